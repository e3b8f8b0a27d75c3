"""Gated activations, ``silu(gate) * up`` (SwiGLU) and ``gelu_tanh(gate) * up`` (GeGLU), forward and
backward, as ``kernel_ladder::swiglu`` and ``kernel_ladder::geglu``.

In a gated MLP, ``down(act(gate(h)) * up(h))``, this is the elementwise part between the
matmuls (LLaMA, Mistral and Qwen use SiLU; Gemma the tanh approximation of GELU). Torch runs it as
two kernels (the activation, then the multiply) and writes ``act(gate)`` to memory in between;
fused, it reads gate and up once and writes the product once. The backward likewise reads
grad_out, gate and up once and writes both gradients in one pass. (``kernel_ladder.gated_mlp`` goes
further and applies the gate inside the GEMM that computes gate and up.)

**In-place backward** (``in_place_backward=True``, as Liger-Kernel does): ``grad_gate`` is written
into the incoming gradient's buffer, saving an allocation of its size during the backward. The
caller promises that nothing else reads that gradient afterwards (it is overwritten: the
aliasing rule, :func:`kernel_ladder._autograd.gradient_reusable`); a gradient that is not contiguous (a
stride-0 ``ones`` from ``y.sum().backward()``) or that is itself differentiated
(``create_graph=True``) gets the out-of-place backward instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._autograd import gradient_reusable
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import (
    check_bool,
    check_float_dtype,
    check_same_device,
    check_same_dtype,
    check_same_shape,
    check_tensor,
)

__all__ = ["GATES", "geglu", "swiglu", "swiglu_kernel", "swiglu_backward_kernel"]

#: The public op of each gate.
GATES: dict[str, str] = {"silu": "kernel_ladder.swiglu", "gelu_tanh": "kernel_ladder.geglu"}


@triton.jit
def swiglu_kernel(
    gate_ptr, up_ptr, out_ptr,                        # inputs (any strides), output (contiguous)
    n_elements, size1, size2, size3,                  # the coalesced iteration space
    stride_gate0, stride_gate1, stride_gate2, stride_gate3,
    stride_up0, stride_up1, stride_up2, stride_up3,
    ACTIVATION: tl.constexpr,                         # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = act(gate[idx]) * up[idx]; out is contiguous, gate and up any strides."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    gate_offset = operand_offset(
        idx, size1, size2, size3, stride_gate0, stride_gate1, stride_gate2, stride_gate3, CONTIGUOUS
    )
    up_offset = operand_offset(idx, size1, size2, size3, stride_up0, stride_up1, stride_up2, stride_up3, CONTIGUOUS)
    gate = tl.load(gate_ptr + gate_offset, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + up_offset, mask=mask).to(tl.float32)
    out = _activations.apply(gate, ACTIVATION) * up
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(
    grad_out_ptr, gate_ptr, up_ptr,                   # inputs (any strides)
    grad_gate_ptr, grad_up_ptr,                       # outputs (contiguous)
    n_elements, size1, size2, size3,
    stride_g0, stride_g1, stride_g2, stride_g3,       # grad_out
    stride_gate0, stride_gate1, stride_gate2, stride_gate3,
    stride_up0, stride_up1, stride_up2, stride_up3,
    ACTIVATION: tl.constexpr, CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_gate = g * up * act'(gate), grad_up = g * act(gate), in one pass.

    ``grad_gate`` may be ``grad_out``'s own buffer (the in-place backward): each element of g is
    loaded by the program that then stores the element's grad_gate, and no program reads another's.
    """
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    g_offset = operand_offset(idx, size1, size2, size3, stride_g0, stride_g1, stride_g2, stride_g3, CONTIGUOUS)
    gate_offset = operand_offset(
        idx, size1, size2, size3, stride_gate0, stride_gate1, stride_gate2, stride_gate3, CONTIGUOUS
    )
    up_offset = operand_offset(idx, size1, size2, size3, stride_up0, stride_up1, stride_up2, stride_up3, CONTIGUOUS)
    g = tl.load(grad_out_ptr + g_offset, mask=mask).to(tl.float32)
    gate = tl.load(gate_ptr + gate_offset, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + up_offset, mask=mask).to(tl.float32)
    grad_gate = g * up * _activations.derivative(gate, ACTIVATION)
    grad_up = g * _activations.apply(gate, ACTIVATION)
    tl.store(grad_gate_ptr + idx, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + idx, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _schema_types(gate: object, up: object, in_place_backward: object) -> bool:
    """Whether the op's schema takes these types; the op itself checks the values (kernel_ladder._validate's rule)."""
    return isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) and isinstance(in_place_backward, bool)


def _check_gated_args(op: str, gate: object, up: object, in_place_backward: object = False) -> None:
    check_tensor(op, "gate", gate)
    check_tensor(op, "up", up)
    check_float_dtype(op, "gate", gate)
    check_float_dtype(op, "up", up)
    check_same_dtype(op, "gate", gate, "up", up)
    check_same_shape(op, "gate", gate, "up", up)
    check_same_device(op, "gate", gate, "up", up)
    check_bool(op, "in_place_backward", in_place_backward)


def _forward(activation: str, gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool) -> torch.Tensor:
    op = GATES[activation]
    _check_gated_args(op, gate, up, in_place_backward)
    runtime.require_launchable(op, gate, up)
    out = _launch.empty_output(gate.shape, gate)
    launch_elementwise(swiglu_kernel, gate.shape, [gate, up], [out], ACTIVATION=activation)
    return out


def _fake(activation: str, gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool) -> torch.Tensor:
    _check_gated_args(GATES[activation], gate, up, in_place_backward)
    return _launch.empty_output(gate.shape, gate)


def _check_backward(activation: str, grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> str:
    op = f"{GATES[activation]} (backward)"
    check_float_dtype(op, "grad_out", grad_out)
    check_same_shape(op, "grad_out", grad_out, "gate", gate)
    check_same_device(op, "grad_out", grad_out, "gate", gate)
    runtime.require_launchable(op, grad_out, gate, up)
    return op


@torch.library.custom_op("kernel_ladder::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    return _forward("silu", gate, up, in_place_backward)


@_swiglu_op.register_fake
def _swiglu_fake(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    return _fake("silu", gate, up, in_place_backward)


@torch.library.custom_op("kernel_ladder::geglu", mutates_args=())
def _geglu_op(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    return _forward("gelu_tanh", gate, up, in_place_backward)


@_geglu_op.register_fake
def _geglu_fake(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    return _fake("gelu_tanh", gate, up, in_place_backward)


def _launch_backward(grad_out, gate, up, grad_gate, grad_up, activation: str) -> None:
    launch_elementwise(swiglu_backward_kernel, gate.shape, [grad_out, gate, up], [grad_gate, grad_up],
                       ACTIVATION=activation)


def _define_backward_ops(name: str, activation: str):
    """``kernel_ladder::<name>_backward`` (fresh gradients) and ``kernel_ladder::<name>_backward_inplace`` (grad_gate
    written over grad_out), one pair per gate so that errors and profiles name the op."""

    @torch.library.custom_op(f"kernel_ladder::{name}_backward", mutates_args=())
    def backward_op(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_backward(activation, grad_out, gate, up)
        grad_gate = _launch.empty_output(gate.shape, gate)
        grad_up = _launch.empty_output(up.shape, up)
        _launch_backward(grad_out, gate, up, grad_gate, grad_up, activation)
        return grad_gate, grad_up

    @backward_op.register_fake
    def _(grad_out, gate, up):
        return _launch.empty_output(gate.shape, gate), _launch.empty_output(up.shape, up)

    @torch.library.custom_op(f"kernel_ladder::{name}_backward_inplace", mutates_args=("grad_out",))
    def backward_inplace_op(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        op = _check_backward(activation, grad_out, gate, up)
        if not grad_out.is_contiguous() or grad_out.dtype != gate.dtype:
            raise ValueError(f"{op}: the in-place backward needs a contiguous grad_out of gate's dtype, "
                             f"got strides {grad_out.stride()} and {grad_out.dtype}")
        grad_up = _launch.empty_output(up.shape, up)
        _launch_backward(grad_out, gate, up, grad_out, grad_up, activation)
        return grad_up

    @backward_inplace_op.register_fake
    def _(grad_out, gate, up):
        return _launch.empty_output(up.shape, up)

    return backward_op, backward_inplace_op


_BACKWARD_OPS = {"silu": _define_backward_ops("swiglu", "silu"),
                 "gelu_tanh": _define_backward_ops("geglu", "gelu_tanh")}


def _setup_context_for(activation: str):
    def setup_context(ctx, inputs, output) -> None:
        gate, up, in_place_backward = inputs
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.in_place_backward = activation, in_place_backward

    return setup_context


def _backward(ctx, grad_out: torch.Tensor):
    gate, up = ctx.saved_tensors
    backward_op, backward_inplace_op = _BACKWARD_OPS[ctx.activation]
    if ctx.in_place_backward and grad_out.dtype == gate.dtype and gradient_reusable(grad_out):
        grad_up = backward_inplace_op(grad_out, gate, up)
        return grad_out, grad_up, None  # grad_out now holds grad_gate
    grad_gate, grad_up = backward_op(grad_out, gate, up)
    return grad_gate, grad_up, None


_swiglu_op.register_autograd(_backward, setup_context=_setup_context_for("silu"))
_geglu_op.register_autograd(_backward, setup_context=_setup_context_for("gelu_tanh"))


def swiglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` in one pass, like ``F.silu(gate) * up``.

    Args:
        gate: float32, float16 or bfloat16 tensor of any shape and strides (not copied).
        up: same shape, dtype and device as ``gate``; any strides.
        in_place_backward: write ``grad_gate`` into the incoming gradient's buffer (see the module
            docstring for when that is safe). Off by default.

    Returns:
        A new contiguous tensor of the common shape and dtype, computed in float32.
        Differentiable in both inputs (one backward pass for both gradients).
    """
    if not _schema_types(gate, up, in_place_backward):
        _check_gated_args("kernel_ladder.swiglu", gate, up, in_place_backward)
    return _swiglu_op(gate, up, in_place_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` in one pass, like ``F.gelu(gate, approximate="tanh") * up`` (Gemma's GeGLU).

    Args and returns as :func:`swiglu`.
    """
    if not _schema_types(gate, up, in_place_backward):
        _check_gated_args("kernel_ladder.geglu", gate, up, in_place_backward)
    return _geglu_op(gate, up, in_place_backward)
