"""kernel_ladder.models.ViT against Hugging Face's ViTModel and CLIPVisionModel (tiny random configs, fp32):
last hidden states, CLIP's pooled output, gradients through the encoder, and clear errors."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_ladder.models import ViT, ViTConfig  # noqa: E402

VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=12,
              patch_size=4)


def _hf(family: str, act: str = "gelu"):
    t = transformers
    torch.manual_seed(0)
    if family == "vit":
        model = t.ViTModel(t.ViTConfig(**VISION, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       hidden_act=act))
    else:
        model = t.CLIPVisionModel(t.CLIPVisionConfig(**VISION, hidden_act=act))
    with torch.no_grad():  # random biases and norm parameters, so a dropped one would show
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.float().eval()


def _rel(a, b) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


@pytest.mark.parametrize("family, act", [("vit", "gelu"), ("clip", "quick_gelu"), ("clip", "gelu_pytorch_tanh")])
def test_last_hidden_state_matches_hf(family, act):
    hf = _hf(family, act)
    ours = ViT.from_hf(hf)
    x = torch.randn(3, 3, 12, 12)
    want = hf(pixel_values=x)
    got = ours(x)
    assert got.shape == want.last_hidden_state.shape
    assert _rel(got, want.last_hidden_state) < 1e-4
    if family == "clip":
        assert _rel(ours.pooled(got), want.pooler_output) < 1e-4


def test_a_whole_clip_model_gives_its_vision_tower():
    t = transformers
    torch.manual_seed(0)
    text = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50)
    clip = t.CLIPModel(t.CLIPConfig(vision_config={**VISION, "hidden_act": "gelu"}, text_config=text)).eval()
    x = torch.randn(2, 3, 12, 12)
    want = clip.vision_model(pixel_values=x).last_hidden_state
    assert _rel(ViT.from_hf(clip)(x), want) < 1e-4


def test_gradients_match_hf():
    hf = _hf("vit")
    ours = ViT.from_hf(hf)
    x = torch.randn(2, 3, 12, 12)
    hf(pixel_values=x).last_hidden_state.square().sum().backward()
    ours(x).square().sum().backward()
    torch.testing.assert_close(ours.layers[0].fc1.weight.grad, hf.layers[0].mlp.fc1.weight.grad,
                               rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(ours.patch.weight.grad, hf.embeddings.patch_embeddings.projection.weight.grad.flatten(1),
                               rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(ours.cls.grad, hf.embeddings.cls_token.grad.flatten(), rtol=1e-3, atol=1e-5)


def test_clear_errors():
    with pytest.raises(ValueError, match="kernel_ladder.models.ViT: model_type 'llama' is not supported"):
        ViTConfig.from_hf({"model_type": "llama"})
    ours = ViT.from_hf(_hf("vit"))
    with pytest.raises(ValueError, match=r"pixel_values must be \(batch, 3, 12, 12\)"):
        ours(torch.randn(1, 3, 16, 16))
    state = _hf("clip").state_dict()
    with pytest.raises(ValueError, match="missing .*layernorm_before"):
        ours.load_hf_state_dict(state, source="CLIPVisionModel")
    with pytest.raises(ValueError, match="hidden_act 'relu2' is not supported"):
        ViTConfig(32, 1, 4, 48, 12, 4, hidden_act="relu2")
