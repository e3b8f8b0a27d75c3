"""kernel_ladder.paged_attention against a float64 reference over the gathered cache (tests/helpers.py's
``paged_attention_reference``): decode and packed (chunked-prefill) queries, shuffled physical blocks,
lengths 1, a block, a block plus one, long contexts through split-KV (forced and automatic), GQA groups
of 1, 2, 4, 8 and MQA, every cache dtype (fp8 e4m3 with scales), windows, soft-capping, strided caches
and queries, empty sequences, int64 offsets, traced bytes (K/V once per KV head; the per-query-head
variant as the negative control), the split plan, custom-op plumbing and errors.

Every buffer the op allocates is poisoned (NaN) first. Every cache block no sequence uses, and every
slot past a sequence's length in its last block, holds NaN, and table entries past a sequence's
blocks are -1 or point at those NaN blocks: a kernel that reads one shows NaN (or an out-of-bounds
access in the trace).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_matches, paged_attention_reference

import kernel_ladder
from kernel_ladder.ops import paged_attention as pa
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE
FP8 = torch.float8_e4m3fn


def rand(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def make_cache(seq_lens, heads_kv, d, block_size, gen, dtype=torch.float32, spare_blocks=3, extra_entries=2,
               layout="contiguous", dv=None):
    """A paged cache holding ``seq_lens`` tokens per sequence in shuffled physical blocks.

    Returns ``(k_cache, v_cache, block_tables, seq_lens, scales)``; ``scales`` is ``(k_scale, v_scale)`` for
    fp8, else ``(None, None)``. Unused blocks and the tail slots of each last block are NaN; table entries
    past a sequence's blocks alternate -1 and an unused (NaN) block. ``layout``: ``contiguous``;
    ``interleaved`` (k and v are ``kv[:, 0]`` and ``kv[:, 1]`` of one ``(blocks, 2, bs, Hkv, D)`` tensor:
    non-contiguous in dim 0); ``heads_major`` (memory ``(blocks, Hkv, bs, D)`` seen as ``(blocks, bs, Hkv, D)``).
    ``dv``: v's head dim when it differs from k's (contiguous layout).
    """
    used = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(used, default=0) + extra_entries
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    spare = perm[sum(used):]
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[start:start + n].int()
        start += n
        for e in range(n, max_blocks):
            if (e - n) % 2 == 1 and len(spare):
                table[b, e] = int(spare[(b + e) % len(spare)])
    shape = (num_blocks, block_size, heads_kv, d)
    values = [torch.randn(shape[:3] + (n,), generator=gen, dtype=torch.float64) for n in (d, dv or d)]
    for t in values:  # NaN wherever no sequence's token lives
        t[spare] = float("nan")
        for b, n in enumerate(seq_lens):
            if n % block_size:
                t[int(table[b, used[b] - 1]), n % block_size:] = float("nan")
    scales = (None, None)
    if dtype == FP8:
        amax = [float(torch.nan_to_num(t, nan=0.0).abs().max()) for t in values]
        scales = tuple(torch.tensor(a / 448.0, dtype=torch.float32, device=DEVICE) for a in amax)
        values = [(t / a * 448.0).to(FP8) for t, a in zip(values, amax)]
    else:
        values = [t.to(dtype) for t in values]
    if layout == "contiguous":
        k, v = (t.to(DEVICE) for t in values)
    elif layout == "interleaved":
        kv = torch.stack(values, 1).to(DEVICE)  # (blocks, 2, bs, Hkv, D)
        k, v = kv[:, 0], kv[:, 1]
        assert not k.is_contiguous()
    elif layout == "heads_major":
        k, v = (t.transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2) for t in values)
        assert not k.is_contiguous()
    else:
        raise ValueError(layout)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return k, v, table.to(DEVICE), lens, scales


def check(q, cache, lowp=False, **options):
    """Run the op and compare with float64 (low dtypes: at most twice torch's own low-precision error)."""
    k, v, table, lens, (k_scale, v_scale) = cache
    out = kernel_ladder.paged_attention(q, k, v, table, lens, k_scale=k_scale, v_scale=v_scale, **options)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref_options = {name: options[name] for name in ("softmax_scale", "window", "softcap", "cu_seqlens_q")
                   if name in options}
    want = paged_attention_reference(q, k, v, table, lens, k_scale=k_scale, v_scale=v_scale, **ref_options)
    theirs = None
    if q.dtype != torch.float32:
        theirs = paged_attention_reference(q, k, v, table, lens, k_scale=k_scale, v_scale=v_scale,
                                           dtype=q.dtype, **ref_options)
    assert_matches(out, want, q.dtype, lowp=theirs)
    return out


# ----------------------------------------------------------------------------- decode

DECODE_CASES = [  # (Hq, Hkv, D, block_size, seq_lens, num_splits)
    (8, 2, 32, 16, [1, 16, 17], 1),          # GQA 4: one token, exactly a block, one past a block
    (16, 2, 64, 8, [8, 100], 1),             # GQA 8, the smallest blocks (8 pages a step)
    (8, 1, 32, 32, [70, 3], 3),              # MQA (group 8), three splits: the short sequence's are empty
    (2, 2, 48, 32, [33, 5], 1),              # MHA (group 1): the elementwise path; a head dim of 48
    (4, 2, 16, 64, [130, 64], 2),            # group 2 (elementwise), two splits, a 64-token block
    (4, 4, 32, 128, [129], 1),               # the largest blocks
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"H{c[0]}:{c[1]}D{c[2]}bs{c[3]}L{c[4]}S{c[5]}")
def test_decode_matches_float64(case, gen):
    hq, hkv, d, block_size, seq_lens, splits = case
    cache = make_cache(seq_lens, hkv, d, block_size, gen)
    q = rand(len(seq_lens), hq, d, gen=gen)
    check(q, cache, num_splits=splits)


def test_long_context_split_kv_forced_and_automatic(gen):
    """A long sequence and a short one: 2 and 3 splits, and the planner's choice (2 here: 4 programs on the
    interpreter's 4 SMs, 640 tokens of table) with its merge launch, all equal to the unsplit result."""
    cache = make_cache([600, 7], 2, 32, 64, gen)
    q = rand(2, 8, 32, gen=gen)
    k, v, table, lens, _ = cache
    assert pa.plan_paged_attention(2, 2, table.shape[1] * 64, 64, DEVICE) == 2
    single = check(q, cache, num_splits=1)
    for splits in (2, 3):
        out = check(q, cache, num_splits=splits)
        torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-6)
    with trace() as tr:
        out = kernel_ladder.paged_attention(q, k, v, table, lens)
    assert [x.kernel for x in tr.launches] == ["paged_attention_kernel", "paged_attention_merge_kernel"]
    assert tr.launches[0].grid == (2, 2, 2)
    torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_caches(dtype, gen):
    cache = make_cache([40, 1, 77], 2, 64, 16, gen, dtype=dtype)
    check(rand(3, 8, 64, gen=gen, dtype=dtype), cache, num_splits=2)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_caches_with_scales(q_dtype, gen):
    """e4m3 codes times per-tensor scales; the output has q's dtype."""
    cache = make_cache([50, 9], 2, 32, 16, gen, dtype=FP8)
    out = check(rand(2, 8, 32, gen=gen, dtype=q_dtype), cache, num_splits=2 if q_dtype == torch.float32 else 1)
    assert out.dtype == q_dtype


def test_window_softcap_and_scale_in_decode(gen):
    cache = make_cache([45, 20], 2, 32, 8, gen)
    q = rand(2, 4, 32, gen=gen)
    check(q, cache, window=13, softcap=2.5, softmax_scale=0.3, num_splits=2)


def test_empty_sequence_gives_zero(gen):
    """seq_lens[b] = 0: no key, output 0 (also through the merge)."""
    cache = make_cache([0, 12], 1, 16, 8, gen)
    q = rand(2, 4, 16, gen=gen)
    for splits in (1, 2):
        out = check(q, cache, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


# ----------------------------------------------------------------------------- packed queries

PACKED_OPTIONS = [
    {},
    {"window": 10},
    {"softcap": 3.0, "softmax_scale": 0.2},
    {"num_splits": 2, "window": 30},
]


@pytest.mark.parametrize("options", PACKED_OPTIONS, ids=str)
def test_packed_queries_chunked_prefill(options, gen):
    """A full prefill (q_len = seq_len = 40), a chunk of 9 after 61 cached tokens, single decode tokens,
    and an empty sequence: causal by position, the window and soft-cap as in flash_attention."""
    seq_lens, q_lens = [5, 40, 70, 1, 0], [1, 40, 9, 1, 0]
    cache = make_cache(seq_lens, 2, 32, 16, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = rand(sum(q_lens), 8, 32, gen=gen)
    check(q, cache, cu_seqlens_q=cu, **options)


def test_packed_queries_match_flash_attention(gen):
    """A full prefill over a paged cache equals kernel_ladder.flash_attention (causal) on the gathered K/V, and a
    windowed chunk equals it too (bottom-right aligned: the chunk's queries are the cache's newest)."""
    seq_lens = [37, 50]  # new tokens: all 37 of the first, the last 12 of the second
    cache = make_cache(seq_lens, 1, 16, 8, gen, dtype=torch.bfloat16)
    k, v, table, lens, _ = cache
    cu = torch.tensor([0, 37, 49], dtype=torch.int32, device=DEVICE)
    q = rand(49, 4, 16, gen=gen, dtype=torch.bfloat16)
    out = kernel_ladder.paged_attention(q, k, v, table, lens, cu_seqlens_q=cu, window=9)
    for b, (kb, vb) in enumerate(pa.gather_kv(k, v, table, lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dense = kernel_ladder.flash_attention(q[rows].transpose(0, 1)[None], kb.transpose(0, 1)[None],
                                              vb.transpose(0, 1)[None], causal=True, window=9)
        torch.testing.assert_close(out[rows].float(), dense[0].transpose(0, 1).float(), rtol=2e-2, atol=2e-2)


def test_packed_group_8_bf16_with_splits(gen):
    seq_lens = [90, 17]  # new tokens: the last 20 of the first, all 17 of the second
    cache = make_cache(seq_lens, 1, 64, 32, gen, dtype=torch.bfloat16)
    cu = torch.tensor([0, 20, 37], dtype=torch.int32, device=DEVICE)
    check(rand(37, 8, 64, gen=gen, dtype=torch.bfloat16), cache, cu_seqlens_q=cu, num_splits=3)


# ----------------------------------------------------------------------------- attention sinks, Dv != D


def sink_paged_reference(q, k_cache, v_cache, block_tables, seq_lens, sinks, cu_seqlens_q=None, window=None,
                         softcap=None):
    """GPT-OSS's eager attention (the sink as one more logit column, softmax, the column dropped) per sequence over
    the gathered cache, in float64: query ``i`` of a sequence at position ``seq_len - q_len + i`` sees keys up to
    it (and inside the window). v may have its own head dim. A query that sees no key gives 0 (sink finite)."""
    q = q.detach().cpu().double()
    heads_q, d = q.shape[1], q.shape[2]
    out = torch.zeros((*q.shape[:2], v_cache.shape[-1]), dtype=torch.float64)
    sinks = sinks.detach().cpu().double()
    for b, (k, v) in enumerate(pa.gather_kv(k_cache.cpu(), v_cache.cpu(), block_tables.cpu(), seq_lens.cpu())):
        rows = slice(b, b + 1) if cu_seqlens_q is None else slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        n, length = q[rows].shape[0], k.shape[0]
        if n == 0:
            continue
        group = heads_q // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("thd,shd->hts", q[rows], k) / math.sqrt(d)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        position = length - n + torch.arange(n)[:, None]
        key = torch.arange(length)[None, :]
        visible = (key <= position) & ((key > position - window) if window is not None else True)
        s = s.masked_fill(~visible, float("-inf"))
        combined = torch.cat([s, sinks.view(heads_q, 1, 1).expand(heads_q, n, 1)], -1)
        combined = combined - combined.max(-1, keepdim=True).values
        out[rows] = torch.einsum("hts,shd->thd", torch.softmax(combined, -1)[..., :-1], v)
    return out


SINK_DECODE_CASES = [  # (Hq, Hkv, D, Dv, block_size, seq_lens, num_splits)
    (8, 2, 32, 32, 16, [1, 16, 40, 0], 1),  # GQA 4 (dot path); an empty sequence: only the sink, output 0
    (8, 2, 32, 32, 16, [1, 16, 40, 0], 3),  # three splits: the sink counted once, in the merge
    (2, 2, 24, 16, 8, [33, 5], 1),  # MHA (elementwise path), Dv != D
    (4, 2, 12, 8, 8, [70, 3], 4),  # group 2, split, 12 / 8
]


@pytest.mark.parametrize("case", SINK_DECODE_CASES, ids=lambda c: f"H{c[0]}:{c[1]}D{c[2]}Dv{c[3]}S{c[6]}")
def test_decode_with_sinks_and_dv_matches_gpt_oss_eager(case, gen):
    hq, hkv, d, dv, block_size, seq_lens, splits = case
    k, v, table, lens, _ = make_cache(seq_lens, hkv, d, block_size, gen, dv=dv)
    q = rand(len(seq_lens), hq, d, gen=gen)
    sinks = rand(hq, gen=gen, scale=2.0)
    out = kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=splits, sinks=sinks)
    assert out.shape == (len(seq_lens), hq, dv)
    assert_matches(out, sink_paged_reference(q, k, v, table, lens, sinks), torch.float32)
    if 0 in seq_lens:
        assert torch.equal(out[seq_lens.index(0)], torch.zeros_like(out[0]))


@pytest.mark.parametrize("splits", [1, 2], ids=lambda s: f"S{s}")
def test_chunked_prefill_with_sinks_window_and_dv(splits, gen):
    """Packed queries (a full prefill, a chunk after cached tokens, a decode token) with sinks, a window and
    Dv != D, split or not, and equal to kernel_ladder.flash_attention with the same sinks on the gathered K/V."""
    seq_lens, q_lens = [40, 70, 5], [40, 9, 1]
    k, v, table, lens, _ = make_cache(seq_lens, 2, 24, 16, gen, dv=16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = rand(sum(q_lens), 4, 24, gen=gen)
    sinks = rand(4, gen=gen, scale=2.0)
    out = kernel_ladder.paged_attention(q, k, v, table, lens, cu_seqlens_q=cu, window=30, num_splits=splits,
                                        sinks=sinks)
    assert_matches(out, sink_paged_reference(q, k, v, table, lens, sinks, cu, window=30), torch.float32)
    for b, (kb, vb) in enumerate(pa.gather_kv(k, v, table, lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dense = kernel_ladder.flash_attention(q[rows].transpose(0, 1)[None], kb.transpose(0, 1)[None],
                                              vb.transpose(0, 1)[None], causal=True, window=30, sinks=sinks)
        torch.testing.assert_close(out[rows], dense[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_split_merge_counts_the_sink_exactly_once(gen):
    """The same decode with 1, 2, 3 and 5 splits gives the same result: a sink counted in every split would
    weigh S times (the reference tells 1 sink from 2: checked on the two-split sum)."""
    k, v, table, lens, _ = make_cache([300, 130], 1, 16, 16, gen)
    q = rand(2, 4, 16, gen=gen)
    sinks = torch.tensor([5.0, 6.0, 6.5, 7.0], device=DEVICE)  # near the rows' lse (log 300): counting it twice shows
    want = sink_paged_reference(q, k, v, table, lens, sinks)
    for splits in (1, 2, 3, 5):
        assert_matches(kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=splits, sinks=sinks), want,
                       torch.float32, what=f"{splits} splits")
    twice = sink_paged_reference(q, k, v, table, lens, sinks + math.log(2.0))  # exp(s + log 2) = 2 exp(s)
    assert (twice - want).abs().max() > 0.1 * want.abs().max()


def test_paged_minus_inf_sinks_are_no_sinks_and_huge_sinks_take_everything(gen):
    k, v, table, lens, _ = make_cache([50, 9], 2, 16, 8, gen)
    q = rand(2, 4, 16, gen=gen)
    for splits in (1, 2):
        plain = kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=splits)
        none = kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=splits,
                                             sinks=torch.full((4,), float("-inf"), device=DEVICE))
        assert torch.equal(none, plain)
        huge = kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=splits,
                                             sinks=torch.full((4,), 1e4, device=DEVICE))
        assert torch.equal(huge, torch.zeros_like(huge))


def test_paged_sinks_opcheck_and_errors(gen):
    k, v, table, lens, _ = make_cache([9, 20], 1, 16, 8, gen, dv=8)
    q = rand(2, 2, 16, gen=gen)
    sinks = rand(2, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.paged_attention.default,
                          (q, k, v, table, lens, None, None, None, 0.25, None, None, 2, sinks))
    base = dict(q=q, k_cache=k, v_cache=v, block_tables=table, seq_lens=lens)
    for change, error, message in [
        (dict(sinks=sinks[:1]), ValueError, r"sinks must have shape \(Hq,\) = \(2,\)"),
        (dict(sinks=sinks.long()), TypeError, "sinks must be a float tensor"),
        (dict(sinks=sinks.tolist()), TypeError, "sinks must be a torch.Tensor"),
        (dict(v_cache=v[:, :, :, :0]), ValueError, r"v_cache's head dim Dv must be in \[1, 256\], got 0"),
        (dict(v_cache=v[:4]), ValueError, "k_cache and v_cache must have the same shape but for the head dim"),
    ]:
        with pytest.raises(error, match=r"kernel_ladder\.paged_attention: .*" + message):
            kernel_ladder.paged_attention(**{**base, **change})


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("layout", ["interleaved", "heads_major"])
def test_strided_caches_and_queries_are_read_in_place(layout, gen):
    """Caches that are views (k and v interleaved per block; heads-major memory) and a query sliced from a
    fused projection: the result equals contiguous copies', bit for bit, and no torch op copies anything."""
    cache = make_cache([30, 41], 2, 32, 16, gen, layout=layout)
    k, v, table, lens, _ = cache
    qkv = rand(2, 3 * 8 * 32, gen=gen)
    q = qkv[:, 8 * 32: 16 * 32].view(2, 8, 32)
    with trace() as tr:
        out = kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=2)
    copies = [op.name for op in tr.torch_ops if op.launches and ("copy" in op.name or "clone" in op.name)]
    assert not copies, copies
    assert torch.equal(out, kernel_ladder.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), table, lens,
                                                          num_splits=2))
    assert_matches(out, paged_attention_reference(q, k, v, table, lens), torch.float32)


def test_int64_offsets_path(gen, monkeypatch):
    """The INDEX_64 variant (chosen for caches past 2**31 elements) gives the same result."""
    cache = make_cache([20, 9], 2, 16, 8, gen)
    q = rand(2, 4, 16, gen=gen)
    want = check(q, cache, num_splits=2)
    monkeypatch.setattr(pa, "_index_64", lambda *tensors: True)
    assert torch.equal(check(q, cache, num_splits=2), want)


def test_index_64_is_chosen_past_int32():
    assert not pa._index_64(torch.empty((1,)).expand(2**20, 2**12))  # stride 0: one element, however large
    assert not pa._index_64(torch.empty((2**15, 16, 8, 128), device="meta"))  # 2**29 elements
    assert pa._index_64(torch.empty((2**17, 16, 8, 128), device="meta"))  # 2**31: a large cache


# ----------------------------------------------------------------------------- traffic


def _decode_ideal(q, k, table, lens, heads_kv) -> int:
    """q read and out written once; each sequence's K and V once per KV head (no padding, no unused slot);
    its table entries and length once per KV head (each program reads its own)."""
    d, element = q.shape[-1], k.element_size()
    block_size = k.shape[1]
    total = 2 * q.numel() * q.element_size()
    for n in lens.tolist():
        total += heads_kv * (2 * n * d * element + 4 * math.ceil(n / block_size) + 4)
    return total


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 2], ids=lambda s: f"splits{s}")
def test_decode_bytes_are_ideal_with_gqa_grouping(splits, gen):
    """Each K/V element is read once per KV head (not once per query head); with split-KV the partials'
    round trip (and q read per split) stays within 5%."""
    hq, hkv, d = 8, 2, 64
    cache = make_cache([700, 520], hkv, d, 16, gen, dtype=torch.float16)  # long: the partials are ~3%
    k, v, table, lens, _ = cache
    q = rand(2, hq, d, gen=gen, dtype=torch.float16)
    with trace() as tr:
        kernel_ladder.paged_attention(q, k, v, table, lens, num_splits=splits)
    ideal = _decode_ideal(q, k, table, lens, hkv)
    assert tr.out_of_bounds == 0
    kernel_bytes = tr.launches[0].per_tensor
    kv_read = kernel_bytes["k_cache_ptr"].bytes_read + kernel_bytes["v_cache_ptr"].bytes_read
    assert kv_read == hkv * 2 * sum(lens.tolist()) * d * 2
    assert len(tr.launches) == (1 if splits == 1 else 2)
    assert tr.bytes <= 1.05 * ideal, (tr.bytes, ideal, tr.table())


@pytest.mark.interpreter
def test_negative_control_per_query_head_programs_read_the_group_times_more(gen):
    """The ladder's previous step: one program per query head (group_query_heads=False) reads each K/V
    block Hq / Hkv times, and so fails the ideal-bytes bound; same values."""
    hq, hkv, d = 8, 2, 32
    cache = make_cache([100, 64], hkv, d, 16, gen)
    k, v, table, lens, _ = cache
    q = rand(2, hq, d, gen=gen)
    runs = {}
    for grouped in (True, False):
        out = torch.empty_like(q)
        with trace() as tr:
            pa._forward(q, k, v, table, lens, None, None, None, out, 1 / math.sqrt(d), None, None, 1,
                        group_query_heads=grouped)
        per_tensor = tr.launches[0].per_tensor
        runs[grouped] = (out, per_tensor["k_cache_ptr"].bytes_read + per_tensor["v_cache_ptr"].bytes_read, tr.bytes)
    assert runs[False][1] == (hq // hkv) * runs[True][1]
    assert runs[False][2] > 1.05 * _decode_ideal(q, k, table, lens, hkv)
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=1e-5, atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed"])
def test_value_checks_read_the_host_memory_not_torch_ops(packed, gen):
    """With the value checks on (the CPU's default), seq_lens, the table entries and cu_seqlens_q are checked on
    the tensors' memory: a trace of the op holds its kernel's bytes and no torch op's (as mla_attention's)."""
    k, v, table, lens, _ = make_cache([20, 9], 2, 16, 8, gen)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE) if packed else None
    q = rand(5 if packed else 2, 4, 16, gen=gen)
    with kernel_ladder.runtime.check_values(True), trace() as tr:
        kernel_ladder.paged_attention(q, k, v, table, lens, cu_seqlens_q=cu, num_splits=1)
    (launch,) = tr.launches
    assert tr.bytes == launch.bytes, tr.table()


# ----------------------------------------------------------------------------- the plan


def test_plan_splits_only_small_batches_of_long_sequences():
    sms = kernel_ladder._launch.num_sms(DEVICE)
    plan = pa.plan_paged_attention
    assert plan(2 * sms, 1, 1 << 16, 16, DEVICE) == 1  # two waves already
    assert plan(1, 1, 256, 16, DEVICE) == 1  # too short to split
    assert plan(1, 1, 1 << 20, 16, DEVICE) == min(2 * sms, pa.MAX_SPLITS)  # one program: up to two waves
    assert plan(1, 1, 1024, 16, DEVICE) == 4  # at least MIN_SPLIT_TOKENS per split
    assert plan(1, 1, 1024, 128, DEVICE) == 2  # and at least 4 blocks
    assert all(1 <= plan(b, h, n, 16, DEVICE) <= pa.MAX_SPLITS for b in (1, 3, 64) for h in (1, 8)
               for n in (1, 700, 1 << 17))


# ----------------------------------------------------------------------------- plumbing


def test_opcheck(gen):
    k, v, table, lens, _ = make_cache([9, 20], 1, 16, 8, gen)
    q = rand(2, 2, 16, gen=gen)
    torch.library.opcheck(torch.ops.kernel_ladder.paged_attention.default,
                          (q, k, v, table, lens, None, None, None, 0.25, None, None, 2))


def test_backward_raises_a_clear_error(gen):
    k, v, table, lens, _ = make_cache([9], 1, 16, 8, gen)
    q = rand(1, 2, 16, gen=gen).requires_grad_()
    out = kernel_ladder.paged_attention(q, k, v, table, lens)
    with pytest.raises(NotImplementedError, match=r"kernel_ladder\.paged_attention is forward only"):
        out.sum().backward()


def test_errors_name_the_op_and_the_argument(gen):
    k, v, table, lens, _ = make_cache([9, 20], 2, 16, 8, gen)
    q = rand(2, 4, 16, gen=gen)
    f8 = k.to(FP8)
    one = torch.ones((), device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    bad = [
        (dict(block_tables=table.long()), TypeError, "block_tables must be int32"),
        (dict(block_tables=table[0]), ValueError, r"block_tables must be 2-D \(B, max_blocks\)"),
        (dict(seq_lens=lens.long()), TypeError, "seq_lens must be int32"),
        (dict(seq_lens=lens[:1]), ValueError, r"seq_lens must have shape \(B,\) = \(2,\)"),
        (dict(q=rand(2, 3, 16, gen=gen)), ValueError, r"query heads \(3\) must be a multiple"),
        (dict(q=rand(2, 4, 32, gen=gen)), ValueError, "share the head dim"),
        (dict(q=rand(2, 4, 4, 16, gen=gen)), ValueError, r"q must be 3-D \(B, Hq, D\)"),
        (dict(q=rand(3, 4, 16, gen=gen)), ValueError, r"q.shape\[0\] must be B = 2"),
        (dict(q=q.long()), TypeError, "q must be float32, float16 or bfloat16"),
        (dict(k_cache=k[:, :6], v_cache=v[:, :6]), ValueError, "block size .* power of two from 8 to 128, got 6"),
        (dict(k_cache=k[:, :, :1]), ValueError, "k_cache and v_cache must have the same shape"),
        (dict(k_cache=k.half()), TypeError, "k_cache and v_cache must have the same dtype"),
        (dict(k_cache=k.half(), v_cache=v.half()), TypeError, "must have q's dtype"),
        (dict(k_cache=k.to("meta")), ValueError, "q and k_cache must be on the same device"),
        (dict(k_cache=f8, v_cache=f8), ValueError, "need k_scale"),
        (dict(k_cache=f8, v_cache=f8, k_scale=one, v_scale=one.double()), TypeError,
         "v_scale must be a float32 tensor of one element"),
        (dict(k_scale=one), ValueError, "k_scale is only for float8_e4m3fn caches"),
        (dict(cu_seqlens_q=cu.long()), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_q=cu[:2]), ValueError, r"cu_seqlens_q must have shape \(B \+ 1,\) = \(3,\)"),
        (dict(num_splits=0), ValueError, "num_splits must be >= 1"),
        (dict(num_splits=2.0), TypeError, "num_splits must be a positive int"),
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(softcap=-1.0), ValueError, "softcap must be a positive"),
        (dict(softmax_scale="a"), TypeError, "softmax_scale must be a float"),
        (dict(seq_lens=torch.tensor([9, 41], dtype=torch.int32, device=DEVICE)), ValueError,
         r"seq_lens must be in \[0, max_blocks \* block_size\] = \[0, 40\]"),
        (dict(cu_seqlens_q=torch.tensor([0, 2, 1], dtype=torch.int32, device=DEVICE), q=rand(1, 4, 16, gen=gen)),
         ValueError, "cu_seqlens_q must start at 0, never decrease, end at total_q = 1"),
        (dict(cu_seqlens_q=torch.tensor([0, 10, 12], dtype=torch.int32, device=DEVICE), q=rand(12, 4, 16, gen=gen)),
         ValueError, "more new tokens than seq_lens"),
    ]
    base = dict(q=q, k_cache=k, v_cache=v, block_tables=table, seq_lens=lens)
    for change, error, message in bad:
        with pytest.raises(error, match=r"kernel_ladder\.paged_attention: .*" + message):
            kernel_ladder.paged_attention(**{**base, **change})
    with pytest.raises(TypeError, match=r"kernel_ladder\.paged_attention: q must be a torch.Tensor"):
        kernel_ladder.paged_attention(None, k, v, table, lens)
    torch.testing.assert_close(kernel_ladder.paged_attention(**base),
                               kernel_ladder.paged_attention(**base))  # base is valid


# ----------------------------------------------------------------------------- bad values, unchecked


@pytest.mark.parametrize("entry", [10**6, -5, 7], ids=["huge", "negative", "num_blocks"])
def test_a_block_table_entry_outside_the_cache_is_clamped(entry, gen):
    """With value checks on, an entry outside [0, num_blocks) is an error; off (a GPU's default), the kernel
    clamps it into the cache (the first or the last block) and reads nothing outside it: the trace blocks and
    counts any access outside the tensors."""
    cache = make_cache([20, 9], 1, 16, 8, gen, spare_blocks=2)  # sequence 0: 3 blocks, sequence 1: 2
    k, v, table, lens, _ = cache
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)  # any block may be read now
    num_blocks = k.shape[0]
    q = rand(2, 4, 16, gen=gen)
    bad = table.clone()
    bad[0, 1] = entry  # sequence 0's middle block
    with kernel_ladder.runtime.check_values(True), pytest.raises(
            ValueError, match=rf"kernel_ladder\.paged_attention: every block_tables entry a sequence uses .* got "
                              rf"block_tables\[0, 1\] = {entry}"):
        kernel_ladder.paged_attention(q, k, v, bad, lens)
    clamped = bad.clamp(0, num_blocks - 1)
    for splits in (1, 2):
        with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
            out = kernel_ladder.paged_attention(q, k, v, bad, lens, num_splits=splits)
        assert tr.out_of_bounds == 0, tr.table()
        assert_matches(out, paged_attention_reference(q, k, v, clamped, lens), torch.float32)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the merge of rows no program owns (poisoned)
@pytest.mark.parametrize("case", ["seq_len_past_table", "seq_len_negative", "cu_past_q", "cu_before_q",
                                  "cu_decreasing"])
def test_bad_lengths_unchecked_never_access_outside_the_tensors(case, gen):
    """seq_lens and cu_seqlens_q that a check would reject (value checks off: a GPU's default) read and write
    only inside q, the caches, the tables and out: the trace blocks and counts every access outside them."""
    k, v, table, lens, _ = make_cache([20, 9], 2, 16, 8, gen)
    cu = None
    q = rand(2, 4, 16, gen=gen)
    if case == "seq_len_past_table":
        lens = torch.tensor([20, 10**6], dtype=torch.int32, device=DEVICE)
    elif case == "seq_len_negative":
        lens = torch.tensor([-40, 9], dtype=torch.int32, device=DEVICE)
    else:
        q = rand(6, 4, 16, gen=gen)
        cu = {"cu_past_q": [0, 2, 1000], "cu_before_q": [100, 102, 104],
              "cu_decreasing": [0, 5, -3]}[case]
        cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    with kernel_ladder.runtime.check_values(True), pytest.raises(ValueError, match=r"kernel_ladder\.paged_attention"):
        kernel_ladder.paged_attention(q, k, v, table, lens, cu_seqlens_q=cu)
    for splits in (1, 2):
        with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
            kernel_ladder.paged_attention(q, k, v, table, lens, cu_seqlens_q=cu, num_splits=splits)
        assert tr.out_of_bounds == 0, tr.table()


@pytest.mark.interpreter
def test_an_empty_cache_unchecked_reads_nothing(gen):
    """No block to clamp into: every sequence is read as empty (output 0), nothing outside the tensors."""
    k = v = torch.empty((0, 8, 1, 16), device=DEVICE)
    q = rand(2, 2, 16, gen=gen)
    table = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5, 16], dtype=torch.int32, device=DEVICE)
    with kernel_ladder.runtime.check_values(True), pytest.raises(ValueError, match="every block_tables entry"):
        kernel_ladder.paged_attention(q, k, v, table, lens)
    with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
        out = kernel_ladder.paged_attention(q, k, v, table, lens)
    assert tr.out_of_bounds == 0, tr.table()
    assert torch.equal(out, torch.zeros_like(q))
