"""Chapter 13's report entry: the C++ CPU ladder timed for real, and counted (``python -m bench.ch13_below_triton``).

The CPU part (this section): each rung of ``chapters/13_below_triton/src/cpu/rms_norm.cpp`` and ``gemm.cpp``
compiled with :data:`utils.cpp.DEFAULT_FLAGS` and ``-fopenmp``, checked against a float64 reference, and

* timed: the median of ``torch.utils.benchmark.Timer`` (``blocked_autorange``) for each rung and for torch's own
  CPU kernel (``torch.nn.functional.rms_norm``, ``torch.matmul``), the thread count of each row stated — torch's
  (``Timer(num_threads=)``) and OpenMP's (:func:`utils.cpp.set_openmp_threads`) set to the same — with the
  machine named (:func:`machine`). These are real times on a real CPU: they move with its clock and with
  whatever else it runs, and torch's kernels may use AVX-512 where the rungs are built for AVX2;
* counted: instructions (callgrind) and D1/LL misses (cachegrind, the simulated caches stated) per rung at a
  smaller size, the same on every machine that runs the same binary (:func:`cpu_counts`).

:func:`cpu_ladder` and :func:`cpu_counts` return rows for the notebook; ``main`` writes both tables between
the ``cpu`` markers of ``docs/results.md`` (part of ``make report``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import sys
from collections.abc import Sequence

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU_SOURCES = ROOT / "chapters" / "13_below_triton" / "src" / "cpu"
CPU_BEGIN, CPU_END = "<!-- cpu:begin -->", "<!-- cpu:end -->"

# --------------------------------------------------------------------------------------------
# The CPU ladder (C++), timed and counted
# --------------------------------------------------------------------------------------------

#: Rungs of each source, in ladder order, and whether a rung uses threads.
RMS_NORM_RUNGS = (("rms_norm_naive", False), ("rms_norm_simd", False), ("rms_norm_avx2", False),
                  ("rms_norm_threads", True))
GEMM_RUNGS = (("gemm_naive", False), ("gemm_ikj", False), ("gemm_blocked", False), ("gemm_simd", False),
              ("gemm_threads", True))
RMS_SIGNATURE = ("const float*", "const float*", "float*", "int64_t", "int64_t", "int64_t", "int64_t", "float")
GEMM_SIGNATURE = ("const float*", "const float*", "float*", *("int64_t",) * 6)

#: Default sizes: RMSNorm rows × cols, GEMM M = N = K (B of 4 MiB: past a 2 MiB L2).
DEFAULT_SIZES = {"rms_norm": (2048, 4096), "gemm": (1024,)}
#: The sizes valgrind counts at (it runs code about 50 times slower).
COUNT_SIZES = {"rms_norm": (64, 1003), "gemm": (144,)}
EPS = 1e-6


def machine() -> str:
    """The CPU (model, logical cores, the vector extensions that matter here, L1d/L2 per core) and torch's version."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    caches = []
    for index in sorted(pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind in ("Data", "Unified") and level in ("1", "2"):
            caches.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    vector = [f for f in ("avx2", "fma", "avx512f") if f in flags]
    return (f"{model}, {os.cpu_count()} logical cores, {' '.join(vector) or 'no AVX2'}"
            f"{', ' + ', '.join(caches) if caches else ''} per core; torch {torch.__version__}")


@dataclasses.dataclass(frozen=True)
class CpuRow:
    """One rung (or torch's kernel) timed: ``median_ms`` over ``threads`` threads, the work's rate (GFLOP/s for
    GEMM, GB/s moved for RMSNorm: x read, y written, w read once), ``vs_torch`` (torch's time at the same thread
    count / this time: above 1 is faster than torch) and the largest error against float64."""

    op: str
    rung: str
    size: str
    threads: int
    median_ms: float
    rate: float
    unit: str
    vs_torch: float
    max_error: float


def _libraries() -> dict[str, object]:
    from utils import cpp

    return {"rms_norm": cpp.compile_shared(CPU_SOURCES / "rms_norm.cpp", openmp=True),
            "gemm": cpp.compile_shared(CPU_SOURCES / "gemm.cpp", openmp=True)}


def built_rungs(library, rungs):
    """The rungs this machine's build has: the AVX2 intrinsics rung exists only where the compiler targets
    x86-64-v3 (``#if`` in its source); elsewhere the ladder goes on without it."""
    return [(name, threaded) for name, threaded in rungs if library.has(name)]


def _median(fn, threads: int, min_run_time: float) -> float:
    from torch.utils import benchmark

    from utils import cpp

    cpp.set_openmp_threads(threads)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def cpu_ladder(sizes: dict[str, tuple[int, ...]] | None = None, *, threads: int | None = None,
               min_run_time: float = 0.2, ops: Sequence[str] = ("rms_norm", "gemm")) -> list[CpuRow]:
    """Time every rung and torch's kernel (see the module's docstring). ``sizes``: ``{"rms_norm": (rows, cols),
    "gemm": (n,)}`` (default :data:`DEFAULT_SIZES`); ``threads``: of the threaded rung and of torch's second row
    (default: every core). Serial rungs run on one thread, compared with torch on one thread."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    threads = threads or os.cpu_count() or 1
    libraries = _libraries()
    generator = torch.Generator().manual_seed(0)
    rows: list[CpuRow] = []
    saved = torch.get_num_threads()
    try:
        if "rms_norm" in ops:
            rows += _rms_rows(libraries["rms_norm"], sizes["rms_norm"], threads, min_run_time, generator)
        if "gemm" in ops:
            rows += _gemm_rows(libraries["gemm"], sizes["gemm"][0], threads, min_run_time, generator)
    finally:
        torch.set_num_threads(saved)
    return rows


def _thread_counts(threads: int) -> list[int]:
    return sorted({1, threads})


def _rms_rows(library, size, threads, min_run_time, generator) -> list[CpuRow]:
    n_rows, cols = size
    x = torch.randn(n_rows, cols, generator=generator)
    w = torch.randn(cols, generator=generator) * 0.5 + 1.0
    y = torch.empty_like(x)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w.double()
    moved = (2 * x.numel() + w.numel()) * 4
    label = f"{n_rows} × {cols} fp32"
    torch_ms = {t: _median(lambda: torch.nn.functional.rms_norm(x, (cols,), w, EPS), t, min_run_time)
                for t in _thread_counts(threads)}
    got = torch.nn.functional.rms_norm(x, (cols,), w, EPS)
    rows = [CpuRow("rms_norm", "torch.nn.functional.rms_norm", label, t, ms, moved / ms / 1e6, "GB/s", 1.0,
                   float((got.double() - expected).abs().max())) for t, ms in torch_ms.items()]
    for name, threaded in built_rungs(library, RMS_NORM_RUNGS):
        kernel = library.kernel(name, RMS_SIGNATURE)
        t = threads if threaded else 1
        y.fill_(float("nan"))
        kernel(x, w, y, n_rows, cols, cols, cols, EPS)
        error = float((y.double() - expected).abs().max())
        ms = _median(lambda kernel=kernel: kernel(x, w, y, n_rows, cols, cols, cols, EPS), t, min_run_time)
        rows.append(CpuRow("rms_norm", name, label, t, ms, moved / ms / 1e6, "GB/s", torch_ms[t] / ms, error))
    return rows


def _gemm_rows(library, n, threads, min_run_time, generator) -> list[CpuRow]:
    a = torch.randn(n, n, generator=generator)
    b = torch.randn(n, n, generator=generator)
    c = torch.empty(n, n)
    expected = a.double() @ b.double()
    flops = 2 * n**3
    label = f"M = N = K = {n} fp32"
    torch_ms = {t: _median(lambda: torch.matmul(a, b), t, min_run_time) for t in _thread_counts(threads)}
    got = torch.matmul(a, b)
    rows = [CpuRow("gemm", "torch.matmul", label, t, ms, flops / ms / 1e6, "GFLOP/s", 1.0,
                   float((got.double() - expected).abs().max())) for t, ms in torch_ms.items()]
    for name, threaded in built_rungs(library, GEMM_RUNGS):
        kernel = library.kernel(name, GEMM_SIGNATURE)
        t = threads if threaded else 1
        c.fill_(float("nan"))
        kernel(a, b, c, n, n, n, n, n, n)
        error = float((c.double() - expected).abs().max())
        ms = _median(lambda kernel=kernel: kernel(a, b, c, n, n, n, n, n, n), t, min_run_time)
        rows.append(CpuRow("gemm", name, label, t, ms, flops / ms / 1e6, "GFLOP/s", torch_ms[t] / ms, error))
    return rows


@dataclasses.dataclass(frozen=True)
class CountRow:
    """One rung counted under valgrind at a small size: instructions (callgrind, the rung and what it calls) and
    its own D1 read misses and last-level misses (cachegrind), per element of the output (RMSNorm) or per 1000
    multiply-adds (GEMM): ``per`` says which."""

    op: str
    rung: str
    size: str
    instructions: float
    d1_read_misses: float
    ll_misses: float
    per: str


def cpu_counts(sizes: dict[str, tuple[int, ...]] | None = None) -> list[CountRow]:
    """Count every rung under valgrind at :data:`COUNT_SIZES` (or ``sizes``), on one OpenMP thread (valgrind runs
    threads one at a time: more would add the runtime's spinning, not the kernel's work)."""
    from utils import cpp, valgrind

    sizes = {**COUNT_SIZES, **(sizes or {})}
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}

    # Everything a rung runs, its calls and inlined intrinsics included (utils.valgrind.inside): counted by source
    # file, an intrinsic's loads would be charged to the compiler's headers and vanish from the SIMD rungs.
    rows = []
    n_rows, cols = sizes["rms_norm"]
    for name, _ in built_rungs(_libraries()["rms_norm"], RMS_NORM_RUNGS):
        exe = cpp.harness(CPU_SOURCES / "rms_norm.cpp", name, [
            cpp.buffer("const float*", n_rows * cols), cpp.buffer("const float*", cols),
            cpp.buffer("float*", n_rows * cols, "zeros"),
            *(cpp.scalar("int64_t", v) for v in (n_rows, cols, cols, cols)),
            cpp.scalar("float", EPS)], openmp=True)
        counts = valgrind.inside(exe, name, env=env)
        elements = n_rows * cols
        rows.append(CountRow("rms_norm", name, f"{n_rows} × {cols}", counts["Ir"] / elements,
                             counts["D1mr"] / elements, (counts["DLmr"] + counts["DLmw"]) / elements, "element"))
    (n,) = sizes["gemm"]
    for name, _ in GEMM_RUNGS:
        exe = cpp.harness(CPU_SOURCES / "gemm.cpp", name, [
            cpp.buffer("const float*", n * n), cpp.buffer("const float*", n * n), cpp.buffer("float*", n * n, "zeros"),
            *(cpp.scalar("int64_t", n) for _ in range(6))], openmp=True)
        counts = valgrind.inside(exe, name, env=env)
        thousand = n**3 / 1000
        rows.append(CountRow("gemm", name, f"M = N = K = {n}", counts["Ir"] / thousand,
                             counts["D1mr"] / thousand, (counts["DLmr"] + counts["DLmw"]) / thousand,
                             "1000 multiply-adds"))
    return rows


def cpu_markdown(rows: Sequence[CpuRow], counts: Sequence[CountRow], stamp: str, threads: int) -> str:
    """The tables of :func:`cpu_ladder` and :func:`cpu_counts` in markdown, with what they are."""
    from utils.valgrind import DEFAULT_CACHE

    lines = [CPU_BEGIN, "## The C++ CPU ladder (chapter 13, generated by `make report`)", "",
             f"Machine: {stamp}.", "",
             "Real times on this CPU: the median of `torch.utils.benchmark.Timer.blocked_autorange` per call. Serial "
             f"rungs run on 1 thread and are compared with torch on 1 thread; the threaded rungs on {threads} "
             f"OpenMP threads, compared with torch on {threads} threads (torch's and OpenMP's thread counts set to "
             "the same). The rungs are built with `-O3 -march=x86-64-v3` (AVX2 + FMA); torch's own kernels choose "
             "their instructions at run time (AVX-512 where the CPU has it). On a machine shared with other work "
             "the times move from run to run; the counts below do not.", "",
             "| op | rung | size | threads | median ms | rate | × torch | max error vs fp64 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.op} | `{r.rung}` | {r.size} | {r.threads} | {r.median_ms:.3f} | {r.rate:.1f} {r.unit} | "
                     f"{r.vs_torch:.2f} | {r.max_error:.1e} |")
    lines += ["", "*× torch*: torch's time at the same thread count divided by the rung's (above 1: faster than "
              "torch). RMSNorm's rate counts x read, y written and w read once.", "",
              f"Counted by valgrind at a smaller size, on one OpenMP thread: instructions of the rung and what it "
              f"calls, and its D1 read misses and last-level misses, all counted while the rung runs (callgrind "
              f"with its cache simulator: D1 {DEFAULT_CACHE['D1']}, LL {DEFAULT_CACHE['LL']} — not this CPU's; "
              "the harness's set-up before the call warms them, so LL misses are near 0 at these sizes); the same "
              "counts on every machine that runs the same binary.", "",
              "| op | rung | size | instructions | D1 read misses | LL misses | per |", "|---|---|---|---|---|---|---|"]
    for c in counts:
        lines.append(f"| {c.op} | `{c.rung}` | {c.size} | {c.instructions:.3g} | {c.d1_read_misses:.3g} | "
                     f"{c.ll_misses:.3g} | {c.per} |")
    lines += ["", CPU_END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.report import write_between
    from utils import valgrind

    parser = argparse.ArgumentParser(prog="python -m bench.ch13_below_triton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results.md")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    parser.add_argument("--threads", type=int, default=None, help="threads of the threaded rungs and of torch")
    args = parser.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    stamp = machine()
    print(f"ch13 cpu: {stamp}", file=sys.stderr)
    rows = cpu_ladder(threads=threads)
    counts = cpu_counts() if valgrind.available() else []
    markdown = cpu_markdown(rows, counts, stamp, threads)
    print(markdown)
    if not args.no_write:
        write_between(args.out, CPU_BEGIN, CPU_END, markdown)
        print(f"ch13 cpu: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------------------------
# make gpu-check: each part's entries (the CUDA parts build on a GPU machine, or say why they cannot)
# --------------------------------------------------------------------------------------------


def gpu_checks(size: str = "gpu") -> list:
    """Chapter 13's ``make gpu-check`` entries: the native operator's CUDA kernels (:mod:`bench.ch13_native_cuda`)
    and the CUDA GEMM ladder (:mod:`bench.ch13_gemm_cuda`), each built on the GPU machine or listed as unavailable
    with the reason."""
    from bench import ch13_gemm_cuda, ch13_native_cuda

    return [*ch13_native_cuda._native_op_gpu_checks(size), *ch13_gemm_cuda._gemm_gpu_checks(size)]
