"""GELU, exact (erf) or tanh-approximated, forward and backward, as ``kernel_ladder::gelu``.

``gelu(x) = x * Phi(x)`` with Phi the standard normal CDF: ``0.5 * x * (1 + erf(x / sqrt(2)))``.
The tanh form replaces Phi(x) with ``0.5 * (1 + tanh(z))``, ``z = sqrt(2/pi) * (x + 0.044715 x^3)``,
which equals ``sigmoid(2z)``. Both formulas and their derivatives are written once, in
:mod:`kernel_ladder._activations` (the matmul epilogue of ``kernel_ladder.linear`` uses the same ones).

One read and one write per element: the op is memory-bound, so everything happens in one pass
in registers, in float32 whatever the storage dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import check_choice, check_float_dtype, check_same_device, check_same_shape, check_tensor

__all__ = ["APPROXIMATIONS", "gelu", "gelu_kernel", "gelu_backward_kernel"]

#: The values of ``approximate``, as in ``torch.nn.functional.gelu``.
APPROXIMATIONS: tuple[str, ...] = ("none", "tanh")


@triton.jit
def gelu_kernel(
    x_ptr, out_ptr,                                   # input (any strides), output (contiguous)
    n_elements, size1, size2, size3,                  # the coalesced iteration space
    stride_x0, stride_x1, stride_x2, stride_x3,
    ACTIVATION: tl.constexpr,                         # "gelu" (erf) or "gelu_tanh"
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = gelu(x[idx]) for BLOCK logical indices; out is contiguous, x any strides."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    x_offset = operand_offset(idx, size1, size2, size3, stride_x0, stride_x1, stride_x2, stride_x3, CONTIGUOUS)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    y = _activations.apply(x, ACTIVATION)
    tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_backward_kernel(
    grad_out_ptr, x_ptr, grad_in_ptr,                 # inputs (any strides), output (contiguous)
    n_elements, size1, size2, size3,
    stride_g0, stride_g1, stride_g2, stride_g3,       # grad_out
    stride_x0, stride_x1, stride_x2, stride_x3,
    ACTIVATION: tl.constexpr, CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_in[idx] = grad_out[idx] * gelu'(x[idx]); recomputes from x, nothing else saved."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    g_offset = operand_offset(idx, size1, size2, size3, stride_g0, stride_g1, stride_g2, stride_g3, CONTIGUOUS)
    x_offset = operand_offset(idx, size1, size2, size3, stride_x0, stride_x1, stride_x2, stride_x3, CONTIGUOUS)
    g = tl.load(grad_out_ptr + g_offset, mask=mask).to(tl.float32)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    grad_in = g * _activations.derivative(x, ACTIVATION)
    tl.store(grad_in_ptr + idx, grad_in.to(grad_in_ptr.dtype.element_ty), mask=mask)


def _activation_name(approximate: str) -> str:
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def _check_gelu_args(x: object, approximate: object) -> None:
    check_tensor("kernel_ladder.gelu", "x", x)
    check_float_dtype("kernel_ladder.gelu", "x", x)
    check_choice("kernel_ladder.gelu", "approximate", approximate, APPROXIMATIONS)


@torch.library.custom_op("kernel_ladder::gelu", mutates_args=())
def _gelu_op(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    _check_gelu_args(x, approximate)
    runtime.require_launchable("kernel_ladder.gelu", x)
    out = _launch.empty_output(x.shape, x)
    launch_elementwise(gelu_kernel, x.shape, [x], [out], ACTIVATION=_activation_name(approximate))
    return out


@_gelu_op.register_fake
def _gelu_fake(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    _check_gelu_args(x, approximate)
    return _launch.empty_output(x.shape, x)


@torch.library.custom_op("kernel_ladder::gelu_backward", mutates_args=())
def _gelu_backward_op(grad_out: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    op = "kernel_ladder.gelu (backward)"
    check_float_dtype(op, "grad_out", grad_out)
    check_same_shape(op, "grad_out", grad_out, "x", x)
    check_same_device(op, "grad_out", grad_out, "x", x)
    runtime.require_launchable(op, grad_out, x)
    grad_in = _launch.empty_output(x.shape, x)
    launch_elementwise(
        gelu_backward_kernel, x.shape, [grad_out, x], [grad_in], ACTIVATION=_activation_name(approximate)
    )
    return grad_in


@_gelu_backward_op.register_fake
def _gelu_backward_fake(grad_out: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return _launch.empty_output(x.shape, x)


def _gelu_setup_context(ctx, inputs, output) -> None:
    x, approximate = inputs
    ctx.save_for_backward(x)
    ctx.approximate = approximate


def _gelu_backward(ctx, grad_out: torch.Tensor):
    (x,) = ctx.saved_tensors
    return _gelu_backward_op(grad_out, x, ctx.approximate), None


_gelu_op.register_autograd(_gelu_backward, setup_context=_gelu_setup_context)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of ``x``, like ``torch.nn.functional.gelu(x, approximate=approximate)``.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (not copied).
        approximate: ``"none"`` for the exact erf form, ``"tanh"`` for the tanh approximation.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype, computed in float32.
        Differentiable (the backward is a Triton kernel too, ``kernel_ladder::gelu_backward``).
    """
    if not (isinstance(x, torch.Tensor) and isinstance(approximate, str)):
        _check_gelu_args(x, approximate)  # the op checks values; here only what its schema would refuse
    return _gelu_op(x, approximate)
