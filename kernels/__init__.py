"""kernel-ladder's production Triton kernels.

``import kernels`` works anywhere: with an NVIDIA GPU the kernels compile; without one they run
in Triton's interpreter on the CPU (see :mod:`kernels.runtime`).
"""

from . import runtime  # noqa: F401  (first: fixes the mode before any kernel is defined)
from ._autograd import forbid_double_backward
from ._norm import column_sum_kernel, norm_launch_config
from .add import add, add_kernel
from .add_rms_norm import add_rms_norm, add_rms_norm_kernel
from .cross_entropy import cross_entropy, cross_entropy_backward_kernel, cross_entropy_forward_kernel
from .dropout import dropout, dropout_kernel, dropout_mask, dropout_mask_kernel
from .gelu import gelu, gelu_backward_kernel, gelu_kernel
from .layer_norm import layer_norm, layer_norm_backward_kernel, layer_norm_kernel
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
from .quantize import (
    QuantizedWeight,
    quantize_activations,
    quantize_int4_kernel,
    quantize_rows_kernel,
    quantize_weight,
)
from .quantized_linear import (
    QuantizedLinearConfig,
    quantization_error,
    quantized_linear,
    quantized_linear_backward_kernel,
    quantized_linear_kernel,
    quantized_linear_reduce_kernel,
    w8a8_linear_kernel,
)
from .rms_norm import rms_norm, rms_norm_backward_kernel, rms_norm_kernel
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

forbid_double_backward()  # every backward op: a clear error for a gradient of a gradient

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
    "quantize_weight",
    "quantize_activations",
    "quantized_linear",
    "QuantizedWeight",
    "QuantizedLinearConfig",
    "quantization_error",
    "rms_norm",
    "layer_norm",
    "add_rms_norm",
    "norm_launch_config",
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
    "quantize_rows_kernel",
    "quantize_int4_kernel",
    "quantized_linear_kernel",
    "w8a8_linear_kernel",
    "quantized_linear_reduce_kernel",
    "quantized_linear_backward_kernel",
    "rms_norm_kernel",
    "rms_norm_backward_kernel",
    "layer_norm_kernel",
    "layer_norm_backward_kernel",
    "add_rms_norm_kernel",
    "column_sum_kernel",
]
