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
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={"rope_type": "yarn"}), ValueError,
         r"rope_type'\] must be one of"),
        (lambda: kernel_ladder.rope_cos_sin(torch.arange(4), 16, scaling={"rope_type": "llama3", "factor": 8}),
         ValueError, r"needs \['low_freq_factor'"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
