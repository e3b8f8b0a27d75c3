"""``kernel_ladder.native``: the optional compiled extension — RMSNorm and softmax as C++ operators in
PyTorch's dispatcher.

**What it is.** A small shared library (C++ sources shipped in the wheel under ``csrc/``) that registers
the namespace ``torch.ops.kernel_ladder_native`` with ``TORCH_LIBRARY``:

* backend ops, one kernel per dispatch key — ``CPU`` (``csrc/cpu/``: rows in parallel with
  ``at::parallel_for``, each row's loops vectorized, float32 accumulation for float16/bfloat16 and float64
  for float64), ``Meta`` (``csrc/meta.cpp``: shapes only, so FakeTensor and ``torch.compile`` work) and,
  where torch has CUDA and nvcc is found, ``CUDA`` (``csrc/cuda/ops_cuda.cu``):
  ``rms_norm_forward(x, weight, eps) -> (y, rstd)``, ``rms_norm_backward(grad_y, x, weight, rstd) ->
  (grad_x, grad_weight)``, ``softmax_forward(x) -> y``, ``softmax_backward(grad_y, y) -> grad_x``;
* the user-facing ops ``rms_norm(x, weight, eps)`` and ``softmax(x)`` (over the last dim), whose gradient
  is a ``torch::autograd::Function`` written in C++ at the ``Autograd`` key (``csrc/autograd.cpp``), with
  a ``CompositeExplicitAutograd`` kernel for calls below autograd (``inference_mode``).

The whole call — argument checks, dispatch, autograd bookkeeping, the kernel — is C++: what a call
costs on the host is torch's dispatcher and nothing written in Python (``bench/overhead.py`` compares it
with the same kernel behind a Python ``torch.library.custom_op`` and with the Triton op).

**How it is built.** Just in time, on first use (:func:`load`) or ahead of it (:func:`build`,
``python -m kernel_ladder.native build``, or the Makefile's ``setup`` when ``g++`` is present), with
``torch.utils.cpp_extension`` and ninja; flags ``-O3 -march=x86-64-v3`` (x86; never ``-march=native``)
and OpenMP where torch's ``at::parallel_for`` runs on it. The library is cached under
``$KERNEL_LADDER_NATIVE_DIR`` (or ``~/.cache/kernel_ladder/native``) in a folder named by a hash of
the sources, the flags, the torch version and the Python ABI, so a changed source or a new torch
builds anew and nothing stale is loaded; a file lock lets several processes build at once.
``python -m kernel_ladder.native info`` says where it lives and what it was built with.

**When to use it.** On the CPU, where the Triton ops run in Triton's interpreter (correct but slow):
these kernels run at native speed. And to read how an operator is made below Triton (chapter 13). On
a GPU, the Triton ops (``kernel_ladder.rms_norm``, ``kernel_ladder.softmax``) **remain the default**:
they have the options (offsets, castings, any softmax dim, log-softmax) and the autotuning; nothing in
``kernel_ladder`` imports this module.

Errors: bad arguments raise ``ValueError``/``TypeError`` starting ``kernel_ladder.native.rms_norm: ``
(or ``softmax``) and naming the argument; a missing compiler or ninja raises :class:`NativeBuildError`
saying what to install. The backward is not differentiable again (no double backward): asking for a
second-order gradient raises an error naming the backend op.
"""

from __future__ import annotations

import numbers
import pathlib

import torch

from ._build import NativeBuildError, available, build, build_config, cache_dir, load, loaded_library

__all__ = ["NativeBuildError", "available", "build", "build_config", "cache_dir", "load", "loaded_library",
           "rms_norm", "softmax"]

_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        load()
        _OPS = torch.ops.kernel_ladder_native
    return _OPS


def _check_tensor(op: str, name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"kernel_ladder.native.{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, like ``torch.nn.functional.rms_norm(x, (C,), weight, eps)``, in C++.

    ``y = x / sqrt(mean(x**2, -1) + eps) * weight``, statistics in float32 (float64 for float64).

    Args:
        x: ``(..., C)`` tensor of float32, float64, float16 or bfloat16, any strides (not copied).
        weight: ``(C,)`` tensor of ``x``'s dtype and device, any stride.
        eps: added to the mean square; finite and ``>= 0``.

    Returns ``y``, a new contiguous tensor like ``x``. Differentiable in ``x`` and ``weight`` (once).
    Builds the extension on first call if needed (:func:`load`).
    """
    _check_tensor("rms_norm", "x", x)
    _check_tensor("rms_norm", "weight", weight)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"kernel_ladder.native.rms_norm: eps must be a float, got {type(eps).__name__}")
    return _ops().rms_norm(x, weight, float(eps))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, like ``torch.softmax(x, -1)``, in C++.

    Computed in float32 (float64 for float64) whatever the storage dtype. A row of all ``-inf`` gives
    NaN, as torch's does.

    Args:
        x: ``(..., C)`` tensor of float32, float64, float16 or bfloat16, any strides (not copied).

    Returns a new contiguous tensor like ``x``. Differentiable (once). Builds the extension on first
    call if needed (:func:`load`).
    """
    _check_tensor("softmax", "x", x)
    return _ops().softmax(x)


def describe() -> str:
    """Where the library lives (or would be built) and what it is built with (``python -m kernel_ladder.native
    info``)."""
    config = build_config()
    directory = cache_dir(config)
    library = directory / "kernel_ladder_native.so"
    lines = [
        f"library: {library} ({'built' if library.exists() else 'not built yet'}"
        f"{', loaded' if loaded_library() is not None else ''})",
        f"sources: {pathlib.Path(__file__).resolve().parent / 'csrc'}: {', '.join(config['sources'])}",
        f"C++ flags: {' '.join(config['extra_cflags'])}" + (f"; link: {' '.join(config['extra_ldflags'])}"
                                                            if config["extra_ldflags"] else ""),
        f"CUDA: {'compiled in (' + ' '.join(config['extra_cuda_cflags']) + ')' if config['with_cuda'] else 'no'}"
        f" (torch CUDA {config['torch_cuda']})",
        f"torch {config['torch']}, Python ABI {config['python_abi']}, {config['machine']}",
        f"can build here: {available()}",
    ]
    return "\n".join(lines)
