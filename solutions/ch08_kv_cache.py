"""Solutions to chapter 08, the KV cache: slot mapping, the paged decode kernel's block-table walk,
the split-KV merge, copy-on-write, the scheduler's admission rule.

One solution per exercise of ``chapters/08_kv_cache/08_kv_cache.ipynb``, written for reading, and
what the chapter gives (the request mix, the memory accounting, the launcher of the paged decode
kernel, the float64 reference, the static-batching simulation) and, for each exercise's check, its
cases (adversarial ones included: slots and offsets past 2^31, scores near ±250 and ±800), the
rules its spec states, the diagnosis that names its common mistakes (each recomputed and compared)
and, for the decode kernel, its traffic verdict. The tests import the same givens, so the notebook
and its tests check the same things. In solution mode the notebook's stubs are replaced by these.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "request_mix",
    "contiguous_cache_bytes",
    "paged_cache_bytes",
    "slot_mapping",
    "slot_mapping_reference",
    "slot_mapping_cases",
    "slot_mapping_rules",
    "slot_mapping_mistakes",
    "diagnose_slot_mapping",
    "paged_inputs",
    "paged_reference",
    "paged_decode_kernel",
    "launch_paged_decode",
    "decode_cases",
    "FarCache",
    "cache_tensor",
    "with_table_reads",
    "decode_rules",
    "decode_traffic",
    "decode_mistakes",
    "diagnose_decode",
    "decode_ideal_bytes",
    "decode_top_bytes",
    "merge_partials",
    "split_attention",
    "merge_reference",
    "merge_cases",
    "merge_tolerance",
    "merge_mistakes",
    "diagnose_merge",
    "prepare_append",
    "prepare_append_reference",
    "prepare_append_cases",
    "diagnose_append",
    "APPEND_MISTAKES",
    "diagnose_append_cause",
    "admit",
    "admit_cases",
    "diagnose_admit",
    "ADMIT_MISTAKES",
    "diagnose_admit_cause",
    "admit_reference",
    "unmodified",
    "static_batching",
    "absorbed_scores",
    "absorbed_scores_reference",
    "absorbed_scores_cases",
    "absorbed_scores_rules",
    "absorbed_scores_mistakes",
    "diagnose_absorbed_scores",
    "absorbed_arithmetic",
    "count_arithmetic",
]


# ----------------------------------------------------------------------------------------------
# Given: a realistic mix of requests, and what a cache reserves for it
# ----------------------------------------------------------------------------------------------


def request_mix(num_requests: int, max_len: int = 4096, seed: int = 0) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` of ``num_requests`` chat-like requests, drawn reproducibly.

    Prompt and output lengths are log-normal (most requests short, a long tail), as in published
    serving traces; each total is clipped to ``max_len``. The exact shape does not matter for the
    lesson, only that lengths vary by orders of magnitude.
    """
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.exp(torch.randn(num_requests, generator=gen) * 1.0 + math.log(300)).clamp(4, max_len - 1)
    outputs = torch.exp(torch.randn(num_requests, generator=gen) * 0.8 + math.log(150)).clamp(1, None)
    mix = []
    for p, o in zip(prompts.tolist(), outputs.tolist()):
        p = int(p)
        mix.append((p, max(1, min(int(o), max_len - p))))
    return mix


def contiguous_cache_bytes(lengths: list[int], max_len: int, bytes_per_token: int) -> tuple[int, int]:
    """``(reserved, used)`` bytes of a cache that gives every sequence one ``max_len`` slab."""
    return len(lengths) * max_len * bytes_per_token, sum(lengths) * bytes_per_token


def paged_cache_bytes(lengths: list[int], block_size: int, bytes_per_token: int) -> tuple[int, int]:
    """``(reserved, used)`` bytes of a paged cache: each sequence holds ``ceil(len / block_size)`` blocks."""
    blocks = sum(-(-n // block_size) for n in lengths)
    return blocks * block_size * bytes_per_token, sum(lengths) * bytes_per_token


# ----------------------------------------------------------------------------------------------
# Exercise 1: slot mapping
# ----------------------------------------------------------------------------------------------


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat cache slot of each token: logical position ``p`` of a sequence lives in its
    ``p // block_size``-th block, physical block ``block_table[p // block_size]``, at offset
    ``p % block_size``; the cache viewed as ``(num_blocks * block_size, Hkv, D)`` holds it at row
    ``block * block_size + offset``. A negative position is padding: slot ``-1`` (skipped by
    ``kernel_ladder.write_kv_cache``)."""
    pad = positions < 0
    pos = positions.clamp(min=0).long()
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    return torch.where(pad, torch.full_like(slots, -1), slots).to(torch.int64)


def slot_mapping_reference(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same, one token at a time (what the check compares against)."""
    out = []
    for p in positions.tolist():
        out.append(-1 if p < 0 else int(block_table[p // block_size]) * block_size + p % block_size)
    return torch.tensor(out, dtype=torch.int64)


def slot_mapping_cases(gen: torch.Generator) -> list[tuple]:
    """Shuffled physical blocks, positions in any order, a block boundary, padding — and a pool of
    more than 2^31 slots: block ids from 2^27 up (an int32 table holds them), so that
    ``block * block_size`` passes 2^31 and wraps if it is computed in int32."""
    cases = []
    for block_size, num_blocks, used in ((16, 40, 5), (8, 64, 9), (32, 12, 3)):
        table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
        positions = torch.randint(0, used * block_size, (11,), generator=gen)
        positions[0], positions[1], positions[2] = block_size - 1, block_size, -1  # a boundary, padding
        cases.append((table, positions, block_size))
    table = torch.randint(2**27, 2**28, (4,), generator=gen).to(torch.int32)  # slots 2^31 .. 2^32
    positions = torch.randint(0, 4 * 16, (9,), generator=gen)
    positions[0] = -1
    cases.append((table, positions, 16))
    return cases


def slot_mapping_rules() -> list:
    """Exercise 1's stated rule: tensor ops only — no Python loop and no round trip through the host
    (``.tolist()``, ``.item()``): the slots feed ``kernel_ladder.write_kv_cache`` on the device, and a
    value taken to the host is a sync every step."""
    from utils.exercises import rules

    return [rules.tensor_ops_only(why="the spec asks for tensor ops only (no Python loop, no round trip through the "
                                      "host: the slots feed a kernel on the device)")]


def slot_mapping_mistakes(block_table: torch.Tensor, positions: torch.Tensor,
                          block_size: int) -> list[tuple[str, torch.Tensor]]:
    """What common wrong slot mappings return on a case, each with its cause (int64, padding kept at -1)."""
    pos = positions.long().clamp(min=0)
    pad = positions < 0
    block = block_table.long()[pos // block_size]
    offset = pos % block_size

    def padded(slots: torch.Tensor) -> torch.Tensor:
        return torch.where(pad, torch.full_like(slots, -1), slots)

    return [
        ("the block and the offset are swapped: the slot is block · block_size + offset (the block's first slot, "
         "then the token's place in it)", padded(offset * block_size + block)),
        ("the slots are the logical positions: the block table is not used (logical block p // block_size is "
         "physical block block_table[p // block_size])", padded(pos)),
        ("the block id is not multiplied by block_size: block + offset counts blocks and tokens in one unit",
         padded(block + offset)),
        ("the offset in the block (p % block_size) is missing: every token of a block gets its first slot",
         padded(block * block_size)),
        ("the offset in the block was computed with // (p // block_size, the block's index): the offset is "
         "p % block_size, the token's place in its block", padded(block * block_size + pos // block_size)),
    ]


def diagnose_slot_mapping(case: tuple, got, expected) -> str | None:
    """Exercise 1's cause: padding, slots past 2^31 wrapped (int32 arithmetic), or a known wrong formula."""
    block_table, positions, block_size = case
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    got, expected = got.detach().cpu().long(), expected.cpu().long()
    pad = positions.cpu() < 0
    if (got[pad] != -1).any():
        i = int((pad & (got != -1)).nonzero()[0, 0])
        return (f"position {int(positions[i])} is padding (negative), but its slot is {int(got[i])}: a negative "
                "position's slot is -1 (clamp the positions to 0 for the gather, then put -1 back with torch.where)")
    wrong = got != expected
    if wrong.any() and bool(((got[wrong] - expected[wrong]) % 2**32 == 0).all()):
        i = int(wrong.nonzero()[0, 0])
        return (f"slot {int(expected[i])} came out as {int(got[i])}: it is past 2^31 and wrapped around — "
                "block · block_size was computed in int32 (the table's dtype); convert the table to int64 first "
                "(block_table.long())")
    for cause, slots in slot_mapping_mistakes(block_table.cpu(), positions.cpu(), block_size):
        if torch.equal(got, slots):
            return cause
    return None


# ----------------------------------------------------------------------------------------------
# Given: paged inputs and the float64 reference (gather the blocks, then attention)
# ----------------------------------------------------------------------------------------------


def paged_inputs(seq_lens: list[int], n_q_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
                 spare_blocks: int = 3) -> tuple[torch.Tensor, ...]:
    """``(q, k_cache, v_cache, block_tables, seq_lens)`` for one decode step.

    Every sequence's blocks are scattered through the cache in a random order (a real cache is
    fragmented); unused block-table entries hold ``-1`` and unused cache slots random values, so
    a kernel that reads past a sequence's end, or through a padded entry, gives a wrong answer.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    q = torch.randn(len(seq_lens), n_q_heads, head_dim, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
            tables.to(device), lens.to(device))


def paged_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
    """Decode attention in float64: each sequence's K and V gathered from its blocks, then
    ``softmax(q Kᵀ / √D) V`` per query head, query head ``h`` reading kv head ``h // (Hq / Hkv)``."""
    k_cache, v_cache = cache_tensor(k_cache), cache_tensor(v_cache)
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    seq_lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    out = torch.empty(batch, n_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = seq_lens[b]
        blocks = block_tables[b, : -(-n // block_size)].long().cpu()
        k = k_cache[blocks.to(k_cache.device)].cpu().double().reshape(-1, n_kv_heads, head_dim)[:n]  # (n, Hkv, D)
        v = v_cache[blocks.to(v_cache.device)].cpu().double().reshape(-1, n_kv_heads, head_dim)[:n]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (n, Hq, D)
        scores = torch.einsum("hd,nhd->hn", q[b].cpu().double(), k) / math.sqrt(head_dim)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.device)


# ----------------------------------------------------------------------------------------------
# Exercise 2: the block-table walk of the paged decode kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,  # q, out: (B, Hq, D); caches: (num_blocks, block_size, Hkv, D)
    block_tables_ptr, seq_lens_ptr,  # (B, max_blocks) int32, (B,) int32
    scale, n_q_heads, n_kv_heads,
    stride_qb, stride_qh,  # q and out (the feature stride is 1)
    stride_kb, stride_kt, stride_kh,  # caches: physical block, token in the block, kv head
    stride_tb,  # block_tables: sequence
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One program per (sequence, query head): walk the sequence's block table, one cache block
    of ``BLOCK_SIZE`` tokens at a time, with the online softmax of chapter 07.

    Block ``j`` of sequence ``b`` holds its tokens ``j * BLOCK_SIZE ..``; its physical index comes
    from ``block_tables[b, j]`` (a load: the only indirection paging adds). Tokens past
    ``seq_lens[b]`` in the last block are masked; table entries past the last block are never read.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv_head = h // (n_q_heads // n_kv_heads)
    d = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + b)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)  # a 0-d running maximum
    l = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + b * stride_tb + j).to(tl.int64)
        valid = j * BLOCK_SIZE + tokens < seq_len
        rows = block * stride_kb + tokens[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + b * stride_qb + h * stride_qh + d, (acc / l).to(out_ptr.dtype.element_ty))


def launch_paged_decode(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One program per (sequence, query head); ``out`` is written in place and returned. The caches
    may come as :class:`FarCache` (a check's case): the kernel gets the tensor it holds."""
    k_cache, v_cache = cache_tensor(k_cache), cache_tensor(v_cache)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or out.stride() != q.stride():
        raise ValueError("the chapter's decode kernel takes q, out and caches with unit feature stride, "
                         "q and out alike")
    batch, n_q_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    kernel[(batch, n_q_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        1.0 / math.sqrt(head_dim), n_q_heads, n_kv_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return out


class FarCache:
    """A paged cache whose physical blocks lie ``2^20`` elements apart: block 2048 starts at element
    2^31, so a kernel that computes ``block * stride_kb`` in int32 (the block id as loaded from an
    int32 table) wraps around and reads outside the cache, while one that converts the block id to
    int64 first reads the right block.

    The tensor is a view over sparse virtual memory (an anonymous ``mmap``: only the pages of the
    blocks in use are ever touched, a few kB, though the view spans 4 GiB), so the check reaches
    2^31 without the memory. It is a case argument, not a tensor, so that the checker neither copies
    it between guards nor upcasts it for the reference; :func:`launch_paged_decode` and
    :func:`paged_reference` take the tensor out (:func:`cache_tensor`). The tracer still sees every
    access, so a wrapped offset is an out-of-bounds read, blocked and counted.
    """

    BLOCK_STRIDE = 1 << 20
    FAR_BLOCK = (1 << 31) // BLOCK_STRIDE  # the first block past 2^31 elements

    def __init__(self, tensor: torch.Tensor, memory: object = None):
        self.tensor = tensor
        self._memory = memory  # keeps the mapping alive as long as the case

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def __repr__(self) -> str:
        num_blocks, block_size, n_kv_heads, head_dim = self.tensor.shape
        dtype = str(self.tensor.dtype).removeprefix("torch.")
        return f"FarCache({num_blocks}×{block_size}×{n_kv_heads}×{head_dim} {dtype})"

    @classmethod
    def pair(cls, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device | str) -> tuple[FarCache, FarCache] | None:
        """K and V caches of ``FAR_BLOCK + 2`` blocks, interleaved in one sparse mapping (V's block
        ``i`` just after K's), or None where such a mapping cannot be made."""
        import mmap

        block = block_size * n_kv_heads * head_dim
        num_blocks = cls.FAR_BLOCK + 2
        elements = (num_blocks - 1) * cls.BLOCK_STRIDE + 2 * block
        shape, strides = (num_blocks, block_size, n_kv_heads, head_dim), (cls.BLOCK_STRIDE, n_kv_heads * head_dim,
                                                                        head_dim, 1)
        try:
            if torch.device(device).type == "cpu":
                size = elements * torch.empty((), dtype=dtype).element_size()
                if hasattr(mmap, "MAP_PRIVATE"):  # private and unreserved: untouched pages cost nothing
                    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0))
                else:
                    memory = mmap.mmap(-1, size)
                flat = torch.frombuffer(memory, dtype=dtype)
            else:
                memory, flat = None, torch.empty(elements, dtype=dtype, device=device)
        except (OSError, ValueError, OverflowError, MemoryError, RuntimeError):
            return None
        k = flat.as_strided(shape, strides, 0)
        v = flat.as_strided(shape, strides, block)
        return cls(k, memory), cls(v, memory)


def cache_tensor(cache: torch.Tensor | FarCache) -> torch.Tensor:
    """The tensor a case's cache argument holds (itself, or a :class:`FarCache`'s view)."""
    return cache.tensor if isinstance(cache, FarCache) else cache


def _extreme_scores_case(gen: torch.Generator, device: torch.device | str) -> tuple:
    """Scores the online softmax must survive, fp32: sequence 0's all near −250 (a running maximum
    started at 0 underflows every exp to 0, and 0 / 0 is NaN), sequence 1's near +200 in its first
    block and near +10 after it (the maximum falls between blocks: rescaling by the tile's own
    maximum multiplies by exp(190) = inf; no maximum at all overflows exp(200)); sequence 2's
    ordinary. Whole blocks, no spare ones: the traffic verdict is measured on this case, and each
    cached token is then read once per program that needs it, nothing else.

    A score of 250 computed in fp32 is off by about 250 · 2^-24 — more than the check's tolerance
    once exponentiated — so these scores are exact instead: ``D = 16`` (``scale = 1/4``), the
    queries of sequences 0 and 1 are ``4`` on feature 0 and 0 elsewhere, and each key's feature 0 is
    its score, a half-integer (exact in fp32, and in a GPU's TF32 dots too). A kernel that exponentiates
    in base 2 (``exp2(s · log2 e)``, as the library's does) still rounds ``s · log2 e``: its weights
    are off by about 1e-5, so these sequences' values are ``1 ± 0.05``, where that is far inside the
    tolerance (a NaN is not)."""
    lens, hq, hkv, head_dim, block_size = [48, 32, 16], 4, 2, 16, 16
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    q, k_cache, v_cache, tables, _ = paged_inputs(lens, hq, hkv, head_dim, block_size, seed=seed, spare_blocks=0)
    noise = torch.Generator().manual_seed(seed + 1)
    q[:2] = 0.0
    q[:2, :, 0] = math.sqrt(head_dim)
    for b, target in ((0, lambda t: -250.0), (1, lambda t: 200.0 if t < block_size else 10.0)):
        for t in range(lens[b]):
            block, slot = int(tables[b, t // block_size]), t % block_size
            k_cache[block, slot, :, 0] = target(t) + torch.randint(-6, 7, (hkv,), generator=noise) / 2
            v_cache[block, slot] = 1.0 + 0.05 * torch.randn(hkv, head_dim, generator=noise)
    tables = torch.cat([tables, torch.full((len(lens), 1), -1, dtype=torch.int32)], dim=1)
    return q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device), lens


def _far_blocks_case(gen: torch.Generator, device: torch.device | str) -> tuple | None:
    """fp16 caches whose blocks lie 2^20 elements apart (:class:`FarCache`), two sequences whose
    tables use blocks 2048 and 2049 — past 2^31 elements — and two low ones."""
    lens, hq, hkv, head_dim, block_size = [30, 20], 2, 1, 16, 16
    pair = FarCache.pair(block_size, hkv, head_dim, torch.float16, device)
    if pair is None:
        return None
    k_far, v_far = pair
    low = torch.randperm(FarCache.FAR_BLOCK, generator=gen)[:2].tolist()
    blocks = [low[0], FarCache.FAR_BLOCK, FarCache.FAR_BLOCK + 1, low[1]]
    order = torch.randperm(4, generator=gen).tolist()
    tables = torch.tensor([[blocks[order[0]], blocks[order[1]], -1], [blocks[order[2]], blocks[order[3]], -1]],
                          dtype=torch.int32)
    for block in blocks:
        k_far.tensor[block] = torch.randn(block_size, hkv, head_dim, generator=gen).to(device, torch.float16)
        v_far.tensor[block] = torch.randn(block_size, hkv, head_dim, generator=gen).to(device, torch.float16)
    q = torch.randn(len(lens), hq, head_dim, generator=gen).to(device, torch.float16)
    return q, k_far, v_far, tables.to(device), lens


def decode_cases(gen: torch.Generator) -> list[tuple]:
    """Exercise 2's cases: lengths 1, exactly a block and one past it, GQA and MQA, fp32 and bf16;
    in the interpreter, fp16 caches whose blocks lie past 2^31 elements (:class:`FarCache`: the
    tracer blocks the stray reads a wrapped int32 offset makes; a GPU has no such net, so it runs
    without that case); last, scores near −250 and +200 with a maximum that falls between blocks
    (:func:`_extreme_scores_case`), the case the traffic is measured on. Every block table has one
    more column of ``-1`` than its longest sequence needs, so a walk one block too far stays
    inside the table (the rule of :func:`decode_rules` names it).

    ``seq_lens`` comes as a list (so that a NOT SOLVED verdict prints the lengths); the candidate
    turns it into the int32 tensor the kernel takes."""
    device = kernel_ladder.runtime.DEVICE
    cases = []
    for lens, hq, hkv, block_size, dtype in (([1, 16, 17, 40], 4, 2, 16, torch.float32),
                                             ([8, 3, 25], 4, 1, 8, torch.float32),
                                             ([33, 64], 2, 2, 32, torch.bfloat16)):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        q, k_cache, v_cache, tables, _ = paged_inputs(lens, hq, hkv, 32, block_size, dtype=dtype,
                                                      device=device, seed=seed)
        tables = torch.cat([tables, torch.full((len(lens), 1), -1, dtype=torch.int32, device=device)], dim=1)
        cases.append((q, k_cache, v_cache, tables, lens))  # seq_lens as a list: the verdict shows it
    far = _far_blocks_case(gen, device) if kernel_ladder.runtime.INTERPRETER else None
    if far is not None:
        cases.append(far)
    cases.append(_extreme_scores_case(gen, device))
    return cases


def with_table_reads(paged_decode):
    """Exercise 2's candidate wrapper: ``paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out)``
    run under a trace that records which elements each launch read (the tracer's access maps), so
    that the rule of :func:`decode_rules` can say which block-table entries the walk visited. The
    launches it records are the check's own (traces nest), so nothing runs twice."""
    import functools

    @functools.wraps(paged_decode)
    def run(q, k_cache, v_cache, block_tables, seq_lens, out):
        if not kernel_ladder.runtime.INTERPRETER:
            return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out)
        from utils.trace import trace  # the course's tracer: its access maps

        with trace(record_access=True, torch_ops=False, block_out_of_bounds=True):
            return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out)

    return run


def _table_reads(launch, block_tables: torch.Tensor):
    """The access map of ``block_tables`` in one traced launch (the kernel's ``block_tables_ptr``), or None."""
    read = launch.access.get("block_tables_ptr")
    if read is not None and tuple(read.shape) == tuple(block_tables.shape):
        return read
    spans = getattr(launch, "spans", {}) or {}
    for name, (low, _) in spans.items():
        if low == block_tables.data_ptr() and name in launch.access:
            return launch.access[name]
    return None


def _walks_its_blocks(args: tuple, launches) -> str | None:
    """The spec's "visit the blocks 0 .. ceil(seq_len / BLOCK_SIZE) − 1 only", from the access maps."""
    q, k_cache, _, block_tables, seq_lens = args
    block_size = cache_tensor(k_cache).shape[1]
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    maps = [read for read in (_table_reads(launch, block_tables) for launch in launches) if read is not None]
    if not maps:
        return ("the block-table reads were not recorded: run the candidate as given.with_table_reads(paged_decode) "
                "so that the tracer keeps its access maps")
    for read in maps:
        for b, n in enumerate(lens):
            used = -(-n // block_size)
            past = (read[b, used:] >= 0).nonzero()[0]
            if past.size:
                j = used + int(past[0])
                tokens, blocks = f"{n} token{'s' * (n != 1)}", f"{used} block{'s' * (used != 1)}"
                return (f"sequence {b} ({tokens}: ceil({n} / {block_size}) = {blocks}) read block_tables[{b}, {j}] "
                        "— the walk goes one block too far: loop j over range(0, tl.cdiv(seq_len, BLOCK_SIZE)); the "
                        "entries past a sequence's blocks are -1, and past the table's end lies other memory")
    return None


def _step(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step (ulp) of ``dtype`` at each float64 ``value``'s magnitude (its subnormals' step near 0)."""
    digits = round(-math.log2(torch.finfo(dtype).eps))  # explicit mantissa bits: 7 for bf16, 10 for fp16
    lowest = math.frexp(torch.finfo(dtype).smallest_normal)[1] - 1 - digits  # the subnormals' step, as a power of 2
    _, exponent = torch.frexp(value.abs().clamp_min(torch.finfo(dtype).smallest_normal))
    return torch.ldexp(torch.ones_like(value), (exponent - 1 - digits).clamp_min(lowest))


def _computed_in_fp32(case: tuple, got) -> str | None:
    """The spec's "compute in fp32 whatever the cache dtype": in a 16-bit case every output element is
    within one step of its dtype of the exact attention. fp32 arithmetic rounded once at the store
    is (half a step); scores summed in bf16 or fp16 are several steps off."""
    q = case[0]
    if q.dtype not in (torch.float16, torch.bfloat16) or not isinstance(got, torch.Tensor):
        return None
    exact = paged_reference(*case).cpu().double()
    allowed = _step(exact, q.dtype) + 1e-6 * (1.0 + exact.abs())  # one step, and fp32's own rounding
    error = (got.detach().cpu().double() - exact).abs()
    far = error > allowed
    if not bool(far.any()):
        return None
    worst = int((error / allowed).flatten().argmax())
    name = str(q.dtype).removeprefix("torch.")
    return (f"{int(far.sum())} of {far.numel()} outputs of this {name} case are more than one {name} step from the "
            f"exact attention (worst: {float(got.flatten()[worst]):.6g}, exact {float(exact.flatten()[worst]):.6g}, "
            f"{float((error / _step(exact, q.dtype)).flatten()[worst]):.0f} steps): the arithmetic ran in {name} — "
            ".to(tl.float32) after each load, round once at the store")


def decode_rules() -> list:
    """Exercise 2's stated rules beyond the values: the walk reads only the sequence's table entries
    (a walk one block too far computes the right values — its extra block is all masked — but reads
    an entry that is -1, or past the table's end), and the arithmetic is fp32 whatever the cache's
    dtype (scores summed in bf16 stay inside bf16's tolerance, but not within one step of the exact
    answer)."""
    from utils.exercises import rules

    return [rules.traced(_walks_its_blocks, name="visit the blocks 0 .. ceil(seq_len / BLOCK_SIZE) − 1 only"),
            rules.holds(_computed_in_fp32, name="compute in fp32 whatever the cache dtype")]


def _decode_explain(reread: dict[str, float]) -> str | None:
    factor = max(reread.get("k_cache", 0.0), reread.get("v_cache", 0.0))
    if factor > 1.05:
        return (f"each query head's program streams its kv head's blocks, so K and V are read once per query head "
                f"of a group ({factor:.0f}× here); section 4's kernel loads each block once for the whole group")
    return None


def decode_traffic():
    """Exercise 2's traffic verdict: :func:`decode_ideal_bytes` against ``kernel_ladder.paged_attention``'s."""
    from utils.exercises import Traffic

    return Traffic(ideal=decode_ideal_bytes, top=decode_top_bytes, explain=_decode_explain)


def decode_mistakes(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                    seq_lens) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Common wrong decode kernels, each as ``(cause, what it computes)``: exercise 2's walk
    emulated in float32, block by block, with one mistake — an emulation, so that NaN and inf come
    out where a kernel's fp32 arithmetic makes them."""
    k_cache, v_cache = cache_tensor(k_cache), cache_tensor(v_cache)
    n_q_heads, n_kv_heads = q.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]

    def walk(**mistake):
        return lambda: _emulated_decode(q, k_cache, v_cache, block_tables, lens, **mistake)

    return [
        ("the block table is not used: block j of the sequence is read as physical block j (load "
         "block_tables[b, j] and address that block)", walk(logical_blocks=True)),
        ("the tokens past seq_len in the last block are attended: mask them (valid = j * BLOCK_SIZE + tokens < "
         "seq_len) in the loads and set their scores to -inf", walk(tail="read")),
        ("the tokens past seq_len in the last block get score 0 (their loads are masked, their scores are not): "
         "set the scores of invalid tokens to -inf", walk(tail="zero")),
        ("the last, partial block is never visited: the loop must run ceil(seq_len / BLOCK_SIZE) blocks "
         "(tl.cdiv), not seq_len // BLOCK_SIZE", walk(blocks="floor")),
        (f"query head h reads kv head h % n_kv_heads: the {group} query heads of a group are consecutive, so head h "
         "reads kv head h // (n_q_heads // n_kv_heads)", walk(kv_head=lambda h: h % n_kv_heads)),
        ("the scores are not scaled: multiply q · k by scale (1 / √D)", walk(scale=1.0)),
        ("the running sum l is not rescaled: l = l * alpha + sum(p) — alpha = exp(m - m_new) rescales l as well "
         "as acc when the maximum grows", walk(rescale_l=False)),
        ("the accumulator is not rescaled: acc = acc * alpha + sum(p * v) — alpha = exp(m - m_new) rescales acc "
         "as well as l when the maximum grows", walk(rescale_acc=False)),
        ("the running maximum starts at 0, not -inf: when every score is far below 0 (here near −250), "
         "exp(s - 0) underflows to 0 and acc / l is 0 / 0", walk(m0=0.0)),
        ("each block is rescaled by its own maximum, not the running one: when the maximum falls between blocks "
         "(here from about 200 to 10), alpha = exp(m - m_new) = exp(190) overflows to inf — "
         "m_new = maximum(m, max(s))", walk(running_max=False)),
        ("exp is taken of the raw scores: with scores near 200, exp(s) overflows float32 (above 88.7) — subtract "
         "the running maximum (the online softmax)", walk(subtract_max=False)),
    ]


def _emulated_decode(q, k_cache, v_cache, block_tables, lens, *, logical_blocks=False, tail="mask", blocks="cdiv",
                     kv_head=None, scale=None, rescale_l=True, rescale_acc=True, m0=float("-inf"),
                     running_max=True, subtract_max=True) -> torch.Tensor:
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    tables = block_tables.cpu().long()
    out = torch.empty(batch, n_q_heads, head_dim, dtype=torch.float32)
    tokens = torch.arange(block_size)
    with torch.no_grad():
        for b in range(batch):
            n = lens[b]
            walked = -(-n // block_size) if blocks == "cdiv" else n // block_size
            cached = []
            for j in range(walked):
                physical = j if logical_blocks else int(tables[b, j])
                cached.append((k_cache[physical].cpu().float(), v_cache[physical].cpu().float(),
                               j * block_size + tokens < n))
            for h in range(n_q_heads):
                g = h // group if kv_head is None else kv_head(h)
                query = q[b, h].cpu().float()
                m = torch.tensor(m0)
                l = torch.tensor(0.0)
                acc = torch.zeros(head_dim)
                for k, v, valid in cached:
                    k, v = k[:, g], v[:, g]
                    if tail != "read":
                        k, v = torch.where(valid[:, None], k, 0.0), torch.where(valid[:, None], v, 0.0)
                    s = (k @ query) * scale
                    if tail == "mask":
                        s = torch.where(valid, s, float("-inf"))
                    if not subtract_max:
                        p = torch.exp(s)
                        l, acc = l + p.sum(), acc + p @ v
                        continue
                    m_new = torch.maximum(m, s.max()) if running_max else s.max()
                    alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
                    l = (l * alpha if rescale_l else l) + p.sum()
                    acc = (acc * alpha if rescale_acc else acc) + p @ v
                    m = m_new
                out[b, h] = acc / l
    return out


def _same_as(got: torch.Tensor, candidate: torch.Tensor, rtol: float, atol: float) -> bool:
    """``got`` equals ``candidate`` within a tolerance, NaN where it is NaN."""
    got, candidate = got.detach().cpu().double(), candidate.detach().cpu().double()
    return got.shape == candidate.shape and bool(torch.isclose(got, candidate, rtol=rtol, atol=atol,
                                                               equal_nan=True).all())


def diagnose_decode(case: tuple, got, expected) -> str | None:
    """Exercise 2's cause: which known mistake (:func:`decode_mistakes`) computes what the kernel
    wrote, or a query head reading another kv head, or an int32 offset past 2^31 (:class:`FarCache`),
    or bf16 arithmetic."""
    q, k_cache, v_cache, block_tables, seq_lens = case
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    rtol, atol = (2e-2, 2e-2) if q.dtype in (torch.float16, torch.bfloat16) else (1e-4, 1e-5)
    for cause, computed in decode_mistakes(q, k_cache, v_cache, block_tables, seq_lens):
        if _same_as(got, computed(), rtol, atol):
            return cause
    heads = _kv_heads_read(q, k_cache, v_cache, block_tables, seq_lens, got, rtol, atol)
    if heads is not None:
        return heads
    if isinstance(k_cache, FarCache):
        lens = list(seq_lens)
        block_size = k_cache.shape[1]
        bad = ~torch.isclose(got.detach().cpu().double(), expected.cpu().double(), rtol=rtol, atol=atol)
        far = [b for b in range(len(lens))
               if bad[b].any() and (block_tables[b, : -(-lens[b] // block_size)] >= FarCache.FAR_BLOCK).any()]
        if far:
            return (f"wrong for sequence(s) {far}, whose blocks lie past 2^31 elements (block "
                    f"{FarCache.FAR_BLOCK} starts at element 2^31 here): block * stride_kb wrapped around in "
                    "int32 — convert the loaded block id to int64 (.to(tl.int64)) before multiplying")
    if q.dtype in (torch.float16, torch.bfloat16):
        return (f"the earlier (fp32) cases pass and this {str(q.dtype).removeprefix('torch.')} one does not: compute "
                "in fp32 — .to(tl.float32) after each load — and store with .to(out_ptr.dtype.element_ty)")
    return None


def _kv_heads_read(q, k_cache, v_cache, block_tables, seq_lens, got, rtol, atol) -> str | None:
    """If every output row is attention over *some* kv head, and some row's is not the right one:
    which kv head each query head read."""
    n_q_heads, n_kv_heads = q.shape[1], cache_tensor(k_cache).shape[2]
    if n_kv_heads == 1:
        return None
    group = n_q_heads // n_kv_heads
    per_head = [_emulated_decode(q, cache_tensor(k_cache), cache_tensor(v_cache), block_tables, list(seq_lens),
                                 kv_head=lambda h, g=g: g) for g in range(n_kv_heads)]
    read = []
    for h in range(n_q_heads):
        match = [g for g in range(n_kv_heads) if _same_as(got[:, h], per_head[g][:, h], rtol, atol)]
        if not match:
            return None
        read.append(match[0] if h // group not in match else h // group)
    if read == [h // group for h in range(n_q_heads)]:
        return None
    return (f"query heads 0..{n_q_heads - 1} read kv heads {read}, expected {[h // group for h in range(n_q_heads)]}: "
            f"query head h reads kv head h // (n_q_heads // n_kv_heads) (groups of {group} consecutive heads)")


def decode_ideal_bytes(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                       seq_lens, out: torch.Tensor | None = None) -> int:
    """Decode's floor: ``q`` read and the output written once, each sequence's cached tokens of K
    and V read once per kv head, the block table entries it uses and ``seq_lens`` read once
    (``seq_lens`` as a tensor, or a check case's list of the int32 lengths)."""
    k_cache, v_cache = cache_tensor(k_cache), cache_tensor(v_cache)
    block_size, n_kv_heads, head_dim = k_cache.shape[1:]
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    lens_bytes = seq_lens.element_size() if isinstance(seq_lens, torch.Tensor) else 4
    blocks = sum(-(-n // block_size) for n in lens)
    kv = sum(lens) * n_kv_heads * head_dim * (k_cache.element_size() + v_cache.element_size())
    return 2 * q.numel() * q.element_size() + kv + blocks * block_tables.element_size() + len(lens) * lens_bytes


def decode_top_bytes(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor, seq_lens,
                     out: torch.Tensor | None = None) -> int:
    """The bytes the top of the ladder, ``kernel_ladder.paged_attention``, moves on the same inputs (traced)."""
    from utils.trace import trace

    lens = seq_lens if isinstance(seq_lens, torch.Tensor) else torch.tensor(seq_lens, dtype=torch.int32,
                                                                             device=q.device)
    with trace(torch_ops=False) as traced:
        kernel_ladder.paged_attention(q, cache_tensor(k_cache), cache_tensor(v_cache), block_tables, lens)
    return traced.bytes


# ----------------------------------------------------------------------------------------------
# Exercise 3: the split-KV merge
# ----------------------------------------------------------------------------------------------


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``S`` partial attentions of the same queries over disjoint key ranges.

    Split ``s`` produced ``outs[s]`` (``(N, D)``, normalised over its own keys) and
    ``lses[s] = log Σ_{j in s} exp(score_j)`` (``(N,)``). The softmax over all keys weights split
    ``s`` by its share of the total: ``exp(lses[s] - lse)`` with ``lse = log Σ_s exp(lses[s])``.
    A split that saw no key has ``lse = -inf``: weight 0 (and its ``out`` may be anything, even
    NaN, so it is masked, not multiplied by 0). Every row has at least one non-empty split.
    """
    lse = torch.logsumexp(lses, dim=0)  # -inf rows drop out: exp(-inf) = 0
    weights = torch.exp(lses - lse[None])
    empty = torch.isinf(lses) & (lses < 0)
    outs = torch.where(empty[..., None], torch.zeros_like(outs), outs)
    return (weights[..., None] * outs).sum(dim=0), lse


def split_attention(scores: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Given: the partials a split-KV kernel writes, key range ``bounds[s] .. bounds[s + 1]`` per split
    (an empty range gives ``lse = -inf`` and a NaN output, as ``0 / 0`` would)."""
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = scores[:, lo:hi]
        lse = torch.logsumexp(s, dim=1) if hi > lo else torch.full(scores.shape[:1], float("-inf"), dtype=scores.dtype)
        p = torch.exp(s - lse[:, None])
        outs.append(p @ v[lo:hi] if hi > lo else torch.full((scores.shape[0], v.shape[1]), float("nan"),
                                                             dtype=scores.dtype))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def merge_reference(scores: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over every key at once, and its log-sum-exp (what the merge must reproduce)."""
    return torch.softmax(scores, dim=1) @ v, torch.logsumexp(scores, dim=1)


def merge_cases(gen: torch.Generator) -> list[tuple]:
    """Uneven splits, an empty split, a split holding the row's maximum, masked keys; last, scores far
    from 0: rows near +120 and −300 (``exp(lse)`` overflows or underflows in fp32), one whose
    maximum falls between splits (200 in the first, 10 after), and rows near ±800 (beyond float64's
    exp too). fp32 holds a log-sum-exp near 800 only to about 800 · 2^-24 ≈ 5e-5, so a right merge
    of these partials is off by that much relative to its weights: that case's tolerance is
    ``rtol=1e-4, atol=1e-5`` (:func:`merge_tolerance`; every wrong merge misses it by far, or gives NaN)."""
    cases = []
    for rows, bounds, dims in ((4, [0, 16, 32], 8), (5, [0, 7, 7, 30, 33], 16), (3, [0, 1, 40, 41], 4)):
        total = bounds[-1]
        scores = torch.randn(rows, total, generator=gen) * 3
        scores[0, -1] += 15.0  # row 0's weight is almost all in the last split
        scores[1, : bounds[1]] = float("-inf")  # row 1 sees nothing in the first split
        cases.append((scores, torch.randn(total, dims, generator=gen), bounds))
    bounds = [0, 12, 12, 30, 41]
    scores = torch.randn(5, bounds[-1], generator=gen) * 3
    scores[0] += 120.0
    scores[1] -= 300.0
    scores[2, : bounds[1]] += 200.0
    scores[2, bounds[1]:] += 10.0
    scores[3] += 800.0
    scores[4] -= 800.0
    cases.append((scores, 0.1 * torch.randn(bounds[-1], 8, generator=gen), bounds))
    return cases


def merge_tolerance(case: tuple, dtype: torch.dtype | None) -> tuple[float, float] | None:
    """Exercise 3's tolerance per case: ``rtol=1e-4, atol=1e-5`` where the scores reach the hundreds
    (fp32 holds their log-sum-exps to about ``|lse| · 2^-24``), the default elsewhere."""
    scores = case[0]
    finite = scores[torch.isfinite(scores)]
    return (1e-4, 1e-5) if finite.numel() and float(finite.abs().max()) > 100 else None


def merge_mistakes(outs: torch.Tensor, lses: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]],
                                                                     list[tuple[str, torch.Tensor]]]:
    """Common wrong merges of the partials ``(outs, lses)``: ``(cause, output)`` pairs, then
    ``(cause, lse)`` pairs, computed in the partials' dtype (so that exp overflows where a merge's
    own arithmetic would) and, for the ones that overflow, in float64 too."""
    empty = torch.isinf(lses) & (lses < 0)
    masked = torch.where(empty[..., None], torch.zeros_like(outs), outs)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse[None])
    naive = ("the weights are exp(lses[s]) / Σ exp(lses[s]): exp overflows to inf for a log-sum-exp above 88.7 "
             "(709 in float64) and underflows to 0 below -103, so the rows with scores far from 0 come out NaN — "
             "weight by exp(lses[s] - lse) with lse = torch.logsumexp(lses, dim=0), which subtracts the maximum")
    outputs = [
        (naive, (torch.exp(lses)[..., None] * masked).sum(0) / torch.exp(lses).sum(0)[..., None]),
        (naive, ((torch.exp(lses.double())[..., None] * masked.double()).sum(0)
                 / torch.exp(lses.double()).sum(0)[..., None]).to(outs.dtype)),
        ("the splits are averaged: a split's weight is its share of the softmax's total, exp(lses[s] - lse), "
         "not 1 / S", torch.nan_to_num(outs).mean(dim=0)),
        ("the splits' outputs are added without weights: each is normalised over its own keys only, so weight "
         "it by exp(lses[s] - lse)", masked.sum(dim=0)),
        ("the splits' outputs are averaged with a plain mean (over the splits that saw a key): a split's weight is "
         "its share of the softmax's total, exp(lses[s] - lse), so a split whose keys score higher counts more",
         masked.sum(dim=0) / (~empty).sum(dim=0).clamp(min=1)[..., None].to(outs.dtype)),
        ("a split that saw no key (lse = -inf, its output NaN) is multiplied by its weight 0, and 0 · NaN is "
         "NaN: mask those splits' outputs (torch.where) before the weighted sum", (weights[..., None] * outs).sum(0)),
        ("the weights exp(lses[s] - max_s lses[s]) are not divided by their sum: subtract the log-sum-exp of "
         "the lses, not their maximum", (torch.exp(lses - lses.amax(0)[None])[..., None] * masked).sum(0)),
    ]
    lse_naive = ("the log-sum-exp is log(Σ exp(lses[s])): exp overflows to inf above 88.7 (709 in float64) — "
                 "torch.logsumexp(lses, dim=0) subtracts the maximum first")
    lse_outputs = [
        ("the returned log-sum-exp is the largest split's, max_s lses[s]: the total is log Σ_s exp(lses[s]) "
         "(torch.logsumexp)", lses.amax(dim=0)),
        (lse_naive, torch.log(torch.exp(lses).sum(0))),
        (lse_naive, torch.log(torch.exp(lses.double()).sum(0)).to(lses.dtype)),
        ("the returned log-sum-exp is the sum of the splits' lses: log-sum-exps combine by logsumexp, not +",
         lses.sum(dim=0)),
    ]
    return outputs, lse_outputs


def diagnose_merge(case: tuple, got, expected) -> str | None:
    """Exercise 3's cause: which known wrong merge (:func:`merge_mistakes`) gives the output, and
    which the log-sum-exp."""
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(g, torch.Tensor) for g in got):
        return None
    scores, v, bounds = case
    outputs, lse_outputs = merge_mistakes(*split_attention(scores.cpu(), v.cpu(), bounds))
    rtol, atol = merge_tolerance(case, scores.dtype) or (1e-5, 1e-6)
    causes = []
    for part, candidates, want in zip(got, (outputs, lse_outputs), expected):
        if part.shape != want.shape or _same_as(part, want, rtol, atol):
            continue
        cause = next((c for c, candidate in candidates if _same_as(part, candidate, 1e-4, 1e-5)), None)
        if cause is not None and cause not in causes:
            causes.append(cause)
    if len(causes) == 2 and all("exp overflows" in c for c in causes):
        # Both the weights and the log-sum-exp take exp(lses[s]) raw: one cause, said once.
        return ("the weights and the log-sum-exp both take exp(lses[s]) as it is: exp overflows to inf for a "
                "log-sum-exp above 88.7 (709 in float64) and underflows to 0 below -103, so the rows with scores "
                "far from 0 come out NaN — use lse = torch.logsumexp(lses, dim=0) (it subtracts the maximum) and "
                "weight by exp(lses[s] - lse)")
    return "; ".join(causes) or None


# ----------------------------------------------------------------------------------------------
# Exercise 4: copy-on-write
# ----------------------------------------------------------------------------------------------


def prepare_append(table: list[int], length: int, block_size: int, refcounts: list[int],
                   free: list[int]) -> tuple[list[int], list[int], list[int], tuple[int, int] | None]:
    """Make room for one more token of a sequence that holds ``length`` tokens in ``table``.

    Returns ``(table, refcounts, free, copy)``, new lists (the arguments are not modified):

    * the last block is full (``length % block_size == 0``, an empty sequence included): take the
      first free block (``free[0]``), reference count 1, append it to the table;
    * the last block has room and is this sequence's alone (reference count 1): nothing changes;
    * the last block has room but is shared (count > 1, after a ``fork``): writing into it would
      change the other sequences' cache too. Take the first free block, ``copy = (old, new)``
      (the caller copies the filled slots), put it in the table instead, and drop one reference
      to the old block (it stays with the others).

    ``copy`` is ``None`` unless a copy is needed. Full shared blocks are never copied: only new
    tokens are written, and they go to a block of their own.
    """
    table, refcounts, free = list(table), list(refcounts), list(free)
    if length % block_size == 0:
        block = free.pop(0)
        refcounts[block] = 1
        table.append(block)
        return table, refcounts, free, None
    last = table[length // block_size]
    if refcounts[last] == 1:
        return table, refcounts, free, None
    block = free.pop(0)
    refcounts[block] = 1
    refcounts[last] -= 1
    table[length // block_size] = block
    return table, refcounts, free, (last, block)


def prepare_append_reference(table, length, block_size, refcounts, free):
    """The same rule, written as the check's reference (kept apart from the solution on purpose)."""
    new_table, counts, pool = list(table), list(refcounts), list(free)
    needs_block = length % block_size == 0
    last = None if needs_block else new_table[length // block_size]
    if not needs_block and counts[last] <= 1:
        return new_table, counts, pool, None
    block = pool[0]
    pool = pool[1:]
    counts[block] = 1
    if needs_block:
        return new_table + [block], counts, pool, None
    counts[last] -= 1
    new_table[length // block_size] = block
    return new_table, counts, pool, (last, block)


def prepare_append_cases(gen: torch.Generator) -> list[tuple]:
    """A full last block, an own partial block, a shared partial block, a shared full block, empty."""
    cases = []
    block_size = 4
    for length, shared_last in ((8, False), (6, False), (6, True), (8, True), (0, False), (9, True)):
        num_blocks = 12
        order = torch.randperm(num_blocks, generator=gen).tolist()
        n = -(-length // block_size)
        table, free = order[:n], order[n:]
        refcounts = [0] * num_blocks
        for block in table:
            refcounts[block] = 1 + int(torch.randint(0, 2, (1,), generator=gen))  # full blocks may be shared
        if table:
            refcounts[table[-1]] = 2 if shared_last else 1
        cases.append((table, length, block_size, refcounts, free))
    return cases


def diagnose_append(got, expected) -> str | None:
    """The check's comparison for exercise 4: None if equal, else what is wrong."""
    if got == expected:
        return None
    if isinstance(got, (tuple, list)) and len(got) == 4:
        kinds = [f"{label}: return a list, got {type(part).__name__}"
                 for label, part in zip(("table", "refcounts", "free"), got[:3]) if not isinstance(part, list)]
        if not (got[3] is None or isinstance(got[3], tuple)):
            kinds.append(f"copy: return a tuple (old, new) or None, got {type(got[3]).__name__}")
        if kinds:
            return "; ".join(kinds)
    if isinstance(got, tuple) and len(got) == 4 and got[3] is None and expected[3] is not None:
        return (f"no copy, but block {expected[3][0]} is shared (count > 1): writing the new token into it "
                "would change the other sequences' cache too")
    if isinstance(got, tuple) and len(got) == 4 and got[3] is not None and expected[3] is None:
        return (f"copied block {got[3][0]}, but it is full or this sequence's alone: only a shared block "
                "with room for the new token is copied")
    if isinstance(got, tuple) and len(got) == 4 and (got[0], got[2], got[3]) == (expected[0], expected[2], expected[3]):
        blocks = [b for b, (g, e) in enumerate(zip(got[1], expected[1])) if g != e]
        return (f"table, free list and copy right, reference counts wrong at block(s) {blocks}: got "
                f"{[got[1][b] for b in blocks]}, expected {[expected[1][b] for b in blocks]} (a new block "
                "starts at 1; the shared block left behind loses this sequence's reference)")
    return f"got {got}, expected {expected}"


def _append_with(table, length, block_size, refcounts, free, *, take=0, grow=True, copy_first="old", new_count=1,
                 old_count=lambda count: count - 1, swap_in=True, append_copy=False, free_old=False):
    """Exercise 4's rule with one thing done differently (the keywords): what a wrong answer returns."""
    table, counts, pool = list(table), list(refcounts), list(free)
    if length % block_size == 0:
        if not grow:
            return table, counts, pool, None
        block = pool.pop(take)
        counts[block] = new_count
        return table + [block], counts, pool, None
    last = table[length // block_size]
    if counts[last] <= 1:
        return table, counts, pool, None
    block = pool.pop(take)
    counts[block] = new_count
    counts[last] = old_count(counts[last])
    if append_copy:
        table.append(block)
    elif swap_in:
        table[length // block_size] = block
    if free_old:
        pool.append(last)
    return table, counts, pool, (last, block) if copy_first == "old" else (block, last)


#: Exercise 4's common mistakes that its comparison (:func:`diagnose_append`) does not already name.
APPEND_MISTAKES = (
    ("the new block came from the end of the free list (free.pop()): take the first free block, free[0] "
     "(free.pop(0))", dict(take=-1)),
    ("the last block is full (length % block_size == 0, or the sequence is empty), but no block was added: the "
     "new token needs a block of its own — take free[0] and append it to the table", dict(grow=False)),
    ("copy is (new, old): it says what to copy where — (old, new), the shared block first", dict(copy_first="new")),
    ("the new block's reference count was not set to 1 (this sequence is its only user)", dict(new_count=0)),
    ("the shared block's count was set to 0, but the other sequences still hold it: drop one reference "
     "(count - 1)", dict(old_count=lambda count: 0)),
    ("the copy is returned but the table still points at the shared block: put the new block in its place",
     dict(swap_in=False)),
    ("the new block was appended to the table, but it replaces the shared last block: table[length // "
     "block_size] = new (the table keeps its length; the new token goes into the copy)", dict(append_copy=True)),
    ("the shared block was put back on the free list, but the other sequences still hold it (its count is still "
     "1 or more): a block goes back on the free list only when no sequence holds it", dict(free_old=True)),
)


def diagnose_append_cause(case: tuple, got, expected) -> str | None:
    """Exercise 4's cause beyond what :func:`diagnose_append` says: which known mistake returns ``got``."""
    for cause, twist in APPEND_MISTAKES:
        if _append_with(*case, **twist) == tuple(got) and tuple(got) != tuple(expected):
            return cause
    return None


_APPEND_ARGUMENTS = ("table", "length", "block_size", "refcounts", "free")


def unmodified(fn):
    """Exercise 4's candidate wrapper: ``fn(*args)``, failing if it changed its (list) arguments."""
    import copy

    from utils.exercises.rules import RuleBroken

    def run(*args):
        before = copy.deepcopy(args)
        result = fn(*args)
        changed = [_APPEND_ARGUMENTS[i] if i < len(_APPEND_ARGUMENTS) else f"argument {i}"
                   for i, (now, was) in enumerate(zip(args, before)) if now != was]
        if changed:
            raise RuleBroken("the spec returns new lists and leaves its arguments as they were",
                             f"the code modified {', '.join(changed)} in place — copy the lists first "
                             "(list(table), ...) and return the new ones")
        return result

    run.__name__ = getattr(fn, "__name__", "candidate")
    run.__wrapped__ = fn
    return run


# ----------------------------------------------------------------------------------------------
# Exercise 5: the scheduler's admission rule
# ----------------------------------------------------------------------------------------------


def admit(waiting: list[int], num_running: int, free_blocks: int, block_size: int, token_budget: int,
          max_num_seqs: int) -> list[int]:
    """How many prompt tokens each waiting request prefills this step (first come, first served).

    ``waiting`` holds the prompt lengths of the waiting requests, oldest first. The step's
    ``token_budget`` goes to the ``num_running`` decoding sequences first (one token each). Then,
    in order, each waiting request is admitted with a chunk of ``min(prompt, budget left)`` tokens if

    * a sequence slot is left (at most ``max_num_seqs`` sequences run at once),
    * some budget is left, and
    * the blocks for its *whole* prompt (``ceil(prompt / block_size)``) are free: they are
      reserved at admission, so the later chunks of a long prompt never wait for memory;

    and the first request that cannot be admitted stops admission: a later, smaller request does
    not overtake it (it would starve a long prompt forever). Returns the admitted chunks, in order.
    This is :class:`kernel_ladder.serving.Scheduler`'s rule for new requests (without its prefix cache).
    """
    budget = token_budget - num_running
    seats = max_num_seqs - num_running
    chunks = []
    for prompt in waiting:
        if seats <= 0 or budget <= 0:
            break
        chunk = min(prompt, budget)
        blocks = -(-prompt // block_size)
        if blocks > free_blocks:
            break
        chunks.append(chunk)
        budget -= chunk
        free_blocks -= blocks
        seats -= 1
    return chunks


def admit_cases(gen: torch.Generator) -> list[tuple]:
    """Budget-bound, block-bound (an exact fit too), seat-bound and head-of-line cases."""
    cases = [
        ([100, 50, 20], 10, 100, 16, 128, 64),  # the budget chunks the second prompt; the third waits
        ([64, 300, 8], 2, 12, 16, 512, 64),     # blocks run out at the long prompt: the short one waits
        ([500, 8], 0, 40, 16, 64, 64),          # a chunk of 64 tokens, but all 32 blocks reserved
        ([500, 8], 0, 10, 16, 64, 64),          # the chunk would fit in 4 blocks, the prompt needs 32: wait
        ([64, 8], 0, 4, 16, 512, 64),           # the first prompt needs exactly the 4 free blocks: it fits
        ([5, 5, 5, 5], 0, 100, 16, 512, 2),     # two seats in all
        ([10, 10, 10], 62, 100, 16, 512, 64),   # two seats left
        ([40], 128, 100, 16, 128, 256),         # decodes take the whole budget
    ]
    for _ in range(4):
        waiting = torch.randint(1, 400, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        cases.append((waiting, int(torch.randint(0, 20, (1,), generator=gen)),
                      int(torch.randint(0, 40, (1,), generator=gen)), 16, 256, 24))
    return cases


def admit_reference(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    """The same rule, written as the check's reference (kept apart from the solution on purpose)."""
    budget = token_budget - num_running
    admitted: list[int] = []
    for prompt in waiting:
        if num_running + len(admitted) >= max_num_seqs or budget < 1:
            return admitted
        need = (prompt + block_size - 1) // block_size
        if need > free_blocks:
            return admitted
        admitted.append(min(prompt, budget))
        budget -= admitted[-1]
        free_blocks -= need
    return admitted


def diagnose_admit(got, expected) -> str | None:
    """The check's comparison for exercise 5: None if equal, else what to look at."""
    if got == expected:
        return None
    return (f"admitted {got}, expected {expected}. In order, for each waiting request: a seat left "
            "(num_running + admitted < max_num_seqs)? budget left after the decodes? blocks free for its "
            "whole prompt? The first request that fails one stops admission (no later request overtakes it)")


def _admit_with(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs, *, stop=True,
                blocks_for="prompt", decodes_first=True, seats_count_running=True, seat_limit=True, exact_fit=True,
                chunked=True, budget_spent=True, whole_prompt=False):
    """Exercise 5's rule with one thing done differently (the keywords): what a wrong answer returns."""
    budget = token_budget - (num_running if decodes_first else 0)
    seats = (max_num_seqs - (num_running if seats_count_running else 0)) if seat_limit else 10**9
    admitted: list[int] = []
    for prompt in waiting:
        chunk = prompt if whole_prompt else min(prompt, budget)
        if blocks_for == "floor":
            need = prompt // block_size
        else:
            need = -(-(prompt if blocks_for == "prompt" else chunk) // block_size)
        fits = need <= free_blocks if exact_fit else need < free_blocks
        if seats <= 0 or budget <= 0 or not fits or (not chunked and prompt > budget):
            if stop:
                break
            continue
        admitted.append(chunk)
        budget -= chunk if budget_spent else 0
        free_blocks -= need
        seats -= 1
    return admitted


#: Exercise 5's common mistakes: a cause each, and the keywords of :func:`_admit_with` that make it.
ADMIT_MISTAKES = (
    ("a request that could not be admitted was skipped and a later one admitted (continue instead of break): "
     "the first request that fails a condition stops admission, or small requests overtake a long prompt forever",
     dict(stop=False)),
    ("blocks were reserved for the chunk only: reserve ceil(prompt / block_size) blocks for the whole prompt at "
     "admission, so that its later chunks never wait for memory", dict(blocks_for="chunk")),
    ("the running sequences' decode tokens were not taken from the budget first: budget = token_budget - "
     "num_running", dict(decodes_first=False)),
    ("the seats ignore the running sequences: at most max_num_seqs sequences run at once, so the seats left are "
     "max_num_seqs - num_running", dict(seats_count_running=False)),
    ("no seat limit: at most max_num_seqs sequences run at once (the running ones included)",
     dict(seat_limit=False)),
    ("a request needing exactly the free blocks was refused: it fits when its blocks ≤ free_blocks",
     dict(exact_fit=False)),
    ("a prompt longer than the budget left was not chunked: admit min(prompt, budget left) of its tokens now "
     "(chunked prefill), the rest in later steps", dict(chunked=False)),
    ("the budget was not reduced by each admitted chunk: the step's tokens are the decodes plus every chunk",
     dict(budget_spent=False)),
    ("the whole prompt was admitted past the budget left, with no chunking: admit min(prompt, budget left) of its "
     "tokens now (chunked prefill), the rest in later steps", dict(whole_prompt=True)),
    ("the blocks were counted by floor division (prompt // block_size), which drops a partial last block: a "
     "prompt needs ceil(prompt / block_size) = -(-prompt // block_size) blocks", dict(blocks_for="floor")),
)


def diagnose_admit_cause(case: tuple, got, expected) -> str | None:
    """Exercise 5's cause: which known mistake (:data:`ADMIT_MISTAKES`) returns ``got``."""
    for cause, twist in ADMIT_MISTAKES:
        if _admit_with(*case, **twist) == got != expected:
            return cause
    return None


# ----------------------------------------------------------------------------------------------
# Given: static batching, the baseline continuous batching is compared with
# ----------------------------------------------------------------------------------------------


def static_batching(requests: list[tuple[int, int]], batch_size: int) -> list[int]:
    """Tokens processed per step when requests run in fixed batches of ``batch_size``.

    A batch is admitted whole, prefills its prompts in one step (which samples each sequence's
    first output token), then feeds one token per unfinished sequence per step until its *longest*
    output is done; only then does the next batch start. Returns the tokens fed to the model in
    each step: ``prompt + output - 1`` per request in all (the last sampled token is never fed
    back), as :class:`kernel_ladder.serving.Scheduler` counts them.
    """
    steps = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        steps.append(sum(p for p, _ in batch))
        for t in range(1, max(o for _, o in batch)):
            steps.append(sum(1 for _, o in batch if o > t))
    return steps


# ----------------------------------------------------------------------------------------------
# Exercise 6: the absorbed decode's scores (DeepSeek-V3's multi-head latent attention)
# ----------------------------------------------------------------------------------------------


def absorbed_scores(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor,
                    qk_nope_head_dim: int, v_head_dim: int) -> torch.Tensor:
    """One decoding token's attention scores ``(H, n)`` over ``n`` cached latent rows ``[c | k_pe]``, absorbed.

    ``kv_b_proj`` (weight ``(H (nope + v), L)``) would expand each cached ``c`` into every head's key
    ``k_nope_h = W_UK_h c``. Instead the query is moved into the latent space once,
    ``q_latent_h = W_UK_h^T q_nope_h`` (``W_UK_h``: the first ``nope`` rows of head ``h``'s block of
    ``nope + v`` rows), so that ``q_nope_h . k_nope_h = q_latent_h . c``: the cache is read as it is. The
    RoPE part adds ``q_pe_h . k_pe``, and the scale stays ``1 / sqrt(nope + rope)`` (the expanded head dim).
    """
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    w_uk = kv_b_weight.view(heads, qk_nope_head_dim + v_head_dim, rank)[:, :qk_nope_head_dim]  # (H, nope, L)
    q_latent = torch.einsum("hn,hnl->hl", q_nope, w_uk)
    c, k_pe = latent[:, :rank], latent[:, rank:]
    scale = (qk_nope_head_dim + q_pe.shape[-1]) ** -0.5
    return scale * (q_latent @ c.T + q_pe @ k_pe.T)


def absorbed_scores_reference(q_nope, q_pe, latent, kv_b_weight, qk_nope_head_dim, v_head_dim) -> torch.Tensor:
    """The scores as transformers' DeepseekV3Attention computes them: every cached ``c`` expanded through
    kv_b_proj into per-head keys (``.view(n, H, nope + v)``, the first ``nope`` of each head), the shared
    RoPE key appended, then ``q . k / sqrt(nope + rope)``."""
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    c, k_pe = latent[:, :rank], latent[:, rank:]
    k_nope = (c @ kv_b_weight.T).view(c.shape[0], heads, qk_nope_head_dim + v_head_dim)[..., :qk_nope_head_dim]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    return torch.einsum("hd,nhd->hn", q, k) / math.sqrt(qk_nope_head_dim + q_pe.shape[-1])


def absorbed_scores_cases(gen: torch.Generator) -> list[tuple]:
    """Tiny DeepSeek-like sizes ``(H, L, R, nope, v, n)``: nope ≠ v and nope = v (the last nope rows of a head's
    block are then exactly its value rows), non-powers of two, and a single cached token (where expanding it
    costs about what absorbing does: the first two cases, with many tokens, tell them apart)."""
    cases = []
    for heads, rank, rope, nope, v_dim, n in ((4, 24, 8, 16, 12, 19), (3, 40, 6, 10, 10, 33), (2, 32, 16, 24, 8, 1)):
        def r(*shape):
            return torch.randn(shape, generator=gen)

        cases.append((r(heads, nope), r(heads, rope), r(n, rank + rope), r(heads * (nope + v_dim), rank) * 0.3,
                      nope, v_dim))
    return cases


def absorbed_arithmetic(q_nope, q_pe, latent, kv_b_weight, qk_nope_head_dim, v_head_dim) -> int:
    """The arithmetic of the absorbed scores, counted as :func:`count_arithmetic` counts a candidate's: the
    query through ``W_UK`` once (``2 H nope L`` matmul FLOPs), the scores' dot products ``2 H n (L + R)``,
    and ``2 H n`` elementwise (the two parts added, the scale). Expanding every cached token's key instead,
    by a matmul or by a broadcast product and a sum, costs ``2 n H nope L`` more."""
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    n = latent.shape[0]
    return 2 * heads * qk_nope_head_dim * rank + 2 * heads * n * latent.shape[1] + 2 * heads * n


# Elementwise ops that move values without computing on them: not arithmetic.
_COPIES = frozenset({"clone", "copy", "copy_", "_to_copy", "lift_fresh_copy"})


def count_arithmetic(fn: Callable[..., object], *args) -> dict[str, int]:
    """What ``fn(*args)``'s torch ops compute, in three parts:

    * ``matmul``: the tracer's FLOPs (``utils.trace``: 2 per multiply-add of ``mm``, ``bmm``, ``mv``,
      ``dot``, ``addmm``, ... whatever spelling ran them: ``einsum``, ``@``, ``F.linear``);
    * ``elementwise``: one per element that an elementwise aten op writes (a product, a sum of two
      tensors, a scale; copies and dtype casts are not counted);
    * ``reduction``: one per element that a reduction reads (``.sum(-1)`` over a broadcast product is the
      other half of a dot product: ``(a[:, None] * b[None]).sum(-1)`` counts as a matmul would).

    Composite ops are counted as what they run (``torch.linalg.vecdot`` as a product and a sum)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from utils.trace import trace

    counted = {"matmul": 0, "elementwise": 0, "reduction": 0}

    class ElementwiseAndReductions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func._can_decompose():  # a composite op seen whole (under inference mode): count what it runs
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            out = func(*args, **kwargs)
            base = func._schema.name.split("::", 1)[-1]
            if torch.Tag.pointwise in func.tags and base not in _COPIES:
                written = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
                counted["elementwise"] += written.numel() if written is not None else 0
            elif torch.Tag.reduction in func.tags:
                read = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
                counted["reduction"] += read.numel() if read is not None else 0
            return out

    with trace() as traced, ElementwiseAndReductions():
        fn(*args)
    counted["matmul"] = traced.flops
    return counted


def absorbed_scores_rules() -> list:
    """Exercise 6's stated rules. Absorbed: everything the candidate's torch ops compute — matmul FLOPs,
    elementwise ops, reductions (:func:`count_arithmetic`) — stays within 1.5× the absorbed form's
    (:func:`absorbed_arithmetic`): a key expanded for every cached token costs ``2 n H nope L`` more, by a
    matmul, a broadcast product and a sum, or ``torch.linalg.vecdot`` alike (with one cached token it costs
    about the same as absorbing: the cases with many tokens tell them apart). And the inputs come back as
    they were (a query scaled in place gives the right scores and changes the caller's tensors)."""
    from utils.exercises import rules
    from utils.exercises.rules import Rule

    def problem(context) -> str | None:
        case = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in context.case)  # the caller's untouched
        counted = count_arithmetic(context.candidate, *case)
        total, allowed = sum(counted.values()), absorbed_arithmetic(*case)
        if total > 1.5 * allowed:
            heads, nope, rank, n = case[0].shape[0], case[4], case[3].shape[1], case[2].shape[0]
            return (f"its torch ops' arithmetic came to {total:,} ({counted['matmul']:,} matmul FLOPs, "
                    f"{counted['elementwise']:,} elementwise, {counted['reduction']:,} in reductions) where the "
                    f"absorbed scores need {allowed:,} (1.5× that is allowed): a key expanded for each of the {n} "
                    f"cached tokens and {heads} heads costs 2·n·H·nope·L = {2 * n * heads * nope * rank:,} more, "
                    "by a matmul or by a broadcast product and a sum alike (move the query into the latent space "
                    "instead: q_latent = W_UK^T q_nope, once per head)")
        return None

    return [Rule(name="absorbed: all arithmetic (matmul FLOPs, elementwise ops, reductions) within 1.5× the "
                      "absorbed form's",
                 why="the spec asks for the absorbed form (no key expanded per cached token)", problem=problem),
            rules.inputs_unchanged(why="the spec returns the scores and leaves its inputs as they were")]


def absorbed_scores_mistakes(q_nope, q_pe, latent, kv_b_weight, qk_nope_head_dim,
                             v_head_dim) -> list[tuple[str, torch.Tensor]]:
    """What common wrong absorbed scores return on a case, each with its cause."""
    heads, rank, rope = q_nope.shape[0], kv_b_weight.shape[1], q_pe.shape[-1]
    nope = qk_nope_head_dim
    per_head = kv_b_weight.view(heads, nope + v_head_dim, rank)
    c, k_pe = latent[:, :rank], latent[:, rank:]
    right = (nope + rope) ** -0.5

    def scores(w_uk, scale=right, rope_scale=None, rope_part=True, c=c, k_pe=k_pe):
        s = scale * (torch.einsum("hn,hnl->hl", q_nope, w_uk) @ c.T)
        if not rope_part:
            return s
        return s + (scale if rope_scale is None else rope_scale) * (q_pe @ k_pe.T)

    w_uk = per_head[:, :nope]
    mistakes = [
        ("W_UK is the first H · nope rows of kv_b_proj's weight: the weight is (H, nope + v, L) per head — head h's "
         "nope key rows and then its v value rows — so W_UK_h is rows h·(nope + v) to h·(nope + v) + nope "
         "(weight.view(H, nope + v, L)[:, :nope])", scores(kv_b_weight[: heads * nope].view(heads, nope, rank))),
        ("W_UK is read feature-major (weight.view(nope + v, H, L)[:nope], row f·H + h for feature f of head h): "
         "kv_b_proj's output is split per head, .view(..., H, nope + v), so each head's nope + v rows are "
         "consecutive — weight.view(H, nope + v, L)[:, :nope]",
         scores(kv_b_weight.view(nope + v_head_dim, heads, rank)[:nope].transpose(0, 1))),
        ("W_UK is taken from the end of each head's block (weight.view(H, nope + v, L)[:, v:] or [:, -nope:]), "
         "where the value rows W_UV_h are: a head's block is its nope key rows first, then its v value rows — "
         "W_UK_h = weight.view(H, nope + v, L)[:, :nope]", scores(per_head[:, v_head_dim:])),
        ("the RoPE part is missing: each score also has q_pe · k_pe (the shared rotated key, the last rope_dim "
         "numbers of each cached row)", scores(w_uk, rope_part=False)),
        ("the cache row's two parts are swapped: a row is [c | k_pe], c first (kv_lora_rank numbers), then k_pe",
         scores(w_uk, c=latent[:, rope:], k_pe=latent[:, :rope])),
        ("the scores are not scaled: multiply by 1 / sqrt(nope + rope), the expanded query's head dim",
         scores(w_uk, scale=1.0)),
        ("only the latent part q_latent · c is scaled, not the RoPE part: the scale 1 / sqrt(nope + rope) "
         "multiplies the whole score, (q_latent · c + q_pe · k_pe) / sqrt(nope + rope)",
         scores(w_uk, rope_scale=1.0)),
        ("only the RoPE part q_pe · k_pe is scaled, not the latent part: the scale 1 / sqrt(nope + rope) "
         "multiplies the whole score, (q_latent · c + q_pe · k_pe) / sqrt(nope + rope)",
         scores(w_uk, scale=1.0, rope_scale=right)),
    ]
    for dim, name in ((nope, "qk_nope_head_dim"), (rank, "kv_lora_rank"), (rank + rope, "kv_lora_rank + rope_dim"),
                      (rope, "rope_dim"), (v_head_dim, "v_head_dim")):
        if dim != nope + rope:
            mistakes.append((f"the scores are scaled by 1 / sqrt({name} = {dim}): absorption changes no score, the "
                             f"scale is the expanded head dim's, 1 / sqrt(nope + rope) = 1 / sqrt({nope + rope})",
                             scores(w_uk, scale=dim**-0.5)))
    mistakes.append(("the result is softmax(scores): return the scores themselves (the softmax comes after, over "
                     "all cached tokens)", torch.softmax(scores(w_uk), -1)))
    return mistakes


def _reduced_precision(case: tuple, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Scores off by about a 16-bit float's rounding (bf16's, or fp16's) though the inputs are float32: the
    arithmetic ran in reduced precision. The error is set against what rounding the inputs alone to each
    dtype does to the exact scores (on this case), so that a mistake in the formula is not taken for it."""
    if got.dtype != torch.float32 or not bool(torch.isfinite(got).all()):
        return None
    exact = absorbed_scores_reference(*(x.double() if isinstance(x, torch.Tensor) else x for x in case))
    largest = float(exact.abs().max())
    error = float((got.detach().cpu().double() - exact).abs().max()) / largest
    if error < 1e-5:
        return None  # float32's own rounding: the comparison's other lines say what is wrong
    fits = []
    for dtype, name, bits in ((torch.float16, "fp16", 11), (torch.bfloat16, "bf16", 8)):
        rounded = absorbed_scores_reference(*(x.to(dtype).double() if isinstance(x, torch.Tensor) else x for x in case))
        ratio = error / max(float((rounded - exact).abs().max()) / largest, 1e-300)
        if ratio <= 16:
            fits.append((abs(math.log(ratio)), name, bits))
    if not fits:
        return None
    _, name, bits = min(fits)  # the dtype whose rounding is nearest the error's size
    return (f"reduced-precision arithmetic: the scores are off by up to {error:.1e} of the largest, what {name} "
            f"({bits} significant bits) gives, not float32 — compute in the inputs' dtype (no .to(torch.bfloat16) "
            "or .half() on the way) and return the scores in it")


def diagnose_absorbed_scores(case: tuple, got, expected) -> str | None:
    """Exercise 6's cause: the known wrong formulas that give this case's result (one, or every one that fits),
    or else arithmetic in a 16-bit float."""
    from utils.exercises import one_or_all_causes

    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    got64 = got.detach().cpu().double()
    double_case = tuple(x.double() if isinstance(x, torch.Tensor) else x for x in case)
    causes = [cause for cause, wrong in absorbed_scores_mistakes(*double_case)
              if torch.allclose(got64, wrong, rtol=1e-4, atol=1e-5)]
    return one_or_all_causes(causes) or _reduced_precision(case, got, expected)
