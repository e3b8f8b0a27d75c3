"""``kernels.models``: models written only with ``kernels`` ops, loadable from Hugging Face.

* :class:`CausalLM` — the Llama / Mistral / Qwen2 decoder (GQA, sliding windows, qkv biases,
  RoPE scaling, tied embeddings), :meth:`CausalLM.from_hf` and :meth:`CausalLM.from_pretrained`
  (a local safetensors checkpoint in HF's layout).
"""

from .causal_lm import SUPPORTED_MODEL_TYPES, CausalLM, CausalLMConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLM", "CausalLMConfig"]
