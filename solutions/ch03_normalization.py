"""Solutions to chapter 03, normalization.

The four exercises of ``chapters/03_normalization/03_normalization.ipynb``, written for reading:

* :func:`rms_norm_kernel` — RMSNorm forward: one row per program, the reduction (mean of squares)
  and the elementwise pass (scale by ``rstd · w``) fused, ``rstd`` saved for the backward;
* :func:`layer_norm_kernel` — LayerNorm forward: mean, then the *centred* variance from the row
  already in registers (two passes over registers, one over memory), mean and ``rstd`` saved;
* :func:`layer_norm_dx_kernel` — the LayerNorm input gradient, one row per program, from the
  saved statistics: ``dx = rstd · (w·g − mean(w·g) − x̂ · mean(w·g·x̂))``;
* :func:`column_sum_kernel` — the second stage of the weight-gradient reduction: sum a
  ``(n_partials, N)`` fp32 buffer over its rows.

Below them, code the chapter *gives* (not exercises): the first stage of the weight-gradient
reduction (:func:`weight_grad_partial_kernel`), the atomic version it replaces
(:func:`weight_grad_atomic_kernel`, for counting), the RMSNorm input gradient
(:func:`rms_norm_dx_kernel`), and Python launchers that string the kernels into whole forward and
backward passes for 2-D inputs with contiguous rows (:func:`rms_norm`, :func:`layer_norm`,
:func:`rms_norm_backward`, :func:`layer_norm_backward`, :func:`weight_grad_two_stage`,
:func:`weight_grad_atomic`). The production versions (any shape and strides, autograd, one fused
backward pass) are ``kernel_ladder.rms_norm``, ``kernel_ladder.layer_norm`` and ``kernel_ladder.add_rms_norm``.

At the end, givens of the checks: the traffic verdicts of the LayerNorm forward and the column sum
(:func:`layer_norm_traffic`, :func:`column_sum_traffic`), which the notebook's checks and
``tests/test_solutions_ch03.py`` both pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    # exercises
    "rms_norm_kernel",
    "layer_norm_kernel",
    "layer_norm_dx_kernel",
    "column_sum_kernel",
    # given
    "rms_norm_dx_kernel",
    "weight_grad_partial_kernel",
    "weight_grad_atomic_kernel",
    "row_block",
    "row_warps",
    "default_partials",
    "rms_norm",
    "layer_norm",
    "rms_norm_backward",
    "layer_norm_backward",
    "weight_grad_two_stage",
    "weight_grad_atomic",
    "column_sum",
    "COLUMN_BLOCK_M",
    "COLUMN_BLOCK_N",
    "layer_norm_traffic",
    "column_sum_traffic",
]


# ----------------------------------------------------------------------------------------------
# Exercises
# ----------------------------------------------------------------------------------------------


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, row_stride, n_cols, eps, BLOCK: tl.constexpr):
    """RMSNorm of one row: ``out = x · rstd · w`` with ``rstd = 1 / sqrt(mean(x²) + eps)``.

    Teaches the row kernel: program ``row`` loads its whole row into registers in one block
    (``BLOCK ≥ n_cols``, masked), reduces it (``tl.sum``), and reuses the same registers for the
    elementwise pass — one read of ``x``, one write of ``out``: the ideal traffic. Padding lanes
    load 0, which adds nothing to the sum of squares; the mean divides by ``n_cols``, never by
    ``BLOCK``. ``eps`` goes *inside* the square root. The row offset is computed in int64
    (``rows × row_stride`` passes 2³¹ for large activations). ``out`` is contiguous; ``x`` may
    have any row stride.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_square + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * rstd * w
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)  # fp32: the backward needs it, and it is 4 bytes per row


@triton.jit
def layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols, eps, BLOCK: tl.constexpr
):
    """LayerNorm of one row: ``out = (x − mean) · rstd · w + b``, ``rstd = 1 / sqrt(var + eps)``.

    Teaches the two-pass variance at the cost of one: the row is in registers, so the mean is
    computed first and the variance from the *centred* values, ``mean((x − mean)²)`` — exact where
    the one-pass ``mean(x²) − mean²`` cancels catastrophically for rows with a large offset. The
    padding lanes must be zeroed after centring (``0 − mean`` is not 0), and the variance is the
    biased one (divide by ``n_cols``, as torch's LayerNorm does).
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = centred * rstd * w + b
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def layer_norm_dx_kernel(
    grad_out_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, row_stride, n_cols, BLOCK: tl.constexpr
):
    """The LayerNorm input gradient of one row from the saved mean and rstd.

    Teaches the backward of a normalization: with ``x̂ = (x − mean)·rstd`` and ``ĝ = w·g``,
    ``dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ·x̂))``. The two row means are the gradient flowing
    through the mean and through the variance; each is one more ``tl.sum`` over the row already in
    registers. Nothing but ``mean`` and ``rstd`` (8 bytes per row) was saved by the forward: ``x̂``
    is recomputed. ``grad_out`` and ``x`` share ``row_stride``; ``dx`` is contiguous.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
    g_hat = w * g  # 0 in the padding lanes (w and g loaded as 0 there)
    mean_g_hat = tl.sum(g_hat, axis=0) / n_cols  # through the mean
    mean_g_hat_x_hat = tl.sum(g_hat * x_hat, axis=0) / n_cols  # through the variance
    dx = (g_hat - mean_g_hat - x_hat * mean_g_hat_x_hat) * rstd
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def column_sum_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[j] = Σ_i partial[i, j]`` over a contiguous ``(n_rows, n_cols)`` buffer.

    Teaches the second stage of a two-stage reduction: each program owns ``BLOCK_N`` columns and
    walks down all rows in ``BLOCK_M``-row tiles, accumulating a ``(BLOCK_M, BLOCK_N)`` fp32 tile
    and reducing it once at the end. No two programs write the same output and the order of the
    additions is fixed by the loop, so the result is the same bit for bit on every run. Neighbouring
    lanes read neighbouring columns (coalesced); both the row and the column tails are masked.
    """
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < n_rows) & col_mask[None, :]
        offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        acc += tl.load(partial_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Given by the chapter: the rest of the backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def rms_norm_dx_kernel(grad_out_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, row_stride, n_cols, BLOCK: tl.constexpr):
    """The RMSNorm input gradient of one row: ``dx = rstd · (ĝ − x̂ · mean(ĝ·x̂))``, ``x̂ = x·rstd``.

    LayerNorm's formula without the mean term: RMSNorm subtracts no mean, so no gradient flows
    through one.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = x * rstd
    g_hat = w * g
    mean_g_hat_x_hat = tl.sum(g_hat * x_hat, axis=0) / n_cols
    dx = (g_hat - x_hat * mean_g_hat_x_hat) * rstd
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def weight_grad_partial_kernel(
    grad_out_ptr, x_ptr, mean_ptr, rstd_ptr, dw_partial_ptr, db_partial_ptr,
    n_rows, n_cols, row_stride, rows_per_program,
    HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Stage 1 of ``dw = Σ_rows g·x̂`` (and ``db = Σ_rows g``): one partial row per program.

    Program ``p`` walks its ``rows_per_program`` consecutive rows, accumulates ``g·x̂`` (and ``g``)
    in fp32 registers, and writes the sums to row ``p`` of the ``(n_programs, n_cols)`` fp32
    buffers: no atomics, no two programs on one address. ``HAS_MEAN`` is LayerNorm's
    ``x̂ = (x − mean)·rstd``; without it, RMSNorm's ``x̂ = x·rstd``.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        if row < n_rows:
            start = row.to(tl.int64) * row_stride
            g = tl.load(grad_out_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            if HAS_MEAN:
                x_hat = (x - tl.load(mean_ptr + row)) * rstd
            else:
                x_hat = x * rstd
            dw += g * x_hat  # g is 0 in the padding lanes
            if HAS_BIAS:
                db += g
    out = pid.to(tl.int64) * n_cols + cols
    tl.store(dw_partial_ptr + out, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + out, db, mask=mask)


@triton.jit
def weight_grad_atomic_kernel(
    grad_out_ptr, x_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_cols, row_stride,
    HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dw += g·x̂`` (and ``db += g``) for one row, with fp32 atomics straight into the result.

    The design the two-stage reduction replaces, kept for counting: every row's program adds its
    ``n_cols`` contributions to the *same* ``n_cols`` addresses, so each address receives one atomic
    per row, in whatever order the hardware schedules them.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    if HAS_MEAN:
        x_hat = (x - tl.load(mean_ptr + row)) * rstd
    else:
        x_hat = x * rstd
    tl.atomic_add(dw_ptr + cols, g * x_hat, mask=mask)
    if HAS_BIAS:
        tl.atomic_add(db_ptr + cols, g, mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers (2-D inputs whose rows are contiguous; the production ops take any shape and strides)
# ----------------------------------------------------------------------------------------------

#: Tile of the column-sum kernel: 16 partial rows × 128 columns per step.
COLUMN_BLOCK_M, COLUMN_BLOCK_N = 16, 128


def row_block(n_cols: int) -> int:
    """The block that holds a whole row: the next power of two ≥ ``n_cols``."""
    return triton.next_power_of_2(max(int(n_cols), 1))


def row_warps(block: int) -> int:
    """Warps for a whole-row block on a GPU: about 1024 elements per warp, 4 to 16 warps."""
    return min(16, max(4, block // 1024))


def default_partials(n_rows: int, device: torch.device) -> int:
    """How many partial rows stage 1 writes: a few per SM on a GPU, 8 in the interpreter."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 8  # each program costs ~1 ms in the interpreter
    return max(1, min(n_rows, target))


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"solutions.ch03: {name} must be 2-D with contiguous rows, got shape "
                         f"{tuple(x.shape)} strides {tuple(x.stride())}")
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             return_rstd: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / sqrt(mean(x², -1) + eps) · weight`` with :func:`rms_norm_kernel`: one launch.

    Returns the output (x's dtype, contiguous), and with ``return_rstd`` also the fp32 ``rstd``.
    """
    _rows(x, "x")
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = row_block(n_cols)
    if n_rows:
        rms_norm_kernel[(n_rows,)](x, weight, out, rstd, x.stride(0), n_cols, eps, BLOCK=block,
                                   num_warps=row_warps(block))
    return (out, rstd) if return_rstd else out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               return_stats: bool = False):
    """LayerNorm over the last dim with :func:`layer_norm_kernel`: one launch.

    Returns the output, and with ``return_stats`` also the fp32 ``mean`` and ``rstd`` per row.
    """
    _rows(x, "x")
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = row_block(n_cols)
    if n_rows:
        layer_norm_kernel[(n_rows,)](x, weight, bias, out, mean, rstd, x.stride(0), n_cols, eps,
                                     BLOCK=block, num_warps=row_warps(block))
    return (out, mean, rstd) if return_stats else out


def column_sum(partial: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum a contiguous ``(P, N)`` buffer over its rows with :func:`column_sum_kernel`."""
    n_rows, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype or partial.dtype, device=partial.device)
    column_sum_kernel[(triton.cdiv(n_cols, COLUMN_BLOCK_N),)](
        partial, out, n_rows, n_cols, BLOCK_M=COLUMN_BLOCK_M, BLOCK_N=COLUMN_BLOCK_N
    )
    return out


def weight_grad_two_stage(grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None,
                          rstd: torch.Tensor, dtype: torch.dtype, has_bias: bool,
                          n_partials: int | None = None):
    """``dw = Σ_rows g·x̂`` (and ``db = Σ_rows g``) in two stages: partial rows, then column sums.

    Returns ``(dw, db, dw_partial)`` (``db`` None without bias); the fp32 partial buffer is
    returned so the chapter can show its size.
    """
    n_rows, n_cols = x.shape
    n_partials = n_partials or default_partials(n_rows, x.device)
    rows_per_program = triton.cdiv(n_rows, n_partials)
    n_partials = triton.cdiv(n_rows, rows_per_program)  # no program without rows
    dw_partial = torch.empty((n_partials, n_cols), dtype=torch.float32, device=x.device)
    db_partial = torch.empty((n_partials, n_cols), dtype=torch.float32, device=x.device) if has_bias else dw_partial
    block = row_block(n_cols)
    weight_grad_partial_kernel[(n_partials,)](
        grad_out, x, mean if mean is not None else rstd, rstd, dw_partial, db_partial,
        n_rows, n_cols, x.stride(0), rows_per_program,
        HAS_MEAN=mean is not None, HAS_BIAS=has_bias, BLOCK=block, num_warps=row_warps(block),
    )
    dw = column_sum(dw_partial, dtype)
    db = column_sum(db_partial, dtype) if has_bias else None
    return dw, db, dw_partial


def weight_grad_atomic(grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None,
                       rstd: torch.Tensor, has_bias: bool):
    """The same sums with fp32 atomics, one program per row (returns fp32 ``(dw, db)``)."""
    n_rows, n_cols = x.shape
    dw = torch.zeros(n_cols, dtype=torch.float32, device=x.device)
    db = torch.zeros(n_cols, dtype=torch.float32, device=x.device) if has_bias else dw
    block = row_block(n_cols)
    weight_grad_atomic_kernel[(n_rows,)](
        grad_out, x, mean if mean is not None else rstd, rstd, dw, db, n_cols, x.stride(0),
        HAS_MEAN=mean is not None, HAS_BIAS=has_bias, BLOCK=block, num_warps=row_warps(block),
    )
    return dw, (db if has_bias else None)


def layer_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        mean: torch.Tensor, rstd: torch.Tensor):
    """``(dx, dw, db)`` of LayerNorm: the dx row kernel, stage 1, and two column sums (4 launches).

    ``grad_out`` and ``x`` must share their row stride.
    """
    _rows(x, "x")
    _rows(grad_out, "grad_out")
    if grad_out.stride(0) != x.stride(0) or grad_out.shape != x.shape:
        raise ValueError("solutions.ch03: grad_out and x must have the same shape and row stride")
    n_rows, n_cols = x.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block = row_block(n_cols)
    layer_norm_dx_kernel[(n_rows,)](grad_out, x, weight, mean, rstd, dx, x.stride(0), n_cols,
                                    BLOCK=block, num_warps=row_warps(block))
    dw, db, _ = weight_grad_two_stage(grad_out, x, mean, rstd, weight.dtype, has_bias=True)
    return dx, dw, db


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """``(dx, dw)`` of RMSNorm: the dx row kernel, stage 1, and a column sum (3 launches)."""
    _rows(x, "x")
    _rows(grad_out, "grad_out")
    if grad_out.stride(0) != x.stride(0) or grad_out.shape != x.shape:
        raise ValueError("solutions.ch03: grad_out and x must have the same shape and row stride")
    n_rows, n_cols = x.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block = row_block(n_cols)
    rms_norm_dx_kernel[(n_rows,)](grad_out, x, weight, rstd, dx, x.stride(0), n_cols,
                                  BLOCK=block, num_warps=row_warps(block))
    dw, _, _ = weight_grad_two_stage(grad_out, x, None, rstd, weight.dtype, has_bias=False)
    return dx, dw


# ----------------------------------------------------------------------------------------------
# Givens: the traffic verdicts (``check(..., traffic=...)``)
# ----------------------------------------------------------------------------------------------


def _traced_bytes(run) -> int:
    """The bytes the Triton launches of ``run()`` move (the ladder's top, traced on the same case)."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        run()
    return traced.bytes


def _layer_norm_ideal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> int:
    """x, weight and bias read once; out (x's shape and dtype), mean and rstd (fp32 per row) written once."""
    from utils.trace import ideal_bytes

    return ideal_bytes(x, weight, bias) + x.numel() * x.element_size() + 2 * 4 * x.shape[0]


def _layer_norm_top(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> int:
    return _traced_bytes(lambda: kernel_ladder.layer_norm(x, x.shape[-1], weight, bias, eps))


def _layer_norm_explain(reread: dict[str, float]) -> str | None:
    causes = []
    if reread.get("x", 0.0) > 1.05:
        causes.append(f"x is read {reread['x']:.0f} times, a pass per statistic and one for the output: the row "
                      "fits one block, so load it once and take the mean and the variance from registers")
    params = max(reread.get("weight", 0.0), reread.get("bias", 0.0))
    if params > 1.05:
        causes.append(f"weight and bias are loaded by each of the {params:.0f} row programs (on a GPU, L2 serves "
                      "all but the first): kernel_ladder.layer_norm gives a program several rows and loads them once")
    return "; ".join(causes) or None


def layer_norm_traffic():
    """The LayerNorm forward's verdict: every input read once, out, mean and rstd written once, against
    ``kernel_ladder.layer_norm``; the explanation names a re-read row and the per-row parameter loads."""
    from utils.exercises import Traffic

    return Traffic(ideal=_layer_norm_ideal, top=_layer_norm_top, explain=_layer_norm_explain)


def _column_sum_ideal(partial: torch.Tensor) -> int:
    from utils.trace import ideal_bytes

    return ideal_bytes(partial) + partial.shape[1] * partial.element_size()  # the buffer read once, a row written


def _column_sum_top(partial: torch.Tensor) -> int:
    from kernel_ladder.ops.norm import column_sum as library_column_sum

    return _traced_bytes(lambda: library_column_sum(partial, (partial.shape[1],), partial.dtype))


def _column_sum_explain(reread: dict[str, float]) -> str | None:
    factor = reread.get("partial", 0.0)
    if factor > 1.05:
        return (f"the partial buffer is read {factor:.0f} times: each program should own its columns and walk "
                "every row once, keeping the running sums in registers")
    return None


def column_sum_traffic():
    """The column sum's verdict: the partial buffer read once and the sums written once, against the
    second stage of ``kernel_ladder``'s weight-gradient reduction (``kernel_ladder.ops.norm.column_sum``)."""
    from utils.exercises import Traffic

    return Traffic(ideal=_column_sum_ideal, top=_column_sum_top, explain=_column_sum_explain)
