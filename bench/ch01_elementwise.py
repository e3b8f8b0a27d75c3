"""Chapter 01's ladders: GELU, SwiGLU (three torch launches -> one fused kernel), seeded dropout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kernels
from bench import Ladder, Step, register

SIZES = {"cpu": (64, 1000), "gpu": (8192, 8192)}
DROPOUT_P, DROPOUT_SEED = 0.1, 1234


def _randn(device, dtype, size, count, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = SIZES[size]
    return tuple(torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(count))


def swiglu_three_launches(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up written the long way: sigmoid, multiply, multiply — three kernels, two temporaries."""
    s = torch.sigmoid(gate)
    return gate * s * up


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's own: F.silu is one fused kernel, the multiply a second."""
    return F.silu(gate) * up


def gelu_reference(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def dropout_reference(x: torch.Tensor) -> torch.Tensor:
    keep = kernels.dropout_mask(x.shape, DROPOUT_P, DROPOUT_SEED, device=x.device)
    return torch.where(keep, x.double() / (1.0 - DROPOUT_P), torch.zeros((), dtype=torch.float64, device=x.device))


register(
    Ladder(
        chapter="01_elementwise",
        op="gelu (erf)",
        make_inputs=lambda device, dtype, size: _randn(device, dtype, size, 1),
        reference=gelu_reference,
        steps=[
            Step("torch F.gelu", F.gelu, baseline=True),
            Step("triton kernels.gelu", kernels.gelu),
        ],
        note="64x1000 fp32 on the CPU; 8192x8192 on a GPU",
    )
)

register(
    Ladder(
        chapter="01_elementwise",
        op="swiglu",
        make_inputs=lambda device, dtype, size: _randn(device, dtype, size, 2),
        reference=lambda g, u: F.silu(g.double()) * u.double(),
        steps=[
            Step("torch sigmoid, mul, mul", swiglu_three_launches),
            Step("torch F.silu(g) * u", swiglu_torch, baseline=True),
            Step("triton kernels.swiglu (fused)", kernels.swiglu),
        ],
        note="64x1000 fp32 on the CPU; 8192x8192 on a GPU",
    )
)

register(
    Ladder(
        chapter="01_elementwise",
        op="dropout p=0.1",
        make_inputs=lambda device, dtype, size: _randn(device, dtype, size, 1),
        reference=dropout_reference,
        steps=[
            # torch's dropout draws a different mask: it is a bytes and time baseline only.
            Step("torch F.dropout", lambda x: F.dropout(x, DROPOUT_P, training=True), baseline=True),
            Step("triton kernels.dropout (seeded)", lambda x: kernels.dropout(x, DROPOUT_P, seed=DROPOUT_SEED)),
        ],
        note="torch's mask differs from ours (another RNG): only the seeded step is checked for values",
        tags={"unchecked_steps": ["torch F.dropout"]},
    )
)
