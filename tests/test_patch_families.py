"""kernel_ladder.patch on today's families — Qwen3, Qwen3-MoE, Gemma 3, GPT-OSS, DeepSeek-V3 — against
transformers' own eager code on tiny random configs (``tests/hf_families.py``, fp32): logits, loss (with the
router's auxiliary loss where the family has one) and every parameter's gradient; a padded batch; what the
patched forward dispatches; unpatch_model restoring the original bit for bit; and what patch_model reports.

A part whose kernel this ``kernel_ladder`` lacks stays on torch and is reported (a warning and a count); the
tests check that report against the kernels' features, and that nothing else is left on torch."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_ladder  # noqa: E402
import kernel_ladder.patch as kp  # noqa: E402
from kernel_ladder.ops.moe import experts_forward  # noqa: E402
from tests.hf_families import FAMILIES, VOCAB, tiny_model  # noqa: E402
from utils.trace import OpLog  # noqa: E402

MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def _takes(function, parameter: str) -> bool:
    return parameter in inspect.signature(function).parameters


SINKS = _takes(kernel_ladder.flash_attention, "sinks")  # and values of another head dim than the keys'


def _left_on_torch(family: str) -> set[str]:
    """The parts this kernel_ladder cannot run for ``family`` (by its kernels' features)."""
    left = set()
    if family in ("gpt_oss", "deepseek_v3") and not SINKS:
        left.add("attention")
    if family == "gpt_oss" and not _takes(experts_forward, "activation"):
        left.add("experts")
    if family == "deepseek_v3" and not _takes(kernel_ladder.topk_routing, "num_groups"):
        left.add("router")
    return left


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
    if family in ("qwen3", "qwen3_moe", "gemma3_text"):  # q_norm and k_norm run inside the attention's forward
        expected["rms_norm"] -= 2 * layers
        fused = _takes(kernel_ladder.rope, "q_norm_weight")
        expected["qk_norm (in rope)" if fused else "qk_norm"] = 2 * layers
    # every nn.Linear but those a gated MLP runs itself
    gated = [m for m in model.modules() if type(m).__name__.endswith("MLP") and type(m).__name__ != "GptOssMLP"]
    mlp_linears = {id(c) for m in gated for c in m.modules() if c is not m}
    expected["linear"] = sum(isinstance(m, torch.nn.Linear) and id(m) not in mlp_linears for m in model.modules())
    return {k: v for k, v in expected.items() if v}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


def _assert_grads_close(ref: torch.nn.Module, patched: torch.nn.Module) -> None:
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for (name, p), q in zip(ref.named_parameters(), patched.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, name
        # 1e-3 relative; a gradient that is zero in exact arithmetic is compared against the model's largest
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5 * scale, msg=name)


def _patch(model, family: str) -> dict[str, int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replaced = kp.patch_model(model)
    left = {kind.split(" left on torch")[0] for kind in replaced if " left on torch (" in kind}
    assert left == _left_on_torch(family), replaced
    warned = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "left on torch" in str(w)]
    assert len(warned) == len(left), warned  # one warning for each part left on torch
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
    replaced = _patch(model, family)
    expected = _expected_counts(ref, family)
    for kind in _left_on_torch(family):
        expected.pop({"attention": "attention (AttentionInterface)", "experts": "experts (ExpertsInterface)",
                      "router": "router"}[kind])
    assert {k: v for k, v in replaced.items() if " left on torch (" not in k} == expected
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
    _assert_grads_close(ref, model)
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
    them); windows of 4 shorter than the longest row."""
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    _patch(model, family)
    ids, mask, labels = _padded(_ids((3, 9), seed=2), side)
    with torch.no_grad():
        real = mask.bool()
        assert _rel(model(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real]) < 1e-4
        torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss,
                                   ref(ids, attention_mask=mask, labels=labels).loss, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_patched_forward_runs_kernel_ladder_ops(family):
    """What the family's forward dispatches once patched: its parts' ops, and no torch softmax, SDPA or matmul
    (the control: transformers' own forward runs them) except where a part is reported left on torch."""
    model = tiny_model(family, num_hidden_layers=2 if family in ("qwen3_moe", "deepseek_v3") else 1)  # a MoE layer
    ids = _ids((1, 6), seed=3)

    def dispatched():
        with torch.no_grad(), OpLog() as log:
            model(ids)
        return log.names

    before = dispatched()
    assert any("softmax" in n for n in before) and any(n in ("aten.mm", "aten.bmm") for n in before)
    _patch(model, family)
    after = dispatched()
    wanted = {"kernel_ladder.rms_norm", "kernel_ladder.rope", "kernel_ladder.linear", "kernel_ladder.gated_mlp"}
    left = _left_on_torch(family)
    if "attention" not in left:
        wanted.add("kernel_ladder.flash_attention")
    if family in MOE and "router" not in left:
        wanted.add("kernel_ladder.topk_routing")
    if family in MOE and "experts" not in left:
        wanted.add("kernel_ladder.grouped_matmul")
    if family == "gpt_oss":
        wanted.discard("kernel_ladder.gated_mlp")  # every GPT-OSS layer is a MoE layer
    assert wanted <= after, (sorted(wanted - after), sorted(after))
    if not left:
        assert not any("softmax" in n or "scaled_dot_product" in n or n in ("aten.mm", "aten.addmm", "aten.bmm")
                       for n in after), sorted(after)
