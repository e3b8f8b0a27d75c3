"""Data parallelism with gradient buckets, all-reduced while the backward is still running.

:class:`DataParallel` is the mechanism of ``torch.nn.parallel.DistributedDataParallel``, written
out: every rank holds the whole model and a different slice of the batch; after the backward,
every rank must hold the *average* of the ranks' gradients. Doing that with one all-reduce per
parameter pays the latency ``α`` hundreds of times; one all-reduce after the backward wastes the
backward's time. So:

* **Buckets.** Parameters are grouped, in the reverse of their registration order (roughly the
  order the backward produces their gradients), into buckets of at most ``bucket_cap_mb``
  megabytes of one dtype, each with one flat buffer.
* **Hooks.** ``register_post_accumulate_grad_hook`` runs when a parameter's gradient is final for
  this backward; the hook copies it into its bucket's buffer, and when the bucket's last gradient
  arrives the bucket's all-reduce is launched asynchronously (``async_op=True``) — while autograd
  goes on computing the gradients of earlier layers.
* **The end of the backward.** The first hook of a backward queues a callback on the autograd
  engine; it runs when the whole backward is done, waits for every bucket, divides by the world
  size and copies the averages back into each ``param.grad``.

``no_sync()`` skips the communication (gradient accumulation over micro-batches: the gradients
add up locally, and the next backward outside ``no_sync`` all-reduces the sum).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Bucket", "DataParallel", "plan_buckets"]

_OP = "kernel_ladder.distributed.DataParallel"


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they share."""

    params: list[torch.nn.Parameter]
    offsets: list[int]  # each parameter's first element in the buffer
    buffer: torch.Tensor
    ready: int = 0
    work: object | None = None
    launched_at: float | None = None  # time.perf_counter() when its all-reduce was launched
    launched_after: int | None = None  # how many gradients of the backward had arrived by then
    names: list[str] = field(default_factory=list)


Named = list[tuple[str, torch.nn.Parameter]]


def plan_buckets(params: Named, cap_bytes: int) -> list[Named]:
    """Group ``(name, param)`` pairs, last registered first, into buckets of at most ``cap_bytes`` of one dtype.

    A parameter larger than the cap gets a bucket of its own; a change of dtype closes a bucket.
    """
    buckets: list[Named] = []
    current: Named = []
    size = 0
    for name, p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0][1].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class DataParallel(torch.nn.Module):
    """Wrap ``module`` for data parallelism over ``group`` (default: the whole world).

    At construction every rank's parameters and buffers are replaced by rank 0's (a broadcast),
    so all ranks start equal. Calling the wrapper calls ``module``; after ``loss.backward()`` each
    ``param.grad`` is the average over the ranks. Every parameter that requires a gradient must
    get one in each backward (unused parameters are refused at the end of the backward, naming
    them). ``bucket_cap_mb`` is in megabytes of 2**20 bytes, as in torch's DDP.
    """

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float = 25, group=None) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{_OP}: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"{_OP}: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{_OP}: no process group: call torch.distributed.init_process_group first")
        self.module = module
        self.group = dist.group.WORLD if group is None else group
        self.world_size = dist.get_world_size(self.group)
        src = 0 if group is None else dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src, group=self.group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}
        for members in plan_buckets(named, int(bucket_cap_mb * 2**20)):
            offsets, total = [], 0
            for _, p in members:
                offsets.append(total)
                total += p.numel()
            first = members[0][1]
            bucket = Bucket([p for _, p in members], offsets,
                            torch.zeros(total, dtype=first.dtype, device=first.device), names=[n for n, _ in members])
            self.buckets.append(bucket)
            for index, (_, p) in enumerate(members):
                self._where[id(p)] = (bucket, index)
        self._sync = True
        self._arrived = 0
        self._seen: set[int] = set()
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in named]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate their gradients locally, with no communication."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # -- the hooks ---------------------------------------------------------------------------

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            self._arrived = 0
            self._seen.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._seen.add(id(param))
        bucket, index = self._where[id(param)]
        start = bucket.offsets[index]
        bucket.buffer[start:start + param.numel()].copy_(param.grad.reshape(-1))
        bucket.ready += 1
        self._arrived += 1
        if bucket.ready == len(bucket.params):
            bucket.launched_at, bucket.launched_after = time.perf_counter(), self._arrived
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _finish(self) -> None:
        self._callback_queued = False
        missing = sorted(name for b in self.buckets for name, p in zip(b.names, b.params) if id(p) not in self._seen)
        if missing:
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()  # the peers sent it: finish the exchange before giving up
                b.ready, b.work = 0, None
            raise RuntimeError(f"{_OP}: no gradient reached {missing} in this backward (unused parameters); every "
                               "parameter that requires a gradient must get one, or set requires_grad=False on it")
        for b in self.buckets:
            b.work.wait()
            b.buffer.div_(self.world_size)
            for p, start in zip(b.params, b.offsets):
                p.grad.copy_(b.buffer[start:start + p.numel()].view_as(p.grad))
            b.ready, b.work = 0, None

    def timeline(self) -> list[dict]:
        """When each bucket's all-reduce was launched in the last backward: its parameters, its bytes,
        and how many of the backward's gradients had arrived by then (fewer than all: overlapped)."""
        return [{"bucket": k, "params": list(b.names), "bytes": b.buffer.numel() * b.buffer.element_size(),
                 "launched_after": b.launched_after, "launched_at": b.launched_at} for k, b in enumerate(self.buckets)]
