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
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import exercises as _package
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
GEMM_NAME = "ch13_below_triton.GEMM_BLOCKED"

#: The bit patterns: an output's unwritten elements (a quiet NaN with a payload no arithmetic makes), the
#: canary of its guards and row gaps, and the NaN of an input's guards and gaps.
POISON_BITS = 0x7FC0DEAD
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
#: Instructions per element the learner's function may execute (inclusive, counted by callgrind). The naive loop
#: executes about 3.3 with GCC 12 (its in-order sum of squares) and about 5 where a compiler leaves it scalar;
#: the solution about 1.4, intrinsics with two accumulators about 1.1: 2.2 leaves the solution half again as much
#: room and fails the naive loop by half as much.
RMS_NORM_IR_BOUND = 2.2

#: Exercise 2's performance case: M = N = K = 144 (B is 81 KiB: it does not fit the simulated 32 KiB L1).
GEMM_COUNT_CASE = (144, 144, 144)
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

    @property
    def length(self) -> int:
        return (self.rows - 1) * self.stride + self.cols if self.rows and self.cols else 0

    def index(self) -> np.ndarray:
        """Positions in ``buffer`` of the matrix's elements, (rows, cols)."""
        return GUARD + np.arange(self.rows)[:, None] * self.stride + np.arange(self.cols)[None, :]

    @staticmethod
    def make(label: str, values: np.ndarray | None, rows: int, cols: int, stride: int) -> _Matrix:
        output = values is None
        matrix = _Matrix(label, rows, cols, stride, output)
        fill = CANARY_BITS if output else INPUT_GUARD_BITS
        buffer = _bits(fill, 2 * GUARD + matrix.length)
        if rows and cols:
            buffer[matrix.index()] = _bits(POISON_BITS, rows * cols).reshape(rows, cols) if output else values
        matrix.buffer = buffer
        return matrix

    def values(self) -> np.ndarray:
        return self.buffer[self.index()] if self.rows and self.cols else np.zeros((self.rows, self.cols), np.float32)

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
                            "a loop that runs past the last row or column — the tail, or a full vector store "
                            "where fewer than 8 elements are left")
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
        width = total_cols - cols[0]
        tails = [v for v in (8, 16, 32, 64) if total_cols % v == width]
        if tails:
            text += (f" — the last {width} {cols_word}s of every {rows_word}, {total_cols} % {tails[0]} = {width}: "
                     "the tail the vector loop leaves")
        else:
            text += f" — the last {width} {cols_word}s of every {rows_word}"
    elif rows and len(cols) == total_cols and rows == list(range(rows[0], total_rows)) and rows[0] > 0:
        text += f" — every {rows_word} from {rows[0]} on"
    first = np.argwhere(mask)[0]
    return text + f" (the first at ({int(first[0])}, {int(first[1])}))"


# --------------------------------------------------------------------------------------------
# Compiling and running in a child process
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """What the child did: ``done`` cases finished; ``error`` the reason it stopped early (None if it did not)."""

    done: int
    error: str | None = None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _run_child(library: Path, function: str, cases: list[tuple[list[_Matrix], list[tuple[str, Any]]]],
               argtypes: list[str]) -> _Run:
    """Run ``function`` of ``library`` on each case (its matrices, then its arguments: ``("buffer", i)`` or
    ``("i64"|"f32", value)``) in a child process; read back the matrices' buffers."""
    with tempfile.TemporaryDirectory(prefix="cpp-check-") as work:
        spec_cases = []
        for n, (matrices, args) in enumerate(cases):
            buffers = []
            for m, matrix in enumerate(matrices):
                path = Path(work, f"case{n}-{m}.bin")
                path.write_bytes(matrix.buffer.tobytes())
                buffers.append({"file": str(path), "offset": GUARD})
            spec_cases.append({"buffers": buffers, "args": [{"buffer": v} if k == "buffer" else {"value": v}
                                                            for k, v in args]})
        spec = {"library": str(library), "function": function, "argtypes": argtypes, "cases": spec_cases}
        Path(work, "spec.json").write_text(json.dumps(spec))
        child = Path(__file__).with_name("cpp_child.py")
        try:
            result = subprocess.run([sys.executable, str(child), str(Path(work, "spec.json"))], capture_output=True,
                                    text=True, timeout=CHILD_TIMEOUT_S)
            code, stdout = result.returncode, result.stdout
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
        if code is None:
            return _Run(done, f"did not finish within {CHILD_TIMEOUT_S} s: a loop that never ends (a counter that "
                              "does not advance, or a bound compared the wrong way)?")
        if code < 0:
            return _Run(done, f"crashed ({_signal_name(code)}): an access far outside the buffers (an index or "
                              "stride mixed up, a loop bound past the end), or an aligned load/store "
                              "(_mm256_load_ps) of an address that is not 32-byte aligned — rows start anywhere")
        if code != 0:
            return _Run(done, f"the child process exited with status {code}: {result.stderr.strip()[-300:]}")
        return _Run(done)


def _compile(source: Any) -> tuple[Path | None, list[str] | None]:
    """The compiled library's path (not loaded here: its code runs in the child only), or the verdict lines of a
    compile error."""
    from utils import cpp

    if not isinstance(source, str):
        return None, [f"expected the C++ source as a string, got {type(source).__name__}"]
    try:
        return cpp.build_shared(source), None
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


def rms_norm_instructions_per_element(source: str) -> float:
    """Instructions per element ``rms_norm_rows`` of ``source`` executes on :data:`RMS_COUNT_CASE` (callgrind,
    inclusive of what it calls)."""
    from utils import cpp, valgrind

    rows, cols, x_stride, y_stride = RMS_COUNT_CASE

    def compute() -> float:
        exe = cpp.harness(source, "rms_norm_rows", [
            cpp.buffer("const float*", (rows - 1) * x_stride + cols), cpp.buffer("const float*", cols),
            cpp.buffer("float*", (rows - 1) * y_stride + cols, "zeros"), cpp.scalar("int64_t", rows),
            cpp.scalar("int64_t", cols), cpp.scalar("int64_t", x_stride), cpp.scalar("int64_t", y_stride),
            cpp.scalar("float", 1e-6)])
        return valgrind.callgrind(exe).of("rms_norm_rows") / (rows * cols)

    return _cached_count(f"rms-ir-{RMS_COUNT_CASE}", source, compute)


def gemm_d1_read_misses(source: str) -> float:
    """D1 read misses per M·N·K/1000 of ``gemm`` of ``source`` (every function compiled from it) on
    :data:`GEMM_COUNT_CASE`, under cachegrind with :data:`utils.valgrind.DEFAULT_CACHE`."""
    from utils import cpp, valgrind

    m, n, k = GEMM_COUNT_CASE

    def compute() -> float:
        exe = cpp.harness(source, "gemm", [
            cpp.buffer("const float*", m * k), cpp.buffer("const float*", k * n), cpp.buffer("float*", m * n, "zeros"),
            *(cpp.scalar("int64_t", v) for v in (m, n, k, k, n, n))])
        counts = valgrind.cachegrind(exe)
        return counts.in_file(cpp.HARNESS_SOURCE, "D1mr") / (m * n * k / 1000)

    return _cached_count(f"gemm-d1-{GEMM_COUNT_CASE}", source, compute)


def _scale(count: Callable[[str], float], naive: str, exercise: str) -> tuple[float | None, float | None]:
    """The solution's and the naive loop's counts, for scale (None where they cannot be had)."""
    from .marker import MissingSolutionError, solution

    try:
        reference = solution(exercise)
        solved = count(reference) if isinstance(reference, str) else None
    except MissingSolutionError:
        solved = None
    return solved, count(naive)


# --------------------------------------------------------------------------------------------
# Exercise 1: RMSNorm rows, vectorized
# --------------------------------------------------------------------------------------------


def _rms_cases(gen: np.random.Generator) -> list[tuple[int, int, int, int, float, float]]:
    """``(rows, cols, x_row_stride, y_row_stride, eps, scale)``: a multiple of 16, a tail of 3, fewer columns than
    a vector, padded rows (different strides for x and y), one element, a long row, no rows, and small values
    where eps matters."""
    return [(4, 64, 64, 64, 1e-6, 1.0), (3, 1003, 1003, 1003, 1e-6, 1.0), (5, 7, 7, 7, 1e-6, 1.0),
            (6, 100, 133, 120, 1e-6, 1.0), (1, 1, 1, 1, 1e-6, 1.0), (2, 2053, 2060, 2053, 1e-6, 1.0),
            (0, 8, 8, 8, 1e-6, 1.0), (3, 37, 37, 40, 1e-2, 0.05)]


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
    name = RMS_NAME
    library, compile_problems = _compile(source)
    if compile_problems:
        return _verdict(name, compile_problems, None, [])
    gen = np.random.default_rng()
    cases, prepared = [], []
    for case in _rms_cases(gen):
        rows, cols, x_stride, y_stride, eps, scale = case
        x = (gen.standard_normal((rows, cols)) * scale).astype(np.float32)
        w = (gen.standard_normal((1, cols)) * 0.5 + 1.0).astype(np.float32)
        matrices = [_Matrix.make("x", x, rows, cols, x_stride), _Matrix.make("w", w, 1, cols, cols),
                    _Matrix.make("y", None, rows, cols, y_stride)]
        args = [("buffer", 0), ("buffer", 1), ("buffer", 2), ("i64", rows), ("i64", cols), ("i64", x_stride),
                ("i64", y_stride), ("f32", eps)]
        inputs = [m.buffer.copy() for m in matrices[:2]]
        cases.append((matrices, args))
        prepared.append((case, x, w[0], inputs))
    run = _run_child(library, "rms_norm_rows", cases, ["ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "f32"])
    for n, (case, x, w, inputs) in enumerate(prepared):
        rows, cols, x_stride, y_stride, eps, _ = case
        line = (f"case {n + 1} of {len(prepared)}: rows={rows}, cols={cols}, x_row_stride={x_stride}, "
                f"y_row_stride={y_stride}, eps={eps:g}")
        if n >= run.done:
            return _verdict(name, [run.error or "the child process stopped"], line, [])
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
        if problems:
            return _verdict(name, problems, line, [])
    lines = [f"all {len(prepared)} cases match the float64 reference (guards intact, every element written)"]
    if count:
        from utils import cpp, valgrind

        if not valgrind.available():
            lines.append("the instruction bound was not checked: valgrind is not installed (apt install valgrind)")
        else:
            rows, cols, x_stride, y_stride = RMS_COUNT_CASE
            per_element = rms_norm_instructions_per_element(source)
            solved, naive = _scale(rms_norm_instructions_per_element, RMS_NORM_NAIVE, name)
            scale = (f"the solution executes {solved:.2f}, " if solved is not None else "") + \
                f"the naive scalar loop {naive:.2f}"
            where = (f"{rows} rows × {cols} columns, row strides {x_stride}/{y_stride}, instructions of "
                     "rms_norm_rows and what it calls, counted by callgrind")
            if per_element > RMS_NORM_IR_BOUND and not cpp.X86_64_V3:
                lines.append(f"{per_element:.2f} instructions per element ({where}); {scale}. The bound "
                             f"({RMS_NORM_IR_BOUND}) is set for x86-64-v3 (8-wide AVX2): this CPU builds for another "
                             "target, so the count is shown, not judged")
            elif per_element > RMS_NORM_IR_BOUND:
                return _verdict(name, [
                    f"too slow: {per_element:.2f} instructions per element, at most {RMS_NORM_IR_BOUND} ({where}); "
                    f"{scale} — the sum of squares is a float reduction the compiler keeps in order unless told: "
                    "`#pragma omp simd reduction(+ : sum)` on the loop, or AVX2 intrinsics (_mm256_fmadd_ps into "
                    "8-lane partial sums, then one horizontal sum per row)"], "the values are right on every case", [])
            else:
                lines.append(f"{per_element:.2f} instructions per element, within {RMS_NORM_IR_BOUND} ({where}); "
                             f"{scale}")
    return _verdict(name, [], None, lines)


# --------------------------------------------------------------------------------------------
# Exercise 2: GEMM, cache-blocked
# --------------------------------------------------------------------------------------------


def _gemm_cases() -> list[tuple[int, int, int, int, int, int]]:
    """``(M, N, K, lda, ldb, ldc)``: square, odd sizes, one element, padded rows in all three (K and N past a
    tile), sizes past common tiles, a skinny one, K = 0 (C must be zeros), M = 0."""
    return [(64, 64, 64, 64, 64, 64), (37, 45, 29, 29, 45, 45), (1, 1, 1, 1, 1, 1), (70, 33, 130, 140, 40, 35),
            (131, 150, 97, 100, 160, 151), (5, 200, 3, 3, 203, 201), (4, 6, 0, 1, 6, 6), (0, 5, 5, 5, 5, 5)]


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
    name = GEMM_NAME
    library, compile_problems = _compile(source)
    if compile_problems:
        return _verdict(name, compile_problems, None, [])
    gen = np.random.default_rng()
    cases, prepared = [], []
    for case in _gemm_cases():
        m, n, k, lda, ldb, ldc = case
        a = gen.uniform(-1, 1, (m, k)).astype(np.float32)
        b = gen.uniform(-1, 1, (k, n)).astype(np.float32)
        matrices = [_Matrix.make("a", a, m, k, lda), _Matrix.make("b", b, k, n, ldb),
                    _Matrix.make("c", None, m, n, ldc)]
        args = [("buffer", 0), ("buffer", 1), ("buffer", 2), *(("i64", v) for v in case)]
        inputs = [mat.buffer.copy() for mat in matrices[:2]]
        cases.append((matrices, args))
        prepared.append((case, a, b, inputs))
    run = _run_child(library, "gemm", cases, ["ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i64", "i64"])
    for index, (case, a, b, inputs) in enumerate(prepared):
        m, n, k, lda, ldb, ldc = case
        line = f"case {index + 1} of {len(prepared)}: M={m}, N={n}, K={k}, lda={lda}, ldb={ldb}, ldc={ldc}"
        if index >= run.done:
            return _verdict(name, [run.error or "the child process stopped"], line, [])
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
        if problems:
            return _verdict(name, problems, line, [])
    lines = [f"all {len(prepared)} cases match the float64 reference (guards intact, every element written)"]
    if count:
        from utils import valgrind

        if not valgrind.available():
            lines.append("the cache-miss bound was not checked: valgrind is not installed (apt install valgrind)")
        else:
            m, n, k = GEMM_COUNT_CASE
            misses = gemm_d1_read_misses(source)
            solved, naive = _scale(gemm_d1_read_misses, GEMM_NAIVE, name)
            ikj = gemm_d1_read_misses(GEMM_IKJ)
            scale = ((f"the solution takes {solved:.3g}, " if solved is not None else "")
                     + f"the unblocked ikj loop {ikj:.3g}, the naive ijk loop {naive:.3g}")
            from utils.valgrind import DEFAULT_CACHE

            where = (f"M = N = K = {m}, D1 read misses of your code per 1000 multiply-adds, a simulated "
                     f"{DEFAULT_CACHE['D1']} L1 (cachegrind)")
            if misses > GEMM_D1_BOUND:
                return _verdict(name, [
                    f"too many cache misses: {misses:.3g} D1 read misses per 1000 multiply-adds, at most "
                    f"{GEMM_D1_BOUND:g} ({where}); {scale} — B ({k} × {n} floats, {k * n * 4 // 1024} KiB) does not "
                    "fit the L1: loop over tiles so that a KC × NC tile of B (at most half the L1: 16 KiB, e.g. "
                    "64 × 64) is reused by many rows of A before the next one is loaded"],
                    "the values are right on every case", [])
            lines.append(f"{misses:.3g} D1 read misses per 1000 multiply-adds, within {GEMM_D1_BOUND:g} ({where}); "
                         f"{scale}")
    return _verdict(name, [], None, lines)
