"""kernel_ladder.rms_norm, layer_norm, add_rms_norm: values, gradients, layouts, dtypes, plumbing, traffic, errors.

Every result is compared with a float64 reference on fresh random inputs; outputs (and the saved
statistics) are poisoned (NaN) before the kernels write them, so an element a kernel forgets stays
NaN and fails. Gradients are compared with torch autograd of the float64 reference (the kernels
take fp32/fp16/bf16 only, so gradcheck would test torch, not them).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES
from helpers import assert_matches as _assert_matches

import kernel_ladder  # noqa: F401  (fixes the mode first)
from kernel_ladder import _launch, _rows
from kernel_ladder.ops import norm as _norm
from kernel_ladder.ops.add_rms_norm import add_rms_norm
from kernel_ladder.ops.layer_norm import layer_norm
from kernel_ladder.ops.rms_norm import rms_norm
from utils.call_path import argument_path
from utils.memory import peak_memory

pytestmark = pytest.mark.usefixtures("poisoned")  # outputs and saved statistics start as NaN

DEVICE = kernel_ladder.runtime.DEVICE


def rand(shape, dtype, gen, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale + shift).to(dtype).to(DEVICE)


def make_input(shape, dtype, layout: str, gen, shift=0.0) -> torch.Tensor:
    """A tensor of logical ``shape`` whose memory layout is ``layout`` (a view, never a copy)."""
    shape = tuple(shape)
    if layout == "contiguous" or len(shape) < 2 and layout == "transposed":
        return rand(shape, dtype, gen, 1.5, shift)
    if layout == "transposed":  # the normalized (last) dim has a large stride
        return rand((*shape[:-2], shape[-1], shape[-2]), dtype, gen, 1.5, shift).transpose(-1, -2)
    if layout == "sliced":  # a step of 2 in the last dim, an offset in the first
        return rand((shape[0] + 1, *shape[1:-1], 2 * shape[-1]), dtype, gen, 1.5, shift)[1:, ..., ::2]
    if layout == "expanded":  # stride 0 in the leading dim: every row the same memory
        return rand((1, *shape[1:]), dtype, gen, 1.5, shift).expand(shape)
    if layout == "permuted":  # leading dims reversed, last dim kept
        lead = list(reversed(range(len(shape) - 1)))
        base = rand([shape[d] for d in lead] + [shape[-1]], dtype, gen, 1.5, shift)
        return base.permute(*[lead.index(d) for d in range(len(shape) - 1)], len(shape) - 1)
    raise AssertionError(layout)


def make_param(n, dtype, gen, strided=False, shift=1.0) -> torch.Tensor:
    if strided:
        return rand((2 * n,), dtype, gen, 0.5, shift)[::2]
    return rand((n,), dtype, gen, 0.5, shift)


def assert_matches(out, reference64, dtype, contiguous=True, **kwargs):
    _assert_matches(out, reference64, dtype, contiguous=contiguous, **kwargs)


# float64 references ------------------------------------------------------------------------------


def rms_reference(x, weight, eps=1e-6):
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def ln_reference(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(x.double(), normalized_shape, None if weight is None else weight.double(),
                        None if bias is None else bias.double(), eps)


def add_reference(x, residual, weight, eps=1e-6):
    s = x + residual  # torch rounds the sum to the dtype, as the kernel does
    return rms_reference(s, weight, eps), s


def float64_grads(fn, inputs, grads):
    """Autograd of ``fn`` in float64 at ``inputs`` (None entries pass through)."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    wanted = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, wanted, [g.double() for g in grads])


OPS = {
    "rms_norm": (lambda x, w, b: rms_norm(x, w), lambda x, w, b: rms_reference(x, w)),
    "layer_norm": (lambda x, w, b: layer_norm(x, x.shape[-1], w, b),
                   lambda x, w, b: ln_reference(x, x.shape[-1:], w, b)),
    "add_rms_norm": (lambda x, w, b: add_rms_norm(x, b.expand_as(x), w)[0],
                     lambda x, w, b: add_reference(x, b.expand_as(x).to(x.dtype), w)[0]),
}

SHAPES = [(1,), (7,), (1, 1), (3, 1), (5, 7), (2, 3, 129), (33, 1000), (4, 2, 300)]


# --------------------------------------------------------------------------- forward values


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_forward_matches_float64_reference_over_shapes(name, shape, gen):
    op, reference = OPS[name]
    x = make_input(shape, torch.float32, "contiguous", gen, shift=0.5)
    w, b = make_param(shape[-1], torch.float32, gen), make_param(shape[-1], torch.float32, gen, shift=0.0)
    assert_matches(op(x, w, b), reference(x, w, b), torch.float32)


def test_rms_norm_matches_torch_and_layer_norm_defaults(gen):
    x = make_input((6, 50), torch.float32, "contiguous", gen)
    w = make_param(50, torch.float32, gen)
    torch.testing.assert_close(rms_norm(x, w), F.rms_norm(x, (50,), w, 1e-6))
    torch.testing.assert_close(rms_norm(x, None, eps=0.5), F.rms_norm(x, (50,), None, 0.5))
    torch.testing.assert_close(layer_norm(x, 50), F.layer_norm(x, (50,)))
    torch.testing.assert_close(layer_norm(x, [50], w, eps=0.1), F.layer_norm(x, (50,), w, None, 0.1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_forward_dtypes(name, dtype, gen):
    op, reference = OPS[name]
    x = make_input((9, 301), dtype, "sliced", gen, shift=1.0)
    w, b = make_param(301, dtype, gen), make_param(301, dtype, gen, shift=0.0)
    assert_matches(op(x, w, b), reference(x, w, b), dtype)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "permuted"])
@pytest.mark.parametrize("name", list(OPS))
def test_forward_honours_strides(name, layout, gen):
    op, reference = OPS[name]
    x = make_input((3, 5, 67), torch.float32, layout, gen, shift=0.5)
    assert not x.is_contiguous()
    w, b = make_param(67, torch.float32, gen, strided=True), make_param(67, torch.float32, gen, True, 0.0)
    assert_matches(op(x, w, b), reference(x, w, b), torch.float32)


def test_layer_norm_over_several_trailing_dims(gen):
    x = make_input((3, 4, 5, 6), torch.float32, "contiguous", gen, shift=2.0)
    for shape in [(6,), (5, 6), (4, 5, 6)]:
        w, b = rand(shape, torch.float32, gen, 0.5, 1.0), rand(shape, torch.float32, gen)
        assert_matches(layer_norm(x, shape, w, b), ln_reference(x, shape, w, b), torch.float32)
    # normalized dims that one stride can walk, in a non-contiguous tensor and weight
    x = rand((7, 10, 12), torch.float32, gen)[::2]
    w = rand((4, 5, 12), torch.float32, gen)[:, 0]  # (4, 12), strides (60, 1): no single stride
    with pytest.raises(ValueError, match=r"weight's normalized dims \(4, 12\) have strides \(60, 1\).*contiguous"):
        layer_norm(x[:, :4, :], (4, 12), w)
    w = rand((10, 12), torch.float32, gen)
    assert_matches(layer_norm(x, (10, 12), w), ln_reference(x, (10, 12), w), torch.float32)


def test_leading_dims_no_operand_can_merge_are_launched_per_slice(gen):
    """Four leading dims in an order no stride merges: several launches, stats and dw partials stitched."""
    x = rand((2, 3, 2, 3, 33), torch.float32, gen).permute(3, 0, 2, 1, 4)
    assert len(_rows.plan_rows([x], 1)) > 1
    w = make_param(33, torch.float32, gen)
    assert_matches(rms_norm(x, w), rms_reference(x, w), torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    dy = rand(x.shape, torch.float32, gen)
    got = torch.autograd.grad(rms_norm(x, w), [x, w], dy)
    for g, want in zip(got, float64_grads(rms_reference, [x, w], [dy])):
        assert_matches(g, want, torch.float32)


@pytest.mark.parametrize("name", list(OPS))
def test_long_rows_chunked_path(name, monkeypatch, gen):
    """Rows past the fused limit (made small here) take the chunked kernels, forward and backward."""
    monkeypatch.setattr(_norm, "MAX_FUSED_BLOCK", 64)
    monkeypatch.setattr(_norm, "MAX_FUSED_BLOCK_BACKWARD", 64)
    monkeypatch.setattr(_norm, "CHUNK_BLOCK", 64)
    monkeypatch.setattr(_launch, "num_sms", lambda device=None: 1)  # 2 programs of 3 rows each
    config = _norm.norm_launch_config(6, 150, backward=True)
    assert config.chunked and (config.programs(6), config.rows_per_program) == (2, 3)
    op, reference = OPS[name]
    x = make_input((6, 150), torch.float32, "transposed", gen, shift=3.0).requires_grad_()
    w = make_param(150, torch.float32, gen).requires_grad_()
    b = make_param(150, torch.float32, gen, shift=0.0).requires_grad_()
    out = op(x, w, b)
    assert_matches(out, reference(x, w, b), torch.float32)
    dy = rand(x.shape, torch.float32, gen)
    got = torch.autograd.grad(out, [x, w, b] if name != "rms_norm" else [x, w], dy)
    want = float64_grads(reference, [x, w, b] if name != "rms_norm" else [x, w, None], [dy])
    for g, expected in zip(got, want):
        assert_matches(g, expected, torch.float32)


@pytest.mark.parametrize("n_cols", [16384, 16500])
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_real_long_rows(name, n_cols, gen):
    """The largest fused row (16384: the forward in one block, the backward chunked) and beyond."""
    op, reference = OPS[name]
    x = make_input((2, n_cols), torch.bfloat16, "contiguous", gen, shift=1.0).requires_grad_()
    w = make_param(n_cols, torch.bfloat16, gen).requires_grad_()
    b = make_param(n_cols, torch.bfloat16, gen, shift=0.0).requires_grad_()
    out = op(x, w, b)
    assert_matches(out, reference(x, w, b), torch.bfloat16)
    dy = rand(x.shape, torch.bfloat16, gen)
    got = torch.autograd.grad(out, [x, w] if name == "rms_norm" else [x, w, b], dy)
    want = float64_grads(reference, [x, w, b] if name == "layer_norm" else [x, w, None], [dy])
    for g, expected in zip(got, want):
        assert_matches(g, expected, torch.bfloat16)


def test_int64_offset_path(monkeypatch, gen):
    """The int64 offset path (taken past 2**31 elements of stride) computes the same values."""
    monkeypatch.setattr(_launch, "INT32_MAX", 100)
    x = make_input((10, 200), torch.float32, "transposed", gen).requires_grad_()
    assert _rows.plan_rows([x], 1)[0].index_64
    w = make_param(200, torch.float32, gen).requires_grad_()
    dy = rand(x.shape, torch.float32, gen)
    for op, reference in (OPS["rms_norm"], OPS["layer_norm"]):
        out = op(x, w, None)
        assert_matches(out, reference(x, w, None), torch.float32)
        got = torch.autograd.grad(out, [x, w], dy)
        for g, want in zip(got, float64_grads(reference, [x, w, None], [dy])):
            assert_matches(g, want, torch.float32)


def test_empty_tensors(gen):
    for shape in [(0, 7), (3, 0), (2, 0, 5)]:
        n = shape[-1]
        x = torch.randn(shape, generator=gen).to(DEVICE).requires_grad_()
        w = torch.randn(n, generator=gen).to(DEVICE).requires_grad_()
        b = torch.randn(n, generator=gen).to(DEVICE).requires_grad_()
        for out, inputs, reference in [
            (rms_norm(x, w), [x, w], F.rms_norm(x, (n,), w)),
            (layer_norm(x, n, w, b), [x, w, b], F.layer_norm(x, (n,), w, b)),
            (add_rms_norm(x, x, w)[0], [x, w], F.rms_norm(x + x, (n,), w)),
        ]:
            assert out.shape == reference.shape == x.shape
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
            want = torch.autograd.grad(reference, inputs, torch.ones_like(out))
            for g, expected in zip(grads, want):
                assert g.shape == expected.shape
                torch.testing.assert_close(g, expected)  # the weight's gradient over no rows is 0


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "permuted"])
def test_rms_norm_backward_matches_float64_autograd(layout, gen):
    x = make_input((4, 3, 130), torch.float32, layout, gen).requires_grad_()
    w = make_param(130, torch.float32, gen, strided=layout != "contiguous").requires_grad_()
    dy = make_input((4, 3, 130), torch.float32, "sliced" if layout == "contiguous" else "contiguous", gen)
    got = torch.autograd.grad(rms_norm(x, w), [x, w], dy)
    want = float64_grads(lambda x, w: F.rms_norm(x, (130,), w, 1e-6), [x, w], [dy])
    for g, expected in zip(got, want):
        assert_matches(g, expected, torch.float32)


@pytest.mark.parametrize("normalized_shape", [(130,), (3, 130)], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_layer_norm_backward_matches_float64_autograd(layout, normalized_shape, gen):
    if layout == "transposed" and len(normalized_shape) == 2:
        layout = "sliced"  # a transposed last pair would not merge (tested as an error)
    x = make_input((4, 3, 130), torch.float32, layout, gen, shift=2.0).requires_grad_()
    w = rand(normalized_shape, torch.float32, gen, 0.5, 1.0).requires_grad_()
    b = rand(normalized_shape, torch.float32, gen).requires_grad_()
    dy = make_input((4, 3, 130), torch.float32, "transposed", gen)
    got = torch.autograd.grad(layer_norm(x, normalized_shape, w, b), [x, w, b], dy)
    want = float64_grads(lambda x, w, b: F.layer_norm(x, normalized_shape, w, b, 1e-5), [x, w, b], [dy])
    for g, expected in zip(got, want):
        assert_matches(g, expected, torch.float32)


def test_add_rms_norm_backward_matches_float64_autograd(gen):
    x = make_input((37, 200), torch.float32, "transposed", gen).requires_grad_()
    r = make_input((37, 200), torch.float32, "contiguous", gen).requires_grad_()
    w = make_param(200, torch.float32, gen, strided=True).requires_grad_()
    dy, ds = rand(x.shape, torch.float32, gen), make_input((37, 200), torch.float32, "sliced", gen)
    normed, s = add_rms_norm(x, r, w)
    dx, dr, dw = torch.autograd.grad((normed, s), [x, r, w], (dy, ds))
    # The reference differentiates with respect to the (rounded) sum itself.
    s64 = (x + r).detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    want_ds, want_dw = torch.autograd.grad((F.rms_norm(s64, (200,), w64, 1e-6), s64), [s64, w64],
                                           (dy.double(), ds.double()))
    assert_matches(dx, want_ds, torch.float32)
    assert_matches(dr, want_ds, torch.float32)
    assert_matches(dw, want_dw, torch.float32)
    # Only the normed output used: the sum's gradient is zero.
    dx, dw = torch.autograd.grad(add_rms_norm(x, r, w)[0], [x, w], dy)
    want_ds, want_dw = torch.autograd.grad(F.rms_norm(s64, (200,), w64, 1e-6), [s64, w64], dy.double())
    assert_matches(dx, want_ds, torch.float32)
    assert_matches(dw, want_dw, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_backward_half_precision(name, dtype, gen):
    op, reference = OPS[name]
    x = make_input((40, 151), dtype, "contiguous", gen, shift=1.0).requires_grad_()
    w = make_param(151, dtype, gen).requires_grad_()
    b = make_param(151, dtype, gen, shift=0.0).requires_grad_()
    inputs = [x, w, b] if name == "layer_norm" else [x, w]
    dy = rand(x.shape, dtype, gen)
    got = torch.autograd.grad(op(x, w, b), inputs, dy)
    if name == "add_rms_norm":  # differentiated with respect to the rounded sum
        want = float64_grads(lambda s, w: rms_reference(s, w), [x + b, w], [dy])
    else:
        want = float64_grads(reference, [x, w, b if name == "layer_norm" else None], [dy])
    for g, expected in zip(got, want):
        assert_matches(g, expected, dtype)


def test_backward_formulas_in_the_docstrings_equal_autograd(gen):
    """The closed forms the kernels implement (kernel_ladder/ops/rms_norm.py, ops/layer_norm.py), in float64."""
    x, w = rand((6, 40), torch.float64, gen, shift=1.0), rand((40,), torch.float64, gen)
    dy = rand((6, 40), torch.float64, gen)
    g = dy * w
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat = x * rstd
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    want = float64_grads(lambda x, w: F.rms_norm(x, (40,), w, 1e-6), [x, w], [dy])
    torch.testing.assert_close(dx, want[0])
    torch.testing.assert_close((dy * xhat).sum(0), want[1])
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    xhat = (x - mean) * rstd
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    want = float64_grads(lambda x, w: F.layer_norm(x, (40,), w, None, 1e-5), [x, w], [dy])
    torch.testing.assert_close(dx, want[0])
    torch.testing.assert_close((dy * xhat).sum(0), want[1])


def test_parameters_without_weight_bias_or_grad(gen):
    x = make_input((12, 90), torch.float32, "contiguous", gen, shift=1.0).requires_grad_()
    dy = rand(x.shape, torch.float32, gen)
    w = make_param(90, torch.float32, gen)  # does not require grad
    (dx,) = torch.autograd.grad(rms_norm(x, None), [x], dy)
    assert_matches(dx, float64_grads(lambda x: rms_reference(x, None), [x], [dy])[0], torch.float32)
    (dx,) = torch.autograd.grad(rms_norm(x, w), [x], dy)
    assert_matches(dx, float64_grads(lambda x: rms_reference(x, w), [x], [dy])[0], torch.float32)
    b = make_param(90, torch.float32, gen).requires_grad_()
    dx, db = torch.autograd.grad(layer_norm(x, 90, None, b), [x, b], dy)
    want = float64_grads(lambda x, b: ln_reference(x, (90,), None, b), [x, b], [dy])
    assert_matches(dx, want[0], torch.float32)
    assert_matches(db, want[1], torch.float32)
    assert_matches(layer_norm(x, 90), ln_reference(x, (90,)), torch.float32)


def test_weight_gradient_is_deterministic(gen):
    x = make_input((300, 70), torch.float32, "contiguous", gen).requires_grad_()
    w = make_param(70, torch.float32, gen).requires_grad_()
    dy = rand(x.shape, torch.float32, gen)
    first = torch.autograd.grad(layer_norm(x, 70, w, w), [w], dy)[0]
    second = torch.autograd.grad(layer_norm(x, 70, w, w), [w], dy)[0]
    assert torch.equal(first, second)


# --------------------------------------------------------------------------- add_rms_norm specifics


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_rounds_the_sum_first(dtype, gen):
    x = make_input((21, 130), dtype, "contiguous", gen)
    r = make_input((21, 130), dtype, "transposed", gen)
    w = make_param(130, dtype, gen)
    normed, s = add_rms_norm(x, r, w)
    assert torch.equal(s, x + r)  # exactly torch's sum in the dtype
    assert s.is_contiguous() and normed.is_contiguous()
    # normalized from the rounded sum: the unfused two-step computation
    assert_matches(normed, rms_reference(x + r, w), dtype)
    torch.testing.assert_close(normed, rms_norm(x + r, w), rtol=0, atol=0)


# --------------------------------------------------------------------------- the launch rule


def test_launch_config_fills_the_gpu_and_keeps_partials_small(monkeypatch):
    monkeypatch.setattr(_launch, "num_sms", lambda device=None: 132)  # an H200
    for n_rows in [1, 7, 300, 8192, 65536, 10**6]:
        for n_cols in [1, 64, 77, 1000, 4096, 8192, 16384, 20000]:
            for backward in (False, True):
                c = _norm.norm_launch_config(n_rows, n_cols, backward=backward)
                assert c.rows_per_program % c.block_rows == 0
                programs = c.programs(n_rows)
                assert programs * c.rows_per_program >= n_rows > (programs - 1) * c.rows_per_program
                if backward:
                    assert programs <= 2 * 132  # the (n_programs, N) partial buffer: at most 264 rows
                else:
                    assert c.rows_per_program <= max(32, c.block_rows)  # the weight read once per 32 rows
                limit = _norm.MAX_FUSED_BLOCK_BACKWARD if backward else _norm.MAX_FUSED_BLOCK
                assert c.chunked == (n_cols > limit)
                assert c.block_cols >= (n_cols if not c.chunked else 1)
                assert c.block_rows * c.block_cols <= max(4096, c.block_cols)
                if n_rows >= 264 * c.block_rows:
                    assert programs >= 132  # every SM has a program
    c = _norm.norm_launch_config(8192, 4096, backward=True)
    assert (c.block_rows, c.rows_per_program, c.programs(8192)) == (1, 32, 256)
    c = _norm.norm_launch_config(65536, 4096, backward=True)
    assert (c.rows_per_program, c.programs(65536)) == (249, 264)
    c = _norm.norm_launch_config(65536, 4096)
    assert (c.rows_per_program, c.programs(65536)) == (32, 2048)
    # The forward's floor: 16 rows per parameter vector, while every SM keeps a program.
    c = _norm.norm_launch_config(4096, 4096)
    assert (c.rows_per_program, c.programs(4096)) == (16, 256)
    assert _norm.norm_launch_config(4096, 4096, params=2).rows_per_program == 31  # 4096 // 132 tiles
    assert _norm.norm_launch_config(64, 4096).programs(64) == 64  # decode: fill the SMs first


# --------------------------------------------------------------------------- memory traffic


def _traced(fn):
    from utils.trace import trace

    with trace(torch_ops=False) as t:
        fn()
    return t


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape, layout",
    [((3, 67, 1000), "contiguous"), ((301, 77), "sliced"), ((1001, 3), "transposed"), ((64, 1000), "contiguous")],
    ids=str,
)
def test_forward_kernels_move_the_ideal_bytes(shape, layout, dtype, gen):
    """x read once, weight/bias once per program (>= 16 rows per parameter vector share it), y once, stats.

    (64, 1000) is the report's size: few enough rows that the parameter re-reads would pass 5% of
    the traffic without the forward's floor on rows per program.
    """
    from utils.trace import ideal_bytes

    n = shape[-1]
    x, r = make_input(shape, dtype, layout, gen), make_input(shape, dtype, "contiguous", gen)
    w, b = make_param(n, dtype, gen), make_param(n, dtype, gen)
    rows = x.numel() // n
    cases = {
        "rms_norm_kernel": (lambda: rms_norm(x, w), ideal_bytes(x, w, x) + 4 * rows),
        "layer_norm_kernel": (lambda: layer_norm(x, n, w, b), ideal_bytes(x, w, b, x) + 8 * rows),
        "add_rms_norm_kernel": (lambda: add_rms_norm(x, r, w), ideal_bytes(x, r, w, x, x) + 4 * rows),
    }
    for kernel, (fn, ideal) in cases.items():
        t = _traced(fn)
        assert [launch.kernel for launch in t.launches] == [kernel]
        assert t.out_of_bounds == 0
        assert ideal <= t.bytes <= 1.05 * ideal, (kernel, t.bytes / ideal)


@pytest.mark.interpreter
def test_chunked_forward_rereads_but_touches_each_byte_once(monkeypatch, gen):
    """Long rows are read twice (and the weight once per row); a cache holding one row sees x once."""
    from utils.trace import SECTOR_BYTES, ideal_bytes

    monkeypatch.setattr(_norm, "MAX_FUSED_BLOCK", 256)
    monkeypatch.setattr(_norm, "CHUNK_BLOCK", 128)
    x, w = rand((40, 1000), torch.float32, gen), make_param(1000, torch.float32, gen)
    t = _traced(lambda: rms_norm(x, w))
    ideal = ideal_bytes(x, w, x) + 4 * 40
    assert t.bytes == 2 * x.nbytes + x.nbytes + 40 * w.nbytes + 4 * 40  # x twice, y once, w per row
    assert t.unique_sectors * SECTOR_BYTES <= 1.01 * ideal


@pytest.mark.interpreter
def test_backward_traffic_and_two_stage_weight_gradient(gen):
    """dx from one pass over dy and x; dw/db through (n_programs, N) partial rows and column sums."""
    from utils.trace import ideal_bytes

    x = make_input((3, 67, 1000), torch.bfloat16, "contiguous", gen).requires_grad_()
    w = make_param(1000, torch.bfloat16, gen).requires_grad_()
    b = make_param(1000, torch.bfloat16, gen).requires_grad_()
    dy = rand(x.shape, torch.bfloat16, gen)
    rows = 201
    out = layer_norm(x, 1000, w, b)
    t = _traced(lambda: torch.autograd.grad(out, [x, w, b], dy))
    kernels_run = [launch.kernel for launch in t.launches]
    assert kernels_run == ["layer_norm_backward_kernel", "column_sum_kernel", "column_sum_kernel"]
    assert all(launch.atomics == 0 for launch in t.launches)
    programs = t.launches[0].grid[0]
    partial_bytes = 2 * programs * 1000 * 4  # dw and db partial rows, written once and read once
    ideal = ideal_bytes(dy, x, x, w, w, b) + 8 * rows
    assert t.launches[0].bytes_written == x.nbytes + partial_bytes
    assert t.bytes == ideal + 2 * partial_bytes + programs * w.nbytes - w.nbytes  # weight once per program
    assert t.bytes <= 1.2 * ideal
    # a weight that needs no gradient: no partials, no second stage
    w.requires_grad_(False)
    b.requires_grad_(False)
    out = rms_norm(x, w)
    t = _traced(lambda: torch.autograd.grad(out, [x], dy))
    assert [launch.kernel for launch in t.launches] == ["rms_norm_backward_kernel"]
    assert t.bytes == ideal_bytes(dy, x, x) + 4 * rows + programs * w.nbytes


# --------------------------------------------------------------------------- custom-op plumbing


def _opcheck_cases(gen):
    x = make_input((5, 7), torch.float32, "contiguous", gen)
    xt = make_input((5, 7), torch.float32, "transposed", gen)
    w = make_param(7, torch.float32, gen, strided=True)
    x3 = make_input((2, 3, 4), torch.float32, "contiguous", gen)
    w2 = rand((3, 4), torch.float32, gen)
    ops = torch.ops.kernel_ladder
    rstd = ops.rms_norm(x, w, 1e-6)[1]
    _, mean3, rstd3 = ops.layer_norm(x3, [3, 4], w2, w2, 1e-5)
    _, s, rstd_s = ops.add_rms_norm(x, xt, w, 1e-6)
    return {
        "rms_norm": (ops.rms_norm.default, (xt, w, 1e-6)),
        "rms_norm_no_weight": (ops.rms_norm.default, (x, None, 1e-6)),
        "rms_norm_backward": (ops.rms_norm_backward.default, (xt, x, w, rstd, True)),
        "layer_norm": (ops.layer_norm.default, (x3, [3, 4], w2, w2, 1e-5)),
        "layer_norm_no_params": (ops.layer_norm.default, (xt, [7], None, None, 1e-5)),
        "layer_norm_backward": (ops.layer_norm_backward.default, (x3, x3, [3, 4], w2, mean3, rstd3, True, True)),
        "add_rms_norm": (ops.add_rms_norm.default, (x, xt, w, 1e-6)),
        "add_rms_norm_backward": (ops.add_rms_norm_backward.default, (xt, x, s, w, rstd_s, True)),
    }


@pytest.mark.parametrize(
    "case", ["rms_norm", "rms_norm_no_weight", "rms_norm_backward", "layer_norm", "layer_norm_no_params",
             "layer_norm_backward", "add_rms_norm", "add_rms_norm_backward"],
)
def test_opcheck(case, gen):
    op, args = _opcheck_cases(gen)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", list(OPS))
def test_torch_compile_fullgraph_forward_and_backward(name, gen):
    op = (lambda x, w, b: add_rms_norm(x, b, w)) if name == "add_rms_norm" else OPS[name][0]
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)
    x = make_input((9, 70), torch.float32, "contiguous", gen).requires_grad_()
    w = make_param(70, torch.float32, gen).requires_grad_()
    b = (make_input((9, 70), torch.float32, "contiguous", gen) if name == "add_rms_norm"
         else make_param(70, torch.float32, gen)).requires_grad_()
    inputs = [x, w, b] if name != "rms_norm" else [x, w]
    dy = [make_input((9, 70), torch.float32, "contiguous", gen) for _ in range(2 if name == "add_rms_norm" else 1)]
    got = compiled(x, w, b)
    got_grads = torch.autograd.grad(got, inputs, dy)
    want = op(x, w, b)
    want_grads = torch.autograd.grad(want, inputs, dy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(g, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(OPS))
def test_torch_compile_dynamic_shapes(name, gen):
    # dynamic=True hands the checks SymInts (layer_norm's normalized_shape taken from x.shape) and
    # SymFloats (eps): both must trace, and one graph must serve two shapes.
    op = (lambda x, w, b: add_rms_norm(x, b, w)) if name == "add_rms_norm" else OPS[name][0]
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True, dynamic=True)
    for rows, cols in ((5, 70), (9, 33)):
        x = make_input((rows, cols), torch.float32, "contiguous", gen).requires_grad_()
        w = make_param(cols, torch.float32, gen).requires_grad_()
        b = (make_input((rows, cols), torch.float32, "contiguous", gen) if name == "add_rms_norm"
             else make_param(cols, torch.float32, gen)).requires_grad_()
        inputs = [x, w, b] if name != "rms_norm" else [x, w]
        got, want = compiled(x, w, b), op(x, w, b)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        dy = [make_input((rows, cols), torch.float32, "contiguous", gen) for _ in got]
        for g, expected in zip([*got, *torch.autograd.grad(got, inputs, dy)],
                               [*want, *torch.autograd.grad(want, inputs, dy)]):
            torch.testing.assert_close(g, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- the host path


def test_an_input_is_checked_and_planned_once_and_crosses_each_module_once(gen):
    """Following ``x`` through a call (utils.call_path): the op's check and plan run once
    (``check_norm``), and no module is entered twice; ``rms_norm`` in at most 12 calls."""
    x, residual = rand((4, 32), torch.float32, gen), rand((4, 32), torch.float32, gen)
    w, b = make_param(32, torch.float32, gen), make_param(32, torch.float32, gen)
    for name, call in [("rms_norm", lambda: rms_norm(x, w)), ("layer_norm", lambda: layer_norm(x, 32, w, b)),
                       ("add_rms_norm", lambda: add_rms_norm(x, residual, w))]:
        call()  # the launch plan's caches warm
        path = argument_path(call, watch=x)
        assert [step.function for step in path].count("check_norm") == 1, f"{name}:\n{path}"
        assert all(path.visits(file) == 1 for file in path.files), f"{name}:\n{path}"
        if name == "rms_norm":
            assert len(path) <= 12, f"{name}:\n{path}"


# --------------------------------------------------------------------------- bad input

_X = torch.ones(4, 8)
_W = torch.ones(8)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: rms_norm([1.0], _W), TypeError, r"^kernel_ladder\.rms_norm: x must be a torch\.Tensor, got list"),
        (lambda: rms_norm(torch.ones(4, 8, dtype=torch.int64), _W), TypeError,
         r"^kernel_ladder\.rms_norm: x must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: rms_norm(torch.ones(4, 8, dtype=torch.float64), _W), TypeError,
         r"^kernel_ladder\.rms_norm: x must be .*got torch\.float64"),
        (lambda: rms_norm(torch.tensor(1.0), _W), ValueError,
         r"^kernel_ladder\.rms_norm: x must have at least one dim"),
        (lambda: rms_norm(_X, torch.ones(7)), ValueError,
         r"^kernel_ladder\.rms_norm: weight must have shape \(8,\) \(x's last dim\), got \(7,\)"),
        (lambda: rms_norm(_X, torch.ones(1, 8)), ValueError,
         r"^kernel_ladder\.rms_norm: weight must have shape \(8,\)"),
        (lambda: rms_norm(_X, torch.ones(8, dtype=torch.bfloat16)), TypeError,
         r"^kernel_ladder\.rms_norm: x and weight must have the same dtype, got torch\.float32 and torch\.bfloat16"),
        (lambda: rms_norm(_X, torch.ones(8, device="meta")), ValueError,
         r"^kernel_ladder\.rms_norm: x and weight must be on the same device, got cpu and meta"),
        (lambda: rms_norm(_X, "w"), TypeError, r"^kernel_ladder\.rms_norm: weight must be a torch\.Tensor, got str"),
        (lambda: rms_norm(_X, _W, eps=0.0), ValueError,
         r"^kernel_ladder\.rms_norm: eps must be a finite number > 0, got 0\.0"),
        (lambda: rms_norm(_X, _W, eps=-1e-6), ValueError, r"^kernel_ladder\.rms_norm: eps must be a finite number > 0"),
        (lambda: rms_norm(_X, _W, eps=math.inf), ValueError,
         r"^kernel_ladder\.rms_norm: eps must be a finite .*, got inf"),
        (lambda: rms_norm(_X, _W, eps=math.nan), ValueError,
         r"^kernel_ladder\.rms_norm: eps must be a finite .*, got nan"),
        (lambda: rms_norm(_X, _W, eps="1e-6"), TypeError,
         r"^kernel_ladder\.rms_norm: eps must be a positive float, got str"),
        (lambda: rms_norm(_X, _W, eps=True), TypeError,
         r"^kernel_ladder\.rms_norm: eps must be a positive float, got bool"),
        (lambda: layer_norm(_X, 7), ValueError,
         r"^kernel_ladder\.layer_norm: x of shape \(4, 8\) must end in the normalized shape \(7,\)"),
        (lambda: layer_norm(_X, (3, 4, 8)), ValueError, r"^kernel_ladder\.layer_norm: x of shape \(4, 8\) must end in"),
        (lambda: layer_norm(_X, ()), ValueError,
         r"^kernel_ladder\.layer_norm: normalized_shape must name at least one dim"),
        (lambda: layer_norm(_X, (-8,)), ValueError,
         r"^kernel_ladder\.layer_norm: normalized_shape must have non-negative"),
        (lambda: layer_norm(_X, 8.0), TypeError,
         r"^kernel_ladder\.layer_norm: normalized_shape must be an int or a sequence of ints, got float"),
        (lambda: layer_norm(_X, (8.0,)), TypeError,
         r"^kernel_ladder\.layer_norm: normalized_shape must be .* type float"),
        (lambda: layer_norm(_X, 8, torch.ones(4)), ValueError,
         r"^kernel_ladder\.layer_norm: weight must have shape \(8,\) \(normalized_shape\), got \(4,\)"),
        (lambda: layer_norm(_X, 8, None, torch.ones(8, dtype=torch.float16)), TypeError,
         r"^kernel_ladder\.layer_norm: x and bias must have the same dtype"),
        (lambda: layer_norm(_X, 8, None, torch.ones(8, dtype=torch.int32)), TypeError,
         r"^kernel_ladder\.layer_norm: bias must be float32, float16 or bfloat16, got torch\.int32"),
        (lambda: layer_norm(_X, 8, eps=0), ValueError, r"^kernel_ladder\.layer_norm: eps must be a finite number > 0"),
        (lambda: layer_norm(torch.ones(3, 4, 5).transpose(1, 2), (5, 4)), ValueError,
         r"^kernel_ladder\.layer_norm: x's normalized dims \(5, 4\) have strides \(1, 5\), which one stride cannot "
         r"walk; call x\.contiguous\(\) first"),
        (lambda: layer_norm(torch.ones(4, 8, dtype=torch.float64), 8), TypeError,
         r"^kernel_ladder\.layer_norm: x must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: add_rms_norm(_X, torch.ones(4, 7), _W), ValueError,
         r"^kernel_ladder\.add_rms_norm: x and residual must have the same shape, got \(4, 8\) and \(4, 7\)"),
        (lambda: add_rms_norm(_X, _X.half(), _W), TypeError,
         r"^kernel_ladder\.add_rms_norm: x and residual must have the same dtype"),
        (lambda: add_rms_norm(_X, torch.ones(4, 8, device="meta"), _W), ValueError,
         r"^kernel_ladder\.add_rms_norm: x and residual must be on the same device"),
        (lambda: add_rms_norm(_X, 1.0, _W), TypeError,
         r"^kernel_ladder\.add_rms_norm: residual must be a torch\.Tensor"),
        (lambda: add_rms_norm(_X, _X, torch.ones(9)), ValueError,
         r"^kernel_ladder\.add_rms_norm: weight must have shape \(8,\)"),
        (lambda: add_rms_norm(_X, _X, _W, eps=-1.0), ValueError, r"^kernel_ladder\.add_rms_norm: eps must be"),
        (lambda: add_rms_norm(_X.long(), _X.long(), _W), TypeError, r"^kernel_ladder\.add_rms_norm: x must be float32"),
        # the raw custom ops validate too (and so do their fakes, under torch.compile)
        (lambda: torch.ops.kernel_ladder.rms_norm(_X, torch.ones(3), 1e-6), ValueError,
         r"^kernel_ladder\.rms_norm: weight must have shape"),
        (lambda: torch.ops.kernel_ladder.layer_norm(_X, [8], None, None, 0.0), ValueError,
         r"^kernel_ladder\.layer_norm: eps"),
        (lambda: torch.ops.kernel_ladder.rms_norm(torch.ones(2, 8, device="meta"), None, -1.0), ValueError,
         r"^kernel_ladder\.rms_norm: eps"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------- GPU sizes


GPU_GRAD_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", [4096, 8192, 16384, 65536])
def test_gpu_real_sizes(dtype, n_cols):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = 2**24 // n_cols
    x = torch.randn(rows, n_cols, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (torch.rand(n_cols, device="cuda", generator=gen) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(n_cols, device="cuda", generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(rows, n_cols, device="cuda", generator=gen).to(dtype)
    for op, reference, inputs in [
        (lambda: rms_norm(x, w), lambda x, w: F.rms_norm(x, (n_cols,), w, 1e-6), [x, w]),
        (lambda: layer_norm(x, n_cols, w, b), lambda x, w, b: F.layer_norm(x, (n_cols,), w, b), [x, w, b]),
    ]:
        out = op()
        assert_matches(out, reference(*(t.detach().double() for t in inputs)), dtype)
        got = torch.autograd.grad(out, inputs, dy)
        want = float64_grads(reference, inputs, [dy])
        for g, expected in zip(got, want):
            # dw/db sum thousands of rows: errors are judged against each gradient's own scale
            error = (g.double() - expected).abs().max().item()
            assert error <= GPU_GRAD_TOLERANCE[dtype] * expected.abs().max().item(), (g.shape, error)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """More than 2**31 elements: row starts and offsets in int64."""
    n_cols = 4096
    rows = 2**31 // n_cols + 5
    x = torch.randn(rows, n_cols, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(n_cols, device="cuda", dtype=torch.bfloat16)
    y = rms_norm(x, w)
    for where in (slice(0, 4), slice(rows - 4, rows)):
        assert_matches(y[where], rms_reference(x[where], w), torch.bfloat16)


# --------------------------------------------------------------------------- rms_norm's options


def hf_llama_rms_norm(x, weight, rstd):
    """Hugging Face's LlamaRMSNorm, transcribed, with a given float32 rstd: round, then scale in x's dtype."""
    h = x.to(torch.float32) * rstd[..., None]
    return weight * h.to(x.dtype)


def hf_gemma_rms_norm(x, weight, rstd):
    """Hugging Face's GemmaRMSNorm, transcribed, with a given float32 rstd: all in float32, (1 + w)."""
    out = x.float() * rstd[..., None]
    return (out * (1.0 + weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n_cols", [77, 300])  # a few rows per tile, and one
def test_casting_modes_reproduce_hugging_face_bit_for_bit(dtype, n_cols, gen):
    """Given the same float32 rstd, 'llama' and 'gemma' (offset 1) equal HF's modules to the last bit,
    and 'none' is F.rms_norm's one rounding; the modes really differ (a negative control)."""
    x = make_input((33, n_cols), dtype, "contiguous", gen)
    w = make_param(n_cols, dtype, gen)
    rms = torch.ops.kernel_ladder.rms_norm
    llama, rstd = rms(x, w, 1e-6, 0.0, "llama", False)
    assert torch.equal(llama, hf_llama_rms_norm(x, w, rstd))
    gemma, rstd_g = rms(x, w, 1e-6, 1.0, "gemma", False)
    assert torch.equal(rstd_g, rstd) and torch.equal(gemma, hf_gemma_rms_norm(x, w, rstd))
    none, _ = rms(x, w, 1e-6, 0.0, "none", False)
    assert torch.equal(none, (x.float() * rstd[:, None] * w.float()).to(dtype))
    assert not torch.equal(llama, none)  # two roundings against one: some elements differ
    assert_matches(kernel_ladder.rms_norm(x, w, casting="llama"), rms_reference(x, w), dtype)


def test_casting_modes_against_transformers_modules(gen):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    x = make_input((64, 256), torch.bfloat16, "contiguous", gen)
    w = make_param(256, torch.bfloat16, gen)
    hf_llama = llama.LlamaRMSNorm(256, eps=1e-6).to(DEVICE, torch.bfloat16)
    hf_gemma = gemma.GemmaRMSNorm(256, eps=1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        hf_llama.weight.copy_(w)
        hf_gemma.weight.copy_(w - 1.0)
        ours_and_theirs = [(kernel_ladder.rms_norm(x, w, casting="llama"), hf_llama(x)),
                           (kernel_ladder.rms_norm(x, w - 1.0, offset=1.0, casting="gemma"), hf_gemma(x))]
    for ours, theirs in ours_and_theirs:
        # Only rstd's last bit (an fp32 sum in another order) can differ: one bf16 step, rarely.
        differ = ours != theirs
        assert differ.float().mean().item() <= 1e-3
        assert ((ours.float() - theirs.float()).abs() <= 2 ** -7 * theirs.float().abs().clamp_min(1e-3)).all()


@pytest.mark.parametrize("offset", [1.0, -0.5])
def test_offset_shifts_the_weight_forward_and_backward(offset, gen):
    x = make_input((9, 70), torch.float32, "transposed", gen).requires_grad_()
    w = make_param(70, torch.float32, gen).requires_grad_()
    y = kernel_ladder.rms_norm(x, w, offset=offset)
    g = make_input((9, 70), torch.float32, "contiguous", gen)
    dx, dw = torch.autograd.grad(y, [x, w], g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = rms_reference(x64, w64 + offset)
    tx, tw = torch.autograd.grad(want, [x64, w64], g.double())
    assert_matches(y, want, torch.float32)
    assert_matches(dx, tx, torch.float32)
    assert_matches(dw, tw, torch.float32, slack=2.0)


def test_in_place_backward_reuses_the_incoming_gradient(gen):
    """dx is written over grad_out's buffer (its data_ptr), equal to the out-of-place result; with
    create_graph the out-of-place op runs; and the documented hazard: the caller's tensor is gone."""
    x = make_input((16, 96), torch.float32, "contiguous", gen).requires_grad_()
    w = make_param(96, torch.float32, gen).requires_grad_()
    g = make_input((16, 96), torch.float32, "contiguous", gen)
    want = torch.autograd.grad(kernel_ladder.rms_norm(x, w), [x, w], g)
    g_in_place = g.clone()
    got = torch.autograd.grad(kernel_ladder.rms_norm(x, w, in_place_backward=True), [x, w], g_in_place)
    assert got[0].data_ptr() == g_in_place.data_ptr()  # the buffer was reused ...
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert torch.equal(g_in_place, want[0])  # ... so the caller's gradient now holds dx: the aliasing rule
    # A stride-0 gradient (y.sum().backward() hands down ones.expand(...)) cannot be written in
    # place: the out-of-place op runs, with the same result.
    (dx_sum,) = torch.autograd.grad(kernel_ladder.rms_norm(x, w, in_place_backward=True).sum(), [x])
    (want_sum,) = torch.autograd.grad(kernel_ladder.rms_norm(x, w).sum(), [x])
    torch.testing.assert_close(dx_sum, want_sum, rtol=0, atol=0)
    # Under create_graph (a gradient that is itself differentiated) the out-of-place op runs too.
    g_graph = g.clone()
    (dx_graph,) = torch.autograd.grad(kernel_ladder.rms_norm(x, w, in_place_backward=True), [x], g_graph,
                                      create_graph=True)
    assert dx_graph.data_ptr() != g_graph.data_ptr() and torch.equal(g_graph, g)


def test_in_place_backward_lowers_peak_memory(gen):
    x = make_input((64, 512), torch.float32, "contiguous", gen).requires_grad_()
    w = make_param(512, torch.float32, gen)
    peaks = {}
    for in_place in (False, True):
        y = kernel_ladder.rms_norm(x, w, in_place_backward=in_place)
        g = torch.randn(y.shape, generator=gen).to(DEVICE)
        with peak_memory() as peak:
            (dx,) = torch.autograd.grad(y, [x], g)
        peaks[in_place] = peak.peak_bytes
        del dx
    assert peaks[True] <= peaks[False] - x.nbytes, peaks


def test_rms_norm_options_opcheck_compile_and_errors(gen):
    x = make_input((6, 40), torch.float32, "contiguous", gen)
    w = make_param(40, torch.float32, gen)
    torch.library.opcheck(torch.ops.kernel_ladder.rms_norm.default, (x, w, 1e-6, 1.0, "llama", True))
    y, rstd = torch.ops.kernel_ladder.rms_norm(x, w, 1e-6, 1.0, "gemma", False)
    g = make_input((6, 40), torch.float32, "contiguous", gen)
    torch.library.opcheck(torch.ops.kernel_ladder.rms_norm_backward_inplace.default, (g.clone(), x, w, rstd, True, 1.0))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: kernel_ladder.rms_norm(a, b, offset=1.0, casting="llama"), fullgraph=True)
    xg = x.clone().requires_grad_()
    torch.testing.assert_close(compiled(xg, w), kernel_ladder.rms_norm(x, w, offset=1.0, casting="llama"),
                               rtol=0, atol=0)
    compiled(xg, w).sum().backward()
    assert xg.grad is not None
    for kwargs, error, message in [
        (dict(casting="fp32"), ValueError,
         r"kernel_ladder\.rms_norm: casting must be one of \('none', 'llama', 'gemma'\)"),
        (dict(offset=float("nan")), ValueError, r"offset must be a finite number"),
        (dict(offset="1"), TypeError, r"offset must be a float"),
        (dict(in_place_backward=1), TypeError, r"in_place_backward must be a bool"),
    ]:
        with pytest.raises(error, match=message):
            kernel_ladder.rms_norm(x, w, **kwargs)
    with pytest.raises(ValueError, match=r"offset=1\.0 needs a weight"):
        kernel_ladder.rms_norm(x, None, offset=1.0)
