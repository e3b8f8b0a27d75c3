"""The check of chapter 13's shared-memory layout exercise: ``smem_swizzle(row, col) -> int``.

The learner writes where element ``(row, col)`` of the register-tiled GEMM's transposed A tile (``TILE_ROWS``
rows of k, ``TILE_COLS`` columns of m: ``gemm_regtile<16, ...>`` in chapters/13_below_triton/src/cuda) is kept
in shared memory, as a 4-byte word offset. :func:`check_smem_swizzle` calls it for every element and judges the
layout as the kernel would use it:

* a bijection: every element at its own word (no two at one offset), every offset in ``[0, bound)`` — the
  tile's words plus one 16-byte column of padding per row (``TILE_ROWS * (TILE_COLS + 4)``);
* every aligned group of 4 columns of a row in 4 consecutive words starting at a multiple of 4, so that the
  inner loop can read it as one float4 (a 16-byte shared load must be 16-byte aligned);
* the tile's store (each lane's (row, col) as the kernel writes it: four 4-byte stores per float4 of A) and the
  inner loop's 16-byte reads free of bank conflicts, counted lane by lane by :mod:`utils.banks`.

An offset is an ``int``, or an integer NumPy or torch scalar (a 0-d integer array or tensor), converted; anything
else — a bool, a float, an array or tensor of one element — is rejected. It never raises for a wrong answer: an
exception, a stub, a non-integer, collisions, offsets out of range, broken 16-byte groups and bank conflicts all
become a NOT SOLVED verdict saying which elements, which lanes and which bank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .. import banks
from .. import exercises as _package
from .verdict import NOT_SOLVED_MARK, SOLVED_MARK, Verdict, _wrapped

__all__ = ["TILE_COLS", "TILE_ROWS", "TILE_BOUND", "check_smem_swizzle", "layout_problems"]

#: The transposed A tile of ``gemm_regtile<16, ...>``: BK = 16 rows (k) of BM = 128 columns (m).
TILE_ROWS = 16
TILE_COLS = 128
#: Offsets must lie below this: the tile's words plus 4 words (one 16-byte column) of padding per row.
TILE_BOUND = TILE_ROWS * (TILE_COLS + 4)

_SHOWN = 3  # examples named per kind of problem


#: What a word offset may be, said with every rejection.
TAKEN = "an int, or an integer NumPy or torch scalar: a 0-d integer array or tensor"


def _as_offset(value: Any) -> int | None:
    """``value`` as an int word offset: an ``int``, a NumPy integer scalar, or a 0-d integer NumPy array or torch
    tensor (converted); None for anything else — bools (of any kind), floats, arrays or tensors of one element."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.integer):
            return int(value)
        if isinstance(value, numpy.ndarray):
            return int(value) if value.ndim == 0 and numpy.issubdtype(value.dtype, numpy.integer) else None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
        return int(value.item()) if value.dim() == 0 and integer else None
    return None


def _offsets(candidate: Callable[[int, int], Any], rows: int, cols: int) -> tuple[dict | None, str | None]:
    """Every element's offset, or None and the problem that stopped the calls."""
    found = {}
    for row in range(rows):
        for col in range(cols):
            try:
                value = candidate(row, col)
            except NotImplementedError:
                return None, "not implemented yet: smem_swizzle raised NotImplementedError (fill in the stub)"
            except Exception as error:  # the learner's bug, reported, never raised
                return None, f"smem_swizzle({row}, {col}) raised {type(error).__name__}: {error}"
            offset = _as_offset(value)
            if offset is None:
                kind = type(value).__name__
                return None, (
                    f"smem_swizzle({row}, {col}) returned {value!r} ({kind}): expected an int word offset ({TAKEN})"
                )
            found[row, col] = offset
    return found, None


def _examples(items: list[str], total: int) -> str:
    more = f" (and {total - len(items)} more)" if total > len(items) else ""
    return "; ".join(items) + more


def layout_problems(
    candidate: Callable[[int, int], Any], rows: int = TILE_ROWS, cols: int = TILE_COLS, bound: int | None = None
) -> tuple[list[str], list[str]]:
    """What is wrong with the layout ``candidate`` gives a ``rows x cols`` tile (empty when nothing is), and
    what was measured (the store's and the reads' wavefronts), as verdict lines."""
    bound = rows * (cols + 4) if bound is None else bound
    offsets, stopped = _offsets(candidate, rows, cols)
    if offsets is None:
        return [stopped], []
    problems: list[str] = []
    outside = [(rc, o) for rc, o in offsets.items() if not 0 <= o < bound]
    if outside:
        shown = [f"({r}, {c}) -> {o}" for (r, c), o in outside[:_SHOWN]]
        problems.append(
            f"offsets outside [0, {bound}) ({rows} x {cols} words plus 4 words of padding a row): "
            + _examples(shown, len(outside))
        )
    first_at: dict[int, tuple[int, int]] = {}
    collisions = []
    for rc, o in offsets.items():
        if o in first_at:
            collisions.append((first_at[o], rc, o))
        else:
            first_at[o] = rc
    if collisions:
        shown = [f"{a} and {b} both at word {o}" for a, b, o in collisions[:_SHOWN]]
        problems.append(
            f"not a bijection: {len(collisions)} elements share a word with another — "
            + _examples(shown, len(collisions))
        )
    broken = []
    for row in range(rows):
        for col in range(0, cols - cols % 4, 4):
            words = [offsets[row, col + j] for j in range(4)]
            if words[0] % 4 or words != list(range(words[0], words[0] + 4)):
                broken.append(f"row {row}, cols {col}..{col + 3} at words {words}")
    if broken:
        problems.append(
            "16-byte groups broken: the inner loop reads columns 4j..4j+3 of a row as one float4, which "
            "needs 4 consecutive words starting at a multiple of 4 — " + _examples(broken[:_SHOWN], len(broken))
        )
    if outside:
        return problems, []
    measured: list[str] = []
    store = banks.a_tile_store(lambda k, m: offsets[k, m], rows, cols)
    element_at = {o: rc for rc, o in offsets.items()}

    def holding(access: banks.WarpAccess) -> str:
        held = [f"{element_at[w]}" for w in access.worst_words if w in element_at]
        return f" — words {', '.join(map(str, access.worst_words))} hold elements (row, col) {', '.join(held)}"

    if store.conflicts:
        warp, step, access = store.worst
        problems.append(
            f"bank conflicts in the tile's store (each lane stores 4 k's of one row m of A, the lanes of a "
            f"warp {128 // rows} rows m x {rows // 4} groups of k): {store.wavefronts} wavefronts where "
            f"{store.ideal} would do; worst, warp {warp} store {step}: {access.describe()}{holding(access)}"
        )
    measured.append(
        f"the tile's store: {len(store.accesses)} warp accesses, {store.wavefronts} wavefronts (ideal {store.ideal})"
    )
    if not broken:
        reads = banks.a_tile_load(lambda k, m: offsets[k, m], rows, cols)
        if reads.conflicts:
            warp, step, access = reads.worst
            problems.append(
                f"bank conflicts in the inner loop's float4 reads: {reads.wavefronts} wavefronts where "
                f"{reads.ideal} would do; worst, warp {warp} read {step}: {access.describe()}{holding(access)}"
            )
        measured.append(
            f"the inner loop's float4 reads: {len(reads.accesses)} warp accesses, {reads.wavefronts} "
            f"wavefronts (ideal {reads.ideal})"
        )
    return problems, measured


def check_smem_swizzle(
    candidate: Callable[[int, int], Any],
    *,
    name: str = "ch13_below_triton.smem_swizzle",
    rows: int = TILE_ROWS,
    cols: int = TILE_COLS,
    bound: int | None = None,
) -> Verdict:
    """Judge ``candidate(row, col) -> word offset`` as the transposed A tile's layout; print and return the verdict.

    ``rows`` x ``cols``: the tile (k by m); ``bound``: offsets allowed below it (default: one 16-byte column of
    padding per row). Never raises for a wrong answer (see the module docstring).
    """
    bound = rows * (cols + 4) if bound is None else bound
    problems, measured = layout_problems(candidate, rows, cols, bound)
    if problems:
        lines = [f"{NOT_SOLVED_MARK} — {name}", f"   the {rows} x {cols} transposed A tile, offsets below {bound}"]
        lines += [f"   • {p}" for p in problems]
        lines += [f"   measured: {m}" for m in measured]
        solved = False
    else:
        lines = [
            f"{SOLVED_MARK} — {name}: every element of the {rows} x {cols} tile at its own word below {bound}, "
            "16-byte groups whole, no bank conflicts"
        ]
        lines += [f"   {m}" for m in measured]
        solved = True
    message = "\n".join(_wrapped(lines))
    _package._LAST_VERDICTS[name] = solved
    print(message)
    return Verdict(name=name, solved=solved, message=message)
