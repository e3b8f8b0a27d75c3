"""``kernels.distributed``: parallelism built on ``torch.distributed`` (gloo on a CPU, NCCL on GPUs).

Import it explicitly (``import kernels.distributed``); ``import kernels`` does not load
``torch.distributed``. Everything here runs inside an initialized process group — under
``torchrun``, or in a notebook or test through :class:`utils.distributed.World`.

* :mod:`kernels.distributed.collectives` — ring all-reduce / all-gather / reduce-scatter and a
  tree broadcast from point-to-point messages, with their α–β cost and byte counts.
"""

from .collectives import (
    AlphaBeta,
    CommStats,
    chunk_bounds,
    count_bytes,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_broadcast,
)

__all__ = [
    "AlphaBeta",
    "CommStats",
    "chunk_bounds",
    "count_bytes",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "tree_broadcast",
]
