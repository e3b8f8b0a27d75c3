"""Rotary position embeddings, forward and backward, as ``kernel_ladder::rope``; and their cos/sin tables.

RoPE (Su et al., 2021, arXiv:2104.09864) rotates each pair of a query's (and key's) features by an
angle proportional to the token's position: for a pair ``(x1, x2)`` with coefficients
``(c1, s1)`` and ``(c2, s2)`` from the cos/sin tables::

    y1 = x1 * c1 - x2 * s1            y2 = x2 * c2 + x1 * s2

— exactly Hugging Face's ``apply_rotary_pos_emb``, ``q * cos + rotate_half(q) * sin``, where the
pairs are feature ``j`` and ``j + R/2`` (the *rotate-half* convention of Llama, Mistral, Qwen,
GPT-NeoX; ``R`` is the rotary width). ``interleaved=True`` pairs features ``2j`` and ``2j + 1``
instead (GPT-J's ``rotate_every_two`` and the original LLaMA code). When the tables are narrower
than the head (``R < D``: GPT-NeoX's and Phi's partial rotary), the features past ``R`` pass
through unchanged.

**One launch for q and k.** HF's torch code runs ``q * cos``, ``rotate_half(q)`` (two slices, a
negation and a ``cat``), ``* sin`` and ``+`` for q, then again for k: about ten kernels, each
writing a full-size intermediate. Here one program takes a run of tokens; for each token it
loads the token's cos/sin row once and rotates every head of q and of k with it, reading each
element of q, k, cos and sin once and writing each output once (the ideal traffic, counted by the
tests; a ``(T, R)`` table shared by the batch is read once, not once per sequence). A program
never materializes ``rotate_half``: it loads the two halves of the pair as two
tiles and combines them in registers.

**Layouts.** ``q`` and ``k`` are read through their strides: in a model they are usually views of
one fused qkv projection, ``(B, T, H, D)`` transposed to ``(B, H, T, D)``, and are never copied.
``unsqueeze_dim`` says which layout they have, as in HF: 1 for ``(B, H, T, D)``, 2 for
``(B, T, H, D)``. Outputs are new contiguous tensors of the inputs' shapes.

**Backward.** The rotation is linear in ``x``, so the gradient is its transpose::

    dx1 = g1 * c1 + g2 * s2           dx2 = g2 * c2 - g1 * s1

(for HF's tables, where ``c1 = c2`` and ``s1 = s2``, the inverse rotation), computed by the same
kernel with ``BACKWARD``. cos and sin get no gradient (they are functions of positions).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._launch import next_power_of_2
from .._validate import FLOAT_DTYPES, check_float_dtype, check_same_device, check_same_dtype, check_tensor, schema_types

__all__ = ["ROPE_SCALINGS", "rope", "rope_cos_sin", "rope_kernel"]

#: The ``scaling["rope_type"]`` values :func:`rope_cos_sin` implements (Hugging Face's names).
ROPE_SCALINGS: tuple[str, ...] = ("default", "linear", "llama3")

_OP = "kernel_ladder.rope"
#: The cos/sin tables' dtypes: the kernel reads them in float32 (float64 tables are rounded to it once).
TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, x_base, y_base, stride_xh, stride_xd, stride_yh, stride_yd, n_heads,
    c1, c2, s1, s2, lo, hi, pair_mask, rest, rest_mask,
    BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, HAS_REST: tl.constexpr,
):
    """Rotate every head of one token of one tensor (heads in tiles of BLOCK_H)."""
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = heads < n_heads
        mask = head_mask[:, None] & pair_mask[None, :]
        x_heads = x_base + heads.to(tl.int64)[:, None] * stride_xh
        y_heads = y_base + heads.to(tl.int64)[:, None] * stride_yh
        x1 = tl.load(x_ptr + x_heads + lo[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_heads + hi[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # the transposed rotation
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:
            y1 = x1 * c1[None, :] - x2 * s1[None, :]
            y2 = x2 * c2[None, :] + x1 * s2[None, :]
        tl.store(y_ptr + y_heads + lo[None, :] * stride_yd, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_heads + hi[None, :] * stride_yd, y2.to(y_ptr.dtype.element_ty), mask=mask)
        if HAS_REST:  # features past the rotary width pass through
            mask = head_mask[:, None] & rest_mask[None, :]
            x = tl.load(x_ptr + x_heads + rest[None, :] * stride_xd, mask=mask, other=0.0)
            tl.store(y_ptr + y_heads + rest[None, :] * stride_yd, x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    n_units, batch, seq_len, units_per_program,       # a unit: a token (b, t), or a position t (SHARED_TABLE)
    n_heads_q, n_heads_k, head_dim, half,             # half = rotary width / 2
    stride_qb, stride_qh, stride_qt, stride_qd,       # q as (B, H, T, D), whatever its memory layout
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qob, stride_qoh, stride_qot, stride_qod,   # the outputs, same logical shape as q / k
    stride_kob, stride_koh, stride_kot, stride_kod,
    stride_cb, stride_ct, stride_cd,                  # cos and sin as (B, T, R); stride_cb 0 for (T, R)
    stride_sb, stride_st, stride_sd,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_REST: tl.constexpr, SHARED_TABLE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    """Rotate q and k for this program's units: each cos/sin row is read once for all the heads (and,
    with ``SHARED_TABLE`` — one table for the whole batch — once for every sequence of the batch).

    Pair ``j`` is features ``(j, j + half)`` (rotate-half) or ``(2j, 2j + 1)`` (``INTERLEAVED``);
    features ``>= 2 * half`` pass through (``HAS_REST``).
    """
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_HALF)
    pair_mask = j < half
    if INTERLEAVED:
        lo = 2 * j
        hi = 2 * j + 1
    else:
        lo = j
        hi = j + half
    rest = 2 * half + tl.arange(0, BLOCK_REST)
    rest_mask = rest < head_dim
    first = pid.to(tl.int64) * units_per_program
    for i in range(0, units_per_program):
        unit = first + i
        if unit < n_units:
            if SHARED_TABLE:  # a position: its table row once, then every sequence of the batch
                t = unit
                b_first = 0
                b_count = batch
            else:  # a token (b, t): its own table row
                t = unit % seq_len
                b_first = unit // seq_len
                b_count = 1
            c_base = b_first * stride_cb + t * stride_ct
            s_base = b_first * stride_sb + t * stride_st
            c1 = tl.load(cos_ptr + c_base + lo * stride_cd, mask=pair_mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + c_base + hi * stride_cd, mask=pair_mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + s_base + lo * stride_sd, mask=pair_mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + s_base + hi * stride_sd, mask=pair_mask, other=0.0).to(tl.float32)
            for b in range(b_first, b_first + b_count):
                _rotate_heads(q_ptr, q_out_ptr, b * stride_qb + t * stride_qt, b * stride_qob + t * stride_qot,
                              stride_qh, stride_qd, stride_qoh, stride_qod, n_heads_q,
                              c1, c2, s1, s2, lo, hi, pair_mask, rest, rest_mask, BLOCK_HQ, BACKWARD, HAS_REST)
                _rotate_heads(k_ptr, k_out_ptr, b * stride_kb + t * stride_kt, b * stride_kob + t * stride_kot,
                              stride_kh, stride_kd, stride_koh, stride_kod, n_heads_k,
                              c1, c2, s1, s2, lo, hi, pair_mask, rest, rest_mask, BLOCK_HK, BACKWARD, HAS_REST)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

#: Elements a head tile aims at (the heads of one token are taken this many features at a time).
TILE_ELEMENTS: int = 4096


def _as_bhtd(t: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """A (B, H, T, D) view of q or k (a transpose for the (B, T, H, D) layout)."""
    return t if unsqueeze_dim == 1 else t.transpose(1, 2)


def _tables(cos: torch.Tensor, batch: int) -> torch.Tensor:
    """cos/sin as a (B, T, R) view: a (T, R) table broadcast over the batch (stride 0)."""
    return cos.unsqueeze(0).expand(batch, *cos.shape) if cos.dim() == 2 else cos.expand(batch, *cos.shape[1:])


def _launch_rope(q, k, q_out, k_out, cos, sin, unsqueeze_dim: int, interleaved: bool, backward: bool) -> None:
    qv, kv = _as_bhtd(q, unsqueeze_dim), _as_bhtd(k, unsqueeze_dim)
    qo, ko = _as_bhtd(q_out, unsqueeze_dim), _as_bhtd(k_out, unsqueeze_dim)
    batch, n_heads_q, seq_len, head_dim = qv.shape
    n_heads_k = kv.shape[1]
    if batch * seq_len == 0 or head_dim == 0:
        return
    c, s = _tables(cos, batch), _tables(sin, batch)
    # One table for the batch (a (T, R) or (1, T, R) table): a program takes positions, every
    # sequence of each, so the table is read once in all; else tokens, each with its own row.
    shared = c.stride(0) == 0 and s.stride(0) == 0 and batch > 1
    n_units = seq_len if shared else batch * seq_len
    half = c.shape[-1] // 2
    block_half = next_power_of_2(half)
    rest = head_dim - 2 * half
    block_rest = next_power_of_2(rest)
    block_hq = max(1, min(next_power_of_2(n_heads_q), TILE_ELEMENTS // block_half))
    block_hk = max(1, min(next_power_of_2(n_heads_k), TILE_ELEMENTS // block_half))
    # Enough programs to fill the GPU twice over; the interpreter's 4 "SMs" keep the CPU's count small.
    programs = min(n_units, 2 * _launch.num_sms(q.device) * (8 if not runtime.INTERPRETER else 1))
    units_per_program = triton.cdiv(n_units, programs)
    grid = (triton.cdiv(n_units, units_per_program),)
    rope_kernel[grid](
        qv, kv, qo, ko, c, s,
        n_units, batch, seq_len, units_per_program,
        n_heads_q, n_heads_k, head_dim, half,
        *qv.stride(), *kv.stride(), *qo.stride(), *ko.stride(), *c.stride(), *s.stride(),
        INTERLEAVED=interleaved, BACKWARD=backward, HAS_REST=rest > 0, SHARED_TABLE=shared,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        num_warps=_launch.num_warps_for(block_hq * block_half * 2),
    )


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_args(q: object, k: object, cos: object, sin: object, unsqueeze_dim: object, interleaved: object) -> None:
    check_tensor(_OP, "q", q)
    check_tensor(_OP, "k", k)
    check_tensor(_OP, "cos", cos)
    check_tensor(_OP, "sin", sin)
    for name, t in (("q", q), ("k", k)):
        check_float_dtype(_OP, name, t)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in TABLE_DTYPES:
            raise TypeError(f"{_OP}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    check_same_dtype(_OP, "q", q, "k", k)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        check_same_device(_OP, "q", q, name, t)
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"{_OP}: unsqueeze_dim must be 1 (q and k laid out (B, H, T, D)) or 2 ((B, T, H, D)), "
            f"as in Hugging Face's apply_rotary_pos_emb; got {unsqueeze_dim!r}"
        )
    if not isinstance(interleaved, bool):
        raise TypeError(f"{_OP}: interleaved must be a bool, got {type(interleaved).__name__}")
    layout = "(B, H, T, D)" if unsqueeze_dim == 1 else "(B, T, H, D)"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be 4-D {layout} (unsqueeze_dim={unsqueeze_dim}), "
                             f"got shape {tuple(t.shape)}")
    h_dim, t_dim = (1, 2) if unsqueeze_dim == 1 else (2, 1)
    if (q.shape[0], q.shape[t_dim], q.shape[3]) != (k.shape[0], k.shape[t_dim], k.shape[3]):
        raise ValueError(
            f"{_OP}: q and k must share B, T and D in the {layout} layout; got q {tuple(q.shape)} and "
            f"k {tuple(k.shape)} (only the number of heads may differ: grouped-query attention)"
        )
    if cos.shape != sin.shape:
        raise ValueError(f"{_OP}: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    batch, seq_len, head_dim = q.shape[0], q.shape[t_dim], q.shape[3]
    if cos.dim() not in (2, 3) or cos.shape[-2] != seq_len or (cos.dim() == 3 and cos.shape[0] not in (1, batch)):
        raise ValueError(
            f"{_OP}: cos and sin must be (B, T, R) — Hugging Face's rotary embedding output — or (T, R), with "
            f"B = {batch} (or 1) and T = {seq_len} as in q {tuple(q.shape)}; got {tuple(cos.shape)}"
        )
    rotary = cos.shape[-1]
    if rotary > head_dim:
        raise ValueError(
            f"{_OP}: the tables' width R = {rotary} exceeds the head dim D = {head_dim}; R must be at most D "
            "(R < D rotates the first R features only, as GPT-NeoX's partial rotary does)"
        )
    if rotary % 2:
        convention = "interleaved pairs (2j, 2j+1)" if interleaved else "rotate-half pairs (j, j + R/2)"
        raise ValueError(f"{_OP}: the rotary width R = cos.shape[-1] must be even ({convention}), got {rotary}")


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _empty_like_input(t: torch.Tensor) -> torch.Tensor:
    return _launch.empty_output(t.shape, t)


@torch.library.custom_op("kernel_ladder::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
             interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
    runtime.require_launchable(_OP, q, k, cos, sin)
    q_out, k_out = _empty_like_input(q), _empty_like_input(k)
    _launch_rope(q, k, q_out, k_out, cos, sin, unsqueeze_dim, interleaved, backward=False)
    return q_out, k_out


@_rope_op.register_fake
def _rope_fake(q, k, cos, sin, unsqueeze_dim, interleaved):
    _check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
    return _empty_like_input(q), _empty_like_input(k)


@torch.library.custom_op("kernel_ladder::rope_backward", mutates_args=())
def _rope_backward_op(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    op = f"{_OP} (backward)"
    runtime.require_launchable(op, grad_q, grad_k, cos, sin)
    dq, dk = _empty_like_input(grad_q), _empty_like_input(grad_k)
    _launch_rope(grad_q, grad_k, dq, dk, cos, sin, unsqueeze_dim, interleaved, backward=True)
    return dq, dk


@_rope_backward_op.register_fake
def _rope_backward_fake(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved):
    return _empty_like_input(grad_q), _empty_like_input(grad_k)


def _setup_context(ctx, inputs, output) -> None:
    q, k, cos, sin, unsqueeze_dim, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
    ctx.q_dtype, ctx.q_shape, ctx.k_shape = q.dtype, q.shape, k.shape
    ctx.set_materialize_grads(False)  # no zeros for an output that takes no part in the loss


def _backward(ctx, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None):
    cos, sin = ctx.saved_tensors
    # An output that took no part in the loss has no gradient (None): rotate a stride-0 zero instead.
    if grad_q is None and grad_k is None:
        return None, None, None, None, None, None
    like = grad_q if grad_q is not None else grad_k
    if grad_q is None:
        grad_q = torch.zeros((), dtype=like.dtype, device=like.device).expand(ctx.q_shape)
    if grad_k is None:
        grad_k = torch.zeros((), dtype=like.dtype, device=like.device).expand(ctx.k_shape)
    dq, dk = _rope_backward_op(grad_q.to(ctx.q_dtype), grad_k.to(ctx.q_dtype), cos, sin, ctx.unsqueeze_dim,
                               ctx.interleaved)
    return dq, dk, None, None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embeddings for ``q`` and ``k`` in one launch, like Hugging Face's ``apply_rotary_pos_emb``.

    Args:
        q: float32, float16 or bfloat16 queries, ``(B, Hq, T, D)`` (``unsqueeze_dim=1``) or
            ``(B, T, Hq, D)`` (``unsqueeze_dim=2``); any strides (a transposed view of a fused qkv
            projection is read in place).
        k: keys of the same dtype and layout, ``Hkv`` heads (``Hq != Hkv`` allowed: GQA, MQA).
        cos, sin: the tables, ``(B, T, R)`` as HF's rotary embedding returns them (``B`` may be 1),
            or ``(T, R)`` for every sequence of the batch; float32, float16, bfloat16 or float64
            (read in float32: float64 tables give the results of tables rounded to float32).
            ``R`` (even) is the rotary width: ``R < D`` rotates the first ``R`` features only and
            passes the rest through (GPT-NeoX / Phi partial rotary). :func:`rope_cos_sin` makes them.
        unsqueeze_dim: 1 or 2, the layout of q and k, as in HF.
        interleaved: pair features ``(2j, 2j+1)`` (GPT-J, original LLaMA) instead of ``(j, j + R/2)``.

    Returns:
        ``(q_embed, k_embed)``: new contiguous tensors of q's and k's shapes and dtype, computed in
        float32 and rounded once. Differentiable in q and k (``kernel_ladder::rope_backward``, the
        transposed rotation); cos and sin get no gradient.
    """
    if not schema_types(tensors=(q, k, cos, sin), ints=(unsqueeze_dim,), flags=(interleaved,)):
        _check_args(q, k, cos, sin, unsqueeze_dim, interleaved)  # the op checks values
    return _rope_op(q, k, cos, sin, unsqueeze_dim, interleaved)


# ----------------------------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------------------------


def _inverse_frequencies(head_dim: int, base: float, scaling: Mapping | None, device) -> torch.Tensor:
    """HF's inverse frequencies ``1 / base**(2i / dim)``, with its ``linear`` or ``llama3`` scaling."""
    # HF builds the arange on the CPU and copies it over; built on the device, it is the same integers
    # without a host-to-device copy, which CUDA-graph capture refuses.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp in between.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def _check_scaling(op: str, scaling: object) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise TypeError(f"{op}: scaling must be None or a dict like a Hugging Face config's rope_scaling, "
                        f"got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(f"{op}: scaling['rope_type'] must be one of {ROPE_SCALINGS}, got {rope_type!r}")
    needed = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [key for key in needed.get(rope_type, ()) if key not in scaling]
    if missing:
        raise ValueError(f"{op}: scaling of rope_type {rope_type!r} needs {missing}, got keys {sorted(scaling)}")


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0, scaling: Mapping | None = None,
    dtype: torch.dtype = torch.float32, interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables of rotary embeddings, as Hugging Face's ``LlamaRotaryEmbedding`` computes them.

    ``inv_freq = 1 / base**(2i / head_dim)`` (optionally scaled), ``freqs = positions * inv_freq``
    in float32, ``emb = cat(freqs, freqs)``, then ``cos(emb)`` and ``sin(emb)`` cast to ``dtype`` —
    the same torch operations in the same order, so a patched model gets the same numbers.

    Args:
        positions: integer positions, ``(T,)`` or ``(B, T)`` (HF's ``position_ids``).
        head_dim: the rotary width R (even): the head dim, or ``head_dim * partial_rotary_factor``.
        base: ``rope_theta`` (10000 for Llama 2, 500000 for Llama 3).
        scaling: None, or a config's ``rope_scaling`` / ``rope_parameters`` dict with ``rope_type``
            ``"linear"`` (``factor``) or ``"llama3"`` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``).
        dtype: of the tables (HF casts them to the activations' dtype).
        interleaved: tables for :func:`rope`'s ``interleaved=True`` pairs: each frequency repeated
            for features ``2j`` and ``2j + 1`` (GPT-J's ``repeat_interleave``) instead of ``cat``.

    Returns:
        ``(cos, sin)`` of shape ``positions.shape + (head_dim,)`` — what :func:`rope` takes.
    """
    op = "kernel_ladder.rope_cos_sin"
    check_tensor(op, "positions", positions)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{op}: positions must be an integer tensor (token positions), got {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"{op}: positions must be (T,) or (B, T), got shape {tuple(positions.shape)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{op}: head_dim must be a positive even int (the rotary width), got {head_dim!r}")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 0:
        raise ValueError(f"{op}: base must be a positive number (rope_theta), got {base!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    _check_scaling(op, scaling)
    inv_freq = _inverse_frequencies(int(head_dim), float(base), scaling, positions.device)
    freqs = positions[..., None].float() * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
