"""Run a Hugging Face ``transformers`` model on ``kernel_ladder`` ops, in place, and undo it.

:func:`patch_model` goes through the model once and, for each part it knows, routes the
computation through a ``kernel_ladder`` op, keeping every parameter where it is (same tensors, same
names, so the state dict, the optimizer and ``save_pretrained`` are unaffected):

* **attention** — through ``transformers``' own extension points (:mod:`kernel_ladder.hf`): the
  ``"kernel_ladder"`` entries :func:`kernel_ladder.hf.register` puts in ``AttentionInterface``
  (:func:`kernel_ladder.hf.attention`, running :func:`kernel_ladder.flash_attention`: causal or not as
  the module says, the sliding window a layer passes, GQA without repeating K/V; a padded batch or packed
  sequences unpadded into :func:`kernel_ladder.flash_attention_varlen`) and ``AttentionMaskInterface``;
  the model is switched to it with ``set_attn_implementation``.
* **experts** (Mixtral) — the ``"kernel_ladder"`` entry in ``ExpertsInterface``
  (:func:`kernel_ladder.hf.experts`: the routed tokens through :mod:`kernel_ladder.ops.moe`'s grouped
  GEMMs on ``MixtralExperts``' own stacked weights), and the router through
  :func:`kernel_ladder.topk_routing`.
* **modules without an extension point** — their ``forward`` replaced on the instance: RMS and
  layer norms, every ``nn.Linear`` and GPT-2 ``Conv1D`` (whose ``(in, out)`` weight is read in
  place, transposed by strides), the Llama-family attention's projections and rotary embedding
  (:func:`kernel_ladder.rope`), the gated MLP (:func:`kernel_ladder.gated_mlp`; with biases, Llama's
  ``mlp_bias``, three :func:`kernel_ladder.linear` with the gate's activation in its epilogue), GPT-2's,
  ViT's and CLIP's MLPs (the activation fused into the first GEMM). The activation is the one the config
  names (``hidden_act``; GPT-2's ``activation_function``), read through :data:`ACTIVATIONS`; an MLP whose
  activation ``kernel_ladder`` has no kernel for (CLIP's ``quick_gelu``, say) keeps transformers' forward
  and activation between its two patched linears, and :func:`patch_model` says so (a warning, and a
  ``"mlp unfused (...)"`` entry in what it returns).
* **the loss** — a causal LM called with ``labels`` computes its loss with
  :func:`kernel_ladder.fused_linear_cross_entropy` from the last hidden states: the ``(N, V)`` logits
  are never materialized (the output's ``logits`` is then ``None``). It takes what transformers' causal-LM
  loss takes: ``num_items_in_batch`` (``Trainer`` passes it: the sum divided by it, so gradient accumulation
  weighs every token alike; else the mean), ``ignore_index``, ``shift_labels``, and ``logits_to_keep``;
  Mixtral's router auxiliary loss is added as transformers adds it. A keyword argument it does not honour is
  refused (transformers' loss would drop it silently). A model whose ``loss_function`` is not transformers'
  causal-LM loss, or whose LM head is not a plain ``nn.Linear``, gets its own forward (logits made).

Supported families: see :data:`SUPPORTED_FAMILIES`. :func:`unpatch_model` restores the model
exactly (each module's forward as it was, a kernelized one included; the attention and experts
implementations set back).

Attention dropout is refused with an error, not computed wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import warnings
from collections import Counter

import torch

import kernel_ladder

from . import hf

__all__ = ["ACTIVATIONS", "SUPPORTED_FAMILIES", "patch_model", "unpatch_model"]

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "gpt2", "vit", "clip_vision_model")
_OP = "kernel_ladder.patch.patch_model"
_NAME = hf.NAME
_STATE = "_kernels_patch_state"
_LLAMA_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "MixtralAttention")
_GATED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
_CAUSAL_LM = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
              "GPT2LMHeadModel")

#: transformers' activation names (``ACT2FN``'s keys) -> the ``kernel_ladder`` activation computing the same
#: function: SiLU; exact GELU; the tanh approximation of GELU, which ``gelu_new``, ``gelu_fast`` and
#: ``gelu_accurate`` write out differently (the same function up to rounding); ReLU.
ACTIVATIONS: dict[str, str] = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu", "gelu_python": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh",
    "relu": "relu",
}


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


def _gated_mlp_forward(self, x, activation: str):
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if gate.bias is None and up.bias is None and down.bias is None:
        return kernel_ladder.gated_mlp(x, gate.weight, up.weight, down.weight, activation=activation)
    # Biases (Llama's mlp_bias): the fused op has none, so three GEMMs, the gate's bias and activation in its
    # epilogue, the up and down biases in theirs.
    h = kernel_ladder.linear(x, gate.weight, gate.bias, activation=activation) * kernel_ladder.linear(
        x, up.weight, up.bias)
    return kernel_ladder.linear(h, down.weight, down.bias)


def _gpt2_mlp_forward(self, hidden_states, activation: str):
    h = kernel_ladder.linear(hidden_states, self.c_fc.weight.t(), self.c_fc.bias, activation=activation)
    return self.dropout(kernel_ladder.linear(h, self.c_proj.weight.t(), self.c_proj.bias))


def _fc_mlp_forward(self, hidden_states, activation: str):  # ViT's and CLIP's MLP: fc2(act(fc1(x))), act fused
    h = kernel_ladder.linear(hidden_states, self.fc1.weight, self.fc1.bias, activation=activation)
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


# ----------------------------------------------------------------------------------------------
# The causal LM's forward with the fused loss
# ----------------------------------------------------------------------------------------------

#: What transformers' causal-LM loss (``ForCausalLMLoss``) takes besides the logits and labels; honoured.
_LOSS_KEYWORDS = ("num_items_in_batch", "ignore_index", "shift_labels")


@functools.cache
def _forward_signature(model_class: type) -> tuple[tuple[str, ...], frozenset[str], type | None]:
    """The class forward's positional parameters (after self), every keyword it and transformers' model kwargs
    take, and its output class (None when its annotation does not name one)."""
    signature = inspect.signature(model_class.forward)
    names = tuple(p.name for p in list(signature.parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    try:
        from transformers.utils.generic import TransformersKwargs

        model_kwargs = set(TransformersKwargs.__annotations__)
    except ImportError:  # an older transformers: the keywords its models pass on
        model_kwargs = {"output_hidden_states", "output_attentions", "output_router_logits", "position_ids",
                        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"}
    known = frozenset({*names, *model_kwargs, *_LOSS_KEYWORDS, "return_dict", "past_key_values"})
    output = signature.return_annotation
    if isinstance(output, str):  # a postponed annotation: look it up in the model's module
        output = getattr(sys.modules[model_class.__module__], output, None)
    return names, known, output if isinstance(output, type) and dataclasses.is_dataclass(output) else None


def _fusable(model) -> bool:
    """Whether the loss is transformers' causal-LM loss on a plain linear head (what the fused op computes)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = model.get_output_embeddings()
    return (model.loss_function is ForCausalLMLoss and isinstance(head, torch.nn.Linear)
            and type(head).forward is torch.nn.Linear.forward)


def _kept(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """transformers' ``slice_logits_to_keep``: the positions whose logits (here: loss) are computed."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # older transformers: the slice written in each model
        return hidden[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def _fused_loss(hidden, head, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """transformers' ``ForCausalLMLoss`` (shift, flatten, cross-entropy, the sum over ``num_items_in_batch`` or the
    mean) with :func:`kernel_ladder.fused_linear_cross_entropy` on the hidden states instead of the logits."""
    if shift_labels is None:  # the targets of position t are the labels at t + 1; the last position has none
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = hidden.reshape(-1, hidden.shape[-1])
    loss = kernel_ladder.fused_linear_cross_entropy(x, head.weight, shift_labels.reshape(-1).to(x.device),
                                                    bias=head.bias, ignore_index=ignore_index,
                                                    reduction="mean" if num_items_in_batch is None else "sum")
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _causal_lm_forward(self, *args, **kwargs):
    """With labels: the loss from the hidden states by kernel_ladder.fused_linear_cross_entropy."""
    names, known, output_class = _forward_signature(type(self))
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward takes {len(names)} positional arguments after self, "
                        f"got {len(args)}")
    for name, value in zip(names, args):
        if name in kwargs:
            raise TypeError(f"{type(self).__name__}.forward got multiple values for argument {name!r}")
        kwargs[name] = value
    if kwargs.get("labels") is None or output_class is None or not _fusable(self):
        return type(self).forward(self, **kwargs)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"kernel_ladder.patch: {type(self).__name__}.forward with labels does not honour the "
                         f"keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(transformers would pass it to its loss, which drops it); the patched loss takes "
                         f"{', '.join(_LOSS_KEYWORDS)} and logits_to_keep, and the model's own arguments")
    labels = kwargs.pop("labels")
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    fields = {f.name for f in dataclasses.fields(output_class)}
    router = "aux_loss" in fields  # Mixtral: the router's load-balancing loss
    if router:
        if kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = self.config.output_router_logits
        router = bool(kwargs["output_router_logits"])
    body = self.transformer if hasattr(self, "transformer") else self.model
    outputs = body(**kwargs)  # what transformers passes its body, the loss's keywords included
    hidden = _kept(outputs.last_hidden_state, logits_to_keep)
    loss = _fused_loss(hidden, self.get_output_embeddings(), labels,
                       **{k: kwargs[k] for k in _LOSS_KEYWORDS if k in kwargs})
    result = {"loss": loss, "logits": None}
    if router:
        load_balancing_loss_func = sys.modules[type(self).__module__].load_balancing_loss_func
        aux = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                       kwargs.get("attention_mask"))
        result["aux_loss"] = aux
        result["loss"] = loss + self.router_aux_loss_coef * aux.to(loss.device)
    for name in fields - set(result):
        result[name] = getattr(outputs, name, None)
    output = output_class(**result)
    return output if return_dict else output.to_tuple()


#: MLP classes -> (kind, forward, the module's activation attribute, the config field naming it).
_MLPS = {
    **{name: ("gated_mlp", _gated_mlp_forward, "act_fn", "hidden_act") for name in _GATED_MLP},
    "GPT2MLP": ("mlp", _gpt2_mlp_forward, "act", "activation_function"),
    "ViTMLP": ("mlp", _fc_mlp_forward, "activation_fn", "hidden_act"),
    "CLIPMLP": ("mlp", _fc_mlp_forward, "activation_fn", "hidden_act"),
}


def _activation(module: torch.nn.Module, act_attr: str, config, field: str) -> tuple[str | None, str]:
    """The ``kernel_ladder`` activation the config names for ``module`` (None if there is none), and why not."""
    value = getattr(config, field, None)
    name = ACTIVATIONS.get(value) if isinstance(value, str) else None
    if name is None:
        return None, f"{field}={value!r} has no kernel_ladder kernel"
    act = getattr(module, act_attr, None)
    if act is not None:
        from transformers.activations import ACT2CLS

        made = ACT2CLS[value][0] if isinstance(ACT2CLS[value], tuple) else ACT2CLS[value]
        if type(act) is not made:  # replaced after the model was built: the module's is what runs
            return None, f"its {act_attr} is a {type(act).__name__}, not the {made.__name__} {field}={value!r} makes"
    return name, ""


def _handler(module: torch.nn.Module, config):
    """The ``(kind, forward)`` for ``module``; ``(reason, None)`` for an MLP left to transformers; or None."""
    name = type(module).__name__
    if name.endswith("RMSNorm"):
        return "rms_norm", _rms_norm_forward
    if isinstance(module, torch.nn.LayerNorm):
        return "layer_norm", _layer_norm_forward
    if name in _LLAMA_ATTENTION:
        return "rotary attention", _llama_attention_forward
    if name in _MLPS:
        kind, forward, act_attr, field = _MLPS[name]
        activation, why = _activation(module, act_attr, getattr(module, "config", config), field)
        if activation is None:  # its forward stays transformers' (the activation torch's); its linears are patched
            return f"mlp unfused ({why})", None
        return kind, functools.partial(forward, activation=activation)
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
    An MLP whose activation has no ``kernel_ladder`` kernel keeps transformers' forward: it is counted
    under ``"mlp unfused (<why>)"`` and a ``UserWarning`` says so.

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
        handler = _handler(module, model.config)
        if handler is None:
            continue
        kind, forward = handler
        if forward is None:  # an MLP left to transformers, kind says why
            counts[kind] += 1
            continue
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
    for kind, count in counts.items():
        if kind.startswith("mlp unfused"):
            warnings.warn(f"{_OP}: {count} MLP{'s' if count > 1 else ''} left to transformers' forward, "
                          f"{kind.removeprefix('mlp unfused (')[:-1]}: their linears run on kernel_ladder.linear, "
                          "the activation on torch", UserWarning, stacklevel=2)
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
