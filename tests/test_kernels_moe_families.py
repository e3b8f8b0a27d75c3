"""kernel_ladder.moe for today's MoE families, against float64 references and Hugging Face's own blocks:

* GPT-OSS — ``gate_up_layout="gpt_oss"`` (``(E, H, 2F)`` with gate/up interleaved, ``(E, F, H)`` down), the
  clamped SwiGLU ``activation="swiglu_oai"`` with ``alpha``/``limit`` (cases where the clamps hold a good share
  of the values), both biases: forward and the gradient of x, the router logits, every weight and every bias;
  the gate epilogues on their own over many tiles;
* DeepSeek-V3 — grouped sigmoid routing with the correction bias and scaling factor, and shared experts;
* Qwen3-MoE — 128 experts, top-8, a few tokens: most experts get no row or one (empty and one-row groups in
  the grouped GEMMs);
* grouped_matmul's bias on its own (empty groups, rows past the last group).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches

import kernel_ladder
from kernel_ladder.autotune import MatmulConfig
from kernel_ladder.ops import grouped_matmul as gm
from kernel_ladder.ops import moe as moe_mod

pytestmark = pytest.mark.usefixtures("poisoned")

DEVICE = kernel_ladder.runtime.DEVICE
SMALL = MatmulConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)


def rand(gen, *shape, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).float().to(DEVICE)


def f64(*tensors):
    return [t.detach().double().cpu().requires_grad_(t.requires_grad) for t in tensors]


def oai_gate(gate_up, alpha, limit):
    """transformers' ``GptOssExperts._apply_gate``: interleaved columns, clamps, (up + 1) * glu."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def gpt_oss_reference(x, logits, w_gu, b_gu, w_d, b_d, top_k, alpha, limit):
    """GptOssMLP in float64 torch ops, token by token: top-k of the logits, softmax over them, the experts."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(top_k):
            e = int(ids[t, j])
            h = oai_gate(x[t] @ w_gu[e] + b_gu[e], alpha, limit)
            acc = acc + weights[t, j] * (h @ w_d[e] + b_d[e])
        rows.append(acc)
    return torch.stack(rows)


def gpt_oss_block(gen, T, H, F_, E, scale=1.5):
    """x, logits, gate_up (E, H, 2F), its bias, down (E, F, H), its bias: large enough that the clamps act."""
    return (rand(gen, T, H), rand(gen, T, E), rand(gen, E, H, 2 * F_, scale=scale), rand(gen, E, 2 * F_),
            rand(gen, E, F_, H, scale=F_ ** -0.5), rand(gen, E, H))


def _clamped_shares(x, w_gu, b_gu, limit):
    pre = torch.einsum("th,ehf->tef", x.double(), w_gu.double()) + b_gu.double()
    return float((pre[..., ::2] > limit).double().mean()), float((pre[..., 1::2].abs() > limit).double().mean())


# --------------------------------------------------------------------------- GPT-OSS


@pytest.mark.parametrize("top_k, alpha, limit", [(2, 1.702, 2.0), (3, 1.0, 7.0), (1, 1.702, 0.5)])
def test_gpt_oss_experts_match_the_float64_reference(top_k, alpha, limit, gen):
    x, logits, w_gu, b_gu, w_d, b_d = gpt_oss_block(gen, 13, 16, 12, 5, scale=2.0 if limit < 7 else 3.0)
    out = kernel_ladder.moe(x, logits, w_gu, w_d, top_k, activation="swiglu_oai", alpha=alpha, limit=limit,
                            gate_up_bias=b_gu, down_bias=b_d, gate_up_layout="gpt_oss")
    ref = gpt_oss_reference(*f64(x, logits, w_gu, b_gu, w_d, b_d), top_k, alpha, limit)
    assert_matches(out, ref, torch.float32, slack=4.0)
    gate_share, up_share = _clamped_shares(x, w_gu, b_gu, limit)
    assert gate_share > 0.05 and up_share > 0.05, (gate_share, up_share)  # the clamps are exercised


def test_gpt_oss_gradients_of_every_input_weight_and_bias(gen):
    alpha, limit, top_k = 1.702, 1.5, 2
    inputs = [t.requires_grad_() for t in gpt_oss_block(gen, 11, 16, 12, 4)]
    x, logits, w_gu, b_gu, w_d, b_d = inputs
    assert min(_clamped_shares(x, w_gu, b_gu, limit)) > 0.05
    out = kernel_ladder.moe(x, logits, w_gu, w_d, top_k, activation="swiglu_oai", alpha=alpha, limit=limit,
                            gate_up_bias=b_gu, down_bias=b_d, gate_up_layout="gpt_oss")
    g = rand(gen, *out.shape)
    got = torch.autograd.grad(out, inputs, g)
    ref_inputs = f64(*inputs)
    want = torch.autograd.grad(gpt_oss_reference(*ref_inputs, top_k, alpha, limit), ref_inputs, g.double().cpu())
    names = ("x", "router_logits", "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    for name, a, b in zip(names, got, want):
        assert_matches(a, b, torch.float32, slack=4.0, what=f"d {name}")
    # The clamp's zero gradient: a gate/up column whose pre-activation is clamped for every routed row gets none.
    assert bool((got[3] == 0).any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt_oss_experts_in_low_precision(dtype, gen):
    """Forward and gradients in fp16/bf16 (weights, biases and x in the dtype, as a loaded checkpoint): within
    twice torch's own error in that dtype of the float64 reference."""
    alpha, limit, top_k = 1.702, 1.5, 2
    block = [t.to(dtype) if i != 1 else t for i, t in enumerate(gpt_oss_block(gen, 9, 16, 8, 3))]
    inputs = [t.clone().requires_grad_() for t in block]
    x, logits, w_gu, b_gu, w_d, b_d = inputs
    out = kernel_ladder.moe(x, logits, w_gu, w_d, top_k, activation="swiglu_oai", alpha=alpha, limit=limit,
                            gate_up_bias=b_gu, down_bias=b_d, gate_up_layout="gpt_oss")
    g = rand(gen, *out.shape).to(dtype)
    got = torch.autograd.grad(out, inputs, g)
    ref_inputs = f64(*inputs)
    ref = gpt_oss_reference(*ref_inputs, top_k, alpha, limit)
    want = torch.autograd.grad(ref, ref_inputs, g.double().cpu())
    low_inputs = [t.detach().clone().requires_grad_() for t in block]
    low = gpt_oss_reference(*low_inputs, top_k, alpha, limit)
    lowp = torch.autograd.grad(low, low_inputs, g)
    assert_matches(out, ref, dtype, lowp=low.detach(), slack=2.0)
    names = ("x", "router_logits", "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    for name, a, b, c in zip(names, got, want, lowp):
        assert_matches(a, b, a.dtype, lowp=c, slack=2.0, what=f"d {name}")


def test_clamped_gate_epilogue_and_its_backward_over_many_tiles(gen):
    """The grouped kernel alone, 16x16 tiles: tile remainders, empty groups, gathered rows, interleaved weights
    and bias, both clamps, against torch's clamp and autograd (which passes the gradient on the bounds)."""
    sizes, k, H, F_, alpha, limit = [5, 0, 33, 1, 17], 2, 40, 24, 1.702, 1.0
    E, M = len(sizes), sum(sizes)
    x = rand(gen, M // k + 1, H)
    perm = torch.randperm(x.shape[0] * k, generator=gen)[:M].int().to(DEVICE)
    offsets = torch.tensor(sizes).cumsum(0).int().to(DEVICE)
    w, b = rand(gen, E, H, 2 * F_, scale=0.6), rand(gen, E, 2 * F_)
    h = torch.empty(M, F_, device=DEVICE)
    gm.launch_grouped_matmul(x, w, offsets, h, SMALL, gather=perm, gather_k=k, epilogue="swiglu_oai", bias=b,
                             interleaved=True, alpha=alpha, limit=limit)
    group = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    rows = x.double().cpu()[perm.long().cpu() // k]
    pre = (torch.einsum("mh,mhf->mf", rows, w.double().cpu()[group]) + b.double().cpu()[group]).requires_grad_()
    ref = oai_gate(pre, alpha, limit)
    assert_matches(h, ref, torch.float32, slack=2.0)
    dh = rand(gen, M, F_)
    got = torch.empty(M, 2 * F_, device=DEVICE)
    gm.launch_grouped_matmul(x, w, offsets, got, SMALL, gather=perm, gather_k=k, epilogue="swiglu_oai_backward",
                             dh=dh, bias=b, interleaved=True, alpha=alpha, limit=limit)
    (want,) = torch.autograd.grad(ref, [pre], dh.double().cpu())
    assert_matches(got, want, torch.float32, slack=2.0)
    assert float((want == 0).double().mean()) > 0.1  # clamped entries: zero gradient, seen


def test_gpt_oss_layout_is_the_mixtral_layout_reordered(gen):
    """The same experts in both layouts (gate/up de-interleaved and transposed by hand) give the same block."""
    x, logits, w_gu, b_gu, w_d, b_d = gpt_oss_block(gen, 9, 16, 8, 3, scale=0.5)
    mixtral_gu = torch.cat([w_gu[..., ::2], w_gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    mixtral_b = torch.cat([b_gu[..., ::2], b_gu[..., 1::2]], dim=-1)
    for activation, extra in (("silu", {}), ("swiglu_oai", {"limit": 1.0})):
        got = kernel_ladder.moe(x, logits, w_gu, w_d, 2, activation=activation, gate_up_bias=b_gu, down_bias=b_d,
                                gate_up_layout="gpt_oss", **extra)
        want = kernel_ladder.moe(x, logits, mixtral_gu, w_d.transpose(1, 2).contiguous(), 2, activation=activation,
                                 gate_up_bias=mixtral_b, down_bias=b_d, **extra)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_matches_transformers_gpt_oss_mlp(gen):
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                          swiglu_limit=2.0)
    mlp = modeling.GptOssMLP(config).to(DEVICE)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(rand(gen, *p.shape, scale=0.6))
    x = rand(gen, 2, 5, 32).requires_grad_()
    want, _ = mlp(x)
    g = rand(gen, *want.shape)
    experts = mlp.experts
    params = [x, mlp.router.weight, mlp.router.bias, experts.gate_up_proj, experts.gate_up_proj_bias,
              experts.down_proj, experts.down_proj_bias]
    want_grads = torch.autograd.grad(want, params, g)
    flat = x.reshape(-1, 32)
    logits = torch.nn.functional.linear(flat, mlp.router.weight, mlp.router.bias)
    got = kernel_ladder.moe(flat, logits, experts.gate_up_proj, experts.down_proj, 2, activation="swiglu_oai",
                            alpha=config.swiglu_alpha, limit=config.swiglu_limit,
                            gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
                            gate_up_layout="gpt_oss").reshape(x.shape)
    got_grads = torch.autograd.grad(got, params, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    names = ("x", "router.weight", "router.bias", "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d {name}: {m}")


def test_experts_forward_takes_the_gpt_oss_options(gen):
    x, logits, w_gu, b_gu, w_d, b_d = gpt_oss_block(gen, 7, 16, 8, 3)
    weights, ids = kernel_ladder.topk_routing(logits, 2)
    got = moe_mod.experts_forward(x, ids, weights, w_gu, w_d, activation="swiglu_oai", limit=1.0, gate_up_bias=b_gu,
                                  down_bias=b_d, gate_up_layout="gpt_oss")
    want = kernel_ladder.moe(x, logits, w_gu, w_d, 2, activation="swiglu_oai", limit=1.0, gate_up_bias=b_gu,
                             down_bias=b_d, gate_up_layout="gpt_oss")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------- DeepSeek-V3 and shared experts


def _deepseek_moe(gen, norm):
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                              norm_topk_prob=norm)
    block = modeling.DeepseekV3MoE(config).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(rand(gen, *p.shape, scale=p.shape[-1] ** -0.5))
        block.gate.e_score_correction_bias.copy_(rand(gen, 16, scale=0.1))
    return config, block


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_matches_transformers_deepseek_v3_moe_with_shared_experts(norm, gen):
    config, block = _deepseek_moe(gen, norm)
    x = rand(gen, 2, 6, 32).requires_grad_()
    want = block(x)
    g = rand(gen, *want.shape)
    se = block.shared_experts
    params = [x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, se.gate_proj.weight,
              se.up_proj.weight, se.down_proj.weight]
    want_grads = torch.autograd.grad(want, params, g)
    flat = x.reshape(-1, 32)
    logits = torch.nn.functional.linear(flat, block.gate.weight)
    got = kernel_ladder.moe(flat, logits, block.experts.gate_up_proj, block.experts.down_proj, 4, norm,
                            scoring="sigmoid", bias=block.gate.e_score_correction_bias, num_groups=4, topk_groups=2,
                            scale=2.5, shared=(se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight))
    got = got.reshape(x.shape)
    got_grads = torch.autograd.grad(got, params, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    names = ("x", "gate.weight", "gate_up_proj", "down_proj", "shared gate", "shared up", "shared down")
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d {name}: {m}")


def test_shared_experts_add_a_gated_mlp_of_every_token(gen):
    x, logits = rand(gen, 9, 16), rand(gen, 9, 4)
    wg, wd = rand(gen, 4, 24, 16, scale=0.25), rand(gen, 4, 16, 12, scale=0.3)
    shared = (rand(gen, 8, 16, scale=0.25), rand(gen, 8, 16, scale=0.25), rand(gen, 16, 8, scale=0.35))
    got = kernel_ladder.moe(x, logits, wg, wd, 2, shared=shared)
    routed = kernel_ladder.moe(x, logits, wg, wd, 2)
    xs, (sg, su, sd) = x.double(), (t.double() for t in shared)
    want = routed.double() + (torch.nn.functional.silu(xs @ sg.T) * (xs @ su.T)) @ sd.T
    assert_matches(got, want, torch.float32, slack=2.0)


# --------------------------------------------------------------------------- Qwen3-MoE: many experts, tiny groups


def test_qwen3_moe_128_experts_top8_few_tokens(gen):
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True)
    block = modeling.Qwen3MoeSparseMoeBlock(config).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(rand(gen, *p.shape, scale=p.shape[-1] ** -0.5))
    x = rand(gen, 1, 6, 32).requires_grad_()
    want = block(x)
    flat = x.reshape(-1, 32)
    logits = torch.nn.functional.linear(flat, block.gate.weight)
    _, ids = kernel_ladder.topk_routing(logits, 8)
    counts = torch.bincount(ids.flatten().cpu(), minlength=128)
    assert int((counts <= 1).sum()) >= 100 and int((counts == 0).sum()) >= 70  # most groups empty or one row
    got = kernel_ladder.moe(flat, logits, block.experts.gate_up_proj, block.experts.down_proj, 8)
    torch.testing.assert_close(got.reshape(x.shape), want, rtol=1e-5, atol=1e-5)
    g = rand(gen, *want.shape)
    params = [x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    want_grads = torch.autograd.grad(want, params, g)
    got_grads = torch.autograd.grad(got.reshape(x.shape), params, g)
    for name, a, b in zip(("x", "gate.weight", "gate_up_proj", "down_proj"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d {name}: {m}")


# --------------------------------------------------------------------------- grouped_matmul's bias


def test_grouped_matmul_bias_forward_and_backward(gen):
    sizes, K, N = [4, 0, 19, 1], 24, 20
    M = sum(sizes) + 3  # three rows past the last group: zero, no bias
    offsets = torch.tensor(sizes).cumsum(0).int().to(DEVICE)
    x, w, b = rand(gen, M, K).requires_grad_(), rand(gen, 4, K, N).requires_grad_(), rand(gen, 4, N).requires_grad_()
    out = kernel_ladder.grouped_matmul(x, w, offsets, bias=b)
    group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    xr, wr, br = f64(x, w, b)
    ref = torch.cat([torch.einsum("mk,mkn->mn", xr[:-3], wr[group]) + br[group], xr.new_zeros(3, N)])
    assert_matches(out, ref, torch.float32, slack=2.0)
    g = rand(gen, M, N)
    got = torch.autograd.grad(out, [x, w, b], g)
    want = torch.autograd.grad(ref, [xr, wr, br], g.double().cpu())
    for name, a, c in zip(("x", "w", "bias"), got, want):
        assert_matches(a, c, torch.float32, slack=2.0, what=f"d {name}")
    assert bool((got[2][1] == 0).all())  # the empty group's bias gets no gradient
    (db,) = torch.autograd.grad(kernel_ladder.grouped_matmul(x, w, offsets, bias=b), [b], g)
    torch.testing.assert_close(db, got[2])  # the bias alone (no weight gradient asked)


# --------------------------------------------------------------------------- torch integration and errors


def test_opcheck_the_gpt_oss_path(gen):
    """The ops' fakes and autograd (torch.compile of the whole GPT-OSS block: test_kernels_compile_torch.py)."""
    x, logits, w_gu, b_gu, w_d, b_d = gpt_oss_block(gen, 6, 16, 8, 3)
    _, ids = kernel_ladder.topk_routing(logits, 2)
    perm, offsets = kernel_ladder.moe_permute(ids, 3)
    args = (x, w_gu, offsets, perm, 2, b_gu, "swiglu_oai", 1.702, 1.0, "gpt_oss")
    torch.library.opcheck(moe_mod._moe_gate_up_op, args)
    dh = rand(gen, 12, 8)
    torch.library.opcheck(moe_mod._moe_gate_up_backward_op,
                          (dh, x, w_gu, offsets, perm, 2, True, True, b_gu, True, "swiglu_oai", 1.702, 1.0, "gpt_oss"))
    torch.library.opcheck(gm._grouped_matmul_op, (rand(gen, 12, 8), w_d, offsets, b_d))


def _args(gen, **over):
    x, logits, w_gu, b_gu, w_d, b_d = gpt_oss_block(gen, 4, 8, 6, 3)
    args = {"x": x, "router_logits": logits, "w_gate_up": w_gu, "w_down": w_d, "top_k": 2,
            "activation": "swiglu_oai", "gate_up_bias": b_gu, "down_bias": b_d, "gate_up_layout": "gpt_oss"}
    args.update(over)
    return args


@pytest.mark.parametrize("over, error, message", [
    ({"gate_up_layout": "deepseek"}, ValueError, "gate_up_layout"),
    ({"activation": "gelu"}, ValueError, "activation"),
    ({"activation": "silu", "limit": 7.0}, ValueError, "alpha and limit belong to activation='swiglu_oai'"),
    ({"limit": "7"}, TypeError, "limit must be a float or None, got str"),
    ({"limit": -1.0}, ValueError, "limit must be >= 0"),
    ({"gate_up_bias": torch.zeros(3, 6)}, ValueError, r"gate_up_bias must be \(3, 12\), got shape \(3, 6\)"),
    ({"down_bias": torch.zeros(3, 6)}, ValueError, r"down_bias must be \(3, 8\)"),
    ({"down_bias": torch.zeros(3, 8, dtype=torch.int64)}, TypeError, "down_bias"),
    ({"w_down": torch.zeros(3, 8, 6)}, ValueError, r"w_down must be \(E, F, H\) = \(3, 6, 8\)"),
    ({"gate_up_layout": "mixtral"}, ValueError, "w_gate_up's last dim must be x's hidden size 8"),
    ({"shared": (torch.zeros(4, 8),)}, TypeError, "shared must be a tuple of 3 tensors"),
    ({"num_groups": 3}, ValueError, "num_groups and topk_groups go together"),
])
def test_bad_family_arguments_raise_clear_errors(over, error, message, gen):
    with pytest.raises(error, match=r"kernel_ladder\.(moe|topk_routing): " + message):
        kernel_ladder.moe(**_args(gen, **over))
