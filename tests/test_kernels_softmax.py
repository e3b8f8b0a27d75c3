"""kernel_ladder.softmax and kernel_ladder.log_softmax: values, gradients, layouts, dtypes, extremes, the launch
rule, traffic, custom-op plumbing, errors.

Every result is compared with a float64 reference on fresh random inputs; outputs are poisoned
(NaN) before the kernels write them, so an element a kernel forgets stays NaN and fails. Each
test that can runs on both kernels: the one-block kernel at its real sizes, and the online
(chunked) kernel forced at small sizes by shrinking the module's block limits.
"""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, TOLERANCES

import kernel_ladder
from kernel_ladder import _launch, _rows
from kernel_ladder.ops import softmax as sm

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
OPS = {"softmax": (sm.softmax, F.softmax), "log_softmax": (sm.log_softmax, F.log_softmax)}
BACKWARD_OPS = {"softmax": torch.ops.kernel_ladder.softmax_backward,
                "log_softmax": torch.ops.kernel_ladder.log_softmax_backward}
KERNEL_NAMES = ["softmax_kernel", "softmax_online_kernel", "softmax_backward_kernel",
                "softmax_backward_online_kernel"]


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The names of the kernels the ops launch, in order; ``launched.calls`` has (name, grid, constexprs)."""

    class Launched(list):
        calls: list[tuple[str, tuple, dict]]

    names = Launched()
    names.calls = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names.append(self.kernel.__name__)
                names.calls.append((self.kernel.__name__, grid, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in KERNEL_NAMES:
        monkeypatch.setattr(sm, name, Recorder(getattr(sm, name)))
    return names


def force_online(monkeypatch) -> None:
    """Rows longer than 16 columns take the online kernels, in chunks of up to 32."""
    monkeypatch.setattr(sm, "MAX_BLOCK", 16)
    monkeypatch.setattr(sm, "ONLINE_BLOCK", 32)


@pytest.fixture(params=["one_block", "online"])
def path(request, monkeypatch) -> str:
    if request.param == "online":
        force_online(monkeypatch)
    return request.param


def rand(shape, dtype=torch.float32, gen=None, scale=3.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def make_input(shape, dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A tensor of logical ``shape`` laid out as ``layout`` (a view, never a copy), values N(0, 3²)."""
    return helpers.make_input(shape, dtype, layout, gen, scale=3.0)


def assert_matches(out: torch.Tensor, reference64: torch.Tensor, dtype: torch.dtype,
                   tolerance: torch.dtype | None = None) -> None:
    """Within ``dtype``'s tolerance, or a coarser dtype's (``tolerance``) for a mixed-dtype result."""
    rtol, atol = helpers.tolerance(tolerance or dtype)
    helpers.assert_matches(out, reference64, dtype, rtol=rtol, atol=atol)


def reference_grad(reference, x, dim, grad_out):
    """torch autograd of the float64 reference at ``x``."""
    leaf = x.detach().double().requires_grad_()
    (grad,) = torch.autograd.grad(reference(leaf, dim), [leaf], grad_out.double())
    return grad


def formula_grad(name, out, dim, grad_out):
    """The backward formula in float64 from the *saved* output: what a 16-bit backward can match
    (the output it saved is rounded to 16 bits; torch's backward starts from the same)."""
    y, dy = out.detach().double(), grad_out.double()
    if name == "softmax":
        return y * (dy - (dy * y).sum(dim, keepdim=True))
    return dy - y.exp() * dy.sum(dim, keepdim=True)


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if TOLERANCES[a][0] >= TOLERANCES[b][0] else b


# --------------------------------------------------------------------------- forward values

# Odd sizes, size-1 dims, tiles of packed rows with remainders, up to 4 dims.
SHAPE_DIMS = [((1,), 0), ((7,), -1), ((1, 1), 1), ((5, 1), -1), ((1, 9), 0), ((33, 65), -1), ((33, 65), 0),
              ((2, 3, 37), 1), ((2, 3, 37), -3), ((3, 1, 4, 21), 3), ((3, 1, 4, 21), 1), ((70, 300), -1)]
# The online kernels take one row per program (8 when the rows are contiguous): few rows here.
ONLINE_SHAPE_DIMS = [((100,), 0), ((3, 65), -1), ((65, 3), 0), ((2, 33, 3), 1), ((1, 2, 1, 47), -1)]


@pytest.mark.parametrize("kind, shape, dim", [("one_block", *c) for c in SHAPE_DIMS] + [("online", *c) for c in
                                        ONLINE_SHAPE_DIMS], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_forward_matches_float64_reference(name, kind, shape, dim, monkeypatch, gen):
    if kind == "online":
        force_online(monkeypatch)
    op, reference = OPS[name]
    x = rand(shape, gen=gen)
    out = op(x, dim)
    assert_matches(out, reference(x.double(), dim), torch.float32)


LONG_DIM_SHAPES = {0: (40, 2, 3), 1: (2, 40, 3), -1: (2, 3, 40)}


@pytest.mark.parametrize("layout", ["transposed", "sliced", "permuted", "expanded"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("name", list(OPS))
def test_forward_honours_strides(name, dim, layout, path, gen):
    op, reference = OPS[name]
    x = make_input(LONG_DIM_SHAPES[dim], torch.float32, layout, gen)
    assert not x.is_contiguous()
    out = op(x, dim)
    assert_matches(out, reference(x.double(), dim), torch.float32)
    ref_layout = F.softmax(x, dim).stride()  # torch's own result: contiguous whatever x's layout
    assert out.stride() == ref_layout and out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("name", list(OPS))
def test_forward_dtypes(name, dim, dtype, path, gen):
    op, reference = OPS[name]
    x = make_input((4, 130) if dim == -1 else (130, 4), dtype, "sliced", gen)
    assert_matches(op(x, dim), reference(x.double(), dim), dtype)


@pytest.mark.parametrize(("x_dtype", "out_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                                    (torch.float16, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_dtype_argument_sets_the_output_dtype(name, x_dtype, out_dtype, path, gen):
    op, reference = OPS[name]
    x = rand((3, 70), x_dtype, gen).requires_grad_()
    out = op(x, -1, dtype=out_dtype)
    assert out.dtype == reference(x, -1, dtype=out_dtype).dtype == out_dtype
    assert_matches(out, reference(x.detach().double(), -1), out_dtype)
    grad_out = rand((3, 70), out_dtype, gen, scale=1.0)
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    assert grad.dtype == x_dtype
    assert_matches(grad, formula_grad(name, out, -1, grad_out), x_dtype, tolerance=coarser(x_dtype, out_dtype))


def test_many_leading_dims_and_tiles_that_cross_them(launched, gen):
    """Leading dims no operand can merge (launched per slice) and tiles over a 2-D row space."""
    x = make_input((2, 3, 2, 3, 5), torch.float32, "permuted", gen)  # 4 leading dims, no merges
    assert len(_rows.plan_rows([x.movedim(2, -1)])) > 1
    assert_matches(sm.softmax(x, 2), F.softmax(x.double(), 2), torch.float32)
    # (4, 7) leading rows that do not merge: tiles of rows cross from one i1 to the next.
    y = rand((4, 9, 30), gen=gen)[:, 1:8]
    (launch,) = _rows.plan_rows([y])
    assert launch.sizes == (4, 7) and sm.softmax_launch_config(30, torch.float32).block_rows > 7
    assert_matches(sm.log_softmax(y, -1), F.log_softmax(y.double(), -1), torch.float32)


@pytest.mark.parametrize("name", list(OPS))
def test_channel_softmax_tiles_run_along_contiguous_rows(name, launched, path, gen):
    """NCHW over C: rows (H*W of them per image) are contiguous; tiles stay inside one image's run,
    the last tile of each run masked where it overhangs (35 is no multiple of a tile)."""
    op, reference = OPS[name]
    x = rand((2, 19, 5, 7), gen=gen).requires_grad_()
    out = op(x, 1)
    assert_matches(out, reference(x.detach().double(), 1), torch.float32)
    grad_out = rand((2, 19, 5, 7), gen=gen)
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    assert_matches(grad, reference_grad(reference, x, 1, grad_out), torch.float32)
    for _, grid, constexprs in launched.calls:
        rows = constexprs["BLOCK_ROWS"]
        assert constexprs["LINEAR_ROWS"] and 35 % rows != 0 and grid == (2 * -(-35 // rows),)


def test_int64_offsets_path(monkeypatch, gen):
    """The int64 column-offset path (strides that can pass 2**31) computes the same values."""
    monkeypatch.setattr(_launch, "INT32_MAX", 100)
    x = make_input((5, 40), torch.float32, "transposed", gen)
    assert _rows.plan_rows([x])[0].index_64  # 39 columns * a stride of 5 pass the patched limit
    assert_matches(sm.softmax(x, -1), F.softmax(x.double(), -1), torch.float32)
    force_online(monkeypatch)
    assert_matches(sm.log_softmax(x, -1), F.log_softmax(x.double(), -1), torch.float32)


def test_no_hidden_copies(monkeypatch, gen):
    """Strided inputs are read in place: every operand a kernel gets lives in the caller's storage."""
    planned = []
    original = sm.plan_rows

    def recording(operands, *args):
        launches = original(operands, *args)
        planned.extend(launches)
        return launches

    monkeypatch.setattr(sm, "plan_rows", recording)
    x = make_input((6, 5, 40), torch.float32, "permuted", gen).requires_grad_()
    y = sm.softmax(x, 1)
    grad_out = make_input((6, 5, 40), torch.float32, "sliced", gen)
    y.backward(grad_out)
    def storage(t):
        return t.untyped_storage().data_ptr()

    forward, backward = planned
    assert storage(forward.tensors[0]) == storage(x) and storage(forward.tensors[1]) == storage(y)
    assert storage(backward.tensors[0]) == storage(y) and storage(backward.tensors[1]) == storage(grad_out)


# --------------------------------------------------------------------------- which kernel, long rows


def test_kernel_choice_follows_the_launch_config(launched, monkeypatch, gen):
    for n_cols in (1, 100):
        sm.softmax(rand((3, n_cols), gen=gen)).sum()
    assert launched == ["softmax_kernel", "softmax_kernel"]
    launched.clear()
    force_online(monkeypatch)
    x = rand((3, 100), gen=gen).requires_grad_()
    sm.log_softmax(x).backward(rand((3, 100), gen=gen))
    sm.softmax(rand((3, 16), gen=gen))  # 16 columns still fit the shrunken block
    assert launched == ["softmax_online_kernel", "softmax_backward_online_kernel", "softmax_kernel"]


@pytest.mark.parametrize("name", list(OPS))
def test_rows_of_100k_columns_and_the_largest_block(name, launched, gen):
    """The real sizes: 32768 columns in one block, 100003 online (one row each)."""
    op, reference = OPS[name]
    for n_cols, kernel in [(32768, "softmax_kernel"), (100_003, "softmax_online_kernel")]:
        launched.clear()
        x = rand((1, n_cols), gen=gen).requires_grad_()
        x.data[0, 5] = 40.0  # a maximum that dominates
        out = op(x, -1)
        assert launched == [kernel]
        assert_matches(out, reference(x.detach().double(), -1), torch.float32)
    grad_out = rand((1, 100_003), gen=gen)
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    assert launched[-1] == "softmax_backward_online_kernel"
    assert_matches(grad, reference_grad(reference, x, -1, grad_out), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_16bit_backward_keeps_32768_columns_in_one_block(name, dtype, launched, gen):
    """y and dy stay 16-bit in registers: 32768 columns take the one-block backward, fp32 the online one."""
    op, _ = OPS[name]
    x = rand((2, 32768), dtype, gen).requires_grad_()
    grad_out = rand((2, 32768), dtype, gen, scale=1.0)
    out = op(x, -1)
    launched.clear()
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    assert launched == ["softmax_backward_kernel"]
    assert_matches(grad, formula_grad(name, out, -1, grad_out), dtype)
    launched.clear()
    BACKWARD_OPS[name](grad_out.float(), out.detach().float(), -1, torch.float32)
    assert launched == ["softmax_backward_online_kernel"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_backward_nan_rows_and_exact_rows(name, dtype, gen):
    """A NaN in dy makes its row's dx all NaN (as torch's); the re-decode leaves every other row as it was."""
    x = rand((4, 300), dtype, gen)
    out = OPS[name][0](x, -1)
    grad_out = rand((4, 300), dtype, gen, scale=1.0)
    grad_out[1, 7] = float("nan")
    got = BACKWARD_OPS[name](grad_out, out, -1, dtype)
    torch_backward = torch._softmax_backward_data if name == "softmax" else torch._log_softmax_backward_data
    want = torch_backward(grad_out.float(), out.float(), -1, torch.float32)
    assert torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    assert not torch.isnan(got[[0, 2, 3]]).any()
    keep = [0, 2, 3]
    assert_matches(got[keep], formula_grad(name, out[keep], -1, grad_out[keep]), dtype)


# --------------------------------------------------------------------------- extremes, empty, 0-d


def _extreme_rows(dtype):
    big = 1e4 if dtype != torch.float32 else 1e38
    inf = float("inf")
    rows = [
        [-inf] * 40,                                   # all -inf: NaN, like torch
        [-inf] * 20 + [1.0] + [-inf] * 19,             # one finite entry: exactly 1 (log: 0)
        [big, -big] + [0.0] * 38,                      # huge magnitudes, no overflow
        [-big] * 40,                                   # all hugely negative: uniform
        [big] * 39 + [big / 2],
        [-inf, 2.0] * 20,
    ]
    if dtype == torch.float32:
        rows.append([3e38, -3e38] + [0.0] * 38)       # x - max overflows to -inf: exp gives 0
    return torch.tensor(rows, dtype=torch.float64).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_inf_and_huge_values_match_torch(name, dtype, path):
    op, reference = OPS[name]
    x = _extreme_rows(dtype)
    for view, dim in [(x, -1), (x.t(), 0)]:  # contiguous rows; rows contiguous in memory
        out = op(view, dim)
        want = reference(view.double(), dim)
        assert torch.isnan(out.movedim(dim, -1)[0]).all()  # the all -inf row
        assert torch.equal(torch.isnan(out), torch.isnan(want.to(dtype)))
        torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=TOLERANCES[dtype][0],
                                   atol=TOLERANCES[dtype][1], equal_nan=True)
        # torch's own result in this dtype, too (NaN where it gives NaN, -inf where it gives -inf)
        torch.testing.assert_close(out, reference(view, dim), rtol=TOLERANCES[dtype][0],
                                   atol=TOLERANCES[dtype][1], equal_nan=True)


@pytest.mark.parametrize("name", list(OPS))
def test_gradients_at_inf_match_torch(name, path):
    op, reference = OPS[name]
    x = _extreme_rows(torch.float32).requires_grad_()
    grad_out = torch.linspace(-1, 1, x.numel(), dtype=torch.float32, device=DEVICE).reshape(x.shape)
    (got,) = torch.autograd.grad(op(x, -1), [x], grad_out)
    (want,) = torch.autograd.grad(reference(x, -1), [x], grad_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("shape, dim", [((0,), 0), ((0, 5), 1), ((5, 0), 1), ((5, 0), 0), ((2, 0, 3), -1), ((), 0),
                                        ((), -1), ((1,), -1), ((3, 1), 1)], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_empty_scalar_and_size_one(name, shape, dim, gen):
    op, reference = OPS[name]
    x = rand(shape, gen=gen).requires_grad_()
    out = op(x, dim)
    assert_matches(out, reference(x.detach().double(), dim), torch.float32)
    grad_out = rand(shape, gen=gen)
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    assert_matches(grad, reference_grad(reference, x, dim, grad_out), torch.float32)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("name", list(OPS))
def test_backward_matches_float64_autograd(name, dim, layout, path, gen):
    op, reference = OPS[name]
    shape = (5, 50) if dim == -1 else (50, 5)
    x = make_input(shape, torch.float32, layout, gen).requires_grad_()
    # A strided grad_out too: autograd hands the backward whatever layout it has.
    grad_out = make_input(shape, torch.float32, "transposed" if layout == "contiguous" else "sliced", gen)
    (grad,) = torch.autograd.grad(op(x, dim), [x], grad_out)
    assert_matches(grad, reference_grad(reference, x, dim, grad_out), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_backward_half_precision(name, dtype, path, gen):
    op, reference = OPS[name]
    x = rand((3, 151), dtype, gen).requires_grad_()
    grad_out = rand((3, 151), dtype, gen, scale=1.0)
    out = op(x, -1)
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    assert_matches(grad, formula_grad(name, out, -1, grad_out), dtype)


def test_backward_op_uses_only_the_output(gen):
    """The backward ops take (grad_out, out): what autograd saved is the output, not the input."""
    x = rand((5, 33), gen=gen)
    grad_out = rand((5, 33), gen=gen)
    for name, backward in [("softmax", torch.ops.kernel_ladder.softmax_backward),
                           ("log_softmax", torch.ops.kernel_ladder.log_softmax_backward)]:
        op, reference = OPS[name]
        out = op(x, 1)
        assert_matches(backward(grad_out, out, 1, torch.float32), reference_grad(reference, x, 1, grad_out),
                       torch.float32)


# --------------------------------------------------------------------------- custom-op plumbing


def _opcheck_cases(gen):
    x = make_input((5, 70), torch.float32, "contiguous", gen)
    xt = make_input((5, 70), torch.float32, "transposed", gen)
    xh = make_input((6, 20), torch.bfloat16, "sliced", gen)
    y = sm.softmax(x, -1)
    yl = sm.log_softmax(xt, 0)
    ops = torch.ops.kernel_ladder
    return {
        "softmax": (ops.softmax.default, (x, -1, None)),
        "softmax_strided_dim0": (ops.softmax.default, (xt, 0, None)),
        "softmax_dtype": (ops.softmax.default, (xh, 1, torch.float32)),
        "log_softmax": (ops.log_softmax.default, (xt, 1, None)),
        "log_softmax_dtype": (ops.log_softmax.default, (x, 0, torch.float16)),
        "softmax_backward": (ops.softmax_backward.default, (xt, y, -1, torch.float32)),
        "log_softmax_backward": (ops.log_softmax_backward.default, (x, yl, 0, torch.bfloat16)),
    }


@pytest.mark.parametrize("case", ["softmax", "softmax_strided_dim0", "softmax_dtype", "log_softmax",
                                  "log_softmax_dtype", "softmax_backward", "log_softmax_backward"])
def test_opcheck(case, gen):
    op, args = _opcheck_cases(gen)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", list(OPS))
def test_torch_compile_fullgraph_forward_and_backward(name, gen):
    op, _ = OPS[name]

    def fn(x):
        return op(x, 0)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    x = make_input((9, 70), torch.float32, "transposed", gen).requires_grad_()
    grad_out = make_input((9, 70), torch.float32, "contiguous", gen)
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got, [x], grad_out)
    want = fn(x)
    (want_grad,) = torch.autograd.grad(want, [x], grad_out)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- the launch rule


def shape(config) -> tuple[int, int, bool, int]:
    """``(block_cols, block_rows, chunked, num_warps)`` of a launch config."""
    return config.block_cols, config.block_rows, config.chunked, config.num_warps


def test_launch_config_rule():
    config = sm.softmax_launch_config
    f32, bf16 = torch.float32, torch.bfloat16
    # short rows packed into 4096-element tiles, 4 warps
    assert shape(config(1, f32)) == (1, 4096, False, 4)
    assert shape(config(100, f32)) == (128, 32, False, 4)
    assert shape(config(1000, bf16)) == (1024, 4, False, 4)
    assert shape(config(100, f32, n_rows=3)) == (128, 4, False, 4)  # no more rows than there are
    # one row per block up to 32768 columns, about 32 values per thread
    assert shape(config(5000, f32)) == (8192, 1, False, 8)
    assert shape(config(32768, f32)) == (32768, 1, False, 32)
    assert shape(config(32769, f32)) == (4096, 1, True, 8)  # then online, in 4096-column chunks
    assert config(1_000_000, bf16).chunked
    # the backward keeps y and dy in their storage dtype: one block up to 16384 fp32, 32768 bf16/fp16
    assert shape(config(16384, f32, backward=True)) == (16384, 1, False, 32)
    assert config(16385, f32, backward=True).chunked
    assert shape(config(32768, bf16, backward=True)) == (32768, 1, False, 32)
    assert shape(config(32768, torch.float16, backward=True)) == (32768, 1, False, 32)
    assert config(32769, bf16, backward=True).chunked
    assert config(32768, bf16, backward=True, grad_dtype=f32).chunked  # 6 bytes a column
    assert shape(config(16384, bf16, backward=True, grad_dtype=f32)) == (16384, 1, False, 32)
    assert shape(config(1000, bf16, backward=True)) == (1024, 4, False, 4)
    # rows contiguous in memory: a 32-byte sector of rows per program, 16 values per thread
    assert shape(config(1000, f32, transposed=True)) == (1024, 8, False, 16)
    assert shape(config(1000, bf16, transposed=True)) == (1024, 16, False, 32)
    assert shape(config(10, f32, transposed=True)) == (16, 256, False, 8)
    assert shape(config(20000, f32, transposed=True)) == (512, 8, True, 8)
    assert config(16384, bf16, transposed=True, backward=True).chunked  # counted as fp32 (addresses)
    assert config(0, f32).block_cols == 1
    for n_cols in (1, 7, 300, 4097, 16384, 32768, 40000, 10**6):
        for dtype in DTYPES:
            for backward in (False, True):
                for transposed in (False, True):
                    c = config(n_cols, dtype, backward=backward, transposed=transposed)
                    # y and dy (as fp32 when transposed), or the fp32 row
                    col_bytes = (8 if transposed else 2 * dtype.itemsize) if backward else 4
                    words = c.block_cols * c.block_rows * (col_bytes if not c.chunked else 4) // 4
                    capacity = sm.MAX_BLOCK if not transposed else sm.MAX_BLOCK // 2
                    assert c.chunked == (triton_next_pow2(n_cols) * col_bytes // 4 > capacity)
                    assert words <= sm.MAX_BLOCK and 4 <= c.num_warps <= 32
                    assert c.num_warps & (c.num_warps - 1) == 0
                    assert c.block_cols & (c.block_cols - 1) == 0 and c.block_rows & (c.block_rows - 1) == 0
                    assert c.rows_per_program == c.block_rows  # one tile a program


def triton_next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def test_transposed_layout_is_detected_and_tiles_are_linear(monkeypatch, gen):
    seen = []
    original = sm.softmax_launch_config

    def recording(n_cols, dtype, **kwargs):
        seen.append(kwargs["transposed"])
        return original(n_cols, dtype, **kwargs)

    monkeypatch.setattr(sm, "softmax_launch_config", recording)
    x = rand((40, 3, 30), gen=gen)
    sm.softmax(x, 0)  # rows (3, 30) contiguous, columns 90 apart
    sm.softmax(x, -1)
    sm.softmax(x.transpose(0, 2), 0)  # the innermost dim again
    assert seen == [True, False, False]


# --------------------------------------------------------------------------- traffic (interpreter)


def _kernel_bytes(t, kernel: str) -> int:
    launches = [launch for launch in t.launches if launch.kernel == kernel]
    assert launches
    return sum(launch.bytes for launch in launches)


@pytest.mark.interpreter
@pytest.mark.parametrize("case, dtype", [(case, torch.float32) for case in ("rows_1000", "dim0", "sliced", "3d_dim1",
                                                                           "short_rows")]
                         + [("dim0", torch.bfloat16), ("sliced", torch.float16), ("rows_32768", torch.bfloat16)],
                         ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_one_block_kernels_move_the_ideal_bytes(name, case, dtype, gen):
    """Forward: x read once, y written once; backward: y and dy read once, dx written once."""
    from utils.trace import ideal_bytes, trace

    op, _ = OPS[name]
    x, dim = {
        "rows_1000": lambda: (rand((37, 1000), dtype, gen), -1),
        "dim0": lambda: (rand((37, 300), dtype, gen), 0),
        "sliced": lambda: (make_input((25, 333), dtype, "sliced", gen), -1),
        "3d_dim1": lambda: (rand((3, 77, 5), dtype, gen), 1),
        "short_rows": lambda: (rand((1000, 3), dtype, gen), -1),
        "rows_32768": lambda: (rand((2, 32768), dtype, gen), -1),  # 16-bit: the one-block backward's limit
    }[case]()
    x.requires_grad_()
    grad_out = make_input(tuple(x.shape), dtype, "transposed", gen)
    with trace(torch_ops=False) as t:
        y = op(x, dim)
        y.backward(grad_out)
    forward = _kernel_bytes(t, "softmax_kernel")
    backward = _kernel_bytes(t, "softmax_backward_kernel")
    assert forward / ideal_bytes(x, y) <= 1.05
    assert backward / ideal_bytes(y, grad_out, x.grad) <= 1.05
    assert t.out_of_bounds == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(OPS))
def test_online_kernels_read_the_row_twice(name, monkeypatch, gen):
    """Online forward 1.5x ideal (fp32 in/out); backward 5/3 (softmax) or 4/3 (log_softmax)."""
    from utils.trace import ideal_bytes, trace

    force_online(monkeypatch)
    op, _ = OPS[name]
    x = rand((3, 200), gen=gen).requires_grad_()
    grad_out = rand((3, 200), gen=gen)
    with trace(torch_ops=False) as t:
        y = op(x, -1)
        y.backward(grad_out)
    assert _kernel_bytes(t, "softmax_online_kernel") / ideal_bytes(x, y) == pytest.approx(1.5)
    backward_ratio = 5 / 3 if name == "softmax" else 4 / 3
    assert _kernel_bytes(t, "softmax_backward_online_kernel") / ideal_bytes(y, grad_out, x.grad) == pytest.approx(
        backward_ratio)
    assert t.out_of_bounds == 0


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: sm.softmax(torch.ones(2, 3), 2), ValueError,
         r"^kernel_ladder\.softmax: dim must be in \[-2, 1\] for x of shape \(2, 3\), got 2"),
        (lambda: sm.log_softmax(torch.ones(2, 3), -3), ValueError,
         r"^kernel_ladder\.log_softmax: dim must be in \[-2, 1\] for x of shape \(2, 3\), got -3"),
        (lambda: sm.softmax(torch.tensor(1.0), 1), ValueError, r"^kernel_ladder\.softmax: dim must be in \[-1, 0\]"),
        (lambda: sm.softmax(torch.ones(3), 0.5), TypeError, r"^kernel_ladder\.softmax: dim must be an int, got float"),
        (lambda: sm.softmax(torch.ones(3), None), TypeError, r"^kernel_ladder\.softmax: dim must be an int, got None"),
        (lambda: sm.softmax(torch.ones(3), True), TypeError, r"^kernel_ladder\.softmax: dim must be an int, got bool"),
        (lambda: sm.softmax(torch.arange(4)), TypeError,
         r"^kernel_ladder\.softmax: x must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: sm.log_softmax(torch.ones(4, dtype=torch.float64)), TypeError,
         r"^kernel_ladder\.log_softmax: x must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: sm.softmax([1.0, 2.0]), TypeError, r"^kernel_ladder\.softmax: x must be a torch\.Tensor, got list"),
        (lambda: sm.softmax(torch.ones(3), dtype=torch.float64), TypeError,
         r"^kernel_ladder\.softmax: dtype must be torch\.float32, torch\.float16, torch\.bfloat16 or None"),
        (lambda: sm.log_softmax(torch.ones(3), dtype="float16"), TypeError,
         r"^kernel_ladder\.log_softmax: dtype must be a torch\.dtype or None, got str"),
        # the custom ops validate too, when called directly through torch.ops
        (lambda: torch.ops.kernel_ladder.softmax(torch.ones(2), 5), ValueError,
         r"^kernel_ladder\.softmax: dim must be in"),
        (lambda: torch.ops.kernel_ladder.log_softmax(torch.ones(2, dtype=torch.int32), 0), TypeError,
         r"^kernel_ladder\.log_softmax: x must be float32"),
        (lambda: torch.ops.kernel_ladder.softmax_backward(torch.ones(2, 3), torch.ones(3, 2), 0, torch.float32),
         ValueError,
         r"^kernel_ladder\.softmax \(backward\): grad_out and out must have the same shape"),
        (lambda: torch.ops.kernel_ladder.log_softmax_backward(torch.ones(2), torch.ones(2), 0, torch.float64),
         TypeError,
         r"^kernel_ladder\.log_softmax \(backward\): input_dtype must be float32"),
        (lambda: sm.softmax_launch_config(-1, torch.float32), ValueError,
         r"^kernel_ladder\.softmax_launch_config: n_cols must be a non-negative int"),
        (lambda: sm.softmax_launch_config(10, torch.int8), TypeError,
         r"^kernel_ladder\.softmax_launch_config: dtype must be"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_gpu_real_sizes(name, dtype):
    """Vocabulary-sized rows, attention-sized rows, channel softmax of an NCHW tensor; fwd and bwd."""
    op, reference = OPS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [((4096, 50257), -1), ((16, 262_144), -1), ((8, 16, 1024, 1024), -1), ((4, 19, 256, 256), 1),
             ((32768, 513), 0)]
    for shape, dim in cases:
        x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype).requires_grad_()
        out = op(x, dim)
        want = reference(x.detach().double(), dim)  # float64 (torch's own float32 is less accurate)
        assert_matches(out, want, dtype)
        grad_out = torch.randn(shape, device="cuda", generator=g).to(dtype)
        (grad,) = torch.autograd.grad(out, [x], grad_out)
        assert_matches(grad, formula_grad(name, out, dim, grad_out), dtype)
        del x, out, want, grad_out, grad
