"""utils.nvcc: CUDA C++ compiled for sm_90 on a machine without a GPU, ptxas's report and the SASS per kernel."""

import pytest

from utils import nvcc

pytestmark = pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc on this machine")

SOURCE = r"""
template <typename T, int SCALE>
__global__ void scale_kernel(const T* __restrict__ x, T* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * SCALE;
}
__global__ void row_sum_kernel(const float4* __restrict__ x, float* __restrict__ out) {
  float4 v = x[blockIdx.x * 32 + threadIdx.x];
  float s = v.x + v.y + v.z + v.w;
  for (int offset = 16; offset; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}
"""


def test_kernels_named_by_base_name_and_instantiation():
    build = nvcc.compile_cuda(SOURCE, instantiate=[
        "template __global__ void scale_kernel<float, 2>(const float*, float*, int);",
        "template __global__ void scale_kernel<double, 3>(const double*, double*, int);",
    ])
    assert len(build.kernels) == 3
    with pytest.raises(KeyError, match="2 kernels named 'scale_kernel'"):
        build.mangled("scale_kernel")
    assert build.info("scale_kernel<double, 3>").registers > 0
    assert build.info("row_sum_kernel").spill_stores == 0
    opcodes = [i.opcode for i in build.instructions("row_sum_kernel")]
    assert any(op.startswith("LDG.E.128") for op in opcodes)
    assert sum(op.startswith("SHFL.BFLY") for op in opcodes) == 5
    # the double kernel's SASS is its own: no shuffles in it, and 64-bit float multiplies
    double_ops = [i.opcode for i in build.instructions("scale_kernel<double, 3>")]
    assert not any(op.startswith("SHFL") for op in double_ops)
    assert any(op.startswith("DMUL") for op in double_ops)


def test_a_base_name_is_not_a_prefix_of_another():
    build = nvcc.compile_cuda("__global__ void scale(float* y) { y[0] = 1; }\n"
                              "__global__ void scale_racy(float* y) { y[threadIdx.x] = 2; }")
    assert build.mangled("scale") != build.mangled("scale_racy")
    assert build.mangled("scale_r") == build.mangled("scale_racy")  # a signature's start, where no base name is


def test_uninstantiated_template_has_no_kernel():
    build = nvcc.compile_cuda(SOURCE)
    with pytest.raises(KeyError, match="no kernel named 'scale_kernel'"):
        build.mangled("scale_kernel")


def test_compile_error_carries_the_log():
    with pytest.raises(nvcc.CudaCompileError, match='identifier "undefined_name" is undefined') as info:
        nvcc.compile_cuda("__global__ void broken() { undefined_name = 1; }")
    assert "source.cu" in str(info.value) and ".build-" not in str(info.value)


def test_spills_are_reported():
    # a large local array indexed at run time lives in local memory: ptxas reports its stack frame
    source = r"""
    __global__ void local_array(const int* idx, float* out) {
      float buf[256];
      for (int i = 0; i < 256; ++i) buf[i] = i * 0.5f;
      out[threadIdx.x] = buf[idx[threadIdx.x]];
    }
    """
    info = nvcc.compile_cuda(source).info("local_array")
    assert info.stack >= 1024


def test_parse_ptxas_reads_every_field():
    log = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'
ptxas info    : Function properties for _Z1kv
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem
"""
    assert nvcc.parse_ptxas(log) == {"_Z1kv": nvcc.PtxasInfo(40, 8, 4, 16, 2048, 1)}
    # ptxas may put the cumulative stack size between the barriers and the shared memory
    log = log.replace("used 1 barriers, ", "used 1 barriers, 8 bytes cumulative stack size, ")
    assert nvcc.parse_ptxas(log)["_Z1kv"].shared == 2048
