"""utils.cpp (g++ into cached libraries, tensor calls, the vectorizer's report, native harnesses) and utils.valgrind
(callgrind, cachegrind, folded stacks)."""

from __future__ import annotations

import concurrent.futures
import shutil
import textwrap

import pytest
import torch

from utils import cpp, valgrind

pytestmark = pytest.mark.skipif(not cpp.compiler_available(), reason="g++ is not installed")
needs_valgrind = pytest.mark.skipif(not valgrind.available(), reason="valgrind is not installed")

SCALE = r"""#include <cstdint>
extern "C" void scale_rows(const float* x, float* y, int64_t rows, int64_t cols, int64_t x_stride, float s) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = s * x[r * x_stride + c];
}
"""

# Two functions: `work` does a known amount of work and calls `helper` (never inlined) for a known share.
CALL_GRAPH = r"""#include <cstdint>
extern "C" __attribute__((noinline)) float helper(const float* x, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i] * 0.5f;
  return s;
}
extern "C" void work(const float* x, float* y, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  y[0] = s + helper(x, n);
}
"""

# The same number of loads, sequential or one per 64-byte line.
STRIDED = r"""#include <cstdint>
extern "C" void walk(const float* x, float* y, int64_t n, int64_t stride) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i * stride];
  y[0] = s;
}
"""


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cpp.CACHE_ENV, str(tmp_path / "cpp"))
    return tmp_path / "cpp"


def test_compile_call_and_cache(fresh_cache):
    library = cpp.compile_shared(SCALE)
    assert library.path.parent == fresh_cache and library.path.exists()
    again = cpp.compile_shared(SCALE)
    assert again.path == library.path  # the content hash: built once
    assert cpp.compile_shared(SCALE, flags=(*cpp.DEFAULT_FLAGS, "-DSOMETHING")).path != library.path
    kernel = library.kernel("scale_rows", ["const float*", "float*", "int64_t", "int64_t", "int64_t", "float"])
    x = torch.randn(5, 9)[:, :7]  # rows padded: stride 9
    y = torch.full((5, 7), float("nan"))
    kernel(x, y, 5, 7, x.stride(0), 3.0)
    torch.testing.assert_close(y, 3.0 * x)


def test_parallel_builds_of_one_source_end_with_one_whole_library(fresh_cache):
    source = SCALE + "\n// built by two threads at once\n"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: cpp.compile_shared(source).path, range(4)))
    assert len(set(paths)) == 1
    assert [p.name for p in fresh_cache.iterdir() if p.name.startswith("build-")] == []  # no partial left
    y = torch.zeros(1, 1)
    cpp.compile_shared(source).kernel("scale_rows", ["const float*", "float*", "int64_t", "int64_t", "int64_t",
                                                     "float"])(torch.ones(1, 1), y, 1, 1, 1, 2.0)
    assert y.item() == 2.0


def test_compile_error_keeps_the_first_lines_and_the_source_lines(fresh_cache):
    source = "#include <cstdint>\n\nextern \"C\" void f(float* y) {\n  y[0] = undefined_name;\n}\n"
    with pytest.raises(cpp.CompileError) as caught:
        cpp.compile_shared(source)
    error = caught.value
    assert error.error_lines == [4]
    assert any("source.cpp:4" in line and "undefined_name" in line for line in error.lines)
    assert str(fresh_cache) not in "\n".join(error.lines)  # the temporary path is not shown


def test_kernel_checks_what_it_passes():
    library = cpp.compile_shared(SCALE)
    kernel = library.kernel("scale_rows", ["const float*", "float*", "int64_t", "int64_t", "int64_t", "float"])
    x, y = torch.randn(2, 3), torch.empty(2, 3)
    with pytest.raises(TypeError, match=r"argument 1 .*expected dtype torch.float32, got torch.float64"):
        kernel(x.double(), y, 2, 3, 3, 1.0)
    with pytest.raises(ValueError, match=r"argument 2 .*last dimension dense"):
        kernel(x, torch.empty(3, 2).t(), 2, 3, 3, 1.0)
    with pytest.raises(TypeError, match=r"takes 6 arguments"):
        kernel(x, y, 2, 3)
    with pytest.raises(TypeError, match=r"argument 3 .*expected an int"):
        kernel(x, y, 2.0, 3, 3, 1.0)
    with pytest.raises(TypeError, match=r"argument 2 .*expected a torch.Tensor"):
        kernel(x, [0.0] * 6, 2, 3, 3, 1.0)
    with pytest.raises(ValueError, match=r"exports no function 'scale'.*extern \"C\""):
        library.kernel("scale", ["float*"])
    with pytest.raises(ValueError, match=r"argument type 'float&'"):
        library.kernel("scale_rows", ["float&"])


def test_vectorization_report_says_which_loops_and_why():
    source = textwrap.dedent("""\
        #include <cstdint>
        extern "C" void f(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
          for (int64_t i = 0; i < n; ++i) y[i] = 2.0f * x[i];
          for (int64_t i = 1; i < n; ++i) y[i] = y[i - 1] * 0.5f + x[i];
        }
        """)
    notes = {note.line: note for note in cpp.vectorization_report(source)}
    assert notes[3].loop_vectorized and "32 byte vectors" in notes[3].why
    assert not notes[4].loop_vectorized and notes[4].why  # a loop-carried dependence: GCC says why


@needs_valgrind
def test_callgrind_counts_are_exact_and_scale_with_the_calls():
    args = [cpp.buffer("const float*", 4000), cpp.buffer("float*", 1, "zeros"), cpp.scalar("int64_t", 4000)]
    once = valgrind.callgrind(cpp.harness(CALL_GRAPH, "work", args))
    thrice = valgrind.callgrind(cpp.harness(CALL_GRAPH, "work", args, calls=3))
    assert once.of("work") == valgrind.callgrind(cpp.harness(CALL_GRAPH, "work", args)).of("work")  # deterministic
    assert thrice.of("work") == 3 * once.of("work")
    assert once.of("work") == once.self_ir["work"] + once.calls[("work", "helper")]
    assert once.calls[("work", "helper")] == once.of("helper") > 4000  # one pass over 4000 floats
    assert once.stdout.startswith("checksum ")
    assert once.files["work"].endswith(cpp.HARNESS_SOURCE)


# Two loops on known lines, one of them AVX2 intrinsics (inlined from immintrin.h's headers), one touching a new
# cache line per iteration.
LINES = r"""#include <cstdint>
#include <immintrin.h>
extern "C" void lines(const float* x, float* y, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
  float s = 0.0f;
  for (int64_t i = 0; i < n; i += 16) s += x[i];
  float out[8];
  _mm256_storeu_ps(out, acc);
  y[0] = s + out[0];
}
"""


@needs_valgrind
@pytest.mark.skipif(not cpp.X86_64_V3, reason="the source is AVX2 intrinsics")
def test_line_profile_charges_inlined_intrinsics_to_the_line_that_calls_them():
    exe = cpp.harness(LINES, "lines", [cpp.buffer("const float*", 16000), cpp.buffer("float*", 1, "zeros"),
                                       cpp.scalar("int64_t", 16000)])
    profile = valgrind.line_profile(exe, cpp.HARNESS_SOURCE)
    assert set(profile) <= set(range(1, len(LINES.splitlines()) + 1))  # no header's line numbers
    assert profile[5]["Ir"] > 3 * 2000 and profile[7]["Ir"] > 3 * 1000  # 2000 vectors, 1000 strided loads
    assert sum(v["Ir"] for v in profile.values()) == valgrind.callgrind(exe).of("lines")
    misses = valgrind.line_profile(exe, cpp.HARNESS_SOURCE, cache=True)
    # one miss per 64-byte line of x in each loop (64 KB: the first loop's lines are gone from the 32 KB L1 when
    # the second starts), 2000 loads and 1000 loads for them
    assert misses[5]["D1mr"] == pytest.approx(1000, abs=20) and misses[5]["Dr"] == 2000
    assert misses[7]["D1mr"] == pytest.approx(1000, abs=20) and misses[7]["Dr"] == 1000


@needs_valgrind
def test_folded_stacks_share_inclusive_instructions_along_the_call_graph(tmp_path):
    args = [cpp.buffer("const float*", 4000), cpp.buffer("float*", 1, "zeros"), cpp.scalar("int64_t", 4000)]
    counts = valgrind.callgrind(cpp.harness(CALL_GRAPH, "work", args), keep=tmp_path / "callgrind.out")
    stacks = valgrind.folded_stacks(tmp_path / "callgrind.out")
    assert stacks[("main", "work", "helper")] == pytest.approx(counts.of("helper"), abs=1)
    assert stacks[("main", "work")] == pytest.approx(counts.self_ir["work"], abs=1)
    assert sum(stacks.values()) == pytest.approx(counts.of("main"), abs=len(stacks))  # rounded per stack
    own = valgrind.folded_stacks(counts, root="work")
    assert own == {("work",): pytest.approx(counts.self_ir["work"], abs=1),
                   ("work", "helper"): pytest.approx(counts.of("helper"), abs=1)}
    ax = valgrind.plot_flame(counts, root="work")
    assert ax.get_xlabel().startswith("instructions (callgrind)")


def test_parse_callgrind_with_compressed_names():
    text = textwrap.dedent("""\
        events: Ir
        fl=(1) a.cpp
        fn=(1) main
        3 10
        cfl=(1)
        cfn=(2) kernel
        calls=2 5
        4 100
        fn=(2)
        5 60
        cfn=(3) leaf
        calls=1 1
        6 40
        fl=(2) b.cpp
        fn=(3)
        1 40
        totals: 150
        """)
    counts = valgrind.parse_callgrind(text)
    assert counts.total == 150
    assert counts.self_ir == {"main": 10, "kernel": 60, "leaf": 40}
    assert counts.inclusive == {"main": 110, "kernel": 100, "leaf": 40}
    assert counts.files == {"main": "a.cpp", "kernel": "a.cpp", "leaf": "b.cpp"}
    assert valgrind.folded_stacks(counts) == {("main",): 10, ("main", "kernel"): 60, ("main", "kernel", "leaf"): 40}


@needs_valgrind
def test_cachegrind_counts_misses_of_the_simulated_cache():
    n = 32768  # 128 KiB read sequentially: more than the simulated L1 holds, so main's fill leaves it out

    def misses(stride: int) -> int:
        exe = cpp.harness(STRIDED, "walk", [cpp.buffer("const float*", n * stride), cpp.buffer("float*", 1, "zeros"),
                                            cpp.scalar("int64_t", n), cpp.scalar("int64_t", stride)])
        counts = valgrind.cachegrind(exe)
        assert counts.caches["D1"] == valgrind.DEFAULT_CACHE["D1"] and "32 KiB 8-way" in counts.describe()
        assert counts.of("walk", "Dr") >= n
        return counts.of("walk", "D1mr")

    sequential, strided = misses(1), misses(16)  # 16 floats: one load per 64-byte line
    assert sequential == pytest.approx(n / 16, rel=0.1)
    assert strided == pytest.approx(n, rel=0.05)
    # A smaller simulated cache is asked for explicitly, and said.
    exe = cpp.harness(STRIDED, "walk", [cpp.buffer("const float*", n), cpp.buffer("float*", 1, "zeros"),
                                        cpp.scalar("int64_t", n), cpp.scalar("int64_t", 1)])
    small = valgrind.cachegrind(exe, d1=valgrind.CacheConfig(4096, 2))
    assert "D1 4 KiB 2-way" in small.describe()


@needs_valgrind
def test_counts_do_not_depend_on_the_callers_environment(monkeypatch, tmp_path):
    # The environment's size moves the program's stack, and with it which cache sets its stack lines take:
    # a notebook's solution-mode and learner-mode runs (different variables) must count the same misses.
    n = 144
    exe = cpp.harness(NAIVE_GEMM, "gemm", [cpp.buffer("const float*", n * n), cpp.buffer("const float*", n * n),
                                          cpp.buffer("float*", n * n, "zeros"), cpp.scalar("int64_t", n)])
    counts = set()
    for padding in (0, 100, 700, 1500, 2900):  # the stack moved by up to most of a 4 KiB page
        monkeypatch.setenv("KERNEL_LADDER_TEST_PADDING", "x" * padding)
        measured = valgrind.cachegrind(exe)
        counts.add((measured.of("gemm", "D1mr"), measured.of("gemm", "Ir")))
    assert len(counts) == 1, f"D1 read misses and instructions moved with the environment: {sorted(counts)}"
    for folder in (tmp_path, tmp_path / "a-much-longer-working-directory-name" / "and-deeper"):  # nor the caller's cwd
        folder.mkdir(parents=True, exist_ok=True)
        monkeypatch.chdir(folder)
        measured = valgrind.cachegrind(exe)
        counts.add((measured.of("gemm", "D1mr"), measured.of("gemm", "Ir")))
    assert len(counts) == 1, f"D1 read misses moved with the working directory: {sorted(counts)}"
    assert valgrind.callgrind(exe).of("gemm") == valgrind.callgrind(exe, env={"UNUSED": "1"}).of("gemm")


@needs_valgrind
def test_counts_do_not_depend_on_where_the_program_lies(tmp_path):
    # The program's path is on its stack too: the same binary in a short and a long folder (another user's home,
    # another checkout) must count the same misses.
    import shutil

    n = 144
    exe = cpp.harness(NAIVE_GEMM, "gemm", [cpp.buffer("const float*", n * n), cpp.buffer("const float*", n * n),
                                          cpp.buffer("float*", n * n, "zeros"), cpp.scalar("int64_t", n)])
    counts = set()
    for length in range(1, 300, 37):  # under the old way (the full path as argv[0]), 75 and 223 moved the misses
        folder = tmp_path / f"{length:03d}" / ("d" * min(length, 200)) / ("e" * max(1, length - 200))
        folder.mkdir(parents=True)
        copy = folder / "harness"
        shutil.copy2(exe, copy)
        measured = valgrind.cachegrind(copy)
        counts.add((measured.of("gemm", "D1mr"), measured.of("gemm", "Ir")))
    assert len(counts) == 1, f"D1 read misses moved with the program's path: {sorted(counts)}"


NAIVE_GEMM = r"""#include <cstdint>
extern "C" void gemm(const float* a, const float* b, float* c, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < n; ++k) sum += a[i * n + k] * b[k * n + j];
      c[i * n + j] = sum;
    }
}
"""


def test_valgrind_missing_is_said(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not valgrind.available()
    with pytest.raises(valgrind.ValgrindMissing, match="valgrind is not installed"):
        valgrind.callgrind("/bin/true")


@needs_valgrind
def test_inside_counts_what_a_function_runs_wherever_its_code_came_from(tmp_path):
    # A kernel whose loop is a function of an #included file (as a chapter rung wrapped under the exercise's name
    # is): a count by the source file charges its misses to that file and sees nothing; inside() sees them all.
    helper = tmp_path / "helper.h"
    helper.write_text("#include <cstdint>\n"
                      "__attribute__((noinline)) void sum_rows(const float* a, float* out, int64_t n) {\n"
                      "  for (int64_t i = 0; i < n; ++i) out[i % 7] += a[i * 16];\n}\n")
    source = f'#include "{helper}"\nextern "C" void gemm(const float* a, const float* b, float* c, int64_t n) ' \
             "{ sum_rows(a, c, n * n / 16); (void)b; }\n"
    n = 144
    exe = cpp.harness(source, "gemm", [cpp.buffer("const float*", n * n), cpp.buffer("const float*", n * n),
                                      cpp.buffer("float*", n * n, "zeros"), cpp.scalar("int64_t", n)])
    by_file = valgrind.cachegrind(exe).in_file(cpp.HARNESS_SOURCE, "D1mr")
    counted = valgrind.inside(exe, "gemm")
    assert by_file < 10 and counted["D1mr"] > 1000  # one miss per 64-byte stride, seen only inside()
    assert counted["Ir"] == valgrind.callgrind(exe).of("gemm")
