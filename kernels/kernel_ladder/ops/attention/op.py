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

    The layout of ``torch.nn.functional.scaled_dot_product_attention``; see :mod:`kernel_ladder.ops.attention`
    for the algorithm.

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
            a device-side assertion; see :func:`~kernel_ladder.ops.attention.check_cu_seqlens_values`).
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
