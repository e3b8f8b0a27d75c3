"""Chapter 08's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (the same givens from ``solutions.ch08_kv_cache``:
cases, launcher, reference, diagnosis), once with the solution (SOLVED) and once per negative control
— a plausible wrong answer the checker must reject, with the diagnosis it must give. The admission
rule is also checked against :class:`kernel_ladder.serving.Scheduler`, which must apply the same rule.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from kernel_ladder.serving import PagedKVCache, Scheduler
from solutions import ch08_kv_cache as given
from utils.exercises import check

pytestmark = pytest.mark.interpreter  # the kernel's diagnoses need the interpreter


# ----------------------------------------------------------------------------------------------
# Exercise 1: slot mapping
# ----------------------------------------------------------------------------------------------


def slots_offset_and_block_swapped(block_table, positions, block_size):
    pos = positions.clamp(min=0).long()
    slots = (pos % block_size) * block_size + block_table.long()[pos // block_size]
    return torch.where(positions < 0, torch.full_like(slots, -1), slots)


def slots_without_the_table(block_table, positions, block_size):
    return torch.where(positions < 0, torch.full_like(positions, -1), positions.long())  # logical = physical


def slots_without_padding(block_table, positions, block_size):
    pos = positions.long()  # -1 // 16 = -1: the table's last entry, not padding
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def test_slot_mapping_solution_solves():
    assert check("ch08.slot_mapping", given.slot_mapping, given.slot_mapping_reference,
                 given.slot_mapping_cases).solved


@pytest.mark.parametrize("wrong", [slots_offset_and_block_swapped, slots_without_the_table, slots_without_padding])
def test_slot_mapping_negative_controls(wrong):
    verdict = check("ch08.slot_mapping", wrong, given.slot_mapping_reference, given.slot_mapping_cases)
    assert not verdict.solved and "wrong" in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 2: the block-table walk
# ----------------------------------------------------------------------------------------------


@triton.jit
def buggy_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    scale, n_q_heads, n_kv_heads,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BUG: tl.constexpr,
):
    # The solution's walk with one mistake: BUG 0 reads logical block j (no table), 1 reads the whole
    # last block (no tail mask), 2 maps query heads to kv heads modulo (wrong GQA grouping).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if BUG == 2:
        kv_head = h % n_kv_heads
    else:
        kv_head = h // (n_q_heads // n_kv_heads)
    d = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + b)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        if BUG == 0:
            block = j.to(tl.int64)
        else:
            block = tl.load(block_tables_ptr + b * stride_tb + j).to(tl.int64)
        if BUG == 1:
            valid = tokens >= 0
        else:
            valid = j * BLOCK_SIZE + tokens < seq_len
        rows = block * stride_kb + tokens[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + b * stride_qb + h * stride_qh + d, (acc / l).to(out_ptr.dtype.element_ty))


class _WithBug:
    """``kernel[grid](...)`` with the ``BUG`` switch set, so the given launcher runs the buggy kernel."""

    def __init__(self, bug: int):
        self.bug = bug

    def __getitem__(self, grid):
        return lambda *args, **kwargs: buggy_decode_kernel[grid](*args, BUG=self.bug, **kwargs)


def decode_with(kernel):
    def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out):
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
        return given.launch_paged_decode(kernel, q, k_cache, v_cache, block_tables, lens, out)

    return paged_decode


def test_paged_decode_solution_solves():
    assert check("ch08.paged_decode_kernel", decode_with(given.paged_decode_kernel), given.paged_reference,
                 given.decode_cases, out=True).solved


@pytest.mark.parametrize("bug", [0, 1, 2], ids=["logical-block", "no-tail-mask", "modulo-gqa"])
def test_paged_decode_negative_controls(bug):
    verdict = check("ch08.paged_decode_kernel", decode_with(_WithBug(bug)), given.paged_reference,
                    given.decode_cases, out=True)
    assert not verdict.solved, verdict.message


def test_the_production_kernel_passes_the_same_check():
    def production(q, k_cache, v_cache, block_tables, seq_lens, out):
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
        out.copy_(kernel_ladder.paged_attention(q, k_cache, v_cache, block_tables, lens))
        return out

    assert check("ch08.paged_decode_kernel", production, given.paged_reference, given.decode_cases, out=True).solved


def test_the_lesson_kernel_reads_kv_once_per_query_head_and_production_once_per_kv_head():
    from utils.trace import trace

    inputs = given.paged_inputs([100, 33, 57], 8, 2, 32, 16, device=kernel_ladder.runtime.DEVICE, seed=1)
    ideal = given.decode_ideal_bytes(*inputs)
    with trace() as per_head:
        given.launch_paged_decode(given.paged_decode_kernel, *inputs, torch.empty_like(inputs[0]))
    with trace() as grouped:
        kernel_ladder.paged_attention(*inputs)
    assert grouped.bytes <= 1.05 * ideal
    assert per_head.bytes > 3.5 * ideal  # G = 4: the K/V read four times


# ----------------------------------------------------------------------------------------------
# Exercise 3: the split merge
# ----------------------------------------------------------------------------------------------


def merge_with(merge):
    return lambda scores, v, bounds: merge(*given.split_attention(scores, v, bounds))


def merge_by_averaging(outs, lses):
    outs = torch.nan_to_num(outs)
    return outs.mean(dim=0), lses.amax(dim=0)


def merge_without_masking_empty_splits(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse[None])[..., None] * outs).sum(dim=0), lse  # 0 * NaN = NaN


def merge_with_the_max_as_lse(outs, lses):
    lse = lses.amax(dim=0)  # the largest split's lse, not the total's
    weights = torch.exp(lses - lse[None])
    outs = torch.where(torch.isinf(lses)[..., None], torch.zeros_like(outs), outs)
    return (weights[..., None] * outs).sum(dim=0), lse


def test_merge_solution_solves():
    assert check("ch08.merge_partials", merge_with(given.merge_partials), given.merge_reference,
                 given.merge_cases).solved


@pytest.mark.parametrize(("wrong", "diagnosis"), [(merge_by_averaging, "wrong"),
                                                  (merge_without_masking_empty_splits, "NaN"),
                                                  (merge_with_the_max_as_lse, "wrong")])
def test_merge_negative_controls(wrong, diagnosis):
    verdict = check("ch08.merge_partials", merge_with(wrong), given.merge_reference, given.merge_cases)
    assert not verdict.solved and diagnosis in verdict.message, verdict.message


# ----------------------------------------------------------------------------------------------
# Exercise 4: copy-on-write
# ----------------------------------------------------------------------------------------------


def append_without_copy(table, length, block_size, refcounts, free):
    table, refcounts, free = list(table), list(refcounts), list(free)
    if length % block_size == 0:
        block = free.pop(0)
        refcounts[block] = 1
        table.append(block)
    return table, refcounts, free, None  # writes into a shared partial block


def append_copying_every_shared_block(table, length, block_size, refcounts, free):
    table, refcounts, free = list(table), list(refcounts), list(free)
    if table and refcounts[table[-1]] > 1:  # copies a shared *full* last block too
        block = free.pop(0)
        refcounts[block], old = 1, table[-1]
        refcounts[old] -= 1
        table[-1] = block
        if length % block_size == 0:
            new = free.pop(0)
            refcounts[new] = 1
            table.append(new)
        return table, refcounts, free, (old, block)
    return given.prepare_append(table, length, block_size, refcounts, free)


def append_keeping_the_old_reference(table, length, block_size, refcounts, free):
    table, refcounts, free, copy = given.prepare_append(table, length, block_size, refcounts, free)
    if copy is not None:
        refcounts[copy[0]] += 1  # the old block keeps this sequence's reference: it leaks
    return table, refcounts, free, copy


def test_prepare_append_solution_solves():
    assert check("ch08.prepare_append", given.unmodified(given.prepare_append), given.prepare_append_reference,
                 given.prepare_append_cases, compare=given.diagnose_append).solved


def append_in_place(table, length, block_size, refcounts, free):
    new = given.prepare_append(table, length, block_size, refcounts, free)
    table[:], refcounts[:], free[:] = new[0], new[1], new[2]  # right values, but the caller's lists changed
    return new


@pytest.mark.parametrize(("wrong", "diagnosis"), [(append_without_copy, "is shared"),
                                                  (append_copying_every_shared_block, "only a shared block"),
                                                  (append_keeping_the_old_reference, "reference counts wrong"),
                                                  (append_in_place, "arguments were modified")])
def test_prepare_append_negative_controls(wrong, diagnosis):
    verdict = check("ch08.prepare_append", given.unmodified(wrong), given.prepare_append_reference,
                    given.prepare_append_cases, compare=given.diagnose_append)
    assert not verdict.solved and diagnosis in verdict.message, verdict.message


def test_prepare_append_does_not_modify_its_arguments():
    table, refcounts, free = [3, 1], [0, 2, 0, 1, 0], [0, 2, 4]
    given.prepare_append(table, 6, 4, refcounts, free)
    assert (table, refcounts, free) == ([3, 1], [0, 2, 0, 1, 0], [0, 2, 4])


def test_the_paged_cache_copies_on_write_as_the_exercise_says():
    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2)
    cache.allocate("a", 6)
    cache.append_slots("a", 6)
    cache.k.normal_()
    cache.fork("a", "b")
    before = cache.gather("a", 1)[0].clone()
    table = cache.block_table("b")
    refcounts = [cache.allocator.refcount(i) for i in range(8)]
    new_table, _, _, copy = given.prepare_append(table, 6, 4, refcounts, [i for i in range(8) if refcounts[i] == 0])
    cache.append_slots("b", 1)
    assert copy is not None and cache.block_table("b")[-1] != table[-1] and cache.block_table("b")[0] == table[0]
    assert torch.equal(cache.gather("b", 1)[0][:6], before) and torch.equal(cache.gather("a", 1)[0], before)
    cache.check_invariants()


# ----------------------------------------------------------------------------------------------
# Exercise 5: the admission rule
# ----------------------------------------------------------------------------------------------


def admit_skipping_ahead(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    budget, seats, chunks = token_budget - num_running, max_num_seqs - num_running, []
    for prompt in waiting:
        chunk, blocks = min(prompt, budget), -(-prompt // block_size)
        if seats == 0 or budget <= 0 or blocks > free_blocks:
            continue  # a later, smaller request overtakes
        chunks.append(chunk)
        budget, free_blocks, seats = budget - chunk, free_blocks - blocks, seats - 1
    return chunks


def admit_reserving_the_chunk_only(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    budget, seats, chunks = token_budget - num_running, max_num_seqs - num_running, []
    for prompt in waiting:
        chunk = min(prompt, budget)
        blocks = -(-chunk // block_size)  # the rest of the prompt may find no block later
        if seats == 0 or budget <= 0 or blocks > free_blocks:
            break
        chunks.append(chunk)
        budget, free_blocks, seats = budget - chunk, free_blocks - blocks, seats - 1
    return chunks


def admit_ignoring_the_decodes(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    return given.admit(waiting, 0, free_blocks, block_size, token_budget, max_num_seqs + num_running)


def admit_without_the_seat_check(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    return given.admit(waiting, num_running, free_blocks, block_size, token_budget, 10**6)


def test_admit_solution_solves():
    assert check("ch08.admit", given.admit, given.admit_reference, given.admit_cases,
                 compare=given.diagnose_admit).solved


@pytest.mark.parametrize("wrong", [admit_skipping_ahead, admit_reserving_the_chunk_only, admit_ignoring_the_decodes,
                                   admit_without_the_seat_check])
def test_admit_negative_controls(wrong):
    diagnosis = "The first request that fails one stops admission"
    verdict = check("ch08.admit", wrong, given.admit_reference, given.admit_cases, compare=given.diagnose_admit)
    assert not verdict.solved and diagnosis in verdict.message, verdict.message


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_scheduler_admits_by_the_exercises_rule(seed):
    """A first step over an empty cache: the Scheduler's prefill chunks are exactly ``admit``'s."""
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, int(torch.randint(4, 40, (1,), generator=gen))
    budget, seats = int(torch.randint(16, 300, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
    prompts = torch.randint(1, 200, (6,), generator=gen).tolist()
    cache = PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=2)
    scheduler = Scheduler(cache, max_num_seqs=seats, max_tokens_per_step=budget)
    for i, n in enumerate(prompts):
        if cache.blocks_for(n) <= num_blocks:  # the scheduler refuses a request that can never fit
            scheduler.add_request(i, torch.randint(0, 1000, (n,), generator=gen).tolist(), max_new_tokens=1)
    waiting = [len(r.prompt_token_ids) for r in scheduler.waiting]
    out = scheduler.step()
    assert out.num_tokens == given.admit(waiting, 0, num_blocks, block_size, budget, seats)


def test_static_batching_counts_every_token():
    requests = [(5, 3), (2, 1), (7, 4)]
    steps = given.static_batching(requests, 2)
    # batch 1: prefill 7 (sampling a token each), then the 3-token output's 2 more steps; batch 2 likewise
    assert steps == [7, 1, 1, 7, 1, 1, 1]
    assert sum(steps) == sum(p + o - 1 for p, o in requests)  # the last sampled token is never fed back
