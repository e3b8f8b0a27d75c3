"""Checks for C++ exercises (chapter 13): the learner's source compiled, run in a child process, then counted.

A C++ exercise's stub is a string of C++ holding one ``extern "C"`` function. Its check
(:func:`check_rms_norm_simd`, :func:`check_gemm_blocked`) prints one verdict block, like every check of
the course, and never raises for a wrong answer:

* **compiled** with g++ and the course's flags (:data:`utils.cpp.DEFAULT_FLAGS`: ``-O3 -march=x86-64-v3``):
  a compile error is NOT SOLVED with the compiler's first lines, numbered as the lines of the source string;
* **run in a child process** (:mod:`utils.exercises.cpp_child`, the standard library only) on awkward cases —
  sizes that are not multiples of 8 or of a tile, row strides and leading dimensions larger than a row, an
  empty matrix — so that a crash (a segfault) or a loop that never ends is a verdict, not a dead kernel;
* every buffer lies between **guard regions**: an output's guards, and the gaps between its rows, hold a
  canary bit pattern (a write there is reported: "3 elements past the end", "between rows"), an input's hold
  NaN (a read there spoils the result visibly); outputs start **poisoned** (a NaN with its own payload), so
  unwritten elements are told apart from wrong ones;
* compared with a **float64 reference**; the wrong or unwritten elements are described by rows and columns
  (and "the last cols % 8 columns of every row: the tail" where that is what they are), with the common
  mistakes recomputed and named when they match (the tail left out of a sum, a stride used for another);
* then **counted** under valgrind, which is deterministic: exercise 1's instructions per element
  (callgrind) and exercise 2's D1 read misses (cachegrind, with its simulated caches stated) against a
  bound that the solution keeps with room to spare and the naive loops break; the solution's and the naive
  loop's counts are printed beside the learner's, for scale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import exercises as _package
from .guards import _POISON_BITS
from .verdict import NOT_SOLVED_MARK, SOLVED_MARK, Verdict, _wrapped

__all__ = [
    "GEMM_BLOCKED_STUB",
    "GEMM_IKJ",
    "GEMM_NAIVE",
    "GEMM_D1_BOUND",
    "RMS_NORM_NAIVE",
    "RMS_NORM_SIMD_STUB",
    "RMS_NORM_IR_BOUND",
    "check_gemm_blocked",
    "check_rms_norm_simd",
    "gemm_d1_read_misses",
    "rms_norm_instructions_per_element",
]

RMS_NAME = "ch13_below_triton.RMS_NORM_SIMD"
#: A count is "fast at one size only" when it is within the bound at one size and over it at the other by more
#: than this factor; closer than that it is near the bound at both, and said so.
ONE_SIZE_RATIO = 1.25
GEMM_NAME = "ch13_below_triton.GEMM_BLOCKED"

#: The bit patterns: an output's unwritten elements (the Triton checks' float32 poison, a quiet NaN with a payload
#: no arithmetic makes), the canary of its guards and row gaps, and the NaN of an input's guards and gaps.
POISON_BITS = _POISON_BITS[torch.float32][1]
CANARY_BITS = 0x7F8CA11B
INPUT_GUARD_BITS = 0x7FC0BEEF
GUARD = 256  # elements of guard before and after every buffer

CHILD_TIMEOUT_S = 30

RMS_NORM_SIMD_STUB = r"""#include <cmath>
#include <cstdint>

extern "C" void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                              int64_t x_row_stride, int64_t y_row_stride, float eps) {
  // YOUR CODE HERE: y[r, c] = x[r, c] / sqrt(mean over c of x[r, c]^2 + eps) * w[c], vectorized.
}
"""

GEMM_BLOCKED_STUB = r"""#include <algorithm>
#include <cstdint>

extern "C" void gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K,
                     int64_t lda, int64_t ldb, int64_t ldc) {
  // YOUR CODE HERE: c[i * ldc + j] = sum over k of a[i * lda + k] * b[k * ldb + j], cache-blocked.
}
"""

#: The naive loop the instruction bound is set against: two scalar passes per row (GCC keeps the sum of squares
#: an in-order float reduction: 8 dependent adds per vector of squares).
RMS_NORM_NAIVE = r"""#include <cmath>
#include <cstdint>

extern "C" void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                              int64_t x_row_stride, int64_t y_row_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; ++c) sum += x[r * x_row_stride + c] * x[r * x_row_stride + c];
    const float rstd = 1.0f / std::sqrt(sum / cols + eps);
    for (int64_t c = 0; c < cols; ++c) y[r * y_row_stride + c] = x[r * x_row_stride + c] * rstd * w[c];
  }
}
"""

#: The naive ijk loop: a column of B per element of C.
GEMM_NAIVE = r"""#include <cstdint>

extern "C" void gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K,
                     int64_t lda, int64_t ldb, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += a[i * lda + k] * b[k * ldb + j];
      c[i * ldc + j] = sum;
    }
}
"""

#: The loop order ikj, unblocked: stride-1 and vectorized, but it streams all of B once per row of A.
GEMM_IKJ = r"""#include <cstdint>

extern "C" void gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K,
                     int64_t lda, int64_t ldb, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] += a[i * lda + k] * b[k * ldb + j];
  }
}
"""

RMS_SIGNATURE = ("const float*", "const float*", "float*", "int64_t", "int64_t", "int64_t", "int64_t", "float")
GEMM_SIGNATURE = ("const float*", "const float*", "float*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
                  "int64_t")

#: Exercise 1's performance case: 64 rows of 1003 columns (a tail of 3), row strides 1008 and 1003.
RMS_COUNT_CASE = (64, 1003, 1008, 1003)
#: Exercise 1 is counted at two sizes, the bound holding at each (a code fast at one size only is not): the
#: first, and 96 rows of 512 columns (a multiple of 8: no tail; row strides 512 and 520, the other way round). The
#: two differ in every property a path could be keyed on — rows, columns, their parity, a tail or none, which
#: buffer is padded.
RMS_COUNT_CASES = (RMS_COUNT_CASE, (96, 512, 512, 520))
#: Instructions per element the learner's function may execute (inclusive, counted by callgrind). The naive loop
#: executes about 3.3 with GCC 12 (its in-order sum of squares; 3.35 at 512 columns) and about 5 where a compiler
#: leaves it scalar; the solution about 1.5 (1.46 and 1.47), intrinsics with two accumulators about 1.3: 2.2
#: leaves the solution 40 % more room and fails the naive loop by half as much.
RMS_NORM_IR_BOUND = 2.2

#: Exercise 2's performance case: M = N = K = 144 (B is 81 KiB: it does not fit the simulated 32 KiB L1).
GEMM_COUNT_CASE = (144, 144, 144)
#: Exercise 2 is counted at two sizes, the bound holding at each: the first, and a wide and shallow one, M = 64,
#: N = 1000, K = 72 — different in M, N and K, K well under 128 — where a loop blocked over K alone (a KC × N panel
#: of B: 125 KiB at KC = 32) misses as often as an unblocked one (about 63), and one tuned for 144, or blocked only
#: when K is large, shows it.
GEMM_COUNT_CASES = (GEMM_COUNT_CASE, (64, 1000, 72))
#: D1 read misses of the learner's code per M·N·K/1000 (cachegrind, a 32 KiB 8-way L1 with 64-byte lines).
#: The unblocked ikj loop misses about 63 (every row of A streams B from beyond the L1: M·K·N/16 lines), and
#: so does the naive ijk loop at this size (its walk down a column of B reuses each line for the next 15
#: columns while the 144 lines stay in L1); a blocked loop with a B tile in half of the L1 about 3-8 (each tile
#: of B loaded once per band of rows). 20 leaves a blocked loop more than twice its room, and fails ikj by three
#: times.
GEMM_D1_BOUND = 20.0


# --------------------------------------------------------------------------------------------
# Buffers between guards
# --------------------------------------------------------------------------------------------


def _bits(value: int, count: int) -> np.ndarray:
    return np.full(count, value, dtype=np.uint32).view(np.float32)


@dataclasses.dataclass
class _Matrix:
    """A (rows × cols) float32 matrix with row stride ``stride``, laid out between guards in ``buffer``."""

    label: str
    rows: int
    cols: int
    stride: int
    output: bool
    buffer: np.ndarray = dataclasses.field(default=None)  # type: ignore[assignment]
    #: placed by the child so that its last element ends where a page ends, an untouchable page after it
    page_end: bool = False

    @property
    def length(self) -> int:
        return (self.rows - 1) * self.stride + self.cols if self.rows and self.cols else 0

    def index(self) -> np.ndarray:
        """Positions in ``buffer`` of the matrix's elements, (rows, cols)."""
        return GUARD + np.arange(self.rows)[:, None] * self.stride + np.arange(self.cols)[None, :]

    @staticmethod
    def make(label: str, values: np.ndarray | None, rows: int, cols: int, stride: int,
             page_end: bool = False) -> _Matrix:
        output = values is None
        matrix = _Matrix(label, rows, cols, stride, output, page_end=page_end)
        fill = CANARY_BITS if output else INPUT_GUARD_BITS
        buffer = _bits(fill, 2 * GUARD + matrix.length)
        if rows and cols:
            buffer[matrix.index()] = _bits(POISON_BITS, rows * cols).reshape(rows, cols) if output else values
        matrix.buffer = buffer
        return matrix

    def values(self) -> np.ndarray:
        return self.buffer[self.index()] if self.rows and self.cols else np.zeros((self.rows, self.cols), np.float32)

    def poison_ranges(self) -> list[list[int]]:
        """``[start, length]`` byte ranges of ``buffer`` that are no element of the matrix: the guards, and the
        padding between rows (from each row's end up to the next row's start)."""
        if not self.length:
            return [[0, 4 * len(self.buffer)]]
        ranges = [[0, 4 * GUARD]]
        if self.stride > self.cols:
            ranges += [[4 * (GUARD + r * self.stride + self.cols), 4 * (self.stride - self.cols)]
                       for r in range(self.rows - 1)]
        end = 4 * (GUARD + self.length)
        ranges.append([end, 4 * len(self.buffer) - end])
        return ranges

    def locate(self, start: int, size: int) -> tuple[int, str] | None:
        """An access of ``size`` bytes at byte ``start`` of ``buffer``: how many of its bytes are no element of the
        matrix, and where the first of them lies; None if every byte is one."""
        stray = [b for b in range(start, start + size)
                 if not (0 <= b // 4 - GUARD < self.length and (b // 4 - GUARD) % self.stride < self.cols)]
        if not stray:
            return None
        first = stray[0] // 4 - GUARD
        if not self.length:
            return len(stray), (f"of {self.label}, which has no elements here ({self.rows} rows × {self.cols} "
                                "columns): an access before any row exists")
        if first < 0:
            return len(stray), f"before the start of {self.label} (in the guard before its first element)"
        if first >= self.length:
            if self.rows == 1:
                return len(stray), f"past the end of {self.label} (past the end of the buffer)"
            return len(stray), (f"past the end of row {self.rows - 1} of {self.label} (past the end of the buffer: "
                                "its last row)")
        row = first // self.stride
        return len(stray), (f"past the end of row {row} of {self.label} (in the padding between rows: columns "
                            f"{self.cols}–{self.stride - 1} of the row stride {self.stride})")

    def damage(self) -> list[str]:
        """What the call wrote where it should not: the guards before and after, the gaps between rows."""
        bits = self.buffer.view(np.uint32)
        problems = []
        before = np.nonzero(bits[:GUARD] != CANARY_BITS)[0]
        if before.size:
            problems.append(f"wrote {before.size} element(s) before the start of {self.label} (the farthest "
                            f"{GUARD - int(before.min())} before it): an index that goes negative")
        end = GUARD + self.length
        after = np.nonzero(bits[end:] != CANARY_BITS)[0]
        if after.size:
            problems.append(f"wrote {after.size} element(s) past the end of {self.label} (the first "
                            f"{int(after.min()) + 1} past its last element, the farthest {int(after.max()) + 1}): "
                            "a loop or a bulk write (memset, std::fill) that runs past the last row or column — "
                            "the tail, a full vector store where fewer than 8 elements are left, or a length of rows "
                            "× row stride")
        if self.length and self.stride > self.cols:
            region = np.arange(GUARD, end)
            gap = ((region - GUARD) % self.stride) >= self.cols
            written = region[gap][bits[region[gap]] != CANARY_BITS]
            if written.size:
                rows = sorted({int((p - GUARD) // self.stride) for p in written})
                problems.append(f"wrote {written.size} element(s) between the rows of {self.label} (after column "
                                f"{self.cols - 1} of row(s) {_spans(rows)}, in the padding up to the row stride "
                                f"{self.stride}): a row is {self.cols} long, it starts at r * stride")
        return problems


def _spans(indices: Sequence[int], limit: int = 4) -> str:
    """``[0, 1, 2, 5]`` → ``"0–2, 5"``."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(f"{a}–{b}" if a != b else f"{a}" for a, b in spans[:limit])
    return text + (", ..." if len(spans) > limit else "")


def _where(mask: np.ndarray, what: str, rows_word: str = "row", cols_word: str = "column") -> str:
    """Where the True elements of a (rows, cols) mask are: which rows, which columns, and a tail named as one."""
    rows = np.nonzero(mask.any(axis=1))[0].tolist()
    cols = np.nonzero(mask.any(axis=0))[0].tolist()
    total_rows, total_cols = mask.shape
    text = f"{int(mask.sum())} of {mask.size} elements {what}: {rows_word}s {_spans(rows)}, {cols_word}s {_spans(cols)}"
    if cols and len(rows) == total_rows and cols == list(range(cols[0], total_cols)) and cols[0] > 0:
        width, done = total_cols - cols[0], cols[0]
        block = max(v for v in (1, 2, 4, 8, 16, 32, 64) if done % v == 0)
        text += f" — the last {width} {cols_word}s of every {rows_word}"
        if block > 1:
            # Which loop stopped there (a vector loop's tail, a skipped partial tile) is not seen from the values:
            # only that the first `done` are a whole number of blocks and the rest is the edge.
            text += (f", after the first {done} ({done // block} × {block}): the edge past the last whole block — a "
                     "partial tile skipped, or a vector loop's tail left out")
    elif rows and len(cols) == total_cols and rows == list(range(rows[0], total_rows)) and rows[0] > 0:
        text += f" — every {rows_word} from {rows[0]} on"
    first = np.argwhere(mask)[0]
    return text + f" (the first at ({int(first[0])}, {int(first[1])}))"


# --------------------------------------------------------------------------------------------
# Compiling and running in a child process
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """What the child did: ``done`` cases finished; ``error`` the reason it stopped early (None if it did not);
    ``stray``: per case, its accesses outside the matrices' elements that AddressSanitizer reported, in words."""

    done: int
    error: str | None = None
    stray: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    def problems(self, case: int, limit: int = 2) -> list[str]:
        """The case's stray accesses (the first ``limit``, and how many more)."""
        found = self.stray.get(case, [])
        more = [f"and {len(found) - limit} more access(es) outside the rows (AddressSanitizer)"] if len(found) > limit \
            else []
        return found[:limit] + more


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


#: The exit status AddressSanitizer would give the child where it stops at a report (it goes on: told apart).
ASAN_EXIT = 86
_ASAN_OPTIONS = (f"detect_leaks=0:halt_on_error=0:exitcode={ASAN_EXIT}:handle_segv=0:handle_sigbus=0:"
                 "handle_sigfpe=0:handle_sigill=0:handle_abort=0")
_ASAN_REPORT = re.compile(r"ERROR: AddressSanitizer: ([\w-]+) on address 0x[0-9a-f]+.*?\n(READ|WRITE) of size (\d+) "
                          r"at 0x([0-9a-f]+)", re.S)


def _asan_reports(stderr: str) -> dict[int, list[tuple[str, str, int, int]]]:
    """AddressSanitizer's reports in the child's stderr, by case: ``(kind, "READ"|"WRITE", size, address)``."""
    found: dict[int, list[tuple[str, str, int, int]]] = {}
    parts = re.split(r"^CASE (\d+)$", stderr, flags=re.M)
    for case, text in zip(parts[1::2], parts[2::2]):
        found[int(case)] = [(m.group(1), m.group(2), int(m.group(3)), int(m.group(4), 16))
                            for m in _ASAN_REPORT.finditer(text)]
    return found


def _asan_problem(report: tuple[str, str, int, int], bases: dict[int, int], matrices: list[_Matrix]) -> str:
    """One AddressSanitizer report in the exercise's words: which buffer, which row, how many bytes past its end."""
    kind, access, size, address = report
    verb = "read" if access == "READ" else "wrote"
    for number, matrix in enumerate(matrices):
        base = bases.get(number)
        if base is None or not base <= address < base + 4 * len(matrix.buffer):
            continue
        found = matrix.locate(address - base, size)
        if found is None:
            continue
        count, where = found
        text = f"{verb} {count} byte(s) {where}: one access of {size} bytes (AddressSanitizer, {kind})"
        if "before any row exists" in where:
            text += (" — with no rows there is nothing to read or write: an access before the row loop (a first "
                     "element read ahead of it, say) runs even then; keep every access inside the loop over rows")
        elif size > 32:
            text += (f" — {size} bytes at once is no vector but a bulk write or copy (memset, memcpy, std::fill of "
                     "the whole buffer) with the wrong length: rows × row stride reaches past the last row's end (the "
                     "last row is cols long), and it writes the padding between rows, which is not the output's. "
                     "Clear or copy row by row, cols elements each")
        elif size >= 16 and where.startswith("past"):
            text += (" — a full vector where fewer elements are left. Masking the lanes afterwards (and, blend) does "
                     "not undo the access: the bytes past a row may be another tensor's, another thread's row being "
                     "written at that moment, or an unmapped page after the last row (a crash in real use). "
                     "_mm256_maskload_ps / _mm256_maskstore_ps touch only the lanes of their mask; or finish the row "
                     "with a scalar loop")
        elif where.startswith("past"):
            text += (" — an index past the row's end: a loop bound (<= for <), a tile's end not clamped to the size, "
                     "or a row stride mixed up with another")
        else:
            text += " — an index that goes negative"
        return text
    return (f"AddressSanitizer: {kind}, a {access.lower()} of {size} bytes outside the buffers the check passed (a "
            "local array indexed past its end?)")


def _run_child(library: Path, function: str, cases: list[tuple[list[_Matrix], list[tuple[str, Any]]]],
               argtypes: list[str], asan: str | None = None) -> _Run:
    """Run ``function`` of ``library`` on each case (its matrices, then its arguments: ``("buffer", i)`` or
    ``("i64"|"f32", value)``) in a child process; read back the matrices' buffers. ``asan``: the AddressSanitizer
    runtime to preload, for a library built with :data:`utils.cpp.ASAN_FLAGS` — every byte of a buffer that is no
    element of its matrix is then poisoned, and the first access to one ends the run with its place named."""
    with tempfile.TemporaryDirectory(prefix="cpp-check-") as work:
        spec_cases = []
        for n, (matrices, args) in enumerate(cases):
            buffers = []
            for m, matrix in enumerate(matrices):
                path = Path(work, f"case{n}-{m}.bin")
                path.write_bytes(matrix.buffer.tobytes())
                buffers.append({"file": str(path), "offset": GUARD, "poison": matrix.poison_ranges()})
                if matrix.page_end and matrix.length:
                    buffers[-1]["page_end"] = 4 * (GUARD + matrix.length)  # the bytes up to its last element
            spec_cases.append({"buffers": buffers, "args": [{"buffer": v} if k == "buffer" else {"value": v}
                                                            for k, v in args]})
        spec = {"library": str(library), "function": function, "argtypes": argtypes, "cases": spec_cases,
                "asan": asan is not None}
        Path(work, "spec.json").write_text(json.dumps(spec))
        child = Path(__file__).with_name("cpp_child.py")
        env = dict(os.environ)
        if asan is not None:
            env["LD_PRELOAD"] = ":".join(p for p in (asan, env.get("LD_PRELOAD", "")) if p)
            env["ASAN_OPTIONS"] = _ASAN_OPTIONS
        stderr = ""
        try:
            result = subprocess.run([sys.executable, str(child), str(Path(work, "spec.json"))], capture_output=True,
                                    text=True, timeout=CHILD_TIMEOUT_S, env=env)
            code, stdout, stderr = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as expired:
            code = None
            stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        done = sum(1 for line in stdout.splitlines() if line.startswith("DONE "))
        for n in range(done):
            for m, matrix in enumerate(cases[n][0]):
                data = Path(work, f"case{n}-{m}.bin.out").read_bytes()
                matrix.buffer = np.frombuffer(data, dtype=np.float32).copy()
        if "MISSING " in stdout:
            return _Run(0, f"the compiled source has no function `{function}`: declare it exactly as the stub does, "
                           f"`extern \"C\" void {function}(...)` (without extern \"C\", C++ renames it)")
        stray: dict[int, list[str]] = {}
        if asan is not None:
            bases: dict[int, dict[int, int]] = {}
            for c, m, a in re.findall(r"^BUFFER (\d+) (\d+) (\d+)$", stdout, re.M):
                bases.setdefault(int(c), {})[int(m)] = int(a)
            for case, reports in _asan_reports(stderr).items():
                if case < len(cases) and reports:
                    said = [_asan_problem(r, bases.get(case, {}), cases[case][0]) for r in reports]
                    stray[case] = list(dict.fromkeys(said))
        run = _result(code, done, stderr, _fault_place(stdout, cases[done][0] if done < len(cases) else []))
        run.stray = stray
        return run


def _fault_place(stdout: str, matrices: list[_Matrix]) -> str | None:
    """Where the child's fault was (its ``FAULT`` line), when it is the page after a buffer placed at a page's end:
    past the last row of that buffer."""
    faults = re.findall(r"^FAULT (\d+)$", stdout, re.M)
    if not faults:
        return None
    address = int(faults[0])
    bases = {int(m): int(a) for c, m, a in re.findall(r"^BUFFER (\d+) (\d+) (\d+)$", stdout, re.M)
             if int(c) == len(re.findall(r"^DONE ", stdout, re.M))}
    for number, matrix in enumerate(matrices):
        base = bases.get(number)
        if base is None or not matrix.page_end or not matrix.length:
            continue
        end = base + 4 * (GUARD + matrix.length)
        if end <= address < end + mmap.PAGESIZE:
            row = "the last row" if matrix.rows > 1 else "the row"
            return (f"read or wrote past the end of {row} of {matrix.label} (a vector access past the row's end, "
                    f"masked lanes included): in this case each buffer ends where a page of memory ends, and the "
                    "next page may not be touched, as an unmapped page after a real tensor may not. A masked load "
                    "or store whose mask enables the lanes past the end, or a gather of them, reads those bytes as "
                    "a plain load does, whatever is done with them after (and, blend). Give "
                    "_mm256_maskload_ps / _mm256_maskstore_ps a mask of the live lanes only, or finish the row with a "
                    "scalar loop")
    return None


def _result(code: int | None, done: int, stderr: str, fault: str | None = None) -> _Run:
    """What the child's exit says (``fault``: where its fault was, in words, if it is known)."""
    if code is None:
        return _Run(done, f"did not finish within {CHILD_TIMEOUT_S} s: a loop that never ends (a counter that "
                          "does not advance, or a bound compared the wrong way)?")
    if code < 0 and fault:
        return _Run(done, f"crashed ({_signal_name(code)}): {fault}")
    if code < 0:
        return _Run(done, f"crashed ({_signal_name(code)}): an access far outside the buffers (an index or "
                          "stride mixed up, a loop bound past the end), or an aligned load/store "
                          "(_mm256_load_ps) of an address that is not 32-byte aligned — rows start anywhere")
    if code != 0:
        return _Run(done, f"the child process exited with status {code}: {stderr.strip()[-300:]}")
    return _Run(done)


#: What starts threads (or asks about them) in a source: OpenMP's constructs other than ``simd``, its runtime's
#: functions and header, and the C++/POSIX thread APIs.
_THREAD_PATTERNS = (
    (re.compile(r"#\s*pragma\s+omp\s+(?:parallel|for\b|task|sections|single|critical|atomic|barrier|master|masked|"
                r"teams|target|distribute|ordered|flush)[^\n]*"), "an OpenMP `{}`"),
    (re.compile(r"\bomp_\w+\s*\("), "a call to the OpenMP runtime, `{}`"),
    (re.compile(r"#\s*include\s*<omp\.h>"), "OpenMP's runtime header, `{}`"),
    (re.compile(r"\bstd::(?:j?thread|async)\b|\bpthread_create\b"), "a thread started with `{}`"),
)


def _without_comments(source: str) -> str:
    """``source`` with its comments blanked (line numbers kept)."""
    source = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), source, flags=re.S)
    return re.sub(r"//[^\n]*", "", source)


def _threads_used(source: str, rung: str) -> str | None:
    """Why a source that starts threads is refused (None if it starts none): ``rung`` names the chapter's threaded
    rung, where threads come in."""
    from utils import cpp

    code = _without_comments(source)
    uses = [(what.startswith("OpenMP's runtime header"), found.start(), found, what)
            for pattern, what in _THREAD_PATTERNS for found in pattern.finditer(code)]
    if uses:
        _, _, found, what = min(uses, key=lambda use: use[:2])  # the first use; the header only if nothing else
        line, used = code.count("\n", 0, found.start()) + 1, what.format(found.group(0).strip())
    else:
        # a pragma the text does not show: _Pragma("omp ..."), or `#pragma omp` spelled through a macro — what the
        # compiler sees, preprocessed, at the line where it is used
        pragmas = [(n, text) for n, text in cpp.omp_pragmas(source)
                   if not re.match(r"#\s*pragma\s+omp\s+(?:simd|declare\s+simd)\b", text)]
        if not pragmas:
            return None
        line, text = pragmas[0]
        used = f"an OpenMP `{text}`, once preprocessed"
    return (f"line {line} uses threads ({used}): this exercise is one core's "
            "vectors and caches, and its check runs one thread — it builds with -fopenmp-simd, which honours "
            "`#pragma omp simd` and nothing else of OpenMP (a `parallel` pragma would be silently ignored, a race in "
            "it never seen, and an omp_ function would have no runtime to come from). "
            f"Threads are the next rung ({rung}, after this exercise): take them out here")


def _compile(source: Any, rung: str) -> tuple[Path | None, list[str] | None]:
    """The compiled library's path (not loaded here: its code runs in the child only; built with AddressSanitizer
    where this compiler has it), or the verdict lines of a refused source or a compile error."""
    from utils import cpp

    if not isinstance(source, str):
        return None, [f"expected the C++ source as a string, got {type(source).__name__}"]
    threads = _threads_used(source, rung)
    if threads:
        return None, [threads]
    try:
        cpp.build_shared(source)  # the course's flags, as counted: its errors are the ones the learner should see
        return (cpp.build_shared(source, flags=(*cpp.DEFAULT_FLAGS, *cpp.ASAN_FLAGS)) if cpp.asan_runtime()
                else cpp.build_shared(source)), None
    except cpp.CompileError as error:
        where = f" (line(s) {', '.join(map(str, error.error_lines))} of the source string)" if error.error_lines else ""
        return None, [f"does not compile{where}: g++ says", *("    " + line for line in error.lines[:8])]


def _verdict(name: str, problems: list[str], case_line: str | None, solved_lines: list[str]) -> Verdict:
    if problems:
        lines = [f"{NOT_SOLVED_MARK} — {name}"]
        if case_line:
            lines.append("   " + case_line)
        lines += [f"   • {p}" for p in problems]
        verdict = Verdict(name=name, solved=False, message="\n".join(_wrapped(lines)))
    else:
        lines = [f"{SOLVED_MARK} — {name}: {solved_lines[0]}", *("   " + line for line in solved_lines[1:])]
        verdict = Verdict(name=name, solved=True, message="\n".join(_wrapped(lines)))
    _package._LAST_VERDICTS[name] = verdict.solved
    print(verdict.message)
    return verdict


# --------------------------------------------------------------------------------------------
# Counting under valgrind (cached: deterministic for a given binary)
# --------------------------------------------------------------------------------------------


def _cached_count(kind: str, source: str, compute: Callable[[], float]) -> float:
    from utils import cpp, valgrind

    key = hashlib.sha256("\0".join((kind, source, " ".join(cpp.DEFAULT_FLAGS), cpp.compiler_version(),
                                    valgrind.version(), valgrind.RUN_METHOD)).encode()).hexdigest()[:24]
    path = cpp.cache_dir() / f"count-{key}.json"
    if path.exists():
        try:
            return float(json.loads(path.read_text())["value"])
        except (ValueError, KeyError):
            pass
    value = compute()
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"kind": kind, "value": value}))
    os.replace(partial, path)
    return value


def _rms_harness(source: str, case: tuple[int, int, int, int]) -> Path:
    from utils import cpp

    rows, cols, x_stride, y_stride = case
    return cpp.harness(source, "rms_norm_rows", [
        cpp.buffer("const float*", (rows - 1) * x_stride + cols), cpp.buffer("const float*", cols),
        cpp.buffer("float*", (rows - 1) * y_stride + cols, "zeros"), cpp.scalar("int64_t", rows),
        cpp.scalar("int64_t", cols), cpp.scalar("int64_t", x_stride), cpp.scalar("int64_t", y_stride),
        cpp.scalar("float", 1e-6)])


def rms_norm_instructions_per_element(source: str, case: tuple[int, int, int, int] = RMS_COUNT_CASE) -> float:
    """Instructions per element ``rms_norm_rows`` of ``source`` executes on ``case`` (``(rows, cols, x_row_stride,
    y_row_stride)``, by default :data:`RMS_COUNT_CASE`; callgrind, inclusive of what it calls)."""
    from utils import valgrind

    rows, cols, _, _ = case

    def compute() -> float:
        return valgrind.callgrind(_rms_harness(source, case)).of("rms_norm_rows") / (rows * cols)

    return _cached_count(f"rms-ir-{case}", source, compute)


def _gemm_harness(source: str, case: tuple[int, int, int]) -> Path:
    from utils import cpp

    m, n, k = case
    return cpp.harness(source, "gemm", [
        cpp.buffer("const float*", m * k), cpp.buffer("const float*", k * n), cpp.buffer("float*", m * n, "zeros"),
        *(cpp.scalar("int64_t", v) for v in (m, n, k, k, n, n))])


def gemm_d1_read_misses(source: str, case: tuple[int, int, int] = GEMM_COUNT_CASE) -> float:
    """D1 read misses per M·N·K/1000 while ``gemm`` of ``source`` runs (what it calls included) on ``case``
    (``(M, N, K)``, dense: lda = K, ldb = ldc = N; by default :data:`GEMM_COUNT_CASE`), by callgrind's cache
    simulator on :data:`utils.valgrind.DEFAULT_CACHE` (:func:`utils.valgrind.inside`)."""
    from utils import valgrind

    m, n, k = case

    def compute() -> float:
        # everything gemm runs, its calls and inlined intrinsics included: a count by source file would miss an
        # intrinsic's loads (their debug lines are in the compiler's headers) and code in an #included file
        return valgrind.inside(_gemm_harness(source, case), "gemm")["D1mr"] / (m * n * k / 1000)

    return _cached_count(f"gemm-d1-inside-{case}", source, compute)


def _scale(count: Callable[[str], float], naive: str, exercise: str) -> tuple[float | None, float | None]:
    """The solution's and the naive loop's counts, for scale (None where they cannot be had)."""
    from .marker import MissingSolutionError, solution

    try:
        reference = solution(exercise)
        solved = count(reference) if isinstance(reference, str) else None
    except MissingSolutionError:
        solved = None
    return solved, count(naive)


def _line_text(source: str, number: int, width: int = 72) -> str:
    lines = source.splitlines()
    if not 1 <= number <= len(lines):
        return "(no line of the source: code the compiler added)"
    text = " ".join(lines[number - 1].split())
    return f"`{text[:width - 3]}...`" if len(text) > width else f"`{text}`"


def _hot_lines(source: str, profile: dict[int, dict[str, int]], event: str, per: float, unit: str,
               limit: int = 3) -> tuple[list[int], str]:
    """The lines of ``source`` that count the most ``event`` (up to ``limit``, each at least a tenth of the total), and
    them in words: ``per`` divides a count into ``unit``."""
    total = sum(v.get(event, 0) for v in profile.values()) or 1
    ranked = sorted(((n, v.get(event, 0)) for n, v in profile.items()), key=lambda item: -item[1])
    chosen = [(n, c) for n, c in ranked[:limit] if c >= total / 10]
    text = "; ".join(f"line {n} {_line_text(source, n)}: {c / per:.2f} {unit} ({c / total:.0%})" for n, c in chosen)
    return [n for n, _ in chosen], text


#: GCC's reasons on an outer loop (it vectorizes innermost loops): no news about the loop that does the work.
_OUTER_LOOP_REASONS = ("couldn't vectorize loop", "multiple nested loops", "two or more consecutive inner loops",
                       "control flow in loop")


def _rms_slow_hint(source: str, hot: list[int]) -> str:
    """What the hot lines of a too-slow ``rms_norm_rows`` are doing, from what can be seen: GCC's vectorizer report
    on their loops, and whether a float sum there has the permission to be reordered."""
    from utils import cpp

    try:
        notes = {note.line: note for note in cpp.vectorization_report(source)}
    except cpp.CompileError:
        notes = {}
    for number in hot:
        for line in (number, number - 1, number - 2):  # GCC names the loop's line, or the pragma's above it
            note = notes.get(line)
            if note and not note.loop_vectorized and not any(r in note.why for r in _OUTER_LOOP_REASONS):
                return (f"GCC did not vectorize the loop on line {line}: \"{note.why}\" "
                        "(utils.cpp.vectorization_report(source) shows what it said of every loop)")
    code = _without_comments(source).splitlines()
    for number in hot:
        text = code[number - 1] if 1 <= number <= len(code) else ""
        loop = _loop_variable(source, number)
        above = code[loop[0] - 2] if loop and loop[0] >= 2 else ""  # the pragma on the loop, if any
        if re.search(r"\w\s*\+=", _after_for_header(text)) and "reduction" not in above and "_mm" not in text:
            return (f"line {number} adds into one running float sum, and nothing gives the compiler permission to "
                    "reorder it: C++ evaluates a float sum in order, so GCC keeps it one add after another (a "
                    "fold-left: 8 dependent adds per vector of squares, even where its report says 'vectorized'). "
                    "`#pragma omp simd reduction(+ : sum)` on the loop is the permission (8 partial sums, added "
                    "once per row); or AVX2 intrinsics, _mm256_fmadd_ps into 8-lane accumulators")
    masking = [n for n in hot if 1 <= n <= len(code) and re.search(r"_mm256_(?:mask(?:load|store)|blendv?|cmp)\w*",
                                                                     code[n - 1])]
    if masking:
        return (f"line {masking[0]} builds or applies a mask: look at what those lines do for every vector that a row "
                "needs only once, or only at its end — a mask built and a blend or masked load/store in every "
                "iteration is the tail's work paid on all of a row's vectors. Whole vectors in the main loop, the "
                "tail once after it")
    return ("those lines are where the instructions go; compare them with what the bound allows for — two passes "
            "over a row (the sum of squares, then the output), whole vectors in each, the tail once after them: an "
            "extra pass over the row, or more work per vector than a load and a multiply-add, shows on those lines")


def _after_for_header(text: str) -> str:
    """A line of code without its ``for (...)`` header, if it has one (its ``c += 8`` is no sum)."""
    found = re.search(r"\bfor\s*\(", text)
    if not found:
        return text
    depth = 0
    for position in range(found.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[position], 0)
        if depth == 0:
            return text[:found.start()] + text[position + 1:]
    return ""


def _loop_variable(source: str, number: int) -> tuple[int, str] | None:
    """The innermost ``for`` loop at or above line ``number``: its line and its variable."""
    lines = _without_comments(source).splitlines()
    for line in range(min(number, len(lines)), 0, -1):
        found = re.search(r"\bfor\s*\(\s*(?:const\s+)?(?:[\w:]+\s+)+(\w+)\s*=", lines[line - 1])
        if found:
            return line, found.group(1)
    return None


def _gemm_misses_hint(source: str, hot: list[int], case: tuple[int, int, int]) -> str:
    """What the hot lines of a ``gemm`` with too many misses do, read from the source: whether the innermost loop
    over them walks memory with stride 1 (then it is the working set of B), or steps whole rows."""
    m, n, k = case
    lines = _without_comments(source).splitlines()
    stride_one = ("tiled or not, the innermost loop must walk memory with stride 1 — j, along a row of B and of C: "
                  "c[i * ldc + j] += a_ik * b[k * ldb + j]; with i or k innermost every access is a new cache line, "
                  "each used for one float of its 16")
    read = False
    for number in hot:
        loop = _loop_variable(source, number)
        text = lines[number - 1] if 1 <= number <= len(lines) else ""
        indexed = re.findall(r"(\w+)\s*\[([^\[\]]+)\]", text)
        if loop is None or not indexed:
            continue
        read = True
        line, variable = loop
        strided = [f"{name}[{index.strip()}]" for name, index in indexed
                   if re.search(rf"\b{variable}\s*\*|\*\s*{variable}\b", index)]
        if strided:
            place = f"on line {line}" if line == number else f"over line {number} (line {line})"
            return (f"the innermost loop {place}, over {variable}, steps {', '.join(dict.fromkeys(strided))} by a "
                    f"whole row each iteration: {stride_one}")
    return (f"B ({k} × {n} floats, {k * n * 4 // 1024} KiB) does not fit the L1, and what is reused between rows "
            "of A must: loop over tiles so that a KC × NC tile of B (at most half the L1: 16 KiB, e.g. 64 × 64) "
            "serves many rows of A before the next one is loaded — a tile over K alone is a KC × N panel, which "
            "grows with N" + ("" if read else f". And {stride_one}"))


# --------------------------------------------------------------------------------------------
# Exercise 1: RMSNorm rows, vectorized
# --------------------------------------------------------------------------------------------


#: Exercise 1's last case: x, w and y each end where a page ends, an untouchable page after each (no padding: row
#: stride = cols, a tail of 3) — a tail overrun happens on every row, so the last row shows it, whatever the
#: instruction.
RMS_PAGE_END_CASE = (4, 203, 203, 203, 1e-6, 1.0)


def _rms_cases(gen: np.random.Generator) -> list[tuple[int, int, int, int, float, float]]:
    """``(rows, cols, x_row_stride, y_row_stride, eps, scale)``: a multiple of 16, a tail of 3, fewer columns than
    a vector, padded rows (different strides for x and y), one element, a long row, no rows, small values where
    eps matters, and :data:`RMS_PAGE_END_CASE`."""
    return [(4, 64, 64, 64, 1e-6, 1.0), (3, 1003, 1003, 1003, 1e-6, 1.0), (5, 7, 7, 7, 1e-6, 1.0),
            (6, 100, 133, 120, 1e-6, 1.0), (1, 1, 1, 1, 1e-6, 1.0), (2, 2053, 2060, 2053, 1e-6, 1.0),
            (0, 8, 8, 8, 1e-6, 1.0), (3, 37, 37, 40, 1e-2, 0.05), RMS_PAGE_END_CASE]


def _rms_reference(x: np.ndarray, w: np.ndarray, eps: float, upto: int | None = None) -> np.ndarray:
    x64 = x.astype(np.float64)
    cols = x.shape[1]
    squares = (x64[:, :upto] ** 2).sum(axis=1, keepdims=True)
    return x64 / np.sqrt(squares / max(cols, 1) + eps) * w.astype(np.float64)


def _rms_causes(x: np.ndarray, w: np.ndarray, eps: float, got: np.ndarray, case: tuple) -> list[str]:
    """The common mistakes, recomputed in float64: the ones whose result is what the function wrote."""
    rows, cols, x_stride, y_stride = case[:4]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    mean = (x64**2).mean(axis=1, keepdims=True)
    candidates = {
        "the sum of squares leaves out the tail (the last cols % 8 columns): add them after the vector loop":
            [_rms_reference(x, w, eps, cols - cols % v) for v in (8, 16, 32) if cols % v],
        "the output is not multiplied by w": [x64 / np.sqrt(mean + eps)],
        "eps is added after the square root (it belongs inside: 1 / sqrt(mean + eps))": [x64 / (np.sqrt(mean) + eps)
                                                                                         * w64],
        "the sum of squares is not divided by cols (the mean)": [x64 / np.sqrt((x64**2).sum(1, keepdims=True) + eps)
                                                                 * w64],
        "multiplies by the root mean square instead of dividing by it": [x64 * np.sqrt(mean + eps) * w64],
    }
    found = []
    written = got.view(np.uint32) != POISON_BITS  # what it wrote is compared; unwritten elements are said apart
    for cause, values in candidates.items():
        if any(v.shape == got.shape and np.allclose(got[written], v[written], rtol=1e-4, atol=1e-5) for v in values):
            found.append(cause)
    if not found and rows > 1 and (x_stride != cols or y_stride != cols):
        first = np.allclose(got[:1][written[:1]], _rms_reference(x, w, eps)[:1][written[:1]], rtol=1e-4, atol=1e-5)
        if first:
            found.append(f"row 0 is right, later rows are wrong, and this case's rows are padded (x_row_stride "
                         f"{x_stride}, y_row_stride {y_stride}, cols {cols}): row r of x starts at "
                         "x + r * x_row_stride, of y at y + r * y_row_stride")
    return found


def check_rms_norm_simd(source: Any, *, count: bool = True) -> Verdict:
    """Exercise 1: ``rms_norm_rows`` of the C++ ``source`` — right on every case, then within
    :data:`RMS_NORM_IR_BOUND` instructions per element (callgrind). ``count=False`` checks the values only."""
    from utils import cpp

    name = RMS_NAME
    library, compile_problems = _compile(source, "rms_norm_threads")
    if compile_problems:
        return _verdict(name, compile_problems, None, [])
    gen = np.random.default_rng()
    cases, prepared = [], []
    for case in _rms_cases(gen):
        rows, cols, x_stride, y_stride, eps, scale = case
        x = (gen.standard_normal((rows, cols)) * scale).astype(np.float32)
        w = (gen.standard_normal((1, cols)) * 0.5 + 1.0).astype(np.float32)
        at_end = case == RMS_PAGE_END_CASE
        matrices = [_Matrix.make("x", x, rows, cols, x_stride, at_end), _Matrix.make("w", w, 1, cols, cols, at_end),
                    _Matrix.make("y", None, rows, cols, y_stride, at_end)]
        args = [("buffer", 0), ("buffer", 1), ("buffer", 2), ("i64", rows), ("i64", cols), ("i64", x_stride),
                ("i64", y_stride), ("f32", eps)]
        inputs = [m.buffer.copy() for m in matrices[:2]]
        cases.append((matrices, args))
        prepared.append((case, x, w[0], inputs))
    run = _run_child(library, "rms_norm_rows", cases, ["ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "f32"],
                     cpp.asan_runtime())
    for n, (case, x, w, inputs) in enumerate(prepared):
        rows, cols, x_stride, y_stride, eps, _ = case
        line = (f"case {n + 1} of {len(prepared)}: rows={rows}, cols={cols}, x_row_stride={x_stride}, "
                f"y_row_stride={y_stride}, eps={eps:g}")
        if n >= run.done:
            return _verdict(name, [run.error or "the child process stopped", *run.problems(n)], line, [])
        matrices = cases[n][0]
        problems = []
        for matrix, before in zip(matrices[:2], inputs):
            if not np.array_equal(matrix.buffer.view(np.uint32), before.view(np.uint32)):
                problems.append(f"changed the input {matrix.label} (it is const: write only y)")
        y = matrices[2]
        problems += y.damage()
        got = y.values()
        unwritten = got.view(np.uint32) == POISON_BITS
        if unwritten.any():
            problems.append(_where(unwritten, "never written (still the poison NaN)")
                            + ("" if unwritten.sum() < unwritten.size else " — the stub, or a loop that never runs"))
        expected = _rms_reference(x, w, eps)
        wrong = ~unwritten & ~(np.abs(got.astype(np.float64) - expected) <= 1e-5 + 1e-5 * np.abs(expected))
        if wrong.any():
            if np.isnan(got[wrong]).any():
                problems.append("NaN computed where the inputs have none: a read outside x's rows (its padding and "
                                "guards hold NaN) — the row stride, or a vector load past the row's end")
            first = tuple(int(i) for i in np.argwhere(wrong)[0])
            problems.append(_where(wrong, "wrong") + f": got {float(got[first]):.6g}, expected "
                            f"{float(expected[first]):.6g}")
            problems = [f"cause: {c}" for c in _rms_causes(x, w, eps, got, case)] + problems
        problems += run.problems(n)
        if problems:
            return _verdict(name, problems, line, [])
    lines = [f"all {len(prepared)} cases match the float64 reference (guards intact, every element written)"]
    if count:
        from utils import valgrind

        if not valgrind.available():
            lines.append("the instruction bound was not checked: valgrind is not installed (apt install valgrind)")
        else:
            counted = []
            for case in RMS_COUNT_CASES:
                def count(text: str, case: tuple[int, int, int, int] = case) -> float:
                    return rms_norm_instructions_per_element(text, case)

                counted.append((case, count(source), *_scale(count, RMS_NORM_NAIVE, name)))
            sizes = "; ".join(
                f"{rows} rows × {cols} columns (row strides {xs}/{ys}): {per:.2f}"
                + (f" (the solution {solved:.2f}, " if solved is not None else " (")
                + f"the naive scalar loop {naive:.2f})"
                for (rows, cols, xs, ys), per, solved, naive in counted)
            where = f"instructions per element of rms_norm_rows and what it calls, counted by callgrind: {sizes}"
            over = [(case, per) for case, per, _, _ in counted if per > RMS_NORM_IR_BOUND]
            if over and not cpp.X86_64_V3:
                lines.append(f"{where}. The bound ({RMS_NORM_IR_BOUND}) is set for x86-64-v3 (8-wide AVX2): this CPU "
                             "builds for another target, so the counts are shown, not judged")
            elif over:
                from utils import valgrind as vg

                (rows, cols, xs, ys), per = over[0]
                profile = vg.line_profile(_rms_harness(source, (rows, cols, xs, ys)), cpp.HARNESS_SOURCE)
                hot, hot_text = _hot_lines(source, profile, "Ir", rows * cols, "per element")
                within = [(case, p) for case, p, _, _ in counted if p <= RMS_NORM_IR_BOUND]
                # "fast at one size only" where the sizes really differ, not a count near the bound at both
                one_size = (f" — within it at {within[0][0][0]} × {within[0][0][1]}: a path fast at one size only"
                            if within and per > ONE_SIZE_RATIO * within[0][1] else
                            f" (and {within[0][1]:.2f} at {within[0][0][0]} × {within[0][0][1]}, near it)" if within
                            else "")
                return _verdict(name, [
                    f"too slow: {per:.2f} instructions per element at {rows} × {cols}, at most {RMS_NORM_IR_BOUND} at "
                    f"each size{one_size} ({where})",
                    f"where they go at {rows} × {cols} (callgrind, per line of your source; intrinsics count at the "
                    f"line that calls them): {hot_text}",
                    _rms_slow_hint(source, hot)], "the values are right on every case", [])
            else:
                lines.append(f"within {RMS_NORM_IR_BOUND} {where}")
    return _verdict(name, [], None, lines)


# --------------------------------------------------------------------------------------------
# Exercise 2: GEMM, cache-blocked
# --------------------------------------------------------------------------------------------


#: Exercise 2's last case: a, b and c each end where a page ends, an untouchable page after each (dense: lda = K,
#: ldb = ldc = N; N and K with tails of 5).
GEMM_PAGE_END_CASE = (19, 45, 29, 29, 45, 45)


def _gemm_cases() -> list[tuple[int, int, int, int, int, int]]:
    """``(M, N, K, lda, ldb, ldc)``: square, odd sizes, one element, padded rows in all three (K and N past a
    tile), sizes past common tiles, a skinny one, K = 0 (C must be zeros), M = 0, and :data:`GEMM_PAGE_END_CASE`."""
    return [(64, 64, 64, 64, 64, 64), (37, 45, 29, 29, 45, 45), (1, 1, 1, 1, 1, 1), (70, 33, 130, 140, 40, 35),
            (131, 150, 97, 100, 160, 151), (5, 200, 3, 3, 203, 201), (4, 6, 0, 1, 6, 6), (0, 5, 5, 5, 5, 5),
            GEMM_PAGE_END_CASE]


def _gemm_causes(a: np.ndarray, b: np.ndarray, got: np.ndarray, case: tuple) -> list[str]:
    m, n, k = case[:3]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    found = []
    scale = np.abs(a64) @ np.abs(b64)
    tolerance = 1e-5 * scale + 1e-5
    for cut in sorted({k - k % v for v in (2, 4, 8, 16, 32, 64, 128) if k % v}, reverse=True):
        if np.all(np.abs(got - a64[:, :cut] @ b64[:cut]) <= tolerance):
            found.append(f"the last {k - cut} of the K = {k} products of each element are missing: the k loop stops "
                         "at the last whole tile (or vector) — take its tail too (std::min(k0 + KC, K))")
            break
    if got.shape == (m, n) and m and n and np.all(np.abs(got - 2 * (a64 @ b64)) <= 2 * tolerance):
        found.append("every element is twice the product: a tile of k (or the whole sum) added twice")
    return found


def check_gemm_blocked(source: Any, *, count: bool = True) -> Verdict:
    """Exercise 2: ``gemm`` of the C++ ``source`` — right on every case, then within :data:`GEMM_D1_BOUND` D1 read
    misses per thousand multiply-adds (cachegrind). ``count=False`` checks the values only."""
    from utils import cpp

    name = GEMM_NAME
    library, compile_problems = _compile(source, "gemm_threads")
    if compile_problems:
        return _verdict(name, compile_problems, None, [])
    gen = np.random.default_rng()
    cases, prepared = [], []
    for case in _gemm_cases():
        m, n, k, lda, ldb, ldc = case
        a = gen.uniform(-1, 1, (m, k)).astype(np.float32)
        b = gen.uniform(-1, 1, (k, n)).astype(np.float32)
        at_end = case == GEMM_PAGE_END_CASE
        matrices = [_Matrix.make("a", a, m, k, lda, at_end), _Matrix.make("b", b, k, n, ldb, at_end),
                    _Matrix.make("c", None, m, n, ldc, at_end)]
        args = [("buffer", 0), ("buffer", 1), ("buffer", 2), *(("i64", v) for v in case)]
        inputs = [mat.buffer.copy() for mat in matrices[:2]]
        cases.append((matrices, args))
        prepared.append((case, a, b, inputs))
    run = _run_child(library, "gemm", cases, ["ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64"],
                     cpp.asan_runtime())
    for index, (case, a, b, inputs) in enumerate(prepared):
        m, n, k, lda, ldb, ldc = case
        line = f"case {index + 1} of {len(prepared)}: M={m}, N={n}, K={k}, lda={lda}, ldb={ldb}, ldc={ldc}"
        if index >= run.done:
            return _verdict(name, [run.error or "the child process stopped", *run.problems(index)], line, [])
        matrices = cases[index][0]
        problems = []
        for matrix, before in zip(matrices[:2], inputs):
            if not np.array_equal(matrix.buffer.view(np.uint32), before.view(np.uint32)):
                problems.append(f"changed the input {matrix.label} (it is const: write only c)")
        c = matrices[2]
        problems += c.damage()
        got = c.values()
        unwritten = got.view(np.uint32) == POISON_BITS
        if unwritten.any():
            text = _where(unwritten, "never written (still the poison NaN)")
            if k == 0 and unwritten.all():
                text += " — with K = 0, C is all zeros: set C before accumulating into it"
            elif unwritten.all():
                text += (" — the stub? Or C accumulated into (c += ...) without being set to zero first: its old "
                         "contents here are the poison NaN, and NaN + x is that NaN")
            problems.append(text)
        expected = a.astype(np.float64) @ b.astype(np.float64)
        tolerance = 1e-5 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))) + 1e-5
        wrong = ~unwritten & ~(np.abs(got.astype(np.float64) - expected) <= tolerance)
        if wrong.any():
            if np.isnan(got[wrong]).any():
                problems.append("NaN computed where the inputs have none: a read outside a's or b's rows (their "
                                f"padding up to lda = {lda} and ldb = {ldb}, and their guards, hold NaN) — a leading "
                                "dimension mixed up with a size (K for lda, N for ldb), or a tile past the edge")
            first = tuple(int(i) for i in np.argwhere(wrong)[0])
            problems.append(_where(wrong, "wrong") + f": got {float(got[first]):.6g}, expected "
                            f"{float(expected[first]):.6g}")
            problems = [f"cause: {c}" for c in _gemm_causes(a, b, got, case)] + problems
        problems += run.problems(index)
        if problems:
            return _verdict(name, problems, line, [])
    lines = [f"all {len(prepared)} cases match the float64 reference (guards intact, every element written)"]
    if count:
        from utils import valgrind

        if not valgrind.available():
            lines.append("the cache-miss bound was not checked: valgrind is not installed (apt install valgrind)")
        else:
            from utils.valgrind import DEFAULT_CACHE

            counted = []
            for case in GEMM_COUNT_CASES:
                def count(text: str, case: tuple[int, int, int] = case) -> float:
                    return gemm_d1_read_misses(text, case)

                counted.append((case, count(source), *_scale(count, GEMM_NAIVE, name), count(GEMM_IKJ)))
            sizes = "; ".join(
                f"M, N, K = {m}, {n}, {k}: {misses:.3g}" + (f" (the solution {solved:.3g}, " if solved is not None
                                                           else " (")
                + f"the unblocked ikj loop {ikj:.3g}, the naive ijk loop {naive:.3g})"
                for (m, n, k), misses, solved, naive, ikj in counted)
            where = (f"D1 read misses of your code per 1000 multiply-adds, a simulated {DEFAULT_CACHE['D1']} L1 "
                     f"(cachegrind): {sizes}")
            over = [(case, misses) for case, misses, _, _, _ in counted if misses > GEMM_D1_BOUND]
            if over:
                (m, n, k), misses = over[0]
                profile = valgrind.line_profile(_gemm_harness(source, (m, n, k)), cpp.HARNESS_SOURCE, cache=True)
                hot, hot_text = _hot_lines(source, profile, "D1mr", m * n * k / 1000, "per 1000 multiply-adds")
                within = [(case, mi) for case, mi, _, _, _ in counted if mi <= GEMM_D1_BOUND]
                one_size = (f" — within it at M, N, K = {', '.join(map(str, within[0][0]))}: a loop that keeps B's "
                            "tile in L1 at one size only" if within and misses > ONE_SIZE_RATIO * within[0][1] else
                            f" (and {within[0][1]:.3g} at M, N, K = {', '.join(map(str, within[0][0]))}, near it)"
                            if within else "")
                return _verdict(name, [
                    f"too many cache misses: {misses:.3g} D1 read misses per 1000 multiply-adds at M, N, K = {m}, {n}, "
                    f"{k}, at most {GEMM_D1_BOUND:g} at each size{one_size} ({where})",
                    f"where they are at M, N, K = {m}, {n}, {k} (callgrind's cache simulator, per line of your "
                    f"source): {hot_text}",
                    _gemm_misses_hint(source, hot, (m, n, k))], "the values are right on every case", [])
            lines.append(f"within {GEMM_D1_BOUND:g} {where}")
    return _verdict(name, [], None, lines)
