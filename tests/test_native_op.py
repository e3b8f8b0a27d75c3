"""kernel_ladder.native: the C++ dispatcher ops (RMSNorm, softmax) against float64 references.

Shapes, dtypes and layouts (no copy of a strided input), special values, bad input, gradients
(gradcheck, no double backward, deterministic dw), torch.library.opcheck, torch.compile with dynamic
shapes, inference_mode; and the build's cache key, lock and missing-tool errors. Skipped as a whole
where no C++ compiler or ninja is found (the extension is optional); the first test of a fresh
checkout builds it (a minute), later runs load it from the cache.
"""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import pytest
import torch

from kernel_ladder import native
from kernel_ladder.native import _build
from tests.helpers import assert_matches, make_input

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="no C++ compiler or ninja: the extension cannot be built")

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SHAPES = [(5, 1), (1, 7), (5, 33), (5, 1000), (0, 33), (2, 3, 33), (3, 0, 7)]
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "permuted")


@pytest.fixture(scope="module")
def ops():
    native.load()
    return torch.ops.kernel_ladder_native


@pytest.fixture
def poisoned_empty():
    """Every at::empty (the kernels' output allocations included, in C++) filled with NaN: an element
    a kernel forgets to write shows up as NaN."""
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.utils.deterministic.fill_uninitialized_memory = before[1]


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def aten_ops_run(fn) -> set[str]:
    """The aten ops a call runs, nested ones included (the profiler sees every op the dispatcher runs,
    also those called from C++)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


COPIES = {"aten::contiguous", "aten::clone", "aten::copy_", "aten::_to_copy"}

# ---------------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_float64(ops, gen, poisoned_empty, shape, dtype):
    x = make_input(shape, dtype, "contiguous", gen, device=CPU)
    w = make_input(shape[-1:], dtype, "contiguous", gen, device=CPU)
    y, rstd = ops.rms_norm_forward(x, w, 1e-6)
    assert_matches(y, rms_norm_reference(x, w, 1e-6), dtype, equal_nan=shape[-1] == 0)
    assert rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rstd.shape == shape[:-1]
    expected = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)  # NaN for C = 0 (a mean of nothing), as here
    torch.testing.assert_close(rstd.double(), expected, rtol=1e-5, atol=0, equal_nan=True)
    assert_matches(native.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), dtype, equal_nan=shape[-1] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_softmax_matches_float64(ops, gen, poisoned_empty, shape, dtype):
    x = make_input(shape, dtype, "contiguous", gen, scale=4.0, device=CPU)
    assert_matches(native.softmax(x), torch.softmax(x.double(), -1), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs_are_read_in_place(ops, gen, layout, dtype):
    """Any layout gives the contiguous input's result bitwise, and no aten op copies x."""
    x = make_input((3, 4, 33), dtype, layout, gen, device=CPU)
    w = make_input((66,), dtype, "contiguous", gen, device=CPU)[::2]  # a strided weight too
    dense, dense_w = x.contiguous(), w.contiguous()
    assert torch.equal(native.rms_norm(x, w), native.rms_norm(dense, dense_w))
    assert torch.equal(native.softmax(x), native.softmax(dense))
    assert not COPIES & aten_ops_run(lambda: (native.rms_norm(x, w), native.softmax(x)))
    grad = make_input((3, 4, 33), dtype, layout, gen, device=CPU)  # a strided incoming gradient
    y, rstd = ops.rms_norm_forward(x, w, 1e-6)
    for got, want in zip(ops.rms_norm_backward(grad, x, w, rstd), ops.rms_norm_backward(grad.contiguous(), dense,
                                                                                       dense_w, rstd)):
        assert torch.equal(got, want)
    assert not COPIES & aten_ops_run(lambda: ops.rms_norm_backward(grad, x, w, rstd))
    s = native.softmax(x)
    assert torch.equal(ops.softmax_backward(grad, s), ops.softmax_backward(grad.contiguous(), s))


def test_the_copy_check_sees_a_copy(gen):
    """Negative control: the profiler check above does see a copy made inside a call."""
    x = make_input((3, 33), torch.float32, "transposed", gen, device=CPU)
    assert COPIES & aten_ops_run(lambda: native.softmax(x.contiguous()))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernels_read_strided_inputs_in_place(ops, gen, layout, dtype):
    """On a GPU: every layout (a transposed or sliced one takes the column-stride kernels, a permuted batch one
    launch per slice) against float64, with a strided weight and incoming gradient, and no aten op copies."""
    cuda = torch.device("cuda")
    for cols in (33, 700, 1100):  # the warp kernels; rows the column-stride path gives the block kernels; both
        x = make_input((3, 4, cols), dtype, layout, gen, device=cuda)
        w = make_input((2 * cols,), dtype, "contiguous", gen, device=cuda)[::2]
        grad = make_input((3, 4, cols), dtype, layout, gen, device=cuda)
        y, rstd = ops.rms_norm_forward(x, w, 1e-6)
        assert_matches(y, rms_norm_reference(x, w, 1e-6), dtype, what=f"{cols}: y")
        x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
        torch.autograd.backward(rms_norm_reference(x64, w64, 1e-6), grad.double())
        grad_x, grad_w = ops.rms_norm_backward(grad, x, w, rstd)
        assert_matches(grad_x, x64.grad, dtype, slack=4, what=f"{cols}: grad_x")
        assert_matches(grad_w, w64.grad, dtype, slack=16, what=f"{cols}: grad_weight")
        s = ops.softmax_forward(x)
        assert_matches(s, torch.softmax(x.double(), -1), dtype, what=f"{cols}: softmax")
        s64, g64 = s.double(), grad.double()
        want = s64 * (g64 - (g64 * s64).sum(-1, keepdim=True))
        assert_matches(ops.softmax_backward(grad, s), want, dtype, slack=4, what=f"{cols}: softmax grad_x")
        calls = (lambda: (ops.rms_norm_forward(x, w, 1e-6), ops.rms_norm_backward(grad, x, w, rstd),
                          ops.softmax_forward(x), ops.softmax_backward(grad, s)))  # fmt: skip
        assert not COPIES & aten_ops_run(calls)


def test_outputs_are_new_contiguous_tensors(gen):
    x = make_input((4, 33), torch.float32, "sliced", gen, device=CPU)
    w = torch.ones(33)
    y = native.rms_norm(x, w)
    assert y.is_contiguous() and y.data_ptr() not in (x.data_ptr(), w.data_ptr())
    assert native.softmax(x).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_rms_norm_of_huge_values_does_not_overflow(dtype):
    """1e30 squared overflows float32: the row is summed again, scaled (y stays about x / |x|)."""
    x = torch.tensor([[1e30, -3e30, 2e30, 5e29], [3e38, 1.0, -1e38, 0.0]], dtype=torch.float64).to(dtype)
    w = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=dtype)
    y = native.rms_norm(x, w)
    assert torch.isfinite(y).all()
    assert_matches(y, rms_norm_reference(x, w, 1e-6), dtype)


def test_rms_norm_nan_and_inf_propagate_as_the_float64_reference():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 2.0], [1.0, inf, 2.0], [-inf, 0.0, 3.0], [1e-30, 0.0, -1e-30]])
    w = torch.tensor([1.0, 2.0, 3.0])
    y = native.rms_norm(x, w)
    want = rms_norm_reference(x, w, 1e-6)  # NaN rows, inf * 0 = NaN, finite * 0 = 0, tiny rows scaled by eps
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert_matches(y, want, torch.float32, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_special_rows_behave_as_torch(dtype):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([
        [-inf, -inf, -inf, -inf],      # all -inf: NaN (exp(-inf - -inf)), like torch
        [-inf, 0.0, -inf, 1.0],        # some -inf: exact zeros there
        [1.0, nan, 2.0, 3.0],          # a NaN: the whole row NaN
        [1.0, inf, 2.0, 3.0],          # +inf: NaN (inf - inf)
        [5.0, 5.0, 5.0, 5.0],          # all equal: 1/4 each
        [1e30, -1e30, 0.0, 1e30],      # huge values: no overflow
        [-200.0, 0.0, -90.0, -110.0],  # exps below float32's normal range: 0 or subnormal
    ], dtype=torch.float64).to(dtype)
    y = native.softmax(x)
    want = torch.softmax(x.double(), -1)
    assert torch.equal(torch.isnan(y), torch.isnan(want)), (y, want)
    assert torch.equal(y[1] == 0, want[1] == 0)
    assert_matches(y, want, dtype, equal_nan=True)
    assert torch.equal(torch.isnan(y), torch.isnan(torch.softmax(x, -1)))  # torch in the same dtype agrees


def test_softmax_exp_is_accurate_over_the_whole_range():
    """The vectorized exp (float32) against float64 over [-104, 0], every row a single element plus 0."""
    z = torch.linspace(-104.0, 0.0, 100_001, dtype=torch.float32)
    pairs = torch.stack([z, torch.zeros_like(z)], dim=-1)  # softmax of (z, 0): e^z / (e^z + 1)
    got = native.softmax(pairs)[:, 0].double()
    want = torch.softmax(pairs.double(), -1)[:, 0]
    rel = ((got - want).abs() / want.clamp_min(1e-300))[want > 1e-37]  # normal range: relative error
    assert rel.max() < 4e-7, rel.max()
    tiny = want <= 1.18e-38  # float32's subnormal range: within one subnormal step (2**-149) absolutely
    assert tiny.sum() > 1000 and (got - want)[tiny].abs().max() <= 2.0**-149


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------

BAD_RMS_NORM = [
    (lambda: (torch.tensor(1.0), torch.ones(1), 1e-6), ValueError, "x must have at least one dim .* got a 0-d tensor"),
    (lambda: (torch.ones(3, 4), torch.ones(5), 1e-6), ValueError, r"weight must have shape \(4,\) .* got \(5,\)"),
    (lambda: (torch.ones(3, 4), torch.ones(2, 2), 1e-6), ValueError, r"weight must have shape \(4,\) .* got \(2, 2\)"),
    (lambda: (torch.ones(3, 4), torch.ones(4, dtype=torch.float64), 1e-6), TypeError,
     "weight must have x's dtype torch.float32, got torch.float64"),
    (lambda: (torch.ones(3, 4, dtype=torch.int64), torch.ones(4, dtype=torch.int64), 1e-6), TypeError,
     "x must be torch.float32, torch.float64, torch.float16 or torch.bfloat16, got torch.int64"),
    (lambda: (torch.ones(3, 4), torch.ones(4), -1e-6), ValueError, "eps must be a finite number >= 0, got -1e-06"),
    (lambda: (torch.ones(3, 4), torch.ones(4), math.nan), ValueError, "eps must be a finite number >= 0, got nan"),
    (lambda: (torch.ones(3, 4), torch.ones(4), math.inf), ValueError, "eps must be a finite number >= 0, got inf"),
    (lambda: (torch.ones(3, 4), torch.ones(4, device="meta"), 1e-6), ValueError,
     "weight must be on x's device cpu, got meta"),
    (lambda: ([1.0, 2.0], torch.ones(2), 1e-6), TypeError, "x must be a torch.Tensor, got list"),
    (lambda: (torch.ones(3, 4), torch.ones(4), "1e-6"), TypeError, "eps must be a float, got str"),
]


@pytest.mark.parametrize("case", range(len(BAD_RMS_NORM)))
def test_rms_norm_bad_input_is_named(case):
    args, error, message = BAD_RMS_NORM[case]
    with pytest.raises(error, match="^kernel_ladder.native.rms_norm: " + message):
        native.rms_norm(*args())


def test_the_same_errors_come_from_the_ops_and_their_meta_kernels(ops):
    for device in ("cpu", "meta"):
        x, w = torch.ones(3, 4, device=device), torch.ones(5, device=device)
        with pytest.raises(ValueError, match=r"^kernel_ladder.native.rms_norm: weight must have shape \(4,\)"):
            ops.rms_norm_forward(x, w, 1e-6)
        with pytest.raises(TypeError, match="^kernel_ladder.native.softmax: x must be torch.float32.*got torch.int32"):
            ops.softmax_forward(torch.ones(3, dtype=torch.int32, device=device))
        x, w, rstd = torch.ones(3, 4, device=device), torch.ones(4, device=device), torch.ones(3, device=device)
        with pytest.raises(ValueError, match=r"^kernel_ladder.native.rms_norm \(backward\): grad_y must have x's "
                                             r"shape \(3, 4\), got \(3, 5\)"):
            ops.rms_norm_backward(torch.ones(3, 5, device=device), x, w, rstd)
        with pytest.raises(TypeError, match=r"^kernel_ladder.native.rms_norm \(backward\): rstd must be "
                                            "torch.float32 for x of torch.float32, got torch.float64"):
            ops.rms_norm_backward(x, x, w, rstd.double())
        with pytest.raises(TypeError, match=r"^kernel_ladder.native.softmax \(backward\): grad_y must have y's "
                                            "dtype torch.float32, got torch.float16"):
            ops.softmax_backward(x.half(), x)
    with pytest.raises(ValueError, match="^kernel_ladder.native.softmax: x must have at least one dim"):
        native.softmax(torch.tensor(1.0))
    with pytest.raises(TypeError, match="^kernel_ladder.native.softmax: x must be a torch.Tensor, got tuple"):
        native.softmax((1.0, 2.0))


def _ones(*shape, dtype=torch.float32, device="cpu"):
    return torch.ones(shape, dtype=dtype, device=device)


#: (backend op, arguments on a device) that every shared check refuses, one case per branch of checks.cpp that
#: does not depend on the device (those that do name it); the Meta, CPU and CUDA kernels must raise the same
BAD_BACKEND_CALLS = [
    ("rms_norm_forward", lambda d: (_ones(device=d).sum(), _ones(1, device=d), 1e-6)),
    ("rms_norm_forward", lambda d: (_ones(3, 4, dtype=torch.int32, device=d), _ones(4, device=d), 1e-6)),
    ("rms_norm_forward", lambda d: (_ones(3, 4, device=d), _ones(5, device=d), 1e-6)),
    ("rms_norm_forward", lambda d: (_ones(3, 4, device=d), _ones(2, 2, device=d), 1e-6)),
    ("rms_norm_forward", lambda d: (_ones(3, 4, device=d), _ones(4, dtype=torch.float16, device=d), 1e-6)),
    ("rms_norm_forward", lambda d: (_ones(3, 4, device=d), _ones(4, device=d), -1e-6)),
    ("rms_norm_forward", lambda d: (_ones(3, 4, device=d), _ones(4, device=d), math.inf)),
    (
        "rms_norm_backward",
        lambda d: (_ones(3, 5, device=d), _ones(3, 4, device=d), _ones(4, device=d), _ones(3, device=d)),
    ),
    (
        "rms_norm_backward",
        lambda d: (
            _ones(3, 4, dtype=torch.float64, device=d),
            _ones(3, 4, device=d),
            _ones(4, device=d),
            _ones(3, device=d),
        ),
    ),
    (
        "rms_norm_backward",
        lambda d: (_ones(3, 4, device=d), _ones(3, 4, device=d), _ones(3, device=d), _ones(3, device=d)),
    ),
    (
        "rms_norm_backward",
        lambda d: (_ones(3, 4, device=d), _ones(3, 4, device=d), _ones(4, device=d), _ones(4, device=d)),
    ),
    (
        "rms_norm_backward",
        lambda d: (
            _ones(3, 4, device=d),
            _ones(3, 4, device=d),
            _ones(4, device=d),
            _ones(3, dtype=torch.float64, device=d),
        ),
    ),
    ("softmax_forward", lambda d: (_ones(device=d).sum(),)),
    ("softmax_forward", lambda d: (_ones(3, dtype=torch.int64, device=d),)),
    ("softmax_backward", lambda d: (_ones(3, 4, device=d), _ones(3, 5, device=d))),
    ("softmax_backward", lambda d: (_ones(3, 4, dtype=torch.bfloat16, device=d), _ones(3, 4, device=d))),
    ("softmax_backward", lambda d: (_ones(3, 4, device=d), _ones(3, 4, dtype=torch.int32, device=d))),
]


def _error_of(ops, name: str, args: tuple, device: str) -> tuple[type, str]:
    """The exception type and message the backend op raises, with the device's name written as "<device>"."""
    with pytest.raises((ValueError, TypeError)) as info:
        getattr(ops, name)(*args)
    return info.type, str(info.value).splitlines()[0].replace(device, "<device>")


@pytest.mark.parametrize("case", range(len(BAD_BACKEND_CALLS)))
def test_bad_backend_calls_get_the_same_error_from_every_kernel(ops, case):
    """The CPU and Meta kernels (and the CUDA kernels: the gpu test below) run the same shared checks: the same
    type, the same message, starting with the user-facing op's name."""
    name, make = BAD_BACKEND_CALLS[case]
    error = _error_of(ops, name, make("cpu"), "cpu")
    assert error == _error_of(ops, name, make("meta"), "meta")
    user_op = "rms_norm" if name.startswith("rms_norm") else "softmax"
    backward = r" \(backward\)" if name.endswith("backward") else ""
    assert re.match(rf"kernel_ladder\.native\.{user_op}{backward}: ", error[1]), error


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(BAD_BACKEND_CALLS)))
def test_bad_backend_calls_get_the_same_error_on_cuda_as_on_the_cpu(ops, case):
    name, make = BAD_BACKEND_CALLS[case]
    assert _error_of(ops, name, make("cuda"), "cuda:0") == _error_of(ops, name, make("cpu"), "cpu")


def _function_bodies(source: str) -> dict[str, str]:
    """The body of each kernel function ``<op>_<backend>(...) { ... }`` of a C++ source, by name."""
    pattern = r"\b((?:rms_norm|softmax)_(?:forward|backward)_(?:cpu|meta|cuda))\([^;{]*?\)\s*\{\n(.*?)\n\}"
    return dict(re.findall(pattern, source, flags=re.S))


def test_every_backend_runs_the_shared_check_of_its_op_first():
    """Each backend op's CPU, Meta and CUDA kernels begin with the same call of the same shared check (native.h)
    with the same op name, so a bad argument gets the same error on any device (the CUDA file is only compiled
    where CUDA is: this reads it). ops_cuda.cu keeps checks of CUDA's own alone: none of the shared checks'
    messages is written there again."""
    csrc = Path(native.__file__).parent / "csrc"
    bodies = {}
    for file in ("cpu/rms_norm.cpp", "cpu/softmax.cpp", "meta.cpp", "cuda/ops_cuda.cu"):
        bodies |= _function_bodies((csrc / file).read_text())
    first_checks = {}
    for function, body in bodies.items():
        found = re.search(r"\bcheck_\w+\(\w+", body)
        assert found, f"{function} runs no check"
        first_checks.setdefault(function.rsplit("_", 1)[0], set()).add(found.group(0))
    expected = {
        "rms_norm_forward": "check_rms_norm_forward(kRmsNorm",
        "rms_norm_backward": "check_rms_norm_backward(kRmsNormBackward",
        "softmax_forward": "check_softmax_forward(kSoftmax",
        "softmax_backward": "check_softmax_backward(kSoftmaxBackward",
    }
    assert len(bodies) == 12 and first_checks == {op: {call} for op, call in expected.items()}, first_checks
    cuda = (csrc / "cuda" / "ops_cuda.cu").read_text()
    messages = (m.strip(" :") for m in re.findall(r'"([^"]*must[^"]*)"', (csrc / "checks.cpp").read_text()))
    shared_messages = {m for m in messages if len(m) > 12}  # " must be on " alone is CUDA's own check too
    again = sorted(m for m in shared_messages if m in cuda)
    assert shared_messages and not again, f"ops_cuda.cu checks again what checks.cpp does: {again}"


# ---------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
def test_gradcheck_in_float64(gen, layout):
    x = make_input((3, 2, 7), torch.float64, layout, gen, device=CPU).requires_grad_()
    w = make_input((7,), torch.float64, "contiguous", gen, device=CPU).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: native.rms_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(native.softmax, (x,))


def test_double_backward_is_refused_with_the_backend_op_named(gen):
    x = make_input((3, 7), torch.float64, "contiguous", gen, device=CPU).requires_grad_()
    w = make_input((7,), torch.float64, "contiguous", gen, device=CPU).requires_grad_()
    with pytest.raises(RuntimeError, match="derivative for kernel_ladder_native::rms_norm_backward is not implemented"):
        torch.autograd.gradgradcheck(lambda a, b: native.rms_norm(a, b, 1e-5), (x, w))
    with pytest.raises(RuntimeError, match="derivative for kernel_ladder_native::softmax_backward is not implemented"):
        torch.autograd.gradgradcheck(native.softmax, (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 33), (2, 3, 1000), (70, 7), (0, 7)], ids=str)
def test_gradients_match_float64(gen, poisoned_empty, shape, dtype):
    x = make_input(shape, dtype, "contiguous", gen, device=CPU).requires_grad_()
    w = make_input(shape[-1:], dtype, "contiguous", gen, device=CPU).requires_grad_()
    dy = make_input(shape, dtype, "transposed", gen, device=CPU)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    native.rms_norm(x, w, 1e-6).backward(dy)
    rms_norm_reference(x64, w64, 1e-6).backward(dy.double())
    slack = 4.0 if dtype in (torch.float16, torch.bfloat16) else 1.0  # a sum of C products, rounded
    assert_matches(x.grad, x64.grad, dtype, slack=slack, what="grad_x")
    assert_matches(w.grad, w64.grad, dtype, slack=slack * max(1, shape[0] // 16), what="grad_weight")
    x.grad = None
    native.softmax(x).backward(dy)
    x64.grad = None
    torch.softmax(x64, -1).backward(dy.double())
    assert_matches(x.grad, x64.grad, dtype, slack=slack, what="softmax grad_x")


def test_backward_is_bitwise_deterministic_for_any_thread_count(gen):
    x = make_input((300, 257), torch.float32, "contiguous", gen, device=CPU).requires_grad_()
    w = make_input((257,), torch.float32, "contiguous", gen, device=CPU).requires_grad_()
    dy = make_input((300, 257), torch.float32, "contiguous", gen, device=CPU)
    threads = torch.get_num_threads()
    grads = []
    try:
        for n in (1, 2, 3, 1, 2):
            torch.set_num_threads(n)
            x.grad = w.grad = None
            native.rms_norm(x, w).backward(dy)
            grads.append((x.grad.clone(), w.grad.clone()))
    finally:
        torch.set_num_threads(threads)
    for gx, gw in grads[1:]:
        assert torch.equal(gx, grads[0][0]) and torch.equal(gw, grads[0][1])


def test_grad_of_a_sum_whose_incoming_gradient_has_stride_zero():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    native.rms_norm(x, w).sum().backward()  # grad_y is an expanded scalar: every stride 0
    x64, w64 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(x64, w64, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, x64.grad)
    torch.testing.assert_close(w.grad, w64.grad)


def test_inference_mode_and_no_grad(gen):
    x = make_input((3, 33), torch.float32, "contiguous", gen, device=CPU).requires_grad_()
    w = torch.randn(33, requires_grad=True)
    with torch.inference_mode():
        y = native.rms_norm(x, w)
        s = native.softmax(x)
    assert y.is_inference() and not y.requires_grad and not s.requires_grad
    with torch.no_grad():
        assert not native.rms_norm(x, w).requires_grad
    assert torch.equal(y, native.rms_norm(x, w).detach())


# ---------------------------------------------------------------------------------------------------
# torch.library and torch.compile
# ---------------------------------------------------------------------------------------------------


def test_opcheck_every_op(ops, gen):
    x = make_input((3, 2, 33), torch.float32, "sliced", gen, device=CPU)
    w = make_input((33,), torch.float32, "contiguous", gen, device=CPU)
    y, rstd = ops.rms_norm_forward(x, w, 1e-6)
    dy = torch.randn_like(y)
    cases = [
        (ops.rms_norm, (x.clone().requires_grad_(), w.clone().requires_grad_(), 1e-6)),
        (ops.softmax, (x.clone().requires_grad_(),)),
        (ops.rms_norm_forward, (x, w, 1e-6)),
        (ops.rms_norm_backward, (dy, x, w, rstd)),
        (ops.softmax_forward, (x,)),
        (ops.softmax_backward, (dy, ops.softmax_forward(x))),
    ]
    for op, args in cases:
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


def test_torch_compile_fullgraph_dynamic_shapes_without_recompiling(gen):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")  # AOTAutograd: the fake (Meta) kernels and the C++ autograd

    def f(x, w):
        return native.softmax(native.rms_norm(x, w, 1e-5) * 2.0)

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for shape in [(3, 8), (5, 33), (7, 100), (2, 4, 17), (3, 5, 9)]:
        x = make_input(shape, torch.float64, "contiguous", gen, device=CPU).requires_grad_()
        w = make_input(shape[-1:], torch.float64, "contiguous", gen, device=CPU).requires_grad_()
        got = compiled(x, w)
        got.backward(torch.ones_like(got) * torch.arange(shape[-1]))  # a different weight per column
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        want = f(x, w)
        want.backward(torch.ones_like(want) * torch.arange(shape[-1]))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, w.grad)
    # One graph per rank: the sizes are symbolic, the number of dims is not.
    assert backend.frame_count == 2, backend.frame_count
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_torch_compile_with_inductor(gen):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: native.rms_norm(x, w) + 1.0, fullgraph=True, dynamic=True)
    for rows in (3, 6):
        x = make_input((rows, 33), torch.float32, "contiguous", gen, device=CPU)
        w = make_input((33,), torch.float32, "contiguous", gen, device=CPU)
        torch.testing.assert_close(compiled(x, w), native.rms_norm(x, w) + 1.0)


# ---------------------------------------------------------------------------------------------------
# the build
# ---------------------------------------------------------------------------------------------------


def test_the_cache_key_follows_sources_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LADDER_NATIVE_DIR", str(tmp_path))
    config = _build.build_config()
    first = _build.cache_dir(config)
    assert first.parent == tmp_path
    assert _build.cache_dir(config) == first  # stable
    assert _build.cache_dir({**config, "extra_cflags": [*config["extra_cflags"], "-DX"]}) != first
    assert _build.cache_dir({**config, "torch": "0.0.0"}) != first
    assert "-march=native" not in config["extra_cflags"]
    copied = tmp_path / "csrc"
    for path in _build.CSRC.rglob("*"):
        if path.is_file():
            target = copied / path.relative_to(_build.CSRC)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    monkeypatch.setattr(_build, "CSRC", copied)
    assert _build.cache_dir(config) == first
    (copied / "cpu" / "rows.h").write_text((copied / "cpu" / "rows.h").read_text() + "\n// changed\n")
    assert _build.cache_dir(config) != first  # a header counts


def test_missing_tools_give_an_error_saying_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LADDER_NATIVE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setattr(_build, "_LOADED", None)
    monkeypatch.setattr(_build, "_compiler", lambda: None)
    monkeypatch.setattr(_build, "_ninja", lambda: None)
    assert not native.available()
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler .*apt install g\\+\\+.*; no ninja: "
                                                      "pip install ninja. The Triton ops .* need none of it"):
        native.load()
    monkeypatch.setattr(_build, "_compiler", lambda: "/usr/bin/c++")
    assert not native.available()  # ninja still missing
    with pytest.raises(native.NativeBuildError, match="cannot build the C\\+\\+ extension: no ninja: pip install "):
        native.build()


def test_concurrent_builds_compile_once(tmp_path, monkeypatch):
    """Two builders at once (as two pytest-xdist workers): the lock makes one compile, the other reuse it."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("KERNEL_LADDER_NATIVE_DIR", str(tmp_path))
    compiles = []

    def fake_load(name, sources, build_directory, **kwargs):
        compiles.append(build_directory)
        threading.Event().wait(0.3)  # long enough for the other builder to reach the lock
        (tmp_path / build_directory / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    results = []
    builders = [threading.Thread(target=lambda: results.append(native.build())) for _ in range(2)]
    for b in builders:
        b.start()
    for b in builders:
        b.join()
    assert len(compiles) == 1 and len(results) == 2 and results[0] == results[1]


def test_python_m_kernel_ladder_native_info_and_build(ops, capsys):
    from kernel_ladder.native.__main__ import main

    assert main(["build"]) == 0  # built by the fixture: nothing to compile
    printed = capsys.readouterr().out
    assert re.search(r"kernel_ladder.native: already built .*kernel_ladder_native.so in \d+\.\d s", printed)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "(built, loaded)" in out and f"torch {torch.__version__}" in out
    assert " ".join(_build.build_config()["extra_cflags"]) in out


def test_every_cache_folder_follows_one_rule(monkeypatch, tmp_path):
    """The library's build cache and the course's (g++, nvcc, the CUDA emulator) live under one root:
    $XDG_CACHE_HOME (else ~/.cache)/kernel_ladder/<kind>, each overridable by its own variable."""
    from kernel_ladder.native import _build
    from utils import cpp, nvcc, simt

    for name in ("KERNEL_LADDER_NATIVE_DIR", "KERNEL_LADDER_CPP_CACHE", "KERNEL_LADDER_NVCC_CACHE",
                 "KERNEL_LADDER_SIMT_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "kernel_ladder"
    assert cpp.cache_dir() == root / "cpp"
    assert nvcc._cache_dir() == root / "nvcc"
    assert simt._cache_dir() == root / "simt"
    assert _build.cache_dir().parent == root / "native"
    monkeypatch.setenv("KERNEL_LADDER_SIMT_CACHE", str(tmp_path / "own"))
    assert simt._cache_dir() == tmp_path / "own"
