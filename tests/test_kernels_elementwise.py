"""kernel_ladder.add, gelu, silu, swiglu: values, gradients, layouts, dtypes, custom-op plumbing, errors.

Every result is compared with a float64 reference on fresh random inputs; outputs are poisoned
(NaN) before the kernels write them, so an element a kernel forgets stays NaN and fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, LAYOUTS, assert_matches, make_input

import kernel_ladder
from kernel_ladder import _elementwise, _launch

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
# name -> (kernel_ladder op, float64 reference, number of tensor inputs)
OPS = {
    "add": (kernel_ladder.add, torch.add, 2),
    "gelu": (kernel_ladder.gelu, F.gelu, 1),
    "gelu_tanh": (lambda x: kernel_ladder.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh"), 1),
    "silu": (kernel_ladder.silu, F.silu, 1),
    "swiglu": (kernel_ladder.swiglu, lambda gate, up: F.silu(gate) * up, 2),
    "geglu": (kernel_ladder.geglu, lambda gate, up: F.gelu(gate, approximate="tanh") * up, 2),
}

# Odd sizes, size-1 dims, empty tensors, up to 5 dims; each is a handful of programs at most.
SHAPES = [(), (0,), (1,), (7,), (1, 1), (3, 0, 5), (33, 65), (2, 1, 67), (3, 4, 5, 6), (2, 3, 1, 4, 5)]


def reference_grads(reference, inputs, grad_out):
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    out = reference(*leaves)
    return torch.autograd.grad(out, leaves, grad_out.double())


# --------------------------------------------------------------------------- forward values


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_forward_matches_float64_reference_over_shapes(name, shape, gen):
    op, reference, arity = OPS[name]
    inputs = [make_input(shape, torch.float32, "contiguous", gen) for _ in range(arity)]
    assert_matches(op(*inputs), reference(*(t.double() for t in inputs)), torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(33, 65), (3, 4, 5, 6)], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_forward_honours_strides(name, shape, layout, gen):
    op, reference, arity = OPS[name]
    # The first input takes the layout under test; the second (if any) a different one.
    inputs = [make_input(shape, torch.float32, layout, gen)]
    if arity == 2:
        inputs.append(make_input(shape, torch.float32, "transposed" if layout == "contiguous" else "contiguous", gen))
    assert not inputs[0].is_contiguous() or layout == "contiguous"
    assert_matches(op(*inputs), reference(*(t.double() for t in inputs)), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
@pytest.mark.parametrize("name", list(OPS))
def test_forward_dtypes(name, dtype, layout, gen):
    op, reference, arity = OPS[name]
    inputs = [make_input((5, 301), dtype, layout, gen) for _ in range(arity)]
    assert_matches(op(*inputs), reference(*(t.double() for t in inputs)), dtype)


def test_many_dims_beyond_the_kernel_rank(gen):
    """Six dims that no operand can merge: launched per slice of the leading dims, still right."""
    x = make_input((2, 3, 2, 3, 2, 5), torch.float32, "permuted", gen)
    sizes, _ = _launch.coalesce_dims(x.shape, [x.stride()])
    assert len(sizes) > _elementwise.MAX_DIMS
    assert len(_elementwise.plan_elementwise(x.shape, [x], [torch.empty(x.shape)])) > 1
    assert_matches(kernel_ladder.gelu(x), F.gelu(x.double()), torch.float32)
    y = make_input((2, 3, 2, 3, 2, 5), torch.float32, "contiguous", gen)
    assert_matches(kernel_ladder.swiglu(x, y), F.silu(x.double()) * y.double(), torch.float32)


def test_int64_index_path(monkeypatch, gen):
    """The int64 offset path (taken for tensors past 2**31 elements) computes the same values."""
    monkeypatch.setattr(_launch, "INT32_MAX", 100)
    for layout in ("contiguous", "transposed"):
        x = make_input((40, 70), torch.float32, layout, gen)
        assert _elementwise.plan_elementwise(x.shape, [x], [torch.empty(x.shape)])[0].index_64
        assert_matches(kernel_ladder.silu(x), F.silu(x.double()), torch.float32)


# --------------------------------------------------------------------------- add broadcasting


@pytest.mark.parametrize(
    "x_shape, y_shape",
    [((33, 65), (65,)), ((33, 65), (33, 1)), ((1, 65), (33, 1)), ((4, 1, 6), (3, 1)), ((), (7, 3)), ((5, 0), (1,))],
    ids=str,
)
def test_add_broadcasts_like_torch(x_shape, y_shape, gen):
    x = make_input(x_shape, torch.float32, "contiguous", gen)
    y = make_input(y_shape, torch.float32, "contiguous", gen)
    assert_matches(kernel_ladder.add(x, y), x.double() + y.double(), torch.float32)
    assert_matches(kernel_ladder.add(y, x), y.double() + x.double(), torch.float32)


def test_add_broadcast_gradients_are_summed(gen):
    x = make_input((6, 5), torch.float32, "contiguous", gen).requires_grad_()
    y = make_input((5,), torch.float32, "contiguous", gen).requires_grad_()
    grad_out = make_input((6, 5), torch.float32, "contiguous", gen)
    kernel_ladder.add(x, y).backward(grad_out)
    torch.testing.assert_close(x.grad, grad_out)
    torch.testing.assert_close(y.grad, grad_out.sum(0))


@pytest.mark.parametrize(("x_dtype", "y_dtype"), [(torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                                               (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_add_promotes_mixed_dtypes_like_torch(x_dtype, y_dtype, gen):
    x = make_input((33, 17), x_dtype, "transposed", gen).requires_grad_()
    y = make_input((17,), y_dtype, "contiguous", gen).requires_grad_()
    out = kernel_ladder.add(x, y)
    expected_dtype = torch.promote_types(x_dtype, y_dtype)
    assert out.dtype == expected_dtype == (x + y).dtype
    assert_matches(out, x.detach().double() + y.detach().double(), expected_dtype)
    grad = torch.randn(out.shape, generator=gen).to(expected_dtype)
    gx, gy = torch.autograd.grad(out, (x, y), grad)
    tx, ty = torch.autograd.grad(x + y, (x, y), grad)
    assert gx.dtype == x_dtype and gy.dtype == y_dtype
    torch.testing.assert_close(gx, tx)
    torch.testing.assert_close(gy.double(), ty.double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tensor_dtype", DTYPES)
@pytest.mark.parametrize("zero_dim_dtype", DTYPES)
def test_add_zero_dim_tensors_promote_like_torch(tensor_dtype, zero_dim_dtype, gen):
    """torch.result_type: a 0-d tensor does not promote a tensor with dims (bf16 + 0-d fp32 is bf16);
    two 0-d tensors, or two with dims, promote normally. Every pairing, both orders."""
    x = make_input((4, 9), tensor_dtype, "contiguous", gen)
    s = make_input((), zero_dim_dtype, "contiguous", gen)
    for a, b in ((x, s), (s, x), (s, s.to(tensor_dtype)), (x, x.to(zero_dim_dtype))):
        out = kernel_ladder.add(a, b)
        assert out.dtype == torch.result_type(a, b) == (a + b).dtype, (a.dtype, a.dim(), b.dtype, b.dim())
        assert_matches(out, a.double() + b.double(), out.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_python_scalar_takes_the_tensors_dtype(dtype, gen):
    x = make_input((5, 7), dtype, "sliced", gen)
    for scalar in (1.5, -3):
        for out in (kernel_ladder.add(x, scalar), kernel_ladder.add(scalar, x)):
            assert out.dtype == (x + scalar).dtype == dtype
            assert_matches(out, x.double() + scalar, dtype)


def test_no_hidden_copies(monkeypatch, gen):
    """Strided inputs are read in place: every operand a kernel gets lives in the caller's storage."""
    planned = []
    original_plan = _elementwise.plan_elementwise

    def recording_plan(shape, inputs, outputs):
        launches = original_plan(shape, inputs, outputs)
        planned.extend(launches)
        return launches

    monkeypatch.setattr(_elementwise, "plan_elementwise", recording_plan)
    x = make_input((33, 65), torch.float32, "transposed", gen)
    y = make_input((33, 65), torch.float32, "sliced", gen)
    bias = make_input((65,), torch.float32, "contiguous", gen)
    wide = make_input((2, 3, 2, 3, 2, 5), torch.float32, "permuted", gen)  # launched per slice
    kernel_ladder.add(x, bias)
    kernel_ladder.gelu(x)
    kernel_ladder.swiglu(x, y)
    kernel_ladder.dropout(y, 0.5, seed=3)
    kernel_ladder.silu(wide)
    storages = {t.untyped_storage().data_ptr() for t in (x, y, bias, wide)}
    assert len(planned) > 5
    for launch in planned:
        assert not launch.contiguous
        for operand in launch.inputs:
            assert operand.untyped_storage().data_ptr() in storages


# --------------------------------------------------------------------------- gradients

# The kernels take float32/16/bf16 only (they compute in float32), so gradients are checked
# against torch autograd of the float64 reference instead of gradcheck.


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "swiglu", "geglu", "add"])
def test_backward_matches_float64_autograd(name, layout, gen):
    op, reference, arity = OPS[name]
    shape = (17, 130)
    inputs = [make_input(shape, torch.float32, layout, gen).requires_grad_() for _ in range(arity)]
    # A strided grad_out too: autograd hands the backward whatever layout it has.
    grad_out = make_input(shape, torch.float32, "transposed" if layout == "contiguous" else "sliced", gen)
    grads = torch.autograd.grad(op(*inputs), inputs, grad_out)
    expected = reference_grads(reference, inputs, grad_out)
    for got, want in zip(grads, expected):
        # add's gradient is grad_out itself (a view, whatever its layout); the kernels' are fresh.
        assert_matches(got, want, torch.float32, contiguous=name != "add")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "swiglu", "geglu"])
def test_backward_half_precision(name, dtype, gen):
    op, reference, arity = OPS[name]
    inputs = [make_input((7, 151), dtype, "contiguous", gen).requires_grad_() for _ in range(arity)]
    grad_out = make_input((7, 151), dtype, "contiguous", gen)
    grads = torch.autograd.grad(op(*inputs), inputs, grad_out)
    for got, want in zip(grads, reference_grads(reference, inputs, grad_out)):
        assert_matches(got, want, dtype)


def test_backward_of_empty_and_scalar_tensors(gen):
    for shape in [(0, 3), ()]:
        x = make_input(shape, torch.float32, "contiguous", gen).requires_grad_()
        (grad,) = torch.autograd.grad(kernel_ladder.gelu(x), [x], torch.ones(shape))
        assert grad.shape == x.shape


# --------------------------------------------------------------------------- custom-op plumbing


def _opcheck_cases(gen):
    x = make_input((5, 7), torch.float32, "contiguous", gen)
    xt = make_input((5, 7), torch.float32, "transposed", gen)
    y = make_input((7,), torch.float32, "contiguous", gen)
    ops = torch.ops.kernel_ladder
    return {
        "add": (ops.add.default, (x, y)),
        "add_strided": (ops.add.default, (xt, x)),
        "gelu": (ops.gelu.default, (xt, "none")),
        "gelu_tanh": (ops.gelu.default, (x, "tanh")),
        "gelu_backward": (ops.gelu_backward.default, (x, xt, "tanh")),
        "silu": (ops.silu.default, (xt,)),
        "silu_backward": (ops.silu_backward.default, (xt, x)),
        "swiglu": (ops.swiglu.default, (x, xt)),
        "swiglu_backward": (ops.swiglu_backward.default, (x, xt, x)),
        "dropout": (ops.dropout.default, (xt, 0.25, 11)),
    }


@pytest.mark.parametrize(
    "case", ["add", "add_strided", "gelu", "gelu_tanh", "gelu_backward", "silu", "silu_backward",
             "swiglu", "swiglu_backward", "dropout"],
)
def test_opcheck(case, gen):
    op, args = _opcheck_cases(gen)[case]
    torch.library.opcheck(op, args)


def test_opcheck_dropout_mask():
    torch.library.opcheck(torch.ops.kernel_ladder.dropout_mask.default, ([3, 50], 0.3, 5, torch.device(DEVICE)))


@pytest.mark.parametrize("name", list(OPS) + ["dropout"])
def test_torch_compile_fullgraph_forward_and_backward(name, gen):
    if name == "dropout":
        op, arity = (lambda x: kernel_ladder.dropout(x, 0.3, seed=21)), 1
    else:
        op, _, arity = OPS[name]
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)
    inputs = [make_input((9, 70), torch.float32, "contiguous", gen).requires_grad_() for _ in range(arity)]
    grad_out = make_input((9, 70), torch.float32, "contiguous", gen)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs, grad_out)
    want = op(*inputs)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_torch_compile_composes_ops_and_broadcasts(gen):
    def block(x, bias, up):
        return kernel_ladder.swiglu(kernel_ladder.gelu(kernel_ladder.add(x, bias), approximate="tanh"), up)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x, up = (make_input((4, 33), torch.float32, "contiguous", gen).requires_grad_() for _ in range(2))
    bias = make_input((33,), torch.float32, "contiguous", gen).requires_grad_()
    grad_out = make_input((4, 33), torch.float32, "contiguous", gen)
    got = torch.autograd.grad(compiled(x, bias, up), [x, bias, up], grad_out)
    want = torch.autograd.grad(block(x, bias, up), [x, bias, up], grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# --------------------------------------------------------------------------- the launch plan


def test_coalescing_merges_what_every_operand_can_walk_as_one():
    x = torch.empty(4, 5, 6)
    assert _launch.coalesce_dims(x.shape, [x.stride()]) == ([120], [[1]])
    t = x.transpose(0, 2)  # no dims mergeable
    assert _launch.coalesce_dims(t.shape, [t.stride()])[0] == [6, 5, 4]
    rows = torch.empty(4, 10)[:, :5]  # each row dense, rows apart
    assert _launch.coalesce_dims(rows.shape, [rows.stride()]) == ([4, 5], [[10, 1]])
    bias = torch.empty(6).expand(4, 5, 6)  # stride 0 over the first two dims merges them
    assert _launch.coalesce_dims(bias.shape, [bias.stride()]) == ([20, 6], [[0, 1]])
    # Mergeable for one operand but not the other: kept apart.
    assert _launch.coalesce_dims(rows.shape, [rows.stride(), (5, 1)]) == ([4, 5], [[10, 1], [5, 1]])
    # Size-1 dims vanish whatever their stride.
    odd = torch.empty(3, 1, 7).as_strided((3, 1, 7), (7, 999, 1))
    assert _launch.coalesce_dims(odd.shape, [odd.stride()]) == ([21], [[1]])


def test_plan_takes_the_flat_path_for_contiguous_operands():
    x, y = torch.empty(3, 1, 70), torch.empty(3, 1, 70)
    (launch,) = _elementwise.plan_elementwise(x.shape, [x, y], [torch.empty(x.shape)])
    assert launch.contiguous and not launch.index_64 and launch.n_elements == 210
    (launch,) = _elementwise.plan_elementwise(x.shape, [x, y.transpose(0, 2).contiguous().transpose(0, 2)],
                                              [torch.empty(x.shape)])
    assert not launch.contiguous
    assert _elementwise.plan_elementwise((0, 5), [torch.empty(0, 5)], [torch.empty(0, 5)]) == []


def test_plan_switches_to_int64_offsets_past_2_to_the_31():
    """Decided on meta tensors: no memory is allocated."""
    big = torch.empty(2**31 + 7, device="meta")
    (launch,) = _elementwise.plan_elementwise(big.shape, [big], [torch.empty_like(big)])
    assert launch.contiguous and launch.index_64
    # Few elements, but a stride that reaches past 2**31 elements.
    wide = torch.empty(3, 2**30, device="meta")[:, ::2**29]
    (launch,) = _elementwise.plan_elementwise(wide.shape, [wide], [torch.empty(wide.shape, device="meta")])
    assert not launch.contiguous and launch.index_64
    small = torch.empty(1000, 1000, device="meta").t()
    (launch,) = _elementwise.plan_elementwise(small.shape, [small], [torch.empty(small.shape, device="meta")])
    assert not launch.index_64


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: kernel_ladder.gelu(torch.arange(4)), TypeError,
         r"^kernel_ladder\.gelu: x must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: kernel_ladder.gelu(torch.ones(4, dtype=torch.float64)), TypeError,
         r"^kernel_ladder\.gelu: x must be .*got torch\.float64"),
        (lambda: kernel_ladder.gelu([1.0, 2.0]), TypeError,
         r"^kernel_ladder\.gelu: x must be a torch\.Tensor, got list"),
        (lambda: kernel_ladder.gelu(torch.ones(4), approximate="fast"), ValueError,
         r"^kernel_ladder\.gelu: approximate must be 'none' or 'tanh', got 'fast'"),
        (lambda: kernel_ladder.gelu(torch.ones(4), approximate=None), TypeError,
         r"^kernel_ladder\.gelu: approximate must be"),
        (lambda: kernel_ladder.silu(3.0), TypeError, r"^kernel_ladder\.silu: x must be a torch\.Tensor, got float"),
        (lambda: kernel_ladder.silu(torch.ones(2, dtype=torch.int32)), TypeError,
         r"^kernel_ladder\.silu: x must be float32"),
        (lambda: kernel_ladder.add(torch.ones(3), torch.ones(3, dtype=torch.int64)), TypeError,
         r"^kernel_ladder\.add: y must be float32, float16 or bfloat16, got torch\.int64"),
        (lambda: kernel_ladder.add(1.0, 2.0), TypeError, r"^kernel_ladder\.add: x must be a torch\.Tensor, got float"),
        (lambda: kernel_ladder.add(torch.ones(3), True), TypeError,
         r"^kernel_ladder\.add: y must be a torch\.Tensor, got bool"),
        (lambda: kernel_ladder.add(torch.ones(3), torch.ones(4)), ValueError,
         r"^kernel_ladder\.add: x and y must have broadcastable shapes, got \(3,\) and \(4,\)"),
        (lambda: kernel_ladder.add(torch.ones(3), torch.ones(3, device="meta")), ValueError,
         r"^kernel_ladder\.add: x and y must be on the same device, got cpu and meta"),
        (lambda: kernel_ladder.swiglu(torch.ones(2, 3), torch.ones(3, 2)), ValueError,
         r"^kernel_ladder\.swiglu: gate and up must have the same shape, got \(2, 3\) and \(3, 2\)"),
        (lambda: kernel_ladder.swiglu(torch.ones(3), torch.ones(3, dtype=torch.bfloat16)), TypeError,
         r"^kernel_ladder\.swiglu: gate and up must have the same dtype"),
        (lambda: kernel_ladder.swiglu(torch.ones(3, dtype=torch.int8), torch.ones(3)), TypeError,
         r"^kernel_ladder\.swiglu: gate must be float32"),
        (lambda: kernel_ladder.dropout(torch.ones(3), p=1.5), ValueError,
         r"^kernel_ladder\.dropout: p must be in \[0, 1\], got 1\.5"),
        (lambda: kernel_ladder.dropout(torch.ones(3), p=-0.1), ValueError,
         r"^kernel_ladder\.dropout: p must be in \[0, 1\]"),
        (lambda: kernel_ladder.dropout(torch.ones(3), p="0.5"), TypeError,
         r"^kernel_ladder\.dropout: p must be a float"),
        (lambda: kernel_ladder.dropout(torch.ones(3), seed=1.5), TypeError,
         r"^kernel_ladder\.dropout: seed must be an int"),
        (lambda: kernel_ladder.dropout(torch.ones(3), seed=-1), ValueError,
         r"^kernel_ladder\.dropout: seed must be in"),
        (lambda: kernel_ladder.dropout(torch.ones(3), training="yes"), TypeError,
         r"^kernel_ladder\.dropout: training must be a bool"),
        (lambda: kernel_ladder.dropout(torch.arange(3)), TypeError, r"^kernel_ladder\.dropout: x must be float32"),
        (lambda: kernel_ladder.dropout_mask((3, -1), 0.5, 1), ValueError,
         r"^kernel_ladder\.dropout_mask: shape must have"),
        (lambda: kernel_ladder.dropout_mask((3, 1.5), 0.5, 1), TypeError,
         r"^kernel_ladder\.dropout_mask: shape must be"),
        (lambda: kernel_ladder.dropout_mask((3,), 2.0, 1), ValueError, r"^kernel_ladder\.dropout_mask: p must be in"),
        # the custom op validates too, when called directly through torch.ops
        (lambda: torch.ops.kernel_ladder.dropout_mask([3], 2.0, 1, torch.device("cpu")), ValueError,
         r"^kernel_ladder\.dropout_mask: p must be in"),
        (lambda: torch.ops.kernel_ladder.dropout_mask([3], 0.5, -5, torch.device("cpu")), ValueError,
         r"^kernel_ladder\.dropout_mask: seed"),
        (lambda: kernel_ladder.dropout_mask((3,), 0.5, 1, device="meta"), ValueError,
         r"^kernel_ladder\.dropout_mask: device must hold data"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_errors_also_come_from_the_raw_custom_op():
    with pytest.raises(TypeError, match=r"^kernel_ladder\.gelu: x must be float32"):
        torch.ops.kernel_ladder.gelu(torch.arange(3), "none")
    with pytest.raises(ValueError, match=r"^kernel_ladder\.dropout: p must be in"):
        torch.ops.kernel_ladder.dropout(torch.ones(3), 3.0, 1)


# --------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_large_tensors(dtype):
    """Real sizes on a GPU: a tensor past 2**31 elements (int64 offsets) and large strided views."""
    n = 2**31 + 1031
    x = torch.randn(n, device="cuda", dtype=torch.float32).to(dtype)
    out = kernel_ladder.silu(x)
    for where in (slice(0, 4096), slice(n - 4096, n)):
        assert_matches(out[where], F.silu(x[where].double()), dtype)
    del out
    m = torch.randn(8192, 8193, device="cuda", dtype=dtype)
    assert_matches(kernel_ladder.gelu(m.t()), F.gelu(m.t().double()), dtype)
    assert_matches(kernel_ladder.add(m, m[0]), m.double() + m[0].double(), dtype)


@pytest.mark.parametrize("op", [kernel_ladder.swiglu, kernel_ladder.geglu], ids=["swiglu", "geglu"])
def test_in_place_backward_writes_grad_gate_into_the_incoming_gradient(op, gen):
    gate = make_input((9, 130), torch.float32, "transposed", gen).requires_grad_()
    up = make_input((9, 130), torch.float32, "contiguous", gen).requires_grad_()
    g = make_input((9, 130), torch.float32, "contiguous", gen)
    want = torch.autograd.grad(op(gate, up), [gate, up], g)
    g_reused = g.clone()
    got = torch.autograd.grad(op(gate, up, in_place_backward=True), [gate, up], g_reused)
    assert got[0].data_ptr() == g_reused.data_ptr()  # the buffer was reused, and now holds grad_gate
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a stride-0 gradient and create_graph=True take the out-of-place backward, same values
    (dgate,) = torch.autograd.grad(op(gate, up, in_place_backward=True).sum(), [gate])
    torch.testing.assert_close(dgate, torch.autograd.grad(op(gate, up).sum(), [gate])[0], rtol=0, atol=0)
    g_graph = g.clone()
    (dgate,) = torch.autograd.grad(op(gate, up, in_place_backward=True), [gate], g_graph, create_graph=True)
    assert dgate.data_ptr() != g_graph.data_ptr() and torch.equal(g_graph, g)
    torch.library.opcheck(torch.ops.kernel_ladder.swiglu_backward_inplace.default,
                          (g.clone(), gate.detach(), up.detach()))
