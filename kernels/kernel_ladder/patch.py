"""Run a Hugging Face ``transformers`` model on ``kernel_ladder`` ops, in place, and undo it.

:func:`patch_model` goes through the model once and, for each part it knows, routes the
computation through a ``kernel_ladder`` op, keeping every parameter where it is (same tensors, same
names, so the state dict, the optimizer and ``save_pretrained`` are unaffected):

* **attention** — through ``transformers``' own extension points (:mod:`kernel_ladder.hf`): the
  ``"kernel_ladder"`` entries :func:`kernel_ladder.hf.register` puts in ``AttentionInterface``
  (:func:`kernel_ladder.hf.attention`, running :func:`kernel_ladder.flash_attention`: causal or not as
  the module says, the sliding window a layer passes, GQA without repeating K/V) and
  ``AttentionMaskInterface``; the model is switched to it with ``set_attn_implementation``.
* **experts** (Mixtral) — the ``"kernel_ladder"`` entry in ``ExpertsInterface``
  (:func:`kernel_ladder.hf.experts`: the routed tokens through :mod:`kernel_ladder.ops.moe`'s grouped
  GEMMs on ``MixtralExperts``' own stacked weights), and the router through
  :func:`kernel_ladder.topk_routing`.
* **modules without an extension point** — their ``forward`` replaced on the instance: RMS and
  layer norms, every ``nn.Linear`` and GPT-2 ``Conv1D`` (whose ``(in, out)`` weight is read in
  place, transposed by strides), the Llama-family attention's projections and rotary embedding
  (:func:`kernel_ladder.rope`), the gated MLP (:func:`kernel_ladder.gated_mlp`), GPT-2's, ViT's and CLIP's
  MLPs (the GELU fused into the first GEMM; CLIP's ``quick_gelu``, which ``kernel_ladder`` lacks, stays
  torch's between two patched linears).
* **the loss** — a causal LM called with ``labels`` computes its loss with
  :func:`kernel_ladder.fused_linear_cross_entropy` from the last hidden states: the ``(N, V)`` logits
  are never materialized (the output's ``logits`` is then ``None``). Given ``num_items_in_batch``
  (``Trainer`` passes it), the loss is normalized by it, as transformers' own loss is, so gradient
  accumulation weighs every token alike.

Supported families: see :data:`SUPPORTED_FAMILIES`. :func:`unpatch_model` restores the model
exactly (each module's forward as it was, a kernelized one included; the attention and experts
implementations set back).

Padded batches (an ``attention_mask`` with zeros) and attention dropout are refused with an
error, not computed wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections import Counter

import torch

import kernel_ladder

from . import hf

__all__ = ["SUPPORTED_FAMILIES", "patch_model", "unpatch_model"]

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "gpt2", "vit", "clip_vision_model")
_OP = "kernel_ladder.patch.patch_model"
_NAME = hf.NAME
_STATE = "_kernels_patch_state"
_LLAMA_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "MixtralAttention")
_GATED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
_CAUSAL_LM = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
              "GPT2LMHeadModel")


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


@functools.cache
def _cache_field(output_class: type) -> str:
    """The output's cache field in this transformers: ``cache`` from 5.25 (the old ``past_key_values`` warns)."""
    return "cache" if "cache" in {f.name for f in dataclasses.fields(output_class)} else "past_key_values"


def _causal_lm_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    """With labels: the loss from the hidden states by kernel_ladder.fused_linear_cross_entropy."""
    if labels is None or getattr(self.config, "output_router_logits", False) or kwargs.get("inputs_embeds") is not None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("logits_to_keep", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    body = self.transformer if hasattr(self, "transformer") else self.model
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs.last_hidden_state
    head = self.get_output_embeddings()
    # Like transformers' causal-LM loss: given the number of targets in the whole (accumulated) batch, as
    # Trainer passes it, the sum over this micro-batch divided by it; else the mean over this batch.
    loss = kernel_ladder.fused_linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), head.weight,
                                                    labels[:, 1:].reshape(-1).to(hidden.device), bias=head.bias,
                                                    reduction="mean" if num_items_in_batch is None else "sum")
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    cache = _cache_field(CausalLMOutputWithPast)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None),
                                  **{cache: getattr(outputs, cache, None)})


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


_MISSING = object()


def patch_model(model: torch.nn.Module) -> dict[str, int]:
    """Patch a ``transformers`` model in place to run on ``kernel_ladder`` ops; returns what was replaced, by kind.

    Outputs and gradients are unchanged up to rounding. Refuses an unsupported model (the error
    lists the supported families) and a model already patched. Undo with :func:`unpatch_model`.

    Composes with ``kernels.kernelize`` (which transformers' ``from_pretrained`` runs by default when
    ``kernels`` is installed): a forward that kernelize put on a module is kept aside and put back by
    :func:`unpatch_model`, and while patched the model does not kernelize itself again when
    ``train()`` / ``eval()`` change its mode (that would replace the patched norms).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_OP}: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    family = _family(model)
    if getattr(model, _STATE, None) is not None:
        raise ValueError(f"{_OP}: this model is already patched (call kernel_ladder.patch.unpatch_model first)")
    hf.register()
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
        # what the instance held (a forward kernelize put there) or nothing: the class's forward
        overridden.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = types.MethodType(forward, module)
        counts[kind] += 1
    attention_modules = sum(1 for m in model.modules() if hasattr(m, "is_causal") and "Attention" in type(m).__name__)
    state = {"modules": overridden, "attn": model.config._attn_implementation,
             "use_kernels": model.__dict__.get("_use_kernels", _MISSING)}
    model.set_attn_implementation(_NAME)
    counts["attention (AttentionInterface)"] = attention_modules
    if family == "mixtral":
        state["experts"] = model.config._experts_implementation
        model.set_experts_implementation(_NAME)
        counts["experts (ExpertsInterface)"] = sum(1 for m in model.modules() if type(m).__name__ == "MixtralExperts")
    if state["use_kernels"] is not _MISSING:
        # transformers' train()/eval() kernelize a model whose use_kernels is on whenever its mode changes,
        # which would put the decorated layers' forwards back over the patched ones
        model._use_kernels = False
    setattr(model, _STATE, state)
    return dict(counts)


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model`: each module's forward as it was (kernelized or the class's), the attention and
    experts implementations, and transformers' ``use_kernels``. Returns ``model``."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("kernel_ladder.patch.unpatch_model: this model was not patched by "
                         "kernel_ladder.patch.patch_model")
    for module, forward in state["modules"]:
        if forward is _MISSING:
            del module.forward  # the instance attribute; the class's forward is visible again
        else:
            module.forward = forward
    model.set_attn_implementation(state["attn"])
    if "experts" in state:
        model.set_experts_implementation(state["experts"])
    if state["use_kernels"] is not _MISSING:
        model._use_kernels = state["use_kernels"]
    delattr(model, _STATE)
    return model
