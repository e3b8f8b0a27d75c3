"""float8 e4m3fn and int8 numerics in Triton's interpreter, against torch, bit for bit.

What the interpreter does on its own (the negative controls at the bottom show it): it keeps fp8
values as raw bytes and decodes the NaN codes 0x7F / 0xFF as +-480; its fp32 -> fp8 conversion
flushes subnormals to zero, does not round to nearest even, and does not saturate (500 becomes
256, 464 becomes NaN, inf becomes 256); and fp8 arithmetic acts on the codes. The runtime's
repairs (``kernel_ladder._interpreter_numerics``: decode exactly, compute in fp32, encode with
round-to-nearest-even and saturation to +-448, as a GPU's ``cvt.rn.satfinite`` and torch do) make
every check here pass. int8 ``tl.dot`` needs no repair: the interpreter accumulates it in int32
exactly, which is checked too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernel_ladder import _interpreter_numerics as numerics
from kernel_ladder import runtime

interpreter_only = pytest.mark.skipif(not runtime.INTERPRETER, reason="interpreter numerics only")
E4M3 = torch.float8_e4m3fn


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_rtz_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x.to(tl.float8e4nv, fp_downcast_rounding="rtz"), mask=mask)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((M, N), dtype=c_ptr.dtype.element_ty)
    for k in range(0, K, BLOCK_K):  # accumulate over several steps, as a matmul's K loop does
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def _arith_kernel(x_ptr, y_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    if OP == "mul":
        r = x * y
    elif OP == "add":
        r = x + y
    elif OP == "where_less":
        r = tl.where(x < y, x, y)
    elif OP == "max":
        r = tl.maximum(x, y)
    else:
        r = -x
    tl.store(out_ptr + offs, r, mask=mask)


@triton.jit
def _reduce_kernel(x_ptr, max_ptr, min_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.store(max_ptr, tl.max(x, axis=0))
    tl.store(min_ptr, tl.min(x, axis=0))


ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _encode_sample(gen: torch.Generator) -> torch.Tensor:
    """Random fp32 values over e4m3's whole range (subnormals to saturation), every tie between
    two neighbouring codes, and the specials."""
    n = 200_000
    x = torch.randn(n, generator=gen) * torch.exp2(torch.empty(n).uniform_(-14, 10, generator=gen))
    finite = ALL_CODES.float()[~ALL_CODES.float().isnan()].unique()
    ties = (finite[1:] + finite[:-1]) / 2  # exact in fp32: halfway points, where rounding to even decides
    inf = torch.tensor(float("inf"))
    nudged = torch.cat([torch.nextafter(ties, inf), torch.nextafter(ties, -inf)])
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 2**-9, -(2**-9), 2**-10, 3 * 2**-11, 2**-6, 2**-7])
    return torch.cat([x, ties, nudged, finite, special])


# --------------------------------------------------------------------------- the codec itself


def test_decode_table_matches_torch_for_all_256_codes():
    ours = numerics.fp8e4m3_bits_to_f32(np.arange(256, dtype=np.uint8))
    theirs = ALL_CODES.float().numpy()
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan) and nan.sum() == 2  # 0x7F, 0xFF
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))  # -0.0 included


def test_encoder_rounds_to_nearest_even_like_torch():
    x = _encode_sample(torch.Generator().manual_seed(0))
    ours = numerics.f32_to_fp8e4m3_bits(x.numpy())
    assert np.array_equal(ours, _bits(x.to(E4M3)).numpy())


def test_encoder_saturates_and_keeps_nan():
    x = np.array([449.0, 464.0, 480.0, 1e6, np.inf, -500.0, -np.inf, np.nan], dtype=np.float32)
    codes = numerics.f32_to_fp8e4m3_bits(x)
    assert codes[:5].tolist() == [0x7E] * 5 and codes[5:7].tolist() == [0xFE] * 2  # +-448
    assert np.isnan(numerics.fp8e4m3_bits_to_f32(codes[7:])).all()
    # torch does the same (finite overflow and infinities saturate, NaN stays NaN)
    theirs = torch.from_numpy(x).to(E4M3).float()
    assert theirs[:7].tolist() == [448.0] * 5 + [-448.0] * 2 and theirs[7].isnan()


def test_encoder_from_float16_and_float64_rounds_once():
    gen = torch.Generator().manual_seed(1)
    x = _encode_sample(gen)
    x = x[x.abs() < 60000]
    for dtype in (torch.float16, torch.float64):
        xd = x.to(dtype)
        assert np.array_equal(numerics.f32_to_fp8e4m3_bits(xd.numpy()), _bits(xd.to(E4M3)).numpy()), dtype


# --------------------------------------------------------------------------- through kernels


@interpreter_only
@pytest.mark.parametrize("dst", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_decodes_every_code_like_torch(dst):
    out = torch.full((256,), 7.0, dtype=dst)
    _cast_kernel[(1,)](ALL_CODES, out, 256, 256)
    expected = ALL_CODES.to(dst)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16 if dst != torch.float32 else torch.int32),
                       expected[~nan].view(torch.int16 if dst != torch.float32 else torch.int32))


@interpreter_only
@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_encodes_like_torch(src):
    x = _encode_sample(torch.Generator().manual_seed(2))
    x = x[x.abs() < 60000].to(src)  # float16 overflows past 65504
    x = torch.cat([x, torch.tensor([1000.0, -1e4, float("inf"), float("-inf"), float("nan")], dtype=src)])
    out = torch.empty(x.numel(), dtype=E4M3)
    block = 4096
    _cast_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), block)
    expected = x.to(E4M3)
    assert torch.equal(_bits(out)[:-1], _bits(expected)[:-1])
    assert out[-1:].float().isnan().all()
    assert out[-5:-1].float().tolist() == [448.0, -448.0, 448.0, -448.0]


@interpreter_only
def test_kernel_round_toward_zero():
    x = torch.tensor([1.0 + 2**-4, 1.0 + 3 * 2**-4, -(1.0 + 3 * 2**-4), 2**-9 * 1.9, 500.0, 0.0])
    out = torch.empty(x.numel(), dtype=E4M3)
    _cast_rtz_kernel[(1,)](x, out, x.numel(), 8)
    assert out.float().tolist() == [1.0, 1.125, -1.125, 2**-9, 448.0, 0.0]


@interpreter_only
def test_fp8_dot_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(3)
    M, N, K = 16, 32, 128
    a = (torch.randn(M, K, generator=gen) * 3).to(E4M3)
    b = (torch.randn(K, N, generator=gen) * 3).to(E4M3)
    a.view(torch.uint8)[0, 5] = 0x7F  # one NaN: it must reach row 0 of the result
    c = torch.full((M, N), float("nan"))
    _dot_kernel[(1,)](a, b, c, M, N, K, 32)
    expected = a.double() @ b.double()
    assert c[0].isnan().all() and not c[1:].isnan().any()
    torch.testing.assert_close(c[1:].double(), expected[1:], rtol=1e-5, atol=1e-5)


@interpreter_only
@pytest.mark.parametrize("op", ["mul", "add", "where_less", "max", "neg"])
def test_fp8_elementwise_computes_in_fp32_and_rounds_once(op):
    gen = torch.Generator().manual_seed(4)
    n = 256
    x = (torch.randn(n, generator=gen) * 8).to(E4M3)
    y = (torch.randn(n, generator=gen) * 8).to(E4M3)
    out = torch.empty(n, dtype=E4M3)
    _arith_kernel[(1,)](x, y, out, n, op, n)
    xf, yf = x.float(), y.float()
    expected = {"mul": xf * yf, "add": xf + yf, "where_less": torch.where(xf < yf, xf, yf),
                "max": torch.maximum(xf, yf), "neg": -xf}[op]
    assert torch.equal(_bits(out), _bits(expected.to(E4M3)))


@interpreter_only
def test_fp8_reductions():
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(128, generator=gen) * 10).to(E4M3)
    mx, mn = torch.empty(1, dtype=E4M3), torch.empty(1, dtype=E4M3)
    _reduce_kernel[(1,)](x, mx, mn, 128)
    assert mx.float().item() == x.float().max().item() and mn.float().item() == x.float().min().item()


@interpreter_only
def test_int8_dot_accumulates_in_int32_exactly():
    """Extreme products (-128 * -128) over a long K pass 2**24, where an fp32 accumulator would
    round; the int32 accumulator must be exact."""
    gen = torch.Generator().manual_seed(6)
    M, N, K = 16, 16, 2048
    a = torch.randint(-128, 128, (M, K), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (K, N), generator=gen, dtype=torch.int8)
    a[0] = -128
    b[:, 0] = -128
    a[1] = 127
    b[:, 1] = -128
    c = torch.empty(M, N, dtype=torch.int32)
    _dot_kernel[(1,)](a, b, c, M, N, K, 256)
    expected = a.long() @ b.long()
    assert expected[0, 0] == 128 * 128 * K and expected.abs().max() > 2**24
    assert torch.equal(c.long(), expected)


# --------------------------------------------------------------------------- negative controls


@pytest.fixture
def unrepaired_fp8(monkeypatch):
    """The interpreter's own fp8 handling (the repairs removed for one test)."""
    from triton.runtime import interpreter as interp

    assert numerics.FP8_ORIGINALS, "the fp8 repairs are not installed"
    for name, original in numerics.FP8_ORIGINALS.items():
        owner, _, attr = name.rpartition(".")
        cls = {"": interp.InterpreterBuilder, "ReduceOps": interp.ReduceOps, "ScanOps": interp.ScanOps}[owner]
        monkeypatch.setattr(cls, attr, original)


@interpreter_only
def test_negative_control_unrepaired_interpreter_encodes_wrongly(unrepaired_fp8):
    x = _encode_sample(torch.Generator().manual_seed(7))
    out = torch.empty(x.numel(), dtype=E4M3)
    _cast_kernel[(triton.cdiv(x.numel(), 8192),)](x, out, x.numel(), 8192)
    wrong = (_bits(out) != _bits(x.to(E4M3))).sum().item()
    assert wrong > 1000, wrong
    big = torch.tensor([500.0, float("inf")])
    out = torch.empty(2, dtype=E4M3)
    _cast_kernel[(1,)](big, out, 2, 2)
    assert out.float().tolist() != [448.0, 448.0]  # no saturation


@interpreter_only
def test_negative_control_unrepaired_interpreter_decodes_nan_as_480(unrepaired_fp8):
    out = torch.empty(256)
    _cast_kernel[(1,)](ALL_CODES, out, 256, 256)
    assert out[0x7F].item() == 480.0 and out[0xFF].item() == -480.0


@interpreter_only
def test_negative_control_unrepaired_fp8_arithmetic_acts_on_codes(unrepaired_fp8):
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(64, generator=gen) * 8).to(E4M3)
    y = (torch.randn(64, generator=gen) * 8).to(E4M3)
    out = torch.empty(64, dtype=E4M3)
    _arith_kernel[(1,)](x, y, out, 64, "mul", 64)
    assert not torch.equal(_bits(out), _bits((x.float() * y.float()).to(E4M3)))
