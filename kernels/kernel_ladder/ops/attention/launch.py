"""From a planned :class:`~.problem._Problem` to the kernel launches (inputs validated already).

:func:`_forward` launches the forward kernel; :func:`_backward` the preprocess (``delta``), then dK/dV and
dQ. Both take the block-sparse lists (:class:`~.problem.BlockLists`) of
``kernel_ladder.block_sparse_attention``, which runs the same kernels with their ``BLOCK_SPARSE`` switch.
"""

from __future__ import annotations

import torch
import triton

from ... import _launch
from ..._launch import next_power_of_2
from .backward import flash_attention_backward_preprocess_kernel
from .configs import _launch_kernel
from .problem import BlockLists, _block_d, _index_64, _no_block_lists, _Problem


def _sink_args(sinks: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """The sinks' pointer and stride (a dummy, never read, without sinks)."""
    return (dummy, 0) if sinks is None else (sinks, sinks.stride(0))


def _forward(problem: _Problem, q, k, v, out, lse, cu_q, cu_k, blocks: BlockLists | None = None,
             sinks: torch.Tensor | None = None) -> None:
    """``blocks``: block-sparse, over each query block's listed key blocks (:class:`BlockLists`); ``sinks``:
    ``(Hq,)`` logits that join each row's softmax denominator (``problem.sinks``)."""
    if out.numel() == 0 or problem.batch == 0:
        return
    args = (q, k, v, out, lse, *_sink_args(sinks, lse), cu_q, cu_k,
            *(_no_block_lists(lse) if blocks is None else blocks.args()),
            *problem.strides4(q), *problem.strides4(k), *problem.strides4(v),
            *problem.strides4(out), *problem.strides3(lse), *problem.scalars())
    constexprs = problem.constexprs(q.dtype, q, k, v, out, lse)
    constexprs["BLOCK_SPARSE"] = blocks is not None
    _launch_kernel("forward", lambda bm, bn: (triton.cdiv(problem.seqlen_q, bm), problem.heads_q, problem.batch),
                   args, constexprs, None if blocks is None else blocks.config)


def _preprocess(problem: _Problem, out, grad_out, grad_lse, delta, lse, lse2, sinks=None, dsink_rows=None) -> None:
    """delta = rowsum(dO * O) - dlse, lse2 = lse in base 2 (+inf for a row that sees no key), and, with sinks,
    each row's -P_sink * delta into ``dsink_rows``, all laid out as ``delta``; a varlen problem runs as one
    sequence of all the packed rows."""
    if problem.varlen:
        n_rows, batch = out.shape[0], 1
    else:
        n_rows, batch = problem.seqlen_q, problem.batch
    if n_rows == 0 or batch == 0:
        return
    block_d = _block_d(problem.dv)  # out and dO have v's head dim
    block_m = max(16, min(next_power_of_2(n_rows), 8192 // block_d))
    dlse = grad_lse if grad_lse is not None else delta  # without a gradient for lse: never read
    preprocess_index_64 = _index_64(out, grad_out, delta, *([grad_lse] if grad_lse is not None else []))
    flash_attention_backward_preprocess_kernel[(triton.cdiv(n_rows, block_m), problem.heads_q, batch)](
        out, grad_out, dlse, delta, lse, lse2,
        *((delta, delta, 0) if sinks is None else (sinks, dsink_rows, sinks.stride(0))),
        n_rows, problem.heads_q, problem.dv,
        *problem.strides4(out), *problem.strides4(grad_out), *problem.strides3(dlse), *problem.strides3(delta),
        HAS_DLSE=grad_lse is not None, HAS_SINKS=sinks is not None, INDEX_64=preprocess_index_64, BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=4,
    )


def _backward(problem: _Problem, grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv,
              rows: BlockLists | None = None, cols: BlockLists | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """``rows``/``cols``: block-sparse, dQ over each query block's key blocks, dK/dV over each key
    block's query blocks (the transposed lists). With ``sinks``, returns their float32 gradient ``(Hq,)``:
    ``d sink_h = -sum_rows P_sink * delta`` (the rows' terms summed by torch, in a fixed order)."""
    if problem.batch == 0:
        return None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
    delta = _launch.empty(lse.shape, torch.float32, lse.device)
    if lse.stride() != delta.stride():  # the kernels read both with one set of strides (lse is ours: contiguous)
        lse = lse.contiguous()
    lse2 = _launch.empty(lse.shape, torch.float32, lse.device)
    dsink_rows = None if sinks is None else _launch.empty(lse.shape, torch.float32, lse.device)
    _preprocess(problem, out, grad_out, grad_lse, delta, lse, lse2, sinks, dsink_rows)
    tensors = (q, k, v, grad_out, lse2, dq, dk, dv)
    constexprs = problem.constexprs(q.dtype, *tensors)
    del constexprs["HAS_SINKS"]  # the sinks change lse, which dK/dV and dQ read (as lse2) as it is: no switch
    constexprs["BLOCK_SPARSE"] = rows is not None
    common = (*problem.strides4(q), *problem.strides4(k), *problem.strides4(v), *problem.strides4(grad_out),
              *problem.strides3(lse2))
    if dk.numel():
        _launch_kernel(
            "dkdv", lambda bm, bn: (triton.cdiv(problem.seqlen_k, bn), problem.heads_kv, problem.batch),
            (q, k, v, grad_out, lse2, delta, dk, dv, cu_q, cu_k,
             *(_no_block_lists(lse2) if cols is None else cols.args()), *common, *problem.strides4(dk),
             *problem.strides4(dv), *problem.scalars()),
            constexprs, None if cols is None else cols.config,
        )
    if dq.numel():
        _launch_kernel(
            "dq", lambda bm, bn: (triton.cdiv(problem.seqlen_q, bm), problem.heads_q, problem.batch),
            (q, k, v, grad_out, lse2, delta, dq, cu_q, cu_k, *(_no_block_lists(lse2) if rows is None else rows.args()),
             *common, *problem.strides4(dq), *problem.scalars()),
            constexprs, None if rows is None else rows.config,
        )
    if sinks is None:
        return None
    # dense (B, Hq, Tq): over the batch and the rows; varlen (Hq, total_q): over the packed rows
    return dsink_rows.sum(1) if problem.varlen else dsink_rows.sum((0, 2))
