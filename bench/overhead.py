"""``python -m bench.overhead`` (part of ``make report``): the host time of every public op per call.

For each op of :func:`utils.op_cases.op_cases` (one tiny call each) it measures, with every Triton
launch replaced by a no-op (:func:`utils.overhead.host_overhead`), the Python time of a forward
call and of a forward + backward step, the launches each makes, torch's own eager op on the same
input for scale, and the floor: a ``torch.library`` custom op that only allocates its output
(:func:`utils.overhead.dispatch_floor`), below which no custom op can go.

Value checks are off while it measures (``kernel_ladder.runtime.check_values(False)``), as they are by
default on CUDA: what is timed is the launch path a GPU run takes. The elementwise and row ops
(:data:`utils.op_cases.ELEMENTWISE`, :data:`utils.op_cases.ROWS`) are read against a goal of
20 us per forward call (the goal chapter 10 sets for the package's launch path on a laptop CPU);
the goal is reported, never asserted (times depend on the machine and its load).

Where the optional C++ extension can be built (:func:`kernel_ladder.native.available`), two more rows
show what the C++ dispatcher path saves, on the ``rms_norm`` row's own input (8 x 64 float32):
``rms_norm[native]`` is ``kernel_ladder.native.rms_norm`` (checks, dispatch, autograd and kernel all C++),
``rms_norm[native kernel, Python custom_op]`` the same C++ kernels behind a Python
``torch.library.custom_op`` with ``register_fake``/``register_autograd`` (:func:`native_custom_op`), the
way a Triton op is wired. Both run their kernel (no Triton launch to swallow), which at this size is a
fraction of a microsecond; the ``rms_norm`` row is the Triton op with its launch swallowed.

Writes a markdown table between the overhead markers of ``docs/results.md`` and a bar chart
``docs/img/overhead.png``; ``--no-write`` prints the table only.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernel_ladder
from bench.report import ROOT, _progress, machine, write_between
from utils.op_cases import ELEMENTWISE, ROWS, Built, OpCase, op_cases
from utils.overhead import Overhead, dispatch_floor, eager_time, floor_op, host_overhead, python_calls

BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"
GOAL_US = 20.0


@dataclass(frozen=True)
class OverheadRow:
    """One op's host cost per call (microseconds, the fastest of the timed rounds)."""

    op: str
    family: str  # "elementwise", "rows" or "" (no goal)
    launches: float  # Triton launches per forward call
    forward_us: float
    backward_us: float | None  # forward + backward step; None for an op without a gradient
    torch_us: float | None  # torch's own eager op on the same input; None where torch has none
    backward_launches: float | None = None
    calls: float | None = None  # Python function calls per forward call (a count: machine-independent)
    floor_us: float | None = None  # the dispatch floor, measured in rounds taken in turn with this op's

    @property
    def of_floor(self) -> float | None:
        """The forward's host time as a multiple of the floor measured beside it (drift cancels)."""
        return self.forward_us / self.floor_us if self.floor_us else None

    @property
    def meets_goal(self) -> bool | None:
        """Forward at most :data:`GOAL_US` (None for an op the goal is not set for)."""
        return self.forward_us <= GOAL_US if self.family else None


def family(name: str) -> str:
    base = name.split("[", 1)[0]
    if base in ELEMENTWISE:
        return "elementwise"
    if base in ROWS:
        return "rows"
    return ""


def measure(case: OpCase, number: int, repeat: int, warmup: int) -> OverheadRow:
    """Measure one op (value checks must already be off)."""
    built = case.build()
    counts = {"number": number, "repeat": repeat, "warmup": warmup}
    # The forward and the floor take turns, one round each, so that a slow spell of the machine
    # hits both: their ratio is what the table trusts most.
    launches = host_overhead(built.forward, number=1, repeat=1, warmup=warmup).launches_per_call
    forward_rounds, floor_rounds = [], []
    for _ in range(repeat):
        floor_rounds.append(dispatch_floor(number=number, repeat=1).min_us)
        forward_rounds.append(host_overhead(built.forward, number=number, repeat=1, warmup=0).min_us)
    backward: Overhead | None = host_overhead(built.backward, **counts) if built.backward else None
    torch_op = eager_time(built.eager, **counts) if built.eager else None
    # The case's forward is a closure around the op call: the closure's own call is not the op's.
    calls = python_calls(built.forward, number=max(1, min(number, 20)), warmup=min(warmup, 3)) - 1
    return OverheadRow(
        op=case.name, family=family(case.name), launches=launches,
        forward_us=min(forward_rounds), backward_us=backward.min_us if backward else None,
        torch_us=torch_op.min_us if torch_op else None, floor_us=min(floor_rounds),
        backward_launches=backward.launches_per_call if backward else None, calls=calls,
    )


def floor_python_calls() -> float:
    """Python calls per call of the dispatch floor's custom op (torch's custom-op machinery alone)."""
    return python_calls(floor_op(), torch.zeros(8))


_NATIVE_CUSTOM_OP = None


def native_custom_op():
    """RMSNorm through the extension's C++ kernels (``torch.ops.kernel_ladder_native.rms_norm_forward`` and
    ``rms_norm_backward``) wired from Python: a ``torch.library.custom_op`` with a fake and an autograd
    formula, as the Triton ops are. Returns ``rms_norm(x, weight, eps=1e-6) -> y``; built once."""
    global _NATIVE_CUSTOM_OP
    if _NATIVE_CUSTOM_OP is None:
        from kernel_ladder import native

        native.load()
        ops = torch.ops.kernel_ladder_native

        @torch.library.custom_op("kernel_ladder_overhead::native_rms_norm", mutates_args=())
        def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            return ops.rms_norm_forward(x, weight, eps)

        @forward.register_fake
        def _(x, weight, eps):
            stats = torch.float64 if x.dtype == torch.float64 else torch.float32
            return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=stats)

        def setup_context(ctx, inputs, output):
            x, weight, _ = inputs
            ctx.save_for_backward(x, weight, output[1])
            ctx.mark_non_differentiable(output[1])

        def backward(ctx, grad_y, _grad_rstd):
            x, weight, rstd = ctx.saved_tensors
            grad_x, grad_weight = ops.rms_norm_backward(grad_y, x, weight, rstd)
            return grad_x, grad_weight, None

        forward.register_autograd(backward, setup_context=setup_context)

        def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            return forward(x, weight, eps)[0]

        _NATIVE_CUSTOM_OP = rms_norm
    return _NATIVE_CUSTOM_OP


def _native_rms_norm_case(name: str, op_of: Callable[[], Callable]) -> OpCase:
    """A row on the ``rms_norm`` case's own input (8 x 64 and a weight of 64, drawn from the case's seed in
    the same order), the op taken from ``op_of()`` when built."""
    def make(device, gen):
        op = op_of()
        x, w = torch.randn(8, 64, generator=gen).to(device), torch.randn(64, generator=gen).to(device)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def step():
            y = op(xg, wg, 1e-6)
            y.backward(torch.ones_like(y))

        return Built(lambda: op(x, w, 1e-6), step, lambda: torch.nn.functional.rms_norm(x, (64,), w, 1e-6))

    return OpCase(name, (), (), make)


def native_cases() -> list[OpCase]:
    """The rows of the C++ extension's ``rms_norm`` (the module docstring); none where it cannot be built."""
    from kernel_ladder import native

    if not native.available():
        return []
    return [
        _native_rms_norm_case("rms_norm[native]", lambda: native.rms_norm),
        _native_rms_norm_case("rms_norm[native kernel, Python custom_op]", native_custom_op),
    ]


def run(names: list[str] | None = None, number: int = 200, repeat: int = 7, warmup: int = 20
        ) -> tuple[list[OverheadRow], Overhead]:
    """Every op's row (or only ``names``) and the dispatch floor, value checks off meanwhile.

    The native rows (:func:`native_cases`) come after the ``rms_norm`` row where the extension can be built.
    """
    cases = op_cases()
    natives = native_cases() if names is None or any("[native" in n for n in names) else []
    at = next(i for i, c in enumerate(cases) if c.name == "rms_norm") + 1
    cases[at:at] = natives
    if names:
        known = {c.name for c in cases}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"bench.overhead: no op case named {unknown}; known: {sorted(known)}")
        cases = [c for c in cases if c.name in names]
    before = kernel_ladder.runtime.values_checked()
    kernel_ladder.runtime.check_values(False)
    try:
        floor = dispatch_floor(number=number, repeat=repeat)
        rows = [measure(case, number, repeat, warmup) for case in _progress(cases, "host overhead")]
    finally:
        kernel_ladder.runtime.check_values(before)
    return rows, floor


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def table(rows: list[OverheadRow], floor: Overhead) -> str:
    """The markdown table, one line per op, the floor first."""
    floor_calls = floor_python_calls()
    lines = [
        "| op | launches (fwd / fwd+bwd) | Python calls, forward | host µs, forward | × floor | host µs, forward + "
        "backward | torch eager µs | goal ≤ 20 µs |",
        "|---|---|---|---|---|---|---|---|",
        f"| *custom-op floor* (`utils.overhead.dispatch_floor`) | 0 | {floor_calls:g} | {floor.min_us:.1f} | 1 | — | — "
        "| |",
    ]
    for r in rows:
        goal = "" if r.meets_goal is None else ("met" if r.meets_goal else "not met")
        bwd_launches = "" if r.backward_launches is None else f" / {r.backward_launches:g}"
        calls = "—" if r.calls is None else f"{r.calls:.0f}"
        ratio = "—" if r.of_floor is None else f"{r.of_floor:.1f}"
        lines.append(f"| {r.op} | {r.launches:g}{bwd_launches} | {calls} | {r.forward_us:.1f} | {ratio} | "
                     f"{_us(r.backward_us)} | {_us(r.torch_us)} | {goal} |")
    return "\n".join(lines)


def plot(rows: list[OverheadRow], floor: Overhead, path: pathlib.Path) -> pathlib.Path:
    """Horizontal bars of the forward host time per op, with the floor and the goal as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.plots import overhead_bars

    path.parent.mkdir(parents=True, exist_ok=True)
    ax = overhead_bars([(r.op, r.forward_us, r.torch_us) for r in rows], floor=floor.min_us, goal=GOAL_US)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=110)
    plt.close(ax.figure)
    return path


def write(rows: list[OverheadRow], floor: Overhead, stamp: str, path: pathlib.Path,
          image: pathlib.Path | None = None) -> None:
    """Replace the part of ``path`` between the overhead markers (appended if it has none)."""
    met = [r for r in rows if r.meets_goal]
    goal_rows = [r for r in rows if r.meets_goal is not None]
    generated = "\n".join([
        BEGIN,
        "## Host overhead per call (generated by `make report`)",
        "",
        f"Machine: {stamp}.",
        "",
        "The Python time an op spends per call outside its kernels: every Triton launch is replaced by a",
        "no-op (`utils.overhead.host_overhead`), so what is timed is argument checks, torch's custom-op",
        "dispatch, autograd bookkeeping, allocation and the launch plan — what a GPU run pays on the host",
        "before each kernel is queued. Value checks are off (`kernel_ladder.runtime.check_values(False)`, the",
        "CUDA default). Each time is the fastest of several rounds of tiny calls (`utils.op_cases`): on a",
        "shared machine a disturbed round is slower, never faster. *torch eager* is torch's own op on the",
        "same input, for scale (its dispatch is C++). The floor is a `torch.library` custom op that only",
        "allocates its output: no custom op is cheaper. It is measured again with each op, a round of",
        "each in turn, and *× floor* divides by that, which cancels the machine's drift over the run.",
        "*Python calls* is a count (`utils.overhead.python_calls`), the same on any machine and under any",
        "load. These are CPU times on the machine above, not GPU times. Where the optional C++ extension",
        "builds, `rms_norm[native]` is `kernel_ladder.native.rms_norm` (checks, dispatch, autograd and kernel",
        "in C++) and `rms_norm[native kernel, Python custom_op]` the same C++ kernels behind a Python",
        "`torch.library.custom_op`, on the `rms_norm` row's input; both run their (tiny) kernel.",
        "",
        table(rows, floor),
        "",
        f"Elementwise and row ops within the 20 µs goal chapter 10 sets for the launch path: {len(met)} of "
        f"{len(goal_rows)}.",
        "",
        *([f"![host overhead per op]({image.relative_to(path.parent).as_posix()})", ""] if image else []),
        END,
    ])
    write_between(path, BEGIN, END, generated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="*", help="only these op cases (names as in utils.op_cases)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results.md")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--number", type=int, default=200, help="calls per timed repeat")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (the fastest is reported)")
    args = parser.parse_args(argv)

    stamp = machine()
    print(f"overhead: {stamp}", file=sys.stderr)
    rows, floor = run(args.ops, number=args.number, repeat=args.repeat)
    markdown = table(rows, floor)
    print(markdown)
    if not args.no_write:
        image = None if args.ops else plot(rows, floor, args.out.parent / "img" / "overhead.png")
        write(rows, floor, stamp, args.out, image)
        print(f"overhead: wrote {args.out}" + (f" and {image}" if image else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
