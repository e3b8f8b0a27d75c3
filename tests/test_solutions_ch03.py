"""Chapter 03's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (same launcher, same kind of cases), once with
the solution (SOLVED) and once per negative control: a plausible mistake the checker must reject
(eps outside the square root, dividing by BLOCK, the unbiased variance, the one-pass variance,
padding lanes not zeroed, row strides ignored or misapplied (caught only by the cases of
column slices), the missing mean term of the backward, a column sum that stops after
one tile, ...). Cases stay at a few programs each: the interpreter runs every program in Python.
The given (non-exercise) kernels — the RMSNorm dx kernel, both weight-gradient reductions and the
launchers — are compared with float64 autograd.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch03_normalization as solutions
from utils.aot import run_compiled
from utils.exercises import check
from utils.trace import trace

# The checker's verdicts (out-of-bounds diagnoses) and the atomics count need the interpreter; the
# launcher and compile tests run compiled on a GPU too.
interpreter = pytest.mark.interpreter

DEVICE = kernel_ladder.runtime.DEVICE
LAYER_NORM_EPS = 1e-5
BLOCK_M, BLOCK_N = 16, 128


# ----------------------------------------------------------------------------------------------
# Launchers, cases and references: the notebook's, parameterised by the kernel under test
# ----------------------------------------------------------------------------------------------


def rms_norm_launcher(kernel):
    def launch(x, weight, eps, out, rstd):
        n_rows, n_cols = x.shape
        kernel[(n_rows,)](x, weight, out, rstd, x.stride(0), n_cols, eps, BLOCK=triton.next_power_of_2(n_cols))

    return launch


def layer_norm_launcher(kernel):
    def launch(x, weight, bias, eps, out, mean, rstd):
        n_rows, n_cols = x.shape
        kernel[(n_rows,)](x, weight, bias, out, mean, rstd, x.stride(0), n_cols, eps,
                          BLOCK=triton.next_power_of_2(n_cols))

    return launch


def layer_norm_dx_launcher(kernel):
    def launch(grad_out, x, weight, dx):
        n_rows, n_cols = x.shape
        x32 = x.float()  # the statistics the forward saved, in fp32
        mean = x32.mean(-1)
        rstd = torch.rsqrt(x32.var(-1, correction=0) + LAYER_NORM_EPS)
        kernel[(n_rows,)](grad_out, x, weight, mean, rstd, dx, x.stride(0), n_cols,
                          BLOCK=triton.next_power_of_2(n_cols))

    return launch


def column_sum_launcher(kernel):
    def launch(partial, out):
        n_rows, n_cols = partial.shape
        kernel[(triton.cdiv(n_cols, BLOCK_N),)](partial, out, n_rows, n_cols, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    return launch


def _randn(gen, *shape, scale=1.0, offset=0.0):
    return offset + scale * torch.randn(*shape, generator=gen, device=gen.device)


def rms_norm_cases(gen: torch.Generator) -> list:
    cases = []
    for n_rows, n_cols, dtype, scale, eps in [
        (6, 1000, torch.float32, 1.0, 1e-6),  # BLOCK 1024: 24 padding lanes
        (3, 4096, torch.bfloat16, 1.0, 1e-6),
        (4, 777, torch.float16, 1.0, 1e-6),
        (5, 300, torch.float32, 1e-3, 1e-5),  # mean(x²) ~ 1e-6 < eps: where eps goes matters
        (1, 1, torch.float32, 1.0, 1e-6),
    ]:
        x = _randn(gen, n_rows, n_cols, scale=scale)
        if scale < 1:
            x[0] = 0.0  # a row of zeros: rstd = 1/sqrt(eps), out = 0
        cases.append((x.to(dtype), _randn(gen, n_cols).to(dtype), eps))
    wide = _randn(gen, 4, 1500)  # rows 1500 apart in memory, 1000 used: x.stride(0) != n_cols
    cases.append((wide[:, 200:1200], _randn(gen, 1000), 1e-6))
    return [tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case) for case in cases]


def rms_norm_reference(x, weight, eps):
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    return x * rstd[:, None] * weight, rstd.float()  # rstd stays fp32 whatever x's dtype


def layer_norm_cases(gen: torch.Generator) -> list:
    cases = []
    for n_rows, n_cols, dtype, offset in [
        (6, 1000, torch.float32, 0.0),
        (3, 4096, torch.bfloat16, 0.0),
        (4, 7, torch.float32, 0.0),  # short rows: the variance's divisor shows
        (3, 777, torch.float16, 2.0),  # a mean: padding lanes left at 0 - mean would count
    ]:
        x = _randn(gen, n_rows, n_cols, offset=offset)
        w, b = _randn(gen, n_cols), _randn(gen, n_cols)
        cases.append((x.to(dtype), w.to(dtype), b.to(dtype), LAYER_NORM_EPS))
    wide = _randn(gen, 4, 1500)
    cases.append((wide[:, 200:1200], _randn(gen, 1000), _randn(gen, 1000), LAYER_NORM_EPS))
    return [tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case) for case in cases]


def large_mean_cases(gen: torch.Generator) -> list:
    # rows with mean ±1000 and standard deviation 1: mean(x²) − mean² cancels in fp32
    cases = []
    for n_rows, n_cols, offset in [(4, 1000, 1000.0), (3, 300, -500.0)]:
        x = _randn(gen, n_rows, n_cols, offset=offset)
        cases.append((x, _randn(gen, n_cols), _randn(gen, n_cols), LAYER_NORM_EPS))
    return [tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case) for case in cases]


# fp32 itself is ~1e-4 off here (the rounding of a mean of 1000 is eps·1000 ≈ 6e-5 against a
# standard deviation of 1); the one-pass formula is off by percent.
LARGE_MEAN_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}


def layer_norm_reference(x, weight, bias, eps):
    mean = x.mean(-1)
    rstd = torch.rsqrt(x.var(-1, correction=0) + eps)
    out = (x - mean[:, None]) * rstd[:, None] * weight + bias
    return out, mean.float(), rstd.float()


def layer_norm_dx_cases(gen: torch.Generator) -> list:
    cases = []
    for n_rows, n_cols, dtype, offset in [
        (6, 1000, torch.float32, 0.0),
        (3, 4096, torch.bfloat16, 0.0),
        (4, 7, torch.float32, 0.0),
        (4, 1000, torch.float16, 3.0),
    ]:
        x = _randn(gen, n_rows, n_cols, offset=offset)
        w = 1.0 + 0.5 * _randn(gen, n_cols)  # mean(w·g) is then clearly non-zero
        g = _randn(gen, n_rows, n_cols)
        cases.append(tuple(t.to(dtype).to(DEVICE) for t in (g, x, w)))
    wide = _randn(gen, 2, 4, 1500)  # g and x: 1000 of every 1500 columns, row_stride 1500 != n_cols
    g, x, w = wide[0][:, 200:1200], wide[1][:, 200:1200], 1.0 + 0.5 * _randn(gen, 1000)
    cases.append(tuple(t.to(DEVICE) for t in (g, x, w)))
    return cases


def layer_norm_dx_by_autograd(grad_out, x, weight):
    x = x.detach().requires_grad_()
    F.layer_norm(x, x.shape[-1:], weight, None, LAYER_NORM_EPS).backward(grad_out)
    return x.grad


def column_sum_cases(gen: torch.Generator) -> list:
    shapes = [(8, 1000), (37, 300), (1, 5), (50, 129)]
    return [(_randn(gen, *shape).to(DEVICE),) for shape in shapes]


def column_sum_reference(partial):
    return partial.sum(0)


# A sum of up to 50 fp32 terms of size ~1 can be ~1e-6 off near 0: more than fp32's default atol.
COLUMN_SUM_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def check_rms_norm(kernel):
    return check("ch03_normalization.rms_norm_kernel", rms_norm_launcher(kernel), rms_norm_reference,
                 rms_norm_cases, out=True)


def check_layer_norm(kernel):
    return check("ch03_normalization.layer_norm_kernel", layer_norm_launcher(kernel), layer_norm_reference,
                 layer_norm_cases, out=True, traffic=solutions.layer_norm_traffic())


def check_layer_norm_large_mean(kernel):
    return check("ch03_normalization.layer_norm_kernel", layer_norm_launcher(kernel), layer_norm_reference,
                 large_mean_cases, out=True, **LARGE_MEAN_TOLERANCE)


def check_layer_norm_dx(kernel):
    return check("ch03_normalization.layer_norm_dx_kernel", layer_norm_dx_launcher(kernel),
                 layer_norm_dx_by_autograd, layer_norm_dx_cases, out=True)


def check_column_sum(kernel):
    return check("ch03_normalization.column_sum_kernel", column_sum_launcher(kernel), column_sum_reference,
                 column_sum_cases, out=True, traffic=solutions.column_sum_traffic(), **COLUMN_SUM_TOLERANCE)


# ----------------------------------------------------------------------------------------------
# Wrong kernels (negative controls)
# ----------------------------------------------------------------------------------------------


@triton.jit
def rms_norm_stub_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, row_stride, n_cols, eps, BLOCK: tl.constexpr):
    pass


@triton.jit
def rms_norm_eps_outside_sqrt_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, row_stride, n_cols, eps,
                                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / (tl.sqrt(tl.sum(x * x, axis=0) / n_cols) + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_divides_by_block_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, row_stride, n_cols, eps,
                                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)  # the padding lanes counted as columns
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_ignores_row_stride_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, row_stride, n_cols, eps,
                                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)  # rows assumed packed
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_no_rstd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, row_stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_stub_kernel(x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols, eps,
                           BLOCK: tl.constexpr):
    pass


@triton.jit
def layer_norm_unbiased_kernel(x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols, eps,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / (n_cols - 1)  # torch.var's default, not LayerNorm's
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (centred * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def layer_norm_one_pass_variance_kernel(x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols,
                                        eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    var = tl.sum(x * x, axis=0) / n_cols - mean * mean  # cancels when |mean| >> std
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, ((x - mean) * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def layer_norm_padding_not_zeroed_kernel(x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols,
                                         eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centred = x - mean  # padding lanes hold 0 - mean, which the variance then sums
    var = tl.sum(centred * centred, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (centred * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def layer_norm_ignores_row_stride_kernel(x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols,
                                         eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)  # rows assumed packed
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (centred * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def layer_norm_dx_stub_kernel(grad_out_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, row_stride, n_cols,
                              BLOCK: tl.constexpr):
    pass


@triton.jit
def layer_norm_dx_no_mean_term_kernel(grad_out_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, row_stride,
                                      n_cols, BLOCK: tl.constexpr):
    # RMSNorm's formula: forgets the gradient that flows through the mean
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
    g_hat = w * g
    dx = (g_hat - x_hat * (tl.sum(g_hat * x_hat, axis=0) / n_cols)) * rstd
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_dx_forgets_weight_kernel(grad_out_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, row_stride,
                                        n_cols, BLOCK: tl.constexpr):
    # uses g where w·g belongs
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
    dx = (g - tl.sum(g, axis=0) / n_cols - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols)) * rstd
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_dx_ignores_row_stride_kernel(grad_out_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, row_stride,
                                            n_cols, BLOCK: tl.constexpr):
    # loads g and x as if their rows were packed: right on contiguous inputs only
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
    g_hat = w * g
    dx = (g_hat - tl.sum(g_hat, axis=0) / n_cols - x_hat * (tl.sum(g_hat * x_hat, axis=0) / n_cols)) * rstd
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_dx_strided_store_kernel(grad_out_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, row_stride,
                                       n_cols, BLOCK: tl.constexpr):
    # stores dx with the inputs' row stride, though dx is contiguous
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(grad_out_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
    g_hat = w * g
    dx = (g_hat - tl.sum(g_hat, axis=0) / n_cols - x_hat * (tl.sum(g_hat * x_hat, axis=0) / n_cols)) * rstd
    tl.store(dx_ptr + row * row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def column_sum_stub_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pass


@triton.jit
def column_sum_one_tile_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    # no loop: only the first BLOCK_M rows are summed
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tile = tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(tile, axis=0), mask=cols < n_cols)


@triton.jit
def column_sum_no_row_mask_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr):
    # the last tile of rows reads past the buffer's end
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        acc += tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=col_mask[None, :], other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def column_sum_sums_rows_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr):
    # the transposed reduction: sums along each row instead of down each column
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_M):
        inner = start + tl.arange(0, BLOCK_M)
        mask = (cols[:, None] < n_rows) & (inner[None, :] < n_cols)
        acc += tl.sum(tl.load(partial_ptr + cols[:, None] * n_cols + inner[None, :], mask=mask, other=0.0), axis=1)
    tl.store(out_ptr + cols, acc, mask=cols < n_cols)


@triton.jit
def layer_norm_three_passes_kernel(x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, row_stride, n_cols, eps,
                                   BLOCK: tl.constexpr):
    # right values, but the row is loaded again for the mean, the variance and the output
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    mean = tl.sum(tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32), axis=0) / n_cols
    centred = tl.where(mask, tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32) - mean,
                       0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, ((x - mean) * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


# ----------------------------------------------------------------------------------------------
# The exercises: solutions solved, wrong variants not
# ----------------------------------------------------------------------------------------------


@interpreter
def test_rms_norm_kernel_solved(capsys):
    assert check_rms_norm(solutions.rms_norm_kernel)
    assert "✅ SOLVED" in capsys.readouterr().out


@interpreter
@pytest.mark.parametrize("wrong, says", [
    (rms_norm_stub_kernel, "never written"),
    (rms_norm_eps_outside_sqrt_kernel, "wrong values"),
    (rms_norm_divides_by_block_kernel, "wrong values"),
    (rms_norm_ignores_row_stride_kernel, "wrong values"),
    (rms_norm_no_rstd_kernel, "never written"),
], ids=["stub", "eps-outside-sqrt", "divides-by-BLOCK", "ignores-row-stride", "no-rstd"])
def test_rms_norm_kernel_wrong_variants_not_solved(wrong, says, capsys):
    assert not check_rms_norm(wrong)
    out = capsys.readouterr().out
    assert "❌ NOT SOLVED" in out and says in out


@interpreter
def test_layer_norm_kernel_solved():
    assert check_layer_norm(solutions.layer_norm_kernel)
    assert check_layer_norm_large_mean(solutions.layer_norm_kernel)


@interpreter
@pytest.mark.parametrize("wrong, says", [
    (layer_norm_stub_kernel, "never written"),
    (layer_norm_unbiased_kernel, "wrong values"),
    (layer_norm_padding_not_zeroed_kernel, "wrong values"),
    (layer_norm_ignores_row_stride_kernel, "wrong values"),
], ids=["stub", "unbiased-variance", "padding-not-zeroed", "ignores-row-stride"])
def test_layer_norm_kernel_wrong_variants_not_solved(wrong, says, capsys):
    assert not check_layer_norm(wrong)
    assert says in capsys.readouterr().out


@interpreter
@pytest.mark.parametrize("wrong", [layer_norm_stub_kernel, layer_norm_one_pass_variance_kernel,
                                   layer_norm_padding_not_zeroed_kernel],
                         ids=["stub", "one-pass-variance", "padding-not-zeroed"])
def test_layer_norm_kernel_large_mean_check_rejects(wrong, capsys):
    assert not check_layer_norm_large_mean(wrong)
    out = capsys.readouterr().out
    assert "wrong values" in out or "never written" in out


@interpreter
def test_layer_norm_dx_kernel_solved():
    assert check_layer_norm_dx(solutions.layer_norm_dx_kernel)


@interpreter
@pytest.mark.parametrize("wrong, says", [
    (layer_norm_dx_stub_kernel, "never written"),
    (layer_norm_dx_no_mean_term_kernel, "wrong values"),
    (layer_norm_dx_forgets_weight_kernel, "wrong values"),
    (layer_norm_dx_ignores_row_stride_kernel, "wrong values"),
    (layer_norm_dx_strided_store_kernel, "out of bounds"),
], ids=["stub", "missing-mean-term", "g-instead-of-w-g", "ignores-row-stride", "dx-stored-with-row-stride"])
def test_layer_norm_dx_kernel_wrong_variants_not_solved(wrong, says, capsys):
    assert not check_layer_norm_dx(wrong)
    assert says in capsys.readouterr().out


@interpreter
def test_column_sum_kernel_solved():
    assert check_column_sum(solutions.column_sum_kernel)


@interpreter
@pytest.mark.parametrize("wrong, says", [
    (column_sum_stub_kernel, "never written"),
    (column_sum_one_tile_kernel, "wrong values"),
    (column_sum_no_row_mask_kernel, "out of bounds"),
    (column_sum_sums_rows_kernel, "wrong values"),
], ids=["stub", "one-tile", "no-row-mask", "sums-rows"])
def test_column_sum_kernel_wrong_variants_not_solved(wrong, says, capsys):
    assert not check_column_sum(wrong)
    assert says in capsys.readouterr().out


@interpreter
def test_layer_norm_solution_reads_x_once_and_names_the_parameter_loads():
    verdict = check_layer_norm(solutions.layer_norm_kernel)
    assert verdict.solved, verdict.message
    report = verdict.traffic  # the last case: 4 rows of 1000 columns, fp32
    assert report.reread == {"x": 1.0, "weight": 4.0, "bias": 4.0}
    assert report.ideal == 2 * 4 * 1000 * 4 + 2 * 1000 * 4 + 2 * 4 * 4  # x, out; weight, bias; mean, rstd
    assert report.moved == report.ideal + 2 * 3 * 1000 * 4  # weight and bias loaded by 4 programs, not 1
    text = " ".join(verdict.message.split())
    assert "weight read 4.00× its size, bias 4.00×" in text
    assert "weight and bias are loaded by each of the 4 row programs" in text and "x is read" not in text


@interpreter
def test_layer_norm_reading_the_row_three_times_is_solved_with_the_cause_named():
    verdict = check_layer_norm(layer_norm_three_passes_kernel)
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread["x"] == 3.0
    assert verdict.traffic.ratio > check_layer_norm(solutions.layer_norm_kernel).traffic.ratio + 0.5
    text = " ".join(verdict.message.split())
    assert "x 3.00×" in text and "x is read 3 times, a pass per statistic and one for the output" in text


@interpreter
def test_column_sum_solution_reads_the_buffer_once():
    verdict = check_column_sum(solutions.column_sum_kernel)
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"partial": 1.0}
    assert verdict.traffic.ideal == (50 + 1) * 129 * 4 and verdict.traffic.moved == verdict.traffic.ideal
    assert verdict.traffic.top == verdict.traffic.ideal
    assert "every input read once, every output written once" in verdict.message


# ----------------------------------------------------------------------------------------------
# The given kernels and launchers, against float64 autograd
# ----------------------------------------------------------------------------------------------


def _inputs(n_rows, n_cols, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(2, n_rows, n_cols, generator=gen).to(dtype).to(DEVICE)
    w, b = (1 + 0.5 * torch.randn(2, n_cols, generator=gen)).to(dtype).to(DEVICE)
    return x, w, b, g


def _autograd(forward, *tensors, grad_out):
    leaves = [t.double().detach().requires_grad_() for t in tensors]
    forward(*leaves).backward(grad_out.double())
    return [t.grad for t in leaves]


def _close(got, expected, dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    scale = expected.abs().max().item() + 1
    assert (got.double() - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launchers_forward_and_backward_match_autograd(dtype):
    n_rows, n_cols = 19, 300  # 19 rows over 8 partial programs: the last one has fewer rows
    x, w, b, g = _inputs(n_rows, n_cols, dtype)
    out, mean, rstd = solutions.layer_norm(x, w, b, return_stats=True)
    _close(out, F.layer_norm(x.double(), (n_cols,), w.double(), b.double(), 1e-5), dtype)
    dx, dw, db = solutions.layer_norm_backward(g, x, w, mean, rstd)
    for got, expected in zip((dx, dw, db), _autograd(lambda x_, w_, b_: F.layer_norm(x_, (n_cols,), w_, b_, 1e-5),
                                                     x, w, b, grad_out=g)):
        assert got.dtype == dtype
        _close(got, expected, dtype)

    out, rstd = solutions.rms_norm(x, w, return_rstd=True)
    _close(out, F.rms_norm(x.double(), (n_cols,), w.double(), 1e-6), dtype)
    dx, dw = solutions.rms_norm_backward(g, x, w, rstd)
    for got, expected in zip((dx, dw), _autograd(lambda x_, w_: F.rms_norm(x_, (n_cols,), w_, 1e-6), x, w,
                                                 grad_out=g)):
        _close(got, expected, dtype)


@interpreter
def test_atomic_and_two_stage_weight_gradients_agree_and_count():
    n_rows, n_cols = 12, 200
    x, w, b, g = _inputs(n_rows, n_cols, torch.float32, seed=1)
    _, mean, rstd = solutions.layer_norm(x, w, b, return_stats=True)
    with trace() as atomic:
        dw_atomic, db_atomic = solutions.weight_grad_atomic(g, x, mean, rstd, has_bias=True)
    with trace() as staged:
        dw, db, partial = solutions.weight_grad_two_stage(g, x, mean, rstd, torch.float32, has_bias=True,
                                                          n_partials=4)
    torch.testing.assert_close(dw_atomic, dw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db_atomic, db, rtol=1e-5, atol=1e-5)
    launch = atomic.launches[0]
    assert launch.atomics == 2 * n_rows  # one dw and one db atomic instruction per row's program
    assert launch.per_tensor["dw_ptr"].bytes_written == n_rows * n_cols * 4  # every row updates every column
    assert partial.shape == (4, n_cols) and [t.kernel for t in staged.launches] == [
        "weight_grad_partial_kernel", "column_sum_kernel", "column_sum_kernel"]
    assert all(t.atomics == 0 for t in staged.launches)


# ----------------------------------------------------------------------------------------------
# The solution kernels are timed on a GPU by the report: prove they compile for sm_90
# ----------------------------------------------------------------------------------------------

COMPILE_SCRIPT = textwrap.dedent(
    """
    from solutions import ch03_normalization as s
    from utils.aot import compile_kernel

    SCALARS = {"eps": "fp32"}
    CASES = [
        (s.rms_norm_kernel, {"BLOCK": 16384}), (s.layer_norm_kernel, {"BLOCK": 1024}),
        (s.layer_norm_dx_kernel, {"BLOCK": 4096}), (s.rms_norm_dx_kernel, {"BLOCK": 4096}),
        (s.column_sum_kernel, {"BLOCK_M": 16, "BLOCK_N": 128}),
        (s.weight_grad_partial_kernel, {"BLOCK": 4096, "HAS_MEAN": True, "HAS_BIAS": True}),
        (s.weight_grad_partial_kernel, {"BLOCK": 4096, "HAS_MEAN": False, "HAS_BIAS": False}),
        (s.weight_grad_atomic_kernel, {"BLOCK": 1024, "HAS_MEAN": True, "HAS_BIAS": True}),
    ]
    FP32_POINTERS = {"mean_ptr", "rstd_ptr", "partial_ptr", "dw_partial_ptr", "db_partial_ptr", "dw_ptr", "db_ptr"}
    for fn, constexprs in CASES:
        def types(name):
            if name.endswith("_ptr"):
                return "*fp32" if name in FP32_POINTERS else "*bf16"
            return SCALARS.get(name, "i32")

        warps = s.row_warps(constexprs.get("BLOCK", 1024))
        ptx = compile_kernel(fn, types, constexprs, aligned_pointers=False, num_warps=warps).asm["ptx"]
        assert ".target sm_90" in ptx, fn.__name__
    print("ok")
    """
)


@pytest.mark.slow
def test_solution_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(COMPILE_SCRIPT, tmp_path)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
