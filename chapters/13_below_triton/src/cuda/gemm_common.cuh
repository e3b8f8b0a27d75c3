// Helpers shared by the CUDA GEMM ladder (gemm_*.cuh): guarded loads and stores of 4-float groups and the
// 16-byte asynchronous tile copy.
//
// Every rung computes C = A @ B with A (M, K), B (K, N) and C (M, N) row-major and contiguous, M, N and K any
// positive sizes: a tile that hangs over an edge of A or B is zero-filled in shared memory (the products it
// adds are 0) and the stores to C are masked to the matrix.
//
// VEC (a template argument of rungs 3-5): the rows of A, B and C are 16-byte aligned — K and N multiples of 4
// floats (8 bf16 for the tensor-core rung) and the base pointers aligned — so that each group of 4 floats
// (8 bf16) along a row is either wholly inside the matrix or wholly outside, and moves as one 16-byte access.
// The caller picks VEC = true only then (gemm_vec_ok); with VEC = false every element is guarded on its own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_pipeline.h>

namespace gemm {

// Whether the 16-byte path (VEC = true) is valid for these operands: every row starts 16-byte aligned.
__host__ __device__ __forceinline__ bool gemm_vec_ok(const void* a, const void* b, const void* c, long long n,
                                                     long long k, int elements_per_16_bytes) {
  const unsigned long long bits = reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b) |
                                  reinterpret_cast<unsigned long long>(c);
  return (bits & 15ull) == 0 && n % elements_per_16_bytes == 0 && k % elements_per_16_bytes == 0;
}

__device__ __forceinline__ void set_zero(float& x) { x = 0.0f; }
__device__ __forceinline__ void set_zero(__nv_bfloat16& x) { x = __float2bfloat16(0.0f); }

// Four consecutive floats row[c .. c+3] of a row (row_ok: the row is inside the matrix) of `cols` elements,
// zero outside. VEC: one 16-byte load (LDG.128), the group wholly inside or outside; else guarded scalars.
template <bool VEC>
__device__ __forceinline__ float4 load4_or_zero(const float* __restrict__ row, int c, bool row_ok, int cols) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (VEC) {
    if (row_ok && c < cols) v = *reinterpret_cast<const float4*>(row + c);
  } else if (row_ok) {
    if (c + 0 < cols) v.x = row[c + 0];
    if (c + 1 < cols) v.y = row[c + 1];
    if (c + 2 < cols) v.z = row[c + 2];
    if (c + 3 < cols) v.w = row[c + 3];
  }
  return v;
}

// row[c .. c+3] = v, masked to the row's `cols` elements (row_ok: the row is inside C).
template <bool VEC>
__device__ __forceinline__ void store4_masked(float* __restrict__ row, int c, bool row_ok, int cols, float4 v) {
  if (!row_ok) return;
  if (VEC) {
    if (c < cols) *reinterpret_cast<float4*>(row + c) = v;
    return;
  }
  if (c + 0 < cols) row[c + 0] = v.x;
  if (c + 1 < cols) row[c + 1] = v.y;
  if (c + 2 < cols) row[c + 2] = v.z;
  if (c + 3 < cols) row[c + 3] = v.w;
}

// Copy a ROWS x COLS tile of a row-major matrix (leading dimension ld; `rows` x `cols` elements left from the
// tile's corner src) into shared memory at dst (leading dimension DST_LD), the block's THREADS threads taking
// 16-byte chunks in turn: chunk idx covers row idx / (COLS / V), elements V * (idx % (COLS / V)) onward, with
// V = 16 / sizeof(T) elements per chunk.
// VEC: a chunk inside the matrix is one cp.async (`__pipeline_memcpy_async`, 16 bytes: LDGSTS.128, global ->
// shared without passing through registers, completing in the background); a chunk outside is zeroed with one
// 16-byte shared store. Else element by element: 4-byte cp.async for floats inside, plain loads for bf16
// (cp.async copies 4, 8 or 16 bytes), zeros outside.
// The caller commits the batch and waits for it (`__pipeline_commit`, `__pipeline_wait_prior`), then
// `__syncthreads()` before any thread reads the tile.
template <typename T, int ROWS, int COLS, int DST_LD, int THREADS, bool VEC>
__device__ __forceinline__ void copy_tile_async(T* dst, const T* __restrict__ src, long long ld, int rows, int cols) {
  constexpr int V = 16 / sizeof(T);
  static_assert(COLS % V == 0 && (ROWS * COLS / V) % THREADS == 0, "the tile must split into whole chunks");
  static_assert((DST_LD * sizeof(T)) % 16 == 0, "shared rows must stay 16-byte aligned");
#pragma unroll
  for (int l = 0; l < ROWS * COLS / V / THREADS; ++l) {
    const int idx = threadIdx.x + l * THREADS;
    const int r = idx / (COLS / V), c = (idx % (COLS / V)) * V;
    T* d = dst + r * DST_LD + c;
    const T* s = src + r * ld + c;
    if (VEC) {
      if (r < rows && c < cols) __pipeline_memcpy_async(d, s, 16);
      else *reinterpret_cast<float4*>(d) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (r < rows && c + j < cols) {
          if (sizeof(T) == 4) __pipeline_memcpy_async(d + j, s + j, 4);
          else d[j] = s[j];
        } else {
          set_zero(d[j]);
        }
      }
    }
  }
}

}  // namespace gemm
