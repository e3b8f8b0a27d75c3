"""Running the candidate: under the tracer (out-of-bounds accesses, store maps), its errors in words.

An exception from the learner's code is a verdict, not a crash: :func:`_describe_error` says what
was raised and where (the innermost frame outside torch, Triton and these tools), and for a
``NotImplementedError`` which stub raised it — this exercise's, another exercise's, or a helper's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections.abc import Callable
from typing import Any

from .. import exercises as _package  # the tracer hook and the stub registry live there, read at each use
from .marker import _code_of, _exercise_owning, _same_code, _stub_label
from .verdict import _plural


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
        with _package._trace_context() as recorded:  # through the package: a test may replace it
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


# Frames in the course's own tools (this checker, the tracer: all of utils/) are not where the learner's bug is.
_TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"


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
    if owner == name or name not in _package._STUBS or code.co_name.startswith("<"):
        return default
    own = _code_of(_package._STUBS[name])
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
    from .rules import BROKE_A_RULE, RuleBroken

    broken = next((e for e in _chain(error) if isinstance(e, RuleBroken)), None)
    if broken is not None:  # a given wrapper saw a stated rule broken: a verdict, not the candidate's error
        return f"{BROKE_A_RULE} — {broken.why}: {broken.what}"
    root = _root_error(error)
    text = str(root).strip()
    lines = text.splitlines()
    if len(lines) > 6:
        text = "\n".join(lines[:6]) + "\n…"
    if len(text) > 600:
        text = text[:600] + "…"
    for note in getattr(root, "__notes__", ()):  # what an exercise's own wrapper knows of the error (add_note)
        text += "\n" + str(note)
    text = text.replace("\n", "\n     ")
    return f"raised {type(root).__name__}{_where(root)}: {text}" if text else f"raised {type(root).__name__}"
