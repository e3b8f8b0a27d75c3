"""Flash attention (FlashAttention-2), forward and backward, dense and packed (varlen), as
``kernel_ladder::flash_attention`` and ``kernel_ladder::flash_attention_varlen``.

For one head, with queries ``Q`` (``Tq x D``), keys ``K`` and values ``V`` (``Tk x D``)::

    S = scale * Q K^T              (then, with softcap c: S = c * tanh(S / c), Gemma-2's order)
    P = softmax(S + mask)          row by row; masked entries get probability 0
    O = P V                        lse_i = log sum_j exp(S_ij)  (over the visible j)

never holding the ``Tq x Tk`` matrix: each program walks the other side block by block (the online
softmax in the forward, ``P`` recomputed from ``lse`` in the backward), and skips the blocks a causal
or sliding-window mask hides.

``V`` may have its own head dim ``Dv`` (``Tk x Dv``, and ``O`` is ``Tq x Dv``): DeepSeek-V3's MLA prefill
has ``qk_head_dim = 192`` and ``v_head_dim = 128``. The kernels keep two head-dim tiles, ``BLOCK_D`` for
``Q, K, dQ, dK`` and ``BLOCK_DV`` for ``V, O, dO, dV``.

**Attention sinks (GPT-OSS).** With ``sinks`` (one logit per query head), each row's softmax has one more
column, of score ``sink_h`` and value 0: ``O_i = sum_j exp(S_ij) V_j / (exp(sink_h) + sum_j exp(S_ij))``.
The forward folds it in once, after the key loop, as one more step of the online softmax
(``m' = max(m, sink)``, ``l' = l exp(m - m') + exp(sink - m')``), so ``lse`` counts it. The backward's
``P = exp(S - lse)`` then already has the right denominator, and ``dS = P * (dP - delta)`` is unchanged;
the sink's own gradient is ``d sink_h = -sum_i P_sink,i * delta_i`` (``P_sink = exp(sink - lse)``,
``delta = rowsum(dO * O) - dlse``), computed per row by the preprocess and summed in a fixed order.

**The modules, one concern each**, in the order a call goes through them:

* :mod:`.op` — the public :func:`flash_attention` and :func:`flash_attention_varlen`, the custom ops
  (forward and backward, with their fake kernels) and the autograd wiring;
* :mod:`.problem` — the checks, and the plan every launch of a call shares (``_Problem``: shape,
  switches, strides, scalars); the ``cu_seqlens`` values checked on the device;
* :mod:`.launch` — from the plan to the launches: the forward, then the backward's three kernels;
* :mod:`.configs` — the tile configurations, which fit a launch, the autotuner, the interpreter's one tile;
* :mod:`.forward` — the forward kernel: the online softmax, causal/window block skipping, GQA;
* :mod:`.backward` — the preprocess (``delta``), dK/dV and dQ kernels, and why dQ is a second pass;
* :mod:`.tiles` — the ``@triton.jit`` helpers the kernels share: a program's sequence, its ranges of
  blocks, a block-sparse row's list, the saved lse in base 2.

**Packed sequences (varlen).** ``q`` is ``(total_q, Hq, D)``: sequence ``b`` is rows
``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` (flash-attn's ``flash_attn_varlen_func``). The same
kernels run with the ``VARLEN`` switch: each program reads its sequence's start and length from
``cu_seqlens`` (two int32 loads), offsets its pointers by ``start * stride`` and uses the
sequence's own lengths for every bound and mask (causal is bottom-right per sequence). The grid is
``(cdiv(max_seqlen, BLOCK), H, B)``; a program whose block starts past its sequence's length exits
at once and key loops stop at the sequence's length, so padding costs no FLOPs and no bytes. The
dense op is the special case of fixed lengths and a batch stride. ``lse`` is ``(Hq, total_q)``,
flash-attn's varlen layout. The ``cu_seqlens`` are checked on the device (one tiny Triton launch and
``torch._assert_async``: no host synchronization on a GPU, by the value-check policy of
:mod:`kernel_ladder.runtime`; see :func:`check_cu_seqlens_values`).

**Block-sparse (``kernel_ladder.block_sparse_attention``).** With the ``BLOCK_SPARSE`` switch the forward and
dQ programs' key loop, and the dK/dV program's query loop, take their blocks from a per-row int32 list
(``block_count_ptr``/``block_index_ptr``, :class:`BlockLists`) instead of a consecutive range: the same
loop bodies, one block index loaded per step, no causal/window mask (a listed block is visible whole;
only the length bounds are masked). The tiles are then the mask's blocks; see
:mod:`kernel_ladder.ops.block_sparse_attention`.
"""

from .backward import (
    flash_attention_backward_dkdv_kernel,
    flash_attention_backward_dq_kernel,
    flash_attention_backward_preprocess_kernel,
)
from .configs import (
    BACKWARD_DKDV_GPU_CONFIGS,
    BACKWARD_DQ_GPU_CONFIGS,
    FORWARD_GPU_CONFIGS,
    INTERPRETER_CONFIG,
    TUNING_KEY,
    AttentionConfig,
    fits,
    make_autotuned,
)
from .forward import flash_attention_forward_kernel
from .op import flash_attention, flash_attention_varlen
from .problem import MAX_HEAD_DIM, BlockLists, check_cu_seqlens_values, flash_attention_cu_seqlens_kernel

__all__ = [
    "AttentionConfig",
    "BlockLists",
    "BACKWARD_DKDV_GPU_CONFIGS",
    "BACKWARD_DQ_GPU_CONFIGS",
    "FORWARD_GPU_CONFIGS",
    "INTERPRETER_CONFIG",
    "MAX_HEAD_DIM",
    "TUNING_KEY",
    "check_cu_seqlens_values",
    "fits",
    "flash_attention",
    "flash_attention_backward_dkdv_kernel",
    "flash_attention_backward_dq_kernel",
    "flash_attention_backward_preprocess_kernel",
    "flash_attention_cu_seqlens_kernel",
    "flash_attention_forward_kernel",
    "flash_attention_varlen",
    "make_autotuned",
]
