"""The strided N-D launch shared by every elementwise op.

An elementwise kernel walks the *logical* elements of its output in row-major order: element
``idx`` of the (contiguous) output is computed from element ``idx`` of each input, wherever that
input keeps it in memory. So the kernels never need a ``.contiguous()`` copy of their inputs:

* The host first **coalesces** dimensions: size-1 dims are dropped, and neighbouring dims
  ``d, d+1`` are merged when every operand can step over them as one (``stride[d] ==
  stride[d+1] * size[d+1]`` for all). A contiguous tensor becomes 1-D, a row-sliced matrix stays
  2-D, a broadcast operand keeps its stride-0 dims.
* If every operand then is one dense run (stride 1), the kernel takes the **flat fast path**:
  offsets ``pid * BLOCK + arange(BLOCK)``, which Triton turns into vectorized loads and stores.
* Otherwise the kernel receives up to ``MAX_DIMS`` sizes and each operand's strides and turns
  ``idx`` into a memory offset with integer div/mod (:func:`unravel_index`,
  :func:`strided_offset`). Tensors that still need more dims after coalescing are launched once
  per slice of their leading dims (rare: it takes five dims that no operand can merge).
* Offsets are computed in int32 when every index and offset stays below 2**31, else in int64
  (``INDEX_64``), so huge tensors are right and ordinary ones pay nothing.

The kernel-side convention, used by every kernel in this package::

    some_kernel(<input pointers>, <output pointers>, <op scalars>, n_elements, [index_base,]
                size1, size2, size3, <for each input x: stride_x0, stride_x1, stride_x2, stride_x3>,
                <op constexprs>, CONTIGUOUS, INDEX_64, BLOCK)

(strides named ``stride_<operand><dim>``, as in Triton's tutorials; every kernel of the package
follows that rule and comments its argument groups.)

Outputs are always contiguous, so they take no strides. ``size0`` is implied by ``n_elements``.
``index_base`` (only when asked for) is the logical index of the slice's first element, which
dropout needs so that its random numbers depend on the element, not on how it was launched.
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
    "BLOCK",
    "MAX_DIMS",
    "NUM_WARPS",
    "ElementwiseLaunch",
    "block_indices",
    "launch_elementwise",
    "plan_elementwise",
    "strided_offset",
    "unravel_index",
]

#: Elements per program. 1024 keeps interpreter grids small and gives each of the 128 threads of
#: 4 warps 8 contiguous elements (16-32 bytes: full-width vector loads) on a GPU.
BLOCK: int = 1024
NUM_WARPS: int = 4
#: Dimensions a kernel walks with div/mod after coalescing; more are split on the host.
MAX_DIMS: int = 4


@triton.jit
def block_indices(n_elements, INDEX_64: tl.constexpr, BLOCK: tl.constexpr):
    """This program's logical element indices and the mask of those inside the tensor."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)  # pid * BLOCK can pass 2**31
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    return idx, idx < n_elements


@triton.jit
def unravel_index(idx, size1, size2, size3):
    """Row-major multi-index (i0, i1, i2, i3) of logical index ``idx`` in a (., size1, size2, size3) space."""
    i3 = idx % size3
    rest = idx // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    return i0, i1, i2, i3


@triton.jit
def strided_offset(i0, i1, i2, i3, stride0, stride1, stride2, stride3):
    """Memory offset (in elements) of multi-index (i0, i1, i2, i3) in an operand with these strides."""
    return i0 * stride0 + i1 * stride1 + i2 * stride2 + i3 * stride3


@triton.jit
def operand_offset(idx, size1, size2, size3, stride0, stride1, stride2, stride3, CONTIGUOUS: tl.constexpr):
    """Memory offset (in elements) of logical index ``idx`` in an operand with these strides.

    When every operand is contiguous (``CONTIGUOUS``), it is ``idx`` itself: the flat, vectorizable
    path. Otherwise the index is unravelled over the merged sizes and dotted with the strides
    (0 for a broadcast dim); the unravel is the same for every operand, and the compiler shares it.
    """
    if CONTIGUOUS:
        offset = idx
    else:
        i0, i1, i2, i3 = unravel_index(idx, size1, size2, size3)
        offset = strided_offset(i0, i1, i2, i3, stride0, stride1, stride2, stride3)
    return offset


@dataclass(frozen=True)
class ElementwiseLaunch:
    """One kernel launch over (a slice of) a coalesced iteration space."""

    inputs: tuple[torch.Tensor, ...]  # tensors whose data_ptr is the slice's first element
    outputs: tuple[torch.Tensor, ...]  # contiguous slices of the outputs
    n_elements: int
    index_base: int  # logical index of the slice's first element in the whole output
    sizes: tuple[int, int, int]  # size1, size2, size3 (size0 = n_elements / their product)
    strides: tuple[int, ...]  # MAX_DIMS strides per input, inputs in order
    contiguous: bool  # every input is one dense run: the flat fast path
    index_64: bool  # some index or offset can pass 2**31


def _needs_int64(n_elements: int, index_base: int, sizes: Sequence[int], strides: Sequence[Sequence[int]]) -> bool:
    # The last program's indices run up to a full BLOCK past n_elements (masked, but computed).
    if index_base + n_elements + BLOCK > _launch.INT32_MAX:
        return True
    return any(sum((s - 1) * st for s, st in zip(sizes, op)) > _launch.INT32_MAX for op in strides)


@functools.lru_cache(maxsize=4096)
def _geometry(
    shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...], int32_max: int
) -> tuple[tuple, ...]:
    """The launch plan of a shape and its inputs' strides, without the tensors: cached.

    One entry per launch: ``(n_elements, index_base, sizes, flat strides, contiguous, index_64,
    per-input storage-offset deltas or None)``. A pure function of hashable ints, so a training
    loop that calls an op with the same shapes every step computes it once. ``int32_max`` is the
    index-width limit the plan was made under, part of the key so that a changed limit (tests force
    the int64 path by lowering it) is never answered from the cache.
    """
    numel = math.prod(shape)
    if numel == 0:
        return ()
    sizes, merged = coalesce_dims(shape, strides)
    if len(sizes) <= 1 and all(not op or op[0] == 1 for op in merged):
        # Flat fast path: logical index == memory offset for every operand.
        return ((numel, 0, (1, 1, 1), (0,) * (MAX_DIMS * len(strides)), True,
                 _needs_int64(numel, 0, [numel], [[1]]), None),)
    outer_sizes, inner_sizes = sizes[:-MAX_DIMS], sizes[-MAX_DIMS:]
    pad = MAX_DIMS - len(inner_sizes)
    padded_sizes = [1] * pad + inner_sizes
    padded_strides = [[0] * pad + op[-MAX_DIMS:] for op in merged]
    inner_numel = math.prod(inner_sizes)
    flat_strides = tuple(st for op in padded_strides for st in op)
    launches = []
    # Leading dims beyond MAX_DIMS: one launch per index into them, on views (no copies).
    for slice_number, outer_index in enumerate(itertools.product(*(range(s) for s in outer_sizes))):
        base = slice_number * inner_numel
        deltas = (
            tuple(sum(i * st for i, st in zip(outer_index, op[:-MAX_DIMS])) for op in merged) if outer_index else None
        )
        launches.append((inner_numel, base, tuple(padded_sizes[1:]), flat_strides, False,
                         _needs_int64(inner_numel, base, padded_sizes, padded_strides), deltas))
    return tuple(launches)


def _check_operands(shape: tuple[int, ...], inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    # A launcher's own contract (the ops build these operands), so an AssertionError, not a user error.
    for t in (*inputs, *outputs):
        if t.shape != shape:
            raise AssertionError(f"operand of shape {tuple(t.shape)} in a launch over {shape}")
    for out in outputs:
        if not out.is_contiguous():
            raise AssertionError("elementwise outputs must be contiguous")


def plan_elementwise(
    shape: Sequence[int], inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
) -> list[ElementwiseLaunch]:
    """The launches that compute ``outputs`` (contiguous, of ``shape``) from ``inputs``.

    Each input must already have ``shape`` (broadcast inputs as stride-0 views, e.g. from
    ``expand``). Returns no launch for an empty shape.
    """
    shape = tuple(shape)
    _check_operands(shape, inputs, outputs)
    geometry = _geometry(shape, tuple(t.stride() for t in inputs), _launch.INT32_MAX)
    flat_outputs = [out.view(-1) for out in outputs]
    launches = []
    for n_elements, base, sizes, strides, contiguous, index_64, deltas in geometry:
        if deltas is None:
            slice_inputs = tuple(inputs)
        else:
            inner = list(sizes)
            slice_inputs = tuple(
                t.as_strided(_inner_sizes(n_elements, inner), strides[k * MAX_DIMS : (k + 1) * MAX_DIMS],
                             t.storage_offset() + d)
                for k, (t, d) in enumerate(zip(inputs, deltas))
            )
        launches.append(
            ElementwiseLaunch(
                inputs=slice_inputs,
                outputs=tuple(out[base : base + n_elements] for out in flat_outputs) if not contiguous
                else tuple(outputs),
                n_elements=n_elements, index_base=base, sizes=sizes, strides=strides,
                contiguous=contiguous, index_64=index_64,
            )
        )
    return launches


def _inner_sizes(n_elements: int, sizes: list[int]) -> tuple[int, ...]:
    """The four inner sizes of a slice (``size0`` implied by ``n_elements``)."""
    inner = math.prod(sizes)
    return (n_elements // inner, *sizes)


def launch_elementwise(
    kernel,
    shape: Sequence[int],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    scalars: Sequence[object] = (),
    *,
    with_index_base: bool = False,
    **constexprs: object,
) -> None:
    """Launch ``kernel`` (following this module's argument convention) over ``shape``."""
    shape = tuple(shape)
    _check_operands(shape, inputs, outputs)
    geometry = _geometry(shape, tuple(t.stride() for t in inputs), _launch.INT32_MAX)
    if len(geometry) == 1 and geometry[0][6] is None:
        # The common case, one launch over the operands themselves: no per-launch objects.
        n_elements, base, sizes, strides, contiguous, index_64, _ = geometry[0]
        extra = (base,) if with_index_base else ()
        kernel[(-(-n_elements // BLOCK),)](
            *inputs, *outputs, *scalars, n_elements, *extra, *sizes, *strides,
            **constexprs, CONTIGUOUS=contiguous, INDEX_64=index_64, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
        return
    for launch in plan_elementwise(shape, inputs, outputs):
        grid = (-(-launch.n_elements // BLOCK),)
        extra = (launch.index_base,) if with_index_base else ()
        kernel[grid](
            *launch.inputs, *launch.outputs, *scalars, launch.n_elements, *extra,
            *launch.sizes, *launch.strides,
            **constexprs, CONTIGUOUS=launch.contiguous, INDEX_64=launch.index_64, BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
