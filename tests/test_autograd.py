"""A gradient of a gradient gets a clear error from every op; first-order graphs still record."""

from __future__ import annotations

import pytest
import torch

import kernel_ladder

DEVICE = kernel_ladder.runtime.DEVICE


def _w(n):
    return torch.ones(n, device=DEVICE)


OPS = {
    "gelu": kernel_ladder.gelu,
    "silu": kernel_ladder.silu,
    "swiglu": lambda x: kernel_ladder.swiglu(x, x * 0.5),
    "softmax": lambda x: kernel_ladder.softmax(x) * torch.arange(x.shape[-1], device=DEVICE),
    "log_softmax": kernel_ladder.log_softmax,
    "rms_norm": lambda x: kernel_ladder.rms_norm(x, _w(x.shape[-1])) ** 2,
    "layer_norm": lambda x: kernel_ladder.layer_norm(x, x.shape[-1:]) ** 2,
    "matmul": lambda x: kernel_ladder.matmul(x, x.t()),
    "linear": lambda x: kernel_ladder.linear(x, x, activation="gelu"),
}


@pytest.mark.parametrize("name", OPS)
def test_double_backward_raises_an_error_naming_the_op(name):
    x = torch.randn(4, 6, device=DEVICE, requires_grad=True)
    (g,) = torch.autograd.grad(OPS[name](x).sum(), x, create_graph=True)  # recording is fine
    with pytest.raises(RuntimeError, match=rf"kernel_ladder\.{name} \(backward\): double backward .* not supported"):
        g.sum().backward()


def test_every_backward_op_without_in_place_writes_is_covered():
    names = {n for n in dir(torch.ops.kernel_ladder) if n.endswith("_backward")}
    in_place = {"cross_entropy_backward"}  # scales its saved gradient buffer in place
    assert set(kernel_ladder._autograd.COVERED) == names - in_place
    assert {"gelu_backward", "softmax_backward", "matmul_backward", "rms_norm_backward"} <= names


def test_layer_norm_without_affine_params_records_a_graph():
    # Its backward returns empty weight/bias gradients; they must not alias (a custom-op rule).
    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    (g,) = torch.autograd.grad(kernel_ladder.layer_norm(x, (8,)).pow(2).sum(), x, create_graph=True)
    assert g.shape == x.shape and g.requires_grad
