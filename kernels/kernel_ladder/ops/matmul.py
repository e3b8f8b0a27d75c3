"""Matrix multiplication, ``torch.matmul``-style, as ``kernel_ladder::matmul``: tiled, split-K and persistent kernels.

``C = A @ B`` with A (M, K), B (K, N): every output element is a K-long dot product, so a naive
kernel reads each row of A N times and each column of B M times. The kernels here tile the
output: one program computes a ``BLOCK_M x BLOCK_N`` tile, walking K in ``BLOCK_K`` slices
and accumulating ``tl.dot`` products (tensor cores on a GPU) in a float32 accumulator. Each
element of A is then read ``N / BLOCK_N`` times and each of B ``M / BLOCK_M`` times::

    bytes read  =  (M*K * ceil(N/BN)  +  K*N * ceil(M/BM)) * element size        (+ M*N written)

Three kernels share the tile loop (``accumulate``) and the epilogue (``store_tile``), @triton.jit
functions other GEMM-shaped kernels call too (``kernel_ladder.gated_mlp``):

* ``matmul_kernel`` — one program per output tile, in **grouped order**: programs walk
  ``GROUP_M`` tile-rows column by column, so consecutive programs share B tiles *and* A tiles
  in L2 (``GROUP_M = 1`` is plain row-major order). Autotuned on a GPU (:mod:`kernel_ladder.autotune`).
* ``matmul_split_k_kernel`` — for skinny, decode-shaped problems (small M, long K) whose tile
  grid cannot fill the GPU: the K range is split ``SPLIT_K`` ways, each program writes an fp32
  partial tile to a ``(SPLIT_K, M, N)`` workspace, and ``matmul_split_k_reduce_kernel`` sums
  the partials in a fixed order (deterministic, unlike atomics) and applies the epilogue.
* ``matmul_persistent_kernel`` — as many programs as the GPU has SMs; each loops over tiles
  (``tile = pid, pid + num_programs, ...``), so launch and tail costs are paid once.

The epilogue is where ``kernel_ladder.linear`` fuses its bias and activation: they are applied to the
fp32 accumulator before the one store (``HAS_BIAS``, ``ACTIVATION``; ``STORE_PREACT`` also stores
the pre-activation for the backward pass).

Operands are read through their strides — a transposed or sliced view costs no copy — and
batch dimensions broadcast like ``torch.matmul`` (a stride-0 batch dim re-reads the same matrix).
Offsets are computed in int64 when some offset can pass 2**31 (``INDEX_64``). The tile loop keeps one
offset per loaded element, fixed for the whole loop, and two scalar base pointers that advance one K
slice per step (not a 64-bit pointer per element advanced every step): fewer registers and integer
instructions per K step (counts in docs/architecture.md). fp32 inputs use
TF32 tensor cores on a GPU exactly when ``torch.backends.cuda.matmul.allow_tf32`` is set
(``INPUT_PRECISION``); the interpreter always computes in IEEE fp32.

**Dispatch** (:func:`plan_matmul`): split-K when the tiled grid has fewer tiles than the GPU has SMs
and K is long enough to share out (:func:`choose_split_k`); otherwise the tiled kernel, autotuned on
a GPU, with :data:`kernel_ladder.autotune.INTERPRETER_CONFIG` in the interpreter (where "SMs" is
:data:`kernel_ladder._launch.INTERPRETER_SMS`). Two cases:

* decode-shaped, M <= 64 (64 x 64 tiles on a GPU): ``SPLIT_K = min(2 * SMs // tiles, K // 256, 16)``
  (about two programs per SM; each split keeps >= 256 of K), if that is at least 2;
* short-M, long-K, M > 64 (128 x 128 tiles; a fused linear cross-entropy's ``grad_x = G @ W``, M the
  chunk's rows, K the vocabulary): the split in ``2 .. min(16, K // 8192)`` whose ``tiles * SPLIT_K``
  programs fill the last wave best (the fewest splits among equals), if that beats the unsplit grid.
  Each split keeps >= 8192 of K, so the fp32 partials' round trip (``8 M N`` bytes per split) costs at
  most ``4 * 184 / 8192`` = 9% of the GEMM's FLOP time at an H200's sustained 790 TFLOP/s over 4.3 TB/s.
  At M = 256, N = 4096, K = 128,256: 64 tiles on 132 SMs unsplit, 128 programs split two ways.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _activations, _launch, runtime
from .._validate import check_float_dtype, check_same_device, check_same_dtype, check_tensor
from ..autotune import (
    SPLIT_K_DECODE_ROWS,
    MatmulConfig,
    default_config,
    make_autotuned,
    size_bucket,
)

__all__ = [
    "EPILOGUE_ACTIVATIONS",
    "launch_matmul",
    "reduced_product",
    "MatmulConfig",
    "MatmulPlan",
    "matmul",
    "matmul_tiled",
    "matmul_split_k",
    "matmul_persistent",
    "plan_matmul",
    "choose_split_k",
    "wave_efficiency",
    "matmul_kernel",
    "matmul_split_k_kernel",
    "matmul_split_k_reduce_kernel",
    "matmul_persistent_kernel",
]

#: What the epilogue can apply (:mod:`kernel_ladder._activations`; ``"none"`` for plain matmul).
EPILOGUE_ACTIVATIONS: tuple[str, ...] = ("none", *_activations.ACTIVATIONS)

#: The decode-shaped split-K rule applies to problems with at most this many rows; wider ones take the
#: short-M, long-K rule (:func:`choose_split_k`).
SPLIT_K_MAX_M = SPLIT_K_DECODE_ROWS
#: Each split keeps at least this much of K (several BLOCK_K iterations), and at most this many splits.
SPLIT_K_MIN_K_PER_SPLIT = 256
SPLIT_K_MAX = 16
#: Each split of a wider (M > SPLIT_K_MAX_M) problem keeps at least this much of K: its fp32 partial tile's
#: round trip, 8 bytes per output, then costs at most 4 * 184 / 8192 = 9% of its FLOP time (184 FLOP/B: an
#: H200's sustained 790 TFLOP/s dense bf16 over 4.3 TB/s).
SPLIT_K_WIDE_MIN_K_PER_SPLIT = 8192

_MAX_GRID_YZ = 65535  # CUDA's limit on grid dims 1 and 2


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def tile_coords(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of the ``tile_id``-th tile in grouped order (row-major when GROUP_M == 1)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)  # the last group may be short
    in_group = tile_id % num_pid_in_group
    pid_m = first_pid_m + in_group % group_size_m
    pid_n = in_group // group_size_m
    return pid_m, pid_n


@triton.jit
def accumulate(
    a_ptr, b_ptr, pid_m, pid_n, M, N, k_start, k_len,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
):
    """fp32 sum over k in [k_start, k_start + k_len) of A[tile rows, k] * B[k, tile cols]."""
    # Rows/cols past M/N wrap around (% M): those loads stay in bounds and need no mask; their
    # results land in rows/cols that the store masks off. (arange + start, not the epilogue's start +
    # arange: common-subexpression elimination would otherwise compute the epilogue's row and column
    # indices before the K loop and keep them live, or spilled, across it.)
    offs_m = (tl.arange(0, BLOCK_M) + pid_m * BLOCK_M) % M
    offs_n = (tl.arange(0, BLOCK_N) + pid_n * BLOCK_N) % N
    offs_k = tl.arange(0, BLOCK_K)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
        k_start = k_start + tl.full((), 0, tl.int64)  # k_start * stride_ak below in int64
        step = tl.full((), BLOCK_K, tl.int64)
    else:
        step = tl.full((), BLOCK_K, tl.int32)
    # Loop-invariant offset tensors and scalar bases that advance by one K slice per step: the K loop
    # carries one int32 (int64 under INDEX_64) offset per loaded element and two scalar pointers, not
    # a 64-bit pointer per element.
    a_offs = offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_offs = offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    a_base = a_ptr + k_start * stride_ak
    b_base = b_ptr + k_start * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_base + a_offs)
            b = tl.load(b_base + b_offs)
        else:
            k_left = k_len - k * BLOCK_K
            a = tl.load(a_base + a_offs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_base + b_offs, mask=offs_k[:, None] < k_left, other=0.0)
        # Operands go to tl.dot in their storage dtype (fp16/bf16 tensor cores; TF32 or IEEE for fp32).
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_base += step * stride_ak
        b_base += step * stride_bk
    return acc


@triton.jit
def store_tile(
    acc, c_ptr, bias_ptr, preact_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr,
    ACCUMULATE: tl.constexpr = False,
):
    """The epilogue: + bias, (+ C's old value), (store the pre-activation), activation, cast, one store.

    ``ACCUMULATE`` (``C += A @ B``) reads the tile of C first: how a gradient is summed over chunks
    (chapter 06's fused linear cross-entropy adds each chunk's weight gradient into an fp32 buffer).
    """
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    c_offsets = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(c_ptr + c_offsets, mask=mask, other=0.0).to(tl.float32)
    if STORE_PREACT:
        tl.store(preact_ptr + c_offsets, acc.to(preact_ptr.dtype.element_ty), mask=mask)
    acc = _activations.apply(acc, ACTIVATION)
    tl.store(c_ptr + c_offsets, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M_BUCKET", "N_BUCKET", "K_BUCKET"])
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, preact_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_bias,
    M_BUCKET, N_BUCKET, K_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, ACCUMULATE: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """C[b] = epilogue(A[b] @ B[b]) for one BLOCK_M x BLOCK_N tile; grid (tiles, batch).

    Program 0 of the grid's first axis is the tile chosen by the grouped order; axis 1 is the
    batch index (stride 0 for a broadcast operand). ``M_BUCKET``/``N_BUCKET``/``K_BUCKET`` are
    not used by the kernel: they are the autotuner's key (powers of two of M, N, K).
    """
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_b = tl.program_id(1)
    if INDEX_64:
        pid_b = pid_b.to(tl.int64)
    acc = accumulate(
        a_ptr + pid_b * stride_ab, b_ptr + pid_b * stride_bb, pid_m, pid_n, M, N, 0, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, INDEX_64,
    )
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    store_tile(
        acc, c_ptr + pid_b * stride_cb, bias_ptr, preact_ptr + pid_b * stride_cb, offs_m, offs_n, M, N,
        stride_cm, stride_cn, stride_bias, HAS_BIAS, ACTIVATION, STORE_PREACT, ACCUMULATE,
    )


@triton.jit
def matmul_split_k_kernel(
    a_ptr, b_ptr, ws_ptr,
    M, N, K, K_PER_SPLIT,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
):
    """WS[b, s] = A[b][:, Ks] @ B[b][Ks, :] for one tile, Ks the s-th K_PER_SPLIT slice; grid (tiles, SPLIT_K, batch).

    The workspace is a contiguous float32 (batch, SPLIT_K, M, N) buffer; K_PER_SPLIT is a
    multiple of BLOCK_K, so EVEN_K (K % BLOCK_K == 0) holds for every split.
    """
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2)
    split_k = tl.num_programs(1)
    if INDEX_64:
        pid_b = pid_b.to(tl.int64)
        pid_s = pid_s.to(tl.int64)
    k_start = pid_s * K_PER_SPLIT
    k_len = tl.minimum(K - k_start, K_PER_SPLIT)
    acc = accumulate(
        a_ptr + pid_b * stride_ab, b_ptr + pid_b * stride_bb, pid_m, pid_n, M, N, k_start, k_len,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, INDEX_64,
    )
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    ws = ws_ptr + (pid_b * split_k + pid_s) * M * N
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(ws + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def matmul_split_k_reduce_kernel(
    ws_ptr, c_ptr, bias_ptr, preact_ptr,
    M, N, SPLIT_K,
    stride_cb, stride_cm, stride_cn,
    stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, ACCUMULATE: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """C[b] = epilogue(sum over s of WS[b, s]) for one tile, s in order 0..SPLIT_K-1; grid (tiles, batch).

    A fixed summation order makes the result deterministic (atomics would add in arrival order).
    """
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    pid_b = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        pid_b = pid_b.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        plane = tl.full((), 1, tl.int64) * M * N
    else:
        plane = M * N
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ws = ws_ptr + pid_b * SPLIT_K * plane + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, SPLIT_K):
        acc += tl.load(ws, mask=mask, other=0.0)
        ws += plane
    store_tile(
        acc, c_ptr + pid_b * stride_cb, bias_ptr, preact_ptr + pid_b * stride_cb, offs_m, offs_n, M, N,
        stride_cm, stride_cn, stride_bias, HAS_BIAS, ACTIVATION, STORE_PREACT, ACCUMULATE,
    )


@triton.jit
def matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, preact_ptr,
    M, N, K, BATCH,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_bias,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, ACCUMULATE: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """The tiled matmul with a fixed grid: program p computes tiles p, p + P, p + 2P, ... (P programs).

    Tiles are numbered batch-major, then in grouped order inside each batch entry.
    """
    tiles_per_batch = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_per_batch * BATCH
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        pid_b = tile_id // tiles_per_batch
        pid_m, pid_n = tile_coords(tile_id % tiles_per_batch, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if INDEX_64:
            pid_b = pid_b.to(tl.int64)
        acc = accumulate(
            a_ptr + pid_b * stride_ab, b_ptr + pid_b * stride_bb, pid_m, pid_n, M, N, 0, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INPUT_PRECISION, INDEX_64,
        )
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if INDEX_64:
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
        store_tile(
            acc, c_ptr + pid_b * stride_cb, bias_ptr, preact_ptr + pid_b * stride_cb, offs_m, offs_n, M, N,
            stride_cm, stride_cn, stride_bias, HAS_BIAS, ACTIVATION, STORE_PREACT, ACCUMULATE,
        )


# ----------------------------------------------------------------------------------------------
# Planning: shapes -> 3-D strided launches
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Launch3d:
    """One launch's operands as (batch, rows, cols) views of the caller's tensors (no copies)."""

    a: torch.Tensor  # (B, M, K)
    b: torch.Tensor  # (B, K, N)
    c: torch.Tensor  # (B, M, N)
    bias: torch.Tensor | None
    preact: torch.Tensor | None  # (B, M, N), laid out like c
    accumulate: bool = False  # c += a @ b (c read in the epilogue) instead of c = a @ b

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        batch, m, k = self.a.shape
        return batch, m, self.b.shape[2], k


def _merged_stride(dims: Sequence[tuple[int, int]]) -> int | None:
    """The stride of ``dims`` (outer first) walked as one flat dim, or None if they do not chain."""
    dims = [(size, stride) for size, stride in dims if size != 1]
    if not dims:
        return 1
    for (_, outer), (size, inner) in zip(dims, dims[1:]):
        if outer != size * inner:
            return None
    return dims[-1][1]


def _view(t: torch.Tensor, sizes: Sequence[int], strides: Sequence[int], offset: int) -> torch.Tensor:
    return t.as_strided(tuple(sizes), tuple(strides), t.storage_offset() + offset)


def _plan_launches(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, preact: torch.Tensor | None
) -> list[_Launch3d]:
    """Split ``c = a @ b`` (batch dims broadcast, c of the broadcast shape) into 3-D launches.

    * b 2-D and a's batch dims chain into its rows (a contiguous activation tensor): one 2-D
      problem with M = batch * rows — the best tiles, no batch axis.
    * Otherwise batch dims are broadcast (stride 0) and merged where a, b and c all allow it;
      the last remaining batch dim becomes the kernel's batch axis and any others are looped
      over here (views, no copies); batch axes longer than CUDA's 65535 are chunked.
    """
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = tuple(c.shape[:-2])
    if b.dim() == 2 and a.dim() > 2:
        a_dims = list(zip(a.shape[:-1], a.stride()[:-1]))
        c_dims = list(zip(c.shape[:-1], c.stride()[:-1]))
        pre_dims = list(zip(preact.shape[:-1], preact.stride()[:-1])) if preact is not None else []
        sa, sc = _merged_stride(a_dims), _merged_stride(c_dims)
        sp = _merged_stride(pre_dims) if preact is not None else 0
        if sa is not None and sc is not None and sp is not None:
            rows = math.prod(a.shape[:-1])
            return [_Launch3d(
                a=_view(a, (1, rows, K), (0, sa, a.stride(-1)), 0),
                b=_view(b, (1, K, N), (0, *b.stride()), 0),
                c=_view(c, (1, rows, N), (0, sc, c.stride(-1)), 0),
                bias=bias,
                preact=_view(preact, (1, rows, N), (0, sp, preact.stride(-1)), 0) if preact is not None else None,
            )]
    a_full = a.expand(*batch, M, K)
    b_full = b.expand(*batch, K, N)
    operands = [a_full, b_full, c] + ([preact] if preact is not None else [])
    sizes, strides = _launch.coalesce_dims(batch, [t.stride()[:-2] for t in operands])
    if not sizes:
        sizes, strides = [1], [[0] for _ in operands]
    outer, inner = sizes[:-1], sizes[-1]
    launches = []
    for index in itertools.product(*(range(s) for s in outer)):
        offsets = [sum(i * st for i, st in zip(index, op[:-1])) for op in strides]
        for start in range(0, inner, _MAX_GRID_YZ):
            count = min(_MAX_GRID_YZ, inner - start)
            views = [
                _view(t, (count, *t.shape[-2:]), (op[-1], *t.stride()[-2:]), off + start * op[-1])
                for t, op, off in zip(operands, strides, offsets)
            ]
            launches.append(_Launch3d(a=views[0], b=views[1], c=views[2], bias=bias,
                                      preact=views[3] if preact is not None else None))
    return launches


def _needs_int64(*views: torch.Tensor | None, slack: int = 512) -> bool:
    """Some offset of these views (plus a tile's worth of masked overrun) can pass 2**31."""
    for v in views:
        if v is None or v.numel() == 0:
            continue
        extent = sum((size - 1) * stride for size, stride in zip(v.shape, v.stride()))
        if extent + slack * max(v.stride()) > _launch.INT32_MAX:
            return True
    return False


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulPlan:
    """What :func:`matmul` runs for a problem: the kernel, its split and its config.

    ``config`` is None when the tiled kernel is autotuned (on a GPU): the autotuner picks it.
    """

    method: str  # "tiled" or "split_k"
    config: MatmulConfig | None
    split_k: int = 1


def wave_efficiency(programs: int, num_sms: int) -> float:
    """The share of ``ceil(programs / num_sms)`` full waves that ``programs`` equal programs keep busy."""
    if programs <= 0:
        return 0.0
    return programs / (triton.cdiv(programs, num_sms) * num_sms)


def choose_split_k(M: int, N: int, K: int, batch: int, config: MatmulConfig, num_sms: int) -> int:
    """How many ways to split K for a (batch, M, N, K) problem: 1 means "use the tiled kernel".

    Split only when the tiled grid, ``batch * ceil(M / BLOCK_M) * ceil(N / BLOCK_N)`` tiles of
    ``config``, has fewer tiles than SMs, so it would leave the GPU partly idle while each program
    walks a long K. Then:

    * M <= :data:`SPLIT_K_MAX_M` (decode-shaped, memory-bound): about two programs per SM, at least
      :data:`SPLIT_K_MIN_K_PER_SPLIT` of K per split, at most :data:`SPLIT_K_MAX` splits;
    * wider (short-M, long-K, compute-bound): the split ``s`` in ``2 .. min(SPLIT_K_MAX, K //``
      :data:`SPLIT_K_WIDE_MIN_K_PER_SPLIT` ``)`` with the best :func:`wave_efficiency` of ``tiles * s``
      programs, the smallest among equals (fewer partials), if it beats the unsplit grid's.
    """
    tiles = max(1, batch) * triton.cdiv(M, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N)
    if tiles >= num_sms:
        return 1
    if M <= SPLIT_K_MAX_M:
        if K < 2 * SPLIT_K_MIN_K_PER_SPLIT:
            return 1
        split = min(2 * num_sms // tiles, K // SPLIT_K_MIN_K_PER_SPLIT, SPLIT_K_MAX)
        return split if split >= 2 else 1
    best, best_efficiency = 1, wave_efficiency(tiles, num_sms)
    for split in range(2, min(SPLIT_K_MAX, K // SPLIT_K_WIDE_MIN_K_PER_SPLIT) + 1):
        efficiency = wave_efficiency(tiles * split, num_sms)
        if efficiency > best_efficiency:
            best, best_efficiency = split, efficiency
    return best


def plan_matmul(M: int, N: int, K: int, dtype: torch.dtype = torch.float32, batch: int = 1, *,
                num_sms: int | None = None, interpreter: bool | None = None) -> MatmulPlan:
    """The kernel and configuration :func:`matmul` uses for a (batch of) M x K @ K x N problem(s).

    Split-K for skinny problems (see :func:`choose_split_k`, with the split-K default config),
    else the tiled kernel: autotuned on a GPU (``config`` None), the fixed interpreter config
    (fitted to the problem) in the interpreter. ``num_sms`` and ``interpreter`` (None: this
    process's) ask what another machine would run, e.g. an H200 (132 SMs, compiled) from the CPU.
    """
    interpreter = runtime.INTERPRETER if interpreter is None else interpreter
    split_config = default_config(M, N, K, dtype, "split_k", interpreter=interpreter)
    split = choose_split_k(M, N, K, batch, split_config, _launch.num_sms() if num_sms is None else num_sms)
    if split > 1:
        return MatmulPlan("split_k", split_config, split)
    if interpreter:
        return MatmulPlan("tiled", default_config(M, N, K, dtype, "tiled", interpreter=True))
    return MatmulPlan("tiled", None)


@functools.cache
def _autotuned_matmul_kernel():
    """``matmul_kernel`` under ``triton.autotune`` (built once, on first use on a GPU)."""
    return make_autotuned(matmul_kernel)


# ----------------------------------------------------------------------------------------------
# Launchers (no validation: the public functions validate first)
# ----------------------------------------------------------------------------------------------


def _epilogue_args(launch: _Launch3d, activation: str):
    c = launch.c
    bias = launch.bias if launch.bias is not None else c  # a dummy pointer when HAS_BIAS is False
    preact = launch.preact if launch.preact is not None else c
    bias_stride = launch.bias.stride(0) if launch.bias is not None else 0
    constexprs = dict(HAS_BIAS=launch.bias is not None, ACTIVATION=activation, STORE_PREACT=launch.preact is not None,
                      ACCUMULATE=launch.accumulate)
    return bias, preact, bias_stride, constexprs


def _operands(launch: _Launch3d) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b, or harmless stand-ins when K == 0 (nothing is read; empty tensors may have no address)."""
    if launch.a.shape[2] == 0:
        c = launch.c
        batch, rows, cols = c.shape
        return c.as_strided((batch, rows, 0), (0, 0, 0)), c.as_strided((batch, 0, cols), (0, 0, 0))
    return launch.a, launch.b


def _run_tiled(launch: _Launch3d, config: MatmulConfig | None, activation: str) -> None:
    batch, M, N, K = launch.sizes
    a, b = _operands(launch)
    c = launch.c
    bias, preact, bias_stride, epilogue = _epilogue_args(launch, activation)
    args = (
        a, b, c, bias, preact, M, N, K, *a.stride(), *b.stride(), *c.stride(), bias_stride,
        size_bucket(M), size_bucket(N), size_bucket(K),
    )
    common = dict(INPUT_PRECISION=_launch.dot_input_precision(a.dtype), INDEX_64=_needs_int64(a, b, c, launch.preact),
                  **epilogue)
    if config is None:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), batch)
        _autotuned_matmul_kernel()[grid](*args, **common)
        return
    grid = (triton.cdiv(M, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N), batch)
    matmul_kernel[grid](*args, **config.meta, EVEN_K=K % config.BLOCK_K == 0, **common, **config.launch_options)


def _run_persistent(launch: _Launch3d, config: MatmulConfig, num_programs: int, activation: str) -> None:
    batch, M, N, K = launch.sizes
    a, b = _operands(launch)
    c = launch.c
    bias, preact, bias_stride, epilogue = _epilogue_args(launch, activation)
    tiles = batch * triton.cdiv(M, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N)
    grid = (max(1, min(num_programs, tiles)),)
    matmul_persistent_kernel[grid](
        a, b, c, bias, preact, M, N, K, batch, *a.stride(), *b.stride(), *c.stride(), bias_stride,
        **config.meta, EVEN_K=K % config.BLOCK_K == 0, INPUT_PRECISION=_launch.dot_input_precision(a.dtype),
        INDEX_64=_needs_int64(a, b, c, launch.preact), **epilogue, **config.launch_options,
    )


def _reduce_block(M: int, N: int) -> tuple[int, int]:
    """The reduce kernel's tile: up to 16 rows, 1024 elements."""
    block_m = min(16, triton.next_power_of_2(max(1, M)))
    block_n = min(1024 // block_m, max(16, triton.next_power_of_2(max(1, N))))
    return block_m, block_n


def _run_reduce(ws: torch.Tensor, launch: _Launch3d, activation: str) -> None:
    """launch.c = epilogue(ws.sum(1)) with ws a contiguous fp32 (batch, S, M, N) buffer."""
    batch, split, M, N = ws.shape
    c = launch.c
    bias, preact, bias_stride, epilogue = _epilogue_args(launch, activation)
    block_m, block_n = _reduce_block(M, N)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), batch)
    matmul_split_k_reduce_kernel[grid](
        ws if ws.numel() else c, c, bias, preact, M, N, split, *c.stride(), bias_stride,
        **epilogue, INDEX_64=_needs_int64(ws, c, launch.preact), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )


def _run_split_k(launch: _Launch3d, config: MatmulConfig, split_k: int, activation: str) -> None:
    batch, M, N, K = launch.sizes
    # Every split gets a whole number of BLOCK_K slices; drop splits that would get none.
    k_per_split = triton.cdiv(triton.cdiv(max(K, 1), split_k), config.BLOCK_K) * config.BLOCK_K
    split_k = max(1, triton.cdiv(K, k_per_split))
    # K == 0: no partials at all; the reduction then writes epilogue(0).
    ws = _launch.empty((batch, split_k if K > 0 else 0, M, N), torch.float32, launch.c.device)
    if K > 0:
        a, b = launch.a, launch.b
        grid = (triton.cdiv(M, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N), split_k, batch)
        matmul_split_k_kernel[grid](
            a, b, ws, M, N, K, k_per_split, *a.stride(), *b.stride(),
            **config.meta, EVEN_K=K % config.BLOCK_K == 0, INPUT_PRECISION=_launch.dot_input_precision(a.dtype),
            INDEX_64=_needs_int64(a, b, ws), **config.launch_options,
        )
    _run_reduce(ws, launch, activation)


def launch_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    method: str = "auto",
    config: MatmulConfig | None = None,
    split_k: int = 1,
    num_programs: int | None = None,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    preact: torch.Tensor | None = None,
    accumulate: bool = False,
) -> None:
    """Write ``epilogue(a @ b)`` into ``c`` (shapes already checked; c of the broadcast shape).

    ``method``: ``"auto"`` (the dispatch rule), ``"tiled"``, ``"split_k"`` or ``"persistent"``;
    ``config`` None means the default for the method (autotuned for tiled on a GPU).
    ``accumulate``: ``c += a @ b`` (then never autotuned: the tuner's repeated runs would add again).
    """
    if c.numel() == 0:
        return
    for launch in _plan_launches(a, b, c, bias, preact):
        if accumulate:
            launch = dataclasses.replace(launch, accumulate=True)
        batch, M, N, K = launch.sizes
        kind, cfg, split = method, config, split_k
        if kind == "auto":
            plan = plan_matmul(M, N, K, a.dtype, batch)
            kind, cfg, split = plan.method, plan.config, plan.split_k
        if kind == "tiled":
            _run_tiled(launch, cfg if cfg is not None or not (runtime.INTERPRETER or accumulate)
                       else default_config(M, N, K, a.dtype, "tiled"), activation)
        elif kind == "split_k":
            _run_split_k(launch, cfg or default_config(M, N, K, a.dtype, "split_k"), split, activation)
        elif kind == "persistent":
            programs = num_programs if num_programs is not None else _launch.num_sms()
            _run_persistent(launch, cfg or default_config(M, N, K, a.dtype, "persistent"), programs, activation)
        else:
            raise AssertionError(kind)


def reduced_product(x: torch.Tensor, y: torch.Tensor, out_shape: Sequence[int]) -> torch.Tensor:
    """``x @ y`` summed over the batch dims that ``out_shape`` does not have (or has as 1).

    The gradient of a broadcast operand. Three ways, cheapest first: no dim reduced (a plain
    launch); every batch dim reduced and the batch dims chain into K for both operands (one GEMM
    with K' = batch * K, e.g. ``dW = X^T @ G`` over a contiguous (batch, seq, features)
    activation); else fp32 products per batch entry into a workspace laid out reduced-dims-first,
    summed in order by the split-K reduction kernel.
    """
    out_shape = tuple(out_shape)
    out = _launch.empty_output(out_shape, x)
    if out.numel() == 0:
        return out
    batch = tuple(torch.broadcast_shapes(x.shape[:-2], y.shape[:-2]))
    R, Kb, C = x.shape[-2], x.shape[-1], y.shape[-1]
    target = (1,) * (len(batch) - len(out_shape[:-2])) + out_shape[:-2]
    reduced = [d for d in range(len(batch)) if target[d] == 1 and batch[d] != 1]
    if not reduced:
        launch_matmul(x, y, out.view(*batch, R, C))
        return out
    x_full, y_full = x.expand(*batch, R, Kb), y.expand(*batch, Kb, C)
    if len(reduced) == len([d for d in batch if d != 1]):
        sx = _merged_stride([*zip(batch, x_full.stride()[:-2]), (Kb, x_full.stride(-1))])
        sy = _merged_stride([*zip(batch, y_full.stride()[:-2]), (Kb, y_full.stride(-2))])
        if sx is not None and sy is not None:
            depth = math.prod(batch) * Kb
            launch_matmul(_view(x_full, (R, depth), (x_full.stride(-2), sx), 0),
                    _view(y_full, (depth, C), (sy, y_full.stride(-1)), 0), out.view(R, C))
            return out
    kept = [d for d in range(len(batch)) if d not in reduced]
    order = reduced + kept
    workspace = _launch.empty([batch[d] for d in order] + [R, C], torch.float32, out.device)
    inverse = [order.index(d) for d in range(len(batch))] + [len(batch), len(batch) + 1]
    split = math.prod(batch[d] for d in reduced)
    if split == 0:
        return out.zero_()
    launch_matmul(x, y, workspace.permute(*inverse))
    rows = math.prod(batch[d] for d in kept) * R
    target_view = out.view(1, rows, C)
    _run_reduce(workspace.view(1, split, rows, C), _Launch3d(a=target_view, b=target_view, c=target_view,
                                                              bias=None, preact=None), "none")
    return out


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _check_operands(op: str, a: object, b: object, min_dim: int = 1) -> None:
    check_tensor(op, "a", a)
    check_tensor(op, "b", b)
    check_float_dtype(op, "a", a)
    check_float_dtype(op, "b", b)
    check_same_dtype(op, "a", a, "b", b)
    check_same_device(op, "a", a, "b", b)
    for name, t in (("a", a), ("b", b)):
        if t.dim() < min_dim:
            need = "at least 1-D (a vector or a matrix)" if min_dim == 1 else "at least 2-D (a matrix or a batch)"
            raise ValueError(f"{op}: {name} must be {need}, got a {t.dim()}-D tensor of shape {tuple(t.shape)}")


def _product_shape(op: str, a: torch.Tensor, b: torch.Tensor, a_shape=None, b_shape=None) -> tuple[int, ...]:
    """The broadcast result shape of (>= 2-D) a @ b; errors name both shapes and the dims."""
    a_shape = tuple(a.shape) if a_shape is None else a_shape
    b_shape = tuple(b.shape) if b_shape is None else b_shape
    if a.shape[-1] != b.shape[-2]:
        b_dim = "dim 0" if len(b_shape) == 1 else "dim -2 (second to last)"
        raise ValueError(
            f"{op}: a's last dim ({a.shape[-1]}) must equal b's {b_dim} ({b.shape[-2]}), the shared K dimension; "
            f"got a of shape {a_shape} and b of shape {b_shape}"
        )
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"{op}: the batch dims of a {tuple(a.shape[:-2])} and b {tuple(b.shape[:-2])} must broadcast "
            f"(torch.matmul's rule); got a of shape {a_shape} and b of shape {b_shape}"
        ) from None
    return (*batch, a.shape[-2], b.shape[-1])


def _check_config(op: str, config: object) -> None:
    if config is not None and not isinstance(config, MatmulConfig):
        raise TypeError(f"{op}: config must be a kernel_ladder.MatmulConfig or None, got {type(config).__name__}")


def _positive_int(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{op}: {name} must be an int >= 1, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# The custom op, its fake and its autograd
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kernel_ladder::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_operands("kernel_ladder.matmul", a, b, min_dim=2)
    shape = _product_shape("kernel_ladder.matmul", a, b)
    runtime.require_launchable("kernel_ladder.matmul", a, b)
    out = _launch.empty_output(shape, a)
    launch_matmul(a, b, out)
    return out


@_matmul_op.register_fake
def _matmul_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_operands("kernel_ladder.matmul", a, b, min_dim=2)
    return _launch.empty_output(_product_shape("kernel_ladder.matmul", a, b), a)


@torch.library.custom_op("kernel_ladder::matmul_backward", mutates_args=())
def _matmul_backward_op(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, need_a: bool, need_b: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.matmul (backward)"
    _check_operands(op, a, b, min_dim=2)
    check_same_device(op, "grad_out", grad_out, "a", a)
    runtime.require_launchable(op, grad_out, a, b)
    grad_out = grad_out.to(a.dtype)
    # dA = G @ B^T and dB = A^T @ G: the same kernels, the transposes are stride swaps.
    grad_a = reduced_product(grad_out, b.mT, a.shape) if need_a else a.new_empty(0)
    grad_b = reduced_product(a.mT, grad_out, b.shape) if need_b else b.new_empty(0)
    return grad_a, grad_b


@_matmul_backward_op.register_fake
def _matmul_backward_fake(grad_out, a, b, need_a: bool, need_b: bool):
    grad_a = _launch.empty_output(a.shape, a) if need_a else a.new_empty(0)
    grad_b = _launch.empty_output(b.shape, b) if need_b else b.new_empty(0)
    return grad_a, grad_b


def _matmul_setup_context(ctx, inputs, output) -> None:
    a, b = inputs
    ctx.save_for_backward(a, b)


def _matmul_backward(ctx, grad_out: torch.Tensor):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_a, grad_b = _matmul_backward_op(grad_out, a, b, need_a, need_b)
    return (grad_a if need_a else None), (grad_b if need_b else None)


_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _as_matrices(op: str, a: torch.Tensor, b: torch.Tensor):
    """torch.matmul's 1-D rules as views: (K,) @ ... is (1, K) @ ..., ... @ (K,) is ... @ (K, 1)."""
    _check_operands(op, a, b, min_dim=1)
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    _product_shape(op, a2, b2, tuple(a.shape), tuple(b.shape))
    return a2, b2


def _squeeze_vectors(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.dim() == 1:
        out = out.squeeze(-1)
    if a.dim() == 1:
        out = out.squeeze(-2 if b.dim() > 1 else -1)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` like ``torch.matmul``: matrices, batches (broadcast) and vectors.

    Args:
        a: float32, float16 or bfloat16 tensor, (..., M, K) or (K,); any strides (not copied).
        b: same dtype and device, (..., K, N) or (K,). Batch dims broadcast like torch.matmul.

    Returns:
        A new contiguous tensor of shape (broadcast batch..., M, N) (vector dims removed as
        torch.matmul does), accumulated in float32 (TF32 for fp32 on a GPU when
        ``torch.backends.cuda.matmul.allow_tf32`` is set). Differentiable (``kernel_ladder::matmul``,
        backward ``kernel_ladder::matmul_backward``). Skinny problems run split-K, others the tiled
        kernel (autotuned on a GPU); see :func:`plan_matmul`.
    """
    a2, b2 = _as_matrices("kernel_ladder.matmul", a, b)
    return _squeeze_vectors(_matmul_op(a2, b2), a, b)


def _launcher(op: str, a: object, b: object, config: object) -> tuple[torch.Tensor, tuple[int, ...]]:
    _check_operands(op, a, b, min_dim=2)
    shape = _product_shape(op, a, b)
    _check_config(op, config)
    runtime.require_launchable(op, a, b)
    return _launch.empty_output(shape, a), shape


def matmul_tiled(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """``a @ b`` with ``matmul_kernel`` (one program per output tile, grouped order).

    Args:
        a: (..., M, K) float32/float16/bfloat16, any strides.
        b: (..., K, N), same dtype and device; batch dims broadcast.
        config: the tiles, ``GROUP_M`` and launch options; None for the default (autotuned on a
            GPU, the fixed interpreter config on a CPU).

    Returns:
        A new contiguous (batch..., M, N) tensor. Not differentiable (use :func:`matmul`).
    """
    out, _ = _launcher("kernel_ladder.matmul_tiled", a, b, config)
    launch_matmul(a, b, out, method="tiled", config=config)
    return out


def matmul_split_k(
    a: torch.Tensor, b: torch.Tensor, split_k: int, config: MatmulConfig | None = None
) -> torch.Tensor:
    """``a @ b`` with ``matmul_split_k_kernel``: K split ``split_k`` ways, partials summed in a fixed order.

    Args:
        a, b: as for :func:`matmul_tiled`.
        split_k: how many K ranges (>= 1); each is a whole number of BLOCK_K slices, so fewer
            splits run when K is short (a K of 100 with BLOCK_K 32 has at most 4).
        config: tiles and launch options, or None for the split-K default.

    Returns:
        A new contiguous (batch..., M, N) tensor. The fp32 workspace holds split_k * M * N floats.
    """
    split_k = _positive_int("kernel_ladder.matmul_split_k", "split_k", split_k)
    out, _ = _launcher("kernel_ladder.matmul_split_k", a, b, config)
    launch_matmul(a, b, out, method="split_k", config=config, split_k=split_k)
    return out


def matmul_persistent(
    a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None, num_programs: int | None = None
) -> torch.Tensor:
    """``a @ b`` with ``matmul_persistent_kernel``: a fixed grid of programs, each looping over tiles.

    Args:
        a, b: as for :func:`matmul_tiled`.
        config: tiles and launch options, or None for the persistent default.
        num_programs: programs to launch (at most one per tile); None for the GPU's SM count
            (:data:`kernel_ladder._launch.INTERPRETER_SMS` in the interpreter).

    Returns:
        A new contiguous (batch..., M, N) tensor.
    """
    if num_programs is not None:
        num_programs = _positive_int("kernel_ladder.matmul_persistent", "num_programs", num_programs)
    out, _ = _launcher("kernel_ladder.matmul_persistent", a, b, config)
    launch_matmul(a, b, out, method="persistent", config=config, num_programs=num_programs)
    return out
