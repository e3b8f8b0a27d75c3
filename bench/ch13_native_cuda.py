"""Chapter 13's native operator on a GPU: the part of ``make gpu-check`` for its CUDA RMSNorm and softmax.

:func:`_native_op_gpu_checks` covers the native extension's CUDA kernels (``kernel_ladder/native/csrc/cuda``):
it builds the extension on the GPU machine (``kernel_ladder.native.load()``), checks the four backend ops
(``torch.ops.kernel_ladder_native``) against torch in float32 at real sizes (bf16, 8192 rows of 1024, 4096 and
8192 columns), and times them against torch (``F.rms_norm``, ``torch.softmax`` and their autograd backward) and
the Triton ops of ``kernel_ladder``. Where the extension cannot be built or run (no nvcc, a CPU build of torch, a
smoke run) its timings are listed as unavailable with the reason. :func:`bench.ch13_below_triton.gpu_checks`
gathers this part with the chapter's others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_ladder
from bench.gpu import Check, Timing

# ----------------------------------------------------------------------------------------------------------
# The native operator's CUDA kernels
# ----------------------------------------------------------------------------------------------------------

#: (rows, columns) of the native op's checks and timings: a warp-per-row size, and the block-per-row sizes
NATIVE_SIZES = {"gpu": [(8192, 1024), (8192, 4096), (8192, 8192)], "smoke": [(4, 40), (3, 1100)]}
NATIVE_EPS = 1e-6


def _native_ops(size: str):
    """``(torch.ops.kernel_ladder_native, "")`` when the extension with its CUDA kernels runs here, else
    ``(None, reason)``."""
    if size != "gpu":
        return None, "smoke run: the native extension is built and run on a GPU run only (its build takes minutes)"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build"
    try:
        from kernel_ladder import native

        native.load()
    except Exception as exc:  # noqa: BLE001 - no compiler, no nvcc, a failed build: reported, not raised
        return None, f"the native extension did not build: {type(exc).__name__}: {str(exc)[:300]}"
    return torch.ops.kernel_ladder_native, ""


def _inputs(rows: int, cols: int, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {
        "x": torch.randn(rows, cols, generator=gen),
        "w": 1.0 + 0.5 * torch.randn(cols, generator=gen),
        "g": torch.randn(rows, cols, generator=gen),
    }
    return {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}


def _rms_norm_grads_float(x, w, g):
    """float32 autograd gradients (dx, dw) of F.rms_norm from bf16 inputs."""
    xf, wf = x.float().requires_grad_(True), w.float().requires_grad_(True)
    y = F.rms_norm(xf, (x.shape[-1],), wf, NATIVE_EPS)
    return torch.autograd.grad(y, (xf, wf), g.float())


def _softmax_backward_float(g, y):
    yf, gf = y.float(), g.float()
    return yf * (gf - (gf * yf).sum(-1, keepdim=True))


def _once(make):
    """A callable returning ``make()``, computed on the first call and kept."""
    kept: list = []

    def get():
        if not kept:
            kept.append(make())
        return kept[0]

    return get


def _autograd_backward(forward, inputs: tuple, grad_out: torch.Tensor):
    """A callable running autograd's backward alone: the forward runs once, on the first (warm-up) call."""
    state: dict = {}

    def backward():
        if not state:
            state["leaves"] = [t.detach().requires_grad_(True) for t in inputs]
            state["out"] = forward(*state["leaves"])
        return torch.autograd.grad(state["out"], state["leaves"], grad_out, retain_graph=True)

    return backward


def _native_op_gpu_checks(size: str = "gpu", ops=None) -> list:
    """Checks and timings of the native extension's CUDA backend ops (see the module docstring).

    ``ops`` stands for ``torch.ops.kernel_ladder_native`` (a test passes a stand-in that runs on the CPU).
    """
    reason = ""
    if ops is None:
        ops, reason = _native_ops(size)
    device = torch.device("cuda") if size == "gpu" else kernel_ladder.runtime.DEVICE
    entries: list = []
    for rows, cols in NATIVE_SIZES["gpu" if size == "gpu" else "smoke"]:
        shape = f"{rows}x{cols}"
        t = _inputs(rows, cols, device)
        x, w, g = t["x"], t["w"], t["g"]
        row = x.numel() * x.element_size()
        param = w.numel() * w.element_size()
        stats = rows * 4  # rstd, one float32 a row
        native = f"native CUDA C++ {shape}"
        # The saved tensors of the backward ops (rstd, the softmax output), made by the native forward on first use.
        rstd = _once(lambda x=x, w=w: ops.rms_norm_forward(x, w, NATIVE_EPS)[1])
        y_sm = _once(lambda x=x: ops.softmax_forward(x))
        if ops is not None:
            entries += [
                Check(f"native rms_norm_forward {shape}", x.dtype,
                      lambda x=x, w=w: ops.rms_norm_forward(x, w, NATIVE_EPS)[0],
                      lambda x=x, w=w: F.rms_norm(x.float(), (x.shape[-1],), w.float(), NATIVE_EPS)),
                Check(f"native rms_norm_backward (dx, dw) {shape}", x.dtype,
                      lambda x=x, w=w, g=g, rstd=rstd: ops.rms_norm_backward(g, x, w, rstd()),
                      lambda x=x, w=w, g=g: _rms_norm_grads_float(x, w, g)),
                Check(f"native softmax_forward {shape}", x.dtype, lambda x=x: ops.softmax_forward(x),
                      lambda x=x: torch.softmax(x.float(), -1)),
                Check(f"native softmax_backward {shape}", x.dtype, lambda g=g, y=y_sm: ops.softmax_backward(g, y()),
                      lambda g=g, y=y_sm: _softmax_backward_float(g, y())),
            ]  # fmt: skip
        impls = {
            "rms_norm forward": (
                2 * row + param + stats,
                {
                    "torch F.rms_norm": lambda x=x, w=w: F.rms_norm(x, (x.shape[-1],), w, NATIVE_EPS),
                    "kernel_ladder (Triton)": lambda x=x, w=w: kernel_ladder.rms_norm(x, w, NATIVE_EPS),
                    native: (lambda x=x, w=w: ops.rms_norm_forward(x, w, NATIVE_EPS)) if ops else None,
                },
            ),
            "rms_norm backward": (
                3 * row + param + stats,
                {
                    "torch F.rms_norm": _autograd_backward(
                        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, NATIVE_EPS), (x, w), g
                    ),
                    "kernel_ladder (Triton)": _autograd_backward(
                        lambda x, w: kernel_ladder.rms_norm(x, w, NATIVE_EPS), (x, w), g
                    ),
                    native: (lambda x=x, w=w, g=g, rstd=rstd: ops.rms_norm_backward(g, x, w, rstd())) if ops else None,
                },
            ),
            "softmax forward": (
                2 * row,
                {
                    "torch.softmax": lambda x=x: torch.softmax(x, -1),
                    "kernel_ladder (Triton)": lambda x=x: kernel_ladder.softmax(x, -1),
                    native: (lambda x=x: ops.softmax_forward(x)) if ops else None,
                },
            ),
            "softmax backward": (
                3 * row,
                {
                    "torch.softmax": _autograd_backward(lambda x: torch.softmax(x, -1), (x,), g),
                    "kernel_ladder (Triton)": _autograd_backward(lambda x: kernel_ladder.softmax(x, -1), (x,), g),
                    native: (lambda g=g, y=y_sm: ops.softmax_backward(g, y())) if ops else None,
                },
            ),
        }
        for op, (nbytes, fns) in impls.items():
            for impl, fn in fns.items():
                baseline = impl.startswith("torch")
                entries.append(
                    Timing(
                        f"{op} {shape}",
                        impl,
                        fn if fn is not None else (lambda: None),
                        bytes=nbytes,
                        baseline=baseline,
                        target="as fast as torch, or faster" if impl == native else "",
                        unavailable="" if fn is not None else reason,
                    )
                )
    return entries
