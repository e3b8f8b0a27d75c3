"""``make report``: run every registered ladder step, check it, count it, model it, time it on a GPU.

Writes a table to stdout, the generated part of ``docs/results.md`` (between the report markers,
so hand-recorded GPU sections around it survive), and one bytes-per-step plot per chapter under
``docs/img/``. Every row is stamped with the machine it ran on.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pathlib
import platform
import sys
from dataclasses import dataclass

import torch

import kernel_ladder
from bench import Figure, Ladder, Step, figures, ladders
from utils.exercises import default_tolerance
from utils.results import write_between
from utils.roofline import dtype_key, predict
from utils.trace import format_bytes, trace

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- summary:begin -->", "<!-- summary:end -->"
MODEL_GPU = "H200"


@dataclass
class Row:
    chapter: str
    op: str
    step: str
    correct: str
    max_error: float
    launches: int
    bytes: int
    ideal_bytes: int
    flops: int
    model_us: float
    bound: str
    gpu_ms: float | None = None
    speedup: float | None = None
    max_ratio: float | None = None  # the step's bound on bytes / ideal
    note: str = ""  # the ladder's sizes and caveats
    baseline: bool = False  # the torch step speedups refer to

    @property
    def over_bound(self) -> bool:
        """Moves more than its step's bound allows (a production forward kernel over 1.05x ideal)."""
        return self.max_ratio is not None and self.bytes_ratio > self.max_ratio

    @property
    def bytes_ratio(self) -> float:
        return self.bytes / self.ideal_bytes if self.ideal_bytes else math.nan


def machine() -> str:
    """The machine, versions and date, for the stamp on every result."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    compiled = torch.cuda.is_available() and not kernel_ladder.runtime.INTERPRETER
    gpu = torch.cuda.get_device_name() if compiled else "none"
    import triton

    return (
        f"date {datetime.date.today().isoformat()}; CPU: {cpu} ({os.cpu_count()} cores); GPU: {gpu}; "
        f"mode: {kernel_ladder.runtime.mode()}; python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )


def _progress(items, desc: str):
    try:
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, leave=False, disable=not sys.stderr.isatty())
    except ImportError:  # the GPU machine may not have tqdm
        return items


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _check(ladder: Ladder, step: Step, inputs: tuple, output) -> tuple[str, float]:
    """Compare a step's output (a tensor, or a tuple of them) with the float64 reference."""
    if step.name in ladder.tags.get("unchecked_steps", []):
        return "n/a", math.nan
    outputs, expected_all = _as_tuple(output), _as_tuple(ladder.reference(*inputs))
    if len(outputs) != len(expected_all):
        return "WRONG SHAPE", math.inf
    worst, ok = 0.0, True
    for out, expected in zip(outputs, expected_all):
        out, expected = torch.as_tensor(out), torch.as_tensor(expected)
        if out.shape != expected.shape:
            return "WRONG SHAPE", math.inf
        err = (out.double() - expected.double()).abs()
        rtol, atol = default_tolerance(out.dtype)
        ok = ok and bool((err <= atol + rtol * expected.double().abs()).all()) and not torch.isnan(out).any()
        worst = max(worst, float(err.max()) if err.numel() else 0.0)
    return ("ok" if ok else "WRONG"), worst


def run_ladder(ladder: Ladder, gpu: bool) -> list[Row]:
    device = kernel_ladder.runtime.DEVICE
    inputs = ladder.make_inputs(device, ladder.dtype, "cpu")
    rows = []
    for step in _progress([s for s in ladder.steps if s.on_cpu], desc=ladder.op):
        with trace() as t:
            output = step.fn(*inputs)
        correct, max_error = _check(ladder, step, inputs, output)
        model = predict(t.bytes, t.flops, gpu=MODEL_GPU, dtype=dtype_key(ladder.dtype))
        rows.append(
            Row(ladder.chapter, ladder.op, step.name, correct, max_error, t.num_launches, t.bytes,
                ladder.ideal(inputs, output), t.flops, model.time_s * 1e6, model.bound, max_ratio=step.bound,
                note=ladder.note, baseline=step.baseline)
        )
        if rows[-1].over_bound and correct == "ok":
            rows[-1].correct = f"OVER {step.bound:g}× IDEAL"
    if gpu:
        _time_on_gpu(ladder, rows)
    return rows


def _time_on_gpu(ladder: Ladder, rows: list[Row]) -> None:
    from utils.bench import measure

    inputs = ladder.make_inputs(torch.device("cuda"), ladder.dtype, "gpu")
    by_name = {row.step: row for row in rows}
    times = {}
    for step in ladder.steps:
        if step.on_gpu:
            times[step.name] = measure(step.fn, *inputs).median_ms
    base = next((times[s.name] for s in ladder.steps if s.baseline and s.name in times), None)
    for name, ms in times.items():
        if name in by_name:
            by_name[name].gpu_ms = ms
            by_name[name].speedup = base / ms if base else None


def table(rows: list[Row], markdown: bool) -> str:
    gpu = any(r.gpu_ms is not None for r in rows)
    head = ["chapter", "op", "step", "check", "launches", "bytes", "bytes / ideal", "FLOPs",
            f"{MODEL_GPU} model (µs)"]
    if gpu:
        head += ["GPU time (ms)", "speedup vs torch"]
    body = []
    for r in rows:
        cells = [r.chapter, r.op, r.step, r.correct, f"{r.launches:,}", format_bytes(r.bytes),
                 f"{r.bytes_ratio:.2f}×", f"{r.flops:,}", f"{r.model_us:.2f} ({r.bound})"]
        if gpu:
            cells += ["—" if r.gpu_ms is None else f"{r.gpu_ms:.3f}",
                      "—" if r.speedup is None else f"{r.speedup:.2f}×"]
        body.append(cells)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c) + " |" for c in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*c) for c in body])


def plot(rows: list[Row], directory: pathlib.Path) -> list[pathlib.Path]:
    """One bytes-per-step chart per chapter (a bar per step, the ideal as a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.plots import bytes_bars

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for chapter in sorted({r.chapter for r in rows}):
        ops = [op for op in dict.fromkeys(r.op for r in rows if r.chapter == chapter)]
        fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 3.8), squeeze=False)
        for ax, op in zip(axes[0], ops):
            steps = [r for r in rows if r.chapter == chapter and r.op == op]
            bytes_bars([(r.step, r.bytes) for r in steps], ideal=steps[0].ideal_bytes, ax=ax, title=op)
        fig.tight_layout()
        path = directory / f"ch{chapter}_bytes.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def draw_figures(chosen: list[Figure], directory: pathlib.Path) -> list[tuple[pathlib.Path, str]]:
    """Each registered figure as ``ch<chapter>_<name>.png``, with the caption its ``draw`` returned."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    drawn = []
    for figure in chosen:
        print(f"report: {figure.chapter} / figure {figure.name} ...", file=sys.stderr, flush=True)
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        caption = figure.draw(ax)
        fig.tight_layout()
        path = directory / f"ch{figure.chapter}_{figure.name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        drawn.append((path, caption))
    return drawn


def write_results(rows: list[Row], stamp: str, images: list[pathlib.Path], path: pathlib.Path,
                  captioned: list[tuple[pathlib.Path, str]] = ()) -> None:
    notes = list(dict.fromkeys(f"* **{r.chapter} / {r.op}**: {r.note}" for r in rows if r.note))
    images_md = "\n".join(f"![bytes per step]({img.relative_to(path.parent).as_posix()})" for img in images)
    for img, caption in captioned:
        images_md += f"\n\n![{img.stem}]({img.relative_to(path.parent).as_posix()})\n\n{caption}"
    generated = "\n".join([
        BEGIN,
        "## Ladder report (generated by `make report`)",
        "",
        f"Machine: {stamp}.",
        "",
        "Bytes and launches are counted exactly by `utils.trace` (Triton loads and stores in the interpreter,",
        "bytes of every aten op's inputs and outputs for torch); *ideal* is every input read once and the",
        f"output written once. The {MODEL_GPU} column is a roofline **model** (max of bytes / bandwidth and",
        "FLOPs / peak, datasheet numbers), not a measurement; it leaves out launch latency, which dominates",
        "at these small sizes (see the launches column). GPU times appear only when the report runs on a GPU.",
        "",
        table(rows, markdown=True),
        "",
        "Sizes and caveats of each ladder:",
        "",
        *notes,
        "",
        "*check* compares each step's output with a float64 reference; `n/a` marks a step whose output is",
        "random in a way the reference cannot know (torch's dropout draws its own mask), kept as a bytes baseline,",
        "or a torch CPU step whose own rounding is outside the dtype's tolerance. The production forward kernels",
        "are also held to at most 1.05× the ideal bytes, or the bound their ladder's note gives (`OVER` would",
        "mark one that moves more).",
        "",
        images_md,
        END,
    ])
    write_between(path, BEGIN, END, generated)


def summary_table(rows: list[Row]) -> str:
    """One line per ladder: its step with the most traffic, its torch baseline and its top (last) step."""
    lines = ["| chapter | op | most traffic: launches, bytes / ideal | torch baseline | top of the ladder |",
             "|---|---|---|---|---|"]
    for chapter, op in dict.fromkeys((r.chapter, r.op) for r in rows):
        steps = [r for r in rows if (r.chapter, r.op) == (chapter, op)]
        baseline = next((r for r in steps if r.baseline), None)

        def cell(r: Row | None, named: bool = True) -> str:
            if r is None:
                return "—"
            name = f"{r.step}: " if named else ""
            return f"{name}{r.launches:,} launch{'es' if r.launches != 1 else ''}, {r.bytes_ratio:.2f}×"

        worst = max(steps, key=lambda r: r.bytes_ratio)
        lines.append(f"| {chapter} | {op} | {cell(worst)} | {cell(baseline)} | {cell(steps[-1])} |")
    return "\n".join(lines)


def write_summary(rows: list[Row], stamp: str, path: pathlib.Path) -> bool:
    """Replace the README's summary (between its markers) with this run's; False if it has none."""
    if not path.exists():
        return False
    old = path.read_text()
    if SUMMARY_BEGIN not in old or SUMMARY_END not in old:
        return False
    generated = "\n".join([SUMMARY_BEGIN, f"Machine: {stamp}.", "", summary_table(rows), SUMMARY_END])
    path.write_text(old[: old.index(SUMMARY_BEGIN)] + generated + old[old.index(SUMMARY_END) + len(SUMMARY_END):])
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--chapters", nargs="*", help="only these chapters (e.g. 00 01)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results.md")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md",
                        help="whose summary table to refresh (between its summary markers)")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not kernel_ladder.runtime.INTERPRETER
    stamp = machine()
    print(f"report: {stamp}", file=sys.stderr)
    if not gpu:
        print("report: no GPU — bytes are counted exactly; times are modelled, not measured.", file=sys.stderr)
    rows: list[Row] = []
    for ladder in ladders(args.chapters):
        print(f"report: {ladder.chapter} / {ladder.op} ...", file=sys.stderr, flush=True)
        rows += run_ladder(ladder, gpu)
    print(table(rows, markdown=False))
    if not args.no_write:
        images = plot(rows, args.out.parent / "img")
        captioned = draw_figures(figures(args.chapters), args.out.parent / "img")
        write_results(rows, stamp, images, args.out, captioned)
        images += [img for img, _ in captioned]
        print(f"report: wrote {args.out} and {len(images)} plot(s)", file=sys.stderr)
        if not args.chapters and write_summary(rows, stamp, args.readme):
            print(f"report: refreshed the summary in {args.readme}", file=sys.stderr)
    failed = [r for r in rows if r.correct.startswith(("WRONG", "OVER"))]
    for r in failed:
        print(f"report: {r.chapter} / {r.op} / {r.step}: {r.correct} (max error {r.max_error:.3g})", file=sys.stderr)
    return 1 if failed else 0
