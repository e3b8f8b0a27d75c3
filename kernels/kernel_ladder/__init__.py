"""kernel-ladder's production Triton kernels.

``import kernel_ladder`` works anywhere: with an NVIDIA GPU the kernels compile; without one they run
in Triton's interpreter on the CPU (see :mod:`kernel_ladder.runtime`).

Layout: the ops and their kernels live in :mod:`kernel_ladder.ops` (one module per op; ``kernel_ladder.softmax``
is the function, ``kernel_ladder.ops.softmax`` its module; flash attention is the subpackage
:mod:`kernel_ladder.ops.attention`); :mod:`kernel_ladder.autotune` holds matmul's tile configurations;
:mod:`kernel_ladder.serving` the paged KV cache, the scheduler and the generation engine
(:mod:`kernel_ladder.kv_cache` re-exports the cache and the scheduler under chapter 08's name); the private
modules (``_launch``, ``_elementwise``, ``_rows``, ``_activations``, ``_validate``, ``_autograd``) are the
helpers every op shares.
"""

from . import (  # noqa: F401  (public modules: kernel_ladder.autotune, kernel_ladder.ops.<op>)
    _autocast,
    autotune,
    kv_cache,
    ops,
    runtime,  # noqa: F401  (first: fixes the mode before any kernel is defined)
    serving,
)
from ._autograd import forbid_double_backward
from ._rows import RowConfig
from .autotune import MatmulConfig
from .ops.add import add, add_kernel
from .ops.add_rms_norm import add_rms_norm, add_rms_norm_kernel
from .ops.attention import (
    flash_attention,
    flash_attention_backward_dkdv_kernel,
    flash_attention_backward_dq_kernel,
    flash_attention_backward_preprocess_kernel,
    flash_attention_forward_kernel,
    flash_attention_varlen,
)
from .ops.block_sparse_attention import bigbird_mask, block_sparse_attention, sliding_window_mask
from .ops.cross_entropy import cross_entropy, cross_entropy_backward_kernel, cross_entropy_forward_kernel
from .ops.dropout import dropout, dropout_kernel, dropout_mask, dropout_mask_kernel
from .ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from .ops.gated_mlp import dual_matmul_kernel, gated_mlp, gated_mlp_backward_kernel, gated_mlp_kernel
from .ops.gelu import gelu, gelu_backward_kernel, gelu_kernel
from .ops.grouped_matmul import (
    grouped_matmul,
    grouped_matmul_dw_kernel,
    grouped_matmul_ideal_bytes,
    grouped_matmul_kernel,
    grouped_tile_map,
)
from .ops.layer_norm import layer_norm, layer_norm_backward_kernel, layer_norm_kernel
from .ops.linear import linear, linear_activation_backward_kernel
from .ops.matmul import (
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
from .ops.mla import mla_attention, mla_attention_kernel, write_latent_cache, write_latent_cache_kernel
from .ops.moe import moe
from .ops.moe_permute import moe_combine, moe_gather, moe_permute
from .ops.norm import column_sum_kernel, norm_launch_config
from .ops.paged_attention import paged_attention, paged_attention_kernel, paged_attention_merge_kernel
from .ops.quantize import (
    QuantizedWeight,
    quantize_activations,
    quantize_int4_kernel,
    quantize_rows_kernel,
    quantize_weight,
)
from .ops.quantized_linear import (
    QuantizedLinearConfig,
    quantization_error,
    quantized_linear,
    quantized_linear_backward_kernel,
    quantized_linear_kernel,
    quantized_linear_reduce_kernel,
    w8a8_linear_kernel,
)
from .ops.rms_norm import rms_norm, rms_norm_backward_kernel, rms_norm_kernel
from .ops.rope import rope, rope_cos_sin, rope_kernel
from .ops.silu import silu, silu_backward_kernel, silu_kernel
from .ops.softmax import (
    log_softmax,
    softmax,
    softmax_backward_kernel,
    softmax_backward_online_kernel,
    softmax_kernel,
    softmax_launch_config,
    softmax_online_kernel,
)
from .ops.swiglu import geglu, swiglu, swiglu_backward_kernel, swiglu_kernel
from .ops.topk_routing import moe_load_balancing_loss, topk_routing, topk_routing_backward_kernel, topk_routing_kernel
from .ops.write_kv_cache import write_kv_cache, write_kv_cache_kernel

forbid_double_backward()  # every backward op: a clear error for a gradient of a gradient
_autocast.register()  # every op: torch.autocast casts its inputs as torch's matching op's

__version__ = "0.1.0"
__all__ = [
    "runtime",
    "ops",
    "autotune",
    "RowConfig",
    # ops (torch.library custom ops in the ``kernel_ladder`` namespace, differentiable)
    "add",
    "gelu",
    "silu",
    "swiglu",
    "geglu",
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
    "rope",
    "rope_cos_sin",
    "gated_mlp",
    "grouped_matmul",
    "grouped_tile_map",
    "grouped_matmul_ideal_bytes",
    "fused_linear_cross_entropy",
    "flash_attention",
    "flash_attention_varlen",
    "block_sparse_attention",
    "sliding_window_mask",
    "bigbird_mask",
    "paged_attention",
    "write_kv_cache",
    "mla_attention",
    "write_latent_cache",
    "topk_routing",
    "moe",
    "moe_load_balancing_loss",
    "moe_permute",
    "moe_gather",
    "moe_combine",
    "kv_cache",
    "serving",
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
    "topk_routing_kernel",
    "topk_routing_backward_kernel",
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
    "rope_kernel",
    "gated_mlp_kernel",
    "gated_mlp_backward_kernel",
    "dual_matmul_kernel",
    "grouped_matmul_kernel",
    "grouped_matmul_dw_kernel",
    "flash_attention_forward_kernel",
    "flash_attention_backward_preprocess_kernel",
    "flash_attention_backward_dkdv_kernel",
    "flash_attention_backward_dq_kernel",
    "paged_attention_kernel",
    "paged_attention_merge_kernel",
    "write_kv_cache_kernel",
    "mla_attention_kernel",
    "write_latent_cache_kernel",
]
