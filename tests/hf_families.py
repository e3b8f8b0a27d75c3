"""Tiny random Hugging Face models of the families ``kernel_ladder`` runs (transformers' own config classes,
float32, eager attention as the reference, seeds fixed), shared by the tests that compare against them.

Each config is the smallest that still has what sets the family apart: Qwen3's QK-norm and a sliding layer,
Qwen3-MoE's dense and sparse layers, Gemma 3's sliding/full layers with their own rope bases,
``query_pre_attn_scalar`` and final logit softcapping, GPT-OSS's sinks, YaRN tables, router bias and clamped
SwiGLU (a ``swiglu_limit`` the activations reach), DeepSeek-V3's latent attention (``qk_head_dim`` 24,
``v_head_dim`` 16, interleaved rope), grouped sigmoid routing with a correction bias, shared experts and a dense
first layer. Weights are drawn wider than transformers' default, and the norm weights, sinks and biases that
it initializes to constants are drawn at random, so that a wrong offset, bias or sink changes the outputs.
"""

from __future__ import annotations

import torch

VOCAB = 64
FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text", "gpt_oss", "deepseek_v3")
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, initializer_range=0.1, attention_dropout=0.0)


#: YaRN stretching 16 original positions 4x (transformers warns when the factor is not max / original positions).
_YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=16, rope_theta=150000.0)


def tiny_config(family: str, **overrides):
    """The tiny config of ``family`` (a ``transformers`` config object), fields overridden by ``overrides``."""
    import transformers as t

    make = {
        "qwen3": lambda: t.Qwen3Config(**_COMMON, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                       use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**_COMMON, intermediate_size=48, moe_intermediate_size=16,
                                              num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=True, mlp_only_layers=[0]),
        "gemma3_text": lambda: t.Gemma3TextConfig(**_COMMON, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                                  sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                                  query_pre_attn_scalar=12, final_logit_softcapping=3.0),
        "gpt_oss": lambda: t.GptOssConfig(**_COMMON, intermediate_size=16, num_key_value_heads=2, head_dim=8,
                                          num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                          swiglu_limit=0.3, rope_parameters=_YARN),
        "deepseek_v3": lambda: t.DeepseekV3Config(**_COMMON, intermediate_size=48, moe_intermediate_size=16,
                                                  num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
                                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                  routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16,
                                                  q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                                  v_head_dim=16, rope_interleave=True),
    }[family]
    config = make()
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 causal LM of ``family`` in eval mode, eager attention and experts (transformers' reference code)."""
    import transformers as t

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            # transformers initializes these to constants (norm weights to 1 or 0, biases and sinks to 0)
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection-only bias
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))
    if hasattr(model, "set_experts_implementation") and getattr(config, "_experts_implementation", None) not in (
            None, "eager"):
        model.set_experts_implementation("eager")
    return model
