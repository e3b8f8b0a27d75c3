"""The LM head and its loss without the logits: ``kernel_ladder::fused_linear_cross_entropy``.

``loss = cross_entropy(x @ weight.T + bias, target)`` for ``x`` ``(..., H)``, ``weight`` ``(V, H)``
(the LM head, ``nn.Linear``'s layout) and ``target`` ``(...)``, with every option of
:func:`kernel_ladder.cross_entropy` that a language model's loss uses: ``ignore_index``, the three
reductions, label smoothing, class weights (``ce_weight``, torch's ``weight``), Gemma-2's ``softcap``
and PaLM's ``z_loss`` (with ``return_z_loss``, its term alone for logging, as Liger-Kernel returns it).

**Why.** At Llama-3's vocabulary, ``V = 128,256``, the logits of 8192 tokens are 2.1 GB in bf16 —
more than the whole rest of a 1B model's activations — and torch's ``F.cross_entropy(logits.float())``
keeps several fp32 copies of them alive until the backward. Here the rows are processed in
**chunks** of ``chunk_size`` rows, and only one chunk's logits ever exist:

1. ``logits = x[chunk] @ W^T (+ b)`` — a ``(chunk, V)`` buffer in x's dtype (``kernel_ladder.matmul``);
2. the chunk's per-row losses and, over the same buffer, the gradient of the loss with respect
   to those logits — one pass of :func:`kernel_ladder.ops.cross_entropy.cross_entropy_forward_kernel`
   (the online log-sum-exp; the gradient written over the logits it was computed from);
3. ``grad_x[chunk] = G @ W`` and ``grad_W += G^T @ x[chunk]`` (an fp32 accumulator, the matmul's
   ``accumulate`` epilogue), ``grad_b += 1^T G``.

The mean's ``1 / n_valid`` is computed once, on the device, from all the targets before the
first chunk (:func:`kernel_ladder.ops.cross_entropy.launch_targets`), so every chunk's gradient already
carries it and the chunks simply add up. The whole gradient is therefore ready when the forward
returns: the backward only scales it by the incoming ``grad_output`` (in place, skipped when it is
exactly 1, as for ``loss.backward()``). With ``reduction="none"`` a per-row ``grad_output`` can
not be applied to a summed weight gradient, so the forward computes only the losses and the
backward runs the chunks again with the rows scaled.

**Memory.** Beyond the inputs and the gradients themselves, the op holds one ``(chunk, V)``
buffer, one float per row, and the fp32 ``grad_W`` accumulator (``V x H x 4`` bytes; with a
bf16 weight, its cast is the gradient): O(chunk x V) instead of O(N x V). The default chunk makes
the logits buffer about as large as ``x`` (``chunk = N / ceil(V / H)``, a power of two), Liger-
Kernel's rule; :func:`chunk_rows` computes it.

No host synchronization: the target check is a device assertion, the counts live on the device.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton

from .. import _launch, runtime
from .._autograd import recorded_gradient
from .._validate import (
    check_bool,
    check_float_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
    schema_types,
)
from . import cross_entropy as ce
from .matmul import launch_matmul

__all__ = ["MIN_CHUNK_ROWS", "chunk_rows", "fused_linear_cross_entropy"]

_OP = "kernel_ladder.fused_linear_cross_entropy"


#: The smallest default chunk: a matmul tile's rows (64-128 on a GPU). Fewer rows would leave most of
#: every tile's dot products padding and multiply the launches, for a buffer that is small anyway.
MIN_CHUNK_ROWS: int = 64


def chunk_rows(n_rows: int, vocab: int, hidden: int) -> int:
    """The default chunk: ``next_power_of_2(ceil(n_rows / ceil(vocab / hidden)))``, at least
    :data:`MIN_CHUNK_ROWS`, at most ``n_rows``.

    The ``(chunk, V)`` logits buffer is then about the size of ``x`` (``n_rows x hidden``): the
    loss costs no more memory than one more activation of the model (Liger-Kernel's rule).
    """
    if n_rows <= 0:
        return 1
    chunk = triton.next_power_of_2(max(1, math.ceil(n_rows / max(1, math.ceil(vocab / max(1, hidden))))))
    return max(1, min(max(chunk, MIN_CHUNK_ROWS), n_rows))


# ----------------------------------------------------------------------------------------------
# The chunk loop
# ----------------------------------------------------------------------------------------------


def _chunks(x2, target_rows, weight, bias, ce_weight, scales, loss_rows, z_rows, options, chunk, grads,
            row_scale=None):
    """Run every chunk: per-row losses into ``loss_rows`` (and z-loss terms into ``z_rows`` unless None); with
    ``grads`` = (grad_x, grad_w32, grad_b32), the gradients (``row_scale``: a per-row factor of the logits'
    gradient, for reduction="none")."""
    n_rows, _ = x2.shape
    vocab = weight.shape[0]
    ignore_index, label_smoothing, softcap, z_loss = options
    logits = _launch.empty((min(chunk, n_rows), vocab), x2.dtype, x2.device)
    ones = torch.ones((), dtype=x2.dtype, device=x2.device)  # a stride-0 row of ones: bias = 1^T G
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        x_chunk = x2[start:stop]
        z = logits[: stop - start]
        launch_matmul(x_chunk, weight.t(), z, bias=bias)
        # The loss of the chunk's rows and, written over the logits, their gradient.
        ce.launch_forward(z, target_rows[start:stop], ce_weight, scales, loss_rows[start:stop],
                          None if z_rows is None else z_rows[start:stop], z if grads is not None else z[:0],
                          ignore_index, label_smoothing, softcap, z_loss)
        if grads is None:
            continue
        grad_x, grad_w32, grad_b32 = grads
        if row_scale is not None:
            torch.ops.kernel_ladder.cross_entropy_backward(z, row_scale[start:stop].to(torch.float32))
        launch_matmul(z, weight, grad_x[start:stop])
        launch_matmul(z.t(), x_chunk, grad_w32, accumulate=start > 0)
        if grad_b32 is not None:
            launch_matmul(ones.expand(1, stop - start), z, grad_b32.view(1, vocab), accumulate=start > 0)


def _targets_and_scales(target_rows, ce_weight, vocab, ignore_index, reduction, label_smoothing):
    device = target_rows.device
    check = _launch.empty((ce.CHECK_SLOTS,), torch.int64, device)
    scales = _launch.empty((ce.SCALE_SLOTS,), torch.float32, device)
    ce.launch_targets(target_rows, ce_weight, check, scales, vocab, ignore_index, reduction == "mean",
                      class_weight_sum=ce_weight is not None and label_smoothing != 0.0)
    ce.assert_targets(check, vocab, ignore_index)
    return scales


def _new_grads(x2, weight, bias):
    grad_x = _launch.empty_output(x2.shape, x2)
    grad_w32 = _launch.empty(weight.shape, torch.float32, weight.device)
    grad_b32 = _launch.empty((weight.shape[0],), torch.float32, weight.device) if bias is not None else None
    return grad_x, grad_w32, grad_b32


def _finish_grads(grads, x, weight, bias, n_rows):
    """The gradients in the parameters' dtypes and shapes (zeros when there are no rows)."""
    grad_x, grad_w32, grad_b32 = grads
    if n_rows == 0:
        grad_w32.zero_()
        if grad_b32 is not None:
            grad_b32.zero_()
    grad_w = grad_w32 if weight.dtype == torch.float32 else grad_w32.to(weight.dtype)
    grad_b = x.new_empty(0)
    if grad_b32 is not None:
        grad_b = grad_b32 if bias.dtype == torch.float32 else grad_b32.to(bias.dtype)
    return grad_x.view(x.shape), grad_w, grad_b


def _chunk(chunk_size, n_rows: int, weight: torch.Tensor) -> int:
    """The op's ``chunk_size`` (0: the default rule, resolved here on the real sizes) as rows per chunk."""
    return int(chunk_size) if chunk_size else chunk_rows(n_rows, weight.shape[0], weight.shape[1])


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    # torch.compile passes a Python int it has made dynamic (a chunk computed from a shape) as a SymInt.
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                return_z_loss, chunk_size):
    """Every argument, as the public function takes them (the ops pass ``_public_chunk(chunk_size)``)."""
    check_tensor(_OP, "x", x)
    check_tensor(_OP, "weight", weight)
    check_tensor(_OP, "target", target)
    check_float_dtype(_OP, "x", x)
    check_float_dtype(_OP, "weight", weight)
    check_same_dtype(_OP, "x", x, "weight", weight)
    check_same_device(_OP, "x", x, "weight", weight)
    check_same_device(_OP, "x", x, "target", target)
    if x.dim() < 1:
        raise ValueError(f"{_OP}: x must be (..., hidden), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{_OP}: weight must be the LM head's (vocab, hidden) = (V, {x.shape[-1]}) for x of shape "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{_OP}: weight must have at least one row (one class), got shape {tuple(weight.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{_OP}: target must be int64 (or int32) class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{_OP}: target must have x's leading shape {tuple(x.shape[:-1])} (one class per row), "
                         f"got {tuple(target.shape)}")
    if bias is not None:
        check_tensor(_OP, "bias", bias)
        check_same_dtype(_OP, "x", x, "bias", bias)
        check_same_device(_OP, "x", x, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{_OP}: bias must be (vocab,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if ce_weight is not None:
        check_tensor(_OP, "ce_weight", ce_weight)
        check_float_dtype(_OP, "ce_weight", ce_weight)
        check_same_device(_OP, "x", x, "ce_weight", ce_weight)
        if tuple(ce_weight.shape) != (weight.shape[0],):
            raise ValueError(f"{_OP}: ce_weight must hold one weight per class, shape (vocab,) = "
                             f"({weight.shape[0]},), got {tuple(ce_weight.shape)}")
    ce.check_loss_options(_OP, ignore_index, reduction, label_smoothing, softcap, z_loss)
    check_bool(_OP, "return_z_loss", return_z_loss)
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"{_OP}: chunk_size must be None (the default rule) or an int >= 1, got {chunk_size!r}")


def _public_chunk(chunk_size):
    """The op's ``chunk_size`` as the public function's: its 0 (the default rule) is None."""
    return None if type(chunk_size) is int and chunk_size == 0 else chunk_size


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, hidden) without a copy: rows are chunked in this order."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{_OP}: x's leading dims {tuple(x.shape[:-1])} with strides {x.stride()[:-1]} cannot be walked as one "
            "run of rows without a copy; pass x.contiguous() (the op never copies silently)"
        ) from None


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::fused_linear_cross_entropy", mutates_args=())
def _flce_op(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
    softcap: float | None, z_loss: float, return_z_loss: bool, chunk_size: int, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z-loss term, grad_x, grad_weight, grad_bias, anchor)``; the z term empty unless ``return_z_loss``,
    the gradients empty unless ``compute_grad``; ``chunk_size`` 0 for :func:`chunk_rows`."""
    _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                return_z_loss, _public_chunk(chunk_size))
    runtime.require_launchable(_OP, x, weight, target, *([ce_weight] if ce_weight is not None else []))
    x2 = _rows_view(x)
    n_rows, vocab = x2.shape[0], weight.shape[0]
    target_rows = target.reshape(n_rows)
    scales = _targets_and_scales(target_rows, ce_weight, vocab, ignore_index, reduction, label_smoothing)
    loss_rows = _launch.empty((n_rows,), torch.float32, x.device)
    z_rows = _launch.empty((n_rows,), torch.float32, x.device) if return_z_loss else None
    grads = _new_grads(x2, weight, bias) if compute_grad else None
    options = (ignore_index, label_smoothing, softcap, z_loss)
    _chunks(x2, target_rows, weight, bias, ce_weight, scales, loss_rows, z_rows, options,
            _chunk(chunk_size, n_rows, weight), grads)
    if reduction == "none":
        loss = loss_rows.view(target.shape)
        z = z_rows.view(target.shape) if return_z_loss else _launch.empty((0,), torch.float32, x.device)
    else:
        loss = _launch.empty((), torch.float32, x.device)
        z = _launch.empty(() if return_z_loss else (0,), torch.float32, x.device)
        ce.cross_entropy_reduce_kernel[(1,)](loss_rows, z_rows if return_z_loss else loss_rows, scales, loss, z,
                                             n_rows, RETURN_Z=return_z_loss, MEAN=reduction == "mean",
                                             BLOCK=ce.SCAN_BLOCK)
    if grads is not None:
        grad_x, grad_w, grad_b = _finish_grads(grads, x, weight, bias, n_rows)
    else:  # three distinct empty tensors: a custom op's outputs may not alias
        grad_x, grad_w, grad_b = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    return loss, z, grad_x, grad_w, grad_b, _launch.empty((0,), torch.float32, x.device)


@_flce_op.register_fake
def _flce_fake(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
               return_z_loss, chunk_size, compute_grad):
    _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                return_z_loss, _public_chunk(chunk_size))
    loss_shape = tuple(target.shape) if reduction == "none" else ()
    loss = x.new_empty(loss_shape, dtype=torch.float32)
    z = x.new_empty(loss_shape if return_z_loss else (0,), dtype=torch.float32)
    anchor = x.new_empty((0,), dtype=torch.float32)
    if not compute_grad:
        return loss, z, x.new_empty(0), x.new_empty(0), x.new_empty(0), anchor
    grad_b = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return loss, z, x.new_empty(x.shape), weight.new_empty(weight.shape), grad_b, anchor


@torch.library.custom_op("kernel_ladder::fused_linear_cross_entropy_backward", mutates_args=())
def _flce_backward_op(
    grad_loss: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float | None, z_loss: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the chunks again, each row's gradient scaled by its ``grad_loss``."""
    runtime.require_launchable(f"{_OP} (backward)", grad_loss, x, weight)
    x2 = _rows_view(x)
    n_rows, vocab = x2.shape[0], weight.shape[0]
    target_rows = target.reshape(n_rows)
    scales = _targets_and_scales(target_rows, ce_weight, vocab, ignore_index, "none", label_smoothing)
    loss_rows = _launch.empty((n_rows,), torch.float32, x.device)  # recomputed, unused
    grads = _new_grads(x2, weight, bias)
    _chunks(x2, target_rows, weight, bias, ce_weight, scales, loss_rows, None,
            (ignore_index, label_smoothing, softcap, z_loss), _chunk(chunk_size, n_rows, weight), grads,
            row_scale=grad_loss.reshape(n_rows))
    return _finish_grads(grads, x, weight, bias, n_rows)


@_flce_backward_op.register_fake
def _flce_backward_fake(grad_loss, x, weight, target, bias, ce_weight, ignore_index, label_smoothing, softcap, z_loss,
                        chunk_size):
    grad_b = bias.new_empty(bias.shape) if bias is not None else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), grad_b


#: The op's inputs: x, weight, target, bias, then these (none of them differentiable).
_OPTIONS = ("ce_weight", "ignore_index", "reduction", "label_smoothing", "softcap", "z_loss", "return_z_loss",
            "chunk_size", "compute_grad")


def _setup_context(ctx, inputs, output) -> None:
    x, weight, target, bias = inputs[:4]
    options = dict(zip(_OPTIONS, inputs[4:]))
    _, z, grad_x, grad_w, grad_b, anchor = output
    ctx.options = tuple(options[k] for k in ("ignore_index", "label_smoothing", "softcap", "z_loss", "chunk_size"))
    ctx.reduction, ctx.compute_grad, ctx.has_bias = options["reduction"], options["compute_grad"], bias is not None
    ctx.backward_ran = False
    ctx.save_for_backward(x, weight, target, bias, options["ce_weight"], grad_x, grad_w, grad_b, anchor)
    # z is for logging (its gradient is already in the loss's, as in Liger-Kernel); not the anchor: it links
    # recorded gradients here
    ctx.mark_non_differentiable(z, grad_x, grad_w, grad_b)
    ctx.set_materialize_grads(False)


def _scaled(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """``grad * grad_loss`` (a 0-d factor): in place, skipped when the factor is 1, unless traced."""
    if grad.numel() == 0:
        return grad
    if ce.tracing(grad, grad_loss):  # a traced graph must not mutate a saved tensor
        return grad * grad_loss.to(grad.dtype)
    with torch.no_grad():
        torch.ops.kernel_ladder.cross_entropy_backward(grad.view(1, -1), grad_loss)
    return grad


def _backward(ctx, grad_loss, *_unused):
    none = (None,) * len(_OPTIONS)
    if ctx.reduction != "none" and ctx.backward_ran:  # before saved_tensors: they were scaled in place
        raise RuntimeError(f"{_OP}: backward through the same loss twice (retain_graph=True) is not supported: "
                           "the gradients computed in the forward are scaled in place. Compute the loss again")
    x, weight, target, bias, ce_weight, grad_x, grad_w, grad_b, anchor = ctx.saved_tensors
    if grad_loss is None:
        return None, None, None, None, *none
    if ctx.reduction == "none":
        ignore_index, label_smoothing, softcap, z_loss, chunk_size = ctx.options
        grad_x, grad_w, grad_b = _flce_backward_op(grad_loss, x, weight, target, bias, ce_weight, ignore_index,
                                                   label_smoothing, softcap, z_loss, chunk_size)
    else:
        if not ctx.compute_grad:
            raise RuntimeError(f"{_OP}: the forward ran without a gradient; call "
                               "kernel_ladder.fused_linear_cross_entropy (it decides from requires_grad and grad mode)")
        ctx.backward_ran = True
        grad_x, grad_w, grad_b = (_scaled(g, grad_loss.reshape(())) for g in (grad_x, grad_w, grad_b))
    if torch.is_grad_enabled():  # create_graph=True: usable, but a gradient of it raises the op's error
        name = f"{_OP} (backward)"
        grad_x, grad_w = (recorded_gradient(name, g, anchor, grad_loss) for g in (grad_x, grad_w))
        if ctx.has_bias:
            grad_b = recorded_gradient(name, grad_b, anchor, grad_loss)
    return grad_x, grad_w, None, (grad_b if ctx.has_bias else None), *none


_flce_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    ce_weight: torch.Tensor | None = None,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(x @ weight.T + bias, target)`` without ever materializing the ``(N, V)`` logits.

    Args:
        x: float32, float16 or bfloat16 hidden states ``(..., H)`` whose leading dims can be walked
            as one run of rows (a contiguous or row-sliced tensor; else pass ``x.contiguous()``).
        weight: the LM head, ``(V, H)``, x's dtype and device.
        target: int64/int32 class indices of x's leading shape, each in ``[0, V)`` or ``ignore_index``.
        bias: ``(V,)`` or None.
        ignore_index, reduction, label_smoothing, softcap, z_loss: as :func:`kernel_ladder.cross_entropy`
            (``softcap``: Gemma-2's ``softcap * tanh(z / softcap)`` of the logits; ``z_loss``: PaLM's
            ``z_loss * mean(logsumexp**2)``).
        chunk_size: rows per chunk; None for :func:`chunk_rows` (the logits buffer about x's size),
            computed inside the op from the real sizes (so a dynamic shape under ``torch.compile`` never
            turns it into a symbolic expression).
        ce_weight: per-class weights ``(V,)``, torch's ``cross_entropy(weight=...)`` (any float dtype, not
            differentiable): row ``i``'s loss is scaled by ``ce_weight[target_i]`` (the smoothing term by each
            class's weight), and ``"mean"`` divides by the sum of the non-ignored rows' target weights. The
            z-loss is not weighted (its ``"mean"`` divides by the number of non-ignored rows).
        return_z_loss: also return the z-loss term alone, ``z_loss * logsumexp**2`` reduced like the loss
            (``"mean"``: summed over the non-ignored rows and divided by their count) — Liger-Kernel's
            definition (``LigerFusedLinearCrossEntropyLoss(return_z_loss=True)``, whose ``lse_square_scale``
            is this ``z_loss``). For logging: not differentiable (its gradient is already in the loss's).

    Returns:
        The loss (0-d, or x's leading shape for ``"none"``) in float32, whatever x's dtype: the
        logits never exist in a dtype of their own, and a loss rounded to bf16 keeps under three
        significant digits (what Hugging Face's models get by upcasting the logits first). With
        ``return_z_loss``, ``(loss, z_loss_term)``, both float32.
        Differentiable in x, weight and bias: for "mean" and "sum" the gradients are computed in the
        forward (one backward per loss); for "none" the backward recomputes the chunks.
    """
    if not schema_types(tensors=(x, weight, target), optional_tensors=(bias, ce_weight),
                        reals=(label_smoothing, z_loss), optional_reals=(softcap,), ints=(ignore_index,),
                        optional_ints=(chunk_size,),
                        flags=(return_z_loss,), strings=(reduction,)) or (chunk_size is not None and chunk_size < 1):
        _check_args(x, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                    return_z_loss, chunk_size)  # else the op checks values (its 0 is the default chunk)
    if ce_weight is not None and ce_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{_OP}: ce_weight is not differentiable (as torch's cross_entropy weight); pass "
                         "ce_weight.detach()")
    needs = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    compute_grad = needs and reduction != "none"
    loss, z, *_ = _flce_op(x, weight, target, bias, ce_weight, int(ignore_index), reduction, float(label_smoothing),
                           None if softcap is None else float(softcap), float(z_loss), bool(return_z_loss),
                           0 if chunk_size is None else chunk_size, compute_grad)
    return (loss, z) if return_z_loss else loss
