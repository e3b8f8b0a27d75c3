"""Token permutation for mixture-of-experts: a stable counting sort of the routed entries by expert
(``kernel_ladder::moe_permute``), the gather of token rows into that order (``kernel_ladder::moe_gather``) and
the weighted scatter back (``kernel_ladder::moe_combine``), with their backwards.

**Entries.** Routing gives ``expert_ids`` ``(T, k)``: entry ``t * k + j`` is token ``t``'s ``j``-th
expert. ``moe_permute`` orders the ``N = T * k`` entries by expert, stably (within an expert,
entries keep their flat order, so tokens stay in order): ``permutation[i]`` is the flat entry at
sorted position ``i`` — exactly ``torch.argsort(expert_ids.flatten(), stable=True)`` — and
``offsets[e]`` the end of expert ``e``'s run (the inclusive cumulative count:
``torch._grouped_mm``'s ``offs``).

**The counting sort, without atomics** (so the result is deterministic and stable by construction).
The entries are cut into segments of :data:`PERMUTE_SEGMENT`, one program each:

1. :func:`moe_histogram_kernel`: each program counts its segment's entries per expert, in chunks
   (a one-hot ``(chunk, E)`` tile summed over the chunk), and writes its row of a ``(segments, E)``
   int32 table.
2. :func:`moe_scan_kernel`: one program scans the table: the experts' totals give ``offsets``
   (their inclusive cumsum) and each expert's start; then a running sum over the segments turns the
   table, in place, into each (segment, expert)'s first sorted position.
3. :func:`moe_scatter_kernel`: each program walks its segment again, in order; an entry's position
   is its (segment, expert) start, plus the entries of that expert in earlier chunks, plus its rank
   among the equal ids earlier in its chunk (an inclusive cumsum of the one-hot tile down the
   chunk). It stores ``permutation[position] = entry``.

Traffic: ``expert_ids`` is read twice (``2 * N`` ids), ``permutation`` written once (``4 * N``
bytes), plus the table (``segments * E`` int32, written twice and read twice: small next to the ids
when a segment holds many more entries than there are experts). Three launches whatever ``T``.

**Gather and combine.** ``moe_gather(x, permutation, k)`` writes row ``i`` = ``x[permutation[i] //
k]`` (:func:`moe_gather_kernel`). ``moe_combine(y_sorted, permutation, weights)`` computes, per
token, ``out[t] = sum_j weights[t, j] * y_sorted[inverse[t * k + j]]`` — one program per block of
tokens gathers its own ``k`` rows, so no atomic adds and a deterministic sum
(:func:`moe_combine_kernel`). The inverse permutation is computed by :func:`moe_invert_kernel`
(one more launch, into a buffer filled first: ``16 * N`` bytes with the fill) inside the ops that
need it. The backward of the gather is a combine without weights; the backward of the combine is a
gather with the weights fused (``d y_sorted``) and, for the weights, a per-token dot product
(:func:`moe_combine_weights_grad_kernel`, ``kernel_ladder::moe_combine_backward``).
Rows are computed in float32 and stored in the rows' dtype.

**Bad values.** ``expert_ids`` in range and ``permutation`` a permutation of ``[0, N)`` are value
checks (:mod:`kernel_ladder.runtime`: on the host for CPU tensors, on CUDA when asked), raising a
``ValueError`` that names the bad value. Unchecked (a GPU's default), no kernel reads or writes
outside its tensors whatever the values, and the results are deterministic: an id outside
``[0, E)`` is clamped into it; a ``permutation`` entry outside ``[0, N)`` gathers a zero row; the
combine takes an entry held at several positions from the first of them (an atomic minimum in
:func:`moe_invert_kernel`, whatever order the programs run in) and adds nothing for an entry no
position holds.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._validate import check_float_dtype, check_same_device, check_tensor, check_values, is_int, schema_types

__all__ = [
    "PERMUTE_SEGMENT",
    "moe_combine",
    "moe_combine_kernel",
    "moe_combine_weights_grad_kernel",
    "moe_gather",
    "moe_gather_kernel",
    "moe_histogram_kernel",
    "moe_invert_kernel",
    "moe_permute",
    "moe_scan_kernel",
    "moe_scatter_kernel",
]

#: Entries per program of the histogram and scatter kernels.
PERMUTE_SEGMENT: int = 1024
#: Elements of a one-hot (entries, experts) tile.
ONE_HOT_TILE: int = 4096
#: The most experts the sort handles (one block of experts per program).
MAX_EXPERTS: int = 4096
#: Elements of a (rows, hidden) tile of the gather and combine kernels.
ROW_TILE: int = 4096
#: The routing weights' dtypes: the kernels read them in float32 (float64 weights are rounded to it once).
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_chunk(ids_ptr, entries, n_entries, n_experts, seg_end, top_k, stride_it, stride_ik):
    """Expert ids of flat ``entries`` (int32) and which of them exist in this segment. An id outside
    ``[0, n_experts)`` (unchecked values) is clamped into it, so every entry lands in some expert."""
    ok = (entries < n_entries) & (entries < seg_end)
    token = entries // top_k
    slot = entries - token * top_k
    ids = tl.load(ids_ptr + token.to(tl.int64) * stride_it + slot.to(tl.int64) * stride_ik, mask=ok, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), n_experts - 1)  # in the ids' own dtype: an int64 id never wraps
    return ids.to(tl.int32), ok


@triton.jit
def moe_histogram_kernel(ids_ptr, counts_ptr, n_entries, n_experts, top_k, stride_it, stride_ik,
                         SEGMENT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[segment, e] = entries of this segment routed to expert e."""
    seg = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    seg_start = seg * SEGMENT
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for c in range(0, SEGMENT, CHUNK):
        ids, ok = _load_chunk(ids_ptr, seg_start + c + tl.arange(0, CHUNK), n_entries, n_experts,
                              seg_start + SEGMENT, top_k, stride_it, stride_ik)
        one_hot = (ids[:, None] == experts[None, :]) & ok[:, None]
        counts += tl.sum(one_hot.to(tl.int32), axis=0)
    tl.store(counts_ptr + seg.to(tl.int64) * n_experts + experts, counts, mask=experts < n_experts)


@triton.jit
def moe_scan_kernel(counts_ptr, offsets_ptr, n_segments, n_experts, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: offsets = inclusive cumsum of the experts' totals; counts -> first positions (in place)."""
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < n_experts
    lanes = tl.arange(0, BLOCK_S)
    total = tl.zeros((BLOCK_E,), tl.int32)
    for s0 in range(0, n_segments, BLOCK_S):
        segs = s0 + lanes
        mask = (segs < n_segments)[:, None] & e_ok[None, :]
        c = tl.load(counts_ptr + segs.to(tl.int64)[:, None] * n_experts + experts[None, :], mask=mask, other=0)
        total += tl.sum(c, axis=0)
    ends = tl.cumsum(total, axis=0)
    tl.store(offsets_ptr + experts, ends, mask=e_ok)
    running = ends - total
    for s0 in range(0, n_segments, BLOCK_S):
        segs = s0 + lanes
        mask = (segs < n_segments)[:, None] & e_ok[None, :]
        ptrs = counts_ptr + segs.to(tl.int64)[:, None] * n_experts + experts[None, :]
        c = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + running[None, :], mask=mask)
        running += tl.sum(c, axis=0)


@triton.jit
def moe_scatter_kernel(ids_ptr, starts_ptr, perm_ptr, n_entries, n_experts, top_k, stride_it, stride_ik,
                       SEGMENT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """permutation[position] = entry, positions in entry order within each expert (stable)."""
    seg = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    seg_start = seg * SEGMENT
    base = tl.load(starts_ptr + seg.to(tl.int64) * n_experts + experts, mask=experts < n_experts, other=0)
    for c in range(0, SEGMENT, CHUNK):
        entries = seg_start + c + tl.arange(0, CHUNK)
        ids, ok = _load_chunk(ids_ptr, entries, n_entries, n_experts, seg_start + SEGMENT, top_k, stride_it,
                              stride_ik)
        one_hot = ((ids[:, None] == experts[None, :]) & ok[:, None]).to(tl.int32)
        rank = tl.cumsum(one_hot, axis=0)  # inclusive: 1 for an expert's first entry in the chunk
        position = tl.sum(one_hot * (rank + base[None, :]), axis=1) - 1
        tl.store(perm_ptr + position.to(tl.int64), entries, mask=ok & (tl.sum(one_hot, axis=1) > 0))
        base += tl.sum(one_hot, axis=0)


@triton.jit
def moe_invert_kernel(perm_ptr, inv_ptr, n_entries, BLOCK: tl.constexpr):
    """inverse[permutation[i]] = i, into an inverse filled with ``n_entries`` ("no position").

    An atomic minimum, not a store: should ``permutation`` not be one (values unchecked), an entry
    held at several positions gets the first of them whatever the order programs run in, an entry
    held nowhere keeps ``n_entries``, and an entry outside ``[0, n_entries)`` is skipped. For a true
    permutation each address is written once, as a store would."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_entries
    entry = tl.load(perm_ptr + i, mask=ok, other=0)
    ok = ok & (entry >= 0) & (entry < n_entries)
    tl.atomic_min(inv_ptr + entry.to(tl.int64), i, mask=ok, sem="relaxed")


@triton.jit
def moe_gather_kernel(x_ptr, perm_ptr, w_ptr, out_ptr, n_entries, hidden, top_k,
                      stride_xt, stride_xh, stride_wt, stride_wk,
                      WEIGHTED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[i] = x[permutation[i] // k] (``WEIGHTED``: times weights[t, j] of that entry); a zero row
    for an entry outside ``[0, T * k)`` (unchecked values), which is never read."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r_ok = rows < n_entries
    mask = r_ok[:, None] & (cols < hidden)[None, :]
    entry = tl.load(perm_ptr + rows, mask=r_ok, other=0)
    e_ok = r_ok & (entry >= 0) & (entry < n_entries)
    token = entry // top_k
    v = tl.load(x_ptr + token.to(tl.int64)[:, None] * stride_xt + cols.to(tl.int64)[None, :] * stride_xh,
                mask=mask & e_ok[:, None], other=0.0)
    if WEIGHTED:
        slot = entry - token * top_k
        w = tl.load(w_ptr + token.to(tl.int64) * stride_wt + slot.to(tl.int64) * stride_wk, mask=e_ok, other=0.0)
        v = v.to(tl.float32) * w.to(tl.float32)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_combine_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, n_tokens, hidden, top_k,
                       stride_yr, stride_yh, stride_wt, stride_wk,
                       WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j weights[t, j] * y[inverse[t * k + j]], the k rows gathered in slot order; an
    entry with no position (``inverse`` = T * k) adds nothing."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < n_tokens
    mask = t_ok[:, None] & (cols < hidden)[None, :]
    tokens64 = tokens.to(tl.int64)
    n_rows = n_tokens * top_k
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j in range(0, top_k):
        pos = tl.load(inv_ptr + tokens64 * top_k + j, mask=t_ok, other=0)
        p_ok = t_ok & (pos >= 0) & (pos < n_rows)
        y = tl.load(y_ptr + pos.to(tl.int64)[:, None] * stride_yr + cols.to(tl.int64)[None, :] * stride_yh,
                    mask=mask & p_ok[:, None], other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + tokens64 * stride_wt + j * stride_wk, mask=t_ok, other=0.0).to(tl.float32)
            y = y * w[:, None]
        acc += y
    tl.store(out_ptr + tokens64[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_combine_weights_grad_kernel(a_ptr, b_ptr, inv_ptr, dw_ptr, n_tokens, hidden,
                                    stride_at, stride_ah, stride_br, stride_bh,
                                    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                                    BLOCK_H: tl.constexpr):
    """dw[t, j] = sum_h a[t, h] * b[inverse[t * K + j], h]: each token row of ``a`` read once; 0 for an
    entry with no position (``inverse`` = T * K)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < n_tokens
    tokens64 = tokens.to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    k_mask = t_ok[:, None] & (slots < K)[None, :]
    pos = tl.load(inv_ptr + tokens64[:, None] * K + slots[None, :], mask=k_mask, other=0).to(tl.int64)
    pos = tl.where((pos >= 0) & (pos < n_tokens * K), pos, -1)  # -1: no position, nothing read
    acc = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = t_ok[:, None] & (cols < hidden)[None, :]
        a = tl.load(a_ptr + tokens64[:, None] * stride_at + cols.to(tl.int64)[None, :] * stride_ah, mask=mask,
                    other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            pos_j = tl.sum(tl.where(slots[None, :] == j, pos, 0), axis=1)
            b = tl.load(b_ptr + pos_j[:, None] * stride_br + cols.to(tl.int64)[None, :] * stride_bh,
                        mask=mask & (pos_j >= 0)[:, None], other=0.0).to(tl.float32)
            acc = tl.where(slots[None, :] == j, acc + tl.sum(a * b, axis=1)[:, None], acc)
    tl.store(dw_ptr + tokens64[:, None] * K + slots[None, :], acc.to(dw_ptr.dtype.element_ty), mask=k_mask)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_permute_args(op: str, expert_ids: object, num_experts: object) -> None:
    check_tensor(op, "expert_ids", expert_ids)
    if expert_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{op}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if expert_ids.dim() != 2:
        raise ValueError(f"{op}: expert_ids must be 2-D (tokens, k), got shape {tuple(expert_ids.shape)}")
    if not is_int(num_experts):
        raise TypeError(f"{op}: num_experts must be an int, got {type(num_experts).__name__}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"{op}: num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if expert_ids.numel() >= 2**31:
        raise ValueError(f"{op}: at most 2**31 - 1 entries (int32 positions), got {expert_ids.numel()}")


def _check_expert_ids(op: str, expert_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in ``[0, num_experts)``, by the value-check policy (no host synchronization on CUDA)."""
    if expert_ids.numel() == 0:
        return
    message = f"{op}: expert_ids must be in [0, num_experts) = [0, {num_experts})"
    low_high = []

    def ok() -> torch.Tensor:  # one read of the ids (a min/max reduction), then two scalars compared
        low_high[:] = torch.aminmax(expert_ids)
        return (low_high[0] >= 0) & (low_high[1] < num_experts)

    def host_ok() -> bool:
        ids = expert_ids.numpy()
        low_high[:] = ids.min(), ids.max()
        return bool(low_high[0] >= 0 and low_high[1] < num_experts)

    # No device assertion by default (the runtime's rule for CUDA: only when asked).
    check_values((expert_ids,), ok, message,
                 lambda: f"{message}; got ids from {int(low_high[0])} to {int(low_high[1])}",
                 host_ok=host_ok, device_assert=False)


def _check_permutation(op: str, permutation: object, n_entries: int | None = None) -> None:
    check_tensor(op, "permutation", permutation)
    if permutation.dtype != torch.int32:
        raise TypeError(f"{op}: permutation must be int32 (from kernel_ladder.moe_permute), got {permutation.dtype}")
    if permutation.dim() != 1:
        raise ValueError(f"{op}: permutation must be 1-D, got shape {tuple(permutation.shape)}")
    if n_entries is not None and permutation.shape[0] != n_entries:
        raise ValueError(f"{op}: permutation must have T * k = {n_entries} entries, got {permutation.shape[0]}")


def _permutation_fault(perm: np.ndarray, n_entries: int) -> str | None:
    """What makes ``perm`` not a permutation of ``[0, n_entries)`` (its length is): the first entry out
    of range, else the first position repeating an earlier entry; None if it is one."""
    perm = perm.astype(np.int64, copy=False)
    outside = np.flatnonzero((perm < 0) | (perm >= n_entries))
    if outside.size:
        i = int(outside[0])
        return f"permutation[{i}] = {int(perm[i])}"
    counts = np.bincount(perm, minlength=n_entries)
    if int(counts.max(initial=0)) <= 1:
        return None
    seen = np.zeros(n_entries, dtype=bool)
    for i, entry in enumerate(perm.tolist()):  # only on failure: the first repeat, by position
        if seen[entry]:
            first = int(np.flatnonzero(perm == entry)[0])
            return f"entry {entry} at positions {first} and {i}"
        seen[entry] = True
    return None


def _check_permutation_values(op: str, permutation: torch.Tensor, n_entries: int) -> None:
    """``permutation`` holds each entry of ``[0, n_entries)`` once, by the value-check policy (no host
    synchronization on CUDA unless asked, and no device assertion: the kernels mask what is out of
    range and take an entry held twice from its first position, see :func:`moe_invert_kernel`)."""
    if n_entries == 0:
        return
    message = f"{op}: permutation must be a permutation of [0, T * k) = [0, {n_entries}) (each entry once)"
    fault: list[str | None] = [None]

    def ok() -> torch.Tensor:  # tensor ops: every entry in range, and each counted once
        p = permutation.long()
        inside = (p >= 0) & (p < n_entries)
        counts = torch.zeros(n_entries, dtype=torch.int32, device=p.device).index_add_(
            0, p.clamp(0, n_entries - 1), inside.to(torch.int32))
        return inside.all() & (counts == 1).all()

    def host_ok() -> bool:
        fault[0] = _permutation_fault(permutation.numpy(), n_entries)
        return fault[0] is None

    def error() -> str:
        if fault[0] is None:  # found by the tensor check (CUDA, asked for): read the values once more
            fault[0] = _permutation_fault(permutation.cpu().numpy(), n_entries)
        return f"{message}; got {fault[0]}"

    check_values((permutation,), ok, message, error, host_ok=host_ok, device_assert=False)


def _check_rows(op: str, name: str, t: object) -> None:
    check_tensor(op, name, t)
    check_float_dtype(op, name, t)
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D (rows, hidden), got shape {tuple(t.shape)}")


def _check_weights(op: str, weights: torch.Tensor, n_tokens: int, top_k: int) -> None:
    check_tensor(op, "weights", weights)
    if weights.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op}: weights must be float32, float16, bfloat16 or float64, got {weights.dtype}")
    if tuple(weights.shape) != (n_tokens, top_k):
        raise ValueError(f"{op}: weights must be (T, k) = ({n_tokens}, {top_k}), got {tuple(weights.shape)}")


def _check_top_k(op: str, top_k: object) -> None:
    if not is_int(top_k):
        raise TypeError(f"{op}: top_k must be an int, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"{op}: top_k must be >= 1, got {top_k}")


def _check_gather_args(op, x, permutation, top_k, weights) -> None:
    _check_rows(op, "x", x)
    _check_top_k(op, top_k)
    _check_permutation(op, permutation, x.shape[0] * top_k)
    check_same_device(op, "x", x, "permutation", permutation)
    if weights is not None:
        _check_weights(op, weights, x.shape[0], top_k)


def _check_combine_args(op, y_sorted, permutation, top_k, weights) -> None:
    _check_rows(op, "y_sorted", y_sorted)
    _check_top_k(op, top_k)
    _check_permutation(op, permutation, y_sorted.shape[0])
    check_same_device(op, "y_sorted", y_sorted, "permutation", permutation)
    if y_sorted.shape[0] % top_k:
        raise ValueError(f"{op}: y_sorted must have T * k rows, got {y_sorted.shape[0]} rows for k = {top_k}")
    if weights is not None:
        _check_weights(op, weights, y_sorted.shape[0] // top_k, top_k)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _one_hot_config(n_experts: int) -> tuple[int, int, int]:
    """(SEGMENT, CHUNK, BLOCK_E) of the histogram and scatter kernels."""
    block_e = next_power_of_2(n_experts)
    chunk = max(1, ONE_HOT_TILE // block_e)
    segment = max(chunk, PERMUTE_SEGMENT // chunk * chunk)
    return segment, chunk, block_e


def _invert(permutation: torch.Tensor) -> torch.Tensor:
    """The inverse permutation; ``n`` (no position) for an entry no position holds (values unchecked)."""
    n = permutation.shape[0]
    inv = _launch.empty((n,), torch.int32, permutation.device).fill_(n)
    if n:
        block = 1024
        moe_invert_kernel[(triton.cdiv(n, block),)](permutation, inv, n, BLOCK=block)
    return inv


def _row_blocks(hidden: int) -> tuple[int, int]:
    block_h = min(next_power_of_2(max(hidden, 1)), 1024)
    return max(1, ROW_TILE // block_h), block_h


def _gather(x: torch.Tensor, permutation: torch.Tensor, top_k: int, weights: torch.Tensor | None) -> torch.Tensor:
    n, hidden = permutation.shape[0], x.shape[1]
    out = _launch.empty_output((n, hidden), x)
    if n and hidden:
        block_r, block_h = _row_blocks(hidden)
        w = x if weights is None else weights
        ws = (0, 0) if weights is None else weights.stride()
        moe_gather_kernel[(triton.cdiv(n, block_r), triton.cdiv(hidden, block_h))](
            x, permutation, w, out, n, hidden, top_k, *x.stride(), *ws,
            WEIGHTED=weights is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
        )
    return out


def _combine(y: torch.Tensor, permutation: torch.Tensor, top_k: int, weights: torch.Tensor | None) -> torch.Tensor:
    n, hidden = y.shape
    n_tokens = n // top_k
    out = _launch.empty_output((n_tokens, hidden), y)
    if n and hidden:
        inv = _invert(permutation)
        block_t, block_h = _row_blocks(hidden)
        w = y if weights is None else weights
        ws = (0, 0) if weights is None else weights.stride()
        moe_combine_kernel[(triton.cdiv(n_tokens, block_t), triton.cdiv(hidden, block_h))](
            y, inv, w, out, n_tokens, hidden, top_k, *y.stride(), *ws,
            WEIGHTED=weights is not None, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        )
    return out


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::moe_permute", mutates_args=())
def _moe_permute_op(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.moe_permute"
    _check_permute_args(op, expert_ids, num_experts)
    runtime.require_launchable(op, expert_ids)
    _check_expert_ids(op, expert_ids, num_experts)
    device = expert_ids.device
    n_tokens, top_k = expert_ids.shape
    n = n_tokens * top_k
    permutation = _launch.empty((n,), torch.int32, device)
    offsets = _launch.empty((num_experts,), torch.int32, device)
    segment, chunk, block_e = _one_hot_config(num_experts)
    n_segments = max(1, triton.cdiv(n, segment))
    counts = _launch.empty((n_segments, num_experts), torch.int32, device)
    strides = expert_ids.stride()
    k = max(top_k, 1)
    moe_histogram_kernel[(n_segments,)](expert_ids, counts, n, num_experts, k, *strides,
                                        SEGMENT=segment, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    moe_scan_kernel[(1,)](counts, offsets, n_segments, num_experts,
                          BLOCK_S=max(1, ONE_HOT_TILE // block_e), BLOCK_E=block_e, num_warps=4)
    if n:
        moe_scatter_kernel[(n_segments,)](expert_ids, counts, permutation, n, num_experts, k, *strides,
                                          SEGMENT=segment, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    return permutation, offsets


@_moe_permute_op.register_fake
def _moe_permute_fake(expert_ids, num_experts):
    _check_permute_args("kernel_ladder.moe_permute", expert_ids, num_experts)
    n = expert_ids.shape[0] * expert_ids.shape[1]
    return (expert_ids.new_empty((n,), dtype=torch.int32), expert_ids.new_empty((num_experts,), dtype=torch.int32))


@torch.library.custom_op("kernel_ladder::moe_gather", mutates_args=())
def _moe_gather_op(x: torch.Tensor, permutation: torch.Tensor, top_k: int,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    op = "kernel_ladder.moe_gather"
    _check_gather_args(op, x, permutation, top_k, weights)
    runtime.require_launchable(op, x, permutation)
    _check_permutation_values(op, permutation, permutation.shape[0])
    return _gather(x, permutation, top_k, weights)


@_moe_gather_op.register_fake
def _moe_gather_fake(x, permutation, top_k, weights=None):
    _check_gather_args("kernel_ladder.moe_gather", x, permutation, top_k, weights)
    return x.new_empty((permutation.shape[0], x.shape[1]))


@torch.library.custom_op("kernel_ladder::moe_combine", mutates_args=())
def _moe_combine_op(y_sorted: torch.Tensor, permutation: torch.Tensor, top_k: int,
                    weights: torch.Tensor | None = None) -> torch.Tensor:
    op = "kernel_ladder.moe_combine"
    _check_combine_args(op, y_sorted, permutation, top_k, weights)
    runtime.require_launchable(op, y_sorted, permutation)
    _check_permutation_values(op, permutation, permutation.shape[0])
    return _combine(y_sorted, permutation, top_k, weights)


@_moe_combine_op.register_fake
def _moe_combine_fake(y_sorted, permutation, top_k, weights=None):
    _check_combine_args("kernel_ladder.moe_combine", y_sorted, permutation, top_k, weights)
    return y_sorted.new_empty((y_sorted.shape[0] // top_k, y_sorted.shape[1]))


def _check_weights_grad_args(op, token_rows, sorted_rows, permutation, top_k, weights_dtype) -> None:
    _check_rows(op, "token_rows", token_rows)
    _check_rows(op, "sorted_rows", sorted_rows)
    _check_top_k(op, top_k)
    if top_k > 64:
        raise ValueError(f"{op}: top_k must be <= 64 for the weights' gradient, got {top_k}")
    _check_permutation(op, permutation, token_rows.shape[0] * top_k)
    if sorted_rows.shape != (permutation.shape[0], token_rows.shape[1]):
        raise ValueError(f"{op}: sorted_rows must be ({permutation.shape[0]}, {token_rows.shape[1]}), "
                         f"got {tuple(sorted_rows.shape)}")
    if weights_dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op}: weights_dtype must be float32, float16, bfloat16 or float64, got {weights_dtype}")


@torch.library.custom_op("kernel_ladder::moe_combine_backward", mutates_args=())
def _moe_combine_backward_op(token_rows: torch.Tensor, sorted_rows: torch.Tensor, permutation: torch.Tensor,
                             top_k: int, weights_dtype: torch.dtype) -> torch.Tensor:
    """The weights' gradient: ``dw[t, j] = <token_rows[t], sorted_rows[inverse[t * k + j]]>``."""
    op = "kernel_ladder.moe_combine (backward)"
    _check_weights_grad_args(op, token_rows, sorted_rows, permutation, top_k, weights_dtype)
    runtime.require_launchable(op, token_rows, sorted_rows, permutation)
    n_tokens, hidden = token_rows.shape
    dw = _launch.empty((n_tokens, top_k), weights_dtype, token_rows.device)
    if n_tokens:
        if hidden == 0:
            return dw.zero_()
        inv = _invert(permutation)
        block_k = next_power_of_2(top_k)
        block_h = min(next_power_of_2(hidden), 256)
        block_t = max(1, ROW_TILE // (block_h * 2))
        moe_combine_weights_grad_kernel[(triton.cdiv(n_tokens, block_t),)](
            token_rows, sorted_rows, inv, dw, n_tokens, hidden, *token_rows.stride(), *sorted_rows.stride(),
            K=top_k, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_H=block_h, num_warps=4,
        )
    return dw


@_moe_combine_backward_op.register_fake
def _moe_combine_backward_fake(token_rows, sorted_rows, permutation, top_k, weights_dtype):
    _check_weights_grad_args("kernel_ladder.moe_combine (backward)", token_rows, sorted_rows, permutation, top_k,
                             weights_dtype)
    return token_rows.new_empty((token_rows.shape[0], top_k), dtype=weights_dtype)


def _gather_setup(ctx, inputs, output) -> None:
    x, permutation, top_k, weights = inputs
    ctx.top_k = top_k
    ctx.has_weights = weights is not None
    ctx.save_for_backward(x, permutation, weights)


def _gather_backward(ctx, grad_out):
    x, permutation, weights = ctx.saved_tensors
    grad_x = _moe_combine_op(grad_out, permutation, ctx.top_k, weights)
    grad_w = None
    if ctx.has_weights and ctx.needs_input_grad[3]:
        grad_w = _moe_combine_backward_op(x, grad_out, permutation, ctx.top_k, weights.dtype)
    return grad_x, None, None, grad_w


def _combine_setup(ctx, inputs, output) -> None:
    y_sorted, permutation, top_k, weights = inputs
    ctx.top_k = top_k
    ctx.has_weights = weights is not None
    ctx.save_for_backward(y_sorted, permutation, weights)


def _combine_backward(ctx, grad_out):
    y_sorted, permutation, weights = ctx.saved_tensors
    grad_y = _moe_gather_op(grad_out, permutation, ctx.top_k, weights)
    grad_w = None
    if ctx.has_weights and ctx.needs_input_grad[3]:
        grad_w = _moe_combine_backward_op(grad_out, y_sorted, permutation, ctx.top_k, weights.dtype)
    return grad_y, None, None, grad_w


_moe_gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)
_moe_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def moe_permute(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the routed entries by expert, stably: a counting sort in three Triton kernels.

    Args:
        expert_ids: ``(T, k)`` int32 or int64 (any strides), values in ``[0, num_experts)`` (a value
            check, see :mod:`kernel_ladder.runtime`: a ``ValueError`` on the CPU, and on CUDA when asked;
            unchecked, an out-of-range id is clamped into ``[0, num_experts)``, so that ``permutation``
            is still a permutation and ``offsets[-1] = T * k``).
        num_experts: ``E``, ``1 <= E <= MAX_EXPERTS``.

    Returns:
        ``(permutation, offsets)``: ``permutation`` ``(T * k,)`` **int32**, the flat entry index
        ``t * k + j`` at each sorted position (equal to ``torch.argsort(expert_ids.flatten(),
        stable=True)``); ``offsets`` ``(E,)`` **int32**, the cumulative end of each expert's rows
        (``torch._grouped_mm``'s ``offs``; expert ``e``'s rows are ``offsets[e-1]:offsets[e]``).
        Not differentiable.
    """
    if not schema_types(tensors=(expert_ids,), ints=(num_experts,)):
        _check_permute_args("kernel_ladder.moe_permute", expert_ids, num_experts)  # the op checks values
    return _moe_permute_op(expert_ids, num_experts)


def moe_gather(x: torch.Tensor, permutation: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token rows in sorted order: ``out[i] = x[permutation[i] // top_k]``.

    Args:
        x: ``(T, H)`` float32, float16 or bfloat16 (any strides).
        permutation: ``(T * top_k,)`` int32 from :func:`moe_permute`: each of ``0 .. T * top_k - 1``
            once (a value check, see :mod:`kernel_ladder.runtime`; unchecked, an entry outside that
            range gathers a zero row).
        top_k: ``k``, experts per token.

    Returns:
        ``(T * top_k, H)`` contiguous, ``x``'s dtype (an exact copy). Differentiable in ``x`` (the
        backward is an unweighted :func:`moe_combine`).
    """
    if not schema_types(tensors=(x, permutation), ints=(top_k,)):
        _check_gather_args("kernel_ladder.moe_gather", x, permutation, top_k, None)  # the op checks values
    return _moe_gather_op(x, permutation, top_k, None)


def moe_combine(y_sorted: torch.Tensor, permutation: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scatter the experts' rows back to their tokens, weighted:
    ``out[t] = sum_j weights[t, j] * y_sorted[position of entry t * k + j]``.

    Args:
        y_sorted: ``(T * k, H)`` float32, float16 or bfloat16, rows in :func:`moe_permute`'s order.
        permutation: ``(T * k,)`` int32 from :func:`moe_permute`: each of ``0 .. T * k - 1`` once (a
            value check, see :mod:`kernel_ladder.runtime`; unchecked, an entry held at several
            positions is taken from the first, and one held nowhere adds nothing).
        weights: ``(T, k)`` routing weights, float32, float16, bfloat16 or float64 (read in float32;
            their gradient in their dtype).

    Returns:
        ``(T, H)`` contiguous, ``y_sorted``'s dtype, summed in float32 in slot order (deterministic:
        one program per block of tokens, no atomic adds). Differentiable in ``y_sorted`` and ``weights``.
    """
    _check_rows("kernel_ladder.moe_combine", "y_sorted", y_sorted)
    check_tensor("kernel_ladder.moe_combine", "weights", weights)
    if weights.dim() != 2:
        raise ValueError(f"kernel_ladder.moe_combine: weights must be 2-D (T, k), got shape {tuple(weights.shape)}")
    top_k = weights.shape[1]
    if top_k < 1:
        raise ValueError("kernel_ladder.moe_combine: weights must have k >= 1 columns, got 0")
    _check_combine_args("kernel_ladder.moe_combine", y_sorted, permutation, top_k, weights)
    return _moe_combine_op(y_sorted, permutation, top_k, weights)
