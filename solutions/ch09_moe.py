"""Solutions to chapter 09, sparse ops and mixture of experts: the routing kernel, the counting sort,
the grouped GEMM's tile map, the weighted combine, block skipping, DeepSeek-V3's group-limited top-k.

One solution per exercise of ``chapters/09_moe/09_moe.ipynb``, written for reading, and what the
chapter gives: each exercise's cases, its reference (written apart from the solution), the rules
its spec states, its diagnosis (the common mistakes named) and, where the chapter teaches bytes,
its traffic verdict against the library's op, which the notebook's checks and
``tests/test_solutions_ch09.py`` both import.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "router_inputs",
    "topk_routing_kernel",
    "launch_topk_routing",
    "routing_reference",
    "routing_cases",
    "diagnose_routing",
    "diagnose_routing_cause",
    "routing_traffic",
    "routing_rules",
    "counting_sort",
    "counting_sort_reference",
    "counting_sort_cases",
    "diagnose_counting_sort",
    "counting_sort_rules",
    "counting_sort_traffic",
    "grouped_tile_map",
    "grouped_tile_map_reference",
    "tile_map_cases",
    "diagnose_tile_map",
    "combine",
    "combine_reference",
    "combine_cases",
    "combine_rules",
    "combine_mistakes",
    "diagnose_combine",
    "combine_traffic",
    "visited_key_blocks",
    "visited_key_blocks_reference",
    "block_mask_cases",
    "diagnose_visited_blocks",
    "visited_rules",
    "diagnose_visited_cause",
    "grouped_topk",
    "grouped_topk_reference",
    "grouped_topk_cases",
    "grouped_topk_rules",
    "grouped_topk_mistakes",
    "diagnose_grouped_topk",
    "diagnose_grouped_topk_cause",
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
    remaining = tl.where(valid, p, -1.0)  # masked experts can never win
    # The K winners collect in registers, slot j in lane j (K <= E <= BLOCK_E), and are stored once:
    # renormalising then needs no read-back of what this program stored.
    top_w = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    top_id = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        # the lowest expert id among those equal to the maximum
        idx = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), axis=1)
        top_w = tl.where(experts[None, :] == j, best[:, None], top_w)
        top_id = tl.where(experts[None, :] == j, idx[:, None], top_id)
        remaining = tl.where(experts[None, :] == idx[:, None], -1.0, remaining)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    slots = (rows[:, None] < num_tokens) & (experts[None, :] < K)
    tl.store(weights_ptr + rows[:, None] * stride_wt + experts[None, :], top_w, mask=slots)
    tl.store(ids_ptr + rows[:, None] * stride_it + experts[None, :], top_id, mask=slots)


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
    """Mixtral's router in float64: softmax, the ``k`` largest, optionally renormalised. A stable
    descending sort, not ``torch.topk`` (whose order among equal values is unspecified: on the CPU
    it does not pick the lowest ids), so that ties go to the lowest expert id, as the kernel must."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def routing_cases(gen: torch.Generator) -> list[tuple]:
    """Token counts off the block, 8 to 60 experts, top 1, 2, 3 and 6, both renormalisations, and
    logits on a coarse grid: many exact ties, and a token whose experts all tie; last, logits far
    from 0 — tokens near +100 (``exp`` overflows float32 above 88.7) and near −200 (it underflows
    to 0, and 0 / 0 is NaN) — which only a softmax that subtracts each token's maximum survives.
    Their spread is ±2, so that the k largest probabilities stay well apart from each other and
    from underflow: the same experts win in fp32 as in float64."""
    cases = []
    for tokens, experts, k, renormalize in ((37, 8, 2, True), (5, 60, 6, False), (20, 16, 1, True), (16, 8, 2, False)):
        cases.append((torch.randn(tokens, experts, generator=gen).to(kernel_ladder.runtime.DEVICE) * 2, k, renormalize))
    ties = torch.randint(-3, 4, (24, 8), generator=gen).float() / 2
    ties[0] = 0.0
    cases.append((ties.to(kernel_ladder.runtime.DEVICE), 3, True))
    far = torch.randn(21, 8, generator=gen) * 2
    far[::2] += 100.0
    far[1::2] -= 200.0
    # One token mixes both: its other seven probabilities underflow to 0 in fp32 (exactly equal logits,
    # so float64's tiny equal values tie the same way), and a winner masked out with 0 wins again.
    far[-1] = torch.tensor([100.0] + [-200.0] * 7)
    cases.append((far.to(kernel_ladder.runtime.DEVICE), 2, False))
    return cases


def _routing_ideal(logits: torch.Tensor, k: int, renormalize: bool) -> int:
    """The routing's floor: the logits read once, the (T, k) fp32 weights and int32 ids written once."""
    return logits.numel() * logits.element_size() + 2 * logits.shape[0] * k * 4


def _routing_top(logits: torch.Tensor, k: int, renormalize: bool) -> int:
    """The bytes ``kernel_ladder.topk_routing`` moves on the same logits (traced)."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        kernel_ladder.topk_routing(logits, k, renormalize=renormalize)
    return traced.bytes


def routing_traffic():
    """Exercise 1's traffic verdict: the logits read once, the k winners written once (the library's kernel)."""
    from utils.exercises import Traffic

    return Traffic(ideal=_routing_ideal, top=_routing_top)


def routing_rules() -> list:
    """Exercise 1's stated rule (Hint 1): the weights are stored once, from registers — a kernel that
    stores them, loads them back to renormalise and stores again has no guarantee on a GPU."""
    from utils.exercises import rules

    return [rules.stores_each_output_once(why="the spec stores each weight once (Hint 1: a program's read-back of "
                                              "its own stores is not guaranteed on a GPU)")]


def diagnose_routing_cause(case: tuple, got, expected) -> str | None:
    """Exercise 1's causes that need the logits: the padding lanes past ``E`` taking part in the
    softmax (loaded as 0, not ``-inf``), or the k largest logits' raw values as the weights."""
    logits, k, renormalize = case
    weights = got[0].detach().cpu().double()
    logits = logits.detach().cpu().double()
    lanes = max(16, triton.next_power_of_2(logits.shape[1]))
    padded = torch.cat([logits, torch.zeros(logits.shape[0], lanes - logits.shape[1], dtype=torch.float64)], dim=1)
    variants = (
        (f"the lanes past the {logits.shape[1]} experts (up to BLOCK_E = {lanes}) take part in the softmax as logits "
         "of 0: load them with other=float('-inf') (or mask them out of the sum), so they get probability 0",
         torch.softmax(padded, dim=-1), renormalize),
        ("the weights are the logits themselves: a weight is the expert's softmax probability (renormalised if "
         "asked)", logits, False),
    )
    for cause, scores, renormalized in variants:
        top = torch.sort(scores, dim=-1, descending=True, stable=True).values[:, :k]
        if renormalized:
            top = top / top.sum(dim=-1, keepdim=True)
        if weights.shape == top.shape and torch.allclose(weights, top, rtol=1e-4, atol=1e-6, equal_nan=True):
            return cause
    return None


def _differences(label: str, got: object, expected: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """What differs between a returned tensor and the expected one, in one sentence (None if nothing)."""
    if not isinstance(got, torch.Tensor):
        return f"{label}: returned {type(got).__name__}, expected a tensor"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{label}: wrong shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"{label}: wrong dtype {got.dtype}, expected {expected.dtype}"
    g, e = got.detach().cpu(), expected.detach().cpu()
    if e.dtype.is_floating_point:
        bad = ~torch.isclose(g.double(), e.double(), rtol=rtol, atol=atol)
    else:
        bad = g != e
    count = int(bad.sum())
    if not count:
        return None
    first = tuple(int(i) for i in bad.nonzero()[0])

    def fmt(v: torch.Tensor) -> str:
        return f"{v.item():.6g}" if v.dtype.is_floating_point else str(v.item())

    return (f"{label}: wrong values in {count} of {e.numel()} elements, first at index "
            f"{first if len(first) > 1 else first[0]}: got {fmt(g[first])}, expected {fmt(e[first])}")


def diagnose_routing(got, expected) -> str | None:
    """The check's comparison for exercise 1 (``out=True``: ``got`` is the written ``(weights, ids)``):
    None if the weights (float32's tolerance) and the ids match, else what is wrong — an expert
    chosen twice, the renormalisation, a tie, or where the values differ."""
    (weights, ids), (want_weights, want_ids) = got, expected
    weights, ids = weights.detach().cpu().double(), ids.detach().cpu()
    want_weights, want_ids = want_weights.cpu().double(), want_ids.cpu()
    weights_bad = ~torch.isclose(weights, want_weights, rtol=1e-5, atol=1e-6)
    ids_bad = ids != want_ids
    if not weights_bad.any() and not ids_bad.any():
        return None
    poison = torch.iinfo(ids.dtype).min
    if (ids == poison).any():
        return (f"ids: {int((ids == poison).sum())} of {ids.numel()} never written (still the poison {poison}), "
                f"first at token {int((ids == poison).nonzero()[0, 0])}")
    overflow = ("exp overflows float32 for a logit above 88.7 and underflows to 0 below -103 (0 / 0 is NaN), and "
                "this check has logits near +100 and -200: subtract each token's largest logit before exp, as "
                "chapter 02's softmax does")
    nonfinite = ~torch.isfinite(weights).all(dim=1)
    if nonfinite.any():
        t = int(nonfinite.nonzero()[0, 0])
        return f"token {t}'s weights are {weights[t].tolist()}: NaN/inf — {overflow}"
    negative = (weights < 0).any(dim=1)
    if negative.any():
        t = int(negative.nonzero()[0, 0])
        return (f"token {t}'s weights are {weights[t].tolist()} (ids {ids[t].tolist()}): no probability is below 0, "
                "so the winners were masked lanes (-1): none of the token's probabilities won a comparison, as NaNs "
                f"do not (tl.max skips them) — {overflow}")
    repeated = ((ids[:, :, None] == ids[:, None, :]).sum(dim=-1) > 1).any(dim=1)
    if repeated.any():
        t = int(repeated.nonzero()[0, 0])
        row = ids[t].tolist()
        e = next(i for i in row if row.count(i) > 1)
        text = (f"token {t} got expert {e} twice (ids {row}, expected {want_ids[t].tolist()}): mask each round's "
                "winner out before the next round, so that a token's k experts are distinct")
        if (want_weights[t] == 0).any():
            text += (f" — token {t}'s other probabilities underflow to 0 (its logits lie far below its largest), so a "
                     "winner masked out with 0 ties with them and wins again: mask it with -1, below any probability")
        return text
    if torch.isfinite(weights).all() and not ids_bad.any():
        sums, ones = weights.sum(dim=1), torch.ones(len(weights), dtype=torch.float64)
        asked = torch.allclose(want_weights.sum(dim=1), ones, atol=1e-5)  # renormalize=True (with k < E)
        if asked and not torch.allclose(sums, ones, atol=1e-5):
            if torch.allclose(weights / sums[:, None], want_weights, rtol=1e-4, atol=1e-6):
                return ("the weights are the chosen experts' softmax probabilities, not renormalised: this case has "
                        "renormalize=True (Mixtral): divide them by their sum, so that a token's k weights sum to 1")
            t = int((~torch.isclose(sums, ones, atol=1e-5)).nonzero()[0, 0])
            return f"with renormalize=True a token's k weights sum to 1; token {t}'s sum to {float(sums[t]):.6g}"
        if not asked and torch.allclose(sums, ones, atol=1e-5):
            return ("each token's weights sum to 1, but this case has renormalize=False (Qwen2-MoE): the weights are "
                    "the chosen experts' own probabilities from the softmax over all E experts (they sum to less "
                    "than 1) — neither renormalised nor a softmax over the k chosen logits")
    if not weights_bad.any():
        t = int(ids_bad.any(dim=1).nonzero()[0, 0])
        if ids_bad.all():
            return (f"the weights are right but every id is wrong (token {t}: got {ids[t].tolist()}, expected "
                    f"{want_ids[t].tolist()}): an id is the index of the expert whose probability is its weight")
        return (f"the weights are right but {int(ids_bad.sum())} of {ids.numel()} ids are not, first at token {t}: "
                f"got {ids[t].tolist()}, expected {want_ids[t].tolist()} — the same weights under other ids: "
                "a tie (experts of equal probability) goes to the lowest expert id")
    problems = [_differences("weights", weights.float(), want_weights.float(), 1e-5, 1e-6),
                _differences("ids", ids, want_ids)]
    return "; ".join(p for p in problems if p)


# ----------------------------------------------------------------------------------------------
# Exercise 2: the counting sort
# ----------------------------------------------------------------------------------------------


def counting_sort(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``(T, k)`` routing entries by expert, stably, without a comparison sort.

    1. ``counts[e]`` = entries routed to ``e`` (a histogram: the column sums of a one-hot ``(N, E)``
       matrix of width ``E`` — ``torch.bincount`` would size its output by the largest id, which a GPU
       must send to the host first);
    2. ``offsets = cumsum(counts)`` — each expert's end; its start is the previous end;
    3. each entry's position = its expert's start + how many entries of the same expert came
       before it (its rank within the expert, from a running count per expert).

    Returns ``permutation`` (``T·k``, int32: sorted position -> flat entry index ``t·k + j``) and
    ``offsets`` (``E``, int32, cumulative ends: the grouped GEMM's convention).
    """
    flat = expert_ids.reshape(-1).long()
    one_hot = torch.nn.functional.one_hot(flat, num_experts)  # (N, E): its width given, no host sync
    counts = one_hot.sum(dim=0)
    offsets = torch.cumsum(counts, dim=0)
    starts = offsets - counts
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
    """Random routes, an expert nobody chose, every token on one expert, one token; last, 1,024
    entries on 4 experts (hundreds of equal keys each: an order that is not stable shows), the case
    the traffic is measured on."""
    cases = []
    for tokens, k, experts in ((50, 2, 8), (9, 1, 6), (31, 3, 16)):
        ids = torch.randint(0, experts, (tokens, k), generator=gen)
        ids[ids == 3] = 4  # expert 3 gets nothing
        cases.append((ids.to(torch.int32), experts))
    cases.append((torch.full((12, 2), 5, dtype=torch.int32), 8))
    cases.append((torch.tensor([[7, 0]], dtype=torch.int32), 8))
    cases.append((torch.randint(0, 4, (512, 2), generator=gen).to(torch.int32), 4))
    return cases


def counting_sort_rules() -> list:
    """Exercise 2's stated rules: no comparison sort (torch.unique and torch.topk sort too), tensor ops only."""
    from utils.exercises import rules

    return [rules.forbids("torch.sort", "torch.argsort", "torch.msort", "torch.topk", "torch.unique",
                          "torch.kthvalue",
                          why="the spec asks for a counting sort (a histogram, a prefix sum and ranks), no "
                              "comparison sort"),
            rules.tensor_ops_only(why="the spec asks for tensor ops only (a Python loop or a round trip through "
                                      "the host runs on the CPU while a GPU waits)")]


def _counting_sort_ideal(expert_ids: torch.Tensor, num_experts: int) -> int:
    """The ids read once, the permutation and the offsets written once (int32)."""
    return expert_ids.numel() * expert_ids.element_size() + expert_ids.numel() * 4 + num_experts * 4


def _counting_sort_top(expert_ids: torch.Tensor, num_experts: int) -> int:
    """The bytes ``kernel_ladder.moe_permute`` (histogram, scan, scatter kernels) moves on the same ids."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        kernel_ladder.moe_permute(expert_ids, num_experts)
    return traced.bytes


def _counting_sort_explain(case: tuple, reread: dict[str, float], ops) -> str:
    """What the ops the tracer saw show: a one-hot matrix and its scan, an all-pairs matrix, or torch ops."""
    expert_ids, num_experts = case
    entries = expert_ids.numel()
    one_hot = any(op.name.startswith(("aten.one_hot", "aten.scatter")) and op.bytes_written >= entries * num_experts
                  for op in ops)
    scanned = any(op.name.startswith("aten.cumsum") and op.bytes_read >= entries * num_experts for op in ops)
    pairs = entries > num_experts and any(op.bytes_written >= entries * entries for op in ops)
    if one_hot and scanned:
        how = ("each torch op writes its result and the next reads it back (ranks taken from a one-hot (T·k, E) "
               "matrix and its cumulative sum move E times the entries, twice)")
    elif one_hot:
        how = ("each torch op writes its result and the next reads it back (a one-hot (T·k, E) matrix: E times the "
               "entries)")
    elif pairs:
        how = ("each torch op writes its result and the next reads it back (an op wrote a (T·k, T·k) matrix: "
               "T·k times the entries)")
    elif len(ops) > 1:
        how = "each torch op writes its result and the next reads it back"
    else:
        return "kernel_ladder.moe_permute's three kernels read the ids twice and write each result once"
    return how + "; kernel_ladder.moe_permute's three kernels read the ids twice and write each result once"


def counting_sort_traffic():
    """Exercise 2's traffic verdict against ``kernel_ladder.moe_permute``."""
    from utils.exercises import Traffic

    return Traffic(ideal=_counting_sort_ideal, top=_counting_sort_top, explain_ops=_counting_sort_explain)


def _few(values: torch.Tensor, limit: int = 8) -> str:
    """The first ``limit`` values of a 1-D tensor as a list, ``…`` if there are more."""
    items = [str(v) for v in values[:limit].tolist()] + (["…"] if len(values) > limit else [])
    return "[" + ", ".join(items) + "]"


def diagnose_counting_sort(got, expected) -> str | None:
    """The check's comparison for exercise 2: None if ``(permutation, offsets)`` match, else what is
    wrong — starts for ends, counts for ends, an unstable order, the inverse permutation, or where."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"returned {type(got).__name__}, expected a tuple (permutation, offsets)"
    (permutation, offsets), (want_permutation, want_offsets) = got, expected
    form = [_differences(label, g, e) for label, g, e in (("permutation", permutation, want_permutation),
                                                           ("offsets", offsets, want_offsets))]
    form = [p for p in form if p and "wrong values" not in p]
    if form:
        if (isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.dtype == want_offsets.dtype
                and len(offsets) < len(want_offsets)):
            form.append(f"one end per expert, the empty ones too: {len(want_offsets)} of them (a one-hot of width "
                        "num_experts: one_hot(flat, num_experts))")
        return "; ".join(form)
    permutation, offsets = permutation.detach().cpu().long(), offsets.detach().cpu().long()
    want_permutation, want_offsets = want_permutation.cpu().long(), want_offsets.cpu().long()
    problems = []
    if not torch.equal(offsets, want_offsets):
        counts = torch.diff(want_offsets, prepend=want_offsets.new_zeros(1))
        if torch.equal(offsets, want_offsets - counts):
            problems.append("offsets are each expert's start (an exclusive scan), not its end: offsets[e] = the "
                            "entries routed to experts 0..e, the inclusive cumsum of the counts (the grouped "
                            "GEMM's convention)")
        elif torch.equal(offsets, counts):
            problems.append("offsets are the counts (the histogram) themselves: take their cumulative sum, "
                            "each expert's end")
        else:
            problems.append(_differences("offsets", offsets, want_offsets))
    if not torch.equal(permutation, want_permutation):
        n = want_permutation.numel()
        positions = torch.arange(n)
        inverse = torch.empty_like(want_permutation)
        inverse[want_permutation] = positions
        if n > 1 and torch.equal(permutation[1:], want_permutation[:-1]):
            problems.append("each entry sits one position after its place: an entry's rank counts itself (the "
                            "cumulative sum includes the entry) — its rank is the number of earlier entries of its "
                            "expert, cumsum - 1, so that an expert's first entry lands at its start")
        elif not torch.equal(torch.sort(permutation).values, positions):
            problems.append(f"permutation is not a permutation of the {n} entries (each flat index t·k + j "
                            f"once); {_differences('permutation', permutation, want_permutation)}")
        elif torch.equal(permutation, inverse):
            problems.append("permutation is inverted: it holds each entry's sorted position; the check wants the "
                            "entry at each sorted position (permutation[position] = t·k + j)")
        else:
            expert_at = torch.searchsorted(want_offsets, positions, right=True)  # the expert of each position
            expert_of = torch.empty_like(expert_at)
            expert_of[want_permutation] = expert_at
            if torch.equal(expert_of[permutation], expert_at):
                e = int(expert_at[int((permutation != want_permutation).nonzero()[0, 0])])
                rows = expert_at == e
                problems.append(f"every entry is in its expert's rows, but not in its original order (expert {e}: "
                                f"got entries {_few(permutation[rows])}, expected {_few(want_permutation[rows])}): "
                                "the sort must be stable — within an expert, increasing t·k + j")
            else:
                problems.append(_differences("permutation", permutation, want_permutation))
    return "; ".join(problems) or None


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


def _row_runs(rows: list[int]) -> str:
    """``[0, 1, 2, 7]`` -> ``'0..2, 7'``."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _tile_map_mistake(got: list[tuple[int, int, int]], expected: list[tuple[int, int, int]]) -> str | None:
    """The common wrong tile maps that the expected tiles alone reveal: offsets read as starts, group 0
    skipped, every group id off by one."""
    expected = [tuple(t) for t in expected]
    if got and got == [(g - 1, a, b) for g, a, b in expected if g >= 1]:
        return ("offsets were read as each group's start: offsets[g] is group g's end (the cumulative count), its "
                "start is offsets[g - 1] (0 for group 0) — here each group got the next group's rows, and group 0's "
                "own rows (from 0) are in no tile")
    for shift, word in ((1, "high"), (-1, "low")):
        if got and got == [(g + shift, a, b) for g, a, b in expected]:
            return (f"every tile's group is one too {word} (got {got[0]}, expected {expected[0]}): groups are "
                    "numbered from 0, as enumerate(offsets) numbers them")
    group0 = [t for t in expected if t[0] == 0]
    if group0 and got == [t for t in expected if t[0] != 0]:
        return (f"group 0 (rows 0..{group0[-1][2] - 1}) has no tiles: the loop over the groups skips it — group 0's "
                "rows start at 0, before offsets[0], its end")
    return None


def diagnose_tile_map(got, expected) -> str | None:
    """The check's comparison for exercise 3: None if the tiles match, else what is wrong — a tile
    for an empty group, one mixing groups, one longer than ``block_m``, rows in no tile, the order."""
    if got == expected:
        return None
    try:
        got = [(int(g), int(a), int(b)) for g, a, b in got]
    except (TypeError, ValueError):
        return f"returned {str(got)[:60]}: expected a list of (group, first row, end row) tuples"
    if got == expected:
        return None
    if got and len(got) == len(expected) and [(g, a) for g, a, _ in got] == [(g, a) for g, a, _ in expected]:
        if all(b == e - 1 for (_, _, b), (_, _, e) in zip(got, expected)):
            return ("every tile ends one row early: the third number is one past the tile's last row (a Python "
                    "range's end), min(row + block_m, end)")
    named = _tile_map_mistake(got, list(expected))
    if named is not None:
        return named
    if got and len(got) == len(expected) and [g for g, _, _ in got] == [g for g, _, _ in expected]:
        starts: dict[int, int] = {}
        for g, a, _ in expected:
            starts.setdefault(g, a)  # each group's first row
        local = [(g, a + starts[g], b + starts[g]) for g, a, b in got]
        if local == list(expected):
            return ("the rows are numbered within each group (from 0): the tiles index the sorted batch, so group "
                    "g's rows run from offsets[g - 1] (0 for group 0) to offsets[g]")
    bounds: dict[int, tuple[int, int]] = {}
    for g, a, b in expected:
        low, high = bounds.get(g, (a, b))
        bounds[g] = (min(low, a), max(high, b))
    longest = max((b - a for _, a, b in expected), default=0)
    for g, a, b in got:
        if g not in bounds:
            return (f"group {g} has no rows, but got the tile {(g, a, b)}: an empty group has no tiles (a "
                    "program for it would compute nothing)")
    for g, a, b in got:
        low, high = bounds[g]
        if a < low or b > high:
            return (f"the tile {(g, a, b)} reaches outside group {g}'s rows {low}..{high - 1}: a tile holds rows "
                    "of one group only (they multiply different weights) — each group's tiles start at its own "
                    "first row, and its last tile ends at its end")
        if b <= a:
            return f"the tile {(g, a, b)} holds no rows"
        if b - a > longest:
            return (f"the tile {(g, a, b)} holds {b - a} rows, more than the longest right tile ({longest}): a tile "
                    "holds at most block_m rows")
    for g, (low, high) in bounds.items():
        covered = {r for h, a, b in got if h == g for r in range(a, b)}
        missing = [r for r in range(low, high) if r not in covered]
        if missing:
            text = (f"group {g} (rows {low}..{high - 1}) is in no tile" if len(missing) == high - low else
                    f"rows {_row_runs(missing)} of group {g} (rows {low}..{high - 1}) are in no tile")
            if missing == list(range(missing[0], high)) and len(missing) < longest:
                text += (f": its last, partial tile is missing — a group of n rows has ceil(n / block_m) tiles, "
                         f"the last one short ({high - missing[0]} rows here)")
            return text
    if len(got) != len(set(got)) or sum(b - a for _, a, b in got) > sum(b - a for _, a, b in expected):
        return f"some rows are in two tiles: got {len(got)} tiles, expected {len(expected)}"
    if sorted(got) == sorted(expected):
        return "the right tiles in the wrong order: group by group, each group's rows in increasing order"
    i = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))
    return (f"got {len(got)} tiles, expected {len(expected)}; the first difference is tile {i}: got "
            f"{got[i] if i < len(got) else 'none'}, expected {expected[i] if i < len(expected) else 'none'}")


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
    """Top 2, 1 and 3; last, 96 tokens of top 2 over 64 features (the case the traffic is measured on)."""
    cases = []
    for tokens, k, hidden in ((7, 2, 16), (12, 1, 8), (5, 3, 24), (96, 2, 64)):
        permutation = torch.randperm(tokens * k, generator=gen).to(torch.int32)
        weights = torch.rand(tokens, k, generator=gen)
        cases.append((torch.randn(tokens * k, hidden, generator=gen), permutation, weights))
    return cases


def combine_rules() -> list:
    """Exercise 4's stated rules: a gather, no scatter-add (under any name: ``index_put_`` with
    ``accumulate=True`` is one); tensor ops only."""
    from utils.exercises import rules

    return [rules.forbids("Tensor.index_add_", "Tensor.index_add", "Tensor.scatter_add_", "Tensor.scatter_add",
                          "Tensor.scatter_reduce_", "Tensor.scatter_reduce", "Tensor.index_reduce_",
                          "Tensor.index_reduce", "Tensor.index_put_(accumulate=True)",
                          "Tensor.index_put(accumulate=True)", "Tensor.put_(accumulate=True)",
                          "Tensor.put(accumulate=True)",
                          why="the spec asks for a gather, no scatter-add (its order of additions is the "
                              "hardware's, so its sums are not deterministic)"),
            rules.tensor_ops_only(why="the spec asks for torch with no Python loop")]


def combine_mistakes(y_sorted: torch.Tensor, permutation: torch.Tensor,
                     weights: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Common wrong combines, each ``(cause, what it returns)``, in float64."""
    tokens, k = weights.shape
    y, w = y_sorted.double().cpu(), weights.double().cpu()
    perm = permutation.long().cpu()
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    rows = y[inverse].reshape(tokens, k, -1)
    sorted_rows = y[perm].reshape(tokens, k, -1)
    return [
        ("the weights are not applied: out[t] = Σ_j weights[t, j] · y(t, j)", rows.sum(dim=1)),
        ("the k rows are averaged, not summed with the router's weights: the weights already say each expert's "
         "share", (w[..., None] * rows).mean(dim=1)),
        ("y_sorted was gathered through the permutation itself: permutation[p] is the entry at sorted position p, "
         "so entry t·k + j's row is y_sorted[inverse[t·k + j]] with inverse[permutation] = arange(T·k)",
         (w[..., None] * sorted_rows).sum(dim=1)),
        ("the weights were taken in sorted order: row p belongs to entry permutation[p], whose weight is "
         "weights.reshape(-1)[permutation[p]], not weights.reshape(-1)[p]",
         torch.zeros(tokens, y.shape[1], dtype=torch.float64).index_add_(0, perm // k, y * w.reshape(-1, 1))),
    ]


def diagnose_combine(case: tuple, got, expected) -> str | None:
    """Exercise 4's cause: which known wrong combine (:func:`combine_mistakes`) returns ``got``."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    g = got.detach().cpu().double()
    return next((cause for cause, wrong in combine_mistakes(*case)
                 if torch.allclose(g, wrong, rtol=1e-4, atol=1e-5)), None)


def _combine_ideal(y_sorted: torch.Tensor, permutation: torch.Tensor, weights: torch.Tensor) -> int:
    """Every row, index and weight read once, each token's output written once."""
    out = weights.shape[0] * y_sorted.shape[1] * y_sorted.element_size()
    return (y_sorted.numel() * y_sorted.element_size() + permutation.numel() * permutation.element_size()
            + weights.numel() * weights.element_size() + out)


def _combine_top(y_sorted: torch.Tensor, permutation: torch.Tensor, weights: torch.Tensor) -> int:
    """The bytes ``kernel_ladder.moe_combine`` moves on the same inputs (its invert and combine kernels)."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        kernel_ladder.moe_combine(y_sorted, permutation, weights)
    return traced.bytes


def _combine_explain(case: tuple, reread: dict[str, float], ops) -> str:
    """What the ops the tracer saw show: a gather of the rows, the weighting, the sum, a dense matrix product."""
    y_sorted, permutation, weights = case
    rows = y_sorted.numel() * y_sorted.element_size()  # a (T·k, H) copy of the sorted rows
    matrix = weights.shape[0] * permutation.numel()  # a (T, T·k) matrix, at a byte an element at least
    gathered = [op.name for op in ops if op.name.startswith(("aten.index.", "aten.index_select", "aten.gather",
                                                               "aten.take")) and op.bytes_written >= rows]
    weighted = any(op.name.startswith("aten.mul") and op.bytes_written >= rows for op in ops)
    summed = any(op.name.startswith("aten.sum") and op.bytes_read >= rows for op in ops)
    product = any(op.name.startswith(("aten.mm", "aten.addmm", "aten.bmm")) and op.bytes_read >= matrix for op in ops)
    parts = []
    if gathered:
        parts.append(f"the gather of the rows ({gathered[0]}) writes a (T·k, H) copy of them"
                     + (" and the weighting another" if weighted else "")
                     + (" before the sum reads them back" if summed else ""))
    if product:
        parts.append("a dense (T, T·k) matrix of the weights (k non-zero entries a row) is written and read by "
                     "the matrix product: T·k times the bytes of the weights")
    if not parts and len(ops) > 1:
        parts.append("each torch op writes its result and the next reads it back")
    parts.append("kernel_ladder.moe_combine reads each row once and writes each token once")
    return "; ".join(parts)


def combine_traffic():
    """Exercise 4's traffic verdict against ``kernel_ladder.moe_combine``."""
    from utils.exercises import Traffic

    return Traffic(ideal=_combine_ideal, top=_combine_top, explain_ops=_combine_explain)


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
    """Row by row (the check's reference), the rest of each row ``-1``: the check
    (:func:`diagnose_visited_blocks`) reads only each row's first ``counts[q]`` indices."""
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


def visited_rules() -> list:
    """Exercise 5's stated rules: tensor ops only, no ``.item()`` (nor ``.tolist()``): no host sync; any sort stable."""
    from utils.exercises import rules

    return [rules.tensor_ops_only(why="the spec asks for tensor ops only, no .item(): the lists stay on the device, "
                                      "no host sync"),
            rules.stable_sorts(why="the spec asks for a stable sort (equal keys keep their order: the allowed blocks "
                                   "in increasing order)")]


def diagnose_visited_cause(case: tuple, got, expected) -> str | None:
    """Exercise 5's causes that need the mask: the forbidden blocks listed, or the mask read transposed."""
    (block_mask,) = case
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not isinstance(got[0], torch.Tensor):
        return None
    counts = got[0].detach().cpu().long()
    mask = block_mask.cpu()
    if counts.shape == (mask.shape[0],) and torch.equal(counts, (~mask).sum(dim=1)) and bool(mask.any()):
        return ("the rows list the blocks the mask forbids: True in block_mask means allowed — count and list the "
                "True entries")
    indices = got[1]
    if (torch.equal(counts, mask.sum(dim=1)) and isinstance(indices, torch.Tensor) and indices.shape == mask.shape
            and bool(mask.any()) and not bool(mask.all())):
        forbidden_first = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices
        indices = indices.detach().cpu().long()
        rows = [(indices[q, : int(counts[q])], forbidden_first[q, : int(counts[q])]) for q in range(mask.shape[0])]
        if all(torch.equal(g, f) for g, f in rows):
            return ("the sort put the forbidden blocks first: sorting the mask ascending puts its False (0) entries "
                    "before its True ones — sort ~block_mask (an allowed block is 0), stable, so the allowed blocks "
                    "come first in increasing order")
    if counts.shape == (mask.shape[1],) and torch.equal(counts, mask.sum(dim=0)):
        return ("the counts are per key block (the mask's columns): block_mask is (Q, K), a row per query block — "
                "sum over dim=1")
    return None


def diagnose_visited_blocks(got, expected) -> str | None:
    """The check's comparison for exercise 5: ``counts`` must match and each row's first
    ``counts[q]`` entries of ``indices`` (the rest is never read, so anything goes there); else what
    is wrong — an empty row visiting a block, the order, an index off by one, or where."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"returned {type(got).__name__}, expected a tuple (counts, indices)"
    (counts, indices), (want_counts, want_indices) = got, expected
    form = [_differences(label, g, e) for label, g, e in (("counts", counts, want_counts),
                                                           ("indices", indices, want_indices))]
    form = [p for p in form if p and "wrong values" not in p]
    if form:
        return "; ".join(form)
    counts, indices = counts.detach().cpu(), indices.detach().cpu()
    want_counts, want_indices = want_counts.cpu(), want_indices.cpu()
    if not torch.equal(counts, want_counts):
        visits_empty = (want_counts == 0) & (counts != 0)
        if visits_empty.any():
            q = int(visits_empty.nonzero()[0, 0])
            return (f"query block {q} allows no key block, but counts[{q}] = {int(counts[q])}: a row with nothing "
                    "allowed visits nothing (count 0: its loop runs no iteration)")
        bad = (counts != want_counts).nonzero()[:, 0].tolist()
        return (f"counts wrong at query block(s) {_row_runs(bad)}: got {counts[bad].tolist()}, expected "
                f"{want_counts[bad].tolist()} (counts[q] = the allowed key blocks of row q)")
    wrong = [q for q in range(len(want_counts))
             if not torch.equal(indices[q, : int(want_counts[q])], want_indices[q, : int(want_counts[q])])]
    if not wrong:
        return None
    q = wrong[0]
    listed, allowed = indices[q, : int(want_counts[q])].tolist(), want_indices[q, : int(want_counts[q])].tolist()
    text = f"query block {q} visits key blocks {listed}, expected {allowed}"
    if all(sorted(indices[r, : int(want_counts[r])].tolist()) == want_indices[r, : int(want_counts[r])].tolist()
           for r in wrong):
        return text + ": the right blocks in the wrong order — list them in increasing order"
    if all(torch.equal(indices[r, : int(want_counts[r])] - 1, want_indices[r, : int(want_counts[r])]) for r in wrong):
        return text + ": every one is one too high — key blocks are numbered from 0"
    return text + f" ({len(wrong)} of {len(want_counts)} rows wrong; a row lists its allowed blocks first)"


# ----------------------------------------------------------------------------------------------
# Exercise 6: DeepSeek-V3's group-limited top-k with bias correction
# ----------------------------------------------------------------------------------------------


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, num_groups: int, topk_groups: int,
                 renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router in torch ops: sigmoid scores; the choice ``scores + bias`` (the bias balances the
    load and is used for choosing only); each group of ``E / num_groups`` consecutive experts scored by its
    two largest choices' sum; the ``topk_groups`` best groups kept, the others' experts masked out (``-inf``:
    never chosen); the top ``k`` choices; their *unbiased* scores as the weights, renormalized if asked,
    then times ``scale`` (``routed_scaling_factor``). Returns ``(weights (T, k), ids (T, k) int64)``."""
    tokens, experts = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + bias
    group_scores = choice.view(tokens, num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    choice = choice.masked_fill(~kept.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, ids


def grouped_topk_reference(logits: torch.Tensor, bias: torch.Tensor, k: int, num_groups: int, topk_groups: int,
                           renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in Python (the check's reference), ids in decreasing order of choice."""
    size = logits.shape[1] // num_groups
    all_weights, all_ids = [], []
    for row in logits.tolist():
        scores = [1.0 / (1.0 + math.exp(-x)) for x in row]
        choice = [s + b for s, b in zip(scores, bias.tolist())]
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(num_groups)]
        kept = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        eligible = [e for g in kept for e in range(g * size, (g + 1) * size)]
        ids = sorted(eligible, key=lambda e: -choice[e])[:k]
        weights = [scores[e] for e in ids]
        total = sum(weights) if renormalize else 1.0
        all_weights.append([w / total * scale for w in weights])
        all_ids.append(ids)
    return torch.tensor(all_weights, dtype=logits.dtype), torch.tensor(all_ids, dtype=torch.int64)


def _distinct_router(gen: torch.Generator, tokens: int, experts: int, num_groups: int,
                     bias: torch.Tensor) -> torch.Tensor:
    """Logits whose choice scores ``sigmoid(logit) + bias`` are distinct values of a 1/128 grid in [0.2, 0.8],
    shifted by 2^-14 per group: no two experts' choices, nor two groups' top-2 sums, tie or come within float32's
    rounding of each other, so float32 and float64 choose the same experts."""
    grid = torch.stack([torch.randperm(77, generator=gen)[:experts] for _ in range(tokens)]).double()
    group = torch.arange(experts).double() // (experts // num_groups)
    choice = 0.2 + grid / 128 + group * 2.0 ** -14
    return torch.logit(choice - bias.double()).float()


def grouped_topk_cases(gen: torch.Generator) -> list[tuple]:
    """(logits, bias, k, num_groups, topk_groups, renormalize, scale): DeepSeek-V3-like routers of 16 to 64
    experts in 3 to 8 groups, both renormalizations, scales 1 to 2.5 (2 where the weights are not
    renormalized: the scale applies either way); then two small routers made to tell the likely mistakes
    apart: one whose best single expert sits in the group with the worse top-2 sum, and one whose bias makes
    a kept group's choices as low as -1.8 (where a dropped group filled with 0, or -1, would win)."""
    device = kernel_ladder.runtime.DEVICE
    cases = []
    for tokens, experts, groups, kept, k, renormalize, scale in ((6, 16, 4, 2, 4, True, 2.5),
                                                                 (5, 24, 3, 1, 3, False, 2.0),
                                                                 (4, 64, 8, 3, 6, True, 1.5)):
        bias = torch.randint(-96, 97, (experts,), generator=gen).double() / 1024
        logits = _distinct_router(gen, tokens, experts, groups, bias)
        cases.append((logits.to(device), bias.float().to(device), k, groups, kept, renormalize, scale))
    max_vs_sum = torch.logit(torch.tensor([[0.9, 0.12, 0.11, 0.1, 0.8, 0.79, 0.13, 0.14]], dtype=torch.float64))
    cases.append((max_vs_sum.float().to(device), torch.zeros(8, device=device), 2, 2, 1, True, 1.0))
    # Choices [0.1, -1.7 | 0.05, -1.8 | -0.2, -3.0]: groups 0 and 1 kept (top-2 sums -1.6, -1.75, -3.2), all four of
    # their experts chosen; filled with any finite value above -1.7 (0, -1), group 2 would win twice, and without
    # the group limit its -0.2 would win once.
    negative = torch.logit(torch.tensor([[0.6, 0.5, 0.55, 0.45, 0.5, 0.4]], dtype=torch.float64)).float()
    bias = torch.tensor([-0.5, -2.2, -0.5, -2.25, -0.7, -3.4])
    cases.append((negative.to(device), bias.to(device), 4, 3, 2, True, 2.0))
    return cases


def grouped_topk_rules() -> list:
    """Exercise 6's stated rule: tensor ops only — no Python loop over tokens or groups (a loop of ``k`` rounds,
    each over every token at once, is the kernel's own way), nothing that waits for the device (``.item()``,
    ``nonzero``...), no library op doing it."""
    from utils.exercises import rules

    return [rules.tensor_ops_only(why="the spec asks for tensor ops only: a router runs on the device, every token "
                                      "at once", loops_over=("k",))]


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weights, ids) ordered by expert id: the order of the k winners is not part of the answer."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _routed(logits, bias, k, num_groups, topk_groups, renormalize, scale, *, weigh_biased=False, group_max=False,
            fill=float("-inf"), groups=True, normalize=None, scaled=True, scoring="sigmoid", rank_biased=True,
            bias_in_logits=False, groups_unbiased=False):
    """The router in float64 with one knob turned (each knob a likely mistake)."""
    x, b = logits.detach().cpu().double(), bias.detach().cpu().double()
    tokens, experts = x.shape
    scores = torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)
    choice = scores + b if rank_biased else scores.clone()
    if bias_in_logits:
        choice = torch.sigmoid(x + b)
    if groups:
        grouped = (scores if groups_unbiased else choice).view(tokens, num_groups, -1)
        group_scores = grouped.max(dim=-1).values if group_max else grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // num_groups, dim=1), fill)
    ids = choice.topk(k, dim=-1).indices
    weights = (scores + b if weigh_biased else scores).gather(1, ids)
    if renormalize if normalize is None else normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scale if scaled else weights), ids


def grouped_topk_mistakes(*case) -> list[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Likely wrong routers, each ``(cause, (weights, ids))``, in float64."""
    renormalize, scale = case[5], case[6]
    mistakes = [
        ("the bias is in the weights: it only steers the choice — weigh the chosen experts by their unbiased "
         "sigmoid scores (scores.gather(1, ids), not (scores + bias).gather(1, ids))", {"weigh_biased": True}),
        ("each group is scored by its largest choice: DeepSeek-V3 scores a group by the sum of its two largest "
         "(topk(2).values.sum(-1)), so one lucky expert does not carry its group", {"group_max": True}),
        ("the dropped groups' experts were filled with a finite value (0, -1, ...), not -inf: a kept expert whose "
         "biased choice is below it (a negative bias) then loses to a dropped one — masked experts must never be "
         "chosen", {"fill": 0.0}),
        ("the group limit is missing: the top k were taken over every expert, not only the kept groups' ones",
         {"groups": False}),
        ("the bias was added to the logits before the sigmoid, not to the scores: the choice is sigmoid(logits) + "
         "bias, not sigmoid(logits + bias)", {"bias_in_logits": True}),
        ("the groups were ranked by the unbiased scores: a group's score is the sum of its two largest choices, "
         "scores + bias, as the experts are chosen", {"groups_unbiased": True}),
        ("the bias was left out of the choice: experts and groups are ranked by scores + bias",
         {"rank_biased": False}),
        ("the scores are a softmax: DeepSeek-V3's router scores each expert with a sigmoid", {"scoring": "softmax"}),
    ]
    if renormalize:
        mistakes.append(("the weights were scaled without being renormalized first: divide the k weights by their "
                         "sum, then multiply by scale", {"normalize": False}))
    else:
        mistakes.append(("the weights were renormalized although renormalize is False: then they are the chosen "
                         "experts' scores as they are, times scale", {"normalize": True}))
    if scale != 1.0 and renormalize:
        mistakes.append(("the scale is missing (or was applied before the renormalization, which divides it out): "
                         "renormalize, then multiply by scale", {"scaled": False}))
    elif scale != 1.0:
        mistakes.append(("the weights were not scaled when renormalize is False: scale multiplies the weights "
                         "whether or not they are renormalized", {"scaled": False}))
    return [(cause, _routed(*case, **knob)) for cause, knob in mistakes]


def diagnose_grouped_topk_cause(case: tuple, got, expected) -> str | None:
    """Exercise 6's cause: the likely mistake (:func:`grouped_topk_mistakes`) whose router returns ``got`` — each
    one that does, where the case cannot tell them apart; none where ``got``'s values are right."""
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        return None
    if got[0].shape != expected[0].shape or got[1].shape != expected[1].shape:
        return None

    def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], rtol=1e-4, atol=1e-6)

    routed = _by_id(got[0].detach().cpu().double(), got[1].detach().cpu().long())
    right = _by_id(expected[0].detach().cpu().double(), expected[1].detach().cpu().long())
    if same(routed, right):
        return None  # the values are right (a wrong dtype, say): no mistake of the router's to name
    from utils.exercises import one_or_all_causes

    # A mistake that changes nothing on this case is not the cause; mistakes this case cannot tell apart are all named.
    return one_or_all_causes([cause for cause, (wrong_w, wrong_ids) in grouped_topk_mistakes(*case)
                              if same(routed, wrong := _by_id(wrong_w, wrong_ids)) and not same(wrong, right)])


def diagnose_grouped_topk(got, expected) -> str | None:
    """The check's comparison for exercise 6: per token the same experts (in any order) with the same weights
    (float32's tolerance), ids int64; else what differs."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"returned {type(got).__name__}, expected a tuple (weights, ids)"
    form = [_differences(label, g, e) for label, g, e in (("weights", got[0], expected[0]), ("ids", got[1],
                                                                                            expected[1]))]
    form = [p for p in form if p and "wrong values" not in p]
    if form:
        return "; ".join(form)
    weights, ids = _by_id(got[0].detach().cpu().double(), got[1].detach().cpu())
    want_weights, want_ids = _by_id(expected[0].cpu().double(), expected[1].cpu())
    wrong_ids = (ids != want_ids).any(dim=-1)
    if wrong_ids.any():
        t = int(wrong_ids.nonzero()[0, 0])
        return (f"token {t} is routed to experts {sorted(ids[t].tolist())}, expected {sorted(want_ids[t].tolist())} "
                f"({int(wrong_ids.sum())} of {len(wrong_ids)} tokens routed wrong)")
    return _differences("weights (each token's ordered by expert id)", weights, want_weights, rtol=1e-5, atol=1e-6)


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
# Given: the MoE block from the chapter's ops, unfused (the ladder step before kernel_ladder.moe)
# ----------------------------------------------------------------------------------------------


def moe_unfused(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Sections 2–3's MoE block: route, counting sort, gather the rows, one grouped GEMM for gate and
    up, the SwiGLU as its own kernel, one grouped GEMM for down, the weighted combine. Seven ops, no
    loop over experts, no host sync — but the gathered rows ``(T·k, H)`` and the gate/up
    pre-activations ``(T·k, 2F)`` each make a round trip through memory, which
    :func:`kernel_ladder.moe` fuses away."""
    ffn = w_down.shape[2]
    weights, expert_ids = kernel_ladder.topk_routing(router_logits, top_k, renormalize=renormalize)
    permutation, offsets = kernel_ladder.moe_permute(expert_ids, w_gate_up.shape[0])
    rows = kernel_ladder.moe_gather(x, permutation, top_k)
    gate_up = kernel_ladder.grouped_matmul(rows, w_gate_up.transpose(1, 2), offsets)  # (T·k, 2F)
    hidden = kernel_ladder.swiglu(gate_up[:, :ffn], gate_up[:, ffn:])
    down = kernel_ladder.grouped_matmul(hidden, w_down.transpose(1, 2), offsets)  # (T·k, H)
    return kernel_ladder.moe_combine(down, permutation, weights)
