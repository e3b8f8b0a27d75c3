"""Run a Hugging Face ``transformers`` model on ``kernel_ladder`` ops, in place, and undo it.

:func:`patch_model` goes through the model once and, for each part it knows, routes the
computation through a ``kernel_ladder`` op, keeping every parameter where it is (same tensors, same
names, so the state dict, the optimizer and ``save_pretrained`` are unaffected):

* **attention** — through ``transformers``' own extension point: a ``"kernel_ladder"`` entry registered
  in ``AttentionInterface`` (:func:`kernel_ladder.flash_attention`: causal or not as the module says,
  the sliding window a layer passes, GQA without repeating K/V) and the matching mask entry in
  ``AttentionMaskInterface``; the model is switched to it with ``set_attn_implementation``.
* **experts** (Mixtral) — a ``"kernel_ladder"`` entry in ``ExpertsInterface`` running the routed tokens
  through :mod:`kernel_ladder.ops.moe`'s grouped GEMMs on ``MixtralExperts``' own stacked weights, and
  the router through :func:`kernel_ladder.topk_routing`.
* **modules without an extension point** — their ``forward`` replaced on the instance: RMS and
  layer norms, every ``nn.Linear`` and GPT-2 ``Conv1D`` (whose ``(in, out)`` weight is read in
  place, transposed by strides), the Llama-family attention's projections and rotary embedding
  (:func:`kernel_ladder.rope`), the gated MLP (:func:`kernel_ladder.gated_mlp`), GPT-2's, ViT's and CLIP's
  MLPs (the GELU fused into the first GEMM; CLIP's ``quick_gelu``, which ``kernel_ladder`` lacks, stays
  torch's between two patched linears).
* **the loss** — a causal LM called with ``labels`` computes its loss with
  :func:`kernel_ladder.fused_linear_cross_entropy` from the last hidden states: the ``(N, V)`` logits
  are never materialized (the output's ``logits`` is then ``None``).

Supported families: see :data:`SUPPORTED_FAMILIES`. :func:`unpatch_model` restores the model
exactly (the instance ``forward`` overrides removed, the attention and experts implementations
set back).

Padded batches (an ``attention_mask`` with zeros) and attention dropout are refused with an
error, not computed wrongly.
"""

from __future__ import annotations

import types
from collections import Counter

import torch

import kernel_ladder

__all__ = ["SUPPORTED_FAMILIES", "patch_model", "unpatch_model", "kernels_attention"]

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "gpt2", "vit", "clip_vision_model")
_OP = "kernel_ladder.patch.patch_model"
_NAME = "kernel_ladder"
_STATE = "_kernels_patch_state"
_LLAMA_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "MixtralAttention")
_GATED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
_CAUSAL_LM = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
              "GPT2LMHeadModel")


# ----------------------------------------------------------------------------------------------
# The attention and experts functions registered with transformers
# ----------------------------------------------------------------------------------------------


def kernels_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """``AttentionInterface`` entry: ``query`` ``(B, H, Tq, D)``, ``key``/``value`` ``(B, Hkv, Tk, D)``
    (a cache's keys included), returns ``((B, Tq, H, D), None)``."""
    op = "kernel_ladder.patch (attention)"
    if dropout:
        raise ValueError(f"{op}: attention dropout {dropout} is not supported by kernel_ladder.flash_attention; set the "
                         "config's attention dropout to 0 (or call model.eval())")
    if attention_mask is not None:
        mask = attention_mask
        if mask.dtype != torch.bool or mask.dim() != 2 or not bool(mask.all()):
            raise ValueError(f"{op}: padded batches are not supported (an attention_mask of shape "
                             f"{tuple(mask.shape)} with masked positions); pass unpadded sequences of one length")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    out = kernel_ladder.flash_attention(query, key, value, causal=causal, softmax_scale=scaling,
                                  window=sliding_window if causal else None, softcap=softcap)
    return out.transpose(1, 2), None


def _mask_function():
    from transformers.masking_utils import flash_attention_mask

    return flash_attention_mask  # None when nothing is padded, else the 2-D padding mask (refused above)


def kernels_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """``ExpertsInterface`` entry for ``MixtralExperts``: the routed tokens through grouped GEMMs."""
    from .ops.moe import experts_forward

    if getattr(self, "act_fn", None) is not None and type(self.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"kernel_ladder.patch (experts): only SiLU-gated experts are supported, got "
                         f"{type(self.act_fn).__name__}")
    return experts_forward(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), self.gate_up_proj,
                           self.down_proj)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_NAME, kernels_attention)
    AttentionMaskInterface.register(_NAME, _mask_function())
    ExpertsInterface.register(_NAME, kernels_experts)


# ----------------------------------------------------------------------------------------------
# Forwards put on module instances
# ----------------------------------------------------------------------------------------------


def _rms_norm_forward(self, hidden_states):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return kernel_ladder.rms_norm(hidden_states, self.weight, eps)


def _layer_norm_forward(self, x):
    return kernel_ladder.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _linear_forward(self, x):
    return kernel_ladder.linear(x, self.weight, self.bias)


def _conv1d_forward(self, x):  # GPT-2's Conv1D: weight (in, out); x @ W + b
    return kernel_ladder.linear(x, self.weight.t(), self.bias)


def _gated_mlp_forward(self, x):
    return kernel_ladder.gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def _gpt2_mlp_forward(self, hidden_states):
    h = kernel_ladder.linear(hidden_states, self.c_fc.weight.t(), self.c_fc.bias, activation="gelu_tanh")
    return self.dropout(kernel_ladder.linear(h, self.c_proj.weight.t(), self.c_proj.bias))


_FUSED_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _fc_mlp_forward(self, hidden_states):  # ViT's and CLIP's MLP: fc2(act(fc1(x))), the activation fused
    h = kernel_ladder.linear(hidden_states, self.fc1.weight, self.fc1.bias,
                       activation=_FUSED_ACTIVATIONS[self.config.hidden_act])
    return kernel_ladder.linear(h, self.fc2.weight, self.fc2.bias)


def _router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = kernel_ladder.linear(hidden_states, self.weight)
    weights, ids = kernel_ladder.topk_routing(logits, self.top_k, renormalize=True)
    return logits, weights, ids


def _llama_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                             past_key_values=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = kernel_ladder.rope(q, k, cos, sin)
    store = cache if cache is not None else past_key_values
    if store is not None:
        try:
            k, v = store.update(k, v, self.layer_idx, kwargs=kwargs)
        except TypeError:  # older transformers: update(key, value, layer_idx, cache_kwargs)
            k, v = store.update(k, v, self.layer_idx, {"sin": sin, "cos": cos,
                                                       "cache_position": kwargs.get("cache_position")})
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    # Qwen2 keeps each layer's window on the module (None on full-attention layers); Mistral and
    # Mixtral read it from the config; Llama has none.
    window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
    extra = {"sliding_window": window} if window else {}
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, **extra, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _causal_lm_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    """With labels: the loss from the hidden states by kernel_ladder.fused_linear_cross_entropy."""
    if labels is None or getattr(self.config, "output_router_logits", False) or kwargs.get("inputs_embeds") is not None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("logits_to_keep", None)
    kwargs.pop("num_items_in_batch", None)
    body = self.transformer if hasattr(self, "transformer") else self.model
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs.last_hidden_state
    head = self.get_output_embeddings()
    loss = kernel_ladder.fused_linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), head.weight,
                                              labels[:, 1:].reshape(-1).to(hidden.device), bias=head.bias)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                                  hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))


def _handler(module: torch.nn.Module):
    """The ``(kind, forward)`` for ``module``, or None."""
    name = type(module).__name__
    if name.endswith("RMSNorm"):
        return "rms_norm", _rms_norm_forward
    if isinstance(module, torch.nn.LayerNorm):
        return "layer_norm", _layer_norm_forward
    if name in _LLAMA_ATTENTION:
        return "rotary attention", _llama_attention_forward
    if name in _GATED_MLP:
        return "gated_mlp", _gated_mlp_forward
    if name == "GPT2MLP":
        return "mlp", _gpt2_mlp_forward
    if name in ("ViTMLP", "CLIPMLP") and getattr(module.config, "hidden_act", None) in _FUSED_ACTIVATIONS:
        return "mlp", _fc_mlp_forward  # (other activations, e.g. CLIP's quick_gelu: fc1 and fc2 patched alone)
    if name == "MixtralTopKRouter":
        return "router", _router_forward
    if name == "Conv1D":
        return "linear", _conv1d_forward
    if isinstance(module, torch.nn.Linear):
        return "linear", _linear_forward
    if name in _CAUSAL_LM:
        return "fused loss", _causal_lm_forward
    return None


def _family(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"{_OP}: {type(model).__name__} (model_type {model_type!r}) is not supported; supported "
                         f"families: {', '.join(SUPPORTED_FAMILIES)}")
    return model_type


def patch_model(model: torch.nn.Module) -> dict[str, int]:
    """Patch a ``transformers`` model in place to run on ``kernel_ladder`` ops; returns what was replaced, by kind.

    Outputs and gradients are unchanged up to rounding. Refuses an unsupported model (the error
    lists the supported families) and a model already patched. Undo with :func:`unpatch_model`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_OP}: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    family = _family(model)
    if getattr(model, _STATE, None) is not None:
        raise ValueError(f"{_OP}: this model is already patched (call kernel_ladder.patch.unpatch_model first)")
    _register()
    counts: Counter[str] = Counter()
    overridden = []
    # Modules whose own forward we replace handle their children (a gated MLP's projections, GPT-2's
    # MLP) or must not be double-handled: their Linear children are skipped.
    handled_children: set[int] = set()
    for module in model.modules():
        if id(module) in handled_children:
            continue
        handler = _handler(module)
        if handler is None:
            continue
        kind, forward = handler
        if kind in ("gated_mlp", "mlp"):
            handled_children.update(id(m) for m in module.modules() if m is not module)
        module.forward = types.MethodType(forward, module)
        overridden.append(module)
        counts[kind] += 1
    attention_modules = sum(1 for m in model.modules() if hasattr(m, "is_causal") and "Attention" in type(m).__name__)
    state = {"modules": overridden, "attn": model.config._attn_implementation, "experts": None}
    model.set_attn_implementation(_NAME)
    counts["attention (AttentionInterface)"] = attention_modules
    if family == "mixtral":
        state["experts"] = getattr(model.config, "_experts_implementation", None)
        model.set_experts_implementation(_NAME)
        counts["experts (ExpertsInterface)"] = sum(1 for m in model.modules() if type(m).__name__ == "MixtralExperts")
    setattr(model, _STATE, state)
    return dict(counts)


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model`: the original forwards and attention/experts implementations. Returns ``model``."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("kernel_ladder.patch.unpatch_model: this model was not patched by kernel_ladder.patch.patch_model")
    for module in state["modules"]:
        del module.forward  # the instance attribute; the class's forward is visible again
    model.set_attn_implementation(state["attn"])
    if state["experts"] is not None:
        model.set_experts_implementation(state["experts"])
    delattr(model, _STATE)
    return model
