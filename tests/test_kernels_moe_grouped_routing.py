"""kernel_ladder.topk_routing with DeepSeek-V3's routing: sigmoid scores, the per-expert correction bias (selection
only), group-limited selection (groups scored by their top-2 sum), the routed scaling factor, with and without
the renormalization — values, ids and gradients against a float64 reference, against Hugging Face's
DeepseekV3TopkRouter, ties, NaN rows, the masking of dropped groups, bad input.

The reference ranks in float32 as Hugging Face does (``sigmoid`` of float32 logits plus a float32 bias) and
computes the weights in float64.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches

import kernel_ladder

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE


def grouped_reference(x, k, renormalize=True, scoring="sigmoid", bias=None, num_groups=None, topk_groups=None,
                      scale=1.0, fill=float("-inf")):
    """DeepSeek-V3's routing in torch ops (transformers' ``DeepseekV3TopkRouter.forward``): (weights, ids), the
    weights differentiable in ``x`` (float64 scores), the choice ranked in float32. ``fill`` is the value dropped
    groups' experts get before the final top-k: ``-inf`` (transformers 5, DeepSeek's own inference code) or
    ``0.0`` (older transformers' DeepseekV3)."""
    T, E = x.shape
    scores = torch.softmax(x.double(), -1) if scoring == "softmax" else torch.sigmoid(x.double())
    choice = (torch.softmax(x.float(), -1) if scoring == "softmax" else torch.sigmoid(x.float())).detach()
    if bias is not None:
        choice = choice + bias.float()
    if num_groups is not None:
        group_scores = choice.view(T, num_groups, E // num_groups).topk(2, dim=-1)[0].sum(-1)
        kept = torch.zeros(T, num_groups, dtype=torch.bool, device=x.device)
        kept.scatter_(1, torch.topk(group_scores, topk_groups, dim=-1)[1], True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // num_groups, dim=1), fill)
    ids = torch.topk(choice, k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids


def logits(gen, T, E, scale=2.0):
    return (scale * torch.randn(T, E, generator=gen)).to(DEVICE)


def bias_for(gen, E, scale=0.3):
    return (scale * torch.randn(E, generator=gen)).to(DEVICE)


# (T, E, num_groups, topk_groups, k): power-of-two and padded groups (3, 5 or 12 experts a group; 3 or 5 groups),
# k = every expert the kept groups hold, one group kept, DeepSeek-V3's 8 groups of 32 with k = 8.
GROUPED_CASES = [(9, 16, 4, 2, 4), (7, 24, 3, 2, 5), (6, 25, 5, 3, 6), (5, 12, 4, 1, 3), (3, 36, 3, 1, 12),
                 (2, 256, 8, 4, 8)]


@pytest.mark.parametrize("renormalize, scale", [(True, 2.5), (False, 1.0), (False, 16.0)],
                         ids=["renorm-scaled", "raw", "raw-scaled"])
@pytest.mark.parametrize("T, E, G, TG, k", GROUPED_CASES, ids=str)
def test_grouped_routing_with_bias_matches_the_reference(T, E, G, TG, k, renormalize, scale, gen):
    x, bias = logits(gen, T, E), bias_for(gen, E)
    weights, ids = kernel_ladder.topk_routing(x, k, renormalize, "sigmoid", bias=bias, num_groups=G,
                                              topk_groups=TG, scale=scale)
    ref_w, ref_ids = grouped_reference(x, k, renormalize, "sigmoid", bias, G, TG, scale)
    assert torch.equal(ids, ref_ids)
    assert_matches(weights, ref_w, torch.float32)
    # Every id lies in a kept group: at most topk_groups distinct groups per token.
    assert int((ids // (E // G)).sort(-1)[0].diff(dim=-1).ne(0).sum(-1).max()) + 1 <= TG


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_bias_without_groups_steers_the_choice_but_not_the_weights(scoring, gen):
    T, E, k = 11, 10, 3
    x = logits(gen, T, E)
    bias = torch.zeros(E, device=DEVICE)
    bias[7] = 5.0  # expert 7 always chosen, first
    weights, ids = kernel_ladder.topk_routing(x, k, False, scoring, bias=bias)
    ref_w, ref_ids = grouped_reference(x, k, False, scoring, bias)
    assert torch.equal(ids, ref_ids) and bool((ids[:, 0] == 7).all())
    scores = torch.softmax(x.double(), -1) if scoring == "softmax" else torch.sigmoid(x.double())
    assert_matches(weights, scores.gather(1, ids), torch.float32)  # the unbiased scores
    assert_matches(weights, ref_w, torch.float32)


def test_groups_without_bias_and_softmax_scoring(gen):
    x = logits(gen, 8, 20)
    for scoring in ("sigmoid", "softmax"):
        weights, ids = kernel_ladder.topk_routing(x, 4, True, scoring, num_groups=4, topk_groups=2)
        ref_w, ref_ids = grouped_reference(x, 4, True, scoring, None, 4, 2)
        assert torch.equal(ids, ref_ids), scoring
        assert_matches(weights, ref_w, torch.float32)


def test_one_group_is_no_limit(gen):
    x, bias = logits(gen, 6, 12), bias_for(gen, 12)
    got = kernel_ladder.topk_routing(x, 4, True, "sigmoid", bias=bias, num_groups=1, topk_groups=1, scale=2.0)
    want = kernel_ladder.topk_routing(x, 4, True, "sigmoid", bias=bias, scale=2.0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_group_score_is_the_top2_sum_not_the_max():
    """Group 0 holds the single best expert (max 0.9 vs 0.8) but group 1 the better pair (1.6 vs 1.0): the top-2
    sum keeps group 1 (a max-scored group limit would keep group 0)."""
    scores = torch.tensor([[0.9, 0.1, 0.1, 0.1, 0.8, 0.8, 0.1, 0.1]], dtype=torch.float64)
    x = torch.logit(scores).float().to(DEVICE)
    _, ids = kernel_ladder.topk_routing(x, 2, True, "sigmoid", num_groups=2, topk_groups=1)
    assert ids.tolist() == [[4, 5]]


def test_dropped_groups_are_never_chosen_where_a_zero_fill_would_choose_them():
    """The one place the two maskings differ: a kept expert whose biased score is negative. A 0.0 fill (older
    transformers' DeepseekV3) lets a dropped group's expert (0.0) outrank it; -inf (transformers 5, DeepSeek's
    inference code, this kernel) keeps the choice inside the kept groups."""
    x = torch.zeros(1, 4, device=DEVICE)  # every score 0.5
    bias = torch.tensor([-0.4, -0.7, -0.8, -0.9], device=DEVICE)  # choice [0.1, -0.2 | -0.3, -0.4]: group 0 kept
    _, ids = kernel_ladder.topk_routing(x, 2, True, "sigmoid", bias=bias, num_groups=2, topk_groups=1)
    assert ids.tolist() == [[0, 1]]
    assert grouped_reference(x, 2, bias=bias, num_groups=2, topk_groups=1)[1].tolist() == [[0, 1]]
    zero_fill = grouped_reference(x, 2, bias=bias, num_groups=2, topk_groups=1, fill=0.0)[1]
    assert zero_fill.tolist() == [[0, 2]]  # expert 2 belongs to the dropped group 1


def test_zero_and_minus_inf_fills_agree_when_biased_scores_are_positive(gen):
    x, bias = logits(gen, 16, 24), bias_for(gen, 24).abs()  # sigmoid > 0, bias >= 0: every choice score > 0
    ours = kernel_ladder.topk_routing(x, 5, True, "sigmoid", bias=bias, num_groups=4, topk_groups=2)[1]
    zero_fill = grouped_reference(x, 5, bias=bias, num_groups=4, topk_groups=2, fill=0.0)[1]
    assert torch.equal(ours, zero_fill)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_grouped_routing_backward_matches_float64_autograd(renormalize, gen):
    T, E, G, TG, k, scale = 13, 24, 4, 2, 5, 2.5
    x, bias = logits(gen, T, E).requires_grad_(), bias_for(gen, E)
    weights, ids = kernel_ladder.topk_routing(x, k, renormalize, "sigmoid", bias=bias, num_groups=G,
                                              topk_groups=TG, scale=scale)
    dw = torch.randn(T, k, generator=gen).to(DEVICE)
    (grad,) = torch.autograd.grad(weights, [x], dw)
    leaf = x.detach().double().requires_grad_()
    ref_w, ref_ids = grouped_reference(leaf, k, renormalize, "sigmoid", bias, G, TG, scale)
    (want,) = torch.autograd.grad(ref_w, [leaf], dw.double())
    assert torch.equal(ids, ref_ids)
    assert_matches(grad, want, torch.float32)
    assert bool((grad.abs().sum(-1) > 0).all())


def test_scale_multiplies_weights_and_gradients(gen):
    x = logits(gen, 5, 8).requires_grad_()
    w1, _ = kernel_ladder.topk_routing(x, 2, True, "sigmoid", scale=1.0)
    w3, _ = kernel_ladder.topk_routing(x, 2, True, "sigmoid", scale=3.0)
    torch.testing.assert_close(w3, 3.0 * w1)
    g = torch.randn(5, 2, generator=gen).to(DEVICE)
    (d1,) = torch.autograd.grad(w1, [x], g)
    (d3,) = torch.autograd.grad(w3, [x], g)
    torch.testing.assert_close(d3, 3.0 * d1)


def test_ties_pick_the_lowest_group_then_the_lowest_expert():
    x = torch.zeros(2, 16, device=DEVICE)  # every score and group score ties
    weights, ids = kernel_ladder.topk_routing(x, 3, True, "sigmoid", bias=torch.zeros(16, device=DEVICE),
                                              num_groups=4, topk_groups=2, scale=2.0)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), 2.0 / 3, device=DEVICE))
    x[1, 8:12] = 1.0  # group 2 best, then groups 0, 1, 3 tie: group 0 kept
    _, ids = kernel_ladder.topk_routing(x, 6, True, "sigmoid", num_groups=4, topk_groups=2)
    assert ids[1].tolist() == [8, 9, 10, 11, 0, 1]


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_a_nan_row_gets_valid_ids_and_spoils_only_itself(renormalize, gen):
    T, E, G, TG, k = 6, 16, 4, 2, 4
    x, bias = logits(gen, T, E), bias_for(gen, E)
    clean = kernel_ladder.topk_routing(x, k, renormalize, "sigmoid", bias=bias, num_groups=G, topk_groups=TG)
    x[2] = float("nan")
    x[4, 3] = float("nan")  # one NaN logit: scored 0, as a -inf logit
    weights, ids = kernel_ladder.topk_routing(x, k, renormalize, "sigmoid", bias=bias, num_groups=G,
                                              topk_groups=TG)
    for t in range(T):
        row = ids[t].tolist()
        assert len(set(row)) == k and all(0 <= e < E for e in row)
        if t not in (2, 4):
            assert torch.equal(ids[t], clean[1][t]) and torch.equal(weights[t], clean[0][t])
    # The NaN row ranks by the bias alone (scores 0): the reference with its logits at -inf.
    x_inf = x.clone()
    x_inf[2] = float("-inf")
    x_inf[4, 3] = float("-inf")
    ref_w, ref_ids = grouped_reference(x_inf, k, renormalize, "sigmoid", bias, G, TG)
    assert torch.equal(ids, ref_ids)
    assert torch.isnan(weights[2]).all() if renormalize else bool((weights[2] == 0).all())
    assert_matches(weights[4], ref_w[4], torch.float32)


def test_empty_batch_and_float64_logits(gen):
    w, i = kernel_ladder.topk_routing(torch.empty(0, 16, device=DEVICE), 2, num_groups=4, topk_groups=2,
                                      scoring="sigmoid")
    assert w.shape == (0, 2) and i.shape == (0, 2)
    x, bias = logits(gen, 4, 16).double(), bias_for(gen, 16).double()
    w, i = kernel_ladder.topk_routing(x, 3, True, "sigmoid", bias=bias, num_groups=4, topk_groups=2)
    ref_w, ref_i = grouped_reference(x.float(), 3, True, "sigmoid", bias.float(), 4, 2)
    assert torch.equal(i, ref_i)
    assert_matches(w, ref_w, torch.float32)


def test_matches_transformers_deepseek_v3_router(gen):
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    for norm in (True, False):
        config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm)
        router = modeling.DeepseekV3TopkRouter(config).to(DEVICE)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.5)
            router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.2)
        hidden = torch.randn(2, 7, 32, generator=gen).to(DEVICE)
        logits_hf, weights_hf, ids_hf = router(hidden)
        weights, ids = kernel_ladder.topk_routing(
            logits_hf, 4, norm, "sigmoid", bias=router.e_score_correction_bias, num_groups=4, topk_groups=2,
            scale=2.5)
        # transformers' top-k is unsorted: compare (id -> weight) per token.
        order_hf, order = ids_hf.argsort(-1), ids.argsort(-1)
        assert torch.equal(ids_hf.gather(1, order_hf), ids.gather(1, order))
        torch.testing.assert_close(weights.gather(1, order), weights_hf.gather(1, order_hf), rtol=1e-5, atol=1e-6)


def test_opcheck_grouped_forward_and_backward(gen):
    from kernel_ladder.ops import topk_routing as tr

    x, bias = logits(gen, 5, 16), bias_for(gen, 16)
    torch.library.opcheck(tr._topk_routing_op, (x, 3, True, "sigmoid", bias, 4, 2, 2.5))
    _, ids = kernel_ladder.topk_routing(x, 3, True, "sigmoid", bias=bias, num_groups=4, topk_groups=2)
    dw = torch.randn(5, 3, generator=gen).to(DEVICE)
    torch.library.opcheck(tr._topk_routing_backward_op, (dw, x, ids, True, "sigmoid", 2.5))


def test_torch_compile_fullgraph_grouped(gen):
    x, bias = logits(gen, 6, 16).requires_grad_(), bias_for(gen, 16)

    def route(x):
        return kernel_ladder.topk_routing(x, 4, True, "sigmoid", bias=bias, num_groups=4, topk_groups=2, scale=2.5)

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    (w, i), (w_e, i_e) = compiled(x), route(x)
    assert torch.equal(i, i_e) and torch.equal(w, w_e)
    g = torch.randn(6, 4, generator=gen).to(DEVICE)
    assert torch.equal(torch.autograd.grad(w, [x], g)[0], torch.autograd.grad(w_e, [x], g)[0])


def _call(**over):
    args = {"router_logits": torch.zeros(3, 16, device=DEVICE), "k": 4, "scoring": "sigmoid",
            "bias": torch.zeros(16, device=DEVICE), "num_groups": 4, "topk_groups": 2}
    args.update(over)
    return kernel_ladder.topk_routing(**args)


@pytest.mark.parametrize("over, error, message", [
    ({"num_groups": 5}, ValueError, r"num_groups must divide the number of experts E = 16.*got 5"),
    ({"num_groups": 4, "topk_groups": 1, "k": 5}, ValueError,
     r"topk_groups \* group size must be at least k = 5: 1 groups of 4 experts hold only 4"),
    ({"num_groups": 16, "topk_groups": 8}, ValueError, "each group needs at least 2 experts"),
    ({"topk_groups": 5}, ValueError, r"topk_groups must be in \[1, num_groups = 4\], got 5"),
    ({"topk_groups": 0}, ValueError, "topk_groups must be in"),
    ({"topk_groups": None}, ValueError, "num_groups and topk_groups go together"),
    ({"num_groups": None}, ValueError, "num_groups and topk_groups go together"),
    ({"num_groups": 4.0}, TypeError, "num_groups must be an int, got float"),
    ({"bias": torch.zeros(8)}, ValueError, r"bias must be \(E,\) = \(16,\).*got shape \(8,\)"),
    ({"bias": torch.zeros(16, dtype=torch.int32)}, TypeError, "bias must be float32"),
    ({"bias": [0.0] * 16}, TypeError, "bias"),
    ({"scale": "2.5"}, TypeError, "scale must be a float"),
])
def test_bad_group_arguments_raise_clear_errors(over, error, message):
    with pytest.raises(error, match=r"kernel_ladder\.topk_routing: " + message):
        _call(**over)
