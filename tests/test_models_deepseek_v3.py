"""kernel_ladder.models' DeepSeek-V3 against Hugging Face's ``DeepseekV3ForCausalLM`` (tiny random configs,
fp32, eager): logits, loss and every parameter's gradient — multi-head latent attention with and without the
low-rank query, interleaved and rotate-half rope; the cache's bytes per token against GQA and MHA caches of
the same model, computed exactly."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_ladder.models import CausalLM, CausalLMConfig  # noqa: E402
from kernel_ladder.models.deepseek_v3 import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    cache_bytes_per_token,
)

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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare(hf, ours, ids: torch.Tensor) -> None:
    labels = ids.clone()
    labels[0, :2] = -100  # ignored positions
    with torch.no_grad():
        assert _rel(ours(ids), hf(ids).logits) < 1e-4
    theirs = hf(ids, labels=labels).loss
    mine = ours(ids, labels=labels)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    theirs.backward()
    mine.backward()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert set(hf_params) == set(our_params)
    for name, p in hf_params.items():
        assert _rel(our_params[name].grad, p.grad) < 1e-3, name


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
    _compare(hf, ours, torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)))


def test_the_rope_layout_is_seen():  # negative control: the comparison sees which features are paired
    hf = hf_model()
    ours = CausalLM.from_hf(hf)
    ours.config.rope_interleave = False
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(ours(ids), hf(ids).logits) > 1e-3


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
    gqa = cache_bytes_per_token(real, kind="gqa", num_kv_heads=8)
    mha = cache_bytes_per_token(real, kind="mha")
    assert latent == 61 * (512 + 64) * 2 == 70_272
    assert gqa == 61 * 8 * (192 + 128) * 2 == 312_320
    assert mha == 61 * 128 * (192 + 128) * 2 == 4_997_120
    assert round(gqa / latent, 1) == 4.4 and round(mha / latent, 1) == 71.1  # the module docstring's table
    # The tiny test model in fp32: 2 layers, latent 16 + 8 against 4 heads of 16 + 16.
    tiny = CausalLMConfig.from_hf(_config())
    assert cache_bytes_per_token(tiny, 4) == 2 * 24 * 4 == 192
    assert cache_bytes_per_token(tiny, 4, kind="mha") == 2 * 4 * 32 * 4 == 1024
    assert cache_bytes_per_token(tiny, 4, kind="gqa", num_kv_heads=1) == 2 * 32 * 4 == 256
    with pytest.raises(ValueError, match="num_kv_heads"):
        cache_bytes_per_token(real, kind="gqa")
    with pytest.raises(ValueError, match="kind"):
        cache_bytes_per_token(real, kind="mqa")
