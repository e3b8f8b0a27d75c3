"""Chapter 13's CPU ladder: every rung right on awkward sizes, the report's timings and counts, and exercises 1
and 2 — their solutions solved, and wrong answers (the stubs, naive loops, a skipped tail, a write past the end,
a stride mixed up, an unblocked loop, a crash...) each NOT SOLVED with the right diagnosis."""

from __future__ import annotations

from pathlib import Path

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
    assert "✅ SOLVED" in text and "instructions per element, within 2.2" in text and "naive scalar loop" in text


@pytest.mark.parametrize("name, source, expected", [
    ("stub", cpp_kernel.RMS_NORM_SIMD_STUB, ["never written (still the poison NaN)", "the stub"]),
    ("tail skipped", rms_body(SUM.replace("c < cols", "c < cols - cols % 8"),
                              OUT.replace("c < cols", "c < cols - cols % 8")),
     ["case 2 of 8", "cols=1003", "the last 3 columns of every row, 1003 % 8 = 3: the tail",
      "cause: the sum of squares leaves out the tail"]),
    ("one past the end", rms_body(SUM, OUT.replace("c < cols", "c <= cols")),
     ["past the end of y", "the first 1 past its last element"]),
    ("x stride ignored", rms_body(SUM, OUT, x_stride="cols"),
     ["case 4 of 8", "x_row_stride=133", "row 0 is right, later rows are wrong", "x + r * x_row_stride"]),
    ("y stride ignored", rms_body(SUM, OUT).replace("y + r * y_row_stride", "y + r * cols"),
     ["case 4 of 8", "never written"]),
    ("eps outside", rms_body(SUM, OUT).replace("std::sqrt(sum / cols + eps)", "(std::sqrt(sum / cols) + eps)"),
     ["case 8 of 8", "eps is added after the square root"]),
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
    assert "the solution executes" in text and "omp simd reduction" in text


def test_rms_norm_compile_error_crash_and_missing_name(capsys):
    broken = rms_body(SUM.replace("xr[c] * xr[c]", "xr[c] * xq[c]"), OUT)  # line 9: a name never declared
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, broken, capsys)
    assert not verdict.solved and "does not compile (line(s) 9 of the source string)" in text
    assert "source.cpp:9" in text and "xq" in text
    crash = rms_body(SUM, OUT.replace("yr[c] =", "yr[c - (int64_t(1) << 40)] ="))
    verdict, text = verdict_of(cpp_kernel.check_rms_norm_simd, crash, capsys)
    assert not verdict.solved and "case 1 of 8" in text and "crashed (SIGSEGV)" in text
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
    assert "D1 read misses per 1000 multiply-adds, within 20" in text and "32 KiB 8-way" in text
    assert "the unblocked ikj loop" in text


BLOCKED = solutions13.GEMM_BLOCKED
ZEROING = "  for (int64_t i = 0; i < M; ++i)\n    for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = 0.0f;"
assert ZEROING in BLOCKED


@pytest.mark.parametrize("name, source, expected", [
    ("stub", cpp_kernel.GEMM_BLOCKED_STUB, ["case 1 of 8", "never written", "the stub?"]),
    ("k tail dropped", BLOCKED.replace("k0 < K; k0 += KC", "k0 + KC <= K; k0 += KC"),
     ["case 2 of 8", "K=29", "cause: the last 29 of the K = 29 products of each element are missing"]),
    ("ldb mixed up with N", BLOCKED.replace("b[k * ldb + j]", "b[k * N + j]"),
     ["case 4 of 8", "ldb=40", "NaN computed where the inputs have none", "a leading dimension mixed up"]),
    ("one past the end", BLOCKED.replace("j < N; ++j) c[i * ldc + j] = 0.0f", "j <= N; ++j) c[i * ldc + j] = 0.0f"),
     ["past the end of c", "the first 1 past its last element"]),
    ("C not zeroed", BLOCKED.replace("c[i * ldc + j] = 0.0f;", ";"), ["never written", "without being set to zero"]),
    ("C not zeroed when K = 0", BLOCKED.replace(ZEROING, "  if (K > 0)\n" + ZEROING),
     ["case 7 of 8", "K=0", "with K = 0, C is all zeros"]),
])
def test_gemm_wrong_answers_are_not_solved_with_their_diagnosis(name, source, expected, capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, source, capsys)
    assert not verdict.solved and "❌ NOT SOLVED — ch13_below_triton.GEMM_BLOCKED" in text, name
    for fragment in expected:
        assert fragment in text, (name, fragment, verdict.message)


@needs_valgrind
@pytest.mark.parametrize("source", [cpp_kernel.GEMM_IKJ, cpp_kernel.GEMM_NAIVE], ids=["unblocked ikj", "naive ijk"])
def test_gemm_unblocked_loops_take_too_many_misses(source, capsys):
    verdict, text = verdict_of(cpp_kernel.check_gemm_blocked, source, capsys)
    assert not verdict.solved
    assert "the values are right on every case" in text and "too many cache misses" in text and "at most 20" in text
    assert "the solution takes" in text


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
