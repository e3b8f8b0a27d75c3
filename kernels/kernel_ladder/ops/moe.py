"""A Mixtral-style sparse mixture-of-experts block, forward and backward, as ``kernel_ladder.moe``.

``moe(x, router_logits, w_gate_up, w_down, top_k)`` computes, for every token ``t``,

    out[t] = Σ_j p_tj · down_e(silu(gate_e x_t) ⊙ up_e x_t),   e = the j-th expert chosen for t,

with Hugging Face's ``MixtralExperts`` layout: ``w_gate_up`` ``(E, 2F, H)`` (the gate's ``F`` rows
first, then up's) and ``w_down`` ``(E, H, F)``, used as they are (the grouped GEMMs read them
transposed through their strides, no copy). Five ops, each a Triton op with its backward:

1. :func:`kernel_ladder.topk_routing` — softmax (or sigmoid) over the experts in fp32, the top ``k``;
2. :func:`kernel_ladder.moe_permute` — the ``T·k`` (token, slot) entries sorted by expert (a counting
   sort) and each expert's cumulative end row;
3. ``kernel_ladder::moe_gate_up`` — **one** grouped GEMM for every expert's gate and up projections,
   reading the token rows through the permutation (the sorted copy of ``x`` is never written) and
   applying the SwiGLU in its epilogue: each program computes a gate tile and the matching up tile
   from the same ``x`` tiles and stores only ``h = silu(gate) * up`` ``(T·k, F)``;
4. :func:`kernel_ladder.grouped_matmul` — the down projection, ``(T·k, H)``;
5. :func:`kernel_ladder.moe_combine` — each token's ``k`` rows weighted by the router and summed (the
   weights applied in the gather back, no atomics).

Of the unfused chain (``solutions.ch09_moe.moe_unfused``: gather, GEMM, SwiGLU, GEMM, combine) the
gathered rows ``(T·k, H)`` and the pre-activations ``(T·k, 2F)`` no longer go through memory; what
is left besides the weights is the block's least traffic (the course's byte model for it is
``utils.traffic.moe_ideal_bytes``). No step synchronizes with the host: the group sizes stay on the
device, and the launch count does not depend on ``E``.

**Backward.** ``h`` is saved (the down GEMM's weight gradient needs it); the pre-activations are
not: ``kernel_ladder::moe_gate_up_backward`` recomputes the gate and up tiles in the same grouped kernel,
reads ``dh`` in the epilogue and writes ``[d gate | d up]`` ``(T·k, 2F)`` (the trade
``kernel_ladder.gated_mlp`` makes: ``4·T·k·F·H`` more FLOPs for ``2·T·k·F`` fewer elements held). Then
``d rows = [d gate | d up] @ w_gate_up[e]`` (a grouped GEMM), ``dx`` = each token's ``k`` rows summed
(the combine without weights) and ``d w_gate_up[e] = [d gate | d up]^T x_e`` (the grouped weight-
gradient kernel, gathering ``x``'s rows through the permutation as the forward did).
"""

from __future__ import annotations

import torch

from .. import _launch, runtime
from .._validate import check_float_dtype, check_tensor, is_int
from .grouped_matmul import grouped_matmul, launch_grouped_dw, launch_grouped_matmul
from .moe_permute import _moe_combine_op, moe_combine, moe_permute
from .topk_routing import check_logits_dtype, topk_routing

__all__ = ["moe"]

_OP = "kernel_ladder.moe"


def _check(x, router_logits, w_gate_up, w_down, top_k, renormalize) -> None:
    for name, t in (("x", x), ("router_logits", router_logits), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_tensor(_OP, name, t)
        if name == "router_logits":
            check_logits_dtype(_OP, name, t)  # routed in float32: float64 logits too
        else:
            check_float_dtype(_OP, name, t)
    if x.dim() != 2:
        raise ValueError(f"{_OP}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)} "
                         "(flatten the batch and sequence dims first: x.reshape(-1, hidden))")
    tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"{_OP}: w_gate_up must be (E, 2F, H) and w_down (E, H, F), got shapes "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    experts, two_f, h = w_gate_up.shape
    if h != hidden:
        raise ValueError(f"{_OP}: w_gate_up's last dim must be x's hidden size {hidden}, got {h}")
    if two_f % 2:
        raise ValueError(f"{_OP}: w_gate_up's middle dim must be 2F (gate rows, then up rows), got {two_f}")
    if tuple(w_down.shape) != (experts, hidden, two_f // 2):
        raise ValueError(f"{_OP}: w_down must be (E, H, F) = {(experts, hidden, two_f // 2)}, got "
                         f"{tuple(w_down.shape)}")
    if router_logits.dim() != 2 or tuple(router_logits.shape) != (tokens, experts):
        raise ValueError(f"{_OP}: router_logits must be (tokens, E) = {(tokens, experts)}, got "
                         f"{tuple(router_logits.shape)}")
    if not is_int(top_k) or not 1 <= top_k <= experts:
        raise ValueError(f"{_OP}: top_k must be an int in [1, E = {experts}], got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"{_OP}: renormalize must be a bool, got {type(renormalize).__name__}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise TypeError(f"{_OP}: {name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{_OP}: {name} must be on x's device {x.device}, got {t.device}")
    if router_logits.device != x.device:
        raise ValueError(f"{_OP}: router_logits must be on x's device {x.device}, got {router_logits.device}")


# ----------------------------------------------------------------------------------------------
# kernel_ladder::moe_gate_up: gather + gate/up grouped GEMM + SwiGLU, one launch; its backward
# ----------------------------------------------------------------------------------------------


def _check_gate_up(op, x, w_gate_up, offsets, permutation, top_k) -> None:
    """The internal op's contract (kernel_ladder.moe has checked the user's arguments)."""
    check_tensor(op, "x", x)
    check_tensor(op, "w_gate_up", w_gate_up)
    if permutation.dtype != torch.int32 or offsets.dtype != torch.int32:
        raise TypeError(f"{op}: permutation and offsets must be int32 (kernel_ladder.moe_permute's outputs)")
    if permutation.shape != (x.shape[0] * top_k,) or offsets.shape != (w_gate_up.shape[0],):
        raise ValueError(f"{op}: permutation must be (T·k,) and offsets (E,), got {tuple(permutation.shape)} "
                         f"and {tuple(offsets.shape)}")


@torch.library.custom_op("kernel_ladder::moe_gate_up", mutates_args=())
def _moe_gate_up_op(x: torch.Tensor, w_gate_up: torch.Tensor, offsets: torch.Tensor, permutation: torch.Tensor,
                    top_k: int) -> torch.Tensor:
    op = "kernel_ladder.moe (gate/up)"
    _check_gate_up(op, x, w_gate_up, offsets, permutation, top_k)
    runtime.require_launchable(op, x, w_gate_up, offsets, permutation)
    ffn = w_gate_up.shape[1] // 2
    hidden = _launch.empty_output((permutation.shape[0], ffn), x)
    launch_grouped_matmul(x, w_gate_up.transpose(1, 2), offsets, hidden, gather=permutation, gather_k=top_k,
                          epilogue="swiglu")
    return hidden


@_moe_gate_up_op.register_fake
def _moe_gate_up_fake(x, w_gate_up, offsets, permutation, top_k):
    _check_gate_up("kernel_ladder.moe (gate/up)", x, w_gate_up, offsets, permutation, top_k)
    return _launch.empty_output((permutation.shape[0], w_gate_up.shape[1] // 2), x)


@torch.library.custom_op("kernel_ladder::moe_gate_up_backward", mutates_args=())
def _moe_gate_up_backward_op(grad_hidden: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor,
                             offsets: torch.Tensor, permutation: torch.Tensor, top_k: int, need_x: bool,
                             need_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.moe (gate/up backward)"
    runtime.require_launchable(op, grad_hidden, x)
    grad_hidden = grad_hidden.to(x.dtype)
    entries = permutation.shape[0]
    # [d gate | d up], the gate/up tiles recomputed from x (gathered) and w_gate_up in the same kernel.
    grad_gate_up = _launch.empty_output((entries, w_gate_up.shape[1]), x)
    launch_grouped_matmul(x, w_gate_up.transpose(1, 2), offsets, grad_gate_up, gather=permutation,
                          gather_k=top_k, epilogue="swiglu_backward", dh=grad_hidden)
    grad_x = x.new_empty(0)
    grad_w = x.new_empty(0)
    if need_x:
        grad_rows = _launch.empty_output((entries, x.shape[1]), x)
        launch_grouped_matmul(grad_gate_up, w_gate_up, offsets, grad_rows)  # (T·k, 2F) @ (2F, H) per expert
        grad_x = _moe_combine_op(grad_rows, permutation, top_k, None)  # each token's k rows summed
    if need_w:
        grad_w = _launch.empty_in_layout(w_gate_up)
        # d w_gate_up[e]^T (H, 2F) = x_e^T [d gate | d up]_e, x's rows gathered through the permutation.
        launch_grouped_dw(x, grad_gate_up, offsets, grad_w.transpose(1, 2), gather=permutation, gather_k=top_k)
    return grad_x, grad_w


@_moe_gate_up_backward_op.register_fake
def _moe_gate_up_backward_fake(grad_hidden, x, w_gate_up, offsets, permutation, top_k, need_x, need_w):
    grad_x = _launch.empty_output(x.shape, x) if need_x else x.new_empty(0)
    grad_w = _launch.empty_in_layout(w_gate_up) if need_w else x.new_empty(0)
    return grad_x, grad_w


def _gate_up_setup(ctx, inputs, output) -> None:
    x, w_gate_up, offsets, permutation, top_k = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(x, w_gate_up, offsets, permutation)


def _gate_up_backward(ctx, grad_hidden):
    x, w_gate_up, offsets, permutation = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = _moe_gate_up_backward_op(grad_hidden, x, w_gate_up, offsets, permutation, ctx.top_k,
                                              need_x, need_w)
    return grad_x if need_x else None, grad_w if need_w else None, None, None, None


_moe_gate_up_op.register_autograd(_gate_up_backward, setup_context=_gate_up_setup)


# ----------------------------------------------------------------------------------------------
# kernel_ladder.moe
# ----------------------------------------------------------------------------------------------


def moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
        top_k: int, renormalize: bool = True) -> torch.Tensor:
    """A sparse MoE block (Mixtral's): route, sort by expert, two grouped GEMMs, combine.

    Args:
        x: ``(T, H)`` token states (fp32, fp16 or bf16).
        router_logits: ``(T, E)`` the router's logits: float32, float16, bfloat16 or float64 (routed in
            fp32).
        w_gate_up: ``(E, 2F, H)``, each expert's gate rows then up rows (``MixtralExperts.gate_up_proj``).
        w_down: ``(E, H, F)`` (``MixtralExperts.down_proj``).
        top_k: experts per token.
        renormalize: divide each token's ``top_k`` weights by their sum (Mixtral); False keeps the
            softmax's probabilities (Qwen2-MoE without ``norm_topk_prob``).

    Returns:
        ``(T, H)`` in ``x``'s dtype. A token whose router row is NaN or infinite is routed as
        :func:`kernel_ladder.topk_routing` says (NaN logits count as ``-inf``; a row with no softmax,
        largest logit ``+inf`` or all ``-inf``, gets NaN weights and a NaN output row); it never
        changes another token's output, and no kernel reads or writes outside its tensors.
    """
    _check(x, router_logits, w_gate_up, w_down, top_k, renormalize)
    weights, expert_ids = topk_routing(router_logits, top_k, renormalize=renormalize)
    return experts_forward(x, expert_ids, weights, w_gate_up, w_down)


def experts_forward(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """The experts half of :func:`moe`, for routing done elsewhere (``kernel_ladder.patch``'s
    ``ExpertsInterface`` entry): ``expert_ids`` and ``weights`` ``(T, k)``; sort by expert, the
    SwiGLU gate-up and the down grouped GEMMs, the weighted combine."""
    top_k = expert_ids.shape[1]
    permutation, offsets = moe_permute(expert_ids, w_gate_up.shape[0])
    hidden = _moe_gate_up_op(x, w_gate_up, offsets, permutation, top_k)  # (T·k, F), SwiGLU applied
    down = grouped_matmul(hidden, w_down.transpose(1, 2), offsets)  # (T·k, H)
    return moe_combine(down, permutation, weights)
