"""What one warp's memory request costs: its 32 lanes' addresses → 32-byte sectors and 128-byte lines.

A GPU runs a load or store for a *warp* of 32 threads (lanes) as one instruction with 32
addresses. The memory system does not move those bytes one by one: it moves whole **32-byte
sectors**, and it looks them up in **128-byte cache lines** (four sectors each). A request costs
the number of distinct sectors its lanes touch; "for devices of compute capability 6.0 or higher
... the concurrent accesses of the threads of a warp will coalesce into a number of transactions
equal to the number of 32-byte transactions necessary to service all of the threads of the warp"
(CUDA C++ Best Practices Guide, *Coalesced Access to Global Memory*). So 32 lanes reading 32
consecutive fp32 values (128 bytes) cost 4 sectors in 1 line — every byte fetched is used — while
32 lanes reading one fp32 each from 32 different rows of a row-major matrix cost 32 sectors in 32
lines, of which 4 bytes in 32 are used.

This module simulates exactly that, for teaching: a :class:`WarpRequest` from the lanes' byte
addresses, its sectors, lines and **efficiency = useful bytes / fetched bytes**, and
:func:`tile_requests`, which splits a Triton block (a 2-D tile) into warp requests the way a
blocked layout does (lanes run along one dimension first, each lane holding a few consecutive
elements), so that the same tile can be costed with lanes along its contiguous dimension
(coalesced) or across it (strided). It models one request in isolation: no caches, no reuse
between requests (:mod:`utils.l2cache` models that), addresses assumed to be the real ones.

Nsight Compute reports the same quantities measured:
``l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum`` divided by
``l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum`` is sectors per request (4 is ideal for
4-byte lanes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = [
    "WARP_SIZE",
    "SECTOR_BYTES",
    "LINE_BYTES",
    "WarpRequest",
    "TileAccess",
    "warp_request",
    "strided_warp",
    "tile_requests",
    "matrix_strides",
]

#: Threads that issue one memory instruction together.
WARP_SIZE = 32
#: The unit DRAM and L2 move data in.
SECTOR_BYTES = 32
#: A cache line: four sectors, one tag.
LINE_BYTES = 128


@dataclass(frozen=True)
class WarpRequest:
    """One warp-wide memory instruction: each lane reads (or writes) ``bytes_per_lane`` bytes.

    ``addresses[i]`` is lane ``i``'s first byte; lanes where ``active`` is False (masked off)
    move nothing.
    """

    addresses: np.ndarray
    bytes_per_lane: int = 4
    active: np.ndarray | None = None

    def __post_init__(self) -> None:
        addresses = np.asarray(self.addresses, dtype=np.int64).reshape(-1)
        if addresses.size > WARP_SIZE:
            raise ValueError(f"utils.coalescing: a warp has {WARP_SIZE} lanes, got {addresses.size} addresses")
        if self.bytes_per_lane < 1:
            raise ValueError(f"utils.coalescing: bytes_per_lane must be >= 1, got {self.bytes_per_lane}")
        active = (np.ones(addresses.size, dtype=bool) if self.active is None
                  else np.asarray(self.active, dtype=bool).reshape(-1))
        if active.size != addresses.size:
            raise ValueError(f"utils.coalescing: active has {active.size} lanes, addresses {addresses.size}")
        object.__setattr__(self, "addresses", addresses)
        object.__setattr__(self, "active", active)

    @property
    def lanes(self) -> int:
        """Lanes that take part (active ones)."""
        return int(self.active.sum())

    def lane_sectors(self) -> list[np.ndarray]:
        """The sectors each lane touches (empty for an inactive lane; two if its bytes straddle a boundary)."""
        result = []
        for address, on in zip(self.addresses, self.active):
            if not on:
                result.append(np.empty(0, dtype=np.int64))
                continue
            first, last = address // SECTOR_BYTES, (address + self.bytes_per_lane - 1) // SECTOR_BYTES
            result.append(np.arange(first, last + 1, dtype=np.int64))
        return result

    @cached_property
    def _bytes(self) -> np.ndarray:
        starts = self.addresses[self.active]
        if starts.size == 0:
            return np.empty(0, dtype=np.int64)
        return np.unique((starts[:, None] + np.arange(self.bytes_per_lane, dtype=np.int64)[None, :]).reshape(-1))

    @cached_property
    def sectors(self) -> np.ndarray:
        """Distinct 32-byte sectors the request touches (address // 32), ascending."""
        return np.unique(self._bytes // SECTOR_BYTES)

    @cached_property
    def lines(self) -> np.ndarray:
        """Distinct 128-byte lines the request touches: one tag lookup (transaction) each."""
        return np.unique(self._bytes // LINE_BYTES)

    @property
    def requested_bytes(self) -> int:
        """Bytes the active lanes ask for (lanes reading the same address count each time)."""
        return self.lanes * self.bytes_per_lane

    @property
    def useful_bytes(self) -> int:
        """Distinct bytes the active lanes ask for."""
        return int(self._bytes.size)

    @property
    def fetched_bytes(self) -> int:
        """Bytes the memory system moves: whole sectors."""
        return int(self.sectors.size) * SECTOR_BYTES

    @property
    def efficiency(self) -> float:
        """Useful bytes / fetched bytes: 1.0 when every byte of every sector moved is used."""
        return self.useful_bytes / self.fetched_bytes if self.fetched_bytes else 1.0

    def __str__(self) -> str:
        return (f"{self.lanes} lanes x {self.bytes_per_lane} B: {_count(self.sectors.size, 'sector')}, "
                f"{_count(self.lines.size, 'line')}, {self.useful_bytes} useful of {self.fetched_bytes} fetched "
                f"bytes ({self.efficiency:.1%} efficient)")


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def warp_request(addresses: Sequence[int] | np.ndarray, bytes_per_lane: int = 4,
                 active: Sequence[bool] | np.ndarray | None = None) -> WarpRequest:
    """A :class:`WarpRequest` from up to 32 lanes' byte addresses."""
    return WarpRequest(np.asarray(addresses), bytes_per_lane, None if active is None else np.asarray(active))


def strided_warp(stride: int, element_bytes: int = 4, base: int = 0, lanes: int = WARP_SIZE) -> WarpRequest:
    """Lane ``i`` reads element ``i * stride`` of an array at byte address ``base``.

    ``stride=1`` is the coalesced case; a column of a row-major matrix has ``stride = n_cols``.
    """
    return WarpRequest(base + np.arange(lanes, dtype=np.int64) * stride * element_bytes, element_bytes)


def matrix_strides(rows: int, cols: int, layout: str) -> tuple[int, int]:
    """Element strides of a ``rows x cols`` matrix stored ``"row-major"`` (C order) or ``"column-major"``."""
    if layout == "row-major":
        return (cols, 1)
    if layout == "column-major":
        return (1, rows)
    raise ValueError(f"utils.coalescing: layout must be 'row-major' or 'column-major', got {layout!r}")


@dataclass(frozen=True)
class TileAccess:
    """A tile load split into warp requests, with the totals a profiler would add up."""

    shape: tuple[int, int]
    strides: tuple[int, int]
    element_bytes: int
    order: tuple[int, int]
    elements_per_lane: int
    requests: list[WarpRequest] = field(repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def sectors(self) -> int:
        """Sum over the requests of the sectors each touches (what the memory system serves)."""
        return sum(int(r.sectors.size) for r in self.requests)

    @property
    def lines(self) -> int:
        return sum(int(r.lines.size) for r in self.requests)

    @property
    def unique_sectors(self) -> int:
        """Distinct sectors of the whole tile (what ``utils.trace`` counts for the block instruction)."""
        if not self.requests:
            return 0
        return int(np.unique(np.concatenate([r.sectors for r in self.requests])).size)

    @property
    def useful_bytes(self) -> int:
        return sum(r.useful_bytes for r in self.requests)

    @property
    def fetched_bytes(self) -> int:
        return self.sectors * SECTOR_BYTES

    @property
    def efficiency(self) -> float:
        return self.useful_bytes / self.fetched_bytes if self.fetched_bytes else 1.0

    @property
    def sectors_per_request(self) -> float:
        return self.sectors / self.num_requests if self.requests else 0.0

    def __str__(self) -> str:
        return (f"{self.shape[0]}x{self.shape[1]} tile, strides {self.strides}, lanes along dim {self.order[0]}, "
                f"{self.elements_per_lane} element(s)/lane: {self.num_requests} requests, {self.sectors} sectors "
                f"({self.sectors_per_request:.1f}/request), {self.efficiency:.1%} efficient")


def tile_requests(shape: tuple[int, int], strides: tuple[int, int], element_bytes: int = 4,
                  order: tuple[int, int] | None = None, elements_per_lane: int = 1, base: int = 0) -> TileAccess:
    """Split the load of a ``shape`` tile of a matrix with element ``strides`` into warp requests.

    The elements are dealt to lanes the way a Triton blocked layout does: walking the tile with
    dimension ``order[0]`` fastest, each lane takes ``elements_per_lane`` consecutive elements,
    32 lanes make a request. ``order`` defaults to the dimension with the smaller stride first —
    what Triton's coalescing pass chooses when it can prove that dimension is contiguous. A
    lane's elements are loaded as one vector (``elements_per_lane * element_bytes`` bytes) only
    if they are adjacent in memory; otherwise the warp issues one request per element position.

    Args:
        shape: (rows, cols) of the tile.
        strides: element strides of the matrix, e.g. ``(K, 1)`` row-major, ``(1, M)`` column-major.
        element_bytes: 4 for fp32, 2 for fp16/bf16.
        order: the layout's dimension order, fastest first: ``(1, 0)`` lanes along columns.
        elements_per_lane: consecutive elements per lane along ``order[0]`` (4 fp32 = a 16-byte vector).
        base: byte address of element (0, 0).
    """
    rows, cols = shape
    if rows < 1 or cols < 1:
        raise ValueError(f"utils.coalescing: tile shape must be positive, got {shape}")
    if order is None:
        order = (1, 0) if abs(strides[1]) <= abs(strides[0]) else (0, 1)
    if sorted(order) != [0, 1]:
        raise ValueError(f"utils.coalescing: order must be (1, 0) or (0, 1), got {order}")
    fast, slow = order
    extent = shape[fast]
    if elements_per_lane < 1 or extent % elements_per_lane:
        raise ValueError(f"utils.coalescing: elements_per_lane ({elements_per_lane}) must divide the tile's "
                         f"extent along dim {fast} ({extent})")
    # Element offsets walked fastest-dim-first, grouped into lane vectors.
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    offsets = r * strides[0] + c * strides[1]
    walk = offsets if fast == 1 else offsets.T  # rows of `walk` run along the fast dim
    vectors = walk.reshape(-1, elements_per_lane)  # one row per lane-vector
    contiguous = elements_per_lane == 1 or strides[fast] == 1
    requests: list[WarpRequest] = []
    for start in range(0, vectors.shape[0], WARP_SIZE):
        chunk = vectors[start:start + WARP_SIZE]
        if contiguous:
            requests.append(WarpRequest(base + chunk[:, 0] * element_bytes, element_bytes * elements_per_lane))
        else:
            for position in range(elements_per_lane):
                requests.append(WarpRequest(base + chunk[:, position] * element_bytes, element_bytes))
    return TileAccess(shape=(rows, cols), strides=tuple(strides), element_bytes=element_bytes, order=tuple(order),
                      elements_per_lane=elements_per_lane, requests=requests)
