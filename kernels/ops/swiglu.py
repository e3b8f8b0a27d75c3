"""SwiGLU's gating, ``silu(gate) * up``, forward and backward, as ``kernels::swiglu``.

In a SwiGLU MLP, ``down(silu(gate(h)) * up(h))``, this is the elementwise part between the
matmuls. Torch runs it as two kernels (silu, then mul) and writes ``silu(gate)`` to memory in
between; fused, it reads gate and up once and writes the product once. The backward likewise
reads grad_out, gate and up once and writes both gradients in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import check_float_dtype, check_same_device, check_same_dtype, check_same_shape, check_tensor

__all__ = ["swiglu", "swiglu_kernel", "swiglu_backward_kernel"]


@triton.jit
def swiglu_kernel(
    gate_ptr, up_ptr, out_ptr,                        # inputs (any strides), output (contiguous)
    n_elements, size1, size2, size3,                  # the coalesced iteration space
    stride_gate0, stride_gate1, stride_gate2, stride_gate3,
    stride_up0, stride_up1, stride_up2, stride_up3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = silu(gate[idx]) * up[idx]; out is contiguous, gate and up any strides."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    gate_offset = operand_offset(
        idx, size1, size2, size3, stride_gate0, stride_gate1, stride_gate2, stride_gate3, CONTIGUOUS
    )
    up_offset = operand_offset(idx, size1, size2, size3, stride_up0, stride_up1, stride_up2, stride_up3, CONTIGUOUS)
    gate = tl.load(gate_ptr + gate_offset, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + up_offset, mask=mask).to(tl.float32)
    out = _activations.silu(gate) * up
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(
    grad_out_ptr, gate_ptr, up_ptr,                   # inputs (any strides)
    grad_gate_ptr, grad_up_ptr,                       # outputs (contiguous)
    n_elements, size1, size2, size3,
    stride_g0, stride_g1, stride_g2, stride_g3,       # grad_out
    stride_gate0, stride_gate1, stride_gate2, stride_gate3,
    stride_up0, stride_up1, stride_up2, stride_up3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_gate = g * up * silu'(gate), grad_up = g * silu(gate), in one pass."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    g_offset = operand_offset(idx, size1, size2, size3, stride_g0, stride_g1, stride_g2, stride_g3, CONTIGUOUS)
    gate_offset = operand_offset(
        idx, size1, size2, size3, stride_gate0, stride_gate1, stride_gate2, stride_gate3, CONTIGUOUS
    )
    up_offset = operand_offset(idx, size1, size2, size3, stride_up0, stride_up1, stride_up2, stride_up3, CONTIGUOUS)
    g = tl.load(grad_out_ptr + g_offset, mask=mask).to(tl.float32)
    gate = tl.load(gate_ptr + gate_offset, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + up_offset, mask=mask).to(tl.float32)
    grad_gate = g * up * _activations.silu_grad(gate)
    grad_up = g * _activations.silu(gate)
    tl.store(grad_gate_ptr + idx, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + idx, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _check_swiglu_args(gate: object, up: object) -> None:
    op = "kernels.swiglu"
    check_tensor(op, "gate", gate)
    check_tensor(op, "up", up)
    check_float_dtype(op, "gate", gate)
    check_float_dtype(op, "up", up)
    check_same_dtype(op, "gate", gate, "up", up)
    check_same_shape(op, "gate", gate, "up", up)
    check_same_device(op, "gate", gate, "up", up)


@torch.library.custom_op("kernels::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check_swiglu_args(gate, up)
    runtime.require_launchable("kernels.swiglu", gate, up)
    out = _launch.empty_output(gate.shape, gate)
    launch_elementwise(swiglu_kernel, gate.shape, [gate, up], [out])
    return out


@_swiglu_op.register_fake
def _swiglu_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check_swiglu_args(gate, up)
    return _launch.empty_output(gate.shape, gate)


@torch.library.custom_op("kernels::swiglu_backward", mutates_args=())
def _swiglu_backward_op(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "kernels.swiglu (backward)"
    check_float_dtype(op, "grad_out", grad_out)
    check_same_shape(op, "grad_out", grad_out, "gate", gate)
    check_same_device(op, "grad_out", grad_out, "gate", gate)
    runtime.require_launchable(op, grad_out, gate, up)
    grad_gate = _launch.empty_output(gate.shape, gate)
    grad_up = _launch.empty_output(up.shape, up)
    launch_elementwise(swiglu_backward_kernel, gate.shape, [grad_out, gate, up], [grad_gate, grad_up])
    return grad_gate, grad_up


@_swiglu_backward_op.register_fake
def _swiglu_backward_fake(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch.empty_output(gate.shape, gate), _launch.empty_output(up.shape, up)


def _swiglu_setup_context(ctx, inputs, output) -> None:
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _swiglu_backward(ctx, grad_out: torch.Tensor):
    gate, up = ctx.saved_tensors
    return _swiglu_backward_op(grad_out, gate, up)


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass, like ``F.silu(gate) * up``.

    Args:
        gate: float32, float16 or bfloat16 tensor of any shape and strides (not copied).
        up: same shape, dtype and device as ``gate``; any strides.

    Returns:
        A new contiguous tensor of the common shape and dtype, computed in float32.
        Differentiable in both inputs (backward: ``kernels::swiglu_backward``, one pass).
    """
    _check_swiglu_args(gate, up)
    return _swiglu_op(gate, up)
