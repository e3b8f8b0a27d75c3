"""The gated MLP of LLaMA, Mistral, Qwen and Gemma, forward and backward, as ``kernel_ladder::gated_mlp``.

``out = down(act(x W_gate^T) * (x W_up^T))`` with ``x`` ``(..., H)``, ``W_gate`` and ``W_up``
``(F, H)`` and ``W_down`` ``(H, F)`` (``nn.Linear``'s layouts). ``act`` is SiLU (SwiGLU: LLaMA,
Mistral, Qwen) or tanh-GELU (GeGLU: Gemma), from :mod:`kernel_ladder._activations`.

**Forward: two GEMMs, not three, and no F-wide intermediate but one.** Unfused, the block is three
GEMMs and an elementwise kernel: ``gate = x W_g^T`` and ``up = x W_u^T`` are written (two
``M x F`` tensors), read back by ``swiglu``, which writes ``h``, read by the down projection.
Here :func:`gated_mlp_kernel` computes the gate and the up tiles of the same ``(BLOCK_M,
BLOCK_N)`` block of ``F`` side by side — one load of each ``x`` tile feeds both dots — and its
epilogue writes ``h = act(gate) * up`` directly. ``gate`` and ``up`` never reach memory: of the
unfused chain's ``5 M F`` element transfers between the GEMMs (write gate, write up, read both,
write h) only the write of ``h`` is left (and the down GEMM's read of it). ``h`` is saved for the
backward (the down projection's weight gradient needs it, as autograd's would).

**Backward.** With ``g = d out`` ``(M, H)``:

* ``dW_down = g^T h`` and ``dh = g W_down`` — but ``dh`` is never written either:
  :func:`gated_mlp_backward_kernel` recomputes the gate and up tiles (two dots over ``H`` from
  ``x``) and the ``dh`` tile (a third dot over ``H``, from ``g`` and ``W_down``) in one K loop,
  and its epilogue writes ``d gate = dh * up * act'(gate)`` and ``d up = dh * act(gate)``;
* ``dx = d_gate W_gate + d_up W_up``, one launch of :func:`dual_matmul_kernel` (two products
  accumulated into one tile, no ``M x H`` temporary);
* ``dW_gate = d_gate^T x``, ``dW_up = d_up^T x`` (the matmul kernels; leading dims of ``x`` folded
  into the reduction).

Recomputing the two GEMMs costs ``4 M F H`` FLOPs (40% more than the backward's other
``8 M F H`` plus ``2 M F H``) and saves ``2 M F`` elements of memory held from forward to backward —
the trade activation checkpointing makes, taken here because an MLP's intermediates are the
largest activations of a transformer block.

``x`` may have any leading dims and strides (read in place through :func:`kernel_ladder._rows.row_start`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._rows import plan_rows, row_start
from .._validate import check_choice, check_float_dtype, check_same_device, check_same_dtype, check_tensor, schema_types
from ..autotune import MatmulConfig, fit_config
from .matmul import accumulate, launch_matmul, reduced_product, store_tile, tile_coords

__all__ = ["GATED_ACTIVATIONS", "dual_matmul_kernel", "gated_mlp", "gated_mlp_backward_kernel", "gated_mlp_kernel"]

#: The gates: SiLU (SwiGLU), tanh-GELU (GeGLU, Gemma's ``gelu_pytorch_tanh``), exact GELU, ReLU.
GATED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "gelu", "relu")

_OP = "kernel_ladder.gated_mlp"


@triton.jit
def _row_offsets(pid_m, M, size1, size2, stride_0, stride_1, stride_2, BLOCK_M: tl.constexpr):
    """int64 offsets of this tile's BLOCK_M rows (rows past M wrap around: in bounds, never stored)."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    return row_start(rows, size1, size2, stride_0, stride_1, stride_2)


@triton.jit
def gated_mlp_kernel(
    x_ptr, wg_ptr, wu_ptr, h_ptr,
    M, F, H, size1, size2,                            # rows of x, intermediate width, hidden width
    stride_x0, stride_x1, stride_x2, stride_xh,       # x (..., H): rows through row_start
    stride_gf, stride_gh,                             # w_gate (F, H)
    stride_uf, stride_uh,                             # w_up (F, H)
    stride_hm,                                        # h (M, F), unit column stride
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """h[tile] = act(x @ W_gate^T) * (x @ W_up^T) for one BLOCK_M x BLOCK_N tile of h."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, F, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = _row_offsets(pid_m, M, size1, size2, stride_x0, stride_x1, stride_x2, BLOCK_M)
    cols = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % F).to(tl.int64)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        x_ptrs = x_ptr + x_rows[:, None] + k[None, :] * stride_xh
        g_ptrs = wg_ptr + k[:, None] * stride_gh + cols[None, :] * stride_gf
        u_ptrs = wu_ptr + k[:, None] * stride_uh + cols[None, :] * stride_uf
        if EVEN_K:
            x = tl.load(x_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(k < H)[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=(k < H)[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=(k < H)[:, None], other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=INPUT_PRECISION)  # one x tile, two dots
        acc_u = tl.dot(x, wu, acc_u, input_precision=INPUT_PRECISION)
    h = _activations.apply(acc_g, ACTIVATION) * acc_u
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < F)[None, :]
    tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def gated_mlp_backward_kernel(
    x_ptr, g_ptr, wg_ptr, wu_ptr, wd_ptr, dgate_ptr, dup_ptr,
    M, F, H, size1, size2,
    stride_x0, stride_x1, stride_x2, stride_xh,       # x (..., H)
    stride_g0, stride_g1, stride_g2, stride_gh,       # g = d out (..., H), x's leading shape
    stride_gf, stride_gk,                             # w_gate (F, H)
    stride_uf, stride_uk,                             # w_up (F, H)
    stride_dh, stride_df,                             # w_down (H, F)
    stride_om,                                        # d_gate, d_up (M, F), unit column stride
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """d_gate = dh * up * act'(gate), d_up = dh * act(gate) for one tile, with gate = x W_g^T,
    up = x W_u^T and dh = g W_down all recomputed in one loop over H (none of them stored)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, F, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = _row_offsets(pid_m, M, size1, size2, stride_x0, stride_x1, stride_x2, BLOCK_M)
    g_rows = _row_offsets(pid_m, M, size1, size2, stride_g0, stride_g1, stride_g2, BLOCK_M)
    cols = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % F).to(tl.int64)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_dh = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        x_ptrs = x_ptr + x_rows[:, None] + k[None, :] * stride_xh
        go_ptrs = g_ptr + g_rows[:, None] + k[None, :] * stride_gh
        g_ptrs = wg_ptr + k[:, None] * stride_gk + cols[None, :] * stride_gf
        u_ptrs = wu_ptr + k[:, None] * stride_uk + cols[None, :] * stride_uf
        d_ptrs = wd_ptr + k[:, None] * stride_dh + cols[None, :] * stride_df
        if EVEN_K:
            x = tl.load(x_ptrs)
            go = tl.load(go_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
            wd = tl.load(d_ptrs)
        else:
            in_k = k < H
            x = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
            go = tl.load(go_ptrs, mask=in_k[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=in_k[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=in_k[:, None], other=0.0)
            wd = tl.load(d_ptrs, mask=in_k[:, None], other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=INPUT_PRECISION)
        acc_dh = tl.dot(go.to(wd.dtype), wd, acc_dh, input_precision=INPUT_PRECISION)
    d_gate = acc_dh * acc_u * _activations.derivative(acc_g, ACTIVATION)
    d_up = acc_dh * _activations.apply(acc_g, ACTIVATION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < F)[None, :]
    out = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dgate_ptr + out, d_gate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + out, d_up.to(dup_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dual_matmul_kernel(
    a1_ptr, b1_ptr, a2_ptr, b2_ptr, c_ptr,
    M, N, K,
    stride_a1m, stride_a1k, stride_b1k, stride_b1n,
    stride_a2m, stride_a2k, stride_b2k, stride_b2n,
    stride_cm, stride_cn,
    INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = A1 @ B1 + A2 @ B2 for one tile: both products accumulated in one fp32 tile, stored once."""
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = accumulate(a1_ptr, b1_ptr, pid_m, pid_n, M, N, 0, K, stride_a1m, stride_a1k, stride_b1k, stride_b1n,
                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, INDEX_64)
    acc += accumulate(a2_ptr, b2_ptr, pid_m, pid_n, M, N, 0, K, stride_a2m, stride_a2k, stride_b2k, stride_b2n,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, INDEX_64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    store_tile(acc, c_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, 0,
               False, "none", False)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def gated_config(M: int, F: int, H: int, dtype: torch.dtype, *, backward: bool = False) -> MatmulConfig:
    """The tile of the gated kernels: two (forward) or three (backward) fp32 accumulators per program.

    On a GPU 128 x 64 (forward) and 64 x 64 (backward) tiles keep the accumulators in registers
    (32K and 12K floats a program; the sm_90 compile test checks for spills); the interpreter
    takes its usual big tiles, shrunk to the problem.
    """
    if runtime.INTERPRETER:
        base = MatmulConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    elif backward:
        base = MatmulConfig(64, 64, 32 if dtype == torch.float32 else 64, 8, 4, 3)
    else:
        base = MatmulConfig(128, 64, 32 if dtype == torch.float32 else 64, 8, 8, 3)
    return fit_config(base, M, F, H)


def _leading(x: torch.Tensor) -> list:
    """The row launches of a (..., H) operand (rows through row_start; slices past 3 leading dims)."""
    return plan_rows([x], reduce_ndim=1)


def _gated_forward(x: torch.Tensor, w_gate, w_up, activation: str) -> torch.Tensor:
    """h = act(x W_g^T) * (x W_u^T), a new (rows, F) tensor."""
    F, H = w_gate.shape
    rows = math.prod(x.shape[:-1])
    h = _launch.empty((rows, F), x.dtype, x.device)
    if rows == 0 or F == 0:
        return h
    if H == 0:  # act(0) * 0
        return h.zero_()
    for launch in plan_rows([x]):
        M = launch.n_rows
        config = gated_config(M, F, H, x.dtype)
        h_slice = h[launch.row_base: launch.row_base + M]
        grid = (triton.cdiv(M, config.BLOCK_M) * triton.cdiv(F, config.BLOCK_N),)
        gated_mlp_kernel[grid](
            launch.tensors[0], w_gate, w_up, h_slice, M, F, H, *launch.sizes, *launch.strides,
            *w_gate.stride(), *w_up.stride(), h_slice.stride(0),
            ACTIVATION=activation, INPUT_PRECISION=_launch.dot_input_precision(x.dtype),
            EVEN_K=H % config.BLOCK_K == 0, **config.meta, **config.launch_options,
        )
    return h


def _gated_backward(x, grad_out, w_gate, w_up, w_down, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up), new (rows, F) tensors."""
    F, H = w_gate.shape
    rows = math.prod(x.shape[:-1])
    d_gate = _launch.empty((rows, F), x.dtype, x.device)
    d_up = _launch.empty((rows, F), x.dtype, x.device)
    if rows == 0 or F == 0:
        return d_gate, d_up
    if H == 0:
        return d_gate.zero_(), d_up.zero_()
    for launch in plan_rows([x, grad_out]):
        M = launch.n_rows
        config = gated_config(M, F, H, x.dtype, backward=True)
        base = launch.row_base
        grid = (triton.cdiv(M, config.BLOCK_M) * triton.cdiv(F, config.BLOCK_N),)
        gated_mlp_backward_kernel[grid](
            *launch.tensors, w_gate, w_up, w_down, d_gate[base:], d_up[base:], M, F, H, *launch.sizes,
            *launch.strides, *w_gate.stride(), *w_up.stride(), *w_down.stride(), d_gate.stride(0),
            ACTIVATION=activation, INPUT_PRECISION=_launch.dot_input_precision(x.dtype),
            EVEN_K=H % config.BLOCK_K == 0, **config.meta, **config.launch_options,
        )
    return d_gate, d_up


def _dual_matmul(a1, b1, a2, b2, out: torch.Tensor) -> None:
    """out = a1 @ b1 + a2 @ b2 (2-D operands of matching shapes; out contiguous)."""
    M, K = a1.shape
    N = b1.shape[1]
    if out.numel() == 0:
        return
    if K == 0:
        out.zero_()
        return
    config = gated_config(M, N, K, a1.dtype)
    index_64 = _launch.needs_int64(*(t.numel() + 512 * max(t.stride()) for t in (a1, b1, a2, b2, out)))
    grid = (triton.cdiv(M, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N),)
    dual_matmul_kernel[grid](
        a1, b1, a2, b2, out, M, N, K, *a1.stride(), *b1.stride(), *a2.stride(), *b2.stride(), *out.stride(),
        INPUT_PRECISION=_launch.dot_input_precision(a1.dtype), EVEN_K=K % config.BLOCK_K == 0, INDEX_64=index_64,
        **config.meta, **config.launch_options,
    )


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_args(x: object, w_gate: object, w_up: object, w_down: object, activation: object) -> None:
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_tensor(_OP, name, t)
        check_float_dtype(_OP, name, t)
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_same_dtype(_OP, "x", x, name, t)
        check_same_device(_OP, "x", x, name, t)
    check_choice(_OP, "activation", activation, GATED_ACTIVATIONS)
    if x.dim() < 1:
        raise ValueError(f"{_OP}: x must be at least 1-D (..., hidden), got a 0-d tensor")
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t.dim() != 2:
            raise ValueError(f"{_OP}: {name} must be 2-D (nn.Linear's (out_features, in_features)), "
                             f"got shape {tuple(t.shape)}")
    H = x.shape[-1]
    if w_gate.shape[1] != H or w_up.shape != w_gate.shape:
        raise ValueError(
            f"{_OP}: w_gate and w_up must both be (intermediate, hidden) = (F, {H}) for x of shape "
            f"{tuple(x.shape)}; got w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)}"
        )
    if tuple(w_down.shape) != (H, w_gate.shape[0]):
        raise ValueError(
            f"{_OP}: w_down must be (hidden, intermediate) = ({H}, {w_gate.shape[0]}), the transpose of "
            f"w_gate's shape; got {tuple(w_down.shape)}"
        )


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::gated_mlp", mutates_args=())
def _gated_mlp_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, w_gate, w_up, w_down, activation)
    runtime.require_launchable(_OP, x, w_gate, w_up, w_down)
    h = _gated_forward(x, w_gate, w_up, activation)
    out = _launch.empty_output(x.shape, x)
    launch_matmul(h, w_down.t(), out.view(h.shape[0], x.shape[-1]))  # h and out are contiguous
    return out, h


@_gated_mlp_op.register_fake
def _gated_mlp_fake(x, w_gate, w_up, w_down, activation):
    _check_args(x, w_gate, w_up, w_down, activation)
    rows = math.prod(x.shape[:-1])
    return _launch.empty_output(x.shape, x), _launch.empty_output((rows, w_gate.shape[0]), x)


@torch.library.custom_op("kernel_ladder::gated_mlp_backward", mutates_args=())
def _gated_mlp_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    h: torch.Tensor, activation: str, need_x: bool, need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = f"{_OP} (backward)"
    check_same_device(op, "grad_out", grad_out, "x", x)
    runtime.require_launchable(op, grad_out, x)
    grad_out = grad_out.to(x.dtype)
    F = w_gate.shape[0]
    d_gate, d_up = _gated_backward(x, grad_out, w_gate, w_up, w_down, activation)
    grad_x = x.new_empty(0)
    if need_x:
        grad_x = _launch.empty_output(x.shape, x)
        _dual_matmul(d_gate, w_gate, d_up, w_up, grad_x.view(-1, x.shape[-1]))
    if not need_weights:
        return grad_x, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    lead = x.shape[:-1]
    x_rows = x.unsqueeze(0) if x.dim() == 1 else x
    d_gate_rows = d_gate.view(*lead, F) if x.dim() > 1 else d_gate
    d_up_rows = d_up.view(*lead, F) if x.dim() > 1 else d_up
    h_rows = h.view(*lead, F) if x.dim() > 1 else h
    g_rows = grad_out.unsqueeze(0) if x.dim() == 1 else grad_out
    grad_w_gate = reduced_product(d_gate_rows.mT, x_rows, w_gate.shape)
    grad_w_up = reduced_product(d_up_rows.mT, x_rows, w_up.shape)
    grad_w_down = reduced_product(g_rows.mT, h_rows, w_down.shape)
    return grad_x, grad_w_gate, grad_w_up, grad_w_down


@_gated_mlp_backward_op.register_fake
def _gated_mlp_backward_fake(grad_out, x, w_gate, w_up, w_down, h, activation, need_x, need_weights):
    grad_x = _launch.empty_output(x.shape, x) if need_x else x.new_empty(0)
    if not need_weights:
        return grad_x, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    return (grad_x, _launch.empty_output(w_gate.shape, x), _launch.empty_output(w_up.shape, x),
            _launch.empty_output(w_down.shape, x))


def _setup_context(ctx, inputs, output) -> None:
    x, w_gate, w_up, w_down, activation = inputs
    _, h = output
    ctx.save_for_backward(x, w_gate, w_up, w_down, h)
    ctx.activation = activation
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # no M x F zeros for h's (absent) gradient


def _backward(ctx, grad_out: torch.Tensor | None, _grad_h):
    if grad_out is None:  # the output took no part in what is differentiated
        return None, None, None, None, None
    x, w_gate, w_up, w_down, h = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    need_weights = any(ctx.needs_input_grad[1:4])
    grad_x, gw_gate, gw_up, gw_down = _gated_mlp_backward_op(grad_out, x, w_gate, w_up, w_down, h, ctx.activation,
                                                              need_x, need_weights)
    keep = ctx.needs_input_grad
    return (grad_x if keep[0] else None, gw_gate if keep[1] else None, gw_up if keep[2] else None,
            gw_down if keep[3] else None, None)


_gated_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
    """The gated MLP ``down(act(x @ w_gate.T) * (x @ w_up.T))`` of LLaMA / Mistral / Qwen (SwiGLU) and Gemma (GeGLU).

    Args:
        x: float32, float16 or bfloat16 activations ``(..., H)``, any strides (not copied).
        w_gate, w_up: ``(F, H)`` weights (``nn.Linear(H, F).weight``), x's dtype and device.
        w_down: ``(H, F)`` (``nn.Linear(F, H).weight``).
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU, Gemma), ``"gelu"`` or ``"relu"``.

    Returns:
        A new contiguous tensor of x's shape. The gate and up projections run in one kernel whose
        epilogue applies the gate, so the two ``F``-wide projections are never written (see the
        module docstring). Differentiable in x and all three weights (``kernel_ladder::gated_mlp_backward``).
    """
    if not schema_types(tensors=(x, w_gate, w_up, w_down), strings=(activation,)):
        _check_args(x, w_gate, w_up, w_down, activation)  # the op checks values
    out, _ = _gated_mlp_op(x, w_gate, w_up, w_down, activation)
    return out
