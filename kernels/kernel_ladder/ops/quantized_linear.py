"""Linear layers with quantized weights, as ``kernel_ladder::quantized_linear``: weight-only and W8A8.

``quantized_linear(x, qweight, bias)`` computes ``F.linear(x, qweight.dequantize(), bias)``
without ever writing the dequantized weight anywhere: each program loads the packed weight tile
it needs for one K step, turns it into numbers in registers, and feeds it to ``tl.dot``. The
weight is read once per ``BLOCK_M`` rows of x — for decode shapes (M <= BLOCK_M) the weight
traffic is exactly ``qweight.nbytes`` (the tests count it), which is the whole point: a decode
step is memory-bound, and int8 moves half the bytes of bf16, int4 a quarter.

**Weight-only** (``activations=None``, every scheme; ``quantized_linear_kernel``): x stays in
its dtype (fp32/fp16/bf16) and the weight values are converted to it in registers — exactly,
since int8, int4 and e4m3 values are all representable in fp16 and bf16 — so ``tl.dot`` runs on
fp16/bf16 tensor cores with an fp32 accumulator (fp32 x: TF32 when
``torch.backends.cuda.matmul.allow_tf32`` is set, else IEEE fp32). The scales never touch the
weight tile:

* int8 / fp8 scale per output channel, so ``sum_k x[m,k] q[n,k] s[n] = s[n] sum_k x[m,k] q[n,k]``:
  the scale multiplies the accumulator once, in the epilogue.
* int4 scales per (channel, K-group): each K step covers at most one group (``BLOCK_K <=
  group_size``), so the step's partial product is scaled by that group's ``(BLOCK_N,)`` scale row
  before it joins the accumulator. The packed bytes hold k = 2j in the low nibble and k = 2j + 1
  in the high one, so the kernel splits its (contiguously loaded) x tile into even and odd
  columns (``tl.reshape`` + ``tl.split``) and runs two half-K dots, ``x_even @ low + x_odd @
  high``: the nibbles are never interleaved back into K order.
* fp8 (e4m3) is dequantized to x's dtype in registers rather than fed to an fp8 ``tl.dot``: an
  fp8 x fp8 dot would need x quantized to fp8 as well (a different accuracy trade-off), while
  the weight-only path keeps x exact and still halves the weight bytes. On a GPU the e4m3 ->
  fp16/bf16 conversion is a hardware ``cvt`` (sm_89+, compiled for sm_90 in the tests).

**W8A8** (``activations="int8"``, int8 weights; ``w8a8_linear_kernel``): x is quantized per
token (per row) at run time by ``kernel_ladder.quantize.quantize_rows_kernel`` — ``s_x[m] = max_k
|x[m,k]| / 127`` — then ``tl.dot`` multiplies int8 by int8 and accumulates in **int32** (exact),
and the epilogue rescales by ``s_x[m] * s_w[n]``. Cost: one extra pass over x (small for decode)
for int8 tensor cores' twice-fp16 throughput at large M.

**Group sizes** (int4): a power of two from 32 to 4096 (``kernel_ladder.quantize.INT4_GROUP_SIZES``),
any K (K need not be a multiple of the group size or of the tile). ``BLOCK_K =
min(group_size, 256)`` (halves of >= 16 for ``tl.dot``); above 256 a group's scales are re-read
once per K step of the group (from cache on a GPU). int8 and fp8: any K.

**Split-K** for decode: with M <= 16 the output has few tiles (N / BLOCK_N), too few programs
to keep a GPU's memory system busy, so the K range is split ``SPLIT_K`` ways
(:func:`choose_config`); each split writes an fp32 partial tile to a ``(SPLIT_K, M, N)``
workspace and ``quantized_linear_reduce_kernel`` sums them in a fixed order (deterministic) and
adds the bias. In W8A8 each split's int32 sum is exact; splits are summed in fp32.

**Autograd** (x and bias; the quantized weight is frozen): ``grad_x = grad_out @ dequant(W)`` is the
transposed problem — a reduction over N — computed by ``quantized_linear_backward_kernel``, which
dequantizes in its loop the same way: the scale of ``w[n, k]`` depends on n (int4: and on k's
group, one group per K tile), so it multiplies the small ``grad_out`` tile (BLOCK_M x BLOCK_N)
instead of the weight tile, and the packed int4 nibbles produce the even and odd columns of
``grad_x`` (joined in registers before the store). ``grad_bias = grad_out`` summed over rows.
W8A8's gradient treats the per-token rounding of x as the identity (the straight-through
estimator), i.e. it is the weight-only gradient. The weight itself gets no gradient.

Shapes: x ``(..., K)`` with any leading dims and strides (not copied; leading dims that do not
merge are walked with ``row_start``), output ``(..., N)`` contiguous in x's dtype. M (the
product of x's leading dims) may be anything from 0 up; K may be 0 (the output is the bias).
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._rows import plan_rows, row_start
from .._validate import FLOAT_DTYPES, check_choice, check_float_dtype, check_tensor
from .quantize import (
    INT4_GROUP_SIZES,
    SCHEMES,
    STORAGE_DTYPES,
    QuantizedWeight,
    launch_quantize_rows,
    quantize_weight,
)

__all__ = [
    "ACTIVATION_SCHEMES",
    "QuantizedLinearConfig",
    "choose_config",
    "quantized_linear",
    "quantization_error",
    "quantized_linear_kernel",
    "w8a8_linear_kernel",
    "quantized_linear_reduce_kernel",
    "quantized_linear_backward_kernel",
]

#: Values of ``activations``: ``None`` (weight-only) or ``"int8"`` (W8A8, int8 weights only).
ACTIVATION_SCHEMES: tuple[str | None, ...] = (None, "int8")

_SCHEME_IDS = {"int8": 0, "int4": 1, "fp8": 2}
_INT4 = tl.constexpr(1)
_REDUCE_BLOCK = 1024


@triton.jit
def _write_tile(acc, rm, rn, M, N, pid_k, bias_ptr, stride_bias, out_ptr, partial_ptr,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """The epilogue: bias and the one store to the (M, N) output, or an fp32 split-K partial."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    rows = rm.to(tl.int64)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn * stride_bias, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + (pid_k.to(tl.int64) * M + rows)[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit
def quantized_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr,
    M, K, size1, size2, stride_x0, stride_x1, stride_x2, stride_xk,
    N, w_cols, stride_wn, stride_wk, stride_sn, stride_sg, stride_bias, k_blocks_per_split,
    SCHEME: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * dequant(w)[n, k] (+ bias[n]) for one BLOCK_M x BLOCK_N tile
    and one split of K, dequantizing each weight tile in registers (SCHEME 0 int8, 1 int4, 2 fp8).

    x: (M, K) rows through ``row_start`` (leading dims) and ``stride_xk``; w: (N, w_cols) values
    (w_cols = K) or packed bytes (w_cols = ceil(K/2)), strides ``stride_wn, stride_wk``; scales
    (N,) or (N, groups). ``w_cols`` is its own argument so that Triton sees its divisibility by 16
    and vectorizes the weight loads (``(K + 1) // 2`` computed in the kernel would hide it).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    x_row = row_start(rm, size1, size2, stride_x0, stride_x1, stride_x2)
    w_row = rn.to(tl.int64) * stride_wn
    scale_row = rn.to(tl.int64) * stride_sn
    dot_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb_start = pid_k * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    for kb in range(kb_start, kb_end):
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        if INDEX_64:
            rk = rk.to(tl.int64)
        xk = tl.load(x_ptr + x_row[:, None] + rk[None, :] * stride_xk,
                     mask=m_mask[:, None] & (rk < K)[None, :], other=0.0)
        if SCHEME == _INT4:
            # x's even and odd columns (k = 2j, 2j + 1) meet the low and high nibbles of byte j.
            xe, xo = tl.split(tl.reshape(xk, (BLOCK_M, BLOCK_K // 2, 2)))
            j = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + w_row[None, :] + j[:, None] * stride_wk,
                             mask=(j < w_cols)[:, None] & n_mask[None, :], other=0x88)
            low = ((packed & 0xF).to(tl.int8) - 8).to(dot_dtype)  # exact: integers in [-8, 7]
            high = ((packed >> 4).to(tl.int8) - 8).to(dot_dtype)
            part = tl.dot(xe, low, input_precision=INPUT_PRECISION)
            part = tl.dot(xo, high, part, input_precision=INPUT_PRECISION)
            group = (kb * BLOCK_K) // GROUP_SIZE  # BLOCK_K <= GROUP_SIZE: one group per step
            s = tl.load(scale_ptr + scale_row + group * stride_sg, mask=n_mask, other=0.0)
            acc += part * s.to(tl.float32)[None, :]
        else:
            w = tl.load(w_ptr + w_row[None, :] + rk[:, None] * stride_wk,
                        mask=(rk < w_cols)[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(xk, w.to(dot_dtype), acc, input_precision=INPUT_PRECISION)  # exact conversion
    if SCHEME != _INT4:  # one scale per output channel: factor it out of the K sum
        s = tl.load(scale_ptr + scale_row, mask=n_mask, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    _write_tile(acc, rm, rn, M, N, pid_k, bias_ptr, stride_bias, out_ptr, partial_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def w8a8_linear_kernel(
    xq_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr,
    M, K, N, stride_xqm, stride_wn, stride_wk, stride_wscale, stride_bias, k_blocks_per_split,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = s_x[m] * s_w[n] * sum_k xq[m, k] * wq[n, k] (+ bias[n]): int8 x int8 ``tl.dot``
    with an int32 accumulator (exact), rescaled once in the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    x_row = rm.to(tl.int64) * stride_xqm
    w_row = rn.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    kb_start = pid_k * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    for kb in range(kb_start, kb_end):
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(xq_ptr + x_row[:, None] + rk[None, :], mask=m_mask[:, None] & (rk < K)[None, :], other=0)
        b = tl.load(w_ptr + w_row[None, :] + rk[:, None] * stride_wk, mask=(rk < K)[:, None] & n_mask[None, :],
                    other=0)
        acc = tl.dot(a, b, acc)  # int8 x int8 -> int32
    x_scale = tl.load(x_scale_ptr + rm, mask=m_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn.to(tl.int64) * stride_wscale, mask=n_mask, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    _write_tile(out, rm, rn, M, N, pid_k, bias_ptr, stride_bias, out_ptr, partial_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def quantized_linear_reduce_kernel(
    partial_ptr, bias_ptr, out_ptr, n_elements, N, stride_bias,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """out = sum over the SPLIT_K fp32 partials (in split order: deterministic) + bias."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n_elements
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * n_elements + idx, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + (idx % N) * stride_bias, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantized_linear_backward_kernel(
    grad_ptr, w_ptr, scale_ptr, grad_x_ptr,
    M, N, size1, size2, stride_g0, stride_g1, stride_g2, stride_gn,
    K, w_cols, stride_wn, stride_wk, stride_sn, stride_sg,
    SCHEME: tl.constexpr, GROUP_SIZE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """grad_x[m, k] = sum_n grad[m, n] * dequant(w)[n, k] for one BLOCK_M x BLOCK_K tile of grad_x.

    The reduction runs over N, so a weight scale (per n; int4: per n and k's group, one group per
    tile since BLOCK_K <= GROUP_SIZE) multiplies the grad tile, rounded to grad's dtype for the
    dot. int4 tiles accumulate even and odd columns separately (low and high nibbles) and join
    them before the store. grad: rows through ``row_start`` and ``stride_gn``; grad_x: (M, K)
    contiguous.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    g_row = row_start(rm, size1, size2, stride_g0, stride_g1, stride_g2)
    dot_dtype = grad_ptr.dtype.element_ty
    if SCHEME == _INT4:
        j = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        acc_even = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.float32)
        acc_odd = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.float32)
        scale_col = ((pid_k * BLOCK_K) // GROUP_SIZE) * stride_sg
    else:
        rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        scale_col = 0
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        g = tl.load(grad_ptr + g_row[:, None] + rn[None, :] * stride_gn, mask=m_mask[:, None] & n_mask[None, :],
                    other=0.0)
        s = tl.load(scale_ptr + rn.to(tl.int64) * stride_sn + scale_col, mask=n_mask, other=0.0)
        g = (g.to(tl.float32) * s.to(tl.float32)[None, :]).to(dot_dtype)
        w_row = rn.to(tl.int64) * stride_wn
        if SCHEME == _INT4:
            packed = tl.load(w_ptr + w_row[:, None] + j[None, :] * stride_wk,
                             mask=n_mask[:, None] & (j < w_cols)[None, :], other=0x88)
            low = ((packed & 0xF).to(tl.int8) - 8).to(dot_dtype)
            high = ((packed >> 4).to(tl.int8) - 8).to(dot_dtype)
            acc_even = tl.dot(g, low, acc_even, input_precision=INPUT_PRECISION)
            acc_odd = tl.dot(g, high, acc_odd, input_precision=INPUT_PRECISION)
        else:
            w = tl.load(w_ptr + w_row[:, None] + rk[None, :] * stride_wk,
                        mask=n_mask[:, None] & (rk < w_cols)[None, :], other=0.0)
            acc = tl.dot(g, w.to(dot_dtype), acc, input_precision=INPUT_PRECISION)
    if SCHEME == _INT4:
        acc = tl.reshape(tl.join(acc_even, acc_odd), (BLOCK_M, BLOCK_K))  # column 2j + t
        rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    out = grad_x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(out, acc.to(grad_x_ptr.dtype.element_ty), mask=m_mask[:, None] & (rk < K)[None, :])


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class QuantizedLinearConfig:
    """Tile shape and launch options of the quantized linear kernels.

    ``BLOCK_M x BLOCK_N`` outputs per program, ``BLOCK_K`` of the reduction per step (powers of
    two; ``BLOCK_M``, ``BLOCK_N`` >= 16, ``BLOCK_K`` >= 32; int4 needs ``BLOCK_K <= group_size``),
    ``SPLIT_K`` splits of the K range (1: none), and Triton's ``num_warps`` / ``num_stages``.
    """

    BLOCK_M: int = 16
    BLOCK_N: int = 64
    BLOCK_K: int = 128
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


def choose_config(M: int, N: int, K: int, scheme: str, group_size: int | None = None,
                  activations: str | None = None, device: torch.device | str | None = None) -> QuantizedLinearConfig:
    """The launch configuration ``quantized_linear`` uses for an (M, K) x (K, N) problem.

    Interpreter: big blocks and no split (few program instances; there is nothing to overlap).

    GPU, decode (M <= 16): the problem is a stream of weight bytes, so the tile is shaped for
    bandwidth, not FLOPs: 16 rows (``tl.dot``'s minimum; the rows past M are masked, free for a
    memory-bound kernel), 64 output channels, wide K steps (256 values; int4 one group, up to 256)
    and 4 pipeline stages (``cp.async`` keeps several K steps of weights in flight). N / 64 tiles
    are too few to occupy every SM's memory pipeline, so K is split until there are about two
    programs per SM (a power of two of splits) — each split keeping >= 4 K steps, and the fp32
    partials (written and read once, ``2 * SPLIT_K * M * N * 4`` bytes, mostly absorbed by L2) at
    most a quarter of the weight's bytes. Larger M: bigger tiles, and a split only while the tile
    grid is smaller than the GPU. These are starting points from this memory-bound analysis, not
    measured tunings; pass ``config=`` to override.
    """
    device = torch.device(device) if device is not None else runtime.DEVICE
    k_cap = min(group_size, 256) if scheme == "int4" else 256
    fit_k = max(32, min(k_cap, triton.next_power_of_2(max(K, 1))))
    if runtime.INTERPRETER:
        return QuantizedLinearConfig(
            BLOCK_M=max(16, min(64, triton.next_power_of_2(max(M, 1)))),
            BLOCK_N=max(16, min(128, triton.next_power_of_2(max(N, 1)))),
            BLOCK_K=fit_k, SPLIT_K=1, num_warps=4, num_stages=1,
        )
    if M <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, fit_k, 4, 4
    elif M <= 64:
        block_m, block_n, block_k, warps, stages = triton.next_power_of_2(M), 128, min(fit_k, 128), 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, min(fit_k, 64 if activations is None else 128), 8, 3
    block_n = max(16, min(block_n, triton.next_power_of_2(max(N, 1))))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(max(K, 1), block_k)
    target = 2 * _launch.num_sms(device)
    split = 1
    if tiles < target:
        weight_bytes = N * K * (0.5 if scheme == "int4" else 1.0)
        partial_cap = int(weight_bytes / 4 // (2 * 4 * max(M, 1) * N)) if N else 1
        split = max(1, min(triton.cdiv(target, tiles), k_blocks // 4, partial_cap, 16))
        split = 1 << (split.bit_length() - 1)  # a power of two: even splits of a power-of-two K
        split = triton.cdiv(k_blocks, triton.cdiv(k_blocks, split))  # no empty splits
    return QuantizedLinearConfig(block_m, block_n, block_k, split, warps, stages)


def _check_config(op: str, config: QuantizedLinearConfig, scheme: str, group_size: int) -> None:
    def power_of_2(v: int) -> bool:
        return isinstance(v, int) and v > 0 and v & (v - 1) == 0

    problems = []
    if not (power_of_2(config.BLOCK_M) and config.BLOCK_M >= 16):
        problems.append(f"BLOCK_M={config.BLOCK_M} (a power of two >= 16)")
    if not (power_of_2(config.BLOCK_N) and config.BLOCK_N >= 16):
        problems.append(f"BLOCK_N={config.BLOCK_N} (a power of two >= 16)")
    if not (power_of_2(config.BLOCK_K) and config.BLOCK_K >= 32):
        problems.append(f"BLOCK_K={config.BLOCK_K} (a power of two >= 32)")
    elif scheme == "int4" and config.BLOCK_K > group_size:
        problems.append(f"BLOCK_K={config.BLOCK_K} (int4 needs BLOCK_K <= group_size = {group_size})")
    if not (isinstance(config.SPLIT_K, int) and 1 <= config.SPLIT_K <= 64):
        problems.append(f"SPLIT_K={config.SPLIT_K} (an int from 1 to 64)")
    if not (power_of_2(config.num_warps) and config.num_warps <= 16):
        problems.append(f"num_warps={config.num_warps} (1, 2, 4, 8 or 16)")
    if not (isinstance(config.num_stages, int) and config.num_stages >= 1):
        problems.append(f"num_stages={config.num_stages} (an int >= 1)")
    if problems:
        raise ValueError(f"{op}: config has unsupported values: {', '.join(problems)}")


# --------------------------------------------------------------------------- launch


def _reduce_partials(partial: torch.Tensor, bias: torch.Tensor | None, out2d: torch.Tensor, split: int) -> None:
    n_elements, n = out2d.numel(), out2d.shape[1]
    quantized_linear_reduce_kernel[(triton.cdiv(n_elements, _REDUCE_BLOCK),)](
        partial, bias if bias is not None else out2d, out2d, n_elements, n, bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=_REDUCE_BLOCK, num_warps=4,
    )


def _split(K: int, rows: int, N: int, config: QuantizedLinearConfig) -> tuple[int, int]:
    """(K steps per split, splits) for a launch: no empty splits, and a workspace whose offsets
    stay below 2**31 (the reduction indexes it in int32 per split)."""
    k_blocks = triton.cdiv(K, config.BLOCK_K)
    per_split = max(1, triton.cdiv(k_blocks, config.SPLIT_K))
    split = max(1, triton.cdiv(k_blocks, per_split))
    if split > 1 and split * rows * N >= 2**31:
        return max(1, k_blocks), 1
    return per_split, split


def _launch_weight_only(x, data, scales, bias, scheme, group_size, K, out2d, config) -> None:
    N = data.shape[0]
    M_total = out2d.shape[0]
    if K > 0:
        launches = [(launch.tensors[0], launch.row_base, launch.n_rows, launch.args()[2:], launch.index_64)
                    for launch in plan_rows([x], reduce_ndim=1)]
    else:  # nothing to read from x: one launch that writes the bias (or zeros)
        launches = [(x, 0, M_total, (1, 1, 0, 0, 0, 1), False)]
    scale_group_stride = scales.stride(1) if scales.dim() == 2 else 0
    for x_slice, row_base, rows, row_args, index_64 in launches:
        per_split, split = _split(K, rows, N, config)
        out_slice = out2d[row_base: row_base + rows]
        partial = _launch.empty((split, rows, N), torch.float32, x.device) if split > 1 else out_slice
        grid = (triton.cdiv(rows, config.BLOCK_M), triton.cdiv(N, config.BLOCK_N), split)
        quantized_linear_kernel[grid](
            x_slice, data, scales, bias if bias is not None else out_slice, out_slice, partial,
            rows, K, *row_args,
            N, data.shape[1], data.stride(0), data.stride(1), scales.stride(0), scale_group_stride,
            bias.stride(0) if bias is not None else 0, per_split,
            SCHEME=_SCHEME_IDS[scheme], GROUP_SIZE=group_size or 1, HAS_BIAS=bias is not None, SPLIT_K=split,
            INPUT_PRECISION=_launch.dot_input_precision(x.dtype), INDEX_64=index_64,
            BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if split > 1:
            _reduce_partials(partial, bias, out_slice, split)


def _launch_w8a8(x, data, scales, bias, K, out2d, config) -> None:
    N, M = data.shape[0], out2d.shape[0]
    xq = _launch.empty(x.shape, torch.int8, x.device)
    x_scales = _launch.empty(x.shape[:-1], torch.float32, x.device)
    launch_quantize_rows(x, xq, x_scales, fp8=False)
    xq2d = xq.view(M, K)
    per_split, split = _split(K, M, N, config)
    partial = _launch.empty((split, M, N), torch.float32, x.device) if split > 1 else out2d
    grid = (triton.cdiv(M, config.BLOCK_M), triton.cdiv(N, config.BLOCK_N), split)
    w8a8_linear_kernel[grid](
        xq2d, x_scales, data, scales, bias if bias is not None else out2d, out2d, partial,
        M, K, N, max(K, 1), data.stride(0), data.stride(1), scales.stride(0),
        bias.stride(0) if bias is not None else 0, per_split,
        HAS_BIAS=bias is not None, SPLIT_K=split,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        _reduce_partials(partial, bias, out2d, split)


# --------------------------------------------------------------------------- validation


def _check_quantized_linear_args(op: str, x: object, data: object, scales: object, bias: object, scheme: object,
                       group_size: object, in_features: object, activations: object) -> None:
    check_tensor(op, "x", x)
    check_float_dtype(op, "x", x)
    check_choice(op, "scheme", scheme, SCHEMES)
    check_choice(op, "activations", activations, ("none", "int8"))
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have shape (..., in_features), got a 0-d tensor")
    if x.shape[-1] != in_features:
        raise ValueError(
            f"{op}: x's last dim must equal qweight's in_features ({in_features}), got x of shape {tuple(x.shape)}"
        )
    n = _check_qweight_parts(op, data, scales, scheme, group_size, in_features, x.device, "x")
    if bias is not None:
        check_tensor(op, "bias", bias)
        if bias.dtype != x.dtype:
            raise TypeError(
                f"{op}: bias must have x's dtype ({x.dtype}), got {bias.dtype} (cast it with .to({x.dtype}))"
            )
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{op}: bias must have shape ({n},) (out_features), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"{op}: x and bias must be on the same device, got {x.device} and {bias.device}")
    if activations == "int8" and scheme != "int8":
        raise ValueError(
            f"{op}: activations='int8' (W8A8: int8 x int8 dot) needs an 'int8' qweight, got scheme '{scheme}'; "
            "use activations=None (weight-only) for 'int4' and 'fp8'"
        )


def _check_qweight_parts(op: str, data: object, scales: object, scheme: str, group_size: object,
                         in_features: object, device: torch.device, against: str) -> int:
    """The packed values and scales must fit the scheme and shape; returns out_features."""
    if scheme == "int4":
        if group_size not in INT4_GROUP_SIZES:
            supported = ", ".join(str(g) for g in INT4_GROUP_SIZES)
            raise ValueError(f"{op}: group_size for scheme 'int4' must be one of {supported}, got {group_size}")
    elif group_size != 0:
        raise ValueError(f"{op}: group_size must be 0 (per output channel) for scheme '{scheme}', got {group_size}")
    check_tensor(op, "qweight data", data)
    check_tensor(op, "qweight scales", scales)
    k = int(in_features)
    n = data.shape[0] if data.dim() == 2 else -1
    expected_data = (n, (k + 1) // 2) if scheme == "int4" else (n, k)
    if data.dtype != STORAGE_DTYPES[scheme] or data.dim() != 2 or tuple(data.shape) != expected_data:
        raise ValueError(
            f"{op}: qweight data for scheme '{scheme}' must be {STORAGE_DTYPES[scheme]} of shape "
            f"(out_features, {expected_data[1]}), got {data.dtype} of shape {tuple(data.shape)}"
        )
    expected_scales = (n, math.ceil(k / group_size)) if scheme == "int4" else (n,)
    if scales.dtype not in FLOAT_DTYPES or tuple(scales.shape) != expected_scales:
        raise ValueError(
            f"{op}: qweight scales for scheme '{scheme}' must be float32/float16/bfloat16 of shape "
            f"{expected_scales}, got {scales.dtype} of shape {tuple(scales.shape)}"
        )
    for name, t in (("qweight", data), ("qweight scales", scales)):
        if t.device != device:
            raise ValueError(f"{op}: {against} and {name} must be on the same device, got {device} and {t.device}")
    return n


def _config_from_list(op: str, config: list[int] | None, x: torch.Tensor, n: int, scheme: str, group_size: int,
                      activations: str) -> QuantizedLinearConfig:
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    if config is None:
        return choose_config(m, n, k, scheme, group_size or None, None if activations == "none" else activations,
                             x.device)
    if len(config) != 6:
        raise ValueError(f"{op}: config must have 6 entries (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, "
                         f"num_stages), got {list(config)}")
    result = QuantizedLinearConfig(*(int(v) for v in config))
    _check_config(op, result, scheme, group_size)
    return result


# --------------------------------------------------------------------------- the custom op


@torch.library.custom_op("kernel_ladder::quantized_linear", mutates_args=())
def _quantized_linear_op(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    scheme: str, group_size: int, in_features: int, activations: str, config: list[int] | None,
) -> torch.Tensor:
    op = "kernel_ladder.quantized_linear"
    _check_quantized_linear_args(op, x, data, scales, bias, scheme, group_size, in_features, activations)
    n = data.shape[0]
    chosen = _config_from_list(op, config, x, n, scheme, group_size, activations)
    runtime.require_launchable(op, x, data, scales, *([bias] if bias is not None else []))
    out = _launch.empty_output((*x.shape[:-1], n), x)
    if out.numel() == 0:
        return out
    out2d = out.view(-1, n)
    if activations == "int8":
        _launch_w8a8(x, data, scales, bias, in_features, out2d, chosen)
    else:
        _launch_weight_only(x, data, scales, bias, scheme, group_size, in_features, out2d, chosen)
    return out


@_quantized_linear_op.register_fake
def _quantized_linear_fake(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
    scheme: str, group_size: int, in_features: int, activations: str, config: list[int] | None,
) -> torch.Tensor:
    op = "kernel_ladder.quantized_linear"
    _check_quantized_linear_args(op, x, data, scales, bias, scheme, group_size, in_features, activations)
    if config is not None:
        _config_from_list(op, config, x, data.shape[0], scheme, group_size, activations)
    return _launch.empty_output((*x.shape[:-1], data.shape[0]), x)


def _backward_config(M: int, K: int, scheme: str, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the backward kernel."""
    block_k = min(group_size, 128) if scheme == "int4" else 128
    block_k = max(32, min(block_k, triton.next_power_of_2(max(K, 1))))
    if runtime.INTERPRETER:
        return max(16, min(64, triton.next_power_of_2(max(M, 1)))), 128, block_k, 4, 1
    return (16 if M <= 16 else 64), 64, block_k, 4, 3


def _check_backward_args(op: str, grad_out: object, data: torch.Tensor, scales: torch.Tensor, scheme: str,
                         group_size: int, in_features: int) -> None:
    check_tensor(op, "grad_out", grad_out)
    check_float_dtype(op, "grad_out", grad_out)
    check_choice(op, "scheme", scheme, SCHEMES)
    n = _check_qweight_parts(op, data, scales, scheme, group_size, in_features, grad_out.device, "grad_out")
    if grad_out.dim() == 0 or grad_out.shape[-1] != n:
        raise ValueError(f"{op}: grad_out must have shape (..., {n}) (out_features), got {tuple(grad_out.shape)}")


@torch.library.custom_op("kernel_ladder::quantized_linear_backward", mutates_args=())
def _quantized_linear_backward_op(
    grad_out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, scheme: str, group_size: int, in_features: int,
) -> torch.Tensor:
    op = "kernel_ladder.quantized_linear (backward)"
    _check_backward_args(op, grad_out, data, scales, scheme, group_size, in_features)
    runtime.require_launchable(op, grad_out, data, scales)
    K, N = in_features, data.shape[0]
    grad_x = _launch.empty_output((*grad_out.shape[:-1], K), grad_out)
    if grad_x.numel() == 0:
        return grad_x
    grad_x2d = grad_x.view(-1, K)
    if N == 0:
        return grad_x.zero_()
    M_total = grad_x2d.shape[0]
    block_m, block_n, block_k, warps, stages = _backward_config(M_total, K, scheme, group_size)
    scale_group_stride = scales.stride(1) if scales.dim() == 2 else 0
    for launch in plan_rows([grad_out], reduce_ndim=1):
        rows = launch.n_rows
        grid = (triton.cdiv(rows, block_m), triton.cdiv(K, block_k))
        quantized_linear_backward_kernel[grid](
            launch.tensors[0], data, scales, grad_x2d[launch.row_base:],
            *launch.args(), K, data.shape[1], data.stride(0), data.stride(1), scales.stride(0), scale_group_stride,
            SCHEME=_SCHEME_IDS[scheme], GROUP_SIZE=group_size or 1,
            INPUT_PRECISION=_launch.dot_input_precision(grad_out.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    return grad_x


@_quantized_linear_backward_op.register_fake
def _quantized_linear_backward_fake(
    grad_out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, scheme: str, group_size: int, in_features: int,
) -> torch.Tensor:
    _check_backward_args("kernel_ladder.quantized_linear (backward)", grad_out, data, scales, scheme, group_size,
                         in_features)
    return _launch.empty_output((*grad_out.shape[:-1], in_features), grad_out)


def _quantized_linear_setup_context(ctx, inputs, output) -> None:
    x, data, scales, bias, scheme, group_size, in_features, activations, config = inputs
    ctx.save_for_backward(data, scales)
    ctx.scheme, ctx.group_size, ctx.in_features = scheme, group_size, in_features
    ctx.has_bias = bias is not None


def _quantized_linear_backward(ctx, grad_out: torch.Tensor):
    data, scales = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = _quantized_linear_backward_op(grad_out, data, scales, ctx.scheme, ctx.group_size, ctx.in_features)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
    return grad_x, None, None, grad_bias, None, None, None, None, None


_quantized_linear_op.register_autograd(_quantized_linear_backward, setup_context=_quantized_linear_setup_context)


# --------------------------------------------------------------------------- the public API


def quantized_linear(
    x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None, *,
    activations: str | None = None, config: QuantizedLinearConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, qweight.dequantize(), bias)`` without materializing the dequantized weight.

    Args:
        x: float32, float16 or bfloat16 input ``(..., in_features)``, any leading dims and strides.
        qweight: a :class:`kernel_ladder.QuantizedWeight` from :func:`kernel_ladder.quantize_weight`
            (``"int8"``, ``"int4"`` or ``"fp8"``), on x's device.
        bias: optional ``(out_features,)`` tensor of x's dtype.
        activations: ``None`` — weight-only: the weight is dequantized to x's dtype in registers;
            ``"int8"`` — W8A8 (int8 qweights only): x is quantized per token to int8 on the fly,
            the dot is int8 x int8 with an int32 accumulator, rescaled by ``s_x[m] * s_w[n]``.
        config: optional :class:`QuantizedLinearConfig` (tile sizes, split-K, warps, stages);
            default :func:`choose_config`.

    Returns:
        A new contiguous ``(..., out_features)`` tensor of x's dtype (fp32 accumulation).
        Differentiable with respect to x and bias (``kernel_ladder::quantized_linear_backward``; the
        quantized weight is frozen; W8A8 passes gradients straight through the rounding of x).

    Raises:
        ValueError / TypeError for bad arguments (messages name the argument and what is
        supported).
    """
    op = "kernel_ladder.quantized_linear"
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(
            f"{op}: qweight must be a kernel_ladder.QuantizedWeight (from kernel_ladder.quantize_weight), "
            f"got {type(qweight).__name__}"
        )
    check_tensor(op, "x", x)
    if activations not in ACTIVATION_SCHEMES:
        raise ValueError(f"{op}: activations must be None (weight-only) or 'int8' (W8A8), got {activations!r}")
    if config is not None and not isinstance(config, QuantizedLinearConfig):
        raise TypeError(f"{op}: config must be a kernel_ladder.QuantizedLinearConfig or None, "
                        f"got {type(config).__name__}")
    group_size = qweight.group_size or 0
    acts = "none" if activations is None else activations
    _check_quantized_linear_args(op, x, qweight.data, qweight.scales, bias, qweight.scheme, group_size,
                       qweight.in_features, acts)
    config_list = list(astuple(config)) if config is not None else None
    if config is not None:
        _check_config(op, config, qweight.scheme, group_size)
    return _quantized_linear_op(x, qweight.data, qweight.scales, bias, qweight.scheme, group_size,
                                qweight.in_features, acts, config_list)


def quantization_error(
    w: torch.Tensor, x: torch.Tensor, scheme: str, group_size: int | None = None, *,
    activations: str | None = None, scale_dtype: torch.dtype = torch.float32,
) -> float:
    """Relative Frobenius error of a quantized linear layer's output.

    ``|| quantized_linear(x, quantize_weight(w, scheme, group_size)) - x @ w.T ||_F / || x @ w.T ||_F``,
    the reference computed in float64 from the unquantized ``w`` and ``x`` as given. It includes
    the output's rounding to x's dtype (~1e-3 for bf16), which is small next to the weights'.

    Args:
        w: ``(out_features, in_features)`` float weight.
        x: ``(..., in_features)`` input, same dtype family (fp32/fp16/bf16; it need not match w's).
        scheme, group_size, scale_dtype: as :func:`kernel_ladder.quantize_weight`.
        activations: as :func:`quantized_linear` (``"int8"`` adds the per-token activation error).

    Returns:
        The error as a Python float.
    """
    qweight = quantize_weight(w, scheme, group_size=group_size, scale_dtype=scale_dtype)
    with torch.no_grad():
        got = quantized_linear(x.detach(), qweight, activations=activations).double()
        reference = x.detach().double() @ w.detach().double().T
    return float((got - reference).norm() / reference.norm())
