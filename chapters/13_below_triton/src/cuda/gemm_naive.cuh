// Rung 1 of the CUDA GEMM ladder: C = A @ B with one thread per output element (fp32).
//
// Thread mapping: a blockDim.y x blockDim.x block (16 x 16 in the tests and the GPU checks) covers as many
// elements of C; threadIdx.x runs along C's columns, so the 32 lanes of a warp read 32 consecutive floats of
// one row of B and write 32 consecutive floats of C (coalesced), and all read the same element of A (one
// broadcast). Each thread walks all of K alone: 2K global loads for K FMAs, every element of A loaded N times
// and every element of B M times — the caches absorb some of it, the next rungs remove it.
// Edges: a thread outside C returns before loading anything (masked; no tile to zero-fill).
#pragma once

__global__ void gemm_naive(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                           long long M, long long N, long long K) {
  const long long row = static_cast<long long>(blockIdx.y) * blockDim.y + threadIdx.y;
  const long long col = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= M || col >= N) return;
  const float* a = A + row * K;
  const float* b = B + col;
  float acc = 0.0f;
  for (long long k = 0; k < K; ++k) acc = fmaf(a[k], b[k * N], acc);
  C[row * N + col] = acc;
}
