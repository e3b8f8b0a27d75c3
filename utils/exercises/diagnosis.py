"""Where a wrong output is, and what the tracer's store maps say about why.

* where: the wrong or unwritten elements' shape — the first wrong index, the rows or columns,
  and for a 1-D kernel (one program per BLOCK) "the first block right, every later block wrong",
  "wrong only in the padded tail" or "the same lanes of every block" (periodic by BLOCK);
* why, only from evidence: the tracer's store maps (``trace(record_writes=True)``) say which
  program stored to each output element and which masked a store to it off. Two programs storing
  the same elements, or a program storing outside its own block, is the ``pid → offset`` mapping —
  unless one program's share runs on, without a gap, from its own rows past the end of a head (a
  slice of the leading dimensions) into the first rows of the next one: a store with no row mask;
  the grid is named only when its programs' lanes cannot cover the output; the mask only when a
  store to a missing element was masked off (or when the padded tail alone is wrong).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .verdict import _fmt_index, _plural


@dataclasses.dataclass
class _Stores:
    """What the one launch that stored into an output did, in the output's flat element order."""

    kernel: str
    grid: tuple[int, ...]
    programs: int
    first: np.ndarray  # program of the first store to each element, -1 where none
    last: np.ndarray  # program of the last store
    masked: np.ndarray  # the last program whose store addressed the element with a masked-off lane
    lanes: int  # the most lanes of one store instruction (BLOCK for a 1-D kernel)
    ranges: dict[int, tuple[int, int, int]]  # program -> (lowest, highest element it stored, count)
    # program -> the lanes of all its store instructions here (two stores per program reach 2 * lanes)
    reach: dict[int, int] = dataclasses.field(default_factory=dict)
    sites: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (function, line) of each store
    first_site: np.ndarray | None = None  # site of the first / last store to each element, -1 where none
    last_site: np.ndarray | None = None
    # (earlier site, later site) -> (elements, first element, program): one program storing an element twice
    self_overwrites: dict[tuple[int, int], tuple[int, int, int]] = dataclasses.field(default_factory=dict)

    def site_text(self, site: int) -> str:
        """``'store at line 27 of rope_kernel'`` for a site index."""
        function, line = self.sites[site] if 0 <= site < len(self.sites) else ("?", 0)
        return f"store at line {line} of {function}" if line else "store (its line unknown)"

    def reach_total(self) -> int:
        """The most elements the launch's stores could cover: every program's store lanes, all its stores."""
        return max(self.programs * self.lanes, sum(self.reach.values()))


def _store_resolver(launches: Sequence[Any]) -> Callable[[torch.Tensor], _Stores | None]:
    """``resolve(tensor)``: the store map of the one launch that stored into ``tensor``, or None."""

    def resolve(tensor: torch.Tensor) -> _Stores | None:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or not tensor.is_contiguous():
            return None
        pointer = tensor.data_ptr()
        found = [
            (launch, stored)
            for launch in launches
            for stored in (getattr(launch, "store_maps", None) or {}).values()
            if stored.data_ptr == pointer
        ]
        # Several launches (or arguments) storing into it: program ids no longer say who wrote what.
        if len(found) != 1 or found[0][1].first.size != tensor.numel():
            return None
        launch, stored = found[0]
        return _Stores(
            kernel=str(launch.kernel), grid=tuple(launch.grid), programs=int(launch.programs),
            first=stored.first, last=stored.last, masked=stored.masked, lanes=int(stored.lanes),
            ranges=dict(stored.programs), reach=dict(getattr(stored, "reach", None) or {}),
            sites=list(getattr(stored, "sites", None) or []), first_site=getattr(stored, "first_site", None),
            last_site=getattr(stored, "last_site", None),
            self_overwrites=dict(getattr(stored, "self_overwrites", None) or {}),
        )

    return resolve


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Ascending indices -> maximal runs of consecutive ones, as (first, last)."""
    if indices.size == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0]
    starts = np.concatenate([indices[:1], indices[breaks + 1]])
    ends = np.concatenate([indices[breaks], indices[-1:]])
    return list(zip(starts.tolist(), ends.tolist()))


def _fmt_flat(index: int, shape: Sequence[int]) -> str:
    return str(index) if len(shape) <= 1 else _fmt_index(index, shape)


def _span_text(first: int, last: int, shape: Sequence[int]) -> str:
    if first == last:
        return f"index {_fmt_flat(first, shape)}"
    return f"indices {_fmt_flat(first, shape)}..{_fmt_flat(last, shape)}"


def _ranges_text(values: Sequence[int] | np.ndarray, limit: int = 3) -> str:
    """``[0, 1, 2, 3, 9]`` -> ``'0..3, 9'`` (at most ``limit`` runs, then how many in all)."""
    runs = _runs(np.asarray(sorted(values), dtype=np.int64))
    parts = [str(a) if a == b else f"{a}..{b}" for a, b in runs[:limit]]
    if len(runs) > limit:
        parts.append(f"… ({len(runs)} runs)")
    return ", ".join(parts)


def _programs_text(programs: Sequence[int]) -> str:
    programs = sorted(programs)
    if len(programs) == 1:
        return f"program {programs[0]}"
    if len(programs) <= 4:
        return "programs " + ", ".join(map(str, programs[:-1])) + f" and {programs[-1]}"
    return "programs " + ", ".join(map(str, programs[:3])) + f", … ({len(programs)} in all)"


def _region_text(mask: np.ndarray, shape: Sequence[int]) -> str:
    """Where the True elements of a flat mask are, as rows / columns / a box / index ranges."""
    indices = np.nonzero(mask)[0]
    if len(shape) >= 2 and indices.size:
        rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
        grid = mask.reshape(rows, cols)
        bad_rows, bad_cols = grid.any(axis=1), grid.any(axis=0)
        row_text = "rows" if len(shape) == 2 else "rows (leading dims flattened)"
        if bool((grid == bad_rows[:, None]).all()):
            return f"{row_text} {_ranges_text(np.nonzero(bad_rows)[0])} (every column)"
        if bool((grid == bad_cols[None, :]).all()):
            return f"columns {_ranges_text(np.nonzero(bad_cols)[0])} (every row)"
        if bool((grid == (bad_rows[:, None] & bad_cols[None, :])).all()):
            return (f"{row_text} {_ranges_text(np.nonzero(bad_rows)[0])} × columns "
                    f"{_ranges_text(np.nonzero(bad_cols)[0])}")
    runs = _runs(indices)
    text = ", ".join(_span_text(a, b, shape).split(" ", 1)[1] for a, b in runs[:3])
    if len(runs) > 3:
        text += f", … ({len(runs)} runs)"
    return ("index " if indices.size == 1 else "indices ") + text


def _block_size(stores: _Stores, total: int) -> int | None:
    """BLOCK if the launch is one program per flat block of ``lanes`` elements (a 1-D kernel), else None."""
    block = stores.lanes
    if block <= 0 or len(stores.grid) != 1 or stores.programs != -(-total // block):
        return None
    if any(count and high - low >= block for low, high, count in stores.ranges.values()):
        return None  # a program stored to a wider span than one block: tiles, rows or loops, not blocks
    return block


def _spill(stores: _Stores, shape: Sequence[int], shared: np.ndarray, i: int) -> tuple[int, int, int, int] | None:
    """``(program, owner, first, last)`` when the element ``i`` two programs stored is the spill of a store
    without its mask: one program's elements run, with no gap and no other program's, up to the end of a
    slice of the output (a head of an ``(H, T, D)`` output, a row of an ``(R, N)`` one) and then on into
    ``first..last``, the start of the next slice, where the other program's own elements begin. A wrong
    ``pid → offset`` mapping shifts a program's whole share, so it does not end at a slice's end."""
    if len(shape) < 2:
        return None
    pair = (int(stores.first[i]), int(stores.last[i]))
    for program, owner in (pair, pair[::-1]):
        low, high, _ = stores.ranges.get(program, (-1, -1, 0))
        both = shared & (((stores.first == program) & (stores.last == owner))
                         | ((stores.first == owner) & (stores.last == program)))
        start = int(np.argmax(both))
        own = slice(low, start)
        if not (0 <= low < start <= high) or int(np.nonzero(both)[0].max()) > high \
                or stores.ranges.get(owner, (-1, -1, 0))[0] != start:
            continue
        if not (bool((stores.first[own] == program).all()) and bool((stores.last[own] == program).all())):
            continue  # a gap or another program's element in its own part: not rows cut off by a mask
        row = int(shape[-1])
        for k in range(1, len(shape)):
            size = int(np.prod(shape[k:]))
            whole_rows = size == row or (high - start + 1) % row == 0  # past a head: whole rows spill
            if start % size == 0 and low >= start - size and whole_rows:
                return program, owner, start, high
    return None


def _store_causes(unwritten: np.ndarray, stores: _Stores, shape: Sequence[int], block: int | None) -> list[str]:
    """What the store maps show about why elements are missing: only what the evidence shows."""
    total = unwritten.size
    storing = {p: r for p, r in stores.ranges.items() if r[2] > 0}
    never_stored = unwritten & (stores.last < 0)
    unaddressed = never_stored & (stores.masked < 0)
    masked_off = never_stored & (stores.masked >= 0)
    causes: list[str] = []
    mapping = False
    if len(storing) > 1 and len(set(storing.values())) == 1:
        low, high, _ = next(iter(storing.values()))
        question = " (is pid * BLOCK missing from them?)" if block else ""
        causes.append(f"every program ({len(storing)}) stored to the same elements, {_span_text(low, high, shape)}: "
                      f"the offsets do not depend on the program id{question}")
        mapping = True
    else:
        shared = (stores.first >= 0) & (stores.first != stores.last)
        spill = _spill(stores, shape, shared, int(np.argmax(shared))) if shared.any() else None
        if spill is not None:
            program, owner, start, end = spill
            past = np.unravel_index(start - 1, tuple(shape))[:-1]
            row = str(int(past[0])) if len(past) == 1 else "(" + ", ".join(str(int(c)) for c in past) + ")"
            causes.append(
                f"the stores are not masked: program {program}'s lanes past row {row} wrote into "
                f"{_span_text(start, end, shape)}, the elements program {owner} owns (a missing store mask): "
                "mask the store to the rows that exist"
            )
        elif shared.any():
            i = int(np.argmax(shared))
            which = ""
            if len(stores.sites) > 1 and stores.first_site is not None and stores.last_site is not None:
                # Several stores per program: say which two met, so the wrong one's offsets are named.
                which = (f" — program {int(stores.first[i])}'s {stores.site_text(int(stores.first_site[i]))} "
                         f"and program {int(stores.last[i])}'s {stores.site_text(int(stores.last_site[i]))}")
            causes.append(
                f"programs {int(stores.first[i])} and {int(stores.last[i])} both stored to index "
                f"{_fmt_flat(i, shape)} ({_plural(int(shared.sum()), 'element')} stored by more than one "
                f"program){which}: the pid → offset mapping sends two programs to the same elements"
            )
            mapping = True
        if stores.self_overwrites and (unwritten.any() or not mapping):
            (earlier, later), (count, element, program) = max(stores.self_overwrites.items(),
                                                               key=lambda item: item[1][0])
            causes.append(
                f"the {stores.site_text(later)} wrote over what the {stores.site_text(earlier)} of the same "
                f"program had stored ({_plural(count, 'element')}; first at index {_fmt_flat(element, shape)}, "
                f"program {program}): check the offsets of the {stores.site_text(later)}"
            )
            mapping = True
        if block and spill is None:
            for program in sorted(storing):
                low, high, _ = storing[program]
                own_low, own_high = program * block, min((program + 1) * block, total) - 1
                if low < own_low or high > own_high:
                    causes.append(
                        f"program {program} stored to {_span_text(low, high, shape)}, outside its own block "
                        f"{own_low}..{own_high} (BLOCK = {block}): its offsets do not start at pid * BLOCK"
                    )
                    mapping = True
                    break
    # Programs whose store lanes pointed into the output but were all masked off. In a 1-D kernel
    # that is the mask's doing; in a 2-D tile a masked lane past the last column points at the next
    # row, so there it only says the programs' tiles miss the output.
    idle = [p for p, r in stores.ranges.items() if r[2] == 0]
    if not mapping and idle and not block and never_stored.any():
        causes.append(
            f"{_programs_text(idle)} stored nothing here (every lane masked off) while "
            f"{_region_text(never_stored, shape)} were never stored: the pid → tile mapping leaves part of "
            "the output to no program"
        )
        return causes
    if mapping:
        if unaddressed.any() or masked_off.any():
            causes.append(f"no program stored to {_region_text(never_stored, shape)}")
        return causes
    if unaddressed.any():
        # Every store of every program counts: a kernel storing twice per program reaches twice its lanes.
        reach = stores.reach_total()
        if reach < total:
            lanes = (f"× {stores.lanes} lanes" if reach == stores.programs * stores.lanes
                     else "with all their stores' lanes")
            causes.append(
                f"the grid is too small: {_plural(stores.programs, 'program')} {lanes} reach at "
                f"most {reach} of the {total} elements; no store reached {_region_text(unaddressed, shape)}"
            )
        else:
            skipped = "it" if int(unaddressed.sum()) == 1 else "them"
            causes.append(f"no program's store reached {_region_text(unaddressed, shape)}: the offsets skip {skipped}")
    if masked_off.any():
        program = int(stores.masked[int(np.argmax(masked_off))])
        causes.append(f"the store to {_region_text(masked_off, shape)} was masked off (by program {program}): "
                      "is the mask's bound too tight?")
    return causes


def _block_shape(bad: np.ndarray, block: int) -> str | None:
    """The wrong elements' pattern over the blocks of a 1-D launch, or None if it has none to name."""
    total = bad.size
    blocks = -(-total // block)
    if blocks < 2:
        return None
    indices = np.nonzero(bad)[0]
    bad_blocks = sorted(set((indices // block).tolist()))
    tail = total % block
    if tail and bad_blocks == [blocks - 1]:
        start = (blocks - 1) * block
        return (f"wrong only in the padded tail, the last partial block (indices {start}..{total - 1}); every "
                "full block is right — only there is the mask partly off: check it and the loads' `other=`")
    lanes = sorted(set((indices % block).tolist()))
    if len(bad_blocks) >= 2 and len(lanes) < block:
        periodic = True
        for k in range(blocks):
            valid = min(block, total - k * block)
            in_block = bad[k * block : k * block + valid]
            expected = np.zeros(valid, dtype=bool)
            expected[[lane for lane in lanes if lane < valid]] = True
            if not np.array_equal(in_block, expected):
                periodic = False
                break
        if periodic:
            return (f"the same lanes of every block of {block} (BLOCK) are wrong: lanes {_ranges_text(lanes)} — "
                    "periodic with period BLOCK; the other lanes are right")
    if bad_blocks == list(range(1, blocks)):
        return f"the first block (indices 0..{block - 1}) is right, every later block is wrong"
    return None


def _layout_hints(
    unwritten: np.ndarray, wrong: np.ndarray, shape: Sequence[int], stores: _Stores | None
) -> list[str]:
    """Where the wrong or unwritten elements are (their shape) and, from the store maps, why."""
    bad = unwritten | wrong
    total = bad.size
    count = int(bad.sum())
    if count == 0 or total < 2:
        return []
    hints: list[str] = []
    block = _block_size(stores, total) if stores is not None else None
    if stores is not None:
        hints += _store_causes(unwritten, stores, shape, block)
    if count == total:
        return hints
    pattern = _block_shape(bad, block) if block else None
    if pattern is None and (wrong.any() or len(shape) >= 2):
        region = _region_text(bad, shape)
        if not any(region in hint for hint in hints):  # not said already (the unwritten line says 1-D runs)
            first = int(np.argmax(bad))
            pattern = f"first wrong at index {_fmt_flat(first, shape)}; wrong: {region}, right elsewhere"
    if pattern:
        hints.append(f"where: {pattern}")
    return hints
