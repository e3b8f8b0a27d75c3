"""Continuous batching over a paged cache: :class:`Scheduler` decides what each model step runs.

Requests join and leave between steps; each step runs every decoding sequence for one token,
then fills the rest of a token budget with chunks of prompts (chunked prefill), and preempts the
newest sequence when the cache is full. Its :class:`SchedulerOutput` holds exactly the tensors a
model step needs.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .block_pool import check_cache_salt, check_token_ids
from .paged_cache import PagedKVCache

__all__ = ["Request", "Scheduler", "SchedulerOutput"]

_OP = "kernel_ladder.serving.Scheduler"


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
    cache_salt: bytes | None = None  # in every prefix-cache key of its blocks (a str given as its UTF-8)

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
                raise ValueError(f"{_OP}: {name} must be a positive int, got {value!r}")
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

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], max_new_tokens: int,
                    cache_salt: str | bytes | None = None) -> Request:
        """Queue a request. Raises ValueError if it could never fit the cache (its prompt and
        ``max_new_tokens`` tokens need more blocks than the cache has) or its id is taken.

        ``cache_salt`` (a str or bytes) separates its prefix-cache entries: it reuses only blocks
        computed for requests with the same salt, and only they reuse its blocks. Give each tenant
        (or each adapter whose K/V differ) its own."""
        salt = check_cache_salt(cache_salt, f"{_OP}.add_request")
        if request_id in self.requests:
            raise ValueError(f"{_OP}.add_request: request {request_id!r} already exists")
        prompt = check_token_ids(prompt_token_ids, f"{_OP}.add_request")
        if any(not 0 <= t < 2**31 for t in prompt):  # the step's token_ids are int32
            bad = next(t for t in prompt if not 0 <= t < 2**31)
            raise ValueError(f"{_OP}.add_request: token ids must be in [0, 2**31), got {bad} in request {request_id!r}")
        if not prompt:
            raise ValueError(f"{_OP}.add_request: request {request_id!r} has an empty prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{_OP}.add_request: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        # The last generated token is never fed back, so len(prompt) + max_new_tokens - 1 slots at most.
        needed = self.cache.blocks_for(len(prompt) + max_new_tokens - 1)
        if needed > self.cache.num_blocks:
            raise ValueError(f"{_OP}.add_request: request {request_id!r} needs up to {needed} blocks "
                             f"({len(prompt)} prompt + {max_new_tokens} new tokens), "
                             f"the cache has {self.cache.num_blocks}")
        request = Request(request_id, prompt, max_new_tokens, cache_salt=salt)
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
            raise RuntimeError(f"{_OP}.step: call update() with the last step's sampled tokens first")
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
            cached = self.cache.try_allocate(request.request_id, request.num_tokens, request.token_ids,
                                             request.cache_salt)
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
            raise ValueError(f"{_OP}.update: expected tokens for {sorted(map(str, expected))}, "
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
            raise ValueError(f"{_OP}.finish: no request {request_id!r}")
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
