"""The row launch shared by every row-wise op (softmax, cross-entropy, the norms).

A row op reduces over one axis of length ``n_cols`` (softmax's ``dim``; a norm's normalized
dims, merged) and treats every other index as a *row*. The kernels never copy their inputs
into a ``(n_rows, n_cols)`` matrix; instead each operand is described by

* one **column stride** (the step between neighbouring elements of a row: 1 for the usual
  last-dim softmax, ``n_rows`` for a softmax over dim 0 of a matrix), and
* up to :data:`MAX_LEAD_DIMS` **leading dims** with a stride each, so that row ``r`` starts at
  :func:`row_start` ``(r, ...)``. Leading dims that every operand can walk as one are merged
  first (:func:`kernel_ladder._launch.coalesce_dims`), so a contiguous or row-sliced tensor has a
  single leading dim; tensors that still need more are launched once per slice (rare).

The kernel-side convention::

    some_row_kernel(<pointers>, <op scalars>, n_rows, n_cols, size1, size2,
                    <for each operand x: stride_x0, stride_x1, stride_x2, stride_xcol>, <constexprs>,
                    BLOCK_ROWS, BLOCK_COLS, ...)

A program's tile is ``BLOCK_ROWS x BLOCK_COLS``: several short rows side by side, or one chunk of
a long row; every row kernel describes its launch with a :class:`RowConfig`.

``size0`` is implied by ``n_rows``. A column stride of 1 is specialized by Triton's JIT (it
treats integer arguments equal to 1 as constants), so the contiguous case gets vectorized loads
without a separate flag. Row starts are computed in int64; column offsets need int64 only when
``(n_cols - 1) * col_stride`` can pass 2**31 (:attr:`RowLaunch.index_64`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _launch
from ._launch import coalesce_dims

__all__ = [
    "MAX_LEAD_DIMS", "RowConfig", "RowLaunch", "load_rows", "merge_trailing", "plan_rows", "row_geometry", "row_start",
    "store_rows", "trailing_stride",
]

#: Leading dims a kernel walks with div/mod after merging; more are split on the host.
MAX_LEAD_DIMS: int = 3


@triton.jit
def row_start(row, size1, size2, stride0, stride1, stride2):
    """Memory offset (int64, in elements) of the first element of row ``row`` (scalar or block)."""
    row = row.to(tl.int64)
    i2 = row % size2
    rest = row // size2
    i1 = rest % size1
    i0 = rest // size1
    return i0 * stride0 + i1 * stride1 + i2 * stride2


@triton.jit
def load_rows(ptr, rows, cols, mask, size1, size2, stride0, stride1, stride2, col_stride):
    """The ``(rows, cols)`` tile of an operand in float32 (masked-off lanes 0): a block of rows at once."""
    offsets = row_start(rows, size1, size2, stride0, stride1, stride2)[:, None] + cols[None, :] * col_stride
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, value, rows, cols, mask, size1, size2, stride0, stride1, stride2, col_stride):
    """Store a ``(rows, cols)`` tile, rounded once to the operand's dtype."""
    offsets = row_start(rows, size1, size2, stride0, stride1, stride2)[:, None] + cols[None, :] * col_stride
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class RowConfig:
    """How a row kernel tiles its rows: the one launch-configuration type of every row op.

    ``block_cols`` columns per load — the whole row padded to a power of two, or one chunk of it
    when ``chunked`` (a row too long for registers, walked in chunks: the online softmax, the
    chunked norms and cross-entropy). ``block_rows`` rows side by side in one tile (short rows are
    stacked until a tile holds a few thousand elements). A program handles ``rows_per_program``
    rows, ``rows_per_program / block_rows`` tiles one after the other (the norms loop; softmax and
    cross-entropy take one tile, ``rows_per_program == block_rows``). ``num_warps`` is a GPU launch
    option (the interpreter ignores it).
    """

    block_cols: int
    block_rows: int
    chunked: bool
    num_warps: int
    rows_per_program: int

    def programs(self, n_rows: int) -> int:
        """Programs that cover ``n_rows`` rows (at least 1)."""
        return max(1, -(-n_rows // self.rows_per_program))


@dataclass(frozen=True)
class RowLaunch:
    """One launch over (a slice of) the rows."""

    tensors: tuple[torch.Tensor, ...]  # operands whose data_ptr is the slice's first element
    n_rows: int
    n_cols: int
    row_base: int  # index of the slice's first row among all rows (row-major over leading dims)
    sizes: tuple[int, int]  # size1, size2 of the merged leading dims (size0 = n_rows / product)
    strides: tuple[int, ...]  # per operand: stride0, stride1, stride2, col_stride
    index_64: bool  # some column offset can pass 2**31

    def args(self) -> tuple:
        """``n_rows, n_cols, size1, size2, <strides>`` in the kernel convention's order."""
        return (self.n_rows, self.n_cols, *self.sizes, *self.strides)


def merge_trailing(t: torch.Tensor, ndim: int) -> tuple[list[int], list[int], int, int] | None:
    """Split ``t`` into leading dims and its last ``ndim`` dims merged into one.

    Returns ``(lead_sizes, lead_strides, n_cols, col_stride)``, or ``None`` when the trailing dims
    cannot be walked with a single stride (e.g. a transposed pair).
    """
    merged = _merge_trailing(tuple(t.shape), t.stride(), ndim)
    if merged is None:
        return None
    lead_sizes, lead_strides, n_cols, col_stride = merged
    return list(lead_sizes), list(lead_strides), n_cols, col_stride


def trailing_stride(shape: Sequence[int], strides: Sequence[int], ndim: int) -> int | None:
    """The one column stride of the last ``ndim`` dims of a tensor of ``shape`` and ``strides``, or
    ``None`` when one stride cannot walk them: :func:`merge_trailing` from the sizes alone."""
    merged = _merge_trailing(tuple(shape), tuple(strides), ndim)
    return None if merged is None else merged[3]


@_launch.shape_cache
def _merge_trailing(shape: tuple[int, ...], strides: tuple[int, ...], ndim: int):
    # Cached: a pure function of ints, on every row op's path (checks and plan) several times a call.
    dim = len(shape)
    lead_sizes, lead_strides = shape[: dim - ndim], strides[: dim - ndim]
    tail = [(s, st) for s, st in zip(shape[dim - ndim :], strides[dim - ndim :]) if s != 1]
    n_cols = math.prod(shape[dim - ndim :])
    if not tail:
        return lead_sizes, lead_strides, n_cols, 1
    col_stride = tail[-1][1]
    expected = col_stride
    for size, stride in reversed(tail):
        if stride != expected:
            return None
        expected = stride * size
    return lead_sizes, lead_strides, n_cols, col_stride


@functools.lru_cache(maxsize=4096)
def _row_geometry(
    shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...], reduce_ndim: int, int32_max: int
):
    """The row launches of operands of ``shape`` with these strides, without the tensors: cached.

    ``None`` when some operand's reduced dims do not merge; else ``(n_cols, launches)`` with one
    ``(n_rows, row_base, sizes, flat strides, index_64, per-operand offset deltas or None)`` each.
    ``int32_max`` (the index-width limit) is part of the key, so a lowered limit is never answered
    from the cache.
    """
    merged = [_merge_trailing(shape, st, reduce_ndim) for st in strides]
    if any(m is None for m in merged):
        return None
    lead_shape = merged[0][0]
    n_cols = merged[0][2]
    n_rows = math.prod(lead_shape)
    if n_rows == 0 or n_cols == 0:
        return n_cols, ()
    col_strides = [m[3] for m in merged]
    sizes, lead_strides = coalesce_dims(lead_shape, [m[1] for m in merged])
    if not sizes:  # a single row
        sizes, lead_strides = [1], [[0] for _ in strides]
    outer_sizes, inner_sizes = sizes[:-MAX_LEAD_DIMS], sizes[-MAX_LEAD_DIMS:]
    pad = MAX_LEAD_DIMS - len(inner_sizes)
    padded_sizes = [1] * pad + inner_sizes
    inner_rows = math.prod(inner_sizes)
    index_64 = any((n_cols - 1) * abs(cs) > int32_max for cs in col_strides)
    flat = tuple(x for op, cs in zip(lead_strides, col_strides) for x in ([0] * pad + op[-MAX_LEAD_DIMS:] + [cs]))
    launches = []
    for slice_number, outer_index in enumerate(itertools.product(*(range(s) for s in outer_sizes))):
        deltas = (
            tuple(sum(i * st for i, st in zip(outer_index, op[:-MAX_LEAD_DIMS])) for op in lead_strides)
            if outer_index else None
        )
        launches.append((inner_rows, slice_number * inner_rows, tuple(padded_sizes[1:]), flat, index_64, deltas))
    return n_cols, tuple(launches)


def row_geometry(shape: Sequence[int], strides: Sequence[Sequence[int]], reduce_ndim: int = 1):
    """:func:`plan_rows` from the sizes alone: the launches of operands of ``shape`` with these
    ``strides`` (one tuple per operand), without the tensors, for a plan built once per call.

    ``None`` when some operand's reduced dims do not merge; else ``(n_cols, launches)`` with one
    ``(n_rows, row_base, sizes, strides, index_64, deltas)`` per launch, in :class:`RowLaunch`'s
    terms; ``deltas`` (None for the one launch over every row) is each operand's element offset to
    the slice's first element. Cached on its arguments.
    """
    return _row_geometry(tuple(shape), tuple(map(tuple, strides)), reduce_ndim, _launch.INT32_MAX)


def plan_rows(operands: Sequence[torch.Tensor], reduce_ndim: int = 1) -> list[RowLaunch]:
    """The launches of a row op over ``operands`` (all of the same shape), reducing the last dims.

    ``reduce_ndim`` trailing dims form a row (softmax: move ``dim`` last first, with ``movedim``,
    which is a view). Every operand's trailing dims must merge into one stride (checked by the
    caller with :func:`merge_trailing`, which can then raise an error naming the op). Returns no
    launch when there are no rows or no columns. The geometry is cached on shapes and strides.
    """
    shape = tuple(operands[0].shape)
    for t in operands:
        if t.shape != shape:
            raise AssertionError(f"row operand of shape {tuple(t.shape)} in a launch over {shape}")
    geometry = _row_geometry(shape, tuple(t.stride() for t in operands), reduce_ndim, _launch.INT32_MAX)
    if geometry is None:
        raise AssertionError("a row operand's reduced dims do not merge into one stride")
    n_cols, launches = geometry
    plans = []
    for n_rows, row_base, sizes, strides, index_64, deltas in launches:
        if deltas is None:
            tensors = tuple(operands)
        else:  # only its data pointer is used
            tensors = tuple(t.as_strided((1,), (1,), t.storage_offset() + d) for t, d in zip(operands, deltas))
        plans.append(RowLaunch(tensors=tensors, n_rows=n_rows, n_cols=n_cols, row_base=row_base, sizes=sizes,
                               strides=strides, index_64=index_64))
    return plans
