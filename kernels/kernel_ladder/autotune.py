"""Tile configurations for the matmul kernels: autotuned on a GPU, fixed in the interpreter.

A matmul kernel's speed depends on its tile shape (``BLOCK_M x BLOCK_N`` outputs per program,
``BLOCK_K``-wide slices of the reduction), on how programs are ordered (``GROUP_M``), and on the
launch options ``num_warps`` / ``num_stages`` (software-pipelining depth: how many K slices are
in flight in shared memory). No single choice is best for every shape, dtype and GPU, so:

* **On a GPU** the tiled kernel is wrapped in ``triton.autotune`` over :data:`GPU_CONFIGS`, a
  list that covers Hopper (H100/H200) and Ampere (A100) well. The tuning key is the power-of-two
  *bucket* of M, N and K (not the exact sizes: a serving workload whose M changes with every batch
  would otherwise re-tune forever), the input precision and the epilogue; Triton adds the
  operands' dtypes to the key by itself. Configs whose pipelined tiles do not fit in shared
  memory, or that are far larger than the problem, are pruned before benchmarking. Results are
  cached on disk across runs (``cache_results=True``, Triton >= 3.2; older versions tune once
  per process, see :func:`autotune_supports_disk_cache`).
* **A candidate limit** (:func:`limit_candidates`, or ``KERNEL_LADDER_AUTOTUNE_LIMIT=k`` in the
  environment) keeps only the first ``k`` candidates of every autotuned kernel after pruning, so a cold
  cache compiles at most ``k`` configs per kernel specialization instead of all of them (``make gpu-check``'s
  quick round). The candidate lists are ordered best-first, so the first ``k`` are the likeliest winners.
* **In the interpreter** there is no driver to time anything with (multi-config autotuning needs
  one) and times would not mean GPU speed anyway, so one fixed, sensible configuration is used:
  :data:`INTERPRETER_CONFIG`, its blocks shrunk to the problem (a 1-row matmul does not need 64
  rows of tile).
* **For the lesson** :func:`autotune_cpu` times any function over a list of configs with
  ``time.perf_counter`` and reports them: the *interpreter's* times, which show the mechanics of
  autotuning (measure every candidate, keep the fastest) but say nothing about GPU speed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import triton

from . import runtime

__all__ = [
    "MatmulConfig",
    "GPU_CONFIGS",
    "INTERPRETER_CONFIG",
    "TUNING_KEY",
    "size_bucket",
    "fit_config",
    "default_config",
    "SPLIT_K_DECODE_ROWS",
    "autotune_supports_disk_cache",
    "prune_configs",
    "prune_to_fit",
    "SHORT_TILE_MAX_M",
    "make_autotuned",
    "AUTOTUNE_LIMIT_ENV",
    "candidate_limit",
    "limit_candidates",
    "limited",
    "CpuTiming",
    "CpuAutotuneReport",
    "autotune_cpu",
]


@dataclass(frozen=True)
class MatmulConfig:
    """One tile configuration of the matmul kernels.

    Attributes:
        BLOCK_M, BLOCK_N: the output tile one program computes (powers of two, >= 16: the
            smallest shape ``tl.dot`` accepts).
        BLOCK_K: the width of each slice of the reduction dimension (power of two, >= 16).
        GROUP_M: how many tile-rows are walked column by column before moving on (the grouped,
            "swizzled" order that keeps operand tiles in L2); 1 is plain row-major order.
        num_warps: warps per program (a launch option).
        num_stages: software-pipelining depth on the GPU (a launch option; ignored by the
            interpreter).
    """

    BLOCK_M: int = 64
    BLOCK_N: int = 64
    BLOCK_K: int = 32
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"kernel_ladder.MatmulConfig: {name} must be a power of two >= 16, got {value!r}")
        if isinstance(self.GROUP_M, bool) or not isinstance(self.GROUP_M, int) or self.GROUP_M < 1:
            raise ValueError(f"kernel_ladder.MatmulConfig: GROUP_M must be an int >= 1, got {self.GROUP_M!r}")
        w = self.num_warps
        if isinstance(w, bool) or not isinstance(w, int) or w < 1 or w > 32 or w & (w - 1):
            raise ValueError(f"kernel_ladder.MatmulConfig: num_warps must be a power of two in [1, 32], got {w!r}")
        s = self.num_stages
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"kernel_ladder.MatmulConfig: num_stages must be an int >= 1, got {s!r}")

    @property
    def meta(self) -> dict[str, int]:
        """The kernel's constexpr tile parameters."""
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K, "GROUP_M": self.GROUP_M}

    @property
    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def shared_memory_bytes(self, element_size: int) -> int:
        """Shared memory the pipelined operand tiles take: ``num_stages`` copies of an A and a B tile."""
        return self.num_stages * (self.BLOCK_M * self.BLOCK_K + self.BLOCK_K * self.BLOCK_N) * element_size

    def to_triton(self) -> triton.Config:
        return triton.Config(self.meta, num_warps=self.num_warps, num_stages=self.num_stages)

    def __str__(self) -> str:
        return (f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} G{self.GROUP_M} "
                f"w{self.num_warps} s{self.num_stages}")


def _c(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> MatmulConfig:
    return MatmulConfig(bm, bn, bk, group, warps, stages)


#: The autotuner's candidates on a GPU. Large 128x256 / 256x128 tiles with 8 warps (two warp
#: groups: Hopper's wgmma shapes) for big problems; 128x128 and 64x128 as the workhorses; small
#: 32-64 row tiles for short M; BLOCK_K 32 for fp32 (4-byte elements fill shared memory twice as
#: fast) and 64 for 16-bit types. The list follows the shapes of Triton's own matmul tutorial,
#: extended with Hopper-sized tiles; the pruner drops those that cannot fit or do not fit the problem.
GPU_CONFIGS: tuple[MatmulConfig, ...] = (
    _c(128, 256, 64, 8, 3),
    _c(256, 128, 64, 8, 3),
    _c(128, 128, 64, 8, 4),
    _c(128, 128, 32, 4, 4),
    _c(128, 64, 64, 4, 4),
    _c(64, 128, 64, 4, 4),
    _c(128, 64, 32, 4, 4),
    _c(64, 128, 32, 4, 4),
    _c(64, 64, 64, 4, 4),
    _c(64, 64, 32, 4, 5),
    _c(32, 64, 64, 4, 5),
    _c(32, 128, 64, 4, 4),
    _c(16, 64, 128, 4, 4),
)

#: The interpreter's one configuration (shrunk to small problems by :func:`fit_config`): big
#: enough that few program instances run (each costs ~1 ms of Python), small enough that masked
#: remainders do not waste much numpy work.
INTERPRETER_CONFIG: MatmulConfig = MatmulConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4,
                                                num_stages=2)

#: The arguments of ``matmul_kernel`` that the autotuner keys on (dtypes are added by Triton).
TUNING_KEY: tuple[str, ...] = ("M_BUCKET", "N_BUCKET", "K_BUCKET", "INPUT_PRECISION", "ACTIVATION")


def size_bucket(n: int) -> int:
    """The tuning bucket of a dimension: the next power of two (at least 16)."""
    return max(16, triton.next_power_of_2(max(1, int(n))))


def _shrink(block: int, size: int, floor: int = 16) -> int:
    return max(floor, min(block, triton.next_power_of_2(max(1, size))))


def fit_config(config: MatmulConfig, M: int, N: int, K: int) -> MatmulConfig:
    """``config`` with each block shrunk to at most the next power of two of its dimension."""
    return replace(config, BLOCK_M=_shrink(config.BLOCK_M, M), BLOCK_N=_shrink(config.BLOCK_N, N),
                   BLOCK_K=_shrink(config.BLOCK_K, K))


#: Split-K problems of at most this many rows are decode-shaped (64 x 64 tiles on a GPU); wider ones (short-M,
#: long-K: a fused linear cross-entropy's ``grad_x``) get the tiled kernel's 128 x 128 tiles.
SPLIT_K_DECODE_ROWS: int = 64


def default_config(M: int, N: int, K: int, dtype: torch.dtype, kind: str = "tiled",
                   interpreter: bool | None = None) -> MatmulConfig:
    """The fixed configuration a launcher uses when none is given and nothing is autotuned.

    ``kind`` is ``"tiled"``, ``"split_k"`` or ``"persistent"``. In the interpreter it is
    :data:`INTERPRETER_CONFIG` fitted to the problem; on a GPU a choice per kernel (split-K: short
    row tiles for decode-shaped problems of at most :data:`SPLIT_K_DECODE_ROWS` rows, 128x128 tiles with two
    warp groups for wider ones; persistent: 128x128 tiles, two warp groups). ``interpreter`` None is
    the current mode; True/False asks what that mode would use (a launch plan made on the other machine).
    """
    if runtime.INTERPRETER if interpreter is None else interpreter:
        return fit_config(INTERPRETER_CONFIG, M, N, K)
    wide = dtype == torch.float32
    if kind == "split_k" and M <= SPLIT_K_DECODE_ROWS:
        base = MatmulConfig(64, 64, 32 if wide else 64, 8, 4, 4)
    elif kind == "split_k":
        # A ragged K (masked loads) takes BLOCK_K 32 and 4 stages: at 64, its int64-offset variant spills
        # registers on sm_90 (tests/aot/matmul.py); a K of whole 64-slices (V = 128,256) keeps 64.
        block_k = 32 if wide or K % 64 else 64
        base = MatmulConfig(128, 128, block_k, 8, 8, 4 if block_k == 32 else 3)
    elif kind == "persistent":
        base = MatmulConfig(128, 128, 32 if wide else 64, 8, 8, 3)
    else:
        base = MatmulConfig(128, 128, 32 if wide else 64, 8, 8, 3)
    return fit_config(base, M, N, K)


# ----------------------------------------------------------------------------------------------
# GPU: triton.autotune
# ----------------------------------------------------------------------------------------------


def autotune_supports_disk_cache() -> bool:
    """Whether this Triton's ``triton.autotune`` takes ``cache_results`` (tunings saved on disk)."""
    return "cache_results" in inspect.signature(triton.autotune).parameters


@functools.cache
def _shared_memory_limit() -> int:
    """Shared memory one program may use on the current GPU (Hopper: 227 KiB), else Ampere's."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        limit = getattr(props, "shared_memory_per_block_optin", 0)
        if limit:
            return int(limit)
    return 163 * 1024  # A100's opt-in limit, a safe default


#: From this many rows on, the pruner drops tiles of fewer than 64 rows (:func:`prune_to_fit`).
SHORT_TILE_MAX_M: int = 1024


def prune_to_fit(configs: Sequence[triton.Config], M: int, N: int, K: int,
                 shared_memory: Callable[[triton.Config], int]) -> list[triton.Config]:
    """The candidates that fit in shared memory and are not far larger than an ``M x N x K`` problem.

    ``shared_memory(config)`` is the bytes a candidate's pipelined tiles take (each kernel knows its
    own: matmul holds one A and one B tile per stage). A tile is kept if each block is at most
    ``max(64, next_pow2(dim))`` (``max(32, ...)`` for BLOCK_K): 64 rows of tile for a 16-row problem
    wastes 3/4 of the work, 256 would waste 15/16. At least one config survives: the one with the
    least shared memory among those that fit, or else the smallest. The rule of every autotuned
    matmul-like kernel of the package (matmul, the grouped GEMMs of ``kernel_ladder.ops.moe_configs``).

    Tiles of fewer than 64 rows are for short problems only: when ``M`` is at least :data:`SHORT_TILE_MAX_M`
    they are dropped. Read from the sm_90 compiles (``python -m utils.isa_report``): a 16- or 32-row tile
    cannot use Hopper's warp-group ``wgmma`` (64 rows per warp group) and compiles to ``mma.sync``, modelled
    at 15-38% tensor-core use against 80-100% for the 64- to 256-row tiles, and re-reads B once per 16 or 32
    rows; it never wins there, and each such candidate costs a compile on a cold cache.
    """
    limit = _shared_memory_limit()
    kept, fallback = [], None
    for cfg in configs:
        meta = cfg.kwargs
        smem = shared_memory(cfg)
        if smem > limit:
            continue
        if fallback is None or smem < fallback[0]:
            fallback = (smem, cfg)
        if (meta["BLOCK_M"] <= max(64, size_bucket(M)) and meta["BLOCK_N"] <= max(64, size_bucket(N))
                and meta["BLOCK_K"] <= max(32, size_bucket(K))
                and not (meta["BLOCK_M"] < 64 and M >= SHORT_TILE_MAX_M)):
            kept.append(cfg)
    if kept:
        return kept
    if fallback is not None:
        return [fallback[1]]
    return [min(configs, key=lambda c: c.num_stages * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


#: The environment variable that limits every autotuned kernel to its first ``k`` candidates after pruning.
AUTOTUNE_LIMIT_ENV = "KERNEL_LADDER_AUTOTUNE_LIMIT"
_limit_stack: list[int | None] = []


def _check_limit(k: object, where: str) -> int | None:
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"kernel_ladder.autotune.limit_candidates: {where} must be an int >= 1 or None, got {k!r}")
    return k


def candidate_limit() -> int | None:
    """How many candidates each autotuned kernel keeps after pruning: the innermost :func:`limit_candidates`,
    else ``KERNEL_LADDER_AUTOTUNE_LIMIT`` from the environment, else None (all of them)."""
    if _limit_stack:
        return _limit_stack[-1]
    raw = os.environ.get(AUTOTUNE_LIMIT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = raw
    return _check_limit(value, AUTOTUNE_LIMIT_ENV)


@contextlib.contextmanager
def limit_candidates(k: int | None) -> Iterator[None]:
    """Within the block, every autotuned kernel tunes only its first ``k`` candidates after pruning (None: all).

    The candidate lists are ordered best-first, so ``k = 1`` compiles the likeliest winner alone (no
    benchmarking), ``k = 2`` benchmarks the two likeliest. It applies when a tuning key is first met: a key
    tuned under a limit keeps its pick in that autotuner's in-process cache after the block ends (Triton's
    on-disk tuning cache is keyed by the candidates benchmarked, so a limited tuning never answers a full one).
    """
    _limit_stack.append(_check_limit(k, "k"))
    try:
        yield
    finally:
        _limit_stack.pop()


def limited(prune: Callable[..., list]) -> Callable[..., list]:
    """``prune`` (an ``early_config_prune`` function) followed by the candidate limit (:func:`candidate_limit`).

    Every autotuned kernel of the package wraps its pruner with this, so one switch limits them all.
    """

    @functools.wraps(prune)
    def prune_and_limit(configs, named_args, **kwargs):
        kept = list(prune(configs, named_args, **kwargs))
        k = candidate_limit()
        return kept if k is None else kept[:k]

    return prune_and_limit


def prune_configs(configs: Sequence[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Drop matmul candidates that cannot fit in shared memory or are far larger than the problem
    (:func:`prune_to_fit` with matmul's pipelined A and B tiles)."""
    element_size = named_args["a_ptr"].element_size()

    def shared_memory(cfg: triton.Config) -> int:
        meta = cfg.kwargs
        return cfg.num_stages * (meta["BLOCK_M"] * meta["BLOCK_K"] + meta["BLOCK_K"] * meta["BLOCK_N"]) * element_size

    return prune_to_fit(configs, named_args["M"], named_args["N"], named_args["K"], shared_memory)


def _even_k(args: dict[str, Any]) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def make_autotuned(
    kernel,
    configs: Iterable[MatmulConfig | triton.Config] = GPU_CONFIGS,
    key: Sequence[str] = TUNING_KEY,
    do_bench: Callable | None = None,
    prune: Callable[..., list[triton.Config]] = prune_configs,
    even_k: bool = True,
):
    """``kernel`` wrapped for the GPU: ``triton.autotune`` over ``configs`` around a heuristic for EVEN_K.

    ``EVEN_K`` (K divisible by BLOCK_K: no K masks) depends on the config, so it is computed per
    candidate by ``triton.heuristics`` (``even_k=False``: for a kernel without that parameter). The
    result is an ordinary Triton launcher (``wrapped[grid](...)``) that takes every kernel argument
    except the tile constexprs, ``EVEN_K``, ``num_warps`` and ``num_stages``. Constructing it needs no
    GPU. ``configs`` are :class:`MatmulConfig` or ready ``triton.Config`` (for kernels without
    ``GROUP_M``); ``prune`` is the early pruning (default: matmul's, :func:`prune_configs`);
    ``do_bench`` replaces Triton's GPU benchmarker (``fn(kernel_call, quantiles) -> timings``), e.g. to
    exercise the tuning loop in the interpreter.
    """
    options: dict[str, Any] = {"prune_configs_by": {"early_config_prune": limited(prune)}}
    if autotune_supports_disk_cache():
        options["cache_results"] = True
    if do_bench is not None:
        options["do_bench"] = do_bench
    target = triton.heuristics({"EVEN_K": _even_k})(kernel) if even_k else kernel
    candidates = [c if isinstance(c, triton.Config) else c.to_triton() for c in configs]
    return triton.autotune(configs=candidates, key=list(key), **options)(target)


# ----------------------------------------------------------------------------------------------
# CPU: a timer for the lesson
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuTiming:
    """One candidate's interpreter times (seconds, one per repeat)."""

    config: Any
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class CpuAutotuneReport:
    """What :func:`autotune_cpu` measured. These are Triton-interpreter times on a CPU, not GPU speed."""

    timings: list[CpuTiming] = field(default_factory=list)

    @property
    def best(self) -> Any:
        """The config with the smallest median interpreter time."""
        return min(self.timings, key=lambda t: t.median).config

    def table(self) -> str:
        best = self.best
        width = max([len("config")] + [len(str(t.config)) for t in self.timings])
        lines = [f"{'config'.ljust(width)}  interpreter ms (median)", "-" * (width + 26)]
        for t in self.timings:
            mark = "  <- fastest here" if t.config is best else ""
            lines.append(f"{str(t.config).ljust(width)}  {t.median * 1e3:12.2f}{mark}")
        lines.append("(Triton interpreter on the CPU: these times show the autotuning loop, not GPU speed)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def autotune_cpu(
    fn_by_config: Callable[[Any], Any],
    configs: Iterable[Any],
    *,
    timer: Callable[[], float] = time.perf_counter,
    repeats: int = 3,
    warmup: int = 1,
) -> CpuAutotuneReport:
    """Time ``fn_by_config(config)`` for each config and report them — autotuning by hand.

    This is what ``triton.autotune`` does on a GPU (run every candidate, keep the fastest),
    done with ``timer`` (``time.perf_counter`` by default) so it works anywhere. In the
    interpreter the numbers measure Python executing program instances — mostly how many
    programs and loop iterations a config runs — and not GPU speed; report them as such.

    Args:
        fn_by_config: runs the workload with one config (e.g. ``lambda c: matmul_tiled(a, b, c)``).
        configs: the candidates (any objects; ``MatmulConfig`` prints compactly).
        timer: a clock returning seconds.
        repeats: timed runs per config (the report keeps each, and ranks by the median).
        warmup: untimed runs per config first.

    Returns:
        A :class:`CpuAutotuneReport` (``.best``, ``.timings``, printable as a table).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"kernel_ladder.autotune.autotune_cpu: repeats must be an int >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"kernel_ladder.autotune.autotune_cpu: warmup must be an int >= 0, got {warmup!r}")
    report = CpuAutotuneReport()
    for config in configs:
        for _ in range(warmup):
            fn_by_config(config)
        seconds = []
        for _ in range(repeats):
            start = timer()
            fn_by_config(config)
            seconds.append(timer() - start)
        report.timings.append(CpuTiming(config, tuple(seconds)))
    if not report.timings:
        raise ValueError("kernel_ladder.autotune.autotune_cpu: configs must not be empty")
    return report

