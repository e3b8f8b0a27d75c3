"""Solutions to chapter 02, reductions and softmax.

One solution per exercise of ``chapters/02_softmax/02_softmax.ipynb``, written for reading, and
the launchers the notebook gives (so the report and the tests launch the kernels exactly as the
notebook does). Every kernel here works on rows: a row starts at ``row * row_stride`` and its
elements are contiguous (column stride 1); the production kernels in ``kernel_ladder.softmax`` handle
any stride and any ``dim``. Loads upcast to float32, every accumulator is float32, and the result
is rounded once, at the store. The softmax kernels' traffic verdict (``softmax_traffic``) is a given:
the notebook's checks and ``tests/test_solutions_ch02.py`` pass the same one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "row_sum_kernel",
    "softmax_kernel",
    "softmax_multirow_kernel",
    "online_softmax_update",
    "softmax_online_kernel",
    "softmax_backward_kernel",
    "chunked_cross_entropy",
    "launch_row_sum",
    "launch_softmax",
    "launch_softmax_multirow",
    "launch_softmax_online",
    "launch_softmax_backward",
    "stats_by_chunks",
    "softmax_traffic",
]


# ----------------------------------------------------------------------------------------------
# Exercise 1 — a row sum: the reduction pattern
# ----------------------------------------------------------------------------------------------


@triton.jit
def row_sum_kernel(x_ptr, out_ptr, n_cols, x_row_stride, BLOCK: tl.constexpr):
    """``out[row] = sum(x[row, :])``, one program per row, for rows of any length.

    Teaches the reduction pattern every row-wise kernel shares: the program walks its row in
    chunks of ``BLOCK`` columns, adds each chunk into a float32 vector of ``BLOCK`` partial sums
    (masked lanes load 0, the identity of ``+``), and reduces that vector to one number with
    ``tl.sum`` at the end. The row start is computed in int64: ``row * x_row_stride`` passes
    2**31 for large tensors.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * x_row_stride
    partial = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0)
        partial += x.to(tl.float32)
    total = tl.sum(partial, axis=0)
    tl.store(out_ptr + row, total.to(out_ptr.dtype.element_ty))


def launch_row_sum(kernel, x: torch.Tensor, out: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """One program per row of a 2-D ``x`` with contiguous rows; ``out`` has one element per row."""
    n_rows, n_cols = x.shape
    kernel[(n_rows,)](x, out, n_cols, x.stride(0), BLOCK=block)
    return out


# ----------------------------------------------------------------------------------------------
# Exercise 2 — fused softmax, one row per program
# ----------------------------------------------------------------------------------------------


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Softmax of one row per program, the whole row in one block (``BLOCK >= n_cols``).

    Teaches fusion of a reduction: the row is loaded once into registers, its max and its sum of
    exponentials are reduced there, and the result is written once — the ideal traffic, where
    torch's five-op composition moves every element eight times. Two details make it right:

    * masked lanes load ``-inf``: they do not change the max, and ``exp(-inf - m) = 0`` keeps
      them out of the sum (loading 0 would add ``exp(-m)`` per padding lane);
    * subtracting the row max before ``exp`` keeps every exponent ≤ 0, so nothing overflows,
      and it does not change the result: ``e^(x-m) / Σ e^(x-m) = e^x / Σ e^x``.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=0)
    numerator = tl.exp(x - row_max)
    denominator = tl.sum(numerator, axis=0)
    y = numerator / denominator
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_softmax(kernel, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One program per row; ``BLOCK`` is the power of two that holds a whole row."""
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    kernel[(n_rows,)](x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block)
    return out


# ----------------------------------------------------------------------------------------------
# Exercise 3 — several short rows per program
# ----------------------------------------------------------------------------------------------


@triton.jit
def softmax_multirow_kernel(x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride,
                            BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Softmax of ``ROWS`` rows per program, as one ``(ROWS, BLOCK)`` tile.

    Teaches 2-D blocks and why short rows want them: a row of 128 columns is too little work for
    one program (a 4-warp program would have one element per thread, and an SM would run out of
    resident programs before it had enough bytes in flight to hide memory latency: the chapter's
    Little's-law model). Stacking rows into a tile gives each program enough work; the
    reductions run along ``axis=1``, one max and one sum per row. The mask has two parts — a
    column past the row's end, and (in the last program) a row past the last row.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    numerator = tl.exp(x - row_max[:, None])
    denominator = tl.sum(numerator, axis=1)
    y = numerator / denominator[:, None]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_softmax_multirow(kernel, x: torch.Tensor, out: torch.Tensor, rows_per_program: int = 8) -> torch.Tensor:
    """``rows_per_program`` rows per program (a power of two); the grid shrinks by that factor."""
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    grid = (triton.cdiv(n_rows, rows_per_program),)
    kernel[grid](x, out, n_rows, n_cols, x.stride(0), out.stride(0), BLOCK=block, ROWS=rows_per_program)
    return out


# ----------------------------------------------------------------------------------------------
# Exercise 4 — the online update
# ----------------------------------------------------------------------------------------------


def online_softmax_update(
    running_max: torch.Tensor, running_sum: torch.Tensor, chunk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one more chunk of columns into a row's running max and sum of exponentials.

    Teaches the online softmax recurrence (Milakov & Gimelshein, 2018). The running sum is
    ``s = Σ exp(x - m)`` over the columns seen so far, *relative to the running max m*. When a
    chunk brings a larger max ``m'``, every term already in ``s`` must be rescaled to the new
    reference: ``exp(x - m') = exp(x - m) · exp(m - m')``, so

        ``m' = max(m, max(chunk))``,   ``s' = s · exp(m - m') + Σ exp(chunk - m')``.

    ``exp(m - m') ≤ 1``, so nothing overflows; at the start ``m = -inf, s = 0`` and
    ``exp(-inf) = 0`` makes the first update a plain two-pass step. ``running_max`` and
    ``running_sum`` have one entry per row; ``chunk`` is ``(rows, columns of this chunk)``.
    """
    new_max = torch.maximum(running_max, chunk.amax(dim=-1))
    new_sum = running_sum * torch.exp(running_max - new_max) + torch.exp(chunk - new_max[:, None]).sum(dim=-1)
    return new_max, new_sum


def stats_by_chunks(update, x: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and ``Σ exp(x - max)``, folding ``chunk_size`` columns at a time with ``update``."""
    running_max = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    running_sum = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], chunk_size):
        running_max, running_sum = update(running_max, running_sum, x[..., start : start + chunk_size])
    return running_max, running_sum


# ----------------------------------------------------------------------------------------------
# Exercise 5 — online softmax for rows longer than a block
# ----------------------------------------------------------------------------------------------


@triton.jit
def softmax_online_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Softmax of a row of any length, ``BLOCK`` columns at a time, one program per row.

    Teaches the online softmax in a kernel: a first pass over the row keeps one running max and
    one running sum (the update of exercise 4, per chunk), so the statistics need one read of the
    row instead of two; a second pass reads the row again and writes ``exp(x - m) / s``. That is
    three row-sized transfers (read, read, write) against the two of the one-block kernel — the
    price of rows too long for registers. (A GPU may serve the second read from L2.)
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - running_max) / running_sum
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_softmax_online(kernel, x: torch.Tensor, out: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """One program per row, walking it ``block`` columns at a time (rows may be longer than a block)."""
    n_rows, n_cols = x.shape
    kernel[(n_rows,)](x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block)
    return out


# ----------------------------------------------------------------------------------------------
# Exercise 6 — the backward from the saved output
# ----------------------------------------------------------------------------------------------


@triton.jit
def softmax_backward_kernel(y_ptr, grad_y_ptr, grad_x_ptr, n_cols, y_row_stride, grad_y_row_stride,
                            grad_x_row_stride, BLOCK: tl.constexpr):
    """``grad_x = y · (grad_y - Σ y·grad_y)`` for one row per program, from the saved output ``y``.

    Teaches the softmax backward. The Jacobian is ``∂y_j/∂x_i = y_j (δ_ij - y_i)``, so
    ``grad_x_i = Σ_j grad_y_j y_j (δ_ij - y_i) = y_i (grad_y_i - Σ_j y_j grad_y_j)``: one dot
    product per row, never the ``n × n`` Jacobian. It needs ``y`` (saved by the forward) and not
    ``x``: reading ``y`` and ``grad_y`` and writing ``grad_x`` is the whole traffic. Masked lanes
    load 0, so they add nothing to the dot product.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(y * grad_y, axis=0)
    grad_x = y * (grad_y - dot)
    tl.store(grad_x_ptr + row * grad_x_row_stride + cols, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


def launch_softmax_backward(kernel, y: torch.Tensor, grad_y: torch.Tensor, grad_x: torch.Tensor) -> torch.Tensor:
    """One program per row, the whole row in one block."""
    n_rows, n_cols = y.shape
    block = triton.next_power_of_2(n_cols)
    kernel[(n_rows,)](y, grad_y, grad_x, n_cols, y.stride(0), grad_y.stride(0), grad_x.stride(0), BLOCK=block)
    return grad_x


# ----------------------------------------------------------------------------------------------
# Exercise 7 — cross-entropy over vocabulary chunks
# ----------------------------------------------------------------------------------------------


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Mean cross-entropy ``mean_i(logsumexp(logits_i) - logits_i[target_i])``, ``chunk_size`` columns at a time.

    Teaches why a loss over a large vocabulary need not materialize ``N × V`` probabilities:
    ``logsumexp = m + log(s)`` from the running max and sum of the online update, so each step
    upcasts and exponentiates one ``N × chunk_size`` slice in float32 and forgets it. Extra
    memory is ``O(N · chunk_size)``, not ``O(N · V)``. The target's logit is gathered from the
    input directly. (Forward only: a training kernel also writes ``softmax - one_hot`` as the
    gradient, which is as large as the logits.)
    """
    n_rows, vocab = logits.shape
    running_max = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    running_sum = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    for start in range(0, vocab, chunk_size):
        chunk = logits[:, start : start + chunk_size].float()
        running_max, running_sum = online_softmax_update(running_max, running_sum, chunk)
    log_sum_exp = running_max + torch.log(running_sum)
    target_logit = logits.gather(1, target[:, None]).squeeze(1).float()
    return (log_sum_exp - target_logit).mean().to(logits.dtype)


# ----------------------------------------------------------------------------------------------
# Givens: the traffic verdict (``check(..., traffic=...)``) of the softmax kernels
# ----------------------------------------------------------------------------------------------


def _softmax_ideal(x: torch.Tensor) -> int:
    """Softmax's floor: x read once, the output (x's shape and dtype) written once."""
    return 2 * x.numel() * x.element_size()


def _softmax_top(x: torch.Tensor) -> int:
    """What ``kernel_ladder.softmax`` moves on the same rows (traced)."""
    from utils.trace import trace

    with trace(torch_ops=False) as traced:
        kernel_ladder.softmax(x, dim=-1)
    return traced.bytes


def _softmax_explain(reread: dict[str, float]) -> str | None:
    """Names the passes over the row from how many times x was read."""
    passes = reread.get("x", 0.0)
    if not reread or passes < 0.05:
        return "torch ops read x: each of softmax's steps writes a row-sized result and the next reads it back"
    if passes > 2.5:
        return (f"x is read {passes:.0f} times, a pass each for the max, the sum and the output: the online "
                "update folds max and sum into one pass, and a row that fits one block is loaded once")
    if passes > 1.5:
        return ("x is read twice, a pass for the running max and sum (the online update) and one for the output: "
                "the price of rows too long for one block; a row that fits one is loaded once")
    return None


def softmax_traffic():
    """The traffic verdict of the softmax kernels: x read once and the output written once against
    what ``kernel_ladder.softmax`` moves; the explanation counts the passes over each row."""
    from utils.exercises import Traffic

    return Traffic(ideal=_softmax_ideal, top=_softmax_top, explain=_softmax_explain)
