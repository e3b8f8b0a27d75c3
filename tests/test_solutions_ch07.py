"""Chapter 07's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (same launcher, same kind of cases), once with
the solution (SOLVED) and once per negative control — a plausible wrong answer the checker must
reject, with the diagnosis it must give.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch07_flash_attention as solutions
from solutions.ch07_flash_attention import kv_head_index as solution_kv_head_index
from utils.exercises import check
from utils.trace import trace

pytestmark = pytest.mark.interpreter  # the traffic checks and diagnoses need the interpreter

DEVICE = kernel_ladder.runtime.DEVICE


def attention_reference(q, k, v):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v.double(), lse.float()


# ----------------------------------------------------------------------------------------------
# Exercise 1: the online softmax's update
# ----------------------------------------------------------------------------------------------


def fold_with(update):
    def fold_tiles(scores, v, widths):
        rows = scores.shape[0]
        m = torch.full((rows,), float("-inf"), dtype=scores.dtype)
        l = torch.zeros(rows, dtype=scores.dtype)
        acc = torch.zeros(rows, v.shape[1], dtype=scores.dtype)
        start = 0
        for width in widths:
            m, l, acc = update(m, l, acc, scores[:, start:start + width], v[start:start + width])
            start += width
        return acc / l[:, None], m + torch.log(l)

    return fold_tiles


def fold_reference(scores, v, widths):
    return torch.softmax(scores, dim=1) @ v, torch.logsumexp(scores, dim=1)


def fold_cases(gen):
    cases = []
    for rows, widths, dims in ((4, [8, 8], 8), (6, [5, 16, 3], 16), (3, [1, 7, 32, 2], 4)):
        total = sum(widths)
        scores = torch.randn(rows, total, generator=gen) * 3
        scores[:, :widths[0]] += 8.0
        scores[0, -widths[-1]:] += 12.0
        scores[1, 1::3] = float("-inf")
        scores[2, :widths[0]] = float("-inf")  # row 2 sees no key of the first tile
        cases.append((scores, torch.randn(total, dims, generator=gen), widths))
    return cases


def update_without_rescaling_acc(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(dim=1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc + p @ v  # acc still relative to the old maximum


def update_without_the_infinity_guard(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(dim=1))
    alpha = torch.exp(m - m_new)  # exp(-inf - (-inf)) = NaN for a row that has seen no key yet
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


def update_with_the_tile_maximum(m, l, acc, scores, v):
    tile_max = scores.amax(dim=1)  # each tile's terms relative to its own maximum: not one scale
    p = torch.exp(scores - tile_max[:, None])
    return torch.maximum(m, tile_max), l + p.sum(dim=1), acc + p @ v


def test_online_softmax_update_solution_solves():
    assert check("ch07.online_softmax_update", fold_with(solutions.online_softmax_update), fold_reference,
                 fold_cases).solved


@pytest.mark.parametrize(("wrong", "diagnosis"), [(update_without_rescaling_acc, "wrong"),
                                                  (update_with_the_tile_maximum, "wrong"),
                                                  (update_without_the_infinity_guard, "NaN")])
def test_online_softmax_update_negative_controls(wrong, diagnosis):
    verdict = check("ch07.online_softmax_update", fold_with(wrong), fold_reference, fold_cases)
    assert not verdict.solved and diagnosis in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 2: the forward kernel
# ----------------------------------------------------------------------------------------------


def forward_with(kernel):
    def flash_forward(q, k, v, out, lse):
        with trace() as traced:
            solutions.launch_flash_forward(kernel, q, k, v, out, lse)
        kv_read = sum(launch.per_tensor[name].bytes_read for launch in traced.launches
                      for name in ("k_ptr", "v_ptr") if name in launch.per_tensor)
        once = triton.cdiv(q.shape[1], 16) * (k.numel() + v.numel()) * k.element_size()
        if kv_read > once:
            raise AssertionError(f"the kernel read {kv_read:,} bytes of k and v, {kv_read / once:.1f}x once per "
                                 "query block: one pass over the keys, the softmax rescaled as it goes")
        return out, lse

    return flash_forward


def forward_cases(gen):
    cases = []
    for heads, seq_q, seq_k, dims, dtype in ((1, 16, 16, 16, torch.float32), (3, 37, 45, 32, torch.float32),
                                             (2, 20, 7, 64, torch.bfloat16), (2, 5, 50, 16, torch.bfloat16)):
        q = torch.randn(heads, seq_q, dims, generator=gen)
        k = torch.randn(heads, seq_k, dims, generator=gen) * 2
        v = torch.randn(heads, seq_k, dims, generator=gen)
        cases.append(tuple(t.to(DEVICE, dtype) for t in (q, k, v)))
    return cases


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


def test_flash_forward_solution_solves():
    assert check("ch07.flash_forward_kernel", forward_with(solutions.flash_forward_kernel), attention_reference,
                 forward_cases, out=True).solved


def test_flash_forward_two_passes_are_refused_for_their_traffic():
    verdict = check("ch07.flash_forward_kernel", forward_with(two_pass_kernel), attention_reference, forward_cases,
                    out=True)
    assert not verdict.solved and "one pass over the keys" in verdict.message, verdict.message


def test_flash_forward_unmasked_keys_are_wrong_values():
    verdict = check("ch07.flash_forward_kernel", forward_with(unmasked_keys_kernel), attention_reference,
                    forward_cases, out=True)
    assert not verdict.solved and "wrong" in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 3: the causal key range
# ----------------------------------------------------------------------------------------------


def blocks_by_scan(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    offset = seq_k - seq_q
    keys = [j for i in range(start_m, min(start_m + BLOCK_M, seq_q)) for j in range(seq_k)
            if j <= i + offset and (window is None or j > i + offset - window)]
    return (0, 0) if not keys else (min(keys) // BLOCK_N * BLOCK_N, max(keys) + 1)


SHAPES = [(16, 16, 64, 64, None), (16, 32, 40, 100, None), (32, 16, 1, 77, None), (16, 16, 50, 20, None),
          (16, 16, 64, 64, 24), (8, 16, 30, 90, 5), (16, 8, 33, 33, 1), (64, 64, 10, 300, 128)]
BLOCK_CASES = [(start_m, *shape) for shape in SHAPES for start_m in range(0, shape[2], shape[0])]


def top_left_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    last_key = min(min(start_m + BLOCK_M, seq_q) - 1, seq_k - 1)  # j <= i: aligned to the top left
    first_key = 0 if window is None else max(0, start_m - window + 1)
    return (0, 0) if last_key < first_key else (first_key // BLOCK_N * BLOCK_N, last_key + 1)


def blocks_without_the_window(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    return solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, None)


def blocks_to_the_end(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window=None):
    lo, hi = solutions.causal_key_blocks(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window)
    return lo, seq_k  # right answers, every block visited: what skipping is for


def test_causal_key_blocks_solution_solves_and_matches_the_scan_widely():
    assert check("ch07.causal_key_blocks", solutions.causal_key_blocks, blocks_by_scan, BLOCK_CASES).solved
    wide = [(m0, bm, bn, tq, tk, w) for bm in (4, 16) for bn in (4, 8) for tq in (1, 5, 33) for tk in (1, 7, 40)
            for w in (None, 1, 3, 50) for m0 in range(0, tq, bm)]
    assert [solutions.causal_key_blocks(*c) for c in wide] == [blocks_by_scan(*c) for c in wide]


@pytest.mark.parametrize("wrong", [top_left_blocks, blocks_without_the_window, blocks_to_the_end])
def test_causal_key_blocks_negative_controls(wrong):
    verdict = check("ch07.causal_key_blocks", wrong, blocks_by_scan, BLOCK_CASES)
    assert not verdict.solved and "start_m=" in verdict.message, verdict.message


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


def gather_with(kernel):
    def gather_kv(k, n_q_heads, out):
        batch, n_kv_heads, seq, head_dim = k.shape
        kernel[(batch, n_q_heads)](k, out, n_q_heads, n_kv_heads, SEQ=seq, HEAD_DIM=head_dim)
        return out

    return gather_kv


def repeat_kv_reference(k, n_q_heads):
    return torch.repeat_interleave(k, n_q_heads // k.shape[1], dim=1)


def gqa_cases(gen):
    return [(torch.randn(batch, kv_heads, 8, 16, generator=gen).to(DEVICE), q_heads)
            for batch, q_heads, kv_heads in ((1, 8, 2), (2, 4, 1), (1, 6, 3), (1, 4, 4))]


def test_kv_head_index_solution_solves_and_the_modulo_grouping_does_not():
    assert check("ch07.kv_head_index", gather_with(gather_solution_kernel), repeat_kv_reference, gqa_cases,
                 out=True).solved
    verdict = check("ch07.kv_head_index", gather_with(gather_modulo_kernel), repeat_kv_reference, gqa_cases, out=True)
    assert not verdict.solved and "wrong" in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 5: the backward of one tile
# ----------------------------------------------------------------------------------------------


def backward_by_autograd(q, k, v, do, lse, delta, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.softmax(scale * (q @ k.T), dim=-1) @ v
    return torch.autograd.grad(out, (q, k, v), do)


def backward_cases(gen):
    cases = []
    for rows, keys, dims in ((8, 8, 16), (5, 13, 32), (16, 3, 8)):
        q, k, v = (torch.randn(n, dims, generator=gen, dtype=torch.float64) for n in (rows, keys, keys))
        do = torch.randn(rows, dims, generator=gen, dtype=torch.float64)
        scale = 1 / math.sqrt(dims)
        scores = scale * (q @ k.T)
        out = torch.softmax(scores, dim=-1) @ v
        cases.append((q, k, v, do, torch.logsumexp(scores, dim=-1), (do * out).sum(-1), scale))
    return cases


def backward_without_delta(q, k, v, do, lse, delta, scale):
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    ds = p * (do @ v.T)  # the softmax's Jacobian forgotten: dS = P o dP
    return scale * (ds @ k), scale * (ds.T @ q), p.T @ do


def backward_without_the_scale(q, k, v, do, lse, delta, scale):
    dq, dk, dv = solutions.attention_backward_tile(q, k, v, do, lse, delta, scale)
    return dq / scale, dk / scale, dv


def test_attention_backward_tile_solution_solves():
    assert check("ch07.attention_backward_tile", solutions.attention_backward_tile, backward_by_autograd,
                 backward_cases).solved


@pytest.mark.parametrize("wrong", [backward_without_delta, backward_without_the_scale])
def test_attention_backward_tile_negative_controls(wrong):
    verdict = check("ch07.attention_backward_tile", wrong, backward_by_autograd, backward_cases)
    assert not verdict.solved and "wrong" in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 6: varlen's work list
# ----------------------------------------------------------------------------------------------


def tiles_by_rows(cu_seqlens, BLOCK_M):
    owner = [b for b in range(len(cu_seqlens) - 1) for _ in range(cu_seqlens[b + 1] - cu_seqlens[b])]
    tiles = []
    for row, b in enumerate(owner):
        if row == cu_seqlens[b] or (row - cu_seqlens[b]) % BLOCK_M == 0:
            tiles.append([b, row, row + 1])
        else:
            tiles[-1][2] = row + 1
    return [tuple(t) for t in tiles]


VARLEN_CASES = [([0, 5, 5, 21, 22], 8), ([0, 16, 32], 16), ([0, 0, 0], 4), ([0, 1, 40, 41, 100], 32)]


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


def test_varlen_tiles_solution_solves():
    assert check("ch07.varlen_tiles", solutions.varlen_tiles, tiles_by_rows, VARLEN_CASES).solved


@pytest.mark.parametrize("wrong", [tiles_on_a_global_grid, tiles_padded_to_the_longest])
def test_varlen_tiles_negative_controls(wrong):
    assert not check("ch07.varlen_tiles", wrong, tiles_by_rows, VARLEN_CASES).solved


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
