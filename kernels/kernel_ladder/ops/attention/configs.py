"""The flash-attention kernels' tile configurations: the candidates, which fit, the autotuner, the launch.

**Tiles.** On a GPU each kernel is autotuned (``triton.autotune``, :func:`make_autotuned`) over its own
list of tile configurations — the forward over 64/128-row query blocks and 32-128-key blocks with 4 or
8 warps and 2-3 pipeline stages; the backward kernels over smaller blocks (16-128), because the dK/dV
program holds its key block's fp32 dK and dV in registers (K and V in shared memory) and the dQ program
its fp32 dQ, and the register file, not shared memory, is what runs out first. Each config carries the
widest head dim at which ptxas fits it in registers for sm_90 without spilling (measured by
``tests/aot/flash_attention.py``; separately for fp32 inputs and for soft-capping, which keeps more
live), and the pruner keeps the configs that fit the launch's head dim, dtype and shared memory. The
key is the head-dim tile, the switches and power-of-two buckets of the lengths. In the interpreter,
which cannot autotune, one small configuration runs (:data:`INTERPRETER_CONFIG`). Head dims up to 256
are supported, any value (48, 80, 96, ...): the tile is padded to the next power of two with masks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

from ... import runtime
from ...autotune import _shared_memory_limit, autotune_supports_disk_cache, limited
from .backward import flash_attention_backward_dkdv_kernel, flash_attention_backward_dq_kernel
from .forward import flash_attention_forward_kernel

__all__ = [
    "AttentionConfig",
    "BACKWARD_DKDV_GPU_CONFIGS",
    "BACKWARD_DQ_GPU_CONFIGS",
    "FORWARD_GPU_CONFIGS",
    "INTERPRETER_CONFIG",
    "TUNING_KEY",
    "fits",
    "make_autotuned",
]


@dataclass(frozen=True)
class AttentionConfig:
    """One tile configuration of a flash-attention kernel.

    ``BLOCK_M`` query rows by ``BLOCK_N`` keys per step (powers of two >= 16, ``tl.dot``'s
    smallest shape); ``num_warps`` and ``num_stages`` (software pipelining of the streamed K/V or
    Q/dO tiles) are launch options. ``max_head_dim``: the widest head-dim tile of 16-bit inputs
    at which ptxas fits the kernel in registers for sm_90 without spilling; ``max_head_dim_fp32``
    for float32 inputs (by default half; 0: never in fp32), ``max_head_dim_softcap`` with soft-capping (``tanh`` takes
    registers; the backward kernels also keep the cap's derivative, one more score-sized tile, live;
    0: never with soft-capping); ``max_head_dim_narrow_v`` when v's tile is narrower than q's and k's
    (``Dv < D``, DeepSeek's MLA prefill: ptxas allocates that mix differently; None: ``max_head_dim``);
    ``max_head_dim_window`` with a sliding window (without soft-capping; None: ``max_head_dim``);
    ``max_head_dim_tma`` for 16-bit inputs whose K and V tiles stream through tensor descriptors (the forward's
    ``USE_TMA``: no per-thread addresses, so wider tiles fit; without a window, soft-capping or a narrower v;
    None: ``max_head_dim``). Measured, not modelled: ``tests/aot/flash_attention.py`` compiles every GPU config at
    its limits (and at head dims 64 and 128 below them), the forward's with and without tensor descriptors, as the
    launcher builds them for an 8k context (int64 offsets: 32 heads x 8192 x D with a tile's overrun passes 2**31;
    the tighter case) and for 1000 tokens (32-bit offsets), and fails on any spill.
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int = 4
    num_stages: int = 2
    max_head_dim: int = 256
    max_head_dim_fp32: int | None = None  # None: half of max_head_dim
    max_head_dim_softcap: int | None = None  # None: max_head_dim
    max_head_dim_narrow_v: int | None = None  # None: max_head_dim
    max_head_dim_window: int | None = None  # None: max_head_dim
    max_head_dim_tma: int | None = None  # None: max_head_dim

    def head_dim_limit(self, element_size: int, softcap: bool = False, narrow_v: bool = False,
                       window: bool = False, tma: bool = False) -> int:
        """The widest head-dim tile this config takes for inputs of ``element_size`` bytes (with soft-capping;
        with ``narrow_v``, a v tile narrower than q's and k's; with a sliding ``window``; with ``tma``, K and V
        loaded through tensor descriptors)."""
        if element_size <= 2:
            limit = self.max_head_dim
            if tma and not (softcap or narrow_v or window) and self.max_head_dim_tma is not None:
                limit = self.max_head_dim_tma
            if narrow_v and self.max_head_dim_narrow_v is not None:
                limit = self.max_head_dim_narrow_v
            if window and not softcap and self.max_head_dim_window is not None:
                limit = min(limit, self.max_head_dim_window)
        else:
            limit = self.max_head_dim // 2 if self.max_head_dim_fp32 is None else self.max_head_dim_fp32
        if softcap and self.max_head_dim_softcap is not None:
            limit = min(limit, self.max_head_dim_softcap // (1 if element_size <= 2 else 2))
        return limit

    def to_triton(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N}, num_warps=self.num_warps,
                             num_stages=self.num_stages)

    def shared_memory_bytes(self, kind: str, block_d: int, element_size: int) -> int:
        """Shared memory of the pipelined tiles (an upper estimate): the streamed pair (K and V, or Q and
        dO for the dK/dV kernel) times ``num_stages``, plus the tile(s) held for the whole loop."""
        streamed = self.BLOCK_M if kind == "dkdv" else self.BLOCK_N
        kept = 2 * self.BLOCK_N if kind == "dkdv" else self.BLOCK_M
        return (self.num_stages * 2 * streamed + kept) * block_d * element_size

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages

    def __str__(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N} w{self.num_warps} s{self.num_stages}"


_c = AttentionConfig
#: Forward candidates on a GPU: 128- and 64-row query blocks; 32-key blocks for head dim 256. (A sliding window
#: without soft-capping keeps more live at the limits: ``max_head_dim_window``, measured.) 128 x 128 takes head
#: dim 128 when K and V come through tensor descriptors (no address registers), 64 with ``cp.async``; 128 x 32
#: takes 256 with them, 128 without (where 64 x 32 serves 256). 64 x 128 takes 128 with them, 64 without (at 128
#: with ``cp.async`` and int64 offsets it spills 112 bytes). Neither takes fp32 (at head dim 32 with ``cp.async``
#: they spill 24-160 bytes).
FORWARD_GPU_CONFIGS: tuple[AttentionConfig, ...] = (
    _c(128, 128, 8, 2, max_head_dim=64, max_head_dim_fp32=0, max_head_dim_window=32, max_head_dim_tma=128),
    _c(128, 64, 8, 3, max_head_dim=128, max_head_dim_fp32=32, max_head_dim_window=64),
    _c(128, 64, 8, 2, max_head_dim=128),
    _c(64, 128, 8, 2, max_head_dim=64, max_head_dim_fp32=0, max_head_dim_softcap=64, max_head_dim_narrow_v=128,
       max_head_dim_window=64, max_head_dim_tma=128),
    _c(64, 64, 4, 3, max_head_dim=128, max_head_dim_fp32=32, max_head_dim_softcap=64, max_head_dim_window=64),
    _c(64, 64, 8, 2, max_head_dim=128),
    _c(128, 32, 8, 2, max_head_dim=128, max_head_dim_fp32=128, max_head_dim_softcap=128, max_head_dim_narrow_v=256,
       max_head_dim_window=128, max_head_dim_tma=256),
    _c(64, 32, 8, 2, max_head_dim=256),
)
#: dK/dV candidates: a key block (K, V in shared memory, fp32 dK, dV in registers) and the query blocks
#: streamed. Every product has the key block as its M side (computed transposed); with 8 warps Triton gives
#: a chain of products all warps along M, so a 128-key block is two warp groups of 64 rows and each product
#: a warp-group MMA (``wgmma``): 32x128 at D = 128 issues m64n32k16 for ``S^T``, ``dP^T`` and m64n128k16 for
#: ``dV``, ``dK`` (64x128 at D <= 64: n64 and n64). dK and dV alone take ``2 * BLOCK_N * D / threads``
#: registers (128 of 255 at 32x128, D = 128), so the query block stays at 32 rows there.
BACKWARD_DKDV_GPU_CONFIGS: tuple[AttentionConfig, ...] = (
    _c(64, 128, 8, 2, max_head_dim=64, max_head_dim_fp32=64, max_head_dim_softcap=0),
    _c(32, 128, 8, 3, max_head_dim=128, max_head_dim_fp32=64, max_head_dim_softcap=64),
    _c(32, 128, 8, 2, max_head_dim=128, max_head_dim_fp32=64, max_head_dim_softcap=64),
    _c(32, 64, 4, 3, max_head_dim=64, max_head_dim_fp32=64, max_head_dim_softcap=64, max_head_dim_narrow_v=128),
    _c(64, 32, 8, 2, max_head_dim=128, max_head_dim_fp32=128),
    _c(32, 32, 8, 2, max_head_dim=256, max_head_dim_softcap=64),
    _c(16, 32, 8, 2, max_head_dim=256),
)
#: dQ candidates: a query block (Q, dO, fp32 dQ) held, key blocks streamed.
BACKWARD_DQ_GPU_CONFIGS: tuple[AttentionConfig, ...] = (
    _c(128, 64, 8, 2, max_head_dim=128, max_head_dim_softcap=64),
    _c(128, 32, 8, 2, max_head_dim=256, max_head_dim_softcap=128, max_head_dim_narrow_v=128, max_head_dim_window=128),
    _c(64, 64, 4, 3, max_head_dim=64, max_head_dim_softcap=32),
    _c(64, 64, 8, 2, max_head_dim=128, max_head_dim_softcap=64),
    _c(64, 32, 4, 3, max_head_dim=128),
    _c(64, 32, 8, 2, max_head_dim=128),
    _c(128, 16, 8, 2, max_head_dim=256),
)
del _c
_GPU_CONFIGS = {"forward": FORWARD_GPU_CONFIGS, "dkdv": BACKWARD_DKDV_GPU_CONFIGS, "dq": BACKWARD_DQ_GPU_CONFIGS}

#: The interpreter's one configuration for every kernel: few program instances (each costs ~1 ms of
#: Python per tile operation), and still several blocks at test sizes so that skipping and masking are
#: exercised (the tests use lengths of 33 to 160).
INTERPRETER_CONFIG: AttentionConfig = AttentionConfig(32, 32, 4, 1)


def fits(config: AttentionConfig, kind: str, block_d: int, element_size: int, softcap: bool = False,
         shared_memory: int | None = None, block_dv: int | None = None, window: bool = False,
         tma: bool = False) -> bool:
    """Whether ``config`` suits kernel ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``) at head-dim tile ``block_d``
    (and v's ``block_dv``, default the same) of ``element_size``-byte inputs (``tma``: the forward's K and V through
    tensor descriptors): within its register limit and the GPU's shared memory. The wider of the two tiles is what
    is checked."""
    limit = _shared_memory_limit() if shared_memory is None else shared_memory
    block_dv = block_d if block_dv is None else block_dv
    widest = max(block_d, block_dv)
    return (widest <= config.head_dim_limit(element_size, softcap, narrow_v=block_dv < block_d, window=window,
                                            tma=tma)
            and config.shared_memory_bytes(kind, widest, element_size) <= limit)


def _pruner(kind: str, candidates: tuple[AttentionConfig, ...] | None = None):
    """The autotuner's early pruning for ``kind``: the configs that fit (or the one with the smallest tiles)."""
    mine = {c.key: c for c in (_GPU_CONFIGS[kind] if candidates is None else candidates)}

    def prune(configs, named_args, **kwargs):
        # v's tile may differ (Dv != D: DeepSeek's MLA prefill, 192 and 128)
        block_d, block_dv, softcap = kwargs["BLOCK_D"], kwargs.get("BLOCK_DV", kwargs["BLOCK_D"]), kwargs["SOFTCAP"]
        element_size = named_args["q_ptr"].element_size()
        pairs = [(mine[(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)], c) for c in configs]
        window = bool(kwargs.get("HAS_WINDOW", False))
        tma = bool(kwargs.get("USE_TMA", False))
        kept = [c for config, c in pairs
                if fits(config, kind, block_d, element_size, softcap, block_dv=block_dv, window=window, tma=tma)]
        if kept:
            return kept
        # Nothing fits (fp32 at head dim 256, soft-capping at 256 in dQ): the smallest tiles spill least.
        return [min(pairs, key=lambda pair: pair[0].BLOCK_M * pair[0].BLOCK_N * pair[0].num_stages)[1]]

    return prune


#: What the autotuner keys on (Triton adds the pointers' dtypes); each kernel on those of its arguments.
TUNING_KEY: tuple[str, ...] = ("BUCKET_Q", "BUCKET_K", "BLOCK_D", "BLOCK_DV", "CAUSAL", "HAS_WINDOW", "SOFTCAP",
                               "VARLEN", "INPUT_PRECISION", "BLOCK_SPARSE", "USE_TMA")

_KERNELS = {
    "forward": flash_attention_forward_kernel,
    "dkdv": flash_attention_backward_dkdv_kernel,
    "dq": flash_attention_backward_dq_kernel,
}


def make_autotuned(kind: str, configs: tuple[AttentionConfig, ...] | None = None, do_bench=None):
    """Kernel ``kind`` (``"forward"``, ``"dkdv"``, ``"dq"``) under ``triton.autotune`` over ``configs``
    (default: its GPU list), pruned by :func:`fits` and keyed on :data:`TUNING_KEY`; results cached on
    disk where Triton supports it. ``do_bench`` replaces Triton's GPU benchmarker (the tests run the
    tuning loop in the interpreter with a stand-in). Building it needs no GPU.
    """
    configs = _GPU_CONFIGS[kind] if configs is None else tuple(configs)
    options = {"prune_configs_by": {"early_config_prune": limited(_pruner(kind, configs))}}
    if autotune_supports_disk_cache():
        options["cache_results"] = True
    if do_bench is not None:
        options["do_bench"] = do_bench
    kernel = _KERNELS[kind]
    key = [name for name in TUNING_KEY if name in kernel.arg_names]  # USE_TMA is the forward's alone
    return triton.autotune(configs=[c.to_triton() for c in configs], key=key, **options)(kernel)


@functools.cache
def _autotuned(kind: str):
    """Kernel ``kind`` autotuned over its GPU configs (built once, on first use on a GPU)."""
    return make_autotuned(kind)


def _fixed_config() -> AttentionConfig | None:
    """The one config of the interpreter (which cannot autotune); None on a GPU: autotuned."""
    return INTERPRETER_CONFIG if runtime.INTERPRETER else None


def _launch_kernel(kind: str, grid_of, args: tuple, constexprs: dict, config: AttentionConfig | None = None) -> None:
    """Launch ``kind`` with ``config``, the fixed config, or autotuned. ``grid_of(BLOCK_M, BLOCK_N)`` is the grid
    for a tile."""
    c = _fixed_config() if config is None else config
    if c is not None:
        _KERNELS[kind][grid_of(c.BLOCK_M, c.BLOCK_N)](*args, **constexprs, BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N,
                                                     num_warps=c.num_warps, num_stages=c.num_stages)
        return
    _autotuned(kind)[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **constexprs)
