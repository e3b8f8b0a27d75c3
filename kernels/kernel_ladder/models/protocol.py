"""The boundary between a decoder-only model and the serving :class:`~kernel_ladder.serving.Engine`.

The engine knows nothing of any family's layers. It runs a model that subclasses :class:`DecoderLM`
through these methods, one packed step at a time (:func:`kernel_ladder.serving.forward.packed_forward`)::

    x = model.embed(token_ids)                               # (T, hidden)
    tables = model.rope_tables(positions[None], x.dtype)     # {rope key: (cos, sin)}, each (1, T, R)
    for index, layer in enumerate(model.decoder_layers()):
        x = layer.forward_paged(x, tables, cache, index, step)
    logits = model.logits(model.final_norm(x[sample_indices]))

* :meth:`DecoderLM.cache_spec` says what each layer keeps per token — a K and a V of ``(Hkv, D)`` /
  ``(Hkv, Dv)``, or one latent vector of ``kv_lora_rank + rope_dim`` features (DeepSeek's MLA) — and the
  engine allocates a :class:`~kernel_ladder.serving.PagedKVCache` of exactly that (``spec=``).
* :meth:`DecoderLM.rope_tables` returns one ``(cos, sin)`` pair per kind of rotary embedding the model uses
  (Gemma 3's local and global bases, GPT-OSS's YaRN, DeepSeek's decoupled rope width): each layer picks
  its own by key. The same tables feed the dense forward (``layer(x, tables)``) and the paged one.
* A layer's ``forward_paged(x, tables, cache, layer_index, step)`` takes the step's ``(T, hidden)``
  residual stream and returns the next one: it writes its new cache entries through ``step.slot_mapping``
  into ``cache``'s tensors of ``layer_index`` before it reads them (``kernel_ladder.write_kv_cache`` then
  ``kernel_ladder.paged_attention``; ``write_latent_cache`` then ``mla_attention`` for MLA), attending over
  ``step.block_tables`` / ``step.seq_lens`` with ``step.cu_seqlens_q`` (decodes and prefill chunks in one
  launch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..serving.paged_cache import CacheSpec, PagedKVCache
    from ..serving.scheduler import SchedulerOutput

__all__ = ["DecoderLM", "PagedLayer", "RopeTables"]

#: One ``(cos, sin)`` pair per kind of rotary embedding, keyed by the name the layers use.
RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]


class PagedLayer(Protocol):
    """A decoder layer the engine can run: the dense ``forward(x, tables)`` (training, scoring) and this."""

    def forward_paged(self, x: torch.Tensor, tables: RopeTables, cache: PagedKVCache, layer_index: int,
                      step: SchedulerOutput) -> torch.Tensor:
        """``(T, hidden)`` in, ``(T, hidden)`` out, this layer's cache entries for the step's tokens written."""
        ...


class DecoderLM(torch.nn.Module):
    """The base class of every decoder-only model :class:`~kernel_ladder.serving.Engine` serves.

    A subclass has a ``config`` with ``vocab_size`` and ``num_hidden_layers``, and implements the methods
    below (see the module docstring for how the engine calls them).
    """

    config: object

    def cache_spec(self) -> list[CacheSpec]:
        """What each layer's paged cache holds per token, one :class:`~kernel_ladder.serving.CacheSpec` per layer."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(...)`` to the first residual stream ``(..., hidden)``."""
        raise NotImplementedError

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The rotary tables of ``positions`` (``(T,)`` or ``(B, T)``), one ``(cos, sin)`` per kind the layers use."""
        raise NotImplementedError

    def decoder_layers(self) -> Sequence[PagedLayer]:
        """The layers, in order (by default ``self.model.layers``, Hugging Face's place for them)."""
        return self.model.layers

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm after the last layer."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states ``(..., hidden)`` to logits ``(..., vocab)`` (the LM head, soft-capped if the
        model does)."""
        raise NotImplementedError
