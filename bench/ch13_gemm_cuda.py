"""Chapter 13's CUDA GEMM ladder on a GPU: the part of ``make gpu-check`` that builds and runs it.

:func:`_gemm_gpu_checks` builds the rungs of ``chapters/13_below_triton/src/cuda/gemm_*.cuh`` into a torch
extension (``torch.utils.cpp_extension.load_inline``, host launchers below) on a machine with CUDA torch and
``nvcc``, checks each rung against a float64 matmul at 4096³ and at odd sizes (the element-by-element edge
paths), and times them against cuBLAS (``torch.matmul``: fp32 SGEMM for the fp32 rungs, bf16 for the
tensor-core rung). Where the extension cannot be built, its timings are listed as unavailable with the reason.
:func:`bench.ch13_below_triton.gpu_checks` gathers this part with the chapter's others.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# ----------------------------------------------------------------------------------------------
# The CUDA GEMM ladder
# ----------------------------------------------------------------------------------------------

GEMM_SRC = Path(__file__).resolve().parents[1] / "chapters" / "13_below_triton" / "src" / "cuda"

#: The host side of the ladder: one launcher per rung, C = A @ B (A, B row-major; C fp32, new).
_GEMM_LAUNCHERS = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include "gemm_naive.cuh"
#include "gemm_smem.cuh"
#include "gemm_regtile.cuh"
#include "gemm_cp_async.cuh"
#include "gemm_wmma.cuh"

namespace {

torch::Tensor output(const torch::Tensor& a, const torch::Tensor& b, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda(), "kernel_ladder.", op, ": a and b must be CUDA tensors");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "kernel_ladder.", op,
              ": expected a (M, K) and b (K, N), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == dtype && b.scalar_type() == dtype, "kernel_ladder.", op, ": expected ", dtype,
              " a and b, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "kernel_ladder.", op, ": a and b must be contiguous");
  return torch::empty({a.size(0), b.size(1)}, a.options().dtype(torch::kFloat32));
}

dim3 tiles(const torch::Tensor& c, int tile_m, int tile_n) {
  return dim3((c.size(1) + tile_n - 1) / tile_n, (c.size(0) + tile_m - 1) / tile_m);
}

}  // namespace

torch::Tensor gemm_naive_cuda(torch::Tensor a, torch::Tensor b) {
  auto c = output(a, b, torch::kFloat32, "gemm_naive");
  gemm_naive<<<tiles(c, 16, 16), dim3(16, 16), 0, c10::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), c.size(0), c.size(1), a.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}

torch::Tensor gemm_smem_cuda(torch::Tensor a, torch::Tensor b) {
  auto c = output(a, b, torch::kFloat32, "gemm_smem");
  gemm_smem<32><<<tiles(c, 32, 32), dim3(32, 32), 0, c10::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), c.size(0), c.size(1), a.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}

template <int BK, int LAYOUT>
void regtile(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& c) {
  const float *pa = a.data_ptr<float>(), *pb = b.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  const long long m = c.size(0), n = c.size(1), k = a.size(1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (gemm::gemm_vec_ok(pa, pb, pc, n, k, 4))
    gemm_regtile<BK, LAYOUT, true><<<tiles(c, 128, 128), 256, 0, stream>>>(pa, pb, pc, m, n, k);
  else
    gemm_regtile<BK, LAYOUT, false><<<tiles(c, 128, 128), 256, 0, stream>>>(pa, pb, pc, m, n, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

torch::Tensor gemm_regtile_cuda(torch::Tensor a, torch::Tensor b, int64_t bk, int64_t layout) {
  auto c = output(a, b, torch::kFloat32, "gemm_regtile");
  TORCH_CHECK((bk == 8 || bk == 16) && 0 <= layout && layout <= 2, "kernel_ladder.gemm_regtile: bk must be 8 or 16 "
              "and layout 0 (plain), 1 (padded) or 2 (swizzled), got bk=", bk, ", layout=", layout);
  if (bk == 8) {
    if (layout == 0) regtile<8, 0>(a, b, c);
    else if (layout == 1) regtile<8, 1>(a, b, c);
    else regtile<8, 2>(a, b, c);
  } else {
    if (layout == 0) regtile<16, 0>(a, b, c);
    else if (layout == 1) regtile<16, 1>(a, b, c);
    else regtile<16, 2>(a, b, c);
  }
  return c;
}

torch::Tensor gemm_cp_async_cuda(torch::Tensor a, torch::Tensor b) {
  auto c = output(a, b, torch::kFloat32, "gemm_cp_async");
  const float *pa = a.data_ptr<float>(), *pb = b.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (gemm::gemm_vec_ok(pa, pb, pc, c.size(1), a.size(1), 4))
    gemm_cp_async<true><<<tiles(c, 128, 128), 256, 0, stream>>>(pa, pb, pc, c.size(0), c.size(1), a.size(1));
  else
    gemm_cp_async<false><<<tiles(c, 128, 128), 256, 0, stream>>>(pa, pb, pc, c.size(0), c.size(1), a.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}

torch::Tensor gemm_wmma_cuda(torch::Tensor a, torch::Tensor b) {
  auto c = output(a, b, torch::kBFloat16, "gemm_wmma");
  auto pa = reinterpret_cast<const __nv_bfloat16*>(a.data_ptr());
  auto pb = reinterpret_cast<const __nv_bfloat16*>(b.data_ptr());
  float* pc = c.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (gemm::gemm_vec_ok(pa, pb, pc, c.size(1), a.size(1), 8))
    gemm_wmma<true><<<tiles(c, 128, 128), 256, 0, stream>>>(pa, pb, pc, c.size(0), c.size(1), a.size(1));
  else
    gemm_wmma<false><<<tiles(c, 128, 128), 256, 0, stream>>>(pa, pb, pc, c.size(0), c.size(1), a.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}
"""

_GEMM_DECLARATIONS = """
torch::Tensor gemm_naive_cuda(torch::Tensor a, torch::Tensor b);
torch::Tensor gemm_smem_cuda(torch::Tensor a, torch::Tensor b);
torch::Tensor gemm_regtile_cuda(torch::Tensor a, torch::Tensor b, int64_t bk, int64_t layout);
torch::Tensor gemm_cp_async_cuda(torch::Tensor a, torch::Tensor b);
torch::Tensor gemm_wmma_cuda(torch::Tensor a, torch::Tensor b);
"""

_GEMM_FUNCTIONS = ["gemm_naive_cuda", "gemm_smem_cuda", "gemm_regtile_cuda", "gemm_cp_async_cuda", "gemm_wmma_cuda"]

#: (M, N, K) of the checks: the timed square, and odd sizes that take the element-by-element edge paths.
GEMM_SIZES = {
    "gpu": {"square": 4096, "odd": (1000, 1001, 999)},
    "smoke": {"square": 256, "odd": (100, 33, 17)},
}


def gemm_unavailable() -> str:
    """Why the CUDA GEMM ladder cannot be built and run here ("" when it can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device and a CUDA build of torch"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "needs nvcc (the CUDA toolkit) to build the extension"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return "needs sm_80 or newer (bf16 tensor cores, cp.async)"
    return ""


@functools.cache
def gemm_extension():
    """The ladder's rungs as a torch extension (built once per process, cached by torch on disk)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="kernel_ladder_ch13_gemm",
        cpp_sources=_GEMM_DECLARATIONS,
        cuda_sources=_GEMM_LAUNCHERS,
        functions=_GEMM_FUNCTIONS,
        extra_include_paths=[str(GEMM_SRC)],
        extra_cuda_cflags=["-O3", "-std=c++17"],
        verbose=False,
    )


def _gemm_rungs() -> list[tuple[str, object]]:
    """(name, fn(a, b)) of every fp32 rung."""
    ext = gemm_extension()
    rungs = [("naive (one thread per output)", ext.gemm_naive_cuda), ("shared-memory tiles 32x32", ext.gemm_smem_cuda)]
    for bk in (8, 16):
        for layout, label in enumerate(("plain", "padded", "swizzled")):
            rungs.append(
                (
                    f"register tiles 8x8, BK={bk}, A tile {label}",
                    lambda a, b, bk=bk, layout=layout: ext.gemm_regtile_cuda(a, b, bk, layout),
                )
            )
    rungs.append(("cp.async double buffering", ext.gemm_cp_async_cuda))
    return rungs


def _gemm_gpu_checks(size: str) -> list:
    """The CUDA GEMM ladder's checks and timings (see the module docstring)."""
    from bench.gpu import Check, Timing

    shapes = GEMM_SIZES["gpu" if size == "gpu" else "smoke"]
    n = shapes["square"]
    f32_op, bf16_op = f"CUDA GEMM ladder {n}³ fp32", f"CUDA GEMM ladder {n}³ bf16 in, fp32 out"
    flops, f32_bytes, bf16_bytes = 2 * n**3, 3 * n * n * 4, 2 * n * n * 2 + n * n * 4
    reason = gemm_unavailable()
    if reason:
        names = ["naive", "shared-memory tiles", "register tiles", "cp.async", "wmma"]
        return [
            Timing(
                f32_op if name != "wmma" else bf16_op,
                f"ch13 CUDA {name}",
                lambda: None,
                bytes=f32_bytes,
                flops=flops,
                unavailable=reason,
            )
            for name in names
        ]

    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(13)
    a, b = (torch.randn(n, n, generator=gen).to(device) for _ in range(2))
    om, on, ok = shapes["odd"]
    oa, ob = torch.randn(om, ok, generator=gen).to(device), torch.randn(ok, on, generator=gen).to(device)

    def exact(x, y):
        return (x.double() @ y.double()).float()

    entries: list = []
    rungs = _gemm_rungs()
    for name, fn in rungs:
        entries += [
            Check(f"ch13 CUDA GEMM {name} {n}³", torch.float32, lambda fn=fn: fn(a, b), lambda: exact(a, b)),
            Check(
                f"ch13 CUDA GEMM {name} {om}x{on}x{ok}", torch.float32, lambda fn=fn: fn(oa, ob), lambda: exact(oa, ob)
            ),
        ]
    wmma = gemm_extension().gemm_wmma_cuda
    a16, b16, oa16, ob16 = a.bfloat16(), b.bfloat16(), oa.bfloat16(), ob.bfloat16()
    entries += [
        # against the exact product of the bf16 inputs: only the fp32 accumulation's rounding may differ
        Check(f"ch13 CUDA GEMM wmma bf16 {n}³", torch.float32, lambda: wmma(a16, b16), lambda: exact(a16, b16)),
        Check(
            f"ch13 CUDA GEMM wmma bf16 {om}x{on}x{ok}",
            torch.float32,
            lambda: wmma(oa16, ob16),
            lambda: exact(oa16, ob16),
        ),
    ]

    entries.append(
        Timing(
            f32_op,
            "torch.matmul fp32 (cuBLAS SGEMM)",
            lambda: torch.matmul(a, b),
            bytes=f32_bytes,
            flops=flops,
            baseline=True,
        )
    )
    for name, fn in rungs:
        target = (
            "within 2x of cuBLAS SGEMM"
            if name.startswith(("register tiles 8x8, BK=8, A tile swizzled", "cp.async"))
            else ""
        )
        entries.append(
            Timing(f32_op, f"ch13 CUDA {name}", lambda fn=fn: fn(a, b), bytes=f32_bytes, flops=flops, target=target)
        )
    entries += [
        Timing(
            bf16_op,
            "torch.matmul bf16 (cuBLAS)",
            lambda: torch.matmul(a16, b16),
            bytes=bf16_bytes,
            flops=flops,
            baseline=True,
        ),
        Timing(
            bf16_op,
            "ch13 CUDA wmma + cp.async",
            lambda: wmma(a16, b16),
            bytes=bf16_bytes,
            flops=flops,
            target="faster than every fp32 rung; a fraction of cuBLAS (no ldmatrix, 2 stages)",
        ),
    ]
    return entries


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------
