"""Pieces shared by the normalization ops: the launch rule, the column reduction, the checks.

``rms_norm``, ``layer_norm`` and ``add_rms_norm`` are row ops (:mod:`kernel_ladder._rows`): the
normalized trailing dims, merged into one column stride, form a row of ``N`` columns; every other
index is a row. Their kernels share one shape of work, chosen here by :func:`norm_launch_config`:

* **A tile** is ``BLOCK_ROWS x BLOCK_COLS`` elements: ``BLOCK_COLS`` (a power of two) holds a
  whole row up to :data:`MAX_FUSED_BLOCK` columns (the *fused* path: a row is loaded once, reduced and normalized
  from registers). ``BLOCK_ROWS`` rows share the tile when rows are short, so that every iteration
  moves about :data:`TILE_ELEMENTS` elements. Longer rows take the *chunked* path: one row at a
  time, in chunks of :data:`CHUNK_BLOCK` columns, a statistics pass and then an output pass (the
  row is read twice; a GPU serves the second read mostly from L2).
* **Rows per program.** A program walks a contiguous group of ``rows_per_program`` rows, tile by
  tile, loading the weight (and bias) once for all of them. The rule::

      n_tiles           = ceil(n_rows / BLOCK_ROWS)
      tiles_per_program = ceil(n_tiles / (PROGRAMS_PER_SM * SMs))       # fill the GPU first
      forward only:       floor = min(ceil(MIN_FORWARD_ROWS_PER_PARAM * params / BLOCK_ROWS),
                                      max(1, n_tiles // SMs))                # >= 1 program per SM
                          tiles_per_program = max(tiles_per_program, floor)
                          tiles_per_program = min(tiles_per_program,
                                                  max(1, FORWARD_ROWS_PER_PROGRAM // BLOCK_ROWS))
      rows_per_program  = BLOCK_ROWS * tiles_per_program
      n_programs        = ceil(n_rows / rows_per_program)

  *Filling*: whenever there are enough tiles, every SM gets :data:`PROGRAMS_PER_SM` (2)
  programs, so one program's reductions overlap another's loads. *The backward* stops there: at
  most ``2 * SMs`` programs, each of which sums its rows' weight-gradient contributions in float32
  registers and writes them as one row of a ``(n_programs, N)`` partial buffer. The buffer is
  then at most 264 rows on an H200 (264 x N x 4 bytes, about 4 MB for N = 4096, against 64 MB
  for one bf16 tensor of 8192 x 4096), so :func:`column_sum_kernel`, the second stage, reads
  little; no two programs write the same address (no atomics, a deterministic result), and
  programs of equal work over exactly two per SM leave no ragged last wave. *The forward* has no
  buffer to bound, so large launches are cut finer — at most :data:`FORWARD_ROWS_PER_PROGRAM`
  rows a program, many programs for the hardware to balance. Mid-sized launches are cut no finer
  than :data:`MIN_FORWARD_ROWS_PER_PARAM` (16) rows per parameter vector a program reads
  (``params``: 1 for RMSNorm's weight, 2 for LayerNorm's weight and bias), as long as every SM
  still gets a program. Each program loads the parameters once, so with ``r`` rows a program
  their re-reads add ``params / (2 r)`` to the ideal traffic of x and y: 1/32 (3%) at the floor.
  On a GPU the re-reads are L2 hits, which is why filling every SM wins over the floor; the
  floor keeps the global traffic the tracer counts within 5% of the ideal wherever the launch
  has at least ``16 * params`` rows per SM (the CPU's sizes included), at no cost in occupancy.

  Triton's interpreter acts as a GPU of :data:`kernel_ladder._launch.INTERPRETER_SMS` SMs, so the CPU runs the same
  multi-program reduction with few program instances.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _launch
from .._launch import next_power_of_2
from .._rows import RowConfig, RowLaunch, merge_trailing, plan_rows
from .._validate import check_float_dtype, check_same_device, check_same_dtype, check_tensor

__all__ = [
    "CASTINGS",
    "CHUNK_BLOCK",
    "FORWARD_ROWS_PER_PROGRAM",
    "MIN_FORWARD_ROWS_PER_PARAM",
    "MAX_FUSED_BLOCK",
    "MAX_FUSED_BLOCK_BACKWARD",
    "PROGRAMS_PER_SM",
    "program_rows",
    "TILE_ELEMENTS",
    "column_sum",
    "column_sum_kernel",
    "launch_norm",
    "norm_launch_config",
    "plan_norm",
]

#: Longest row the forward keeps in registers whole (one load of x per element).
MAX_FUSED_BLOCK: int = 16384
#: The backward holds more per column (x, dy, the weight, one or two gradient accumulators), so
#: its fused path stops earlier: compiled for sm_90 at 16384 columns and 16 warps, ptxas spills
#: (232 bytes of stack a thread for RMSNorm, 400 for LayerNorm); at 8192 it fits in registers.
MAX_FUSED_BLOCK_BACKWARD: int = 8192
#: Columns per chunk on the chunked (long-row) path.
CHUNK_BLOCK: int = 4096
#: Elements a tile aims at: short rows are stacked BLOCK_ROWS high up to this many elements.
TILE_ELEMENTS: int = 4096
#: Programs per streaming multiprocessor when there are enough rows (see the module docstring).
PROGRAMS_PER_SM: int = 2
#: The forward's largest share of rows per program (once the GPU is full).
FORWARD_ROWS_PER_PROGRAM: int = 32
#: The forward's smallest share of rows per program, per parameter vector (weight, bias) it reads.
MIN_FORWARD_ROWS_PER_PARAM: int = 16


# ----------------------------------------------------------------------------------------------
# The second stage of the weight/bias gradient
# ----------------------------------------------------------------------------------------------


@triton.jit
def column_sum_kernel(
    partial_ptr, out_ptr, n_partials, n_cols, out_stride,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``out[c] = sum_p partial[p, c]`` for BLOCK_N columns; partial is a contiguous fp32 (P, N).

    Each program owns a strip of columns and walks all P partial rows, BLOCK_P at a time,
    accumulating in float32; the result is rounded once, to ``out``'s dtype (the weight's).
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, n_partials, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols * out_stride, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def column_sum(partial: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The column sums of a contiguous fp32 ``(P, N)`` buffer, as a new tensor of ``shape``/``dtype``."""
    n_partials, n_cols = partial.shape
    out = _launch.empty(shape, dtype, partial.device)
    if n_cols == 0:
        return out
    if n_partials == 0:
        return out.zero_()
    sms = _launch.num_sms(partial.device)
    # Enough column strips to give every SM one (at least 32 columns: a full sector of fp32 each
    # row), and partial rows stacked up to TILE_ELEMENTS per iteration.
    block_n = min(1024, max(32, next_power_of_2(_launch.cdiv(n_cols, sms))))
    block_p = max(1, min(next_power_of_2(n_partials), TILE_ELEMENTS // block_n))
    grid = (_launch.cdiv(n_cols, block_n),)
    column_sum_kernel[grid](partial, out, n_partials, n_cols, 1, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------------
# The launch rule
# ----------------------------------------------------------------------------------------------


@triton.jit
def program_rows(n_rows, rows_per_program, BLOCK_COLS: tl.constexpr, INDEX_64: tl.constexpr):
    """This program's id, its first row, how many rows it has, and the column offsets of a block."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    row0 = pid * rows_per_program
    n_here = tl.minimum(rows_per_program, n_rows - row0)
    cols = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols = cols.to(tl.int64)
    return pid, row0, n_here, cols


def norm_launch_config(
    n_rows: int, n_cols: int, device: torch.device | str = "cpu", *, backward: bool = False, params: int = 1
) -> RowConfig:
    """The tile and rows-per-program of a norm over ``n_rows`` rows of ``n_cols`` columns.

    ``params`` is the number of parameter vectors (weight, bias) each program of the forward reads.
    The launch has ``config.programs(n_rows)`` programs. Cached: the key holds every input of the
    choice (the device's SM count and this module's tile limits included), so a changed limit is
    never answered from the cache.
    """
    return _norm_config(n_rows, n_cols, _launch.num_sms(torch.device(device)), backward, params, MAX_FUSED_BLOCK,
                        MAX_FUSED_BLOCK_BACKWARD, CHUNK_BLOCK, TILE_ELEMENTS, PROGRAMS_PER_SM,
                        FORWARD_ROWS_PER_PROGRAM, MIN_FORWARD_ROWS_PER_PARAM)


@_launch.shape_cache
def _norm_config(n_rows, n_cols, sms, backward, params, max_fused, max_fused_backward, chunk_block, tile_elements,
                 programs_per_sm, forward_rows_per_program, min_forward_rows_per_param) -> RowConfig:
    max_fused = max_fused_backward if backward else max_fused
    chunked = n_cols > max_fused
    block = chunk_block if chunked else next_power_of_2(n_cols)
    tile_rows = 1 if chunked else max(1, min(tile_elements // block, next_power_of_2(n_rows)))
    n_tiles = max(1, _launch.cdiv(n_rows, tile_rows))
    tiles_per_program = _launch.cdiv(n_tiles, programs_per_sm * sms)
    if not backward:
        floor = min(_launch.cdiv(min_forward_rows_per_param * params, tile_rows), max(1, n_tiles // sms))
        tiles_per_program = max(tiles_per_program, floor)
        tiles_per_program = min(tiles_per_program, max(1, forward_rows_per_program // tile_rows))
    rows_per_program = tile_rows * tiles_per_program
    return RowConfig(block_cols=block, block_rows=tile_rows, chunked=chunked,
                     num_warps=_launch.num_warps_for(tile_rows * block), rows_per_program=rows_per_program)


@dataclass(frozen=True)
class NormPlan:
    """The launches of one norm op: the row slices, each one's config, and program offsets."""

    launches: tuple[RowLaunch, ...]
    configs: tuple[RowConfig, ...]
    program_offsets: tuple[int, ...]  # each launch's first row in a (n_programs, N) partial buffer
    n_programs: int  # over all launches


def plan_norm(
    row_operands: Sequence[torch.Tensor], reduce_ndim: int, *, backward: bool = False, params: int = 1
) -> NormPlan:
    """Plan a norm over ``row_operands`` (same shape), normalizing their last ``reduce_ndim`` dims.

    ``params``: how many parameter vectors (weight, bias) the forward kernel loads per program.
    """
    launches = tuple(plan_rows(row_operands, reduce_ndim))
    device = row_operands[0].device
    configs = tuple(
        norm_launch_config(rl.n_rows, rl.n_cols, device, backward=backward, params=params) for rl in launches
    )
    offsets, total = [], 0
    for launch, config in zip(launches, configs):
        offsets.append(total)
        total += config.programs(launch.n_rows)
    return NormPlan(launches, configs, tuple(offsets), total)


def launch_norm(
    kernel,
    plan: NormPlan,
    params: Sequence[tuple[torch.Tensor | None, int]],
    per_row: Sequence[torch.Tensor] = (),
    partials: Sequence[torch.Tensor] = (),
    scalars: Sequence[object] = (),
    **constexprs: object,
) -> None:
    """Launch ``kernel`` once per planned slice, in the norm kernels' argument convention::

        kernel(<row operands>, <params>, <per-row tensors>, <partial buffers>, <scalars>,
               n_rows, n_cols, size1, size2, <row operand strides>, <param column strides>,
               rows_per_program, <constexprs>, BLOCK_ROWS, BLOCK_COLS, CHUNKED, INDEX_64)

    ``params`` are (tensor or None, column stride) pairs: weight/bias, read once per program; a
    missing one is replaced by a dummy pointer that the kernel never loads (its ``HAS_*``
    constexpr is off). ``per_row`` tensors (the statistics, a scratch) are indexed by the row's
    global index, so each slice gets a view starting at its first row; ``partials`` are
    ``(n_programs, N)`` buffers, each slice getting the rows of its programs.
    """
    for launch, config, offset in zip(plan.launches, plan.configs, plan.program_offsets):
        dummy = launch.tensors[0]
        param_ptrs = [dummy if p is None else p for p, _ in params]
        param_strides = [0 if p is None else stride for p, stride in params]
        rows = [t[launch.row_base :] for t in per_row]
        parts = [t[offset:] for t in partials]
        index_64 = launch.index_64 or _launch.needs_int64(launch.n_rows + config.rows_per_program)
        kernel[(config.programs(launch.n_rows),)](
            *launch.tensors, *param_ptrs, *rows, *parts, *scalars, *launch.args(), *param_strides,
            config.rows_per_program, **constexprs,
            BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, CHUNKED=config.chunked, INDEX_64=index_64,
            num_warps=config.num_warps,
        )


# ----------------------------------------------------------------------------------------------
# Input checks (shared by the public functions and the fake kernels)
# ----------------------------------------------------------------------------------------------


def check_eps(op: str, eps: object) -> float:
    """``eps`` must be a finite real number > 0; returns it as a float."""
    # torch.compile(dynamic=True) passes a Python float that it has made dynamic as a SymFloat.
    if isinstance(eps, bool) or not isinstance(eps, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{op}: eps must be a positive float, got {type(eps).__name__}")
    value = float(eps)
    if not 0.0 < value < math.inf:  # comparisons, not math.isfinite: they also trace on a SymFloat
        raise ValueError(f"{op}: eps must be a finite number > 0, got {value}")
    return value


#: The RMSNorm casting modes: the order of roundings of Hugging Face's RMSNorm modules.
CASTINGS: tuple[str, ...] = ("none", "llama", "gemma")


def check_casting(op: str, casting: object) -> bool:
    """``casting`` is one of :data:`CASTINGS`; returns whether ``x * rstd`` is rounded before the scale."""
    if not isinstance(casting, str):
        raise TypeError(f"{op}: casting must be a str, one of {CASTINGS}, got {type(casting).__name__}")
    if casting not in CASTINGS:
        raise ValueError(f"{op}: casting must be one of {CASTINGS}, got {casting!r}")
    return casting == "llama"


def check_offset(op: str, offset: object, weight: object) -> float:
    """``offset`` is a finite real number, and 0 unless there is a weight for it to shift."""
    if isinstance(offset, bool) or not isinstance(offset, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{op}: offset must be a float, got {type(offset).__name__}")
    value = float(offset)
    if not -math.inf < value < math.inf:
        raise ValueError(f"{op}: offset must be a finite number, got {value}")
    if weight is None and value != 0.0:
        raise ValueError(
            f"{op}: offset={value} needs a weight: the output is scaled by (offset + weight), and "
            "weight=None means no scale at all; pass the weight (Gemma's are stored as w, applied as 1 + w)"
        )
    return value


def check_flag(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
    return value


def check_normalized_shape(op: str, normalized_shape: object) -> tuple[int, ...]:
    """``normalized_shape`` is an int or a non-empty sequence of non-negative ints."""
    # torch.compile(dynamic=True) passes sizes taken from a tensor's shape as SymInts.
    integer = (numbers.Integral, torch.SymInt)
    if isinstance(normalized_shape, integer) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if not isinstance(normalized_shape, Sequence) or isinstance(normalized_shape, str):
        raise TypeError(
            f"{op}: normalized_shape must be an int or a sequence of ints, got {type(normalized_shape).__name__}"
        )
    dims = []
    for size in normalized_shape:
        if isinstance(size, bool) or not isinstance(size, integer):
            raise TypeError(
                f"{op}: normalized_shape must be an int or a sequence of ints, "
                f"got an element of type {type(size).__name__}"
            )
        if size < 0:
            raise ValueError(f"{op}: normalized_shape must have non-negative sizes, got {tuple(normalized_shape)}")
        dims.append(size if isinstance(size, torch.SymInt) else int(size))
    if not dims:
        raise ValueError(f"{op}: normalized_shape must name at least one dim, got ()")
    return tuple(dims)


def check_row_input(op: str, name: str, x: object, normalized_shape: tuple[int, ...]) -> int:
    """``x`` is a float tensor ending in ``normalized_shape`` whose normalized dims merge into one
    stride; returns the column stride."""
    check_tensor(op, name, x)
    check_float_dtype(op, name, x)
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k :]) != normalized_shape:
        raise ValueError(
            f"{op}: {name} of shape {tuple(x.shape)} must end in the normalized shape {normalized_shape}"
        )
    return _column_stride(op, name, x, k)


def check_param(
    op: str, name: str, p: object, x: torch.Tensor, normalized_shape: tuple[int, ...], what: str
) -> int:
    """A weight/bias: ``x``'s dtype and device, shape ``normalized_shape``; returns its column stride."""
    check_tensor(op, name, p)
    check_float_dtype(op, name, p)
    if tuple(p.shape) != normalized_shape:
        raise ValueError(f"{op}: {name} must have shape {normalized_shape} ({what}), got {tuple(p.shape)}")
    check_same_dtype(op, "x", x, name, p)
    check_same_device(op, "x", x, name, p)
    return _column_stride(op, name, p, len(normalized_shape))


def _column_stride(op: str, name: str, t: torch.Tensor, ndim: int) -> int:
    merged = merge_trailing(t, ndim)
    if merged is None:
        dims = tuple(t.shape[t.dim() - ndim :])
        strides = tuple(t.stride()[t.dim() - ndim :])
        raise ValueError(
            f"{op}: {name}'s normalized dims {dims} have strides {strides}, which one stride cannot walk; "
            f"call {name}.contiguous() first"
        )
    return merged[3]


def walkable(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``t`` itself if its last ``ndim`` dims merge into one stride, else a contiguous copy.

    Only for gradients that autograd hands the backward (the user cannot fix their layout);
    inputs the user passes get :func:`check_row_input`'s error instead of a hidden copy.
    """
    return t if merge_trailing(t, ndim) is not None else t.contiguous()


def empty_stats(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """Per-row float32 statistics: a contiguous tensor of ``x``'s leading shape."""
    return _launch.empty(x.shape[: x.dim() - ndim], torch.float32, x.device)
