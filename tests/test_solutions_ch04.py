"""Chapter 04's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked the way the notebook checks it (the same launchers, the same kind of
cases: awkward sizes, tile remainders, fp32/fp16/bf16, transposed views), once with the solution
(SOLVED) and once per negative control — a plausible wrong answer the checker must reject. Sizes
stay at a few dozen program instances per case: the interpreter runs each in Python.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch04_matmul as solutions
from utils.aot import run_compiled
from utils.coalescing import matrix_strides, tile_requests
from utils.exercises import check
from utils.l2cache import program_order
from utils.trace import trace

pytestmark = pytest.mark.interpreter  # out-of-bounds diagnoses need the interpreter's tracer

DEVICE = kernel_ladder.runtime.DEVICE


# ----------------------------------------------------------------------------------------------
# Cases and references (as in the notebook)
# ----------------------------------------------------------------------------------------------


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _pair(gen, M, K, N, dtype=torch.float32, a_transposed=False, b_transposed=False):
    """A (M, K) and B (K, N) with B scaled by 1/sqrt(K): outputs of order 1, so the float32 rounding of a
    K-long sum stays inside the checker's float32 tolerance (1e-6 absolute) even where terms cancel."""
    a = _rand(gen, K, M, dtype=dtype).t() if a_transposed else _rand(gen, M, K, dtype=dtype)
    scale = K**-0.5
    b = _rand(gen, N, K, dtype=dtype, scale=scale).t() if b_transposed else _rand(gen, K, N, dtype=dtype, scale=scale)
    return a, b


def matmul_cases(gen: torch.Generator) -> list:
    """(a, b) pairs: remainders in every dimension, one element, the three dtypes, transposed views."""
    return [
        _pair(gen, 70, 50, 40),
        _pair(gen, 1, 17, 33),
        _pair(gen, 40, 64, 24, torch.float16),
        _pair(gen, 33, 40, 31, torch.bfloat16),
        _pair(gen, 45, 36, 50, a_transposed=True, b_transposed=True),  # both operands column-major
    ]


def naive_cases(gen: torch.Generator) -> list:
    return [
        _pair(gen, 5, 40, 7),
        _pair(gen, 1, 1, 1),
        _pair(gen, 4, 33, 6, torch.float16),
        _pair(gen, 3, 20, 5, torch.bfloat16),
        _pair(gen, 6, 50, 4, b_transposed=True),  # B column-major
    ]


def bias_cases(gen: torch.Generator) -> list:
    return [(a, b, _rand(gen, b.shape[1], dtype=a.dtype)) for a, b in matmul_cases(gen)]


def split_k_cases(gen: torch.Generator) -> list:
    return [
        (*_pair(gen, 1, 200, 40), 4),  # one token: a decode step
        (*_pair(gen, 5, 100, 33, torch.float16), 3),
        (*_pair(gen, 16, 64, 64, torch.bfloat16), 2),
        (*_pair(gen, 3, 40, 20), 8),  # more splits asked than K has slices
        (*_pair(gen, 2, 130, 24, b_transposed=True), 2),
    ]


def matmul_reference(a, b):
    return a @ b


def bias_gelu_reference(a, b, bias):
    return F.gelu(a @ b + bias)


def split_k_reference(a, b, split_k):
    return a @ b


def grid_cases(gen: torch.Generator) -> list:
    """(grid_m, grid_n, group_m): groups that divide the grid and groups that leave a short last band."""
    # (5, 3, 3): a last band of 2 rows starting at program 9, the one fixed case where counting inside the band
    # from `pid` instead of from the band's start goes wrong (order_pid_not_band_local below)
    fixed = [(8, 8, 4), (7, 5, 3), (1, 6, 4), (6, 1, 8), (5, 9, 1), (16, 3, 16), (5, 3, 3)]
    drawn = [tuple(int(v) for v in torch.randint(1, 13, (3,), generator=gen)) for _ in range(4)]
    return fixed + drawn


def every_program(order_fn):
    """``f(grid_m, grid_n, group_m)`` -> (pid_m, pid_n) of every program, as int64 tensors."""

    def run(grid_m, grid_n, group_m):
        tiles = [order_fn(pid, grid_m, grid_n, group_m) for pid in range(grid_m * grid_n)]
        return (torch.tensor([int(t[0]) for t in tiles], dtype=torch.int64),
                torch.tensor([int(t[1]) for t in tiles], dtype=torch.int64))

    return run


def program_order_reference(grid_m, grid_n, group_m):
    pid_m, pid_n = program_order(grid_m, grid_n, group_m)
    return torch.from_numpy(pid_m), torch.from_numpy(pid_n)


def warp_cases(gen: torch.Generator) -> list:
    """(layout, lanes_along, n_rows, n_cols, element_bytes): each layout with lanes along and across its
    contiguous dimension, short dimensions that make the warp wrap, 2-, 4- and 8-byte elements."""
    fixed = [("row-major", 1, 64, 64, 4), ("row-major", 0, 64, 64, 4), ("column-major", 0, 64, 64, 4),
             ("column-major", 1, 64, 64, 4), ("row-major", 1, 16, 8, 4), ("row-major", 0, 16, 8, 4),
             ("column-major", 0, 8, 16, 2), ("column-major", 1, 40, 24, 2), ("row-major", 0, 48, 3, 8),
             ("row-major", 1, 4, 12, 2)]
    drawn = []
    for layout in ("row-major", "column-major"):
        for lanes_along in (0, 1):
            rows, cols = (int(v) for v in torch.randint(6, 70, (2,), generator=gen))
            element_bytes = (1, 2, 4, 8)[int(torch.randint(4, (1,), generator=gen))]
            drawn.append((layout, lanes_along, rows, cols, element_bytes))
    return fixed + drawn


def warp_reference(layout, lanes_along, n_rows, n_cols, element_bytes):
    strides = matrix_strides(n_rows, n_cols, layout)
    first = tile_requests((n_rows, n_cols), strides, element_bytes, order=(lanes_along, 1 - lanes_along)).requests[0]
    return int(first.sectors.size), int(first.lines.size)


# ----------------------------------------------------------------------------------------------
# Launchers bound to a kernel (the notebook's, with the notebook's block sizes)
# ----------------------------------------------------------------------------------------------


def naive_launcher(kernel):
    return lambda a, b, out: solutions.naive_matmul(a, b, out, BLOCK_K=32, kernel=kernel)


class TileOrderError(Exception):
    """The values are right, but the programs computed the tiles in another order than the exercise's."""


def tile_order_problem(owner: np.ndarray, block_m: int, block_n: int) -> str | None:
    """As the notebook's: None if program pid wrote exactly tile (pid // grid_n, pid % grid_n), else why not."""
    grid_m, grid_n = -(-owner.shape[0] // block_m), -(-owner.shape[1] // block_n)
    tiles = np.empty((grid_m, grid_n), dtype=np.int64)
    for i in range(grid_m):
        for j in range(grid_n):
            tile = owner[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
            if (tile < 0).any() or (tile != tile.flat[0]).any():
                return None  # unwritten or shared tiles: the value check says what is wrong
            tiles[i, j] = tile.flat[0]
    row_major = np.arange(grid_m * grid_n).reshape(grid_m, grid_n)
    if (tiles == row_major).all():
        return None
    if (tiles == row_major.reshape(grid_n, grid_m).T).all():
        return (f"the tile order is column-major: program pid computed tile (pid % grid_m, pid // grid_m) of the "
                f"{grid_m} x {grid_n} tile grid; the exercise asks for row-major, (pid // grid_n, pid % grid_n)")
    i, j = (int(v[0]) for v in np.nonzero(tiles != row_major))
    return (f"program {tiles[i, j]} computed tile ({i}, {j}) of the {grid_m} x {grid_n} tile grid; in row-major "
            f"order that tile is program {row_major[i, j]}'s (pid // grid_n, pid % grid_n)")


def in_row_major_order(launch, tensor="c_ptr", block_m=32, block_n=32, planes=1):
    """As the notebook's check: the launcher under the tracer, then which program wrote each output tile."""
    def run(*args):
        with trace(record_access=True) as traced:
            launch(*args)
        owner = traced.launches[-1].access[tensor]
        owner = owner.reshape(planes, -1, owner.shape[-1])
        for plane in range(planes):  # split-K: plane s is written by programs s * tiles + tile
            tiles = -(-owner.shape[1] // block_m) * -(-owner.shape[2] // block_n)
            problem = tile_order_problem(np.where(owner[plane] >= 0, owner[plane] - plane * tiles, -1),
                                         block_m, block_n)
            if problem:
                raise TileOrderError(problem)
        return args[-1]

    return run


def tiled_launcher(kernel):
    return in_row_major_order(
        lambda a, b, out: solutions.tiled_matmul(a, b, out, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, kernel=kernel))


def bias_launcher(kernel):
    return in_row_major_order(lambda a, b, bias, out: solutions.bias_gelu_matmul(a, b, bias, out, kernel=kernel))


def split_k_launcher(kernel):
    def run(a, b, split_k, out):
        planes = solutions.split_k_slices(a.shape[1], split_k, 32)[1]
        launch = lambda a, b, split_k, out: solutions.split_k_matmul(a, b, split_k, out, kernel=kernel)  # noqa: E731
        return in_row_major_order(launch, "partial_ptr", block_m=16, block_n=32, planes=planes)(a, b, split_k, out)

    return run


KERNEL_EXERCISES = {
    "matmul_naive_kernel": (naive_launcher, matmul_reference, naive_cases),
    "matmul_tiled_kernel": (tiled_launcher, matmul_reference, matmul_cases),
    "matmul_bias_gelu_kernel": (bias_launcher, bias_gelu_reference, bias_cases),
    "matmul_split_k_kernel": (split_k_launcher, split_k_reference, split_k_cases),
}


# ----------------------------------------------------------------------------------------------
# Wrong kernels (negative controls)
# ----------------------------------------------------------------------------------------------


@triton.jit
def naive_stub_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                      stride_cn, BLOCK_K: tl.constexpr):
    pass


@triton.jit
def naive_no_k_mask_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                           stride_cn, BLOCK_K: tl.constexpr):
    m, n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc += (tl.load(a_ptr + m * stride_am + k * stride_ak).to(tl.float32)
                * tl.load(b_ptr + k * stride_bk + n * stride_bn).to(tl.float32))
    tl.store(c_ptr + m * stride_cm + n * stride_cn, tl.sum(acc, axis=0).to(c_ptr.dtype.element_ty))


@triton.jit
def naive_contiguous_only_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                                 stride_cn, BLOCK_K: tl.constexpr):
    # assumes row-major operands: wrong for a transposed view
    m, n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k * N + n, mask=k < K, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(c_ptr + m * stride_cm + n * stride_cn, tl.sum(acc, axis=0).to(c_ptr.dtype.element_ty))


@triton.jit
def naive_first_chunk_only_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                                  stride_cn, BLOCK_K: tl.constexpr):
    # forgets the loop over K: sums only the first BLOCK_K products
    m, n = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + m * stride_am + k * stride_ak, mask=k < K, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + k * stride_bk + n * stride_bn, mask=k < K, other=0.0).to(tl.float32)
    tl.store(c_ptr + m * stride_cm + n * stride_cn, tl.sum(a * b, axis=0).to(c_ptr.dtype.element_ty))


@triton.jit
def tiled_stub_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pass


@triton.jit
def _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def tiled_no_store_mask_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                               stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty))


@triton.jit
def tiled_no_k_mask_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                           stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak, mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn, mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def tiled_wrong_grid_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                            stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # divides by the wrong grid size: right only when the tile grid is square
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def tiled_column_major_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                              stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # right values, but program pid computes tile (pid % grid_m, pid // grid_m): column-major tile order
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    rm = (pid % grid_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // grid_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def tiled_overwrites_accumulator_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                        stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                        BLOCK_K: tl.constexpr):
    # acc = tl.dot(a, b) instead of acc = tl.dot(a, b, acc): only the last K slice survives
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def bias_stub_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                     stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pass


@triton.jit
def _epilogue_variant(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                      stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      VARIANT: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    if VARIANT == "gelu_then_bias":
        y = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476)) + bias[None, :]
    elif VARIANT == "no_bias":
        y = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif VARIANT == "tanh_gelu":  # the tanh approximation where F.gelu's exact form is asked
        z = acc + bias[None, :]
        y = z * tl.sigmoid(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z))
    else:  # "bias_by_row": bias[m] instead of bias[n]
        row_bias = tl.load(bias_ptr + rm, mask=rm < N, other=0.0).to(tl.float32)
        z = acc + row_bias[:, None]
        y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, y.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def epilogue_variant(variant: str):
    def launch(a, b, bias, out):
        M, K = a.shape
        N = b.shape[1]
        grid = (triton.cdiv(M, 32) * triton.cdiv(N, 32),)
        _epilogue_variant[grid](a, b, bias, out, M, N, K, *a.stride(), *b.stride(), *out.stride(),
                                BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, VARIANT=variant)
        return out

    launch.__name__ = variant
    return launch


@triton.jit
def split_k_stub_kernel(a_ptr, b_ptr, partial_ptr, M, N, K, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pass


@triton.jit
def _split_k_variant(a_ptr, b_ptr, partial_ptr, M, N, K, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VARIANT: tl.constexpr):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    if VARIANT == "whole_k":  # ignores its slice: every split sums all of K
        acc = _tile_product(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        if VARIANT == "runs_to_end":  # starts at its slice but runs on to the end of K
            k_end = K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (k[None, :] < k_end), other=0.0)
            b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(k[:, None] < k_end) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
    slot = 0 if VARIANT == "one_slot" else pid_s  # "one_slot": every split writes partial 0
    tl.store(partial_ptr + slot * M * N + rm[:, None] * N + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def split_k_variant(variant: str):
    def launch(a, b, split_k, out):
        M, K = a.shape
        N = b.shape[1]
        k_per_split, splits = solutions.split_k_slices(K, split_k, 32)
        partials = torch.full((splits, M, N), float("nan"), dtype=torch.float32, device=a.device)
        _split_k_variant[(triton.cdiv(M, 16) * triton.cdiv(N, 32), splits)](
            a, b, partials, M, N, K, k_per_split, *a.stride(), *b.stride(),
            BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, VARIANT=variant)
        out.copy_(partials.sum(dim=0))
        return out

    launch.__name__ = variant
    return launch


# ----------------------------------------------------------------------------------------------
# Wrong Python answers (negative controls)
# ----------------------------------------------------------------------------------------------


def order_stub(pid, grid_m, grid_n, group_m):
    raise NotImplementedError


def order_row_major(pid, grid_m, grid_n, group_m):
    return pid // grid_n, pid % grid_n


def order_full_last_group(pid, grid_m, grid_n, group_m):
    # forgets that the last band may be shorter than group_m
    per_group = group_m * grid_n
    first_m = (pid // per_group) * group_m
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


def order_columns_fastest(pid, grid_m, grid_n, group_m):
    # walks each band row by row instead of column by column
    per_group = group_m * grid_n
    first_m = (pid // per_group) * group_m
    return first_m + (pid % per_group) // grid_n, (pid % per_group) % grid_n


def order_pid_not_band_local(pid, grid_m, grid_n, group_m):
    # pid_m from `pid % group_size` instead of `(pid % per_group) % group_size` (an early version of Triton's
    # matmul tutorial): right wherever the band starts at a multiple of its height, wrong in a short last band
    per_group = group_m * grid_n
    first_m = (pid // per_group) * group_m
    size = min(grid_m - first_m, group_m)
    return first_m + pid % size, (pid % per_group) // size


def sectors_stub(layout, lanes_along, n_rows, n_cols, element_bytes):
    raise NotImplementedError


def sectors_ignore_layout(layout, lanes_along, n_rows, n_cols, element_bytes):
    # treats every matrix as row-major
    return solutions.warp_sectors("row-major", lanes_along, n_rows, n_cols, element_bytes)


def sectors_ignore_lane_order(layout, lanes_along, n_rows, n_cols, element_bytes):
    # assumes the lanes always run along rows
    return solutions.warp_sectors(layout, 1, n_rows, n_cols, element_bytes)


def sectors_no_wrap(layout, lanes_along, n_rows, n_cols, element_bytes):
    # the lanes' stride alone, as if the dimension never ended: wrong for short dimensions
    contiguous = (layout == "row-major") == (lanes_along == 1)
    stride = 1 if contiguous else (n_cols if layout == "row-major" else n_rows)
    sectors = {(lane * stride * element_bytes) // 32 for lane in range(32)}
    lines = {(lane * stride * element_bytes) // 128 for lane in range(32)}
    return len(sectors), len(lines)


def sectors_assume_fp32(layout, lanes_along, n_rows, n_cols, element_bytes):
    return solutions.warp_sectors(layout, lanes_along, n_rows, n_cols, 4)


# ----------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_kernel_solution_is_solved(name, capsys):
    launcher, reference, cases = KERNEL_EXERCISES[name]
    verdict = check(f"ch04_matmul.{name}", launcher(getattr(solutions, name)), reference, cases, out=True)
    assert verdict.solved, verdict.message
    assert capsys.readouterr().out.startswith("✅ SOLVED — ch04_matmul.")


def test_grouped_order_solution_is_solved():
    verdict = check("ch04_matmul.grouped_program_order", every_program(solutions.grouped_program_order),
                    program_order_reference, grid_cases)
    assert verdict.solved, verdict.message


def test_grouped_order_solution_works_on_arrays():
    for grid_m, grid_n, group_m in [(7, 5, 3), (9, 4, 4)]:
        pid_m, pid_n = program_order(grid_m, grid_n, group_m)
        got_m, got_n = solutions.grouped_program_order(np.arange(grid_m * grid_n), grid_m, grid_n, group_m)
        np.testing.assert_array_equal(got_m, pid_m)
        np.testing.assert_array_equal(got_n, pid_n)
        got_m, got_n = solutions.grouped_program_order(torch.arange(grid_m * grid_n), grid_m, grid_n, group_m)
        assert got_m.tolist() == pid_m.tolist() and got_n.tolist() == pid_n.tolist()


def test_warp_sectors_solution_is_solved():
    verdict = check("ch04_matmul.warp_sectors", solutions.warp_sectors, warp_reference, warp_cases)
    assert verdict.solved, verdict.message
    assert solutions.warp_sectors("row-major", 1, 64, 64, 4) == (4, 1)
    assert solutions.warp_sectors("row-major", 0, 64, 64, 4) == (32, 32)


def test_grouped_kernel_matches_and_follows_the_order():
    from utils.trace import trace

    gen = torch.Generator().manual_seed(0)
    a, b = _rand(gen, 96, 40), _rand(gen, 40, 64)
    with trace(record_access=True) as t:
        c = solutions.grouped_matmul(a, b, GROUP_M=2, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)
    torch.testing.assert_close(c, a @ b, rtol=1e-5, atol=1e-5)
    owner = t.launches[0].access["c_ptr"]
    pid_m, pid_n = program_order(3, 2, 2)
    for pid in range(6):
        tile = owner[pid_m[pid] * 32:(pid_m[pid] + 1) * 32, pid_n[pid] * 32:(pid_n[pid] + 1) * 32]
        assert (tile == pid).all()


WRONG_KERNELS = [
    ("matmul_naive_kernel", naive_stub_kernel, "never written"),
    ("matmul_naive_kernel", naive_no_k_mask_kernel, "out of bounds"),
    ("matmul_naive_kernel", naive_contiguous_only_kernel, "wrong values"),
    ("matmul_naive_kernel", naive_first_chunk_only_kernel, "wrong values"),
    ("matmul_tiled_kernel", tiled_stub_kernel, "never written"),
    ("matmul_tiled_kernel", tiled_no_store_mask_kernel, "out of bounds"),
    ("matmul_tiled_kernel", tiled_no_k_mask_kernel, "out of bounds"),
    ("matmul_tiled_kernel", tiled_wrong_grid_kernel, "never written"),
    ("matmul_tiled_kernel", tiled_overwrites_accumulator_kernel, "wrong values"),
    ("matmul_tiled_kernel", tiled_column_major_kernel, "the tile order is column-major"),
    ("matmul_bias_gelu_kernel", bias_stub_kernel, "never written"),
    ("matmul_split_k_kernel", split_k_stub_kernel, "NaN"),
]


@pytest.mark.parametrize(("name", "kernel", "diagnosis"), WRONG_KERNELS,
                         ids=[kernel.fn.__name__ for _, kernel, _ in WRONG_KERNELS])
def test_wrong_kernel_is_not_solved(name, kernel, diagnosis):
    launcher, reference, cases = KERNEL_EXERCISES[name]
    verdict = check(f"ch04_matmul.{name}", launcher(kernel), reference, cases, out=True)
    assert not verdict.solved
    assert verdict.message.startswith(f"❌ NOT SOLVED — ch04_matmul.{name}")
    assert diagnosis in verdict.message, verdict.message


def test_column_major_tiles_have_right_values_so_only_the_order_check_catches_them():
    # Without the access-map check the column-major kernel is SOLVED: every value is right.
    plain = lambda a, b, out: solutions.tiled_matmul(a, b, out, kernel=tiled_column_major_kernel)  # noqa: E731
    assert check("ch04_matmul.matmul_tiled_kernel", plain, matmul_reference, matmul_cases, out=True).solved
    verdict = check("ch04_matmul.matmul_tiled_kernel", tiled_launcher(tiled_column_major_kernel), matmul_reference,
                    matmul_cases, out=True)
    assert not verdict.solved and "TileOrderError" in verdict.message and "3 x 2 tile grid" in verdict.message


def test_tile_order_problem_names_a_permuted_order():
    owner = np.repeat(np.repeat(np.array([[0, 1], [3, 2]]), 4, axis=0), 4, axis=1)
    assert tile_order_problem(owner, 4, 4) == ("program 3 computed tile (1, 0) of the 2 x 2 tile grid; in row-major "
                                               "order that tile is program 2's (pid // grid_n, pid % grid_n)")
    assert tile_order_problem(np.repeat(np.repeat(np.arange(4).reshape(2, 2), 4, 0), 4, 1), 4, 4) is None
    owner[0, 0] = -1  # an unwritten element: left to the value check
    assert tile_order_problem(owner, 4, 4) is None


@pytest.mark.parametrize(("variant", "diagnosis"), [("gelu_then_bias", "wrong values"), ("no_bias", "wrong values"),
                                                    ("tanh_gelu", "wrong values"), ("bias_by_row", "wrong values")])
def test_wrong_epilogue_is_not_solved(variant, diagnosis):
    verdict = check("ch04_matmul.matmul_bias_gelu_kernel", epilogue_variant(variant), bias_gelu_reference, bias_cases,
                    out=True)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


@pytest.mark.parametrize(("variant", "diagnosis"), [("whole_k", "wrong values"), ("runs_to_end", "wrong values"),
                                                    ("one_slot", "NaN")])
def test_wrong_split_k_is_not_solved(variant, diagnosis):
    verdict = check("ch04_matmul.matmul_split_k_kernel", split_k_variant(variant), split_k_reference, split_k_cases,
                    out=True)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


@pytest.mark.parametrize(
    ("candidate", "diagnosis"),
    [(order_stub, "not implemented yet"), (order_row_major, "wrong values"),
     (order_full_last_group, "wrong values"), (order_columns_fastest, "wrong values"),
     (order_pid_not_band_local, "wrong values")],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_wrong_program_order_is_not_solved(candidate, diagnosis):
    verdict = check("ch04_matmul.grouped_program_order", every_program(candidate), program_order_reference, grid_cases)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


@pytest.mark.parametrize(
    ("candidate", "diagnosis"),
    [(sectors_stub, "not implemented yet"), (sectors_ignore_layout, "wrong value"),
     (sectors_ignore_lane_order, "wrong value"), (sectors_no_wrap, "wrong value"),
     (sectors_assume_fp32, "wrong value")],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_wrong_warp_sectors_is_not_solved(candidate, diagnosis):
    verdict = check("ch04_matmul.warp_sectors", candidate, warp_reference, warp_cases)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys
    from solutions import ch04_matmul as s
    from utils.aot import compile_kernel

    TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
    CASES = [(s.matmul_naive_kernel, {"BLOCK_K": 128}, 1), (s.matmul_tiled_kernel, TILES, 8),
             (s.matmul_grouped_kernel, {**TILES, "GROUP_M": 8}, 8), (s.matmul_bias_gelu_kernel, TILES, 8),
             (s.matmul_split_k_kernel, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, 4)]
    types = lambda name: "*fp32" if name == "partial_ptr" else ("*bf16" if name.endswith("_ptr") else "i32")
    for fn, constexprs, warps in CASES:
        ptx = compile_kernel(fn, types, constexprs, aligned_pointers=False, num_warps=warps,
                             num_stages=3).asm["ptx"]
        if fn is not s.matmul_naive_kernel and "mma" not in ptx:
            sys.exit(f"{fn.__name__}: no tensor-core instruction in the PTX")
    print("ok")
    """
)


@pytest.mark.slow
def test_solution_kernels_compile_for_sm90(tmp_path):
    """The report times these kernels on a GPU: prove they are valid compiled Triton (and use tensor cores)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(COMPILE_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# The traffic verdict: A and B re-read per row and column of tiles, named against the tile sizes
# ----------------------------------------------------------------------------------------------


def tiled_check(launch):
    return check("ch04_matmul.matmul_tiled_kernel", launch, matmul_reference, matmul_cases, out=True,
                 traffic=solutions.tiled_traffic())


def test_tiled_solution_rereads_a_and_b_once_per_tile_column_and_row():
    verdict = tiled_check(tiled_launcher(solutions.matmul_tiled_kernel))
    assert verdict.solved, verdict.message
    report = verdict.traffic  # the last case: M = 45, K = 36, N = 50, fp32, 32 x 32 tiles
    assert report.reread == {"a": 2.0, "b": 2.0}  # ceil(50 / 32) column tiles, ceil(45 / 32) row tiles
    assert report.ideal == (45 * 36 + 36 * 50 + 45 * 50) * 4
    assert report.moved == (2 * 45 * 36 + 2 * 36 * 50 + 45 * 50) * 4
    text = " ".join(verdict.message.split())
    assert "a read 2.00× its size, b 2.00×" in text
    assert "(2 = ceil(N / BLOCK_N), N = 50, BLOCK_N = 32)" in text
    assert "(2 = ceil(M / BLOCK_M), M = 45, BLOCK_M = 32)" in text


def test_tiled_with_tiny_tiles_is_solved_with_higher_reread_factors():
    small_tiles = in_row_major_order(lambda a, b, out: solutions.tiled_matmul(a, b, out, BLOCK_M=16, BLOCK_N=16,
                                                                                BLOCK_K=16),
                                     block_m=16, block_n=16)
    verdict = tiled_check(small_tiles)
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"a": 4.0, "b": 3.0}  # ceil(50 / 16), ceil(45 / 16)
    assert verdict.traffic.ratio > tiled_check(tiled_launcher(solutions.matmul_tiled_kernel)).traffic.ratio
    text = " ".join(verdict.message.split())
    assert "a read 4.00× its size, b 3.00×" in text
    assert "BLOCK_N = 16" in text and "BLOCK_M = 16" in text and "larger tiles divide both" in text
