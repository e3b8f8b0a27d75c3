"""RMSNorm, forward and backward, as ``kernel_ladder::rms_norm`` (like ``F.rms_norm(x, (N,), weight, eps)``).

Over each row of ``N`` elements (the last dim of ``x``)::

    rstd = 1 / sqrt(mean(x**2) + eps)        xhat = x * rstd        y = xhat * w

**Forward.** One kernel fuses the reduction and the elementwise pass: a row is loaded once,
its mean square reduced in float32 registers, and ``y`` written from the same registers. It saves
only ``rstd`` (float32, one per row) for the backward; ``x`` is the op's input and is kept anyway.

**Backward.** With ``g = dy * w`` (``dy`` the incoming gradient),
``dx_j = g_j rstd + sum_i g_i x_i d(rstd)/dx_j`` and ``d(rstd)/dx_j = -rstd**3 x_j / N``, so::

    dx = rstd * (g - xhat * mean(g * xhat))          dw = sum over rows of dy * xhat

``dx`` is one row reduction and one elementwise pass per row, like the forward. ``dw`` is a sum
over rows, done in two stages (:mod:`kernel_ladder.ops.norm`): each program adds its rows' ``dy * xhat``
into float32 registers and writes one row of a ``(n_programs, N)`` partial buffer, then
:func:`~kernel_ladder.ops.norm.column_sum_kernel` adds the buffer's rows, rounding to the weight's dtype.
No atomics, and the result does not depend on scheduling.

Rows longer than the fused limit take a chunked path in the same kernels (statistics pass, then
output pass, reading the row twice). ``kernel_ladder.add_rms_norm`` reuses the backward kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _launch
from .._autograd import gradient_reusable
from .._rows import load_rows, row_start, store_rows
from .norm import NormOp, NormProblem, check_norm, check_norm_backward, norm_backward, norm_forward, program_rows

__all__ = ["rms_norm", "rms_norm_kernel", "rms_norm_backward_kernel"]


@triton.jit
def rms_norm_kernel(
    x_ptr, y_ptr, w_ptr, rstd_ptr, eps, offset,
    n_rows, n_cols, size1, size2,                     # rows, their length, the merged leading dims
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    stride_w,                                         # the weight's (column) stride
    rows_per_program,                                 # a multiple of BLOCK_ROWS
    HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr, ROUND_BEFORE_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHUNKED: tl.constexpr, INDEX_64: tl.constexpr,
):
    """y = x * rstd * (offset + w) for this program's rows_per_program rows, BLOCK_ROWS x BLOCK_COLS at a time.

    ``ROUND_BEFORE_SCALE`` (``casting="llama"``): ``x * rstd`` is rounded to y's dtype before the
    scale multiplies it; otherwise the product is rounded once, at the store.
    """
    pid, row0, n_here, cols = program_rows(n_rows, rows_per_program, BLOCK_COLS, INDEX_64)
    if not CHUNKED:
        col_mask = cols < n_cols
        if HAS_WEIGHT:  # once per program, shared by all its rows
            w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                w = w + offset
    for i in range(0, n_here, BLOCK_ROWS):
        rows = row0 + i + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)[:, None]
        y_row = row_start(rows, size1, size2, stride_y0, stride_y1, stride_y2)[:, None]
        if CHUNKED:
            squares = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                squares += x * x
            rstd = tl.rsqrt(tl.sum(squares, axis=1) / n_cols + eps)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                y = x * rstd[:, None]
                if ROUND_BEFORE_SCALE:
                    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
                if HAS_WEIGHT:
                    wc = tl.load(w_ptr + c * stride_w, mask=c < n_cols, other=0.0).to(tl.float32)
                    if HAS_OFFSET:
                        wc = wc + offset
                    y = y * wc[None, :]
                tl.store(y_ptr + y_row + c[None, :] * stride_ycol, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + x_row + cols[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
            y = x * rstd[:, None]
            if ROUND_BEFORE_SCALE:  # Llama's order: the normalized value in x's dtype, then the scale
                y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            if HAS_WEIGHT:
                y = y * w[None, :]
            tl.store(y_ptr + y_row + cols[None, :] * stride_ycol, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def rms_norm_backward_kernel(
    dy_ptr, x_ptr, dx_ptr, ds_ptr, w_ptr, rstd_ptr, scratch_ptr, dw_partial_ptr, offset,
    n_rows, n_cols, size1, size2,                     # rows, their length, the merged leading dims
    stride_dy0, stride_dy1, stride_dy2, stride_dycol,
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_dx0, stride_dx1, stride_dx2, stride_dxcol,
    stride_ds0, stride_ds1, stride_ds2, stride_dscol,
    stride_w,                                         # the weight's (column) stride
    rows_per_program,                                 # a multiple of BLOCK_ROWS
    HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_GRAD_SUM: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHUNKED: tl.constexpr, INDEX_64: tl.constexpr,
):
    """dx = rstd * (g - xhat * mean(g * xhat)) [+ ds], g = dy * (offset + w); this program's dw partial row.

    ``dx`` may be ``dy``'s own buffer (the in-place backward): every element of ``dy`` is loaded
    by the program that owns its row before that program stores the element's ``dx`` (the store
    depends on the load), and no program reads another's rows.

    ``ds`` (``HAS_GRAD_SUM``) is the gradient arriving at the normalized tensor from elsewhere:
    ``kernel_ladder.add_rms_norm``'s residual sum. The chunked path computes ``mean(g * xhat)`` of every
    row first (into ``scratch``), then walks column chunks, each over all of the program's rows,
    so that the dw partial of a chunk stays in registers.
    """
    pid, row0, n_here, cols = program_rows(n_rows, rows_per_program, BLOCK_COLS, INDEX_64)
    if not CHUNKED:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                w = w + offset
        if WEIGHT_GRAD:
            dw = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for i in range(0, n_here, BLOCK_ROWS):
            rows = row0 + i + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            dy = load_rows(dy_ptr, rows, cols, mask, size1, size2, stride_dy0, stride_dy1, stride_dy2, stride_dycol)
            x = load_rows(x_ptr, rows, cols, mask, size1, size2, stride_x0, stride_x1, stride_x2, stride_xcol)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            xhat = x * rstd
            g = dy
            if HAS_WEIGHT:
                g = dy * w[None, :]
            mean_gx = tl.sum(g * xhat, axis=1)[:, None] / n_cols
            dx = (g - xhat * mean_gx) * rstd
            if HAS_GRAD_SUM:
                dx += load_rows(ds_ptr, rows, cols, mask, size1, size2,
                                stride_ds0, stride_ds1, stride_ds2, stride_dscol)
            store_rows(dx_ptr, dx, rows, cols, mask, size1, size2, stride_dx0, stride_dx1, stride_dx2, stride_dxcol)
            if WEIGHT_GRAD:
                dw += dy * xhat
        if WEIGHT_GRAD:
            tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_mask)
    else:
        # Pass 1: mean(g * xhat) of each row, kept in scratch (one float32 per row).
        for i in range(0, n_here, BLOCK_ROWS):
            rows = row0 + i + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            dy_row = row_start(rows, size1, size2, stride_dy0, stride_dy1, stride_dy2)[:, None]
            x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                dy = tl.load(dy_ptr + dy_row + c[None, :] * stride_dycol, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                g = dy
                if HAS_WEIGHT:
                    wc = tl.load(w_ptr + c * stride_w, mask=c < n_cols, other=0.0).to(tl.float32)
                    if HAS_OFFSET:
                        wc = wc + offset
                    g = dy * wc[None, :]
                acc += g * x * rstd
            tl.store(scratch_ptr + rows, tl.sum(acc, axis=1) / n_cols, mask=row_mask)
        tl.debug_barrier()  # pass 2 reads scratch values other threads wrote
        # Pass 2: column chunks outside, the program's rows inside: dx, and dw in registers.
        for start in range(0, n_cols, BLOCK_COLS):
            c = start + cols
            c_mask = c < n_cols
            if HAS_WEIGHT:
                w = tl.load(w_ptr + c * stride_w, mask=c_mask, other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    w = w + offset
            if WEIGHT_GRAD:
                dw = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for i in range(0, n_here, BLOCK_ROWS):
                rows = row0 + i + tl.arange(0, BLOCK_ROWS)
                row_mask = rows < n_rows
                mask = row_mask[:, None] & c_mask[None, :]
                dy = load_rows(dy_ptr, rows, c, mask, size1, size2, stride_dy0, stride_dy1, stride_dy2, stride_dycol)
                x = load_rows(x_ptr, rows, c, mask, size1, size2, stride_x0, stride_x1, stride_x2, stride_xcol)
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
                mean_gx = tl.load(scratch_ptr + rows, mask=row_mask, other=0.0)[:, None]
                xhat = x * rstd
                g = dy
                if HAS_WEIGHT:
                    g = dy * w[None, :]
                dx = (g - xhat * mean_gx) * rstd
                if HAS_GRAD_SUM:
                    dx += load_rows(ds_ptr, rows, c, mask, size1, size2,
                                    stride_ds0, stride_ds1, stride_ds2, stride_dscol)
                store_rows(dx_ptr, dx, rows, c, mask, size1, size2, stride_dx0, stride_dx1, stride_dx2, stride_dxcol)
                if WEIGHT_GRAD:
                    dw += dy * xhat
            if WEIGHT_GRAD:
                tl.store(dw_partial_ptr + pid * n_cols + c, tl.sum(dw, axis=0), mask=c_mask)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------

_OP = "kernel_ladder.rms_norm"


def _forward_options(problem: NormProblem) -> tuple[tuple, dict]:
    return (problem.eps, problem.offset), dict(HAS_WEIGHT=problem.has_params[0], HAS_OFFSET=problem.offset != 0.0,
                                               ROUND_BEFORE_SCALE=problem.round_before_scale)


def backward_options(problem: NormProblem) -> tuple[tuple, dict]:
    """:func:`rms_norm_backward_kernel`'s scalars and constexprs (shared with ``kernel_ladder.add_rms_norm``)."""
    return (problem.offset,), dict(HAS_WEIGHT=problem.has_params[0], HAS_OFFSET=problem.offset != 0.0,
                                   HAS_GRAD_SUM=problem.grad_sum, WEIGHT_GRAD=problem.weight_grad)


RMS_NORM = NormOp(_OP, inputs=("x",), params=("weight",), stats=1, forward=rms_norm_kernel,
                  backward=rms_norm_backward_kernel, forward_options=_forward_options,
                  backward_options=backward_options, backward_grad_sum=True)


@torch.library.custom_op("kernel_ladder::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0, casting: str = "none",
    in_place_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_forward(RMS_NORM, (x,), (weight,), eps, offset=offset, casting=casting,
                        in_place_backward=in_place_backward)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, offset=0.0, casting="none", in_place_backward=False):
    (y,), (rstd,) = check_norm(RMS_NORM, (x,), (weight,), eps, offset=offset, casting=casting,
                               in_place_backward=in_place_backward).empty_outputs()
    return y, rstd


def _backward(grad_out, x, weight, rstd, weight_grad, offset, dx=None):
    problem = check_norm_backward(RMS_NORM, (("grad_out", grad_out),), ("x", x), weight, weight_grad, offset=offset,
                                  in_place=dx is not None)
    return norm_backward(problem, (grad_out,), x, weight, (rstd,), dx)


@torch.library.custom_op("kernel_ladder::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, weight_grad: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad_out, x, weight, rstd, weight_grad, offset)


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(grad_out, x, weight, rstd, weight_grad, offset=0.0):
    dw_shape = weight.shape if (weight_grad and weight is not None) else (0,)
    return _launch.empty_output(x.shape, x), x.new_empty(dw_shape)


@torch.library.custom_op("kernel_ladder::rms_norm_backward_inplace", mutates_args=("grad_out",))
def _rms_norm_backward_inplace_op(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, weight_grad: bool,
    offset: float = 0.0,
) -> torch.Tensor:
    """The backward writing ``dx`` over ``grad_out`` (contiguous); returns ``dw`` (empty unless ``weight_grad``)."""
    return _backward(grad_out, x, weight, rstd, weight_grad, offset, dx=grad_out)[1]


@_rms_norm_backward_inplace_op.register_fake
def _rms_norm_backward_inplace_fake(grad_out, x, weight, rstd, weight_grad, offset=0.0):
    return x.new_empty(weight.shape if (weight_grad and weight is not None) else (0,))


def _rms_norm_setup_context(ctx, inputs, output) -> None:
    x, weight, _, offset, _, in_place_backward = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.in_place_backward = in_place_backward
    ctx.mark_non_differentiable(rstd)


def _rms_norm_backward(ctx, grad_out: torch.Tensor, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    if ctx.in_place_backward and gradient_reusable(grad_out):
        dw = _rms_norm_backward_inplace_op(grad_out, x, weight, rstd, weight_grad, ctx.offset)
        dx = grad_out  # now holds dx
    else:
        dx, dw = _rms_norm_backward_op(grad_out, x, weight, rstd, weight_grad, ctx.offset)
    return dx, (dw if weight_grad else None), None, None, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "none",
    in_place_backward: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x``, like ``torch.nn.functional.rms_norm(x, (N,), weight, eps)``.

    ``y = x / sqrt(mean(x**2, -1) + eps) * (offset + weight)``; ``rstd`` is computed in float32.

    Args:
        x: float32, float16 or bfloat16 tensor of shape ``(..., N)``, any strides (not copied).
        weight: ``(N,)`` tensor of ``x``'s dtype and device (any stride), or ``None`` for no scale.
        eps: added to the mean square; a finite number > 0.
        offset: added to the weight, in float32: Gemma stores ``w`` and scales by ``1 + w``
            (``offset=1.0``). Must be 0 without a weight.
        casting: the order of roundings (they differ only for fp16/bf16), named after the Hugging
            Face modules whose numerics each one reproduces:

            * ``"none"`` (default): everything in float32, rounded once at the end — the most
              accurate, and ``F.rms_norm``'s result.
            * ``"llama"``: ``LlamaRMSNorm``: ``x * rstd`` in float32 is rounded to ``x``'s dtype,
              then multiplied by the weight in that dtype (``weight * h.to(input_dtype)``): two
              roundings.
            * ``"gemma"``: ``GemmaRMSNorm``: everything in float32, ``* (1 + w.float())``,
              rounded once — the same computation as ``"none"`` (kernel_ladder's ``"none"`` is already
              float32 throughout; the name is there so that a Gemma patch says what it means).

            Given the same float32 ``rstd`` the output equals the Hugging Face module's bit for bit
            (``tests/test_kernels_norm.py`` checks it). ``rstd`` itself is a float32 reduction
            whose last bit depends on the order of the sum, which no two implementations share;
            on random inputs that changes about 1 output element in 10**5 by one bf16 step.
        in_place_backward: write ``dx`` into the incoming gradient's buffer instead of a new
            one, saving an allocation of ``x``'s size during the backward (peak memory). Only
            when nothing else uses that gradient: see :func:`kernel_ladder._autograd.gradient_reusable`
            and the module docstring for what goes wrong otherwise. Off by default.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype. Differentiable in ``x`` and
        ``weight`` (the backward is ``kernel_ladder::rms_norm_backward``, or with ``in_place_backward``
        ``kernel_ladder::rms_norm_backward_inplace``; it saves only ``rstd``, one float32 per row,
        besides the inputs). The backward is the same for every casting mode: the gradient of
        ``x * rstd * (offset + w)`` computed in float32 and rounded once.
    """
    # The schema's types (the op checks values): anything else gets the op's error, not torch's.
    if not (isinstance(x, torch.Tensor) and (weight is None or isinstance(weight, torch.Tensor))
            and type(eps) in (float, int) and type(offset) in (float, int) and type(casting) is str
            and type(in_place_backward) is bool):
        check_norm(RMS_NORM, (x,), (weight,), eps, offset=offset, casting=casting, in_place_backward=in_place_backward)
    return _rms_norm_op(x, weight, float(eps), float(offset), casting, in_place_backward)[0]
