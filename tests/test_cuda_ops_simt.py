"""The native extension's CUDA RMSNorm and softmax kernels, run thread by thread on the CPU by ``utils.simt``.

``kernels/kernel_ladder/native/csrc/cuda/{rms_norm,softmax}.cuh`` are launched here as ``ops_cuda.cu`` launches
them (the same kernel for a row length, the same vector width for an alignment, the same grids: the launch
constants are read from the header) on awkward shapes, row strides, misaligned rows, infinities and NaN, in
every dtype, against float64 references. Outputs start as NaN, so an element a kernel forgets to write fails.
The block kernels are also run with the emulator's threads started last to first, where it has that option: a
missing barrier changes the bits.
"""

from __future__ import annotations

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


def warp_max_cols(dtype: torch.dtype) -> int:
    return WARP_MAX_COLS // 2 if dtype == torch.float64 else WARP_MAX_COLS


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


def rms_norm_forward(x: torch.Tensor, w: torch.Tensor, eps: float, vec: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    y = torch.full((rows, cols), NAN, dtype=x.dtype)
    rstd = torch.full((rows,), NAN, dtype=acc_dtype(x.dtype))
    t = CTYPE[x.dtype]
    args = [x, w, y, rstd, rows, cols, x.stride(0), eps]
    if cols <= warp_max_cols(x.dtype):
        launch(f"rms_norm_forward_warp<{t}, {vec}>", (math.ceil(rows / WARP_ROWS),), (32, WARP_ROWS), args)
    else:
        launch(f"rms_norm_forward_block<{t}, {vec}>", (rows,), (BLOCK_THREADS,), args)
    return y, rstd


def backward_blocks(rows: int, cols: int, dtype: torch.dtype) -> int:
    if cols <= warp_max_cols(dtype):
        return min(math.ceil(rows / (WARP_ROWS * ROWS_PER_WARP)), MAX_BLOCKS)
    return min(rows, MAX_BLOCKS)


def rms_norm_backward(gy, x, w, rstd, vec: int, blocks: int | None = None):
    """(grad_x, grad_weight, weight_partials); ``blocks`` overrides the launcher's grid."""
    rows, cols = x.shape
    blocks = blocks or backward_blocks(rows, cols, x.dtype)
    gx = torch.full((rows, cols), NAN, dtype=x.dtype)
    partials = torch.full((blocks, cols), NAN, dtype=acc_dtype(x.dtype))
    t = CTYPE[x.dtype]
    args = [gy, x, w, rstd, gx, partials, rows, cols, gy.stride(0), x.stride(0)]
    if cols <= warp_max_cols(x.dtype):
        launch(f"rms_norm_backward_warp<{t}, {vec}>", (blocks,), (32, WARP_ROWS), args)
    else:
        launch(f"rms_norm_backward_block<{t}, {vec}>", (blocks,), (BLOCK_THREADS,), args)
    gw = torch.full((cols,), NAN, dtype=x.dtype)
    reduce_args = [partials, gw, blocks, cols]
    launch(f"rms_norm_weight_grad_reduce<{t}>", (math.ceil(cols / 32),), (32, REDUCE_ROWS), reduce_args)
    return gx, gw, partials


def softmax_forward(x: torch.Tensor, vec: int) -> torch.Tensor:
    rows, cols = x.shape
    y = torch.full((rows, cols), NAN, dtype=x.dtype)
    kind = "warp" if cols <= warp_max_cols(x.dtype) else "block"
    grid, block = ((math.ceil(rows / WARP_ROWS),), (32, WARP_ROWS)) if kind == "warp" else ((rows,), (BLOCK_THREADS,))
    launch(f"softmax_forward_{kind}<{CTYPE[x.dtype]}, {vec}>", grid, block, [x, y, rows, cols, x.stride(0)])
    return y


def softmax_backward(gy: torch.Tensor, y: torch.Tensor, vec: int) -> torch.Tensor:
    rows, cols = y.shape
    gx = torch.full((rows, cols), NAN, dtype=y.dtype)
    kind = "warp" if cols <= warp_max_cols(y.dtype) else "block"
    grid, block = ((math.ceil(rows / WARP_ROWS),), (32, WARP_ROWS)) if kind == "warp" else ((rows,), (BLOCK_THREADS,))
    launch(
        f"softmax_backward_{kind}<{CTYPE[y.dtype]}, {vec}>",
        grid,
        block,
        [gy, y, gx, rows, cols, gy.stride(0), y.stride(0)],
    )
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
