"""The custom ops ``kernel_ladder::flash_attention`` and ``kernel_ladder::flash_attention_varlen`` (and their
backward ops), their autograd, and the public :func:`flash_attention` and :func:`flash_attention_varlen`."""

from __future__ import annotations

import torch

from ... import _launch, runtime
from ..._validate import schema_types
from .launch import _backward, _forward
from .problem import (
    _OP,
    _VARLEN_OP,
    _check_dense,
    _check_varlen,
    _dense_problem,
    _scale,
    _varlen_problem,
    check_cu_seqlens_values,
)

__all__ = ["flash_attention", "flash_attention_varlen"]


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _dsinks_output(q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The backward ops' fourth result: the sinks' float32 gradient ``(Hq,)``, or an empty ``(0,)`` without sinks."""
    return _launch.empty_output((0,) if sinks is None else sinks.shape, q, torch.float32)


@torch.library.custom_op("kernel_ladder::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                        window: int | None, softcap: float | None,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``(B, Hq, Tq, Dv)`` in q's dtype, lse ``(B, Hq, Tq)`` float32 (the sink counted)."""
    _check_dense(q, k, v, causal, softmax_scale, window, softcap, False, sinks)
    runtime.require_launchable(_OP, q, k, v, *(() if sinks is None else (sinks,)))
    batch, heads_q, seqlen_q, _ = q.shape
    out = _launch.empty_output((batch, heads_q, seqlen_q, v.shape[-1]), q)
    lse = _launch.empty((batch, heads_q, seqlen_q), torch.float32, q.device)
    _forward(_dense_problem(q, k, causal, softmax_scale, window, softcap, v, sinks), q, k, v, out, lse, lse, lse,
             sinks=sinks)
    return out, lse


@_flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, softmax_scale, window, softcap, sinks=None):
    _check_dense(q, k, v, causal, softmax_scale, window, softcap, False, sinks)
    batch, heads_q, seqlen_q, _ = q.shape
    return (_launch.empty_output((batch, heads_q, seqlen_q, v.shape[-1]), q),
            _launch.empty_output((batch, heads_q, seqlen_q), q, torch.float32))


@torch.library.custom_op("kernel_ladder::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float, window: int | None,
    softcap: float | None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``: new contiguous tensors of q's, k's and v's shapes, and the sinks' float32
    gradient (``(0,)`` without sinks)."""
    runtime.require_launchable(f"{_OP} (backward)", grad_out, q, k, v, out, lse)
    dq, dk, dv = _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)
    dsinks = _backward(_dense_problem(q, k, causal, softmax_scale, window, softcap, v, sinks), grad_out, grad_lse,
                       q, k, v, out, lse, lse, lse, dq, dk, dv, sinks=sinks)
    return dq, dk, dv, _dsinks_output(q, None) if dsinks is None else dsinks


@_flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, causal, softmax_scale, window, softcap,
                                   sinks=None):
    return (_launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v),
            _dsinks_output(q, sinks))


@torch.library.custom_op("kernel_ladder::flash_attention_varlen", mutates_args=())
def _flash_attention_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window: int | None,
    softcap: float | None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``(total_q, Hq, Dv)`` in q's dtype, lse ``(Hq, total_q)`` float32 (the sink counted)."""
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                  softcap, False, sinks)
    runtime.require_launchable(_VARLEN_OP, q, k, v, cu_seqlens_q, cu_seqlens_k, *(() if sinks is None else (sinks,)))
    check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    total_q, heads_q, _ = q.shape
    out = _launch.empty_output((total_q, heads_q, v.shape[-1]), q)
    lse = _launch.empty((heads_q, total_q), torch.float32, q.device)
    problem = _varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap,
                              v, sinks)
    _forward(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks=sinks)
    return out, lse


@_flash_attention_varlen_op.register_fake
def _flash_attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, window, softcap, sinks=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                  softcap, False, sinks)
    total_q, heads_q, _ = q.shape
    return (_launch.empty_output((total_q, heads_q, v.shape[-1]), q),
            _launch.empty_output((heads_q, total_q), q, torch.float32))


@torch.library.custom_op("kernel_ladder::flash_attention_varlen_backward", mutates_args=())
def _flash_attention_varlen_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float, window: int | None,
    softcap: float | None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    runtime.require_launchable(f"{_VARLEN_OP} (backward)", grad_out, q, k, v, out, lse)
    dq, dk, dv = _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)
    problem = _varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap,
                              v, sinks)
    dsinks = _backward(problem, grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv,
                       sinks=sinks)
    return dq, dk, dv, _dsinks_output(q, None) if dsinks is None else dsinks


@_flash_attention_varlen_backward_op.register_fake
def _flash_attention_varlen_backward_fake(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap,
                                          sinks=None):
    return (_launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v),
            _dsinks_output(q, sinks))


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A stride-0 zero of ``t``'s shape: the gradient of an output that took no part in the loss."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def _output_gradients(ctx, grad_out, grad_lse, out):
    if grad_out is None:
        grad_out = _zeros_like(out)
    return grad_out.to(out.dtype), None if grad_lse is None else grad_lse.to(torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    """Saves q, k, v, out, lse and the sinks; ``ctx.rest``: the other inputs, sinks last (None without)."""
    q, k, v, *rest, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.rest = tuple(rest)
    ctx.set_materialize_grads(False)  # no zeros for an output the loss does not use


def _sinks_gradient(dsinks: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor | None:
    return None if sinks is None or not sinks.requires_grad else dsinks.to(sinks.dtype)


def _backward_formula(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return (None,) * (4 + len(ctx.rest))
    q, k, v, out, lse, sinks = ctx.saved_tensors
    grad_out, grad_lse = _output_gradients(ctx, grad_out, grad_lse, out)
    backward = _flash_attention_varlen_backward_op if ctx.varlen else _flash_attention_backward_op
    dq, dk, dv, dsinks = backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.rest, sinks)
    return (dq, dk, dv, *(None,) * len(ctx.rest), _sinks_gradient(dsinks, sinks))


def _dense_setup_context(ctx, inputs, output) -> None:
    ctx.varlen = False
    inputs = (*inputs, None) if len(inputs) == 7 else inputs  # the sinks default to None
    _setup_context(ctx, inputs, output)


def _varlen_setup_context(ctx, inputs, output) -> None:
    ctx.varlen = True
    inputs = (*inputs, None) if len(inputs) == 11 else inputs
    _setup_context(ctx, inputs, output)


_flash_attention_op.register_autograd(_backward_formula, setup_context=_dense_setup_context)
_flash_attention_varlen_op.register_autograd(_backward_formula, setup_context=_varlen_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(scale * q k^T + mask) v`` without the ``Tq x Tk`` matrix (FlashAttention-2).

    The layout of ``torch.nn.functional.scaled_dot_product_attention``; see :mod:`kernel_ladder.ops.attention`
    for the algorithm.

    Args:
        q: float32, float16 or bfloat16 queries ``(B, Hq, Tq, D)``, any strides (a ``(B, T, H, D)``
            projection transposed to ``(B, H, T, D)`` is read in place, never copied). ``D <= 256``,
            any value (non-powers of two are padded in the tile with masks).
        k, v: keys ``(B, Hkv, Tk, D)`` and values ``(B, Hkv, Tk, Dv)``, q's dtype, any strides. ``Hq`` must be a
            multiple of ``Hkv`` (grouped-query / multi-query attention: query head ``h`` uses kv head
            ``h // (Hq // Hkv)``; K and V are not repeated in memory). ``Dv`` (``<= 256``) may differ from
            ``D``: DeepSeek-V3's MLA prefill has ``qk_head_dim = 192`` and ``v_head_dim = 128``.
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
        return_lse: also return the log-sum-exp of each query row's (scaled, capped, masked) scores
            (and of its sink, when given: the log of the softmax's whole denominator).
        sinks: GPT-OSS's attention sinks, ``(Hq,)`` of any float dtype (read in float32): one learned
            logit per query head that joins every row's softmax denominator and nothing else,
            ``out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))`` (its column is dropped, as in
            transformers' ``eager_attention_forward`` for gpt_oss). A row that sees no key gives 0 (and
            ``lse = sink``). Differentiable: ``d sink_h = -sum_rows P_sink * (dO . O - dlse)``.

    Returns:
        ``out``, a new contiguous ``(B, Hq, Tq, Dv)`` tensor of q's dtype (float32 accumulation), or
        ``(out, lse)`` with ``lse`` a ``(B, Hq, Tq)`` float32 tensor of natural-log log-sum-exps.
        Differentiable in q, k, v (and sinks) through both outputs (``kernel_ladder::flash_attention_backward``:
        deterministic, first order only), including a gradient that flows through ``lse`` (merging
        partial attention results); double backward raises an error.
    """
    if not (schema_types(tensors=(q, k, v), optional_tensors=(sinks,), optional_reals=(softmax_scale, softcap),
                         optional_ints=(window,), flags=(causal, return_lse)) and q.dim()):
        _check_dense(q, k, v, causal, softmax_scale, window, softcap, return_lse, sinks)  # the op checks values
    scale = _scale(softmax_scale, q.shape[-1])
    out, lse = _flash_attention_op(q, k, v, causal, scale, None if window is None else int(window),
                                   None if softcap is None else float(softcap), sinks)
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
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths, like flash-attn's ``flash_attn_varlen_func``.

    Args:
        q: queries ``(total_q, Hq, D)``: sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``;
            any strides; float32, float16 or bfloat16, ``D <= 256``.
        k, v: keys ``(total_k, Hkv, D)`` and values ``(total_k, Hkv, Dv)``, packed by ``cu_seqlens_k``;
            ``Hq % Hkv == 0``; ``Dv`` may differ from ``D`` (as in :func:`flash_attention`).
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` on q's device: 0, then the cumulative lengths
            (non-decreasing, the last equal to ``total_q`` / ``total_k``). Sequences of length 0 and
            1 are fine. Checked on the device without a host synchronization (on CUDA a bad value is
            a device-side assertion; see :func:`~kernel_ladder.ops.attention.check_cu_seqlens_values`).
        max_seqlen_q, max_seqlen_k: ints >= every sequence's length (the grid's extent).
        causal, softmax_scale, window, softcap, sinks: as in :func:`flash_attention`, per sequence (causal
            is aligned to the bottom right of each sequence's own ``Tq_b x Tk_b``).
        return_lse: also return the lse, ``(Hq, total_q)`` float32 (flash-attn's varlen layout).

    Returns:
        ``out``, a new contiguous ``(total_q, Hq, Dv)`` tensor of q's dtype, or ``(out, lse)``.
        Differentiable in q, k, v and sinks (``kernel_ladder::flash_attention_varlen_backward``), lse included.
        No FLOPs are spent on padding: every program and loop stops at its sequence's length.
    """
    if not (schema_types(tensors=(q, k, v, cu_seqlens_q, cu_seqlens_k), optional_tensors=(sinks,),
                         ints=(max_seqlen_q, max_seqlen_k), optional_reals=(softmax_scale, softcap),
                         optional_ints=(window,), flags=(causal, return_lse))
            and q.dim()):
        _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                      window, softcap, return_lse, sinks)  # the op checks values
    scale = _scale(softmax_scale, q.shape[-1])
    out, lse = _flash_attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                          int(max_seqlen_k), causal, scale, None if window is None else int(window),
                                          None if softcap is None else float(softcap), sinks)
    return (out, lse) if return_lse else out
