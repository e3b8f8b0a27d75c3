"""Chapter 00's ladder: vector add as a Python loop, as one torch op, as one Triton kernel."""

from __future__ import annotations

import torch

import kernels
from bench import Ladder, Step, register

SIZES = {"cpu": 2048, "gpu": 1 << 26}


def python_loop_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One tiny torch op per element: what a Python loop over a tensor really launches."""
    out = torch.empty_like(x)
    for i in range(x.numel()):
        out[i] = x[i] + y[i]
    return out


def make_inputs(device: torch.device, dtype: torch.dtype, size: str) -> tuple:
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = SIZES[size]
    return tuple(torch.randn(n, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype) for _ in range(2))


register(
    Ladder(
        chapter="00_gpu_model",
        op="vector add",
        make_inputs=make_inputs,
        reference=lambda x, y: x.double() + y.double(),
        steps=[
            Step("python loop", python_loop_add, on_gpu=False),
            Step("torch x + y", torch.add, baseline=True),
            Step("triton kernels.add", kernels.add),
        ],
        note="n = 2048 fp32 on the CPU (traced); 2^26 on a GPU (timed)",
    )
)
