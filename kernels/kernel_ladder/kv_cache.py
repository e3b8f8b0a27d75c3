"""The paged KV cache's bookkeeping and the continuous-batching scheduler, under their first name.

A thin module kept so that ``kernel_ladder.kv_cache`` (chapter 08's name) still imports: the code
lives in :mod:`kernel_ladder.serving` — the block pool in :mod:`~kernel_ladder.serving.block_pool`,
the paged cache in :mod:`~kernel_ladder.serving.paged_cache`, the scheduler in
:mod:`~kernel_ladder.serving.scheduler` — and this module re-exports its public names unchanged
(the same classes, not copies). New code imports from :mod:`kernel_ladder.serving`.
"""

from .serving.block_pool import BlockAllocator, BlockKey, KVCacheOutOfBlocks  # noqa: F401  (BlockKey: as before)
from .serving.paged_cache import PagedKVCache
from .serving.scheduler import Request, Scheduler, SchedulerOutput

__all__ = [
    "KVCacheOutOfBlocks",
    "BlockAllocator",
    "PagedKVCache",
    "Request",
    "Scheduler",
    "SchedulerOutput",
]
