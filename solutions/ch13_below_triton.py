"""Solutions to chapter 13, below Triton: C++ on the CPU, CUDA C++ thread by thread.

One solution per exercise of ``chapters/13_below_triton/13_below_triton.ipynb``, in the notebook's order:

1. ``RMS_NORM_SIMD`` (section 2) — RMSNorm rows in C++, vectorized;
2. ``GEMM_BLOCKED`` (section 3) — a cache-blocked GEMM in C++;
3. ``RMS_NORM_WARP`` (section 5) — RMSNorm in CUDA C++ with one warp per row;
4. ``smem_swizzle`` (section 6) — a bank-conflict-free layout of the CUDA GEMM's transposed A tile.

The C++ and CUDA exercises' solutions are source strings, as their stubs are: the notebook's checks compile
and run them — the C++ ones natively in a child process (:mod:`utils.exercises.cpp_kernel`), the CUDA one
thread by thread on the CPU and then for sm_90 (:mod:`utils.exercises.cuda_kernel`). ``smem_swizzle`` is a
Python function judged lane by lane by :mod:`utils.exercises.banks`.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------------------
# The CPU ladder: exercises 1 and 2 (C++, checked by utils.exercises.cpp_kernel)
# ----------------------------------------------------------------------------------------------

#: Exercise 1: RMSNorm over rows, vectorized. Teaches why a float sum does not vectorize by itself — C++
#: evaluates ``sum += x * x`` in order, and 8 partial sums round differently, so the compiler may not split
#: it — and how to give it permission (``#pragma omp simd reduction(+ : sum)``); ``__restrict__`` says y
#: overlaps neither input, so the second loop needs no run-time overlap check. The tail (cols % 8) is the
#: compiler's: it adds a scalar epilogue after the vector loop, never reading past the row.
RMS_NORM_SIMD = r"""#include <cmath>
#include <cstdint>

extern "C" void rms_norm_rows(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                              int64_t rows, int64_t cols, int64_t x_row_stride, int64_t y_row_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict__ xr = x + r * x_row_stride;
    float* __restrict__ yr = y + r * y_row_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
    const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];
  }
}
"""

#: Exercise 2: GEMM, cache-blocked. Teaches reuse: the ikj loop reads every element of B once per row of A,
#: from wherever B fits; blocked, a KC × NC tile of B (64 × 64 floats, 16 KiB: half a 32 KiB L1) serves every
#: row of an MC-row band of A while it is in L1. The edges are ``std::min``: M, N and K need not be multiples
#: of a tile, and every index goes through a leading dimension (lda, ldb, ldc), never through a size.
GEMM_BLOCKED = r"""#include <algorithm>
#include <cstdint>

extern "C" void gemm(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c, int64_t M,
                     int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  constexpr int64_t MC = 128, KC = 64, NC = 64;  // B's tile: 64 x 64 floats = 16 KiB, half a 32 KiB L1
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;  // C is overwritten, even when K == 0
  for (int64_t i0 = 0; i0 < M; i0 += MC)
    for (int64_t k0 = 0; k0 < K; k0 += KC)
      for (int64_t j0 = 0; j0 < N; j0 += NC) {
        const int64_t i1 = std::min(i0 + MC, M), k1 = std::min(k0 + KC, K), j1 = std::min(j0 + NC, N);
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t k = k0; k < k1; ++k) {
            const float aik = a[i * lda + k];
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) c[i * ldc + j] += aik * b[k * ldb + j];
          }
      }
}
"""


# ----------------------------------------------------------------------------------------------
# CUDA C++ thread by thread: exercise 3 (checked by utils.exercises.cuda_kernel, run by utils.simt)
# ----------------------------------------------------------------------------------------------

#: Exercise 3: RMSNorm with one warp per row. Teaches the warp as the unit of a reduction: each lane adds the
#: squares of the float4s it owns (i = lane, lane + 32, ...: consecutive lanes read consecutive 16 bytes, so a
#: warp's load is 512 contiguous bytes) and then the tail's columns one by one; five ``__shfl_xor_sync`` steps
#: (16, 8, 4, 2, 1) leave every lane holding the row's total — no shared memory and no ``__syncthreads()``:
#: the lanes of a warp exchange registers directly. A warp past the last row returns whole, so every lane the
#: full mask names reaches each shuffle. Rows start 16-byte aligned (``row_stride`` is a multiple of 4).
RMS_NORM_WARP = r"""#include <cuda_runtime.h>

__global__ void rms_norm_warp(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                              long long rows, long long cols, long long row_stride, float eps) {
  const int lane = threadIdx.x % 32;
  const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: every lane of the full mask stays for the shuffles
  const float* xr = x + row * row_stride;
  float* yr = y + row * row_stride;
  const long long vectors = cols / 4;  // whole float4s; the last cols % 4 columns are the tail
  const float4* xv = reinterpret_cast<const float4*>(xr);
  float sum = 0.0f;
  for (long long i = lane; i < vectors; i += 32) {
    const float4 v = xv[i];
    sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (long long c = 4 * vectors + lane; c < cols; c += 32) sum += xr[c] * xr[c];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float rstd = rsqrtf(sum / (float)cols + eps);  // every lane holds the row's total
  const float4* wv = reinterpret_cast<const float4*>(w);
  float4* yv = reinterpret_cast<float4*>(yr);
  for (long long i = lane; i < vectors; i += 32) {
    const float4 v = xv[i], g = wv[i];
    yv[i] = make_float4(v.x * rstd * g.x, v.y * rstd * g.y, v.z * rstd * g.z, v.w * rstd * g.w);
  }
  for (long long c = 4 * vectors + lane; c < cols; c += 32) yr[c] = xr[c] * rstd * w[c];
}
"""


# ----------------------------------------------------------------------------------------------
# The CUDA GEMM ladder: exercise 4, a bank-conflict-free layout of the GEMM's transposed A tile (shared memory)
# ----------------------------------------------------------------------------------------------


def smem_swizzle(row: int, col: int) -> int:
    """The 4-byte word where element ``(row, col)`` of the transposed A tile (16 rows of k, 128 columns of m) is
    kept in shared memory: an XOR swizzle.

    What it teaches: the kernel's store writes, per warp, 8 rows m of A for each of the 4 groups of k (rows
    0-3, 4-7, 8-11, 12-15 of the tile); stored at ``row * 128 + col``, the 4 groups land in the same 8 banks
    (128 is a multiple of 32): a 4-way conflict. Padding each row by 4 words moves each group by 16 banks, so
    groups 0 and 2 still collide; a pad that is not a multiple of 4 would break the float4 reads. XOR-ing the
    column with ``8 * (row // 4)`` gives group g its own 8 banks (``8 g`` .. ``8 g + 7``), and, being a multiple
    of 4, keeps every aligned group of 4 columns 4 consecutive, 16-byte aligned words — with no padding at all.
    """
    return row * 128 + (col ^ (8 * (row // 4)))
