"""The paged KV cache: every layer's K and V (or latent vector) in blocks, and each sequence's block table
and length.

:class:`PagedKVCache` hands out **slots** (``block * block_size + offset``) for a sequence's next
tokens — the ``slot_mapping`` that :func:`kernel_ladder.write_kv_cache` writes through —
allocating blocks from its :class:`~kernel_ladder.serving.block_pool.BlockAllocator` as the
sequence grows, sharing blocks between forked sequences (copy-on-write) and between prompts with a
common prefix (prefix caching), and builds the ``block_tables`` and ``seq_lens`` that
:func:`kernel_ladder.paged_attention` reads.

What a layer stores per token is its :class:`CacheSpec`: K ``(Hkv, D)`` and V ``(Hkv, Dv)`` (multi-head,
grouped-query and multi-query attention), or one latent vector of ``kv_lora_rank + rope_dim`` features
shared by every head (DeepSeek's multi-head latent attention, written by ``kernel_ladder.write_latent_cache``
and read by ``kernel_ladder.mla_attention``). A model says what each of its layers holds
(``model.cache_spec()``); the cache allocates one tensor per kind of layer, and every block operation
(copy-on-write, gather) moves all of them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .block_pool import BlockAllocator, BlockKey, KVCacheOutOfBlocks, block_key, check_cache_salt, check_token_ids

__all__ = ["CacheSpec", "PagedKVCache"]

_OP = "kernel_ladder.serving.PagedKVCache"


@dataclass
class _Sequence:
    """One sequence's view of the cache."""

    block_table: list[int]
    length: int  # tokens whose slots were handed out (cached or being written this step)
    token_ids: list[int] | None  # known tokens (prompt, then appended), None if not prefix-caching
    block_keys: list[BlockKey] = field(default_factory=list)  # the key of each full block, in order
    cache_salt: bytes | None = None  # part of every key: sequences of different salts share no block


def _check_size(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class CacheSpec:
    """What one layer's cache holds per token: build it with :meth:`kv` or :meth:`latent`.

    * ``kind="kv"``: a key ``(num_kv_heads, head_dim)`` and a value ``(num_kv_heads, v_head_dim)``
      (``v_head_dim`` defaults to ``head_dim``), the tensors :func:`kernel_ladder.write_kv_cache` writes.
    * ``kind="latent"``: one vector of ``kv_lora_rank + rope_dim`` features per token for all heads:
      the normalized compressed KV then the rotated shared RoPE key (DeepSeek-V2/V3's MLA).
    """

    kind: str
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0

    @classmethod
    def kv(cls, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> CacheSpec:
        """K ``(num_kv_heads, head_dim)`` and V ``(num_kv_heads, v_head_dim or head_dim)`` per token."""
        op = f"{_OP.rsplit('.', 1)[0]}.CacheSpec.kv"
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            _check_size(op, name, value)
        return cls("kv", num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)

    @classmethod
    def latent(cls, kv_lora_rank: int, rope_dim: int) -> CacheSpec:
        """One ``(kv_lora_rank + rope_dim,)`` vector per token, shared by every head (MLA)."""
        op = f"{_OP.rsplit('.', 1)[0]}.CacheSpec.latent"
        _check_size(op, "kv_lora_rank", kv_lora_rank)
        _check_size(op, "rope_dim", rope_dim)
        return cls("latent", kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The per-token shape of each tensor the layer keeps: ``{"k": …, "v": …}`` or ``{"latent": …}``."""
        if self.kind == "latent":
            return {"latent": (self.kv_lora_rank + self.rope_dim,)}
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.v_head_dim)}

    def elements_per_token(self) -> int:
        """Cached numbers per token in one layer."""
        return sum(math.prod(shape) for shape in self.shapes().values())

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes per token in one layer at ``dtype``."""
        return self.elements_per_token() * torch.empty((), dtype=dtype).element_size()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """The caches of every layer, split into blocks, and each sequence's blocks and length.

    Built with ``num_kv_heads`` and ``head_dim`` (every layer a K and a V of ``(Hkv, D)``) or with
    ``spec`` (a :class:`CacheSpec` for every layer, or a list of one per layer). Layers of the same
    spec share one tensor ``(num_layers_of_that_spec, num_blocks, block_size, *per_token_shape)``; when
    every layer holds the same K/V, :attr:`k` and :attr:`v` are those ``(num_layers, num_blocks, block_size,
    Hkv, D)`` tensors. :meth:`k_cache` / :meth:`v_cache` give one layer's ``(num_blocks, block_size, Hkv, D)``
    view, what :func:`kernel_ladder.write_kv_cache` and paged attention take; :meth:`latent_cache` an MLA
    layer's ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` view. A sequence's token at position
    ``p`` lives at slot ``block_table[p // block_size] * block_size + p % block_size`` in every layer.

    Sequence ids are any hashable values. Blocks beyond a sequence's length may be reserved
    (:meth:`allocate` reserves a whole prompt's blocks), so prefilling it in chunks never runs out.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 *, spec: CacheSpec | Sequence[CacheSpec] | None = None) -> None:
        """Allocate the caches (zero-filled) and an empty pool of ``num_blocks`` blocks."""
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size)):
            _check_size(_OP, name, value)
        if spec is None:
            if num_kv_heads is None or head_dim is None:
                raise ValueError(f"{_OP}: give num_kv_heads and head_dim, or spec (a CacheSpec per layer), "
                                 f"got num_kv_heads={num_kv_heads!r}, head_dim={head_dim!r}, spec=None")
            _check_size(_OP, "num_kv_heads", num_kv_heads)
            _check_size(_OP, "head_dim", head_dim)
            specs = [CacheSpec.kv(num_kv_heads, head_dim)] * num_layers
        else:
            if num_kv_heads is not None or head_dim is not None:
                raise ValueError(f"{_OP}: give spec or num_kv_heads and head_dim, not both")
            specs = [spec] * num_layers if isinstance(spec, CacheSpec) else list(spec)
            if len(specs) != num_layers or not all(isinstance(s, CacheSpec) for s in specs):
                raise ValueError(f"{_OP}: spec must be a CacheSpec or a list of {num_layers} (one per layer), got "
                                 f"{spec!r}")
        if num_blocks * block_size > 2**31 - 1:
            raise ValueError(f"{_OP}: num_blocks * block_size = {num_blocks * block_size} slots do not fit "
                             "the int32 slot mapping")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.specs: list[CacheSpec] = specs
        uniform_kv = all(s == specs[0] for s in specs) and specs[0].kind == "kv"
        # the sizes of a uniform K/V cache (what chapter 08's lessons print), None otherwise
        self.num_kv_heads = specs[0].num_kv_heads if uniform_kv else None
        self.head_dim = specs[0].head_dim if uniform_kv else None
        self.dtype, self.device = dtype, torch.device(device)
        # one group of tensors per distinct spec; layer -> (group, index in the group)
        self._groups: list[tuple[CacheSpec, dict[str, torch.Tensor]]] = []
        self._where: list[tuple[int, int]] = []
        members: dict[CacheSpec, list[int]] = {}
        for layer, layer_spec in enumerate(specs):
            members.setdefault(layer_spec, []).append(layer)
        group_of = {layer_spec: g for g, layer_spec in enumerate(members)}
        for layer_spec, layers in members.items():
            self._groups.append((layer_spec, {
                name: torch.zeros((len(layers), num_blocks, block_size, *shape), dtype=dtype, device=self.device)
                for name, shape in layer_spec.shapes().items()}))
        counts: dict[CacheSpec, int] = {}
        for layer_spec in specs:
            self._where.append((group_of[layer_spec], counts.get(layer_spec, 0)))
            counts[layer_spec] = counts.get(layer_spec, 0) + 1
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[Hashable, _Sequence] = {}

    # --- the tensors

    def _whole(self, name: str) -> torch.Tensor:
        if len(self._groups) != 1 or name not in self._groups[0][1]:
            kinds = sorted({s.kind for s in self.specs})
            raise AttributeError(f"{_OP}: .{name} is the one {name!r} tensor of a cache whose layers all hold the "
                                 f"same {name!r}; this cache's layers hold {kinds} of {len(self._groups)} "
                                 f"shape(s): use {name}_cache(layer) / tensor({name!r}, layer)")
        return self._groups[0][1][name]

    @property
    def k(self) -> torch.Tensor:
        """Every layer's keys, ``(num_layers, num_blocks, block_size, Hkv, D)`` (layers all of one K/V spec)."""
        return self._whole("k")

    @property
    def v(self) -> torch.Tensor:
        """Every layer's values, ``(num_layers, num_blocks, block_size, Hkv, Dv)`` (layers all of one K/V spec)."""
        return self._whole("v")

    @property
    def latent(self) -> torch.Tensor:
        """Every layer's latent vectors, ``(num_layers, num_blocks, block_size, L + R)`` (all layers MLA)."""
        return self._whole("latent")

    def tensor(self, name: str, layer: int) -> torch.Tensor:
        """Layer ``layer``'s ``name`` cache (``"k"``, ``"v"`` or ``"latent"``): a ``(num_blocks, block_size, …)``
        view."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"{_OP}: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        group, index = self._where[layer]
        spec, tensors = self._groups[group]
        if name not in tensors:
            raise KeyError(f"{_OP}: layer {layer} holds {sorted(tensors)} ({spec.kind} cache), not {name!r}")
        return tensors[name][index]

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s key cache, a ``(num_blocks, block_size, Hkv, D)`` view."""
        return self.tensor("k", layer)

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s value cache, a ``(num_blocks, block_size, Hkv, Dv)`` view."""
        return self.tensor("v", layer)

    def latent_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent cache (MLA), a ``(num_blocks, block_size, kv_lora_rank + rope_dim)`` view."""
        return self.tensor("latent", layer)

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over every layer."""
        return sum(spec.bytes_per_token(self.dtype) for spec in self.specs)

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
            raise KeyError(f"{_OP}: no sequence {seq_id!r} (allocate() it first)") from None

    # --- allocation

    def allocate(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None,
                 cache_salt: str | bytes | None = None) -> int:
        """Start sequence ``seq_id`` and reserve blocks for its first ``num_tokens`` tokens.

        With ``token_ids`` (the prompt, ``num_tokens`` of them) the prefix cache is consulted: the
        longest run of leading full blocks already cached is reused (shared, not copied), and the
        sequence's full blocks are registered as they fill. At least one token is always left to
        compute (the model needs the last prompt token's output to sample), so a prompt that is
        entirely cached reuses all but its last block. ``cache_salt`` (a str or bytes) goes into
        every key of the sequence's blocks: only sequences with the same salt (or none) share blocks
        (:func:`~kernel_ladder.serving.block_pool.block_key`).

        Returns the number of tokens already in the cache: the sequence's length starts there, and
        the caller prefills only the rest (with :meth:`append_slots`). Raises
        :class:`KVCacheOutOfBlocks` (and changes nothing) if the blocks do not fit.
        """
        salt = check_cache_salt(cache_salt, f"{_OP}.allocate")
        result = self.try_allocate(seq_id, num_tokens, token_ids, salt)
        if result is None:
            hits = self._prefix_hits(token_ids, num_tokens, salt) if token_ids is not None else []
            needed = self.blocks_for(num_tokens) - len(hits)
            evictable_hits = sum(1 for block, _ in hits if self.allocator.refcount(block) == 0)
            raise KVCacheOutOfBlocks(needed, self.num_free_blocks - evictable_hits,
                                     f"sequence {seq_id!r} ({num_tokens} tokens)")
        return result

    def try_allocate(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None,
                     cache_salt: str | bytes | None = None) -> int | None:
        """:meth:`allocate`, but returns None (and changes nothing) when the blocks do not fit."""
        op = f"{_OP}.allocate"
        if seq_id in self._seqs:
            raise ValueError(f"{op}: sequence {seq_id!r} already exists")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"{op}: num_tokens must be an int >= 0, got {num_tokens!r}")
        salt = check_cache_salt(cache_salt, op)
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, op)
            if len(token_ids) != num_tokens:
                raise ValueError(f"{op}: token_ids has {len(token_ids)} ids, num_tokens is {num_tokens}")
        hits = self._prefix_hits(token_ids, num_tokens, salt) if token_ids is not None else []
        new = self.blocks_for(num_tokens) - len(hits)
        # Reviving an evictable hit takes it out of the pool new blocks come from.
        if new > self.num_free_blocks - sum(1 for block, _ in hits if self.allocator.refcount(block) == 0):
            return None
        for block, _ in hits:
            self.allocator.incref(block)
        table = [block for block, _ in hits] + self.allocator.allocate_many(new)
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Sequence(table, cached, token_ids, [key for _, key in hits], salt)
        return cached

    def _prefix_hits(self, token_ids: Sequence[int], num_tokens: int,
                     salt: bytes | None) -> list[tuple[int, BlockKey]]:
        """(block, key) of the leading full blocks of ``token_ids`` found in the prefix cache,
        leaving at least the last token uncached."""
        hits: list[tuple[int, BlockKey]] = []
        parent: BlockKey | None = None
        bs = self.block_size
        for i in range(max(0, num_tokens - 1) // bs):
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs], salt)
            block = self.allocator.lookup(parent)
            if block is None:
                break
            hits.append((block, parent))
        return hits

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
        op = f"{_OP}.append_slots"
        seq = self._seq(seq_id)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{op}: n must be an int >= 0, got {n!r}")
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, op)
            if len(token_ids) != n:
                raise ValueError(f"{op}: token_ids has {len(token_ids)} ids, n is {n}")
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
            for _, tensors in self._groups:
                for tensor in tensors.values():
                    tensor[:, new, :filled] = tensor[:, old, :filled]
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
                    if seq.token_ids[position] != token:
                        raise ValueError(f"{_OP}.append_slots: token {token} at "
                                         f"position {position} differs from the prompt's {seq.token_ids[position]}")
                else:
                    seq.token_ids.append(token)
        if len(seq.token_ids) < seq.length:  # tokens of unknown ids were appended: stop prefix caching it
            seq.token_ids = None
            return
        bs = self.block_size
        while (len(seq.block_keys) + 1) * bs <= seq.length:
            i = len(seq.block_keys)
            key = block_key(seq.block_keys[-1] if seq.block_keys else None, seq.token_ids[i * bs:(i + 1) * bs],
                            seq.cache_salt)
            self.allocator.register(seq.block_table[i], key)  # False: another block holds it (stays unkeyed)
            seq.block_keys.append(key)

    # --- sharing and freeing

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares every block (beam search,
        parallel sampling): no data moves; each block gains a reference, and whichever sequence
        writes into a shared block first copies it (:meth:`append_slots`)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"{_OP}.fork: sequence {child_id!r} already exists")
        for block in parent.block_table:
            self.allocator.incref(block)
        self._seqs[child_id] = _Sequence(list(parent.block_table), parent.length,
                                         None if parent.token_ids is None else list(parent.token_ids),
                                         list(parent.block_keys), parent.cache_salt)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shorten ``seq_id`` to its first ``num_tokens`` tokens (speculative decoding's rollback of
        rejected draft tokens): blocks past them lose this sequence's reference. A block registered
        in the prefix cache cannot be cut into (its contents are shared by its key)."""
        seq = self._seq(seq_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= seq.length:
            raise ValueError(f"{_OP}.truncate: num_tokens must be an int in [0, {seq.length}], "
                             f"got {num_tokens!r}")
        if len(seq.block_keys) * self.block_size > num_tokens:
            raise ValueError(f"{_OP}.truncate: sequence {seq_id!r} has {len(seq.block_keys)} blocks "
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
            raise KeyError(f"{_OP}.free: no sequence {seq_id!r}")
        # Last block first, so a prompt's leading blocks (the most reusable) are evicted last.
        for block in reversed(seq.block_table):
            self.allocator.decref(block)

    def forget_blocks(self, slots: torch.Tensor) -> None:
        """Take the blocks holding ``slots`` (a step's ``slot_mapping``) out of the prefix cache: a
        model step that was to write them failed, so their contents are not what their keys say.
        Full blocks are keyed when their slots are handed out, before the step writes them; without
        this a later prompt with the same prefix would reuse blocks that were never written."""
        for block in sorted(set((slots[slots >= 0].long() // self.block_size).tolist())):
            self.allocator.forget(block)

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

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, ...]:
        """``seq_id``'s history in ``layer`` (a copy, for tests and lessons): K and V, ``(length, Hkv, D)`` each,
        for a K/V layer; ``(latent,)``, ``(length, L + R)``, for an MLA layer."""
        seq = self._seq(seq_id)
        positions = torch.arange(seq.length)
        table = torch.tensor(seq.block_table, dtype=torch.int64)[positions // self.block_size]
        names = self.specs[layer].shapes() if 0 <= layer < self.num_layers else ("k",)
        return tuple(self.tensor(name, layer)[table, positions % self.block_size] for name in names)

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
                assert len(seq.block_keys) == seq.length // self.block_size, (
                    f"sequence {seq_id!r}: {len(seq.block_keys)} full blocks keyed, length {seq.length}")
                parent = None
                for i, key in enumerate(seq.block_keys):
                    parent = block_key(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size],
                                       seq.cache_salt)
                    assert key == parent, f"sequence {seq_id!r}: block {i}'s key does not match its tokens"
                    registered = self.allocator.key_of(seq.block_table[i])
                    assert registered in (None, key), (
                        f"sequence {seq_id!r}: block {i} is in the prefix cache under another key than its tokens'")
        self.allocator.check_invariants(references)
