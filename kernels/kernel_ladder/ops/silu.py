"""SiLU (swish), ``x * sigmoid(x)``, forward and backward, as ``kernel_ladder::silu``.

One read and one write per element, computed in float32 in registers whatever the storage
dtype. The backward recomputes ``sigmoid(x)`` from the saved input instead of saving it: an extra
few FLOPs are free in a memory-bound kernel, an extra tensor is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import check_float_dtype, check_same_device, check_same_shape, check_tensor

__all__ = ["silu", "silu_kernel", "silu_backward_kernel"]


@triton.jit
def silu_kernel(
    x_ptr, out_ptr,                                   # input (any strides), output (contiguous)
    n_elements, size1, size2, size3,                  # the coalesced iteration space
    stride_x0, stride_x1, stride_x2, stride_x3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = x[idx] * sigmoid(x[idx]); out is contiguous, x any strides."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    x_offset = operand_offset(idx, size1, size2, size3, stride_x0, stride_x1, stride_x2, stride_x3, CONTIGUOUS)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    tl.store(out_ptr + idx, _activations.silu(x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_backward_kernel(
    grad_out_ptr, x_ptr, grad_in_ptr,                 # inputs (any strides), output (contiguous)
    n_elements, size1, size2, size3,
    stride_g0, stride_g1, stride_g2, stride_g3,       # grad_out
    stride_x0, stride_x1, stride_x2, stride_x3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_in = grad_out * silu'(x) = grad_out * s * (1 + x * (1 - s)), s = sigmoid(x)."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    g_offset = operand_offset(idx, size1, size2, size3, stride_g0, stride_g1, stride_g2, stride_g3, CONTIGUOUS)
    x_offset = operand_offset(idx, size1, size2, size3, stride_x0, stride_x1, stride_x2, stride_x3, CONTIGUOUS)
    g = tl.load(grad_out_ptr + g_offset, mask=mask).to(tl.float32)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    grad_in = g * _activations.silu_grad(x)
    tl.store(grad_in_ptr + idx, grad_in.to(grad_in_ptr.dtype.element_ty), mask=mask)


def _check_silu_args(x: object) -> None:
    check_tensor("kernel_ladder.silu", "x", x)
    check_float_dtype("kernel_ladder.silu", "x", x)


@torch.library.custom_op("kernel_ladder::silu", mutates_args=())
def _silu_op(x: torch.Tensor) -> torch.Tensor:
    _check_silu_args(x)
    runtime.require_launchable("kernel_ladder.silu", x)
    out = _launch.empty_output(x.shape, x)
    launch_elementwise(silu_kernel, x.shape, [x], [out])
    return out


@_silu_op.register_fake
def _silu_fake(x: torch.Tensor) -> torch.Tensor:
    _check_silu_args(x)
    return _launch.empty_output(x.shape, x)


@torch.library.custom_op("kernel_ladder::silu_backward", mutates_args=())
def _silu_backward_op(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    op = "kernel_ladder.silu (backward)"
    check_float_dtype(op, "grad_out", grad_out)
    check_same_shape(op, "grad_out", grad_out, "x", x)
    check_same_device(op, "grad_out", grad_out, "x", x)
    runtime.require_launchable(op, grad_out, x)
    grad_in = _launch.empty_output(x.shape, x)
    launch_elementwise(silu_backward_kernel, x.shape, [grad_out, x], [grad_in])
    return grad_in


@_silu_backward_op.register_fake
def _silu_backward_fake(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _launch.empty_output(x.shape, x)


def _silu_setup_context(ctx, inputs, output) -> None:
    (x,) = inputs
    ctx.save_for_backward(x)


def _silu_backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return _silu_backward_op(grad_out, x)


_silu_op.register_autograd(_silu_backward, setup_context=_silu_setup_context)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x``, like ``torch.nn.functional.silu(x)``.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (not copied).

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype, computed in float32.
        Differentiable (backward: ``kernel_ladder::silu_backward``).
    """
    if not isinstance(x, torch.Tensor):
        _check_silu_args(x)  # the op checks values; here only what its schema would refuse
    return _silu_op(x)
