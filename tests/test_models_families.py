"""kernel_ladder.models.CausalLM and Engine for Qwen3, Qwen3-MoE, Gemma 3 and GPT-OSS against Hugging Face's own
models (tiny random configs, fp32, eager attention): logits, loss and every parameter's gradient, and the
engine's greedy output token for token against HF's greedy ``generate`` — prompts batched together, one
longer than the step budget (chunked prefill) and longer than the sliding windows.

Every norm weight, bias and sink gets noise on top of HF's initialization (which sets them to ones or
zeros), so that a norm's offset, a missing bias or a sink read as zero shows in the comparison."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_ladder.models import CausalLM, CausalLMConfig, Engine  # noqa: E402
from tests.helpers import assert_equals_hugging_face, hf_greedy, random_prompts, rel_error  # noqa: E402

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)


def _configs() -> dict:
    t = transformers
    return {
        # layer 1 slides (window 4), biases on every attention projection
        "qwen3": lambda: t.Qwen3Config(**SMALL, attention_bias=True, use_sliding_window=True, sliding_window=4,
                                       max_window_layers=1),
        # layer 0 an MoE of 4 experts (top 2, renormalized), layer 1 a dense MLP (mlp_only_layers)
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                              norm_topk_prob=True, mlp_only_layers=[1]),
        # a local layer (window 4, base 10^4) and a global one (base 10^6, linear scaling); query_pre_attn_scalar
        # != head_dim; final soft-capping. attn_logit_softcapping is set but HF's Gemma 3 never applies it
        "gemma3_text": lambda: t.Gemma3TextConfig(
            **SMALL, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
            attn_logit_softcapping=0.5,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
        # sliding (window 4) then full, sinks, YaRN, 4 experts (top 2) with biases and the clamped SwiGLU
        "gpt_oss": lambda: t.GptOssConfig(
            **SMALL, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}),
    }


FAMILIES = ["qwen3", "qwen3_moe", "gemma3_text", "gpt_oss"]


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_configs()[family](), attn_implementation="eager")
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(0.3 * torch.randn_like(p))
    return hf


_MODELS: dict[str, tuple] = {}


def models(family: str):
    """(HF's model, ours) for ``family``, built once per module."""
    if family not in _MODELS:
        hf = hf_model(family)
        _MODELS[family] = hf, CausalLM.from_hf(hf)
    return _MODELS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_equal_hugging_face(family):
    hf, ours = models(family)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))  # 11 > every window
    assert_equals_hugging_face(hf, ours, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_hugging_face(family):
    """Three prompts batched; the 13-token one is longer than the step budget (8: prefilled in chunks) and than
    every sliding window (4), and the decodes run past the windows too."""
    hf, ours = models(family)
    prompts = random_prompts((5, 13, 2), VOCAB, seed=3)
    engine = Engine(ours, num_blocks=16, block_size=8, max_tokens_per_step=8)
    out = engine.generate(prompts, max_new_tokens=6)
    assert engine.stats.max_batch == 3 and engine.stats.preemptions == 0
    assert out == [hf_greedy(hf, p, 6) for p in prompts]


# ----------------------------------------------------------------------------------------------
# Negative controls: the comparisons see each feature
# ----------------------------------------------------------------------------------------------


def _break_qk_norm(model):
    for layer in model.model.layers:
        layer.self_attn.q_norm = None


def _break_norm_offset(model):
    for layer in model.model.layers:
        layer.offset = 0.0


def _break_local_rope(model):
    for layer in model.model.layers:
        layer.self_attn.rope_key = "full_attention"


def _break_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.sinks = None


def _break_swiglu_limit(model):
    for layer in model.model.layers:
        layer.mlp.limit = 1e4


@pytest.mark.parametrize("family, breaks", [("qwen3", _break_qk_norm), ("gemma3_text", _break_norm_offset),
                                            ("gemma3_text", _break_local_rope), ("gpt_oss", _break_sinks),
                                            ("gpt_oss", _break_swiglu_limit)])
def test_a_feature_left_out_is_caught(family, breaks):
    hf = hf_model(family)
    ours = CausalLM.from_hf(hf)
    breaks(ours)
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) > 1e-3


# ----------------------------------------------------------------------------------------------
# Configs: what each family reads, and what is refused by name
# ----------------------------------------------------------------------------------------------


def test_the_config_reads_each_family():
    qwen3 = CausalLMConfig.from_hf(_configs()["qwen3"]())
    assert qwen3.qk_norm and qwen3.qkv_bias and qwen3.o_bias and qwen3.windows == [None, 4]
    moe = CausalLMConfig.from_hf(_configs()["qwen3_moe"]())
    assert moe.moe_layers == [True, False] and moe.num_experts == 4 and moe.moe_intermediate_size == 24
    sparse_step = CausalLMConfig.from_hf(transformers.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                                         decoder_sparse_step=2))
    assert sparse_step.moe_layers == [False, True]
    gemma = CausalLMConfig.from_hf(_configs()["gemma3_text"]())
    assert gemma.norm_offset == 1.0 and gemma.sandwich_norms and gemma.embed_scale == 32**0.5
    assert gemma.attn_scale == 24**-0.5 and gemma.final_softcap == 3.0 and gemma.attn_softcap is None
    assert gemma.windows == [4, None] and gemma.rope_by_layer_type == {
        "sliding_attention": {"rope_theta": 10000.0},
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}}
    oss = CausalLMConfig.from_hf(_configs()["gpt_oss"]())
    assert oss.attention_sinks and oss.moe_style == "gpt_oss" and oss.moe_layers == [True, True]
    assert oss.windows == [4, None] and oss.rope_scaling["rope_type"] == "yarn" and oss.o_bias


def test_what_a_family_config_asks_for_and_is_not_implemented_is_refused():
    t = transformers
    with pytest.raises(ValueError, match=r"gemma3_text config: use_bidirectional_attention \(attention is causal "
                                         r"here\) is not supported"):
        CausalLMConfig.from_hf(t.Gemma3TextConfig(**SMALL, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"qwen3 config: rope_type 'dynamic' \(supported: default, linear, llama3, "
                                         r"yarn\) is not supported"):
        CausalLMConfig.from_hf(t.Qwen3Config(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match=r"model_type 'gemma3' is not supported; .*load its text model, "
                                         r"Gemma3ForCausalLM"):
        CausalLMConfig.from_hf({"model_type": "gemma3"})
