"""A simulated L2 cache: an LRU of 32-byte sectors, fed by a kernel's programs in the order a GPU runs them.

``utils.trace`` counts the bytes a kernel *asks* for. What reaches DRAM is less: a sector some
program loaded a moment ago may still sit in the L2 cache when another program asks for it. How
often that happens depends on the order the programs run — which is why tiled matmuls launch
their programs in a *grouped* order. This module measures it on a model, so the hit rate is
computed rather than asserted:

* :class:`LRUCache` holds ``capacity_bytes / 32`` sectors and evicts the least recently used;
* programs run in **waves** of ``concurrent`` programs (the ones resident on the GPU's SMs at
  the same time), in launch order; inside a wave their memory instructions interleave —
  instruction 0 of every program of the wave, then instruction 1, ... — the way concurrently
  running programs march through their K loops side by side;
* loads that find their sector are hits; the others are misses, read from DRAM. Stores allocate
  their sectors in the cache (write-back) and are written to DRAM once.

The stream comes from a real launch (``trace(record_sectors=True)``, see
:func:`programs_from_launch`) or, for sizes the interpreter cannot run, from
:func:`matmul_tile_programs`, which generates the same sectors a tiled matmul kernel touches
(the tests prove the two agree). :func:`scaled_machine` shrinks the cache and the wave to the
problem at hand: an L2 as large *relative to the operands* as an H200's 50 MB is to an 8192³
bf16 matmul's.

It is a model. A real L2 is set-associative, split in two partitions on Hopper, not exactly LRU,
and programs do not run in lockstep; the model keeps what decides the effect — the reuse
distance the launch order creates — and leaves out the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from utils.roofline import get_gpu
from utils.trace import SECTOR_BYTES, Launch, SectorAccess

__all__ = [
    "LRUCache",
    "CacheResult",
    "interleave",
    "simulate",
    "programs_from_launch",
    "program_order",
    "matmul_tile_programs",
    "scaled_capacity",
    "scaled_machine",
]


class LRUCache:
    """A fully associative cache of ``capacity_bytes // sector_bytes`` sectors with LRU eviction."""

    def __init__(self, capacity_bytes: int, sector_bytes: int = SECTOR_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"utils.l2cache: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.sector_bytes = sector_bytes
        self.capacity = capacity_bytes // sector_bytes
        self._lines: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def access(self, sectors: Iterable[int]) -> int:
        """Look up each sector in turn (a miss brings it in); return how many were hits."""
        lines, capacity = self._lines, self.capacity
        hits = 0
        for sector in (sectors.tolist() if isinstance(sectors, np.ndarray) else sectors):
            if sector in lines:
                lines.move_to_end(sector)
                hits += 1
            else:
                self.misses += 1
                if capacity:
                    lines[sector] = None
                    if len(lines) > capacity:
                        lines.popitem(last=False)
        self.hits += hits
        return hits

    def insert(self, sectors: Iterable[int]) -> None:
        """Put sectors in as most recently used without counting hits or misses (a write allocating)."""
        lines, capacity = self._lines, self.capacity
        if not capacity:
            return
        for sector in (sectors.tolist() if isinstance(sectors, np.ndarray) else sectors):
            if sector in lines:
                lines.move_to_end(sector)
            else:
                lines[sector] = None
                if len(lines) > capacity:
                    lines.popitem(last=False)

    def __contains__(self, sector: int) -> bool:
        return sector in self._lines

    def __len__(self) -> int:
        return len(self._lines)

    def contents(self) -> list[int]:
        """Sectors held, least recently used first."""
        return list(self._lines)


@dataclass(frozen=True)
class CacheResult:
    """What one simulated launch did to the cache and to DRAM."""

    capacity_bytes: int
    concurrent: int
    #: Sector lookups by loads (the traffic the kernel asks of the L2).
    load_sectors: int
    hits: int
    misses: int
    #: Distinct sectors stored (each written back to DRAM once).
    stored_sectors: int
    #: tensor name -> (hits, misses) of its loads.
    per_tensor: dict[str, tuple[int, int]] = field(default_factory=dict)
    sector_bytes: int = SECTOR_BYTES

    @property
    def hit_rate(self) -> float:
        return self.hits / self.load_sectors if self.load_sectors else 0.0

    @property
    def requested_bytes(self) -> int:
        """Bytes the loads ask for, in whole sectors: what DRAM would serve with no cache at all."""
        return self.load_sectors * self.sector_bytes

    @property
    def dram_read_bytes(self) -> int:
        return self.misses * self.sector_bytes

    @property
    def dram_write_bytes(self) -> int:
        return self.stored_sectors * self.sector_bytes

    @property
    def dram_bytes(self) -> int:
        return self.dram_read_bytes + self.dram_write_bytes

    def __str__(self) -> str:
        return (f"L2 model ({self.capacity_bytes / 1024:,.0f} KiB, waves of {self.concurrent}): "
                f"hit rate {self.hit_rate:.1%}, DRAM reads {self.dram_read_bytes:,} B of "
                f"{self.requested_bytes:,} B requested, writes {self.dram_write_bytes:,} B")


Programs = Mapping[int, Sequence[SectorAccess]] | Sequence[Sequence[SectorAccess]]


def _in_launch_order(programs: Programs) -> list[Sequence[SectorAccess]]:
    if isinstance(programs, Mapping):
        return [programs[pid] for pid in sorted(programs)]
    return list(programs)


def interleave(programs: Programs, concurrent: int) -> Iterator[SectorAccess]:
    """The memory instructions of ``programs`` in the order the model runs them.

    Programs run in launch order (a mapping is sorted by program id), ``concurrent`` at a time;
    within a wave, instruction ``i`` of each of its programs comes before instruction ``i + 1``
    of any. ``concurrent=1`` runs the programs one after the other.
    """
    if concurrent < 1:
        raise ValueError(f"utils.l2cache: concurrent must be >= 1, got {concurrent}")
    ordered = _in_launch_order(programs)
    for start in range(0, len(ordered), concurrent):
        wave = ordered[start:start + concurrent]
        for step in range(max((len(p) for p in wave), default=0)):
            for accesses in wave:
                if step < len(accesses):
                    yield accesses[step]


def simulate(programs: Programs, capacity_bytes: int, concurrent: int = 1,
             sector_bytes: int = SECTOR_BYTES) -> CacheResult:
    """Replay ``programs`` (per-program lists of :class:`~utils.trace.SectorAccess`) through an LRU.

    Loads and atomics look their sectors up (hits and misses are counted); stores insert theirs.
    """
    cache = LRUCache(capacity_bytes, sector_bytes)
    per_tensor: dict[str, list[int]] = {}
    stored: set[int] = set()
    load_sectors = 0
    for access in interleave(programs, concurrent):
        if access.kind == "store":
            cache.insert(access.sectors)
            stored.update(access.sectors.tolist())
            continue
        hits = cache.access(access.sectors)
        load_sectors += access.sectors.size
        counts = per_tensor.setdefault(access.tensor, [0, 0])
        counts[0] += hits
        counts[1] += access.sectors.size - hits
    return CacheResult(capacity_bytes=capacity_bytes, concurrent=concurrent, load_sectors=load_sectors,
                       hits=cache.hits, misses=cache.misses, stored_sectors=len(stored),
                       per_tensor={k: (v[0], v[1]) for k, v in per_tensor.items()}, sector_bytes=sector_bytes)


def programs_from_launch(launch: Launch) -> dict[int, list[SectorAccess]]:
    """A traced launch's instructions grouped by program (needs ``trace(record_sectors=True)``)."""
    if not launch.sector_log and launch.sectors:
        raise ValueError("utils.l2cache: this launch has no sector log; trace it with trace(record_sectors=True)")
    return launch.program_sectors()


def program_order(grid_m: int, grid_n: int, group_m: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The output tile ``(pid_m, pid_n)`` of every program id of a grouped launch, as two arrays.

    Programs walk down a group of ``group_m`` tile rows, column by column, then go to the next
    group (the last group may have fewer rows). ``group_m=1`` is row-major order.
    """
    if min(grid_m, grid_n, group_m) < 1:
        raise ValueError(f"utils.l2cache: grid and group sizes must be >= 1, got {grid_m}, {grid_n}, {group_m}")
    pid = np.arange(grid_m * grid_n, dtype=np.int64)
    per_group = group_m * grid_n
    first_m = (pid // per_group) * group_m
    rows_in_group = np.minimum(grid_m - first_m, group_m)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    return pid_m, pid_n


def _tile_sectors(base: int, row0: int, rows: int, col0: int, cols: int, row_stride: int,
                  element_bytes: int) -> np.ndarray:
    """Distinct sectors of the rows x cols tile at (row0, col0) of a row-major matrix (``row_stride`` elements)."""
    r = np.arange(row0, row0 + rows, dtype=np.int64)
    first = (base + (r * row_stride + col0) * element_bytes) // SECTOR_BYTES
    last = (base + (r * row_stride + col0 + cols) * element_bytes - 1) // SECTOR_BYTES
    counts = last - first + 1
    starts = np.repeat(first, counts)
    within = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.unique(starts + within)


def matmul_tile_programs(M: int, N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int,
                         element_bytes: int = 2, group_m: int = 1, bases: tuple[int, int, int] | None = None
                         ) -> dict[int, list[SectorAccess]]:
    """The sectors a tiled ``C = A @ B`` kernel touches, per program, without running it.

    A (M x K), B (K x N) and C (M x N) are row-major and contiguous. Program ``pid`` computes
    tile :func:`program_order` ``(pid_m, pid_n)``: for each K slice it loads the A tile
    (BLOCK_M x BLOCK_K), then the B tile (BLOCK_K x BLOCK_N), clipped at the edges as a masked
    load is; after the loop it stores its C tile. ``bases`` are the byte addresses of A, B, C
    (default: one after the other, sector aligned).
    """
    if bases is None:
        a_bytes, b_bytes = M * K * element_bytes, K * N * element_bytes
        align = lambda n: -(-n // 128) * 128  # noqa: E731
        bases = (0, align(a_bytes), align(a_bytes) + align(b_bytes))
    a_base, b_base, c_base = bases
    grid_m, grid_n = -(-M // BLOCK_M), -(-N // BLOCK_N)
    pid_m, pid_n = program_order(grid_m, grid_n, group_m)
    programs: dict[int, list[SectorAccess]] = {}
    b_cache: dict[tuple[int, int], np.ndarray] = {}
    a_cache: dict[tuple[int, int], np.ndarray] = {}
    for pid in range(grid_m * grid_n):
        m0, n0 = int(pid_m[pid]) * BLOCK_M, int(pid_n[pid]) * BLOCK_N
        rows, cols = min(BLOCK_M, M - m0), min(BLOCK_N, N - n0)
        accesses = []
        for k0 in range(0, K, BLOCK_K):
            depth = min(BLOCK_K, K - k0)
            a_key, b_key = (m0, k0), (k0, n0)
            if a_key not in a_cache:
                a_cache[a_key] = _tile_sectors(a_base, m0, rows, k0, depth, K, element_bytes)
            if b_key not in b_cache:
                b_cache[b_key] = _tile_sectors(b_base, k0, depth, n0, cols, N, element_bytes)
            accesses.append(SectorAccess(pid, "load", "a_ptr", a_cache[a_key]))
            accesses.append(SectorAccess(pid, "load", "b_ptr", b_cache[b_key]))
        c_sectors = _tile_sectors(c_base, m0, rows, n0, cols, N, element_bytes)
        accesses.append(SectorAccess(pid, "store", "c_ptr", c_sectors))
        programs[pid] = accesses
    return programs


def scaled_capacity(problem_bytes: int, reference_bytes: int, l2_bytes: int) -> int:
    """A cache as large relative to ``problem_bytes`` as ``l2_bytes`` is to ``reference_bytes`` (whole sectors)."""
    return int(l2_bytes * problem_bytes / reference_bytes) // SECTOR_BYTES * SECTOR_BYTES


def scaled_machine(M: int, N: int, K: int, BLOCK_M: int, BLOCK_N: int, element_bytes: int = 2, gpu: str = "H200",
                   reference: tuple[int, int, int] = (8192, 8192, 8192),
                   reference_tile: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """``(capacity_bytes, concurrent)`` for simulating an ``M x N x K`` matmul the way ``gpu`` runs ``reference``.

    The capacity is the GPU's L2 scaled by this problem's operand bytes (A and B) over the
    reference's. The wave is one program per SM, scaled so that it spans as many rows of this
    launch grid as the GPU's wave spans of the reference grid (``reference_tile`` tiles): on an
    H200, 132 programs cover 2.06 rows of the 64 x 64 tiles of 8192³. Together these keep the
    ratios that decide reuse — how many tile rows a wave covers, how many K-panels fit in the
    cache per row of the grid — while the problem shrinks. Both are at least 1 (sector, program).
    """
    spec = get_gpu(gpu)
    rm, rn, rk = reference
    operands = (M * K + K * N) * element_bytes
    reference_operands = (rm * rk + rk * rn) * element_bytes
    grid_n = -(-N // BLOCK_N)
    reference_grid_n = -(-rn // reference_tile[1])
    capacity = max(SECTOR_BYTES, scaled_capacity(operands, reference_operands, spec.l2_bytes))
    concurrent = max(1, round(spec.sm_count * grid_n / reference_grid_n))
    return capacity, min(concurrent, -(-M // BLOCK_M) * grid_n)
