"""kernel_ladder.write_kv_cache: exactly its slots are written (bit for bit, the rest untouched), padding and
out-of-range slots skipped, every cache dtype (fp8 with scales against torch's own cast), strided
operands, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch

import kernel_ladder
from tests.helpers import DEVICE
from utils.trace import trace

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float8_e4m3fn: torch.uint8}


def _sentinel_cache(shape, dtype) -> torch.Tensor:
    """A cache filled with a value no write produces: NaN (fp8: its NaN code 0x7F)."""
    if dtype == torch.float8_e4m3fn:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _stored(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """What the cache must hold for x: torch's own cast (fp8: x / scale in fp32, saturated to +-448)."""
    if dtype == torch.float8_e4m3fn:
        x = x.float() if scale is None else x.float() / scale
        return x.clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


def _reference(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale=None) -> torch.Tensor:
    """The cache after the write, computed with torch indexing (valid slots only)."""
    out = cache.contiguous().clone()  # logical layout: compared with .contiguous() too
    flat = out.view(-1, *out.shape[2:])
    keep = (slots >= 0) & (slots < flat.shape[0])
    flat[slots[keep].long()] = _stored(x[keep.to(x.device)], cache.dtype, scale)
    return out


def _assert_bits_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    bits = _BITS[got.dtype]
    g, e = got.contiguous().view(bits), expected.contiguous().view(bits)
    wrong = (g != e).nonzero()
    assert wrong.numel() == 0, f"{what}: {wrong.shape[0]} elements differ, first at {wrong[0].tolist()}"


def _inputs(gen, t, heads, dim, dtype=torch.float32, scale=3.0):
    k = (torch.randn(t, heads, dim, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)
    v = (torch.randn(t, heads, dim, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)
    return k, v


@pytest.mark.parametrize("cache_dtype, input_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.float8_e4m3fn, torch.float32), (torch.float8_e4m3fn, torch.bfloat16),
])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_writes_exactly_its_slots(gen, cache_dtype, input_dtype, slot_dtype):
    num_blocks, block_size, heads, dim, t = 5, 4, 3, 5, 11
    k, v = _inputs(gen, t, heads, dim, input_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(slot_dtype)
    slots[[2, 7]] = -1  # padding tokens
    k_cache = _sentinel_cache((num_blocks, block_size, heads, dim), cache_dtype)
    v_cache = _sentinel_cache((num_blocks, block_size, heads, dim), cache_dtype)
    k_ref, v_ref = _reference(k_cache, k, slots), _reference(v_cache, v, slots)
    kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots.to(DEVICE))
    _assert_bits_equal(k_cache, k_ref, "k_cache")
    _assert_bits_equal(v_cache, v_ref, "v_cache")


def test_negative_and_out_of_range_slots_are_never_written(gen):
    num_blocks, block_size, heads, dim = 3, 4, 2, 8
    k, v = _inputs(gen, 6, heads, dim)
    # -1 and -7 are padding; 12 (= num_blocks * block_size) and 2**40 are past the cache, masked on the device.
    slots = torch.tensor([-1, 12, 5, -7, 2**40, 0], dtype=torch.int64)
    k_cache = _sentinel_cache((num_blocks, block_size, heads, dim), torch.float32)
    v_cache = _sentinel_cache((num_blocks, block_size, heads, dim), torch.float32)
    with kernel_ladder.runtime.check_values(True), pytest.raises(
            ValueError, match=r"kernel_ladder\.write_kv_cache: slot_mapping must hold slots below num_blocks \* "
                              r"block_size = 12 .*got slot_mapping\[1\] = 12"):
        kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots.to(DEVICE))  # a value check (the CPU's default)
    assert torch.isnan(k_cache).all()
    with kernel_ladder.runtime.check_values(False):  # unchecked (CUDA's default): the kernel masks them
        kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots.to(DEVICE))
    flat = k_cache.view(-1, heads, dim).cpu()
    written = (~torch.isnan(flat)).all(-1).all(-1).nonzero().flatten().tolist()
    assert written == [0, 5]
    assert torch.equal(flat[5], k[2].cpu()) and torch.equal(flat[0], k[5].cpu())
    assert torch.isnan(flat).all(-1).all(-1).sum() == 10


@pytest.mark.interpreter
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_bad_slots_unchecked_touch_nothing_outside_the_tensors(slot_dtype, gen):
    """Slots far past the cache, at its end, and very negative, unchecked: the trace (which blocks and counts
    any access outside the tensors) sees none, in int32 and int64 (2**40 must not wrap into the cache)."""
    k, v = _inputs(gen, 6, 2, 8)
    extremes = [2**31 - 1, 24, -(2**31), 5, -1, 2**40 if slot_dtype == torch.int64 else 25]
    slots = torch.tensor(extremes, dtype=slot_dtype, device=DEVICE)
    caches = [_sentinel_cache((3, 8, 2, 8), torch.float16) for _ in range(2)]
    with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
        kernel_ladder.write_kv_cache(k, v, *caches, slots)
    assert tr.out_of_bounds == 0, tr.table()
    written = (~caches[0].view(-1, 2, 8).isnan()).all(-1).all(-1).nonzero().flatten().tolist()
    assert written == [5]


def test_all_padding_and_empty_batch_write_nothing(gen):
    k_cache = _sentinel_cache((2, 4, 1, 4), torch.float16)
    v_cache = _sentinel_cache((2, 4, 1, 4), torch.float16)
    k, v = _inputs(gen, 3, 1, 4, torch.float16)
    kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
    kernel_ladder.write_kv_cache(k[:0], v[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=DEVICE))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


@pytest.mark.parametrize("k_scale, v_scale", [(0.05, 2.0), (1.0, 1.0), (0.003, 0.5)])
def test_fp8_scales_round_trip_like_torch(gen, k_scale, v_scale):
    """k / k_scale saturated to +-448 and rounded to e4m3 exactly as torch casts; dequantized
    (times the scale) it is within e4m3's rounding of k, except where it saturated."""
    num_blocks, block_size, heads, dim, t = 4, 4, 2, 16, 9
    k, v = _inputs(gen, t, heads, dim, scale=4.0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(torch.int32)
    ks = torch.tensor(k_scale, dtype=torch.float32, device=DEVICE)
    vs = torch.tensor([v_scale], dtype=torch.float32, device=DEVICE)  # one-element works too
    k_cache = _sentinel_cache((num_blocks, block_size, heads, dim), torch.float8_e4m3fn)
    v_cache = _sentinel_cache((num_blocks, block_size, heads, dim), torch.float8_e4m3fn)
    k_ref, v_ref = _reference(k_cache, k, slots, ks), _reference(v_cache, v, slots, vs)
    kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots.to(DEVICE), ks, vs)
    _assert_bits_equal(k_cache, k_ref, "k_cache")
    _assert_bits_equal(v_cache, v_ref, "v_cache")
    stored = k_cache.view(-1, heads, dim)[slots.long()].float() * ks
    unsaturated = (k / ks).abs() < 448
    error = (stored - k).abs()[unsaturated]
    assert bool((error <= 2**-4 * k.abs()[unsaturated] + 2**-9 * k_scale).all())
    if k_scale < 0.01:
        assert bool((~unsaturated).any()), "the test meant to saturate some values"
        assert bool((stored[~unsaturated].abs() == 448 * ks).all())


def test_strided_caches_and_fused_qkv_inputs(gen):
    """Caches: one layer of a (layers, ...) tensor, and a cache stored head-major (blocks, Hkv,
    block_size, D) and permuted; k and v: slices of a fused (T, Hq + 2 Hkv, D) projection."""
    layers, num_blocks, block_size, heads_q, heads, dim, t = 3, 4, 8, 4, 2, 8, 10
    qkv = torch.randn(t, heads_q + 2 * heads, dim, generator=gen).to(DEVICE)
    k, v = qkv[:, heads_q:heads_q + heads], qkv[:, heads_q + heads:]
    assert not k.is_contiguous()
    all_k = _sentinel_cache((layers, num_blocks, block_size, heads, dim), torch.bfloat16)
    head_major = _sentinel_cache((num_blocks, heads, block_size, dim), torch.bfloat16).transpose(1, 2)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(torch.int64)
    before = all_k.clone()
    k_ref, v_ref = _reference(all_k[1], k, slots), _reference(head_major, v, slots)
    kernel_ladder.write_kv_cache(k, v, all_k[1], head_major, slots.to(DEVICE))
    _assert_bits_equal(all_k[1], k_ref, "layer 1 of the stacked cache")
    _assert_bits_equal(all_k[0], before[0], "layer 0 (untouched)")
    _assert_bits_equal(all_k[2], before[2], "layer 2 (untouched)")
    _assert_bits_equal(head_major, v_ref, "the head-major v cache")


def test_opcheck(gen):
    k, v = _inputs(gen, 4, 2, 4)
    k_cache = torch.zeros(3, 2, 2, 4, device=DEVICE)
    v_cache = torch.zeros(3, 2, 2, 4, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.kernel_ladder.write_kv_cache.default, (k, v, k_cache, v_cache, slots, None, None))


def _good(dtype=torch.float32):
    k = torch.randn(3, 2, 4, device=DEVICE)
    return dict(k=k, v=k.clone(), k_cache=torch.zeros(2, 4, 2, 4, dtype=dtype, device=DEVICE),
                v_cache=torch.zeros(2, 4, 2, 4, dtype=dtype, device=DEVICE),
                slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("change, error, message", [
    (dict(k=[1.0]), TypeError, "k must be a torch.Tensor"),
    (dict(k=torch.randn(3, 8)), ValueError, "k must be 3-D"),
    (dict(v=torch.randn(3, 2, 5)), ValueError, "k and v must have the same shape"),
    (dict(k=torch.ones(3, 2, 4, dtype=torch.int32)), TypeError, "k must be float32"),
    (dict(k_cache=torch.zeros(8, 2, 4)), ValueError, "k_cache must be 4-D"),
    (dict(k_cache=torch.zeros(2, 4, 2, 4, dtype=torch.float64)), TypeError, "k_cache must be float32"),
    (dict(v_cache=torch.zeros(3, 4, 2, 4)), ValueError, "k_cache and v_cache must have the same shape"),
    (dict(v_cache=torch.zeros(2, 4, 2, 4, dtype=torch.float16)), TypeError, "same dtype"),
    (dict(k_cache=torch.zeros(2, 4, 1, 4), v_cache=torch.zeros(2, 4, 1, 4)), ValueError, "must match k's"),
    (dict(slot_mapping=torch.zeros(3)), TypeError, "slot_mapping must be int32 or int64"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int64)), ValueError, "slot_mapping must be 1-D \\(T,\\) with T = 3"),
    (dict(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0)), ValueError, "float8_e4m3fn cache only"),
])
def test_bad_input_errors(change, error, message):
    args = _good()
    args.update({name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                 for name, value in change.items()})
    with pytest.raises(error, match=f"kernel_ladder.write_kv_cache: .*{message}"):
        kernel_ladder.write_kv_cache(**args)


@pytest.mark.parametrize("k_scale, v_scale, error, message", [
    (torch.tensor(1.0), None, ValueError, "give both k_scale and v_scale"),
    (torch.tensor(1.0, dtype=torch.float16), torch.tensor(1.0), TypeError, "k_scale must be a float32"),
    (torch.ones(2), torch.tensor(1.0), ValueError, "k_scale must hold one value"),
])
def test_bad_fp8_scales(k_scale, v_scale, error, message):
    args = _good(torch.float8_e4m3fn)
    args.update(k_scale=k_scale.to(DEVICE), v_scale=None if v_scale is None else v_scale.to(DEVICE))
    with pytest.raises(error, match=f"kernel_ladder.write_kv_cache: {message}"):
        kernel_ladder.write_kv_cache(**args)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's numpy, as a GPU: inf
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_fp8_scales_must_be_positive_and_finite(which, bad, gen):
    """A scale the cache cannot be decoded with is an error when values are checked (the CPU's default;
    nothing is written); unchecked (CUDA's default) the kernel divides by it as documented: zero saturates
    to +-448 with k's sign, a negative scale stores -k / |scale|, NaN stores NaN, infinity stores 0."""
    k, v = _inputs(gen, 5, 2, 8)
    slots = torch.tensor([3, 0, 7, 1, 4], dtype=torch.int32, device=DEVICE)
    scales = {"k_scale": torch.tensor(0.25, device=DEVICE), "v_scale": torch.tensor(0.5, device=DEVICE)}
    scales[which] = torch.tensor(bad, device=DEVICE)
    caches = [_sentinel_cache((2, 4, 2, 8), torch.float8_e4m3fn) for _ in range(2)]
    with kernel_ladder.runtime.check_values(True), pytest.raises(
            ValueError, match=rf"kernel_ladder\.write_kv_cache: {which} must be a positive finite number "
                              rf"\(the cache stores k / k_scale, v / v_scale\); got {which} = {bad}"):
        kernel_ladder.write_kv_cache(k, v, *caches, slots, **scales)
    assert all(bool((c.view(torch.uint8) == 0x7F).all()) for c in caches), "nothing may be written"
    with kernel_ladder.runtime.check_values(False):
        kernel_ladder.write_kv_cache(k, v, *caches, slots, **scales)
    x = k if which == "k_scale" else v
    stored = (caches[0] if which == "k_scale" else caches[1]).view(-1, 2, 8)[slots.long()].float()
    if bad == 0.0:
        want = torch.where(x > 0, 448.0, -448.0)
    elif bad < 0:
        want = _stored(-x / -bad, torch.float8_e4m3fn, None).float()
    elif bad != bad:
        want = torch.full_like(x, float("nan"))
    else:
        want = torch.zeros_like(x)
    torch.testing.assert_close(stored, want, rtol=0, atol=0, equal_nan=True)


def test_fp8_cache_keeps_a_nan_input_nan(gen):
    """Saturation to +-448 clamps infinities but keeps NaN (torch's clamp-then-cast), never a finite code."""
    k, v = _inputs(gen, 3, 1, 8)
    k[1, 0, 2], v[2, 0, 5] = float("nan"), float("-inf")
    caches = [_sentinel_cache((1, 4, 1, 8), torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device=DEVICE)
    kernel_ladder.write_kv_cache(k, v, *caches, slots)
    _assert_bits_equal(caches[0], _reference(_sentinel_cache((1, 4, 1, 8), torch.float8_e4m3fn), k, slots), "k")
    _assert_bits_equal(caches[1], _reference(_sentinel_cache((1, 4, 1, 8), torch.float8_e4m3fn), v, slots), "v")
    assert caches[0].float().view(-1, 8)[1, 2].isnan() and caches[1].float().view(-1, 8)[2, 5] == -448


def test_overlapping_caches_rejected():
    args = _good()
    args["v_cache"] = args["k_cache"]
    with pytest.raises(ValueError, match="must not overlap"):
        kernel_ladder.write_kv_cache(**args)


@pytest.mark.parametrize("overlap", [
    lambda kv: (kv[:, 0], kv[:, 0]),                          # the same view twice
    lambda kv: (kv[:, 0], kv.flatten(1, 2)[:, 3:7]),           # v shifted 3 slots: k's last slot in each block
    lambda kv: (kv.flatten(1, 2)[:, ::2], kv[:, 1]),           # k every other slot of both halves: v's 0 and 2
    lambda kv: (kv[:, 0], kv.as_strided(kv[:, 0].shape, kv[:, 0].stride(), 3)),  # k's layout, 3 elements on
], ids=["same", "shifted", "every_other_slot", "three_elements_on"])
def test_genuinely_overlapping_views_of_one_tensor_rejected(overlap, gen):
    kv = _sentinel_cache((3, 2, 4, 2, 4), torch.float32)
    k_cache, v_cache = overlap(kv)
    args = {**_good(), "k_cache": k_cache, "v_cache": v_cache}
    before = kv.clone()
    with pytest.raises(ValueError, match=r"kernel_ladder\.write_kv_cache: k_cache and v_cache must not overlap"):
        kernel_ladder.write_kv_cache(**args)
    assert torch.equal(kv.isnan(), before.isnan()), "nothing may be written before the error"


def test_k_and_v_caches_interleaved_in_one_tensor(gen):
    """``kv[:, 0]`` and ``kv[:, 1]`` of one ``(num_blocks, 2, block_size, Hkv, D)`` tensor (FlashInfer's and
    FlagGems' layout): disjoint, though each spans the other's bytes. Written exactly, and read back by
    paged_attention."""
    num_blocks, block_size, heads, dim, t = 4, 8, 2, 16, 13
    kv = _sentinel_cache((num_blocks, 2, block_size, heads, dim), torch.float32)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    k, v = _inputs(gen, t, heads, dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(torch.int64)
    k_ref, v_ref = _reference(k_cache, k, slots), _reference(v_cache, v, slots)
    kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots.to(DEVICE))
    _assert_bits_equal(k_cache, k_ref, "k_cache = kv[:, 0]")
    _assert_bits_equal(v_cache, v_ref, "v_cache = kv[:, 1]")

    # Two sequences written into blocks 1 (5 tokens) and 3 (8 tokens); paged_attention reads them back.
    kv.copy_(torch.randn(kv.shape, generator=gen).to(DEVICE))  # no NaN left in the slots it will not read
    slots = torch.cat([block_size * 1 + torch.arange(5), block_size * 3 + torch.arange(8)])
    k_new, v_new = _inputs(gen, 13, heads, dim)
    kernel_ladder.write_kv_cache(k_new, v_new, k_cache, v_cache, slots.to(DEVICE))
    table = torch.tensor([[1], [3]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, dim, generator=gen).to(DEVICE)
    out = kernel_ladder.paged_attention(q, k_cache, v_cache, table, torch.tensor([5, 8], dtype=torch.int32,
                                                                                    device=DEVICE))
    for b, (start, n) in enumerate(((0, 5), (5, 8))):
        kb, vb = k_new[start:start + n].double(), v_new[start:start + n].double()  # (n, Hkv, D)
        qb = q[b].double().view(heads, 2, dim)  # query heads grouped by kv head
        scores = torch.einsum("hgd,nhd->hgn", qb, kb) / dim**0.5
        want = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), vb).reshape(4, dim)
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)


def _element_offsets(t: torch.Tensor) -> set[int]:
    """Every storage offset a view reaches, by enumeration (the brute-force reference)."""
    index = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return set(index.as_strided(t.shape, t.stride(), t.storage_offset()).flatten().tolist())


def test_share_elements_is_exact_against_enumeration(gen):
    """Random views of one storage (any sizes, strides, zero strides, offsets, self-overlapping too): shared
    elements exactly when the sets of element offsets intersect, whatever the byte ranges say."""
    from kernel_ladder._validate import share_elements

    base = torch.zeros(4096)
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    agree = {True: 0, False: 0}
    interleaved = 0
    for _ in range(3000):
        views = []
        for _ in range(2):
            dims = int(torch.randint(1, 4, (1,), generator=rng))
            sizes = [int(torch.randint(1, 6, (1,), generator=rng)) for _ in range(dims)]
            strides = [int(torch.randint(0, 40, (1,), generator=rng)) for _ in range(dims)]
            extent = sum((n - 1) * s for n, s in zip(sizes, strides))
            offset = int(torch.randint(0, 4096 - extent, (1,), generator=rng)) if extent < 4096 else 0
            offset = offset % 200  # near each other: most pairs' byte ranges intersect
            views.append(base.as_strided(sizes, strides, offset))
        a, b = views
        want = bool(_element_offsets(a) & _element_offsets(b))
        assert share_elements(a, b) == want == share_elements(b, a), (a.shape, a.stride(), a.storage_offset(),
                                                                      b.shape, b.stride(), b.storage_offset())
        agree[want] += 1
        lo_a, hi_a = min(_element_offsets(a)), max(_element_offsets(a))
        lo_b, hi_b = min(_element_offsets(b)), max(_element_offsets(b))
        interleaved += (not want) and lo_a <= hi_b and lo_b <= hi_a
    assert agree[True] > 300 and interleaved > 300, (agree, interleaved)  # both answers, often despite the ranges


def test_share_elements_is_cheap_for_large_caches():
    """Decided from the strides, never by enumerating: the halves of a (65536, 2, 16, 8, 128) cache (2**31
    elements, on the meta device: no memory), in well under a millisecond each; views of another dtype over
    the same bytes; another storage."""
    import time

    from kernel_ladder._validate import share_elements

    kv = torch.empty((65536, 2, 16, 8, 128), device="meta")
    k, v = kv[:, 0], kv[:, 1]
    pairs = [(k, v, False), (k, kv[:, :, 3], True), (kv[:-1, 1], kv.flatten(1, 2)[:-1, 16:32], True),
             (k, kv.flatten(1, 2)[:, 8:24], True), (kv[::2, 1], kv[1::2, 0], False),
             (k.permute(0, 2, 1, 3), v.transpose(1, 2), False)]
    start = time.perf_counter()
    for a, b, want in pairs:
        assert share_elements(a, b) == want, (a.shape, a.stride(), b.shape, b.stride())
    assert (time.perf_counter() - start) / len(pairs) < 0.01
    small = torch.zeros(2, 2, 4, 4)
    as_bytes = small.view(torch.uint8)  # (2, 2, 4, 16): four bytes per float
    assert share_elements(small[:, 0], as_bytes[:, 0, :, 3:4])
    assert not share_elements(small[:, 0], as_bytes[:, 1])
    assert not share_elements(small[:, 0], torch.zeros(2, 4, 4))  # another storage
