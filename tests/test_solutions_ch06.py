"""Chapter 06's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked exactly as the notebook checks it — the chapter's givens in
``solutions/ch06_fused_ops.py``: its reference, cases, stated rules, diagnosis and traffic verdict —
once with the solution (SOLVED) and once per negative control: a plausible wrong answer the checker
must reject, with the verdict naming its cause.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch06_fused_ops as given
from solutions import ch06_fused_ops as solutions
from utils.exercises import Verdict, check

pytestmark = pytest.mark.interpreter  # the traffic checks and diagnoses need the interpreter

DEVICE = kernel_ladder.runtime.DEVICE


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_not_solved(verdict: Verdict, *fragments: str) -> None:
    assert not verdict.solved, verdict.message
    for fragment in fragments:
        assert flat(fragment) in flat(verdict.message), f"{fragment!r} not in:\n{verdict.message}"


# ----------------------------------------------------------------------------------------------
# Exercise 1: the RoPE token kernel (the notebook's launcher, cases and reference)
# ----------------------------------------------------------------------------------------------


def check_rope_tokens(kernel) -> Verdict:
    """Exercise 1's check, as the notebook's check cell makes it."""
    return check("ch06_fused_ops.rope_token_kernel", given.rope_tokens_with(kernel), given.rope_reference,
                 given.rope_cases, out=True, rules=given.rope_token_rules(), diagnose=given.diagnose_rope_tokens,
                 traffic=given.rope_token_traffic())


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


@triton.jit
def rope_kernel_with(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BUG: tl.constexpr):
    # The solution's kernel with one planted mistake (BUG): 1 the rotation the other way, 2 the halves
    # stored swapped, 3 the second store's offset missing + HALF, 4 cos and sin swapped.
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = t.to(tl.int64) * (2 * HALF)
    c1 = tl.load(cos_ptr + table + j).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF + j).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table + j).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF + j).to(tl.float32)[None, :]
    if BUG == 4:
        c1, c2, s1, s2 = s1, s2, c1, c2
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None]
    rows = ((b * n_heads + heads).to(tl.int64) * seq_len + t) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :], mask=mask).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    if BUG == 1:
        y1 = x1 * c1 + x2 * s1
        y2 = x2 * c2 - x1 * s2
    if BUG == 2:
        y1, y2 = y2, y1
    second = rows[:, None] + HALF + j[None, :]
    if BUG == 3:
        second = rows[:, None] + j[None, :]
    tl.store(out_ptr + rows[:, None] + j[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + second, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_table_by_program_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr,
                                 BLOCK_H: tl.constexpr):
    # The table row indexed by the program (the token of the whole batch), not by its position t: the
    # second sequence's tokens read rows past the table's end.
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = token.to(tl.int64) * (2 * HALF)
    c1 = tl.load(cos_ptr + table + j).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF + j).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table + j).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF + j).to(tl.float32)[None, :]
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None]
    rows = ((b * n_heads + heads).to(tl.int64) * seq_len + t) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :], mask=mask).to(tl.float32)
    tl.store(out_ptr + rows[:, None] + j[None, :], (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + rows[:, None] + HALF + j[None, :], (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


def planted(bug: int):
    """``rope_kernel_with`` with ``BUG`` fixed, indexable by a grid as the launcher indexes a kernel."""

    class Planted:
        def __getitem__(self, grid):
            return lambda *args, **kw: rope_kernel_with[grid](*args, **kw, BUG=bug)

    return Planted()


@triton.jit
def rope_in_bf16_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    # Computes in x's dtype: the table and x never upcast (bf16 arithmetic for the bf16 case).
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = t.to(tl.int64) * (2 * HALF)
    c1 = tl.load(cos_ptr + table + j).to(x_ptr.dtype.element_ty)[None, :]
    c2 = tl.load(cos_ptr + table + HALF + j).to(x_ptr.dtype.element_ty)[None, :]
    s1 = tl.load(sin_ptr + table + j).to(x_ptr.dtype.element_ty)[None, :]
    s2 = tl.load(sin_ptr + table + HALF + j).to(x_ptr.dtype.element_ty)[None, :]
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None]
    rows = ((b * n_heads + heads).to(tl.int64) * seq_len + t) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :], mask=mask)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None] + j[None, :], x1 * c1 - x2 * s1, mask=mask)
    tl.store(out_ptr + rows[:, None] + HALF + j[None, :], x2 * c2 + x1 * s2, mask=mask)


def test_rope_token_kernel_solution_is_solved_with_its_rule_and_traffic():
    verdict = check_rope_tokens(solutions.rope_token_kernel)
    assert verdict.solved, verdict.message
    assert "rules kept: the token's table row read once for all its heads" in flat(verdict.message)
    # The last case: 3 sequences share one (2, 64) table, read once per sequence: 1.5x the ideal.
    assert verdict.traffic.reread["cos"] == 3.0 and verdict.traffic.reread["x"] == 1.0
    assert ("traffic: 1.50× the ideal bytes (6.14 kB moved, 4.1 kB ideal; the ladder's top moves 1.00×) — cos read "
            "3.00× its size, sin 3.00×: the (T, D) tables are read once per sequence of the batch (3×)") in flat(
        verdict.message)


@pytest.mark.parametrize(("kernel", "diagnosis"), [
    (rope_stub_kernel, ["never written"]),
    (rope_per_head_kernel, ["broke a stated rule — the token's table row read once for all its heads: the kernel read",
                            "one row of each per token: load the token's row once and use it for every head"]),
    (rope_one_half_table_kernel, ["cause: the second half used the first half of the tables (c1, s1)"]),
    (rope_unmasked_heads_kernel, ["out of bounds"]),
    (planted(1), ["cause: the rotation runs the other way (the sin terms' signs flipped)"]),
    (planted(2), ["cause: the two halves are stored swapped"]),
    (planted(4), ["cause: cos and sin are swapped"]),
    (rope_table_by_program_kernel, ["cause: the table row is indexed by the program id (the token of the whole "
                                    "batch), not by its position t = pid % seq_len"]),
    (rope_in_bf16_kernel, ["case 2 of 3", "cause: this is the bf16 case (the fp32 case before it passed)",
                           "compute in fp32 and round once at the store"]),
], ids=["stub", "table per head", "one half of the table", "unmasked heads", "opposite rotation", "halves swapped",
        "cos and sin swapped", "table by program id", "bf16 arithmetic"])
def test_rope_token_kernel_negative_controls(kernel, diagnosis):
    assert_not_solved(check_rope_tokens(kernel), *diagnosis)


def test_rope_token_kernel_second_store_offset_is_named_not_the_grid():
    verdict = check_rope_tokens(planted(3))
    lines, start = inspect.getsourcelines(rope_kernel_with.fn)
    second = [start + i for i, line in enumerate(lines) if "tl.store(" in line][1]
    assert_not_solved(verdict, f"the store at line {second} of rope_kernel_with wrote over what the store at line",
                      f"check the offsets of the store at line {second} of rope_kernel_with",
                      "no program stored to columns 16..31 (every row)")
    assert "grid" not in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 2: the RoPE backward
# ----------------------------------------------------------------------------------------------


def check_rope_backward(candidate) -> Verdict:
    return check("ch06_fused_ops.rope_backward", candidate, given.rope_backward_reference, given.rope_backward_cases,
                 rules=given.rope_backward_rules(candidate), diagnose=given.diagnose_rope_backward,
                 traffic=given.rope_backward_traffic())


def halves(t):
    return t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2 :]


def backward_with_the_forward_rotation(grad, cos, sin):
    return given.rope_reference(grad.float(), cos.float(), sin.float()).to(grad.dtype)


def backward_rotating_by_minus_sin(grad, cos, sin):
    # the inverse rotation: right for HF's tables (c1 = c2, s1 = s2), wrong for general ones
    (g1, g2), c, s = halves(grad.float()), cos.float()[:, : grad.shape[-1] // 2], sin.float()[:, : grad.shape[-1] // 2]
    return torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), -1).to(grad.dtype)


def backward_with_the_sines_swapped(grad, cos, sin):
    (g1, g2), (c1, c2), (s1, s2) = halves(grad.float()), halves(cos.float()), halves(sin.float())
    return torch.cat((g1 * c1 + g2 * s1, g2 * c2 - g1 * s2), -1).to(grad.dtype)


def backward_in_bf16(grad, cos, sin):
    # The right formula, never upcast: every product and sum rounded to bf16.
    (g1, g2), (c1, c2), (s1, s2) = halves(grad), halves(cos), halves(sin)
    return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), -1)


def backward_with_the_tables_rounded(grad, cos, sin):
    # fp32 tables rounded to grad's bf16 first: the check's bf16 gradient with fp32 tables catches it.
    g, c, s = grad.float(), cos.to(grad.dtype).float(), sin.to(grad.dtype).float()
    (g1, g2), (c1, c2), (s1, s2) = halves(g), halves(c), halves(s)
    return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1).to(grad.dtype)


def backward_with_the_halves_swapped(grad, cos, sin):
    g, c, s = grad.float(), cos.float(), sin.float()
    (g1, g2), (c1, c2), (s1, s2) = halves(g), halves(c), halves(s)
    return torch.cat((g2 * c2 - g1 * s1, g1 * c1 + g2 * s2), dim=-1).to(grad.dtype)  # dx2 first


def test_rope_backward_solution_is_solved_with_its_rule_and_traffic():
    verdict = check_rope_backward(solutions.rope_backward)
    assert verdict.solved, verdict.message
    assert "rules kept: compute in fp32, return grad's dtype" in flat(verdict.message)
    assert verdict.traffic.ratio > 3  # torch's ops each write and re-read: the lesson of the fused kernel
    assert "each torch op writes its result and the next reads it back" in flat(verdict.message)


@pytest.mark.parametrize(("wrong", "cause"), [
    (backward_with_the_forward_rotation, "cause: that is the forward rotation again"),
    (backward_rotating_by_minus_sin, "cause: the rotation by the opposite angle with the tables' first halves is right "
                                     "only for HF's tables"),
    (backward_with_the_sines_swapped, "cause: the sines are swapped"),
    (backward_with_the_halves_swapped, "cause: the two halves are swapped in the cat: dx1 = g1·c1 + g2·s2 goes first"),
    (backward_with_the_tables_rounded, "broke a stated rule — fp32 tables used at their precision: with fp32 tables "
                                       "(a bf16 grad): the fp32 tables were rounded to bfloat16 (grad's dtype) before "
                                       "use"),
], ids=["forward rotation", "HF's inverse", "sines swapped", "halves swapped", "tables rounded"])
def test_rope_backward_negative_controls(wrong, cause):
    assert_not_solved(check_rope_backward(wrong), cause)


def test_rope_backward_in_bf16_breaks_the_fp32_rule():
    # bf16 arithmetic passes bf16's value tolerance often; the rule (each element within one bf16 step of
    # the exact gradient) catches it on every draw, and the verdict says the arithmetic ran in bf16.
    for _ in range(3):
        verdict = check_rope_backward(backward_in_bf16)
        assert not verdict.solved and "case 2 of 2" in verdict.message, verdict.message
        assert ("broke a stated rule — compute in fp32, return grad's dtype" in flat(verdict.message)
                or "cause: the arithmetic ran in bfloat16" in flat(verdict.message)), verdict.message
        assert "the low precision" in flat(verdict.message) or "ran in bfloat16" in flat(verdict.message)


def test_the_fp32_rule_holds_for_the_solution_on_many_draws(gen):
    for _ in range(20):
        for case in given.rope_backward_cases(gen):
            assert given._fp32_then_rounded(case, solutions.rope_backward(*case)) is None


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


def check_chunk(candidate) -> Verdict:
    return check("ch06_fused_ops.fused_linear_ce_chunk", candidate, given.chunk_reference, given.chunk_cases,
                 rtol=1e-5, atol=1e-6, tolerance=given.chunk_tolerance, diagnose=given.diagnose_chunk)


def chunk_over_its_own_rows(x, weight, target, n_valid, ignore_index=-100):
    own = int((target != ignore_index).sum())
    return solutions.fused_linear_ce_chunk(x, weight, target, own, ignore_index)


def chunk_counting_ignored_rows(x, weight, target, n_valid, ignore_index=-100):
    safe = torch.where(target == ignore_index, torch.zeros_like(target), target)
    return solutions.fused_linear_ce_chunk(x, weight, safe, n_valid, ignore_index)


def chunk_without_scaled_gradients(x, weight, target, n_valid, ignore_index=-100):
    share, grad_x, grad_w = solutions.fused_linear_ce_chunk(x, weight, target, n_valid, ignore_index)
    return share, grad_x * n_valid, grad_w * n_valid


def chunk_with_a_naive_softmax(x, weight, target, n_valid, ignore_index=-100):
    z = x.float() @ weight.float().T
    p = torch.exp(z) / torch.exp(z).sum(dim=-1, keepdim=True)  # overflows at logits above ~88
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    nll = -torch.log(p.gather(1, safe[:, None]).squeeze(1))
    share = torch.where(valid, nll, torch.zeros_like(nll)).sum() / n_valid
    g = p.clone()
    g[torch.arange(len(safe)), safe] -= 1.0
    g = torch.where(valid[:, None], g, torch.zeros_like(g)) / n_valid
    return share, g @ weight.float(), g.T @ x.float()


def chunk_with_ignored_gradients(x, weight, target, n_valid, ignore_index=-100):
    loss, _, _ = solutions.fused_linear_ce_chunk(x, weight, target, n_valid, ignore_index)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    g = torch.softmax(x.float() @ weight.float().T, dim=-1)
    g[torch.arange(len(safe)), safe] -= 1.0
    g = g / n_valid  # the ignored rows' gradient kept: their loss is 0, so must their gradient be
    return loss, g @ weight.float(), g.T @ x.float()


def test_fused_chunk_solution_is_solved():
    for _ in range(10):  # fresh draws: the case with logits in the hundreds rounds differently on each
        verdict = check_chunk(solutions.fused_linear_ce_chunk)
        assert verdict.solved, verdict.message


@pytest.mark.parametrize(("wrong", "cause"), [
    (chunk_over_its_own_rows, "cause: divided by the chunk's own"),
    (chunk_counting_ignored_rows, "cause: the ignored rows (target = ignore_index) are counted"),
    (chunk_without_scaled_gradients, "cause: the gradients miss the 1 / n_valid the loss share has"),
    (chunk_with_a_naive_softmax, "cause: NaN/inf: the logits reach"),
    (chunk_with_ignored_gradients, "cause: the ignored rows' gradient is not zeroed"),
], ids=["own rows", "ignored rows counted", "unscaled gradients", "naive softmax", "ignored gradient kept"])
def test_fused_chunk_negative_controls(wrong, cause):
    assert_not_solved(check_chunk(wrong), cause)


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


def check_chunk_size(candidate) -> Verdict:
    return check("ch06_fused_ops.chunk_size_for_budget", candidate, given.chunk_by_search, given.BUDGET_CASES,
                 diagnose=given.diagnose_chunk_size)


def rounds_up(budget_bytes, bytes_per_row, n_rows):
    return min(triton.next_power_of_2(max(1, budget_bytes // bytes_per_row)), triton.next_power_of_2(n_rows))


def no_floor(budget_bytes, bytes_per_row, n_rows):
    fit = budget_bytes // bytes_per_row
    return 0 if fit == 0 else min(1 << (fit.bit_length() - 1), triton.next_power_of_2(n_rows))


def no_cap(budget_bytes, bytes_per_row, n_rows):
    fit = max(1, budget_bytes // bytes_per_row)
    return 1 << (fit.bit_length() - 1)


def by_float_log2(budget_bytes, bytes_per_row, n_rows):
    import math

    fit = max(1, budget_bytes // bytes_per_row)
    return min(1 << int(math.log2(fit)), triton.next_power_of_2(n_rows))


def as_a_float(budget_bytes, bytes_per_row, n_rows):
    import math

    fit = max(1, budget_bytes // bytes_per_row)
    return min(2.0 ** math.floor(math.log2(fit)), triton.next_power_of_2(n_rows))


def by_true_division(budget_bytes, bytes_per_row, n_rows):
    fit = max(1, int(budget_bytes / bytes_per_row))  # a float quotient: rounds past 2**53
    return min(1 << (fit.bit_length() - 1), triton.next_power_of_2(n_rows))


def capped_at_n_rows(budget_bytes, bytes_per_row, n_rows):
    fit = max(1, budget_bytes // bytes_per_row)
    return min(1 << (fit.bit_length() - 1), n_rows)  # not a power of two when n_rows is not


def as_numpy_int(budget_bytes, bytes_per_row, n_rows):
    import numpy as np

    return np.int64(solutions.chunk_size_for_budget(budget_bytes, bytes_per_row, n_rows))


def test_chunk_size_for_budget_solution_is_solved():
    verdict = check_chunk_size(solutions.chunk_size_for_budget)
    assert verdict.solved, verdict.message


@pytest.mark.parametrize(("wrong", "cause"), [
    (rounds_up, "cause: rounded up to a power of two"),
    (no_floor, "cause: 0 rows when the budget holds less than one"),
    (no_cap, "cause: not capped at the next power of two of n_rows"),
    (by_float_log2, "cause: the float log2 rounded up a power of two past 2**53"),
    (as_a_float, "expected an exact int, got float"),
    (by_true_division, "cause: budget_bytes / bytes_per_row is a float division: past 2**53 its quotient rounds"),
    (capped_at_n_rows, "cause: capped at n_rows (100), not at its next power of two (128)"),
    (as_numpy_int, "cause: numpy.int64 is not an int"),
], ids=["rounds up", "no floor", "no cap", "float log2", "a float", "true division", "capped at n_rows", "numpy int"])
def test_chunk_size_for_budget_negative_controls(wrong, cause):
    assert_not_solved(check_chunk_size(wrong), cause)
