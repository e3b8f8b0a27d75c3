"""Solutions to chapter 12, end to end, and what the chapter gives its checks.

Four exercises, each one piece of what ``kernel_ladder.models`` and ``kernel_ladder.patch`` do in full:

1. :func:`decoder_layer` — a Llama decoder layer from ``kernel_ladder`` ops, checked against Hugging
   Face's own ``LlamaDecoderLayer`` with the same weights.
2. :func:`top_p_filter` — the nucleus of a distribution, as the engine samples from it.
3. :func:`speculative_accept` — one speculative step's acceptance rule, the one that keeps the
   target's distribution exact.
4. :func:`step_flops` — the FLOPs of a training step, for MFU.
"""

from __future__ import annotations

import torch

import kernel_ladder

__all__ = [
    "decoder_layer",
    "decoder_cases",
    "decoder_reference",
    "kernels_only",
    "DECODER_TOLERANCE",
    "top_p_filter",
    "top_p_cases",
    "top_p_reference",
    "speculative_accept",
    "accept_cases",
    "accept_reference",
    "step_flops",
    "flops_cases",
    "flops_reference",
    "hf_decoder_layer",
]


# ----------------------------------------------------------------------------------------------
# Exercise 1: a decoder layer from kernel_ladder ops
# ----------------------------------------------------------------------------------------------


def decoder_layer(x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``layer`` (an HF ``LlamaDecoderLayer``) on ``x`` ``(B, T, hidden)`` with ``kernel_ladder`` ops:

    ``h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))``, ``out = h + mlp(n2(h))``: RMS
    norms, the three projections split into heads, rotary on q and k, causal grouped-query
    attention, the output projection, the SiLU-gated MLP, two residual adds.
    """
    attn, eps = layer.self_attn, layer.input_layernorm.variance_epsilon
    b, t, _ = x.shape
    d = attn.head_dim
    h = kernel_ladder.rms_norm(x, layer.input_layernorm.weight, eps)
    q = kernel_ladder.linear(h, attn.q_proj.weight).view(b, t, -1, d).transpose(1, 2)  # (B, Hq, T, D)
    k = kernel_ladder.linear(h, attn.k_proj.weight).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, D)
    v = kernel_ladder.linear(h, attn.v_proj.weight).view(b, t, -1, d).transpose(1, 2)
    q, k = kernel_ladder.rope(q, k, cos, sin)
    out = kernel_ladder.flash_attention(q, k, v, causal=True, softmax_scale=attn.scaling)  # GQA: K/V not repeated
    x = kernel_ladder.add(x, kernel_ladder.linear(out.transpose(1, 2).reshape(b, t, -1), attn.o_proj.weight))
    mlp = layer.mlp
    h = kernel_ladder.rms_norm(x, layer.post_attention_layernorm.weight,
                               layer.post_attention_layernorm.variance_epsilon)
    return kernel_ladder.add(x,
                             kernel_ladder.gated_mlp(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))


_FORBIDDEN = ("aten.mm", "aten.bmm", "aten.addmm", "aten.matmul", "aten.linear", "aten._softmax", "aten.softmax",
              "aten.baddbmm", "aten._scaled_dot_product")


def kernels_only(candidate):
    """Run ``candidate`` and refuse it if it computed with torch's matmuls, softmax or attention
    (every op the dispatcher runs is seen) or ran no ``kernel_ladder`` op at all."""
    from utils.trace import OpLog

    def run(*args):
        with OpLog() as log:
            out = candidate(*args)
        torch_ops = log.matching(*_FORBIDDEN)
        if torch_ops:
            raise ValueError(f"the layer ran torch's {', '.join(torch_ops)}: compute it with kernel_ladder ops "
                             "(kernel_ladder.linear, kernel_ladder.flash_attention, …), not by calling the HF layer "
                             "or torch's matmul/softmax")
        if not log.matching("kernel_ladder."):
            raise ValueError("no kernel_ladder op ran: build the layer from kernel_ladder.rms_norm, "
                             "kernel_ladder.linear, kernel_ladder.rope, kernel_ladder.flash_attention, "
                             "kernel_ladder.gated_mlp and kernel_ladder.add")
        return out

    return run


def hf_decoder_layer(hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A random HF ``LlamaDecoderLayer`` (eval mode, fp32) and its rotary module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden - 8, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=16, rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return layer, LlamaRotaryEmbedding(config)


class DescribedLayer:
    """An HF layer with a one-line ``repr`` (a check's verdict names its inputs on one line); every
    attribute and the call are the layer's."""

    def __init__(self, layer, text: str) -> None:
        self._layer, self._text = layer, text

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, *args, **kwargs):
        return self._layer(*args, **kwargs)

    def __repr__(self) -> str:
        return self._text


def decoder_cases(gen: torch.Generator) -> list[tuple]:
    """``(x, layer, cos, sin)``: layers with grouped-query (4 query heads over 2) and multi-query
    (4 over 1) attention, sequences of 1, 7 and 12."""
    cases = []
    for kv_heads, batch, seq in ((2, 2, 7), (1, 1, 12), (2, 1, 1)):
        layer, rotary = hf_decoder_layer(kv_heads=kv_heads, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
        x = torch.randn(batch, seq, 32, generator=gen)
        positions = torch.arange(seq)[None].expand(batch, seq)
        cos, sin = rotary(x, positions)
        text = f"LlamaDecoderLayer(4 q / {kv_heads} kv heads)"  # a verdict shows 40 characters
        cases.append((x, DescribedLayer(layer, text), cos, sin))
    return cases


def decoder_reference(x, layer, cos, sin):
    """Hugging Face's own layer (eager attention, causal mask) on the same weights, in float64."""
    import copy

    exact = copy.deepcopy(getattr(layer, "_layer", layer)).double()
    x, cos, sin = x.double(), cos.double(), sin.double()
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = exact(x, attention_mask=mask, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out


#: The check's tolerance: the layer chains a dozen fp32 ops (norms, GEMMs, attention), each
#: rounding once, against a float64 run of HF's layer.
DECODER_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


# ----------------------------------------------------------------------------------------------
# Exercise 2: the nucleus
# ----------------------------------------------------------------------------------------------


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Each row of ``probs`` kept to its nucleus — the fewest most probable tokens whose total
    reaches ``top_p`` (the token that crosses it included) — and renormalized to sum to one."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass ranked above each token
    kept = sorted_probs.masked_fill(before >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(dim=-1, keepdim=True)


def top_p_cases(gen: torch.Generator) -> list[tuple]:
    cases = [(torch.tensor([[0.5, 0.3, 0.15, 0.05]]), 0.7), (torch.tensor([[0.5, 0.3, 0.15, 0.05]]), 0.5),
             (torch.tensor([[0.1, 0.6, 0.3]]), 1.0), (torch.tensor([[0.35, 0.4, 0.25]]), 0.3)]  # no ties
    for top_p in (0.9, 0.5, 0.05):
        cases.append((torch.softmax(torch.randn(3, 50, generator=gen) * 3, -1), top_p))
    return cases


def top_p_reference(probs, top_p):
    return top_p_filter(probs, top_p)


# ----------------------------------------------------------------------------------------------
# Exercise 3: the speculative acceptance rule
# ----------------------------------------------------------------------------------------------


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step, made deterministic by its uniform draws ``u`` ``(k,)``.

    ``p`` ``(k + 1, V)``: the target's distributions at the last kept token and after each draft;
    ``q`` ``(k, V)``: the draft's distribution each draft was sampled from; ``drafts`` ``(k,)``.
    Draft ``i`` is kept if ``u[i] < min(1, p[i, x] / q[i, x])`` and every earlier one was.
    Returns ``(n, dist)``: ``n`` the drafts kept (a 0-d int64 tensor), and the distribution the next
    token is drawn from — ``max(0, p[n] − q[n])`` renormalized after a rejection, ``p[k]`` (the
    bonus) if all ``k`` were kept.
    """
    k = drafts.shape[0]
    ratio = p[torch.arange(k), drafts] / q[torch.arange(k), drafts]
    accepted = u < ratio.clamp(max=1.0)
    n = int(accepted.long().cumprod(0).sum())
    if n == k:
        return torch.tensor(n), p[k]
    residual = (p[n] - q[n]).clamp_min(0.0)
    return torch.tensor(n), residual / residual.sum()


def accept_cases(gen: torch.Generator) -> list[tuple]:
    """Random ``(p, q, drafts, u)`` with drafts sampled from ``q``; and fixed ones: every draft
    kept, the first rejected, a draft the target gives more mass than the draft did."""
    cases = []
    for k, vocab in ((3, 6), (4, 10), (2, 5), (5, 8)):
        p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 2, -1)
        q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, -1)
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        cases.append((p, q, drafts, torch.rand(k, generator=gen)))
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]])
    cases.append((p, q, torch.tensor([0, 1]), torch.tensor([0.99, 0.99])))  # p/q >= 1: both kept, the bonus p[2]
    cases.append((p, q, torch.tensor([1, 1]), torch.tensor([0.9, 0.0])))  # 0.2/0.4: rejected at 0.9
    return cases


def accept_reference(p, q, drafts, u):
    return speculative_accept(p, q, drafts, u)


# ----------------------------------------------------------------------------------------------
# Exercise 4: the FLOPs of a training step
# ----------------------------------------------------------------------------------------------


def step_flops(params: int, layers: int, hidden: int, seq: int, tokens: int) -> int:
    """FLOPs of one training step (forward and backward) over ``tokens`` tokens of sequences of
    ``seq``: ``6·N`` per token for the ``N`` non-embedding parameters (2 forward, 4 backward) plus
    ``12·L·h·s`` per token for attention's scores and weighted sum (``Q Kᵀ`` and ``P V``: 2·2·h·s
    forward per layer, tripled for the backward), as in PaLM's appendix B (Chowdhery et al. 2022,
    arXiv:2204.02311). Causal masking is not subtracted (the convention MFU uses)."""
    return 6 * params * tokens + 12 * layers * hidden * seq * tokens


def flops_cases(gen: torch.Generator) -> list[tuple]:
    cases = [(6_700_000_000, 32, 4096, 2048, 2048), (1_000, 2, 16, 8, 64)]
    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    for _ in range(3):
        layers, hidden, seq = draw(1, 80), draw(64, 8192), draw(128, 8192)
        cases.append((12 * layers * hidden * hidden, layers, hidden, seq, seq * draw(1, 16)))
    return cases


def flops_reference(params, layers, hidden, seq, tokens):
    return step_flops(params, layers, hidden, seq, tokens)
