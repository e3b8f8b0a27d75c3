"""bench/ch13_gemm_cuda.py, the CUDA GEMM ladder's part of ``make gpu-check``: without CUDA its timings are
listed as unavailable with the reason (the smoke run on a CPU must not try to build the extension)."""

import pytest
import torch

from bench import ch13_below_triton
from bench import ch13_gemm_cuda as ch13
from bench.gpu import Check, Timing


@pytest.mark.skipif(torch.cuda.is_available(), reason="the unavailable path is the CPU's")
def test_gemm_entries_are_unavailable_without_cuda():
    assert ch13.gemm_unavailable() == "needs a CUDA device and a CUDA build of torch"
    entries = ch13._gemm_gpu_checks("smoke")
    assert entries and all(isinstance(e, Timing) for e in entries)
    assert all(e.unavailable == "needs a CUDA device and a CUDA build of torch" for e in entries)
    assert {e.impl for e in entries} >= {"ch13 CUDA naive", "ch13 CUDA cp.async", "ch13 CUDA wmma"}
    assert not any(isinstance(e, Check) for e in entries)
    assert {e.impl for e in entries} <= {e.impl for e in ch13_below_triton.gpu_checks("smoke")}


def test_launchers_cover_every_rung():
    # every kernel of the ladder is launched, each 16-byte path only behind gemm_vec_ok
    for kernel in (
        "gemm_naive<<<",
        "gemm_smem<32><<<",
        "gemm_regtile<BK, LAYOUT, true><<<",
        "gemm_regtile<BK, LAYOUT, false><<<",
        "gemm_cp_async<true><<<",
        "gemm_cp_async<false><<<",
        "gemm_wmma<true><<<",
        "gemm_wmma<false><<<",
    ):
        assert kernel in ch13._GEMM_LAUNCHERS, kernel
    assert ch13._GEMM_LAUNCHERS.count("gemm::gemm_vec_ok(") == 3
    for name in ch13._GEMM_FUNCTIONS:
        assert f"torch::Tensor {name}(" in ch13._GEMM_LAUNCHERS and f"torch::Tensor {name}(" in ch13._GEMM_DECLARATIONS
    assert all((ch13.GEMM_SRC / f"gemm_{r}.cuh").is_file() for r in ("naive", "smem", "regtile", "cp_async", "wmma"))
