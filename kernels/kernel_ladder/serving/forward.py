"""The model step: a decoder model (:class:`~kernel_ladder.models.protocol.DecoderLM`) run on one packed
step over the paged cache.

Every sequence's new tokens go through the model one after another, no padding. The step knows no
family's layers: it embeds the tokens, builds the model's rope tables for their positions, and hands
the ``(T, hidden)`` stream to each layer's ``forward_paged`` — which writes its cache entries for the
step's slots (``kernel_ladder.write_kv_cache``, or ``write_latent_cache`` for MLA) and attends over the
blocks (decode and chunked prefill in one launch, through ``cu_seqlens_q``). Only the last token of each
sequence that samples goes through the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from .paged_cache import PagedKVCache
from .scheduler import SchedulerOutput

if TYPE_CHECKING:
    from ..models.protocol import DecoderLM

__all__ = ["packed_forward", "single_step"]


@torch.no_grad()
def packed_forward(model: DecoderLM, cache: PagedKVCache, step: SchedulerOutput) -> torch.Tensor:
    """``model`` on one packed step over ``cache``: every sequence's new tokens one after another.
    Writes their cache entries and returns the logits ``(S, V)`` of the tokens at ``step.sample_indices``."""
    x = model.embed(step.token_ids.long())  # (T, hidden)
    tables = model.rope_tables(step.positions.long()[None], x.dtype)  # each (1, T, R)
    for index, layer in enumerate(model.decoder_layers()):
        x = layer.forward_paged(x, tables, cache, index, step)
    if step.sample_indices.numel() == 0:  # every chunk ends mid-prompt: the cache entries were the work
        return x.new_empty((0, model.config.vocab_size))
    last = x.index_select(0, step.sample_indices.long())
    return model.logits(model.final_norm(last))


def single_step(cache: PagedKVCache, seq_id: Hashable, tokens: list[int], every_logit: bool) -> SchedulerOutput:
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
