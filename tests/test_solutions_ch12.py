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
                 diagnose=given.explain_decoder, **given.DECODER_TOLERANCE)


def test_decoder_solution_solves():
    assert check_decoder(given.decoder_layer).solved


def _layer(rope=True, causal=True, residual1=True, residual2=True, gqa="group", transpose_back=True, scale=None,
           second_norm="post", residual_from="x", swap_gate_up=False, default_eps=()):
    """The solution's layer with one thing changed: each keyword is a common mistake."""

    def layer_fn(x, layer, cos, sin):
        attn = layer.self_attn
        b, t, _ = x.shape
        d = attn.head_dim

        def norm(v, which):  # rms_norm's own default eps (1e-6) where asked, not the layer's 1e-5
            module = layer.input_layernorm if which == 1 else layer.post_attention_layernorm
            if which in default_eps:
                return kernel_ladder.rms_norm(v, module.weight)
            return kernel_ladder.rms_norm(v, module.weight, module.variance_epsilon)

        h = norm(x, 1)
        q = kernel_ladder.linear(h, attn.q_proj.weight).view(b, t, -1, d).transpose(1, 2)
        k = kernel_ladder.linear(h, attn.k_proj.weight).view(b, t, -1, d).transpose(1, 2)
        v = kernel_ladder.linear(h, attn.v_proj.weight).view(b, t, -1, d).transpose(1, 2)
        if rope:
            q, k = kernel_ladder.rope(q, k, cos, sin)
        if gqa == "modulo":  # query head h on kv head h % kv_heads: K/V tiled, not interleaved
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat(1, group, 1, 1).contiguous(), v.repeat(1, group, 1, 1).contiguous()
        out = kernel_ladder.flash_attention(q, k, v, causal=causal,
                                            softmax_scale=attn.scaling if scale is None else scale(d, x.shape[-1]))
        out = out.transpose(1, 2).reshape(b, t, -1) if transpose_back else out.reshape(b, t, -1)
        o = kernel_ladder.linear(out, attn.o_proj.weight)
        x = kernel_ladder.add(x if residual_from == "x" else h, o) if residual1 else o  # h: the normed x
        if second_norm == "post":
            h = norm(x, 2)
        else:
            h = kernel_ladder.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        mlp = layer.mlp
        gate, up = (mlp.up_proj.weight, mlp.gate_proj.weight) if swap_gate_up else (mlp.gate_proj.weight,
                                                                                    mlp.up_proj.weight)
        m = kernel_ladder.gated_mlp(h, gate, up, mlp.down_proj.weight)
        return kernel_ladder.add(x, m) if residual2 else m

    return layer_fn


def _calls_the_hf_layer(x, layer, cos, sin):  # right values, no kernels: refused
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    return layer(x, attention_mask=mask, position_embeddings=(cos, sin))


def _torch_residuals(x, layer, cos, sin):  # everything from kernel_ladder but the two residual adds: torch's +
    import kernel_ladder

    real_add = kernel_ladder.add
    kernel_ladder.add = lambda a, b: a + b
    try:
        return given.decoder_layer(x, layer, cos, sin)
    finally:
        kernel_ladder.add = real_add


def test_the_variants_reproduce_the_solution_when_nothing_is_changed():
    assert check_decoder(_layer()).solved


@pytest.mark.parametrize("fn, diagnosis", [
    (_layer(rope=False), "cause: no rotary embedding"),
    (_layer(causal=False), "cause: attention is not causal"),
    (_layer(residual1=False), "cause: the first residual add is missing"),
    (_layer(residual2=False), "cause: the second residual add is missing"),
    (_layer(gqa="modulo"), "cause: query head h attends K/V head h % kv_heads"),
    (_layer(transpose_back=False), "cause: the attention output reshaped to (B, T, H·D) without transposing"),
    (_layer(scale=lambda d, hidden: 1.0 / d), "cause: softmax scale 1/head_dim"),
    (_layer(scale=lambda d, hidden: hidden**-0.5), "cause: softmax scale 1/sqrt(hidden)"),
    (_layer(second_norm="input"), "cause: the second norm uses input_layernorm's weight"),
    (_layer(residual_from="normed"), "cause: the first residual adds the attention to the normed x"),
    (_layer(swap_gate_up=True), "cause: gate and up projections swapped"),
    (_layer(default_eps=(1,)), "cause: RMSNorm with a default eps (1e-06) instead of the config's (1e-05)"),
    (_layer(default_eps=(1, 2)), "cause: RMSNorm with a default eps (1e-06) instead of the config's (1e-05)"),
    (_calls_the_hf_layer, "compute it with kernel_ladder ops"),
    (_torch_residuals, "the layer ran torch's aten.add"),
], ids=["no rope", "not causal", "no first residual", "no second residual", "GQA modulo", "no transpose",
        "scale 1/d", "scale 1/sqrt(hidden)", "second norm's weight", "residual from the normed x",
        "gate and up swapped", "default eps, first norm", "default eps, both norms", "the HF layer itself",
        "torch's + for the residuals"])
def test_decoder_wrong_variants_rejected(fn, diagnosis):
    verdict = check_decoder(fn)
    assert rejected(verdict, diagnosis), verdict.message


def test_the_float64_variants_reproduce_hf_when_nothing_is_changed():
    # HF's RMSNorm computes in float32 even in a float64 layer: agreement to float32's rounding.
    for x, layer, cos, sin in given.decoder_cases(torch.Generator().manual_seed(3)):
        want = given.decoder_reference(x, layer, cos, sin)
        assert torch.allclose(given.decoder_variant(x, layer, cos, sin), want, rtol=1e-5, atol=1e-5)


# -- exercise 2: top-p ------------------------------------------------------------------------


def check_top_p(fn):
    return check("ch12.top_p_filter", given.inputs_unchanged(fn), given.top_p_reference, given.top_p_cases,
                 diagnose=given.explain_top_p)


def test_top_p_solution_solves():
    assert check_top_p(given.top_p_filter).solved


def _exclusive(probs, top_p):  # keeps a token only while the mass including itself is within top_p
    s, order = probs.sort(-1, descending=True)
    kept = s.masked_fill(s.cumsum(-1) > top_p, 0.0)
    kept[..., 0] = s[..., 0]
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(-1, keepdim=True)


def _not_renormalized(probs, top_p):
    s, order = probs.sort(-1, descending=True)
    kept = s.masked_fill(s.cumsum(-1) - s >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def _at_most_top_p_above(probs, top_p):  # keeps a token whose mass above is exactly top_p
    s, order = probs.sort(-1, descending=True)
    kept = s.masked_fill(s.cumsum(-1) - s > top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(-1, keepdim=True)


def _ascending(probs, top_p):  # the least probable tokens first
    s, order = probs.sort(-1)
    kept = s.masked_fill(s.cumsum(-1) - s >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(-1, keepdim=True)


def _left_sorted(probs, top_p):  # the kept values in sorted order, never scattered back to their columns
    s, _ = probs.sort(-1, descending=True)
    kept = s.masked_fill(s.cumsum(-1) - s >= top_p, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _value_threshold(probs, top_p):  # keeps tokens by their own probability, not by the mass above them
    kept = probs * (probs >= (1 - top_p) * probs.max(-1, keepdim=True).values)
    return kept / kept.sum(-1, keepdim=True)


def _renormalized_by_the_whole_tensor(probs, top_p):  # one sum over every row, not each row's own
    s, order = probs.sort(-1, descending=True)
    kept = s.masked_fill(s.cumsum(-1) - s >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum()


def _sorts_in_place(probs, top_p):  # right rows, but the caller's probs is overwritten
    out = given.top_p_filter(probs, top_p)
    probs.copy_(out)
    return out


@pytest.mark.parametrize("fn, diagnosis", [
    (_sorts_in_place, "changed its argument probs in place"),
    (_exclusive, "cause: the token whose probability crosses top_p is dropped"),
    (_not_renormalized, "cause: not renormalized"),
    (_at_most_top_p_above, "cause: a token whose mass above is exactly top_p kept"),
    (_ascending, "cause: sorted ascending"),
    (_left_sorted, "cause: the kept probabilities are left in sorted order"),
    (_value_threshold, "cause: tokens kept by a threshold on their own probability"),
    (_renormalized_by_the_whole_tensor, "cause: renormalized by the whole tensor's sum"),
])
def test_top_p_wrong_variants_rejected(fn, diagnosis):
    verdict = check_top_p(fn)
    assert rejected(verdict, diagnosis), verdict.message


def test_the_top_p_check_has_a_nearly_one_hot_row():
    cases = given.top_p_cases(torch.Generator().manual_seed(0))
    assert any(float(probs.max()) > 0.999 for probs, _ in cases)


# -- exercise 3: speculative acceptance ---------------------------------------------------------


def check_accept(fn):
    return check("ch12.speculative_accept", fn, given.accept_reference, given.accept_cases,
                 diagnose=given.explain_accept)


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


def _residual_not_renormalized(p, q, drafts, u):
    n, _ = given.speculative_accept(p, q, drafts, u)
    if int(n) == drafts.shape[0]:
        return n, p[-1]
    return n, (p[int(n)] - q[int(n)]).clamp_min(0)


def _keeps_going_after_a_rejection(p, q, drafts, u):
    k = drafts.shape[0]
    ratio = p[torch.arange(k), drafts] / q[torch.arange(k), drafts]
    n = int((u < ratio.clamp(max=1.0)).sum())
    if n == k:
        return torch.tensor(n), p[k]
    r = (p[n] - q[n]).clamp_min(0)
    return torch.tensor(n), r / r.sum()


def _ratio_inverted(p, q, drafts, u):  # q / p: keeps what the draft likes more than the target
    k = drafts.shape[0]
    ratio = q[torch.arange(k), drafts] / p[torch.arange(k), drafts]
    n = int((u < ratio.clamp(max=1.0)).long().cumprod(0).sum())
    if n == k:
        return torch.tensor(n), p[k]
    r = (p[n] - q[n]).clamp_min(0)
    return torch.tensor(n), r / r.sum()


def _no_bonus(p, q, drafts, u):
    n, dist = given.speculative_accept(p, q, drafts, u)
    return n, (p[int(n) - 1] if int(n) == drafts.shape[0] else dist)


def _residual_q_minus_p(p, q, drafts, u):
    n, dist = given.speculative_accept(p, q, drafts, u)
    if int(n) == drafts.shape[0]:
        return n, dist
    r = (q[int(n)] - p[int(n)]).clamp_min(0)
    return n, r / r.sum()


def _residual_from_the_row_before(p, q, drafts, u):  # p[n - 1], q[n - 1]: the last kept draft's row
    n, dist = given.speculative_accept(p, q, drafts, u)
    if int(n) == drafts.shape[0]:
        return n, dist
    row = max(int(n) - 1, 0)
    r = (p[row] - q[row]).clamp_min(0)
    return n, r / r.sum()


def _n_as_int32(p, q, drafts, u):
    n, dist = given.speculative_accept(p, q, drafts, u)
    return n.to(torch.int32), dist


def _keeps_at_equality(p, q, drafts, u):  # u <= ratio: a draft kept when u equals p/q exactly
    k = drafts.shape[0]
    ratio = p[torch.arange(k), drafts] / q[torch.arange(k), drafts]
    n = int((u <= ratio.clamp(max=1.0)).long().cumprod(0).sum())
    if n == k:
        return torch.tensor(n), p[k]
    residual = (p[n] - q[n]).clamp_min(0.0)
    return torch.tensor(n), residual / residual.sum()


@pytest.mark.parametrize("fn, diagnosis", [
    (_keeps_at_equality, "cause: a draft kept where u equals p/q exactly"),
    (_residual_is_p, "cause: after a rejection the next token is drawn from p[n] itself"),
    (_unclamped_residual, "cause: p[n] − q[n] not clamped at 0"),
    (_residual_not_renormalized, "cause: max(0, p[n] − q[n]) not renormalized"),
    (_keeps_going_after_a_rejection, "n counts every draft accepted"),  # may be named beside the inverted ratio
    (_ratio_inverted, "the ratio inverted"),  # some inputs fit "n counts every draft" too: both named
    (_no_bonus, "cause: all drafts kept, the next token drawn from p[k − 1]"),
    (_n_as_int32, "wrong dtype: got torch.int32, expected torch.int64"),
    (_residual_q_minus_p, "cause: the residual taken as q[n] − p[n]"),
    (_residual_from_the_row_before, "cause: the residual taken from row n − 1"),
])
def test_accept_wrong_variants_rejected(fn, diagnosis):
    verdict = check_accept(fn)
    assert rejected(verdict, diagnosis), verdict.message


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
    return check("ch12.step_flops", fn, given.flops_reference, given.flops_cases, diagnose=given.explain_flops)


def test_flops_solution_solves():
    assert check_flops(given.step_flops).solved
    # Llama-2-7B-like at 2048 tokens: 6N dominates; attention adds 12 L h s
    assert given.step_flops(6_700_000_000, 32, 4096, 2048, 1) == 6 * 6_700_000_000 + 12 * 32 * 4096 * 2048


def test_every_flops_case_is_an_int_no_float64_holds():
    for case in given.flops_cases(torch.Generator().manual_seed(0)):
        value = given.flops_reference(*case)
        assert value > 2**53 and int(float(value)) != value, case


@pytest.mark.parametrize("fn, diagnosis", [
    (lambda n, l, h, s, t: 6.0 * n * t + 12.0 * l * h * s * t, "expected an exact int, got float"),
    (lambda n, l, h, s, t: int(6.0 * n * t + 12.0 * l * h * s * t),
     "cause: the count was computed in floating point"),
    (lambda n, l, h, s, t: 2 * n * t + 4 * l * h * s * t, "cause: the forward pass only"),
    (lambda n, l, h, s, t: 6 * n * t, "cause: attention's own FLOPs (12·L·h·s per token"),
    (lambda n, l, h, s, t: 6 * n * t + 6 * l * h * s * t, "cause: attention halved for the causal mask"),
    (lambda n, l, h, s, t: 6 * n + 12 * l * h * s, "cause: the FLOPs of one token"),
    (lambda n, l, h, s, t: 6 * n * t + 4 * l * h * s * t, "cause: attention's forward pass only"),
    (lambda n, l, h, s, t: 2 * n * t + 12 * l * h * s * t, "cause: the parameters' forward pass only"),
    (lambda n, l, h, s, t: 6 * n * t + 12 * l * h * s * s * (t // s),
     "cause: attention counted over tokens // seq whole sequences"),
])
def test_flops_wrong_variants_rejected(fn, diagnosis):
    verdict = check_flops(fn)
    assert rejected(verdict, diagnosis), verdict.message
