"""A linear layer with a fused epilogue, ``activation(x @ weight^T + bias)``, as ``kernel_ladder::linear``.

The forward pass is one matmul launch: the bias add and the activation (None, ReLU, GELU, tanh-GELU
or SiLU, from :mod:`kernel_ladder._activations`)
are applied to the float32 accumulator in the matmul kernel's epilogue, before its single store,
so the (M, N) output is written once and never re-read — unfused, ``x @ W^T``, ``+ b`` and
``act(.)`` would write and read it three times over. Skinny (decode-shaped) inputs take the
split-K path; its reduction kernel applies the same epilogue.

The backward pass reuses the matmul kernels through strides (``W^T`` and ``X^T`` are views):

* ``G_z = G_y * act'(z)``, one elementwise kernel (``linear_activation_backward_kernel``);
  skipped without an activation;
* ``dX = G_z @ W``, ``dW = G_z^T @ X`` (leading dims of x folded into the reduction: one GEMM
  with K = batch * seq when x is contiguous), ``db = 1^T @ G_z`` — the column sums of G_z as a
  matmul against a stride-0 vector of ones: fp32-accumulated, deterministic, no atomics.

**Save or recompute the pre-activation?** GELU (both forms) and SiLU need ``z = x W^T + b`` in the backward
pass. Saving it costs M*N*element_size bytes of memory held from forward to backward, plus one
extra M*N store in the forward epilogue and one M*N load in the backward (both in the op's
memory-bound part). Recomputing it costs a whole extra GEMM: 2*M*N*K FLOPs (half again the
backward's 4*M*N*K) and re-reading x and W. For any K past a few dozen, bytes are far cheaper
than that GEMM, so the forward stores z (``STORE_PREACT``) exactly when a gradient will be
needed; the op can also be called without it (``save_preactivation=False``), and then the
backward recomputes z with the same kernel — the choice activation checkpointing makes when
memory, not time, is short. ReLU needs neither: ``z > 0`` exactly where ``y > 0``, so it keeps the
output it already has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import check_float_dtype, check_same_device, check_same_dtype, check_tensor, schema_types
from .matmul import launch_matmul, reduced_product

__all__ = ["LINEAR_ACTIVATIONS", "linear", "linear_activation_backward_kernel"]

#: The epilogue activations ``linear`` accepts (None is no activation); see :mod:`kernel_ladder._activations`.
LINEAR_ACTIVATIONS: tuple[str, ...] = _activations.ACTIVATIONS


@triton.jit
def linear_activation_backward_kernel(
    grad_ptr, saved_ptr, grad_pre_ptr,                # inputs (any strides), output (contiguous)
    n_elements, size1, size2, size3,                  # the coalesced iteration space
    stride_g0, stride_g1, stride_g2, stride_g3,       # grad (of the output)
    stride_s0, stride_s1, stride_s2, stride_s3,       # saved: z for GELU/SiLU, y for ReLU
    ACTIVATION: tl.constexpr, CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_pre = grad * act'(z); ``saved`` is z for GELU/SiLU, the output y for ReLU (y > 0 iff z > 0)."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    g_offset = operand_offset(idx, size1, size2, size3, stride_g0, stride_g1, stride_g2, stride_g3, CONTIGUOUS)
    s_offset = operand_offset(idx, size1, size2, size3, stride_s0, stride_s1, stride_s2, stride_s3, CONTIGUOUS)
    g = tl.load(grad_ptr + g_offset, mask=mask).to(tl.float32)
    s = tl.load(saved_ptr + s_offset, mask=mask).to(tl.float32)
    grad_pre = g * _activations.derivative(s, ACTIVATION)
    tl.store(grad_pre_ptr + idx, grad_pre.to(grad_pre_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_OP = "kernel_ladder.linear"


def _normalize_activation(activation: object) -> str:
    if activation is None:
        return "none"
    expected = "None, " + ", ".join(repr(a) for a in LINEAR_ACTIVATIONS[:-1]) + f" or {LINEAR_ACTIVATIONS[-1]!r}"
    if not isinstance(activation, str):
        raise TypeError(f"{_OP}: activation must be {expected}, got {type(activation).__name__}")
    if activation not in LINEAR_ACTIVATIONS:
        raise ValueError(f"{_OP}: activation must be {expected}, got {activation!r}")
    return activation


def _check_args(x: object, weight: object, bias: object, activation: str, op: str = _OP) -> tuple[int, ...]:
    """Validate; returns the output shape (x.shape[:-1] + (out_features,))."""
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight)
    check_float_dtype(op, "x", x)
    check_float_dtype(op, "weight", weight)
    check_same_dtype(op, "x", x, "weight", weight)
    check_same_device(op, "x", x, "weight", weight)
    if weight.dim() != 2:
        raise ValueError(
            f"{op}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be at least 1-D (..., in_features), got a 0-D tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: x's last dim ({x.shape[-1]}) must equal weight's dim 1, in_features ({weight.shape[1]}); "
            f"got x of shape {tuple(x.shape)} and weight of shape {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_float_dtype(op, "bias", bias)
        check_same_dtype(op, "x", x, "bias", bias)
        check_same_device(op, "x", x, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{op}: bias must have shape (out_features,) = ({weight.shape[0]},) to match weight's dim 0; "
                f"got bias of shape {tuple(bias.shape)} and weight of shape {tuple(weight.shape)}"
            )
    if activation != "none":
        _normalize_activation(activation)
    return (*x.shape[:-1], weight.shape[0])


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A (..., features) tensor as (..., rows, features): a 1-D vector becomes one row (a view)."""
    return t.unsqueeze(0) if t.dim() == 1 else t


# ----------------------------------------------------------------------------------------------
# The custom op, its fake and its autograd
# ----------------------------------------------------------------------------------------------


def _saves_preactivation(activation: str, save_preactivation: bool) -> bool:
    return save_preactivation and activation in ("gelu", "gelu_tanh", "silu")


@torch.library.custom_op("kernel_ladder::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, save_preactivation: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = _check_args(x, weight, bias, activation)
    runtime.require_launchable(_OP, x, weight, *([bias] if bias is not None else []))
    out = _launch.empty_output(shape, x)
    preact = _launch.empty_output(shape, x) if _saves_preactivation(activation, save_preactivation) else x.new_empty(0)
    rows = (*_rows(x).shape[:-1], weight.shape[0])
    saving = _saves_preactivation(activation, save_preactivation)
    launch_matmul(_rows(x), weight.t(), out.view(rows), bias=bias, activation=activation,
                preact=preact.view(rows) if saving else None)
    return out, preact


@_linear_op.register_fake
def _linear_fake(x, weight, bias, activation: str, save_preactivation: bool):
    shape = _check_args(x, weight, bias, activation)
    preact = _launch.empty_output(shape, x) if _saves_preactivation(activation, save_preactivation) else x.new_empty(0)
    return _launch.empty_output(shape, x), preact


@torch.library.custom_op("kernel_ladder::linear_backward", mutates_args=())
def _linear_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: torch.Tensor,
    activation: str,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.linear (backward)"
    shape = _check_args(x, weight, bias, activation, op=op)
    check_same_device(op, "grad_out", grad_out, "x", x)
    runtime.require_launchable(op, grad_out, x, weight)
    grad_out = grad_out.to(x.dtype)
    x_rows = _rows(x)
    rows = (*x_rows.shape[:-1], weight.shape[0])
    if activation == "none":
        grad_pre = grad_out
    else:
        if activation != "relu" and saved.numel() != grad_out.numel():
            # The pre-activation was not kept: recompute z = x W^T + b with the forward kernel.
            saved = _launch.empty_output(shape, x)
            launch_matmul(x_rows, weight.t(), saved.view(rows), bias=bias)
        grad_pre = _launch.empty_output(shape, x)
        launch_elementwise(linear_activation_backward_kernel, shape, [grad_out, saved], [grad_pre],
                           ACTIVATION=activation)
    g_rows = grad_pre.unsqueeze(0) if x.dim() == 1 else grad_pre
    # A distinct empty tensor for each gradient not needed: a custom op's outputs may not alias.
    grad_x = x.new_empty(0)
    if need_x:
        grad_x = _launch.empty_output(x.shape, x)
        launch_matmul(g_rows, weight, grad_x.view(x_rows.shape))
    grad_weight = reduced_product(g_rows.mT, x_rows, weight.shape) if need_weight else x.new_empty(0)
    grad_bias = x.new_empty(0)
    if need_bias and bias is not None:
        ones = torch.ones((), dtype=x.dtype, device=x.device).expand(*g_rows.shape[:-2], 1, g_rows.shape[-2])
        grad_bias = reduced_product(ones, g_rows, (1, weight.shape[0])).view(weight.shape[0])
    return grad_x, grad_weight, grad_bias


@_linear_backward_op.register_fake
def _linear_backward_fake(grad_out, x, weight, bias, saved, activation, need_x, need_weight, need_bias):
    grad_x = _launch.empty_output(x.shape, x) if need_x else x.new_empty(0)
    grad_weight = _launch.empty_output(weight.shape, weight) if need_weight else x.new_empty(0)
    grad_bias = _launch.empty_output((weight.shape[0],), x) if need_bias and bias is not None else x.new_empty(0)
    return grad_x, grad_weight, grad_bias


def _linear_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation, save_preactivation = inputs
    out, preact = output
    if activation == "relu":
        saved = out
    elif _saves_preactivation(activation, save_preactivation):
        saved = preact
    else:
        saved = None
    ctx.save_for_backward(x, weight, bias, saved)
    ctx.activation = activation
    ctx.mark_non_differentiable(preact)
    ctx.set_materialize_grads(False)  # no M x N zeros for the pre-activation's (absent) gradient


def _linear_backward(ctx, grad_out: torch.Tensor | None, _grad_preact: torch.Tensor | None):
    if grad_out is None:  # the output took no part in what is differentiated
        return None, None, None, None, None
    x, weight, bias, saved = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    if saved is None:
        saved = x.new_empty(0)
    grad_x, grad_weight, grad_bias = _linear_backward_op(
        grad_out, x, weight, bias, saved, ctx.activation, need_x, need_weight, need_bias and bias is not None
    )
    return (grad_x if need_x else None, grad_weight if need_weight else None,
            grad_bias if need_bias and bias is not None else None, None, None)


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """``activation(x @ weight.T + bias)``, like ``F.linear`` followed by the activation, in one launch.

    Args:
        x: (..., in_features) float32, float16 or bfloat16, any strides (not copied).
        weight: (out_features, in_features), same dtype and device (the layout of ``nn.Linear``).
        bias: (out_features,) or None.
        activation: None, ``"relu"``, ``"gelu"`` (exact, erf form), ``"gelu_tanh"`` (the tanh
            approximation, GPT-2's) or ``"silu"``, applied to the float32 accumulator before the store.

    Returns:
        A new contiguous (..., out_features) tensor. Differentiable in x, weight and bias
        (``kernel_ladder::linear_backward``); when a gradient is needed, GELU/SiLU also store their
        pre-activation in the forward pass (see the module docstring for the trade).
    """
    act = _normalize_activation(activation)
    if not schema_types(tensors=(x, weight), optional_tensors=(bias,)):
        _check_args(x, weight, bias, act)  # the op checks values
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    out, _ = _linear_op(x, weight, bias, act, needs_grad)
    return out
