"""Elementwise addition with torch's broadcasting, as ``kernel_ladder::add``.

Broadcasting costs no memory: a broadcast operand becomes a stride-0 view (``expand``), and the
strided launch reads it through those strides, so ``x + bias`` reads the bias row once per output
row from cache instead of materializing a full-size copy. Dtypes promote by torch's rule
(``torch.result_type``: fp16 + fp32 is fp32, but a 0-d tensor or a Python number does not promote
a tensor with dims, so ``bf16 + 0-d fp32`` stays bf16); each operand is loaded in its own dtype,
the sum computed in float32 and rounded once to the result dtype, as torch does for fp16 and bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import (
    check_broadcastable,
    check_float_dtype,
    check_same_device,
    check_tensor,
    schema_types,
)

__all__ = ["add", "add_kernel"]


@triton.jit
def add_kernel(
    x_ptr, y_ptr, out_ptr,                            # inputs (any strides, 0 where broadcast), output
    n_elements, size1, size2, size3,                  # the coalesced iteration space
    stride_x0, stride_x1, stride_x2, stride_x3,
    stride_y0, stride_y1, stride_y2, stride_y3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = x[idx] + y[idx]; out is contiguous, x and y any strides (0 where broadcast)."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    x_offset = operand_offset(idx, size1, size2, size3, stride_x0, stride_x1, stride_x2, stride_x3, CONTIGUOUS)
    y_offset = operand_offset(idx, size1, size2, size3, stride_y0, stride_y1, stride_y2, stride_y3, CONTIGUOUS)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + y_offset, mask=mask).to(tl.float32)
    tl.store(out_ptr + idx, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def _check_add_args(x: object, y: object) -> torch.Size:
    op = "kernel_ladder.add"
    check_tensor(op, "x", x)
    check_tensor(op, "y", y)
    check_float_dtype(op, "x", x)
    check_float_dtype(op, "y", y)
    check_same_device(op, "x", x, "y", y)
    return check_broadcastable(op, "x", x, "y", y)


@torch.library.custom_op("kernel_ladder::add", mutates_args=())
def _add_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    shape = _check_add_args(x, y)
    runtime.require_launchable("kernel_ladder.add", x, y)
    # Mixed dtypes promote like torch (torch.result_type: 0-d tensors do not promote dims); each
    # input is loaded in its own dtype.
    out = _launch.empty_output(shape, x, torch.result_type(x, y))
    # expand() makes stride-0 views: broadcasting without copies.
    launch_elementwise(add_kernel, shape, [x.expand(shape), y.expand(shape)], [out])
    return out


@_add_op.register_fake
def _add_fake(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _launch.empty_output(_check_add_args(x, y), x, torch.result_type(x, y))


def _add_setup_context(ctx, inputs, output) -> None:
    x, y = inputs
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.y_shape, ctx.y_dtype = y.shape, y.dtype


def _grad_for(grad_out: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    # A broadcast input receives the sum of the gradient over the dims it was broadcast along,
    # in its own dtype (a promoted fp16 input gets an fp16 gradient, as in torch).
    grad = grad_out if grad_out.shape == shape else grad_out.sum_to_size(shape)
    return grad if grad.dtype == dtype else grad.to(dtype)


def _add_backward(ctx, grad_out: torch.Tensor):
    return _grad_for(grad_out, ctx.x_shape, ctx.x_dtype), _grad_for(grad_out, ctx.y_shape, ctx.y_dtype)


_add_op.register_autograd(_add_backward, setup_context=_add_setup_context)


def add(x: torch.Tensor | float, y: torch.Tensor | float) -> torch.Tensor:
    """``x + y`` with torch's broadcasting and type promotion, in one Triton kernel.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (not copied), or a
            Python number (then ``y`` must be a tensor).
        y: a tensor on ``x``'s device whose shape broadcasts with ``x``'s, or a Python number.
            A number takes the tensor's dtype, as in torch (``x + 1.0`` stays bf16).

    Returns:
        A new contiguous tensor of the broadcast shape in the promoted dtype
        (``torch.result_type``, torch's rule: a 0-d tensor does not promote a tensor with dims),
        computed in float32. Differentiable: each input's gradient
        is summed over the dims it was broadcast along and given in its own dtype.
    """
    x, y = _scalar_to_tensor(x, y), _scalar_to_tensor(y, x)
    if not schema_types(tensors=(x, y)):
        _check_add_args(x, y)  # the op checks values
    return _add_op(x, y)


def _scalar_to_tensor(value: object, other: object) -> object:
    """A Python int/float beside a tensor becomes a 0-d tensor of that tensor's dtype (a stride-0 read)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(other, torch.Tensor):
        # A fill on the device, not torch.tensor's host-to-device copy (refused in CUDA-graph capture).
        return torch.full((), value, dtype=other.dtype, device=other.device)
    return value
