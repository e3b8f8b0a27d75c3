"""Solutions to chapter 06, fused LLM ops: RoPE, the fused linear + cross-entropy, the gated MLP.

One solution per exercise of ``chapters/06_fused_ops/06_fused_ops.ipynb``, written for reading. In
solution mode the notebook's stubs are replaced by these. Below them, what the chapter gives each
exercise's check — its reference (written apart from the solution), its cases, the rules its spec
states, the diagnosis that names the common mistakes, and its traffic verdict — which the notebook's
checks and ``tests/test_solutions_ch06.py`` both use.
"""

from __future__ import annotations

import math

import numpy as np
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
    # what the chapter gives its checks
    "rope_reference",
    "rope_cases",
    "rope_tokens_with",
    "rope_token_rules",
    "rope_token_traffic",
    "diagnose_rope_tokens",
    "rope_backward_reference",
    "rope_backward_cases",
    "rope_backward_rules",
    "rope_backward_traffic",
    "diagnose_rope_backward",
    "chunk_reference",
    "chunk_cases",
    "chunk_tolerance",
    "diagnose_chunk",
    "chunk_by_search",
    "BUDGET_CASES",
    "diagnose_chunk_size",
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


# ----------------------------------------------------------------------------------------------
# What the chapter gives: each exercise's reference (written apart from the solution), its cases,
# the rules its spec states, its diagnosis and its traffic verdict — the notebook's checks and
# tests/test_solutions_ch06.py both use these.
# ----------------------------------------------------------------------------------------------


def _close(got: object, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """``got`` equals the float64 ``want`` rounded to ``dtype``, within a diagnosis's tolerance for it."""
    from utils.exercises import default_tolerance

    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return False
    # Looser than the check's own: a diagnosis tells mistakes apart (they differ by far more) and a variant
    # recomputed in float64 differs from the kernel's rounding.
    rtol, atol = (max(2 * t, floor) for t, floor in zip(default_tolerance(dtype), (1e-4, 1e-5)))
    got64, want64 = got.detach().cpu().double(), want.detach().cpu().to(dtype).double()
    return bool(torch.isfinite(got64).all()) and bool(torch.allclose(got64, want64, rtol=rtol, atol=atol))


def _first_match(got: object, dtype: torch.dtype, variants: dict[str, torch.Tensor]) -> str | None:
    return next((cause for cause, want in variants.items() if _close(got, want, dtype)), None)


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


# Exercise 1 ------------------------------------------------------------------------------------


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with general tables (``c1 ≠ c2`` allowed): the check's reference."""
    (c1, c2), (s1, s2), (x1, x2) = _halves(cos), _halves(sin), _halves(x)
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def rope_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """fp32 and bf16; heads not a power of two; a batch of three sequences sharing one (T, D) table."""
    from kernel_ladder.runtime import DEVICE

    cases = []
    for (b, h, t, d), dtype in [((2, 3, 5, 32), torch.float32), ((1, 5, 7, 16), torch.bfloat16),
                                ((3, 1, 2, 64), torch.float32)]:
        x = torch.randn(b, h, t, d, generator=gen).to(dtype)
        # random angles (not HF's tables): c1 != c2 catches a kernel that reads one half only
        table_cos, table_sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
        cases.append((x.to(DEVICE), table_cos.to(DEVICE), table_sin.to(DEVICE)))
    return cases


def rope_tokens_with(kernel):
    """The exercise's candidate: ``launch_rope_tokens`` with the learner's kernel, writing ``out``."""

    def rope_tokens(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return launch_rope_tokens(kernel, x, cos, sin, out)

    return rope_tokens


def _table_row_once(args: tuple, launches) -> str | None:
    from utils.exercises.rules import bytes_read

    x, cos, sin = args
    tokens = x.shape[0] * x.shape[2]
    once = tokens * cos.shape[-1] * cos.element_size()  # each token's row of one table, once
    read = bytes_read(launches, cos) + bytes_read(launches, sin)
    if read <= 2 * once:
        return None
    return (f"the kernel read {read:,} bytes of cos and sin, {read / (2 * once):.1f}× one row of each per token: "
            f"load the token's row once and use it for every head (n_heads = {x.shape[1]})")


def rope_token_rules() -> list:
    from utils.exercises import rules

    return [rules.traced(_table_row_once, name="the token's table row read once for all its heads")]


def _rope_ideal(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    return 2 * x.nbytes + cos.nbytes + sin.nbytes  # x read, out written, each table read once


def _rope_explain(reread: dict[str, float]) -> str | None:
    if reread.get("cos", 0) > 1.05:
        return (f"the (T, D) tables are read once per sequence of the batch ({reread['cos']:.0f}×): "
                "kernel_ladder.rope gives a program a run of tokens and reads a table the batch shares once")
    return None


def rope_token_traffic():
    """The traffic verdict: the ideal reads x and each table once; kernel_ladder.rope's launch does."""
    from utils.exercises import Traffic

    return Traffic(ideal=_rope_ideal, top=_rope_ideal, explain=_rope_explain)


def diagnose_rope_tokens(case: tuple, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """The common mistakes of exercise 1, each recomputed in float64 and compared with what was written."""
    x, cos, sin = (t.double() for t in case)
    (c1, c2), (s1, s2), (x1, x2) = _halves(cos), _halves(sin), _halves(x)
    variants = {
        "the second half used the first half of the tables (c1, s1): the check's tables have c2 ≠ c1, "
        "s2 ≠ s1 — load cos[t, HALF + j] and sin[t, HALF + j] for y2":
            torch.cat((x1 * c1 - x2 * s1, x2 * c1 + x1 * s1), dim=-1),
        "the rotation runs the other way (the sin terms' signs flipped): y1 = x1·c1 − x2·s1, "
        "y2 = x2·c2 + x1·s2": torch.cat((x1 * c1 + x2 * s1, x2 * c2 - x1 * s2), dim=-1),
        "the two halves are stored swapped: y1 belongs at j, y2 at j + HALF":
            torch.cat((x2 * c2 + x1 * s2, x1 * c1 - x2 * s1), dim=-1),
        "cos and sin are swapped": torch.cat((x1 * s1 - x2 * c1, x2 * s2 + x1 * c2), dim=-1),
        "the same table halves apply to x1 and x2 the wrong way round (x1·c2, x2·c1): c1, s1 go with the "
        "first half of the row": torch.cat((x1 * c2 - x2 * s2, x2 * c1 + x1 * s1), dim=-1),
    }
    cause = _first_match(got, expected.dtype, variants)
    batch = x.shape[0]
    if cause is None and batch > 1 and isinstance(got, torch.Tensor) and got.shape == expected.shape:
        later_all_wrong = all(not _close(got[b, :, t], expected[b, :, t], expected.dtype)
                              for b in range(1, batch) for t in range(x.shape[2]))
        if _close(got[0], expected[0], expected.dtype) and later_all_wrong:
            return (f"the table row is indexed by the program id (the token of the whole batch), not by its position "
                    f"t = pid % seq_len: sequence 0 is right, and sequence b ≥ 1 reads rows b · seq_len + t, past "
                    f"the table's {x.shape[2]} rows — the tables are (T, D), shared by every sequence")
    if cause is None and case[0].dtype == torch.bfloat16:
        return ("this is the bf16 case (the fp32 case before it passed), its output fp32 (the tables are): "
                "upcast every load with .to(tl.float32), compute in fp32 and round once at the store")
    return cause


# Exercise 2 ------------------------------------------------------------------------------------


def rope_backward_reference(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """d(input) by float64 autograd through :func:`rope_reference` (never the solution's formula)."""
    x = torch.zeros(grad.shape, dtype=torch.float64, device=grad.device, requires_grad=True)
    (dx,) = torch.autograd.grad(rope_reference(x, cos.double(), sin.double()), x, grad.double())
    return dx


def rope_backward_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """fp32, then bf16 with tables in bf16 (HF casts them to the activations'): the bf16 case is where
    fp32 arithmetic and bf16 arithmetic part (the rule below; with the candidate, the rules also run it on
    that gradient with fp32 tables)."""
    from kernel_ladder.runtime import DEVICE

    cases = []
    for shape, dtype in [((2, 3, 5, 16), torch.float32), ((1, 4, 6, 32), torch.bfloat16)]:
        t, d = shape[2], shape[3]
        grad = torch.randn(shape, generator=gen).to(dtype)
        cases.append((grad.to(DEVICE), torch.randn(t, d, generator=gen).to(DEVICE, dtype),
                      torch.randn(t, d, generator=gen).to(DEVICE, dtype)))
    return cases


def _step(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step (ulp) of ``dtype`` at each float64 ``value``'s magnitude."""
    digits = round(-math.log2(torch.finfo(dtype).eps))  # explicit mantissa bits: 7 for bf16, 10 for fp16
    _, exponent = torch.frexp(value.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(value), exponent - 1 - digits)


def _with_tables_rounded(case: tuple, got: object) -> str | None:
    """The cause where fp32 tables were rounded to a low-precision ``grad``'s dtype before the fp32 arithmetic:
    ``got`` is exactly what that computes (and the tables lose bits in the rounding)."""
    grad, cos, sin = case
    if grad.dtype not in (torch.bfloat16, torch.float16) or cos.dtype != torch.float32:
        return None
    if not isinstance(got, torch.Tensor) or got.shape != grad.shape or got.dtype != grad.dtype:
        return None
    g, c, s = grad.float(), cos.to(grad.dtype).float(), sin.to(grad.dtype).float()
    if torch.equal(c, cos) and torch.equal(s, sin):
        return None
    (g1, g2), (c1, c2), (s1, s2) = _halves(g), _halves(c), _halves(s)
    if not torch.equal(got.cpu(), torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1).to(grad.dtype).cpu()):
        return None
    name = str(grad.dtype).removeprefix("torch.")
    return (f"the fp32 tables were rounded to {name} (grad's dtype) before use: cos.to(grad.dtype) drops their low "
            "bits — upcast everything to fp32 (cos.float()), whatever the tables' dtype, and round once at the end")


def _fp32_then_rounded(case: tuple, got: torch.Tensor) -> str | None:
    """The spec's "compute in fp32, return grad's dtype": every element within one step of grad's dtype
    of the exact gradient. fp32 arithmetic rounded once is; arithmetic in bf16 rounds each product and
    sum and, where the two terms nearly cancel, lands several steps away."""
    grad, cos, sin = case
    if grad.dtype not in (torch.bfloat16, torch.float16) or not isinstance(got, torch.Tensor):
        return None
    exact = rope_backward_reference(grad, cos, sin).cpu()
    g, c, s = (t.double().cpu() for t in (grad, cos, sin))
    (g1, g2), (c1, c2), (s1, s2) = _halves(g), _halves(c), _halves(s)
    terms = torch.cat(((g1 * c1).abs() + (g2 * s2).abs(), (g2 * c2).abs() + (g1 * s1).abs()), dim=-1)
    allowed = _step(exact, grad.dtype) + 2.0**-22 * terms  # one step, and fp32's own rounding of the terms
    error = (got.detach().cpu().double() - exact).abs()
    far = error > allowed
    if not bool(far.any()):
        return None
    rounded = _with_tables_rounded(case, got)
    if rounded:
        return rounded
    worst = int((error / allowed).flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), exact.shape))
    return (f"{int(far.sum())} of {far.numel()} elements of the {str(grad.dtype).removeprefix('torch.')} case are more "
            f"than one {str(grad.dtype).removeprefix('torch.')} step from the exact gradient (worst at {index}: got "
            f"{float(got.flatten()[worst]):.6g}, exact {float(exact.flatten()[worst]):.6g}): the arithmetic ran in "
            "the low precision — upcast with .float() first, round once at the end")


def _fp32_tables_probe(rope_backward):
    """The candidate on the bf16 case's gradient with fp32 tables (kernel_ladder.rope's own dtype): the output
    in grad's dtype, every element within one step of the exact gradient — tables rounded to bf16 first are not.
    The check's comparison rounds its reference to the inputs' promoted dtype, so this case is a rule's probe."""

    def probe(case: tuple, got: object) -> str | None:
        grad, cos, sin = case
        if grad.dtype not in (torch.bfloat16, torch.float16) or cos.dtype != grad.dtype:
            return None
        # fp32 tables with bits below bf16's: the bf16 case's own, nudged off the bf16 grid
        cos32, sin32 = (t.float() * (1 + 2.0**-10) + 2.0**-12 for t in (cos, sin))
        probe_case = (grad.clone(), cos32, sin32)
        out = rope_backward(*probe_case)
        if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
            return f"with fp32 tables it returned {type(out).__name__} {getattr(out, 'shape', '')}, not grad's shape"
        if out.dtype != grad.dtype:
            return f"with fp32 tables it returned {out.dtype}: return grad's dtype ({grad.dtype}) whatever the tables'"
        problem = _fp32_then_rounded(probe_case, out)
        return None if problem is None else f"with fp32 tables (a bf16 grad): {problem}"

    return probe


def rope_backward_rules(rope_backward=None) -> list:
    """The spec's "compute in fp32, return grad's dtype"; given the candidate, also on fp32 tables."""
    from utils.exercises import rules

    held = [rules.holds(_fp32_then_rounded, name="compute in fp32, return grad's dtype")]
    if rope_backward is not None:
        held.append(rules.holds(_fp32_tables_probe(rope_backward), name="fp32 tables used at their precision"))
    return held


def _rope_backward_ideal(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    return 2 * grad.nbytes + cos.nbytes + sin.nbytes


def _unfused_explain(reread: dict[str, float]) -> str:
    return ("each torch op writes its result and the next reads it back (the upcasts, the halves' products, "
            "the sums, the cat, the downcast); kernel_ladder.rope's backward is one launch at the ideal")


def rope_backward_traffic():
    """The torch backward's bytes (every aten op counted) against one fused launch's."""
    from utils.exercises import Traffic

    return Traffic(ideal=_rope_backward_ideal, top=_rope_backward_ideal, explain=_unfused_explain)


def diagnose_rope_backward(case: tuple, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """The common mistakes of exercise 2, recomputed in float64 (and the low-precision arithmetic in bf16)."""
    grad, cos, sin = case
    g, c, s = (t.double() for t in case)
    (g1, g2), (c1, c2), (s1, s2) = _halves(g), _halves(c), _halves(s)
    variants = {
        "that is the forward rotation again; the backward applies its transpose: dx1 = g1·c1 + g2·s2, "
        "dx2 = g2·c2 − g1·s1": rope_reference(g, c, s),
        "the rotation by the opposite angle with the tables' first halves is right only for HF's tables "
        "(c1 = c2, s1 = s2): the transpose takes s2 into dx1 and s1 into dx2, c1 and c2 each in its own half":
            torch.cat((g1 * c1 + g2 * s1, g2 * c1 - g1 * s1), dim=-1),
        "the sines are swapped: dx1 takes s2 (the second half's), dx2 takes s1":
            torch.cat((g1 * c1 + g2 * s1, g2 * c2 - g1 * s2), dim=-1),
        "the cosines are swapped: dx1 takes c1, dx2 takes c2":
            torch.cat((g1 * c2 + g2 * s2, g2 * c1 - g1 * s1), dim=-1),
        "the sign of the sine terms is flipped (that is the transpose of the opposite rotation)":
            torch.cat((g1 * c1 - g2 * s2, g2 * c2 + g1 * s1), dim=-1),
        "the two halves are swapped in the cat: dx1 = g1·c1 + g2·s2 goes first (features < D/2), "
        "dx2 = g2·c2 − g1·s1 second": torch.cat((g2 * c2 - g1 * s1, g1 * c1 + g2 * s2), dim=-1),
    }
    rounded = _with_tables_rounded(case, got)
    if rounded:
        return rounded
    cause = _first_match(got, grad.dtype, variants)
    if cause is None and grad.dtype in (torch.bfloat16, torch.float16) and isinstance(got, torch.Tensor):
        # the transpose in the low precision, as code that never upcasts computes it
        (a1, a2), (k1, k2), (z1, z2) = _halves(grad), _halves(cos), _halves(sin)
        in_low = torch.cat((a1 * k1 + a2 * z2, a2 * k2 - a1 * z1), dim=-1)
        if torch.equal(got.detach().cpu(), in_low.cpu()):
            return ("the arithmetic ran in " + str(grad.dtype).removeprefix("torch.") + ": upcast with .float() "
                    "first and round once at the end")
    return cause


# Exercise 3 ------------------------------------------------------------------------------------


def chunk_reference(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, n_valid: int,
                    ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's share of the batch's mean loss and its gradients, by float64 autograd through
    ``F.cross_entropy`` (never the solution's formula)."""
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    losses = torch.nn.functional.cross_entropy(x64 @ w64.T, target, ignore_index=ignore_index, reduction="none")
    share = losses.sum() / n_valid
    grad_x, grad_w = torch.autograd.grad(share, (x64, w64))
    return share.detach(), grad_x, grad_w


def chunk_cases(gen: torch.Generator) -> list[tuple]:
    """Chunks of batches of ``n_valid`` rows, an ignored row in each; the last with logits in the
    hundreds (a softmax that exponentiates them unshifted overflows float32)."""
    from kernel_ladder.runtime import DEVICE

    cases = []
    for rows, hidden, vocab, n_valid, logit_scale in [(8, 16, 50, 20, 1.0), (5, 24, 97, 5, 1.0),
                                                      (6, 8, 33, 31, 1.0), (4, 16, 40, 9, 60.0)]:
        x = torch.randn(rows, hidden, generator=gen)
        weight = torch.randn(vocab, hidden, generator=gen) * 0.3 * logit_scale
        target = torch.randint(0, vocab, (rows,), generator=gen)
        target[1] = -100  # an ignored row in every chunk
        cases.append((x.to(DEVICE), weight.to(DEVICE), target.to(DEVICE), n_valid))
    return cases


def chunk_tolerance(case: tuple, dtype: torch.dtype | None) -> tuple[float, float] | None:
    """fp32's rounding of a logit of magnitude |z| moves its exponential by about |z| · 2⁻²³: the chunk with
    logits in the hundreds gets that much room (the check's 1e-5 elsewhere)."""
    x, weight = case[0], case[1]
    largest = float((x.double() @ weight.double().T).abs().max())
    if largest <= 20:
        return None
    rtol = 8 * largest * 2.0**-24
    return rtol, rtol


def diagnose_chunk(case: tuple, got: tuple, expected: tuple) -> str | None:
    """The common mistakes of exercise 3: the wrong denominator, ignored rows counted, a missing one-hot,
    a softmax that overflows."""
    x, weight, target, n_valid = case[:4]
    ignore_index = case[4] if len(case) > 4 else -100
    valid = target != ignore_index
    own = int(valid.sum())
    share, grad_x, grad_w = (t.detach().cpu().double() if isinstance(t, torch.Tensor) else t for t in got)
    if any(isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()) for t in (share, grad_x, grad_w)):
        z = (x.double() @ weight.double().T).abs().max()
        return (f"NaN/inf: the logits reach {float(z):.0f} here, and exp of a logit above ~88 overflows float32 — "
                "subtract each row's maximum first (torch.log_softmax does)")

    def variant(denominator: float, keep_ignored: bool = False, onehot: bool = True, grads_scaled: bool = True):
        z = x.double() @ weight.double().T
        safe = torch.where(valid, target, torch.zeros_like(target))
        log_p = torch.log_softmax(z, dim=-1)
        rows = valid if not keep_ignored else torch.ones_like(valid)
        nll = -log_p.gather(1, safe[:, None]).squeeze(1)
        loss = torch.where(rows, nll, torch.zeros_like(nll)).sum() / denominator
        g = log_p.exp()
        if onehot:
            g[torch.arange(len(safe)), safe] -= 1.0
        g = torch.where(rows[:, None], g, torch.zeros_like(g)) / (denominator if grads_scaled else 1.0)
        return loss, g @ weight.double(), g.T @ x.double()

    variants = {
        f"divided by the chunk's own {own} valid rows, not the batch's n_valid = {n_valid}: every chunk's share "
        "carries the whole batch's 1 / n_valid, so that the chunks add up": variant(own),
        f"divided by the chunk's {len(target)} rows (ignored ones included), not the batch's n_valid = {n_valid}":
            variant(len(target)),
        "the ignored rows (target = ignore_index) are counted, as class 0: their loss and gradient must be 0":
            variant(n_valid, keep_ignored=True),
        "the gradients miss the 1 / n_valid the loss share has: scale G = (p − onehot) by 1 / n_valid too":
            variant(n_valid, grads_scaled=False),
        "the loss share is not divided by n_valid (its gradients are): the share is the rows' sum / n_valid":
            (variant(1)[0], *variant(n_valid)[1:]),
        "the logits' gradient is p − onehot(target): the one-hot is not subtracted": variant(n_valid, onehot=False),
        "the ignored rows' gradient is not zeroed: their loss is 0, so their row of G = (p − onehot) / n_valid must "
        "be 0 too": (variant(n_valid)[0], *variant(n_valid, keep_ignored=True)[1:]),
    }
    for cause, (want_share, want_x, want_w) in variants.items():
        if (_close(share if isinstance(share, torch.Tensor) else torch.tensor(share), want_share.reshape(()),
                   torch.float32) and _close(grad_x, want_x, torch.float32) and _close(grad_w, want_w, torch.float32)):
            return cause
    return None


# Exercise 4 ------------------------------------------------------------------------------------


def chunk_by_search(budget_bytes: int, bytes_per_row: int, n_rows: int) -> int:
    """The reference: every power of two up to the cap tried in turn."""
    best, c = 1, 1
    while c <= triton.next_power_of_2(max(1, n_rows)):
        if c * bytes_per_row <= budget_bytes:
            best = c
        c *= 2
    return best


#: The budgets checked: ordinary, below one row, larger than the whole batch, an exact fit, zero, one
#: row in all; a budget past 2**53 bytes whose float quotient rounds 2**40 − 1 rows up to 2**40 (a float
#: division; the rows' log2 is still exact); budgets past 2**53 rows, where a float's log2 rounds up to the
#: next power of two.
BUDGET_CASES = [(1 << 20, 4096, 10_000), (4095, 4096, 10), (10**9, 512, 100), (3 * 4096, 4096, 64),
                (0, 100, 5), (1 << 16, 256, 1), (1 << 16, 1024, 1 << 20),
                (((1 << 40) - 1) * 16385 + 16384, 16385, 1 << 60), ((1 << 53) - 1, 1, 1 << 60),
                (((1 << 62) - 1) * 3, 3, 1 << 62)]


def diagnose_chunk_size(case: tuple, got: object, expected: int) -> str | None:
    """The common mistakes of exercise 4, each computed and compared with the answer."""
    budget, per_row, n_rows = case
    fit = budget // max(1, per_row)
    cap = triton.next_power_of_2(max(1, n_rows))
    if isinstance(got, np.integer):
        return (f"{type(got).__module__}.{type(got).__name__} is not an int: return a Python int (int(...) around "
                "a numpy value; a fixed-width integer also wraps where Python's do not)")
    if isinstance(got, float):
        return ("a float: math.log2 or ** gave it (and past 2**53 a float's log2 rounds up a power of two): keep to "
                "integers, 1 << (m.bit_length() - 1)")
    # Where two mistakes give the same number, the one whose first wrong case this is comes first: a float
    # log2 is right until 2**53, rounding up is wrong from the first budget that is not a power of two.
    divided = max(1, int(budget / max(1, per_row)))
    variants = {
        "the float log2 rounded up a power of two past 2**53: keep to integers, 1 << (m.bit_length() - 1)":
            min(1 << int(math.log2(max(1, fit))), cap),
        f"budget_bytes / bytes_per_row is a float division: past 2**53 its quotient rounds ({budget:,} / {per_row:,} "
        f"gives {divided:,}, the rows that fit are {fit:,}) — use integer division, budget_bytes // bytes_per_row":
            min(1 << (divided.bit_length() - 1), cap),
        f"capped at n_rows ({n_rows}), not at its next power of two ({cap}): the chunk stays a power of two":
            min(1 << (max(1, fit).bit_length() - 1), n_rows),
        "rounded up to a power of two: the chunk must fit the budget, so round down":
            min(triton.next_power_of_2(max(1, fit)), cap),
        "0 rows when the budget holds less than one: at least 1 (a single row must run whatever the budget)":
            0 if fit == 0 else min(1 << (fit.bit_length() - 1), cap),
        f"not capped at the next power of two of n_rows ({cap}): one chunk holds the whole batch":
            1 << (max(1, fit).bit_length() - 1),
        "not a power of two: round the rows that fit down to one (tiles stay whole)": max(1, min(fit, cap)),
    }
    return next((cause for cause, want in variants.items() if want != expected and got == want), None)
