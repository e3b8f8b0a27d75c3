"""Chapter 13's CUDA exercise 3 (``rms_norm_warp``): the solution passes the checker, run thread by thread on the
CPU by the SIMT emulator and read as sm_90 SASS; plausible wrong kernels do not, each with its diagnosis.

The wrong kernels are the solution with one mistake each (a string replacement, so that each differs from the
solution by exactly what it gets wrong).
"""

from __future__ import annotations

import pytest

from solutions.ch13_below_triton import RMS_NORM_WARP
from utils import exercises
from utils.exercises import cuda_kernel
from utils.exercises.cuda_kernel import RMS_NORM_WARP_STUB, check_rms_norm_warp
from utils.nvcc import find_nvcc

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="no nvcc: the sm_90 SASS cannot be read")


def rejected(verdict, diagnosis: str) -> bool:
    """NOT SOLVED, saying ``diagnosis`` (the verdict's lines are wrapped: compared with single spaces)."""
    return not verdict.solved and diagnosis in " ".join(verdict.message.split())


def variant(old: str, new: str) -> str:
    assert old in RMS_NORM_WARP, old
    return RMS_NORM_WARP.replace(old, new)


SUM_LOOP = """  for (long long i = lane; i < vectors; i += 32) {
    const float4 v = xv[i];
    sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
"""
TAIL_SUM = "  for (long long c = 4 * vectors + lane; c < cols; c += 32) sum += xr[c] * xr[c];\n"
REDUCTION = "  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);\n"
STORE_LOOP = """  for (long long i = lane; i < vectors; i += 32) {
    const float4 v = xv[i], g = wv[i];
    yv[i] = make_float4(v.x * rstd * g.x, v.y * rstd * g.y, v.z * rstd * g.z, v.w * rstd * g.w);
  }
"""
TAIL_STORE = "  for (long long c = 4 * vectors + lane; c < cols; c += 32) yr[c] = xr[c] * rstd * w[c];\n"

#: Right values, scalar loads: every column one by one (the emulator counts no float4 read of x or w).
SCALAR_LOADS = variant(SUM_LOOP, "").replace(STORE_LOOP, "").replace("4 * vectors + lane", "lane")

#: Right values, the reduction through shared memory with block barriers (the emulator counts no shuffle).
SHARED_REDUCTION = variant(
    "#pragma unroll\n" + REDUCTION,
    """  __shared__ float partial[32][32];
  const int warp = threadIdx.x / 32;
  partial[warp][lane] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int i = 0; i < 32; ++i) sum += partial[warp][i];
  __syncthreads();
""",
)

NO_TAIL = variant(TAIL_SUM, "").replace(TAIL_STORE, "")

BARRIER_IN_THE_TAIL = variant(
    TAIL_SUM,
    """  for (long long c = 4 * vectors + lane; c < cols; c += 32) {
    sum += xr[c] * xr[c];
    __syncthreads();
  }
""",
)

#: __shfl_down_sync leaves the total in lane 0 only; every lane then scales by its own partial sum.
DOWN_WITHOUT_BROADCAST = variant(REDUCTION, REDUCTION.replace("__shfl_xor_sync", "__shfl_down_sync"))

#: The xor offsets stop at 2: lanes 2k and 2k+1 never add each other's sums.
OFFSETS_STOP_AT_TWO = variant("offset > 0", "offset > 1")

#: float4s rounded up, no tail: the last float4 of a row reads and writes past it.
PAST_THE_ROW = variant("const long long vectors = cols / 4;", "const long long vectors = (cols + 3) / 4;")

#: The row stride taken as cols: rows of a padded tensor land on unaligned addresses.
STRIDE_AS_COLS = variant("x + row * row_stride", "x + row * cols")

#: Every warp of a block takes the same row.
SAME_ROW_PER_BLOCK = variant(
    "(long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32", "(long long)blockIdx.x * (blockDim.x / 32)"
)

NO_EPS = variant("sum / (float)cols + eps", "sum / (float)cols")

#: Four warps per block assumed: right for every launch of 4 warps, wrong from the second block of 8 warps on.
FOUR_WARPS_PER_BLOCK = variant(
    "(long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32", "(long long)blockIdx.x * 4 + threadIdx.x / 32"
)

#: A NaN guard: the row holding a NaN comes out 0 where it must be NaN; every other row is right.
NAN_GUARD = variant(
    "const float rstd = rsqrtf(sum / (float)cols + eps);",
    "float rstd = rsqrtf(sum / (float)cols + eps);\n  if (rstd != rstd) rstd = 0.0f;",
)

#: The tail of y written as one float4 read, changed and written back: the padding keeps its bytes (no canary can
#: see it), but the kernel touched memory that is not y's view.
TAIL_FLOAT4_WRITE_BACK = variant(
    TAIL_STORE,
    """  if (lane == 0 && cols % 4) {
    float4 last = yv[vectors];
    last.x = xr[4 * vectors] * rstd * w[4 * vectors];
    if (cols % 4 > 1) last.y = xr[4 * vectors + 1] * rstd * w[4 * vectors + 1];
    if (cols % 4 > 2) last.z = xr[4 * vectors + 2] * rstd * w[4 * vectors + 2];
    yv[vectors] = last;
  }
""",
)

#: The tail of x summed from one float4 that runs past the row (only the row's columns added: right values).
TAIL_FLOAT4_OVER_READ = variant(
    TAIL_SUM,
    """  if (lane == 0 && cols % 4) {
    const float4 v = xv[vectors];
    sum += v.x * v.x + (cols % 4 > 1 ? v.y * v.y : 0.0f) + (cols % 4 > 2 ? v.z * v.z : 0.0f);
  }
""",
)

#: A barrier only lane 0 of each warp reaches: the other lanes run past it and return.
BARRIER_FOR_LANE_0 = variant(REDUCTION, REDUCTION + "  if (lane == 0) __syncthreads();\n")


#: A block barrier every thread reaches (before any returns): right, and no use in a kernel where a warp owns a row.
BARRIER_FOR_ALL = variant("  if (row >= rows) return;", "  __syncthreads();\n  if (row >= rows) return;")

#: x read one float at a time (the sum and the output), w still as float4: nvcc's SASS holds LDG.E.128 (w's).
X_SCALAR = (
    variant(SUM_LOOP, "")
    .replace("4 * vectors + lane; c < cols; c += 32) sum", "lane; c < cols; c += 32) sum")
    .replace("const float4 v = xv[i], g = wv[i];", "const float4 g = wv[i];")
    .replace("v.x * rstd", "xr[4 * i] * rstd")
    .replace("v.y * rstd", "xr[4 * i + 1] * rstd")
    .replace("v.z * rstd", "xr[4 * i + 2] * rstd")
    .replace("v.w * rstd", "xr[4 * i + 3] * rstd")
)

#: w read one float at a time, x as float4.
W_SCALAR = variant("const float4 v = xv[i], g = wv[i];", "const float4 v = xv[i];").replace(
    "rstd * g.x, v.y * rstd * g.y, v.z * rstd * g.z, v.w * rstd * g.w",
    "rstd * w[4 * i], v.y * rstd * w[4 * i + 1], v.z * rstd * w[4 * i + 2], v.w * rstd * w[4 * i + 3]",
)

#: Each lane sums the whole row itself; the float4 load and the shuffles sit on a path never taken (their SASS
#: is there all the same).
NO_REDUCTION_DEAD_SHUFFLES = variant(
    SUM_LOOP + TAIL_SUM + "#pragma unroll\n" + REDUCTION,
    """  for (long long c = 0; c < cols; ++c) sum += xr[c] * xr[c];
  if (cols < 0) {
    const float4 v = xv[lane];
    sum += v.x + v.y + v.z + v.w;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
""",
)

#: eps added only to rows with a tail.
EPS_ONLY_WITH_A_TAIL = variant("sum / (float)cols + eps", "sum / (float)cols + (cols % 4 ? eps : 0.0f)")

#: The sum left uninitialized in every lane but lane 0.
UNINITIALIZED_SUM = variant("float sum = 0.0f;", "float sum;\n  if (lane == 0) sum = 0.0f;")

EPS_INSIDE_THE_DIVISION = variant("sum / (float)cols + eps", "(sum + eps) / (float)cols")

MEAN_OVER_ROW_STRIDE = variant("sum / (float)cols + eps", "sum / (float)row_stride + eps")

#: The row whose rstd is NaN is not written at all.
SKIP_NAN_ROWS = variant(
    "  const float4* wv = reinterpret_cast<const float4*>(w);",
    "  if (rstd != rstd) return;\n  const float4* wv = reinterpret_cast<const float4*>(w);",
)


@needs_nvcc
def test_the_solution_is_solved_and_its_sass_named():
    verdict = check_rms_norm_warp(RMS_NORM_WARP)
    assert verdict.solved, verdict.message
    assert "LDG.E.128" in verdict.message and "SHFL.BFLY ×5" in verdict.message and "no spills" in verdict.message
    assert exercises._LAST_VERDICTS[cuda_kernel.RMS_WARP_NAME] is True


def test_without_nvcc_the_values_alone_are_checked_and_that_is_said(monkeypatch):
    from utils import nvcc

    monkeypatch.setattr(nvcc, "find_nvcc", lambda: None)
    verdict = check_rms_norm_warp(RMS_NORM_WARP)
    assert verdict.solved and "the sm_90 SASS was not read: no nvcc here" in verdict.message


@pytest.mark.parametrize(
    "source,diagnosis",
    [
        (RMS_NORM_WARP_STUB, "256 of 256 elements never written (still the poison NaN): rows 0–3, columns 0–63"),
        (NO_TAIL, "cause: the scalar tail is missing: the last cols % 4 = 1 column(s) of each row are no float4"),
        (BARRIER_IN_THE_TAIL, "cause: a __syncthreads() that not every thread of the block reaches"),
        (DOWN_WITHOUT_BROADCAST, "cause: lane 0's columns are right, the other lanes' wrong: only lane 0 holds"),
        (OFFSETS_STOP_AT_TWO, "cause: the lanes of a row disagree on its factor"),
        (PAST_THE_ROW, "wrote outside y: 3 past its last element (element offsets 1, 2, 3) — a row is 1 long"),
        (STRIDE_AS_COLS, "misaligned: kernel.cu:"),
        (SAME_ROW_PER_BLOCK, "cause: only the first row of each block of 4 rows is written"),
        (NO_EPS, "cause: eps is missing"),
        (FOUR_WARPS_PER_BLOCK, "row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32"),
        (NAN_GUARD, "cause: only row 2, the row holding a NaN, is wrong"),
        (BARRIER_FOR_LANE_0, "cause: a __syncthreads() that some lanes of a warp skip"),
        (
            TAIL_FLOAT4_WRITE_BACK,
            "y: read 12 bytes past the end of row 0 (the last row), outside the tensor — a 16-byte read",
        ),
        (
            TAIL_FLOAT4_OVER_READ,
            "x: read 12 bytes past the end of row 0 (the last row), outside the tensor — a 16-byte read",
        ),
        (SCALAR_LOADS, "x is read 4 bytes at a time: 0 float4 read(s) of x ran"),
        (SHARED_REDUCTION, "the lanes of a row do not reduce with warp shuffles: 0 thread(s) executed 5 or more"),
        (X_SCALAR, "x is read 4 bytes at a time: 0 float4 read(s) of x ran, while its 4 row(s) hold 64 whole"),
        (W_SCALAR, "w is read 4 bytes at a time: 0 float4 read(s) of w ran, while w holds 16 whole float4s"),
        (NO_REDUCTION_DEAD_SHUFFLES, "the lanes of a row do not reduce with warp shuffles: 0 thread(s) executed"),
        (EPS_ONLY_WITH_A_TAIL, "cause: eps is missing"),
        (UNINITIALIZED_SUM, "or a local variable used before every lane set it"),
        (EPS_INSIDE_THE_DIVISION, "cause: eps is added before the division by cols ((sum + eps) / cols)"),
        (MEAN_OVER_ROW_STRIDE, "cause: the sum of squares is divided by row_stride (4), not by cols (1)"),
        (SKIP_NAN_ROWS, "cause: the NaN row was skipped: row 2, the row holding a NaN, is the only one left"),
    ],
    ids=[
        "stub",
        "no-tail",
        "barrier-in-tail",
        "down-no-broadcast",
        "offsets-stop-at-2",
        "past-the-row",
        "stride-as-cols",
        "same-row-per-block",
        "no-eps",
        "four-warps-per-block",
        "nan-guard",
        "barrier-for-lane-0",
        "tail-float4-write-back",
        "tail-float4-over-read",
        "scalar-loads",
        "shared-reduction",
        "x-scalar",
        "w-scalar",
        "no-reduction-dead-shuffles",
        "eps-only-with-a-tail",
        "uninitialized-sum",
        "eps-inside-the-division",
        "mean-over-row-stride",
        "skip-nan-rows",
    ],
)
def test_wrong_kernels_are_not_solved_with_their_diagnosis(source, diagnosis):
    verdict = check_rms_norm_warp(source, sass=False)
    assert rejected(verdict, diagnosis), verdict.message
    assert exercises._LAST_VERDICTS[cuda_kernel.RMS_WARP_NAME] is False


@needs_nvcc
def test_right_values_and_runs_with_sass_that_breaks_the_spec_are_not_solved():
    # Values right, shuffles and float4 reads run: the emulator passes it, the sm_90 build's barrier is what fails.
    assert check_rms_norm_warp(BARRIER_FOR_ALL, sass=False).solved
    verdict = check_rms_norm_warp(BARRIER_FOR_ALL)
    assert rejected(verdict, "the values are right on every case; the sm_90 build is not")
    assert rejected(verdict, "shared memory or a block barrier in the sm_90 SASS (BAR.SYNC"), verdict.message


def test_a_nan_guard_is_named_by_its_row_not_by_the_row_stride():
    verdict = check_rms_norm_warp(NAN_GUARD, sass=False)
    after_the_case_line = verdict.message.split("of x holds a NaN", 1)[1]
    assert not verdict.solved and "padded" not in verdict.message and "row_stride" not in after_the_case_line


def test_the_checks_launches_include_two_blocks_of_8_warps():
    assert any(warps == 8 and rows > 8 for rows, _, _, _, warps, _ in cuda_kernel.CASES)


def test_a_compile_error_is_named_by_its_line():
    verdict = check_rms_norm_warp(variant("const int lane = threadIdx.x % 32;", "const int lane = threadIdx.x % 32"))
    assert rejected(verdict, "does not compile (line(s) 6, 7, 8 of the source string): g++ says")
    assert rejected(verdict, "kernel.cu:6: expected ‘,’ or ‘;’ before ‘const’")


def test_a_source_that_is_not_a_string_is_not_solved():
    assert rejected(check_rms_norm_warp(None), "expected the CUDA source as a string, got NoneType")


def test_a_skipped_nan_row_is_not_blamed_on_the_warps_per_block():
    verdict = check_rms_norm_warp(SKIP_NAN_ROWS, sass=False)
    assert not verdict.solved and "warps per block" not in verdict.message.split("holds a NaN", 1)[1]


def test_a_wrong_divisor_is_not_blamed_on_the_reduction():
    for source in (EPS_INSIDE_THE_DIVISION, MEAN_OVER_ROW_STRIDE):
        verdict = check_rms_norm_warp(source, sass=False)
        assert not verdict.solved and "partial sums of all 32 lanes" not in verdict.message, verdict.message
