"""Byte models: the least traffic an op can have, for the benchmarks' "ideal" and the traffic tests.

The generic model (each input read once, each output written once) is :func:`utils.trace.ideal_bytes`;
the ones here are for ops whose least traffic depends on more than their arguments' sizes. They read
routing decisions on the host, so they belong to benchmarks and tests, not to the library.
"""

from __future__ import annotations

import torch

__all__ = ["moe_ideal_bytes"]


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
