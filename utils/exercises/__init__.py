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
  to the output's dtype, so a correct kernel matches within a tolerance set by its dtype;
* every argument is compared before and after each call (tensors: values, shape and strides; lists,
  tuples, dicts and sets of them or of plain values): an input changed in place is NOT SOLVED, the
  argument named, however right the result.

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

The package, one module per part of that work (``from utils.exercises import check, exercise``
reaches everything a notebook uses):

* :mod:`~utils.exercises.marker` — :func:`exercise`, :func:`solution`, :func:`solution_mode`:
  the stub marker and solution mode, and the registry of learner-mode stubs;
* :mod:`~utils.exercises.verdict` — :class:`Verdict`, :func:`default_tolerance`, how a verdict's
  lines are written;
* :mod:`~utils.exercises.guards` — poisoned outputs and guarded inputs;
* :mod:`~utils.exercises.running` — the candidate run under the tracer, its errors in words;
* :mod:`~utils.exercises.compare` — the float64 reference and what is wrong against it;
* :mod:`~utils.exercises.diagnosis` — where the wrong elements are, and why, from the store maps;
* :mod:`~utils.exercises.rules` — the spec's stated rules, checked: ``rules.forbids``,
  ``rules.no_python_loops``, ``rules.holds`` (``check(..., rules=[...])``);
* :mod:`~utils.exercises.traffic` — :class:`Traffic`, the performance verdict of a solved kernel:
  its traced bytes against the ideal and the ladder's top (``check(..., traffic=...)``);
* :mod:`~utils.exercises.checker` — :func:`check`, the runner;
* :mod:`~utils.exercises.cuda_kernel` — the checks of CUDA C++ exercises (a source string): run thread by
  thread on the CPU by :mod:`utils.simt`, then read as sm_90 SASS
  (:func:`~utils.exercises.cuda_kernel.check_rms_norm_warp`).

Beyond the values: where the reference returns an exact Python ``int`` (or ``bool``), the answer
must be one too (a float that happens to be equal is "expected an exact int, got float ..."); an
exercise's own diagnosis (``check(..., diagnose=)``) names the likely cause of a wrong result.

The package's mutable state — the stub registry (``_STUBS``), each check's last verdict
(``_LAST_VERDICTS``) and the tracer hook (``_trace_context``) — is kept here and read through the
package at each use, so replacing one of them here (a test does) reaches every module.
"""

from __future__ import annotations

from typing import Any

import kernel_ladder  # noqa: F401  (fixes interpreter vs compiled mode before any solution kernel is defined)

from . import rules
from .checker import CHECK_SEED_ENV, check
from .marker import SOLUTIONS_ENV, MissingSolutionError, exercise, solution, solution_mode
from .running import _trace_context  # noqa: F401  (the hook check() calls, replaceable here)
from .traffic import Traffic, TrafficReport
from .verdict import (  # noqa: F401
    LINE_WIDTH,
    NOT_SOLVED_MARK,
    SOLVED_MARK,
    Verdict,
    default_tolerance,
    one_or_all_causes,
)

# Learner-mode stubs by exercise name, and each check's last verdict: a check whose code runs
# another exercise's unsolved stub names that exercise instead of blaming its own.
_STUBS: dict[str, Any] = {}
_LAST_VERDICTS: dict[str, bool] = {}

__all__ = [
    "CHECK_SEED_ENV",
    "SOLUTIONS_ENV",
    "MissingSolutionError",
    "Traffic",
    "TrafficReport",
    "Verdict",
    "check",
    "default_tolerance",
    "exercise",
    "one_or_all_causes",
    "rules",
    "solution",
    "solution_mode",
]
