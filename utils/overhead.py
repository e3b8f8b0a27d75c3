"""Host launch overhead: the Python time an op spends per call outside its kernels.

A kernel op's call does two things: host work (argument checks, torch's custom-op dispatch,
autograd bookkeeping, output allocation, working out the grid and strides) and the kernel launches
themselves. In Triton's interpreter the launches cost milliseconds of Python, which hides the host
work; on a GPU the host work is what a small op is made of. :func:`no_launch` replaces every
Triton kernel launch with a no-op that only counts it, so that what remains is the host work, and
:func:`host_overhead` times it::

    from utils.overhead import host_overhead, eager_time
    x = torch.randn(8, 64)
    host_overhead(kernel_ladder.gelu, x)               # kernel_ladder's host time per call, launches skipped
    eager_time(torch.nn.functional.gelu, x)      # torch's own op on the same tiny input, for scale

Under :func:`no_launch` outputs are never written (they keep whatever the allocator gave them),
so nothing computed there should be used. An op that reads a kernel's result on the host (a check
slot: cross-entropy's target range) needs ``no_launch(fill=1)``: every buffer kernels allocate
(``kernel_ladder._launch.empty``) then starts as that value, which costs one fill per buffer.

What is replaced, for every kernel at once (at class level, restored on exit):

* the interpreter's launch: ``triton.runtime.interpreter.InterpretedFunction.run`` (and the
  ``GridExecutor`` it builds, for a caller that reaches it directly);
* the compiled launch: ``triton.runtime.jit.JITFunction.run``;
* Triton's autotuner (``Autotuner.run``, which ``kernel_ladder.autotune.make_autotuned`` builds on a
  GPU): a no-op there too, so that an autotuner never benchmarks no-ops and caches a choice
  made from them.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from triton.runtime import autotuner as _autotuner
from triton.runtime import interpreter as _interp
from triton.runtime import jit as _jit

__all__ = [
    "NoLaunch", "Overhead", "dispatch_floor", "eager_time", "floor_op", "host_overhead", "no_launch", "python_calls",
]

# Every active no_launch block, innermost last: each swallowed launch is counted in all of them.
_ACTIVE: list[NoLaunch] = []


def _kernel_name(obj: object) -> str:
    """A readable name for a launched kernel object (JIT/interpreted function, autotuner, executor)."""
    for attr in ("base_fn", "fn"):
        inner = getattr(obj, attr, None)
        name = getattr(inner, "__name__", None)
        if isinstance(name, str):
            return name
    return type(obj).__name__


def _record(obj: object) -> None:
    name = _kernel_name(obj)
    for block in _ACTIVE:
        block.launches += 1
        block.by_kernel[name] += 1


def _skip_run(self, *args, grid=None, warmup=False, **kwargs):
    # Same signature as KernelInterface.run; a warm-up launch runs nothing anyway.
    if not warmup:
        _record(self)
    return None


def _skip_autotuned(self, *args, **kwargs):
    _record(self)
    return None


def _skip_grid_call(self, *args, **kwargs):
    _record(self)
    return None


_PATCHES: tuple[tuple[type, str, Callable], ...] = (
    (_interp.InterpretedFunction, "run", _skip_run),
    (_interp.GridExecutor, "__call__", _skip_grid_call),
    (_jit.JITFunction, "run", _skip_run),
    (_autotuner.Autotuner, "run", _skip_autotuned),
)


class NoLaunch:
    """What a ``with no_launch() as nl:`` block swallowed: ``nl.launches`` in all, ``nl.by_kernel`` per name."""

    def __init__(self, fill: float | None = None) -> None:
        self.fill = fill
        self.launches: int = 0
        self.by_kernel: Counter[str] = Counter()
        self._saved: list[tuple[object, str, object]] = []
        self._state = "new"

    def __enter__(self) -> NoLaunch:
        if self._state != "new":
            raise RuntimeError("utils.overhead.no_launch: a NoLaunch block runs once; start a new one")
        for cls, name, stub in _PATCHES:
            # cls.__dict__, not getattr: restore exactly what the class itself held (a wrapper
            # that kernels or utils.trace installed stays in place afterwards).
            self._saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, stub)
        if self.fill is not None:
            from kernel_ladder import _launch

            fill = self.fill

            def filled(shape, dtype, device):
                return torch.full(tuple(shape), fill, dtype=dtype, device=device)

            self._saved.append((_launch, "empty", _launch.empty))
            _launch.empty = filled
        _ACTIVE.append(self)
        self._state = "active"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state != "active":
            return
        self._state = "done"
        _ACTIVE.remove(self)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def no_launch(fill: float | None = None) -> NoLaunch:
    """A context manager under which every Triton kernel launch is a no-op that is only counted.

    Works in both modes (interpreter and compiled) and for autotuned kernels; everything it
    replaced is put back on exit, also when the block raises. Blocks may nest (each counts the
    launches inside it). ``fill``: every buffer kernels allocate starts as this value (for ops
    that read a kernel's result on the host); None leaves them as allocated.
    """
    return NoLaunch(fill)


@dataclass(frozen=True)
class Overhead:
    """Per-call host time of a function: microseconds (median and min over repeats) and launches."""

    median_us: float
    min_us: float
    launches_per_call: float  # Triton launches swallowed per call (0 for torch's own ops)
    number: int  # calls per timed repeat
    repeat: int

    def __str__(self) -> str:
        return f"{self.median_us:.1f} us/call (min {self.min_us:.1f}, {self.launches_per_call:g} launches/call)"


def _check_counts(where: str, number: object, repeat: object, warmup: object) -> None:
    for name, value, least in (("number", number, 1), ("repeat", repeat, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"utils.overhead.{where}: {name} must be an int >= {least}, got {value!r}")


def _time_calls(fn: Callable, args: tuple, kwargs: dict, number: int, repeat: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn(*args, **kwargs)
    per_call = []
    clock = time.perf_counter_ns
    for _ in range(repeat):
        start = clock()
        for _ in range(number):
            fn(*args, **kwargs)
        per_call.append((clock() - start) / number / 1e3)
    return per_call


def host_overhead(fn: Callable, *args, number: int = 200, repeat: int = 7, warmup: int = 20,
                  fill: float | None = None, **kwargs) -> Overhead:
    """Time ``fn(*args, **kwargs)`` per call with every Triton launch replaced by a no-op.

    ``warmup`` untimed calls first (caches filled, the op's first-call setup done), then ``repeat``
    rounds of ``number`` calls each, timed with ``time.perf_counter_ns``. Returns the median and
    the fastest round's microseconds per call, and the launches each call made. For a forward and
    backward pass, pass a function doing both (e.g. ``lambda x: op(x).backward(g)``). ``fill`` as
    in :func:`no_launch`.
    """
    _check_counts("host_overhead", number, repeat, warmup)
    with no_launch(fill) as block:
        for _ in range(warmup):
            fn(*args, **kwargs)
        before = block.launches
        rounds = _time_calls(fn, args, kwargs, number, repeat, 0)
        launches = block.launches - before
    return Overhead(
        median_us=statistics.median(rounds), min_us=min(rounds),
        launches_per_call=launches / (number * repeat), number=number, repeat=repeat,
    )


def eager_time(fn: Callable, *args, number: int = 200, repeat: int = 7, warmup: int = 20, **kwargs) -> Overhead:
    """Time ``fn(*args, **kwargs)`` per call as it is (no launch replaced): the scale to compare with.

    Meant for torch's own eager op on the same tiny input (``torch.nn.functional.gelu``), whose
    time per call at such sizes is mostly torch's dispatch. ``launches_per_call`` counts Triton
    launches only (0 for a torch op).
    """
    _check_counts("eager_time", number, repeat, warmup)
    rounds = _time_calls(fn, args, kwargs, number, repeat, warmup)
    return Overhead(median_us=statistics.median(rounds), min_us=min(rounds), launches_per_call=0.0,
                    number=number, repeat=repeat)


def python_calls(fn: Callable, *args, number: int = 20, warmup: int = 3, launches: bool = False,
                 fill: float | None = None, **kwargs) -> float:
    """Function calls (Python functions and C builtins) per call of ``fn(*args, **kwargs)``.

    A count, not a time: the same on every machine and under any load, so it shows a change to the
    launch path that a noisy clock hides (one fewer validation pass is a few dozen calls). Counted
    with ``sys.setprofile`` over ``number`` calls after ``warmup``; Triton launches are swallowed as
    in :func:`host_overhead` unless ``launches`` (then the interpreter's own calls count too).
    ``fn`` itself counts as one (``torch.add`` is 1: all of it is C++).
    """
    _check_counts("python_calls", number, 1, warmup)
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    def measure() -> None:
        for _ in range(warmup):
            fn(*args, **kwargs)
        previous = sys.getprofile()
        sys.setprofile(hook)
        try:
            for _ in range(number):
                fn(*args, **kwargs)
        finally:
            sys.setprofile(previous)

    if launches:
        measure()
    else:
        with no_launch(fill):
            measure()
    # The hook also sees the sys.setprofile call that removes it: not the op's.
    return (count - 1) / number


_FLOOR_OP = None


def floor_op():
    """A ``torch.library`` custom op that only allocates an output of its input's shape (built once)."""
    global _FLOOR_OP
    if _FLOOR_OP is None:
        @torch.library.custom_op("kernel_ladder_overhead::identity", mutates_args=())
        def identity(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(x.shape)

        @identity.register_fake
        def _(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(x.shape)

        _FLOOR_OP = identity
    return _FLOOR_OP


def dispatch_floor(x: torch.Tensor | None = None, *, number: int = 200, repeat: int = 7) -> Overhead:
    """Per-call time of a custom op that only allocates its output: torch's own custom-op dispatch cost.

    No kernel op can be cheaper than this (each is such an op, plus its checks and launch plan);
    it is the floor the per-op overheads are read against.
    """
    op = floor_op()
    x = torch.zeros(8) if x is None else x
    return eager_time(op, x, number=number, repeat=repeat)
