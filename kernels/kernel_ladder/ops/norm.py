"""What the normalization ops share: one validation-and-plan step, the launch, the launch rule, the column reduction.

**One call, checked and planned once.** Each op (``rms_norm``, ``layer_norm``, ``add_rms_norm``)
describes itself as a :class:`NormOp` (its operands, kernels and their options); its custom op
hands its arguments to :func:`norm_forward` (or :func:`norm_backward`), which validates them in
one pass (:func:`check_norm`, also the fake kernels' check) into a frozen :class:`NormProblem` —
shapes, dtype, device, parameter strides, options, no tensor — plans the launches from the
operands' shapes and strides alone (:func:`plan_norm`, cached) and launches. So an input crosses
each module on its way once (``utils.call_path.argument_path`` counts the calls that receive it;
``tests/test_kernels_norm.py`` bounds them).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._rows import RowConfig, merge_trailing, row_geometry, trailing_stride
from .._validate import check_float_dtype, check_same_device, check_same_dtype, check_same_shape, check_tensor

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
    "NormOp",
    "NormPlan",
    "NormProblem",
    "check_norm",
    "check_norm_backward",
    "column_sum",
    "column_sum_kernel",
    "norm_backward",
    "norm_forward",
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
class NormLaunch:
    """One launch of a norm kernel over (a slice of) the rows: everything but the tensors."""

    grid: tuple[int]
    args: tuple[int, ...]  # n_rows, n_cols, size1, size2, then each row operand's stride0, stride1, stride2, col stride
    rows_per_program: int
    row_base: int  # the slice's first row: the per-row tensors (statistics, scratch) are indexed from it
    program_offset: int  # the slice's first program: the rows of the (n_programs, N) partial buffers
    deltas: tuple[int, ...] | None  # each row operand's element offset to the slice (None: the operands themselves)
    options: Mapping[str, object]  # BLOCK_ROWS, BLOCK_COLS, CHUNKED, INDEX_64 and num_warps


@dataclass(frozen=True)
class NormPlan:
    """The launches of one norm kernel call, from the operands' shape and strides (no tensors)."""

    launches: tuple[NormLaunch, ...]
    n_programs: int  # over all launches: the rows of a partial buffer
    chunked: bool  # some launch walks its rows in chunks (the backward then needs a per-row scratch)


def plan_norm(shape: Sequence[int], strides: Sequence[Sequence[int]], ndim: int, device: torch.device | str = "cpu",
              *, backward: bool = False, params: int = 1) -> NormPlan:
    """Plan a norm over row operands of ``shape`` with these ``strides`` (one tuple per operand, in
    the kernel's order), normalizing their last ``ndim`` dims.

    ``params``: how many parameter vectors (weight, bias) the forward kernel loads per program.
    Cached: the key holds every input of the plan, the device's SM count, the index-width limit and
    this module's tile limits included.
    """
    return _plan_norm(tuple(shape), tuple(map(tuple, strides)), ndim, backward, params,
                      _launch.num_sms(torch.device(device)), _launch.INT32_MAX, _limits())


def _limits() -> tuple[int, ...]:
    return (MAX_FUSED_BLOCK, MAX_FUSED_BLOCK_BACKWARD, CHUNK_BLOCK, TILE_ELEMENTS, PROGRAMS_PER_SM,
            FORWARD_ROWS_PER_PROGRAM, MIN_FORWARD_ROWS_PER_PARAM)


@_launch.shape_cache
def _plan_norm(shape, strides, ndim, backward, params, sms, int32_max, limits) -> NormPlan:
    geometry = row_geometry(shape, strides, ndim)
    if geometry is None:
        raise AssertionError("a row operand's normalized dims do not merge into one stride")
    n_cols, slices = geometry
    launches, n_programs = [], 0
    for n_rows, row_base, sizes, flat_strides, index_64, deltas in slices:
        config = _norm_config(n_rows, n_cols, sms, backward, params, *limits)
        programs = config.programs(n_rows)
        options = MappingProxyType(dict(
            BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, CHUNKED=config.chunked,
            INDEX_64=index_64 or n_rows + config.rows_per_program > int32_max, num_warps=config.num_warps,
        ))
        launches.append(NormLaunch((programs,), (n_rows, n_cols, *sizes, *flat_strides), config.rows_per_program,
                                   row_base, n_programs, deltas, options))
        n_programs += programs
    return NormPlan(tuple(launches), n_programs, any(launch.options["CHUNKED"] for launch in launches))


# ----------------------------------------------------------------------------------------------
# One call of a norm op: validated and planned once
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormOp:
    """What the family's shared code knows of one op: its names, operands and kernels.

    The row inputs (``x``, and ``residual`` for ``add_rms_norm``) come with as many row outputs of
    the same shape (``y``, and the sum ``s``); the forward saves ``stats`` float32 values per row
    (``rstd`` last: ``mean, rstd`` for LayerNorm). The kernels follow :func:`norm_forward`'s
    argument convention; ``forward_options`` and ``backward_options`` give a call's kernel scalars
    and constexprs from its :class:`NormProblem`.
    """

    name: str  # the public name every error starts with
    inputs: tuple[str, ...]  # the row inputs' names, in the kernel's order
    params: tuple[str, ...]  # the parameter vectors' names, in the kernel's order
    stats: int
    forward: Any  # the Triton kernels
    backward: Any
    forward_options: Callable[[NormProblem], tuple[tuple, dict]]
    backward_options: Callable[[NormProblem], tuple[tuple, dict]]
    backward_grad_sum: bool = False  # the backward kernel takes a gradient-sum row operand (HAS_GRAD_SUM)


@dataclass(frozen=True)
class NormProblem:
    """One call of a norm op, validated once: what its launches and outputs need, and no tensor.

    Built by :func:`check_norm` (a forward) or :func:`check_norm_backward`; the fake kernels use it
    for their outputs, the launchers to plan (:func:`plan_norm`) and launch.
    """

    op: NormOp
    shape: tuple[int, ...]  # every row operand's
    normalized_shape: tuple[int, ...]  # the trailing dims normalized over
    dtype: torch.dtype
    device: torch.device
    has_params: tuple[bool, ...]  # per parameter of op.params (the backward: the weight only)
    param_strides: tuple[int, ...]  # each parameter's column stride (0 when absent)
    eps: float = 0.0
    offset: float = 0.0
    round_before_scale: bool = False
    weight_grad: bool = False  # the backward's
    bias_grad: bool = False
    grad_sum: bool = False

    @property
    def ndim(self) -> int:
        return len(self.normalized_shape)

    @property
    def n_cols(self) -> int:
        return math.prod(self.normalized_shape)

    @property
    def stats_shape(self) -> tuple[int, ...]:
        """The leading (row) dims: the shape of each per-row statistic."""
        return self.shape[: len(self.shape) - self.ndim]

    def empty_outputs(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Fresh row outputs (one per row input) and float32 per-row statistics, as the op returns them."""
        rows = tuple(_launch.empty(self.shape, self.dtype, self.device) for _ in self.op.inputs)
        stats = tuple(_launch.empty(self.stats_shape, torch.float32, self.device) for _ in range(self.op.stats))
        return rows, stats


def check_norm(op: NormOp, inputs: Sequence[object], params: Sequence[object], eps: object,
               normalized_shape: object = None, *, offset: object = 0.0, casting: object = None,
               in_place_backward: object = False) -> NormProblem:
    """Validate one forward call of ``op``, once, with the op's errors; returns its :class:`NormProblem`.

    ``normalized_shape=None``: the last dim of ``x`` (RMSNorm); ``casting=None``: the op has no
    RMSNorm options (``offset``, ``casting``, ``in_place_backward``). The checks, in order: ``x``
    (a float tensor ending in the normalized shape, whose normalized dims one stride walks), each
    other row input (``x``'s shape, dtype and device), ``eps``, the options, each parameter.
    """
    name = op.name
    x = inputs[0]
    if normalized_shape is None:
        check_tensor(name, "x", x)
        if x.dim() == 0:
            raise ValueError(f"{name}: x must have at least one dim (the normalized one), got a 0-d tensor")
        normalized_shape, what = (x.shape[-1],), "x's last dim"
    else:
        normalized_shape, what = check_normalized_shape(name, normalized_shape), "normalized_shape"
        check_tensor(name, "x", x)
    ndim = len(normalized_shape)
    for i, (label, t) in enumerate(zip(op.inputs, inputs)):
        if i:
            check_tensor(name, label, t)
            check_same_shape(name, "x", x, label, t)
        check_float_dtype(name, label, t)
        if i == 0 and (x.dim() < ndim or tuple(x.shape[x.dim() - ndim :]) != normalized_shape):
            raise ValueError(
                f"{name}: x of shape {tuple(x.shape)} must end in the normalized shape {normalized_shape}"
            )
        _column_stride(name, label, t.shape, t.stride(), ndim)
        if i:
            check_same_dtype(name, "x", x, label, t)
            check_same_device(name, "x", x, label, t)
    check_eps(name, eps)
    round_before_scale = False
    if casting is not None:
        round_before_scale = check_casting(name, casting)
        check_offset(name, offset, params[0])
        check_flag(name, "in_place_backward", in_place_backward)
    strides = []
    for label, p in zip(op.params, params):
        if p is None:
            strides.append(0)
            continue
        check_tensor(name, label, p)
        check_float_dtype(name, label, p)
        if tuple(p.shape) != normalized_shape:
            raise ValueError(f"{name}: {label} must have shape {normalized_shape} ({what}), got {tuple(p.shape)}")
        check_same_dtype(name, "x", x, label, p)
        check_same_device(name, "x", x, label, p)
        strides.append(_column_stride(name, label, p.shape, p.stride(), ndim))
    return NormProblem(op, tuple(x.shape), normalized_shape, x.dtype, x.device,
                       tuple(p is not None for p in params), tuple(strides), eps, offset, round_before_scale)


def norm_forward(op: NormOp, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor | None], eps: float,
                 normalized_shape: Sequence[int] | None = None, *, offset: float = 0.0, casting: str | None = None,
                 in_place_backward: bool = False) -> tuple[torch.Tensor, ...]:
    """``op``'s forward: validate and plan once, launch; returns the row outputs, then the statistics.

    The kernel's argument convention (every norm kernel's)::

        kernel(<row operands>, <params>, <per-row tensors>, <partial buffers>, <scalars>,
               n_rows, n_cols, size1, size2, <row operand strides>, <param column strides>,
               rows_per_program, <constexprs>, BLOCK_ROWS, BLOCK_COLS, CHUNKED, INDEX_64)

    The row operands are the inputs then the outputs; a missing parameter is replaced by a dummy
    pointer that the kernel never loads (its ``HAS_*`` constexpr is off); the per-row tensors (the
    statistics) are indexed by the row's global index, so each slice gets a view from its first row.
    """
    problem = check_norm(op, inputs, params, eps, normalized_shape, offset=offset, casting=casting,
                         in_place_backward=in_place_backward)
    runtime.require_launchable(op.name, inputs[0])
    outputs, stats = problem.empty_outputs()
    if problem.n_cols == 0:  # the statistics of no elements: mean 0, mean square or variance 0
        for stat in stats[:-1]:
            stat.zero_()
        stats[-1].fill_(eps**-0.5)
    operands = (*inputs, *outputs)
    plan = plan_norm(problem.shape, [t.stride() for t in operands], problem.ndim, problem.device,
                     params=sum(problem.has_params))
    scalars, constexprs = op.forward_options(problem)
    per_row = [stat.view(-1) for stat in stats]
    # The loop is written out here and in norm_backward, not in a helper: the tensors go to the kernel directly.
    for launch in plan.launches:
        rows = operands if launch.deltas is None else _slice(operands, launch.deltas)
        op.forward[launch.grid](
            *rows, *[rows[0] if p is None else p for p in params], *[t[launch.row_base :] for t in per_row],
            *scalars, *launch.args, *problem.param_strides, launch.rows_per_program, **constexprs, **launch.options,
        )
    return (*outputs, *stats)


def check_norm_backward(op: NormOp, grads: Sequence[tuple[str, torch.Tensor]], saved: tuple[str, torch.Tensor],
                        weight: torch.Tensor | None, weight_grad: bool, bias_grad: bool = False, *,
                        normalized_shape: Sequence[int] | None = None, offset: float = 0.0,
                        in_place: bool = False) -> NormProblem:
    """Validate one backward call, once: each incoming gradient has the saved input's shape, dtype
    and device (``in_place``: the first is contiguous, to be overwritten with ``dx``)."""
    name = f"{op.name} (backward)"
    saved_name, saved_input = saved
    for label, g in grads:
        check_same_shape(name, label, g, saved_name, saved_input)
        check_same_dtype(name, label, g, saved_name, saved_input)
        check_same_device(name, label, g, saved_name, saved_input)
    if in_place and not grads[0][1].is_contiguous():
        raise ValueError(f"{name}: the in-place backward needs a contiguous {grads[0][0]}, "
                         f"got strides {grads[0][1].stride()}")
    runtime.require_launchable(name, *(g for _, g in grads), saved_input)
    normalized_shape = (saved_input.shape[-1],) if normalized_shape is None else tuple(normalized_shape)
    ndim = len(normalized_shape)
    has_weight = weight is not None
    w_stride = trailing_stride(weight.shape, weight.stride(), ndim) if has_weight else 0
    return NormProblem(op, tuple(saved_input.shape), normalized_shape, saved_input.dtype, saved_input.device,
                       (has_weight,), (w_stride,), offset=offset, weight_grad=weight_grad and has_weight,
                       bias_grad=bias_grad, grad_sum=len(grads) > 1)


def norm_backward(problem: NormProblem, grads: Sequence[torch.Tensor], x: torch.Tensor, weight: torch.Tensor | None,
                  stats: Sequence[torch.Tensor], dx: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``(dx, <one gradient per parameter, empty where not wanted>)`` of a checked backward ``problem``.

    ``grads``: the gradient of the output, then (``add_rms_norm``) the one arriving at the sum;
    ``dx``: the buffer to write into (the in-place backward passes the first gradient itself).
    Each program sums its rows' parameter-gradient contributions into one row of a float32
    ``(n_programs, N)`` partial buffer per parameter; :func:`column_sum` adds the rows.
    """
    op, ndim, n_cols = problem.op, problem.ndim, problem.n_cols
    grads = [walkable(g, ndim) for g in grads]
    if dx is None:
        dx = _launch.empty(problem.shape, problem.dtype, problem.device)
    operands = (grads[0], x, dx)
    if op.backward_grad_sum:  # the gradient-sum operand: the output's own gradient when there is none (never read)
        operands += (grads[-1],)
    plan = plan_norm(problem.shape, [t.stride() for t in operands], ndim, problem.device, backward=True)
    wanted = (problem.weight_grad, problem.bias_grad)[: len(op.params)]
    partials = [_launch.empty((plan.n_programs, n_cols) if w else (0,), torch.float32, problem.device) for w in wanted]
    rows = stats[-1].numel() if plan.chunked else 0
    scratch = _launch.empty((rows, op.stats) if op.stats > 1 else (rows,), torch.float32, problem.device)
    per_row = [*(stat.view(-1) for stat in stats), scratch]
    scalars, constexprs = op.backward_options(problem)
    for launch in plan.launches:  # as in norm_forward
        slices = operands if launch.deltas is None else _slice(operands, launch.deltas)
        op.backward[launch.grid](
            *slices, slices[0] if weight is None else weight, *[t[launch.row_base :] for t in per_row],
            *[t[launch.program_offset :] for t in partials], *scalars, *launch.args, *problem.param_strides,
            launch.rows_per_program, **constexprs, **launch.options,
        )
    # Distinct empty tensors for the gradients not wanted: a custom op's outputs may not alias each other.
    return dx, *[column_sum(t.view(plan.n_programs, n_cols), problem.normalized_shape, problem.dtype) if w
                 else x.new_empty((0,)) for t, w in zip(partials, wanted)]


def _slice(operands: Sequence[torch.Tensor], deltas: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """The operands of a launch over a slice of the rows: only their data pointer is used."""
    return tuple(t.as_strided((1,), (1,), t.storage_offset() + d) for t, d in zip(operands, deltas))


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


def _column_stride(op: str, name: str, shape: Sequence[int], strides: Sequence[int], ndim: int) -> int:
    """The column stride of a tensor's normalized dims; an error naming it when one stride cannot walk them."""
    stride = trailing_stride(shape, strides, ndim)
    if stride is None:
        dims = tuple(shape[len(shape) - ndim :])
        raise ValueError(
            f"{op}: {name}'s normalized dims {dims} have strides {tuple(strides[len(strides) - ndim :])}, which one "
            f"stride cannot walk; call {name}.contiguous() first"
        )
    return stride


def walkable(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``t`` itself if its last ``ndim`` dims merge into one stride, else a contiguous copy.

    Only for gradients that autograd hands the backward (the user cannot fix their layout);
    inputs the user passes get :func:`check_norm`'s error instead of a hidden copy.
    """
    return t if merge_trailing(t, ndim) is not None else t.contiguous()
