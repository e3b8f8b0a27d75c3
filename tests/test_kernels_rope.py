"""kernel_ladder.rope and kernel_ladder.rope_cos_sin: values against float64 transcriptions of Hugging Face's code
(and HF itself when transformers is installed), layouts, GQA/MQA, partial and interleaved rotary,
dtypes, the backward, traffic, custom-op plumbing, errors.

Outputs are poisoned (NaN) before the kernel writes them; inputs are fresh random draws.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DTYPES, assert_matches

import kernel_ladder
from kernel_ladder.ops import rope as rope_module
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE


def rand(*shape, gen, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------- float64 references


def rotate_half(x):
    """HF's rotate_half (Llama, Mistral, Qwen, GPT-NeoX)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """HF's GPT-J rotate_every_two: pairs (2j, 2j + 1)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def reference(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    """apply_rotary_pos_emb in float64, with GPT-NeoX's partial rotary (the first R features)."""
    q, k = q.double(), k.double()
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    rot = rotate_every_two if interleaved else rotate_half
    r = cos.shape[-1]

    def apply(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat((x_rot * cos + rot(x_rot) * sin, x_pass), dim=-1)

    return apply(q), apply(k)


def tables(batch, seq_len, rotary, gen, interleaved=False, dtype=torch.float32, shared=False):
    """cos/sin from random positions (a batch may hold different positions per sequence)."""
    positions = torch.randint(0, 4096, (1 if shared else batch, seq_len), generator=gen).to(DEVICE)
    return kernel_ladder.rope_cos_sin(positions, rotary, base=10000.0, dtype=dtype, interleaved=interleaved)


def fused_qkv(batch, seq_len, hq, hk, d, gen, dtype=torch.float32):
    """q (B, Hq, T, D) and k (B, Hk, T, D) as views of one (B, T, (Hq + 2 Hk) * D) projection."""
    qkv = rand(batch, seq_len, (hq + 2 * hk) * d, gen=gen, dtype=dtype)
    q = qkv[..., : hq * d].view(batch, seq_len, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hk) * d].view(batch, seq_len, hk, d).transpose(1, 2)
    return qkv, q, k


# ----------------------------------------------------------------------------- values


CASES = [  # (B, Hq, Hk, T, D, R): GQA, MQA, non-power-of-two heads and dims, partial rotary
    (2, 4, 2, 7, 16, 16),
    (1, 3, 1, 9, 80, 80),
    (2, 2, 2, 5, 64, 32),
    (3, 5, 5, 1, 96, 24),
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_float64_reference(case, interleaved, gen):
    batch, hq, hk, seq_len, d, r = case
    _, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen)
    cos, sin = tables(batch, seq_len, r, gen, interleaved)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, interleaved=interleaved)
    want_q, want_k = reference(q, k, cos, sin, interleaved=interleaved)
    assert_matches(q_embed, want_q, torch.float32, what="q_embed")
    assert_matches(k_embed, want_k, torch.float32, what="k_embed")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table_dtype", [torch.float32, "same"], ids=["fp32 tables", "tables in q's dtype"])
def test_dtypes(dtype, table_dtype, gen):
    _, q, k = fused_qkv(2, 6, 4, 2, 32, gen, dtype=dtype)
    cos, sin = tables(2, 6, 32, gen, dtype=dtype if table_dtype == "same" else table_dtype)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
    want_q, want_k = reference(q, k, cos, sin)
    assert_matches(q_embed, want_q, dtype)
    assert_matches(k_embed, want_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float64_tables_are_read_in_float32(dtype, gen):
    """float64 cos/sin (a float64 rotary embedding's) are accepted and read in float32, as the kernel
    computes: the same bits as tables rounded to float32 first, forward and backward."""
    _, q, k = fused_qkv(2, 6, 4, 2, 32, gen, dtype=dtype)
    positions = torch.randint(0, 4096, (2, 6), generator=gen, dtype=torch.float64)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    angles = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1)  # HF's emb = cat(freqs, freqs), in float64
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    assert not torch.equal(cos.float().double(), cos)  # values float32 cannot hold: the rounding is exercised
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
    want_q, want_k = reference(q.detach(), k.detach(), cos, sin)
    assert q_embed.dtype == dtype
    assert_matches(q_embed, want_q, dtype)
    assert_matches(k_embed, want_k, dtype)
    q32_embed, k32_embed = kernel_ladder.rope(q, k, cos.float(), sin.float())
    assert torch.equal(q_embed, q32_embed) and torch.equal(k_embed, k32_embed)
    g_q, g_k = rand(*q.shape, gen=gen, dtype=dtype), rand(*k.shape, gen=gen, dtype=dtype)
    grads = torch.autograd.grad((q_embed, k_embed), (q, k), (g_q, g_k))
    grads32 = torch.autograd.grad((q32_embed, k32_embed), (q, k), (g_q, g_k))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads32))


@pytest.mark.parametrize("shape", ["(B, T, R)", "(1, T, R)", "(T, R)"])
def test_table_shapes_broadcast_over_the_batch(shape, gen):
    _, q, k = fused_qkv(3, 5, 2, 1, 16, gen)
    cos, sin = tables(3, 5, 16, gen, shared=shape != "(B, T, R)")
    if shape == "(T, R)":
        cos, sin = cos[0], sin[0]
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
    want_q, want_k = reference(q, k, cos, sin)
    assert_matches(q_embed, want_q, torch.float32)
    assert_matches(k_embed, want_k, torch.float32)


def test_b_t_h_d_layout_with_unsqueeze_dim_2(gen):
    """(B, T, H, D) straight from the projection's view, cos/sin unsqueezed at dim 2, as in HF."""
    qkv = rand(2, 7, (4 + 2) * 16, gen=gen)
    q = qkv[..., :64].view(2, 7, 4, 16)
    k = qkv[..., 64:].view(2, 7, 2, 16)
    cos, sin = tables(2, 7, 16, gen)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim=2)
    want_q, want_k = reference(q, k, cos, sin, unsqueeze_dim=2)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    assert_matches(q_embed, want_q, torch.float32)
    assert_matches(k_embed, want_k, torch.float32)


def test_empty_and_single_token(gen):
    for seq_len in (0, 1):
        _, q, k = fused_qkv(2, seq_len, 2, 1, 8, gen)
        cos, sin = tables(2, seq_len, 8, gen)
        q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
        want_q, want_k = reference(q, k, cos, sin)
        assert_matches(q_embed, want_q, torch.float32)
        assert_matches(k_embed, want_k, torch.float32)


# ----------------------------------------------------------------------------- Hugging Face itself


def test_matches_hugging_face_apply_rotary_pos_emb_and_rotary_module(gen):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    for rope_scaling in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}):
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512, rope_theta=500000.0, rope_scaling=rope_scaling)
        rotary = llama.LlamaRotaryEmbedding(config).to(DEVICE)
        positions = torch.randint(0, 512, (2, 9), generator=gen).to(DEVICE)
        x = rand(2, 9, 64, gen=gen)
        hf_cos, hf_sin = rotary(x, positions)
        cos, sin = kernel_ladder.rope_cos_sin(positions, 16, base=500000.0, scaling=rope_scaling)
        assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin), rope_scaling
        _, q, k = fused_qkv(2, 9, 4, 2, 16, gen)
        hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
        q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
        # fp32 in both, the same products and sums: equal to the last bit (or within one ulp).
        torch.testing.assert_close(q_embed, hf_q, rtol=2e-7, atol=1e-7)
        torch.testing.assert_close(k_embed, hf_k, rtol=2e-7, atol=1e-7)


def test_llama3_scaling_changes_only_the_long_wavelengths():
    positions = torch.arange(8, device=DEVICE)
    plain = rope_module._inverse_frequencies(64, 500000.0, None, DEVICE)
    scaled = rope_module._inverse_frequencies(
        64, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}, DEVICE)
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # short: kept
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)  # long: divided
    assert kernel_ladder.rope_cos_sin(positions, 64)[0].shape == (8, 64)


GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}


def _gpt_oss_rotary(rope_parameters):
    module = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_hidden_layers=2, intermediate_size=32, vocab_size=64, num_local_experts=4,
                          rope_parameters=dict(rope_parameters))
    return module.GptOssRotaryEmbedding(config).to(DEVICE), 16


def _deepseek_rotary(rope_parameters):
    module = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=24,
                              num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16, vocab_size=64,
                              n_routed_experts=4, max_position_embeddings=163840,
                              rope_parameters=dict(rope_parameters))
    return module.DeepseekV3RotaryEmbedding(config).to(DEVICE), 8, module, config


@pytest.mark.parametrize("variant", ["gpt_oss", "gpt_oss truncated", "deepseek_v3", "deepseek_v3 mscale 0.707"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_yarn_tables_match_hugging_face_rotary_modules(variant, dtype, gen):
    """HF's GptOssRotaryEmbedding and DeepseekV3RotaryEmbedding of tiny configs (YaRN with GPT-OSS's
    truncate=False, DeepSeek-V3's mscale / mscale_all_dim): the same cos and sin, attention factor included.
    GPT-OSS's module returns the R/2 frequencies once (its rotation pairs the halves): ours repeat them."""
    if variant.startswith("gpt_oss"):
        params = dict(GPT_OSS_YARN, truncate=variant.endswith("truncated"))
        rotary, width = _gpt_oss_rotary(params)
    else:
        params = dict(DEEPSEEK_YARN, mscale=0.707) if variant.endswith("0.707") else DEEPSEEK_YARN
        rotary, width = _deepseek_rotary(params)[:2]
    assert rotary.attention_scaling != 1.0 or variant == "deepseek_v3"  # mscale == mscale_all_dim: the ratio is 1
    positions = torch.randint(0, 160000, (2, 9), generator=gen).to(DEVICE)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=dtype, device=DEVICE), positions)
    theta = params["rope_theta"]
    cos, sin = kernel_ladder.rope_cos_sin(positions, width, base=theta, scaling=params, dtype=dtype)
    if hf_cos.shape[-1] == width // 2:
        hf_cos, hf_sin = torch.cat([hf_cos, hf_cos], -1), torch.cat([hf_sin, hf_sin], -1)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)
    plain_cos, _ = kernel_ladder.rope_cos_sin(positions, width, base=theta)
    assert not torch.allclose(cos.float(), plain_cos, atol=1e-3)  # negative control: YaRN changes the tables


def test_yarn_get_mscale_gives_deepseek_attention_scale():
    """DeepSeek-V3's softmax scale is qk_head_dim**-0.5 * yarn_get_mscale(factor, mscale_all_dim)**2 (HF's
    DeepseekV3Attention.scaling); the helper is HF's Eq. 21 of the YaRN paper, 1 for a factor <= 1."""
    _, _, module, config = _deepseek_rotary(dict(DEEPSEEK_YARN, mscale_all_dim=0.8))
    attention = module.DeepseekV3Attention(config, layer_idx=0)
    want = config.qk_head_dim**-0.5 * rope_module.yarn_get_mscale(40.0, 0.8) ** 2
    assert attention.scaling == pytest.approx(want, rel=1e-12)
    assert rope_module.yarn_get_mscale(40.0) == pytest.approx(0.1 * math.log(40.0) + 1.0, rel=1e-12)
    assert rope_module.yarn_get_mscale(1.0, 0.707) == 1.0 and rope_module.yarn_get_mscale(0.5) == 1.0


def test_yarn_keeps_high_frequencies_and_divides_low_ones():
    """The ramp between the correction dims: the fastest pairs keep their frequency, the slowest are divided
    by the factor (interpolated), whatever the attention factor."""
    plain = rope_module._inverse_frequencies(64, 10000.0, None, DEVICE)
    yarn = rope_module._inverse_frequencies(64, 10000.0, dict(DEEPSEEK_YARN, factor=16.0), DEVICE)
    assert torch.equal(yarn[:4], plain[:4])
    torch.testing.assert_close(yarn[-4:], plain[-4:] / 16.0, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_backward_matches_float64_autograd(case, interleaved, gen):
    batch, hq, hk, seq_len, d, r = case
    qkv, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen)
    cos, sin = tables(batch, seq_len, r, gen, interleaved)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, interleaved=interleaved)
    g_q, g_k = rand(*q_embed.shape, gen=gen), rand(*k_embed.shape, gen=gen)
    dq, dk = torch.autograd.grad((q_embed, k_embed), (q, k), (g_q, g_k))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want_q, want_k = reference(q64, k64, cos, sin, interleaved=interleaved)
    tq, tk = torch.autograd.grad((want_q, want_k), (q64, k64), (g_q.double(), g_k.double()))
    assert_matches(dq, tq, torch.float32, what="dq")
    assert_matches(dk, tk, torch.float32, what="dk")


def test_backward_with_only_q_in_the_loss(gen):
    _, q, k = fused_qkv(2, 4, 2, 1, 16, gen)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = tables(2, 4, 16, gen)
    q_embed, _ = kernel_ladder.rope(q, k, cos, sin)
    (q_embed * 2).sum().backward()
    q64 = q.detach().double().requires_grad_()
    (reference(q64, k.detach(), cos, sin)[0] * 2).sum().backward()
    assert_matches(q.grad, q64.grad, torch.float32)
    assert k.grad is None or not k.grad.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_backward_half_precision(dtype, gen):
    _, q, k = fused_qkv(2, 3, 2, 2, 32, gen, dtype=dtype)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = tables(2, 3, 32, gen)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
    g_q, g_k = rand(*q.shape, gen=gen, dtype=dtype), rand(*k.shape, gen=gen, dtype=dtype)
    dq, dk = torch.autograd.grad((q_embed, k_embed), (q, k), (g_q, g_k))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    tq, tk = torch.autograd.grad(reference(q64, k64, cos, sin), (q64, k64), (g_q.double(), g_k.double()))
    assert_matches(dq, tq, dtype)
    assert_matches(dk, tk, dtype)


# ----------------------------------------------------------------------------- traffic, plumbing


@pytest.mark.interpreter
@pytest.mark.parametrize("table", ["(B, T, R)", "(T, R)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_launch_reads_q_k_and_the_tables_once(dtype, table, gen):
    """q and k straight from a fused qkv view: one launch, every element of q, k, cos, sin read once
    (a (T, R) table once for the whole batch), every output written once (the ideal), and no copy."""
    batch, hq, hk, seq_len, d = 3, 4, 2, 6, 32
    _, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen, dtype=dtype)
    cos, sin = tables(batch, seq_len, d, gen, shared=table == "(T, R)")
    if table == "(T, R)":
        cos, sin = cos[0], sin[0]
    with trace() as t:
        q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin)
    assert t.num_launches == 1 and t.launches[0].kernel == "rope_kernel"
    element = q.element_size()
    ideal = 2 * (q.numel() + k.numel()) * element + 2 * cos.numel() * cos.element_size()
    assert t.bytes == ideal, (t.bytes, ideal)


@pytest.mark.interpreter
@pytest.mark.parametrize("norms", [False, True], ids=["rope", "with QK-norm"])
def test_backward_launches_and_bytes(norms, gen):
    """The backward is one rope_kernel launch reading the gradients and the tables once and writing dq, dk once
    (nothing else: no placeholder copies); with the norms it also reads q, k (for rstd) and each weight once a
    program, writes one fp32 partial row a program per weight, and adds the rows up in one launch per weight."""
    batch, hq, hk, seq_len, d = 2, 4, 2, 6, 32
    _, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen)
    cos, sin = tables(batch, seq_len, d, gen)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    weights = (norm_weight(d, gen).requires_grad_(), norm_weight(d, gen).requires_grad_()) if norms else (None, None)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, q_norm_weight=weights[0], k_norm_weight=weights[1])
    g_q, g_k = rand(*q.shape, gen=gen), rand(*k.shape, gen=gen)
    leaves = (q, k, *weights) if norms else (q, k)
    with trace() as t:
        torch.autograd.grad((q_embed, k_embed), leaves, (g_q, g_k))
    launches = [launch.kernel for launch in t.launches]
    ideal = 2 * (q.numel() + k.numel()) * 4 + 2 * cos.numel() * 4
    assert t.num_launches == len(launches), t.table()  # no torch kernel (a copy, a fill) beside them
    if not norms:
        assert launches == ["rope_kernel"], launches
        assert t.bytes == ideal, (t.bytes, ideal)
    else:
        assert launches == ["rope_kernel", "column_sum_kernel", "column_sum_kernel"], launches
        programs = t.launches[0].grid[0]
        rope_bytes = ideal + (q.numel() + k.numel()) * 4 + programs * 2 * d * 4 * 2  # inputs; weights, partials
        assert t.launches[0].bytes == rope_bytes, (t.launches[0].bytes, rope_bytes)


def test_opcheck_and_torch_compile(gen):
    _, q, k = fused_qkv(2, 3, 2, 1, 16, gen)
    cos, sin = tables(2, 3, 16, gen)
    torch.library.opcheck(torch.ops.kernel_ladder.rope.default, (q, k, cos, sin, 1, False))
    torch.library.opcheck(torch.ops.kernel_ladder.rope.default, (q, k, cos, sin, 1, True))
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    compiled = torch.compile(lambda a, b: kernel_ladder.rope(a, b, cos, sin), fullgraph=True)
    q_embed, k_embed = compiled(q, k)
    want_q, want_k = kernel_ladder.rope(q, k, cos, sin)
    torch.testing.assert_close(q_embed, want_q, rtol=0, atol=0)
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad is not None and k.grad is not None


def test_double_backward_is_refused_clearly(gen):
    _, q, k = fused_qkv(1, 2, 1, 1, 8, gen)
    q = q.detach().requires_grad_()
    cos, sin = tables(1, 2, 8, gen)
    (dq,) = torch.autograd.grad(kernel_ladder.rope(q, k, cos, sin)[0].pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.rope \(backward\): double backward"):
        dq.sum().backward()


def test_bad_input_errors(gen):
    _, q, k = fused_qkv(2, 5, 4, 2, 16, gen)
    cos, sin = tables(2, 5, 16, gen)
    cases = [
        (lambda: kernel_ladder.rope(q[0], k, cos, sin), ValueError,
         r"kernel_ladder\.rope: q must be 4-D \(B, H, T, D\)"),
        (lambda: kernel_ladder.rope(q, k[..., :8], cos, sin), ValueError, r"q and k must share B, T and D"),
        (lambda: kernel_ladder.rope(q, k, cos[..., :15], sin[..., :15]), ValueError,
         r"R = cos\.shape\[-1\] must be even"),
        (lambda: kernel_ladder.rope(q, k, cos[:, :4], sin[:, :4]), ValueError, r"cos and sin must be \(B, T, R\)"),
        (lambda: kernel_ladder.rope(q, k, cos, sin[..., :8]), ValueError, r"cos and sin must have the same shape"),
        (lambda: kernel_ladder.rope(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)), ValueError,
         r"R = 32 exceeds the head dim D = 16"),
        (lambda: kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim=0), ValueError, r"unsqueeze_dim must be 1"),
        (lambda: kernel_ladder.rope(q, k.half(), cos, sin), TypeError, r"q and k must have the same dtype"),
        (lambda: kernel_ladder.rope(q, k.long(), cos, sin), TypeError, r"k must be float32, float16 or bfloat16"),
        (lambda: kernel_ladder.rope(q.double(), k.double(), cos, sin), TypeError,
         r"q must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: kernel_ladder.rope(q, k, cos.long(), sin), TypeError,
         r"^kernel_ladder\.rope: cos must be float32, float16, bfloat16 or float64, got torch\.int64"),
        (lambda: kernel_ladder.rope(q, k, cos, sin.to(torch.complex64)), TypeError,
         r"^kernel_ladder\.rope: sin must be float32, float16, bfloat16 or float64, got torch\.complex64"),
        (lambda: kernel_ladder.rope(q, k, cos, sin, interleaved=1), TypeError, r"interleaved must be a bool"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4.0), 16), TypeError, r"positions must be an integer tensor"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 15), ValueError, r"head_dim must be a positive even int"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={"rope_type": "longrope"}), ValueError,
         r"rope_type'\] must be one of \('default', 'linear', 'llama3', 'yarn'\), got 'longrope'"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={"rope_type": "yarn", "factor": 4.0}),
         ValueError, r"of rope_type 'yarn' needs \['original_max_position_embeddings'\]"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={
            "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}), ValueError,
         r"needs \['factor'\].*max_position_embeddings / original_max_position_embeddings"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={
            "rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}), ValueError,
         r"partial_rotary_factor'\] = 0\.5 is not applied here: head_dim is the rotary width"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={"rope_type": "llama3", "factor": 8}),
         ValueError, r"needs \['low_freq_factor'"),
    ]
    assert kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={"rope_type": "linear", "factor": 2.0,
                                                                    "partial_rotary_factor": 1.0})[0].shape == (4, 16)
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


# ----------------------------------------------------------------------------- QK-norm fused into the rotation


def qk_norm_reference(x, weight, eps=1e-6, offset=0.0):
    """RMSNorm of each head vector over its D features, in float64: x * rsqrt(mean(x^2) + eps) * (offset + w)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())


def normed_reference(q, k, cos, sin, unsqueeze_dim=1, interleaved=False, q_weight=None, k_weight=None, eps=1e-6,
                     offset=0.0):
    """QK-norm (where a weight is given) then apply_rotary_pos_emb, in float64."""
    q = q.double() if q_weight is None else qk_norm_reference(q, q_weight, eps, offset)
    k = k.double() if k_weight is None else qk_norm_reference(k, k_weight, eps, offset)
    return reference(q, k, cos, sin, unsqueeze_dim, interleaved)


def norm_weight(d, gen, dtype=torch.float32):
    """A norm weight far from 1 (so that a kernel ignoring it fails), of either sign."""
    return (torch.randn(d, generator=gen, dtype=torch.float64) * 0.5 + 1.0).to(dtype).to(DEVICE)


NORM_CASES = [  # (B, Hq, Hk, T, D, R, interleaved, unsqueeze_dim, offset): GQA, odd T, D not a power of two
    (2, 4, 2, 5, 16, 16, False, 1, 0.0),   # Qwen3-like
    (1, 3, 1, 7, 24, 24, True, 1, 1.0),    # Gemma-like (1 + w), interleaved, D = 24
    (2, 2, 2, 3, 40, 32, False, 2, 0.0),   # (B, T, H, D), partial rotary: the norm covers all 40 features
    (3, 5, 5, 1, 80, 80, False, 2, 1.0),
]


@pytest.mark.parametrize("case", NORM_CASES, ids=str)
def test_qk_norm_forward_matches_float64_reference(case, gen):
    batch, hq, hk, seq_len, d, r, interleaved, unsqueeze_dim, offset = case
    qkv, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen)
    if unsqueeze_dim == 2:  # (B, T, H, D) views of the projection
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = tables(batch, seq_len, r, gen, interleaved)
    wq, wk = norm_weight(d, gen), norm_weight(d, gen)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight=wq,
                                          k_norm_weight=wk, norm_eps=1e-5, norm_offset=offset)
    want_q, want_k = normed_reference(q, k, cos, sin, unsqueeze_dim, interleaved, wq, wk, 1e-5, offset)
    assert_matches(q_embed, want_q, torch.float32, what="q_embed")
    assert_matches(k_embed, want_k, torch.float32, what="k_embed")


@pytest.mark.parametrize("which", ["q", "k"])
def test_qk_norm_on_one_tensor_only(which, gen):
    _, q, k = fused_qkv(2, 3, 4, 2, 16, gen)
    cos, sin = tables(2, 3, 16, gen)
    w = norm_weight(16, gen)
    kwargs = {f"{which}_norm_weight": w}
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, **kwargs)
    want_q, want_k = normed_reference(q, k, cos, sin, q_weight=w if which == "q" else None,
                                      k_weight=w if which == "k" else None)
    assert_matches(q_embed, want_q, torch.float32)
    assert_matches(k_embed, want_k, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_dtypes(dtype, gen):
    """Activations and weights in fp32/fp16/bf16 (a bf16 weight with fp32 activations too): one rounding."""
    _, q, k = fused_qkv(2, 3, 4, 2, 32, gen, dtype=dtype)
    cos, sin = tables(2, 3, 32, gen, dtype=dtype)
    wq, wk = norm_weight(32, gen, dtype), norm_weight(32, gen, torch.bfloat16)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk)
    want_q, want_k = normed_reference(q, k, cos, sin, q_weight=wq, k_weight=wk)
    assert_matches(q_embed, want_q, dtype)
    assert_matches(k_embed, want_k, dtype)


def test_qk_norm_non_finite_head_stays_in_its_head_and_zero_head_gives_zero(gen):
    """A NaN (or inf) feature spoils its own head's norm and nothing else; an all-zero head is normalized by
    rsqrt(eps) into zeros (not NaN), and its gradient is finite."""
    _, q, k = fused_qkv(2, 3, 4, 2, 16, gen)
    q, k = q.clone(), k.clone()
    q[0, 1, 2, 5] = float("nan")
    q[1, 3, 0, 0] = float("inf")
    k[1, 0, 1] = 0.0
    cos, sin = tables(2, 3, 16, gen)
    wq, wk = norm_weight(16, gen), norm_weight(16, gen)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk)
    want_q, want_k = normed_reference(q, k, cos, sin, q_weight=wq, k_weight=wk)
    bad = torch.zeros(q.shape, dtype=torch.bool, device=q.device)
    bad[0, 1, 2] = bad[1, 3, 0] = True
    assert torch.isnan(q_embed[0, 1, 2]).all()
    # inf * rsqrt(inf) = inf * 0 is NaN, the head's finite features become 0 (as in float64), the pair
    # partner of the inf feature takes the NaN through the rotation
    assert torch.isnan(q_embed[1, 3, 0]).sum() == 2
    assert torch.isfinite(q_embed[~bad]).all()
    assert_matches(q_embed, want_q, torch.float32, equal_nan=True)
    assert torch.equal(k_embed[1, 0, 1], torch.zeros_like(k_embed[1, 0, 1]))
    assert_matches(k_embed, want_k, torch.float32)
    k_leaf, wk_leaf = k.detach().requires_grad_(), wk.detach().requires_grad_()
    g = rand(*k.shape, gen=gen)
    dk, dwk = torch.autograd.grad(kernel_ladder.rope(q, k_leaf, cos, sin, k_norm_weight=wk_leaf)[1], (k_leaf, wk_leaf),
                                  g)
    k64, wk64 = k.detach().double().requires_grad_(), wk.detach().double().requires_grad_()
    want = torch.autograd.grad(normed_reference(q, k64, cos, sin, k_weight=wk64)[1], (k64, wk64), g.double())
    assert torch.isfinite(dk).all() and dk[1, 0, 1].abs().max() > 100  # rsqrt(1e-6) * g * w
    assert_matches(dk, want[0], torch.float32, what="dk")
    assert_matches(dwk, want[1], torch.float32, what="dwk")


def _hf_attention_norms(family, d, hq, hk, gen):
    """A tiny Qwen3 or Gemma 3 attention: its q_norm/k_norm modules (random weights) and its rotary helper."""
    if family == "qwen3":
        module = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
        from transformers import Qwen3Config

        config = Qwen3Config(hidden_size=32, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                             rms_norm_eps=1e-6, intermediate_size=64, vocab_size=64, num_hidden_layers=1)
        attention = module.Qwen3Attention(config, layer_idx=0)
    else:
        module = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(hidden_size=32, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                                  rms_norm_eps=1e-6, intermediate_size=64, vocab_size=64, num_hidden_layers=1)
        attention = module.Gemma3Attention(config, layer_idx=0)
    with torch.no_grad():
        for norm in (attention.q_norm, attention.k_norm):
            norm.weight.copy_(torch.randn(d, generator=gen) * 0.5 + (0.0 if family == "gemma3" else 1.0))
    return attention.to(DEVICE), module.apply_rotary_pos_emb, 1.0 if family == "gemma3" else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qk_norm_matches_hugging_face_norm_modules_and_rotary(family, dtype, gen):
    """HF's own q_norm/k_norm modules (Qwen3RMSNorm; Gemma3RMSNorm's 1 + w) on the projection viewed
    (B, T, H, D), transposed to (B, H, T, D), then apply_rotary_pos_emb: the values, and in float32 the
    gradients of the input and of both norm weights."""
    batch, seq_len, hq, hk, d = 2, 5, 4, 2, 24
    attention, apply_rotary, offset = _hf_attention_norms(family, d, hq, hk, gen)
    attention = attention.to(dtype)
    qkv = rand(batch, seq_len, (hq + 2 * hk) * d, gen=gen, dtype=dtype).requires_grad_()
    q_bthd = qkv[..., : hq * d].view(batch, seq_len, hq, d)  # (B, T, H, D), as HF's q_proj(x).view(...)
    k_bthd = qkv[..., hq * d : (hq + hk) * d].view(batch, seq_len, hk, d)
    q, k = q_bthd.transpose(1, 2), k_bthd.transpose(1, 2)
    cos, sin = tables(batch, seq_len, d, gen, dtype=dtype)
    hf_q, hf_k = apply_rotary(attention.q_norm(q_bthd).transpose(1, 2), attention.k_norm(k_bthd).transpose(1, 2),
                              cos, sin)
    wq, wk = attention.q_norm.weight, attention.k_norm.weight
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk, norm_eps=1e-6,
                                          norm_offset=offset)
    want_q, want_k = normed_reference(q, k, cos, sin, q_weight=wq, k_weight=wk, offset=offset)
    if dtype == torch.float32:
        torch.testing.assert_close(q_embed, hf_q, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(k_embed, hf_k, rtol=2e-6, atol=2e-6)
        g_q, g_k = rand(*q.shape, gen=gen), rand(*k.shape, gen=gen)
        ours = torch.autograd.grad((q_embed, k_embed), (qkv, wq, wk), (g_q, g_k))
        theirs = torch.autograd.grad((hf_q, hf_k), (qkv, wq, wk), (g_q, g_k))
        for name, a, b in zip(("dqkv", "d q_norm.weight", "d k_norm.weight"), ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # In bf16 HF rounds between the norm, the weight and each product: the fused op is at least as close
    # to float64 (within twice HF's own error).
    assert_matches(q_embed, want_q, dtype, lowp=hf_q)
    assert_matches(k_embed, want_k, dtype, lowp=hf_k)


@pytest.mark.parametrize("case", NORM_CASES[:3], ids=str)
def test_qk_norm_backward_matches_float64_autograd(case, gen):
    batch, hq, hk, seq_len, d, r, interleaved, unsqueeze_dim, offset = case
    _, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = tables(batch, seq_len, r, gen, interleaved)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    wq, wk = norm_weight(d, gen).requires_grad_(), norm_weight(d, gen).requires_grad_()
    out = kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight=wq, k_norm_weight=wk,
                             norm_offset=offset)
    g = (rand(*q.shape, gen=gen), rand(*k.shape, gen=gen))
    got = torch.autograd.grad(out, (q, k, wq, wk), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    want = torch.autograd.grad(normed_reference(leaves[0], leaves[1], cos, sin, unsqueeze_dim, interleaved,
                                                leaves[2], leaves[3], offset=offset), leaves, [x.double() for x in g])
    for name, a, b in zip(("dq", "dk", "d q_norm_weight", "d k_norm_weight"), got, want):
        assert_matches(a, b, torch.float32, what=name, slack=2 if name.startswith("d ") else 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_qk_norm_backward_half_precision(dtype, gen):
    _, q, k = fused_qkv(2, 3, 2, 1, 32, gen, dtype=dtype)
    cos, sin = tables(2, 3, 32, gen)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    wq, wk = norm_weight(32, gen, dtype).requires_grad_(), norm_weight(32, gen, dtype).requires_grad_()
    out = kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk)
    g = (rand(*q.shape, gen=gen, dtype=dtype), rand(*k.shape, gen=gen, dtype=dtype))
    got = torch.autograd.grad(out, (q, k, wq, wk), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    want = torch.autograd.grad(normed_reference(leaves[0], leaves[1], cos, sin, q_weight=leaves[2],
                                                k_weight=leaves[3]), leaves, [x.double() for x in g])
    for name, a, b in zip(("dq", "dk", "dwq", "dwk"), got, want):
        assert a.dtype == dtype
        assert_matches(a, b, dtype, what=name, slack=2)


def test_qk_norm_weight_gradients_are_deterministic_sums_of_program_partials(gen):
    """More tokens than programs (several per program, several partial rows): the same bits on every run,
    and the weight gradient only where the weight asks for one."""
    _, q, k = fused_qkv(2, 9, 2, 1, 16, gen)
    cos, sin = tables(2, 9, 16, gen)
    q = q.detach().requires_grad_()
    wq, wk = norm_weight(16, gen).requires_grad_(), norm_weight(16, gen)
    g = (rand(*q.shape, gen=gen), rand(*k.shape, gen=gen))
    runs = [torch.autograd.grad(kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk)[0], (q, wq),
                                g[0]) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    q64, wq64 = q.detach().double().requires_grad_(), wq.detach().double().requires_grad_()
    want = torch.autograd.grad(normed_reference(q64, k, cos, sin, q_weight=wq64, k_weight=wk)[0], (q64, wq64),
                               g[0].double())
    assert_matches(runs[0][1], want[1], torch.float32, slack=2)
    q_embed, k_embed = kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk)
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad is not None and wq.grad is not None and wk.grad is None and not wk.requires_grad


@pytest.mark.interpreter
def test_qk_norm_fused_traffic_against_separate_norms_and_rope(gen):
    """The fused launch reads q, k and the tables once and writes each output once, plus each norm weight
    once per program; rms_norm(q), rms_norm(k) then rope write the normalized q and k and read them back."""
    batch, hq, hk, seq_len, d = 2, 4, 2, 6, 32
    _, q, k = fused_qkv(batch, seq_len, hq, hk, d, gen, dtype=torch.bfloat16)
    cos, sin = tables(batch, seq_len, d, gen, dtype=torch.bfloat16)
    wq, wk = norm_weight(d, gen, torch.bfloat16), norm_weight(d, gen, torch.bfloat16)
    with trace() as fused:
        kernel_ladder.rope(q, k, cos, sin, q_norm_weight=wq, k_norm_weight=wk)
    assert fused.num_launches == 1
    programs = fused.launches[0].grid[0]
    ideal = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
    assert fused.bytes == ideal + programs * 2 * d * 2, (fused.bytes, ideal, programs)
    with trace() as separate:
        qn = kernel_ladder.rms_norm(q.transpose(1, 2), wq)
        kn = kernel_ladder.rms_norm(k.transpose(1, 2), wk)
        kernel_ladder.rope(qn, kn, cos, sin, unsqueeze_dim=2)
    assert separate.num_launches == 3
    # the normalized q and k: written, then read back (plus rms_norm's rstd and weight re-reads)
    assert separate.bytes >= fused.bytes - programs * 2 * d * 2 + 2 * (q.numel() + k.numel()) * 2


def test_qk_norm_opcheck_and_torch_compile(gen):
    _, q, k = fused_qkv(2, 3, 2, 1, 16, gen)
    cos, sin = tables(2, 3, 16, gen)
    wq, wk = norm_weight(16, gen), norm_weight(16, gen)
    torch.library.opcheck(torch.ops.kernel_ladder.rope.default, (q, k, cos, sin, 1, False, wq, wk, 1e-6, 0.0))
    torch.library.opcheck(torch.ops.kernel_ladder.rope.default, (q, k, cos, sin, 1, True, None, wk, 1e-5, 1.0))
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    wq.requires_grad_()

    def fused(a, b, w):
        return kernel_ladder.rope(a, b, cos, sin, q_norm_weight=w, k_norm_weight=wk, norm_offset=1.0)

    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, wq)
    want = fused(q, k, wq)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    grads = torch.autograd.grad(sum(o.sum() for o in got), (q, k, wq))
    eager = torch.autograd.grad(sum(o.sum() for o in want), (q, k, wq))
    for a, b in zip(grads, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_qk_norm_bad_input_errors(gen):
    _, q, k = fused_qkv(2, 5, 4, 2, 16, gen)
    cos, sin = tables(2, 5, 16, gen)
    w = norm_weight(16, gen)
    cases = [
        (dict(q_norm_weight=w[:8]), ValueError,
         r"^kernel_ladder\.rope: q_norm_weight must have shape \(D,\) = \(16,\).*got \(8,\)"),
        (dict(k_norm_weight=w[None]), ValueError, r"^kernel_ladder\.rope: k_norm_weight must have shape \(D,\)"),
        (dict(q_norm_weight=w.double()), TypeError,
         r"^kernel_ladder\.rope: q_norm_weight must be float32, float16 or bfloat16, got torch\.float64"),
        (dict(k_norm_weight=w.long()), TypeError, r"^kernel_ladder\.rope: k_norm_weight must be float32"),
        (dict(q_norm_weight=[1.0] * 16), TypeError,
         r"^kernel_ladder\.rope: q_norm_weight must be None or a torch\.Tensor of shape \(D,\), got list"),
        (dict(q_norm_weight=w.to("meta")), ValueError,
         r"^kernel_ladder\.rope: q and q_norm_weight must be on the same device"),
        (dict(q_norm_weight=w, norm_eps=0.0), ValueError,
         r"^kernel_ladder\.rope: norm_eps must be a finite number > 0"),
        (dict(q_norm_weight=w, norm_eps="1e-6"), TypeError, r"^kernel_ladder\.rope: norm_eps must be a float, got str"),
        (dict(q_norm_weight=w, norm_offset=float("nan")), ValueError,
         r"^kernel_ladder\.rope: norm_offset must be a finite number"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            kernel_ladder.rope(q, k, cos, sin, **kwargs)
