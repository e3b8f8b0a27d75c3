"""Chapter 12's exercise solutions pass their checks, and plausible wrong answers are rejected."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kernel_ladder  # noqa: E402
from solutions import ch12_end_to_end as given  # noqa: E402
from utils.exercises import check  # noqa: E402


def rejected(verdict, diagnosis: str = "") -> bool:
    return not verdict.solved and diagnosis in " ".join(verdict.message.split())


# -- exercise 1: the decoder layer ------------------------------------------------------------


def check_decoder(fn):
    return check("ch12.decoder_layer", given.kernels_only(fn), given.decoder_reference, given.decoder_cases,
                 **given.DECODER_TOLERANCE)


def test_decoder_solution_solves():
    assert check_decoder(given.decoder_layer).solved


def _no_rope(x, layer, cos, sin):
    return given.decoder_layer(x, layer, torch.ones_like(cos), torch.zeros_like(sin))


def _not_causal(x, layer, cos, sin):
    original = kernel_ladder.flash_attention
    try:
        kernel_ladder.flash_attention = lambda q, k, v, causal=False, **kw: original(q, k, v, causal=False, **kw)
        return given.decoder_layer(x, layer, cos, sin)
    finally:
        kernel_ladder.flash_attention = original


def _no_second_residual(x, layer, cos, sin):
    attn_only = given.decoder_layer(x, layer, cos, sin)
    mlp = layer.mlp
    h = kernel_ladder.rms_norm(attn_only, layer.post_attention_layernorm.weight, 1e-5)  # a wrong path, on purpose
    return kernel_ladder.gated_mlp(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def _calls_the_hf_layer(x, layer, cos, sin):  # right values, no kernels: refused
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    return layer(x, attention_mask=mask, position_embeddings=(cos, sin))


@pytest.mark.parametrize("fn, diagnosis", [(_no_rope, ""), (_not_causal, ""), (_no_second_residual, ""),
                                           (_calls_the_hf_layer, "compute it with kernel_ladder ops")],
                         ids=["no rope", "not causal", "no residual", "the HF layer itself"])
def test_decoder_wrong_variants_rejected(fn, diagnosis):
    assert rejected(check_decoder(fn), diagnosis)


# -- exercise 2: top-p ------------------------------------------------------------------------


def check_top_p(fn):
    return check("ch12.top_p_filter", fn, given.top_p_reference, given.top_p_cases)


def test_top_p_solution_solves():
    assert check_top_p(given.top_p_filter).solved


def _exclusive(probs, top_p):  # drops the token that crosses top_p
    s, order = probs.sort(-1, descending=True)
    kept = s.masked_fill(s.cumsum(-1) > top_p, 0.0)
    kept[..., 0] = s[..., 0]
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(-1, keepdim=True)


def _not_renormalized(probs, top_p):
    out = given.top_p_filter(probs, top_p)
    return out * probs.masked_fill(out == 0, 0).sum(-1, keepdim=True)


@pytest.mark.parametrize("fn", [_exclusive, _not_renormalized])
def test_top_p_wrong_variants_rejected(fn):
    assert rejected(check_top_p(fn))


# -- exercise 3: speculative acceptance ---------------------------------------------------------


def check_accept(fn):
    return check("ch12.speculative_accept", fn, given.accept_reference, given.accept_cases)


def test_accept_solution_solves():
    assert check_accept(given.speculative_accept).solved


def _residual_is_p(p, q, drafts, u):  # the replacement drawn from p: biased towards what the draft proposed
    n, _ = given.speculative_accept(p, q, drafts, u)
    return n, p[int(n)]


def _unclamped_residual(p, q, drafts, u):
    n, _ = given.speculative_accept(p, q, drafts, u)
    if int(n) == drafts.shape[0]:
        return n, p[-1]
    r = p[int(n)] - q[int(n)]
    return n, r / r.sum()


def _keeps_going_after_a_rejection(p, q, drafts, u):
    k = drafts.shape[0]
    ratio = p[torch.arange(k), drafts] / q[torch.arange(k), drafts]
    n = int((u < ratio.clamp(max=1.0)).sum())
    if n == k:
        return torch.tensor(n), p[k]
    r = (p[n] - q[n]).clamp_min(0)
    return torch.tensor(n), r / r.sum()


def _no_bonus(p, q, drafts, u):
    n, dist = given.speculative_accept(p, q, drafts, u)
    return n, (p[int(n) - 1] if int(n) == drafts.shape[0] else dist)


@pytest.mark.parametrize("fn", [_residual_is_p, _unclamped_residual, _keeps_going_after_a_rejection, _no_bonus])
def test_accept_wrong_variants_rejected(fn):
    assert rejected(check_accept(fn))


def test_the_accept_rule_is_the_engines():
    """The exercise's rule and Engine.verify keep the same drafts given the same uniforms."""
    from kernel_ladder.models import Engine

    for p, q, drafts, _ in given.accept_cases(torch.Generator().manual_seed(4))[:4]:
        for seed in range(5):
            gu = torch.Generator().manual_seed(seed)  # Engine.verify draws one uniform per draft, in order
            u = torch.stack([torch.rand((), generator=gu) for _ in range(drafts.shape[0])])
            _, accepted = Engine.verify(p.log(), drafts.tolist(), list(q), 1.0, 1.0,
                                        torch.Generator().manual_seed(seed))
            n, _ = given.speculative_accept(p, q, drafts, u)
            assert accepted == int(n), (seed, accepted, int(n))


# -- exercise 4: FLOPs ----------------------------------------------------------------------------


def check_flops(fn):
    return check("ch12.step_flops", fn, given.flops_reference, given.flops_cases)


def test_flops_solution_solves():
    assert check_flops(given.step_flops).solved
    # Llama-2-7B-like at 2048 tokens: 6N dominates; attention adds 12 L h s
    assert given.step_flops(6_700_000_000, 32, 4096, 2048, 1) == 6 * 6_700_000_000 + 12 * 32 * 4096 * 2048


@pytest.mark.parametrize("fn", [
    lambda n, l, h, s, t: 2 * n * t + 4 * l * h * s * t,  # the forward only
    lambda n, l, h, s, t: 6 * n * t,  # attention forgotten
    lambda n, l, h, s, t: 6 * n * t + 6 * l * h * s * t,  # causal halving applied
])
def test_flops_wrong_variants_rejected(fn):
    assert rejected(check_flops(fn))
