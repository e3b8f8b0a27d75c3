"""Chapter 01's ladders: GELU, SwiGLU (three torch launches -> one fused kernel), seeded dropout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import FORWARD_BOUND, Ladder, Step, register

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
    keep = kernel_ladder.dropout_mask(x.shape, DROPOUT_P, DROPOUT_SEED, device=x.device)
    return torch.where(keep, x.double() / (1.0 - DROPOUT_P), torch.zeros((), dtype=torch.float64, device=x.device))


register(
    Ladder(
        chapter="01_elementwise",
        op="gelu (erf)",
        make_inputs=lambda device, dtype, size: _randn(device, dtype, size, 1),
        reference=gelu_reference,
        steps=[
            Step("torch F.gelu", F.gelu, baseline=True),
            Step("triton kernel_ladder.gelu", kernel_ladder.gelu, bound=FORWARD_BOUND),
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
            Step("triton kernel_ladder.swiglu (fused)", kernel_ladder.swiglu, bound=FORWARD_BOUND),
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
            Step("triton kernel_ladder.dropout (seeded)",
                 lambda x: kernel_ladder.dropout(x, DROPOUT_P, seed=DROPOUT_SEED),
                 bound=FORWARD_BOUND),
        ],
        note="torch's mask differs from ours (another RNG): only the seeded step is checked for values",
        tags={"unchecked_steps": ["torch F.dropout"]},
    )
)


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: every elementwise op at 2^24 elements, timings at 2^26, bf16 and fp16."""
    from bench.gpu import Check, Timing, compiled, grads

    device = kernel_ladder.runtime.DEVICE
    shape_check, n_time = ((4096, 4096), 1 << 26) if size == "gpu" else ((3, 1000), 4096)
    entries = []
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator(device="cpu").manual_seed(1)
        x, y, g = (torch.randn(shape_check, generator=gen).to(device, dtype) for _ in range(3))
        forward = {
            "gelu": (lambda a: kernel_ladder.gelu(a), F.gelu),
            "gelu tanh": (lambda a: kernel_ladder.gelu(a, approximate="tanh"), lambda a: F.gelu(a, approximate="tanh")),
            "silu": (kernel_ladder.silu, F.silu),
        }
        for name, (ours, ref) in forward.items():
            entries.append(Check(name, dtype, lambda o=ours, x=x: o(x), lambda r=ref, x=x: r(x.float())))
            entries.append(Check(f"{name} backward", dtype, lambda o=ours, x=x, g=g: grads(o, (x,), g),
                                 lambda r=ref, x=x, g=g: grads(r, (x,), g, upcast=True)))
        entries += [
            Check("swiglu", dtype, lambda x=x, y=y: kernel_ladder.swiglu(x, y),
                  lambda x=x, y=y: swiglu_torch(x.float(), y.float())),
            Check("swiglu backward", dtype, lambda x=x, y=y, g=g: grads(kernel_ladder.swiglu, (x, y), g),
                  lambda x=x, y=y, g=g: grads(swiglu_torch, (x, y), g, upcast=True)),
            # The seeded mask is reproducible: the reference rebuilds it from the same seed.
            Check("dropout p=0.1", dtype, lambda x=x: kernel_ladder.dropout(x, DROPOUT_P, seed=7),
                  lambda x=x: torch.where(kernel_ladder.dropout_mask(x.shape, DROPOUT_P, 7, device=x.device),
                                          x.float() / (1 - DROPOUT_P), 0.0)),
        ]
    x, y = (torch.randn(n_time, device=device, dtype=torch.bfloat16) for _ in range(2))
    size_bytes = x.element_size() * n_time
    ops = {
        "gelu": (2, (lambda: kernel_ladder.gelu(x)), F.gelu, (x,)),
        "swiglu": (3, (lambda: kernel_ladder.swiglu(x, y)), swiglu_torch, (x, y)),
        "dropout p=0.1": (2, (lambda: kernel_ladder.dropout(x, DROPOUT_P, seed=1)),
                          lambda a: F.dropout(a, DROPOUT_P), (x,)),
    }
    for name, (passes, ours, torch_fn, args) in ops.items():
        op = f"{name} bf16 2^26"
        entries += [
            Timing(op, "torch eager", lambda f=torch_fn, a=args: f(*a), bytes=passes * size_bytes, baseline=True),
            Timing(op, "torch.compile", compiled(torch_fn, *args), bytes=passes * size_bytes),
            Timing(op, f"kernel_ladder.{name.split()[0]}", ours, bytes=passes * size_bytes,
                   target=">= 90% of copy bandwidth"),
        ]
    return entries
