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

How it says where and why:

* where: the wrong or unwritten elements' shape — the first wrong index, the rows or columns,
  and for a 1-D kernel (one program per BLOCK) "the first block right, every later block wrong",
  "wrong only in the padded tail" or "the same lanes of every block" (periodic by BLOCK);
* why, only from evidence: the tracer's store maps (``trace(record_writes=True)``) say which
  program stored to each output element and which masked a store to it off. Two programs storing
  the same elements, or a program storing outside its own block, is the ``pid → offset`` mapping;
  the grid is named only when its programs' lanes cannot cover the output; the mask only when a
  store to a missing element was masked off (or when the padded tail alone is wrong);
* which code: a stub raising ``NotImplementedError`` in another exercise (or in a helper) is
  named instead of the exercise checked, and so is another exercise this check runs whose own
  check said NOT SOLVED (learner-mode stubs are registered by :func:`exercise`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
import numbers
import os
import random
import secrets
import textwrap
import traceback
import types
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

import kernel_ladder  # noqa: F401  (fixes interpreter vs compiled mode before any solution kernel is defined)

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
        _STUBS[name] = stub  # so that another exercise's check can say it depends on this one
        return stub

    return mark


# Learner-mode stubs by exercise name, and each check's last verdict: a check whose code runs
# another exercise's unsolved stub names that exercise instead of blaming its own.
_STUBS: dict[str, Any] = {}
_LAST_VERDICTS: dict[str, bool] = {}


def _code_of(function: Any) -> types.CodeType | None:
    """The code object of a function, of a ``@triton.jit`` kernel (its ``.fn``), or of a partial."""
    function = getattr(function, "func", function)  # functools.partial
    function = getattr(function, "fn", function)  # triton.JITFunction
    code = getattr(function, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


#: How many decorator lines may precede a ``def`` (``@exercise``, ``@triton.jit``, ...).
_DECORATOR_LINES = 4


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    # The interpreter runs a rewritten copy of a @triton.jit function called from a kernel: same name
    # and file, its first line the ``def`` rather than the first decorator.
    if a is b:
        return True
    if (a.co_name, a.co_filename) != (b.co_name, b.co_filename):
        return False
    return abs(a.co_firstlineno - b.co_firstlineno) <= _DECORATOR_LINES


def _exercise_owning(code: types.CodeType) -> str | None:
    """The exercise whose learner-mode stub this code is, if any."""
    for name, stub in _STUBS.items():
        stub_code = _code_of(stub)
        if stub_code is not None and _same_code(code, stub_code):
            return name
    return None


def _stub_label(name: str) -> str:
    stub = _STUBS.get(name)
    function = getattr(stub, "fn", stub)
    return f"{getattr(function, '__name__', name.rpartition('.')[2])} (exercise {name})"


def _referenced(function: Any, depth: int = 3) -> list[Any]:
    """Objects the code of ``function`` names (globals, closure cells), following the same module's functions."""
    found: list[Any] = []
    seen: set[int] = set()

    def codes(code: types.CodeType) -> list[types.CodeType]:
        nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
        return [code, *(inner for c in nested for inner in codes(c))]

    def walk(current: Any, left: int) -> None:
        current = getattr(current, "func", current)
        code = getattr(current, "__code__", None)
        if not isinstance(code, types.CodeType) or id(current) in seen:
            return
        seen.add(id(current))
        namespace = getattr(current, "__globals__", {}) or {}
        values = [namespace[n] for c in codes(code) for n in c.co_names if n in namespace]
        for cell in getattr(current, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                values.append(cell.cell_contents)
        for value in values:
            found.append(value)
            if left and isinstance(value, types.FunctionType) and value.__module__ == current.__module__:
                walk(value, left - 1)

    walk(function, depth)
    return found


def _unsolved_helpers(name: str, candidate: Callable[..., Any], launches: Sequence[Any]) -> list[str]:
    """Sentences naming other exercises whose stubs this check runs and whose own checks are NOT SOLVED."""
    others = {n: stub for n, stub in _STUBS.items() if n != name and _LAST_VERDICTS.get(n) is False}
    if not others:
        return []
    launched = {str(getattr(launch, "kernel", "")) for launch in launches}
    referenced = {id(value) for value in _referenced(candidate)}
    found = []
    for other, stub in others.items():
        kernel = getattr(getattr(stub, "fn", None), "__name__", None)
        if kernel is not None and kernel in launched:
            found.append(f"this check launches {_stub_label(other)}, whose own check is NOT SOLVED yet: "
                         "solve that exercise first")
        elif id(stub) in referenced:
            found.append(f"this check's code uses {_stub_label(other)}, whose own check is NOT SOLVED yet: "
                         "solve that exercise first")
    return found


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
        # The store maps say which program wrote each output element: the evidence for the hints.
        return trace(torch_ops=False, block_out_of_bounds=True, record_writes=True)
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
    launches: list[Any] = dataclasses.field(default_factory=list)


def _run_traced(call: Callable[[], Any]) -> _Run:
    run = _Run()
    recorded = None
    try:
        with _trace_context() as recorded:
            run.value = call()
    except Exception as error:  # the learner's code may fail in any way: that is a verdict
        run.error = error
    run.out_of_bounds = _out_of_bounds(recorded)
    run.launches = list(getattr(recorded, "launches", None) or [])
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


def _not_implemented(error: NotImplementedError, name: str | None, candidate: Any) -> str:
    """Which stub raised NotImplementedError: this exercise's, another exercise's, or a helper's."""
    default = "not implemented yet (the stub raised NotImplementedError)"
    frame = error.__traceback__
    if frame is None or name is None:
        return default
    while frame.tb_next is not None:
        frame = frame.tb_next
    code, line = frame.tb_frame.f_code, frame.tb_lineno
    owner = _exercise_owning(code)
    if owner is not None and owner != name:
        return (f"not implemented yet: this check runs {_stub_label(owner)}, which is still a stub "
                "(it raised NotImplementedError): solve that exercise first")
    if owner == name or name not in _STUBS or code.co_name.startswith("<"):
        return default
    own = _code_of(_STUBS[name])
    candidate_code = _code_of(candidate)
    if (own is not None and _same_code(code, own)) or (candidate_code is not None and _same_code(code, candidate_code)):
        return default
    # The exercise checked is registered and is not what raised: a helper it calls did.
    return (f"not implemented yet: {code.co_name} (line {line}) raised NotImplementedError — "
            f"a function this check runs, not the exercise {name} itself")


def _describe_error(error: BaseException, name: str | None = None, candidate: Any = None) -> str:
    stub_error = next((e for e in _chain(error) if isinstance(e, NotImplementedError)), None)
    if stub_error is not None:
        return _not_implemented(stub_error, name, candidate)
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
) -> tuple[list[str], torch.Tensor]:
    """Wrong values and unexpected NaN/inf among the ``considered`` flat elements, and where they are."""
    total = expected.numel()
    problems: list[str] = []
    wrong = torch.zeros(total, dtype=torch.bool)
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
# Where a wrong output is, and what the tracer's store maps say about why
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Stores:
    """What the one launch that stored into an output did, in the output's flat element order."""

    kernel: str
    grid: tuple[int, ...]
    programs: int
    first: np.ndarray  # program of the first store to each element, -1 where none
    last: np.ndarray  # program of the last store
    masked: np.ndarray  # the last program whose store addressed the element with a masked-off lane
    lanes: int  # the most lanes of one store instruction (BLOCK for a 1-D kernel)
    ranges: dict[int, tuple[int, int, int]]  # program -> (lowest, highest element it stored, count)


def _store_resolver(launches: Sequence[Any]) -> Callable[[torch.Tensor], _Stores | None]:
    """``resolve(tensor)``: the store map of the one launch that stored into ``tensor``, or None."""

    def resolve(tensor: torch.Tensor) -> _Stores | None:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or not tensor.is_contiguous():
            return None
        pointer = tensor.data_ptr()
        found = [
            (launch, stored)
            for launch in launches
            for stored in (getattr(launch, "store_maps", None) or {}).values()
            if stored.data_ptr == pointer
        ]
        # Several launches (or arguments) storing into it: program ids no longer say who wrote what.
        if len(found) != 1 or found[0][1].first.size != tensor.numel():
            return None
        launch, stored = found[0]
        return _Stores(
            kernel=str(launch.kernel), grid=tuple(launch.grid), programs=int(launch.programs),
            first=stored.first, last=stored.last, masked=stored.masked, lanes=int(stored.lanes),
            ranges=dict(stored.programs),
        )

    return resolve


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Ascending indices -> maximal runs of consecutive ones, as (first, last)."""
    if indices.size == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0]
    starts = np.concatenate([indices[:1], indices[breaks + 1]])
    ends = np.concatenate([indices[breaks], indices[-1:]])
    return list(zip(starts.tolist(), ends.tolist()))


def _fmt_flat(index: int, shape: Sequence[int]) -> str:
    return str(index) if len(shape) <= 1 else _fmt_index(index, shape)


def _span_text(first: int, last: int, shape: Sequence[int]) -> str:
    if first == last:
        return f"index {_fmt_flat(first, shape)}"
    return f"indices {_fmt_flat(first, shape)}..{_fmt_flat(last, shape)}"


def _ranges_text(values: Sequence[int] | np.ndarray, limit: int = 3) -> str:
    """``[0, 1, 2, 3, 9]`` -> ``'0..3, 9'`` (at most ``limit`` runs, then how many in all)."""
    runs = _runs(np.asarray(sorted(values), dtype=np.int64))
    parts = [str(a) if a == b else f"{a}..{b}" for a, b in runs[:limit]]
    if len(runs) > limit:
        parts.append(f"… ({len(runs)} runs)")
    return ", ".join(parts)


def _programs_text(programs: Sequence[int]) -> str:
    programs = sorted(programs)
    if len(programs) == 1:
        return f"program {programs[0]}"
    if len(programs) <= 4:
        return "programs " + ", ".join(map(str, programs[:-1])) + f" and {programs[-1]}"
    return "programs " + ", ".join(map(str, programs[:3])) + f", … ({len(programs)} in all)"


def _region_text(mask: np.ndarray, shape: Sequence[int]) -> str:
    """Where the True elements of a flat mask are, as rows / columns / a box / index ranges."""
    indices = np.nonzero(mask)[0]
    if len(shape) >= 2 and indices.size:
        rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
        grid = mask.reshape(rows, cols)
        bad_rows, bad_cols = grid.any(axis=1), grid.any(axis=0)
        row_text = "rows" if len(shape) == 2 else "rows (leading dims flattened)"
        if bool((grid == bad_rows[:, None]).all()):
            return f"{row_text} {_ranges_text(np.nonzero(bad_rows)[0])} (every column)"
        if bool((grid == bad_cols[None, :]).all()):
            return f"columns {_ranges_text(np.nonzero(bad_cols)[0])} (every row)"
        if bool((grid == (bad_rows[:, None] & bad_cols[None, :])).all()):
            return (f"{row_text} {_ranges_text(np.nonzero(bad_rows)[0])} × columns "
                    f"{_ranges_text(np.nonzero(bad_cols)[0])}")
    runs = _runs(indices)
    text = ", ".join(_span_text(a, b, shape).split(" ", 1)[1] for a, b in runs[:3])
    if len(runs) > 3:
        text += f", … ({len(runs)} runs)"
    return ("index " if indices.size == 1 else "indices ") + text


def _block_size(stores: _Stores, total: int) -> int | None:
    """BLOCK if the launch is one program per flat block of ``lanes`` elements (a 1-D kernel), else None."""
    block = stores.lanes
    if block <= 0 or len(stores.grid) != 1 or stores.programs != -(-total // block):
        return None
    if any(count and high - low >= block for low, high, count in stores.ranges.values()):
        return None  # a program stored to a wider span than one block: tiles, rows or loops, not blocks
    return block


def _store_causes(unwritten: np.ndarray, stores: _Stores, shape: Sequence[int], block: int | None) -> list[str]:
    """What the store maps show about why elements are missing: only what the evidence shows."""
    total = unwritten.size
    storing = {p: r for p, r in stores.ranges.items() if r[2] > 0}
    never_stored = unwritten & (stores.last < 0)
    unaddressed = never_stored & (stores.masked < 0)
    masked_off = never_stored & (stores.masked >= 0)
    causes: list[str] = []
    mapping = False
    if len(storing) > 1 and len(set(storing.values())) == 1:
        low, high, _ = next(iter(storing.values()))
        question = " (is pid * BLOCK missing from them?)" if block else ""
        causes.append(f"every program ({len(storing)}) stored to the same elements, {_span_text(low, high, shape)}: "
                      f"the offsets do not depend on the program id{question}")
        mapping = True
    else:
        shared = (stores.first >= 0) & (stores.first != stores.last)
        if shared.any():
            i = int(np.argmax(shared))
            causes.append(
                f"programs {int(stores.first[i])} and {int(stores.last[i])} both stored to index "
                f"{_fmt_flat(i, shape)} ({_plural(int(shared.sum()), 'element')} stored by more than one "
                "program): the pid → offset mapping sends two programs to the same elements"
            )
            mapping = True
        if block:
            for program in sorted(storing):
                low, high, _ = storing[program]
                own_low, own_high = program * block, min((program + 1) * block, total) - 1
                if low < own_low or high > own_high:
                    causes.append(
                        f"program {program} stored to {_span_text(low, high, shape)}, outside its own block "
                        f"{own_low}..{own_high} (BLOCK = {block}): its offsets do not start at pid * BLOCK"
                    )
                    mapping = True
                    break
    # Programs whose store lanes pointed into the output but were all masked off. In a 1-D kernel
    # that is the mask's doing; in a 2-D tile a masked lane past the last column points at the next
    # row, so there it only says the programs' tiles miss the output.
    idle = [p for p, r in stores.ranges.items() if r[2] == 0]
    if not mapping and idle and not block and never_stored.any():
        causes.append(
            f"{_programs_text(idle)} stored nothing here (every lane masked off) while "
            f"{_region_text(never_stored, shape)} were never stored: the pid → tile mapping leaves part of "
            "the output to no program"
        )
        return causes
    if mapping:
        if unaddressed.any() or masked_off.any():
            causes.append(f"no program stored to {_region_text(never_stored, shape)}")
        return causes
    if unaddressed.any():
        reach = stores.programs * stores.lanes
        if reach < total:
            causes.append(
                f"the grid is too small: {_plural(stores.programs, 'program')} × {stores.lanes} lanes reach at "
                f"most {reach} of the {total} elements; no store reached {_region_text(unaddressed, shape)}"
            )
        else:
            skipped = "it" if int(unaddressed.sum()) == 1 else "them"
            causes.append(f"no program's store reached {_region_text(unaddressed, shape)}: the offsets skip {skipped}")
    if masked_off.any():
        program = int(stores.masked[int(np.argmax(masked_off))])
        causes.append(f"the store to {_region_text(masked_off, shape)} was masked off (by program {program}): "
                      "is the mask's bound too tight?")
    return causes


def _block_shape(bad: np.ndarray, block: int) -> str | None:
    """The wrong elements' pattern over the blocks of a 1-D launch, or None if it has none to name."""
    total = bad.size
    blocks = -(-total // block)
    if blocks < 2:
        return None
    indices = np.nonzero(bad)[0]
    bad_blocks = sorted(set((indices // block).tolist()))
    tail = total % block
    if tail and bad_blocks == [blocks - 1]:
        start = (blocks - 1) * block
        return (f"wrong only in the padded tail, the last partial block (indices {start}..{total - 1}); every "
                "full block is right — only there is the mask partly off: check it and the loads' `other=`")
    lanes = sorted(set((indices % block).tolist()))
    if len(bad_blocks) >= 2 and len(lanes) < block:
        periodic = True
        for k in range(blocks):
            valid = min(block, total - k * block)
            in_block = bad[k * block : k * block + valid]
            expected = np.zeros(valid, dtype=bool)
            expected[[lane for lane in lanes if lane < valid]] = True
            if not np.array_equal(in_block, expected):
                periodic = False
                break
        if periodic:
            return (f"the same lanes of every block of {block} (BLOCK) are wrong: lanes {_ranges_text(lanes)} — "
                    "periodic with period BLOCK; the other lanes are right")
    if bad_blocks == list(range(1, blocks)):
        return f"the first block (indices 0..{block - 1}) is right, every later block is wrong"
    return None


def _layout_hints(
    unwritten: np.ndarray, wrong: np.ndarray, shape: Sequence[int], stores: _Stores | None
) -> list[str]:
    """Where the wrong or unwritten elements are (their shape) and, from the store maps, why."""
    bad = unwritten | wrong
    total = bad.size
    count = int(bad.sum())
    if count == 0 or total < 2:
        return []
    hints: list[str] = []
    block = _block_size(stores, total) if stores is not None else None
    if stores is not None:
        hints += _store_causes(unwritten, stores, shape, block)
    if count == total:
        return hints
    pattern = _block_shape(bad, block) if block else None
    if pattern is None and (wrong.any() or len(shape) >= 2):
        region = _region_text(bad, shape)
        if not any(region in hint for hint in hints):  # not said already (the unwritten line says 1-D runs)
            first = int(np.argmax(bad))
            pattern = f"first wrong at index {_fmt_flat(first, shape)}; wrong: {region}, right elsewhere"
    if pattern:
        hints.append(f"where: {pattern}")
    return hints


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
    name: str,
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
        problems.append(_describe_error(run.error, name, candidate))
    problems += run.out_of_bounds
    for guarded in outputs + input_guards:
        damage = guarded.guard_damage()
        if damage:
            problems.append(damage)
    if run.error is not None:
        if not problems[0].startswith("not implemented yet: this check runs"):
            problems = _unsolved_helpers(name, candidate, run.launches) + problems
        return problems, outputs
    labels = [o.label for o in outputs] if out and isinstance(expected, (tuple, list)) else None
    stores = _store_resolver(run.launches)
    if compare is not None:
        if out and _has_unwritten(got):
            problems += _value_mismatch(got, expected, rtol, atol, poisoned=True, labels=labels, stores=stores)
        else:
            problems += _custom_problems(compare, got, expected)
    else:
        problems += _value_mismatch(got, expected, rtol, atol, poisoned=out, labels=labels, stores=stores)
    if problems:
        # An unsolved exercise this one builds on comes first: it is the likelier cause.
        problems = _unsolved_helpers(name, candidate, run.launches) + problems
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


#: Printed verdict lines are wrapped to this width (a notebook's output column).
LINE_WIDTH = 100


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


@contextlib.contextmanager
def _global_random_state_kept():
    """Leave torch's, numpy's and Python's global random generators as they were found.

    A reference or a candidate that draws from them would otherwise leave them in a state that
    depends on how many cases ran — on the verdict — and a later cell's random inputs with them.
    """
    # numpy's legacy global generator is the very state a notebook's np.random calls share.
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002


def _first_failure(
    name: str,
    candidate: Callable[..., Any],
    reference: Callable[..., Any],
    case_list: Sequence[tuple],
    names: list[str],
    out: bool,
    rtol: float | None,
    atol: float | None,
    compare: Callable[[Any, Any], Any] | None,
) -> tuple[int, tuple, list[str], list[_Guarded]] | None:
    """The first case that fails — its index, the case, its problems and outputs — or None."""
    for index, case in enumerate(case_list):
        problems, outputs = _check_case(name, candidate, reference, case, names, out, rtol, atol, compare)
        if problems:
            return index, case, problems, outputs
    return None


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

    with _global_random_state_kept():
        failure = _first_failure(name, candidate, reference, case_list, names, out, rtol, atol, compare)
    if failure is not None:
        index, case, problems, outputs = failure
        lines = [f"{NOT_SOLVED_MARK} — {name}", "   " + _describe_case(index, len(case_list), names, case, outputs)]
        lines += [f"   • {p}" for p in problems]
        if drawn:
            inputs = "fresh random inputs" if fresh else "random inputs"
            lines.append(f"   ({inputs}; check(..., seed={seed}) reproduces them)")
        verdict = Verdict(name=name, solved=False, message="\n".join(_wrapped(lines)))
        _LAST_VERDICTS[name] = False
        print(verdict.message)
        return verdict

    count = len(case_list)
    matched = "the case matches" if count == 1 else f"all {count} cases match"
    message = "\n".join(_wrapped([f"{SOLVED_MARK} — {name}: {matched} the reference"]))
    verdict = Verdict(name=name, solved=True, message=message)
    _LAST_VERDICTS[name] = True
    print(verdict.message)
    return verdict
