"""Flash attention (FlashAttention-2), forward and backward, dense and packed (varlen), as
``kernel_ladder::flash_attention`` and ``kernel_ladder::flash_attention_varlen``.

For one head, with queries ``Q`` (``Tq x D``), keys ``K`` and values ``V`` (``Tk x D``)::

    S = scale * Q K^T              (then, with softcap c: S = c * tanh(S / c), Gemma-2's order)
    P = softmax(S + mask)          row by row; masked entries get probability 0
    O = P V                        lse_i = log sum_j exp(S_ij)  (over the visible j)

**Never the Tq x Tk matrix.** One program owns ``BLOCK_M`` query rows of one head and walks the
keys ``BLOCK_N`` at a time, keeping for each row a running maximum ``m``, a running sum ``l`` of
``exp(S - m)`` and an unnormalized output ``acc`` (the *online softmax*, Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022, arXiv:2205.14135; FlashAttention-2, Dao 2023, arXiv:2307.08691).
For each key block::

    m' = max(m, rowmax(S_blk))     alpha = exp(m - m')          (the rescale)
    P_blk = exp(S_blk - m')        l' = alpha * l + rowsum(P_blk)
    acc' = alpha * acc + P_blk V_blk

and at the end ``O = acc / l``, ``lse = m + log(l)``. The rescale makes every earlier term as if it
had been computed with the final maximum, so the result is exact, and no ``exp`` ever overflows.
Scores are kept in base 2: ``log2(e)`` is folded into the scale once, so each score costs one
multiply and one ``exp2`` (the GPU's native instruction). Everything accumulates in float32; ``P``
is rounded to the inputs' dtype only to feed the second ``tl.dot``, as on tensor cores. The
running maximum starts at the most negative finite float, not ``-inf``, so that a block in which a
row sees no key (all ``-inf``) gives ``exp2(-inf - finite) = 0`` and never ``inf - inf``.

**Causal and sliding-window masks, and skipping.** ``causal`` is aligned to the bottom right, as in
FlashAttention 2 and ``flash_attn_func``: with ``diag = Tk - Tq``, query ``i`` sees key ``j`` iff
``j <= i + diag`` (so the last query sees every key, and a single query token — decoding — sees the
whole cache). ``window = W`` (Mistral's sliding window; needs ``causal``) also requires
``j > i + diag - W``: the ``W`` most recent keys, its own position included. For a query block with
rows ``m0 .. m1`` the visible keys are ``[m0 + diag - W + 1, m1 + diag]`` (clamped to ``[0, Tk)``),
so the key loop runs over those blocks only: everything else is skipped, not masked. Inside that
range, blocks that every row of the block sees entirely (keys ``[m1 + diag - W + 1, m0 + diag]``
and inside ``Tk``) run without any mask; only the blocks on the diagonal, on the window's edge and
at the end of the keys compute the mask. Causal attention with ``Tq = Tk`` thus does
``(n + 1) / 2n`` of the full work for ``n`` blocks — about half (the FLOP count is traced in the
tests). When ``Tq > Tk``, the first ``Tq - Tk`` queries see no key at all: their output is 0 and
their ``lse`` is ``-inf``, as in flash-attn (a softmax over an all-``-inf`` row in torch gives NaN).

**Grouped-query attention without copies.** The grid is ``(query blocks, Hq, B)``; the program of
query head ``h`` reads key/value head ``h // (Hq // Hkv)``. K and V are never repeated in memory;
each query head's programs stream their group's K/V themselves (on a GPU the group's repeated reads
are mostly served by L2). Packing a group's query heads into one program's rows, which would read
K/V once per group (what decoding with a single query would gain most from), is not done here.

**Backward (FlashAttention-2).** The forward saves ``O`` and ``lse`` (one float per row), not
``P``: the backward recomputes ``P_ij = exp(S_ij - lse_i)`` exactly, block by block. With
``dO`` the output's gradient::

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta),  delta_i = sum_j P_ij dP_ij
    dQ = scale * dS K  dK = scale * dS^T Q

(``dS`` is the gradient of the softmax's input; with soft-capping it is multiplied by
``1 - tanh(S / c)^2``, the derivative of ``c * tanh(x / c)``). The row sums ``delta_i`` would need
a full row of ``P`` and ``dP``, but ``sum_j P_ij dP_ij = sum_j P_ij (dO_i . V_j) = dO_i . O_i``:
a preprocess kernel computes ``delta = rowsum(dO * O)`` once, from two ``Tq x D`` tensors. A
gradient of the returned ``lse`` adds ``dlse_i * P_ij`` to ``dS_ij`` (``d lse_i / d S_ij =
P_ij``), so it is folded in as ``delta - dlse``: ``lse`` is differentiable at no extra cost (later
chapters merge partial attention results through it).

Then two kernels:

* ``dK, dV``: one program per (key block, **kv** head, batch). It holds its ``K_blk, V_blk`` and
  fp32 ``dK_blk, dV_blk`` on chip and loops over the query heads of its group and, for each,
  over the query blocks that see its keys (for causal/window, ``[n0 - diag, n1 - diag + W)``;
  the others are skipped). So the GQA sum over a group happens inside one program, in a fixed
  order: no atomics and no buffer of repeated K/V gradients.
* ``dQ``: one program per (query block, q head, batch), looping over the same key blocks as the
  forward, recomputing ``P`` and ``dP`` a second time.

Why a second pass for ``dQ`` rather than atomics. ``dQ_i`` sums over every key block, and the
``dK/dV`` program of each key block has the pieces (``dS_blk K_blk``) in registers: adding them
into ``dQ`` with float32 atomics saves the recomputation (FlashAttention-2's original CUDA kernel
does this), but atomic float additions land in whatever order the programs run, so the gradient's
rounding changes from run to run (non-deterministic training), and it needs an fp32 ``dQ``
workspace and a final cast. The separate ``dQ`` kernel costs the ``QK^T`` and ``dO V^T`` products
again — the backward does 7 ``Tq x Tk x D`` matrix products instead of 5 (4 of them in the
``dK/dV`` kernel: ``QK^T``, ``dO V^T``, ``P^T dO``, ``dS^T Q``; 3 in the ``dQ`` kernel:
``QK^T``, ``dO V^T``, ``dS K``), 1.4x the FLOPs — and is deterministic: two backward runs give
bitwise-equal gradients (tested).

**Packed sequences (varlen).** ``q`` is ``(total_q, Hq, D)``: sequence ``b`` is rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` (flash-attn's ``flash_attn_varlen_func``). The same
kernels run with the ``VARLEN`` switch: each program reads its sequence's start and length from
``cu_seqlens`` (two int32 loads), offsets its pointers by ``start * stride`` and uses the
sequence's own lengths for every bound and mask (causal is bottom-right per sequence). The grid is
``(cdiv(max_seqlen, BLOCK), H, B)``; a program whose block starts past its sequence's length exits
at once and key loops stop at the sequence's length, so padding costs no FLOPs and no bytes. The
dense op is the special case of fixed lengths and a batch stride. ``lse`` is ``(Hq, total_q)``,
flash-attn's varlen layout. The ``cu_seqlens`` are checked on the device (one tiny Triton launch and
``torch._assert_async``: no host synchronization on a GPU, by the value-check policy of
:mod:`kernel_ladder.runtime`; see :func:`check_cu_seqlens_values`).

**Block-sparse (``kernel_ladder.block_sparse_attention``).** With the ``BLOCK_SPARSE`` switch the forward and
dQ programs' key loop, and the dK/dV program's query loop, take their blocks from a per-row int32 list
(``block_count_ptr``/``block_index_ptr``, :class:`BlockLists`) instead of a consecutive range: the same
loop bodies, one block index loaded per step, no causal/window mask (a listed block is visible whole;
only the length bounds are masked). The tiles are then the mask's blocks; see
:mod:`kernel_ladder.ops.block_sparse_attention`.

**Tiles.** On a GPU each kernel is autotuned (``triton.autotune``, :func:`make_autotuned`) over its own
list of tile configurations — the forward over 64/128-row query blocks and 32-128-key blocks with 4 or
8 warps and 2-3 pipeline stages; the backward kernels over smaller blocks (16-128), because the dK/dV
program holds four tiles of its key block (K, V, dK, dV) and the dQ program three, and the register
file, not shared memory, is what runs out first. Each config carries the widest head dim at which
ptxas fits it in registers for sm_90 without spilling (measured by ``tests/aot/flash_attention.py``;
separately for fp32 inputs and for soft-capping, which keeps more live), and the pruner keeps the
configs that fit the launch's head dim, dtype and shared memory. The key is the head-dim tile, the
switches and power-of-two buckets of the lengths. In the interpreter, which cannot autotune, one
small configuration runs (:data:`INTERPRETER_CONFIG`). Head dims up to 256 are supported, any value
(48, 80, 96, ...): the tile is padded to the next power of two with masks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._validate import (
    check_attention_options,
    check_bool,
    check_float_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
    check_values,
    schema_types,
)
from .._validate import is_int as _is_int
from ..autotune import _shared_memory_limit, autotune_supports_disk_cache, size_bucket
from .cross_entropy import softcap_logits, softcapped

__all__ = [
    "AttentionConfig",
    "BlockLists",
    "BACKWARD_DKDV_GPU_CONFIGS",
    "BACKWARD_DQ_GPU_CONFIGS",
    "FORWARD_GPU_CONFIGS",
    "INTERPRETER_CONFIG",
    "MAX_HEAD_DIM",
    "check_cu_seqlens_values",
    "flash_attention",
    "flash_attention_backward_dkdv_kernel",
    "flash_attention_backward_dq_kernel",
    "flash_attention_backward_preprocess_kernel",
    "flash_attention_cu_seqlens_kernel",
    "flash_attention_forward_kernel",
    "flash_attention_varlen",
    "fits",
    "hf_attention",
    "make_autotuned",
    "register_hf_attention",
]

_OP = "kernel_ladder.flash_attention"
_VARLEN_OP = "kernel_ladder.flash_attention_varlen"

#: The largest head dim (the tiles hold a whole head: 256 is Gemma's and the shared-memory limit).
MAX_HEAD_DIM: int = 256

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * log2(e))
_LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) = log2(x) * ln(2)
_FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)  # a finite start for the running max (no inf - inf)


# ----------------------------------------------------------------------------------------------
# Shared pieces (@triton.jit helpers)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _diagonal(seqlen_q, seqlen_k):
    """The causal diagonal's offset: query ``i`` sees key ``j <= i + diagonal`` (bottom-right aligned)."""
    return seqlen_k - seqlen_q


@triton.jit
def _sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, batch, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``batch``: from cu_seqlens (VARLEN) or fixed."""
    if VARLEN:
        q_start = tl.load(cu_seqlens_q_ptr + batch)
        q_len = tl.load(cu_seqlens_q_ptr + batch + 1) - q_start
        k_start = tl.load(cu_seqlens_k_ptr + batch)
        k_len = tl.load(cu_seqlens_k_ptr + batch + 1) - k_start
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
                 BLOCK_M: tl.constexpr, INDEX_64: tl.constexpr):
    """The query blocks that see keys ``n0 .. n_last``: ``(lo, full_lo, full_hi, hi)`` as in :func:`_key_range`.

    Key ``j`` is seen by rows ``[j - diagonal, j - diagonal + W)``. Rows past ``seqlen_q`` (the last
    block's padding) need no mask: they load ``lse = +inf``, so their ``P`` is 0.
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
    if INDEX_64:  # the loops multiply these by strides
        lo, full_lo, full_hi, hi = lo.to(tl.int64), full_lo.to(tl.int64), full_hi.to(tl.int64), hi.to(tl.int64)
    return lo, full_lo, full_hi, hi


@triton.jit
def _load_lse2(lse_ptr, offsets, mask):
    """The saved lse in base 2; ``+inf`` for rows that see no key (lse = -inf) and for padding rows,
    so that their recomputed ``P = exp2(S - lse)`` is 0, never ``exp2(-inf + inf)``."""
    lse = tl.load(lse_ptr + offsets, mask=mask, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def _block_list(block_count_ptr, block_index_ptr, stride_cb, stride_ch, stride_cm, stride_ib, stride_ih, stride_im,
                batch, head, row):
    """BLOCK_SPARSE: ``(pointer to the list, its length)`` of row ``row`` (a query block for the forward and
    dQ, a key block for dK/dV) of ``(batch, head)``: the blocks of the other side that the mask allows."""
    n_blocks = tl.load(block_count_ptr + batch * stride_cb + head * stride_ch + row * stride_cm)
    return block_index_ptr + batch * stride_ib + head * stride_ih + row * stride_im, n_blocks


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _forward_blocks(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key, d_mask,
    start, end, seqlen_k, sm_scale, qk_scale, softcap, block_list_ptr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
):
    """Fold key blocks ``[start, end)`` into the running ``(acc, m, l)`` of one query block.

    ``BLOCK_SPARSE``: the ``(end - start) / BLOCK_N`` blocks are not consecutive but read, one per
    step, from the int32 list at ``block_list_ptr`` (block indices, in units of ``BLOCK_N`` keys).

    ``k_ptrs``/``v_ptrs`` point at key 0 of the block's columns (``[BLOCK_N, BLOCK_D]``); row ``i``
    sees keys ``first_key[i] <= j <= last_key[i]`` (``i + diagonal - W + 1`` and ``i + diagonal``).
    Unmasked blocks (``MASKED`` False) are inside ``seqlen_k`` and visible to every row: no mask.
    The loop body is written out (no helper calls): it is the hot loop, also in the interpreter.
    """
    cols = start + tl.arange(0, BLOCK_N)
    k_ptrs += start * stride_kn
    v_ptrs += start * stride_vn
    step_k = BLOCK_N * stride_kn
    step_v = BLOCK_N * stride_vn
    for _ in range(start, end, BLOCK_N):
        if BLOCK_SPARSE:  # the next listed block: its keys and their K/V rows
            block = tl.load(block_list_ptr)
            block_list_ptr += 1
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            k_tile = k_ptrs + block.to(tl.int64) * step_k
            v_tile = v_ptrs + block.to(tl.int64) * step_v
        else:
            k_tile = k_ptrs
            v_tile = v_ptrs
        if MASKED:
            kv_mask = (cols < seqlen_k)[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_tile, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if SOFTCAP:  # Gemma-2: scale, then cap, then base 2
            s = softcapped(qk * sm_scale, softcap) * _LOG2E
        else:
            s = qk * qk_scale
        if MASKED:
            visible = (cols < seqlen_k)[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= last_key[:, None])
            if HAS_WINDOW:
                visible = visible & (cols[None, :] >= first_key[:, None])
            s = tl.where(visible, s, float("-inf"))
            cols += BLOCK_N
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # the rescale of everything accumulated so far
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_tile, mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
        if not BLOCK_SPARSE:
            k_ptrs += step_k
            v_ptrs += step_v
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "BUCKET_Q", "BUCKET_K"])
def flash_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,          # inputs; outputs: out (q's dtype), lse (float32, natural log)
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,             # VARLEN: (B + 1,) int32 sequence starts (else never read)
    block_count_ptr, block_index_ptr,               # BLOCK_SPARSE: int32 counts (Bm, Hm, rows) and lists (.., rows, n)
    stride_cb, stride_ch, stride_cm,                # the counts' strides (0 over a broadcast batch or head)
    stride_ib, stride_ih, stride_im,                # the lists' strides (each list contiguous)
    stride_qb, stride_qh, stride_qm, stride_qd,     # q as (B, Hq, Tq, D) whatever its layout (VARLEN: stride_qb 0)
    stride_kb, stride_kh, stride_kn, stride_kd,     # k, v as (B, Hkv, Tk, D)
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,     # out as (B, Hq, Tq, D)
    stride_lb, stride_lh, stride_lm,                # lse as (B, Hq, Tq) (VARLEN: (Hq, total_q), stride_lb 0)
    seqlen_q, seqlen_k, head_dim, group_size,       # lengths (VARLEN: read from cu_seqlens), Hq // Hkv
    sm_scale, qk_scale, softcap, window,            # qk_scale = sm_scale * log2(e)
    BUCKET_Q, BUCKET_K,                             # the autotuner's key only (powers of two of the lengths)
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out`` and ``lse`` of one block of ``BLOCK_M`` queries of one head; grid ``(query blocks, Hq, B)``.

    Walks the key blocks of :func:`_key_range` only: masked blocks at the window's edge, unmasked
    ones in the middle, masked ones on the diagonal and at the end of the keys.
    """
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = _sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, batch, seqlen_q,
                                                     seqlen_k, VARLEN)
    kv_head = head // group_size
    if INDEX_64:
        head = head.to(tl.int64)
        kv_head = kv_head.to(tl.int64)
        batch = batch.to(tl.int64)
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    m0 = pid_m * BLOCK_M
    if m0 < seqlen_q:  # a varlen program past its sequence's end does nothing
        rows = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        if INDEX_64:
            rows = rows.to(tl.int64)
        d_mask = offs_d < head_dim
        row_mask = rows < seqlen_q
        q_base = q_ptr + batch * stride_qb + head * stride_qh + q_start * stride_qm
        q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        k_ptrs = (k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
                  + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        v_ptrs = (v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
                  + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)

        diagonal = _diagonal(seqlen_q, seqlen_k)
        m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
        lo, full_lo, full_hi, hi = _key_range(m0, m_last, seqlen_k, diagonal, window, CAUSAL, HAS_WINDOW, BLOCK_N,
                                              INDEX_64)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], _FLOAT_MIN, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        last_key = rows + diagonal  # row i sees keys first_key[i] <= j <= last_key[i]
        first_key = last_key - window + 1
        if BLOCK_SPARSE:  # exactly the listed key blocks of this query block (BLOCK_M = BLOCK_N = the mask's block)
            block_list, n_blocks = _block_list(block_count_ptr, block_index_ptr, stride_cb, stride_ch, stride_cm,
                                               stride_ib, stride_ih, stride_im, batch, head, pid_m)
            acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key,
                                            first_key, d_mask, 0, n_blocks * BLOCK_N, seqlen_k, sm_scale, qk_scale,
                                            softcap, block_list, True, False, False, SOFTCAP, INPUT_PRECISION,
                                            BLOCK_N, True)
        else:
            acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key,
                                            first_key, d_mask, lo, full_lo, seqlen_k, sm_scale, qk_scale, softcap,
                                            lse_ptr, True, CAUSAL, HAS_WINDOW, SOFTCAP, INPUT_PRECISION, BLOCK_N,
                                            False)
            acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key,
                                            first_key, d_mask, full_lo, full_hi, seqlen_k, sm_scale, qk_scale, softcap,
                                            lse_ptr, False, CAUSAL, HAS_WINDOW, SOFTCAP, INPUT_PRECISION, BLOCK_N,
                                            False)
            acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key,
                                            first_key, d_mask, full_hi, hi, seqlen_k, sm_scale, qk_scale, softcap,
                                            lse_ptr, True, CAUSAL, HAS_WINDOW, SOFTCAP, INPUT_PRECISION, BLOCK_N,
                                            False)
        # A row that sees no key has l = 0: output 0 and lse = -inf (flash-attn's convention).
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
        out_base = out_ptr + batch * stride_ob + head * stride_oh + q_start * stride_om
        tl.store(out_base + rows[:, None] * stride_om + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
        lse_base = lse_ptr + batch * stride_lb + head * stride_lh + q_start * stride_lm
        tl.store(lse_base + rows * stride_lm, lse, mask=row_mask)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def flash_attention_backward_preprocess_kernel(
    out_ptr, do_ptr, dlse_ptr, delta_ptr,           # delta = rowsum(dO * O) - dlse, float32
    n_rows, n_heads, head_dim,                      # rows of (B, Hq, T) flattened in (b, h, t) order
    stride_ob, stride_oh, stride_om, stride_od,     # out and dO as (B, Hq, T, D)
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_gb, stride_gh, stride_gm,                # dlse as (B, Hq, T)
    stride_db, stride_dh, stride_dm,                # delta as (B, Hq, T)
    HAS_DLSE: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``delta`` for ``BLOCK_M`` rows of one (batch, head); grid ``(row blocks, Hq, B)``."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INDEX_64:
        head = head.to(tl.int64)
        batch = batch.to(tl.int64)
        rows = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (offs_d < head_dim)[None, :]
    o = tl.load(out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(do_ptr + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + batch * stride_gb + head * stride_gh + rows * stride_gm, mask=row_mask,
                         other=0.0).to(tl.float32)
    tl.store(delta_ptr + batch * stride_db + head * stride_dh + rows * stride_dm, delta, mask=row_mask)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom, stride_lm, first_row, last_row,
    d_mask, start, end, seqlen_q, sm_scale, qk_scale, softcap, block_list_ptr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
):
    """Add query blocks ``[start, end)`` of one q head into one key block's ``dK, dV``.

    Computed transposed (keys x queries), so that the key block is the tiles' first dim. Key ``j``
    is seen by rows ``first_row[j] <= i <= last_row[j]`` (``j - diagonal`` and ``j - diagonal + W - 1``).
    ``q_ptrs``/``do_ptrs`` point at row 0, ``lse_ptrs``/``delta_ptrs`` at row 0 of ``BLOCK_M`` lanes.
    ``BLOCK_SPARSE``: the query blocks come one per step from the int32 list at ``block_list_ptr``.
    """
    rows = start + tl.arange(0, BLOCK_M)
    q_ptrs += start * stride_qm
    do_ptrs += start * stride_dom
    lse_ptrs += start * stride_lm
    delta_ptrs += start * stride_lm
    step_q = BLOCK_M * stride_qm
    step_do = BLOCK_M * stride_dom
    step_l = BLOCK_M * stride_lm
    for _ in range(start, end, BLOCK_M):
        if BLOCK_SPARSE:  # the next listed query block
            block = tl.load(block_list_ptr)
            block_list_ptr += 1
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            block = block.to(tl.int64)
            q_tile = q_ptrs + block * step_q
            do_tile = do_ptrs + block * step_do
            lse_tile = lse_ptrs + block * step_l
            delta_tile = delta_ptrs + block * step_l
        else:
            q_tile = q_ptrs
            do_tile = do_ptrs
            lse_tile = lse_ptrs
            delta_tile = delta_ptrs
        row_mask = rows < seqlen_q
        mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_tile, mask=mask, other=0.0)
        do = tl.load(do_tile, mask=mask, other=0.0)
        # lse in base 2; +inf for rows that see no key (lse = -inf) and padding rows: their P is 0.
        lse = tl.load(lse_tile, mask=row_mask, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
        delta = tl.load(delta_tile, mask=row_mask, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if SOFTCAP:
            capped_t, dcap_t = softcap_logits(qk_t * sm_scale, softcap)
            s_t = capped_t * _LOG2E
        else:
            s_t = qk_t * qk_scale
        if MASKED:
            visible = row_mask[None, :]
            if CAUSAL:
                visible = visible & (rows[None, :] >= first_row[:, None])
            if HAS_WINDOW:
                visible = visible & (rows[None, :] <= last_row[:, None])
            s_t = tl.where(visible, s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * dcap_t
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        if not BLOCK_SPARSE:
            rows += BLOCK_M
            q_ptrs += step_q
            do_ptrs += step_do
            lse_ptrs += step_l
            delta_ptrs += step_l
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "BUCKET_Q", "BUCKET_K"])
def flash_attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,  # inputs; lse and delta share one (B, Hq, Tq) layout
    dk_ptr, dv_ptr,                                   # outputs, (B, Hkv, Tk, D) in k's dtype
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,               # VARLEN: (B + 1,) int32 sequence starts
    block_count_ptr, block_index_ptr,                 # BLOCK_SPARSE: int32 block counts and lists (see the forward)
    stride_cb, stride_ch, stride_cm,
    stride_ib, stride_ih, stride_im,
    stride_qb, stride_qh, stride_qm, stride_qd,       # q as (B, Hq, Tq, D)
    stride_kb, stride_kh, stride_kn, stride_kd,       # k, v as (B, Hkv, Tk, D)
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,   # dO as (B, Hq, Tq, D)
    stride_lb, stride_lh, stride_lm,                  # lse and delta as (B, Hq, Tq)
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,   # dk, dv as (B, Hkv, Tk, D)
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    seqlen_q, seqlen_k, head_dim, group_size,
    sm_scale, qk_scale, softcap, window,
    BUCKET_Q, BUCKET_K,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``dK, dV`` of one block of ``BLOCK_N`` keys of one kv head; grid ``(key blocks, Hkv, B)``.

    Sums over the ``group_size`` query heads of the group and, for each, over the query blocks of
    :func:`_query_range`, in a fixed order, in float32 on chip.
    """
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = _sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, batch, seqlen_q,
                                                     seqlen_k, VARLEN)
    if INDEX_64:
        kv_head = kv_head.to(tl.int64)
        batch = batch.to(tl.int64)
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    n0 = pid_n * BLOCK_N
    if n0 < seqlen_k:  # a varlen program past its sequence's end does nothing
        cols = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_m = tl.arange(0, BLOCK_M)
        if INDEX_64:
            cols = cols.to(tl.int64)
        d_mask = offs_d < head_dim
        kv_mask = (cols < seqlen_k)[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + (k_start + cols[:, None]) * stride_kn
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + (k_start + cols[:, None]) * stride_vn
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        diagonal = _diagonal(seqlen_q, seqlen_k)
        n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
        lo, full_lo, full_hi, hi = _query_range(n0, n_last, seqlen_q, diagonal, window, CAUSAL, HAS_WINDOW,
                                                BLOCK_M, INDEX_64)
        first_row = cols - diagonal  # key j is seen by rows first_row[j] <= i <= last_row[j]
        last_row = first_row + window - 1
        for g in range(0, group_size):
            head = kv_head * group_size + g
            q_ptrs = (q_ptr + batch * stride_qb + head * stride_qh + q_start * stride_qm
                      + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
            do_ptrs = (do_ptr + batch * stride_dob + head * stride_doh + q_start * stride_dom
                       + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod)
            row_base = batch * stride_lb + head * stride_lh + (q_start + offs_m) * stride_lm
            lse_ptrs = lse_ptr + row_base
            delta_ptrs = delta_ptr + row_base
            if BLOCK_SPARSE:  # the query blocks of head `head` whose mask row allows this key block
                block_list, n_blocks = _block_list(block_count_ptr, block_index_ptr, stride_cb, stride_ch, stride_cm,
                                                   stride_ib, stride_ih, stride_im, batch, head, pid_n)
                dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                                      stride_lm, first_row, last_row, d_mask, 0, n_blocks * BLOCK_M, seqlen_q,
                                      sm_scale, qk_scale, softcap, block_list, True, False, False, SOFTCAP,
                                      INPUT_PRECISION, BLOCK_M, True)
            else:
                dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                                      stride_lm, first_row, last_row, d_mask, lo, full_lo, seqlen_q, sm_scale,
                                      qk_scale, softcap, lse_ptr, True, CAUSAL, HAS_WINDOW, SOFTCAP,
                                      INPUT_PRECISION, BLOCK_M, False)
                dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                                      stride_lm, first_row, last_row, d_mask, full_lo, full_hi, seqlen_q, sm_scale,
                                      qk_scale, softcap, lse_ptr, False, CAUSAL, HAS_WINDOW, SOFTCAP,
                                      INPUT_PRECISION, BLOCK_M, False)
                dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, stride_qm, stride_dom,
                                      stride_lm, first_row, last_row, d_mask, full_hi, hi, seqlen_q, sm_scale,
                                      qk_scale, softcap, lse_ptr, True, CAUSAL, HAS_WINDOW, SOFTCAP,
                                      INPUT_PRECISION, BLOCK_M, False)
        dk = dk * sm_scale
        tl.store(dk_ptr + batch * stride_dkb + kv_head * stride_dkh + (k_start + cols[:, None]) * stride_dkn
                 + offs_d[None, :] * stride_dkd, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dv_ptr + batch * stride_dvb + kv_head * stride_dvh + (k_start + cols[:, None]) * stride_dvn
                 + offs_d[None, :] * stride_dvd, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key, d_mask,
    start, end, seqlen_k, sm_scale, qk_scale, softcap, block_list_ptr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
):
    """Add key blocks ``[start, end)`` into one query block's ``dQ`` (``P`` and ``dP`` recomputed);
    the arguments are :func:`_forward_blocks`'s."""
    cols = start + tl.arange(0, BLOCK_N)
    k_ptrs += start * stride_kn
    v_ptrs += start * stride_vn
    step_k = BLOCK_N * stride_kn
    step_v = BLOCK_N * stride_vn
    for _ in range(start, end, BLOCK_N):
        if BLOCK_SPARSE:
            block = tl.load(block_list_ptr)
            block_list_ptr += 1
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            k_tile = k_ptrs + block.to(tl.int64) * step_k
            v_tile = v_ptrs + block.to(tl.int64) * step_v
        else:
            k_tile = k_ptrs
            v_tile = v_ptrs
        if MASKED:
            kv_mask = (cols < seqlen_k)[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_tile, mask=kv_mask, other=0.0)
        v = tl.load(v_tile, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if SOFTCAP:
            capped, dcap = softcap_logits(qk * sm_scale, softcap)
            s = capped * _LOG2E
        else:
            s = qk * qk_scale
        if MASKED:
            visible = (cols < seqlen_k)[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= last_key[:, None])
            if HAS_WINDOW:
                visible = visible & (cols[None, :] >= first_key[:, None])
            s = tl.where(visible, s, float("-inf"))
            cols += BLOCK_N
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
        if not BLOCK_SPARSE:
            k_ptrs += step_k
            v_ptrs += step_v
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "BUCKET_Q", "BUCKET_K"])
def flash_attention_backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,  # inputs; lse and delta share one (B, Hq, Tq) layout
    dq_ptr,                                           # output, (B, Hq, Tq, D) in q's dtype
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,               # VARLEN: (B + 1,) int32 sequence starts
    block_count_ptr, block_index_ptr,                 # BLOCK_SPARSE: int32 block counts and lists (see the forward)
    stride_cb, stride_ch, stride_cm,
    stride_ib, stride_ih, stride_im,
    stride_qb, stride_qh, stride_qm, stride_qd,       # q as (B, Hq, Tq, D)
    stride_kb, stride_kh, stride_kn, stride_kd,       # k, v as (B, Hkv, Tk, D)
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,   # dO as (B, Hq, Tq, D)
    stride_lb, stride_lh, stride_lm,                  # lse and delta as (B, Hq, Tq)
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,   # dq as (B, Hq, Tq, D)
    seqlen_q, seqlen_k, head_dim, group_size,
    sm_scale, qk_scale, softcap, window,
    BUCKET_Q, BUCKET_K,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``dQ`` of one block of ``BLOCK_M`` queries of one head; grid ``(query blocks, Hq, B)``, the
    forward's key blocks (:func:`_key_range`)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = _sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, batch, seqlen_q,
                                                     seqlen_k, VARLEN)
    kv_head = head // group_size
    if INDEX_64:
        head = head.to(tl.int64)
        kv_head = kv_head.to(tl.int64)
        batch = batch.to(tl.int64)
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    m0 = pid_m * BLOCK_M
    if m0 < seqlen_q:
        rows = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        if INDEX_64:
            rows = rows.to(tl.int64)
        d_mask = offs_d < head_dim
        row_mask = rows < seqlen_q
        mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + (q_start + rows[:, None]) * stride_qm
                    + offs_d[None, :] * stride_qd, mask=mask, other=0.0)
        do = tl.load(do_ptr + batch * stride_dob + head * stride_doh + (q_start + rows[:, None]) * stride_dom
                     + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
        row_offsets = batch * stride_lb + head * stride_lh + (q_start + rows) * stride_lm
        lse2 = _load_lse2(lse_ptr, row_offsets, row_mask)
        delta = tl.load(delta_ptr + row_offsets, mask=row_mask, other=0.0)
        k_ptrs = (k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
                  + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        v_ptrs = (v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
                  + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        diagonal = _diagonal(seqlen_q, seqlen_k)
        m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
        lo, full_lo, full_hi, hi = _key_range(m0, m_last, seqlen_k, diagonal, window, CAUSAL, HAS_WINDOW, BLOCK_N,
                                              INDEX_64)
        last_key = rows + diagonal
        first_key = last_key - window + 1
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if BLOCK_SPARSE:  # the forward's list of key blocks
            block_list, n_blocks = _block_list(block_count_ptr, block_index_ptr, stride_cb, stride_ch, stride_cm,
                                               stride_ib, stride_ih, stride_im, batch, head, pid_m)
            dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key,
                            d_mask, 0, n_blocks * BLOCK_N, seqlen_k, sm_scale, qk_scale, softcap, block_list, True,
                            False, False, SOFTCAP, INPUT_PRECISION, BLOCK_N, True)
        else:
            dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key,
                            d_mask, lo, full_lo, seqlen_k, sm_scale, qk_scale, softcap, lse_ptr, True, CAUSAL,
                            HAS_WINDOW, SOFTCAP, INPUT_PRECISION, BLOCK_N, False)
            dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key,
                            d_mask, full_lo, full_hi, seqlen_k, sm_scale, qk_scale, softcap, lse_ptr, False, CAUSAL,
                            HAS_WINDOW, SOFTCAP, INPUT_PRECISION, BLOCK_N, False)
            dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key,
                            d_mask, full_hi, hi, seqlen_k, sm_scale, qk_scale, softcap, lse_ptr, True, CAUSAL,
                            HAS_WINDOW, SOFTCAP, INPUT_PRECISION, BLOCK_N, False)
        dq = dq * sm_scale
        tl.store(dq_ptr + batch * stride_dqb + head * stride_dqh + (q_start + rows[:, None]) * stride_dqm
                 + offs_d[None, :] * stride_dqd, dq.to(dq_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Tile configurations
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionConfig:
    """One tile configuration of a flash-attention kernel.

    ``BLOCK_M`` query rows by ``BLOCK_N`` keys per step (powers of two >= 16, ``tl.dot``'s
    smallest shape); ``num_warps`` and ``num_stages`` (software pipelining of the streamed K/V or
    Q/dO tiles) are launch options. ``max_head_dim``: the widest head-dim tile of 16-bit inputs
    at which ptxas fits the kernel in registers for sm_90 without spilling; ``max_head_dim_fp32``
    for float32 inputs (by default half), ``max_head_dim_softcap`` with soft-capping (``tanh`` takes
    registers; the backward kernels also keep the cap's derivative, one more score-sized tile, live;
    0: never with soft-capping). Measured, not
    modelled: ``tests/aot/flash_attention.py`` compiles every GPU config at its limits (and at head
    dims 64 and 128 below them) and fails on any spill.
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 2
    max_head_dim: int = 256
    max_head_dim_fp32: int | None = None  # None: half of max_head_dim
    max_head_dim_softcap: int | None = None  # None: max_head_dim

    def head_dim_limit(self, element_size: int, softcap: bool = False) -> int:
        """The widest head-dim tile this config takes for inputs of ``element_size`` bytes (with soft-capping)."""
        if element_size <= 2:
            limit = self.max_head_dim
        else:
            limit = self.max_head_dim // 2 if self.max_head_dim_fp32 is None else self.max_head_dim_fp32
        if softcap and self.max_head_dim_softcap is not None:
            limit = min(limit, self.max_head_dim_softcap // (1 if element_size <= 2 else 2))
        return limit

    def to_triton(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N}, num_warps=self.num_warps,
                             num_stages=self.num_stages)

    def shared_memory_bytes(self, kind: str, block_d: int, element_size: int) -> int:
        """Shared memory of the pipelined tiles (an upper estimate): the streamed pair (K and V, or Q and
        dO for the dK/dV kernel) times ``num_stages``, plus the tile(s) held for the whole loop."""
        streamed = self.BLOCK_M if kind == "dkdv" else self.BLOCK_N
        kept = 2 * self.BLOCK_N if kind == "dkdv" else self.BLOCK_M
        return (self.num_stages * 2 * streamed + kept) * block_d * element_size

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages

    def __str__(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N} w{self.num_warps} s{self.num_stages}"


_c = AttentionConfig
#: Forward candidates on a GPU: 128- and 64-row query blocks; 32-key blocks for head dim 256.
FORWARD_GPU_CONFIGS: tuple[AttentionConfig, ...] = (
    _c(128, 128, 8, 2, max_head_dim=64),
    _c(128, 64, 8, 3, max_head_dim=128),
    _c(128, 64, 8, 2, max_head_dim=128),
    _c(64, 128, 8, 2, max_head_dim=128, max_head_dim_fp32=32, max_head_dim_softcap=64),
    _c(64, 64, 4, 3, max_head_dim=128, max_head_dim_fp32=32, max_head_dim_softcap=64),
    _c(64, 64, 8, 2, max_head_dim=128),
    _c(128, 32, 8, 2, max_head_dim=256, max_head_dim_softcap=128),
    _c(64, 32, 8, 2, max_head_dim=256),
)
#: dK/dV candidates: a key block (K, V and fp32 dK, dV) held in registers, query blocks streamed. This
#: kernel holds four tiles of the key block, so its blocks are smaller than the others'.
BACKWARD_DKDV_GPU_CONFIGS: tuple[AttentionConfig, ...] = (
    _c(32, 128, 8, 3, max_head_dim=64, max_head_dim_softcap=0),
    _c(32, 128, 8, 2, max_head_dim=64, max_head_dim_softcap=0),
    _c(32, 64, 4, 3, max_head_dim=64, max_head_dim_softcap=0),
    _c(64, 32, 8, 2, max_head_dim=64),
    _c(16, 64, 8, 2, max_head_dim=128, max_head_dim_softcap=64),
    _c(32, 32, 8, 2, max_head_dim=128),
    _c(16, 32, 8, 2, max_head_dim=256),
)
#: dQ candidates: a query block (Q, dO, fp32 dQ) held, key blocks streamed.
BACKWARD_DQ_GPU_CONFIGS: tuple[AttentionConfig, ...] = (
    _c(128, 64, 8, 2, max_head_dim=128, max_head_dim_softcap=64),
    _c(128, 32, 8, 2, max_head_dim=256, max_head_dim_softcap=128),
    _c(64, 64, 4, 3, max_head_dim=64),
    _c(64, 64, 8, 2, max_head_dim=128, max_head_dim_softcap=64),
    _c(64, 32, 4, 3, max_head_dim=128),
    _c(64, 32, 8, 2, max_head_dim=128),
    _c(128, 16, 8, 2, max_head_dim=256),
)
del _c
_GPU_CONFIGS = {"forward": FORWARD_GPU_CONFIGS, "dkdv": BACKWARD_DKDV_GPU_CONFIGS, "dq": BACKWARD_DQ_GPU_CONFIGS}

#: The interpreter's one configuration for every kernel: few program instances (each costs ~1 ms of
#: Python per tile operation), and still several blocks at test sizes so that skipping and masking are
#: exercised (the tests use lengths of 33 to 160).
INTERPRETER_CONFIG: AttentionConfig = AttentionConfig(32, 32, 4, 1)


def fits(config: AttentionConfig, kind: str, block_d: int, element_size: int, softcap: bool = False,
         shared_memory: int | None = None) -> bool:
    """Whether ``config`` suits kernel ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``) at head-dim tile ``block_d``
    of ``element_size``-byte inputs: within its register limit and the GPU's shared memory."""
    limit = _shared_memory_limit() if shared_memory is None else shared_memory
    return (block_d <= config.head_dim_limit(element_size, softcap)
            and config.shared_memory_bytes(kind, block_d, element_size) <= limit)


def _pruner(kind: str, candidates: tuple[AttentionConfig, ...] | None = None):
    """The autotuner's early pruning for ``kind``: the configs that fit (or the one with the smallest tiles)."""
    mine = {c.key: c for c in (_GPU_CONFIGS[kind] if candidates is None else candidates)}

    def prune(configs, named_args, **kwargs):
        block_d, softcap = kwargs["BLOCK_D"], kwargs["SOFTCAP"]
        element_size = named_args["q_ptr"].element_size()
        pairs = [(mine[(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)], c) for c in configs]
        kept = [c for config, c in pairs if fits(config, kind, block_d, element_size, softcap)]
        if kept:
            return kept
        # Nothing fits (fp32 at head dim 256, soft-capping at 256 in dQ): the smallest tiles spill least.
        return [min(pairs, key=lambda pair: pair[0].BLOCK_M * pair[0].BLOCK_N * pair[0].num_stages)[1]]

    return prune


#: What the autotuner keys on (Triton adds the pointers' dtypes).
TUNING_KEY: tuple[str, ...] = ("BUCKET_Q", "BUCKET_K", "BLOCK_D", "CAUSAL", "HAS_WINDOW", "SOFTCAP", "VARLEN",
                               "INPUT_PRECISION", "BLOCK_SPARSE")

_KERNELS = {
    "forward": flash_attention_forward_kernel,
    "dkdv": flash_attention_backward_dkdv_kernel,
    "dq": flash_attention_backward_dq_kernel,
}


def make_autotuned(kind: str, configs: tuple[AttentionConfig, ...] | None = None, do_bench=None):
    """Kernel ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``) under ``triton.autotune`` over ``configs``
    (default: its GPU list), pruned by :func:`fits` and keyed on :data:`TUNING_KEY`; results cached on
    disk where Triton supports it. ``do_bench`` replaces Triton's GPU benchmarker (the tests run the
    tuning loop in the interpreter with a stand-in). Building it needs no GPU.
    """
    configs = _GPU_CONFIGS[kind] if configs is None else tuple(configs)
    options = {"prune_configs_by": {"early_config_prune": _pruner(kind, configs)}}
    if autotune_supports_disk_cache():
        options["cache_results"] = True
    if do_bench is not None:
        options["do_bench"] = do_bench
    return triton.autotune(configs=[c.to_triton() for c in configs], key=list(TUNING_KEY), **options)(_KERNELS[kind])


@functools.cache
def _autotuned(kind: str):
    """Kernel ``kind`` autotuned over its GPU configs (built once, on first use on a GPU)."""
    return make_autotuned(kind)


def _fixed_config() -> AttentionConfig | None:
    """The one config of the interpreter (which cannot autotune); None on a GPU: autotuned."""
    return INTERPRETER_CONFIG if runtime.INTERPRETER else None


def _launch_kernel(kind: str, grid_of, args: tuple, constexprs: dict, config: AttentionConfig | None = None) -> None:
    """Launch ``kind`` with ``config``, the fixed config, or autotuned. ``grid_of(BLOCK_M, BLOCK_N)`` is the grid
    for a tile."""
    c = _fixed_config() if config is None else config
    if c is not None:
        _KERNELS[kind][grid_of(c.BLOCK_M, c.BLOCK_N)](*args, **constexprs, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N,
                                                     num_warps=c.num_warps, num_stages=c.num_stages)
        return
    _autotuned(kind)[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **constexprs)


# ----------------------------------------------------------------------------------------------
# Launchers (inputs validated already)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """What every launch shares: the shape, the switches, and how to see each tensor as (B, H, T, D)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int  # dense: Tq; varlen: max_seqlen_q (the grid's extent)
    seqlen_k: int
    head_dim: int
    causal: bool
    sm_scale: float
    window: int | None
    softcap: float | None
    varlen: bool

    def strides4(self, t: torch.Tensor) -> tuple[int, ...]:
        """A (B, H, T, D) tensor's strides; a packed (total, H, D) one's as (0, H, T, D)."""
        if self.varlen:
            return 0, t.stride(1), t.stride(0), t.stride(2)
        return tuple(t.stride())

    def strides3(self, t: torch.Tensor) -> tuple[int, ...]:
        """A (B, H, T) row statistic's strides; a packed (H, total) one's as (0, H, T)."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return tuple(t.stride())

    def scalars(self) -> tuple:
        """seqlen_q, seqlen_k, head_dim, group_size, sm_scale, qk_scale, softcap, window, the two buckets."""
        # A window wider than every sequence changes nothing; capping it keeps the bounds in int32.
        window = min(self.window, self.seqlen_q + self.seqlen_k + 1) if self.window is not None else 0
        return (self.seqlen_q, self.seqlen_k, self.head_dim, self.heads_q // self.heads_kv, float(self.sm_scale),
                float(self.sm_scale) * math.log2(math.e), float(self.softcap or 1.0), window,
                size_bucket(self.seqlen_q), size_bucket(self.seqlen_k))

    def constexprs(self, dtype: torch.dtype, *tensors: torch.Tensor) -> dict:
        return dict(CAUSAL=self.causal, HAS_WINDOW=self.window is not None, SOFTCAP=self.softcap is not None,
                    VARLEN=self.varlen, INDEX_64=_index_64(*tensors),
                    INPUT_PRECISION=_launch.dot_input_precision(dtype), BLOCK_D=_block_d(self.head_dim),
                    BLOCK_SPARSE=False)


@dataclass(frozen=True)
class BlockLists:
    """The block-sparse switch's per-row lists (``kernel_ladder.block_sparse_attention``): for each (batch, head,
    row block) of one side, ``counts`` (int32 ``(Bm, Hm, R)``) blocks of the other side, listed first in
    ``indices`` (int32 ``(Bm, Hm, R, C)``, each row contiguous). ``Bm``/``Hm`` of 1 broadcast (stride 0).
    ``config`` is the tile (``BLOCK_M = BLOCK_N`` = the mask's block size)."""

    counts: torch.Tensor
    indices: torch.Tensor
    config: AttentionConfig

    def args(self) -> tuple:
        def strides(t):
            return tuple(0 if size == 1 else stride for size, stride in zip(t.shape[:3], t.stride()[:3]))

        return (self.counts, self.indices, *strides(self.counts), *strides(self.indices))


def _no_block_lists(dummy: torch.Tensor) -> tuple:
    """The block-sparse arguments of a dense launch (never read)."""
    return (dummy, dummy, 0, 0, 0, 0, 0, 0)


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _index_64(*tensors: torch.Tensor) -> bool:
    """Whether some offset (a tile's masked overrun included) of these tensors can pass 2**31."""
    extents = []
    for t in tensors:
        if t.numel() == 0:
            continue
        strides = [abs(s) for s in t.stride()]
        extents.append(sum((size - 1) * s for size, s in zip(t.shape, strides)) + 256 * max(strides))
    return _launch.needs_int64(*extents)


def _forward(problem: _Problem, q, k, v, out, lse, cu_q, cu_k, blocks: BlockLists | None = None) -> None:
    """``blocks``: block-sparse, over each query block's listed key blocks (:class:`BlockLists`)."""
    if out.numel() == 0 or problem.batch == 0:
        return
    args = (q, k, v, out, lse, cu_q, cu_k, *(_no_block_lists(lse) if blocks is None else blocks.args()),
            *problem.strides4(q), *problem.strides4(k), *problem.strides4(v),
            *problem.strides4(out), *problem.strides3(lse), *problem.scalars())
    constexprs = problem.constexprs(q.dtype, q, k, v, out, lse)
    constexprs["BLOCK_SPARSE"] = blocks is not None
    _launch_kernel("forward", lambda bm, bn: (triton.cdiv(problem.seqlen_q, bm), problem.heads_q, problem.batch),
                   args, constexprs, None if blocks is None else blocks.config)


def _preprocess(problem: _Problem, out, grad_out, grad_lse, delta) -> None:
    """delta = rowsum(dO * O) - dlse; a varlen problem runs as one sequence of all the packed rows."""
    if problem.varlen:
        n_rows, batch = out.shape[0], 1
    else:
        n_rows, batch = problem.seqlen_q, problem.batch
    if n_rows == 0 or batch == 0:
        return
    block_d = _block_d(problem.head_dim)
    block_m = max(16, min(next_power_of_2(n_rows), 8192 // block_d))
    dlse = grad_lse if grad_lse is not None else delta  # without a gradient for lse: never read
    preprocess_index_64 = _index_64(out, grad_out, delta, *([grad_lse] if grad_lse is not None else []))
    flash_attention_backward_preprocess_kernel[(triton.cdiv(n_rows, block_m), problem.heads_q, batch)](
        out, grad_out, dlse, delta, n_rows, problem.heads_q, problem.head_dim,
        *problem.strides4(out), *problem.strides4(grad_out), *problem.strides3(dlse), *problem.strides3(delta),
        HAS_DLSE=grad_lse is not None, INDEX_64=preprocess_index_64, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=4,
    )


def _backward(problem: _Problem, grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv,
              rows: BlockLists | None = None, cols: BlockLists | None = None) -> None:
    """``rows``/``cols``: block-sparse, dQ over each query block's key blocks, dK/dV over each key
    block's query blocks (the transposed lists)."""
    if problem.batch == 0:
        return
    delta = _launch.empty(lse.shape, torch.float32, lse.device)
    if lse.stride() != delta.stride():  # the kernels read both with one set of strides (lse is ours: contiguous)
        lse = lse.contiguous()
    _preprocess(problem, out, grad_out, grad_lse, delta)
    tensors = (q, k, v, grad_out, lse, dq, dk, dv)
    constexprs = problem.constexprs(q.dtype, *tensors)
    constexprs["BLOCK_SPARSE"] = rows is not None
    common = (*problem.strides4(q), *problem.strides4(k), *problem.strides4(v), *problem.strides4(grad_out),
              *problem.strides3(lse))
    if dk.numel():
        _launch_kernel(
            "dkdv", lambda bm, bn: (triton.cdiv(problem.seqlen_k, bn), problem.heads_kv, problem.batch),
            (q, k, v, grad_out, lse, delta, dk, dv, cu_q, cu_k,
             *(_no_block_lists(lse) if cols is None else cols.args()), *common, *problem.strides4(dk),
             *problem.strides4(dv), *problem.scalars()),
            constexprs, None if cols is None else cols.config,
        )
    if dq.numel():
        _launch_kernel(
            "dq", lambda bm, bn: (triton.cdiv(problem.seqlen_q, bm), problem.heads_q, problem.batch),
            (q, k, v, grad_out, lse, delta, dq, cu_q, cu_k, *(_no_block_lists(lse) if rows is None else rows.args()),
             *common, *problem.strides4(dq), *problem.scalars()),
            constexprs, None if rows is None else rows.config,
        )


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------



def _check_options(op: str, causal: object, softmax_scale: object, window: object, softcap: object,
                   return_lse: object) -> None:
    check_bool(op, "causal", causal)
    check_bool(op, "return_lse", return_lse)
    check_attention_options(op, softmax_scale, window, softcap)
    if window is not None and not causal:
        raise ValueError(f"{op}: window={window} needs causal=True (a sliding window looks back from each "
                         "query's own position, as in Mistral); pass causal=True")


def _check_tensors(op: str, q: object, k: object, v: object, rank: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t)
        check_float_dtype(op, name, t)
    check_same_dtype(op, "q", q, "k", k)
    check_same_dtype(op, "q", q, "v", v)
    check_same_device(op, "q", q, "k", k)
    check_same_device(op, "q", q, "v", v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            what = layout.replace("H", "Hq" if name == "q" else "Hkv").replace("T", "Tq" if name == "q" else "Tk")
            raise ValueError(f"{op}: {name} must be {rank}-D {what}, got shape {tuple(t.shape)}")
    head_dims = (q.shape[-1], k.shape[-1], v.shape[-1])
    if not head_dims[0] == head_dims[1] == head_dims[2]:
        raise ValueError(f"{op}: q, k and v must share the head dim D (the last dim), got {head_dims[0]}, "
                         f"{head_dims[1]} and {head_dims[2]}")
    d = head_dims[0]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: the head dim D must be in [1, {MAX_HEAD_DIM}], got {d}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape (the same batch, heads and keys), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    heads_q, heads_kv = q.shape[-2 if rank == 3 else 1], k.shape[-2 if rank == 3 else 1]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{op}: the query heads ({heads_q}) must be a multiple of the key/value heads ({heads_kv}): "
                         "grouped-query attention gives each kv head Hq // Hkv query heads")


def _check_dense(q, k, v, causal, softmax_scale, window, softcap, return_lse) -> None:
    _check_tensors(_OP, q, k, v, 4, "(B, H, T, D)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{_OP}: q and k must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    _check_options(_OP, causal, softmax_scale, window, softcap, return_lse)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                  softcap, return_lse) -> None:
    op = _VARLEN_OP
    _check_tensors(op, q, k, v, 3, "(total_T, H, D)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(op, name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{op}: {name} must be int32 (flash-attn's cu_seqlens), got {cu.dtype}; "
                            "convert with .to(torch.int32)")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{op}: {name} must be 1-D (B + 1,): 0, then each sequence's end; "
                             f"got shape {tuple(cu.shape)}")
        check_same_device(op, "q", q, name, cu)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(value):
            raise TypeError(f"{op}: {name} must be an int (the longest sequence), got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    _check_options(op, causal, softmax_scale, window, softcap, return_lse)


#: cu_seqlens entries the check kernel takes per iteration (the interpreter: fewer, larger steps).
CHECK_BLOCK: int = 4096 if runtime.INTERPRETER else 1024


@triton.jit
def _count_bad(cu_ptr, i, inside, n_entries, total, max_seqlen):
    value = tl.load(cu_ptr + i, mask=inside, other=0)
    previous = tl.load(cu_ptr + i - 1, mask=inside & (i > 0), other=0)
    length = value - previous
    bad = inside & (i > 0) & ((length < 0) | (length > max_seqlen))
    bad = bad | (inside & (i == 0) & (value != 0)) | (inside & (i == n_entries - 1) & (value != total))
    return bad.to(tl.int32)


@triton.jit
def flash_attention_cu_seqlens_kernel(
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, check_ptr,  # check: int32 [both valid, q's valid, k's valid]
    n_entries, total_q, total_k, max_seqlen_q, max_seqlen_k,
    BLOCK: tl.constexpr,
):
    """One program reads both ``cu_seqlens`` once: each must start at 0, never decrease, end at the
    packed length and have no sequence longer than its ``max_seqlen``."""
    lanes = tl.arange(0, BLOCK)
    bad_q = tl.zeros([BLOCK], tl.int32)
    bad_k = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_entries, BLOCK):
        i = start + lanes
        inside = i < n_entries
        bad_q += _count_bad(cu_seqlens_q_ptr, i, inside, n_entries, total_q, max_seqlen_q)
        bad_k += _count_bad(cu_seqlens_k_ptr, i, inside, n_entries, total_k, max_seqlen_k)
    ok_q = tl.sum(bad_q, 0) == 0
    ok_k = tl.sum(bad_k, 0) == 0
    tl.store(check_ptr, (ok_q & ok_k).to(tl.int32))
    tl.store(check_ptr + 1, ok_q.to(tl.int32))
    tl.store(check_ptr + 2, ok_k.to(tl.int32))


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                            max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Each ``cu_seqlens`` starts at 0, never decreases, ends at its packed length (``total``) and has no
    sequence longer than its ``max_seqlen``.

    One one-program Triton launch (:func:`flash_attention_cu_seqlens_kernel`) writes a flag on the
    tensors' device, read by the value-check policy (:func:`kernel_ladder._validate.check_values`): on the
    CPU a failure raises at once, as a ``ValueError`` naming the op, the argument and its values; on
    CUDA it is a device-side assertion (like torch's own index checks), surfacing as ``CUDA error:
    device-side assert triggered`` at the next synchronizing call, unless
    ``kernel_ladder.runtime.check_values(True)`` asked for the host check. Skipped entirely (no launch)
    where no check runs.
    """
    check = _launch.empty((3,), torch.int32, cu_seqlens_q.device)

    def ok() -> torch.Tensor:
        flash_attention_cu_seqlens_kernel[(1,)](cu_seqlens_q, cu_seqlens_k, check, cu_seqlens_q.shape[0], total_q,
                                                total_k, max_seqlen_q, max_seqlen_k, BLOCK=CHECK_BLOCK)
        return check[0]

    def message(name, total, max_seqlen):
        return (f"{_VARLEN_OP}: {name} must start at 0, never decrease, end at {total} (the packed length) and "
                f"have every sequence length <= max_seqlen = {max_seqlen}")

    def error() -> str:
        ok_q = bool(check[1])  # only on the way to the error
        name, cu, total, max_seqlen = (("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k) if ok_q else
                                       ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q))
        values = cu.tolist()
        shown = values if len(values) <= 12 else values[:6] + ["..."] + values[-6:]
        return f"{message(name, total, max_seqlen)}; got {shown}"

    check_values((cu_seqlens_q, cu_seqlens_k), ok,
                 message("cu_seqlens_q and cu_seqlens_k", "total_q / total_k", "max_seqlen_q / max_seqlen_k"), error)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _dense_problem(q, k, causal, softmax_scale, window, softcap) -> _Problem:
    batch, heads_q, seqlen_q, head_dim = q.shape
    return _Problem(batch, heads_q, k.shape[1], seqlen_q, k.shape[2], head_dim, causal, softmax_scale, window,
                    softcap, varlen=False)


def _varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                    softcap) -> _Problem:
    return _Problem(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k, q.shape[2],
                    causal, softmax_scale, window, softcap, varlen=True)


@torch.library.custom_op("kernel_ladder::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                        window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``(B, Hq, Tq, D)`` in q's dtype, lse ``(B, Hq, Tq)`` float32."""
    _check_dense(q, k, v, causal, softmax_scale, window, softcap, False)
    runtime.require_launchable(_OP, q, k, v)
    batch, heads_q, seqlen_q, head_dim = q.shape
    out = _launch.empty_output((batch, heads_q, seqlen_q, head_dim), q)
    lse = _launch.empty((batch, heads_q, seqlen_q), torch.float32, q.device)
    _forward(_dense_problem(q, k, causal, softmax_scale, window, softcap), q, k, v, out, lse, lse, lse)
    return out, lse


@_flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, softmax_scale, window, softcap):
    _check_dense(q, k, v, causal, softmax_scale, window, softcap, False)
    batch, heads_q, seqlen_q, head_dim = q.shape
    return (_launch.empty_output((batch, heads_q, seqlen_q, head_dim), q),
            _launch.empty_output((batch, heads_q, seqlen_q), q, torch.float32))


@torch.library.custom_op("kernel_ladder::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float, window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, new contiguous tensors of q's, k's and v's shapes."""
    runtime.require_launchable(f"{_OP} (backward)", grad_out, q, k, v, out, lse)
    dq, dk, dv = _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)
    _backward(_dense_problem(q, k, causal, softmax_scale, window, softcap), grad_out, grad_lse, q, k, v, out, lse,
              lse, lse, dq, dk, dv)
    return dq, dk, dv


@_flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, causal, softmax_scale, window, softcap):
    return _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)


@torch.library.custom_op("kernel_ladder::flash_attention_varlen", mutates_args=())
def _flash_attention_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``(total_q, Hq, D)`` in q's dtype, lse ``(Hq, total_q)`` float32."""
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                  softcap, False)
    runtime.require_launchable(_VARLEN_OP, q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    total_q, heads_q, head_dim = q.shape
    out = _launch.empty_output((total_q, heads_q, head_dim), q)
    lse = _launch.empty((heads_q, total_q), torch.float32, q.device)
    problem = _varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap)
    _forward(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    return out, lse


@_flash_attention_varlen_op.register_fake
def _flash_attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, window, softcap):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                  softcap, False)
    total_q, heads_q, head_dim = q.shape
    return (_launch.empty_output((total_q, heads_q, head_dim), q),
            _launch.empty_output((heads_q, total_q), q, torch.float32))


@torch.library.custom_op("kernel_ladder::flash_attention_varlen_backward", mutates_args=())
def _flash_attention_varlen_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    runtime.require_launchable(f"{_VARLEN_OP} (backward)", grad_out, q, k, v, out, lse)
    dq, dk, dv = _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)
    problem = _varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap)
    _backward(problem, grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv)
    return dq, dk, dv


@_flash_attention_varlen_backward_op.register_fake
def _flash_attention_varlen_backward_fake(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap):
    return _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A stride-0 zero of ``t``'s shape: the gradient of an output that took no part in the loss."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def _output_gradients(ctx, grad_out, grad_lse, out):
    if grad_out is None:
        grad_out = _zeros_like(out)
    return grad_out.to(out.dtype), None if grad_lse is None else grad_lse.to(torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.rest = tuple(rest)
    ctx.set_materialize_grads(False)  # no zeros for an output the loss does not use


def _backward_formula(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return (None,) * (3 + len(ctx.rest))
    q, k, v, out, lse = ctx.saved_tensors
    grad_out, grad_lse = _output_gradients(ctx, grad_out, grad_lse, out)
    dq, dk, dv = _flash_attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, *ctx.rest)
    return (dq, dk, dv, *(None,) * len(ctx.rest))


def _varlen_backward_formula(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return (None,) * (3 + len(ctx.rest))
    q, k, v, out, lse = ctx.saved_tensors
    grad_out, grad_lse = _output_gradients(ctx, grad_out, grad_lse, out)
    cu_seqlens_q, cu_seqlens_k, *options = ctx.rest
    dq, dk, dv = _flash_attention_varlen_backward_op(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q,
                                                     cu_seqlens_k, *options)
    return (dq, dk, dv, *(None,) * len(ctx.rest))


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.rest = (cu_seqlens_q, cu_seqlens_k, *options)
    ctx.set_materialize_grads(False)


_flash_attention_op.register_autograd(_backward_formula, setup_context=_setup_context)
_flash_attention_varlen_op.register_autograd(_varlen_backward_formula, setup_context=_varlen_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(scale * q k^T + mask) v`` without the ``Tq x Tk`` matrix (FlashAttention-2).

    The layout of ``torch.nn.functional.scaled_dot_product_attention``; see the module docstring for
    the algorithm.

    Args:
        q: float32, float16 or bfloat16 queries ``(B, Hq, Tq, D)``, any strides (a ``(B, T, H, D)``
            projection transposed to ``(B, H, T, D)`` is read in place, never copied). ``D <= 256``,
            any value (non-powers of two are padded in the tile with masks).
        k, v: keys and values ``(B, Hkv, Tk, D)``, q's dtype, any strides. ``Hq`` must be a multiple
            of ``Hkv`` (grouped-query / multi-query attention: query head ``h`` uses kv head
            ``h // (Hq // Hkv)``; K and V are not repeated in memory).
        causal: mask aligned to the **bottom right** (FlashAttention 2, ``flash_attn_func``): query
            ``i`` sees key ``j`` iff ``j <= i + Tk - Tq``. With ``Tq = Tk`` that is the usual lower
            triangle; a single query (``Tq = 1``, decoding) sees every key. When ``Tq > Tk`` the first
            ``Tq - Tk`` queries see no key: their output is **0** and their lse ``-inf`` (flash-attn's
            convention; a softmax over nothing has no value).
        softmax_scale: the scale of ``q k^T``; ``None`` for ``1 / sqrt(D)``.
        window: Mistral's sliding window ``W >= 1`` (needs ``causal=True``): query ``i`` also needs
            ``j > i + Tk - Tq - W``, i.e. it sees the ``W`` most recent keys up to and including its
            own position. Key blocks outside a query block's window are skipped.
        softcap: Gemma-2's attention-logit soft-capping ``c > 0``: the scaled scores become
            ``c * tanh(scores / c)`` before the mask and softmax (HF's eager order: scale, then cap),
            with the gradient through it.
        return_lse: also return the log-sum-exp of each query row's (scaled, capped, masked) scores.

    Returns:
        ``out``, a new contiguous ``(B, Hq, Tq, D)`` tensor of q's dtype (float32 accumulation), or
        ``(out, lse)`` with ``lse`` a ``(B, Hq, Tq)`` float32 tensor of natural-log log-sum-exps.
        Differentiable in q, k and v through both outputs (``kernel_ladder::flash_attention_backward``:
        deterministic, first order only), including a gradient that flows through ``lse`` (merging
        partial attention results); double backward raises an error.
    """
    if not (schema_types(tensors=(q, k, v), optional_reals=(softmax_scale, softcap), optional_ints=(window,),
                         flags=(causal, return_lse)) and q.dim()):
        _check_dense(q, k, v, causal, softmax_scale, window, softcap, return_lse)  # the op checks values
    scale = _scale(softmax_scale, q.shape[-1])
    out, lse = _flash_attention_op(q, k, v, causal, scale, None if window is None else int(window),
                                   None if softcap is None else float(softcap))
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths, like flash-attn's ``flash_attn_varlen_func``.

    Args:
        q: queries ``(total_q, Hq, D)``: sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``;
            any strides; float32, float16 or bfloat16, ``D <= 256``.
        k, v: keys and values ``(total_k, Hkv, D)``, packed by ``cu_seqlens_k``; ``Hq % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` on q's device: 0, then the cumulative lengths
            (non-decreasing, the last equal to ``total_q`` / ``total_k``). Sequences of length 0 and
            1 are fine. Checked on the device without a host synchronization (on CUDA a bad value is
            a device-side assertion; see :func:`check_cu_seqlens_values`).
        max_seqlen_q, max_seqlen_k: ints >= every sequence's length (the grid's extent).
        causal, softmax_scale, window, softcap: as in :func:`flash_attention`, per sequence (causal
            is aligned to the bottom right of each sequence's own ``Tq_b x Tk_b``).
        return_lse: also return the lse, ``(Hq, total_q)`` float32 (flash-attn's varlen layout).

    Returns:
        ``out``, a new contiguous ``(total_q, Hq, D)`` tensor of q's dtype, or ``(out, lse)``.
        Differentiable in q, k and v (``kernel_ladder::flash_attention_varlen_backward``), lse included.
        No FLOPs are spent on padding: every program and loop stops at its sequence's length.
    """
    if not (schema_types(tensors=(q, k, v, cu_seqlens_q, cu_seqlens_k), ints=(max_seqlen_q, max_seqlen_k),
                         optional_reals=(softmax_scale, softcap), optional_ints=(window,), flags=(causal, return_lse))
            and q.dim()):
        _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      window, softcap, return_lse)  # the op checks values
    scale = _scale(softmax_scale, q.shape[-1])
    out, lse = _flash_attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                          int(max_seqlen_k), causal, scale, None if window is None else int(window),
                                          None if softcap is None else float(softcap))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers
# ----------------------------------------------------------------------------------------------


def _visible_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """An HF 4-D mask as booleans (True: the key is attended): bool masks as they are, additive float
    masks where they are 0 (masked entries hold the dtype's minimum or -inf)."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask == 0


def hf_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function for Hugging Face transformers' ``AttentionInterface`` (see
    :func:`register_hf_attention`), running :func:`flash_attention`.

    Takes what HF's attention modules pass (``query`` ``(B, Hq, T, D)``, ``key``/``value``
    ``(B, Hkv, S, D)``, not repeated; ``scaling``; ``sliding_window`` and ``softcap`` keywords from
    Mistral and Gemma-2) and returns ``(attn_output (B, T, Hq, D), None)`` like HF's sdpa function.
    Causal unless the module says ``is_causal = False``. Only masks that are purely causal (or
    none at all) are supported; a padding mask, or any other pattern, raises ``NotImplementedError``.
    """
    op = "kernel_ladder.flash_attention (Hugging Face attention)"
    if dropout:
        raise NotImplementedError(f"{op}: attention dropout is not supported (got dropout={dropout}); "
                                  "evaluate with model.eval()")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    if attention_mask is not None:
        tq, tk = query.shape[2], key.shape[2]
        visible = _visible_keys(attention_mask).expand(query.shape[0], -1, tq, tk)
        rows = torch.arange(tq, device=query.device)[:, None]
        cols = torch.arange(tk, device=query.device)[None, :]
        if bool(visible.all()):
            causal = False
        elif bool((visible == (cols <= rows + tk - tq)).all()):
            causal = True
        else:
            raise NotImplementedError(
                f"{op}: only causal (or no) masks are supported; this attention_mask masks other entries "
                "(padding?). Run the model without padding, or pack the sequences and call "
                "kernel_ladder.flash_attention_varlen")
    window = kwargs.get("sliding_window")
    if window is not None and window >= key.shape[2]:
        window = None  # a window wider than the keys changes nothing
    out = flash_attention(query, key, value, causal=causal or window is not None, softmax_scale=scaling,
                          window=window, softcap=kwargs.get("softcap"))
    return out.transpose(1, 2), None


def register_hf_attention(name: str = "kernel_ladder") -> str:
    """Register :func:`hf_attention` with transformers' ``AttentionInterface`` under ``name``; returns the name.

    Then ``AutoModel.from_pretrained(..., attn_implementation=name)`` (or setting
    ``config._attn_implementation``) runs every attention layer through :func:`flash_attention`.
    The name must not contain ``flash``: transformers takes such names for its own flash-attn
    integrations and looks for that package.
    """
    if "flash" in name:
        raise ValueError(f"kernel_ladder.ops.flash_attention.register_hf_attention: name must not contain 'flash' "
                         f"(transformers reserves such names for its flash-attn integrations), got {name!r}")
    from transformers import AttentionInterface  # noqa: PLC0415 (an optional dependency)

    AttentionInterface.register(name, hf_attention)
    return name
