"""Weight and activation quantization: int8 per channel, int4 group-wise packed, fp8 e4m3 per channel.

A linear layer's weight ``w`` has shape ``(out_features, in_features) = (N, K)``, as in
``torch.nn.Linear``. Quantizing it stores small integers (or fp8 values) ``q`` and *scales*
``s`` such that ``w ~ q * s``. Every scheme here is **symmetric** (no zero points:
``0.0`` is always exactly representable, and dequantizing is one multiply):

========  ============================================  ================================  =========
scheme    values ``q``                                  scales                            bits/wt
========  ============================================  ================================  =========
``int8``  ``round(w / s)`` in [-127, 127], ``int8``     one per output channel (row):     8
          ``(N, K)``                                    ``s[n] = max_k |w[n, k]| / 127``
``int4``  ``round(w / s)`` in [-8, 7] (in practice      one per group of ``group_size``   4
          [-7, 7]), two per byte, ``uint8``             consecutive k in a row:
          ``(N, ceil(K / 2))``                          ``s[n, g] = max |w[n, group g]| / 7``
``fp8``   ``(w / s)`` cast to ``torch.float8_e4m3fn``   one per output channel:           8
          (round to nearest even), ``(N, K)``           ``s[n] = max_k |w[n, k]| / 448``
========  ============================================  ================================  =========

``round`` is round-half-to-even (``torch.round``), divisions are IEEE-exact, and scales are
computed in float32 and then stored in ``scale_dtype`` (float32 by default); the values are
quantized with the *stored* scale, so ``dequantize()`` is exactly ``q * s``. A row or group that
is all zeros gets scale 1 (and zeros). **Non-finite values**: :func:`quantize_weight` rejects a
weight holding NaN or +-inf with an error (no format can represent them); at run time (W8A8
activations) a row holding one gets zero values and a NaN scale, so its results are NaN.

**int4 packing (nibble order).** Values are stored as unsigned nibbles ``u = q + 8`` in
[0, 15] (offset 8), two per byte along K::

    data[n, j] = u[n, 2*j]  |  (u[n, 2*j + 1] << 4)        # low nibble = even k, high = odd k

so ``q[n, 2j] = (data[n, j] & 0xF) - 8`` and ``q[n, 2j+1] = (data[n, j] >> 4) - 8``. An odd K
leaves the last byte's high nibble at 8 (the value 0). **Group sizes** for int4: a power of two
from 32 to 4096 (:data:`INT4_GROUP_SIZES`; default 128). K need not be a multiple of the group
size: the last group of each row is then shorter (its scale comes from the elements it has).
int4 scales have shape ``(N, ceil(K / group_size))`` and are laid out *group-major* in memory
(strides ``(1, N)``): the scales of one K-group for consecutive output channels are contiguous,
which is what the linear kernel reads per K step.

**fp8** values are ``torch.float8_e4m3fn`` (Triton's ``fp8e4nv``): 4 exponent bits, 3 mantissa
bits, largest finite value 448, no infinities. ``w / s`` is at most 448 by construction; larger
magnitudes (only through rounding) saturate to +-448, as the GPU's ``cvt.rn.satfinite`` and
torch's conversion both do.

The same row kernel also quantizes **activations per token** (per row of ``x``) to int8 at run
time, for the W8A8 path of :func:`kernel_ladder.quantized_linear` (:func:`quantize_activations`).

Kernels: ``quantize_rows_kernel`` (per-row amax, scale, int8 or fp8 values; weights per channel
and activations per token) and ``quantize_int4_kernel`` (per-group amax, scale, packing). Ops:
``kernel_ladder::quantize_rows`` and ``kernel_ladder::quantize_int4`` (not differentiable: quantization is
a step function; quantized weights are frozen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._rows import plan_rows, row_start
from .._validate import FLOAT_DTYPES, check_choice, check_float_dtype, check_tensor

__all__ = [
    "SCHEMES",
    "INT4_GROUP_SIZES",
    "DEFAULT_INT4_GROUP_SIZE",
    "INT8_MAX",
    "INT4_MAX",
    "FP8_MAX",
    "QuantizedWeight",
    "quantize_weight",
    "quantize_activations",
    "quantize_rows_kernel",
    "quantize_int4_kernel",
]

#: The weight quantization schemes.
SCHEMES: tuple[str, ...] = ("int8", "int4", "fp8")
#: int4 group sizes the quantizer and the linear kernel support (powers of two).
INT4_GROUP_SIZES: tuple[int, ...] = tuple(2**i for i in range(5, 13))
DEFAULT_INT4_GROUP_SIZE: int = 128
#: Largest quantized magnitude of each scheme (the scale maps a row's / group's amax onto it).
INT8_MAX: float = 127.0
INT4_MAX: float = 7.0
FP8_MAX: float = 448.0

#: torch storage dtype of each scheme's values.
STORAGE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}

# fp32 x + 1.5 * 2**23 - 1.5 * 2**23 rounds x to an integer, ties to even (for |x| < 2**22): the
# hardware's own round-to-nearest-even addition does it, with no libdevice rint (which the
# interpreter lacks), identically on a GPU and in the interpreter.
_ROUNDING_MAGIC = tl.constexpr(12582912.0)

#: Elements per program in the interpreter (big blocks, few programs) and on a GPU.
_INTERPRETER_BLOCK_ELEMENTS = 16384
_GPU_BLOCK_ELEMENTS = 4096


@triton.jit
def _is_nonfinite(x):
    """NaN (the one value unequal to itself) or +-inf."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def _round_half_even(v):
    """Round fp32 ``v`` (|v| < 2**22) to the nearest integer, ties to even (as torch.round)."""
    return (v + _ROUNDING_MAGIC) - _ROUNDING_MAGIC


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr,
    n_rows, n_cols, size1, size2,
    stride_x0, stride_x1, stride_x2, stride_xcol, stride_qrow,
    FP8: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHUNKED: tl.constexpr,
):
    """Symmetric per-row quantization of ``BLOCK_ROWS`` rows: ``s = amax / QMAX``, ``q = round(x / s)``.

    int8 (``FP8=False``): QMAX 127, q rounded half-to-even and clamped to [-127, 127].
    fp8 (``FP8=True``): QMAX 448, q = (x / s) cast to e4m3 (round to nearest even, saturating).
    ``x`` is read through its strides (leading dims via ``row_start``); ``q`` is written with
    row stride ``stride_qrow`` and unit column stride; ``scale`` is contiguous, one per row, in
    its own dtype — and q is computed with the stored (rounded) scale. A row that fits in one
    block is read once; longer rows (``CHUNKED``) are read twice (amax pass, quantize pass).
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    x_start = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)
    q_start = rows.to(tl.int64) * stride_qrow
    cols = tl.arange(0, BLOCK_COLS)
    if FP8:
        qmax = 448.0
    else:
        qmax = 127.0
    # A NaN or +-inf has no int8/e4m3 value; counted separately (tl.max may skip NaN on a GPU).
    if not CHUNKED:
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + x_start[:, None] + cols[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        nonfinite = tl.sum(_is_nonfinite(x).to(tl.int32), axis=1)
    else:
        amax = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        nonfinite = tl.zeros((BLOCK_ROWS,), dtype=tl.int32)
        for c0 in range(0, n_cols, BLOCK_COLS):
            c = c0 + cols
            mask = row_mask[:, None] & (c < n_cols)[None, :]
            x = tl.load(x_ptr + x_start[:, None] + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            nonfinite += tl.sum(_is_nonfinite(x).to(tl.int32), axis=1)
    scale = tl.math.div_rn(amax, qmax).to(scale_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.where(scale > 0.0, scale, 1.0)  # all-zero rows (or an amax that underflows): q = 0
    # A row holding a NaN or an inf: zero values and a NaN scale, so everything computed from the
    # row (its dequantized values, a W8A8 output row) is NaN, never a finite or wrong-signed number.
    bad_row = nonfinite > 0
    scale = tl.where(bad_row, float("nan"), scale)
    tl.store(scale_ptr + rows, scale.to(scale_ptr.dtype.element_ty), mask=row_mask)
    for c0 in range(0, n_cols, BLOCK_COLS):
        c = c0 + cols
        mask = row_mask[:, None] & (c < n_cols)[None, :]
        if CHUNKED:
            x = tl.load(x_ptr + x_start[:, None] + c[None, :] * stride_xcol, mask=mask, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale[:, None])
        v = tl.where(bad_row[:, None], 0.0, tl.minimum(tl.maximum(v, -qmax), qmax))
        if FP8:
            q = v.to(tl.float8e4nv)
        else:
            q = _round_half_even(v).to(tl.int8)
        tl.store(q_ptr + q_start[:, None] + c[None, :], q, mask=mask)


@triton.jit
def quantize_int4_kernel(
    w_ptr, packed_ptr, scale_ptr,
    n_rows, n_cols,
    stride_wn, stride_wk, stride_pn, stride_sn, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """One K-group of ``BLOCK_ROWS`` rows: ``s = amax / 7``, ``q = clamp(round(w / s), -8, 7)``, packed.

    The group's even and odd columns are loaded as two ``(BLOCK_ROWS, GROUP_SIZE / 2)`` halves, so
    packing needs no shuffle: byte ``j`` of the group is ``(q_even[j] + 8) | (q_odd[j] + 8) << 4``.
    Columns past ``n_cols`` read as 0 (so a short last group's scale comes from its own elements)
    and bytes past ``ceil(n_cols / 2)`` are not written.
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    row_mask = rows < n_rows
    half = tl.arange(0, GROUP_SIZE // 2)
    k_even = group * GROUP_SIZE + 2 * half
    w_row = rows.to(tl.int64) * stride_wn
    base = w_ptr + w_row[:, None] + k_even[None, :] * stride_wk
    even = tl.load(base, mask=row_mask[:, None] & (k_even < n_cols)[None, :], other=0.0).to(tl.float32)
    odd = tl.load(base + stride_wk, mask=row_mask[:, None] & (k_even + 1 < n_cols)[None, :], other=0.0)
    odd = odd.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    scale = tl.math.div_rn(amax, 7.0).to(scale_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.where(scale > 0.0, scale, 1.0)
    q_even = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(even, scale[:, None])), -8.0), 7.0)
    q_odd = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(odd, scale[:, None])), -8.0), 7.0)
    low = (q_even + 8.0).to(tl.uint8)
    high = (q_odd + 8.0).to(tl.uint8)
    packed = low | (high << 4)
    byte = group * (GROUP_SIZE // 2) + half
    out = packed_ptr + rows.to(tl.int64)[:, None] * stride_pn + byte[None, :]
    tl.store(out, packed, mask=row_mask[:, None] & (byte < (n_cols + 1) // 2)[None, :])
    scale_out = scale_ptr + rows.to(tl.int64) * stride_sn + group * stride_sg
    tl.store(scale_out, scale.to(scale_ptr.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------- launchers


def _block_elements() -> int:
    return _INTERPRETER_BLOCK_ELEMENTS if runtime.INTERPRETER else _GPU_BLOCK_ELEMENTS


def launch_quantize_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fp8: bool) -> None:
    """Quantize every row of ``x`` (any leading dims, any strides) into ``q`` (contiguous, x's
    shape) and ``scales`` (contiguous, x.shape[:-1])."""
    n_cols = x.shape[-1]
    if n_cols == 0:
        scales.fill_(1.0)  # an empty row has amax 0: scale 1, like an all-zero row
        return
    elements = _block_elements()
    block = min(triton.next_power_of_2(n_cols), elements)
    q_rows, scale_rows = q.view(-1, n_cols), scales.view(-1)
    for launch in plan_rows([x], reduce_ndim=1):
        rows = max(1, min(elements // block, triton.next_power_of_2(launch.n_rows)))
        start = launch.row_base
        quantize_rows_kernel[(triton.cdiv(launch.n_rows, rows),)](
            launch.tensors[0], q_rows[start:], scale_rows[start:], *launch.args(), q_rows.stride(0),
            FP8=fp8, BLOCK_ROWS=rows, BLOCK_COLS=block, CHUNKED=n_cols > block, num_warps=4,
        )


def _int4_storage(n: int, k: int, group_size: int, scale_dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    packed = _launch.empty((n, (k + 1) // 2), torch.uint8, device)
    groups = math.ceil(k / group_size)
    scales = _launch.empty((groups, n), scale_dtype, device).t()  # (N, groups), group-major
    return packed, scales


def _launch_quantize_int4(w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    n, k = w.shape
    if n == 0 or k == 0:
        return
    rows = max(1, min(_block_elements() // (group_size // 2), triton.next_power_of_2(n)))
    grid = (triton.cdiv(n, rows), scales.shape[1])
    quantize_int4_kernel[grid](
        w, packed, scales, n, k, w.stride(0), w.stride(1), packed.stride(0), scales.stride(0), scales.stride(1),
        GROUP_SIZE=group_size, BLOCK_ROWS=rows, num_warps=4,
    )


# --------------------------------------------------------------------------- validation


def _check_scale_dtype(op: str, scale_dtype: object) -> None:
    if scale_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: scale_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {scale_dtype}")


def check_group_size(op: str, scheme: str, group_size: object) -> int | None:
    """The group size a scheme will use: int4's (default 128), ``None`` for per-channel schemes."""
    if scheme != "int4":
        if group_size is not None:
            raise ValueError(
                f"{op}: group_size applies to scheme 'int4' only ('{scheme}' scales per output channel), "
                f"got group_size={group_size!r}; leave it out"
            )
        return None
    if group_size is None:
        return DEFAULT_INT4_GROUP_SIZE
    supported = ", ".join(str(g) for g in INT4_GROUP_SIZES)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"{op}: group_size must be an int (one of {supported}), got {type(group_size).__name__}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"{op}: group_size must be a power of two from 32 to 4096 ({supported}) for scheme 'int4', "
            f"got {group_size}"
        )
    return group_size


def _check_weight(op: str, w: object) -> torch.Tensor:
    check_tensor(op, "w", w)
    check_float_dtype(op, "w", w)
    if w.dim() != 2:
        raise ValueError(
            f"{op}: w must be a 2-D (out_features, in_features) weight, like nn.Linear's, got shape {tuple(w.shape)}"
        )
    return w


def _check_finite(op: str, w: torch.Tensor) -> None:
    """A weight to quantize holds only finite values (one host synchronization: an offline step).

    NaN and +-inf have no int8/int4/e4m3 representation, and one of them would also make its
    row's (or group's) scale non-finite; rejecting them is clearer than a silently wrong layer.
    """
    finite = torch.isfinite(w)
    if torch.compiler.is_compiling():
        # A traced graph cannot read the flag on the host: it asserts it instead (a RuntimeError when it runs).
        torch._assert_async(finite.all(), f"{op}: w holds a non-finite value (NaN or +-inf), which no quantized "
                                          "format can represent")
        return
    if w.numel() and not bool(finite.all()):
        bad = (~finite).nonzero()
        first = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{op}: w has {bad.shape[0]} non-finite value(s) (NaN or +-inf; the first at {list(first)} is "
            f"{w[first].item()}), which no quantized format can represent. Find where they came from, or "
            "replace them (e.g. torch.nan_to_num) before quantizing"
        )


def _check_rows_args(op: str, x: object, fp8: object, scale_dtype: object) -> None:
    check_tensor(op, "x", x)
    check_float_dtype(op, "x", x)
    if x.dim() == 0:
        raise ValueError(
            f"{op}: x must have at least one dimension (rows are quantized along the last), got a 0-d tensor"
        )
    if not isinstance(fp8, bool):
        raise TypeError(f"{op}: fp8 must be a bool, got {type(fp8).__name__}")
    _check_scale_dtype(op, scale_dtype)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("kernel_ladder::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor, fp8: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.quantize_rows"
    _check_rows_args(op, x, fp8, scale_dtype)
    runtime.require_launchable(op, x)
    q = _launch.empty(x.shape, torch.float8_e4m3fn if fp8 else torch.int8, x.device)
    scales = _launch.empty(x.shape[:-1], scale_dtype, x.device)
    launch_quantize_rows(x, q, scales, fp8)
    return q, scales


@_quantize_rows_op.register_fake
def _quantize_rows_fake(x: torch.Tensor, fp8: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rows_args("kernel_ladder.quantize_rows", x, fp8, scale_dtype)
    q = _launch.empty(x.shape, torch.float8_e4m3fn if fp8 else torch.int8, x.device)
    return q, _launch.empty(x.shape[:-1], scale_dtype, x.device)


def _check_int4_args(op: str, w: object, group_size: object, scale_dtype: object) -> None:
    _check_weight(op, w)
    check_group_size(op, "int4", group_size)
    _check_scale_dtype(op, scale_dtype)


@torch.library.custom_op("kernel_ladder::quantize_int4", mutates_args=())
def _quantize_int4_op(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    op = "kernel_ladder.quantize_int4"
    _check_int4_args(op, w, group_size, scale_dtype)
    runtime.require_launchable(op, w)
    packed, scales = _int4_storage(*w.shape, group_size, scale_dtype, w.device)
    _launch_quantize_int4(w, packed, scales, group_size)
    return packed, scales


@_quantize_int4_op.register_fake
def _quantize_int4_fake(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_int4_args("kernel_ladder.quantize_int4", w, group_size, scale_dtype)
    return _int4_storage(*w.shape, group_size, scale_dtype, w.device)


# --------------------------------------------------------------------------- the public API


class QuantizedWeight:
    """A quantized ``(out_features, in_features)`` linear weight: values, scales, and what they mean.

    Made by :func:`quantize_weight`; consumed by :func:`kernel_ladder.quantized_linear`. Treat it as
    frozen (inference weights).

    Attributes:
        scheme: ``"int8"``, ``"int4"`` or ``"fp8"`` (see the module docstring for each format).
        data: the quantized values: int8 ``(N, K)``; uint8 ``(N, ceil(K/2))`` two int4 nibbles per
            byte (low nibble = even k, stored as q + 8); float8_e4m3fn ``(N, K)``.
        scales: ``(N,)`` for int8 / fp8 (one per output channel); ``(N, ceil(K/group_size))``
            for int4, group-major in memory (strides ``(1, N)``).
        shape: the original weight's ``torch.Size((N, K))``.
        dtype: the original weight's dtype (what :meth:`dequantize` returns).
        group_size: int4's group size along K; ``None`` for the per-channel schemes.
    """

    __slots__ = ("scheme", "data", "scales", "shape", "dtype", "group_size")

    def __init__(self, scheme: str, data: torch.Tensor, scales: torch.Tensor, shape: Sequence[int],
                 dtype: torch.dtype, group_size: int | None = None) -> None:
        op = "kernel_ladder.QuantizedWeight"
        check_choice(op, "scheme", scheme, SCHEMES)
        group_size = check_group_size(op, scheme, group_size)
        check_tensor(op, "data", data)
        check_tensor(op, "scales", scales)
        n, k = (int(s) for s in shape)
        expected_data = (n, (k + 1) // 2) if scheme == "int4" else (n, k)
        expected_scales = (n, math.ceil(k / group_size)) if scheme == "int4" else (n,)
        if data.dtype != STORAGE_DTYPES[scheme] or tuple(data.shape) != expected_data:
            raise ValueError(
                f"{op}: data for scheme '{scheme}' and shape {(n, k)} must be {STORAGE_DTYPES[scheme]} of shape "
                f"{expected_data}, got {data.dtype} of shape {tuple(data.shape)}"
            )
        if scales.dtype not in FLOAT_DTYPES or tuple(scales.shape) != expected_scales:
            raise ValueError(
                f"{op}: scales for scheme '{scheme}' and shape {(n, k)} must be float32/float16/bfloat16 of shape "
                f"{expected_scales}, got {scales.dtype} of shape {tuple(scales.shape)}"
            )
        if data.device != scales.device:
            raise ValueError(f"{op}: data and scales must be on the same device, got {data.device} and {scales.device}")
        self.scheme = scheme
        self.data = data
        self.scales = scales
        self.shape = torch.Size((n, k))
        self.dtype = dtype
        self.group_size = group_size

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of storage: the quantized values plus the scales (what a kernel must read)."""
        return self.data.nbytes + self.scales.nbytes

    @property
    def bits_per_weight(self) -> float:
        """``nbytes * 8 / (N * K)``: 4.25 for int4 with group 128 and fp32 scales, ~8 for int8."""
        numel = self.shape.numel()
        return self.nbytes * 8 / numel if numel else float("nan")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``(N, K)`` weight these values stand for, ``q * s``, in ``dtype`` (default: the
        original weight's dtype).

        ``q * s`` is computed in float32 (float64 when ``dtype`` is float64) and rounded once to
        ``dtype``. The kernels never round it: they scale the fp32 accumulator. So a reference
        for a bf16 or fp16 weight should ask for ``dequantize(torch.float64)``, or it carries the
        rounding of every weight element to the low-precision dtype, an error the kernel does
        not have. Materializes the full weight (torch code, for reference and for error
        measurements); :func:`kernel_ladder.quantized_linear` never does this.
        """
        dtype = self.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"QuantizedWeight.dequantize: dtype must be a floating torch.dtype, got {dtype!r}")
        work = torch.float64 if dtype == torch.float64 else torch.float32
        n, k = self.shape
        if self.scheme == "int4":
            low = (self.data & 0xF).to(torch.int16) - 8
            high = (self.data >> 4).to(torch.int16) - 8
            q = torch.stack([low, high], dim=-1).reshape(n, 2 * self.data.shape[1])[:, :k].to(work)
            scales = self.scales.to(work).repeat_interleave(self.group_size, dim=1)[:, :k]
            return (q * scales).to(dtype)
        return (self.data.to(work) * self.scales.to(work)[:, None]).to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """A copy on ``device`` (scales keep their group-major layout)."""
        scales = self.scales
        if self.scheme == "int4":
            scales = scales.t().to(device).t()
        else:
            scales = scales.to(device)
        return QuantizedWeight(self.scheme, self.data.to(device), scales, self.shape, self.dtype, self.group_size)

    def __repr__(self) -> str:
        n, k = self.shape
        group = f", group_size={self.group_size}" if self.group_size is not None else ", per output channel"
        return (
            f"QuantizedWeight(scheme='{self.scheme}', shape=({n}, {k}), dtype={self.dtype}{group}, "
            f"data={self.data.dtype}{tuple(self.data.shape)}, scales={self.scales.dtype}{tuple(self.scales.shape)}, "
            f"nbytes={self.nbytes}, bits_per_weight={self.bits_per_weight:.3g}, device={self.device})"
        )


def quantize_weight(w: torch.Tensor, scheme: str, group_size: int | None = None,
                    scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Quantize a linear layer's weight (Triton kernels; symmetric scales, see the module docstring).

    Args:
        w: float32, float16 or bfloat16 weight of shape ``(out_features, in_features)``, any
            strides (not copied). Its values are read, never modified.
        scheme: ``"int8"`` (per output channel), ``"int4"`` (group-wise along K, packed two per
            byte) or ``"fp8"`` (float8 e4m3fn, per output channel).
        group_size: int4 only: consecutive K elements sharing a scale, a power of two from 32 to
            4096 (default 128). Leave it out for int8 and fp8.
        scale_dtype: dtype the scales are stored in (float32 by default; float16/bfloat16 halve
            their bytes). Values are quantized with the stored scale.

    Returns:
        A :class:`QuantizedWeight` (not differentiable: quantized weights are frozen).

    Raises:
        ValueError: if ``w`` holds a NaN or an infinity (checked with one host synchronization;
            quantization is an offline step).
    """
    op = "kernel_ladder.quantize_weight"
    _check_weight(op, w)
    check_choice(op, "scheme", scheme, SCHEMES)
    group_size = check_group_size(op, scheme, group_size)
    _check_scale_dtype(op, scale_dtype)
    w = w.detach()
    _check_finite(op, w)
    if scheme == "int4":
        data, scales = _quantize_int4_op(w, group_size, scale_dtype)
    else:
        data, scales = _quantize_rows_op(w, scheme == "fp8", scale_dtype)
    return QuantizedWeight(scheme, data, scales, w.shape, w.dtype, group_size)


def quantize_activations(x: torch.Tensor, dtype: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: each row (last dim) of ``x`` gets its own scale.

    ``s[row] = max |x[row, :]| / QMAX`` (127 for int8, 448 for fp8), ``q = round(x / s)``
    (int8: half to even, clamped to [-127, 127]; fp8: cast to e4m3 to nearest even). This is the
    first kernel of the W8A8 path of :func:`kernel_ladder.quantized_linear`.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape (>= 1-D) and strides.
        dtype: ``"int8"`` or ``"fp8"``.

    Returns:
        ``(q, scales)``: q contiguous, x's shape, int8 or float8_e4m3fn; scales float32 of shape
        ``x.shape[:-1]``. A row holding a NaN or an infinity has no quantized form: its values are
        0 and its scale NaN, so everything computed from it (a W8A8 output row) is NaN — as
        non-finite as torch's result from such a row, never a finite or wrong-signed number.
    """
    op = "kernel_ladder.quantize_activations"
    check_choice(op, "dtype", dtype, ("int8", "fp8"))
    _check_rows_args(op, x, dtype == "fp8", torch.float32)
    return _quantize_rows_op(x.detach(), dtype == "fp8", torch.float32)
