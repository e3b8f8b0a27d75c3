"""Solutions to chapter 07, FlashAttention: the online softmax, the tiled forward, causal bounds, GQA,
the backward, varlen packing.

One solution per exercise of ``chapters/07_flash_attention/07_flash_attention.ipynb``, written for
reading, and the given kernels the chapter's ladder runs (``attention_row_kernel`` and the
launchers). In solution mode the notebook's stubs are replaced by these.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

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
