"""Generation with continuous batching over a paged KV cache: :class:`Engine`.

The engine puts chapter 08's serving loop to work on a :class:`~kernel_ladder.models.CausalLM` (or any
model of the layer protocol, :class:`~kernel_ladder.models.protocol.DecoderLM`):

* :class:`~kernel_ladder.serving.scheduler.Scheduler` decides each step's work — decodes first,
  then prefill chunks under a token budget (chunked prefill), new requests admitted as others
  finish (continuous batching), preemption by recomputation when the cache is full — and hands
  over the packed step: token ids, positions, the cache slots they go to, block tables, sequence
  lengths.
* :class:`~kernel_ladder.serving.paged_cache.PagedKVCache` holds what every layer caches in blocks (K and V,
  or MLA's latent vector: the model's ``cache_spec()``); a
  block filled with a prompt prefix another request already computed is shared (prefix caching:
  its tokens are not recomputed).
* :func:`~kernel_ladder.serving.forward.packed_forward` runs the model on the packed step through its
  layers' ``forward_paged``.
* :mod:`~kernel_ladder.serving.sampling` picks the tokens; :mod:`~kernel_ladder.serving.speculative`
  replaces the loop with draft-and-verify when the engine has a draft.

Greedy decoding gives Hugging Face's greedy ``generate`` token for token (fp32); sampling uses a
temperature and nucleus (``top_p``) filter with a seeded generator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..ops.paged_attention import BLOCK_SIZES, MAX_HEAD_DIM
from .block_pool import check_cache_salt
from .forward import packed_forward
from .paged_cache import CacheSpec, PagedKVCache
from .sampling import distribution, sample
from .scheduler import Scheduler, SchedulerOutput
from .speculative import Speculator, verify

if TYPE_CHECKING:
    from ..models.protocol import DecoderLM

__all__ = ["Engine", "EngineStats"]

_OP = "kernel_ladder.models.Engine"

#: A request's prefix-cache salt: requests share cached blocks only with those of the same salt.
CacheSalt = str | bytes | None


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


def _check_int(name: str, value: object, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_OP}: {name} must be an int{also}, got {type(value).__name__} {value!r}")


def _check_positive_int(name: str, value: object, also: str = "") -> None:
    _check_int(name, value, also)
    if value < 1:
        raise ValueError(f"{_OP}: {name} must be a positive int{also}, got {value}")


def _check_model(model: DecoderLM, name: str) -> torch.nn.Parameter:
    """One of the model's parameters (its dtype and device are the cache's), once the paged step can run it."""
    param = next(model.parameters())
    if param.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{_OP}: {name}'s parameters must be float32, float16 or bfloat16 (the paged attention's "
                        f"dtypes), got {param.dtype}")
    for spec in _cache_specs(model, name):
        if spec.kind == "kv" and not max(spec.head_dim, spec.v_head_dim) <= MAX_HEAD_DIM:
            raise ValueError(f"{_OP}: {name}'s head dim must be in [1, {MAX_HEAD_DIM}] (what "
                             f"kernel_ladder.paged_attention supports), got {max(spec.head_dim, spec.v_head_dim)}")
    return param


def _cache_specs(model: DecoderLM, name: str) -> list[CacheSpec]:
    specs = model.cache_spec()
    specs = [specs] * model.config.num_hidden_layers if isinstance(specs, CacheSpec) else list(specs)
    if len(specs) != model.config.num_hidden_layers or not all(isinstance(s, CacheSpec) for s in specs):
        raise TypeError(f"{_OP}: {name}.cache_spec() must give a CacheSpec per layer "
                        f"({model.config.num_hidden_layers}), got {specs!r}")
    return specs


class Engine:
    """Serve ``model`` from a paged cache of ``num_blocks`` blocks of ``block_size`` tokens.

    ``max_batch_size``: the most sequences in one step (default: as many as the cache can hold);
    ``max_tokens_per_step``: the token budget of a step (prefill chunks fill it; default 256).

    **Speculative decoding** (:mod:`kernel_ladder.serving.speculative`): ``draft_model`` — a smaller
    :class:`CausalLM` with the same vocabulary, or ``"prompt_lookup"`` (drafts copied from the
    context after the last earlier occurrence of its final ``lookup_ngram`` tokens) — proposes
    ``num_speculative_tokens`` tokens; the target scores them all in one forward pass and keeps them
    by the rule that leaves its own distribution exact (Leviathan et al. 2023, arXiv:2211.17192;
    Chen et al. 2023, arXiv:2302.01318): draft token ``x`` is accepted with probability
    ``min(1, p(x) / q(x))``, and at the first rejection a token is drawn from ``max(0, p − q)``
    renormalized; if every draft is accepted the target's next token is a bonus. Greedy output is
    then exactly the target's greedy output. Speculative generation runs the prompts one after
    another (no batching); :attr:`stats` counts the acceptance.
    """

    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int = 16, max_batch_size: int | None = None,
                 max_tokens_per_step: int = 256, draft_model: DecoderLM | str | None = None,
                 num_speculative_tokens: int = 4, lookup_ngram: int = 3) -> None:
        from ..models.protocol import DecoderLM  # here: kernel_ladder.models imports this module

        # Every argument is checked here, before the caches are allocated: not at the first generate.
        if not isinstance(model, DecoderLM):
            raise TypeError(f"{_OP}: model must be a kernel_ladder.models.CausalLM (CausalLM.from_hf converts a "
                            f"transformers model) or another kernel_ladder.models.protocol.DecoderLM, got "
                            f"{type(model).__name__}")
        param = _check_model(model, "model")
        _check_positive_int("num_blocks", num_blocks)
        _check_int("block_size", block_size)
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"{_OP}: block_size must be one of {BLOCK_SIZES} (the cache block sizes "
                             f"kernel_ladder.paged_attention supports), got {block_size}")
        if num_blocks * block_size > 2**31 - 1:
            raise ValueError(f"{_OP}: num_blocks * block_size = {num_blocks * block_size} slots do not fit the int32 "
                             "slot mapping; use fewer blocks")
        if max_batch_size is not None:
            _check_positive_int("max_batch_size", max_batch_size, " or None")
        _check_positive_int("max_tokens_per_step", max_tokens_per_step)
        if draft_model is not None and not isinstance(draft_model, DecoderLM) and draft_model != "prompt_lookup":
            raise ValueError(f"{_OP}: draft_model must be a kernel_ladder.models.CausalLM, 'prompt_lookup' or None, "
                             f"got {draft_model!r}")
        if isinstance(draft_model, DecoderLM):
            if draft_model.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"{_OP}: the draft model's vocabulary ({draft_model.config.vocab_size}) must be "
                                 f"the target's ({model.config.vocab_size})")
            draft_param = _check_model(draft_model, "draft_model")
            if (draft_param.dtype, draft_param.device) != (param.dtype, param.device):
                raise TypeError(f"{_OP}: draft_model's parameters must be the target's dtype ({param.dtype}) and "
                                f"device ({param.device}), got {draft_param.dtype} on {draft_param.device}")
        _check_positive_int("num_speculative_tokens", num_speculative_tokens)
        _check_positive_int("lookup_ngram", lookup_ngram)

        c = model.config
        self.model, self.config = model, c
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size, dtype=param.dtype,
                                  device=param.device, spec=_cache_specs(model, "model"))
        self.max_batch_size = num_blocks if max_batch_size is None else max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.stats = EngineStats()
        self.draft_model, self.draft_cache = draft_model, None
        if isinstance(draft_model, DecoderLM):
            self.draft_cache = PagedKVCache(draft_model.config.num_hidden_layers, num_blocks, block_size,
                                            dtype=param.dtype, device=param.device,
                                            spec=_cache_specs(draft_model, "draft_model"))
        self.num_speculative_tokens, self.lookup_ngram = num_speculative_tokens, lookup_ngram
        self._speculator = None if draft_model is None else Speculator(
            model, self.cache, draft_model, self.draft_cache, num_speculative_tokens, lookup_ngram)

    # -- one model step ------------------------------------------------------------------------

    def forward_step(self, step: SchedulerOutput) -> torch.Tensor:
        """The model on one packed step: writes its K/V into the cache, returns the logits
        ``(S, V)`` of the tokens in ``step.sample_indices``."""
        return packed_forward(self.model, self.cache, step)

    # -- sampling (kernel_ladder.serving.sampling) ----------------------------------------------

    distribution = staticmethod(distribution)
    sample = staticmethod(sample)

    # -- generation ----------------------------------------------------------------------------

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, stop_token_ids: Sequence[int] | None = None, seed: int | None = None,
               cache_salt: CacheSalt | Sequence[CacheSalt] = None) -> Iterator[tuple[int, int]]:
        """Yield ``(prompt index, token)`` as each token is generated (continuous batching: the
        prompts' tokens interleave). Arguments as :meth:`generate`."""
        prompts = self._check(prompts, max_new_tokens, temperature, top_p)
        salts = self._check_salts(cache_salt, len(prompts))
        stops = set(int(s) for s in stop_token_ids) if stop_token_ids else set()
        if self.draft_model is not None:
            yield from self._speculative_stream(prompts, max_new_tokens, temperature, top_p, stops, seed)
            return
        scheduler = Scheduler(self.cache, max_num_seqs=self.max_batch_size,
                              max_tokens_per_step=self.max_tokens_per_step)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.stats = stats = EngineStats(prompt_tokens=sum(len(p) for p in prompts))
        for index, (prompt, salt) in enumerate(zip(prompts, salts)):
            scheduler.add_request(index, prompt, max_new_tokens, cache_salt=salt)
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
                # Every step runs the model, one whose chunks all end mid-prompt too: the scheduler has
                # counted their tokens as computed and keyed their full blocks in the prefix cache.
                try:
                    logits = self.forward_step(step)
                except BaseException:
                    self.cache.forget_blocks(step.slot_mapping)  # keyed when scheduled, maybe never written
                    raise
                tokens = sample(logits, temperature, top_p, generator).tolist() if step.sample_request_ids else []
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

    # -- speculative decoding (kernel_ladder.serving.speculative) --------------------------------

    verify = staticmethod(verify)

    def _speculative_stream(self, prompts, max_new_tokens, temperature, top_p, stops, seed):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.stats = stats = EngineStats(prompt_tokens=sum(len(p) for p in prompts), max_batch=1)
        for index, prompt in enumerate(prompts):
            for token in self._speculator.generate(index, prompt, max_new_tokens, temperature, top_p, stops,
                                                   generator, stats):
                yield index, token

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, stop_token_ids: Sequence[int] | None = None, seed: int | None = None,
                 cache_salt: CacheSalt | Sequence[CacheSalt] = None) -> list[list[int]]:
        """The new tokens of each prompt (a list of token ids), in prompt order.

        Each prompt gets at most ``max_new_tokens`` tokens and stops after a token in
        ``stop_token_ids`` (which is kept). ``temperature=0`` is greedy; otherwise sampling with
        ``top_p`` nucleus filtering, reproducible with ``seed``.

        ``cache_salt`` (a str or bytes, or a list of them, one per prompt) keeps prompts apart in
        the prefix cache, which outlives the call: a prompt reuses only blocks computed under the
        same salt (None: the unsalted ones). Give each tenant its own, so that one cannot learn from
        how fast it is served which prefixes another sent. Speculative generation does not prefix-cache.
        """
        out: list[list[int]] = [[] for _ in prompts]
        for index, token in self.stream(prompts, max_new_tokens, temperature, top_p, stop_token_ids, seed,
                                        cache_salt):
            out[index].append(token)
        return out

    @staticmethod
    def _check_salts(cache_salt, num_prompts: int) -> list[bytes | None]:
        if isinstance(cache_salt, (list, tuple)):
            if len(cache_salt) != num_prompts:
                raise ValueError(f"{_OP}.generate: cache_salt must be one salt or a list of {num_prompts} (one per "
                                 f"prompt), got a list of {len(cache_salt)}")
            return [check_cache_salt(salt, f"{_OP}.generate") for salt in cache_salt]
        return [check_cache_salt(cache_salt, f"{_OP}.generate")] * num_prompts

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
