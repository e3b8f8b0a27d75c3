"""Cross-entropy over large vocabularies, forward and backward, as ``kernel_ladder::cross_entropy``.

For a row ``x`` of ``V`` logits with target class ``y``, class weights ``w`` (all 1 by default)
and label smoothing ``eps``, torch's definition::

    loss = (1 - eps) * w[y] * (lse - z[y]) + eps / V * sum_c w[c] * (lse - z[c]),   lse = logsumexp(z)

where ``z = x``, or with ``softcap`` (Gemma-2's final-logit soft-capping) ``z = softcap *
tanh(x / softcap)``, computed in the kernel and never stored. ``z_loss`` (PaLM's auxiliary loss)
adds ``z_loss * lse**2`` per row. Rows whose target is ``ignore_index`` contribute nothing;
``"mean"`` divides the cross-entropy by the sum of the non-ignored rows' target weights (their
number without weights) and the z-loss by the number of non-ignored rows (it is not weighted), as
torch does for the one and Liger-Kernel for the other.

**No softmax is materialized.** Each program walks its rows in chunks of ``BLOCK_COLS`` columns with a
running maximum ``m`` and a running sum of exponentials rescaled to it (``s <- s * exp(m - m') +
sum exp(z - m')``, the online log-sum-exp), so a 128k-word row is read once, in registers, and
only one float per row is written. Short rows are stacked ``BLOCK_ROWS`` to a tile. The per-row
math (soft-capping, the online update, the loss and the gradient of a chunk) is a set of
``@triton.jit`` helpers that another kernel can call on logits it computes itself (chapter 06's
fused linear cross-entropy).

**The gradient is computed in the forward pass.** ``d loss / d z[c] = A p[c] - B [c == y] - C w[c]``
with ``p = softmax(z)``, ``A = (1 - eps) w[y] + eps / V sum(w)``, ``B = (1 - eps) w[y]``,
``C = eps / V`` (plus ``2 z_loss lse p[c]``), times the reduction's scale, and times
``1 - tanh(x / softcap)**2`` with soft-capping. It needs only the row's log-sum-exp, which the
forward has just computed; so when a gradient will be needed (``logits.requires_grad`` and grad
mode on), the forward also writes it, once, into a buffer of the logits' shape and dtype (a row
that fits in one block is still read once; a longer row is read a second time for it, which a
GPU serves largely from L2). The backward then only scales that buffer by ``grad_output`` (per
row for ``"none"``), *in place* (``kernel_ladder::cross_entropy_backward``), and skips even that when
the scale is exactly 1, as for ``loss.backward()``. Consequences: one backward per loss (a
second one through a retained graph is refused with an error); no double backward (a gradient
penalty through this gradient raises the op's error instead of silently contributing nothing);
under ``torch.compile`` the traced backward scales out of place (a traced graph must not mutate
a saved tensor).

**No host synchronization, no torch work.** A call is three launches, all Triton:

1. ``cross_entropy_targets_kernel`` (one program) reads the targets once: checks that every one is
   a class in ``[0, V)`` or ``ignore_index``, counts the non-ignored rows and sums their target
   weights, and writes the reduction's scales (``1 / count`` or ``1 / weight sum`` for "mean")
   into a small device buffer;
2. ``cross_entropy_forward_kernel`` reads the logits (and the targets again, one integer per row),
   reads the scales from that buffer — no value goes through the host — and writes the per-row
   losses and the gradient;
3. ``cross_entropy_reduce_kernel`` (one program, "mean" and "sum" only) sums the per-row losses in
   a fixed order: deterministic, no atomics.

An out-of-range target sets a flag in the device buffer, checked with ``torch._assert_async``.
On the CPU that raises at once, and the error (a ``ValueError``) names the op, the valid range
and the targets' range. On CUDA it is a device-side assertion, like the one torch's own
``F.cross_entropy`` raises for a bad target: it does not stop the host, the failure surfaces as
``CUDA error: device-side assert triggered`` at the next synchronizing call, and the CUDA context
is unusable afterwards (run the same batch on the CPU, or with ``kernel_ladder.runtime.check_values(True)``
for a host check that names the targets). That check is one tiny aten kernel (``aten._assert_async``);
it follows the value-check policy of :mod:`kernel_ladder.runtime`.

**Memory.** What torch keeps for ``F.cross_entropy`` forward + backward, per element of the
``N x V`` logits: the log-probabilities (saved for the backward), the gradient of the NLL
(a one-hot ``N x V`` scatter) and the gradient of the log-softmax — three ``N x V`` tensors alive
at the backward's peak. What this op keeps: the gradient buffer (it becomes ``logits.grad``
without a copy), one float32 per row and a few bytes of scales. Measured with
``utils.memory.peak_memory`` on the CPU (N = 32, V = 32768, forward + backward, the logits
themselves excluded; ``tests/test_kernels_cross_entropy.py`` measures this table again and
fails if it drifts), in bytes:

===================================================  ==========  =========  =====
comparison                                                torch       ours  ratio
===================================================  ==========  =========  =====
fp32 logits, ``F.cross_entropy(logits, y)``          12,582,920  4,194,472  0.333
bf16 logits, ``F.cross_entropy(logits, y)``           6,291,460  2,097,318  0.333
bf16 logits, ``F.cross_entropy(logits.float(), y)``  12,582,920  2,097,318  0.167
===================================================  ==========  =========  =====

That is 12, 6 and 12 bytes per logit for torch against 4, 2 and 2 for this op. So the "at most a
quarter of torch's peak" asked of the GPU at V = 128k holds against the pattern language models
run — bf16 logits upcast to fp32 for the loss, where torch keeps the fp32 log-softmax, its NLL
gradient and the log-softmax gradient (12 bytes per logit) before casting the gradient back —
and not against torch on the same dtype, where the honest ratio is a third.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._autograd import recorded_gradient
from .._launch import coalesce_dims, next_power_of_2
from .._rows import RowConfig, plan_rows, row_start
from .._validate import (
    check_bool,
    check_choice,
    check_float_dtype,
    check_same_device,
    check_tensor,
    check_values,
    schema_types,
)

__all__ = [
    "REDUCTIONS",
    "cross_entropy",
    "cross_entropy_backward_kernel",
    "cross_entropy_forward_kernel",
    "cross_entropy_grad_chunk",
    "cross_entropy_grad_coefficients",
    "cross_entropy_launch_config",
    "cross_entropy_reduce_kernel",
    "cross_entropy_row_loss",
    "cross_entropy_targets_kernel",
    "online_logsumexp_update",
    "softcap_logits",
    "softcapped",
    "tanh",
]

#: The values of ``reduction``, as in ``torch.nn.functional.cross_entropy``.
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")

#: Columns per chunk of a long row (the interpreter takes bigger chunks: fewer Python iterations).
MAX_BLOCK: int = 16384 if runtime.INTERPRETER else 4096
#: Elements a tile aims at: short rows are stacked BLOCK_ROWS high up to this many.
TILE_ELEMENTS: int = 65536 if runtime.INTERPRETER else 4096
#: Targets (or per-row losses) the one-program targets and reduce kernels take per iteration.
SCAN_BLOCK: int = 16384 if runtime.INTERPRETER else 1024

_OP = "kernel_ladder.cross_entropy"
_FLOAT_MIN = tl.constexpr(-3.4028234663852886e38)  # a finite start for the running max (no inf - inf)
_INT64_MAX = tl.constexpr(2**63 - 1)
_INT64_MIN = tl.constexpr(-(2**63))
# Slots of the targets kernel's outputs.
CHECK_SLOTS = 3  # int64: all targets valid (1/0), the lowest and the highest non-ignored target
SCALE_SLOTS = 3  # float32: the cross-entropy's scale, the z-loss's scale, the sum of the class weights


# ----------------------------------------------------------------------------------------------
# Per-row math: @triton.jit helpers any kernel can call on a (BLOCK_ROWS, BLOCK_COLS) chunk
# ----------------------------------------------------------------------------------------------


@triton.jit
def tanh(u):
    """``tanh(u)`` in float32 from ``exp``, accurate to a few ulp everywhere (no libdevice needed).

    ``(1 - e) / (1 + e)`` with ``e = exp(-2|u|)`` never overflows, but loses relative precision as
    ``|u| -> 0`` (``1 - e`` cancels); below ``|u| = 1/4`` the Taylor series to ``u**9`` is used
    instead (its next term is below 1e-8 relative there).
    """
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, small, big)
    return tl.where(u < 0, -t, t)


@triton.jit
def softcap_logits(x, cap):
    """Gemma-2's soft-capping: ``(cap * tanh(x / cap), d/dx = 1 - tanh(x / cap)**2)`` in float32.

    The derivative is formed as ``4e / (1 + e)**2`` (``e = exp(-2|x / cap|)``), which keeps its
    relative precision where ``1 - tanh**2`` would cancel (large ``|x|``).
    """
    u = x * (1.0 / cap)
    e = tl.exp(-2.0 * tl.abs(u))
    derivative = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return cap * tanh(u), derivative


@triton.jit
def softcapped(x, cap):
    """``cap * tanh(x / cap)`` alone (the statistics pass needs no derivative)."""
    return cap * tanh(x * (1.0 / cap))


@triton.jit
def online_logsumexp_update(row_max, sum_exp, z):
    """Fold a ``(rows, cols)`` chunk ``z`` (masked lanes ``-inf``) into the running ``(max, sum exp(z - max))``.

    Start from ``(_FLOAT_MIN, 0)``: a finite max, so that a row with every lane masked gives
    ``(_FLOAT_MIN, 0)`` and never ``inf - inf``. One ``exp`` per element: the running sum is
    rescaled once per chunk.
    """
    new_max = tl.maximum(row_max, tl.max(z, 1))
    sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), 1)
    return new_max, sum_exp


@triton.jit
def cross_entropy_row_loss(row_max, log_sum, z_target, w_target, sum_wz, class_weight_sum, label_smoothing,
                           n_cols, SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """torch's per-row cross-entropy from the row's statistics (unscaled, before the reduction).

    ``lse = row_max + log_sum`` is never formed: at ``|z| ~ 1e4`` its rounding (fp32 spacing 1e-3)
    would be the loss's error; differences from the max are exact (like torch's log_softmax).
    ``sum_wz`` is ``sum_c w[c] z[c]`` (``sum_c z[c]`` unweighted), used only with SMOOTHING;
    ``class_weight_sum`` is ``sum_c w[c]``, used only with SMOOTHING and HAS_WEIGHT.
    """
    loss = (1.0 - label_smoothing) * w_target * (log_sum + (row_max - z_target))
    if SMOOTHING:
        if HAS_WEIGHT:
            loss += label_smoothing / n_cols * (class_weight_sum * (log_sum + row_max) - sum_wz)
        else:
            loss += label_smoothing * (log_sum + (row_max - sum_wz / n_cols))
    return loss


@triton.jit
def cross_entropy_grad_coefficients(row_max, log_sum, w_target, class_weight_sum, label_smoothing, n_cols,
                                    z_loss, z_scale, SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                    Z_LOSS: tl.constexpr):
    """Per-row ``(A, B, Z)`` of the gradient ``ce_scale (A p - B [c == y] - eps/V w[c]) + Z p``.

    ``A = (1 - eps) w[y] + eps / V sum(w)`` (1 without weights: ``(1 - eps) + eps``), ``B = (1 - eps)
    w[y]`` and ``Z = 2 z_loss lse z_scale`` (0 without the z-loss).
    """
    b = (1.0 - label_smoothing) * w_target
    if HAS_WEIGHT:
        a = b
        if SMOOTHING:
            a += label_smoothing / n_cols * class_weight_sum
    else:
        a = w_target * 0.0 + 1.0  # (1 - eps) + eps, exactly
    if Z_LOSS:
        z = 2.0 * z_loss * z_scale * (row_max + log_sum)
    else:
        z = a * 0.0
    return a, b, z


@triton.jit
def cross_entropy_grad_chunk(z, cols, target, row_max, log_sum, a, b, zc, w, ce_scale, label_smoothing, n_cols,
                             SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr):
    """``d loss / d z`` over a ``(rows, cols)`` chunk of (capped) logits ``z``, in float32.

    ``w`` is the chunk's class weights (``[1, cols]``) or 1.0; ``a, b, zc`` come from
    :func:`cross_entropy_grad_coefficients`. Rows are not masked here: the caller zeroes ignored ones.
    """
    p = tl.exp((z - row_max[:, None]) - log_sum[:, None])
    g = a[:, None] * p
    g = tl.where(cols[None, :] == target[:, None], g - b[:, None], g)
    if SMOOTHING:
        g -= (label_smoothing / n_cols) * w
    g = ce_scale * g
    if Z_LOSS:
        g += zc[:, None] * p
    return g


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def cross_entropy_targets_kernel(
    target_ptr, weight_ptr, check_ptr, scale_ptr,     # targets, class weights; outputs: the check, the scales
    ignore_index, n_rows, n_cols, size1, size2,       # rows (targets), V, the merged leading dims
    stride_t0, stride_t1, stride_t2, stride_w,
    HAS_WEIGHT: tl.constexpr, CLASS_WEIGHT_SUM: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program reads every target once, in a fixed order, and writes what the loss kernel needs.

    ``check = [every non-ignored target in [0, V), lowest, highest]`` (int64; 0, 0 for the range
    without any) and ``scale = [ce_scale, z_scale, sum(w)]`` (float32): for ``MEAN``, ``ce_scale`` is
    1 / (the non-ignored rows' target weights summed, or counted without weights) and ``z_scale``
    1 / (their count), NaN when that is 0 (``0 / 0``, like torch); otherwise both are 1.
    ``sum(w)`` over all classes only with CLASS_WEIGHT_SUM (weights and label smoothing).
    """
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    weight_sum = tl.zeros([BLOCK], tl.float32)
    lowest = tl.full([BLOCK], _INT64_MAX, tl.int64)
    highest = tl.full([BLOCK], _INT64_MIN, tl.int64)
    for start in range(0, n_rows, BLOCK):
        rows = start + lanes
        in_batch = rows < n_rows
        target = tl.load(target_ptr + row_start(rows, size1, size2, stride_t0, stride_t1, stride_t2), mask=in_batch,
                         other=ignore_index).to(tl.int64)
        valid = in_batch & (target != ignore_index)
        in_range = valid & (target >= 0) & (target < n_cols)
        count += valid.to(tl.int32)
        bad += (valid & ~in_range).to(tl.int32)
        lowest = tl.minimum(lowest, tl.where(valid, target, _INT64_MAX))
        highest = tl.maximum(highest, tl.where(valid, target, _INT64_MIN))
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + tl.where(in_range, target, 0) * stride_w, mask=in_range, other=0.0)
            weight_sum += w.to(tl.float32)
    n_valid = tl.sum(count, 0)
    any_valid = n_valid > 0
    tl.store(check_ptr, (tl.sum(bad, 0) == 0).to(tl.int64))
    tl.store(check_ptr + 1, tl.where(any_valid, tl.min(lowest, 0), 0))
    tl.store(check_ptr + 2, tl.where(any_valid, tl.max(highest, 0), 0))

    count_f = n_valid.to(tl.float32)
    if MEAN:
        if HAS_WEIGHT:
            total = tl.sum(weight_sum, 0)
        else:
            total = count_f
        ce_scale = tl.where(total != 0.0, 1.0 / tl.where(total != 0.0, total, 1.0), float("nan"))
        z_scale = tl.where(any_valid, 1.0 / tl.where(any_valid, count_f, 1.0), float("nan"))
    else:
        ce_scale = count_f * 0.0 + 1.0
        z_scale = ce_scale
    tl.store(scale_ptr, ce_scale)
    tl.store(scale_ptr + 1, z_scale)
    class_weight_sum = tl.zeros([BLOCK], tl.float32)
    if CLASS_WEIGHT_SUM:
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            class_weight_sum += tl.load(weight_ptr + cols * stride_w, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(scale_ptr + 2, tl.sum(class_weight_sum, 0))


@triton.jit
def cross_entropy_forward_kernel(
    logits_ptr, target_ptr, loss_ptr, z_ptr, grad_ptr,  # x (rows of V logits), targets; per-row losses, z terms; grad
    weight_ptr, scale_ptr,                            # class weights (V,), the targets kernel's scales
    ignore_index, label_smoothing, softcap, z_loss,
    n_rows, n_cols, size1, size2,                     # rows, V, the merged leading dims
    stride_x0, stride_x1, stride_x2, stride_xcol,
    stride_t0, stride_t1, stride_t2, stride_tcol,
    stride_o0, stride_o1, stride_o2, stride_ocol,
    stride_z0, stride_z1, stride_z2, stride_zcol,
    stride_g0, stride_g1, stride_g2, stride_gcol,
    stride_w,
    COMPUTE_GRAD: tl.constexpr, SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    Z_LOSS: tl.constexpr, RETURN_Z: tl.constexpr, CHUNKED: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Loss of BLOCK_ROWS rows (and, with COMPUTE_GRAD, their gradient), by online log-sum-exp.

    ``loss[r] = ce_scale * ce + z_scale * z_loss * lse**2`` (0 for ignored rows), with ``ce`` from
    :func:`cross_entropy_row_loss` and the scales read from ``scale_ptr`` (written by
    :func:`cross_entropy_targets_kernel`); with RETURN_Z, ``z[r]`` is the z term alone. With
    COMPUTE_GRAD, ``grad[r, :]`` is the loss's gradient with respect to the row (0 for ignored
    rows). Unless CHUNKED, the row fits in one block, so it is loaded once and kept in registers
    for both; CHUNKED: a statistics pass over chunks, then (only for the gradient) a second pass.
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    x_row = row_start(rows, size1, size2, stride_x0, stride_x1, stride_x2)
    target = tl.load(target_ptr + row_start(rows, size1, size2, stride_t0, stride_t1, stride_t2), mask=row_mask,
                     other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index)  # ignored rows read no logits at all
    # A target outside [0, n_cols) (a value check's to catch; unchecked, the CUDA default) reads nothing:
    # its row's logit is NaN, so the loss says so instead of reading another row's memory.
    in_range = valid & (target >= 0) & (target < n_cols)
    safe_target = tl.where(in_range, target, 0)
    z_target = tl.load(logits_ptr + x_row + safe_target * stride_xcol, mask=in_range, other=0.0).to(tl.float32)
    z_target = tl.where(valid & ~in_range, float("nan"), z_target)
    if SOFTCAP:
        z_target = softcapped(z_target, softcap)
    if HAS_WEIGHT:
        w_target = tl.load(weight_ptr + safe_target * stride_w, mask=in_range, other=0.0).to(tl.float32)
    else:
        w_target = tl.where(valid, 1.0, 0.0)
    ce_scale = tl.load(scale_ptr)
    z_scale = tl.load(scale_ptr + 1)
    class_weight_sum = tl.load(scale_ptr + 2)
    cols0 = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols0 = cols0.to(tl.int64)

    row_max = tl.full([BLOCK_ROWS], _FLOAT_MIN, tl.float32)
    sum_exp = tl.zeros([BLOCK_ROWS], tl.float32)
    sum_wz = tl.zeros([BLOCK_ROWS], tl.float32)
    if not CHUNKED:
        col_mask = cols0 < n_cols
        mask = valid[:, None] & col_mask[None, :]
        x = tl.load(logits_ptr + x_row[:, None] + (cols0 * stride_xcol)[None, :], mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            x, dz = softcap_logits(x, softcap)
        z = tl.where(mask, x, float("-inf"))
        row_max, sum_exp = online_logsumexp_update(row_max, sum_exp, z)
        w = 1.0
        if SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + cols0 * stride_w, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            sum_wz = tl.sum(tl.where(mask, x * w, 0.0), 1)
    else:
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + cols0
            col_mask = cols < n_cols
            mask = valid[:, None] & col_mask[None, :]
            x = tl.load(logits_ptr + x_row[:, None] + (cols * stride_xcol)[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            if SOFTCAP:
                x = softcapped(x, softcap)
            row_max, sum_exp = online_logsumexp_update(row_max, sum_exp, tl.where(mask, x, float("-inf")))
            if SMOOTHING:
                if HAS_WEIGHT:
                    w_stat = tl.load(weight_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                    sum_wz += tl.sum(tl.where(mask, x * w_stat, 0.0), 1)
                else:
                    sum_wz += tl.sum(tl.where(mask, x, 0.0), 1)
    log_sum = tl.log(tl.where(valid, sum_exp, 1.0))  # ignored rows: nothing summed, unused
    ce = cross_entropy_row_loss(row_max, log_sum, z_target, w_target, sum_wz, class_weight_sum, label_smoothing,
                                n_cols, SMOOTHING, HAS_WEIGHT)
    loss = ce_scale * ce
    if Z_LOSS:
        lse = row_max + log_sum
        z_term = tl.where(valid, z_scale * z_loss * lse * lse, 0.0)
        loss += z_term
    else:
        z_term = loss * 0.0
    loss = tl.where(valid, loss, 0.0)
    tl.store(loss_ptr + row_start(rows, size1, size2, stride_o0, stride_o1, stride_o2),
             loss.to(loss_ptr.dtype.element_ty), mask=row_mask)
    if RETURN_Z:
        tl.store(z_ptr + row_start(rows, size1, size2, stride_z0, stride_z1, stride_z2),
                 z_term.to(z_ptr.dtype.element_ty), mask=row_mask)

    if COMPUTE_GRAD:
        a, b, zc = cross_entropy_grad_coefficients(row_max, log_sum, w_target, class_weight_sum, label_smoothing,
                                                   n_cols, z_loss, z_scale, SMOOTHING, HAS_WEIGHT, Z_LOSS)
        g_row = row_start(rows, size1, size2, stride_g0, stride_g1, stride_g2)
        if not CHUNKED:
            g = cross_entropy_grad_chunk(z, cols0, safe_target, row_max, log_sum, a, b, zc, w, ce_scale,
                                         label_smoothing, n_cols, SMOOTHING, Z_LOSS)
            if SOFTCAP:
                g = g * dz
            g = tl.where(valid[:, None], g, 0.0)
            tl.store(grad_ptr + g_row[:, None] + (cols0 * stride_gcol)[None, :], g.to(grad_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (cols0 < n_cols)[None, :])
        else:
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + cols0
                col_mask = cols < n_cols
                mask = valid[:, None] & col_mask[None, :]
                x = tl.load(logits_ptr + x_row[:, None] + (cols * stride_xcol)[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                if SOFTCAP:
                    x, dx = softcap_logits(x, softcap)
                w_grad = 1.0
                if SMOOTHING:
                    if HAS_WEIGHT:
                        w_grad = tl.load(weight_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                g = cross_entropy_grad_chunk(x, cols, safe_target, row_max, log_sum, a, b, zc, w_grad, ce_scale,
                                             label_smoothing, n_cols, SMOOTHING, Z_LOSS)
                if SOFTCAP:
                    g = g * dx
                g = tl.where(valid[:, None], g, 0.0)
                tl.store(grad_ptr + g_row[:, None] + (cols * stride_gcol)[None, :], g.to(grad_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def cross_entropy_reduce_kernel(
    loss_rows_ptr, z_rows_ptr, scale_ptr, loss_ptr, z_ptr,  # per-row losses and z terms (float32); the outputs
    n_rows,
    RETURN_Z: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program sums the (already scaled) per-row losses in a fixed order: the same bits every run.

    For MEAN, a NaN scale (no non-ignored row, or their weights sum to 0) makes the loss NaN, as
    torch's ``0 / 0``.
    """
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    z_total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + lanes
        total += tl.load(loss_rows_ptr + rows, mask=rows < n_rows, other=0.0)
        if RETURN_Z:
            z_total += tl.load(z_rows_ptr + rows, mask=rows < n_rows, other=0.0)
    loss = tl.sum(total, 0)
    z = tl.sum(z_total, 0)
    if MEAN:
        ce_scale = tl.load(scale_ptr)
        z_scale = tl.load(scale_ptr + 1)
        loss = tl.where(ce_scale == ce_scale, loss, float("nan"))
        z = tl.where(z_scale == z_scale, z, float("nan"))
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))
    if RETURN_Z:
        tl.store(z_ptr, z.to(z_ptr.dtype.element_ty))


@triton.jit
def cross_entropy_backward_kernel(
    grad_ptr, scale_ptr,                              # the gradient (scaled in place), the scales
    n_rows, n_cols, size1, size2,
    stride_g0, stride_g1, stride_g2, stride_gcol,
    stride_s0, stride_s1, stride_s2, stride_scol,
    INDEX_64: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """``grad[r, :] *= scale[r]`` in place for BLOCK_ROWS rows; a tile whose scales are all 1 is left untouched."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    scale = tl.load(scale_ptr + row_start(rows, size1, size2, stride_s0, stride_s1, stride_s2), mask=row_mask,
                    other=1.0).to(tl.float32)
    g_row = row_start(rows, size1, size2, stride_g0, stride_g1, stride_g2)
    cols0 = tl.arange(0, BLOCK_COLS)
    if INDEX_64:
        cols0 = cols0.to(tl.int64)
    if tl.sum((scale != 1.0).to(tl.int32), 0) != 0:  # loss.backward() passes exactly 1: nothing to do
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + cols0
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            offsets = g_row[:, None] + (cols * stride_gcol)[None, :]
            g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
            tl.store(grad_ptr + offsets, (g * scale[:, None]).to(grad_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


def cross_entropy_launch_config(n_rows: int, n_cols: int) -> RowConfig:
    """The tile of a cross-entropy over ``n_rows`` rows of ``n_cols`` classes.

    A row of up to :data:`MAX_BLOCK` columns is one block (loaded once); a longer one is walked in
    chunks of ``MAX_BLOCK``. Short rows are stacked until a tile holds :data:`TILE_ELEMENTS`.
    """
    block = min(next_power_of_2(n_cols), MAX_BLOCK)
    rows = max(1, min(TILE_ELEMENTS // block, next_power_of_2(n_rows)))
    return RowConfig(block_cols=block, block_rows=rows, chunked=n_cols > block,
                     num_warps=_launch.num_warps_for(rows * block), rows_per_program=rows)


# ----------------------------------------------------------------------------------------------
# Shapes and checks
# ----------------------------------------------------------------------------------------------


def _class_last(t: torch.Tensor) -> torch.Tensor:
    """The logits (or a tensor of their shape) as a view with the class dim last and at least one row dim."""
    if t.dim() == 1:
        return t.unsqueeze(0)
    return t.movedim(1, -1) if t.dim() > 2 else t


def _expected_target_shape(logits: torch.Tensor) -> tuple[int, ...]:
    if logits.dim() == 1:
        return ()
    return (logits.shape[0], *logits.shape[2:])


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_args(logits: object, target: object, weight: object, ignore_index: object, reduction: object,
                label_smoothing: object, softcap: object, z_loss: object, return_z_loss: object) -> None:
    check_tensor(_OP, "logits", logits)
    check_tensor(_OP, "target", target)
    check_float_dtype(_OP, "logits", logits)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{_OP}: target must be int64 (or int32) class indices, got {target.dtype}"
            + (" (class-probability targets are not supported; pass the class index of each row)"
               if target.is_floating_point() else "")
        )
    check_same_device(_OP, "logits", logits, "target", target)
    if logits.dim() == 0:
        raise ValueError(f"{_OP}: logits must have a class dim: (V,), (N, V) or (N, V, d1, ...), got a 0-d tensor")
    expected = _expected_target_shape(logits)
    if tuple(target.shape) != expected:
        layout = {1: "(V,) logits take a 0-d target", 2: "(N, V) logits take an (N,) target"}.get(
            logits.dim(), "(N, V, d1, ...) logits take an (N, d1, ...) target")
        raise ValueError(
            f"{_OP}: target must have shape {expected} for logits of shape {tuple(logits.shape)} "
            f"({layout}; the class dim is dim 1), got {tuple(target.shape)}"
        )
    n_classes = logits.shape[0] if logits.dim() == 1 else logits.shape[1]
    if n_classes == 0:
        raise ValueError(f"{_OP}: logits must have at least one class, got shape {tuple(logits.shape)}")
    if weight is not None:
        check_tensor(_OP, "weight", weight)
        check_float_dtype(_OP, "weight", weight)
        check_same_device(_OP, "logits", logits, "weight", weight)
        if tuple(weight.shape) != (n_classes,):
            raise ValueError(f"{_OP}: weight must hold one weight per class, shape ({n_classes},), "
                             f"got {tuple(weight.shape)}")
    check_loss_options(_OP, ignore_index, reduction, label_smoothing, softcap, z_loss)
    check_bool(_OP, "return_z_loss", return_z_loss)


def check_loss_options(op: str, ignore_index: object, reduction: object, label_smoothing: object, softcap: object,
                       z_loss: object) -> None:
    """The scalar options shared with ``kernel_ladder.fused_linear_cross_entropy``; errors name ``op``."""
    # torch.compile passes a Python int that it has made dynamic as a SymInt.
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__}")
    check_choice(op, "reduction", reduction, REDUCTIONS)
    if not _is_real(label_smoothing):
        raise TypeError(f"{op}: label_smoothing must be a float in [0, 1], got {type(label_smoothing).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {float(label_smoothing)}")
    if softcap is not None:
        if not _is_real(softcap):
            raise TypeError(f"{op}: softcap must be None or a positive float, got {type(softcap).__name__}")
        if not 0 < float(softcap) < math.inf:  # comparisons, not math.isfinite: a traced float may be symbolic
            raise ValueError(f"{op}: softcap must be a positive, finite float (Gemma-2 uses 30.0), got {softcap}")
    if not _is_real(z_loss):
        raise TypeError(f"{op}: z_loss must be a float >= 0, got {type(z_loss).__name__}")
    if not 0 <= float(z_loss) < math.inf:
        raise ValueError(f"{op}: z_loss must be a finite float >= 0 (PaLM uses 1e-4), got {z_loss}")


def _loss_shape(logits: torch.Tensor, reduction: str) -> tuple[int, ...]:
    return _expected_target_shape(logits) if reduction == "none" else ()


def _z_shape(logits: torch.Tensor, reduction: str, return_z_loss: bool) -> tuple[int, ...]:
    return _loss_shape(logits, reduction) if return_z_loss else (0,)


def _empty_grad(logits: torch.Tensor, compute_grad: bool) -> torch.Tensor:
    """The gradient buffer: the logits' shape, dtype and layout, like ``torch.empty_like``; empty without one.

    ``torch.empty_like``'s strides (the logits' own when they are dense, else their dim order,
    packed) are taken from a meta tensor; the buffer itself comes from ``_launch.empty`` (the
    poisoning hook) with its dims in that order, permuted back. A transposed or channels-last
    input gets a gradient of its own layout: no transposed writes.
    """
    if not compute_grad:
        return _launch.empty((0,), logits.dtype, logits.device)
    strides = torch.empty_like(logits, device="meta").stride()
    order = sorted(range(logits.dim()), key=lambda d: (-strides[d], d))
    buffer = _launch.empty([logits.shape[d] for d in order], logits.dtype, logits.device)
    return buffer.permute([order.index(d) for d in range(logits.dim())])


def _target_rows(target: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """The targets as a tensor of the row shape, walkable by the one-program targets kernel.

    That kernel walks at most three leading dims; targets whose dims do not merge into three (a
    permuted 4-d target) are copied contiguous first — the one copy this op can make, of one
    integer per row.
    """
    t = target.reshape(lead)
    sizes, _ = coalesce_dims(t.shape, [t.stride()])
    return t if len(sizes) <= 3 else t.contiguous()


def assert_targets(check: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise if the targets kernel found a target outside ``[0, V)`` (``check[0] == 0``).

    By the value-check policy (:func:`kernel_ladder._validate.check_values`): on the CPU at once; on CUDA a
    device-side assertion, unless the host check was asked for.
    """
    message = f"{_OP}: target must hold class indices in [0, {n_classes}) or ignore_index={ignore_index}"

    def error() -> str:
        low, high = check[1:].tolist()  # only on the way to the error
        bad = low if low < 0 else high
        return (f"{message}, got {bad} (targets range over [{low}, {high}]). Check the labels against the "
                "vocabulary size, or pass the padding label as ignore_index")

    check_values((check,), lambda: check[0], message, error)


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def launch_targets(target_rows, weight, check, scales, n_classes, ignore_index, mean, class_weight_sum) -> None:
    t = target_rows.reshape(-1) if target_rows.dim() == 0 else target_rows
    sizes, (strides,) = coalesce_dims(t.shape, [t.stride()])
    sizes = [1] * (3 - len(sizes)) + sizes
    strides = [0] * (3 - len(strides)) + strides
    w = weight if weight is not None else scales  # without weights: never read
    cross_entropy_targets_kernel[(1,)](
        t, w, check, scales, ignore_index, t.numel(), n_classes, sizes[1], sizes[2], *strides,
        w.stride(0) if weight is not None else 0,
        HAS_WEIGHT=weight is not None, CLASS_WEIGHT_SUM=class_weight_sum, MEAN=mean, BLOCK=SCAN_BLOCK,
    )


def launch_forward(logits, target_rows, weight, scales, loss_rows, z_rows, grad, ignore_index, label_smoothing,
                    softcap, z_loss) -> None:
    x = _class_last(logits)
    n_classes = x.shape[-1]
    lead = x.shape[:-1]
    compute_grad = grad.numel() > 0
    return_z = z_rows is not None
    z_out = z_rows if return_z else loss_rows  # without the z terms: never written

    def per_row(t):
        return t.view(lead).unsqueeze(-1).expand(x.shape)

    operands = [x, target_rows.unsqueeze(-1).expand(x.shape), per_row(loss_rows), per_row(z_out)]
    operands.append(_class_last(grad) if compute_grad else x)  # without a gradient: never written
    w = weight if weight is not None else scales  # without weights: never read
    stride_w = weight.stride(0) if weight is not None else 0
    for launch in plan_rows(operands):
        config = cross_entropy_launch_config(launch.n_rows, n_classes)
        grid = (config.programs(launch.n_rows),)
        cross_entropy_forward_kernel[grid](
            *launch.tensors[:4], launch.tensors[4], w, scales,
            ignore_index, float(label_smoothing), float(softcap or 1.0), float(z_loss), *launch.args(), stride_w,
            COMPUTE_GRAD=compute_grad, SMOOTHING=label_smoothing != 0.0, HAS_WEIGHT=weight is not None,
            SOFTCAP=softcap is not None, Z_LOSS=z_loss != 0.0, RETURN_Z=return_z, CHUNKED=config.chunked,
            INDEX_64=launch.index_64, BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols,
            num_warps=config.num_warps,
        )


@torch.library.custom_op("kernel_ladder::cross_entropy", mutates_args=())
def _cross_entropy_op(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, reduction: str,
    label_smoothing: float, softcap: float | None, z_loss: float, return_z_loss: bool, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z term or an empty tensor, the gradient buffer or an empty one, an empty anchor)``.

    The anchor is a 0-element output that autograd links to this op's node: the backward saves it
    to give a gradient computed under ``create_graph=True`` a graph whose backward raises.
    """
    _check_args(logits, target, weight, ignore_index, reduction, label_smoothing, softcap, z_loss, return_z_loss)
    runtime.require_launchable(_OP, logits, target, *([weight] if weight is not None else []))
    device = logits.device
    x = _class_last(logits)
    n_classes = x.shape[-1]
    lead = tuple(x.shape[:-1])
    n_rows = math.prod(lead)
    mean = reduction == "mean"
    target_rows = _target_rows(target, lead)

    check = _launch.empty((CHECK_SLOTS,), torch.int64, device)
    scales = _launch.empty((SCALE_SLOTS,), torch.float32, device)
    launch_targets(target_rows, weight, check, scales, n_classes, ignore_index, mean,
                    class_weight_sum=weight is not None and label_smoothing != 0.0)
    assert_targets(check, n_classes, ignore_index)

    if reduction == "none":
        loss_rows = _launch.empty(lead, logits.dtype, device)
        z_rows = _launch.empty(lead, logits.dtype, device) if return_z_loss else None
    else:
        loss_rows = _launch.empty((n_rows,), torch.float32, device)
        z_rows = _launch.empty((n_rows,), torch.float32, device) if return_z_loss else None
    grad = _empty_grad(logits, compute_grad)
    launch_forward(logits, target_rows, weight, scales, loss_rows, z_rows, grad, ignore_index, label_smoothing,
                    softcap, z_loss)
    if reduction == "none":
        loss = loss_rows.view(_loss_shape(logits, reduction))
        z = z_rows.view(loss.shape) if return_z_loss else _launch.empty((0,), logits.dtype, device)
    else:
        loss = _launch.empty((), logits.dtype, device)
        z = _launch.empty(() if return_z_loss else (0,), logits.dtype, device)
        cross_entropy_reduce_kernel[(1,)](
            loss_rows, z_rows if return_z_loss else loss_rows, scales, loss, z, n_rows,
            RETURN_Z=return_z_loss, MEAN=mean, BLOCK=SCAN_BLOCK,
        )
    anchor = _launch.empty((0,), torch.float32, device)
    return loss, z, grad, anchor


@_cross_entropy_op.register_fake
def _cross_entropy_fake(logits, target, weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                        return_z_loss, compute_grad):
    _check_args(logits, target, weight, ignore_index, reduction, label_smoothing, softcap, z_loss, return_z_loss)
    loss = logits.new_empty(_loss_shape(logits, reduction))
    z = logits.new_empty(_z_shape(logits, reduction, return_z_loss))
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty((0,))  # _empty_grad's layout
    return loss, z, grad, logits.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("kernel_ladder::cross_entropy_backward", mutates_args=("grad_logits",))
def _cross_entropy_backward_op(grad_logits: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """Scale the forward's gradient buffer by ``grad_loss`` in place (per row if ``grad_loss`` has rows)."""
    op = f"{_OP} (backward)"
    check_float_dtype(op, "grad_loss", grad_loss)
    check_same_device(op, "grad_logits", grad_logits, "grad_loss", grad_loss)
    runtime.require_launchable(op, grad_logits, grad_loss)
    g = _class_last(grad_logits)
    lead = g.shape[:-1]
    if grad_loss.dim() == 0 or grad_logits.dim() == 1:
        scale = grad_loss.reshape(()).expand(g.shape)
    else:
        scale = grad_loss.unsqueeze(-1).expand(g.shape)
    if tuple(scale.shape[:-1]) != tuple(lead):
        raise ValueError(f"{op}: grad_loss of shape {tuple(grad_loss.shape)} does not match rows {tuple(lead)}")
    for launch in plan_rows([g, scale]):
        config = cross_entropy_launch_config(launch.n_rows, g.shape[-1])
        grid = (config.programs(launch.n_rows),)
        cross_entropy_backward_kernel[grid](
            *launch.tensors, *launch.args(), INDEX_64=launch.index_64, BLOCK_ROWS=config.block_rows,
            BLOCK_COLS=config.block_cols, num_warps=config.num_warps,
        )


@_cross_entropy_backward_op.register_fake
def _cross_entropy_backward_fake(grad_logits, grad_loss) -> None:
    return None


#: The inputs of ``kernel_ladder::cross_entropy`` after (logits, target): none of them gets a gradient.
_NO_GRADIENTS = (None,) * 9


def _setup_context(ctx, inputs, output) -> None:
    *_, compute_grad = inputs
    _, z, grad, anchor = output
    ctx.compute_grad = compute_grad
    ctx.backward_ran = False
    ctx.save_for_backward(grad, anchor)
    ctx.mark_non_differentiable(z, grad)
    ctx.set_materialize_grads(False)  # no N x V zeros for the buffer's (absent) gradient


def _backward(ctx, grad_loss, _grad_z, _grad_of_grad_buffer, _grad_anchor):
    if not ctx.compute_grad:
        raise RuntimeError(
            f"{_OP}: the forward ran with compute_grad=False, so no gradient was computed; call "
            "kernel_ladder.cross_entropy (it decides from logits.requires_grad and grad mode)"
        )
    if ctx.backward_ran:
        raise RuntimeError(
            f"{_OP}: backward through the same loss twice (retain_graph=True) is not supported: the "
            "gradient computed in the forward is scaled in place by the first backward. Compute the "
            "loss again for each backward"
        )
    ctx.backward_ran = True
    grad, anchor = ctx.saved_tensors
    if grad_loss is None:  # the loss took no part in what is being differentiated
        return (None, *_NO_GRADIENTS)
    if tracing(grad, grad_loss):
        # A traced backward (torch.compile, AOTAutograd) must not mutate a saved activation: scale
        # out of place, which Inductor can do in the dead buffer's memory.
        g = _class_last(grad)
        scale = grad_loss.reshape(()) if grad_loss.dim() == 0 or grad.dim() == 1 else grad_loss.unsqueeze(-1)
        return (_unmove(g * scale, grad), *_NO_GRADIENTS)
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        _cross_entropy_backward_op(grad, grad_loss)
    if create_graph:
        # A first-order backward merely recorded (create_graph=True) works; differentiating the
        # gradient it returns raises the op's error.
        grad = recorded_gradient(f"{_OP} (backward)", grad, anchor, grad_loss)
    return (grad, *_NO_GRADIENTS)


def tracing(*tensors: torch.Tensor) -> bool:
    """Whether the backward is being traced (by Dynamo, AOTAutograd or make_fx) rather than run."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 (imported by the tracers already)
    from torch.fx.experimental.proxy_tensor import get_proxy_mode  # noqa: PLC0415

    return get_proxy_mode() is not None or any(is_fake(t) for t in tensors)


def _unmove(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dim() == 1:
        return g.squeeze(0)
    return g.movedim(-1, 1) if like.dim() > 2 else g


_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``logits`` against class indices, like ``torch.nn.functional.cross_entropy``.

    Args:
        logits: float32, float16 or bfloat16 scores, ``(N, V)``, ``(V,)``, or ``(N, V, d1, ...)``
            with the classes in dim 1 (like torch); any strides (not copied). Vocabularies of any
            size: the softmax is never stored.
        target: int64 (or int32) class indices of shape ``(N,)``, ``()`` or ``(N, d1, ...)``; each a
            class in ``[0, V)`` or ``ignore_index`` (checked on the device, without a host
            synchronization: on CUDA a bad target is a device-side assertion, see the module docstring).
        ignore_index: rows with this target add nothing to the loss or the gradient; ``"mean"``
            averages over the others (all ignored: NaN, like torch).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row losses, of ``target``'s shape).
        label_smoothing: ``eps`` in [0, 1]: the target distribution is ``(1 - eps)`` one-hot plus
            ``eps / V`` everywhere (torch's definition).
        weight: per-class weights ``(V,)`` (float32/16, bf16, whatever the logits' dtype; any stride),
            torch's ``weight``: row ``i``'s loss is scaled by ``weight[target_i]`` (the smoothing term
            by each class's weight), and ``"mean"`` divides by the non-ignored rows' target weights
            summed. Not differentiable (as in torch): a weight that requires a gradient is refused.
        softcap: Gemma-2's final-logit soft-capping: the loss is computed on ``softcap *
            tanh(logits / softcap)`` (in the kernel, never stored), with the gradient through it.
        z_loss: PaLM's auxiliary loss: ``z_loss * logsumexp(row)**2`` is added for each non-ignored row,
            reduced like the loss — except that ``"mean"`` divides it by the number of non-ignored rows,
            unweighted (as Liger-Kernel does) — with its gradient.
        return_z_loss: also return the z-loss term alone, reduced the same way, for logging. It is
            not differentiable (its gradient is already in the loss's).

    Returns:
        The loss in the logits' dtype (computed in float32), or ``(loss, z_loss_term)`` with
        ``return_z_loss``. Differentiable with respect to ``logits``: when ``logits.requires_grad``
        and grad mode is on, the forward also writes the gradient (one extra pass for long rows),
        and the backward only scales it by the incoming gradient, in place
        (``kernel_ladder::cross_entropy_backward``), so one backward per loss, and no double backward.
    """
    if not schema_types(tensors=(logits, target), optional_tensors=(weight,), reals=(label_smoothing, z_loss),
                        optional_reals=(softcap,), ints=(ignore_index,), flags=(return_z_loss,), strings=(reduction,)):
        _check_args(logits, target, weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                    return_z_loss)  # the op checks values
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{_OP}: weight is not differentiable (as in torch's cross_entropy); pass weight.detach()")
    compute_grad = bool(logits.requires_grad and torch.is_grad_enabled())
    loss, z, _, _ = _cross_entropy_op(
        logits, target, weight, int(ignore_index), reduction, float(label_smoothing),
        None if softcap is None else float(softcap), float(z_loss), bool(return_z_loss), compute_grad,
    )
    return (loss, z) if return_z_loss else loss
