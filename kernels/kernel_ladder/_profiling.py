"""Readable Triton kernel names in ``torch.profiler`` traces, in interpreter mode.

Every op is a ``torch.library`` custom op, so the profiler already records it by name
(``kernel_ladder::softmax``, ``kernel_ladder::softmax_backward``). Its kernel launches are a different matter:

* **compiled** (a GPU), each launch is a CUDA kernel that the profiler's CUDA activity names after
  the Triton function (``softmax_kernel``); nothing is needed here;
* **interpreted** (the CPU), a launch is Python code that the profiler does not see as anything.
  :func:`install` wraps the interpreter's launch (``InterpretedFunction.run``, the one place every
  launch goes through) in ``torch.profiler.record_function("triton::<kernel name>")``, only while
  a profiler is recording: with none, the wrapper costs one C call (``torch.autograd._profiler_enabled``,
  about 0.1 us) per launch.

Installed by :mod:`kernel_ladder.runtime` in interpreter mode only.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PREFIX", "install", "launch_name"]

#: The prefix of a launch's name in a trace: ``triton::softmax_kernel``.
PREFIX: str = "triton::"

_INSTALLED = False


def launch_name(kernel: object) -> str:
    """The trace name of a launch of ``kernel`` (a JIT or interpreted Triton function)."""
    fn = getattr(kernel, "fn", kernel)
    return PREFIX + getattr(fn, "__name__", type(kernel).__name__)


def install() -> None:
    """Wrap the interpreter's launch in a named profiler range (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    profiler_enabled = torch.autograd._profiler_enabled
    record_function = torch.profiler.record_function

    @functools.wraps(original)
    def run(self, *args, **kwargs):
        if not profiler_enabled():
            return original(self, *args, **kwargs)
        with record_function(launch_name(self)):
            return original(self, *args, **kwargs)

    InterpretedFunction.run = run
    _INSTALLED = True
