"""Paged attention over a block-table KV cache (vLLM's layout), decode and chunked prefill, with
split-KV (flash decoding), as ``kernel_ladder::paged_attention``. Forward only: an inference op.

**The cache.** ``k_cache`` and ``v_cache`` are ``(num_blocks, block_size, Hkv, D)``: a pool of
fixed-size physical blocks shared by every sequence. Sequence ``b``'s logical token ``j`` lives in
physical block ``block_tables[b, j // block_size]`` at slot ``j % block_size``; ``seq_lens[b]``
tokens are cached, the newest ones included (their K/V already written). Blocks need not be in
order, and table entries past a sequence's last block are never read (they may hold anything).

**One program per KV head's query group.** The grid is ``(query programs, Hkv, num_splits)``. A
program holds every query head of one KV head's group (``Hq / Hkv`` heads, padded to a power of two
``GROUP_P`` with masks) — and, with ``cu_seqlens_q``, a tile of ``BLOCK_R / GROUP_P`` query tokens
— as the rows of one ``BLOCK_R x D`` tile: row ``r`` is token ``r // GROUP_P``, head ``r % GROUP_P``.
So each K/V block is read once per KV head, not once per query head (a GQA-8 model reads an
eighth of the bytes a per-query-head kernel does; traced in the tests). Per step a program
gathers ``PAGES`` blocks' table entries (one int32 each), loads their ``PAGES x block_size`` keys
as one ``BLOCK_N x D`` tile, and folds it into a running ``(max, sum, acc)`` in float32 —
FlashAttention's online softmax (see :mod:`kernel_ladder.ops.attention.forward`), in base 2. Scores are
``tl.dot`` products when the row tile has at least 16 rows (a GQA group of 3 or more is padded up to
16 rows: decoding is memory bound, so idle tensor-core rows cost no time); groups of 1 or 2 heads
decoding use an elementwise multiply and sum instead (a 1- or 2-row tile, vLLM's v1 scheme).

**Positions and masks.** Without ``cu_seqlens_q`` (decode) ``q`` is ``(B, Hq, D)``: one new token per
sequence at position ``seq_lens[b] - 1``, which sees every cached token. With ``cu_seqlens_q``
(prefill, chunked prefill, the new part after a shared prefix) ``q`` packs the newest
``q_len_b = cu[b+1] - cu[b]`` tokens of each sequence; query ``i`` is at position
``p = seq_lens[b] - q_len_b + i`` and sees keys ``j <= p`` (causal), and with ``window = W`` only
``j > p - W`` (kernel_ladder.flash_attention's bottom-right causal mask and sliding window exactly).
Soft-capping is Gemma-2's (scale, then ``c * tanh(s / c)``). Key pages outside a tile's visible range
are skipped, not masked. Packed query tiles: ``cdiv`` tiles of each sequence are found without a
host synchronization: the grid has ``total_q // BLOCK_Q + B`` programs (at least every sequence's
tile count) and program ``t`` finds its sequence by a binary search over ``cu[b] // BLOCK_Q + b``
(vLLM's unified attention scheme); programs past their sequence's tiles exit at once.

**Split-KV (flash decoding, Dao et al. 2023).** With ``B * Hkv`` programs a GPU of 132 SMs sits
mostly idle on small batches, each program streaming a long sequence alone. ``num_splits = S > 1``
splits each tile's visible pages into ``S`` contiguous ranges (whole steps of ``PAGES`` blocks),
one program each; every split writes its normalized partial output (float32) and log-sum-exp, and
:func:`paged_attention_merge_kernel` combines them::

    out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M),   M = max_s lse_s

(what ``kernel_ladder.flash_attention(..., return_lse=True)`` provides for merging, in one small launch).
A split that holds no key (a sequence shorter than the split's range, a query that sees nothing)
writes ``o = 0`` and ``lse = -inf``: weight 0. :func:`plan_paged_attention` chooses ``S`` when
``num_splits=None``: split only when ``B * Hkv`` programs would not fill two waves of the GPU's SMs
and the sequences are long (each split at least :data:`MIN_SPLIT_TOKENS` tokens). The partials'
round trip is ``2 S Hq (D + 1) * 4`` bytes per query token, small against the K/V it splits.

**Attention sinks (GPT-OSS) and ``Dv != D``.** ``sinks`` (one logit per query head) join each query's
softmax denominator once: an unsplit program folds ``exp(sink - m)`` into its running sum after its last
page (as :mod:`kernel_ladder.ops.attention.forward` does); with split-KV the splits leave it out and the
merge adds it, ``out = sum_s exp(lse_s - M) o_s / (exp(sink - M) + sum_s exp(lse_s - M))`` with
``M = max(sink, max_s lse_s)`` — a sink in every split would be counted ``S`` times. ``v_cache`` may have
its own head dim ``Dv`` (DeepSeek-V3's MLA prefill, 192 and 128): the output is ``(rows, Hq, Dv)``.

**fp8 caches.** ``torch.float8_e4m3fn`` caches with per-tensor float32 scales ``k_scale``, ``v_scale``
(value = fp8 * scale): the codes are cast to q's dtype in registers (exact: e4m3 fits fp16 and bf16)
and the scales folded in once — ``k_scale`` into the score scale, ``v_scale`` into the final
output — so the dots run in q's dtype as for a 16-bit cache.

**Empty sequences.** ``seq_lens[b] = 0`` is allowed: the sequence has no key and its output is 0
(as flash-attn does for a query that sees nothing). With ``cu_seqlens_q``, ``q_len_b > seq_lens[b]``
is rejected (the new tokens are part of the cache). Values of ``seq_lens``, ``cu_seqlens_q`` and the
block table entries each sequence uses (in ``[0, num_blocks)``) follow the value-check policy of
:mod:`kernel_ladder.runtime`: checked on the host for CPU tensors; on a GPU ``seq_lens`` and
``cu_seqlens_q`` are asserted on the device with ``torch._assert_async`` (no host synchronization)
and the block tables are not checked, unless ``check_values(True)`` asks for the host checks.

**Unchecked values never reach outside a tensor.** Whatever the checks, the kernel keeps what they would
reject inside the tensors: a block table entry outside ``[0, num_blocks)`` (negative, or past the cache)
is clamped into it (``min(max(entry, 0), num_blocks - 1)``: the sequence reads the first or the last
block of the cache instead); ``seq_lens`` are clamped to ``[0, max_blocks * block_size]``; query rows
that ``cu_seqlens_q`` puts outside ``q`` are neither read nor written. The output for such values is
meaningless, but no access leaves q, the caches, the tables or the output (traced in the tests). A read
clamps where :mod:`kernel_ladder.ops.write_kv_cache` masks a bad slot: a write that landed on another
block would corrupt it, a read of another block only returns garbage for garbage; and masking each key of
a bad block costs the prefill tile registers (sm_90: 250 -> 255 and a spill at head dim 128), clamping
the table's entries nothing.

:func:`gather_kv` turns the paged cache back into dense per-sequence tensors (the reference and
the gather + SDPA baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .. import _autocast, _launch, runtime
from .._launch import next_power_of_2
from .._validate import FLOAT_DTYPES, check_attention_options, check_tensor, check_values
from .._validate import is_int as _is_int
from .cross_entropy import softcapped

__all__ = [
    "GPU_CONFIG",
    "INTERPRETER_CONFIG",
    "MAX_HEAD_DIM",
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "PagedConfig",
    "gather_kv",
    "paged_attention",
    "paged_attention_kernel",
    "paged_attention_merge_kernel",
    "plan_paged_attention",
]

_OP = "kernel_ladder.paged_attention"

#: The largest head dim (any value up to it; the tile is padded to a power of two with masks).
MAX_HEAD_DIM: int = 256
#: The fewest tokens one split of a sequence takes (a split shorter than this is not worth its partials).
MIN_SPLIT_TOKENS: int = 256
#: The most splits :func:`plan_paged_attention` chooses (the merge holds them all in one tile).
MAX_SPLITS: int = 32
#: Cache block sizes supported (tokens per physical block).
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)  # a finite start for the running max (no inf - inf)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence of packed query program ``pid``: the last ``b`` with ``cu[b] // BLOCK_Q + b <= pid``
    (a binary search; that key strictly increases with ``b``)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def query_tile(cu_seqlens_q_ptr, pid_q, num_seqs, BLOCK_Q: tl.constexpr, VARLEN: tl.constexpr):
    """Query program ``pid_q``'s ``(sequence, its first row in q, its query tokens, the tile of BLOCK_Q of them)``:
    decoding, sequence ``pid_q``'s one token; packed (``VARLEN``), found by :func:`_find_sequence`."""
    if VARLEN:
        seq = _find_sequence(cu_seqlens_q_ptr, pid_q, num_seqs, BLOCK_Q)
        found = seq >= 0  # -1 only when cu_seqlens_q[0] > 0: values a check would reject
        seq = tl.maximum(seq, 0)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.where(found, tl.load(cu_seqlens_q_ptr + seq + 1) - q_start, 0)
        tile = pid_q - (q_start // BLOCK_Q + seq)
    else:
        seq = pid_q
        q_start = pid_q
        q_len = 1
        tile = 0
    return seq, q_start, q_len, tile


@triton.jit
def cache_block(entry, num_blocks, INDEX_64: tl.constexpr):
    """The physical block a block table entry names, clamped into ``[0, num_blocks)`` whatever the table holds
    (an entry a value check would reject reads the first or the last block, never past the cache); int64 with
    ``INDEX_64``."""
    block = tl.minimum(tl.maximum(entry, 0), num_blocks - 1)
    if INDEX_64:
        block = block.to(tl.int64)
    return block


@triton.jit(do_not_specialize=["num_seqs", "group_size", "heads_per_program", "num_splits", "window", "num_rows",
                               "num_blocks", "max_blocks"])
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,          # q (rows, Hq, D), out (rows, Hq, Dv); caches (.., Hkv, D/Dv)
    partial_out_ptr, partial_lse_ptr,                  # SPLIT: fp32 (splits, rows, Hq, Dv) and (splits, rows, Hq)
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,  # int32 (B, max_blocks), (B,), VARLEN: (B + 1,)
    k_scale_ptr, v_scale_ptr,                          # FP8: float32 scalars (else never read)
    sinks_ptr, stride_sink,                            # HAS_SINKS and not SPLIT: (Hq,) logits (the merge adds them)
    stride_qt, stride_qh, stride_qd,                   # q as (rows, Hq, D): rows are B (decode) or total_q
    stride_kb, stride_ks, stride_kh, stride_kd,        # k_cache as (block, slot, Hkv, D)
    stride_vb, stride_vs, stride_vh, stride_vd,        # v_cache as (block, slot, Hkv, Dv)
    stride_ot, stride_oh, stride_od,                   # out as (rows, Hq, Dv)
    stride_pos, stride_pot, stride_poh, stride_pod,    # partial_out as (split, rows, Hq, Dv)
    stride_pls, stride_plt, stride_plh,                # partial_lse as (split, rows, Hq)
    stride_btb, stride_btp, stride_sl,                 # block_tables as (B, max_blocks); seq_lens
    num_seqs, head_dim, head_dim_v, group_size, heads_per_program, num_splits,  # D, Dv; Hq // Hkv; heads/program
    sm_scale, softcap, window,                         # sm_scale: of q k^T (before soft-capping)
    num_rows, num_blocks, max_blocks,                  # q's rows; the cache's blocks; block_tables' columns
    VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr, SAME_DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Attention of one tile of query rows (query heads x tokens of one KV head's group) over one split
    of its sequence's visible cache pages; grid ``(query programs, Hkv or Hq / heads_per_program, splits)``."""
    BLOCK_Q: tl.constexpr = BLOCK_R // GROUP_P  # query tokens per tile
    BLOCK_N: tl.constexpr = PAGES * BLOCK_SIZE  # keys per step
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, tile = query_tile(cu_seqlens_q_ptr, pid_q, num_seqs, BLOCK_Q, VARLEN)
    # Values a check would reject never reach outside a tensor (with value checks off, a GPU's default):
    # seq_len is clamped to the table's capacity, rows outside q are masked, and a block table entry is
    # clamped into [0, num_blocks) (see the module docstring).
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + seq * stride_sl), 0), max_blocks * BLOCK_SIZE)
    m0 = tile * BLOCK_Q
    if m0 < q_len:  # a packed program past its sequence's tiles does nothing
        rows = tl.arange(0, BLOCK_R)
        tok = m0 + rows // GROUP_P
        g = rows % GROUP_P
        first_head = pid_h * heads_per_program
        head = first_head + g
        kv_head = first_head // group_size
        q_row = q_start + tok
        row_mask = (tok < q_len) & (g < heads_per_program)
        if VARLEN:  # decode rows are the program ids: always inside q
            row_mask = row_mask & (q_row >= 0) & (q_row < num_rows)
        position = seq_len - q_len + tok  # each query row's position in its sequence
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        if SAME_DV:  # Dv = D: the code of a kernel without Dv (no register more)
            offs_dv = offs_d
            dv_mask = d_mask
        else:
            offs_dv = tl.arange(0, BLOCK_DV)
            dv_mask = offs_dv < head_dim_v
        seq_row = seq
        if INDEX_64:
            q_row = q_row.to(tl.int64)
            head = head.to(tl.int64)
            kv_head = kv_head.to(tl.int64)
            seq_row = seq_row.to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if FP8:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        else:
            k_scale = 1.0
            v_scale = 1.0
        score_scale = sm_scale * k_scale  # q . (s k) = s (q . k)

        # The keys this tile sees, [lo, hi), as whole pages, and this split's share of them.
        last = tl.minimum(m0 + BLOCK_Q, q_len) - 1
        hi = tl.maximum(seq_len - q_len + last + 1, 0)
        if HAS_WINDOW:
            lo = tl.maximum(seq_len - q_len + m0 - window + 1, 0)
        else:
            lo = 0
        lo_page = lo // BLOCK_SIZE
        hi_page = tl.cdiv(hi, BLOCK_SIZE)
        n_pages = tl.maximum(hi_page - lo_page, 0)
        per_split = tl.cdiv(tl.cdiv(n_pages, num_splits), PAGES) * PAGES
        start_page = lo_page + split * per_split
        end_page = tl.minimum(start_page + per_split, hi_page)
        k_hi = tl.minimum(end_page * BLOCK_SIZE, hi)

        offs_n = tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, PAGES)
        slot = offs_n % BLOCK_SIZE
        table_row = block_tables_ptr + seq_row * stride_btb
        k_base = k_cache_ptr + kv_head * stride_kh + slot[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_base = v_cache_ptr + kv_head * stride_vh + slot[:, None] * stride_vs + offs_dv[None, :] * stride_vd
        acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_R], _FLOAT_MIN, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        for page0 in range(start_page, end_page, PAGES):
            pages = page0 + offs_p
            physical = cache_block(tl.load(table_row + pages * stride_btp, mask=pages < end_page, other=0),
                                   num_blocks, INDEX_64)
            # each key's physical block: the PAGES entries broadcast over their block_size slots
            block_of_key = tl.reshape(tl.broadcast_to(physical[:, None], (PAGES, BLOCK_SIZE)), (BLOCK_N,))
            keys = page0 * BLOCK_SIZE + offs_n
            key_mask = keys < k_hi
            kv_mask = key_mask[:, None] & d_mask[None, :]
            k = tl.load(k_base + block_of_key[:, None] * stride_kb, mask=kv_mask, other=0.0)
            if FP8:
                k = k.to(tl.float32).to(q_ptr.dtype.element_ty)
            if USE_DOT:
                qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
            else:
                qk = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
            if SOFTCAP:  # Gemma-2: scale, then cap, then base 2
                s = softcapped(qk * score_scale, softcap) * _LOG2E
            else:
                s = qk * (score_scale * _LOG2E)
            visible = key_mask[None, :] & (keys[None, :] <= position[:, None])
            if HAS_WINDOW:
                visible = visible & (keys[None, :] > position[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if SAME_DV:
                v = tl.load(v_base + block_of_key[:, None] * stride_vb, mask=kv_mask, other=0.0)
            else:
                v = tl.load(v_base + block_of_key[:, None] * stride_vb, mask=key_mask[:, None] & dv_mask[None, :],
                            other=0.0)
            if FP8:
                v = v.to(tl.float32).to(q_ptr.dtype.element_ty)
            if USE_DOT:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            m_i = m_new
        if HAS_SINKS and not SPLIT:  # the sink joins the denominator once (split: in the merge, once)
            sink = tl.load(sinks_ptr + head * stride_sink, mask=g < heads_per_program, other=float("-inf"))
            sink = sink.to(tl.float32) * _LOG2E
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
        # A row that sees no key here (and no sink) has l = 0: output 0 and lse = -inf (weight 0 in the merge).
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc * (v_scale / l_safe)[:, None]
        out_mask = row_mask[:, None] & dv_mask[None, :]
        if SPLIT:
            tl.store(partial_out_ptr + split * stride_pos + q_row[:, None] * stride_pot + head[:, None] * stride_poh
                     + offs_dv[None, :] * stride_pod, out, mask=out_mask)
            lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
            tl.store(partial_lse_ptr + split * stride_pls + q_row * stride_plt + head * stride_plh, lse,
                     mask=row_mask)
        else:
            tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def paged_attention_merge_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,         # fp32 partials in; out (rows, Hq, Dv) in q's dtype
    sinks_ptr, stride_sink,                            # HAS_SINKS: (Hq,) logits, counted here once
    stride_pos, stride_pot, stride_poh, stride_pod,    # partial_out as (split, rows, Hq, Dv)
    stride_pls, stride_plt, stride_plh,                # partial_lse as (split, rows, Hq)
    stride_ot, stride_oh, stride_od,                   # out as (rows, Hq, Dv)
    num_heads, head_dim, num_splits,                   # head_dim: Dv
    INDEX_64: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the splits of ``BLOCK_H`` heads of one query row by their lse; grid ``(rows, head blocks)``.
    A row whose every split is empty (lse all ``-inf``) gets 0. ``HAS_SINKS``: the sink joins the
    denominator here, once — the splits leave it out (each split counting it would count it S times)."""
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    if INDEX_64:
        row = row.to(tl.int64)
        heads = heads.to(tl.int64)
        splits = splits.to(tl.int64)
    hs_mask = (heads < num_heads)[:, None] & (splits < num_splits)[None, :]
    lse = tl.load(partial_lse_ptr + splits[None, :] * stride_pls + row * stride_plt + heads[:, None] * stride_plh,
                  mask=hs_mask, other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads * stride_sink, mask=heads < num_heads, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse - m[:, None]) * _LOG2E)  # -inf (an empty split) -> weight 0
    total = tl.sum(w, 1)
    if HAS_SINKS:
        total += tl.exp2((sink - m) * _LOG2E)
    total = tl.where(total == 0.0, 1.0, total)
    mask3 = hs_mask[:, :, None] & (offs_d < head_dim)[None, None, :]
    o = tl.load(partial_out_ptr + splits[None, :, None] * stride_pos + row * stride_pot
                + heads[:, None, None] * stride_poh + offs_d[None, None, :] * stride_pod, mask=mask3, other=0.0)
    out = tl.sum(w[:, :, None] * o, 1) / total[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=(heads < num_heads)[:, None] & (offs_d < head_dim)[None, :])


# ----------------------------------------------------------------------------------------------
# Tiles and the split plan
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedConfig:
    """The tiles of :func:`paged_attention_kernel`: at least ``block_n`` keys per step (whole cache
    blocks: ``PAGES = max(1, block_n // block_size)``), ``block_rows`` query rows per program with
    ``cu_seqlens_q`` (query heads x tokens; at least the padded group), ``num_warps``, ``num_stages``."""

    block_n: int
    block_rows: int
    num_warps: int = 4
    num_stages: int = 2

    def pages(self, block_size: int, head_dim: int) -> int:
        block_n = self.block_n if head_dim <= 128 else max(16, self.block_n // 2)  # D = 256: half the keys
        return max(1, block_n // block_size)

    def warps(self, block_size: int, head_dim: int) -> int:
        """``num_warps``, doubled for a step of 128 keys of a 128-wide head or more (128-token blocks):
        ptxas spills the K and V tiles at 4 warps there (tests/aot/paged_attention.py)."""
        keys = self.pages(block_size, head_dim) * block_size
        return self.num_warps * 2 if keys * max(16, next_power_of_2(head_dim)) >= 128 * 128 else self.num_warps


#: The GPU's tiles (memory bound: 64 keys of 4 warps per step, 64 query rows when prefilling).
GPU_CONFIG: PagedConfig = PagedConfig(block_n=64, block_rows=64, num_warps=4, num_stages=2)
#: The interpreter's: few, large steps (each tile operation costs the interpreter the same Python time).
INTERPRETER_CONFIG: PagedConfig = PagedConfig(block_n=64, block_rows=32, num_warps=4, num_stages=1)


def _config() -> PagedConfig:
    return INTERPRETER_CONFIG if runtime.INTERPRETER else GPU_CONFIG


def plan_paged_attention(batch: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                         device: torch.device | str | None = None, num_sms: int | None = None) -> int:
    """The ``num_splits`` that ``paged_attention(num_splits=None)`` uses (a pure function of the shapes).

    ``batch * num_kv_heads`` programs (``batch``: query programs, the sequences when decoding) each
    stream one sequence. When they fill two waves of ``device``'s SMs (:func:`kernel_ladder._launch.num_sms`;
    the interpreter acts as a 4-SM GPU), or the sequences are shorter than two splits of
    :data:`MIN_SPLIT_TOKENS` (or of 4 cache blocks), there is nothing to gain: 1. Otherwise enough
    splits for two waves, at most one per ``MIN_SPLIT_TOKENS`` tokens and :data:`MAX_SPLITS`.
    ``max_seq_len`` bounds the sequences (the op passes ``block_tables.shape[1] * block_size``: no sync).
    ``num_sms`` replaces the device's count (to plan for another GPU, e.g. ``utils.roofline``'s H200: 132).
    """
    programs = max(1, int(batch) * int(num_kv_heads))
    target = 2 * (_launch.num_sms(device) if num_sms is None else int(num_sms))
    if programs >= target:
        return 1
    min_split = max(MIN_SPLIT_TOKENS, 4 * int(block_size))
    by_length = int(max_seq_len) // min_split
    return max(1, min(triton.cdiv(target, programs), by_length, MAX_SPLITS))


@dataclass(frozen=True)
class _Launch:
    """How one call runs: the row tile, the grid, and the switches."""

    rows: int  # B (decode) or total_q
    num_seqs: int
    heads_q: int
    heads_kv: int
    head_dim: int
    block_size: int
    group_query_heads: bool
    varlen: bool

    @property
    def heads_per_program(self) -> int:
        return self.heads_q // self.heads_kv if self.group_query_heads else 1

    @property
    def group_p(self) -> int:
        return next_power_of_2(self.heads_per_program)

    @property
    def use_dot(self) -> bool:
        # Decoding a group of 1 or 2 heads: an elementwise product (a 1-2 row tile); else tl.dot on >= 16 rows.
        return self.varlen or self.group_p > 2

    @property
    def block_rows(self) -> int:
        if self.varlen:  # at most 64 x 128 fp32 accumulators (a 256-wide head: 32 rows)
            block_d = max(16, next_power_of_2(self.head_dim))
            return max(16, self.group_p, min(_config().block_rows, 8192 // block_d))
        return max(16, self.group_p) if self.use_dot else self.group_p

    @property
    def block_q(self) -> int:
        return self.block_rows // self.group_p

    @property
    def query_programs(self) -> int:
        if self.varlen:
            return self.rows // self.block_q + self.num_seqs
        return self.rows

    @property
    def head_programs(self) -> int:
        return self.heads_q // self.heads_per_program


def _index_64(*tensors: torch.Tensor) -> bool:
    """Whether some offset (a tile's masked overrun included) of these tensors can pass 2**31."""
    extents = []
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        strides = [abs(s) for s in t.stride()]
        extents.append(sum((size - 1) * s for size, s in zip(t.shape, strides)) + 256 * max(strides))
    return _launch.needs_int64(*extents)


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """Split-KV's float32 partial outputs ``(splits, rows, H, Dv)`` and log-sum-exps ``(splits, rows, H)`` for
    ``out`` ``(rows, H, Dv)``, and their strides; with one split ``out`` in their place (never touched), strides 0."""
    if num_splits <= 1:
        return out, out, (0, 0, 0, 0), (0, 0, 0)
    rows, heads, width = out.shape
    partial_out = _launch.empty((num_splits, rows, heads, width), torch.float32, out.device)
    partial_lse = _launch.empty((num_splits, rows, heads), torch.float32, out.device)
    return partial_out, partial_lse, partial_out.stride(), partial_lse.stride()


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, index_64: bool,
                 sinks: torch.Tensor | None = None) -> None:
    """Launch :func:`paged_attention_merge_kernel`: the splits' partials (:func:`split_partials`) into ``out``,
    ``sinks`` (one logit per head) counted here once."""
    num_splits, rows, heads, head_dim = partial_out.shape
    block_d = max(16, next_power_of_2(head_dim))
    block_s = next_power_of_2(num_splits)
    block_h = max(1, min(next_power_of_2(heads), 8192 // (block_s * block_d)))
    sink_args = (partial_lse, 0) if sinks is None else (sinks, sinks.stride(0))  # no sinks: never read
    paged_attention_merge_kernel[(rows, triton.cdiv(heads, block_h))](
        partial_out, partial_lse, out, *sink_args, *partial_out.stride(), *partial_lse.stride(), *out.stride(),
        heads, head_dim, num_splits,
        INDEX_64=index_64, HAS_SINKS=sinks is not None, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_D=block_d,
        num_warps=4,
    )


def _forward(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale, out, softmax_scale,
             window, softcap, num_splits, group_query_heads=True, sinks=None) -> None:
    """Launch the attention kernel (and the merge when ``num_splits > 1``) into ``out``."""
    rows, heads_q, head_dim = q.shape
    head_dim_v = v_cache.shape[-1]
    num_blocks, block_size, heads_kv, _ = k_cache.shape
    varlen = cu_seqlens_q is not None
    num_seqs = seq_lens.shape[0]
    if rows == 0 or heads_q == 0 or head_dim == 0:
        return
    # the tiles are sized by the wider of the q/k and v heads (Dv != D: DeepSeek's MLA prefill)
    plan = _Launch(rows, num_seqs, heads_q, heads_kv, max(head_dim, head_dim_v), block_size, group_query_heads,
                   varlen)
    config = _config()
    split = num_splits > 1
    partial_out, partial_lse, pstrides, lstrides = split_partials(out, num_splits)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    index_64 = _index_64(q, k_cache, v_cache, out, block_tables, *((partial_out,) if split else ()))
    block_d = max(16, next_power_of_2(head_dim))
    block_dv = max(16, next_power_of_2(head_dim_v))
    dummy = seq_lens
    sink_args = (dummy, 0) if sinks is None else (sinks, sinks.stride(0))
    grid = (plan.query_programs, plan.head_programs, num_splits)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, out, partial_out, partial_lse,
        block_tables, seq_lens, cu_seqlens_q if varlen else dummy,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy, *sink_args,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *pstrides, *lstrides,
        block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        num_seqs, head_dim, head_dim_v, heads_q // heads_kv, plan.heads_per_program, num_splits,
        float(softmax_scale), float(softcap or 1.0), int(window or 0),
        rows, num_blocks, block_tables.shape[1] if num_blocks else 0,  # an empty cache: every seq_len clamps to 0
        VARLEN=varlen, HAS_WINDOW=window is not None, SOFTCAP=softcap is not None, FP8=fp8, SPLIT=split,
        USE_DOT=plan.use_dot, INDEX_64=index_64, INPUT_PRECISION=_launch.dot_input_precision(q.dtype),
        HAS_SINKS=sinks is not None, SAME_DV=head_dim_v == head_dim, BLOCK_SIZE=block_size,
        PAGES=config.pages(block_size, max(head_dim, head_dim_v)),
        BLOCK_R=plan.block_rows, GROUP_P=plan.group_p, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=config.warps(block_size, max(head_dim, head_dim_v)),
        num_stages=config.num_stages,
    )
    if split:
        merge_splits(partial_out, partial_lse, out, index_64, sinks)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """4-D ``(num_blocks, block_size, Hkv, D)`` and ``(..., Dv)`` caches of one dtype and the same blocks and heads."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D (num_blocks, block_size, Hkv, D), got shape {tuple(t.shape)}"
                             " (for one layer of a (layers, ...) cache, pass cache[layer])")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{op}: k_cache and v_cache must have the same shape but for the head dim (num_blocks, "
                         f"block_size, Hkv), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{op}: k_cache and v_cache must have the same dtype, got {k_cache.dtype} and {v_cache.dtype}")


def _check(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, window, softcap, cu_seqlens_q, num_splits,
           k_scale, v_scale, sinks=None) -> None:
    op = _OP
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        check_tensor(op, name, t)
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.dim() != 3:
        layout = "(total_q, Hq, D) with cu_seqlens_q" if cu_seqlens_q is not None else "(B, Hq, D) (decode)"
        raise ValueError(f"{op}: q must be 3-D {layout}, got shape {tuple(q.shape)}")
    _check_caches(op, k_cache, v_cache)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # Under autocast a float q and cache both go to the autocast dtype first (as SDPA's inputs): no mismatch.
    if not fp8 and k_cache.dtype != q.dtype and not _autocast.unifies(op, ("q", q), ("k_cache", k_cache)):
        raise TypeError(f"{op}: k_cache and v_cache must have q's dtype ({q.dtype}) or be torch.float8_e4m3fn "
                        f"(with k_scale and v_scale), got {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{op}: q and {name} must be on the same device, got {q.device} and {t.device}")
    num_blocks, block_size, heads_kv, head_dim = k_cache.shape
    check_block_size(op, "k_cache", block_size)
    if q.shape[-1] != head_dim:
        raise ValueError(f"{op}: q and the caches must share the head dim D (the last dim), got {q.shape[-1]} and "
                         f"{head_dim}")
    for what, d in (("the head dim D", head_dim), ("v_cache's head dim Dv", v_cache.shape[-1])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{op}: {what} must be in [1, {MAX_HEAD_DIM}], got {d}")
    heads_q = q.shape[1]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{op}: the query heads ({heads_q}) must be a multiple of the cache's key/value heads "
                         f"({heads_kv}): grouped-query attention gives each kv head Hq // Hkv query heads")
    check_block_tables(op, "q", q, block_tables, seq_lens, cu_seqlens_q)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            if scale is not None:
                raise ValueError(f"{op}: {name} is only for float8_e4m3fn caches; the caches are {k_cache.dtype}")
            continue
        if scale is None:
            raise ValueError(f"{op}: float8_e4m3fn caches need {name} (a float32 scalar tensor: value = fp8 * scale)")
        check_tensor(op, name, scale)
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(f"{op}: {name} must be a float32 tensor of one element, got {scale.dtype} of shape "
                            f"{tuple(scale.shape)}")
        if scale.device != q.device:
            raise ValueError(f"{op}: q and {name} must be on the same device, got {q.device} and {scale.device}")
    check_attention_options(op, softmax_scale, window, softcap)
    if sinks is not None:
        check_tensor(op, "sinks", sinks)
        if not sinks.dtype.is_floating_point or sinks.dtype.itemsize < 2:
            raise TypeError(f"{op}: sinks must be a float tensor (float64, float32, float16 or bfloat16; read in "
                            f"float32), got {sinks.dtype}")
        if sinks.shape != (heads_q,):
            raise ValueError(f"{op}: sinks must have shape (Hq,) = ({heads_q},): one logit per query head, got "
                             f"{tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"{op}: q and sinks must be on the same device, got {q.device} and {sinks.device}")
    check_num_splits(op, num_splits)


def check_block_size(op: str, cache_name: str, block_size: int) -> None:
    """A paged cache's block size (``cache.shape[1]``): one of :data:`BLOCK_SIZES`."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{op}: the cache block size ({cache_name}.shape[1]) must be a power of two from 8 to 128, "
                         f"got {block_size}")


def check_block_tables(op: str, q_name: str, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       cu_seqlens_q: torch.Tensor | None) -> None:
    """The paging arguments of an attention over a paged cache (their dtypes and shapes; the values are
    :func:`check_block_table_values`'): int32 ``block_tables (B, max_blocks)`` and ``seq_lens (B,)``, and the
    query rows ``q_name`` holds: one per sequence when decoding, else packed by an int32 ``cu_seqlens_q (B + 1,)``
    on q's device."""
    if block_tables.dtype != torch.int32:
        raise TypeError(f"{op}: block_tables must be int32, got {block_tables.dtype}; convert with .to(torch.int32)")
    if block_tables.dim() != 2:
        raise ValueError(f"{op}: block_tables must be 2-D (B, max_blocks), got shape {tuple(block_tables.shape)}")
    batch = block_tables.shape[0]
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"{op}: seq_lens must be int32, got {seq_lens.dtype}; convert with .to(torch.int32)")
    if seq_lens.shape != (batch,):
        raise ValueError(f"{op}: seq_lens must have shape (B,) = ({batch},) (one length per block_tables row), got "
                         f"{tuple(seq_lens.shape)}")
    if cu_seqlens_q is None:
        if q.shape[0] != batch:
            raise ValueError(f"{op}: decoding (no cu_seqlens_q) takes one query token per sequence: {q_name}.shape[0] "
                             f"must be B = {batch} (block_tables.shape[0]), got {q.shape[0]}")
        return
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dtype != torch.int32:
        raise TypeError(f"{op}: cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(f"{op}: cu_seqlens_q must have shape (B + 1,) = ({batch + 1},): 0, then each sequence's "
                         f"end in {q_name}; got {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"{op}: {q_name} and cu_seqlens_q must be on the same device, got {q.device} and "
                         f"{cu_seqlens_q.device}")


def check_num_splits(op: str, num_splits: object) -> None:
    """``num_splits``: a positive int, or None (:func:`plan_paged_attention` chooses)."""
    if num_splits is None:
        return
    if not _is_int(num_splits):
        raise TypeError(f"{op}: num_splits must be a positive int or None (chosen automatically), got "
                        f"{type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"{op}: num_splits must be >= 1, got {num_splits}")


def check_block_table_values(op: str, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             cu_seqlens_q: torch.Tensor | None, block_size: int, num_blocks: int) -> None:
    """seq_lens in [0, max_blocks * block_size]; the block table entries a sequence uses in
    [0, num_blocks); cu_seqlens_q from 0, non-decreasing, ending at total_q = ``q.shape[0]``, and no sequence
    with more new tokens than cached ones. By the value-check policy (no host synchronization on CUDA); on the
    CPU computed on the tensors' memory (numpy), so that a trace of the op counts only its kernels."""
    capacity = block_tables.shape[1] * block_size
    lens_message = (f"{op}: seq_lens must be in [0, max_blocks * block_size] = [0, {capacity}] "
                    "(block_tables has max_blocks entries per sequence)")
    check_values((seq_lens,), lambda: ((seq_lens >= 0) & (seq_lens <= capacity)).all(), lens_message,
                 lambda: f"{lens_message}; got {seq_lens.tolist()}",
                 host_ok=lambda: bool(((seq_lens.numpy() >= 0) & (seq_lens.numpy() <= capacity)).all()))

    def used() -> torch.Tensor:  # the entries each sequence reads: the first cdiv(seq_len, block_size)
        columns = torch.arange(block_tables.shape[1], device=block_tables.device, dtype=torch.int32)
        return columns[None, :] * block_size < seq_lens[:, None]

    def bad_entries() -> torch.Tensor:
        return ~((block_tables >= 0) & (block_tables < num_blocks)) & used()

    tables_message = (f"{op}: every block_tables entry a sequence uses (the first cdiv(seq_lens[b], "
                      f"block_size = {block_size})) must be a block of the cache, in [0, num_blocks = {num_blocks})")

    def tables_error() -> str:
        b, e = bad_entries().nonzero()[0].tolist()
        return (f"{tables_message}; got block_tables[{b}, {e}] = {int(block_tables[b, e])} "
                f"(sequence {b} has seq_len {int(seq_lens[b])})")

    def tables_host_ok() -> bool:
        tables, lens = block_tables.numpy(), seq_lens.numpy()
        used_np = np.arange(tables.shape[1])[None, :] * block_size < lens[:, None]
        return bool((((tables >= 0) & (tables < num_blocks)) | ~used_np).all())

    # No device assertion by default (the runtime's rule for CUDA: only when asked): a decode step
    # would pay several launches for it.
    check_values((block_tables, seq_lens), lambda: ~bad_entries().any(), tables_message, tables_error,
                 host_ok=tables_host_ok, device_assert=False)
    if cu_seqlens_q is None:
        return

    def cu_ok() -> torch.Tensor:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        return ((cu_seqlens_q[0] == 0) & (cu_seqlens_q[-1] == q.shape[0]) & (q_lens >= 0).all()
                & (q_lens <= seq_lens).all())

    def cu_host_ok() -> bool:
        cu, lens = cu_seqlens_q.numpy(), seq_lens.numpy()
        q_lens = cu[1:] - cu[:-1]
        return bool(cu[0] == 0 and cu[-1] == q.shape[0] and (q_lens >= 0).all() and (q_lens <= lens).all())

    cu_message = (f"{op}: cu_seqlens_q must start at 0, never decrease, end at total_q = {q.shape[0]}, and no "
                  "sequence may have more new tokens than seq_lens (the new tokens are in the cache)")
    check_values((cu_seqlens_q, seq_lens), cu_ok, cu_message,
                 lambda: f"{cu_message}; got cu_seqlens_q {cu_seqlens_q.tolist()} and seq_lens {seq_lens.tolist()}",
                 host_ok=cu_host_ok)


# ----------------------------------------------------------------------------------------------
# The custom op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, softmax_scale: float, window: int | None, softcap: float | None, num_splits: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    _check(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, window, softcap, cu_seqlens_q, num_splits,
           k_scale, v_scale, sinks)
    runtime.require_launchable(_OP, q, k_cache, v_cache, block_tables, seq_lens)
    check_block_table_values(_OP, q, block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1], k_cache.shape[0])
    out = _launch.empty_output((*q.shape[:2], v_cache.shape[-1]), q)
    _forward(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale, out, softmax_scale,
             window, softcap, num_splits, sinks=sinks)
    return out


@_paged_attention_op.register_fake
def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale,
                          softmax_scale, window, softcap, num_splits, sinks=None):
    _check(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, window, softcap, cu_seqlens_q, num_splits,
           k_scale, v_scale, sinks)
    return _launch.empty_output((*q.shape[:2], v_cache.shape[-1]), q)


def _no_backward(ctx, grad_out):
    raise NotImplementedError(f"{_OP} is forward only (an inference op over a KV cache): it has no gradient. "
                              "Run it under torch.no_grad(), or use kernel_ladder.flash_attention to train")


def _setup_context(ctx, inputs, output) -> None:
    pass


_paged_attention_op.register_autograd(_no_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _resolve_splits(q, k_cache, v_cache, block_tables, cu_seqlens_q, num_splits) -> int:
    if num_splits is not None:
        return int(num_splits)
    block_size, heads_kv = k_cache.shape[1], k_cache.shape[2]
    programs = block_tables.shape[0]
    if cu_seqlens_q is not None:
        plan = _Launch(q.shape[0], block_tables.shape[0], q.shape[1], heads_kv, max(q.shape[2], v_cache.shape[3]),
                       block_size, True, True)
        programs = plan.query_programs
    return plan_paged_attention(programs, heads_kv, block_tables.shape[1] * block_size, block_size, q.device)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over a paged KV cache (decode, or chunked prefill with ``cu_seqlens_q``).

    See the module docstring for the layout and the algorithm.

    Args:
        q: float32, float16 or bfloat16 queries, any strides. Decode (no ``cu_seqlens_q``): ``(B, Hq, D)``,
            one new token per sequence at position ``seq_lens[b] - 1``. With ``cu_seqlens_q``:
            ``(total_q, Hq, D)``, the newest ``q_len_b`` tokens of each sequence packed.
        k_cache, v_cache: ``(num_blocks, block_size, Hkv, D)`` and ``(..., Hkv, Dv)``, any strides (e.g. one
            layer's slice of a ``(layers, num_blocks, ...)`` tensor); ``block_size`` a power of two from 8 to
            128; ``Hq`` a multiple of ``Hkv`` (GQA/MQA); q's dtype, or ``torch.float8_e4m3fn`` with
            ``k_scale``/``v_scale``.
            Under ``torch.autocast`` q and a float cache go to the autocast dtype first (as SDPA's inputs):
            an fp32 q over a bf16 cache runs in bf16, the cache uncopied.
            ``D`` and ``Dv`` any values up to 256 (``Dv != D``: DeepSeek-V3's MLA prefill, 192 and 128).
        block_tables: int32 ``(B, max_blocks)``: sequence ``b``'s token ``j`` is in physical block
            ``block_tables[b, j // block_size]``, slot ``j % block_size``. Entries past
            ``cdiv(seq_lens[b], block_size)`` are never read; the others must be in ``[0, num_blocks)``
            (a value check: see :mod:`kernel_ladder.runtime`); unchecked, an entry outside the cache is
            clamped into ``[0, num_blocks)``: never read past the cache, the output meaningless.
        seq_lens: int32 ``(B,)``: cached tokens of each sequence, the new ones included; each in
            ``[0, max_blocks * block_size]``. A sequence of length 0 gives output 0.
        softmax_scale: the scale of ``q k^T``; ``None`` for ``1 / sqrt(D)``.
        window: sliding window ``W >= 1``: the query at position ``p`` sees keys in ``(p - W, p]``
            (kernel_ladder.flash_attention's ``window`` with ``causal=True``).
        softcap: Gemma-2's soft-capping ``c > 0``: scores become ``c * tanh(scale * q.k / c)``.
        cu_seqlens_q: int32 ``(B + 1,)``: 0, then the packed ends of each sequence's new tokens in ``q``;
            ``q_len_b <= seq_lens[b]``. Query ``i`` of sequence ``b`` is at position
            ``seq_lens[b] - q_len_b + i`` and sees the cached keys at positions ``<=`` its own (causal).
        num_splits: split-KV (flash decoding): each query tile's keys in ``num_splits`` contiguous
            ranges, run by separate programs and merged by their log-sum-exp; ``1``: no split and no
            merge launch; ``None``: :func:`plan_paged_attention` chooses.
        k_scale, v_scale: float32 one-element tensors, for float8_e4m3fn caches only (value = fp8 * scale).
        sinks: GPT-OSS's attention sinks, ``(Hq,)`` of any float dtype (read in float32): a per-head logit in
            every query's softmax denominator and nothing else (see :func:`kernel_ladder.flash_attention`);
            counted once per query, also with split-KV (the merge adds it, not each split).

    Returns:
        A new contiguous ``(rows, Hq, Dv)`` tensor of q's dtype (float32 accumulation).

    Forward only: the op has no autograd formula (a backward through it raises ``NotImplementedError``).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, window, softcap, cu_seqlens_q, num_splits,
           k_scale, v_scale, sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    splits = _resolve_splits(q, k_cache, v_cache, block_tables, cu_seqlens_q, num_splits)
    return _paged_attention_op(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale, scale,
                               None if window is None else int(window), None if softcap is None else float(softcap),
                               splits, sinks)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's cached keys and values as dense ``(seq_len, Hkv, D)`` tensors (torch gathers):
    ``[(k_b, v_b) for b in range(B)]``, in the caches' dtype.

    The course's contiguous view of a paged cache: the float64 reference and the gather + SDPA
    baseline start from it. Reads only the table entries a sequence uses. Syncs with the host
    (it reads ``seq_lens``).
    """
    block_size = k_cache.shape[1]
    result = []
    for b, length in enumerate(seq_lens.tolist()):
        n_blocks = triton.cdiv(length, block_size)
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(n_blocks * block_size, *k_cache.shape[2:])[:length]
        v = v_cache[blocks].reshape(n_blocks * block_size, *v_cache.shape[2:])[:length]
        result.append((k, v))
    return result
