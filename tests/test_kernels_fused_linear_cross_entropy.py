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


def reference(x, weight, target, bias=None, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0):
    """torch in float64: the logits, soft-capped, cross-entropy, plus z_loss * lse**2 reduced like it."""
    z = F.linear(x, weight, bias).flatten(0, -2)
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        valid = t != -100
        term = z_loss * torch.logsumexp(z, -1) ** 2 * valid
        loss = loss + {"mean": term.sum() / valid.sum(), "sum": term.sum(), "none": term}[reduction]
    return loss.reshape(target.shape) if reduction == "none" else loss


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
    assert flce.chunk_rows(8192, 128256, 4096) == 256  # ceil(128256 / 4096) = 32 chunks' worth
    assert flce.chunk_rows(10, 100, 1000) == 10  # V < H: the whole batch at once
    assert flce.chunk_rows(4096, 128256, 512) == 64  # 16 rows by the rule: a tile's 64 at least
    assert flce.chunk_rows(0, 10, 10) == 1


# ----------------------------------------------------------------------------- plumbing


def test_opcheck_and_torch_compile(gen):
    x, weight, bias = rand(6, 16, gen=gen), rand(30, 16, gen=gen), rand(30, gen=gen)
    target = targets((6,), 30, gen)
    for reduction, compute_grad in (("mean", True), ("none", False), ("sum", True)):
        torch.library.opcheck(torch.ops.kernel_ladder.fused_linear_cross_entropy.default,
                              (x, weight, target, bias, -100, reduction, 0.1, 4.0, 1e-3, 4, compute_grad))
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
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
