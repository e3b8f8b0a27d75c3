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

**QK-norm in the same launch.** Qwen3, OLMo 2 and Gemma 3 RMS-normalize every head vector of q and
k over its ``D`` features before the rotation (``q_norm``/``k_norm``: ``x * rsqrt(mean(x**2) + eps)
* (offset + w)``, offset 1 for Gemma's ``1 + w``). A program already holds whole head vectors, so
with ``q_norm_weight``/``k_norm_weight`` it sums each head's squares in float32, scales, weights,
rotates and stores once: the normalized q and k are never written, where separate ``rms_norm``
launches write them and the rotation reads them back. The backward applies the transposed rotation
to the incoming gradient, giving ``gn``, then the norm's Jacobian with ``xhat = x * rstd`` (rstd
recomputed from the saved input, one head in registers)::

    dx = rstd * (gn * w' - xhat * mean(gn * w' * xhat))        dw = sum over heads and tokens of gn * xhat

(``w' = offset + w``). ``dw`` is summed in two stages, as :mod:`kernel_ladder.ops.rms_norm` does:
each program adds its tokens' heads into float32 registers and writes one row of a
``(programs, D)`` buffer, and :func:`~kernel_ladder.ops.norm.column_sum_kernel` adds the rows in a
fixed order (no atomics: the same bits on every run).

Counted by the tracer (``utils.trace``, Triton's interpreter, 8 programs) for a Qwen3-like layer,
bf16, B = 1, T = 64, Hq = 16, Hkv = 8, D = 128, q and k views of a fused projection: the fused
forward moves 823,296 bytes in one launch (q, k and the tables read once, the outputs written once:
819,200, plus the two weights once a program); ``rms_norm(q)``, ``rms_norm(k)`` and ``rope`` move
1,624,064 bytes in three launches (1.97x: the normalized q and k written and read back, rms_norm's
rstd). On a GPU there are more programs, each reading the weights (``2 * D`` elements) once: at most
``1 / (Hq + Hkv)`` of the ideal on top, and L2 hits.

**YaRN tables.** :func:`rope_cos_sin` also computes ``rope_type "yarn"`` (GPT-OSS, DeepSeek-V3) as
Hugging Face's ``_compute_yarn_parameters``: the inverse frequencies ramp from interpolated (divided
by ``factor``) to kept between two correction dims, and both tables are multiplied by the attention
factor (:func:`yarn_get_mscale`, or DeepSeek's ratio of ``mscale`` to ``mscale_all_dim``).
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
from .norm import column_sum

__all__ = ["ROPE_SCALINGS", "rope", "rope_cos_sin", "rope_kernel", "yarn_get_mscale"]

#: The ``scaling["rope_type"]`` values :func:`rope_cos_sin` implements (Hugging Face's names).
ROPE_SCALINGS: tuple[str, ...] = ("default", "linear", "llama3", "yarn")

_OP = "kernel_ladder.rope"
#: The cos/sin tables' dtypes: the kernel reads them in float32 (float64 tables are rounded to it once).
TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, src_ptr, x_base, y_base, src_base,
    stride_xh, stride_xd, stride_yh, stride_yd, stride_sh, stride_sd, n_heads,
    c1, c2, s1, s2, lo, hi, pair_mask, rest, rest_mask,
    w1, w2, wr, eps, head_dim, dw1, dw2, dwr,
    BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, HAS_REST: tl.constexpr, NORM: tl.constexpr,
):
    """Rotate every head of one token of one tensor (heads in tiles of BLOCK_H); with ``NORM``, RMS-normalize
    each head vector over its ``head_dim`` features first (forward) or back through that norm (backward).

    ``w1``, ``w2``, ``wr`` are the norm's scale (``offset + w``, float32) at the features ``lo``, ``hi`` and
    ``rest``. The backward reads the gradient at ``x_ptr`` and the forward's input at ``src_ptr`` (NORM only),
    and returns the weight-gradient sums ``dw1``, ``dw2``, ``dwr`` with this token's heads added.
    """
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = heads < n_heads
        mask = head_mask[:, None] & pair_mask[None, :]
        rmask = head_mask[:, None] & rest_mask[None, :]
        x_heads = x_base + heads.to(tl.int64)[:, None] * stride_xh
        y_heads = y_base + heads.to(tl.int64)[:, None] * stride_yh
        x1 = tl.load(x_ptr + x_heads + lo[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_heads + hi[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # the transposed rotation
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
            if NORM:  # back through x * rstd * w: dx = rstd * (g w - xhat * mean(g w xhat)), dw += g xhat
                yr = tl.load(x_ptr + x_heads + rest[None, :] * stride_xd, mask=rmask, other=0.0).to(tl.float32)
                s_heads = src_base + heads.to(tl.int64)[:, None] * stride_sh
                a1 = tl.load(src_ptr + s_heads + lo[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
                a2 = tl.load(src_ptr + s_heads + hi[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
                ar = tl.load(src_ptr + s_heads + rest[None, :] * stride_sd, mask=rmask, other=0.0).to(tl.float32)
                squares = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1) + tl.sum(ar * ar, axis=1)
                rstd = tl.rsqrt(squares / head_dim + eps)[:, None]
                a1, a2, ar = a1 * rstd, a2 * rstd, ar * rstd  # xhat
                g1, g2, gr = y1 * w1[None, :], y2 * w2[None, :], yr * wr[None, :]
                mean_gx = (tl.sum(g1 * a1, axis=1) + tl.sum(g2 * a2, axis=1) + tl.sum(gr * ar, axis=1)) / head_dim
                dw1 += tl.sum(y1 * a1, axis=0)
                dw2 += tl.sum(y2 * a2, axis=0)
                dwr += tl.sum(yr * ar, axis=0)
                y1 = (g1 - a1 * mean_gx[:, None]) * rstd
                y2 = (g2 - a2 * mean_gx[:, None]) * rstd
                yr = (gr - ar * mean_gx[:, None]) * rstd
        else:
            if NORM:  # x * rstd * w over the whole head, then the rotation
                xr = tl.load(x_ptr + x_heads + rest[None, :] * stride_xd, mask=rmask, other=0.0).to(tl.float32)
                squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
                rstd = tl.rsqrt(squares / head_dim + eps)[:, None]
                x1 = x1 * rstd * w1[None, :]
                x2 = x2 * rstd * w2[None, :]
                yr = xr * rstd * wr[None, :]
            y1 = x1 * c1[None, :] - x2 * s1[None, :]
            y2 = x2 * c2[None, :] + x1 * s2[None, :]
        tl.store(y_ptr + y_heads + lo[None, :] * stride_yd, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_heads + hi[None, :] * stride_yd, y2.to(y_ptr.dtype.element_ty), mask=mask)
        if HAS_REST:  # features past the rotary width are not rotated
            if not NORM:
                yr = tl.load(x_ptr + x_heads + rest[None, :] * stride_xd, mask=rmask, other=0.0)
            tl.store(y_ptr + y_heads + rest[None, :] * stride_yd, yr.to(y_ptr.dtype.element_ty), mask=rmask)
    return dw1, dw2, dwr


@triton.jit
def _norm_scale(w_ptr, stride_w, offset, lo, hi, pair_mask, rest, rest_mask, NORM: tl.constexpr):
    """``offset + w`` in float32 at the features ``lo``, ``hi`` and ``rest``, and zeroed weight-gradient sums."""
    if NORM:
        w1 = tl.load(w_ptr + lo * stride_w, mask=pair_mask, other=0.0).to(tl.float32) + offset
        w2 = tl.load(w_ptr + hi * stride_w, mask=pair_mask, other=0.0).to(tl.float32) + offset
        wr = tl.load(w_ptr + rest * stride_w, mask=rest_mask, other=0.0).to(tl.float32) + offset
    else:
        w1 = tl.zeros(lo.shape, dtype=tl.float32)
        w2 = w1
        wr = tl.zeros(rest.shape, dtype=tl.float32)
    return w1, w2, wr


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    q_src_ptr, k_src_ptr, q_weight_ptr, k_weight_ptr, dq_weight_ptr, dk_weight_ptr,  # the QK-norm's operands
    norm_eps, norm_offset,
    n_units, batch, seq_len, units_per_program,       # a unit: a token (b, t), or a position t (SHARED_TABLE)
    n_heads_q, n_heads_k, head_dim, half,             # half = rotary width / 2
    stride_qb, stride_qh, stride_qt, stride_qd,       # q as (B, H, T, D), whatever its memory layout
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qob, stride_qoh, stride_qot, stride_qod,   # the outputs, same logical shape as q / k
    stride_kob, stride_koh, stride_kot, stride_kod,
    stride_qsb, stride_qsh, stride_qst, stride_qsd,   # the forward's q and k (the backward with a norm)
    stride_ksb, stride_ksh, stride_kst, stride_ksd,
    stride_cb, stride_ct, stride_cd,                  # cos and sin as (B, T, R); stride_cb 0 for (T, R)
    stride_sb, stride_st, stride_sd,
    stride_qw, stride_kw,                             # the norm weights' strides
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_REST: tl.constexpr, SHARED_TABLE: tl.constexpr,
    NORM_Q: tl.constexpr, NORM_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    """Rotate q and k for this program's units: each cos/sin row is read once for all the heads (and,
    with ``SHARED_TABLE`` — one table for the whole batch — once for every sequence of the batch).

    Pair ``j`` is features ``(j, j + half)`` (rotate-half) or ``(2j, 2j + 1)`` (``INTERLEAVED``);
    features ``>= 2 * half`` are not rotated (``HAS_REST``). ``NORM_Q`` / ``NORM_K``: each head vector
    of q / k is RMS-normalized over its ``head_dim`` features and scaled by ``norm_offset + w`` before
    the rotation; the backward then writes this program's row of each weight's float32 gradient
    partials (``dq_weight_ptr``, ``dk_weight_ptr``: ``(programs, head_dim)``).
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
    wq1, wq2, wqr = _norm_scale(q_weight_ptr, stride_qw, norm_offset, lo, hi, pair_mask, rest, rest_mask, NORM_Q)
    wk1, wk2, wkr = _norm_scale(k_weight_ptr, stride_kw, norm_offset, lo, hi, pair_mask, rest, rest_mask, NORM_K)
    dwq1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dwq2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dwqr = tl.zeros([BLOCK_REST], dtype=tl.float32)
    dwk1, dwk2, dwkr = dwq1, dwq2, dwqr
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
                dwq1, dwq2, dwqr = _rotate_heads(
                    q_ptr, q_out_ptr, q_src_ptr, b * stride_qb + t * stride_qt, b * stride_qob + t * stride_qot,
                    b * stride_qsb + t * stride_qst, stride_qh, stride_qd, stride_qoh, stride_qod, stride_qsh,
                    stride_qsd, n_heads_q, c1, c2, s1, s2, lo, hi, pair_mask, rest, rest_mask,
                    wq1, wq2, wqr, norm_eps, head_dim, dwq1, dwq2, dwqr, BLOCK_HQ, BACKWARD, HAS_REST, NORM_Q)
                dwk1, dwk2, dwkr = _rotate_heads(
                    k_ptr, k_out_ptr, k_src_ptr, b * stride_kb + t * stride_kt, b * stride_kob + t * stride_kot,
                    b * stride_ksb + t * stride_kst, stride_kh, stride_kd, stride_koh, stride_kod, stride_ksh,
                    stride_ksd, n_heads_k, c1, c2, s1, s2, lo, hi, pair_mask, rest, rest_mask,
                    wk1, wk2, wkr, norm_eps, head_dim, dwk1, dwk2, dwkr, BLOCK_HK, BACKWARD, HAS_REST, NORM_K)
    if BACKWARD:  # one row of partial sums a program, added up in a fixed order afterwards (no atomics)
        row = pid.to(tl.int64) * head_dim
        if NORM_Q:
            tl.store(dq_weight_ptr + row + lo, dwq1, mask=pair_mask)
            tl.store(dq_weight_ptr + row + hi, dwq2, mask=pair_mask)
            tl.store(dq_weight_ptr + row + rest, dwqr, mask=rest_mask)
        if NORM_K:
            tl.store(dk_weight_ptr + row + lo, dwk1, mask=pair_mask)
            tl.store(dk_weight_ptr + row + hi, dwk2, mask=pair_mask)
            tl.store(dk_weight_ptr + row + rest, dwkr, mask=rest_mask)


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


def _held_features(block_half: int, block_rest: int, rest: int, norm: bool) -> int:
    """The features of a head a program holds at once: the two halves of the pairs, and with a norm the
    unrotated rest too (the whole head, for its sum of squares). The warps follow from this."""
    return 2 * block_half + (block_rest if norm and rest else 0)


def _launch_rope(
    q, k, q_out, k_out, cos, sin, unsqueeze_dim: int, interleaved: bool, backward: bool, *,
    q_src=None, k_src=None, q_weight=None, k_weight=None, norm_eps: float = 1e-6, norm_offset: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One launch over q and k. The backward with a norm weight reads the forward's input (``q_src``,
    ``k_src``) besides the gradient (``q``, ``k``) and returns each weight's float32 gradient partials,
    ``(programs, D)`` (None without that norm)."""
    qv, kv = _as_bhtd(q, unsqueeze_dim), _as_bhtd(k, unsqueeze_dim)
    qo, ko = _as_bhtd(q_out, unsqueeze_dim), _as_bhtd(k_out, unsqueeze_dim)
    batch, n_heads_q, seq_len, head_dim = qv.shape
    n_heads_k = kv.shape[1]
    norm_q, norm_k = q_weight is not None, k_weight is not None
    if batch * seq_len == 0 or head_dim == 0:
        empty = _launch.empty((0, head_dim), torch.float32, q.device)
        return (empty if norm_q and backward else None), (empty if norm_k and backward else None)
    c, s = _tables(cos, batch), _tables(sin, batch)
    # One table for the batch (a (T, R) or (1, T, R) table): a program takes positions, every
    # sequence of each, so the table is read once in all; else tokens, each with its own row.
    shared = c.stride(0) == 0 and s.stride(0) == 0 and batch > 1
    n_units = seq_len if shared else batch * seq_len
    half = c.shape[-1] // 2
    block_half = next_power_of_2(half)
    rest = head_dim - 2 * half
    block_rest = next_power_of_2(rest)
    # The norm's backward holds the gradient and the input of a head tile at once: half the heads a tile.
    tile = TILE_ELEMENTS // (2 if backward and (norm_q or norm_k) else 1)
    block_hq = max(1, min(next_power_of_2(n_heads_q), tile // block_half))
    block_hk = max(1, min(next_power_of_2(n_heads_k), tile // block_half))
    # Enough programs to fill the GPU twice over; the interpreter's 4 "SMs" keep the CPU's count small.
    programs = min(n_units, 2 * _launch.num_sms(q.device) * (8 if not runtime.INTERPRETER else 1))
    units_per_program = triton.cdiv(n_units, programs)
    grid = (triton.cdiv(n_units, units_per_program),)
    qs = _as_bhtd(q_src, unsqueeze_dim) if backward and norm_q else qv
    ks = _as_bhtd(k_src, unsqueeze_dim) if backward and norm_k else kv
    dwq = _launch.empty((grid[0], head_dim), torch.float32, q.device) if backward and norm_q else None
    dwk = _launch.empty((grid[0], head_dim), torch.float32, q.device) if backward and norm_k else None
    rope_kernel[grid](
        qv, kv, qo, ko, c, s,
        qs, ks, q_weight if norm_q else c, k_weight if norm_k else c,
        dwq if dwq is not None else c, dwk if dwk is not None else c,
        float(norm_eps), float(norm_offset),
        n_units, batch, seq_len, units_per_program,
        n_heads_q, n_heads_k, head_dim, half,
        *qv.stride(), *kv.stride(), *qo.stride(), *ko.stride(), *qs.stride(), *ks.stride(), *c.stride(), *s.stride(),
        q_weight.stride(0) if norm_q else 0, k_weight.stride(0) if norm_k else 0,
        INTERLEAVED=interleaved, BACKWARD=backward, HAS_REST=rest > 0, SHARED_TABLE=shared,
        NORM_Q=norm_q, NORM_K=norm_k,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        num_warps=_launch.num_warps_for(block_hq * _held_features(block_half, block_rest, rest, norm_q or norm_k)),
    )
    return dwq, dwk


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_args(q: object, k: object, cos: object, sin: object, unsqueeze_dim: object, interleaved: object,
                q_norm_weight: object = None, k_norm_weight: object = None, norm_eps: object = 1e-6,
                norm_offset: object = 0.0) -> None:
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
    _check_norm(q, k, head_dim, q_norm_weight, k_norm_weight, norm_eps, norm_offset)


def _check_norm(q: torch.Tensor, k: torch.Tensor, head_dim: int, q_norm_weight: object, k_norm_weight: object,
                norm_eps: object, norm_offset: object) -> None:
    """The QK-norm's arguments: ``(D,)`` float weights on q's device (or None), a finite eps > 0, a finite offset."""
    for name, w, x in (("q_norm_weight", q_norm_weight, q), ("k_norm_weight", k_norm_weight, k)):
        if w is None:
            continue
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be None or a torch.Tensor of shape (D,), got {type(w).__name__}")
        check_float_dtype(_OP, name, w)
        check_same_device(_OP, "q", q, name, w)
        if w.dim() != 1 or w.shape[0] != head_dim:
            raise ValueError(
                f"{_OP}: {name} must have shape (D,) = ({head_dim},), one scale per feature of a head of "
                f"{name[0]} {tuple(x.shape)}; got {tuple(w.shape)}"
            )
    for name, value, positive in (("norm_eps", norm_eps, True), ("norm_offset", norm_offset, False)):
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat)):
            raise TypeError(f"{_OP}: {name} must be a float, got {type(value).__name__}")
        if not math.isfinite(float(value)) or (positive and not float(value) > 0):
            raise ValueError(f"{_OP}: {name} must be a finite number{' > 0' if positive else ''}, got {value}")


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _empty_like_input(t: torch.Tensor) -> torch.Tensor:
    return _launch.empty_output(t.shape, t)


@torch.library.custom_op("kernel_ladder::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
             interleaved: bool, q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
             norm_eps: float = 1e-6, norm_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight, k_norm_weight, norm_eps, norm_offset)
    runtime.require_launchable(_OP, q, k, cos, sin, *[w for w in (q_norm_weight, k_norm_weight) if w is not None])
    q_out, k_out = _empty_like_input(q), _empty_like_input(k)
    _launch_rope(q, k, q_out, k_out, cos, sin, unsqueeze_dim, interleaved, backward=False,
                 q_weight=q_norm_weight, k_weight=k_norm_weight, norm_eps=norm_eps, norm_offset=norm_offset)
    return q_out, k_out


@_rope_op.register_fake
def _rope_fake(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6,
               norm_offset=0.0):
    _check_args(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight, k_norm_weight, norm_eps, norm_offset)
    return _empty_like_input(q), _empty_like_input(k)


@torch.library.custom_op("kernel_ladder::rope_backward", mutates_args=())
def _rope_backward_op(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int, interleaved: bool, q: torch.Tensor | None = None,
                      k: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6, norm_offset: float = 0.0,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, d q_norm_weight, d k_norm_weight)``; a weight's gradient is empty ``(0,)`` without that norm.
    With a norm weight, the forward's input (``q``, ``k``) is read again to recompute each head's rstd."""
    op = f"{_OP} (backward)"
    runtime.require_launchable(op, grad_q, grad_k, cos, sin)
    dq, dk = _empty_like_input(grad_q), _empty_like_input(grad_k)
    dwq, dwk = _launch_rope(grad_q, grad_k, dq, dk, cos, sin, unsqueeze_dim, interleaved, backward=True,
                            q_src=q, k_src=k, q_weight=q_norm_weight, k_weight=k_norm_weight, norm_eps=norm_eps,
                            norm_offset=norm_offset)
    # (0,) placeholders without a norm: two allocations (a custom op's outputs may not alias), no kernel
    dwq = (column_sum(dwq, q_norm_weight.shape, q_norm_weight.dtype) if q_norm_weight is not None
           else grad_q.new_empty((0,)))
    dwk = (column_sum(dwk, k_norm_weight.shape, k_norm_weight.dtype) if k_norm_weight is not None
           else grad_q.new_empty((0,)))
    return dq, dk, dwq, dwk


@_rope_backward_op.register_fake
def _rope_backward_fake(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved, q=None, k=None, q_norm_weight=None,
                        k_norm_weight=None, norm_eps=1e-6, norm_offset=0.0):
    dwq = q_norm_weight.new_empty(q_norm_weight.shape) if q_norm_weight is not None else grad_q.new_empty((0,))
    dwk = k_norm_weight.new_empty(k_norm_weight.shape) if k_norm_weight is not None else grad_q.new_empty((0,))
    return _empty_like_input(grad_q), _empty_like_input(grad_k), dwq, dwk


def _setup_context(ctx, inputs, output) -> None:
    q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight, k_norm_weight, norm_eps, norm_offset = inputs
    # The norm's backward recomputes each head's rstd from the input: q (k) is kept only with its norm.
    ctx.save_for_backward(cos, sin, q if q_norm_weight is not None else None,
                          k if k_norm_weight is not None else None, q_norm_weight, k_norm_weight)
    ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
    ctx.norm_eps, ctx.norm_offset = norm_eps, norm_offset
    ctx.q_dtype, ctx.q_shape, ctx.k_shape = q.dtype, q.shape, k.shape
    ctx.set_materialize_grads(False)  # no zeros for an output that takes no part in the loss


def _backward(ctx, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None):
    cos, sin, q, k, q_norm_weight, k_norm_weight = ctx.saved_tensors
    # An output that took no part in the loss has no gradient (None): rotate a stride-0 zero instead.
    if grad_q is None and grad_k is None:
        return (None,) * 10
    like = grad_q if grad_q is not None else grad_k
    if grad_q is None:
        grad_q = torch.zeros((), dtype=like.dtype, device=like.device).expand(ctx.q_shape)
    if grad_k is None:
        grad_k = torch.zeros((), dtype=like.dtype, device=like.device).expand(ctx.k_shape)
    dq, dk, dwq, dwk = _rope_backward_op(grad_q.to(ctx.q_dtype), grad_k.to(ctx.q_dtype), cos, sin, ctx.unsqueeze_dim,
                                         ctx.interleaved, q, k, q_norm_weight, k_norm_weight, ctx.norm_eps,
                                         ctx.norm_offset)
    dwq = dwq if q_norm_weight is not None and ctx.needs_input_grad[6] else None
    dwk = dwk if k_norm_weight is not None and ctx.needs_input_grad[7] else None
    return dq, dk, None, None, None, None, dwq, dwk, None, None


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
    interleaved: bool = False, *, q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6, norm_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embeddings for ``q`` and ``k`` in one launch, like Hugging Face's ``apply_rotary_pos_emb``,
    optionally after a per-head RMSNorm of each (QK-norm).

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
        q_norm_weight, k_norm_weight: ``(D,)`` float32, float16 or bfloat16 weights of a QK-norm, or
            None (no norm of that tensor). With a weight, each head vector ``x`` of q (k) becomes
            ``x * rsqrt(mean(x**2) + norm_eps) * (norm_offset + w)`` over its ``D`` features, in
            float32, before the rotation — Qwen3's and OLMo 2's ``q_norm``/``k_norm``
            (``Qwen3RMSNorm``: ``norm_offset=0``) and Gemma 3's (``Gemma3RMSNorm``, ``1 + w``:
            ``norm_offset=1.0``), fused into the same launch (the norm's output is never written).
        norm_eps: the norm's epsilon, a finite number > 0 (the config's ``rms_norm_eps``).
        norm_offset: added to the weights in float32 (a finite number).

    Returns:
        ``(q_embed, k_embed)``: new contiguous tensors of q's and k's shapes and dtype, computed in
        float32 and rounded once. Differentiable in q and k (``kernel_ladder::rope_backward``: the
        transposed rotation, then the norm's Jacobian) and in the norm weights (float32 sums of
        per-program partial rows, added in a fixed order: deterministic); cos and sin get no gradient.
        HF's ``Qwen3RMSNorm`` rounds the normalized value to the input's dtype before the weight
        multiplies it, and its RoPE then works in that dtype: in float16/bfloat16 the two differ by
        those roundings (this op is the closer to the float64 result).
    """
    if not schema_types(tensors=(q, k, cos, sin), optional_tensors=(q_norm_weight, k_norm_weight),
                        reals=(norm_eps, norm_offset), ints=(unsqueeze_dim,), flags=(interleaved,)):
        _check_args(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight, k_norm_weight, norm_eps,
                    norm_offset)  # the op checks values
    return _rope_op(q, k, cos, sin, unsqueeze_dim, interleaved, q_norm_weight, k_norm_weight, float(norm_eps),
                    float(norm_offset))


# ----------------------------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------------------------


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``), as Hugging Face's
    ``yarn_get_mscale`` (Peng et al., 2023, arXiv:2309.00071, Eq. 21).

    :func:`rope_cos_sin` multiplies the YaRN tables by it (or by the ratio DeepSeek's config asks for);
    DeepSeek-V3's attention also multiplies its softmax scale by ``yarn_get_mscale(factor, mscale_all_dim)**2``.
    """
    scale, mscale = float(scale), float(mscale)
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inverse_frequencies(dim: int, base: float, scaling: Mapping, device) -> tuple[torch.Tensor, float]:
    """HF's ``_compute_yarn_parameters``, step for step: the inverse frequencies and the attention factor."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:  # DeepSeek: the ratio of the two temperatures
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32  # HF's defaults (a 0 or None means the default)
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the feature pair whose wavelength makes this many turns in `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp  # 1: high frequencies kept; 0: low frequencies divided by factor
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _inverse_frequencies(head_dim: int, base: float, scaling: Mapping | None, device) -> torch.Tensor:
    """HF's inverse frequencies ``1 / base**(2i / dim)``, with its ``linear``, ``llama3`` or ``yarn`` scaling."""
    return _frequencies_and_attention_factor(head_dim, base, scaling, device)[0]


def _frequencies_and_attention_factor(head_dim: int, base: float, scaling: Mapping | None,
                                      device) -> tuple[torch.Tensor, float]:
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, base, scaling, device)
    # HF builds the arange on the CPU and copies it over; built on the device, it is the same integers
    # without a host-to-device copy, which CUDA-graph capture refuses.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
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
    return torch.where(is_medium_freq, smoothed, inv_freq_llama), 1.0


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
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}
    missing = [key for key in needed.get(rope_type, ()) if scaling.get(key) is None]
    if missing:
        hint = (" (HF derives a missing yarn factor from max_position_embeddings / original_max_position_embeddings: "
                "pass that number as factor)" if rope_type == "yarn" and "factor" in missing else "")
        raise ValueError(f"{op}: scaling of rope_type {rope_type!r} needs {missing}, got keys {sorted(scaling)}{hint}")
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(
            f"{op}: scaling['partial_rotary_factor'] = {partial!r} is not applied here: head_dim is the rotary width "
            "itself, so pass head_dim=int(head_dim * partial_rotary_factor) (what HF's rotary embedding rotates) and "
            "leave partial_rotary_factor out of scaling"
        )


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0, scaling: Mapping | None = None,
    dtype: torch.dtype = torch.float32, interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables of rotary embeddings, as Hugging Face's ``LlamaRotaryEmbedding`` computes them.

    ``inv_freq = 1 / base**(2i / head_dim)`` (optionally scaled), ``freqs = positions * inv_freq``
    in float32, ``emb = cat(freqs, freqs)``, then ``cos(emb)`` and ``sin(emb)`` (times YaRN's
    attention factor) cast to ``dtype`` — the same torch operations in the same order, so a patched
    model gets the same numbers.

    Args:
        positions: integer positions, ``(T,)`` or ``(B, T)`` (HF's ``position_ids``).
        head_dim: the rotary width R (even): the head dim, or ``head_dim * partial_rotary_factor``.
        base: ``rope_theta`` (10000 for Llama 2, 500000 for Llama 3).
        scaling: None, or a config's ``rope_scaling`` / ``rope_parameters`` dict with ``rope_type``
            ``"linear"`` (``factor``), ``"llama3"`` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``) or ``"yarn"`` (``factor``,
            ``original_max_position_embeddings``; optional ``beta_fast`` (32), ``beta_slow`` (1),
            ``truncate`` (True), ``attention_factor``, ``mscale``, ``mscale_all_dim``): HF's
            ``_compute_yarn_parameters`` — GPT-OSS's and DeepSeek-V3's configs — with both tables
            multiplied by its attention factor in float32 before the cast, as HF's rotary modules do.
            A ``partial_rotary_factor`` other than 1 is refused: ``head_dim`` is already the rotary width.
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
    inv_freq, attention_factor = _frequencies_and_attention_factor(int(head_dim), float(base), scaling,
                                                                   positions.device)
    freqs = positions[..., None].float() * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:  # YaRN: HF's rotary module multiplies the tables in float32, then casts
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)
