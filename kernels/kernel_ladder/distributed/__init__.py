"""``kernel_ladder.distributed``: parallelism built on ``torch.distributed`` (gloo on a CPU, NCCL on GPUs).

Import it explicitly (``import kernel_ladder.distributed``); ``import kernel_ladder`` does not load
``torch.distributed``. Everything here runs inside an initialized process group — under
``torchrun``, or in a notebook or test through :class:`utils.distributed.World`.

* :mod:`kernel_ladder.distributed.collectives` — ring all-reduce / all-gather / reduce-scatter and a
  tree broadcast from point-to-point messages, with their α–β cost and byte counts.
* :mod:`kernel_ladder.distributed.data_parallel` — :class:`DataParallel`: gradient buckets all-reduced
  during the backward, through gradient hooks.
* :mod:`kernel_ladder.distributed.tensor_parallel` — Megatron's column / row parallel linears with their
  ``f`` / ``g`` operators, the vocabulary-parallel embedding and cross-entropy.
* :mod:`kernel_ladder.distributed.context_parallel` — ring attention (contiguous or zigzag layout) on
  ``kernel_ladder.flash_attention``, forward and backward.
* :mod:`kernel_ladder.distributed.pipeline` — :class:`Pipeline`: GPipe and 1F1B over one stage per rank,
  and the bubble of the order that ran.
* :mod:`kernel_ladder.distributed.zero` — ZeRO: :class:`ZeroOptimizer` (stages 1 and 2) and
  :func:`shard_module` (stage 3), with the bytes each rank holds.
* :mod:`kernel_ladder.distributed.layout` — :func:`plan_layout`: memory and traffic per GPU of a
  tensor × pipeline × data parallel mesh (a model, counted from the sizes).
"""

from .collectives import (
    AlphaBeta,
    CommStats,
    RingShift,
    chunk_bounds,
    count_bytes,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_shift,
    star_all_reduce,
    tree_all_reduce,
    tree_broadcast,
)
from .context_parallel import causal_work, ring_attention, zigzag_shard, zigzag_unshard
from .data_parallel import Bucket, DataParallel, plan_buckets
from .layout import Layout, plan_layout
from .pipeline import Pipeline, bubble_fraction, logical_timeline, schedule_order
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_parallel,
    gather_from_parallel,
    gather_sequence,
    reduce_from_parallel,
    reduce_scatter_sequence,
    shard_range,
    vocab_parallel_cross_entropy,
)
from .zero import ZeroOptimizer, module_memory, shard_module

__all__ = [
    "AlphaBeta",
    "Bucket",
    "ColumnParallelLinear",
    "CommStats",
    "DataParallel",
    "Layout",
    "Pipeline",
    "RingShift",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ZeroOptimizer",
    "chunk_bounds",
    "bubble_fraction",
    "causal_work",
    "copy_to_parallel",
    "count_bytes",
    "gather_from_parallel",
    "gather_sequence",
    "logical_timeline",
    "module_memory",
    "plan_buckets",
    "plan_layout",
    "reduce_from_parallel",
    "reduce_scatter_sequence",
    "ring_attention",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_shift",
    "schedule_order",
    "shard_module",
    "shard_range",
    "star_all_reduce",
    "tree_all_reduce",
    "tree_broadcast",
    "vocab_parallel_cross_entropy",
    "zigzag_shard",
    "zigzag_unshard",
]
