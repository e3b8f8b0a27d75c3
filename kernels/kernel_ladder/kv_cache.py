"""A paged KV cache's bookkeeping and a continuous-batching scheduler, in plain Python over torch tensors.

Three layers, each usable alone:

* :class:`BlockAllocator` — the block pool: which of ``num_blocks`` blocks are free, how many
  sequences reference each used block (reference counts make sharing safe), and the *prefix
  cache*'s index (full blocks keyed by their token contents).
* :class:`PagedKVCache` — the cache tensors of every layer and, per sequence, its **block table**
  (the blocks that hold its tokens, in order) and its length. It hands out **slots** (``block *
  block_size + offset``) for a sequence's next tokens — the ``slot_mapping`` that
  :func:`kernel_ladder.write_kv_cache` writes through — allocating blocks as the sequence grows,
  sharing blocks between forked sequences (copy-on-write) and between prompts with a common
  prefix (prefix caching).
* :class:`Scheduler` — continuous batching: requests join and leave between steps; each step
  runs every decoding sequence for one token, then fills the rest of a token budget with
  chunks of prompts (chunked prefill), and preempts the newest sequence when the cache is full.
  Its :class:`SchedulerOutput` holds exactly the tensors a model step needs.

**Prefix caching.** A *full* block's contents depend on every token before it, so a block is
identified by ``hash((parent block's hash, this block's token ids))``: two sequences whose first
``n`` blocks hold the same tokens get the same ``n`` keys. When a block fills, its key is
registered; a new sequence whose prompt starts with the same tokens reuses those blocks (a
reference each) and only prefills the rest. A block whose last reference goes keeps its contents
and its key in an *evictable* pool (least recently freed first): a later prompt can still reuse
it, and it is only overwritten (its key forgotten) when a free block is needed and no block
without a key is left. The cache index compares the block's tokens exactly (the key is the pair,
not only its hash), so two different blocks are never confused; parents are identified by hash.

A block's key is registered when its slots are handed out, before the model step writes it. That
is safe because a model step writes every token's K/V (:func:`kernel_ladder.write_kv_cache`) in each
layer before that layer's attention reads the cache, so a sequence admitted in the same step that
reuses the block reads it after it was written.

**Host state by design.** This module is host-side bookkeeping: block tables, lengths and free lists
live in Python, and it builds the step's ``block_tables``, ``seq_lens`` and ``slot_mapping`` on the
host before copying them to the device. That is where an engine's per-step host work belongs. The
ops it feeds (:func:`kernel_ladder.write_kv_cache`, :func:`kernel_ladder.paged_attention`) never read those
tensors back: they make no host synchronization (their value checks follow :mod:`kernel_ladder.runtime`'s
policy), so a model step over them can be captured in a CUDA graph with its inputs copied into
static buffers.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "KVCacheOutOfBlocks",
    "BlockAllocator",
    "PagedKVCache",
    "Request",
    "Scheduler",
    "SchedulerOutput",
]

#: The key of a full block in the prefix cache: (parent block's hash or None, this block's token ids).
BlockKey = tuple[int | None, tuple[int, ...]]


class KVCacheOutOfBlocks(RuntimeError):
    """Raised when the cache has fewer free blocks than an allocation needs.

    Attributes:
        needed: blocks the allocation needed.
        free: blocks that were free (including evictable cached blocks).
    """

    def __init__(self, needed: int, free: int, what: str = "the allocation") -> None:
        self.needed = needed
        self.free = free
        super().__init__(
            f"kv cache out of blocks: {what} needs {needed} block(s), {free} free. Free finished sequences, "
            "preempt one (the scheduler does), or build the cache with more blocks"
        )


# ----------------------------------------------------------------------------------------------
# The block pool
# ----------------------------------------------------------------------------------------------


class BlockAllocator:
    """A pool of ``num_blocks`` cache blocks with reference counts and a prefix-cache index.

    A block is in exactly one of three states:

    * **used**: reference count >= 1 (one per block table holding it);
    * **free**: count 0, no cached contents;
    * **evictable**: count 0, but it holds a full block registered in the prefix cache; it can be
      revived by :meth:`incref` (a prefix hit) or taken by :meth:`allocate` once no free block is
      left (then its key is forgotten). The least recently freed is taken first (LRU).

    :meth:`allocate` never hands out a block whose count is above zero.
    """

    def __init__(self, num_blocks: int) -> None:
        """A pool whose blocks ``0 .. num_blocks - 1`` are all free."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockAllocator: num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._key_of: dict[int, BlockKey] = {}  # block -> its prefix-cache key
        self._block_of: dict[BlockKey, int] = {}  # prefix-cache key -> block

    # --- counts

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks that still hold prefix-cached contents."""
        return len(self._evictable)

    def refcount(self, block: int) -> int:
        """How many block tables hold ``block``."""
        return self._refcount[block]

    # --- allocation and references

    def allocate(self) -> int:
        """A block with reference count 1: a free one, else the least recently freed evictable one
        (whose prefix-cache key is then forgotten). Raises :class:`KVCacheOutOfBlocks` when none is left."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        else:
            raise KVCacheOutOfBlocks(1, 0, "allocating a block")
        self._refcount[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks at once, or none (raises :class:`KVCacheOutOfBlocks` before taking any)."""
        if n > self.num_free:
            raise KVCacheOutOfBlocks(n, self.num_free, f"allocating {n} blocks")
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        """One more reference to ``block``: a used block (sharing) or an evictable one (a prefix hit)."""
        if self._refcount[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"BlockAllocator.incref: block {block} is free; allocate() it instead")
            del self._evictable[block]
        self._refcount[block] += 1

    def decref(self, block: int) -> bool:
        """One reference fewer; at zero the block becomes evictable (if prefix-cached) or free.
        Returns whether it lost its last reference."""
        if self._refcount[block] <= 0:
            raise ValueError(f"BlockAllocator.decref: block {block} has no reference to drop")
        self._refcount[block] -= 1
        if self._refcount[block] > 0:
            return False
        if block in self._key_of:
            self._evictable[block] = None  # most recently freed: evicted last
        else:
            self._free.append(block)
        return True

    # --- the prefix-cache index

    def register(self, block: int, key: BlockKey) -> bool:
        """Record that used ``block`` holds the full block ``key``. Returns False (and records
        nothing) if another block already holds that key or this block already has one."""
        if self._refcount[block] == 0:
            raise ValueError(f"BlockAllocator.register: block {block} is not in use")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding the full block ``key`` (used or evictable), or None."""
        return self._block_of.get(key)

    def key_of(self, block: int) -> BlockKey | None:
        """The prefix-cache key ``block`` is registered under, or None."""
        return self._key_of.get(block)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def check_invariants(self, references: dict[int, int] | None = None) -> None:
        """Assert the pool is consistent: every block in exactly one state, the index a bijection
        over evictable and used blocks, and (given ``references``: block -> count of block-table
        entries) every reference count equal to the references that exist."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)}"
        for block in range(self.num_blocks):
            count = self._refcount[block]
            assert count >= 0, f"block {block} has a negative reference count {count}"
            unreferenced = block in free or block in evictable
            assert unreferenced == (count == 0), (
                f"block {block}: reference count {count}, but free={block in free}, evictable={block in evictable}")
        assert all(b in self._key_of for b in evictable), "an evictable block without a prefix-cache key"
        assert not any(b in self._key_of for b in free), "a free block still holds a prefix-cache key"
        assert len(self._key_of) == len(self._block_of), "the prefix-cache index is not one-to-one"
        for block, key in self._key_of.items():
            assert self._block_of.get(key) == block, f"block {block}'s key maps to another block"
        if references is not None:
            for block in range(self.num_blocks):
                expected = references.get(block, 0)
                assert self._refcount[block] == expected, (
                    f"block {block}: reference count {self._refcount[block]}, but {expected} block-table references "
                    + ("(leaked)" if expected == 0 else ""))


# ----------------------------------------------------------------------------------------------
# The paged cache
# ----------------------------------------------------------------------------------------------


@dataclass
class _Sequence:
    """One sequence's view of the cache."""

    block_table: list[int]
    length: int  # tokens whose slots were handed out (cached or being written this step)
    token_ids: list[int] | None  # known tokens (prompt, then appended), None if not prefix-caching
    block_hashes: list[int] = field(default_factory=list)  # hash of each registered-full block, in order


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """The K and V caches of every layer, split into blocks, and each sequence's blocks and length.

    ``k`` and ``v`` are each one ``(num_layers, num_blocks, block_size, num_kv_heads, head_dim)``
    tensor; :meth:`k_cache` / :meth:`v_cache` give one layer's ``(num_blocks, block_size, Hkv, D)``
    view, what :func:`kernel_ladder.write_kv_cache` and paged attention take. A sequence's token at
    position ``p`` lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

    Sequence ids are any hashable values. Blocks beyond a sequence's length may be reserved
    (:meth:`allocate` reserves a whole prompt's blocks), so prefilling it in chunks never runs out.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        """Allocate the caches (zero-filled) and an empty pool of ``num_blocks`` blocks."""
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        if num_blocks * block_size > 2**31 - 1:
            raise ValueError(f"PagedKVCache: num_blocks * block_size = {num_blocks * block_size} slots do not fit "
                             "the int32 slot mapping")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[Hashable, _Sequence] = {}

    # --- the tensors

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s key cache, a ``(num_blocks, block_size, Hkv, D)`` view."""
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s value cache, a ``(num_blocks, block_size, Hkv, D)`` view."""
        return self.v[layer]

    # --- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new allocations (free plus evictable prefix-cached ones)."""
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return _cdiv(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now (without counting prefix hits)."""
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list[Hashable]:
        """The sequences the cache holds, in allocation order."""
        return list(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` whose slots were handed out (in the cache, or written this step)."""
        return self._seq(seq_id).length

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of ``seq_id``'s block table (reserved blocks past its length included)."""
        return list(self._seq(seq_id).block_table)

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"PagedKVCache: no sequence {seq_id!r} (allocate() it first)") from None

    # --- allocation

    def allocate(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Start sequence ``seq_id`` and reserve blocks for its first ``num_tokens`` tokens.

        With ``token_ids`` (the prompt, ``num_tokens`` of them) the prefix cache is consulted: the
        longest run of leading full blocks already cached is reused (shared, not copied), and the
        sequence's full blocks are registered as they fill. At least one token is always left to
        compute (the model needs the last prompt token's output to sample), so a prompt that is
        entirely cached reuses all but its last block.

        Returns the number of tokens already in the cache: the sequence's length starts there, and
        the caller prefills only the rest (with :meth:`append_slots`). Raises
        :class:`KVCacheOutOfBlocks` (and changes nothing) if the blocks do not fit.
        """
        result = self.try_allocate(seq_id, num_tokens, token_ids)
        if result is None:
            hits = len(self._prefix_hits(token_ids, num_tokens)) if token_ids is not None else 0
            needed = self.blocks_for(num_tokens) - hits
            raise KVCacheOutOfBlocks(needed, self.num_free_blocks - self._evictable_hits(token_ids, num_tokens),
                                     f"sequence {seq_id!r} ({num_tokens} tokens)")
        return result

    def try_allocate(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> int | None:
        """:meth:`allocate`, but returns None (and changes nothing) when the blocks do not fit."""
        if seq_id in self._seqs:
            raise ValueError(f"PagedKVCache.allocate: sequence {seq_id!r} already exists")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"PagedKVCache.allocate: num_tokens must be an int >= 0, got {num_tokens!r}")
        if token_ids is not None:
            token_ids = [int(t) for t in token_ids]
            if len(token_ids) != num_tokens:
                raise ValueError(f"PagedKVCache.allocate: token_ids has {len(token_ids)} ids, "
                                 f"num_tokens is {num_tokens}")
        hits = self._prefix_hits(token_ids, num_tokens) if token_ids is not None else []
        new = self.blocks_for(num_tokens) - len(hits)
        # Reviving an evictable hit takes it out of the pool new blocks come from.
        if new > self.num_free_blocks - self._evictable_hits(token_ids, num_tokens):
            return None
        for block, _ in hits:
            self.allocator.incref(block)
        table = [block for block, _ in hits] + self.allocator.allocate_many(new)
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Sequence(table, cached, token_ids, [h for _, h in hits])
        return cached

    def _prefix_hits(self, token_ids: Sequence[int], num_tokens: int) -> list[tuple[int, int]]:
        """(block, hash) of the leading full blocks of ``token_ids`` found in the prefix cache,
        leaving at least the last token uncached."""
        hits: list[tuple[int, int]] = []
        parent: int | None = None
        for i in range(max(0, num_tokens - 1) // self.block_size):
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            block = self.allocator.lookup(key)
            if block is None:
                break
            parent = hash(key)
            hits.append((block, parent))
        return hits

    def _evictable_hits(self, token_ids: Sequence[int] | None, num_tokens: int) -> int:
        if token_ids is None:
            return 0
        return sum(1 for block, _ in self._prefix_hits(token_ids, num_tokens) if self.allocator.refcount(block) == 0)

    def append_slots(self, seq_id: Hashable, n: int, token_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Slots for ``seq_id``'s next ``n`` tokens, as an int32 tensor ``(n,)`` on the cache's device.

        Uses the sequence's reserved blocks first and allocates more as needed. A block about to be
        written that other sequences share (reference count > 1, after :meth:`fork`) is first
        copied on write: a new block gets the filled part of every layer's K and V, and the
        shared one loses this sequence's reference. ``token_ids`` (``n`` ids) are the tokens being
        added, for prefix caching (full blocks get registered); tokens the cache already knows
        (the prompt given to :meth:`allocate`) need not be repeated. Raises
        :class:`KVCacheOutOfBlocks` (and changes nothing) if the blocks do not fit.
        """
        slots = self.try_append_slots(seq_id, n, token_ids)
        if slots is None:
            raise KVCacheOutOfBlocks(self._blocks_to_append(self._seq(seq_id), n), self.num_free_blocks,
                                     f"appending {n} token(s) to sequence {seq_id!r}")
        return slots

    def try_append_slots(self, seq_id: Hashable, n: int, token_ids: Sequence[int] | None = None) -> torch.Tensor | None:
        """:meth:`append_slots`, but returns None (and changes nothing) when the blocks do not fit:
        the scheduler's signal to preempt a sequence."""
        seq = self._seq(seq_id)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"PagedKVCache.append_slots: n must be an int >= 0, got {n!r}")
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"PagedKVCache.append_slots: token_ids has {len(token_ids)} ids, n is {n}")
        if self._blocks_to_append(seq, n) > self.num_free_blocks:
            return None
        bs = self.block_size
        start, end = seq.length, seq.length + n
        seq.block_table += self.allocator.allocate_many(max(0, self.blocks_for(end) - len(seq.block_table)))
        for index in range(start // bs, self.blocks_for(end)):
            self._own_block(seq, index, filled=max(0, start - index * bs))
        seq.length = end
        self._record_tokens(seq, start, token_ids)
        positions = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        slots = table[positions // bs] * bs + positions % bs if n else positions
        return slots.to(dtype=torch.int32, device=self.device)

    def _blocks_to_append(self, seq: _Sequence, n: int) -> int:
        """New blocks appending ``n`` tokens takes: growth past the table plus copies of shared blocks."""
        end = seq.length + n
        grow = max(0, self.blocks_for(end) - len(seq.block_table))
        touched = range(seq.length // self.block_size, min(self.blocks_for(end), len(seq.block_table)))
        return grow + sum(1 for i in touched if self.allocator.refcount(seq.block_table[i]) > 1)

    def _own_block(self, seq: _Sequence, index: int, filled: int) -> None:
        """Copy-on-write: make block ``index`` of ``seq`` its own before writing, copying its first ``filled`` slots."""
        old = seq.block_table[index]
        if self.allocator.refcount(old) <= 1:
            return
        new = self.allocator.allocate()
        if filled:
            self.k[:, new, :filled] = self.k[:, old, :filled]
            self.v[:, new, :filled] = self.v[:, old, :filled]
        self.allocator.decref(old)
        seq.block_table[index] = new

    def _record_tokens(self, seq: _Sequence, start: int, token_ids: Sequence[int] | None) -> None:
        """Extend the known tokens and register every block that is now full and known."""
        if seq.token_ids is None:
            return
        if token_ids is not None:
            for offset, token in enumerate(token_ids):
                position = start + offset
                if position < len(seq.token_ids):
                    if seq.token_ids[position] != int(token):
                        raise ValueError(f"PagedKVCache.append_slots: token {int(token)} at position {position} "
                                         f"differs from the prompt's {seq.token_ids[position]}")
                else:
                    seq.token_ids.append(int(token))
        if len(seq.token_ids) < seq.length:  # tokens of unknown ids were appended: stop prefix caching it
            seq.token_ids = None
            return
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.length:
            i = len(seq.block_hashes)
            key = (seq.block_hashes[-1] if seq.block_hashes else None, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            self.allocator.register(seq.block_table[i], key)
            seq.block_hashes.append(hash(key))

    # --- sharing and freeing

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares every block (beam search,
        parallel sampling): no data moves; each block gains a reference, and whichever sequence
        writes into a shared block first copies it (:meth:`append_slots`)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"PagedKVCache.fork: sequence {child_id!r} already exists")
        for block in parent.block_table:
            self.allocator.incref(block)
        self._seqs[child_id] = _Sequence(list(parent.block_table), parent.length,
                                         None if parent.token_ids is None else list(parent.token_ids),
                                         list(parent.block_hashes))

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shorten ``seq_id`` to its first ``num_tokens`` tokens (speculative decoding's rollback of
        rejected draft tokens): blocks past them lose this sequence's reference. A block registered
        in the prefix cache cannot be cut into (its contents are shared by its key)."""
        seq = self._seq(seq_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= seq.length:
            raise ValueError(f"PagedKVCache.truncate: num_tokens must be an int in [0, {seq.length}], "
                             f"got {num_tokens!r}")
        if len(seq.block_hashes) * self.block_size > num_tokens:
            raise ValueError(f"PagedKVCache.truncate: sequence {seq_id!r} has {len(seq.block_hashes)} blocks "
                             f"registered in the prefix cache; it cannot be cut to {num_tokens} tokens")
        keep = self.blocks_for(num_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.allocator.decref(block)
        del seq.block_table[keep:]
        seq.length = num_tokens
        if seq.token_ids is not None:
            del seq.token_ids[num_tokens:]

    def free(self, seq_id: Hashable) -> None:
        """Drop ``seq_id``: each of its blocks loses a reference (prefix-cached ones stay evictable)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"PagedKVCache.free: no sequence {seq_id!r}")
        # Last block first, so a prompt's leading blocks (the most reusable) are evicted last.
        for block in reversed(seq.block_table):
            self.allocator.decref(block)

    # --- the model step's tensors

    def block_tables(self, seq_ids: Iterable[Hashable], pad: int = 0) -> torch.Tensor:
        """int32 ``(B, max_blocks)``: row ``b`` holds the blocks covering ``seq_ids[b]``'s length,
        padded with ``pad`` (never read: attention stops at ``seq_lens``). At least one column."""
        tables = []
        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            tables.append(seq.block_table[:self.blocks_for(seq.length)])
        width = max([1, *(len(t) for t in tables)])
        out = torch.full((len(tables), width), pad, dtype=torch.int32)
        for row, table in enumerate(tables):
            out[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        return out.to(self.device)

    def seq_lens(self, seq_ids: Iterable[Hashable]) -> torch.Tensor:
        """int32 ``(B,)``: each sequence's length (tokens in the cache, this step's included)."""
        return torch.tensor([self._seq(s).length for s in seq_ids], dtype=torch.int32, device=self.device)

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_id``'s K and V history in ``layer``, ``(length, Hkv, D)`` each (a copy, for tests and lessons)."""
        seq = self._seq(seq_id)
        positions = torch.arange(seq.length)
        table = torch.tensor(seq.block_table, dtype=torch.int64)[positions // self.block_size]
        return self.k[layer, table, positions % self.block_size], self.v[layer, table, positions % self.block_size]

    # --- invariants

    def check_invariants(self) -> None:
        """Assert the cache's bookkeeping is consistent (the tests call it after every step):

        every reference count equals the number of block-table entries holding the block (a
        cached-free block has none), free and evictable blocks are disjoint from used ones and
        together with them cover every block exactly once (nothing leaked), a block appears at most
        once in one table, a sequence's table covers its length, and every registered full block's
        key matches that sequence's tokens."""
        references: dict[int, int] = {}
        for seq_id, seq in self._seqs.items():
            assert len(set(seq.block_table)) == len(seq.block_table), f"sequence {seq_id!r} holds a block twice"
            assert self.blocks_for(seq.length) <= len(seq.block_table), f"sequence {seq_id!r}'s table is too short"
            for block in seq.block_table:
                references[block] = references.get(block, 0) + 1
            if seq.token_ids is not None:
                assert len(seq.block_hashes) == seq.length // self.block_size, (
                    f"sequence {seq_id!r}: {len(seq.block_hashes)} full blocks hashed, length {seq.length}")
                parent = None
                for i, h in enumerate(seq.block_hashes):
                    key = (parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
                    assert hash(key) == h, f"sequence {seq_id!r}: block {i}'s hash does not match its tokens"
                    parent = h
        self.allocator.check_invariants(references)


# ----------------------------------------------------------------------------------------------
# Continuous batching
# ----------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One generation request and its progress.

    ``token_ids`` is the prompt followed by the tokens generated so far; ``num_computed`` counts
    the leading ones whose K/V are in the cache (after the scheduled step runs). ``status`` is
    ``"waiting"``, ``"running"`` or ``"finished"``.
    """

    request_id: Hashable
    prompt_token_ids: list[int]
    max_new_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: str = "waiting"
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at the last admission

    @property
    def token_ids(self) -> list[int]:
        """Prompt plus generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SchedulerOutput:
    """What one model step runs: the sequences, in batch order (decodes first, then prefill chunks),
    and the tensors the model needs, all int32 on the cache's device.

    * ``token_ids``, ``positions``, ``slot_mapping``: ``(T,)``, the sequences' tokens packed one
      after the other — the input ids, their positions (for RoPE) and the slots
      :func:`kernel_ladder.write_kv_cache` writes their K/V to.
    * ``cu_seqlens_q``: ``(B + 1,)``, 0 then the prefix sums of ``num_tokens``: sequence ``b``'s
      tokens are ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
    * ``seq_lens``: ``(B,)``, tokens in the cache per sequence, this step's included.
    * ``block_tables``: ``(B, max_blocks)``, padded with 0.
    * ``sample_indices``: ``(S,)``, the flat index of the last token of each sequence in
      ``sample_request_ids`` — those whose prompt is complete after this step and that get a new
      token (a prefill chunk that ends mid-prompt produces none).

    Empty (``B = 0``) when nothing can run.
    """

    request_ids: list[Hashable]
    num_tokens: list[int]
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    sample_request_ids: list[Hashable]
    sample_indices: torch.Tensor
    num_decodes: int
    preempted: list[Hashable]

    @property
    def num_seqs(self) -> int:
        """B, the sequences in this step."""
        return len(self.request_ids)

    @property
    def total_tokens(self) -> int:
        """T, the tokens in this step."""
        return sum(self.num_tokens)

    @property
    def max_seqlen_q(self) -> int:
        """The most tokens any sequence runs this step."""
        return max(self.num_tokens, default=0)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to run."""
        return not self.request_ids


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recomputation, over a :class:`PagedKVCache`.

    Each :meth:`step` decides what the next model step runs:

    1. **Decodes first.** Every running sequence that has exactly one token to compute (the
       token sampled last step), oldest first, 1 token each. If the cache cannot give one a slot,
       the most recently admitted running sequence not yet scheduled this step is **preempted**
       (its blocks freed; it goes back to the front of the waiting queue and is recomputed from
       its prompt plus what it generated, mostly from the prefix cache) until it can — possibly
       itself.
    2. **Prefill chunks** under the rest of the token budget: first the running sequences whose
       prompt is partly computed, then waiting requests in arrival order (first come, first
       served: no request overtakes the head of the queue). A waiting request is admitted only
       if there is room (``max_num_seqs``) and the cache can reserve blocks for all its tokens
       (reusing cached prefix blocks); a long prompt runs over several steps (chunked prefill).
       Nothing is admitted in a step that preempted (it would be the next victim).

    :meth:`update` then appends the sampled tokens and finishes requests that reached
    ``max_new_tokens`` or produced ``eos_token_id``, freeing their blocks.
    """

    def __init__(self, cache: PagedKVCache, max_num_seqs: int, max_tokens_per_step: int,
                 eos_token_id: int | None = None) -> None:
        """A scheduler over ``cache`` running at most ``max_num_seqs`` sequences and
        ``max_tokens_per_step`` tokens per step."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_tokens_per_step", max_tokens_per_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheduler: {name} must be a positive int, got {value!r}")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order, oldest first
        self.requests: dict[Hashable, Request] = {}
        self._awaiting: set[Hashable] = set()  # the last step's sampling requests, until update()
        self.num_steps = 0

    # --- requests

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], max_new_tokens: int) -> Request:
        """Queue a request. Raises ValueError if it could never fit the cache (its prompt and
        ``max_new_tokens`` tokens need more blocks than the cache has) or its id is taken."""
        if request_id in self.requests:
            raise ValueError(f"Scheduler.add_request: request {request_id!r} already exists")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"Scheduler.add_request: request {request_id!r} has an empty prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"Scheduler.add_request: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        # The last generated token is never fed back, so len(prompt) + max_new_tokens - 1 slots at most.
        needed = self.cache.blocks_for(len(prompt) + max_new_tokens - 1)
        if needed > self.cache.num_blocks:
            raise ValueError(f"Scheduler.add_request: request {request_id!r} needs up to {needed} blocks "
                             f"({len(prompt)} prompt + {max_new_tokens} new tokens), "
                             f"the cache has {self.cache.num_blocks}")
        request = Request(request_id, prompt, max_new_tokens)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    # --- one step

    def step(self) -> SchedulerOutput:
        """Choose this step's sequences and tokens, reserve their slots, and return the model's inputs."""
        if self._awaiting:
            raise RuntimeError("Scheduler.step: call update() with the last step's sampled tokens first")
        budget = self.max_tokens_per_step
        scheduled: list[tuple[Request, int, torch.Tensor]] = []  # (request, tokens, slots)
        done: set[Hashable] = set()
        preempted: list[Hashable] = []

        # 1. Decodes: one token each, oldest first; preempt the newest when the cache is full.
        for request in list(self.running):
            if request.status != "running" or request.num_tokens - request.num_computed != 1:
                continue
            if budget == 0:
                break
            slots = None
            while slots is None:
                slots = self.cache.try_append_slots(request.request_id, 1, request.token_ids[-1:])
                if slots is None:
                    victim = next(r for r in reversed(self.running) if r.request_id not in done)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
            if slots is None:
                continue
            scheduled.append((request, 1, slots))
            done.add(request.request_id)
            budget -= 1
        num_decodes = len(scheduled)

        # 2a. Prefill chunks of running sequences whose prompt is partly computed (blocks reserved).
        for request in self.running:
            remaining = request.num_tokens - request.num_computed
            if budget == 0 or request.request_id in done or remaining <= 1:
                continue  # nothing left to prefill (a decode), or already scheduled
            budget = self._schedule_chunk(request, min(remaining, budget), budget, scheduled, done)

        # 2b. Admit waiting requests, first come first served, while there is room.
        while budget > 0 and self.waiting and not preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.cache.try_allocate(request.request_id, request.num_tokens, request.token_ids)
            if cached is None:
                break  # not enough blocks: wait for sequences to finish
            self.waiting.popleft()
            request.status, request.num_computed = "running", cached
            request.num_cached_prompt_tokens = cached
            self.running.append(request)
            remaining = request.num_tokens - request.num_computed
            budget = self._schedule_chunk(request, min(remaining, budget), budget, scheduled, done)

        output = self._build_output(scheduled, num_decodes, preempted)
        self._awaiting = set(output.sample_request_ids)
        self.num_steps += 1
        return output

    def _schedule_chunk(self, request: Request, n: int, budget: int,
                        scheduled: list[tuple[Request, int, torch.Tensor]], done: set[Hashable]) -> int:
        """Schedule ``n`` prompt tokens of ``request`` (their blocks are reserved); returns the budget left."""
        start = request.num_computed
        slots = self.cache.append_slots(request.request_id, n, request.token_ids[start:start + n])
        scheduled.append((request, n, slots))
        done.add(request.request_id)
        return budget - n

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and put it at the front of the waiting queue, to be recomputed."""
        self.cache.free(request.request_id)
        self.running.remove(request)
        request.status, request.num_computed = "waiting", 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _build_output(self, scheduled: list[tuple[Request, int, torch.Tensor]], num_decodes: int,
                      preempted: list[Hashable]) -> SchedulerOutput:
        device = self.cache.device
        ids = [r.request_id for r, _, _ in scheduled]
        counts = [n for _, n, _ in scheduled]
        tokens: list[int] = []
        positions: list[int] = []
        sample_ids: list[Hashable] = []
        sample_indices: list[int] = []
        for request, n, _ in scheduled:
            start = request.num_computed
            tokens += request.token_ids[start:start + n]
            positions += range(start, start + n)
            request.num_computed = start + n  # what the cache holds once this step has run
            if request.num_computed == request.num_tokens:
                sample_ids.append(request.request_id)
                sample_indices.append(len(tokens) - 1)
        cu = [0, *itertools.accumulate(counts)]
        slots = [s for _, _, s in scheduled]

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return SchedulerOutput(
            request_ids=ids, num_tokens=counts, token_ids=int32(tokens), positions=int32(positions),
            slot_mapping=torch.cat(slots) if slots else int32([]),
            block_tables=self.cache.block_tables(ids), seq_lens=self.cache.seq_lens(ids), cu_seqlens_q=int32(cu),
            sample_request_ids=sample_ids, sample_indices=int32(sample_indices), num_decodes=num_decodes,
            preempted=preempted,
        )

    # --- after the model step

    def update(self, outputs: dict[Hashable, int]) -> list[Request]:
        """Append each sampled token (``outputs``: request id -> token id, exactly the last step's
        ``sample_request_ids``); finish the requests that reached ``max_new_tokens`` or produced
        ``eos_token_id`` and free their blocks. Returns the requests finished now."""
        expected = self._awaiting
        if set(outputs) != expected:
            raise ValueError(f"Scheduler.update: expected tokens for {sorted(map(str, expected))}, "
                             f"got {sorted(map(str, outputs))}")
        finished = []
        for request_id, token in outputs.items():
            request = self.requests[request_id]
            request.output_token_ids.append(int(token))
            eos = self.eos_token_id is not None and int(token) == self.eos_token_id
            if eos or len(request.output_token_ids) >= request.max_new_tokens:
                request.status = "finished"
                self.running.remove(request)
                self.cache.free(request_id)
                finished.append(request)
        self._awaiting = set()
        return finished

    def finish(self, request_id: Hashable) -> Request:
        """End a request now (a stop token its caller recognized, or an abort): it leaves the queue or
        the running set and its blocks are freed. Returns it; finishing a finished request does nothing."""
        if request_id not in self.requests:
            raise ValueError(f"Scheduler.finish: no request {request_id!r}")
        request = self.requests[request_id]
        if request.status == "finished":
            return request
        if request.status == "running":
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request_id in self.cache:
            self.cache.free(request_id)
        self._awaiting.discard(request_id)
        request.status = "finished"
        return request
