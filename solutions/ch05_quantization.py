"""Solutions to chapter 05, quantization.

One solution per exercise of ``chapters/05_quantization/05_quantization.ipynb``, written for reading:

* :func:`quantize_int8_per_channel` — symmetric int8 with one scale per output channel (torch);
* :func:`pack_int4` / :func:`unpack_int4` — two int4 values per byte, offset-8 nibbles, low nibble
  first (the layout of ``kernel_ladder.quantize_weight(w, "int4")``);
* :func:`int4_linear_kernel` — ``x @ W.T`` with W int4 group-wise: the packed weight is unpacked
  and scaled in registers inside the K loop, never written out;
* :func:`quantize_per_token_kernel` — dynamic per-token (per row) int8 quantization of activations;
* :func:`w8a8_matmul_kernel` — int8 x int8 ``tl.dot`` into an int32 accumulator, rescaled by
  ``s_x[m] * s_w[n]`` in the epilogue.

Also here, for the chapter and the report (not exercises): Python launchers for the three kernels
(:func:`int4_linear`, :func:`quantize_per_token`, :func:`w8a8_matmul`).

Every scheme is **symmetric**: ``w ~ q * s`` with no zero point, so 0.0 is exact and dequantizing
is one multiply. Scales are float32 and computed from the absolute maximum of what they cover.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "quantize_int8_per_channel",
    "pack_int4",
    "unpack_int4",
    "int4_linear_kernel",
    "int4_linear",
    "quantize_per_token_kernel",
    "quantize_per_token",
    "w8a8_matmul_kernel",
    "w8a8_matmul",
    "INT4_BLOCK_M",
    "INT4_BLOCK_N",
    "int4_linear_traffic",
]

#: fp32 ``(v + 1.5 * 2**23) - 1.5 * 2**23`` rounds ``v`` (|v| < 2**22) to an integer, ties to even:
#: the addition itself rounds to nearest even, and it needs no libdevice (which the interpreter lacks).
_ROUND_MAGIC = tl.constexpr(12582912.0)

#: Tile of the int4 launcher: 16 rows (``tl.dot``'s minimum), 64 output channels per program.
INT4_BLOCK_M = 16
INT4_BLOCK_N = 64


# ----------------------------------------------------------------------------------------------
# Exercise 1: int8 per channel
# ----------------------------------------------------------------------------------------------


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of an ``(N, K)`` weight, one float32 scale per output channel (row).

    Teaches the whole recipe of symmetric quantization: the scale maps the row's largest
    *magnitude* onto the largest integer, ``s[n] = max_k |w[n, k]| / 127``; values are divided by
    it, **rounded** to the nearest integer (half to even, ``torch.round``) and **clamped** to
    [-127, 127] (-128 is left unused so the grid is symmetric). Computing in float32 whatever the
    weight's dtype keeps the scale exact to fp32 rounding; an all-zero row gets scale 1 (and zeros).
    Dequantizing is ``q * s[:, None]``: each value is off by at most half a step, ``s / 2``.

    Returns:
        ``(q, scales)``: int8 ``(N, K)`` and float32 ``(N,)``.
    """
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = amax / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


# ----------------------------------------------------------------------------------------------
# Exercises 2 and 3: int4 packing
# ----------------------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values ``q`` (integers in [-8, 7], shape ``(N, K)``) two per byte along K.

    Teaches the nibble layout of ``kernel_ladder.quantize_weight(w, "int4")``: each value is stored as
    the *unsigned* nibble ``u = q + 8`` in [0, 15] (offset 8: an implicit zero point), and byte
    ``j`` of a row holds ``k = 2j`` in its low four bits and ``k = 2j + 1`` in its high four::

        byte[n, j] = u[n, 2j]  |  (u[n, 2j + 1] << 4)

    An odd K pads the last byte's high nibble with 8 (the value 0). The arithmetic is done in
    int16 so that ``q + 8`` and the shift cannot overflow on the way.

    Returns:
        uint8 ``(N, ceil(K / 2))``.
    """
    n, k = q.shape
    u = q.to(torch.int16) + 8  # [0, 15]
    if k % 2:
        u = torch.cat([u, torch.full((n, 1), 8, dtype=torch.int16, device=q.device)], dim=1)
    low, high = u[:, 0::2], u[:, 1::2]
    return (low | (high << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 ``(N, ceil(k / 2))`` back to int8 ``(N, k)`` in [-8, 7].

    Teaches reading nibbles: the low one is ``byte & 0xF``, the high one ``byte >> 4`` (a logical
    shift: the byte is unsigned), each minus the offset 8; then the two are interleaved back into
    K order (low = even k, high = odd k) and an odd K's padding nibble is dropped.
    """
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])
    return q[:, :k]


# ----------------------------------------------------------------------------------------------
# Exercise 4: int4 dequantization inside the matmul's K loop
# ----------------------------------------------------------------------------------------------


@triton.jit
def int4_linear_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K,
                       stride_xm, stride_pn, stride_sn, stride_sg, stride_om,
                       GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[m, n] = sum_k x[m, k] * q[n, k] * s[n, k // GROUP_SIZE]`` for one ``BLOCK_M x BLOCK_N`` tile.

    Teaches fused dequantization: the weight is read as packed bytes, and the int4 values exist
    only in registers. Each step of the K loop covers one scale group (``GROUP_SIZE`` values of
    K, ``GROUP_SIZE / 2`` bytes per output channel):

    * the packed tile is ``(GROUP_SIZE / 2, BLOCK_N)`` bytes; its low nibbles are the weights of
      the even k, its high nibbles those of the odd k — so x is loaded as two half tiles, its even
      and its odd columns, and the step is two half-K dots, ``x_even @ low + x_odd @ high``: no
      shuffle to interleave the nibbles back into K order;
    * a nibble ``u`` becomes the integer ``u - 8``, exactly representable in fp16/bf16/fp32, so
      the dots run in x's dtype (tensor cores on a GPU) with an fp32 accumulator;
    * the whole group shares one scale per output channel, so the scale multiplies the step's
      ``(BLOCK_M, BLOCK_N)`` partial product once, instead of every weight.

    The weight traffic is then the packed bytes plus the scales, read once per row of tiles.
    K must be a multiple of ``GROUP_SIZE`` (the launcher checks); rows and columns are masked.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    half = tl.arange(0, GROUP_SIZE // 2)
    dot_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP_SIZE):
        k_even = g * GROUP_SIZE + 2 * half  # the k of each byte's low nibble
        x_rows = x_ptr + rm[:, None] * stride_xm
        x_even = tl.load(x_rows + k_even[None, :], mask=m_mask[:, None], other=0.0)
        x_odd = tl.load(x_rows + (k_even + 1)[None, :], mask=m_mask[:, None], other=0.0)
        byte = g * (GROUP_SIZE // 2) + half
        packed = tl.load(packed_ptr + rn[None, :] * stride_pn + byte[:, None], mask=n_mask[None, :], other=0x88)
        low = ((packed & 0xF).to(tl.int8) - 8).to(dot_dtype)  # (GROUP_SIZE / 2, BLOCK_N), exact
        high = ((packed >> 4).to(tl.int8) - 8).to(dot_dtype)
        part = tl.dot(x_even, low)
        part = tl.dot(x_odd, high, part)
        s = tl.load(scale_ptr + rn * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
        acc += part * s[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`int4_linear_kernel`: ``x (M, K) @ W.T`` for a packed int4 ``W`` (the notebook's launcher).

    ``packed`` is ``(N, K / 2)`` uint8 and ``scales`` ``(N, K / group_size)`` with any strides
    (``kernel_ladder.quantize_weight``'s are group-major); x's rows must be unit-stride. Writes ``out``
    (default: a new ``(M, N)`` tensor of x's dtype) and returns it.
    """
    M, K = x.shape
    N = packed.shape[0]
    if K % group_size or x.stride(1) != 1:
        raise ValueError("int4_linear: K must be a multiple of group_size and x's rows contiguous")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, INT4_BLOCK_M), triton.cdiv(N, INT4_BLOCK_N))
    int4_linear_kernel[grid](x, packed, scales, out, M, N, K, x.stride(0), packed.stride(0), scales.stride(0),
                             scales.stride(1), out.stride(0), GROUP_SIZE=group_size,
                             BLOCK_M=INT4_BLOCK_M, BLOCK_N=INT4_BLOCK_N)
    return out


# ----------------------------------------------------------------------------------------------
# Exercise 5: per-token activation quantization
# ----------------------------------------------------------------------------------------------


@triton.jit
def quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    """Quantize one row (token) of ``x`` to int8 with its own scale: ``s = max|x| / 127``, ``q = round(x / s)``.

    Teaches *dynamic* quantization: the scale is computed at run time from the data in hand, so a
    token with small activations gets a fine grid and one with large activations a coarse one —
    no calibration, and no token's outliers coarsen another's grid. One program per row; the row
    fits one block (``BLOCK >= K``), so x is read once: amax by ``tl.max``, then divide, round
    half to even (fp32 magic-number addition, as ``torch.round``), clamp, cast, store. The
    divisions use ``tl.math.div_rn`` (IEEE-rounded; a plain ``/`` is an approximation on a GPU)
    so that the result matches ``kernel_ladder.quantize_activations`` bit for bit.
    """
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.math.div_rn(amax, 127.0)
    scale = tl.where(scale > 0.0, scale, 1.0)  # an all-zero row: scale 1, q = 0
    v = tl.math.div_rn(x, scale)
    q = (v + _ROUND_MAGIC) - _ROUND_MAGIC
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + row * stride_qm + cols, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`quantize_per_token_kernel` on a 2-D ``x`` with unit-stride rows: ``(q int8, scales fp32)``."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scales = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M and K:
        quantize_per_token_kernel[(M,)](x, q, scales, K, x.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(K))
    return q, scales


# ----------------------------------------------------------------------------------------------
# Exercise 6: W8A8 — int8 dot, int32 accumulator, rescale in the epilogue
# ----------------------------------------------------------------------------------------------


@triton.jit
def w8a8_matmul_kernel(xq_ptr, x_scale_ptr, wq_ptr, w_scale_ptr, out_ptr, M, N, K,
                       stride_xm, stride_wn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[m, n] = s_x[m] * s_w[n] * sum_k xq[m, k] * wq[n, k]``: W8A8 with an exact integer dot.

    Teaches integer matmuls and where the scales go. ``tl.dot`` of int8 by int8 tiles runs on
    int8 tensor cores (twice the fp16 rate on Hopper) and accumulates in **int32**: a product is
    at most 127² = 16129 in magnitude, so an int16 accumulator would overflow after three terms
    while int32 holds more than 130 000 of them — the sum is exact. Both scales are constant
    along K (per token, per output channel), so they factor out of the sum and are applied once,
    in the epilogue: convert the int32 tile to fp32 and multiply by the outer product
    ``s_x[:, None] * s_w[None, :]``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(xq_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0)
        b = tl.load(wq_ptr + rn[None, :] * stride_wn + k[:, None], mask=(k < K)[:, None] & n_mask[None, :], other=0)
        acc = tl.dot(a, b, acc)  # int8 x int8 -> int32, exact
    # the epilogue: both scales are constant along K, so they are applied once, here
    x_scale = tl.load(x_scale_ptr + rm, mask=m_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def w8a8_matmul(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`w8a8_matmul_kernel`: int8 ``xq (M, K)``, ``wq (N, K)`` (unit-stride rows) -> fp32 ``(M, N)``."""
    M, K = xq.shape
    N = wq.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(M, 16), triton.cdiv(N, 32))
    w8a8_matmul_kernel[grid](xq, x_scales, wq, w_scales, out, M, N, K, xq.stride(0), wq.stride(0), out.stride(0),
                             BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)
    return out


# ----------------------------------------------------------------------------------------------
# Given: the traffic verdict (``check(..., traffic=...)``) of the int4 linear kernel
# ----------------------------------------------------------------------------------------------


def int4_linear_traffic():
    """The int4 linear's verdict: x, the packed weight (K / 2 bytes a row) and the scales read once,
    out written once, against ``kernel_ladder.quantized_linear`` on the same weight.

    The explanation (``explain_ops`` sees the case) names why: x is re-read once per column of output
    tiles, the packed weight once per row of tiles (or twice as often where each byte is loaded once
    per nibble).
    """
    from utils.exercises import Traffic
    from utils.trace import ideal_bytes, trace

    def ideal(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> int:
        return ideal_bytes(x, packed, scales) + x.shape[0] * packed.shape[0] * x.element_size()

    def top(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> int:
        qweight = kernel_ladder.QuantizedWeight("int4", packed, scales, (packed.shape[0], x.shape[1]), x.dtype,
                                                group_size)
        with trace(torch_ops=False) as traced:
            kernel_ladder.quantized_linear(x, qweight)
        return traced.bytes

    def explain(case: tuple, reread: dict[str, float], ops: object) -> str | None:
        causes = []
        x, packed = case[0], case[1]
        row_tiles = -(-x.shape[0] // INT4_BLOCK_M)
        if reread.get("packed", 0.0) > row_tiles + 0.05:
            causes.append(f"the packed weight is read {reread['packed']:.2f}× for {row_tiles} row(s) of output tiles: "
                          "load each byte once and take both its nibbles from the register")
        if reread.get("x", 0.0) > 1.05:
            causes.append(f"x is re-read once per column of output tiles ({reread['x']:.0f} = ceil(N / BLOCK_N), "
                          f"N = {packed.shape[0]}): wider tiles read it fewer times, and in decode x is small "
                          "next to the weight")
        return "; ".join(causes) or None

    return Traffic(ideal=ideal, top=top, explain_ops=explain)
