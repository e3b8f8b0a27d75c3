"""kernel-ladder's production Triton kernels.

``import kernels`` works anywhere: with an NVIDIA GPU the kernels compile; without one they run
in Triton's interpreter on the CPU (see :mod:`kernels.runtime`).
"""

from . import runtime  # noqa: F401  (first: fixes the mode before any kernel is defined)

__version__ = "0.1.0"
__all__ = ["runtime"]
