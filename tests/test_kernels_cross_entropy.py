"""kernel_ladder.cross_entropy: values and gradients against torch in float64, shapes, layouts, dtypes,
ignore_index, label smoothing, class weights, soft-capping, z-loss, reductions, custom-op plumbing,
double backward, memory, traffic (no host sync, no torch work), errors.

Every buffer the op allocates is poisoned (NaN) first, so an element the kernels forget to write
stays NaN and fails. Inputs are fresh random draws (the seed is printed).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from helpers import assert_matches
from helpers import random_targets as targets

import kernel_ladder
from kernel_ladder.ops import cross_entropy as ce
from kernel_ladder.ops.cross_entropy import cross_entropy
from utils.memory import peak_memory

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the op allocates starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE


def randn(shape, gen, dtype=torch.float32, scale=3.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def class_weights(n_classes, gen):
    return (torch.rand(n_classes, generator=gen, dtype=torch.float64) * 2 + 0.1).float().to(DEVICE)


def z_term(z, target, ignore_index=-100, reduction="mean"):
    """PaLM's z-loss term, ``lse**2`` per non-ignored row, reduced; "mean" over the non-ignored rows."""
    lse = torch.logsumexp(z, dim=1 if z.dim() > 1 else 0)
    valid = target != ignore_index
    per_row = torch.where(valid, lse**2, 0.0)
    if reduction == "none":
        return per_row
    return per_row.sum() / valid.sum() if reduction == "mean" else per_row.sum()


def reference(logits, target, grad_out=None, weight=None, softcap=None, z_loss=0.0, **kwargs):
    """The float64 torch composition: loss and its gradient (for ``grad_out``, default ones).

    ``F.cross_entropy(softcap * tanh(x / softcap), target, weight=...) + z_loss * z_term``.
    """
    x = logits.detach().double().requires_grad_()
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    w = None if weight is None else weight.double()
    loss = F.cross_entropy(z, target.long(), weight=w, **kwargs)
    if z_loss:
        loss = loss + z_loss * z_term(z, target.long(), kwargs.get("ignore_index", -100),
                                      kwargs.get("reduction", "mean"))
    go = torch.ones_like(loss) if grad_out is None else grad_out.double()
    (grad,) = torch.autograd.grad(loss, x, go)
    return loss.detach(), grad


def ours(logits, target, grad_out=None, **kwargs):
    x = logits.detach().clone().requires_grad_() if logits.is_contiguous() else logits.detach().requires_grad_()
    loss = cross_entropy(x, target, **kwargs)
    go = torch.ones_like(loss) if grad_out is None else grad_out
    (grad,) = torch.autograd.grad(loss, x, go)
    return loss, grad


def assert_close(got, want, dtype, what="loss"):
    """A reduction over V (the log-sum-exp), rounded once: twice the one-rounding tolerance."""
    assert_matches(got, want, dtype, slack=2.0, equal_nan=True, contiguous=False, what=what)


def raw_op(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
           z_loss=0.0, return_z_loss=False, compute_grad=False):
    """``torch.ops.kernel_ladder.cross_entropy`` with its schema's positional arguments."""
    return torch.ops.kernel_ladder.cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing,
                                                 softcap,
                                                 z_loss, return_z_loss, compute_grad)


# --------------------------------------------------------------------------- values and gradients


# Every shape with every reduction; label smoothing alternates so that each shape and each
# reduction meets both values. (3, 20000) is longer than the interpreter's block: two chunks.
MATCH_CASES = [
    (shape, reduction, (0.0, 0.15)[(i + j) % 2])
    for i, shape in enumerate([(1, 1), (5, 7), (37, 1000), (3, 20000)])
    for j, reduction in enumerate(["mean", "sum", "none"])
]


@pytest.mark.parametrize("shape, reduction, label_smoothing", MATCH_CASES, ids=str)
def test_matches_torch_values_and_gradients(shape, reduction, label_smoothing, gen):
    logits = randn(shape, gen)
    target = targets(shape[:1], shape[1], gen)
    grad_out = torch.rand(shape[:1] if reduction == "none" else (), generator=gen).to(DEVICE) + 0.5
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, grad = ours(logits, target, grad_out, **kwargs)
    want_loss, want_grad = reference(logits, target, grad_out, **kwargs)
    assert_close(loss, want_loss, torch.float32)
    assert_close(grad, want_grad, torch.float32, "gradient")


def test_long_rows_take_the_chunked_path(monkeypatch, gen):
    """Rows longer than a block: online log-sum-exp over chunks, a remainder chunk, two passes for the grad."""
    monkeypatch.setattr(ce, "MAX_BLOCK", 256)
    assert ce.cross_entropy_launch_config(6, 1000).chunked
    logits = randn((6, 1000), gen, scale=8.0)
    logits[0, 999] = 60.0  # the row max in the last, partial chunk: earlier chunks are rescaled
    logits[1, 3] = 60.0  # the row max in the first chunk
    target = targets((6,), 1000, gen)
    target[0], target[1] = 999, 5
    for kwargs in (dict(), dict(reduction="none", label_smoothing=0.3)):
        loss, grad = ours(logits, target, **kwargs)
        want_loss, want_grad = reference(logits, target, **kwargs)
        assert_close(loss, want_loss, torch.float32)
        assert_close(grad, want_grad, torch.float32, "gradient")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_classes", [300, 5000])
def test_half_precision_logits(dtype, n_classes, gen):
    logits = randn((9, n_classes), gen, dtype)
    target = targets((9,), n_classes, gen)
    for kwargs in (dict(), dict(reduction="none", label_smoothing=0.1)):
        loss, grad = ours(logits, target, **kwargs)
        want_loss, want_grad = reference(logits, target, **kwargs)
        assert_close(loss, want_loss, dtype)
        assert_close(grad, want_grad, dtype, "gradient")


def test_large_logits_do_not_overflow(gen):
    logits = randn((4, 500), gen) + torch.tensor([[1e4], [-1e4], [0.0], [80.0]], device=DEVICE)
    target = targets((4,), 500, gen, ignore_fraction=0.0)
    loss, grad = ours(logits, target, reduction="none")
    want_loss, want_grad = reference(logits, target, reduction="none")
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    # Near 1e4, float32's spacing is 1e-3: x - lse is only that exact, in any float32 computation
    # (torch's included). Hold the kernel to what torch's own float32 reaches, with some room.
    x32 = logits.detach().requires_grad_()
    torch_loss = F.cross_entropy(x32, target, reduction="none")
    (torch_grad,) = torch.autograd.grad(torch_loss.sum(), x32)
    for got, want, fp32 in ((loss, want_loss, torch_loss), (grad, want_grad, torch_grad)):
        bound = 4 * (fp32.detach().double() - want).abs().max().item() + 1e-6
        assert (got.double() - want).abs().max().item() <= bound


# --------------------------------------------------------------------------- ignore_index


def test_ignore_index_rows_add_nothing_and_mean_counts_the_others(gen):
    logits = randn((20, 50), gen)
    target = targets((20,), 50, gen, ignore_fraction=0.5, ignore_index=7)
    target[0] = 7
    for reduction in ("mean", "sum", "none"):
        for ls in (0.0, 0.2):
            kwargs = dict(ignore_index=7, reduction=reduction, label_smoothing=ls)
            loss, grad = ours(logits, target, **kwargs)
            want_loss, want_grad = reference(logits, target, **kwargs)
            assert_close(loss, want_loss, torch.float32)
            assert_close(grad, want_grad, torch.float32, "gradient")
            assert (grad[target == 7] == 0).all()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_all_ignored_batch_matches_torch(label_smoothing, gen):
    logits = randn((4, 30), gen)
    target = torch.full((4,), -100, device=DEVICE)
    for reduction, expected in (("mean", float("nan")), ("sum", 0.0)):
        loss, grad = ours(logits, target, reduction=reduction, label_smoothing=label_smoothing)
        want_loss, want_grad = reference(logits, target, reduction=reduction, label_smoothing=label_smoothing)
        assert torch.equal(want_loss.isnan(), loss.isnan()) and (expected != expected) == bool(loss.isnan())
        assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(want_grad, torch.zeros_like(want_grad))
    loss, grad = ours(logits, target, reduction="none")
    assert torch.equal(loss, torch.zeros(4, device=DEVICE)) and (grad == 0).all()


# --------------------------------------------------------------------------- class weights


# Every reduction, with and without smoothing, with ignored rows (ignore_index -100 and a class).
WEIGHT_CASES = [(reduction, ls, ii) for reduction in ("mean", "sum", "none") for ls in (0.0, 0.2)
                for ii in (-100, 3)]


@pytest.mark.parametrize("reduction, label_smoothing, ignore_index", WEIGHT_CASES, ids=str)
def test_class_weights_match_torch(reduction, label_smoothing, ignore_index, gen):
    """torch's weight: w[y] scales each row, smoothing weighs each class, "mean" divides by sum of w[y]."""
    logits = randn((23, 41), gen)
    target = targets((23,), 41, gen, ignore_index=ignore_index)
    weight = class_weights(41, gen)
    grad_out = torch.rand(23 if reduction == "none" else (), generator=gen).to(DEVICE) + 0.5
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing, ignore_index=ignore_index, weight=weight)
    loss, grad = ours(logits, target, grad_out, **kwargs)
    want_loss, want_grad = reference(logits, target, grad_out, **kwargs)
    assert_close(loss, want_loss, torch.float32)
    assert_close(grad, want_grad, torch.float32, "gradient")
    assert (grad[target == ignore_index] == 0).all()


def test_class_weights_on_long_rows_strided_and_in_low_precision(monkeypatch, gen):
    """The chunked path reads the weights chunk by chunk; any stride; bf16 weights with fp32 logits."""
    monkeypatch.setattr(ce, "MAX_BLOCK", 256)
    logits = randn((5, 1000), gen)
    target = targets((5,), 1000, gen)
    weight = class_weights(2000, gen)[::2]  # stride 2
    for w in (weight, weight.bfloat16()):
        for kwargs in (dict(weight=w), dict(weight=w, label_smoothing=0.3, reduction="none")):
            loss, grad = ours(logits, target, **kwargs)
            want_loss, want_grad = reference(logits, target, **{**kwargs, "weight": w.double()})
            assert_close(loss, want_loss, torch.float32)
            assert_close(grad, want_grad, torch.float32, "gradient")


def test_weights_whose_targets_sum_to_zero_give_nan_like_torch(gen):
    logits = randn((4, 6), gen)
    target = _t(0, 1, 1, -100)
    weight = torch.tensor([0.0, 0.0, 1, 1, 1, 1], device=DEVICE)
    for ls in (0.0, 0.1):
        loss, grad = ours(logits, target, weight=weight, label_smoothing=ls)
        want_loss, want_grad = reference(logits, target, weight=weight, label_smoothing=ls)
        assert loss.isnan() and want_loss.isnan()
        assert torch.equal(grad.isnan(), want_grad.isnan())  # NaN rows where torch's are, zeros for the ignored


# --------------------------------------------------------------------------- soft-capping and z-loss


@triton.jit
def _tanh_kernel(x_ptr, t_ptr, d_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    capped, derivative = ce.softcap_logits(x, 1.0)
    tl.store(t_ptr + offsets, ce.tanh(x), mask=mask)
    tl.store(d_ptr + offsets, derivative, mask=mask)
    tl.store(t_ptr + n + offsets, capped, mask=mask)


def test_tanh_and_the_softcap_derivative_are_accurate_to_a_few_ulp():
    x = torch.cat([torch.linspace(-30, 30, 2001), torch.logspace(-8, 0, 200), -torch.logspace(-8, 0, 200),
                   torch.tensor([0.0, 0.2499, 0.25, 0.2501, 1e-30, 88.0, -88.0])]).float().to(DEVICE)
    n = x.numel()
    t = torch.empty(2 * n, device=DEVICE)
    d = torch.empty(n, device=DEVICE)
    _tanh_kernel[(1,)](x, t, d, n, BLOCK=triton.next_power_of_2(n))
    x64 = x.double()
    want_t, want_d = torch.tanh(x64), torch.cosh(x64) ** -2  # not 1 - tanh**2: float64 cancels it too
    ulp = torch.finfo(torch.float32).eps
    relative = ((t[:n].double() - want_t).abs() / want_t.abs().clamp_min(1e-38)).max().item()
    assert relative <= 4 * ulp, relative
    assert torch.equal(t[:n], t[n:])  # softcap 1: the same function
    normal = want_d > torch.finfo(torch.float32).tiny  # below: float32 underflows, to (nearly) 0
    relative_d = ((d.double() - want_d).abs() / want_d)[normal].max().item()
    assert relative_d <= 8 * ulp, relative_d  # no cancellation of 1 - tanh**2 at large |x|
    assert (d[~normal] <= 2 * torch.finfo(torch.float32).tiny).all()


# (softcap, z_loss, reduction, label smoothing, weighted?): each option alone and all together.
OPTION_CASES = [
    (30.0, 0.0, "mean", 0.0, False), (4.0, 0.0, "none", 0.1, False), (2.0, 0.0, "sum", 0.0, True),
    (None, 1e-2, "mean", 0.0, False), (None, 0.5, "none", 0.0, True), (None, 1e-4, "sum", 0.1, False),
    (5.0, 0.1, "mean", 0.2, True), (5.0, 0.1, "none", 0.0, False),
]


@pytest.mark.parametrize("softcap, z_loss, reduction, label_smoothing, weighted", OPTION_CASES, ids=str)
@pytest.mark.parametrize("n_classes", [37, 1000])
def test_softcap_and_z_loss_match_the_torch_composition(softcap, z_loss, reduction, label_smoothing, weighted,
                                                        n_classes, gen, monkeypatch):
    monkeypatch.setattr(ce, "MAX_BLOCK", 256)  # 1000 classes: the chunked path
    logits = randn((13, n_classes), gen, scale=6.0)
    target = targets((13,), n_classes, gen)
    kwargs = dict(softcap=softcap, z_loss=z_loss, reduction=reduction, label_smoothing=label_smoothing,
                  weight=class_weights(n_classes, gen) if weighted else None)
    grad_out = torch.rand(13 if reduction == "none" else (), generator=gen).to(DEVICE) + 0.5
    loss, grad = ours(logits, target, grad_out, **kwargs)
    want_loss, want_grad = reference(logits, target, grad_out, **kwargs)
    assert_close(loss, want_loss, torch.float32)
    assert_close(grad, want_grad, torch.float32, "gradient")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_softcap_and_z_loss_in_half_precision(dtype, gen):
    logits = randn((9, 3000), gen, dtype, scale=20.0)
    target = targets((9,), 3000, gen)
    kwargs = dict(softcap=30.0, z_loss=1e-3, label_smoothing=0.1)
    loss, grad = ours(logits, target, **kwargs)
    want_loss, want_grad = reference(logits, target, **kwargs)
    assert_close(loss, want_loss, dtype)
    assert_close(grad, want_grad, dtype, "gradient")


def test_softcap_bounds_what_the_loss_sees(gen):
    """Capped at 1, logits of +-1e4 behave as +-1: the loss is finite and the derivative of the cap ~0."""
    logits = randn((3, 50), gen)
    logits[:, 0] = 1e4
    target = _t(0, 1, 2)
    loss, grad = ours(logits, target, softcap=1.0, reduction="none")
    want_loss, want_grad = reference(logits, target, softcap=1.0, reduction="none")
    assert_close(loss, want_loss, torch.float32)
    assert_close(grad, want_grad, torch.float32, "gradient")
    assert (grad[:, 0] == 0).all()  # sech**2(1e4) underflows: no gradient through a saturated cap


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_z_loss_returns_the_term_alone_and_it_is_not_differentiable(reduction, gen):
    logits = randn((11, 70), gen).requires_grad_()
    target = targets((11,), 70, gen)
    loss, z = cross_entropy(logits, target, reduction=reduction, z_loss=1e-2, return_z_loss=True, label_smoothing=0.1)
    x = logits.detach().double()
    want_z = 1e-2 * z_term(x, target, reduction=reduction)
    want_loss = F.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1) + want_z
    assert_close(z, want_z, torch.float32, "z-loss term")
    assert_close(loss, want_loss, torch.float32)
    assert loss.requires_grad and not z.requires_grad  # the z term is for logging: its gradient is in loss's
    plain = cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, return_z_loss=True)[1]
    assert torch.equal(plain, torch.zeros_like(plain))  # z_loss = 0: the term is 0


def test_all_ignored_batch_with_z_loss_is_nan_for_mean_and_zero_for_sum(gen):
    logits = randn((3, 10), gen)
    target = torch.full((3,), -100, device=DEVICE)
    loss, z = cross_entropy(logits, target, z_loss=1.0, return_z_loss=True)
    assert loss.isnan() and z.isnan()
    loss, z = cross_entropy(logits, target, z_loss=1.0, return_z_loss=True, reduction="sum")
    assert loss == 0 and z == 0


# --------------------------------------------------------------------------- shapes and layouts


def test_one_row_with_a_0d_target(gen):
    logits, target = randn((300,), gen), torch.tensor(17, device=DEVICE)
    for reduction in ("mean", "none"):
        loss, grad = ours(logits, target, reduction=reduction, label_smoothing=0.05)
        want_loss, want_grad = reference(logits, target, reduction=reduction, label_smoothing=0.05)
        assert loss.shape == () and grad.shape == (300,)
        assert_close(loss, want_loss, torch.float32)
        assert_close(grad, want_grad, torch.float32, "gradient")


@pytest.mark.parametrize("shape", [(2, 11, 3), (3, 40, 2, 5), (1, 5, 1, 1, 2), (2, 9, 3, 2, 2)], ids=str)
def test_class_dim_1_like_torch(shape, gen):
    logits = randn(shape, gen)
    if shape == (2, 9, 3, 2, 2):  # four leading dims no operand can merge: launched per slice
        logits = randn(tuple(reversed(shape)), gen).permute(4, 3, 2, 1, 0)
        assert len(ce.plan_rows([ce._class_last(logits)])) > 1
    target = targets((shape[0], *shape[2:]), shape[1], gen)
    for kwargs in (dict(), dict(reduction="none", label_smoothing=0.1)):
        loss, grad = ours(logits, target, **kwargs)
        want_loss, want_grad = reference(logits, target, **kwargs)
        assert_close(loss, want_loss, torch.float32)
        assert_close(grad, want_grad, torch.float32, "gradient")


@pytest.mark.parametrize("layout", ["transposed", "sliced", "row_slice"])
def test_strided_logits_are_read_in_place(layout, gen, monkeypatch):
    if layout == "transposed":
        logits = randn((300, 13), gen).t()  # class stride 13
    elif layout == "sliced":
        logits = randn((14, 601), gen)[1:, ::2]  # class stride 2, rows 601 apart
    else:
        logits = randn((13, 512), gen)[:, 100:400]  # rows 512 apart
    seen = []
    original = ce.plan_rows

    def recording(operands, *args):
        seen.append(operands[0])
        return original(operands, *args)

    monkeypatch.setattr(ce, "plan_rows", recording)
    target = targets((13,), 300 if layout != "sliced" else 301, gen)
    loss, grad = ours(logits, target, reduction="none")
    want_loss, want_grad = reference(logits, target, reduction="none")
    assert_close(loss, want_loss, torch.float32)
    assert_close(grad, want_grad, torch.float32, "gradient")
    assert seen[0].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()  # no copy


def test_targets_in_four_unmergeable_dims_are_copied_once(gen):
    """The one-program targets kernel walks three dims: a permuted 4-d target is made contiguous first."""
    from utils.trace import trace

    logits = randn((2, 7, 3, 2, 2), gen)
    target = targets((2, 2, 2, 3), 7, gen).permute(0, 3, 2, 1)  # (2, 3, 2, 2), no two dims merge
    with trace() as t:
        loss = cross_entropy(logits, target, reduction="none")
    assert [op.name for op in t.torch_ops] == ["aten.clone.default", "aten._assert_async.msg"]
    assert_close(loss, reference(logits, target, reduction="none")[0], torch.float32)


def test_strided_and_int32_targets(gen):
    logits = randn((10, 64), gen)
    wide = targets((10, 3), 64, gen)
    for target in (wide[:, 1], wide[:, 2].to(torch.int32)):
        loss, grad = ours(logits, target, reduction="none")
        want_loss, want_grad = reference(logits, target, reduction="none")
        assert_close(loss, want_loss, torch.float32)
        assert_close(grad, want_grad, torch.float32, "gradient")


def test_empty_batches(gen):
    logits = randn((0, 10), gen)
    target = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    for reduction in ("mean", "sum", "none"):
        loss, grad = ours(logits, target, reduction=reduction)
        want_loss, _ = reference(logits, target, reduction=reduction)
        assert loss.shape == want_loss.shape and torch.equal(loss.isnan(), want_loss.isnan())
        assert grad.shape == (0, 10)


# --------------------------------------------------------------------------- the gradient path


def test_no_gradient_buffer_without_grad(gen):
    logits = randn((16, 4096), gen)
    target = targets((16,), 4096, gen)
    for requires_grad, grad_mode in ((False, True), (True, False)):
        x = logits.clone().requires_grad_(requires_grad)
        with torch.set_grad_enabled(grad_mode), peak_memory(cuda=False) as m:
            loss = cross_entropy(x, target)
        # A float per row, the loss, the targets kernel's check and scales: no N x V buffer.
        assert m.peak_bytes <= 16 * 4 + 4 + 3 * 8 + 3 * 4
        torch.testing.assert_close(loss.double(), reference(logits, target)[0], rtol=1e-5, atol=1e-6)
    x = logits.clone().requires_grad_()
    with peak_memory(cuda=False) as m:
        cross_entropy(x, target)
    assert m.peak_bytes >= logits.nbytes  # the gradient buffer


def test_the_gradient_buffer_becomes_logits_grad_without_a_copy(gen):
    x = randn((8, 2000), gen).requires_grad_()
    target = targets((8,), 2000, gen)
    with peak_memory(cuda=False) as m:
        cross_entropy(x, target).backward()
    assert m.allocated_bytes < x.nbytes + 64  # x.grad is the forward's buffer itself
    assert m.peak_bytes < x.nbytes + 8 * 4 + 64


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_the_gradient_has_the_logits_layout(layout, gen):
    if layout == "transposed":
        logits = randn((30, 7), gen).t()
        target = targets((7,), 30, gen)
    else:
        logits = randn((2, 4, 3, 5), gen).contiguous(memory_format=torch.channels_last)
        target = targets((2, 3, 5), 4, gen)
    loss, grad = ours(logits, target)
    assert grad.stride() == logits.stride()  # like torch.empty_like: no transposed writes
    assert_close(grad, reference(logits, target)[1], torch.float32, "gradient")


def test_a_second_backward_through_the_same_loss_is_refused(gen):
    x = randn((3, 20), gen).requires_grad_()
    loss = cross_entropy(x, targets((3,), 20, gen, ignore_fraction=0.0))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.cross_entropy: backward through the same loss twice"):
        loss.backward()


def test_raw_op_without_gradient_explains_itself(gen):
    x = randn((3, 20), gen).requires_grad_()
    loss, *_ = raw_op(x, targets((3,), 20, gen))
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.cross_entropy: the forward ran with compute_grad=False"):
        loss.backward()


# --------------------------------------------------------------------------- double backward

_DOUBLE = r"^kernel_ladder\.cross_entropy \(backward\): double backward \(a gradient of a gradient\) is not supported"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_create_graph_gives_the_gradient_and_a_gradient_of_it_raises(reduction, gen):
    logits = randn((6, 40), gen)
    target = targets((6,), 40, gen)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)
    grad_out = torch.ones_like(loss)
    (g,) = torch.autograd.grad(loss, x, grad_out, create_graph=True)  # a first-order backward, recorded
    assert_close(g, reference(logits, target, reduction=reduction, label_smoothing=0.1)[1], torch.float32,
                 "gradient")
    assert g.requires_grad  # so that a penalty on it cannot silently contribute nothing
    with pytest.raises(RuntimeError, match=_DOUBLE):
        (g**2).sum().backward()  # a gradient penalty
    with pytest.raises(RuntimeError, match=_DOUBLE):
        torch.autograd.grad(g.sum(), x)  # not torch's "does not require grad"


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_backward_with_create_graph_then_a_penalty_on_logits_grad_raises(gen):
    x = randn((4, 25), gen).requires_grad_()
    target = targets((4,), 25, gen)
    cross_entropy(x, target).backward(create_graph=True)
    assert_close(x.grad, reference(x, target)[1], torch.float32, "gradient")
    with pytest.raises(RuntimeError, match=_DOUBLE):
        x.grad.pow(2).sum().backward()


def test_a_differentiable_grad_output_reaches_the_error_too(gen):
    x = randn((4, 25), gen).requires_grad_()
    v = torch.tensor(2.0, device=DEVICE, requires_grad=True)
    (g,) = torch.autograd.grad(cross_entropy(x, targets((4,), 25, gen)), x, v, create_graph=True)
    with pytest.raises(RuntimeError, match=_DOUBLE):
        torch.autograd.grad(g.sum(), v)


def test_negative_control_without_the_guard_the_penalty_is_silently_lost(gen, monkeypatch):
    """What the tests above catch: a gradient handed out with no graph (the op's old behaviour)."""
    monkeypatch.setattr(ce, "recorded_gradient", lambda name, grad, *links: grad)
    x = randn((4, 25), gen).requires_grad_()
    (g,) = torch.autograd.grad(cross_entropy(x, targets((4,), 25, gen)), x, create_graph=True)
    assert not g.requires_grad  # (g**2).sum().backward() would raise torch's generic error, not the op's
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(g.sum(), x)


# --------------------------------------------------------------------------- memory


def _peak_forward_backward(fn, x, target):
    x = x.detach().clone().requires_grad_()
    with peak_memory(cuda=False) as m:
        fn(x, target).backward()
    return m.peak_bytes


def _memory_table() -> dict[str, tuple[int, int, float]]:
    """The module docstring's memory table: comparison -> (torch bytes, our bytes, ratio)."""
    rows = {}
    for line in ce.__doc__.splitlines():
        found = re.match(r"^(\w+) logits, ``F\.cross_entropy\((logits(?:\.float\(\))?), y\)``\s+([\d,]+)\s+([\d,]+)"
                         r"\s+([\d.]+)$", line)
        if found:
            dtype, call, torch_bytes, our_bytes, ratio = found.groups()
            rows[f"{dtype} {call}"] = (int(torch_bytes.replace(",", "")), int(our_bytes.replace(",", "")),
                                       float(ratio))
    return rows


def test_the_docstring_memory_table_is_what_peak_memory_measures(gen):
    """N=32, V=32768, forward + backward, measured again: the table in the docstring cannot drift.

    torch keeps 3 N x V tensors at its peak (log-probabilities, NLL gradient, log-softmax
    gradient), this op 1 (the gradient buffer) plus a few bytes a row.
    """
    table = _memory_table()
    assert set(table) == {"fp32 logits", "bf16 logits", "bf16 logits.float()"}
    n, v = 32, 32768
    target = targets((n,), v, gen, ignore_fraction=0.0)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = randn((n, v), gen, dtype)
        runs = {"logits": F.cross_entropy}
        if dtype == torch.bfloat16:
            runs["logits.float()"] = lambda a, t: F.cross_entropy(a.float(), t)
        ours_peak = _peak_forward_backward(cross_entropy, x, target)
        assert ours_peak <= x.nbytes + n * 4 + 64  # the gradient buffer and one float per row
        for call, fn in runs.items():
            torch_peak = _peak_forward_backward(fn, x, target)
            want_torch, want_ours, want_ratio = table[f"{name} {call}"]
            assert (torch_peak, ours_peak) == (want_torch, want_ours), f"{name} {call}: measured {torch_peak:,} / " \
                f"{ours_peak:,}, the docstring says {want_torch:,} / {want_ours:,}"
            assert round(ours_peak / torch_peak, 3) == want_ratio
    assert table["fp32 logits"][2] < 0.34 and table["bf16 logits.float()"][2] < 0.17  # a third; a sixth


# --------------------------------------------------------------------------- traffic: no host sync, no torch work


def _kernels(t):
    return [launch.kernel for launch in t.launches]


@pytest.mark.interpreter
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_forward_without_gradient_is_three_triton_launches_and_one_assert(reduction, gen):
    from utils.trace import ideal_bytes, trace

    for shape in [(16, 3000), (64, 100)]:
        n = shape[0]
        logits = randn(shape, gen)
        target = targets(shape[:1], shape[1], gen, ignore_fraction=0.0)
        with trace() as t:
            loss = cross_entropy(logits, target, reduction=reduction)
        reduces = [] if reduction == "none" else ["cross_entropy_reduce_kernel"]
        assert _kernels(t) == ["cross_entropy_targets_kernel", "cross_entropy_forward_kernel", *reduces]
        # The only aten op inside: the device-side check of the targets kernel's flag (8 bytes read).
        assert [(op.name, op.inside, op.bytes) for op in t.torch_ops] == [
            ("aten._assert_async.msg", "kernel_ladder.cross_entropy.default", 8)]
        assert t.num_launches == len(t.launches) + 1
        assert all(launch.atomics == 0 for launch in t.launches)
        targets_kernel, forward, *reduce = t.launches
        # The targets: read once by each kernel that needs them; the check (3 x int64) and scales (3 x fp32).
        assert targets_kernel.bytes_read == target.nbytes and targets_kernel.bytes_written == 3 * 8 + 3 * 4
        # The logits once (and each row's target logit: n floats, cached), the targets once, the scales.
        assert forward.bytes_read == logits.nbytes + target.nbytes + n * 4 + 3 * 4
        assert forward.bytes_written == n * (loss.element_size() if reduction == "none" else 4)
        if reduce:
            assert reduce[0].bytes_read == n * 4 + (8 if reduction == "mean" else 0)
            assert reduce[0].bytes_written == loss.nbytes
        # Beyond the ideal, per row: the target read again (8 B), its logit (4 B), and for "mean"/"sum" the
        # float32 row loss written and read back (8 B); and the check (48 B with the assert), the scales.
        per_row = 8 + 4 + (0 if reduction == "none" else 8)
        scales = 3 * 4 + 3 * 4 + (0 if reduction == "none" else (8 if reduction == "mean" else 0))
        assert t.bytes == ideal_bytes(logits, target, loss) + n * per_row + 3 * 8 + 8 + scales
        if shape[1] >= 1000:
            assert t.bytes <= 1.01 * ideal_bytes(logits, target, loss)


@pytest.mark.interpreter
def test_no_host_synchronization(gen, monkeypatch):
    """No value goes to the host: no .item(), .tolist(), bool() of a tensor (the CPU's error path aside)."""
    logits = randn((6, 50), gen).requires_grad_()
    target = targets((6,), 50, gen)
    weight = class_weights(50, gen)

    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronization")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss = cross_entropy(logits, target, weight=weight, label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    loss.backward(torch.tensor(0.5, device=DEVICE))
    monkeypatch.undo()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.interpreter
def test_weights_cost_one_gather_a_row_and_with_smoothing_one_read_a_program(gen):
    from utils.trace import trace

    logits = randn((8, 512), gen)
    target = targets((8,), 512, gen, ignore_fraction=0.0)
    weight = class_weights(512, gen)
    with trace() as t:
        cross_entropy(logits, target, weight=weight)
    targets_kernel, forward, _ = t.launches
    assert targets_kernel.per_tensor["weight_ptr"].bytes_read == 8 * 4  # w[y] for the weight sum
    assert forward.per_tensor["weight_ptr"].bytes_read == 8 * 4  # w[y] per row
    with trace() as t:
        cross_entropy(logits, target, weight=weight, label_smoothing=0.1)
    targets_kernel, forward, _ = t.launches
    assert targets_kernel.per_tensor["weight_ptr"].bytes_read == 8 * 4 + weight.nbytes  # and sum(w) once
    # w[c] once per program (its rows share the block), as L2 would serve it to every row on a GPU
    assert forward.per_tensor["weight_ptr"].bytes_read == 8 * 4 + forward.programs * weight.nbytes


@pytest.mark.interpreter
def test_forward_with_gradient_writes_it_once(gen, monkeypatch):
    from utils.trace import ideal_bytes, trace

    logits = randn((16, 3000), gen).requires_grad_()
    target = targets((16,), 3000, gen, ignore_fraction=0.0)
    with trace() as t:
        loss = cross_entropy(logits, target)
    assert len(t.launches) == 3 and t.num_launches == 4
    forward = t.launches[1]
    assert forward.bytes_written == logits.nbytes + 16 * 4  # the gradient once, one float per row
    assert forward.bytes_read == logits.nbytes + target.nbytes + 16 * 4 + 3 * 4  # one chunk: one read
    assert t.bytes <= 1.01 * ideal_bytes(logits, target, loss, logits)
    # Rows longer than a block: the statistics pass, then the gradient pass reads the row again.
    monkeypatch.setattr(ce, "MAX_BLOCK", 1024)
    with trace() as t:
        cross_entropy(logits, target, softcap=10.0, z_loss=1e-4, label_smoothing=0.1)
    forward = t.launches[1]
    assert forward.bytes_written == logits.nbytes + 16 * 4
    assert forward.bytes_read == 2 * logits.nbytes + target.nbytes + 16 * 4 + 3 * 4


@pytest.mark.interpreter
def test_backward_only_scales_and_skips_a_scale_of_one(gen):
    from utils.trace import trace

    logits = randn((8, 1000), gen).requires_grad_()
    target = targets((8,), 1000, gen)
    loss = cross_entropy(logits, target)
    with trace() as t:
        loss.backward()
    (launch,) = t.launches
    assert launch.kernel == "cross_entropy_backward_kernel" and launch.bytes <= 8 * 4  # only the scale
    logits.grad = None
    loss = cross_entropy(logits, target, reduction="none")
    with trace() as t:
        loss.backward(torch.full((8,), 0.5))
    (launch,) = t.launches
    assert launch.bytes_read >= logits.nbytes and launch.bytes_written == logits.nbytes


def test_mean_and_sum_are_deterministic(gen):
    """A fixed-order sum, no atomics: the same bits on every run (and rows in any order of programs)."""
    logits = randn((300, 64), gen)
    target = targets((300,), 64, gen)
    for reduction in ("mean", "sum"):
        first = cross_entropy(logits, target, reduction=reduction, z_loss=1e-3, return_z_loss=True)
        for _ in range(2):
            again = cross_entropy(logits, target, reduction=reduction, z_loss=1e-3, return_z_loss=True)
            assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_launch_config_stacks_short_rows_and_chunks_long_ones():
    short = ce.cross_entropy_launch_config(1000, 10)
    assert short.block_cols == 16 and not short.chunked and short.block_rows * short.block_cols <= ce.TILE_ELEMENTS
    long = ce.cross_entropy_launch_config(4, 200_000)
    assert long.block_cols == ce.MAX_BLOCK and long.chunked
    assert ce.cross_entropy_launch_config(3, 5).block_rows == 4  # never more rows than the batch needs


# --------------------------------------------------------------------------- custom-op plumbing


@pytest.mark.parametrize("reduction, compute_grad, options", [
    ("mean", True, False), ("none", True, False), ("sum", False, False), ("mean", True, True), ("none", True, True),
], ids=str)
def test_opcheck_forward(reduction, compute_grad, options, gen):
    logits = randn((6, 37), gen).requires_grad_(compute_grad)
    target = targets((6,), 37, gen)
    weight, softcap, z_loss = (class_weights(37, gen), 7.0, 1e-2) if options else (None, None, 0.0)
    args = (logits, target, weight, -100, reduction, 0.1, softcap, z_loss, options, compute_grad)
    torch.library.opcheck(torch.ops.kernel_ladder.cross_entropy.default, args)


def test_opcheck_backward(gen):
    op = torch.ops.kernel_ladder.cross_entropy_backward.default
    torch.library.opcheck(op, (randn((6, 37), gen), torch.rand(6, generator=gen).to(DEVICE)))
    torch.library.opcheck(op, (randn((2, 9, 3), gen), torch.tensor(0.5, device=DEVICE)))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_forward_and_backward(backend, gen):
    def step(x, t, w):
        loss, z = cross_entropy(x, t, label_smoothing=0.1, weight=w, softcap=6.0, z_loss=1e-2, return_z_loss=True)
        return loss * 3.0 + cross_entropy(x, t, reduction="none").sum() + z.detach() * 0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    logits = randn((6, 37), gen)
    target = targets((6,), 37, gen)
    weight = class_weights(37, gen)
    x = logits.clone().requires_grad_()
    loss = compiled(x, target, weight)
    loss.backward()
    xr = logits.double().requires_grad_()
    capped = 6.0 * torch.tanh(xr / 6.0)
    want = (F.cross_entropy(capped, target, label_smoothing=0.1, weight=weight.double())
            + 1e-2 * z_term(capped, target)) * 3.0 + F.cross_entropy(xr, target, reduction="none").sum()
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(logits, target, weight).double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_torch_compile_accepts_an_ignore_index_it_has_made_dynamic(gen):
    # A second call with another int makes dynamo trace it as a SymInt.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, t, ii: cross_entropy(x, t, ignore_index=ii), fullgraph=True,
                             backend="aot_eager")
    logits, target = randn((5, 23), gen), targets((5,), 23, gen, ignore_fraction=0.0)  # no -100: both runs valid
    for ignore in (-100, int(target[0])):
        want = F.cross_entropy(logits.double(), target, ignore_index=ignore)
        torch.testing.assert_close(compiled(logits, target, ignore).double(), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- bad input

_X = torch.randn(4, 10, device=DEVICE)
_T = torch.tensor([1, 2, 3, -100], device=DEVICE)


def _t(*values):
    return torch.tensor(values, device=DEVICE)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: cross_entropy(_X, _t(1, 2, 10, 0)), ValueError,
         r"^kernel_ladder\.cross_entropy: target must hold class indices in \[0, 10\) or ignore_index=-100, got 10 "
         r".*pass the padding label as ignore_index"),
        (lambda: cross_entropy(_X, _t(1, -1, 3, 0)), ValueError,
         r"^kernel_ladder\.cross_entropy: target must hold class indices in \[0, 10\).*got -1"),
        (lambda: cross_entropy(_X, _t(1, -100, 3, 0), ignore_index=0), ValueError,
         r"^kernel_ladder\.cross_entropy: target .* or ignore_index=0, got -100"),
        (lambda: cross_entropy(_X, _t(1, 2, 3)), ValueError,
         r"^kernel_ladder\.cross_entropy: target must have shape \(4,\) for logits of shape \(4, 10\) "
         r"\(\(N, V\) logits take an \(N,\) target.*got \(3,\)"),
        (lambda: cross_entropy(_X, _T[None]), ValueError,
         r"^kernel_ladder\.cross_entropy: target must have shape \(4,\)"),
        (lambda: cross_entropy(_X[0], _T), ValueError,
         r"^kernel_ladder\.cross_entropy: target must have shape \(\) .*\(V,\) logits take a 0-d target"),
        (lambda: cross_entropy(_X[:2, :, None].expand(2, 10, 3), _T[:2, None].expand(2, 10)), ValueError,
         r"^kernel_ladder\.cross_entropy: target must have shape \(2, 3\) .*class dim is dim 1"),
        (lambda: cross_entropy(_X[0, 0], _T[0]), ValueError,
         r"^kernel_ladder\.cross_entropy: logits must have a class dim"),
        (lambda: cross_entropy(_X[:3, :0], _T[:3]), ValueError,
         r"^kernel_ladder\.cross_entropy: logits must have at least one class"),
        (lambda: cross_entropy(_X.long(), _T), TypeError,
         r"^kernel_ladder\.cross_entropy: logits must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: cross_entropy(_X.double(), _T), TypeError,
         r"^kernel_ladder\.cross_entropy: logits must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: cross_entropy(_X, _T.float()), TypeError,
         r"^kernel_ladder\.cross_entropy: target must be int64 \(or int32\) class indices, got torch\.float32 "
         r"\(class-probability targets are not supported"),
        (lambda: cross_entropy(_X, _T.to(torch.int16)), TypeError,
         r"^kernel_ladder\.cross_entropy: target must be int64 \(or int32\) class indices, got torch\.int16$"),
        (lambda: cross_entropy(_X.cpu().numpy(), _T), TypeError,
         r"^kernel_ladder\.cross_entropy: logits must be a torch\.Tensor, got ndarray"),
        (lambda: cross_entropy(_X, [1, 2, 3, 4]), TypeError,
         r"^kernel_ladder\.cross_entropy: target must be a torch\.Tensor, got list"),
        (lambda: cross_entropy(_X, _T.to("meta")), ValueError,
         r"^kernel_ladder\.cross_entropy: logits and target must be on the same device, got \S+ and meta"),
        (lambda: cross_entropy(_X, _T, reduction="avg"), ValueError,
         r"^kernel_ladder\.cross_entropy: reduction must be 'mean', 'sum' or 'none', got 'avg'"),
        (lambda: cross_entropy(_X, _T, reduction=None), TypeError, r"^kernel_ladder\.cross_entropy: reduction must be"),
        (lambda: cross_entropy(_X, _T, label_smoothing=1.5), ValueError,
         r"^kernel_ladder\.cross_entropy: label_smoothing must be in \[0, 1\], got 1\.5"),
        (lambda: cross_entropy(_X, _T, label_smoothing="0.1"), TypeError,
         r"^kernel_ladder\.cross_entropy: label_smoothing must be a float"),
        (lambda: cross_entropy(_X, _T, ignore_index=1.0), TypeError,
         r"^kernel_ladder\.cross_entropy: ignore_index must be an int, got float"),
        (lambda: cross_entropy(_X, _T, weight=torch.ones(9, device=DEVICE)), ValueError,
         r"^kernel_ladder\.cross_entropy: weight must hold one weight per class, shape \(10,\), got \(9,\)"),
        (lambda: cross_entropy(_X, _T, weight=torch.ones(10, dtype=torch.float64, device=DEVICE)), TypeError,
         r"^kernel_ladder\.cross_entropy: weight must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: cross_entropy(_X, _T, weight=[1.0] * 10), TypeError,
         r"^kernel_ladder\.cross_entropy: weight must be a torch\.Tensor, got list"),
        (lambda: cross_entropy(_X, _T, weight=torch.ones(10, device=DEVICE, requires_grad=True)), ValueError,
         r"^kernel_ladder\.cross_entropy: weight is not differentiable \(as in torch's cross_entropy\)"),
        (lambda: cross_entropy(_X, _T, softcap=0.0), ValueError,
         r"^kernel_ladder\.cross_entropy: softcap must be a positive, finite float \(Gemma-2 uses 30\.0\), got 0\.0"),
        (lambda: cross_entropy(_X, _T, softcap=float("inf")), ValueError,
         r"^kernel_ladder\.cross_entropy: softcap must be"),
        (lambda: cross_entropy(_X, _T, softcap="30"), TypeError,
         r"^kernel_ladder\.cross_entropy: softcap must be None or a positive float, got str"),
        (lambda: cross_entropy(_X, _T, z_loss=-1e-4), ValueError,
         r"^kernel_ladder\.cross_entropy: z_loss must be a finite float >= 0 \(PaLM uses 1e-4\), got -0\.0001"),
        (lambda: cross_entropy(_X, _T, z_loss=None), TypeError,
         r"^kernel_ladder\.cross_entropy: z_loss must be a float"),
        (lambda: cross_entropy(_X, _T, return_z_loss=1), TypeError,
         r"^kernel_ladder\.cross_entropy: return_z_loss must be a bool, got int"),
        # the custom op validates too, when called directly through torch.ops
        (lambda: raw_op(_X.double(), _T), TypeError, r"^kernel_ladder\.cross_entropy: logits must be float32"),
        (lambda: raw_op(_X, _t(0, 0, 0, 99)), ValueError,
         r"^kernel_ladder\.cross_entropy: target must hold class indices"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
def test_gpu_vocabulary_128k_values_and_peak_memory():
    """bf16 logits, V = 128k: correct, and at most a quarter of the upcast torch pattern's peak."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, v = 4096, 128 * 1024
    logits = (torch.randn(n, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda", generator=gen)
    target[::7] = -100
    rows = slice(0, 64)
    want_loss, want_grad = reference(logits[rows], target[rows], reduction="none")
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction="none")
    loss.backward(torch.ones_like(loss))
    assert_close(loss[rows], want_loss, torch.bfloat16)
    assert_close(x.grad[rows], want_grad, torch.bfloat16, "gradient")
    del x, loss

    def peak(fn):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        with peak_memory() as m:
            fn(x, target).backward()
        return m

    ours_m = peak(cross_entropy)
    upcast_m = peak(lambda a, t: F.cross_entropy(a.float(), t))
    same_m = peak(F.cross_entropy)
    print(f"peak bytes: ours {ours_m.cuda_peak_bytes:,}, torch upcast {upcast_m.cuda_peak_bytes:,}, "
          f"torch bf16 {same_m.cuda_peak_bytes:,}")
    assert ours_m.cuda_peak_bytes <= upcast_m.cuda_peak_bytes / 4
    assert ours_m.peak_bytes <= same_m.peak_bytes / 2.9


@pytest.mark.gpu
def test_gpu_more_than_2_to_the_31_logits():
    n, v = 16400, 131072  # 2.15e9 elements: row starts pass 2**31
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    loss = cross_entropy(logits, target, reduction="none")
    tail = slice(n - 8, n)
    assert_close(loss[tail], reference(logits[tail], target[tail], reduction="none")[0], torch.bfloat16)


@pytest.mark.parametrize("bad", [5, -3, 10**6])
def test_an_out_of_range_target_unchecked_reads_nothing_and_gives_nan(bad):
    """With the value checks off (the CUDA default), a target outside [0, V) must not send the kernel
    to another row's logits: no access outside any tensor, and that row's loss is NaN, the others exact."""
    from kernel_ladder import runtime
    from utils.trace import trace

    logits = torch.randn(3, 5, dtype=torch.float32, requires_grad=True)
    target = torch.tensor([1, bad, 4])
    with runtime.check_values(False), trace(block_out_of_bounds=True) as traced:
        losses = kernel_ladder.cross_entropy(logits, target, reduction="none")
        losses.nansum().backward()
    assert sum(launch.out_of_bounds for launch in traced.launches) == 0
    assert torch.isnan(losses[1]) and torch.isfinite(losses[[0, 2]]).all()
    expected = torch.nn.functional.cross_entropy(logits.detach().double()[[0, 2]], target[[0, 2]], reduction="none")
    torch.testing.assert_close(losses.detach()[[0, 2]].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(logits.grad).all()
    with runtime.check_values(True), pytest.raises(ValueError, match=r"kernel_ladder\.cross_entropy: target"):
        kernel_ladder.cross_entropy(logits, target)
