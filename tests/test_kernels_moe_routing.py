"""kernel_ladder.topk_routing, kernel_ladder.moe_load_balancing_loss, kernel_ladder.moe_permute,
kernel_ladder.moe_gather and kernel_ladder.moe_combine: values and gradients against float64 references,
the stable counting sort against torch.argsort, launches, custom-op plumbing, errors.

Router logits are drawn as distinct values (a random permutation of a grid exact in every dtype),
so that no two experts of a token tie and the chosen ids are unique; outputs are poisoned (NaN).
"""

from __future__ import annotations

import helpers
import pytest
import torch
from helpers import DTYPES

import kernel_ladder
from kernel_ladder.ops import moe_permute as mp
from kernel_ladder.ops import topk_routing as tr

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE


def distinct_logits(n_tokens, n_experts, dtype, gen, transposed=False) -> torch.Tensor:
    """(T, E) logits, each row a random permutation of a grid of step 1/16 in [-4, 4) — exact in
    bf16/fp16 and without ties (E > 128 uses a step of 1/32, still exact)."""
    step = 16 if n_experts <= 128 else 64
    rows = torch.stack([torch.randperm(n_experts, generator=gen) for _ in range(n_tokens)]) if n_tokens else \
        torch.empty(0, n_experts, dtype=torch.int64)
    x = ((rows.double() - n_experts / 2) / step).to(dtype)
    if transposed:
        x = x.t().contiguous().t()
    return x.to(DEVICE)


def reference(x, k, renormalize, scoring):
    """float64 Mixtral/DeepSeek routing with torch ops: (weights, ids), differentiable in x."""
    p = torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


# --------------------------------------------------------------------------- topk_routing

ROUTING_CASES = [(37, 8, 2), (1, 60, 6), (50, 64, 8), (13, 128, 1), (9, 128, 8), (5, 60, 1), (3, 512, 6)]


@pytest.mark.parametrize("scoring, renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                  ("sigmoid", False)])
@pytest.mark.parametrize("T, E, k", ROUTING_CASES, ids=str)
def test_topk_routing_matches_float64_reference(T, E, k, scoring, renormalize, gen):
    x = distinct_logits(T, E, torch.float32, gen, transposed=(T % 2 == 1))
    weights, ids = kernel_ladder.topk_routing(x, k, renormalize, scoring)
    ref_w, ref_ids = reference(x.double(), k, renormalize, scoring)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    helpers.assert_matches(weights, ref_w, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scoring, renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_topk_routing_backward_matches_float64_autograd(scoring, renormalize, dtype, gen):
    T, E, k = 21, 60, 6
    x = distinct_logits(T, E, dtype, gen).requires_grad_()
    dw = helpers.make_input((T, k), torch.float32, "transposed", gen)
    weights, ids = kernel_ladder.topk_routing(x, k, renormalize, scoring)
    (grad,) = torch.autograd.grad(weights, [x], dw)
    leaf = x.detach().double().requires_grad_()
    ref_w, ref_ids = reference(leaf, k, renormalize, scoring)
    (ref_grad,) = torch.autograd.grad(ref_w, [leaf], dw.double())
    assert torch.equal(ids, ref_ids)
    helpers.assert_matches(weights, ref_w, torch.float32)  # computed in fp32 from exact logits
    assert grad.dtype == dtype
    helpers.assert_matches(grad, ref_grad, dtype)


def test_topk_routing_gradcheck_like_small_case(gen):
    """Finite differences of the float64 reference agree with the kernel's analytic gradient."""
    x = distinct_logits(3, 8, torch.float32, gen).requires_grad_()
    dw = torch.randn(3, 2, generator=gen).to(DEVICE)
    for scoring in tr.SCORINGS:
        (grad,) = torch.autograd.grad(kernel_ladder.topk_routing(x, 2, True, scoring)[0], [x], dw)
        leaf = x.detach().double().requires_grad_()
        assert torch.autograd.gradcheck(lambda z: reference(z, 2, True, scoring)[0], (leaf,))
        (ref,) = torch.autograd.grad(reference(leaf, 2, True, scoring)[0], [leaf], dw.double())
        helpers.assert_matches(grad, ref, torch.float32)


def test_topk_routing_matches_mixtral_routing(gen):
    """Mixtral: softmax(dtype=float) -> topk -> divide by the sum -> cast to the hidden dtype."""
    x = distinct_logits(17, 8, torch.bfloat16, gen)
    p = torch.softmax(x, dim=1, dtype=torch.float)
    w, ids = torch.topk(p, 2, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    got_w, got_ids = kernel_ladder.topk_routing(x, 2)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_w.to(torch.bfloat16), w, rtol=0, atol=0)


def test_topk_routing_ties_pick_the_lowest_expert():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], device=DEVICE)
    weights, ids = kernel_ladder.topk_routing(x, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights[1], torch.full((2,), 0.2, device=DEVICE))


def test_topk_routing_empty_and_k_equals_e(gen):
    w, ids = kernel_ladder.topk_routing(torch.empty(0, 8, device=DEVICE), 2)
    assert w.shape == ids.shape == (0, 2)
    x = distinct_logits(4, 6, torch.float32, gen)
    w, ids = kernel_ladder.topk_routing(x, 6)
    assert torch.equal(ids.sort(-1).values, torch.arange(6, device=DEVICE).expand(4, 6))
    helpers.assert_matches(w, torch.softmax(x.double(), -1).sort(-1, descending=True).values, torch.float32)


# --------------------------------------------------------------------------- any logits: ties, NaN, inf

NAN, INF = float("nan"), float("inf")


def cleaned(x: torch.Tensor) -> torch.Tensor:
    """The logits the router ranks: float64, NaN read as -inf."""
    x = x.double()
    return torch.where(torch.isnan(x), -INF, x)


def torch_scores(x: torch.Tensor, scoring: str) -> torch.Tensor:
    return torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)


def check_routing(x: torch.Tensor, k: int, renormalize: bool, scoring: str):
    """Every promise of topk_routing on any logits: ids in [0, E) and distinct per row, in descending
    order of logit with ties to the lowest index (a stable sort of the logits, NaN as -inf); weights
    torch's scores (float64, of the cleaned logits) at those ids — NaN exactly where torch's are —
    and the k largest, as torch.topk gives them."""
    weights, ids = kernel_ladder.topk_routing(x, k, renormalize, scoring)
    n_experts = x.shape[1]
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == weights.shape == (len(x), k)
    ids_cpu = ids.cpu()
    assert bool(((ids_cpu >= 0) & (ids_cpu < n_experts)).all()), ids_cpu
    assert bool((ids_cpu.sort(-1).values.diff(dim=-1) > 0).all()), f"repeated ids {ids_cpu}"
    z = cleaned(x.cpu())
    assert torch.equal(ids_cpu, torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :k])
    p = torch_scores(z, scoring)
    want = p.gather(1, ids_cpu)
    top = torch.topk(p, k, dim=-1).values
    if renormalize:
        want, top = want / want.sum(-1, keepdim=True), top / top.sum(-1, keepdim=True)
    got = weights.double().cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got, top, rtol=1e-5, atol=1e-6, equal_nan=True)
    return weights, ids


def nonfinite_logits(n_experts: int, gen) -> torch.Tensor:
    """One row of each kind of non-finite logits, between finite rows."""
    x = torch.randn(12, n_experts, generator=gen)
    x[1] = NAN  # all NaN: read as all -inf
    x[2, 3] = NAN  # one NaN: that expert is never preferred
    x[3, n_experts - 1] = INF  # one +inf
    x[4, [0, 2]] = INF  # two +inf: they tie
    x[5] = -INF  # all -inf
    x[6, :n_experts // 2] = -INF  # half -inf
    x[7, 0], x[7, 1] = INF, NAN  # +inf and NaN
    x[8, ::2] = NAN  # NaN and -inf mixed, finite between
    x[8, 1::4] = -INF
    x[9, :] = INF  # all +inf
    return x.to(DEVICE)


@pytest.mark.parametrize("scoring, renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                  ("sigmoid", False)])
@pytest.mark.parametrize("E, k", [(8, 2), (6, 1), (6, 6), (60, 5)], ids=str)
def test_nonfinite_logits_give_valid_distinct_ids(E, k, scoring, renormalize, gen):
    """A row of NaN or inf logits still gets k distinct experts in [0, E) (NaN counts as -inf), and its
    weights are torch's on those logits: finite, or NaN where torch's softmax is NaN."""
    x = nonfinite_logits(E, gen)
    weights, _ = check_routing(x, k, renormalize, scoring)
    finite_rows = [0, 2, 6, 8, 10, 11]  # a finite logit is the largest: every softmax weight finite
    assert bool(torch.isfinite(weights[finite_rows]).all())
    if scoring == "sigmoid" and not renormalize:
        assert bool(torch.isfinite(weights).all())  # sigmoid(-inf) = 0, sigmoid(inf) = 1


def test_inf_rows_compared_with_torch_softmax_topk(gen):
    """The choice for a row whose largest logit is +inf, or whose logits are all -inf (or NaN): torch's
    softmax is NaN for every expert, so its top-k weights are NaN and its ids arbitrary. The weights
    here are NaN too (the token's output is NaN, as Hugging Face's block gives, and no other token's),
    and the ids are the +inf experts first, lowest index first, then the rest by logit."""
    x = nonfinite_logits(8, gen)
    weights, ids = kernel_ladder.topk_routing(x, 3)
    their_w, _ = torch.topk(torch.softmax(x.double(), -1), 3, dim=-1)
    for row in (1, 3, 4, 5, 7, 9):
        assert bool(torch.isnan(their_w[row]).all()) and bool(torch.isnan(weights[row]).all()), row
    assert ids[3].tolist()[0] == 7 and ids[4].tolist()[:2] == [0, 2] and ids[7].tolist()[0] == 0
    assert ids[9].tolist() == [0, 1, 2] and ids[5].tolist() == [0, 1, 2] and ids[1].tolist() == [0, 1, 2]
    for row in (0, 2, 6, 8, 10, 11):  # finite where torch's are, and equal to them once NaN is read as -inf
        assert bool(torch.isfinite(weights[row]).all()), row
    ok_rows = [0, 6, 10, 11]  # no NaN logit: torch's own weights, unchanged
    torch.testing.assert_close(weights[ok_rows].double(), their_w[ok_rows] / their_w[ok_rows].sum(-1, keepdim=True),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", tr.SCORINGS)
def test_nonfinite_rows_keep_the_other_rows_gradients(scoring, gen):
    """The backward ranks and scores as the forward does: rows whose weights are finite get the float64
    gradient of the cleaned logits (0 for a NaN logit), whatever the rows beside them hold."""
    x = nonfinite_logits(8, gen).requires_grad_()
    dw = torch.randn(12, 3, generator=gen).to(DEVICE)
    weights, ids = kernel_ladder.topk_routing(x, 3, True, scoring)
    (grad,) = torch.autograd.grad(weights, [x], dw)
    leaf = cleaned(x.detach().cpu()).requires_grad_()
    p = torch_scores(leaf, scoring)
    chosen = p.gather(1, ids.cpu())
    (want,) = torch.autograd.grad(chosen / chosen.sum(-1, keepdim=True), [leaf], dw.double().cpu())
    rows = [r for r in range(12) if bool(torch.isfinite(weights[r]).all())]
    assert {0, 2, 6, 8, 10, 11} <= set(rows)
    torch.testing.assert_close(grad[rows].double().cpu(), want[rows], rtol=1e-5, atol=1e-6)
    assert bool((grad[2, 3] == 0) & (grad[8, ::2] == 0).all())  # NaN logits: no gradient


@pytest.mark.parametrize("scoring", tr.SCORINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_everywhere_pick_the_lowest_experts(dtype, scoring, gen):
    """Logits from five values: most of a row ties. The ids are the stable order, the weights torch's."""
    x = torch.randint(-2, 3, (33, 12), generator=gen).to(dtype).to(DEVICE)
    for k in (1, 3, 12):
        for renormalize in (True, False):
            check_routing(x, k, renormalize, scoring)


@pytest.mark.parametrize("scoring", tr.SCORINGS)
@pytest.mark.parametrize("renormalize", [True, False], ids=lambda r: f"renorm{int(r)}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, E, k", [(33, 8, 2), (7, 6, 1), (16, 6, 6), (19, 60, 4), (5, 257, 8), (3, 1, 1)],
                         ids=str)
def test_random_logits_like_fused_topk_tests(T, E, k, dtype, renormalize, scoring, gen):
    """The cases inference engines' routing tests sweep (tokens, experts not a power of two, k = 1 and
    k = E, renormalize on and off, softmax and sigmoid scoring, low-precision logits with their ties):
    normal logits, compared with torch's softmax/sigmoid + topk."""
    x = (2.0 * torch.randn(T, E, generator=gen)).to(dtype).to(DEVICE)
    check_routing(x, k, renormalize, scoring)


# --------------------------------------------------------------------------- load-balancing loss


@pytest.mark.parametrize("T, E, k", [(37, 8, 2), (20, 60, 4)], ids=str)
def test_load_balancing_loss_matches_transformers(T, E, k, gen):
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    x = distinct_logits(T, E, torch.float32, gen).requires_grad_()
    _, ids = kernel_ladder.topk_routing(x, k)
    loss = kernel_ladder.moe_load_balancing_loss(x, ids, E)
    leaf = x.detach().double().requires_grad_()
    want = modeling.load_balancing_loss_func((leaf,), E, k)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    helpers.assert_matches(loss, want.detach(), torch.float32)
    (grad,) = torch.autograd.grad(loss, [x])
    (ref_grad,) = torch.autograd.grad(want, [leaf])
    helpers.assert_matches(grad, ref_grad, torch.float32)


# --------------------------------------------------------------------------- moe_permute


def check_permute(ids, num_experts):
    perm, offsets = kernel_ladder.moe_permute(ids, num_experts)
    flat = ids.flatten().long()
    assert perm.dtype == torch.int32 and offsets.dtype == torch.int32
    assert torch.equal(perm.long(), torch.argsort(flat, stable=True))
    assert torch.equal(offsets.long(), torch.bincount(flat, minlength=num_experts).cumsum(0))
    return perm, offsets


@pytest.mark.parametrize("segment", [1024, 32], ids=lambda s: f"segment{s}")
@pytest.mark.parametrize("T, k, E", [(37, 2, 8), (100, 6, 60), (50, 8, 128), (1, 1, 4), (77, 1, 64)], ids=str)
def test_moe_permute_is_a_stable_argsort(T, k, E, segment, monkeypatch, gen):
    monkeypatch.setattr(mp, "PERMUTE_SEGMENT", segment)  # 32: many segments, chunks, and the scan's loop
    ids = torch.randint(0, E, (T, k), generator=gen).to(DEVICE)
    check_permute(ids, E)


def test_moe_permute_edge_cases(monkeypatch, gen):
    monkeypatch.setattr(mp, "PERMUTE_SEGMENT", 16)
    check_permute(torch.full((40, 2), 5, dtype=torch.int32, device=DEVICE), 8)  # all to one expert
    ids = torch.randint(0, 3, (30, 4), generator=gen).to(DEVICE) * 3  # experts 1, 2, 4, ... empty
    check_permute(ids, 12)
    check_permute(ids.t().contiguous().t(), 12)  # strided ids
    perm, offsets = check_permute(torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 5)
    assert perm.numel() == 0 and offsets.tolist() == [0] * 5
    check_permute(torch.tensor([[3]], device=DEVICE), 4)  # T = 1


# --------------------------------------------------------------------------- gather / combine


def routed(T, k, E, H, dtype, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEVICE)
    perm, _ = kernel_ladder.moe_permute(ids, E)
    inverse = torch.empty_like(perm)
    inverse[perm.long()] = torch.arange(T * k, dtype=torch.int32, device=DEVICE)
    return ids, perm, inverse.long()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, k, E, H", [(19, 2, 8, 33), (5, 6, 60, 130), (1, 1, 4, 8)], ids=str)
def test_moe_gather_and_combine_match_loops(T, k, E, H, dtype, gen):
    _, perm, inverse = routed(T, k, E, H, dtype, gen)
    x = helpers.make_input((T, H), dtype, "transposed", gen).requires_grad_()
    gathered = kernel_ladder.moe_gather(x, perm, k)
    rows = perm.long() // k
    assert torch.equal(gathered, x[rows])  # an exact copy
    y = helpers.make_input((T * k, H), dtype, "sliced", gen).requires_grad_()
    w = torch.rand((T, k), generator=gen).to(DEVICE).requires_grad_()
    out = kernel_ladder.moe_combine(y, perm, w)
    y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.stack([sum(w64[t, j] * y64[inverse[t * k + j]] for j in range(k)) for t in range(T)])
    helpers.assert_matches(out, want.detach(), dtype)
    dout = helpers.make_input((T, H), dtype, "contiguous", gen)
    grad_y, grad_w = torch.autograd.grad(out, [y, w], dout)
    ref_y, ref_w = torch.autograd.grad(want, [y64, w64], dout.double())
    helpers.assert_matches(grad_y, ref_y, dtype)
    assert grad_w.dtype == torch.float32
    helpers.assert_matches(grad_w, ref_w, torch.float32, rtol=helpers.tolerance(dtype)[0],
                           atol=helpers.tolerance(dtype)[1] * H ** 0.5)
    dg = helpers.make_input((T * k, H), dtype, "contiguous", gen)
    (grad_x,) = torch.autograd.grad(gathered, [x], dg)
    ref_x = torch.zeros(T, H, dtype=torch.float64, device=DEVICE).index_add_(0, rows, dg.double())
    helpers.assert_matches(grad_x, ref_x, dtype)


def test_moe_combine_takes_float64_weights(gen):
    """Float64 routing weights are accepted and used in float32: the same output as the weights rounded
    to float32 first; their gradient comes back in float64."""
    T, k, E, H = 9, 3, 8, 20
    _, perm, _ = routed(T, k, E, H, torch.float32, gen)
    y = torch.randn(T * k, H, generator=gen).to(DEVICE).requires_grad_()
    w64 = torch.rand(T, k, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    w32 = w64.detach().float().requires_grad_()
    out64, out32 = kernel_ladder.moe_combine(y, perm, w64), kernel_ladder.moe_combine(y, perm, w32)
    assert out64.dtype == torch.float32 and torch.equal(out64, out32)
    dout = torch.randn(T, H, generator=gen).to(DEVICE)
    grad_y64, grad_w64 = torch.autograd.grad(out64, [y, w64], dout)
    grad_y32, grad_w32 = torch.autograd.grad(out32, [y, w32], dout)
    assert grad_w64.dtype == torch.float64 and torch.equal(grad_w64, grad_w32.double())
    assert torch.equal(grad_y64, grad_y32)


@pytest.mark.parametrize("scoring", tr.SCORINGS)
def test_topk_routing_takes_float64_logits(scoring, gen):
    """Float64 logits are accepted and routed in float32 (the kernel reads them so): the weights and ids
    of the logits rounded to float32 first; the gradient comes back in float64."""
    x64 = distinct_logits(11, 12, torch.float64, gen).requires_grad_()
    x32 = x64.detach().float().requires_grad_()
    w64, ids64 = kernel_ladder.topk_routing(x64, 3, True, scoring)
    w32, ids32 = kernel_ladder.topk_routing(x32, 3, True, scoring)
    assert w64.dtype == torch.float32 and torch.equal(w64, w32) and torch.equal(ids64, ids32)
    dw = torch.randn(11, 3, generator=gen).to(DEVICE)
    (g64,) = torch.autograd.grad(w64, [x64], dw)
    (g32,) = torch.autograd.grad(w32, [x32], dw)
    assert g64.dtype == torch.float64 and torch.equal(g64, g32.double())


def test_moe_pipeline_round_trip(gen):
    """gather -> identity experts -> combine with weights summing to 1 gives x back."""
    T, E, k, H = 23, 8, 2, 16
    logits = distinct_logits(T, E, torch.float32, gen)
    w, ids = kernel_ladder.topk_routing(logits, k)
    perm, offsets = kernel_ladder.moe_permute(ids, E)
    x = torch.randn(T, H, generator=gen).to(DEVICE)
    out = kernel_ladder.moe_combine(kernel_ladder.moe_gather(x, perm, k), perm, w)
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-5)
    sorted_ids = ids.flatten()[perm.long()]
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
    for e in range(E):
        assert (sorted_ids[starts[e]:offsets[e]] == e).all()


# --------------------------------------------------------------------------- bad permutations

#: (what, T, k, the permutation): none of them a permutation of [0, T * k).
BAD_PERMUTATIONS = {
    "past the end": (4, 2, [0, 1, 2, 8, 4, 5, 6, 7]),
    "negative": (4, 2, [0, 1, -1, 3, 4, 5, 6, 7]),
    "far past the end": (4, 2, [2**31 - 1, 1, 2, 3, 4, 5, 6, 0]),
    "repeated": (4, 2, [0, 5, 2, 3, 4, 5, 6, 7]),  # 1 missing, 5 twice
    "all the same": (3, 3, [4] * 9),
}
BAD_PERMUTATION_MESSAGES = {
    "past the end": r"permutation\[3\] = 8",
    "negative": r"permutation\[2\] = -1",
    "far past the end": r"permutation\[0\] = 2147483647",
    "repeated": r"entry 5 at positions 1 and 5",
    "all the same": r"entry 4 at positions 0 and 1",
}


def _bad_permutation_inputs(what, gen):
    T, k, perm = BAD_PERMUTATIONS[what]
    x = torch.randn(T, 24, generator=gen).to(DEVICE).requires_grad_()
    y = torch.randn(T * k, 24, generator=gen).to(DEVICE).requires_grad_()
    w = torch.rand(T, k, generator=gen).to(DEVICE).requires_grad_()
    return T, k, torch.tensor(perm, dtype=torch.int32, device=DEVICE), x, y, w


def _gather_combine_and_grads(x, y, w, perm, k, gen):
    gathered = kernel_ladder.moe_gather(x, perm, k)
    combined = kernel_ladder.moe_combine(y, perm, w)
    dg = torch.randn(gathered.shape, generator=gen).to(DEVICE)
    dc = torch.randn(combined.shape, generator=gen).to(DEVICE)
    grads = torch.autograd.grad([gathered, combined], [x, y, w], [dg, dc])
    return (gathered, combined, *grads)


@pytest.mark.parametrize("what", sorted(BAD_PERMUTATIONS))
def test_a_bad_permutation_is_refused_when_values_are_checked(what, gen):
    T, k, perm, x, y, w = _bad_permutation_inputs(what, gen)
    message = (rf"permutation must be a permutation of \[0, T \* k\) = \[0, {T * k}\) \(each entry once\); got "
               + BAD_PERMUTATION_MESSAGES[what])
    for checks in (None, True):  # the CPU's default, and asked for
        with kernel_ladder.runtime.check_values(checks):
            if DEVICE.type == "cpu" or checks:
                with pytest.raises(ValueError, match=r"^kernel_ladder\.moe_gather: " + message):
                    kernel_ladder.moe_gather(x, perm, k)
                with pytest.raises(ValueError, match=r"^kernel_ladder\.moe_combine: " + message):
                    kernel_ladder.moe_combine(y, perm, w)


@pytest.mark.parametrize("what", sorted(BAD_PERMUTATIONS))
def test_a_bad_permutation_unchecked_stays_in_bounds_and_is_deterministic(what, gen):
    """Value checks off (a GPU's default): no kernel of the gather, the combine or their backwards
    touches memory outside its tensors, nothing uninitialized is read (buffers are poisoned), and
    the results are the documented ones: an entry outside [0, T * k) gathers a zero row; the combine
    takes each entry from the first position holding it, and nothing for an entry no position holds."""
    from utils.trace import trace

    T, k, perm, x, y, w = _bad_permutation_inputs(what, gen)
    with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True, torch_ops=False) as t:
        first = _gather_combine_and_grads(x, y, w, perm, k, torch.Generator().manual_seed(1))
        second = _gather_combine_and_grads(x, y, w, perm, k, torch.Generator().manual_seed(1))
    assert t.out_of_bounds == 0, [(launch.kernel, launch.out_of_bounds) for launch in t.launches]
    for a, b in zip(first, second):
        assert bool(torch.isfinite(a).all()), "an unwritten or uninitialized value"
        assert torch.equal(a, b)
    n = T * k
    entries = perm.long().cpu()
    valid = (entries >= 0) & (entries < n)
    want_gathered = torch.where(valid[:, None], x.detach().cpu()[entries.clamp(0, n - 1) // k], 0.0)
    assert torch.equal(first[0].cpu(), want_gathered)
    position = {}
    for i, e in enumerate(entries.tolist()):
        position.setdefault(e, i)
    want_combined = torch.zeros(T, 24, dtype=torch.float64)
    for t_ in range(T):
        for j in range(k):
            if t_ * k + j in position:
                want_combined[t_] += w.detach().double().cpu()[t_, j] * y.detach().double().cpu()[position[t_ * k + j]]
    helpers.assert_matches(first[1], want_combined, torch.float32)


@pytest.mark.parametrize("what", sorted(BAD_PERMUTATIONS) + ["a permutation"])
def test_the_tensor_form_of_the_permutation_check_agrees(what, monkeypatch, gen):
    """The check CUDA runs when asked (tensor ops, then one read of the flag) finds what the host form
    finds, with the same message: run here on the CPU by withholding the host form."""
    from kernel_ladder import _validate

    T, k, perm = BAD_PERMUTATIONS.get(what, (3, 2, [5, 0, 3, 1, 4, 2]))
    perm = torch.tensor(perm, dtype=torch.int32, device=DEVICE)
    calls = []

    def tensor_form_only(tensors, ok, message, error=None, *, host_ok=None, device_assert=True):
        calls.append(message)
        return _validate.check_values(tensors, ok, message, error, device_assert=device_assert)

    monkeypatch.setattr(mp, "check_values", tensor_form_only)
    x = torch.randn(T, 8, generator=gen).to(DEVICE)
    if what == "a permutation":
        kernel_ladder.moe_gather(x, perm, k)
    else:
        with pytest.raises(ValueError, match=r"^kernel_ladder\.moe_gather: permutation must be a permutation .*; got "
                                             + BAD_PERMUTATION_MESSAGES[what]):
            kernel_ladder.moe_gather(x, perm, k)
    assert len(calls) == 1


def test_moe_permute_unchecked_clamps_ids_outside_the_experts(gen):
    """With the value checks off, an id outside [0, E) counts as the nearest expert (0 or E - 1): the
    permutation is still a whole permutation, the offsets end at T * k, and nothing is left unwritten."""
    from utils.trace import trace

    ids = torch.tensor([[0, 5], [-3, 2], [9, 1], [4, 2**40]], dtype=torch.int64, device=DEVICE)
    with kernel_ladder.runtime.check_values(False), trace(block_out_of_bounds=True, torch_ops=False) as t:
        perm, offsets = kernel_ladder.moe_permute(ids, 5)
    assert t.out_of_bounds == 0
    clamped = ids.clamp(0, 4)
    assert torch.equal(perm.long(), torch.argsort(clamped.flatten(), stable=True))
    assert torch.equal(offsets.long(), torch.bincount(clamped.flatten(), minlength=5).cumsum(0))


# --------------------------------------------------------------------------- launches


def _count_launches(T, gen):
    from utils.trace import trace

    logits = distinct_logits(T, 8, torch.float32, gen).requires_grad_()
    x = torch.randn(T, 16, generator=gen).to(DEVICE).requires_grad_()
    with trace(torch_ops=False) as t:
        w, ids = kernel_ladder.topk_routing(logits, 2)
        perm, _ = kernel_ladder.moe_permute(ids, 8)
        out = kernel_ladder.moe_combine(kernel_ladder.moe_gather(x, perm, 2), perm, w)
        out.sum().backward()
    assert t.out_of_bounds == 0
    return [launch.kernel for launch in t.launches]


@pytest.mark.interpreter
def test_launch_count_is_small_and_independent_of_tokens(monkeypatch, gen):
    monkeypatch.setattr(mp, "PERMUTE_SEGMENT", 64)  # T = 300 takes several segments
    small, large = _count_launches(5, gen), _count_launches(300, gen)
    assert small == large
    assert len(small) == 13, small  # forward 7 (4 routing + invert), backward 6 (3 inverts)
    assert small[:3] == ["topk_routing_kernel", "moe_histogram_kernel", "moe_scan_kernel"]


# --------------------------------------------------------------------------- custom-op plumbing


def _opcheck_cases(gen):
    x = distinct_logits(7, 60, torch.float32, gen, transposed=True)
    w, ids = kernel_ladder.topk_routing(x, 4)
    perm, _ = kernel_ladder.moe_permute(ids, 60)
    rows = torch.randn(7, 20, generator=gen).to(DEVICE)
    sorted_rows = torch.randn(28, 20, generator=gen).to(DEVICE)
    ops = torch.ops.kernel_ladder
    return {
        "topk_routing": (ops.topk_routing.default, (x, 4, True, "softmax")),
        "topk_routing_sigmoid": (ops.topk_routing.default, (x.bfloat16(), 2, False, "sigmoid")),
        "topk_routing_backward": (ops.topk_routing_backward.default, (w, x, ids, True, "softmax")),
        "moe_permute": (ops.moe_permute.default, (ids, 60)),
        "moe_gather": (ops.moe_gather.default, (rows, perm, 4, None)),
        "moe_gather_weighted": (ops.moe_gather.default, (rows, perm, 4, w)),
        "moe_combine": (ops.moe_combine.default, (sorted_rows, perm, 4, w)),
        "moe_combine_backward": (ops.moe_combine_backward.default, (rows, sorted_rows, perm, 4, torch.float32)),
    }


@pytest.mark.parametrize("case", ["topk_routing", "topk_routing_sigmoid", "topk_routing_backward", "moe_permute",
                                  "moe_gather", "moe_gather_weighted", "moe_combine", "moe_combine_backward"])
def test_opcheck(case, gen):
    op, args = _opcheck_cases(gen)[case]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph_routing_forward_and_backward(gen):
    def fn(logits, x):
        w, ids = kernel_ladder.topk_routing(logits, 2)
        perm, _ = kernel_ladder.moe_permute(ids, 8)
        return kernel_ladder.moe_combine(kernel_ladder.moe_gather(x, perm, 2), perm, w)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    logits = distinct_logits(9, 8, torch.float32, gen).requires_grad_()
    x = torch.randn(9, 16, generator=gen).to(DEVICE).requires_grad_()
    got = compiled(logits, x)
    got_grads = torch.autograd.grad(got.square().sum(), [logits, x])
    want = fn(logits, x)
    want_grads = torch.autograd.grad(want.square().sum(), [logits, x])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- bad input

_L = torch.zeros(4, 8)
_P = torch.zeros(8, dtype=torch.int32)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: kernel_ladder.topk_routing(_L, 9), ValueError, r"^kernel_ladder\.topk_routing: k must be in \[1, min"),
        (lambda: kernel_ladder.topk_routing(_L, 0), ValueError, r"^kernel_ladder\.topk_routing: k must be in"),
        (lambda: kernel_ladder.topk_routing(_L, 2.0), TypeError,
         r"^kernel_ladder\.topk_routing: k must be an int, got float"),
        (lambda: kernel_ladder.topk_routing(torch.zeros(2, 4, 8), 2), ValueError,
         r"^kernel_ladder\.topk_routing: router_logits must be 2-D"),
        (lambda: kernel_ladder.topk_routing(torch.zeros(4, 8, dtype=torch.int64), 2), TypeError,
         r"^kernel_ladder\.topk_routing: router_logits must be float32, float16, bfloat16 or float64, "
         r"got torch\.int64"),
        (lambda: kernel_ladder.topk_routing(_L, 2, scoring="softplus"), ValueError,
         r"^kernel_ladder\.topk_routing: scoring must be 'softmax' or 'sigmoid', got 'softplus'"),
        (lambda: kernel_ladder.topk_routing(_L, 2, renormalize=1), TypeError,
         r"^kernel_ladder\.topk_routing: renormalize must be a bool"),
        (lambda: kernel_ladder.topk_routing([[1.0]], 1), TypeError,
         r"^kernel_ladder\.topk_routing: router_logits must be a torch"),
        (lambda: torch.ops.kernel_ladder.topk_routing(_L, 9, True, "softmax"), ValueError,
         r"^kernel_ladder\.topk_routing: k must be"),
        (lambda: kernel_ladder.moe_permute(torch.zeros(4, 2), 8), TypeError,
         r"^kernel_ladder\.moe_permute: expert_ids must be int32 or int64, got torch\.float32"),
        (lambda: kernel_ladder.moe_permute(torch.zeros(8, dtype=torch.int64), 8), ValueError,
         r"^kernel_ladder\.moe_permute: expert_ids must be 2-D"),
        (lambda: kernel_ladder.moe_permute(torch.zeros(4, 2, dtype=torch.int64), 0), ValueError,
         r"^kernel_ladder\.moe_permute: num_experts must be in \[1, 4096\], got 0"),
        (lambda: kernel_ladder.moe_gather(_L, _P, 3), ValueError,
         r"^kernel_ladder\.moe_gather: permutation must have T \* k = 12 entries, got 8"),
        (lambda: kernel_ladder.moe_gather(_L, _P.long(), 2), TypeError,
         r"^kernel_ladder\.moe_gather: permutation must be int32"),
        (lambda: kernel_ladder.moe_gather(_L, _P, 0), ValueError, r"^kernel_ladder\.moe_gather: top_k must be >= 1"),
        (lambda: kernel_ladder.moe_combine(torch.zeros(8, 8), _P, torch.zeros(3, 2)), ValueError,
         r"^kernel_ladder\.moe_combine: weights must be \(T, k\) = \(4, 2\), got \(3, 2\)"),
        (lambda: kernel_ladder.moe_combine(torch.zeros(8, 8, dtype=torch.int32), _P, torch.zeros(4, 2)), TypeError,
         r"^kernel_ladder\.moe_combine: y_sorted must be float32"),
        (lambda: kernel_ladder.moe_combine(torch.zeros(8, 8), _P, torch.zeros(8)), ValueError,
         r"^kernel_ladder\.moe_combine: weights must be 2-D"),
        (lambda: kernel_ladder.moe_combine(torch.zeros(8, 8), _P, torch.zeros(4, 2, dtype=torch.int64)), TypeError,
         r"^kernel_ladder\.moe_combine: weights must be float32, float16, bfloat16 or float64, got torch\.int64"),
        (lambda: kernel_ladder.moe_combine(torch.zeros(8, 8, dtype=torch.float64), _P, torch.zeros(4, 2)), TypeError,
         r"^kernel_ladder\.moe_combine: y_sorted must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: kernel_ladder.topk_routing(torch.zeros(4, 8, dtype=torch.complex64), 2), TypeError,
         r"^kernel_ladder\.topk_routing: router_logits must be float32, float16, bfloat16 or float64, "
         r"got torch\.complex64"),
        (lambda: kernel_ladder.moe_load_balancing_loss(_L, torch.zeros(4, 2, dtype=torch.int64), 6), ValueError,
         r"^kernel_ladder\.moe_load_balancing_loss: num_experts must equal router_logits\.shape\[1\] = 8"),
        (lambda: kernel_ladder.moe_load_balancing_loss(_L, torch.zeros(4, 2), 8), TypeError,
         r"^kernel_ladder\.moe_load_balancing_loss: expert_ids must be int32 or int64"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()
