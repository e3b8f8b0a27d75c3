"""Solutions to chapter 06, fused LLM ops: RoPE, the fused linear + cross-entropy, the gated MLP.

One solution per exercise of ``chapters/06_fused_ops/06_fused_ops.ipynb``, written for reading. In
solution mode the notebook's stubs are replaced by these.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes interpreter/compiled mode before any @triton.jit below)

__all__ = [
    "rope_row_kernel",
    "launch_rope_rows",
    "rope_token_kernel",
    "launch_rope_tokens",
    "rope_backward",
    "fused_linear_ce_chunk",
    "chunk_size_for_budget",
]


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


@triton.jit
def rope_row_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr):
    """The first kernel of the ladder (given in the notebook): one program per row ``(b, h, t)``.

    ``x`` is a contiguous ``(B, H, T, 2 * HALF)`` tensor, cos and sin contiguous ``(T, 2 * HALF)``.
    Each program loads the two halves of its row and the token's cos/sin row, and writes
    ``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2``. Correct, but every head of a token reloads the
    same cos/sin row: H times the table's bytes.
    """
    row = tl.program_id(0)
    t = row % seq_len
    j = tl.arange(0, HALF)
    base = row.to(tl.int64) * (2 * HALF)
    x1 = tl.load(x_ptr + base + j).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + j).to(tl.float32)
    table = t.to(tl.int64) * (2 * HALF)
    c1 = tl.load(cos_ptr + table + j).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF + j).to(tl.float32)
    s1 = tl.load(sin_ptr + table + j).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF + j).to(tl.float32)
    tl.store(out_ptr + base + j, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + base + HALF + j, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty))


def launch_rope_rows(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor):
    """One program per row of a contiguous (B, H, T, D) ``x``; cos/sin contiguous (T, D)."""
    batch, n_heads, seq_len, head_dim = x.shape
    kernel[(batch * n_heads * seq_len,)](x, cos, sin, out, n_heads, seq_len, HALF=head_dim // 2)
    return out


@triton.jit
def rope_token_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, seq_len, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """Exercise 1: one program per token ``(b, t)``, every head of it, the cos/sin row loaded once.

    Teaches the reuse a fused kernel is built around: the table row is the same for all ``H`` heads
    of a token, so a program that owns the token loads it once and applies it to an ``(H, HALF)``
    tile of each half — H times fewer table bytes than one program per row, the rest unchanged.
    Heads are masked (``H`` need not be a power of two).
    """
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    j = tl.arange(0, HALF)
    table = t.to(tl.int64) * (2 * HALF)
    c1 = tl.load(cos_ptr + table + j).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF + j).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table + j).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF + j).to(tl.float32)[None, :]
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None]
    # row (b, h, t) of a contiguous (B, H, T, D) tensor starts at ((b * H + h) * T + t) * D
    rows = ((b * n_heads + heads).to(tl.int64) * seq_len + t) * (2 * HALF)
    x1 = tl.load(x_ptr + rows[:, None] + j[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + j[None, :], mask=mask).to(tl.float32)
    tl.store(out_ptr + rows[:, None] + j[None, :], (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + rows[:, None] + HALF + j[None, :], (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty),
             mask=mask)


def launch_rope_tokens(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor):
    """One program per token of a contiguous (B, H, T, D) ``x`` (the exercise's launcher)."""
    batch, n_heads, seq_len, head_dim = x.shape
    kernel[(batch * seq_len,)](x, cos, sin, out, n_heads, seq_len, HALF=head_dim // 2,
                               BLOCK_H=triton.next_power_of_2(n_heads))
    return out


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exercise 2: the gradient of RoPE with respect to its input, from the output's gradient.

    Teaches that the backward of a linear map is its transpose. Per pair,
    ``[y1, y2] = [[c1, -s1], [s2, c2]] [x1, x2]``, so ``[dx1, dx2] = [[c1, s2], [-s1, c2]] [g1, g2]``:
    ``dx1 = g1 c1 + g2 s2`` and ``dx2 = g2 c2 - g1 s1`` — for HF's tables (``c1 = c2``, ``s1 = s2``)
    the rotation by the opposite angle. Computed in fp32, returned in ``grad``'s dtype.
    """
    half = grad.shape[-1] // 2
    g = grad.float()
    c, s = cos.float(), sin.float()
    g1, g2 = g[..., :half], g[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1).to(grad.dtype)


# ----------------------------------------------------------------------------------------------
# The fused linear + cross-entropy
# ----------------------------------------------------------------------------------------------


def fused_linear_ce_chunk(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, n_valid: int,
                          ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 3: one chunk of rows of ``mean cross_entropy(x @ weight.T, target)`` over the whole batch.

    Teaches what makes chunking exact: the mean divides by the number of non-ignored rows of the
    *whole* batch (``n_valid``), not of the chunk, so every chunk's loss and gradients carry the
    same ``1 / n_valid``; then the chunks' losses and weight gradients simply add up. With
    ``p = softmax(z)``, ``z = x W^T``, the logits' gradient is ``(p - onehot(y)) / n_valid`` on
    non-ignored rows (0 on ignored ones), and ``grad_x = G W``, ``grad_W = G^T x``.

    Returns ``(loss_share, grad_x, grad_weight)``: the chunk's share of the loss (0-d: its rows'
    losses summed and divided by ``n_valid``), ``grad_x`` of x's shape and ``grad_weight`` of the
    weight's, all float32.
    """
    z = x.float() @ weight.float().T
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    log_p = torch.log_softmax(z, dim=-1)
    nll = -log_p.gather(1, safe[:, None]).squeeze(1)
    loss_share = torch.where(valid, nll, torch.zeros_like(nll)).sum() / n_valid
    grad_z = log_p.exp()
    grad_z[torch.arange(z.shape[0], device=z.device), safe] -= 1.0
    grad_z = torch.where(valid[:, None], grad_z, torch.zeros_like(grad_z)) / n_valid
    return loss_share, grad_z @ weight.float(), grad_z.T @ x.float()


def chunk_size_for_budget(budget_bytes: int, bytes_per_row: int, n_rows: int) -> int:
    """Exercise 4: the largest power-of-two chunk of rows whose working memory fits ``budget_bytes``.

    Teaches sizing a chunk from a memory budget: the fused loss's extra memory grows linearly with
    the chunk (its logits, overwritten in place by their gradient, and a few floats of statistics
    per row), so ``chunk = budget // bytes_per_row`` rounded *down* to a power of two (tiles stay
    whole), at least 1 (a single row must run whatever the budget), at most the next power of two
    of ``n_rows`` (one chunk, padded to a power of two, holds the whole batch).
    """
    fit = max(1, budget_bytes // max(1, bytes_per_row))
    chunk = 1 << (fit.bit_length() - 1)
    return max(1, min(chunk, triton.next_power_of_2(max(1, n_rows))))
