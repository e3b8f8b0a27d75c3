"""kernel_ladder.moe: the sparse MoE block against a float64 loop over experts and tokens — top_k 1 and 2, both
renormalizations, sigmoid-free Mixtral routing, uneven and empty experts, dtypes, strided inputs — and its
gradients for x, router_logits, w_gate_up and w_down; the fused gate/up kernel's epilogues on their own (several
tiles, tile remainders, empty groups); launches independent of E; traced bytes against the ideal; opcheck,
torch.compile; bad input; and, with transformers installed, Hugging Face's MixtralSparseMoeBlock given its own
parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, alternating_bench, assert_matches, tolerance

import kernel_ladder
from kernel_ladder import _launch
from kernel_ladder.autotune import MatmulConfig
from kernel_ladder.ops import grouped_matmul as gm
from kernel_ladder.ops import moe as moe_mod
from kernel_ladder.ops import moe_configs

pytestmark = pytest.mark.usefixtures("poisoned")  # every buffer the ops allocate starts as NaN

DEVICE = kernel_ladder.runtime.DEVICE
SMALL = MatmulConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)


def rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)


def block(gen, T, H, F_, E, dtype=torch.float32, skew=0.0):
    """x, router logits (fp32; ``skew`` starves the high-numbered experts), w_gate_up (E, 2F, H), w_down (E, H, F)."""
    x = rand(gen, T, H, dtype=dtype)
    logits = rand(gen, T, E) - skew * torch.arange(E, device=DEVICE, dtype=torch.float32)
    return x, logits, rand(gen, E, 2 * F_, H, dtype=dtype, scale=H ** -0.5), rand(gen, E, H, F_, dtype=dtype,
                                                                                    scale=F_ ** -0.5)


def loop_reference(x, logits, w_gate_up, w_down, top_k, renormalize=True):
    """Token by token, slot by slot, in x's dtype of the inputs given (float64 for the reference)."""
    probs = torch.softmax(logits.to(torch.float64 if x.dtype == torch.float64 else torch.float32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ffn = w_down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(top_k):
            e = int(ids[t, j])
            gate_up = w_gate_up[e] @ x[t]
            h = F.silu(gate_up[:ffn]) * gate_up[ffn:]
            acc = acc + weights[t, j].to(x.dtype) * (w_down[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


def f64(*tensors):
    return [t.detach().double().cpu() for t in tensors]


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("top_k, renormalize", [(1, True), (2, True), (2, False), (5, True)])
def test_matches_the_loop_over_tokens(top_k, renormalize, gen):
    x, logits, wg, wd = block(gen, 23, 24, 20, 5, skew=1.5)  # uneven experts, some nearly empty
    out = kernel_ladder.moe(x, logits, wg, wd, top_k, renormalize=renormalize)
    ref = loop_reference(*f64(x, logits, wg, wd), top_k, renormalize)
    assert_matches(out, ref, torch.float32, slack=2.0)


def test_empty_experts_and_one_token(gen):
    x, logits, wg, wd = block(gen, 9, 16, 16, 6)
    logits[:, 2:4] = -1e4  # experts 2 and 3 never chosen: empty groups between full ones
    out = kernel_ladder.moe(x, logits, wg, wd, 2)
    assert_matches(out, loop_reference(*f64(x, logits, wg, wd), 2), torch.float32, slack=2.0)
    one = kernel_ladder.moe(x[:1], logits[:1], wg, wd, 2)
    assert_matches(one, loop_reference(*f64(x[:1], logits[:1], wg, wd), 2), torch.float32, slack=2.0)


@pytest.mark.parametrize("checks", [None, False], ids=["checks_default", "checks_off"])
def test_a_nonfinite_router_row_spoils_only_its_own_token(checks, gen):
    """Router rows of NaN, +inf and -inf logits: every other token's output is what it is alone, the
    bad tokens still go to valid, distinct experts, and no kernel leaves its tensors (with the value
    checks off too, a GPU's default). A row with one NaN logit routes around that expert."""
    from utils.trace import trace

    x, logits, wg, wd = block(gen, 10, 16, 16, 6)
    logits[1] = float("nan")
    logits[4, 2] = float("inf")
    logits[6] = float("-inf")
    logits[8, 0] = float("nan")
    _, ids = kernel_ladder.topk_routing(logits, 2)
    assert bool(((ids >= 0) & (ids < 6)).all()) and bool((ids[:, 0] != ids[:, 1]).all())
    with kernel_ladder.runtime.check_values(checks), trace(torch_ops=False) as t:
        out = kernel_ladder.moe(x, logits, wg, wd, 2)
    assert t.out_of_bounds == 0
    good = [0, 2, 3, 5, 7, 9]
    alone = kernel_ladder.moe(x[good], logits[good], wg, wd, 2)
    torch.testing.assert_close(out[good], alone, rtol=1e-6, atol=1e-6)
    assert_matches(out[good], loop_reference(*f64(x[good], logits[good], wg, wd), 2), torch.float32, slack=2.0)
    # One NaN logit reads as -inf: the token's output is the reference's with that logit at -inf.
    cleaned = logits[8:9].clone()
    cleaned[0, 0] = float("-inf")
    assert_matches(out[8:9], loop_reference(*f64(x[8:9], cleaned, wg, wd), 2), torch.float32, slack=2.0)
    # No softmax for rows 1 (all NaN), 4 (+inf) and 6 (all -inf): NaN weights, as torch's, in their rows only.
    assert bool(torch.isnan(out[[1, 4, 6]]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_against_torch_own_error(dtype, gen):
    x, logits, wg, wd = block(gen, 19, 32, 24, 4, dtype=dtype)
    out = kernel_ladder.moe(x, logits, wg, wd, 2)
    assert out.dtype == dtype
    ref = loop_reference(*f64(x, logits, wg, wd), 2)
    lowp = loop_reference(x, logits, wg, wd, 2)  # torch in the low precision (CPU fp16/bf16 matmuls)
    assert_matches(out, ref, dtype, lowp=lowp, slack=2.0)


def test_float64_router_logits_are_routed_in_float32(gen):
    """The router's logits may be float64 (as the docstring says: any float dtype, routed in fp32): the
    same output as the logits rounded to float32 first, and their gradient in float64."""
    x, logits, wg, wd = block(gen, 11, 16, 16, 5)
    logits64 = logits.double().requires_grad_()
    logits32 = logits.clone().requires_grad_()
    out64, out32 = kernel_ladder.moe(x, logits64, wg, wd, 2), kernel_ladder.moe(x, logits32, wg, wd, 2)
    assert torch.equal(out64, out32)
    g = rand(gen, *out64.shape)
    (d64,), (d32,) = torch.autograd.grad(out64, [logits64], g), torch.autograd.grad(out32, [logits32], g)
    assert d64.dtype == torch.float64 and torch.equal(d64, d32.double())


def test_strided_inputs_are_read_in_place(gen):
    x, logits, wg, wd = block(gen, 13, 16, 12, 4)
    x_t = x.t().contiguous().t()  # column-major x
    logits_s = torch.cat([logits, logits], dim=1)[:, ::2]  # a strided view: every other column
    logits_s.copy_(logits)
    wg_p = wg.transpose(1, 2).contiguous().transpose(1, 2)  # (E, 2F, H) stored as (E, H, 2F)
    wd_p = wd.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    out = kernel_ladder.moe(x_t, logits_s, wg_p, wd_p, 2)
    assert_matches(out, loop_reference(*f64(x, logits, wg, wd), 2), torch.float32, slack=2.0)


# --------------------------------------------------------------------------- the fused gate/up kernel


def _ends(sizes):
    return torch.tensor(torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _gate_up_reference(x, w_gate_up, sizes, perm, k):
    """float64 gate/up pre-activations per sorted row: x[perm[r] // k] @ w_gate_up[e]^T."""
    rows = x.double().cpu()[perm.cpu().long() // k]
    out, start = [], 0
    for e, s in enumerate(sizes):
        out.append(rows[start:start + s] @ w_gate_up[e].double().cpu().T)
        start += s
    return torch.cat(out)


@pytest.mark.parametrize("sizes", [[5, 0, 33, 1, 17], [0, 0, 40]])
def test_swiglu_epilogue_and_its_backward_over_many_tiles(sizes, gen):
    """16x16x16 tiles: groups spanning tiles, partial tiles, empty groups, F over two column tiles, K remainder."""
    k, H, F_ = 2, 24, 20  # H % 16 != 0 (the K remainder), F over two 16-wide column tiles
    M = sum(sizes)
    x = rand(gen, (M + 1) // k, H)
    perm = torch.randperm(x.shape[0] * k, generator=gen)[:M].to(torch.int32).to(DEVICE)
    wg = rand(gen, len(sizes), 2 * F_, H, scale=H ** -0.5)
    offsets = _ends(sizes)
    pre = _gate_up_reference(x, wg, sizes, perm, k)
    h = _launch.empty_output((M, F_), x)
    gm.launch_grouped_matmul(x, wg.transpose(1, 2), offsets, h, SMALL, gather=perm, gather_k=k, epilogue="swiglu")
    assert_matches(h, F.silu(pre[:, :F_]) * pre[:, F_:], torch.float32, slack=2.0)
    dh = rand(gen, M, F_)
    got = _launch.empty_output((M, 2 * F_), x)
    gm.launch_grouped_matmul(x, wg.transpose(1, 2), offsets, got, SMALL, gather=perm, gather_k=k,
                             epilogue="swiglu_backward", dh=dh)
    gate, up = pre[:, :F_].requires_grad_(), pre[:, F_:].requires_grad_()
    (F.silu(gate) * up).backward(dh.double().cpu())
    assert_matches(got, torch.cat([gate.grad, up.grad], dim=1), torch.float32, slack=2.0)


# --------------------------------------------------------------------------- gradients


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("top_k, renormalize", [(1, True), (2, True), (2, False)])
def test_gradients_for_every_input(top_k, renormalize, gen):
    x, logits, wg, wd = block(gen, 17, 16, 24, 5, skew=1.0)
    inputs = [t.clone().requires_grad_() for t in (x, logits, wg, wd)]
    out = kernel_ladder.moe(*inputs, top_k, renormalize=renormalize)
    g = rand(gen, *out.shape)
    got = _grads(out, inputs, g)
    ref_inputs = [t.requires_grad_() for t in f64(x, logits, wg, wd)]
    ref = loop_reference(*ref_inputs, top_k, renormalize)
    want = _grads(ref, ref_inputs, g.double().cpu())
    for name, a, b in zip(("x", "router_logits", "w_gate_up", "w_down"), got, want):
        assert_matches(a, b, torch.float32, slack=4.0, what=f"d {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_low_precision(dtype, gen):
    x, logits, wg, wd = block(gen, 11, 16, 16, 4, dtype=dtype)
    inputs = [t.clone().requires_grad_() for t in (x, logits, wg, wd)]
    out = kernel_ladder.moe(*inputs, 2)
    g = rand(gen, *out.shape, dtype=dtype)
    got = _grads(out, inputs, g)
    ref_inputs = [t.requires_grad_() for t in f64(x, logits, wg, wd)]
    want = _grads(loop_reference(*ref_inputs, 2), ref_inputs, g.double().cpu())
    low_inputs = [t.detach().clone().requires_grad_() for t in (x, logits, wg, wd)]
    lowp = _grads(loop_reference(*low_inputs, 2), low_inputs, g)
    for name, a, b, c in zip(("x", "router_logits", "w_gate_up", "w_down"), got, want, lowp):
        # The router's gradient is fp32 (its logits are), but each of its terms is g . y_e with y_e an
        # expert's output in the low precision: it is only as precise as that dtype, whoever computes it.
        rtol, atol = tolerance(dtype, 2.0) if a.dtype != dtype else (None, None)
        assert_matches(a, b, a.dtype, lowp=c, slack=2.0, rtol=rtol, atol=atol, what=f"d {name}")


def test_gradient_of_the_weights_only(gen):
    x, logits, wg, wd = block(gen, 7, 16, 16, 3)
    wg.requires_grad_()
    out = kernel_ladder.moe(x, logits, wg, wd, 2)
    (grad,) = torch.autograd.grad(out.sum(), [wg])
    ref_wg = f64(wg)[0].requires_grad_()
    ref = loop_reference(*f64(x, logits), ref_wg, f64(wd)[0], 2)
    (want,) = torch.autograd.grad(ref.sum(), [ref_wg])
    assert_matches(grad, want, torch.float32, slack=4.0)


def test_autotuned_launch_path_in_the_interpreter(gen, monkeypatch):
    """The GPU launch path of all four grouped GEMMs (autotuner, pruner, the grid from the chosen tiles), forward
    and backward, with a stand-in benchmarker: the "faster" tile wins, each kind tunes once per key."""
    benched = []
    bench = alternating_bench(benched)

    candidates = (moe_configs.GroupedConfig(16, 16, 16, 4, 1), moe_configs.GroupedConfig(32, 32, 32, 4, 1))
    monkeypatch.setattr(kernel_ladder.autotune, "autotune_supports_disk_cache", lambda: False)
    tuned = {kind: moe_configs.make_grouped_autotuned(kind, True, candidates, do_bench=bench)
             for kind in moe_configs.KINDS}
    monkeypatch.setattr(moe_configs, "fixed_config", lambda *args, **kwargs: None)  # as on a GPU
    monkeypatch.setattr(moe_configs, "autotuned", lambda kind, wide: tuned[kind])
    x, logits, wg, wd = block(gen, 23, 16, 24, 5, skew=1.0)
    g = rand(gen, 23, 16)
    for call in range(2):  # the second call is served from the tuning caches
        inputs = [t.clone().requires_grad_() for t in (x, logits, wg, wd)]
        out = kernel_ladder.moe(*inputs, 2)
        got = _grads(out, inputs, g)
        if call == 0:
            first = len(benched)
    keys = sum(len(t.cache) for t in tuned.values())
    assert len(benched) == first == 2 * keys  # each key tuned once, over both candidates
    assert all(t.cache for t in tuned.values())  # gate/up, its backward, the plain products and dw all tuned
    assert {c.kwargs["BLOCK_M"] for t in tuned.values() for c in t.cache.values()} == {32}
    ref_inputs = [t.requires_grad_() for t in f64(x, logits, wg, wd)]
    ref = loop_reference(*ref_inputs, 2)
    assert_matches(out, ref, torch.float32, slack=2.0)
    want = _grads(ref, ref_inputs, g.double().cpu())
    for name, a, b in zip(("x", "router_logits", "w_gate_up", "w_down"), got, want):
        assert_matches(a, b, torch.float32, slack=4.0, what=f"d {name}")


# --------------------------------------------------------------------------- launches and traffic


@pytest.mark.interpreter
def test_launches_do_not_grow_with_the_experts(gen):
    from utils.trace import trace

    counts = []
    for E in (4, 16):
        x, logits, wg, wd = block(gen, 24, 16, 16, E)
        with trace() as t:
            kernel_ladder.moe(x, logits, wg, wd, 2)
        counts.append([launch.kernel for launch in t.launches])
    assert counts[0] == counts[1]
    assert counts[0].count("grouped_matmul_kernel") == 2  # gate/up (+ SwiGLU) and down: no separate swiglu or gather
    assert "moe_gather_kernel" not in counts[0] and "swiglu_kernel" not in counts[0]


@pytest.mark.interpreter
def test_traffic_within_ten_percent_of_the_ideal(gen):
    """The report's sizes: one column tile, groups of at most 64 rows, so each weight is read once."""
    from solutions.ch09_moe import moe_unfused
    from utils.trace import trace
    from utils.traffic import moe_ideal_bytes

    x, logits, wg, wd = block(gen, 128, 64, 64, 8, dtype=torch.float16)
    logits = logits * 0.1  # a balanced router: every expert's group fits one 64-row tile
    _, ids = kernel_ladder.topk_routing(logits, 2)
    assert int(torch.bincount(ids.flatten(), minlength=8).max()) <= 64
    ideal = moe_ideal_bytes(x, logits, wg, wd, ids)
    with trace() as fused:
        kernel_ladder.moe(x, logits, wg, wd, 2)
    with trace() as unfused:
        moe_unfused(x, logits, wg, wd, 2)
    assert fused.bytes <= 1.1 * ideal, (fused.bytes, ideal)
    # The unfused chain's extra round trips: the gathered rows (T·k, H) and the pre-activations (T·k, 2F).
    T, H, F_, k = 128, 64, 64, 2
    assert unfused.bytes - fused.bytes >= 2 * 2 * T * k * (H + 2 * F_) * 0.9


# --------------------------------------------------------------------------- torch integration


def test_opcheck_the_fused_ops(gen):
    x, logits, wg, wd = block(gen, 6, 16, 16, 3)
    _, ids = kernel_ladder.topk_routing(logits, 2)
    perm, offsets = kernel_ladder.moe_permute(ids, 3)
    torch.library.opcheck(moe_mod._moe_gate_up_op, (x, wg, offsets, perm, 2))
    dh = rand(gen, 12, 16)
    torch.library.opcheck(moe_mod._moe_gate_up_backward_op, (dh, x, wg, offsets, perm, 2, True, True))


def test_torch_compile_fullgraph_forward_and_backward(gen):
    x, logits, wg, wd = block(gen, 8, 16, 16, 4)
    inputs = [t.clone().requires_grad_() for t in (x, logits, wg, wd)]
    compiled = torch.compile(kernel_ladder.moe, fullgraph=True, backend="aot_eager")
    out = compiled(*inputs, 2)
    out.sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, logits, wg, wd)]
    kernel_ladder.moe(*eager, 2).sum().backward()
    torch.testing.assert_close(out, kernel_ladder.moe(x, logits, wg, wd, 2))
    for a, b in zip(inputs, eager):
        torch.testing.assert_close(a.grad, b.grad)


# --------------------------------------------------------------------------- bad input


def _bad(over, gen):
    x, logits, wg, wd = block(gen, 4, 8, 8, 3)
    args = {"x": x, "router_logits": logits, "w_gate_up": wg, "w_down": wd, "top_k": 2}
    args.update(over(args))
    return args


@pytest.mark.parametrize("over, error, message", [
    (lambda a: {"top_k": 4}, ValueError, r"top_k must be an int in \[1, E = 3\]"),
    (lambda a: {"top_k": 0}, ValueError, "top_k"),
    (lambda a: {"router_logits": a["router_logits"][:, :2]}, ValueError, r"router_logits must be \(tokens, E\)"),
    (lambda a: {"w_gate_up": a["w_gate_up"][:, :, :4]}, ValueError, "w_gate_up's last dim must be x's hidden"),
    (lambda a: {"w_gate_up": a["w_gate_up"][:, :15]}, ValueError, "2F"),
    (lambda a: {"w_down": a["w_down"][:, :, :4]}, ValueError, r"w_down must be \(E, H, F\)"),
    (lambda a: {"x": a["x"][None]}, ValueError, "x must be 2-D"),
    (lambda a: {"w_down": a["w_down"].half()}, TypeError, "w_down must have x's dtype"),
    (lambda a: {"x": a["x"].long()}, TypeError, "kernel_ladder.moe"),
])
def test_bad_input_errors(over, error, message, gen):
    args = _bad(over, gen)
    with pytest.raises(error, match=message):
        kernel_ladder.moe(**args)


# --------------------------------------------------------------------------- Hugging Face's Mixtral block


def test_matches_mixtral_sparse_moe_block(gen):
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    if not hasattr(modeling, "MixtralExperts"):
        pytest.skip("this transformers keeps Mixtral's experts as separate Linear layers, not the stacked "
                    "(E, 2F, H) / (E, H, F) tensors kernel_ladder.moe takes")
    config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.0)
    hf = modeling.MixtralSparseMoeBlock(config).to(DEVICE)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(rand(gen, *p.shape, scale=p.shape[-1] ** -0.5))
    x = rand(gen, 2, 5, 32).requires_grad_()
    want = hf(x)
    g = rand(gen, *want.shape)
    params = [x, hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj]
    want_grads = torch.autograd.grad(want, params, g)

    flat = x.reshape(-1, 32)
    got = kernel_ladder.moe(flat, F.linear(flat, hf.gate.weight), hf.experts.gate_up_proj, hf.experts.down_proj,
                            config.num_experts_per_tok).reshape(x.shape)
    got_grads = torch.autograd.grad(got, params, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("x", "gate.weight", "gate_up_proj", "down_proj"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d {name}: {m}")


# --------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mixtral_like_block(dtype, gen):
    x, logits, wg, wd = block(gen, 2048, 1024, 1536, 8, dtype=dtype)
    out = kernel_ladder.moe(x, logits, wg, wd, 2)
    from solutions.ch09_moe import experts_loop

    ref = experts_loop(*[t.double() for t in (x, logits, wg, wd)], 2)
    lowp = experts_loop(x, logits, wg, wd, 2)
    assert_matches(out, ref, dtype, lowp=lowp, slack=2.0)
