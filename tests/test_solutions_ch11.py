"""Chapter 11's solutions pass their checks, and deliberately wrong variants fail them with a
diagnosis that points at the cause (negative controls)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from solutions import ch11_distributed as given
from utils.exercises import check


def rejected(verdict, diagnosis: str) -> bool:
    return not verdict.solved and diagnosis in " ".join(verdict.message.split())


# -- the thread world ---------------------------------------------------------------------------


def _both_receive_first(x, comm):
    comm.recv((comm.rank + 1) % comm.size)
    return x


def test_thread_world_reports_a_deadlock_naming_the_ranks():
    with pytest.raises(given.DeadlockError, match="waited .* for a message from rank"):
        given.ThreadWorld(2, timeout=0.5).run(_both_receive_first, [(torch.zeros(1),), (torch.zeros(1),)])


# -- exercise 1: ring reduce-scatter ------------------------------------------------------------


def check_ring(fn):
    return check("ch11.ring_reduce_scatter", given.run_ring(fn), given.ring_reference, given.ring_cases,
                 compare=given.diagnose_ring, diagnose=given.explain_ring)


def test_ring_solution_solves():
    assert check_ring(given.ring_reduce_scatter).solved


def _ring_off_by_one(x, comm):  # receives into the chunk it just sent: partial sums never complete
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for step in range(p - 1):
        k = (r - step - 1) % p
        comm.send(chunks[k], (r + 1) % p)
        chunks[k] = chunks[k] + comm.recv((r - 1) % p)
    return chunks[r]


def _everything_to_everyone(x, comm):  # right answer, p times the traffic
    for dst in range(comm.size):
        if dst != comm.rank:
            comm.send(x, dst)
    total = x.clone()
    for src in range(comm.size):
        if src != comm.rank:
            total = total + comm.recv(src)
    return total.chunk(comm.size)[comm.rank]


def _ring_shifted(x, comm):  # the textbook indexing: rank r ends with chunk r + 1
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for step in range(p - 1):
        send_k, recv_k = (r - step) % p, (r - step - 1) % p
        comm.send(chunks[send_k], (r + 1) % p)
        chunks[recv_k] = chunks[recv_k] + comm.recv((r - 1) % p)
    return chunks[(r + 1) % p]


def _ring_returns_all_chunks(x, comm):
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for step in range(p - 1):
        send_k, recv_k = (r - step - 1) % p, (r - step - 2) % p
        comm.send(chunks[send_k], (r + 1) % p)
        chunks[recv_k] = chunks[recv_k] + comm.recv((r - 1) % p)
    return chunks


def _replaces_instead_of_adding(x, comm):  # the arriving partial sum overwrites this rank's part
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for step in range(p - 1):
        send_k, recv_k = (r - step - 1) % p, (r - step - 2) % p
        comm.send(chunks[send_k], (r + 1) % p)
        chunks[recv_k] = comm.recv((r - 1) % p)
    return chunks[r]


def _direct_to_owner(x, comm):  # right bytes and values, but every chunk straight to its owner: no ring
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for owner in range(p):
        if owner != r:
            comm.send(chunks[owner], owner)
    total = chunks[r]
    for src in range(p):
        if src != r:
            total = total + comm.recv(src)
    return total


def _recv_before_send(x, comm):
    comm.recv((comm.rank - 1) % comm.size)
    return x


def _adds_into_views_of_x(x, comm):  # right chunks, but the caller's x is changed under it
    r, p = comm.rank, comm.size
    chunks = x.chunk(p)
    for step in range(p - 1):
        comm.send(chunks[(r - step - 1) % p], (r + 1) % p)
        chunks[(r - step - 2) % p].add_(comm.recv((r - 1) % p))
    return chunks[r]


def _indices_one_too_high(x, comm):  # sends r − s, adds into r − s − 1: finishes chunk r + 1, returns chunk r
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for step in range(p - 1):
        comm.send(chunks[(r - step) % p], (r + 1) % p)
        chunks[(r - step - 1) % p] = chunks[(r - step - 1) % p] + comm.recv((r - 1) % p)
    return chunks[r]


@pytest.mark.parametrize("fn, diagnosis", [
    (_adds_into_views_of_x, "rank 0's x was changed by the call"),
    (_indices_one_too_high, "cause: at step s rank r sends chunk (r − s) % p and adds into chunk (r − s − 1) % p"),
    (_ring_off_by_one, "hold a wrong chunk"),
    (_replaces_instead_of_adding, "cause: rank 0 ends with chunk 0 summed over rank [1] only, 1 of the 2 ranks"),
    (_ring_shifted, "shifted by 1"),
    (_ring_returns_all_chunks, "return one tensor"),
    (_everything_to_everyone, "a ring reduce-scatter sends (p − 1)/p · n elements each"),
    (_recv_before_send, "that never came"),
    (_direct_to_owner, "rank 0 sent to rank 2: around the ring a rank sends only to its right-hand neighbour"),
])
def test_ring_wrong_variants_rejected(fn, diagnosis, monkeypatch):
    monkeypatch.setattr(given.ThreadWorld, "__init__", _short_timeout(given.ThreadWorld.__init__))
    verdict = check_ring(fn)
    assert rejected(verdict, diagnosis), verdict.message


def _short_timeout(init):
    def patched(self, size, timeout=5.0):
        init(self, size, timeout=0.5)
    return patched


# -- exercise 2: buckets ------------------------------------------------------------------------


def test_bucket_solution_solves_and_matches_the_library():
    assert check_buckets(given.plan_buckets).solved
    from kernel_ladder.distributed import plan_buckets as library

    sizes = [400, 40, 4000, 40, 40]
    params = [(str(i), torch.nn.Parameter(torch.zeros(s // 4))) for i, s in enumerate(sizes)]
    assert [[int(n) for n, _ in b] for b in library(params, 100)] == given.plan_buckets(sizes, 100)


def check_buckets(fn):
    return check("ch11.plan_buckets", fn, given.bucket_reference, given.bucket_cases, compare=given.diagnose_buckets,
                 diagnose=given.explain_buckets)


def _closes_at_the_cap(sizes, cap):  # a bucket that would reach the cap exactly is closed too early
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        if current and total + sizes[i] >= cap:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    return buckets + ([current] if current else [])


def _empty_first_bucket(sizes, cap):  # closes even an empty bucket
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        if total + sizes[i] > cap:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    return buckets + ([current] if current else [])


@pytest.mark.parametrize("fn, diagnosis", [
    (lambda sizes, cap: [list(range(len(sizes)))] if sizes else [], "close a bucket"),  # one bucket whatever the cap
    (lambda sizes, cap: [[len(sizes) - 1 - i for i in b] for b in given.plan_buckets(sizes[::-1], cap)],
     "cause: the parameters walked in registration order"),  # forward order: the last gradients wait longest
    (_closes_at_the_cap, "cause: a bucket closed when the next parameter would bring it exactly to the cap"),
    (_empty_first_bucket, "an empty bucket"),
    (lambda sizes, cap: [tuple(b) for b in given.plan_buckets(sizes, cap)], "got a list of tuple"),
    (lambda sizes, cap: [sorted(b) for b in given.plan_buckets(sizes, cap)], "wrong order inside a bucket"),
])
def test_bucket_wrong_variants_rejected(fn, diagnosis):
    verdict = check_buckets(fn)
    assert rejected(verdict, diagnosis), verdict.message


# -- exercise 3: the column / row split ----------------------------------------------------------


def check_mlp(fn, seed=None):
    return check("ch11.mlp_shards", given.run_sharded_mlp(fn), given.mlp_reference, given.mlp_cases, seed=seed,
                 **given.MLP_TOLERANCE)


def test_mlp_solution_solves():
    assert check_mlp(given.mlp_shards).solved


@pytest.mark.parametrize("seed", [28, 79])
def test_mlp_solution_solves_where_a_sum_of_partials_cancels(seed):
    """Seeds whose outputs near zero come from partial products that cancel: float32's rounding of
    the terms, not of the result, is what the tolerance must allow."""
    assert check_mlp(given.mlp_shards, seed=seed).solved


def _bias_everywhere(w_up, b_up, w_down, rank, p):
    size = w_up.shape[0] // p
    s = slice(rank * size, (rank + 1) * size)
    return w_up[s], b_up, w_down[:, s]


def _bias_of_the_next_rank(w_up, b_up, w_down, rank, p):
    size = w_up.shape[0] // p
    s, t = slice(rank * size, (rank + 1) * size), slice(((rank + 1) % p) * size, ((rank + 1) % p + 1) * size)
    return w_up[s], b_up[t], w_down[:, s]


def _interleaved_up_contiguous_down(w_up, b_up, w_down, rank, p):
    size = w_up.shape[0] // p
    s = slice(rank * size, (rank + 1) * size)
    return w_up[rank::p], b_up[rank::p], w_down[:, s]


def _bias_on_rank_0_only(w_up, b_up, w_down, rank, p):
    up, bias, down = given.mlp_shards(w_up, b_up, w_down, rank, p)
    return up, bias if rank == 0 else torch.zeros_like(bias), down


def _bias_divided(w_up, b_up, w_down, rank, p):
    up, bias, down = given.mlp_shards(w_up, b_up, w_down, rank, p)
    return up, bias / p, down


@pytest.mark.parametrize("fn, diagnosis", [
    (_bias_on_rank_0_only, "rank 1's b_up shard is zeros"),
    (_bias_divided, "rank 0's b_up shard is b_up[0:4] / 2"),
    (_bias_of_the_next_rank, "rank 0's bias is b_up[4:8] but its rows of w_up are [0:4]"),
    (_interleaved_up_contiguous_down, "rank 0 holds rows [0, 2, 4, 6] of w_up but columns [0:4] of w_down"),
    (_bias_everywhere, "the same slice of up's bias"),
    (lambda w_up, b_up, w_down, rank, p: (w_up, b_up, w_down), "each rank holds 1/"),
])
def test_mlp_wrong_variants_rejected(fn, diagnosis):
    verdict = check_mlp(fn)
    assert rejected(verdict, diagnosis), verdict.message


# -- exercise 4: the LSE merge ------------------------------------------------------------------


def check_merge(fn):
    return check("ch11.merge_partials", given.attention_by_blocks(fn), given.merge_reference, given.merge_cases,
                 compare=given.diagnose_merge, diagnose=given.explain_merge)


def test_merge_solution_solves():
    assert check_merge(given.merge_partials).solved


def _equal_weights(oa, la, ob, lb):  # the blocks weighed equally, whatever they saw
    return (oa + ob) / 2, torch.logaddexp(la, lb)


def _max_not_logaddexp(oa, la, ob, lb):  # the weights then do not sum to one
    m = torch.maximum(la, lb)
    return oa * torch.exp(la - m)[..., None] + ob * torch.exp(lb - m)[..., None], m


def _unguarded_weights(oa, la, ob, lb):  # a row that saw no key at all: exp(-inf - -inf) = NaN
    lse = torch.logaddexp(la, lb)
    return oa * torch.exp(la - lse)[..., None] + ob * torch.exp(lb - lse)[..., None], lse


def _exp_ratio(oa, la, ob, lb):  # exp(lse) / Σ exp(lse): inf / inf once the scores pass ~88
    ea, eb = la.exp(), lb.exp()
    w_a, w_b = (ea / (ea + eb)).nan_to_num(0.0), (eb / (ea + eb)).nan_to_num(0.0)  # a row that saw nothing: 0
    return oa * w_a[..., None] + ob * w_b[..., None], torch.log(ea + eb)


def _log_of_sum(oa, la, ob, lb):  # log(exp(a) + exp(b)) overflows float32 once the scores pass ~88
    lse = torch.log(la.exp() + lb.exp())
    w_a, w_b = torch.exp(la - lse).nan_to_num(0.0), torch.exp(lb - lse).nan_to_num(0.0)
    return oa * w_a[..., None] + ob * w_b[..., None], lse


def _max_started_at_zero(oa, la, ob, lb):  # the running max started at 0: exp(score - 0) underflows far below 0
    m = torch.maximum(torch.maximum(la, lb), torch.zeros_like(la))
    ea, eb = torch.exp(la - m), torch.exp(lb - m)
    total = ea + eb
    out = (oa * ea[..., None] + ob * eb[..., None]) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return out, m + torch.log(total)


def _weights_swapped(oa, la, ob, lb):
    lse = torch.logaddexp(la, lb)
    w_a, w_b = torch.exp(lb - lse).nan_to_num(0.0), torch.exp(la - lse).nan_to_num(0.0)
    return oa * w_a[..., None] + ob * w_b[..., None], lse


def _shifted_not_normalized(oa, la, ob, lb):  # weights exp(lse_block − max): they do not sum to one
    m = torch.maximum(la, lb)
    w_a, w_b = torch.exp(la - m).nan_to_num(0.0), torch.exp(lb - m).nan_to_num(0.0)
    return oa * w_a[..., None] + ob * w_b[..., None], torch.logaddexp(la, lb)


@pytest.mark.parametrize("fn, case, diagnosis", [
    (_weights_swapped, "case 1 of 5", "cause: the blocks' weights are swapped"),
    (_shifted_not_normalized, "case 1 of 5", "cause: each block weighted by exp(lse_block − max(lse_a, lse_b))"),
    (_equal_weights, "case 1 of 5", "weighted by exp(lse_block - lse)"),
    (_max_not_logaddexp, "case 1 of 5", "lse is wrong"),
    (_unguarded_weights, "case 2 of 5", "saw no key in either block"),
    (_log_of_sum, "case 4 of 5", "exp(lse) overflows"),
    (_exp_ratio, "case 4 of 5", "exp(lse) overflows"),
    (_max_started_at_zero, "", "underflowed to 0"),  # case 5, or case 4 when a row's scores all lie below 0
])
def test_merge_wrong_variants_rejected(fn, case, diagnosis):
    """The 4th case has scores in the hundreds; the 5th every score near -250."""
    verdict = check_merge(fn)
    assert rejected(verdict, case) and rejected(verdict, diagnosis), verdict.message


# -- exercise 5: the 1F1B order ------------------------------------------------------------------


def check_order(fn):
    return check("ch11.one_f_one_b", lambda p, m: [fn(r, p, m) for r in range(p)], given.order_reference,
                 given.order_cases, compare=given.diagnose_order)


def test_order_solution_solves():
    assert check_order(given.one_f_one_b).solved


def _warmup_one_too_many(rank, p, m):
    warmup = min(p - rank, m)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return order + [("B", i) for i in range(b, m)]


def _newest_backward_first(rank, p, m):
    order = given.one_f_one_b(rank, p, m)
    tail = [i for i, (kind, _) in enumerate(order) if kind == "B"]
    last_fwd = max(i for i, (kind, _) in enumerate(order) if kind == "F")
    cooldown = [i for i in tail if i > last_fwd]
    if len(cooldown) > 1:
        items = [order[i] for i in cooldown][::-1]
        for i, item in zip(cooldown, items):
            order[i] = item
    return order


@pytest.mark.parametrize("fn, diagnosis", [
    (lambda r, p, m: [(kind.lower(), i) for kind, i in given.one_f_one_b(r, p, m)],
     "rank 0's steps are ('f', i) and ('b', i): the kinds are \"F\" and \"B\", upper case"),
    (lambda r, p, m: [list(step) for step in given.one_f_one_b(r, p, m)],
     "rank 0's steps are lists (['F', 0]): each step is a tuple"),
    (_warmup_one_too_many, "rank 0 warms up with 4 forwards, one too many: 1F1B's warm-up is min(p − rank − 1, m) = 3"),
    (_newest_backward_first, "the backwards go oldest micro-batch first"),
    (lambda r, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)], "micro-batches in flight"),
    (lambda r, p, m: [x for i in range(m) for x in (("F", i), ("B", i))], "bubble"),
    (lambda r, p, m: [("B", i) for i in range(m)] + [("F", i) for i in range(m)], "rank 3's B0 waits for"),
    (lambda r, p, m: [("F", i) for i in range(m)], "exactly once"),
])
def test_order_wrong_variants_rejected(fn, diagnosis):
    verdict = check_order(fn)
    assert rejected(verdict, diagnosis), verdict.message


# -- exercise 6: the vocabulary-parallel loss ----------------------------------------------------


def check_vocab(fn):
    return check("ch11.vocab_parallel_loss", given.run_vocab_loss(fn), given.vocab_reference, given.vocab_cases,
                 compare=given.diagnose_vocab, diagnose=given.explain_vocab)


def test_vocab_solution_solves():
    assert check_vocab(given.vocab_parallel_loss).solved


def _no_max(logits, target, start, comm):  # overflows for large logits? here: right but unstable -> still right
    sum_exp = comm.all_reduce(logits.exp().sum(1), "sum")
    local = target - start
    mine = (local >= 0) & (local < logits.shape[1])
    t = comm.all_reduce(logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return (sum_exp.log() - t).mean()


def _local_max_only(logits, target, start, comm):  # each rank shifts by its own max: the sums disagree
    z = logits - logits.max(1).values[:, None]
    sum_exp = comm.all_reduce(z.exp().sum(1), "sum")
    local = target - start
    mine = (local >= 0) & (local < logits.shape[1])
    t = comm.all_reduce(z.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return (sum_exp.log() - t).mean()


def _per_row(logits, target, start, comm):  # the solution's steps, the per-row losses before the mean
    z = logits - comm.all_reduce(logits.max(1).values, "max")[:, None]
    sum_exp = comm.all_reduce(z.exp().sum(1), "sum")
    local = target - start
    mine = (local >= 0) & (local < logits.shape[1])
    t = comm.all_reduce(z.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return sum_exp.log() - t


def _sum_not_mean(logits, target, start, comm):
    return _per_row(logits, target, start, comm).sum()


def _divided_by_world_size(logits, target, start, comm):
    return _per_row(logits, target, start, comm).mean() / comm.size


def _target_unshifted(logits, target, start, comm):  # Σ shifted by the max, the target's logit not
    m = comm.all_reduce(logits.max(1).values, "max")
    sum_exp = comm.all_reduce((logits - m[:, None]).exp().sum(1), "sum")
    local = target - start
    mine = (local >= 0) & (local < logits.shape[1])
    t = comm.all_reduce(logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return (sum_exp.log() - t).mean()


def _result_dropped(logits, target, start, comm):  # all_reduce as if in place: its result unused
    m = logits.max(1).values
    comm.all_reduce(m, "max")
    z = logits - m[:, None]
    sum_exp = z.exp().sum(1)
    comm.all_reduce(sum_exp, "sum")
    local = target - start
    mine = (local >= 0) & (local < logits.shape[1])
    t = z.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine
    comm.all_reduce(t, "sum")
    return (sum_exp.log() - t).mean()


def _gather_everything(logits, target, start, comm):
    parts = [logits]
    for dst in range(comm.size):
        if dst != comm.rank:
            comm.send(logits, dst)
    parts = [comm.recv(src) if src != comm.rank else logits for src in range(comm.size)]
    return F.cross_entropy(torch.cat(parts, 1), target)


def _no_ownership_mask(logits, target, start, comm):  # every rank adds "its" target logit
    z = logits - comm.all_reduce(logits.max(1).values, "max")[:, None]
    sum_exp = comm.all_reduce(z.exp().sum(1), "sum")
    local = (target - start).clamp(0, logits.shape[1] - 1)
    t = comm.all_reduce(z.gather(1, local[:, None])[:, 0], "sum")
    return (sum_exp.log() - t).mean()


def _python_float(logits, target, start, comm):
    return float(given.vocab_parallel_loss(logits, target, start, comm))


def _own_max_unshifted(logits, target, start, comm):  # no all-reduce of the max at all
    m = logits.max(1).values
    sum_exp = comm.all_reduce((logits - m[:, None]).exp().sum(1), "sum")
    local = target - start
    mine = (local >= 0) & (local < logits.shape[1])
    t = comm.all_reduce(logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return (sum_exp.log() + m - t).mean()


def _a_fourth_vector(logits, target, start, comm):
    loss = given.vocab_parallel_loss(logits, target, start, comm)
    comm.all_reduce(torch.ones(logits.shape[0]), "sum")
    return loss


def _unmasked_unshifted(logits, target, start, comm):  # the target's logit from every rank, clamped
    m = comm.all_reduce(logits.max(1).values, "max")
    sum_exp = comm.all_reduce((logits - m[:, None]).exp().sum(1), "sum")
    local = (target - start).clamp(0, logits.shape[1] - 1)
    t = comm.all_reduce(logits.gather(1, local[:, None])[:, 0], "sum")
    return (sum_exp.log() + m - t).mean()


def _start_not_subtracted(logits, target, start, comm):  # owner masked, but column target (not target − start)
    m = comm.all_reduce(logits.max(1).values, "max")
    sum_exp = comm.all_reduce((logits - m[:, None]).exp().sum(1), "sum")
    mine = (target >= start) & (target < start + logits.shape[1])
    t = comm.all_reduce(logits.gather(1, target.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return (sum_exp.log() + m - t).mean()


@pytest.mark.parametrize("fn, diagnosis", [
    (_python_float, "return the mean loss as a 0-d tensor, got float"),
    (_own_max_unshifted, "no rank all-reduced the row max"),
    (_a_fourth_vector, "each rank ran 4 all-reduces of [5, 5, 5, 5] numbers"),
    (_unmasked_unshifted, "cause: the target's logit summed from every rank"),
    (_start_not_subtracted, "cause: the target's column looked up without subtracting vocab_start"),
    (_sum_not_mean, "cause: the sum of the 5 rows' losses, not their mean"),
    (_divided_by_world_size, "cause: the mean divided by the world size p = 2"),
    (_target_unshifted, "cause: the sum of exponentials shifted by the global max, the target's logit not"),
    (_result_dropped, "comm.all_reduce returns a new tensor"),
    (_no_max, "cause: exp of logits that reach"),
    (_local_max_only, "cause: each rank shifts by its own max"),
    (_no_ownership_mask, "cause: the target's logit summed from every rank"),
    (_gather_everything, "the (N, V) logits must not travel"),
])
def test_vocab_wrong_variants_rejected(fn, diagnosis):
    verdict = check_vocab(fn)
    assert rejected(verdict, diagnosis), verdict.message


def test_the_vocab_check_has_logits_in_the_hundreds_of_both_signs():
    cases = given.vocab_cases(torch.Generator().manual_seed(0))
    assert max(float(logits.max()) for _, logits, _ in cases) > 200
    assert any(float(logits.max()) < -200 for _, logits, _ in cases)  # every logit far below zero


# ----------------------------------------------------------------------------------------------
# The world functions the chapter runs: what the notebook prints, asserted
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world4():
    from utils.distributed import World

    with World(4, timeout=60) as w:
        yield w


@pytest.mark.timeout(300)
def test_the_chapter_world_functions_show_what_the_text_says(world4):
    ladder = world4.run(given.world_all_reduce_ladder, 1000)
    busiest = {name: max(rank[name]["bytes"] for rank in ladder) for name in ladder[0]}
    assert busiest == {"star_all_reduce": 12000, "tree_all_reduce": 8000, "ring_all_reduce": 6000}
    assert all(rank[name]["max_error"] < 1e-5 for rank in ladder for name in rank)

    no_sync = world4.run(given.world_no_sync, 4)[0]
    assert no_sync["all_reduces"] == no_sync["buckets"] > 1  # one all-reduce per bucket for four micro-batches
    assert no_sync["max_difference_from_ddp"] < 1e-6 and no_sync["max_difference_from_one_process"] < 1e-6

    for row in world4.run(given.world_zero_memory_sweep, [16, 64])[0]:
        per = {k: v / row["parameters"] for k, v in row.items() if k not in ("width", "parameters")}
        for stage, want in {0: 16, 1: 10, 2: 6, 3: 4}.items():  # fp32 + Adam at p = 4
            assert want <= per[stage] < want + 0.05, (row["width"], stage, per[stage])
        assert 7.5 < per["zero2_backward_peak"] < 8.5 < per[1]  # ZeRO-2's backward peak below ZeRO-1's

    for schedule, peaks in (("gpipe", [6, 6, 6, 6]), ("1f1b", [4, 3, 2, 1])):
        stages = world4.run(given.world_pipeline, schedule, 6)
        assert [s["peak_in_flight"] for s in stages] == peaks
        assert max(s["max_grad_difference"] for s in stages) < 1e-6
