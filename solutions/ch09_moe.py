"""Solutions to chapter 09, sparse ops and mixture of experts: the routing kernel, the counting sort,
the grouped GEMM's tile map, the weighted combine, block skipping.

One solution per exercise of ``chapters/09_moe/09_moe.ipynb``, written for reading, and what the
chapter gives: each exercise's cases, its reference (written apart from the solution) and its
diagnosis, which the notebook's checks and ``tests/test_solutions_ch09.py`` both import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "router_inputs",
    "topk_routing_kernel",
    "launch_topk_routing",
    "routing_reference",
    "routing_cases",
    "counting_sort",
    "counting_sort_reference",
    "counting_sort_cases",
    "grouped_tile_map",
    "grouped_tile_map_reference",
    "tile_map_cases",
    "combine",
    "combine_reference",
    "combine_cases",
    "visited_key_blocks",
    "visited_key_blocks_reference",
    "block_mask_cases",
    "experts_loop",
    "moe_unfused",
]


# ----------------------------------------------------------------------------------------------
# Given: a router's logits
# ----------------------------------------------------------------------------------------------


def router_inputs(tokens: int, num_experts: int, skew: float = 0.0, seed: int = 0,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """``(tokens, num_experts)`` router logits; ``skew > 0`` favours the low-numbered experts (a
    router that has collapsed onto a few experts, as an untrained or unbalanced one does)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits -= skew * torch.arange(num_experts, dtype=torch.float32) / max(1, num_experts - 1)
    return logits.to(device)


# ----------------------------------------------------------------------------------------------
# Exercise 1: the routing kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def topk_routing_kernel(
    logits_ptr, weights_ptr, ids_ptr,  # logits (T, E); weights (T, K) fp32; ids (T, K) int32
    num_tokens, num_experts,
    stride_lt, stride_wt, stride_it,  # rows (the expert / slot stride is 1)
    K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """``BLOCK_T`` tokens per program: the softmax over the experts in fp32, then ``K`` rounds of
    "take the largest, mask it out" (ties to the lowest expert id), the weights renormalised to
    sum to 1 if asked (Mixtral), else the softmax's own probabilities (Qwen-MoE)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    valid = (rows[:, None] < num_tokens) & (experts[None, :] < num_experts)
    logits = tl.load(logits_ptr + rows[:, None] * stride_lt + experts[None, :], mask=valid,
                     other=float("-inf")).to(tl.float32)
    m = tl.max(logits, axis=1)
    p = tl.exp(logits - m[:, None])
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    total = tl.zeros([BLOCK_T], tl.float32)
    remaining = tl.where(valid, p, -1.0)  # masked experts can never win
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        # the lowest expert id among those equal to the maximum
        idx = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), axis=1)
        tl.store(weights_ptr + rows * stride_wt + j, best, mask=rows < num_tokens)
        tl.store(ids_ptr + rows * stride_it + j, idx, mask=rows < num_tokens)
        total += best
        remaining = tl.where(experts[None, :] == idx[:, None], -1.0, remaining)
    if RENORMALIZE:
        for j in tl.static_range(K):
            w = tl.load(weights_ptr + rows * stride_wt + j, mask=rows < num_tokens, other=1.0)
            tl.store(weights_ptr + rows * stride_wt + j, w / total, mask=rows < num_tokens)


def launch_topk_routing(kernel, logits: torch.Tensor, k: int, renormalize: bool, weights: torch.Tensor,
                        ids: torch.Tensor, BLOCK_T: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per ``BLOCK_T`` tokens, every expert in one block; writes ``weights`` and ``ids``."""
    num_tokens, num_experts = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the chapter's routing kernel takes logits with unit expert stride")
    kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        logits, weights, ids, num_tokens, num_experts,
        logits.stride(0), weights.stride(0), ids.stride(0),
        K=k, RENORMALIZE=renormalize, BLOCK_T=BLOCK_T, BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
    )
    return weights, ids


def routing_reference(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router in float64: softmax, ``torch.topk``, optionally renormalised."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def routing_cases(gen: torch.Generator) -> list[tuple]:
    """Token counts off the block, 8 to 60 experts, top 1, 2 and 6, both renormalisations."""
    cases = []
    for tokens, experts, k, renormalize in ((37, 8, 2, True), (5, 60, 6, False), (20, 16, 1, True), (16, 8, 2, False)):
        cases.append((torch.randn(tokens, experts, generator=gen).to(kernels.runtime.DEVICE) * 2, k, renormalize))
    return cases


# ----------------------------------------------------------------------------------------------
# Exercise 2: the counting sort
# ----------------------------------------------------------------------------------------------


def counting_sort(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``(T, k)`` routing entries by expert, stably, without a comparison sort.

    1. ``counts[e]`` = entries routed to ``e`` (a histogram, ``torch.bincount``);
    2. ``offsets = cumsum(counts)`` — each expert's end; its start is the previous end;
    3. each entry's position = its expert's start + how many entries of the same expert came
       before it (its rank within the expert, from a running count per expert).

    Returns ``permutation`` (``T·k``, int32: sorted position -> flat entry index ``t·k + j``) and
    ``offsets`` (``E``, int32, cumulative ends: the grouped GEMM's convention).
    """
    flat = expert_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, dim=0)
    starts = offsets - counts
    one_hot = torch.nn.functional.one_hot(flat, num_experts)  # (N, E)
    rank = (torch.cumsum(one_hot, dim=0) - 1).gather(1, flat[:, None])[:, 0]  # earlier entries of my expert
    position = starts[flat] + rank
    permutation = torch.empty_like(flat)
    permutation[position] = torch.arange(flat.numel(), device=flat.device)
    return permutation.to(torch.int32), offsets.to(torch.int32)


def counting_sort_reference(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable comparison sort and a histogram (the check's reference)."""
    flat = expert_ids.reshape(-1).long()
    permutation = torch.sort(flat, stable=True).indices
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    return permutation.to(torch.int32), offsets.to(torch.int32)


def counting_sort_cases(gen: torch.Generator) -> list[tuple]:
    """Random routes, an expert nobody chose, every token on one expert, one token."""
    cases = []
    for tokens, k, experts in ((50, 2, 8), (9, 1, 6), (31, 3, 16)):
        ids = torch.randint(0, experts, (tokens, k), generator=gen)
        ids[ids == 3] = 4  # expert 3 gets nothing
        cases.append((ids.to(torch.int32), experts))
    cases.append((torch.full((12, 2), 5, dtype=torch.int32), 8))
    cases.append((torch.tensor([[7, 0]], dtype=torch.int32), 8))
    return cases


# ----------------------------------------------------------------------------------------------
# Exercise 3: the grouped GEMM's tile map
# ----------------------------------------------------------------------------------------------


def grouped_tile_map(offsets: list[int], block_m: int) -> list[tuple[int, int, int]]:
    """The row tiles of a grouped GEMM: ``(group, first row, one past the last row)`` each.

    Group ``e`` holds rows ``offsets[e - 1] .. offsets[e] - 1`` (``offsets[-1]`` before group 0
    is 0). Its tiles start at its own first row, every ``block_m`` rows; the last may be short;
    an empty group has none. No tile mixes two groups (they multiply different weights).
    """
    tiles, start = [], 0
    for group, end in enumerate(offsets):
        for row in range(start, end, block_m):
            tiles.append((group, row, min(row + block_m, end)))
        start = end
    return tiles


def grouped_tile_map_reference(offsets: list[int], block_m: int) -> list[tuple[int, int, int]]:
    """Row by row (the check's reference): a new tile where the group changes or a tile fills."""
    tiles: list[list[int]] = []
    bounds = [0, *offsets]
    for group in range(len(offsets)):
        for row in range(bounds[group], bounds[group + 1]):
            if tiles and tiles[-1][0] == group and row - tiles[-1][1] < block_m:
                tiles[-1][2] = row + 1
            else:
                tiles.append([group, row, row + 1])
    return [tuple(t) for t in tiles]


def tile_map_cases(gen: torch.Generator) -> list[tuple]:
    """Uneven groups, empty first/middle/last groups, groups of exactly a tile."""
    cases = []
    for sizes in ([5, 0, 17, 16, 1], [0, 40, 0], [16, 16], [3]):
        cases.append((torch.tensor(sizes).cumsum(0).tolist(), 16))
    sizes = torch.randint(0, 30, (6,), generator=gen)
    cases.append((sizes.cumsum(0).tolist(), 8))
    return cases


# ----------------------------------------------------------------------------------------------
# Exercise 4: the weighted combine
# ----------------------------------------------------------------------------------------------


def combine(y_sorted: torch.Tensor, permutation: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scatter the experts' outputs back to their tokens, weighted: ``out[t] = Σ_j weights[t, j] ·
    y(t, j)``, where entry ``t·k + j`` sits at sorted position ``p`` with ``permutation[p] = t·k + j``.

    Invert the permutation (``inverse[permutation[p]] = p``), gather each entry's row, weight and
    sum over the ``k`` slots: each token reads its ``k`` rows — no scatter-add, deterministic.
    """
    tokens, k = weights.shape
    inverse = torch.empty_like(permutation, dtype=torch.long)
    inverse[permutation.long()] = torch.arange(permutation.numel(), device=permutation.device)
    rows = y_sorted[inverse].reshape(tokens, k, -1)
    return (weights[..., None].to(rows.dtype) * rows).sum(dim=1)


def combine_reference(y_sorted: torch.Tensor, permutation: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Entry by entry (the check's reference)."""
    tokens, k = weights.shape
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=y_sorted.dtype)
    for position, entry in enumerate(permutation.tolist()):
        t, j = divmod(entry, k)
        out[t] += weights[t, j] * y_sorted[position]
    return out


def combine_cases(gen: torch.Generator) -> list[tuple]:
    cases = []
    for tokens, k, hidden in ((7, 2, 16), (12, 1, 8), (5, 3, 24)):
        permutation = torch.randperm(tokens * k, generator=gen).to(torch.int32)
        weights = torch.rand(tokens, k, generator=gen)
        cases.append((torch.randn(tokens * k, hidden, generator=gen), permutation, weights))
    return cases


# ----------------------------------------------------------------------------------------------
# Exercise 5: which key blocks a query block visits
# ----------------------------------------------------------------------------------------------


def visited_key_blocks(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact form of a ``(Q, K)`` boolean block mask a kernel loops over (CSR):
    ``counts[q]`` = allowed key blocks of query block ``q``, and ``indices`` ``(Q, K)`` holding
    them first, in increasing order (the rest of each row: anything, here ``-1``). Built with
    tensor ops only (a stable sort of each row by "not allowed"): no host synchronization."""
    counts = block_mask.sum(dim=1).to(torch.int32)
    order = torch.sort((~block_mask).to(torch.int8), dim=1, stable=True).indices
    keep = torch.arange(block_mask.shape[1], device=block_mask.device)[None, :] < counts[:, None]
    return counts, torch.where(keep, order, torch.full_like(order, -1)).to(torch.int32)


def visited_key_blocks_reference(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counts, rows = [], []
    for row in block_mask.tolist():
        allowed = [j for j, a in enumerate(row) if a]
        counts.append(len(allowed))
        rows.append(allowed + [-1] * (len(row) - len(allowed)))
    return torch.tensor(counts, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32)


def block_mask_cases(gen: torch.Generator) -> list[tuple]:
    """Random masks of several densities, an empty row, a full row."""
    cases = []
    for q, k, density in ((6, 8, 0.3), (4, 4, 0.8), (8, 5, 0.5)):
        mask = torch.rand(q, k, generator=gen) < density
        mask[0] = False
        mask[-1] = True
        cases.append((mask,))
    return cases


# ----------------------------------------------------------------------------------------------
# Given: the naive MoE, a Python loop over experts
# ----------------------------------------------------------------------------------------------


def experts_loop(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Hugging Face's ``MixtralExperts.forward`` in its essentials: per expert, gather its tokens,
    ``down(silu(gate x) * up x)``, weight and ``index_add_`` back. Launches grow with ``E``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    ffn = w_down.shape[2]
    for e in range(w_gate_up.shape[0]):
        token_idx, slot = torch.where(ids == e)
        if token_idx.numel() == 0:
            continue
        h = x[token_idx] @ w_gate_up[e].T
        a = torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]
        y = (a @ w_down[e].T) * weights[token_idx, slot, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out


# ----------------------------------------------------------------------------------------------
# Given: the MoE block from the chapter's ops, unfused (the ladder step before kernels.moe)
# ----------------------------------------------------------------------------------------------


def moe_unfused(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Sections 2–3's MoE block: route, counting sort, gather the rows, one grouped GEMM for gate and
    up, the SwiGLU as its own kernel, one grouped GEMM for down, the weighted combine. Seven ops, no
    loop over experts, no host sync — but the gathered rows ``(T·k, H)`` and the gate/up
    pre-activations ``(T·k, 2F)`` each make a round trip through memory, which
    :func:`kernels.moe` fuses away."""
    ffn = w_down.shape[2]
    weights, expert_ids = kernels.topk_routing(router_logits, top_k, renormalize=renormalize)
    permutation, offsets = kernels.moe_permute(expert_ids, w_gate_up.shape[0])
    rows = kernels.moe_gather(x, permutation, top_k)
    gate_up = kernels.grouped_matmul(rows, w_gate_up.transpose(1, 2), offsets)  # (T·k, 2F)
    hidden = kernels.swiglu(gate_up[:, :ffn], gate_up[:, ffn:])
    down = kernels.grouped_matmul(hidden, w_down.transpose(1, 2), offsets)  # (T·k, H)
    return kernels.moe_combine(down, permutation, weights)
