"""kernel_ladder.quantized_linear: values, layouts, dtypes, split-K, W8A8, traffic, custom-op plumbing, errors.

Weight-only results are compared with ``F.linear(x, qweight.dequantize(), bias)`` in float64 —
the quantization itself is tested in test_kernels_quantize.py, so the only differences allowed
here are fp32 accumulation and the output's rounding. W8A8 results are compared with the same
product computed from torch's own per-token int8 quantization of x, in int64. Outputs are
poisoned (NaN) before the kernels write them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, TOLERANCES
from helpers import assert_matches as _assert_matches

import kernel_ladder
from kernel_ladder import QuantizedLinearConfig, quantize_weight, quantized_linear
from kernel_ladder.ops import quantized_linear as QL

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the op allocates starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
# Relative to the output's largest magnitude (a K-long fp32 sum: twice one rounding; bf16's own
# rounding already dominates); fp32 leaves room for TF32 on a GPU.
TOLERANCE = {dtype: TOLERANCES[dtype][0] * (1 if dtype == torch.bfloat16 else 2) for dtype in DTYPES}
SCHEMES = [("int8", None), ("fp8", None), ("int4", 32), ("int4", 128)]


@pytest.fixture(autouse=True)
def no_grad_by_default():
    with torch.no_grad():
        yield


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def make_layer(n, k, scheme, group_size, gen, dtype=torch.float32):
    w = randn(n, k, gen=gen, scale=max(k, 1) ** -0.5)
    return w, quantize_weight(w, scheme, group_size=group_size), randn(n, gen=gen, dtype=dtype)


def reference(x, qweight, bias=None):
    b = bias.double() if bias is not None else None
    return F.linear(x.double(), qweight.dequantize(torch.float64), b)


def assert_matches(out, expected, dtype):
    scale = expected.abs().max().item() if expected.numel() else 1.0
    _assert_matches(out, expected, dtype, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * max(scale, 1e-6))


# --------------------------------------------------------------------------- weight-only values


@pytest.mark.parametrize("scheme,group_size", SCHEMES)
@pytest.mark.parametrize("x_shape,n,bias", [((1, 256), 64, True), ((5, 300), 97, False), ((2, 3, 129), 130, True)])
def test_weight_only_matches_dequantized_linear(scheme, group_size, x_shape, n, bias, gen):
    """M = 1 (decode) up; K and N off the tile and the group size; leading dims."""
    k = x_shape[-1]
    _, qw, b = make_layer(n, k, scheme, group_size, gen)
    b = b if bias else None
    x = randn(*x_shape, gen=gen)
    assert_matches(quantized_linear(x, qw, b), reference(x, qw, b), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme,group_size", SCHEMES[:3])
def test_dtypes(dtype, scheme, group_size, gen):
    _, qw, bias = make_layer(72, 200, scheme, group_size, gen, dtype=dtype)
    x = randn(3, 200, gen=gen, dtype=dtype)
    assert_matches(quantized_linear(x, qw, bias), reference(x, qw, bias), dtype)


def test_weights_from_any_dtype_serve_any_activation_dtype(gen):
    """The weight's original dtype only sets what dequantize() returns."""
    w = randn(40, 96, gen=gen, dtype=torch.bfloat16)
    qw = quantize_weight(w, "int4", group_size=32)
    x = randn(4, 96, gen=gen, dtype=torch.float16)
    assert_matches(quantized_linear(x, qw), reference(x, qw), torch.float16)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "unmergeable", "expanded"])
def test_strided_inputs_are_read_in_place(layout, gen, monkeypatch):
    _, qw, _ = make_layer(50, 96, "int4", 32, gen)
    bias_base = randn(100, gen=gen)
    bias = bias_base[::2]  # stride 2
    if layout == "transposed":
        x = randn(96, 6, gen=gen).t()
    elif layout == "sliced":
        x = randn(7, 200, gen=gen)[1:, 3:99]
    elif layout == "unmergeable":
        x = randn(3, 4, 96, gen=gen).transpose(0, 1)[:, ::2]  # (4, 2, 96): leading dims do not merge
    else:
        x = randn(1, 96, gen=gen).expand(5, 96)
    copies = []
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **k: copies.append(1) or self)
    out = quantized_linear(x, qw, bias)
    assert not copies
    assert_matches(out, reference(x, qw, bias), torch.float32)


@pytest.mark.parametrize("scheme,group_size", SCHEMES[:3])
def test_empty_and_degenerate_shapes(scheme, group_size, gen):
    _, qw, bias = make_layer(10, 64, scheme, group_size, gen)
    assert quantized_linear(torch.empty(0, 64, device=DEVICE), qw, bias).shape == (0, 10)
    assert quantized_linear(torch.empty(2, 0, 64, device=DEVICE), qw).shape == (2, 0, 10)
    _, q_empty_n, _ = make_layer(0, 64, scheme, group_size, gen)
    assert quantized_linear(randn(3, 64, gen=gen), q_empty_n).shape == (3, 0)
    _, q_k0, bias_k0 = make_layer(10, 0, scheme, group_size, gen)
    out = quantized_linear(torch.empty(3, 0, device=DEVICE), q_k0, bias_k0)
    assert torch.equal(out, bias_k0.expand(3, 10))  # written: the poison is gone
    assert torch.equal(quantized_linear(torch.empty(2, 0, device=DEVICE), q_k0), torch.zeros(2, 10))
    x1 = randn(64, gen=gen)  # 1-D x: a single row, like F.linear
    assert_matches(quantized_linear(x1, qw, bias), reference(x1, qw, bias), torch.float32)


# --------------------------------------------------------------------------- configurations


@pytest.mark.parametrize("scheme,group_size", SCHEMES[:3])
@pytest.mark.parametrize("config", [QuantizedLinearConfig(16, 32, 32, 3, 4, 1),
                                    QuantizedLinearConfig(32, 64, 32, 64, 4, 1)])
def test_explicit_configs_and_split_k(scheme, group_size, config, gen):
    """Small tiles (several K steps per int4 group), split-K with uneven and empty-free splits."""
    _, qw, bias = make_layer(40, 200, scheme, group_size, gen)
    x = randn(2, 200, gen=gen)
    assert_matches(quantized_linear(x, qw, bias, config=config), reference(x, qw, bias), torch.float32)


def test_choose_config_decode_splits_k_on_a_gpu(monkeypatch):
    monkeypatch.setattr(QL.runtime, "INTERPRETER", False)
    monkeypatch.setattr(QL._launch, "num_sms", lambda device=None: 132)
    for m, scheme, group_size in ((1, "int4", 128), (16, "int4", 128), (1, "int8", None), (16, "int8", None)):
        config = QL.choose_config(m, 4096, 4096, scheme, group_size, device="cpu")
        assert config.BLOCK_M == 16 and config.BLOCK_K == (128 if scheme == "int4" else 256)
        programs = 4096 // config.BLOCK_N * config.SPLIT_K
        assert config.SPLIT_K > 1 and programs >= 132  # enough programs to occupy the GPU
        k_steps = 4096 // config.BLOCK_K
        assert k_steps // config.SPLIT_K >= 4 and k_steps % config.SPLIT_K == 0
        weight_bytes = 4096 * 4096 // (2 if scheme == "int4" else 1)
        assert 2 * config.SPLIT_K * m * 4096 * 4 <= weight_bytes / 4  # partials stay a small overhead
    prefill = QL.choose_config(4096, 4096, 4096, "int8", device="cpu")
    assert prefill.SPLIT_K == 1 and prefill.BLOCK_M == 128


def test_int64_offsets_path(monkeypatch, gen):
    """INDEX_64 (strides past 2**31, taken from the row planner) gives the same answer."""
    plan_rows = QL.plan_rows

    def forced(*args, **kwargs):
        import dataclasses

        return [dataclasses.replace(launch, index_64=True) for launch in plan_rows(*args, **kwargs)]

    monkeypatch.setattr(QL, "plan_rows", forced)
    for scheme, group_size in SCHEMES[:3]:
        _, qw, bias = make_layer(20, 100, scheme, group_size, gen)
        x = randn(3, 100, gen=gen)
        assert_matches(quantized_linear(x, qw, bias), reference(x, qw, bias), torch.float32)


# --------------------------------------------------------------------------- W8A8


def w8a8_reference(x, qw, bias=None):
    """Per-token int8 quantization in torch, the int64 product, both scales, the bias."""
    xf = x.float()
    s_x = xf.abs().amax(-1, keepdim=True) / 127
    s_x = torch.where(s_x > 0, s_x, torch.ones_like(s_x))
    xq = torch.round(xf / s_x).clamp(-127, 127)
    exact = (xq.long() @ qw.data.long().T).double()
    out = exact * s_x.double() * qw.scales.double()
    return out + bias.double() if bias is not None else out


def test_non_finite_activations_give_non_finite_outputs(gen):
    """Weight-only keeps x in floating point: NaN and inf propagate exactly as in F.linear. W8A8 has
    no int8 form for them: those rows come out all NaN (never finite, never a wrong-signed inf), the
    other rows as without them."""
    _, qw, bias = make_layer(10, 96, "int8", None, gen)
    x = randn(4, 96, gen=gen)
    x[0, 5], x[1, 6], x[2, 7] = float("nan"), float("inf"), -float("inf")
    want = reference(x, qw, bias)
    out = quantized_linear(x, qw, bias)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())
    assert torch.equal(out.isinf() & (out > 0), want.isinf() & (want > 0))
    w8a8 = quantized_linear(x, qw, bias, activations="int8")
    assert w8a8[:3].isnan().all()
    torch.testing.assert_close(w8a8[3:].double(), w8a8_reference(x[3:], qw, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape,n", [((1, 256), 64), ((2, 5, 300), 97), ((33, 64), 20)])
def test_w8a8_matches_int_reference(dtype, x_shape, n, gen):
    _, qw, bias = make_layer(n, x_shape[-1], "int8", None, gen, dtype=dtype)
    x = randn(*x_shape, gen=gen, dtype=dtype, scale=3.0)
    out = quantized_linear(x, qw, bias, activations="int8")
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    expected = w8a8_reference(x, qw, bias)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_w8a8_int32_accumulator_is_exact_past_2_to_the_24(gen):
    """All-extreme int8 values over a long K: partial sums pass 2**24, where fp32 would round."""
    k = 2048
    w = torch.ones(16, k, device=DEVICE)
    w[1::2] = -1
    qw = quantize_weight(w, "int8")  # every value +-127, scale 1/127
    x = torch.ones(2, k, device=DEVICE)
    x[1, 1::2] = -1
    x[:, 0] = 1.0 + 1 / 127  # off the grid by one step
    config = QuantizedLinearConfig(16, 16, 256, 1, 4, 1)
    out = quantized_linear(x, qw, activations="int8", config=config)
    expected = w8a8_reference(x, qw)
    assert (qw.data.long().abs().sum(1) * 127 > 2**24).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-7, atol=0)


@pytest.mark.parametrize("config", [QuantizedLinearConfig(16, 32, 32, 4, 4, 1),
                                    QuantizedLinearConfig(64, 16, 64, 1, 4, 1)])
def test_w8a8_configs(config, gen):
    _, qw, bias = make_layer(40, 250, "int8", None, gen)
    x = randn(3, 250, gen=gen)
    out = quantized_linear(x, qw, bias, activations="int8", config=config)
    torch.testing.assert_close(out.double(), w8a8_reference(x, qw, bias), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- traffic


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme,group_size,activations",
                         [("int8", None, None), ("fp8", None, None), ("int4", 128, None), ("int4", 32, None),
                          ("int8", None, "int8")])
def test_weight_bytes_read_are_the_packed_bytes(scheme, group_size, activations, gen):
    """Decode: the kernel reads each quantized value and each scale exactly once, and nothing
    dequantized is ever allocated."""
    from utils.trace import trace

    n, k = 80, 256
    _, qw, bias = make_layer(n, k, scheme, group_size, gen)
    x = randn(4, k, gen=gen)
    with trace() as t:
        quantized_linear(x, qw, bias, activations=activations)
    main = [launch for launch in t.launches if launch.kernel in ("quantized_linear_kernel", "w8a8_linear_kernel")]
    assert len(main) == 1
    traffic = main[0].per_tensor
    assert traffic["w_ptr"].bytes_read == qw.data.nbytes
    scales = traffic["w_scale_ptr" if activations else "scale_ptr"]
    assert scales.bytes_read == qw.scales.nbytes
    assert traffic["w_ptr"].bytes_read + scales.bytes_read == qw.nbytes
    assert traffic["w_ptr"].bytes_written == 0 and main[0].out_of_bounds == 0
    dense = n * k * 2  # a bf16 copy of the weight, the smallest dequantized one
    assert all(op.bytes_written < dense for op in t.torch_ops)
    assert t.bytes < dense + x.nbytes * 4  # the whole call moves less than a dequantized weight would


# --------------------------------------------------------------------------- accuracy


# Measured relative Frobenius errors (x (16, 512), w (128, 512) ~ N(0, 1), fp32 x; mean [min, max] of
# 12 seeds): int8 0.0074 [0.0072, 0.0076], W8A8 0.0105 [0.0101, 0.0112], fp8 0.026 [0.025, 0.027],
# int4 g32 0.097 [0.095, 0.099], g64 0.107, g128 0.117 [0.112, 0.122], g256 0.126. bf16 x: the same
# to two digits (the bf16 output's rounding adds ~1e-3).
ERROR_BOUNDS = {("int8", None, None): (0.004, 0.012), ("int8", None, "int8"): (0.006, 0.016),
                ("fp8", None, None): (0.015, 0.04), ("int4", 32, None): (0.07, 0.13),
                ("int4", 128, None): (0.08, 0.15)}


def test_quantization_error_per_scheme(gen):
    x = randn(16, 512, gen=gen)
    w = randn(128, 512, gen=gen)
    errors = {}
    for (scheme, group_size, activations), (low, high) in ERROR_BOUNDS.items():
        errors[scheme, group_size, activations] = err = kernel_ladder.quantization_error(
            w, x, scheme, group_size, activations=activations)
        assert low < err < high, (scheme, group_size, activations, err)
    assert errors["int8", None, None] < errors["fp8", None, None] < errors["int4", 32, None]
    assert errors["int4", 32, None] < errors["int4", 128, None]  # smaller groups, smaller error
    assert errors["int8", None, None] < errors["int8", None, "int8"]  # quantizing x costs a little


# --------------------------------------------------------------------------- custom-op plumbing


@pytest.mark.parametrize("case", ["int8_w8a8", "int4"])
def test_opcheck(case, gen):
    scheme, group_size = {"int8": ("int8", None), "int8_w8a8": ("int8", None), "int4": ("int4", 32),
                          "fp8": ("fp8", None)}[case]
    _, qw, bias = make_layer(24, 70, scheme, group_size, gen)
    x = randn(2, 3, 70, gen=gen)
    acts = "int8" if case == "int8_w8a8" else "none"
    args = (x, qw.data, qw.scales, bias, scheme, group_size or 0, 70, acts, None)
    utils = "ALL"
    if scheme == "fp8":  # test_schema's mutation check compares inputs with ops torch lacks for float8 on a CPU
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.kernel_ladder.quantized_linear.default, args, test_utils=utils)


def test_torch_compile_fullgraph_forward_and_backward(gen):
    _, qw, bias = make_layer(48, 128, "int8", None, gen)
    _, qw4, _ = make_layer(48, 48, "int4", 32, gen)

    def block(x):  # two quantized layers around an activation, as in an MLP: W8A8, then int4
        h = kernel_ladder.silu(quantized_linear(x, qw, bias, activations="int8"))
        return quantized_linear(h, qw4)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    x = randn(3, 128, gen=gen).requires_grad_()
    grad_out = randn(3, 48, gen=gen)
    with torch.enable_grad():
        got = compiled(x)
        (got_grad,) = torch.autograd.grad(got, [x], grad_out)
        want = block(x)
        (want_grad,) = torch.autograd.grad(want, [x], grad_out)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


# --------------------------------------------------------------------------- errors


def test_bad_input_errors(gen):
    _, qw, bias = make_layer(8, 64, "int8", None, gen)
    _, qw4, _ = make_layer(8, 64, "int4", 32, gen)
    x = randn(2, 64, gen=gen)
    op = r"kernel_ladder\.quantized_linear: "
    with pytest.raises(TypeError, match=op + r"qweight must be a kernel_ladder\.QuantizedWeight \(from "
                                             r"kernel_ladder\.quantize_weight\), got Tensor"):
        quantized_linear(x, torch.randn(8, 64))
    with pytest.raises(ValueError, match=op + r"x's last dim must equal qweight's in_features \(64\), "
                                              r"got x of shape \(2, 65\)"):
        quantized_linear(randn(2, 65, gen=gen), qw)
    with pytest.raises(TypeError, match=op + r"x must be float32, float16 or bfloat16, got torch\.float64"):
        quantized_linear(x.double(), qw)
    with pytest.raises(TypeError, match=op + r"x must be a torch\.Tensor, got list"):
        quantized_linear([1.0], qw)
    with pytest.raises(ValueError, match=op + r"x must have shape \(\.\.\., in_features\), got a 0-d tensor"):
        quantized_linear(torch.tensor(1.0, device=DEVICE), qw)
    with pytest.raises(TypeError, match=op + r"bias must have x's dtype \(torch\.float32\), got torch\.float16"):
        quantized_linear(x, qw, bias.half())
    with pytest.raises(ValueError, match=op + r"bias must have shape \(8,\) \(out_features\), got \(9,\)"):
        quantized_linear(x, qw, randn(9, gen=gen))
    with pytest.raises(ValueError, match=op + r"activations must be None \(weight-only\) or 'int8' \(W8A8\), "
                                              r"got 'fp8'"):
        quantized_linear(x, qw, activations="fp8")
    with pytest.raises(ValueError, match=op + r"activations='int8' \(W8A8: int8 x int8 dot\) needs an 'int8' qweight, "
                                              r"got scheme 'int4'"):
        quantized_linear(x, qw4, activations="int8")
    with pytest.raises(ValueError, match=op + r"config has unsupported values: BLOCK_K=64 \(int4 needs BLOCK_K <= "
                                              r"group_size = 32\)"):
        quantized_linear(x, qw4, config=QuantizedLinearConfig(16, 16, 64, 1, 4, 1))
    with pytest.raises(ValueError, match=op + r"config has unsupported values: BLOCK_M=8 \(a power of two >= 16\), "
                                              r"SPLIT_K=0"):
        quantized_linear(x, qw, config=QuantizedLinearConfig(8, 16, 64, 0, 4, 1))
    with pytest.raises(TypeError,
                       match=op + r"config must be a kernel_ladder\.QuantizedLinearConfig or None, got tuple"):
        quantized_linear(x, qw, config=(16, 16, 64, 1, 4, 1))
    # the custom op checks what it is given, too (scheme, group size, packed shapes)
    ops = torch.ops.kernel_ladder.quantized_linear.default
    with pytest.raises(ValueError, match=op + r"scheme must be 'int8', 'int4' or 'fp8', got 'int2'"):
        ops(x, qw.data, qw.scales, None, "int2", 0, 64, "none", None)
    with pytest.raises(ValueError, match=op + r"group_size for scheme 'int4' must be one of 32, 64, .* got 48"):
        ops(x, qw4.data, qw4.scales, None, "int4", 48, 64, "none", None)
    with pytest.raises(ValueError, match=op + r"qweight data for scheme 'int4' must be torch\.uint8 of shape "
                                              r"\(out_features, 32\), got torch\.int8 of shape \(8, 64\)"):
        ops(x, qw.data, qw4.scales, None, "int4", 32, 64, "none", None)
    with pytest.raises(ValueError, match=op + r"qweight scales for scheme 'int8' must be float32/float16/bfloat16 of "
                                              r"shape \(8,\)"):
        ops(x, qw.data, qw4.scales, None, "int8", 0, 64, "none", None)


# --------------------------------------------------------------------------- gradients


def torch_grads(x, qw, bias, grad_out):
    """Gradients of F.linear(x, dequantize(w), bias) in float64."""
    xr = x.detach().double().requires_grad_()
    inputs = [xr]
    if bias is not None:
        inputs.append(bias.detach().double().requires_grad_())
    with torch.enable_grad():
        out = F.linear(xr, qw.dequantize(torch.float64), inputs[1] if bias is not None else None)
        return torch.autograd.grad(out, inputs, grad_out.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,group_size", SCHEMES)
def test_gradients_match_torch(dtype, scheme, group_size, gen):
    """grad_x through the transposed kernel (K off the tile, N off the block), grad_bias by a sum."""
    _, qw, bias = make_layer(70, 200, scheme, group_size, gen, dtype=dtype)
    bias.requires_grad_()
    x = randn(2, 3, 200, gen=gen, dtype=dtype).requires_grad_()
    with torch.enable_grad():
        out = quantized_linear(x, qw, bias)
        grad_out = randn(*out.shape, gen=gen, dtype=dtype)
        grads = torch.autograd.grad(out, [x, bias], grad_out)
    for got, want in zip(grads, torch_grads(x, qw, bias, grad_out)):
        assert_matches(got, want, dtype)


def test_gradients_of_strided_views_and_w8a8(gen):
    """A transposed x and a non-contiguous grad_out (from a transposed loss); W8A8's gradient is
    the weight-only one (straight through the rounding of x)."""
    _, qw, _ = make_layer(40, 96, "int8", None, gen)
    x = randn(96, 6, gen=gen).t().requires_grad_()
    with torch.enable_grad():
        for activations in (None, "int8"):
            out = quantized_linear(x, qw, activations=activations)
            weights = randn(40, 6, gen=gen)
            (grad_x,) = torch.autograd.grad((out * weights.t()).sum(), [x])
            (want,) = torch_grads(x, qw, None, weights.t())
            assert_matches(grad_x, want, torch.float32)
        out = quantized_linear(x, qw)
        (grad_x,) = torch.autograd.grad(out.t().sum(), [x])  # grad_out is an expanded (stride-0) view
        assert_matches(grad_x, torch_grads(x, qw, None, torch.ones(6, 40))[0], torch.float32)


def test_opcheck_backward(gen):
    _, qw, bias = make_layer(24, 70, "int4", 32, gen)
    x = randn(5, 70, gen=gen).requires_grad_()
    bias.requires_grad_()
    torch.library.opcheck(torch.ops.kernel_ladder.quantized_linear.default,
                          (x, qw.data, qw.scales, bias, "int4", 32, 70, "none", None))
    grad_out = randn(5, 24, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.quantized_linear_backward.default,
                          (grad_out, qw.data, qw.scales, "int4", 32, 70))


# --------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,group_size,activations",
                         [("int8", None, None), ("int8", None, "int8"), ("fp8", None, None), ("int4", 128, None)])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_real_sizes_on_gpu(scheme, group_size, activations, m, gen):
    n, k = 4096, 4096
    _, qw, bias = make_layer(n, k, scheme, group_size, gen, dtype=torch.bfloat16)
    x = randn(m, k, gen=gen, dtype=torch.bfloat16)
    out = quantized_linear(x, qw, bias, activations=activations)
    expected = w8a8_reference(x, qw, bias) if activations else reference(x, qw, bias)
    torch.testing.assert_close(out.double(), expected, rtol=1.6e-2, atol=1.6e-2 * expected.abs().max().item())
