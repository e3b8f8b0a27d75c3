"""Chapter 02's solutions pass the checker on fresh inputs; wrong variants of each do not.

Each exercise is checked as the notebook checks it (the same launchers, the same kind of cases):
once with the solution (SOLVED) and once per negative control — a plausible wrong answer (a
stub, a mask off by one, padding loaded as 0 instead of -inf, no max subtraction overflowing, a
missing or inverted rescale, a skipped last chunk, a dropped term of the backward, one row stride
used for tensors whose strides differ) that the checker must reject with the right diagnosis.
Sizes stay at a few dozen programs per case.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel_ladder
from solutions import ch02_softmax as solutions
from utils.aot import run_compiled
from utils.exercises import check
from utils.memory import peak_memory
from utils.trace import trace

# exp overflows (to inf) and -inf - -inf (NaN) in numpy are what some negative controls are about.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.interpreter,
]

DEVICE = kernel_ladder.runtime.DEVICE
ROW_SUM_BLOCK = 1024
ROWS_PER_PROGRAM = 8
ONLINE_BLOCK = 256


# ----------------------------------------------------------------------------------------------
# Launchers (the notebook's), parameterised by the kernel under test
# ----------------------------------------------------------------------------------------------


def row_sum_launcher(kernel):
    return lambda x, out: solutions.launch_row_sum(kernel, x, out, block=ROW_SUM_BLOCK)


def softmax_launcher(kernel):
    return lambda x, out: solutions.launch_softmax(kernel, x, out)


def multirow_launcher(kernel):
    return lambda x, out: solutions.launch_softmax_multirow(kernel, x, out, ROWS_PER_PROGRAM)


def online_launcher(kernel):
    # As the notebook's check: the kernel under the tracer, failed if it reads x more than twice.
    def launch(x, out):
        with trace() as traced:
            solutions.launch_softmax_online(kernel, x, out, block=ONLINE_BLOCK)
        x_reads = traced.launches[-1].per_tensor["x_ptr"].bytes_read / (x.numel() * x.element_size())
        if x_reads > 2:
            raise RuntimeError(f"the kernel read x {x_reads:.2f} times; the online update gets max and sum "
                               "in one pass, and the output takes a second")
        return out

    return launch


def ce_within_memory(candidate):
    # As the notebook's check: failed if more than four float32 N x chunk_size slices are alive at once.
    def run(logits, target, chunk_size):
        with peak_memory() as memory:
            loss = candidate(logits, target, chunk_size)
        budget = 4 * logits.shape[0] * chunk_size * 4 + 1024
        if memory.peak_bytes > budget:
            raise MemoryError(f"{memory.peak_bytes:,} bytes alive at once, over the {budget:,} of four float32 "
                              "N x chunk_size slices: is an N x V tensor (or a float32 copy of the logits) made?")
        return loss

    return run


def backward_launcher(kernel):
    def launch(x, grad_y, out):
        y = torch.softmax(x.float(), dim=-1).to(x.dtype)  # what the forward saved
        return solutions.launch_softmax_backward(kernel, y, grad_y, out)

    return launch


def stats_candidate(update):
    return lambda x, chunk_size: solutions.stats_by_chunks(update, x, chunk_size)


# ----------------------------------------------------------------------------------------------
# Cases and references
# ----------------------------------------------------------------------------------------------


def _randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def _sliced(gen, rows, cols, width, scale=1.0):
    """Rows of ``cols`` elements, ``width`` apart in memory (a column slice: row stride != n_cols)."""
    return _randn(gen, rows, width, scale=scale)[:, :cols]


def row_sum_cases(gen):
    return [
        (_randn(gen, 5, 3000) + 0.5,),
        (_randn(gen, 3, 1) + 0.5,),
        (_randn(gen, 4, 1024, dtype=torch.float16) + 0.5,),
        ((_randn(gen, 6, 2500) + 0.5).to(torch.bfloat16),),
        (_sliced(gen, 4, 1500, 2000) + 0.5,),  # offset like the others: a zero-mean row cancels to ~0
    ]


def softmax_cases(gen):
    return [
        (_randn(gen, 13, 1000, scale=3.0),),
        (_randn(gen, 1, 1),),
        (_randn(gen, 7, 777, scale=3.0, dtype=torch.float16),),
        (_randn(gen, 5, 2048, scale=3.0, dtype=torch.bfloat16),),
        (_sliced(gen, 6, 300, 512, scale=3.0),),
        (_randn(gen, 4, 100, scale=100.0),),  # exp(x) overflows fp32 from x = 88.7
    ]


def multirow_cases(gen):
    return [
        (_randn(gen, 37, 100, scale=3.0),),  # 37 rows: the last program has 5
        (_randn(gen, 1, 1),),
        (_randn(gen, 20, 64, scale=3.0, dtype=torch.bfloat16),),
        (_randn(gen, 9, 200, scale=3.0, dtype=torch.float16),),
        (_sliced(gen, 11, 50, 80, scale=3.0),),
        (_randn(gen, 8, 30, scale=100.0),),
    ]


def online_cases(gen):
    return [
        (_randn(gen, 4, 1000, scale=3.0) + torch.linspace(0, 30, 1000, device=DEVICE),),  # max rises chunk by chunk
        (_randn(gen, 3, 768, scale=3.0),),  # exactly 3 chunks
        (_sliced(gen, 3, 900, 1024, scale=3.0),),  # x's row stride 1024, out's 900
        (_randn(gen, 2, 1),),
        (_randn(gen, 3, 700, scale=3.0, dtype=torch.bfloat16),),
        (_randn(gen, 2, 600, scale=3.0, dtype=torch.float16),),
        (_randn(gen, 2, 600, scale=100.0),),
    ]


def backward_cases(gen):
    return [
        (_randn(gen, 9, 1000, scale=2.0), _randn(gen, 9, 1000)),
        (_randn(gen, 1, 1), _randn(gen, 1, 1)),
        (_randn(gen, 5, 513, scale=2.0), _randn(gen, 5, 513)),
        (_randn(gen, 4, 700, scale=2.0, dtype=torch.bfloat16), _randn(gen, 4, 700, dtype=torch.bfloat16)),
        (_randn(gen, 3, 900, scale=2.0, dtype=torch.float16), _randn(gen, 3, 900, dtype=torch.float16)),
        # grad_y sliced: its row stride (512) differs from y's and grad_x's (300). (A sliced x would
        # not reach the kernel: the launcher's y is a fresh, contiguous softmax of it.)
        (_randn(gen, 6, 300, scale=2.0), _sliced(gen, 6, 300, 512)),
    ]


def stats_cases(gen):
    rising = torch.linspace(0, 40, 1000, device=DEVICE)
    return [
        (_randn(gen, 4, 1000, scale=2.0) + rising, 7),  # the max grows at almost every chunk
        (_randn(gen, 4, 1000, scale=2.0) - rising, 64),  # the first chunk holds the max
        (_randn(gen, 3, 500, scale=5.0), 128),
        (_randn(gen, 2, 300, scale=50.0), 300),  # one chunk: the two-pass result
    ]


def ce_cases(gen):
    def target(n, vocab):
        return torch.randint(0, vocab, (n,), generator=gen).to(DEVICE)

    return [
        (_randn(gen, 16, 5000, scale=3.0), target(16, 5000), 1024),  # a partial last chunk
        (_randn(gen, 8, 1000, scale=3.0), target(8, 1000), 1000),
        (_randn(gen, 4, 3), target(4, 3), 2),
        (_randn(gen, 16, 4000, scale=3.0, dtype=torch.bfloat16), target(16, 4000), 512),
        (_randn(gen, 8, 2000, scale=100.0), target(8, 2000), 512),  # exp overflows without the max
    ]


def softmax_reference(x):
    return torch.softmax(x, dim=-1)


def stats_reference(x, chunk_size):
    row_max = x.amax(dim=-1)
    return row_max, torch.exp(x - row_max[:, None]).sum(dim=-1)


def backward_reference(x, grad_y):
    x = x.detach().requires_grad_()
    torch.softmax(x, dim=-1).backward(grad_y)
    return x.grad


def ce_reference(logits, target, chunk_size):
    return F.cross_entropy(logits, target)


# ----------------------------------------------------------------------------------------------
# Wrong kernels (negative controls)
# ----------------------------------------------------------------------------------------------


@triton.jit
def row_sum_stub(x_ptr, out_ptr, n_cols, x_row_stride, BLOCK: tl.constexpr):
    pass


@triton.jit
def row_sum_no_mask(x_ptr, out_ptr, n_cols, x_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    partial = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        partial += tl.load(x_ptr + row * x_row_stride + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(partial, axis=0).to(out_ptr.dtype.element_ty))


@triton.jit
def row_sum_first_block_only(x_ptr, out_ptr, n_cols, x_row_stride, BLOCK: tl.constexpr):
    # no loop: rows longer than BLOCK lose their tail
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(x, axis=0).to(out_ptr.dtype.element_ty))


@triton.jit
def row_sum_skips_last_chunk(x_ptr, out_ptr, n_cols, x_row_stride, BLOCK: tl.constexpr):
    # the loop stops one chunk early, so the partial last chunk is never added
    row = tl.program_id(0).to(tl.int64)
    partial = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols - BLOCK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        partial += tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(partial, axis=0).to(out_ptr.dtype.element_ty))


@triton.jit
def softmax_stub(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    pass


@triton.jit
def softmax_no_max(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # exp(x) / sum(exp(x)): inf / inf = NaN once x passes 88.7
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    numerator = tl.exp(x)
    tl.store(out_ptr + row * out_row_stride + cols, (numerator / tl.sum(numerator, axis=0)).to(
        out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_pads_with_zero(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # padding lanes load 0: each adds exp(0 - max) to the sum (and 0 may exceed a negative max)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, (numerator / tl.sum(numerator, axis=0)).to(
        out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_mask_off_by_one(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # cols <= n_cols: one element too many, read and written
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols <= n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, (numerator / tl.sum(numerator, axis=0)).to(
        out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def multirow_stub(x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr):
    pass


@triton.jit
def multirow_no_row_mask(x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr):
    # masks the columns only: the last program runs past the last row
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] >= 0) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = numerator / tl.sum(numerator, axis=1)[:, None]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def multirow_wrong_axis(x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr):
    # reduces down the columns of the tile (axis 0) instead of along each row
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=0)[None, :])
    y = numerator / tl.sum(numerator, axis=0)[None, :]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def online_stub(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    pass


@triton.jit
def online_no_rescale(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # adds each chunk's exp(x - new max) to a sum still relative to the old max
    row = tl.program_id(0).to(tl.int64)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        running_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum += tl.sum(tl.exp(x - running_max), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols,
                 (tl.exp(x - running_max) / running_sum).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def online_chunk_local(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # one pass: each chunk normalized by its own max and sum, as if it were the whole row
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        numerator = tl.exp(x - tl.max(x, axis=0))
        tl.store(out_ptr + row * out_row_stride + cols,
                 (numerator / tl.sum(numerator, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def online_three_passes(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # right values, but the max and the sum take a pass each: three reads of x instead of two
    row = tl.program_id(0).to(tl.int64)
    row_max = -float("inf")
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        row_max = tl.maximum(row_max, tl.max(x, axis=0))
    row_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        row_sum += tl.sum(tl.exp(x - row_max), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols, (tl.exp(x - row_max) / row_sum).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def online_no_mask(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + tl.arange(0, BLOCK)).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols,
                 (tl.exp(x - running_max) / running_sum).to(out_ptr.dtype.element_ty))


@triton.jit
def online_out_uses_x_stride(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # right statistics, but the output rows are placed with the input's row stride
    row = tl.program_id(0).to(tl.int64)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(out_ptr + row * x_row_stride + cols,
                 (tl.exp(x - running_max) / running_sum).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def backward_stub(y_ptr, grad_y_ptr, grad_x_ptr, n_cols, y_row_stride, grad_y_row_stride, grad_x_row_stride,
                  BLOCK: tl.constexpr):
    pass


@triton.jit
def backward_no_dot(y_ptr, grad_y_ptr, grad_x_ptr, n_cols, y_row_stride, grad_y_row_stride, grad_x_row_stride,
                    BLOCK: tl.constexpr):
    # only the diagonal of the Jacobian: y * grad_y
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_x_ptr + row * grad_x_row_stride + cols, (y * grad_y).to(grad_x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def backward_sums_grad_only(y_ptr, grad_y_ptr, grad_x_ptr, n_cols, y_row_stride, grad_y_row_stride,
                            grad_x_row_stride, BLOCK: tl.constexpr):
    # y * (grad_y - sum(grad_y)): the sum is missing its y weights
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad_x = y * (grad_y - tl.sum(grad_y, axis=0))
    tl.store(grad_x_ptr + row * grad_x_row_stride + cols, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def backward_no_mask(y_ptr, grad_y_ptr, grad_x_ptr, n_cols, y_row_stride, grad_y_row_stride, grad_x_row_stride,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = tl.load(y_ptr + row * y_row_stride + cols).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + cols).to(tl.float32)
    grad_x = y * (grad_y - tl.sum(y * grad_y, axis=0))
    tl.store(grad_x_ptr + row * grad_x_row_stride + cols, grad_x.to(grad_x_ptr.dtype.element_ty))


@triton.jit
def backward_one_stride(y_ptr, grad_y_ptr, grad_x_ptr, n_cols, y_row_stride, grad_y_row_stride, grad_x_row_stride,
                        BLOCK: tl.constexpr):
    # y's row stride used for all three tensors
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + row * y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad_x = y * (grad_y - tl.sum(y * grad_y, axis=0))
    tl.store(grad_x_ptr + row * y_row_stride + cols, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Wrong Python answers
# ----------------------------------------------------------------------------------------------


def update_stub(running_max, running_sum, chunk):
    raise NotImplementedError


def update_no_rescale(running_max, running_sum, chunk):
    new_max = torch.maximum(running_max, chunk.amax(dim=-1))
    return new_max, running_sum + torch.exp(chunk - new_max[:, None]).sum(dim=-1)


def update_inverted_rescale(running_max, running_sum, chunk):
    # exp(m' - m) instead of exp(m - m'): inf at the first chunk (m = -inf), then NaN
    new_max = torch.maximum(running_max, chunk.amax(dim=-1))
    return new_max, running_sum * torch.exp(new_max - running_max) + torch.exp(chunk - new_max[:, None]).sum(dim=-1)


def update_chunk_max(running_max, running_sum, chunk):
    # the chunk's max replaces the running max instead of joining it
    new_max = chunk.amax(dim=-1)
    return new_max, running_sum * torch.exp(running_max - new_max) + torch.exp(chunk - new_max[:, None]).sum(dim=-1)


def ce_stub(logits, target, chunk_size):
    raise NotImplementedError


def ce_no_max(logits, target, chunk_size):
    # sums exp(logits) directly: inf once a logit passes 88.7
    total = torch.zeros(logits.shape[0], device=logits.device)
    for start in range(0, logits.shape[1], chunk_size):
        total += torch.exp(logits[:, start : start + chunk_size].float()).sum(dim=-1)
    picked = logits.gather(1, target[:, None]).squeeze(1).float()
    return (torch.log(total) - picked).mean().to(logits.dtype)


def ce_skips_last_chunk(logits, target, chunk_size):
    vocab = logits.shape[1]
    running_max = torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    running_sum = torch.zeros(logits.shape[0], device=logits.device)
    for start in range(0, vocab - chunk_size + 1, chunk_size):
        running_max, running_sum = solutions.online_softmax_update(
            running_max, running_sum, logits[:, start : start + chunk_size].float())
    picked = logits.gather(1, target[:, None]).squeeze(1).float()
    return (running_max + torch.log(running_sum) - picked).mean().to(logits.dtype)


def ce_upcasts_all_logits(logits, target, chunk_size):
    # right value, but a float32 copy of the whole N x V logits (and torch's N x V log-probabilities)
    return F.cross_entropy(logits.float(), target).to(logits.dtype)


def ce_forgets_target(logits, target, chunk_size):
    # the mean log-sum-exp: the target's logit is never subtracted
    stats = solutions.stats_by_chunks(solutions.online_softmax_update, logits.float(), chunk_size)
    return (stats[0] + torch.log(stats[1])).mean().to(logits.dtype)


@triton.jit
def softmax_three_loads(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    # right values, but the row is loaded again for the max, the sum and the output
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    row_max = tl.max(tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32), 0)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    row_sum = tl.sum(tl.exp(x - row_max), axis=0)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (tl.exp(x - row_max) / row_sum).to(out_ptr.dtype.element_ty),
             mask=mask)


# ----------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------

KERNEL_EXERCISES = {
    "row_sum_kernel": (row_sum_launcher, lambda x: x.sum(dim=-1), row_sum_cases),
    "softmax_kernel": (softmax_launcher, softmax_reference, softmax_cases),
    "softmax_multirow_kernel": (multirow_launcher, softmax_reference, multirow_cases),
    "softmax_online_kernel": (online_launcher, softmax_reference, online_cases),
    "softmax_backward_kernel": (backward_launcher, backward_reference, backward_cases),
}

PYTHON_EXERCISES = {
    "online_softmax_update": (stats_candidate, stats_reference, stats_cases),
    "chunked_cross_entropy": (ce_within_memory, ce_reference, ce_cases),
}


@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_kernel_solution_is_solved(name, capsys):
    launcher, reference, cases = KERNEL_EXERCISES[name]
    verdict = check(f"ch02_softmax.{name}", launcher(getattr(solutions, name)), reference, cases, out=True)
    assert verdict.solved, verdict.message
    assert capsys.readouterr().out.startswith("✅ SOLVED — ch02_softmax.")


@pytest.mark.parametrize("name", sorted(PYTHON_EXERCISES))
def test_python_solution_is_solved(name):
    wrap, reference, cases = PYTHON_EXERCISES[name]
    verdict = check(f"ch02_softmax.{name}", wrap(getattr(solutions, name)), reference, cases)
    assert verdict.solved, verdict.message


WRONG_KERNELS = [
    ("row_sum_kernel", row_sum_stub, "never written"),
    ("row_sum_kernel", row_sum_no_mask, "out of bounds"),
    ("row_sum_kernel", row_sum_first_block_only, "wrong values"),
    ("row_sum_kernel", row_sum_skips_last_chunk, "wrong values"),
    ("softmax_kernel", softmax_stub, "never written"),
    ("softmax_kernel", softmax_no_max, "NaN"),
    ("softmax_kernel", softmax_pads_with_zero, "wrong values"),
    ("softmax_kernel", softmax_mask_off_by_one, "out of bounds"),
    ("softmax_multirow_kernel", multirow_stub, "never written"),
    ("softmax_multirow_kernel", multirow_no_row_mask, "out of bounds"),
    ("softmax_multirow_kernel", multirow_wrong_axis, "wrong values"),
    ("softmax_online_kernel", online_stub, "never written"),
    ("softmax_online_kernel", online_no_rescale, "wrong values"),
    ("softmax_online_kernel", online_chunk_local, "wrong values"),
    ("softmax_online_kernel", online_three_passes, "read x 3.00 times"),
    ("softmax_online_kernel", online_no_mask, "out of bounds"),
    ("softmax_online_kernel", online_out_uses_x_stride, "out of bounds"),
    ("softmax_backward_kernel", backward_stub, "never written"),
    ("softmax_backward_kernel", backward_no_dot, "wrong values"),
    ("softmax_backward_kernel", backward_sums_grad_only, "wrong values"),
    ("softmax_backward_kernel", backward_no_mask, "out of bounds"),
    ("softmax_backward_kernel", backward_one_stride, "wrong values"),
]


@pytest.mark.parametrize(("name", "kernel", "diagnosis"), WRONG_KERNELS,
                         ids=[kernel.fn.__name__ for _, kernel, _ in WRONG_KERNELS])
def test_wrong_kernel_is_not_solved(name, kernel, diagnosis):
    launcher, reference, cases = KERNEL_EXERCISES[name]
    verdict = check(f"ch02_softmax.{name}", launcher(kernel), reference, cases, out=True)
    assert not verdict.solved
    assert verdict.message.startswith(f"❌ NOT SOLVED — ch02_softmax.{name}")
    assert diagnosis in verdict.message, verdict.message


WRONG_FUNCTIONS = [
    ("online_softmax_update", update_stub, "not implemented yet"),
    ("online_softmax_update", update_no_rescale, "wrong values"),
    ("online_softmax_update", update_inverted_rescale, "NaN"),
    ("online_softmax_update", update_chunk_max, "wrong values"),
    ("chunked_cross_entropy", ce_stub, "not implemented yet"),
    ("chunked_cross_entropy", ce_no_max, "NaN/inf"),
    ("chunked_cross_entropy", ce_skips_last_chunk, "wrong value"),
    ("chunked_cross_entropy", ce_forgets_target, "wrong value"),
    ("chunked_cross_entropy", ce_upcasts_all_logits, "alive at once"),
]


@pytest.mark.parametrize(("name", "candidate", "diagnosis"), WRONG_FUNCTIONS,
                         ids=[candidate.__name__ for _, candidate, _ in WRONG_FUNCTIONS])
def test_wrong_function_is_not_solved(name, candidate, diagnosis):
    wrap, reference, cases = PYTHON_EXERCISES[name]
    verdict = check(f"ch02_softmax.{name}", wrap(candidate), reference, cases)
    assert not verdict.solved
    assert diagnosis in verdict.message, verdict.message


def test_online_update_equals_two_pass_on_the_worked_example():
    # The notebook's worked example: three chunks whose maxima rise, then fall.
    x = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0, 0.0, -1.0, 6.0, 2.0]], dtype=torch.float64)
    row_max, row_sum = solutions.stats_by_chunks(solutions.online_softmax_update, x, 3)
    assert row_max.item() == 6.0
    assert row_sum.item() == pytest.approx(torch.exp(x - 6.0).sum().item(), rel=1e-15)


# ----------------------------------------------------------------------------------------------
# The solution kernels are valid compiled Triton (the report times them on a GPU)
# ----------------------------------------------------------------------------------------------

COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys
    from solutions import ch02_softmax as s
    from utils.aot import compile_kernel

    CASES = [(s.row_sum_kernel, {"BLOCK": 1024}), (s.softmax_kernel, {"BLOCK": 16384}),
             (s.softmax_multirow_kernel, {"BLOCK": 128, "ROWS": 16}), (s.softmax_online_kernel, {"BLOCK": 4096}),
             (s.softmax_backward_kernel, {"BLOCK": 16384})]
    failures = []
    for fn, constexprs in CASES:
        types = lambda name: "*bf16" if name.endswith("_ptr") else "i32"
        divisible = lambda name: name.endswith("_stride") or name == "n_cols"
        ptx = compile_kernel(fn, types, constexprs, divisible=divisible, num_warps=8).asm["ptx"]
        if fn is not s.row_sum_kernel and "st.global" not in ptx:
            failures.append(f"{fn.__name__}: no global store")
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_solution_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(COMPILE_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# The traffic verdicts: the passes over each row, counted and named
# ----------------------------------------------------------------------------------------------


def test_softmax_solution_reads_each_row_once():
    verdict = check("ch02_softmax.softmax_kernel", softmax_launcher(solutions.softmax_kernel), softmax_reference,
                    softmax_cases, out=True, traffic=solutions.softmax_traffic())
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"x": 1.0}
    assert verdict.traffic.ideal == 2 * 4 * 100 * 4 and verdict.traffic.moved == verdict.traffic.ideal
    assert verdict.traffic.top == verdict.traffic.ideal  # kernel_ladder.softmax: one pass over a short row
    assert "traffic: 1.00× the ideal bytes" in verdict.message


def test_softmax_loading_the_row_three_times_is_solved_with_the_passes_named():
    verdict = check("ch02_softmax.softmax_kernel", softmax_launcher(softmax_three_loads), softmax_reference,
                    softmax_cases, out=True, traffic=solutions.softmax_traffic())
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"x": 3.0}
    assert verdict.traffic.ratio == 2.0  # three reads and a write against a read and a write
    text = " ".join(verdict.message.split())
    assert "traffic: 2.00× the ideal bytes" in text and "x read 3.00× its size" in text
    assert "a pass each for the max, the sum and the output" in text


def test_online_softmax_solution_reads_each_row_twice_and_says_why():
    verdict = check("ch02_softmax.softmax_online_kernel", online_launcher(solutions.softmax_online_kernel),
                    softmax_reference, online_cases, out=True, traffic=solutions.softmax_traffic())
    assert verdict.solved, verdict.message
    assert verdict.traffic.reread == {"x": 2.0}
    assert verdict.traffic.ratio == 1.5
    text = " ".join(verdict.message.split())
    assert "x read 2.00× its size" in text and "the price of rows too long for one block" in text
