"""The exercise checker's verdicts on right and wrong code, and the stub/solution switch.

Every wrong variant here is a mistake a learner makes — a stub, a missing mask, an off-by-one
offset, an ignored input, NaNs, a wrong shape, a wrong number — and each must come back NOT
SOLVED with the diagnosis that points at it, without the checker raising. Sizes are not
multiples of BLOCK so that masks matter; grids stay at a few programs (the interpreter costs
about a millisecond per program).
"""

from __future__ import annotations

import contextlib
import random
import sys
import types

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from utils import exercises
from utils.exercises import MissingSolutionError, Verdict, check, default_tolerance, exercise, solution_mode

# The checker's out-of-bounds diagnoses and the traced references need the interpreter.
pytestmark = pytest.mark.interpreter

DEVICE = kernel_ladder.runtime.DEVICE
BLOCK = 1024
SIZES = (1000, 2500)  # not multiples of BLOCK: the last program is partly masked
interpreter_only = pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER,
                                      reason="the tracer sees interpreted kernels")


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


def flat(text: str) -> str:
    """The text with its line wrapping undone (verdicts are wrapped at 100 characters)."""
    return " ".join(text.split())


def assert_not_solved(verdict: Verdict, *fragments: str) -> None:
    assert not verdict.solved and not bool(verdict)
    assert first_line(verdict) == f"❌ NOT SOLVED — {verdict.name}"
    assert all(len(line) <= 100 for line in verdict.message.splitlines()), verdict.message
    for fragment in fragments:
        assert flat(fragment) in flat(verdict.message), f"{fragment!r} not in:\n{verdict.message}"


def assert_not_in(verdict: Verdict, *fragments: str) -> None:
    for fragment in fragments:
        assert flat(fragment) not in flat(verdict.message), f"{fragment!r} should not be in:\n{verdict.message}"


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
    if kernel_ladder.runtime.INTERPRETER:
        assert_not_solved(verdict, "no program's store reached index 0: the offsets skip it")
        assert_not_in(verdict, "grid", "mask")


@triton.jit
def add_short_mask_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n - 1  # one short: the last element is never stored
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@interpreter_only
def test_mask_one_short_points_at_the_bound():
    verdict = check_add(add_short_mask_kernel)
    assert_not_solved(verdict, "1 of 1000 elements never written (still NaN) — the last 1 element (from index (999,))",
                      "the store to index 999 was masked off (by program 0): is the mask's bound too tight?")
    assert_not_in(verdict, "does the kernel store", "grid", "offset")  # one program, BLOCK > n: not the grid


def test_without_the_tracer_the_checker_says_where_not_why(no_tracer):
    verdict = check_add(add_short_mask_kernel)
    assert_not_solved(verdict, "1 of 1000 elements never written (still NaN) — the last 1 element (from index (999,))")
    assert_not_in(verdict, "mask", "grid", "program")


def test_result_that_ignores_an_input_is_wrong_values():
    verdict = check_add(add_ignores_y_kernel)
    assert_not_solved(verdict, "wrong values in ", "of 1000 elements; worst at index (")
    assert "never written" not in verdict.message
    # Every element stored once by its own program, every one wrong: no cause, no place to name.
    assert_not_in(verdict, "grid", "mask", "program", "where:")


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
# Where a wrong output comes from: planted bugs, each diagnosed from the tracer's store maps.
# Every hint must name the cause the evidence shows, and not the causes it does not.

MAPPING = "the pid → offset mapping"


@triton.jit
def add_without_pid_offset_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)  # forgot pid * BLOCK: every program does the first block
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + tl.load(y_ptr + offsets, mask=in_bounds), mask=in_bounds)


@triton.jit
def add_pid_mod_2_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = (tl.program_id(0) % 2) * BLOCK + tl.arange(0, BLOCK)  # blocks 0, 1, 0, 1, ...
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + tl.load(y_ptr + offsets, mask=in_bounds), mask=in_bounds)


@triton.jit
def add_tail_load_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    y = tl.load(y_ptr + offsets, mask=offsets < (n // BLOCK) * BLOCK, other=0.0)  # drops y in the tail
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=in_bounds) + y, mask=in_bounds)


@triton.jit
def add_tail_store_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + y, mask=offsets < (n // BLOCK) * BLOCK)  # full blocks only


@triton.jit
def add_first_lanes_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    y = tl.load(y_ptr + offsets, mask=in_bounds & (tl.arange(0, BLOCK) >= 4), other=0.0)  # lanes 0..3 lose y
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=in_bounds) + y, mask=in_bounds)


def sized_cases(*sizes: int):
    def cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randn(n, generator=gen).to(DEVICE), torch.randn(n, generator=gen).to(DEVICE)) for n in sizes]

    return cases


def check_planted(kernel, sizes=SIZES, programs=None) -> Verdict:
    def launch(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        kernel[(programs(n) if programs else triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)

    return check("ch99_test.add_kernel", launch, torch.add, sized_cases(*sizes), out=True)


@interpreter_only
def test_offsets_without_pid_are_the_offset_mapping_not_the_grid():
    verdict = check_planted(add_without_pid_offset_kernel)  # n = 1000 passes (one program); n = 2500 does not
    assert_not_solved(
        verdict,
        "case 2 of 2",
        "every program (3) stored to the same elements, indices 0..1023: the offsets do not depend on the program id "
        "(is pid * BLOCK missing from them?)",
        "no program stored to indices 1024..2499",
        "where: the first block (indices 0..1023) is right, every later block is wrong",
    )
    assert_not_in(verdict, "grid", "mask")


@interpreter_only
def test_blocks_by_pid_mod_2_overlap_and_leave_their_own_blocks():
    verdict = check_planted(add_pid_mod_2_kernel, sizes=(3500,))  # 4 programs: blocks 0, 1, 0, 1
    assert_not_solved(
        verdict,
        f"programs 0 and 2 both stored to index 0 (2048 elements stored by more than one program): {MAPPING} "
        "sends two programs to the same elements",
        "program 2 stored to indices 0..1023, outside its own block 2048..3071 (BLOCK = 1024): its offsets do not "
        "start at pid * BLOCK",
        "no program stored to indices 2048..3499",
    )
    assert_not_in(verdict, "grid", "mask", "every program")


@interpreter_only
def test_a_grid_one_program_short_is_the_grid():
    verdict = check_planted(add_kernel, sizes=(2500,), programs=lambda n: triton.cdiv(n, BLOCK) - 1)
    assert_not_solved(
        verdict,
        "452 of 2500 elements never written (still NaN) — the last 452 elements (from index (2048,))",
        "the grid is too small: 2 programs × 1024 lanes reach at most 2048 of the 2500 elements; no store reached "
        "indices 2048..2499",
    )
    assert_not_in(verdict, "mask", MAPPING, "where:")


@interpreter_only
def test_a_mask_one_short_in_the_last_of_several_blocks_is_the_mask():
    verdict = check_planted(add_short_mask_kernel, sizes=(2500,))
    assert_not_solved(verdict, "the store to index 2499 was masked off (by program 2): is the mask's bound too tight?",
                      "where: wrong only in the padded tail, the last partial block (indices 2048..2499)")
    assert_not_in(verdict, "grid", MAPPING)


@interpreter_only
def test_a_wrong_padded_tail_is_the_mask_there():
    verdict = check_planted(add_tail_load_kernel, sizes=(2500,))
    assert_not_solved(
        verdict,
        "wrong values in ",
        "where: wrong only in the padded tail, the last partial block (indices 2048..2499); every full block is "
        "right — only there is the mask partly off: check it and the loads' `other=`",
    )
    assert_not_in(verdict, "grid", MAPPING, "never written", "stored")
    stored = check_planted(add_tail_store_kernel, sizes=(2500,))  # the tail's store masked off instead
    assert_not_solved(
        stored,
        "452 of 2500 elements never written",
        "the store to indices 2048..2499 was masked off (by program 2): is the mask's bound too tight?",
        "where: wrong only in the padded tail",
    )
    assert_not_in(stored, "grid", MAPPING)


@interpreter_only
def test_the_same_lanes_wrong_in_every_block_are_periodic_by_block():
    verdict = check_planted(add_first_lanes_kernel, sizes=(2500,))
    assert_not_solved(
        verdict,
        "wrong values in 12 of 2500 elements",
        "where: the same lanes of every block of 1024 (BLOCK) are wrong: lanes 0..3 — periodic with period BLOCK; "
        "the other lanes are right",
    )
    assert_not_in(verdict, "grid", "mask", MAPPING, "padded tail", "first block")
    one_block = check_planted(add_first_lanes_kernel, sizes=(1000,))  # one block: no period to see
    assert_not_solved(one_block, "where: first wrong at index 0; wrong: indices 0..3, right elsewhere")
    assert_not_in(one_block, "periodic", "grid", "mask")


# A 2-D tiled kernel (a scaled copy, so that only the tiling is under test): one program per
# 32 x 32 tile, row-major tile order, as chapter 04's matmul.
TILED_CORRECT, TILED_PID_DIV_GRID_M, TILED_TILE_SWAPPED = 0, 1, 2


@triton.jit
def tiled_double_kernel(x_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    if BUG == 1:
        pid_m = pid // grid_m  # should be pid // grid_n
    else:
        pid_m = pid // grid_n
    pid_n = pid % grid_n
    if BUG == 2:
        pid_m, pid_n = pid_n, pid_m  # the tile's row and column index swapped
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    tl.store(out_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=in_bounds), mask=in_bounds)


def check_tiled(bug: int) -> Verdict:
    def launch(x: torch.Tensor, out: torch.Tensor) -> None:
        M, N = x.shape
        grid = (triton.cdiv(M, 32) * triton.cdiv(N, 32),)  # (70, 50): 3 x 2 tiles, 6 programs
        tiled_double_kernel[grid](x, out, M, N, BLOCK_M=32, BLOCK_N=32, BUG=bug)

    def cases(gen: torch.Generator) -> list[tuple[torch.Tensor]]:
        return [(torch.randn(70, 50, generator=gen).to(DEVICE),)]

    return check("ch99_test.tiled", launch, lambda x: 2 * x, cases, out=True)


def test_tiled_kernel_is_solved():
    verdict = check_tiled(TILED_CORRECT)
    assert verdict.solved, verdict.message


@interpreter_only
def test_tile_index_from_the_wrong_grid_size_is_the_offset_mapping():
    verdict = check_tiled(TILED_PID_DIV_GRID_M)  # tiles (0,0) (0,1) (0,0) (1,1) (1,0) (1,1)
    assert_not_solved(
        verdict,
        "300 of 3500 elements never written",
        f"programs 0 and 2 both stored to index (0, 0) (1600 elements stored by more than one program): {MAPPING} "
        "sends two programs to the same elements",
        "no program stored to rows 64..69 (every column)",
    )
    assert_not_in(verdict, "grid is too small", "mask", "where:")  # the rows are named once


@interpreter_only
def test_tile_rows_and_columns_swapped_leave_programs_idle():
    verdict = check_tiled(TILED_TILE_SWAPPED)  # programs 4 and 5 get tile column 2, past N
    assert_not_solved(
        verdict,
        "programs 4 and 5 stored nothing here (every lane masked off) while rows 64..69 (every column) were never "
        "stored: the pid → tile mapping leaves part of the output to no program",
    )
    assert_not_in(verdict, "grid is too small", "mask's bound", "where:")


@interpreter_only
def test_store_maps_record_who_stored_each_element():
    from utils.trace import trace

    x, out = torch.randn(2500), torch.empty(2500)
    with trace(record_writes=True, torch_ops=False) as traced:
        add_pid_mod_2_kernel[(3,)](x, x, out, 2500, BLOCK=BLOCK)
    stores = traced.launches[0].store_maps
    assert set(stores) == {"out_ptr"}  # the tensors stored to, not the inputs
    stored = stores["out_ptr"]
    assert stored.lanes == BLOCK and stored.data_ptr == out.data_ptr()
    assert stored.programs == {0: (0, 1023, 1024), 1: (1024, 2047, 1024), 2: (0, 1023, 1024)}
    assert (stored.first[:1024] == 0).all() and (stored.last[:1024] == 2).all()
    assert (stored.first[1024:2048] == 1).all() and (stored.last[2048:] == -1).all()
    assert (stored.masked == -1).all()  # every masked-off lane pointed past the end
    with trace(record_writes=True, torch_ops=False) as traced:
        add_short_mask_kernel[(1,)](x[:1000], x[:1000], out[:1000], 1000, BLOCK=BLOCK)
    short = traced.launches[0].store_maps["out_ptr"]
    assert short.masked[999] == 0 and (short.masked[:999] == -1).all() and short.last[999] == -1


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


# ----------------------------------------------------------------------------------------------
# An exercise that builds on another: the other one's stub is named, not this exercise


@pytest.fixture
def learner_registry(monkeypatch):
    """Learner mode with an empty registry of stubs and verdicts (restored afterwards)."""
    monkeypatch.delenv(exercises.SOLUTIONS_ENV, raising=False)
    monkeypatch.setattr(exercises, "_STUBS", {})
    monkeypatch.setattr(exercises, "_LAST_VERDICTS", {})


def test_a_stub_raised_in_an_earlier_exercise_is_named(learner_registry):
    @exercise("ch99_fake.programs_needed")
    def programs_needed(n: int, block: int) -> int:
        raise NotImplementedError

    @exercise("ch99_fake.grid_for")
    def grid_for(n: int) -> tuple[int]:
        return (programs_needed(n, 256),)

    verdict = check("ch99_fake.grid_for", grid_for, lambda n: (-(-n // 256),), [(1000,)])
    assert_not_solved(
        verdict,
        "not implemented yet: this check runs programs_needed (exercise ch99_fake.programs_needed), which is still "
        "a stub (it raised NotImplementedError): solve that exercise first",
    )
    assert_not_in(verdict, "the stub raised")
    # Its own stub raising is still "the stub", as before.
    assert_not_solved(check("ch99_fake.programs_needed", programs_needed, lambda n, b: -(-n // b), [(1000, 256)]),
                      "not implemented yet (the stub raised NotImplementedError)")


def test_a_helper_that_is_not_an_exercise_is_named(learner_registry):
    def tile_count(n: int) -> int:
        raise NotImplementedError  # a helper the learner has yet to write

    @exercise("ch99_fake.grid_for")
    def grid_for(n: int) -> tuple[int]:
        return (tile_count(n),)

    verdict = check("ch99_fake.grid_for", grid_for, lambda n: (4,), [(1000,)])
    assert_not_solved(verdict, "not implemented yet: tile_count (line ",
                      "raised NotImplementedError — a function this check runs, not the exercise ch99_fake.grid_for")


@interpreter_only
def test_a_jit_helper_stub_called_from_a_given_kernel_is_the_exercise_itself(learner_registry, monkeypatch):
    # The exercise is a @triton.jit helper; the check launches a given kernel that calls it. The
    # interpreter runs a rewritten copy of the helper (its first line the def, not the decorators).
    @exercise("ch99_fake.offset_of")
    @triton.jit
    def offset_of(pid, BLOCK: tl.constexpr):
        raise NotImplementedError

    @triton.jit
    def copy_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offsets = offset_of(tl.program_id(0), BLOCK) + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))

    monkeypatch.setitem(copy_kernel.fn.__globals__, "offset_of", offset_of)  # as a notebook's global

    def copy(x: torch.Tensor, out: torch.Tensor) -> None:
        copy_kernel[(x.numel() // 16,)](x, out, BLOCK=16)

    cases = [(torch.randn(64, device=DEVICE),)]
    verdict = check("ch99_fake.offset_of", copy, lambda x: x.clone(), cases, out=True)
    assert_not_solved(verdict, "not implemented yet (the stub raised NotImplementedError)")
    assert_not_in(verdict, "a function this check runs")


@interpreter_only
def test_an_unsolved_earlier_kernel_this_check_launches_is_named(learner_registry):
    @exercise("ch99_fake.add_kernel")
    @triton.jit
    def add_stub(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pass

    def add_twice(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:  # an exercise built on add
        launcher(add_stub)(x, y, out)
        out.mul_(2)

    assert not check("ch99_fake.add_kernel", launcher(add_stub), torch.add, add_cases, out=True).solved
    verdict = check("ch99_fake.add_twice", add_twice, lambda x, y: 2 * (x + y), add_cases, out=True)
    assert_not_solved(verdict, "this check launches add_stub (exercise ch99_fake.add_kernel), whose own check is NOT "
                               "SOLVED yet: solve that exercise first")
    # Once add's check is solved (the learner fixed it), add_twice's failure is its own.
    exercises._LAST_VERDICTS["ch99_fake.add_kernel"] = True
    assert_not_in(check("ch99_fake.add_twice", add_twice, lambda x, y: 2 * (x + y), add_cases, out=True),
                  "ch99_fake.add_kernel")


def test_an_unsolved_earlier_function_this_check_uses_is_named(learner_registry):
    @exercise("ch99_fake.double")
    def double(x: int) -> int:
        return x  # wrong: the learner is not done

    @exercise("ch99_fake.quadruple")
    def quadruple(x: int) -> int:
        return double(double(x))

    assert not check("ch99_fake.double", double, lambda x: 2 * x, [(3,)]).solved
    verdict = check("ch99_fake.quadruple", quadruple, lambda x: 4 * x, [(3,)])
    assert_not_solved(verdict, "this check's code uses double (exercise ch99_fake.double), whose own check is NOT "
                               "SOLVED yet", "wrong value: got 3, expected 12")
    never_checked = check("ch99_fake.other", lambda x: x, lambda x: 4 * x, [(3,)])  # does not use double
    assert_not_in(never_checked, "ch99_fake.double")


# ----------------------------------------------------------------------------------------------
# Printed width and reproducible verdicts


def test_every_printed_line_fits_in_100_characters(capsys):
    def fails_loudly(x):
        raise ValueError("a message long enough to need wrapping: " + "word " * 40)

    long_name = "ch99_a_chapter_with_a_long_name.an_exercise_with_a_rather_long_name_too"
    verdict = check(long_name, fails_loudly, lambda x: x, [(torch.randn(3),)])
    printed = capsys.readouterr().out
    assert printed == verdict.message + "\n"
    assert all(len(line) <= 100 for line in printed.splitlines()), printed
    assert all(line.startswith("   ") for line in printed.splitlines()[1:])  # the block stays one indented block
    assert flat("word " * 40) in flat(printed)
    solved = check(long_name + "_and_then_some_more", lambda: 1, lambda: 1, [()]).message
    assert all(len(line) <= 100 for line in solved.splitlines())


def test_check_seed_from_the_environment_makes_a_not_solved_verdict_reproducible(monkeypatch):
    def cases(gen):
        return [(torch.randn(4, generator=gen),)]

    def run(name):
        return check(name, lambda x: x + 1, lambda x: x, cases).message

    monkeypatch.setenv(exercises.CHECK_SEED_ENV, "0")
    first, again, other = run("seeded"), run("seeded"), run("seeded too")
    assert first == again and "(random inputs; check(..., seed=" in first
    assert first.split("seed=")[1] != other.split("seed=")[1]  # each check its own seed
    monkeypatch.delenv(exercises.CHECK_SEED_ENV)
    assert "(fresh random inputs; check(..., seed=" in run("seeded") and run("seeded") != run("seeded")


def test_a_check_leaves_the_global_random_generators_as_it_found_them():
    # A reference that draws from the global generators (as a traced measurement may) would
    # otherwise consume more of them when every case runs (solved) than when the first fails
    # (learner mode), and a later cell's "random" inputs would depend on the learner's code.
    # numpy's legacy global generator is under test here, hence the noqa: NPY002 below.
    def reseed() -> None:
        torch.manual_seed(0)
        np.random.seed(0)  # noqa: NPY002
        random.seed(0)

    def draws() -> tuple[float, float, float]:
        return torch.rand(1).item(), float(np.random.rand()), random.random()  # noqa: NPY002

    def measured(n: int) -> int:
        draws()
        return torch.randn(n).numel()

    after = {}
    for label, candidate in (("solved", lambda n: n), ("not solved", lambda n: n + 1)):
        reseed()
        assert check("rng", candidate, measured, [(3,), (4,), (5,)]).solved == (label == "solved")
        after[label] = draws()
    reseed()
    assert after["solved"] == after["not solved"] == draws()


# ----------------------------------------------------------------------------------------------
# Two stores per program (RoPE): the grid's reach counts every store


@triton.jit
def rope_like_kernel(x_ptr, out_ptr, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BUG: tl.constexpr):
    # One program per token: an (H, 2 * HALF) tile stored as two halves, as chapter 06's RoPE kernel.
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    mask = (heads < n_heads)[:, None]
    rows = (token * n_heads + heads) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :], mask=mask)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None] + j[None, :], 2 * x1, mask=mask)
    if BUG == 1:
        second = rows[:, None] + j[None, :]  # the second half's offset forgets + HALF
    elif BUG == 2:
        second = rows[:, None] + HALF + 1 + j[None, :]  # one past: runs into the next row's first half
    else:
        second = rows[:, None] + HALF + j[None, :]
    tl.store(out_ptr + second, 3 * x2, mask=mask)


def check_rope_like(bug: int, tokens: int = 10, programs: int | None = None) -> Verdict:
    def launch(x: torch.Tensor, out: torch.Tensor) -> None:
        n_tokens, n_heads, head_dim = x.shape
        rope_like_kernel[(programs or n_tokens,)](x, out, n_heads, HALF=head_dim // 2, BLOCK_H=4, BUG=bug)

    def reference(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((2 * x[..., :half], 3 * x[..., half:]), dim=-1)

    def cases(gen: torch.Generator) -> list[tuple[torch.Tensor]]:
        return [(torch.randn(tokens, 3, 32, generator=gen).to(DEVICE),)]  # 960 elements; 64 lanes per store

    return check("ch99_test.rope_like", launch, reference, cases, out=True)


def rope_line(bug: int, which: str) -> int:
    """The source line of the kernel's first or second ``tl.store`` (the verdict names them by line)."""
    import inspect

    lines, start = inspect.getsourcelines(rope_like_kernel.fn)
    stores = [start + i for i, line in enumerate(lines) if "tl.store(" in line]
    return stores[0] if which == "first" else stores[1]


def test_a_kernel_storing_twice_per_program_is_solved():
    assert check_rope_like(0).solved


@interpreter_only
def test_a_wrong_second_store_offset_names_that_store_not_the_grid():
    verdict = check_rope_like(1)
    first, second = rope_line(1, "first"), rope_line(1, "second")
    assert_not_solved(
        verdict,
        "480 of 960 elements never written",
        f"the store at line {second} of rope_like_kernel wrote over what the store at line {first} of "
        "rope_like_kernel of the same program had stored (480 elements; first at index (0, 0, 0), program 0): "
        f"check the offsets of the store at line {second} of rope_like_kernel",
        "no program stored to columns 16..31 (every row)",
    )
    assert_not_in(verdict, "grid", "mask")


@interpreter_only
def test_a_second_store_one_past_names_both_stores_that_met():
    verdict = check_rope_like(2)
    first, second = rope_line(2, "first"), rope_line(2, "second")
    assert_not_solved(
        verdict,
        f"programs 0 and 1 both stored to index (1, 0, 0) (9 elements stored by more than one program) — program 0's "
        f"store at line {second} of rope_like_kernel and program 1's store at line {first} of rope_like_kernel",
        f"the store at line {second} of rope_like_kernel wrote over what the store at line {first}",
        "no program stored to",
    )
    assert_not_in(verdict, "grid is too small")


@interpreter_only
def test_a_grid_too_small_for_two_stores_per_program_is_still_the_grid():
    verdict = check_rope_like(0, programs=7)  # 7 programs × 2 stores × 64 lanes reach 896 < 960
    assert_not_solved(
        verdict,
        "the grid is too small: 7 programs with all their stores' lanes reach at most 896 of the 960 elements",
    )


# ----------------------------------------------------------------------------------------------
# Stated rules: forbids, no_python_loops, holds


def sort_cases(gen: torch.Generator) -> list[tuple[torch.Tensor]]:
    return [(torch.randint(0, 5, (40,), generator=gen),), (torch.randint(0, 3, (100,), generator=gen),)]


def stable_order(keys: torch.Tensor) -> torch.Tensor:
    return torch.argsort(keys, stable=True)


def counting_sort(keys: torch.Tensor) -> torch.Tensor:
    """Stable order by counts: tensor ops, no sort."""
    n_keys = int(keys.max()) + 1
    one_hot = torch.nn.functional.one_hot(keys, n_keys)
    rank_within = (one_hot.cumsum(0) - one_hot)[torch.arange(len(keys)), keys]
    starts = torch.cumsum(torch.bincount(keys, minlength=n_keys), 0) - torch.bincount(keys, minlength=n_keys)
    order = torch.empty_like(keys)
    order[starts[keys] + rank_within] = torch.arange(len(keys))
    return order


NO_SORT = "the spec asks for a counting sort"


def no_sort_rule():
    return exercises.rules.forbids("torch.argsort", "torch.sort", "Tensor.index_add_", why=NO_SORT)


def test_forbids_passes_code_that_keeps_the_rule():
    verdict = check("sorting", counting_sort, stable_order, sort_cases, rules=[no_sort_rule()])
    assert verdict.solved, verdict.message
    assert "rules kept: forbids torch.argsort, torch.sort, Tensor.index_add_" in flat(verdict.message)


def test_forbids_names_the_forbidden_call():
    verdict = check("sorting", stable_order, stable_order, sort_cases, rules=[no_sort_rule()])
    assert_not_solved(verdict, f"broke a stated rule — {NO_SORT}: the code called torch.argsort", "case 1 of 2")


def test_forbids_sees_the_method_form_and_calls_from_helpers():
    def helper(keys):
        return keys.sort(stable=True).indices

    verdict = check("sorting", lambda keys: helper(keys), stable_order, sort_cases, rules=[no_sort_rule()])
    assert_not_solved(verdict, f"broke a stated rule — {NO_SORT}: the code called Tensor.sort")

    def with_index_add(keys):
        counts = torch.zeros(int(keys.max()) + 1, dtype=torch.long).index_add_(0, keys, torch.ones_like(keys))
        assert int(counts.sum()) == len(keys)
        return counting_sort(keys)

    verdict = check("sorting", with_index_add, stable_order, sort_cases, rules=[no_sort_rule()])
    assert_not_solved(verdict, "the code called Tensor.index_add_")


def test_forbids_rejects_a_name_that_is_not_torch():
    with pytest.raises(ValueError, match="must name a torch function"):
        exercises.rules.forbids("numpy.argsort", why="x")
    with pytest.raises(ValueError, match="torch has no"):
        exercises.rules.forbids("torch.not_a_function", why="x")


def test_forbids_sees_the_aten_op_under_any_spelling():
    """A forbidden op is caught by the aten op that runs, whatever called it: ``torch.ops.aten.sort.stable``
    is ``torch.sort``, and so is ``argsort`` (it runs a sort) when only ``torch.sort`` is named."""
    only_sort = exercises.rules.forbids("torch.sort", why=NO_SORT)
    by_aten = lambda keys: torch.ops.aten.sort.stable(keys, stable=True)[1]
    verdict = check("sorting", by_aten, stable_order, sort_cases, rules=[only_sort])
    assert_not_solved(verdict, f"broke a stated rule — {NO_SORT}: the code ran aten.sort.stable, the op behind "
                               "torch.sort (under another spelling)")
    verdict = check("sorting", stable_order, stable_order, sort_cases, rules=[only_sort])
    assert_not_solved(verdict, "the code ran aten.sort.stable, the op behind torch.sort")
    assert check("sorting", counting_sort, stable_order, sort_cases, rules=[only_sort]).solved


def histogram_cases(gen: torch.Generator) -> list[tuple[torch.Tensor]]:
    return [(torch.randint(0, 6, (50,), generator=gen),)]


def test_forbids_with_a_condition_on_an_argument():
    """``"Tensor.index_put_(accumulate=True)"`` forbids the scatter-add, not the plain indexed write."""
    rule = exercises.rules.forbids("Tensor.index_put_(accumulate=True)", why="no scatter-add")
    reference = lambda keys: torch.bincount(keys, minlength=6)

    def by_index_put(keys):
        return torch.zeros(6, dtype=torch.long).index_put_((keys,), torch.ones_like(keys), accumulate=True)

    def by_plain_index_put(keys):
        counts = torch.bincount(keys, minlength=6)
        out = torch.zeros(6, dtype=torch.long)
        out[torch.arange(6)] = counts  # an index_put_ without accumulate: a gather's inverse, no sum
        return out

    verdict = check("histogram", by_index_put, reference, histogram_cases, rules=[rule])
    assert_not_solved(verdict, "broke a stated rule — no scatter-add: the code ran aten.index_put_.default with "
                               "accumulate=True")
    assert check("histogram", by_plain_index_put, reference, histogram_cases, rules=[rule]).solved
    with pytest.raises(ValueError, match="must be a Python literal"):
        exercises.rules.forbids("Tensor.index_put_(accumulate=yes)", why="x")


def distinct_key_cases(gen: torch.Generator) -> list[tuple[torch.Tensor]]:
    return [(torch.randperm(20, generator=gen),)]


def test_stable_sorts_wants_stable_true_on_every_sort():
    """Keys without ties: an unstable sort returns the right values, and still breaks the rule it was given."""
    rule = exercises.rules.stable_sorts(why="equal keys keep their order")
    unstable = lambda keys: torch.sort(keys).indices
    verdict = check("sorting", unstable, stable_order, distinct_key_cases, rules=[rule])
    assert_not_solved(verdict, "broke a stated rule — equal keys keep their order: a sort ran without stable=True "
                               "(aten.sort.default")
    descending = lambda keys: torch.argsort(-keys, descending=True)
    assert_not_solved(check("sorting", descending, stable_order, distinct_key_cases, rules=[rule]),
                      "(aten.sort.default(dim=-1, descending=True))")
    assert check("sorting", stable_order, stable_order, sort_cases, rules=[rule]).solved


def order_in_numpy(keys):
    return torch.from_numpy(np.argsort(keys.cpu().numpy(), kind="stable"))


def order_by_builtin_sorted(keys):
    return torch.tensor(sorted(range(len(keys)), key=keys.tolist().__getitem__))


def order_by_counting_with_item(keys):
    if keys.numel() == 0 or keys.min().item() < 0:  # a host sync for a check
        raise ValueError("keys")
    return counting_sort(keys)


def test_tensor_ops_only_rules_out_python_data_and_host_round_trips():
    import inspect

    rule = exercises.rules.tensor_ops_only(why=TENSOR_OPS)
    verdict = check("sorting", order_in_numpy, stable_order, sort_cases, rules=[rule])
    assert_not_solved(verdict, f"broke a stated rule — {TENSOR_OPS}: the code took values to the host: .cpu(), "
                               ".numpy()")
    line = inspect.getsourcelines(order_by_builtin_sorted)[1] + 1
    verdict = check("sorting", order_by_builtin_sorted, stable_order, sort_cases, rules=[rule])
    assert_not_solved(verdict, f"a call of the builtin sorted (Python data, not tensor ops) at line {line} of "
                               "order_by_builtin_sorted")
    verdict = check("sorting", order_by_counting_with_item, stable_order, sort_cases, rules=[rule])
    assert_not_solved(verdict, "the code took values to the host: .item()")
    verdict = check("add", add_with_loop, torch.add, small_add_cases, rules=[rule])
    assert_not_solved(verdict, "a Python for loop at line", "of add_with_loop (over range(len(x)))")
    for candidate in (torch.add, lambda x, y: x + y, add_over_a_literal_tuple):
        verdict = check("add", candidate, torch.add, small_add_cases, rules=[rule])
        assert verdict.solved, verdict.message
        assert "rules kept: tensor ops only" in flat(verdict.message)


@triton.jit
def double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TWICE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    if TWICE:  # store x, read it back, store the double: right in the interpreter, unguaranteed on a GPU
        tl.store(out_ptr + offsets, x, mask=mask)
        again = tl.load(out_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, again * 2, mask=mask)
    else:
        tl.store(out_ptr + offsets, x * 2, mask=mask)


def test_stores_each_output_once_names_the_kernel_and_its_two_stores():
    import inspect

    rule = exercises.rules.stores_each_output_once(why="each output stored once")

    def doubled(twice):
        def run(x, out):
            double_kernel[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), BLOCK=64, TWICE=twice)
            return out

        return run

    cases = lambda gen: [(torch.randn(100, generator=gen),)]
    verdict = check("double", doubled(True), lambda x: 2 * x, cases, out=True, rules=[rule])
    first = inspect.getsourcelines(double_kernel.fn)[1] + 6
    assert_not_solved(verdict, "broke a stated rule — each output stored once: double_kernel stored 100 elements of "
                               f"out_ptr twice in one launch (program 0: the store at line {first} of double_kernel, "
                               f"then the store at line {first + 2} of double_kernel; first at element 0)")
    assert check("double", doubled(False), lambda x: 2 * x, cases, out=True, rules=[rule]).solved


def test_a_rule_broken_raised_by_a_given_wrapper_is_a_rule_verdict():
    def unchanged(fn):
        def run(values):
            before = list(values)
            result = fn(values)
            if values != before:
                raise exercises.rules.RuleBroken("the arguments stay as they were", "the code modified values")
            return result

        return run

    def total_popping(values):
        total = 0
        while values:
            total += values.pop()
        return total

    verdict = check("total", unchanged(total_popping), sum, [([1, 2, 3],)])
    assert_not_solved(verdict, "broke a stated rule — the arguments stay as they were: the code modified values")
    assert_not_in(verdict, "raised")
    assert check("total", unchanged(sum), sum, [([1, 2, 3],)]).solved


def add_with_loop(x, y):
    out = torch.empty_like(x)
    for i in range(len(x)):
        out[i] = x[i] + y[i]
    return out


def add_by_comprehension(x, y):
    return torch.stack([a + b for a, b in zip(x, y)])


def loop_helper(x, y):
    total = x.clone()
    while False:
        total += y
    return total + y


def add_through_a_helper(x, y):
    return loop_helper(x, y)


def add_over_a_literal_tuple(x, y):
    result = x.clone()
    for term in (y,):  # structure, not data
        result = result + term
    return result


TENSOR_OPS = "tensor ops only"


def small_add_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(12, generator=gen), torch.randn(12, generator=gen))]


def test_no_python_loops_names_the_loop_and_its_line():
    import inspect

    rule = exercises.rules.no_python_loops(why=TENSOR_OPS)
    line = inspect.getsourcelines(add_with_loop)[1] + 2
    assert_not_solved(check("add", add_with_loop, torch.add, small_add_cases, rules=[rule]),
                      f"broke a stated rule — {TENSOR_OPS}: a Python for loop at line {line} of add_with_loop")
    assert_not_solved(check("add", add_by_comprehension, torch.add, small_add_cases, rules=[rule]),
                      "a list comprehension at line")
    line = inspect.getsourcelines(loop_helper)[1] + 2
    assert_not_solved(check("add", add_through_a_helper, torch.add, small_add_cases, rules=[rule]),
                      f"a Python while loop at line {line} of loop_helper")


def test_no_python_loops_passes_tensor_code_and_loops_over_literals():
    rule = exercises.rules.no_python_loops(why=TENSOR_OPS)
    for candidate in (torch.add, lambda x, y: x + y, add_over_a_literal_tuple):
        verdict = check("add", candidate, torch.add, small_add_cases, rules=[rule])
        assert verdict.solved, verdict.message


def sorted_by(keys: torch.Tensor, order: torch.Tensor) -> str | None:
    ordered = keys[order]
    if bool((ordered[1:] < ordered[:-1]).any()):
        return "the keys are not in order"
    return None


def stable(case, got) -> str | None:
    (keys,) = case
    ties = (keys[got][1:] == keys[got][:-1]) & (got[1:] < got[:-1])
    if bool(ties.any()):
        i = int(ties.nonzero()[0, 0])
        return f"equal keys out of their input order at positions {i} and {i + 1}"
    return None


def test_holds_names_the_property_broken():
    def any_order(got, expected):
        return None  # any permutation that sorts is right; the rule decides stability

    rule = exercises.rules.holds(stable, name="stable: equal keys keep their order")
    reversed_ties = lambda keys: torch.argsort(keys * len(keys) - torch.arange(len(keys)))
    verdict = check("order", reversed_ties, stable_order, sort_cases, compare=any_order, rules=[rule])
    assert_not_solved(verdict, "broke a stated rule — stable: equal keys keep their order: equal keys out of their "
                               "input order at positions 0 and 1")
    assert check("order", stable_order, stable_order, sort_cases, compare=any_order, rules=[rule]).solved


def test_holds_with_the_expected_result_and_a_raising_property():
    within = exercises.rules.holds(lambda case, got, expected: None if got.shape == expected.shape else "shape",
                                   name="same shape")
    assert check("add", torch.add, torch.add, small_add_cases, rules=[within]).solved
    raising = exercises.rules.holds(lambda case, got: got.no_such_attribute, name="a property")
    assert_not_solved(check("add", torch.add, torch.add, small_add_cases, rules=[raising]),
                      "broke a stated rule — a property: checking it raised AttributeError")


def test_inputs_unchanged_names_the_arguments_changed_in_place():
    rule = exercises.rules.inputs_unchanged(why="the spec leaves its inputs as they were")

    def add_into_x(x, y):
        return x.add_(y)  # the right sum, in x's memory

    def add_into_y_and_back(x, y):
        y.add_(x)
        result = y.clone()
        y.sub_(x)  # put back, but rounded: y + x - x is not y in floating point
        return result

    verdict = check("add", add_into_x, torch.add, small_add_cases, rules=[rule])
    assert_not_solved(verdict, "broke a stated rule — the spec leaves its inputs as they were: the code changed x "
                               "in place (12 of its 12 elements)")
    assert_not_solved(check("add", add_into_y_and_back, torch.add, small_add_cases, rules=[rule]), "changed y in place")
    kept = check("add", torch.add, torch.add, small_add_cases, rules=[rule])
    assert kept.solved and "rules kept: inputs left unchanged" in kept.message, kept.message


def test_inputs_unchanged_keeps_nan_inputs_and_views_that_write_nothing():
    rule = exercises.rules.inputs_unchanged(why="x")
    cases = [(torch.tensor([1.0, float("nan"), 3.0]), torch.ones(3))]
    assert check("add", lambda x, y: x[:].view(3) + y, torch.add, cases, rules=[rule]).solved


# ----------------------------------------------------------------------------------------------
# Exact types: a Python int (or bool) reference wants exactly that


def step_flops(tokens: int, params: int) -> int:
    return 6 * tokens * params


def test_exact_int_wants_an_int_not_an_equal_float():
    cases = [(5, 1_823_331_638_651_427)]  # 6 * 5 * params = 54699949159542810, past 2**53
    assert check("flops", step_flops, step_flops, cases).solved
    as_float = lambda tokens, params: 6.0 * tokens * params
    assert_not_solved(
        check("flops", as_float, step_flops, cases),
        f"expected an exact int, got float {as_float(*cases[0])!r}; the exact answer is 54699949159542810",
    )
    rounded = lambda tokens, params: int(6.0 * tokens * params)  # an int, off by the float's rounding
    verdict = check("flops", rounded, step_flops, cases)
    assert_not_solved(verdict, f"wrong value: got {rounded(*cases[0])}, expected 54699949159542810")
    assert_not_in(verdict, "exact")
    representable = [(4096 * 8, 278_229_000_000)]  # a float that is exactly right is still not an int
    assert_not_solved(check("flops", as_float, step_flops, representable),
                      "expected an exact int, got float 5.4702047232e+16; the value is right, the type is not")


def test_exact_int_names_numpy_and_tensor_results():
    cases = [(3, 5)]
    verdict = check("flops", lambda t, p: np.int64(6 * t * p), step_flops, cases)
    assert_not_solved(verdict, "expected an exact int, got numpy.int64", "the value is right, the type is not")
    verdict = check("flops", lambda t, p: torch.tensor(6 * t * p), step_flops, cases)
    assert_not_solved(verdict, "expected an exact int, got a tensor () int64; the value is right, the type is not")


def test_exact_bool_wants_a_bool():
    assert check("fits", lambda n: n < 10, lambda n: n < 10, [(3,), (30,)]).solved
    assert_not_solved(check("fits", lambda n: int(n < 10), lambda n: n < 10, [(3,)]),
                      "expected an exact bool, got int 1")


def test_python_floats_still_compare_with_a_tolerance():
    assert check("ratio", lambda n: n / 3 * (1 + 1e-9), lambda n: n / 3, [(4,)]).solved


# ----------------------------------------------------------------------------------------------
# diagnose: the exercise's own cause for a wrong result


def test_diagnose_adds_the_cause_when_the_values_are_wrong():
    seen = []

    def diagnose(case, got, expected):
        seen.append(len(case))
        if torch.allclose(got, 2 * expected):
            return "every value doubled: the sum is counted twice"
        return None

    verdict = check("add", lambda x, y: 2 * (x + y), torch.add, small_add_cases, diagnose=diagnose)
    assert_not_solved(verdict, "wrong values in", "cause: every value doubled: the sum is counted twice")
    assert check("add", torch.add, torch.add, small_add_cases, diagnose=diagnose).solved
    assert seen == [2]  # called on the failing case only
    raising = check("add", lambda x, y: x, torch.add, small_add_cases, diagnose=lambda c, g, e: 1 / 0)
    assert_not_solved(raising, "wrong values in")
    assert_not_in(raising, "cause:")


# ----------------------------------------------------------------------------------------------
# Traffic: the performance verdict of a solved kernel


@triton.jit
def add_reading_y_twice_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    y_again = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + (y + y_again) * 0.5, mask=in_bounds)


def add_traffic(explain=None):
    from utils.trace import ideal_bytes

    return exercises.Traffic(ideal=lambda x, y: ideal_bytes(x, y, x), top=lambda x, y: ideal_bytes(x, y, x),
                             explain=explain)


@interpreter_only
def test_traffic_of_a_solved_kernel_at_the_ideal():
    verdict = check_add(add_kernel, traffic=add_traffic())
    assert verdict.solved
    report = verdict.traffic
    assert report.moved == report.ideal == 3 * 2500 * 4 and report.ratio == 1.0
    assert report.reread == {"x": 1.0, "y": 1.0}
    assert ("traffic: 1.00× the ideal bytes (30 kB moved, 30 kB ideal; the ladder's top moves 1.00×) — every input "
            "read once, every output written once") in flat(verdict.message)


@interpreter_only
def test_traffic_names_the_input_read_twice_and_the_cause():
    def explain(reread):
        return "y is loaded twice per element: load it once" if reread["y"] > 1.5 else None

    verdict = check_add(add_reading_y_twice_kernel, traffic=add_traffic(explain))
    assert verdict.solved  # solved stays solved: traffic is a separate, honest line
    assert verdict.traffic.reread["y"] == 2.0 and verdict.traffic.moved == 4 * 2500 * 4
    assert ("traffic: 1.33× the ideal bytes (40 kB moved, 30 kB ideal; the ladder's top moves 1.00×) — y read 2.00× "
            "its size: y is loaded twice per element: load it once") in flat(verdict.message)


@interpreter_only
def test_traffic_counts_torch_ops_and_is_absent_from_a_failed_verdict():
    from utils.trace import ideal_bytes

    traffic = exercises.Traffic(ideal=lambda x, y: ideal_bytes(x, y, x))
    unfused = check("add", lambda x, y: (x * 1) + y, torch.add, small_add_cases, traffic=traffic)
    assert unfused.solved and unfused.traffic.moved == 5 * 12 * 4  # x*1 reads 1 writes 1; + reads 2 writes 1
    assert "traffic: 1.67× the ideal bytes" in flat(unfused.message)
    assert "the ladder's top" not in unfused.message
    wrong = check_add(add_ignores_y_kernel, traffic=add_traffic())
    assert not wrong.solved and wrong.traffic is None and "traffic" not in wrong.message


# ----------------------------------------------------------------------------------------------
# Progress lines for slow cells


def test_progress_lines_are_deterministic_and_say_the_expected_time(capsys):
    from utils.progress import announce, progress

    assert list(progress(range(25), "tracing", expected="about 8 s on a 2-core laptop CPU")) == list(range(25))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "⏳ tracing: 25 steps — expected: about 8 s on a 2-core laptop CPU"
    assert lines[-1] == "✓ tracing: done"
    bars = lines[1:-1]
    assert len(bars) == 10 and bars[-1] == "   [####################] 25/25 tracing"
    assert bars[0] == "   [##..................] 3/25 tracing"
    list(progress(range(3), "three", expected="a second"))
    assert capsys.readouterr().out.splitlines()[1:] == [
        "   [######..............] 1/3 three",
        "   [#############.......] 2/3 three",
        "   [####################] 3/3 three",
        "✓ three: done",
    ]
    with announce("one torch.compile", expected="about 50 s on a cold cache"):
        pass
    assert capsys.readouterr().out.splitlines() == [
        "⏳ one torch.compile — expected: about 50 s on a cold cache …", "✓ one torch.compile: done"]
    assert list(progress(iter([1, 2]), "generator", expected="soon")) == [1, 2]  # no len: a line per step
    assert capsys.readouterr().out.splitlines() == ["⏳ generator: steps — expected: soon", "   generator: 1 done",
                                                    "   generator: 2 done", "✓ generator: done"]


def test_no_python_loops_of_the_exercise_function_a_given_driver_calls():
    def driver(update):
        def run(x, y):
            out = x.clone()
            for _ in range(1):  # the given driver may loop: the rule reads the exercise's function
                out = update(out, y)
            return out

        return run

    looping = exercises.rules.no_python_loops(why=TENSOR_OPS, function=add_with_loop)
    assert_not_solved(check("add", driver(add_with_loop), torch.add, small_add_cases, rules=[looping]),
                      "a Python for loop at line")
    clean = exercises.rules.no_python_loops(why=TENSOR_OPS, function=torch.add)
    assert check("add", driver(torch.add), torch.add, small_add_cases, rules=[clean]).solved


@interpreter_only
def test_traced_rule_sees_the_bytes_each_argument_was_read():
    def y_read_once(args, launches):
        x, y = args  # the case's arguments (out=True outputs are not among them)
        read = exercises.rules.bytes_read(launches, y)
        return None if read <= y.nbytes else f"y read {read // y.nbytes}× its size"

    rule = exercises.rules.traced(y_read_once, name="y read once")
    assert check_add(add_kernel, rules=[rule]).solved
    assert_not_solved(check_add(add_reading_y_twice_kernel, rules=[rule]),
                      "broke a stated rule — y read once: y read 2× its size")


def test_tolerance_per_case_and_dtype():
    def noisy(x):
        return x * (1 + 1e-4)

    def cases(gen):
        return [(torch.ones(8),), (torch.full((8,), 200.0),)]

    def tolerance(case, dtype):
        (x,) = case
        return (2e-4, 0.0) if float(x.abs().max()) > 100 and dtype == torch.float32 else None

    verdict = check("tol", noisy, lambda x: x, cases, tolerance=tolerance)
    assert_not_solved(verdict, "case 1 of 2", "(rtol=1e-05, atol=1e-06)")  # the default where none is chosen
    assert check("tol", noisy, lambda x: x, [cases(None)[1]], tolerance=tolerance).solved


@interpreter_only
def test_traffic_of_torch_code_names_the_ops_it_saw_and_gives_them_to_explain_ops():
    """The line says what was measured: the aten ops that moved data, the heaviest first; an explanation
    that names a method sees the case and those ops, so it names a method only when the ops show it."""
    from utils.trace import ideal_bytes

    seen = []

    def explain_ops(case, reread, ops):
        seen.append((case[0].shape, [op.name for op in ops]))
        return "a product ran" if any(op.name == "aten.mul.Tensor" for op in ops) else None

    traffic = exercises.Traffic(ideal=lambda x, y: ideal_bytes(x, y, x), explain_ops=explain_ops)
    unfused = check("add", lambda x, y: (x * 1) + y, torch.add, small_add_cases, traffic=traffic)
    message = flat(unfused.message)
    assert unfused.solved and seen == [(small_add_cases(None)[-1][0].shape, ["aten.mul.Tensor", "aten.add.Tensor"])]
    assert ("(240 B moved, 144 B ideal) — 2 torch ops moved 240 B: aten.add.Tensor 144 B, aten.mul.Tensor 96 B: "
            "a product ran") in message, message
    plain = check("add", lambda x, y: x - (-y), torch.add, small_add_cases, traffic=traffic)
    assert plain.solved and "aten.neg.default" in flat(plain.message) and "a product ran" not in plain.message
    kernel = check_add(add_kernel, traffic=add_traffic())
    assert "torch ops moved" not in kernel.message  # a Triton launch alone: no torch ops to name


def test_traffic_is_not_measured_where_kernels_are_compiled(monkeypatch):
    from utils.exercises import checker

    monkeypatch.setattr(checker, "_interpreted", lambda: False)
    calls = []
    traffic = exercises.Traffic(ideal=lambda x, y: 3 * x.nbytes, top=lambda x, y: calls.append(1) or 0)
    verdict = check("add", torch.add, torch.add, small_add_cases, traffic=traffic)
    assert verdict.solved and not verdict.traffic.measured and calls == []  # no ladder run for nothing
    assert "traffic: not measured — the tracer counts the bytes of interpreted kernels only" in flat(verdict.message)


def test_exact_int_leaves_a_missing_return_to_the_value_line():
    verdict = check("flops", lambda t, p: None, step_flops, [(3, 5)])
    assert_not_solved(verdict, "wrong value: got None, expected 90")
    assert_not_in(verdict, "exact")


# ----------------------------------------------------------------------------------------------
# The exercise's own solution, called through the notebook's `given` module, is not an answer


def test_calling_the_exercises_own_solution_is_a_broken_rule(learner_registry, fake_solutions):
    @exercise("ch99_fake.programs_needed")
    def programs_needed(n: int, block: int) -> int:
        return fake_solutions.programs_needed(n, block)  # given.programs_needed, as a learner would reach it

    cases = [(1000, 256), (1, 64), (4097, 128)]
    verdict = check("ch99_fake.programs_needed", programs_needed, lambda n, b: -(-n // b), cases)
    assert_not_solved(verdict, "broke a stated rule — write the exercise yourself: the code called the chapter's "
                      "own solution (programs_needed in solutions/ch99_fake.py, the notebook's given.programs_needed)")
    # The solution is back in its module afterwards, and a check named by chapter number is guarded the same way.
    assert not type(fake_solutions.programs_needed).__name__ == "_Watched"
    assert_not_solved(check("ch99.programs_needed", programs_needed, lambda n, b: -(-n // b), cases),
                      "the chapter's own solution")

    # Negative control: the learner's own arithmetic is SOLVED with the same check.
    @exercise("ch99_fake.programs_needed")
    def programs_needed_own(n: int, block: int) -> int:
        return (n + block - 1) // block

    assert check("ch99_fake.programs_needed", programs_needed_own, lambda n, b: -(-n // b), cases).solved


def test_launching_the_exercises_own_solution_kernel_is_a_broken_rule(learner_registry, fake_solutions):
    @exercise("ch99_fake.add_kernel")
    @triton.jit
    def learner_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pass  # never launched: the launcher below takes the solution's kernel

    def launch(x, y, out):
        fake_solutions.add_kernel[(triton.cdiv(x.numel(), 256),)](x, y, out, x.numel(), BLOCK=256)

    verdict = check("ch99_fake.add_kernel", launch, torch.add, add_cases, out=True)
    assert_not_solved(verdict, "the notebook's given.add_kernel")
    # Another exercise's solution is a given there: a check of a different exercise may run it.
    assert check("ch99_fake.other", launch, torch.add, add_cases, out=True).solved


def test_solution_mode_watches_nothing(monkeypatch, fake_solutions):
    monkeypatch.setenv(exercises.SOLUTIONS_ENV, "1")
    monkeypatch.setattr(exercises, "_STUBS", {"ch99_fake.programs_needed": None})

    def through_module(n: int, block: int) -> int:
        return fake_solutions.programs_needed(n, block)

    assert check("ch99_fake.programs_needed", through_module, lambda n, b: -(-n // b), [(1000, 256)]).solved


# ----------------------------------------------------------------------------------------------
# One program per (head, block of rows): a store without its row mask spills into the next head


@triton.jit
def heads_rows_kernel(x_ptr, out_ptr, T, D: tl.constexpr, BLOCK_T: tl.constexpr, BUG: tl.constexpr):
    block, head = tl.program_id(0), tl.program_id(1)  # all first blocks run before any second block
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    in_rows = (rows < T)[:, None]
    if BUG == 2:
        base = head * (T - 1) * D  # the head stride one row short: heads overlap by a row
    else:
        base = head * T * D
    offsets = base + rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=in_rows, other=0.0)
    if BUG == 1:
        tl.store(out_ptr + offsets, 2 * x)  # no row mask: the last block's spare rows land in the next head
    else:
        tl.store(out_ptr + offsets, 2 * x, mask=in_rows)


def check_heads_rows(bug: int) -> Verdict:
    def launch(x: torch.Tensor, out: torch.Tensor) -> None:
        heads, t, d = x.shape
        heads_rows_kernel[(triton.cdiv(t, 4), heads)](x, out, t, D=d, BLOCK_T=4, BUG=bug)

    def cases(gen: torch.Generator) -> list[tuple[torch.Tensor]]:
        return [(torch.randn(3, 5, 16, generator=gen).to(DEVICE),)]  # T = 5 rows: the second block has 3 spare

    return check("ch99_test.heads_rows", launch, lambda x: 2 * x, cases, out=True)


def test_a_per_head_row_block_kernel_with_its_masks_is_solved():
    assert check_heads_rows(0).solved


@interpreter_only
def test_a_store_without_its_row_mask_is_the_mask_not_the_mapping():
    verdict = check_heads_rows(1)
    assert_not_solved(
        verdict,
        # program 1 is (block 1, head 0): its rows 5..7 are head 1's rows 0..2, which program 2 (block 0, head 1)
        # stored first; the last head's spare rows fall outside the output
        "the stores are not masked: program 1's lanes past row (0, 4) wrote into indices (1, 0, 0)..(1, 2, 15), "
        "the elements program 2 owns (a missing store mask)",
        "out of bounds: heads_rows_kernel wrote 48 elements outside every tensor argument",
    )
    assert_not_in(verdict, MAPPING, "grid")


@interpreter_only
def test_a_head_stride_one_row_short_is_still_the_mapping():
    verdict = check_heads_rows(2)
    assert_not_solved(verdict, f"{MAPPING} sends two programs to the same elements")
    assert_not_in(verdict, "not masked", "missing store mask")


# ----------------------------------------------------------------------------------------------
# Inputs changed in place (every check), host syncs and library ops (tensor ops only), loops of k rounds


def add_into_x(x, y):
    return x.add_(y)  # the right sum, written into the caller's x


def add_then_clear_y(x, y):
    out = x + y
    y.zero_()
    return out


def add_then_transpose_x(x, y):
    out = x + y
    x.t_()
    return out


def test_a_candidate_that_changes_an_input_in_place_is_not_solved_and_the_argument_is_named():
    verdict = check("add", add_into_x, torch.add, small_add_cases)
    assert_not_solved(verdict, "broke a stated rule — the inputs are the caller's and come back as they were: the "
                               "code changed x in place (12 of its 12 elements), first at [0]:")
    assert_not_in(verdict, "y in place")
    verdict = check("add", add_then_clear_y, torch.add, small_add_cases)
    assert_not_solved(verdict, "the code changed y in place (", "→ 0")
    matrices = lambda gen: [(torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen))]
    assert_not_solved(check("add", add_then_transpose_x, torch.add, matrices),
                      "the code changed x in place (its shape (3, 4) is now (4, 3))")


def test_inputs_left_alone_keep_the_check_quiet_and_a_list_changed_in_place_is_named():
    assert check("add", lambda x, y: x + y, torch.add, small_add_cases).solved
    assert check("add", lambda x, y: torch.add(x, y, out=torch.empty_like(x)), torch.add, small_add_cases).solved

    def total_popping(values):
        total = 0
        while values:
            total += values.pop()
        return total

    verdict = check("total", total_popping, sum, [([1, 2, 3],)])
    assert_not_solved(verdict, "the code changed values in place (the list [1, 2, 3] is now [])")


def add_into_both(x, y):
    x.add_(y)
    y.copy_(x)
    return x.clone()


def test_the_inputs_rule_words_the_line_in_the_spec_s_terms_and_is_listed_as_kept():
    rule = exercises.rules.inputs_unchanged(why="the spec leaves its inputs as they were")
    verdict = check("add", add_into_both, torch.add, small_add_cases, rules=[rule])
    assert_not_solved(verdict, "broke a stated rule — the spec leaves its inputs as they were: the code changed x, y "
                               "in place (x: 12 of 12; y: 12 of 12), first at x[0]:")
    kept = check("add", torch.add, torch.add, small_add_cases, rules=[rule])
    assert kept.solved and "rules kept: inputs left unchanged" in kept.message, kept.message
    nan_input = [(torch.tensor([1.0, float("nan"), 3.0]), torch.ones(3))]  # NaN stays NaN: nothing changed
    assert check("add", lambda x, y: x[:].view(3) + y, torch.add, nan_input, rules=[rule]).solved


def test_an_out_kernel_storing_into_its_input_is_named_as_an_input_changed():
    def doubled_in_place(x, out):
        double_kernel[(triton.cdiv(x.numel(), 64),)](x, x, x.numel(), BLOCK=64, TWICE=False)
        out.copy_(x)
        return out

    cases = lambda gen: [(torch.randn(100, generator=gen),)]
    verdict = check("double", doubled_in_place, lambda x: 2 * x, cases, out=True)
    assert_not_solved(verdict, "the code changed x in place (100 of its 100 elements), first at [0]:")


def nonzero_rows(x, y):
    rows = torch.nonzero(torch.ones_like(x, dtype=torch.bool))[:, 0]  # every index: the values, by a sync
    return x[rows] + y[rows]


def masked_sum(x, y):
    out = x + y
    keep = out == out
    return out.masked_select(keep)


def by_a_boolean_mask(x, y):
    return (x + y)[torch.ones_like(x, dtype=torch.bool)]


def repeated_by_a_tensor(x, y):
    return torch.repeat_interleave(x + y, torch.ones_like(x, dtype=torch.long))


def through_unique(x, y):
    return (x + y)[torch.unique(torch.arange(len(x)))]


def counted_with_bincount(x, y):
    ones = torch.bincount(torch.arange(len(x)), minlength=len(x))
    return (x + y) * ones


def one_hot_of_the_ids_width(x, y):
    ids = torch.arange(len(x))
    return (x + y) * torch.nn.functional.one_hot(ids).sum(dim=1)  # its width from the largest id


def histogram_over_the_values_range(x, y):
    return (x + y) + 0 * torch.histc(x, bins=4).sum()  # min == max: the range read from x


def compared_with_equal(x, y):
    return (x + y) if torch.equal(x, x) else (x - y)


def with_fixed_shapes(x, y):
    """Tensor ops whose output shapes the host knows: none of them waits for the device."""
    keep = torch.ones_like(x, dtype=torch.bool)
    out = torch.where(keep, x + y, 0.0)
    out[~keep] = 0.0  # a scalar through a mask is a masked_fill on the device
    twice = out.repeat_interleave(2)[::2]  # an int repeat: a fixed size
    return twice + torch.nn.functional.one_hot(torch.zeros(len(x), dtype=torch.long), 3)[:, 1]


@pytest.mark.parametrize(("candidate", "named"), [
    (nonzero_rows, "nonzero"),
    (masked_sum, "masked_select"),
    (by_a_boolean_mask, "indexing with a boolean mask (x[mask])"),
    (repeated_by_a_tensor, "repeat_interleave with tensor repeats"),
    (through_unique, "unique"),
    (counted_with_bincount, "bincount"),
    (compared_with_equal, "torch.equal"),
    (one_hot_of_the_ids_width, "one_hot without num_classes"),
    (histogram_over_the_values_range, "histc without a range"),
])
def test_tensor_ops_only_rules_out_ops_that_sync_with_the_device(candidate, named):
    rule = exercises.rules.tensor_ops_only(why=TENSOR_OPS)
    verdict = check("add", candidate, torch.add, small_add_cases, rules=[rule])
    assert_not_solved(verdict, f"broke a stated rule — {TENSOR_OPS}: the code made the host wait for the device: "
                               f"{named}")


def test_tensor_ops_only_keeps_fixed_shape_ops():
    rule = exercises.rules.tensor_ops_only(why=TENSOR_OPS)
    verdict = check("add", with_fixed_shapes, torch.add, small_add_cases, rules=[rule])
    assert verdict.solved, verdict.message


def add_by_the_library(x, y):
    return kernel_ladder.add(x, y)


def add_by_a_triton_launch(x, y):
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, out, x.numel(), BLOCK=BLOCK)
    return out


def test_tensor_ops_only_rules_out_a_library_op_and_a_triton_launch():
    rule = exercises.rules.tensor_ops_only(why=TENSOR_OPS)
    verdict = check("add", add_by_the_library, torch.add, small_add_cases, rules=[rule])
    assert_not_solved(verdict, f"broke a stated rule — {TENSOR_OPS}: the code called kernel_ladder's op "
                               "kernel_ladder::add")
    if kernel_ladder.runtime.INTERPRETER:  # the tracer sees launches in the interpreter only
        verdict = check("add", add_by_a_triton_launch, torch.add, small_add_cases, rules=[rule])
        assert_not_solved(verdict, f"broke a stated rule — {TENSOR_OPS}: the code launched the Triton kernel "
                                   "add_kernel")


def top2_by_rounds(x, k):
    picks = []
    for _ in range(k):  # k rounds, each over every row at once
        best = x.argmax(dim=-1, keepdim=True)
        picks.append(best)
        x = x.scatter(1, best, float("-inf"))
    return torch.cat(picks, dim=1)


def top2_row_by_row(x, k):
    return torch.stack([row.topk(k).indices for row in x])


def test_a_loop_over_an_allowed_argument_is_structure():
    cases = lambda gen: [(torch.randperm(40, generator=gen).float().view(5, 8), 3)]
    reference = lambda x, k: x.topk(k, dim=-1).indices
    allowed = exercises.rules.tensor_ops_only(why=TENSOR_OPS, loops_over=("k",))
    verdict = check("rounds", top2_by_rounds, reference, cases, rules=[allowed])
    assert verdict.solved, verdict.message
    verdict = check("rounds", top2_by_rounds, reference, cases, rules=[exercises.rules.tensor_ops_only(why=TENSOR_OPS)])
    assert_not_solved(verdict, "a Python for loop at line", "of top2_by_rounds (over range(k))")
    verdict = check("rounds", top2_row_by_row, reference, cases, rules=[allowed])
    assert_not_solved(verdict, "a list comprehension at line", "of top2_row_by_row (over x)")


# --------------------------------------------------------------------------------------------
# The instruction-level part of a check (chapter 10): a candidate compiled alone for sm_90
# --------------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not __import__("importlib.util").util.find_spec("triton.backends.nvidia"),
                                reason="Triton's NVIDIA backend (ptxas, nvdisasm) is needed to compile for sm_90")


@triton.jit
def _ch10_scale_loop_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(x_ptr + start + offsets, mask=start + offsets < n, other=0.0) * 3.0
    tl.store(out_ptr + offsets, acc)


@triton.jit
def _ch10_helper(x):
    return x * 3.0


@triton.jit
def _ch10_uses_helper_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, _ch10_helper(tl.load(x_ptr + offsets)))


def _ch10_spec():
    from utils.exercises.sass_loop import CompileSpec

    return CompileSpec(label="n = 4096", types={"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                       constexprs={"BLOCK": 512}, divisible=("n",))


def test_ch10_kernel_source_starts_at_def_for_interpreted_and_plain_functions():
    from utils.exercises.sass_loop import kernel_source

    name, source = kernel_source(_ch10_scale_loop_kernel)
    assert name == "_ch10_scale_loop_kernel" and source.startswith("def _ch10_scale_loop_kernel(")
    assert "@triton.jit" not in source and source.rstrip().endswith("tl.store(out_ptr + offsets, acc)")
    with pytest.raises(TypeError, match="utils.exercises.sass_loop: kernel must be a @triton.jit function"):
        kernel_source(len)


@needs_sm90
def test_ch10_loop_report_counts_the_steady_loop_by_line_and_is_kept(monkeypatch):
    from utils.exercises import sass_loop

    report = sass_loop.loop_report(_ch10_scale_loop_kernel, _ch10_spec())
    assert report.error is None and report.loop_found and report.loops >= 1, report
    assert report.counts.get("global", 0) >= 1 and report.counts.get("fp32", 0) >= 1  # the load, the FFMA/FADD
    assert report.integer_control == report.counts.get("integer", 0) + report.counts.get("control", 0)
    by_line = {line.number: line for line in report.lines}
    assert "tl.load" in by_line[5].text and by_line[5].categories.get("fp32", 0) >= 1, report.lines
    assert sum(line.overhead for line in report.lines) <= report.integer_control
    # Kept: the same source and spec again compiles nothing (a child process would be needed to).
    monkeypatch.setattr("utils.aot.run_compiled", lambda *args, **kwargs: pytest.fail("compiled again"))
    assert sass_loop.loop_report(_ch10_scale_loop_kernel, _ch10_spec()) == report
    sass_loop._MEMORY.clear()  # and from the disk copy, in a fresh process
    assert sass_loop.loop_report(_ch10_scale_loop_kernel, _ch10_spec()) == report


@needs_sm90
def test_ch10_loop_report_carries_the_error_of_a_kernel_that_does_not_stand_alone():
    from utils.exercises import sass_loop

    report = sass_loop.loop_report(_ch10_uses_helper_kernel, _ch10_spec())
    assert report.error is not None and "_ch10_helper" in report.error and not report.loop_found, report
