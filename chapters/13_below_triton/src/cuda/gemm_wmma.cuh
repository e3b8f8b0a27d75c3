// Rung 5 of the CUDA GEMM ladder: tensor cores through nvcuda::wmma — bf16 A and B in, fp32 accumulate and
// out — with the tiles staged in shared memory by cp.async, double buffered as in rung 4.
//
// Block tile 128 x 128 of C, 256 threads = 8 warps, BK = 32 along K per step. Warp tiles: warp w computes the
// 64 x 32 block of C at rows 64 (w / 4), columns 32 (w % 4): 4 x 2 accumulator fragments of 16 x 16 floats.
// For each 16 of the step's 32 k's the warp loads 4 A fragments (16 x 16 bf16, row-major from the A tile) and 2
// B fragments (from the B tile) and issues 8 `mma_sync`s: each a 16 x 16 x 16 product on the tensor cores (on
// sm_90 one wmma 16x16x16 bf16 is two HMMA.16816.F32.BF16 instructions, m16 n8 k16 each). The 8 accumulators
// (8 floats per lane each) stay in registers for the whole K loop.
// The fragments' layout in registers is the library's (opaque): a thread cannot know which elements it holds,
// so edges are handled in memory: the tiles are zero-filled in shared memory outside A and B (the extra
// products are 0), and each accumulator goes back through a 16 x 16 float staging tile in shared memory
// (`store_matrix_sync`), from which the warp's lanes store the elements inside C (masked).
// Shared-memory rows are padded by 8 bf16 (16 bytes): A tile rows of 40 bf16 (80 bytes), B rows of 136 bf16
// (272 bytes), so that the 8 rows one fragment load reads at a time start in different banks; every fragment
// starts 32-byte aligned, as `load_matrix_sync` requires, and the leading dimensions are multiples of 8.
// Copies: gemm::copy_tile_async, 16-byte chunks of 8 bf16 (VEC: rows 16-byte aligned, K and N multiples of 8),
// else element by element with plain loads (cp.async has no 2-byte copy).
#pragma once

#include <mma.h>

#include "gemm_common.cuh"

// Two blocks per SM on the 16-byte path (at most 128 registers a thread: 8 accumulator fragments of 8 floats,
// 6 operand fragments, addresses; 2 x 46 KB of shared memory); the element-by-element path's addresses need
// more registers, and one block per SM keeps it from spilling.
template <bool VEC>
__global__ void __launch_bounds__(256, VEC ? 2 : 1)
    gemm_wmma(const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B, float* __restrict__ C,
              long long M, long long N, long long K) {
  using namespace nvcuda;
  using namespace gemm;
  constexpr int BM = 128, BN = 128, BK = 32, THREADS = 256, WARPS = THREADS / 32;
  constexpr int LDA = BK + 8, LDB = BN + 8;  // padded shared rows (elements)
  constexpr int FM = 4, FN = 2;              // 16 x 16 fragments per warp tile (64 x 32)
  __shared__ __align__(32) __nv_bfloat16 As[2][BM * LDA];
  __shared__ __align__(32) __nv_bfloat16 Bs[2][BK * LDB];
  __shared__ __align__(32) float Cs[WARPS][16 * 16];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = 64 * (warp / 4), warp_col = 32 * (warp % 4);
  const long long block_row = static_cast<long long>(blockIdx.y) * BM;
  const long long block_col = static_cast<long long>(blockIdx.x) * BN;
  const int rows = static_cast<int>(M - block_row < BM ? M - block_row : BM);
  const int cols = static_cast<int>(N - block_col < BN ? N - block_col : BN);
  const int k_size = static_cast<int>(K);
  A += block_row * K;
  B += block_col;
  C += block_row * N + block_col;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int steps = (k_size + BK - 1) / BK;
  copy_tile_async<__nv_bfloat16, BM, BK, LDA, THREADS, VEC>(As[0], A, K, rows, k_size);
  copy_tile_async<__nv_bfloat16, BK, BN, LDB, THREADS, VEC>(Bs[0], B, N, k_size, cols);
  __pipeline_commit();
  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    if (step + 1 < steps) {
      const int k0 = (step + 1) * BK;
      copy_tile_async<__nv_bfloat16, BM, BK, LDA, THREADS, VEC>(As[stage ^ 1], A + k0, K, rows, k_size - k0);
      copy_tile_async<__nv_bfloat16, BK, BN, LDB, THREADS, VEC>(Bs[stage ^ 1], B + k0 * N, N, k_size - k0, cols);
    }
    __pipeline_commit();
    __pipeline_wait_prior(1);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b[FN];
#pragma unroll
      for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &As[stage][(warp_row + 16 * i) * LDA + kk], LDA);
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(b[j], &Bs[stage][kk * LDB + warp_col + 16 * j], LDB);
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }

  float* staging = Cs[warp];
#pragma unroll
  for (int i = 0; i < FM; ++i) {
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      wmma::store_matrix_sync(staging, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int e = lane; e < 16 * 16; e += 32) {
        const int r = warp_row + 16 * i + e / 16, c = warp_col + 16 * j + e % 16;
        if (r < rows && c < cols) C[r * N + c] = staging[e];
      }
      __syncwarp();
    }
  }
}
