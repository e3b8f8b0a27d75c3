"""The performance verdict beside correctness: a solved kernel's traced bytes against the ideal.

``check(..., traffic=Traffic(ideal=..., top=...))`` runs the last (largest) case under the tracer
(:mod:`utils.trace`) once every case matches, and adds one line to the SOLVED verdict::

    traffic: 1.92× the ideal bytes (24.6 kB moved, 12.8 kB ideal; the ladder's top moves 1.00×)
      — k read 4.00× its size, v 4.00×: K and V are re-read for every query head

Where the candidate runs torch code, the line names the aten ops that moved data, the heaviest first
(``— 6 torch ops moved 283 kB: aten.index.Tensor 99.8 kB, …``): what was measured, whatever the code.
An explanation that names a method (``explain_ops``) sees those ops, so it names one only when they show it.

The bytes are the ones the candidate's launches really move (masked-in lanes of every load and
store, and the aten ops it runs), counted in the interpreter: a judge no timer trick can fool and
that needs no GPU. It never changes the verdict: solved stays solved, the line is the honest price.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .rules import bytes_read

__all__ = ["Traffic", "TrafficReport"]

#: An input read up to this many times its size counts as read once (a tile's halo, a mask's row).
_READ_ONCE = 1.05
#: How many of the aten ops that moved data the line names.
_OPS_NAMED = 3


@dataclasses.dataclass(frozen=True)
class Traffic:
    """How to judge a solved candidate's traffic.

    Args:
        ideal: ``ideal(*case) -> bytes``, the least an op can move on that case (each input read
            once, each output written once: :func:`utils.trace.ideal_bytes`).
        top: ``top(*case) -> bytes``, what the ladder's top (the chapter's best kernel) moves, or None.
        explain: ``explain(reread) -> cause or None`` from each input's read factor (bytes read /
            its size, by argument name): names why the bytes are what they are ("K and V are re-read
            for every query head"), printed after the factors.
        explain_ops: ``explain_ops(case, reread, ops) -> cause or None``, used instead of ``explain``
            where the cause depends on the code: ``ops`` are the aten ops the candidate ran that moved
            data (:class:`utils.trace.TorchOp`: ``name``, ``bytes_read``, ``bytes_written``), in order.
    """

    ideal: Callable[..., int]
    top: Callable[..., int] | None = None
    explain: Callable[[dict[str, float]], str | None] | None = None
    explain_ops: Callable[[tuple, dict[str, float], Sequence[Any]], str | None] | None = None


@dataclasses.dataclass(frozen=True)
class TrafficReport:
    """What the tracer saw of a solved candidate's last case, and the line it prints."""

    moved: int  # bytes: Triton launches plus aten ops
    ideal: int
    top: int | None
    reread: dict[str, float]  # input argument name -> bytes read / its size (Triton launches)
    cause: str | None = None
    measured: bool = True  # False where kernels are compiled (the tracer sees interpreted ones only)
    #: The aten ops that moved data, by name: (name, bytes), the heaviest first.
    ops: tuple[tuple[str, int], ...] = ()
    op_calls: int = 0  # how many calls of those ops

    @property
    def ratio(self) -> float:
        """Bytes moved over the ideal bytes."""
        return self.moved / self.ideal if self.ideal else float("inf")

    def line(self) -> str:
        """The verdict's traffic line (unwrapped)."""
        from utils.trace import format_bytes

        if not self.measured:
            return ("traffic: not measured — the tracer counts the bytes of interpreted kernels only "
                    "(run the check on the CPU, or with TRITON_INTERPRET=1)")
        top = "" if self.top is None or not self.ideal else f"; the ladder's top moves {self.top / self.ideal:.2f}×"
        text = (f"traffic: {self.ratio:.2f}× the ideal bytes ({format_bytes(self.moved)} moved, "
                f"{format_bytes(self.ideal)} ideal{top})")
        reread = sorted(((name, factor) for name, factor in self.reread.items() if factor > _READ_ONCE),
                        key=lambda item: -item[1])
        if reread:
            first, *rest = reread
            text += f" — {first[0]} read {first[1]:.2f}× its size"
            text += "".join(f", {name} {factor:.2f}×" for name, factor in rest[:3])
        elif self.ideal and self.ratio <= _READ_ONCE:
            text += " — every input read once, every output written once"
        if self.ops:
            heaviest = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in self.ops[:_OPS_NAMED])
            more = ", …" if len(self.ops) > _OPS_NAMED else ""
            text += (f" — {self.op_calls} torch op{'s' if self.op_calls != 1 else ''} moved "
                     f"{format_bytes(sum(nbytes for _, nbytes in self.ops))}: {heaviest}{more}")
        if self.cause:
            text += f": {self.cause}"
        return text


def measure(
    spec: Traffic,
    case: tuple,
    inputs: Sequence[tuple[str, torch.Tensor]],
    launches: Sequence[Any],
    torch_ops: Sequence[Any],
    interpreted: bool,
) -> TrafficReport:
    """The report for one traced run of ``case``: ``inputs`` are the (name, tensor) the candidate got."""
    from utils.trace import tensor_bytes

    ideal = int(spec.ideal(*case))
    if not interpreted:
        return TrafficReport(moved=0, ideal=ideal, top=None, reread={}, measured=False)
    top = None if spec.top is None else int(spec.top(*case))
    moved = sum(int(launch.bytes) for launch in launches) + sum(int(op.bytes) for op in torch_ops)
    reread: dict[str, float] = {}
    for name, tensor in inputs:
        size = tensor_bytes(tensor)
        if not size or not launches:
            continue
        read = bytes_read(launches, tensor)
        reread[name] = read / size
    moving = [op for op in torch_ops if int(op.bytes) > 0]
    by_name: dict[str, int] = {}
    for op in moving:
        by_name[op.name] = by_name.get(op.name, 0) + int(op.bytes)
    ops = tuple(sorted(by_name.items(), key=lambda item: -item[1]))
    if spec.explain_ops is not None:
        cause = spec.explain_ops(case, dict(reread), tuple(moving))
    else:
        cause = spec.explain(dict(reread)) if spec.explain is not None else None
    return TrafficReport(moved=moved, ideal=ideal, top=top, reread=reread, cause=cause, ops=ops,
                         op_calls=len(moving))
