"""Progress lines for a notebook cell that takes a while, with the time it is expected to take.

A cell that runs for more than a few seconds says so before it starts, and how far it has got
while it runs, so that a learner does not wonder whether the kernel hangs::

    for size in progress(sizes, "tracing the ladder", expected="about 8 s on a 2-core laptop CPU"):
        ...

    announce("one torch.compile", expected="about 50 s on a cold cache, 5 s on a warm one")
    compiled = torch.compile(fn)(x)

The lines are deterministic — counts and the expected time as written, never a measured time —
so that nbval's comparison of a notebook's committed outputs stays stable.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

__all__ = ["announce", "progress"]

T = TypeVar("T")

#: At most this many progress lines for one loop (the steps are spread evenly over them).
MAX_LINES = 10
#: Width of the bar drawn in a progress line.
BAR_WIDTH = 20


def _bar(done: int, total: int) -> str:
    filled = BAR_WIDTH * done // total if total else BAR_WIDTH
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def _milestones(total: int) -> set[int]:
    """The steps (1-based) after which a line is printed: at most :data:`MAX_LINES`, always the last."""
    if total <= MAX_LINES:
        return set(range(1, total + 1))
    return {-(-total * k // MAX_LINES) for k in range(1, MAX_LINES + 1)}


def _print(text: str, stream: TextIO | None) -> None:
    print(text, file=stream or sys.stdout, flush=True)


class announce:  # noqa: N801  (used like a function; a context manager too)
    """Say that a single long call starts, and what time to expect: ``announce(label, expected)``.

    As a context manager it also says when the call is done::

        with announce("one torch.compile", expected="about 50 s on a cold cache"):
            compiled(x)
    """

    def __init__(self, label: str, expected: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.expected = expected
        self.stream = stream
        _print(f"⏳ {label} — expected: {expected} …", stream)

    def __enter__(self) -> announce:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        if kind is None:
            _print(f"✓ {self.label}: done", self.stream)


def progress(
    iterable: Iterable[T], label: str, expected: str, total: int | None = None, stream: TextIO | None = None
) -> Iterator[T]:
    """Yield the items of ``iterable``, printing where the loop is (at most :data:`MAX_LINES` lines).

    Args:
        iterable: the steps of the slow loop.
        label: what the loop does ("tracing each ladder step").
        expected: the time the whole loop is expected to take, in words
            ("about 30 s on a 2-core laptop CPU"): printed before the first step.
        total: the number of steps, if ``iterable`` has no ``len``; without either, one line per step.
        stream: where to print (standard output by default).
    """
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    count = f"{total} steps" if total is not None else "steps"
    _print(f"⏳ {label}: {count} — expected: {expected}", stream)
    marks = _milestones(total) if total is not None else None
    done = 0
    for item in iterable:
        yield item
        done += 1
        if marks is None:
            _print(f"   {label}: {done} done", stream)
        elif done in marks:
            _print(f"   {_bar(done, total)} {done}/{total} {label}", stream)  # type: ignore[arg-type]
    if total is not None and done != total:
        _print(f"   {label}: stopped after {done} of {total}", stream)
    else:
        _print(f"✓ {label}: done", stream)
