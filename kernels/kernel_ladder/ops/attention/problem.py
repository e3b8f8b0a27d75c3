"""Validate a flash-attention call and plan its launches, once: the checks, the :class:`_Problem`, the
block-sparse lists' arguments, and the ``cu_seqlens`` value check.

A :class:`_Problem` is what every launch of one call shares — the shape, the switches, how to see each
tensor as ``(B, H, T, D)`` (a packed ``(total, H, D)`` one with a batch stride of 0), the scalar
arguments and the constexprs — so the forward and the three backward kernels are launched from the
same plan (:mod:`.launch`). The checks raise ``ValueError``/``TypeError`` naming the op and the
argument; the ``cu_seqlens`` values are checked on their device (:func:`check_cu_seqlens_values`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import _launch, runtime
from ..._launch import next_power_of_2
from ..._validate import (
    check_attention_options,
    check_bool,
    check_float_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
    check_values,
)
from ..._validate import is_int as _is_int
from ...autotune import size_bucket
from .configs import AttentionConfig

__all__ = ["BlockLists", "CHECK_BLOCK", "MAX_HEAD_DIM", "check_cu_seqlens_values", "flash_attention_cu_seqlens_kernel"]

_OP = "kernel_ladder.flash_attention"
_VARLEN_OP = "kernel_ladder.flash_attention_varlen"

#: The largest head dim (the tiles hold a whole head: 256 is Gemma's and the shared-memory limit).
MAX_HEAD_DIM: int = 256


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """What every launch shares: the shape, the switches, and how to see each tensor as (B, H, T, D)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int  # dense: Tq; varlen: max_seqlen_q (the grid's extent)
    seqlen_k: int
    head_dim: int
    causal: bool
    sm_scale: float
    window: int | None
    softcap: float | None
    varlen: bool
    total_q: int = 0  # varlen: the packed lengths (q.shape[0], k.shape[0]), which every sequence stays inside
    total_k: int = 0
    head_dim_v: int = 0  # v's (and out's) head dim Dv; 0: D
    sinks: bool = False  # a per-head sink logit joins every row's softmax denominator

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    def strides4(self, t: torch.Tensor) -> tuple[int, ...]:
        """A (B, H, T, D) tensor's strides; a packed (total, H, D) one's as (0, H, T, D)."""
        if self.varlen:
            return 0, t.stride(1), t.stride(0), t.stride(2)
        return tuple(t.stride())

    def strides3(self, t: torch.Tensor) -> tuple[int, ...]:
        """A (B, H, T) row statistic's strides; a packed (H, total) one's as (0, H, T)."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return tuple(t.stride())

    def scalars(self) -> tuple:
        """seqlen_q, seqlen_k, head_dim, head_dim_v, group_size, sm_scale, qk_scale, softcap, window, the buckets.

        Varlen: the kernels read each sequence's lengths from cu_seqlens, and get the packed lengths as
        ``seqlen_q``/``seqlen_k`` to clamp them into (values a check would reject stay inside q, k, v)."""
        # A window wider than every sequence changes nothing; capping it keeps the bounds in int32.
        window = min(self.window, self.seqlen_q + self.seqlen_k + 1) if self.window is not None else 0
        lengths = (self.total_q, self.total_k) if self.varlen else (self.seqlen_q, self.seqlen_k)
        return (*lengths, self.head_dim, self.dv, self.heads_q // self.heads_kv, float(self.sm_scale),
                float(self.sm_scale) * math.log2(math.e), float(self.softcap or 1.0), window,
                size_bucket(self.seqlen_q), size_bucket(self.seqlen_k))

    def constexprs(self, dtype: torch.dtype, *tensors: torch.Tensor) -> dict:
        return dict(CAUSAL=self.causal, HAS_WINDOW=self.window is not None, SOFTCAP=self.softcap is not None,
                    VARLEN=self.varlen, INDEX_64=_index_64(*tensors),
                    INPUT_PRECISION=_launch.dot_input_precision(dtype), BLOCK_D=_block_d(self.head_dim),
                    BLOCK_DV=_block_d(self.dv), SAME_DV=self.dv == self.head_dim, BLOCK_SPARSE=False,
                    HAS_SINKS=self.sinks)


def _dense_problem(q, k, causal, softmax_scale, window, softcap, v=None, sinks=None) -> _Problem:
    batch, heads_q, seqlen_q, head_dim = q.shape
    return _Problem(batch, heads_q, k.shape[1], seqlen_q, k.shape[2], head_dim, causal, softmax_scale, window,
                    softcap, varlen=False, head_dim_v=head_dim if v is None else v.shape[-1], sinks=sinks is not None)


def _varlen_problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                    softcap, v=None, sinks=None) -> _Problem:
    return _Problem(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k, q.shape[2],
                    causal, softmax_scale, window, softcap, varlen=True, total_q=q.shape[0], total_k=k.shape[0],
                    head_dim_v=q.shape[2] if v is None else v.shape[-1], sinks=sinks is not None)


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


@dataclass(frozen=True)
class BlockLists:
    """The block-sparse switch's per-row lists (``kernel_ladder.block_sparse_attention``): for each (batch, head,
    row block) of one side, ``counts`` (int32 ``(Bm, Hm, R)``) blocks of the other side, listed first in
    ``indices`` (int32 ``(Bm, Hm, R, C)``, each row contiguous). ``Bm``/``Hm`` of 1 broadcast (stride 0).
    ``config`` is the tile (``BLOCK_M = BLOCK_N`` = the mask's block size)."""

    counts: torch.Tensor
    indices: torch.Tensor
    config: AttentionConfig

    def args(self) -> tuple:
        def strides(t):
            return tuple(0 if size == 1 else stride for size, stride in zip(t.shape[:3], t.stride()[:3]))

        return (self.counts, self.indices, *strides(self.counts), *strides(self.indices))


def _no_block_lists(dummy: torch.Tensor) -> tuple:
    """The block-sparse arguments of a dense launch (never read)."""
    return (dummy, dummy, 0, 0, 0, 0, 0, 0)


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _index_64(*tensors: torch.Tensor) -> bool:
    """Whether some offset (a tile's masked overrun included) of these tensors can pass 2**31."""
    extents = []
    for t in tensors:
        if t.numel() == 0:
            continue
        strides = [abs(s) for s in t.stride()]
        extents.append(sum((size - 1) * s for size, s in zip(t.shape, strides)) + 256 * max(strides))
    return _launch.needs_int64(*extents)


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_options(op: str, causal: object, softmax_scale: object, window: object, softcap: object,
                   return_lse: object) -> None:
    check_bool(op, "causal", causal)
    check_bool(op, "return_lse", return_lse)
    check_attention_options(op, softmax_scale, window, softcap)
    if window is not None and not causal:
        raise ValueError(f"{op}: window={window} needs causal=True (a sliding window looks back from each "
                         "query's own position, as in Mistral); pass causal=True")


def _check_tensors(op: str, q: object, k: object, v: object, rank: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t)
        check_float_dtype(op, name, t)
    check_same_dtype(op, "q", q, "k", k)
    check_same_dtype(op, "q", q, "v", v)
    check_same_device(op, "q", q, "k", k)
    check_same_device(op, "q", q, "v", v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            what = layout.replace("H", "Hq" if name == "q" else "Hkv").replace("T", "Tq" if name == "q" else "Tk")
            raise ValueError(f"{op}: {name} must be {rank}-D {what}, got shape {tuple(t.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: q and k must share the head dim D (the last dim), got {q.shape[-1]} and "
                         f"{k.shape[-1]} (v may have its own, Dv)")
    for what, d in (("the head dim D of q and k", q.shape[-1]), ("v's head dim Dv", v.shape[-1])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{op}: {what} must be in [1, {MAX_HEAD_DIM}], got {d}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{op}: k and v must have the same shape but for the head dim (the same batch, heads and "
                         f"keys), got {tuple(k.shape)} and {tuple(v.shape)}")
    heads_q, heads_kv = q.shape[-2 if rank == 3 else 1], k.shape[-2 if rank == 3 else 1]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"{op}: the query heads ({heads_q}) must be a multiple of the key/value heads ({heads_kv}): "
                         "grouped-query attention gives each kv head Hq // Hkv query heads")


def _check_sinks(op: str, q: torch.Tensor, sinks: object) -> None:
    """``sinks``: None, or one float logit per query head, ``(Hq,)``, on q's device (any float dtype)."""
    if sinks is None:
        return
    check_tensor(op, "sinks", sinks)
    if not sinks.dtype.is_floating_point or sinks.dtype.itemsize < 2:
        raise TypeError(f"{op}: sinks must be a float tensor (float64, float32, float16 or bfloat16; read in float32), "
                        f"got {sinks.dtype}")
    heads_q = q.shape[-2] if q.dim() == 3 else q.shape[1]
    if sinks.shape != (heads_q,):
        raise ValueError(f"{op}: sinks must have shape (Hq,) = ({heads_q},): one logit per query head, got "
                         f"{tuple(sinks.shape)}")
    check_same_device(op, "q", q, "sinks", sinks)


def _check_dense(q, k, v, causal, softmax_scale, window, softcap, return_lse, sinks=None) -> None:
    _check_tensors(_OP, q, k, v, 4, "(B, H, T, D)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{_OP}: q and k must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    _check_options(_OP, causal, softmax_scale, window, softcap, return_lse)
    _check_sinks(_OP, q, sinks)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                  softcap, return_lse, sinks=None) -> None:
    op = _VARLEN_OP
    _check_tensors(op, q, k, v, 3, "(total_T, H, D)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(op, name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{op}: {name} must be int32 (flash-attn's cu_seqlens), got {cu.dtype}; "
                            "convert with .to(torch.int32)")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{op}: {name} must be 1-D (B + 1,): 0, then each sequence's end; "
                             f"got shape {tuple(cu.shape)}")
        check_same_device(op, "q", q, name, cu)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(value):
            raise TypeError(f"{op}: {name} must be an int (the longest sequence), got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    _check_options(op, causal, softmax_scale, window, softcap, return_lse)
    _check_sinks(op, q, sinks)


# ----------------------------------------------------------------------------------------------
# The cu_seqlens values, checked on their device
# ----------------------------------------------------------------------------------------------


#: cu_seqlens entries the check kernel takes per iteration (the interpreter: fewer, larger steps).
CHECK_BLOCK: int = 4096 if runtime.INTERPRETER else 1024


@triton.jit
def _count_bad(cu_ptr, i, inside, n_entries, total, max_seqlen):
    value = tl.load(cu_ptr + i, mask=inside, other=0)
    previous = tl.load(cu_ptr + i - 1, mask=inside & (i > 0), other=0)
    length = value - previous
    bad = inside & (i > 0) & ((length < 0) | (length > max_seqlen))
    bad = bad | (inside & (i == 0) & (value != 0)) | (inside & (i == n_entries - 1) & (value != total))
    return bad.to(tl.int32)


@triton.jit
def flash_attention_cu_seqlens_kernel(
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, check_ptr,  # check: int32 [both valid, q's valid, k's valid]
    n_entries, total_q, total_k, max_seqlen_q, max_seqlen_k,
    BLOCK: tl.constexpr,
):
    """One program reads both ``cu_seqlens`` once: each must start at 0, never decrease, end at the
    packed length and have no sequence longer than its ``max_seqlen``."""
    lanes = tl.arange(0, BLOCK)
    bad_q = tl.zeros([BLOCK], tl.int32)
    bad_k = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_entries, BLOCK):
        i = start + lanes
        inside = i < n_entries
        bad_q += _count_bad(cu_ptr=cu_seqlens_q_ptr, i=i, inside=inside, n_entries=n_entries, total=total_q,
                            max_seqlen=max_seqlen_q)
        bad_k += _count_bad(cu_ptr=cu_seqlens_k_ptr, i=i, inside=inside, n_entries=n_entries, total=total_k,
                            max_seqlen=max_seqlen_k)
    ok_q = tl.sum(bad_q, 0) == 0
    ok_k = tl.sum(bad_k, 0) == 0
    tl.store(check_ptr, (ok_q & ok_k).to(tl.int32))
    tl.store(check_ptr + 1, ok_q.to(tl.int32))
    tl.store(check_ptr + 2, ok_k.to(tl.int32))


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                            max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Each ``cu_seqlens`` starts at 0, never decreases, ends at its packed length (``total``) and has no
    sequence longer than its ``max_seqlen``.

    One one-program Triton launch (:func:`flash_attention_cu_seqlens_kernel`) writes a flag on the
    tensors' device, read by the value-check policy (:func:`kernel_ladder._validate.check_values`): on the
    CPU a failure raises at once, as a ``ValueError`` naming the op, the argument and its values; on
    CUDA it is a device-side assertion (like torch's own index checks), surfacing as ``CUDA error:
    device-side assert triggered`` at the next synchronizing call, unless
    ``kernel_ladder.runtime.check_values(True)`` asked for the host check. Skipped entirely (no launch)
    where no check runs.
    """
    check = _launch.empty((3,), torch.int32, cu_seqlens_q.device)

    def ok() -> torch.Tensor:
        flash_attention_cu_seqlens_kernel[(1,)](cu_seqlens_q, cu_seqlens_k, check, cu_seqlens_q.shape[0], total_q,
                                                total_k, max_seqlen_q, max_seqlen_k, BLOCK=CHECK_BLOCK)
        return check[0]

    def message(name, total, max_seqlen):
        return (f"{_VARLEN_OP}: {name} must start at 0, never decrease, end at {total} (the packed length) and "
                f"have every sequence length <= max_seqlen = {max_seqlen}")

    def error() -> str:
        ok_q = bool(check[1])  # only on the way to the error
        name, cu, total, max_seqlen = (("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k) if ok_q else
                                       ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q))
        values = cu.tolist()
        shown = values if len(values) <= 12 else values[:6] + ["..."] + values[-6:]
        return f"{message(name, total, max_seqlen)}; got {shown}"

    check_values((cu_seqlens_q, cu_seqlens_k), ok,
                 message("cu_seqlens_q and cu_seqlens_k", "total_q / total_k", "max_seqlen_q / max_seqlen_k"), error)
