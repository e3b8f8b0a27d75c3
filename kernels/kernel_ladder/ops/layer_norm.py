"""LayerNorm, forward and backward, as ``kernel_ladder::layer_norm`` (like ``F.layer_norm``).

Over each row of ``N`` elements (the trailing ``normalized_shape`` dims of ``x``, merged)::

    mean = sum(x) / N    rstd = 1 / sqrt(sum((x - mean)**2) / N + eps)
    xhat = (x - mean) * rstd                y = xhat * w + b

**Forward.** One kernel: a row is loaded once; the mean and then the variance of the centred
values are reduced from registers (two reductions over data already loaded — the centred form
has none of the cancellation of ``E[x^2] - E[x]^2``), and ``y`` is written. It saves ``mean`` and
``rstd``, float32, one each per row.

**Backward.** With ``g = dy * w``: ``xhat_i`` depends on ``x_j`` through ``x_j`` itself, the mean
(``-rstd / N``) and ``rstd`` (``d rstd / d x_j = -rstd**2 xhat_j / N``), so::

    dx_j = rstd * (g_j - sum_i g_i / N - xhat_j * sum_i g_i xhat_i / N)
         = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat            db = sum over rows of dy

``dx`` is two row reductions and one elementwise pass; ``dw`` and ``db`` are reduced in two
stages (per-program float32 partial rows, then :func:`~kernel_ladder.ops.norm.column_sum_kernel`).

Rows longer than the fused limit take a chunked path: the statistics pass combines per-chunk
means and centred sums of squares with Chan et al.'s parallel update (as stable as the fused
form), then the output pass reads the row again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import _launch
from .._rows import load_rows, row_start, store_rows
from .norm import NormOp, NormProblem, check_norm, check_norm_backward, norm_backward, norm_forward, program_rows

__all__ = ["layer_norm", "layer_norm_kernel", "layer_norm_backward_kernel"]


@triton.jit
def layer_norm_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, eps,
    n_rows, n_cols, size1, size2,                     # rows, their length, the merged leading dims
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    stride_w, stride_b,                               # the weight's and bias's strides
    rows_per_program,                                 # a multiple of BLOCK_ROWS
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    CHUNKED: tl.constexpr, INDEX_64: tl.constexpr,
):
    """y = (x - mean) * rstd * w + b for this program's rows, BLOCK_ROWS x BLOCK_COLS at a time."""
    pid, row0, n_here, cols = program_rows(n_rows, rows_per_program, BLOCK_COLS, INDEX_64)
    if not CHUNKED:
        col_mask = cols < n_cols
        if HAS_WEIGHT:  # once per program, shared by all its rows
            w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + cols * stride_b, mask=col_mask, other=0.0).to(tl.float32)
    for i in range(0, n_here, BLOCK_ROWS):
        rows = row0 + i + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)[:, None]
        y_row = row_start(rows, size1, size2, stride_y0, stride_y1, stride_y2)[:, None]
        if CHUNKED:
            # Chan's update: merge each chunk's (count, mean, centred sum of squares) into the row's.
            count = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            m2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                c_mask = c < n_cols
                mask = row_mask[:, None] & c_mask[None, :]
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                n_chunk = tl.minimum(n_cols - start, BLOCK_COLS).to(tl.float32)
                chunk_mean = tl.sum(x, axis=1) / n_chunk
                centred = tl.where(mask, x - chunk_mean[:, None], 0.0)
                chunk_m2 = tl.sum(centred * centred, axis=1)
                total = count + n_chunk
                delta = chunk_mean - mean
                mean += delta * (n_chunk / total)
                m2 += chunk_m2 + delta * delta * (count * n_chunk / total)
                count = total
            rstd = tl.rsqrt(m2 / n_cols + eps)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                c_mask = c < n_cols
                mask = row_mask[:, None] & c_mask[None, :]
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                y = (x - mean[:, None]) * rstd[:, None]
                if HAS_WEIGHT:
                    y = y * tl.load(w_ptr + c * stride_w, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                if HAS_BIAS:
                    y = y + tl.load(b_ptr + c * stride_b, mask=c_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + y_row + c[None, :] * stride_ycol, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + x_row + cols[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=1) / n_cols
            centred = tl.where(mask, x - mean[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
            y = centred * rstd[:, None]
            if HAS_WEIGHT:
                y = y * w[None, :]
            if HAS_BIAS:
                y = y + b[None, :]
            tl.store(y_ptr + y_row + cols[None, :] * stride_ycol, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def layer_norm_backward_kernel(
    dy_ptr, x_ptr, dx_ptr, w_ptr, mean_ptr, rstd_ptr, scratch_ptr, dw_partial_ptr, db_partial_ptr,
    n_rows, n_cols, size1, size2,                     # rows, their length, the merged leading dims
    stride_dy0, stride_dy1, stride_dy2, stride_dycol,
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_dx0, stride_dx1, stride_dx2, stride_dxcol,
    stride_w,                                         # the weight's (column) stride
    rows_per_program,                                 # a multiple of BLOCK_ROWS
    HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHUNKED: tl.constexpr, INDEX_64: tl.constexpr,
):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w; this program's dw/db partial rows.

    The chunked path computes both row means first (into ``scratch``, two float32 per row), then
    walks column chunks, each over all of the program's rows, keeping the chunk's dw/db in registers.
    """
    pid, row0, n_here, cols = program_rows(n_rows, rows_per_program, BLOCK_COLS, INDEX_64)
    if not CHUNKED:
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
        if WEIGHT_GRAD:
            dw = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        if BIAS_GRAD:
            db = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for i in range(0, n_here, BLOCK_ROWS):
            rows = row0 + i + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            dy = load_rows(dy_ptr, rows, cols, mask, size1, size2, stride_dy0, stride_dy1, stride_dy2, stride_dycol)
            x = load_rows(x_ptr, rows, cols, mask, size1, size2, stride_x0, stride_x1, stride_x2, stride_xcol)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy
            if HAS_WEIGHT:
                g = dy * w[None, :]
            mean_g = tl.sum(g, axis=1)[:, None] / n_cols
            mean_gx = tl.sum(g * xhat, axis=1)[:, None] / n_cols
            dx = (g - mean_g - xhat * mean_gx) * rstd
            store_rows(dx_ptr, dx, rows, cols, mask, size1, size2, stride_dx0, stride_dx1, stride_dx2, stride_dxcol)
            if WEIGHT_GRAD:
                dw += dy * xhat
            if BIAS_GRAD:
                db += dy
        if WEIGHT_GRAD:
            tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_mask)
        if BIAS_GRAD:
            tl.store(db_partial_ptr + pid * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)
    else:
        # Pass 1: mean(g) and mean(g * xhat) of each row, kept in scratch (2 float32 per row).
        for i in range(0, n_here, BLOCK_ROWS):
            rows = row0 + i + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            dy_row = row_start(rows, size1, size2, stride_dy0, stride_dy1, stride_dy2)[:, None]
            x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)[:, None]
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            acc_g = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            acc_gx = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_COLS):
                c = start + cols
                mask = row_mask[:, None] & (c < n_cols)[None, :]
                dy = tl.load(dy_ptr + dy_row + c[None, :] * stride_dycol, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + x_row + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
                g = dy
                if HAS_WEIGHT:
                    g = dy * tl.load(w_ptr + c * stride_w, mask=c < n_cols, other=0.0).to(tl.float32)[None, :]
                acc_g += g
                acc_gx += g * tl.where(mask, (x - mean) * rstd, 0.0)
            tl.store(scratch_ptr + 2 * rows, tl.sum(acc_g, axis=1) / n_cols, mask=row_mask)
            tl.store(scratch_ptr + 2 * rows + 1, tl.sum(acc_gx, axis=1) / n_cols, mask=row_mask)
        tl.debug_barrier()  # pass 2 reads scratch values other threads wrote
        # Pass 2: column chunks outside, the program's rows inside: dx, and dw/db in registers.
        for start in range(0, n_cols, BLOCK_COLS):
            c = start + cols
            c_mask = c < n_cols
            if HAS_WEIGHT:
                w = tl.load(w_ptr + c * stride_w, mask=c_mask, other=0.0).to(tl.float32)
            if WEIGHT_GRAD:
                dw = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            if BIAS_GRAD:
                db = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            for i in range(0, n_here, BLOCK_ROWS):
                rows = row0 + i + tl.arange(0, BLOCK_ROWS)
                row_mask = rows < n_rows
                mask = row_mask[:, None] & c_mask[None, :]
                dy = load_rows(dy_ptr, rows, c, mask, size1, size2, stride_dy0, stride_dy1, stride_dy2, stride_dycol)
                x = load_rows(x_ptr, rows, c, mask, size1, size2, stride_x0, stride_x1, stride_x2, stride_xcol)
                mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
                mean_g = tl.load(scratch_ptr + 2 * rows, mask=row_mask, other=0.0)[:, None]
                mean_gx = tl.load(scratch_ptr + 2 * rows + 1, mask=row_mask, other=0.0)[:, None]
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                g = dy
                if HAS_WEIGHT:
                    g = dy * w[None, :]
                dx = (g - mean_g - xhat * mean_gx) * rstd
                store_rows(dx_ptr, dx, rows, c, mask, size1, size2, stride_dx0, stride_dx1, stride_dx2, stride_dxcol)
                if WEIGHT_GRAD:
                    dw += dy * xhat
                if BIAS_GRAD:
                    db += dy
            if WEIGHT_GRAD:
                tl.store(dw_partial_ptr + pid * n_cols + c, tl.sum(dw, axis=0), mask=c_mask)
            if BIAS_GRAD:
                tl.store(db_partial_ptr + pid * n_cols + c, tl.sum(db, axis=0), mask=c_mask)


# ----------------------------------------------------------------------------------------------
# The custom op
# ----------------------------------------------------------------------------------------------

_OP = "kernel_ladder.layer_norm"


def _forward_options(problem: NormProblem) -> tuple[tuple, dict]:
    return (problem.eps,), dict(HAS_WEIGHT=problem.has_params[0], HAS_BIAS=problem.has_params[1])


def _backward_options(problem: NormProblem) -> tuple[tuple, dict]:
    return (), dict(HAS_WEIGHT=problem.has_params[0], WEIGHT_GRAD=problem.weight_grad, BIAS_GRAD=problem.bias_grad)


LAYER_NORM = NormOp(_OP, inputs=("x",), params=("weight", "bias"), stats=2, forward=layer_norm_kernel,
                    backward=layer_norm_backward_kernel, forward_options=_forward_options,
                    backward_options=_backward_options)


@torch.library.custom_op("kernel_ladder::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_forward(LAYER_NORM, (x,), (weight, bias), eps, normalized_shape)


@_layer_norm_op.register_fake
def _layer_norm_fake(x, normalized_shape, weight, bias, eps):
    (y,), (mean, rstd) = check_norm(LAYER_NORM, (x,), (weight, bias), eps, normalized_shape).empty_outputs()
    return y, mean, rstd


@torch.library.custom_op("kernel_ladder::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
    mean: torch.Tensor, rstd: torch.Tensor, weight_grad: bool, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = check_norm_backward(LAYER_NORM, (("grad_out", grad_out),), ("x", x), weight, weight_grad, bias_grad,
                                  normalized_shape=normalized_shape)
    return norm_backward(problem, (grad_out,), x, weight, (mean, rstd))


@_layer_norm_backward_op.register_fake
def _layer_norm_backward_fake(grad_out, x, normalized_shape, weight, mean, rstd, weight_grad, bias_grad):
    shape = tuple(normalized_shape)
    dw = x.new_empty(shape if (weight_grad and weight is not None) else (0,))
    db = x.new_empty(shape if bias_grad else (0,))
    return _launch.empty_output(x.shape, x), dw, db


def _layer_norm_setup_context(ctx, inputs, output) -> None:
    x, normalized_shape, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.normalized_shape = tuple(normalized_shape)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_backward(ctx, grad_out: torch.Tensor, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    bias_grad = ctx.has_bias and ctx.needs_input_grad[3]
    dx, dw, db = _layer_norm_backward_op(grad_out, x, list(ctx.normalized_shape), weight, mean, rstd, weight_grad,
                                         bias_grad)
    return dx, None, (dw if weight_grad else None), (db if bias_grad else None), None


_layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, like ``torch.nn.functional.layer_norm``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the (biased) mean and variance of
    each row of ``prod(normalized_shape)`` elements, computed in float32 and rounded once.

    Args:
        x: float32, float16 or bfloat16 tensor of shape ``(..., *normalized_shape)``, any strides
            (not copied) as long as the normalized dims can be walked with one stride (a
            transposed pair of them cannot: the error says to call ``.contiguous()``).
        normalized_shape: an int or a sequence of ints, the trailing dims to normalize over.
        weight: optional tensor of shape ``normalized_shape`` (``x``'s dtype and device, any strides).
        bias: optional tensor of shape ``normalized_shape``, like ``weight``.
        eps: added to the variance; a finite number > 0.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype. Differentiable in ``x``, ``weight``
        and ``bias`` (the backward is ``kernel_ladder::layer_norm_backward``; the forward saves only
        ``mean`` and ``rstd``, one float32 each per row, besides the inputs).
    """
    if type(normalized_shape) is int:
        shape = [normalized_shape]
    elif type(normalized_shape) in (list, tuple) and all(type(s) is int for s in normalized_shape):
        shape = list(normalized_shape)
    else:
        shape = None
    if shape is None or not (isinstance(x, torch.Tensor) and type(eps) in (float, int)
                             and all(p is None or isinstance(p, torch.Tensor) for p in (weight, bias))):
        # the schema's types (the op checks values): anything else gets the op's error, not torch's
        shape = list(check_norm(LAYER_NORM, (x,), (weight, bias), eps, normalized_shape).normalized_shape)
    return _layer_norm_op(x, shape, weight, bias, float(eps))[0]
