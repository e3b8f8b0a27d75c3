"""kernel_ladder.linear: the fused bias + activation epilogue, forward and backward, against float64 torch.

Outputs are poisoned (NaN) before the kernels write them; inputs are fresh random tensors; the
matmul kernels run with the interpreter's fixed configuration (small problems: one or two tiles).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES
from helpers import assert_matches as _assert_matches

import kernel_ladder
from kernel_ladder.ops import linear as lin
from utils.trace import trace

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu"]
TORCH_ACT = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
             "silu": F.silu}


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def reference(x, weight, bias, activation):
    return TORCH_ACT[activation](F.linear(x.double(), weight.double(), None if bias is None else bias.double()))


def assert_matches(out, reference64, dtype):
    """A K-long fp32 accumulation, then the epilogue: twice the one-rounding tolerance."""
    _assert_matches(out, reference64, dtype, slack=2.0)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("x_shape, out_features", [((5, 20), 13), ((2, 3, 20), 1), ((20,), 33), ((1, 1), 4)],
                         ids=str)
def test_forward_matches_torch(x_shape, out_features, activation, gen):
    x, w, b = rand(gen, *x_shape), rand(gen, out_features, x_shape[-1]), rand(gen, out_features)
    assert_matches(kernel_ladder.linear(x, w, b, activation), reference(x, w, b, activation), torch.float32)
    assert_matches(kernel_ladder.linear(x, w, None, activation), reference(x, w, None, activation), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_forward_dtypes(activation, dtype, gen):
    x, w, b = rand(gen, 7, 40, dtype=dtype), rand(gen, 24, 40, dtype=dtype), rand(gen, 24, dtype=dtype)
    assert_matches(kernel_ladder.linear(x, w, b, activation), reference(x, w, b, activation), dtype)


def test_forward_strided_inputs(gen):
    x = rand(gen, 20, 3, 6).permute(2, 1, 0)  # (6, 3, 20): rows cannot fold into one M
    w = rand(gen, 20, 9).t()  # (9, 20) transposed
    b = rand(gen, 18)[::2]  # stride 2
    assert_matches(kernel_ladder.linear(x, w, b, "relu"), reference(x, w, b, "relu"), torch.float32)


def test_forward_empty_and_zero_in_features(gen):
    x, w, b = rand(gen, 3, 0), rand(gen, 4, 0), rand(gen, 4)
    assert_matches(kernel_ladder.linear(x, w, b, "silu"), F.silu(b.double()).expand(3, 4), torch.float32)
    out = kernel_ladder.linear(rand(gen, 0, 5), rand(gen, 4, 5), rand(gen, 4), "gelu")
    assert out.shape == (0, 4)


@pytest.mark.interpreter
def test_fused_epilogue_is_one_launch_and_decode_shapes_split_k(gen):
    from utils.trace import trace

    M, K, N = 8, 32, 24
    x, w, b = rand(gen, M, K), rand(gen, N, K), rand(gen, N)
    with trace() as t:
        kernel_ladder.linear(x, w, b, "gelu")
    (launch,) = t.launches
    assert launch.kernel == "matmul_kernel"
    assert launch.bytes_written == M * N * 4  # the output, once: no pre-activation kept without grads
    assert launch.per_tensor["bias_ptr"].bytes_read == N * 4
    # With a gradient to come, GELU also stores z (M*N more bytes): the cost of not recomputing it.
    with trace() as t:
        kernel_ladder.linear(x, w.requires_grad_(), b, "gelu")
    assert t.launches[0].bytes_written == 2 * M * N * 4
    with trace() as t:
        kernel_ladder.linear(x, w, b, "relu")  # ReLU's backward uses the output: nothing extra
    assert t.launches[0].bytes_written == M * N * 4
    # A decode-shaped input runs split-K; the reduction applies the same epilogue.
    x1, w1, b1 = rand(gen, 1, 1024), rand(gen, 16, 1024), rand(gen, 16)
    with trace() as t:
        out = kernel_ladder.linear(x1, w1, b1, "silu")
    assert [x.kernel for x in t.launches] == ["matmul_split_k_kernel", "matmul_split_k_reduce_kernel"]
    assert_matches(out, reference(x1, w1, b1, "silu"), torch.float32)


# --------------------------------------------------------------------------- backward


def _check_grads(x, w, b, activation, out=None, rtol=2e-5, atol=2e-5, gen=None):
    """Gradients of the inputs that require them match float64 torch; the others get none."""
    out = kernel_ladder.linear(x, w, b, activation) if out is None else out
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype).to(DEVICE)
    got = torch.autograd.grad(out, wanted, grad)
    leaves = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, b)]
    want = torch.autograd.grad(reference(*leaves, activation), [t for t in leaves if t is not None and t.requires_grad],
                               grad.double())
    for g, w_, t in zip(got, want, wanted):
        assert g.shape == t.shape and g.dtype == t.dtype
        torch.testing.assert_close(g.double(), w_.to(t.dtype).double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("x_shape", [(5, 20), (2, 3, 20), (20,)], ids=str)
def test_gradients_match_torch(x_shape, activation, gen):
    x = rand(gen, *x_shape).requires_grad_()
    w, b = rand(gen, 13, x_shape[-1]).requires_grad_(), rand(gen, 13).requires_grad_()
    _check_grads(x, w, b, activation, gen=gen)


def test_gradients_strided_x_without_bias_and_bf16(gen):
    x = rand(gen, 20, 3, 6).permute(2, 1, 0).requires_grad_()  # dW sums fp32 partials over the batch
    w = rand(gen, 9, 20).requires_grad_()
    _check_grads(x, w, None, "silu", gen=gen)
    xb, wb, bb = (rand(gen, *s, dtype=torch.bfloat16).requires_grad_() for s in ((6, 40), (16, 40), (16,)))
    _check_grads(xb, wb, bb, "gelu", rtol=2e-2, atol=2e-2, gen=gen)
    # Only some inputs need gradients.
    _check_grads(rand(gen, 4, 20), w, rand(gen, 9).requires_grad_(), "relu", gen=gen)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("needed", ["x", "weight", "bias"])
def test_gradient_of_one_input_only(needed, activation, gen):
    # The two gradients not needed come back as distinct empty tensors (a custom op's outputs may
    # not alias each other).
    x, w, b = rand(gen, 2, 3, 20), rand(gen, 9, 20), rand(gen, 9)
    {"x": x, "weight": w, "bias": b}[needed].requires_grad_()
    _check_grads(x, w, b, activation, gen=gen)


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_recomputed_preactivation_gives_the_same_gradients(activation, gen):
    x, w, b = rand(gen, 6, 20).requires_grad_(), rand(gen, 11, 20).requires_grad_(), rand(gen, 11).requires_grad_()
    out, preact = torch.ops.kernel_ladder.linear(x, w, b, activation, False)  # z not kept: the backward recomputes it
    assert preact.numel() == 0
    _check_grads(x, w, b, activation, out=out, gen=gen)


def test_opcheck(gen):
    x, w, b = rand(gen, 2, 5, 20).requires_grad_(), rand(gen, 7, 20).requires_grad_(), rand(gen, 7).requires_grad_()
    torch.library.opcheck(lin._linear_op, (x, w, b, "gelu", True))


def test_torch_compile_fullgraph_forward_and_backward(gen):
    def layer(x, w, b):
        return kernel_ladder.linear(x, w, b, activation="silu")

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    x, w, b = rand(gen, 2, 5, 20).requires_grad_(), rand(gen, 7, 20).requires_grad_(), rand(gen, 7).requires_grad_()
    grad = rand(gen, 2, 5, 7)
    got = compiled(x, w, b)
    got_grads = torch.autograd.grad(got, (x, w, b), grad)
    want = layer(x, w, b)
    want_grads = torch.autograd.grad(want, (x, w, b), grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=0, atol=0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: (torch.randn(4, 5), torch.randn(3, 6), None, None), ValueError,
         r"kernel_ladder\.linear: x's last dim \(5\) must equal weight's dim 1, in_features \(6\); "
         r"got x of shape \(4, 5\) and weight of shape \(3, 6\)"),
        (lambda: (torch.randn(4, 5), torch.randn(3, 5), torch.randn(4), None), ValueError,
         r"kernel_ladder\.linear: bias must have shape \(out_features,\) = \(3,\).*got bias of shape \(4,\)"),
        (lambda: (torch.randn(4, 5), torch.randn(5), None, None), ValueError,
         r"kernel_ladder\.linear: weight must be 2-D \(out_features, in_features\), got shape \(5,\)"),
        (lambda: (torch.randn(()), torch.randn(3, 1), None, None), ValueError,
         r"kernel_ladder\.linear: x must be at least 1-D"),
        (lambda: (torch.randn(4, 5), torch.randn(3, 5, dtype=torch.float16), None, None), TypeError,
         r"kernel_ladder\.linear: x and weight must have the same dtype, got torch\.float32 and torch\.float16"),
        (lambda: (torch.randn(4, 5), torch.randn(3, 5), torch.randn(3, dtype=torch.bfloat16), None), TypeError,
         r"kernel_ladder\.linear: x and bias must have the same dtype"),
        (lambda: (torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64), None, None),
         TypeError, r"kernel_ladder\.linear: x must be float32, float16 or bfloat16, got torch\.float64"),
        (lambda: (torch.ones(4, 5, dtype=torch.int64), torch.randn(3, 5), None, None), TypeError,
         r"kernel_ladder\.linear: x must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: (torch.randn(4, 5), torch.randn(3, 5, device="meta"), None, None), ValueError,
         r"kernel_ladder\.linear: x and weight must be on the same device"),
        (lambda: (torch.randn(4, 5), torch.randn(3, 5), None, "tanh"), ValueError,
         r"kernel_ladder\.linear: activation must be None, 'relu', 'gelu', 'gelu_tanh' or 'silu', got 'tanh'"),
        (lambda: (torch.randn(4, 5), torch.randn(3, 5), None, F.relu), TypeError,
         r"kernel_ladder\.linear: activation must be None, 'relu', 'gelu', 'gelu_tanh' or 'silu', got function"),
    ],
)
def test_bad_input_errors(make, error, message):
    x, w, b, activation = make()
    with pytest.raises(error, match=message):
        kernel_ladder.linear(x, w, b, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_real_sizes_forward_and_backward(activation, gen):
    x = rand(gen, 4, 512, 1024, dtype=torch.bfloat16).requires_grad_()
    w = (rand(gen, 2048, 1024, dtype=torch.bfloat16) * 0.03).requires_grad_()
    b = rand(gen, 2048, dtype=torch.bfloat16).requires_grad_()
    out = kernel_ladder.linear(x, w, b, activation)
    want = TORCH_ACT[activation](F.linear(x.float(), w.float(), b.float()))
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=5e-2)
    grad = rand(gen, *out.shape, dtype=torch.bfloat16)
    got = torch.autograd.grad(out, (x, w, b), grad)
    ref = torch.autograd.grad(TORCH_ACT[activation](F.linear(x, w, b)), (x, w, b), grad)
    for g, r in zip(got, ref):
        scale = r.float().abs().max().item()
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("op", ["linear", "gated_mlp"])
def test_backward_materializes_no_zeros_for_the_saved_intermediate(op, gen):
    """The pre-activation (linear) and h (gated_mlp) are outputs without a gradient: autograd must not
    allocate and fill an M x N tensor of zeros for them in every backward."""
    x = rand(gen, 8, 32).requires_grad_()
    w = rand(gen, 24, 32)
    out = kernel_ladder.linear(x, w, activation="gelu") if op == "linear" else kernel_ladder.gated_mlp(x, w, w, w.t())
    grad = torch.ones_like(out)
    with trace() as t:
        out.backward(grad)
    assert not [o for o in t.torch_ops if "zeros" in o.name or "fill" in o.name], t.table()
