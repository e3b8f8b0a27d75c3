"""``kernel_ladder.models``: models written only with ``kernel_ladder`` ops, loadable from Hugging Face.

* :class:`CausalLM` — the Llama / Mistral / Qwen2 decoder (GQA, sliding windows, qkv biases,
  RoPE scaling, tied embeddings), :meth:`CausalLM.from_hf` and :meth:`CausalLM.from_pretrained`
  (a local safetensors checkpoint in HF's layout).
* :class:`Engine` — generation with continuous batching, chunked prefill and prefix caching over
  chapter 08's paged KV cache, greedy or sampled, streaming, and speculative decoding (a draft
  model or prompt lookup); it lives in :mod:`kernel_ladder.serving` with the cache and the scheduler.
* :class:`DecoderLM` — the layer protocol a model implements for the engine to serve it
  (:mod:`kernel_ladder.models.protocol`: embedding, per-layer cache spec, rope tables, paged layers).
* :class:`DeepseekV3ForCausalLM` — DeepSeek-V3: multi-head latent attention, dense then MoE layers
  (sigmoid, bias-corrected, group-limited routing; shared experts); ``CausalLM.from_hf`` of a
  ``DeepseekV3ForCausalLM`` returns one.
* :class:`ViT` — the vision encoder of ``ViTModel`` and ``CLIPVisionModel``, :meth:`ViT.from_hf`.
"""

from ..serving.engine import Engine, EngineStats
from .causal_lm import SUPPORTED_MODEL_TYPES, CausalLM, CausalLMConfig
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from .protocol import DecoderLM
from .vit import ViT, ViTConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLM", "CausalLMConfig", "DecoderLM", "DeepseekV3Config",
           "DeepseekV3ForCausalLM", "Engine", "EngineStats", "ViT", "ViTConfig"]
