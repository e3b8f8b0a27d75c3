"""Serving: a paged KV cache, continuous batching and a generation engine, one concern per module.

From the bottom up, each layer usable alone:

* :mod:`~kernel_ladder.serving.block_pool` — :class:`BlockAllocator`, the pool of cache blocks:
  which of ``num_blocks`` blocks are free, how many sequences reference each used block
  (reference counts make sharing safe), and the *prefix cache*'s index (full blocks keyed by
  the SHA-256 of their parent's key and their token ids).
* :mod:`~kernel_ladder.serving.paged_cache` — :class:`PagedKVCache`, the cache tensors of every
  layer and, per sequence, its **block table** (the blocks that hold its tokens, in order) and its
  length. It hands out **slots** (``block * block_size + offset``) for a sequence's next tokens —
  the ``slot_mapping`` that :func:`kernel_ladder.write_kv_cache` writes through — allocating
  blocks as the sequence grows, sharing blocks between forked sequences (copy-on-write) and
  between prompts with a common prefix (prefix caching).
* :mod:`~kernel_ladder.serving.scheduler` — :class:`Scheduler`, continuous batching: requests
  join and leave between steps; each step runs every decoding sequence for one token, then fills
  the rest of a token budget with chunks of prompts (chunked prefill), and preempts the newest
  sequence when the cache is full. Its :class:`SchedulerOutput` holds exactly the tensors a model
  step needs.
* :mod:`~kernel_ladder.serving.forward` — the model step: a model of the layer protocol
  (:class:`~kernel_ladder.models.protocol.DecoderLM`, e.g. :class:`~kernel_ladder.models.CausalLM`) on one
  packed step over the cache; :class:`~kernel_ladder.serving.paged_cache.CacheSpec` is what each of its layers
  caches per token (K and V, or MLA's latent vector).
* :mod:`~kernel_ladder.serving.sampling` — greedy, temperature and nucleus sampling.
* :mod:`~kernel_ladder.serving.speculative` — speculative decoding: a draft model or prompt
  lookup proposes, the target verifies (the rule that keeps its distribution exact).
* :mod:`~kernel_ladder.serving.engine` — :class:`Engine`, all of the above driven for a model:
  ``generate`` and ``stream`` (also ``kernel_ladder.models.Engine``).

**Prefix caching.** A *full* block's contents depend on every token before it, so a block is
identified by a chain: its key is the SHA-256 of its parent block's key, the request's cache salt
and its own token ids (:func:`~kernel_ladder.serving.block_pool.block_key`; an encoding with fixed
widths and length prefixes, so that different chains never hash the same bytes). Two sequences
whose first ``n`` blocks hold the same tokens, under the same salt, get the same ``n`` keys; no
two different prefixes can be made to (Python's 64-bit ``hash`` could be: see the block pool). When
a block fills, its key is registered; a new sequence whose prompt starts with the same tokens
reuses those blocks (a reference each) and only prefills the rest. A block whose last reference
goes keeps its contents and its key in an *evictable* pool (least recently freed first): a later
prompt can still reuse it, and it is only overwritten (its key forgotten) when a free block is
needed and no block without a key is left. Requests with different ``cache_salt`` values (tenants,
adapters) never share a block.

A block's key is registered when its slots are handed out, before the model step writes it. That
is safe because every scheduled step is run — a step whose prefill chunks all end mid-prompt too
(it samples nothing, but its K/V are what later steps and later prompts read) — and a model step
writes every token's K/V (:func:`kernel_ladder.write_kv_cache`) in each layer before that layer's
attention reads the cache, so a sequence admitted in the same step that reuses the block reads it
after it was written. A step that fails takes its blocks out of the prefix cache
(:meth:`PagedKVCache.forget_blocks <kernel_ladder.serving.paged_cache.PagedKVCache.forget_blocks>`).

**Host state by design.** The cache and the scheduler are host-side bookkeeping: block tables,
lengths and free lists live in Python, and the step's ``block_tables``, ``seq_lens`` and
``slot_mapping`` are built on the host before they are copied to the device. That is where an
engine's per-step host work belongs. The ops they feed (:func:`kernel_ladder.write_kv_cache`,
:func:`kernel_ladder.paged_attention`) never read those tensors back: they make no host
synchronization (their value checks follow :mod:`kernel_ladder.runtime`'s policy), so a model step
over them can be captured in a CUDA graph with its inputs copied into static buffers.
"""

from .block_pool import BlockAllocator, BlockKey, KVCacheOutOfBlocks, block_key
from .engine import Engine, EngineStats
from .paged_cache import CacheSpec, PagedKVCache
from .scheduler import Request, Scheduler, SchedulerOutput

__all__ = [
    "BlockAllocator",
    "BlockKey",
    "CacheSpec",
    "Engine",
    "EngineStats",
    "KVCacheOutOfBlocks",
    "PagedKVCache",
    "Request",
    "Scheduler",
    "SchedulerOutput",
    "block_key",
]
