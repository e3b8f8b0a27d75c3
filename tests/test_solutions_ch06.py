"""Chapter 06's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (same launcher, same kind of cases), once with
the solution (SOLVED) and once per negative control — a plausible wrong answer the checker must
reject, with the diagnosis it must give.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch06_fused_ops as solutions
from utils.exercises import check
from utils.trace import trace

pytestmark = pytest.mark.interpreter  # the traffic checks and diagnoses need the interpreter

DEVICE = kernel_ladder.runtime.DEVICE


# ----------------------------------------------------------------------------------------------
# Exercise 1: the RoPE token kernel (the notebook's launcher, cases and reference)
# ----------------------------------------------------------------------------------------------


def rope_tokens_with(kernel):
    def rope_tokens(x, cos, sin, out):
        with trace() as traced:
            solutions.launch_rope_tokens(kernel, x, cos, sin, out)
        table_reads = sum(launch.per_tensor[name].bytes_read for launch in traced.launches
                          for name in ("cos_ptr", "sin_ptr") if name in launch.per_tensor)
        once = x.shape[0] * x.shape[2] * 2 * cos.shape[-1] * cos.element_size()
        if table_reads > once:
            raise AssertionError(f"the kernel read {table_reads:,} bytes of cos/sin, {table_reads / once:.0f}x "
                                 "one row per token: load the row once and use it for every head")
        return out

    return rope_tokens


def rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    c1, c2, s1, s2 = cos[:, :half], cos[:, half:], sin[:, :half], sin[:, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def rope_cases(gen):
    cases = []
    for (b, h, t, d), dtype in [((2, 3, 5, 32), torch.float32), ((1, 5, 7, 16), torch.bfloat16),
                                ((3, 1, 2, 64), torch.float32)]:
        x = torch.randn(b, h, t, d, generator=gen).to(dtype)
        cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
        cases.append((x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)))
    return cases


@triton.jit
def rope_stub_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    pass


@triton.jit
def rope_per_head_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    # Right values, but the table row reloaded for every head (the row kernel's traffic).
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = t.to(tl.int64) * (2 * HALF)
    for h in range(0, n_heads):
        c1 = tl.load(cos_ptr + table + j)
        c2 = tl.load(cos_ptr + table + HALF + j)
        s1 = tl.load(sin_ptr + table + j)
        s2 = tl.load(sin_ptr + table + HALF + j)
        row = ((b * n_heads + h).to(tl.int64) * seq_len + t) * (2 * HALF)
        x1 = tl.load(x_ptr + row + j).to(tl.float32)
        x2 = tl.load(x_ptr + row + HALF + j).to(tl.float32)
        tl.store(out_ptr + row + j, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + row + HALF + j, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty))


@triton.jit
def rope_one_half_table_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr,
                               BLOCK_H: tl.constexpr):
    # Reads only the first half of the tables (right for HF's duplicated tables, not in general).
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = t.to(tl.int64) * (2 * HALF)
    c = tl.load(cos_ptr + table + j)[None, :]
    s = tl.load(sin_ptr + table + j)[None, :]
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None]
    rows = ((b * n_heads + heads).to(tl.int64) * seq_len + t) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :], mask=mask).to(tl.float32)
    tl.store(out_ptr + rows[:, None] + j[None, :], (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + rows[:, None] + HALF + j[None, :], (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_unmasked_heads_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr,
                               BLOCK_H: tl.constexpr):
    # No head mask: with H not a power of two, the padded heads read and write past the token.
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = t.to(tl.int64) * (2 * HALF)
    c1 = tl.load(cos_ptr + table + j)[None, :]
    c2 = tl.load(cos_ptr + table + HALF + j)[None, :]
    s1 = tl.load(sin_ptr + table + j)[None, :]
    s2 = tl.load(sin_ptr + table + HALF + j)[None, :]
    heads = tl.arange(0, BLOCK_H)
    rows = ((b * n_heads + heads).to(tl.int64) * seq_len + t) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :]).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :]).to(tl.float32)
    tl.store(out_ptr + rows[:, None] + j[None, :], (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + rows[:, None] + HALF + j[None, :], (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty))


def test_rope_token_kernel_solution_is_solved():
    assert check("ch06.rope_token_kernel", rope_tokens_with(solutions.rope_token_kernel), rope_reference, rope_cases,
                 out=True).solved


@pytest.mark.parametrize(("kernel", "diagnosis"), [
    (rope_stub_kernel, "never written"),
    (rope_per_head_kernel, "bytes of cos/sin"),
    (rope_one_half_table_kernel, "wrong values"),
    (rope_unmasked_heads_kernel, "out of bounds"),
], ids=["stub", "table per head", "one half of the table", "unmasked heads"])
def test_rope_token_kernel_negative_controls(kernel, diagnosis):
    verdict = check("ch06.rope_token_kernel", rope_tokens_with(kernel), rope_reference, rope_cases, out=True)
    assert not verdict.solved and diagnosis in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 2: the RoPE backward
# ----------------------------------------------------------------------------------------------


def rope_backward_by_autograd(grad, cos, sin):
    x = torch.zeros(grad.shape, dtype=torch.float64, device=grad.device, requires_grad=True)
    (dx,) = torch.autograd.grad(rope_reference(x, cos.double(), sin.double()), x, grad.double())
    return dx


def rope_backward_cases(gen):
    cases = []
    for shape, dtype in [((2, 3, 5, 16), torch.float32), ((1, 4, 6, 32), torch.bfloat16)]:
        t, d = shape[2], shape[3]
        grad = torch.randn(shape, generator=gen).to(dtype)
        cases.append((grad.to(DEVICE), torch.randn(t, d, generator=gen).to(DEVICE, dtype),
                      torch.randn(t, d, generator=gen).to(DEVICE, dtype)))
    return cases


def backward_with_the_forward_rotation(grad, cos, sin):
    return rope_reference(grad.float(), cos.float(), sin.float()).to(grad.dtype)


def backward_rotating_by_minus_sin(grad, cos, sin):
    # the inverse rotation: right for HF's tables (c1 = c2, s1 = s2), wrong for general ones
    half = grad.shape[-1] // 2
    g1, g2 = grad.float()[..., :half], grad.float()[..., half:]
    c, s = cos.float()[:, :half], sin.float()[:, :half]
    return torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), -1).to(grad.dtype)


def test_rope_backward_solution_and_negative_controls():
    assert check("ch06.rope_backward", solutions.rope_backward, rope_backward_by_autograd, rope_backward_cases).solved
    for wrong in (backward_with_the_forward_rotation, backward_rotating_by_minus_sin):
        verdict = check("ch06.rope_backward", wrong, rope_backward_by_autograd, rope_backward_cases)
        assert not verdict.solved and "wrong values" in verdict.message, verdict.message


def test_rope_backward_matches_the_kernels_backward(gen):
    """The exercise's formula is what kernel_ladder.rope's BACKWARD kernel computes."""
    q = torch.randn(1, 2, 4, 16, generator=gen).to(DEVICE).requires_grad_()
    cos, sin = kernel_ladder.rope_cos_sin(torch.arange(4, device=DEVICE), 16)
    q_embed, _ = kernel_ladder.rope(q, q.detach()[:, :1], cos, sin)
    g = torch.randn(q_embed.shape, generator=gen).to(DEVICE)
    (dq,) = torch.autograd.grad(q_embed, q, g)
    torch.testing.assert_close(dq, solutions.rope_backward(g, cos, sin), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Exercise 3: one chunk of the fused loss
# ----------------------------------------------------------------------------------------------


def chunk_by_autograd(x, weight, target, n_valid, ignore_index=-100):
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    losses = F.cross_entropy(x64 @ w64.T, target, ignore_index=ignore_index, reduction="none")
    share = losses.sum() / n_valid
    grad_x, grad_w = torch.autograd.grad(share, (x64, w64))
    return share.detach(), grad_x, grad_w


def chunk_cases(gen):
    cases = []
    for rows, hidden, vocab, n_valid in [(8, 16, 50, 20), (5, 24, 97, 5), (6, 8, 33, 31)]:
        x = torch.randn(rows, hidden, generator=gen)
        weight = torch.randn(vocab, hidden, generator=gen) * 0.3
        target = torch.randint(0, vocab, (rows,), generator=gen)
        target[1] = -100
        cases.append((x.to(DEVICE), weight.to(DEVICE), target.to(DEVICE), n_valid))
    return cases


def chunk_over_its_own_rows(x, weight, target, n_valid, ignore_index=-100):
    own = int((target != ignore_index).sum())
    return solutions.fused_linear_ce_chunk(x, weight, target, own, ignore_index)


def chunk_counting_ignored_rows(x, weight, target, n_valid, ignore_index=-100):
    safe = torch.where(target == ignore_index, torch.zeros_like(target), target)
    return solutions.fused_linear_ce_chunk(x, weight, safe, n_valid, ignore_index)


def test_fused_chunk_solution_and_negative_controls():
    kwargs = dict(rtol=1e-5, atol=1e-6)
    assert check("ch06.fused_linear_ce_chunk", solutions.fused_linear_ce_chunk, chunk_by_autograd, chunk_cases,
                 **kwargs).solved
    for wrong in (chunk_over_its_own_rows, chunk_counting_ignored_rows):
        verdict = check("ch06.fused_linear_ce_chunk", wrong, chunk_by_autograd, chunk_cases, **kwargs)
        assert not verdict.solved and "wrong value" in verdict.message, verdict.message


def test_chunks_add_up_to_the_batch_loss(gen):
    x = torch.randn(12, 16, generator=gen).to(DEVICE)
    weight = (torch.randn(40, 16, generator=gen) * 0.3).to(DEVICE)
    target = torch.randint(0, 40, (12,), generator=gen).to(DEVICE)
    target[3] = -100
    n_valid = int((target != -100).sum())
    parts = [solutions.fused_linear_ce_chunk(x[i:i + 5], weight, target[i:i + 5], n_valid) for i in (0, 5, 10)]
    loss = sum(p[0] for p in parts)
    torch.testing.assert_close(loss, F.cross_entropy(x @ weight.T, target), rtol=1e-5, atol=1e-6)
    w = weight.detach().requires_grad_()
    (want_grad_w,) = torch.autograd.grad(F.cross_entropy(x @ w.T, target), [w])
    torch.testing.assert_close(sum(p[2] for p in parts), want_grad_w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Exercise 4: the chunk from a budget
# ----------------------------------------------------------------------------------------------


def chunk_by_search(budget_bytes, bytes_per_row, n_rows):
    best, c = 1, 1
    while c <= triton.next_power_of_2(max(1, n_rows)):
        if c * bytes_per_row <= budget_bytes:
            best = c
        c *= 2
    return best


BUDGET_CASES = [(1 << 20, 4096, 10_000), (4095, 4096, 10), (10**9, 512, 100), (3 * 4096, 4096, 64),
                (0, 100, 5), (1 << 16, 256, 1)]


def rounds_up(budget_bytes, bytes_per_row, n_rows):
    return triton.next_power_of_2(max(1, budget_bytes // bytes_per_row))


def no_floor(budget_bytes, bytes_per_row, n_rows):
    fit = budget_bytes // bytes_per_row
    return 0 if fit == 0 else min(1 << (fit.bit_length() - 1), triton.next_power_of_2(n_rows))


def no_cap(budget_bytes, bytes_per_row, n_rows):
    fit = max(1, budget_bytes // bytes_per_row)
    return 1 << (fit.bit_length() - 1)


def test_chunk_size_for_budget_solution_and_negative_controls():
    assert check("ch06.chunk_size_for_budget", solutions.chunk_size_for_budget, chunk_by_search, BUDGET_CASES).solved
    for wrong in (rounds_up, no_floor, no_cap):
        verdict = check("ch06.chunk_size_for_budget", wrong, chunk_by_search, BUDGET_CASES)
        assert not verdict.solved and "wrong value" in verdict.message, (wrong.__name__, verdict.message)
