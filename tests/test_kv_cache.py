"""kernel_ladder.serving: the block allocator, the paged cache (copy-on-write forks, prefix caching,
eviction) under randomized operation sequences with its invariants checked after every step, and the
continuous-batching scheduler — with an end-to-end run through kernel_ladder.write_kv_cache."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

import kernel_ladder
from kernel_ladder.serving import (
    BlockAllocator,
    KVCacheOutOfBlocks,
    PagedKVCache,
    Scheduler,
    SchedulerOutput,
    block_key,
)
from tests.helpers import DEVICE

# ----------------------------------------------------------------------------------------------
# BlockAllocator
# ----------------------------------------------------------------------------------------------


def test_allocator_refcounts_and_free_list():
    pool = BlockAllocator(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert sorted([a, b, c]) == [0, 1, 2] and pool.num_free == 0
    pool.incref(a)
    assert pool.refcount(a) == 2
    assert not pool.decref(a) and pool.decref(a)  # freed at the second
    assert pool.num_free == 1 and pool.allocate() == a
    pool.check_invariants({a: 1, b: 1, c: 1})
    pool.decref(b)
    with pytest.raises(ValueError, match=f"block {b} is free; allocate"):
        pool.incref(b)
    with pytest.raises(ValueError, match="no reference to drop"):
        pool.decref(b)


def test_allocator_out_of_blocks_message():
    pool = BlockAllocator(2)
    pool.allocate_many(2)
    with pytest.raises(KVCacheOutOfBlocks, match="needs 1 block\\(s\\), 0 free") as info:
        pool.allocate()
    assert isinstance(info.value, RuntimeError) and info.value.needed == 1 and info.value.free == 0
    pool.decref(0)
    with pytest.raises(KVCacheOutOfBlocks, match="needs 3 block\\(s\\), 1 free"):
        pool.allocate_many(3)
    assert pool.num_free == 1, "a failed allocate_many takes nothing"


def test_allocator_evicts_cached_blocks_last_and_lru():
    pool = BlockAllocator(4)
    blocks = pool.allocate_many(4)
    for i, block in enumerate(blocks[:2]):
        assert pool.register(block, block_key(None, [i]))
    for block in blocks:
        pool.decref(block)  # blocks 0, 1 evictable (0 freed first), 2, 3 free
    assert pool.num_free == 4 and pool.num_evictable == 2
    assert {pool.allocate(), pool.allocate()} == {2, 3}, "uncached free blocks go first"
    assert pool.lookup(block_key(None, [0])) == 0
    assert pool.allocate() == 0, "then the least recently freed"
    assert pool.lookup(block_key(None, [0])) is None, "whose key is forgotten"
    pool.incref(1)  # a prefix hit revives the evictable block
    assert pool.num_free == 0 and pool.refcount(1) == 1
    pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1})


@pytest.mark.parametrize("seed", range(4))
def test_allocator_randomized_never_hands_out_a_referenced_block(seed):
    rng = random.Random(seed)
    pool = BlockAllocator(16)
    refs: dict[int, int] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            block = pool.allocate()
            assert refs.get(block, 0) == 0, f"step {step}: handed out block {block}, still referenced"
            refs[block] = 1
            if rng.random() < 0.5:
                pool.register(block, block_key(None, [rng.randrange(6)]))
        elif op < 0.6 and refs:
            block = rng.choice(list(refs))
            pool.incref(block)
            refs[block] += 1
        elif refs:
            block = rng.choice(list(refs))
            pool.decref(block)
            refs[block] -= 1
            if refs[block] == 0:
                del refs[block]
        pool.check_invariants(refs)


# ----------------------------------------------------------------------------------------------
# PagedKVCache
# ----------------------------------------------------------------------------------------------


def _value(token: int, position: int) -> float:
    """The K (or, negated, V) a token writes: a function of (token, position), as a model's K/V
    depend on the prefix; so a prefix-cache hit holds exactly what the sequence would have written."""
    return float(token * 1000 + position)


def _write(cache: PagedKVCache, slots: torch.Tensor, tokens: list[int], positions: range) -> None:
    """Write tokens' values into every layer through their slots (torch indexing; the kernel is tested below)."""
    values = torch.tensor([_value(t, p) for t, p in zip(tokens, positions)], dtype=cache.dtype, device=cache.device)
    block, offset = slots.long() // cache.block_size, slots.long() % cache.block_size
    for layer in range(cache.num_layers):
        cache.k[layer, block, offset] = (values + layer)[:, None, None]
        cache.v[layer, block, offset] = -(values + layer)[:, None, None]


def _assert_history(cache: PagedKVCache, seq_id, tokens: list[int]) -> None:
    for layer in range(cache.num_layers):
        k, v = cache.gather(seq_id, layer)
        expected = torch.tensor([_value(t, p) + layer for p, t in enumerate(tokens)], dtype=cache.dtype)
        assert torch.equal(k[:, 0, 0].cpu(), expected), f"sequence {seq_id}: layer {layer}'s K history is wrong"
        assert torch.equal(v[:, 0, 0].cpu(), -expected), f"sequence {seq_id}: layer {layer}'s V history is wrong"


def _cache(num_blocks=24, block_size=4, num_layers=2) -> PagedKVCache:
    return PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads=1, head_dim=2, dtype=torch.float64,
                        device=DEVICE)


@pytest.mark.parametrize("seed", range(5))
def test_paged_cache_randomized(seed):
    """Random allocate (with and without prefix caching) / append / fork / free; after every step the
    invariants hold and every sequence's gathered K/V is exactly what was written for its tokens."""
    rng = random.Random(seed)
    cache = _cache()
    tokens: dict[int, list[int]] = {}
    next_id = 0
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    for _ in range(300):
        op = rng.random()
        if op < 0.25 or not tokens:
            prompt = list(rng.choice(prompts)) if rng.random() < 0.7 else [rng.randrange(3) for _ in range(9)]
            prompt = prompt[:rng.randrange(1, len(prompt) + 1)]
            cached = cache.try_allocate(next_id, len(prompt), prompt if rng.random() < 0.8 else None)
            if cached is not None:
                assert cached % cache.block_size == 0 and cached < len(prompt)
                slots = cache.append_slots(next_id, len(prompt) - cached)
                _write(cache, slots, prompt[cached:], range(cached, len(prompt)))
                tokens[next_id] = prompt
                next_id += 1
        elif op < 0.6:
            seq = rng.choice(list(tokens))
            new = [rng.randrange(3) for _ in range(rng.choice([1, 1, 1, 3, 6]))]
            start = len(tokens[seq])
            slots = cache.try_append_slots(seq, len(new), new)
            if slots is not None:
                _write(cache, slots, new, range(start, start + len(new)))
                tokens[seq] = tokens[seq] + new
        elif op < 0.75:
            parent = rng.choice(list(tokens))
            cache.fork(parent, next_id)
            tokens[next_id] = list(tokens[parent])
            next_id += 1
        else:
            seq = rng.choice(list(tokens))
            cache.free(seq)
            del tokens[seq]
        cache.check_invariants()
        for seq, seq_tokens in tokens.items():
            assert cache.seq_len(seq) == len(seq_tokens)
            _assert_history(cache, seq, seq_tokens)
    for seq in list(tokens):
        cache.free(seq)
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_blocks, "blocks leaked"


def test_copy_on_write_after_fork():
    cache = _cache(block_size=4)
    parent = [1, 2, 3, 4, 5, 6]  # one full block and a half-full one
    cache.allocate("p", len(parent))
    _write(cache, cache.append_slots("p", len(parent)), parent, range(6))
    cache.fork("p", "c")
    assert cache.block_table("c") == cache.block_table("p")
    shared_tail = cache.block_table("p")[1]
    assert cache.allocator.refcount(shared_tail) == 2
    _write(cache, cache.append_slots("p", 1, [7]), [7], range(6, 7))  # the parent copies the shared tail
    _write(cache, cache.append_slots("c", 3, [8, 8, 8]), [8, 8, 8], range(6, 9))  # the child now owns it
    assert cache.block_table("p")[0] == cache.block_table("c")[0], "the full block stays shared"
    assert cache.block_table("p")[1] != shared_tail and cache.block_table("c")[1] == shared_tail
    cache.check_invariants()
    _assert_history(cache, "p", parent + [7])
    _assert_history(cache, "c", parent + [8, 8, 8])
    cache.free("c")
    _assert_history(cache, "p", parent + [7])
    cache.check_invariants()


def test_prefix_caching_reuses_full_blocks_only():
    cache = _cache(block_size=4)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    assert cache.allocate("a", 10, prompt) == 0
    _write(cache, cache.append_slots("a", 10), prompt, range(10))
    same_prefix = prompt[:8] + [99, 98, 97]
    assert cache.allocate("b", 11, same_prefix) == 8, "both full blocks reused"
    assert cache.block_table("b")[:2] == cache.block_table("a")[:2]
    assert cache.block_table("b")[2] != cache.block_table("a")[2], "the partial last block is not shared"
    _write(cache, cache.append_slots("b", 3), same_prefix[8:], range(8, 11))
    differs_in_first = [0] + prompt[1:]
    assert cache.allocate("c", 10, differs_in_first) == 0, "a different first block: nothing reused"
    differs_in_second = prompt[:5] + [0] + prompt[6:]
    assert cache.allocate("d", 10, differs_in_second) == 4
    assert cache.allocate("e", 8, prompt[:8]) == 4, "a fully cached prompt leaves its last block to compute"
    cache.check_invariants()
    _assert_history(cache, "b", same_prefix)
    for seq in "abcde":
        cache.free(seq)
    cache.check_invariants()
    # Freed, the full blocks stay cached (evictable) and are still reused.
    assert cache.allocator.num_evictable >= 2
    assert cache.allocate("f", 9, prompt[:9]) == 8
    _write(cache, cache.append_slots("f", 1), prompt[8:9], range(8, 9))
    _assert_history(cache, "f", prompt[:9])
    cache.check_invariants()


def test_generated_tokens_fill_cacheable_blocks():
    cache = _cache(block_size=4)
    cache.allocate("a", 3, [1, 2, 3])
    cache.append_slots("a", 3)
    cache.append_slots("a", 2, [4, 5])  # block 0 full now: registered
    assert cache.allocate("b", 6, [1, 2, 3, 4, 9, 9]) == 4
    cache.check_invariants()


def test_eviction_of_cached_free_blocks_when_needed():
    cache = _cache(num_blocks=4, block_size=4)
    cache.allocate("a", 12, list(range(12)))
    cache.append_slots("a", 12)
    cache.free("a")
    assert cache.num_free_blocks == 4 and cache.allocator.num_evictable == 3
    cache.allocate("b", 16)  # needs every block: the cached ones are evicted
    assert cache.allocator.num_evictable == 0
    cache.check_invariants()
    cache.free("b")
    assert cache.allocate("c", 12, list(range(12))) == 0, "evicted contents are no longer found"
    cache.check_invariants()


def test_out_of_blocks_errors_and_try_variants():
    cache = _cache(num_blocks=3, block_size=4)
    cache.allocate("a", 8)
    with pytest.raises(KVCacheOutOfBlocks, match="sequence 'b' \\(9 tokens\\) needs 3 block\\(s\\), 1 free"):
        cache.allocate("b", 9)
    assert "b" not in cache and cache.try_allocate("b", 9) is None
    cache.append_slots("a", 8)
    with pytest.raises(KVCacheOutOfBlocks, match="appending 5 token\\(s\\) to sequence 'a' needs 2 block"):
        cache.append_slots("a", 5)
    assert cache.try_append_slots("a", 5) is None and cache.seq_len("a") == 8, "a failed append changes nothing"
    cache.check_invariants()
    with pytest.raises(ValueError, match="already exists"):
        cache.allocate("a", 1)
    with pytest.raises(KeyError, match="no sequence 'z'"):
        cache.append_slots("z", 1)


def test_block_tables_and_seq_lens():
    cache = _cache(block_size=4)
    cache.allocate("a", 9)
    cache.allocate("b", 2)
    slots_a, slots_b = cache.append_slots("a", 9), cache.append_slots("b", 2)
    tables = cache.block_tables(["a", "b"])
    assert tables.dtype == torch.int32 and tables.shape == (2, 3)
    assert tables[0].tolist() == cache.block_table("a")[:3] and tables[1, 1:].tolist() == [0, 0]
    assert cache.seq_lens(["b", "a"]).tolist() == [2, 9]
    positions = torch.arange(9)
    assert torch.equal(slots_a.long().cpu(), tables[0].long().cpu()[positions // 4] * 4 + positions % 4)
    assert slots_b.dtype == torch.int32


# ----------------------------------------------------------------------------------------------
# Scheduler
# ----------------------------------------------------------------------------------------------


def _sampled_token(request_id, length: int) -> int:
    """A deterministic stand-in for sampling (crc32: str hashes change from process to process)."""
    return zlib.crc32(repr((request_id, length)).encode()) % 50 + 1


def _check_output(out: SchedulerOutput, scheduler: Scheduler, budget: int) -> None:
    cache = scheduler.cache
    assert out.total_tokens <= budget, "token budget exceeded"
    assert out.num_seqs <= scheduler.max_num_seqs
    assert len(set(out.request_ids)) == out.num_seqs
    assert all(n == 1 for n in out.num_tokens[:out.num_decodes])
    t = out.total_tokens
    for tensor in (out.token_ids, out.positions, out.slot_mapping, out.seq_lens, out.cu_seqlens_q, out.block_tables):
        assert tensor.dtype == torch.int32 and tensor.device == cache.device
    assert out.token_ids.shape == out.positions.shape == out.slot_mapping.shape == (t,)
    cu = out.cu_seqlens_q.tolist()
    assert cu[0] == 0 and [b - a for a, b in zip(cu, cu[1:])] == out.num_tokens
    tables, positions, slots = out.block_tables.long().cpu(), out.positions.long().cpu(), out.slot_mapping.long().cpu()
    for b, request_id in enumerate(out.request_ids):
        request = scheduler.requests[request_id]
        rows = slice(cu[b], cu[b + 1])
        assert out.seq_lens[b].item() == cache.seq_len(request_id) == positions[rows][-1].item() + 1
        length, bs = out.seq_lens[b].item(), cache.block_size
        assert positions[rows].tolist() == list(range(length - out.num_tokens[b], length))
        assert out.token_ids[rows].tolist() == request.token_ids[positions[rows][0]:positions[rows][-1] + 1]
        expected = tables[b][positions[rows] // bs] * bs + positions[rows] % bs
        assert torch.equal(slots[rows], expected), "slot_mapping disagrees with block_tables and positions"
    assert len(set(slots.tolist())) == t, "two tokens share a slot"
    for request_id, index in zip(out.sample_request_ids, out.sample_indices.tolist()):
        b = out.request_ids.index(request_id)
        assert index == cu[b + 1] - 1


def _run(scheduler: Scheduler, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 2000,
         on_step=None) -> list[SchedulerOutput]:
    """Drive the scheduler to the end with a fake model; requests in ``arrivals[step]`` join at that step."""
    arrivals = arrivals or {}
    outputs = []
    step = 0
    while scheduler.has_unfinished or any(s >= step for s in arrivals):
        for args in arrivals.get(step, []):
            scheduler.add_request(*args)
        out = scheduler.step()
        _check_output(out, scheduler, scheduler.max_tokens_per_step)
        scheduler.cache.check_invariants()
        if on_step is not None:
            on_step(out)
        scheduler.update({rid: _sampled_token(rid, scheduler.requests[rid].num_tokens)
                          for rid in out.sample_request_ids})
        scheduler.cache.check_invariants()
        outputs.append(out)
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    return outputs


def test_scheduler_finishes_every_request_with_its_token_count():
    cache = _cache(num_blocks=40, block_size=4)
    scheduler = Scheduler(cache, max_num_seqs=4, max_tokens_per_step=16)
    rng = random.Random(0)
    arrivals = {step: [(f"r{step}-{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))],
                        rng.randrange(1, 12)) for i in range(rng.randrange(0, 3))] for step in range(0, 30, 3)}
    outputs = _run(scheduler, arrivals)
    assert scheduler.requests and all(r.status == "finished" for r in scheduler.requests.values())
    for request in scheduler.requests.values():
        assert len(request.output_token_ids) == request.max_new_tokens
    assert cache.num_free_blocks == cache.num_blocks
    assert max(o.num_seqs for o in outputs) > 1, "continuous batching ran sequences together"


def test_scheduler_eos_finishes_early():
    cache = _cache(num_blocks=10)
    scheduler = Scheduler(cache, max_num_seqs=2, max_tokens_per_step=8, eos_token_id=_sampled_token("x", 5))
    scheduler.add_request("x", [1, 2, 3, 4], max_new_tokens=10)  # its second sampled token is the eos
    _run(scheduler)
    assert scheduler.requests["x"].output_token_ids[-1] == scheduler.eos_token_id
    assert len(scheduler.requests["x"].output_token_ids) == 2


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    cache = _cache(num_blocks=40, block_size=4)
    scheduler = Scheduler(cache, max_num_seqs=4, max_tokens_per_step=8)
    scheduler.add_request("short", [1, 2, 3], 6)
    outputs = _run(scheduler, {1: [("long", list(range(100, 130)), 2)]})  # no prefix shared with "short"
    long_chunks = [o.num_tokens[o.request_ids.index("long")] for o in outputs if "long" in o.request_ids]
    assert long_chunks == [7, 7, 7, 7, 2, 1], "the long prompt runs in chunks beside the short one's decode"
    assert sum(long_chunks) == 30 + 1
    step = outputs[1]
    assert step.request_ids == ["short", "long"] and step.num_decodes == 1, "decodes first, then prefill"
    assert step.sample_request_ids == ["short"], "a chunk that ends mid-prompt samples nothing"


def test_preemption_under_memory_pressure_recovers():
    cache = _cache(num_blocks=8, block_size=4)
    scheduler = Scheduler(cache, max_num_seqs=4, max_tokens_per_step=32)
    for i in range(4):
        scheduler.add_request(f"r{i}", [i + 1] * 6, 10)  # 4 x 2 blocks admitted; growing needs 4 x 4
    outputs = _run(scheduler)
    preempted = [rid for o in outputs for rid in o.preempted]
    assert preempted, "the cache was too small for all four: someone must have been preempted"
    assert all(r.status == "finished" and len(r.output_token_ids) == 10 for r in scheduler.requests.values())
    victim = scheduler.requests[preempted[0]]
    assert victim.num_preemptions >= 1
    first = next(o for o in outputs if o.preempted)
    assert preempted[0] == "r3", "the most recently admitted is preempted first"
    assert "r3" not in first.request_ids
    assert cache.num_free_blocks == cache.num_blocks


def test_readmitted_request_reuses_its_prefix_blocks():
    cache = _cache(num_blocks=8, block_size=4)
    scheduler = Scheduler(cache, max_num_seqs=4, max_tokens_per_step=32)
    for i in range(4):
        scheduler.add_request(f"r{i}", [i + 1] * 5, 8)  # 4 x 2 blocks; growing to 12 tokens needs 4 x 3
    _run(scheduler)
    again = [r for r in scheduler.requests.values() if r.num_preemptions]
    assert again and any(r.num_cached_prompt_tokens > 0 for r in again)


def test_scheduler_errors():
    cache = _cache(num_blocks=2, block_size=4)
    scheduler = Scheduler(cache, max_num_seqs=2, max_tokens_per_step=8)
    with pytest.raises(ValueError, match="needs up to 3 blocks"):
        scheduler.add_request("big", [1] * 8, 2)
    scheduler.add_request("a", [1, 2], 3)
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add_request("a", [1], 1)
    scheduler.step()
    with pytest.raises(RuntimeError, match="call update"):
        scheduler.step()
    with pytest.raises(ValueError, match="expected tokens for"):
        scheduler.update({})
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        Scheduler(cache, 0, 8)


# ----------------------------------------------------------------------------------------------
# End to end: the scheduler, write_kv_cache, and attention against the gathered history
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_end_to_end_cache_holds_every_sequence_history(gen, dtype):
    """A toy model step: each token's K/V is a fixed function of (token, position) per layer, written
    with kernel_ladder.write_kv_cache through the step's slot_mapping; then every sequence's cache, gathered
    through block_tables and seq_lens, equals its full K/V history, and float64 attention of this
    step's queries over it equals attention over the history (causal within the step)."""
    layers, heads, dim, vocab, max_pos = 2, 2, 8, 64, 64
    tables = {name: torch.randn(layers, size, heads, dim, generator=gen, dtype=torch.float64)
              for name, size in (("k_tok", vocab), ("k_pos", max_pos), ("v_tok", vocab), ("v_pos", max_pos))}
    query_table = torch.randn(vocab, heads, dim, generator=gen, dtype=torch.float64)

    def kv(layer: int, tokens: torch.Tensor, positions: torch.Tensor):
        tokens, positions = tokens.long().cpu(), positions.long().cpu()
        k = tables["k_tok"][layer, tokens] + tables["k_pos"][layer, positions]
        v = tables["v_tok"][layer, tokens] + tables["v_pos"][layer, positions]
        return k, v

    cache = PagedKVCache(layers, 12, 4, heads, dim, dtype=dtype, device=DEVICE)
    scheduler = Scheduler(cache, max_num_seqs=3, max_tokens_per_step=10)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    arrivals = {0: [("a", shared + [1, 2], 6), ("b", [3] * 13, 4)], 2: [("c", shared + [4], 5)], 5: [("d", [7, 7], 8)]}

    def model_step(out: SchedulerOutput) -> None:
        if out.is_empty:
            return
        for layer in range(layers):
            k, v = kv(layer, out.token_ids, out.positions)
            kernel_ladder.write_kv_cache(k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), cache.k_cache(layer),
                                         cache.v_cache(layer), out.slot_mapping)
            cu = out.cu_seqlens_q.tolist()
            for b, request_id in enumerate(out.request_ids):
                length = out.seq_lens[b].item()
                table = out.block_tables[b].long().cpu()
                positions = torch.arange(length)
                slots = table[positions // cache.block_size] * cache.block_size + positions % cache.block_size
                got_k = cache.k_cache(layer).reshape(-1, heads, dim)[slots.to(DEVICE)].double().cpu()
                got_v = cache.v_cache(layer).reshape(-1, heads, dim)[slots.to(DEVICE)].double().cpu()
                history = torch.tensor(scheduler.requests[request_id].token_ids[:length], dtype=torch.int32)
                ref_k, ref_v = kv(layer, history, positions)
                assert torch.equal(got_k, ref_k.to(dtype).double()), f"{request_id}: layer {layer}'s K in the cache"
                assert torch.equal(got_v, ref_v.to(dtype).double()), f"{request_id}: layer {layer}'s V in the cache"
                q = query_table[out.token_ids[cu[b]:cu[b + 1]].long().cpu()]  # (n, H, D)
                n = q.shape[0]
                attend = positions[None, :] <= (length - n + torch.arange(n))[:, None]  # causal, bottom-right
                def attention(keys, values):
                    scores = torch.einsum("nhd,khd->hnk", q, keys) / dim**0.5
                    probs = scores.masked_fill(~attend, float("-inf")).softmax(-1)
                    return torch.einsum("hnk,khd->nhd", probs, values)
                torch.testing.assert_close(attention(got_k, got_v), attention(ref_k.to(dtype).double(),
                                                                              ref_v.to(dtype).double()))

    _run(scheduler, arrivals, on_step=model_step)
    assert scheduler.requests["c"].num_cached_prompt_tokens == 8, "c reused a's two full prompt blocks"
    assert all(len(r.output_token_ids) == r.max_new_tokens for r in scheduler.requests.values())


def test_truncate_rolls_back_slots_and_frees_whole_blocks():
    cache = PagedKVCache(1, 8, 4, 1, 2)
    cache.allocate("s", 0)
    cache.append_slots("s", 10)  # 3 blocks
    assert cache.num_free_blocks == 5
    cache.truncate("s", 5)  # 2 blocks stay, the third is freed
    assert cache.seq_len("s") == 5 and len(cache.block_table("s")) == 2 and cache.num_free_blocks == 6
    slots = cache.append_slots("s", 2)  # the rolled-back positions are handed out again, in place
    table = cache.block_table("s")
    assert slots.tolist() == [table[1] * 4 + 1, table[1] * 4 + 2]
    with pytest.raises(ValueError, match=r"num_tokens must be an int in \[0, 7\]"):
        cache.truncate("s", 8)
    cached = PagedKVCache(1, 8, 4, 1, 2)
    cached.allocate("p", 9, token_ids=list(range(9)))
    cached.append_slots("p", 9)
    with pytest.raises(ValueError, match="registered in the prefix cache"):
        cached.truncate("p", 3)
    cache.check_invariants()


def test_scheduler_finish_ends_a_request_early_and_frees_its_blocks():
    cache = PagedKVCache(1, 8, 4, 1, 2)
    scheduler = Scheduler(cache, max_num_seqs=4, max_tokens_per_step=64)
    scheduler.add_request("a", [1, 2, 3], 5)
    scheduler.add_request("b", [4, 5], 5)
    scheduler.step()
    free_before = cache.num_free_blocks
    assert scheduler.finish("a").status == "finished"
    assert "a" not in cache and cache.num_free_blocks > free_before and scheduler.finish("a").status == "finished"
    scheduler.update({"b": 7})  # what the step sampled for the request still running
    assert [r.request_id for r in scheduler.running] == ["b"]
    scheduler.add_request("c", [6], 2)
    assert scheduler.finish("c").status == "finished" and not scheduler.waiting  # a waiting one
    with pytest.raises(ValueError, match="no request 'z'"):
        scheduler.finish("z")


# ----------------------------------------------------------------------------------------------
# The package's layout
# ----------------------------------------------------------------------------------------------


def test_kv_cache_module_re_exports_serving_and_models_the_engine():
    """``kernel_ladder.kv_cache`` (chapter 08's name) and ``kernel_ladder.models.Engine`` are the same
    objects as ``kernel_ladder.serving``'s, not copies."""
    from kernel_ladder import kv_cache, models, serving

    for name in kv_cache.__all__:
        assert getattr(kv_cache, name) is getattr(serving, name), name
    assert kv_cache.BlockKey is serving.BlockKey
    assert models.Engine is serving.Engine and models.EngineStats is serving.EngineStats


# ----------------------------------------------------------------------------------------------
# Prefix-cache keys: a cryptographic chain, never Python's hash
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first, other", [(-1, -2), (0, 2**61 - 1)], ids=["hash(-1)==hash(-2)", "hash(0)==hash(M61)"])
def test_a_python_hash_collision_between_prefixes_shares_no_block(first, other):
    """Two first blocks that differ in one token whose Python hashes are equal (CPython hashes -1 as -2,
    and ints modulo 2**61 - 1), followed by the same tokens: a prompt with the second prefix must find
    the second sequence's blocks, never a block computed after the first prefix."""
    assert hash(first) == hash(other) and hash((None, (first, 5))) == hash((None, (other, 5)))
    cache = _cache(block_size=2)
    tail = [7, 8, 9]
    a, b = [first, 5] + tail, [other, 5] + tail
    for seq, prompt in (("a", a), ("b", b)):
        assert cache.allocate(seq, len(prompt), prompt) == 0, f"{seq}: nothing of it is cached yet"
        _write(cache, cache.append_slots(seq, len(prompt)), prompt, range(len(prompt)))
    assert cache.allocate("c", len(b), b) == 4, "c is b: both of b's full blocks are found"
    assert cache.block_table("c")[:2] == cache.block_table("b")[:2]
    assert cache.block_table("c")[1] != cache.block_table("a")[1], "c got a block computed after a's prefix"
    cache.check_invariants()


def test_block_keys_are_sha256_of_an_unambiguous_encoding():
    root = block_key(None, [1, 2, 3])
    assert isinstance(root, bytes) and len(root) == 32
    assert block_key(None, [1, 2, 3]) == root, "deterministic (no per-process seed)"
    child = block_key(root, [4, 5, 6])
    distinct = {
        root, child, block_key(None, [1, 2]), block_key(None, [1, 2, 3, 0]), block_key(None, [3, 2, 1]),
        block_key(None, [-1]), block_key(None, [-2]), block_key(None, [0]), block_key(None, [2**61 - 1]),
        block_key(None, [256]), block_key(None, [1, 0]),  # the same bytes as 256 if tokens were packed loosely
        block_key(child, [4, 5, 6]), block_key(root, [4, 5]),
        block_key(None, [1, 2, 3], cache_salt="a"), block_key(None, [1, 2, 3], cache_salt="b"),
        block_key(None, [1, 2, 3], cache_salt=""), block_key(root, [4, 5, 6], cache_salt="a"),
    }
    assert len(distinct) == 17, "two different (parent, tokens, salt) gave one key"
    assert block_key(None, [1], cache_salt="x") == block_key(None, [1], cache_salt=b"x"), "a str salt is its UTF-8"
    with pytest.raises(ValueError, match=r"block_key: token ids must fit int64, got 9223372036854775808"):
        block_key(None, [2**63])
    with pytest.raises(TypeError, match="block_key: parent must be a 32-byte BlockKey or None"):
        block_key((None, (1,)), [1])
    with pytest.raises(TypeError, match="block_key: cache_salt must be a str, bytes or None, got int"):
        block_key(None, [1], cache_salt=3)


def test_requests_with_different_cache_salts_never_share_blocks():
    cache = _cache(block_size=4)
    prompt = list(range(20, 30))
    assert cache.allocate("a", 10, prompt, cache_salt="tenant-1") == 0
    _write(cache, cache.append_slots("a", 10), prompt, range(10))
    assert cache.allocate("b", 10, prompt, cache_salt="tenant-2") == 0, "another salt: no hit"
    _write(cache, cache.append_slots("b", 10), prompt, range(10))
    assert cache.allocate("c", 10, prompt) == 0, "no salt is a salt of its own"
    _write(cache, cache.append_slots("c", 10), prompt, range(10))
    assert cache.allocate("d", 10, prompt, cache_salt="tenant-1") == 8, "the same salt shares"
    assert cache.block_table("d")[:2] == cache.block_table("a")[:2]
    assert not set(cache.block_table("b")) & set(cache.block_table("a"))
    assert not set(cache.block_table("c")) & (set(cache.block_table("a")) | set(cache.block_table("b")))
    cache.fork("d", "e")  # a fork keeps the salt: the block it fills is keyed under tenant-1
    grown = prompt + [0, 1]
    _write(cache, cache.append_slots("e", 4, grown[8:]), grown[8:], range(8, 12))
    assert cache.allocate("f", 13, grown + [5], cache_salt="tenant-1") == 12
    assert cache.block_table("f")[2] == cache.block_table("e")[2]
    assert cache.allocate("g", 13, grown + [5]) == 8, "unsalted: only c's blocks"
    assert cache.block_table("g")[:2] == cache.block_table("c")[:2]
    cache.check_invariants()
    scheduler = Scheduler(_cache(block_size=4), max_num_seqs=4, max_tokens_per_step=64)
    scheduler.add_request("x", prompt, 2, cache_salt="s1")
    scheduler.add_request("y", prompt, 2, cache_salt="s2")
    scheduler.add_request("z", prompt, 2, cache_salt="s1")
    scheduler.step()
    assert [scheduler.requests[r].num_cached_prompt_tokens for r in "xyz"] == [0, 0, 8]
    with pytest.raises(TypeError, match="Scheduler.add_request: cache_salt must be a str, bytes or None, got list"):
        scheduler.add_request("w", prompt, 2, cache_salt=[1])


def test_prefix_cache_hits_full_blocks_only_and_never_keys_a_partial_one():
    cache = _cache(num_blocks=8, block_size=4)
    prompt = list(range(40, 50))  # blocks [40..43] [44..47] and a partial [48, 49]
    cache.allocate("a", 10, prompt)
    _write(cache, cache.append_slots("a", 10), prompt, range(10))
    table = cache.block_table("a")
    assert cache.allocator.key_of(table[0]) is not None and cache.allocator.key_of(table[1]) is not None
    assert cache.allocator.key_of(table[2]) is None, "the partial last block is not in the prefix cache"
    assert cache.allocate("b", 11, prompt[:6] + [0] * 5) == 4, "the first full block matches, the second does not"
    cache.free("a")
    cache.free("b")
    assert cache.allocator.num_evictable == 2, "a's two full blocks (b's own were never filled, so never keyed)"
    assert cache.num_free_blocks == cache.num_blocks and cache.allocator.refcount(table[0]) == 0
    assert cache.allocate("c", 10, prompt) == 8, "freed full blocks are still found"
    assert cache.block_table("c")[:2] == table[:2] and cache.allocator.refcount(table[0]) == 1
    cache.free("c")
    cache.check_invariants()


def test_prefix_cache_evicts_the_least_recently_freed_block_first():
    cache = _cache(num_blocks=7, block_size=2)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9, 10]}  # two full blocks and a partial one each
    for seq, prompt in prompts.items():
        cache.allocate(seq, 5, prompt)
        _write(cache, cache.append_slots(seq, 5), prompt, range(5))
    a, b = cache.block_table("a"), cache.block_table("b")
    cache.free("b")  # b's keyed blocks freed first (its second block before its first), then a's
    cache.free("a")
    assert cache.allocator.num_evictable == 4 and cache.num_free_blocks == 7
    assert cache.allocate("b again", 5, prompts["b"]) == 4  # a hit revives b's blocks...
    cache.free("b again")  # ...and freeing them again makes them the most recently freed
    pool = cache.allocator
    assert set(pool.allocate_many(3)) == {a[2], b[2], *(set(range(7)) - set(a) - set(b))}, (
        "the free blocks without contents go before any cached one")
    for expected in (a[1], a[0], b[1], b[0]):  # least recently freed first
        assert all(pool.key_of(block) is not None for block in (a[0], a[1], b[0], b[1]) if pool.refcount(block) == 0)
        assert pool.allocate() == expected and pool.key_of(expected) is None, "evicted: its key forgotten"
    assert pool.num_evictable == 0 and pool.num_free == 0
    for block in range(7):
        pool.decref(block)  # the blocks taken above, each held once
    assert cache.allocate("a again", 5, prompts["a"]) == 0, "nothing cached is left"
    cache.free("a again")
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_blocks, "every reference went back to zero: nothing leaked"


# ----------------------------------------------------------------------------------------------
# BlockAllocator: block ids checked
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["incref", "decref", "refcount", "key_of", "register"])
@pytest.mark.parametrize("block", [-1, -4, 4, 100])
def test_allocator_refuses_a_block_id_outside_the_pool(method, block):
    pool = BlockAllocator(4)
    for b in pool.allocate_many(4):
        pool.incref(b)  # every block in use twice: a wrapped-around id would find a real block
    args = (block, b"\0" * 32) if method == "register" else (block,)
    with pytest.raises(ValueError, match=rf"BlockAllocator.{method}: block must be in \[0, 4\), got {block}$"):
        getattr(pool, method)(*args)
    pool.check_invariants({b: 2 for b in range(4)})


@pytest.mark.parametrize("block", [1.0, "1", True, None])
def test_allocator_refuses_a_block_id_that_is_not_an_int(block):
    pool = BlockAllocator(4)
    with pytest.raises(TypeError, match=r"BlockAllocator.refcount: block must be an int in \[0, 4\), got "):
        pool.refcount(block)


def test_forgotten_blocks_leave_the_prefix_cache():
    """A step whose model run failed: its blocks were keyed when scheduled but never written."""
    cache = _cache(num_blocks=6, block_size=4)
    prompt = list(range(60, 69))
    cache.allocate("a", 9, prompt)
    slots = cache.append_slots("a", 9)
    keyed = cache.block_table("a")[:2]
    assert all(cache.allocator.key_of(b) is not None for b in keyed)
    cache.forget_blocks(slots)
    assert all(cache.allocator.key_of(b) is None for b in keyed)
    cache.check_invariants()
    cache.free("a")
    assert cache.allocator.num_evictable == 0 and cache.allocate("b", 9, prompt) == 0, "nothing of it is found"
    _write(cache, cache.append_slots("b", 9), prompt, range(9))
    cache.free("b")
    evictable = cache.allocator.num_evictable
    cache.allocator.forget(cache.allocator.lookup(block_key(None, prompt[:4])))  # an evictable block: freed
    assert cache.allocator.num_evictable == evictable - 1 and cache.num_free_blocks == cache.num_blocks
    cache.check_invariants()


def test_cache_and_scheduler_refuse_bad_token_ids_and_keys():
    cache = _cache()
    with pytest.raises(TypeError, match=r"PagedKVCache.allocate: token_ids must be ints, got float 2.5"):
        cache.allocate("a", 2, [1, 2.5])
    with pytest.raises(TypeError, match=r"PagedKVCache.allocate: cache_salt must be a str, bytes or None, got int"):
        cache.allocate("a", 2, [1, 2], cache_salt=5)
    assert "a" not in cache
    assert cache.allocate("a", 2, torch.tensor([1, 2])) == 0, "a tensor's integers are token ids"
    scheduler = Scheduler(cache, max_num_seqs=2, max_tokens_per_step=8)
    with pytest.raises(ValueError, match=r"Scheduler.add_request: token ids must be in \[0, 2\*\*31\), got -1 in "
                                         r"request 'r'"):
        scheduler.add_request("r", [3, -1], 2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*31\), got 2147483648"):
        scheduler.add_request("r", [2**31], 2)
    assert not scheduler.requests
    pool = BlockAllocator(2)
    block = pool.allocate()
    with pytest.raises(TypeError, match=r"BlockAllocator.register: key must be a 32-byte BlockKey \(what block_key "
                                        r"returns\), got tuple"):
        pool.register(block, (None, (1, 2)))
    with pytest.raises(TypeError, match=r"BlockAllocator.lookup: key must be a 32-byte BlockKey"):
        pool.lookup(b"short")
    with pytest.raises(ValueError, match=r"BlockAllocator.allocate_many: n must be an int >= 0, got -1"):
        pool.allocate_many(-1)
    with pytest.raises(ValueError, match=r"BlockAllocator.forget: block must be in \[0, 2\), got -1"):
        pool.forget(-1)
