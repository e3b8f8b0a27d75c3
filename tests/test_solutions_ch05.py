"""Chapter 05's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (same launchers, same kind of cases, same
references), once with the solution (SOLVED) and once per negative control: a plausible wrong
answer — the scale from the wrong maximum, truncating instead of rounding, rounding ties away
from zero (C's ``round``, caught by rows of exact ties), a scale in bf16,
swapped nibbles, two's-complement nibbles, a sign-extending shift, the wrong group's scale, an
int16 or int8 accumulator that overflows, a forgotten scale, a stub — that the checker must reject.
A slow test compiles the three solution kernels ahead of time for sm_90 (a learner with a GPU runs them).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch05_quantization as solutions
from utils.aot import run_compiled
from utils.exercises import check
from utils.trace import trace

# The checker's out-of-bounds diagnosis and the interpreter's numerics need the interpreter.
pytestmark = pytest.mark.interpreter

DEVICE = kernel_ladder.runtime.DEVICE


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _verdict(name, candidate, reference, cases, **kwargs):
    return check(name, candidate, reference, cases, **kwargs).solved


def _tie_rows(dtype=torch.float32):
    """Two rows whose largest magnitude is 127 (scale exactly 1) and whose other values are exact
    halves, -39.5 ... 39.5: every one a tie, which only round-half-to-even gets right every time."""
    halves = torch.arange(-40, 40, dtype=torch.float32) + 0.5
    row = torch.cat([torch.tensor([127.0]), halves])
    return torch.stack([row, -row.flip(0)]).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------------------------
# Exercise 1: int8 per channel
# ----------------------------------------------------------------------------------------------


def int8_cases(gen: torch.Generator) -> list:
    with_zero_row = _randn(gen, 16, 64, dtype=torch.float16)
    with_zero_row[5] = 0
    return [
        (_randn(gen, 37, 300, scale=0.05),),
        (_randn(gen, 1, 1),),
        (_randn(gen, 64, 129, dtype=torch.bfloat16),),
        (with_zero_row,),
        (_randn(gen, 70, 24).t(),),  # a transposed view: rows are strided
        (_tie_rows(),),  # exact ties: round half to even
    ]


def int8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qweight = kernel_ladder.quantize_weight(w, "int8")
    return qweight.data, qweight.scales


def int8_signed_max(w):
    # the largest value, not the largest magnitude: rows whose extreme is negative clip
    w = w.float()
    scales = w.amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def int8_over_128(w):
    w = w.float()
    scales = w.abs().amax(dim=1) / 128
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8), scales


def int8_truncated(w):
    # .to(int8) truncates towards zero: a bias of half a step on average
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def int8_scale_in_input_dtype(w):
    scales = w.abs().amax(dim=1) / 127  # bf16/fp16 scales: rounded to 8 or 11 bits
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales.float()


def int8_round_half_away(w):
    # C's round() (and libdevice.round): halves away from zero; differs from torch.round only at ties
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    v = w / scales[:, None]
    return (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scales


def int8_floor_plus_half(w):
    w = w.float()
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.floor(w / scales[:, None] + 0.5).clamp(-127, 127).to(torch.int8), scales


def int8_per_tensor(w):
    w = w.float()
    scale = w.abs().max() / 127
    scales = torch.full((w.shape[0],), float(scale) if scale > 0 else 1.0)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def test_int8_per_channel_solution_is_solved():
    assert _verdict("ch05.quantize_int8_per_channel", solutions.quantize_int8_per_channel, int8_reference,
                    int8_cases)


@pytest.mark.parametrize("wrong", [int8_signed_max, int8_over_128, int8_truncated, int8_scale_in_input_dtype,
                                   int8_round_half_away, int8_floor_plus_half, int8_per_tensor])
def test_int8_per_channel_wrong_variants_are_not_solved(wrong):
    assert not _verdict("ch05.quantize_int8_per_channel", wrong, int8_reference, int8_cases)


# ----------------------------------------------------------------------------------------------
# Exercises 2 and 3: int4 packing
# ----------------------------------------------------------------------------------------------


def int4_values(gen, n, k):
    return torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)


def pack_cases(gen: torch.Generator) -> list:
    return [(int4_values(gen, 5, 8),), (int4_values(gen, 33, 301),), (int4_values(gen, 1, 1),),
            (int4_values(gen, 64, 256),)]


def pack_reference(q: torch.Tensor) -> torch.Tensor:
    u = q.long() + 8
    if q.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return (u[:, 0::2] + 16 * u[:, 1::2]).to(torch.uint8)


def pack_swapped(q):
    u = q.to(torch.int16) + 8
    if q.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return ((u[:, 0::2] << 4) | u[:, 1::2]).to(torch.uint8)


def pack_twos_complement(q):
    u = q.to(torch.int16) & 0xF  # a valid format, but not this one: 0 would be stored as 0, not 8
    if q.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=0)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)


def pack_drops_odd_column(q):
    u = q.to(torch.int16) + 8
    return (u[:, 0:u.shape[1] // 2 * 2:2] | (u[:, 1::2] << 4)).to(torch.uint8)


def test_pack_int4_solution_is_solved():
    assert _verdict("ch05.pack_int4", solutions.pack_int4, pack_reference, pack_cases)


@pytest.mark.parametrize("wrong", [pack_swapped, pack_twos_complement, pack_drops_odd_column])
def test_pack_int4_wrong_variants_are_not_solved(wrong):
    assert not _verdict("ch05.pack_int4", wrong, pack_reference, pack_cases)


def unpack_cases(gen: torch.Generator) -> list:
    def packed(n, k):
        return torch.randint(0, 256, (n, (k + 1) // 2), generator=gen, dtype=torch.uint8).to(DEVICE)

    return [(packed(5, 8), 8), (packed(33, 301), 301), (packed(1, 1), 1), (packed(64, 256), 256)]


def unpack_reference(packed: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.empty((packed.shape[0], 2 * packed.shape[1]), dtype=torch.int8, device=packed.device)
    out[:, 0::2] = (packed.long() % 16 - 8).to(torch.int8)
    out[:, 1::2] = (packed.long() // 16 - 8).to(torch.int8)
    return out[:, :k]


def unpack_no_offset(packed, k):
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return q[:, :k].to(torch.int8)


def unpack_sign_extending_shift(packed, k):
    signed = packed.to(torch.int8)  # bytes >= 128 become negative: >> 4 then sign-extends
    q = torch.stack([(signed & 0xF) - 8, (signed >> 4) - 8], dim=-1).reshape(packed.shape[0], -1)
    return q[:, :k]


def unpack_swapped(packed, k):
    q = torch.stack([(packed >> 4).to(torch.int8) - 8, (packed & 0xF).to(torch.int8) - 8], dim=-1)
    return q.reshape(packed.shape[0], -1)[:, :k]


def unpack_keeps_padding(packed, k):
    q = torch.stack([(packed & 0xF).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8], dim=-1)
    return q.reshape(packed.shape[0], -1)


def test_unpack_int4_solution_is_solved():
    assert _verdict("ch05.unpack_int4", solutions.unpack_int4, unpack_reference, unpack_cases)


@pytest.mark.parametrize("wrong", [unpack_no_offset, unpack_sign_extending_shift, unpack_swapped,
                                   unpack_keeps_padding])
def test_unpack_int4_wrong_variants_are_not_solved(wrong):
    assert not _verdict("ch05.unpack_int4", wrong, unpack_reference, unpack_cases)


def test_pack_and_unpack_match_the_library_layout():
    gen = torch.Generator().manual_seed(0)
    for k in (64, 301):
        w = torch.randn(20, k, generator=gen).to(DEVICE)
        qweight = kernel_ladder.quantize_weight(w, "int4", group_size=32)
        q = solutions.unpack_int4(qweight.data, k)
        assert torch.equal(solutions.pack_int4(q), qweight.data)
        scales = qweight.scales.float().repeat_interleave(32, dim=1)[:, :k]
        assert torch.equal(q.float() * scales, qweight.dequantize().float())


# ----------------------------------------------------------------------------------------------
# Exercise 4: int4 dequantization inside the K loop
# ----------------------------------------------------------------------------------------------


def reading_packed_once(launch):
    """As the notebook's check: the launch under the tracer, failed if a row of 16-row output tiles reads
    the packed weight more than once (each byte must give both its nibbles)."""

    def run(x, packed, scales, group_size, out):
        with trace() as traced:
            launch(x, packed, scales, group_size, out)
        reads = traced.launches[-1].per_tensor["packed_ptr"].bytes_read / packed.nbytes
        if reads > triton.cdiv(x.shape[0], 16):
            raise RuntimeError(f"the kernel read the packed weight {reads:.2f} times for {triton.cdiv(x.shape[0], 16)} "
                               "row(s) of output tiles: each byte should be loaded once and give both its nibbles")
        return out

    return run


def int4_launcher(kernel):
    """The notebook's launcher (16 x 64 tiles, one scale group per K step) and its check of the packed reads."""

    def launch(x, packed, scales, group_size, out):
        M, K = x.shape
        N = packed.shape[0]
        grid = (triton.cdiv(M, 16), triton.cdiv(N, 64))
        kernel[grid](x, packed, scales, out, M, N, K, x.stride(0), packed.stride(0), scales.stride(0),
                     scales.stride(1), out.stride(0), GROUP_SIZE=group_size, BLOCK_M=16, BLOCK_N=64)
        return out

    return reading_packed_once(launch)


def int4_linear_cases(gen: torch.Generator) -> list:
    def case(m, n, k, group_size, dtype):
        x = _randn(gen, m, k, dtype=dtype)
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(DEVICE)
        # group-major scales, as kernel_ladder.quantize_weight lays them out; sized for outputs of about 1
        scales = (0.5 + torch.rand(k // group_size, n, generator=gen)).t().to(DEVICE) * (0.3 / k**0.5)
        return x, packed, scales, group_size

    return [case(1, 64, 128, 32, torch.float32), case(5, 100, 256, 64, torch.bfloat16),
            case(20, 40, 128, 128, torch.float16), case(16, 130, 64, 32, torch.float32)]


def int4_linear_reference(x, packed, scales, group_size):
    q = torch.stack([packed.long() % 16 - 8, packed.long() // 16 - 8], dim=-1).reshape(packed.shape[0], -1)
    w = q.to(scales.dtype) * scales.repeat_interleave(group_size, dim=1)
    return x @ w.T


@triton.jit
def int4_stub_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_sg,
                     stride_om, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pass


@triton.jit
def _int4_variant(x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_sg,
                  stride_om, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SWAP: tl.constexpr, FIRST_GROUP_SCALE: tl.constexpr, OFFSET: tl.constexpr,
                  RELOAD: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, GROUP_SIZE // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP_SIZE):
        k_even = g * GROUP_SIZE + 2 * half
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + k_even[None, :], mask=(rm < M)[:, None], other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + (k_even + 1)[None, :], mask=(rm < M)[:, None], other=0.0)
        byte = g * (GROUP_SIZE // 2) + half
        packed = tl.load(packed_ptr + rn[None, :] * stride_pn + byte[:, None], mask=(rn < N)[None, :], other=0x88)
        low = ((packed & 0xF).to(tl.int8) - OFFSET).to(x_ptr.dtype.element_ty)
        if RELOAD:  # loads the same bytes again for the high nibbles: right values, twice the weight traffic
            packed = tl.load(packed_ptr + rn[None, :] * stride_pn + byte[:, None], mask=(rn < N)[None, :], other=0x88)
        high = ((packed >> 4).to(tl.int8) - OFFSET).to(x_ptr.dtype.element_ty)
        if SWAP:
            part = tl.dot(x_even, high) + tl.dot(x_odd, low)
        else:
            part = tl.dot(x_even, low) + tl.dot(x_odd, high)
        group = 0 if FIRST_GROUP_SCALE else g
        s = tl.load(scale_ptr + rn * stride_sn + group * stride_sg, mask=rn < N, other=0.0)
        acc += part * s[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def _int4_wrong(**switches):
    def launch(x, packed, scales, group_size, out):
        M, K = x.shape
        N = packed.shape[0]
        grid = (triton.cdiv(M, 16), triton.cdiv(N, 64))
        _int4_variant[grid](x, packed, scales, out, M, N, K, x.stride(0), packed.stride(0), scales.stride(0),
                            scales.stride(1), out.stride(0), GROUP_SIZE=group_size, BLOCK_M=16, BLOCK_N=64,
                            **{"SWAP": False, "FIRST_GROUP_SCALE": False, "OFFSET": 8, "RELOAD": False, **switches})
        return out

    return reading_packed_once(launch)


def test_int4_linear_solution_is_solved():
    assert _verdict("ch05.int4_linear_kernel", int4_launcher(solutions.int4_linear_kernel), int4_linear_reference,
                    int4_linear_cases, out=True, rtol=1e-4, atol=1e-4)


def test_int4_linear_variant_switches_off_is_solved():
    # the negative controls below differ from a correct kernel by their switch alone
    assert _verdict("ch05.int4_linear_kernel", _int4_wrong(), int4_linear_reference, int4_linear_cases, out=True,
                    rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wrong", [
    pytest.param(int4_launcher(int4_stub_kernel), id="stub"),
    pytest.param(_int4_wrong(SWAP=True), id="nibbles-swapped"),
    pytest.param(_int4_wrong(FIRST_GROUP_SCALE=True), id="first-group-scale-everywhere"),
    pytest.param(_int4_wrong(OFFSET=0), id="offset-8-forgotten"),
    pytest.param(_int4_wrong(RELOAD=True), id="packed-bytes-loaded-twice"),
])
def test_int4_linear_wrong_variants_are_not_solved(wrong):
    assert not _verdict("ch05.int4_linear_kernel", wrong, int4_linear_reference, int4_linear_cases, out=True,
                        rtol=1e-4, atol=1e-4)


def test_int4_reload_is_caught_by_the_traffic_check_alone(capsys):
    # Its values are right: only the count of packed bytes read rejects it, and the verdict says so.
    verdict = check("ch05_quantization.int4_linear_kernel", _int4_wrong(RELOAD=True), int4_linear_reference,
                    int4_linear_cases, rtol=1e-4, atol=1e-4, out=True)
    assert not verdict.solved and "read the packed weight 2.00 times" in verdict.message, verdict.message
    assert "wrong value" not in verdict.message


def test_int4_linear_launcher_matches_kernels_quantized_linear():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 256, generator=gen).to(DEVICE)
    x = torch.randn(3, 256, generator=gen).to(DEVICE)
    qweight = kernel_ladder.quantize_weight(w, "int4", group_size=64)
    ours = solutions.int4_linear(x, qweight.data, qweight.scales, 64)
    with torch.no_grad():
        theirs = kernel_ladder.quantized_linear(x, qweight)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Exercise 5: per-token activation quantization
# ----------------------------------------------------------------------------------------------


def per_token_launcher(kernel):
    def launch(x, q, scales):
        M, K = x.shape
        kernel[(M,)](x, q, scales, K, x.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(K))
        return q, scales

    return launch


def per_token_cases(gen: torch.Generator) -> list:
    with_zero_row = _randn(gen, 5, 1000)
    with_zero_row[2] = 0
    wide = _randn(gen, 8, 256, dtype=torch.bfloat16)
    return [(_randn(gen, 7, 300, dtype=torch.bfloat16, scale=3.0),), (_randn(gen, 1, 1),),
            (_randn(gen, 33, 64, dtype=torch.float16),), (with_zero_row,), (wide[:, :200],),
            (_tie_rows(torch.bfloat16),)]  # exact ties: round half to even


def per_token_reference(x):
    return kernel_ladder.quantize_activations(x)


@triton.jit
def _per_token_variant(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr,
                       QMAX: tl.constexpr, ROUND: tl.constexpr, SIGNED_MAX: tl.constexpr, MASK: tl.constexpr,
                       HALF_AWAY: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    if MASK:
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_xm + cols).to(tl.float32)
    if SIGNED_MAX:
        amax = tl.max(tl.where(mask, x, -1e30), axis=0)
    else:
        amax = tl.max(tl.abs(x), axis=0)
    scale = tl.math.div_rn(amax, QMAX)
    scale = tl.where(scale > 0.0, scale, 1.0)
    v = tl.math.div_rn(x, scale)
    if HALF_AWAY:  # C's round() / libdevice.round: halves away from zero
        v = tl.where(v >= 0.0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    elif ROUND:
        v = (v + 12582912.0) - 12582912.0
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    tl.store(q_ptr + row * stride_qm + cols, v.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, scale)


def _per_token_wrong(**switches):
    def launch(x, q, scales):
        M, K = x.shape
        _per_token_variant[(M,)](x, q, scales, K, x.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(K),
                                 **{"QMAX": 127.0, "ROUND": True, "SIGNED_MAX": False, "MASK": True, "HALF_AWAY": False,
                                    **switches})
        return q, scales

    return launch


def test_per_token_solution_is_solved():
    assert _verdict("ch05.quantize_per_token_kernel", per_token_launcher(solutions.quantize_per_token_kernel),
                    per_token_reference, per_token_cases, out=True)


def test_per_token_variant_switches_off_is_solved():
    assert _verdict("ch05.quantize_per_token_kernel", _per_token_wrong(), per_token_reference, per_token_cases,
                    out=True)


@pytest.mark.parametrize("wrong", [
    pytest.param(_per_token_wrong(ROUND=False), id="truncated-not-rounded"),
    pytest.param(_per_token_wrong(HALF_AWAY=True), id="ties-away-from-zero"),
    pytest.param(_per_token_wrong(QMAX=128.0), id="scale-over-128"),
    pytest.param(_per_token_wrong(SIGNED_MAX=True), id="max-not-abs-max"),
    pytest.param(_per_token_wrong(MASK=False), id="no-load-mask"),
])
def test_per_token_wrong_variants_are_not_solved(wrong):
    assert not _verdict("ch05.quantize_per_token_kernel", wrong, per_token_reference, per_token_cases, out=True)


# ----------------------------------------------------------------------------------------------
# Exercise 6: W8A8
# ----------------------------------------------------------------------------------------------


def w8a8_launcher(kernel):
    def launch(xq, x_scales, wq, w_scales, out):
        M, K = xq.shape
        N = wq.shape[0]
        grid = (triton.cdiv(M, 16), triton.cdiv(N, 32))
        kernel[grid](xq, x_scales, wq, w_scales, out, M, N, K, xq.stride(0), wq.stride(0), out.stride(0),
                     BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)
        return out

    return launch


def w8a8_cases(gen: torch.Generator) -> list:
    def case(m, n, k):
        xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8).to(DEVICE)
        wq = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
        x_scales = (0.001 + 0.05 * torch.rand(m, generator=gen)).to(DEVICE)
        w_scales = (0.001 + 0.01 * torch.rand(n, generator=gen)).to(DEVICE)
        return xq, x_scales, wq, w_scales

    return [case(1, 50, 300), case(17, 40, 64), case(5, 100, 129), case(16, 32, 512)]


def w8a8_reference(xq, x_scales, wq, w_scales):
    return (xq.double() @ wq.double().T) * x_scales[:, None] * w_scales[None, :]


@triton.jit
def _w8a8_variant(xq_ptr, x_scale_ptr, wq_ptr, w_scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ACC_BITS: tl.constexpr, X_SCALE: tl.constexpr, STORE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if ACC_BITS == 8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int8)
    elif ACC_BITS == 16:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int16)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(xq_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :], other=0)
        b = tl.load(wq_ptr + rn[None, :] * stride_wn + k[:, None], mask=(k < K)[:, None] & (rn < N)[None, :], other=0)
        if ACC_BITS == 32:
            acc = tl.dot(a, b, acc)
        else:  # "a narrower accumulator saves registers": each block's sum wraps around
            acc += tl.dot(a, b).to(acc.dtype)
    if STORE:
        out = acc.to(tl.float32) * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if X_SCALE:
            out = out * tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=(rm < M)[:, None] & (rn < N)[None, :])


def _w8a8_wrong(**switches):
    def launch(xq, x_scales, wq, w_scales, out):
        M, K = xq.shape
        N = wq.shape[0]
        grid = (triton.cdiv(M, 16), triton.cdiv(N, 32))
        _w8a8_variant[grid](xq, x_scales, wq, w_scales, out, M, N, K, xq.stride(0), wq.stride(0), out.stride(0),
                            BLOCK_M=16, BLOCK_N=32, BLOCK_K=64,
                            **{"ACC_BITS": 32, "X_SCALE": True, "STORE": True, **switches})
        return out

    return launch


def test_w8a8_solution_is_solved():
    assert _verdict("ch05.w8a8_matmul_kernel", w8a8_launcher(solutions.w8a8_matmul_kernel), w8a8_reference,
                    w8a8_cases, out=True)


def test_w8a8_variant_switches_off_is_solved():
    assert _verdict("ch05.w8a8_matmul_kernel", _w8a8_wrong(), w8a8_reference, w8a8_cases, out=True)


@pytest.mark.parametrize("wrong", [
    pytest.param(_w8a8_wrong(ACC_BITS=16), id="int16-accumulator-overflows"),
    pytest.param(_w8a8_wrong(ACC_BITS=8), id="int8-accumulator-overflows"),
    pytest.param(_w8a8_wrong(X_SCALE=False), id="token-scale-forgotten"),
    pytest.param(_w8a8_wrong(STORE=False), id="stub-loop-only"),
])
def test_w8a8_wrong_variants_are_not_solved(wrong):
    assert not _verdict("ch05.w8a8_matmul_kernel", wrong, w8a8_reference, w8a8_cases, out=True)


def test_w8a8_launcher_matches_kernels_quantized_linear():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 200, generator=gen).to(DEVICE)
    x = torch.randn(6, 200, generator=gen).to(DEVICE)
    qweight = kernel_ladder.quantize_weight(w, "int8")
    xq, x_scales = solutions.quantize_per_token(x)
    ours = solutions.w8a8_matmul(xq, x_scales, qweight.data, qweight.scales)
    with torch.no_grad():
        theirs = kernel_ladder.quantized_linear(x, qweight, activations="int8")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The solution kernels are valid compiled Triton (a learner with a GPU runs them compiled)
# ----------------------------------------------------------------------------------------------

COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys
    from solutions import ch05_quantization as s
    from utils.aot import compile_kernel

    def ptx_of(fn, pointers, constexprs):
        types = lambda name: "*" + pointers[name] if name.endswith("_ptr") else "i32"
        return compile_kernel(fn, types, constexprs, num_warps=4).asm["ptx"]

    failures = []
    for dtype in ("bf16", "fp16"):
        for group in (32, 128):
            ptx = ptx_of(s.int4_linear_kernel,
                         {"x_ptr": dtype, "packed_ptr": "u8", "scale_ptr": "fp32", "out_ptr": dtype},
                         {"GROUP_SIZE": group, "BLOCK_M": 16, "BLOCK_N": 64})
            if "mma" not in ptx:
                failures.append(f"int4_linear_kernel {dtype} g{group}: no tensor-core mma")
        ptx = ptx_of(s.quantize_per_token_kernel, {"x_ptr": dtype, "q_ptr": "i8", "scale_ptr": "fp32"},
                     {"BLOCK": 1024})
        if "div.rn.f32" not in ptx or "0f4B400000" not in ptx:
            failures.append(f"quantize_per_token_kernel {dtype}: IEEE division or the rounding constant is gone")
    ptx = ptx_of(s.w8a8_matmul_kernel,
                 {"xq_ptr": "i8", "x_scale_ptr": "fp32", "wq_ptr": "i8", "w_scale_ptr": "fp32", "out_ptr": "fp32"},
                 {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64})
    if not ("mma" in ptx and ".s8" in ptx and ".s32" in ptx):
        failures.append("w8a8_matmul_kernel: no int8 x int8 -> int32 tensor-core mma")
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_solution_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(COMPILE_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# The traffic verdict: the packed weight read once, x re-read per column of tiles, named
# ----------------------------------------------------------------------------------------------


def int4_traffic_check(launch):
    return check("ch05_quantization.int4_linear_kernel", launch, int4_linear_reference, int4_linear_cases,
                 out=True, rtol=1e-4, atol=1e-4, traffic=solutions.int4_linear_traffic())


def test_int4_linear_solution_reads_the_packed_weight_once():
    verdict = int4_traffic_check(int4_launcher(solutions.int4_linear_kernel))
    assert verdict.solved, verdict.message
    report = verdict.traffic  # the last case: M = 16, N = 130, K = 64, groups of 32, 16 x 64 tiles
    assert report.reread == {"x": 3.0, "packed": 1.0, "scales": 1.0}  # x: ceil(130 / 64) column tiles
    assert report.ideal == 16 * 64 * 4 + 130 * 32 + 130 * 2 * 4 + 16 * 130 * 4
    assert report.top is not None and report.top <= report.moved
    text = " ".join(verdict.message.split())
    assert "x read 3.00× its size:" in text  # the packed weight and the scales stay off the re-read list
    assert "x is re-read once per column of output tiles (3 = ceil(N / BLOCK_N), N = 130)" in text


def test_int4_linear_with_narrow_tiles_is_solved_with_a_higher_x_factor():
    def narrow(x, packed, scales, group_size, out):  # the solution's kernel on 16 x 16 tiles
        M, K = x.shape
        N = packed.shape[0]
        solutions.int4_linear_kernel[(triton.cdiv(M, 16), triton.cdiv(N, 16))](
            x, packed, scales, out, M, N, K, x.stride(0), packed.stride(0), scales.stride(0), scales.stride(1),
            out.stride(0), GROUP_SIZE=group_size, BLOCK_M=16, BLOCK_N=16)
        return out

    verdict = int4_traffic_check(narrow)
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread["x"] == 9.0 and verdict.traffic.reread["packed"] == 1.0  # ceil(130 / 16)
    assert verdict.traffic.ratio > int4_traffic_check(int4_launcher(solutions.int4_linear_kernel)).traffic.ratio
    assert "(9 = ceil(N / BLOCK_N), N = 130)" in " ".join(verdict.message.split())


def test_int4_linear_loading_each_byte_twice_is_named_by_the_traffic_line():
    def reload(x, packed, scales, group_size, out):  # right values, each packed byte loaded once per nibble
        M, K = x.shape
        N = packed.shape[0]
        _int4_variant[(triton.cdiv(M, 16), triton.cdiv(N, 64))](
            x, packed, scales, out, M, N, K, x.stride(0), packed.stride(0), scales.stride(0), scales.stride(1),
            out.stride(0), GROUP_SIZE=group_size, BLOCK_M=16, BLOCK_N=64, SWAP=False, FIRST_GROUP_SCALE=False,
            OFFSET=8, RELOAD=True)
        return out

    verdict = int4_traffic_check(reload)  # without the notebook's packed-read rule: the traffic line alone
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread["packed"] == 2.0
    assert "the packed weight is read 2.00× for 1 row(s) of output tiles" in " ".join(verdict.message.split())
