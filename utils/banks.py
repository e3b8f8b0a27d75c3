"""What one warp's shared-memory access costs: its lanes' addresses → 32 banks → wavefronts.

Shared memory is split into **32 banks**, each 4 bytes wide: the 4-byte word at byte address ``a`` lives in
bank ``(a // 4) % 32``, so 32 consecutive words fall in 32 different banks. Each bank serves one word per
clock. When the lanes of a warp touch several *different* words of one bank, those words are served one after
another — a **bank conflict** — while lanes that read the *same* word are served together (a broadcast; for
stores, one of them writes). NVIDIA, *CUDA C++ Programming Guide*: "Shared Memory" under "Device Memory
Accesses" (a request with bank conflicts is split "into as many separate conflict-free requests as
necessary": n distinct words in one bank, an n-way conflict) and the shared-memory section of each compute
capability in the "Compute Capabilities" appendix (32 banks, "successive 32-bit words map to successive
banks"; no conflict "between two threads that access any address within the same 32-bit word").

Wider accesses move more than the 128 bytes the 32 banks deliver in one pass, so a warp's request is served
in phases of fewer lanes, each phase a pass over the banks: 8-byte accesses in two half-warp phases (lanes
0-15, 16-31), 16-byte accesses in four quarter-warp phases (lanes 0-7, 8-15, ...). The guide states the
bank rule above; the phase split of 64- and 128-bit accesses is the model its older shared-memory sections
describe and the one Nsight Compute's shared-memory **wavefronts** (``l1tex__data_pipe_lsu_wavefronts_mem_shared``)
show for conflict-free accesses (2 for a warp's 8-byte loads, 4 for 16-byte loads): it is a model here.
This module counts exactly that, for teaching, from the byte addresses each lane computes — the same way
:mod:`utils.coalescing` counts sectors for global memory:

* :func:`wavefronts` — passes one warp-wide access needs: summed over its phases, the largest number of
  distinct words any one bank is asked for;
* :func:`conflicts` — wavefronts beyond the ideal (one per phase that has an active lane);
* :func:`warp_access` — the same with the detail: the worst phase and bank, its lanes and words;
* :func:`tile_access` — every warp access of a tile load or store, from a per-lane index function (Python code
  mirroring a kernel's index expression), totalled as a :class:`TileAccess`.

It is a model: one access in isolation, the phase split as above for every access (the hardware may merge
phases whose lanes all read one address), no other traffic on the banks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BANKS",
    "BANK_BYTES",
    "WARP_SIZE",
    "TileAccess",
    "WarpAccess",
    "bank",
    "conflicts",
    "a_tile_load",
    "a_tile_offset",
    "a_tile_store",
    "tile_access",
    "warp_access",
    "wavefronts",
]

#: Banks of shared memory.
BANKS = 32
#: Bytes per bank (one word).
BANK_BYTES = 4
#: Lanes of a warp.
WARP_SIZE = 32

_PHASES = {1: 1, 2: 1, 4: 1, 8: 2, 16: 4}


def bank(byte_address: int) -> int:
    """The bank holding the byte at ``byte_address``: ``(byte_address // 4) % 32``."""
    return (byte_address // BANK_BYTES) % BANKS


@dataclass(frozen=True)
class WarpAccess:
    """One warp-wide shared-memory access: each active lane touches ``width`` bytes from its address.

    ``addresses[i]`` is lane ``i``'s byte address, ``None`` for an inactive lane (masked off, or past the end
    of a partial warp).
    """

    addresses: tuple
    width: int
    #: Passes over the banks the access needs (summed over its phases).
    wavefronts: int
    #: One pass per phase that has an active lane: what the access costs without bank conflicts.
    ideal: int
    #: The phase whose bank is asked for the most distinct words, that bank, the words and the lanes asking.
    worst_phase: int
    worst_bank: int
    worst_words: tuple
    worst_lanes: tuple

    @property
    def conflicts(self) -> int:
        """Wavefronts beyond the ideal."""
        return self.wavefronts - self.ideal

    @property
    def ways(self) -> int:
        """The worst bank's number of distinct words: an n-way conflict (1: none)."""
        return len(self.worst_words)

    def describe(self) -> str:
        """One line: wavefronts against the ideal and, if conflicted, the worst bank with its lanes and words."""
        text = f"{self.wavefronts} wavefront{'s' if self.wavefronts != 1 else ''} (ideal {self.ideal})"
        if self.conflicts == 0:
            return text + ", no bank conflict"
        phase = f" in phase {self.worst_phase}" if _PHASES[self.width] > 1 else ""
        pairs = ", ".join(f"lane {lane} word {word}" for lane, word in _lane_words(self))
        return f"{text}: {self.ways}-way conflict on bank {self.worst_bank}{phase} ({pairs})"


def _lane_words(access: WarpAccess) -> list[tuple[int, int]]:
    """(lane, word) for each lane of the worst phase touching a worst word, one lane per word."""
    seen, out = set(), []
    for lane in access.worst_lanes:
        words = _words(access.addresses[lane], access.width)
        for word in words:
            if word in access.worst_words and word not in seen:
                seen.add(word)
                out.append((lane, word))
    return out


def _words(address: int, width: int) -> range:
    first = address // BANK_BYTES
    return range(first, first + max(1, width // BANK_BYTES))


def warp_access(byte_addresses: Sequence[int | None], width: int = 4) -> WarpAccess:
    """A :class:`WarpAccess` from up to 32 lanes' byte addresses, each lane touching ``width`` bytes.

    ``width`` is 1, 2, 4, 8 or 16; each address must be a multiple of it (the hardware's alignment rule).
    """
    if width not in _PHASES:
        raise ValueError(f"utils.banks: width must be one of {sorted(_PHASES)} bytes, got {width!r}")
    addresses = tuple(None if a is None else int(a) for a in byte_addresses)
    if len(addresses) > WARP_SIZE:
        raise ValueError(f"utils.banks: a warp has {WARP_SIZE} lanes, got {len(addresses)} addresses")
    for lane, a in enumerate(addresses):
        if a is not None and (a < 0 or a % width):
            raise ValueError(
                f"utils.banks: lane {lane}'s address {a} is not a non-negative multiple of the access width {width}"
            )
    phases = _PHASES[width]
    per_phase = WARP_SIZE // phases
    total, ideal = 0, 0
    worst = (0, 0, 0, (), ())  # (ways, phase, bank, words, lanes)
    for phase in range(phases):
        lanes = [
            lane
            for lane in range(phase * per_phase, min(len(addresses), (phase + 1) * per_phase))
            if addresses[lane] is not None
        ]
        if not lanes:
            continue
        ideal += 1
        words_of_bank: dict[int, set[int]] = {}
        for lane in lanes:
            for word in _words(addresses[lane], width):
                words_of_bank.setdefault(word % BANKS, set()).add(word)
        b, words = max(words_of_bank.items(), key=lambda item: (len(item[1]), -item[0]))
        total += len(words)
        if len(words) > worst[0]:
            asking = tuple(lane for lane in lanes if set(_words(addresses[lane], width)) & words)
            worst = (len(words), phase, b, tuple(sorted(words)), asking)
    _, phase, b, words, lanes = worst
    return WarpAccess(addresses, width, total, ideal, phase, b, words, lanes)


def wavefronts(byte_addresses: Sequence[int | None], width: int = 4) -> int:
    """Passes over the 32 banks one warp's access needs (see the module docstring).

    >>> wavefronts([4 * lane for lane in range(32)])        # stride 1: 32 banks, one pass
    1
    >>> wavefronts([4 * 32 * lane for lane in range(32)])   # stride 32: all in bank 0
    32
    """
    return warp_access(byte_addresses, width).wavefronts


def conflicts(byte_addresses: Sequence[int | None], width: int = 4) -> int:
    """Wavefronts beyond the ideal (one per phase with an active lane): 0 for a conflict-free access."""
    return warp_access(byte_addresses, width).conflicts


@dataclass(frozen=True)
class TileAccess:
    """Every warp access of one tile load or store, as :func:`tile_access` splits it."""

    label: str
    width: int
    #: ``(warp, step, access)`` for every warp and step with an active lane.
    accesses: list = field(repr=False)

    @property
    def wavefronts(self) -> int:
        return sum(a.wavefronts for _, _, a in self.accesses)

    @property
    def ideal(self) -> int:
        return sum(a.ideal for _, _, a in self.accesses)

    @property
    def conflicts(self) -> int:
        return self.wavefronts - self.ideal

    @property
    def worst(self) -> tuple:
        """``(warp, step, access)`` of the access with the most conflicts (the first such)."""
        return max(self.accesses, key=lambda item: (item[2].conflicts, -item[0], -item[1]))

    @property
    def ways(self) -> int:
        """The worst access's n-way conflict (1: none)."""
        return self.worst[2].ways if self.accesses else 1

    def describe(self) -> str:
        """Totals, and the worst access with its lanes when there are conflicts."""
        text = (
            f"{self.label}: {len(self.accesses)} warp accesses of {self.width} bytes a lane, "
            f"{self.wavefronts} wavefronts (ideal {self.ideal})"
        )
        if self.conflicts == 0:
            return text + ", no bank conflict"
        warp, step, access = self.worst
        return f"{text}; worst: warp {warp}, step {step}: {access.describe()}"

    def __str__(self) -> str:
        return self.describe()


def tile_access(
    offset: Callable[[int, int], int | None],
    *,
    threads: int,
    steps: int = 1,
    width: int = 4,
    element_bytes: int = 4,
    base: int = 0,
    label: str = "access",
) -> TileAccess:
    """Every warp access of a tile load or store that a block of ``threads`` threads makes in ``steps`` steps.

    ``offset(thread, step)`` returns the element index (in units of ``element_bytes``) that thread ``thread``
    (``threadIdx.x`` of a 1-D block) accesses in step ``step`` — Python mirroring the kernel's index
    expression — or ``None`` where the thread takes no part. Each lane touches ``width`` bytes from
    ``base + offset * element_bytes``. Threads are grouped into warps of 32 (thread ``t`` is lane ``t % 32``
    of warp ``t // 32``); each (warp, step) is one warp access.
    """
    if threads < 1 or steps < 1:
        raise ValueError(f"utils.banks: threads and steps must be >= 1, got {threads} and {steps}")
    out = []
    for warp in range((threads + WARP_SIZE - 1) // WARP_SIZE):
        for step in range(steps):
            addresses = []
            for lane in range(WARP_SIZE):
                thread = warp * WARP_SIZE + lane
                index = offset(thread, step) if thread < threads else None
                addresses.append(None if index is None else base + index * element_bytes)
            if any(a is not None for a in addresses):
                out.append((warp, step, warp_access(addresses, width)))
    return TileAccess(label, width, out)


# ----------------------------------------------------------------------------------------------
# The GEMM ladder's transposed A tile (chapters/13_below_triton/src/cuda/gemm_regtile.cuh), mirrored
# ----------------------------------------------------------------------------------------------

#: Threads of a block of the register-tiled GEMM, and its tile of C (BM x BN).
GEMM_THREADS = 256
GEMM_BM = 128

#: The layouts of the transposed A tile, as ``gemm::kPlain``, ``kPadded``, ``kSwizzled`` in the ``.cuh``.
LAYOUTS = ("plain", "padded", "swizzled")


def a_tile_offset(layout: str, bk: int, bm: int = GEMM_BM) -> Callable[[int, int], int]:
    """``offset(k, m)``: the word where element (k, m) of the transposed A tile (``bk`` rows of ``bm``) is kept,
    as ``gemm::a_tile_offset<BK, BM, LAYOUT>`` computes it."""
    if layout == "plain":
        return lambda k, m: k * bm + m
    if layout == "padded":
        return lambda k, m: k * (bm + 4) + m
    if layout == "swizzled":
        return lambda k, m: k * bm + (m ^ ((k >> 2) * (128 // bk)))
    raise ValueError(f"utils.banks: layout must be one of {LAYOUTS}, got {layout!r}")


def a_tile_store(
    offset: Callable[[int, int], int | None], bk: int, bm: int = GEMM_BM, threads: int = GEMM_THREADS
) -> TileAccess:
    """The register-tiled GEMM's transposed store of its A tile into shared memory, warp by warp.

    Mirrors ``gemm_regtile``: chunk ``idx = t + threads * l`` of the tile is row ``m = idx / (bk/4)`` of A and
    ``k = 4 * (idx % (bk/4))`` .. ``+3``, loaded as a float4 and stored as four 4-byte stores, component ``j`` to
    ``offset(k + j, m)``; step ``4 l + j`` is that store.
    """
    chunks = bm * bk // 4 // threads

    def index(t: int, step: int) -> int | None:
        l, j = divmod(step, 4)
        idx = t + threads * l
        return offset(4 * (idx % (bk // 4)) + j, idx // (bk // 4))

    return tile_access(index, threads=threads, steps=4 * chunks, width=4, label=f"A tile store (BK={bk})")


def a_tile_load(
    offset: Callable[[int, int], int | None], bk: int, bm: int = GEMM_BM, threads: int = GEMM_THREADS
) -> TileAccess:
    """The register-tiled GEMM's inner-loop reads of its A tile: for each k, thread ``t`` (``ty = t / 16``)
    reads 16 bytes at ``offset(k, 4 ty)`` and at ``offset(k, bm/2 + 4 ty)``; step ``2 k + h`` is read ``h``."""

    def index(t: int, step: int) -> int | None:
        k, half = divmod(step, 2)
        return offset(k, half * (bm // 2) + 4 * (t // 16))

    return tile_access(index, threads=threads, steps=2 * bk, width=16, label=f"A tile float4 reads (BK={bk})")
