"""Chapter 07's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked exactly as the notebook checks it — the chapter's givens in
``solutions/ch07_flash_attention.py``: its reference, cases (adversarial ones included), stated
rules, diagnosis and traffic verdict — once with the solution (SOLVED) and once per negative
control: a plausible wrong answer the checker must reject, with the verdict naming its cause.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch07_flash_attention as given
from solutions import ch07_flash_attention as solutions
from solutions.ch07_flash_attention import kv_head_index as solution_kv_head_index
from utils.exercises import Verdict, check

pytestmark = pytest.mark.interpreter  # the traffic checks and diagnoses need the interpreter

DEVICE = kernel_ladder.runtime.DEVICE


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_not_solved(verdict: Verdict, *fragments: str) -> None:
    assert not verdict.solved, verdict.message
    for fragment in fragments:
        assert flat(fragment) in flat(verdict.message), f"{fragment!r} not in:\n{verdict.message}"


def attention_reference(q, k, v):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v.double(), lse.float()


# ----------------------------------------------------------------------------------------------
# Exercise 1: the online softmax's update
# ----------------------------------------------------------------------------------------------


def check_fold(update) -> Verdict:
    """Exercise 1's check, as the notebook's check cell makes it."""
    return check("ch07_flash_attention.online_softmax_update", given.fold_tiles_with(update), given.fold_reference,
                 given.fold_cases, rules=given.online_softmax_rules(update), diagnose=given.diagnose_fold)


def update_without_rescaling_acc(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(dim=1))
    safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - safe)
    p = torch.exp(scores - safe[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc + p @ v  # acc still relative to the old maximum


def update_without_the_infinity_guard(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(dim=1))
    alpha = torch.exp(m - m_new)  # exp(-inf - (-inf)) = NaN for a row that has seen no key yet
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


def update_with_the_tile_maximum(m, l, acc, scores, v):
    tile_max = scores.amax(dim=1)  # each tile's terms relative to its own maximum: not one scale
    safe = torch.where(tile_max == float("-inf"), torch.zeros_like(tile_max), tile_max)
    p = torch.exp(scores - safe[:, None])
    return torch.maximum(m, tile_max), l + p.sum(dim=1), acc + p @ v


def update_with_the_tile_overflowing(m, l, acc, scores, v):
    # Rescales towards each tile's own maximum: exp(m - tile_max) overflows when the maximum falls by 190.
    tile = scores.amax(dim=1)
    safe = torch.where(tile == float("-inf"), torch.zeros_like(tile), tile)
    old = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    alpha = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(old - safe))
    p = torch.exp(scores - safe[:, None])
    m_new = torch.maximum(m, tile)
    beta = torch.exp(safe - torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new))
    return m_new, (l * alpha + p.sum(1)) * beta, (acc * alpha[:, None] + p @ v) * beta[:, None]


def update_clamping_the_maximum_at_zero(m, l, acc, scores, v):
    # The -inf guard as a clamp: a row whose scores are all near -250 underflows to l = 0.
    m_new = torch.clamp(torch.maximum(m, scores.amax(dim=1)), min=0.0)
    old = torch.clamp(m, min=0.0)
    alpha = torch.exp(old - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def update_without_rescaling_l(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(dim=1))
    safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - safe)
    p = torch.exp(scores - safe[:, None])
    return m_new, l + p.sum(dim=1), acc * alpha[:, None] + p @ v


def update_returning_the_safe_maximum(m, l, acc, scores, v):
    # The -inf guard's 0 returned as m: a row masked through its first tile then holds m = 0, and its next
    # tile's scores, all near -250, are taken against 0: every exponential underflows, l = 0.
    m_new = torch.maximum(m, scores.amax(dim=1))
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(scores - m_safe[:, None])
    return m_safe, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def update_without_a_maximum(m, l, acc, scores, v):
    # No maximum subtracted at all: m stays 0, exp(scores) overflows near +200 and underflows near -250.
    p = torch.exp(scores)
    old_l = torch.where(m == float("-inf"), l, l * torch.exp(m))
    old_acc = torch.where((m == float("-inf"))[:, None], acc, acc * torch.exp(m)[:, None])
    return torch.zeros_like(m), old_l + p.sum(1), old_acc + p @ v


def update_normalising_every_step(m, l, acc, scores, v):
    # acc kept as the running average (divided by l at every tile): the fold divides by l once more at the end.
    m_new = torch.maximum(m, scores.amax(dim=1))
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(scores - m_safe[:, None])
    l_new = l * alpha + p.sum(1)
    acc_new = (acc * (l * alpha)[:, None] + p @ v) / torch.where(l_new == 0, 1.0, l_new)[:, None]
    return m_new, l_new, acc_new


def update_in_a_loop(m, l, acc, scores, v):
    m_new, l_new, acc_new = m.clone(), l.clone(), acc.clone()
    for row in range(scores.shape[0]):  # right values, row by row: the spec says no loops
        outs = solutions.online_softmax_update(m[row:row + 1], l[row:row + 1], acc[row:row + 1],
                                               scores[row:row + 1], v)
        m_new[row], l_new[row], acc_new[row] = outs[0][0], outs[1][0], outs[2][0]
    return m_new, l_new, acc_new


def test_online_softmax_update_solution_solves():
    verdict = check_fold(solutions.online_softmax_update)
    assert verdict.solved, verdict.message
    assert "rules kept: no Python loops" in flat(verdict.message)


@pytest.mark.parametrize(("wrong", "cause"), [
    (update_without_rescaling_acc, "cause: acc is not rescaled"),
    (update_without_rescaling_l, "cause: l is not rescaled"),
    (update_with_the_tile_maximum, "cause: each tile's terms are taken against the tile's own maximum"),
    (update_without_the_infinity_guard, "cause: row 2 sees no key in the first tile (all −inf), and "
                                        "exp(−inf − (−inf)) is NaN"),
    (update_with_the_tile_overflowing, "cause: row 0's maximum falls by"),
    (update_clamping_the_maximum_at_zero, "cause: row 1's scores are all near -2"),
    (update_returning_the_safe_maximum, "cause: row 4 sees no key in the first tile, and the m returned after it "
                                        "is 0: m must stay −inf while no key is seen"),
    (update_without_a_maximum, "cause: no maximum is subtracted: exp(s) overflows float32 for scores near 2"),
    (update_normalising_every_step, "cause: acc is divided by l at every step"),
    (update_in_a_loop, "broke a stated rule — torch, no loops (one tile's update is tensor ops): a Python for "
                       "loop at line"),
], ids=["acc unrescaled", "l unrescaled", "tile maximum", "no -inf guard", "overflow when the max falls",
        "max clamped at 0", "safe maximum returned", "no maximum",
        "normalised every step", "a loop"])
def test_online_softmax_update_negative_controls(wrong, cause):
    assert_not_solved(check_fold(wrong), cause)


# ----------------------------------------------------------------------------------------------
# Exercise 2: the forward kernel
# ----------------------------------------------------------------------------------------------


def check_forward(kernel) -> Verdict:
    """Exercise 2's check, as the notebook's check cell makes it."""
    return check("ch07_flash_attention.flash_forward_kernel", given.flash_forward_with(kernel),
                 given.forward_reference, given.forward_cases, out=True, tolerance=given.forward_tolerance,
                 rules=given.flash_forward_rules(), diagnose=given.diagnose_flash_forward,
                 traffic=given.flash_forward_traffic())


@triton.jit
def forward_kernel_with(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seq_q, seq_k, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BUG: tl.constexpr):
    # The online-softmax forward with one planted mistake (BUG): 1 no scale, 2 acc not rescaled, 3 the key
    # mask one too far, 4 lse in base 2, 5 K not transposed, 6 rescaled towards the tile's own maximum,
    # 7 q kᵀ as an fp32 dot of upcast inputs, 8 p v as an fp32 dot of upcast v, 9 masked keys scored 0,
    # 10 K and V offset by seq_q, 11 lse = m + log2(l), 12 no row mask on the stores.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < seq_q,
                other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bound = seq_k + 1 if BUG == 3 else seq_k
    head_rows = seq_q if BUG == 10 else seq_k  # 10: K and V offset by the query length
    for start_n in range(0, seq_k, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + bh * head_rows * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < bound, other=0.0)
        v = tl.load(v_ptr + bh * head_rows * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < bound, other=0.0)
        if BUG == 5:
            s = tl.dot(q, k)
        elif BUG == 7:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))  # right values, but no bf16 tensor cores
        else:
            s = tl.dot(q, tl.trans(k))
        if BUG != 1:
            s = s * scale
        if BUG == 9:
            s = tl.where(keys[None, :] < bound, s, 0.0)  # masked keys set to 0, not -inf: they take a share
        else:
            s = tl.where(keys[None, :] < bound, s, float("-inf"))
        tile_max = tl.max(s, axis=1)
        m_new = tl.maximum(m, tile_max)
        if BUG == 6:
            alpha = tl.exp(m - tile_max)  # towards the tile's own maximum: overflows when the maximum falls
            p = tl.exp(s - tile_max[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            beta = tl.exp(tile_max - m_new)
            l = l * beta
            acc = acc * beta[:, None]
        else:
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if BUG == 2:
                acc = acc + tl.dot(p.to(v.dtype), v)
            elif BUG == 8:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))  # v upcast: an fp32 dot for bf16 inputs
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    row_bound = seq_q + BLOCK_M if BUG == 12 else seq_q  # 12: the rows past seq_q stored too
    tl.store(out_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :],
             (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=rows[:, None] < row_bound)
    lse = m + tl.log(l)
    if BUG == 4:
        lse = lse * 1.4426950408889634
    if BUG == 11:
        lse = m + tl.log2(l)  # the sum's log in base 2, the maximum's natural
    tl.store(lse_ptr + bh * seq_q + rows, lse, mask=rows < row_bound)


def planted_forward(bug: int):
    class Planted:
        def __getitem__(self, grid):
            return lambda *args, **kw: forward_kernel_with[grid](*args, **kw, BUG=bug)

    return Planted()


@triton.jit
def two_pass_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seq_q, seq_k, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Right values: a first pass over the keys for the maximum and the sum, a second for the output.
    # But it reads K twice (the check counts it).
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < seq_q,
                other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, seq_k, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        s = tl.where(keys[None, :] < seq_k, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, seq_k, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        v = tl.load(v_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        s = tl.where(keys[None, :] < seq_k, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        p = tl.exp(s - m[:, None]) / l[:, None]
        acc += tl.dot(p.to(v.dtype), v)
    tl.store(out_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)
    tl.store(lse_ptr + bh * seq_q + rows, m + tl.log(l), mask=rows < seq_q)


@triton.jit
def unmasked_keys_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seq_q, seq_k, scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # The online softmax, but the keys past seq_k (loaded as zeros) keep their score of 0.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < seq_q,
                other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, seq_k, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        v = tl.load(v_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(out_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :],
             (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)
    tl.store(lse_ptr + bh * seq_q + rows, m + tl.log(l), mask=rows < seq_q)


def test_flash_forward_solution_solves_with_its_rule_and_traffic():
    verdict = check_forward(solutions.flash_forward_kernel)
    assert verdict.solved, verdict.message
    assert "rules kept: one pass over the keys" in flat(verdict.message)
    # The last case: 40 queries, 3 query blocks of 16: K and V read 3 times.
    assert verdict.traffic.reread["k"] == 3.0 and verdict.traffic.reread["v"] == 3.0
    assert verdict.traffic.top is not None and verdict.traffic.top > verdict.traffic.ideal
    assert ("k read 3.00× its size, v 3.00×: K and V are read once per query block of 16 (3 blocks)"
            in flat(verdict.message))


def test_the_planted_kernel_without_a_bug_is_the_solution():
    assert check_forward(planted_forward(0)).solved


@pytest.mark.parametrize(("bug", "cause"), [
    (1, "cause: the scores miss the scale 1/√D"),
    (2, "cause: acc is not rescaled when the maximum moves"),
    (3, "cause: the key mask lets key seq_k in"),
    (4, "cause: lse is in base 2"),
    (5, "cause: K is not transposed"),
    (6, "cause: NaN/inf where a row's maximum falls by more than 80 after the first key tile"),
    (9, "cause: the keys past seq_k are not masked to −inf"),
    (10, "cause: K and V are offset by bh * seq_q * HEAD_DIM"),
    (11, "cause: lse is m + log2(l)"),
    (12, "cause: the stores are not masked to the rows < seq_q: head 0's last query block spills"),
], ids=["no scale", "acc unrescaled", "mask one too far", "lse base 2", "K not transposed", "tile maximum",
        "masked keys 0", "kv offset seq_q", "lse log2 l", "no row mask"])
def test_flash_forward_negative_controls(bug, cause):
    assert_not_solved(check_forward(planted_forward(bug)), cause)


@pytest.mark.parametrize(("bug", "operands"), [(7, "fp32 × fp32"), (8, "fp32 × fp32")], ids=["q k", "p v"])
def test_flash_forward_fp32_dots_of_bf16_inputs_break_the_dtype_rule(bug, operands):
    assert_not_solved(check_forward(planted_forward(bug)), "broke a stated rule — tl.dot in the inputs' dtype",
                      f"bf16 inputs, but a tl.dot took {operands} operands")


def test_flash_forward_two_passes_break_the_one_pass_rule():
    assert_not_solved(check_forward(two_pass_kernel), "broke a stated rule — one pass over the keys (k and v read "
                                                      "once per query block): the kernel read")


def test_flash_forward_unmasked_keys_are_wrong_values():
    verdict = check_forward(unmasked_keys_kernel)
    assert_not_solved(verdict, "wrong", "cause: the keys past seq_k are not masked to −inf: padded keys (loaded as 0) "
                                        "score 0")


# ----------------------------------------------------------------------------------------------
# Exercise 3: the causal key range
# ----------------------------------------------------------------------------------------------


def check_key_blocks(candidate) -> Verdict:
    return check("ch07_flash_attention.causal_key_blocks", candidate, given.blocks_by_scan, given.BLOCK_CASES,
                 diagnose=given.diagnose_key_blocks)


def top_left_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    last_key = min(min(start_m + BLOCK_M, seq_q) - 1, seq_k - 1)  # j <= i: aligned to the top left
    first_key = 0 if window is None else max(0, start_m - window + 1)
    return (0, 0) if last_key < first_key else (first_key // BLOCK_N * BLOCK_N, last_key + 1)


def blocks_without_the_window(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    return solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, None)


def blocks_to_the_end(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    lo, hi = solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window)
    return lo, seq_k  # right answers, every block visited: what skipping is for


def blocks_rounded_up(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    lo, hi = solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window)
    return lo, -(-hi // BLOCK_N) * BLOCK_N  # a whole last block: the spec wants hi exact


def blocks_one_short(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    lo, hi = solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window)
    return (lo, hi - 1) if hi else (lo, hi)


def blocks_with_the_last_row_unclipped(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    last_key = start_m + BLOCK_M - 1 + seq_k - seq_q  # the block's rows past seq_q counted
    first_key = 0 if window is None else max(0, start_m + seq_k - seq_q - window + 1)
    return (0, 0) if last_key < first_key else (first_key // BLOCK_N * BLOCK_N, last_key + 1)


def blocks_as_floats(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    lo, hi = solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window)
    return float(lo), float(hi)


def test_causal_key_blocks_solution_solves_and_matches_the_scan_widely():
    assert check_key_blocks(solutions.causal_key_blocks).solved
    wide = [(m0, bm, bn, tq, tk, w) for bm in (4, 16) for bn in (4, 8) for tq in (1, 5, 33) for tk in (1, 7, 40)
            for w in (None, 1, 3, 50) for m0 in range(0, tq, bm)]
    assert [solutions.causal_key_blocks(*c) for c in wide] == [given.blocks_by_scan(*c) for c in wide]


@pytest.mark.parametrize(("wrong", "cause"), [
    (top_left_blocks, "cause: aligned to the top left (j <= i)"),
    (blocks_without_the_window, "cause: the window is ignored"),
    (blocks_to_the_end, "cause: every block up to seq_k is visited"),
    (blocks_rounded_up, "cause: hi is rounded up to a block"),
    (blocks_one_short, "cause: hi is one short"),
    (blocks_with_the_last_row_unclipped, "cause: the block's last row is not clipped to seq_q − 1"),
    (blocks_as_floats, "expected an exact int, got float"),
], ids=["top left", "no window", "to the end", "hi rounded up", "hi one short", "last row unclipped", "floats"])
def test_causal_key_blocks_negative_controls(wrong, cause):
    assert_not_solved(check_key_blocks(wrong), "start_m=", cause)


# ----------------------------------------------------------------------------------------------
# Exercise 4: the GQA index map (through the notebook's probe kernel)
# ----------------------------------------------------------------------------------------------


@triton.jit
def kv_head_modulo(q_head, n_q_heads, n_kv_heads):
    return q_head % n_kv_heads  # the other grouping: wrong for HF's repeat_kv


@triton.jit
def gather_solution_kernel(k_ptr, out_ptr, n_q_heads, n_kv_heads, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr):
    # The notebook's probe kernel, calling the solution's index map.
    b, h = tl.program_id(0), tl.program_id(1)
    kv = solution_kv_head_index(h, n_q_heads, n_kv_heads)
    tile = tl.arange(0, SEQ)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    keys = tl.load(k_ptr + (b * n_kv_heads + kv) * SEQ * HEAD_DIM + tile)
    tl.store(out_ptr + (b * n_q_heads + h) * SEQ * HEAD_DIM + tile, keys)


@triton.jit
def gather_modulo_kernel(k_ptr, out_ptr, n_q_heads, n_kv_heads, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr):
    # The same probe, calling the wrong index map.
    b, h = tl.program_id(0), tl.program_id(1)
    kv = kv_head_modulo(h, n_q_heads, n_kv_heads)
    tile = tl.arange(0, SEQ)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    keys = tl.load(k_ptr + (b * n_kv_heads + kv) * SEQ * HEAD_DIM + tile)
    tl.store(out_ptr + (b * n_q_heads + h) * SEQ * HEAD_DIM + tile, keys)


@triton.jit
def kv_head_by_kv_count(q_head, n_q_heads, n_kv_heads):
    return q_head // n_kv_heads  # divides by the number of kv heads, not the group size


@triton.jit
def gather_by_kv_count_kernel(k_ptr, out_ptr, n_q_heads, n_kv_heads, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kv = kv_head_by_kv_count(h, n_q_heads, n_kv_heads)
    tile = tl.arange(0, SEQ)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    keys = tl.load(k_ptr + (b * n_kv_heads + kv) * SEQ * HEAD_DIM + tile)
    tl.store(out_ptr + (b * n_q_heads + h) * SEQ * HEAD_DIM + tile, keys)


@triton.jit
def kv_head_zero(q_head, n_q_heads, n_kv_heads):
    return q_head * 0  # every query head on kv head 0


@triton.jit
def gather_zero_kernel(k_ptr, out_ptr, n_q_heads, n_kv_heads, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kv = kv_head_zero(h, n_q_heads, n_kv_heads)
    tile = tl.arange(0, SEQ)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    keys = tl.load(k_ptr + (b * n_kv_heads + kv) * SEQ * HEAD_DIM + tile)
    tl.store(out_ptr + (b * n_q_heads + h) * SEQ * HEAD_DIM + tile, keys)


@triton.jit
def kv_head_identity(q_head, n_q_heads, n_kv_heads):
    return q_head  # as if every query head had its own kv head: past the last one, outside K


@triton.jit
def gather_identity_kernel(k_ptr, out_ptr, n_q_heads, n_kv_heads, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kv = kv_head_identity(h, n_q_heads, n_kv_heads)
    tile = tl.arange(0, SEQ)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    keys = tl.load(k_ptr + (b * n_kv_heads + kv) * SEQ * HEAD_DIM + tile)
    tl.store(out_ptr + (b * n_q_heads + h) * SEQ * HEAD_DIM + tile, keys)


def gather_with(kernel):
    def gather_kv(k, n_q_heads, out):
        batch, n_kv_heads, seq, head_dim = k.shape
        kernel[(batch, n_q_heads)](k, out, n_q_heads, n_kv_heads, SEQ=seq, HEAD_DIM=head_dim)
        return out

    return gather_kv


def check_gather(kernel) -> Verdict:
    return check("ch07_flash_attention.kv_head_index", gather_with(kernel), given.repeat_kv_reference,
                 given.gqa_cases, out=True, diagnose=given.diagnose_kv_head_index, traffic=given.gather_traffic())


def test_kv_head_index_solution_solves_with_the_copy_traffic_named():
    verdict = check_gather(gather_solution_kernel)
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread["k"] == 4.0  # the last case: 8 query heads on 2 kv heads
    assert ("k read 4.00× its size: each key/value head is read once per query head of its group (4×) — what "
            "repeat_kv's copy costs") in flat(verdict.message)


@pytest.mark.parametrize(("kernel", "cause"), [
    (gather_modulo_kernel, "cause: query head h read kv head h % n_kv_heads, the interleaved grouping"),
    (gather_by_kv_count_kernel, "cause: h // n_kv_heads divides by the number of kv heads (3), not by the group "
                                "size G = n_q_heads // n_kv_heads = 2"),
    (gather_zero_kernel, "cause: every query head read kv head 0: the map ignores q_head"),
    (gather_identity_kernel, "cause: query head h read kv head h, as if each query head had its own"),
], ids=["h % kv_heads", "h // kv_heads", "always 0", "identity"])
def test_kv_head_index_negative_controls(kernel, cause):
    verdict = check_gather(kernel)
    assert_not_solved(verdict, cause)
    first = next(line for line in verdict.message.splitlines() if line.strip().startswith("•"))
    assert "cause:" in first, verdict.message  # the cause leads, before what the given kernel's loads did


# ----------------------------------------------------------------------------------------------
# Exercise 5: the backward of one tile
# ----------------------------------------------------------------------------------------------


def check_backward_tile(candidate) -> Verdict:
    return check("ch07_flash_attention.attention_backward_tile", candidate, given.backward_reference,
                 given.backward_cases, diagnose=given.diagnose_backward_tile)


def backward_without_delta(q, k, v, do, lse, delta, scale):
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    ds = p * (do @ v.T)  # the softmax's Jacobian forgotten: dS = P o dP
    return scale * (ds @ k), scale * (ds.T @ q), p.T @ do


def backward_without_the_scale(q, k, v, do, lse, delta, scale):
    dq, dk, dv = solutions.attention_backward_tile(q, k, v, do, lse, delta, scale)
    return dq / scale, dk / scale, dv


def backward_with_p_dO(q, k, v, do, lse, delta, scale):
    dq, dk, dv = solutions.attention_backward_tile(q, k, v, do, lse, delta, scale)
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    return dq, dk, p @ do  # not transposed: runs on a square tile


def backward_dividing_exponentials(q, k, v, do, lse, delta, scale):
    p = torch.exp(scale * (q @ k.T)) / torch.exp(lse)[:, None]  # overflows at scores near 1000
    dp = do @ v.T
    ds = p * (dp - delta[:, None])
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def backward_with_the_tiles_own_softmax(q, k, v, do, lse, delta, scale):
    p = torch.softmax(scale * (q @ k.T), dim=-1)  # right only when the tile holds every key of its rows
    ds = p * (do @ v.T - delta[:, None])
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def backward_with_the_tiles_own_delta(q, k, v, do, lse, delta, scale):
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    dp = do @ v.T
    own = (p * dp).sum(1)  # the tile's part of delta only: delta sums over every key of the row
    ds = p * (dp - own[:, None])
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def backward_with_delta_outside(q, k, v, do, lse, delta, scale):
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    ds = p * (do @ v.T) - delta[:, None]  # a parenthesis slip: P ∘ dP − delta
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def backward_with_delta_added(q, k, v, do, lse, delta, scale):
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    ds = p * (do @ v.T + delta[:, None])  # delta's sign flipped
    return scale * ds @ k, scale * ds.T @ q, p.T @ do


def backward_with_dq_and_dk_swapped(q, k, v, do, lse, delta, scale):
    dq, dk, dv = solutions.attention_backward_tile(q, k, v, do, lse, delta, scale)
    return (dk, dq, dv) if dq.shape == dk.shape else (dq, dk, dv)  # returned in the wrong order where it runs


def test_attention_backward_tile_solution_solves():
    assert check_backward_tile(solutions.attention_backward_tile).solved


@pytest.mark.parametrize(("wrong", "cause"), [
    (backward_without_delta, "cause: dS misses delta"),
    (backward_without_the_scale, "cause: dq and dk miss the scale"),
    (backward_with_p_dO, "cause: dV is P dO, not Pᵀ dO"),
    (backward_dividing_exponentials, "cause: NaN/inf: the scores reach"),
    (backward_with_the_tiles_own_softmax, ("cause: P is the tile's own softmax",
                                           "the tile holds only part of its rows' keys")),
    (backward_with_the_tiles_own_delta, ("cause: delta is recomputed from the tile",
                                         "the tile holds only part of its rows' keys")),
    (backward_with_delta_outside, "cause: dS = P ∘ dP − delta: the parenthesis slipped"),
    (backward_with_delta_added, "cause: delta's sign is flipped"),
    (backward_with_dq_and_dk_swapped, "cause: dq and dk are swapped"),
], ids=["no delta", "no scale", "dv transposed", "exp overflow", "tile softmax", "tile delta", "parenthesis",
        "delta sign", "dq dk swapped"])
def test_attention_backward_tile_negative_controls(wrong, cause):
    assert_not_solved(check_backward_tile(wrong), *(cause if isinstance(cause, tuple) else (cause,)))


# ----------------------------------------------------------------------------------------------
# Exercise 6: varlen's work list
# ----------------------------------------------------------------------------------------------


def check_varlen(candidate) -> Verdict:
    return check("ch07_flash_attention.varlen_tiles", candidate, given.tiles_by_rows, given.VARLEN_CASES,
                 diagnose=given.diagnose_varlen_tiles)


def tiles_on_a_global_grid(cu_seqlens, BLOCK_M):
    # Blocks every BLOCK_M packed rows: a block straddles two sequences.
    tiles = []
    for row in range(0, cu_seqlens[-1], BLOCK_M):
        b = max(i for i in range(len(cu_seqlens) - 1) if cu_seqlens[i] <= row < cu_seqlens[i + 1])
        tiles.append((b, row, min(row + BLOCK_M, cu_seqlens[-1])))
    return tiles


def tiles_padded_to_the_longest(cu_seqlens, BLOCK_M):
    longest = max(cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(cu_seqlens) - 1))
    return [(b, cu_seqlens[b] + r, cu_seqlens[b] + min(r + BLOCK_M, longest))
            for b in range(len(cu_seqlens) - 1) for r in range(0, longest, BLOCK_M)]


def tiles_with_local_rows(cu_seqlens, BLOCK_M):
    return [(b, first - cu_seqlens[b], end - cu_seqlens[b]) for b, first, end in solutions.varlen_tiles(cu_seqlens,
                                                                                                      BLOCK_M)]


def tiles_past_the_end(cu_seqlens, BLOCK_M):
    return [(b, first, first + BLOCK_M) for b, first, _ in solutions.varlen_tiles(cu_seqlens, BLOCK_M)]


def tiles_for_empty_sequences_too(cu_seqlens, BLOCK_M):
    tiles = []
    for b in range(len(cu_seqlens) - 1):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        tiles += [(b, row, min(row + BLOCK_M, end)) for row in range(start, max(end, start + 1), BLOCK_M)]
    return tiles


def test_varlen_tiles_solution_solves():
    assert check_varlen(solutions.varlen_tiles).solved


@pytest.mark.parametrize(("wrong", "cause"), [
    (tiles_on_a_global_grid, "cause: tile (2, 8, 16) starts 3 rows into sequence 2: blocks on one grid over the "
                             "packed rows straddle sequences"),
    (tiles_padded_to_the_longest, "cause: every sequence gets the 2 tiles of the longest (16 rows): that is padding"),
    (tiles_with_local_rows, "cause: the rows are counted from each sequence's start (tile (2, 0, 8) of sequence 2); "
                            "rows are packed indices: add cu_seqlens[2] = 5"),
    (tiles_for_empty_sequences_too, "cause: sequence 1 is empty and gets tile (1, 5, 5)"),
    (tiles_past_the_end, "cause: tile (0, 0, 8) runs past sequence 0's end (5): the last block is short"),
], ids=["global grid", "padded", "local rows", "empty sequences", "last block not clipped"])
def test_varlen_tiles_negative_controls(wrong, cause):
    assert_not_solved(check_varlen(wrong), cause)


# ----------------------------------------------------------------------------------------------
# The given row kernel, and the solutions compiled for sm_90
# ----------------------------------------------------------------------------------------------


def test_row_kernel_and_forward_kernel_match_the_reference(gen):
    q, k, v = (torch.randn(2, n, 32, generator=gen).to(DEVICE) for n in (21, 40, 40))
    expected, expected_lse = attention_reference(q, k, v)
    for kernel, launch in ((solutions.attention_row_kernel, solutions.launch_attention_rows),
                           (solutions.flash_forward_kernel, solutions.launch_flash_forward)):
        out, lse = torch.empty_like(q), torch.empty(2, 21, device=DEVICE)
        launch(kernel, q, k, v, out, lse)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


def test_launchers_refuse_what_the_chapter_kernels_do_not_take():
    q = torch.randn(2, 8, 24, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        solutions.launch_flash_forward(solutions.flash_forward_kernel, q, q, q, torch.empty_like(q),
                                       torch.empty(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.randn(2, 16, 8, device=DEVICE).transpose(1, 2)
        solutions.launch_flash_forward(solutions.flash_forward_kernel, t, t, t, torch.empty(2, 8, 16),
                                       torch.empty(2, 8))


# ----------------------------------------------------------------------------------------------
# Exercise 7: attention sinks
# ----------------------------------------------------------------------------------------------


def check_sinks(candidate) -> Verdict:
    return check("ch07_flash_attention.sink_attention", candidate, given.sink_reference, given.sink_cases,
                 rules=given.sink_attention_rules(), diagnose=given.diagnose_sink_attention)


def _fold(scores, v, widths, sink=None, update=solutions.online_softmax_update):
    """Exercise 1's fold; with ``sink``, the sink folded after every tile (the per-tile mistake)."""
    rows = scores.shape[0]
    m = torch.full((rows,), float("-inf"), dtype=scores.dtype)
    l, acc = torch.zeros(rows, dtype=scores.dtype), torch.zeros(rows, v.shape[1], dtype=scores.dtype)
    start = 0
    for width in widths:
        m, l, acc = update(m, l, acc, scores[:, start:start + width], v[start:start + width])
        if sink is not None:
            m, l, acc = _fold_sink(m, l, acc, sink)
        start += width
    return m, l, acc


def _fold_sink(m, l, acc, sink):
    m_new = torch.maximum(m, torch.full_like(m, sink))
    alpha = torch.exp(m - m_new)
    return m_new, l * alpha + torch.exp(sink - m_new), acc * alpha[:, None]


def _finish(m, l, acc, sink, do):
    out, lse = acc / l[:, None], m + torch.log(l)
    return out, lse, -(torch.exp(sink - lse) * (do * out).sum(1)).sum()


def sink_folded_per_tile(scores, v, sink, widths, do):
    return _finish(*_fold(scores, v, widths, sink), sink, do)


def sink_in_the_numerator(scores, v, sink, widths, do):
    m, l, acc = _fold_sink(*_fold(scores, v, widths), sink)
    out = (acc + torch.exp(sink - m)[:, None]) / l[:, None]  # the sink's term added to every output feature
    lse = m + torch.log(l)
    return out, lse, -(torch.exp(sink - lse) * (do * out).sum(1)).sum()


def sink_left_out(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    seen = torch.isfinite(m)
    out = torch.where(seen[:, None], acc / torch.where(seen, l, 1.0)[:, None], 0.0)
    lse = torch.where(seen, m + torch.log(l), float("-inf"))
    return out, lse, torch.zeros(())


def lse_without_the_sink(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    seen = torch.isfinite(m)
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))  # before the sink's fold
    m2, l2, acc2 = _fold_sink(m, l, acc, sink)
    out = acc2 / l2[:, None]
    return out, lse, -(torch.exp(sink - lse).nan_to_num(0.0) * (do * out).sum(1)).sum()


def sink_ignored_in_the_backward(scores, v, sink, widths, do):
    out, lse, _ = solutions.sink_attention(scores, v, sink, widths, do)
    return out, lse, torch.zeros(())


def sink_gradient_with_the_wrong_sign(scores, v, sink, widths, do):
    out, lse, d_sink = solutions.sink_attention(scores, v, sink, widths, do)
    return out, lse, -d_sink


def sink_gradient_without_delta(scores, v, sink, widths, do):
    out, lse, _ = solutions.sink_attention(scores, v, sink, widths, do)
    return out, lse, -torch.exp(sink - lse).sum()


def sink_not_against_the_max(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    e_sink = torch.exp(torch.tensor(sink, dtype=scores.dtype))  # exp(100) overflows float32
    l = torch.where(torch.isfinite(m), l, 0.0) * torch.exp(torch.where(torch.isfinite(m), m, 0.0)) + e_sink
    acc = acc * torch.exp(torch.where(torch.isfinite(m), m, 0.0))[:, None]
    out, lse = acc / l[:, None], torch.log(l)
    return out, lse, -(torch.exp(sink - lse) * (do * out).sum(1)).sum()


def _after_the_sink(m, l, acc, sink):
    """The state after the sink's fold, and the maximum before it."""
    m_new, l_new, acc_new = _fold_sink(m, l, acc, sink)
    return m, m_new, l_new, acc_new


def sink_by_the_whole_row(scores, v, sink, widths, do):
    # Right values by GPT-OSS's eager route: the sink's column concatenated, one logsumexp per row, no tiles.
    column = torch.full((scores.shape[0], 1), float(sink), dtype=scores.dtype)
    lse = torch.logsumexp(torch.cat([scores, column], dim=1), dim=1)
    out = torch.exp(scores - lse[:, None]) @ v
    return out, lse, -(torch.exp(sink - lse) * (do * out).sum(1)).sum()


def sink_with_one_tile(scores, v, sink, widths, do):
    # Right values with `widths` ignored: every key folded as one tile.
    return _finish(*_fold_sink(*_fold(scores, v, [scores.shape[1]]), sink), sink, do)


def sink_folded_by_the_update(scores, v, sink, widths, do):
    # Right, by the spec's own picture: the sink is one more tile of one key, score `sink`, value 0.
    m, l, acc = _fold(scores, v, widths)
    column = torch.full((scores.shape[0], 1), float(sink), dtype=scores.dtype)
    m, l, acc = solutions.online_softmax_update(m, l, acc, column, torch.zeros(1, v.shape[1], dtype=v.dtype))
    return _finish(m, l, acc, sink, do)


def test_sink_attention_solution_solves():
    verdict = check_sinks(solutions.sink_attention)
    assert verdict.solved
    assert "rules kept: the key tiles folded with exercise 1's update" in flat(verdict.message)


def sink_folded_first(scores, v, sink, widths, do):
    # Right too: the fold's order does not change its result, the sink may come first (once).
    rows = scores.shape[0]
    m = torch.full((rows,), float("-inf"), dtype=scores.dtype)
    l, acc = torch.zeros(rows, dtype=scores.dtype), torch.zeros(rows, v.shape[1], dtype=scores.dtype)
    column = torch.full((rows, 1), float(sink), dtype=scores.dtype)
    m, l, acc = solutions.online_softmax_update(m, l, acc, column, torch.zeros(1, v.shape[1], dtype=v.dtype))
    start = 0
    for width in widths:
        m, l, acc = solutions.online_softmax_update(m, l, acc, scores[:, start:start + width], v[start:start + width])
        start += width
    return _finish(m, l, acc, sink, do)


@pytest.mark.parametrize("right", [sink_folded_by_the_update, sink_folded_first], ids=["last", "first"])
def test_sink_attention_accepts_the_sink_folded_as_a_one_key_tile(right):
    assert check_sinks(right).solved


@pytest.mark.parametrize("wrong", [sink_by_the_whole_row, sink_with_one_tile], ids=["whole row", "one tile"])
def test_sink_attention_holds_the_tiles_to_the_update(wrong):
    assert_not_solved(check_sinks(wrong), "broke a stated rule", "exercise 1's update")


def lse_from_the_old_maximum(scores, v, sink, widths, do):
    # lse = m + log(l') with m the maximum from before the sink's fold: -inf for a row that sees no key.
    m, _, l, acc = _after_the_sink(*_fold(scores, v, widths), sink)
    return _finish(m, l, acc, sink, do)


def sink_after_an_unguarded_update(scores, v, sink, widths, do):
    # Exercise 1's update without its -inf guard: a row masked through a whole tile computes exp(-inf - -inf).
    return _finish(*_fold_sink(*_fold(scores, v, widths, update=update_without_the_infinity_guard), sink), sink, do)


@pytest.mark.parametrize(("wrong", "cause"), [
    (lse_from_the_old_maximum, "cause: lse is taken from the maximum before the sink's fold"),
    (sink_after_an_unguarded_update, "cause: NaN in rows that see no key through a whole tile"),
], ids=["lse old maximum", "unguarded update"])
def test_sink_attention_nan_is_not_called_an_overflow_when_the_sink_is_small(wrong, cause):
    verdict = check_sinks(wrong)
    assert_not_solved(verdict, cause)
    assert "overflows" not in verdict.message


def d_sink_mean_over_rows(scores, v, sink, widths, do):
    out, lse, _ = solutions.sink_attention(scores, v, sink, widths, do)
    return out, lse, -(torch.exp(sink - lse) * (do * out).sum(1)).mean()


def delta_mean_over_features(scores, v, sink, widths, do):
    out, lse, _ = solutions.sink_attention(scores, v, sink, widths, do)
    return out, lse, -(torch.exp(sink - lse) * (do * out).mean(1)).sum()


def delta_without_the_output(scores, v, sink, widths, do):
    out, lse, _ = solutions.sink_attention(scores, v, sink, widths, do)
    return out, lse, -(torch.exp(sink - lse) * do.sum(1)).sum()


def delta_from_the_unnormalised_acc(scores, v, sink, widths, do):
    _, m, l, acc = _after_the_sink(*_fold(scores, v, widths), sink)
    out, lse = acc / l[:, None], m + torch.log(l)
    return out, lse, -(torch.exp(sink - lse) * (do * acc).sum(1)).sum()


def acc_not_rescaled_for_the_sink(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    _, m_new, l_new, _ = _after_the_sink(m, l, acc, sink)
    return _finish(m_new, l_new, acc, sink, do)  # acc still relative to the keys' maximum


def l_not_rescaled_for_the_sink(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    _, m_new, _, acc_new = _after_the_sink(m, l, acc, sink)
    return _finish(m_new, l + torch.exp(sink - m_new), acc_new, sink, do)  # l still relative to the keys' maximum


def sink_in_lse_only(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    lse = torch.logaddexp(m + torch.log(l), torch.full_like(m, sink))
    out = torch.nan_to_num(acc / l[:, None])  # softmax over the keys alone: the sink missing from its denominator
    return out, lse, -(torch.exp(sink - lse) * (do * out).sum(1)).sum()


def sink_as_a_weight(scores, v, sink, widths, do):
    m, l, acc = _fold(scores, v, widths)
    m = torch.where(torch.isfinite(m), m, 0.0)
    l = l + sink * torch.exp(-m)  # `sink` added to the denominator, not e^sink
    return _finish(m, l, acc, sink, do)


def sink_scaled_like_the_scores(scores, v, sink, widths, do):
    return solutions.sink_attention(scores, v, sink / math.sqrt(v.shape[1]), widths, do)


@pytest.mark.parametrize(("wrong", "cause"), [
    (d_sink_mean_over_rows, "cause: d_sink is a mean over the rows"),
    (delta_mean_over_features, "cause: δ is a mean over the features"),
    (delta_without_the_output, "cause: δ leaves the output out"),
    (delta_from_the_unnormalised_acc, "cause: δ is taken from the unnormalised acc"),
    (acc_not_rescaled_for_the_sink, "cause: acc is not rescaled when the maximum moves to the sink"),
    (l_not_rescaled_for_the_sink, "cause: l is not rescaled when the maximum moves to the sink"),
    (sink_in_lse_only, "cause: the sink is in lse but not in the output's denominator"),
    (sink_as_a_weight, "cause: the sink is added as a weight"),
    (sink_scaled_like_the_scores, "cause: the sink is scaled like the scores"),
], ids=["d_sink mean", "delta mean", "delta no O", "delta acc", "acc alpha", "l alpha", "lse only", "weight",
        "scaled"])
def test_sink_attention_names_the_cause(wrong, cause):
    assert_not_solved(check_sinks(wrong), cause)


def test_sink_cases_move_the_maximum_to_the_sink_in_three_tiles():
    for seed in range(200):  # every seed: the check draws fresh ones
        scores, _, sink, widths, _ = given.sink_cases(torch.Generator().manual_seed(seed))[2]
        assert len(widths) == 3 and sink == 4.0
        maxima = scores.amax(dim=1)
        maxima = maxima[torch.isfinite(maxima)]
        assert bool((maxima < sink).any()), f"seed {seed}: no row of case 3 has its maximum below the sink"
        assert bool((maxima > sink).any()), f"seed {seed}: no row of case 3 has scores above the sink"


@pytest.mark.parametrize(("wrong", "cause"), [
    (sink_folded_per_tile, "cause: the sink is counted once per key tile (2 tiles here)"),
    (sink_in_the_numerator, "cause: the sink is added to the numerator too"),
    (sink_left_out, "cause: the sink is left out"),
    (lse_without_the_sink, "cause: lse leaves the sink out"),
    (sink_ignored_in_the_backward, "cause: the sink is ignored in the backward (d_sink = 0)"),
    (sink_gradient_with_the_wrong_sign, "cause: d_sink has the wrong sign"),
    (sink_gradient_without_delta, "cause: d_sink misses δ"),
    (sink_not_against_the_max, "cause: NaN/inf: the sink is 100"),
], ids=["per tile", "numerator", "left out", "lse", "backward ignored", "sign", "no delta", "overflow"])
def test_sink_attention_negative_controls(wrong, cause):
    assert_not_solved(check_sinks(wrong), cause)
