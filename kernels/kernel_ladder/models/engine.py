"""Generation with continuous batching over a paged KV cache: :class:`Engine`.

The engine is chapter 08's serving loop put to work on a :class:`~kernel_ladder.models.CausalLM`:

* :class:`kernel_ladder.kv_cache.Scheduler` decides each step's work — decodes first, then prefill
  chunks under a token budget (chunked prefill), new requests admitted as others finish
  (continuous batching), preemption by recomputation when the cache is full — and hands over the
  packed step: token ids, positions, the cache slots they go to, block tables, sequence lengths.
* :class:`kernel_ladder.kv_cache.PagedKVCache` holds every layer's K and V in blocks; a block filled
  with a prompt prefix another request already computed is shared (prefix caching: its tokens
  are not recomputed).
* The model step runs packed: every sequence's new tokens one after another, no padding.
  :func:`kernel_ladder.write_kv_cache` stores each layer's new K/V in their slots and
  :func:`kernel_ladder.paged_attention` attends over the blocks (decode and chunked prefill in one
  launch, through ``cu_seqlens_q``). Only the last token of each sequence that samples goes
  through the LM head.

Greedy decoding gives Hugging Face's greedy ``generate`` token for token (fp32); sampling uses a
temperature and nucleus (``top_p``) filter with a seeded generator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

import kernel_ladder
from kernel_ladder.kv_cache import PagedKVCache, Scheduler, SchedulerOutput

from .causal_lm import CausalLM

__all__ = ["Engine", "EngineStats"]

_OP = "kernel_ladder.models.Engine"


@dataclass
class EngineStats:
    """Counts of the last :meth:`Engine.generate` (or :meth:`Engine.stream`) call."""

    steps: int = 0  # model steps
    tokens_computed: int = 0  # tokens that went through the model
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache, not recomputed
    generated_tokens: int = 0
    preemptions: int = 0
    max_batch: int = 0  # the most sequences in one step
    target_steps: int = 0  # forward passes of the target model (speculative decoding; else = steps)
    draft_tokens: int = 0  # tokens proposed by the draft (speculative decoding)
    accepted_tokens: int = 0  # proposals the target accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones (speculative decoding; 0.0 when none was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        """Generated tokens per forward pass of the target model (1 without speculation)."""
        return self.generated_tokens / self.target_steps if self.target_steps else 0.0


@torch.no_grad()
def packed_forward(model: CausalLM, cache: PagedKVCache, step: SchedulerOutput) -> torch.Tensor:
    """``model`` on one packed step over ``cache``: every sequence's new tokens one after another.
    Writes their K/V into the cache and returns the logits ``(S, V)`` of the tokens at
    ``step.sample_indices``."""
    c = model.config
    ids = step.token_ids.long()
    x = torch.nn.functional.embedding(ids, model.model.embed_tokens.weight)  # (T, hidden)
    cos, sin = model.rotary(step.positions.long()[None], x.dtype)  # (1, T, D)
    t = ids.shape[0]
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = kernel_ladder.rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
        q = kernel_ladder.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(t, attn.heads, attn.head_dim)
        k = kernel_ladder.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(t, attn.kv_heads, attn.head_dim)
        v = kernel_ladder.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(t, attn.kv_heads, attn.head_dim)
        q, k = kernel_ladder.rope(q[None], k[None], cos, sin, unsqueeze_dim=2)  # (1, T, H, D): HF's BTHD layout
        q, k = q[0], k[0]
        k_cache, v_cache = cache.k_cache(index), cache.v_cache(index)
        kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, step.slot_mapping)
        out = kernel_ladder.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                      window=attn.window, cu_seqlens_q=step.cu_seqlens_q)
        x = kernel_ladder.add(x, kernel_ladder.linear(out.reshape(t, -1), attn.o_proj.weight, attn.o_proj.bias))
        x = kernel_ladder.add(x, layer.mlp(kernel_ladder.rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)))
    last = x.index_select(0, step.sample_indices.long())
    return kernel_ladder.linear(kernel_ladder.rms_norm(last, model.model.norm.weight, c.rms_norm_eps), model.lm_head.weight)


def _single_step(cache: PagedKVCache, seq_id, tokens: list[int], every_logit: bool) -> SchedulerOutput:
    """A one-sequence step of ``tokens`` appended to ``seq_id`` (slots reserved here); the logits
    of every token, or of the last only."""
    start, n = cache.seq_len(seq_id), len(tokens)
    slots = cache.append_slots(seq_id, n)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=cache.device)

    return SchedulerOutput(
        request_ids=[seq_id], num_tokens=[n], token_ids=int32(tokens), positions=int32(list(range(start, start + n))),
        slot_mapping=slots, block_tables=cache.block_tables([seq_id]).to(cache.device), seq_lens=int32([start + n]),
        cu_seqlens_q=int32([0, n]), sample_request_ids=[seq_id],
        sample_indices=int32(list(range(n)) if every_logit else [n - 1]), num_decodes=0, preempted=[])


class Engine:
    """Serve ``model`` from a paged cache of ``num_blocks`` blocks of ``block_size`` tokens.

    ``max_batch_size``: the most sequences in one step (default: as many as the cache can hold);
    ``max_tokens_per_step``: the token budget of a step (prefill chunks fill it; default 256).

    **Speculative decoding**: ``draft_model`` — a smaller :class:`CausalLM` with the same vocabulary,
    or ``"prompt_lookup"`` (drafts copied from the context after the last earlier occurrence of its
    final ``lookup_ngram`` tokens) — proposes ``num_speculative_tokens`` tokens; the target scores
    them all in one forward pass and keeps them by the rule that leaves its own distribution exact
    (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318): draft token ``x``
    is accepted with probability ``min(1, p(x) / q(x))``, and at the first rejection a token is
    drawn from ``max(0, p − q)`` renormalized; if every draft is accepted the target's next token
    is a bonus. Greedy output is then exactly the target's greedy output. Speculative generation
    runs the prompts one after another (no batching); :attr:`stats` counts the acceptance.
    """

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int = 16, max_batch_size: int | None = None,
                 max_tokens_per_step: int = 256, draft_model: CausalLM | str | None = None,
                 num_speculative_tokens: int = 4, lookup_ngram: int = 3) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"{_OP}: model must be a kernel_ladder.models.CausalLM (CausalLM.from_hf converts a "
                            f"transformers model), got {type(model).__name__}")
        c = model.config
        param = next(model.parameters())
        self.model, self.config = model, c
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                                  dtype=param.dtype, device=param.device)
        if max_batch_size is None:
            max_batch_size = num_blocks
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"{_OP}: max_batch_size must be a positive int, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.stats = EngineStats()
        self.draft_model, self.draft_cache = None, None
        if draft_model is not None:
            if isinstance(draft_model, CausalLM):
                if draft_model.config.vocab_size != c.vocab_size:
                    raise ValueError(f"{_OP}: the draft model's vocabulary ({draft_model.config.vocab_size}) must be "
                                     f"the target's ({c.vocab_size})")
                d = draft_model.config
                self.draft_cache = PagedKVCache(d.num_hidden_layers, num_blocks, block_size, d.num_key_value_heads,
                                                d.head_dim, dtype=param.dtype, device=param.device)
            elif draft_model != "prompt_lookup":
                raise ValueError(f"{_OP}: draft_model must be a kernel_ladder.models.CausalLM or 'prompt_lookup', got "
                                 f"{draft_model!r}")
            self.draft_model = draft_model
        for name, value in (("num_speculative_tokens", num_speculative_tokens), ("lookup_ngram", lookup_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_OP}: {name} must be a positive int, got {value!r}")
        self.num_speculative_tokens, self.lookup_ngram = num_speculative_tokens, lookup_ngram

    # -- one model step ------------------------------------------------------------------------

    def forward_step(self, step: SchedulerOutput) -> torch.Tensor:
        """The model on one packed step: writes its K/V into the cache, returns the logits
        ``(S, V)`` of the tokens in ``step.sample_indices``."""
        return packed_forward(self.model, self.cache, step)

    # -- sampling ------------------------------------------------------------------------------

    @staticmethod
    def distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """The probabilities sampling draws from: the softmax of ``logits / temperature`` kept to
        the smallest set of top tokens whose mass reaches ``top_p``, renormalized (a one-hot of the
        argmax at ``temperature == 0``)."""
        if temperature == 0.0:
            return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # sampling's own arithmetic, on (S, V) only
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each
            sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the top one always stays
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @classmethod
    def sample(cls, logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
               ) -> torch.Tensor:
        """One token per row of ``logits``: the argmax at ``temperature == 0``, else a draw from
        :meth:`distribution`."""
        if temperature == 0.0:
            return logits.argmax(dim=-1)
        probs = cls.distribution(logits, temperature, top_p)
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)

    # -- generation ----------------------------------------------------------------------------

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, stop_token_ids: Sequence[int] | None = None, seed: int | None = None
               ) -> Iterator[tuple[int, int]]:
        """Yield ``(prompt index, token)`` as each token is generated (continuous batching: the
        prompts' tokens interleave). Arguments as :meth:`generate`."""
        prompts = self._check(prompts, max_new_tokens, temperature, top_p)
        stops = set(int(s) for s in stop_token_ids) if stop_token_ids else set()
        if self.draft_model is not None:
            yield from self._speculative_stream(prompts, max_new_tokens, temperature, top_p, stops, seed)
            return
        scheduler = Scheduler(self.cache, max_num_seqs=self.max_batch_size,
                              max_tokens_per_step=self.max_tokens_per_step)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.stats = stats = EngineStats(prompt_tokens=sum(len(p) for p in prompts))
        for index, prompt in enumerate(prompts):
            scheduler.add_request(index, prompt, max_new_tokens)
        cached_seen: dict[int, int] = {}
        try:
            while scheduler.has_unfinished:
                step = scheduler.step()
                if step.is_empty:
                    raise RuntimeError(f"{_OP}: no request can run (the cache of {self.num_blocks} blocks is too "
                                       "small for the next one); give the engine more num_blocks")
                for request_id in step.request_ids:
                    request = scheduler.requests[request_id]
                    cached_seen[request_id] = max(cached_seen.get(request_id, 0), request.num_cached_prompt_tokens)
                stats.steps += 1
                stats.target_steps += 1
                stats.tokens_computed += step.total_tokens
                stats.max_batch = max(stats.max_batch, step.num_seqs)
                stats.preemptions += len(step.preempted)
                if not step.sample_request_ids:
                    scheduler.update({})
                    continue
                tokens = self.sample(self.forward_step(step), temperature, top_p, generator).tolist()
                outputs = dict(zip(step.sample_request_ids, tokens))
                scheduler.update(outputs)
                for request_id, token in outputs.items():
                    stats.generated_tokens += 1
                    yield request_id, int(token)
                    request = scheduler.requests[request_id]
                    if token in stops and request.status != "finished":
                        scheduler.finish(request_id)
        finally:
            for request_id in list(scheduler.requests):
                if scheduler.requests[request_id].status != "finished":
                    scheduler.finish(request_id)
            stats.cached_prompt_tokens = sum(cached_seen.values())

    # -- speculative decoding ------------------------------------------------------------------

    def _lookup(self, context: list[int], k: int) -> list[int]:
        """Prompt-lookup drafts: the ``k`` tokens after the latest earlier occurrence of the
        context's last ``lookup_ngram`` tokens (none if they never occurred before)."""
        n = self.lookup_ngram
        if len(context) <= n:
            return []
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
        return []

    @classmethod
    def verify(cls, scored: torch.Tensor, drafts: list[int], q_probs: list[torch.Tensor] | None, temperature: float,
               top_p: float, generator: torch.Generator | None, stops: set[int] = frozenset(),
               budget: int | None = None) -> tuple[list[int], int]:
        """The tokens kept from one speculative step, and how many of them are accepted drafts.

        ``scored`` is the target's logits ``(k + 1, V)`` at the last accepted token and at each of
        the ``k`` ``drafts``; ``q_probs`` the draft's
        distributions (None: deterministic drafts, a one-hot ``q``). Draft ``x`` is kept with
        probability ``min(1, p(x)/q(x))``; the first rejected one is replaced by a draw from
        ``max(0, p − q)`` renormalized, and if all are kept a bonus token is drawn from the last row.
        Stops after a token in ``stops`` or ``budget`` tokens. Greedy (``temperature == 0``) keeps
        the drafts that equal the target's argmax."""
        new: list[int] = []
        budget = len(drafts) + 1 if budget is None else budget
        for i, token in enumerate(drafts):
            if temperature == 0.0:
                accept = int(scored[i].argmax()) == token
            else:
                p = cls.distribution(scored[i], temperature, top_p)
                q_x = float(q_probs[i][token]) if q_probs else 1.0
                accept = float(torch.rand((), generator=generator)) < min(1.0, float(p[token]) / q_x)
            if not accept:
                if temperature == 0.0:
                    new.append(int(scored[i].argmax()))
                else:
                    q = q_probs[i] if q_probs else torch.nn.functional.one_hot(torch.tensor(token), p.shape[-1]).float()
                    residual = (p - q.to(p.device)).clamp_min(0.0)
                    residual = residual / residual.sum() if float(residual.sum()) > 0 else p
                    new.append(int(torch.multinomial(residual.cpu(), 1, generator=generator)))
                return new, i
            new.append(token)
            if token in stops or len(new) >= budget:
                return new, i + 1
        new.append(int(cls.sample(scored[len(drafts):], temperature, top_p, generator)[0]))
        return new, len(drafts)

    def _speculative_stream(self, prompts, max_new_tokens, temperature, top_p, stops, seed):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.stats = stats = EngineStats(prompt_tokens=sum(len(p) for p in prompts), max_batch=1)
        for index, prompt in enumerate(prompts):
            for token in self._speculate(index, prompt, max_new_tokens, temperature, top_p, stops, generator, stats):
                yield index, token

    def _speculate(self, index, prompt, max_new_tokens, temperature, top_p, stops, generator, stats):
        target, cache = self.model, self.cache
        draft, dcache = self.draft_model, self.draft_cache
        seq = ("speculative", index)
        cache.allocate(seq, 0)
        if dcache is not None:
            dcache.allocate(seq, 0)

        def uniform() -> float:
            return float(torch.rand((), generator=generator))

        try:
            logits = packed_forward(target, cache, _single_step(cache, seq, prompt, every_logit=False))
            stats.steps += 1
            stats.target_steps += 1
            stats.tokens_computed += len(prompt)
            out = [int(self.sample(logits, temperature, top_p, generator)[0])]
            stats.generated_tokens += 1
            yield out[0]
            while len(out) < max_new_tokens and out[-1] not in stops:
                context = prompt + out
                k = min(self.num_speculative_tokens, max_new_tokens - len(out))
                drafts, q_probs = [], []
                if draft == "prompt_lookup":
                    drafts = self._lookup(context, k)
                else:  # the draft model, from what its cache lacks of the context
                    feed = context[dcache.seq_len(seq):]
                    for _ in range(k):
                        d_logits = packed_forward(draft, dcache, _single_step(dcache, seq, feed, every_logit=False))
                        q = self.distribution(d_logits[0], temperature, top_p)
                        token = int(self.sample(d_logits, temperature, top_p, generator)[0])
                        drafts.append(token)
                        q_probs.append(q)
                        feed = [token]
                stats.draft_tokens += len(drafts)
                scored = packed_forward(target, cache, _single_step(cache, seq, [out[-1]] + drafts, every_logit=True))
                stats.steps += 1
                stats.target_steps += 1
                stats.tokens_computed += 1 + len(drafts)
                new, accepted = self.verify(scored, drafts, q_probs or None, temperature, top_p, generator,
                                            stops=stops, budget=max_new_tokens - len(out))
                stats.accepted_tokens += accepted
                for token in new:
                    if len(out) >= max_new_tokens:
                        break
                    out.append(token)
                    stats.generated_tokens += 1
                    yield token
                    if token in stops:
                        break
                # keep the K/V of every token but the newest (not yet fed to the model)
                cache.truncate(seq, len(prompt) + len(out) - 1)
                if dcache is not None:
                    dcache.truncate(seq, min(dcache.seq_len(seq), len(prompt) + len(out) - 1))
        finally:
            cache.free(seq)
            if dcache is not None:
                dcache.free(seq)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, stop_token_ids: Sequence[int] | None = None, seed: int | None = None
                 ) -> list[list[int]]:
        """The new tokens of each prompt (a list of token ids), in prompt order.

        Each prompt gets at most ``max_new_tokens`` tokens and stops after a token in
        ``stop_token_ids`` (which is kept). ``temperature=0`` is greedy; otherwise sampling with
        ``top_p`` nucleus filtering, reproducible with ``seed``.
        """
        out: list[list[int]] = [[] for _ in prompts]
        for index, token in self.stream(prompts, max_new_tokens, temperature, top_p, stop_token_ids, seed):
            out[index].append(token)
        return out

    def _check(self, prompts, max_new_tokens, temperature, top_p) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor):
            hint = (" (a (batch, length) tensor: pass input_ids.tolist(), or a list of 1-D tensors, one per prompt)"
                    if prompts.dim() == 2 else " (one prompt: pass [ids])")
            raise ValueError(f"{_OP}.generate: prompts must be a list of prompts, each a list of token ids; got a "
                             f"{prompts.dim()}-D tensor{hint}")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"{_OP}.generate: prompts must be a non-empty list of token-id lists, got "
                             f"{type(prompts).__name__}")
        checked = []
        for i, prompt in enumerate(prompts):
            tokens = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if not tokens or any(not isinstance(t, int) or not 0 <= t < self.config.vocab_size for t in tokens):
                raise ValueError(f"{_OP}.generate: prompt {i} must be a non-empty list of token ids in "
                                 f"[0, {self.config.vocab_size})")
            checked.append(tokens)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{_OP}.generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not temperature >= 0.0:
            raise ValueError(f"{_OP}.generate: temperature must be >= 0, got {temperature!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"{_OP}.generate: top_p must be in (0, 1], got {top_p!r}")
        return checked
