"""Chapter 01's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked exactly as the notebook checks it (same launcher shape, same kind of
cases), once with the solution (must be SOLVED) and once per negative control: a plausible wrong
answer (missing mask, wrong formula, ignoring an input, computing in fp16, a stub) that the
checker must reject. Sizes stay at a few programs per case: the interpreter runs each in Python.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch01_elementwise as solutions
from utils.exercises import check

# The interpreter's numpy exp warns where it overflows to inf; sigmoid's 1 / (1 + inf) = 0 is right.
# The checker's out-of-bounds diagnoses and the traced references need the interpreter.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"), pytest.mark.interpreter]

BLOCK = 1024
DEVICE = kernel_ladder.runtime.DEVICE


# ----------------------------------------------------------------------------------------------
# Launchers: the notebook's, parameterised by the kernel under test
# ----------------------------------------------------------------------------------------------


def unary_launcher(kernel):
    """``f(x, out)`` launching ``kernel(x_ptr, out_ptr, n_elements, BLOCK)``, as in the notebook."""

    def launch(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n_elements = x.numel()
        kernel[(triton.cdiv(n_elements, BLOCK),)](x, out, n_elements, BLOCK=BLOCK)
        return out

    return launch


def swiglu_launcher(kernel):
    def launch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n_elements = gate.numel()
        kernel[(triton.cdiv(n_elements, BLOCK),)](gate, up, out, n_elements, BLOCK=BLOCK)
        return out

    return launch


def dropout_launcher(kernel):
    def launch(x: torch.Tensor, p: float, seed: int, out: torch.Tensor) -> torch.Tensor:
        n_elements = x.numel()
        kernel[(triton.cdiv(n_elements, BLOCK),)](x, out, n_elements, p, seed, BLOCK=BLOCK)
        return out

    return launch


# ----------------------------------------------------------------------------------------------
# Cases and references (fresh random inputs from the checker's generator)
# ----------------------------------------------------------------------------------------------

SIZES_AND_DTYPES = [(2051, torch.float32), (1, torch.float32), (1500, torch.float16), (1030, torch.bfloat16)]


def gelu_cases(gen: torch.Generator) -> list:
    return [((3 * torch.randn(size, generator=gen, device=gen.device)).to(dtype),) for size, dtype in SIZES_AND_DTYPES]


def gelu_tanh_reference(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Gates where exp(gate) overflows fp32 (from 88.7): a textbook exp(g) / (1 + exp(g)) gives inf / inf = NaN.
EXTREME_GATES = [-100.0, -90.0, -20.0, 0.0, 20.0, 90.0, 100.0]


def swiglu_cases(gen: torch.Generator) -> list:
    cases = []
    for size, dtype in SIZES_AND_DTYPES:
        gate = (8 * torch.randn(size, generator=gen, device=gen.device)).to(dtype)
        up = torch.randn(size, generator=gen, device=gen.device).to(dtype)
        cases.append((gate, up))
    gate = torch.tensor(EXTREME_GATES, device=gen.device)
    cases.append((gate, torch.randn(gate.numel(), generator=gen, device=gen.device)))
    # last: the case the traffic verdict is measured on, three blocks and a partial one
    cases.append(tuple(torch.randn(2, 3100, generator=gen, device=gen.device)))
    return cases


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# (gate, up, grad_out) in bf16 where the formula evaluated op by op in bf16 rounds to two bf16
# steps off the exact grad_gate (e.g. 4.375 for 4.4375 at gate 6.5): rounding once, from fp32, does not.
SWIGLU_BF16_DRIFT = tuple(
    torch.tensor(values, dtype=torch.bfloat16, device=DEVICE)
    for values in ([4.3125, 5.15625, 4.3125, 5.1875, 6.5], [0.98828125, 2.84375, -1.2734375, -2.078125, 1.8984375],
                   [2.03125, -1.640625, 3.4375, -2.171875, 2.3125])
)


def swiglu_backward_cases(gen: torch.Generator) -> list:
    cases = []
    for size, dtype in [(700, torch.float32), (33, torch.float32), (300, torch.bfloat16)]:
        gate = (4 * torch.randn(size, generator=gen, device=gen.device)).to(dtype)
        up, grad_out = torch.randn(2, size, generator=gen, device=gen.device).to(dtype)
        cases.append((gate, up, grad_out))
    cases.append(SWIGLU_BF16_DRIFT)
    return cases


def swiglu_backward_by_autograd(gate, up, grad_out):
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    (F.silu(gate) * up).backward(grad_out)
    return gate.grad, up.grad


def dropout_cases(gen: torch.Generator) -> list:
    return [
        (torch.randn(2051, generator=gen, device=gen.device), 0.5, 1234),
        (torch.randn(1500, generator=gen, device=gen.device), 0.1, 7),
        (torch.randn(1030, generator=gen, device=gen.device).to(torch.bfloat16), 0.3, 2**31 + 5),
        (torch.randn(100, generator=gen, device=gen.device), 0.0, 99),
        (torch.randn(3100, generator=gen, device=gen.device), 0.25, 2024),  # the traffic verdict's case
    ]


def dropout_reference(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    keep = kernel_ladder.dropout_mask(x.shape, p, seed, x.device)
    return torch.where(keep, x / (1 - p), 0.0)


def measured_swiglu_bytes(n_elements: int, element_size: int) -> tuple[int, int]:
    """What the tracer counts for ``sigmoid(g) * g * u`` and for ``kernel_ladder.swiglu``."""
    from utils.trace import trace

    dtype = {2: torch.bfloat16, 4: torch.float32}[element_size]
    gate = torch.randn(n_elements, device=DEVICE).to(dtype)
    up = torch.randn(n_elements, device=DEVICE).to(dtype)
    with trace() as unfused:
        torch.sigmoid(gate) * gate * up
    with trace() as fused:
        kernel_ladder.swiglu(gate, up)
    return unfused.bytes, fused.bytes


BYTES_CASES = [(1000, 4), (4096, 2), (3001, 2)]


# ----------------------------------------------------------------------------------------------
# Wrong kernels (negative controls)
# ----------------------------------------------------------------------------------------------


@triton.jit
def stub_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pass


@triton.jit
def gelu_tanh_no_mask_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets).to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    tl.store(out_ptr + offsets, (x * tl.sigmoid(2.0 * inner)).to(out_ptr.dtype.element_ty))


@triton.jit
def gelu_exact_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # the erf form where the tanh form is asked for: off by up to 5e-4
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_tanh_wrong_constant_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # tanh(u) written as sigmoid(u): a plausible slip when avoiding libdevice
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(inner) - 1.0))
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_stub_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pass


@triton.jit
def swiglu_no_mask_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(gate_ptr + offsets).to(tl.float32)
    up = tl.load(up_ptr + offsets).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty))


@triton.jit
def swiglu_sigmoid_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # sigmoid(gate) * up: forgot the "x ·" of silu
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_textbook_sigmoid_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # upcasts, but sigmoid as exp(g) / (1 + exp(g)): inf / inf = NaN once exp overflows fp32
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    e = tl.exp(gate)
    tl.store(out_ptr + offsets, (gate * (e / (1.0 + e)) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_ignores_up_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # silu(gate) alone
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_fp16_compute_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # computes in fp16 whatever the storage: sigmoid (tl.sigmoid insists on fp32) rounded to fp16,
    # then the two products in fp16 — three roundings to 11 bits, far outside fp32's tolerance
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float16)
    up = tl.load(up_ptr + offsets, mask=mask).to(tl.float16)
    sig = tl.sigmoid(gate.to(tl.float32)).to(tl.float16)
    tl.store(out_ptr + offsets, (gate * sig * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dropout_stub_kernel(x_ptr, out_ptr, n_elements, p, seed, BLOCK: tl.constexpr):
    pass


@triton.jit
def dropout_no_scale_kernel(x_ptr, out_ptr, n_elements, p, seed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    keep = tl.rand(seed, offsets) >= p
    tl.store(out_ptr + offsets, tl.where(keep, x, 0.0).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dropout_inverted_keep_kernel(x_ptr, out_ptr, n_elements, p, seed, BLOCK: tl.constexpr):
    # keeps where rand < p: the dropped set instead of the kept one
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    keep = tl.rand(seed, offsets) < p
    tl.store(out_ptr + offsets, tl.where(keep, x / (1.0 - p), 0.0).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dropout_ignores_seed_kernel(x_ptr, out_ptr, n_elements, p, seed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    keep = tl.rand(0, offsets) >= p
    tl.store(out_ptr + offsets, tl.where(keep, x / (1.0 - p), 0.0).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dropout_no_mask_kernel(x_ptr, out_ptr, n_elements, p, seed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets).to(tl.float32)
    keep = tl.rand(seed, offsets) >= p
    tl.store(out_ptr + offsets, tl.where(keep, x / (1.0 - p), 0.0).to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Wrong Python answers (negative controls)
# ----------------------------------------------------------------------------------------------


def swiglu_backward_stub(gate, up, grad_out):
    raise NotImplementedError


def swiglu_backward_missing_term(gate, up, grad_out):
    # treats sigmoid(gate) as a constant: drops the g·(1 - s) term
    sig = torch.sigmoid(gate)
    return grad_out * up * sig, grad_out * gate * sig


def swiglu_backward_swapped(gate, up, grad_out):
    grad_gate, grad_up = solutions.swiglu_backward(gate, up, grad_out)
    return grad_up, grad_gate


def swiglu_backward_ignores_grad_out(gate, up, grad_out):
    return solutions.swiglu_backward(gate, up, torch.ones_like(grad_out))


def swiglu_backward_op_by_op_in_bf16(gate, up, grad_out):
    # the right formula, every op in the inputs' dtype (bf16 rounds six times)
    sig = torch.sigmoid(gate)
    return grad_out * up * sig * (1 + gate * (1 - sig)), grad_out * gate * sig


def swiglu_backward_in_fp16(gate, up, grad_out):
    # the right formula, computed in fp16 and cast back
    grad_gate, grad_up = solutions.swiglu_backward(gate.half(), up.half(), grad_out.half())
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def predict_bytes_stub(n_elements, element_size):
    raise NotImplementedError


def predict_bytes_one_round_trip(n_elements, element_size):
    # counts silu(gate) * up (5 tensors), not the three-launch chain
    return 5 * n_elements * element_size, 3 * n_elements * element_size


def predict_bytes_ignores_element_size(n_elements, element_size):
    return 8 * n_elements, 3 * n_elements


def predict_bytes_writes_only(n_elements, element_size):
    # counts only the writes: 3 launches write once each, the fused kernel once
    return 3 * n_elements * element_size, n_elements * element_size


@triton.jit
def swiglu_loads_gate_twice_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # right values, but gate loaded once for the sigmoid and again for the product
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    sig = tl.sigmoid(tl.load(gate_ptr + offsets, mask=mask).to(tl.float32))
    gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * sig * up).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_by_torch_ops(gate, up, out):
    # right values from unfused torch ops (in fp32): every intermediate goes through memory
    return out.copy_(F.silu(gate.float()) * up.float())


def dropout_by_torch_ops(x, p, seed, out):
    # right values, the mask materialised and applied by torch ops
    keep = kernel_ladder.dropout_mask(x.shape, p, seed, x.device)
    return out.copy_(torch.where(keep, x / (1 - p), 0.0))


# ----------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------

EXERCISES = {
    "gelu_tanh_kernel": (unary_launcher, gelu_tanh_reference, gelu_cases, True),
    "swiglu_kernel": (swiglu_launcher, swiglu_reference, swiglu_cases, True),
    "dropout_kernel": (dropout_launcher, dropout_reference, dropout_cases, True),
}


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_kernel_solution_is_solved(name, capsys):
    launcher, reference, cases, out = EXERCISES[name]
    verdict = check(f"ch01_elementwise.{name}", launcher(getattr(solutions, name)), reference, cases, out=out)
    assert verdict.solved, verdict.message
    assert capsys.readouterr().out.startswith("✅ SOLVED — ch01_elementwise.")


def test_swiglu_backward_solution_is_solved():
    verdict = check("ch01_elementwise.swiglu_backward", solutions.swiglu_backward, swiglu_backward_by_autograd,
                    swiglu_backward_cases)
    assert verdict.solved, verdict.message


def test_predict_swiglu_bytes_solution_is_solved():
    verdict = check("ch01_elementwise.predict_swiglu_bytes", solutions.predict_swiglu_bytes, measured_swiglu_bytes,
                    BYTES_CASES)
    assert verdict.solved, verdict.message


WRONG_KERNELS = [
    ("gelu_tanh_kernel", stub_kernel, "never written"),
    ("gelu_tanh_kernel", gelu_tanh_no_mask_kernel, "out of bounds"),
    ("gelu_tanh_kernel", gelu_exact_kernel, "wrong values"),
    ("gelu_tanh_kernel", gelu_tanh_wrong_constant_kernel, "wrong values"),
    ("swiglu_kernel", swiglu_stub_kernel, "never written"),
    ("swiglu_kernel", swiglu_no_mask_kernel, "out of bounds"),
    ("swiglu_kernel", swiglu_sigmoid_kernel, "wrong values"),
    ("swiglu_kernel", swiglu_ignores_up_kernel, "wrong values"),
    ("swiglu_kernel", swiglu_textbook_sigmoid_kernel, "NaN"),
    ("swiglu_kernel", swiglu_fp16_compute_kernel, "wrong values"),
    ("dropout_kernel", dropout_stub_kernel, "never written"),
    ("dropout_kernel", dropout_no_scale_kernel, "wrong values"),
    ("dropout_kernel", dropout_inverted_keep_kernel, "wrong values"),
    ("dropout_kernel", dropout_ignores_seed_kernel, "wrong values"),
    ("dropout_kernel", dropout_no_mask_kernel, "out of bounds"),
]


@pytest.mark.parametrize(("name", "kernel", "diagnosis"), WRONG_KERNELS,
                         ids=[kernel.fn.__name__ for _, kernel, _ in WRONG_KERNELS])
def test_wrong_kernel_is_not_solved(name, kernel, diagnosis):
    launcher, reference, cases, out = EXERCISES[name]
    verdict = check(f"ch01_elementwise.{name}", launcher(kernel), reference, cases, out=out)
    assert not verdict.solved
    assert verdict.message.startswith(f"❌ NOT SOLVED — ch01_elementwise.{name}")
    assert diagnosis in verdict.message, verdict.message


@pytest.mark.parametrize(
    ("candidate", "diagnosis"),
    [
        (swiglu_backward_stub, "not implemented yet"),
        (swiglu_backward_missing_term, "wrong values"),
        (swiglu_backward_swapped, "wrong values"),
        (swiglu_backward_ignores_grad_out, "wrong values"),
        (swiglu_backward_in_fp16, "wrong values"),
        (swiglu_backward_op_by_op_in_bf16, "wrong values"),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_wrong_swiglu_backward_is_not_solved(candidate, diagnosis):
    verdict = check("ch01_elementwise.swiglu_backward", candidate, swiglu_backward_by_autograd, swiglu_backward_cases)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


def test_bf16_drift_case_alone_separates_rounding_once_from_op_by_op():
    """The fixed bf16 case, not luck in the random ones, is what rejects op-by-op bf16."""
    cases = [SWIGLU_BF16_DRIFT]
    name = "ch01_elementwise.swiglu_backward"
    assert check(name, solutions.swiglu_backward, swiglu_backward_by_autograd, cases).solved
    verdict = check(name, swiglu_backward_op_by_op_in_bf16, swiglu_backward_by_autograd, cases)
    assert not verdict.solved and "wrong values" in verdict.message, verdict.message


@pytest.mark.parametrize(
    ("candidate", "diagnosis"),
    [
        (predict_bytes_stub, "not implemented yet"),
        (predict_bytes_one_round_trip, "wrong value"),
        (predict_bytes_ignores_element_size, "wrong value"),
        (predict_bytes_writes_only, "wrong value"),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_wrong_byte_prediction_is_not_solved(candidate, diagnosis):
    verdict = check("ch01_elementwise.predict_swiglu_bytes", candidate, measured_swiglu_bytes, BYTES_CASES)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


def test_predict_swiglu_bytes_formula():
    assert solutions.predict_swiglu_bytes(10, 2) == (160, 60)


# ----------------------------------------------------------------------------------------------
# The traffic verdicts: the solution at the ideal, wasteful but correct variants above it, named
# ----------------------------------------------------------------------------------------------


def swiglu_check(candidate):
    return check("ch01_elementwise.swiglu_kernel", candidate, swiglu_reference, swiglu_cases, out=True,
                 traffic=solutions.swiglu_traffic())


def test_swiglu_solution_moves_the_ideal_bytes():
    verdict = swiglu_check(swiglu_launcher(solutions.swiglu_kernel))
    assert verdict.solved, verdict.message
    report = verdict.traffic
    assert report.reread == {"gate": 1.0, "up": 1.0}
    assert report.ideal == 3 * 3100 * 4 and report.moved == report.ideal and report.top == report.ideal
    assert "traffic: 1.00× the ideal bytes" in verdict.message
    assert "every input read once, every output written once" in verdict.message


def test_swiglu_loading_gate_twice_is_solved_with_the_reread_named():
    verdict = swiglu_check(swiglu_launcher(swiglu_loads_gate_twice_kernel))
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"gate": 2.0, "up": 1.0}
    assert verdict.traffic.ratio == pytest.approx(4 / 3)
    text = " ".join(verdict.message.split())
    assert "traffic: 1.33× the ideal bytes" in text and "gate read 2.00× its size" in text
    assert "every element of gate is loaded 2 times" in text


def test_swiglu_by_torch_ops_is_solved_with_the_unfused_cause():
    verdict = swiglu_check(swiglu_by_torch_ops)
    assert verdict.solved, verdict.message
    assert verdict.traffic.ratio > 2  # each op writes its result and the next reads it back
    assert verdict.traffic.reread == {}  # no Triton launch read anything
    assert "the inputs never reached a Triton load: torch ops read them" in " ".join(verdict.message.split())


def dropout_check(candidate):
    return check("ch01_elementwise.dropout_kernel", candidate, dropout_reference, dropout_cases, out=True,
                 traffic=solutions.dropout_traffic())


def test_dropout_solution_moves_the_ideal_bytes():
    verdict = dropout_check(dropout_launcher(solutions.dropout_kernel))
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"x": 1.0}
    assert verdict.traffic.ideal == 2 * 3100 * 4 and verdict.traffic.moved == verdict.traffic.ideal
    assert verdict.traffic.top == verdict.traffic.ideal
    assert "traffic: 1.00× the ideal bytes" in verdict.message


def test_dropout_with_a_stored_mask_is_solved_with_more_bytes_and_the_cause():
    verdict = dropout_check(dropout_by_torch_ops)
    assert verdict.solved, verdict.message
    assert verdict.traffic.ratio > 1.5  # the mask written and read back, x / (1 - p) through memory
    assert "never reached a Triton load: torch ops read them" in " ".join(verdict.message.split())
