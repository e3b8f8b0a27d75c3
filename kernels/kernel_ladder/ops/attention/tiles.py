"""The ``@triton.jit`` helpers every flash-attention kernel shares, and their constants.

Each program first finds its sequence (:func:`_sequence`: fixed lengths, or a packed sequence's start
and length from ``cu_seqlens``), then the blocks of the other side it visits: a range of consecutive
blocks cut where the causal diagonal and the sliding window start and stop being masked
(:func:`_key_range` for a query block, :func:`_query_range` for a key block, both around
:func:`_diagonal`), or a block-sparse row's list (:func:`_block_list`).

The kernels call these by keyword, so that a reader sees which value is which bound and which switch.
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * log2(e))
_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) = log2(x) * ln(2)
_FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)  # a finite start for the running max (no inf - inf)


@triton.jit
def _diagonal(seqlen_q, seqlen_k):
    """The causal diagonal's offset: query ``i`` sees key ``j <= i + diagonal`` (bottom-right aligned)."""
    return seqlen_k - seqlen_q


@triton.jit
def _sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, batch, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``batch``: from cu_seqlens (VARLEN) or fixed.

    VARLEN: ``seqlen_q``/``seqlen_k`` are the packed lengths, and each sequence is clamped into them, so
    that cu_seqlens a check would reject (value checks off: a GPU's default) never reach outside q, k, v
    (a start outside ``[0, total]`` moves to its edge, an end before its start makes the sequence empty)."""
    if VARLEN:
        q_start = tl.minimum(tl.maximum(tl.load(cu_seqlens_q_ptr + batch), 0), seqlen_q)
        q_len = tl.minimum(tl.maximum(tl.load(cu_seqlens_q_ptr + batch + 1), q_start), seqlen_q) - q_start
        k_start = tl.minimum(tl.maximum(tl.load(cu_seqlens_k_ptr + batch), 0), seqlen_k)
        k_len = tl.minimum(tl.maximum(tl.load(cu_seqlens_k_ptr + batch + 1), k_start), seqlen_k) - k_start
    else:
        q_start = 0
        q_len = seqlen_q
        k_start = 0
        k_len = seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def _key_range(m0, m_last, seqlen_k, diagonal, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               BLOCK_N: tl.constexpr, INDEX_64: tl.constexpr):
    """The key blocks query rows ``m0 .. m_last`` see: ``(lo, full_lo, full_hi, hi)``.

    Keys ``[lo, hi)`` cover every visible key (``lo`` a multiple of BLOCK_N); blocks in
    ``[full_lo, full_hi)`` are visible to every row entirely (no mask needed); ``[lo, full_lo)``
    (the window's edge) and ``[full_hi, hi)`` (the diagonal, the end of the keys) are masked.
    ``lo <= full_lo <= full_hi <= hi``; every bound is clamped at 0 before it is divided.
    """
    if CAUSAL:
        hi = tl.maximum(tl.minimum(seqlen_k, m_last + diagonal + 1), 0)
        full_hi = tl.maximum(tl.minimum(seqlen_k, m0 + diagonal + 1), 0) // BLOCK_N * BLOCK_N
    else:
        hi = seqlen_k
        full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(m0 + diagonal - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m_last + diagonal - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        lo = hi * 0
        full_lo = lo
    full_hi = tl.maximum(full_hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    if INDEX_64:  # the loops multiply these by strides
        lo, full_lo, full_hi, hi = lo.to(tl.int64), full_lo.to(tl.int64), full_hi.to(tl.int64), hi.to(tl.int64)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(n0, n_last, seqlen_q, diagonal, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """The query blocks that see keys ``n0 .. n_last``: ``(lo, full_lo, full_hi, hi)`` as in :func:`_key_range`.

    Key ``j`` is seen by rows ``[j - diagonal, j - diagonal + W)``. Rows past ``seqlen_q`` (the last
    block's padding) need no mask: they load ``lse2 = +inf``, so their ``P`` is 0. int32 bounds: the
    dK/dV loop widens its row offsets to int64 itself where needed.
    """
    if CAUSAL:
        lo = tl.maximum(n0 - diagonal, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n_last - diagonal, 0), BLOCK_M) * BLOCK_M
    else:
        lo = seqlen_q * 0
        full_lo = lo
    if HAS_WINDOW:
        hi = tl.maximum(tl.minimum(seqlen_q, n_last - diagonal + window), 0)
        edge = n0 - diagonal + window  # rows below it see every key of the block from the window's side
        full_hi = tl.where(edge >= seqlen_q, seqlen_q, tl.maximum(edge, 0) // BLOCK_M * BLOCK_M)
    else:
        hi = seqlen_q
        full_hi = seqlen_q
    full_hi = tl.maximum(tl.minimum(full_hi, hi), lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _block_list(block_count_ptr, block_index_ptr, stride_cb, stride_ch, stride_cm, stride_ib, stride_ih, stride_im,
                batch, head, row):
    """BLOCK_SPARSE: ``(pointer to the list, its length)`` of row ``row`` (a query block for the forward and
    dQ, a key block for dK/dV) of ``(batch, head)``: the blocks of the other side that the mask allows."""
    n_blocks = tl.load(block_count_ptr + batch * stride_cb + head * stride_ch + row * stride_cm)
    return block_index_ptr + batch * stride_ib + head * stride_ih + row * stride_im, n_blocks
