// Rung 2 of the CUDA GEMM ladder: shared-memory tiles (fp32).
//
// Thread mapping: a TILE x TILE block of threads computes a TILE x TILE tile of C, one element per thread
// (threadIdx.x along C's columns, threadIdx.y along its rows). For each step of TILE along K, every thread
// loads one element of the A tile (TILE x TILE, rows of C by k) and one of the B tile (k by columns of C)
// into shared memory, coalesced along the rows; after `__syncthreads()` each thread reads its row of the A
// tile and its column of the B tile from shared memory. Each global element is now loaded once per tile
// instead of once per thread: global loads per FMA drop from 2 to 2 / TILE. Inside a warp (one row of the
// block when TILE = 32) the reads of As[ty][k] are one word for all lanes (a broadcast) and Bs[k][tx] are 32
// consecutive words in 32 banks: no bank conflicts. The second `__syncthreads()` keeps the next step's
// stores from overwriting a tile another warp is still reading.
// Edges: tiles are zero-filled outside A and B (the loads are masked, 0 stored instead), stores to C masked.
#pragma once

template <int TILE>
__global__ void __launch_bounds__(TILE * TILE)
    gemm_smem(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, long long M,
              long long N, long long K) {
  __shared__ float As[TILE][TILE];
  __shared__ float Bs[TILE][TILE];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long row = static_cast<long long>(blockIdx.y) * TILE + ty;
  const long long col = static_cast<long long>(blockIdx.x) * TILE + tx;
  float acc = 0.0f;
  for (long long k0 = 0; k0 < K; k0 += TILE) {
    As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
    Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) acc = fmaf(As[ty][k], Bs[k][tx], acc);
    __syncthreads();
  }
  if (row < M && col < N) C[row * N + col] = acc;
}
