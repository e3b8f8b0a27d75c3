// RMSNorm over the last dim, forward and backward, as CUDA kernels (templates over the element type T, the
// vector width VEC and the column layout STRIDED). Host code lives in ops_cuda.cu; this file is kernels only,
// so that the course's SIMT emulator can run it on the CPU.
//
//   rstd = 1 / sqrt(sum(x^2) / C + eps)          y = (x * rstd) * w
//   xhat = x * rstd   g = dy * w                  dx = (g - xhat * sum(g * xhat) / C) * rstd
//   dw = sum over rows of dy * xhat
//
// Everything is computed in acc_t<T> (float; double for double) and rounded once at the store; rstd is
// written in acc_t<T>.
//
// Thread mapping
// --------------
// A row is cut into packs of VEC consecutive elements (VEC = 16 bytes / sizeof(T): 4 floats or 8 bf16/fp16,
// one 128-bit load each), or single elements (VEC = 1: the scalar path, for rows whose start or length is
// not a multiple of 16 bytes). The launcher picks VEC; with VEC > 1 it guarantees C % VEC == 0 and every
// row start 16-byte aligned, so the kernels have no tail. Pack p covers columns [p * VEC, p * VEC + VEC).
// With STRIDED (VEC = 1 only) an input's columns are its own col_stride apart (a transposed or column-sliced
// tensor, an expanded weight or grad_y: the launcher takes it when some operand's last-dim stride is not 1):
// the same mapping with one scalar load per element (load_cols in common.cuh), never a copy of the input;
// rstd of the backward is then read rstd_stride apart too. Outputs are always contiguous. Without STRIDED the
// column-stride arguments are not read, and the kernels compile as if they were not there.
//
// * C <= kWarpMaxColsOf<T, STRIDED> (1024; 512 for double; half that with STRIDED): ONE WARP PER ROW.
//   Block (32, kWarpRows): threadIdx.y picks the warp's row (row = blockIdx.x * kWarpRows + threadIdx.y),
//   lane l takes packs l, l + 32, l + 64, ... (so one warp-wide load instruction reads 32 consecutive packs:
//   512 contiguous bytes with VEC > 1). The row stays in registers (at most 32 elements a lane), the sum of
//   squares is reduced by shuffles alone: no shared memory, no barrier; x is read once.
// * longer rows: ONE BLOCK PER ROW (forward: blockIdx.x is the row), kBlockThreads threads; thread t
//   takes packs t, t + 256, ... The first kCachePacks of them stay in registers (the whole row up to
//   256 * 4 * VEC columns: 4096 fp32, 8192 bf16/fp16), the rest are read again for the second pass (from L2 on
//   a GPU). Warp sums by shuffles, then one value per warp through shared memory and a barrier.
//
// Backward and the weight gradient
// --------------------------------
// dx of a row needs sum(g * xhat) over the row: a second reduction of the same shape as the forward's.
// dw sums over rows, and is made deterministic in two steps, without atomics:
// 1. each backward program (a warp in the warp-per-row kernel, a block in the block-per-row kernel) owns a
//    fixed set of rows (a grid-stride loop over rows, so the set depends only on the grid) and adds their
//    dy * xhat into acc_t registers, one per column it owns; at the end it writes them as its own row of
//    `weight_partials` [programs, C];
// 2. rms_norm_weight_grad_reduce sums the columns of that buffer in a fixed order.
// The launcher sizes the grid from the number of rows only (never from the device), so the same inputs give
// the same bits on any GPU and any run.
#pragma once

#include "common.cuh"

namespace kl_cuda {
constexpr int kWarpMaxCols = 1024;  // the longest row one warp takes (512 for double: 16 doubles a lane)
constexpr int kWarpRows = 4;        // rows (warps) per block of the warp-per-row kernels: 128 threads
constexpr int kBlockThreads = 256;  // threads of a block-per-row kernel
constexpr int kCachePacks = 4;      // packs a thread of a block-per-row kernel keeps in registers
constexpr int kReduceRows = 16;     // threadIdx.y extent of rms_norm_weight_grad_reduce: block (32, 16)
// The backward grids (ops_cuda.cu): blocks = min(ceil(rows / (kWarpRows * kBackwardRowsPerWarp)),
// kBackwardMaxBlocks) for the warp kernel, min(rows, kBackwardMaxBlocks) for the block kernel; each block
// writes one row of weight_partials. Functions of the row count alone, so the sums' order is too.
constexpr int kBackwardRowsPerWarp = 8;
constexpr int kBackwardMaxBlocks = 512;
// __launch_bounds__'s minimum resident blocks per SM, which cap a thread's registers at
// 65536 / (blocks * threads): forward kernels 64 (8 x 128 or 4 x 256 threads: 32 warps an SM, half the
// H100's 64), except the warp kernels' scalar path, 128 (16 warps: a lane holds 32 separate values there);
// backward kernels 128 (16 warps an SM; they keep x and the running sums). tests/test_cuda_ops_sass.py
// checks the counts and that nothing spills.
constexpr int kForwardBlockMinBlocks = 4;
constexpr int kBackwardWarpMinBlocks = 4;
constexpr int kBackwardBlockMinBlocks = 2;
template <int VEC>
constexpr int kForwardWarpMinBlocks = VEC == 1 ? 4 : 8;

// Rows up to this many columns take the warp-per-row kernels. A lane holds 32 values of a 1024-column row;
// in double that is 64 registers a row, and the exp of the softmax spilled around its slow path: 512. On the
// column-stride path (STRIDED) every element a lane loads has an address of its own (no immediate offset from
// one base), 64 bits each, and the compiler keeps them in registers to issue the loads together (and, in the
// backward, to read dy and w again): half as many columns (512; 256 for double) keep those kernels out of local
// memory; longer strided rows take the block kernels.
template <typename T, bool STRIDED = false>
constexpr int kWarpMaxColsOf = (sizeof(T) == 8 ? kWarpMaxCols / 2 : kWarpMaxCols) / (STRIDED ? 2 : 1);
}  // namespace kl_cuda

// ---------------------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------------------

// One warp per row (C <= kWarpMaxColsOf<T, STRIDED>). y is contiguous (row r starts at r * cols); x's rows are
// x_row_stride apart (and with STRIDED its columns x_col_stride, weight's weight_col_stride).
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kWarp* kl_cuda::kWarpRows, kl_cuda::kForwardWarpMinBlocks<VEC>)
    rms_norm_forward_warp(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y,
                          kl_cuda::acc_t<T>* __restrict__ rstd, long long rows, long long cols,
                          long long x_row_stride, float eps, long long x_col_stride, long long weight_col_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int PACKS = kWarpMaxColsOf<T, STRIDED> / (kWarp * VEC);  // packs a lane holds at most
  const int lane = threadIdx.x;
  const long long row = (long long)blockIdx.x * kWarpRows + threadIdx.y;
  if (row >= rows) return;  // row is the same for all 32 lanes: the warp leaves whole
  const int n_packs = (int)(cols / VEC);
  const T* xr = x + row * x_row_stride;

  Pack<T, VEC> xv[PACKS];
  A sum = 0;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
      xv[k] = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A v = to_acc(xv[k].v[j]);
        sum += v * v;
      }
    }
  }
  sum = warp_sum(sum);
  const A r = acc_rsqrt(sum / (A)cols + (A)eps);
  if (lane == 0) rstd[row] = r;

  T* yr = y + row * cols;
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs) {
      const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) store_as(to_acc(xv[k].v[j]) * r * to_acc(w.v[j]), out.v[j]);
      store_pack<VEC>(yr + (long long)p * VEC, out);
    }
  }
}

// One block of kBlockThreads per row (C > kWarpMaxColsOf<T, STRIDED>): blockIdx.x is the row.
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kBlockThreads, kl_cuda::kForwardBlockMinBlocks)
    rms_norm_forward_block(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y,
                           kl_cuda::acc_t<T>* __restrict__ rstd, long long rows, long long cols,
                           long long x_row_stride, float eps, long long x_col_stride, long long weight_col_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int THREADS = kBlockThreads;
  __shared__ A partials[THREADS / kWarp];
  const int tid = threadIdx.x;
  const long long row = blockIdx.x;
  const long long n_packs = cols / VEC;
  const T* xr = x + row * x_row_stride;

  Pack<T, VEC> xv[kCachePacks];
  A sum = 0;
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      xv[k] = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A v = to_acc(xv[k].v[j]);
        sum += v * v;
      }
    }
  }
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
    const Pack<T, VEC> v = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const A a = to_acc(v.v[j]);
      sum += a * a;
    }
  }
  sum = block_sum<THREADS / kWarp>(sum, partials);
  const A r = acc_rsqrt(sum / (A)cols + (A)eps);
  if (tid == 0) rstd[row] = r;

  T* yr = y + row * cols;
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) store_as(to_acc(xv[k].v[j]) * r * to_acc(w.v[j]), out.v[j]);
      store_pack<VEC>(yr + p * VEC, out);
    }
  }
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
    const Pack<T, VEC> v = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
    const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) store_as(to_acc(v.v[j]) * r * to_acc(w.v[j]), out.v[j]);
    store_pack<VEC>(yr + p * VEC, out);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------------------

// One warp per row (C <= kWarpMaxColsOf<T, STRIDED>). Warp w = threadIdx.y of block b takes rows
// b * kWarpRows + w + i * gridDim.x * kWarpRows (i = 0, 1, ...), keeping x of the row and its running dw in
// registers (dy is read again in the second pass: from L1, it was loaded a moment before). At the end the
// block's kWarpRows warps add their dw through shared memory, in warp order, into row b of
// weight_partials [gridDim.x, cols] (zeros where the block had no row). grad_x is contiguous; grad_y's and
// x's rows are their own strides apart.
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kWarp* kl_cuda::kWarpRows, kl_cuda::kBackwardWarpMinBlocks)
    rms_norm_backward_warp(const T* __restrict__ grad_y, const T* __restrict__ x, const T* __restrict__ weight,
                           const kl_cuda::acc_t<T>* __restrict__ rstd, T* __restrict__ grad_x,
                           kl_cuda::acc_t<T>* __restrict__ weight_partials, long long rows, long long cols,
                           long long grad_y_row_stride, long long x_row_stride, long long grad_y_col_stride,
                           long long x_col_stride, long long weight_col_stride, long long rstd_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int PACKS = kWarpMaxColsOf<T, STRIDED> / (kWarp * VEC);
  __shared__ A dw_shared[kWarpRows][kWarpMaxColsOf<T, STRIDED>];  // 16 KiB (8 KiB on the strided path)
  const int lane = threadIdx.x;
  const long long warp = (long long)blockIdx.x * kWarpRows + threadIdx.y;
  const long long n_warps = (long long)gridDim.x * kWarpRows;
  const int n_packs = (int)(cols / VEC);

  A dw[PACKS][VEC];
#pragma unroll
  for (int k = 0; k < PACKS; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[k][j] = 0;

  for (long long row = warp; row < rows; row += n_warps) {  // the same trip count for all 32 lanes
    const T* gyr = grad_y + row * grad_y_row_stride;
    const T* xr = x + row * x_row_stride;
    const A r = rstd[STRIDED ? row * rstd_stride : row];
    Pack<T, VEC> xv[PACKS];
    A dot = 0;  // sum(g * xhat) over this lane's columns
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const int p = lane + kWarp * k;
      if (p < n_packs) {
        xv[k] = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
        const Pack<T, VEC> g = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
        const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot += (to_acc(g.v[j]) * to_acc(w.v[j])) * (to_acc(xv[k].v[j]) * r);
      }
    }
    const A mean = warp_sum(dot) / (A)cols;
    T* gxr = grad_x + row * cols;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const int p = lane + kWarp * k;
      if (p < n_packs) {
        const Pack<T, VEC> g = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
        const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
        Pack<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const A xhat = to_acc(xv[k].v[j]) * r;
          const A dy = to_acc(g.v[j]);
          store_as((dy * to_acc(w.v[j]) - xhat * mean) * r, out.v[j]);
          dw[k][j] += dy * xhat;
        }
        store_pack<VEC>(gxr + (long long)p * VEC, out);
      }
    }
  }

#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const int p = lane + kWarp * k;
    if (p < n_packs)
#pragma unroll
      for (int j = 0; j < VEC; ++j) dw_shared[threadIdx.y][p * VEC + j] = dw[k][j];
  }
  __syncthreads();
  A* part = weight_partials + (long long)blockIdx.x * cols;
  for (int c = threadIdx.y * kWarp + lane; c < cols; c += kWarp * kWarpRows) {
    A total = 0;
#pragma unroll
    for (int w = 0; w < kWarpRows; ++w) total += dw_shared[w][c];
    part[c] = total;
  }
}

// One block of kBlockThreads per row (C > kWarpMaxColsOf<T, STRIDED>). Block b of B = gridDim.x takes rows
// b, b + B, ... and writes row b of weight_partials [B, cols]. A thread's first kCachePacks packs keep x and
// their dw in registers (dy is read again in the second pass, from L1); packs beyond them are read again in the
// second pass, and their dw is added into the block's own row of weight_partials in place (only this thread
// touches those entries, always in row order: deterministic).
template <typename T, int VEC, bool STRIDED>
__global__ void __launch_bounds__(kl_cuda::kBlockThreads, kl_cuda::kBackwardBlockMinBlocks)
    rms_norm_backward_block(const T* __restrict__ grad_y, const T* __restrict__ x, const T* __restrict__ weight,
                            const kl_cuda::acc_t<T>* __restrict__ rstd, T* __restrict__ grad_x,
                            kl_cuda::acc_t<T>* __restrict__ weight_partials, long long rows, long long cols,
                            long long grad_y_row_stride, long long x_row_stride, long long grad_y_col_stride,
                            long long x_col_stride, long long weight_col_stride, long long rstd_stride) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  constexpr int THREADS = kBlockThreads;
  // Two buffers, used by alternate rows: a thread still reading row i's warp sums cannot be overtaken by a
  // warp writing row i + 1's (it writes the other buffer), and row i + 2's writes come after row i + 1's
  // barrier, which every thread reaches only after it has read row i's.
  __shared__ A partials[2][THREADS / kWarp];
  const int tid = threadIdx.x;
  const long long n_packs = cols / VEC;
  A* part = weight_partials + (long long)blockIdx.x * cols;

  A dw[kCachePacks][VEC];
#pragma unroll
  for (int k = 0; k < kCachePacks; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[k][j] = 0;
  for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS)
#pragma unroll
    for (int j = 0; j < VEC; ++j) part[p * VEC + j] = 0;

  int buffer = 0;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x, buffer ^= 1) {  // uniform over the block
    const T* gyr = grad_y + row * grad_y_row_stride;
    const T* xr = x + row * x_row_stride;
    const A r = rstd[STRIDED ? row * rstd_stride : row];
    Pack<T, VEC> xv[kCachePacks];
    A dot = 0;
#pragma unroll
    for (int k = 0; k < kCachePacks; ++k) {
      const long long p = tid + (long long)THREADS * k;
      if (p < n_packs) {
        xv[k] = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
        const Pack<T, VEC> g = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
        const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot += (to_acc(g.v[j]) * to_acc(w.v[j])) * (to_acc(xv[k].v[j]) * r);
      }
    }
    for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
      const Pack<T, VEC> xs = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
      const Pack<T, VEC> gs = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
      const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += (to_acc(gs.v[j]) * to_acc(w.v[j])) * (to_acc(xs.v[j]) * r);
    }
    const A mean = block_sum<THREADS / kWarp>(dot, partials[buffer]) / (A)cols;

    T* gxr = grad_x + row * cols;
#pragma unroll
    for (int k = 0; k < kCachePacks; ++k) {
      const long long p = tid + (long long)THREADS * k;
      if (p < n_packs) {
        const Pack<T, VEC> g = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
        const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
        Pack<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const A xhat = to_acc(xv[k].v[j]) * r;
          const A dy = to_acc(g.v[j]);
          store_as((dy * to_acc(w.v[j]) - xhat * mean) * r, out.v[j]);
          dw[k][j] += dy * xhat;
        }
        store_pack<VEC>(gxr + p * VEC, out);
      }
    }
    for (long long p = tid + (long long)THREADS * kCachePacks; p < n_packs; p += THREADS) {
      const Pack<T, VEC> xs = load_cols<VEC, STRIDED>(xr, p, x_col_stride);
      const Pack<T, VEC> gs = load_cols<VEC, STRIDED>(gyr, p, grad_y_col_stride);
      const Pack<T, VEC> w = load_cols<VEC, STRIDED>(weight, p, weight_col_stride);
      Pack<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A xhat = to_acc(xs.v[j]) * r;
        const A dy = to_acc(gs.v[j]);
        store_as((dy * to_acc(w.v[j]) - xhat * mean) * r, out.v[j]);
        part[p * VEC + j] += dy * xhat;
      }
      store_pack<VEC>(gxr + p * VEC, out);
    }
  }

#pragma unroll
  for (int k = 0; k < kCachePacks; ++k) {
    const long long p = tid + (long long)THREADS * k;
    if (p < n_packs) {
      Pack<A, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = dw[k][j];
      store_pack<VEC>(part + p * VEC, out);
    }
  }
}

// grad_weight[c] = sum over p of weight_partials[p, c], in a fixed order. Block (32, kReduceRows), one block
// per 32 columns: thread (tx, ty) adds rows ty, ty + 16, ... of column blockIdx.x * 32 + tx in order (a warp
// reads 32 consecutive columns of one row: 128 coalesced bytes), then thread (tx, 0) adds the 16 sums in
// order of ty and rounds to T once.
template <typename T>
__global__ void __launch_bounds__(kl_cuda::kWarp* kl_cuda::kReduceRows)
    rms_norm_weight_grad_reduce(const kl_cuda::acc_t<T>* __restrict__ weight_partials, T* __restrict__ grad_weight,
                                long long n_partials, long long cols) {
  using namespace kl_cuda;
  using A = acc_t<T>;
  __shared__ A sums[kReduceRows][kWarp];
  const long long c = (long long)blockIdx.x * kWarp + threadIdx.x;
  A s = 0;
  if (c < cols)
    for (long long p = threadIdx.y; p < n_partials; p += kReduceRows) s += weight_partials[p * cols + c];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    A total = 0;
#pragma unroll
    for (int i = 0; i < kReduceRows; ++i) total += sums[i][threadIdx.x];
    store_as(total, grad_weight[c]);
  }
}
