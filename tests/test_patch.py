"""kernel_ladder.patch on Hugging Face's own models (tiny random configs, fp32): patched against unpatched
logits (or encoder states), loss and every parameter's gradient for each supported family; what
the patched forward dispatches (kernels ops for norms, rotary, attention and MLP; no torch softmax
or SDPA); unpatch_model restores; bad input is refused with clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernel_ladder.patch as kp  # noqa: E402
from tests.helpers import assert_grads_close  # noqa: E402
from utils.trace import OpLog  # noqa: E402

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             max_position_embeddings=64)  # one layer (two for Qwen2: one sliding, one full): the interpreter is slow
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, image_size=16,
              patch_size=4)


def _decoder(family: str):
    t = transformers
    config = {
        "llama": lambda: t.LlamaConfig(**SMALL, num_key_value_heads=2),
        "mistral": lambda: t.MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=5),
        "qwen2": lambda: t.Qwen2Config(**{**SMALL, "num_hidden_layers": 2}, num_key_value_heads=2,
                                       use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "mixtral": lambda: t.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, attn_pdrop=0.0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    }[family]()
    torch.manual_seed(0)
    return t.AutoModelForCausalLM.from_config(config).float().eval()


def _encoder(family: str):
    t = transformers
    torch.manual_seed(0)
    if family == "vit":
        return t.ViTModel(t.ViTConfig(**VISION, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    return t.CLIPVisionModel(t.CLIPVisionConfig(**VISION, hidden_act="gelu")).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


DECODERS = ["llama", "mistral", "qwen2", "mixtral", "gpt2"]


@pytest.mark.parametrize("family", DECODERS)
def test_patched_decoder_equals_the_original_and_unpatches(family):
    ref = _decoder(family)
    model = copy.deepcopy(ref)
    replaced = kp.patch_model(model)
    layers = model.config.num_hidden_layers
    assert replaced["attention (AttentionInterface)"] == layers and replaced["fused loss"] == 1
    assert replaced.get("rms_norm", 0) + replaced.get("layer_norm", 0) == 2 * layers + 1
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))  # 11 > every window
    with torch.no_grad():
        assert _rel(model(ids).logits, ref(ids).logits) < 1e-4
    theirs = ref(ids, labels=ids).loss
    out = model(ids, labels=ids)
    assert out.logits is None  # the fused loss never made them
    torch.testing.assert_close(out.loss, theirs, rtol=1e-4, atol=1e-6)
    theirs.backward()
    out.loss.backward()
    assert_grads_close(ref, model)
    assert kp.unpatch_model(model) is model
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)  # the original code path, bit for bit
    assert model.config._attn_implementation == ref.config._attn_implementation


@pytest.mark.parametrize("family", ["vit", "clip"])
def test_patched_vision_encoder_equals_the_original(family):
    ref = _encoder(family)
    model = copy.deepcopy(ref)
    replaced = kp.patch_model(model)
    assert replaced["attention (AttentionInterface)"] == 1 and replaced["mlp"] == 1 and replaced["layer_norm"] >= 3
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    a, b = ref(pixel_values=pixels).last_hidden_state, model(pixel_values=pixels).last_hidden_state
    assert _rel(b, a) < 1e-4
    w = torch.randn(a.shape, generator=torch.Generator().manual_seed(3))
    (a * w).sum().backward()
    (b * w).sum().backward()
    assert_grads_close(ref, model)


def _dispatched(model, ids) -> set[str]:
    with torch.no_grad(), OpLog() as log:
        model(ids)
    return log.names


def test_the_patched_forward_runs_kernels_ops_and_no_torch_attention():
    model = _decoder("llama")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    before = _dispatched(model, ids)
    assert any("scaled_dot_product" in n or "softmax" in n for n in before)  # the control: HF's own path
    kp.patch_model(model)
    after = _dispatched(model, ids)
    for op in ("kernel_ladder.rms_norm", "kernel_ladder.rope", "kernel_ladder.flash_attention",
               "kernel_ladder.gated_mlp", "kernel_ladder.linear"):
        assert op in after, (op, sorted(after))
    assert not any("softmax" in n or "scaled_dot_product" in n or n in ("aten.mm", "aten.addmm", "aten.bmm")
                   for n in after), sorted(after)


def test_the_fused_loss_never_materializes_the_logits():
    model = _decoder("llama")
    kp.patch_model(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with OpLog() as log:
        model(ids, labels=ids).loss.backward()
    shapes = log.shapes
    assert (2 * 8, VOCAB) not in shapes and (2, 9, VOCAB) not in shapes and (2 * 9, VOCAB) not in shapes


def test_a_bf16_models_loss_comes_back_in_float32_like_hfs():
    """HF upcasts the logits before its loss; the fused loss never makes logits, and returns float32 too
    (a bf16 loss would keep under three significant digits)."""
    model = _decoder("llama").to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(ids, labels=ids).loss
        kp.patch_model(model)
        got = model(ids, labels=ids).loss
    assert want.dtype == got.dtype == torch.float32
    assert abs(float(got) - float(want)) <= 2e-2 * float(want), (float(got), float(want))


def test_bad_input_is_refused_with_clear_errors():
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=32, vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"model_type 'bert'\) is not supported; supported families: llama, mistral"):
        kp.patch_model(bert)
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel"):
        kp.patch_model("llama")
    model = _decoder("llama")
    with pytest.raises(ValueError, match="was not patched"):
        kp.unpatch_model(model)
    kp.patch_model(model)
    with pytest.raises(ValueError, match="already patched"):
        kp.patch_model(model)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention dropout 0.1 is not supported"):
        model(ids)


def test_the_patched_loss_output_uses_this_transformers_cache_field_without_a_deprecation_notice():
    """transformers 5.25 renamed the output's ``past_key_values`` to ``cache`` and logs a notice for the old
    name (once per process, hence a child process); the patched forward builds its output with the new one."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from kernel_ladder.patch import patch_model
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config)
        patch_model(model)
        ids = torch.randint(0, 64, (1, 6))
        print("loss", model(ids, labels=ids).loss.item())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "loss" in done.stdout
    assert "deprecated" not in done.stderr, done.stderr


# ----------------------------------------------------------------------------- every option of the model


def _tiny(family: str, **overrides):
    """A one-layer decoder of ``family`` with config fields overridden (the model built after them)."""
    torch.manual_seed(0)
    config = _decoder(family).config
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _ids(shape=(2, 9), seed=11):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _assert_same_as_transformers(ref, model, ids, labels=None, real=None, **call):
    """Logits (at ``real`` positions, a (B, T) bool mask; all by default), the loss with ``labels`` and every
    parameter's gradient: the patched model against the unpatched one, each called with ``call``."""
    labels = ids if labels is None else labels
    with torch.no_grad():
        want, got = ref(ids, **call).logits, model(ids, **call).logits
    real = torch.ones(ids.shape, dtype=torch.bool) if real is None else real
    assert _rel(got[real], want[real]) < 1e-4
    theirs = ref(ids, labels=labels, **call).loss
    ours = model(ids, labels=labels, **call)
    assert ours.logits is None  # the fused loss
    torch.testing.assert_close(ours.loss, theirs, rtol=1e-4, atol=1e-6)
    ref.zero_grad()
    model.zero_grad()
    theirs.backward()
    ours.loss.backward()
    assert_grads_close(ref, model)


def test_a_gated_mlp_with_biases_keeps_them():
    """Llama's mlp_bias: gate, up and down projections with biases; their gradients too."""
    ref = _tiny("llama", mlp_bias=True)
    model = copy.deepcopy(ref)
    assert kp.patch_model(model)["gated_mlp"] == 1
    _assert_same_as_transformers(ref, model, _ids())
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert getattr(model.model.layers[0].mlp, proj).bias.grad is not None, proj


@pytest.mark.parametrize("family, field, value", [
    ("llama", "hidden_act", "gelu_pytorch_tanh"), ("qwen2", "hidden_act", "gelu"), ("mistral", "hidden_act", "relu"),
    ("gpt2", "activation_function", "relu"), ("gpt2", "activation_function", "gelu"),
])
def test_the_mlp_activation_is_read_from_the_config(family, field, value):
    """Weights drawn 15x wider than the default: pre-activations of order 1, where the activations differ."""
    ref = _tiny(family, **{field: value, "initializer_range": 0.3})
    model = copy.deepcopy(ref)
    replaced = kp.patch_model(model)
    assert replaced.get("gated_mlp", 0) + replaced.get("mlp", 0) == model.config.num_hidden_layers
    _assert_same_as_transformers(ref, model, _ids())


@pytest.mark.parametrize("family, field, value", [("llama", "hidden_act", "quick_gelu"),
                                                  ("gpt2", "activation_function", "tanh")])
def test_an_activation_without_a_kernel_leaves_the_mlp_to_transformers_and_says_so(family, field, value):
    ref = _tiny(family, **{field: value, "initializer_range": 0.3})
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=rf"{field}={value!r} has no kernel_ladder kernel"):
        replaced = kp.patch_model(model)
    assert replaced[f"mlp unfused ({field}={value!r} has no kernel_ladder kernel)"] == model.config.num_hidden_layers
    assert "gated_mlp" not in replaced and "mlp" not in replaced
    _assert_same_as_transformers(ref, model, _ids())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_loss_honours_shift_labels_ignore_index_and_num_items_in_batch(family):
    """What transformers' causal-LM loss takes besides the labels: shift_labels (already shifted; the labels then
    unused), ignore_index (padding the shift too) and num_items_in_batch (int or tensor: the sum divided by it)."""
    ref = _tiny(family)
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids = _ids()
    shift = torch.roll(ids, -1, 1)
    shift[0, :3] = -100
    shift[1, -2:] = -100  # 5 masked targets
    odd = ids.clone()
    odd[:, ::3] = 7  # a real class id used as ignore_index
    cases = [dict(labels=ids, shift_labels=shift), dict(labels=ids, shift_labels=shift, num_items_in_batch=30),
             dict(labels=odd, ignore_index=7), dict(labels=odd, ignore_index=7, num_items_in_batch=torch.tensor(50)),
             dict(labels=ids, num_items_in_batch=40)]
    for call in cases:
        theirs = ref(ids, **call).loss
        ours = model(ids, **call).loss
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=lambda m, c=call: f"{sorted(c)}: {m}")
    # the controls: each option changes transformers' loss here
    with torch.no_grad():
        plain = ref(ids, labels=ids).loss
        for call in cases[:1] + cases[2:3]:
            assert abs(float(ref(ids, **call).loss) - float(plain)) > 1e-3


def test_the_loss_refuses_a_keyword_it_does_not_honour():
    """transformers passes unknown keywords on to its loss, which drops them; the patched loss refuses them."""
    ref = _tiny("llama")
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids = _ids()
    ref(ids, labels=ids, reduction="sum")  # the control: transformers takes it (and computes the mean anyway)
    with pytest.raises(ValueError, match=r"kernel_ladder\.patch: LlamaForCausalLM\.forward with labels does not "
                                         r"honour the keyword argument 'reduction'"):
        model(ids, labels=ids, reduction="sum")


def test_the_loss_follows_a_custom_loss_function_return_dict_inputs_embeds_and_logits_to_keep():
    ref = _tiny("llama")
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids = _ids()
    # return_dict=False: transformers' tuple, the loss first
    theirs, ours = ref(ids, labels=ids, return_dict=False), model(ids, labels=ids, return_dict=False)
    assert isinstance(ours, tuple)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-6)
    # inputs_embeds instead of ids: still the fused loss
    embeds = ref.get_input_embeddings()(ids).detach()
    out = model(inputs_embeds=embeds, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref(inputs_embeds=embeds, labels=ids).loss, rtol=1e-4, atol=1e-6)
    # logits_to_keep: the loss over the kept positions, as transformers computes it
    labels = ids[:, -4:]
    torch.testing.assert_close(model(ids, labels=labels, logits_to_keep=4).loss,
                               ref(ids, labels=labels, logits_to_keep=4).loss, rtol=1e-4, atol=1e-6)
    # a loss function of the user's: transformers' forward computes it (the logits made)
    def custom(logits, labels, vocab_size, **kwargs):
        return logits.float().square().mean()

    ref.loss_function = model.loss_function = custom
    out = model(ids, labels=ids)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref(ids, labels=ids).loss, rtol=1e-4, atol=1e-6)


def test_mixtral_router_aux_loss_is_added_like_transformers():
    ref = _tiny("mixtral", router_aux_loss_coef=0.5)
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids = _ids()
    theirs = ref(ids, labels=ids, output_router_logits=True)
    ours = model(ids, labels=ids, output_router_logits=True)
    assert ours.logits is None and ours.aux_loss is not None
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # the control: the aux loss counts
        assert abs(float(theirs.loss) - float(ref(ids, labels=ids).loss)) > 1e-3


def _padded(ids: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids with rows of 9, 6 and 4 real tokens padded on one side (pad id 0): (ids, attention_mask, labels with
    -100 at the padding, as transformers' collators make them)."""
    mask = torch.zeros(ids.shape, dtype=torch.long)
    for row, n in enumerate((9, 6, 4)):
        if side == "left":
            mask[row, ids.shape[1] - n:] = 1
        else:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_a_padded_batch_equals_transformers_at_every_real_token(family, side):
    """Left and right padding (rows of 9, 6 and 4 tokens; Mistral's window 5 and Qwen2's 4 shorter than the
    longest): the logits at the real tokens, the loss and the gradients equal transformers'."""
    ref = _decoder(family)
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids, mask, labels = _padded(_ids((3, 9)), side)
    _assert_same_as_transformers(ref, model, ids, labels=labels, real=mask.bool(), attention_mask=mask)


def test_packed_sequences_each_attend_to_themselves():
    """Several sequences in a row told apart by position_ids restarting (padding-free packing): each attends only to
    itself, as transformers' flash-attention integration computes it always, and its SDPA when use_cache=False
    (with a cache, transformers' SDPA does not look for packing)."""
    ref = _decoder("llama")
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids = _ids((2, 10))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    labels = ids.clone()
    labels[0, [0, 4, 7]] = labels[1, [0, 6]] = -100  # the first token of a sequence is no target of the one before
    _assert_same_as_transformers(ref, model, ids, labels=labels, position_ids=position_ids, use_cache=False)
    with torch.no_grad():  # each packed sequence as if alone
        alone = model(ids[:1, 4:7], position_ids=position_ids[:1, 4:7]).logits
        assert _rel(model(ids, position_ids=position_ids).logits[:1, 4:7], alone) < 1e-5
        assert _rel(ref(ids[:1, 4:7]).logits, alone) < 1e-4
