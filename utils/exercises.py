"""Exercises that check themselves: the stub marker, solution mode, and the checker.

A notebook marks each exercise stub with :func:`exercise`, linking it to its solution in
``solutions/``::

    @exercise("ch00_gpu_model.add_kernel")     # "<module in solutions>.<attribute>"
    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        # YOUR CODE HERE
        pass

In learner mode the stub is returned unchanged; in solution mode (``KERNEL_LADDER_SOLUTIONS=1``,
what CI sets) the decorator returns ``solutions.ch00_gpu_model.add_kernel`` instead, so the
notebook runs top to bottom with correct answers.

A later cell calls :func:`check`, which runs the learner's code on fresh random inputs against a
reference and prints one verdict block. It never raises for a wrong answer: a stub, an exception
inside the kernel, a wrong shape, NaNs, unwritten outputs and out-of-bounds accesses all become a
``❌ NOT SOLVED`` verdict with a diagnosis, so an unsolved notebook still runs to the end.

How the checker sees what went wrong:

* outputs (``out=True``) start *poisoned* — NaN with a recognisable bit pattern for floats, the
  most negative value for integers — so elements the kernel never wrote are told apart from
  elements it wrote wrongly;
* every tensor the candidate gets lives between two *guard regions* of spare memory. An output's
  guards hold a canary byte pattern (a write there is reported), an input's guards hold NaN (a
  read there spoils the result visibly). On the CPU each tensor has its own storage that ends
  exactly where its data ends, so the tracer (:mod:`utils.trace`) also counts every access
  outside every tensor argument, and a missing mask lands in the guard instead of in someone
  else's memory;
* the reference runs in float64 where the inputs are floating point, and the result is rounded
  to the output's dtype, so a correct kernel matches within a tolerance set by its dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
import numbers
import os
import secrets
import traceback
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

import kernels  # noqa: F401  (fixes interpreter vs compiled mode before any solution kernel is defined)

__all__ = [
    "CHECK_SEED_ENV",
    "SOLUTIONS_ENV",
    "MissingSolutionError",
    "Verdict",
    "check",
    "default_tolerance",
    "exercise",
    "solution",
    "solution_mode",
]

#: Environment variable that switches exercise stubs to their solutions.
SOLUTIONS_ENV = "KERNEL_LADDER_SOLUTIONS"
#: When set, :func:`check` draws random cases from a seed derived from its value and the check's
#: name instead of a fresh one, so that a NOT SOLVED verdict (which describes its inputs) is the
#: same on every run: learner-mode notebook runs set it (``utils.notebooks``), learners do not.
CHECK_SEED_ENV = "KERNEL_LADDER_CHECK_SEED"

SOLVED_MARK = "✅ SOLVED"
NOT_SOLVED_MARK = "❌ NOT SOLVED"

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Solution mode and the exercise marker
# --------------------------------------------------------------------------------------------


class MissingSolutionError(LookupError):
    """Solution mode asked for a solution that ``solutions/`` does not have."""


def solution_mode() -> bool:
    """True when ``KERNEL_LADDER_SOLUTIONS`` is set to 1/true/yes/on (read now, at each call)."""
    return os.environ.get(SOLUTIONS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _split_name(name: str) -> tuple[str, str]:
    module, _, attribute = name.rpartition(".")
    if not module or not attribute:
        raise ValueError(
            f"exercise name {name!r} must look like '<module in solutions>.<attribute>', "
            "e.g. 'ch00_gpu_model.add_kernel'"
        )
    return module, attribute


def solution(name: str) -> Any:
    """The solution object ``solutions.<module>.<attribute>`` named by ``name``.

    Raises :class:`MissingSolutionError` with a message naming the missing file or attribute.
    """
    module_name, attribute = _split_name(name)
    full_module = f"solutions.{module_name}"
    try:
        module = importlib.import_module(full_module)
    except ModuleNotFoundError as error:
        # Only a missing solutions module is "missing"; a failing import inside it is a bug to show.
        if error.name not in (full_module, "solutions"):
            raise
        raise MissingSolutionError(
            f"exercise {name!r}: solution mode ({SOLUTIONS_ENV}=1) needs solutions/{module_name}.py, "
            "which does not exist"
        ) from error
    try:
        return getattr(module, attribute)
    except AttributeError as error:
        raise MissingSolutionError(
            f"exercise {name!r}: solutions/{module_name}.py has no {attribute!r} (solution mode, {SOLUTIONS_ENV}=1)"
        ) from error


def exercise(name: str) -> Callable[[T], T]:
    """Mark an exercise stub (a ``@triton.jit`` kernel or a plain function) and link it to its solution.

    ``name`` is ``"<module in solutions>.<attribute>"``. In learner mode the decorated object is
    returned unchanged; in solution mode (see :func:`solution_mode`, read when the decorator is
    applied) the solution ``solutions.<module>.<attribute>`` is returned in its place. Put it
    above ``@triton.jit``.
    """
    _split_name(name)  # a malformed name is an error in both modes

    def mark(stub: T) -> T:
        if solution_mode():
            return solution(name)
        return stub

    return mark


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`check` decided. ``bool(verdict)`` is ``verdict.solved``; ``str`` is the printed block."""

    name: str
    solved: bool
    message: str

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

# Poison for outputs: quiet NaNs with a payload no arithmetic produces, so "never written" is told
# apart from "wrote NaN".
_POISON_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF8DEADDEADDEAD),
    torch.float32: (torch.int32, 0x7FC0DEAD),
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FDA),
}
_CANARY_BYTE = 0xA5  # fills an output's guard regions
_MIN_GUARD_BYTES = 64 * 1024  # at least a few BLOCKs of overrun in any direction


# --------------------------------------------------------------------------------------------
# Guarded tensors
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Guarded:
    """A tensor given to the candidate, the guard regions on either side of it, and their snapshot."""

    label: str
    tensor: torch.Tensor
    before: torch.Tensor  # uint8 views of the guards
    after: torch.Tensor
    before_snapshot: torch.Tensor
    after_snapshot: torch.Tensor
    element_size: int

    def guard_damage(self) -> str | None:
        """A sentence saying how many guard elements changed, or None if none did."""
        parts = []
        for where, region, snapshot in (
            ("before the start", self.before, self.before_snapshot),
            ("after the end", self.after, self.after_snapshot),
        ):
            changed = (region != snapshot).view(-1, self.element_size).any(dim=1)
            count = int(changed.sum())
            if count:
                parts.append(f"{count} element{'s' if count != 1 else ''} {where} of {self.label}")
        if not parts:
            return None
        return "wrote out of bounds (guard region changed): " + " and ".join(parts)


def _storage_span(t: torch.Tensor) -> int:
    """Elements from the first to the last one a strided tensor can address (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _guarded_bytes(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 tensors (before, body, after) over one block of memory, with guards on both sides.

    On the CPU each is a separate storage over one numpy allocation, so a tensor made from
    ``body`` ends exactly at its data (the tracer sees accesses past it as out of bounds) while
    an overrun still lands in memory we own.
    """
    guard = max(_MIN_GUARD_BYTES, -(-nbytes // 64) * 64)
    if device.type == "cpu":
        block = np.empty(guard + nbytes + guard, dtype=np.uint8)
        return (
            torch.from_numpy(block[:guard]),
            torch.from_numpy(block[guard : guard + nbytes]),
            torch.from_numpy(block[guard + nbytes :]),
        )
    block = torch.empty(guard + nbytes + guard, dtype=torch.uint8, device=device)
    return block[:guard], block[guard : guard + nbytes], block[guard + nbytes :]


def _fill_poison(flat: torch.Tensor) -> None:
    """Fill a contiguous 1-D tensor with the poison for its dtype."""
    if flat.dtype in _POISON_BITS:
        int_dtype, bits = _POISON_BITS[flat.dtype]
        flat.view(int_dtype).fill_(bits)
    elif flat.dtype.is_floating_point:
        flat.fill_(float("nan"))
    elif flat.dtype == torch.bool:
        flat.fill_(False)  # overwritten with the negated reference by the caller
    else:
        flat.fill_(torch.iinfo(flat.dtype).min)


def _guarded_output(label: str, like: torch.Tensor) -> _Guarded:
    """A contiguous poisoned tensor shaped like ``like``, between canary-filled guards."""
    element_size = like.element_size()
    before, body, after = _guarded_bytes(like.numel() * element_size, like.device)
    before.fill_(_CANARY_BYTE)
    after.fill_(_CANARY_BYTE)
    flat = body.view(like.dtype)
    _fill_poison(flat)
    if like.dtype == torch.bool:
        flat.copy_(~like.reshape(-1))  # an unwritten bool is then a wrong value
    return _Guarded(label, flat.view(like.shape), before, after, before.clone(), after.clone(), element_size)


def _guarded_input(label: str, t: torch.Tensor) -> _Guarded | None:
    """A copy of ``t`` (same shape and strides) between NaN-filled guards; None if not possible."""
    if t.numel() == 0 or t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
        return None
    element_size = t.element_size()
    span = _storage_span(t)
    try:
        before, body, after = _guarded_bytes(span * element_size, t.device)
        for guard in (before, after):
            if t.dtype.is_floating_point:
                guard.view(t.dtype).fill_(float("nan"))
            else:
                guard.fill_(_CANARY_BYTE)
        flat = body.view(t.dtype)
        # Copy the whole addressed span (gaps included) so expanded/overlapping views stay valid.
        flat.copy_(t.detach().as_strided((span,), (1,), t.storage_offset()))
        copy = flat.as_strided(t.shape, t.stride())
    except (RuntimeError, TypeError, ValueError):
        return None
    if t.requires_grad and t.is_leaf:
        copy.requires_grad_(True)
    return _Guarded(label, copy, before, after, before.clone(), after.clone(), element_size)


# --------------------------------------------------------------------------------------------
# Running the candidate
# --------------------------------------------------------------------------------------------


def _trace_context() -> contextlib.AbstractContextManager:
    """``utils.trace.trace()`` if it can be used, else a context that records nothing."""
    try:
        from utils.trace import trace  # lazy: the checker works (without the tracer's report) if it cannot load
    except Exception:
        return contextlib.nullcontext()
    try:
        # Blocking stray accesses keeps a wild pointer from corrupting memory; they are still counted.
        return trace(torch_ops=False, block_out_of_bounds=True)
    except TypeError:
        pass
    except Exception:
        return contextlib.nullcontext()
    try:
        return trace()
    except Exception:
        return contextlib.nullcontext()


def _out_of_bounds(recorded: Any) -> list[str]:
    """A sentence per traced launch that accessed memory outside every tensor argument."""
    found: list[str] = []
    for launch in getattr(recorded, "launches", None) or []:
        total = int(getattr(launch, "out_of_bounds", 0) or 0)
        if not total:
            continue
        kernel = str(getattr(launch, "kernel", "the kernel"))
        reads = getattr(launch, "out_of_bounds_reads", None)
        writes = getattr(launch, "out_of_bounds_writes", None)
        if reads is None or writes is None:
            what = f"read/wrote {_plural(total, 'element')}"
        elif reads and writes:
            what = f"read {int(reads)} and wrote {_plural(int(writes), 'element')}"
        elif reads:
            what = f"read {_plural(int(reads), 'element')}"
        else:
            what = f"wrote {_plural(int(writes), 'element')}"
        found.append(f"out of bounds: {kernel} {what} outside every tensor argument (is a mask missing or wrong?)")
    return found


@dataclasses.dataclass
class _Run:
    value: Any = None
    error: BaseException | None = None
    out_of_bounds: list[str] = dataclasses.field(default_factory=list)


def _run_traced(call: Callable[[], Any]) -> _Run:
    run = _Run()
    recorded = None
    try:
        with _trace_context() as recorded:
            run.value = call()
    except Exception as error:  # the learner's code may fail in any way: that is a verdict
        run.error = error
    run.out_of_bounds = _out_of_bounds(recorded)
    return run


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _root_error(error: BaseException) -> BaseException:
    """The learner-facing exception: Triton's interpreter wraps kernel errors in InterpreterError."""
    while type(error).__name__ == "InterpreterError" and error.__cause__ is not None:
        error = error.__cause__
    return error


# Frames in the course's own tools (this checker, the tracer) are not where the learner's bug is.
_TOOLS_DIR = os.path.dirname(os.path.abspath(__file__)).replace("\\", "/") + "/"


def _where(error: BaseException) -> str:
    """' (line N of fn)' for the innermost frame outside torch/triton/site-packages, if any."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "site-packages" in path or "/triton/" in path or "/torch/" in path or path.startswith(_TOOLS_DIR):
            continue
        return f" (line {frame.lineno} of {frame.name})"
    return ""


def _describe_error(error: BaseException) -> str:
    if any(isinstance(e, NotImplementedError) for e in _chain(error)):
        return "not implemented yet (the stub raised NotImplementedError)"
    root = _root_error(error)
    text = str(root).strip()
    lines = text.splitlines()
    if len(lines) > 6:
        text = "\n".join(lines[:6]) + "\n…"
    if len(text) > 600:
        text = text[:600] + "…"
    text = text.replace("\n", "\n     ")
    return f"raised {type(root).__name__}{_where(root)}: {text}" if text else f"raised {type(root).__name__}"


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


def _value_problems(
    got: torch.Tensor,
    expected: torch.Tensor,
    considered: torch.Tensor,
    shape: tuple[int, ...],
    rtol: float | None,
    atol: float | None,
    prefix: str,
) -> list[str]:
    """Wrong values and unexpected NaN/inf among the ``considered`` flat elements."""
    total = expected.numel()
    problems: list[str] = []
    if expected.dtype.is_floating_point:
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
    return problems


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
    if run and last == total - 1:
        return (f" — the last {_plural(count, 'element')} (from index {_fmt_index(first, shape)}): "
                "is the mask's bound or the grid too small?")
    if run and first == 0:
        return f" — the first {_plural(count, 'element')}: is an offset shifted?"
    return f"; first at index {_fmt_index(first, shape)}, last at {_fmt_index(last, shape)}"


def _tensor_problems(
    got: Any, expected: torch.Tensor, rtol: float | None, atol: float | None, poisoned: bool, where: str
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
    problems += _value_problems(flat_got, flat_expected, considered, shape, rtol, atol, prefix)
    return problems


def _value_mismatch(
    got: Any, expected: Any, rtol: float | None, atol: float | None, poisoned: bool, where: str = "",
    labels: Sequence[str] | None = None,
) -> list[str]:
    """Problems with ``got`` against ``expected`` for tensors, numbers, strings and containers.

    ``labels`` name the items of a tuple result (the output arguments' names), else they are ``[i]``.
    """
    prefix = f"{where}: " if where else ""
    if isinstance(expected, torch.Tensor):
        return _tensor_problems(got, expected, rtol, atol, poisoned, where)
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
            problems += _value_mismatch(g, e, rtol, atol, poisoned, item)
        return problems
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return [f"{prefix}returned {type(got).__name__}, expected a dict"]
        if set(got) != set(expected):
            return [f"{prefix}wrong keys: got {sorted(map(str, got))}, expected {sorted(map(str, expected))}"]
        problems = []
        for key in expected:
            problems += _value_mismatch(got[key], expected[key], rtol, atol, poisoned, f"{where}[{key!r}]")
        return problems
    if isinstance(expected, bool) or isinstance(expected, numbers.Integral):
        if isinstance(got, numbers.Number) and not isinstance(got, complex) and got == expected:
            return []
        return [f"{prefix}wrong value: got {got!r}, expected {expected!r}"]
    if isinstance(expected, numbers.Real):
        if isinstance(got, numbers.Real):
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


# --------------------------------------------------------------------------------------------
# Describing a case
# --------------------------------------------------------------------------------------------


def _parameter_names(*functions: Callable[..., Any]) -> list[str]:
    for function in functions:
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            continue
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if names:
            return names
    return []


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        text = f"{tuple(value.shape)} {dtype}"
        if not value.is_contiguous():
            text += f" strides {tuple(value.stride())}"
        if value.device.type != "cpu":
            text += f" on {value.device}"
        return text
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _describe_case(index: int, count: int, names: list[str], case: tuple, outputs: list[_Guarded]) -> str:
    parts = []
    for i, value in enumerate(case):
        label = names[i] if i < len(names) else f"arg{i}"
        separator = ": " if isinstance(value, torch.Tensor) else "="
        parts.append(f"{label}{separator}{_describe_value(value)}")
    for output in outputs:
        parts.append(f"{output.label}: {_describe_value(output.tensor)}")
    described = "; ".join(parts) if parts else "no arguments"
    return f"case {index + 1} of {count}: {described}"


# --------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------


def _guard_case(case: tuple, names: list[str]) -> tuple[tuple, list[_Guarded]]:
    """The case with every tensor argument replaced by a guarded copy (same shape and strides)."""
    guarded_args = []
    guards: list[_Guarded] = []
    for i, value in enumerate(case):
        if isinstance(value, torch.Tensor):
            label = names[i] if i < len(names) else f"arg{i}"
            guarded = _guarded_input(label, value)
            if guarded is not None:
                guards.append(guarded)
                guarded_args.append(guarded.tensor)
                continue
        guarded_args.append(value)
    return tuple(guarded_args), guards


def _check_case(
    candidate: Callable[..., Any],
    reference: Callable[..., Any],
    case: tuple,
    names: list[str],
    out: bool,
    rtol: float | None,
    atol: float | None,
    compare: Callable[[Any, Any], Any] | None,
) -> tuple[list[str], list[_Guarded]]:
    """Problems found in one case (empty when it passes) and the outputs given to the candidate."""
    expected = _reference_result(reference, case)
    args, input_guards = _guard_case(case, names)

    outputs: list[_Guarded] = []
    if out:
        expected_outputs = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        if not all(isinstance(e, torch.Tensor) for e in expected_outputs):
            raise TypeError("check(out=True) needs a reference that returns a tensor (or a tuple of tensors)")
        out_names = names[len(case) :]
        for i, e in enumerate(expected_outputs):
            label = out_names[i] if i < len(out_names) else ("out" if len(expected_outputs) == 1 else f"out{i}")
            outputs.append(_guarded_output(label, e))
        run = _run_traced(lambda: candidate(*args, *(o.tensor for o in outputs)))
        got: Any = tuple(o.tensor for o in outputs) if isinstance(expected, (tuple, list)) else outputs[0].tensor
        if isinstance(expected, list):
            got = list(got)
    else:
        run = _run_traced(lambda: candidate(*args))
        got = run.value

    problems: list[str] = []
    if run.error is not None:
        problems.append(_describe_error(run.error))
    problems += run.out_of_bounds
    for guarded in outputs + input_guards:
        damage = guarded.guard_damage()
        if damage:
            problems.append(damage)
    if run.error is not None:
        return problems, outputs
    labels = [o.label for o in outputs] if out and isinstance(expected, (tuple, list)) else None
    if compare is not None:
        if out and _has_unwritten(got):
            problems += _value_mismatch(got, expected, rtol, atol, poisoned=True, labels=labels)
        else:
            problems += _custom_problems(compare, got, expected)
    else:
        problems += _value_mismatch(got, expected, rtol, atol, poisoned=out, labels=labels)
    return problems, outputs


def _has_unwritten(value: Any) -> bool:
    """True if any float tensor in ``value`` still holds the checker's poison (never written)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POISON_BITS:
            return False
        int_dtype, bits = _POISON_BITS[value.dtype]
        return bool((value.detach().reshape(-1).view(int_dtype) == bits).any())
    if isinstance(value, (tuple, list)):
        return any(_has_unwritten(v) for v in value)
    return False


def _seed_from_environment(name: str) -> int | None:
    """The seed :data:`CHECK_SEED_ENV` fixes for the check ``name``, or None if it is not set."""
    base = os.environ.get(CHECK_SEED_ENV, "").strip()
    if not base:
        return None
    return zlib.crc32(f"{base}:{name}".encode()) & 0x7FFFFFFF


def check(
    name: str,
    candidate: Callable[..., Any],
    reference: Callable[..., Any],
    cases: Sequence[tuple] | Callable[[torch.Generator], Sequence[tuple]],
    *,
    out: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    compare: Callable[[Any, Any], Any] | None = None,
    seed: int | None = None,
) -> Verdict:
    """Run ``candidate`` against ``reference`` on every case, print one verdict block, return it.

    Args:
        name: the exercise's name, as in :func:`exercise` (shown in the verdict).
        candidate: the learner's code. With ``out=False`` it is called as ``candidate(*case)``
            and its result compared; with ``out=True`` as ``candidate(*case, out)`` (one ``out``
            per tensor the reference returns), and what it wrote into ``out`` is compared.
        reference: computes the right answer: ``reference(*case)``. Floating-point tensor
            inputs are upcast to float64 first and the result rounded to the inputs' dtype
            (if the reference rejects float64, it runs in the inputs' dtype).
        cases: a list of argument tuples, or ``make_cases(gen)`` returning one, called with a
            freshly seeded CPU ``torch.Generator`` (draw on the CPU, then ``.to(device)``), so
            each run sees new random inputs (unless :data:`CHECK_SEED_ENV` is set).
        out: allocate the outputs for the candidate: contiguous, shaped and typed like the
            reference's result, poisoned, between guard regions.
        rtol, atol: override the tolerance (default: :func:`default_tolerance` of the output
            dtype; 1e-6 relative for Python floats). Integers compare exactly.
        compare: optional ``compare(got, expected)`` returning None/True if they match, False
            or a diagnosis string if not; replaces the element-wise comparison.
        seed: reproduce the inputs of an earlier run (printed in its NOT SOLVED verdict).

    Every wrong answer — an exception (``NotImplementedError`` from a stub included), a wrong
    shape, NaNs, unwritten elements, out-of-bounds accesses — becomes a NOT SOLVED verdict; the
    checker raises only for mistakes in how it is called (or in the reference).
    """
    drawn = callable(cases)
    fresh = False
    if drawn:
        if seed is None:
            seed = _seed_from_environment(name)
        if seed is None:
            seed, fresh = secrets.randbits(31), True
        # A CPU generator: the same seed gives the same inputs on every machine (draw, then .to(device)).
        generator = torch.Generator()
        generator.manual_seed(seed)
        case_list = list(cases(generator))  # type: ignore[operator]
    else:
        case_list = list(cases)  # type: ignore[arg-type]
    if not case_list:
        raise ValueError(f"check({name!r}): no cases to run")
    case_list = [c if isinstance(c, tuple) else (c,) for c in case_list]
    names = _parameter_names(candidate, reference)

    for index, case in enumerate(case_list):
        problems, outputs = _check_case(candidate, reference, case, names, out, rtol, atol, compare)
        if problems:
            lines = [f"{NOT_SOLVED_MARK} — {name}", "   " + _describe_case(index, len(case_list), names, case, outputs)]
            lines += [f"   • {p}" for p in problems]
            if drawn:
                inputs = "fresh random inputs" if fresh else "random inputs"
                lines.append(f"   ({inputs}; check(..., seed={seed}) reproduces them)")
            verdict = Verdict(name=name, solved=False, message="\n".join(lines))
            print(verdict.message)
            return verdict

    count = len(case_list)
    matched = "the case matches" if count == 1 else f"all {count} cases match"
    verdict = Verdict(name=name, solved=True, message=f"{SOLVED_MARK} — {name}: {matched} the reference")
    print(verdict.message)
    return verdict
