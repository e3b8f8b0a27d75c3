"""Solutions to chapter 01, elementwise and fusion.

One solution per exercise of ``chapters/01_elementwise/01_elementwise.ipynb``, written for reading.
Every kernel follows the same shape: one program handles ``BLOCK`` consecutive elements, loads
them (masked, so the last partial block stays in bounds), upcasts to float32, computes, and casts
back to the output's dtype only at the store. In solution mode the notebook's stubs are replaced
by these. The traffic verdicts of the forward kernels (``swiglu_traffic``, ``dropout_traffic``)
are givens too: the notebook's checks and ``tests/test_solutions_ch01.py`` pass the same ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "gelu_tanh_kernel",
    "predict_swiglu_bytes",
    "swiglu_kernel",
    "swiglu_backward",
    "dropout_kernel",
    "swiglu_traffic",
    "dropout_traffic",
]

#: sqrt(2 / pi), the constant of GELU's tanh approximation.
SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def gelu_tanh_kernel(x_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """GELU, tanh approximation: ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``.

    Teaches the elementwise kernel pattern (offsets, mask, load → fp32 → compute → cast → store)
    and how to write ``tanh`` without libdevice: ``tanh(u) = 2·sigmoid(2u) − 1``, so
    ``0.5·(1 + tanh(u)) = sigmoid(2u)`` exactly, and GELU-tanh is ``x·sigmoid(2u)``. That form
    is also the more accurate one: ``1 + tanh(u)`` cancels catastrophically for very negative x.
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements  # the last block may hang over the end
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)  # compute in fp32 whatever the storage
    inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    y = x * tl.sigmoid(2.0 * inner)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def predict_swiglu_bytes(n_elements: int, element_size: int) -> tuple[int, int]:
    """Bytes moved by ``torch.sigmoid(gate) * gate * up`` and by one fused SwiGLU kernel.

    Teaches counting memory traffic before measuring it. Each torch op is its own launch that
    reads its inputs from memory and writes its output back:

    * ``s = sigmoid(gate)``: read gate, write s — 2 tensors;
    * ``t = s * gate``: read s and gate, write t — 3 tensors;
    * ``out = t * up``: read t and up, write out — 3 tensors;

    8 tensor-sized transfers in all. The fused kernel reads gate and up once and writes out once:
    3 transfers, the ideal. The two intermediates ``s`` and ``t`` are the whole difference.
    """
    tensor_bytes = n_elements * element_size
    unfused = (2 + 3 + 3) * tensor_bytes
    fused = 3 * tensor_bytes
    return unfused, fused


@triton.jit
def swiglu_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """Fused SwiGLU forward: ``out = silu(gate) · up = gate · sigmoid(gate) · up``.

    Teaches fusion: one launch reads ``gate`` and ``up`` once and writes ``out`` once; the
    intermediates (``sigmoid(gate)``, ``silu(gate)``) live in registers, in float32, and never
    touch memory — which saves bytes and a rounding to the storage dtype at every step.
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # tl.sigmoid is the overflow-safe form in fp32
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_backward(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``out = silu(gate) · up`` with respect to ``gate`` and ``up``.

    Teaches deriving a fused backward by hand. With ``s = sigmoid(g)`` and ``s' = s·(1 − s)``:

    * ``∂out/∂up = silu(g) = g·s``, so ``grad_up = grad_out · g · s``;
    * ``∂out/∂g = up · d(g·s)/dg = up · (s + g·s·(1 − s)) = up · s · (1 + g·(1 − s))``.

    Everything is recomputed from ``gate`` and ``up``: the backward needs no saved
    intermediate, so a fused kernel reads gate, up, grad_out and writes the two gradients.

    Computed in float32 and rounded once to the inputs' dtype, as the kernels do: the same ops
    in bf16 round after each of six steps and can land two bf16 steps off the exact result.
    """
    g, u, go = gate.float(), up.float(), grad_out.float()
    sig = torch.sigmoid(g)
    grad_up = go * g * sig
    grad_gate = go * u * sig * (1 + g * (1 - sig))
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


@triton.jit
def dropout_kernel(x_ptr, out_ptr, n_elements, p, seed, BLOCK: tl.constexpr):
    """Seeded dropout: keep ``x[i]`` (scaled by ``1/(1 − p)``) where ``rand(seed, i) ≥ p``, else 0.

    Teaches counter-based random numbers: ``tl.rand(seed, i)`` is a pure function of the seed and
    the element's index (Philox), so no random state is stored, every program draws its own
    numbers independently, and the same seed gives the same mask — which lets the backward
    regenerate the mask instead of saving it.
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    random = tl.rand(seed, offsets)  # uniform in [0, 1), one per element index
    keep = random >= p
    out = tl.where(keep, x / (1.0 - p), 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Givens: the traffic verdicts (``check(..., traffic=...)``) of the fused forward kernels
# ----------------------------------------------------------------------------------------------


def _traced_bytes(run) -> int:
    """The bytes the Triton launches of ``run()`` move (the ladder's top, traced on the same case)."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        run()
    return traced.bytes


def _elementwise_explain(reread: dict[str, float]) -> str | None:
    """Why an elementwise kernel moves more than its inputs once and its output once."""
    # The checker reports read factors of Triton launches only: none at all means no kernel ran.
    by_torch = [name for name, factor in reread.items() if factor < 0.05]
    if by_torch or not reread:
        inputs = " and ".join(by_torch) if by_torch else "the inputs"
        return (f"{inputs} never reached a Triton load: torch ops read them, and each op writes its result "
                "to memory for the next to read back; one fused launch reads each input once")
    loaded_again = sorted((name for name, factor in reread.items() if factor > 1.05), key=lambda n: -reread[n])
    if loaded_again:
        name = loaded_again[0]
        return (f"every element of {name} is loaded {reread[name]:.0f} times: load it once into a register "
                "and use the register for every term that needs it")
    return None


def _swiglu_ideal(gate: torch.Tensor, up: torch.Tensor) -> int:
    from utils.trace import ideal_bytes

    return ideal_bytes(gate, up, gate)  # gate and up read once, out (gate's size and dtype) written once


def _swiglu_top(gate: torch.Tensor, up: torch.Tensor) -> int:
    return _traced_bytes(lambda: kernel_ladder.swiglu(gate, up))


def swiglu_traffic():
    """SwiGLU's traffic verdict: the ideal reads gate and up once and writes out once; so does
    ``kernel_ladder.swiglu``. Three torch ops (or a kernel that loads gate twice) move more."""
    from utils.exercises import Traffic

    return Traffic(ideal=_swiglu_ideal, top=_swiglu_top, explain=_elementwise_explain)


def _dropout_ideal(x: torch.Tensor, p: float, seed: int) -> int:
    from utils.trace import ideal_bytes

    return ideal_bytes(x, x)  # x read once, out written once: the mask is drawn in registers, never stored


def _dropout_top(x: torch.Tensor, p: float, seed: int) -> int:
    return _traced_bytes(lambda: kernel_ladder.dropout(x, p, seed))


def dropout_traffic():
    """Dropout's traffic verdict: x read once and out written once (``kernel_ladder.dropout``'s bytes);
    a stored mask, a second pass or torch ops show up as the bytes above that."""
    from utils.exercises import Traffic

    return Traffic(ideal=_dropout_ideal, top=_dropout_top, explain=_elementwise_explain)
