"""The pre-norm residual step ``s = x + residual; y = rms_norm(s)`` in one kernel, as ``kernel_ladder::add_rms_norm``.

A transformer block's ``h = h + attn(...)`` followed by the next sub-layer's RMSNorm reads ``h``
and the update, writes ``h``, then reads ``h`` again to normalize it. Fused, each row is read
once from each input and both outputs are written from registers: 4 tensors' worth of traffic
instead of 5, and one launch instead of two.

**Rounding.** The sum is rounded to the inputs' dtype *first*, stored, and the norm is computed
from that rounded value — exactly what the unfused ``s = x + residual`` (a bf16 tensor) followed
by ``rms_norm(s)`` computes. So the normed output is the norm of the residual stream the model
actually carries forward, and fusing changes no result (an fp32 sum would normalize a value the
next block never sees).

**Backward.** ``s`` feeds both outputs, so ``ds = d(sum) + rms_norm_backward(d(normed))``, and
``dx = dresidual = ds`` (one tensor, returned for both). It reuses
:func:`kernel_ladder.ops.rms_norm.rms_norm_backward_kernel` with its ``HAS_GRAD_SUM`` input, and the saved
``s`` in place of ``x``; ``dweight`` is reduced in two stages like ``rms_norm``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _launch
from .._rows import row_start
from .norm import NormOp, NormProblem, check_norm, check_norm_backward, norm_backward, norm_forward, program_rows
from .rms_norm import backward_options, rms_norm_backward_kernel

__all__ = ["add_rms_norm", "add_rms_norm_kernel"]


@triton.jit
def add_rms_norm_kernel(
    x_ptr, r_ptr, y_ptr, s_ptr, w_ptr, rstd_ptr, eps,
    n_rows, n_cols, size1, size2,                     # rows, their length, the merged leading dims
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_r0, stride_r1, stride_r2, stride_rcol,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    stride_s0, stride_s1, stride_s2, stride_scol,
    stride_w,                                         # the weight's (column) stride
    rows_per_program,                                 # a multiple of BLOCK_ROWS
    HAS_WEIGHT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHUNKED: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """s = round(x + r); y = s * rstd(s) * w — both stored — for this program's rows."""
    pid, row0, n_here, cols = program_rows(n_rows, rows_per_program, BLOCK_COLS, INDEX_64)
    if not CHUNKED:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
    for i in range(0, n_here, BLOCK_ROWS):
        rows = row0 + i + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)[:, None]
        r_row = row_start(rows, size1, size2, stride_r0, stride_r1, stride_r2)[:, None]
        y_row = row_start(rows, size1, size2, stride_y0, stride_y1, stride_y2)[:, None]
        s_row = row_start(rows, size1, size2, stride_s0, stride_s1, stride_s2)[:, None]
        if CHUNKED:
            squares = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_ptr + r_row + c[None, :] * stride_rcol, mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(s_ptr.dtype.element_ty)
                tl.store(s_ptr + s_row + c[None, :] * stride_scol, s, mask=mask)
                s = s.to(tl.float32)
                squares += s * s
            rstd = tl.rsqrt(tl.sum(squares, axis=1) / n_cols + eps)
            tl.debug_barrier()  # the output pass reads back sums other threads stored
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                s = tl.load(s_ptr + s_row + c[None, :] * stride_scol, mask=mask, other=0.0).to(tl.float32)
                y = s * rstd[:, None]
                if HAS_WEIGHT:
                    y = y * tl.load(w_ptr + c * stride_w, mask=c < n_cols, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + y_row + c[None, :] * stride_ycol, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + x_row + cols[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + r_row + cols[None, :] * stride_rcol, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(s_ptr.dtype.element_ty)  # rounded first: the residual stream's value
            tl.store(s_ptr + s_row + cols[None, :] * stride_scol, s, mask=mask)
            s = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(s * s, axis=1) / n_cols + eps)
            y = s * rstd[:, None]
            if HAS_WEIGHT:
                y = y * w[None, :]
            tl.store(y_ptr + y_row + cols[None, :] * stride_ycol, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


_OP = "kernel_ladder.add_rms_norm"


def _forward_options(problem: NormProblem) -> tuple[tuple, dict]:
    return (problem.eps,), dict(HAS_WEIGHT=problem.has_params[0])


ADD_RMS_NORM = NormOp(_OP, inputs=("x", "residual"), params=("weight",), stats=1, forward=add_rms_norm_kernel,
                      backward=rms_norm_backward_kernel, forward_options=_forward_options,
                      backward_options=backward_options, backward_grad_sum=True)


@torch.library.custom_op("kernel_ladder::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_forward(ADD_RMS_NORM, (x, residual), (weight,), eps)


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    (y, s), (rstd,) = check_norm(ADD_RMS_NORM, (x, residual), (weight,), eps).empty_outputs()
    return y, s, rstd


@torch.library.custom_op("kernel_ladder::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward_op(
    grad_normed: torch.Tensor, grad_sum: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None,
    rstd: torch.Tensor, weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    problem = check_norm_backward(ADD_RMS_NORM, (("grad_normed", grad_normed), ("grad_sum", grad_sum)), ("sum", s),
                                  weight, weight_grad)
    return norm_backward(problem, (grad_normed, grad_sum), s, weight, (rstd,))


@_add_rms_norm_backward_op.register_fake
def _add_rms_norm_backward_fake(grad_normed, grad_sum, s, weight, rstd, weight_grad):
    dw_shape = weight.shape if (weight_grad and weight is not None) else (0,)
    return _launch.empty_output(s.shape, s), s.new_empty(dw_shape)


def _add_rms_norm_setup_context(ctx, inputs, output) -> None:
    _, _, weight, _ = inputs
    _, s, rstd = output
    ctx.save_for_backward(s, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_backward(ctx, grad_normed: torch.Tensor, grad_sum: torch.Tensor, _grad_rstd):
    s, weight, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    ds, dw = _add_rms_norm_backward_op(grad_normed, grad_sum, s, weight, rstd, weight_grad)
    # x and residual get the same gradient: one tensor, returned twice (autograd copies if needed).
    return ds, ds, (dw if weight_grad else None), None


_add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps), x + residual)`` in one kernel.

    The sum is rounded to ``x``'s dtype first and normalized from that rounded value, so both
    results equal the unfused ``s = x + residual; rms_norm(s, weight, eps), s``.

    Args:
        x: float32, float16 or bfloat16 tensor of shape ``(..., N)``, any strides (not copied).
        residual: a tensor of ``x``'s shape, dtype and device, any strides.
        weight: ``(N,)`` tensor of ``x``'s dtype and device (any stride), or ``None``.
        eps: added to the mean square; a finite number > 0.

    Returns:
        ``(normed, sum)``: two new contiguous tensors of ``x``'s shape and dtype. Differentiable:
        ``x`` and ``residual`` both get ``d(sum) + `` the gradient through the norm, ``weight`` its
        own (the backward is ``kernel_ladder::add_rms_norm_backward``; the forward saves only the sum
        it returns and ``rstd``, one float32 per row).
    """
    # The schema's types (the op checks values): anything else gets the op's error, not torch's.
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)
            and (weight is None or isinstance(weight, torch.Tensor)) and type(eps) in (float, int)):
        check_norm(ADD_RMS_NORM, (x, residual), (weight,), eps)
    normed, s, _ = _add_rms_norm_op(x, residual, weight, float(eps))
    return normed, s
