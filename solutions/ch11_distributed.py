"""Solutions to chapter 11, distributed parallelism, and what the chapter gives its checks.

Six exercises, each one piece of a form of parallelism that ``kernel_ladder.distributed`` implements in
full: the ring reduce-scatter, the gradient buckets, the column/row split of an MLP, the
log-sum-exp merge of ring attention, the 1F1B order, the vocabulary-parallel loss.

A function defined in a notebook cannot travel to another process (the workers of
:class:`utils.distributed.World` import their functions by name), so the checks run the
learner's code on a :class:`ThreadWorld`: ``p`` threads in this process, one per rank, each with a
:class:`ThreadComm` whose ``send``/``recv``/``all_reduce`` behave like ``torch.distributed``'s
(non-blocking sends, blocking receives, every rank in the collective) and count what each rank
sends. A receive that waits too long is reported as a deadlock, naming the rank and its peer.
The chapter runs the library's versions on real gloo worlds beside each check.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernel_ladder.distributed import bubble_fraction, logical_timeline, schedule_order
from utils.exercises import one_or_all_causes

__all__ = [
    "ThreadComm",
    "ThreadWorld",
    "DeadlockError",
    "ring_reduce_scatter",
    "ring_cases",
    "ring_reference",
    "run_ring",
    "diagnose_ring",
    "explain_ring",
    "plan_buckets",
    "bucket_cases",
    "bucket_reference",
    "diagnose_buckets",
    "explain_buckets",
    "mlp_shards",
    "mlp_cases",
    "mlp_reference",
    "MLP_TOLERANCE",
    "run_sharded_mlp",
    "merge_partials",
    "merge_cases",
    "merge_reference",
    "attention_by_blocks",
    "diagnose_merge",
    "explain_merge",
    "one_f_one_b",
    "order_cases",
    "order_reference",
    "diagnose_order",
    "vocab_parallel_loss",
    "vocab_cases",
    "vocab_reference",
    "run_vocab_loss",
    "diagnose_vocab",
    "explain_vocab",
]



# ----------------------------------------------------------------------------------------------
# A world of threads
# ----------------------------------------------------------------------------------------------


class DeadlockError(RuntimeError):
    """A rank waited for a message (or a collective) that never came."""


class ThreadComm:
    """One rank's view of a :class:`ThreadWorld`: ``rank``, ``size``, and its messages."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size
        self.bytes_sent = 0
        self.messages = 0
        self.sent_to: list[int] = []  # the destination of every send, in order
        self.reduced: list[tuple[str, int]] = []  # every all-reduce's op and element count, in order
        self.received_from: list[int] = []  # the source of every recv, in order

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send a copy of ``tensor`` to rank ``dst`` (returns at once, like ``isend``)."""
        if not 0 <= dst < self.size or dst == self.rank:
            raise ValueError(f"rank {self.rank}: send to {dst}: not another rank of a world of {self.size}")
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1
        self.sent_to.append(dst)
        self.world.mailbox[(self.rank, dst)].put(tensor.detach().clone())

    def recv(self, src: int) -> torch.Tensor:
        """The next tensor rank ``src`` sent to this rank (waits for it)."""
        if not 0 <= src < self.size or src == self.rank:
            raise ValueError(f"rank {self.rank}: recv from {src}: not another rank of a world of {self.size}")
        self.received_from.append(src)
        box = self.world.mailbox[(src, self.rank)]
        try:
            patience = min(1.0, self.world.timeout)
            try:
                return box.get(timeout=patience)
            except queue.Empty:
                if not self.world.told_waiting.is_set():  # one line per world, not one per waiting rank
                    self.world.told_waiting.set()
                    print(f"(rank {self.rank} has waited {patience:g} s for a message from rank {src}; the world "
                          f"gives up at {self.world.timeout:g} s and reports a deadlock)", flush=True)
            return box.get(timeout=self.world.timeout - patience)
        except queue.Empty:
            raise DeadlockError(f"rank {self.rank} waited {self.world.timeout:g} s for a message from rank {src} "
                                "that never came (both waiting to receive? a send missing?)") from None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The elementwise ``"sum"`` or ``"max"`` of every rank's ``tensor``, returned as a new tensor;
        ``tensor`` itself is left as it was (unlike ``torch.distributed.all_reduce``, which reduces in
        place and returns None)."""
        if op not in ("sum", "max"):
            raise ValueError(f"rank {self.rank}: all_reduce op must be 'sum' or 'max', got {op!r}")
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.reduced.append((op, tensor.numel()))
        return self.world._collective(self.rank, tensor.detach().clone(), op)


class ThreadWorld:
    """Run ``fn(*args_of_rank, comm)`` on ``size`` threads at once; :meth:`run` returns the results."""

    def __init__(self, size: int, timeout: float = 5.0) -> None:
        self.size, self.timeout = size, timeout
        self.mailbox = {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size
        self.told_waiting = threading.Event()
        self.comms = [ThreadComm(self, r) for r in range(size)]

    def _collective(self, rank: int, tensor: torch.Tensor, op: str) -> torch.Tensor:
        try:
            self._slots[rank] = tensor
            self._barrier.wait()
            parts = list(self._slots)
            self._barrier.wait()  # everyone has read before anyone writes the next one
        except threading.BrokenBarrierError:
            raise DeadlockError(f"rank {rank}: a collective that not every rank joined") from None
        stacked = torch.stack(parts)
        return stacked.sum(0) if op == "sum" else stacked.max(0).values

    def run(self, fn: Callable[..., Any], per_rank_args: list[tuple]) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(r: int) -> None:
            try:
                results[r] = fn(*per_rank_args[r], self.comms[r])
            except BaseException as error:  # reported below, with its rank
                errors[r] = error
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        # The first real error, else the first deadlock (the others usually waited on that rank).
        failures = [e for e in errors if e is not None]
        failures.sort(key=lambda e: isinstance(e, DeadlockError))
        if failures:
            raise failures[0]
        if any(t.is_alive() for t in threads):
            raise DeadlockError("a rank never returned")
        return results


# ----------------------------------------------------------------------------------------------
# Exercise 1: the ring reduce-scatter
# ----------------------------------------------------------------------------------------------


def ring_reduce_scatter(x: torch.Tensor, comm: ThreadComm) -> torch.Tensor:
    """This rank's chunk ``comm.rank`` of the sum over ranks of ``x`` (``x.numel()`` divisible by ``p``).

    In ``p − 1`` steps, rank ``r`` sends its partial sum of chunk ``(r − step − 1) mod p`` to the
    right and adds its own part into chunk ``(r − step − 2) mod p`` arriving from the left.
    """
    r, p = comm.rank, comm.size
    chunks = list(x.reshape(-1).clone().chunk(p))
    for step in range(p - 1):
        send_k, recv_k = (r - step - 1) % p, (r - step - 2) % p
        comm.send(chunks[send_k], (r + 1) % p)
        chunks[recv_k] = chunks[recv_k] + comm.recv((r - 1) % p)
    return chunks[r]


def ring_cases(gen: torch.Generator) -> list[tuple]:
    """``(p, data)``: every rank's input as one ``(p, n)`` tensor; ``n`` a multiple of ``p``."""
    return [(p, torch.randn(p, n, generator=gen)) for p, n in ((2, 6), (3, 12), (4, 8), (4, 20))]


def ring_reference(p: int, data: torch.Tensor) -> torch.Tensor:
    """Row ``r``: chunk ``r`` of the sum over ranks."""
    return data.sum(0).reshape(p, -1)


def run_ring(candidate: Callable[..., torch.Tensor]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Run ``candidate(x, comm)`` on a thread world; stack the ranks' chunks. Records the bytes sent,
    and holds the spec's rules: every send to the right-hand neighbour, ``(p − 1)/p · n`` elements
    sent by each rank."""
    def run(p: int, data: torch.Tensor) -> torch.Tensor:
        world = ThreadWorld(p)
        inputs = [data[r].clone() for r in range(p)]
        outs = world.run(candidate, [(x,) for x in inputs])
        run.bytes_sent = [c.bytes_sent for c in world.comms]
        changed = [r for r in range(p) if not torch.equal(inputs[r], data[r])]
        if changed:
            raise ValueError(f"rank {changed[0]}'s x was changed by the call (ranks {changed}): the caller's input "
                             "must be left as it was — x.chunk(p) gives views of x, so add_ or += on a chunk writes "
                             "into x; add into copies (x.clone().chunk(p)) or make new tensors (chunk + received)")
        for comm in world.comms:
            stray = [dst for dst in comm.sent_to if dst != (comm.rank + 1) % p]
            if stray:
                raise ValueError(f"rank {comm.rank} sent to rank {stray[0]}: around the ring a rank sends only to its "
                                 f"right-hand neighbour, (r + 1) % p = {(comm.rank + 1) % p}, and receives only from "
                                 f"its left, (r − 1) % p")
        n = data.shape[1]
        ideal = (p - 1) * (n // p) * data.element_size()
        if any(b != ideal for b in run.bytes_sent):
            raise ValueError(f"the ranks sent {run.bytes_sent} bytes; a ring reduce-scatter sends (p − 1)/p · n "
                             f"elements each: {ideal} bytes")
        for r, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise ValueError(f"rank {r} returned a {type(o).__name__}: return one tensor, this rank's chunk "
                                 "(chunk comm.rank of the sum)")
        return torch.stack([o.reshape(-1) for o in outs])

    return run


def diagnose_ring(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    if got.shape != expected.shape:
        return f"each rank must return its chunk: got {tuple(got.shape)} for the stacked chunks, expected " \
               f"{tuple(expected.shape)}"
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
        return None
    p = got.shape[0]
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    for shift in range(1, p):
        if all(close(got[r], expected[(r + shift) % p]) for r in range(p)):
            return (f"every rank holds a finished chunk, but rank r holds chunk r + {shift} (mod p): your chunk "
                    f"indices are shifted by {shift}; rank r must end with chunk r — start step 0 by sending "
                    "chunk r − 1")
    partial = [r for r in range(p) if not close(got[r], expected[r])]
    return f"ranks {partial} hold a wrong chunk: a step sent or added the wrong chunk index, or too few steps"


def _ring_steps(parts: torch.Tensor, send_offset: int, recv_offset: int) -> torch.Tensor:
    """Chunk ``r`` on each rank ``r`` after ``p − 1`` ring steps in which rank ``r`` sends chunk
    ``(r − s − 1 + send_offset) % p`` and adds what arrives into chunk ``(r − s − 2 + recv_offset) % p``."""
    p = parts.shape[0]
    chunks = [[parts[r, k].clone() for k in range(p)] for r in range(p)]
    for step in range(p - 1):
        sent = [chunks[r][(r - step - 1 + send_offset) % p].clone() for r in range(p)]
        for r in range(p):
            k = (r - step - 2 + recv_offset) % p
            chunks[r][k] = chunks[r][k] + sent[(r - 1) % p]
    return torch.stack([chunks[r][r] for r in range(p)])


def _index(offset: int) -> str:
    return "(r − s)" if offset == 0 else f"(r − s {'−' if offset < 0 else '+'} {abs(offset)})"


def _ring_index_shift(p: int, parts: torch.Tensor, got: torch.Tensor) -> str | None:
    """The cause when ``got`` is what the ring gives with its send / receive chunk indices shifted."""
    if p < 3:  # with two ranks most shifts coincide: p = 3 and 4 tell them apart
        candidates = [(1, 1), (-1, -1)]
    else:
        candidates = [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1) if (a, b) != (0, 0)]
    for send_offset, recv_offset in candidates:
        if torch.allclose(got, _ring_steps(parts, send_offset, recv_offset), rtol=1e-5, atol=1e-5):
            return (f"at step s rank r sends chunk {_index(send_offset - 1)} % p and adds into chunk "
                    f"{_index(recv_offset - 2)} % p; the ring's indices are (r − s − 1) % p and (r − s − 2) % p, "
                    "so that chunk k's partial sum starts at rank k + 1 and arrives complete at rank k after "
                    "p − 1 hops")
    return None


def explain_ring(case: tuple, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Which ranks' parts the first wrong rank's chunk sums, when it is a sum of some of them.

    A chunk that holds only some ranks' contributions is a missing step or an arriving partial
    sum stored instead of added; the right chunk index with every rank is a finished chunk.
    """
    p, data = case
    parts = data.double().reshape(p, p, -1)  # [rank, chunk, element]
    got = got.double()
    shifted = _ring_index_shift(p, parts, got)
    if shifted is not None:
        return shifted
    for r in range(p):
        if torch.allclose(got[r], parts[:, r].sum(0), rtol=1e-5, atol=1e-5):
            continue
        for chunk in [r] + [c for c in range(p) if c != r]:
            for size in range(1, p + 1):
                for ranks in itertools.combinations(range(p), size):
                    if torch.allclose(got[r], parts[list(ranks), chunk].sum(0), rtol=1e-5, atol=1e-5):
                        which = f"rank{'s' if size > 1 else ''} {list(ranks)}"
                        if size == p:
                            return (f"rank {r} ends with chunk {chunk}, finished (summed over every rank), "
                                    f"instead of chunk {r}")
                        return (f"rank {r} ends with chunk {chunk} summed over {which} only, {size} of the {p} "
                                "ranks: an arriving partial sum was stored instead of added to this rank's own "
                                "part, or a step is missing (p − 1 steps, each adding what arrives)")
        return None
    return None


# ----------------------------------------------------------------------------------------------
# Exercise 2: gradient buckets
# ----------------------------------------------------------------------------------------------


def plan_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices of parameters (``sizes[i]`` bytes, registration order) in buckets of at most ``cap``
    bytes, last registered first; a parameter over the cap gets a bucket of its own."""
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in reversed(range(len(sizes))):
        if current and total + sizes[i] > cap:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def bucket_cases(gen: torch.Generator) -> list[tuple]:
    cases = [([400, 40, 4000, 40, 40], 100), ([8] * 7, 24), ([100], 10), ([], 10)]
    for _ in range(3):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        sizes = [int(s) for s in torch.randint(1, 300, (n,), generator=gen)]
        cases.append((sizes, int(torch.randint(50, 600, (1,), generator=gen))))
    return cases


def bucket_reference(sizes: list[int], cap: int) -> list[list[int]]:
    return plan_buckets(sizes, cap)


def _plan_variant(sizes: list[int], cap: int, order: list[int], close) -> list[list[int]]:
    """Buckets filled along ``order``; ``close(current, total, size)`` says when to start a new one."""
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in order:
        if close(current, total, sizes[i], cap):
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def explain_buckets(case: tuple, got: Any, expected: Any) -> str | None:
    """The common wrong plans, each recomputed and compared with ``got``."""
    sizes, cap = case
    backward = list(reversed(range(len(sizes))))
    over = lambda current, total, size, cap: bool(current) and total + size > cap  # noqa: E731
    variants = [
        (_plan_variant(sizes, cap, list(range(len(sizes))), over),
         "the parameters walked in registration order: the backward produces the last registered "
         "parameter's gradient first, so the buckets fill from the end (reversed(range(len(sizes))))"),
        (_plan_variant(sizes, cap, backward, lambda c, t, s, cap: bool(c) and t + s >= cap),
         "a bucket closed when the next parameter would bring it exactly to the cap: the cap is allowed — "
         "close only when the next one would take it past the cap (total + size > cap)"),
        (_plan_variant(sizes, cap, backward, lambda c, t, s, cap: bool(c) and t > cap),
         "a bucket closed only once it is already over the cap: check before adding the next parameter "
         "(total + size > cap), not after"),
    ]
    if isinstance(got, list) and any(b == [] for b in got):
        return "an empty bucket: close the current bucket only when it holds a parameter"
    return one_or_all_causes([cause for plan, cause in variants if got == plan and plan != expected])


def diagnose_buckets(got, expected) -> str | None:
    if got == expected:
        return None
    if not isinstance(got, list):
        return f"return a list of lists of parameter indices, got {type(got).__name__}"
    inner = sorted({type(b).__name__ for b in got if not isinstance(b, list)})
    if inner:
        return (f"return a list of lists of parameter indices, got a list of {' and '.join(inner)}: make each "
                "bucket a list")
    if [sorted(b) for b in got] == [sorted(b) for b in expected]:
        return ("the right parameters in the right buckets, but in the wrong order inside a bucket: list each "
                f"bucket's indices last registered first, as the backward produces them (got {got}, expected "
                f"{expected})")
    if sorted(i for b in got for i in b) != sorted(i for b in expected for i in b):
        return f"every parameter must be in exactly one bucket: got {got}, expected {expected}"
    return (f"got {got}, expected {expected}: walk the parameters last registered first and close a bucket "
            "when the next one would take it over the cap (a parameter over the cap alone gets its own)")


# ----------------------------------------------------------------------------------------------
# Exercise 3: the column / row split
# ----------------------------------------------------------------------------------------------


def mlp_shards(w_up: torch.Tensor, b_up: torch.Tensor, w_down: torch.Tensor, rank: int, p: int):
    """Rank ``rank``'s ``(w_up rows, b_up slice, w_down columns)`` of ``down(gelu(up(x)))``."""
    size = w_up.shape[0] // p
    rows = slice(rank * size, (rank + 1) * size)
    return w_up[rows], b_up[rows], w_down[:, rows]


def mlp_cases(gen: torch.Generator) -> list[tuple]:
    cases = []
    for p, hidden, ffn in ((2, 4, 8), (4, 6, 16), (3, 5, 12)):
        cases.append((torch.randn(3, hidden, generator=gen), torch.randn(ffn, hidden, generator=gen),
                      torch.randn(ffn, generator=gen), torch.randn(hidden, ffn, generator=gen), p))
    return cases


def mlp_reference(x, w_up, b_up, w_down, p):
    return F.gelu(x @ w_up.T + b_up) @ w_down.T


#: The check's tolerance: each output is a sum over the ranks of float32 partial products of a few
#: units each, so an output near zero carries their rounding (about 1e-5), not its own.
MLP_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}


def _where_from(parts: torch.Tensor, whole: torch.Tensor) -> list[int] | None:
    """For each slice ``parts[i]`` (rows), the index of the equal row of ``whole``, or None if one has none."""
    found = []
    for part in parts:
        hits = [j for j in range(whole.shape[0]) if torch.equal(whole[j], part)]
        if not hits:
            return None
        found.append(hits[0])
    return found


def _span(indices: list[int]) -> str:
    """``[a:b]`` for a contiguous ascending run, else the list."""
    if indices and indices == list(range(indices[0], indices[0] + len(indices))):
        return f"[{indices[0]}:{indices[0] + len(indices)}]"
    return str(indices)


def _shard_problem(r: int, wu, bu, wd, w_up, b_up, w_down) -> tuple[str | None, list[int] | None]:
    """What is wrong with rank ``r``'s shards, from which rows, bias entries and columns they are."""
    rows = _where_from(wu, w_up)
    if rows is None:
        return (f"rank {r}'s w_up shard is not made of rows of w_up: split up's output features, the rows of "
                "its (out, in) weight"), None
    bias = _where_from(bu[:, None], b_up[:, None])
    if bias is None:
        if bool((bu == 0).all()):
            return (f"rank {r}'s b_up shard is zeros: every rank adds the bias of the hidden features it computes, "
                    f"b_up[j] beside row j of w_up — the bias comes before the gelu, so it cannot be added once "
                    "on one rank"), None
        for divisor in range(2, 9):
            scaled = _where_from((bu * divisor)[:, None], b_up[:, None])
            if scaled is None:
                scaled = _where_from(bu[:, None], (b_up / divisor)[:, None])
            if scaled is not None:
                return (f"rank {r}'s b_up shard is b_up{_span(scaled)} / {divisor}: each hidden feature's bias "
                        "belongs whole to the one rank that computes it (before the gelu), not shared out"), None
        return f"rank {r}'s b_up shard is not made of entries of b_up", None
    cols = _where_from(wd.T, w_down.T)
    if cols is None:
        return (f"rank {r}'s w_down shard is not made of columns of w_down: split down's input features, the "
                "columns of its (out, in) weight"), None
    if bias != rows:
        return (f"rank {r}'s bias is b_up{_span(bias)} but its rows of w_up are {_span(rows)}: hidden feature j "
                "needs b_up[j] beside row j"), None
    if cols != rows:
        return (f"rank {r} holds rows {_span(rows)} of w_up but columns {_span(cols)} of w_down: the hidden "
                "feature j computed by row j of w_up must be consumed by column j of w_down on the same rank"), None
    return None, rows


def run_sharded_mlp(candidate: Callable[..., tuple]) -> Callable[..., torch.Tensor]:
    """The MLP from every rank's shards: each rank's partial product, then their sum (the all-reduce).

    The shards are checked before they are used: each rank's must be rows of ``w_up``, the same
    entries of ``b_up`` and the same columns of ``w_down``, and the ranks' hidden features must
    cover each feature once; a wrong split raises, saying which rank holds what.
    """
    def run(x, w_up, b_up, w_down, p):
        total = 0
        held: list[int] = []
        for r in range(p):
            wu, bu, wd = candidate(w_up, b_up, w_down, r, p)
            if wu.shape[0] * p != w_up.shape[0] or wd.shape[1] * p != w_down.shape[1] or bu.shape != wu.shape[:1]:
                raise ValueError(f"rank {r}'s shards are {tuple(wu.shape)}, {tuple(bu.shape)}, {tuple(wd.shape)}: "
                                 f"each rank holds 1/{p} of up's rows, the same slice of up's bias, and 1/{p} of "
                                 "down's columns")
            problem, rows = _shard_problem(r, wu, bu, wd, w_up, b_up, w_down)
            if problem is not None:
                raise ValueError(problem)
            held += rows
            total = total + F.gelu(x @ wu.T + bu) @ wd.T
        twice = sorted({j for j in held if held.count(j) > 1})
        if twice:
            raise ValueError(f"hidden features {twice} are held by more than one rank (and others by none): give each "
                             "rank its own range, rank r the r-th of p")
        return total

    return run


# ----------------------------------------------------------------------------------------------
# Exercise 4: the log-sum-exp merge
# ----------------------------------------------------------------------------------------------


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Attention over keys A ∪ B from attention over A and over B: ``(out, lse)``.

    A row that saw no key in a block has ``lse = -inf`` there and weighs nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)  # -inf - -inf is NaN: a row that saw nothing anywhere
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)
    return out_a * w_a[..., None] + out_b * w_b[..., None], lse


def _block_attention(q, k, v, mask=None):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def merge_cases(gen: torch.Generator) -> list[tuple]:
    """``(q, k, v, split, masked)``: keys split at ``split``. ``masked``: row 0 sees nothing of the
    first block, and row 1 no key at all (its output is 0 and its lse ``-inf``). The fourth case has
    scores in the hundreds, where ``log(exp(a) + exp(b))`` overflows; the fifth every score near
    -250, where ``exp(lse)`` underflows to 0."""
    cases = []
    for rows, keys, dim, split, masked, scale in ((4, 8, 8, 3, False, 1.0), (5, 12, 4, 6, True, 1.0),
                                                  (3, 7, 16, 1, False, 1.0), (4, 8, 8, 4, True, 300.0)):
        cases.append((torch.randn(rows, dim, generator=gen) * scale, torch.randn(keys, dim, generator=gen),
                      torch.randn(keys, dim, generator=gen), split, masked))
    # Every score near -250 (q near +125, every key near -1): exp of any lse underflows to 0, and a
    # running max started at 0 shifts by nothing. Integers and sixty-fourths, so that float32 computes
    # the scores exactly and the blocks' lse differ from float64's by their rounding only.
    rows, keys, dim = 4, 8, 4
    q = 125.0 + torch.randint(-3, 4, (rows, dim), generator=gen).float()
    k = -1.0 + torch.randint(-2, 3, (keys, dim), generator=gen).float() / 64
    cases.append((q, k, torch.randn(keys, dim, generator=gen), 3, False))
    return cases


def _merge_masks(rows: int, keys: int, split: int) -> torch.Tensor:
    mask = torch.ones(rows, keys, dtype=torch.bool)
    mask[0, :split] = False
    mask[1] = False
    return mask


def merge_reference(q, k, v, split, masked):
    return _block_attention(q, k, v, _merge_masks(q.shape[0], k.shape[0], split) if masked else None)


def diagnose_merge(got, expected) -> str | None:
    """Out and lse against the reference; rows that saw no key in either block named."""
    if not isinstance(got, tuple) or len(got) != 2:
        return f"return a pair (out, lse), got {type(got).__name__}"
    (out, lse), (want_out, want_lse) = got, expected
    if out.shape != want_out.shape or lse.shape != want_lse.shape:
        return (f"out must be {tuple(want_out.shape)} and lse {tuple(want_lse.shape)}, got {tuple(out.shape)} and "
                f"{tuple(lse.shape)}")
    empty = torch.isneginf(want_lse)
    if torch.isnan(out[empty]).any():
        rows = torch.nonzero(empty).flatten().tolist()
        return (f"row(s) {rows} saw no key in either block: their lse is -inf in both, and exp(-inf - (-inf)) is "
                "NaN; such a row must get weight 0 from each block (output 0, lse -inf)")
    finite = torch.isfinite(want_lse)
    broken = (~torch.isfinite(out)).any(-1) | torch.isnan(lse) | (torch.isinf(lse) & finite)
    if bool(broken.any()):
        levels = want_lse[broken & finite]
        rows = torch.nonzero(broken).flatten().tolist()
        if levels.numel() and bool((levels < -80).all()):
            return (f"NaN/inf in row(s) {rows}, whose scores all lie near {float(levels.mean()):.0f}: exp of them "
                    "underflowed to 0 in float32 (0/0, or log 0) — a max started at 0, or no max, shifts by "
                    "nothing; weight each block by exp(lse_block - lse) with lse from torch.logaddexp")
        return ("NaN/inf in rows that saw some key: with scores in the hundreds, exp(lse) overflows — weight each "
                "block by exp(lse_block - lse) with lse from torch.logaddexp, never by exp(lse_block) itself")
    if not torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True):
        wrong = ~torch.isclose(lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
        if bool((want_lse[wrong] < -80).all()):
            rows = torch.nonzero(wrong).flatten().tolist()
            return (f"lse is wrong in row(s) {rows}, whose scores all lie below -80: exp of them underflowed to 0 "
                    "or to a subnormal in float32 — a max started at 0, or no max, shifts by nothing; the merged "
                    "lse is torch.logaddexp(lse_a, lse_b)")
        return "lse is wrong: the merged lse is log(exp(lse_a) + exp(lse_b)), computed stably (torch.logaddexp)"
    # The blocks' lse come from float32 attention: a weight exp(lse_block - lse) carries their rounding,
    # a few units in the last place of |lse| (1e-5 of the output at |lse| = 250).
    scale = float(want_lse[finite].abs().max()) if bool(finite.any()) else 0.0
    atol = 1e-5 + 8 * 2.0**-24 * scale * float(want_out.abs().max())
    if not torch.allclose(out, want_out, rtol=1e-5, atol=atol):
        wrong = ~torch.isclose(out, want_out, rtol=1e-5, atol=atol).all(-1)
        if bool((want_lse[wrong] < -80).all()):
            rows = torch.nonzero(wrong).flatten().tolist()
            return (f"out is wrong in row(s) {rows}, whose scores all lie below -80: exp of them underflowed to 0 "
                    "or to a subnormal in float32 — a max started at 0, or no max, shifts by nothing; weight each "
                    "block by exp(lse_block - lse) with lse from torch.logaddexp")
        return "out is wrong (lse is right): each block's output is weighted by exp(lse_block - lse), then summed"
    return None


def _blocks(q, k, v, split, masked) -> tuple[tuple, tuple]:
    """The two blocks' ``(out, lse)``, as :func:`attention_by_blocks` hands them to the candidate."""
    mask = _merge_masks(q.shape[0], k.shape[0], split) if masked else None
    a = _block_attention(q, k[:split], v[:split], None if mask is None else mask[:, :split])
    b = _block_attention(q, k[split:], v[split:], None if mask is None else mask[:, split:])
    return a, b


def explain_merge(case: tuple, got: Any, expected: Any) -> str | None:
    """The common wrong weightings of the two blocks, each recomputed from the case's blocks."""
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)):
        return None
    (out_a, lse_a), (out_b, lse_b) = _blocks(*case)
    lse = torch.logaddexp(lse_a, lse_b)
    top = torch.maximum(lse_a, lse_b)

    def weight(x):
        return x.nan_to_num(0.0)[..., None]

    variants = [
        (out_a * weight(torch.exp(lse_b - lse)) + out_b * weight(torch.exp(lse_a - lse)),
         "the blocks' weights are swapped: block A's output is weighted by exp(lse_a - lse), B's by exp(lse_b - lse)"),
        (out_a * weight(torch.exp(lse_a - top)) + out_b * weight(torch.exp(lse_b - top)),
         "each block weighted by exp(lse_block − max(lse_a, lse_b)): shifting by the max keeps exp in range but the "
         "weights then sum to more than one — divide by their sum, i.e. weight by exp(lse_block - lse) with "
         "lse = torch.logaddexp(lse_a, lse_b)"),
    ]
    out, want = got[0], expected[0]
    causes = [cause for value, cause in variants
              if out.shape == value.shape and torch.allclose(out, value, rtol=1e-5, atol=1e-5, equal_nan=True)
              and not torch.allclose(value, want, rtol=1e-5, atol=1e-5, equal_nan=True)]
    return one_or_all_causes(causes)


def attention_by_blocks(candidate: Callable[..., tuple]) -> Callable[..., tuple]:
    """Attention over two key blocks, merged by ``candidate``."""
    def run(q, k, v, split, masked):
        a, b = _blocks(q, k, v, split, masked)
        # A block a row saw nothing of gives output 0 and lse -inf there (flash-attention's
        # convention, and kernel_ladder.flash_attention's): it must get no weight, and a row that saw
        # nothing in either block must come out 0, not NaN.
        return candidate(a[0], a[1], b[0], b[1])

    return run


# ----------------------------------------------------------------------------------------------
# Exercise 5: the 1F1B order
# ----------------------------------------------------------------------------------------------


def one_f_one_b(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s 1F1B order of ``("F" | "B", micro-batch)``: ``min(p − rank − 1, m)`` warm-up
    forwards, then forward and backward in turn, then the remaining backwards."""
    warmup = min(p - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return order + [("B", i) for i in range(b, m)]


order_cases = [(4, 8), (4, 2), (2, 5), (8, 8), (3, 1)]  # fixed: the edge cases are what matter here


def order_reference(p: int, m: int) -> list[list[tuple[str, int]]]:
    return [schedule_order("1f1b", r, p, m) for r in range(p)]


def diagnose_order(got: list, expected: list) -> str | None:
    """Run the candidate's orders on the pipeline's dependencies: deadlock-free, every micro-batch
    once each way, at most ``p − r`` in flight on rank ``r``, the 1F1B bubble."""
    p = len(expected)
    m = len(expected[0]) // 2
    for r, order in enumerate(got):
        if not isinstance(order, list):
            return f"rank {r}'s order is a {type(order).__name__}: return a list of (kind, micro-batch) tuples"
        kinds = sorted({type(step).__name__ for step in order if not isinstance(step, tuple)})
        if kinds:
            first = next(step for step in order if not isinstance(step, tuple))
            return (f"rank {r}'s steps are {' and '.join(kinds)}s ({first!r}): each step is a tuple (\"F\", i) "
                    "or (\"B\", i)")
        wrong = list(dict.fromkeys(str(step[0]) for step in order if step and step[0] not in ("F", "B")))
        if wrong:
            return (f"rank {r}'s steps are {' and '.join(f'({k!r}, i)' for k in wrong)}: the kinds are \"F\" and "
                    "\"B\", upper case")
        if sorted(order) != sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]):
            return f"rank {r} must run every micro-batch's F and B exactly once, got {order}"
        backwards = [i for kind, i in order if kind == "B"]
        if backwards != sorted(backwards):
            return (f"rank {r} runs its backwards in the order {backwards}: the backwards go oldest micro-batch "
                    "first (the one whose activations have waited longest)")
        in_flight = peak = 0
        for kind, _ in order:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        warmup = next((i for i, (kind, _) in enumerate(order) if kind == "B"), len(order))
        want = min(p - r - 1, m)
        if peak > min(p - r, m):
            line = f"rank {r} keeps {peak} micro-batches in flight; 1F1B keeps at most p − r = {min(p - r, m)}"
            if warmup == want + 2 and warmup <= m:  # warm-up forwards, then one more F before the first B
                line += (f": rank {r} warms up with {warmup - 1} forwards, one too many: 1F1B's warm-up is "
                         f"min(p − rank − 1, m) = {want}")
            return line
    try:
        timeline = logical_timeline(got)
    except ValueError as error:
        detail = str(error).split(" — ", 1)[-1]
        return f"these orders deadlock: {detail}"
    bubble, target = bubble_fraction(timeline), (p - 1) / (m + p - 1)
    if abs(bubble - target) > 1e-9:
        return f"the bubble is {bubble:.3f}, not (p − 1)/(m + p − 1) = {target:.3f}: a rank idles where it could work"
    return None


# ----------------------------------------------------------------------------------------------
# Exercise 6: the vocabulary-parallel loss
# ----------------------------------------------------------------------------------------------


def vocab_parallel_loss(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                        comm: ThreadComm) -> torch.Tensor:
    """The mean cross-entropy over rows of logits of which this rank holds columns
    ``[vocab_start, vocab_start + logits.shape[1])``, without gathering them: the row max and the
    sum of exponentials are all-reduced, and so is the target's logit."""
    row_max = comm.all_reduce(logits.max(dim=1).values, "max")
    z = logits - row_max[:, None]
    sum_exp = comm.all_reduce(z.exp().sum(dim=1), "sum")
    local = target - vocab_start
    mine = (local >= 0) & (local < logits.shape[1])
    target_logit = comm.all_reduce(z.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * mine, "sum")
    return (sum_exp.log() - target_logit).mean()


def vocab_cases(gen: torch.Generator) -> list[tuple]:
    """``(p, logits, target)``: the vocabulary split over 2, 4 and 3 ranks; then logits in the
    hundreds (where ``exp`` of an unshifted logit overflows float32, and the row's max sits on one
    rank) and logits all near -250 (where ``exp`` of every one underflows to 0)."""
    cases = []
    for p, n, vocab in ((2, 5, 8), (4, 3, 16), (3, 6, 9)):
        logits = torch.randn(n, vocab, generator=gen) * 4
        cases.append((p, logits, torch.randint(0, vocab, (n,), generator=gen)))
    p, n, vocab = 4, 4, 12
    cases.append((p, torch.randn(n, vocab, generator=gen) * 100, torch.randint(0, vocab, (n,), generator=gen)))
    cases.append((p, torch.randn(n, vocab, generator=gen) * 4 - 250, torch.randint(0, vocab, (n,), generator=gen)))
    return cases


def vocab_reference(p: int, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def diagnose_vocab(got, expected) -> str | None:
    """None if ``got`` is the mean loss, else what it is (the cause is :func:`explain_vocab`'s)."""
    got = torch.as_tensor(got)
    if got.shape != torch.as_tensor(expected).shape:
        return f"return the mean loss as a 0-d tensor, got shape {tuple(got.shape)}"
    if torch.allclose(got.double(), torch.as_tensor(expected).double(), rtol=1e-5, atol=1e-6):
        return None
    return f"loss {float(got):.6f}, expected {float(expected):.6f}"


def _vocab_variants(p: int, logits: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """The common wrong losses in float64, each with its cause."""
    x = logits.double()
    n, vocab = x.shape
    width = vocab // p
    shards = [x[:, r * width:(r + 1) * width] for r in range(p)]
    owner = target // width
    m = x.max(1).values
    lse = torch.logsumexp(x, 1)
    target_logit = x.gather(1, target[:, None])[:, 0]
    per_row = lse - target_logit
    right = per_row.mean()

    local_max = [s.max(1).values for s in shards]
    sum_local = sum(torch.exp(s - lm[:, None]).sum(1) for s, lm in zip(shards, local_max))
    own_max = torch.stack(local_max)[owner, torch.arange(n)]
    local_max_loss = (sum_local.log() - (target_logit - own_max)).mean()

    every_rank = sum(s.gather(1, (target - r * width).clamp(0, width - 1)[:, None])[:, 0]  # no owner mask
                     for r, s in enumerate(shards))
    no_owner_mask = (lse - m - (every_rank - p * m)).mean()
    ignore_start = sum(s.gather(1, target.clamp(0, width - 1)[:, None])[:, 0] * (target < width) for s in shards)
    no_start = (lse - ignore_start).mean()
    unshifted_target = (lse - m - target_logit).mean()
    clamped = (target[:, None] - torch.arange(p)[None, :] * width).clamp(0, width - 1)  # [row, rank]
    every_rank_unshifted = sum(s.gather(1, clamped[:, r:r + 1])[:, 0] for r, s in enumerate(shards))
    by_owner_no_start = sum(s.gather(1, target.clamp(0, width - 1)[:, None])[:, 0] * (owner == r)
                            for r, s in enumerate(shards))
    return [
        ((lse - every_rank_unshifted).mean(), "the target's logit summed from every rank: only the rank whose "
                                              "columns hold the target (0 <= target − vocab_start < V/p) may "
                                              "contribute it, the others add 0"),
        ((lse - by_owner_no_start).mean(), "the target's column looked up without subtracting vocab_start: the "
                                           "target's local column is target − vocab_start"),
        (per_row.sum(), f"the sum of the {n} rows' losses, not their mean: divide the sum by the N = {n} rows "
                        "(or take .mean())"),
        (right / p, f"the mean divided by the world size p = {p}: after the three all-reduces every rank holds "
                    f"every row's whole loss, so the mean is over the N = {n} rows alone"),
        (per_row.sum() / p, f"the sum of the rows' losses divided by the world size p = {p}: the divisor is the "
                            f"N = {n} rows"),
        (local_max_loss, "each rank shifts by its own max: the sums of exp(z − max) then have different scales "
                         "and cannot be added — all-reduce the row max with 'max' first, and shift every rank by it"),
        (no_owner_mask, "the target's logit summed from every rank: only the rank whose columns hold the target "
                        "(0 <= target − vocab_start < V/p) may contribute it, the others add 0"),
        (no_start, "the target's column looked up without subtracting vocab_start: the target's local column "
                   "is target − vocab_start"),
        (unshifted_target, "the sum of exponentials shifted by the global max, the target's logit not: the loss "
                           "is log Σ exp(z − max) − (z_target − max) — shift both by the same max"),
    ]


def explain_vocab(case: tuple, got: Any, expected: Any) -> str | None:
    """The cause of a wrong vocabulary-parallel loss: the common mistakes, each recomputed in float64."""
    p, logits, target = case
    value = float(torch.as_tensor(got).double().reshape(-1)[0])
    if not math.isfinite(value):
        top, bottom = float(logits.max()), float(logits.min())
        if top > 80:
            return (f"exp of logits that reach {top:.0f} overflows float32 (past about 88): shift every logit by "
                    "the row's global max (all-reduced with 'max') before exp")
        return (f"exp of logits that reach only {top:.0f} (down to {bottom:.0f}) underflows to 0, and log 0 is -inf: "
                "shift every logit by the row's global max (all-reduced with 'max') before exp")
    right = float(torch.as_tensor(expected).double())
    return one_or_all_causes([cause for variant, cause in _vocab_variants(p, logits, target)
                   if math.isclose(value, float(variant), rel_tol=1e-4, abs_tol=1e-5)
                   and not math.isclose(right, float(variant), rel_tol=1e-4, abs_tol=1e-5)])


def run_vocab_loss(candidate: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Each thread-rank gets only its columns; every rank must return the same loss."""
    def run(p: int, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        width = logits.shape[1] // p
        world = ThreadWorld(p)
        args = [(logits[:, r * width:(r + 1) * width].clone(), target.clone(), r * width) for r in range(p)]
        results = world.run(candidate, args)
        for r, x in enumerate(results):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"return the mean loss as a 0-d tensor, got {type(x).__name__} from rank {r} "
                                 "(a Python number leaves autograd: the loss must stay a tensor to be backpropagated)")
        losses = list(results)
        sent = [c.bytes_sent for c in world.comms]
        n = logits.shape[0]
        budget = 3 * n * logits.element_size()
        busiest = max(range(p), key=lambda r: sent[r])
        if sent[busiest] > budget:
            comm = world.comms[busiest]
            sizes = [numel for _, numel in comm.reduced]
            what = (f"rank {busiest} ran {len(sizes)} all-reduce{'s' if len(sizes) != 1 else ''} of {sizes} numbers"
                    if len(set(sent)) > 1 else
                    f"each rank ran {len(sizes)} all-reduce{'s' if len(sizes) != 1 else ''} of {sizes} numbers")
            if comm.messages:
                what += f" and {comm.messages} send{'s' if comm.messages != 1 else ''}"
            line = (f"{what} ({sent[busiest]} bytes): three all-reduces of N = {n} numbers ({budget} bytes) are "
                    "enough — the row max, the sum of exponentials, the target's logit")
            if comm.messages or any(size > n for size in sizes):
                line += "; the (N, V) logits must not travel"
            raise ValueError(line)
        disagree = any(not torch.allclose(x, losses[0]) for x in losses)
        if disagree and not any(op == "max" for comm in world.comms for op, _ in comm.reduced):
            raise ValueError(f"the ranks disagree on the loss: {[float(x) for x in losses]}: no rank all-reduced the "
                             "row max (comm.all_reduce(..., 'max')) — each shifted by its own max, so the sums of "
                             "exponentials have different scales and each rank's loss is its own")
        if any(not torch.allclose(x, losses[0]) for x in losses):
            raise ValueError(f"the ranks disagree on the loss: {[float(x) for x in losses]}: a value some rank used "
                             "is its own, not the all-reduced one — comm.all_reduce returns a new tensor, the "
                             "reduction over the ranks, and leaves its argument as it was: use what it returns")
        return losses[0]

    return run


# ----------------------------------------------------------------------------------------------
# What the chapter runs on real worlds (module-level, so that World's workers can import them)
# ----------------------------------------------------------------------------------------------


def world_all_reduce(n: int) -> dict:
    """kernel_ladder's ring all-reduce against torch's on this rank's random vector; the bytes it sent."""
    import torch.distributed as dist

    import kernel_ladder.distributed as kd

    r, p = dist.get_rank(), dist.get_world_size()
    x = torch.randn(n, generator=torch.Generator().manual_seed(r))
    ours, theirs = x.clone(), x.clone()
    with kd.count_bytes() as stats:
        kd.ring_all_reduce(ours)
    dist.all_reduce(theirs)
    return {"max_error": float((ours - theirs).abs().max()), "bytes": stats.bytes_sent,
            "model_bytes": kd.AlphaBeta.ring_bytes(n * 4, p, passes=2)}


def world_all_reduce_ladder(n: int) -> dict:
    """The bytes this rank sent in each rung of the all-reduce ladder (star, tree, ring), and the
    largest difference of each from torch's all-reduce."""
    import torch.distributed as dist

    import kernel_ladder.distributed as kd

    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    theirs = x.clone()
    dist.all_reduce(theirs)
    out = {}
    for name in ("star_all_reduce", "tree_all_reduce", "ring_all_reduce"):
        ours = x.clone()
        with kd.count_bytes() as stats:
            getattr(kd, name)(ours)
        out[name] = {"bytes": stats.bytes_sent, "max_error": float((ours - theirs).abs().max())}
    return out


def _mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def world_data_parallel(bucket_cap_mb: float) -> dict:
    """kernel_ladder's DataParallel and torch's DDP on the same model and per-rank data: their largest
    gradient difference, and when each bucket's all-reduce was launched."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from kernel_ladder.distributed import DataParallel

    model = _mlp()
    twin = copy.deepcopy(model)
    ours, theirs = DataParallel(model, bucket_cap_mb=bucket_cap_mb), DistributedDataParallel(twin)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    ours(x).pow(2).mean().backward()
    theirs(x).pow(2).mean().backward()
    diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))
    return {"max_grad_difference": diff, "timeline": ours.timeline(),
            "gradients": sum(1 for _ in model.parameters())}


def world_no_sync(micro_batches: int = 4) -> dict:
    """Gradient accumulation over ``micro_batches`` with ``no_sync`` on all but the last, in kernel_ladder's
    DataParallel and torch's DDP: the all-reduces each launched, and the gradients against one
    backward over the whole batch of every rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from kernel_ladder.distributed import DataParallel

    r, p = dist.get_rank(), dist.get_world_size()
    model, twin, whole = _mlp(), _mlp(), _mlp()
    ours, theirs = DataParallel(model, bucket_cap_mb=0.01), DistributedDataParallel(twin)
    batches = [torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * k + j))
               for k in range(p) for j in range(micro_batches)]
    mine = batches[r * micro_batches:(r + 1) * micro_batches]
    launched = {"ours": 0}
    real_all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        launched["ours"] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting  # count the buckets' all-reduces (DataParallel calls dist.all_reduce)
    try:
        for j, x in enumerate(mine):
            last = j == micro_batches - 1
            with (ours.no_sync() if not last else _nothing()):
                ours(x).pow(2).mean().backward()
    finally:
        dist.all_reduce = real_all_reduce
    for j, x in enumerate(mine):
        with (theirs.no_sync() if j < micro_batches - 1 else _nothing()):
            theirs(x).pow(2).mean().backward()
    # one process, every rank's micro-batches: the sum over micro-batches of the mean over ranks
    sum(whole(x).pow(2).mean() for x in batches).div(p).backward()
    diff_torch = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))
    diff_whole = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), whole.parameters()))
    return {"all_reduces": launched["ours"], "buckets": len(ours.buckets), "max_difference_from_ddp": diff_torch,
            "max_difference_from_one_process": diff_whole}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _deep_mlp(width: int, depth: int = 16) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _zero_step(model: torch.nn.Module, stage: int, x: torch.Tensor, bucket_cap_mb: float | None = None):
    """``model`` under DDP (stage 0) or ZeRO 1/2/3 with Adam, after one step on ``x``: ``(optimizer,
    memory)``, the bytes of parameters, gradients and optimizer state this rank holds."""
    from kernel_ladder.distributed import DataParallel, ZeroOptimizer, module_memory, shard_module

    if stage in (1, 2):
        options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, **options)
    else:
        model = DataParallel(model) if stage == 0 else shard_module(model)
        opt = torch.optim.Adam(model.parameters())
    model(x).pow(2).mean().backward()
    opt.step()
    return opt, (opt.memory() if stage in (1, 2) else module_memory(model, opt))


def world_zero_memory_sweep(widths: list[int]) -> list[dict]:
    """For 16-layer MLPs of each width: the parameters, and the bytes this rank holds after one Adam
    step under DDP and ZeRO 1/2/3, with ZeRO-2's peak during its backward (buckets of one layer)."""
    import torch.distributed as dist

    out = []
    for width in widths:
        row = {"width": width, "parameters": sum(q.numel() for q in _deep_mlp(width).parameters())}
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(dist.get_rank()))
        for stage in (0, 1, 2, 3):
            one_layer = (width * width + width) * 4 / 2**20
            _, memory = _zero_step(_deep_mlp(width), stage, x, bucket_cap_mb=one_layer)
            if stage == 2:
                row["zero2_backward_peak"] = memory["gradients_peak"] + memory["parameters"] + \
                    memory["optimizer_state"]
            row[stage] = memory["parameters"] + memory["gradients"] + memory["optimizer_state"]
        out.append(row)
    return out


def world_zero_memory() -> dict:
    """Bytes per rank of parameters, gradients and Adam's state after one step, for ZeRO stages 0–3."""
    import torch.distributed as dist

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    return {stage: _zero_step(_mlp(), stage, x)[1] for stage in (0, 1, 2, 3)}


def world_tensor_parallel() -> dict:
    """A column-then-row parallel MLP against the same MLP in one process (every rank computes it)."""
    import kernel_ladder
    from kernel_ladder.distributed import ColumnParallelLinear, RowParallelLinear

    model = _mlp()
    up, down = ColumnParallelLinear.from_linear(model[0]), RowParallelLinear.from_linear(model[2])
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = down(kernel_ladder.gelu(up(x)))
        reference = model[2](torch.nn.functional.gelu(model[0](x)))
    return {"max_error": float((ours - reference).abs().max()), "up_shard": tuple(up.weight.shape),
            "down_shard": tuple(down.weight.shape)}


def world_ring_attention(layout: str, causal: bool, seq: int = 32) -> dict:
    """Ring attention of this rank's slice against SDPA over the whole sequence (computed here too)."""
    import torch.distributed as dist

    import kernel_ladder.distributed as kd

    r, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, seq, 16, generator=g) for _ in range(3))
    take = (lambda t: t.chunk(p, dim=2)[r]) if layout == "contiguous" else (lambda t: kd.zigzag_shard(t, r, p))
    ours = kd.ring_attention(take(q).contiguous(), take(k).contiguous(), take(v).contiguous(), causal=causal,
                             layout=layout)
    reference = take(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    return {"max_error": float((ours - reference).abs().max())}


def world_sequence_parallel(sequence_parallel: bool) -> dict:
    """``x + down(gelu(up(rms_norm(x))))`` tensor parallel, with or without sequence parallelism: the
    activation bytes autograd saved on this rank (parameters, which are saved by reference, not
    counted), each saved tensor's shape, and the largest error against one process."""
    import torch.distributed as dist

    import kernel_ladder
    from kernel_ladder.distributed import ColumnParallelLinear, RowParallelLinear

    r, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x_full = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    w = torch.ones(32)
    rows = slice(r * 16 // p, (r + 1) * 16 // p)
    x = x_full[rows] if sequence_parallel else x_full
    up = ColumnParallelLinear.from_linear(model[0], sequence_parallel=sequence_parallel)
    down = RowParallelLinear.from_linear(model[2], sequence_parallel=sequence_parallel)
    x = x.clone().requires_grad_(True)
    saved = [0]
    shapes = []
    params = {q.data_ptr() for q in (*up.parameters(), *down.parameters())} | {w.data_ptr()}

    def pack(t):
        if t.data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kernel_ladder.add(x, down(kernel_ladder.gelu(up(kernel_ladder.rms_norm(x, w)))))
    with torch.no_grad():
        reference = x_full + model[2](F.gelu(model[0](F.rms_norm(x_full, (32,), w, 1e-6))))
    expected = reference[rows] if sequence_parallel else reference
    out.sum().backward()  # the backward runs too (it all-gathers the sequence again)
    return {"saved_bytes": saved[0], "saved_shapes": shapes, "max_error": float((out.detach() - expected).abs().max())}


def world_pipeline(schedule: str, microbatches: int) -> dict:
    """kernel_ladder's Pipeline (one stage of two Linear+Tanh pairs per rank) against the whole model in one
    process: this stage's largest gradient difference, the micro-batches it held at once, its order."""
    import torch.distributed as dist

    from kernel_ladder.distributed import Pipeline

    r, p = dist.get_rank(), dist.get_world_size()

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(p) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                                                      torch.nn.Linear(8, 8), torch.nn.Tanh())])

    model, whole = build(), build()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    pipe = Pipeline([model[4 * k:4 * (k + 1)] for k in range(p)], schedule=schedule, num_microbatches=microbatches)
    pipe.step(x if r == 0 else None, y if r == p - 1 else None)
    # one process: the mean of the micro-batches' losses, as the pipeline's loss is
    sum(torch.nn.functional.mse_loss(whole(xb), yb) for xb, yb in zip(x.chunk(microbatches), y.chunk(microbatches))
        ).div(microbatches).backward()
    mine = whole[4 * r:4 * (r + 1)]
    diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(pipe.stage.parameters(), mine.parameters()))
    return {"max_grad_difference": diff, "peak_in_flight": pipe.peak_in_flight, "order": pipe.order()}
