"""Chapter 03's ladders: RMSNorm and LayerNorm forward and backward, and the fused residual add.

Forward: the torch composition (one launch per op, fp32 intermediates) → torch's own op → the
chapter's one-kernel solution → ``kernel_ladder``. Backward steps run forward and backward and return
the gradients as a tuple: autograd through the composition → through torch's op → the chapter's
kernels (dx row kernel, stage-1 partial sums, column sums) → ``kernel_ladder`` (dx and the partial sums
in one pass). ``add_rms_norm``: the residual add and the norm as two launches → one.

Above the ideal, by design: the row-per-program solutions reload the weight for every row; the
``kernel_ladder`` ops load it once per program (4 forward and 8 backward programs at the CPU size, up to
2 per SM on a GPU), and their backward writes and reads a ``(programs, N)`` fp32 partial buffer
per parameter. The CPU size's rows (1000) take the fused backward; the GPU size's (16384, above
``kernel_ladder.ops.norm.MAX_FUSED_BLOCK_BACKWARD``) take the chunked one, which reads ``g`` and ``x``
twice — so the report's H200 model, scaled from the CPU size, is optimistic for the backward.

``gpu_checks(size)`` adds the chapter's entries to ``make gpu-check``: correctness in bf16 and
fp16 at 4096 x 16384 (forward and backward, weight gradients included) and timings against torch
eager, ``torch.compile`` and a device-to-device copy, with the bytes each op must move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import FORWARD_BOUND, Ladder, Step, register
from bench.gpu import Check, Timing
from bench.gpu import grads as gpu_grads
from solutions import ch03_normalization as solutions

SIZES = {"cpu": (64, 1000), "gpu": (4096, 16384), "smoke": (8, 96)}
RMS_EPS, LN_EPS = 1e-6, 1e-5
NOTE = "64x1000 bf16 on the CPU; 4096x16384 bf16 on a GPU"
BF16_BACKWARD_NOTE = (
    "The unchecked torch step is a traffic and time baseline: in bf16 on the CPU its dw/db miss the "
    "report's bf16 tolerance (max error 0.1-0.3 on values up to 32; they round along the way, where "
    "the chapter's kernels sum in fp32 and round once; chapter 03's notebook measures it)."
)


# ----------------------------------------------------------------------------------------------
# Inputs and the implementations of each step
# ----------------------------------------------------------------------------------------------


def make_inputs(device, dtype, size, names=("x", "w", "b", "g", "residual"), seed=0) -> dict:
    """Row inputs x, grad_out g, residual (n_rows, n_cols) and weight w, bias b (n_cols,)."""
    n_rows, n_cols = SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {
        "x": torch.randn(n_rows, n_cols, generator=gen),
        "w": 1.0 + 0.5 * torch.randn(n_cols, generator=gen),
        "b": 0.5 * torch.randn(n_cols, generator=gen),
        "g": torch.randn(n_rows, n_cols, generator=gen),
        "residual": torch.randn(n_rows, n_cols, generator=gen),
    }
    return {name: tensors[name].to(device=device, dtype=dtype) for name in names}


def rms_norm_composed(x: torch.Tensor, w: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """RMSNorm as written in Hugging Face's LLaMA: upcast, pow, mean, add, rsqrt, mul, downcast, mul."""
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(x.dtype)


def layer_norm_composed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = LN_EPS) -> torch.Tensor:
    """LayerNorm op by op in fp32: mean, subtract, square, mean, add, rsqrt, multiply, scale, shift."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    centred = h - mean
    variance = (centred * centred).mean(-1, keepdim=True)
    y = centred * torch.rsqrt(variance + eps)
    return (y * w + b).to(x.dtype)


def rms_norm_torch(x, w):
    return F.rms_norm(x, x.shape[-1:], w, RMS_EPS)


def layer_norm_torch(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, LN_EPS)


def rms_norm_kernels(x, w):
    return kernel_ladder.rms_norm(x, w, RMS_EPS)


def layer_norm_kernels(x, w, b):
    return kernel_ladder.layer_norm(x, x.shape[-1:], w, b, LN_EPS)


def add_rms_norm_torch(x, residual, w):
    h = x + residual
    return F.rms_norm(h, h.shape[-1:], w, RMS_EPS), h


def add_rms_norm_unfused_kernels(x, residual, w):
    h = kernel_ladder.add(x, residual)
    return kernel_ladder.rms_norm(h, w, RMS_EPS), h


def add_rms_norm_fused(x, residual, w):
    return kernel_ladder.add_rms_norm(x, residual, w, RMS_EPS)


def grads(forward, *inputs: torch.Tensor, grad_out: torch.Tensor) -> tuple:
    """Forward, then autograd's backward: the gradients of every input (a tuple)."""
    return gpu_grads(forward, inputs, grad_out)


def rms_norm_solution_fwd_bwd(x, w, g):
    """The chapter's kernels: forward (saves rstd), dx row kernel, stage 1, column sum."""
    _, rstd = solutions.rms_norm(x, w, RMS_EPS, return_rstd=True)
    return solutions.rms_norm_backward(g, x, w, rstd)


def layer_norm_solution_fwd_bwd(x, w, b, g):
    """The chapter's kernels: forward (saves mean, rstd), dx row kernel, stage 1, two column sums."""
    _, mean, rstd = solutions.layer_norm(x, w, b, LN_EPS, return_stats=True)
    return solutions.layer_norm_backward(g, x, w, mean, rstd)


# ----------------------------------------------------------------------------------------------
# float64 references
# ----------------------------------------------------------------------------------------------


def _double(*tensors):
    return [t.double() for t in tensors]


def rms_norm_reference(x, w):
    return F.rms_norm(*_double(x), x.shape[-1:], *_double(w), RMS_EPS)


def layer_norm_reference(x, w, b):
    return F.layer_norm(x.double(), x.shape[-1:], *_double(w, b), LN_EPS)


def rms_norm_grads_reference(x, w, g):
    return grads(lambda x_, w_: F.rms_norm(x_, x_.shape[-1:], w_, RMS_EPS), *_double(x, w), grad_out=g.double())


def layer_norm_grads_reference(x, w, b, g):
    return grads(lambda x_, w_, b_: F.layer_norm(x_, x_.shape[-1:], w_, b_, LN_EPS), *_double(x, w, b),
                 grad_out=g.double())


def add_rms_norm_reference(x, residual, w):
    # the sum rounded to the inputs' dtype first: the residual stream's value, which is what is normalized
    h = (x + residual).double()
    return F.rms_norm(h, h.shape[-1:], w.double(), RMS_EPS), h


def _fwd_bwd_ideal(*tensors):
    """Forward reads x and the parameters and writes y; backward reads g, x and the parameters and
    writes every gradient. The saved statistics (4-8 bytes per row) are left out."""
    *inputs, g, gradients = tensors
    x, params = inputs[0], inputs[1:-1]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    forward = nbytes(x) + sum(map(nbytes, params)) + nbytes(x)
    backward = nbytes(g) + nbytes(x) + sum(map(nbytes, params)) + sum(map(nbytes, gradients))
    return forward + backward


# ----------------------------------------------------------------------------------------------
# The ladders
# ----------------------------------------------------------------------------------------------


def _compiled(fn):
    """``torch.compile(fn)``, built on the first call (the report calls it on a GPU only)."""
    compiled = []

    def call(*args):
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0](*args)

    return call


def _inputs(names):
    return lambda device, dtype, size: tuple(make_inputs(device, dtype, size, names).values())


register(
    Ladder(
        chapter="03_normalization",
        op="rms_norm forward",
        make_inputs=_inputs(("x", "w")),
        reference=rms_norm_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch composition (op by op)", rms_norm_composed),
            Step("torch F.rms_norm", rms_norm_torch, baseline=True),
            Step("torch.compile composition", _compiled(rms_norm_composed), on_cpu=False),
            Step("one-kernel solution (row per program)", lambda x, w: solutions.rms_norm(x, w, RMS_EPS)),
            Step("kernel_ladder.rms_norm", rms_norm_kernels, bound=FORWARD_BOUND),
        ],
        note=NOTE,
    )
)

register(
    Ladder(
        chapter="03_normalization",
        op="layer_norm forward",
        make_inputs=_inputs(("x", "w", "b")),
        reference=layer_norm_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch composition (op by op)", layer_norm_composed),
            Step("torch F.layer_norm", layer_norm_torch, baseline=True),
            Step("torch.compile composition", _compiled(layer_norm_composed), on_cpu=False),
            Step("one-kernel solution (row per program)", lambda x, w, b: solutions.layer_norm(x, w, b, LN_EPS)),
            Step("kernel_ladder.layer_norm", layer_norm_kernels, bound=FORWARD_BOUND),
        ],
        note=NOTE,
    )
)

register(
    Ladder(
        chapter="03_normalization",
        op="rms_norm forward+backward",
        make_inputs=_inputs(("x", "w", "g")),
        reference=rms_norm_grads_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("autograd of the composition", lambda x, w, g: grads(rms_norm_composed, x, w, grad_out=g)),
            Step("autograd of F.rms_norm", lambda x, w, g: grads(rms_norm_torch, x, w, grad_out=g), baseline=True),
            Step("torch.compile composition",
                 lambda x, w, g, f=_compiled(rms_norm_composed): grads(f, x, w, grad_out=g), on_cpu=False),
            Step("solution kernels (fwd, dx, partials, column sum)", rms_norm_solution_fwd_bwd),
            Step("kernel_ladder.rms_norm", lambda x, w, g: grads(rms_norm_kernels, x, w, grad_out=g)),
        ],
        ideal_bytes=_fwd_bwd_ideal,
        note=NOTE + "; returns (dx, dw). " + BF16_BACKWARD_NOTE,
        tags={"unchecked_steps": ["autograd of the composition"]},
    )
)

register(
    Ladder(
        chapter="03_normalization",
        op="layer_norm forward+backward",
        make_inputs=_inputs(("x", "w", "b", "g")),
        reference=layer_norm_grads_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("autograd of the composition",
                 lambda x, w, b, g: grads(layer_norm_composed, x, w, b, grad_out=g)),
            Step("autograd of F.layer_norm", lambda x, w, b, g: grads(layer_norm_torch, x, w, b, grad_out=g),
                 baseline=True),
            Step("torch.compile composition",
                 lambda x, w, b, g, f=_compiled(layer_norm_composed): grads(f, x, w, b, grad_out=g), on_cpu=False),
            Step("solution kernels (fwd, dx, partials, 2 column sums)", layer_norm_solution_fwd_bwd),
            Step("kernel_ladder.layer_norm", lambda x, w, b, g: grads(layer_norm_kernels, x, w, b, grad_out=g)),
        ],
        ideal_bytes=_fwd_bwd_ideal,
        note=NOTE + "; returns (dx, dw, db). " + BF16_BACKWARD_NOTE,
        tags={"unchecked_steps": ["autograd of F.layer_norm"]},
    )
)

register(
    Ladder(
        chapter="03_normalization",
        op="add_rms_norm",
        make_inputs=_inputs(("x", "residual", "w")),
        reference=add_rms_norm_reference,
        dtype=torch.bfloat16,
        steps=[
            Step("torch x + r, F.rms_norm", add_rms_norm_torch, baseline=True),
            Step("torch.compile x + r, rms_norm", _compiled(add_rms_norm_torch), on_cpu=False),
            Step("kernel_ladder.add + kernel_ladder.rms_norm (unfused)", add_rms_norm_unfused_kernels),
            Step("kernel_ladder.add_rms_norm (fused)", add_rms_norm_fused, bound=FORWARD_BOUND),
        ],
        note=NOTE + "; returns (normed, x + residual)",
    )
)


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------


def _float_grads(forward, *inputs, grad_out):
    return gpu_grads(forward, inputs, grad_out, upcast=True)


def _add_rms_norm_float(x, residual, w, dtype):
    """fp32 add_rms_norm whose sum has the value of the low-precision sum (the residual stream's)
    and the gradient of the exact one."""
    exact = x + residual
    s = exact + ((x.to(dtype) + residual.to(dtype)).float() - exact).detach()
    return rms_norm_torch(s, w), s


def gpu_checks(size: str = "gpu") -> list:
    """Correctness (bf16, fp16; forward and backward incl. dweight/dbias) and timings (bf16).

    ``size="gpu"``: 4096 x 16384 on CUDA, the size the chapter targets. ``size="smoke"``: 8 x 96 on
    ``kernel_ladder.runtime.DEVICE``, so a typo dies on the CPU, not on a rare GPU run (the runner skips
    the ``torch.compile`` implementations there). References are torch in float32. A timed
    backward runs autograd's backward alone (``retain_graph``) on a forward made at its first call.
    """
    device = torch.device("cuda") if size == "gpu" else kernel_ladder.runtime.DEVICE
    entries: list = []

    for dtype in (torch.bfloat16, torch.float16):
        t = make_inputs(device, dtype, size)
        x, w, b, g, r = t["x"], t["w"], t["b"], t["g"], t["residual"]
        entries += [
            Check("rms_norm forward", dtype, lambda x=x, w=w: kernel_ladder.rms_norm(x, w, RMS_EPS),
                  lambda x=x, w=w: rms_norm_torch(x.float(), w.float())),
            Check("layer_norm forward", dtype, lambda x=x, w=w, b=b: layer_norm_kernels(x, w, b),
                  lambda x=x, w=w, b=b: layer_norm_torch(x.float(), w.float(), b.float())),
            Check("add_rms_norm forward (normed, sum)", dtype,
                  lambda x=x, r=r, w=w: add_rms_norm_fused(x, r, w),
                  lambda x=x, r=r, w=w: _add_rms_norm_float(x.float(), r.float(), w.float(), x.dtype)),
            Check("rms_norm backward (dx, dw)", dtype,
                  lambda x=x, w=w, g=g: grads(rms_norm_kernels, x, w, grad_out=g),
                  lambda x=x, w=w, g=g: _float_grads(rms_norm_torch, x, w, grad_out=g)),
            Check("layer_norm backward (dx, dw, db)", dtype,
                  lambda x=x, w=w, b=b, g=g: grads(layer_norm_kernels, x, w, b, grad_out=g),
                  lambda x=x, w=w, b=b, g=g: _float_grads(layer_norm_torch, x, w, b, grad_out=g)),
            Check("add_rms_norm backward (dx, dresidual, dw)", dtype,
                  lambda x=x, r=r, w=w, g=g: grads(lambda *a: add_rms_norm_fused(*a)[0], x, r, w, grad_out=g),
                  lambda x=x, r=r, w=w, g=g: _float_grads(lambda *a: _add_rms_norm_float(*a, x.dtype)[0], x, r, w,
                                                          grad_out=g)),
        ]

    t = make_inputs(device, torch.bfloat16, size)
    x, w, b, g, r = t["x"], t["w"], t["b"], t["g"], t["residual"]
    row = x.numel() * x.element_size()  # one (n_rows, n_cols) tensor
    param = w.numel() * w.element_size()
    copy_dst = torch.empty_like(x)
    entries.append(Timing("copy (device to device)", "torch copy_", lambda: copy_dst.copy_(x), bytes=2 * row,
                          baseline=True, target="the bandwidth the norms are judged against"))

    def forward_timings(op, impls, nbytes, target):
        for impl, fn in impls.items():
            entries.append(Timing(op, impl, fn, bytes=nbytes, baseline=impl == "torch eager",
                                  target=target if impl == "kernels" else ""))

    compiled_rms = torch.compile(rms_norm_composed)
    compiled_ln = torch.compile(layer_norm_composed)
    compiled_add_rms = torch.compile(add_rms_norm_torch)
    forward_timings("rms_norm forward", {
        "kernels": lambda: kernel_ladder.rms_norm(x, w, RMS_EPS),
        "torch eager": lambda: rms_norm_torch(x, w),
        "torch.compile": lambda: compiled_rms(x, w),
    }, 2 * row + param, ">= 90% of the copy's GB/s")
    forward_timings("layer_norm forward", {
        "kernels": lambda: layer_norm_kernels(x, w, b),
        "torch eager": lambda: layer_norm_torch(x, w, b),
        "torch.compile": lambda: compiled_ln(x, w, b),
    }, 2 * row + 2 * param, ">= 90% of the copy's GB/s")
    forward_timings("add_rms_norm forward", {
        "kernels": lambda: add_rms_norm_fused(x, r, w),
        "torch eager": lambda: add_rms_norm_torch(x, r, w),
        "torch.compile": lambda: compiled_add_rms(x, r, w),
    }, 4 * row + param, ">= 90% of the copy's GB/s, and faster than eager's add + rms_norm")

    def backward_timing(op, impl, forward, inputs, nbytes, target=""):
        state: dict = {}

        def backward():
            if not state:  # the forward runs once, on the first (warm-up) call
                state["leaves"] = [t.detach().requires_grad_() for t in inputs]
                out = forward(*state["leaves"])
                state["out"] = out[0] if isinstance(out, tuple) else out
            return torch.autograd.grad(state["out"], state["leaves"], g, retain_graph=True)

        entries.append(Timing(op, impl, backward, bytes=nbytes, baseline=impl == "torch eager", target=target))

    for impl, fn in {"kernels": rms_norm_kernels, "torch eager": rms_norm_torch,
                     "torch.compile": compiled_rms}.items():
        backward_timing("rms_norm backward", impl, fn, (x, w), 3 * row + 2 * param,
                        "faster than torch eager" if impl == "kernels" else "")
    for impl, fn in {"kernels": layer_norm_kernels, "torch eager": layer_norm_torch,
                     "torch.compile": compiled_ln}.items():
        backward_timing("layer_norm backward", impl, fn, (x, w, b), 3 * row + 3 * param,
                        "faster than torch eager" if impl == "kernels" else "")
    for impl, fn in {"kernels": add_rms_norm_fused, "torch eager": add_rms_norm_torch,
                     "torch.compile": compiled_add_rms}.items():
        # reads grad_out and the saved sum, writes one gradient for x and residual (they are equal)
        backward_timing("add_rms_norm backward", impl, fn, (x, r, w), 3 * row + 2 * param,
                        "faster than torch eager" if impl == "kernels" else "")
    return entries
