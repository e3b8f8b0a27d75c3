"""kernel_ladder.quantize_weight / QuantizedWeight / quantize_activations against torch, bit for bit.

The references below are plain torch code written from the documented formats (symmetric
scales from the amax, round half to even, int4 offset-8 nibbles with the low nibble holding the
even k); the Triton quantizers must reproduce them exactly — values, scales and packed bytes.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DTYPES

import kernel_ladder
from kernel_ladder.ops import quantize as kq

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the quantizers allocate is poisoned

DEVICE = kernel_ladder.runtime.DEVICE
E4M3 = torch.float8_e4m3fn


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


# --------------------------------------------------------------------------- torch references


def _scale(amax: torch.Tensor, qmax: float, scale_dtype: torch.dtype) -> torch.Tensor:
    s = (amax / qmax).to(scale_dtype).float()
    return torch.where(s > 0, s, torch.ones_like(s))


def reference_rows(x: torch.Tensor, fp8: bool, scale_dtype=torch.float32):
    """Per-row symmetric quantization of the last dim (float32 math, like the kernel)."""
    xf = x.float()
    qmax = 448.0 if fp8 else 127.0
    s = _scale(xf.abs().amax(-1) if x.shape[-1] else torch.zeros(x.shape[:-1], device=x.device), qmax, scale_dtype)
    v = (xf / s[..., None]).clamp(-qmax, qmax)
    q = v.to(E4M3) if fp8 else torch.round(v).to(torch.int8)
    return q, s.to(scale_dtype)


def reference_int4(w: torch.Tensor, group_size: int, scale_dtype=torch.float32):
    """(packed uint8 (N, ceil(K/2)), scales (N, groups)) from the documented format."""
    n, k = w.shape
    groups = math.ceil(k / group_size)
    padded = torch.zeros(n, groups * group_size, device=w.device)
    padded[:, :k] = w.float()
    blocks = padded.view(n, groups, group_size)
    s = _scale(blocks.abs().amax(-1), 7.0, scale_dtype)
    q = torch.round(blocks / s[..., None]).clamp(-8, 7).view(n, -1)[:, :k]
    if k % 2:
        q = torch.cat([q, torch.zeros(n, 1, device=w.device)], dim=1)
    u = (q + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4), s.to(scale_dtype)


# --------------------------------------------------------------------------- weights, per channel


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (65, 300), (3, 1000)])
def test_per_channel_schemes_match_torch_bit_for_bit(scheme, shape, gen):
    w = randn(*shape, gen=gen, scale=0.05)
    qw = kernel_ladder.quantize_weight(w, scheme)
    q, s = reference_rows(w, scheme == "fp8")
    assert qw.data.dtype == kq.STORAGE_DTYPES[scheme] and qw.data.shape == shape
    assert torch.equal(qw.data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qw.scales, s)
    assert qw.scheme == scheme and qw.shape == torch.Size(shape) and qw.group_size is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_weight_dtypes_and_scale_dtypes(dtype, scheme, gen):
    w = randn(40, 256, gen=gen, dtype=dtype, scale=3.0)
    for scale_dtype in (torch.float32, torch.bfloat16):
        qw = kernel_ladder.quantize_weight(w, scheme, scale_dtype=scale_dtype)
        if scheme == "int4":
            q, s = reference_int4(w, 128, scale_dtype)
        else:
            q, s = reference_rows(w, scheme == "fp8", scale_dtype)
        assert qw.scales.dtype == scale_dtype and qw.dtype == dtype
        assert torch.equal(qw.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scales, s)
        assert qw.dequantize().dtype == dtype


def test_dequantize_dtype_rounds_once(gen):
    """dequantize(dtype) rounds the exact q * s once; the default is the weight's dtype."""
    w = randn(24, 64, gen=gen, dtype=torch.bfloat16)
    qw = kernel_ladder.quantize_weight(w, "int4", group_size=32)
    exact = qw.dequantize(torch.float64)
    assert exact.dtype == torch.float64
    assert torch.equal(qw.dequantize(), exact.to(torch.bfloat16))
    assert torch.equal(qw.dequantize(torch.float32), exact.float())
    # q has 4 bits and a bf16 scale 8: the exact product needs up to 12, more than bf16 keeps
    assert not torch.equal(qw.dequantize().double(), exact)
    with pytest.raises(TypeError, match="dequantize: dtype"):
        qw.dequantize(torch.int8)


def test_strided_weight_is_read_in_place(gen):
    base = randn(300, 66, gen=gen)
    w = base.t()[:, ::1]  # (66, 300), column-major: the quantizer walks it through its strides
    assert not w.is_contiguous()
    for scheme in ("int8", "fp8"):
        q, s = reference_rows(w, scheme == "fp8")
        qw = kernel_ladder.quantize_weight(w, scheme)
        assert torch.equal(qw.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scales, s)
    packed, s = reference_int4(w, 64)
    qw = kernel_ladder.quantize_weight(w, "int4", group_size=64)
    assert torch.equal(qw.data, packed) and torch.equal(qw.scales, s)


def test_fp8_values_stay_within_448_and_use_the_range(gen):
    w = randn(16, 512, gen=gen, scale=1e-3)
    qw = kernel_ladder.quantize_weight(w, "fp8")
    values = qw.data.float()
    assert values.abs().max() == 448.0  # each row's amax lands exactly on the largest value
    assert torch.equal(values.abs().amax(1), torch.full((16,), 448.0))


# --------------------------------------------------------------------------- int4


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("k", [256, 200, 97, 1])  # multiple of the group, not, odd, one
def test_int4_packing_matches_torch_bit_for_bit(group_size, k, gen):
    w = randn(37, k, gen=gen)
    qw = kernel_ladder.quantize_weight(w, "int4", group_size=group_size)
    packed, s = reference_int4(w, group_size)
    assert qw.data.dtype == torch.uint8 and qw.data.shape == (37, (k + 1) // 2)
    assert qw.scales.shape == (37, math.ceil(k / group_size))
    assert qw.scales.stride() == (1, 37)  # group-major: one group's scales are contiguous over channels
    assert torch.equal(qw.data, packed) and torch.equal(qw.scales, s)
    assert qw.group_size == group_size


def test_int4_nibble_order_is_documented_one():
    """q = [1, -2, 7, -7] * s: byte 0 = (1+8) | (-2+8) << 4 = 0x69, byte 1 = (7+8) | (-7+8) << 4 = 0x1F."""
    w = torch.tensor([[1.0, -2.0, 7.0, -7.0] + [0.0] * 28], device=DEVICE)
    qw = kernel_ladder.quantize_weight(w, "int4", group_size=32)
    assert qw.scales.item() == 1.0
    assert qw.data[0, :2].tolist() == [0x69, 0x1F]
    assert qw.data[0, 2:].tolist() == [0x88] * 14  # zeros are code 8 in both nibbles
    odd = kernel_ladder.quantize_weight(torch.tensor([[7.0, 1.0, -7.0]], device=DEVICE), "int4", group_size=32)
    assert odd.data[0].tolist() == [(7 + 8) | ((1 + 8) << 4), (-7 + 8) | (8 << 4)]  # padding nibble: 8


def test_int4_large_group_sizes(gen):
    w = randn(3, 5000, gen=gen)
    for group_size in (1024, 4096):
        qw = kernel_ladder.quantize_weight(w, "int4", group_size=group_size)
        packed, s = reference_int4(w, group_size)
        assert torch.equal(qw.data, packed) and torch.equal(qw.scales, s)


# --------------------------------------------------------------------------- QuantizedWeight


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("fp8", None), ("int4", 32), ("int4", 128)])
def test_dequantize_nbytes_repr(scheme, group_size, gen):
    w = randn(48, 300, gen=gen, dtype=torch.bfloat16)
    qw = kernel_ladder.quantize_weight(w, scheme, group_size=group_size)
    deq = qw.dequantize()
    assert deq.shape == w.shape and deq.dtype == torch.bfloat16
    if scheme == "int4":
        packed, s = reference_int4(w, group_size)
        low, high = (packed & 0xF).float() - 8, (packed >> 4).float() - 8
        q = torch.stack([low, high], -1).view(48, -1)[:, :300]
        expected = q * s.repeat_interleave(group_size, 1)[:, :300]
    else:
        q, s = reference_rows(w, scheme == "fp8")
        expected = q.float() * s[:, None]
    assert torch.equal(deq, expected.to(torch.bfloat16))
    assert qw.nbytes == qw.data.nbytes + qw.scales.nbytes
    values = {"int8": 48 * 300, "fp8": 48 * 300, "int4": 48 * 150}[scheme]
    scales = 48 * 4 * (math.ceil(300 / group_size) if group_size else 1)
    assert qw.nbytes == values + scales
    text = repr(qw)
    assert f"scheme='{scheme}'" in text and "shape=(48, 300)" in text and "torch.bfloat16" in text
    assert (f"group_size={group_size}" in text) if group_size else ("per output channel" in text)
    rel = ((deq.float() - w.float()).norm() / w.float().norm()).item()
    assert rel < {"int8": 0.01, "fp8": 0.04, "int4": 0.12}[scheme]
    moved = qw.to(DEVICE)
    assert torch.equal(moved.data.view(torch.uint8), qw.data.view(torch.uint8))
    assert moved.scales.stride() == qw.scales.stride()
    assert qw.out_features == 48 and qw.in_features == 300 and qw.device == qw.data.device


def test_bits_per_weight():
    w = torch.randn(64, 1024, device=DEVICE)
    assert kernel_ladder.quantize_weight(w, "int4", group_size=128).bits_per_weight == 4 + 32 / 128
    assert kernel_ladder.quantize_weight(w, "int4", group_size=128, scale_dtype=torch.float16).bits_per_weight == 4.125
    assert kernel_ladder.quantize_weight(w, "int8").bits_per_weight == 8 + 32 / 1024


def test_zero_rows_and_groups_get_scale_one(gen):
    w = randn(4, 64, gen=gen)
    w[1] = 0
    w[2, :32] = 0
    for scheme, gs in (("int8", None), ("fp8", None), ("int4", 32)):
        qw = kernel_ladder.quantize_weight(w, scheme, group_size=gs)
        if scheme == "int4":
            assert qw.scales[1].tolist() == [1.0, 1.0] and qw.scales[2, 0].item() == 1.0
            assert (qw.data[1] == 0x88).all()
        else:
            assert qw.scales[1].item() == 1.0 and (qw.data[1].float() == 0).all()
        assert torch.equal(qw.dequantize()[1], torch.zeros(64, device=DEVICE))


@pytest.mark.parametrize("shape", [(0, 16), (5, 0), (0, 0)])
@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_empty_weights(shape, scheme):
    w = torch.randn(shape, device=DEVICE)
    qw = kernel_ladder.quantize_weight(w, scheme)
    assert qw.dequantize().shape == shape
    if scheme != "int4":
        assert qw.scales.shape == (shape[0],) and bool((qw.scales == 1).all())


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_activations_per_token_match_torch(dtype, fmt, gen):
    x = randn(2, 5, 77, gen=gen, dtype=dtype, scale=4.0)
    for view in (x, x.transpose(0, 1), x[:, 1:4, ::2]):  # strided and non-mergeable leading dims
        q, s = kernel_ladder.quantize_activations(view, fmt)
        rq, rs = reference_rows(view, fmt == "fp8")
        assert q.shape == view.shape and q.is_contiguous() and s.shape == view.shape[:-1]
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_activations_long_rows_take_the_two_pass_path(gen):
    x = randn(3, 20000, gen=gen)  # longer than one block: an amax pass, then a quantize pass
    q, s = kernel_ladder.quantize_activations(x)
    rq, rs = reference_rows(x, False)
    assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("n_cols", [77, 20000])  # one block, and the two-pass (chunked) path
def test_activation_rows_with_nan_or_inf_get_a_nan_scale_and_zero_values(fmt, n_cols, gen):
    """A NaN or +-inf has no quantized form: the row's scale is NaN and its values 0, so whatever is
    computed from it is NaN; the other rows are quantized exactly as without them."""
    x = randn(5, n_cols, gen=gen, scale=4.0)
    x[0, 3], x[1, n_cols - 1], x[2, 0] = float("nan"), float("inf"), -float("inf")
    q, s = kernel_ladder.quantize_activations(x, fmt)
    assert s[:3].isnan().all() and (q[:3].float() == 0).all()
    rq, rs = reference_rows(x[3:], fmt == "fp8")
    assert torch.equal(q[3:].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s[3:], rs)


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32), ("fp8", None)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_weight_rejects_non_finite_weights(scheme, group_size, bad, gen):
    w = randn(6, 64, gen=gen)
    w[4, 17] = bad
    w[5, 1] = bad
    with pytest.raises(ValueError,
                       match=r"kernel_ladder\.quantize_weight: w has 2 non-finite value\(s\) \(NaN or \+-inf; "
                             r"the first at \[4, 17\] is (nan|inf|-inf)\).*torch\.nan_to_num"):
        kernel_ladder.quantize_weight(w, scheme, group_size=group_size)


def test_rounding_is_half_to_even():
    # amax 127 -> scale exactly 1: x / s are the values themselves, ties included
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49999]], device=DEVICE)
    q, s = kernel_ladder.quantize_activations(x)
    assert s.item() == 1.0
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 3]


# --------------------------------------------------------------------------- errors


def test_bad_input_errors():
    w = torch.randn(8, 64, device=DEVICE)
    floats = "float32, float16 or bfloat16"
    with pytest.raises(ValueError, match=r"kernel_ladder\.quantize_weight: scheme must be 'int8', 'int4' or 'fp8', "
                                         r"got 'int3'"):
        kernel_ladder.quantize_weight(w, "int3")
    with pytest.raises(ValueError,
                       match=r"kernel_ladder\.quantize_weight: group_size must be a power of two from 32 to 4096 "
                             r"\(32, 64, 128, 256, 512, 1024, 2048, 4096\) for scheme 'int4', got 48"):
        kernel_ladder.quantize_weight(w, "int4", group_size=48)
    with pytest.raises(ValueError, match=r"kernel_ladder\.quantize_weight: group_size must be .* got 16"):
        kernel_ladder.quantize_weight(w, "int4", group_size=16)
    with pytest.raises(TypeError, match=r"kernel_ladder\.quantize_weight: group_size must be an int"):
        kernel_ladder.quantize_weight(w, "int4", group_size=128.0)
    with pytest.raises(ValueError, match=r"kernel_ladder\.quantize_weight: group_size applies to scheme 'int4' only"):
        kernel_ladder.quantize_weight(w, "int8", group_size=128)
    with pytest.raises(ValueError,
                       match=r"kernel_ladder\.quantize_weight: w must be a 2-D \(out_features, in_features\)"):
        kernel_ladder.quantize_weight(w[0], "int8")
    with pytest.raises(TypeError, match=rf"kernel_ladder\.quantize_weight: w must be {floats}, got torch\.float64"):
        kernel_ladder.quantize_weight(w.double(), "int8")
    with pytest.raises(TypeError, match=rf"kernel_ladder\.quantize_weight: w must be {floats}, got torch\.int32"):
        kernel_ladder.quantize_weight(w.int(), "int4")
    with pytest.raises(TypeError, match=r"kernel_ladder\.quantize_weight: w must be a torch\.Tensor, got list"):
        kernel_ladder.quantize_weight([[1.0]], "int8")
    with pytest.raises(TypeError, match=r"kernel_ladder\.quantize_weight: scale_dtype must be torch\.float32"):
        kernel_ladder.quantize_weight(w, "int8", scale_dtype=torch.int8)
    with pytest.raises(ValueError,
                       match=r"kernel_ladder\.quantize_activations: dtype must be 'int8' or 'fp8', got 'int4'"):
        kernel_ladder.quantize_activations(w, "int4")
    with pytest.raises(ValueError, match=r"kernel_ladder\.quantize_activations: x must have at least one dimension"):
        kernel_ladder.quantize_activations(torch.tensor(1.0, device=DEVICE))


def test_quantized_weight_constructor_checks_its_parts():
    qw = kernel_ladder.quantize_weight(torch.randn(8, 64, device=DEVICE), "int4", group_size=32)
    with pytest.raises(ValueError, match=r"kernel_ladder\.QuantizedWeight: data for scheme 'int4' and shape \(8, 64\) "
                                         r"must be torch\.uint8 of shape \(8, 32\), got torch\.uint8 of shape "
                                         r"\(8, 31\)"):
        kq.QuantizedWeight("int4", qw.data[:, 1:], qw.scales, (8, 64), torch.float32, 32)
    with pytest.raises(ValueError, match=r"kernel_ladder\.QuantizedWeight: scales for scheme 'int4'"):
        kq.QuantizedWeight("int4", qw.data, qw.scales[:, :1], (8, 64), torch.float32, 32)
    with pytest.raises(ValueError, match=r"kernel_ladder\.QuantizedWeight: data for scheme 'int8'"):
        kq.QuantizedWeight("int8", qw.data, qw.scales[:, 0], (8, 64), torch.float32)


# --------------------------------------------------------------------------- custom-op plumbing


def test_opcheck_quantize_ops(gen):
    x = randn(6, 70, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.quantize_rows.default, (x, False, torch.float32))
    torch.library.opcheck(torch.ops.kernel_ladder.quantize_rows.default, (x.t(), True, torch.float16))
    torch.library.opcheck(torch.ops.kernel_ladder.quantize_int4.default, (x, 32, torch.float32))


def test_torch_compile_fullgraph_quantize_activations(gen):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: kernel_ladder.quantize_activations(x), fullgraph=True)
    x = randn(4, 100, gen=gen)
    q, s = compiled(x)
    rq, rs = reference_rows(x, False)
    assert torch.equal(q, rq) and torch.equal(s, rs)
