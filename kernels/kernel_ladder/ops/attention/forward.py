"""The flash-attention forward kernel: ``out`` and the log-sum-exp ``lse`` of one query block per program.

**Never the Tq x Tk matrix.** One program owns ``BLOCK_M`` query rows of one head and walks the
keys ``BLOCK_N`` at a time, keeping for each row a running maximum ``m``, a running sum ``l`` of
``exp(S - m)`` and an unnormalized output ``acc`` (the *online softmax*, Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022, arXiv:2205.14135; FlashAttention-2, Dao 2023, arXiv:2307.08691).
For each key block::

    m' = max(m, rowmax(S_blk))     alpha = exp(m - m')          (the rescale)
    P_blk = exp(S_blk - m')        l' = alpha * l + rowsum(P_blk)
    acc' = alpha * acc + P_blk V_blk

and at the end ``O = acc / l``, ``lse = m + log(l)``. An attention sink (GPT-OSS) is one more
"block" of a single column of score ``sink`` and value 0, folded in after the loop, once:
``m' = max(m, sink)``, ``l' = l exp(m - m') + exp(sink - m')``, ``acc' = acc exp(m - m')``.
The rescale makes every earlier term as if it had been computed with the final maximum, so the
result is exact, and no ``exp`` ever overflows.
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

**K and V loads.** Where K's and V's layout suits a tensor descriptor (unit feature stride, 16-byte
aligned rows) on a GPU of sm_90 or later with Triton >= 3.6, and in the interpreter, the launcher sets
``USE_TMA``: each program describes its head's ``(Tk, D)`` keys and values (``tl.make_tensor_descriptor``)
and each block is one copy by the tensor-memory accelerator into shared memory, with zeros past the
sequence's last key and past ``D`` (a packed sequence's descriptor ends at its own length). The loop then
holds no per-thread address or load mask, which frees the registers that let 128 x 128 tiles fit at
``D = 128``. Otherwise (a misaligned or strided layout, an older Triton or GPU) the masked loads read from a
scalar base advanced by one block per step over loop-invariant offsets (``cp.async`` on sm_90). A
descriptor built in a kernel lives in scratch memory from Triton's allocator: the launcher sets one (torch's)
where the caller has set none.

**Grouped-query attention without copies.** The grid is ``(query blocks, Hq, B)``; the program of
query head ``h`` reads key/value head ``h // (Hq // Hkv)``. K and V are never repeated in memory;
each query head's programs stream their group's K/V themselves (on a GPU the group's repeated reads
are mostly served by L2). Packing a group's query heads into one program's rows, which would read
K/V once per group (what decoding with a single query would gain most from), is not done here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..cross_entropy import softcapped
from .tiles import _FLOAT_MIN, _LN2, _LOG2E, _block_list, _diagonal, _key_range, _sequence

__all__ = ["flash_attention_forward_kernel"]


@triton.jit
def _forward_blocks(
    acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, stride_kn, stride_vn, last_key, first_key, d_mask, dv_mask,
    start, end, seqlen_k, sm_scale, qk_scale, softcap, block_list_ptr, k_desc, v_desc,
    USE_TMA: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPARSE: tl.constexpr, SAME_DV: tl.constexpr,
):
    """Fold key blocks ``[start, end)`` into the running ``(acc, m, l)`` of one query block.

    ``BLOCK_SPARSE``: the ``(end - start) / BLOCK_N`` blocks are not consecutive but read, one per
    step, from the int32 list at ``block_list_ptr`` (block indices, in units of ``BLOCK_N`` keys;
    ``None`` and never read for consecutive blocks).

    ``k_base``/``v_base`` point at key 0 of the head (scalars); ``k_offs``/``v_offs`` are a block's
    element offsets (``[BLOCK_N, BLOCK_D]``), the same for every block: each step advances the scalar
    base by ``BLOCK_N`` rows, so the per-element addresses cost one add per load and nothing else.
    Row ``i`` sees keys ``first_key[i] <= j <= last_key[i]`` (``i + diagonal - W + 1`` and ``i + diagonal``).
    Unmasked blocks (``MASKED`` False) are inside ``seqlen_k`` and visible to every row: no mask.
    The scores stay unscaled until the exponent: the row maximum is taken of ``Q K^T`` and scaled once
    per row (``qk_scale > 0``, so ``max(s * c) = max(s) * c`` exactly), and ``exp2``'s argument
    ``s * qk_scale - m`` is one fused multiply-add per score.
    The loop body is written out (no helper calls): it is the hot loop, also in the interpreter.
    """
    cols = start + tl.arange(0, BLOCK_N)
    key0 = start.to(tl.int32)  # USE_TMA: the block's first key, a coordinate of the descriptors
    step_k = BLOCK_N * stride_kn
    step_v = BLOCK_N * stride_vn
    k_base += start * stride_kn
    v_base += start * stride_vn
    for _ in range(start, end, BLOCK_N):
        if BLOCK_SPARSE:  # the next listed block: its keys and their K/V rows
            block = tl.load(block_list_ptr)
            block_list_ptr += 1
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            key0 = block * BLOCK_N
            k_tile = k_base + block.to(tl.int64) * step_k
            v_tile = v_base + block.to(tl.int64) * step_v
        else:
            k_tile = k_base
            v_tile = v_base
        if MASKED:
            k_mask = (cols < seqlen_k)[:, None] & d_mask[None, :]
        else:
            k_mask = d_mask[None, :]
        if SAME_DV:  # one mask for K and V (the code of a kernel without Dv: no register more)
            v_mask = k_mask
        elif MASKED:
            v_mask = (cols < seqlen_k)[:, None] & dv_mask[None, :]
        else:
            v_mask = dv_mask[None, :]
        if USE_TMA:  # one copy per block by the tensor-memory accelerator: keys past Tk, columns past D read as 0
            k = k_desc.load([key0, 0])
        else:
            k = tl.load(k_tile + k_offs, mask=k_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if SOFTCAP:  # Gemma-2: scale, then cap, then base 2 (the scale is in the scores: qk_scale unused)
            s = softcapped(s * sm_scale, softcap) * _LOG2E
        if MASKED:
            visible = (cols < seqlen_k)[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= last_key[:, None])
            if HAS_WINDOW:
                visible = visible & (cols[None, :] >= first_key[:, None])
            s = tl.where(visible, s, float("-inf"))
            cols += BLOCK_N
        if SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # the rescale of everything accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = v_desc.load([key0, 0])
        else:
            v = tl.load(v_tile + v_offs, mask=v_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
        if not BLOCK_SPARSE:
            k_base += step_k
            v_base += step_v
            key0 += BLOCK_N
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "BUCKET_Q", "BUCKET_K"])
def flash_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,          # inputs; outputs: out (q's dtype), lse (float32, natural log)
    sinks_ptr, stride_sink,                         # HAS_SINKS: one logit per q head (any float dtype), else unread
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,             # VARLEN: (B + 1,) int32 sequence starts (else never read)
    block_count_ptr, block_index_ptr,               # BLOCK_SPARSE: int32 counts (Bm, Hm, rows) and lists (.., rows, n)
    stride_cb, stride_ch, stride_cm,                # the counts' strides (0 over a broadcast batch or head)
    stride_ib, stride_ih, stride_im,                # the lists' strides (each list contiguous)
    stride_qb, stride_qh, stride_qm, stride_qd,     # q as (B, Hq, Tq, D) whatever its layout (VARLEN: stride_qb 0)
    stride_kb, stride_kh, stride_kn, stride_kd,     # k, v as (B, Hkv, Tk, D)
    stride_vb, stride_vh, stride_vn, stride_vd,     # (v's head dim is Dv)
    stride_ob, stride_oh, stride_om, stride_od,     # out as (B, Hq, Tq, Dv)
    stride_lb, stride_lh, stride_lm,                # lse as (B, Hq, Tq) (VARLEN: (Hq, total_q), stride_lb 0)
    seqlen_q, seqlen_k, head_dim, head_dim_v, group_size,  # lengths (VARLEN: the packed totals), D, Dv, Hq // Hkv
    sm_scale, qk_scale, softcap, window,            # qk_scale = sm_scale * log2(e)
    BUCKET_Q, BUCKET_K,                             # the autotuner's key only (powers of two of the lengths)
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr, HAS_SINKS: tl.constexpr,
    SAME_DV: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``out`` and ``lse`` of one block of ``BLOCK_M`` queries of one head; grid ``(query blocks, Hq, B)``.

    Walks the key blocks of :func:`_key_range` only: masked blocks at the window's edge, unmasked
    ones in the middle, masked ones on the diagonal and at the end of the keys.
    """
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = _sequence(cu_seqlens_q_ptr=cu_seqlens_q_ptr,
                                                     cu_seqlens_k_ptr=cu_seqlens_k_ptr, batch=batch,
                                                     seqlen_q=seqlen_q, seqlen_k=seqlen_k, VARLEN=VARLEN)
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
        if SAME_DV:  # Dv = D
            offs_dv = offs_d
            dv_mask = d_mask
        else:
            offs_dv = tl.arange(0, BLOCK_DV)
            dv_mask = offs_dv < head_dim_v
        row_mask = rows < seqlen_q
        q_base = q_ptr + batch * stride_qb + head * stride_qh + q_start * stride_qm
        q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        # scalar bases (advanced per key block) and one block's element offsets (loop-invariant)
        k_base = k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
        v_base = v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
        k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_offs = offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd

        if USE_TMA:
            # this head's keys as a (Tk, D) tensor (the launcher checked: unit feature stride, 16-byte aligned
            # rows); a varlen sequence's own length bounds it, so its blocks never read the next sequence's keys
            n_keys = tl.maximum(seqlen_k, 1)  # (a descriptor's dims are positive; no block is read when Tk = 0)
            k_tma = tl.make_tensor_descriptor(k_base, [n_keys, head_dim], [stride_kn, 1], [BLOCK_N, BLOCK_D])
            v_tma = tl.make_tensor_descriptor(v_base, [n_keys, head_dim_v], [stride_vn, 1], [BLOCK_N, BLOCK_DV])
        else:
            k_tma = None
            v_tma = None
        diagonal = _diagonal(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
        lo, full_lo, full_hi, hi = _key_range(m0=m0, m_last=m_last, seqlen_k=seqlen_k, diagonal=diagonal,
                                              window=window, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N,
                                              INDEX_64=INDEX_64)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], _FLOAT_MIN, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        last_key = rows + diagonal  # row i sees keys first_key[i] <= j <= last_key[i]
        first_key = last_key - window + 1
        if BLOCK_SPARSE:  # exactly the listed key blocks of this query block (BLOCK_M = BLOCK_N = the mask's block)
            block_list, n_blocks = _block_list(
                block_count_ptr=block_count_ptr, block_index_ptr=block_index_ptr, stride_cb=stride_cb,
                stride_ch=stride_ch, stride_cm=stride_cm, stride_ib=stride_ib, stride_ih=stride_ih,
                stride_im=stride_im, batch=batch, head=head, row=pid_m)
            acc, m_i, l_i = _forward_blocks(
                acc=acc, m_i=m_i, l_i=l_i, q=q, k_base=k_base, v_base=v_base, k_offs=k_offs, v_offs=v_offs,
                stride_kn=stride_kn, stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask,
                dv_mask=dv_mask,
                start=n_blocks * 0, end=n_blocks * BLOCK_N, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=block_list, k_desc=k_tma, v_desc=v_tma,
                USE_TMA=USE_TMA, MASKED=True, CAUSAL=False, HAS_WINDOW=False,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=True,
                SAME_DV=SAME_DV)
        else:  # the window's edge (masked), the blocks every row sees whole, the diagonal and the end (masked)
            acc, m_i, l_i = _forward_blocks(
                acc=acc, m_i=m_i, l_i=l_i, q=q, k_base=k_base, v_base=v_base, k_offs=k_offs, v_offs=v_offs,
                stride_kn=stride_kn, stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask,
                dv_mask=dv_mask,
                start=lo, end=full_lo, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=None, k_desc=k_tma, v_desc=v_tma,
                USE_TMA=USE_TMA, MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=False,
                SAME_DV=SAME_DV)
            acc, m_i, l_i = _forward_blocks(
                acc=acc, m_i=m_i, l_i=l_i, q=q, k_base=k_base, v_base=v_base, k_offs=k_offs, v_offs=v_offs,
                stride_kn=stride_kn, stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask,
                dv_mask=dv_mask,
                start=full_lo, end=full_hi, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=None, k_desc=k_tma, v_desc=v_tma,
                USE_TMA=USE_TMA, MASKED=False, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=False,
                SAME_DV=SAME_DV)
            acc, m_i, l_i = _forward_blocks(
                acc=acc, m_i=m_i, l_i=l_i, q=q, k_base=k_base, v_base=v_base, k_offs=k_offs, v_offs=v_offs,
                stride_kn=stride_kn, stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask,
                dv_mask=dv_mask,
                start=full_hi, end=hi, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=None, k_desc=k_tma, v_desc=v_tma,
                USE_TMA=USE_TMA, MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=False,
                SAME_DV=SAME_DV)
        if HAS_SINKS:  # the sink: one more column of score `sink` and value 0, folded in once, at the end
            sink = tl.load(sinks_ptr + head * stride_sink).to(tl.float32) * _LOG2E
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]  # (a -inf sink: alpha = 1, the bits of no sink)
            m_i = m_new
        # A row that sees no key (and no sink) has l = 0: output 0 and lse = -inf (flash-attn's convention).
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
        out_base = out_ptr + batch * stride_ob + head * stride_oh + q_start * stride_om
        tl.store(out_base + rows[:, None] * stride_om + offs_dv[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dv_mask[None, :])
        lse_base = lse_ptr + batch * stride_lb + head * stride_lh + q_start * stride_lm
        tl.store(lse_base + rows * stride_lm, lse, mask=row_mask)
