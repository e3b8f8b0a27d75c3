"""The grouped GEMMs' tile configurations: the GPU candidates, the default table, the autotuner.

A mixture-of-experts layer runs four grouped GEMMs (:mod:`kernel_ladder.ops.grouped_matmul`), each a
*kind* here:

* ``"matmul"`` — a plain grouped product: the down projection, ``grouped_matmul`` itself, and every
  ``dx = dy w^T`` of the backward;
* ``"gate_up"`` — the gate and up projections with the SwiGLU in the epilogue (a gate tile and an up
  tile per program: two fp32 accumulators of ``BLOCK_M x BLOCK_N``, so a ``128 x 128`` pair computes
  as many outputs per K step as a plain ``128 x 256`` tile);
* ``"gate_up_backward"`` — the same pair recomputed, ``dh`` read, ``[d gate | d up]`` stored;
* ``"dw"`` — the weight gradient: ``BLOCK_M`` is the slice of an expert's rows reduced per step and
  ``BLOCK_K x BLOCK_N`` the tile of ``dw``.

**On a GPU** each kind is autotuned (``triton.autotune`` through
:func:`kernel_ladder.autotune.make_autotuned`, its disk cache included) over its candidates
(:data:`GPU_CANDIDATES`; :data:`GPU_CANDIDATES_FP32` for float32 inputs, whose tiles take twice the
shared memory and registers), pruned by :func:`kernel_ladder.autotune.prune_to_fit` — the shared memory
of the pipelined tiles (a pair's two B tiles counted) and the problem's size, the rows of one expert
standing for M — and by :attr:`GroupedConfig.interleaved` (GPT-OSS's stride-2 gate/up columns keep more
registers live). The key is ``(E, N, K)``, the dtypes (Triton adds them), the epilogue's switches and
``ROWS_BUCKET``, the power-of-two bucket of the mean rows per expert (``cdiv(M, E)``): a serving batch
whose size changes every step tunes once per bucket, not once per size. The pruner puts the default
table's entry for the key first, so a tuner limited to its first candidates runs it.

**The default table** (:data:`DEFAULT_TABLE`) is what runs when autotuning is off (:data:`AUTOTUNE`) and
the autotuner's first candidate. Its entries are static, modelled choices — **not timings** (no GPU has
run them):

* *rows per expert <= 16* (decode: a few tokens over many experts): 16-row tiles, 4 warps, long
  ``BLOCK_K`` steps (128; 64 for the gate's backward, which keeps more live) and 3-4 stages, so a program
  streams its expert's weight with few loop iterations; a 64-row tile would compute 4x the rows it keeps.
  (vLLM's tuned H200 table for Mixtral's experts uses 16-32-row tiles with ``BLOCK_K`` 128-256 and 4 warps
  at these sizes.)
* *<= 32*: the same with 32-row tiles.
* *<= 128*: 64-row tiles with 4 warps (one warp group, Hopper's ``wgmma.m64``): a group's partial last
  tile wastes at most 63 rows.
* *>= 256* (prefill and training: Mixtral 8x7B at 4,096 tokens has 1,024 rows per expert): the H200
  class tiles, 128 rows and 8 warps (two warp groups), ``BLOCK_K`` 64, 3-4 stages: ``128 x 256``
  outputs for the plain product (vLLM's choice for the same shapes: 128 x 256 x 64, 8 warps, 4
  stages), a ``128 x (128 + 128)`` pair for the gate/up. The cycle model of the steady loop's SASS
  (sm_90; per K step of one program: tensor-core cycles at 2,048 FMA per SM per clock against the
  issue slots, 4 warp-instructions per clock, and shared memory, 128 bytes per clock, for the
  cp.async writes and the wgmma operand reads) puts these at 89% (gate/up) and 100% (plain)
  tensor-core use, against 57% and 67% for the 64-row tiles; docs/architecture.md has the counts.
* the weight gradient reduces 64-row slices into ``128 x 128`` tiles of ``dw`` with 8 warps from 256
  rows per expert, ``64 x 64`` tiles with 4 warps below (its M of the dot is ``BLOCK_K``).

Float32 inputs (TF32 dots) take ``BLOCK_K`` 32 and the tiles the kernels had before: the table's
16-bit choices do not fit their registers. **In the interpreter**, which cannot autotune, one small
configuration runs (:data:`INTERPRETER_CONFIG`, shrunk to the problem), as before.

Every GPU candidate compiles for sm_90 without spilling, with ``wgmma`` for 16-bit tiles of 64 rows
and more: ``tests/aot/grouped_matmul.py`` checks each (``--quick``: the default table's entries).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from .. import runtime
from ..autotune import (
    MatmulConfig,
    fit_config,
    make_autotuned,
    prune_to_fit,
    size_bucket,
)

__all__ = [
    "AUTOTUNE",
    "DEFAULT_TABLE",
    "GPU_CANDIDATES",
    "GPU_CANDIDATES_FP32",
    "INTERPRETER_CONFIG",
    "KINDS",
    "TUNING_KEY",
    "GroupedConfig",
    "autotuned",
    "default_config",
    "fixed_config",
    "make_grouped_autotuned",
    "rows_bucket",
]

#: The grouped GEMMs' kinds (see the module docstring).
KINDS: tuple[str, ...] = ("matmul", "gate_up", "gate_up_backward", "dw")

#: Autotune on a GPU (True) or launch the default table's entry (False). Read at every launch.
AUTOTUNE: bool = True


@dataclass(frozen=True)
class GroupedConfig:
    """One tile configuration of a grouped GEMM.

    ``BLOCK_M`` rows (for ``"dw"``: the slice of rows reduced per step) by ``BLOCK_N`` columns (for the
    gate/up kinds: of the gate, and as many of up) with ``BLOCK_K``-wide steps; ``num_warps`` and
    ``num_stages`` (the software pipeline's depth) are launch options. ``interleaved``: whether it
    compiles without spilling with GPT-OSS's interleaved gate/up columns (measured by
    ``tests/aot/grouped_matmul.py``).
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3
    interleaved: bool = True

    def __post_init__(self) -> None:
        MatmulConfig(self.BLOCK_M, self.BLOCK_N, self.BLOCK_K, 1, self.num_warps, self.num_stages)  # validates

    @property
    def matmul_config(self) -> MatmulConfig:
        """The same tiles as a :class:`~kernel_ladder.autotune.MatmulConfig` (what the launchers take)."""
        return MatmulConfig(self.BLOCK_M, self.BLOCK_N, self.BLOCK_K, 1, self.num_warps, self.num_stages)

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        return self.BLOCK_M, self.BLOCK_N, self.BLOCK_K, self.num_warps, self.num_stages

    def shared_memory_bytes(self, kind: str, element_size: int) -> int:
        """Shared memory of the pipelined operand tiles: ``num_stages`` copies of an A tile and one B tile
        (two for the gate/up pair; for ``"dw"`` an ``x`` slice and a ``dy`` slice)."""
        if kind == "dw":
            per_stage = self.BLOCK_M * (self.BLOCK_K + self.BLOCK_N)
        else:
            pair = 2 if kind.startswith("gate_up") else 1
            per_stage = self.BLOCK_K * (self.BLOCK_M + pair * self.BLOCK_N)
        return self.num_stages * per_stage * element_size

    def to_triton(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K},
                             num_warps=self.num_warps, num_stages=self.num_stages)

    def __str__(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} w{self.num_warps} s{self.num_stages}"


_c = GroupedConfig
#: The 16-bit candidates of each kind, H200-class tiles first, then the workhorses, then the small-M
#: tiles for decode. Every one compiles for sm_90 without spills (tests/aot/grouped_matmul.py).
GPU_CANDIDATES: dict[str, tuple[GroupedConfig, ...]] = {
    "matmul": (
        _c(128, 256, 64, 8, 4), _c(128, 256, 64, 8, 3), _c(128, 128, 64, 8, 4), _c(128, 128, 64, 4, 4),
        _c(64, 256, 64, 8, 4), _c(64, 128, 64, 4, 4), _c(64, 64, 64, 4, 4),
        _c(32, 128, 128, 4, 3), _c(32, 64, 128, 4, 4), _c(16, 128, 128, 4, 4), _c(16, 64, 256, 4, 3),
    ),
    "gate_up": (
        _c(128, 128, 64, 8, 4, interleaved=False), _c(128, 128, 64, 8, 3, interleaved=False), _c(128, 64, 64, 8, 4),
        _c(64, 128, 64, 8, 4), _c(64, 64, 64, 4, 4), _c(64, 64, 64, 4, 3),
        _c(32, 64, 128, 4, 3, interleaved=False), _c(32, 128, 64, 4, 4, interleaved=False), _c(32, 64, 64, 4, 3),
        _c(16, 64, 128, 4, 4, interleaved=False), _c(16, 128, 128, 4, 3, interleaved=False), _c(16, 64, 64, 4, 4),
    ),
    "gate_up_backward": (
        _c(128, 128, 64, 8, 3, interleaved=False), _c(128, 64, 64, 8, 3), _c(64, 128, 64, 8, 3),
        _c(64, 64, 64, 4, 3, interleaved=False), _c(64, 64, 32, 4, 3),
        _c(32, 64, 64, 4, 3), _c(16, 64, 64, 4, 3), _c(16, 64, 128, 4, 3, interleaved=False),
    ),
    "dw": (
        _c(64, 128, 128, 8, 3), _c(64, 256, 128, 8, 3), _c(32, 128, 128, 8, 4),
        _c(64, 64, 64, 4, 3), _c(32, 64, 64, 4, 4), _c(16, 64, 64, 4, 4),
    ),
}
#: Float32 candidates (TF32 dots: BLOCK_K 32, twice the bytes per element).
GPU_CANDIDATES_FP32: dict[str, tuple[GroupedConfig, ...]] = {
    "matmul": (_c(128, 128, 32, 8, 3), _c(64, 128, 32, 4, 3), _c(64, 64, 32, 4, 3), _c(16, 64, 64, 4, 3)),
    "gate_up": (_c(128, 64, 32, 8, 3), _c(64, 64, 32, 4, 3), _c(16, 64, 32, 4, 3)),
    "gate_up_backward": (_c(64, 64, 32, 4, 3), _c(32, 64, 32, 4, 3), _c(16, 64, 32, 4, 3)),
    "dw": (_c(32, 64, 64, 4, 3), _c(32, 128, 64, 8, 3), _c(16, 64, 64, 4, 3)),
}

#: The default table: ``(kind, fp32) -> ((rows-per-expert bucket at most, config), ...)``; the first row whose
#: bound holds the bucket is taken (the last bound, 2**62, is "any"). Each entry is one of the kind's candidates
#: (named here by its tiles, warps and stages). Where each comes from: the module docstring (a static, modelled
#: choice, not a timing).
_ANY = 1 << 62
_TABLE_TILES: dict[tuple[str, bool], tuple[tuple[int, tuple[int, int, int, int, int]], ...]] = {
    ("matmul", False): ((16, (16, 128, 128, 4, 4)), (32, (32, 128, 128, 4, 3)), (128, (64, 128, 64, 4, 4)),
                        (_ANY, (128, 256, 64, 8, 4))),
    ("gate_up", False): ((16, (16, 64, 128, 4, 4)), (32, (32, 64, 128, 4, 3)), (128, (64, 64, 64, 4, 4)),
                         (_ANY, (128, 128, 64, 8, 4))),
    ("gate_up_backward", False): ((16, (16, 64, 64, 4, 3)), (32, (32, 64, 64, 4, 3)), (128, (64, 64, 64, 4, 3)),
                                  (_ANY, (128, 64, 64, 8, 3))),
    ("dw", False): ((128, (64, 64, 64, 4, 3)), (_ANY, (64, 128, 128, 8, 3))),
    ("matmul", True): ((_ANY, (64, 128, 32, 4, 3)),),
    ("gate_up", True): ((_ANY, (64, 64, 32, 4, 3)),),
    ("gate_up_backward", True): ((_ANY, (64, 64, 32, 4, 3)),),
    ("dw", True): ((_ANY, (32, 64, 64, 4, 3)),),
}


def _candidate(kind: str, wide: bool, key: tuple[int, int, int, int, int]) -> GroupedConfig:
    (found,) = [c for c in (GPU_CANDIDATES_FP32 if wide else GPU_CANDIDATES)[kind] if c.key == key]
    return found


DEFAULT_TABLE: dict[tuple[str, bool], tuple[tuple[int, GroupedConfig], ...]] = {
    (kind, wide): tuple((bound, _candidate(kind, wide, key)) for bound, key in rows)
    for (kind, wide), rows in _TABLE_TILES.items()
}
del _c

#: The interpreter's one configuration (shrunk to the problem): few program instances, each ~1 ms of Python.
INTERPRETER_CONFIG: MatmulConfig = MatmulConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=4,
                                                num_stages=2)

#: What the autotuner keys on (Triton adds the pointers' dtypes). The flags change what a tile keeps live.
TUNING_KEY: tuple[str, ...] = ("ROWS_BUCKET", "N", "K", "E", "INPUT_PRECISION", "GATHER_K", "HAS_BIAS", "CLAMPED",
                               "INTERLEAVED")


def rows_bucket(rows: int, experts: int) -> int:
    """The tuning bucket of ``rows`` spread over ``experts``: the next power of two (>= 16) of ``cdiv(rows, E)``."""
    return size_bucket(triton.cdiv(max(1, rows), max(1, experts)))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kernel_ladder.grouped_matmul: kind must be one of {KINDS}, got {kind!r}")


def _interleaved_ok(kind: str, config: GroupedConfig, interleaved: bool) -> bool:
    return config.interleaved or not (interleaved and kind.startswith("gate_up"))


def default_config(kind: str, rows_per_expert: int, N: int, K: int, dtype: torch.dtype, *,
                   interleaved: bool = False) -> GroupedConfig:
    """The default table's entry for ``kind`` at ``rows_per_expert`` (its power-of-two bucket), unfitted.

    ``interleaved`` (GPT-OSS's gate/up columns): when the entry spills with them, the largest candidate of no
    more rows that does not (measured by ``tests/aot/grouped_matmul.py``). ``N`` and ``K``, the rest of the
    tuning key, do not change the table's choice (the launchers shrink it to the problem).
    """
    _check_kind(kind)
    wide = dtype == torch.float32
    bucket = size_bucket(rows_per_expert)
    entry = next(c for bound, c in DEFAULT_TABLE[(kind, wide)] if bucket <= bound)
    if _interleaved_ok(kind, entry, interleaved):
        return entry
    candidates = (GPU_CANDIDATES_FP32 if wide else GPU_CANDIDATES)[kind]
    fitting = [c for c in candidates if _interleaved_ok(kind, c, True)]
    return max(fitting, key=lambda c: (c.BLOCK_M <= entry.BLOCK_M, c.BLOCK_M * c.BLOCK_N, c.BLOCK_K))


def fixed_config(kind: str, rows: int, experts: int, N: int, K: int, dtype: torch.dtype, *,
                 interleaved: bool = False) -> MatmulConfig | None:
    """The config a launcher uses without autotuning, fitted to the problem; None when it autotunes.

    The interpreter's :data:`INTERPRETER_CONFIG`; on a GPU with :data:`AUTOTUNE` off, the default table's
    entry for ``cdiv(rows, experts)`` rows per expert; on a GPU with it on, None (the autotuner picks).
    For ``"dw"`` the fitted "M" is the reduction over the rows and the tile ``BLOCK_K x BLOCK_N`` of dw.
    """
    _check_kind(kind)
    if runtime.INTERPRETER:
        return fit_config(INTERPRETER_CONFIG, rows, N, K)
    if AUTOTUNE:
        return None
    entry = default_config(kind, triton.cdiv(max(1, rows), max(1, experts)), N, K, dtype, interleaved=interleaved)
    return fit_config(entry.matmul_config, rows, N, K)


def _pruner(kind: str, candidates: tuple[GroupedConfig, ...]):
    """The autotuner's early pruning for ``kind``: what fits (shared memory, the problem's size, GPT-OSS's
    interleaved columns), the default table's entry for the key first."""
    mine = {c.key: c for c in candidates}

    def prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
        dtype = named_args["x_ptr"].dtype
        element_size = named_args["x_ptr"].element_size()
        interleaved = bool(kwargs.get("INTERLEAVED", False))
        rows = named_args["ROWS_BUCKET"]
        N, K = named_args["N"], named_args["K"]

        def config_of(c: triton.Config) -> GroupedConfig:
            return mine[(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)]

        allowed = [c for c in configs if _interleaved_ok(kind, config_of(c), interleaved)] or list(configs)
        if kind == "dw":  # the dot is (BLOCK_K x BLOCK_M) @ (BLOCK_M x BLOCK_N): dw's tile is the output
            kept = prune_to_fit(allowed, K, N, rows, lambda c: config_of(c).shared_memory_bytes(kind, element_size))
        else:
            kept = prune_to_fit(allowed, rows, N, K, lambda c: config_of(c).shared_memory_bytes(kind, element_size))
        first = default_config(kind, rows, N, K, dtype, interleaved=interleaved)
        return sorted(kept, key=lambda c: config_of(c) != first)  # stable: the rest keep their order

    return prune


def make_grouped_autotuned(kind: str, wide: bool = False, configs: tuple[GroupedConfig, ...] | None = None,
                           do_bench=None):
    """The kernel of ``kind`` under ``triton.autotune`` over ``configs`` (default: its GPU candidates, float32's
    when ``wide``), pruned by :func:`_pruner` and keyed on :data:`TUNING_KEY` (``kernel_ladder.autotune``'s
    wrapper: EVEN_K per candidate, the disk cache where Triton has one). ``do_bench`` replaces Triton's GPU
    benchmarker (the tests run the tuning loop in the interpreter with a stand-in). Building it needs no GPU.
    """
    from .grouped_matmul import grouped_matmul_dw_kernel, grouped_matmul_kernel

    _check_kind(kind)
    if configs is None:
        configs = (GPU_CANDIDATES_FP32 if wide else GPU_CANDIDATES)[kind]
    configs = tuple(configs)
    dw = kind == "dw"
    key = [k for k in TUNING_KEY if not dw or k not in ("CLAMPED", "INTERLEAVED")]
    return make_autotuned(grouped_matmul_dw_kernel if dw else grouped_matmul_kernel,
                          [c.to_triton() for c in configs], key, do_bench=do_bench,
                          prune=_pruner(kind, configs), even_k=not dw)


@functools.cache
def autotuned(kind: str, wide: bool = False):
    """The kernel of ``kind`` autotuned over its GPU candidates (built once, on first use on a GPU)."""
    return make_grouped_autotuned(kind, wide)

