"""Solutions to chapter 07, FlashAttention: the online softmax, the tiled forward, causal bounds, GQA,
the backward, varlen packing, attention sinks.

One solution per exercise of ``chapters/07_flash_attention/07_flash_attention.ipynb``, written for
reading, and the given kernels the chapter's ladder runs (``attention_row_kernel`` and the
launchers). In solution mode the notebook's stubs are replaced by these. Below them, what the
chapter gives each exercise's check — its reference (written apart from the solution), its cases
(adversarial ones included: a maximum that falls by 190 between tiles, scores near ±200 and −250, a
masked first tile), the rules its spec states, the diagnosis naming the common mistakes, and the
traffic verdict — which the notebook's checks and ``tests/test_solutions_ch07.py`` both use.
"""

from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

import kernel_ladder  # fixes interpreter/compiled mode before any @triton.jit below

__all__ = [
    "attention_row_kernel",
    "launch_attention_rows",
    "online_softmax_update",
    "flash_forward_kernel",
    "launch_flash_forward",
    "causal_key_blocks",
    "kv_head_index",
    "attention_backward_tile",
    "varlen_tiles",
    "sink_attention",
    # what the chapter gives its checks
    "fold_tiles_with",
    "fold_reference",
    "fold_cases",
    "online_softmax_rules",
    "diagnose_fold",
    "flash_forward_with",
    "forward_reference",
    "forward_cases",
    "forward_tolerance",
    "flash_forward_rules",
    "flash_forward_traffic",
    "diagnose_flash_forward",
    "blocks_by_scan",
    "BLOCK_CASES",
    "diagnose_key_blocks",
    "repeat_kv_reference",
    "gqa_cases",
    "gather_traffic",
    "diagnose_kv_head_index",
    "backward_reference",
    "backward_cases",
    "diagnose_backward_tile",
    "tiles_by_rows",
    "VARLEN_CASES",
    "diagnose_varlen_tiles",
    "sink_reference",
    "sink_cases",
    "sink_attention_rules",
    "diagnose_sink_attention",
]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))


# ----------------------------------------------------------------------------------------------
# Given: one query block per program, holding its whole row of scores
# ----------------------------------------------------------------------------------------------


@triton.jit
def attention_row_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,  # q, k, v, out: contiguous (BH, T, D); lse (BH, Tq) fp32
    seq_q, seq_k, scale,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """The second step of the ladder (given in the notebook): a ``(BLOCK_M, BLOCK_K)`` tile holds
    the scores of ``BLOCK_M`` queries against *every* key (``BLOCK_K >= seq_k``), so the softmax is
    an ordinary one. Right, and nothing T x T is written — but the tile, and the whole K and V it
    loads, grow with the sequence."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.arange(0, BLOCK_K)
    d = tl.arange(0, HEAD_DIM)
    q_rows = bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :]
    kv_rows = bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_rows, mask=rows[:, None] < seq_q, other=0.0)
    k = tl.load(k_ptr + kv_rows, mask=keys[:, None] < seq_k, other=0.0)  # every key at once
    v = tl.load(v_ptr + kv_rows, mask=keys[:, None] < seq_k, other=0.0)
    s = tl.dot(q, tl.trans(k)) * (scale * 1.4426950408889634)  # base-2 scores
    s = tl.where(keys[None, :] < seq_k, s, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.math.exp2(s - m[:, None])
    l = tl.sum(p, axis=1)
    o = tl.dot(p.to(v.dtype), v) / l[:, None]
    tl.store(out_ptr + q_rows, o.to(out_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)
    lse = (m + tl.math.log2(l)) / 1.4426950408889634  # back to natural log
    tl.store(lse_ptr + bh * seq_q + rows, lse, mask=rows < seq_q)


def _check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("the chapter's kernels take contiguous (BH, T, D) tensors")
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the chapter's kernels take a head dim that is a power of two >= 16, got {head_dim}")


def launch_attention_rows(kernel, q, k, v, out, lse, BLOCK_M: int = 16):
    """One program per ``BLOCK_M`` queries of one (batch, head); the whole key row in one tile."""
    _check_dense(q, k, v)
    bh, seq_q, head_dim = q.shape
    seq_k = k.shape[1]
    grid = (triton.cdiv(seq_q, BLOCK_M), bh)
    kernel[grid](q, k, v, out, lse, seq_q, seq_k, 1.0 / math.sqrt(head_dim),
                 BLOCK_M=BLOCK_M, BLOCK_K=max(16, triton.next_power_of_2(seq_k)), HEAD_DIM=head_dim)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Exercise 1: the online softmax's update
# ----------------------------------------------------------------------------------------------


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of keys into the running state of ``M`` query rows.

    The state after some keys is ``m`` (the running row maximum of the scores, ``-inf`` before any),
    ``l = Σ exp(s - m)`` and ``acc = Σ exp(s - m) v`` over those keys. A new tile of scores
    ``(M, N)`` with its values ``(N, D)`` moves the maximum to ``m_new = max(m, rowmax(scores))``;
    everything summed so far was relative to the old maximum, so it is rescaled by
    ``alpha = exp(m - m_new)`` before the tile's own terms are added. ``acc / l`` is then the
    softmax-weighted average of every value seen. A row that has seen no key yet (all ``-inf``,
    possibly after this tile too) would compute ``exp(-inf - (-inf))``, NaN: the exponentials are
    taken against 0 instead, which gives 0 for every ``-inf``.
    """
    m_new = torch.maximum(m, scores.amax(dim=1))
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)  # 0 for the first tile (m = -inf)
    p = torch.exp(scores - m_safe[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


# ----------------------------------------------------------------------------------------------
# Exercise 2: the FlashAttention forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def flash_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,  # q, k, v, out: contiguous (BH, T, D); lse (BH, Tq) fp32
    seq_q, seq_k, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """``BLOCK_M`` queries of one (batch, head) against every key, ``BLOCK_N`` keys at a time.

    The scores of one tile live in registers only; the running maximum ``m``, sum ``l`` and
    output ``acc`` are rescaled when the maximum moves (exercise 1, in base 2: the scale is
    multiplied by ``log2(e)`` once so that every exponential is an ``exp2``). The output is
    ``acc / l``, the log-sum-exp ``m + log(l)`` (natural log) is written for the backward.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :],
                mask=rows[:, None] < seq_q, other=0.0)
    qk_scale = scale * 1.4426950408889634
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, seq_k, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        v = tl.load(v_ptr + bh * seq_k * HEAD_DIM + keys[:, None] * HEAD_DIM + d[None, :],
                    mask=keys[:, None] < seq_k, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(keys[None, :] < seq_k, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(out_ptr + bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :],
             (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)
    lse = (m + tl.math.log2(l)) / 1.4426950408889634  # back to natural log
    tl.store(lse_ptr + bh * seq_q + rows, lse, mask=rows < seq_q)


def launch_flash_forward(kernel, q, k, v, out, lse, BLOCK_M: int = 16, BLOCK_N: int = 16):
    """One program per ``BLOCK_M`` queries of one (batch, head), over contiguous ``(BH, T, D)`` tensors."""
    _check_dense(q, k, v)
    bh, seq_q, head_dim = q.shape
    grid = (triton.cdiv(seq_q, BLOCK_M), bh)
    kernel[grid](q, k, v, out, lse, seq_q, k.shape[1], 1.0 / math.sqrt(head_dim),
                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Exercise 3: which key blocks a causal (sliding-window) query block visits
# ----------------------------------------------------------------------------------------------


def causal_key_blocks(start_m: int, BLOCK_M: int, BLOCK_N: int, seq_q: int, seq_k: int,
                      window: int | None = None) -> tuple[int, int]:
    """The key loop ``range(lo, hi, BLOCK_N)`` of the query block whose first row is ``start_m``.

    Causal attention aligned to the bottom right: query ``i`` sees key ``j`` when
    ``j <= i + seq_k - seq_q``; with a window of ``W``, only when also ``j > i + seq_k - seq_q - W``.
    The block's rows are ``start_m .. min(start_m + BLOCK_M, seq_q) - 1``; the keys they see,
    together, are one interval. ``lo`` is the start of the key block holding its first key (a
    multiple of ``BLOCK_N``), ``hi`` one past its last key; ``(0, 0)`` if the block sees none.
    """
    offset = seq_k - seq_q
    last_row = min(start_m + BLOCK_M, seq_q) - 1
    last_key = last_row + offset  # the last row sees furthest (at most seq_k - 1: last_row < seq_q)
    first_key = 0 if window is None else max(0, start_m + offset - window + 1)  # the first row, least far
    if last_key < first_key:
        return 0, 0
    return (first_key // BLOCK_N) * BLOCK_N, last_key + 1


# ----------------------------------------------------------------------------------------------
# Exercise 4: the GQA index map
# ----------------------------------------------------------------------------------------------


@triton.jit
def kv_head_index(q_head, n_q_heads, n_kv_heads):
    """The key/value head query head ``q_head`` reads: groups of ``n_q_heads // n_kv_heads``
    consecutive query heads share one (Hugging Face's ``repeat_kv`` repeats each kv head in place,
    ``repeat_interleave``, so query heads ``0 .. G-1`` see kv head 0)."""
    return q_head // (n_q_heads // n_kv_heads)


# ----------------------------------------------------------------------------------------------
# Exercise 5: the backward of one tile
# ----------------------------------------------------------------------------------------------


def attention_backward_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                            lse: torch.Tensor, delta: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``out = softmax(scale · q kᵀ) v`` for queries ``(M, D)`` and keys ``(N, D)``.

    ``P`` is recomputed from the saved log-sum-exp, ``P = exp(scale · q kᵀ - lse)``, never stored.
    ``dV = Pᵀ dO``; ``dP = dO Vᵀ``; the softmax's Jacobian gives ``dS = P ∘ (dP - delta)`` with
    ``delta_i = Σ_j P_ij dP_ij = Σ_d dO_id O_id`` (computed once from ``dO`` and ``O``, not from
    ``P``); then ``dQ = scale · dS K`` and ``dK = scale · dSᵀ Q``.
    """
    p = torch.exp(scale * (q @ k.T) - lse[:, None])
    dv = p.T @ do
    dp = do @ v.T
    ds = p * (dp - delta[:, None])
    return scale * (ds @ k), scale * (ds.T @ q), dv


# ----------------------------------------------------------------------------------------------
# Exercise 6: varlen's work list
# ----------------------------------------------------------------------------------------------


def varlen_tiles(cu_seqlens: list[int], BLOCK_M: int) -> list[tuple[int, int, int]]:
    """The query blocks of packed sequences: ``(sequence, first row, one past the last row)`` each.

    Sequence ``b`` holds packed rows ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``. Its blocks start
    at its own first row, every ``BLOCK_M`` rows, and stop at its end (the last one may be
    short); an empty sequence has none. No block straddles two sequences and none covers padding.
    """
    tiles = []
    for b in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        for row in range(start, end, BLOCK_M):
            tiles.append((b, row, min(row + BLOCK_M, end)))
    return tiles


# ----------------------------------------------------------------------------------------------
# Exercise 7: attention sinks (GPT-OSS), forward and the sink's gradient
# ----------------------------------------------------------------------------------------------


def sink_attention(scores: torch.Tensor, v: torch.Tensor, sink: float, widths: list[int],
                   do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, d_sink)`` of one head's rows with an attention sink: a logit ``sink`` that joins every
    row's softmax denominator and nothing else (GPT-OSS), ``out = Σ_j e^{s_j} v_j / (e^{sink} + Σ_j e^{s_j})``.

    The key tiles (``widths``) are folded with exercise 1's update; the sink is one more "tile" of one
    column, score ``sink`` and value 0, folded in **once**, after the last tile: the running maximum may
    move to it, the old sums are rescaled, and ``e^{sink - m}`` joins ``l`` only. Then ``out = acc / l`` and
    ``lse = m + log l`` — the sink counted, so that ``P_sink = e^{sink - lse}`` is its probability.

    The gradient of the sink, from ``dO`` (the output's gradient): ``∂out_i/∂sink = -P_sink,i · out_i``, so
    ``d_sink = -Σ_i P_sink,i · δ_i`` with ``δ_i = Σ_d dO_id O_id`` — the same ``δ`` as the backward's.
    """
    rows = scores.shape[0]
    m = torch.full((rows,), float("-inf"), dtype=scores.dtype)
    l = torch.zeros(rows, dtype=scores.dtype)
    acc = torch.zeros(rows, v.shape[1], dtype=scores.dtype)
    start = 0
    for width in widths:
        m, l, acc = online_softmax_update(m, l, acc, scores[:, start:start + width], v[start:start + width])
        start += width
    # The one-line change, written out: fold the sink once, as a key of score `sink` and value 0.
    m_new = torch.maximum(m, torch.full_like(m, sink))
    alpha = torch.exp(m - m_new)
    l = l * alpha + torch.exp(sink - m_new)
    acc = acc * alpha[:, None]
    out = acc / l[:, None]
    lse = m_new + torch.log(l)
    delta = (do * out).sum(dim=1)
    d_sink = -(torch.exp(sink - lse) * delta).sum()
    return out, lse, d_sink


# ----------------------------------------------------------------------------------------------
# What the chapter gives: each exercise's reference (written apart from the solution), its cases,
# the rules its spec states, its diagnosis and, where the chapter teaches bytes, its traffic
# verdict — the notebook's checks and tests/test_solutions_ch07.py both use these.
# ----------------------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Looser than the check's own: a diagnosis tells mistakes apart (they differ by far more), it does
    not judge precision, and a variant recomputed in float64 differs from the kernel's rounding."""
    from utils.exercises import default_tolerance

    rtol, atol = default_tolerance(dtype)
    return max(2 * rtol, 1e-4), max(2 * atol, 1e-5)


def _close(got: object, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """``got`` equals the float64 ``want`` rounded to ``dtype``, within a diagnosis's tolerance for it."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return False
    rtol, atol = _tolerance(dtype)
    got64, want64 = got.detach().cpu().double(), want.detach().cpu().to(dtype).double()
    finite = torch.isfinite(want64)
    if not bool((torch.isfinite(got64) == finite).all()):
        return False
    return bool(torch.allclose(got64[finite], want64[finite], rtol=rtol, atol=atol))


def _all_close(got: object, want: tuple, dtypes: tuple) -> bool:
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        return False
    return all(_close(g, w, d) for g, w, d in zip(got, want, dtypes))


# Exercise 1: the update ------------------------------------------------------------------------


def fold_tiles_with(update):
    """The exercise's candidate: attention of each row of ``scores`` ``(M, Tk)`` over ``v`` ``(Tk, D)``,
    folded tile by tile (``widths``) with ``update``, then ``acc / l`` and ``m + log l`` once at the end."""

    def fold_tiles(scores: torch.Tensor, v: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
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


def fold_reference(scores: torch.Tensor, v: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole row at once: ``softmax(S) V`` and the log-sum-exp."""
    return torch.softmax(scores, dim=1) @ v, torch.logsumexp(scores, dim=1)


def fold_cases(gen: torch.Generator) -> list[tuple]:
    """Tiles whose maximum rises and falls, masked keys, a row that sees nothing in its first tile; then
    the adversarial case: a maximum that falls from about 200 to about 10 between tiles, a row whose
    scores are all near −250, a masked first tile before scores near +200, a rise from −200 to +200, a
    masked first tile before scores near −250."""
    cases = []
    for rows, widths, dims in ((4, [8, 8], 8), (6, [5, 16, 3], 16), (3, [1, 7, 32, 2], 4)):
        total = sum(widths)
        scores = torch.randn(rows, total, generator=gen) * 3
        scores[:, :widths[0]] += 8.0             # a large first tile: the maximum falls later
        scores[0, -widths[-1]:] += 12.0          # row 0: a larger maximum in the last tile
        scores[1, 1::3] = float("-inf")          # masked keys
        scores[2, :widths[0]] = float("-inf")    # row 2 sees no key of the first tile
        cases.append((scores, torch.randn(total, dims, generator=gen), widths))
    widths = [8, 8, 8]
    scores = torch.randn(5, 24, generator=gen)
    scores[0, :8] += 200.0                       # the maximum falls from ~200 to ~10
    scores[0, 8:] += 10.0
    scores[1] -= 250.0                           # every score near -250: exp(s) alone underflows
    scores[2, :8] = float("-inf")                # a masked first tile, then scores near +200
    scores[2, 8:] += 200.0
    scores[3, :8] -= 200.0                       # the maximum rises from ~-200 to ~+200
    scores[3, 8:] += 200.0
    scores[4, :8] = float("-inf")                # a masked first tile, then scores near -250: m must stay
    scores[4, 8:] -= 250.0                       # -inf after the first tile, or exp(s - 0) underflows
    cases.append((scores, torch.randn(24, 8, generator=gen), widths))
    return cases


def online_softmax_rules(update) -> list:
    """The spec's "torch, no loops", held to the learner's ``update`` (the given fold loops over tiles)."""
    from utils.exercises import rules

    return [rules.no_python_loops(why="torch, no loops (one tile's update is tensor ops)", function=update)]


def _update_variants() -> dict[str, object]:
    def no_rescaled_acc(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(dim=1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - safe), torch.exp(s - safe[:, None])
        return m_new, l * alpha + p.sum(1), acc + p @ v

    def no_rescaled_l(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(dim=1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - safe), torch.exp(s - safe[:, None])
        return m_new, l + p.sum(1), acc * alpha[:, None] + p @ v

    def tile_maximum(m, l, acc, s, v):
        tile = s.amax(dim=1)
        safe = torch.where(tile == float("-inf"), torch.zeros_like(tile), tile)
        p = torch.exp(s - safe[:, None])
        return torch.maximum(m, tile), l + p.sum(1), acc + p @ v

    def maximum_not_kept(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(dim=1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - safe), torch.exp(s - safe[:, None])
        return m, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v

    def alpha_inverted(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(dim=1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        old = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        alpha, p = torch.exp(safe - old), torch.exp(s - safe[:, None])
        return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v

    def normalised_every_step(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(dim=1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        alpha, p = torch.exp(m - safe), torch.exp(s - safe[:, None])
        l_new = l * alpha + p.sum(1)
        return m_new, l_new, (acc * (l * alpha)[:, None] + p @ v) / torch.where(l_new == 0, 1.0, l_new)[:, None]

    return {
        "acc is divided by l at every step: keep acc = Σ exp(s − m) v unnormalised, as FlashAttention-2 does — the "
        "fold divides by l once, after the last tile": normalised_every_step,
        "acc is not rescaled: when the maximum moves, multiply acc by alpha = exp(m − m_new), as l is":
            no_rescaled_acc,
        "l is not rescaled: when the maximum moves, multiply l by alpha = exp(m − m_new), as acc is": no_rescaled_l,
        "each tile's terms are taken against the tile's own maximum and summed unrescaled: every term must be "
        "relative to the running maximum m_new = max(m, rowmax(scores)), the old sums rescaled by exp(m − m_new)":
            tile_maximum,
        "the returned m is the old maximum: return m_new, the next tile's terms are relative to it":
            maximum_not_kept,
        "alpha is inverted: the old sums are relative to m, so they are multiplied by exp(m − m_new) ≤ 1":
            alpha_inverted,
    }


def _explains(got: tuple, want: tuple, expected: tuple, dtypes: tuple) -> bool:
    """``want`` (a wrong variant, float64) accounts for every finite element where ``got`` is wrong, in
    every output, and is right where ``got`` is right; at least one element is wrong."""
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        return False
    wrong_somewhere = False
    for g, w, e, dtype in zip(got, want, expected, dtypes):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(w.shape):
            return False
        rtol, atol = _tolerance(dtype)
        g, w, e = (t.detach().cpu().double() for t in (g, w.to(dtype), e))
        finite = torch.isfinite(g)
        wrong = finite & ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        right = finite & ~wrong
        if not bool(torch.isclose(g[wrong], w[wrong], rtol=rtol, atol=atol).all()):
            return False
        if not bool(torch.isclose(w[right], e[right], rtol=rtol, atol=atol, equal_nan=True).all()):
            return False
        wrong_somewhere |= bool(wrong.any())
    return wrong_somewhere


def diagnose_fold(case: tuple, got: tuple, expected: tuple) -> str | None:
    """The common mistakes of exercise 1: which rows came out NaN and why, and which update the finite
    wrong rows are."""
    scores, v, widths = case
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        return None
    causes = []
    out = got[0].detach()
    if out.shape[0] == scores.shape[0]:
        starts = [sum(widths[:i]) for i in range(len(widths))]
        bad = set((~torch.isfinite(out).all(dim=1)).nonzero().flatten().tolist())
        peaks = scores.amax(dim=1)
        hot = {r for r in range(scores.shape[0]) if float(peaks[r]) > 89}  # exp overflows float32 past ~88.7
        cold = {r for r in range(scores.shape[0]) if float(peaks[r]) < -104}  # and underflows below ~-103.9
        if hot and cold and hot | cold <= bad:
            top, bottom = float(peaks.max()), float(peaks.min())
            causes.append(f"no maximum is subtracted: exp(s) overflows float32 for scores near {top:.0f} "
                          f"(rows {sorted(hot)}) and underflows to l = 0 near {bottom:.0f} (rows "
                          f"{sorted(cold)}) — take every exponential relative to the running maximum, "
                          "m_new = max(m, rowmax(scores))")
        for row in [] if causes else sorted(bad):
            maxima = [float(scores[row, a:a + w].max()) for a, w in zip(starts, widths)]
            falls = [a - b for a, b in zip(maxima, maxima[1:])]
            if maxima[0] == float("-inf") and max(maxima) < -80:
                causes.append(f"row {row} sees no key in the first tile, and the m returned after it is 0: m must "
                              "stay −inf while no key is seen (take the exponentials against 0, but return m_new) "
                              f"— its next scores, near {max(maxima):.0f}, taken against 0 underflow to l = 0")
            elif maxima[0] == float("-inf"):
                causes.append(f"row {row} sees no key in the first tile (all −inf), and exp(−inf − (−inf)) is NaN: "
                              "where m_new is still −inf, take the exponentials against 0")
            elif max(maxima) < -80:
                causes.append(f"row {row}'s scores are all near {max(maxima):.0f}: exp(s) alone underflows to 0 "
                              "and l = 0 gives 0/0 — take every exponential relative to the running maximum")
            elif falls and max(falls) > 80:
                causes.append(f"row {row}'s maximum falls by {max(falls):.0f} between tiles, and exp of that "
                              "overflows float32: keep the running maximum m_new = max(m, rowmax(scores)) and "
                              "rescale the old sums by exp(m − m_new) ≤ 1, never towards a tile's own maximum")
            if causes:
                break
    for cause, update in _update_variants().items():
        want = fold_tiles_with(update)(scores.double(), v.double(), widths)
        if _explains(got, want, expected, (scores.dtype, scores.dtype)):
            causes.append(cause if not causes else "and besides, " + cause)
            break
    return "; ".join(causes) or None


# Exercise 2: the forward kernel ----------------------------------------------------------------

#: The launcher's blocks (``launch_flash_forward``'s defaults): the check's rule and diagnosis use them.
FORWARD_BLOCK_M = FORWARD_BLOCK_N = 16


def flash_forward_with(kernel):
    """The exercise's candidate: ``launch_flash_forward`` with the learner's kernel, writing ``out`` and ``lse``."""

    def flash_forward(q, k, v, out, lse):
        launch_flash_forward(kernel, q, k, v, out, lse, BLOCK_M=FORWARD_BLOCK_M, BLOCK_N=FORWARD_BLOCK_N)
        return out, lse

    return flash_forward


def _dense_attention(q, k, v, scale):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v.double(), lse


def forward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over ``(BH, T, D)`` tensors, and the natural-log log-sum-exp (fp32, as written)."""
    out, lse = _dense_attention(q, k, v, 1 / math.sqrt(q.shape[-1]))
    return out, lse.float()


def forward_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """fp32 and bf16, lengths that are not multiples of the blocks, a single key tile; then scores that
    fall from ~200 to ~10 after the first key tile, that rise from ~−200 to ~+200, and last three query
    blocks (the traffic verdict is the last case's)."""
    from kernel_ladder.runtime import DEVICE

    cases = []
    for heads, seq_q, seq_k, dims, dtype in ((1, 16, 16, 16, torch.float32), (3, 37, 45, 32, torch.float32),
                                             (2, 20, 7, 64, torch.bfloat16), (2, 5, 50, 16, torch.bfloat16)):
        q = torch.randn(heads, seq_q, dims, generator=gen)
        k = torch.randn(heads, seq_k, dims, generator=gen) * 2
        v = torch.randn(heads, seq_k, dims, generator=gen)
        cases.append(tuple(t.to(DEVICE, dtype) for t in (q, k, v)))
    for levels in (((0, 200.0), (16, 10.0)), ((0, -200.0), (16, 200.0))):
        direction = torch.randn(16, generator=gen)
        direction /= direction.norm()
        level = torch.zeros(40)
        for start, value in levels:
            level[start:] = value
        q = 4.0 * direction + 0.02 * torch.randn(2, 20, 16, generator=gen)  # scale · q · k = level for k = level · u
        k = level[:, None] * direction + 0.02 * torch.randn(2, 40, 16, generator=gen)
        v = torch.randn(2, 40, 16, generator=gen)
        cases.append(tuple(t.to(DEVICE) for t in (q, k, v)))
    q, k, v = (torch.randn(2, n, 32, generator=gen) for n in (40, 37, 37))
    cases.append(tuple(t.to(DEVICE) for t in (q, k, v)))
    return cases


def forward_tolerance(case: tuple, dtype: torch.dtype | None) -> tuple[float, float] | None:
    """fp32's rounding of a score of magnitude |s| moves its exponential by about |s| · 2⁻²³: the cases
    with scores near 200 get that much room (the dtype's default elsewhere)."""
    q, k, _ = case
    if dtype != torch.float32:
        return None
    largest = float(((q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])).abs().max())
    rtol = max(1e-5, 8 * largest * 2.0**-24)
    return rtol, rtol  # the output averages values of order 1: its error is absolute, not relative to it


def _keys_once_per_query_block(args: tuple, launches) -> str | None:
    from utils.exercises.rules import bytes_read

    q, k, v = args
    blocks = triton.cdiv(q.shape[1], FORWARD_BLOCK_M)
    read = bytes_read(launches, k) + bytes_read(launches, v)
    once = blocks * (k.nbytes + v.nbytes)
    if read <= once:
        return None
    return (f"the kernel read {read:,} bytes of k and v, {read / once:.1f}× once per query block: one pass over "
            "the keys, the softmax rescaled as it goes")


def _dots_in_the_inputs_dtype(args: tuple, launches) -> str | None:
    """Every ``tl.dot`` the tracer saw took operands of the inputs' dtype (bf16 inputs: bf16 × bf16, what a
    GPU's tensor cores run at full rate; an fp32 dot of upcast inputs runs at a fraction of it)."""
    q = args[0]
    want = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype)
    if want is None:
        return None
    for launch in launches:
        for (a, b), count in getattr(launch, "dot_dtypes", {}).items():
            if (a, b) != (want, want):
                return (f"{want} inputs, but a tl.dot took {a} × {b} operands ({count} calls): keep q, k and v in "
                        f"their dtype and cast p to v.dtype — tl.dot accumulates in fp32 anyway")
    return None


def flash_forward_rules() -> list:
    from utils.exercises import rules

    return [rules.traced(_keys_once_per_query_block, name="one pass over the keys (k and v read once per query "
                                                           "block)"),
            rules.traced(_dots_in_the_inputs_dtype, name="tl.dot in the inputs' dtype (fp32 accumulation)")]


def _forward_ideal(q, k, v) -> int:
    lse = q.shape[0] * q.shape[1] * 4
    return q.nbytes + k.nbytes + v.nbytes + q.nbytes + lse


def _forward_top(q, k, v) -> int:
    """What the ladder's top moves on the case: ``kernel_ladder.flash_attention``, traced."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        kernel_ladder.flash_attention(q[None], k[None], v[None])
    return traced.bytes


def _forward_explain(reread: dict[str, float]) -> str | None:
    factor = reread.get("k", 0)
    if factor > 1.05:
        return (f"K and V are read once per query block of {FORWARD_BLOCK_M} ({factor:.0f} blocks): the larger "
                "BLOCK_M of kernel_ladder.flash_attention feeds more queries from each byte of K and V")
    return None


def flash_forward_traffic():
    from utils.exercises import Traffic

    return Traffic(ideal=_forward_ideal, top=_forward_top, explain=_forward_explain)


def _tiled_forward(q, k, v, scale, rescale_acc=True, rescale_l=True, divide=True, lse_kind="natural",
                   extra_key=False):
    """The forward as the kernel computes it, key tile by key tile, in float64, with a mistake planted."""
    q, k, v = q.double(), k.double(), v.double()
    heads, seq_q, _ = q.shape
    outs, lses = [], []
    for h in range(heads):
        keys, values = k[h], v[h]
        if extra_key:  # the mask's bound one too far: key seq_k is the next head's key 0
            keys = torch.cat((keys, k[h + 1, :1]))
            values = torch.cat((values, v[h + 1, :1]))
        m = torch.full((seq_q,), float("-inf"), dtype=torch.float64)
        l = torch.zeros(seq_q, dtype=torch.float64)
        acc = torch.zeros(seq_q, q.shape[2], dtype=torch.float64)
        for start in range(0, keys.shape[0], FORWARD_BLOCK_N):
            s = (q[h] @ keys[start:start + FORWARD_BLOCK_N].T) * scale
            m_new = torch.maximum(m, s.amax(dim=1))
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l = (l * alpha if rescale_l else l) + p.sum(1)
            acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ values[start:start + FORWARD_BLOCK_N]
            m = m_new
        outs.append(acc / l[:, None] if divide else acc)
        lse = {"natural": m + torch.log(l), "max only": m, "sum only": torch.log(l),
               "base 2": (m + torch.log(l)) * LOG2E, "sum in base 2": m + torch.log(l) * LOG2E}[lse_kind]
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _spilled_rows(q: torch.Tensor, got: object, expected: tuple) -> str | None:
    """The stores not masked to ``rows < seq_q``: a head's last query block writes its rows past ``seq_q`` over
    the next head's first rows (``out`` and ``lse`` are ``(BH, Tq)``, one head's rows after another's)."""
    heads, seq_q, _ = q.shape
    pad = -(-seq_q // FORWARD_BLOCK_M) * FORWARD_BLOCK_M - seq_q
    if heads < 2 or not pad or not isinstance(got, (tuple, list)) or len(got) != 2:
        return None
    wrong_rows = []
    for g, e in zip(got, expected):
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            return None
        rtol, atol = _tolerance(q.dtype)
        close = torch.isclose(g.detach().cpu().double(), e.detach().cpu().to(g.dtype).double(), rtol=rtol, atol=atol)
        wrong_rows.append(~close.reshape(heads, seq_q, -1).all(dim=-1))
    wrong = wrong_rows[0] | wrong_rows[1]
    spill = torch.zeros(heads, seq_q, dtype=torch.bool)
    spill[1:, :pad] = True
    if not bool(wrong.any()) or bool((wrong & ~spill).any()):
        return None
    head = int(wrong.any(dim=1).nonzero()[0]) - 1
    return (f"the stores are not masked to the rows < seq_q: head {head}'s last query block spills its "
            f"{pad} rows past seq_q = {seq_q} into head {head + 1}'s first rows (out and lse hold one head's rows "
            "after another's) — mask both stores with rows < seq_q")


def diagnose_flash_forward(case: tuple, got: tuple, expected: tuple) -> str | None:
    """The common mistakes of exercise 2, each recomputed tile by tile in float64 and compared."""
    q, k, v = case
    dims = q.shape[-1]
    scale = 1 / math.sqrt(dims)
    dtypes = (q.dtype, torch.float32)
    out = got[0] if isinstance(got, (tuple, list)) else None
    if isinstance(out, torch.Tensor) and not bool(torch.isfinite(out.detach()).all()):
        scores = (q.double() @ k.double().transpose(-1, -2)) * scale
        tiles = scores.split(FORWARD_BLOCK_N, dim=-1)
        maxima = torch.stack([t.amax(dim=-1) for t in tiles], dim=-1)
        if maxima.shape[-1] > 1 and float((maxima[..., :-1] - maxima[..., 1:]).max()) > 80:
            return ("NaN/inf where a row's maximum falls by more than 80 after the first key tile: rescale by "
                    "alpha = exp(m − m_new) with m_new = max(m, rowmax(s)), so that no exponent is positive")
    spill = _spilled_rows(q, got, expected)
    if spill:
        return spill
    heads, seq_q, _ = q.shape
    seq_k = k.shape[1]
    padded = -(-seq_k // FORWARD_BLOCK_N) * FORWARD_BLOCK_N
    variants = {}
    if padded > seq_k:  # the padded keys, loaded as 0, score q · 0 = 0 (masked to 0 or not masked at all)
        zeros = q.new_zeros(heads, padded - seq_k, dims)
        variants["the keys past seq_k are not masked to −inf: padded keys (loaded as 0) score 0 and take a share "
                 f"of every row's softmax ({seq_k} keys, {padded} in the last tile) — s = tl.where(keys < seq_k, s, "
                 "float('-inf')), never 0"] = _dense_attention(q, torch.cat((k, zeros), 1), torch.cat((v, zeros), 1),
                                                               scale)
    if heads > 1 and seq_q < seq_k:  # head bh's keys read from row bh * seq_q of the flattened K: in bounds
        rows = torch.arange(heads)[:, None] * seq_q + torch.arange(seq_k)[None, :]
        variants["K and V are offset by bh * seq_q * HEAD_DIM: head bh's keys start at bh * seq_k * HEAD_DIM (K and "
                 "V have seq_k rows per head, Q and the output seq_q)"] = _dense_attention(
            q, k.reshape(-1, dims)[rows], v.reshape(-1, dims)[rows], scale)
    variants.update({
        f"the scores miss the scale 1/√D = {scale:.4g} (scale = 1 / sqrt(HEAD_DIM), given as `scale`)":
            _dense_attention(q, k, v, 1.0),
        f"the scores are multiplied by √D instead of 1/√D (= {scale:.4g})": _dense_attention(q, k, v, math.sqrt(dims)),
        "acc is not rescaled when the maximum moves: acc * alpha[:, None] before adding the tile's p @ v":
            _tiled_forward(q, k, v, scale, rescale_acc=False),
        "l is not rescaled when the maximum moves: l * alpha before adding the tile's sum":
            _tiled_forward(q, k, v, scale, rescale_l=False),
        "the output is not divided by l: out = acc / l[:, None] after the last tile":
            _tiled_forward(q, k, v, scale, divide=False),
        "lse is the running maximum alone: lse = m + log(l)": _tiled_forward(q, k, v, scale, lse_kind="max only"),
        "lse misses the running maximum: lse = m + log(l), not log(l)":
            _tiled_forward(q, k, v, scale, lse_kind="sum only"),
        "lse is in base 2 (scores scaled by log2(e) for exp2): divide m + log2(l) by log2(e) for the natural log":
            _tiled_forward(q, k, v, scale, lse_kind="base 2"),
        "lse is m + log2(l): with natural-log scores (tl.exp) the sum's log is natural too, m + tl.log(l)":
            _tiled_forward(q, k, v, scale, lse_kind="sum in base 2"),
    })
    if k.shape[1] == FORWARD_BLOCK_N == dims:
        # tl.dot(q, k) instead of tl.dot(q, tl.trans(k)): with a square tile it runs, on K's transpose
        variants["K is not transposed: the scores are q · kᵀ, tl.dot(q, tl.trans(k))"] = _dense_attention(
            q, k.transpose(-1, -2), v, scale)
    for cause, want in variants.items():
        if _all_close(got, want, dtypes):
            return cause
    if q.shape[0] > 1 and isinstance(out, torch.Tensor) and out.shape == q.shape:
        extra = _tiled_forward(q[:-1], k, v, scale, extra_key=True)  # heads but the last: theirs is a guard's
        if _close(out[:-1], extra[0], q.dtype):
            return ("the key mask lets key seq_k in (its bound is one too far: keys < seq_k, not <=): each head "
                    "attends to the next head's first key too")
    return None


# Exercise 3: the causal key range --------------------------------------------------------------


def blocks_by_scan(start_m: int, BLOCK_M: int, BLOCK_N: int, seq_q: int, seq_k: int,
                   window: int | None = None) -> tuple[int, int]:
    """The reference: every (query, key) pair of the block scanned."""
    offset = seq_k - seq_q
    keys = [j for i in range(start_m, min(start_m + BLOCK_M, seq_q)) for j in range(seq_k)
            if j <= i + offset and (window is None or j > i + offset - window)]
    return (0, 0) if not keys else (min(keys) // BLOCK_N * BLOCK_N, max(keys) + 1)


_SHAPES = [(16, 16, 64, 64, None), (16, 32, 40, 100, None), (32, 16, 1, 77, None), (16, 16, 50, 20, None),
           (16, 16, 64, 64, 24), (8, 16, 30, 90, 5), (16, 8, 33, 33, 1), (64, 64, 10, 300, 128)]
#: Every query block of each shape ``(BLOCK_M, BLOCK_N, seq_q, seq_k, window)``: square, a cache longer than
#: the chunk, one query, more queries than keys, windows of 24, 5 and 1, a window past the cache.
BLOCK_CASES = [(start_m, *shape) for shape in _SHAPES for start_m in range(0, shape[2], shape[0])]


def _key_range(start_m, BLOCK_M, BLOCK_N, seq_q, seq_k, window, *, offset=None, last_rows_clipped=True,
               lo_rounded=True, hi_exact=True, hi_one_past=True, window_exact=True, empty_checked=True,
               window_used=True, to_the_end=False):
    offset = seq_k - seq_q if offset is None else offset
    last_row = min(start_m + BLOCK_M, seq_q) - 1 if last_rows_clipped else start_m + BLOCK_M - 1
    last_key = min(last_row + offset, seq_k - 1) if last_rows_clipped else last_row + offset
    if window is None or not window_used:
        first_key = 0
    else:
        first_key = max(0, start_m + offset - window + (1 if window_exact else 0))
    if empty_checked and last_key < first_key:
        return 0, 0
    lo = first_key // BLOCK_N * BLOCK_N if lo_rounded else first_key
    hi = last_key + 1 if hi_one_past else last_key
    if not hi_exact:
        hi = triton.cdiv(hi, BLOCK_N) * BLOCK_N
    return lo, seq_k if to_the_end else hi


def diagnose_key_blocks(case: tuple, got: object, expected: tuple[int, int]) -> str | None:
    """The common mistakes of exercise 3, each computed and compared with the answer."""
    start_m, block_m, block_n, seq_q, seq_k, *rest = case
    window = rest[0] if rest else None
    args = (start_m, block_m, block_n, seq_q, seq_k, window)
    variants = {
        "aligned to the top left (j <= i): causal here is aligned to the bottom right, j <= i + seq_k − seq_q":
            _key_range(*args, offset=0),
        "the window is ignored: with a window W the first visible key is start_m + seq_k − seq_q − W + 1":
            _key_range(*args, window_used=False),
        "the window's first key is one too early (j > i + offset − W, so + 1)": _key_range(*args, window_exact=False),
        "hi is one short: one past the last visible key, last_row + seq_k − seq_q + 1": _key_range(*args,
                                                                                                 hi_one_past=False),
        "hi is rounded up to a block: it is exact, one past the last visible key (the kernel masks against it)":
            _key_range(*args, hi_exact=False),
        "lo is not rounded down to a key block: key blocks start at multiples of BLOCK_N":
            _key_range(*args, lo_rounded=False),
        "the block's last row is not clipped to seq_q − 1: a partial last query block sees fewer keys":
            _key_range(*args, last_rows_clipped=False),
        "every block up to seq_k is visited: the keys past the block's last visible one are skipped, not masked":
            _key_range(*args, to_the_end=True),
        "a block that sees no key must give (0, 0)": _key_range(*args, empty_checked=False),
    }
    return next((cause for cause, want in variants.items() if want != expected and got == want), None)


# Exercise 4: the GQA index map -----------------------------------------------------------------


def repeat_kv_reference(k: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: each key/value head repeated in place, ``n_q_heads // n_kv_heads`` times."""
    return torch.repeat_interleave(k, n_q_heads // k.shape[1], dim=1)


def gqa_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, int]]:
    """``(k, n_q_heads)``: groups of two on three kv heads first (where a constant map, ``h // n_kv_heads`` and
    the identity all differ and stay inside K), MHA, MQA, groups of four (last: the traffic verdict's case)."""
    from kernel_ladder.runtime import DEVICE

    return [(torch.randn(batch, kv_heads, 8, 16, generator=gen).to(DEVICE), q_heads)
            for batch, q_heads, kv_heads in ((1, 6, 3), (1, 4, 4), (2, 4, 1), (1, 8, 2))]


def _gather_ideal(k: torch.Tensor, n_q_heads: int) -> int:
    return k.nbytes + k.nbytes * (n_q_heads // k.shape[1])  # each kv head read once, the repeated copy written


def _gather_explain(reread: dict[str, float]) -> str | None:
    factor = reread.get("k", 0)
    if factor > 1.05:
        return (f"each key/value head is read once per query head of its group ({factor:.0f}×) — what repeat_kv's "
                "copy costs; a grouped attention kernel reads K where it lies, the group's query heads sharing one "
                "head's bytes (section 5)")
    return None


def gather_traffic():
    from utils.exercises import Traffic

    return Traffic(ideal=_gather_ideal, explain=_gather_explain)


def diagnose_kv_head_index(case: tuple, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Which key/value head each query head copied, against ``repeat_kv``'s grouping."""
    k, n_q_heads = case
    n_kv_heads = k.shape[1]
    group = n_q_heads // n_kv_heads
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    read = []
    for h in range(n_q_heads):
        matches = [kv for kv in range(n_kv_heads) if torch.equal(got[0, h].cpu(), k[0, kv].cpu())]
        read.append(matches[0] if matches else None)
    if group > 1 and read == [0] * n_q_heads:
        return (f"every query head read kv head 0: the map ignores q_head — query head h reads kv head h // G, "
                f"G = n_q_heads // n_kv_heads = {group}")
    if read == [h % n_kv_heads for h in range(n_q_heads)]:
        return (f"query head h read kv head h % n_kv_heads, the interleaved grouping: repeat_kv gives each kv head "
                f"G = n_q_heads // n_kv_heads = {group} consecutive query heads, h // G")
    if group > 1 and read[:n_kv_heads] == list(range(n_kv_heads)) and None in read[n_kv_heads:]:
        return (f"query head h read kv head h, as if each query head had its own: there are {n_kv_heads} kv heads, "
                f"one per G = n_q_heads // n_kv_heads = {group} consecutive query heads, h // G (query heads "
                f"{n_kv_heads}..{n_q_heads - 1} read past K's last head)")
    if read == [min(h // n_kv_heads, n_kv_heads) for h in range(n_q_heads)]:
        return (f"h // n_kv_heads divides by the number of kv heads ({n_kv_heads}), not by the group size "
                f"G = n_q_heads // n_kv_heads = {group}")
    wrong = [h for h in range(n_q_heads) if read[h] != h // group]
    if wrong:
        h = wrong[0]
        what = f"kv head {read[h]}" if read[h] is not None else "no kv head of its batch"
        return (f"query head {h} read {what}; repeat_kv gives it kv head {h // group} (groups of G = {group} "
                "consecutive query heads)")
    return None


# Exercise 5: the backward of one tile ----------------------------------------------------------


def backward_reference(q, k, v, do, lse, delta, scale):
    """Autograd through a softmax over the tile's keys and the rest of its rows (never the solution's formulas).

    The tile may hold only some of its rows' keys: ``lse`` and ``delta`` are the whole row's. The keys outside
    the tile are stood for by one key per row, its score and value chosen so that the row's log-sum-exp is
    ``lse`` and ``Σ_d dO O`` is ``delta`` (none where the tile holds the whole row); autograd through
    ``softmax([scale · q kᵀ, s_rest]) [v; v_rest]`` then gives the tile's part of ``dq`` and its ``dk``, ``dv``.
    """
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        p_tile = torch.exp(scale * (q @ k.T) - lse[:, None])
        rest = 1 - p_tile.sum(dim=1)  # the probability the row's other keys hold
        outside = rest > 1e-9  # else the tile holds the whole row (up to rounding)
        s_rest = torch.where(outside, lse + torch.log(rest.clamp_min(1e-300)), torch.full_like(rest, -torch.inf))
        # the other keys' part of delta, carried by a value along dO: rest · (dO · v_rest) = delta − tile's part
        tile_part = (p_tile @ v.detach() * do).sum(dim=1)
        weight = torch.where(outside, (delta - tile_part) / (rest * (do * do).sum(dim=1)), torch.zeros_like(rest))
        v_rest = weight[:, None] * do
    scores = torch.cat((scale * (q @ k.T), s_rest[:, None]), dim=1)
    probs = torch.softmax(scores, dim=-1)
    out = probs[:, :-1] @ v + probs[:, -1:] * v_rest
    return torch.autograd.grad(out, (q, k, v), do)


def backward_cases(gen: torch.Generator) -> list[tuple]:
    """float64 tiles: square (where a transpose still runs), more keys, more queries; then scores in the
    thousands, where exp(s) alone overflows even float64; last, a tile of keys 6..13 of rows that have 20
    (``lse`` and ``delta`` the whole row's, as the kernel's key blocks see them)."""
    cases = []
    for rows, keys, dims, spread in ((8, 8, 16, 1.0), (5, 13, 32, 1.0), (16, 3, 8, 1.0), (6, 9, 16, 1000.0)):
        q, k, v = (torch.randn(n, dims, generator=gen, dtype=torch.float64) for n in (rows, keys, keys))
        scale = 1 / math.sqrt(dims)
        if spread > 1:  # a query along key 0, its score exactly `spread`: exp of it overflows float64
            q[0] = k[0] * (spread / (scale * float(k[0] @ k[0])))
        do = torch.randn(rows, dims, generator=gen, dtype=torch.float64)
        scores = scale * (q @ k.T)
        out = torch.softmax(scores, dim=-1) @ v
        cases.append((q, k, v, do, torch.logsumexp(scores, dim=-1), (do * out).sum(-1), scale))
    q, k, v = (torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (8, 20, 20))
    do = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    scores = 0.25 * (q @ k.T)
    out = torch.softmax(scores, dim=-1) @ v
    cases.append((q, k[6:14], v[6:14], do, torch.logsumexp(scores, dim=-1), (do * out).sum(-1), 0.25))
    return cases


def diagnose_backward_tile(case: tuple, got: tuple, expected: tuple) -> str | None:
    """The common mistakes of exercise 5, each computed and compared (dq, dk, dv together)."""
    q, k, v, do, lse, delta, scale = case
    if isinstance(got, (tuple, list)) and any(isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all())
                                              for t in got):
        return (f"NaN/inf: the scores reach {float((scale * (q @ k.T)).abs().max()):.0f} here — exp(s) / exp(lse) "
                "overflows; recompute P as exp(scale · q kᵀ − lse), one exponent")
    s = scale * (q @ k.T)
    p = torch.exp(s - lse[:, None])
    dp = do @ v.T
    ds = p * (dp - delta[:, None])
    right = (scale * ds @ k, scale * ds.T @ q, p.T @ do)
    no_delta = p * dp
    unscaled_p = torch.exp(q @ k.T - lse[:, None])
    ds_unscaled_p = unscaled_p * (do @ v.T - delta[:, None])
    share = float(p.sum(dim=1).mean())
    own_p = torch.softmax(s, dim=-1)
    ds_own_p = own_p * (dp - delta[:, None])
    ds_own_delta = p * (dp - (p * dp).sum(1, keepdim=True))
    ds_outside = p * dp - delta[:, None]
    ds_added = p * (dp + delta[:, None])
    partial = f"the tile holds only part of its rows' keys (their P sums to {share:.2f} of each row here)"
    variants = {
        f"P is the tile's own softmax: {partial}, so P = exp(scale · q kᵀ − lse) with the whole row's lse":
            (scale * ds_own_p @ k, scale * ds_own_p.T @ q, own_p.T @ do),
        f"delta is recomputed from the tile: {partial}, and delta sums over every key of the row — use the "
        "delta given (Σ_d dO O, from the forward's output)": (scale * ds_own_delta @ k, scale * ds_own_delta.T @ q,
                                                              right[2]),
        "dS = P ∘ dP − delta: the parenthesis slipped, dS = P ∘ (dP − delta[:, None])":
            (scale * ds_outside @ k, scale * ds_outside.T @ q, right[2]),
        "delta's sign is flipped: dS = P ∘ (dP − delta[:, None])": (scale * ds_added @ k, scale * ds_added.T @ q,
                                                                     right[2]),
        "dS misses delta: the softmax's Jacobian gives dS = P ∘ (dP − delta[:, None])":
            (scale * no_delta @ k, scale * no_delta.T @ q, right[2]),
        "dq and dk miss the scale: S = scale · q kᵀ, so dQ = scale · dS K and dK = scale · dSᵀ Q":
            (ds @ k, ds.T @ q, right[2]),
        "P is recomputed without the scale: P = exp(scale · q kᵀ − lse)":
            (scale * ds_unscaled_p @ k, scale * ds_unscaled_p.T @ q, unscaled_p.T @ do),
    }
    if q.shape[0] == k.shape[0]:  # a square tile: the transposes run and give wrong numbers
        variants["dq and dk are swapped: return (dq, dk, dv), dq = scale · dS K (one row per query), "
                 "dk = scale · dSᵀ Q (one per key)"] = (right[1], right[0], right[2])
        variants["dQ is built from Q and dK from K: dQ = scale · dS K, dK = scale · dSᵀ Q"] = (
            scale * ds @ q, scale * ds.T @ k, right[2])
        variants["dV is P dO, not Pᵀ dO: dV sums over the queries, dV = P.T @ dO"] = (*right[:2], p @ do)
        variants["dK is dS Q, not dSᵀ Q: dK sums over the queries, dK = scale · dS.T @ Q"] = (
            right[0], scale * ds @ q, right[2])
        variants["dQ is dSᵀ K, not dS K: dQ sums over the keys, dQ = scale · dS @ K"] = (
            scale * ds.T @ k, *right[1:])
    dtypes = (q.dtype, k.dtype, v.dtype)
    return next((cause for cause, want in variants.items() if _all_close(got, want, dtypes)), None)


# Exercise 6: varlen's work list ----------------------------------------------------------------


def tiles_by_rows(cu_seqlens: list[int], BLOCK_M: int) -> list[tuple[int, int, int]]:
    """The reference: each packed row assigned to its sequence, a new tile every ``BLOCK_M`` rows of it."""
    owner = [b for b in range(len(cu_seqlens) - 1) for _ in range(cu_seqlens[b + 1] - cu_seqlens[b])]
    tiles: list[list[int]] = []
    for row, b in enumerate(owner):
        if row == cu_seqlens[b] or (row - cu_seqlens[b]) % BLOCK_M == 0:
            tiles.append([b, row, row + 1])
        else:
            tiles[-1][2] = row + 1
    return [tuple(t) for t in tiles]


#: ``(cu_seqlens, BLOCK_M)``: an empty sequence in the middle, whole blocks, only empty sequences, one-row
#: sequences beside a long one.
VARLEN_CASES = [([0, 5, 5, 21, 22], 8), ([0, 16, 32], 16), ([0, 0, 0], 4), ([0, 1, 40, 41, 100], 32)]


def diagnose_varlen_tiles(case: tuple, got: object, expected: list) -> str | None:
    """What is wrong with the work list: blocks on one grid over the packed rows, an empty sequence's tile,
    rows counted from a sequence's own start, a last block running past its sequence's end."""
    cu, block = case
    if not isinstance(got, (list, tuple)):
        return None
    tiles = []
    for tile in got:
        if not (isinstance(tile, (tuple, list)) and len(tile) == 3):
            return f"each tile is a tuple (sequence, first_row, end_row); got {tile!r}"
        b, first, end = tile
        if not (isinstance(b, int) and 0 <= b < len(cu) - 1):
            return f"tile {tuple(tile)} names sequence {b!r}, not one of 0..{len(cu) - 2}"
        tiles.append((b, first, end))
    if [(b, first + cu[b], end + cu[b]) for b, first, end in tiles] == [tuple(t) for t in expected]:
        b, first, end = next(t for t in tiles if cu[t[0]])
        return (f"the rows are counted from each sequence's start (tile {(b, first, end)} of sequence {b}); rows "
                f"are packed indices: add cu_seqlens[{b}] = {cu[b]}")
    longest = max(cu[b + 1] - cu[b] for b in range(len(cu) - 1))
    per_sequence = [sum(t[0] == b for t in tiles) for b in range(len(cu) - 1)]
    if longest and len(set(per_sequence)) == 1 and per_sequence[0] == -(-longest // block) and tiles != expected:
        return (f"every sequence gets the {per_sequence[0]} tiles of the longest ({longest} rows): that is padding "
                "— each sequence's tiles stop at its own end, and an empty one has none")
    for b, first, end in tiles:
        start = cu[b]
        if start <= first < cu[b + 1] and (first - start) % block:
            return (f"tile {(b, first, end)} starts {first - start} rows into sequence {b}: blocks on one grid over "
                    "the packed rows straddle sequences — start each sequence's blocks at its own first row")
    for b, first, end in tiles:
        if cu[b] == cu[b + 1]:
            return f"sequence {b} is empty and gets tile {(b, first, end)}: an empty sequence has no tile"
    for b, first, end in tiles:
        if end > cu[b + 1]:
            return (f"tile {(b, first, end)} runs past sequence {b}'s end ({cu[b + 1]}): the last block is short, "
                    "min(row + BLOCK_M, end) — no tile covers padding")
        if end - first > block:
            return f"tile {(b, first, end)} holds {end - first} rows, more than BLOCK_M = {block}"
    return None


# Exercise 7: attention sinks -----------------------------------------------------------------------


def sink_reference(scores: torch.Tensor, v: torch.Tensor, sink: float, widths: list[int],
                   do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-OSS's ``eager_attention_forward`` (transformers, models/gpt_oss): the sink as one more column of
    the logits, the row maximum subtracted, a softmax, the sink's column dropped; ``d_sink`` by autograd."""
    sink_t = torch.tensor(float(sink), dtype=scores.dtype, requires_grad=True)
    combined = torch.cat([scores, sink_t.expand(scores.shape[0], 1)], dim=1)
    combined = combined - combined.max(dim=1, keepdim=True).values.detach()
    probs = torch.softmax(combined, dim=1)
    out = probs[:, :-1] @ v
    lse = torch.logsumexp(torch.cat([scores, sink_t.detach().expand(scores.shape[0], 1)], dim=1), dim=1)
    (d_sink,) = torch.autograd.grad(out, sink_t, do)
    return out.detach(), lse, d_sink


def sink_cases(gen: torch.Generator) -> list[tuple]:
    """Rows of one head with a sink: tiles whose maximum moves, masked keys; case 2, a row that sees no key
    at all (only the sink: output 0, lse = the sink); case 3, three tiles and a sink as large as the scores
    (a sink folded per tile weighs three times), one row peaking below it (the maximum moves to the sink:
    l and acc rescaled) and one above, for every seed; and case 4, the adversarial one: scores near +200 in
    one row and near -250 in another, and a sink of 100 (``exp(100)`` overflows float32: the sink must be
    taken against the max)."""
    cases = []
    for number, (rows, widths, dims, sink) in enumerate(((4, [8, 8], 8, 0.5), (6, [5, 16, 3], 16, -1.0),
                                                         (5, [8, 8, 8], 8, 4.0)), start=1):
        total = sum(widths)
        scores = torch.randn(rows, total, generator=gen) * 3
        scores[1, 1::3] = float("-inf")  # masked keys
        scores[2, :widths[0]] = float("-inf")  # no key in the first tile
        if rows > 5:
            scores[5] = float("-inf")  # no key at all: only the sink
        if number == 3:  # the maximum of row 3 moves to the sink; row 0's stays above it
            scores[3] += (sink - 1.5) - scores[3].max()
            scores[0] += (sink + 1.5) - scores[0].max()
        cases.append((scores, torch.randn(total, dims, generator=gen), sink, widths,
                      torch.randn(rows, dims, generator=gen)))
    scores = torch.randn(4, 24, generator=gen)
    scores[0] += 200.0  # exp(s) overflows: everything against the running maximum
    scores[1] -= 250.0  # every score far below the sink: the sink takes (almost) everything
    scores[2, :8] = float("-inf")
    scores[2, 8:] += 99.0  # scores right at the sink's level: both count
    cases.append((scores, torch.randn(24, 8, generator=gen), 100.0, [8, 8, 8], torch.randn(4, 8, generator=gen)))
    return cases


def _update_calls(candidate, case: tuple) -> list[tuple]:
    """The ``(scores, v)`` tiles that exercise 1's update folded while ``candidate`` ran once more on a copy
    of ``case``, in call order. Any function named ``online_softmax_update`` counts (the given one, or the
    learner's own from exercise 1), seen by a profile hook, whatever name the candidate calls it by; a call
    made from inside another such call is not counted again."""
    calls: list[tuple] = []
    open_frames: set[int] = set()

    def hook(frame, event, _arg):
        if frame.f_code.co_name != "online_softmax_update":
            return
        if event == "call" and not open_frames:
            code = frame.f_code
            arguments = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount]]
            calls.append(tuple(arguments[3:5]) if len(arguments) >= 5 else (None, None))
            open_frames.add(id(frame))
        elif event == "return":
            open_frames.discard(id(frame))

    copies = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in case)
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        candidate(*copies)
    finally:
        sys.setprofile(previous)
    return calls


def _key_tiles_folded_by_the_update(context) -> str | None:
    """None when the candidate's run folded the key tiles with exercise 1's update, one call per tile, in
    order (and at most one more call, before, between or after them: the sink as a tile of one key, value
    0 — the fold's order does not change its result); else what it did instead."""
    scores, v, sink, widths, _ = context.case
    calls = _update_calls(context.candidate, context.case)
    tiles = len(widths)
    said = f"{tiles} key tile{'s' if tiles != 1 else ''} here, widths {list(widths)}"

    def is_the_sink(call: tuple) -> bool:
        tile_scores, tile_v = call
        return (isinstance(tile_scores, torch.Tensor) and isinstance(tile_v, torch.Tensor)
                and tile_scores.shape[-1] == 1 and bool((tile_scores == sink).all()) and not bool(tile_v.any()))

    sink_calls = [i for i, call in enumerate(calls) if is_the_sink(call)]
    if len(calls) == tiles + 1 and sink_calls:
        calls = calls[:sink_calls[0]] + calls[sink_calls[0] + 1:]
    if len(calls) != tiles:
        times = "never ran" if not calls else f"ran {len(calls)} time{'s' if len(calls) != 1 else ''}"
        return (f"exercise 1's update (online_softmax_update) {times}, for {said}: call it once per tile, on "
                "that tile's scores and values, then fold the sink once")
    start = 0
    for index, (width, (tile_scores, tile_v)) in enumerate(zip(widths, calls)):
        want = scores[:, start:start + width]
        if not isinstance(tile_scores, torch.Tensor) or tuple(tile_scores.shape) != tuple(want.shape):
            shape = tuple(tile_scores.shape) if isinstance(tile_scores, torch.Tensor) else type(tile_scores).__name__
            return (f"call {index + 1} of exercise 1's update got scores of shape {shape}; tile {index + 1} of "
                    f"widths {list(widths)} is {tuple(want.shape)}: one call per tile, on that tile's keys")
        if not torch.equal(tile_scores.detach().to(want.dtype).cpu(), want.cpu()):
            return (f"call {index + 1} of exercise 1's update got scores other than keys [{start}, {start + width}) "
                    f"of the rows as given (tile {index + 1} of widths {list(widths)}): fold the tiles unchanged")
        if not isinstance(tile_v, torch.Tensor) or tuple(tile_v.shape) != (width, v.shape[1]):
            return f"call {index + 1} of exercise 1's update got values not shaped ({width}, {v.shape[1]}), its tile's"
        start += width
    return None


def sink_attention_rules() -> list:
    """The spec's "fold the key tiles with exercise 1's update": the candidate is run once more, and the
    calls of the update are counted and compared with the tiles (a whole-row softmax or logsumexp, or all
    the keys as one tile, gets the right values by another route)."""
    from utils.exercises.rules import Rule

    return [Rule(name="the key tiles folded with exercise 1's update (one call per tile)",
                 why="fold the key tiles with exercise 1's update", problem=_key_tiles_folded_by_the_update)]


def _unguarded_update(m, l, acc, scores, v):
    """Exercise 1's update without its ``-inf`` guard: ``exp(-inf - (-inf))`` is NaN for a row that has
    seen no key through a whole tile."""
    m_new = torch.maximum(m, scores.amax(dim=1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v


def _sink_fold(scores, v, sink, widths, update=online_softmax_update):
    """``(m, l, acc)`` after the key tiles, then ``(m', l', acc')`` after the sink's fold, all in float64."""
    rows = scores.shape[0]
    m = torch.full((rows,), float("-inf"), dtype=torch.float64)
    l, acc = torch.zeros(rows, dtype=torch.float64), torch.zeros(rows, v.shape[1], dtype=torch.float64)
    start = 0
    for width in widths:
        m, l, acc = update(m, l, acc, scores[:, start:start + width], v[start:start + width])
        start += width
    top = torch.maximum(m, torch.full_like(m, sink))
    alpha = torch.exp(m - top)
    return (m, l, acc), (top, l * alpha + torch.exp(sink - top), acc * alpha[:, None])


def _sink_variants(case: tuple) -> dict[str, tuple]:
    """The likely wrong answers of exercise 7, each computed in float64 from the case: ``(out, lse, d_sink)``,
    ``d_sink`` None where the mistake is in the forward (whatever the backward made of it). Some hold NaN or
    inf where the mistake makes them (the comparison asks for the same non-finite places)."""
    scores, v, sink, widths, do = (t.double() if isinstance(t, torch.Tensor) else t for t in case)
    (m, l, acc), (top, l_sink, acc_top) = _sink_fold(scores, v, sink, widths)
    alpha = torch.exp(m - top)
    e_sink = torch.exp(sink - top)
    out = acc_top / l_sink[:, None]
    lse = top + torch.log(l_sink)
    delta = (do * out).sum(1)
    p_sink = torch.exp(sink - lse)
    d_sink = -(p_sink * delta).sum()
    seen = torch.isfinite(m)
    m_seen = torch.where(seen, m, 0.0)
    l_seen = torch.where(seen, l, 1.0)
    plain_out = torch.where(seen[:, None], acc / l_seen[:, None], 0.0)
    plain_lse = torch.where(seen, m_seen + torch.log(l_seen), float("-inf"))
    tiles = len(widths)
    per_tile_l = l * alpha + tiles * e_sink  # the sink folded into every tile: it weighs `tiles` times
    l_unrescaled = l + e_sink  # l left relative to the keys' maximum when the maximum moves to the sink
    weight_l = l + sink * torch.exp(-m_seen)  # `sink` itself in the denominator, not e^sink
    shifted_weight_l = l + sink  # the same, added to the sum taken against the keys' maximum
    _, (s_top, s_l, s_acc) = _sink_fold(scores, v, sink / math.sqrt(v.shape[1]), widths)
    _, (n_top, n_l, n_acc) = _sink_fold(scores, v, sink, widths, update=_unguarded_update)
    zero = torch.zeros((), dtype=torch.float64)
    as_a_weight = ("the sink is added as a weight, not as a logit ({}): its term in the denominator is e^sink — "
                   "exp(sink − m') against the running maximum")
    return {
        f"the sink is counted once per key tile ({tiles} tiles here): fold it in once, after the last tile":
            (acc_top / per_tile_l[:, None], top + torch.log(per_tile_l), None),
        "the sink is added to the numerator too: it joins the denominator only (its value is 0, its column is "
        "dropped)": ((acc_top + e_sink[:, None]) / l_sink[:, None], lse, None),
        "the sink is left out: softmax(S) V — the sink joins every row's denominator, l += exp(sink - m) once at "
        "the end": (plain_out, plain_lse, None),
        "lse leaves the sink out: take lse = m + log(l) after the sink's fold, so that P_sink = exp(sink - lse) "
        "is its probability": (out, plain_lse, None),
        "the sink is in lse but not in the output's denominator: out = acc' / l' after the sink's fold (the sink "
        "takes its share of every row), not acc / l of the keys alone": (plain_out, lse, None),
        "lse is taken from the maximum before the sink's fold: l' is relative to m' = max(m, sink), so "
        "lse = m' + log l' (m is −inf for a row that sees no key)":
            (out, m + torch.log(l_sink), None),
        "acc is not rescaled when the maximum moves to the sink: acc' = acc · exp(m − m'), as l is":
            (acc / l_sink[:, None], lse, None),
        "l is not rescaled when the maximum moves to the sink: l' = l · exp(m − m') + exp(sink − m'), as acc is":
            (acc_top / l_unrescaled[:, None], top + torch.log(l_unrescaled), None),
        as_a_weight.format("l + sink · e^−m"): (acc / weight_l[:, None], m_seen + torch.log(weight_l), None),
        as_a_weight.format("l + sink"): (acc / shifted_weight_l[:, None], m_seen + torch.log(shifted_weight_l), None),
        "the sink is scaled like the scores (sink / √D): the scores come scaled, the sink is a logit as it is — "
        "fold it unchanged": (s_acc / s_l[:, None], s_top + torch.log(s_l), None),
        "NaN in rows that see no key through a whole tile: exp(−inf − (−inf)) in the update — guard it as "
        "exercise 1's does (the exponentials taken against 0 while m_new = −inf)":
            (n_acc / n_l[:, None], n_top + torch.log(n_l), None),
        "d_sink has the wrong sign: d_sink = -Σ_i P_sink,i · δ_i": (out, lse, -d_sink),
        "the sink is ignored in the backward (d_sink = 0): ∂out_i/∂sink = -P_sink,i · out_i, so "
        "d_sink = -Σ_i P_sink,i · δ_i with δ_i = Σ_d dO_id O_id": (out, lse, zero),
        "d_sink misses δ: d_sink = -Σ_i P_sink,i · δ_i, δ_i = Σ_d dO_id O_id": (out, lse, -p_sink.sum()),
        f"d_sink is a mean over the rows (1/{scores.shape[0]} of the sum): d_sink = −Σ_i P_sink,i · δ_i sums "
        "the rows' terms": (out, lse, d_sink / scores.shape[0]),
        f"δ is a mean over the features (1/{v.shape[1]} of the sum): δ_i = Σ_d dO_id O_id":
            (out, lse, d_sink / v.shape[1]),
        "δ leaves the output out: δ_i = Σ_d dO_id · O_id, not Σ_d dO_id":
            (out, lse, -(p_sink * do.sum(1)).sum()),
        "δ is taken from the unnormalised acc: δ_i = Σ_d dO_id O_id with O = acc' / l', the output":
            (out, lse, -(p_sink * (do * acc_top).sum(1)).sum()),
    }


def diagnose_sink_attention(case: tuple, got: tuple, expected: tuple) -> str | None:
    """The common mistakes of exercise 7, each computed and compared (out and lse, and d_sink where the
    mistake is in the backward); then, for NaN/inf that none of them explains, an overflow — only where the
    sink is large enough to make one (``exp(sink)`` beyond float32's range, or ``exp(sink − m)`` for a row
    whose scores lie that far below it)."""
    scores, _, sink, _, _ = case
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return None
    dtypes = tuple(t.dtype if isinstance(t, torch.Tensor) else torch.float32 for t in expected)
    for cause, (out, lse, d_sink) in _sink_variants(case).items():
        if d_sink is None and _all_close(expected[:2], (out, lse), dtypes[:2]):
            continue  # a forward mistake that changes nothing in this case (no row's maximum moves to the sink)
        if _all_close(got[:2], (out, lse), dtypes[:2]) and (d_sink is None or _close(got[2], d_sink, dtypes[2])):
            return cause
    if not any(isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()) for t in got):
        return None
    limit = math.log(torch.finfo(scores.dtype).max)  # exp(x) overflows beyond it: 88.7 in float32
    dtype = str(scores.dtype).removeprefix("torch.")
    if sink > limit:
        top = float(scores[torch.isfinite(scores)].max())
        return (f"NaN/inf: the sink is {sink:g} and the scores reach {top:.0f} here — exp(sink) alone overflows "
                f"{dtype} (beyond e^{limit:.1f}); fold it against the running maximum: m' = max(m, sink), "
                "l = l · exp(m − m') + exp(sink − m')")
    maxima = scores.amax(dim=1)
    far = torch.isfinite(maxima) & (sink - maxima > limit)
    if bool(far.any()):
        row = int(far.nonzero()[0][0])
        return (f"NaN/inf: the sink is {sink:g} and row {row}'s scores reach only {float(maxima[row]):.0f} — "
                f"exp(sink − m) overflows {dtype} there; take the maximum with the sink first: m' = max(m, sink), "
                "l = l · exp(m − m') + exp(sink − m')")
    return None
