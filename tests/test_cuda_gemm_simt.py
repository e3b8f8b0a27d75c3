"""The CUDA GEMM ladder (chapters/13_below_triton/src/cuda/gemm_*.cuh) run on the CPU by utils.simt, thread by
thread, against a float64 matmul — every rung on awkward M, N, K (1, 17, 33, 64, 100: not multiples of the
tiles), with C poisoned (NaN) first so that an element no thread stores shows.

The fp32 rungs match to fp32 rounding; the tensor-core rung (bf16 in, fp32 accumulate) matches the float64
product of its bf16-rounded inputs to fp32 rounding, and the float64 product of the unrounded inputs to a bf16
tolerance. The 16-byte paths (VEC = true) run where the host would pick them (``gemm_vec_ok``: K and N
multiples of 4 floats / 8 bf16), the element-by-element ones on every case.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from utils import simt

SRC = Path(__file__).resolve().parents[1] / "chapters" / "13_below_triton" / "src" / "cuda"

#: (M, N, K): 1-sized dimensions, sizes past one tile, K past one step, sizes the 16-byte path takes
SIZES = [(1, 1, 1), (17, 33, 100), (100, 17, 33), (33, 100, 64), (64, 64, 64), (100, 100, 17), (1, 64, 100)]

#: rung -> (file, kernel template, block, tile of C per block, elements per 16 bytes (0: no VEC argument))
RUNGS = {
    "naive": ("gemm_naive.cuh", "gemm_naive", (16, 16), (16, 16), 0),
    "smem": ("gemm_smem.cuh", "gemm_smem<16>", (16, 16), (16, 16), 0),
    "regtile plain BK=8": ("gemm_regtile.cuh", "gemm_regtile<8, 0, {vec}>", (256,), (128, 128), 4),
    "regtile padded BK=8": ("gemm_regtile.cuh", "gemm_regtile<8, 1, {vec}>", (256,), (128, 128), 4),
    "regtile swizzled BK=8": ("gemm_regtile.cuh", "gemm_regtile<8, 2, {vec}>", (256,), (128, 128), 4),
    "regtile padded BK=16": ("gemm_regtile.cuh", "gemm_regtile<16, 1, {vec}>", (256,), (128, 128), 4),
    "regtile swizzled BK=16": ("gemm_regtile.cuh", "gemm_regtile<16, 2, {vec}>", (256,), (128, 128), 4),
    "cp_async": ("gemm_cp_async.cuh", "gemm_cp_async<{vec}>", (256,), (128, 128), 4),
    "wmma": ("gemm_wmma.cuh", "gemm_wmma<{vec}>", (256,), (128, 128), 8),
}


def run(rung: str, a: torch.Tensor, b: torch.Tensor, vec: bool) -> torch.Tensor:
    file, kernel, block, (tile_m, tile_n), _ = RUNGS[rung]
    (m, k), n = a.shape, b.shape[1]
    c = torch.full((m, n), float("nan"), dtype=torch.float32)
    grid = (math.ceil(n / tile_n), math.ceil(m / tile_m))
    simt.launch(SRC / file, kernel.format(vec="true" if vec else "false"), grid, block, [a, b, c, m, n, k])
    return c


def inputs(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)


def paths(rung: str, n: int, k: int) -> list[bool]:
    per_16_bytes = RUNGS[rung][4]
    if not per_16_bytes:
        return [False]
    return [False, True] if n % per_16_bytes == 0 and k % per_16_bytes == 0 else [False]


@pytest.mark.parametrize("m, n, k", SIZES)
@pytest.mark.parametrize("rung", [r for r in RUNGS if r != "wmma"])
def test_fp32_rungs_match_float64(rung, m, n, k):
    a, b = inputs(m, n, k, seed=m * 10_000 + n * 100 + k)
    expected = (a.double() @ b.double()).float()
    for vec in paths(rung, n, k):
        c = run(rung, a, b, vec)
        assert not c.isnan().any(), f"{rung} vec={vec}: {int(c.isnan().sum())} elements of C never stored"
        torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-5 * math.sqrt(k), msg=f"{rung} vec={vec}")


@pytest.mark.parametrize("m, n, k", SIZES + [(100, 64, 64)])
def test_tensor_core_rung_matches_float64(m, n, k):
    a, b = inputs(m, n, k, seed=m * 10_000 + n * 100 + k + 1)
    a16, b16 = a.bfloat16(), b.bfloat16()
    exact = (a16.double() @ b16.double()).float()  # the products of the bf16 inputs, summed without rounding
    for vec in paths("wmma", n, k):
        c = run("wmma", a16, b16, vec)
        assert not c.isnan().any(), f"vec={vec}: {int(c.isnan().sum())} elements of C never stored"
        torch.testing.assert_close(c, exact, rtol=1e-5, atol=1e-5 * math.sqrt(k), msg=f"wmma vec={vec}")
        # against the unrounded inputs: bf16's 8-bit mantissa, about 2^-8 relative per input
        torch.testing.assert_close(c, (a.double() @ b.double()).float(), rtol=2e-2, atol=2e-2 * math.sqrt(k))


def test_a_wrong_tile_fails_the_comparison():
    # negative control: the naive rung launched with a grid one block short in x leaves columns unwritten
    a, b = inputs(17, 33, 5, seed=3)
    c = torch.full((17, 33), float("nan"))
    simt.launch(SRC / "gemm_naive.cuh", "gemm_naive", (2, 2), (16, 16), [a, b, c, 17, 33, 5])
    assert c[:, 32].isnan().all() and not c[:, :32].isnan().any()
