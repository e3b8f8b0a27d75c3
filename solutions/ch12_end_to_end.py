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

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import kernel_ladder
from utils.exercises import one_or_all_causes

__all__ = [
    "decoder_layer",
    "decoder_cases",
    "decoder_reference",
    "kernels_only",
    "DECODER_TOLERANCE",
    "decoder_variant",
    "explain_decoder",
    "top_p_filter",
    "top_p_cases",
    "top_p_reference",
    "explain_top_p",
    "speculative_accept",
    "accept_cases",
    "accept_reference",
    "explain_accept",
    "step_flops",
    "flops_cases",
    "flops_reference",
    "explain_flops",
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


_FORBIDDEN = ("aten.add", "aten.add_",  # the residuals: kernel_ladder.add
              "aten.mm", "aten.bmm", "aten.addmm", "aten.matmul", "aten.linear", "aten._softmax", "aten.softmax",
              "aten.baddbmm", "aten._scaled_dot_product")


def kernels_only(candidate):
    """Run ``candidate`` and refuse it if it computed with torch's matmuls, softmax or attention
    (every op the dispatcher runs is seen) or ran no ``kernel_ladder`` op at all."""
    from utils.trace import OpLog

    def run(*args):
        with OpLog() as log:
            out = candidate(*args)
        torch_ops = log.matching(*_FORBIDDEN)
        if torch_ops and all(op.split(".")[1] in ("add", "add_") for op in torch_ops):
            raise ValueError(f"the layer ran torch's {', '.join(torch_ops)}: the two residual adds are "
                             "kernel_ladder.add(x, …) too (the spec's list), not torch's + — the whole layer runs on "
                             "kernel_ladder ops")
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
    (4 over 1) attention, sequences of 1, 7 and 12; the 12 rows' magnitudes fall from 1 to 0.01, where
    the norms' eps weighs (the config's 1e-5 against a default's)."""
    cases = []
    for kv_heads, batch, seq in ((2, 2, 7), (1, 1, 12), (2, 1, 1)):
        layer, rotary = hf_decoder_layer(kv_heads=kv_heads, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
        x = torch.randn(batch, seq, 32, generator=gen)
        if seq == 12:
            x = x * torch.logspace(0, -2, seq)[:, None]
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


def decoder_variant(x, layer, cos, sin, *, rope: bool = True, causal: bool = True, residual1: bool = True,
                    residual2: bool = True, gqa: str = "group", transpose_back: bool = True,
                    scale: float | None = None, second_norm: str = "post", residual_from: str = "x",
                    swap_gate_up: bool = False, eps: dict[int, float] | None = None) -> torch.Tensor:
    """The decoder layer in float64 from the layer's weights, with one step changeable: each keyword
    is a common mistake (all defaults: HF's layer). ``gqa="modulo"`` sends query head ``h`` to K/V
    head ``h % kv_heads``; ``scale`` replaces ``1/sqrt(head_dim)``; ``second_norm="input"`` normalizes
    before the MLP with ``input_layernorm``'s weight; ``residual_from="normed"`` adds the attention to
    ``norm₁(x)`` instead of ``x``; ``swap_gate_up`` gives SiLU the up projection; ``eps`` maps a norm
    (1 or 2) to the eps it uses instead of its module's."""
    layer = getattr(layer, "_layer", layer)
    attn = layer.self_attn
    x, cos, sin = x.double(), cos.double(), sin.double()

    def weight(t: torch.Tensor) -> torch.Tensor:
        return t.detach().double()

    def rms(v: torch.Tensor, norm, which: int) -> torch.Tensor:
        e = (eps or {}).get(which, norm.variance_epsilon)
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + e) * weight(norm.weight)

    def rotate(u: torch.Tensor) -> torch.Tensor:  # HF's rotate_half: (u1, u2) -> (-u2, u1)
        half = u.shape[-1] // 2
        return torch.cat((-u[..., half:], u[..., :half]), -1)

    b, t, _ = x.shape
    d = attn.head_dim
    normed = h = rms(x, layer.input_layernorm, 1)
    q, k, v = ((h @ weight(proj.weight).T).view(b, t, -1, d).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    if rope:
        c, s = cos[:, None], sin[:, None]
        q, k = q * c + rotate(q) * s, k * c + rotate(k) * s
    heads, kv_heads = q.shape[1], k.shape[1]
    index = torch.arange(heads) // (heads // kv_heads) if gqa == "group" else torch.arange(heads) % kv_heads
    scores = q @ k[:, index].transpose(-1, -2) * (attn.scaling if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ v[:, index]
    out = out.transpose(1, 2).reshape(b, t, -1) if transpose_back else out.reshape(b, t, -1)
    o = out @ weight(attn.o_proj.weight).T
    x = (x if residual_from == "x" else normed) + o if residual1 else o
    h = rms(x, layer.post_attention_layernorm if second_norm == "post" else layer.input_layernorm, 2)
    mlp = layer.mlp
    gate, up, down = (weight(w) for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    if swap_gate_up:
        gate, up = up, gate
    m = (F.silu(h @ gate.T) * (h @ up.T)) @ down.T
    return x + m if residual2 else m


def _default_eps() -> list[float]:
    """The eps a norm gets when none is passed: ``kernel_ladder.rms_norm``'s, and torch's (float32's epsilon)."""
    import inspect

    return [inspect.signature(kernel_ladder.rms_norm).parameters["eps"].default, torch.finfo(torch.float32).eps]


def _decoder_mistakes(head_dim: int, hidden: int, config_eps: float) -> list[tuple[dict, str]]:
    defaults = [(e, f"RMSNorm with a default eps ({e:.3g}) instead of the config's ({config_eps:.3g}): pass each "
                    "norm its module's variance_epsilon — it weighs on rows of small magnitude")
                for e in _default_eps()]
    return [
        ({"rope": False}, "no rotary embedding: apply kernel_ladder.rope(q, k, cos, sin) to the projected, "
                          "head-split q and k before the attention"),
        ({"causal": False}, "attention is not causal: a query sees the keys after it — "
                            "kernel_ladder.flash_attention(q, k, v, causal=True, ...)"),
        ({"residual1": False}, "the first residual add is missing: h = x + o_proj(attention), and the MLP "
                               "reads norm₂(h)"),
        ({"residual2": False}, "the second residual add is missing: the layer returns h + mlp(norm₂(h))"),
        ({"gqa": "modulo"}, "query head h attends K/V head h % kv_heads (K/V tiled with .repeat); grouped-query "
                            "attention gives it K/V head h // (heads / kv_heads) — pass flash_attention the K/V "
                            "heads as they are (or repeat_interleave)"),
        ({"transpose_back": False}, "the attention output reshaped to (B, T, H·D) without transposing "
                                    "(B, H, T, D) back to (B, T, H, D) first: .transpose(1, 2), then reshape"),
        ({"scale": 1.0 / head_dim}, "softmax scale 1/head_dim: the scores are scaled by 1/sqrt(head_dim) "
                                    "(layer.self_attn.scaling)"),
        ({"scale": 1.0}, "no softmax scale: the scores are scaled by 1/sqrt(head_dim) (layer.self_attn.scaling)"),
        ({"scale": hidden ** -0.5}, "softmax scale 1/sqrt(hidden): the scores are scaled by 1/sqrt(head_dim), the "
                                    "size of one head's q·k (layer.self_attn.scaling), not the model's width"),
        ({"residual_from": "normed"}, "the first residual adds the attention to the normed x: "
                                      "h = x + o_proj(attention) takes the layer's input x itself, not rms_norm(x) "
                                      "(the norm feeds only the projections)"),
        ({"swap_gate_up": True}, "gate and up projections swapped: SiLU applies to the gate's product — "
                                 "gated_mlp(h, gate_proj.weight, up_proj.weight, down_proj.weight), in that order"),
        *(({"eps": {which: e for which in norms}}, cause) for e, cause in defaults for norms in ((1,), (2,), (1, 2))),
        ({"second_norm": "input"}, "the second norm uses input_layernorm's weight: the MLP's input is "
                                   "normalized with post_attention_layernorm"),
    ]


def explain_decoder(case: tuple, got: Any, expected: Any) -> str | None:
    """The common mistakes, each recomputed in float64, against the layer ``got`` returned."""
    x, layer, cos, sin = case
    got, expected = got.detach().double(), expected.double()
    inner = getattr(layer, "_layer", layer)
    mistakes = _decoder_mistakes(inner.self_attn.head_dim, x.shape[-1], inner.input_layernorm.variance_epsilon)
    causes, eps_fits = [], []
    for change, cause in mistakes:
        variant = decoder_variant(x, layer, cos, sin, **change)
        # a mistake fits when the layer returned its values, they are not the right ones, and they are nearer
        # the mistake than the right layer (a default eps moves only a few elements, and a little)
        if variant.shape != got.shape or not torch.allclose(got, variant, rtol=1e-4, atol=1e-4):
            continue
        distance = float((got - variant).abs().max())
        nearer = distance < float((got - expected).abs().max())
        if nearer and not torch.allclose(variant, expected, **DECODER_TOLERANCE):
            (eps_fits if "eps" in change else causes).append((distance, cause))
    # the default eps are alternatives of one mistake, told apart by how near each comes: the nearest is named
    return one_or_all_causes([cause for _, cause in causes] + ([min(eps_fits)[1]] if eps_fits else []))


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


def inputs_unchanged(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, raising if it changed any tensor argument in place (the caller's inputs must stay)."""
    import inspect

    def run(*args: Any) -> Any:
        before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
        result = function(*args)
        try:
            names = list(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            names = []
        for i, (arg, copy) in enumerate(zip(args, before)):
            if copy is not None and not torch.equal(arg, copy):
                name = names[i] if i < len(names) else f"argument {i}"
                raise ValueError(f"{getattr(function, '__name__', 'the function')} changed its argument {name} in "
                                 "place: the caller's tensor must be left as it was — work on a copy or on new "
                                 "tensors (in-place ops such as masked_fill_, scatter_, copy_ or /= write into it)")
        return result

    run.__name__ = getattr(function, "__name__", "run")
    run.__wrapped__ = function
    return run


def top_p_cases(gen: torch.Generator) -> list[tuple]:
    """Fixed rows (one at the boundary: 0.3's mass above is exactly 0.5), random rows of 50, and
    rows from scores in the tens, nearly one-hot (the first token alone passes top_p)."""
    cases = [(torch.tensor([[0.5, 0.3, 0.15, 0.05]]), 0.7), (torch.tensor([[0.5, 0.3, 0.15, 0.05]]), 0.5),
             (torch.tensor([[0.1, 0.6, 0.3]]), 1.0), (torch.tensor([[0.35, 0.4, 0.25]]), 0.3)]  # no ties
    for top_p in (0.9, 0.5, 0.05):
        cases.append((torch.softmax(torch.randn(3, 50, generator=gen) * 3, -1), top_p))
    scores = torch.randn(3, 50, generator=gen) * 2
    scores[:, 7] += 30  # one token far ahead: the rest share less than 1e-12 of the mass
    cases.append((torch.softmax(scores, -1), 0.9))
    return cases


def _nucleus(probs: torch.Tensor, top_p: float, *, keep, descending: bool = True, scatter: bool = True,
             renormalize: bool | str = True) -> torch.Tensor:
    """Each row's tokens in order of probability; ``keep(mass_above, mass_through)`` says which stay;
    ``renormalize="all"`` divides by the whole tensor's sum instead of each row's."""
    out = torch.zeros_like(probs)
    for r, row in enumerate(probs):
        order = sorted(range(row.shape[0]), key=lambda j: float(row[j]), reverse=descending)
        above = 0.0
        for rank, j in enumerate(order):
            value = float(row[j])
            if keep(above, above + value) or rank == 0:
                out[r, j if scatter else rank] = value
            above += value
    if renormalize == "all":
        return out / out.sum()
    return out / out.sum(-1, keepdim=True) if renormalize else out


def _kept_by_own_probability(probs: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether every row of ``got`` keeps some of its most probable tokens, in proportion to ``probs``, and
    some row keeps another number of them than the nucleus: what a threshold on each token's own
    probability (``probs >= value``) does."""
    if got.shape != probs.shape or not bool(torch.isfinite(got).all()):
        return False
    for row, out in zip(probs, got):
        kept = out > 0
        if not bool(kept.any()) or (bool((~kept).any()) and float(row[kept].min()) <= float(row[~kept].max())):
            return False
        share = row[kept] / row[kept].sum()
        if not torch.allclose(out[kept], share, rtol=1e-5, atol=1e-6):
            return False
    return not torch.equal(got > 0, expected > 0)


def top_p_reference(probs, top_p):
    """Written apart from :func:`top_p_filter`: a token stays while the mass ranked above it is below
    ``top_p`` (the most probable one always stays), then the row is renormalized."""
    return _nucleus(probs, top_p, keep=lambda above, through: above < top_p)


def explain_top_p(case: tuple, got: Any, expected: Any) -> str | None:
    """The common mistakes, each recomputed, against the rows ``got``."""
    probs, top_p = case
    probs = probs.double()
    right = lambda above, through: above < top_p  # noqa: E731
    variants = [
        (_nucleus(probs, top_p, keep=lambda above, through: through <= top_p),
         "the token whose probability crosses top_p is dropped: a token stays while the mass ranked above it "
         "(cumsum − itself) is below top_p, so the one that crosses top_p is kept"),
        (_nucleus(probs, top_p, keep=lambda above, through: through < top_p),
         "the token whose probability crosses top_p is dropped: a token stays while the mass ranked above it "
         "(cumsum − itself) is below top_p, so the one that crosses top_p is kept"),
        (_nucleus(probs, top_p, keep=right, renormalize=False),
         "not renormalized: divide each row's kept probabilities by their sum"),
        (_nucleus(probs, top_p, keep=lambda above, through: above <= top_p),
         "a token whose mass above is exactly top_p kept: it stays only while that mass is below top_p (<, not <=)"),
        (_nucleus(probs, top_p, keep=right, descending=False),
         "sorted ascending: the nucleus is the most probable tokens — sort in descending order"),
        (_nucleus(probs, top_p, keep=right, scatter=False),
         "the kept probabilities are left in sorted order: scatter them back to their tokens' columns "
         "(the indices the sort returned)"),
        (_nucleus(probs, top_p, keep=right, renormalize="all"),
         "renormalized by the whole tensor's sum: each row is its own distribution — divide it by its own sum "
         "(kept.sum(-1, keepdim=True))"),
    ]
    got = got.detach().double()
    causes = [cause for variant, cause in variants
              if variant.shape == got.shape and torch.allclose(got, variant, rtol=1e-5, atol=1e-6)
              and not torch.allclose(variant, expected.double(), rtol=1e-5, atol=1e-6)]
    if not causes and _kept_by_own_probability(probs, got, expected.double()):
        causes.append("tokens kept by a threshold on their own probability (probs >= some value), not by the "
                      "cumulative mass: each row keeps its most probable tokens, but not as many as its nucleus "
                      "holds — a token stays while the mass ranked above it (cumsum − itself) is below top_p")
    return one_or_all_causes(causes)


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
    """Random ``(p, q, drafts, u)`` with drafts sampled from ``q``, two of them from scores in the
    tens (probabilities from nearly 1 down to 1e-13, ratios p/q far from 1); and fixed ones: every
    draft kept, the first rejected, a draft the target gives more mass than the draft did."""
    cases = []
    for k, vocab, spread in ((3, 6, 2.0), (4, 10, 2.0), (2, 5, 2.0), (5, 8, 2.0), (4, 12, 12.0), (3, 9, 12.0)):
        p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * spread, -1)
        q = torch.softmax(torch.randn(k, vocab, generator=gen) * spread, -1)
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        cases.append((p, q, drafts, torch.rand(k, generator=gen)))
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]])
    cases.append((p, q, torch.tensor([0, 1]), torch.tensor([0.99, 0.99])))  # p/q >= 1: both kept, the bonus p[2]
    cases.append((p, q, torch.tensor([1, 1]), torch.tensor([0.9, 0.0])))  # 0.2/0.4: rejected at 0.9
    # The first draft kept (0.7/0.5 >= 1), the second rejected (0.1/0.6 < 0.9): the residual is row 1's,
    # max(0, p[1] - q[1]) = [0, 0.6, 0], not row 0's [0.2, 0, 0] (a fixed case: random ones may never reject late).
    cases.append((p, q, torch.tensor([0, 2]), torch.tensor([0.1, 0.9])))
    # u equal to p/q exactly: 0.2 / 0.4 is 0.5 in float32 (0.4 is 2 · 0.2 to the bit), and u < 0.5 rejects.
    cases.append((p, q, torch.tensor([1, 1]), torch.tensor([0.5, 0.3])))
    return cases


def _accept(p, q, drafts, u, *, ratio=lambda p, q: p / q, leading: bool = True, residual: str = "p - q",
            renormalize: bool = True, bonus: int = 0, strict: bool = True, residual_row: str = "n"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule step by step, draft after draft; each keyword is one way to get it wrong."""
    k = drafts.shape[0]
    n = 0
    for i in range(k):
        x = int(drafts[i])
        bound = min(1.0, float(ratio(p[i, x], q[i, x])))
        if float(u[i]) < bound or (not strict and float(u[i]) == bound):
            n += 1
        elif leading:
            break
    if n == k:
        return torch.tensor(n), p[k - bonus]
    row = n if residual_row == "n" else (n - 1 if residual_row == "n - 1" else max(n - 1, 0))  # n - 1 wraps at 0
    if residual == "p":
        dist = p[row].clone()
    else:
        dist = (p[row] - q[row] if residual == "p - q" else q[row] - p[row]).clamp_min(0.0)
    return torch.tensor(n), dist / dist.sum() if renormalize else dist


def accept_reference(p, q, drafts, u):
    """Written apart from :func:`speculative_accept`: draft by draft, stopping at the first rejection."""
    return _accept(p, q, drafts, u)


def explain_accept(case: tuple, got: Any, expected: Any) -> str | None:
    """The common mistakes, each recomputed, against the ``(n, dist)`` returned."""
    p, q, drafts, u = (t.double() if t.dtype.is_floating_point else t for t in case)
    variants = [
        (_accept(p, q, drafts, u, strict=False),
         "a draft kept where u equals p/q exactly: keep draft x only if u < min(1, p[i, x] / q[i, x]) — strictly "
         "less, so that it is kept with probability min(1, p/q) exactly"),
        (_accept(p, q, drafts, u, residual="p"),
         "after a rejection the next token is drawn from p[n] itself: draw it from max(0, p[n] − q[n]) "
         "renormalized, which removes the mass the draft already had its chance at"),
        (_accept(p, q, drafts, u, renormalize=False),
         "max(0, p[n] − q[n]) not renormalized: divide it by its sum"),
        (_accept(p, q, drafts, u, leading=False),
         "n counts every draft accepted, not the leading run: the first rejection ends the run "
         "(kept.long().cumprod(0).sum())"),
        (_accept(p, q, drafts, u, ratio=lambda p, q: q / p),
         "the ratio inverted: draft x is kept if u < min(1, p[i, x] / q[i, x]), the target's probability over "
         "the draft's"),
        (_accept(p, q, drafts, u, residual="q - p"),
         "the residual taken as q[n] − p[n]: after a rejection the next token comes from max(0, p[n] − q[n]) "
         "renormalized — the mass the target gives beyond the draft, not the draft's beyond the target"),
        *((_accept(p, q, drafts, u, residual_row=row),
           "the residual taken from row n − 1: n drafts were kept, so the rejected one is draft n (counting from "
           "0) and the residual is max(0, p[n] − q[n]), both rows at the rejected position")
          for row in ("n - 1", "max(n - 1, 0)")),
        (_accept(p, q, drafts, u, bonus=1),
         "all drafts kept, the next token drawn from p[k − 1]: the bonus token comes from p[k], the target's "
         "distribution after the last draft"),
    ]
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return None
    n, dist = int(got[0]), got[1].detach().double()
    if n == int(expected[0]) and n < drafts.shape[0] and bool((dist < 0).any()):
        return ("p[n] − q[n] not clamped at 0: its negative entries are not probabilities (and it sums to 0) — "
                "max(0, p[n] − q[n]), then renormalize")
    causes = []
    for (v_n, v_dist), cause in variants:
        same = n == int(v_n) and v_dist.shape == dist.shape and torch.allclose(dist, v_dist, rtol=1e-5, atol=1e-6)
        right = int(v_n) == int(expected[0]) and torch.allclose(v_dist, expected[1].double(), rtol=1e-5, atol=1e-6)
        if same and not right:
            causes.append(cause)
    return one_or_all_causes(causes)


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
    """``(params, layers, hidden, seq, tokens)``: a 7B-like and a 70B-like step of about four million
    tokens, then random ones; every count passes 2^53 with a low bit a float64 cannot hold, so a
    count computed in floating point comes out wrong (an odd ``params`` and an odd ``tokens`` leave
    the count one factor of two)."""
    cases = [(6_476_005_377, 32, 4096, 4096, 4_194_301), (68_976_648_193, 80, 8192, 8192, 4_194_303)]

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    while len(cases) < 5:
        layers, hidden, seq = draw(1, 80), draw(64, 8192), draw(128, 8192)
        case = (12 * layers * hidden * hidden + 2 * layers * hidden + 1, layers, hidden, seq, draw(2**20, 2**23) | 1)
        value = flops_reference(*case)
        if value > 2**54 and int(float(value)) != value:
            cases.append(case)
    return cases


def flops_reference(params, layers, hidden, seq, tokens):
    """Written apart from :func:`step_flops`: the FLOPs of one token, forward (2 per parameter, 4·h·s
    per layer for QKᵀ and PV) times three for forward and backward, times the tokens."""
    forward_per_token = 2 * params + 2 * 2 * layers * hidden * seq
    return 3 * forward_per_token * tokens


def explain_flops(case: tuple, got: Any, expected: Any) -> str | None:
    """The common wrong counts, each recomputed exactly, against the number returned."""
    n, layers, hidden, seq, tokens = case
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return None
    if got != expected and math.isfinite(got) and abs(got - expected) <= expected * 2**-50:
        return (f"the count was computed in floating point: a float64 holds integers exactly only up to 2^53 "
                f"(about 9.0e15), and this count is {expected:,}; compute it with Python ints, which never round "
                "(int(...) of a float keeps the float's rounding)")
    attention = layers * hidden * seq
    variants = [
        (2 * n * tokens + 4 * attention * tokens,
         "the forward pass only: a training step's backward costs twice its forward — 6·N and 12·L·h·s per token"),
        (6 * n * tokens, "attention's own FLOPs (12·L·h·s per token: QKᵀ and PV, forward and backward) are missing"),
        (6 * n * tokens + 6 * attention * tokens,
         "attention halved for the causal mask: MFU's convention counts the whole score matrix, 12·L·h·s"),
        (6 * n + 12 * attention, "the FLOPs of one token: multiply by the step's tokens"),
        (6 * n * tokens + 12 * attention, "attention counted once for the step, not per token: 12·L·h·s·tokens"),
        (6 * n * tokens + 4 * attention * tokens,
         "attention's forward pass only: 4·L·h·s per token is QKᵀ and PV forward; with the backward (twice the "
         "forward) a training step costs 12·L·h·s"),
        (2 * n * tokens + 12 * attention * tokens,
         "the parameters' forward pass only: 2·N per token; with the backward (4·N) a training step costs 6·N"),
        *((n_term + 12 * attention * seq * (tokens // seq),
           "attention counted over tokens // seq whole sequences: the step's tokens need not fill whole sequences "
           "(the check's are odd), and tokens // seq drops the rest — count 12·L·h·s per token, times tokens")
          for n_term in (6 * n * tokens, 6 * n * seq * (tokens // seq))),
    ]
    return one_or_all_causes([cause for value, cause in variants
                              if value != expected and math.isclose(got, value, rel_tol=1e-9)])
