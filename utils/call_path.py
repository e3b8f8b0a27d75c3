"""Follow one argument through a library call: the Python functions that receive it, in order.

A public op hands its input tensor to a validator, a planner, a launcher, a custom-op wrapper;
each hand-over is a Python call that takes the tensor as an argument. :func:`argument_path`
lists those calls — one *step* per call, the ``(file, function)`` that received the watched
object — so "how many places does ``x`` pass through, and how often does it come back to the
same file?" becomes a number a test can bound::

    from utils.call_path import argument_path
    path = argument_path(kernel_ladder.rms_norm, x, w, watch=x)
    len(path), path.files, path.visits("ops/norm.py")

It uses :func:`sys.setprofile`, so only Python function calls are seen (Triton's interpreter and
torch's dispatcher are outside the package and not counted; a ``torch.library`` custom op's
Python implementation is a call like any other). A call counts when one of its arguments *is*
the watched object (identity, not equality), directly or as an element of a list, tuple or dict
argument (``plan([x, y])`` receives ``x``). Only functions defined in files under ``package``'s
directory count; a file is named by its path relative to it (``ops/norm.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

__all__ = ["ArgumentPath", "Step", "argument_path"]


@dataclass(frozen=True)
class Step:
    """One call that received the watched object: the file (relative to the package) and the function."""

    file: str
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.function}"


class ArgumentPath(list):
    """The steps, in call order (a list of :class:`Step`), with counts over them."""

    @property
    def files(self) -> list[str]:
        """The distinct files the object passed through, in order of first arrival."""
        return list(dict.fromkeys(step.file for step in self))

    def visits(self, file: str) -> int:
        """How many times the path *enters* ``file``: runs of consecutive steps in it count once."""
        count, previous = 0, None
        for step in self:
            if step.file == file and previous != file:
                count += 1
            previous = step.file
        return count

    def __str__(self) -> str:
        return "\n".join(f"{i:3d}  {step}" for i, step in enumerate(self, 1))


def _holds(value: Any, target: Any) -> bool:
    if value is target:
        return True
    if isinstance(value, (list, tuple)):
        return any(item is target for item in value)
    if isinstance(value, dict):
        return any(item is target for item in value.values())
    return False


def _receives(frame: FrameType, target: Any) -> bool:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    local = frame.f_locals
    return any(_holds(local.get(name), target) for name in code.co_varnames[:n])


def argument_path(fn: Callable[..., Any], *args: Any, watch: Any, package: str | ModuleType = "kernel_ladder",
                  **kwargs: Any) -> ArgumentPath:
    """Call ``fn(*args, **kwargs)`` and return every call inside ``package`` that received ``watch``.

    ``fn``'s own call counts when it is defined in the package. Generators and other Python calls
    count like functions; C functions are not seen.
    """
    if isinstance(package, str):
        package = __import__(package)
    root = Path(package.__file__).resolve().parent
    prefix = str(root) + "/"
    steps = ArgumentPath()
    relative: dict[str, str | None] = {}

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        name = relative.get(filename, "")
        if name == "":
            resolved = str(Path(filename).resolve())
            name = relative[filename] = resolved[len(prefix):] if resolved.startswith(prefix) else None
        if name is not None and _receives(frame, watch):
            steps.append(Step(name, frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return steps
