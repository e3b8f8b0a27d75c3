"""Speculative decoding: a cheap draft proposes tokens, the target model checks them all in one pass.

The draft is a smaller :class:`~kernel_ladder.models.CausalLM` with the same vocabulary, or
``"prompt_lookup"`` (drafts copied from the context after the last earlier occurrence of its final
``lookup_ngram`` tokens). It proposes ``num_speculative_tokens`` tokens; the target scores them all
in one forward pass and keeps them by the rule that leaves its own distribution exact (Leviathan
et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318): draft token ``x`` is accepted
with probability ``min(1, p(x) / q(x))``, and at the first rejection a token is drawn from
``max(0, p − q)`` renormalized; if every draft is accepted the target's next token is a bonus.
Greedy output is then exactly the target's greedy output.

Each prompt runs alone (no batching), in a sequence of its own in the target's cache (and the
draft model's); rejected drafts are rolled back with :meth:`PagedKVCache.truncate
<kernel_ladder.serving.paged_cache.PagedKVCache.truncate>`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .forward import packed_forward, single_step
from .paged_cache import PagedKVCache
from .sampling import distribution, sample

if TYPE_CHECKING:
    from ..models.protocol import DecoderLM
    from .engine import EngineStats

__all__ = ["Speculator", "prompt_lookup", "verify"]


def prompt_lookup(context: list[int], k: int, ngram: int) -> list[int]:
    """Prompt-lookup drafts: the ``k`` tokens after the latest earlier occurrence of the
    context's last ``ngram`` tokens (none if they never occurred before)."""
    if len(context) <= ngram:
        return []
    tail = context[-ngram:]
    for start in range(len(context) - ngram - 1, -1, -1):
        if context[start:start + ngram] == tail:
            return context[start + ngram:start + ngram + k]
    return []


def verify(scored: torch.Tensor, drafts: list[int], q_probs: list[torch.Tensor] | None, temperature: float,
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
            p = distribution(scored[i], temperature, top_p)
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
    new.append(int(sample(scored[len(drafts):], temperature, top_p, generator)[0]))
    return new, len(drafts)


@dataclass(frozen=True)
class Speculator:
    """A target model and its draft (a model with its own cache, or ``"prompt_lookup"``), generating
    one prompt at a time."""

    target: DecoderLM
    cache: PagedKVCache
    draft: DecoderLM | str
    draft_cache: PagedKVCache | None  # None for prompt lookup
    num_speculative_tokens: int
    lookup_ngram: int

    def generate(self, index: int, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float,
                 stops: set[int], generator: torch.Generator | None, stats: EngineStats) -> Iterator[int]:
        """Yield the tokens of prompt ``index`` as they are accepted, counting the work in ``stats``."""
        target, cache = self.target, self.cache
        draft, dcache = self.draft, self.draft_cache
        seq = ("speculative", index)
        cache.allocate(seq, 0)
        if dcache is not None:
            dcache.allocate(seq, 0)
        try:
            logits = packed_forward(target, cache, single_step(cache, seq, prompt, every_logit=False))
            stats.steps += 1
            stats.target_steps += 1
            stats.tokens_computed += len(prompt)
            out = [int(sample(logits, temperature, top_p, generator)[0])]
            stats.generated_tokens += 1
            yield out[0]
            while len(out) < max_new_tokens and out[-1] not in stops:
                context = prompt + out
                k = min(self.num_speculative_tokens, max_new_tokens - len(out))
                drafts, q_probs = [], []
                if draft == "prompt_lookup":
                    drafts = prompt_lookup(context, k, self.lookup_ngram)
                else:  # the draft model, from what its cache lacks of the context
                    feed = context[dcache.seq_len(seq):]
                    for _ in range(k):
                        d_logits = packed_forward(draft, dcache, single_step(dcache, seq, feed, every_logit=False))
                        q = distribution(d_logits[0], temperature, top_p)
                        token = int(sample(d_logits, temperature, top_p, generator)[0])
                        drafts.append(token)
                        q_probs.append(q)
                        feed = [token]
                stats.draft_tokens += len(drafts)
                scored = packed_forward(target, cache, single_step(cache, seq, [out[-1]] + drafts, every_logit=True))
                stats.steps += 1
                stats.target_steps += 1
                stats.tokens_computed += 1 + len(drafts)
                new, accepted = verify(scored, drafts, q_probs or None, temperature, top_p, generator,
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
