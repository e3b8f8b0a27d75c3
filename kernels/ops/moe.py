"""A Mixtral-style sparse mixture-of-experts block from the chapter's kernels.

``moe(x, router_logits, w_gate_up, w_down, top_k)`` computes, for every token ``t``,

    out[t] = Σ_j p_tj · down_e(silu(gate_e x_t) ⊙ up_e x_t),   e = the j-th expert chosen for t,

with Hugging Face's ``MixtralExperts`` layout: ``w_gate_up`` ``(E, 2F, H)`` (the gate's ``F`` rows
first, then up's) and ``w_down`` ``(E, H, F)``, used as they are (the grouped GEMMs read them
transposed through their strides, no copy). The steps, each one Triton op with its backward:

1. :func:`kernels.topk_routing` — softmax over the experts, the top ``k``, renormalised or not;
2. :func:`kernels.moe_permute` — the ``T·k`` (token, slot) entries sorted by expert (a counting
   sort) and each expert's cumulative end;
3. :func:`kernels.moe_gather` — the token rows in that order;
4. :func:`kernels.grouped_matmul` over every expert at once: gate and up, then the SwiGLU, then down;
5. :func:`kernels.moe_combine` — each token's ``k`` rows weighted by the router and summed.

No step synchronizes with the host: the group sizes stay on the device. Autograd flows through
every step to ``x``, ``router_logits``, ``w_gate_up`` and ``w_down``.
"""

from __future__ import annotations

import torch

from .._validate import check_float_dtype, check_tensor, is_int

__all__ = ["moe", "moe_ideal_bytes"]

_OP = "kernels.moe"


def _check(x, router_logits, w_gate_up, w_down, top_k, renormalize) -> None:
    for name, t in (("x", x), ("router_logits", router_logits), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_tensor(_OP, name, t)
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


def moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
        top_k: int, renormalize: bool = True) -> torch.Tensor:
    """A sparse MoE block (Mixtral's): route, sort by expert, two grouped GEMMs, combine.

    Args:
        x: ``(T, H)`` token states (fp32, fp16 or bf16).
        router_logits: ``(T, E)`` the router's logits (any float dtype; routed in fp32).
        w_gate_up: ``(E, 2F, H)``, each expert's gate rows then up rows (``MixtralExperts.gate_up_proj``).
        w_down: ``(E, H, F)`` (``MixtralExperts.down_proj``).
        top_k: experts per token.
        renormalize: divide each token's ``top_k`` weights by their sum (Mixtral); False keeps the
            softmax's probabilities (Qwen2-MoE without ``norm_topk_prob``).

    Returns:
        ``(T, H)`` in ``x``'s dtype.
    """
    import kernels

    _check(x, router_logits, w_gate_up, w_down, top_k, renormalize)
    experts, two_f, _ = w_gate_up.shape
    ffn = two_f // 2
    weights, expert_ids = kernels.topk_routing(router_logits, top_k, renormalize=renormalize)
    permutation, offsets = kernels.moe_permute(expert_ids, experts)
    rows = kernels.moe_gather(x, permutation, top_k)
    gate_up = kernels.grouped_matmul(rows, w_gate_up.transpose(1, 2), offsets)  # (T·k, 2F)
    hidden = kernels.swiglu(gate_up[:, :ffn], gate_up[:, ffn:])
    down = kernels.grouped_matmul(hidden, w_down.transpose(1, 2), offsets)  # (T·k, H)
    return kernels.moe_combine(down, permutation, weights)


def moe_ideal_bytes(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    expert_ids: torch.Tensor) -> int:
    """The least traffic of a two-GEMM MoE block's forward, in bytes.

    Each of these once: ``x`` ``(T, H)``, ``router_logits``, the weights of the experts that received
    at least one token (``w_gate_up[e]`` and ``w_down[e]``), and ``out`` ``(T, H)``; plus the two
    intermediates a block of two GEMMs and a k-way sum must keep, each written once and read once:
    the activated hidden rows ``h`` ``(T·k, F)`` and the down rows ``y`` ``(T·k, H)`` (summing a
    token's ``k`` rows needs them all, and after the sort by expert they sit in different tiles —
    only atomics would avoid ``y``). Routing metadata (ids, permutation, offsets) is not counted:
    it is ``O(T·k)`` integers, small next to rows of ``H``. (Reads ``expert_ids`` on the host: a
    benchmark helper.)
    """
    tokens, hidden = x.shape
    experts, two_f, _ = w_gate_up.shape
    ffn = two_f // 2
    k = expert_ids.shape[1]
    used = int(torch.bincount(expert_ids.detach().cpu().flatten().long(), minlength=experts).gt(0).sum())
    item = x.element_size()
    weights = used * (w_gate_up[0].numel() + w_down[0].numel()) * item
    return (2 * tokens * hidden * item + router_logits.numel() * router_logits.element_size() + weights
            + 2 * tokens * k * ffn * item + 2 * tokens * k * hidden * item)
