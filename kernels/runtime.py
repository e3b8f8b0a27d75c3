"""How `kernels` runs: compiled on an NVIDIA GPU, or in Triton's interpreter on a CPU.

The mode is fixed when ``@triton.jit`` decorates a function, so it is chosen here, at import,
before any kernel is defined:

* ``KERNEL_LADDER_INTERPRET=1`` forces the interpreter (useful on a GPU machine to debug);
* ``KERNEL_LADDER_INTERPRET=0`` forces compiled kernels;
* otherwise the interpreter is used exactly when no CUDA device is visible.

In interpreter mode the numerics of bfloat16 are repaired (see ``_interpreter_numerics``) so that
bf16 kernels give the answers a GPU gives.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["INTERPRETER", "INTERPRETER_SMS", "DEVICE", "mode", "device_for_tests", "require_launchable", "describe"]


def _choose_interpreter() -> bool:
    forced = os.environ.get("KERNEL_LADDER_INTERPRET", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return not torch.cuda.is_available()


INTERPRETER: bool = _choose_interpreter()
if INTERPRETER:
    # Must happen before triton.jit runs on any kernel; triton reads it at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"

_LANGUAGE_IMPORTED_EARLY = "triton.language" in sys.modules

import triton  # noqa: E402  (after the mode is set)

if INTERPRETER:
    from . import _interpreter_numerics

    if _LANGUAGE_IMPORTED_EARLY:
        # triton.language was imported before the mode was set, so its library functions
        # (tl.sum, tl.max, tl.rand, ...) were built for compilation; rebuild them for the interpreter.
        _interpreter_numerics.reinterpret_language_library()
    _interpreter_numerics.install()
    _interpreter_numerics.explain_missing_driver()
    from . import _profiling

    _profiling.install()  # launches named triton::<kernel> in torch.profiler traces
    # A GPU computes exp(large) = inf or -inf - -inf = nan silently, and the kernels rely on it
    # (softmax of an all -inf row, sigmoid of a very negative input); numpy, under the
    # interpreter, warns about each. Those warnings say nothing about the kernel: silence them.
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")

#: The streaming multiprocessors Triton's interpreter acts as (it has no GPU to ask): launch rules that
#: size a grid by the GPU (programs per SM, split-K, persistent kernels) run on the CPU with this many,
#: so the same multi-program schedules execute with few (slow, interpreted) program instances.
INTERPRETER_SMS: int = 4

#: Where the package's tensors live by default: the GPU when kernels compile, else the CPU.
DEVICE: torch.device = torch.device("cuda" if (torch.cuda.is_available() and not INTERPRETER) else "cpu")


def mode() -> str:
    """``"interpreter"`` or ``"compiled"``."""
    return "interpreter" if INTERPRETER else "compiled"


def device_for_tests() -> torch.device:
    """The device tests and notebooks allocate on (the GPU if kernels compile, else the CPU)."""
    return DEVICE


def describe() -> str:
    """One line naming the mode, the device and the versions, for notebooks and reports."""
    if INTERPRETER:
        where = "Triton interpreter on the CPU (times are not a GPU's)"
    elif torch.cuda.is_available():
        where = f"compiled on {torch.cuda.get_device_name()}"
    else:
        where = "compiled mode, but no CUDA device is visible (launches will fail; unset KERNEL_LADDER_INTERPRET=0)"
    return f"kernels: {where}; triton {triton.__version__}, torch {torch.__version__}"


def require_launchable(op: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error if a kernel of ``op`` cannot run on these tensors in this mode.

    Compiled kernels need CUDA tensors and a CUDA device; the interpreter runs on CPU tensors
    (and copies CUDA tensors to the host and back, which is slow but correct).
    """
    if INTERPRETER:
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{op}: cannot launch a compiled Triton kernel: no CUDA device is visible. "
            "Unset KERNEL_LADDER_INTERPRET=0 (or set it to 1) to run in Triton's interpreter on the CPU, "
            "or run on a machine with an NVIDIA GPU."
        )
    for t in tensors:
        if t.device.type != "cuda":
            raise ValueError(
                f"{op}: expected tensors on a CUDA device (kernels are compiled for the GPU), "
                f"got one on {t.device}. Move it with .cuda(), or set KERNEL_LADDER_INTERPRET=1 "
                "before importing kernels to use the CPU interpreter."
            )
