"""Measure the peak memory of torch code and of our Triton ops, on any device (the CPU too).

``peak_memory()`` watches every tensor storage that is allocated inside a ``with`` block and
knows when each one is freed, so it reports the largest number of bytes alive at any moment::

    from utils.memory import peak_memory
    with peak_memory() as m:
        loss = kernel_ladder.cross_entropy(logits, target)
        loss.backward()
    m.peak_bytes          # the most bytes alive at once inside the block
    m.allocated_bytes     # bytes allocated inside the block and still alive at its end
    print(m.table())      # the biggest allocations alive at the peak, by the op that made them

How it works: a ``TorchDispatchMode`` sees every operator call below autograd — the forward's
ops, the backward's (the autograd engine dispatches them too), factory functions such as
``torch.empty``, and our ``kernel_ladder::`` custom ops. For each output it takes the tensor's
*storage* (views and in-place results share their input's storage, so each storage is counted
once) and registers a ``weakref.finalize`` on it: torch keeps one Python object per live
storage, so the finalizer runs exactly when the memory is released. Custom ops (and any op
whose implementation calls other operators) are run with the recorder active inside them, so a
Triton op's ``torch.empty`` outputs and scratch buffers are seen and credited to the op.

What it counts, precisely:

* only storages created inside the block (tensors that existed before are not counted, even if
  an op inside resizes them in place); a storage that grows in place (an ``out=`` result) is
  counted at its new size;
* the bytes the storages hold (``UntypedStorage.nbytes()``), not the allocator's rounding or
  caching; on CUDA, ``cuda_peak_bytes`` adds the allocator's own view
  (``torch.cuda.max_memory_allocated`` minus the bytes allocated at entry; entering resets the
  device's peak statistics);
* scratch memory that an aten kernel allocates without going through the dispatcher, and
  values a Triton kernel holds in registers (or, in the interpreter, in numpy arrays), are not
  torch storages and are not counted; on CUDA, ``cuda_peak_bytes`` sees everything the caching
  allocator hands out. (A ``torch.compile``'d function called inside the block was seen through
  the aten ops it dispatched, with the ``inductor`` and ``aot_eager`` backends on the CPU.)

The mode composes with :func:`utils.trace.trace` (both can be active).
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["Allocation", "OpMemory", "PeakMemory", "peak_memory", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.54 kB'`` (decimal units, like the tracer's)."""
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass
class Allocation:
    """One storage allocated inside the block."""

    index: int  # order of allocation
    op: str  # the operator called from the block (or by autograd), e.g. "aten.mul" or "kernel_ladder.gelu"
    inner: str  # the operator that returned the storage first (``op`` itself unless ``op`` calls others)
    nbytes: int
    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the first tensor seen on the storage
    alive: bool = True  # still alive (at the block's end, once it has ended)


@dataclass(frozen=True)
class OpMemory:
    """The allocations of one op, summed."""

    op: str
    count: int
    total_bytes: int  # everything it allocated inside the block
    at_peak_bytes: int  # of which alive at the peak
    alive_bytes: int  # of which still alive at the block's end
    largest_bytes: int


def _op_name(func: Any) -> str:
    try:
        return f"{func.namespace}.{func._opname}"
    except AttributeError:  # pragma: no cover - every OpOverload has both
        return str(func)


def _real_tensor(t: object) -> bool:
    """A tensor with real memory (not meta, fake, sparse, or a wrapper subclass)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.is_sparse:
        return False
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return True
    if is_traceable_wrapper_subclass(t):
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # imported by whoever makes fake tensors
    return fake is None or not isinstance(t, fake.FakeTensor)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # nested/sparse layouts have no single storage
        return None


class PeakMemory:
    """What a ``with peak_memory() as m:`` block measured (read it after the block)."""

    def __init__(self, cuda: bool | None = None) -> None:
        self._cuda = torch.cuda.is_available() if cuda is None else cuda
        self._lock = threading.RLock()
        self._live: dict[int, tuple[Allocation, weakref.finalize]] = {}  # id(storage) -> ...
        self._events: list[tuple[Allocation, int]] = []  # (allocation, +bytes / -bytes) in order
        self._current = 0
        self._peak = 0
        self._peak_event = 0  # number of events up to and including the peak
        self._allocs: list[Allocation] = []  # every storage seen, empty ones included (they may grow)
        self._modes: list[_Recorder] = []
        self._state = "new"
        self._cuda_base = 0
        self.cuda_peak_bytes: int | None = None
        self._at_peak: dict[int, int] | None = None  # allocation index -> bytes it held at the peak
        self._final_allocated = 0

    # -- recording ------------------------------------------------------------------------------
    def _record_outputs(self, op: str, inner: str, out: Any, input_storages: set[int]) -> None:
        for t in tree_leaves(out):
            if not _real_tensor(t):
                continue
            storage = _storage(t)
            if storage is None:
                continue
            key = id(storage)
            nbytes = storage.nbytes()
            with self._lock:
                known = self._live.get(key)
                if known is not None:
                    alloc = known[0]
                    if nbytes != alloc.nbytes:  # grown (or shrunk) in place, e.g. an out= result
                        self._change(alloc, nbytes - alloc.nbytes)
                        alloc.nbytes = nbytes
                    continue
                if key in input_storages:
                    continue  # a view of, or an in-place result on, memory from before the block
                alloc = Allocation(
                    index=len(self._allocs), op=op, inner=inner, nbytes=nbytes, device=str(t.device),
                    dtype=t.dtype, shape=tuple(t.shape),
                )
                self._allocs.append(alloc)
                finalizer = weakref.finalize(storage, self._freed, key)
                finalizer.atexit = False
                self._live[key] = (alloc, finalizer)
                self._change(alloc, nbytes)

    def _freed(self, key: int) -> None:
        with self._lock:
            known = self._live.pop(key, None)
            if known is None:
                return
            alloc = known[0]
            alloc.alive = False
            self._change(alloc, -alloc.nbytes)

    def _change(self, alloc: Allocation, delta: int) -> None:
        self._events.append((alloc, delta))
        self._current += delta
        if self._current > self._peak:
            self._peak = self._current
            self._peak_event = len(self._events)

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> PeakMemory:
        if self._state != "new":
            raise RuntimeError("utils.memory: a PeakMemory measures once; start a new one with peak_memory()")
        self._state = "active"
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base = torch.cuda.memory_allocated()
        mode = _Recorder(self, outer_op=None)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state != "active":
            return
        self._modes.pop().__exit__(*exc)
        self._state = "done"
        if self._cuda:
            torch.cuda.synchronize()
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated() - self._cuda_base
        with self._lock:
            self._final_allocated = self._current
            # Storages alive at the end stay alive as far as this measurement is concerned.
            for _, finalizer in self._live.values():
                finalizer.detach()
            self._live.clear()
            self._at_peak = self._replay_to_peak()

    def _replay_to_peak(self) -> dict[int, int]:
        # The bytes each storage held at the peak: its net change up to the peak event.
        net: dict[int, int] = {}
        for alloc, delta in self._events[: self._peak_event]:
            net[alloc.index] = net.get(alloc.index, 0) + delta
        return {i: n for i, n in net.items() if n > 0}

    def _require_done(self) -> None:
        if self._state != "done":
            raise RuntimeError("utils.memory: read the measurement after the `with peak_memory()` block ends")

    # -- results --------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """The most bytes of storages allocated inside the block that were alive at one moment."""
        self._require_done()
        return self._peak

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated inside the block and still alive when it ended (e.g. the returned loss and ``.grad``)."""
        self._require_done()
        return self._final_allocated

    @property
    def allocations(self) -> list[Allocation]:
        """Every storage allocated inside the block with at least one byte, in order."""
        self._require_done()
        return [a for a in self._allocs if a.nbytes > 0]

    @property
    def total_allocated_bytes(self) -> int:
        """Everything allocated inside the block, freed or not."""
        self._require_done()
        return sum(a.nbytes for a in self._allocs)

    @property
    def at_peak(self) -> list[Allocation]:
        """The allocations alive at the peak, biggest first (their bytes then sum to ``peak_bytes``)."""
        self._require_done()
        at_peak = self._at_peak or {}
        return sorted((self._allocs[i] for i in at_peak), key=lambda a: (-at_peak[a.index], a.index))

    def by_op(self) -> list[OpMemory]:
        """The allocations summed per op, biggest at the peak first (then by total)."""
        self._require_done()
        at_peak = self._at_peak or {}
        rows: dict[str, list[Allocation]] = {}
        for a in self.allocations:
            rows.setdefault(a.op, []).append(a)
        result = [
            OpMemory(
                op=op, count=len(allocs), total_bytes=sum(a.nbytes for a in allocs),
                at_peak_bytes=sum(at_peak.get(a.index, 0) for a in allocs),
                alive_bytes=sum(a.nbytes for a in allocs if a.alive),
                largest_bytes=max(a.nbytes for a in allocs),
            )
            for op, allocs in rows.items()
        ]
        return sorted(result, key=lambda r: (-r.at_peak_bytes, -r.total_bytes, r.op))

    def table(self, top: int = 10) -> str:
        """The ``top`` ops by bytes alive at the peak, with totals; exact byte counts."""
        self._require_done()
        header = ("op", "allocs", "at peak B", "total B", "alive at end B", "largest B")
        rows = [header]
        ops = self.by_op()
        for r in ops[:top]:
            rows.append((r.op, f"{r.count:,}", f"{r.at_peak_bytes:,}", f"{r.total_bytes:,}", f"{r.alive_bytes:,}",
                         f"{r.largest_bytes:,}"))
        if len(ops) > top:
            rest = ops[top:]
            rows.append((f"({len(rest)} more ops)", f"{sum(r.count for r in rest):,}",
                         f"{sum(r.at_peak_bytes for r in rest):,}", f"{sum(r.total_bytes for r in rest):,}",
                         f"{sum(r.alive_bytes for r in rest):,}", ""))
        rows.append(("peak", f"{len(self.allocations):,}", f"{self.peak_bytes:,}", f"{self.total_allocated_bytes:,}",
                     f"{self.allocated_bytes:,}", ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = []
        for n, row in enumerate(rows):
            cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
            if n == 0 or n == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        if self.cuda_peak_bytes is not None:
            lines.append(f"CUDA allocator peak above the bytes at entry: {self.cuda_peak_bytes:,} B")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        if self._state != "done":
            return f"PeakMemory({self._state})"
        return (f"PeakMemory(peak={format_bytes(self._peak)}, allocated={format_bytes(self._final_allocated)}, "
                f"allocations={len(self.allocations)})")


def _python_body(func: Any, args: tuple, kwargs: dict) -> Any:
    """The Python function that implements a ``torch.library.custom_op`` here, or None."""
    if func.namespace in ("aten", "prim", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef  # noqa: PLC0415
    except ImportError:  # pragma: no cover - older torch
        return None
    opdef = _maybe_get_opdef(func)
    if opdef is None:
        return None
    device_type = next((t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
    backends = getattr(opdef, "_backend_fns", {})
    return backends.get(device_type) or backends.get(None) or getattr(opdef, "_init_fn", None)


class _Recorder(TorchDispatchMode):
    """Records the output storages of every op; runs a custom op's Python body with a recorder active."""

    def __init__(self, owner: PeakMemory, outer_op: str | None) -> None:
        super().__init__()
        self.owner = owner
        self.outer_op = outer_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        input_storages = set()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.UntypedStorage):  # e.g. Tensor.set_(storage): not a new allocation
                input_storages.add(id(t))
            elif isinstance(t, torch.TypedStorage):
                input_storages.add(id(t.untyped_storage()))
            elif _real_tensor(t):
                storage = _storage(t)
                if storage is not None:
                    input_storages.add(id(storage))
        outer = self.outer_op or name
        body = _python_body(func, args, kwargs)
        if body is None:
            out = func(*args, **kwargs)  # an aten op: its C++ kernel's own scratch is not seen
        else:
            # While an op runs this mode is off the dispatch stack; running a custom op's Python body
            # under a fresh recorder sees what it allocates (its torch.empty outputs, any scratch),
            # credited to the outermost op.
            with _Recorder(self.owner, outer_op=outer):
                out = body(*args, **kwargs)
        self.owner._record_outputs(outer, name, out, input_storages)
        return out


def peak_memory(cuda: bool | None = None) -> PeakMemory:
    """Measure the peak bytes of tensor storages allocated inside a ``with`` block.

    Args:
        cuda: also read the CUDA caching allocator's peak (``PeakMemory.cuda_peak_bytes``); by
            default when a CUDA device is available. Entering resets the device's peak statistics.

    Returns:
        A :class:`PeakMemory`; read ``peak_bytes``, ``allocated_bytes``, ``at_peak``, ``by_op()``
        and ``table()`` after the block.
    """
    return PeakMemory(cuda=cuda)
