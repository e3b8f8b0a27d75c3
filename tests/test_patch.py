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


def _assert_grads_close(ref: torch.nn.Module, patched: torch.nn.Module) -> None:
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for (name, p), q in zip(ref.named_parameters(), patched.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        # 1e-3 relative; a gradient that is exactly zero in exact arithmetic (a key bias, which the
        # softmax cancels) is compared against the model's largest gradient instead
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5 * scale, msg=name)


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
    _assert_grads_close(ref, model)
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
    _assert_grads_close(ref, model)


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
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded batches are not supported"):
        model(ids, attention_mask=mask)
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
