"""Chapter 09's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (the same givens from ``solutions.ch09_moe``:
cases, launcher, reference, diagnosis), once with the solution (SOLVED) and once per negative control
— a plausible wrong answer the checker must reject, with the diagnosis it must give. The library's
own ops (``kernel_ladder.topk_routing``, ``moe_permute``, ``grouped_tile_map``, ``moe_combine``, the
block-sparse attention's block lists) must pass the same checks: the exercises ask what they do.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from kernel_ladder.ops.block_sparse_attention import block_lists
from solutions import ch09_moe as given
from utils.exercises import check

pytestmark = pytest.mark.interpreter  # the kernel's diagnoses need the interpreter


def rejected(verdict, diagnosis: str) -> bool:
    """NOT SOLVED, saying ``diagnosis`` (the verdict's lines are wrapped: compared with single spaces)."""
    return not verdict.solved and diagnosis in " ".join(verdict.message.split())


# ----------------------------------------------------------------------------------------------
# Exercise 1: the routing kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def buggy_routing_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_lt, stride_wt, stride_it,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BUG: tl.constexpr,
):
    # The solution with one mistake: BUG 0 never renormalises, 1 breaks ties to the highest id,
    # 2 always renormalises (a softmax over the k chosen logits), 3 never masks a winner out,
    # 4 stores without the token mask (the rows past the last token), 5 exponentiates the raw logits,
    # 6 loads the lanes past E as 0 and keeps them in the softmax, 7 stores the weights, loads them
    # back to renormalise and stores them again, 8 masks a winner out with 0 instead of -1.
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    valid = (rows[:, None] < num_tokens) & (experts[None, :] < num_experts)
    if BUG == 6:
        logits = tl.load(logits_ptr + rows[:, None] * stride_lt + experts[None, :], mask=valid,
                         other=0.0).to(tl.float32)
    else:
        logits = tl.load(logits_ptr + rows[:, None] * stride_lt + experts[None, :], mask=valid,
                         other=float("-inf")).to(tl.float32)
    m = tl.max(logits, axis=1)
    if BUG == 5:
        p = tl.exp(logits)
    else:
        p = tl.exp(logits - m[:, None])
    if BUG != 6:
        p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    if BUG == 6:
        remaining = tl.where(rows[:, None] < num_tokens, p, -1.0)
    else:
        remaining = tl.where(valid, p, -1.0)
    top_w = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    top_id = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        if BUG == 1:
            idx = tl.max(tl.where(remaining == best[:, None], experts[None, :], -1), axis=1)
        else:
            idx = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), axis=1)
        top_w = tl.where(experts[None, :] == j, best[:, None], top_w)
        top_id = tl.where(experts[None, :] == j, idx[:, None], top_id)
        if BUG == 8:
            remaining = tl.where(experts[None, :] == idx[:, None], 0.0, remaining)
        elif BUG != 3:
            remaining = tl.where(experts[None, :] == idx[:, None], -1.0, remaining)
    if ((RENORMALIZE and BUG != 0) or BUG == 2) and BUG != 7:
        top_w = top_w / tl.sum(tl.where(experts[None, :] < K, top_w, 0.0), axis=1)[:, None]
    if BUG == 4:
        slots = (rows[:, None] >= 0) & (experts[None, :] < K)
    else:
        slots = (rows[:, None] < num_tokens) & (experts[None, :] < K)
    tl.store(weights_ptr + rows[:, None] * stride_wt + experts[None, :], top_w, mask=slots)
    tl.store(ids_ptr + rows[:, None] * stride_it + experts[None, :], top_id, mask=slots)
    if BUG == 7 and RENORMALIZE:
        back = tl.load(weights_ptr + rows[:, None] * stride_wt + experts[None, :], mask=slots, other=0.0)
        tl.store(weights_ptr + rows[:, None] * stride_wt + experts[None, :], back / tl.sum(back, axis=1)[:, None],
                 mask=slots)


class _WithBug:
    """``kernel[grid](...)`` with the ``BUG`` switch set, so the given launcher runs the buggy kernel."""

    def __init__(self, bug: int):
        self.bug = bug

    def __getitem__(self, grid):
        return lambda *args, **kwargs: buggy_routing_kernel[grid](*args, BUG=self.bug, **kwargs)


def routing_with(kernel):
    def topk_routing(logits, k, renormalize, weights, ids):
        return given.launch_topk_routing(kernel, logits, k, renormalize, weights, ids)

    return topk_routing


def check_routing(candidate):
    return check("ch09_moe.topk_routing_kernel", candidate, given.routing_reference, given.routing_cases, out=True,
                 compare=given.diagnose_routing, diagnose=given.diagnose_routing_cause, rules=given.routing_rules(),
                 traffic=given.routing_traffic())


def test_routing_solution_solves():
    verdict = check_routing(routing_with(given.topk_routing_kernel))
    assert verdict.solved and verdict.traffic.ratio < 1.05, verdict.message


@pytest.mark.parametrize(("bug", "diagnosis"), [
    (0, "not renormalised"),
    (1, "a tie (experts of equal probability) goes to the lowest expert id"),
    (2, "but this case has renormalize=False"),
    (3, "got expert"),
    (4, "out of bounds"),
    (5, "exp overflows float32 for a logit above 88.7"),
    (6, "take part in the softmax as logits of 0: load them with other=float('-inf')"),
    (7, "broke a stated rule — the spec stores each weight once (Hint 1: a program's read-back of its own stores is "
        "not guaranteed on a GPU): buggy_routing_kernel stored 74 elements of weights_ptr twice in one launch"),
    (8, "token 20 got expert 0 twice (ids [0, 0], expected [0, 1])"),
    (8, "a winner masked out with 0 ties with them and wins again: mask it with -1"),
], ids=["no-renormalization", "ties-to-highest", "always-renormalized", "winner-not-masked", "no-store-mask",
        "no-max-subtracted", "padding-lanes-counted", "stored-then-reloaded", "winner-masked-with-0",
        "winner-masked-with-0-cause"])
def test_routing_negative_controls(bug, diagnosis):
    verdict = check_routing(routing_with(_WithBug(bug)))
    assert rejected(verdict, diagnosis), verdict.message


def test_the_production_router_passes_the_same_check():
    def production(logits, k, renormalize, weights, ids):
        w, i = kernel_ladder.topk_routing(logits, k, renormalize=renormalize)
        weights.copy_(w)
        ids.copy_(i)
        return weights, ids

    assert check_routing(production).solved


def test_the_routing_reference_breaks_ties_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = given.routing_reference(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))


# ----------------------------------------------------------------------------------------------
# Exercise 2: the counting sort
# ----------------------------------------------------------------------------------------------


def sort_filling_each_expert_from_its_end(expert_ids, num_experts):
    # The textbook placement loop (ends[e] -= 1, then place) run forwards: each expert's entries reversed.
    flat = expert_ids.reshape(-1).long()
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    ends, permutation = offsets.clone(), torch.empty_like(flat)
    for i, e in enumerate(flat.tolist()):
        ends[e] -= 1
        permutation[ends[e]] = i
    return permutation.to(torch.int32), offsets.to(torch.int32)


def sort_returning_the_starts(expert_ids, num_experts):
    permutation, offsets = given.counting_sort(expert_ids, num_experts)
    counts = torch.bincount(expert_ids.reshape(-1).long(), minlength=num_experts)
    return permutation, (offsets - counts).to(torch.int32)  # an exclusive scan


def sort_returning_the_counts(expert_ids, num_experts):
    permutation, _ = given.counting_sort(expert_ids, num_experts)
    return permutation, torch.bincount(expert_ids.reshape(-1).long(), minlength=num_experts).to(torch.int32)


def sort_returning_the_positions(expert_ids, num_experts):
    permutation, offsets = given.counting_sort(expert_ids, num_experts)
    positions = torch.empty_like(permutation)
    positions[permutation.long()] = torch.arange(permutation.numel(), dtype=torch.int32)  # entry -> position
    return positions, offsets


def sort_by_token(expert_ids, num_experts):
    permutation, offsets = given.counting_sort(expert_ids, num_experts)
    return (permutation // expert_ids.shape[1]).to(torch.int32), offsets  # the token, not the entry t·k + j


def sort_without_minlength(expert_ids, num_experts):
    permutation, _ = given.counting_sort(expert_ids, num_experts)
    return permutation, torch.cumsum(torch.bincount(expert_ids.reshape(-1).long()), 0).to(torch.int32)


def sort_by_comparison(expert_ids, num_experts):
    flat = expert_ids.reshape(-1).long()
    permutation = torch.sort(flat, stable=True).indices  # right, but the comparison sort the spec rules out
    return permutation.to(torch.int32), torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)


def sort_by_argsort(expert_ids, num_experts):
    flat = expert_ids.reshape(-1)
    return flat.argsort(stable=True).to(torch.int32), given.counting_sort(expert_ids, num_experts)[1]


def sort_entry_by_entry(expert_ids, num_experts):
    # right, and linear, but a Python loop over the entries (a host sync each)
    flat = expert_ids.reshape(-1).long()
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    nxt = (offsets - torch.bincount(flat, minlength=num_experts)).tolist()
    permutation = torch.empty_like(flat)
    for i, e in enumerate(flat.tolist()):
        permutation[nxt[e]] = i
        nxt[e] += 1
    return permutation.to(torch.int32), offsets.to(torch.int32)


def sort_by_the_aten_op(expert_ids, num_experts):
    flat = expert_ids.reshape(-1).long()
    permutation = torch.ops.aten.sort.stable(flat, stable=True)[1]  # torch.sort under another spelling
    return permutation.to(torch.int32), torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)


def sort_in_numpy(expert_ids, num_experts):
    import numpy as np

    flat = expert_ids.reshape(-1).long()
    permutation = torch.from_numpy(np.argsort(flat.cpu().numpy(), kind="stable"))  # a comparison sort on the host
    return permutation.to(torch.int32), torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)


def sort_by_builtin_sorted(expert_ids, num_experts):
    flat = expert_ids.reshape(-1).long()
    order = sorted(range(flat.numel()), key=flat.tolist().__getitem__)  # Python's sort over a list
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    return torch.tensor(order, dtype=torch.int32), offsets.to(torch.int32)


def sort_expert_by_expert(expert_ids, num_experts):
    # right, but a Python loop over the experts (one nonzero, a host sync, each)
    flat = expert_ids.reshape(-1).long()
    permutation = torch.cat([(flat == e).nonzero()[:, 0] for e in range(num_experts)])
    return permutation.to(torch.int32), torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)


def sort_counting_with_bincount(expert_ids, num_experts):
    # right, but bincount sizes its output by the largest id: on a GPU the host reads it first
    flat = expert_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    one_hot = torch.nn.functional.one_hot(flat, num_experts)
    rank = (torch.cumsum(one_hot, dim=0) - 1).gather(1, flat[:, None])[:, 0]
    permutation = torch.empty_like(flat)
    permutation[torch.cumsum(counts, 0)[flat] - counts[flat] + rank] = torch.arange(flat.numel())
    return permutation.to(torch.int32), torch.cumsum(counts, 0).to(torch.int32)


def sort_with_ranks_counting_the_entry_itself(expert_ids, num_experts):
    flat = expert_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    ends = torch.cumsum(counts, 0)
    rank = torch.cumsum(torch.nn.functional.one_hot(flat, num_experts), 0).gather(1, flat[:, None])[:, 0]  # no - 1
    permutation = torch.zeros(flat.numel() + 1, dtype=torch.long)
    permutation[(ends - counts)[flat] + rank] = torch.arange(flat.numel())
    return permutation[:-1].to(torch.int32), ends.to(torch.int32)


def library_checked(rules: list) -> list:
    """An exercise's rules less "tensor ops only": a library op passes the rest of the check (its values, its
    traffic), while tensor ops only rejects it as the learner's answer (the exercise asks for the computation)."""
    kept = [rule for rule in rules if rule.name != "tensor ops only"]
    assert len(kept) == len(rules) - 1
    return kept


def check_counting_sort(candidate, library: bool = False):
    rules = given.counting_sort_rules()
    return check("ch09_moe.counting_sort", candidate, given.counting_sort_reference, given.counting_sort_cases,
                 compare=given.diagnose_counting_sort, rules=library_checked(rules) if library else rules,
                 traffic=given.counting_sort_traffic())


def test_counting_sort_solution_solves():
    verdict = check_counting_sort(given.counting_sort)
    message = " ".join(verdict.message.split())
    assert verdict.solved and "rules kept: forbids torch.sort" in message and "tensor ops only" in message, message
    assert verdict.traffic.ratio > 5 * verdict.traffic.top / verdict.traffic.ideal  # the one-hot round trips


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (sort_filling_each_expert_from_its_end, "the sort must be stable"),
    (sort_returning_the_starts, "offsets are each expert's start (an exclusive scan), not its end"),
    (sort_returning_the_counts, "offsets are the counts (the histogram) themselves"),
    (sort_returning_the_positions, "permutation is inverted"),
    (sort_by_token, "is not a permutation of the"),
    (sort_with_ranks_counting_the_entry_itself, "each entry sits one position after its place: an entry's rank "
                                                "counts itself"),
    (sort_without_minlength, "the code made the host wait for the device: bincount"),  # its width, from the ids
    (sort_by_comparison, "broke a stated rule — the spec asks for a counting sort (a histogram, a prefix sum and "
                         "ranks), no comparison sort: the code called torch.sort"),
    (sort_by_argsort, "no comparison sort: the code called Tensor.argsort"),
    (sort_entry_by_entry, "broke a stated rule — the spec asks for tensor ops only (a Python loop or a round trip "
                          "through the host runs on the CPU while a GPU waits): a Python for loop at line"),
    (sort_by_the_aten_op, "no comparison sort: the code ran aten.sort.stable, the op behind torch.sort"),
    (sort_in_numpy, "tensor ops only (a Python loop or a round trip through the host runs on the CPU while a GPU "
                    "waits): the code took values to the host: .cpu(), .numpy()"),
    (sort_by_builtin_sorted, "a call of the builtin sorted (Python data, not tensor ops) at line"),
    (sort_expert_by_expert, "a list comprehension at line"),
    (sort_expert_by_expert, "of sort_expert_by_expert (over range(num_experts))"),
    (sort_counting_with_bincount, "tensor ops only (a Python loop or a round trip through the host runs on the CPU "
                                  "while a GPU waits): the code made the host wait for the device: bincount"),
])
def test_counting_sort_negative_controls(wrong, diagnosis):
    verdict = check_counting_sort(wrong)
    assert rejected(verdict, diagnosis), verdict.message


def sort_ranking_by_an_equality_matrix(expert_ids, num_experts):
    # right, with no one-hot: an entry's rank is how many earlier entries share its expert, from a (T·k, T·k) matrix
    flat = expert_ids.reshape(-1).long()
    counts = (flat[:, None] == torch.arange(num_experts)).sum(dim=0)
    offsets = torch.cumsum(counts, 0)
    earlier = torch.ones(flat.numel(), flat.numel(), dtype=torch.bool).tril(-1)
    rank = ((flat[:, None] == flat[None, :]) & earlier).sum(dim=1)
    permutation = torch.empty_like(flat)
    permutation[(offsets - counts)[flat] + rank] = torch.arange(flat.numel())
    return permutation.to(torch.int32), offsets.to(torch.int32)


def test_the_counting_sort_traffic_line_says_what_was_measured():
    """The line names the ops the tracer saw; the one-hot is named only where its ops ran."""
    one_hot = " ".join(check_counting_sort(given.counting_sort).message.split())
    assert "torch ops moved" in one_hot and "aten.cumsum.default" in one_hot, one_hot
    assert "a one-hot (T·k, E) matrix" in one_hot, one_hot
    verdict = check_counting_sort(sort_ranking_by_an_equality_matrix)
    message = " ".join(verdict.message.split())
    assert verdict.solved and "one-hot" not in message and "aten.eq.Tensor" in message, message
    kernels = check_counting_sort(kernel_ladder.moe_permute, library=True)
    message = " ".join(kernels.message.split())
    assert kernels.solved and "each torch op" not in message and "one-hot" not in message, message


def test_the_production_permute_passes_the_same_check():
    verdict = check_counting_sort(kernel_ladder.moe_permute, library=True)
    assert verdict.solved and verdict.traffic.ratio < 1.5 * verdict.traffic.top / verdict.traffic.ideal, \
        verdict.message
    assert rejected(check_counting_sort(kernel_ladder.moe_permute), "the code called kernel_ladder's op "
                                                                    "kernel_ladder::moe_permute")


# ----------------------------------------------------------------------------------------------
# Exercise 3: the grouped GEMM's tile map
# ----------------------------------------------------------------------------------------------


def tiles_without_the_partial_last(offsets, block_m):
    tiles, start = [], 0
    for group, end in enumerate(offsets):
        for row in range(start, end - block_m + 1, block_m):  # whole tiles only
            tiles.append((group, row, row + block_m))
        start = end
    return tiles


def tiles_for_every_group(offsets, block_m):
    tiles, start = [], 0
    for group, end in enumerate(offsets):
        for i in range(max(1, -(-(end - start) // block_m))):  # at least one tile, even for an empty group
            tiles.append((group, start + i * block_m, min(start + (i + 1) * block_m, end)))
        start = end
    return tiles


def tiles_one_per_group(offsets, block_m):
    bounds = [0, *offsets]
    return [(g, bounds[g], bounds[g + 1]) for g in range(len(offsets)) if bounds[g + 1] > bounds[g]]  # no block_m


def tiles_across_groups(offsets, block_m):
    bounds, tiles = [0, *offsets], []
    for row in range(0, offsets[-1], block_m):  # every block_m rows of the whole batch, groups ignored
        group = max(g for g in range(len(offsets)) if bounds[g] <= row)
        tiles.append((group, row, min(row + block_m, offsets[-1])))
    return tiles


def tiles_ending_on_their_last_row(offsets, block_m):
    return [(g, a, b - 1) for g, a, b in given.grouped_tile_map(offsets, block_m)]  # an inclusive end


def tiles_numbered_within_groups(offsets, block_m):
    starts = dict.fromkeys(range(len(offsets)))
    tiles = given.grouped_tile_map(offsets, block_m)
    for g, a, _ in tiles:
        starts[g] = a if starts[g] is None else starts[g]
    return [(g, a - starts[g], b - starts[g]) for g, a, b in tiles]  # rows from 0 in every group


def tiles_with_offsets_as_starts(offsets, block_m):
    tiles = []
    for group, start in enumerate(offsets):
        end = offsets[group + 1] if group + 1 < len(offsets) else start  # offsets read as starts
        tiles += [(group, row, min(row + block_m, end)) for row in range(start, end, block_m)]
    return tiles


def tiles_skipping_group_0(offsets, block_m):
    return [t for t in given.grouped_tile_map(offsets, block_m) if t[0] != 0]  # range(1, E) over the groups


def tiles_with_groups_from_1(offsets, block_m):
    return [(g + 1, a, b) for g, a, b in given.grouped_tile_map(offsets, block_m)]


def check_tile_map(candidate):
    return check("ch09_moe.grouped_tile_map", candidate, given.grouped_tile_map_reference, given.tile_map_cases,
                 compare=given.diagnose_tile_map)


def test_tile_map_solution_solves():
    assert check_tile_map(given.grouped_tile_map).solved


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (tiles_without_the_partial_last, "its last, partial tile is missing"),
    (tiles_for_every_group, "an empty group has no tiles"),
    (tiles_one_per_group, "a tile holds at most block_m rows"),
    (tiles_across_groups, "a tile holds rows of one group only"),
    (tiles_ending_on_their_last_row, "every tile ends one row early: the third number is one past the tile's last row"),
    (tiles_numbered_within_groups, "the rows are numbered within each group (from 0)"),
    (tiles_with_offsets_as_starts, "offsets were read as each group's start: offsets[g] is group g's end"),
    (tiles_skipping_group_0, "group 0 (rows 0..4) has no tiles: the loop over the groups skips it"),
    (tiles_with_groups_from_1, "every tile's group is one too high (got (1, 0, 5), expected (0, 0, 5))"),
])
def test_tile_map_negative_controls(wrong, diagnosis):
    verdict = check_tile_map(wrong)
    assert rejected(verdict, diagnosis), verdict.message


def test_the_tile_map_diagnosis_names_the_order():
    def reversed_tiles(offsets, block_m):
        return given.grouped_tile_map(offsets, block_m)[::-1]

    verdict = check_tile_map(reversed_tiles)
    assert rejected(verdict, "the right tiles in the wrong order"), verdict.message


def test_the_production_tile_map_passes_the_same_check():
    assert check_tile_map(kernel_ladder.grouped_tile_map).solved


# ----------------------------------------------------------------------------------------------
# Exercise 4: the weighted combine
# ----------------------------------------------------------------------------------------------


def combine_without_the_weights(y_sorted, permutation, weights):
    return given.combine(y_sorted, permutation, torch.ones_like(weights))


def combine_through_the_permutation(y_sorted, permutation, weights):
    tokens, k = weights.shape
    rows = y_sorted[permutation.long()].reshape(tokens, k, -1)  # the permutation where its inverse belongs
    return (weights[..., None] * rows).sum(dim=1)


def combine_with_the_weights_in_sorted_order(y_sorted, permutation, weights):
    tokens, k = weights.shape
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=y_sorted.dtype)
    # row p is entry permutation[p]'s, but takes the weight of entry p
    return out.index_add_(0, permutation.long() // k, y_sorted * weights.reshape(-1, 1).to(y_sorted.dtype))


def combine_by_scatter_add(y_sorted, permutation, weights):
    """The right values another way — a scatter-add of each sorted row, weighted, into its token — which the
    spec rules out: index_add_ sums in the order the hardware picks, so its sums are not deterministic."""
    tokens, k = weights.shape
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=y_sorted.dtype)
    w = weights.reshape(-1)[permutation.long()].to(y_sorted.dtype)
    return out.index_add_(0, permutation.long() // k, y_sorted * w[:, None])


def combine_token_by_token(y_sorted, permutation, weights):
    """The right values with a Python loop over the tokens, which the spec rules out."""
    tokens, k = weights.shape
    inverse = torch.empty_like(permutation, dtype=torch.long)
    inverse[permutation.long()] = torch.arange(permutation.numel())
    return torch.stack([(weights[t, :, None] * y_sorted[inverse[t * k:(t + 1) * k]]).sum(dim=0) for t in range(tokens)])


def combine_averaging(y_sorted, permutation, weights):
    return given.combine(y_sorted, permutation, weights) / weights.shape[1]


def combine_by_index_put_accumulating(y_sorted, permutation, weights):
    """The right values by a scatter-add under another name: index_put_ with accumulate=True."""
    tokens, k = weights.shape
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=y_sorted.dtype)
    w = weights.reshape(-1)[permutation.long()].to(y_sorted.dtype)
    return out.index_put_((permutation.long() // k,), y_sorted * w[:, None], accumulate=True)


def check_combine(candidate, library: bool = False):
    rules = given.combine_rules()
    return check("ch09_moe.combine", candidate, given.combine_reference, given.combine_cases,
                 rules=library_checked(rules) if library else rules, diagnose=given.diagnose_combine,
                 traffic=given.combine_traffic())


def test_combine_solution_solves():
    verdict = check_combine(given.combine)
    message = " ".join(verdict.message.split())
    assert verdict.solved and "the gather of the rows (aten.index.Tensor) writes a (T·k, H) copy" in message, message
    assert verdict.traffic.ratio > 2 > 1.2 > verdict.traffic.top / verdict.traffic.ideal


def test_the_production_combine_passes_the_same_check():
    verdict = check_combine(kernel_ladder.moe_combine, library=True)
    assert verdict.solved and verdict.traffic.ratio < 1.2, verdict.message
    assert rejected(check_combine(kernel_ladder.moe_combine), "the code called kernel_ladder's op "
                                                              "kernel_ladder::moe_combine")


def combine_by_a_weight_matrix(y_sorted, permutation, weights):
    # right, with no gather: a dense (T, T·k) matrix of the weights times the sorted rows
    tokens, k = weights.shape
    perm = permutation.long()
    matrix = torch.zeros(tokens, perm.numel(), dtype=y_sorted.dtype)
    matrix[perm // k, torch.arange(perm.numel())] = weights.reshape(-1)[perm].to(y_sorted.dtype)
    return matrix @ y_sorted


def test_the_combine_traffic_line_says_what_was_measured():
    """The gather is named where its op copied the rows; a matrix product is told as one."""
    verdict = check_combine(combine_by_a_weight_matrix)
    message = " ".join(verdict.message.split())
    assert verdict.solved and "aten.mm.default" in message and "y_sorted[inverse]" not in message, message
    assert "a dense (T, T·k) matrix" in message, message
    kernels = check_combine(kernel_ladder.moe_combine, library=True)
    message = " ".join(kernels.message.split())
    assert kernels.solved and "each torch op" not in message and "gather" not in message, message


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (combine_without_the_weights, "cause: the weights are not applied"),
    (combine_through_the_permutation, "cause: y_sorted was gathered through the permutation itself"),
    (combine_with_the_weights_in_sorted_order, "cause: the weights were taken in sorted order"),
    (combine_averaging, "cause: the k rows are averaged"),
    (combine_by_scatter_add, "broke a stated rule — the spec asks for a gather, no scatter-add (its order of "
                             "additions is the hardware's, so its sums are not deterministic): the code called "
                             "Tensor.index_add_"),
    (combine_token_by_token, "broke a stated rule — the spec asks for torch with no Python loop: a list comprehension"),
    (combine_by_index_put_accumulating, "no scatter-add (its order of additions is the hardware's, so its sums "
                                        "are not deterministic): the code ran aten.index_put_.default with "
                                        "accumulate=True"),
])
def test_combine_negative_controls(wrong, diagnosis):
    verdict = check_combine(wrong)
    assert rejected(verdict, diagnosis), verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 5: which key blocks a query block visits
# ----------------------------------------------------------------------------------------------


def visited_numbered_from_one(block_mask):
    counts, indices = given.visited_key_blocks(block_mask)
    return counts, torch.where(indices >= 0, indices + 1, indices)


def visited_at_least_one_block(block_mask):
    counts, indices = given.visited_key_blocks(block_mask)
    return counts.clamp(min=1), torch.where(indices >= 0, indices, torch.zeros_like(indices))  # an empty row: block 0


def visited_in_decreasing_order(block_mask):
    columns = torch.arange(1, block_mask.shape[1] + 1)
    order = torch.sort(block_mask * columns, dim=1, descending=True).indices  # allowed blocks, the last first
    return block_mask.sum(dim=1).to(torch.int32), order.to(torch.int32)


def visited_forbidden_first(block_mask):
    counts = block_mask.sum(dim=1).to(torch.int32)
    order = torch.sort(block_mask.to(torch.int8), dim=1, stable=True).indices  # the False (0) keys sort first
    keep = torch.arange(block_mask.shape[1])[None, :] < counts[:, None]
    return counts, torch.where(keep, order, -1).to(torch.int32)


def visited_as_int64(block_mask):
    counts, indices = given.visited_key_blocks(block_mask)
    return counts.long(), indices.long()


def visited_row_by_row(block_mask):
    counts = block_mask.sum(dim=1).to(torch.int32)
    indices = torch.full(block_mask.shape, -1, dtype=torch.int32)
    for q in range(block_mask.shape[0]):  # a Python loop over the rows
        allowed = block_mask[q].nonzero()[:, 0]
        indices[q, : allowed.numel()] = allowed.to(torch.int32)
    return counts, indices


def visited_with_item(block_mask):
    counts, indices = given.visited_key_blocks(block_mask)
    widest = int(counts.max().item())  # a host sync: the kernel would wait for it
    return counts, torch.where(torch.arange(indices.shape[1]) < widest, indices, indices)


def visited_by_an_unstable_sort(block_mask):
    counts = block_mask.sum(dim=1).to(torch.int32)
    order = torch.sort((~block_mask).to(torch.int8), dim=1).indices  # no stable=True: a CPU's sort happens to be
    keep = torch.arange(block_mask.shape[1])[None, :] < counts[:, None]
    return counts, torch.where(keep, order, -1).to(torch.int32)


def visited_by_an_unstable_descending_argsort(block_mask):
    counts = block_mask.sum(dim=1).to(torch.int32)
    order = torch.argsort(block_mask.to(torch.int8), dim=1, descending=True)
    keep = torch.arange(block_mask.shape[1])[None, :] < counts[:, None]
    return counts, torch.where(keep, order, -1).to(torch.int32)


def visited_through_tolist(block_mask):
    counts, indices = given.visited_key_blocks(block_mask)
    return torch.tensor(counts.tolist(), dtype=torch.int32), indices


def visited_forbidden_blocks(block_mask):
    return given.visited_key_blocks(~block_mask)


def visited_columns(block_mask):
    return given.visited_key_blocks(block_mask.T.contiguous())


def check_visited(candidate):
    return check("ch09_moe.visited_key_blocks", candidate, given.visited_key_blocks_reference, given.block_mask_cases,
                 compare=given.diagnose_visited_blocks, rules=given.visited_rules(),
                 diagnose=given.diagnose_visited_cause)


def test_visited_blocks_solution_solves():
    assert check_visited(given.visited_key_blocks).solved


def test_the_production_block_lists_pass_the_same_check():
    """``block_lists`` leaves the not-allowed blocks in each row's tail, not -1: the check reads only the
    first ``counts[q]`` entries of a row, as the kernel does."""

    def production(block_mask):
        lists = block_lists(block_mask, 16)
        return lists.counts, lists.indices

    assert check_visited(production).solved


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (visited_numbered_from_one, "every one is one too high"),
    (visited_at_least_one_block, "a row with nothing allowed visits nothing"),
    (visited_in_decreasing_order, "the right blocks in the wrong order"),
    (visited_as_int64, "wrong dtype"),
    (visited_forbidden_first, "cause: the sort put the forbidden blocks first"),
    (visited_row_by_row, "broke a stated rule — the spec asks for tensor ops only, no .item(): the lists stay on the "
                         "device, no host sync: a Python for loop at line"),
    (visited_with_item, "broke a stated rule — the spec asks for tensor ops only, no .item(): the lists stay on the "
                        "device, no host sync: the code took values to the host: .item()"),
    (visited_through_tolist, "the code took values to the host: .tolist()"),
    (visited_by_an_unstable_sort, "broke a stated rule — the spec asks for a stable sort (equal keys keep their "
                                  "order: the allowed blocks in increasing order): a sort ran without stable=True "
                                  "(aten.sort.default(dim=1))"),
    (visited_by_an_unstable_descending_argsort, "a sort ran without stable=True (aten.sort.default(dim=1, "
                                                "descending=True))"),
    (visited_forbidden_blocks, "cause: the rows list the blocks the mask forbids"),
    (visited_columns, "cause: the counts are per key block (the mask's columns)"),
])
def test_visited_blocks_negative_controls(wrong, diagnosis):
    verdict = check_visited(wrong)
    assert rejected(verdict, diagnosis), verdict.message


# ----------------------------------------------------------------------------------------------
# The diagnoses' other branches, on answers made by hand
# ----------------------------------------------------------------------------------------------


def _i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


_ROUTED = (torch.tensor([[0.6, 0.4], [0.7, 0.3]]), _i32([[1, 0], [2, 3]]))
_SORTED = (_i32([1, 3, 0, 2]), _i32([2, 3, 4]))  # entries 1, 3 on expert 0, 0 on 1, 2 on 2
_VISITED = (_i32([2, 1, 0]), _i32([[0, 3, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1]]))


@pytest.mark.parametrize(("diagnose", "got", "expected", "diagnosis"), [
    (given.diagnose_routing, _ROUTED, _ROUTED, None),
    (given.diagnose_routing, (_ROUTED[0], _i32([[1, -2**31], [2, 3]])), _ROUTED, "never written"),
    (given.diagnose_routing, (_ROUTED[0], _i32([[2, 3], [1, 0]])), _ROUTED, "every id is wrong"),
    (given.diagnose_routing, (torch.tensor([[0.5, 0.3], [0.7, 0.3]]), _ROUTED[1]), _ROUTED, "token 0's sum to 0.8"),
    (given.diagnose_routing, (torch.tensor([[0.7, 0.3], [0.7, 0.3]]), _ROUTED[1]), _ROUTED,
     "weights: wrong values in 2 of 4 elements, first at index (0, 0): got 0.7, expected 0.6"),
    (given.diagnose_counting_sort, _SORTED, _SORTED, None),
    (given.diagnose_counting_sort, _SORTED[0], _SORTED, "expected a tuple (permutation, offsets)"),
    (given.diagnose_counting_sort, (_SORTED[0], _i32([2, 2, 4])), _SORTED, "offsets: wrong values in 1 of 3"),
    (given.diagnose_counting_sort, (_i32([1, 0, 3, 2]), _SORTED[1]), _SORTED,
     "permutation: wrong values in 2 of 4 elements, first at index 1: got 0, expected 3"),
    (given.diagnose_counting_sort, (_SORTED[0].long(), _SORTED[1]), _SORTED, "permutation: wrong dtype"),
    (given.diagnose_counting_sort, (_SORTED[0], _i32([2, 3])), _SORTED,  # the last expert's end left out
     "one end per expert, the empty ones too: 3 of them (a one-hot of width num_experts"),
    (given.diagnose_tile_map, [[0, 0, 4]], [(0, 0, 4)], None),  # lists for tuples are fine
    (given.diagnose_tile_map, 5, [(0, 0, 4)], "expected a list of (group, first row, end row) tuples"),
    (given.diagnose_tile_map, [(0, 0, 4), (0, 4, 4)], [(0, 0, 4)], "the tile (0, 4, 4) holds no rows"),
    (given.diagnose_tile_map, [(0, 0, 4), (0, 2, 4)], [(0, 0, 4)], "some rows are in two tiles"),
    (given.diagnose_tile_map, [(0, 0, 2), (0, 2, 4), (0, 4, 6)], [(0, 0, 4), (0, 4, 6)],
     "got 3 tiles, expected 2; the first difference is tile 0: got (0, 0, 2), expected (0, 0, 4)"),
    (given.diagnose_tile_map, [(0, 0, 2), (0, 4, 6)], [(0, 0, 4), (0, 4, 6)],
     "rows 2..3 of group 0 (rows 0..5) are in no tile"),
    (given.diagnose_visited_blocks, _VISITED, _VISITED, None),
    (given.diagnose_visited_blocks, (_VISITED[0], _i32([[0, 3, 1, 2], [2, 0, 1, 3], [0, 1, 2, 3]])), _VISITED,
     None),  # the tails are never read
    (given.diagnose_visited_blocks, (_i32([1, 1, 0]), _VISITED[1]), _VISITED,
     "counts wrong at query block(s) 0: got [1], expected [2]"),
    (given.diagnose_visited_blocks, (_VISITED[0], _i32([[0, 2, -1, -1], [2, -1, -1, -1], [-1] * 4])), _VISITED,
     "query block 0 visits key blocks [0, 2], expected [0, 3] (1 of 3 rows wrong"),
    (given.diagnose_visited_blocks, (_VISITED[0], _VISITED[1][:, :2]), _VISITED, "indices: wrong shape (3, 2)"),
])
def test_the_diagnoses_on_hand_made_answers(diagnose, got, expected, diagnosis):
    said = diagnose(got, expected)
    if diagnosis is None:
        assert said is None, said
    else:
        assert said is not None and diagnosis in said, said


# ----------------------------------------------------------------------------------------------
# Exercise 6: DeepSeek-V3's group-limited top-k with bias correction
# ----------------------------------------------------------------------------------------------


def _router(logits, bias, k, num_groups, topk_groups, renormalize, scale, *, weigh=None, group_score=None,
            fill=float("-inf"), limit=True, rank_bias=True, scores=None, normalize_first=True, normalize=True,
            choose=None, groups_by_scores=False):
    """A torch-ops router with parts swapped for wrong ones (the negative controls below)."""
    tokens, experts = logits.shape
    scores = torch.sigmoid(logits) if scores is None else scores(logits)
    choice = choose(logits, bias) if choose else (scores + bias if rank_bias else scores)
    if limit:
        grouped = (scores if groups_by_scores else choice).view(tokens, num_groups, -1)
        ranked = group_score(grouped) if group_score else grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // num_groups, dim=1), fill)
    ids = choice.topk(k, dim=-1).indices
    weights = (weigh(scores, bias) if weigh else scores).gather(1, ids)
    if not normalize_first:
        weights = weights * scale
    if renormalize and normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scale if normalize_first else weights), ids


def topk_bias_in_the_weights(*case):
    return _router(*case, weigh=lambda s, b: s + b)


def topk_group_max(*case):
    return _router(*case, group_score=lambda g: g.max(dim=-1).values)


def topk_scaled_not_renormalized(*case):
    return _router(*case, normalize=False)


def topk_scaled_then_renormalized(*case):
    return _router(*case, normalize_first=False)


def topk_zero_fill(*case):
    return _router(*case, fill=0.0)


def topk_without_the_group_limit(*case):
    return _router(*case, limit=False)


def topk_bias_not_in_the_choice(*case):
    return _router(*case, rank_bias=False)


def topk_softmax_scores(*case):
    return _router(*case, scores=lambda x: torch.softmax(x, dim=-1))


def topk_token_by_token(logits, bias, *rest):
    rows = [given.grouped_topk(logits[t:t + 1], bias, *rest) for t in range(logits.shape[0])]  # a Python loop
    return torch.cat([w for w, _ in rows]), torch.cat([i for _, i in rows])


def topk_with_item(logits, bias, k, num_groups, topk_groups, renormalize, scale):
    weights, ids = given.grouped_topk(logits, bias, k, num_groups, topk_groups, renormalize, scale)
    return weights * (weights.sum() / weights.sum()).item(), ids  # a host sync


def topk_int32_ids(*case):
    weights, ids = given.grouped_topk(*case)
    return weights, ids.to(torch.int32)


def topk_float64_weights(*case):
    weights, ids = given.grouped_topk(*case)
    return weights.double(), ids


def topk_scaled_only_when_renormalized(logits, bias, k, num_groups, topk_groups, renormalize, scale):
    weights, ids = _router(logits, bias, k, num_groups, topk_groups, renormalize, 1.0)
    return (weights * scale if renormalize else weights), ids


def topk_always_renormalized(logits, bias, k, num_groups, topk_groups, renormalize, scale):
    return _router(logits, bias, k, num_groups, topk_groups, True, scale)


def topk_minus_one_fill(*case):
    return _router(*case, fill=-1.0)  # "the choices are sigmoid scores, in (0, 1)": not with a bias


def topk_bias_before_the_sigmoid(*case):
    return _router(*case, choose=lambda logits, bias: torch.sigmoid(logits + bias))


def topk_groups_by_unbiased_scores(*case):
    return _router(*case, groups_by_scores=True)


def topk_through_nonzero(logits, bias, k, num_groups, topk_groups, renormalize, scale):
    weights, ids = given.grouped_topk(logits, bias, k, num_groups, topk_groups, renormalize, scale)
    every = torch.nonzero(torch.ones_like(ids, dtype=torch.bool))  # all of them: the right ids, after a sync
    return weights, ids[every[:, 0], every[:, 1]].view_as(ids)


def topk_by_the_library(logits, bias, k, num_groups, topk_groups, renormalize, scale):
    return kernel_ladder.topk_routing(logits, k, renormalize, "sigmoid", bias=bias, num_groups=num_groups,
                                      topk_groups=topk_groups, scale=scale)


def topk_sigmoid_in_place(logits, bias, *rest):
    logits.sigmoid_()  # the scores, over the caller's logits
    return given.grouped_topk(torch.logit(logits.double()).float(), bias, *rest)


def topk_clearing_the_bias(*case):
    weights, ids = given.grouped_topk(*case)
    case[1].zero_()  # the caller's bias, reset
    return weights, ids


def topk_in_k_argmax_rounds(logits, bias, k, num_groups, topk_groups, renormalize, scale):
    """Right, as the kernel does it: k argmax rounds, each over every token at once."""
    tokens, experts = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + bias
    ranked = choice.view(tokens, num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(topk_groups, dim=-1).indices, True)
    choice = choice.masked_fill(~kept.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    picks = []
    for _ in range(k):
        best = choice.argmax(dim=-1, keepdim=True)
        picks.append(best)
        choice = choice.scatter(1, best, float("-inf"))
    ids = torch.cat(picks, dim=1)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, ids


def check_grouped_topk(candidate):
    return check("ch09_moe.grouped_topk", candidate, given.grouped_topk_reference, given.grouped_topk_cases,
                 compare=given.diagnose_grouped_topk, rules=given.grouped_topk_rules(),
                 diagnose=given.diagnose_grouped_topk_cause)


def test_grouped_topk_solution_solves():
    assert check_grouped_topk(given.grouped_topk).solved


def test_k_argmax_rounds_in_a_python_loop_solve():
    """The spec allows a loop over range(k): k rounds, each over every token, as the kernel does them."""
    verdict = check_grouped_topk(topk_in_k_argmax_rounds)
    assert verdict.solved, verdict.message


def test_the_cases_tell_the_scale_and_the_fill_apart():
    """A case without renormalization has a scale other than 1; a kept expert's biased choice is below -1.5."""
    cases = given.grouped_topk_cases(torch.Generator().manual_seed(0))
    assert any(not renormalize and scale != 1.0 for *_, renormalize, scale in cases)
    lowest_kept = []
    for logits, bias, k, num_groups, topk_groups, renormalize, scale in cases:
        choice = torch.sigmoid(logits.double()) + bias.double()
        _, ids = given.grouped_topk_reference(logits, bias, k, num_groups, topk_groups, renormalize, scale)
        lowest_kept.append(float(choice.gather(1, ids).min()))
    assert min(lowest_kept) < -1.5, lowest_kept


def test_the_production_grouped_router_passes_the_same_check():
    """The library's router gives the check's values; it is not tensor ops, so that rule alone rejects it."""
    verdict = check("ch09_moe.grouped_topk", topk_by_the_library, given.grouped_topk_reference,
                    given.grouped_topk_cases, compare=given.diagnose_grouped_topk,
                    rules=library_checked(given.grouped_topk_rules()), diagnose=given.diagnose_grouped_topk_cause)
    assert verdict.solved, verdict.message


@pytest.mark.parametrize("wrong", [topk_int32_ids, topk_float64_weights])
def test_a_wrong_dtype_alone_gets_no_cause(wrong):
    verdict = check_grouped_topk(wrong)
    assert rejected(verdict, "wrong dtype") and "cause:" not in verdict.message, verdict.message


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (topk_bias_in_the_weights, "cause: the bias is in the weights"),
    (topk_group_max, "cause: each group is scored by its largest choice"),
    (topk_scaled_not_renormalized, "cause: the weights were scaled without being renormalized first"),
    (topk_scaled_then_renormalized, "cause: the scale is missing (or was applied before the renormalization"),
    (topk_zero_fill, "cause: the dropped groups' experts were filled with a finite value (0, -1, ...), not -inf"),
    (topk_without_the_group_limit, "cause: the group limit is missing"),
    (topk_bias_not_in_the_choice, "cause: the bias was left out of the choice"),
    (topk_softmax_scores, "cause: the scores are a softmax"),
    (topk_token_by_token, "broke a stated rule — the spec asks for tensor ops only: a router runs on the device, "
                          "every token at once"),
    (topk_with_item, "the code took values to the host: .item()"),
    (topk_int32_ids, "ids: wrong dtype torch.int32"),
    (topk_float64_weights, "weights: wrong dtype torch.float64"),
    (topk_scaled_only_when_renormalized, "cause: the weights were not scaled when renormalize is False"),
    (topk_minus_one_fill, "cause: the dropped groups' experts were filled with a finite value"),
    (topk_always_renormalized, "cause: the weights were renormalized although renormalize is False"),
    (topk_bias_before_the_sigmoid, "cause: the bias was added to the logits before the sigmoid, not to the scores"),
    (topk_groups_by_unbiased_scores, "cause: the groups were ranked by the unbiased scores"),
    (topk_through_nonzero, "broke a stated rule — the spec asks for tensor ops only: a router runs on the device, "
                           "every token at once"),
    (topk_through_nonzero, "the code made the host wait for the device: nonzero"),
    (topk_by_the_library, "the code called kernel_ladder's op kernel_ladder::topk_routing"),
    (topk_sigmoid_in_place, "the code changed logits in place"),
    (topk_clearing_the_bias, "the code changed bias in place"),
])
def test_grouped_topk_negative_controls(wrong, diagnosis):
    verdict = check_grouped_topk(wrong)
    if diagnosis.startswith("cause: "):  # the cause named, alone or among the ones its failing case cannot tell apart
        message = " ".join(verdict.message.split())
        assert not verdict.solved and "cause: " in message, verdict.message
        assert diagnosis.removeprefix("cause: ") in message[message.index("cause: "):], verdict.message
    else:
        assert rejected(verdict, diagnosis), verdict.message
