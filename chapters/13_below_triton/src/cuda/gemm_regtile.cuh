// Rung 3 of the CUDA GEMM ladder: each thread computes an 8 x 8 register tile (fp32), the A tile stored
// transposed in shared memory so that the inner loop reads 16-byte vectors, and the bank conflicts of that
// transposed store removed by padding or by an XOR swizzle.
//
// Block tile: BM x BN = 128 x 128 of C, 256 threads, BK along K per step (8 or 16).
// Thread mapping (compute): thread t = 16 * ty + tx owns rows {4ty .. 4ty+3} and {64+4ty .. 64+4ty+3} of the
// block tile and columns {4tx .. 4tx+3} and {64+4tx .. 64+4tx+3}: 64 accumulators in registers. For each k of
// the tile it reads 8 values of A (two float4: As[k][4ty..], As[k][64+4ty..]) and 8 of B (two float4), and
// does 64 FMAs: 4 shared loads (LDS.128) per 64 FMAs, against 2 LDS per FMA in rung 2. The two groups of 4
// (rather than 8 consecutive) keep the B reads conflict-free: the 8 lanes of a quarter warp (one 16-byte phase)
// read columns 4tx .. 4tx+3 for tx = 0..7, 32 consecutive words in 32 banks; with 8 consecutive columns per
// thread they would be 2-way conflicted. The A reads are one address per quarter warp (a broadcast).
// Thread mapping (loads): the A tile (BM x BK) is read from global memory as float4 groups along K, coalesced:
// chunk idx = t + 256 l covers row m = idx / (BK/4) and k = 4 (idx % (BK/4)) .. +3, and is stored transposed,
// As[k][m], with four 4-byte stores (STS). The B tile (BK x BN) is copied row-major as float4 (STS.128).
//
// The transposed store's bank conflicts, and the three layouts of As (LAYOUT):
// * kPlain: As[k][m] at word k*BM + m. One warp's store writes 128/BK rows m of A for each of the BK/4 groups
//   of k, and BM is a multiple of 32, so the groups land in the same banks: (BK/4)-way conflicts (2-way at
//   BK = 8, 4-way at BK = 16).
// * kPadded: rows of BM + 4 words. Each k moves the bank by 4, each group of 4 k's by 16: at BK = 8 the two
//   groups fall in disjoint halves of the banks, conflict-free. The pad keeps rows 16-byte aligned for the
//   float4 reads, so it must be a multiple of 4 words, and then groups of k repeat every 2: at BK = 16 a pad
//   of 4 leaves 2-way conflicts (no pad that keeps rows aligned removes them).
// * kSwizzled: no padding; element (k, m) at k*BM + (m ^ (k/4) * (128/BK)). Group c of k's XORs m with
//   c * (128/BK): the 128/BK rows each group writes move to their own set of banks (conflict-free at any BK up
//   to 32), and as the XOR is a multiple of 4, every aligned group of 4 m's stays 4 consecutive, 16-byte
//   aligned words (the float4 reads still work, at the swizzled address).
// utils/banks.py models these accesses lane by lane (tests/test_banks.py mirrors the index expressions below).
//
// Edges: the tiles are zero-filled outside A and B, stores to C masked; VEC (gemm_common.cuh): 16-byte
// global loads and stores where the rows are 16-byte aligned, else guarded scalar ones.
#pragma once

#include "gemm_common.cuh"

namespace gemm {

constexpr int kPlain = 0;
constexpr int kPadded = 1;
constexpr int kSwizzled = 2;

// Word offset of element (k, m) of the transposed A tile (BK rows of BM words) in shared memory.
template <int BK, int BM, int LAYOUT>
__device__ __forceinline__ int a_tile_offset(int k, int m) {
  if (LAYOUT == kPadded) return k * (BM + 4) + m;
  if (LAYOUT == kSwizzled) return k * BM + (m ^ ((k >> 2) * (128 / BK)));
  return k * BM + m;
}

}  // namespace gemm

// Blocks per SM the launch bounds ask for: 2 blocks of 256 threads leave each thread 65,536 / 512 = 128
// registers, enough for the 64 accumulators, the 16 operands and the addresses without spilling.
#ifndef GEMM_REGTILE_MIN_BLOCKS
#define GEMM_REGTILE_MIN_BLOCKS 2
#endif

template <int BK, int LAYOUT, bool VEC>
__global__ void __launch_bounds__(256, GEMM_REGTILE_MIN_BLOCKS)
    gemm_regtile(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, long long M,
                 long long N, long long K) {
  using namespace gemm;
  constexpr int BM = 128, BN = 128, THREADS = 256;
  static_assert(BK % 4 == 0 && BK <= 32, "BK: groups of 4 along K, and the swizzle needs 128 / BK >= 4");
  __shared__ __align__(16) float As[LAYOUT == kPadded ? BK * (BM + 4) : BK * BM];
  __shared__ __align__(16) float Bs[BK * BN];

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const long long block_row = static_cast<long long>(blockIdx.y) * BM;
  const long long block_col = static_cast<long long>(blockIdx.x) * BN;
  // What is left of C from this block's corner, and K: ints from here on (offsets into A, B and C that can
  // pass 2^31 are the 64-bit block and row offsets below).
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

  for (int k0 = 0; k0 < k_size; k0 += BK) {
#pragma unroll
    for (int l = 0; l < BM * BK / 4 / THREADS; ++l) {
      const int idx = tid + l * THREADS;
      const int m = idx / (BK / 4), kg = (idx % (BK / 4)) * 4;
      const float4 v = load4_or_zero<VEC>(A + m * K, k0 + kg, m < rows, k_size);
      As[a_tile_offset<BK, BM, LAYOUT>(kg + 0, m)] = v.x;
      As[a_tile_offset<BK, BM, LAYOUT>(kg + 1, m)] = v.y;
      As[a_tile_offset<BK, BM, LAYOUT>(kg + 2, m)] = v.z;
      As[a_tile_offset<BK, BM, LAYOUT>(kg + 3, m)] = v.w;
    }
#pragma unroll
    for (int l = 0; l < BK * BN / 4 / THREADS; ++l) {
      const int idx = tid + l * THREADS;
      const int k = idx / (BN / 4), n = (idx % (BN / 4)) * 4;
      const float4 v = load4_or_zero<VEC>(B + (k0 + k) * N, n, k0 + k < k_size, cols);
      *reinterpret_cast<float4*>(&Bs[k * BN + n]) = v;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      const float4 a0 = *reinterpret_cast<const float4*>(&As[a_tile_offset<BK, BM, LAYOUT>(k, 4 * ty)]);
      const float4 a1 = *reinterpret_cast<const float4*>(&As[a_tile_offset<BK, BM, LAYOUT>(k, BM / 2 + 4 * ty)]);
      const float4 b0 = *reinterpret_cast<const float4*>(&Bs[k * BN + 4 * tx]);
      const float4 b1 = *reinterpret_cast<const float4*>(&Bs[k * BN + BN / 2 + 4 * tx]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
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
