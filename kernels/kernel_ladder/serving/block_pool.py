"""The block pool: which cache blocks are free, who holds each used one, and the prefix-cache index.

:class:`BlockAllocator` knows nothing of tensors or sequences: blocks are numbers ``0 ..
num_blocks - 1``; a block table (:mod:`kernel_ladder.serving.paged_cache`) holding a block is one
reference to it, so blocks shared between forked sequences or between prompts with a common
prefix are freed only when their last holder lets go. Full blocks are also indexed by their
contents (:data:`BlockKey`, made by :func:`block_key`), so that a later prompt starting with the
same tokens can find them — prefix caching.

**Keys.** A full block's K/V depend on every token before it, so its key chains: the SHA-256 of its
parent block's key, the cache salt and its own token ids, each encoded unambiguously (fixed widths
and length prefixes). Two blocks share a key only if their whole prefixes, token for token, and
their salts are equal — short of a SHA-256 collision, which nobody can construct. Python's
``hash`` would not do: it is 64 bits and easy to collide on purpose (CPython hashes ``-1`` and
``-2`` alike, and ints modulo ``2**61 - 1``), and a collision between two parents would hand one
prompt a block computed after another's prefix (vLLM met this: CVE-2025-25183, and keys its blocks
by SHA-256 since). The *cache salt* is any extra key whose values must never share K/V: a tenant's
secret (so that timing cannot reveal another tenant's prompts), an adapter's name (its K/V differ).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

__all__ = ["BlockAllocator", "BlockKey", "KVCacheOutOfBlocks", "block_key"]

#: The key of a full block in the prefix cache: the 32-byte SHA-256 digest :func:`block_key` makes.
BlockKey = bytes

_OP = "kernel_ladder.serving.BlockAllocator"
_KEY_BYTES = 32
_KEY_DOMAIN = b"kernel_ladder.serving.prefix-cache.block.v1\0"


def check_cache_salt(cache_salt: object, op: str) -> bytes | None:
    """``cache_salt`` as bytes (a str as its UTF-8), None for none; a TypeError naming ``op`` otherwise."""
    if cache_salt is None or isinstance(cache_salt, bytes):
        return cache_salt
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8")
    raise TypeError(f"{op}: cache_salt must be a str, bytes or None, got {type(cache_salt).__name__}")


def check_token_ids(token_ids: Sequence[int], op: str) -> list[int]:
    """``token_ids`` as a list of ints (a tensor's or numpy's integers too), else a TypeError naming ``op``."""
    tokens = []
    for t in token_ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"{op}: token_ids must be ints, got {type(t).__name__} {t!r}")
        tokens.append(operator.index(t))
    return tokens


def block_key(parent: BlockKey | None, token_ids: Sequence[int], cache_salt: str | bytes | None = None) -> BlockKey:
    """The prefix-cache key of a full block holding ``token_ids`` after the block keyed ``parent``
    (None for a sequence's first block): ``sha256`` of a domain tag, the parent's key (or a marker
    for none), the salt (a marker for none, else its length and bytes; a str counts as its UTF-8) and
    the token count then each id as a little-endian int64. Every field has a fixed width or a length
    prefix, so two different ``(parent, token_ids, cache_salt)`` never encode alike."""
    op = "kernel_ladder.serving.block_key"
    if parent is not None and not (isinstance(parent, bytes) and len(parent) == _KEY_BYTES):
        raise TypeError(f"{op}: parent must be a {_KEY_BYTES}-byte BlockKey or None (a key block_key made), got "
                        f"{type(parent).__name__}")
    salt = check_cache_salt(cache_salt, op)
    tokens = check_token_ids(token_ids, op)
    try:
        packed = struct.pack(f"<q{len(tokens)}q", len(tokens), *tokens)
    except struct.error:
        bad = next(t for t in tokens if not -2**63 <= t < 2**63)
        raise ValueError(f"{op}: token ids must fit int64, got {bad}") from None
    digest = hashlib.sha256(_KEY_DOMAIN)
    digest.update(b"\0" if parent is None else b"\1" + parent)
    digest.update(b"\0" if salt is None else b"\1" + struct.pack("<q", len(salt)) + salt)
    digest.update(packed)
    return digest.digest()


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


def _check_key(key: object, method: str) -> None:
    if not (isinstance(key, bytes) and len(key) == _KEY_BYTES):
        raise TypeError(f"{_OP}.{method}: key must be a {_KEY_BYTES}-byte BlockKey (what block_key returns), got "
                        f"{type(key).__name__}")


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
            raise ValueError(f"{_OP}: num_blocks must be a positive int, got {num_blocks!r}")
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
        return self._refcount[self._check_block(block, "refcount")]

    def _check_block(self, block: object, method: str) -> int:
        """``block`` as an int in ``[0, num_blocks)``, else a TypeError or ValueError naming ``method``
        (a negative id would otherwise index from the end of the pool: another block)."""
        where = f"{_OP}.{method}: block must be"
        if isinstance(block, bool) or not hasattr(block, "__index__"):
            raise TypeError(f"{where} an int in [0, {self.num_blocks}), got {type(block).__name__} {block!r}")
        block = operator.index(block)
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"{where} in [0, {self.num_blocks}), got {block}")
        return block

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
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{_OP}.allocate_many: n must be an int >= 0, got {n!r}")
        if n > self.num_free:
            raise KVCacheOutOfBlocks(n, self.num_free, f"allocating {n} blocks")
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        """One more reference to ``block``: a used block (sharing) or an evictable one (a prefix hit)."""
        block = self._check_block(block, "incref")
        if self._refcount[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"{_OP}.incref: block {block} is free; allocate() it instead")
            del self._evictable[block]
        self._refcount[block] += 1

    def decref(self, block: int) -> bool:
        """One reference fewer; at zero the block becomes evictable (if prefix-cached) or free.
        Returns whether it lost its last reference."""
        block = self._check_block(block, "decref")
        if self._refcount[block] <= 0:
            raise ValueError(f"{_OP}.decref: block {block} has no reference to drop")
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
        """Record that used ``block`` holds the full block ``key`` (a :func:`block_key` digest).
        Returns False (and records nothing) if another block already holds that key or this block
        already has one."""
        block = self._check_block(block, "register")
        _check_key(key, "register")
        if self._refcount[block] == 0:
            raise ValueError(f"{_OP}.register: block {block} is not in use")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding the full block ``key`` (used or evictable), or None."""
        _check_key(key, "lookup")
        return self._block_of.get(key)

    def key_of(self, block: int) -> BlockKey | None:
        """The prefix-cache key ``block`` is registered under, or None."""
        return self._key_of.get(self._check_block(block, "key_of"))

    def forget(self, block: int) -> None:
        """Drop ``block``'s prefix-cache key, if it has one: its contents are not what the key says
        (a model step that was to write them failed). Unreferenced, it becomes plainly free."""
        block = self._check_block(block, "forget")
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)
        self._forget(block)

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

