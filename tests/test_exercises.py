"""The exercise checker's verdicts on right and wrong code, and the stub/solution switch.

Every wrong variant here is a mistake a learner makes — a stub, a missing mask, an off-by-one
offset, an ignored input, NaNs, a wrong shape, a wrong number — and each must come back NOT
SOLVED with the diagnosis that points at it, without the checker raising. Sizes are not
multiples of BLOCK so that masks matter; grids stay at a few programs (the interpreter costs
about a millisecond per program).
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import triton
import triton.language as tl

import kernels
from utils import exercises
from utils.exercises import MissingSolutionError, Verdict, check, default_tolerance, exercise, solution_mode

# The checker's out-of-bounds diagnoses and the traced references need the interpreter.
pytestmark = pytest.mark.interpreter

DEVICE = kernels.runtime.DEVICE
BLOCK = 1024
SIZES = (1000, 2500)  # not multiples of BLOCK: the last program is partly masked
interpreter_only = pytest.mark.skipif(not kernels.runtime.INTERPRETER, reason="the tracer sees interpreted kernels")


# ----------------------------------------------------------------------------------------------
# Vector add: the right kernel and the mistakes


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + y, mask=in_bounds)


@triton.jit
def add_stub_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # YOUR CODE HERE
    pass


@triton.jit
def add_without_mask_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


@triton.jit
def add_shifted_load_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets + 1, mask=in_bounds)  # off by one: reads x[i + 1], and x[n] at the end
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + y, mask=in_bounds)


@triton.jit
def add_shifted_store_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK) + 1  # off by one: starts at 1
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + y, mask=in_bounds)


@triton.jit
def add_store_before_start_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets - 1, x + y, mask=in_bounds)  # writes out[-1] .. out[n - 2]


@triton.jit
def add_ignores_y_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=in_bounds), mask=in_bounds)


@triton.jit
def add_nan_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, (x + y) * float("nan"), mask=in_bounds)


@triton.jit
def add_raising_stub_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    raise NotImplementedError("write the kernel")


def launcher(kernel):
    """The candidate a check cell passes: launch ``kernel`` over ``out`` with one program per BLOCK."""

    def launch_add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)

    return launch_add


def add_cases(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(n, generator=gen).to(DEVICE, dtype), torch.randn(n, generator=gen).to(DEVICE, dtype))
        for n in SIZES
    ]


def check_add(kernel, **kwargs) -> Verdict:
    return check("ch99_test.add_kernel", launcher(kernel), torch.add, add_cases, out=True, **kwargs)


def first_line(verdict: Verdict) -> str:
    return verdict.message.splitlines()[0]


def assert_not_solved(verdict: Verdict, *fragments: str) -> None:
    assert not verdict.solved and not bool(verdict)
    assert first_line(verdict) == f"❌ NOT SOLVED — {verdict.name}"
    for fragment in fragments:
        assert fragment in verdict.message, f"{fragment!r} not in:\n{verdict.message}"


@pytest.fixture
def no_tracer(monkeypatch):
    """The checker as it is when utils.trace cannot be used: the guard regions alone must catch writes."""
    monkeypatch.setattr(exercises, "_trace_context", contextlib.nullcontext)


def test_correct_kernel_is_solved(capsys):
    verdict = check_add(add_kernel)
    assert verdict.solved and bool(verdict)
    assert verdict.message == "✅ SOLVED — ch99_test.add_kernel: all 2 cases match the reference"
    assert capsys.readouterr().out == verdict.message + "\n"  # exactly one block, printed


def test_solved_text_is_the_same_on_fresh_inputs():
    # Fresh random inputs every run, but nothing random in the SOLVED text (nbval compares it).
    assert check_add(add_kernel).message == check_add(add_kernel).message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_correct_kernel_is_solved_in_half_precision(dtype):
    verdict = check("add", launcher(add_kernel), torch.add, lambda gen: add_cases(gen, dtype), out=True)
    assert verdict.solved, verdict.message


def test_stub_is_never_written(capsys):
    verdict = check_add(add_stub_kernel)
    assert_not_solved(verdict, "1000 of 1000 elements never written (still NaN) — none at all: does the kernel store",
                      "case 1 of 2")
    printed = capsys.readouterr().out
    assert printed == verdict.message + "\n" and printed.count("NOT SOLVED") == 1


def test_stub_raising_not_implemented_in_a_plain_function():
    def add(x, y):
        raise NotImplementedError

    assert_not_solved(
        check("add", add, torch.add, add_cases), "not implemented yet (the stub raised NotImplementedError)"
    )


@interpreter_only
def test_stub_raising_not_implemented_in_a_kernel():
    # The interpreter wraps the kernel's exception; the checker must still see NotImplementedError.
    verdict = check_add(add_raising_stub_kernel)
    assert_not_solved(verdict, "not implemented yet (the stub raised NotImplementedError)")


@interpreter_only
def test_missing_mask_is_out_of_bounds_for_the_tracer():
    verdict = check_add(add_without_mask_kernel)
    # 1000 elements in one BLOCK of 1024: 24 stray lanes, read from x and y, written to out.
    assert_not_solved(
        verdict,
        "out of bounds: add_without_mask_kernel read 48 and wrote 24 elements outside every tensor argument",
        "case 1 of 2: x: (1000,) float32; y: (1000,) float32; out: (1000,) float32",
    )


def test_missing_mask_lands_in_the_guard_without_the_tracer(no_tracer):
    verdict = check_add(add_without_mask_kernel)
    assert_not_solved(verdict, "wrote out of bounds (guard region changed): 24 elements after the end of out")
    assert "outside every tensor argument" not in verdict.message


def test_write_before_the_start_lands_in_the_guard(no_tracer):
    verdict = check_add(add_store_before_start_kernel)
    assert_not_solved(verdict, "wrote out of bounds (guard region changed): 1 element before the start of out")
    assert "1 of 1000 elements never written" in verdict.message  # out[n - 1]


@interpreter_only
def test_off_by_one_load_is_wrong_values_and_out_of_bounds():
    verdict = check_add(add_shifted_load_kernel)
    assert_not_solved(
        verdict,
        "out of bounds: add_shifted_load_kernel read 1 element outside every tensor argument",
        "wrong values in ",
        "of 1000 elements; worst at index (",
    )


def test_off_by_one_start_leaves_the_first_element_unwritten():
    verdict = check_add(add_shifted_store_kernel)
    assert_not_solved(verdict, "1 of 1000 elements never written (still NaN) — the first 1 element")
    assert "wrong values" not in verdict.message  # the others are right


@triton.jit
def add_short_mask_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n - 1  # one short: the last element is never stored
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def test_mask_one_short_points_at_the_bound():
    verdict = check_add(add_short_mask_kernel)
    assert_not_solved(verdict, "1 of 1000 elements never written (still NaN) — the last 1 element (from index (999,))",
                      "is the mask's bound or the grid too small?")
    assert "does the kernel store" not in verdict.message


def test_result_that_ignores_an_input_is_wrong_values():
    verdict = check_add(add_ignores_y_kernel)
    assert_not_solved(verdict, "wrong values in ", "of 1000 elements; worst at index (")
    assert "never written" not in verdict.message


def test_nan_output_is_reported_as_nan_not_as_unwritten():
    verdict = check_add(add_nan_kernel)
    assert_not_solved(verdict, "NaN/inf where the reference is finite in 1000 of 1000 elements; first at index (0,)")
    assert "never written" not in verdict.message


# ----------------------------------------------------------------------------------------------
# A 2-D kernel with strides: a row-scaled copy


@triton.jit
def row_scale_kernel(x_ptr, scale_ptr, out_ptr, n_cols, stride_row, stride_col, BLOCK: tl.constexpr):
    row = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK)
    in_bounds = cols < n_cols
    x = tl.load(x_ptr + row * stride_row + cols * stride_col, mask=in_bounds)
    scale = tl.load(scale_ptr + row)
    tl.store(out_ptr + row * n_cols + cols, x * scale, mask=in_bounds)


@triton.jit
def row_scale_contiguous_only_kernel(x_ptr, scale_ptr, out_ptr, n_cols, stride_row, stride_col, BLOCK: tl.constexpr):
    row = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK)
    in_bounds = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=in_bounds)  # ignores the strides
    scale = tl.load(scale_ptr + row)
    tl.store(out_ptr + row * n_cols + cols, x * scale, mask=in_bounds)


def row_scale_launcher(kernel):
    def launch(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
        n_rows, n_cols = x.shape
        kernel[(n_rows,)](x, scale, out, n_cols, x.stride(0), x.stride(1), BLOCK=triton.next_power_of_2(n_cols))

    return launch


def row_scale_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale[:, None]


def row_scale_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    contiguous = torch.randn(5, 37, generator=gen).to(DEVICE)
    transposed = torch.randn(37, 6, generator=gen).to(DEVICE).t()  # (6, 37), strides (1, 6)
    return [(x, torch.randn(x.shape[0], generator=gen).to(DEVICE)) for x in (contiguous, transposed)]


def test_strided_kernel_is_solved():
    verdict = check("row_scale", row_scale_launcher(row_scale_kernel), row_scale_reference, row_scale_cases, out=True)
    assert verdict.solved, verdict.message


def test_kernel_that_ignores_strides_fails_on_the_transposed_case():
    launch = row_scale_launcher(row_scale_contiguous_only_kernel)
    verdict = check("row_scale", launch, row_scale_reference, row_scale_cases, out=True)
    assert_not_solved(verdict, "case 2 of 2: x: (6, 37) float32 strides (1, 6)", "wrong values in ")
    assert "worst at index (" in verdict.message and "of 222 elements" in verdict.message


# ----------------------------------------------------------------------------------------------
# Results returned (out=False): shapes, dtypes, exceptions, Python values


def test_wrong_shape():
    verdict = check("add", lambda x, y: (x + y)[:-1], torch.add, add_cases)
    assert_not_solved(verdict, "wrong shape: got (999,), expected (1000,)")


def test_wrong_dtype():
    verdict = check("add", lambda x, y: (x + y).double(), torch.add, add_cases)
    assert_not_solved(verdict, "wrong dtype: got torch.float64, expected torch.float32")


def test_forgotten_return():
    def add(x, y):
        x + y  # noqa: B018  (the mistake under test)

    assert_not_solved(check("add", add, torch.add, add_cases), "returned None, expected a tensor")


def test_other_exceptions_become_a_verdict():
    def add(x, y):
        return x + y.reshape(7, -1)

    verdict = check("add", add, torch.add, add_cases)
    assert_not_solved(verdict, "raised RuntimeError (line ", "of add): shape '[7, -1]' is invalid")


def test_plain_python_function_with_the_wrong_number():
    def programs_needed(n: int, block: int) -> int:
        return n // block  # forgets the partial last block

    verdict = check("grid", programs_needed, lambda n, block: -(-n // block), [(1024, 256), (1000, 256)])
    assert_not_solved(verdict, "case 2 of 2: n=1000; block=256", "wrong value: got 3, expected 4")


def test_plain_python_values_solved_and_compared_structurally():
    assert check("t", lambda n: (n, n / 3, [n * 2]), lambda n: (n, n / 3, [n * 2]), [(4,), (5,)]).solved
    verdict = check("t", lambda n: (n, n / 3, [n * 2]), lambda n: (n, n / 3, [n * 2 + 1]), [(4,)])
    assert_not_solved(verdict, "[2][0]: wrong value: got 8, expected 9")
    assert check("f", lambda: 0.1 + 0.2, lambda: 0.3, [()]).solved  # floats within 1e-6 relative
    assert_not_solved(check("f", lambda: 0.31, lambda: 0.3, [()]), "wrong value: got 0.31, expected 0.3")


def test_integer_tensor_output_unwritten_and_wrong():
    def reference(x):
        return x * 2

    cases = [(torch.arange(10, dtype=torch.int32),)]
    assert check("i", lambda x, out: out.copy_(x * 2), reference, cases, out=True).solved
    assert_not_solved(
        check("i", lambda x, out: None, reference, cases, out=True), "10 of 10 elements never written (still the poison"
    )
    assert_not_solved(
        check("i", lambda x, out: out.copy_(x * 3), reference, cases, out=True),
        "wrong values in 9 of 10 elements; worst at index (9,): got 27, expected 18",
    )


def test_tuple_of_outputs_gets_one_out_each():
    def reference(x):
        return x + 1, x * 2

    def candidate(x, plus_one, doubled):
        plus_one.copy_(x + 1)
        doubled.copy_(x * 2)

    cases = [(torch.randn(50),)]
    assert check("pair", candidate, reference, cases, out=True).solved
    verdict = check("pair", lambda x, a, b: a.copy_(x + 1), reference, cases, out=True)
    # A tuple of outputs is diagnosed by the output arguments' names, not by position.
    assert_not_solved(verdict, "b: 50 of 50 elements never written", "a: (50,) float32; b: (50,) float32")


# ----------------------------------------------------------------------------------------------
# Numerics: float64 reference, tolerances by dtype


def test_reference_runs_in_float64_and_is_rounded_to_the_output_dtype():
    seen = []

    def reference(x):
        seen.append(x.dtype)
        return x.sum()

    # A float32 sum of 10^4 numbers is not the float64 sum rounded, but within the fp32 tolerance.
    cases = [(torch.randn(10_000, generator=torch.Generator().manual_seed(0)),)]
    verdict = check("sum", lambda x: x.sum(), reference, cases)
    assert verdict.solved, verdict.message
    assert seen == [torch.float64]


def test_reference_that_rejects_float64_runs_in_the_inputs_dtype():
    def float32_only(x):
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return x * 2

    assert check("f32", lambda x: x * 2, float32_only, [(torch.randn(10),)]).solved


@pytest.mark.parametrize(
    ("dtype", "relative_error", "solved"),
    [
        (torch.float32, 1e-7, True),
        (torch.float32, 1e-3, False),
        (torch.float16, 5e-4, True),
        (torch.float16, 1e-2, False),
        (torch.bfloat16, 4e-3, True),
        (torch.bfloat16, 5e-2, False),
    ],
)
def test_tolerance_follows_the_dtype(dtype, relative_error, solved):
    x = (torch.rand(200, generator=torch.Generator().manual_seed(1)) + 1).to(dtype)  # in [1, 2): no atol effects

    def candidate(x):
        return (x.double() * (1 + relative_error)).to(dtype)

    verdict = check("tol", candidate, lambda x: x, [(x,)])
    assert verdict.solved == solved, verdict.message


def test_default_tolerances():
    assert default_tolerance(torch.float32) == (1e-5, 1e-6)
    assert default_tolerance(torch.float16) == (1e-3, 1e-3)
    assert default_tolerance(torch.bfloat16) == (1e-2, 1e-2)
    assert default_tolerance(torch.int64) == (0.0, 0.0)


def test_explicit_tolerance_overrides_the_default():
    x = torch.ones(10)
    assert not check("tol", lambda x: x * 1.001, lambda x: x, [(x,)]).solved
    assert check("tol", lambda x: x * 1.001, lambda x: x, [(x,)], rtol=1e-2).solved


def test_matching_nan_and_inf_in_the_reference_are_accepted():
    x = torch.tensor([1.0, float("inf"), float("nan"), -float("inf")])
    assert check("same", lambda x: x.clone(), lambda x: x, [(x,)]).solved
    verdict = check("inf", lambda x: torch.zeros_like(x), lambda x: x, [(x,)])
    assert_not_solved(verdict, "wrong values in 4 of 4 elements")


# ----------------------------------------------------------------------------------------------
# Cases, seeds, custom comparisons, misuse


def test_fresh_inputs_each_run_and_seed_reproduces_them():
    drawn = []

    def record(x):
        drawn.append(x.clone())
        return x + 1  # wrong on purpose

    def cases(gen):
        return [(torch.randn(8, generator=gen),)]

    first = check("seed", record, lambda x: x, cases)
    second = check("seed", record, lambda x: x, cases)
    assert not torch.equal(drawn[0], drawn[1])  # fresh every run
    seed = int(first.message.split("seed=")[1].split(")")[0])
    assert f"check(..., seed={seed}) reproduces them" in first.message
    check("seed", record, lambda x: x, cases, seed=seed)
    assert torch.equal(drawn[2], drawn[0])
    assert second.message != first.message  # different seed printed


def test_candidate_gets_copies_with_the_same_strides():
    x = torch.randn(8, 6).t()
    seen = {}

    def candidate(x):
        seen["stride"], seen["contiguous"] = x.stride(), x.is_contiguous()
        return x * 1

    assert check("strides", candidate, lambda x: x * 1, [(x,)]).solved
    assert seen == {"stride": (1, 6), "contiguous": False}


def test_custom_compare():
    cases = [(torch.randn(10),)]

    def same_sorted(got, expected):
        return None if torch.equal(got.sort().values, expected.sort().values) else "different elements"

    assert check("perm", lambda x: x.flip(0), lambda x: x, cases, compare=same_sorted).solved
    assert_not_solved(check("perm", lambda x: x + 1, lambda x: x, cases, compare=same_sorted), "different elements")


def test_checker_raises_only_for_its_own_misuse():
    with pytest.raises(ValueError, match="no cases"):
        check("empty", lambda: 1, lambda: 1, [])
    with pytest.raises(TypeError, match="out=True"):
        check("scalar", lambda n, out: None, lambda n: n, [(3,)], out=True)


def test_verdict_object():
    verdict = check("v", lambda: 2, lambda: 2, [()])
    assert isinstance(verdict, Verdict) and verdict.name == "v" and str(verdict) == verdict.message
    assert verdict.message == "✅ SOLVED — v: the case matches the reference"
    assert verdict._ipython_display_() is None  # a notebook shows the printed block only


# ----------------------------------------------------------------------------------------------
# exercise(): learner mode and solution mode


@pytest.fixture
def fake_solutions(monkeypatch):
    """A solutions.ch99_fake module with one kernel and one function."""
    module = types.ModuleType("solutions.ch99_fake")
    module.add_kernel = add_kernel
    module.programs_needed = lambda n, block: -(-n // block)
    monkeypatch.setitem(sys.modules, "solutions.ch99_fake", module)
    return module


def test_learner_mode_returns_the_stub_unchanged(monkeypatch, fake_solutions):
    monkeypatch.delenv(exercises.SOLUTIONS_ENV, raising=False)
    assert not solution_mode()

    @triton.jit
    def stub(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pass

    assert exercise("ch99_fake.add_kernel")(stub) is stub
    assert not check_add(stub).solved

    def plain(n, block):
        raise NotImplementedError

    assert exercise("ch99_fake.programs_needed")(plain) is plain
    monkeypatch.setenv(exercises.SOLUTIONS_ENV, "0")
    assert exercise("ch99_fake.programs_needed")(plain) is plain


def test_solution_mode_returns_the_solution(monkeypatch, fake_solutions):
    marker = exercise("ch99_fake.add_kernel")
    monkeypatch.setenv(exercises.SOLUTIONS_ENV, "1")  # read when the decorator is applied
    assert solution_mode()

    @marker
    @triton.jit
    def stub(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pass

    assert stub is add_kernel
    assert check_add(stub).solved

    @exercise("ch99_fake.programs_needed")
    def plain(n, block):
        raise NotImplementedError

    assert plain is fake_solutions.programs_needed and plain(1000, 256) == 4


def test_solution_mode_with_a_missing_solution_is_a_clear_error(monkeypatch, fake_solutions):
    monkeypatch.setenv(exercises.SOLUTIONS_ENV, "1")
    with pytest.raises(MissingSolutionError, match=r"solutions/ch99_fake.py has no 'nope'"):
        exercise("ch99_fake.nope")(lambda: None)
    with pytest.raises(MissingSolutionError, match=r"needs solutions/ch99_absent.py, which does not exist"):
        exercise("ch99_absent.add_kernel")(lambda: None)


def test_malformed_exercise_name():
    with pytest.raises(ValueError, match="<module in solutions>.<attribute>"):
        exercise("add_kernel")
