"""Pipeline parallelism: one stage of the model per rank, micro-batches flowing through, GPipe or 1F1B.

Rank ``r`` holds stage ``r``. A batch is cut into ``m`` micro-batches; rank 0 feeds them in, each
stage sends its activations to the next (``isend``) and, in the backward, each stage sends the
gradient of its input back to the previous one. The order of forwards (F) and backwards (B) on a
rank is the schedule:

* **GPipe** — every forward, then every backward. Simple; every stage keeps the activations of
  all ``m`` micro-batches until their backward.
* **1F1B** — a warm-up of ``p − r − 1`` forwards, then one forward and one backward in turn, then
  the remaining backwards: at most ``p − r`` micro-batches in flight on stage ``r``, whatever
  ``m``.

Both leave every stage idle at the start and the end — the bubble. With every F and B taking one
unit of time the idle fraction is ``(p − 1)/(m + p − 1)`` for both (1F1B's gain is memory, not
the bubble); :func:`logical_timeline` replays the order each rank really ran, with those unit
times and the true dependencies, so the bubble is measured from the schedule that ran, not from
a noisy clock.

Sends never block (``isend``; all are waited on at the end of the step) and each ordered pair of
ranks carries one kind of message (activations forward, gradients backward), so no schedule can
deadlock on a send. A small header (the tensor's rank and sizes) precedes every tensor, so stages
need not know each other's shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Pipeline", "bubble_fraction", "logical_timeline", "schedule_order"]

_OP = "kernel_ladder.distributed.Pipeline"
SCHEDULES = ("gpipe", "1f1b")
_HEADER = 9  # ndim + up to 8 sizes


def schedule_order(schedule: str, rank: int, world: int, microbatches: int) -> list[tuple[str, int]]:
    """The ``("F" | "B", micro-batch)`` order of ``rank`` under ``schedule``."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(world - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", i) for i in range(b, m)]
    return order


def logical_timeline(orders: list[list[tuple[str, int]]], forward: float = 1.0, backward: float = 1.0
                     ) -> list[list[tuple[str, int, float, float]]]:
    """Start and end of every op on every rank if an F takes ``forward`` and a B ``backward``.

    ``orders[r]`` is rank ``r``'s executed order. An op starts when its rank is free and its input
    has arrived: F of micro-batch ``i`` on rank ``r`` needs F ``i`` of rank ``r − 1``; B ``i`` needs
    B ``i`` of rank ``r + 1`` (and the last rank's B needs its own F). Messages take no time.
    """
    p = len(orders)
    end: dict[tuple[int, str, int], float] = {}
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    position = [0] * p
    clock = [0.0] * p
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, i = orders[r][position[r]]
                dep = (r - 1, "F", i) if kind == "F" else ((r + 1, "B", i) if r < p - 1 else (r, "F", i))
                if kind == "F" and r == 0:
                    ready = 0.0
                elif dep in end:
                    ready = end[dep]
                else:
                    break
                start = max(clock[r], ready)
                finish = start + (forward if kind == "F" else backward)
                end[(r, kind, i)], clock[r] = finish, finish
                out[r].append((kind, i, start, finish))
                position[r] += 1
                progressed = True
    stuck = []
    for r in range(p):
        if position[r] < len(orders[r]):
            kind, i = orders[r][position[r]]
            dep = (r - 1, "F", i) if kind == "F" else ((r + 1, "B", i) if r < p - 1 else (r, "F", i))
            stuck.append(f"rank {r}'s {kind}{i} waits for rank {dep[0]}'s {dep[1]}{dep[2]}")
    if stuck:
        raise ValueError("kernel_ladder.distributed.logical_timeline: the orders deadlock — " + "; ".join(stuck)
                         + " (each waits on an op that can never run before it)")
    return out


def bubble_fraction(timeline: list[list[tuple[str, int, float, float]]]) -> float:
    """Idle time over all ranks divided by ``p`` times the step's length."""
    length = max(op[3] for ops in timeline for op in ops)
    busy = sum(op[3] - op[2] for ops in timeline for op in ops)
    return 1.0 - busy / (len(timeline) * length)


@dataclass
class _Event:
    kind: str
    microbatch: int
    start: float
    end: float


class Pipeline(torch.nn.Module):
    """``stages[r]`` on rank ``r`` (``len(stages)`` must equal the world size), run by ``schedule``.

    :meth:`step` runs one training step's forward and backward over ``num_microbatches``
    micro-batches (the gradients accumulate in each stage's parameters, scaled so that they are
    the gradients of the mean loss over the micro-batches) and returns the mean loss on the last
    rank (None elsewhere). Only rank 0 passes ``inputs`` and only the last rank ``target``.
    """

    def __init__(self, stages, schedule: str = "1f1b", num_microbatches: int = 4, group=None,
                 loss_fn=None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{_OP}: no process group: call torch.distributed.init_process_group first")
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        stages = list(stages)
        if len(stages) != self.world:
            raise ValueError(f"{_OP}: stages must hold one module per rank ({self.world}), got {len(stages)}")
        if schedule not in SCHEDULES:
            raise ValueError(f"{_OP}: schedule must be 'gpipe' or '1f1b', got {schedule!r}")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"{_OP}: num_microbatches must be an int >= 1, got {num_microbatches!r}")
        self.stage = stages[self.rank]
        self.schedule, self.num_microbatches = schedule, num_microbatches
        self.loss_fn = torch.nn.functional.mse_loss if loss_fn is None else loss_fn
        self.events: list[_Event] = []
        self.peak_in_flight = 0

    def _peer(self, r: int) -> int:
        return r if self.group is dist.group.WORLD else dist.get_global_rank(self.group, r)

    def _send(self, tensor: torch.Tensor, to: int, pending: list) -> None:
        t = tensor.detach().contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = t.dim()
        header[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        pending.append((dist.isend(header, self._peer(to), group=self.group), header))
        pending.append((dist.isend(t, self._peer(to), group=self.group), t))  # keep t alive until sent

    def _recv(self, frm: int, dtype: torch.dtype) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.irecv(header, self._peer(frm), group=self.group).wait()
        shape = header[1:1 + int(header[0])].tolist()
        t = torch.empty(shape, dtype=dtype)
        dist.irecv(t, self._peer(frm), group=self.group).wait()
        return t

    def step(self, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None) -> torch.Tensor | None:
        m, r, p = self.num_microbatches, self.rank, self.world
        first, last = r == 0, r == p - 1
        if first and not isinstance(inputs, torch.Tensor):
            raise ValueError(f"{_OP}.step: rank 0 must pass inputs (the whole batch), got {type(inputs).__name__}")
        if last and not isinstance(target, torch.Tensor):
            raise ValueError(f"{_OP}.step: the last rank must pass target, got {type(target).__name__}")
        dtype = next(self.stage.parameters()).dtype
        xs = list(inputs.chunk(m)) if first else None
        ys = list(target.chunk(m)) if last else None
        if first and len(xs) != m:
            raise ValueError(f"{_OP}.step: the batch of {inputs.shape[0]} rows cannot make {m} micro-batches")
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        losses, pending = [], []
        self.events, self.peak_in_flight = [], 0
        t0 = time.perf_counter()
        for kind, i in schedule_order(self.schedule, r, p, m):
            start = time.perf_counter() - t0
            if kind == "F":
                x = xs[i] if first else self._recv(r - 1, dtype).requires_grad_(True)
                out = self.stage(x)
                if last:
                    loss = self.loss_fn(out, ys[i]) / m
                    losses.append(loss.detach())
                    out = loss
                else:
                    self._send(out, r + 1, pending)
                saved[i] = (x, out)
                self.peak_in_flight = max(self.peak_in_flight, len(saved))
            else:
                x, out = saved.pop(i)
                if last:
                    out.backward()
                else:
                    out.backward(self._recv(r + 1, out.dtype))
                if not first:
                    self._send(x.grad, r - 1, pending)
            self.events.append(_Event(kind, i, start, time.perf_counter() - t0))
        for request, _ in pending:
            request.wait()
        return torch.stack(losses).sum() if last else None

    def order(self) -> list[tuple[str, int]]:
        """The ``(kind, micro-batch)`` order the last :meth:`step` ran on this rank."""
        return [(e.kind, e.microbatch) for e in self.events]
