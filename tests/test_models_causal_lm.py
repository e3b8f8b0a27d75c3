"""kernel_ladder.models.CausalLM against Hugging Face's own models (tiny random configs, fp32): logits,
loss and every parameter's gradient for Llama (GQA, Llama 3 RoPE scaling, tied embeddings),
Mistral (a sliding window shorter than the sequence, multi-query attention) and Qwen2 (qkv biases,
one sliding layer); a safetensors checkpoint saved by HF loads; bad models and checkpoints are
refused with errors that say what is wrong."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_ladder.models import CausalLM, CausalLMConfig  # noqa: E402
from tests.helpers import assert_equals_hugging_face, rel_error  # noqa: E402

VOCAB = 64


def _configs() -> dict:
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    return {
        "llama": transformers.LlamaConfig(**small, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "mistral": transformers.MistralConfig(**small, num_key_value_heads=1, sliding_window=5),
        "qwen2": transformers.Qwen2Config(**small, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                                          max_window_layers=1),
    }


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_configs()[family]).float().eval()


FAMILIES = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_equal_hugging_face(family):
    hf = hf_model(family)
    ours = CausalLM.from_hf(hf)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))  # 11 > every window
    assert_equals_hugging_face(hf, ours, ids)


def test_the_config_reads_each_family():
    llama = CausalLMConfig.from_hf(_configs()["llama"])
    assert llama.tie_word_embeddings and llama.rope_scaling["rope_type"] == "llama3" and llama.windows == [None, None]
    assert CausalLMConfig.from_hf(_configs()["mistral"]).windows == [5, 5]
    qwen = CausalLMConfig.from_hf(_configs()["qwen2"])
    assert qwen.qkv_bias and not qwen.o_bias and qwen.windows == [None, 4]


def test_a_window_that_is_not_applied_is_caught():  # negative control: the comparison sees the window
    hf = hf_model("mistral")
    ours = CausalLM.from_hf(hf)
    for layer in ours.model.layers:
        layer.self_attn.window = None
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) > 1e-3


def test_a_safetensors_checkpoint_saved_by_hugging_face_loads(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    ours = CausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) < 1e-4


def test_unsupported_models_and_wrong_checkpoints_are_refused(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"):
        CausalLM.from_hf(gpt2)
    with pytest.raises(TypeError, match="expected a transformers model"):
        CausalLM.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        CausalLM.from_pretrained(tmp_path)
    hf = hf_model("llama")
    state = hf.state_dict()
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.norm.weight"] = torch.ones(31)
    ours = CausalLM(CausalLMConfig.from_hf(hf.config))
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight.*wrong shapes model\.norm"):
        ours.load_hf_state_dict(state)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 64\)"):
        ours(torch.tensor([[1, 64]]))


def test_transformers_runs_beside_hugging_faces_kernels_package():
    """transformers (>= 5.25) requires Hugging Face's Hub-kernel loader, imported as ``kernels``: it and
    ``kernel_ladder`` share an environment. ``import kernel_ladder`` is this repository's package (its src
    layout: ``kernels/kernel_ladder``), ``import kernels`` the Hub loader, and a model still runs."""
    import importlib.metadata
    import pathlib

    import kernel_ladder

    here = pathlib.Path(__file__).resolve().parent.parent
    assert pathlib.Path(kernel_ladder.__file__).resolve().parent == here / "kernels" / "kernel_ladder"
    names = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    if "kernels" in names:  # the Hub loader: its own package, not a folder of this repository
        import kernels

        assert pathlib.Path(kernels.__file__).resolve().parent != here / "kernels"
        assert hasattr(kernels, "kernelize")  # its API, not a folder of ours
    hf = hf_model("llama")
    with torch.no_grad():
        assert hf(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, VOCAB)
