"""What a chapter contributes to ``make gpu-check``: correctness cases, timings, peak memory.

A chapter's ``bench/chNN_topic.py`` may define ``gpu_checks(size)`` returning a list of the
entries below, built lazily (tensors are made inside the callables or when ``gpu_checks`` is
called, never at import). ``size`` is ``"gpu"`` for the real sizes on a CUDA device, or
``"smoke"`` for tiny sizes on ``kernel_ladder.runtime.DEVICE`` — the CPU test runs every chapter's
checks that way so that a GPU run, which is rare and short, does not die on a typo.

``bench.gpu_check`` runs them all: each :class:`Check` is compared as
``max |ours - ref| / (|ref| + 1)`` against its tolerance; each :class:`Timing` is timed with
``triton.testing.do_bench`` (a wall-clock timer in smoke mode) and turned into GB/s and TFLOP/s
from the bytes and FLOPs it declares, and into a ratio against the ``baseline`` timing of the
same ``op`` (a Timing whose ``unavailable`` gives a reason is recorded with it, not timed); each
:class:`Peak` reports the peak CUDA memory its callable allocates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Check", "Peak", "Timing", "TOLERANCE", "compiled", "grads"]

#: Default tolerance of a Check, per dtype of the tested op (against a float32 reference).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}


@dataclass
class Check:
    """``run()`` and ``reference()`` return a tensor or a tuple of tensors of the same shapes."""

    op: str
    dtype: torch.dtype
    run: Callable[[], object]
    reference: Callable[[], object]
    tol: float | None = None

    @property
    def tolerance(self) -> float:
        return self.tol if self.tol is not None else TOLERANCE[self.dtype]


@dataclass
class Timing:
    """One implementation of ``op``; ``bytes``/``flops`` are what the op must move/compute (for GB/s, TFLOP/s)."""

    op: str
    impl: str
    fn: Callable[[], object]
    bytes: int | None = None
    flops: int | None = None
    baseline: bool = False
    #: The target this timing is judged against, in words (printed with the result).
    target: str = ""
    #: Why this implementation cannot run here (say, an op this torch lacks): recorded with the reason
    #: instead of a time, not a failure. Empty: time it.
    unavailable: str = ""
    #: Whether ``--quick`` times it; None: the rule of :func:`bench.gpu_check.is_headline` (the op's baseline,
    #: implementations with a target, else the ladder's top; never torch.compile).
    headline: bool | None = None


@dataclass
class Peak:
    """Peak memory allocated while ``fn()`` runs (forward and backward if it does both)."""

    op: str
    impl: str
    fn: Callable[[], object]
    baseline: bool = False
    target: str = ""


def compiled(fn: Callable, *args) -> Callable[[], object]:
    """A zero-argument callable running ``torch.compile(fn)(*args)``; it compiles on its first call.

    Name the timing's ``impl`` with "compile" in it: ``--smoke`` skips those (compiling is slow on a CPU).
    """
    compiled_fn = torch.compile(fn)
    return lambda: compiled_fn(*args)


def grads(fn: Callable, inputs: tuple, grad_out: torch.Tensor | None = None, upcast: bool = False) -> tuple:
    """Gradients of ``fn(*inputs)`` with respect to every floating input (a Check's run or reference).

    ``upcast=True`` computes in float32 from float32 copies of the inputs (the reference side).
    """
    leaves = tuple(
        (t.float() if upcast else t).detach().requires_grad_(True) if t.is_floating_point() else t for t in inputs
    )
    out = fn(*leaves)
    g = torch.ones_like(out) if grad_out is None else grad_out.to(out.dtype)
    wrt = [t for t in leaves if t.requires_grad]
    return tuple(torch.autograd.grad(out, wrt, g))
