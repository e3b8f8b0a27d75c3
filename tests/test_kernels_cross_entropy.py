"""kernels.cross_entropy: values and gradients against torch in float64, shapes, layouts, dtypes,
ignore_index, label smoothing, reductions, custom-op plumbing, memory, traffic, errors.

Every buffer the op allocates is poisoned (NaN) first, so an element the kernels forget to write
stays NaN and fails. Inputs are fresh random draws (the seed is printed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches

import kernels
from kernels.ops import cross_entropy as ce
from kernels.ops.cross_entropy import cross_entropy
from utils.memory import peak_memory

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the op allocates starts as NaN

DEVICE = kernels.runtime.DEVICE


def randn(shape, gen, dtype=torch.float32, scale=3.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def targets(shape, n_classes, gen, ignore_fraction=0.25, ignore_index=-100, dtype=torch.int64):
    t = torch.randint(0, n_classes, shape, generator=gen)
    t[torch.rand(shape, generator=gen) < ignore_fraction] = ignore_index
    return t.to(dtype).to(DEVICE)


def reference(logits, target, grad_out=None, **kwargs):
    """torch's loss and gradient in float64 (and the gradient for ``grad_out``, default ones)."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, target.long(), **kwargs)
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
        # A float per row, the scalar, the target check's temporaries (a few bytes a row): no N x V buffer.
        assert m.peak_bytes <= 16 * 4 + 2 * 16 * 8 + 64
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


def test_a_second_backward_through_the_same_loss_is_refused(gen):
    x = randn((3, 20), gen).requires_grad_()
    loss = cross_entropy(x, targets((3,), 20, gen, ignore_fraction=0.0))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"kernels\.cross_entropy: backward through the same loss twice"):
        loss.backward()


def test_raw_op_without_gradient_explains_itself(gen):
    x = randn((3, 20), gen).requires_grad_()
    loss, _ = torch.ops.kernels.cross_entropy(x, targets((3,), 20, gen), -100, "mean", 0.0, False)
    with pytest.raises(RuntimeError, match=r"kernels\.cross_entropy: the forward ran with compute_grad=False"):
        loss.backward()


# --------------------------------------------------------------------------- memory


def _peak_forward_backward(fn, x, target):
    x = x.detach().clone().requires_grad_()
    with peak_memory(cuda=False) as m:
        fn(x, target).backward()
    return m.peak_bytes


def test_peak_memory_is_a_third_of_torchs(gen):
    """N=32, V=32768, forward + backward. torch keeps 3 N x V tensors at its peak, we keep 1."""
    n, v = 32, 32768
    target = targets((n,), v, gen, ignore_fraction=0.0)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn((n, v), gen, dtype)
        elems = n * v * x.element_size()
        ours_peak = _peak_forward_backward(cross_entropy, x, target)
        torch_peak = _peak_forward_backward(F.cross_entropy, x, target)
        assert ours_peak <= elems + n * 4 + 64  # the gradient buffer and one float per row
        assert torch_peak >= 3 * elems  # log-probabilities, NLL gradient, log-softmax gradient
        assert ours_peak / torch_peak < 0.34
    # The mixed-precision pattern: bf16 logits upcast for torch's loss; 1/6 of its peak.
    upcast_peak = _peak_forward_backward(lambda a, t: F.cross_entropy(a.float(), t), x, target)
    assert ours_peak / upcast_peak < 0.17


# --------------------------------------------------------------------------- traffic


@pytest.mark.interpreter
def test_forward_without_gradient_reads_the_logits_once(gen):
    from utils.trace import ideal_bytes, trace

    for shape in [(16, 3000), (64, 100)]:
        logits = randn(shape, gen)
        target = targets(shape[:1], shape[1], gen, ignore_fraction=0.0)
        for reduction in ("none", "mean"):
            with trace() as t:
                loss = cross_entropy(logits, target, reduction=reduction)
            (launch,) = t.launches
            assert launch.kernel == "cross_entropy_forward_kernel"
            assert launch.bytes <= 1.05 * ideal_bytes(logits, target, loss)


@pytest.mark.interpreter
def test_forward_with_gradient_writes_it_once(gen, monkeypatch):
    from utils.trace import ideal_bytes, trace

    logits = randn((16, 3000), gen).requires_grad_()
    target = targets((16,), 3000, gen, ignore_fraction=0.0)
    with trace() as t:
        loss = cross_entropy(logits, target)
    (launch,) = t.launches
    assert launch.bytes_written <= logits.nbytes + 16 * 4  # the gradient once, one float per row
    assert launch.bytes <= 1.05 * ideal_bytes(logits, target, loss, logits)  # one chunk: one read
    # Rows longer than a block: the statistics pass, then the gradient pass reads the row again.
    monkeypatch.setattr(ce, "MAX_BLOCK", 1024)
    with trace() as t:
        cross_entropy(logits, target)
    (launch,) = t.launches
    assert launch.bytes_written <= logits.nbytes + 16 * 4
    assert launch.bytes_read <= 2.01 * logits.nbytes


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


def test_launch_config_stacks_short_rows_and_chunks_long_ones():
    short = ce.cross_entropy_launch_config(1000, 10)
    assert short.block_cols == 16 and not short.chunked and short.block_rows * short.block_cols <= ce.TILE_ELEMENTS
    long = ce.cross_entropy_launch_config(4, 200_000)
    assert long.block_cols == ce.MAX_BLOCK and long.chunked
    assert ce.cross_entropy_launch_config(3, 5).block_rows == 4  # never more rows than the batch needs


# --------------------------------------------------------------------------- custom-op plumbing


@pytest.mark.parametrize("reduction, compute_grad", [("mean", True), ("none", True), ("sum", False)])
def test_opcheck_forward(reduction, compute_grad, gen):
    logits = randn((6, 37), gen).requires_grad_(compute_grad)
    target = targets((6,), 37, gen)
    torch.library.opcheck(torch.ops.kernels.cross_entropy.default, (logits, target, -100, reduction, 0.1, compute_grad))


def test_opcheck_backward(gen):
    op = torch.ops.kernels.cross_entropy_backward.default
    torch.library.opcheck(op, (randn((6, 37), gen), torch.rand(6, generator=gen).to(DEVICE)))
    torch.library.opcheck(op, (randn((2, 9, 3), gen), torch.tensor(0.5, device=DEVICE)))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_forward_and_backward(backend, gen):
    def step(x, t):
        return cross_entropy(x, t, label_smoothing=0.1) * 3.0 + cross_entropy(x, t, reduction="none").sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    logits = randn((6, 37), gen)
    target = targets((6,), 37, gen)
    x = logits.clone().requires_grad_()
    loss = compiled(x, target)
    loss.backward()
    xr = logits.double().requires_grad_()
    want = F.cross_entropy(xr, target, label_smoothing=0.1) * 3.0 + F.cross_entropy(xr, target, reduction="none").sum()
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(logits, target).double(), want.detach(), rtol=1e-5, atol=1e-5)


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
         r"^kernels\.cross_entropy: target must hold class indices in \[0, 10\) or ignore_index=-100, got 10 "
         r".*pass the padding label as ignore_index"),
        (lambda: cross_entropy(_X, _t(1, -1, 3, 0)), ValueError,
         r"^kernels\.cross_entropy: target must hold class indices in \[0, 10\).*got -1"),
        (lambda: cross_entropy(_X, _t(1, -100, 3, 0), ignore_index=0), ValueError,
         r"^kernels\.cross_entropy: target .* or ignore_index=0, got -100"),
        (lambda: cross_entropy(_X, _t(1, 2, 3)), ValueError,
         r"^kernels\.cross_entropy: target must have shape \(4,\) for logits of shape \(4, 10\) "
         r"\(\(N, V\) logits take an \(N,\) target.*got \(3,\)"),
        (lambda: cross_entropy(_X, _T[None]), ValueError, r"^kernels\.cross_entropy: target must have shape \(4,\)"),
        (lambda: cross_entropy(_X[0], _T), ValueError,
         r"^kernels\.cross_entropy: target must have shape \(\) .*\(V,\) logits take a 0-d target"),
        (lambda: cross_entropy(_X[:2, :, None].expand(2, 10, 3), _T[:2, None].expand(2, 10)), ValueError,
         r"^kernels\.cross_entropy: target must have shape \(2, 3\) .*class dim is dim 1"),
        (lambda: cross_entropy(_X[0, 0], _T[0]), ValueError,
         r"^kernels\.cross_entropy: logits must have a class dim"),
        (lambda: cross_entropy(_X[:3, :0], _T[:3]), ValueError,
         r"^kernels\.cross_entropy: logits must have at least one class"),
        (lambda: cross_entropy(_X.long(), _T), TypeError,
         r"^kernels\.cross_entropy: logits must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: cross_entropy(_X.double(), _T), TypeError,
         r"^kernels\.cross_entropy: logits must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: cross_entropy(_X, _T.float()), TypeError,
         r"^kernels\.cross_entropy: target must be int64 \(or int32\) class indices, got torch\.float32 "
         r"\(class-probability targets are not supported"),
        (lambda: cross_entropy(_X, _T.to(torch.int16)), TypeError,
         r"^kernels\.cross_entropy: target must be int64 \(or int32\) class indices, got torch\.int16$"),
        (lambda: cross_entropy(_X.cpu().numpy(), _T), TypeError,
         r"^kernels\.cross_entropy: logits must be a torch\.Tensor, got ndarray"),
        (lambda: cross_entropy(_X, [1, 2, 3, 4]), TypeError,
         r"^kernels\.cross_entropy: target must be a torch\.Tensor, got list"),
        (lambda: cross_entropy(_X, _T.to("meta")), ValueError,
         r"^kernels\.cross_entropy: logits and target must be on the same device, got \S+ and meta"),
        (lambda: cross_entropy(_X, _T, reduction="avg"), ValueError,
         r"^kernels\.cross_entropy: reduction must be 'mean' or 'sum' or 'none', got 'avg'"),
        (lambda: cross_entropy(_X, _T, reduction=None), TypeError, r"^kernels\.cross_entropy: reduction must be"),
        (lambda: cross_entropy(_X, _T, label_smoothing=1.5), ValueError,
         r"^kernels\.cross_entropy: label_smoothing must be in \[0, 1\], got 1\.5"),
        (lambda: cross_entropy(_X, _T, label_smoothing="0.1"), TypeError,
         r"^kernels\.cross_entropy: label_smoothing must be a float"),
        (lambda: cross_entropy(_X, _T, ignore_index=1.0), TypeError,
         r"^kernels\.cross_entropy: ignore_index must be an int, got float"),
        # the custom op validates too, when called directly through torch.ops
        (lambda: torch.ops.kernels.cross_entropy(_X.double(), _T, -100, "mean", 0.0, False), TypeError,
         r"^kernels\.cross_entropy: logits must be float32"),
        (lambda: torch.ops.kernels.cross_entropy(_X, _t(0, 0, 0, 99), -100, "mean", 0.0, False),
         ValueError, r"^kernels\.cross_entropy: target must hold class indices"),
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
