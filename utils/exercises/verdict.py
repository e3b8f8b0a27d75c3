"""What a check decides and how it is written: :class:`Verdict`, the tolerances, the text of its lines.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

SOLVED_MARK = "✅ SOLVED"
NOT_SOLVED_MARK = "❌ NOT SOLVED"

#: Printed verdict lines are wrapped to this width (a notebook's output column).
LINE_WIDTH = 100


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`check` decided. ``bool(verdict)`` is ``verdict.solved``; ``str`` is the printed block."""

    name: str
    solved: bool
    message: str
    #: A solved check's traffic (``check(..., traffic=...)``): a :class:`~utils.exercises.traffic.TrafficReport`.
    traffic: Any = None

    def __bool__(self) -> bool:
        return self.solved

    def __str__(self) -> str:
        return self.message

    def _ipython_display_(self) -> None:
        # check() has already printed the block; showing it again as the cell's value would
        # duplicate it (and nbval would compare it twice).
        return None


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing an output of ``dtype`` with a float64 reference rounded to it.

    float32 leaves a little room for TF32 dots and fp32 accumulation; fp16 and bf16 for their
    short mantissas. Integers and bools compare exactly.
    """
    if dtype == torch.float64:
        return 1e-7, 1e-9
    if dtype == torch.float32:
        return 1e-5, 1e-6
    if dtype == torch.float16:
        return 1e-3, 1e-3
    if dtype == torch.bfloat16:
        return 1e-2, 1e-2
    if dtype.is_floating_point:  # fp8 and friends
        return 1.25e-1, 1.25e-1
    return 0.0, 0.0


# Python floats returned by plain-function exercises (bytes per FLOP, times, ...).
_PYTHON_FLOAT_TOLERANCE = (1e-6, 1e-12)


def _fmt_number(value: float | int | bool) -> str:
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.6g}"


def _fmt_index(flat_index: int, shape: Sequence[int]) -> str:
    if len(shape) == 0:
        return "()"
    index = np.unravel_index(flat_index, tuple(shape))
    items = [str(int(i)) for i in index]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _wrapped(lines: Sequence[str]) -> list[str]:
    """Every line within :data:`LINE_WIDTH`, continuations indented under their first line's text."""
    result: list[str] = []
    for block in lines:
        for line in block.split("\n"):
            if len(line) <= LINE_WIDTH:
                result.append(line)
                continue
            text = line.lstrip(" ")
            indent = " " * (len(line) - len(text))
            hanging = indent + ("  " if text.startswith("• ") else "") + "  "
            result += textwrap.wrap(text, width=LINE_WIDTH, initial_indent=indent, subsequent_indent=hanging,
                                    break_long_words=False, break_on_hyphens=False)
    return result


def one_or_all_causes(causes: Sequence[str]) -> str | None:
    """A diagnosis's sentence from the causes that fit a failing case: the one cause, or every one
    (in order, without repeats) when the case cannot tell them apart; None when none fits."""
    unique = list(dict.fromkeys(causes))
    if len(unique) <= 1:
        return unique[0] if unique else None
    return "this case fits more than one common mistake — " + "; or ".join(unique)
