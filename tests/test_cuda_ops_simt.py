"""The native extension's CUDA RMSNorm and softmax kernels, run thread by thread on the CPU by ``utils.simt``.

``kernels/kernel_ladder/native/csrc/cuda/{rms_norm,softmax}.cuh`` are launched here as ``ops_cuda.cu`` launches
them (the same kernel for a row length, the same vector width for an alignment, the same grids: the launch
constants are read from the header) on awkward shapes, row strides, misaligned rows, infinities and NaN, in
every dtype, against float64 references; the column-stride kernels on transposed and column-sliced inputs; and
the launcher's row plan (``row_plan.h``, compiled on its own) on layouts whose leading dims do not collapse.
Outputs start as NaN, so an element a kernel forgets to write fails. The block kernels are also run with the
emulator's threads started last to first, where it has that option: a missing barrier changes the bits.
"""

from __future__ import annotations

import ctypes
import inspect
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from utils import simt

CUDA_DIR = Path(__file__).resolve().parents[1] / "kernels" / "kernel_ladder" / "native" / "csrc" / "cuda"
SOURCE = CUDA_DIR / "softmax.cuh"  # includes rms_norm.cuh and common.cuh: every kernel


def _constant(name: str) -> int:
    found = re.search(rf"constexpr int {name} = (\d+);", (CUDA_DIR / "rms_norm.cuh").read_text())
    assert found, name
    return int(found.group(1))


WARP_MAX_COLS = _constant("kWarpMaxCols")
WARP_ROWS = _constant("kWarpRows")
BLOCK_THREADS = _constant("kBlockThreads")
CACHE_PACKS = _constant("kCachePacks")
REDUCE_ROWS = _constant("kReduceRows")
ROWS_PER_WARP = _constant("kBackwardRowsPerWarp")
MAX_BLOCKS = _constant("kBackwardMaxBlocks")

CTYPE = {torch.float32: "float", torch.float64: "double", torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}
DTYPES = list(CTYPE)
#: relative tolerance against float64: a few roundings of the storage dtype (fp32: float32 sums over 8200 columns)
RTOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
EPS = 1e-6
NAN = float("nan")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def warp_max_cols(dtype: torch.dtype, strided: bool = False) -> int:
    """kWarpMaxColsOf<T, STRIDED>: the longest row a warp takes (half of it on the column-stride path)."""
    most = WARP_MAX_COLS // 2 if dtype == torch.float64 else WARP_MAX_COLS
    return most // 2 if strided else most


def full_width(dtype: torch.dtype) -> int:
    """The vector width of the 128-bit path (double has only the scalar path)."""
    return 1 if dtype == torch.float64 else 16 // dtype.itemsize


def vector_width(cols: int, *rows: torch.Tensor) -> int:
    """The launcher's choice: 128-bit packs where every row start is 16-byte aligned and the packs tile C."""
    vec = full_width(rows[0].dtype)
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) % vec == 0 for t in rows)
    return vec if cols % vec == 0 and aligned else 1


def rows_of(
    rows: int, cols: int, dtype: torch.dtype, pad: int = 0, shift: int = 0, seed: int = 0, scale: float = 1.0
) -> torch.Tensor:
    """A (rows, cols) tensor of random values whose rows are cols + pad apart, starting shift elements in."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shift + rows * (cols + pad) + 1, generator=gen, dtype=torch.float64) * scale
    return base.to(dtype)[shift : shift + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]


def layout(rows: int, cols: int, dtype: torch.dtype, path: str, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Rows laid out for the path: "vector" (aligned, padded rows), "scalar" (rows one element off alignment)."""
    if path == "vector":
        vec = full_width(dtype)
        x = rows_of(rows, cols, dtype, pad=vec, seed=seed, scale=scale)
        assert vector_width(cols, x) == vec
    else:
        x = rows_of(rows, cols, dtype, pad=3, shift=1, seed=seed, scale=scale)
    return x


def weight_of(cols: int, dtype: torch.dtype, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(cols, generator=gen, dtype=torch.float64)).to(dtype)


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, factor: float = 1.0, scale: float | None = None
) -> None:
    """|out - ref| <= rtol * (|ref| + scale), NaN where the reference is NaN, and nowhere else.

    ``scale`` (default max|ref|) is the size of the terms the result is made of, where they cancel.
    """
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, what
    nan_ref = ref.isnan()
    assert torch.equal(out.isnan(), nan_ref), f"{what}: NaN at {torch.nonzero(out.isnan() != nan_ref)[:5].tolist()}"
    out, ref = out[~nan_ref], ref[~nan_ref]
    if ref.numel() == 0:
        return
    rtol = RTOL[dtype] * factor
    scale = ref.abs().max() if scale is None else torch.tensor(scale, dtype=torch.float64)
    err = (out - ref).abs()
    bad = err > rtol * (ref.abs() + scale)
    assert not bad.any(), f"{what}: max error {err.max().item():.3g} (scale {scale.item():.3g}, rtol {rtol})"


# ----------------------------------------------------------------------------------------------------------
# Launching as ops_cuda.cu does
# ----------------------------------------------------------------------------------------------------------


#: extra arguments of every launch (a test sets the emulator's thread order here)
LAUNCH_OPTIONS: dict = {}


def launch(kernel: str, grid: tuple, block: tuple, args: list) -> None:
    simt.launch(SOURCE, kernel, grid, block, args, include_dirs=(CUDA_DIR,), **LAUNCH_OPTIONS)


def kernel_name(kernel: str, dtype: torch.dtype, vec: int, strided: bool) -> str:
    """The instantiation: element type, vector width, and the column-stride path (STRIDED) or stride 1."""
    return f"{kernel}<{CTYPE[dtype]}, {vec}, {str(strided).lower()}>"


def col_stride(t: torch.Tensor) -> int:
    return t.stride(-1) if t.shape[-1] > 1 else 1


def rms_norm_forward(
    x: torch.Tensor, w: torch.Tensor, eps: float, vec: int, strided: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    y = torch.full((rows, cols), NAN, dtype=x.dtype)
    rstd = torch.full((rows,), NAN, dtype=acc_dtype(x.dtype))
    args = [x, w, y, rstd, rows, cols, x.stride(0), eps, col_stride(x), col_stride(w)]
    if cols <= warp_max_cols(x.dtype, strided):
        name = kernel_name("rms_norm_forward_warp", x.dtype, vec, strided)
        launch(name, (math.ceil(rows / WARP_ROWS),), (32, WARP_ROWS), args)
    else:
        launch(kernel_name("rms_norm_forward_block", x.dtype, vec, strided), (rows,), (BLOCK_THREADS,), args)
    return y, rstd


def backward_blocks(rows: int, cols: int, dtype: torch.dtype, strided: bool = False) -> int:
    if cols <= warp_max_cols(dtype, strided):
        return min(math.ceil(rows / (WARP_ROWS * ROWS_PER_WARP)), MAX_BLOCKS)
    return min(rows, MAX_BLOCKS)


def rms_norm_backward(gy, x, w, rstd, vec: int, blocks: int | None = None, strided: bool = False):
    """(grad_x, grad_weight, weight_partials); ``blocks`` overrides the launcher's grid."""
    rows, cols = x.shape
    blocks = blocks or backward_blocks(rows, cols, x.dtype, strided)
    gx = torch.full((rows, cols), NAN, dtype=x.dtype)
    partials = torch.full((blocks, cols), NAN, dtype=acc_dtype(x.dtype))
    t = CTYPE[x.dtype]
    strides = [gy.stride(0), x.stride(0), col_stride(gy), col_stride(x), col_stride(w), rstd.stride(0)]
    args = [gy, x, w, rstd, gx, partials, rows, cols, *strides]
    if cols <= warp_max_cols(x.dtype, strided):
        launch(kernel_name("rms_norm_backward_warp", x.dtype, vec, strided), (blocks,), (32, WARP_ROWS), args)
    else:
        launch(kernel_name("rms_norm_backward_block", x.dtype, vec, strided), (blocks,), (BLOCK_THREADS,), args)
    gw = torch.full((cols,), NAN, dtype=x.dtype)
    reduce_args = [partials, gw, blocks, cols]
    launch(f"rms_norm_weight_grad_reduce<{t}>", (math.ceil(cols / 32),), (32, REDUCE_ROWS), reduce_args)
    return gx, gw, partials


def row_launch(rows: int, cols: int, dtype: torch.dtype, strided: bool) -> tuple[str, tuple, tuple]:
    """(kind, grid, block) of a forward or softmax-backward launch: a warp per row, or a block per row."""
    if cols <= warp_max_cols(dtype, strided):
        return "warp", (math.ceil(rows / WARP_ROWS),), (32, WARP_ROWS)
    return "block", (rows,), (BLOCK_THREADS,)


def softmax_forward(x: torch.Tensor, vec: int, strided: bool = False) -> torch.Tensor:
    rows, cols = x.shape
    y = torch.full((rows, cols), NAN, dtype=x.dtype)
    kind, grid, block = row_launch(rows, cols, x.dtype, strided)
    args = [x, y, rows, cols, x.stride(0), col_stride(x)]
    launch(kernel_name(f"softmax_forward_{kind}", x.dtype, vec, strided), grid, block, args)
    return y


def softmax_backward(gy: torch.Tensor, y: torch.Tensor, vec: int, strided: bool = False) -> torch.Tensor:
    rows, cols = y.shape
    gx = torch.full((rows, cols), NAN, dtype=y.dtype)
    kind, grid, block = row_launch(rows, cols, y.dtype, strided)
    args = [gy, y, gx, rows, cols, gy.stride(0), y.stride(0), col_stride(gy), col_stride(y)]
    launch(kernel_name(f"softmax_backward_{kind}", y.dtype, vec, strided), grid, block, args)
    return gx


# ----------------------------------------------------------------------------------------------------------
# References (float64)
# ----------------------------------------------------------------------------------------------------------


def rms_norm_reference(x, w, eps=EPS):
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1) + eps)
    return x64 * rstd[:, None] * w.double(), rstd


def rms_norm_backward_reference(gy, x, w, eps=EPS):
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    y = F.rms_norm(x64, (x.shape[-1],), w64, eps)
    return torch.autograd.grad(y, (x64, w64), gy.double())


# Row lengths: 1, 7 and 33 (warp kernel, scalar only), 1000 (warp, both paths), 4100 (block; fp32 packs
# 4100 / 4 = 1025 > 256 x 4 cached: one pack streamed), 2056 and 8200 (block, bf16/fp16 packs: 8200 / 8 = 1025,
# one streamed), 600 (double's block kernel).
CASES = [(1, 1), (5, 7), (5, 33), (5, 1000), (3, 4100), (2, 2056), (2, 8200), (3, 600)]


def paths(cols: int, dtype: torch.dtype) -> list[str]:
    return ["scalar"] + (["vector"] if full_width(dtype) > 1 and cols % full_width(dtype) == 0 else [])


def cases(dtypes=DTYPES):
    for dtype in dtypes:
        for rows, cols in CASES:
            if cols in (2056, 8200) and dtype.itemsize != 2:
                continue  # the 16-bit block cases; fp32 has 4100
            if cols == 600 and dtype != torch.float64:
                continue
            for path in paths(cols, dtype):
                yield pytest.param(dtype, rows, cols, path, id=f"{str(dtype)[6:]}-{rows}x{cols}-{path}")


# ----------------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rows", "cols", "path"), list(cases()))
def test_rms_norm_forward_against_float64(dtype, rows, cols, path):
    x = layout(rows, cols, dtype, path)
    w = weight_of(cols, dtype)
    vec = vector_width(cols, x) if path == "vector" else 1
    y, rstd = rms_norm_forward(x, w, EPS, vec)
    ref_y, ref_rstd = rms_norm_reference(x, w)
    assert_close(y, ref_y, dtype, "y")
    assert_close(rstd, ref_rstd, torch.float64 if dtype == torch.float64 else torch.float32, "rstd")


@pytest.mark.parametrize(("dtype", "rows", "cols", "path"), list(cases()))
def test_rms_norm_backward_against_float64(dtype, rows, cols, path):
    x = layout(rows, cols, dtype, path)
    gy = layout(rows, cols, dtype, path, seed=1)
    w = weight_of(cols, dtype)
    vec = vector_width(cols, x, gy) if path == "vector" else 1
    _, rstd = rms_norm_forward(x, w, EPS, vec)
    gx, gw, _ = rms_norm_backward(gy, x, w, rstd, vec)
    ref_gx, ref_gw = rms_norm_backward_reference(gy, x, w)
    # dx = rstd * (g - xhat * mean(g * xhat)) cancels (to nothing at C = 1): errors scale with rstd * |g|
    terms = (gy.double() * w.double() * rstd.double()[:, None]).abs().max().item()
    assert_close(gx, ref_gx, dtype, "grad_x", factor=2, scale=terms)
    assert_close(gw, ref_gw, dtype, "grad_weight", factor=2)


@pytest.mark.parametrize(("cols", "blocks"), [(40, 1), (4100, 2)])
def test_rms_norm_backward_programs_take_several_rows(cols, blocks):
    """A grid smaller than the rows: each program adds several rows' dw (in the block kernel the streamed packs'
    dw goes through its row of weight_partials, and the warp sums alternate between two shared buffers)."""
    rows, dtype = 9, torch.float32
    x, gy, w = layout(rows, cols, dtype, "vector"), layout(rows, cols, dtype, "vector", seed=1), weight_of(cols, dtype)
    _, rstd = rms_norm_forward(x, w, EPS, 4)
    gx, gw, partials = rms_norm_backward(gy, x, w, rstd, 4, blocks=blocks)
    ref_gx, ref_gw = rms_norm_backward_reference(gy, x, w)
    assert_close(gx, ref_gx, dtype, "grad_x", factor=2)
    assert_close(gw, ref_gw, dtype, "grad_weight", factor=2)
    # each partial row is its program's rows' sum of dy * xhat
    xhat = x.double() * rstd.double()[:, None]
    programs = blocks * (WARP_ROWS if cols <= WARP_MAX_COLS else 1)
    per_program = torch.stack([(gy.double() * xhat)[p::programs].sum(0) for p in range(programs)])
    if cols <= WARP_MAX_COLS:  # the block's warps are added into one row, in warp order
        per_program = per_program.view(WARP_ROWS, blocks, cols).sum(0)
    assert_close(partials, per_program, dtype, "weight_partials", factor=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_weight_grad_is_the_fixed_order_sum_of_the_partials(dtype):
    """grad_weight is the float32 sum of weight_partials' rows in the reduce kernel's fixed order, bit for bit,
    and a second run gives the same bits."""
    rows, cols = 70, 40  # 3 blocks of 4 warps: 12 warps, up to 6 rows each
    x, gy, w = layout(rows, cols, dtype, "vector"), layout(rows, cols, dtype, "vector", seed=1), weight_of(cols, dtype)
    vec = full_width(dtype)
    _, rstd = rms_norm_forward(x, w, EPS, vec)
    gx, gw, partials = rms_norm_backward(gy, x, w, rstd, vec, blocks=3)
    gx2, gw2, partials2 = rms_norm_backward(gy, x, w, rstd, vec, blocks=3)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2) and torch.equal(partials, partials2)
    # thread (c, ty) adds rows ty, ty + 16, ... in order; then the 16 sums in order of ty; then one rounding
    lane_sums = []
    for ty in range(REDUCE_ROWS):
        s = torch.zeros(cols, dtype=torch.float32)
        for p in range(ty, partials.shape[0], REDUCE_ROWS):
            s = s + partials[p]
        lane_sums.append(s)
    total = torch.zeros(cols, dtype=torch.float32)
    for s in lane_sums:
        total = total + s
    assert torch.equal(gw, total.to(dtype))


def test_rms_norm_special_rows_match_torch():
    """A NaN makes its row NaN; an inf makes rstd 0 (inf * 0 = NaN there, 0 elsewhere); squares past float32's
    range give rstd 0 and zeros, as torch's float32 rms_norm does; tiny values are scaled up exactly."""
    cols = 40
    x = torch.randn(6, cols)
    x[0, 3] = NAN
    x[1, 5] = float("inf")
    x[2] = 1e30
    x[3] = 1e-30
    x[4, :] = 0.0
    w = weight_of(cols, torch.float32)
    for path in ("vector", "scalar"):
        xs = x if path == "vector" else rows_of(6, cols, torch.float32, shift=1).copy_(x)
        y, rstd = rms_norm_forward(xs, w, EPS, 4 if path == "vector" else 1)
        ref = F.rms_norm(x, (cols,), w, EPS)
        assert torch.equal(y.isnan(), ref.isnan()), path
        assert torch.allclose(y.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-6), path
        assert rstd[0].isnan() and rstd[1] == 0 and rstd[2] == 0
        assert rstd[4].item() == pytest.approx(1 / math.sqrt(EPS), rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rows", "cols", "path"), list(cases()))
def test_softmax_forward_against_float64(dtype, rows, cols, path):
    x = layout(rows, cols, dtype, path, scale=4.0)
    vec = vector_width(cols, x) if path == "vector" else 1
    y = softmax_forward(x, vec)
    assert_close(y, torch.softmax(x.double(), -1), dtype, "y")


@pytest.mark.parametrize(("dtype", "rows", "cols", "path"), list(cases()))
def test_softmax_backward_against_float64(dtype, rows, cols, path):
    y = torch.softmax(layout(rows, cols, dtype, path, scale=4.0).double(), -1).to(dtype)
    y = layout(rows, cols, dtype, path).copy_(y)  # the same layout as the path's
    gy = layout(rows, cols, dtype, path, seed=1)
    vec = vector_width(cols, y, gy) if path == "vector" else 1
    gx = softmax_backward(gy, y, vec)
    y64, g64 = y.double(), gy.double()
    assert_close(gx, y64 * (g64 - (g64 * y64).sum(-1, keepdim=True)), dtype, "grad_x", factor=2)


def special_rows(cols: int, dtype: torch.dtype) -> torch.Tensor:
    big = 6e4 if dtype == torch.float16 else 1e30
    x = torch.randn(8, cols).to(dtype)
    x[0] = float("-inf")  # all -inf: NaN
    x[1, ::3] = float("-inf")  # some -inf: exact zeros there
    x[2, cols // 2] = float("inf")  # +inf: NaN
    x[3, cols - 1] = NAN  # NaN: NaN
    x[4] = torch.linspace(-big, big, cols)  # huge values: one or two ones, zeros elsewhere
    x[5] = float("-inf")
    x[5, cols - 1] = -100.0  # one finite value far below 0 at the end (streamed in the block kernel)
    x[6] = float("-inf")
    x[6, 0] = -100.0  # ... and at the start (cached)
    x[7] = -big  # a constant row of huge negative values: uniform
    return x


@pytest.mark.parametrize(("dtype", "cols"), [(d, c) for d in DTYPES for c in (33, 1000, 4100)])
def test_softmax_special_rows_match_torch(dtype, cols):
    x = special_rows(cols, dtype)
    ref = torch.softmax(x.double(), -1)
    for path in paths(cols, dtype):
        xs = x if path == "vector" else rows_of(8, cols, dtype, shift=1).copy_(x)
        y = softmax_forward(xs, vector_width(cols, xs) if path == "vector" else 1)
        assert_close(y, ref, dtype, f"{path} special rows")
    assert ref[0].isnan().all() and ref[2].isnan().all() and ref[3].isnan().all() and (ref[1, ::3] == 0).all()


# ----------------------------------------------------------------------------------------------------------
# Barriers: the same bits whichever order the emulator starts a block's threads in
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernels_give_the_same_bits_in_reverse_thread_order(dtype, monkeypatch):
    """A missing barrier shows as a different result when the block's threads start last to first."""
    if "order" not in inspect.signature(simt.launch).parameters:
        pytest.skip("this utils.simt has no thread order option")
    rows, cols = 5, 4100 if dtype == torch.float32 else 8200  # a pack past the cached ones
    x, gy, w = layout(rows, cols, dtype, "vector"), layout(rows, cols, dtype, "vector", seed=1), weight_of(cols, dtype)
    vec = vector_width(cols, x, gy)

    def run():
        y, rstd = rms_norm_forward(x, w, EPS, vec)
        gx, gw, partials = rms_norm_backward(gy, x, w, rstd, vec, blocks=2)
        sy = softmax_forward(x, vec)
        return y, rstd, gx, gw, partials, sy, softmax_backward(gy, sy, vec)

    forward = run()
    monkeypatch.setitem(LAUNCH_OPTIONS, "order", "reverse")
    for a, b in zip(forward, run()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------
# The column-stride path (STRIDED): transposed and column-sliced inputs read in place
# ----------------------------------------------------------------------------------------------------------


def strided_layout(
    rows: int, cols: int, dtype: torch.dtype, kind: str, seed: int = 0, scale: float = 1.0
) -> torch.Tensor:
    """A (rows, cols) tensor whose last-dim stride is not 1: "transposed" (a (cols, rows) tensor's ``.t()``: columns
    ``rows`` apart, rows 1 apart), "sliced" (every other column of a wider tensor, from its second column on)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "transposed":
        x = (torch.randn(cols, rows, generator=gen, dtype=torch.float64) * scale).to(dtype).t()
    else:
        wide = (torch.randn(rows, 2 * cols + 3, generator=gen, dtype=torch.float64) * scale).to(dtype)
        x = wide[:, 1 : 1 + 2 * cols : 2]
    assert x.shape == (rows, cols) and x.stride(-1) != 1
    return x


def strided_weight(cols: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """The weight: contiguous with a transposed x, every other element of a longer vector with a sliced one."""
    if kind == "transposed":
        return weight_of(cols, dtype)
    return weight_of(2 * cols, dtype)[::2]


# 33 columns: the warp kernel, a lane's 16 elements partly used; 512: the strided warp kernels' longest rows (16 a
# lane, all used); 1100: the block kernel (rows past 512 take it on this path), 1024 elements cached, 76 streamed.
STRIDED_CASES = [
    pytest.param(dtype, rows, cols, kind, id=f"{str(dtype)[6:]}-{rows}x{cols}-{kind}")
    for dtype in (torch.float32, torch.bfloat16)
    for rows, cols in [(5, 33), (3, 512), (2, 1100)]
    for kind in ("transposed", "sliced")
]


@pytest.mark.parametrize(("dtype", "rows", "cols", "kind"), STRIDED_CASES)
def test_strided_rms_norm_forward_and_backward_against_float64(dtype, rows, cols, kind):
    """The column-stride kernels on x, grad_y, weight (and rstd, rows 2 apart) as they lie, against float64; and
    bit for bit what the stride-1 scalar kernels give on contiguous copies (a lane or thread takes the same
    columns in the same order on both paths)."""
    x = strided_layout(rows, cols, dtype, kind)
    gy = strided_layout(rows, cols, dtype, kind, seed=1)
    w = strided_weight(cols, dtype, kind)
    y, rstd = rms_norm_forward(x, w, EPS, 1, strided=True)
    ref_y, ref_rstd = rms_norm_reference(x, w)
    assert_close(y, ref_y, dtype, "y")
    assert_close(rstd, ref_rstd, acc_dtype(dtype), "rstd")
    rstd_in = torch.full((2 * rows,), NAN, dtype=rstd.dtype)[::2].copy_(rstd) if kind == "sliced" else rstd
    gx, gw, _ = rms_norm_backward(gy, x, w, rstd_in, 1, strided=True)
    ref_gx, ref_gw = rms_norm_backward_reference(gy, x, w)
    terms = (gy.double() * w.double() * rstd.double()[:, None]).abs().max().item()
    assert_close(gx, ref_gx, dtype, "grad_x", factor=2, scale=terms)
    assert_close(gw, ref_gw, dtype, "grad_weight", factor=2)

    dense = [t.contiguous() for t in (x, gy, w)]
    y1, rstd1 = rms_norm_forward(dense[0], dense[2], EPS, 1)
    gx1, gw1, _ = rms_norm_backward(dense[1], dense[0], dense[2], rstd1, 1)
    for got, want, what in [(y, y1, "y"), (rstd, rstd1, "rstd"), (gx, gx1, "grad_x"), (gw, gw1, "grad_weight")]:
        assert torch.equal(got, want), f"{what}: the strided path differs from the stride-1 path"


@pytest.mark.parametrize(("dtype", "rows", "cols", "kind"), STRIDED_CASES)
def test_strided_softmax_forward_and_backward_against_float64(dtype, rows, cols, kind):
    x = strided_layout(rows, cols, dtype, kind, scale=4.0)
    y = softmax_forward(x, 1, strided=True)
    assert_close(y, torch.softmax(x.double(), -1), dtype, "y")
    y_in = strided_layout(rows, cols, dtype, kind, seed=2).copy_(y)  # the saved output, laid out like x
    gy = strided_layout(rows, cols, dtype, kind, seed=1)
    gx = softmax_backward(gy, y_in, 1, strided=True)
    y64, g64 = y_in.double(), gy.double()
    assert_close(gx, y64 * (g64 - (g64 * y64).sum(-1, keepdim=True)), dtype, "grad_x", factor=2)
    assert torch.equal(y, softmax_forward(x.contiguous(), 1))
    assert torch.equal(gx, softmax_backward(gy.contiguous(), y_in.contiguous(), 1))


def test_strided_softmax_backward_of_a_column_expanded_grad():
    """grad_y of stride 0 along the row (the gradient of a sum over the last dim is such a tensor): dx = y * g *
    (1 - sum(y)) cancels to about nothing, so the errors are measured against the size of y * g."""
    rows, cols, dtype = 5, 40, torch.float32
    y = torch.softmax(torch.randn(rows, cols, dtype=torch.float64), -1).to(dtype)
    gy = torch.randn(rows, 1, dtype=dtype).expand(rows, cols)
    gx = softmax_backward(gy, y, 1, strided=True)
    y64, g64 = y.double(), gy.double()
    want = y64 * (g64 - (g64 * y64).sum(-1, keepdim=True))
    assert_close(gx, want, dtype, "grad_x", factor=2, scale=(y64 * g64).abs().max().item())
    assert torch.equal(gx, softmax_backward(gy.contiguous(), y, 1))


# ----------------------------------------------------------------------------------------------------------
# The launcher's row plan (row_plan.h): leading dims that do not collapse are launched once per slice
# ----------------------------------------------------------------------------------------------------------

ROW_PLAN_SHIM = r"""
extern "C" void row_plan(const int64_t* lead, int64_t ndim, const int64_t* strides, int64_t inputs,
                         int64_t* rows_launches, int64_t* row_strides, int64_t* offsets, int64_t capacity) {
  std::vector<std::vector<int64_t>> s;
  for (int64_t k = 0; k < inputs; ++k) s.emplace_back(strides + k * ndim, strides + (k + 1) * ndim);
  const kl_cuda::RowPlan plan(std::vector<int64_t>(lead, lead + ndim), s);
  rows_launches[0] = plan.rows;
  rows_launches[1] = plan.launches;
  for (int64_t k = 0; k < inputs; ++k) row_strides[k] = plan.row_stride[k];
  for (int64_t l = 0; l < plan.launches && l < capacity; ++l)
    for (int64_t k = 0; k < inputs; ++k) offsets[l * inputs + k] = plan.offset(k, l);
}
"""


@pytest.fixture(scope="module")
def row_plan():
    """RowPlan of row_plan.h, compiled on its own: (rows, launches, row strides, per-launch offsets) of tensors
    of one shape (their leading dims: all but the last)."""
    cpp = pytest.importorskip("utils.cpp")
    if not cpp.compiler_available():
        pytest.skip("no C++ compiler")
    header = (CUDA_DIR / "row_plan.h").read_text().replace("#pragma once", "")  # its text is in the cache key
    lib = cpp.compile_shared(header + ROW_PLAN_SHIM)
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function = lib.function("row_plan", [pointer, i64, pointer, i64, pointer, pointer, pointer, i64])

    def plan(*tensors: torch.Tensor):
        lead = torch.tensor(tensors[0].shape[:-1], dtype=torch.int64)
        strides = torch.tensor([t.stride()[:-1] for t in tensors], dtype=torch.int64).reshape(-1)
        rows_launches = torch.zeros(2, dtype=torch.int64)
        row_strides = torch.zeros(len(tensors), dtype=torch.int64)
        capacity = max(1, math.prod(lead.tolist()))
        offsets = torch.zeros(capacity, len(tensors), dtype=torch.int64)
        function(lead.data_ptr(), len(lead), strides.data_ptr(), len(tensors), rows_launches.data_ptr(),
                 row_strides.data_ptr(), offsets.data_ptr(), capacity)  # fmt: skip
        rows, launches = rows_launches.tolist()
        return rows, launches, row_strides.tolist(), offsets[:launches].tolist()

    return plan


def row_start(t: torch.Tensor, row: int) -> int:
    """The element offset (from t's first element) of row ``row`` (row-major over the leading dims) of t."""
    offset = 0
    for size, stride in reversed(list(zip(t.shape[:-1], t.stride()[:-1]))):
        offset += (row % size) * stride
        row //= size
    return offset


def base(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# (name, inputs of one shape, the launches the plan must take): every layout the dims collapse for in one launch,
# then batches whose leading dims do not collapse
PLAN_LAYOUTS = [
    ("contiguous", lambda: [base(2, 3, 8)], 1),
    ("transposed matrix", lambda: [base(8, 5).t()], 1),
    ("row slice and padded rows", lambda: [base(2, 7, 12)[:, 1:6, :8]], 2),
    ("padded rows of a contiguous batch", lambda: [base(6, 12)[:, :8].view(2, 3, 8)], 1),
    ("expanded rows", lambda: [base(1, 8).expand(6, 8)], 1),
    ("size-1 dims", lambda: [base(1, 4, 1, 8)[:, :, :, :]], 1),
    ("one row", lambda: [base(8)], 1),
    ("x and grad_y: transposed and contiguous", lambda: [base(8, 5).t(), base(5, 8)], 1),
    ("a slice of a batch", lambda: [base(3, 9, 8)[:, ::2]], 3),
    ("a permuted batch", lambda: [base(4, 3, 8).permute(1, 0, 2)], 3),
    ("4-d, inner pair collapses", lambda: [base(2, 3, 4, 5, 8).permute(1, 0, 2, 3, 4)[:, :, :, :, :]], 6),
    ("x contiguous, grad_y permuted", lambda: [base(3, 4, 8), base(4, 3, 8).transpose(0, 1)], 3),
]


@pytest.mark.parametrize("case", range(len(PLAN_LAYOUTS)), ids=[c[0] for c in PLAN_LAYOUTS])
def test_row_plan_finds_every_row_of_every_input(row_plan, case):
    """Row r of launch l starts at offset(k, l) + r * row_stride[k] in input k, for every row of the row-major
    order (launch l holding rows l * rows ...), with as few launches as the layout allows."""
    _, make, launches_wanted = PLAN_LAYOUTS[case]
    tensors = make()
    rows, launches, row_strides, offsets = row_plan(*tensors)
    assert rows * launches == math.prod(tensors[0].shape[:-1])
    assert launches == launches_wanted
    for k, t in enumerate(tensors):
        for row in range(rows * launches):
            l, r = divmod(row, rows)
            assert offsets[l][k] + r * row_strides[k] == row_start(t, row), (k, row)


def test_rms_norm_over_a_permuted_batch_launched_per_slice(row_plan):
    """The launcher's way with leading dims that do not collapse: one launch per slice of the outer dim, each on
    its inputs in place (pointers offset to the slice), outputs and weight partials of the slices one after the
    other, then one reduce over all of them; against float64."""
    dtype, cols = torch.float32, 40
    x = base(4, 3, cols).permute(1, 0, 2)  # (3, 4, cols): the leading dims do not collapse
    gy = base(3, 4, cols)[:, :, :]
    w = weight_of(cols, dtype)
    rows, launches, row_strides, offsets = row_plan(gy, x)
    assert (rows, launches) == (4, 3)

    ys, gxs, partials = [], [], []
    for l in range(launches):
        xl = x.as_strided((rows, cols), (row_strides[1], x.stride(-1)), x.storage_offset() + offsets[l][1])
        gl = gy.as_strided((rows, cols), (row_strides[0], gy.stride(-1)), gy.storage_offset() + offsets[l][0])
        y, rstd = rms_norm_forward(xl, w, EPS, 4)
        gx, _, part = rms_norm_backward(gl, xl, w, rstd, 4)
        ys, gxs, partials = ys + [y], gxs + [gx], partials + [part]
    y, gx = torch.stack(ys), torch.stack(gxs)  # (launches, rows, cols): the outputs' row-major order
    all_partials = torch.cat(partials)
    gw = torch.full((cols,), NAN, dtype=dtype)
    launch("rms_norm_weight_grad_reduce<float>", (math.ceil(cols / 32),), (32, REDUCE_ROWS),
           [all_partials, gw, all_partials.shape[0], cols])  # fmt: skip
    x2, g2 = x.reshape(-1, cols), gy.reshape(-1, cols)
    ref_y, _ = rms_norm_reference(x2, w)
    ref_gx, ref_gw = rms_norm_backward_reference(g2, x2, w)
    assert_close(y.reshape(-1, cols), ref_y, dtype, "y")
    assert_close(gx.reshape(-1, cols), ref_gx, dtype, "grad_x", factor=2)
    assert_close(gw, ref_gw, dtype, "grad_weight", factor=2)
