"""The check runner: :func:`check` runs the candidate on every case and prints one verdict block.

It never raises for a wrong answer: a stub, an exception inside the kernel, a wrong shape, NaNs,
unwritten outputs and out-of-bounds accesses all become a ``❌ NOT SOLVED`` verdict whose lines say
which case failed (its arguments), what is wrong and where (:mod:`utils.exercises.compare`,
:mod:`utils.exercises.diagnosis`), and how to reproduce its random inputs (``seed=``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import random
import secrets
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import exercises as _package  # the verdict registry lives there, read at each use
from .compare import _custom_problems, _reference_result, _value_mismatch
from .diagnosis import _store_resolver
from .guards import (
    _changed_in_words,
    _changed_inputs,
    _guard_case,
    _Guarded,
    _guarded_output,
    _has_unwritten,
    _snapshot,
)
from .marker import _solution_used, _solutions_watched, _unsolved_helpers
from .rules import BROKE_A_RULE, INPUTS_UNCHANGED, INPUTS_UNCHANGED_WHY, Rule, RunContext, _CallRecorder
from .running import _describe_error, _run_traced
from .traffic import Traffic, TrafficReport, measure
from .verdict import NOT_SOLVED_MARK, SOLVED_MARK, Verdict, _wrapped

#: When set, :func:`check` draws random cases from a seed derived from its value and the check's
#: name instead of a fresh one, so that a NOT SOLVED verdict (which describes its inputs) is the
#: same on every run: learner-mode notebook runs set it (``utils.notebooks``), learners do not.
CHECK_SEED_ENV = "KERNEL_LADDER_CHECK_SEED"


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


@dataclasses.dataclass
class _Options:
    """How :func:`check` judges each case (its keyword arguments, passed along together)."""

    out: bool
    rtol: float | None
    atol: float | None
    compare: Callable[[Any, Any], Any] | None
    rules: Sequence[Rule] = ()
    diagnose: Callable[[tuple, Any, Any], str | None] | None = None
    traffic: Traffic | None = None
    tolerance: Callable[[tuple, torch.dtype | None], tuple[float, float] | None] | None = None

    def for_case(self, case: tuple) -> tuple[Any, Any]:
        """``(rtol, atol)`` for one case: with ``tolerance=``, a function of the output dtype."""
        if self.tolerance is None:
            return self.rtol, self.atol
        chosen = self.tolerance

        def per_dtype(dtype: torch.dtype | None) -> tuple[float | None, float | None]:
            picked = chosen(case, dtype)
            return (self.rtol, self.atol) if picked is None else picked

        return per_dtype, None


def _diagnosis(diagnose: Callable[[tuple, Any, Any], str | None], case: tuple, got: Any, expected: Any) -> list[str]:
    """The exercise's own diagnosis of a wrong result, as a ``cause:`` line (nothing if it has none)."""
    try:
        cause = diagnose(case, got, expected)
    except Exception:  # a result too wrong to diagnose (a wrong shape, say): the other lines say what
        return []
    return [f"cause: {cause}"] if cause else []


def _inputs_changed(changed: list[tuple[str, Any]], args: tuple, names: list[str], rules: Sequence[Rule]) -> str:
    """The verdict line for inputs the candidate changed in place: which, and how — in the words of the
    exercise's :func:`~utils.exercises.rules.inputs_unchanged` rule where it states one."""
    labels = [label for label, _ in changed]
    said = _changed_in_words(changed)
    tensors = any(isinstance(arg, torch.Tensor) for i, arg in enumerate(args)
                  if (names[i] if i < len(names) else f"argument {i + 1}") in labels)
    advice = ("compute into new tensors: an in-place op (sigmoid_(), zero_(), masked_fill_(), x += ..., out=) on an "
              "argument writes into the caller's tensor" if tensors else
              "copy what you change (list(values), dict(values)) and return the copy")
    stated = next((rule.why for rule in rules if rule.name == INPUTS_UNCHANGED), INPUTS_UNCHANGED_WHY)
    return f"{BROKE_A_RULE} — {stated}: the code changed {said} — {advice}"


def _check_case(
    name: str,
    candidate: Callable[..., Any],
    reference: Callable[..., Any],
    case: tuple,
    names: list[str],
    options: _Options,
    measure_traffic: bool = False,
) -> tuple[list[str], list[_Guarded], TrafficReport | None]:
    """Problems found in one case (empty when it passes), the outputs given to the candidate, and,
    with ``measure_traffic``, what the tracer saw of its traffic."""
    out, compare = options.out, options.compare
    rtol, atol = options.for_case(case)
    expected = _reference_result(reference, case)
    args, input_guards = _guard_case(case, names)
    snapshots = [_snapshot(arg) for arg in args]  # every argument as it was: the call must leave it so
    recorder = _CallRecorder() if any(rule.records_calls for rule in options.rules) else None
    counted: list[Any] = []
    watched: list[str] = []  # the exercise's own solutions the candidate called (learner mode)

    def under_rules(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with contextlib.ExitStack() as stack:
                if measure_traffic:
                    counted.append(stack.enter_context(_traffic_trace()))
                if recorder is not None:
                    stack.enter_context(recorder)
                hits = stack.enter_context(_solutions_watched(name))
                try:
                    return call()
                finally:
                    watched.extend(hits)

        return run

    outputs: list[_Guarded] = []
    if out:
        expected_outputs = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        if not all(isinstance(e, torch.Tensor) for e in expected_outputs):
            raise TypeError("check(out=True) needs a reference that returns a tensor (or a tuple of tensors)")
        out_names = names[len(case) :]
        for i, e in enumerate(expected_outputs):
            label = out_names[i] if i < len(out_names) else ("out" if len(expected_outputs) == 1 else f"out{i}")
            outputs.append(_guarded_output(label, e))
        run = _run_traced(under_rules(lambda: candidate(*args, *(o.tensor for o in outputs))))
        got: Any = tuple(o.tensor for o in outputs) if isinstance(expected, (tuple, list)) else outputs[0].tensor
        if isinstance(expected, list):
            got = list(got)
    else:
        run = _run_traced(under_rules(lambda: candidate(*args)))
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
        return problems, outputs, None
    labels = [o.label for o in outputs] if out and isinstance(expected, (tuple, list)) else None
    stores = _store_resolver(run.launches)
    if compare is not None:
        if out and _has_unwritten(got):
            problems += _value_mismatch(got, expected, rtol, atol, poisoned=True, labels=labels, stores=stores)
        else:
            problems += _custom_problems(compare, got, expected)
    else:
        problems += _value_mismatch(got, expected, rtol, atol, poisoned=out, labels=labels, stores=stores)
    if problems and options.diagnose is not None:
        # The exercise's own cause is the most specific line: it goes first, before the generic ones
        # (an out-of-bounds access is the symptom of an int32 offset that wrapped, say).
        problems = _diagnosis(options.diagnose, case, got, expected) + problems
    changed = _changed_inputs(args, snapshots, names)
    if changed:
        problems.append(_inputs_changed(changed, args, names, options.rules))
    if not problems and options.rules:
        # The values are right: now the rules the spec states, each named in the verdict.
        context = RunContext(candidate=candidate, case=case, got=got, expected=expected,
                             calls=tuple(recorder.calls) if recorder is not None else (), args=args,
                             aten_calls=recorder.aten_calls if recorder is not None else (),
                             launches=tuple(run.launches))
        for rule in options.rules:
            line = rule.verdict_line(context)
            if line is not None:
                problems.append(line)
    own_solution = _solution_used(watched)
    if own_solution is not None:
        problems.append(own_solution)
    if problems:
        # An unsolved exercise this one builds on comes first: it is the likelier cause.
        problems = _unsolved_helpers(name, candidate, run.launches) + problems
        return problems, outputs, None
    report = None
    if measure_traffic and options.traffic is not None:
        inputs = [(g.label, g.tensor) for g in input_guards]
        traced = counted[0] if counted else None
        report = measure(options.traffic, case, inputs, list(getattr(traced, "launches", []) or []),
                         list(getattr(traced, "torch_ops", []) or []), interpreted=_interpreted())
    return problems, outputs, report


def _interpreted() -> bool:
    import kernel_ladder

    return bool(kernel_ladder.runtime.INTERPRETER)


def _traffic_trace() -> contextlib.AbstractContextManager:
    """A trace counting the candidate's Triton launches and aten ops (for :class:`Traffic`), if it can."""
    try:
        from utils.trace import trace
    except Exception:
        return contextlib.nullcontext()
    if not _interpreted():
        return contextlib.nullcontext()  # compiled kernels are not seen: the report says so
    return trace(torch_ops=True)


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
    options: _Options,
) -> tuple[tuple[int, tuple, list[str], list[_Guarded]] | None, TrafficReport | None]:
    """The first case that fails — its index, the case, its problems and outputs — or None; and, when
    every case passes and ``options.traffic`` asks, the traffic of the last case."""
    report = None
    for index, case in enumerate(case_list):
        last = index == len(case_list) - 1
        problems, outputs, report = _check_case(name, candidate, reference, case, names, options,
                                                measure_traffic=last and options.traffic is not None)
        if problems:
            return (index, case, problems, outputs), None
    return None, report


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
    rules: Sequence[Rule] = (),
    diagnose: Callable[[tuple, Any, Any], str | None] | None = None,
    traffic: Traffic | None = None,
    tolerance: Callable[[tuple, torch.dtype | None], tuple[float, float] | None] | None = None,
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
        rules: the spec's stated rules (:mod:`utils.exercises.rules`: ``forbids``, ``no_python_loops``,
            ``holds``), held on every case whose values match; a broken one is NOT SOLVED, named.
        diagnose: ``diagnose(case, got, expected) -> cause or None``, the exercise's own diagnosis of
            a wrong result (as ``cause: ...``, before the comparison's lines).
        traffic: a :class:`~utils.exercises.traffic.Traffic`: once every case matches, the last case's
            traced bytes against the ideal and the ladder's top, one more line of the SOLVED verdict.
        tolerance: ``tolerance(case, dtype) -> (rtol, atol) or None``, per case and output dtype (None
            for a Python float): an adversarial case (scores near 200, whose fp32 rounding moves an
            exponential by 200 · 2⁻²⁴) may need more room than the dtype's default; None keeps
            ``rtol``/``atol`` (or the dtype's default).

    Every wrong answer — an exception (``NotImplementedError`` from a stub included), a wrong
    shape, NaNs, unwritten elements, out-of-bounds accesses, a broken rule, a float where the
    reference returns an exact int — becomes a NOT SOLVED verdict; the checker raises only for
    mistakes in how it is called (or in the reference).
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

    options = _Options(out=out, rtol=rtol, atol=atol, compare=compare, rules=tuple(rules), diagnose=diagnose,
                       traffic=traffic, tolerance=tolerance)
    with _global_random_state_kept():
        failure, report = _first_failure(name, candidate, reference, case_list, names, options)
    if failure is not None:
        index, case, problems, outputs = failure
        lines = [f"{NOT_SOLVED_MARK} — {name}", "   " + _describe_case(index, len(case_list), names, case, outputs)]
        lines += [f"   • {p}" for p in problems]
        if drawn:
            inputs = "fresh random inputs" if fresh else "random inputs"
            lines.append(f"   ({inputs}; check(..., seed={seed}) reproduces them)")
        verdict = Verdict(name=name, solved=False, message="\n".join(_wrapped(lines)))
        _package._LAST_VERDICTS[name] = False
        print(verdict.message)
        return verdict

    count = len(case_list)
    matched = "the case matches" if count == 1 else f"all {count} cases match"
    lines = [f"{SOLVED_MARK} — {name}: {matched} the reference"]
    if rules:
        lines.append("   rules kept: " + "; ".join(rule.name for rule in rules))
    if report is not None:
        lines.append("   " + report.line())
    message = "\n".join(_wrapped(lines))
    verdict = Verdict(name=name, solved=True, message=message, traffic=report)
    _package._LAST_VERDICTS[name] = True
    print(verdict.message)
    return verdict
