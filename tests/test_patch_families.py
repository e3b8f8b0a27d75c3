"""kernel_ladder.patch on today's families — Qwen3, Qwen3-MoE, Gemma 3, GPT-OSS, DeepSeek-V3 — against
transformers' own eager code on tiny random configs (``tests/hf_families.py``, fp32): logits, loss (with the
router's auxiliary loss where the family has one) and every parameter's gradient; a padded batch; what the
patched forward dispatches; unpatch_model restoring the original bit for bit; and what patch_model reports.

Every part of these configs runs on kernel_ladder (patch_model warns of nothing and leaves nothing on torch); a
config whose MoE experts have an activation no grouped kernel computes keeps those experts on torch, reported."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_ladder.patch as kp  # noqa: E402
from tests.helpers import assert_grads_close  # noqa: E402
from tests.hf_families import FAMILIES, VOCAB, tiny_model  # noqa: E402
from utils.trace import OpLog  # noqa: E402

MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def _expected_counts(model, family: str) -> dict[str, int]:
    """What patch_model must report replacing, module by module, from the model's own structure."""
    names = [type(m).__name__ for m in model.modules()]
    layers = model.config.num_hidden_layers
    expected = {
        "rms_norm": sum(n.endswith("RMSNorm") for n in names),
        "fused loss": 1,
        "attention (AttentionInterface)": layers,
        "gated_mlp": sum(n.endswith("MLP") and n != "GptOssMLP" for n in names),
        "router": sum(n.endswith(("TopKRouter", "TopkRouter")) for n in names),
        "experts (ExpertsInterface)": sum(n.endswith("Experts") for n in names),
    }
    if family == "deepseek_v3":
        expected["mla attention"] = layers
    else:
        expected["rotary attention"] = layers
    if family in ("qwen3", "qwen3_moe", "gemma3_text"):  # q_norm and k_norm run inside the attention's rope
        expected["rms_norm"] -= 2 * layers
        expected["qk_norm (in rope)"] = 2 * layers
    # every nn.Linear but those a gated MLP runs itself
    gated = [m for m in model.modules() if type(m).__name__.endswith("MLP") and type(m).__name__ != "GptOssMLP"]
    mlp_linears = {id(c) for m in gated for c in m.modules() if c is not m}
    expected["linear"] = sum(isinstance(m, torch.nn.Linear) and id(m) not in mlp_linears for m in model.modules())
    return {k: v for k, v in expected.items() if v}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


def _patch(model) -> dict[str, int]:
    """patch_model, which must leave nothing on torch here and say nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replaced = kp.patch_model(model)
    assert not any(" left on torch (" in kind or kind.startswith("mlp unfused") for kind in replaced), replaced
    return replaced


def _ids(shape=(2, 11), seed=1):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_patched_family_equals_transformers_and_unpatches_exactly(family):
    """11 tokens: longer than every sliding window (4). MoE families with the router's auxiliary loss on."""
    ref = tiny_model(family)
    if family in ("qwen3_moe", "gpt_oss"):
        ref.config.output_router_logits = True
        ref.config.router_aux_loss_coef = 0.5
    model = copy.deepcopy(ref)
    assert _patch(model) == _expected_counts(ref, family)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
        assert _rel(model(ids).logits, want) < 1e-4
    theirs = ref(ids, labels=ids)
    ours = model(ids, labels=ids)
    assert ours.logits is None  # the fused loss never made them
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-4, atol=1e-6)
    if ref.config.output_router_logits if hasattr(ref.config, "output_router_logits") else False:
        torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-4, atol=1e-6)
    theirs.loss.backward()
    ours.loss.backward()
    assert_grads_close(ref, model)
    assert kp.unpatch_model(model) is model
    assert model.config._attn_implementation == ref.config._attn_implementation == "eager"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # transformers' own code path, bit for bit


def _padded(ids: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of 9, 6 and 4 real tokens padded on one side (pad id 0): ids, attention_mask, labels: -100 at the
    padding and, left-padded, at each row's first token — a target only a padded position would predict (there
    the patched attention gives 0, as transformers' flash-attention and SDPA do; its eager code, the reference
    here, averages the values instead)."""
    mask = torch.zeros(ids.shape, dtype=torch.long)
    labels = ids.clone()
    for row, n in enumerate((9, 6, 4)):
        if side == "left":
            mask[row, ids.shape[1] - n:] = 1
            labels[row, ids.shape[1] - n] = -100
        else:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, labels.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("family, side", [("qwen3", "left"), ("qwen3_moe", "right"), ("gemma3_text", "right"),
                                          ("gpt_oss", "left"), ("deepseek_v3", "right")])
def test_a_padded_batch_equals_transformers_at_every_real_token(family, side):
    """The logits at the real tokens and the loss (labels -100 at the padding, as transformers' collators make
    them); windows of 4 shorter than the longest row. DeepSeek-V3 here in its other variant: a full-rank query
    projection (``q_lora_rank=None``) and rotate-half rope."""
    ref = tiny_model(family, **(dict(q_lora_rank=None, rope_interleave=False) if family == "deepseek_v3" else {}))
    model = copy.deepcopy(ref)
    _patch(model)
    ids, mask, labels = _padded(_ids((3, 9), seed=2), side)
    with torch.no_grad():
        real = mask.bool()
        assert _rel(model(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real]) < 1e-4
        torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss,
                                   ref(ids, attention_mask=mask, labels=labels).loss, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_patched_forward_runs_kernel_ladder_ops(family):
    """What the family's forward dispatches once patched: its parts' ops, and no torch softmax, SDPA or matmul
    (the control: transformers' own forward runs them)."""
    model = tiny_model(family, num_hidden_layers=2 if family in ("qwen3_moe", "deepseek_v3") else 1)  # a MoE layer
    ids = _ids((1, 6), seed=3)

    def dispatched():
        with torch.no_grad(), OpLog() as log:
            model(ids)
        return log.names

    before = dispatched()
    assert any("softmax" in n for n in before) and any(n in ("aten.mm", "aten.bmm") for n in before)
    _patch(model)
    after = dispatched()
    wanted = {"kernel_ladder.rms_norm", "kernel_ladder.rope", "kernel_ladder.linear", "kernel_ladder.flash_attention"}
    if family != "gpt_oss":  # every GPT-OSS layer is a MoE layer
        wanted.add("kernel_ladder.gated_mlp")
    if family in MOE:
        wanted |= {"kernel_ladder.topk_routing", "kernel_ladder.grouped_matmul"}
    assert wanted <= after, (sorted(wanted - after), sorted(after))
    assert not any("softmax" in n or "scaled_dot_product" in n or n in ("aten.mm", "aten.addmm", "aten.bmm")
                   for n in after), sorted(after)


def test_patched_greedy_generation_equals_transformers():
    """transformers' generate with its cache, on GPT-OSS (sinks, a sliding layer's window of 4 under a 7-token
    prompt, a full layer): the patched model picks the same tokens as the original, step by step."""
    family = "gpt_oss"
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    _patch(model)
    prompt = _ids((1, 7), seed=4)
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(prompt, **options)
        got = model.generate(prompt, **options)
    assert want.shape[1] == 12
    assert torch.equal(got, want), (got, want)


def test_experts_whose_activation_has_no_kernel_stay_on_torch_and_are_reported():
    """Qwen3-MoE with hidden_act="gelu": the grouped experts kernels gate with SiLU only, so the experts keep
    transformers' code (and its activation) — reported, a warning and a count — while everything else is patched;
    the model still equals the original (the control: transformers' own gelu experts differ from SiLU ones)."""
    ref = tiny_model("qwen3_moe", hidden_act="gelu")
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=r"1 experts module left on torch .*hidden_act='gelu'"):
        replaced = kp.patch_model(model)
    assert replaced["experts left on torch (hidden_act='gelu': kernel_ladder's experts kernels gate with SiLU or "
                    "GPT-OSS's clamped SwiGLU)"] == 1
    assert "experts (ExpertsInterface)" not in replaced and replaced["router"] == 1
    assert model.config._experts_implementation == ref.config._experts_implementation
    ids = _ids((2, 7), seed=5)
    with torch.no_grad():
        want = ref(ids).logits
        assert _rel(model(ids).logits, want) < 1e-4
        assert _rel(tiny_model("qwen3_moe")(ids).logits, want) > 1e-3
    kp.unpatch_model(model)


def test_a_qk_norm_pair_with_two_eps_is_refused():
    """The fused rope takes one norm_eps for q and k: a model whose q_norm and k_norm were given different eps is
    refused by name rather than normalized with the wrong one."""
    model = tiny_model("qwen3", num_hidden_layers=1)
    model.model.layers[0].self_attn.k_norm.variance_epsilon = 1e-3
    _patch(model)
    with pytest.raises(ValueError, match=r"kernel_ladder\.patch\.patch_model: Qwen3Attention's q_norm and k_norm have "
                                         r"different eps \(1e-06, 0\.001\)"):
        model(_ids((1, 4)))
