// Softmax over the last dim, forward and backward, as CUDA kernels (templates over the element type T, the
// vector width VEC and the column layout STRIDED, as in rms_norm.cuh: with STRIDED, VEC = 1 and each input's
// columns are its own col_stride apart). Host code lives in ops_cuda.cu; this file is kernels only (see
// common.cuh).
//
//   y = exp(x - m) / s,  m = max(x),  s = sum(exp(x - m))          dx = y * (dy - sum(dy * y))
//
// computed in acc_t<T> (float; double for double), rounded once at the store.
//
// Thread mapping: as in rms_norm.cuh. Packs of VEC elements (one 128-bit access for VEC > 1; VEC = 1 is the
// scalar path); C <= kWarpMaxColsOf<T, STRIDED> (1024; 512 for double; half that with STRIDED): one warp per
// row, block (32, 4), lane l takes packs l, l + 32, ..., the row in registers, reductions by shuffles only;
// longer rows: one block of 256 threads per row, thread t takes packs t, t + 256, ..., its first 4 packs kept in
// registers, warp results combined through shared memory.
//
// Two-pass or online?
// -------------------
// Where the row is in registers (every row of the warp kernels; up to 4096 fp32 / 8192 bf16 columns in the
// block kernels) the kernels make two passes over the registers: the maximum, then the sum of exp(x - m).
// Memory is read once either way, and the two-pass form takes one exp per element where the online form
// (running max m and a sum rescaled by exp(m_old - m_new) whenever m grows; Milakov & Gimelshein 2018) takes
// two. Where a block's row is longer than its registers hold, each thread runs the online form over the
// packs it streams, so those are read twice (statistics, then output) instead of three times (max, sum,
// output); the thread's cached packs and its streamed statistics are then merged, and the block merges its
// threads' (max, sum) pairs.
//
// Rows with infinities and NaN, as torch.softmax gives them (on the CPU and on CUDA):
// * all -inf: m = -inf, x - m = NaN: the row is NaN;
// * some +inf: m = +inf, exp(inf - inf) = NaN enters the sum: the row is NaN;
// * a NaN element: exp(NaN - m) = NaN enters the sum: the row is NaN (fmaxf dropping the NaN from m
//   changes nothing);
// * some -inf among finite values: exp(-inf) = 0 there, exact zeros.
// The online merge uses a reference r = m, or 0 where m = -inf, so that a thread or lane that has only seen
// -inf keeps (m, s) = (-inf, 0) instead of making exp(-inf - -inf) = NaN; the all -inf row then ends with
// s = 0, and y = exp(x - r) * (1 / s) = 0 * inf = NaN, as above.
#pragma once

#include "common.cuh"
#include "rms_norm.cuh"  // the shared launch constants (kWarpMaxColsOf, kWarpRows, kBlockThreads, kCachePacks)

namespace kl_cuda {
// The online form's reference point: m, or 0 where m = -inf (nothing but -inf seen yet).
template <typename A>
__device__ __forceinline__ A online_ref(A m) {
  return m == -(A)INFINITY ? (A)0 : m;
}
}  // namespace kl_cuda

// ---------------------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------------------

// One warp per row (C <= kWarpMaxColsOf<T, STRIDED>). y is contiguous; x's rows are x_row_stride apart.
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kWarp* kl_cuda::kWarpRows, kl_cuda::kForwardWarpMinBlocks<VEC>)
    softmax_forward_warp(const T* __restrict__ x, T* __restrict__ y, long long rows, long long cols,
                         long long x_row_stride, long long x_col_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int PACKS = kWarpMaxColsOf<T, STRIDED> / (kWarp * VEC);
  const int lane = threadIdx.x;
  const long long row = (long long)blockIdx.x * kWarpRows + threadIdx.y;
  if (row >= rows) return;  // the whole warp leaves together
  const int n_packs = (int)(cols / VEC);
  const T* xr = x + row * x_row_stride;

  // The row in acc_t registers: x first, then exp(x - m) in place, then the output.
  A v[PACKS][VEC];
  A m = -(A)INFINITY;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
      const Pack<T, VEC> xs = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        v[k][j] = to_acc(xs.v[j]);
        m = acc_max(m, v[k][j]);
      }
    }
  }
  m = warp_max(m);
  A s = 0;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        v[k][j] = acc_exp(v[k][j] - m);
        s += v[k][j];
      }
    }
  }
  const A inv = (A)1 / warp_sum(s);
  T* yr = y + row * cols;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) store_as(v[k][j] * inv, out.v[j]);
      store_pack<VEC>(yr + (long long)p * VEC, out);
    }
  }
}

// One block of kBlockThreads per row (C > kWarpMaxColsOf<T, STRIDED>): blockIdx.x is the row.
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kBlockThreads, kl_cuda::kForwardBlockMinBlocks)
    softmax_forward_block(const T* __restrict__ x, T* __restrict__ y, long long rows, long long cols,
                          long long x_row_stride, long long x_col_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int THREADS = kBlockThreads;
  constexpr int WARPS = THREADS / kWarp;
  __shared__ A warp_max_s[WARPS];
  __shared__ A warp_sum_s[WARPS];
  const int tid = threadIdx.x;
  const long long row = blockIdx.x;
  const long long n_packs = cols / VEC;
  const T* xr = x + row * x_row_stride;

  // Cached packs: their maximum now, their exps once the thread's maximum is known.
  Pack<T, VEC> xv[kCachePacks];
  A m_cached = -(A)INFINITY;
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      xv[k] = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) m_cached = acc_max(m_cached, to_acc(xv[k].v[j]));
    }
  }
  // Streamed packs: online (max, sum), read once here and once more for the output.
  A m_streamed = -(A)INFINITY, s_streamed = 0;
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
    const Pack<T, VEC> v = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const A a = to_acc(v.v[j]);
      const A m_new = acc_max(m_streamed, a);
      const A ref = online_ref(m_new);
      s_streamed = s_streamed * acc_exp(m_streamed - ref) + acc_exp(a - ref);
      m_streamed = m_new;
    }
  }
  // This thread's (max, sum) over all its elements, the sum taken relative to ref_t.
  const A m_t = acc_max(m_cached, m_streamed);
  const A ref_t = online_ref(m_t);
  A s_t = s_streamed * acc_exp(m_streamed - ref_t);
  A e[kCachePacks][VEC];
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        e[k][j] = acc_exp(to_acc(xv[k].v[j]) - ref_t);
        s_t += e[k][j];
      }
    }
  }
  // The warp's (max, sum) by shuffles, then the block's through shared memory: every thread merges the
  // WARPS pairs in the same order and gets the same bits.
  A m_w = m_t, s_w = s_t;
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const A m_o = __shfl_xor_sync(kFullMask, m_w, offset);
    const A s_o = __shfl_xor_sync(kFullMask, s_w, offset);
    const A m_new = acc_max(m_w, m_o);
    const A ref = online_ref(m_new);
    s_w = s_w * acc_exp(m_w - ref) + s_o * acc_exp(m_o - ref);
    m_w = m_new;
  }
  if ((tid & (kWarp - 1)) == 0) {
    warp_max_s[tid / kWarp] = m_w;
    warp_sum_s[tid / kWarp] = s_w;
  }
  __syncthreads();
  A m = -(A)INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) m = acc_max(m, warp_max_s[w]);
  const A ref = online_ref(m);
  A s = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) s += warp_sum_s[w] * acc_exp(warp_max_s[w] - ref);
  const A inv = (A)1 / s;
  // e holds exp(x - ref_t); exp(ref_t - ref) <= 1 turns it into exp(x - ref). A thread that saw only -inf
  // (and NaN) has ref_t = 0, and exp(0 - ref) could overflow where ref < -88: its e are 0 (or NaN) already,
  // and 0 * inv is 0, or NaN where the row's inv is (all -inf: 1 / 0; a NaN or +inf elsewhere).
  const A cached_scale = m_t == -(A)INFINITY ? inv : acc_exp(ref_t - ref) * inv;

  T* yr = y + row * cols;
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) store_as(e[k][j] * cached_scale, out.v[j]);
      store_pack<VEC>(yr + p * VEC, out);
    }
  }
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
    const Pack<T, VEC> v = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) store_as(acc_exp(to_acc(v.v[j]) - ref) * inv, out.v[j]);
    store_pack<VEC>(yr + p * VEC, out);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward: dx = y * (dy - sum(dy * y)), from the saved output y
// ---------------------------------------------------------------------------------------------------------

// One warp per row (C <= kWarpMaxColsOf<T, STRIDED>). grad_x is contiguous; grad_y's and y's rows (and with
// STRIDED their columns) are their own strides apart.
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kWarp* kl_cuda::kWarpRows, kl_cuda::kBackwardWarpMinBlocks)
    softmax_backward_warp(const T* __restrict__ grad_y, const T* __restrict__ y, T* __restrict__ grad_x,
                          long long rows, long long cols, long long grad_y_row_stride, long long y_row_stride,
                          long long grad_y_col_stride, long long y_col_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int PACKS = kWarpMaxColsOf<T, STRIDED> / (kWarp * VEC);
  const int lane = threadIdx.x;
  const long long row = (long long)blockIdx.x * kWarpRows + threadIdx.y;
  if (row >= rows) return;
  const int n_packs = (int)(cols / VEC);
  const T* gyr = grad_y + row * grad_y_row_stride;
  const T* yr = y + row * y_row_stride;

  Pack<T, VEC> gv[PACKS], yv[PACKS];
  A dot = 0;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
      gv[k] = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
      yv[k] = load_cols<VEC, STRIDED>(yr, p, y_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += to_acc(gv[k].v[j]) * to_acc(yv[k].v[j]);
    }
  }
  dot = warp_sum(dot);
  T* gxr = grad_x + row * cols;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) store_as(to_acc(yv[k].v[j]) * (to_acc(gv[k].v[j]) - dot), out.v[j]);
      store_pack<VEC>(gxr + (long long)p * VEC, out);
    }
  }
}

// One block of kBlockThreads per row (C > kWarpMaxColsOf<T, STRIDED>): blockIdx.x is the row.
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kBlockThreads, kl_cuda::kBackwardBlockMinBlocks)
    softmax_backward_block(const T* __restrict__ grad_y, const T* __restrict__ y, T* __restrict__ grad_x,
                           long long rows, long long cols, long long grad_y_row_stride, long long y_row_stride,
                          long long grad_y_col_stride, long long y_col_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int THREADS = kBlockThreads;
  __shared__ A partials[THREADS / kWarp];
  const int tid = threadIdx.x;
  const long long row = blockIdx.x;
  const long long n_packs = cols / VEC;
  const T* gyr = grad_y + row * grad_y_row_stride;
  const T* yr = y + row * y_row_stride;

  Pack<T, VEC> gv[kCachePacks], yv[kCachePacks];
  A dot = 0;
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      gv[k] = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
      yv[k] = load_cols<VEC, STRIDED>(yr, p, y_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += to_acc(gv[k].v[j]) * to_acc(yv[k].v[j]);
    }
  }
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
    const Pack<T, VEC> g = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
    const Pack<T, VEC> v = load_cols<VEC, STRIDED>(yr, p, y_col_stride);
#pragma unroll
    for (int j = 0; j < VEC; ++j) dot += to_acc(g.v[j]) * to_acc(v.v[j]);
  }
  dot = block_sum<THREADS / kWarp>(dot, partials);

  T* gxr = grad_x + row * cols;
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) store_as(to_acc(yv[k].v[j]) * (to_acc(gv[k].v[j]) - dot), out.v[j]);
      store_pack<VEC>(gxr + p * VEC, out);
    }
  }
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
    const Pack<T, VEC> g = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
    const Pack<T, VEC> v = load_cols<VEC, STRIDED>(yr, p, y_col_stride);
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) store_as(to_acc(v.v[j]) * (to_acc(g.v[j]) - dot), out.v[j]);
    store_pack<VEC>(gxr + p * VEC, out);
  }
}
