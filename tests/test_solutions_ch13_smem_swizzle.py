"""Chapter 13, exercise 4 (``smem_swizzle``): the solution passes the layout check; wrong layouts do not.

The check (``utils.exercises.banks.check_smem_swizzle``) judges a word offset per element of the GEMM's
transposed A tile: a bijection below the bound, 16-byte groups whole, and the tile's store and the inner loop's
float4 reads free of bank conflicts (``utils.banks``). Each negative control is a plausible wrong answer the
checker must reject, with the diagnosis it must give.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solutions.ch13_below_triton import smem_swizzle
from utils.exercises.banks import TILE_BOUND, TILE_COLS, TILE_ROWS, check_smem_swizzle


def said(verdict, text: str) -> bool:
    return text in " ".join(verdict.message.split())


def test_solution_is_solved():
    verdict = check_smem_swizzle(smem_swizzle)
    assert verdict.solved, verdict.message
    assert said(verdict, "the tile's store: 64 warp accesses, 64 wavefronts (ideal 64)")
    assert said(verdict, "the inner loop's float4 reads: 256 warp accesses, 1024 wavefronts (ideal 1024)")


def test_solution_is_a_bijection_onto_the_unpadded_tile():
    words = {smem_swizzle(r, c) for r in range(TILE_ROWS) for c in range(TILE_COLS)}
    assert words == set(range(TILE_ROWS * TILE_COLS)) and TILE_BOUND == 16 * 132


def identity(row, col):
    return row * TILE_COLS + col


def padded_by_4(row, col):  # keeps the float4 reads aligned, but groups 0 and 2 of k still share banks
    return row * (TILE_COLS + 4) + col


def padded_by_1(row, col):  # the classic odd pad: conflict-free stores, unaligned float4 reads
    return row * (TILE_COLS + 1) + col


def xor_row(row, col):  # a swizzle that moves single columns: breaks the 16-byte groups
    return row * TILE_COLS + (col ^ row)


def xor_by_16(row, col):  # a whole-group swizzle, but 16 banks apart: groups 0 and 2 collide again
    return row * TILE_COLS + (col ^ (16 * (row // 4)))


def folded(row, col):  # two rows of k in one: not a bijection
    return (row % 8) * TILE_COLS + (col ^ (8 * (row // 4)))


def padded_by_8(row, col):  # conflict-free? no: and past the bound
    return row * (TILE_COLS + 8) + col


@pytest.mark.parametrize(
    "layout, diagnosis",
    [
        (identity, "bank conflicts in the tile's store"),
        (identity, "256 wavefronts where 64 would do"),
        (identity, "4-way conflict on bank 0 (lane 0 word 0, lane 1 word 512, lane 2 word 1024, lane 3 word 1536)"),
        (identity, "words 0, 512, 1024, 1536 hold elements (row, col) (0, 0), (4, 0), (8, 0), (12, 0)"),
        (padded_by_4, "128 wavefronts where 64 would do"),
        (padded_by_4, "2-way conflict on bank 0 (lane 0 word 0, lane 2 word 1056)"),
        (padded_by_1, "16-byte groups broken"),
        (padded_by_1, "row 1, cols 0..3 at words [129, 130, 131, 132]"),
        (xor_row, "16-byte groups broken"),
        (xor_row, "row 1, cols 0..3 at words [129, 128, 131, 130]"),
        (xor_by_16, "2-way conflict"),
        (folded, "not a bijection: 1024 elements share a word with another"),
        (folded, "(0, 16) and (8, 0) both at word 16"),
        (padded_by_8, "offsets outside [0, 2112)"),
        (padded_by_8, "(15, 72) -> 2112; (15, 73) -> 2113"),
    ],
)
def test_wrong_layouts_are_rejected(layout, diagnosis):
    verdict = check_smem_swizzle(layout)
    assert not verdict.solved and said(verdict, diagnosis), verdict.message


def stub(row, col):
    raise NotImplementedError


def crashes(row, col):
    return [row, col][2]


def returns_float(row, col):
    return float(row * TILE_COLS + col)


@pytest.mark.parametrize(
    "layout, diagnosis",
    [
        (stub, "not implemented yet: smem_swizzle raised NotImplementedError"),
        (crashes, "smem_swizzle(0, 0) raised IndexError: list index out of range"),
        (returns_float, "smem_swizzle(0, 0) returned 0.0 (float): expected an int word offset"),
        (lambda row, col: True, "returned True (bool): expected an int word offset"),
    ],
)
def test_broken_code_is_a_verdict_not_an_exception(layout, diagnosis):
    verdict = check_smem_swizzle(layout)
    assert not verdict.solved and said(verdict, diagnosis), verdict.message


def solution_as(convert):
    return lambda row, col: convert(smem_swizzle(row, col))


@pytest.mark.parametrize(
    "convert",
    [int, np.int64, np.int32, lambda v: np.array(v), torch.tensor, lambda v: torch.tensor(v, dtype=torch.int16)],
    ids=["int", "np.int64", "np.int32", "0-d array", "0-d tensor", "0-d int16 tensor"],
)
def test_an_int_or_an_integer_numpy_or_torch_scalar_is_taken(convert):
    assert check_smem_swizzle(solution_as(convert)).solved


@pytest.mark.parametrize(
    "convert, shown",
    [
        (float, "returned 0.0 (float)"),
        (np.float64, "returned np.float64(0.0) (float64)"),
        (lambda v: torch.tensor(float(v)), "returned tensor(0.) (Tensor)"),
        (lambda v: torch.tensor([v]), "returned tensor([0]) (Tensor)"),
        (lambda v: np.array([v]), "returned array([0]) (ndarray)"),
        (lambda v: torch.tensor(v % 2 == 1), "returned tensor(False) (Tensor)"),
        (lambda v: np.bool_(v % 2 == 1), "returned np.False_ (bool)"),
    ],
    ids=["float", "np.float64", "0-d float tensor", "1-element tensor", "1-element array", "bool tensor", "np.bool_"],
)
def test_anything_else_is_rejected_saying_what_is_taken(convert, shown):
    verdict = check_smem_swizzle(solution_as(convert))
    assert not verdict.solved and said(verdict, f"smem_swizzle(0, 0) {shown}: expected an int word offset"), verdict
    assert said(verdict, "(an int, or an integer NumPy or torch scalar: a 0-d integer array or tensor)")


def test_padding_that_is_enough_at_bk_8():
    # the BK = 8 tile of gemm_regtile<8, kPadded>: a pad of 4 words is conflict-free there
    assert check_smem_swizzle(lambda r, c: r * (TILE_COLS + 4) + c, rows=8).solved
    assert not check_smem_swizzle(lambda r, c: r * TILE_COLS + c, rows=8).solved
