"""The exercise marker and solution mode: how a notebook's stub is linked to its solution.

:func:`exercise` marks a stub with the name of its solution in ``solutions/``; in solution mode
(:data:`SOLUTIONS_ENV`) it returns the solution in the stub's place. In learner mode it registers the
stub, so that a check whose code runs another exercise's unsolved stub can name that exercise
instead of blaming its own (:func:`_unsolved_helpers`, and :mod:`utils.exercises.running` for a
stub that raised).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from .. import exercises as _package  # the registries live there, read at each use

#: Environment variable that switches exercise stubs to their solutions.
SOLUTIONS_ENV = "KERNEL_LADDER_SOLUTIONS"

T = TypeVar("T")


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
        _package._STUBS[name] = stub  # so that another exercise's check can say it depends on this one
        return stub

    return mark


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
    for name, stub in _package._STUBS.items():
        stub_code = _code_of(stub)
        if stub_code is not None and _same_code(code, stub_code):
            return name
    return None


def _stub_label(name: str) -> str:
    stub = _package._STUBS.get(name)
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
    others = {n: stub for n, stub in _package._STUBS.items() if n != name and _package._LAST_VERDICTS.get(n) is False}
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


class _Watched:
    """Stands in for a solution while a learner's code runs: a call or a ``[grid]`` launch is noted, then
    passed on, so the verdict can say the exercise was answered by its own solution."""

    def __init__(self, target: Any, label: str, hits: list[str]) -> None:
        self._target, self._label, self._hits = target, label, hits

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._hits.append(self._label)
        return self._target(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        self._hits.append(self._label)
        return self._target[key]

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._target, attribute)


def _own_exercises(name: str) -> list[str]:
    """The learner-mode exercises a check named ``name`` is for: the same name, or the same chapter
    number and attribute (a check may be named ``ch10.x`` for the exercise ``ch10_integration.x``)."""
    chapter, _, attribute = name.rpartition(".")
    number = chapter.split("_")[0]
    own = []
    for exercise_name in _package._STUBS:
        module, _, stub_attribute = exercise_name.rpartition(".")
        if exercise_name == name or (stub_attribute == attribute and module.split("_")[0] == number):
            own.append(exercise_name)
    return own


@contextlib.contextmanager
def _solutions_watched(name: str) -> Iterator[list[str]]:
    """While learner code runs in learner mode, the solutions of the exercises this check is for are
    replaced in their ``solutions`` module by watchers; yields the list of those called.

    In solution mode nothing is watched (the candidate *is* the solution there)."""
    hits: list[str] = []
    if solution_mode():
        yield hits
        return
    replaced: list[tuple[Any, str, Any]] = []
    try:
        for exercise_name in _own_exercises(name):
            module_name, attribute = _split_name(exercise_name)
            try:
                module = importlib.import_module(f"solutions.{module_name}")
                original = getattr(module, attribute)
            except (ImportError, AttributeError):
                continue
            label = f"{module_name}.{attribute}"
            setattr(module, attribute, _Watched(original, label, hits))
            replaced.append((module, attribute, original))
        yield hits
    finally:
        for module, attribute, original in replaced:
            setattr(module, attribute, original)


def _solution_used(hits: Sequence[str]) -> str | None:
    """A broken-rule line when the learner's code answered with the exercise's own solution."""
    if not hits:
        return None
    module_name, _, attribute = hits[0].rpartition(".")
    return (f"broke a stated rule — write the exercise yourself: the code called the chapter's own solution "
            f"({attribute} in solutions/{module_name}.py, the notebook's given.{attribute})")
