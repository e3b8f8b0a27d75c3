"""Solutions to chapter 08, the KV cache: slot mapping, the paged decode kernel's block-table walk,
the split-KV merge, copy-on-write, the scheduler's admission rule.

One solution per exercise of ``chapters/08_kv_cache/08_kv_cache.ipynb``, written for reading, and
what the chapter gives (the request mix, the memory accounting, the launcher of the paged decode
kernel, the float64 reference, each exercise's cases and the static-batching simulation). The
tests import the same givens, so the notebook and its tests check the same things. In solution
mode the notebook's stubs are replaced by these.
"""

from __future__ import annotations

import math

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
    "paged_inputs",
    "paged_reference",
    "paged_decode_kernel",
    "launch_paged_decode",
    "decode_cases",
    "decode_ideal_bytes",
    "merge_partials",
    "split_attention",
    "merge_reference",
    "merge_cases",
    "prepare_append",
    "prepare_append_reference",
    "prepare_append_cases",
    "diagnose_append",
    "admit",
    "admit_cases",
    "diagnose_admit",
    "admit_reference",
    "unmodified",
    "static_batching",
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
    """Shuffled physical blocks, positions in any order, a block boundary, padding."""
    cases = []
    for block_size, num_blocks, used in ((16, 40, 5), (8, 64, 9), (32, 12, 3)):
        table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
        positions = torch.randint(0, used * block_size, (11,), generator=gen)
        positions[0], positions[1], positions[2] = block_size - 1, block_size, -1  # a boundary, padding
        cases.append((table, positions, block_size))
    return cases


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
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    seq_lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    out = torch.empty(batch, n_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = seq_lens[b]
        blocks = block_tables[b, : -(-n // block_size)].long().cpu()
        k = k_cache.cpu()[blocks].double().reshape(-1, n_kv_heads, head_dim)[:n]  # (n, Hkv, D)
        v = v_cache.cpu()[blocks].double().reshape(-1, n_kv_heads, head_dim)[:n]
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
    """One program per (sequence, query head); ``out`` is written in place and returned."""
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


def decode_cases(gen: torch.Generator) -> list[tuple]:
    """Exercise 2's cases: lengths 1, exactly a block and one past it, GQA and MQA, fp32 and bf16.

    ``seq_lens`` comes as a list (so that a NOT SOLVED verdict prints the lengths); the candidate
    turns it into the int32 tensor the kernel takes."""
    cases = []
    for lens, hq, hkv, block_size, dtype in (([1, 16, 17, 40], 4, 2, 16, torch.float32),
                                             ([8, 3, 25], 4, 1, 8, torch.float32),
                                             ([33, 64], 2, 2, 32, torch.bfloat16)):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        q, k_cache, v_cache, tables, _ = paged_inputs(lens, hq, hkv, 32, block_size, dtype=dtype,
                                                      device=kernel_ladder.runtime.DEVICE, seed=seed)
        cases.append((q, k_cache, v_cache, tables, lens))  # seq_lens as a list: the verdict shows it
    return cases


def decode_ideal_bytes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, out: torch.Tensor | None = None) -> int:
    """Decode's floor: ``q`` read and the output written once, each sequence's cached tokens of K
    and V read once per kv head, the block table entries it uses and ``seq_lens`` read once."""
    block_size, n_kv_heads, head_dim = k_cache.shape[1:]
    tokens = int(seq_lens.sum())
    blocks = sum(-(-int(n) // block_size) for n in seq_lens.tolist())
    kv = tokens * n_kv_heads * head_dim * (k_cache.element_size() + v_cache.element_size())
    return (2 * q.numel() * q.element_size() + kv + blocks * block_tables.element_size()
            + seq_lens.numel() * seq_lens.element_size())


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
    """Uneven splits, an empty split, a split holding the row's maximum, masked keys."""
    cases = []
    for rows, bounds, dims in ((4, [0, 16, 32], 8), (5, [0, 7, 7, 30, 33], 16), (3, [0, 1, 40, 41], 4)):
        total = bounds[-1]
        scores = torch.randn(rows, total, generator=gen) * 3
        scores[0, -1] += 15.0  # row 0's weight is almost all in the last split
        scores[1, : bounds[1]] = float("-inf")  # row 1 sees nothing in the first split
        cases.append((scores, torch.randn(total, dims, generator=gen), bounds))
    return cases


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


def unmodified(fn):
    """Exercise 4's candidate wrapper: ``fn(*args)``, failing if it changed its (list) arguments."""
    import copy

    def run(*args):
        before = copy.deepcopy(args)
        result = fn(*args)
        if list(args) != list(before):
            raise AssertionError("the arguments were modified: copy the lists first (list(table), ...) and "
                                 "return the new ones")
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
    """Budget-bound, block-bound, seat-bound and head-of-line cases."""
    cases = [
        ([100, 50, 20], 10, 100, 16, 128, 64),  # the budget chunks the second prompt; the third waits
        ([64, 300, 8], 2, 12, 16, 512, 64),     # blocks run out at the long prompt: the short one waits
        ([500, 8], 0, 40, 16, 64, 64),          # a chunk of 64 tokens, but all 32 blocks reserved
        ([500, 8], 0, 10, 16, 64, 64),          # the chunk would fit in 4 blocks, the prompt needs 32: wait
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
