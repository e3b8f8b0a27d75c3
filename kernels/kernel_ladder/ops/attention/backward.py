"""The flash-attention backward kernels: the preprocess (``delta``), ``dK, dV`` per key block, ``dQ`` per query block.

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
chapters merge partial attention results through it). The preprocess also writes ``lse2``, the
log-sum-exp in base 2 (``+inf`` for a row that sees no key), so that the loops below form
``P = exp2(S * scale * log2(e) - lse2)`` with one FMA and one ``ex2`` per score and no per-tile conversion.

Then two kernels:

* ``dK, dV``: one program per (key block, **kv** head, batch). It holds its ``K_blk, V_blk`` (in
  shared memory) and fp32 ``dK_blk, dV_blk`` (in registers) and runs one loop over the query heads of
  its group and, for each, the query blocks that see its keys (for causal/window,
  ``[n0 - diag, n1 - diag + W)``; the others are skipped; only the blocks at the diagonal and the
  window's edge build a mask). So the GQA sum over a group happens inside one program, in a fixed
  order: no atomics and no buffer of repeated K/V gradients. Every product is computed transposed
  (keys x queries), so that the key block is the M side of each warp-group MMA on Hopper.
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
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..cross_entropy import softcap_logits
from .tiles import _LOG2E, _block_list, _diagonal, _key_range, _query_range, _sequence

__all__ = [
    "flash_attention_backward_dkdv_kernel",
    "flash_attention_backward_dq_kernel",
    "flash_attention_backward_preprocess_kernel",
]


@triton.jit
def flash_attention_backward_preprocess_kernel(
    out_ptr, do_ptr, dlse_ptr, delta_ptr,           # delta = rowsum(dO * O) - dlse, float32
    lse_ptr, lse2_ptr,                              # lse in, lse2 out (base 2, see below): delta's layout
    sinks_ptr, dsink_ptr, stride_sink,              # HAS_SINKS: each row's -P_sink * delta, delta's layout
    n_rows, n_heads, head_dim,                      # rows of (B, Hq, T) flattened in (b, h, t) order; Dv
    stride_ob, stride_oh, stride_om, stride_od,     # out and dO as (B, Hq, T, Dv)
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_gb, stride_gh, stride_gm,                # dlse as (B, Hq, T)
    stride_db, stride_dh, stride_dm,                # delta (and lse, dsink) as (B, Hq, T)
    HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``delta`` for ``BLOCK_M`` rows of one (batch, head); grid ``(row blocks, Hq, B)``.

    Also ``lse2 = lse * log2(e)``, the log-sum-exp in base 2 that the dK/dV and dQ loops subtract
    (``P = exp2(S * scale * log2(e) - lse2)``), ``+inf`` for a row that sees no key (``lse = -inf``) so
    that its ``P`` is 0: converted once per row here rather than once per row per tile there.

    ``HAS_SINKS``: also each row's share of the sink's gradient, ``-P_sink * delta`` with
    ``P_sink = exp(sink - lse)`` (the sink's probability: ``lse`` counts the sink), summed over the rows
    afterwards in a fixed order (no atomics)."""
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
    row_offsets = batch * stride_db + head * stride_dh + rows * stride_dm
    tl.store(delta_ptr + row_offsets, delta, mask=row_mask)
    lse = tl.load(lse_ptr + row_offsets, mask=row_mask, other=float("-inf"))
    tl.store(lse2_ptr + row_offsets, tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E), mask=row_mask)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head * stride_sink).to(tl.float32)
        # lse = -inf only with a -inf sink on a row that sees no key: the sink's probability is 0 there.
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp2((sink - lse) * _LOG2E))
        tl.store(dsink_ptr + row_offsets, -p_sink * delta, mask=row_mask)


# ----------------------------------------------------------------------------------------------
# dK, dV: one key block per program, the query blocks (of every query head of its group) streamed
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_ptr, do_ptr, lse2_ptr, delta_ptr, q_offsets, do_offsets, stride_qh, stride_qm, stride_doh,
    stride_dom, stride_lh, stride_lm, heads, offs_n, key_shift, window, d_mask, dv_mask, start, end, full_lo, full_hi,
    seqlen_q, sm_scale, qk_scale, softcap, block_list_ptr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SPARSE: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Add query blocks ``[start, end)`` of ``heads`` q heads (one after the other) into one key block's ``dK, dV``.

    One loop over every (head, block) pair, so that the software pipeline runs across the heads of a GQA
    group without a restart, and nothing is held across an outer loop.

    Computed transposed (keys x queries), so that the key block is the M side of every product (the
    warp-group MMA's 64-row side) and the query block its N side. ``q_ptr``, ``do_ptr``, ``lse2_ptr`` and
    ``delta_ptr`` are scalars at row 0 of the first head, ``q_offsets``/``do_offsets`` the ``BLOCK_M x D`` tile's
    offsets from its first row: no tile of pointers stays live across the loop (registers are what runs out
    here: dK and dV alone take ``2 * BLOCK_N * D / threads`` of them). The masks are formed from the block's
    own offsets: key ``n0 + j`` is seen by query ``m0 + i`` iff ``i + m0 + key_shift >= j`` (causal;
    ``key_shift = diagonal - n0``) and ``i + m0 + key_shift < j + W`` (window). Only blocks outside
    ``[full_lo, full_hi)`` (the diagonal's side, the window's edge) compute them; the loads mask rows past
    ``seqlen_q`` (padding rows load ``lse2 = +inf``: their ``P`` is 0).
    ``BLOCK_SPARSE``: the query blocks of one head come one per step from the int32 list at ``block_list_ptr``
    (``None`` and never read for consecutive blocks).

    The order keeps two score-sized float32 tiles live at most: ``dP - delta`` first, then ``S`` and ``P``
    in place, ``dV += P^T dO`` and ``dS = P * (dP - delta)`` in place.
    """
    offs_m = tl.arange(0, BLOCK_M)
    per_head = tl.cdiv(end - start, BLOCK_M)
    m0 = start
    g = start * 0  # the head of the group, int32: only the address arithmetic below needs int64
    for _ in range(0, heads * per_head):
        if BLOCK_SPARSE:  # the next listed query block
            m0 = tl.load(block_list_ptr) * BLOCK_M
            block_list_ptr += 1
        row0 = m0.to(tl.int64) if INDEX_64 else m0
        head = g.to(tl.int64) if INDEX_64 else g
        row_mask = offs_m < seqlen_q - m0
        q = tl.load(q_ptr + head * stride_qh + row0 * stride_qm + q_offsets,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        do = tl.load(do_ptr + head * stride_doh + row0 * stride_dom + do_offsets,
                     mask=row_mask[:, None] & dv_mask[None, :], other=0.0)
        row_offsets = head * stride_lh + row0 * stride_lm + offs_m * stride_lm
        lse2 = tl.load(lse2_ptr + row_offsets, mask=row_mask, other=float("inf"))
        delta = tl.load(delta_ptr + row_offsets, mask=row_mask, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION) - delta[None, :]  # [BLOCK_N, BLOCK_M]
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        if SOFTCAP:
            capped_t, dcap_t = softcap_logits(qk_t * sm_scale, softcap)
            s_t = capped_t * _LOG2E
            dp_t = dp_t * dcap_t
        else:
            s_t = qk_t * qk_scale
        if CAUSAL or HAS_WINDOW:
            if BLOCK_SPARSE or m0 < full_lo or m0 >= full_hi:
                shift = m0 + key_shift  # query m0 + i against key n0 + j: i + shift against j
                if CAUSAL:
                    visible = offs_m[None, :] + shift >= offs_n[:, None]
                    if HAS_WINDOW:
                        visible = visible & (offs_m[None, :] + shift < offs_n[:, None] + window)
                else:
                    visible = offs_m[None, :] + shift < offs_n[:, None] + window
                s_t = tl.where(visible, s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dk = tl.dot((p_t * dp_t).to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
        if not BLOCK_SPARSE:  # the next block, or the first of the next head
            m0 += BLOCK_M
            next_head = m0 >= end
            g = tl.where(next_head, g + 1, g)
            m0 = tl.where(next_head, start, m0)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "BUCKET_Q", "BUCKET_K"])
def flash_attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr,  # inputs; lse2 (the preprocess's) and delta: one layout
    dk_ptr, dv_ptr,                                   # outputs, (B, Hkv, Tk, D) in k's dtype
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,               # VARLEN: (B + 1,) int32 sequence starts
    block_count_ptr, block_index_ptr,                 # BLOCK_SPARSE: int32 block counts and lists (see the forward)
    stride_cb, stride_ch, stride_cm,
    stride_ib, stride_ih, stride_im,
    stride_qb, stride_qh, stride_qm, stride_qd,       # q as (B, Hq, Tq, D)
    stride_kb, stride_kh, stride_kn, stride_kd,       # k, v as (B, Hkv, Tk, D)
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,   # dO as (B, Hq, Tq, D)
    stride_lb, stride_lh, stride_lm,                  # lse2 and delta as (B, Hq, Tq)
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,   # dk as (B, Hkv, Tk, D), dv as (B, Hkv, Tk, Dv)
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    seqlen_q, seqlen_k, head_dim, head_dim_v, group_size,
    sm_scale, qk_scale, softcap, window,
    BUCKET_Q, BUCKET_K,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr, SAME_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``dK, dV`` of one block of ``BLOCK_N`` keys of one kv head; grid ``(key blocks, Hkv, B)``.

    Sums over the ``group_size`` query heads of the group and, for each, over the query blocks of
    :func:`_query_range`, in a fixed order, in float32 on chip.
    """
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = _sequence(cu_seqlens_q_ptr=cu_seqlens_q_ptr,
                                                     cu_seqlens_k_ptr=cu_seqlens_k_ptr, batch=batch,
                                                     seqlen_q=seqlen_q, seqlen_k=seqlen_k, VARLEN=VARLEN)
    if INDEX_64:
        kv_head = kv_head.to(tl.int64)
        batch = batch.to(tl.int64)
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    n0 = pid_n * BLOCK_N
    if n0 < seqlen_k:  # a varlen program past its sequence's end does nothing
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_m = tl.arange(0, BLOCK_M)
        d_mask = offs_d < head_dim
        if SAME_DV:  # Dv = D: one mask for K and V
            offs_dv = offs_d
            dv_mask = d_mask
        else:
            offs_dv = tl.arange(0, BLOCK_DV)
            dv_mask = offs_dv < head_dim_v
        # Scalar bases and the tile's offsets from them: the same per-thread values serve the loads here
        # and the stores after the loop, and nothing tile-sized is kept across the loop but dK and dV.
        key_mask = offs_n < seqlen_k - n0
        key_row = k_start + n0
        key_offs = offs_n.to(tl.int64) if INDEX_64 else offs_n  # a tile's offsets may pass 2**31 too
        k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + key_row * stride_kn
                    + (key_offs[:, None] * stride_kn + offs_d[None, :] * stride_kd),
                    mask=key_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + key_row * stride_vn
                    + (key_offs[:, None] * stride_vn + offs_dv[None, :] * stride_vd),
                    mask=key_mask[:, None] & dv_mask[None, :], other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        diagonal = _diagonal(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
        lo, full_lo, full_hi, hi = _query_range(n0=n0, n_last=n_last, seqlen_q=seqlen_q, diagonal=diagonal,
                                                window=window, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M)
        query_offs = offs_m.to(tl.int64) if INDEX_64 else offs_m
        q_offsets = query_offs[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_offsets = query_offs[:, None] * stride_dom + offs_dv[None, :] * stride_dod
        first_head = kv_head * group_size
        q_group = q_ptr + batch * stride_qb + first_head * stride_qh + q_start * stride_qm
        do_group = do_ptr + batch * stride_dob + first_head * stride_doh + q_start * stride_dom
        row_base = batch * stride_lb + first_head * stride_lh + q_start * stride_lm
        if BLOCK_SPARSE:  # per head, the query blocks whose mask row allows this key block
            for g in range(0, group_size):
                block_list, n_blocks = _block_list(
                    block_count_ptr=block_count_ptr, block_index_ptr=block_index_ptr, stride_cb=stride_cb,
                    stride_ch=stride_ch, stride_cm=stride_cm, stride_ib=stride_ib, stride_ih=stride_ih,
                    stride_im=stride_im, batch=batch, head=first_head + g, row=pid_n)
                head = g.to(tl.int64) if INDEX_64 else g
                dk, dv = _dkdv_blocks(
                    dk=dk, dv=dv, k=k, v=v, q_ptr=q_group + head * stride_qh, do_ptr=do_group + head * stride_doh,
                    lse2_ptr=lse2_ptr + row_base + head * stride_lh, delta_ptr=delta_ptr + row_base + head * stride_lh,
                    q_offsets=q_offsets, do_offsets=do_offsets, stride_qh=stride_qh, stride_qm=stride_qm,
                    stride_doh=stride_doh, stride_dom=stride_dom, stride_lh=stride_lh, stride_lm=stride_lm, heads=1,
                    offs_n=offs_n, key_shift=diagonal - n0, window=window, d_mask=d_mask, dv_mask=dv_mask, start=0,
                    end=n_blocks * BLOCK_M, full_lo=0, full_hi=0, seqlen_q=seqlen_q, sm_scale=sm_scale,
                    qk_scale=qk_scale, softcap=softcap, block_list_ptr=block_list, CAUSAL=False, HAS_WINDOW=False,
                    SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_SPARSE=True,
                    INDEX_64=INDEX_64)
        else:  # every head of the group over the query blocks that see the key block, masked at the edges only
            dk, dv = _dkdv_blocks(
                dk=dk, dv=dv, k=k, v=v, q_ptr=q_group, do_ptr=do_group, lse2_ptr=lse2_ptr + row_base,
                delta_ptr=delta_ptr + row_base, q_offsets=q_offsets, do_offsets=do_offsets, stride_qh=stride_qh,
                stride_qm=stride_qm, stride_doh=stride_doh, stride_dom=stride_dom, stride_lh=stride_lh,
                stride_lm=stride_lm, heads=group_size, offs_n=offs_n, key_shift=diagonal - n0, window=window,
                d_mask=d_mask, dv_mask=dv_mask, start=lo, end=hi, full_lo=full_lo, full_hi=full_hi,
                seqlen_q=seqlen_q, sm_scale=sm_scale, qk_scale=qk_scale, softcap=softcap, block_list_ptr=None,
                CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION,
                BLOCK_M=BLOCK_M, BLOCK_SPARSE=False, INDEX_64=INDEX_64)
        dk = dk * sm_scale
        tl.store(dk_ptr + batch * stride_dkb + kv_head * stride_dkh + key_row * stride_dkn
                 + (key_offs[:, None] * stride_dkn + offs_d[None, :] * stride_dkd), dk.to(dk_ptr.dtype.element_ty),
                 mask=key_mask[:, None] & d_mask[None, :])
        tl.store(dv_ptr + batch * stride_dvb + kv_head * stride_dvh + key_row * stride_dvn
                 + (key_offs[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd), dv.to(dv_ptr.dtype.element_ty),
                 mask=key_mask[:, None] & dv_mask[None, :])


# ----------------------------------------------------------------------------------------------
# dQ: one query block per program, the forward's key blocks streamed again
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, last_key, first_key, d_mask, dv_mask,
    start, end, seqlen_k, sm_scale, qk_scale, softcap, block_list_ptr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPARSE: tl.constexpr, SAME_DV: tl.constexpr,
):
    """Add key blocks ``[start, end)`` into one query block's ``dQ`` (``P`` and ``dP`` recomputed);
    the arguments are the forward's ``_forward_blocks``'s."""
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
            k_mask = (cols < seqlen_k)[:, None] & d_mask[None, :]
        else:
            k_mask = d_mask[None, :]
        if SAME_DV:
            v_mask = k_mask
        elif MASKED:
            v_mask = (cols < seqlen_k)[:, None] & dv_mask[None, :]
        else:
            v_mask = dv_mask[None, :]
        k = tl.load(k_tile, mask=k_mask, other=0.0)
        v = tl.load(v_tile, mask=v_mask, other=0.0)
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
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr,  # inputs; lse2 (the preprocess's) and delta: one layout
    dq_ptr,                                           # output, (B, Hq, Tq, D) in q's dtype
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,               # VARLEN: (B + 1,) int32 sequence starts
    block_count_ptr, block_index_ptr,                 # BLOCK_SPARSE: int32 block counts and lists (see the forward)
    stride_cb, stride_ch, stride_cm,
    stride_ib, stride_ih, stride_im,
    stride_qb, stride_qh, stride_qm, stride_qd,       # q as (B, Hq, Tq, D)
    stride_kb, stride_kh, stride_kn, stride_kd,       # k, v as (B, Hkv, Tk, D)
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,   # dO as (B, Hq, Tq, D)
    stride_lb, stride_lh, stride_lm,                  # lse2 and delta as (B, Hq, Tq)
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,   # dq as (B, Hq, Tq, D)
    seqlen_q, seqlen_k, head_dim, head_dim_v, group_size,
    sm_scale, qk_scale, softcap, window,
    BUCKET_Q, BUCKET_K,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    INDEX_64: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr, SAME_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``dQ`` of one block of ``BLOCK_M`` queries of one head; grid ``(query blocks, Hq, B)``, the
    forward's key blocks (:func:`_key_range`)."""
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
    if m0 < seqlen_q:
        rows = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        if INDEX_64:
            rows = rows.to(tl.int64)
        d_mask = offs_d < head_dim
        row_mask = rows < seqlen_q
        mask = row_mask[:, None] & d_mask[None, :]
        if SAME_DV:
            offs_dv = offs_d
            dv_mask = d_mask
            do_mask = mask
        else:
            offs_dv = tl.arange(0, BLOCK_DV)
            dv_mask = offs_dv < head_dim_v
            do_mask = row_mask[:, None] & dv_mask[None, :]
        q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + (q_start + rows[:, None]) * stride_qm
                    + offs_d[None, :] * stride_qd, mask=mask, other=0.0)
        do = tl.load(do_ptr + batch * stride_dob + head * stride_doh + (q_start + rows[:, None]) * stride_dom
                     + offs_dv[None, :] * stride_dod, mask=do_mask, other=0.0)
        row_offsets = batch * stride_lb + head * stride_lh + (q_start + rows) * stride_lm
        lse2 = tl.load(lse2_ptr + row_offsets, mask=row_mask, other=float("inf"))  # padding rows: P = 0
        delta = tl.load(delta_ptr + row_offsets, mask=row_mask, other=0.0)
        k_ptrs = (k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
                  + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        v_ptrs = (v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
                  + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd)
        diagonal = _diagonal(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
        lo, full_lo, full_hi, hi = _key_range(m0=m0, m_last=m_last, seqlen_k=seqlen_k, diagonal=diagonal,
                                              window=window, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N,
                                              INDEX_64=INDEX_64)
        last_key = rows + diagonal
        first_key = last_key - window + 1
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if BLOCK_SPARSE:  # the forward's list of key blocks
            block_list, n_blocks = _block_list(
                block_count_ptr=block_count_ptr, block_index_ptr=block_index_ptr, stride_cb=stride_cb,
                stride_ch=stride_ch, stride_cm=stride_cm, stride_ib=stride_ib, stride_ih=stride_ih,
                stride_im=stride_im, batch=batch, head=head, row=pid_m)
            dq = _dq_blocks(
                dq=dq, q=q, do=do, lse2=lse2, delta=delta, k_ptrs=k_ptrs, v_ptrs=v_ptrs, stride_kn=stride_kn,
                stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask, dv_mask=dv_mask,
                start=0, end=n_blocks * BLOCK_N, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=block_list, MASKED=True, CAUSAL=False, HAS_WINDOW=False,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=True,
                SAME_DV=SAME_DV)
        else:  # the forward's three ranges: the window's edge, the blocks every row sees whole, the diagonal
            dq = _dq_blocks(
                dq=dq, q=q, do=do, lse2=lse2, delta=delta, k_ptrs=k_ptrs, v_ptrs=v_ptrs, stride_kn=stride_kn,
                stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask, dv_mask=dv_mask,
                start=lo, end=full_lo, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=None, MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=False,
                SAME_DV=SAME_DV)
            dq = _dq_blocks(
                dq=dq, q=q, do=do, lse2=lse2, delta=delta, k_ptrs=k_ptrs, v_ptrs=v_ptrs, stride_kn=stride_kn,
                stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask, dv_mask=dv_mask,
                start=full_lo, end=full_hi, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=None, MASKED=False, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=False,
                SAME_DV=SAME_DV)
            dq = _dq_blocks(
                dq=dq, q=q, do=do, lse2=lse2, delta=delta, k_ptrs=k_ptrs, v_ptrs=v_ptrs, stride_kn=stride_kn,
                stride_vn=stride_vn, last_key=last_key, first_key=first_key, d_mask=d_mask, dv_mask=dv_mask,
                start=full_hi, end=hi, seqlen_k=seqlen_k, sm_scale=sm_scale, qk_scale=qk_scale,
                softcap=softcap, block_list_ptr=None, MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                SOFTCAP=SOFTCAP, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_SPARSE=False,
                SAME_DV=SAME_DV)
        dq = dq * sm_scale
        tl.store(dq_ptr + batch * stride_dqb + head * stride_dqh + (q_start + rows[:, None]) * stride_dqm
                 + offs_d[None, :] * stride_dqd, dq.to(dq_ptr.dtype.element_ty), mask=mask)
