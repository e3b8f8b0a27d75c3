"""A small pre-norm decoder block built only from ``kernel_ladder`` ops, and its float64 reference.

The block is the shape of a LLaMA / Mistral / Qwen layer::

    h   = x + o_proj(attention(rope(qkv_proj(rms_norm(x)))))     # causal, GQA when n_kv_heads < n_heads
    out = h + gated_mlp(rms_norm(h))                              # SwiGLU

and every tensor op on the way is a ``kernel_ladder`` custom op: ``kernel_ladder.rms_norm`` →
``kernel_ladder.linear`` (q, k and v in one fused projection) → ``kernel_ladder.rope`` →
``kernel_ladder.flash_attention`` → ``kernel_ladder.linear`` → ``kernel_ladder.add`` → ``kernel_ladder.rms_norm`` →
``kernel_ladder.gated_mlp`` → ``kernel_ladder.add``. Only views, one reshape of the attention output and the
rotary tables are torch. :class:`TinyDecoder` puts an embedding lookup in front and
``kernel_ladder.rms_norm`` + ``kernel_ladder.fused_linear_cross_entropy`` (the LM head and its loss, without
the logits) behind, so that a training step exists: :func:`block_training_step`.

:func:`reference_decoder` (and :func:`reference_block`) compute the same thing in plain torch in
float64 from the same parameters, so tests check outputs and gradients against it. The defaults
are small enough for Triton's interpreter (hidden 32, 2 heads, sequences of 16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernel_ladder

__all__ = [
    "BlockConfig",
    "DecoderBlock",
    "TinyDecoder",
    "block_training_step",
    "reference_block",
    "reference_decoder",
    "rotary_tables",
    "LOSS_CHUNK_ROWS",
]

#: Rows per chunk of the LM head's fused loss (one chunk at the sizes the tests use).
LOSS_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class BlockConfig:
    """The sizes of a :class:`DecoderBlock` (and of :class:`TinyDecoder`'s embedding and head)."""

    hidden: int = 32
    n_heads: int = 2
    n_kv_heads: int = 2  # fewer than n_heads: grouped-query attention
    ffn: int = 64
    vocab: int = 64
    eps: float = 1e-6
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads:
            raise ValueError(f"BlockConfig: hidden ({self.hidden}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"BlockConfig: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if (self.hidden // self.n_heads) % 2:
            raise ValueError(f"BlockConfig: the head dim ({self.hidden // self.n_heads}) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0, device=None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(T, head_dim)`` cos/sin tables of positions ``0 .. T-1`` (``kernel_ladder.rope_cos_sin``)."""
    positions = torch.arange(seq_len, device=device)
    return kernel_ladder.rope_cos_sin(positions, head_dim, base=base, dtype=dtype)


def _init(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None, dtype, device) -> torch.nn.Parameter:
    w = torch.randn(shape, generator=generator, dtype=torch.float32) / math.sqrt(fan_in)
    return torch.nn.Parameter(w.to(device=device, dtype=dtype))


def _norm_weight(n: int, generator: torch.Generator | None, dtype, device) -> torch.nn.Parameter:
    # Not all ones, so that a test notices a weight that is dropped or applied twice.
    w = 1.0 + 0.1 * torch.randn(n, generator=generator, dtype=torch.float32)
    return torch.nn.Parameter(w.to(device=device, dtype=dtype))


class DecoderBlock(torch.nn.Module):
    """One pre-norm decoder layer (attention, then a SwiGLU MLP) computed only with ``kernel_ladder`` ops.

    Args:
        config: the sizes.
        generator: draws the initial weights (a CPU generator; weights are then moved to ``device``).
        dtype, device: of the parameters and of the activations the block takes.

    Parameters follow Hugging Face's names where they exist: ``attn_norm`` and ``mlp_norm`` (the
    RMSNorm weights), ``qkv`` (``((Hq + 2 Hkv) * D, hidden)``: q, k and v projections stacked,
    ``nn.Linear`` layout), ``o_proj`` (``(hidden, Hq * D)``), ``gate``, ``up`` (``(ffn, hidden)``)
    and ``down`` (``(hidden, ffn)``).
    """

    def __init__(self, config: BlockConfig = BlockConfig(), generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.config = c = config
        qkv_rows = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.attn_norm = _norm_weight(c.hidden, generator, dtype, device)
        self.qkv = _init((qkv_rows, c.hidden), c.hidden, generator, dtype, device)
        self.o_proj = _init((c.hidden, c.n_heads * c.head_dim), c.n_heads * c.head_dim, generator, dtype, device)
        self.mlp_norm = _norm_weight(c.hidden, generator, dtype, device)
        self.gate = _init((c.ffn, c.hidden), c.hidden, generator, dtype, device)
        self.up = _init((c.ffn, c.hidden), c.hidden, generator, dtype, device)
        self.down = _init((c.hidden, c.ffn), c.ffn, generator, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``(B, T, hidden)`` → ``(B, T, hidden)``; ``cos``/``sin``: ``(T, head_dim)`` (:func:`rotary_tables`)."""
        c = self.config
        batch, seq = x.shape[0], x.shape[1]
        normed = kernel_ladder.rms_norm(x, self.attn_norm, c.eps)
        qkv = kernel_ladder.linear(normed, self.qkv).view(batch, seq, c.n_heads + 2 * c.n_kv_heads, c.head_dim)
        q = qkv[:, :, : c.n_heads]                                    # (B, T, Hq, D) views, read in place
        k = qkv[:, :, c.n_heads : c.n_heads + c.n_kv_heads]
        v = qkv[:, :, c.n_heads + c.n_kv_heads :]
        q, k = kernel_ladder.rope(q, k, cos, sin, unsqueeze_dim=2)
        attn = kernel_ladder.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        attn = attn.transpose(1, 2).reshape(batch, seq, c.n_heads * c.head_dim)
        h = kernel_ladder.add(x, kernel_ladder.linear(attn, self.o_proj))
        mlp = kernel_ladder.gated_mlp(kernel_ladder.rms_norm(h, self.mlp_norm, c.eps), self.gate, self.up, self.down)
        return kernel_ladder.add(h, mlp)


class TinyDecoder(torch.nn.Module):
    """Embedding → :class:`DecoderBlock` → final RMSNorm → LM head loss: the smallest trainable model.

    :meth:`loss` is ``kernel_ladder.fused_linear_cross_entropy`` of the final hidden states against the
    targets (mean over the tokens whose target is not ``ignore_index``). The embedding is a torch
    lookup (``F.embedding``): indexing, not a kernel of this package.
    """

    def __init__(self, config: BlockConfig = BlockConfig(), generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.config = c = config
        self.embed = torch.nn.Parameter(
            torch.randn((c.vocab, c.hidden), generator=generator).to(device=device, dtype=dtype))
        self.block = DecoderBlock(c, generator, dtype, device)
        self.final_norm = _norm_weight(c.hidden, generator, dtype, device)
        self.lm_head = _init((c.vocab, c.hidden), c.hidden, generator, dtype, device)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states ``(B, T, hidden)`` of ``tokens`` ``(B, T)``."""
        c = self.config
        cos, sin = rotary_tables(tokens.shape[1], c.head_dim, c.rope_base, device=tokens.device,
                                 dtype=self.embed.dtype)
        x = torch.nn.functional.embedding(tokens, self.embed)
        return kernel_ladder.rms_norm(self.block(x, cos, sin), self.final_norm, c.eps)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The mean next-token cross-entropy (0-d) of ``tokens`` against ``targets`` (both ``(B, T)``)."""
        h = self.hidden_states(tokens)
        # A fixed chunk (not the default rule, computed from the row count) keeps torch.compile's
        # dynamic shapes from specializing on B * T; the logits buffer is min(chunk, B * T) x vocab.
        return kernel_ladder.fused_linear_cross_entropy(h, self.lm_head, targets, ignore_index=ignore_index,
                                                        chunk_size=LOSS_CHUNK_ROWS)

    forward = loss


def block_training_step(model: TinyDecoder, tokens: torch.Tensor, targets: torch.Tensor,
                        optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """One training step: the loss, its backward and (given an optimizer) ``optimizer.step()``.

    Gradients are accumulated into ``.grad`` as usual; zeroing them is the caller's (so that the
    same function can be captured in a CUDA graph, whose gradients must stay at fixed addresses).
    Returns the loss (0-d, still on the device: no host synchronization).
    """
    loss = model.loss(tokens, targets)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


# ----------------------------------------------------------------------------------------------
# The float64 reference
# ----------------------------------------------------------------------------------------------


def _rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def reference_block(params: dict[str, torch.Tensor], config: BlockConfig, x: torch.Tensor) -> torch.Tensor:
    """:class:`DecoderBlock`'s forward in plain torch, in ``x``'s dtype (pass float64).

    ``params`` holds the block's parameters by name (``dict(block.named_parameters())``, cast as
    wanted); gradients flow to them and to ``x``. The attention is written out: scores, a causal
    mask, softmax, K and V repeated for GQA.
    """
    c = config
    batch, seq, _ = x.shape
    positions = torch.arange(seq, device=x.device, dtype=x.dtype)
    inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, device=x.device, dtype=x.dtype) / c.head_dim))
    freqs = positions[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    qkv = (_rms_norm64(x, params["attn_norm"], c.eps) @ params["qkv"].T).view(
        batch, seq, c.n_heads + 2 * c.n_kv_heads, c.head_dim).transpose(1, 2)
    q, k, v = qkv.split([c.n_heads, c.n_kv_heads, c.n_kv_heads], dim=1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    group = c.n_heads // c.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    attn = (probs @ v).transpose(1, 2).reshape(batch, seq, c.n_heads * c.head_dim)
    h = x + attn @ params["o_proj"].T
    m = _rms_norm64(h, params["mlp_norm"], c.eps)
    gated = torch.nn.functional.silu(m @ params["gate"].T) * (m @ params["up"].T)
    return h + gated @ params["down"].T


def reference_decoder(params: dict[str, torch.Tensor], config: BlockConfig, tokens: torch.Tensor,
                      targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """:meth:`TinyDecoder.loss` in plain torch, in the parameters' dtype (pass float64 copies).

    ``params`` is ``dict(model.named_parameters())`` (names ``embed``, ``block.*``, ``final_norm``,
    ``lm_head``), cast as wanted.
    """
    block = {name.removeprefix("block."): p for name, p in params.items() if name.startswith("block.")}
    x = params["embed"][tokens]
    h = _rms_norm64(reference_block(block, config, x), params["final_norm"], config.eps)
    logits = h @ params["lm_head"].T
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
