"""What every kernel test shares: tolerances, the comparison with a float64 reference, layouts.

* :data:`TOLERANCES` — ``(rtol, atol)`` of an output against the float64 reference *rounded to the
  output's dtype*: one unit of rounding for fp16/bf16, and room for a GPU's approximate ``exp`` /
  ``erf`` (or TF32) in fp32. Ops that accumulate long sums (matmul, a K-reduction) pass
  ``slack=2``.
* :func:`assert_matches` — elementwise within that tolerance, **or**, when torch's own result in
  the low precision is given (``lowp=``), flash-attention's criterion: the kernel's largest error
  against float64 is at most twice torch's own largest error (plus ``atol``). The second form
  scales with the problem (long rows, large values), so a fresh random seed cannot push a correct
  kernel over a fixed bound.
* :func:`paged_attention_reference` — ``kernel_ladder.paged_attention`` written out: each sequence's K/V
  gathered from the paged cache (``kernel_ladder.ops.paged_attention.gather_kv``), scores, mask, softmax.
* :func:`make_input` — a tensor of a logical shape in a given memory layout (transposed, sliced,
  expanded, permuted), never a hidden copy.
* :func:`assert_equals_hugging_face` — a ``kernel_ladder.models`` model against the Hugging Face model it was
  built from: logits, loss and every parameter's gradient (:func:`rel_error` of each);
  :func:`random_prompts` and :func:`hf_greedy` — prompts, and HF's greedy continuation of one, for the
  ``Engine``'s generation to equal.

The fixtures (``gen``: a seeded generator whose seed is printed and can be replayed with
``KERNEL_LADDER_SEED``; ``poisoned``: every buffer the ops allocate starts as NaN) live in
``tests/conftest.py``.
"""

from __future__ import annotations

import torch

import kernel_ladder

__all__ = ["DEVICE", "DTYPES", "LAYOUTS", "TOLERANCES", "assert_equals_hugging_face", "assert_matches", "hf_greedy",
           "make_input", "paged_attention_reference", "random_prompts", "rel_error", "tolerance"]

DEVICE = kernel_ladder.runtime.DEVICE
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "permuted")

#: (rtol, atol) against the float64 reference rounded to the output dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype, slack: float = 1.0) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype``, times ``slack``."""
    rtol, atol = TOLERANCES[dtype]
    return rtol * slack, atol * slack


def assert_matches(
    out: torch.Tensor,
    reference64: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    lowp: torch.Tensor | None = None,
    slack: float = 1.0,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = False,
    contiguous: bool = True,
    what: str = "output",
) -> None:
    """Assert that ``out`` matches the float64 ``reference64`` to ``dtype``'s precision (see the module).

    ``dtype``, when given, must be ``out``'s dtype (it defaults to it). NaN and inf must sit where
    the reference has them (NaN only with ``equal_nan``). ``lowp`` is torch's own result in the low
    precision: then a kernel whose largest error is at most twice torch's also passes.
    ``contiguous`` (default): ``out`` must also be a contiguous tensor, what every op promises.
    """
    if dtype is not None:
        assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    dtype = out.dtype
    assert out.shape == reference64.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(reference64.shape)}"
    if contiguous:
        assert out.is_contiguous(), f"{what}: not contiguous (strides {out.stride()})"
    default_rtol, default_atol = tolerance(dtype, slack)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    got = out.detach().double().cpu()
    exact = reference64.detach().double().cpu()
    rounded = exact.to(dtype).double()
    both_nan = torch.isnan(got) & torch.isnan(rounded)
    if not equal_nan:
        assert not both_nan.any(), f"{what}: NaN where a NaN was not allowed ({int(both_nan.sum())} elements)"
    error = (got - rounded).abs()
    ok = (error <= atol + rtol * rounded.abs()) | (got == rounded) | both_nan
    if bool(ok.all()):
        return
    special = ~torch.isfinite(rounded) | ~torch.isfinite(got)
    if lowp is not None and not bool((~ok & special).any()):
        ours = (got - exact).abs().max().item()
        theirs = (lowp.detach().double().cpu() - exact).abs().max().item()
        if ours <= 2 * theirs + atol:
            return
        criterion = f"; and max error {ours:.3g} > 2 x torch's own {dtype} error {theirs:.3g} + atol {atol:g}"
    else:
        criterion = ""
    bad = ~ok
    worst = int(torch.where(bad, torch.nan_to_num(error, nan=float("inf")), torch.full_like(error, -1)).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)) if got.dim() else ()
    raise AssertionError(
        f"{what} ({dtype}): {int(bad.sum())} of {bad.numel()} elements outside rtol={rtol:g}, atol={atol:g}; "
        f"worst at {index}: got {got.reshape(-1)[worst].item():.6g}, expected {rounded.reshape(-1)[worst].item():.6g}"
        f"{criterion} (KERNEL_LADDER_SEED replays the inputs: see the seed printed above)"
    )


def make_input(
    shape, dtype: torch.dtype, layout: str, gen: torch.Generator, scale: float = 2.0, device=DEVICE
) -> torch.Tensor:
    """A tensor of logical ``shape`` whose memory layout is ``layout`` (never a copy of another).

    ``contiguous``; ``transposed`` (last two dims swapped in memory); ``sliced`` (an offset in dim 0,
    a step of 2 in the last dim); ``expanded`` (stride 0 along dim 0); ``permuted`` (all dims
    reversed in memory). Values are ``scale`` times standard normal, drawn in float64 on the CPU.
    """
    shape = tuple(shape)

    def rand(*s):
        return (torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)

    if layout == "contiguous" or len(shape) == 0:
        return rand(*shape)
    if layout == "transposed":
        if len(shape) < 2:
            return rand(*shape)
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return rand(*swapped).transpose(-1, -2)
    if layout == "sliced":
        base = rand(shape[0] + 1, *shape[1:-1], 2 * shape[-1]) if len(shape) > 1 else rand(2 * shape[0] + 1)
        return base[1:, ..., ::2] if len(shape) > 1 else base[1::2]
    if layout == "expanded":
        return rand(1, *shape[1:]).expand(shape)
    if layout == "permuted":
        order = list(reversed(range(len(shape))))
        return rand(*(shape[d] for d in order)).permute(*order)
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def random_targets(
    shape, n_classes: int, gen: torch.Generator, ignore_fraction: float = 0.25, ignore_index: int = -100,
    dtype: torch.dtype = torch.int64, device=DEVICE,
) -> torch.Tensor:
    """Class indices in ``[0, n_classes)`` with about ``ignore_fraction`` of them ``ignore_index``.

    At least one target always stays valid: a batch with none has a NaN mean loss, which no
    comparison of outputs can check (NaN never equals NaN), so it would fail a test by chance once
    in ``ignore_fraction ** numel`` draws. The all-ignored batch has tests of its own.
    """
    t = torch.randint(0, n_classes, tuple(shape), generator=gen)
    ignored = torch.rand(tuple(shape), generator=gen) < ignore_fraction
    if t.numel() and bool(ignored.all()):
        ignored.view(-1)[0] = False
    t[ignored] = ignore_index
    return t.to(dtype).to(device)


def paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale=None, window=None,
                              softcap=None, cu_seqlens_q=None, k_scale=None, v_scale=None,
                              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``kernel_ladder.paged_attention`` written out, per sequence, on the CPU: K/V gathered by the block table
    (:func:`kernel_ladder.ops.paged_attention.gather_kv`, fp8 dequantized by its scales), GQA by
    ``repeat_interleave``, scores, soft-cap, the causal (and window) mask by position, softmax, ``P V``.

    ``dtype=float64`` is the exact reference. A low dtype evaluates it as torch would in that dtype
    (products in it, the softmax in float32 then rounded): torch's own low-precision result, for
    :func:`assert_matches`'s ``lowp``. Queries that see no key (an empty sequence) give 0.
    """
    import math  # noqa: PLC0415

    from kernel_ladder.ops.paged_attention import gather_kv  # noqa: PLC0415

    q = q.detach().cpu()
    head_dim, heads_q = q.shape[-1], q.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=dtype)
    pairs = gather_kv(k_cache.cpu(), v_cache.cpu(), block_tables.cpu(), seq_lens.cpu())
    for b, (k, v) in enumerate(pairs):
        k = k.double() * (float(k_scale) if k_scale is not None else 1.0)
        v = v.double() * (float(v_scale) if v_scale is not None else 1.0)
        rows = slice(b, b + 1) if cu_seqlens_q is None else slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        qb = q[rows].to(dtype)
        n, length = qb.shape[0], k.shape[0]
        if n == 0 or length == 0:
            continue
        group = heads_q // k.shape[1]
        k = k.to(dtype).repeat_interleave(group, 1)
        v = v.to(dtype).repeat_interleave(group, 1)
        s = torch.einsum("thd,shd->hts", qb, k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.double() if dtype == torch.float64 else s.float()
        position = length - n + torch.arange(n)[:, None]
        key = torch.arange(length)[None, :]
        visible = key <= position
        if window is not None:
            visible &= key > position - window
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[rows] = torch.einsum("hts,shd->thd", p.to(dtype), v)
    return out


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of ``a`` from ``b``, relative to ``b``'s largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def assert_grads_close(ref: torch.nn.Module, other: torch.nn.Module) -> None:
    """Every parameter's gradient of ``other`` within 1e-3 relative of ``ref``'s (the same parameters in the same
    order); a gradient that is zero in exact arithmetic (a key bias, which the softmax cancels) is compared
    against the model's largest gradient instead (``atol = 1e-5 x`` that)."""
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for (name, p), q in zip(ref.named_parameters(), other.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5 * scale, msg=name)


def assert_equals_hugging_face(hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, ignored: int = 3) -> None:
    """``ours`` computes what the Hugging Face model ``hf`` does on ``ids`` ``(B, T)``: logits within 1e-4 (relative
    to the largest), the mean next-token loss with ``ids`` as labels (the first ``ignored`` of row 0 set to -100)
    within 1e-4, and every parameter's gradient within 1e-3, under the same names. Both models' gradients are
    cleared first (a model built once per module is compared more than once)."""
    labels = ids.clone()
    labels[0, :ignored] = -100
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) < 1e-4
    hf.zero_grad()
    ours.zero_grad()
    theirs = hf(ids, labels=labels).loss
    mine = ours(ids, labels=labels)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    theirs.backward()
    mine.backward()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert set(hf_params) == set(our_params)
    for name, p in hf_params.items():
        assert rel_error(our_params[name].grad, p.grad) < 1e-3, name


def random_prompts(lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    """One prompt of each length, tokens drawn from ``[3, vocab)`` (clear of the usual special ids 0-2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens Hugging Face's greedy ``generate`` appends to ``prompt``: no stop token (the Engine's
    default), every prompt token attended (one equal to the pad id is not padding)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def alternating_bench(benched: list):
    """A stand-in for Triton's GPU benchmarker (``fn(kernel_call, quantiles) -> timings``) that runs in the
    interpreter: each call runs the candidate, appends to ``benched`` and reports every second candidate as
    the faster one, so a test can see the autotuner keep the "faster" config."""

    def bench(kernel_call, quantiles):
        kernel_call()
        benched.append(1)
        t = 2.0 if len(benched) % 2 else 1.0  # the second candidate is "faster"
        return [t, t, t]

    return bench
