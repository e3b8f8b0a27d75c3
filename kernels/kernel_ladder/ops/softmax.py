"""Softmax and log-softmax over any dim, forward and backward, as ``kernel_ladder::softmax`` and
``kernel_ladder::log_softmax``.

``softmax(x)_i = exp(x_i - m) / s`` and ``log_softmax(x)_i = (x_i - m) - log(s)``, with
``m = max_j x_j`` and ``s = sum_j exp(x_j - m)``: subtracting the row maximum keeps every ``exp``
in (0, 1], so no magnitude that float32 can hold overflows (``x = ±1e38`` is fine). Everything is
computed in float32 whatever the storage dtype.

Two forward kernels, chosen per row length by :func:`softmax_launch_config`:

* :func:`softmax_kernel` holds a whole row in registers (one block of ``next_power_of_2(n_cols)``
  columns, up to :data:`MAX_BLOCK`), and packs several short rows into one program
  (``BLOCK_ROWS``) so that every program has enough work. It reads ``x`` once and writes
  ``y`` once: exactly the ideal traffic.
* :func:`softmax_online_kernel` takes rows longer than that in chunks of ``ONLINE_BLOCK``
  columns. A first pass keeps, per lane, a running maximum and a running sum rescaled whenever the
  maximum grows (``s <- s * exp(m_old - m_new) + exp(x - m_new)``; the "online softmax" of
  Milakov & Gimelshein, 2018, arXiv:1805.02867), so one pass gives both statistics; a second pass
  writes the output. It reads ``x`` twice: ``3 * n`` element-bytes against the ideal ``2 * n`` —
  **1.5x the ideal bytes** for equal input and output dtypes (fp32 in and out: 12 bytes per
  element instead of 8). The output can only be written once the statistics of the whole row are
  known, and a row this long does not fit on chip, so the second read cannot be avoided in
  general; the second pass walks the chunks in reverse, so on a GPU its first reads hit what the
  first pass left in L2 (the tracer counts loads, not cache hits: it shows 1.5x).

The backward uses the saved output ``y``: softmax ``dx = y * (dy - sum(dy * y))``, log-softmax
``dx = dy - exp(y) * sum(dy)``. :func:`softmax_backward_kernel` (one block per row) reads ``y`` and
``dy`` once and writes ``dx`` once (ideal); :func:`softmax_backward_online_kernel` (long rows)
first accumulates the sum, then writes ``dx``: softmax reads ``y`` and ``dy`` twice (5/3 = 1.67x the
ideal), log-softmax reads ``dy`` twice and ``y`` once (4/3 = 1.33x).

**How long a row the one-block backward takes.** It must hold ``y`` and ``dy`` of the whole row
across the reduction. It keeps them in registers in their *storage* dtype and converts each element
to float32 where it is used, so a program holds ``2 * itemsize`` bytes per column: 128 KiB at
32768 columns of bf16 or fp16 — the same as the forward's fp32 row at 32768 — and at 16384
columns of fp32. (ptxas, sm_90, 32 warps: 63-64 registers a thread and no spills at both limits;
``tests/aot/softmax.py`` checks every variant.) For that the compiler must not keep float32 copies
of ``y`` and ``dy`` from the reduction for the final product (it did: 48 bytes a thread spilled at
32768 bf16 columns), so the kernel decodes them a second time after the reduction, through a form
the compiler cannot merge with the first (:func:`_decode_after`: the 16-bit pattern OR-ed with
``isnan(sum)``, which leaves every value as it is — a row whose sum is NaN gives NaN either way).
fp32 rows of 16385-32768 columns stay online: ``y`` and ``dy`` would take 256 KiB, the whole
register file of an SM. So at 32768 columns the bf16/fp16 backward moves exactly the ideal bytes
(it moved 1.67x before), fp32 still 1.67x.

Layouts are honoured without copies: the reduced ``dim`` is moved last (a view) and the rows are
planned by :func:`kernel_ladder._rows.plan_rows`. When the rows, not the columns, are contiguous in
memory (a softmax over a dim that is not the innermost, e.g. the channels of an NCHW tensor), the
tile's threads run along the rows, and a program takes a 32-byte sector's worth of rows when the
tile has room, so that no sector is fetched for a fraction of its bytes. (This needs the tile's
rows to be one run of memory: one leading dim, or an innermost leading size that is a multiple of
``BLOCK_ROWS``; otherwise row starts are computed per row and the compiler cannot see the
contiguity.) The output is a new contiguous tensor whatever ``x``'s layout, as torch's is.

Rows that are entirely ``-inf`` give NaN, as torch does (``exp(-inf - -inf)``), in both kernels and
both ops; rows with some ``-inf`` entries give exact zeros (softmax) and ``-inf`` (log-softmax) there.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._rows import RowConfig, plan_rows, row_start
from .._validate import FLOAT_DTYPES, check_float_dtype, check_same_device, check_same_shape, check_tensor

__all__ = [
    "MAX_BLOCK",
    "ONLINE_BLOCK",
    "ROW_TILE",
    "log_softmax",
    "softmax",
    "softmax_backward_kernel",
    "softmax_backward_online_kernel",
    "softmax_kernel",
    "softmax_launch_config",
    "softmax_online_kernel",
]

#: The most 32-bit registers' worth of tile data a one-block program keeps: the forward's row in
#: float32, or the backward's row of ``y`` and of ``dy`` in their storage dtypes (so 16384 columns
#: of fp32, 32768 of bf16/fp16). 32768 words are 128 KiB, half an H100/H200 SM's register file;
#: with 32 warps (1024 threads) that is 32 words per thread, inside the 64 registers per thread a
#: 1024-thread program may use (ptxas: 63-64 registers, no spills, for the forward at 32768 and
#: the backward at its two limits; ``tests/aot/softmax.py``). An fp32 backward at 32768 spills.
MAX_BLOCK: int = 32768
#: Columns per chunk of the online kernels (rows longer than a block).
ONLINE_BLOCK: int = 4096
#: Elements a one-block program aims to hold: short rows are packed until a tile is this big.
ROW_TILE: int = 4096
#: float32 values per thread the launch config aims for: 32 for tiles along the columns; 16 when
#: the rows are contiguous (each element then needs its own 64-bit address, two more registers).
_VALUES_PER_THREAD = 32
_VALUES_PER_THREAD_TRANSPOSED = 16
#: Bytes of the DRAM/L2 transaction unit; a program over row-contiguous data takes a sector's rows.
_SECTOR_BYTES = 32

_NEG_INF = tl.constexpr(float("-inf"))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_rows(n_rows, size2, BLOCK_ROWS: tl.constexpr, LINEAR_ROWS: tl.constexpr):
    """This program's first row and the mask of its ``BLOCK_ROWS`` rows that exist.

    Plain tiles are rows ``pid * BLOCK_ROWS ..``. With ``LINEAR_ROWS`` a tile never crosses a run of the
    innermost leading dim (``size2`` rows that are one stride apart): the grid has
    ``cdiv(size2, BLOCK_ROWS)`` tiles per run, the last one of each run masked where it overhangs.
    """
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_ROWS)
    if LINEAR_ROWS:
        tiles_per_run = tl.cdiv(size2, BLOCK_ROWS)
        start = (pid % tiles_per_run) * BLOCK_ROWS  # position of the tile in its run
        first_row = (pid // tiles_per_run) * size2 + start
        row_ok = start + lanes < size2
    else:
        first_row = pid * BLOCK_ROWS
        row_ok = first_row + lanes < n_rows
    return first_row, row_ok


@triton.jit
def _tile_row_offsets(first_row, size1, size2, stride0, stride1, stride2,
                      BLOCK_ROWS: tl.constexpr, LINEAR_ROWS: tl.constexpr):
    """int64 memory offsets of rows ``first_row .. first_row + BLOCK_ROWS - 1``.

    With ``LINEAR_ROWS`` (no tile crosses a run of the innermost leading dim, see
    :func:`_tile_rows`) one row start is computed and the rest are ``+ k * stride2``: fewer integer
    divisions, and when ``stride2 == 1`` the compiler sees that the rows are contiguous and lays
    the tile's threads along them (coalesced accesses for a softmax over a non-innermost dim).
    """
    if LINEAR_ROWS:
        base = row_start(first_row, size1, size2, stride0, stride1, stride2)
        offsets = base + tl.arange(0, BLOCK_ROWS).to(tl.int64) * stride2
    else:
        offsets = row_start(first_row + tl.arange(0, BLOCK_ROWS), size1, size2, stride0, stride1, stride2)
    return offsets


@triton.jit
def softmax_kernel(
    x_ptr, y_ptr, n_rows, n_cols, size1, size2,
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    LOG: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    LINEAR_ROWS: tl.constexpr, INDEX_64: tl.constexpr,
):
    """y = softmax(x) (``LOG``: log_softmax) of BLOCK_ROWS whole rows, each in one block."""
    first_row, row_ok = _tile_rows(n_rows, size2, BLOCK_ROWS, LINEAR_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols = cols.to(tl.int64)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x_rows = _tile_row_offsets(first_row, size1, size2, stride_x0, stride_x1, stride_x2,
                               BLOCK_ROWS, LINEAR_ROWS)
    x = tl.load(x_ptr + (x_rows[:, None] + (cols * stride_xcol)[None, :]), mask=mask)
    # Padding columns are -inf (they add exp(-inf) = 0); padding rows are 0, so they compute
    # harmless numbers instead of NaN. A select after the upcast works for every dtype.
    fill = tl.where(row_ok, _NEG_INF, 0.0)
    x = tl.where(mask, x.to(tl.float32), fill[:, None])
    m = tl.max(x, axis=1)
    z = x - m[:, None]
    e = tl.exp(z)
    s = tl.sum(e, axis=1)
    if LOG:
        y = z - tl.log(s)[:, None]
    else:
        y = e * (1.0 / s)[:, None]
    y_rows = _tile_row_offsets(first_row, size1, size2, stride_y0, stride_y1, stride_y2,
                               BLOCK_ROWS, LINEAR_ROWS)
    tl.store(y_ptr + (y_rows[:, None] + (cols * stride_ycol)[None, :]), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_online_kernel(
    x_ptr, y_ptr, n_rows, n_cols, size1, size2,
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    LOG: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    LINEAR_ROWS: tl.constexpr, INDEX_64: tl.constexpr,
):
    """y = softmax(x) (``LOG``: log_softmax) of rows longer than a block, in BLOCK_COLS-column chunks.

    Pass 1 keeps a running maximum ``m`` and a sum ``s`` rescaled to it, per lane (no reduction
    inside the loop); the lanes are combined at the end. Pass 2 writes the output.
    """
    first_row, row_ok = _tile_rows(n_rows, size2, BLOCK_ROWS, LINEAR_ROWS)
    lanes = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        lanes = lanes.to(tl.int64)
    x_rows = _tile_row_offsets(first_row, size1, size2, stride_x0, stride_x1, stride_x2,
                               BLOCK_ROWS, LINEAR_ROWS)
    fill = tl.where(row_ok, _NEG_INF, 0.0)
    m_lane = tl.full((BLOCK_ROWS, BLOCK_COLS), _NEG_INF, tl.float32)
    s_lane = tl.zeros((BLOCK_ROWS, BLOCK_COLS), tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + lanes
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + (x_rows[:, None] + (cols * stride_xcol)[None, :]), mask=mask)
        x = tl.where(mask, x.to(tl.float32), fill[:, None])
        m_new = tl.maximum(m_lane, x)
        # A lane that has seen only -inf keeps m = -inf and s = 0; rescaling it by
        # exp(-inf - -inf) would make NaN, so it is rescaled against 0 instead (giving 0).
        m_ref = tl.where(m_new == _NEG_INF, 0.0, m_new)
        s_lane = s_lane * tl.exp(m_lane - m_ref) + tl.exp(x - m_ref)
        m_lane = m_new
    m = tl.max(m_lane, axis=1)
    m_ref = tl.where(m == _NEG_INF, 0.0, m)
    s = tl.sum(s_lane * tl.exp(m_lane - m_ref[:, None]), axis=1)
    # An all -inf row has m = -inf and s = 0: its output below is NaN (x - m), like torch's.
    # s = 1 there only spares log(0) and 1/0.
    s = tl.where(s == 0.0, 1.0, s)
    log_s = tl.log(s)
    inv_s = 1.0 / s
    y_rows = _tile_row_offsets(first_row, size1, size2, stride_y0, stride_y1, stride_y2,
                               BLOCK_ROWS, LINEAR_ROWS)
    n_chunks = tl.cdiv(n_cols, BLOCK_COLS)
    for i in range(0, n_chunks):
        # Last chunk first: on a GPU the chunks pass 1 read last are the likeliest still in L2.
        cols = (n_chunks - 1 - i) * BLOCK_COLS + lanes
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + (x_rows[:, None] + (cols * stride_xcol)[None, :]), mask=mask)
        x = tl.where(mask, x.to(tl.float32), fill[:, None])
        z = x - m[:, None]
        if LOG:
            y = z - log_s[:, None]
        else:
            y = tl.exp(z) * inv_s[:, None]
        tl.store(y_ptr + (y_rows[:, None] + (cols * stride_ycol)[None, :]), y.to(y_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _decode_after(v, total):
    """``v`` (loaded in its storage dtype) in float32, decoded anew after the reduction ``total``.

    For a 16-bit ``v`` the bits are OR-ed with ``isnan(total)`` first: 0 unless the row's sum is
    NaN, when every ``dx`` of the row is NaN whatever ``v`` is. The compiler cannot prove it is a
    no-op, so it keeps the 16-bit ``v`` alive across the reduction instead of the float32 copy it
    made for the reduction: half the registers (see the module docstring).
    """
    if v.dtype.primitive_bitwidth == 16:
        nan = (total != total).to(tl.int16)
        v = (v.to(tl.int16, bitcast=True) | nan).to(v.dtype, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def softmax_backward_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, size1, size2,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    stride_dy0, stride_dy1, stride_dy2, stride_dycol,
    stride_dx0, stride_dx1, stride_dx2, stride_dxcol,
    LOG: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    LINEAR_ROWS: tl.constexpr, INDEX_64: tl.constexpr,
):
    """dx from the saved output y and dy, BLOCK_ROWS whole rows per program.

    softmax: ``dx = y * (dy - sum(dy * y))``; ``LOG`` (y = log_softmax): ``dx = dy - exp(y) * sum(dy)``.
    ``y`` and ``dy`` stay in their storage dtype in registers; each use converts to float32.
    """
    first_row, row_ok = _tile_rows(n_rows, size2, BLOCK_ROWS, LINEAR_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols = cols.to(tl.int64)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    y_rows = _tile_row_offsets(first_row, size1, size2, stride_y0, stride_y1, stride_y2,
                               BLOCK_ROWS, LINEAR_ROWS)
    dy_rows = _tile_row_offsets(first_row, size1, size2, stride_dy0, stride_dy1, stride_dy2,
                                BLOCK_ROWS, LINEAR_ROWS)
    y = tl.load(y_ptr + (y_rows[:, None] + (cols * stride_ycol)[None, :]), mask=mask, other=0.0)
    dy = tl.load(dy_ptr + (dy_rows[:, None] + (cols * stride_dycol)[None, :]), mask=mask, other=0.0)
    if LOG:
        total = tl.sum(dy.to(tl.float32), axis=1)[:, None]
        dx = _decode_after(dy, total) - tl.exp(y.to(tl.float32)) * total
    else:
        total = tl.sum(dy.to(tl.float32) * y.to(tl.float32), axis=1)[:, None]
        dx = _decode_after(y, total) * (_decode_after(dy, total) - total)
    dx_rows = _tile_row_offsets(first_row, size1, size2, stride_dx0, stride_dx1, stride_dx2,
                                BLOCK_ROWS, LINEAR_ROWS)
    tl.store(dx_ptr + (dx_rows[:, None] + (cols * stride_dxcol)[None, :]), dx.to(dx_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def softmax_backward_online_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, size1, size2,
    stride_y0, stride_y1, stride_y2, stride_ycol,
    stride_dy0, stride_dy1, stride_dy2, stride_dycol,
    stride_dx0, stride_dx1, stride_dx2, stride_dxcol,
    LOG: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    LINEAR_ROWS: tl.constexpr, INDEX_64: tl.constexpr,
):
    """The backward for rows longer than a block: pass 1 sums ``dy * y`` (``LOG``: ``dy``), pass 2 writes dx."""
    first_row, row_ok = _tile_rows(n_rows, size2, BLOCK_ROWS, LINEAR_ROWS)
    lanes = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        lanes = lanes.to(tl.int64)
    y_rows = _tile_row_offsets(first_row, size1, size2, stride_y0, stride_y1, stride_y2,
                               BLOCK_ROWS, LINEAR_ROWS)
    dy_rows = _tile_row_offsets(first_row, size1, size2, stride_dy0, stride_dy1, stride_dy2,
                                BLOCK_ROWS, LINEAR_ROWS)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + lanes
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        dy = tl.load(dy_ptr + (dy_rows[:, None] + (cols * stride_dycol)[None, :]), mask=mask)
        dy = tl.where(mask, dy.to(tl.float32), 0.0)
        if LOG:
            acc += dy
        else:
            y = tl.load(y_ptr + (y_rows[:, None] + (cols * stride_ycol)[None, :]), mask=mask)
            acc += dy * tl.where(mask, y.to(tl.float32), 0.0)
    total = tl.sum(acc, axis=1)
    dx_rows = _tile_row_offsets(first_row, size1, size2, stride_dx0, stride_dx1, stride_dx2,
                                BLOCK_ROWS, LINEAR_ROWS)
    n_chunks = tl.cdiv(n_cols, BLOCK_COLS)
    for i in range(0, n_chunks):
        cols = (n_chunks - 1 - i) * BLOCK_COLS + lanes  # reverse order: L2 still holds the last chunks
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        y = tl.load(y_ptr + (y_rows[:, None] + (cols * stride_ycol)[None, :]), mask=mask)
        dy = tl.load(dy_ptr + (dy_rows[:, None] + (cols * stride_dycol)[None, :]), mask=mask)
        y = tl.where(mask, y.to(tl.float32), 0.0)
        dy = tl.where(mask, dy.to(tl.float32), 0.0)
        if LOG:
            dx = dy - tl.exp(y) * total[:, None]
        else:
            dx = y * (dy - total[:, None])
        tl.store(dx_ptr + (dx_rows[:, None] + (cols * stride_dxcol)[None, :]), dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


def softmax_launch_config(
    n_cols: int, dtype: torch.dtype, *, n_rows: int | None = None, transposed: bool = False,
    backward: bool = False, grad_dtype: torch.dtype | None = None,
) -> RowConfig:
    """The kernel configuration for rows of ``n_cols`` elements of ``dtype``.

    The rule (``block = next_power_of_2(n_cols)``):

    * **One block per row** when the tile's data fit :data:`MAX_BLOCK` 32-bit registers: the
      forward holds its row in float32 (4 bytes a column), the backward ``y`` and ``dy`` in their
      storage dtypes (4 bytes a column for bf16/fp16, 8 for fp32; 8 for every dtype when
      ``transposed``). So rows up to 32768 columns (forward; backward in bf16/fp16) and 16384
      (backward in fp32) stay in registers. Short rows
      are then packed until a program holds :data:`ROW_TILE` elements (``block_rows = ROW_TILE //
      block``), never more rows than there are (``n_rows``, if given).
    * **Online** otherwise, in chunks of :data:`ONLINE_BLOCK` columns (the forward keeps three
      lane arrays: running max, running sum, the chunk).
    * **Warps**: enough for about 32 registers of tile data per thread (4 to 32 warps: a
      4096-column fp32 tile gets 4, 32768 gets 32); 16 when ``transposed``. An online chunk of
      4096 gets 8.
    * ``transposed``: the rows, not the columns, are contiguous in memory (a softmax over a dim
      that is not the innermost). The tile's threads then run along the rows, and a program takes
      at least ``32 bytes / itemsize`` rows (8 for float32, 16 for 16-bit dtypes) so that each
      column of the tile fills whole 32-byte sectors.

    Args:
        n_cols: length of a row (the softmax dim).
        dtype: the storage dtype (float32, float16 or bfloat16) of ``x`` (forward) or ``y``
            (backward); it sets the rows per sector.
        n_rows: number of rows, if known (caps ``block_rows``).
        transposed: see above.
        backward: the configuration of the backward kernels.
        grad_dtype: the backward's ``dy`` dtype (default: ``dtype``).

    Returns:
        A :class:`kernel_ladder._rows.RowConfig`: ``block_cols`` columns a load, ``block_rows`` rows a
        program (``rows_per_program`` is the same: one tile a program), ``chunked`` for the online
        kernels, ``num_warps``.
    """
    # Cached: a pure function of its arguments and this module's limits (passed, so in the key).
    return _softmax_config(n_cols, dtype, n_rows, transposed, backward, grad_dtype, MAX_BLOCK, ONLINE_BLOCK, ROW_TILE)


@_launch.shape_cache
def _softmax_config(n_cols, dtype, n_rows, transposed, backward, grad_dtype, max_block, online_block, row_tile
                    ) -> RowConfig:
    op = "kernel_ladder.softmax_launch_config"
    if isinstance(n_cols, bool) or not isinstance(n_cols, numbers.Integral) or n_cols < 0:
        raise ValueError(f"{op}: n_cols must be a non-negative int, got {n_cols!r}")
    for name, value in (("dtype", dtype), ("grad_dtype", dtype if grad_dtype is None else grad_dtype)):
        if value not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be torch.float32, torch.float16 or torch.bfloat16, got {value!r}")
    if n_rows is not None and (isinstance(n_rows, bool) or not isinstance(n_rows, numbers.Integral) or n_rows < 0):
        raise ValueError(f"{op}: n_rows must be a non-negative int or None, got {n_rows!r}")
    # Bytes a one-block program keeps per column: the forward's float32 row, the backward's y and dy
    # (counted as fp32 when transposed: each element then needs its own 64-bit address, which
    # 16-bit storage does not shrink; ptxas spills 16-bit tiles of twice the rows).
    if backward:
        col_bytes = 8 if transposed else dtype.itemsize + (grad_dtype or dtype).itemsize
    else:
        col_bytes = 4
    per_thread = _VALUES_PER_THREAD_TRANSPOSED if transposed else _VALUES_PER_THREAD
    capacity = 4 * max_block * per_thread // _VALUES_PER_THREAD  # bytes of tile data a program may keep
    sector_rows = _SECTOR_BYTES // dtype.itemsize if transposed else 1
    row_cap = next_power_of_2(n_rows) if n_rows is not None else None
    block = next_power_of_2(n_cols)
    if block * col_bytes <= capacity:
        fit = 1 << (capacity // (block * col_bytes)).bit_length() - 1  # a power of two
        rows = min(max(row_tile // block, sector_rows), fit)
        if row_cap is not None:
            rows = min(rows, row_cap)
        words = next_power_of_2(block * rows * col_bytes // 4)  # 32-bit registers of tile data
        warps = _launch.num_warps_for(words, per_thread, max_warps=32)
        return RowConfig(block_cols=block, block_rows=rows, chunked=False, num_warps=warps, rows_per_program=rows)
    rows = sector_rows if row_cap is None else min(sector_rows, row_cap)
    chunk = max(1, min(online_block // rows, block))
    warps = _launch.num_warps_for(chunk * rows, 16, max_warps=32)
    return RowConfig(block_cols=chunk, block_rows=rows, chunked=True, num_warps=warps, rows_per_program=rows)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _rows_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A view of ``t`` whose last dim is the softmax dim (a 0-d tensor becomes one row of one)."""
    return t.reshape(1) if t.dim() == 0 else t.movedim(dim, -1)


def _launch_rows(forward: bool, operands: list[torch.Tensor], log: bool) -> None:
    """Launch the forward (x, y) or backward (y, dy, dx) kernels over every row of ``operands``."""
    dtype = operands[0].dtype  # x or y
    grad_dtype = None if forward else operands[1].dtype
    for launch in plan_rows(operands):
        s0, s1, s2, col = launch.strides[:4]  # the first operand (x or y) decides the layout
        size1, size2 = launch.sizes
        # Rows contiguous in memory, columns not: tiles must run along the rows (LINEAR_ROWS) to
        # be coalesced, so their block_rows is capped by the run length, size2.
        transposed = col != 1 and s2 == 1 and size2 > 1
        config = softmax_launch_config(launch.n_cols, dtype, n_rows=size2 if transposed else launch.n_rows,
                                       transposed=transposed, backward=not forward, grad_dtype=grad_dtype)
        rows = config.block_rows
        # Linear tiles cost nothing extra when runs are whole tiles (or there is one run).
        linear_rows = transposed or size2 % rows == 0 or size2 == launch.n_rows
        if linear_rows:
            tiles = (launch.n_rows // size2) * _launch.cdiv(size2, rows)
        else:
            tiles = _launch.cdiv(launch.n_rows, rows)
        if forward:
            kernel = softmax_online_kernel if config.chunked else softmax_kernel
        else:
            kernel = softmax_backward_online_kernel if config.chunked else softmax_backward_kernel
        kernel[(tiles,)](
            *launch.tensors, *launch.args(),
            LOG=log, BLOCK_COLS=config.block_cols, BLOCK_ROWS=rows, LINEAR_ROWS=linear_rows,
            INDEX_64=launch.index_64, num_warps=config.num_warps,
        )


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _normalize_dim(op: str, dim: object, x: torch.Tensor) -> int:
    """``dim`` as an index in ``[0, rank)`` (a 0-d tensor has one dim, like in torch)."""
    if isinstance(dim, bool) or not isinstance(dim, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    dim = int(dim)
    rank = max(x.dim(), 1)
    if not -rank <= dim < rank:
        raise ValueError(
            f"{op}: dim must be in [{-rank}, {rank - 1}] for x of shape {tuple(x.shape)}, got {dim} "
            f"(negative dims count from the end)"
        )
    return dim % rank


def _check_dtype_arg(op: str, dtype: object) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: dtype must be torch.float32, torch.float16, torch.bfloat16 or None (x's dtype), got {dtype}"
        )


def _check_forward_args(op: str, x: object, dim: object, dtype: object) -> int:
    check_tensor(op, "x", x)
    check_float_dtype(op, "x", x)
    _check_dtype_arg(op, dtype)
    return _normalize_dim(op, dim, x)


def _check_backward_args(op: str, grad_out: object, out: object, dim: object, input_dtype: object) -> int:
    check_tensor(op, "grad_out", grad_out)
    check_tensor(op, "out", out)
    check_float_dtype(op, "grad_out", grad_out)
    check_float_dtype(op, "out", out)
    check_same_shape(op, "grad_out", grad_out, "out", out)
    check_same_device(op, "grad_out", grad_out, "out", out)
    if input_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: input_dtype must be float32, float16 or bfloat16, got {input_dtype}")
    return _normalize_dim(op, dim, out)


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------


def _forward(op: str, x: torch.Tensor, dim: int, dtype: torch.dtype | None, log: bool) -> torch.Tensor:
    dim = _check_forward_args(op, x, dim, dtype)
    runtime.require_launchable(op, x)
    out_dtype = dtype or x.dtype
    y = _launch.empty_output(x.shape, x, out_dtype)
    _launch_rows(True, [_rows_view(x, dim), _rows_view(y, dim)], log)
    return y


def _backward(op: str, grad_out: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype,
              log: bool) -> torch.Tensor:
    dim = _check_backward_args(op, grad_out, out, dim, input_dtype)
    runtime.require_launchable(op, grad_out, out)
    grad_in = _launch.empty_output(out.shape, out, input_dtype)
    _launch_rows(False, [_rows_view(t, dim) for t in (out, grad_out, grad_in)], log)
    return grad_in


@torch.library.custom_op("kernel_ladder::softmax", mutates_args=())
def _softmax_op(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _forward("kernel_ladder.softmax", x, dim, dtype, log=False)


@_softmax_op.register_fake
def _softmax_fake(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    _check_forward_args("kernel_ladder.softmax", x, dim, dtype)
    return _launch.empty_output(x.shape, x, dtype or x.dtype)


@torch.library.custom_op("kernel_ladder::log_softmax", mutates_args=())
def _log_softmax_op(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _forward("kernel_ladder.log_softmax", x, dim, dtype, log=True)


@_log_softmax_op.register_fake
def _log_softmax_fake(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    _check_forward_args("kernel_ladder.log_softmax", x, dim, dtype)
    return _launch.empty_output(x.shape, x, dtype or x.dtype)


@torch.library.custom_op("kernel_ladder::softmax_backward", mutates_args=())
def _softmax_backward_op(grad_out: torch.Tensor, out: torch.Tensor, dim: int,
                         input_dtype: torch.dtype) -> torch.Tensor:
    return _backward("kernel_ladder.softmax (backward)", grad_out, out, dim, input_dtype, log=False)


@_softmax_backward_op.register_fake
def _softmax_backward_fake(grad_out: torch.Tensor, out: torch.Tensor, dim: int,
                           input_dtype: torch.dtype) -> torch.Tensor:
    _check_backward_args("kernel_ladder.softmax (backward)", grad_out, out, dim, input_dtype)
    return _launch.empty_output(out.shape, out, input_dtype)


@torch.library.custom_op("kernel_ladder::log_softmax_backward", mutates_args=())
def _log_softmax_backward_op(grad_out: torch.Tensor, out: torch.Tensor, dim: int,
                             input_dtype: torch.dtype) -> torch.Tensor:
    return _backward("kernel_ladder.log_softmax (backward)", grad_out, out, dim, input_dtype, log=True)


@_log_softmax_backward_op.register_fake
def _log_softmax_backward_fake(grad_out: torch.Tensor, out: torch.Tensor, dim: int,
                               input_dtype: torch.dtype) -> torch.Tensor:
    _check_backward_args("kernel_ladder.log_softmax (backward)", grad_out, out, dim, input_dtype)
    return _launch.empty_output(out.shape, out, input_dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, dim, _ = inputs
    ctx.save_for_backward(output)  # the backward needs only the output
    ctx.dim = dim
    ctx.input_dtype = x.dtype


def _softmax_backward(ctx, grad_out: torch.Tensor):
    (out,) = ctx.saved_tensors
    return _softmax_backward_op(grad_out, out, ctx.dim, ctx.input_dtype), None, None


def _log_softmax_backward(ctx, grad_out: torch.Tensor):
    (out,) = ctx.saved_tensors
    return _log_softmax_backward_op(grad_out, out, ctx.dim, ctx.input_dtype), None, None


_softmax_op.register_autograd(_softmax_backward, setup_context=_setup_context)
_log_softmax_op.register_autograd(_log_softmax_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _schema_types(x: object, dim: object, dtype: object) -> bool:
    """Whether the op's schema takes these types; the op itself checks the values (kernel_ladder._validate's rule)."""
    return (isinstance(x, torch.Tensor) and isinstance(dim, int) and not isinstance(dim, bool)
            and (dtype is None or isinstance(dtype, torch.dtype)))


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax of ``x`` along ``dim``, like ``torch.nn.functional.softmax(x, dim, dtype=dtype)``.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (read in place, not copied).
        dim: the dim to normalize over; negative counts from the end.
        dtype: the output's dtype (float32, float16 or bfloat16); ``None`` keeps ``x``'s. Unlike
            torch, which casts ``x`` first, ``x`` is read in its own dtype and computed in float32.

    Returns:
        A new contiguous tensor of ``x``'s shape (torch's layout too), computed in
        float32. Rows that are all ``-inf`` give NaN, like torch. Differentiable; the backward
        (``kernel_ladder::softmax_backward``) uses only the saved output.
    """
    if not _schema_types(x, dim, dtype):
        _check_forward_args("kernel_ladder.softmax", x, dim, dtype)
    return _softmax_op(x, dim, dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-softmax of ``x`` along ``dim``, like ``torch.nn.functional.log_softmax(x, dim, dtype=dtype)``.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (read in place, not copied).
        dim: the dim to normalize over; negative counts from the end.
        dtype: the output's dtype (float32, float16 or bfloat16); ``None`` keeps ``x``'s.

    Returns:
        A new contiguous tensor of ``x``'s shape (torch's layout too), computed in
        float32 as ``(x - max) - log(sum(exp(x - max)))``. Rows that are all ``-inf`` give NaN,
        like torch. Differentiable; the backward (``kernel_ladder::log_softmax_backward``) uses only
        the saved output.
    """
    if not _schema_types(x, dim, dtype):
        _check_forward_args("kernel_ladder.log_softmax", x, dim, dtype)
    return _log_softmax_op(x, dim, dtype)
