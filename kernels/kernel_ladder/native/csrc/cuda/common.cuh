// Helpers shared by the row kernels of rms_norm.cuh and softmax.cuh: element types, 128-bit packs, and warp
// and block reductions.
//
// Kernels only, no host code: the same text compiles with nvcc for a GPU and with g++ for the course's
// SIMT emulator, so it keeps to the CUDA subset the emulator implements (no extern __shared__, no inline PTX).
//
// Element types: float, double, __nv_bfloat16, __half. Arithmetic is done in acc_t<T>: float for the 32- and
// 16-bit types, double for double; loads convert to it, stores round from it once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kl_cuda {

//: Threads of a warp; every kernel here reduces over whole warps (full mask).
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Accumulator<T>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

// Round an accumulator value to the storage type (overloaded on the destination).
__device__ __forceinline__ void store_as(float v, float& out) { out = v; }
__device__ __forceinline__ void store_as(double v, double& out) { out = v; }
__device__ __forceinline__ void store_as(float v, __nv_bfloat16& out) { out = __float2bfloat16(v); }
__device__ __forceinline__ void store_as(float v, __half& out) { out = __float2half(v); }

__device__ __forceinline__ float acc_rsqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double acc_rsqrt(double v) { return 1.0 / sqrt(v); }
__device__ __forceinline__ float acc_exp(float v) { return expf(v); }
__device__ __forceinline__ double acc_exp(double v) { return exp(v); }
// fmaxf: a NaN operand is dropped. The softmax kernels rely on that: a NaN element still makes its row's
// sum NaN (exp(NaN - m) is NaN), so the row comes out all NaN, as torch's does.
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }

// N consecutive elements loaded or stored by one instruction: a Pack of 16 bytes (4 floats, 8 bf16/fp16) is
// one 128-bit access (LDG.E.128 / STG.E.128) when its address is a multiple of 16, which the launchers
// check before they choose a vector width above 1. The struct's alignment is what lets nvcc emit the wide
// access; copying a struct (rather than writing through a uint4* into an array of T) also keeps g++'s
// aliasing rules satisfied, so the emulator computes the same thing.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* __restrict__ p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// Pack p of an input row, for the two layouts of a row the kernels take (their STRIDED template parameter):
// * stride 1 (STRIDED false): the VEC consecutive elements at row + p * VEC, one access (128-bit for VEC > 1);
// * columns col_stride elements apart (STRIDED true, VEC = 1: a transposed or column-sliced input): the one
//   element at row + p * col_stride, a scalar load. This is how the kernels read any layout without a copy.
// col_stride is not read on the stride-1 path, so that path compiles to what it would without the argument.
template <int VEC, bool STRIDED, typename T>
__device__ __forceinline__ Pack<T, VEC> load_cols(const T* __restrict__ row, long long p, long long col_stride) {
  static_assert(!STRIDED || VEC == 1, "the column-stride path loads one element at a time");
  if constexpr (STRIDED) {
    Pack<T, VEC> out;
    out.v[0] = row[p * col_stride];
    return out;
  } else {
    return load_pack<VEC>(row + p * VEC);
  }
}

// Butterfly sum over the 32 lanes: after step k every lane holds the sum of its 2^k-lane group, and each
// lane adds the same two partial sums (in swapped order, and float addition commutes), so all 32 lanes end
// with the same bits.
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

template <typename A>
__device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = acc_max(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum over a block of WARPS warps (1-D block): warp sums by shuffles, lane 0 of each warp writes its warp's
// sum to `partials` (shared, WARPS entries), one barrier, then every thread adds the WARPS values in the same
// order, so every thread gets the same bits and the result does not depend on scheduling. The caller must
// not write `partials` again before every thread has read it (a second buffer, or a barrier).
template <int WARPS, typename A>
__device__ __forceinline__ A block_sum(A v, A* partials) {
  v = warp_sum(v);
  if ((threadIdx.x & (kWarp - 1)) == 0) partials[threadIdx.x / kWarp] = v;
  __syncthreads();
  A total = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += partials[w];
  return total;
}

}  // namespace kl_cuda
