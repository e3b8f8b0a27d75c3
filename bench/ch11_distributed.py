"""``python -m bench.ch11_distributed`` (part of ``make report``): chapter 11's all-reduce ladder on a
real gloo world — star (everyone through rank 0) → binomial tree → ring — and the ring's
reduce-scatter and all-gather, each beside torch's own collective on the same world.

For every collective, world size and message size it records what was *counted* (the bytes the
busiest rank sent, through :func:`kernel_ladder.distributed.count_bytes`, against the α–β model's
formula), what was *checked* (the largest difference from torch's result), and what was *timed*
on this machine's gloo (the median over repeats of the slowest rank's time). The ring's times are
fitted to ``messages·α + bytes·β`` by least squares, which gives this machine's own ``α`` and
bandwidth, and each row's time predicted from them.

These are CPU processes talking through gloo on one machine (loopback TCP, ranks possibly more than
cores), not GPUs on NVLink: the shapes of the curves carry over, the numbers do not.

Writes a table between the distributed markers of ``docs/results.md`` and
``docs/img/ch11_collectives.png``; ``--no-write`` prints the table only.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench.report import ROOT, _progress, machine, write_between

BEGIN, END = "<!-- distributed:begin -->", "<!-- distributed:end -->"
ALL_REDUCES = ("star_all_reduce", "tree_all_reduce", "ring_all_reduce")
RING = ("ring_reduce_scatter", "ring_all_gather")
TORCH_OF = {"star_all_reduce": "all_reduce", "tree_all_reduce": "all_reduce", "ring_all_reduce": "all_reduce",
            "ring_reduce_scatter": "reduce_scatter", "ring_all_gather": "all_gather"}
SIZES = tuple(4**k for k in range(4, 12))  # 256 .. 4M fp32 elements: 1 KiB .. 16 MiB
WORLDS = (2, 4)


@dataclass(frozen=True)
class CollectiveRow:
    """One collective at one world size and message size (``n`` fp32 elements per rank)."""

    op: str  # a kernel_ladder.distributed collective, or "torch.<name>" for torch's own
    p: int
    n: int
    busiest_bytes: int | None  # the most bytes any rank sent (counted; None for torch's)
    model_bytes: float | None  # the α–β model's bytes on the busiest link
    max_error: float  # against torch's result
    seconds: float  # median over repeats of the slowest rank

    @property
    def counted_matches_model(self) -> bool | None:
        return None if self.busiest_bytes is None else math.isclose(self.busiest_bytes, self.model_bytes)


def _model_bytes(op: str, nbytes: int, p: int) -> float:
    from kernel_ladder.distributed import AlphaBeta

    unit = AlphaBeta(alpha=0.0, bandwidth=1.0)  # its "time" is then the bytes on the critical path
    if op == "tree_all_reduce":  # the busiest rank sends at most its children's and one parent's share
        return float(max(_tree_sends(r, p) for r in range(p)) * nbytes)
    method = {"ring_reduce_scatter": "reduce_scatter", "ring_all_gather": "all_gather",
              "ring_all_reduce": "all_reduce"}.get(op, op)
    if op == "ring_all_gather":  # the model counts the gathered tensor; the input is 1/p of it
        return getattr(unit, method)(nbytes * p, p)
    return getattr(unit, method)(nbytes, p)


def _tree_sends(r: int, p: int) -> int:
    up = 0 if r == 0 else 1
    return up + sum(1 for k in range(p.bit_length()) if r < 2**k and r + 2**k < p)


def messages(op: str, p: int) -> int:
    """Messages on the critical path (the α term)."""
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    return {"star_all_reduce": 2, "tree_all_reduce": 2 * rounds, "ring_all_reduce": 2 * (p - 1)}.get(op, p - 1)


def _run(op: str, x: torch.Tensor):
    import torch.distributed as dist

    import kernel_ladder.distributed as kd

    p = dist.get_world_size()
    if op.startswith("torch."):
        name = op.split(".", 1)[1]
        if name == "all_reduce":
            dist.all_reduce(x)
            return x
        if name == "reduce_scatter":
            out = torch.empty(x.numel() // p, dtype=x.dtype)
            kd.collectives.reduce_scatter_into(out, x)
            return out
        out = torch.empty(x.numel() * p, dtype=x.dtype)
        kd.collectives.all_gather_into(out, x)
        return out
    return getattr(kd, op)(x)


def measure(sizes: tuple[int, ...], repeats: int) -> list[dict]:
    """On every rank of the world: each collective at each size, its bytes, error and times."""
    import torch.distributed as dist

    import kernel_ladder.distributed as kd

    r, p = dist.get_rank(), dist.get_world_size()
    out = []
    for n in sizes:
        n = n - n % p  # a multiple of p: torch's reduce-scatter needs one, and the model is then exact
        x = torch.randn(n, generator=torch.Generator().manual_seed(100 * r + n % 97))
        for op in (*ALL_REDUCES, *RING):
            theirs = _run("torch." + TORCH_OF[op], x.clone())
            with kd.count_bytes() as stats:
                ours = _run(op, x.clone())
            error = float((ours - theirs).abs().max())
            for name in (op, "torch." + TORCH_OF[op]):
                if name.startswith("torch.") and op not in ("ring_all_reduce", *RING):
                    continue  # torch's all-reduce is timed once, beside the ring
                times = []
                for _ in range(repeats + 1):
                    y = x.clone()
                    dist.barrier()
                    start = time.perf_counter()
                    _run(name, y)
                    times.append(time.perf_counter() - start)
                out.append({"op": name, "n": n, "bytes": None if name.startswith("torch.") else stats.bytes_sent,
                            "error": 0.0 if name.startswith("torch.") else error, "times": times[1:]})
    return out


def collect(p: int, sizes: tuple[int, ...], repeats: int) -> list[CollectiveRow]:
    """Run :func:`measure` on a fresh world of ``p`` ranks and fold the ranks' results into rows."""
    from bench import ch11_distributed as this  # by its module name: under ``python -m`` this file is __main__
    from utils.distributed import World

    with World(p, timeout=120) as world:
        per_rank = world.run(this.measure, sizes, repeats, timeout=1800)
    rows = []
    for k, first in enumerate(per_rank[0]):
        ranks = [res[k] for res in per_rank]
        slowest = [max(t) for t in zip(*(res["times"] for res in ranks))]
        counted = None if first["bytes"] is None else max(res["bytes"] for res in ranks)
        model = None if counted is None else _model_bytes(first["op"], first["n"] * 4, p)
        rows.append(CollectiveRow(first["op"], p, first["n"], counted, model,
                                  max(res["error"] for res in ranks), statistics.median(slowest)))
    return rows


def fit_alpha_beta(rows: list[CollectiveRow], p: int) -> tuple[float, float]:
    """``(α seconds, bandwidth bytes/s)`` fitted to the ring all-reduce's times on ``p`` ranks."""
    ring = [r for r in rows if r.op == "ring_all_reduce" and r.p == p]
    a = torch.tensor([[messages(r.op, r.p), r.busiest_bytes] for r in ring], dtype=torch.float64)
    t = torch.tensor([r.seconds for r in ring], dtype=torch.float64)
    # relative least squares (divide each equation by its time), so the small messages count too
    solution = torch.linalg.lstsq(a / t[:, None], torch.ones_like(t)).solution
    alpha, beta = (max(float(v), 0.0) for v in solution)
    return alpha, (1 / beta if beta > 0 else math.inf)


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def table(rows: list[CollectiveRow], fits: dict[int, tuple[float, float]]) -> str:
    lines = ["| collective | p | tensor | busiest rank sent (counted) | model | max error vs torch | "
             "time (gloo, this CPU) | α–β fit |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fitted = ""
        if r.busiest_bytes is not None:
            alpha, bandwidth = fits[r.p]
            fitted = f"{1e3 * (messages(r.op, r.p) * alpha + r.busiest_bytes / bandwidth):.3f} ms"
        counted = "—" if r.busiest_bytes is None else _size(r.busiest_bytes)
        model = "—" if r.model_bytes is None else _size(r.model_bytes) + (" ✓" if r.counted_matches_model else " ✗")
        error = "—" if r.op.startswith("torch.") else f"{r.max_error:.1e}"
        lines.append(f"| `{r.op}` | {r.p} | {_size(r.n * 4)} | {counted} | {model} | {error} | "
                     f"{1e3 * r.seconds:.3f} ms | {fitted} |")
    return "\n".join(lines)


def plot(rows: list[CollectiveRow], fits: dict[int, tuple[float, float]], path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = max(r.p for r in rows)
    alpha, bandwidth = fits[p]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for op, style in (("star_all_reduce", "s-"), ("tree_all_reduce", "^-"), ("ring_all_reduce", "o-"),
                      ("torch.all_reduce", "k--")):
        mine = [r for r in rows if r.op == op and r.p == p]
        ax.plot([r.n * 4 for r in mine], [1e3 * r.seconds for r in mine], style, label=op, ms=4)
    ring = [r for r in rows if r.op == "ring_all_reduce" and r.p == p]
    ax.plot([r.n * 4 for r in ring], [1e3 * (messages(r.op, p) * alpha + r.busiest_bytes / bandwidth) for r in ring],
            ":", color="gray", label=f"α–β fit: α={alpha * 1e6:.0f} µs, {bandwidth / 1e9:.2f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="tensor per rank (bytes)", ylabel="time (ms)",
           title=f"all-reduce on {p} gloo ranks of one CPU machine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fastest(rows: list[CollectiveRow]) -> dict[int, list[tuple[int, str]]]:
    """For each world size, the quickest of the ladder's all-reduces (and torch's) at each tensor size."""
    out: dict[int, list[tuple[int, str]]] = {}
    for p in sorted({r.p for r in rows}):
        for n in sorted({r.n for r in rows if r.p == p}):
            contenders = [r for r in rows if r.p == p and r.n == n and r.op in (*ALL_REDUCES, "torch.all_reduce")]
            out.setdefault(p, []).append((n, min(contenders, key=lambda r: r.seconds).op))
    return out


def _fits_text(fits: dict[int, tuple[float, float]]) -> str:
    return "; ".join(f"p = {p}: α = {a * 1e6:.0f} µs, bandwidth = {b / 1e9:.2f} GB/s" for p, (a, b) in fits.items())


def write(rows: list[CollectiveRow], fits: dict[int, tuple[float, float]], stamp: str, path: pathlib.Path,
          image: pathlib.Path | None = None) -> None:
    """Replace the part of ``path`` between the distributed markers (appended if it has none)."""
    matched = [r for r in rows if r.busiest_bytes is not None]
    generated = "\n".join([
        BEGIN,
        "## Collectives on a gloo world (chapter 11, generated by `make report`)",
        "",
        f"Machine: {stamp}. Ranks are processes of this one machine talking through gloo; the times are "
        "CPU times of loopback messages, not GPU or NVLink times.",
        "",
        "The all-reduce ladder (`kernel_ladder.distributed`): *star* (every rank through rank 0), a binomial "
        "*tree* (reduce, then broadcast), the *ring* (reduce-scatter, then all-gather), beside torch's "
        "gloo collective. *Busiest rank sent* is counted (`kernel_ladder.distributed.count_bytes`), *model* "
        "is the α–β model's formula for it (✓: equal); *time* is the median over repeats of the slowest "
        "rank; *α–β fit* is the time predicted by `messages·α + bytes/bandwidth` with α and bandwidth "
        "fitted to this run's ring all-reduce times at each world size: "
        f"**{_fits_text(fits)}** on this machine.",
        "",
        table(rows, fits),
        "",
        f"Counted bytes equal to the model: {sum(bool(r.counted_matches_model) for r in matched)} of {len(matched)}.",
        "",
        "Quickest all-reduce at each size, in this run: " + "; ".join(
            f"p = {p}: " + ", ".join(f"{_size(n * 4)} `{op}`" for n, op in sizes) for p, sizes in fastest(rows).items())
        + ". The bytes are the same on any machine; which algorithm wins is the α–β trade-off: "
        "the ring sends the fewest bytes but pays `2(p − 1)` latencies, the star and the tree pay 2 and "
        "`2⌈log₂ p⌉`. Here a latency is a CPU process being woken (more so with more ranks than cores), "
        "so it is large against the bandwidth; NCCL on GPUs picks a tree or a ring by the same trade-off.",
        "",
        *([f"![all-reduce ladder]({image.relative_to(path.parent).as_posix()})", ""] if image else []),
        END,
    ])
    write_between(path, BEGIN, END, generated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ch11_distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="*", default=list(WORLDS), help="world sizes")
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="fp32 elements per rank")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results.md")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    rows = []
    for p in _progress(args.worlds, "gloo worlds"):
        rows += collect(p, tuple(args.sizes), args.repeats)
    fits = {p: fit_alpha_beta(rows, p) for p in args.worlds}
    print(table(rows, fits))
    print(f"\nα–β fitted to the ring all-reduce: {_fits_text(fits)}")
    bad = [r for r in rows if r.counted_matches_model is False or r.max_error > 1e-3 * max(r.p, 1)]
    if not args.no_write:
        image = plot(rows, fits, args.out.parent / "img" / "ch11_collectives.png")
        write(rows, fits, machine(), args.out, image)
        print(f"wrote {args.out} and {image}")
    if bad:
        print("bench.ch11_distributed: rows off their model or torch's result: " + ", ".join(
            f"{r.op} p={r.p} n={r.n}" for r in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
