"""kernel_ladder.gated_mlp: the fused gate/up GEMM and its backward against float64 torch; layouts, dtypes,
the activations, what the forward and backward write (traced), custom-op plumbing, errors.

Outputs are poisoned (NaN) before the kernels write them; inputs are fresh random draws.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches, make_input

import kernel_ladder
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE
ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu, "relu": F.relu}


def rand(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def layer(hidden, inter, gen, dtype=torch.float32):
    """Weights of nn.Linear layouts with outputs of order 1: w_gate, w_up (F, H), w_down (H, F)."""
    return (rand(inter, hidden, gen=gen, dtype=dtype, scale=hidden**-0.5),
            rand(inter, hidden, gen=gen, dtype=dtype, scale=hidden**-0.5),
            rand(hidden, inter, gen=gen, dtype=dtype, scale=inter**-0.5))


def reference(x, w_gate, w_up, w_down, activation):
    x, w_gate, w_up, w_down = (t.double() for t in (x, w_gate, w_up, w_down))
    return F.linear(ACTS[activation](F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("shape,inter", [((7, 48), 70), ((2, 5, 33), 40), ((48,), 16), ((3, 1, 64), 100)], ids=str)
def test_forward_matches_float64(shape, inter, activation, gen):
    x = rand(*shape, gen=gen)
    weights = layer(shape[-1], inter, gen)
    out = kernel_ladder.gated_mlp(x, *weights, activation=activation)
    assert_matches(out, reference(x, *weights, activation), torch.float32, slack=2.0)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "permuted"])
def test_strided_x_is_read_in_place(layout, gen):
    x = make_input((6, 5, 40), torch.float32, layout, gen, scale=1.0)
    weights = layer(40, 24, gen)
    out = kernel_ladder.gated_mlp(x, *weights)
    assert_matches(out, reference(x, *weights, "silu"), torch.float32, slack=2.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision(dtype, gen):
    x = rand(9, 64, gen=gen, dtype=dtype)
    weights = layer(64, 96, gen, dtype=dtype)
    out = kernel_ladder.gated_mlp(x, *weights, activation="gelu_tanh")
    # h is rounded to the dtype between the two GEMMs, as torch's own chain rounds it.
    lowp = F.linear(F.gelu(F.linear(x, weights[0]), approximate="tanh") * F.linear(x, weights[1]), weights[2])
    assert_matches(out, reference(x, *weights, "gelu_tanh"), dtype, lowp=lowp, slack=2.0)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape", [(2, 7, 40), (33,)], ids=str)
def test_backward_matches_float64_autograd(shape, activation, gen):
    x = rand(*shape, gen=gen).requires_grad_()
    weights = [w.requires_grad_() for w in layer(shape[-1], 24, gen)]
    out = kernel_ladder.gated_mlp(x, *weights, activation=activation)
    grad_out = rand(*out.shape, gen=gen)
    grads = torch.autograd.grad(out, [x, *weights], grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (x, *weights)]
    want = torch.autograd.grad(reference(*leaves, activation), leaves, grad_out.double())
    for name, got, expected in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, want):
        assert_matches(got, expected, torch.float32, slack=4.0, what=name)


def test_backward_of_weights_only_and_of_x_only(gen):
    x = rand(5, 32, gen=gen)
    w_gate, w_up, w_down = layer(32, 16, gen)
    w_gate.requires_grad_()
    kernel_ladder.gated_mlp(x, w_gate, w_up, w_down).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    reference(*leaves, "silu").sum().backward()
    assert_matches(w_gate.grad, leaves[1].grad, torch.float32, slack=4.0)
    x.requires_grad_()
    (grad_x,) = torch.autograd.grad(kernel_ladder.gated_mlp(x, w_gate.detach(), w_up, w_down).sum(), x)
    assert_matches(grad_x, leaves[0].grad, torch.float32, slack=4.0)


def test_empty_rows_and_zero_hidden(gen):
    weights = layer(16, 8, gen)
    assert kernel_ladder.gated_mlp(rand(0, 16, gen=gen), *weights).shape == (0, 16)
    assert kernel_ladder.gated_mlp(rand(2, 0, 16, gen=gen), *weights).shape == (2, 0, 16)


@pytest.mark.interpreter
def test_forward_writes_h_once_and_never_the_gate_or_up_projection(gen):
    """Unfused: gate and up are written and read back (4 M F element transfers) before h exists.
    Fused: the gated kernel reads x and both weights and writes only h; the down GEMM reads h."""
    M, H, Fw = 16, 64, 128
    x = rand(M, H, gen=gen)
    weights = layer(H, Fw, gen)
    with trace() as fused:
        out = kernel_ladder.gated_mlp(x, *weights)
    gated = [launch for launch in fused.launches if launch.kernel == "gated_mlp_kernel"]
    assert len(gated) == 1 and len(fused.launches) == 2
    element = x.element_size()
    assert gated[0].bytes_written == M * Fw * element  # h, and nothing else F-wide
    with trace() as unfused:
        gate = kernel_ladder.linear(x, weights[0])
        up = kernel_ladder.linear(x, weights[1])
        kernel_ladder.linear(kernel_ladder.swiglu(gate, up), weights[2])
    saved = unfused.bytes - fused.bytes
    assert saved >= 4 * M * Fw * element, (unfused.bytes, fused.bytes)
    assert_matches(out, reference(x, *weights, "silu"), torch.float32, slack=2.0)


@pytest.mark.interpreter
def test_backward_writes_d_gate_and_d_up_but_not_dh(gen):
    M, H, Fw = 16, 32, 64
    x = rand(M, H, gen=gen).requires_grad_()
    weights = [w.requires_grad_() for w in layer(H, Fw, gen)]
    out = kernel_ladder.gated_mlp(x, *weights)
    with trace() as t:
        out.backward(rand(M, H, gen=gen))
    recompute = [launch for launch in t.launches if launch.kernel == "gated_mlp_backward_kernel"]
    assert len(recompute) == 1
    assert recompute[0].bytes_written == 2 * M * Fw * x.element_size()  # d_gate and d_up only
    assert any(launch.kernel == "dual_matmul_kernel" for launch in t.launches)


def test_opcheck_and_torch_compile(gen):
    x = rand(4, 32, gen=gen)
    weights = layer(32, 16, gen)
    torch.library.opcheck(torch.ops.kernel_ladder.gated_mlp.default, (x, *weights, "silu"))
    x.requires_grad_()
    compiled = torch.compile(lambda a: kernel_ladder.gated_mlp(a, *weights), fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, kernel_ladder.gated_mlp(x, *weights), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None


def test_double_backward_is_refused_clearly(gen):
    x = rand(3, 16, gen=gen).requires_grad_()
    weights = layer(16, 8, gen)
    (dx,) = torch.autograd.grad(kernel_ladder.gated_mlp(x, *weights).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.gated_mlp \(backward\): double backward"):
        dx.sum().backward()


def test_bad_input_errors(gen):
    x = rand(4, 32, gen=gen)
    w_gate, w_up, w_down = layer(32, 16, gen)
    cases = [
        (lambda: kernel_ladder.gated_mlp(x, w_gate, w_up, w_down, activation="tanh"), ValueError,
         r"kernel_ladder\.gated_mlp: activation must be 'silu', 'gelu_tanh', 'gelu' or 'relu'"),
        (lambda: kernel_ladder.gated_mlp(x[:, :30], w_gate, w_up, w_down), ValueError,
         r"w_gate and w_up must both be \(intermediate, hidden\) = \(F, 30\)"),
        (lambda: kernel_ladder.gated_mlp(x, w_gate, w_up[:8], w_down), ValueError, r"w_gate and w_up must both be"),
        (lambda: kernel_ladder.gated_mlp(x, w_gate, w_up, w_down.t()), ValueError,
         r"w_down must be \(hidden, intermediate\) = \(32, 16\)"),
        (lambda: kernel_ladder.gated_mlp(x, w_gate[None], w_up, w_down), ValueError, r"w_gate must be 2-D"),
        (lambda: kernel_ladder.gated_mlp(x.half(), w_gate, w_up, w_down), TypeError,
         r"x and w_gate must have the same dtype"),
        (lambda: kernel_ladder.gated_mlp(x.long(), w_gate, w_up, w_down), TypeError, r"x must be float32"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
