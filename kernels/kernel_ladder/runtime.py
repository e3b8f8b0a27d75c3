"""How `kernel_ladder` runs: compiled on an NVIDIA GPU, or in Triton's interpreter on a CPU.

The mode is fixed when ``@triton.jit`` decorates a function, so it is chosen here, at import,
before any kernel is defined:

* ``KERNEL_LADDER_INTERPRET=1`` forces the interpreter (useful on a GPU machine to debug);
* ``KERNEL_LADDER_INTERPRET=0`` forces compiled kernels;
* otherwise the interpreter is used exactly when no CUDA device is visible.

In interpreter mode the numerics of bfloat16 are repaired (see ``_interpreter_numerics``) so that
bf16 kernels give the answers a GPU gives.

**Value checks.** No op synchronizes with the host in its forward or backward, so that every op can
run inside a CUDA graph and under ``torch.compile(mode="reduce-overhead")``. Checks of an input's
*values* (targets in the vocabulary, offsets non-decreasing, block tables and slots inside the
cache, expert ids in range, ...) need those values on the host, so they follow one rule,
:func:`values_checked`: on CPU tensors they run (there is no device to wait for) and raise a
``ValueError`` naming the bad values; on CUDA only when asked, with ``check_values(True)`` or
``KERNELS_CHECK_VALUES=1`` in the environment (each check then costs a synchronization); never
while a CUDA graph is being captured or ``torch.compile`` traces (there are no values then). When
the host check is off, some CUDA ops still assert their condition on the device
(``torch._assert_async``: no synchronization; a failure surfaces as a device-side assert at the next
synchronizing call): cross-entropy's targets, varlen attention's ``cu_seqlens``, grouped-GEMM
offsets, paged attention's ``seq_lens``. ``check_values(False)`` (``KERNELS_CHECK_VALUES=0``) turns
the host checks off everywhere.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["INTERPRETER", "INTERPRETER_SMS", "DEVICE", "mode", "device_for_tests", "require_launchable", "describe",
           "check_values", "values_checked", "CHECK_VALUES_ENV", "CHECK_VALUES_HINT"]


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
    return f"kernel_ladder: {where}; triton {triton.__version__}, torch {torch.__version__}"


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


# ----------------------------------------------------------------------------------------------
# Value checks (see the module docstring)
# ----------------------------------------------------------------------------------------------

#: The environment variable that sets the value checks at import: 1 (on everywhere), 0 (off), unset (default).
CHECK_VALUES_ENV = "KERNELS_CHECK_VALUES"
#: What an error or assertion says when the host value checks were off.
CHECK_VALUES_HINT = (f"value checks are off on this device: kernel_ladder.runtime.check_values(True) or "
                     f"{CHECK_VALUES_ENV}=1 checks on the host (one synchronization) and names the bad values")


def _setting_from_env() -> bool | None:
    raw = os.environ.get(CHECK_VALUES_ENV, "").strip().lower()
    if raw in ("", "auto", "default"):
        return None
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"kernel_ladder.runtime: {CHECK_VALUES_ENV} must be 1, 0 or auto (unset), got {raw!r}")


_check_values_setting: bool | None = _setting_from_env()


class check_values:  # noqa: N801  (a function-like context manager, as torch.set_grad_enabled)
    """Turn the ops' data-dependent value checks on (``True``), off (``False``) or to the default (``None``).

    The default checks CPU tensors only; ``True`` also checks CUDA tensors, at the price of one
    host synchronization per check (for debugging: the error names the bad values); ``False``
    checks nothing on the host (the CUDA ops that assert on the device keep doing so). Takes effect at
    once, for the whole process; used as a context manager it restores the previous setting on
    exit::

        kernel_ladder.runtime.check_values(True)            # from now on
        with kernel_ladder.runtime.check_values(False):     # only inside the block
            ...
    """

    def __init__(self, enabled: bool | None) -> None:
        global _check_values_setting
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"kernel_ladder.runtime.check_values: enabled must be True, False or None (the default), "
                            f"got {type(enabled).__name__}")
        self.previous = _check_values_setting
        self.enabled = enabled
        _check_values_setting = enabled

    def __enter__(self) -> check_values:
        return self

    def __exit__(self, *exc: object) -> None:
        global _check_values_setting
        _check_values_setting = self.previous

    @staticmethod
    def setting() -> bool | None:
        """The current setting: ``True``, ``False`` or ``None`` (the default: CPU tensors only)."""
        return _check_values_setting


def _tracing(tensors: tuple[torch.Tensor, ...]) -> bool:
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 (loaded with torch already)

    return any(t.device.type == "meta" or is_fake(t) for t in tensors)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def values_checked(*tensors: torch.Tensor) -> bool:
    """Whether a value check of these tensors runs on the host now (the rule in the module docstring).

    False while ``torch.compile`` traces or the tensors are fake, and while a CUDA graph is being
    captured; otherwise the :class:`check_values` setting, whose default checks CPU tensors only.
    """
    if _tracing(tensors) or _capturing():
        return False
    if _check_values_setting is not None:
        return _check_values_setting
    return all(t.device.type == "cpu" for t in tensors)


def device_assertions(*tensors: torch.Tensor) -> bool:
    """Whether an op asserts a value condition on the device instead (no host check, real CUDA tensors)."""
    return not _tracing(tensors) and any(t.device.type == "cuda" for t in tensors)
