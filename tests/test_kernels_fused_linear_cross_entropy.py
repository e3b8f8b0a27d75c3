"""kernel_ladder.fused_linear_cross_entropy: loss and gradients against float64 torch for every reduction and
option, chunk sizes, shapes, dtypes, memory (never the N x V logits), custom-op plumbing, errors.

Every buffer the op allocates is poisoned (NaN) first; inputs are fresh random draws.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches, random_targets

import kernel_ladder
from kernel_ladder.ops import fused_linear_cross_entropy as flce
from utils.memory import peak_memory

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "softcap + z-loss": {"softcap": 5.0, "z_loss": 1e-2},
    "all": {"label_smoothing": 0.2, "softcap": 3.0, "z_loss": 1e-3},
}


def rand(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def targets(shape, vocab, gen, ignore_fraction=0.2):
    return random_targets(shape, vocab, gen, ignore_fraction)


def reference(x, weight, target, bias=None, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0,
              ce_weight=None, return_z_loss=False):
    """torch in float64: the logits, soft-capped, cross-entropy (class-weighted as torch's ``weight``), plus
    z_loss * lse**2 of the non-ignored rows reduced like it, unweighted ("mean": over their count, as
    Liger-Kernel's z-loss); with return_z_loss also that term alone."""
    z = F.linear(x, weight, bias).flatten(0, -2)
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, reduction=reduction, label_smoothing=label_smoothing,
                           weight=None if ce_weight is None else ce_weight.to(z.dtype))
    valid = t != -100
    term = z_loss * torch.logsumexp(z, -1) ** 2 * valid
    z_term = {"mean": term.sum() / valid.sum(), "sum": term.sum(), "none": term}[reduction]
    loss = loss + z_term
    if reduction == "none":
        loss, z_term = loss.reshape(target.shape), z_term.reshape(target.shape)
    return (loss, z_term) if return_z_loss else loss


def grads_of(fn, inputs, grad_out):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    g = grad_out if grad_out is not None else torch.ones_like(out)
    return out, torch.autograd.grad(out, leaves, g)


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_and_gradients_match_float64(reduction, options, gen):
    x, weight, bias = rand(37, 48, gen=gen), rand(301, 48, gen=gen, scale=0.2), rand(301, gen=gen)
    target = targets((37,), 301, gen)
    kwargs = OPTIONS[options]
    g = rand(37, gen=gen) if reduction == "none" else rand(gen=gen)
    loss, grads = grads_of(lambda a, w, b: kernel_ladder.fused_linear_cross_entropy(
        a, w, target, b, reduction=reduction, chunk_size=8, **kwargs), [x, weight, bias], g)
    want, want_grads = grads_of(lambda a, w, b: reference(a, w, target, b, reduction, **kwargs),
                                [x.double(), weight.double(), bias.double()], g.double())
    assert_matches(loss, want, torch.float32, slack=2.0, what="loss")
    for name, got, expected in zip(("grad_x", "grad_weight", "grad_bias"), grads, want_grads):
        assert_matches(got, expected, torch.float32, slack=4.0, what=name)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, None])
def test_every_chunk_size_gives_the_same_answer(chunk_size, gen):
    x, weight = rand(2, 9, 32, gen=gen), rand(130, 32, gen=gen, scale=0.3)
    target = targets((2, 9), 130, gen)
    loss, grads = grads_of(lambda a, w: kernel_ladder.fused_linear_cross_entropy(a, w, target, chunk_size=chunk_size),
                           [x, weight], None)
    want, want_grads = grads_of(lambda a, w: reference(a, w, target), [x.double(), weight.double()], None)
    assert_matches(loss, want, torch.float32, slack=2.0)
    for got, expected in zip(grads, want_grads):
        assert_matches(got, expected, torch.float32, slack=4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_within_twice_torchs_own_error(dtype, gen):
    x, weight = rand(24, 64, gen=gen, dtype=dtype), rand(257, 64, gen=gen, dtype=dtype, scale=0.2)
    target = targets((24,), 257, gen)
    loss, grads = grads_of(lambda a, w: kernel_ladder.fused_linear_cross_entropy(a, w, target, chunk_size=8),
                           [x, weight], None)
    lowp, lowp_grads = grads_of(lambda a, w: F.cross_entropy(F.linear(a, w), target), [x, weight], None)
    want, want_grads = grads_of(lambda a, w: reference(a, w, target), [x.double(), weight.double()], None)
    assert loss.dtype == torch.float32 and grads[1].dtype == dtype  # the loss in float32 whatever x's dtype
    # The loss against torch's from logits made in the low precision and upcast (HF's recipe), float32 too.
    upcast = F.cross_entropy(F.linear(x, weight).float(), target)
    assert_matches(loss, want, torch.float32, lowp=upcast, slack=2.0)
    for got, expected, theirs in zip(grads, want_grads, lowp_grads):
        assert_matches(got, expected, dtype, lowp=theirs, slack=2.0)


def test_all_ignored_gives_nan_mean_and_zero_gradients(gen):
    x, weight = rand(6, 16, gen=gen).requires_grad_(), rand(20, 16, gen=gen)
    target = torch.full((6,), -100, device=DEVICE)
    loss = kernel_ladder.fused_linear_cross_entropy(x, weight, target)
    assert loss.isnan()
    assert kernel_ladder.fused_linear_cross_entropy(x, weight, target, reduction="sum").item() == 0.0
    (grad,) = torch.autograd.grad(kernel_ladder.fused_linear_cross_entropy(x, weight, target, reduction="sum"), x)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_int32_targets_and_a_row_sliced_x(gen):
    base = rand(10, 2, 24, gen=gen)
    x = base[:, 0]  # rows 48 elements apart: one run of rows, read in place
    weight = rand(40, 24, gen=gen)
    target = targets((10,), 40, gen).to(torch.int32)
    assert_matches(kernel_ladder.fused_linear_cross_entropy(x, weight, target),
                   reference(x.double(), weight.double(), target.long()), torch.float32, slack=2.0)


# ----------------------------------------------------------------------------- class weights, the z-loss term


WEIGHTED = {
    "weights": {"z_loss": 2e-2},
    "weights + smoothing": {"label_smoothing": 0.1, "z_loss": 2e-2},
    "all": OPTIONS["all"],
}


@pytest.mark.parametrize("options", list(WEIGHTED))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_and_the_z_loss_term_match_float64(reduction, options, gen):
    """ce_weight is torch's cross_entropy weight (the weighted mean divides by the non-ignored targets' weights);
    return_z_loss returns z_loss * lse**2 reduced like the loss, its mean over the non-ignored rows (Liger-Kernel's
    definition). Loss, term and the three gradients against float64."""
    x, weight, bias = rand(29, 40, gen=gen), rand(203, 40, gen=gen, scale=0.2), rand(203, gen=gen)
    target = targets((29,), 203, gen)
    kwargs = WEIGHTED[options]
    ce_weight = rand(203, gen=gen).abs() + 0.1
    # the class of the row with the largest loss weighs 10x more: a weighted mean far from the plain one
    rows = reference(x.double(), weight.double(), target, bias.double(), "none", **kwargs)
    ce_weight[target[rows.argmax()]] *= 10
    g = rand(29, gen=gen) if reduction == "none" else rand(gen=gen)
    terms = {}

    def ours(a, w, b):
        loss, terms["ours"] = kernel_ladder.fused_linear_cross_entropy(
            a, w, target, b, reduction=reduction, chunk_size=8, ce_weight=ce_weight, return_z_loss=True, **kwargs)
        return loss

    def theirs(a, w, b):
        loss, terms["theirs"] = reference(a, w, target, b, reduction, ce_weight=ce_weight, return_z_loss=True,
                                          **kwargs)
        return loss

    loss, grads = grads_of(ours, [x, weight, bias], g)
    want, want_grads = grads_of(theirs, [x.double(), weight.double(), bias.double()], g.double())
    assert_matches(loss, want, torch.float32, slack=2.0, what="loss")
    assert_matches(terms["ours"], terms["theirs"].detach(), torch.float32, slack=2.0, what="z-loss term")
    assert terms["ours"].dtype == torch.float32 and not terms["ours"].requires_grad  # for logging
    for name, got, expected in zip(("grad_x", "grad_weight", "grad_bias"), grads, want_grads):
        assert_matches(got, expected, torch.float32, slack=4.0, what=name)
    # the control: the weights change this loss (a kernel that ignored them would fail above)
    unweighted = reference(x.double(), weight.double(), target, bias.double(), reduction, **kwargs)
    assert (unweighted - want).abs().max() > 1e-3 * want.abs().max(), (unweighted, want)


def test_all_ignored_with_class_weights_gives_no_nan_gradient(gen):
    """Nothing to average: "mean" is NaN as torch's (0 / 0, and transformers' loss likewise), the z-loss term
    too; "sum" and "none" are 0; the gradients are zeros, never NaN."""
    x, weight = rand(6, 16, gen=gen), rand(20, 16, gen=gen)
    ce_weight = rand(20, gen=gen).abs()
    target = torch.full((6,), -100, device=DEVICE)
    want = F.cross_entropy(F.linear(x, weight), target, weight=ce_weight)
    assert want.isnan()
    for reduction in ("mean", "sum", "none"):
        xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, term = kernel_ladder.fused_linear_cross_entropy(xg, wg, target, reduction=reduction, ce_weight=ce_weight,
                                                              z_loss=1e-2, return_z_loss=True)
        if reduction == "mean":
            assert loss.isnan() and term.isnan()
        else:
            assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(term, torch.zeros_like(term))
        loss.sum().backward() if reduction == "none" else loss.backward()
        for grad in (xg.grad, wg.grad):
            assert torch.equal(grad, torch.zeros_like(grad)), reduction


def test_huge_logits_stay_finite_and_accurate(gen):
    """Logits of order 1e4 (a diverging model): the online log-sum-exp never overflows; the loss, the z-loss term
    (lse**2 ~ 1e8) and the gradients within twice torch's own float32 error of float64."""
    x, weight = rand(12, 32, gen=gen, scale=100.0), rand(70, 32, gen=gen, scale=30.0)
    ce_weight = rand(70, gen=gen).abs() + 0.1
    target = targets((12,), 70, gen)
    kw = dict(ce_weight=ce_weight, z_loss=1e-4)
    xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, term = kernel_ladder.fused_linear_cross_entropy(xg, wg, target, chunk_size=4, return_z_loss=True, **kw)
    loss.backward()
    assert F.linear(x, weight).abs().max() > 5e3
    want, want_term = reference(x.double(), weight.double(), target, return_z_loss=True, **kw)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    reference(x64, w64, target, **kw).backward()
    x32, w32 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    theirs = reference(x32, w32, target, **kw)  # torch in float32: the error to stay within twice of
    theirs.backward()
    assert torch.isfinite(loss) and torch.isfinite(term)
    assert_matches(loss, want, torch.float32, lowp=theirs.detach(), slack=2.0, what="loss")
    assert_matches(term, want_term, torch.float32, slack=2.0, what="z-loss term")
    for name, got, expected, lowp in (("grad_x", xg.grad, x64.grad, x32.grad), ("grad_weight", wg.grad, w64.grad,
                                                                                w32.grad)):
        assert torch.isfinite(got).all(), name
        assert_matches(got, expected, torch.float32, lowp=lowp, slack=2.0, what=name)


# ----------------------------------------------------------------------------- memory


def test_peak_memory_is_a_chunk_of_logits_not_all_of_them(gen):
    """The extra memory of forward + backward stays within one (chunk, V) buffer, the fp32 weight
    gradient and the gradients themselves; torch's F.cross_entropy(F.linear(x, W).float()) holds
    several (N, V) tensors: at least five times more here."""
    n, hidden, vocab, chunk = 256, 32, 1024, 16
    x = rand(n, hidden, gen=gen, dtype=torch.bfloat16).requires_grad_()
    weight = rand(vocab, hidden, gen=gen, dtype=torch.bfloat16, scale=0.2).requires_grad_()
    target = targets((n,), vocab, gen)

    def ours():
        kernel_ladder.fused_linear_cross_entropy(x, weight, target, chunk_size=chunk).backward()

    def theirs():
        F.cross_entropy(F.linear(x, weight).float(), target).backward()

    peaks = {}
    for name, step in (("ours", ours), ("torch", theirs)):
        x.grad = weight.grad = None
        with peak_memory() as peak:
            step()
        peaks[name] = peak.peak_bytes
    element = x.element_size()
    bound = (chunk * vocab * element + n * 4 + vocab * hidden * (4 + element) + n * hidden * element
             + 64 * 1024)  # the chunk, the row losses, the fp32 and final weight gradient, grad_x, scalars
    assert peaks["ours"] <= bound, (peaks, bound)
    assert peaks["ours"] * 5 <= peaks["torch"], peaks
    assert peaks["torch"] > n * vocab * 4  # the logits in fp32, at least once


def test_chunk_rows_rule():
    # Llama-3-8B's head: grad_W's traffic share (8 / 6) * 184 / chunk <= 1/8 takes 2048 rows (Liger's rule: 256)
    assert flce.chunk_rows(8192, 128256, 4096) == 2048
    assert (8 / 6) * flce.MACHINE_BALANCE / 2048 <= flce.GRAD_W_TRAFFIC_SHARE < (8 / 6) * flce.MACHINE_BALANCE / 1024
    assert flce.chunk_rows(8192, 128256, 4096, element_size=4) == 2048  # fp32 logits: the budget's 2 H / 4 rows
    assert flce.chunk_rows(8192, 151936, 896) == 512  # a small head: the budget, 2 * 896 / 2 -> 512 rows
    assert flce.chunk_rows(8192, 151936, 896) * 151936 * 2 <= flce.LOGITS_BUDGET_SHARE * 151936 * 896 * 4
    assert flce.chunk_rows(4096, 128256, 512) == 512  # was 64 (16 by Liger's rule, a tile's 64 at least)
    assert flce.chunk_rows(4096, 128256, 16) == 64  # a tiny head: the budget's 16 rows, a tile's 64 at least
    assert flce.chunk_rows(262144, 32000, 4096) == 32768  # Liger's rule asks more than the traffic: never below it
    assert flce.chunk_rows(10, 100, 1000) == 10  # at most the batch: one chunk
    assert flce.chunk_rows(1500, 128256, 4096) == 1500
    assert flce.chunk_rows(0, 10, 10) == 1


# ----------------------------------------------------------------------------- the launch plan and its model

# (rows, vocab, hidden, dtype, bias, reduction, chunk_size, grad): several chunks with a short last one; a bias
# (its GEMM reads a broadcast row of ones); "sum"; no gradient; a vocabulary past the interpreter's one-block row
# (the cross-entropy reads each row twice); fp16's casts of the fp32 gradients.
PLAN_CASES = [
    (70, 300, 40, torch.float32, False, "mean", 32, True),
    (70, 300, 40, torch.bfloat16, True, "sum", 32, True),
    (45, 130, 24, torch.float16, True, "mean", None, True),
    (45, 130, 24, torch.float32, False, "mean", 16, False),
    (33, 20000, 24, torch.float32, False, "mean", None, True),
]


def _traced_and_planned(rows, vocab, hidden, dtype, bias, reduction, chunk_size, grad, gen):
    from utils.trace import trace

    x = rand(rows, hidden, gen=gen, dtype=dtype).requires_grad_(grad)
    weight = rand(vocab, hidden, gen=gen, dtype=dtype, scale=0.3).requires_grad_(grad)
    b = rand(vocab, gen=gen, dtype=dtype).requires_grad_(grad) if bias else None
    target = targets((rows,), vocab, gen, ignore_fraction=0.0)  # the plan counts every row as a class
    with trace() as t:
        kernel_ladder.fused_linear_cross_entropy(x, weight, target, bias=b, reduction=reduction, chunk_size=chunk_size)
    plan = flce.launch_plan(rows, vocab, hidden, dtype, chunk_size=chunk_size, bias=bias, reduction=reduction,
                            compute_grad=grad)
    return t, plan


@pytest.mark.interpreter
@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: f"{c[0]}x{c[2]}->{c[1]} {c[3]} bias={c[4]} {c[5]} "
                                                             f"chunk={c[6]} grad={c[7]}")
def test_launch_plan_counts_what_the_tracer_counts(case, gen):
    """The plan, computed from the sizes alone, lists the op's launches in order with the bytes and FLOPs the
    tracer counts for them, exactly: what makes its figures at a GPU's sizes counts rather than guesses."""
    t, plan = _traced_and_planned(*case, gen)
    traced = [(x.kernel, x.programs, x.bytes, x.flops) for x in t.launches]
    assert traced == [(p.kernel, p.programs, p.bytes, p.flops) for p in plan if p.programs]
    torch_ops = sorted((op.name, op.bytes) for op in t.torch_ops if op.launches)
    assert torch_ops == sorted((p.kernel, p.bytes) for p in plan if not p.programs)
    assert t.bytes == sum(p.bytes for p in plan) and t.flops == sum(p.flops for p in plan)
    # the DRAM model counts each element once: never more than the lanes move, at least the operands once
    assert all(p.dram_bytes <= p.bytes for p in plan)


@pytest.mark.interpreter
def test_launch_plan_counts_a_split_k_grad_x_too(gen, monkeypatch):
    """With the short-M, long-K rule forced (each split keeps >= 64 of K), the 80-row chunks' grad_x GEMMs run
    split-K on the interpreter's 4 SMs: the plan has the partials' kernel and their reduction, as traced."""
    from kernel_ladder.ops import matmul as mm

    monkeypatch.setattr(mm, "SPLIT_K_WIDE_MIN_K_PER_SPLIT", 64)
    t, plan = _traced_and_planned(150, 300, 40, torch.float32, True, "mean", 80, True, gen)
    kernels = [x.kernel for x in t.launches]
    assert kernels.count("matmul_split_k_kernel") == kernels.count("matmul_split_k_reduce_kernel") == 2
    assert [(x.kernel, x.programs, x.bytes, x.flops) for x in t.launches] == [
        (p.kernel, p.programs, p.bytes, p.flops) for p in plan if p.programs]


H200_SIZES = (8192, 128256, 4096)  # Llama-3-8B's head at 8k tokens


def _h200(**kwargs):
    return flce.launch_plan(*H200_SIZES, torch.bfloat16, interpreter=False, num_sms=132, **kwargs)


def _total(plan, step=None, field="dram_bytes"):
    return sum(getattr(p, field) for p in plan if step is None or p.step == step)


def _model(plan, **kwargs):
    return sum(flce.modelled_seconds(p, **kwargs) for p in plan)


def test_h200_model_before_and_after_the_chunk_rule(monkeypatch):
    """At V = 128,256, H = 4096, N = 8192 (bf16, an H200, the model's 790 TFLOP/s and 4.3 TB/s): Liger's 256-row
    chunks without a split grad_x (the old rule) model at about twice the FLOP floor; the default chunk within
    1.25 times it."""
    from kernel_ladder.ops import matmul as mm

    n, vocab, hidden = H200_SIZES
    floor = flce.flop_floor_seconds(n, vocab, hidden)
    assert floor == pytest.approx(6 * n * vocab * hidden / 790e12) and 32.6e-3 < floor < 32.8e-3
    grad_w = vocab * hidden * 4  # the fp32 accumulator: written by the first chunk, read and written by the others

    with monkeypatch.context() as m:
        m.setattr(mm, "SPLIT_K_WIDE_MIN_K_PER_SPLIT", 10**12)  # the old rule: no split-K above 64 rows
        before = _h200(chunk_size=256)
    chunks = n // 256
    assert _total(before, "grad_W GEMM") == (2 * chunks - 1) * grad_w + chunks * (256 * vocab + 256 * hidden) * 2
    (grad_x,) = {(p.kernel, p.programs) for p in before if p.step == "grad_x GEMM"}
    assert grad_x == ("matmul_kernel", 64)  # 64 of 132 SMs, each walking all of K
    assert _model(before) > 1.9 * floor

    after = _h200()
    chunks = n // flce.chunk_rows(n, vocab, hidden)
    assert chunks == 4
    assert _total(after, "grad_W GEMM") == (2 * chunks - 1) * grad_w + chunks * (2048 * vocab + 2048 * hidden) * 2
    assert _total(after, field="flops") == _total(before, field="flops") == 6 * n * vocab * hidden  # no padding
    assert _model(after) <= 1.25 * floor
    assert _model(after, overlap=False) <= 1.3 * floor  # even with no overlap of bytes and FLOPs at all


def test_h200_model_split_k_halves_a_short_chunks_grad_x():
    """Forced to 256-row chunks, the grad_x GEMM (M = 256, N = 4096, K = 128,256) runs split-K in two: 128 of
    132 SMs busy instead of 64, at the cost of its fp32 partials (2 x 256 x 4096 x 4 bytes each way)."""
    plan = _h200(chunk_size=256)
    grad_x = [p for p in plan if p.step == "grad_x GEMM" and p.chunk == 0]
    assert [(p.kernel, p.programs) for p in grad_x] == [("matmul_split_k_kernel", 128),
                                                        ("matmul_split_k_reduce_kernel", 1024)]
    one_wave = 2 * 128 * 128 * 128256 / 2 / (790e12 / 132)  # a 128 x 128 tile over half of K
    assert flce.modelled_seconds(grad_x[0]) == pytest.approx(one_wave)
    assert grad_x[1].bytes == 2 * 256 * 4096 * 4 + 256 * 4096 * 2


def test_modelled_seconds_quantizes_waves_and_takes_the_larger_bound():
    machine = flce.Machine("test", sms=4, flops_per_s=4e12, bytes_per_s=1e12)
    launch = flce.PlannedLaunch("x", "k", programs=5, flops=5 * 10**9, bytes=0, dram_bytes=10**9)
    assert flce.modelled_seconds(launch, machine) == pytest.approx(2 * 1e-3)  # 2 waves of 1 ms > 1 ms of bytes
    assert flce.modelled_seconds(launch, machine, overlap=False) == pytest.approx(3e-3)
    memory_bound = flce.PlannedLaunch("x", "k", programs=4, flops=4 * 10**9, bytes=0, dram_bytes=5 * 10**9)
    assert flce.modelled_seconds(memory_bound, machine) == pytest.approx(5e-3)


def test_launch_plan_bad_input():
    with pytest.raises(ValueError, match=r"kernel_ladder.fused_linear_cross_entropy: launch_plan needs n_rows"):
        flce.launch_plan(0, 10, 10)
    with pytest.raises(ValueError, match=r"launch_plan plans reduction 'mean' or 'sum', got 'none'"):
        flce.launch_plan(4, 10, 10, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_grad_x_gives_the_same_answer(dtype, gen, monkeypatch):
    """The short-M, long-K split forced onto the grad_x GEMM (two 70-row chunks): loss and gradients still match
    float64."""
    from kernel_ladder.ops import matmul as mm

    monkeypatch.setattr(mm, "SPLIT_K_WIDE_MIN_K_PER_SPLIT", 64)
    assert mm.plan_matmul(70, 24, 260, dtype).method == "split_k"
    x, weight = rand(140, 24, gen=gen, dtype=dtype), rand(260, 24, gen=gen, dtype=dtype, scale=0.3)
    target = targets((140,), 260, gen)
    loss, grads = grads_of(lambda a, w: kernel_ladder.fused_linear_cross_entropy(a, w, target, chunk_size=70),
                           [x, weight], None)
    want, want_grads = grads_of(lambda a, w: reference(a, w, target), [x.double(), weight.double()], None)
    _, lowp_grads = grads_of(lambda a, w: F.cross_entropy(F.linear(a, w), target), [x, weight], None)
    assert_matches(loss, want, torch.float32, lowp=F.cross_entropy(F.linear(x, weight).float(), target), slack=2.0)
    for got, expected, theirs in zip(grads, want_grads, lowp_grads):
        assert_matches(got, expected, dtype, lowp=theirs, slack=2.0)


# ----------------------------------------------------------------------------- plumbing


def test_opcheck_and_torch_compile(gen):
    x, weight, bias = rand(6, 16, gen=gen), rand(30, 16, gen=gen), rand(30, gen=gen)
    target = targets((6,), 30, gen)
    for reduction, compute_grad in (("mean", True), ("none", False), ("sum", True)):
        for ce_weight, return_z in ((None, False), (rand(30, gen=gen).abs(), True)):
            torch.library.opcheck(torch.ops.kernel_ladder.fused_linear_cross_entropy.default,
                                  (x, weight, target, bias, ce_weight, -100, reduction, 0.1, 4.0, 1e-3, return_z, 4,
                                   compute_grad))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, w: kernel_ladder.fused_linear_cross_entropy(a, w, target, chunk_size=4),
                             fullgraph=True)
    xg = x.clone().requires_grad_()
    loss = compiled(xg, weight)
    loss.backward()
    want, (want_grad,) = grads_of(lambda a: reference(a, weight.double(), target), [x.double()], None)
    assert_matches(loss, want, torch.float32, slack=2.0)
    assert_matches(xg.grad, want_grad, torch.float32, slack=4.0)


def test_double_backward_and_second_backward_are_refused_clearly(gen):
    x, weight = rand(5, 16, gen=gen).requires_grad_(), rand(30, 16, gen=gen)
    target = targets((5,), 30, gen)
    (g,) = torch.autograd.grad(kernel_ladder.fused_linear_cross_entropy(x, weight, target), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.fused_linear_cross_entropy \(backward\): double backward"):
        g.pow(2).sum().backward()
    loss = kernel_ladder.fused_linear_cross_entropy(x, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward through the same loss twice"):
        loss.backward()


def test_bad_input_errors(gen):
    x, weight = rand(5, 16, gen=gen), rand(30, 16, gen=gen)
    target = targets((5,), 30, gen)
    op = kernel_ladder.fused_linear_cross_entropy
    cases = [
        (lambda: op(x, weight[:, :8], target), ValueError,
         r"weight must be the LM head's \(vocab, hidden\) = \(V, 16\)"),
        (lambda: op(x, weight, target[:4]), ValueError, r"target must have x's leading shape \(5,\)"),
        (lambda: op(x, weight, target.float()), TypeError, r"target must be int64"),
        (lambda: op(x, weight.half(), target), TypeError, r"x and weight must have the same dtype"),
        (lambda: op(x, weight, target, bias=weight[:, 0][:7]), ValueError, r"bias must be \(vocab,\) = \(30,\)"),
        (lambda: op(x, weight, target, reduction="avg"), ValueError, r"reduction must be 'mean', 'sum' or 'none'"),
        (lambda: op(x, weight, target, softcap=0.0), ValueError, r"softcap must be a positive, finite float"),
        (lambda: op(x, weight, target, chunk_size=0), ValueError, r"chunk_size must be None"),
        (lambda: op(x, weight, torch.full((5,), 30, device=DEVICE)), ValueError, r"class indices in \[0, 30\)"),
        (lambda: op(rand(4, 3, 16, gen=gen).transpose(0, 1), weight, targets((3, 4), 30, gen)), ValueError,
         r"cannot be walked as one run of rows without a copy"),
        (lambda: op(x, weight, target, ce_weight=rand(29, gen=gen)), ValueError,
         r"ce_weight must hold one weight per class, shape \(vocab,\) = \(30,\), got \(29,\)"),
        (lambda: op(x, weight, target, ce_weight=rand(30, 1, gen=gen)), ValueError,
         r"ce_weight must hold one weight per class, shape \(vocab,\) = \(30,\), got \(30, 1\)"),
        (lambda: op(x, weight, target, ce_weight=torch.ones(30, dtype=torch.int64, device=DEVICE)), TypeError,
         r"ce_weight must be float32, float16 or bfloat16, got torch.int64"),
        (lambda: op(x, weight, target, ce_weight=[1.0] * 30), TypeError, r"ce_weight must be a torch.Tensor"),
        (lambda: op(x, weight, target, ce_weight=rand(30, gen=gen).requires_grad_()), ValueError,
         r"ce_weight is not differentiable"),
        (lambda: op(x, weight, target, return_z_loss=1), TypeError, r"return_z_loss must be a bool"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("chunk", ["default", "from the shape"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
def test_torch_compile_fullgraph_over_three_sizes_equals_eager(dynamic, chunk, gen):
    """The default chunk_size depends on the shapes: under dynamic shapes (automatic ones from the second size
    on) it must not become a symbolic argument the check rejects; a chunk_size the caller computes from a shape
    is a SymInt there, and is taken."""
    torch._dynamo.reset()
    hidden, vocab = 16, 40
    weight = rand(vocab, hidden, gen=gen, scale=0.3)

    def step(a, w, t):
        chunk_size = None if chunk == "default" else a.shape[0] // 2
        return kernel_ladder.fused_linear_cross_entropy(a, w, t, chunk_size=chunk_size)

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for rows in (6, 9, 13):
        x, target = rand(rows, hidden, gen=gen), targets((rows,), vocab, gen)
        loss, (grad_x, grad_w) = grads_of(lambda a, w, t=target: compiled(a, w, t), [x, weight], None)
        want, (want_x, want_w) = grads_of(lambda a, w, t=target: step(a, w, t), [x, weight], None)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6, msg=f"loss, {rows} rows")
        torch.testing.assert_close(grad_x, want_x, rtol=1e-6, atol=1e-6, msg=f"grad_x, {rows} rows")
        torch.testing.assert_close(grad_w, want_w, rtol=1e-6, atol=1e-6, msg=f"grad_weight, {rows} rows")
