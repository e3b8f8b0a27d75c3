"""The native extension's CUDA kernels compiled for sm_90 and read as SASS, without a GPU.

Every kernel instantiation ``ops_cuda.cu`` can launch (float32, bfloat16, float16 with 128-bit packs and with
the scalar path; float64 scalar; and every dtype's column-stride path, STRIDED, for inputs whose last-dim stride is
not 1) is compiled with the flags torch's extension builder gives nvcc, and checked: nothing spills and nothing
lives in local memory; registers leave the occupancy the headers claim (32 warps an SM for the forward kernels'
vector paths and block kernels, 16 for the rest); the vector paths load with ``LDG.E.128`` and the scalar and
column-stride paths never do; every reduction is a butterfly of ``SHFL.BFLY``; block-per-row
kernels meet at ``BAR.SYNC`` and exchange through shared memory (``STS``/``LDS``), warp-per-row forward kernels
never do. Each assertion helper is shown to fail on a variant built to break its property.
Also: ``ops_cuda.cu`` itself (the host launchers) compiles with nvcc against torch's headers.
"""

from __future__ import annotations

import re
import subprocess
import sysconfig
from pathlib import Path

import pytest

from utils import nvcc
from utils.aot import occupancy

pytestmark = pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc on this machine")

CUDA_DIR = Path(__file__).resolve().parents[1] / "kernels" / "kernel_ladder" / "native" / "csrc" / "cuda"
#: what torch.utils.cpp_extension passes nvcc for every CUDA source of an extension (its COMMON_NVCC_FLAGS)
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]

#: element type -> (accumulator type, the vector width of its 128-bit path; 1: scalar only)
TYPES = {"float": ("float", 4), "__nv_bfloat16": ("float", 8), "__half": ("float", 8), "double": ("double", 1)}
ROW_KERNELS = [f"{op}_{kind}" for op in ("rms_norm_forward", "rms_norm_backward", "softmax_forward",
                                         "softmax_backward") for kind in ("warp", "block")]  # fmt: skip


def _signature(kernel: str, t: str, acc: str) -> str:
    ll = "long long"
    if kernel.startswith("rms_norm_forward"):
        return f"(const {t}*, const {t}*, {t}*, {acc}*, {ll}, {ll}, {ll}, float, {ll}, {ll})"
    if kernel.startswith("rms_norm_backward"):
        pointers = f"const {t}*, const {t}*, const {t}*, const {acc}*, {t}*, {acc}*"
        return f"({pointers}, {', '.join([ll] * 8)})"
    if kernel.startswith("softmax_forward"):
        return f"(const {t}*, {t}*, {ll}, {ll}, {ll}, {ll})"
    return f"(const {t}*, const {t}*, {t}*, {', '.join([ll] * 6)})"


def launched_variants() -> list[tuple[str, str, int, bool]]:
    """(kernel, element type, vector width, column-strided) of every row kernel ops_cuda.cu can launch: the
    stride-1 paths (128-bit packs, scalar) and the column-stride path (scalar, any last-dim stride)."""
    return [
        (k, t, vec, strided)
        for t, (_, full) in TYPES.items()
        for vec, strided in [*((v, False) for v in sorted({1, full})), (1, True)]
        for k in ROW_KERNELS
    ]


def instantiations() -> list[str]:
    lines = [
        f"template __global__ void {name(k, t, vec, strided)}{_signature(k, t, TYPES[t][0])};"
        for k, t, vec, strided in launched_variants()
    ]
    lines += [
        f"template __global__ void rms_norm_weight_grad_reduce<{t}>(const {acc}*, {t}*, long long, long long);"
        for t, (acc, _) in TYPES.items()
    ]
    return lines


@pytest.fixture(scope="module")
def build():
    return nvcc.compile_cuda(CUDA_DIR / "softmax.cuh", instantiate=instantiations(), flags=TORCH_NVCC_FLAGS)


def name(kernel: str, t: str, vec: int, strided: bool = False) -> str:
    return f"{kernel}<{t}, {vec}, {str(strided).lower()}>"


def opcodes(build, kernel: str) -> list[str]:
    return [i.opcode for i in build.instructions(kernel) if i.predicate != "!PT"]


# ----------------------------------------------------------------------------------------------------------
# Assertion helpers (each one shown to fail on a broken variant below)
# ----------------------------------------------------------------------------------------------------------


def assert_no_local_memory(build, kernel: str) -> None:
    """ptxas reports no spills and no stack frame, and no instruction touches local memory (LDL/STL)."""
    info = build.info(kernel)
    local = [op for op in opcodes(build, kernel) if op.split(".")[0] in ("LDL", "STL")]
    assert info.spill_stores == info.spill_loads == info.stack == 0 and not local, (
        f"{kernel}: spills {info.spill_stores}/{info.spill_loads} bytes, stack {info.stack}, local accesses {local[:4]}"
    )


def assert_resident_warps(build, kernel: str, warps_per_block: int, at_least: int) -> None:
    """At least ``at_least`` warps of this kernel fit on an sm_90 SM (registers and shared memory)."""
    info = build.info(kernel)
    occ = occupancy(info.registers, info.shared, warps_per_block)
    assert occ.warps_per_sm >= at_least, (
        f"{kernel}: {info.registers} registers, {info.shared} B shared: {occ.warps_per_sm} warps an SM "
        f"(limited by {occ.limiter}), fewer than {at_least}"
    )


def global_loads(build, kernel: str) -> list[str]:
    return [op for op in opcodes(build, kernel) if op.startswith("LDG")]


def assert_wide_loads(build, kernel: str, only: bool = False) -> None:
    """The kernel loads global memory 128 bits at a time (``only``: every global load is 128-bit)."""
    loads = global_loads(build, kernel)
    wide = [op for op in loads if op.startswith("LDG.E.128")]
    assert wide, f"{kernel}: no LDG.E.128 among its global loads {sorted(set(loads))}"
    if only:
        assert len(wide) == len(loads), f"{kernel}: narrower global loads {sorted(set(loads) - set(wide))}"


def assert_no_wide_loads(build, kernel: str) -> None:
    wide = [op for op in global_loads(build, kernel) if op.startswith("LDG.E.128")]
    assert not wide, f"{kernel}: {len(wide)} LDG.E.128 on the scalar path"


def assert_shuffle_reductions(build, kernel: str, reductions: int) -> None:
    """``reductions`` butterflies over 32 lanes: 5 SHFL.BFLY each (two per step for 64-bit values)."""
    ops = opcodes(build, kernel)
    bfly = sum(op.startswith("SHFL.BFLY") for op in ops)
    assert bfly >= 5 * reductions, f"{kernel}: {bfly} SHFL.BFLY, fewer than {5 * reductions}"


def assert_block_exchange(build, kernel: str) -> None:
    """Warps meet at a barrier and exchange through shared memory."""
    ops = opcodes(build, kernel)
    bases = {op.split(".")[0] for op in ops}
    assert "BAR" in bases and any(op.startswith("BAR.SYNC") for op in ops), f"{kernel}: no BAR.SYNC"
    assert {"STS", "LDS"} <= bases, f"{kernel}: shared-memory accesses {sorted(bases & {'STS', 'LDS'})}"


def assert_warp_only(build, kernel: str) -> None:
    """No barrier, no shared memory: the warp's lanes exchange by shuffles alone."""
    bases = {op.split(".")[0] for op in opcodes(build, kernel)}
    found = bases & {"BAR", "STS", "LDS"}
    assert not found and build.info(kernel).shared == 0, f"{kernel}: {sorted(found)}"


# ----------------------------------------------------------------------------------------------------------
# Every launched kernel
# ----------------------------------------------------------------------------------------------------------


def test_every_kernel_the_launcher_names_is_compiled(build):
    source = (CUDA_DIR / "ops_cuda.cu").read_text()
    launched = set(re.findall(r"(\w+)<T(?:, VEC, STRIDED)?><<<", source))
    assert launched == set(ROW_KERNELS) | {"rms_norm_weight_grad_reduce"}
    assert len(build.kernels) == len(launched_variants()) + len(TYPES)


@pytest.mark.parametrize(("kernel", "t", "vec", "strided"), launched_variants(), ids=lambda v: str(v))
def test_no_spills_no_local_memory(build, kernel, t, vec, strided):
    assert_no_local_memory(build, name(kernel, t, vec, strided))


@pytest.mark.parametrize(("kernel", "t", "vec", "strided"), launched_variants(), ids=lambda v: str(v))
def test_registers_leave_the_claimed_occupancy(build, kernel, t, vec, strided):
    """Forward kernels: 32 warps an SM (64 registers), except the warp kernels' scalar path (a lane holds 32
    separate values): 16; backward kernels (x and the running sums kept): 16 (128 registers)."""
    warps = 4 if kernel.endswith("warp") else 8
    at_least = (
        32 if kernel.startswith(("rms_norm_forward", "softmax_forward")) and (vec > 1 or "block" in kernel) else 16
    )
    assert_resident_warps(build, name(kernel, t, vec, strided), warps, at_least)


@pytest.mark.parametrize(("kernel", "t", "vec", "strided"), launched_variants(), ids=lambda v: str(v))
def test_vector_paths_load_128_bits_and_scalar_paths_never(build, kernel, t, vec, strided):
    k = name(kernel, t, vec, strided)
    if vec > 1:
        # forward kernels load only x (and w) in packs; backward ones also load rstd, one float per row
        assert_wide_loads(build, k, only="forward" in kernel)
    else:
        assert_no_wide_loads(build, k)


@pytest.mark.parametrize(("kernel", "t", "vec", "strided"), launched_variants(), ids=lambda v: str(v))
def test_reductions_are_warp_shuffles(build, kernel, t, vec, strided):
    reductions = 2 if kernel.startswith("softmax_forward") else 1  # the maximum and the sum
    assert_shuffle_reductions(build, name(kernel, t, vec, strided), reductions)


@pytest.mark.parametrize(("kernel", "t", "vec", "strided"), launched_variants(), ids=lambda v: str(v))
def test_block_kernels_use_shared_memory_and_forward_warp_kernels_do_not(build, kernel, t, vec, strided):
    k = name(kernel, t, vec, strided)
    if kernel.endswith("block") or kernel == "rms_norm_backward_warp":  # the latter adds its warps' dw at the end
        assert_block_exchange(build, k)
    else:
        assert_warp_only(build, k)


@pytest.mark.parametrize("t", list(TYPES))
def test_weight_grad_reduce(build, t):
    k = f"rms_norm_weight_grad_reduce<{t}>"
    assert_no_local_memory(build, k)
    assert_block_exchange(build, k)
    assert_resident_warps(build, k, 16, 32)


# ----------------------------------------------------------------------------------------------------------
# Negative controls: each helper fails on a variant built to break its property
# ----------------------------------------------------------------------------------------------------------

CONTROLS = r"""
#include "common.cuh"
using namespace kl_cuda;

// A row in a local array indexed at run time: it lives in local memory.
__global__ void runtime_indexed(const float* __restrict__ x, const int* __restrict__ idx, float* __restrict__ y) {
  float row[256];
  for (int i = 0; i < 256; ++i) row[i] = x[i * 32 + threadIdx.x];
  y[threadIdx.x] = row[idx[threadIdx.x]];
}

// 128 floats a thread in registers and no launch bounds: far more than 64 registers.
__global__ void register_hungry(const float4* __restrict__ x, float* __restrict__ y) {
  float4 v[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) v[k] = x[k * 1024 + threadIdx.x];
  float s = 0;
#pragma unroll
  for (int k = 0; k < 32; ++k) s += v[k].x * v[k].y + v[k].z * v[k].w;
#pragma unroll
  for (int k = 0; k < 32; ++k) y[k * 1024 + threadIdx.x] = s * (v[k].x + v[k].y - v[k].z * v[k].w);
}

// Four floats in a struct without alignas(16): the compiler cannot assume 16-byte alignment.
struct Unaligned { float v[4]; };
__global__ void unaligned_pack(const float* __restrict__ x, float* __restrict__ y) {
  const Unaligned p = *reinterpret_cast<const Unaligned*>(x + 4 * threadIdx.x);
  y[threadIdx.x] = p.v[0] + p.v[1] + p.v[2] + p.v[3];
}

// A row sum through shared memory only: a tree of barriers, no shuffle.
__global__ void shared_tree_sum(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float s[256];
  s[threadIdx.x] = x[blockIdx.x * 256 + threadIdx.x];
  __syncthreads();
  for (int half = 128; half > 0; half >>= 1) {
    if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) y[blockIdx.x] = s[0];
}
"""


@pytest.fixture(scope="module")
def controls():
    return nvcc.compile_cuda(CONTROLS, include_dirs=[CUDA_DIR], flags=TORCH_NVCC_FLAGS)


def test_control_runtime_indexed_array_is_local_memory(controls):
    with pytest.raises(AssertionError, match="stack"):
        assert_no_local_memory(controls, "runtime_indexed")


def test_control_register_hungry_kernel_fails_the_occupancy_bound(controls):
    assert controls.info("register_hungry").registers > 64
    with pytest.raises(AssertionError, match="fewer than 32"):
        assert_resident_warps(controls, "register_hungry", 8, 32)


def test_control_scalar_and_unaligned_loads_are_not_wide(build, controls):
    with pytest.raises(AssertionError, match="no LDG.E.128"):
        assert_wide_loads(build, "rms_norm_forward_warp<float, 1, false>")
    with pytest.raises(AssertionError, match="no LDG.E.128"):
        assert_wide_loads(controls, "unaligned_pack")
    with pytest.raises(AssertionError, match="on the scalar path"):
        assert_no_wide_loads(build, "rms_norm_forward_warp<float, 4, false>")
    with pytest.raises(AssertionError, match="narrower global loads"):  # rstd: one float per row
        assert_wide_loads(build, "rms_norm_backward_warp<float, 4, false>", only=True)


def test_control_shared_memory_tree_has_no_shuffles(controls):
    with pytest.raises(AssertionError, match="SHFL.BFLY"):
        assert_shuffle_reductions(controls, "shared_tree_sum", 1)
    assert_block_exchange(controls, "shared_tree_sum")


def test_control_block_and_warp_kernels_fail_each_others_helper(build):
    with pytest.raises(AssertionError, match="BAR"):
        assert_warp_only(build, "softmax_forward_block<__nv_bfloat16, 8, false>")
    with pytest.raises(AssertionError, match="no BAR.SYNC"):
        assert_block_exchange(build, "softmax_forward_warp<__nv_bfloat16, 8, false>")


# ----------------------------------------------------------------------------------------------------------
# The host launchers
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ops_cuda_host_code_compiles_against_torch_headers(tmp_path):
    """nvcc -c of ops_cuda.cu for sm_90 against this torch's headers (a CPU build ships ATen/cuda and c10/cuda):
    a syntax and type check of the launchers and the TORCH_LIBRARY_IMPL registration. ``cuda_cmake_macros.h``
    is generated only in CUDA builds of torch; C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips it (it only sets the
    Windows export macro)."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    if not Path(includes[0], "c10", "cuda", "CUDAStream.h").is_file():
        pytest.skip("this torch ships no c10/cuda headers")
    command = [nvcc.find_nvcc(), "-c", "-std=c++20", "-arch=sm_90", "-Xcompiler", "-fPIC",
               "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DTORCH_EXTENSION_NAME=kernel_ladder_native",
               *TORCH_NVCC_FLAGS, *(f"-I{d}" for d in includes),
               str(CUDA_DIR / "ops_cuda.cu"), "-o", str(tmp_path / "ops_cuda.o")]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    own = [line for line in log.splitlines() if "ops_cuda.cu" in line or ".cuh" in line]
    assert not own, "warnings in the extension's own files:\n" + "\n".join(own)
    assert (tmp_path / "ops_cuda.o").stat().st_size > 0
