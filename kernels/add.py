"""Elementwise addition with torch's broadcasting, as ``kernels::add``.

Broadcasting costs no memory: a broadcast operand becomes a stride-0 view (``expand``), and the
strided launch reads it through those strides, so ``x + bias`` reads the bias row once per output
row from cache instead of materializing a full-size copy. Both operands must share a dtype (no
type promotion); the sum is computed in float32 and rounded once to the storage dtype, as torch
does for float16 and bfloat16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from ._elementwise import block_indices, empty_output, launch_elementwise, strided_offset, unravel_index
from ._validate import (
    check_broadcastable,
    check_float_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
)

__all__ = ["add", "add_kernel"]


@triton.jit
def add_kernel(
    x_ptr, y_ptr, out_ptr, n_elements,
    size1, size2, size3,
    x_stride0, x_stride1, x_stride2, x_stride3,
    y_stride0, y_stride1, y_stride2, y_stride3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = x[idx] + y[idx]; out is contiguous, x and y any strides (0 where broadcast)."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    if CONTIGUOUS:
        x_offset = idx
        y_offset = idx
    else:
        i0, i1, i2, i3 = unravel_index(idx, size1, size2, size3)
        x_offset = strided_offset(i0, i1, i2, i3, x_stride0, x_stride1, x_stride2, x_stride3)
        y_offset = strided_offset(i0, i1, i2, i3, y_stride0, y_stride1, y_stride2, y_stride3)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + y_offset, mask=mask).to(tl.float32)
    tl.store(out_ptr + idx, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def _check_add_args(x: object, y: object) -> torch.Size:
    op = "kernels.add"
    check_tensor(op, "x", x)
    check_tensor(op, "y", y)
    check_float_dtype(op, "x", x)
    check_float_dtype(op, "y", y)
    check_same_dtype(op, "x", x, "y", y)
    check_same_device(op, "x", x, "y", y)
    return check_broadcastable(op, "x", x, "y", y)


@torch.library.custom_op("kernels::add", mutates_args=())
def _add_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    shape = _check_add_args(x, y)
    runtime.require_launchable("kernels.add", x, y)
    out = empty_output(shape, x)
    # expand() makes stride-0 views: broadcasting without copies.
    launch_elementwise(add_kernel, shape, [x.expand(shape), y.expand(shape)], [out])
    return out


@_add_op.register_fake
def _add_fake(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return empty_output(_check_add_args(x, y), x)


def _add_setup_context(ctx, inputs, output) -> None:
    x, y = inputs
    ctx.x_shape = x.shape
    ctx.y_shape = y.shape


def _grad_for(grad_out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    # A broadcast input receives the sum of the gradient over the dims it was broadcast along.
    return grad_out if grad_out.shape == shape else grad_out.sum_to_size(shape)


def _add_backward(ctx, grad_out: torch.Tensor):
    return _grad_for(grad_out, ctx.x_shape), _grad_for(grad_out, ctx.y_shape)


_add_op.register_autograd(_add_backward, setup_context=_add_setup_context)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` with torch's broadcasting, in one Triton kernel.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (not copied).
        y: same dtype and device as ``x``; its shape must broadcast with ``x``'s.

    Returns:
        A new contiguous tensor of the broadcast shape, computed in float32 and stored in the
        inputs' dtype. Differentiable (a broadcast input's gradient is summed over the
        broadcast dims).
    """
    _check_add_args(x, y)
    return _add_op(x, y)
