"""DeepSeek-V3 written with ``kernel_ladder`` ops: multi-head latent attention and a mixture of experts.

What sets it apart from :class:`~kernel_ladder.models.CausalLM`'s Llama family:

* **Multi-head latent attention (MLA).** Keys and values are not projected per head from the hidden
  state. ``kv_a_proj_with_mqa`` compresses each token to one vector of ``kv_lora_rank`` features
  ``c`` (RMS-normalized by ``kv_a_layernorm``) plus one shared key of ``qk_rope_head_dim`` features
  that carries the rotary position (the *decoupled* RoPE key, shared by all heads); ``kv_b_proj``
  expands ``c`` to every head's ``k_nope`` (``qk_nope_head_dim``) and ``v`` (``v_head_dim``). A
  head's key is ``[k_nope | k_rope]`` (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``), its
  query ``[q_nope | q_rope]`` from ``q_proj``, or through the low-rank ``q_a_proj`` →
  ``q_a_layernorm`` → ``q_b_proj`` when ``q_lora_rank`` is set. Keys are wider than values
  (192 and 128 in the real model): training and prefill run :func:`kernel_ladder.flash_attention`
  with ``v``'s own head dim, no padding.
* **Rotary layout and YaRN.** ``rope_interleave`` pairs features ``(2j, 2j + 1)``; rotating q and k
  by :func:`kernel_ladder.rope` ``interleaved=True`` leaves each pair in place where HF writes the
  rotated pairs de-interleaved (``[evens | odds]``): the same permutation of q's and k's features,
  so every score ``q · k`` is the same. With YaRN the tables carry YaRN's attention factor and the
  softmax scale is ``qk_head_dim ** -0.5 * mscale ** 2`` (``mscale`` from ``mscale_all_dim``), as
  HF's ``yarn_apply_mscale``.
* **Dense then MoE layers.** The first ``first_k_dense_replace`` layers have a gated MLP
  (:func:`kernel_ladder.gated_mlp`); the rest a mixture of experts: a sigmoid router with a
  per-expert selection bias (``e_score_correction_bias``), group-limited selection (``n_group``
  groups, the best ``topk_group`` kept) and a routed scaling factor, all in
  :func:`kernel_ladder.topk_routing`; the routed experts through
  :func:`kernel_ladder.ops.moe.experts_forward` (two grouped GEMMs) and the shared experts (one gated
  MLP every token goes through) added.

**Serving over the latent cache.** The paged cache holds, per layer and token, ONE vector of
``kv_lora_rank + qk_rope_head_dim`` features — ``[c | k_rope]`` — written by
:func:`kernel_ladder.write_latent_cache`, instead of every head's key and value. Attention runs
*absorbed* (:func:`kernel_ladder.mla_attention`): ``W_UK`` (``kv_b_proj``'s ``k_nope`` rows of a
head) moves to the query side, ``q_latent = q_nope @ W_UK`` so that ``q_nope · k_nope = q_latent ·
c``, the scores are ``scale * (q_latent · c + q_rope · k_rope)``, the output ``softmax @ c`` in the
latent space, and ``W_UV`` (the ``v`` rows) maps it to the head's values before ``o_proj``.

Bytes of cache per token, all layers (:func:`cache_bytes_per_token`): per layer ``(kv_lora_rank +
qk_rope_head_dim) * element size`` for the latent cache, against ``kv_heads * (qk_head_dim +
v_head_dim) * element size`` for a cache of expanded keys and values (GQA with ``kv_heads`` heads; MHA
with one per query head). The tests assert every number below:

==================================  ============  ===========================  ===========================
model                               latent (MLA)  GQA, 8 kv heads of 192/128   MHA, 128 heads of 192/128
==================================  ============  ===========================  ===========================
DeepSeek-V3, bf16 (61 layers)       70,272        312,320 (4.4x)               4,997,120 (71.1x)
the tests' tiny model, fp32         192 (2 x 24)  256 (1 kv head of 16/16)     1,024 (4 heads of 16/16)
==================================  ============  ===========================  ===========================

DeepSeek-V3's GQA column keeps the model's per-head widths (keys ``qk_head_dim`` 192, values
``v_head_dim`` 128) and groups its 128 query heads into 8 key/value heads: ``61 * 8 * (192 + 128) * 2``
bytes. The latent vector (576 elements per layer) is as small as a GQA cache of 1.8 such key/value
heads (320 elements each). The :class:`~kernel_ladder.models.Engine` allocates the latent cache for
this model (its ``cache_spec()``), so its ``cache.bytes_per_token()`` is the first column.

Parameter names are HF's (``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``,
``model.layers.3.mlp.experts.gate_up_proj``, ``model.layers.3.mlp.gate.e_score_correction_bias`` …),
so :meth:`CausalLM.from_hf <kernel_ladder.models.CausalLM.from_hf>` of a ``DeepseekV3ForCausalLM``
returns a :class:`DeepseekV3ForCausalLM` here with its weights.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

import kernel_ladder
from kernel_ladder.ops.moe import experts_forward

from ..serving.paged_cache import CacheSpec
from .causal_lm import CausalLM, _Body, _Norm
from .protocol import RopeTables

if TYPE_CHECKING:
    from ..serving.paged_cache import PagedKVCache
    from ..serving.scheduler import SchedulerOutput

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM", "cache_bytes_per_token"]

_OP = "kernel_ladder.models.DeepseekV3ForCausalLM"
_ROPE = "mla"  # the key of the decoupled rope's tables in rope_tables()


@dataclass
class DeepseekV3Config:
    """The sizes and options of a :class:`DeepseekV3ForCausalLM` (names as in HF's ``DeepseekV3Config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0  # each routed (and shared) expert's width
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_parameters minus the default type
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    pad_token_id: int | None = None  # the embedding's padding row (no gradient), as HF's nn.Embedding
    model_type: str = "deepseek_v3"

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"{_OP}: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{_OP}: qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace:
            raise ValueError(f"{_OP}: first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")
        if self.num_moe_layers:
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{_OP}: {name} must be >= 1 for the MoE layers, got {getattr(self, name)}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(f"{_OP}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                                 f"({self.n_routed_experts})")
            groups = self.n_group or 1
            if self.n_routed_experts % groups:
                raise ValueError(f"{_OP}: n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group "
                                 f"({groups})")

    # -- derived sizes --------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """A head's query/key width: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The width of one token's cache entry per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale ** 2`` under YaRN with ``mscale_all_dim`` (HF's
        ``yarn_apply_mscale``)."""
        scale = self.qk_head_dim ** -0.5
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
            from ..ops.rope import yarn_get_mscale

            mscale = yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"])
            scale = scale * mscale * mscale
        return scale

    @classmethod
    def from_hf(cls, config) -> DeepseekV3Config:
        """From a ``transformers`` ``DeepseekV3Config`` (an object, or its ``to_dict()``)."""
        c = config if isinstance(config, dict) else config.to_dict()
        if c.get("model_type") != "deepseek_v3":
            raise ValueError(f"{_OP}: expected a deepseek_v3 config, got model_type {c.get('model_type')!r}")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        if scaling is not None and scaling.get("factor") is None and "original_max_position_embeddings" in scaling:
            # HF: DeepSeek's YaRN factor may be left implicit, the ratio of the context lengths
            scaling["factor"] = c.get("max_position_embeddings", 4096) / scaling["original_max_position_embeddings"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
            kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], q_lora_rank=c.get("q_lora_rank"),
            moe_intermediate_size=c.get("moe_intermediate_size", 0), n_routed_experts=c.get("n_routed_experts", 0),
            n_shared_experts=c.get("n_shared_experts", 0) or 0, num_experts_per_tok=c.get("num_experts_per_tok", 0),
            n_group=c.get("n_group"), topk_group=c.get("topk_group"),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=c.get("first_k_dense_replace") or 0, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling, rope_interleave=bool(c.get("rope_interleave", True)),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            attention_bias=bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), hidden_act=c.get("hidden_act", "silu"),
            pad_token_id=c.get("pad_token_id"))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def cache_bytes_per_token(config: DeepseekV3Config, kind: str = "mla", *, dtype: torch.dtype | int = torch.bfloat16,
                          num_kv_heads: int | None = None) -> int:
    """Bytes one token takes in the caches of all of ``config``'s layers, exactly.

    ``kind="mla"``: the latent cache, ``kv_lora_rank + qk_rope_head_dim`` elements per layer (what the
    :class:`~kernel_ladder.models.Engine` allocates for this model); ``"gqa"``: expanded keys
    (``qk_head_dim``) and values (``v_head_dim``) of ``num_kv_heads`` heads; ``"mha"``: of every head;
    ``"mqa"``: of one. ``dtype``: the cache's, or its element size in bytes. Per layer this is
    :func:`kernel_ladder.ops.mla.cache_bytes_per_token`.
    """
    from ..ops.mla import cache_bytes_per_token as per_layer

    return config.num_hidden_layers * per_layer(config, kind, dtype=dtype, num_kv_heads=num_kv_heads)


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return kernel_ladder.linear(x, module.weight, module.bias)


class _NormEps(_Norm):
    """An RMS norm's weight under HF's name, with its own eps (MLA's inner norms keep HF's default 1e-6)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.rms_norm(x, self.weight, self.eps)


class Attention(torch.nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        c = config
        h, heads = c.hidden_size, c.num_attention_heads
        self.heads, self.kv_lora_rank = heads, c.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_dim = c.qk_head_dim
        self.interleaved = c.rope_interleave
        self.scale = c.softmax_scale
        if c.q_lora_rank is None:
            self.q_proj = torch.nn.Linear(h, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = torch.nn.Linear(h, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = _NormEps(c.q_lora_rank, 1e-6)  # HF builds it with the default eps
            self.q_b_proj = torch.nn.Linear(c.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(h, c.kv_lora_rank + self.rope_dim, bias=c.attention_bias)
        self.kv_a_layernorm = _NormEps(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = torch.nn.Linear(c.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = torch.nn.Linear(heads * self.v_dim, h, bias=c.attention_bias)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., H, qk_head_dim)``: ``q_proj(x)``, or ``q_b_proj(q_a_layernorm(q_a_proj(x)))``."""
        q = _linear(self.q_proj, x) if hasattr(self, "q_proj") else \
            _linear(self.q_b_proj, self.q_a_layernorm(_linear(self.q_a_proj, x)))
        return q.unflatten(-1, (self.heads, self.qk_dim))

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, k_rope)``: the normalized compressed KV ``(..., kv_lora_rank)`` and the shared rope key
        ``(..., qk_rope_head_dim)``, not yet rotated (a view of the projection)."""
        kv = _linear(self.kv_a_proj_with_mqa, x)
        return self.kv_a_layernorm(kv[..., :self.kv_lora_rank]), kv[..., self.kv_lora_rank:]

    def _kv_b(self) -> torch.Tensor:
        """``kv_b_proj``'s weight as ``(H, nope + v, kv_lora_rank)``: per head, ``W_UK`` rows then ``W_UV`` rows."""
        return self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.kv_lora_rank)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training and whole-sequence prefill: ``x`` ``(B, T, hidden)`` → ``(B, T, hidden)``."""
        b, t = x.shape[:2]
        q = self.query(x).transpose(1, 2)  # (B, H, T, qk)
        c, k_rope = self.latent(x)
        q_rope, k_rope = kernel_ladder.rope(q[..., self.nope:], k_rope[:, None], cos, sin,
                                            interleaved=self.interleaved)  # (B, H, T, R), (B, 1, T, R)
        kv = _linear(self.kv_b_proj, c).view(b, t, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        q = torch.cat((q[..., :self.nope], q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, self.heads, t, self.rope_dim)), dim=-1)
        out = kernel_ladder.flash_attention(q, k, v, causal=True, softmax_scale=self.scale)  # (B, H, T, v)
        return _linear(self.o_proj, out.transpose(1, 2).reshape(b, t, self.heads * self.v_dim))

    def paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latent_cache: torch.Tensor,
              step: SchedulerOutput) -> torch.Tensor:
        """Serving: one packed step's tokens ``x`` ``(T, hidden)`` over the paged latent cache
        ``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``; the tokens' ``[c | k_rope]`` are
        written first, then the absorbed attention reads them with the sequences' history."""
        t = x.shape[0]
        q = self.query(x)  # (T, H, qk)
        c, k_rope = self.latent(x)  # (T, L), (T, R)
        q_rope, k_rope = kernel_ladder.rope(q[None, ..., self.nope:], k_rope[None, :, None], cos, sin, unsqueeze_dim=2,
                                            interleaved=self.interleaved)  # (1, T, H, R), (1, T, 1, R)
        kernel_ladder.write_latent_cache(c, k_rope[0, :, 0], latent_cache, step.slot_mapping)
        w = self._kv_b()
        # Absorb W_UK into the query: q_latent[t, h] = q_nope[t, h] @ W_UK[h]  ((H, T, nope) @ (H, nope, L))
        q_latent = kernel_ladder.matmul(q[..., :self.nope].transpose(0, 1), w[:, :self.nope]).transpose(0, 1)
        out = kernel_ladder.mla_attention(q_latent, q_rope[0], latent_cache, step.block_tables, step.seq_lens,
                                          self.scale, self.kv_lora_rank, cu_seqlens_q=step.cu_seqlens_q)  # (T, H, L)
        # ... and W_UV into the output: v[t, h] = out[t, h] @ W_UV[h]^T  ((H, T, L) @ (H, L, v))
        v = kernel_ladder.matmul(out.transpose(0, 1), w[:, self.nope:].transpose(1, 2))
        return _linear(self.o_proj, v.transpose(0, 1).reshape(t, self.heads * self.v_dim))


class MLP(torch.nn.Module):
    """``down(silu(gate(x)) * up(x))`` in one :func:`kernel_ladder.gated_mlp`."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class Router(torch.nn.Module):
    """HF's ``DeepseekV3TopkRouter``'s parameters: ``weight`` ``(E, hidden)`` and the selection bias buffer."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        torch.nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))


class Experts(torch.nn.Module):
    """The routed experts' weights, ``gate_up_proj`` ``(E, 2F, hidden)`` and ``down_proj`` ``(E, hidden, F)``."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        e, f, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = torch.nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = torch.nn.Parameter(torch.empty(e, h, f))
        torch.nn.init.normal_(self.gate_up_proj, std=0.02)
        torch.nn.init.normal_(self.down_proj, std=0.02)


class MoE(torch.nn.Module):
    """Routed experts (sigmoid, bias-corrected, group-limited routing) plus the shared experts."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        c = config
        self.top_k, self.renormalize, self.scale = c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor
        groups = c.n_group or 1
        # One group is plain top-k: no group step.
        self.num_groups = groups if groups > 1 else None
        self.topk_groups = (c.topk_group or groups) if groups > 1 else None
        self.gate = Router(c)
        self.experts = Experts(c)
        self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts) \
            if c.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # HF routes in float32 (the router's weight is kept in float32 there)
        logits = kernel_ladder.linear(flat.float(), self.gate.weight.float())
        weights, ids = kernel_ladder.topk_routing(
            logits, self.top_k, renormalize=self.renormalize, scoring="sigmoid",
            bias=self.gate.e_score_correction_bias, num_groups=self.num_groups, topk_groups=self.topk_groups,
            scale=self.scale)
        out = experts_forward(flat, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shared_experts is not None:
            out = kernel_ladder.add(out, self.shared_experts(flat))
        return out.view(x.shape)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: DeepseekV3Config, layer: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = _Norm(config.hidden_size)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = _Norm(config.hidden_size)
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if layer < config.first_k_dense_replace \
            else MoE(config)

    def forward(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """Training and scoring: ``(B, T, hidden)``, the model's rope tables (``rope_tables()``)."""
        cos, sin = tables[_ROPE]
        h = kernel_ladder.add(x, self.self_attn(kernel_ladder.rms_norm(x, self.input_layernorm.weight, self.eps),
                                                cos, sin))
        return kernel_ladder.add(h, self.mlp(kernel_ladder.rms_norm(h, self.post_attention_layernorm.weight, self.eps)))

    def forward_paged(self, x: torch.Tensor, tables: RopeTables, cache: PagedKVCache, layer_index: int,
                      step: SchedulerOutput) -> torch.Tensor:
        """The serving step: ``(T, hidden)`` in and out, this layer's latent cache entries written."""
        cos, sin = tables[_ROPE]
        h = kernel_ladder.rms_norm(x, self.input_layernorm.weight, self.eps)
        h = kernel_ladder.add(x, self.self_attn.paged(h, cos, sin, cache.latent_cache(layer_index), step))
        return kernel_ladder.add(h, self.mlp(kernel_ladder.rms_norm(h, self.post_attention_layernorm.weight, self.eps)))


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 from ``kernel_ladder`` ops, in HF's parameter layout (a :class:`CausalLM`: the same
    ``forward(input_ids, labels=None)``, ``from_hf``, ``load_hf_state_dict``), built from a
    :class:`DeepseekV3Config`."""

    @staticmethod
    def _body(config: DeepseekV3Config) -> torch.nn.Module:
        return _Body(config, DecoderLayer)

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module) -> DeepseekV3ForCausalLM:
        """The same model as a ``transformers`` ``DeepseekV3ForCausalLM`` (weights copied, dtype and device kept)."""
        from ._hf import build_from_hf

        return build_from_hf(cls, DeepseekV3Config, hf_model, _OP)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], source: str = "the state dict") -> None:
        """Copy weights named as in HF's ``DeepseekV3ForCausalLM``. The multi-token-prediction module that
        DeepSeek-V3's checkpoints keep as layer ``num_hidden_layers`` and up (``model.layers.61.*``) is
        skipped, as HF skips it; any other missing, unexpected or misshapen weight is refused."""
        layers = self.config.num_hidden_layers

        def beyond_the_model(name: str) -> bool:
            parts = name.split(".", 3)
            in_layers = len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            return in_layers and int(parts[2]) >= layers

        super().load_hf_state_dict({k: v for k, v in state.items() if not beyond_the_model(k)}, source=source)

    # -- the layer protocol (kernel_ladder.models.protocol) ---------------------------------------

    def cache_spec(self) -> list[CacheSpec]:
        """Every layer caches ONE latent vector per token: ``kv_lora_rank + qk_rope_head_dim`` features."""
        c = self.config
        return [CacheSpec.latent(c.kv_lora_rank, c.qk_rope_head_dim)] * c.num_hidden_layers

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables of the decoupled rope key (``qk_rope_head_dim`` wide) for ``positions``."""
        c = self.config
        return kernel_ladder.rope_cos_sin(positions, c.qk_rope_head_dim, base=c.rope_theta, scaling=c.rope_scaling,
                                          dtype=dtype, interleaved=c.rope_interleave)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """``{"mla": rotary(positions, dtype)}``: one rope, the decoupled key's, for every layer."""
        return {_ROPE: self.rotary(positions, dtype)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding: a table lookup (a gather, no arithmetic)."""
        return torch.nn.functional.embedding(input_ids, self.model.embed_tokens.weight,
                                             padding_idx=self.config.pad_token_id)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.rms_norm(x, self.model.norm.weight, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernel_ladder.linear(hidden, self.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(B, T, V)`` logits; with ``labels``, the mean next-token loss (shifted inside, ``-100``
        ignored) through :func:`kernel_ladder.fused_linear_cross_entropy`, the logits never materialized."""
        hidden = self.hidden_states(input_ids, positions)
        if labels is None:
            return self.logits(hidden)
        if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
            raise ValueError(f"{_OP}: labels must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
        shifted = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return kernel_ladder.fused_linear_cross_entropy(shifted, self.lm_head.weight, labels[:, 1:].reshape(-1))
