"""Chapter 00's ladder: vector add as a Python loop, as one torch op, as one Triton kernel."""

from __future__ import annotations

import torch

import kernel_ladder
from bench import FORWARD_BOUND, Ladder, Step, register

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
            Step("triton kernel_ladder.add", kernel_ladder.add, bound=FORWARD_BOUND),
        ],
        note="n = 2048 fp32 on the CPU (traced); 2^26 on a GPU (timed)",
    )
)


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: add at 2^24 (checks) and 2^26 (timing) elements, bf16 and fp16."""
    from bench.gpu import Check, Timing, compiled

    device = kernel_ladder.runtime.DEVICE
    n_check, n_time = (4096 * 4096, 1 << 26) if size == "gpu" else (3000, 4096)
    entries = []
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator(device="cpu").manual_seed(0)
        x, y = (torch.randn(n_check, generator=gen).to(device, dtype) for _ in range(2))
        rows = x.view(-1, 1000 if size != "gpu" else 4096)
        entries += [
            Check("add", dtype, lambda x=x, y=y: kernel_ladder.add(x, y), lambda x=x, y=y: x.float() + y.float()),
            Check("add (broadcast row)", dtype, lambda r=rows: kernel_ladder.add(r, r[:1]),
                  lambda r=rows: r.float() + r[:1].float()),
            Check("add (transposed)", dtype, lambda r=rows: kernel_ladder.add(r.t(), r.t()),
                  lambda r=rows: 2 * r.t().float()),
        ]
    x, y = (torch.randn(n_time, device=device, dtype=torch.bfloat16) for _ in range(2))
    moved = 3 * n_time * x.element_size()
    entries += [
        Timing("add bf16 2^26", "torch eager", lambda: x + y, bytes=moved, baseline=True),
        Timing("add bf16 2^26", "torch.compile", compiled(lambda a, b: a + b, x, y), bytes=moved),
        Timing("add bf16 2^26", "kernel_ladder.add", lambda: kernel_ladder.add(x, y), bytes=moved,
               target=">= 90% of copy bandwidth"),
    ]
    return entries

