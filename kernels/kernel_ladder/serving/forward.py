"""The model step: a :class:`~kernel_ladder.models.CausalLM` run on one packed step over the paged cache.

Every sequence's new tokens go through the model one after another, no padding.
:func:`kernel_ladder.write_kv_cache` stores each layer's new K/V in their slots and
:func:`kernel_ladder.paged_attention` attends over the blocks (decode and chunked prefill in one
launch, through ``cu_seqlens_q``). Only the last token of each sequence that samples goes through
the LM head.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

import kernel_ladder

from .paged_cache import PagedKVCache
from .scheduler import SchedulerOutput

if TYPE_CHECKING:
    from ..models.causal_lm import CausalLM

__all__ = ["packed_forward", "single_step"]


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
        x = kernel_ladder.add(x, layer.mlp(kernel_ladder.rms_norm(x, layer.post_attention_layernorm.weight,
                                                                  c.rms_norm_eps)))
    if step.sample_indices.numel() == 0:  # every chunk ends mid-prompt: the K/V were the work, no logits
        return x.new_empty((0, c.vocab_size))
    last = x.index_select(0, step.sample_indices.long())
    return kernel_ladder.linear(kernel_ladder.rms_norm(last, model.model.norm.weight, c.rms_norm_eps),
                                model.lm_head.weight)


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
