"""The block pool: which cache blocks are free, who holds each used one, and the prefix-cache index.

:class:`BlockAllocator` knows nothing of tensors or sequences: blocks are numbers ``0 ..
num_blocks - 1``; a block table (:mod:`kernel_ladder.serving.paged_cache`) holding a block is one
reference to it, so blocks shared between forked sequences or between prompts with a common
prefix are freed only when their last holder lets go. Full blocks are also indexed by their
contents (:data:`BlockKey`), so that a later prompt starting with the same tokens can find them —
prefix caching (see :mod:`kernel_ladder.serving` for how keys are built).
"""

from __future__ import annotations

from collections import OrderedDict, deque

__all__ = ["BlockAllocator", "BlockKey", "KVCacheOutOfBlocks"]

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

