"""A seeded fuzz of kernel_ladder.serving's block pool, paged cache and scheduler together: random
requests (prompts drawn from a few shared prefixes, under a few cache salts), random lengths, a
random token budget every step, a cache small enough to preempt, random sampled tokens, end-of-
sequence tokens and aborts. A fake model writes each scheduled token's K and V; after every step:

* the pool is consistent and nothing leaked (every block free, evictable or held by exactly as
  many block tables as its reference count says);
* every block in the prefix cache holds what its key says: its K are the block's tokens, its V
  name the whole prefix (and salt) each token was computed after, and the key is that prefix's
  SHA-256 chain;
* every scheduled sequence reads back its own history through its block table: a reused block
  was computed after the same prefix.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernel_ladder.serving import PagedKVCache, Scheduler, block_key

SALTS = (None, b"tenant-a", b"tenant-b")
VOCAB = 6  # a small vocabulary: sampled continuations often repeat, so generated blocks get shared too


class Histories:
    """Names every (salt, prefix) a token was computed after with a small integer, exact in float64."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.prefixes: list[tuple] = []

    def id(self, salt: bytes | None, prefix: tuple[int, ...]) -> int:
        key = (salt, prefix)
        if key not in self.ids:
            self.ids[key] = len(self.prefixes)
            self.prefixes.append(key)
        return self.ids[key]


def _model_step(cache: PagedKVCache, scheduler: Scheduler, out, histories: Histories) -> None:
    """The fake model: token ``t`` at position ``p`` writes K = t and V = the id of (salt, tokens[:p + 1])."""
    slots = out.slot_mapping.long()
    assert len(set(slots.tolist())) == len(slots), "two tokens of the step share a slot"
    cu = out.cu_seqlens_q.tolist()
    k, v = [], []
    for b, request_id in enumerate(out.request_ids):
        request = scheduler.requests[request_id]
        tokens = request.token_ids
        for position in out.positions[cu[b]:cu[b + 1]].tolist():
            k.append(tokens[position])
            v.append(histories.id(request.cache_salt, tuple(tokens[:position + 1])))
    flat_k, flat_v = cache.k[0].view(-1), cache.v[0].view(-1)
    flat_k[slots] = torch.tensor(k, dtype=cache.dtype)
    flat_v[slots] = torch.tensor(v, dtype=cache.dtype)


def _check_prefix_cache(cache: PagedKVCache, histories: Histories) -> None:
    """Every keyed block (used or evictable) holds the tokens and the history its key was made from."""
    pool, bs = cache.allocator, cache.block_size
    for block in range(cache.num_blocks):
        key = pool.key_of(block)
        if key is None:
            continue
        assert pool.lookup(key) == block
        ids = cache.v[0, block, :, 0, 0].long().tolist()
        salt, prefix = histories.prefixes[ids[-1]]
        assert len(prefix) % bs == 0, f"block {block} is keyed but its last slot is not a block's end"
        assert cache.k[0, block, :, 0, 0].long().tolist() == list(prefix[-bs:]), f"block {block}: tokens"
        assert ids == [histories.ids[(salt, prefix[:len(prefix) - bs + i + 1])] for i in range(bs)], (
            f"block {block}: its slots were computed after different prefixes")
        parent = None
        for start in range(0, len(prefix), bs):
            parent = block_key(parent, prefix[start:start + bs], salt)
        assert key == parent, f"block {block}'s key is not the chain of the prefix it holds"


def _check_histories(cache: PagedKVCache, scheduler: Scheduler, out, histories: Histories) -> None:
    """Each scheduled sequence's cache, through its block table, is its own tokens and prefix ids."""
    for request_id in out.request_ids:
        request = scheduler.requests[request_id]
        k, v = cache.gather(request_id, 0)
        length = cache.seq_len(request_id)
        tokens = request.token_ids[:length]
        assert k[:, 0, 0].long().tolist() == tokens, f"request {request_id!r}: K history"
        expected = [histories.ids[(request.cache_salt, tuple(tokens[:p + 1]))] for p in range(length)]
        assert v[:, 0, 0].long().tolist() == expected, f"request {request_id!r} reads blocks of another prefix"


@pytest.mark.parametrize("seed", range(8))
def test_block_pool_and_scheduler_fuzz(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4])
    num_blocks = rng.randrange(24, 64) // block_size  # small enough that sequences get preempted
    cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads=1, head_dim=1, dtype=torch.float64)
    scheduler = Scheduler(cache, max_num_seqs=rng.randrange(1, 6), max_tokens_per_step=8,
                          eos_token_id=rng.choice([None, 0]))
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    histories = Histories()
    next_id, steps, scheduled_tokens = 0, 0, 0
    while steps < 150 or scheduler.has_unfinished:
        if steps < 150 and rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
            try:
                scheduler.add_request(next_id, prompt, rng.randrange(1, 12), cache_salt=rng.choice(SALTS))
            except ValueError as error:
                assert "needs up to" in str(error)  # more blocks than the cache has: refused up front
            next_id += 1
        if not scheduler.has_unfinished:
            steps += 1
            continue
        scheduler.max_tokens_per_step = rng.randrange(1, 13)
        out = scheduler.step()
        assert not out.is_empty or out.preempted, f"step {steps}: requests wait but nothing runs"
        assert out.total_tokens <= scheduler.max_tokens_per_step
        scheduled_tokens += out.total_tokens
        _model_step(cache, scheduler, out, histories)
        cache.check_invariants()
        _check_prefix_cache(cache, histories)
        _check_histories(cache, scheduler, out, histories)
        sampled = {r: rng.randrange(VOCAB) for r in out.sample_request_ids}
        if sampled and rng.random() < 0.1:  # an abort between the model step and the update
            victim = rng.choice(list(sampled))
            scheduler.finish(victim)
            del sampled[victim]
        scheduler.update(sampled)
        if rng.random() < 0.05:  # an abort of any request, waiting or running
            unfinished = [r for r, q in scheduler.requests.items() if q.status != "finished"]
            if unfinished:
                scheduler.finish(rng.choice(unfinished))
        cache.check_invariants()
        _check_prefix_cache(cache, histories)
        steps += 1
        assert steps < 2000, "the scheduler made no progress"
    assert all(r.status == "finished" for r in scheduler.requests.values())
    assert not cache.seq_ids and cache.num_free_blocks == cache.num_blocks, "blocks leaked"
    assert all(cache.allocator.refcount(b) == 0 for b in range(cache.num_blocks))
    cache.check_invariants()
    _check_prefix_cache(cache, histories)
    assert scheduled_tokens > 0 and next_id > 10
    assert sum(r.num_cached_prompt_tokens for r in scheduler.requests.values()) > 0, "no prefix was ever reused"
