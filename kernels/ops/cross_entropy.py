"""Cross-entropy over large vocabularies, forward and backward, as ``kernels::cross_entropy``.

``loss_i = logsumexp(x_i) - (1 - eps) * x_i[y_i] - (eps / V) * sum_c x_i[c]`` for a row ``x_i`` of
``V`` logits and a target class ``y_i`` — torch's formula, label smoothing ``eps`` included
(``eps = 0`` is the plain negative log-likelihood of the softmax). Rows whose target is
``ignore_index`` contribute nothing; ``"mean"`` divides by the number of the others.

**No softmax is materialized.** Each program walks its rows in chunks of ``BLOCK_COLS`` columns with a
running maximum ``m`` and a running sum of exponentials rescaled to it (``s <- s * exp(m - m') +
sum exp(x - m')``, the online log-sum-exp), so a 128k-word row is read once, in registers, and
only one float per row — the loss — is written. Short rows are stacked ``BLOCK_ROWS`` to a tile.

**The gradient is computed in the forward pass.** ``d loss_i / d x_i[c] = softmax(x_i)[c] - (1 - eps)
[c == y_i] - eps / V`` (times ``1/n_valid`` for ``"mean"``) needs only the row's log-sum-exp, which
the forward has just computed; so when a gradient will be needed (``logits.requires_grad`` and
grad mode on), the forward also writes it, once, into a buffer of the logits' shape and dtype (a
row that fits in one block is still read once; a longer row is read a second time for it, which
a GPU serves largely from L2). The backward then only scales that buffer by ``grad_output`` (per
row for ``"none"``), *in place* (``kernels::cross_entropy_backward``), and skips even that when
the scale is exactly 1, as for ``loss.backward()``. Without a gradient the forward is one pass:
logits read once, targets read, the loss written. Consequences: one backward per loss (a second
one through a retained graph is refused with an error); under ``torch.compile`` the traced
backward scales out of place (a traced graph must not mutate a saved tensor). Checking the
targets (every one in ``[0, V)`` or ``ignore_index``) and counting the non-ignored rows costs one
host synchronization per call.

**Memory.** What torch keeps for ``F.cross_entropy`` forward + backward, per element of the
``N x V`` logits: the log-probabilities (saved for the backward), the gradient of the NLL
(a one-hot ``N x V`` scatter) and the gradient of the log-softmax — three ``N x V`` tensors alive
at the backward's peak. What this op keeps: the gradient buffer (it becomes ``logits.grad``
without a copy) and one float32 per row. Measured with ``utils.memory.peak_memory`` on the CPU
(N = 32, V = 32768, forward + backward, the logits themselves excluded), in bytes:

===================================================  ==========  =========  =====
comparison                                                torch       ours  ratio
===================================================  ==========  =========  =====
fp32 logits, ``F.cross_entropy(logits, y)``          12,582,920  4,194,440  0.333
bf16 logits, ``F.cross_entropy(logits, y)``           6,291,460  2,097,288  0.333
bf16 logits, ``F.cross_entropy(logits.float(), y)``  12,582,920  2,097,288  0.167
===================================================  ==========  =========  =====

That is 12, 6 and 12 bytes per logit for torch against 4, 2 and 2 for this op. So the "at most a
quarter of torch's peak" asked of the GPU at V = 128k holds against the pattern language models
run — bf16 logits upcast to fp32 for the loss, where torch keeps the fp32 log-softmax, its NLL
gradient and the log-softmax gradient (12 bytes per logit) before casting the gradient back —
and not against torch on the same dtype, where the honest ratio is a third.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._rows import RowConfig, plan_rows, row_start
from .._validate import check_choice, check_float_dtype, check_same_device, check_tensor

__all__ = [
    "REDUCTIONS",
    "cross_entropy",
    "cross_entropy_backward_kernel",
    "cross_entropy_forward_kernel",
    "cross_entropy_launch_config",
]

#: The values of ``reduction``, as in ``torch.nn.functional.cross_entropy``.
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")

#: Columns per chunk of a long row (the interpreter takes bigger chunks: fewer Python iterations).
MAX_BLOCK: int = 16384 if runtime.INTERPRETER else 4096
#: Elements a tile aims at: short rows are stacked BLOCK_ROWS high up to this many.
TILE_ELEMENTS: int = 65536 if runtime.INTERPRETER else 4096

_OP = "kernels.cross_entropy"
_FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)  # a finite start for the running max (no inf - inf)


@triton.jit
def cross_entropy_forward_kernel(
    logits_ptr, target_ptr, loss_ptr, grad_ptr,       # x (rows of V logits), targets, losses, gradient
    ignore_index, label_smoothing, grad_scale,
    n_rows, n_cols, size1, size2,                     # rows, V, the merged leading dims
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_t0, stride_t1, stride_t2, stride_tcol,
    stride_o0, stride_o1, stride_o2, stride_ocol,
    stride_g0, stride_g1, stride_g2, stride_gcol,
    COMPUTE_GRAD: tl.constexpr, SMOOTHING: tl.constexpr, CHUNKED: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Loss of BLOCK_ROWS rows (and, with COMPUTE_GRAD, their gradient), by online log-sum-exp.

    ``loss[r] = lse - (1 - eps) x[y] - eps/V sum(x)`` with ``lse = max + log(sum exp(x - max))``
    (0 for ignored rows), written in
    ``loss_ptr``'s dtype. With COMPUTE_GRAD, ``grad[r, c] = grad_scale * (softmax[c] - (1 - eps)
    [c == y] - eps/V)`` (0 for ignored rows), in ``grad_ptr``'s dtype. Unless CHUNKED, the row fits
    in one block, so it is loaded once and kept in registers for both; CHUNKED: a statistics pass
    over chunks, then (only for the gradient) a second pass.
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)
    target = tl.load(target_ptr + row_start(rows, size1, size2, stride_t0, stride_t1, stride_t2), mask=row_mask,
                     other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index)  # ignored rows read no logits at all
    safe_target = tl.where(valid, target, 0)
    x_target = tl.load(logits_ptr + x_row + safe_target * stride_xcol, mask=valid, other=0.0).to(tl.float32)
    cols0 = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols0 = cols0.to(tl.int64)

    if not CHUNKED:
        mask = valid[:, None] & (cols0 < n_cols)[None, :]
        x = tl.load(logits_ptr + x_row[:, None] + (cols0 * stride_xcol)[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        row_max = tl.maximum(tl.max(x, 1), _FLOAT_MIN)
        sum_exp = tl.sum(tl.exp(x - row_max[:, None]), 1)
        if SMOOTHING:
            sum_x = tl.sum(tl.where(mask, x, 0.0), 1)
    else:
        row_max = tl.full([BLOCK_ROWS], _FLOAT_MIN, tl.float32)
        sum_exp = tl.zeros([BLOCK_ROWS], tl.float32)
        sum_x = tl.zeros([BLOCK_ROWS], tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + cols0
            mask = valid[:, None] & (cols < n_cols)[None, :]
            x = tl.load(logits_ptr + x_row[:, None] + (cols * stride_xcol)[None, :], mask=mask,
                        other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, 1))
            # One exp per element: the running sum is rescaled once per chunk, not per element.
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), 1)
            row_max = new_max
            if SMOOTHING:
                sum_x += tl.sum(tl.where(mask, x, 0.0), 1)
    # lse = row_max + log_sum is never formed: at |x| ~ 1e4 its rounding (fp32 spacing 1e-3) would
    # be the loss's error; differences from the max are exact (like torch's log_softmax).
    log_sum = tl.log(tl.where(valid, sum_exp, 1.0))  # ignored rows: nothing summed, unused
    loss = log_sum + (1.0 - label_smoothing) * (row_max - x_target)
    if SMOOTHING:
        loss += label_smoothing * (row_max - sum_x / n_cols)
    loss = tl.where(valid, loss, 0.0)
    loss_offsets = row_start(rows, size1, size2, stride_o0, stride_o1, stride_o2)
    tl.store(loss_ptr + loss_offsets, loss.to(loss_ptr.dtype.element_ty), mask=row_mask)

    if COMPUTE_GRAD:
        g_row = row_start(rows, size1, size2, stride_g0, stride_g1, stride_g2)
        smooth = label_smoothing / n_cols
        if not CHUNKED:
            g = tl.exp((x - row_max[:, None]) - log_sum[:, None]) - smooth
            g = tl.where(cols0[None, :] == safe_target[:, None], g - (1.0 - label_smoothing), g)
            g = tl.where(valid[:, None], g * grad_scale, 0.0)
            tl.store(grad_ptr + g_row[:, None] + (cols0 * stride_gcol)[None, :], g.to(grad_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (cols0 < n_cols)[None, :])
        else:
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + cols0
                col_mask = (cols < n_cols)[None, :]
                x = tl.load(logits_ptr + x_row[:, None] + (cols * stride_xcol)[None, :], mask=valid[:, None] & col_mask,
                            other=0.0).to(tl.float32)
                g = tl.exp((x - row_max[:, None]) - log_sum[:, None]) - smooth
                g = tl.where(cols[None, :] == safe_target[:, None], g - (1.0 - label_smoothing), g)
                g = tl.where(valid[:, None], g * grad_scale, 0.0)
                tl.store(grad_ptr + g_row[:, None] + (cols * stride_gcol)[None, :], g.to(grad_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & col_mask)


@triton.jit
def cross_entropy_backward_kernel(
    grad_ptr, scale_ptr,                              # the gradient (scaled in place), the scales
    n_rows, n_cols, size1, size2,
    stride_g0, stride_g1, stride_g2, stride_gcol,
    stride_s0, stride_s1, stride_s2, stride_scol,
    INDEX_64: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """``grad[r, :] *= scale[r]`` in place for BLOCK_ROWS rows; a tile whose scales are all 1 is left untouched."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    scale = tl.load(scale_ptr + row_start(rows, size1, size2, stride_s0, stride_s1, stride_s2), mask=row_mask,
                    other=1.0).to(tl.float32)
    g_row = row_start(rows, size1, size2, stride_g0, stride_g1, stride_g2)
    cols0 = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols0 = cols0.to(tl.int64)
    if tl.sum((scale != 1.0).to(tl.int32), 0) != 0:  # loss.backward() passes exactly 1: nothing to do
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + cols0
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            offsets = g_row[:, None] + (cols * stride_gcol)[None, :]
            g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
            tl.store(grad_ptr + offsets, (g * scale[:, None]).to(grad_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


def cross_entropy_launch_config(n_rows: int, n_cols: int) -> RowConfig:
    """The tile of a cross-entropy over ``n_rows`` rows of ``n_cols`` classes.

    A row of up to :data:`MAX_BLOCK` columns is one block (loaded once); a longer one is walked in
    chunks of ``MAX_BLOCK``. Short rows are stacked until a tile holds :data:`TILE_ELEMENTS`.
    """
    block = min(next_power_of_2(n_cols), MAX_BLOCK)
    rows = max(1, min(TILE_ELEMENTS // block, next_power_of_2(n_rows)))
    return RowConfig(block_cols=block, block_rows=rows, chunked=n_cols > block,
                     num_warps=_launch.num_warps_for(rows * block), rows_per_program=rows)


# ----------------------------------------------------------------------------------------------
# Shapes and checks
# ----------------------------------------------------------------------------------------------


def _class_last(t: torch.Tensor) -> torch.Tensor:
    """The logits (or a tensor of their shape) as a view with the class dim last and at least one row dim."""
    if t.dim() == 1:
        return t.unsqueeze(0)
    return t.movedim(1, -1) if t.dim() > 2 else t


def _expected_target_shape(logits: torch.Tensor) -> tuple[int, ...]:
    if logits.dim() == 1:
        return ()
    return (logits.shape[0], *logits.shape[2:])


def _check_args(logits: object, target: object, ignore_index: object, reduction: object,
                label_smoothing: object) -> None:
    check_tensor(_OP, "logits", logits)
    check_tensor(_OP, "target", target)
    check_float_dtype(_OP, "logits", logits)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{_OP}: target must be int64 (or int32) class indices, got {target.dtype}"
            + (" (class-probability targets are not supported; pass the class index of each row)"
               if target.is_floating_point() else "")
        )
    check_same_device(_OP, "logits", logits, "target", target)
    if logits.dim() == 0:
        raise ValueError(f"{_OP}: logits must have a class dim: (V,), (N, V) or (N, V, d1, ...), got a 0-d tensor")
    expected = _expected_target_shape(logits)
    if tuple(target.shape) != expected:
        layout = {1: "(V,) logits take a 0-d target", 2: "(N, V) logits take an (N,) target"}.get(
            logits.dim(), "(N, V, d1, ...) logits take an (N, d1, ...) target")
        raise ValueError(
            f"{_OP}: target must have shape {expected} for logits of shape {tuple(logits.shape)} "
            f"({layout}; the class dim is dim 1), got {tuple(target.shape)}"
        )
    n_classes = logits.shape[0] if logits.dim() == 1 else logits.shape[1]
    if n_classes == 0:
        raise ValueError(f"{_OP}: logits must have at least one class, got shape {tuple(logits.shape)}")
    # torch.compile passes a Python int that it has made dynamic as a SymInt.
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{_OP}: ignore_index must be an int, got {type(ignore_index).__name__}")
    check_choice(_OP, "reduction", reduction, REDUCTIONS)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"{_OP}: label_smoothing must be a float in [0, 1], got {type(label_smoothing).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{_OP}: label_smoothing must be in [0, 1], got {float(label_smoothing)}")


def _check_target_values(target: torch.Tensor, n_classes: int, ignore_index: int) -> int:
    """Every target is a class in [0, V) or ignore_index (one host sync); returns the non-ignored count."""
    if target.numel() == 0:
        return 0
    valid = target != ignore_index
    lowest = torch.where(valid, target, 0).min()
    highest = torch.where(valid, target, 0).max()
    low, high, n_valid = torch.stack([lowest.long(), highest.long(), valid.sum()]).tolist()
    if low < 0 or high >= n_classes:
        bad = low if low < 0 else high
        raise ValueError(
            f"{_OP}: target must hold class indices in [0, {n_classes}) or ignore_index={ignore_index}, "
            f"got {bad} (targets range over [{low}, {high}]). Check the labels against the vocabulary size, "
            f"or pass the padding label as ignore_index"
        )
    return n_valid


def _loss_shape(logits: torch.Tensor, reduction: str) -> tuple[int, ...]:
    return _expected_target_shape(logits) if reduction == "none" else ()


def _empty_grad(logits: torch.Tensor, compute_grad: bool) -> torch.Tensor:
    """The gradient buffer: the logits' shape, dtype and (dense) layout; empty without a gradient."""
    if compute_grad:
        return torch.empty_like(logits, memory_format=torch.preserve_format)
    return logits.new_empty((0,))


def _poisonable(t: torch.Tensor) -> torch.Tensor:
    """Identity; tests replace it to fill fresh buffers with NaN."""
    return t





# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _launch_forward(logits, target, loss_rows, grad, ignore_index, label_smoothing, grad_scale) -> None:
    x = _class_last(logits)
    n_classes = x.shape[-1]
    lead = x.shape[:-1]
    t = target.reshape(lead) if target.dim() == 0 else target
    operands = [x, t.unsqueeze(-1).expand(x.shape), loss_rows.view(lead).unsqueeze(-1).expand(x.shape)]
    compute_grad = grad.numel() > 0
    operands.append(_class_last(grad) if compute_grad else x)  # without a gradient: never written
    for launch in plan_rows(operands):
        config = cross_entropy_launch_config(launch.n_rows, n_classes)
        pointers = list(launch.tensors)
        grid = (config.programs(launch.n_rows),)
        cross_entropy_forward_kernel[grid](
            *pointers, ignore_index, float(label_smoothing), float(grad_scale), *launch.args(),
            COMPUTE_GRAD=compute_grad, SMOOTHING=label_smoothing != 0.0, CHUNKED=config.chunked,
            INDEX_64=launch.index_64, BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols,
            num_warps=config.num_warps,
        )


@torch.library.custom_op("kernels::cross_entropy", mutates_args=())
def _cross_entropy_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(logits, target, ignore_index, reduction, label_smoothing)
    runtime.require_launchable(_OP, logits, target)
    x = _class_last(logits)
    n_valid = _check_target_values(target, x.shape[-1], ignore_index)
    n_rows = math.prod(x.shape[:-1])
    if reduction == "none":
        loss_rows = _launch.empty(tuple(target.shape), logits.dtype, logits.device)
    else:
        loss_rows = _launch.empty((n_rows,), torch.float32, logits.device)
    grad = _empty_grad(logits, compute_grad)
    # "mean" divides by the non-ignored rows; with none of them the loss is 0/0 = NaN (like torch)
    # and every row's gradient is 0 (ignored rows write zeros), so the scale is never used.
    grad_scale = 1.0 / n_valid if reduction == "mean" and n_valid > 0 else 1.0
    _launch_forward(logits, target, loss_rows, grad, ignore_index, label_smoothing, grad_scale)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum().to(logits.dtype)
    else:
        loss = (loss_rows.sum() / n_valid).to(logits.dtype)
    return loss, grad


@_cross_entropy_op.register_fake
def _cross_entropy_fake(logits, target, ignore_index, reduction, label_smoothing, compute_grad):
    _check_args(logits, target, ignore_index, reduction, label_smoothing)
    loss = logits.new_empty(_loss_shape(logits, reduction))
    return loss, _empty_grad(logits, compute_grad)


@torch.library.custom_op("kernels::cross_entropy_backward", mutates_args=("grad_logits",))
def _cross_entropy_backward_op(grad_logits: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """Scale the forward's gradient buffer by ``grad_loss`` in place (per row if ``grad_loss`` has rows)."""
    op = f"{_OP} (backward)"
    check_float_dtype(op, "grad_loss", grad_loss)
    check_same_device(op, "grad_logits", grad_logits, "grad_loss", grad_loss)
    runtime.require_launchable(op, grad_logits, grad_loss)
    g = _class_last(grad_logits)
    lead = g.shape[:-1]
    if grad_loss.dim() == 0 or grad_logits.dim() == 1:
        scale = grad_loss.reshape(()).expand(g.shape)
    else:
        scale = grad_loss.unsqueeze(-1).expand(g.shape)
    if tuple(scale.shape[:-1]) != tuple(lead):
        raise ValueError(f"{op}: grad_loss of shape {tuple(grad_loss.shape)} does not match rows {tuple(lead)}")
    for launch in plan_rows([g, scale]):
        config = cross_entropy_launch_config(launch.n_rows, g.shape[-1])
        grid = (config.programs(launch.n_rows),)
        cross_entropy_backward_kernel[grid](
            *launch.tensors, *launch.args(), INDEX_64=launch.index_64, BLOCK_ROWS=config.block_rows,
            BLOCK_COLS=config.block_cols, num_warps=config.num_warps,
        )


@_cross_entropy_backward_op.register_fake
def _cross_entropy_backward_fake(grad_logits, grad_loss) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    *_, compute_grad = inputs
    loss, grad = output
    ctx.compute_grad = compute_grad
    ctx.backward_ran = False
    ctx.save_for_backward(grad)
    ctx.mark_non_differentiable(grad)
    ctx.set_materialize_grads(False)  # no N x V zeros for the buffer's (absent) gradient


def _backward(ctx, grad_loss: torch.Tensor, _grad_of_grad_buffer: torch.Tensor | None):
    if not ctx.compute_grad:
        raise RuntimeError(
            f"{_OP}: the forward ran with compute_grad=False, so no gradient was computed; call "
            "kernels.cross_entropy (it decides from logits.requires_grad and grad mode)"
        )
    if ctx.backward_ran:
        raise RuntimeError(
            f"{_OP}: backward through the same loss twice (retain_graph=True) is not supported: the "
            "gradient computed in the forward is scaled in place by the first backward. Compute the "
            "loss again for each backward"
        )
    ctx.backward_ran = True
    (grad,) = ctx.saved_tensors
    if grad_loss is None:  # the loss took no part in what is being differentiated
        return None, None, None, None, None, None
    if _tracing(grad, grad_loss):
        # A traced backward (torch.compile, AOTAutograd) must not mutate a saved activation: scale
        # out of place, which Inductor can do in the dead buffer's memory.
        g = _class_last(grad)
        scale = grad_loss.reshape(()) if grad_loss.dim() == 0 or grad.dim() == 1 else grad_loss.unsqueeze(-1)
        grad = _unmove(g * scale, grad)
    else:
        _cross_entropy_backward_op(grad, grad_loss)
    return grad, None, None, None, None, None


def _tracing(*tensors: torch.Tensor) -> bool:
    """Whether the backward is being traced (by Dynamo, AOTAutograd or make_fx) rather than run."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 (imported by the tracers already)
    from torch.fx.experimental.proxy_tensor import get_proxy_mode  # noqa: PLC0415

    return get_proxy_mode() is not None or any(is_fake(t) for t in tensors)


def _unmove(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dim() == 1:
        return g.squeeze(0)
    return g.movedim(-1, 1) if like.dim() > 2 else g


_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against class indices, like ``torch.nn.functional.cross_entropy``.

    Args:
        logits: float32, float16 or bfloat16 scores, ``(N, V)``, ``(V,)``, or ``(N, V, d1, ...)``
            with the classes in dim 1 (like torch); any strides (not copied). Vocabularies of any
            size: the softmax is never stored.
        target: int64 (or int32) class indices of shape ``(N,)``, ``()`` or ``(N, d1, ...)``; each a
            class in ``[0, V)`` or ``ignore_index`` (checked, with one host synchronization).
        ignore_index: rows with this target add nothing to the loss or the gradient; ``"mean"``
            averages over the others (all ignored: NaN, like torch).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row losses, of ``target``'s shape).
        label_smoothing: ``eps`` in [0, 1]: the target distribution is ``(1 - eps)`` one-hot plus
            ``eps / V`` everywhere (torch's definition).

    Returns:
        The loss in the logits' dtype (computed in float32). Differentiable with respect to
        ``logits``: when ``logits.requires_grad`` and grad mode is on, the forward also writes the
        gradient (one extra pass), and the backward only scales it by the incoming gradient,
        in place (``kernels::cross_entropy_backward``), so one backward per loss.
    """
    _check_args(logits, target, ignore_index, reduction, label_smoothing)
    compute_grad = bool(logits.requires_grad and torch.is_grad_enabled())
    loss, _ = _cross_entropy_op(logits, target, int(ignore_index), reduction, float(label_smoothing), compute_grad)
    return loss
