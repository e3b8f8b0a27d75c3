"""kernel-ladder's production Triton kernels.

``import kernels`` works anywhere: with an NVIDIA GPU the kernels compile; without one they run
in Triton's interpreter on the CPU (see :mod:`kernels.runtime`).
"""

from . import runtime  # noqa: F401  (first: fixes the mode before any kernel is defined)
from .add import add, add_kernel
from .cross_entropy import cross_entropy, cross_entropy_backward_kernel, cross_entropy_forward_kernel
from .dropout import dropout, dropout_kernel, dropout_mask, dropout_mask_kernel
from .gelu import gelu, gelu_backward_kernel, gelu_kernel
from .linear import linear, linear_activation_backward_kernel
from .matmul import (
    MatmulConfig,
    matmul,
    matmul_kernel,
    matmul_persistent,
    matmul_persistent_kernel,
    matmul_split_k,
    matmul_split_k_kernel,
    matmul_split_k_reduce_kernel,
    matmul_tiled,
    plan_matmul,
)
from .silu import silu, silu_backward_kernel, silu_kernel
from .softmax import (
    log_softmax,
    softmax,
    softmax_backward_kernel,
    softmax_backward_online_kernel,
    softmax_kernel,
    softmax_launch_config,
    softmax_online_kernel,
)
from .swiglu import swiglu, swiglu_backward_kernel, swiglu_kernel

__version__ = "0.1.0"
__all__ = [
    "runtime",
    # ops (torch.library custom ops in the ``kernels`` namespace, differentiable)
    "add",
    "gelu",
    "silu",
    "swiglu",
    "dropout",
    "dropout_mask",
    "cross_entropy",
    "softmax",
    "log_softmax",
    "softmax_launch_config",
    "matmul",
    "linear",
    # matmul's launchers with an explicit configuration, and its dispatch rule
    "MatmulConfig",
    "matmul_tiled",
    "matmul_split_k",
    "matmul_persistent",
    "plan_matmul",
    # the Triton kernels behind them, for reading and tracing
    "add_kernel",
    "gelu_kernel",
    "gelu_backward_kernel",
    "silu_kernel",
    "silu_backward_kernel",
    "swiglu_kernel",
    "swiglu_backward_kernel",
    "dropout_kernel",
    "dropout_mask_kernel",
    "cross_entropy_forward_kernel",
    "cross_entropy_backward_kernel",
    "softmax_kernel",
    "softmax_online_kernel",
    "softmax_backward_kernel",
    "softmax_backward_online_kernel",
    "matmul_kernel",
    "matmul_split_k_kernel",
    "matmul_split_k_reduce_kernel",
    "matmul_persistent_kernel",
    "linear_activation_backward_kernel",
]
