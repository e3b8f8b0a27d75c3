"""Chapter 02's ladders: softmax forward (5 torch launches -> one fused kernel -> several rows per
program -> online), its backward from the saved output, and cross-entropy over a large vocabulary.

Each ladder is traced at a CPU size small enough for the interpreter and timed (on a GPU) at the
issue's sizes: softmax 4096 x 16384 bf16, cross-entropy with a 128k vocabulary (LLaMA-3's 128256).
``gpu_checks`` adds correctness at those sizes in bf16/fp16, timings against torch eager and
``torch.compile`` with the bytes each must move, and the peak memory of cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

import kernel_ladder
from bench import FORWARD_BOUND, Ladder, Step, register
from solutions import ch02_softmax as solutions

#: (rows, columns) per ladder; "cpu" is traced in the interpreter, "gpu" timed.
SIZES = {
    "softmax": {"cpu": (64, 1000), "gpu": (4096, 16384)},
    "short rows": {"cpu": (512, 100), "gpu": (262144, 128)},
    "long rows": {"cpu": (2, 70000), "gpu": (1024, 131072)},
    "cross-entropy": {"cpu": (32, 4000), "gpu": (4096, 128256)},
}


def _generator(device, seed: int) -> torch.Generator:
    # Drawn on the device itself: a 4096 x 128256 draw on the host would cost seconds of GPU time.
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, device, dtype, seed=0, scale=1.0):
    return (scale * torch.randn(shape, generator=_generator(device, seed), device=device)).to(dtype)


def _randint(high, n, device, seed):
    return torch.randint(0, high, (n,), generator=_generator(device, seed), device=device)


# ----------------------------------------------------------------------------------------------
# The steps
# ----------------------------------------------------------------------------------------------


def softmax_five_ops(x: torch.Tensor) -> torch.Tensor:
    """Softmax as torch ops: max, subtract, exp, sum, divide — five launches, four temporaries."""
    row_max = x.amax(dim=-1, keepdim=True)
    shifted = x - row_max
    numerator = torch.exp(shifted)
    denominator = numerator.sum(dim=-1, keepdim=True)
    return numerator / denominator


def softmax_one_row(x: torch.Tensor) -> torch.Tensor:
    """The chapter's fused kernel: one program per row, the whole row in one block."""
    return solutions.launch_softmax(solutions.softmax_kernel, x, torch.empty_like(x))


def multirow_rows_per_program(n_cols: int) -> int:
    """Rows per program for the chapter's multi-row kernel: about 2048 elements per program."""
    return max(1, min(64, 2048 // triton.next_power_of_2(n_cols)))


def softmax_multirow(x: torch.Tensor) -> torch.Tensor:
    """The chapter's multi-row kernel: several short rows per program as one 2-D tile."""
    rows = multirow_rows_per_program(x.shape[-1])
    return solutions.launch_softmax_multirow(solutions.softmax_multirow_kernel, x, torch.empty_like(x), rows)


def online_block(n_cols: int) -> int:
    """Chunk of the chapter's online kernel: a quarter of the row, at most 4096 columns."""
    return max(16, min(4096, triton.next_power_of_2(n_cols) // 4))


def softmax_online(x: torch.Tensor) -> torch.Tensor:
    """The chapter's online kernel: a statistics pass with a running max and sum, then the output pass."""
    return solutions.launch_softmax_online(solutions.softmax_online_kernel, x, torch.empty_like(x),
                                           online_block(x.shape[-1]))


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


def softmax_backward_torch_ops(y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """``y * (grad_y - sum(y * grad_y))`` as torch ops: multiply, sum, subtract, multiply."""
    dot = (y * grad_y).sum(dim=-1, keepdim=True)
    return y * (grad_y - dot)


def softmax_backward_aten(y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """What torch's autograd runs for softmax: one fused aten kernel."""
    return torch._softmax_backward_data(grad_y, y, -1, y.dtype)


def softmax_backward_one_row(y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """The chapter's backward kernel, from the saved output."""
    return solutions.launch_softmax_backward(solutions.softmax_backward_kernel, y, grad_y, torch.empty_like(y))


def softmax_backward_kernels(y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """``kernel_ladder.softmax``'s backward op (the one autograd calls)."""
    return torch.ops.kernel_ladder.softmax_backward(grad_y, y, -1, y.dtype)


def softmax_backward_reference(y: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    y, grad_y = y.double(), grad_y.double()
    return y * (grad_y - (y * grad_y).sum(dim=-1, keepdim=True))


def cross_entropy_naive(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy the long way: fp32 probabilities for the whole N x V, then -log of the target's."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    picked = probabilities.gather(1, target[:, None]).squeeze(1)
    return (-torch.log(picked)).mean().to(logits.dtype)


def cross_entropy_chunked(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The chapter's torch version over vocabulary chunks of 1024 (online log-sum-exp)."""
    return solutions.chunked_cross_entropy(logits, target, chunk_size=1024)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.double(), target)


def _softmax_inputs(key: str):
    def make(device, dtype, size):
        return (_randn(SIZES[key][size], device, dtype, seed=0, scale=2.0),)

    return make


def _backward_inputs(device, dtype, size):
    shape = SIZES["softmax"][size]
    y = torch.softmax(_randn(shape, device, torch.float32, seed=1, scale=2.0), dim=-1).to(dtype)
    return y, _randn(shape, device, dtype, seed=2)


def _cross_entropy_inputs(device, dtype, size):
    n_rows, vocab = SIZES["cross-entropy"][size]
    return _randn((n_rows, vocab), device, dtype, seed=3, scale=2.0), _randint(vocab, n_rows, device, seed=4)


def _cross_entropy_ideal(logits, target, loss):
    """Read the logits and the targets once, write one number."""
    return logits.nbytes + target.nbytes + loss.nbytes


# ----------------------------------------------------------------------------------------------
# The ladders
# ----------------------------------------------------------------------------------------------

register(
    Ladder(
        chapter="02_softmax",
        op="softmax",
        make_inputs=_softmax_inputs("softmax"),
        reference=softmax_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch 5 ops (max, sub, exp, sum, div)", softmax_five_ops),
            Step("torch F.softmax", lambda x: F.softmax(x, dim=-1), baseline=True),
            Step("triton one row per program", softmax_one_row),
            Step("online: triton, 2 passes", softmax_online),
            Step("triton kernel_ladder.softmax", kernel_ladder.softmax, bound=FORWARD_BOUND),
        ],
        note="64x1000 bf16 on the CPU; 4096x16384 bf16 on a GPU",
    )
)

register(
    Ladder(
        chapter="02_softmax",
        op="softmax, short rows",
        make_inputs=_softmax_inputs("short rows"),
        reference=softmax_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch F.softmax", lambda x: F.softmax(x, dim=-1), baseline=True),
            Step("triton one row per program", softmax_one_row),
            Step("triton several rows per program", softmax_multirow),
            Step("triton kernel_ladder.softmax", kernel_ladder.softmax, bound=FORWARD_BOUND),
        ],
        note="512x100 bf16 on the CPU; 262144x128 bf16 on a GPU: same bytes, fewer programs",
    )
)

register(
    Ladder(
        chapter="02_softmax",
        op="softmax, long rows",
        make_inputs=_softmax_inputs("long rows"),
        reference=softmax_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch F.softmax", lambda x: F.softmax(x, dim=-1), baseline=True),
            # A 131072-column block in 4 warps is 1024 values per thread: it would spill and take
            # minutes to compile on a GPU; traced here only, to show that it moves the ideal bytes.
            Step("triton one row per program (one block)", softmax_one_row, on_gpu=False),
            Step("online: triton, 2 passes", softmax_online),
            Step("online: triton kernel_ladder.softmax", kernel_ladder.softmax),
        ],
        note="2x70000 bf16 on the CPU; 1024x131072 bf16 on a GPU (rows longer than the largest block)",
    )
)

register(
    Ladder(
        chapter="02_softmax",
        op="softmax backward",
        make_inputs=_backward_inputs,
        reference=softmax_backward_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch 4 ops (mul, sum, sub, mul)", softmax_backward_torch_ops),
            Step("torch _softmax_backward_data", softmax_backward_aten, baseline=True),
            Step("triton one row per program", softmax_backward_one_row),
            Step("triton kernels softmax_backward", softmax_backward_kernels),
        ],
        note="from the saved output y; 64x1000 bf16 on the CPU; 4096x16384 bf16 on a GPU",
    )
)

register(
    Ladder(
        chapter="02_softmax",
        op="cross-entropy",
        make_inputs=_cross_entropy_inputs,
        reference=cross_entropy_reference,
        dtype=torch.bfloat16,
        ideal_bytes=_cross_entropy_ideal,
        steps=[
            Step("torch fp32 probabilities, -log", cross_entropy_naive),
            Step("torch F.cross_entropy", F.cross_entropy, baseline=True),
            Step("torch chunks of 1024 (online)", cross_entropy_chunked),
            Step("triton kernel_ladder.cross_entropy", kernel_ladder.cross_entropy, bound=FORWARD_BOUND),
        ],
        note="forward; 32x4000 bf16 on the CPU; 4096x128256 (LLaMA-3 vocabulary) bf16 on a GPU",
    )
)


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------

#: Shapes of gpu_checks: (rows, columns) for each kind of row, and the cross-entropy (N, V).
CHECK_SIZES = {
    "gpu": {"softmax": (4096, 16384), "short": (65536, 128), "long": (256, 131072), "ce": (4096, 128256)},
    "smoke": {"softmax": (4, 1000), "short": (33, 100), "long": (2, 70000), "ce": (8, 3000)},
}


def _backward_from_saved(name: str, x: torch.Tensor, grad_y: torch.Tensor) -> tuple[torch.Tensor]:
    """The gradient in fp32 from the 16-bit output the forward saved (``kernel_ladder``' own forward output).

    Any implementation that saves a bf16/fp16 output inherits that output's rounding: for a
    log-softmax over 70000 columns, ``exp(y)`` is off by up to 2^-9 * |y| relative, times a
    ``sum(grad_y)`` of hundreds — 2% in bf16, for torch's autograd exactly as for ours. So the
    backward is checked against the exact formula applied to the saved output, and the forward
    (checked separately) against float32.
    """
    forward = kernel_ladder.softmax if name == "softmax" else kernel_ladder.log_softmax
    y, g = forward(x).float(), grad_y.float()
    if name == "softmax":
        return (y * (g - (y * g).sum(dim=-1, keepdim=True)),)
    return (g - torch.exp(y) * g.sum(dim=-1, keepdim=True),)


def _ce_torch_fp32(logits, target):
    """What Hugging Face causal-LM losses do: upcast the logits to fp32, then torch's loss."""
    return F.cross_entropy(logits.float(), target)


def _forward_backward(loss_fn, logits, target):
    """Loss and ``backward()`` on a fresh leaf over ``logits``: the gradient is allocated (and freed) per call."""

    def run():
        leaf = logits.detach().requires_grad_(True)
        loss_fn(leaf, target).backward()
        return leaf.grad

    return run


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: softmax / log_softmax / cross-entropy forward and backward in bf16
    and fp16 at real sizes; timings of softmax forward (with a same-size copy for reference) and
    backward at 4096x16384 bf16 and of cross-entropy forward+backward at V = 128256; peak memory of
    cross-entropy forward+backward, ours against torch's."""
    from bench.gpu import Check, Peak, Timing, compiled, grads

    device = kernel_ladder.runtime.DEVICE
    shapes = CHECK_SIZES["gpu" if size == "gpu" else "smoke"]
    entries: list = []
    for dtype in (torch.bfloat16, torch.float16):
        for kind in ("softmax", "short", "long"):
            x = _randn(shapes[kind], device, dtype, seed=5, scale=3.0)
            g = _randn(shapes[kind], device, dtype, seed=6)
            rows = f"{shapes[kind][0]}x{shapes[kind][1]}"
            for name, ours, ref in (
                ("softmax", kernel_ladder.softmax, lambda a: torch.softmax(a, dim=-1)),
                ("log_softmax", kernel_ladder.log_softmax, lambda a: torch.log_softmax(a, dim=-1)),
            ):
                entries.append(Check(f"{name} {rows}", dtype, lambda o=ours, x=x: o(x),
                                     lambda r=ref, x=x: r(x.float())))
                entries.append(Check(f"{name} backward {rows}", dtype, lambda o=ours, x=x, g=g: grads(o, (x,), g),
                                     lambda n=name, x=x, g=g: _backward_from_saved(n, x, g)))
        x = _randn(shapes["softmax"], device, dtype, seed=7, scale=3.0)
        entries.append(Check("softmax dim=0", dtype, lambda x=x: kernel_ladder.softmax(x, dim=0),
                             lambda x=x: torch.softmax(x.float(), dim=0)))
        n_rows, vocab = shapes["ce"]
        logits = _randn((n_rows, vocab), device, dtype, seed=8, scale=3.0)
        target = _randint(vocab, n_rows, device, seed=9)
        target[::7] = -100  # ignored positions, as in padded batches
        entries += [
            Check(f"cross_entropy {n_rows}x{vocab}", dtype,
                  lambda lg=logits, t=target: kernel_ladder.cross_entropy(lg, t),
                  lambda lg=logits, t=target: F.cross_entropy(lg.float(), t)),
            Check(f"cross_entropy backward {n_rows}x{vocab}", dtype,
                  lambda lg=logits, t=target: grads(lambda a: kernel_ladder.cross_entropy(a, t), (lg,)),
                  lambda lg=logits, t=target: grads(lambda a: F.cross_entropy(a, t), (lg,), upcast=True)),
            Check(f"cross_entropy label_smoothing=0.1 {n_rows}x{vocab}", dtype,
                  lambda lg=logits, t=target: kernel_ladder.cross_entropy(lg, t, label_smoothing=0.1),
                  lambda lg=logits, t=target: F.cross_entropy(lg.float(), t, label_smoothing=0.1)),
            Check(f"cross_entropy reduction=none {n_rows}x{vocab}", dtype,
                  lambda lg=logits, t=target: kernel_ladder.cross_entropy(lg, t, reduction="none"),
                  lambda lg=logits, t=target: F.cross_entropy(lg.float(), t, reduction="none")),
        ]

    # Timings, bf16. Softmax reads and writes each element once: 2 tensors; its backward reads y and
    # grad_y and writes grad_x: 3 tensors.
    x = _randn(shapes["softmax"], device, torch.bfloat16, seed=10, scale=3.0)
    y = torch.softmax(x.float(), dim=-1).to(x.dtype)
    grad_y = _randn(shapes["softmax"], device, torch.bfloat16, seed=11)
    copy_dst = torch.empty_like(x)
    op = f"softmax fwd {shapes['softmax'][0]}x{shapes['softmax'][1]} bf16"
    entries += [
        Timing(op, "copy (same bytes)", lambda: copy_dst.copy_(x), bytes=2 * x.nbytes),
        Timing(op, "torch eager", lambda: torch.softmax(x, dim=-1), bytes=2 * x.nbytes, baseline=True),
        Timing(op, "torch.compile", compiled(lambda a: torch.softmax(a, dim=-1), x), bytes=2 * x.nbytes),
        Timing(op, "torch.compile 5 ops", compiled(softmax_five_ops, x), bytes=2 * x.nbytes),
        Timing(op, "ch02 one row/program", lambda: softmax_one_row(x), bytes=2 * x.nbytes),
        Timing(op, "ch02 online", lambda: softmax_online(x), bytes=2 * x.nbytes),
        Timing(op, "kernel_ladder.softmax", lambda: kernel_ladder.softmax(x), bytes=2 * x.nbytes,
               target=">= 90% of copy bandwidth"),
    ]
    op = f"softmax bwd {shapes['softmax'][0]}x{shapes['softmax'][1]} bf16"
    entries += [
        Timing(op, "torch eager", lambda: softmax_backward_aten(y, grad_y), bytes=3 * y.nbytes, baseline=True),
        Timing(op, "torch.compile", compiled(softmax_backward_torch_ops, y, grad_y), bytes=3 * y.nbytes),
        Timing(op, "ch02 one row/program", lambda: softmax_backward_one_row(y, grad_y), bytes=3 * y.nbytes),
        Timing(op, "kernel_ladder softmax_backward", lambda: softmax_backward_kernels(y, grad_y), bytes=3 * y.nbytes,
               target="faster than torch eager"),
    ]
    for kind in ("short", "long"):
        xs = _randn(shapes[kind], device, torch.bfloat16, seed=12, scale=3.0)
        op = f"softmax fwd {shapes[kind][0]}x{shapes[kind][1]} bf16"
        entries += [
            Timing(op, "torch eager", lambda a=xs: torch.softmax(a, dim=-1), bytes=2 * xs.nbytes, baseline=True),
            Timing(op, "torch.compile", compiled(lambda a: torch.softmax(a, dim=-1), xs), bytes=2 * xs.nbytes),
            Timing(op, "kernel_ladder.softmax", lambda a=xs: kernel_ladder.softmax(a), bytes=2 * xs.nbytes),
        ]

    # Cross-entropy forward + backward: at least read the logits and write their gradient.
    n_rows, vocab = shapes["ce"]
    logits = _randn((n_rows, vocab), device, torch.bfloat16, seed=13, scale=3.0)
    target = _randint(vocab, n_rows, device, seed=14)
    op = f"cross_entropy fwd+bwd {n_rows}x{vocab} bf16"
    compiled_ce = torch.compile(F.cross_entropy)
    entries += [
        Timing(op, "torch eager", _forward_backward(F.cross_entropy, logits, target), bytes=2 * logits.nbytes,
               baseline=True),
        Timing(op, "torch eager, fp32 upcast", _forward_backward(_ce_torch_fp32, logits, target),
               bytes=2 * logits.nbytes),
        Timing(op, "torch.compile", _forward_backward(compiled_ce, logits, target), bytes=2 * logits.nbytes),
        Timing(op, "kernel_ladder.cross_entropy", _forward_backward(kernel_ladder.cross_entropy, logits, target),
               bytes=2 * logits.nbytes, target="faster than torch eager"),
    ]
    op = f"cross_entropy fwd+bwd {n_rows}x{vocab} bf16"
    entries += [
        Peak(op, "torch, fp32 upcast (HF)", _forward_backward(_ce_torch_fp32, logits, target), baseline=True),
        Peak(op, "torch, bf16", _forward_backward(F.cross_entropy, logits, target)),
        Peak(op, "kernel_ladder.cross_entropy", _forward_backward(kernel_ladder.cross_entropy, logits, target),
             target="<= 1/4 of torch's (fp32 upcast)"),
    ]
    return entries
