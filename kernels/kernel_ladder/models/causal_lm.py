"""Decoder-only language models written with ``kernel_ladder`` ops: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Gemma 3 and GPT-OSS.

One module covers them, since they differ only in configuration (:class:`CausalLMConfig`):

* **Llama** — RMS norms, rotary embeddings (with Llama 3's or linear scaling through
  :func:`kernel_ladder.rope_cos_sin`), grouped-query attention, a SiLU-gated MLP; optional biases on the
  attention projections (``attention_bias``) and the MLP (``mlp_bias``).
* **Mistral** — the same with a sliding window on every layer (``sliding_window``).
* **Qwen2** — biases on q, k and v (not on o), and a sliding window on the layers
  ``layer_types`` marks ``"sliding_attention"``.
* **Qwen3** — Qwen2 without the qkv biases, with QK-norm: each head's query and key RMS-normalized over
  its ``head_dim`` features before the rotation (fused into the ``kernel_ladder.rope`` launch).
* **Qwen3-MoE** — Qwen3's attention; the MLP of every ``decoder_sparse_step``-th layer (but those in
  ``mlp_only_layers``) a sparse mixture of experts: a softmax router over ``num_experts``, the top
  ``num_experts_per_tok`` (renormalized if ``norm_topk_prob``), SiLU-gated experts (``kernel_ladder.moe``).
* **Gemma 3** (``Gemma3ForCausalLM``, ``gemma3_text``) — RMS norms that scale by ``1 + w``, "sandwich" norms
  (after the attention and after the MLP as well as before them), the embedding scaled by
  ``sqrt(hidden_size)``, QK-norm, local (sliding) and global layers each with its own rope base (and
  scaling), the softmax scale ``query_pre_attn_scalar ** -0.5``, a tanh-GELU-gated MLP, and the soft-capping
  of the final logits when the config sets it (``final_logit_softcapping``; its ``attn_logit_softcapping`` is
  not applied, as in Hugging Face's Gemma 3, whose attention never reads it).
* **GPT-OSS** — attention sinks (a learned per-head logit that joins every softmax's denominator:
  ``kernel_ladder.flash_attention(..., sinks=)`` / ``paged_attention(..., sinks=)``), sliding and full layers
  alternating, YaRN rope, biases on every attention projection, and an MoE MLP in every layer: a biased
  router, the top-k's softmax, experts with biases and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha *
  gate)`` with their gate and up columns interleaved (``kernel_ladder.moe(..., activation="swiglu_oai",
  gate_up_layout="gpt_oss")``).

Parameter names and shapes are Hugging Face's (``model.layers.3.self_attn.q_proj.weight`` …), so
a ``LlamaForCausalLM`` state dict or a local safetensors checkpoint in that layout loads as it is:
:meth:`CausalLM.from_hf`, :meth:`CausalLM.from_pretrained`. A config asking for what the module does not
implement is refused by name (:meth:`CausalLMConfig.from_hf`).

Every step of the forward runs a ``kernel_ladder`` op: ``rms_norm``, ``linear``, ``rope``,
``flash_attention`` (causal, sliding window, GQA without repeating K/V), ``gated_mlp`` / ``moe``, ``add``,
and with labels ``fused_linear_cross_entropy`` (the ``(N, V)`` logits never materialized). The
token embedding is a table lookup (``torch.nn.functional.embedding``: a gather, no arithmetic; Gemma's
scale is one multiply by a scalar). The serving engine runs the same layers through
:mod:`kernel_ladder.models.protocol` (each layer's ``forward_paged``).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

import kernel_ladder

from ..serving.paged_cache import CacheSpec
from ._hf import build_from_hf, mismatch_error
from .protocol import DecoderLM, RopeTables

if TYPE_CHECKING:
    from ..serving.paged_cache import PagedKVCache
    from ..serving.scheduler import SchedulerOutput

__all__ = ["CausalLM", "CausalLMConfig", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss")
_OP = "kernel_ladder.models.CausalLM"
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class CausalLMConfig:
    """The sizes and options of a :class:`CausalLM` (names as in Hugging Face's configs)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_parameters minus the default type
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    windows: list[int | None] = field(default_factory=list)  # per layer: a sliding window, or None
    model_type: str = "llama"
    pad_token_id: int | None = None  # the embedding row that gets no gradient (HF's padding_idx)
    # rope per kind of layer (Gemma 3: local and global bases): {layer type: {"rope_theta": …, scaling…}}
    # with layer_types naming each layer's kind; None: one rope (rope_theta, rope_scaling) for every layer
    rope_by_layer_type: dict[str, dict] | None = None
    layer_types: list[str] = field(default_factory=list)
    qk_norm: bool = False  # RMS-normalize each head of q and k before the rotation (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMS norm scales by (norm_offset + w): Gemma's 1 + w
    sandwich_norms: bool = False  # Gemma: norms after the attention and the MLP too
    embed_scale: float | None = None  # Gemma: the embedding times sqrt(hidden_size)
    attn_scale: float | None = None  # the softmax scale; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in every softmax's denominator
    # mixture of experts: per layer, whether its MLP is the sparse block
    moe_layers: list[bool] = field(default_factory=list)
    moe_style: str = "qwen3_moe"  # "qwen3_moe" (gate, fused SiLU experts) or "gpt_oss" (biased router/experts)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.windows:
            self.windows = [None] * n
        if len(self.windows) != n:
            raise ValueError(f"{_OP}: windows has {len(self.windows)} entries for {n} layers")
        if not self.layer_types:
            self.layer_types = ["sliding_attention" if w else "full_attention" for w in self.windows]
        if len(self.layer_types) != n:
            raise ValueError(f"{_OP}: layer_types has {len(self.layer_types)} entries for {n} layers")
        if self.rope_by_layer_type is not None:
            missing = sorted(set(self.layer_types) - set(self.rope_by_layer_type))
            if missing:
                raise ValueError(f"{_OP}: rope_by_layer_type has no rope for the layer types {missing}")
        if not self.moe_layers:
            self.moe_layers = [False] * n
        if len(self.moe_layers) != n:
            raise ValueError(f"{_OP}: moe_layers has {len(self.moe_layers)} entries for {n} layers")
        if any(self.moe_layers) and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{_OP}: an MoE layer needs 1 <= num_experts_per_tok <= num_experts, got "
                             f"{self.num_experts_per_tok} of {self.num_experts}")
        if self.moe_style not in ("qwen3_moe", "gpt_oss"):
            raise ValueError(f"{_OP}: moe_style must be 'qwen3_moe' or 'gpt_oss', got {self.moe_style!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{_OP}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"{_OP}: hidden_act {self.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")

    @classmethod
    def from_hf(cls, config) -> CausalLMConfig:
        """From a ``transformers`` config (an object, or its ``to_dict()``) of a supported family.

        Options the module does not implement are refused by name (a ``ValueError``), never ignored."""
        c = config if isinstance(config, dict) else config.to_dict()
        model_type = c.get("model_type")
        if model_type == "deepseek_v3":  # multi-head latent attention: its own model (models/deepseek_v3.py)
            from .deepseek_v3 import DeepseekV3Config

            return DeepseekV3Config.from_hf(c)
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = (" (Gemma 3's multimodal model: load its text model, Gemma3ForCausalLM)" if model_type == "gemma3"
                    else " (for other families see kernel_ladder.patch.patch_model)")
            raise ValueError(f"{_OP}: model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}{hint}")

        def refuse(what: str) -> None:
            raise ValueError(f"{_OP}: {model_type} config: {what} is not supported")

        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        layers = c["num_hidden_layers"]
        window = c.get("sliding_window")
        types = list(c.get("layer_types") or [])
        gemma, gpt_oss, moe = model_type == "gemma3_text", model_type == "gpt_oss", model_type == "qwen3_moe"
        if model_type in ("mistral", "qwen3_moe"):
            windows = [window] * layers  # None unless use_sliding_window (Qwen3-MoE's config sets it so)
        elif model_type in ("qwen2", "qwen3", "gemma3_text", "gpt_oss"):
            types = types or ["full_attention"] * layers
            windows = [window if t == "sliding_attention" else None for t in types]
        else:
            windows = [None] * layers
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{_OP}: partial rotary embeddings are not supported")
        if gemma and c.get("use_bidirectional_attention"):
            refuse("use_bidirectional_attention (attention is causal here)")

        def split_rope(params: dict | None, default_theta: float) -> tuple[float, dict | None]:
            rope = dict(params or {})
            theta = rope.pop("rope_theta", default_theta)
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in _ROPE_TYPES:
                refuse(f"rope_type {rope_type!r} (supported: {', '.join(_ROPE_TYPES)})")
            return theta, (rope if rope_type != "default" else None)

        rope_by_type = None
        params = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if gemma:  # {"sliding_attention": {...}, "full_attention": {...}}
            rope_by_type = {}
            for kind in sorted(set(types)):
                theta, scaling = split_rope(params.get(kind), 10000.0)
                rope_by_type[kind] = {"rope_theta": theta, **(scaling or {})}
            theta, scaling = 10000.0, None
        else:
            theta, scaling = split_rope(params, c.get("rope_theta", 10000.0))

        attention_bias = bool(c.get("attention_bias", False))
        moe_layers = [False] * layers
        if moe:
            if (c.get("num_local_experts") or c.get("num_experts") or 0) > 0:
                step = c.get("decoder_sparse_step", 1)
                only = set(c.get("mlp_only_layers") or [])
                moe_layers = [i not in only and (i + 1) % step == 0 for i in range(layers)]
        elif gpt_oss:
            moe_layers = [True] * layers
        act = (c.get("hidden_activation") or c.get("hidden_act", "gelu_pytorch_tanh")) if gemma else \
            c.get("hidden_act", "silu")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size") or 0,
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(c.get("mlp_bias", False)), tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            hidden_act="silu" if gpt_oss else act, windows=windows, model_type=model_type,
            pad_token_id=c.get("pad_token_id"),
            rope_by_layer_type=rope_by_type, layer_types=types if rope_by_type else [],
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"), norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma, embed_scale=c["hidden_size"] ** 0.5 if gemma else None,
            attn_scale=c["query_pre_attn_scalar"] ** -0.5 if gemma else None,
            # Gemma 3's configs carry attn_logit_softcapping, but HF's Gemma3Attention never passes it to the
            # attention (Gemma 2's did): the scores are not capped, here either
            attn_softcap=None,
            final_softcap=c.get("final_logit_softcapping") if gemma else None,
            attention_sinks=gpt_oss, moe_layers=moe_layers, moe_style="gpt_oss" if gpt_oss else "qwen3_moe",
            num_experts=c.get("num_local_experts") or c.get("num_experts") or 0,  # HF maps one name to the other
            num_experts_per_tok=c.get("num_experts_per_tok") or 0,
            moe_intermediate_size=(c.get("intermediate_size") if gpt_oss else c.get("moe_intermediate_size")) or 0,
            norm_topk_prob=True if gpt_oss else bool(c.get("norm_topk_prob", False)),
            swiglu_alpha=c.get("swiglu_alpha", 1.702), swiglu_limit=c.get("swiglu_limit", 7.0))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return kernel_ladder.linear(x, module.weight, module.bias)


def _rope(attn: Attention, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated; with QK-norm each head is RMS-normalized first, in the same launch."""
    if attn.q_norm is None:
        return kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, q_norm_weight=attn.q_norm.weight,
                              k_norm_weight=attn.k_norm.weight, norm_eps=attn.eps, norm_offset=attn.norm_offset)


class Attention(torch.nn.Module):
    """Grouped-query attention with rotary embeddings, and as the config says: a sliding window, QK-norm,
    a softmax scale, soft-capped scores, attention sinks."""

    def __init__(self, config: CausalLMConfig, layer: int) -> None:
        super().__init__()
        h, q, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = q, kv, d
        self.window = config.windows[layer]
        # which of the model's rope tables this layer rotates with (CausalLM.rope_tables)
        self.rope_key = config.layer_types[layer] if config.rope_by_layer_type is not None else "default"
        self.scale, self.softcap = config.attn_scale, config.attn_softcap
        self.eps, self.norm_offset = config.rms_norm_eps, config.norm_offset
        self.q_proj = torch.nn.Linear(h, q * d, bias=config.qkv_bias)
        self.k_proj = torch.nn.Linear(h, kv * d, bias=config.qkv_bias)
        self.v_proj = torch.nn.Linear(h, kv * d, bias=config.qkv_bias)
        self.o_proj = torch.nn.Linear(q * d, h, bias=config.o_bias)
        self.q_norm = _Norm(d, config.norm_offset) if config.qk_norm else None
        self.k_norm = _Norm(d, config.norm_offset) if config.qk_norm else None
        self.sinks = torch.nn.Parameter(torch.zeros(q)) if config.attention_sinks else None

    def _options(self) -> dict:
        """The keyword arguments the attention ops need beyond the defaults (none for Llama)."""
        options = {}
        if self.scale is not None:
            options["softmax_scale"] = self.scale
        if self.softcap is not None:
            options["softcap"] = self.softcap
        if self.sinks is not None:
            options["sinks"] = self.sinks
        return options

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``q, k, v`` as ``(B, H, T, D)`` views, q and k rotated."""
        b, t = x.shape[:2]
        q = _linear(self.q_proj, x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = _linear(self.k_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = _linear(self.v_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(self, q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = kernel_ladder.flash_attention(q, k, v, causal=True, window=self.window, **self._options())
        b, t = x.shape[:2]
        return _linear(self.o_proj, out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                      layer_index: int, step: SchedulerOutput) -> torch.Tensor:
        """The packed step's ``(T, hidden)`` through this attention over the paged cache (tables ``(1, T, D)``):
        the step's K/V written into layer ``layer_index``'s blocks first, then every query attends over its
        sequence's cached keys (decodes and prefill chunks in one launch)."""
        t = x.shape[0]
        q = _linear(self.q_proj, x).view(t, self.heads, self.head_dim)
        k = _linear(self.k_proj, x).view(t, self.kv_heads, self.head_dim)
        v = _linear(self.v_proj, x).view(t, self.kv_heads, self.head_dim)
        q, k = _rope(self, q[None], k[None], cos, sin, unsqueeze_dim=2)  # (1, T, H, D): HF's BTHD layout
        k_cache, v_cache = cache.k_cache(layer_index), cache.v_cache(layer_index)
        kernel_ladder.write_kv_cache(k[0], v, k_cache, v_cache, step.slot_mapping)
        out = kernel_ladder.paged_attention(q[0], k_cache, v_cache, step.block_tables, step.seq_lens,
                                            window=self.window, cu_seqlens_q=step.cu_seqlens_q, **self._options())
        return _linear(self.o_proj, out.reshape(t, -1))


class MLP(torch.nn.Module):
    """``down(act(gate(x)) * up(x))``: one fused ``kernel_ladder.gated_mlp`` when there are no biases."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = torch.nn.Linear(h, f, bias=bias)
        self.up_proj = torch.nn.Linear(h, f, bias=bias)
        self.down_proj = torch.nn.Linear(f, h, bias=bias)
        self.activation = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj.bias is None and self.activation == "silu":
            return kernel_ladder.gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        gate, up = _linear(self.gate_proj, x), _linear(self.up_proj, x)
        # geglu: the tanh GELU
        hidden = kernel_ladder.swiglu(gate, up) if self.activation == "silu" else kernel_ladder.geglu(gate, up)
        return _linear(self.down_proj, hidden)


class _Router(torch.nn.Module):
    """The router's ``(E, H)`` weight (and GPT-OSS's ``(E,)`` bias) under HF's names."""

    def __init__(self, experts: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(experts, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(experts)) if bias else None


class _Experts(torch.nn.Module):
    """Every expert's weights as HF stacks them: Qwen3-MoE's ``gate_up_proj (E, 2F, H)`` (gate rows then up
    rows) and ``down_proj (E, H, F)``; GPT-OSS's ``gate_up_proj (E, H, 2F)`` (gate and up columns
    interleaved), ``down_proj (E, F, H)`` and their biases ``(E, 2F)``, ``(E, H)``."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        e, h, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        if config.moe_style == "gpt_oss":
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(e, h, 2 * f))
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(e, 2 * f))
            self.down_proj = torch.nn.Parameter(torch.zeros(e, f, h))
            self.down_proj_bias = torch.nn.Parameter(torch.zeros(e, h))
        else:
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(e, 2 * f, h))
            self.down_proj = torch.nn.Parameter(torch.zeros(e, h, f))


class SparseMoE(torch.nn.Module):
    """A sparse mixture-of-experts MLP: the router's logits, then ``kernel_ladder.moe`` (top-k routing,
    tokens sorted by expert, two grouped GEMMs, the weighted combine)."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.style, self.top_k, self.renormalize = config.moe_style, config.num_experts_per_tok, config.norm_topk_prob
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        router = _Router(config.num_experts, config.hidden_size, bias=self.style == "gpt_oss")
        if self.style == "gpt_oss":
            self.router = router
        else:
            self.gate = router
        self.experts = _Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        e = self.experts
        if self.style == "gpt_oss":
            # GPT-OSS takes the softmax of the top-k logits: the full softmax's top-k renormalized
            logits = kernel_ladder.linear(tokens, self.router.weight, self.router.bias)
            out = kernel_ladder.moe(tokens, logits, e.gate_up_proj, e.down_proj, self.top_k, renormalize=True,
                                    activation="swiglu_oai", alpha=self.alpha, limit=self.limit,
                                    gate_up_bias=e.gate_up_proj_bias, down_bias=e.down_proj_bias,
                                    gate_up_layout="gpt_oss")
        else:
            logits = kernel_ladder.linear(tokens, self.gate.weight)
            out = kernel_ladder.moe(tokens, logits, e.gate_up_proj, e.down_proj, self.top_k,
                                    renormalize=self.renormalize)
        return out.view(shape)


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention then pre-norm MLP (or MoE), each added to the residual stream; with sandwich norms
    (Gemma) the attention's and the MLP's outputs are normalized too before they are added.

    ``layer(x, tables)`` with the model's rope tables (:meth:`CausalLM.rope_tables`), or ``layer(x, cos, sin)``
    with this layer's own pair; :meth:`forward_paged` is the engine's packed step over the paged cache.
    """

    def __init__(self, config: CausalLMConfig, layer: int) -> None:
        super().__init__()
        self.eps, self.offset = config.rms_norm_eps, config.norm_offset
        self.input_layernorm = _Norm(config.hidden_size, config.norm_offset)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = _Norm(config.hidden_size, config.norm_offset)
        if config.sandwich_norms:  # post_attention_layernorm then normalizes the attention's output
            self.pre_feedforward_layernorm = _Norm(config.hidden_size, config.norm_offset)
            self.post_feedforward_layernorm = _Norm(config.hidden_size, config.norm_offset)
        self.sandwich = config.sandwich_norms
        self.mlp = SparseMoE(config) if config.moe_layers[layer] else MLP(config)

    def _norm(self, norm: _Norm, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return kernel_ladder.rms_norm(x, norm.weight, self.eps, offset=self.offset)
        return kernel_ladder.rms_norm(x, norm.weight, self.eps)

    def _mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP half of the layer."""
        if self.sandwich:
            out = self._norm(self.post_feedforward_layernorm, self.mlp(self._norm(self.pre_feedforward_layernorm, x)))
            return kernel_ladder.add(x, out)
        return kernel_ladder.add(x, self.mlp(self._norm(self.post_attention_layernorm, x)))

    def _attn_out(self, out: torch.Tensor) -> torch.Tensor:
        return self._norm(self.post_attention_layernorm, out) if self.sandwich else out

    def forward(self, x: torch.Tensor, tables: RopeTables | torch.Tensor, sin: torch.Tensor | None = None
                ) -> torch.Tensor:
        cos, sin = (tables, sin) if sin is not None else tables[self.self_attn.rope_key]
        h = kernel_ladder.add(x, self._attn_out(self.self_attn(self._norm(self.input_layernorm, x), cos, sin)))
        return self._mlp_block(h)

    def forward_paged(self, x: torch.Tensor, tables: RopeTables, cache: PagedKVCache, layer_index: int,
                      step: SchedulerOutput) -> torch.Tensor:
        cos, sin = tables[self.self_attn.rope_key]
        h = self._norm(self.input_layernorm, x)
        x = kernel_ladder.add(x, self._attn_out(self.self_attn.forward_paged(h, cos, sin, cache, layer_index, step)))
        return self._mlp_block(x)


class _Norm(torch.nn.Module):
    """Holds an RMS norm's weight under HF's name (``….weight``): ones, or zeros where the norm scales by
    ``1 + w`` (Gemma), so that a new model's norms are identities either way."""

    def __init__(self, size: int, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((size,), 1.0 - offset))


class _Body(torch.nn.Module):
    """HF's ``model``: the token embedding, ``config.num_hidden_layers`` layers (``layer(config, index)``), the
    final norm."""

    def __init__(self, config, layer: Callable[[Any, int], torch.nn.Module], norm_offset: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size, norm_offset)


class CausalLM(DecoderLM):
    """A Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 / GPT-OSS decoder from ``kernel_ladder`` ops, in
    Hugging Face's parameter layout.

    ``model(input_ids)`` returns the ``(B, T, V)`` logits; ``model(input_ids, labels=labels)`` the
    mean next-token loss (labels shifted inside, as HF does; ``-100`` ignored), computed by
    ``kernel_ladder.fused_linear_cross_entropy`` without the logits.
    """

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self._body(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def _body(config: CausalLMConfig) -> torch.nn.Module:
        """HF's ``model`` of ``config``: the embedding, this family's decoder layers, the final norm (a subclass
        of another family builds its own layers here)."""
        return _Body(config, DecoderLayer, config.norm_offset)

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> CausalLM:
        """The same model as a ``transformers`` ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
        ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``Gemma3ForCausalLM`` /
        ``GptOssForCausalLM`` (its weights copied, its dtype and device kept); a ``DeepseekV3ForCausalLM``
        gives a :class:`~kernel_ladder.models.deepseek_v3.DeepseekV3ForCausalLM`."""
        if cls is CausalLM and getattr(getattr(hf_model, "config", None), "model_type", None) == "deepseek_v3":
            from .deepseek_v3 import DeepseekV3ForCausalLM

            return DeepseekV3ForCausalLM.from_hf(hf_model)
        return build_from_hf(cls, CausalLMConfig, hf_model, _OP)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> CausalLM:
        """Load a local checkpoint in Hugging Face's layout: ``config.json`` and ``*.safetensors``
        (one file or shards) in the folder ``path``."""
        from safetensors.torch import load_file

        folder = pathlib.Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{_OP}.from_pretrained: no config.json in {folder} (expected a folder saved "
                                    "by save_pretrained: config.json and model*.safetensors)")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{_OP}.from_pretrained: no .safetensors file in {folder}")
        config = CausalLMConfig.from_hf(json.loads((folder / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file), device=str(device)))
        if cls is CausalLM and config.model_type == "deepseek_v3":
            from .deepseek_v3 import DeepseekV3ForCausalLM

            model = DeepseekV3ForCausalLM(config)
        else:
            model = cls(config)
        model.to(device=device, dtype=dtype or next(iter(state.values())).dtype)
        model.load_hf_state_dict(state, source=str(folder))
        return model

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], source: str = "the state dict") -> None:
        """Copy weights named as in HF's ``*ForCausalLM``; missing, unexpected or misshapen ones are
        refused, all named at once."""
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        own = dict(self.state_dict())
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        shapes = sorted(f"{k} {tuple(state[k].shape)} (expected {tuple(own[k].shape)})" for k in set(own) & set(state)
                        if state[k].shape != own[k].shape)
        if missing or unexpected or shapes:
            raise mismatch_error(_OP, source, f"a {self.config.model_type} model of this config", missing, unexpected,
                                 shapes)
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(state[name])

    # -- the layer protocol (kernel_ladder.models.protocol: what the serving Engine runs) -------

    def cache_spec(self) -> list[CacheSpec]:
        """Every layer caches K and V of ``(num_key_value_heads, head_dim)`` per token."""
        c = self.config
        return [CacheSpec.kv(c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding: a table lookup (a gather, no arithmetic), times Gemma's ``sqrt(hidden_size)``
        (rounded to the weights' dtype first, as HF does)."""
        c = self.config
        x = torch.nn.functional.embedding(input_ids, self.model.embed_tokens.weight,
                                          padding_idx=getattr(c, "pad_token_id", None))
        if getattr(c, "embed_scale", None) is not None:
            x = x * torch.tensor(c.embed_scale, device=x.device).to(x.dtype)
        return x

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype, layer_type: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables for ``positions`` (``(T,)`` or ``(B, T)``), as HF's rotary module makes them
        (for a model with a rope per kind of layer, Gemma 3's, those of ``layer_type``)."""
        c = self.config
        theta, scaling = c.rope_theta, c.rope_scaling
        if getattr(c, "rope_by_layer_type", None) is not None:
            if layer_type not in c.rope_by_layer_type:
                raise ValueError(f"{_OP}.rotary: layer_type must be one of {sorted(c.rope_by_layer_type)}, got "
                                 f"{layer_type!r}")
            scaling = dict(c.rope_by_layer_type[layer_type])
            theta = scaling.pop("rope_theta")
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        return kernel_ladder.rope_cos_sin(positions, c.head_dim, base=theta, scaling=scaling, dtype=dtype)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """One ``(cos, sin)`` pair per rope the layers use: ``{"default": …}``, or one per layer type (Gemma 3's
        ``"sliding_attention"`` and ``"full_attention"``)."""
        if getattr(self.config, "rope_by_layer_type", None) is None:
            return {"default": self.rotary(positions, dtype)}
        return {kind: self.rotary(positions, dtype, kind) for kind in sorted(set(self.config.layer_types))}

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if getattr(c, "norm_offset", 0.0):
            return kernel_ladder.rms_norm(x, self.model.norm.weight, c.rms_norm_eps, offset=c.norm_offset)
        return kernel_ladder.rms_norm(x, self.model.norm.weight, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, then ``c * tanh(logits / c)`` when the config soft-caps the final logits (Gemma)."""
        logits = kernel_ladder.linear(hidden, self.lm_head.weight)
        cap = getattr(self.config, "final_softcap", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- running -------------------------------------------------------------------------------

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states ``(B, T, hidden)``."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(f"{_OP}: input_ids must be an integer (B, T) tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        checked = input_ids.numel() and kernel_ladder.runtime.values_checked(input_ids)  # a host sync: off on CUDA
        if checked and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"{_OP}: input_ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        x = self.embed(input_ids)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        tables = {key: (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)  # (T, D): one table for the batch
                  for key, (cos, sin) in self.rope_tables(positions, x.dtype).items()}
        for layer in self.model.layers:
            x = layer(x, tables)
        return self.final_norm(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions)
        if labels is None:
            return self.logits(hidden)
        if labels.shape != input_ids.shape:
            raise ValueError(f"{_OP}: labels must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(labels.shape)}")
        shifted = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return kernel_ladder.fused_linear_cross_entropy(shifted, self.lm_head.weight, labels[:, 1:].reshape(-1),
                                                        softcap=getattr(self.config, "final_softcap", None))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
