"""kernel_ladder.models' DeepSeek-V3 against Hugging Face's ``DeepseekV3ForCausalLM`` (tiny random configs,
fp32, eager): logits, loss and every parameter's gradient — multi-head latent attention with and without the
low-rank query, interleaved and rotate-half rope; the cache's bytes per token against GQA and MHA caches of
the same model, computed exactly."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_ladder.models import CausalLM, CausalLMConfig, Engine  # noqa: E402
from kernel_ladder.models.deepseek_v3 import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    cache_bytes_per_token,
)
from tests.helpers import assert_equals_hugging_face, hf_greedy, rel_error  # noqa: E402

VOCAB = 64


def _config(**overrides):
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=2, topk_group=1,
                 num_experts_per_tok=2, first_k_dense_replace=2, max_position_embeddings=64)
    sizes.update(overrides)
    return transformers.DeepseekV3Config(**sizes)


def hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(**overrides)).float().eval()


DENSE = {
    "low-rank q, interleaved rope": dict(),
    "q_proj, rotate-half rope": dict(q_lora_rank=None, rope_interleave=False),
}


@pytest.mark.parametrize("overrides", DENSE.values(), ids=DENSE.keys())
def test_dense_layers_equal_hugging_face(overrides):
    hf = hf_model(**overrides)
    ours = CausalLM.from_hf(hf)
    assert isinstance(ours, DeepseekV3ForCausalLM)
    assert hasattr(ours.model.layers[0].self_attn, "q_proj") == (overrides.get("q_lora_rank", 24) is None)
    assert_equals_hugging_face(hf, ours, torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)),
                               ignored=2)


# Everything at once: MoE layers after a dense one (grouped, bias-corrected sigmoid routing, shared
# experts), keys wider than values (qk 8 + 8, v 12), YaRN with mscale_all_dim.
FULL = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, n_shared_experts=2, routed_scaling_factor=2.5, v_head_dim=12,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 0.8, "original_max_position_embeddings": 16, "beta_fast": 32,
                             "beta_slow": 1})


def full_model(seed: int = 0):
    """FULL with a router that decides (weights and selection biases far from HF's zero/near-zero init)."""
    hf = hf_model(seed, **FULL)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in hf.model.layers[FULL["first_k_dense_replace"]:]:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator))
            layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.randn(8, generator=generator))
    return hf


def test_moe_layers_wide_keys_and_yarn_equal_hugging_face():
    hf = full_model()
    ours = CausalLM.from_hf(hf)
    assert ours.config.rope_scaling["rope_type"] == "yarn" and ours.config.softmax_scale != 16 ** -0.5
    assert_equals_hugging_face(hf, ours, torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)),
                               ignored=2)


def test_bf16_runs_the_same_model():  # the router stays in fp32; attention, experts and cache in bf16
    hf = full_model()
    ours = CausalLM.from_hf(hf).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = ours(ids)
        assert logits.dtype == torch.bfloat16 and rel_error(logits.float(), hf(ids).logits) < 3e-2


def test_the_selection_bias_is_seen():  # negative control: routing without e_score_correction_bias differs
    hf = full_model()
    ours = CausalLM.from_hf(hf)
    for layer in ours.model.layers[FULL["first_k_dense_replace"]:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) > 1e-3


def test_engine_serves_the_latent_cache_token_for_token_as_hugging_face_generates():
    hf = full_model(seed=5)
    ours = CausalLM.from_hf(hf)
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(0, VOCAB, (19,), generator=generator).tolist()  # 19 tokens > the step budget of 8
    second = first[:16] + torch.randint(0, VOCAB, (3,), generator=generator).tolist()  # two blocks shared
    engine = Engine(ours, num_blocks=12, block_size=8, max_tokens_per_step=8)
    c = ours.config
    assert engine.cache.latent.shape == (c.num_hidden_layers, 12, 8, c.kv_lora_rank + c.qk_rope_head_dim)
    assert engine.cache.bytes_per_token() == cache_bytes_per_token(c, dtype=torch.float32) == 3 * (16 + 8) * 4
    out = engine.generate([first, second], max_new_tokens=5)
    assert engine.stats.cached_prompt_tokens == 16
    assert out == [hf_greedy(hf, prompt, 5) for prompt in (first, second)]


def test_the_rope_layout_is_seen():  # negative control: the comparison sees which features are paired
    hf = hf_model()
    ours = CausalLM.from_hf(hf)
    ours.config.rope_interleave = False
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) > 1e-3


def test_the_config_reads_hugging_face_names():
    c = CausalLMConfig.from_hf(_config(first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=False))
    assert isinstance(c, DeepseekV3Config)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.v_head_dim, c.latent_dim) == (24, 16, 16, 16, 24)
    assert (c.n_group, c.topk_group, c.num_experts_per_tok, c.first_k_dense_replace) == (2, 1, 2, 1)
    assert c.routed_scaling_factor == 2.5 and not c.norm_topk_prob and c.rope_interleave and c.rope_scaling is None
    assert c.softmax_scale == 16 ** -0.5
    with pytest.raises(ValueError, match="hidden_act"):
        DeepseekV3Config.from_hf(_config(hidden_act="gelu"))


def test_cache_bytes_per_token_latent_against_gqa_and_mha():
    # The real DeepSeek-V3: 61 layers, 128 heads, kv_lora_rank 512, rope 64, qk 192 / v 128, bf16.
    real = DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                            num_attention_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, q_lora_rank=1536, moe_intermediate_size=2048, n_routed_experts=256,
                            n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                            routed_scaling_factor=2.5, first_k_dense_replace=3)
    latent = cache_bytes_per_token(real)
    gqa = cache_bytes_per_token(real, "gqa", num_kv_heads=8)
    mha = cache_bytes_per_token(real, "mha")
    assert latent == 61 * (512 + 64) * 2 == 70_272
    assert gqa == 61 * 8 * (192 + 128) * 2 == 312_320
    assert mha == 61 * 128 * (192 + 128) * 2 == 4_997_120
    assert round(gqa / latent, 1) == 4.4 and round(mha / latent, 1) == 71.1  # the module docstring's table
    # The tiny test model in fp32: 2 layers, latent 16 + 8 against 4 heads of 16 + 16.
    tiny = CausalLMConfig.from_hf(_config())
    assert cache_bytes_per_token(tiny, dtype=torch.float32) == 2 * 24 * 4 == 192
    assert cache_bytes_per_token(tiny, "mha", dtype=4) == 2 * 4 * 32 * 4 == 1024
    assert cache_bytes_per_token(tiny, "gqa", dtype=torch.float32, num_kv_heads=1) == 2 * 32 * 4 == 256
    with pytest.raises(ValueError, match="num_kv_heads"):
        cache_bytes_per_token(real, "gqa")
    with pytest.raises(ValueError, match="kind"):
        cache_bytes_per_token(real, "latent")


def test_a_saved_checkpoint_loads_through_causal_lm_from_pretrained(tmp_path):
    hf = hf_model(seed=3)
    hf.save_pretrained(tmp_path)
    ours = CausalLM.from_pretrained(tmp_path)
    assert isinstance(ours, DeepseekV3ForCausalLM)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) < 1e-4


def test_multi_token_prediction_layers_in_a_checkpoint_are_ignored():
    # DeepSeek-V3's checkpoints carry the MTP module as layer num_hidden_layers (model.layers.61.*), which
    # HF's DeepseekV3ForCausalLM does not build and skips on load; so do we. Other stray keys are refused.
    hf = hf_model(seed=7)
    ours = DeepseekV3ForCausalLM(CausalLMConfig.from_hf(hf.config))
    state = dict(hf.state_dict())
    state["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
    state["model.layers.2.shared_head.norm.weight"] = torch.zeros(32)
    ours.load_hf_state_dict(state)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) < 1e-4
    state["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected model\.extra\.weight"):
        ours.load_hf_state_dict(state)
