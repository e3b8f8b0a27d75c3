"""kernel_ladder.flash_attention and kernel_ladder.flash_attention_varlen: values and gradients against a float64
reference (explicit scores and masks), bottom-right causal, sliding windows, soft-capping, GQA/MQA,
odd lengths and head dims, every dtype, lse and its gradient, strided inputs, packed sequences,
determinism, memory (no Tq x Tk buffer), traced traffic and FLOPs (block skipping),
custom-op plumbing, errors, and negative controls (a wrongly aligned diagonal, a skipped block).

Every buffer the ops allocate is poisoned (NaN) first; inputs are fresh random draws (the seed is
printed). Low-precision results are judged by flash-attention's criterion: the largest error against
float64 at most twice torch's own in that dtype (the reference evaluated in the low dtype, as
Hugging Face's eager attention computes it), so a fresh seed cannot make a correct kernel fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import alternating_bench, assert_matches

import kernel_ladder
from kernel_ladder.ops import attention
from utils.memory import peak_memory
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
LOW = (torch.float16, torch.bfloat16)


def rand(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


# ----------------------------------------------------------------------------- the reference


def visible_mask(tq, tk, causal, window, device="cpu"):
    """(Tq, Tk) booleans: bottom-right causal (j <= i + Tk - Tq) and the window (j > i + Tk - Tq - W)."""
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    visible = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if causal:
        visible &= j <= i + tk - tq
    if window is not None:
        visible &= j > i + tk - tq - window
    return visible


def reference(q, k, v, causal=False, softmax_scale=None, window=None, softcap=None, dtype=torch.float64):
    """Attention written out: scores, soft-cap, mask, softmax, P V; GQA by repeat_interleave (here only).

    ``dtype=float64`` is the exact reference; a low dtype evaluates it the way Hugging Face's eager
    attention does (products in that dtype, the softmax in float32 then rounded), torch's own
    low-precision result. Rows that see no key give 0 and lse = -inf. Returns ``(out, lse)``.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.float() if dtype != torch.float64 else s
    visible = visible_mask(q.shape[2], k.shape[2], causal, window, q.device)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = visible.any(-1)
    p = torch.where(seen[:, None], torch.exp(s - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    return p.to(dtype) @ v, lse


def reference_grads(q, k, v, grad_out, grad_lse=None, dtype=torch.float64, **options):
    """(out, lse, dq, dk, dv) of the reference, by autograd, in ``dtype``."""
    q2, k2, v2 = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = reference(q2, k2, v2, dtype=dtype, **options)
    outputs, grads = [out], [grad_out.to(dtype)]
    if grad_lse is not None:
        finite = torch.isfinite(lse)  # -inf rows (no key) have no gradient
        outputs.append(torch.where(finite, lse, 0.0))
        grads.append(torch.where(finite, grad_lse.to(lse.dtype), 0.0))
    dq, dk, dv = torch.autograd.grad(outputs, (q2, k2, v2), grads)
    return out.detach(), lse.detach(), dq, dk, dv


def check(q, k, v, gen, grad_lse=True, varlen=None, **options):
    """Run the op forward (out, lse) and backward (dq, dk, dv) and compare all five with float64
    (low dtypes: at most twice the low-precision reference's error)."""
    q, k, v = leaf(q), leaf(k), leaf(v)
    out, lse = kernel_ladder.flash_attention(q, k, v, return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    g = rand(*out.shape, gen=gen, dtype=q.dtype)
    gl = rand(*lse.shape, gen=gen) if grad_lse else None
    got = [out, lse, *torch.autograd.grad([out, lse] if grad_lse else [out], (q, k, v),
                                          [g, gl] if grad_lse else [g])]
    want = reference_grads(q, k, v, g, gl, **options)
    lowp = reference_grads(q, k, v, g, gl, dtype=q.dtype, **options) if q.dtype in LOW else [None] * 5
    for name, ours, exact, theirs in zip(("out", "lse", "dq", "dk", "dv"), got, want, lowp):
        if name == "lse":  # float32 (fp32 scores of the inputs as given): a float32 tolerance
            assert torch.equal(torch.isinf(ours).cpu(), torch.isinf(exact).cpu()), "lse: -inf rows"
            ok = torch.isfinite(exact)
            assert_matches(torch.where(ok, ours, 0.0), torch.where(ok, exact, 0.0), lowp=None if theirs is None
                           else torch.where(ok, theirs.float(), 0.0), what="lse")
            continue
        assert_matches(ours, exact, q.dtype, lowp=theirs, what=name)
    return got


# ----------------------------------------------------------------------------- values and gradients

CASES = [  # (B, Hq, Hkv, Tq, Tk, D, options): lengths not multiples of the block, both Tq < Tk and Tq > Tk
    (2, 4, 2, 37, 37, 48, {}),  # GQA 2:1, non-causal
    (1, 8, 2, 45, 70, 64, {"causal": True}),  # GQA 8:2, Tq < Tk (bottom right: rows see more keys)
    (2, 4, 1, 70, 33, 80, {"causal": True}),  # MQA 4:1, Tq > Tk: the first 37 rows see no key
    (2, 2, 2, 1, 50, 128, {"causal": True}),  # decoding: one query sees every key
    (1, 4, 2, 70, 70, 96, {"causal": True, "window": 20}),  # Mistral's window, blocks skipped both sides
    (2, 2, 1, 33, 40, 32, {"softcap": 5.0, "softmax_scale": 0.3}),  # Gemma-2's soft-capping
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}:{c[2]}T{c[3]}x{c[4]}D{c[5]}{c[6]}")
def test_forward_and_backward_match_float64(case, gen):
    batch, hq, hkv, tq, tk, d, options = case
    q, k, v = rand(batch, hq, tq, d, gen=gen), rand(batch, hkv, tk, d, gen=gen), rand(batch, hkv, tk, d, gen=gen)
    check(q, k, v, gen, **options)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("options", [{"causal": True}, {"causal": True, "window": 9, "softcap": 8.0}], ids=str)
def test_half_precision_forward_and_backward(dtype, options, gen):
    """fp16/bf16 in, fp32 accumulation and softmax: at most twice torch's own low-precision error."""
    q = rand(2, 4, 40, 64, gen=gen, dtype=dtype)
    k, v = rand(2, 2, 45, 64, gen=gen, dtype=dtype), rand(2, 2, 45, 64, gen=gen, dtype=dtype)
    check(q, k, v, gen, grad_lse=False, **options)


def test_head_dims_8_and_256_forward(gen):
    """The smallest tile (D = 8 padded to 16) and the largest head."""
    for d in (8, 256):
        q, k, v = rand(1, 2, 20, d, gen=gen), rand(1, 1, 24, d, gen=gen), rand(1, 1, 24, d, gen=gen)
        out = kernel_ladder.flash_attention(q, k, v, causal=True)
        assert_matches(out, reference(q, k, v, causal=True)[0], torch.float32)


def test_large_scores_do_not_overflow(gen):
    """Scores near 1e4: the running max keeps every exp in range."""
    q, k, v = rand(1, 2, 33, 32, gen=gen, scale=30.0), rand(1, 2, 33, 32, gen=gen, scale=30.0), rand(1, 2, 33, 32,
                                                                                                      gen=gen)
    out, lse = kernel_ladder.flash_attention(q, k, v, return_lse=True)
    want, want_lse = reference(q, k, v)
    # A float32 score of magnitude |s| carries an error of ~eps * |s| (here ~1e-3 absolute), and every
    # probability that much relative error: the tolerance grows with the largest score (an overflow would
    # give inf/NaN or zeros, far outside it).
    largest = float((q.double() @ k.double().transpose(-1, -2)).abs().max()) / 32**0.5
    slack = max(10.0, 4 * 2.0**-24 * largest / 1e-5)
    assert_matches(out, want, torch.float32, slack=slack)
    assert_matches(lse, want_lse, torch.float32, slack=slack)


def test_rows_that_see_no_key_give_zero_and_minus_inf(gen):
    """Causal with Tq > Tk: the first Tq - Tk queries see nothing (flash-attn's convention: 0, lse -inf),
    and their gradients are zero, not NaN."""
    q, k, v = leaf(rand(1, 2, 40, 16, gen=gen)), leaf(rand(1, 2, 8, 16, gen=gen)), leaf(rand(1, 2, 8, 16, gen=gen))
    out, lse = kernel_ladder.flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :32], torch.zeros_like(out[:, :, :32]))
    assert torch.isneginf(lse[:, :, :32]).all() and torch.isfinite(lse[:, :, 32:]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    assert torch.equal(q.grad[:, :, :32], torch.zeros_like(q.grad[:, :, :32]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gradient_through_lse_alone_and_through_out_alone(gen):
    """lse is differentiable (d lse / dS = P, folded into delta); each output alone works too."""
    q, k, v = rand(2, 2, 20, 16, gen=gen), rand(2, 1, 30, 16, gen=gen), rand(2, 1, 30, 16, gen=gen)
    for use in ("lse", "out"):
        q2, k2, v2 = leaf(q), leaf(k), leaf(v)
        out, lse = kernel_ladder.flash_attention(q2, k2, v2, causal=True, return_lse=True)
        g = rand(*lse.shape, gen=gen) if use == "lse" else rand(*out.shape, gen=gen)
        got = torch.autograd.grad(lse if use == "lse" else out, (q2, k2, v2), g)
        q6, k6, v6 = (t.double().requires_grad_() for t in (q, k, v))
        want_out, want_lse = reference(q6, k6, v6, causal=True)
        want = torch.autograd.grad(want_lse if use == "lse" else want_out, (q6, k6, v6), g.double(),
                                   allow_unused=True)  # lse does not depend on v
        for name, ours, exact in zip("qkv", got, want):
            exact = torch.zeros_like(q6 if name == "q" else k6) if exact is None else exact
            assert_matches(ours, exact, torch.float32, what=f"d{name} through {use}")


def test_lse_is_the_log_sum_exp_of_the_scaled_capped_scores(gen):
    q, k, v = rand(1, 2, 9, 16, gen=gen), rand(1, 2, 11, 16, gen=gen), rand(1, 2, 11, 16, gen=gen)
    _, lse = kernel_ladder.flash_attention(q, k, v, softmax_scale=0.5, softcap=2.0, return_lse=True)
    s = 2.0 * torch.tanh((q.double() @ k.double().transpose(-1, -2)) * 0.5 / 2.0)
    assert_matches(lse, torch.logsumexp(s, -1), torch.float32)


# ----------------------------------------------------------------------------- attention sinks, Dv != D


def sink_reference(q, k, v, sinks=None, causal=False, softmax_scale=None, window=None, softcap=None,
                   dtype=torch.float64):
    """GPT-OSS's ``eager_attention_forward`` (transformers, models/gpt_oss) written out: the scores, soft-cap and
    mask, then each head's sink as one more column of the logits, the row max subtracted, a softmax, and the
    sink's column dropped before ``P V``. ``v`` may have its own head dim Dv. Returns ``(out, lse)`` with lse the
    log-sum-exp of the whole row, sink included. A row with neither a visible key nor a finite sink (eager: NaN)
    gives 0 and lse -inf, flash-attn's convention. Differentiable (float64 autograd is the gradient reference)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    visible = visible_mask(q.shape[2], k.shape[2], causal, window, q.device)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is None:
        sinks = torch.full((q.shape[1],), float("-inf"), dtype=dtype)
    column = sinks.to(dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    combined = torch.cat([s, column], dim=-1)
    top = combined.max(dim=-1, keepdim=True).values
    nothing = torch.isneginf(top)
    combined = combined - torch.where(nothing, 0.0, top)
    probs = torch.where(nothing, 0.0, torch.softmax(combined, dim=-1))
    lse = torch.where(nothing[..., 0], float("-inf"), torch.logsumexp(combined, -1) + top[..., 0])
    return probs[..., :-1] @ v, lse


def check_sinks(q, k, v, sinks, gen, **options):
    """out, lse and the gradients of q, k, v and sinks (through out and lse) against float64 autograd."""
    leaves = [leaf(t) for t in (q, k, v, sinks)]
    out, lse = kernel_ladder.flash_attention(*leaves[:3], return_lse=True, sinks=leaves[3], **options)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == q.shape[:3]
    g, gl = rand(*out.shape, gen=gen, dtype=q.dtype), rand(*lse.shape, gen=gen)
    grads = torch.autograd.grad([out, lse], leaves, [g, gl])
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want, want_lse = sink_reference(*exact, **options)
    finite = torch.isfinite(want_lse)
    want_grads = torch.autograd.grad([want, torch.where(finite, want_lse, 0.0)], exact,
                                     [g.double(), torch.where(finite, gl.double(), 0.0)])
    assert_matches(out, want, q.dtype, what="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), "lse: -inf rows"
    assert_matches(torch.where(finite, lse, 0.0), torch.where(finite, want_lse, 0.0), torch.float32, what="lse")
    for name, ours, theirs in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert ours.dtype == (sinks.dtype if name == "dsinks" else q.dtype), name
        assert_matches(ours, theirs, what=name)
    return out, lse, grads


SINK_CASES = [  # (B, Hq, Hkv, Tq, Tk, D, Dv, options)
    (2, 4, 2, 37, 37, 32, 32, {"causal": True}),  # GQA, causal
    (1, 4, 1, 45, 70, 24, 16, {}),  # MQA, non-causal, Dv != D (DeepSeek's MLA prefill, tiny: 24 / 16)
    (1, 2, 2, 70, 33, 16, 16, {"causal": True}),  # Tq > Tk: the first 37 rows see no key, only the sink: 0
    (1, 4, 2, 70, 70, 12, 8, {"causal": True, "window": 20}),  # sliding window, 12 / 8
    (2, 2, 1, 33, 40, 16, 24, {"softcap": 5.0, "softmax_scale": 0.3}),  # soft-capping; Dv > D too
]


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"H{c[1]}:{c[2]}T{c[3]}x{c[4]}D{c[5]}Dv{c[6]}{c[7]}")
def test_sinks_and_dv_forward_and_backward_match_gpt_oss_eager(case, gen):
    """The sink joins every softmax's denominator and nothing else; its gradient is
    -sum_rows P_sink * (dO . O - dlse), checked with the others against float64 autograd."""
    batch, hq, hkv, tq, tk, d, dv, options = case
    q, k, v = rand(batch, hq, tq, d, gen=gen), rand(batch, hkv, tk, d, gen=gen), rand(batch, hkv, tk, dv, gen=gen)
    out, lse, _ = check_sinks(q, k, v, rand(hq, gen=gen, scale=2.0), gen, **options)
    if tq > tk and options.get("causal"):  # rows that see no key: output 0, lse = the sink
        assert torch.equal(out[:, :, : tq - tk], torch.zeros_like(out[:, :, : tq - tk]))


def test_dv_differs_from_d_without_sinks(gen):
    """Dv != D alone (no sinks) against the plain reference, forward and backward, GQA and causal."""
    q, k, v = rand(1, 4, 40, 24, gen=gen), rand(1, 2, 45, 24, gen=gen), rand(1, 2, 45, 16, gen=gen)
    leaves = [leaf(t) for t in (q, k, v)]
    out = kernel_ladder.flash_attention(*leaves, causal=True)
    g = rand(*out.shape, gen=gen)
    grads = torch.autograd.grad(out, leaves, g)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference(*exact, causal=True)[0]
    assert_matches(out, want, torch.float32)
    for name, ours, theirs in zip("qkv", grads, torch.autograd.grad(want, exact, g.double())):
        assert_matches(ours, theirs, torch.float32, what=f"d{name}")


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_sinks_half_precision_with_bf16_sinks(dtype, gen):
    """16-bit q, k, v and bf16 sinks (GPT-OSS's parameter dtype): at most twice torch's own error; the sinks'
    gradient comes back in their dtype."""
    q, k, v = rand(1, 4, 40, 32, gen=gen, dtype=dtype), rand(1, 2, 40, 32, gen=gen, dtype=dtype), rand(
        1, 2, 40, 32, gen=gen, dtype=dtype)
    sinks = leaf(rand(4, gen=gen, dtype=torch.bfloat16))
    out = kernel_ladder.flash_attention(q, k, v, causal=True, sinks=sinks)
    want = sink_reference(q, k, v, sinks, causal=True)[0]
    lowp = sink_reference(q, k, v, sinks, causal=True, dtype=dtype)[0]
    assert_matches(out, want, dtype, lowp=lowp)
    (dsinks,) = torch.autograd.grad(out.float().sum(), sinks)
    assert dsinks.dtype == torch.bfloat16 and torch.isfinite(dsinks).all()


def test_huge_and_minus_inf_sinks(gen):
    """A sink of 1e4 takes the whole softmax: output 0, lse = the sink, every gradient 0 but the sink's
    (dO . O = 0). A -inf sink is no sink: the same bits as without one, and a zero gradient."""
    q, k, v = rand(1, 3, 20, 16, gen=gen), rand(1, 3, 24, 16, gen=gen), rand(1, 3, 24, 16, gen=gen)
    plain, plain_lse = kernel_ladder.flash_attention(q, k, v, causal=True, return_lse=True)
    sinks = leaf(torch.tensor([1e4, float("-inf"), 0.5], device=DEVICE))
    q2, k2, v2 = leaf(q), leaf(k), leaf(v)
    out, lse = kernel_ladder.flash_attention(q2, k2, v2, causal=True, return_lse=True, sinks=sinks)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.equal(lse[:, 0], torch.full_like(lse[:, 0],
                                                                                                          1e4))
    assert torch.equal(out[:, 1], plain[:, 1]) and torch.equal(lse[:, 1], plain_lse[:, 1])
    assert_matches(out[:, 2:], sink_reference(q, k, v, sinks.detach(), causal=True)[0][:, 2:], torch.float32)
    g = rand(*out.shape, gen=gen)
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q2, k2, v2, sinks), g)
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0])) and dsinks[0] == 0 and dsinks[1] == 0
    assert dsinks[2] != 0 and all(torch.isfinite(t).all() for t in (dq, dk, dv, dsinks))


def test_sinks_nan_in_one_row_stays_in_that_row(gen):
    """A NaN in one query row reaches that row's output alone: other rows and heads match the reference."""
    q, k, v = rand(1, 2, 40, 16, gen=gen), rand(1, 2, 40, 16, gen=gen), rand(1, 2, 40, 16, gen=gen)
    q[0, 1, 7, 3] = float("nan")
    sinks = rand(2, gen=gen)
    out = kernel_ladder.flash_attention(q, k, v, causal=True, sinks=sinks)
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows[0, 1, 7] and int(nan_rows.sum()) == 1
    want = sink_reference(q, k, v, sinks, causal=True)[0]
    assert_matches(out, want, torch.float32, equal_nan=True)


def test_sinks_merge_by_lse_counts_the_sink_once(gen):
    """Split the keys in two, attend to each half and merge by lse (what split-KV decoding does): with the sink
    in each half it is counted twice and the result is wrong; without it in the halves and added once in the
    merge, the result is the full call's. The lse counts the sink: out = sum_j exp(s_j - lse) v_j."""
    q, k, v = rand(1, 2, 1, 16, gen=gen), rand(1, 2, 64, 16, gen=gen), rand(1, 2, 64, 16, gen=gen)
    sinks = torch.tensor([4.0, 5.0], device=DEVICE)  # near the rows' lse (about log 64): as heavy as the keys
    full = kernel_ladder.flash_attention(q, k, v, sinks=sinks)
    halves = [(k[:, :, :32], v[:, :, :32]), (k[:, :, 32:], v[:, :, 32:])]

    def merge(parts, extra_sink):
        lses = torch.stack([lse for _, lse in parts] + ([sinks.view(1, 2, 1)] if extra_sink else []))
        weights = torch.softmax(lses, 0)[: len(parts)]
        return sum(w[..., None] * o for w, (o, _) in zip(weights, parts))

    twice = merge([kernel_ladder.flash_attention(q, *h, sinks=sinks, return_lse=True) for h in halves], False)
    once = merge([kernel_ladder.flash_attention(q, *h, return_lse=True) for h in halves], True)
    assert_matches(once, full, torch.float32, slack=4, contiguous=False)
    assert (twice - full).abs().max() > 0.1 * full.abs().max()


def test_sinks_backward_is_deterministic(gen):
    """The sinks' gradient is a fixed-order sum of per-row terms: two runs give the same bits."""
    q, k, v = rand(2, 4, 50, 16, gen=gen), rand(2, 2, 50, 16, gen=gen), rand(2, 2, 50, 16, gen=gen)
    sinks = rand(4, gen=gen)
    g = rand(2, 4, 50, 16, gen=gen)
    runs = []
    for _ in range(2):
        leaves = [leaf(t) for t in (q, k, v, sinks)]
        out = kernel_ladder.flash_attention(*leaves[:3], causal=True, sinks=leaves[3])
        runs.append(torch.autograd.grad(out, leaves, g))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_varlen_with_sinks_and_dv_matches_the_reference_per_sequence(gen):
    """Packed sequences (lengths 0 and 1 included) with sinks and Dv != D: every sequence's rows equal the
    reference on that sequence; the sinks' gradient sums over every sequence's rows."""
    lengths_q, lengths_k = [5, 0, 1, 33, 17], [9, 3, 1, 40, 6]
    hq, hkv, d, dv = 4, 2, 24, 16
    q, cu_q = pack(lengths_q, hq, d, gen)
    k, cu_k = pack(lengths_k, hkv, d, gen)
    v = rand(k.shape[0], hkv, dv, gen=gen)
    sinks = rand(hq, gen=gen, scale=2.0)
    leaves = [leaf(t) for t in (q, k, v, sinks)]
    out, lse = kernel_ladder.flash_attention_varlen(*leaves[:3], cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    causal=True, return_lse=True, sinks=leaves[3])
    assert out.shape == (q.shape[0], hq, dv)
    g, gl = rand(*out.shape, gen=gen), rand(*lse.shape, gen=gen)
    grads = torch.autograd.grad([out, lse], leaves, [g, gl])
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    outs, lses = [], []
    for b in range(len(lengths_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o, ls = sink_reference(*(t[r].transpose(0, 1)[None] for t, r in zip(exact[:3], (rq, rk, rk))), exact[3],
                               causal=True)
        outs.append(o[0].transpose(0, 1))
        lses.append(ls[0])
    want, want_lse = torch.cat(outs), torch.cat(lses, dim=1)
    finite = torch.isfinite(want_lse)
    want_grads = torch.autograd.grad([want, torch.where(finite, want_lse, 0.0)], exact,
                                     [g.double(), torch.where(finite, gl.double(), 0.0)])
    assert_matches(out, want, torch.float32)
    assert_matches(torch.where(finite, lse, 0.0), torch.where(finite, want_lse, 0.0), torch.float32, what="lse")
    for name, ours, theirs in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert_matches(ours, theirs, torch.float32, what=name)


def test_sinks_stay_float32_under_autocast(gen):
    """Under autocast q, k, v go to bf16 (as SDPA's) but the sinks, per-head logits read in float32, are never
    cast: their gradient comes back in float32."""
    from kernel_ladder import _autocast  # noqa: PLC0415

    for name in ("flash_attention", "flash_attention_varlen", "paged_attention"):
        assert "sinks" not in _autocast._castable_args(name), name
    q, k, v = rand(1, 2, 20, 16, gen=gen), rand(1, 1, 20, 16, gen=gen), rand(1, 1, 20, 16, gen=gen)
    sinks = leaf(rand(2, gen=gen))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = kernel_ladder.flash_attention(q, k, v, causal=True, sinks=sinks)
    assert out.dtype == torch.bfloat16
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert_matches(out, sink_reference(*low, sinks.detach(), causal=True)[0], torch.bfloat16,
                   lowp=sink_reference(*low, sinks.detach(), causal=True, dtype=torch.bfloat16)[0])
    (dsinks,) = torch.autograd.grad(out.float().sum(), sinks)
    assert dsinks.dtype == torch.float32


def test_sinks_and_dv_opcheck(gen):
    q, k, v = rand(1, 2, 5, 16, gen=gen), rand(1, 1, 7, 16, gen=gen), rand(1, 1, 7, 8, gen=gen)
    sinks = rand(2, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.flash_attention.default, (q, k, v, True, 0.25, 3, None, sinks))
    qv, cu = pack([2, 0, 3], 2, 16, gen)
    vv = rand(qv.shape[0], 1, 24, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.flash_attention_varlen.default,
                          (qv, qv[:, :1], vv, cu, cu, 3, 3, False, 0.25, None, None, sinks))


@pytest.mark.parametrize("sinks, error, message", [
    (torch.zeros(3), ValueError, r"^kernel_ladder\.flash_attention: sinks must have shape \(Hq,\) = \(4,\): one "
                                 r"logit per query head, got \(3,\)"),
    (torch.zeros(1, 4), ValueError, r"sinks must have shape \(Hq,\) = \(4,\).* got \(1, 4\)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, r"sinks must be a float tensor .* got torch\.int32"),
    ([0.0] * 4, TypeError, r"sinks must be a torch\.Tensor, got list"),
])
def test_bad_sinks_errors(sinks, error, message):
    with pytest.raises(error, match=message):
        kernel_ladder.flash_attention(torch.zeros(2, 4, 5, 16), torch.zeros(2, 2, 7, 16), torch.zeros(2, 2, 7, 16),
                                      sinks=sinks)


def test_bad_dv_errors():
    q, k = torch.zeros(1, 2, 5, 16), torch.zeros(1, 1, 7, 16)
    with pytest.raises(ValueError, match=r"v's head dim Dv must be in \[1, 256\], got 320"):
        kernel_ladder.flash_attention(q, k, torch.zeros(1, 1, 7, 320))
    with pytest.raises(ValueError, match=r"k and v must have the same shape but for the head dim"):
        kernel_ladder.flash_attention(q, k, torch.zeros(1, 1, 6, 8))
    with pytest.raises(ValueError, match=r"^kernel_ladder\.flash_attention_varlen: sinks must have shape \(Hq,\)"):
        qv, cu = torch.zeros(7, 2, 16), torch.tensor([0, 3, 7], dtype=torch.int32)
        kernel_ladder.flash_attention_varlen(qv, qv, qv, cu, cu, 4, 4, sinks=torch.zeros(3))


# ----------------------------------------------------------------------------- layouts


def test_strided_inputs_are_read_in_place(gen):
    """(B, T, H, D) projections transposed to (B, H, T, D) and slices of one fused qkv tensor: the same
    result as contiguous copies, bit for bit, with no copy made (the trace sees no torch op)."""
    batch, t, hq, hkv, d = 2, 21, 4, 2, 16
    qkv = rand(batch, t, (hq + 2 * hkv) * d, gen=gen)
    q = qkv[..., : hq * d].view(batch, t, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hkv) * d].view(batch, t, hkv, d).transpose(1, 2)
    v = qkv[..., (hq + hkv) * d :].view(batch, t, hkv, d).transpose(1, 2)
    assert not q.is_contiguous()
    with trace() as tr:
        out = kernel_ladder.flash_attention(q, k, v, causal=True)
    copies = [op.name for op in tr.torch_ops if op.launches]
    assert not copies, copies
    assert torch.equal(out, kernel_ladder.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))
    assert out.is_contiguous() and out.shape == (batch, hq, t, d)
    assert_matches(out, reference(q, k, v, causal=True)[0], torch.float32)


def test_strided_backward_and_a_noncontiguous_output_gradient(gen):
    qkv = leaf(rand(2, 17, 3, 2, 32, gen=gen))  # (B, T, 3, H, D): q, k, v interleaved per token
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out = kernel_ladder.flash_attention(q, k, v, causal=True)
    g = rand(2, 17, 2, 32, gen=gen).transpose(1, 2)  # the gradient of a (B, T, H, D) consumer
    out.backward(g)
    q6 = qkv.detach().double().requires_grad_()
    reference(*(q6[:, :, i].transpose(1, 2) for i in range(3)), causal=True)[0].backward(g.double())
    assert_matches(qkv.grad, q6.grad, torch.float32, what="d qkv")


# ----------------------------------------------------------------------------- packed sequences


def pack(lengths, heads, d, gen, dtype=torch.float32):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return rand(total, heads, d, gen=gen, dtype=dtype), cu


VARLEN_CASES = [  # lengths of q and k per sequence: 0 and 1, mixed, Tq != Tk both ways
    ([5, 0, 1, 33, 17], [9, 3, 1, 33, 0], {}),
    ([5, 0, 1, 33, 17], [9, 3, 1, 40, 6], {"causal": True, "window": 7}),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: str(c[2]))
def test_varlen_matches_the_reference_per_sequence(case, gen):
    lengths_q, lengths_k, options = case
    hq, hkv, d = 4, 2, 48
    q, cu_q = pack(lengths_q, hq, d, gen)
    k, cu_k = pack(lengths_k, hkv, d, gen)
    v = rand(*k.shape, gen=gen)
    q, k, v = leaf(q), leaf(k), leaf(v)
    out, lse = kernel_ladder.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    return_lse=True,
                                                    **options)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    g = rand(*out.shape, gen=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    want = [torch.zeros(t.shape, dtype=torch.float64) for t in (out, q, k, v)]
    want_lse = torch.zeros(lse.shape, dtype=torch.float64)
    for b in range(len(lengths_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rq.start == rq.stop:
            continue

        def bhtd(t):
            return t.transpose(0, 1)[None]

        o, ls, gq, gk, gv = reference_grads(bhtd(q[rq]), bhtd(k[rk]), bhtd(v[rk]), bhtd(g[rq]), **options)
        for w, part, r in zip(want, (o, gq, gk, gv), (rq, rq, rk, rk)):
            w[r] = part[0].transpose(0, 1)
        want_lse[:, rq] = ls[0]
    for name, ours, exact in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
        assert_matches(ours, exact, torch.float32, what=name)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert_matches(torch.where(finite, lse, 0.0), torch.where(finite, want_lse, 0.0), torch.float32, what="lse")


def test_varlen_bf16_against_the_dense_op_per_sequence(gen):
    """Packing changes nothing: each sequence's rows equal the dense op on that sequence alone, bit for bit."""
    lengths = [3, 20, 1]
    q, cu = pack(lengths, 2, 32, gen, torch.bfloat16)
    k, v = rand(*q.shape, gen=gen, dtype=torch.bfloat16), rand(*q.shape, gen=gen, dtype=torch.bfloat16)
    out = kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 20, 20, causal=True)
    for b in range(len(lengths)):
        r = slice(int(cu[b]), int(cu[b + 1]))
        dense = kernel_ladder.flash_attention(*(t[r].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        assert torch.equal(out[r], dense[0].transpose(0, 1))


@pytest.mark.interpreter
def test_varlen_programs_past_a_sequence_do_no_work(gen):
    """One long and one short sequence: the short one's extra query blocks exit at once and its key loops
    stop at its length, so the FLOPs are those of the two sequences alone."""
    q, cu = pack([64, 5], 1, 32, gen)
    k, v = rand(*q.shape, gen=gen), rand(*q.shape, gen=gen)
    with trace() as tr:
        kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 64, 64)
    block = attention.configs.INTERPRETER_CONFIG.BLOCK_M
    tiles = (64 // block) ** 2 + 1  # the long sequence's tiles, and one for the short one
    assert tr.flops == tiles * 4 * block * block * 32


def test_cu_seqlens_values_are_checked(gen):
    q, cu = pack([3, 4], 2, 16, gen)
    for bad in ([1, 3, 7], [0, 5, 3], [0, 3, 6]):  # not starting at 0, decreasing, not ending at the total
        cu_bad = torch.tensor(bad, dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError,
                           match=r"kernel_ladder\.flash_attention_varlen: cu_seqlens_q must start at 0, never "
                                 rf"decrease, end at 7 .*got \[{bad[0]}, {bad[1]}, {bad[2]}\]"):
            kernel_ladder.flash_attention_varlen(q, q, q, cu_bad, cu, 7, 7)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must .* every sequence length <= max_seqlen = 3"):
        kernel_ladder.flash_attention_varlen(q, q, q, cu, cu, 4, 3)
    # Valid input: one Triton launch reads both, no host synchronization (no aten._local_scalar_dense).
    with trace() as tr:
        kernel_ladder.flash_attention_varlen(q, q, q, cu, cu, 4, 4)
    assert [x.kernel for x in tr.launches] == ["flash_attention_cu_seqlens_kernel", "flash_attention_forward_kernel"]
    assert [op.name for op in tr.torch_ops if op.launches] == ["aten._assert_async.msg"]


@pytest.mark.interpreter
@pytest.mark.parametrize("bad_q, bad_k", [
    ([0, 5, 40], [0, 3, 7]),     # q's last sequence past q
    ([-4, 5, 7], [0, 3, 7]),     # q's first sequence before q
    ([0, 6, 2], [0, 3, 7]),      # decreasing
    ([0, 3, 7], [0, 300, 7]),    # k's first sequence past k
    ([0, 3, 7], [5, -9, 12]),    # k before and past k
], ids=["q_past_end", "q_before_start", "q_decreasing", "k_past_end", "k_both"])
def test_bad_cu_seqlens_unchecked_never_access_outside_the_tensors(bad_q, bad_k, gen):
    """cu_seqlens a check rejects, with value checks off (a GPU's default): the forward and the backward read
    and write only inside q, k, v, out, lse and the gradients (the trace blocks and counts every access
    outside the tensors); the kernels clamp each sequence into its packed tensor."""
    q, _ = pack([3, 4], 2, 16, gen)
    k, v = rand(*q.shape, gen=gen), rand(*q.shape, gen=gen)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (bad_q, bad_k))
    with pytest.raises(ValueError, match=r"kernel_ladder\.flash_attention_varlen: cu_seqlens_[qk] must"):
        kernel_ladder.flash_attention_varlen(q, k, v, cu_q, cu_k, 8, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
        out, lse = kernel_ladder.flash_attention_varlen(*leaves, cu_q, cu_k, 8, 8, causal=True, return_lse=True)
        torch.autograd.grad((out * out).sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum(), leaves)
    assert len(tr.launches) == 4  # the forward, the backward's preprocess, dK/dV and dQ
    assert tr.out_of_bounds == 0, tr.table()


# ----------------------------------------------------------------------------- K and V through tensor descriptors


#: Whether aligned K and V go through tensor descriptors here (the interpreter, or a GPU of sm_90 or later).
TMA = attention.launch._tma_supported() and (kernel_ladder.runtime.INTERPRETER
                                             or torch.cuda.get_device_capability()[0] >= 9)


def _spy_tma(monkeypatch, force=None):
    """Record each forward launch's choice of K/V loads (``force``: make that choice instead)."""
    chosen = []
    decide = attention.launch._use_tma

    def spy(k, v):
        chosen.append(decide(k, v) if force is None else force)
        return chosen[-1]

    monkeypatch.setattr(attention.launch, "_use_tma", spy)
    return chosen


@pytest.mark.parametrize("options", [
    {"causal": True},
    {"causal": True, "window": 9, "softcap": 8.0},
    {"sinks": True, "dv": 16},
], ids=str)
def test_tensor_descriptor_and_cp_async_loads_give_the_same_bits(options, gen, monkeypatch):
    """The forward reads K and V through tensor descriptors (the TMA) where their layout allows, else with masked
    loads: the same tiles (zeros past the keys' end and past the head dim), so the same bits; odd lengths and a
    head dim (40) below its tile (64)."""
    options = dict(options)
    dv = options.pop("dv", 40)
    sinks = rand(4, gen=gen) if options.pop("sinks", False) else None
    q, k, v = rand(1, 4, 45, 40, gen=gen), rand(1, 2, 70, 40, gen=gen), rand(1, 2, 70, dv, gen=gen)
    chosen = _spy_tma(monkeypatch)
    tma = kernel_ladder.flash_attention(q, k, v, sinks=sinks, **options)
    _spy_tma(monkeypatch, force=False)
    masked = kernel_ladder.flash_attention(q, k, v, sinks=sinks, **options)
    assert chosen == [TMA]
    assert torch.equal(tma, masked)
    if sinks is None:
        assert_matches(tma, reference(q, k, v, **options)[0], torch.float32)


def test_varlen_tensor_descriptor_and_cp_async_loads_give_the_same_bits(gen, monkeypatch):
    """Packed sequences of 0 to 40 keys, each its own descriptor or its masked loads: the same bits."""
    q, cu_q = pack([5, 0, 33, 17], 4, 40, gen)
    k, cu_k = pack([9, 3, 40, 6], 2, 40, gen)
    v = rand(*k.shape, gen=gen)
    chosen = _spy_tma(monkeypatch)
    tma = kernel_ladder.flash_attention_varlen(q, k, v, cu_q, cu_k, 33, 40, causal=True, window=7)
    _spy_tma(monkeypatch, force=False)
    masked = kernel_ladder.flash_attention_varlen(q, k, v, cu_q, cu_k, 33, 40, causal=True, window=7)
    assert chosen == [TMA]
    assert torch.equal(tma, masked)


def test_tensor_descriptors_read_nothing_past_a_sequence_or_a_head(gen, monkeypatch):
    """A packed sequence's descriptor ends at its own last key and at the head dim: an infinite next sequence
    (keys 20.. of the first one's last block) and an infinite next head (the columns past D = 48 in the tile of
    64) leave the first sequence's head 0 exact, where a bound at the packed length or the tile would give NaN."""
    lengths = [20, 30]
    q, cu = pack(lengths, 2, 48, gen)
    k, v = rand(*q.shape, gen=gen), rand(*q.shape, gen=gen)
    for t in (k, v):
        t[20:] = float("inf")  # the second sequence
        t[:20, 1] = float("inf")  # the first sequence's head 1, right after head 0's 48 columns
    chosen = _spy_tma(monkeypatch)
    out = kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True)
    assert chosen == [TMA]
    first = (t[:20, :1].transpose(0, 1)[None] for t in (q, k, v))
    assert_matches(out[:20, :1].transpose(0, 1)[None].contiguous(), reference(*first, causal=True)[0],
                   torch.float32)


def test_tensor_descriptors_only_for_aligned_unit_stride_rows():
    """A descriptor needs a unit feature stride and 16-byte aligned rows: anything else keeps the masked loads."""
    use = attention.launch._use_tma
    k = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    assert use(k, k) == TMA
    assert not use(k[..., 1:65], k[..., :64])  # 2 bytes off alignment
    assert not use(k[..., ::2], k[..., ::2])  # feature stride 2
    odd = torch.zeros(1, 2, 64, 36, dtype=torch.bfloat16, device=DEVICE)  # rows of 72 bytes
    assert not use(odd, odd)
    broadcast = k[:, :, :1].expand(1, 2, 64, 128)  # every key the same row: stride 0
    assert not use(broadcast, broadcast)
    packed = torch.zeros(50, 2, 48, dtype=torch.float32, device=DEVICE)  # varlen (total, H, D)
    assert use(packed, packed) == TMA


# ----------------------------------------------------------------------------- properties


def test_two_backward_runs_are_bitwise_equal(gen):
    """No atomics: dK/dV sum a GQA group in a fixed order inside one program, dQ is a second pass."""
    q, k, v = rand(1, 4, 40, 32, gen=gen), rand(1, 1, 40, 32, gen=gen), rand(1, 1, 40, 32, gen=gen)
    g = rand(1, 4, 40, 32, gen=gen)
    runs = []
    for _ in range(2):
        q2, k2, v2 = leaf(q), leaf(k), leaf(v)
        runs.append(torch.autograd.grad(kernel_ladder.flash_attention(q2, k2, v2, causal=True), (q2, k2, v2), g))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_no_tq_by_tk_buffer_is_allocated(gen):
    """Forward and backward at T = 256: the scores would take Tq * Tk * 4 = 256 kB; what is allocated
    is the outputs, the gradients and a few floats per row."""
    t, d = 256, 16
    q, k, v = leaf(rand(1, 1, t, d, gen=gen)), leaf(rand(1, 1, t, d, gen=gen)), leaf(rand(1, 1, t, d, gen=gen))
    g = rand(1, 1, t, d, gen=gen)
    with peak_memory(cuda=False) as m:
        out = kernel_ladder.flash_attention(q, k, v, causal=True)
        out.backward(g)
    scores = t * t * 4
    per_tensor = t * d * 4
    # out, lse, delta, dq, dk, dv (and the autograd engine's buffers): far from one Tq x Tk matrix
    assert m.peak_bytes <= 5 * per_tensor + 3 * t * 4, m.table()
    assert m.peak_bytes < scores / 3


def test_index_64_path(gen, monkeypatch):
    """The int64-offset variant (taken for tensors past 2**31 elements) gives the same bits."""
    q, k, v = rand(1, 2, 40, 16, gen=gen), rand(1, 1, 40, 16, gen=gen), rand(1, 1, 40, 16, gen=gen)
    want = kernel_ladder.flash_attention(q, k, v, causal=True, window=11)
    monkeypatch.setattr(attention.problem, "_index_64", lambda *tensors: True)
    assert torch.equal(kernel_ladder.flash_attention(q, k, v, causal=True, window=11), want)


def test_empty_inputs(gen):
    q = rand(2, 2, 0, 16, gen=gen)
    k = rand(2, 1, 5, 16, gen=gen)
    assert kernel_ladder.flash_attention(q, k, k).shape == (2, 2, 0, 16)
    # no keys at all: every row sees nothing
    out, lse = kernel_ladder.flash_attention(rand(1, 2, 3, 16, gen=gen), k[:1, :, :0], k[:1, :, :0], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------- traffic and FLOPs


def _tiles_seen(n_blocks_q, n_blocks_k, block, causal, tq, tk, window=None):
    """(query block, key block) pairs with at least one visible entry: what the kernels may not skip."""
    visible = visible_mask(tq, tk, causal, window)
    return sum(bool(visible[i * block:(i + 1) * block, j * block:(j + 1) * block].any())
               for i in range(n_blocks_q) for j in range(n_blocks_k))


@pytest.mark.interpreter
def test_forward_traffic_and_flops_are_the_ideal_and_causal_skips_half(gen):
    """The ideal forward traffic: q read once, out and lse written once, and K and V read once per query
    block per q head (a program holds one query block of one head: the K/V it streams are its own).
    FLOPs: 4 B Hq Tq Tk D (two products of 2 Tq Tk D). Causal visits only the n(n+1)/2 tiles on or
    below the diagonal: (n + 1) / 2n of the work, no tile above it (skipped, not masked)."""
    batch, hq, hkv, t, d = 1, 2, 1, 128, 32
    block = attention.configs.INTERPRETER_CONFIG.BLOCK_M
    n = t // block
    q, k, v = rand(batch, hq, t, d, gen=gen), rand(batch, hkv, t, d, gen=gen), rand(batch, hkv, t, d, gen=gen)
    with trace() as full:
        kernel_ladder.flash_attention(q, k, v)
    with trace() as causal:
        kernel_ladder.flash_attention(q, k, v, causal=True)
    element = q.element_size()
    io = 2 * batch * hq * t * d * element + batch * hq * t * 4  # q read, out written, lse written
    ideal = io + n * batch * hq * 2 * t * d * element  # K and V once per query block per head
    assert full.num_launches == 1 and full.bytes == ideal, (full.bytes, ideal)
    assert full.flops == 4 * batch * hq * t * t * d
    tiles = n * (n + 1) // 2
    assert causal.flops == tiles * 4 * batch * hq * block * block * d
    assert causal.flops / full.flops == (n + 1) / (2 * n)
    causal_ideal = io + tiles * batch * hq * 2 * block * d * element
    assert causal.bytes == causal_ideal


@pytest.mark.interpreter
def test_window_and_backward_skip_every_invisible_tile(gen):
    """With a window, the forward, dK/dV and dQ kernels each visit exactly the tiles that hold a visible
    entry; the backward does 7 block products per tile (dK/dV: QK^T, dO V^T, P^T dO, dS^T Q; dQ: QK^T,
    dO V^T, dS K) against the forward's 2."""
    t, d, window = 160, 16, 40
    block = attention.configs.INTERPRETER_CONFIG.BLOCK_M
    q, k, v = leaf(rand(1, 1, t, d, gen=gen)), leaf(rand(1, 1, t, d, gen=gen)), leaf(rand(1, 1, t, d, gen=gen))
    with trace() as fwd:
        out = kernel_ladder.flash_attention(q, k, v, causal=True, window=window)
    with trace() as bwd:
        out.backward(torch.ones_like(out))
    tiles = _tiles_seen(t // block, t // block, block, True, t, t, window)
    assert tiles < (t // block) ** 2 / 2
    tile_flops = 2 * block * block * d
    assert fwd.flops == 2 * tiles * tile_flops
    kinds = {x.kernel: x.flops for x in bwd.launches}
    assert kinds["flash_attention_backward_dkdv_kernel"] == 4 * tiles * tile_flops
    assert kinds["flash_attention_backward_dq_kernel"] == 3 * tiles * tile_flops


# ----------------------------------------------------------------------------- negative controls


@triton.jit
def _top_left_diagonal(seqlen_q, seqlen_k):
    return seqlen_q * 0  # the torch SDPA convention (is_causal=True): query i sees keys j <= i


_key_range = attention.forward._key_range  # the real bounds, for the wrong variant below


@triton.jit
def _one_block_short(m0, m_last, seqlen_k, diagonal, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    lo, full_lo, full_hi, hi = _key_range(m0, m_last, seqlen_k, diagonal, window, CAUSAL, HAS_WINDOW, BLOCK_N,
                                          INDEX_64)
    return lo, full_lo, full_hi, tl.maximum(hi - BLOCK_N, full_hi)  # skips the last (masked) key block


@pytest.mark.interpreter
def test_negative_control_a_top_left_diagonal_is_caught(gen, monkeypatch):
    """The comparison fails for a kernel whose causal mask is aligned to the top left — except when
    Tq = Tk, where the two conventions agree (so that case alone could not tell them apart)."""
    q, k, v = rand(1, 2, 20, 16, gen=gen), rand(1, 2, 45, 16, gen=gen), rand(1, 2, 45, 16, gen=gen)
    monkeypatch.setattr(attention.forward, "_diagonal", _top_left_diagonal)
    with pytest.raises(AssertionError, match="elements outside"):
        assert_matches(kernel_ladder.flash_attention(q, k, v, causal=True), reference(q, k, v, causal=True)[0])
    square = k[:, :, :20], v[:, :, :20]
    assert_matches(kernel_ladder.flash_attention(q, *square, causal=True), reference(q, *square, causal=True)[0])


@pytest.mark.interpreter
def test_negative_control_a_skipped_key_block_is_caught(gen, monkeypatch):
    """Loop bounds one block too short (a plausible off-by-one in the skipping) fail the comparison."""
    q, k, v = rand(1, 2, 40, 16, gen=gen), rand(1, 2, 40, 16, gen=gen), rand(1, 2, 40, 16, gen=gen)
    monkeypatch.setattr(attention.forward, "_key_range", _one_block_short)
    for causal in (False, True):
        with pytest.raises(AssertionError, match="elements outside"):
            assert_matches(kernel_ladder.flash_attention(q, k, v, causal=causal), reference(q, k, v, causal=causal)[0])


# ----------------------------------------------------------------------------- plumbing


def test_opcheck(gen):
    q, k = rand(1, 2, 5, 16, gen=gen), rand(1, 1, 7, 16, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.flash_attention.default, (q, k, k * 0.5, True, 0.25, 3, 4.0))
    lengths = [2, 0, 3]
    qv, cu = pack(lengths, 2, 16, gen)
    torch.library.opcheck(torch.ops.kernel_ladder.flash_attention_varlen.default,
                          (qv, qv[:, :1], qv[:, 1:], cu, cu, 3, 3, False, 0.25, None, None))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_torch_compile_fullgraph_forward_and_backward(varlen, backend, gen):
    torch._dynamo.reset()
    if varlen:
        q, cu = pack([4, 9], 2, 16, gen)
        k, v = rand(*q.shape, gen=gen), rand(*q.shape, gen=gen)

        def step_terms(q, k, v):
            return kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 9, 9, causal=True, return_lse=True)
    else:
        q, k, v = rand(2, 2, 9, 16, gen=gen), rand(2, 1, 12, 16, gen=gen), rand(2, 1, 12, 16, gen=gen)

        def step_terms(q, k, v):
            return kernel_ladder.flash_attention(q, k, v, causal=True, softcap=3.0, return_lse=True)

    def step(q, k, v):
        out, lse = step_terms(q, k, v)
        return (out * 2).sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    leaves = [leaf(t) for t in (q, k, v)]
    loss = compiled(*leaves)
    loss.backward()
    eager = [leaf(t) for t in (q, k, v)]
    want = step(*eager)
    want.backward()
    exact = backend == "aot_eager"  # the same aten ops around the same kernels; Inductor fuses the rest
    # Inductor sums the loss's few hundred fp32 terms in another order: the bound scales with the sum
    # of their magnitudes (an fp32 rounding per term at most), not with the (cancelling) total.
    magnitude = sum(t.detach().abs().sum() * w for t, w in zip(step_terms(*eager), (2, 1)))
    torch.testing.assert_close(loss, want, rtol=0, atol=0 if exact else float(magnitude) * 2**-22)
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)


def test_double_backward_is_refused_clearly(gen):
    q, k = leaf(rand(1, 1, 4, 16, gen=gen)), rand(1, 1, 4, 16, gen=gen)
    (dq,) = torch.autograd.grad(kernel_ladder.flash_attention(q, k, k).pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.flash_attention \(backward\): double backward"):
        dq.sum().backward()
    qv, cu = pack([3], 1, 16, torch.Generator().manual_seed(0))
    qv = leaf(qv)
    (dq,) = torch.autograd.grad(kernel_ladder.flash_attention_varlen(qv, qv, qv, cu, cu, 3, 3).pow(2).sum(), qv,
                                create_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.flash_attention_varlen \(backward\): double backward"):
        dq.sum().backward()


def test_gpu_configs_fit_every_head_dim():
    """On a GPU every kernel keeps candidates at each head-dim tile (16 ... 256 in 16-bit types, with or
    without soft-capping; up to 128 in fp32); the pruner drops those past their register limits or the
    shared memory, and falls back to the smallest tiles when nothing fits (fp32 at 256)."""
    smem = 227 * 1024
    for kind, configs in attention.configs._GPU_CONFIGS.items():
        for block_d in (16, 32, 64, 128, 256):
            for element_size, softcap in ((2, False), (2, True), (4, False), (4, True)):
                if element_size == 4 and block_d > 128:
                    continue
                for window in (False, True):
                    assert any(attention.configs.fits(c, kind, block_d, element_size, softcap, shared_memory=smem,
                                                      window=window)
                               for c in configs), (kind, block_d, element_size, softcap, window)
        prune = attention.configs._pruner(kind)
        triton_configs = [c.to_triton() for c in configs]
        for dtype, block_d in ((torch.bfloat16, 256), (torch.bfloat16, 64), (torch.float32, 128)):
            kept = prune(triton_configs, {"q_ptr": torch.empty(1, dtype=dtype)}, BLOCK_D=block_d, SOFTCAP=False)
            assert 1 <= len(kept) < len(triton_configs) or block_d == 64, (kind, dtype, block_d)
        assert len(prune(triton_configs, {"q_ptr": torch.empty(1)}, BLOCK_D=256, SOFTCAP=True)) == 1
        # DeepSeek's MLA prefill: q/k 192 (a 256 tile), v 128: kept configs exist, and only those measured for it
        assert any(attention.configs.fits(c, kind, 256, 2, shared_memory=smem, block_dv=128) for c in configs), kind
    wide = attention.configs.FORWARD_GPU_CONFIGS[0]  # 128x128 at 64: spills with a window alone (sm_90)
    assert attention.configs.fits(wide, "forward", 64, 2, shared_memory=smem)
    assert not attention.configs.fits(wide, "forward", 64, 2, shared_memory=smem, window=True)
    assert any(attention.configs.fits(c, "forward", 64, 2, shared_memory=smem, window=True)
               for c in attention.configs.FORWARD_GPU_CONFIGS)
    # with K and V through tensor descriptors (no address registers) it takes head dim 128 (sm_90)
    assert attention.configs.fits(wide, "forward", 128, 2, shared_memory=smem, tma=True)
    assert not attention.configs.fits(wide, "forward", 128, 2, shared_memory=smem)
    assert not attention.configs.fits(wide, "forward", 128, 2, shared_memory=smem, tma=True, window=True)
    prune = attention.configs._pruner("forward")
    triton_configs = [c.to_triton() for c in attention.configs.FORWARD_GPU_CONFIGS]
    bf16 = {"q_ptr": torch.empty(1, dtype=torch.bfloat16)}
    assert triton_configs[0] in prune(triton_configs, bf16, BLOCK_D=128, SOFTCAP=False, USE_TMA=True)
    assert triton_configs[0] not in prune(triton_configs, bf16, BLOCK_D=128, SOFTCAP=False, USE_TMA=False)
    narrow = attention.configs.BACKWARD_DQ_GPU_CONFIGS[1]  # 128x32: fits 256/256, spills at 256/128 (sm_90)
    assert (narrow.BLOCK_M, narrow.BLOCK_N) == (128, 32)
    assert attention.configs.fits(narrow, "dq", 256, 2, shared_memory=smem)
    assert not attention.configs.fits(narrow, "dq", 256, 2, shared_memory=smem, block_dv=128)


def test_gpu_configs_spilling_with_int64_offsets_are_pruned():
    """The limits hold for the launches of an 8k context (int64 offsets: the tile-overrun bound passes 2**31 at 32
    heads), measured by tests/aot/flash_attention.py at sm_90: dK/dV 32x64 w4 s3 spills 32 bytes at head dim 128
    (bf16), 32x128 w8 72 and 32 bytes in fp32 at 128; the forward's 64x128 w8 s2 112 bytes at 128 with cp.async
    (not with tensor descriptors), and with 128x128 24-160 bytes in fp32 at 32; dQ 64x64 w4 s3 56 bytes soft-capped
    at 64. The first candidates at 128 stay."""
    smem = 227 * 1024

    def kept(kind, block_d, element_size=2, **switches):
        prune = attention.configs._pruner(kind)
        configs = attention.configs._GPU_CONFIGS[kind]
        q = {"q_ptr": torch.empty(1, dtype=torch.bfloat16 if element_size == 2 else torch.float32)}
        chosen = prune([c.to_triton() for c in configs], q, BLOCK_D=block_d, SOFTCAP=switches.pop("softcap", False),
                       **switches)
        return {str(c) for c in configs if c.to_triton() in chosen}

    assert attention.configs.fits(attention.configs.BACKWARD_DKDV_GPU_CONFIGS[3], "dkdv", 64, 2, shared_memory=smem)
    assert "32x64 w4 s3" not in kept("dkdv", 128)
    assert {"32x128 w8 s3", "32x128 w8 s2"} <= kept("dkdv", 128)
    assert not {"32x128 w8 s3", "32x128 w8 s2"} & kept("dkdv", 128, 4)
    assert "64x128 w8 s2" not in kept("forward", 128, USE_TMA=False)
    assert not {"128x128 w8 s2", "64x128 w8 s2"} & kept("forward", 32, 4)  # fp32: 24-160 bytes at 32
    assert {"128x128 w8 s2", "64x128 w8 s2"} <= kept("forward", 128, USE_TMA=True)
    assert "64x64 w4 s3" not in kept("dq", 64, softcap=True)
    assert {"64x64 w4 s3", "128x64 w8 s2"} <= kept("dq", 64)
    assert "128x64 w8 s2" in kept("dq", 128)


def test_autotuned_launch_path_in_the_interpreter(gen, monkeypatch):
    """The GPU launch path end to end (autotuner, pruner, the grid from the chosen tiles), forward and
    backward, with a stand-in benchmarker: the "faster" config wins, each kernel tunes once per key."""
    benched = []
    bench = alternating_bench(benched)

    candidates = (attention.configs.AttentionConfig(16, 16, 4, 1), attention.configs.AttentionConfig(32, 32, 4, 1))
    # a GPU run would reuse its disk cache
    monkeypatch.setattr(attention.configs, "autotune_supports_disk_cache", lambda: False)
    tuned = {kind: attention.configs.make_autotuned(kind, candidates, do_bench=bench)
             for kind in ("forward", "dkdv", "dq")}
    monkeypatch.setattr(attention.configs, "_fixed_config", lambda: None)
    monkeypatch.setattr(attention.configs, "_autotuned", tuned.__getitem__)
    q, k, v = rand(1, 2, 40, 16, gen=gen), rand(1, 1, 50, 16, gen=gen), rand(1, 1, 50, 16, gen=gen)
    for _ in range(2):  # the second call is served from the tuning cache
        q2, k2, v2 = leaf(q), leaf(k), leaf(v)
        out = kernel_ladder.flash_attention(q2, k2, v2, causal=True)
        out.backward(torch.ones_like(out))
    assert len(benched) == 6  # 3 kernels x 2 candidates, once
    assert all(t.best_config.kwargs == {"BLOCK_M": 32, "BLOCK_N": 32} for t in tuned.values())
    assert_matches(out, reference(q, k, v, causal=True)[0], torch.float32)
    q6, k6, v6 = (t.double().requires_grad_() for t in (q, k, v))
    reference(q6, k6, v6, causal=True)[0].sum().backward()
    for ours, exact in ((q2.grad, q6.grad), (k2.grad, k6.grad), (v2.grad, v6.grad)):
        assert_matches(ours, exact, torch.float32)


def _bad(**changes):
    base = dict(q=torch.zeros(2, 4, 5, 16), k=torch.zeros(2, 2, 7, 16), v=torch.zeros(2, 2, 7, 16))
    base.update(changes)
    return lambda: kernel_ladder.flash_attention(**base)


@pytest.mark.parametrize("call, error, message", [
    (_bad(k=torch.zeros(2, 3, 7, 16), v=torch.zeros(2, 3, 7, 16)), ValueError,
     r"^kernel_ladder\.flash_attention: the query heads \(4\) must be a multiple of the key/value heads \(3\)"),
    (_bad(q=torch.zeros(2, 4, 5, 8)), ValueError, r"q and k must share the head dim D .* got 8 and 16"),
    (_bad(q=torch.zeros(1, 1, 5, 320), k=torch.zeros(1, 1, 5, 320), v=torch.zeros(1, 1, 5, 320)), ValueError,
     r"the head dim D of q and k must be in \[1, 256\], got 320"),
    (_bad(v=torch.zeros(2, 2, 7, 16, dtype=torch.float16)), TypeError, r"q and v must have the same dtype"),
    (_bad(q=torch.zeros(2, 4, 5, 16, dtype=torch.int64)), TypeError, r"q must be float32, float16 or bfloat16"),
    (_bad(q=torch.zeros(4, 5, 16)), ValueError, r"q must be 4-D \(B, Hq, Tq, D\), got shape \(4, 5, 16\)"),
    (_bad(v=torch.zeros(2, 2, 6, 16)), ValueError, r"k and v must have the same shape"),
    (_bad(k=torch.zeros(1, 2, 7, 16), v=torch.zeros(1, 2, 7, 16)), ValueError, r"q and k must have the same batch"),
    (_bad(q="q"), TypeError, r"q must be a torch\.Tensor, got str"),
    (_bad(k=torch.zeros(2, 2, 7, 16, device="meta")), ValueError, r"q and k must be on the same device"),
    (_bad(window=4), ValueError, r"window=4 needs causal=True"),
    (_bad(causal=True, window=0), ValueError, r"window must be >= 1"),
    (_bad(causal=True, window=2.5), TypeError, r"window must be an int"),
    (_bad(softcap=0.0), ValueError, r"softcap must be a positive finite number"),
    (_bad(softcap="x"), TypeError, r"softcap must be a float or None"),
    (_bad(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a positive finite number"),
    (_bad(causal=1), TypeError, r"causal must be a bool"),
    (_bad(return_lse=None), TypeError, r"return_lse must be a bool"),
])
def test_bad_input_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_bad_varlen_input_errors():
    q, cu = torch.zeros(7, 2, 16), torch.tensor([0, 3, 7], dtype=torch.int32)
    op = kernel_ladder.flash_attention_varlen
    cases = [
        (lambda: op(q[None], q, q, cu, cu, 4, 4), ValueError,
         r"^kernel_ladder\.flash_attention_varlen: q must be 3-D \(total_Tq, Hq, D\)"),
        (lambda: op(q, q, q, cu.long(), cu, 4, 4), TypeError, r"cu_seqlens_q must be int32"),
        (lambda: op(q, q, q, cu, cu[None], 4, 4), ValueError, r"cu_seqlens_k must be 1-D \(B \+ 1,\)"),
        (lambda: op(q, q, q, cu, cu[:2], 4, 4), ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
        (lambda: op(q, q, q, cu, cu, 4.0, 4), TypeError, r"max_seqlen_q must be an int"),
        (lambda: op(q, q, q, cu, cu, 4, -1), ValueError, r"max_seqlen_k must be >= 0"),
        (lambda: op(q, q[:, :1], q, cu, cu, 4, 4), ValueError, r"k and v must have the same shape"),
        (lambda: op(q, q, q, cu, cu, 4, 4, window=3), ValueError, r"needs causal=True"),
    ]
    if torch.cuda.is_available():
        cases.append((lambda: op(q.cuda(), q.cuda(), q.cuda(), cu, cu, 4, 4), ValueError,
                      r"q and cu_seqlens_q must be on the same device"))
        cases.append((lambda: kernel_ladder.flash_attention(q[None].cuda(), q[None], q[None]), ValueError,
                      r"q and k must be on the same device"))
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


# ----------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"causal": True, "window": 1024, "softcap": 30.0}],
                         ids=str)
def test_gpu_real_sizes(dtype, options):
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch, hq, hkv, tq, tk, d in ((4, 16, 4, 2048, 2048, 128), (2, 8, 8, 1024, 3000, 64), (8, 32, 8, 1, 4096, 128),
                                      (2, 8, 2, 777, 777, 80), (1, 4, 1, 512, 512, 256)):
        q = torch.randn(batch, hq, tq, d, device="cuda", generator=g, dtype=dtype).requires_grad_()
        k = torch.randn(batch, hkv, tk, d, device="cuda", generator=g, dtype=dtype).requires_grad_()
        v = torch.randn(batch, hkv, tk, d, device="cuda", generator=g, dtype=dtype).requires_grad_()
        out = kernel_ladder.flash_attention(q, k, v, **options)
        grad = torch.randn_like(out)
        got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
        want = reference_grads(q.float(), k.float(), v.float(), grad.float(), dtype=torch.float32, **options)
        lowp = reference_grads(q, k, v, grad, dtype=dtype, **options)
        for name, ours, exact, theirs in zip(("out", "dq", "dk", "dv"), got, [want[0], *want[2:]],
                                             [lowp[0], *lowp[2:]]):
            assert_matches(ours, exact, dtype, lowp=theirs, what=f"{name} {(batch, hq, hkv, tq, tk, d)}")


@pytest.mark.gpu
def test_gpu_varlen_real_sizes():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 0, 2048, 517, 3000, 64]
    q, cu = pack(lengths, 16, 128, g, torch.bfloat16)
    k, v = rand(q.shape[0], 4, 128, gen=g, dtype=torch.bfloat16), rand(q.shape[0], 4, 128, gen=g, dtype=torch.bfloat16)
    out = kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    for b in range(len(lengths)):
        r = slice(int(cu[b]), int(cu[b + 1]))
        if r.start == r.stop:
            continue
        dense = kernel_ladder.flash_attention(*(t[r].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        assert torch.equal(out[r], dense[0].transpose(0, 1))
