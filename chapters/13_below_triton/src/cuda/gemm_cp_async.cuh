// Rung 4 of the CUDA GEMM ladder: cp.async double buffering (fp32) — the tiles for step k+1 are copied from
// global to shared memory in the background while the block computes on step k.
//
// Block tile 128 x 128 of C, 256 threads, BK = 8 along K per step; two stages of shared memory, each an A tile
// (128 x BK, row-major like A: a 16-byte copy cannot transpose) and a B tile (BK x 128).
// Thread mapping (compute) as in rung 3: thread t = 16 ty + tx owns rows {4ty..+3, 64+4ty..+3} and columns
// {4tx..+3, 64+4tx..+3}, 64 accumulators. A is not transposed here, so for each group of 4 k's the thread reads
// its 8 rows of A as float4 along k (As[m][k..k+3]), and for each of the 4 k's two float4 of B: 16 LDS.128 per
// 256 FMAs, as in rung 3. Reads of A are one address per quarter warp (a broadcast), reads of B 32 consecutive
// words per quarter warp: no bank conflicts; the copies into A's tile (8 lanes of a quarter warp: 2 rows x 4
// chunks of 16 bytes, 128 consecutive bytes) none either.
// Thread mapping (copies): gemm::copy_tile_async — 16-byte chunk idx = t + 256 l of each tile (2 per thread per
// tile), 4 chunks per row of A's tile, 32 per row of B's.
// Pipeline: the copies of step 0 are issued and committed; then each step issues step k+1's copies into the
// other stage and commits them, waits until at most that one batch is still in flight
// (`__pipeline_wait_prior(1)`: step k's batch has landed, for this thread), and `__syncthreads()` makes every
// thread's copies visible to all; after computing, a second `__syncthreads()` keeps step k+2's copies (into
// this stage) from overwriting a tile another warp is still reading. A global load's latency is now hidden
// behind a whole step of FMAs instead of stalling the warps that wait on it, and the loaded values never
// occupy registers (LDGSTS writes shared memory directly).
// Edges: chunks outside A and B are zeroed in shared memory, stores to C masked; VEC (gemm_common.cuh):
// 16-byte copies and stores where rows are 16-byte aligned, else element by element (4-byte cp.async).
#pragma once

#include "gemm_common.cuh"

// Two blocks per SM (at most 128 registers a thread) on the 16-byte path; the element-by-element path's
// addresses need more registers, and one block per SM keeps it from spilling.
template <bool VEC>
__global__ void __launch_bounds__(256, VEC ? 2 : 1)
    gemm_cp_async(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, long long M,
                  long long N, long long K) {
  using namespace gemm;
  constexpr int BM = 128, BN = 128, BK = 8, THREADS = 256;
  __shared__ __align__(16) float As[2][BM * BK];
  __shared__ __align__(16) float Bs[2][BK * BN];

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const long long block_row = static_cast<long long>(blockIdx.y) * BM;
  const long long block_col = static_cast<long long>(blockIdx.x) * BN;
  const int rows = static_cast<int>(M - block_row < BM ? M - block_row : BM);
  const int cols = static_cast<int>(N - block_col < BN ? N - block_col : BN);
  const int k_size = static_cast<int>(K);
  A += block_row * K;
  B += block_col;
  C += block_row * N + block_col;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  const int steps = (k_size + BK - 1) / BK;
  copy_tile_async<float, BM, BK, BK, THREADS, VEC>(As[0], A, K, rows, k_size);
  copy_tile_async<float, BK, BN, BN, THREADS, VEC>(Bs[0], B, N, k_size, cols);
  __pipeline_commit();
  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    if (step + 1 < steps) {
      const int k0 = (step + 1) * BK;
      copy_tile_async<float, BM, BK, BK, THREADS, VEC>(As[stage ^ 1], A + k0, K, rows, k_size - k0);
      copy_tile_async<float, BK, BN, BN, THREADS, VEC>(Bs[stage ^ 1], B + k0 * N, N, k_size - k0, cols);
    }
    __pipeline_commit();  // an empty batch on the last step keeps the count of batches in flight uniform
    __pipeline_wait_prior(1);
    __syncthreads();
    const float* as = As[stage];
    const float* bs = Bs[stage];
#pragma unroll
    for (int kk = 0; kk < BK; kk += 4) {
      float4 a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int m = (i < 4 ? 0 : BM / 2) + 4 * ty + (i % 4);
        a[i] = *reinterpret_cast<const float4*>(&as[m * BK + kk]);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 b0 = *reinterpret_cast<const float4*>(&bs[(kk + q) * BN + 4 * tx]);
        const float4 b1 = *reinterpret_cast<const float4*>(&bs[(kk + q) * BN + BN / 2 + 4 * tx]);
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float av = q == 0 ? a[i].x : q == 1 ? a[i].y : q == 2 ? a[i].z : a[i].w;
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av, b[j], acc[i][j]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = (i < 4 ? 0 : BM / 2) + 4 * ty + (i % 4);
    float* row = C + r * N;
    store4_masked<VEC>(row, 4 * tx, r < rows, cols, make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    store4_masked<VEC>(row, BN / 2 + 4 * tx, r < rows, cols, make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]));
  }
}
