"""Chapter 13's CPU ladder: every rung right on awkward sizes, the report's timings and counts, and exercises 1
and 2 — their solutions solved, and wrong answers (the stubs, naive loops, a skipped tail, a write past the end,
a stride mixed up, an unblocked loop, a crash...) each NOT SOLVED with the right diagnosis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench import ch13_below_triton as bench13
from solutions import ch13_below_triton as solutions13
from utils import cpp, valgrind
from utils.exercises import cpp_kernel

pytestmark = pytest.mark.skipif(not cpp.compiler_available(), reason="g++ is not installed")
needs_valgrind = pytest.mark.skipif(not valgrind.available(), reason="valgrind is not installed")

SOURCES = Path(__file__).resolve().parent.parent / "chapters" / "13_below_triton" / "src" / "cpu"
RMS_ARGS = "const float* x, const float* w, float* y, int64_t rows, int64_t cols, int64_t xs, int64_t ys, float eps"
GEMM_ARGS = ("const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, "
             "int64_t ldc")


def rung_as_exercise(file: str, rung: str) -> str:
    """A chapter rung under the exercise's name, so that the exercise's check (guards, poison, awkward cases)
    runs it."""
    if file == "rms_norm.cpp":
        return (f'#include "{SOURCES / file}"\nextern "C" void rms_norm_rows({RMS_ARGS}) '
                f"{{ {rung}(x, w, y, rows, cols, xs, ys, eps); }}\n")
    return (f'#include "{SOURCES / file}"\nextern "C" void gemm({GEMM_ARGS}) '
            f"{{ {rung}(a, b, c, M, N, K, lda, ldb, ldc); }}\n")


def verdict_of(check, source, capsys, count=True):
    verdict = check(source, count=count)
    printed = capsys.readouterr().out
    assert printed.strip() == verdict.message.strip()
    return verdict, " ".join(verdict.message.split())  # the message unwrapped, for matching


# ------------------------------------------------------------------------------------------------
# The rungs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rung", ["rms_norm_naive", "rms_norm_simd", "rms_norm_avx2"])
def test_rms_norm_rungs_are_right_on_awkward_cases(rung, capsys):
    verdict, _ = verdict_of(cpp_kernel.check_rms_norm_simd, rung_as_exercise("rms_norm.cpp", rung), capsys, False)
    assert verdict.solved, verdict.message


@pytest.mark.parametrize("rung", ["gemm_naive", "gemm_ikj", "gemm_blocked", "gemm_simd"])
def test_gemm_rungs_are_right_on_awkward_cases(rung, capsys):
    verdict, _ = verdict_of(cpp_kernel.check_gemm_blocked, rung_as_exercise("gemm.cpp", rung), capsys, False)
    assert verdict.solved, verdict.message


@needs_valgrind
def test_the_chapter_rungs_keep_the_exercises_bounds_and_the_naive_ones_do_not():
    for rung in ("rms_norm_simd", "rms_norm_avx2"):
        per = cpp_kernel.rms_norm_instructions_per_element(rung_as_exercise("rms_norm.cpp", rung))
        assert per < cpp_kernel.RMS_NORM_IR_BOUND / 1.4, rung  # room to spare
    assert cpp_kernel.rms_norm_instructions_per_element(rung_as_exercise("rms_norm.cpp", "rms_norm_naive")) > \
        cpp_kernel.RMS_NORM_IR_BOUND * 1.3
    for rung in ("gemm_blocked", "gemm_simd"):
        misses = cpp_kernel.gemm_d1_read_misses(rung_as_exercise("gemm.cpp", rung))
        assert misses < cpp_kernel.GEMM_D1_BOUND / 2, rung
    assert cpp_kernel.gemm_d1_read_misses(rung_as_exercise("gemm.cpp", "gemm_ikj")) > cpp_kernel.GEMM_D1_BOUND * 2


def test_threaded_rungs_on_two_openmp_threads():
    rms = cpp.compile_shared(SOURCES / "rms_norm.cpp", openmp=True).kernel("rms_norm_threads", bench13.RMS_SIGNATURE)
    gemm = cpp.compile_shared(SOURCES / "gemm.cpp", openmp=True).kernel("gemm_threads", bench13.GEMM_SIGNATURE)
    cpp.set_openmp_threads(2)
    x = torch.randn(37, 1030)[:, :1003]
    w = torch.randn(1003)
    y = torch.full((37, 1003), float("nan"))
    rms(x, w, y, 37, 1003, x.stride(0), y.stride(0), 1e-6)
    x64 = x.double()
    torch.testing.assert_close(y.double(), x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w.double(),
                               rtol=1e-5, atol=1e-5)
    a, b = torch.randn(300, 130)[:, :129], torch.randn(129, 260)[:, :257]  # three bands of 128 rows, padded
    c = torch.full((300, 270), float("nan"))
    gemm(a, b, c, 300, 257, 129, a.stride(0), b.stride(0), c.stride(0))
    torch.testing.assert_close(c[:, :257].double(), a.double() @ b.double(), rtol=1e-4, atol=1e-4)
    assert c[:, 257:].isnan().all()  # the padding past N untouched


def test_the_vectorizer_report_of_the_rms_norm_rungs():
    source = (SOURCES / "rms_norm.cpp").read_text().splitlines()
    notes = {note.line: note for note in cpp.vectorization_report(SOURCES / "rms_norm.cpp", openmp=True)}
    # rung 2's pragmas (the non-AVX2 fallback further down has its own, not compiled here)
    start = next(i for i, line in enumerate(source) if line.startswith('extern "C" void rms_norm_simd('))
    end = next(i for i, line in enumerate(source) if i > start and line.startswith("}"))
    simd_lines = [i + 2 for i in range(start, end) if source[i].strip().startswith("#pragma omp simd")]
    assert len(simd_lines) == 2
    for line in simd_lines:  # the loop under each pragma
        assert notes[line].loop_vectorized and "32 byte vectors" in notes[line].why, (line, notes.get(line))


# ------------------------------------------------------------------------------------------------
# The report's rows
# ------------------------------------------------------------------------------------------------


def test_cpu_ladder_rows_state_threads_and_compare_with_torch():
    rows = bench13.cpu_ladder({"rms_norm": (16, 259), "gemm": (40,)}, threads=2, min_run_time=0.002)
    names = [(r.op, r.rung, r.threads) for r in rows]
    assert ("rms_norm", "torch.nn.functional.rms_norm", 1) in names and ("gemm", "torch.matmul", 2) in names
    assert {r.rung for r in rows} >= {name for name, _ in bench13.RMS_NORM_RUNGS + bench13.GEMM_RUNGS}
    for r in rows:
        assert r.threads == (2 if r.rung.endswith("_threads") else r.threads)
        assert r.median_ms > 0 and r.rate > 0 and r.vs_torch > 0
        assert r.max_error < (1e-4 if r.op == "gemm" else 1e-5), r
    markdown = bench13.cpu_markdown(rows, [], bench13.machine(), 2)
    assert markdown.startswith(bench13.CPU_BEGIN) and markdown.endswith(bench13.CPU_END)
    assert "logical cores" in markdown and "torch.matmul" in markdown


@needs_valgrind
def test_cpu_counts_order_the_rungs():
    counts = {r.rung: r for r in bench13.cpu_counts({"rms_norm": (8, 203), "gemm": (48,)})}
    assert counts["rms_norm_naive"].instructions > 1.5 * counts["rms_norm_avx2"].instructions
    assert counts["gemm_naive"].instructions > 5 * counts["gemm_simd"].instructions
    assert counts["gemm_simd"].size == "M = N = K = 48" and counts["gemm_simd"].per == "1000 multiply-adds"
    assert all(r.d1_read_misses >= 0 and r.ll_misses >= 0 for r in counts.values())


# ------------------------------------------------------------------------------------------------
# Exercise 1: RMS_NORM_SIMD
# ------------------------------------------------------------------------------------------------

RMS_HEAD = '#include <cmath>\n#include <cstdint>\nextern "C" void rms_norm_rows(' + RMS_ARGS.replace(
    "xs", "x_row_stride").replace("ys", "y_row_stride") + ") {\n"


def rms_body(sum_loop: str, out_loop: str, x_stride: str = "x_row_stride") -> str:
    return RMS_HEAD + f"""  for (int64_t r = 0; r < rows; ++r) {{
    const float* xr = x + r * {x_stride};
    float* yr = y + r * y_row_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    {sum_loop}
    const float rstd = 1.0f / std::sqrt(sum / cols + eps);
#pragma omp simd
    {out_loop}
  }}
}}
"""


SUM = "for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];"
OUT = "for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];"


@needs_valgrind
def test_rms_norm_solution_is_solved_with_its_count(capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, solutions13.RMS_NORM_SIMD, capsys)
    assert verdict.solved, verdict.message
    assert "✅ SOLVED" in text and "within 2.2 instructions per element" in text and "naive scalar loop" in text
    assert "64 rows × 1003 columns" in text and "96 rows × 512 columns" in text  # both sizes counted, both printed


@pytest.mark.parametrize("name, source, expected", [
    ("stub", cpp_kernel.RMS_NORM_SIMD_STUB, ["never written (still the poison NaN)", "the stub"]),
    ("tail skipped", rms_body(SUM.replace("c < cols", "c < cols - cols % 8"),
                              OUT.replace("c < cols", "c < cols - cols % 8")),
     ["case 2 of 9", "cols=1003", "the last 3 columns of every row, after the first 1000 (125 × 8): the edge",
      "cause: the sum of squares leaves out the tail"]),
    ("one past the end", rms_body(SUM, OUT.replace("c < cols", "c <= cols")),
     ["past the end of y", "the first 1 past its last element"]),
    ("x stride ignored", rms_body(SUM, OUT, x_stride="cols"),
     ["case 4 of 9", "x_row_stride=133", "row 0 is right, later rows are wrong", "x + r * x_row_stride"]),
    ("y stride ignored", rms_body(SUM, OUT).replace("y + r * y_row_stride", "y + r * cols"),
     ["case 4 of 9", "never written"]),
    ("eps outside", rms_body(SUM, OUT).replace("std::sqrt(sum / cols + eps)", "(std::sqrt(sum / cols) + eps)"),
     ["case 8 of 9", "eps is added after the square root"]),
    ("w forgotten", rms_body(SUM, OUT.replace(" * w[c]", "")), ["cause: the output is not multiplied by w"]),
])
def test_rms_norm_wrong_answers_are_not_solved_with_their_diagnosis(name, source, expected, capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, source, capsys)
    assert not verdict.solved and "❌ NOT SOLVED — ch13_below_triton.RMS_NORM_SIMD" in text, name
    for fragment in expected:
        assert fragment in text, (name, fragment, verdict.message)
    assert "too slow" not in text  # wrong values are reported before any count


@needs_valgrind
def test_rms_norm_naive_loop_is_too_slow(capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, cpp_kernel.RMS_NORM_NAIVE, capsys)
    assert not verdict.solved
    assert "the values are right on every case" in text and "too slow" in text and "at most 2.2" in text
    assert "(the solution 1.4" in text and "omp simd reduction" in text


# Wrong answers whose values are right — a race hidden by a build without threads, a read or a write past a row
# that discards or restores what it touched, code fast at one size only — and too-slow verdicts that must name what
# they see. Each was once SOLVED, or told a wrong reason.

RMS_THREADED_RACE = RMS_HEAD + """  float sum = 0.0f;  // one sum shared by all the threads: a race, were they started
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
    sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
    const float rstd = 1.0f / std::sqrt(sum / cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];
  }
}
"""


@pytest.mark.parametrize("name, source, line", [
    ("a parallel for with a shared sum", RMS_THREADED_RACE, 5),
    ("asks the OpenMP runtime", "#include <omp.h>\n" + rms_body(SUM, OUT).replace(
        "    float sum = 0.0f;\n", "    float sum = 0.0f * omp_get_max_threads();\n"), 8),
    ("a std::thread", "#include <thread>\n" + rms_body(SUM, OUT).replace(
        "    float sum = 0.0f;\n", "    float sum = 0.0f;\n    std::thread([] {}).join();\n"), 9),
])
def test_rms_norm_threads_are_refused_with_why(name, source, line, capsys):
    # Built with -fopenmp-simd only, a parallel pragma was silently ignored (the race passed) and an omp_ call left
    # the library with an undefined symbol (the child failed to load it, unexplained).
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, source, capsys, False)
    assert not verdict.solved, name
    assert f"line {line} uses threads" in text and "one thread" in text and "rms_norm_threads" in text, text
    assert "undefined symbol" not in text


def test_gemm_threads_are_refused_but_simd_pragmas_and_comments_are_not(capsys):
    threaded = BLOCKED.replace("  for (int64_t i0 = 0; i0 < M; i0 += MC)\n",
                               "#pragma omp parallel for\n  for (int64_t i0 = 0; i0 < M; i0 += MC)\n")
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, threaded, capsys, False)
    assert not verdict.solved and "line 9 uses threads" in text and "gemm_threads" in text
    commented = BLOCKED.replace("#pragma omp simd", "// no #pragma omp parallel here, only:\n#pragma omp simd")
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, commented, capsys, False)
    assert verdict.solved, text


AVX2_HEAD = RMS_HEAD.replace("#include <cstdint>\n", "#include <cstdint>\n#include <immintrin.h>\n")
# The sum of squares, 8 at a time, with the last partial vector read whole and its dead lanes zeroed by a mask: the
# values are right (the mask discards what lies past the row), but the load reads past it.
MASKED_OVERREAD_SUM = """  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(cols - c)), lane));
      const __m256 v = _mm256_and_ps(_mm256_loadu_ps(xr + c), live);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    const float rstd = 1.0f / std::sqrt(sum / cols + eps);
"""
RMS_MASKED_OVERREAD = AVX2_HEAD + MASKED_OVERREAD_SUM + "    " + OUT + "\n  }\n}\n"
# x and w read safely (masked loads), but y's last partial vector is read, blended with the results and stored
# whole: the bytes past the row are written back as they were — right values, intact canaries, and still a read and
# a write of memory that is not y's row.
RMS_TAIL_READ_MODIFY_WRITE = AVX2_HEAD + """  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
    const __m256 rstd = _mm256_set1_ps(1.0f / std::sqrt(sum / cols + eps));
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(cols - c)), lane);
      const __m256 out = _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(xr + c, live), rstd),
                                       _mm256_maskload_ps(w + c, live));
      _mm256_storeu_ps(yr + c, _mm256_blendv_ps(_mm256_loadu_ps(yr + c), out, _mm256_castsi256_ps(live)));
    }
  }
}
"""


@pytest.mark.parametrize("name, source, expected", [
    ("a masked full-vector read past the last row", RMS_MASKED_OVERREAD,
     ["case 2 of 9", "read 20 byte(s) past the end of row 2 of x (past the end of the buffer", "32 bytes",
      "_mm256_maskload_ps"]),
    ("a read-modify-write of y's tail", RMS_TAIL_READ_MODIFY_WRITE,
     ["case 2 of 9", "read 20 byte(s) past the end of row 2 of y (past the end of the buffer",
      "_mm256_maskstore_ps"]),
    # 4 bytes past a row that ends in the middle of one of AddressSanitizer's 8-byte granules (3 × 1003 floats:
    # the buffer's end is 4 bytes into one), and in the padding of y, whose row 0 ends mid-granule too (case 8:
    # 37 columns, row stride 40)
    ("one float past the last row", rms_body(SUM, OUT).replace(
        "    float sum = 0.0f;\n", "    float sum = 0.0f;\n    if (cols % 2) { volatile float seen = xr[cols]; }\n"),
     ["case 2 of 9", "read 4 byte(s) past the end of row 2 of x (past the end of the buffer", "a loop bound"]),
    ("one float into y's padding", rms_body(SUM, OUT).replace(
        "    float sum = 0.0f;\n",
        "    float sum = 0.0f;\n    if (cols % 2 && y_row_stride > cols) { volatile float seen = yr[cols]; }\n"),
     ["case 8 of 9", "read 4 byte(s) past the end of row 0 of y (in the padding between rows: columns 37–39"]),
])
def test_rms_norm_accesses_past_a_row_are_caught_even_when_the_values_are_right(name, source, expected, capsys):
    if cpp.asan_runtime() is None:
        pytest.skip("this g++ cannot build with AddressSanitizer")
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, source, capsys, False)
    assert not verdict.solved, name
    for fragment in expected:
        assert fragment in text, (name, fragment, verdict.message)


def test_the_poisoned_bytes_are_the_padding_and_the_guards():
    matrix = cpp_kernel._Matrix.make("x", np.ones((3, 5), np.float32), 3, 5, 7)
    poisoned = np.zeros(4 * len(matrix.buffer), bool)
    for start, length in matrix.poison_ranges():
        poisoned[start:start + length] = True
    elements = np.zeros_like(poisoned)
    for index in matrix.index().ravel():
        elements[4 * index:4 * index + 4] = True
    assert (poisoned == ~elements).all()  # every byte is an element or poisoned, never both
    assert matrix.locate(4 * (cpp_kernel.GUARD + 3), 32) == (8, "past the end of row 0 of x (in the padding between "
                                                                "rows: columns 5–6 of the row stride 7)")
    assert matrix.locate(4 * cpp_kernel.GUARD, 20) is None


@needs_valgrind
def test_rms_norm_fast_at_one_size_only_is_too_slow(capsys):
    one_size = rms_body(SUM, OUT).replace("#pragma omp simd reduction(+ : sum)\n    " + SUM,
                                          "if (cols == 1003) {\n#pragma omp simd reduction(+ : sum)\n    " + SUM
                                          + "\n    } else {\n    " + SUM + "\n    }")
    assert one_size.count("sum +=") == 2
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, one_size, capsys)
    assert not verdict.solved
    assert "at 96 × 512, at most 2.2 at each size — within it at 64 × 1003: a path fast at one size only" in text
    assert "adds into one running float sum" in text  # the scalar path's sum, seen on its line


@needs_valgrind
def test_rms_norm_too_slow_names_where_the_instructions_go(capsys):
    # Every vector of both loops masked (masked loads and stores: safe and right): the sum is vectorized with
    # partial sums, so the in-order sum is not the reason — the per-iteration masking is.
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, MASK_EVERY_VECTOR, capsys)
    assert not verdict.solved and "too slow" in text
    assert "where they go at 64 × 1003" in text and "_mm256_cmpgt_epi32" in text
    assert "a mask built and a blend or masked load/store in every iteration" in text
    assert "in order" not in text and "reduction(+ : sum)" not in text


MASK_EVERY_VECTOR = AVX2_HEAD + """  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(cols - c)), lane);
      const __m256 v = _mm256_maskload_ps(xr + c, live);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    const __m256 rstd = _mm256_set1_ps(1.0f / std::sqrt(sum / cols + eps));
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(cols - c)), lane);
      const __m256 out = _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(xr + c, live), rstd),
                                       _mm256_maskload_ps(w + c, live));
      _mm256_maskstore_ps(yr + c, live, out);
    }
  }
}
"""


def test_rms_norm_compile_error_crash_and_missing_name(capsys):
    broken = rms_body(SUM.replace("xr[c] * xr[c]", "xr[c] * xq[c]"), OUT)  # line 9: a name never declared
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, broken, capsys)
    assert not verdict.solved and "does not compile (line(s) 9 of the source string)" in text
    assert "source.cpp:9" in text and "xq" in text
    crash = rms_body(SUM, OUT.replace("yr[c] =", "yr[c - (int64_t(1) << 40)] ="))
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, crash, capsys)
    assert not verdict.solved and "case 1 of 9" in text and "crashed (SIGSEGV)" in text
    unnamed = rms_body(SUM, OUT).replace('extern "C" ', "")
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, unnamed, capsys)
    assert not verdict.solved and "has no function `rms_norm_rows`" in text
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, 42, capsys)
    assert not verdict.solved and "expected the C++ source as a string" in text


# ------------------------------------------------------------------------------------------------
# Exercise 2: GEMM_BLOCKED
# ------------------------------------------------------------------------------------------------


@needs_valgrind
def test_gemm_solution_is_solved_with_its_count(capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, solutions13.GEMM_BLOCKED, capsys)
    assert verdict.solved, verdict.message
    assert "within 20 D1 read misses of your code per 1000 multiply-adds" in text and "32 KiB 8-way" in text
    assert "the unblocked ikj loop" in text
    assert "M, N, K = 144, 144, 144" in text and "M, N, K = 64, 1000, 72" in text  # both sizes counted


BLOCKED = solutions13.GEMM_BLOCKED
ZEROING = "  for (int64_t i = 0; i < M; ++i)\n    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;"
assert ZEROING in BLOCKED


@pytest.mark.parametrize("name, source, expected", [
    ("stub", cpp_kernel.GEMM_BLOCKED_STUB, ["case 1 of 9", "never written", "the stub?"]),
    ("k tail dropped", BLOCKED.replace("k0 < K; k0 += KC", "k0 + KC <= K; k0 += KC"),
     ["case 2 of 9", "K=29", "cause: the last 29 of the K = 29 products of each element are missing"]),
    ("ldb mixed up with N", BLOCKED.replace("b[k * ldb + j]", "b[k * N + j]"),
     ["case 4 of 9", "ldb=40", "NaN computed where the inputs have none", "a leading dimension mixed up"]),
    ("one past the end", BLOCKED.replace("j < N; ++j) c[i * ldc + j] = 0.0f", "j <= N; ++j) c[i * ldc + j] = 0.0f"),
     ["past the end of c", "the first 1 past its last element"]),
    ("C not zeroed", BLOCKED.replace("c[i * ldc + j] = 0.0f;", ";"), ["never written", "without being set to zero"]),
    ("C not zeroed when K = 0", BLOCKED.replace(ZEROING, "  if (K > 0)\n" + ZEROING),
     ["case 7 of 9", "K=0", "with K = 0, C is all zeros"]),
])
def test_gemm_wrong_answers_are_not_solved_with_their_diagnosis(name, source, expected, capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, source, capsys)
    assert not verdict.solved and "❌ NOT SOLVED — ch13_below_triton.GEMM_BLOCKED" in text, name
    for fragment in expected:
        assert fragment in text, (name, fragment, verdict.message)


def test_gemm_skipped_partial_tile_is_named_an_edge(capsys):
    # NC = 32 and the partial j-tile skipped: 45 = 32 + 13 columns. Once worded "45 % 16 = 13: the tail the vector
    # loop leaves", a vector loop this code does not have.
    skipped = BLOCKED.replace("NC = 64", "NC = 32").replace("j0 < N; j0 += NC", "j0 + NC <= N; j0 += NC")
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, skipped, capsys, False)
    assert not verdict.solved and "case 2 of 9" in text
    assert "the last 13 columns of every row, after the first 32 (1 × 32): the edge past the last whole block" in text
    assert "a partial tile skipped" in text and "%" not in text


K_ONLY = BLOCKED.replace("  constexpr int64_t MC = 128, KC = 64, NC = 64;",
                         "  const int64_t MC = M, KC = 32, NC = N;  // K blocked, M and N whole")
SPECIAL_144 = BLOCKED.replace("  constexpr int64_t MC = 128, KC = 64, NC = 64;",
                              "  const int64_t MC = 128, KC = 64, NC = (N == 144 ? 64 : N);")
TILED_KJI = BLOCKED.replace("""        for (int64_t i = i0; i < i1; ++i)
          for (int64_t k = k0; k < k1; ++k) {
            const float aik = a[i * lda + k];
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) c[i * ldc + j] += aik * b[k * ldb + j];
          }""", """        for (int64_t k = k0; k < k1; ++k)
          for (int64_t j = j0; j < j1; ++j)
            for (int64_t i = i0; i < i1; ++i) c[i * ldc + j] += a[i * lda + k] * b[k * ldb + j];""")
assert K_ONLY != BLOCKED and SPECIAL_144 != BLOCKED and TILED_KJI != BLOCKED


@needs_valgrind
@pytest.mark.parametrize("name, source, expected, absent", [
    # blocked over K only: a KC × N panel of B, in L1 at N = 144, not at N = 1000
    ("K blocked only", K_ONLY, ["at M, N, K = 64, 1000, 72, at most 20 at each size — within it at M, N, K = 144, "
                                "144, 144", "a tile over K alone is a KC × N panel"], ["steps"]),
    ("blocked for N = 144 only", SPECIAL_144, ["at M, N, K = 64, 1000, 72", "within it at M, N, K = 144, 144, 144"],
     []),
    # tiled, but i innermost: every access to C and A a new line. Once told "B does not fit the L1: loop over tiles"
    ("tiles with i innermost", TILED_KJI, ["at M, N, K = 144, 144, 144",
                                           "over i, steps c[i * ldc + j], a[i * lda + k] by a whole row",
                                           "tiled or not, the innermost loop must walk memory with stride 1"],
     ["does not fit the L1"]),
])
def test_gemm_miss_verdicts_count_two_sizes_and_name_the_access(name, source, expected, absent, capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, source, capsys)
    assert not verdict.solved and "the values are right on every case" in text, name
    assert "where they are at" in text
    for fragment in expected:
        assert fragment in text, (name, fragment, verdict.message)
    for fragment in absent:
        assert fragment not in text, (name, fragment, verdict.message)


@needs_valgrind
@pytest.mark.parametrize("source", [cpp_kernel.GEMM_IKJ, cpp_kernel.GEMM_NAIVE], ids=["unblocked ikj", "naive ijk"])
def test_gemm_unblocked_loops_take_too_many_misses(source, capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, source, capsys)
    assert not verdict.solved
    assert "the values are right on every case" in text and "too many cache misses" in text and "at most 20" in text
    assert "(the solution 3." in text


def test_cpu_rungs_build_without_avx2(tmp_path):
    """Built for the compiler's default x86-64 target (no AVX2, as on an older CPU, or like another ISA), the
    ladder's sources still compile: the intrinsics rung is left out, every other rung is there and right."""
    from utils import cpp

    flags = tuple(f for f in cpp.DEFAULT_FLAGS if not f.startswith("-march"))
    rms = cpp.compile_shared(bench13.CPU_SOURCES / "rms_norm.cpp", flags=flags, openmp=True)
    gemm = cpp.compile_shared(bench13.CPU_SOURCES / "gemm.cpp", flags=flags, openmp=True)
    assert [n for n, _ in bench13.built_rungs(rms, bench13.RMS_NORM_RUNGS)] == [
        "rms_norm_naive", "rms_norm_simd", "rms_norm_threads"]
    assert len(bench13.built_rungs(gemm, bench13.GEMM_RUNGS)) == len(bench13.GEMM_RUNGS)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 29, generator=g), torch.randn(29, 41, generator=g)
    for name in ("gemm_simd", "gemm_threads"):
        c = torch.full((37, 41), float("nan"))
        gemm.kernel(name, bench13.GEMM_SIGNATURE)(a, b, c, 37, 41, 29, 29, 41, 41)
        torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)
    x, w = torch.randn(5, 1003, generator=g), torch.rand(1003, generator=g) + 0.5
    y = torch.full_like(x, float("nan"))
    rms.kernel("rms_norm_threads", bench13.RMS_SIGNATURE)(x, w, y, 5, 1003, 1003, 1003, bench13.EPS)
    x64 = x.double()
    torch.testing.assert_close(y.double(), x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + bench13.EPS) * w,
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Accesses past the last row that AddressSanitizer does not see (masked loads and stores, gathers: its
# instrumentation checks ordinary loads and stores only), caught by a page that may not be touched after each buffer
# ------------------------------------------------------------------------------------------------

# The tail of each row read with _mm256_maskload_ps, but with every lane enabled: the same bytes as a plain load.
RMS_FULL_MASK_TAIL = AVX2_HEAD + """  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
    float sum = 0.0f;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8)
      for (int i = 0; i < 8; ++i) sum += xr[c + i] * xr[c + i];
    if (c < cols) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(cols - c)), lane));
      const __m256 v = _mm256_and_ps(_mm256_maskload_ps(xr + c, _mm256_set1_epi32(-1)), keep);
      float lanes[8];
      _mm256_storeu_ps(lanes, _mm256_mul_ps(v, v));
      for (int i = 0; i < 8; ++i) sum += lanes[i];
    }
    const float rstd = 1.0f / std::sqrt(sum / cols + eps);
    for (c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * w[c];
  }
}
"""
# The tail as one gather of eight consecutive floats, the lanes past the row zeroed afterwards.
RMS_GATHER_TAIL = RMS_FULL_MASK_TAIL.replace("_mm256_maskload_ps(xr + c, _mm256_set1_epi32(-1))",
                                             "_mm256_i32gather_ps(xr + c, lane, 4)")
assert RMS_GATHER_TAIL != RMS_FULL_MASK_TAIL
# GEMM's j-tail: C's and B's last partial vectors read and written with an all-enabled mask, blended.
GEMM_FULL_MASK_TAIL = """#include <algorithm>
#include <cstdint>
#include <immintrin.h>
extern "C" void gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K, int64_t lda,
                     int64_t ldb, int64_t ldc) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), all = _mm256_set1_epi32(-1);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += 32)
    for (int64_t j0 = 0; j0 < N; j0 += 64)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = k0; k < std::min(k0 + 32, K); ++k) {
          const __m256 aik = _mm256_set1_ps(a[i * lda + k]);
          const int64_t j1 = std::min(j0 + 64, N);
          int64_t j = j0;
          for (; j + 8 <= j1; j += 8)
            _mm256_storeu_ps(c + i * ldc + j, _mm256_fmadd_ps(aik, _mm256_loadu_ps(b + k * ldb + j),
                                                              _mm256_loadu_ps(c + i * ldc + j)));
          if (j < j1) {
            const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(j1 - j)), lane));
            const __m256 old = _mm256_maskload_ps(c + i * ldc + j, all);
            const __m256 sum = _mm256_fmadd_ps(aik, _mm256_maskload_ps(b + k * ldb + j, all), old);
            _mm256_maskstore_ps(c + i * ldc + j, all, _mm256_blendv_ps(old, sum, keep));
          }
        }
}
"""
PAST_LAST_ROW = "(a vector access past the row's end, masked lanes included)"


@pytest.mark.parametrize("name, source, buffer", [
    ("a full-mask maskload of the tail", RMS_FULL_MASK_TAIL, "x"),
    ("a gather of the tail", RMS_GATHER_TAIL, "x"),
])
def test_rms_norm_masked_and_gathered_reads_past_the_last_row_fault(name, source, buffer, capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, source, capsys, False)
    assert not verdict.solved, name
    assert "crashed (SIGSEGV)" in text and f"read or wrote past the end of the last row of {buffer} " \
        f"{PAST_LAST_ROW}" in text, text


def test_gemm_masked_tail_past_the_last_row_faults(capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, GEMM_FULL_MASK_TAIL, capsys, False)
    assert not verdict.solved
    assert "crashed (SIGSEGV)" in text and "read or wrote past the end of the last row of b " + PAST_LAST_ROW in text, \
        text
    # the same loop with its masks honest is right and touches nothing past a row
    honest = GEMM_FULL_MASK_TAIL.replace("_mm256_maskload_ps(c + i * ldc + j, all)", "_mm256_maskload_ps(c + i * ldc "
                                         "+ j, _mm256_castps_si256(keep))").replace(
        "_mm256_maskload_ps(b + k * ldb + j, all)", "_mm256_maskload_ps(b + k * ldb + j, _mm256_castps_si256(keep))"
    ).replace("_mm256_maskstore_ps(c + i * ldc + j, all,", "_mm256_maskstore_ps(c + i * ldc + j, "
              "_mm256_castps_si256(keep),")
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, honest, capsys, False)
    assert verdict.solved, text


@pytest.mark.parametrize("name, source, line", [
    ("_Pragma in a macro", rms_body(SUM, OUT).replace(
        "  for (int64_t r = 0; r < rows; ++r) {", '#define ROWS_IN_PARALLEL _Pragma("omp parallel for")\n'
        "  ROWS_IN_PARALLEL\n  for (int64_t r = 0; r < rows; ++r) {"), 5),
    ("a pragma spelled by a macro", "#define SPREAD parallel for\n" + rms_body(SUM, OUT).replace(
        "  for (int64_t r = 0; r < rows; ++r) {", "#pragma omp SPREAD\n  for (int64_t r = 0; r < rows; ++r) {"), 5),
])
def test_threads_hidden_behind_the_preprocessor_are_refused(name, source, line, capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, source, capsys, False)
    assert not verdict.solved, name
    assert f"line {line} uses threads" in text and "#pragma omp parallel for" in text, text


# Fast only where a property of both counted sizes holds (an odd number of columns; K of at least 128): the two
# sizes differ in each, so such a path is slow at one of them.
ODD_COLS_ONLY = rms_body(SUM, OUT).replace("#pragma omp simd reduction(+ : sum)\n    " + SUM,
                                           "if (cols & 1) {\n#pragma omp simd reduction(+ : sum)\n    " + SUM
                                           + "\n    } else {\n    " + SUM + "\n    }")
BIG_K_ONLY = BLOCKED.replace("  constexpr int64_t MC = 128, KC = 64, NC = 64;",
                             "  const int64_t MC = K >= 128 ? 128 : M, KC = K >= 128 ? 64 : K, NC = K >= 128 ? 64 : N;")
assert ODD_COLS_ONLY.count("sum +=") == 2 and BIG_K_ONLY != BLOCKED


@needs_valgrind
def test_rms_norm_fast_for_odd_columns_only_is_too_slow(capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, ODD_COLS_ONLY, capsys)
    assert not verdict.solved and "too slow" in text
    assert "within it at 64 × 1003: a path fast at one size only" in text, text


@needs_valgrind
def test_gemm_blocked_for_big_k_only_has_too_many_misses(capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, BIG_K_ONLY, capsys)
    assert not verdict.solved and "too many cache misses" in text
    assert "within it at M, N, K = 144, 144, 144" in text, text


# Four vectorized passes over each row, y used as scratch: slow at both sizes alike, and with no mask or blend in it.
FOUR_PASSES = RMS_HEAD + """  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row_stride;
    float* yr = y + r * y_row_stride;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * xr[c];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) sum += yr[c];
    const float rstd = 1.0f / std::sqrt(sum / cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = yr[c] * w[c];
  }
}
"""


@needs_valgrind
def test_rms_norm_slow_at_both_sizes_is_not_called_one_size_nor_blamed_on_masks(capsys):
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, FOUR_PASSES, capsys)
    assert not verdict.solved and "too slow" in text and "where they go at" in text, text
    assert "one size only" not in text and "mask" not in text and "blend" not in text, text


@pytest.mark.parametrize("check, source, expected, absent", [
    # x[0] read before the row loop, also when there are no rows: once worded "past the end of row -1 of x"
    (cpp_kernel.check_rms_norm_simd, rms_body(SUM, OUT).replace(
        "  for (int64_t r = 0; r < rows; ++r) {",
        "  volatile float first = x[0];\n  for (int64_t r = 0; r < rows; ++r) {"),
     ["case 7 of 9", "of x, which has no elements here (0 rows × 8 columns)", "before any row exists"], ["row -1"]),
    # C cleared with one memset of M × ldc floats: past the last row's end (a 9800-byte access once called "a full
    # vector")
    (cpp_kernel.check_gemm_blocked, "#include <cstring>\n" + BLOCKED.replace(
        ZEROING, "  if (M > 0) std::memset(c, 0, sizeof(float) * M * ldc);"),
     ["case 4 of 9", "one access of 9800 bytes", "a bulk write", "the wrong length",
      "the farthest 2): a loop or a bulk write (memset"],
     ["unknown-crash) — a full vector"]),
])
def test_stray_accesses_are_worded_by_what_they_are(check, source, expected, absent, capsys):
    if cpp.asan_runtime() is None:
        pytest.skip("this g++ cannot build with AddressSanitizer")
    verdict, text = verdict_of(check, source, capsys, False)
    assert not verdict.solved
    for fragment in expected:
        assert fragment in text, (fragment, text)
    for fragment in absent:
        assert fragment not in text, (fragment, text)
