"""A decoder-only language model written with ``kernel_ladder`` ops: the Llama / Mistral / Qwen2 family.

One module covers the three, since they differ only in configuration:

* **Llama** — RMS norms, rotary embeddings (with Llama 3's or linear scaling through
  :func:`kernel_ladder.rope_cos_sin`), grouped-query attention, a SiLU-gated MLP; optional biases on the
  attention projections (``attention_bias``) and the MLP (``mlp_bias``).
* **Mistral** — the same with a sliding window on every layer (``sliding_window``).
* **Qwen2** — biases on q, k and v (not on o), and a sliding window on the layers
  ``layer_types`` marks ``"sliding_attention"``.

Parameter names and shapes are Hugging Face's (``model.layers.3.self_attn.q_proj.weight`` …), so
a ``LlamaForCausalLM`` state dict or a local safetensors checkpoint in that layout loads as it is:
:meth:`CausalLM.from_hf`, :meth:`CausalLM.from_pretrained`.

Every step of the forward runs a ``kernel_ladder`` op: ``rms_norm``, ``linear``, ``rope``,
``flash_attention`` (causal, sliding window, GQA without repeating K/V), ``gated_mlp``, ``add``,
and with labels ``fused_linear_cross_entropy`` (the ``(N, V)`` logits never materialized). The
token embedding is a table lookup (``torch.nn.functional.embedding``: a gather, no arithmetic).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

import kernel_ladder

from ..serving.paged_cache import CacheSpec
from ._hf import build_from_hf, mismatch_error
from .protocol import DecoderLM, RopeTables

if TYPE_CHECKING:
    from ..serving.paged_cache import PagedKVCache
    from ..serving.scheduler import SchedulerOutput

__all__ = ["CausalLM", "CausalLMConfig", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_OP = "kernel_ladder.models.CausalLM"


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

    def __post_init__(self) -> None:
        if not self.windows:
            self.windows = [None] * self.num_hidden_layers
        if len(self.windows) != self.num_hidden_layers:
            raise ValueError(f"{_OP}: windows has {len(self.windows)} entries for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{_OP}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"{_OP}: hidden_act {self.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")

    @classmethod
    def from_hf(cls, config) -> CausalLMConfig:
        """From a ``transformers`` config (an object, or its ``to_dict()``) of a supported family."""
        c = config if isinstance(config, dict) else config.to_dict()
        model_type = c.get("model_type")
        if model_type == "deepseek_v3":  # multi-head latent attention: its own model (models/deepseek_v3.py)
            from .deepseek_v3 import DeepseekV3Config

            return DeepseekV3Config.from_hf(c)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{_OP}: model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(for other families see kernel_ladder.patch.patch_model)")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        layers = c["num_hidden_layers"]
        window = c.get("sliding_window")
        if model_type == "mistral":
            windows = [window] * layers
        elif model_type == "qwen2":
            types = c.get("layer_types") or ["full_attention"] * layers
            windows = [window if t == "sliding_attention" else None for t in types]
        else:
            windows = [None] * layers
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{_OP}: partial rotary embeddings are not supported")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            qkv_bias=bool(c.get("attention_bias", False)) or model_type == "qwen2",
            o_bias=bool(c.get("attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(c.get("mlp_bias", False)), tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            hidden_act=c.get("hidden_act", "silu"), windows=windows, model_type=model_type)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return kernel_ladder.linear(x, module.weight, module.bias)


def _paged_step_attention(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
                          layer_index: int, step: SchedulerOutput, **options) -> torch.Tensor:
    """Write the step's ``k, v`` ``(T, Hkv, D)`` into layer ``layer_index``'s cache, then attend ``q`` ``(T, Hq, D)``
    over every sequence's cached keys (decodes and prefill chunks in one launch)."""
    k_cache, v_cache = cache.k_cache(layer_index), cache.v_cache(layer_index)
    kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, step.slot_mapping)
    return kernel_ladder.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, window=attn.window,
                                         cu_seqlens_q=step.cu_seqlens_q, **options)


class Attention(torch.nn.Module):
    """Grouped-query attention with rotary embeddings and an optional sliding window."""

    def __init__(self, config: CausalLMConfig, layer: int) -> None:
        super().__init__()
        h, q, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = q, kv, d
        self.window = config.windows[layer]
        self.rope_key = "default"  # which of the model's rope tables this layer rotates with
        self.q_proj = torch.nn.Linear(h, q * d, bias=config.qkv_bias)
        self.k_proj = torch.nn.Linear(h, kv * d, bias=config.qkv_bias)
        self.v_proj = torch.nn.Linear(h, kv * d, bias=config.qkv_bias)
        self.o_proj = torch.nn.Linear(q * d, h, bias=config.o_bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``q, k, v`` as ``(B, H, T, D)`` views, q and k rotated."""
        b, t = x.shape[:2]
        q = _linear(self.q_proj, x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = _linear(self.k_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = _linear(self.v_proj, x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = kernel_ladder.rope(q, k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = kernel_ladder.flash_attention(q, k, v, causal=True, window=self.window)
        b, t = x.shape[:2]
        return _linear(self.o_proj, out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                      layer_index: int, step: SchedulerOutput) -> torch.Tensor:
        """The packed step's ``(T, hidden)`` through this attention over the paged cache (tables ``(1, T, D)``)."""
        t = x.shape[0]
        q = _linear(self.q_proj, x).view(t, self.heads, self.head_dim)
        k = _linear(self.k_proj, x).view(t, self.kv_heads, self.head_dim)
        v = _linear(self.v_proj, x).view(t, self.kv_heads, self.head_dim)
        q, k = kernel_ladder.rope(q[None], k[None], cos, sin, unsqueeze_dim=2)  # (1, T, H, D): HF's BTHD layout
        out = _paged_step_attention(self, q[0], k[0], v, cache, layer_index, step)
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


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream.

    ``layer(x, tables)`` with the model's rope tables (:meth:`CausalLM.rope_tables`), or ``layer(x, cos, sin)``
    with this layer's own pair; :meth:`forward_paged` is the engine's packed step over the paged cache.
    """

    def __init__(self, config: CausalLMConfig, layer: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = _Norm(config.hidden_size)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = _Norm(config.hidden_size)
        self.mlp = MLP(config)

    def _rope(self, tables, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return (tables, sin) if sin is not None else tables[self.self_attn.rope_key]

    def forward(self, x: torch.Tensor, tables: RopeTables | torch.Tensor, sin: torch.Tensor | None = None
                ) -> torch.Tensor:
        cos, sin = self._rope(tables, sin)
        h = kernel_ladder.add(x, self.self_attn(kernel_ladder.rms_norm(x, self.input_layernorm.weight, self.eps), cos,
                                                sin))
        return kernel_ladder.add(h, self.mlp(kernel_ladder.rms_norm(h, self.post_attention_layernorm.weight, self.eps)))

    def forward_paged(self, x: torch.Tensor, tables: RopeTables, cache: PagedKVCache, layer_index: int,
                      step: SchedulerOutput) -> torch.Tensor:
        cos, sin = tables[self.self_attn.rope_key]
        h = kernel_ladder.rms_norm(x, self.input_layernorm.weight, self.eps)
        x = kernel_ladder.add(x, self.self_attn.forward_paged(h, cos, sin, cache, layer_index, step))
        return kernel_ladder.add(x, self.mlp(kernel_ladder.rms_norm(x, self.post_attention_layernorm.weight, self.eps)))


class _Norm(torch.nn.Module):
    """Holds an RMS norm's weight under HF's name (``….weight``)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))


class _Body(torch.nn.Module):
    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size)


class CausalLM(DecoderLM):
    """A Llama / Mistral / Qwen2 decoder from ``kernel_ladder`` ops, in Hugging Face's parameter layout.

    ``model(input_ids)`` returns the ``(B, T, V)`` logits; ``model(input_ids, labels=labels)`` the
    mean next-token loss (labels shifted inside, as HF does; ``-100`` ignored), computed by
    ``kernel_ladder.fused_linear_cross_entropy`` without the logits.
    """

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> CausalLM:
        """The same model as a ``transformers`` ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
        ``Qwen2ForCausalLM`` (its weights copied, its dtype and device kept); a ``DeepseekV3ForCausalLM``
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
        """The token embedding: a table lookup (a gather, no arithmetic)."""
        return torch.nn.functional.embedding(input_ids, self.model.embed_tokens.weight)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables for ``positions`` (``(T,)`` or ``(B, T)``), as HF's rotary module makes them."""
        c = self.config
        return kernel_ladder.rope_cos_sin(positions, c.head_dim, base=c.rope_theta, scaling=c.rope_scaling, dtype=dtype)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """``{"default": rotary(positions, dtype)}``: every layer rotates with the same tables."""
        return {"default": self.rotary(positions, dtype)}

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.rms_norm(x, self.model.norm.weight, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.linear(hidden, self.lm_head.weight)

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
        return kernel_ladder.fused_linear_cross_entropy(shifted, self.lm_head.weight, labels[:, 1:].reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
