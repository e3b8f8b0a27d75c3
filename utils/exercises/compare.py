"""The reference's answer in float64, and what is wrong with the candidate's against it.

The reference runs in float64 where the inputs are floating point and its result is rounded to the
output's dtype, so a correct kernel matches within a tolerance set by its dtype
(:func:`~utils.exercises.verdict.default_tolerance`). The comparison reports unwritten elements
(still poisoned), NaN/inf where the reference is finite, the worst wrong value, and then where the
bad elements are (:mod:`utils.exercises.diagnosis`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .diagnosis import _layout_hints
from .guards import _POISON_BITS
from .running import _describe_error
from .verdict import _PYTHON_FLOAT_TOLERANCE, _fmt_index, _fmt_number, _plural, default_tolerance

# --------------------------------------------------------------------------------------------
# References in float64
# --------------------------------------------------------------------------------------------


def _floating_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.dtype.is_floating_point else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floating_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _floating_tensors(item)]
    return []


def _copy_args(value: Any, upcast: bool) -> Any:
    """A copy of the arguments for the reference (so neither side sees the other's writes)."""
    if isinstance(value, torch.Tensor):
        copy = value.detach()
        if upcast and copy.dtype.is_floating_point and copy.dtype != torch.float64:
            return copy.to(torch.float64)
        return copy.clone()
    if isinstance(value, tuple):
        return tuple(_copy_args(v, upcast) for v in value)
    if isinstance(value, list):
        return [_copy_args(v, upcast) for v in value]
    if isinstance(value, dict):
        return {k: _copy_args(v, upcast) for k, v in value.items()}
    return value


def _round_to(value: Any, dtype: torch.dtype) -> Any:
    """Cast float64 tensors of a float64 reference result back to the inputs' dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.float64 else value
    if isinstance(value, tuple):
        return tuple(_round_to(v, dtype) for v in value)
    if isinstance(value, list):
        return [_round_to(v, dtype) for v in value]
    return value


def _reference_result(reference: Callable[..., Any], case: tuple) -> Any:
    """The reference's answer: computed in float64 where inputs are float, rounded to their dtype."""
    floats = _floating_tensors(case)
    low_precision = [t.dtype for t in floats if t.dtype != torch.float64]
    if low_precision:
        try:
            result = reference(*_copy_args(case, upcast=True))
        except Exception:
            # Some references (e.g. a Triton op) do not take float64: use the inputs' dtype.
            return reference(*_copy_args(case, upcast=False))
        dtype = low_precision[0]
        for other in low_precision[1:]:
            dtype = torch.promote_types(dtype, other)
        return _round_to(result, dtype)
    return reference(*_copy_args(case, upcast=False))


# --------------------------------------------------------------------------------------------
# Comparing results
# --------------------------------------------------------------------------------------------


def _value_problems(
    got: torch.Tensor,
    expected: torch.Tensor,
    considered: torch.Tensor,
    shape: tuple[int, ...],
    rtol: float | None,
    atol: float | None,
    prefix: str,
) -> tuple[list[str], torch.Tensor]:
    """Wrong values and unexpected NaN/inf among the ``considered`` flat elements, and where they are."""
    total = expected.numel()
    problems: list[str] = []
    wrong = torch.zeros(total, dtype=torch.bool)
    if expected.dtype.is_floating_point:
        if callable(rtol):  # check(tolerance=...): chosen per case and per output dtype
            rtol, atol = rtol(expected.dtype)
        default_rtol, default_atol = default_tolerance(expected.dtype)
        rtol = default_rtol if rtol is None else rtol
        atol = default_atol if atol is None else atol
        g = got.to(torch.float64)
        e = expected.to(torch.float64)
        finite = torch.isfinite(e)
        bad_nonfinite = considered & finite & ~torch.isfinite(g)
        count = int(bad_nonfinite.sum())
        if count:
            first = int(bad_nonfinite.nonzero()[0, 0])
            problems.append(
                f"{prefix}NaN/inf where the reference is finite in {count} of {total} elements; "
                f"first at index {_fmt_index(first, shape)}: got {_fmt_number(float(g[first]))}, "
                f"expected {_fmt_number(float(e[first]))}"
            )
        # Non-finite references: NaN must meet NaN, inf the same inf.
        special = considered & ~finite
        bad_special = special & ~((torch.isnan(e) & torch.isnan(g)) | (e == g))
        both_finite = considered & finite & torch.isfinite(g)
        excess = torch.zeros_like(e)
        excess[both_finite] = ((g - e).abs() - (atol + rtol * e.abs()))[both_finite]
        bad = (both_finite & (excess > 0)) | bad_special
        wrong = bad | bad_nonfinite
        count = int(bad.sum())
        if count:
            if bool((both_finite & (excess > 0)).any()):
                worst = int(torch.where(both_finite, excess, torch.full_like(excess, -math.inf)).argmax())
            else:
                worst = int(bad.nonzero()[0, 0])
            problems.append(
                f"{prefix}wrong values in {count} of {total} elements; worst at index "
                f"{_fmt_index(worst, shape)}: got {_fmt_number(float(g[worst]))}, "
                f"expected {_fmt_number(float(e[worst]))} (rtol={rtol:g}, atol={atol:g})"
            )
    else:
        bad = considered & (got != expected)
        wrong = bad
        count = int(bad.sum())
        if count:
            if expected.dtype == torch.bool:
                worst = int(bad.nonzero()[0, 0])
                where = "first"
            else:
                diff = (got.to(torch.float64) - expected.to(torch.float64)).abs()
                worst = int(torch.where(bad, diff, torch.full_like(diff, -1.0)).argmax())
                where = "worst"
            problems.append(
                f"{prefix}wrong values in {count} of {total} elements; {where} at index "
                f"{_fmt_index(worst, shape)}: got {got[worst].item()}, expected {expected[worst].item()}"
            )
    return problems, wrong


def _where_unwritten(unwritten: torch.Tensor, shape: Sequence[int]) -> str:
    """Where the unwritten elements are, in words that point at the likely bug."""
    total, count = unwritten.numel(), int(unwritten.sum())
    if count == total:
        if total == 1:
            return " — the only element"
        return " — none at all: does the kernel store to the output?"
    indices = torch.nonzero(unwritten).reshape(-1)
    first, last = int(indices[0]), int(indices[-1])
    run = last - first + 1 == count
    # Where, not why: the cause is told from the tracer's store maps (_store_causes), when it has them.
    if run and last == total - 1:
        return f" — the last {_plural(count, 'element')} (from index {_fmt_index(first, shape)})"
    if run and first == 0:
        return f" — the first {_plural(count, 'element')}"
    return f"; first at index {_fmt_index(first, shape)}, last at {_fmt_index(last, shape)}"


def _tensor_problems(
    got: Any, expected: torch.Tensor, rtol: float | None, atol: float | None, poisoned: bool, where: str,
    stores: Callable[[torch.Tensor], Any] | None = None,
) -> list[str]:
    """Problems with ``got`` as an answer equal to ``expected`` (empty if it matches)."""
    prefix = f"{where}: " if where else ""
    if isinstance(got, np.ndarray):
        got = torch.from_numpy(got)
    if not isinstance(got, torch.Tensor):
        if got is None:
            return [f"{prefix}returned None, expected a tensor (is a `return` missing?)"]
        return [f"{prefix}returned {type(got).__name__}, expected a tensor"]
    if tuple(got.shape) != tuple(expected.shape):
        return [f"{prefix}wrong shape: got {tuple(got.shape)}, expected {tuple(expected.shape)}"]
    if got.dtype != expected.dtype:
        return [f"{prefix}wrong dtype: got {got.dtype}, expected {expected.dtype}"]
    total = expected.numel()
    if total == 0:
        return []
    shape = tuple(expected.shape)
    flat_got = got.detach().cpu().reshape(-1)
    flat_expected = expected.detach().cpu().reshape(-1)
    problems: list[str] = []
    considered = torch.ones(total, dtype=torch.bool)
    unwritten = torch.zeros(total, dtype=torch.bool)
    if poisoned and flat_got.dtype in _POISON_BITS:
        int_dtype, bits = _POISON_BITS[flat_got.dtype]
        unwritten = flat_got.view(int_dtype) == bits
        count = int(unwritten.sum())
        if count:
            problems.append(f"{prefix}{count} of {total} elements never written (still NaN)"
                            f"{_where_unwritten(unwritten, shape)}")
            considered &= ~unwritten
    elif poisoned and not flat_got.dtype.is_floating_point and flat_got.dtype != torch.bool:
        sentinel = torch.iinfo(flat_got.dtype).min
        unwritten = (flat_got == sentinel) & (flat_expected != sentinel)
        count = int(unwritten.sum())
        if count:
            problems.append(f"{prefix}{count} of {total} elements never written (still the poison {sentinel})"
                            f"{_where_unwritten(unwritten, shape)}")
            considered &= ~unwritten
    value_problems, wrong = _value_problems(flat_got, flat_expected, considered, shape, rtol, atol, prefix)
    problems += value_problems
    if problems:
        written_by = stores(got) if stores is not None else None
        problems += [prefix + hint for hint in _layout_hints(unwritten.numpy(), wrong.numpy(), shape, written_by)]
    return problems


def _value_mismatch(
    got: Any, expected: Any, rtol: float | None, atol: float | None, poisoned: bool, where: str = "",
    labels: Sequence[str] | None = None, stores: Callable[[torch.Tensor], Any] | None = None,
) -> list[str]:
    """Problems with ``got`` against ``expected`` for tensors, numbers, strings and containers.

    ``labels`` name the items of a tuple result (the output arguments' names), else they are ``[i]``.
    """
    prefix = f"{where}: " if where else ""
    if isinstance(expected, torch.Tensor):
        return _tensor_problems(got, expected, rtol, atol, poisoned, where, stores)
    if (type(expected) in (int, bool) and type(got) is not type(expected)
            and isinstance(got, (numbers.Number, np.generic, torch.Tensor))):
        return [prefix + _inexact(got, expected)]  # a number of another type: said so (None, a str: below)
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not isinstance(expected, (tuple, list, dict)):
        got = got.item()
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)):
            return [f"{prefix}returned {type(got).__name__}, expected a {type(expected).__name__}"]
        if len(got) != len(expected):
            return [f"{prefix}wrong length: got {len(got)} items, expected {len(expected)}"]
        problems: list[str] = []
        for i, (g, e) in enumerate(zip(got, expected)):
            item = labels[i] if labels is not None and i < len(labels) else f"{where}[{i}]"
            problems += _value_mismatch(g, e, rtol, atol, poisoned, item, stores=stores)
        return problems
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return [f"{prefix}returned {type(got).__name__}, expected a dict"]
        if set(got) != set(expected):
            return [f"{prefix}wrong keys: got {sorted(map(str, got))}, expected {sorted(map(str, expected))}"]
        problems = []
        for key in expected:
            problems += _value_mismatch(got[key], expected[key], rtol, atol, poisoned, f"{where}[{key!r}]",
                                        stores=stores)
        return problems
    if isinstance(expected, bool) or isinstance(expected, numbers.Integral):
        if isinstance(got, numbers.Number) and not isinstance(got, complex) and got == expected:
            return []
        return [f"{prefix}wrong value: got {got!r}, expected {expected!r}"]
    if isinstance(expected, numbers.Real):
        if isinstance(got, numbers.Real):
            if callable(rtol):
                rtol, atol = rtol(None)
            default_rtol, default_atol = _PYTHON_FLOAT_TOLERANCE
            r = default_rtol if rtol is None else rtol
            a = default_atol if atol is None else atol
            g, e = float(got), float(expected)
            if (math.isnan(g) and math.isnan(e)) or math.isclose(g, e, rel_tol=r, abs_tol=a):
                return []
            return [f"{prefix}wrong value: got {_fmt_number(g)}, expected {_fmt_number(e)}"]
        return [f"{prefix}wrong value: got {got!r}, expected {expected!r}"]
    if got != expected:
        return [f"{prefix}wrong value: got {got!r}, expected {expected!r}"]
    return []


def _inexact(got: Any, expected: int | bool) -> str:
    """Where the reference returns an exact Python int (or bool), the answer must be one: say what came."""
    kind = type(expected).__name__
    if isinstance(got, torch.Tensor):
        what = f"a tensor {tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}"
        value = got.item() if got.numel() == 1 else None
    else:
        what = f"{type(got).__module__ + '.' if type(got).__module__ not in ('builtins',) else ''}" \
               f"{type(got).__name__} {got!r}"
        value = got
    try:
        same = value is not None and value == expected
    except Exception:
        same = False
    text = f"expected an exact {kind}, got {what}"
    return text + ("; the value is right, the type is not" if same else f"; the exact answer is {expected!r}")


def _custom_problems(compare: Callable[[Any, Any], Any], got: Any, expected: Any) -> list[str]:
    try:
        answer = compare(got, expected)
    except Exception as error:
        return [f"comparison failed: {_describe_error(error)}"]
    if answer is None or answer is True:
        return []
    if answer is False:
        return ["does not match the reference"]
    return [str(answer)]
