"""Count the memory traffic and FLOPs of Triton kernels and of torch code, exactly.

On a CPU, Triton's interpreter runs every program instance in numpy, so every load and store a
kernel executes can be watched. ``trace()`` does that: while it is active it wraps the
interpreter's memory instructions (masked loads and stores, atomics) and ``tl.dot``, and it
counts, per kernel launch, the bytes that the masked-in lanes really move, the 32-byte sectors
they touch, the FLOPs of every dot, which tensor argument each access belongs to, and the
accesses that fall outside every tensor argument (a missing mask). Alongside, a
``TorchDispatchMode`` counts the bytes each aten op reads and writes, so a naive torch version
and a fused kernel are compared on the same scale. That includes the torch work a ``kernel_ladder``
custom op does inside its implementation (``TorchOp.inside`` names the op), so an op cannot hide
a reduction or a host sync (``aten._local_scalar_dense``) behind its one Triton launch::

    from utils.trace import trace
    with trace() as t:
        y = kernel_ladder.gelu(x)
    print(t)            # one row per launch / torch op, then the totals
    t.bytes, t.flops, t.num_launches

The wrappers are installed when the outermost trace starts and removed when it ends, so code
that runs outside a trace pays nothing. They wrap whatever is on the interpreter's classes at
that moment (for instance the bf16 numerics of ``kernel_ladder``), so the two compose. Traces nest:
every active trace receives every launch and op.

Only the interpreter can be watched: with compiled kernels (on a GPU) Triton launches are not
seen, and only the torch side is counted.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from triton.runtime import interpreter as _interp

# Import order matters: kernel_ladder.runtime installs the bf16 numerics on the same interpreter class
# before any trace wraps it, so a trace's wrappers sit outside them and restore them intact.
from kernel_ladder import runtime as _runtime

__all__ = [
    "SECTOR_BYTES",
    "TensorTraffic",
    "SectorAccess",
    "StoreMap",
    "Launch",
    "TorchOp",
    "KernelTotal",
    "Trace",
    "trace",
    "OpLog",
    "ideal_bytes",
    "tensor_bytes",
    "format_bytes",
]

#: The unit of a GPU's DRAM/L2 transactions: a load touching any byte of a sector moves all 32.
SECTOR_BYTES = 32
_SECTOR_SHIFT = 5

#: Access maps are kept only for tensors up to this many elements (they cost 4 bytes each).
ACCESS_MAP_MAX_ELEMENTS = 1 << 24


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------


@dataclass
class TensorTraffic:
    """The traffic of one launch to one tensor argument."""

    bytes_read: int = 0
    bytes_written: int = 0
    #: Sum over the launch's load/store instructions of the distinct sectors of this tensor each touched.
    sectors: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class SectorAccess:
    """One memory instruction of one program, as ``trace(record_sectors=True)`` keeps it.

    ``sectors`` are the distinct 32-byte sectors (byte address // 32, ascending) the instruction's
    masked-in lanes touch; ``kind`` is ``"load"``, ``"store"`` or ``"atomic"``; ``tensor`` names
    the argument the accesses fall in ("" when one instruction spans several, "?" when outside all).
    """

    program: int
    kind: str
    tensor: str
    sectors: np.ndarray


@dataclass
class StoreMap:
    """Which programs stored to each element of one tensor argument (``trace(record_writes=True)``).

    The arrays run over the argument's memory in storage order, from its first element to its
    last (``extent`` elements from ``data_ptr``): for a contiguous tensor, its flat index. Only
    ``tl.store`` counts (atomics, meant to be shared, do not).
    """

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    #: Linear program id (x + gx*(y + gy*z)) of the first and of the last store to each element, -1 if none.
    first: np.ndarray
    last: np.ndarray
    #: The last program whose store addressed the element with that lane masked off, -1 if none.
    masked: np.ndarray
    #: The most lanes (pointers, masked or not) of one store instruction that addressed this tensor:
    #: BLOCK for a 1-D kernel, BLOCK_M * BLOCK_N for a 2-D tile.
    lanes: int = 0
    #: program -> (lowest, highest element index it stored to, elements stored); (-1, -1, 0) for a
    #: program whose stores here were all masked off.
    programs: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: program -> the lanes (masked or not) of all its store instructions that addressed this tensor:
    #: the most elements its stores could cover (a kernel storing twice per program reaches twice BLOCK).
    reach: dict[int, int] = field(default_factory=dict)
    #: The store instructions' places in the source, ``(function, line)``: a kernel with several
    #: ``tl.store`` calls has several; ``first_site`` / ``last_site`` index this list (-1 if none).
    sites: list[tuple[str, int]] = field(default_factory=list)
    first_site: np.ndarray | None = None
    last_site: np.ndarray | None = None
    #: ``(earlier site, later site)`` -> (elements, first such element, its program): elements one
    #: program stored to twice, the later store overwriting its own earlier one.
    self_overwrites: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)


@dataclass
class Launch:
    """One Triton kernel launch, as the interpreter executed it."""

    kernel: str
    grid: tuple[int, ...]
    programs: int
    bytes_read: int = 0
    bytes_written: int = 0
    #: Load / store instructions executed (summed over all programs); atomics are counted in ``atomics``.
    loads: int = 0
    stores: int = 0
    atomics: int = 0
    #: Sum over every load/store/atomic instruction of the distinct 32-byte sectors it touches.
    sectors: int = 0
    #: Distinct sectors over the whole launch: the traffic a perfect cache would leave.
    unique_sectors: int = 0
    #: 2*M*N*K of every ``tl.dot``.
    flops: int = 0
    #: ``tl.dot`` calls by their operands' dtypes, ``("bf16", "bf16") -> count`` (summed over all programs).
    dot_dtypes: dict[tuple[str, str], int] = field(default_factory=dict)
    per_tensor: dict[str, TensorTraffic] = field(default_factory=dict)
    #: Masked-in element accesses that fall outside every tensor argument (reads + writes).
    out_of_bounds: int = 0
    out_of_bounds_reads: int = 0
    out_of_bounds_writes: int = 0
    #: With ``trace(record_access=True)``: arg name -> int32 array shaped like the tensor, the linear
    #: id (x + gx*(y + gy*z)) of the last program that touched each element, -1 where none did.
    access: dict[str, np.ndarray] = field(default_factory=dict)
    #: With ``trace(record_sectors=True)``: every memory instruction in the order the interpreter ran
    #: them (program by program), with the program's linear id and the sectors it touched — the
    #: ordered stream a cache model (``utils.l2cache``) replays.
    sector_log: list[SectorAccess] = field(default_factory=list)
    #: With ``trace(record_writes=True)``: arg name -> which program stored to each of its elements.
    store_maps: dict[str, StoreMap] = field(default_factory=dict)
    #: arg name -> ``(first byte, end byte)`` of the memory the tensor argument spans, so that its
    #: ``per_tensor`` traffic can be matched with the caller's tensors.
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)

    def program_sectors(self) -> dict[int, list[SectorAccess]]:
        """``sector_log`` grouped by program (linear id, ascending), each program's instructions in order."""
        programs: dict[int, list[SectorAccess]] = {}
        for access in self.sector_log:
            programs.setdefault(access.program, []).append(access)
        return dict(sorted(programs.items()))

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class TorchOp:
    """One aten op seen by the trace."""

    name: str
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0
    #: 1 for an op that runs a kernel, 0 for views and allocations (they move nothing).
    launches: int = 1
    #: The ``kernel_ladder::`` custom op whose implementation ran this aten op ("" for one called directly).
    inside: str = ""

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class KernelTotal:
    """All launches of one kernel (or one aten op) in a trace: :meth:`Trace.by_kernel`."""

    name: str
    launches: int = 0
    bytes: int = 0
    flops: int = 0


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of distinct memory a tensor view covers (a broadcast, stride-0 dim counts once)."""
    if t.numel() == 0:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def ideal_bytes(*tensors: torch.Tensor) -> int:
    """The least traffic an op can have: each input read once, each output written once.

    Pass the inputs and the outputs: the result is the sum of their sizes in bytes
    (``tensor_bytes``, which equals ``nbytes`` except for broadcast views).
    """
    return sum(tensor_bytes(t) for t in tensors)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.54 kB'`` (decimal units, like GB/s)."""
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _format_count(n: int) -> str:
    return f"{n:,}"


def _view_extent(t: torch.Tensor) -> int:
    """Number of storage elements from the view's first element to its last."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _logical_offsets(shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """Storage offset (in elements, from the view's start) of every logical element, shaped like the view."""
    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip(shape, strides):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
    return offsets


def _unique_sectors(addresses: np.ndarray, itemsize: int) -> np.ndarray:
    sectors = addresses >> np.uint64(_SECTOR_SHIFT)
    # An element that straddles a sector boundary touches two (only unaligned pointers do).
    if itemsize > 1 and np.any((addresses & np.uint64(SECTOR_BYTES - 1)) > SECTOR_BYTES - itemsize):
        sectors = np.concatenate([sectors, (addresses + np.uint64(itemsize - 1)) >> np.uint64(_SECTOR_SHIFT)])
    if sectors.size < 2:
        return sectors
    # Blocks of offsets usually come in ascending order: skip the sort then (np.unique always pays).
    if not np.all(sectors[1:] >= sectors[:-1]):
        sectors = np.sort(sectors)
    keep = np.empty(sectors.size, dtype=bool)
    keep[0] = True
    np.not_equal(sectors[1:], sectors[:-1], out=keep[1:])
    return sectors[keep]


_TRITON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(tl.__file__))) + os.sep
# The wrappers around the interpreter's builder (this tracer, kernel_ladder's bf16 numerics) are not the kernel.
_WRAPPER_FILES = frozenset(
    os.path.join(os.path.dirname(os.path.abspath(_runtime.__file__)), name)
    for name in ("runtime.py", "_interpreter_numerics.py")
) | {os.path.abspath(__file__)}


def _store_site() -> tuple[str, int]:
    """``(function, line)`` of the kernel source line whose ``tl.store`` is executing now."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TRITON_DIR) and path not in _WRAPPER_FILES:
            return frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "?", 0


# ----------------------------------------------------------------------------------------------
# Triton side: one launch being recorded
# ----------------------------------------------------------------------------------------------

_LOAD, _STORE, _ATOMIC = 0, 1, 2


class _Span:
    __slots__ = ("name", "lo", "hi", "itemsize", "shape", "strides", "traffic", "access", "stores")

    def __init__(self, name: str, tensor: torch.Tensor, record_access: bool, record_writes: bool = False) -> None:
        self.name = name
        self.lo = tensor.data_ptr()
        extent = _view_extent(tensor)
        self.itemsize = tensor.element_size()
        self.hi = self.lo + extent * self.itemsize
        self.shape = tuple(tensor.shape)
        self.strides = tuple(tensor.stride())
        self.traffic = TensorTraffic()
        keep = record_access and extent <= ACCESS_MAP_MAX_ELEMENTS
        self.access = np.full(max(extent, 1), -1, dtype=np.int32) if keep else None
        self.stores: StoreMap | None = None
        if record_writes and 0 < extent <= ACCESS_MAP_MAX_ELEMENTS:
            self.stores = StoreMap(
                data_ptr=self.lo, shape=self.shape, strides=self.strides,
                first=np.full(extent, -1, dtype=np.int32), last=np.full(extent, -1, dtype=np.int32),
                masked=np.full(extent, -1, dtype=np.int32),
                first_site=np.full(extent, -1, dtype=np.int32), last_site=np.full(extent, -1, dtype=np.int32),
            )


class _LaunchState:
    def __init__(self, kernel: str, requested_grid: Any, record_access: bool, block_oob: bool,
                 record_sectors: bool = False, record_writes: bool = False) -> None:
        self.kernel = kernel
        self.record_sectors = record_sectors
        self.record_writes = record_writes
        self.requested_rank = len(requested_grid) if isinstance(requested_grid, tuple) else None
        self.record_access = record_access
        self.block_oob = block_oob
        self.grid = (1, 1, 1)
        self.spans: list[_Span] = []
        self.launch = Launch(kernel=kernel, grid=(), programs=0)
        self.sector_chunks: list[np.ndarray] = []

    def set_args(self, arg_names: list[str], args_hst: list[Any], kwargs_hst: dict[str, Any]) -> None:
        """Register the host tensors the interpreter will address (their pointers are the real ones)."""
        seen: set[str] = set()

        def add(name: str, value: Any) -> None:
            if isinstance(value, tuple):
                for i, item in enumerate(value):
                    add(f"{name}[{i}]", item)
                return
            base = getattr(value, "base", None)
            if isinstance(value, _interp.TensorDescriptor) and base is not None:
                value = base
            elif not isinstance(value, torch.Tensor) and isinstance(base, torch.Tensor):
                value = base  # triton.runtime.jit.TensorWrapper (reinterpreted dtype)
            if isinstance(value, torch.Tensor) and name not in seen:
                seen.add(name)
                self.spans.append(_Span(name, value, self.record_access, self.record_writes))

        for i, value in enumerate(args_hst):
            add(arg_names[i] if i < len(arg_names) else f"arg{i}", value)
        for name, value in kwargs_hst.items():
            add(name, value)
        self.launch.per_tensor = {span.name: span.traffic for span in self.spans}
        self.launch.spans = {span.name: (span.lo, span.hi) for span in self.spans}

    def program_id(self, builder: Any) -> int:
        x, y, z = builder.grid_idx
        nx, ny, _ = self.grid
        return x + nx * (y + ny * z)

    def record(self, builder: Any, ptrs: Any, mask: Any, kind: int) -> np.ndarray | None:
        """Account one memory instruction; return a new mask if out-of-bounds lanes must be blocked."""
        launch = self.launch
        if kind == _LOAD:
            launch.loads += 1
        elif kind == _STORE:
            launch.stores += 1
        else:
            launch.atomics += 1
        pointers = np.asarray(ptrs.data)
        if mask is None:
            lanes = None
            active = pointers.reshape(-1)
        else:
            lanes = np.asarray(mask.data)
            if lanes.shape != pointers.shape:
                lanes = np.broadcast_to(lanes, pointers.shape)
            active = pointers[lanes]
        n = active.size
        itemsize = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        if kind == _STORE and self.record_writes:
            self._note_store(builder, pointers, lanes, itemsize)
        if n == 0:
            return None
        active = active.astype(np.uint64, copy=False)
        nbytes = n * itemsize
        if kind != _STORE:
            launch.bytes_read += nbytes
        if kind != _LOAD:
            launch.bytes_written += nbytes
        sectors = _unique_sectors(active, itemsize)
        launch.sectors += sectors.size
        self.sector_chunks.append(sectors)

        lowest, highest = int(active.min()), int(active.max())
        for span in self.spans:  # fast path: the whole instruction hits one tensor
            if span.lo <= lowest and highest < span.hi:
                self._credit(span, active, nbytes, sectors.size, kind, builder)
                if self.record_sectors:
                    self._log(builder, kind, span.name, sectors)
                return None

        owner = np.full(n, -1, dtype=np.int32)
        for index, span in enumerate(self.spans):
            inside = (owner < 0) & (active >= np.uint64(span.lo)) & (active < np.uint64(span.hi))
            owner[inside] = index
        for index, span in enumerate(self.spans):
            mine = owner == index
            count = int(np.count_nonzero(mine))
            if count:
                sub = active[mine]
                self._credit(span, sub, count * itemsize, _unique_sectors(sub, itemsize).size, kind, builder)
        outside = owner < 0
        stray = int(np.count_nonzero(outside))
        if self.record_sectors:
            owners = {int(i) for i in np.unique(owner)}
            name = "?" if owners == {-1} else (self.spans[owners.pop()].name if len(owners) == 1 else "")
            self._log(builder, kind, name, sectors)
        if stray == 0:
            return None
        launch.out_of_bounds += stray
        if kind != _STORE:
            launch.out_of_bounds_reads += stray
        if kind != _LOAD:
            launch.out_of_bounds_writes += stray
        if not self.block_oob:
            return None
        blocked = np.ones(pointers.shape, dtype=bool) if lanes is None else lanes.copy()
        blocked[blocked] = ~outside
        return blocked

    def _note_store(self, builder: Any, pointers: np.ndarray, lanes: np.ndarray | None, itemsize: int) -> None:
        """Record, per element of each tensor this store addresses, the program storing it or masking it off."""
        flat = pointers.reshape(-1).astype(np.uint64, copy=False)
        on = np.ones(flat.size, dtype=bool) if lanes is None else lanes.reshape(-1)
        program = self.program_id(builder)
        site_key: tuple[str, int] | None = None
        for span in self.spans:
            stores = span.stores
            if stores is None:
                continue
            inside = (flat >= np.uint64(span.lo)) & (flat < np.uint64(span.hi))
            if not inside.any():
                continue
            if site_key is None:
                site_key = _store_site()
            if site_key not in stores.sites:
                stores.sites.append(site_key)
            site = stores.sites.index(site_key)
            stores.lanes = max(stores.lanes, int(flat.size))
            stores.reach[program] = stores.reach.get(program, 0) + int(flat.size)
            elements = ((flat - np.uint64(span.lo)) // np.uint64(span.itemsize)).astype(np.int64)
            stored = elements[inside & on]
            switched_off = elements[inside & ~on]
            if switched_off.size:
                stores.masked[switched_off] = program
            low, high, count = stores.programs.get(program, (-1, -1, 0))
            if stored.size:
                again = stored[(stores.last[stored] == program) & (stores.last_site[stored] != site)]
                if again.size:
                    for earlier in np.unique(stores.last_site[again]).tolist():
                        mine = again[stores.last_site[again] == earlier]
                        known = stores.self_overwrites.get((earlier, site))
                        first = int(mine.min()) if known is None else known[1]
                        owner = program if known is None else known[2]
                        total = int(mine.size) + (0 if known is None else known[0])
                        stores.self_overwrites[(earlier, site)] = (total, first, owner)
                fresh = stored[stores.first[stored] < 0]
                stores.first[fresh] = program
                stores.first_site[fresh] = site
                stores.last[stored] = program
                stores.last_site[stored] = site
                lowest, highest = int(stored.min()), int(stored.max())
                low = lowest if low < 0 else min(low, lowest)
                high = max(high, highest)
                count += int(stored.size)
            stores.programs[program] = (low, high, count)

    def _log(self, builder: Any, kind: int, tensor: str, sectors: np.ndarray) -> None:
        kind_name = ("load", "store", "atomic")[kind]
        self.launch.sector_log.append(SectorAccess(self.program_id(builder), kind_name, tensor, sectors))

    def _credit(self, span: _Span, addresses: np.ndarray, nbytes: int, sectors: int, kind: int,
                builder: Any) -> None:
        traffic = span.traffic
        if kind != _STORE:
            traffic.bytes_read += nbytes
        if kind != _LOAD:
            traffic.bytes_written += nbytes
        traffic.sectors += sectors
        if span.access is not None:
            elements = (addresses - np.uint64(span.lo)) // np.uint64(span.itemsize)
            span.access[elements.astype(np.int64)] = self.program_id(builder)

    def finish(self) -> Launch:
        launch = self.launch
        nx, ny, nz = self.grid
        grid = self.grid
        if self.requested_rank is not None:
            grid = grid[: max(1, self.requested_rank)]
        else:
            while len(grid) > 1 and grid[-1] == 1:
                grid = grid[:-1]
        launch.grid = tuple(int(g) for g in grid)
        launch.programs = int(nx * ny * nz)
        if self.sector_chunks:
            launch.unique_sectors = int(np.unique(np.concatenate(self.sector_chunks)).size)
        for span in self.spans:
            if span.access is not None:
                launch.access[span.name] = span.access[_logical_offsets(span.shape, span.strides)]
            if span.stores is not None and span.stores.lanes:  # only the tensors the kernel stored to
                launch.store_maps[span.name] = span.stores
        self.sector_chunks = []
        return launch


# ----------------------------------------------------------------------------------------------
# Torch side
# ----------------------------------------------------------------------------------------------

# Ops that allocate or relabel memory without moving it (``_unsafe_view`` is a view its schema
# does not mark as one: a batched matmul's result reshaped).
_ALLOCATIONS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "set_", "lift_fresh", "_unsafe_view",
})
# Factories that take a tensor only for its shape, dtype and device: they write, never read it.
_METADATA_INPUT = frozenset({
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_full",
})
# In-place ops that overwrite ``self`` without reading it.
_OVERWRITES = frozenset({
    "copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_",
    "geometric_", "cauchy_", "log_normal_",
})
_MATMUL_K_FROM_FIRST = frozenset({"mm", "bmm", "mv", "dot", "vdot", "matmul", "_int_mm", "_scaled_mm"})
_MATMUL_K_FROM_SECOND = frozenset({"addmm", "baddbmm", "addmv", "_addmm_activation"})
_CONVOLUTIONS = frozenset({"convolution", "_convolution", "convolution_overrideable", "mkldnn_convolution"})
_ATTENTIONS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
})


def _first_tensor(value: Any) -> torch.Tensor | None:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def _torch_flops(base: str, args: tuple, out: Any) -> int:
    """Tensor-core work of an aten op: 2*M*N*K for the matmul family, 0 for everything else."""
    result = _first_tensor(out)
    if result is None:
        return 0
    if base in _MATMUL_K_FROM_FIRST:
        return 2 * result.numel() * args[0].shape[-1]
    if base in _MATMUL_K_FROM_SECOND:
        return 2 * result.numel() * args[1].shape[-1]
    if base == "addbmm":  # sums the batch of products into one M x N result
        batch, m, k = args[1].shape
        return 2 * batch * m * k * args[2].shape[-1]
    if base in _CONVOLUTIONS:
        x, weight = args[0], args[1]
        transposed = bool(args[6]) if len(args) > 6 else False
        taps = int(np.prod(weight.shape[2:], dtype=np.int64))
        if transposed:
            return 2 * x.numel() * weight.shape[1] * taps
        return 2 * result.numel() * weight.shape[1] * taps
    if base in _ATTENTIONS:
        q, k, v = args[0], args[1], args[2]
        batch_heads = int(np.prod(q.shape[:-2], dtype=np.int64))
        return 2 * batch_heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return 0


def _key(t: torch.Tensor) -> Any:
    try:
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except Exception:  # fake/meta tensors have no storage
        return id(t)


def _torch_op(func: Any, args: tuple, kwargs: dict, out: Any) -> TorchOp:
    name = str(func)
    base = func._schema.name.split("::", 1)[-1]
    if func.is_view or base in _ALLOCATIONS:
        return TorchOp(name=name, launches=0)
    schema_args = func._schema.arguments
    out_names = {a.name for a in schema_args if a.is_out}
    mutated = []
    overwritten: set[Any] = set()
    for position, argument in enumerate(schema_args):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            for leaf in tree_leaves(value):
                if isinstance(leaf, torch.Tensor):
                    mutated.append(leaf)
                    if base in _OVERWRITES and position == 0:
                        overwritten.add(_key(leaf))

    reads: dict[Any, torch.Tensor] = {}
    read_args = () if base in _METADATA_INPUT else (args, {k: v for k, v in kwargs.items() if k not in out_names})
    for leaf in tree_leaves(read_args):
        if isinstance(leaf, torch.Tensor) and _key(leaf) not in overwritten:
            reads.setdefault(_key(leaf), leaf)
    writes: dict[Any, torch.Tensor] = {}
    for leaf in [*tree_leaves(out), *mutated]:
        if isinstance(leaf, torch.Tensor):
            writes.setdefault(_key(leaf), leaf)
    return TorchOp(
        name=name,
        bytes_read=sum(tensor_bytes(t) for t in reads.values()),
        bytes_written=sum(tensor_bytes(t) for t in writes.values()),
        flops=_torch_flops(base, args, out),
    )


class _TorchCounter(TorchDispatchMode):
    """Counts every aten op below autograd, including those a ``kernel_ladder::`` custom op runs inside.

    A ``kernel_ladder::`` op is not counted as an op of its own: its Triton launches are recorded as
    launches, and its implementation runs with this mode re-entered, so the aten ops it runs
    (a reduction, a copy, a host sync) are counted too, with :attr:`TorchOp.inside` naming the op.
    Views and allocations inside such an op are left out: they move nothing and launch nothing.
    (Under a ``utils.memory.peak_memory`` entered after the trace, that recorder runs the op's body
    itself: the same work is counted, without ``inside`` and with the views listed.)
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kernel_ladder" and not _STATE.in_launch:
            return self._run_kernels_op(func, args, kwargs)
        if func._can_decompose():
            # A composite op reaches this mode undecomposed where autograd is not in the way (inside
            # a custom op, under inference mode): count what it runs (``contiguous`` -> ``clone``).
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        # The interpreter's own copies of kernel arguments are not the program's traffic.
        if _STATE.in_launch:
            return out
        counting = [active for active in _STATE.active if active.count_torch]
        if counting:
            op = _torch_op(func, args, kwargs, out)
            if _STATE.inside:
                op.inside = _STATE.inside[-1]
            if op.launches or not op.inside:
                for active in counting:
                    active.torch_ops.append(op)
        return out

    def _run_kernels_op(self, func, args, kwargs):
        """Run a ``kernel_ladder::`` op's implementation below this mode's dispatch key, with the mode active."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or any(_is_fake(t) or t.device.type == "meta" for t in tensors):
            return func(*args, **kwargs)  # a tracer's fake tensors: nothing runs, nothing to count
        backend = getattr(torch._C.DispatchKey, torch._C._dispatch_key_for_device(tensors[0].device.type))
        _STATE.inside.append(str(func))
        try:
            with self:
                return func.redispatch(torch._C.DispatchKeySet(backend), *args, **kwargs)
        finally:
            _STATE.inside.pop()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 (imported by torch already)

    return is_fake(t)


# ----------------------------------------------------------------------------------------------
# Installing and removing the wrappers
# ----------------------------------------------------------------------------------------------


class _GlobalState:
    def __init__(self) -> None:
        self.active: list[Trace] = []
        self.launch: _LaunchState | None = None
        self.in_launch = 0
        #: The ``kernel_ladder::`` ops whose implementations are running (innermost last).
        self.inside: list[str] = []
        self.installed: list[tuple[type, str, Any, Any]] = []
        self.mode: _TorchCounter | None = None


_STATE = _GlobalState()


def _wrap_masked_load(original):
    @functools.wraps(original)
    def create_masked_load(self, ptrs, mask, *rest, **kwargs):
        state = _STATE.launch
        if state is not None:
            blocked = state.record(self, ptrs, mask, _LOAD)
            if blocked is not None:
                mask = _interp.TensorHandle(blocked, tl.int1)
        return original(self, ptrs, mask, *rest, **kwargs)

    return create_masked_load


def _wrap_masked_store(original):
    @functools.wraps(original)
    def create_masked_store(self, ptrs, value, mask, *rest, **kwargs):
        state = _STATE.launch
        if state is not None:
            blocked = state.record(self, ptrs, mask, _STORE)
            if blocked is not None:
                mask = _interp.TensorHandle(blocked, tl.int1)
        return original(self, ptrs, value, mask, *rest, **kwargs)

    return create_masked_store


def _wrap_atomic_rmw(original):
    @functools.wraps(original)
    def create_atomic_rmw(self, rmw_op, ptr, val, mask, *rest, **kwargs):
        state = _STATE.launch
        if state is not None:
            blocked = state.record(self, ptr, mask, _ATOMIC)
            if blocked is not None:
                mask = _interp.TensorHandle(blocked, tl.int1)
        return original(self, rmw_op, ptr, val, mask, *rest, **kwargs)

    return create_atomic_rmw


def _wrap_atomic_cas(original):
    @functools.wraps(original)
    def create_atomic_cas(self, ptr, *rest, **kwargs):
        state = _STATE.launch
        if state is not None:
            state.record(self, ptr, None, _ATOMIC)  # no mask to block with: counted only
        return original(self, ptr, *rest, **kwargs)

    return create_atomic_cas


def _wrap_dot(original):
    @functools.wraps(original)
    def create_dot(self, a, b, *rest, **kwargs):
        state = _STATE.launch
        if state is not None:
            a_shape, b_shape = np.shape(a.data), np.shape(b.data)
            rows = int(np.prod(a_shape[:-1], dtype=np.int64))  # batch * M
            state.launch.flops += 2 * rows * int(b_shape[-1]) * int(a_shape[-1])
            operands = (str(getattr(a, "dtype", "?")), str(getattr(b, "dtype", "?")))
            state.launch.dot_dtypes[operands] = state.launch.dot_dtypes.get(operands, 0) + 1
        return original(self, a, b, *rest, **kwargs)

    return create_dot


def _wrap_set_grid_dim(original):
    @functools.wraps(original)
    def set_grid_dim(self, nx, ny, nz):
        if _STATE.launch is not None:
            _STATE.launch.grid = (int(nx), int(ny), int(nz))
        return original(self, nx, ny, nz)

    return set_grid_dim


def _wrap_init_args(original):
    @functools.wraps(original)
    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = original(self, args_dev, kwargs)
        if _STATE.launch is not None:
            _STATE.launch.set_args(list(self.arg_names), list(args_hst), dict(kwargs_hst))
        return args_hst, kwargs_hst

    return _init_args_hst


def _wrap_grid_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if not _STATE.active or _STATE.launch is not None:
            return original(self, *args, **kwargs)
        state = _LaunchState(
            kernel=getattr(self.fn, "__name__", "kernel"),
            requested_grid=self.grid,
            record_access=any(t.record_access for t in _STATE.active),
            block_oob=any(t.block_out_of_bounds for t in _STATE.active),
            record_sectors=any(getattr(t, "record_sectors", False) for t in _STATE.active),
            record_writes=any(getattr(t, "record_writes", False) for t in _STATE.active),
        )
        _STATE.launch = state
        _STATE.in_launch += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _STATE.launch = None
            _STATE.in_launch -= 1
        launch = state.finish()
        for active in _STATE.active:
            active.launches.append(launch)
        return result

    return __call__


_PATCHES = (
    (_interp.InterpreterBuilder, "create_masked_load", _wrap_masked_load),
    (_interp.InterpreterBuilder, "create_masked_store", _wrap_masked_store),
    (_interp.InterpreterBuilder, "create_atomic_rmw", _wrap_atomic_rmw),
    (_interp.InterpreterBuilder, "create_atomic_cas", _wrap_atomic_cas),
    (_interp.InterpreterBuilder, "create_dot", _wrap_dot),
    (_interp.InterpreterBuilder, "set_grid_dim", _wrap_set_grid_dim),
    (_interp.GridExecutor, "_init_args_hst", _wrap_init_args),
    (_interp.GridExecutor, "__call__", _wrap_grid_call),
)


def _install() -> None:
    for cls, name, make in _PATCHES:
        original = getattr(cls, name)
        wrapper = make(original)
        setattr(cls, name, wrapper)
        _STATE.installed.append((cls, name, original, wrapper))
    _STATE.mode = _TorchCounter()
    _STATE.mode.__enter__()


def _uninstall() -> None:
    mode, _STATE.mode = _STATE.mode, None
    try:
        if mode is not None:
            mode.__exit__(None, None, None)
    finally:
        for cls, name, original, wrapper in reversed(_STATE.installed):
            # If something wrapped our wrapper meanwhile, leave the chain alone: ours is inert
            # without an active trace, and removing it would drop the newer wrapper.
            if cls.__dict__.get(name) is wrapper:
                setattr(cls, name, original)
        _STATE.installed.clear()


# ----------------------------------------------------------------------------------------------
# The public trace
# ----------------------------------------------------------------------------------------------


class Trace:
    """What a ``with trace() as t:`` block recorded; totals cover Triton launches and torch ops."""

    def __init__(self, record_access: bool = False, torch_ops: bool = True,
                 block_out_of_bounds: bool = False, record_sectors: bool = False,
                 record_writes: bool = False) -> None:
        self.record_access = record_access
        self.record_writes = record_writes
        self.record_sectors = record_sectors
        self.count_torch = torch_ops
        self.block_out_of_bounds = block_out_of_bounds
        self.launches: list[Launch] = []
        self.torch_ops: list[TorchOp] = []
        self._state = "new"

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        if self._state != "new":
            raise RuntimeError("utils.trace: a Trace records once; start a new one with trace()")
        if _STATE.launch is not None:
            raise RuntimeError("utils.trace: cannot start a trace inside a running Triton kernel")
        if not _runtime.INTERPRETER:
            warnings.warn("utils.trace: kernels are compiled (not interpreted), so Triton launches are not "
                          "traced; only torch ops are counted", stacklevel=2)
        if not _STATE.active:
            _install()
        _STATE.active.append(self)
        self._state = "active"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state != "active":
            return
        if _STATE.active[-1] is not self:
            raise RuntimeError("utils.trace: nested traces must end in reverse order of starting")
        _STATE.active.pop()
        self._state = "done"
        if not _STATE.active:
            _uninstall()

    # -- totals ---------------------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return sum(x.bytes_read for x in self.launches) + sum(x.bytes_read for x in self.torch_ops)

    @property
    def bytes_written(self) -> int:
        return sum(x.bytes_written for x in self.launches) + sum(x.bytes_written for x in self.torch_ops)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def flops(self) -> int:
        return sum(x.flops for x in self.launches) + sum(x.flops for x in self.torch_ops)

    @property
    def num_launches(self) -> int:
        """Triton launches plus torch ops that run a kernel (views and allocations launch nothing)."""
        return len(self.launches) + sum(op.launches for op in self.torch_ops)

    @property
    def sectors(self) -> int:
        return sum(x.sectors for x in self.launches)

    @property
    def unique_sectors(self) -> int:
        return sum(x.unique_sectors for x in self.launches)

    @property
    def out_of_bounds(self) -> int:
        return sum(x.out_of_bounds for x in self.launches)

    def summary(self) -> dict[str, int]:
        """The totals as a dict (Triton sectors only: torch ops have no sector counts)."""
        return {
            "launches": self.num_launches,
            "triton_launches": len(self.launches),
            "torch_ops": sum(op.launches for op in self.torch_ops),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "bytes": self.bytes,
            "flops": self.flops,
            "sectors": self.sectors,
            "unique_sectors": self.unique_sectors,
            "out_of_bounds": self.out_of_bounds,
        }

    def by_kernel(self) -> list[KernelTotal]:
        """The trace summed per kernel, most bytes first: Triton launches by kernel name, aten ops
        that launch a kernel as ``torch.<op>`` (views and allocations left out) — which kernels a
        step's traffic goes to, without one row per launch."""
        totals: dict[str, KernelTotal] = {}
        rows = [(x.kernel, x.bytes, x.flops) for x in self.launches]
        rows += [("torch." + op.name.removesuffix(".default"), op.bytes, op.flops)
                 for op in self.torch_ops if op.launches]
        for name, nbytes, flops in rows:
            total = totals.setdefault(name, KernelTotal(name))
            total.launches += 1
            total.bytes += nbytes
            total.flops += flops
        return sorted(totals.values(), key=lambda k: (-k.bytes, k.name))

    def table(self) -> str:
        """One row per Triton launch, then one per torch op, then the totals; exact byte counts.

        Kept within 100 characters for the usual names: an aten op is named without its
        ``.default`` overload, ops that launch no kernel (views, allocations) are of kind
        ``view/alloc``, the sector columns (``sectors``, ``unique``: Triton launches only) appear
        only when the trace has a Triton launch, and the out-of-bounds column (``OOB``) only when
        some launch accessed memory outside every tensor argument.
        """
        header = ("kind", "name", "grid", "read B", "write B", "total B", "FLOPs", "sectors",
                  "unique", "OOB")
        rows = [header]
        for x in self.launches:
            rows.append(("triton", x.kernel, "x".join(map(str, x.grid)), _format_count(x.bytes_read),
                         _format_count(x.bytes_written), _format_count(x.bytes), _format_count(x.flops),
                         _format_count(x.sectors), _format_count(x.unique_sectors),
                         _format_count(x.out_of_bounds)))
        for op in self.torch_ops:
            rows.append(("torch" if op.launches else "view/alloc", op.name.removesuffix(".default"), "",
                         _format_count(op.bytes_read), _format_count(op.bytes_written), _format_count(op.bytes),
                         _format_count(op.flops), "", "", ""))
        rows.append(("total", f"{self.num_launches} launches", "", _format_count(self.bytes_read),
                     _format_count(self.bytes_written), _format_count(self.bytes), _format_count(self.flops),
                     _format_count(self.sectors), _format_count(self.unique_sectors),
                     _format_count(self.out_of_bounds)))
        keep = [i for i, name in enumerate(header)
                if (name not in ("sectors", "unique") or self.launches) and (name != "OOB" or self.out_of_bounds)]
        rows = [tuple(row[i] for i in keep) for row in rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = []
        for n, row in enumerate(rows):
            cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
            if n == 0 or n == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (f"Trace(launches={self.num_launches}, bytes={self.bytes}, flops={self.flops}, "
                f"out_of_bounds={self.out_of_bounds})")


def trace(record_access: bool = False, torch_ops: bool = True, block_out_of_bounds: bool = False,
          record_sectors: bool = False, record_writes: bool = False) -> Trace:
    """Record Triton launches (in the interpreter) and torch aten ops inside a ``with`` block.

    Args:
        record_access: keep, per launch and tensor argument, which program touched each element
            (``Launch.access``), for access maps; meant for small tensors.
        torch_ops: also count aten ops (``Trace.torch_ops``).
        block_out_of_bounds: mask off accesses outside every tensor argument before the
            interpreter performs them (loads give ``other``/0, stores are dropped), so a buggy
            kernel cannot read or corrupt host memory; they are still counted. Off by default,
            so that tracing never changes what a kernel does.
        record_sectors: keep, per launch, every memory instruction's program id and sectors in
            execution order (``Launch.sector_log``), for cache models such as ``utils.l2cache``.
        record_writes: keep, per launch and tensor argument, which programs stored to each element
            and which masked a store to it off (``Launch.store_maps``): the exercise checker's evidence
            for where a wrong result comes from.
    """
    return Trace(record_access=record_access, torch_ops=torch_ops, block_out_of_bounds=block_out_of_bounds,
                 record_sectors=record_sectors, record_writes=record_writes)


class OpLog(TorchDispatchMode):
    """Which operators ran inside a ``with`` block, as the dispatcher saw them (below autograd, so a
    backward's ops count too): the lighter question beside :class:`Trace`'s bytes.

    Attributes:
        counts: calls per operator name, ``"aten.mm"``, ``"kernel_ladder.rms_norm"`` (a ``Counter``).
        shapes: the shape of every tensor an operator returned, in order.
        largest: ``(bytes, shape, operator)`` of the largest tensor any operator returned.
        calls: ``(func, args, kwargs)`` of the operators of namespace ``keep_calls`` (``"kernel_ladder"``,
            say), to be called again; empty when ``keep_calls`` is None.
    """

    def __init__(self, keep_calls: str | None = None) -> None:
        super().__init__()
        self.keep_calls = keep_calls
        self.counts: Counter[str] = Counter()
        self.shapes: list[tuple[int, ...]] = []
        self.largest: tuple[int, tuple[int, ...] | None, str | None] = (0, None, None)
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if self.keep_calls is not None and func.namespace == self.keep_calls:
            self.calls.append((func, args, kwargs))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
                if tensor_bytes(t) > self.largest[0]:
                    self.largest = (tensor_bytes(t), tuple(t.shape), name)
        return out

    @property
    def names(self) -> set[str]:
        """Every operator that ran."""
        return set(self.counts)

    def matching(self, *prefixes: str) -> list[str]:
        """The operators that ran whose names start with any of ``prefixes``, sorted."""
        return sorted(n for n in self.counts if n.startswith(prefixes))
