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
* **experts** (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3) — the ``"kernel_ladder"`` entry in
  ``ExpertsInterface`` (:func:`kernel_ladder.hf.experts`: the routed tokens through
  :mod:`kernel_ladder.ops.moe`'s grouped GEMMs on the experts' own stacked weights; GPT-OSS's transposed,
  interleaved, biased layout with its clamped SwiGLU), and the routers through :func:`kernel_ladder.topk_routing`
  (softmax, ``norm_topk_prob`` as ``renormalize``; GPT-OSS's router bias; DeepSeek-V3's grouped sigmoid routing
  with its correction bias and ``routed_scaling_factor``).
* **modules without an extension point** — their ``forward`` replaced on the instance: RMS norms (Gemma's
  ``1 + w`` with ``offset=1.0``) and layer norms, every ``nn.Linear`` and GPT-2 ``Conv1D`` (whose ``(in, out)``
  weight is read in place, transposed by strides), the rotary attention's projections and rotation
  (:func:`kernel_ladder.rope`; Qwen3's and Gemma 3's QK-norm fused into it; GPT-OSS's sinks passed on as
  ``s_aux``), DeepSeek-V3's latent attention (its projections, norms and the rotation, interleaved as the config
  says, before the attention function), the gated MLP (:func:`kernel_ladder.gated_mlp`, GeGLU for Gemma; with
  biases, Llama's ``mlp_bias``, three :func:`kernel_ladder.linear` with the gate's activation in its epilogue),
  GPT-2's, ViT's and CLIP's MLPs (the activation fused into the first GEMM). The activation is the one the
  config names (``hidden_act``; Gemma's ``hidden_activation``; GPT-2's ``activation_function``), read through
  :data:`ACTIVATIONS`; an MLP whose
  activation ``kernel_ladder`` has no kernel for (CLIP's ``quick_gelu``, say) keeps transformers' forward
  and activation between its two patched linears, and :func:`patch_model` says so (a warning, and a
  ``"mlp unfused (...)"`` entry in what it returns).
* **the loss** — a causal LM called with ``labels`` computes its loss with
  :func:`kernel_ladder.fused_linear_cross_entropy` from the last hidden states: the ``(N, V)`` logits
  are never materialized (the output's ``logits`` is then ``None``). It takes what transformers' causal-LM
  loss takes: ``num_items_in_batch`` (``Trainer`` passes it: the sum divided by it, so gradient accumulation
  weighs every token alike; else the mean), ``ignore_index``, ``shift_labels``, and ``logits_to_keep``;
  Gemma's ``final_logit_softcapping`` is applied inside the fused op (its ``softcap``); the MoE families' router
  auxiliary loss is added as transformers adds it. A keyword argument it does not honour is
  refused (transformers' loss would drop it silently). A model whose ``loss_function`` is not transformers'
  causal-LM loss, or whose LM head is not a plain ``nn.Linear``, gets its own forward (logits made).

A part whose kernel this ``kernel_ladder`` lacks (a feature the op's signature does not have) keeps
transformers' computation, and :func:`patch_model` says so: a warning and a ``"<part> left on torch (<why>)"``
entry in what it returns — never a wrong result.

Supported families: see :data:`SUPPORTED_FAMILIES`; ``docs/models.md`` tabulates which layer of each runs on
which op. :func:`unpatch_model` restores the model
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
from .ops.moe import experts_forward

__all__ = ["ACTIVATIONS", "SUPPORTED_FAMILIES", "patch_model", "unpatch_model"]

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss",
                      "deepseek_v3", "gpt2", "vit", "clip_vision_model")
_OP = "kernel_ladder.patch.patch_model"
_NAME = hf.NAME
_STATE = "_kernels_patch_state"
#: Rotary attention classes -> what their forward does besides Llama's: ``qk_norm`` (an RMS norm of each query and
#: key head before the rotation, fused into :func:`kernel_ladder.rope`), its weight ``offset`` (Gemma's ``1 + w``),
#: ``half_tables`` (GPT-OSS's rotary tables hold each frequency once: ``(B, T, D/2)``) and ``sinks`` (GPT-OSS's
#: per-head sink logits, passed to the attention as ``s_aux``).
_ROTARY_ATTENTION: dict[str, dict] = {
    "LlamaAttention": {}, "MistralAttention": {}, "Qwen2Attention": {}, "MixtralAttention": {},
    "Qwen3Attention": {"qk_norm": True}, "Qwen3MoeAttention": {"qk_norm": True},
    "Gemma3Attention": {"qk_norm": True, "offset": 1.0},
    "GptOssAttention": {"half_tables": True, "sinks": True},
}
_GATED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "DeepseekV3MLP")
#: RMS norm classes that scale by ``1 + w`` (their weight is stored centred on 0).
_OFFSET_RMS_NORM = ("Gemma3RMSNorm",)
_CAUSAL_LM = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
              "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
              "DeepseekV3ForCausalLM", "GPT2LMHeadModel")
#: Experts classes the ``ExpertsInterface`` entry (:func:`kernel_ladder.hf.experts`) runs.
_EXPERTS = ("MixtralExperts", "Qwen3MoeExperts", "GptOssExperts", "DeepseekV3Experts")
#: Families whose experts go through ``ExpertsInterface``.
_MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")

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


@functools.cache
def _accepts(function, parameter: str) -> bool:
    """Whether a ``kernel_ladder`` function takes ``parameter`` (a feature of this version of the package)."""
    return parameter in inspect.signature(function).parameters


def _eps(norm: torch.nn.Module) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def _rms_norm_forward(self, hidden_states, offset: float = 0.0):
    return kernel_ladder.rms_norm(hidden_states, self.weight, _eps(self), offset=offset)


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
    """Mixtral's and Qwen3-MoE's router: softmax over the experts, the top k, renormalized (Qwen's
    ``norm_topk_prob``; Mixtral always)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = kernel_ladder.linear(hidden_states, self.weight)
    weights, ids = kernel_ladder.topk_routing(logits, self.top_k, renormalize=getattr(self, "norm_topk_prob", True))
    return logits, weights.to(logits.dtype), ids


def _gpt_oss_router_forward(self, hidden_states):
    """GPT-OSS's router: logits with a bias, the top k, a softmax over those k — the softmax over every expert
    renormalized over the chosen ones, which is what :func:`kernel_ladder.topk_routing` computes."""
    logits = kernel_ladder.linear(hidden_states, self.weight, self.bias)
    weights, ids = kernel_ladder.topk_routing(logits, self.top_k, renormalize=True)
    return logits, weights.to(logits.dtype), ids


def _deepseek_router_forward(self, hidden_states):
    """DeepSeek-V3's router, in float32 as transformers' is: sigmoid scores; the expert choice biased by
    ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group`` groups; the unbiased scores of the
    chosen, renormalized if ``norm_topk_prob``, times ``routed_scaling_factor``."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = kernel_ladder.linear(hidden_states.float(), self.weight.float())
    weights, ids = kernel_ladder.topk_routing(logits, self.top_k, renormalize=bool(self.norm_topk_prob),
                                              scoring="sigmoid", bias=self.e_score_correction_bias,
                                              num_groups=self.num_group, topk_groups=self.topk_group,
                                              scale=float(self.routed_scaling_factor))
    return logits, weights, ids


def _update_cache(module, store, k, v, cos, sin, kwargs):
    try:
        return store.update(k, v, module.layer_idx, kwargs=kwargs)
    except TypeError:  # older transformers: update(key, value, layer_idx, cache_kwargs)
        return store.update(k, v, module.layer_idx, {"sin": sin, "cos": cos,
                                                     "cache_position": kwargs.get("cache_position")})


def _qk_norm_rope(self, q, k, cos, sin, offset: float):
    """Each query and key head RMS-normalized (``self.q_norm`` / ``self.k_norm``'s weights and eps, scaled by
    ``offset + w``) and rotated: one :func:`kernel_ladder.rope` launch where it fuses the norm, else two
    :func:`kernel_ladder.rms_norm` and the rotation."""
    eps = _eps(self.q_norm)
    if _accepts(kernel_ladder.rope, "q_norm_weight"):
        return kernel_ladder.rope(q, k, cos, sin, q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                                  norm_eps=eps, norm_offset=offset)
    q = kernel_ladder.rms_norm(q, self.q_norm.weight, eps, offset=offset)
    k = kernel_ladder.rms_norm(k, self.k_norm.weight, _eps(self.k_norm), offset=offset)
    return kernel_ladder.rope(q, k, cos, sin)


def _attention_function(module):
    """The attention function the model's implementation names: the ``"kernel_ladder"`` entry once patched, or the
    module's own eager function where the attention was left to transformers (its kernel lacking a feature)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = module.config._attn_implementation
    if implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    return sys.modules[type(module).__module__].eager_attention_forward


def _rotary_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                              past_key_values=None, *, spec: dict, **kwargs):
    """Llama's attention forward and its relatives' (:data:`_ROTARY_ATTENTION` says what each adds)."""
    input_shape = hidden_states.shape[:-1]
    shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    if spec.get("half_tables"):  # GPT-OSS: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each frequency once in the table
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if spec.get("qk_norm"):
        q, k = _qk_norm_rope(self, q, k, cos, sin, spec.get("offset", 0.0))
    else:
        q, k = kernel_ladder.rope(q, k, cos, sin)
    store = cache if cache is not None else past_key_values
    if store is not None:
        k, v = _update_cache(self, store, k, v, cos, sin, kwargs)
    attention = _attention_function(self)
    # Qwen2, Qwen3, Gemma 3 and GPT-OSS keep each layer's window on the module (None on full-attention layers);
    # Mistral and Mixtral read it from the config; Llama has none.
    window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
    extra = {"sliding_window": window} if window else {}
    if spec.get("sinks"):
        extra["s_aux"] = self.sinks
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, **extra, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(x0, x1), (x2, x3), ...`` laid out as halves ``(x0, x2, ..., x1, x3, ...)``."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _mla_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                           past_key_values=None, **kwargs):
    """DeepSeek-V3's multi-head latent attention, as transformers computes it (the latent expanded into per-head
    keys and values, the compressed ``kv`` and the rotated shared key cached): the projections on
    :func:`kernel_ladder.linear` and :func:`kernel_ladder.rms_norm` (their instance forwards), the rotation on
    :func:`kernel_ladder.rope` and the attention through ``AttentionInterface`` (keys of ``qk_head_dim``, values of
    ``v_head_dim``)."""
    batch, seq = hidden_states.shape[:-1]
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim],
                                 dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, seq, self.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, seq, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    if self.config.rope_interleave:
        # transformers rotates the interleaved pairs and writes the result as halves; the same rotation here, then
        # the same layout (so that the cache holds what transformers' would)
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        q_rot, k_rot = kernel_ladder.rope(q_rot, k_rot, cos, sin, interleaved=True)
        q_rot, k_rot = _halves(q_rot), _halves(k_rot)
    else:
        q_rot, k_rot = kernel_ladder.rope(q_rot, k_rot, cos, sin)
    store = cache if cache is not None else past_key_values
    if store is not None:
        kv_nope, k_rot = _update_cache(self, store, kv_nope, k_rot, cos, sin, kwargs)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key, value = self.expand_kv(kv_nope, k_rot)
    attention = _attention_function(self)
    out, weights = attention(self, query, key, value, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


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


def _fused_loss(hidden, head, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None, softcap=None):
    """transformers' ``ForCausalLMLoss`` (shift, flatten, cross-entropy, the sum over ``num_items_in_batch`` or the
    mean) with :func:`kernel_ladder.fused_linear_cross_entropy` on the hidden states instead of the logits;
    ``softcap``: the logits capped first (Gemma's ``final_logit_softcapping``)."""
    if shift_labels is None:  # the targets of position t are the labels at t + 1; the last position has none
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = hidden.reshape(-1, hidden.shape[-1])
    loss = kernel_ladder.fused_linear_cross_entropy(x, head.weight, shift_labels.reshape(-1).to(x.device),
                                                    bias=head.bias, ignore_index=ignore_index, softcap=softcap,
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
                       softcap=getattr(self.config, "final_logit_softcapping", None),
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
    "Gemma3MLP": ("gated_mlp", _gated_mlp_forward, "act_fn", "hidden_activation"),  # GeGLU: gelu_pytorch_tanh
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
    if name in _OFFSET_RMS_NORM:
        return "rms_norm", functools.partial(_rms_norm_forward, offset=1.0)
    if name.endswith("RMSNorm"):
        return "rms_norm", _rms_norm_forward
    if isinstance(module, torch.nn.LayerNorm):
        return "layer_norm", _layer_norm_forward
    if name in _ROTARY_ATTENTION:
        return "rotary attention", functools.partial(_rotary_attention_forward, spec=_ROTARY_ATTENTION[name])
    if name == "DeepseekV3Attention":
        return "mla attention", _mla_attention_forward
    if name in _MLPS:
        kind, forward, act_attr, field = _MLPS[name]
        activation, why = _activation(module, act_attr, getattr(module, "config", config), field)
        if activation is None:  # its forward stays transformers' (the activation torch's); its linears are patched
            return f"mlp unfused ({why})", None
        return kind, functools.partial(forward, activation=activation)
    if name in ("MixtralTopKRouter", "Qwen3MoeTopKRouter"):
        return "router", _router_forward
    if name == "GptOssTopKRouter":
        return "router", _gpt_oss_router_forward
    if name == "DeepseekV3TopkRouter":
        if not _accepts(kernel_ladder.topk_routing, "num_groups"):
            return "router left on torch (this kernel_ladder.topk_routing has no grouped sigmoid routing)", None
        return "router", _deepseek_router_forward
    if name == "Conv1D":
        return "linear", _conv1d_forward
    if isinstance(module, torch.nn.Linear):
        return "linear", _linear_forward
    if name in _CAUSAL_LM:
        return "fused loss", _causal_lm_forward
    return None


def _missing_attention_feature(family: str) -> str | None:
    """What this ``kernel_ladder.flash_attention`` lacks for ``family``'s attention (None: nothing)."""
    if family == "gpt_oss" and not _accepts(kernel_ladder.flash_attention, "sinks"):
        return "this kernel_ladder.flash_attention has no attention sinks"
    if family == "deepseek_v3" and not _accepts(kernel_ladder.flash_attention, "sinks"):
        # the value head dim other than the key's came with the sinks
        return "this kernel_ladder.flash_attention needs values of the keys' head dim"
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
    under ``"mlp unfused (<why>)"`` and a ``UserWarning`` says so; likewise a part whose kernel lacks a feature
    the family needs (``"attention left on torch (<why>)"``, ``"experts ..."``, ``"router ..."``). Qwen3's and
    Gemma 3's ``q_norm`` / ``k_norm`` are counted under ``"qk_norm (in rope)"`` (run inside the rotation).

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
        if forward is None:  # left to transformers, kind says why
            counts[kind] += 1
            continue
        if kind in ("gated_mlp", "mlp"):
            handled_children.update(id(m) for m in module.modules() if m is not module)
        if kind == "rotary attention" and _ROTARY_ATTENTION[type(module).__name__].get("qk_norm"):
            # its q_norm / k_norm run inside the attention's forward, fused into the rotation
            handled_children.update((id(module.q_norm), id(module.k_norm)))
            counts["qk_norm (in rope)" if _accepts(kernel_ladder.rope, "q_norm_weight") else "qk_norm"] += 2
        # what the instance held (a forward kernelize put there) or nothing: the class's forward
        overridden.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = types.MethodType(forward, module)
        counts[kind] += 1
    attention_modules = sum(1 for m in model.modules() if hasattr(m, "is_causal") and "Attention" in type(m).__name__)
    state = {"modules": overridden, "attn": model.config._attn_implementation,
             "use_kernels": model.__dict__.get("_use_kernels", _MISSING)}
    missing = _missing_attention_feature(family)
    if missing is None:
        model.set_attn_implementation(_NAME)
        counts["attention (AttentionInterface)"] = attention_modules
    else:
        counts[f"attention left on torch ({missing})"] = attention_modules
    if family in _MOE_FAMILIES:
        n_experts = sum(1 for m in model.modules() if type(m).__name__ in _EXPERTS)
        if family == "gpt_oss" and not _accepts(experts_forward, "activation"):
            counts["experts left on torch (this kernel_ladder.ops.moe.experts_forward has no clamped SwiGLU)"] = (
                n_experts)
        else:
            state["experts"] = model.config._experts_implementation
            model.set_experts_implementation(_NAME)
            counts["experts (ExpertsInterface)"] = n_experts
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
        elif " left on torch (" in kind:
            part, why = kind.split(" left on torch (", 1)
            warnings.warn(f"{_OP}: {count} {part} module{'s' if count > 1 else ''} left on torch (transformers' "
                          f"own computation): {why[:-1]}", UserWarning, stacklevel=2)
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
