"""The SIMT emulator (``utils.simt``) against hand-computed results: CUDA C++ run on the CPU thread by thread.

Every kernel here is real CUDA: the same source is compiled for sm_90 by ``nvcc`` (where it is installed)
at the end. Negative controls (a divergent barrier, a shuffle with exited lanes, an out-of-bounds write)
must be reported, never hang.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from utils import simt

# One source for every test: the emulator compiles one kernel of it at a time, nvcc all of it at once.
KERNELS = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <mma.h>

// Each thread writes its square into shared memory; after the barrier it reads its neighbour's.
__global__ void neighbour_squares(float* out) {
  __shared__ float squares[256];
  int t = threadIdx.x + blockDim.x * threadIdx.y;
  int n = blockDim.x * blockDim.y;
  squares[t] = (float)(t * t);
  __syncthreads();
  int block = blockIdx.x + gridDim.x * blockIdx.y;
  out[block * n + t] = squares[(t + 1) % n] + 1000.0f * block;
}

// The same without the barrier: a thread that runs before its neighbour reads unwritten shared memory.
__global__ void neighbour_squares_racy(float* out) {
  __shared__ float squares[256];
  int t = threadIdx.x;
  squares[t] = (float)(t * t);
  out[t] = squares[(t + 1) % blockDim.x];
}

__global__ void shuffles(const float* x, float* out, int delta) {
  int lane = threadIdx.x & 31;
  float v = x[threadIdx.x];
  float sum = v;
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  int n = blockDim.x;
  out[0 * n + threadIdx.x] = sum;
  out[1 * n + threadIdx.x] = __shfl_down_sync(0xffffffffu, v, delta);
  out[2 * n + threadIdx.x] = __shfl_up_sync(0xffffffffu, v, delta);
  out[3 * n + threadIdx.x] = __shfl_sync(0xffffffffu, v, 31 - lane);
  out[4 * n + threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 9, 8);   // lanes past their group of 8 keep v
  out[5 * n + threadIdx.x] = __shfl_sync(0xffffffffu, v, 3, 16);      // lane 3 of each half warp
  out[6 * n + threadIdx.x] = (float)__popc(__ballot_sync(0xffffffffu, v > 0.0f));
}

// The two halves of a warp shuffle apart, each naming its own lanes in the mask.
__global__ void half_warp_shuffles(float* out) {
  int lane = threadIdx.x;
  float v = (float)lane;
  if (lane < 16) v = __shfl_down_sync(0x0000ffffu, v, 1, 16) * 10.0f;
  else v = __shfl_up_sync(0xffff0000u, v, 2, 16) * 100.0f;
  out[lane] = v;
}

// Threads past `live` return at once; the others still meet at __syncthreads (sm_70+: a warp that returned whole
// does not count; part of a warp returning while its other lanes wait at the barrier is undefined, and reported).
__global__ void early_exit(float* out, int live) {
  __shared__ float values[128];
  int t = threadIdx.x;
  if (t >= live) return;
  values[t] = (float)(t + 1);
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < live; ++i) total += values[i];
  out[t] = total;
}

// Negative controls: barriers that cannot complete.
__global__ void barrier_in_a_branch(float* out) {
  if (threadIdx.x < 40) __syncthreads();
  out[threadIdx.x] = 1.0f;
  __syncthreads();
}

// Lane 0 of each warp alone waits at the barrier; the other lanes run past it and return.
__global__ void barrier_for_lane_0(float* out) {
  const int lane = threadIdx.x % 32;
  float v = (float)threadIdx.x;
  if (lane == 0) __syncthreads();
  out[threadIdx.x] = v;
}

__global__ void shuffle_after_exit(float* out) {
  if (threadIdx.x >= 20) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

__global__ void shuffle_against_barrier(float* out) {
  float v = 1.0f;
  if (threadIdx.x == 0) __syncthreads();
  else v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void to_bf16(const float* x, __nv_bfloat16* y, float* back, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    y[i] = __float2bfloat16(x[i]);
    back[i] = __bfloat162float(y[i]);
  }
}

__global__ void to_half(const float* x, __half* y, float* back, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    y[i] = __float2half(x[i]);
    back[i] = __half2float(y[i]);
  }
}

__global__ void bf16_pairs(const float* x, __nv_bfloat162* y, float2* back, int pairs) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < pairs) {
    y[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    back[i] = __bfloat1622float2(y[i]);
  }
}

// 128-bit loads and stores: each thread reverses one float4.
__global__ void reverse_float4(const float* __restrict__ x, float* __restrict__ y, int vectors) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < vectors) {
    float4 v = reinterpret_cast<const float4*>(x)[i];
    reinterpret_cast<float4*>(y)[i] = make_float4(v.w, v.z, v.y, v.x);
  }
}

__global__ void float4_from(const float* x, float* y, int first) {
  float4 v = __ldg(reinterpret_cast<const float4*>(x + first) + threadIdx.x);
  y[threadIdx.x] = v.x + v.y + v.z + v.w;
}

__global__ void atomics(const float* x, float* total, int* count, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    atomicAdd(total, x[i]);
    atomicAdd(count, 1);
  }
}

// C (M x N, fp32) = A (M x K, bf16 row-major) B (K x N, bf16 column-major): one warp per 16 x 16 tile of C.
__global__ void wmma_gemm(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, float* d, int M, int N,
                          int K) {
  using namespace nvcuda;
  int warp = threadIdx.x / 32, tiles_n = N / 16;
  int tile = blockIdx.x * (blockDim.x / 32) + warp;
  if (tile >= (M / 16) * tiles_n) return;
  int row = tile / tiles_n * 16, col = tile % tiles_n * 16;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(acc, c + row * N + col, N, wmma::mem_row_major);
  for (int k = 0; k < K; k += 16) {
    wmma::load_matrix_sync(fa, a + row * K + k, K);
    wmma::load_matrix_sync(fb, b + col * K + k, K);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= 2.0f;
  wmma::store_matrix_sync(d + row * N + col, acc, N, wmma::mem_row_major);
}

// Each thread copies 16 bytes into shared memory with cp.async; `wait` = 0 reads them before waiting.
__global__ void async_copy(const float* x, float* y, int wait) {
  __shared__ __align__(16) float tile[4 * 64];
  int t = threadIdx.x;
  __pipeline_memcpy_async(tile + 4 * t, x + 4 * t, 16, t == 0 ? 8 : 0);  // thread 0 zero-fills its last 8 bytes
  __pipeline_commit();
  if (wait) __pipeline_wait_prior(0);
  __syncthreads();
  for (int i = 0; i < 4; ++i) y[4 * t + i] = tile[4 * ((t + 1) % blockDim.x) + i];
}

__global__ void write_past_the_end(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  y[i] = x[i < n ? i : 0] + 1.0f;  // no bound on the store
}

__global__ void rows_past_cols(float* y, int rows, int cols, int stride) {
  int r = blockIdx.x, c = threadIdx.x;
  if (c <= cols) y[r * stride + c] = 1.0f;  // one column too many
}

// Each row's last float4 read and written back whole: the bytes past the row's `cols` keep their values.
__global__ void float4_read_modify_write(float* y, int cols, int stride) {
  float4* last = reinterpret_cast<float4*>(y + blockIdx.x * stride) + (cols - 1) / 4;
  if (threadIdx.x == 0) {
    float4 v = *last;
    v.x = 2.0f;
    *last = v;
  }
}

// Each row read one float past its end (into the padding between rows, or past the last row).
__global__ void read_past_the_row(const float* x, float* y, int cols, int stride) {
  const float* row = x + blockIdx.x * stride;
  if (threadIdx.x == 0) y[blockIdx.x] = row[cols];
}

__global__ void wild_store(float* y) { y[threadIdx.x * 100000000LL] = 1.0f; }

__global__ void shared_past_the_end(float* y) {
  __shared__ float tile[32];
  tile[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  y[threadIdx.x] = tile[threadIdx.x];
}

__global__ void endless(float* y) {
  while (y[0] == y[0]) y[1] += 1.0f;
}

template <int SCALE>
__global__ void scaled_copy(const float* x, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = SCALE * x[i];
}

__global__ void typed_args(unsigned u, int i, double d, float* out) {
  out[0] = (float)u;
  out[1] = (float)i;
  out[2] = (float)d;
}
"""


def run(kernel, grid, block, args, **kwargs):
    simt.launch(KERNELS, kernel, grid, block, args, **kwargs)


def nans(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype)


# ------------------------------------------------------------------------------------------------------
# Barriers and shared memory
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_barrier_orders_shared_memory_in_2d_blocks_and_grids(order):
    out = nans(6 * 96)
    run("neighbour_squares", (3, 2), (32, 3), [out], order=order)
    t = torch.arange(96)
    for block in range(6):
        expected = ((t + 1) % 96).float() ** 2 + 1000 * block
        assert torch.equal(out[block * 96 : (block + 1) * 96], expected)


def test_a_missing_barrier_reads_shared_memory_nobody_wrote_yet():
    # Threads run one after another until they wait: without a barrier, thread t reads t+1's slot before
    # t+1 has run (forward order) — and shared memory starts as 0xFF bytes (NaN), as garbage would on a GPU.
    out = nans(64)
    run("neighbour_squares_racy", 1, 64, [out])
    assert torch.isnan(out[:63]).all() and out[63] == 0.0
    run("neighbour_squares_racy", 1, 64, [out], order="reverse")
    assert torch.equal(out[:63], (torch.arange(1, 64) ** 2).float()) and torch.isnan(out[63])


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_warps_that_returned_whole_no_longer_count_at_syncthreads(order):
    out = nans(128)
    run("early_exit", 1, 128, [out, 64], order=order)
    assert torch.equal(out[:64], torch.full((64,), 64 * 65 / 2))
    assert torch.isnan(out[64:]).all()


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_a_barrier_that_part_of_a_warp_returned_before_is_reported(order):
    with pytest.raises(simt.SimtError) as caught:
        run("early_exit", 1, 128, [nans(128), 40], order=order)
    message = str(caught.value)
    assert caught.value.kind == "error" and "not reached by every thread of block (0, 0, 0)" in message
    assert "with threads 32-39 there while threads 40-63 of the same warps had returned" in message


def test_a_barrier_only_lane_0_of_each_warp_reaches_is_reported():
    report = simt.run_checked(KERNELS, "barrier_for_lane_0", 2, 128, [nans(256)], outputs=[0], names=["out"])
    assert report.status == "error" and "__syncthreads() at kernel.cu:" in report.message
    assert "with threads 0, 32, 64, 96 there while threads 1-31, 33-63, 65-95, 97-127" in report.message


# ------------------------------------------------------------------------------------------------------
# Warp collectives
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [1, 5])
def test_each_shuffle_kind_against_hand_computed_lanes(gen, delta):
    x = torch.randn(64, generator=gen)
    out = nans(7 * 64)
    run("shuffles", 1, 64, [x, out, delta])
    out = out.view(7, 64)
    lane = torch.arange(64) % 32
    warp_base = torch.arange(64) - lane
    assert torch.allclose(out[0], x.view(2, 32).sum(1).repeat_interleave(32), rtol=1e-6, atol=1e-6)
    # down: a lane whose source is past the warp keeps its own value, as on a GPU
    down = torch.where(lane + delta < 32, warp_base + lane + delta, warp_base + lane)
    assert torch.equal(out[1], x[down])
    up = torch.where(lane - delta >= 0, warp_base + lane - delta, warp_base + lane)
    assert torch.equal(out[2], x[up])
    assert torch.equal(out[3], x[warp_base + 31 - lane])
    # xor 9 within groups of 8: lane ^ 9 lands in the next group for lanes 0-7 of a group of 16 -> own value
    group = lane & ~7
    xor = lane ^ 9
    assert torch.equal(out[4], x[warp_base + torch.where(xor >= group + 8, lane, xor)])
    assert torch.equal(out[5], x[warp_base + (lane & ~15) + 3])
    positives = (x.view(2, 32) > 0).sum(1).float().repeat_interleave(32)
    assert torch.equal(out[6], positives)


def test_the_two_halves_of_a_warp_shuffle_apart_with_their_own_masks():
    out = nans(32)
    run("half_warp_shuffles", 1, 32, [out])
    lane = torch.arange(32)
    low = torch.where(lane + 1 < 16, lane + 1, lane) * 10.0
    high = torch.where(lane - 2 >= 16, lane - 2, lane) * 100.0
    assert torch.equal(out, torch.where(lane < 16, low, high).float())


# ------------------------------------------------------------------------------------------------------
# Deadlocks are reported, never hung in
# ------------------------------------------------------------------------------------------------------


def test_a_syncthreads_in_a_branch_some_threads_skip_is_reported():
    with pytest.raises(simt.SimtError) as caught:
        run("barrier_in_a_branch", 2, 64, [nans(64)])
    message = str(caught.value)
    assert caught.value.kind == "error"
    assert "divergent __syncthreads()" in message and "block (0, 0, 0)" in message
    assert "threads 0-39" in message and "threads 40-63" in message


def test_a_full_mask_shuffle_with_lanes_that_returned_is_a_deadlock():
    with pytest.raises(simt.SimtError) as caught:
        run("shuffle_after_exit", 1, 32, [nans(32)])
    message = str(caught.value)
    assert caught.value.kind == "deadlock"
    assert "__shfl_xor_sync(mask 0xffffffff)" in message and "lanes 0-19 arrived" in message
    assert "lanes 20-31 returned" in message


def test_a_shuffle_against_a_barrier_is_a_deadlock_naming_both():
    report = simt.run_checked(KERNELS, "shuffle_against_barrier", 1, 32, [nans(32)], outputs=[0], names=["out"])
    assert report.status == "deadlock"
    assert (
        "__syncthreads() at kernel.cu:" in report.message
        and "threads 0 arrived (1 of 32 live threads)" in report.message
    )
    assert "lanes 1-31 arrived; lanes 0 wait elsewhere" in report.message


def test_a_partial_warp_cannot_shuffle_with_a_full_mask():
    with pytest.raises(simt.SimtError, match=r"lanes 16-31 do not exist \(the block has 48 threads\)"):
        run("shuffles", 1, 48, [torch.randn(48), nans(7 * 48), 1])


# ------------------------------------------------------------------------------------------------------
# bf16 and fp16: CUDA's round-to-nearest-even, bit for bit against torch
# ------------------------------------------------------------------------------------------------------


def awkward_floats(gen, n=1 << 14):
    """Random bit patterns (every exponent: subnormals, huge values, NaN, inf), exact ties, and ordinary values."""
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    patterns = bits.view(torch.float32)
    ties = (torch.randint(0, 2**16, (n // 4,), generator=gen, dtype=torch.int64) << 16 | 0x8000).to(torch.int32)
    half_ties = (torch.randint(0x3000, 0x4800, (n // 4,), generator=gen) << 16 | 0x1000).to(torch.int32)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            65504.0,
            65519.99,
            65520.0,
            2.0**-24,
            2.0**-25,
            2.0**-25 * 1.0000001,
            2.0**-14,
            3.0e38,
            3.4e38,
            1.0e-40,
        ]
    )
    return torch.cat(
        [
            patterns,
            ties.view(torch.float32),
            half_ties.view(torch.float32),
            special,
            torch.randn(n, generator=gen) * 100,
        ]
    )


@pytest.mark.parametrize("kernel,dtype", [("to_bf16", torch.bfloat16), ("to_half", torch.float16)])
def test_conversions_round_to_nearest_even_like_torch(gen, kernel, dtype):
    x = awkward_floats(gen)
    y, back = torch.empty(x.numel(), dtype=dtype), nans(x.numel())
    run(kernel, (x.numel() + 255) // 256, 256, [x, y, back, x.numel()])
    expected = x.to(dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(y), nan)
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert torch.equal(back[~nan], expected[~nan].float())


def test_bf16_pairs_round_and_widen(gen):
    x = torch.randn(2 * 300, generator=gen) * 1000
    y, back = torch.empty(2 * 300, dtype=torch.bfloat16), nans(2 * 300)
    run("bf16_pairs", 2, 256, [x, simt.Arg(y, "__nv_bfloat162*"), simt.Arg(back, "float2*"), 300])
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(back, x.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------------------
# Vector loads, atomics, tensor cores, cp.async
# ------------------------------------------------------------------------------------------------------


def test_float4_loads_and_stores(gen):
    x = torch.randn(4 * 300, generator=gen)
    y = nans(4 * 300)
    run("reverse_float4", 2, 256, [x, y, 300])
    assert torch.equal(y, x.view(300, 4).flip(1).reshape(-1))


def test_a_misaligned_float4_load_is_reported_with_its_line():
    x = torch.randn(64)
    with pytest.raises(simt.SimtError, match=r"__ldg at kernel\.cu:\d+: misaligned address .* 16-byte alignment"):
        run("float4_from", 1, 8, [x, nans(8), 1])
    out = nans(8)
    run("float4_from", 1, 8, [x, out, 4])
    assert torch.allclose(out, x[4:36].view(8, 4).sum(1))


def test_atomics_from_every_block(gen):
    x = torch.randn(1000, generator=gen)
    total, count = torch.zeros(1), torch.zeros(1, dtype=torch.int32)
    run("atomics", 4, 256, [x, total, count, 1000])
    assert count.item() == 1000
    assert torch.allclose(total, x.double().sum().float(), rtol=1e-5, atol=1e-4)


def test_wmma_against_a_float64_matmul(gen):
    M, N, K = 32, 48, 64
    a = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(K, N, generator=gen).to(torch.bfloat16)
    c = torch.randn(M, N, generator=gen)
    d = nans(M, N)
    # b column-major: its transpose, contiguous
    run("wmma_gemm", 2, 96, [a, b.t().contiguous(), c, d, M, N, K])
    expected = 2 * (a.double() @ b.double() + c.double())
    assert torch.allclose(d.double(), expected, rtol=1e-6, atol=1e-5)


def test_wmma_lanes_must_pass_the_same_pointer():
    source = (
        KERNELS
        + r"""
__global__ void lane_pointers(const __nv_bfloat16* a, float* d) {
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> fa;
  nvcuda::wmma::load_matrix_sync(fa, a + threadIdx.x, 16);
  d[threadIdx.x] = 0.0f;
}
"""
    )
    with pytest.raises(simt.SimtError, match="lanes of a warp must pass the same pointer"):
        simt.launch(source, "lane_pointers", 1, 32, [torch.zeros(600, dtype=torch.bfloat16), nans(32)])


def test_async_copies_complete_at_the_wait_with_their_zero_fill(gen):
    x = torch.randn(256, generator=gen)
    y = nans(256)
    run("async_copy", 1, 64, [x, y, 1])
    expected = x.view(64, 4).roll(-1, 0).clone()
    expected[63, 2:] = 0.0  # thread 0's copy zero-filled its last 8 bytes; thread 63 reads it
    assert torch.equal(y.view(64, 4), expected)
    # Read before the wait: the copies have not landed, the tile still holds its poison.
    run("async_copy", 1, 64, [x, y, 0])
    assert torch.isnan(y).all()


# ------------------------------------------------------------------------------------------------------
# run_checked: guards, crashes, sanitizers, timeouts
# ------------------------------------------------------------------------------------------------------


def test_writes_past_the_end_land_in_the_guard_and_are_reported(gen):
    x = torch.randn(100, generator=gen)
    y = nans(100)
    report = simt.run_checked(KERNELS, "write_past_the_end", 4, 32, [x, y, 100], outputs=[1], names=["x", "y", "n"])
    assert report.status == "ok" and not report.ok
    (hit,) = report.guard_hits
    assert hit.arg == "y" and hit.after == tuple(range(100, 128)) and not hit.before and not hit.gaps
    assert torch.equal(y, x + 1)  # the kernel's in-bounds writes are copied back


def test_writes_between_the_rows_of_a_strided_view_are_reported():
    base = torch.zeros(5, 12)
    y = base[:, :7]  # 5 rows of 7 columns, row stride 12
    report = simt.run_checked(KERNELS, "rows_past_cols", 5, 32, [y, 5, 7, 12], outputs=[0], names=["y"])
    (hit,) = report.guard_hits
    assert hit.gaps == (7, 19, 31, 43) and hit.after == (55,)
    assert torch.equal(base[:, :7], torch.ones(5, 7)) and torch.equal(base[:, 7:], torch.zeros(5, 5))


def test_a_float4_written_back_over_a_rows_padding_is_reported_though_no_byte_changed():
    base = torch.zeros(3, 8)
    y = base[:, :5]  # rows of 5 floats, 8 apart: each row's second float4 holds 3 floats of padding
    report = simt.run_checked(KERNELS, "float4_read_modify_write", 3, 32, [y, 5, 8], outputs=[0], names=["y"])
    assert report.status == "ok" and not report.guard_hits and not report.ok
    first = report.bad_accesses[0]
    assert first.arg == "y" and first.size == 16 and first.outside == 12 and first.row == 0
    assert "y: read 12 bytes past the end of row 0, into the padding between rows" in str(report)
    assert "kernel.cu:" in first.line and first.thread == "block (0, 0, 0), thread (0, 0, 0)"
    assert torch.equal(base[:, 4], torch.full((3,), 2.0))


def test_a_read_into_the_padding_between_rows_is_reported(gen):
    x = torch.randn(4, 12, generator=gen)[:, :7]
    report = simt.run_checked(KERNELS, "read_past_the_row", 4, 32, [x, nans(4), 7, 12], outputs=[1], names=["x", "y"])
    (access,) = report.bad_accesses  # one report per source line
    assert not access.write and access.arg == "x" and access.outside == 4 and access.row == 0
    assert "past the end of row 0, into the padding between rows" in access.place


def test_reads_and_writes_inside_the_views_are_not_reported(gen):
    x = torch.randn(4, 12, generator=gen)[:, :8]
    report = simt.run_checked(KERNELS, "read_past_the_row", 3, 32, [x, nans(3), 7, 12], outputs=[1], names=["x", "y"])
    assert report.ok, str(report)


REPO = Path(__file__).resolve().parents[1]
NATIVE_CUDA = REPO / "kernels" / "kernel_ladder" / "native" / "csrc" / "cuda"
GEMM_CUDA = REPO / "chapters" / "13_below_triton" / "src" / "cuda"


def test_the_native_rms_norm_and_softmax_kernels_touch_only_their_views(gen):
    """The library's CUDA kernels under the sanitizer, on rows padded to a longer stride: every byte they read or
    write is an element of a view (the padding between rows and the guards are poisoned)."""
    rows, cols = 5, 36
    x = torch.randn(rows, 40, generator=gen)[:, :cols]
    w, y, rstd = torch.rand(cols, generator=gen) + 0.5, nans(rows, cols), nans(rows)
    report = simt.run_checked(
        NATIVE_CUDA / "softmax.cuh",
        "rms_norm_forward_warp<float, 4, false>",
        2,
        (32, 4),
        [x, w, y, rstd, rows, cols, 40, 1e-6, 1, 1],
        include_dirs=(NATIVE_CUDA,),
        outputs=[2, 3],
        names=["x", "w", "y", "rstd"],
    )
    assert report.ok, str(report)
    x64 = x.double()
    assert torch.allclose(y.double(), x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w, atol=1e-5)
    x, y = torch.randn(2, 4104, generator=gen)[:, :4100], nans(2, 4100)
    report = simt.run_checked(
        NATIVE_CUDA / "softmax.cuh",
        "softmax_forward_block<float, 4, false>",
        2,
        256,
        [x, y, 2, 4100, 4104, 1],
        include_dirs=(NATIVE_CUDA,),
        outputs=[1],
        names=["x", "y"],
    )
    assert report.ok, str(report)
    assert torch.allclose(y.double(), torch.softmax(x.double(), -1), atol=1e-7)


def test_the_cp_async_gemm_touches_only_its_operands(gen):
    m, n, k = 33, 100, 64  # ragged tiles: the copies of the last rows and columns are zero-filled, not read
    a, b, c = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen), nans(m, n)
    report = simt.run_checked(
        GEMM_CUDA / "gemm_cp_async.cuh", "gemm_cp_async<true>", 1, 256, [a, b, c, m, n, k], outputs=[2]
    )
    assert report.ok, str(report)
    assert torch.allclose(c.double(), a.double() @ b.double(), atol=1e-4)


def test_an_input_written_in_place_is_reported():
    x = torch.randn(64)
    report = simt.run_checked(KERNELS, "write_past_the_end", 2, 32, [x, x, 64], outputs=[], names=["x", "y", "n"])
    assert "x" in report.changed_inputs and not report.ok


def test_a_wild_store_crashes_the_child_not_the_caller():
    report = simt.run_checked(KERNELS, "wild_store", 1, 64, [nans(64)], outputs=[0], names=["y"])
    assert report.status == "crash"
    assert report.message.startswith("SIGSEGV") and "thread (1, 0, 0)" in report.message


def test_an_index_past_a_shared_array_is_reported_with_its_line():
    report = simt.run_checked(KERNELS, "shared_past_the_end", 1, 32, [nans(32)], outputs=[0])
    assert report.status == "out_of_bounds"
    assert "index 32 out of bounds for type 'float [32]'" in report.message


def test_a_misaligned_vector_load_is_caught_by_the_sanitizer():
    source = r"""
__global__ void misaligned(const float* x, float* y) {
  float4 v = reinterpret_cast<const float4*>(x + 1)[threadIdx.x];
  y[threadIdx.x] = v.x;
}
"""
    report = simt.run_checked(source, "misaligned", 1, 4, [torch.randn(32), nans(4)], outputs=[1])
    assert report.status == "misaligned" and "float4" in report.message and report.message.startswith("kernel.cu:3:")


def test_an_endless_kernel_times_out():
    report = simt.run_checked(KERNELS, "endless", 1, 1, [torch.zeros(2)], outputs=[0], timeout=2)
    assert report.status == "timeout"


def test_compile_errors_name_their_lines():
    report = simt.run_checked("__global__ void k(float* y) {\n  y[0] = 1\n}\n", "k", 1, 1, [nans(1)])
    assert report.status == "compile_error"
    assert report.compile_errors and report.compile_errors[0][:2] == ("kernel.cu", 2)
    with pytest.raises(simt.SimtCompileError, match=r"kernel\.cu:2:"):
        simt.launch("__global__ void k(float* y) {\n  y[0] = 1\n}\n", "k", 1, 1, [nans(1)])


# ------------------------------------------------------------------------------------------------------
# Arguments, templates, bad input
# ------------------------------------------------------------------------------------------------------


def test_templates_and_exact_argument_types():
    x = torch.arange(10.0)
    y = nans(10)
    run("scaled_copy<3>", 1, 32, [x, y, 10])
    assert torch.equal(y, 3 * x)
    out = nans(3)
    run("typed_args", 1, 1, [simt.Arg(2**32 - 1, "unsigned"), simt.Arg(-7, "int"), simt.Arg(0.1, "double"), out])
    assert out.tolist() == [float(torch.tensor(2**32 - 1, dtype=torch.float32)), -7.0, float(torch.tensor(0.1))]


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="argument 0 must be a CPU tensor"):
        run("scaled_copy<3>", 1, 32, [torch.empty(4, device="meta"), nans(4), 4])
    with pytest.raises(TypeError, match="argument 2 is a str"):
        run("scaled_copy<3>", 1, 32, [nans(4), nans(4), "4"])
    with pytest.raises(TypeError, match="dtype torch.complex64"):
        run("scaled_copy<3>", 1, 32, [torch.zeros(4, dtype=torch.complex64), nans(4), 4])
    with pytest.raises(ValueError, match="unsupported scalar type"):
        run("scaled_copy<3>", 1, 32, [nans(4), nans(4), simt.Arg(4, "int128")])
    with pytest.raises(TypeError, match="grid must be an int or a tuple"):
        run("scaled_copy<3>", (1, 1, 1, 1), 32, [nans(4), nans(4), 4])
    with pytest.raises(ValueError, match="kernel must name a kernel"):
        run('scaled_copy<3>(); system("x")', 1, 32, [nans(4), nans(4), 4])
    with pytest.raises(simt.SimtError, match="invalid launch configuration"):
        run("scaled_copy<3>", 1, 2048, [nans(4), nans(4), 4])


def test_a_launch_of_64_blocks_of_256_threads_is_fast():
    x = torch.randn(64 * 96)
    out = nans(64 * 256)
    run("neighbour_squares", 64, 256, [out])  # compiled and loaded
    started = time.perf_counter()
    run("neighbour_squares", 64, 256, [out])
    assert time.perf_counter() - started < 0.5
    del x


# ------------------------------------------------------------------------------------------------------
# The same source is real CUDA
# ------------------------------------------------------------------------------------------------------


def test_the_same_source_compiles_for_sm_90_with_nvcc():
    from utils import nvcc

    if nvcc.find_nvcc() is None:
        pytest.skip("no nvcc on this machine")
    build = nvcc.compile_cuda(
        KERNELS, instantiate=["template __global__ void scaled_copy<3>(const float*, float*, long long);"]
    )
    # (a name with its "(": utils.nvcc also matches "neighbour_squares_racy" by prefix)
    for kernel in ("neighbour_squares(", "shuffles", "wmma_gemm", "async_copy", "to_bf16", "reverse_float4"):
        assert build.instructions(kernel), kernel
    names = {i.base for i in build.instructions("wmma_gemm")}
    assert "HMMA" in names
    assert "LDGSTS" in {i.base for i in build.instructions("async_copy")}
    assert "SHFL" in {i.base for i in build.instructions("shuffles")}


COUNTED = r"""
__global__ void copy_rows(const float* x, float* y, int vectors_per_thread, int shuffles) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const float4* xv = reinterpret_cast<const float4*>(x);
  float4* yv = reinterpret_cast<float4*>(y);
  for (int i = 0; i < vectors_per_thread; ++i) yv[t * vectors_per_thread + i] = xv[t * vectors_per_thread + i];
  float s = x[4 * t];
  for (int k = 0; k < shuffles; ++k) s += __shfl_xor_sync(0xffffffffu, s, 1);
  if (threadIdx.x % 32 == 0) y[4 * t] = s;
}

__global__ void lane_0_sets(float* out) {
  float sum;
  if (threadIdx.x == 0) sum = 0.0f;
  sum += 1.0f;
  out[threadIdx.x] = sum;
}
"""


def test_shuffles_are_counted_by_thread_and_float4_reads_by_tensor(gen):
    x, y = torch.randn(2 * 64 * 4 * 3, generator=gen), nans(2 * 64 * 4 * 3)
    report = simt.run_checked(
        COUNTED, "copy_rows", 2, 64, [x, y, 3, 5], outputs=[1], names=["x", "y"], count_reads=True
    )
    assert report.ok, report
    assert report.shuffles == [5] * 128 and report.reads16 == {"x": 384, "y": 0}
    report = simt.run_checked(
        COUNTED, "copy_rows", 2, 64, [x, y, 0, 0], outputs=[1], names=["x", "y"], count_reads=True
    )
    assert report.shuffles == [0] * 128 and report.reads16 == {"x": 0, "y": 0}


def test_an_uninitialized_local_is_garbage_not_what_suits_the_compiler():
    out = torch.zeros(32)
    report = simt.run_checked(COUNTED, "lane_0_sets", 1, 32, [out], outputs=[0], names=["out"])
    assert report.ok and out[0] == 1.0 and (out[1:] != 1.0).all(), out
