"""Writing a step's keys and values into a paged KV cache, as ``kernel_ladder::write_kv_cache``.

A paged cache stores keys (and, separately, values) in fixed-size *blocks* of ``block_size``
token slots: ``k_cache`` has shape ``(num_blocks, block_size, Hkv, D)``. A sequence owns a list of
blocks (its *block table*, kept by :mod:`kernel_ladder.serving.paged_cache`), and its token at
position ``p`` lives in slot ``p % block_size`` of block ``block_table[p // block_size]``. The scheduler flattens that
into one number per token, its **slot**::

    slot = block * block_size + offset        (block = slot // block_size, offset = slot % block_size)

so a model step writes its ``T`` new tokens with one launch, whatever sequences they belong to:
token ``t``'s ``k[t]`` and ``v[t]`` (``Hkv x D`` each) go to ``k_cache[slot // bs, slot % bs]`` and
``v_cache[slot // bs, slot % bs]``. Tokens of a batch that is padded to a fixed size carry
**slot -1** (any negative slot): they are skipped, nothing is written (vLLM's convention).

**Slots past the cache.** A slot ``>= num_blocks * block_size`` would write past the cache.
Checking that on the host would need the slot mapping's values, i.e. a device-to-host copy and a
synchronization on every model step, which an engine cannot afford. So it is a value check under
the policy of :mod:`kernel_ladder.runtime`: a ``ValueError`` for CPU tensors, or on CUDA when
``kernel_ladder.runtime.check_values(True)`` asks for it (one synchronization); nothing on CUDA otherwise.
Whatever the checks, the kernel masks such a slot on the device: **an out-of-range slot is never
written** (like a negative one), so no check setting lets it write past the cache.

**Dtypes.** The caches are float32, float16, bfloat16 or ``torch.float8_e4m3fn``; ``k``/``v`` are
float32, float16 or bfloat16 and are cast to the cache's dtype (round to nearest even, as torch's
``.to()``). An fp8 cache stores ``k / k_scale`` (``v / v_scale``) with per-tensor float32 scales
(0-d or one-element tensors, read on the device: no sync), computed in float32, saturated to
+-448 (NaN stays NaN) and rounded to e4m3 as :mod:`kernel_ladder.ops.quantize`'s fp8 path does; no
scale means 1. A scale must be positive and finite: a value check (the policy of
:mod:`kernel_ladder.runtime`: a ``ValueError`` for CPU tensors or when checks are on, nothing on CUDA by
default). Unchecked, the kernel divides by it all the same: a zero scale stores +-448 (k's sign; NaN
for k = 0), a negative one ``-k / |scale|``, NaN stores NaN, an infinite one stores 0.

**Strides.** Every operand is read and written through its own strides: ``k``/``v`` may be slices
of a fused QKV projection's output and the caches one layer of a ``(layers, num_blocks, ...)``
tensor, or the two halves ``kv[:, 0]``, ``kv[:, 1]`` of one ``(num_blocks, 2, block_size, Hkv, D)``
tensor (FlashInfer's layout). The caches must share no element (``_validate.share_elements``: exact
from the strides, not the byte ranges the views span). Offsets are int32 while every reachable offset
fits, else int64 (``INDEX_64``).

**The launch.** A program writes ``BLOCK_T`` tokens x all ``Hkv * D`` elements of each (the head
and head-dim indices flattened into one ``BLOCK_HD`` range). In the interpreter few big programs
(each costs about a millisecond); on a GPU about 4096 elements per program.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._validate import (
    FLOAT_DTYPES,
    check_paged_caches,
    check_same_device,
    check_tensor,
    check_values,
    schema_types,
    share_elements,
)

__all__ = ["CACHE_DTYPES", "write_kv_cache", "write_kv_cache_kernel"]

_OP = "kernel_ladder.write_kv_cache"

#: The cache dtypes write_kv_cache supports.
CACHE_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, torch.float8_e4m3fn)

#: Elements (tokens x Hkv x D) per program in the interpreter and on a GPU.
_INTERPRETER_BLOCK_ELEMENTS = 16384
_GPU_BLOCK_ELEMENTS = 4096


@triton.jit
def token_slots(slot_ptr, stride_slot, n_tokens, num_slots, block_size, BLOCK_T: tl.constexpr,
                INDEX_64: tl.constexpr):
    """This program's ``BLOCK_T`` tokens, which of them are written, and the ``(block, offset)`` of their slots
    (``slot // block_size``, ``slot % block_size``): the prologue of every cache write."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    slots = tl.load(slot_ptr + tokens * stride_slot, mask=token_mask, other=-1)
    # Negative slots are padding; slots past the cache cannot be checked on the host without a sync,
    # so they are masked here too: neither is ever written. (Compared before any narrowing cast, so
    # an int64 slot past 2**31 cannot wrap into the cache.)
    write = token_mask & (slots >= 0) & (slots < num_slots)
    if INDEX_64:
        slots = slots.to(tl.int64)
        tokens = tokens.to(tl.int64)
    else:
        slots = tl.where(write, slots, 0).to(tl.int32)
    return tokens, write, slots // block_size, slots % block_size


@triton.jit
def write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,  # inputs, caches, slots, scales
    n_tokens, num_slots, block_size, head_dim, hd,                                # sizes (hd = Hkv * D)
    stride_kt, stride_kh, stride_kd,                                              # k (T, Hkv, D)
    stride_vt, stride_vh, stride_vd,                                              # v (T, Hkv, D)
    stride_kcb, stride_kco, stride_kch, stride_kcd,                               # k_cache (blocks, offset, Hkv, D)
    stride_vcb, stride_vco, stride_vch, stride_vcd,                               # v_cache
    stride_slot,
    FP8: tl.constexpr, HAS_SCALE: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    """``cache[slot // bs, slot % bs] = k[t]`` (and v) for ``BLOCK_T`` tokens; slots < 0 or past the cache skipped."""
    tokens, write, block, offset = token_slots(slot_ptr, stride_slot, n_tokens, num_slots, block_size, BLOCK_T,
                                               INDEX_64)
    hd_index = tl.arange(0, BLOCK_HD)
    head = hd_index // head_dim
    dim = hd_index % head_dim
    mask = write[:, None] & (hd_index < hd)[None, :]

    k_src = tokens[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd
    v_src = tokens[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd
    k_dst = (block * stride_kcb + offset * stride_kco)[:, None] + head[None, :] * stride_kch + dim[None, :] * stride_kcd
    v_dst = (block * stride_vcb + offset * stride_vco)[:, None] + head[None, :] * stride_vch + dim[None, :] * stride_vcd
    k = tl.load(k_ptr + k_src, mask=mask)
    v = tl.load(v_ptr + v_src, mask=mask)
    if FP8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if HAS_SCALE:
            k = tl.math.div_rn(k, tl.load(k_scale_ptr).to(tl.float32))
            v = tl.math.div_rn(v, tl.load(v_scale_ptr).to(tl.float32))
        # Saturate to e4m3's largest finite value (torch's clamp-then-cast); NaN stays NaN (not fmax's -448).
        k = tl.minimum(tl.maximum(k, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
        v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
    tl.store(k_cache_ptr + k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launcher


def max_offset(t: torch.Tensor) -> int:
    """The largest element offset a tensor's view reaches (its last element), from its storage start."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)


def tokens_per_program(n_tokens: int, row_elements: int) -> int:
    """``BLOCK_T`` of a cache write whose tokens are ``row_elements`` wide (padded to a power of two): about
    16384 elements per program in the interpreter (each program costs about a millisecond), 4096 on a GPU."""
    elements = _INTERPRETER_BLOCK_ELEMENTS if runtime.INTERPRETER else _GPU_BLOCK_ELEMENTS
    return max(1, min(elements // triton.next_power_of_2(row_elements), triton.next_power_of_2(n_tokens)))


def _launch_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    n_tokens, heads, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[:2]
    if n_tokens == 0 or num_blocks == 0 or heads * head_dim == 0:
        return
    hd = heads * head_dim
    block_hd = triton.next_power_of_2(hd)
    block_t = tokens_per_program(n_tokens, hd)
    # The largest offsets written (a valid slot's) and read (the last block's padding tokens included).
    index_64 = _launch.needs_int64(
        max_offset(k_cache), max_offset(v_cache), num_blocks * block_size,
        max_offset(k) + block_t * abs(k.stride(0)), max_offset(v) + block_t * abs(v.stride(0)),
    )
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    has_scale = k_scale is not None
    write_kv_cache_kernel[(triton.cdiv(n_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if has_scale else slot_mapping, v_scale if has_scale else slot_mapping,  # unused when no scale
        n_tokens, num_blocks * block_size, block_size, head_dim, hd,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), slot_mapping.stride(0),
        FP8=fp8, HAS_SCALE=has_scale, INDEX_64=index_64, BLOCK_T=block_t, BLOCK_HD=block_hd, num_warps=4,
    )


# --------------------------------------------------------------------------- validation


def _check_scale(name: str, scale: object) -> None:
    check_tensor(_OP, name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(f"{_OP}: {name} must be a float32 tensor (a per-tensor scale), got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{_OP}: {name} must hold one value (a 0-d or one-element per-tensor scale), "
                         f"got shape {tuple(scale.shape)}")


def _check_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        check_tensor(_OP, name, t)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{_OP}: {name} must be 3-D (T, Hkv, D): one row of Hkv heads per token, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{_OP}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{_OP}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in CACHE_DTYPES:
            raise TypeError(f"{_OP}: {name} must be float32, float16, bfloat16 or float8_e4m3fn, got {t.dtype}")
    check_paged_caches(_OP, k_cache, v_cache)
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"{_OP}: the caches' (Hkv, D) = {tuple(k_cache.shape[2:])} must match k's and v's "
                         f"(T, Hkv, D) = {tuple(k.shape)}")
    check_slot_mapping(_OP, slot_mapping, "k", k.shape[0])
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{_OP}: give both k_scale and v_scale or neither")
    if k_scale is not None:
        if not fp8:
            raise ValueError(f"{_OP}: k_scale and v_scale apply to a float8_e4m3fn cache only, "
                             f"got a {k_cache.dtype} cache; leave them out")
        _check_scale("k_scale", k_scale)
        _check_scale("v_scale", v_scale)
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping),
                    ("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None:
            check_same_device(_OP, "k", k, name, t)


def _check_no_overlap(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache and v_cache must share no element (real tensors only: fake ones have no storage). Views of
    one tensor that interleave without sharing, as ``kv[:, 0]`` and ``kv[:, 1]``, are fine."""
    if share_elements(k_cache, v_cache):
        raise ValueError(f"{_OP}: k_cache and v_cache must not overlap in memory (they share elements: a write "
                         f"to one would land in the other); got strides {k_cache.stride()} at offset "
                         f"{k_cache.storage_offset()} and {v_cache.stride()} at offset {v_cache.storage_offset()}")


def _check_scale_values(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Both fp8 scales positive and finite, by the value-check policy (unchecked on CUDA by default)."""
    if k_scale is None:
        return
    message = (f"{_OP}: k_scale and v_scale must be positive finite numbers (the cache stores k / k_scale, "
               "v / v_scale)")

    def valid(scale: torch.Tensor) -> torch.Tensor:
        return (torch.isfinite(scale) & (scale > 0)).all()

    def error() -> str:
        name, scale = ("k_scale", k_scale) if not bool(valid(k_scale)) else ("v_scale", v_scale)
        return (f"{_OP}: {name} must be a positive finite number (the cache stores k / k_scale, v / v_scale); "
                f"got {name} = {float(scale.reshape(()))}")

    def host_ok() -> bool:
        values = [float(s.reshape(())) for s in (k_scale, v_scale)]
        return all(math.isfinite(x) and x > 0 for x in values)

    # No device assertion (a decode step's write would pay its launches): unchecked, the kernel divides by
    # the scale as the module docstring says.
    check_values((k_scale, v_scale), lambda: valid(k_scale) & valid(v_scale), message, error, host_ok=host_ok,
                 device_assert=False)


def check_slot_mapping(op: str, slot_mapping: torch.Tensor, tokens_of: str, n_tokens: int) -> None:
    """``slot_mapping``: int32 or int64 ``(T,)``, one slot per token of the tensor ``tokens_of`` (``T = n_tokens``)."""
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: slot_mapping must be int32 or int64 (one flat slot per token), "
                        f"got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != n_tokens:
        raise ValueError(f"{op}: slot_mapping must be 1-D (T,) with T = {n_tokens} ({tokens_of}'s tokens), "
                         f"got shape {tuple(slot_mapping.shape)}")


def check_slot_values(op: str, slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot below ``num_slots`` (negative ones are padding), by the value-check policy."""
    if slot_mapping.numel() == 0:
        return
    message = (f"{op}: slot_mapping must hold slots below num_blocks * block_size = {num_slots} "
               "(or a negative slot for padding)")

    def error() -> str:
        bad = (slot_mapping >= num_slots).nonzero()[0, 0].item()  # only on the way to the error
        return f"{message}; got slot_mapping[{bad}] = {slot_mapping[bad].item()}"

    # Host-only on purpose: the kernel masks such slots anyway, and a decode step should not pay for
    # a device assertion (kernel_ladder.runtime.check_values(True) checks CUDA tensors on the host).
    check_values((slot_mapping,), lambda: (slot_mapping < num_slots).all(), message, error,
                 host_ok=lambda: bool((slot_mapping.numpy() < num_slots).all()), device_assert=False)


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("kernel_ladder::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_cache_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None) -> None:
    _check_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _check_no_overlap(k_cache, v_cache)
    runtime.require_launchable(_OP, k, v, k_cache, v_cache, slot_mapping)
    check_slot_values(_OP, slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    _check_scale_values(k_scale, v_scale)
    _launch_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_write_kv_cache_op.register_fake
def _write_kv_cache_fake(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    _check_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's keys and values into its slot of a paged cache, in place.

    Args:
        k, v: ``(T, Hkv, D)`` float32, float16 or bfloat16, any strides (e.g. slices of a fused
            QKV projection); cast to the cache's dtype.
        k_cache, v_cache: ``(num_blocks, block_size, Hkv, D)``, float32, float16, bfloat16 or
            ``torch.float8_e4m3fn``, any strides (e.g. ``cache[layer]`` of a ``(layers, ...)``
            tensor); written in place, nothing else of them is touched.
        slot_mapping: ``(T,)`` int32 or int64: token ``t`` goes to slot ``slot_mapping[t]``, i.e.
            block ``slot // block_size``, offset ``slot % block_size``. A negative slot is padding
            and is skipped; a slot ``>= num_blocks * block_size`` is an error (a value check: see
            :mod:`kernel_ladder.runtime`), and is masked on the device, never written, when unchecked.
        k_scale, v_scale: for a float8_e4m3fn cache only: float32 per-tensor scales (0-d or one
            element), positive and finite (a value check); the cache stores ``k / k_scale`` saturated
            to +-448. None means 1.

    Not differentiable (a cache write is not part of a training graph).
    """
    if not schema_types(tensors=(k, v, k_cache, v_cache, slot_mapping), optional_tensors=(k_scale, v_scale)):
        _check_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)  # the op checks values
    _write_kv_cache_op(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
