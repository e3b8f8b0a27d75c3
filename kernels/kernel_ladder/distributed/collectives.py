"""Collectives built from point-to-point messages, with their α–β cost and the bytes they send.

The teaching versions of what NCCL and gloo do inside ``all_reduce``, ``all_gather`` and
``reduce_scatter``: every message is a ``torch.distributed.isend`` / ``irecv`` pair between two
ranks of a process group, posted together and then waited on, so no two ranks ever block on each
other. They run on any backend that has point-to-point (gloo on the CPU, NCCL on GPUs) and check
against torch's own collectives on the same world (``tests/test_distributed_collectives.py``).

* :func:`ring_reduce_scatter` — the flat tensor is cut into ``p`` chunks (:func:`chunk_bounds`:
  any length, the first ``n % p`` chunks one element longer); in ``p − 1`` steps each rank passes
  a partial sum to its right-hand neighbour and adds its own part into the one arriving from its
  left. Rank ``r`` ends with the full sum of chunk ``r``.
* :func:`ring_all_gather` — the same ring, passing finished chunks on instead of partial sums.
* :func:`ring_all_reduce` — reduce-scatter, then all-gather: every rank sends ``2(p − 1)/p · n``
  elements, whatever ``p``: the bandwidth-optimal all-reduce.
* :func:`tree_broadcast` — a binomial tree from ``src``: ``⌈log₂ p⌉`` rounds, the set of ranks
  that have the data doubling each round.

Two more all-reduces are the lower rungs of the ladder that ends at the ring:

* :func:`star_all_reduce` — every rank sends its whole tensor to rank 0, which adds them up and
  sends the sum back to each: two message latencies, but rank 0's link carries ``(p − 1) · n``
  elements each way.
* :func:`tree_all_reduce` — a binomial-tree reduce to rank 0, then :func:`tree_broadcast`:
  ``2⌈log₂ p⌉`` messages of the whole tensor on the critical path.

Sums are taken in the tensor's dtype, one rounding per hop, as NCCL does (a bf16 all-reduce over
``p`` ranks rounds ``p − 1`` times). :func:`count_bytes` records every message these functions
send; :class:`AlphaBeta` is the cost model each is checked against (``α`` per message on the
critical path, ``β`` per byte a rank sends).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "AlphaBeta",
    "CommStats",
    "RingShift",
    "all_gather_into",
    "chunk_bounds",
    "count_bytes",
    "reduce_scatter_into",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_shift",
    "tree_broadcast",
]


# ----------------------------------------------------------------------------------------------
# Bookkeeping: bytes sent, and the cost model
# ----------------------------------------------------------------------------------------------


@dataclass
class CommStats:
    """What this rank sent inside a :func:`count_bytes` block."""

    bytes_sent: int = 0
    messages: int = 0
    by_op: dict[str, int] = field(default_factory=dict)  # bytes per collective


_ACTIVE: list[CommStats] = []


@contextmanager
def count_bytes() -> Iterator[CommStats]:
    """Count the bytes and messages this rank sends through this module's collectives."""
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def _record(op: str, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    for stats in _ACTIVE:
        stats.bytes_sent += nbytes
        stats.messages += 1
        stats.by_op[op] = stats.by_op.get(op, 0) + nbytes


@dataclass(frozen=True)
class AlphaBeta:
    """The α–β model of a message: ``alpha`` seconds of latency plus ``nbytes / bandwidth``.

    ``alpha``: per message on the critical path (software and link latency, ~1–10 µs between
    GPUs); ``bandwidth``: bytes per second one rank can send (a link's unidirectional bandwidth).
    Each method gives the time of one collective on ``p`` ranks for a tensor of ``nbytes``.
    """

    alpha: float
    bandwidth: float

    def _time(self, messages: int, sent: float) -> float:
        return messages * self.alpha + sent / self.bandwidth

    @staticmethod
    def ring_bytes(nbytes: float, p: int, passes: int = 1) -> float:
        """Bytes each rank sends in ``passes`` ring passes (1: reduce-scatter or all-gather; 2: all-reduce)."""
        return passes * (p - 1) / p * nbytes

    def reduce_scatter(self, nbytes: float, p: int) -> float:
        return self._time(p - 1, self.ring_bytes(nbytes, p))

    def all_gather(self, nbytes: float, p: int) -> float:
        return self._time(p - 1, self.ring_bytes(nbytes, p))

    def all_reduce(self, nbytes: float, p: int) -> float:
        return self._time(2 * (p - 1), self.ring_bytes(nbytes, p, passes=2))

    def tree_broadcast(self, nbytes: float, p: int) -> float:
        rounds = math.ceil(math.log2(p)) if p > 1 else 0
        return self._time(rounds, rounds * nbytes)  # the root sends the whole tensor every round

    def star_all_reduce(self, nbytes: float, p: int) -> float:
        """Everyone to rank 0 and back: two latencies; rank 0 sends ``p − 1`` whole tensors."""
        return self._time(2 if p > 1 else 0, (p - 1) * nbytes)

    def tree_all_reduce(self, nbytes: float, p: int) -> float:
        """A tree reduce then a tree broadcast: ``2⌈log₂ p⌉`` whole tensors one after another."""
        rounds = math.ceil(math.log2(p)) if p > 1 else 0
        return self._time(2 * rounds, 2 * rounds * nbytes)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``p`` chunks of ``n`` elements: the first ``n % p`` one longer."""
    base, extra = divmod(n, p)
    bounds, start = [], 0
    for r in range(p):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """torch's all-gather into one tensor (``all_gather_single`` where torch has it, else the older name).
    With ``async_op=True`` it returns the work handle to ``wait()`` on."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """torch's reduce-scatter (sum) from one tensor (``reduce_scatter_single`` where torch has it).
    With ``async_op=True`` it returns the work handle to ``wait()`` on."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=async_op)


def _group(op: str, tensor: object, group) -> tuple[object, int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: no process group: call torch.distributed.init_process_group first (torchrun "
                           "sets up its environment; utils.distributed.World does it for a notebook or a test)")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: tensor must be contiguous (the collective works on its flat storage), got strides "
                         f"{tensor.stride()} for shape {tuple(tensor.shape)}; pass tensor.contiguous()")
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"{op}: tensor must be a float or int32/int64 tensor, got {tensor.dtype}")
    g = dist.group.WORLD if group is None else group
    return g, dist.get_rank(g), dist.get_world_size(g)


def _peer(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (isend/irecv take global ranks)."""
    return group_rank if group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def _exchange(op: str, group, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
    """Post a send to ``dst`` and a receive from ``src`` (group ranks) together, then wait for both.

    Either may be None or empty (nothing to send or receive this step): both sides of a message
    decide from the same chunk index, so they always agree.
    """
    requests = []
    if recv is not None and recv.numel():
        requests.append(dist.irecv(recv, _peer(group, src), group=group))
    if send is not None and send.numel():
        _record(op, send)
        requests.append(dist.isend(send, _peer(group, dst), group=group))
    for request in requests:
        request.wait()


class RingShift:
    """Tensors on their way one hop around the ring: :meth:`wait` returns what arrived from the left."""

    def __init__(self, received: list[torch.Tensor], requests: list) -> None:
        self._received, self._requests = received, requests

    def wait(self) -> list[torch.Tensor]:
        for request in self._requests:
            request.wait()
        self._requests = []
        return self._received


def ring_shift(tensors: list[torch.Tensor], group=None, op: str = "kernel_ladder.distributed.ring_shift") -> RingShift:
    """Start sending each tensor to the right-hand neighbour and receiving its twin from the left.

    Returns at once (the messages are in flight), so the caller computes on what it holds while
    they travel: ring attention overlaps the next K/V block's transfer with the current block's
    attention. Every rank must call it with tensors of the same shapes and dtypes; they must be
    contiguous. Received tensors are new buffers.
    """
    group = dist.group.WORLD if group is None else group
    r, p = dist.get_rank(group), dist.get_world_size(group)
    right, left = _peer(group, (r + 1) % p), _peer(group, (r - 1) % p)
    received = [torch.empty_like(t) for t in tensors]
    requests = []
    for t, buf in zip(tensors, received):
        if not t.is_contiguous():
            raise ValueError(f"{op}: every tensor must be contiguous, got strides {t.stride()} for {tuple(t.shape)}")
        requests.append(dist.irecv(buf, left, group=group))
        _record(op, t)
        requests.append(dist.isend(t, right, group=group))
    return RingShift(received, requests)


# ----------------------------------------------------------------------------------------------
# The collectives
# ----------------------------------------------------------------------------------------------


def _reduce_scatter_ring(op: str, flat: torch.Tensor, group, r: int, p: int, bounds) -> None:
    """In place on ``flat``: afterwards ``flat[bounds[r]]`` holds the sum of every rank's chunk ``r``."""
    right, left = (r + 1) % p, (r - 1) % p
    longest = max(stop - start for start, stop in bounds)
    incoming = torch.empty(longest, dtype=flat.dtype, device=flat.device)
    for step in range(p - 1):
        send_k, recv_k = (r - step - 1) % p, (r - step - 2) % p
        (s0, s1), (q0, q1) = bounds[send_k], bounds[recv_k]
        buf = incoming[: q1 - q0]
        _exchange(op, group, flat[s0:s1], right, buf, left)
        flat[q0:q1] += buf  # this rank's part, added into the partial sum from the left


def _all_gather_ring(op: str, flat: torch.Tensor, group, r: int, p: int, bounds) -> None:
    """In place on ``flat``: rank ``r`` holds finished chunk ``r``; afterwards every rank holds all."""
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_k, recv_k = (r - step) % p, (r - step - 1) % p
        (s0, s1), (q0, q1) = bounds[send_k], bounds[recv_k]
        _exchange(op, group, flat[s0:s1], right, flat[q0:q1], left)


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of ``tensor`` (the same shape on every rank).

    The flat tensor is cut by :func:`chunk_bounds` (``n`` elements over ``p`` ranks, any ``n``);
    rank ``r`` gets chunk ``r`` of the sum, a new 1-D tensor of ``tensor``'s dtype. ``tensor``
    is not modified. Each rank sends ``n − len(chunk r)`` elements: ``(p − 1)/p · n`` when ``p``
    divides ``n``.
    """
    op = "kernel_ladder.distributed.ring_reduce_scatter"
    group, r, p = _group(op, tensor, group)
    bounds = chunk_bounds(tensor.numel(), p)
    work = tensor.reshape(-1).clone()
    if p > 1:
        _reduce_scatter_ring(op, work, group, r, p, bounds)
    start, stop = bounds[r]
    return work[start:stop].clone()


def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on each), stacked along dim 0 in rank order.

    Like ``torch.distributed.all_gather_into_tensor``: the result has ``p * tensor.shape[0]`` rows
    (a 0-d tensor gives a 1-D result of ``p`` elements). Each rank sends ``(p − 1) · n`` elements,
    ``(p − 1)/p`` of the result.
    """
    op = "kernel_ladder.distributed.ring_all_gather"
    group, r, p = _group(op, tensor, group)
    n = tensor.numel()
    out = torch.empty(p * n, dtype=tensor.dtype, device=tensor.device)
    bounds = [(k * n, (k + 1) * n) for k in range(p)]
    out[r * n:(r + 1) * n] = tensor.reshape(-1)
    if p > 1:
        _all_gather_ring(op, out, group, r, p, bounds)
    shape = (p * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (p,)
    return out.view(shape)


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over every rank of ``group``, in place (returns ``tensor``).

    A ring reduce-scatter, then a ring all-gather of the reduced chunks: ``2(p − 1)`` messages on
    the critical path, and ``2(p − 1)/p · n`` elements sent by each rank (exactly that when ``p``
    divides ``n``; otherwise ``2n`` minus the lengths of chunks ``r`` and ``r + 1``).
    """
    op = "kernel_ladder.distributed.ring_all_reduce"
    group, r, p = _group(op, tensor, group)
    if p == 1:
        return tensor
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), p)
    _reduce_scatter_ring(op, flat, group, r, p, bounds)
    _all_gather_ring(op, flat, group, r, p, bounds)
    return tensor


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor`` (in place; returns it) along a binomial tree.

    Round ``k`` (``k = 0, 1, ...``): every rank that has the data and whose distance from ``src``
    is below ``2**k`` sends it to the rank ``2**k`` further on. ``⌈log₂ p⌉`` rounds; ``src`` sends
    in each of them, a leaf in none.
    """
    op = "kernel_ladder.distributed.tree_broadcast"
    group, r, p = _group(op, tensor, group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < p:
        raise ValueError(f"{op}: src must be a rank of the group, 0 <= src < {p}, got {src!r}")
    flat = tensor.view(-1)
    me = (r - src) % p  # distance from the root
    mask = 1
    while mask < p:
        if me < mask and me + mask < p:
            _exchange(op, group, flat, (me + mask + src) % p, None, 0)
        elif mask <= me < 2 * mask:
            _exchange(op, group, None, 0, flat, (me - mask + src) % p)
        mask <<= 1
    return tensor


def star_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, through rank 0 (the first rung of the ladder).

    Every other rank sends its tensor to rank 0, which adds them in rank order and sends the sum
    back to each. Rank 0 sends ``(p − 1) · n`` elements and receives as many — the busiest link
    carries ``p − 1`` times what a ring's does, however fast the others are. An empty tensor (the
    same shape on every rank) sends nothing: every rank returns at once.
    """
    op = "kernel_ladder.distributed.star_all_reduce"
    group, r, p = _group(op, tensor, group)
    flat = tensor.view(-1)
    if p == 1 or flat.numel() == 0:  # every rank decides alike: no message one side posts and the other skips
        return tensor
    if r == 0:
        incoming = [torch.empty_like(flat) for _ in range(p - 1)]
        requests = [dist.irecv(buf, _peer(group, k + 1), group=group) for k, buf in enumerate(incoming)]
        for request, buf in zip(requests, incoming):
            request.wait()
            flat += buf
        sends = []
        for k in range(1, p):
            _record(op, flat)
            sends.append(dist.isend(flat, _peer(group, k), group=group))
        for request in sends:
            request.wait()
    else:
        _exchange(op, group, flat, 0, None, 0)
        _exchange(op, group, None, 0, flat, 0)
    return tensor


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place along a binomial tree, then broadcast it back.

    Reduce: in round ``k`` every rank whose index has lowest set bit ``2**k`` sends its partial sum
    to the rank ``2**k`` below it, which adds it in; after ``⌈log₂ p⌉`` rounds rank 0 holds the
    sum. Then :func:`tree_broadcast` from rank 0. Few messages, each of the whole tensor: good for
    small tensors, ``2⌈log₂ p⌉ · n`` on the critical path for large ones.
    """
    op = "kernel_ladder.distributed.tree_all_reduce"
    group, r, p = _group(op, tensor, group)
    flat = tensor.view(-1)
    incoming = torch.empty_like(flat)
    mask = 1
    while mask < p:
        if r & mask:  # this rank's partial sum goes down the tree, and it is done
            _exchange(op, group, flat, r - mask, None, 0)
            break
        if r + mask < p:
            _exchange(op, group, None, 0, incoming, r + mask)
            flat += incoming
        mask <<= 1
    return tree_broadcast(tensor, 0, group)
