"""kernel_ladder.mla_attention and write_latent_cache (DeepSeek-V3's absorbed multi-head latent attention over a
paged latent cache) against float64 references: the absorbed algebra against the unabsorbed attention (keys and
values expanded through kv_b_proj), the kernel against transformers' own DeepseekV3Attention, decode and chunked
prefill over shuffled blocks, seq_len 0, non-power-of-two kv_lora_rank and RoPE dims, blocks larger than a step,
several head programs, split-KV, every dtype, strided inputs, NaN kept in its sequence, bad block tables with the
value checks on and off (clamped, nothing read outside a tensor), the exact bytes (cache per token against
GQA/MHA; the decode kernel's traced traffic against the ideal), errors, the custom-op plumbing, and sm_90
compilation without spills.

Every buffer the ops allocate is poisoned (NaN) first; every cache row no sequence owns is NaN, so a kernel that
reads one shows it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_matches

import kernel_ladder
from kernel_ladder.ops import mla
from utils.aot import run_compiled
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE
I32 = torch.int32


def rand(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def make_latent_cache(seq_lens, width, block_size, gen, dtype=torch.float32, spare_blocks=2, extra_entries=1):
    """A paged latent cache ``(num_blocks, block_size, width)`` holding ``seq_lens`` tokens in shuffled blocks;
    unused blocks and each last block's tail rows are NaN, table entries past a sequence's blocks are -1.
    Returns ``(cache, block_tables, seq_lens)``."""
    used = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(used) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(used, default=0) + extra_entries), -1, dtype=I32)
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[start:start + n].int()
        start += n
    cache = torch.randn((num_blocks, block_size, width), generator=gen, dtype=torch.float64)
    cache[perm[sum(used):]] = float("nan")
    for b, n in enumerate(seq_lens):
        if n % block_size:
            cache[int(table[b, used[b] - 1]), n % block_size:] = float("nan")
    return cache.to(dtype).to(DEVICE), table.to(DEVICE), torch.tensor(seq_lens, dtype=I32, device=DEVICE)


def reference(q_latent, q_rope, cache, table, lens, scale, rank, cu=None, dtype=torch.float64):
    """The absorbed attention written out per sequence (``dtype``: float64, or a low precision for torch's own
    error): scores ``scale (q_latent . c + q_rope . k_pe)`` over the visible cached tokens, softmax, times c."""
    out = torch.zeros(q_latent.shape, dtype=dtype)
    for b, latent in enumerate(mla.gather_latent(cache.cpu(), table.cpu(), lens.cpu())):
        latent = latent.to(dtype)
        rows = [b] if cu is None else list(range(int(cu[b]), int(cu[b + 1])))
        if not rows or latent.shape[0] == 0:
            continue
        c, k_pe = latent[:, :rank], latent[:, rank:]
        ql, qr = q_latent.cpu()[rows].to(dtype), q_rope.cpu()[rows].to(dtype)  # (q_len, H, .)
        s = scale * (torch.einsum("thl,nl->thn", ql, c) + torch.einsum("thr,nr->thn", qr, k_pe))
        positions = latent.shape[0] - len(rows) + torch.arange(len(rows))
        hidden = torch.arange(latent.shape[0])[None, :] > positions[:, None]  # causal: keys after the query
        s = s.masked_fill(hidden[:, None, :], float("-inf"))
        out[rows] = torch.einsum("thn,nl->thl", torch.softmax(s.double(), -1).to(dtype), c)
    return out


def check(q_latent, q_rope, cache, table, lens, scale, rank, cu=None, **options):
    out = kernel_ladder.mla_attention(q_latent, q_rope, cache, table, lens, scale, rank, cu, **options)
    assert out.shape == q_latent.shape and out.dtype == q_latent.dtype
    want = reference(q_latent, q_rope, cache, table, lens, scale, rank, cu)
    theirs = None
    if q_latent.dtype != torch.float32:
        theirs = reference(q_latent, q_rope, cache, table, lens, scale, rank, cu, dtype=q_latent.dtype)
    assert_matches(out, want, q_latent.dtype, lowp=theirs)
    return out


# ----------------------------------------------------------------------------- the algebra


def unabsorbed(q_nope, q_pe, c, k_pe, w_kv_b, heads, nope, v_dim, scale):
    """Ordinary attention over keys and values expanded through kv_b_proj (HF's ``expand_kv``): one query token
    per head ``(H, nope)``/``(H, R)`` over ``n`` cached tokens; returns ``(H, v_dim)``."""
    kv = (c @ w_kv_b.T).view(c.shape[0], heads, nope + v_dim)  # HF: kv_b_proj(c).view(..., H, nope + v)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], -1)  # (n, H, nope + R)
    q = torch.cat([q_nope, q_pe], -1)  # (H, nope + R)
    p = torch.softmax(scale * torch.einsum("hd,nhd->hn", q, k), -1)
    return torch.einsum("hn,nhv->hv", p, v)


def test_absorbed_attention_equals_the_unabsorbed_one_in_float64(gen):
    """q_nope . (W_UK c) = (W_UK^T q_nope) . c and sum p W_UV c = W_UV (sum p c): the absorbed scores and output
    equal the expanded keys' and values' to float64 rounding, with DeepSeek's scale (nope + rope dims)."""
    heads, rank, rope, nope, v_dim, n = 3, 24, 6, 10, 7, 13
    w = torch.randn(heads * (nope + v_dim), rank, generator=gen, dtype=torch.float64)
    c, k_pe = (torch.randn(n, d, generator=gen, dtype=torch.float64) for d in (rank, rope))
    q_nope, q_pe = (torch.randn(heads, d, generator=gen, dtype=torch.float64) for d in (nope, rope))
    scale = (nope + rope) ** -0.5
    want = unabsorbed(q_nope, q_pe, c, k_pe, w, heads, nope, v_dim, scale)
    w_uk, w_uv = mla.split_kv_b_weight(w, heads, nope, v_dim)
    q_latent = mla.absorb_query(q_nope, w_uk)
    p = torch.softmax(scale * (q_latent @ c.T + q_pe @ k_pe.T), -1)
    got = mla.project_output(p @ c, w_uv)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Negative controls: the first H * nope rows as W_UK (the wrong head slicing), and the scores without the
    # RoPE part, are not the same attention.
    wrong_uk = w[: heads * nope].view(heads, nope, rank)
    p_wrong = torch.softmax(scale * (mla.absorb_query(q_nope, wrong_uk) @ c.T + q_pe @ k_pe.T), -1)
    assert not torch.allclose(mla.project_output(p_wrong @ c, w_uv), want, atol=1e-3)
    p_no_rope = torch.softmax(scale * (q_latent @ c.T), -1)
    assert not torch.allclose(mla.project_output(p_no_rope @ c, w_uv), want, atol=1e-3)


def test_kernel_matches_transformers_deepseek_v3_attention(gen):
    """transformers' DeepseekV3Attention (eager, float64, interleaved RoPE) on an 11-token sequence, against
    the latent cache written by write_latent_cache and read by mla_attention (float32): the whole sequence as
    one prefill chunk, its last 4 tokens as a chunk after 7 cached ones, and the last token decoding, each
    absorbed through kv_b_proj and projected by o_proj."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = DeepseekV3Config(hidden_size=32, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                              num_hidden_layers=1, vocab_size=64, max_position_embeddings=64, rope_interleave=True)
    config._attn_implementation = "eager"
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    attention = hf.DeepseekV3Attention(config, layer_idx=0).double().eval()
    with torch.no_grad():  # weights large enough for peaked softmaxes; a norm weight a missing norm would show
        for weight in attention.parameters():
            weight.normal_(0.0, 0.25)
        attention.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    tokens = 11
    x = torch.randn(1, tokens, 32, generator=gen, dtype=torch.float64)
    cos, sin = rotary(x, torch.arange(tokens)[None])
    causal = torch.full((tokens, tokens), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        want, _ = attention(x, (cos, sin), causal)  # (1, T, hidden)

        heads, nope, rope, rank, v_dim = 3, 16, 8, 20, 12
        q = attention.q_proj(x).view(tokens, heads, nope + rope)
        compressed = attention.kv_a_proj_with_mqa(x)[0]
        c = attention.kv_a_layernorm(compressed[:, :rank])
        q_pe, k_pe = hf.apply_rotary_pos_emb_interleave(q[None, :, :, nope:].transpose(1, 2),
                                                        compressed[None, None, :, rank:], cos, sin)
        q_pe, k_pe = q_pe[0].transpose(0, 1), k_pe[0, 0]  # (T, H, R), (T, R)
        w_uk, w_uv = mla.split_kv_b_weight(attention.kv_b_proj.weight, heads, nope, v_dim)
        q_latent = mla.absorb_query(q[..., :nope], w_uk)

    block_size = 8
    cache = torch.full((4, block_size, rank + rope), float("nan"), device=DEVICE)
    table = torch.tensor([[2, 0, 3]], dtype=I32, device=DEVICE)
    slots = torch.tensor([int(table[0, t // block_size]) * block_size + t % block_size for t in range(tokens)],
                         device=DEVICE)
    kernel_ladder.write_latent_cache(c.float().to(DEVICE), k_pe.float().to(DEVICE), cache, slots)
    lens = torch.tensor([tokens], dtype=I32, device=DEVICE)
    scale = attention.scaling
    ql, qr = q_latent.float().to(DEVICE), q_pe.float().to(DEVICE)

    def project(out_latent):
        return attention.o_proj(mla.project_output(out_latent.cpu().double(), w_uv).reshape(-1, heads * v_dim))

    with torch.no_grad():
        full = kernel_ladder.mla_attention(ql, qr, cache, table, lens, scale, rank,
                                           torch.tensor([0, tokens], dtype=I32, device=DEVICE))
        torch.testing.assert_close(project(full), want[0], rtol=1e-4, atol=1e-5)
        chunk = kernel_ladder.mla_attention(ql[7:], qr[7:], cache, table, lens, scale, rank,
                                            torch.tensor([0, 4], dtype=I32, device=DEVICE))
        torch.testing.assert_close(project(chunk), want[0, 7:], rtol=1e-4, atol=1e-5)
        last = kernel_ladder.mla_attention(ql[-1:], qr[-1:], cache, table, lens, scale, rank)
        torch.testing.assert_close(project(last), want[0, -1:], rtol=1e-4, atol=1e-5)
        # Negative control: the score scaled by the latent width instead of qk_head_dim is another attention.
        wrong = kernel_ladder.mla_attention(ql[-1:], qr[-1:], cache, table, lens, rank**-0.5, rank)
        assert not torch.allclose(project(wrong), want[0, -1:], atol=1e-3)


# ----------------------------------------------------------------------------- decode and prefill

DECODE_CASES = [  # (H, kv_lora_rank, rope_dim, block_size, seq_lens, num_splits)
    (4, 32, 16, 16, [1, 16, 17], 1),        # a token, exactly a block, one past a block
    (3, 24, 12, 8, [0, 21, 5], 1),          # seq_len 0; non-power-of-two rank, rope and heads
    (2, 40, 6, 128, [130, 3], 1),           # a block larger than a step (the kernel walks it in pieces)
    (5, 20, 10, 16, [70, 9, 0], 3),         # three splits: the short sequences' later splits are empty
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"H{c[0]}L{c[1]}R{c[2]}bs{c[3]}S{c[5]}")
def test_decode_matches_float64(case, gen):
    heads, rank, rope, block_size, seq_lens, splits = case
    cache, table, lens = make_latent_cache(seq_lens, rank + rope, block_size, gen)
    ql, qr = rand(len(seq_lens), heads, rank, gen=gen), rand(len(seq_lens), heads, rope, gen=gen)
    out = check(ql, qr, cache, table, lens, 0.2, rank, num_splits=splits)
    assert torch.equal(out[torch.tensor(seq_lens) == 0].cpu(), torch.zeros_like(out[torch.tensor(seq_lens) == 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_prefill_matches_float64(dtype, gen):
    """Packed chunks: a whole prompt, the newest 3 tokens after a cached prefix, a sequence with no new token,
    and one new token (a decode inside the packed batch), causal within each chunk."""
    seq_lens, q_lens = [19, 30, 6, 9], [19, 3, 0, 1]
    rank, rope, heads = 24, 8, 2
    cache, table, lens = make_latent_cache(seq_lens, rank + rope, 8, gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32, device=DEVICE)
    ql, qr = rand(sum(q_lens), heads, rank, gen=gen, dtype=dtype), rand(sum(q_lens), heads, rope, gen=gen, dtype=dtype)
    single = check(ql, qr, cache, table, lens, 0.25, rank, cu, num_splits=1)
    split = check(ql, qr, cache, table, lens, 0.25, rank, cu, num_splits=2)
    if dtype == torch.float32:
        torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_in_low_precision(dtype, gen):
    cache, table, lens = make_latent_cache([37, 12], 48 + 16, 16, gen, dtype=dtype)
    ql, qr = rand(2, 4, 48, gen=gen, dtype=dtype), rand(2, 4, 16, gen=gen, dtype=dtype)
    check(ql, qr, cache, table, lens, 0.15, 48)


def test_several_head_programs(gen, monkeypatch):
    """A GPU runs at most 32 heads a program: with 2 a program, 5 heads take 3 programs (the last one half
    empty) over the same cache, each the reference's."""
    monkeypatch.setattr(mla, "INTERPRETER_CONFIG", mla.MLAConfig(block_n=32, max_heads=2, block_rows=4))
    cache, table, lens = make_latent_cache([25, 4], 24 + 8, 8, gen)
    ql, qr = rand(2, 5, 24, gen=gen), rand(2, 5, 8, gen=gen)
    with trace() as tr:
        check(ql, qr, cache, table, lens, 0.3, 24)
    assert tr.launches[0].grid == (2, 3, 1)


def test_strided_inputs(gen):
    """q_latent and q_rope as the two parts of one fused tensor (non-contiguous), the cache as one layer of a
    (layers, ...) tensor, a transposed block table: read through their strides."""
    rank, rope, heads = 32, 16, 3
    cache, table, lens = make_latent_cache([20, 11], rank + rope, 8, gen)
    layers = torch.stack([torch.full_like(cache, float("nan")), cache], 0)
    fused = rand(2, heads, rank + rope + 5, gen=gen)
    ql, qr = fused[..., :rank], fused[..., rank:rank + rope]
    table_t = table.T.contiguous().T
    assert not ql.is_contiguous() and not table_t.is_contiguous()
    check(ql, qr, layers[1], table_t, lens, 0.2, rank)


def test_nan_in_one_sequence_stays_in_that_sequence(gen):
    cache, table, lens = make_latent_cache([9, 14, 6], 16 + 16, 8, gen)
    cache[int(table[1, 1]), 2, 3] = float("nan")  # sequence 1's token 10, in c
    ql, qr = rand(3, 2, 16, gen=gen), rand(3, 2, 16, gen=gen)
    out = kernel_ladder.mla_attention(ql, qr, cache, table, lens, 0.25, 16)
    assert torch.isnan(out[1]).all()
    assert_matches(out[[0, 2]], reference(ql, qr, cache, table, lens, 0.25, 16)[[0, 2]], torch.float32)


# ----------------------------------------------------------------------------- bad values


@pytest.mark.interpreter
@pytest.mark.parametrize("entry", [10**6, -5], ids=["huge", "negative"])
def test_a_block_table_entry_outside_the_cache(entry, gen):
    """Checks on: a ValueError naming the entry. Off (a GPU's default): clamped into the cache, nothing read
    outside any tensor (the trace blocks and counts such accesses), the clamped table's result."""
    cache, table, lens = make_latent_cache([20, 9], 24 + 8, 8, gen)
    cache = torch.nan_to_num(cache)
    ql, qr = rand(2, 2, 24, gen=gen), rand(2, 2, 8, gen=gen)
    bad = table.clone()
    bad[0, 1] = entry
    with kernel_ladder.runtime.check_values(True), pytest.raises(
            ValueError, match=rf"kernel_ladder\.mla_attention: every block_tables entry .* got block_tables\[0, 1\] "
                              rf"= {entry}"):
        kernel_ladder.mla_attention(ql, qr, cache, bad, lens, 0.2, 24)
    clamped = bad.clamp(0, cache.shape[0] - 1)
    for splits in (1, 2):
        with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
            out = kernel_ladder.mla_attention(ql, qr, cache, bad, lens, 0.2, 24, num_splits=splits)
        assert tr.out_of_bounds == 0, tr.table()
        assert_matches(out, reference(ql, qr, cache, clamped, lens, 0.2, 24), torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["seq_len_past_table", "seq_len_negative", "cu_past_q"])
def test_bad_lengths_are_errors_checked_and_stay_inside_unchecked(case, gen):
    cache, table, lens = make_latent_cache([20, 9], 24 + 8, 8, gen)
    ql, qr = rand(2, 2, 24, gen=gen), rand(2, 2, 8, gen=gen)
    cu = None
    if case == "seq_len_past_table":
        lens = torch.tensor([20, 10**6], dtype=I32, device=DEVICE)
    elif case == "seq_len_negative":
        lens = torch.tensor([-40, 9], dtype=I32, device=DEVICE)
    else:
        cu = torch.tensor([0, 1, 1000], dtype=I32, device=DEVICE)
    with kernel_ladder.runtime.check_values(True), pytest.raises(ValueError, match=r"kernel_ladder\.mla_attention"):
        kernel_ladder.mla_attention(ql, qr, cache, table, lens, 0.2, 24, cu)
    with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True) as tr:
        kernel_ladder.mla_attention(ql, qr, cache, table, lens, 0.2, 24, cu)
    assert tr.out_of_bounds == 0, tr.table()


# ----------------------------------------------------------------------------- bytes


def test_cache_bytes_per_token_deepseek_v3():
    """DeepSeek-V3 (bf16, per token per layer): the latent cache 576 x 2 = 1152 B; its MHA cache 128 heads x
    (192 + 128) x 2 = 81920 B, 71x; GQA-8 5120 B; even MQA (one 192-key + 128-value head) 640 B."""
    from transformers import DeepseekV3Config

    for config in (mla.DEEPSEEK_V3, DeepseekV3Config(), DeepseekV3Config().to_dict()):
        assert mla.cache_bytes_per_token(config) == 1152
        assert mla.cache_bytes_per_token(config, "mha") == 81920
        assert mla.cache_bytes_per_token(config, "gqa", num_kv_heads=8) == 5120
        assert mla.cache_bytes_per_token(config, "mqa") == 640
    assert mla.cache_bytes_per_token(mla.DEEPSEEK_V3, dtype=torch.float32) == 2304
    tiny = mla.MLASizes(num_heads=4, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    assert mla.cache_bytes_per_token(tiny, dtype=torch.float32) == 128
    assert mla.cache_bytes_per_token(tiny, "mha", dtype=torch.float32) == 4 * (24 + 12) * 4
    table = mla.cache_bytes_table(mla.DEEPSEEK_V3)
    assert [row["cache"] for row in table] == ["MHA", "GQA-8", "MQA", "MLA (latent)"]
    assert table[0]["vs_mla"] == pytest.approx(81920 / 1152)
    with pytest.raises(ValueError, match="num_kv_heads"):
        mla.cache_bytes_per_token(tiny, "gqa")


@pytest.mark.interpreter
@pytest.mark.parametrize("max_heads", [128, 2], ids=["one_head_program", "three_head_programs"])
def test_decode_traffic_is_counted_exactly(max_heads, gen, monkeypatch):
    """The traced bytes of a decode step equal decode_bytes' count: with every head in one program the ideal
    (each cached row read once, as key and as value); with 3 head programs the rows read 3 times."""
    monkeypatch.setattr(mla, "INTERPRETER_CONFIG", mla.MLAConfig(block_n=64, max_heads=max_heads, block_rows=64))
    seq_lens, heads, rank, rope, block_size = [45, 7, 16], 5, 40, 8, 16
    cache, table, lens = make_latent_cache(seq_lens, rank + rope, block_size, gen, dtype=torch.bfloat16)
    ql, qr = rand(3, heads, rank, gen=gen, dtype=torch.bfloat16), rand(3, heads, rope, gen=gen, dtype=torch.bfloat16)
    with trace() as tr:
        kernel_ladder.mla_attention(ql, qr, cache, table, lens, 0.2, rank, num_splits=1)
    (launch,) = tr.launches
    assert tr.bytes == launch.bytes, tr.table()  # no torch op beside the kernel (value checks on the host's memory)
    programs = math.ceil(heads / min(heads, max_heads))
    counted = mla.decode_bytes(seq_lens, heads, rank, rope, block_size, torch.bfloat16, head_programs=programs)
    assert launch.bytes == counted["kernel"]
    assert launch.per_tensor["cache_ptr"].bytes_read == programs * sum(seq_lens) * (rank + rope) * 2
    if programs == 1:
        assert counted["kernel"] == counted["ideal"]
    else:
        assert counted["kernel"] > counted["ideal"]


# ----------------------------------------------------------------------------- write_latent_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_latent_cache(dtype, gen):
    """Each token's [c | k_pe] lands in its slot (cast to the cache's dtype as torch's .to), padding slots (-1)
    are skipped, nothing else of the (strided: one layer of two) cache changes."""
    rank, rope, block_size, blocks = 20, 12, 8, 4
    layers = rand(2, blocks, block_size, rank + rope, gen=gen, dtype=dtype)
    cache = layers[1]
    before = layers.clone()
    c, k_pe = rand(6, rank, gen=gen), rand(6, 2 * rope, gen=gen)[:, ::2]
    slots = torch.tensor([3, -1, 17, 31, 8, -7], device=DEVICE)
    kernel_ladder.write_latent_cache(c, k_pe, cache, slots)
    want = before.clone()
    flat = want[1].view(-1, rank + rope)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[slot] = torch.cat([c[t], k_pe[t]]).to(dtype)
    assert torch.equal(layers.cpu(), want.cpu())


def test_write_latent_cache_bad_slot(gen):
    cache = torch.zeros(2, 8, 24, device=DEVICE)
    c, k_pe = rand(2, 16, gen=gen), rand(2, 8, gen=gen)
    slots = torch.tensor([3, 16], device=DEVICE)
    with kernel_ladder.runtime.check_values(True), pytest.raises(
            ValueError, match=r"kernel_ladder\.write_latent_cache: slot_mapping must hold slots below .* = 16 .*; "
                              r"got slot_mapping\[1\] = 16"):
        kernel_ladder.write_latent_cache(c, k_pe, cache, slots)
    with kernel_ladder.runtime.check_values(False):
        kernel_ladder.write_latent_cache(c, k_pe, cache, slots)
    assert torch.equal(cache.view(-1, 24)[3].cpu(), torch.cat([c[0], k_pe[0]]).cpu())
    assert int((cache != 0).any(-1).sum()) == 1  # the bad slot was not written anywhere


# ----------------------------------------------------------------------------- errors and plumbing


def _args(gen, **change):
    cache, table, lens = make_latent_cache([9, 4], 24 + 8, 8, gen)
    args = dict(q_latent=rand(2, 2, 24, gen=gen), q_rope=rand(2, 2, 8, gen=gen), latent_cache=cache,
                block_tables=table, seq_lens=lens, softmax_scale=0.2, kv_lora_rank=24)
    args.update(change)
    return args


ERRORS = [
    (dict(kv_lora_rank=20), ValueError, r"q_latent's last dim must be kv_lora_rank = 20"),
    (dict(kv_lora_rank=2.0), TypeError, r"kv_lora_rank must be an int"),
    (dict(softmax_scale=-1.0), ValueError, r"softmax_scale must be a positive finite number"),
    (dict(q_rope=torch.zeros(2, 2, 6)), ValueError, r"q_rope's last dim must be the cache's rope_dim = 32 - 24 = 8"),
    (dict(q_rope=torch.zeros(2, 3, 8)), ValueError, r"q_rope and q_latent must have the same \(rows, H\)"),
    (dict(q_latent=torch.zeros(2, 2, 24, dtype=torch.float64)), TypeError, r"q_latent must be float32"),
    (dict(q_latent=torch.zeros(3, 2, 24), q_rope=torch.zeros(3, 2, 8)), ValueError,
     r"decoding .* q_latent.shape\[0\] must be B = 2"),
    (dict(latent_cache=torch.zeros(4, 12, 32)), ValueError,
     r"the cache block size .* must be a power of two from 8 to 128"),
    (dict(latent_cache=torch.zeros(4, 8, 2, 32)), ValueError, r"latent_cache must be 3-D"),
    (dict(latent_cache=torch.zeros(4, 8, 32, dtype=torch.float16)), TypeError, r"latent_cache must have q_latent's"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), TypeError, r"block_tables must be int32"),
    (dict(seq_lens=torch.zeros(3, dtype=I32)), ValueError, r"seq_lens must have shape \(B,\) = \(2,\)"),
    (dict(cu_seqlens_q=torch.zeros(2, dtype=I32)), ValueError, r"cu_seqlens_q must have shape \(B \+ 1,\)"),
    (dict(num_splits=0), ValueError, r"num_splits must be >= 1"),
]


@pytest.mark.parametrize("change, error, message", ERRORS, ids=lambda x: None)
def test_errors_name_the_op_and_the_argument(change, error, message, gen):
    args = _args(gen, **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(error, match=r"^kernel_ladder\.mla_attention: " + message):
        kernel_ladder.mla_attention(**args)


WRITE_ERRORS = [
    ((torch.zeros(2, 16), torch.zeros(2, 6), torch.zeros(2, 8, 24), torch.zeros(2, dtype=torch.int64)), ValueError,
     r"the cache's last dim must be kv_lora_rank \+ rope_dim = 16 \+ 6"),
    ((torch.zeros(2, 16), torch.zeros(3, 8), torch.zeros(2, 8, 24), torch.zeros(2, dtype=torch.int64)), ValueError,
     r"c_kv and k_rope must have the same number of tokens"),
    ((torch.zeros(2, 16), torch.zeros(2, 8), torch.zeros(2, 8, 24), torch.zeros(2)), TypeError,
     r"slot_mapping must be int32 or int64"),
    ((torch.zeros(2, 16), torch.zeros(2, 8), torch.zeros(2, 8, 24, dtype=torch.int8), torch.zeros(2, dtype=I32)),
     TypeError, r"latent_cache must be float32, float16 or bfloat16"),
]


@pytest.mark.parametrize("args, error, message", WRITE_ERRORS, ids=lambda x: None)
def test_write_errors_name_the_op_and_the_argument(args, error, message):
    with pytest.raises(error, match=r"^kernel_ladder\.write_latent_cache: " + message):
        kernel_ladder.write_latent_cache(*(a.to(DEVICE) for a in args))


def test_opcheck_and_no_backward(gen):
    args = _args(gen)
    torch.library.opcheck(torch.ops.kernel_ladder.mla_attention.default,
                          (args["q_latent"], args["q_rope"], args["latent_cache"], args["block_tables"],
                           args["seq_lens"], None, 0.2, 24, 1))
    q = args["q_latent"].clone().requires_grad_()
    out = kernel_ladder.mla_attention(**{**args, "q_latent": q})
    with pytest.raises(NotImplementedError, match=r"kernel_ladder\.mla_attention is forward only"):
        out.sum().backward()


SCRIPT = Path(__file__).parent / "aot" / "mla.py"


@pytest.mark.slow
def test_mla_kernels_compile_for_sm90_without_spills(tmp_path):
    """DeepSeek-V3's sizes (kv_lora_rank 512, RoPE 64) with 16 and 128 heads, bf16: no spills, dots on tensor
    cores (tests/aot/mla.py; ``KERNEL_LADDER_AOT_FULL=1`` adds prefill, fp32 and int64 offsets)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    full = os.environ.get("KERNEL_LADDER_AOT_FULL", "") == "1"
    result = run_compiled(SCRIPT, tmp_path, timeout=900, args=() if full else ("--quick",))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
