"""Checks for CUDA C++ exercises (chapter 13): the learner's kernel run thread by thread on the CPU, then read
as sm_90 SASS.

A CUDA exercise's stub is a string of CUDA C++ holding one ``__global__`` kernel. Its check
(:func:`check_rms_norm_warp`) prints one verdict block, like every check of the course, and never raises
for a wrong answer:

* **run on the CPU** by the SIMT emulator (:func:`utils.simt.run_checked`): g++ compiles the same source, every
  CUDA thread is a fiber, ``__syncthreads()`` and the warp shuffles really wait for each other; a compile
  error, a deadlock or a barrier not every thread reaches, a shuffle whose lanes returned, a misaligned
  ``float4`` access, a crash or a kernel that never ends is NOT SOLVED with the emulator's words;
* on awkward cases — one column, fewer columns than a float4, tails of 1 to 3, rows padded to a larger stride,
  two blocks of 8 warps (the last partial), no rows at all, a row holding a NaN — each tensor between **guard
  regions**: the output ``y``'s guards and the padding between its rows hold a canary (a write there is
  reported, by element), the inputs' hold NaN (a read there spoils the row visibly); ``y`` starts **poisoned** (a
  NaN with its own payload), so unwritten elements are told apart from wrong ones; with AddressSanitizer (g++'s),
  the guards and the padding between rows are poisoned, so a read there or a float4 that writes back a row's
  padding unchanged is named too (the tensor, the row, the bytes, the line);
* compared with a **float64 reference**, the wrong or unwritten elements described by rows, columns and the
  lanes that own them, the common mistakes recomputed and named when they match;
* then **compiled for sm_90** by ``nvcc`` (:func:`utils.nvcc.compile_cuda`): no spills, 128-bit global loads
  (``LDG.E.128``), a shuffle reduction (``SHFL``), and no shared memory or block barrier (``LDS``/``STS``/
  ``BAR``) — a warp that owns a row needs neither. Without ``nvcc`` that part is said to be skipped.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import torch

from .cpp_kernel import POISON_BITS, _spans, _verdict, _where
from .verdict import Verdict

__all__ = ["RMS_NORM_WARP_STUB", "check_rms_norm_warp", "rms_norm_warp_sass"]

RMS_WARP_NAME = "ch13_below_triton.RMS_NORM_WARP"
KERNEL = "rms_norm_warp"
CHILD_TIMEOUT_S = 30

RMS_NORM_WARP_STUB = r"""#include <cuda_runtime.h>

__global__ void rms_norm_warp(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                              long long rows, long long cols, long long row_stride, float eps) {
  // YOUR CODE HERE: one warp per row, y[r, c] = x[r, c] / sqrt(mean over c of x[r, c]^2 + eps) * w[c]
}
"""

#: ``(rows, cols, row_stride, eps, warps per block, the row holding a NaN or None)``: an easy case first (with an
#: eps that matters on rows of whole float4s: 0.5 against a mean square near 1), then one column, a tail of 3 with
#: eps that matters, two blocks of 8 warps (the second with 5 rows: 3 warps of it have none), a long row, a row
#: longer than 128 float4 (4100 = 4 · 1025), no rows, and a NaN in one row (only that row is NaN). Each launches
#: ``<<<ceil(rows / warps), 32 * warps>>>``.
CASES = (
    (4, 64, 64, 0.5, 4, None),
    (1, 1, 4, 1e-5, 4, None),
    (5, 7, 8, 0.25, 4, None),
    (13, 33, 36, 1e-5, 8, None),
    (3, 1000, 1000, 1e-5, 4, None),
    (2, 4100, 4104, 1e-5, 4, None),
    (0, 5, 8, 1e-5, 4, None),
    (6, 37, 40, 1e-5, 4, 2),
)
RTOL, ATOL = 1e-4, 1e-5

_NAMES = ["x", "w", "y", "rows", "cols", "row_stride", "eps"]


def _seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    base = os.environ.get("KERNEL_LADDER_CHECK_SEED", "").strip()
    if base:
        return zlib.crc32(f"{base}:{RMS_WARP_NAME}".encode()) & 0x7FFFFFFF
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def _reference(x: np.ndarray, w: np.ndarray, eps: float, upto: int | None = None) -> np.ndarray:
    x64 = x.astype(np.float64)
    squares = (x64[:, :upto] ** 2).sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return x64 / np.sqrt(squares / max(x.shape[1], 1) + eps) * w.astype(np.float64)


def _lanes(cols: int) -> np.ndarray:
    """The lane that owns each column: float4 ``i`` (columns 4i..4i+3) is lane ``i % 32``'s, the tail's columns
    lane ``(c - 4 * (cols // 4)) % 32``'s."""
    c = np.arange(cols)
    body = 4 * (cols // 4)
    return np.where(c < body, (c // 4) % 32, (c - body) % 32)


def _value_causes(
    x: np.ndarray, w: np.ndarray, eps: float, got: np.ndarray, wrong: np.ndarray, written: np.ndarray, case: tuple
) -> list[str]:
    """The common mistakes, recomputed in float64, whose result is what the kernel wrote; then what the wrong
    elements' pattern says (the lanes that own them, a factor shared by a row)."""
    rows, cols, stride = case[:3]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    mean = (x64**2).mean(axis=1, keepdims=True)
    candidates = {
        "the sum of squares leaves out the tail (the last cols % 4 columns, which are no float4): add them to the "
        "lane's partial sum before the reduction": [_reference(x, w, eps, cols - cols % 4)] if cols % 4 else [],
        "the output is not multiplied by w": [x64 / np.sqrt(mean + eps)],
        "eps is missing (or added after the square root): 1 / sqrt(mean + eps)": [
            x64 / np.sqrt(mean) * w64,
            x64 / (np.sqrt(mean) + eps) * w64,
        ],
        "the sum of squares is not divided by cols (the mean)": [
            x64 / np.sqrt((x64**2).sum(1, keepdims=True) + eps) * w64
        ],
        f"the sum of squares is divided by row_stride ({stride}), not by cols ({cols}): the mean is over the row's "
        "cols elements (row_stride only says where the next row starts)": [
            x64 / np.sqrt((x64**2).sum(1, keepdims=True) / stride + eps) * w64
        ]
        if stride != cols
        else [],
        "eps is added before the division by cols ((sum + eps) / cols): 1 / sqrt(sum / cols + eps)": [
            x64 / np.sqrt(((x64**2).sum(1, keepdims=True) + eps) / max(cols, 1)) * w64
        ],
    }
    found = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for cause, values in candidates.items():
            if any(np.allclose(got[written], v[written], rtol=RTOL, atol=ATOL) for v in values):
                found.append(cause)
        if found:
            return found
        expected = _reference(x, w, eps)
        lanes = _lanes(cols)
        bad_rows = np.nonzero(wrong.any(axis=1))[0]
        usable = written & np.isfinite(got) & np.isfinite(expected) & (np.abs(expected) > 1e-3)
        ratio = np.where(usable, got.astype(np.float64) / np.where(usable, expected, 1.0), np.nan)
        lane_zero_right = all(not wrong[r][lanes == 0].any() for r in bad_rows)
        if cols > 4 and lane_zero_right and all(wrong[r][lanes != 0].any() for r in bad_rows):
            found.append(
                "lane 0's columns are right, the other lanes' wrong: only lane 0 holds the row's sum after "
                "the reduction (__shfl_down_sync leaves the total in lane 0 alone) — broadcast it "
                "(__shfl_sync(0xffffffff, sum, 0)), or reduce with __shfl_xor_sync: every lane ends with it"
            )
        elif bad_rows.size:
            per_row = [ratio[r][np.isfinite(ratio[r])] for r in bad_rows]
            constant = [v for v in per_row if v.size and np.ptp(v) <= 1e-3 * np.abs(v).max()]
            if len(constant) == len(per_row):
                found.append(
                    "each wrong row is off by one factor: its 1 / sqrt(mean + eps) is wrong — none of the sum "
                    "over row_stride, eps inside the division, the sum for the mean fits; is the sum of squares "
                    "wrong? The reduction must add the partial sums of all 32 lanes (xor offsets 16, 8, 4, 2, 1) "
                    "and each lane must first add every float4 and tail element it owns (a loop i = lane, "
                    "lane + 32, ...)"
                )
            elif any(v.size for v in per_row):
                found.append(
                    "the lanes of a row disagree on its factor: not every lane holds the whole row's sum "
                    "after the reduction — with __shfl_xor_sync and offsets 16, 8, 4, 2, 1 every lane ends "
                    "with the total"
                )
        if not found and rows > 1 and stride != cols and not wrong[0].any():
            found.append(
                f"row 0 is right, later rows wrong, and this case's rows are padded (row_stride {stride}, "
                f"cols {cols}): row r starts at x + r * row_stride (and y + r * row_stride)"
            )
    return found


def _status_problems(report: Any) -> list[str]:
    """The verdict's lines for a run that did not finish (compile error, deadlock, crash, ...)."""
    status, message = report.status, report.message
    if status == "compile_error":
        where = sorted({line for file, line, _ in report.compile_errors if file == "kernel.cu"})
        said = f" (line(s) {', '.join(map(str, where))} of the source string)" if where else ""
        errors = [f"    {file}:{line}: {text}" for file, line, text in report.compile_errors[:8]]
        return [f"does not compile{said}: g++ says", *(errors or ["    " + message[-600:]])]
    lines = message.splitlines() or [status]
    first = lines[0] if lines[0].startswith(status) else f"{status}: {lines[0]}"
    problems = [first, *("    " + line.strip() for line in lines[1:])]
    if status == "deadlock" and "__syncthreads()" in message:
        problems.append(
            "cause: a __syncthreads() that not every thread of the block reaches (in a branch, or after "
            "an early return of some lanes): a warp that owns a row needs no block barrier — its "
            "shuffles are what synchronizes its lanes"
        )
    elif status == "deadlock" and "returned" in message:
        problems.append(
            "cause: a shuffle with the full mask after some lanes returned: every lane named in the mask "
            "must reach it — return whole warps only (row >= rows), and let every lane of a warp take "
            "part in the reduction, even those with nothing to add"
        )
    elif "not reached by every thread" in message:
        problems.append(
            "cause: a __syncthreads() that some lanes of a warp skip (they returned, or took another branch): "
            "CUDA leaves such a barrier undefined — and a warp that owns a row needs no block barrier at all"
        )
    elif "divergent __syncthreads()" in message:
        problems.append(
            "cause: a __syncthreads() in a branch some threads skip: a warp that owns a row needs no "
            "block barrier at all"
        )
    elif status == "misaligned":
        problems.append(
            "cause: a float4 load or store at an address that is not a multiple of 16 bytes: each row "
            "starts 16-byte aligned (row_stride is a multiple of 4), so take float4 number i of a row as "
            "reinterpret_cast<const float4*>(x + row * row_stride)[i], and the columns past the last "
            "whole float4 one by one"
        )
    elif status == "timeout":
        problems.append(
            "cause: a loop that never ends — a counter that does not advance (i += 32 per lane), or a "
            "bound compared the wrong way"
        )
    elif status == "crash":
        problems.append(
            "cause: an access far outside x, w and y: a row index past rows (return when row >= rows), "
            "or an offset computed in 32 bits"
        )
    return problems


def _case_line(index: int, count: int, case: tuple) -> str:
    rows, cols, stride, eps, warps, nan_row = case
    text = (
        f"case {index + 1} of {count}: rows={rows}, cols={cols}, row_stride={stride}, eps={eps:g}; "
        f"<<<{-(-rows // warps)}, {32 * warps}>>> ({warps} warps per block)"
    )
    return text + (f"; row {nan_row} of x holds a NaN" if nan_row is not None else "")


def _run_case(source: str, case: tuple, gen: torch.Generator) -> tuple[list[str], Any]:
    """Problems of one case (empty when it passes), and the run's report."""
    from utils import simt

    rows, cols, stride, eps, warps, nan_row = case
    x_base = torch.randn(rows, stride, generator=gen)
    if nan_row is not None:
        x_base[nan_row, cols // 2] = float("nan")
    x = x_base[:, :cols]
    w = torch.randn(cols, generator=gen) * 0.5 + 1.0
    y_base = torch.full((rows, stride), POISON_BITS, dtype=torch.int32).view(torch.float32)
    y = y_base[:, :cols]
    x_before, w_before = x.clone(), w.clone()
    report = simt.run_checked(
        source,
        KERNEL,
        -(-rows // warps),
        32 * warps,
        [x, w, y, rows, cols, stride, eps],
        outputs=[2],
        names=_NAMES,
        timeout=CHILD_TIMEOUT_S,
        count_reads=True,
    )
    if report.status != "ok":
        return _status_problems(report), report
    problems = []
    seen = set()
    for access in report.bad_accesses:  # one line per tensor and direction: the first such access
        if (access.arg, access.write) not in seen:
            seen.add((access.arg, access.write))
            problems.append(_bad_access_line(access, cols))
    for hit in report.guard_hits:
        text = f"wrote outside {hit.arg}: {str(hit).split(': wrote ', 1)[1]}"
        if hit.arg == "y" and (hit.gaps or hit.after):
            text += (
                f" — a row is {cols} long: the float4 loop covers 4 * (cols / 4) columns, the tail the rest, "
                "and nothing reaches column cols"
            )
        problems.append(text)
    for name in report.changed_inputs:
        problems.append(f"changed the input {name} (it is const: write only y)")
    if not torch.equal(x.view(torch.int32), x_before.view(torch.int32)) and "x" not in report.changed_inputs:
        problems.append("changed the input x")
    if not torch.equal(w.view(torch.int32), w_before.view(torch.int32)) and "w" not in report.changed_inputs:
        problems.append("changed the input w")
    got = y.numpy().copy()
    x_np, w_np = x_before.numpy(), w_before.numpy()
    unwritten = got.view(np.uint32) == POISON_BITS
    if rows and unwritten.any():
        text = _where(unwritten, "never written (still the poison NaN)")
        causes = _unwritten_causes(unwritten, case)
        if unwritten.all() and not causes:
            text += " — the stub, or a store that never runs"
        problems = causes + problems + [text]
    expected = _reference(x_np, w_np, eps)
    with np.errstate(invalid="ignore"):
        close = np.abs(got.astype(np.float64) - expected) <= ATOL + RTOL * np.abs(expected)
    close |= np.isnan(expected) & np.isnan(got)
    wrong = ~unwritten & ~close
    if rows and wrong.any():
        wrong_rows = np.nonzero(wrong.any(axis=1))[0].tolist()
        if nan_row is not None and wrong_rows == [nan_row]:
            # Every other row is right: the NaN row alone says what is wrong (not the row stride, not the sum).
            first = tuple(int(i) for i in np.argwhere(wrong)[0])
            return [
                f"cause: only row {nan_row}, the row holding a NaN, is wrong: a NaN in x makes its sum of squares, "
                "its rstd and all of its outputs NaN (as torch gives them) — no guard may replace it "
                "(if (r != r), isnan, fmaxf): a NaN in the input must show in the output",
                _where(wrong, "wrong") + f": got {float(got[first]):.6g}, expected {float(expected[first]):.6g}",
                *problems,
            ], report
        if (np.isnan(got) & wrong & ~np.isnan(expected)).any():
            problems.append(
                "NaN computed in a row with no NaN: a read outside x's row (the padding between rows and "
                "the guards hold NaN) — a float4 past the row's end, or a wrong row stride; or a local variable "
                "used before every lane set it (each starts as garbage here, as a register does on a GPU: "
                "float sum = 0.0f; in every lane)"
            )
        if nan_row is not None and not np.isnan(got[nan_row][~unwritten[nan_row]]).all():
            problems.append(
                f"row {nan_row} holds a NaN, so all of its outputs must be NaN (its sum of squares is "
                "NaN): some are not — is every element of the row in the sum?"
            )
        first = tuple(int(i) for i in np.argwhere(wrong)[0])
        problems.append(
            _where(wrong, "wrong") + f": got {float(got[first]):.6g}, expected {float(expected[first]):.6g}"
        )
        causes = _value_causes(x_np, w_np, eps, got, wrong, ~unwritten, case)
        problems = [f"cause: {c}" for c in causes] + problems
    if not problems:
        problems = _what_ran(report, case)
    return problems, report


def _what_ran(report: Any, case: tuple) -> list[str]:
    """What the spec asks of the running kernel, counted by the emulator: each row's lanes reduce with warp
    shuffles, x and w are read 16 bytes at a time (float4)."""
    rows, cols = case[:2]
    problems = []
    if not rows:
        return problems
    vectors = cols // 4
    reducing = sum(1 for n in report.shuffles if n >= 5)
    if cols >= 8 and reducing < 32 * rows:
        most = max(report.shuffles, default=0)
        problems.append(
            f"the lanes of a row do not reduce with warp shuffles: {reducing} thread(s) executed 5 or more "
            f"(the most any thread ran: {most}), where each of the {rows} row(s) needs its 32 lanes to — each "
            "lane adds its own float4s, then __shfl_xor_sync(0xffffffff, sum, offset) for offsets 16, 8, 4, 2, 1 "
            "gives every lane the row's sum (a lane summing the whole row alone reads it 32 times over)"
        )
    x_reads, w_reads = report.reads16.get("x", 0), report.reads16.get("w", 0)
    if vectors and x_reads < rows * vectors:
        problems.append(
            f"x is read 4 bytes at a time: {x_reads} float4 read(s) of x ran, while its {rows} row(s) hold "
            f"{rows * vectors} whole float4s — load x as float4: reinterpret_cast<const float4*>(x + row * "
            "row_stride)[i], the tail (cols % 4 columns) one by one"
        )
    if vectors and w_reads < vectors:
        problems.append(
            f"w is read 4 bytes at a time: {w_reads} float4 read(s) of w ran, while w holds {vectors} whole "
            "float4s — load w as float4 too: reinterpret_cast<const float4*>(w)[i]"
        )
    return problems


def _bad_access_line(access: Any, cols: int) -> str:
    """One read or write of bytes that are no element of x, w or y (AddressSanitizer's report, by the emulator)."""
    verb = "wrote" if access.write else "read"
    count = f"{access.outside} byte{'s' if access.outside != 1 else ''}"
    where = f"{access.line}, {access.thread}" if access.thread else access.line
    text = f"{access.arg + ': ' if access.arg else ''}{verb} {count} {access.place} — a {access.size}-byte "
    text += f"{'write' if access.write else 'read'} at {where}"
    if access.arg in ("x", "y") and access.row is not None:
        text += (
            f"; a row of {access.arg} is cols = {cols} float{'s' if cols != 1 else ''}: the bytes after it (up to "
            "row_stride, or past the tensor) are no element of the view, even to write back what was there (on "
            "a GPU they may be another tensor's) — float4s up to 4 * (cols / 4), then the tail one by one"
        )
    elif access.arg == "w":
        text += f"; w holds cols = {cols} floats — float4s of w up to 4 * (cols / 4), then the tail one by one"
    return text


def _unwritten_causes(unwritten: np.ndarray, case: tuple) -> list[str]:
    rows, cols, _, _, warps, nan_row = case
    causes = []
    row_unwritten = unwritten.all(axis=1)
    if nan_row is not None and np.nonzero(unwritten.any(axis=1))[0].tolist() == [nan_row]:
        causes.append(
            f"the NaN row was skipped: row {nan_row}, the row holding a NaN, is the only one left unwritten — its "
            "rstd is NaN and so must be all of its outputs, as torch gives them: write every row (a NaN must "
            "propagate, not be left out)"
        )
    elif rows > 1 and not row_unwritten.all():
        lead = np.arange(rows) % warps == 0
        if row_unwritten[~lead].all() and not row_unwritten[lead].any():
            causes.append(
                f"only the first row of each block of {warps} rows is written: each warp takes its own "
                "row, row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32"
            )
        elif row_unwritten.any() and not unwritten[~row_unwritten].any():
            missing = np.nonzero(row_unwritten)[0].tolist()
            causes.append(
                f"whole rows are never written ({'rows' if len(missing) > 1 else 'row'} {_spans(missing)}) while the "
                "others are: warp "
                "threadIdx.x / 32 of block blockIdx.x owns row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32 "
                f"— this launch has {warps} warps per block, so block b starts at row {warps} · b; a fixed "
                "number of warps per block in the row index skips rows (and gives others to two warps)"
            )
    tail = cols % 4
    columns = unwritten.any(axis=0)
    if (
        tail
        and (cols < 4 or not row_unwritten.all())
        and columns[cols - tail :].all()
        and not columns[: cols - tail].any()
    ):
        causes.append(
            f"the scalar tail is missing: the last cols % 4 = {tail} column(s) of each row are no "
            "float4 — take them one by one after the float4 loop"
        )
    elif columns.any() and not columns.all() and not row_unwritten.any():
        lanes = _lanes(cols)
        owners = sorted(set(lanes[columns].tolist()))
        if len(owners) < 32 and not set(lanes[~columns].tolist()) & set(owners):
            causes.append(
                f"the columns of lane(s) {_spans(owners)} are never written: each lane walks float4 "
                "i = lane, lane + 32, ... up to cols / 4"
            )
    return [f"cause: {c}" for c in causes]


def rms_norm_warp_sass(source: str) -> tuple[list[str], str]:
    """What the sm_90 build of ``source``'s ``rms_norm_warp`` breaks of the spec (problems; empty if nothing),
    and a one-line summary of what it is. Raises :class:`utils.nvcc.NvccNotFound` without nvcc."""
    from collections import Counter

    from utils import nvcc

    try:
        build = nvcc.compile_cuda(source)
        ops = build.instructions(KERNEL)
        info = build.info(KERNEL)
    except nvcc.CudaCompileError as error:
        lines = [line for line in error.log.splitlines() if "error" in line][:4]
        return ["nvcc cannot compile it for sm_90 (g++ could): " + " | ".join(lines or [str(error)[:300]])], ""
    except KeyError as error:
        return [f"no kernel named {KERNEL} in nvcc's build: {error}"], ""
    opcodes = Counter(op.opcode for op in ops)
    wide = sum(n for opcode, n in opcodes.items() if opcode.startswith("LDG") and ".128" in opcode)
    narrow = sum(n for opcode, n in opcodes.items() if opcode.startswith("LDG") and ".128" not in opcode)
    shuffles = Counter(op.opcode for op in ops if op.base == "SHFL")
    shared = Counter(op.opcode for op in ops if op.base in ("LDS", "STS", "LDSM", "ATOMS", "BAR"))
    problems = []
    spilled = info.spill_stores + info.spill_loads
    if spilled:
        problems.append(
            f"ptxas spills: {info.spill_stores} bytes stored to and {info.spill_loads} loaded from local "
            f"memory ({info.registers} registers) — keep the per-lane state to a few floats"
        )
    if not wide:
        problems.append(
            f"no 128-bit global load (LDG.E.128) in the sm_90 SASS, only {narrow} narrower LDG: load x "
            "(and w) as float4 — reinterpret_cast<const float4*>(x + row * row_stride)[i]"
        )
    if not shuffles:
        problems.append(
            "no warp shuffle (SHFL) in the sm_90 SASS: reduce the lanes' partial sums with "
            "__shfl_xor_sync (offsets 16, 8, 4, 2, 1)"
        )
    if shared:
        said = ", ".join(f"{o} ×{n}" for o, n in sorted(shared.items()))
        problems.append(
            f"shared memory or a block barrier in the sm_90 SASS ({said}): one warp owns a row, so its "
            "lanes exchange their partial sums with shuffles — no __shared__ array, no __syncthreads()"
        )
    summary = (
        f"sm_90: {info.registers} registers, no spills; LDG.E.128 ×{wide}, "
        + ", ".join(f"{o} ×{n}" for o, n in sorted(shuffles.items()))
        + "; no shared memory, no barrier"
    )
    return problems, summary


def check_rms_norm_warp(source: Any, *, sass: bool = True, seed: int | None = None) -> Verdict:
    """Exercise 3: the CUDA kernel ``rms_norm_warp`` of ``source`` — right on every case, run thread by thread on
    the CPU (:func:`utils.simt.run_checked`), then (``sass=True``) its sm_90 build within the spec. ``seed``
    reproduces a run's inputs (printed with a NOT SOLVED verdict)."""
    name = RMS_WARP_NAME
    if not isinstance(source, str):
        return _verdict(name, [f"expected the CUDA source as a string, got {type(source).__name__}"], None, [])
    seed = _seed(seed)
    gen = torch.Generator().manual_seed(seed)
    for index, case in enumerate(CASES):
        problems, report = _run_case(source, case, gen)
        if problems:
            line = None if report.status == "compile_error" else _case_line(index, len(CASES), case)
            if report.status != "compile_error":
                problems.append(f"(random inputs; check_rms_norm_warp(..., seed={seed}) reproduces them)")
            return _verdict(name, problems, line, [])
    lines = [
        f"all {len(CASES)} cases match the float64 reference, run thread by thread on the CPU (guards intact, "
        "every element written, no deadlock)"
    ]
    if sass:
        from utils import nvcc

        if nvcc.find_nvcc() is None:
            lines.append("the sm_90 SASS was not read: no nvcc here (pip install nvidia-cuda-nvcc)")
        else:
            problems, summary = rms_norm_warp_sass(source)
            if problems:
                return _verdict(name, problems, "the values are right on every case; the sm_90 build is not", [])
            lines.append(summary)
    return _verdict(name, [], None, lines)
