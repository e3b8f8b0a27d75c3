"""Timing that says what it measured.

On a GPU (kernels compiled), ``measure`` uses ``triton.testing.do_bench``: warm-up, many
repetitions, the L2 cache flushed between them, quantiles of the distribution. On the CPU there is
no driver for ``do_bench``; ``measure`` then takes wall-clock times of a few calls and labels them
as what they are: CPU time (torch's CPU kernels, or Triton's interpreter running each program in
Python), which says nothing about a GPU's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernel_ladder import runtime as _runtime

__all__ = ["Timing", "Row", "measure", "compare", "format_table", "gbps", "CPU_NOTE"]

CPU_NOTE = "CPU time (torch's CPU kernels or Triton's interpreter), not a GPU's"
GPU_NOTE = "GPU time from triton.testing.do_bench (median over repetitions, L2 flushed between them)"
# What ``str(timing)`` says on one line (the notes above are kept whole in ``Timing.note`` and under tables).
_SHORT_NOTES = {CPU_NOTE: "CPU time, not a GPU's", GPU_NOTE: "do_bench, L2 flushed"}

_CPU_MIN_RUNS = 3
_CPU_MAX_RUNS = 100


@dataclass(frozen=True)
class Timing:
    """Quantiles of a function's run time, with where and how they were taken."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    device: str
    note: str
    runs: int = 0

    def __str__(self) -> str:
        # One short line (the full note is ``self.note``): "0.0052 ms (p20 0.0051, p80 0.0055) on cpu — CPU time, ...".
        note = _SHORT_NOTES.get(self.note, self.note)
        return (f"{self.median_ms:.4g} ms (p20 {self.p20_ms:.4g}, p80 {self.p80_ms:.4g}) on {self.device}"
                f" — {note}")


@dataclass(frozen=True)
class Row:
    """One line of a comparison: the timing, its speed-up over the first entry, and GB/s if bytes were given."""

    name: str
    timing: Timing
    speedup: float
    gbps: float | None = None


def _gpu_timing_available() -> bool:
    return (not _runtime.INTERPRETER) and torch.cuda.is_available()


def gbps(bytes: float, ms: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second) of moving ``bytes`` in ``ms`` milliseconds."""
    return bytes / (ms * 1e6) if ms > 0 else float("inf")


def measure(fn: Callable[..., Any], *args: Any, warmup: int = 25, rep: int = 100, **kwargs: Any) -> Timing:
    """Time ``fn(*args, **kwargs)``.

    ``warmup`` and ``rep`` are milliseconds, as for ``triton.testing.do_bench`` on a GPU. On the
    CPU: one warm-up call (if ``warmup`` > 0), then calls until ``rep`` ms have passed (at least 3,
    at most 100), and the note says the times are the interpreter's.
    """
    if _gpu_timing_available():
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=warmup, rep=rep,
                                                   quantiles=[0.5, 0.2, 0.8])
        return Timing(float(median), float(p20), float(p80), device=torch.cuda.get_device_name(), note=GPU_NOTE)

    if warmup > 0:
        fn(*args, **kwargs)
    times: list[float] = []
    budget_s = rep / 1e3
    started = time.perf_counter()
    while len(times) < _CPU_MAX_RUNS and (len(times) < _CPU_MIN_RUNS or time.perf_counter() - started < budget_s):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append((time.perf_counter() - t0) * 1e3)
    median, p20, p80 = np.quantile(np.asarray(times), [0.5, 0.2, 0.8])
    return Timing(float(median), float(p20), float(p80), device="cpu", note=CPU_NOTE, runs=len(times))


def compare(fns: Mapping[str, Callable[..., Any]], *args: Any, bytes: float | Mapping[str, float] | None = None,
            warmup: int = 25, rep: int = 100) -> list[Row]:
    """Time each function on the same arguments; speed-ups are relative to the first.

    ``bytes`` (one number, or one per name) adds each row's achieved GB/s.
    """
    rows: list[Row] = []
    baseline: float | None = None
    for name, fn in fns.items():
        timing = measure(fn, *args, warmup=warmup, rep=rep)
        baseline = timing.median_ms if baseline is None else baseline
        moved = bytes.get(name) if isinstance(bytes, Mapping) else bytes
        rows.append(Row(
            name=name,
            timing=timing,
            speedup=baseline / timing.median_ms if timing.median_ms > 0 else float("inf"),
            gbps=gbps(moved, timing.median_ms) if moved is not None else None,
        ))
    return rows


def format_table(rows: list[Row]) -> str:
    """A plain-text table of ``compare``'s rows, with the timings' notes underneath."""
    header = ("name", "median ms", "p20 ms", "p80 ms", "vs first", "GB/s")
    body = [(r.name, f"{r.timing.median_ms:.4g}", f"{r.timing.p20_ms:.4g}", f"{r.timing.p80_ms:.4g}",
             f"{r.speedup:.2f}×", "" if r.gbps is None else f"{r.gbps:.4g}") for r in rows]
    table = [header, *body]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = sorted({f"{r.timing.device}: {r.timing.note}" for r in rows})
    return "\n".join([*lines, *notes])
