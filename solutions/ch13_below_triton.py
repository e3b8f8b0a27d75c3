"""Solutions to chapter 13, below Triton: C++ on the CPU, CUDA C++ thread by thread.

One solution per exercise of ``chapters/13_below_triton/13_below_triton.ipynb``. The C++ exercises'
solutions are source strings, as their stubs are: the notebook's check compiles and runs them
(:mod:`utils.exercises.cpp_kernel`).
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
# Exercise 4: a bank-conflict-free layout of the GEMM's transposed A tile (shared memory)
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
