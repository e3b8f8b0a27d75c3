"""kernel_ladder.dropout and kernel_ladder.dropout_mask: the mask's determinism and statistics, exact edge cases,
a backward that regenerates the same mask, and masks that do not depend on memory layout."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import test_seed

import kernel_ladder
from kernel_ladder import _elementwise, _launch

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE


@pytest.fixture
def seed() -> int:
    """A fresh dropout seed each run (printed, replayable), spread over the whole 63-bit range."""
    value = (test_seed() * 0x9E3779B97F4A7C15) % (2**63)
    print(f"dropout seed: {value}")
    return value


def randn(*shape, gen, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def test_same_seed_same_output_other_seed_other_mask(gen, seed):
    x = randn(40, 51, gen=gen)
    first = kernel_ladder.dropout(x, 0.5, seed=seed)
    assert torch.equal(first, kernel_ladder.dropout(x, 0.5, seed=seed))
    other = kernel_ladder.dropout(x, 0.5, seed=(seed + 1) % 2**63)
    assert not torch.equal(first != 0, other != 0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_fraction_kept_is_one_minus_p(p, seed):
    n = 60_000
    mask = kernel_ladder.dropout_mask((n,), p, seed).double()
    q = 1 - p
    # 5 standard deviations of a binomial fraction: fails by chance about once in 3.5 million runs.
    assert abs(mask.mean().item() - q) < 5 * math.sqrt(p * q / n)
    # Neighbours are independent (a counter-based RNG must not stripe): P(both kept) = q^2. The
    # pair indicators overlap, so their mean's variance has a covariance term q^3 - q^4.
    both = (mask[1:] * mask[:-1]).mean().item()
    assert abs(both - q**2) < 5 * math.sqrt((q**2 * (1 - q**2) + 2 * (q**3 - q**4)) / n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kept_values_are_scaled_and_dropped_ones_are_zero(dtype, gen, seed):
    p = 0.3
    x = randn(7, 301, gen=gen, dtype=dtype)
    out = kernel_ladder.dropout(x, p, seed=seed)
    keep = kernel_ladder.dropout_mask(x.shape, p, seed)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))
    expected = (x.double() / (1 - p))[keep].to(dtype)
    rtol, atol = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}[dtype]
    torch.testing.assert_close(out[keep].double(), expected.double(), rtol=rtol, atol=atol)


def test_mask_does_not_depend_on_dtype(gen, seed):
    x = randn(3, 1000, gen=gen)
    masks = [kernel_ladder.dropout(x.to(dtype), 0.4, seed=seed) != 0 for dtype in (torch.float32, torch.bfloat16)]
    assert torch.equal(masks[0], masks[1])


def test_backward_applies_the_same_mask(gen, seed):
    p = 0.25
    x = randn(9, 130, gen=gen).requires_grad_()
    grad_out = randn(9, 130, gen=gen)
    out = kernel_ladder.dropout(x, p, seed=seed)
    (grad,) = torch.autograd.grad(out, [x], grad_out)
    keep = out != 0
    assert torch.equal(keep, kernel_ladder.dropout_mask(x.shape, p, seed))
    torch.testing.assert_close(grad, torch.where(keep, grad_out / (1 - p), 0.0), rtol=1e-6, atol=1e-6)
    # A strided grad_out (e.g. from a transpose downstream) gets the mask by logical index too.
    grad_t = randn(130, 9, gen=gen).t()
    (grad,) = torch.autograd.grad(kernel_ladder.dropout(x, p, seed=seed), [x], grad_t)
    torch.testing.assert_close(grad, torch.where(keep, grad_t / (1 - p), 0.0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "many_dims"])
def test_strided_view_gets_the_mask_of_its_contiguous_copy(layout, gen, seed):
    if layout == "transposed":
        x = randn(70, 33, gen=gen).t()
    elif layout == "sliced":
        x = randn(12, 90, gen=gen)[2:, ::3]
    elif layout == "expanded":
        x = randn(1, 80, gen=gen).abs().add(0.5).expand(11, 80)
    else:  # six unmergeable dims: launched per slice, each slice offset by its first logical index
        x = randn(5, 2, 3, 2, 3, 2, gen=gen).permute(5, 4, 3, 2, 1, 0)
    assert not x.is_contiguous()
    assert torch.equal(kernel_ladder.dropout(x, 0.5, seed=seed), kernel_ladder.dropout(x.contiguous(), 0.5, seed=seed))


def test_int64_offsets_give_the_same_mask(monkeypatch, gen, seed):
    x = randn(50, 61, gen=gen)
    ordinary = kernel_ladder.dropout(x, 0.5, seed=seed)
    monkeypatch.setattr(_launch, "INT32_MAX", 100)  # force the path huge tensors take
    assert _elementwise.plan_elementwise(x.shape, [x], [torch.empty(x.shape)])[0].index_64
    assert torch.equal(kernel_ladder.dropout(x, 0.5, seed=seed), ordinary)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_p_zero_is_exactly_the_identity_and_p_one_exactly_zeros(dtype, gen, seed):
    x = randn(5, 333, gen=gen, dtype=dtype)
    same = kernel_ladder.dropout(x.t(), 0.0, seed=seed)
    assert torch.equal(same, x.t()) and same.is_contiguous()
    x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    zeros = kernel_ladder.dropout(x, 1.0, seed=seed)
    assert torch.equal(zeros, torch.zeros_like(x))
    assert not torch.signbit(zeros).any()
    assert kernel_ladder.dropout_mask(x.shape, 0.0, seed).all()
    assert not kernel_ladder.dropout_mask(x.shape, 1.0, seed).any()
    # Gradients of the edge cases are exact too.
    leaf = x.detach().clone().nan_to_num().requires_grad_()
    (g0,) = torch.autograd.grad(kernel_ladder.dropout(leaf, 0.0, seed=seed), [leaf], torch.ones_like(leaf))
    (g1,) = torch.autograd.grad(kernel_ladder.dropout(leaf, 1.0, seed=seed), [leaf], torch.ones_like(leaf))
    assert torch.equal(g0, torch.ones_like(leaf)) and torch.equal(g1, torch.zeros_like(leaf))


def test_not_training_returns_the_input_itself(gen):
    x = randn(4, 5, gen=gen)
    assert kernel_ladder.dropout(x, 0.9, training=False) is x


def test_seed_none_draws_from_torchs_generator(gen):
    x = randn(4, 500, gen=gen)
    torch.manual_seed(1234)
    first = kernel_ladder.dropout(x, 0.5)
    second = kernel_ladder.dropout(x, 0.5)
    torch.manual_seed(1234)
    assert torch.equal(kernel_ladder.dropout(x, 0.5), first)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (1, 1, 1), (1031,)], ids=str)
def test_edge_shapes(shape, gen, seed):
    x = randn(*shape, gen=gen)
    out = kernel_ladder.dropout(x, 0.5, seed=seed)
    keep = kernel_ladder.dropout_mask(shape, 0.5, seed)
    assert out.shape == x.shape and keep.shape == x.shape and keep.dtype == torch.bool
    torch.testing.assert_close(out, torch.where(keep, x * 2, 0.0))


def test_mask_index_is_logical_row_major(seed):
    """The mask of a (3, 400) tensor is the flat mask of 1200 elements, reshaped."""
    assert torch.equal(kernel_ladder.dropout_mask((3, 400), 0.5, seed),
                       kernel_ladder.dropout_mask((1200,), 0.5, seed).view(3, 400))
    assert torch.equal(kernel_ladder.dropout_mask(torch.Size([1200]), 0.5, seed),
                       kernel_ladder.dropout_mask(1200, 0.5, seed))


def test_torch_compile_with_seed_from_the_caller(gen, seed):
    def layer(x, s):
        return kernel_ladder.dropout(kernel_ladder.gelu(x), 0.2, seed=s)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    x = randn(8, 100, gen=gen).requires_grad_()
    grad_out = randn(8, 100, gen=gen)
    got = compiled(x, seed)
    assert torch.equal(got, layer(x, seed))
    (g_compiled,) = torch.autograd.grad(got, [x], grad_out)
    (g_eager,) = torch.autograd.grad(layer(x, seed), [x], grad_out)
    torch.testing.assert_close(g_compiled, g_eager, rtol=0, atol=0)


def test_dropout_mask_device_errors_name_the_op():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError,
                           match=r"kernel_ladder\.dropout_mask: device 'cuda' was asked for, but no CUDA device"):
            kernel_ladder.dropout_mask((4, 4), 0.5, seed=1, device="cuda")
    with pytest.raises(ValueError, match=r"kernel_ladder\.dropout_mask: device must be a torch\.device or a name"):
        kernel_ladder.dropout_mask((4, 4), 0.5, seed=1, device="not-a-device")
    with pytest.raises(ValueError, match=r"kernel_ladder\.dropout_mask: device must hold data"):
        kernel_ladder.dropout_mask((4, 4), 0.5, seed=1, device="meta")
