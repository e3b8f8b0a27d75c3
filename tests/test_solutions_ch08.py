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


def rejected(verdict, diagnosis: str) -> bool:
    """NOT SOLVED, saying ``diagnosis`` (the verdict's lines are wrapped: compared with single spaces)."""
    return not verdict.solved and diagnosis in " ".join(verdict.message.split())


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


def slots_in_int32(block_table, positions, block_size):
    pos = positions.clamp(min=0)
    slots = block_table[pos // block_size] * block_size + (pos % block_size).to(torch.int32)  # int32 arithmetic
    return torch.where(positions < 0, torch.full_like(slots, -1), slots).long()


def slots_counting_blocks_as_tokens(block_table, positions, block_size):
    pos = positions.clamp(min=0).long()
    slots = block_table.long()[pos // block_size] + pos % block_size
    return torch.where(positions < 0, torch.full_like(slots, -1), slots)


def slots_without_the_offset(block_table, positions, block_size):
    pos = positions.clamp(min=0).long()
    slots = block_table.long()[pos // block_size] * block_size
    return torch.where(positions < 0, torch.full_like(slots, -1), slots)


def slots_offset_by_floor_division(block_table, positions, block_size):
    pos = positions.clamp(min=0).long()
    slots = block_table.long()[pos // block_size] * block_size + pos // block_size  # the block's index, not p % B
    return torch.where(positions < 0, torch.full_like(slots, -1), slots)


def slots_one_token_at_a_time(block_table, positions, block_size):
    # the right slots, but a Python loop over the tokens (a host sync each): the spec asks for tensor ops only
    return torch.tensor([-1 if p < 0 else int(block_table[p // block_size]) * block_size + p % block_size
                         for p in positions.tolist()], dtype=torch.int64)


def slots_through_the_host(block_table, positions, block_size):
    # the right slots, no loop, but the table goes to the host and back (a sync before the write kernel)
    pos = positions.clamp(min=0).long()
    table = torch.tensor(block_table.tolist(), dtype=torch.int64)
    slots = table[pos // block_size] * block_size + pos % block_size
    return torch.where(positions < 0, torch.full_like(slots, -1), slots)


def check_slots(candidate):
    return check("ch08_kv_cache.slot_mapping", candidate, given.slot_mapping_reference, given.slot_mapping_cases,
                 rules=given.slot_mapping_rules(), diagnose=given.diagnose_slot_mapping)


def test_slot_mapping_solution_solves():
    verdict = check_slots(given.slot_mapping)
    assert verdict.solved and "rules kept: tensor ops only" in verdict.message, verdict.message


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (slots_offset_and_block_swapped, "cause: the block and the offset are swapped"),
    (slots_without_the_table, "cause: the slots are the logical positions: the block table is not used"),
    (slots_without_padding, "is padding (negative), but its slot is"),
    (slots_in_int32, "it is past 2^31 and wrapped around — block · block_size was computed in int32"),
    (slots_counting_blocks_as_tokens, "cause: the block id is not multiplied by block_size"),
    (slots_without_the_offset, "cause: the offset in the block (p % block_size) is missing"),
    (slots_offset_by_floor_division, "cause: the offset in the block was computed with // (p // block_size, the "
                                     "block's index): the offset is p % block_size"),
    (slots_one_token_at_a_time, "broke a stated rule — the spec asks for tensor ops only (no Python loop, no round "
                                "trip through the host: the slots feed a kernel on the device): a list comprehension "
                                "at line"),
    (slots_through_the_host, "broke a stated rule — the spec asks for tensor ops only (no Python loop, no round trip "
                             "through the host: the slots feed a kernel on the device): the code took values to the "
                             "host: .tolist()"),
])
def test_slot_mapping_negative_controls(wrong, diagnosis):
    verdict = check_slots(wrong)
    assert rejected(verdict, diagnosis), verdict.message


def test_the_slot_cases_reach_past_two_to_the_31():
    """The pool of the last case has more than 2^31 slots: int32 arithmetic cannot hold its slots."""
    table, positions, block_size = given.slot_mapping_cases(torch.Generator().manual_seed(0))[-1]
    slots = given.slot_mapping_reference(table, positions, block_size)
    assert table.dtype == torch.int32 and int(slots.max()) >= 2**31


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
    # The solution's walk with one mistake (the BUG names in DECODE_BUGS below).
    if BUG == "int32 offsets":
        b = tl.program_id(0)
    else:
        b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if BUG == "modulo gqa":
        kv_head = h % n_kv_heads
    else:
        kv_head = h // (n_q_heads // n_kv_heads)
    d = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    if BUG == "16-bit arithmetic":
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d)  # left in the cache's dtype
    else:
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + b)
    if BUG == "max starts at 0":
        m = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    else:
        m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    if BUG == "one block too many":
        n_blocks = tl.cdiv(seq_len, BLOCK_SIZE) + 1
    elif BUG == "whole blocks only":
        n_blocks = seq_len // BLOCK_SIZE
    else:
        n_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    for j in range(0, n_blocks):
        if BUG == "logical block":
            block = j
        elif BUG == "int32 offsets":
            block = tl.load(block_tables_ptr + b * stride_tb + j)  # int32, as the table holds it
        else:
            block = tl.load(block_tables_ptr + b * stride_tb + j).to(tl.int64)
        if BUG == "no tail mask":
            valid = tokens >= 0
        else:
            valid = j * BLOCK_SIZE + tokens < seq_len
        rows = block * stride_kb + tokens[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + rows, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows, mask=valid[:, None], other=0.0)
        if BUG != "16-bit arithmetic":
            k, v = k.to(tl.float32), v.to(tl.float32)
        if BUG == "unscaled":
            s = tl.sum(k * q[None, :], axis=1)
        else:
            s = tl.sum(k * q[None, :], axis=1) * scale
        if BUG != "tail scores 0":
            s = tl.where(valid, s, float("-inf"))
        if BUG == "no max subtracted":
            p = tl.exp(s)
            l = l + tl.sum(p, axis=0)
            acc = acc + tl.sum(p[:, None] * v, axis=0)
        else:
            if BUG == "tile's own max":
                m_new = tl.max(s, axis=0)
            else:
                m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            if BUG == "l not rescaled":
                l = l + tl.sum(p, axis=0)
            else:
                l = l * alpha + tl.sum(p, axis=0)
            if BUG == "acc not rescaled":
                acc = acc + tl.sum(p[:, None] * v, axis=0)
            else:
                acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
    tl.store(out_ptr + b * stride_qb + h * stride_qh + d, (acc / l).to(out_ptr.dtype.element_ty))


class _WithBug:
    """``kernel[grid](...)`` with the ``BUG`` switch set, so the given launcher runs the buggy kernel."""

    def __init__(self, bug: str):
        self.bug = bug

    def __getitem__(self, grid):
        return lambda *args, **kwargs: buggy_decode_kernel[grid](*args, BUG=self.bug, **kwargs)


def decode_with(kernel):
    def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out):
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
        return given.launch_paged_decode(kernel, q, k_cache, v_cache, block_tables, lens, out)

    return paged_decode


def check_decode(paged_decode):
    """Exercise 2's check as the notebook runs it."""
    return check("ch08_kv_cache.paged_decode_kernel", given.with_table_reads(paged_decode), given.paged_reference,
                 given.decode_cases, out=True, rules=given.decode_rules(), diagnose=given.diagnose_decode,
                 traffic=given.decode_traffic())


def test_paged_decode_solution_solves():
    verdict = check_decode(decode_with(given.paged_decode_kernel))
    message = " ".join(verdict.message.split())
    assert verdict.solved, verdict.message
    assert ("rules kept: visit the blocks 0 .. ceil(seq_len / BLOCK_SIZE) − 1 only; compute in fp32 whatever the "
            "cache dtype") in message
    # G = 2 on the traced case: K and V streamed once per query head, the top of the ladder reads them once
    assert "k_cache read 2.00× its size" in message and "K and V are read once per query head" in message
    assert verdict.traffic.top / verdict.traffic.ideal < 1.05 < 1.8 < verdict.traffic.ratio


DECODE_BUGS = {
    "logical block": "cause: the block table is not used: block j of the sequence is read as physical block j",
    "no tail mask": "cause: the tokens past seq_len in the last block are attended",
    "tail scores 0": "cause: the tokens past seq_len in the last block get score 0",
    "whole blocks only": "cause: the last, partial block is never visited",
    "modulo gqa": "cause: query head h reads kv head h % n_kv_heads",
    "unscaled": "cause: the scores are not scaled",
    "l not rescaled": "cause: the running sum l is not rescaled",
    "acc not rescaled": "cause: the accumulator is not rescaled",
    "max starts at 0": "cause: the running maximum starts at 0, not -inf",
    "tile's own max": "cause: each block is rescaled by its own maximum, not the running one",
    "no max subtracted": "cause: exp is taken of the raw scores",
    "int32 offsets": "whose blocks lie past 2^31 elements (block 2048 starts at element 2^31 here): block * stride_kb "
                     "wrapped around in int32",
    "16-bit arithmetic": "broke a stated rule — compute in fp32 whatever the cache dtype: ",
    "one block too many": "broke a stated rule — visit the blocks 0 .. ceil(seq_len / BLOCK_SIZE) − 1 only: sequence 0 "
                          "(1 token: ceil(1 / 16) = 1 block) read block_tables[0, 1] — the walk goes one block too far",
}


@pytest.mark.parametrize("bug", list(DECODE_BUGS))
def test_paged_decode_negative_controls(bug):
    verdict = check_decode(decode_with(_WithBug(bug)))
    assert rejected(verdict, DECODE_BUGS[bug]), verdict.message


def test_a_walk_one_block_too_far_is_not_asked_about_a_mask():
    """Its extra block is all masked, so its values are right: the rule names the walk, nothing else."""
    verdict = check_decode(decode_with(_WithBug("one block too many")))
    assert "out of bounds" not in verdict.message and "mask" not in verdict.message, verdict.message


def test_the_production_kernel_passes_the_same_check():
    def production(q, k_cache, v_cache, block_tables, seq_lens, out):
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
        k_cache, v_cache = given.cache_tensor(k_cache), given.cache_tensor(v_cache)
        out.copy_(kernel_ladder.paged_attention(q, k_cache, v_cache, block_tables, lens))
        return out

    verdict = check_decode(production)
    assert verdict.solved and verdict.traffic.ratio < 1.1, verdict.message  # its input checks and the copy: a few %


def test_the_decode_cases_reach_past_two_to_the_31_and_keep_their_scores():
    cases = given.decode_cases(torch.Generator().manual_seed(0))
    far = [c for c in cases if isinstance(c[1], given.FarCache)]
    assert len(far) == 1
    q, k_far, _, tables, lens = far[0]
    stride = k_far.tensor.stride(0)
    assert int(tables.max()) * stride >= 2**31 > stride  # the offset passes 2^31, the stride alone does not
    q, k_cache, v_cache, tables, lens = cases[-1]
    scores = torch.einsum("hd,nhd->hn", q[0].double(), k_cache[tables[0, :3].long()].reshape(-1, 2, 16)
                          .repeat_interleave(2, dim=1).double()) / 4
    assert float(scores.max()) < -240  # every score of sequence 0 near -250


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


def check_merge(merge):
    """Exercise 3's check as the notebook runs it (fp32 holds a log-sum-exp near 800 to about 5e-5)."""
    return check("ch08_kv_cache.merge_partials", merge_with(merge), given.merge_reference, given.merge_cases,
                 tolerance=given.merge_tolerance, diagnose=given.diagnose_merge)


def _masked(outs, lses):
    return torch.where((torch.isinf(lses) & (lses < 0))[..., None], torch.zeros_like(outs), outs)


def merge_by_averaging(outs, lses):
    outs = torch.nan_to_num(outs)
    return outs.mean(dim=0), torch.logsumexp(lses, dim=0)


def merge_without_masking_empty_splits(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse[None])[..., None] * outs).sum(dim=0), lse  # 0 * NaN = NaN


def merge_with_the_max_as_lse(outs, lses):
    lse = lses.amax(dim=0)  # the largest split's lse, not the total's
    weights = torch.exp(lses - lse[None])
    return (weights[..., None] * _masked(outs, lses)).sum(dim=0), lse


def merge_by_exp_of_lse(outs, lses):
    weights = torch.exp(lses) / torch.exp(lses).sum(dim=0)  # inf / inf near +120, 0 / 0 near -300
    return (weights[..., None] * _masked(outs, lses)).sum(dim=0), torch.logsumexp(lses, dim=0)


def merge_by_exp_of_lse_in_float64(outs, lses):
    out, lse = merge_by_exp_of_lse(outs.double(), lses.double())  # survives 120, not 800
    return out.to(outs.dtype), lse.to(lses.dtype)


def merge_by_log_of_summed_exp(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    out = (torch.exp(lses - lse[None])[..., None] * _masked(outs, lses)).sum(dim=0)
    return out, torch.log(torch.exp(lses).sum(dim=0))  # inf near +120


def merge_by_exp_of_lse_everywhere(outs, lses):
    total = torch.exp(lses).sum(dim=0)  # inf near +120, 0 near -300: the weights and the lse both
    return (torch.exp(lses)[..., None] * _masked(outs, lses)).sum(dim=0) / total[..., None], torch.log(total)


def merge_without_weights(outs, lses):
    return _masked(outs, lses).sum(dim=0), torch.logsumexp(lses, dim=0)


def merge_by_a_plain_mean(outs, lses):
    seen = ~(torch.isinf(lses) & (lses < 0))  # the splits that saw a key, averaged with equal weights
    return _masked(outs, lses).sum(dim=0) / seen.sum(dim=0).clamp(min=1)[..., None], torch.logsumexp(lses, dim=0)


def test_merge_solution_solves():
    assert check_merge(given.merge_partials).solved


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (merge_by_averaging, "cause: the splits are averaged"),
    (merge_without_masking_empty_splits, "cause: a split that saw no key (lse = -inf, its output NaN) is multiplied "
                                         "by its weight 0"),
    (merge_with_the_max_as_lse, "the returned log-sum-exp is the largest split's"),
    (merge_by_exp_of_lse, "cause: the weights are exp(lses[s]) / Σ exp(lses[s]): exp overflows"),
    (merge_by_exp_of_lse_everywhere, "cause: the weights and the log-sum-exp both take exp(lses[s]) as it is"),
    (merge_by_exp_of_lse_in_float64, "cause: the weights are exp(lses[s]) / Σ exp(lses[s]): exp overflows"),
    (merge_by_log_of_summed_exp, "cause: the log-sum-exp is log(Σ exp(lses[s])): exp overflows"),
    (merge_by_a_plain_mean, "cause: the splits' outputs are averaged with a plain mean (over the splits that saw a "
                            "key)"),
    (merge_without_weights, "cause: the splits' outputs are added without weights"),
])
def test_merge_negative_controls(wrong, diagnosis):
    verdict = check_merge(wrong)
    assert rejected(verdict, diagnosis), verdict.message
    assert " ".join(verdict.message.split()).count("exp overflows") <= 1, verdict.message  # one cause, said once


def test_the_merge_cases_reach_scores_past_float64s_exp():
    cases = given.merge_cases(torch.Generator().manual_seed(0))
    scores = cases[-1][0]
    assert float(scores.max()) > 710 and float(scores.min()) < -750  # exp overflows / underflows in float64
    # only that case is judged at fp32's precision of its log-sum-exps; the others at the default
    assert [given.merge_tolerance(case, torch.float32) for case in cases] == [None, None, None, (1e-4, 1e-5)]


def test_a_merge_off_by_1e_4_passes_only_the_extreme_case():
    """The per-case tolerance is no loophole: an error of 1e-4 on the ordinary cases is still wrong."""

    def merge_slightly_off(outs, lses):
        out, lse = given.merge_partials(outs, lses)
        return out * (1 + 5e-5), lse

    assert rejected(check_merge(merge_slightly_off), "case 1 of 4")


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


def check_append(candidate):
    return check("ch08_kv_cache.prepare_append", given.unmodified(candidate), given.prepare_append_reference,
                 given.prepare_append_cases, compare=given.diagnose_append, diagnose=given.diagnose_append_cause)


def test_prepare_append_solution_solves():
    assert check_append(given.prepare_append).solved


def append_in_place(table, length, block_size, refcounts, free):
    new = given.prepare_append(table, length, block_size, refcounts, free)
    table[:], refcounts[:], free[:] = new[0], new[1], new[2]  # right values, but the caller's lists changed
    return new


def append_taking_the_last_free_block(table, length, block_size, refcounts, free):
    table, refcounts, free = list(table), list(refcounts), list(free)
    return given.prepare_append(table, length, block_size, refcounts, free[::-1])[:2] + (
        free[:-1] if length % block_size == 0 or refcounts[table[length // block_size]] > 1 else free,
        given.prepare_append(table, length, block_size, refcounts, free[::-1])[3])


def append_without_growing(table, length, block_size, refcounts, free):
    if length % block_size == 0:
        return list(table), list(refcounts), list(free), None  # the full last block gets no successor
    return given.prepare_append(table, length, block_size, refcounts, free)


def append_copy_backwards(table, length, block_size, refcounts, free):
    table, refcounts, free, copy = given.prepare_append(table, length, block_size, refcounts, free)
    return table, refcounts, free, None if copy is None else (copy[1], copy[0])


def append_forgetting_the_new_count(table, length, block_size, refcounts, free):
    new_table, counts, pool, copy = given.prepare_append(table, length, block_size, refcounts, free)
    if pool != list(free):
        counts[free[0]] = 0  # the new block is used but counted by nobody
    return new_table, counts, pool, copy


def append_dropping_every_reference(table, length, block_size, refcounts, free):
    new_table, counts, pool, copy = given.prepare_append(table, length, block_size, refcounts, free)
    if copy is not None:
        counts[copy[0]] = 0  # the other sequences still use it
    return new_table, counts, pool, copy


def append_leaving_the_table(table, length, block_size, refcounts, free):
    new_table, counts, pool, copy = given.prepare_append(table, length, block_size, refcounts, free)
    return (list(table) if copy is not None else new_table), counts, pool, copy


def append_adding_the_copy_at_the_end(table, length, block_size, refcounts, free):
    new_table, counts, pool, copy = given.prepare_append(table, length, block_size, refcounts, free)
    if copy is not None:
        new_table = list(table) + [copy[1]]  # the copy appended after the shared block instead of replacing it
    return new_table, counts, pool, copy


def append_returning_a_tuple(table, length, block_size, refcounts, free):
    new_table, counts, pool, copy = given.prepare_append(table, length, block_size, refcounts, free)
    return tuple(new_table), counts, pool, copy


def append_freeing_the_shared_block(table, length, block_size, refcounts, free):
    new_table, counts, pool, copy = given.prepare_append(table, length, block_size, refcounts, free)
    if copy is not None:
        pool = pool + [copy[0]]  # the other sequences still hold it
    return new_table, counts, pool, copy


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (append_without_copy, "is shared"),
    (append_copying_every_shared_block, "only a shared block"),
    (append_keeping_the_old_reference, "reference counts wrong"),
    (append_in_place, "broke a stated rule — the spec returns new lists and leaves its arguments as they were: the "
                      "code modified table, refcounts, free in place"),
    (append_taking_the_last_free_block, "cause: the new block came from the end of the free list"),
    (append_without_growing, "cause: the last block is full (length % block_size == 0, or the sequence is empty), "
                             "but no block was added"),
    (append_copy_backwards, "cause: copy is (new, old)"),
    (append_forgetting_the_new_count, "cause: the new block's reference count was not set to 1"),
    (append_dropping_every_reference, "cause: the shared block's count was set to 0"),
    (append_leaving_the_table, "cause: the copy is returned but the table still points at the shared block"),
    (append_adding_the_copy_at_the_end, "cause: the new block was appended to the table, but it replaces the shared "
                                        "last block"),
    (append_returning_a_tuple, "table: return a list, got tuple"),
    (append_freeing_the_shared_block, "cause: the shared block was put back on the free list"),
])
def test_prepare_append_negative_controls(wrong, diagnosis):
    verdict = check_append(wrong)
    assert rejected(verdict, diagnosis), verdict.message


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


def admit_refusing_an_exact_fit(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    return given.admit(waiting, num_running, free_blocks - 1, block_size, token_budget, max_num_seqs)  # need < free


def admit_whole_prompts_only(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    budget, seats, chunks = token_budget - num_running, max_num_seqs - num_running, []
    for prompt in waiting:
        blocks = -(-prompt // block_size)
        if seats <= 0 or budget < prompt or blocks > free_blocks:  # no chunked prefill
            break
        chunks.append(prompt)
        budget, free_blocks, seats = budget - prompt, free_blocks - blocks, seats - 1
    return chunks


def admit_without_chunking(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    budget, seats, chunks = token_budget - num_running, max_num_seqs - num_running, []
    for prompt in waiting:
        blocks = -(-prompt // block_size)
        if seats <= 0 or budget <= 0 or blocks > free_blocks:
            break
        chunks.append(prompt)  # the whole prompt, past the budget left
        budget, free_blocks, seats = budget - prompt, free_blocks - blocks, seats - 1
    return chunks


def admit_counting_blocks_by_floor(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    budget, seats, chunks = token_budget - num_running, max_num_seqs - num_running, []
    for prompt in waiting:
        blocks = prompt // block_size  # a partial last block is not counted
        if seats <= 0 or budget <= 0 or blocks > free_blocks:
            break
        chunks.append(min(prompt, budget))
        budget, free_blocks, seats = budget - chunks[-1], free_blocks - blocks, seats - 1
    return chunks


def admit_with_seats_from_zero(waiting, num_running, free_blocks, block_size, token_budget, max_num_seqs):
    return given.admit(waiting, 0, free_blocks, block_size, token_budget - num_running, max_num_seqs)


def check_admit(candidate):
    return check("ch08_kv_cache.admit", candidate, given.admit_reference, given.admit_cases,
                 compare=given.diagnose_admit, diagnose=given.diagnose_admit_cause)


def test_admit_solution_solves():
    assert check_admit(given.admit).solved


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (admit_skipping_ahead, "cause: a request that could not be admitted was skipped and a later one admitted"),
    (admit_reserving_the_chunk_only, "cause: blocks were reserved for the chunk only"),
    (admit_ignoring_the_decodes, "cause: the running sequences' decode tokens were not taken from the budget first"),
    (admit_without_the_seat_check, "cause: no seat limit"),
    (admit_with_seats_from_zero, "cause: the seats ignore the running sequences"),
    (admit_refusing_an_exact_fit, "cause: a request needing exactly the free blocks was refused"),
    (admit_whole_prompts_only, "cause: a prompt longer than the budget left was not chunked"),
    (admit_without_chunking, "cause: the whole prompt was admitted past the budget left"),
    (admit_counting_blocks_by_floor, "cause: the blocks were counted by floor division (prompt // block_size)"),
])
def test_admit_negative_controls(wrong, diagnosis):
    verdict = check_admit(wrong)
    assert rejected(verdict, diagnosis) and "The first request that fails one stops admission" in verdict.message, \
        verdict.message


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


# ----------------------------------------------------------------------------------------------
# Exercise 6: the absorbed decode's scores (DeepSeek-V3's MLA)
# ----------------------------------------------------------------------------------------------


def _w_uk(kv_b_weight, heads, nope, v_dim):
    return kv_b_weight.view(heads, nope + v_dim, kv_b_weight.shape[1])[:, :nope]


def scores_first_rows_as_w_uk(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    w_uk = kv_b_weight[: heads * nope].view(heads, nope, rank)  # the first H * nope rows: heads' blocks mixed up
    scale = (nope + q_pe.shape[-1]) ** -0.5
    return scale * (torch.einsum("hn,hnl->hl", q_nope, w_uk) @ latent[:, :rank].T + q_pe @ latent[:, rank:].T)


def scores_without_rope(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    q_latent = torch.einsum("hn,hnl->hl", q_nope, _w_uk(kv_b_weight, heads, nope, v_dim))
    return (nope + q_pe.shape[-1]) ** -0.5 * (q_latent @ latent[:, :rank].T)


def scores_scaled_by_nope(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    return given.absorbed_scores(q_nope, q_pe, latent, kv_b_weight, nope, v_dim) * (
        (nope + q_pe.shape[-1]) ** 0.5 / nope**0.5)


def scores_scaled_by_rank(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    return given.absorbed_scores(q_nope, q_pe, latent, kv_b_weight, nope, v_dim) * (
        (nope + q_pe.shape[-1]) ** 0.5 / kv_b_weight.shape[1] ** 0.5)


def scores_with_the_row_parts_swapped(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rope = q_nope.shape[0], q_pe.shape[-1]
    q_latent = torch.einsum("hn,hnl->hl", q_nope, _w_uk(kv_b_weight, heads, nope, v_dim))
    return (nope + rope) ** -0.5 * (q_latent @ latent[:, rope:].T + q_pe @ latent[:, :rope].T)  # [k_pe | c]


def scores_softmaxed(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    return torch.softmax(given.absorbed_scores(q_nope, q_pe, latent, kv_b_weight, nope, v_dim), -1)


def scores_expanded(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    # the right values, the unabsorbed way: every cached c through kv_b_proj into per-head keys
    return given.absorbed_scores_reference(q_nope, q_pe, latent, kv_b_weight, nope, v_dim)


def scores_by_broadcast_expansion(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    # every cached token's key, by a broadcast product and a sum instead of a matmul: no matmul FLOP at all
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    c, k_pe = latent[:, :rank], latent[:, rank:]
    k_nope = (_w_uk(kv_b_weight, heads, nope, v_dim)[:, None] * c[None, :, None]).sum(-1)  # (H, n, nope)
    scores = (q_nope[:, None] * k_nope).sum(-1) + (q_pe[:, None] * k_pe[None]).sum(-1)
    return scores / (nope + q_pe.shape[-1]) ** 0.5


def scores_by_vecdot_expansion(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    c, k_pe = latent[:, :rank], latent[:, rank:]
    k_nope = torch.linalg.vecdot(_w_uk(kv_b_weight, heads, nope, v_dim)[:, None], c[None, :, None])  # (H, n, nope)
    scores = torch.linalg.vecdot(q_nope[:, None], k_nope) + torch.linalg.vecdot(q_pe[:, None], k_pe[None])
    return scores / (nope + q_pe.shape[-1]) ** 0.5


def scores_scaling_the_query_in_place(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    # the right scores, but the caller's queries come back scaled
    scale = (nope + q_pe.shape[-1]) ** -0.5
    q_nope.mul_(scale)
    q_pe.mul_(scale)
    return given.absorbed_scores(q_nope, q_pe, latent, kv_b_weight, nope, v_dim) / scale


def scores_feature_major_w_uk(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    w_uk = kv_b_weight.view(nope + v_dim, heads, rank)[:nope].transpose(0, 1)  # row f·H + h: not transformers' split
    scale = (nope + q_pe.shape[-1]) ** -0.5
    return scale * (torch.einsum("hn,hnl->hl", q_nope, w_uk) @ latent[:, :rank].T + q_pe @ latent[:, rank:].T)


def scores_from_the_value_rows(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    w_uk = kv_b_weight.view(heads, nope + v_dim, rank)[:, v_dim:]  # the last nope rows of each head's block
    scale = (nope + q_pe.shape[-1]) ** -0.5
    return scale * (torch.einsum("hn,hnl->hl", q_nope, w_uk) @ latent[:, :rank].T + q_pe @ latent[:, rank:].T)


def scores_with_the_rope_part_unscaled(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    heads, rank = q_nope.shape[0], kv_b_weight.shape[1]
    q_latent = torch.einsum("hn,hnl->hl", q_nope, _w_uk(kv_b_weight, heads, nope, v_dim))
    return (nope + q_pe.shape[-1]) ** -0.5 * (q_latent @ latent[:, :rank].T) + q_pe @ latent[:, rank:].T


def scores_in_bf16(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
    # "like the kernel": the matmuls in bfloat16, the result cast back to the inputs' dtype
    low = (q_nope.bfloat16(), q_pe.bfloat16(), latent.bfloat16(), kv_b_weight.bfloat16())
    return given.absorbed_scores(*low, nope, v_dim).to(q_nope.dtype)


def check_absorbed(candidate):
    return check("ch08_kv_cache.absorbed_scores", candidate, given.absorbed_scores_reference,
                 given.absorbed_scores_cases, rules=given.absorbed_scores_rules(),
                 diagnose=given.diagnose_absorbed_scores)


def test_absorbed_scores_solution_solves():
    verdict = check_absorbed(given.absorbed_scores)
    assert verdict.solved and ("rules kept: absorbed: all arithmetic (matmul FLOPs, elementwise ops, reductions) "
                               "within 1.5× the absorbed form's; inputs left unchanged") in " ".join(
        verdict.message.split()), verdict.message


def test_absorbed_scores_equal_transformers_deepseek_v3_scores():
    """The reference is transformers' expansion: kv_b_proj(c).view(n, H, nope + v), keys = [k_nope | k_pe]."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = transformers.DeepseekV3Config(hidden_size=32, num_attention_heads=3, num_key_value_heads=3,
                                           kv_lora_rank=20, q_lora_rank=None, qk_rope_head_dim=8,
                                           qk_nope_head_dim=16, v_head_dim=12)
    attention = DeepseekV3Attention(config, layer_idx=0).double()
    gen = torch.Generator().manual_seed(3)
    c, k_pe = torch.randn(1, 1, 9, 20, generator=gen, dtype=torch.float64), torch.randn(1, 1, 9, 8, generator=gen,
                                                                                         dtype=torch.float64)
    with torch.no_grad():
        keys, _ = attention.expand_kv(c, k_pe)  # (1, H, n, nope + R)
    q = torch.randn(3, 24, generator=gen, dtype=torch.float64)
    want = torch.einsum("hd,hnd->hn", q, keys[0]) * attention.scaling
    got = given.absorbed_scores(q[:, :16], q[:, 16:], torch.cat([c[0, 0], k_pe[0, 0]], -1),
                                attention.kv_b_proj.weight.detach(), 16, 12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_count_arithmetic_counts_a_dot_product_alike_however_spelled():
    """A broadcast product and a sum, ``torch.linalg.vecdot`` and a matmul are the same 2·M·N·K operations;
    copies and casts are not arithmetic."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 7, generator=gen), torch.randn(3, 7, generator=gen)
    as_matmul = given.count_arithmetic(lambda: a @ b.T)
    assert as_matmul == {"matmul": 2 * 5 * 3 * 7, "elementwise": 0, "reduction": 0}
    assert sum(given.count_arithmetic(lambda: (a[:, None] * b[None]).sum(-1)).values()) == 2 * 5 * 3 * 7
    assert sum(given.count_arithmetic(lambda: torch.linalg.vecdot(a[:, None], b[None])).values()) == 2 * 5 * 3 * 7
    with torch.inference_mode():  # a composite op reaching the counter whole is counted as what it runs
        assert sum(given.count_arithmetic(lambda: torch.linalg.vecdot(a[:, None], b[None])).values()) == 2 * 5 * 3 * 7
    assert sum(given.count_arithmetic(lambda: (a.clone(), a.double(), a.T.contiguous())).values()) == 0
    assert given.count_arithmetic(lambda: a * 2 + 1) == {"matmul": 0, "elementwise": 2 * 35, "reduction": 0}


def test_absorbed_scores_solution_does_the_absorbed_arithmetic_exactly():
    case = given.absorbed_scores_cases(torch.Generator().manual_seed(0))[0]
    assert sum(given.count_arithmetic(given.absorbed_scores, *case).values()) == given.absorbed_arithmetic(*case)


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bf16 (8 significant bits)"),
                                             (torch.float16, "fp16 (11 significant bits)")])
def test_absorbed_scores_names_the_16_bit_float_the_arithmetic_ran_in(dtype, name):
    def in_low_precision(q_nope, q_pe, latent, kv_b_weight, nope, v_dim):
        low = (q_nope.to(dtype), q_pe.to(dtype), latent.to(dtype), kv_b_weight.to(dtype))
        return given.absorbed_scores(*low, nope, v_dim).float()

    verdict = check_absorbed(in_low_precision)
    assert rejected(verdict, "cause: reduced-precision arithmetic") and rejected(verdict, f"what {name} gives"), \
        verdict.message


@pytest.mark.parametrize(("wrong", "diagnosis"), [
    (scores_first_rows_as_w_uk, "cause: W_UK is the first H · nope rows of kv_b_proj's weight"),
    (scores_without_rope, "cause: the RoPE part is missing"),
    (scores_scaled_by_nope, "cause: the scores are scaled by 1 / sqrt(qk_nope_head_dim"),
    (scores_scaled_by_rank, "cause: the scores are scaled by 1 / sqrt(kv_lora_rank"),
    (scores_with_the_row_parts_swapped, "cause: the cache row's two parts are swapped"),
    (scores_softmaxed, "cause: the result is softmax(scores)"),
    (scores_expanded, "broke a stated rule — the spec asks for the absorbed form (no key expanded per cached "
                      "token): its torch ops' arithmetic came to"),
    (scores_by_broadcast_expansion, "broke a stated rule — the spec asks for the absorbed form (no key expanded per "
                                    "cached token): its torch ops' arithmetic came to"),
    (scores_by_vecdot_expansion, "broke a stated rule — the spec asks for the absorbed form (no key expanded per "
                                 "cached token): its torch ops' arithmetic came to"),
    (scores_scaling_the_query_in_place, "broke a stated rule — the spec returns the scores and leaves its inputs as "
                                        "they were: the code changed q_nope, q_pe"),
    (scores_feature_major_w_uk, "cause: W_UK is read feature-major"),
    (scores_from_the_value_rows, "cause: W_UK is taken from the end of each head's block"),
    (scores_with_the_rope_part_unscaled, "cause: only the latent part q_latent · c is scaled"),
    (scores_in_bf16, "cause: reduced-precision arithmetic"),
])
def test_absorbed_scores_negative_controls(wrong, diagnosis):
    verdict = check_absorbed(wrong)
    assert rejected(verdict, diagnosis), verdict.message
