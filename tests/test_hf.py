"""kernel_ladder.hf: transformers' interfaces (attn_implementation="kernel_ladder", the experts), the adapter's
mask handling and refusals, kernels' layer mapping (kernelize on the CPU, offline, through the local layer
repository kernel_ladder.hf_layers), patch_model composed with a kernelized model, and Trainer on a patched
model. Tiny random configs in fp32: the interpreter is slow."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import types

import pytest
import torch
from helpers import DEVICE

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")

import kernel_ladder  # noqa: E402
import kernel_ladder.hf as hf  # noqa: E402
import kernel_ladder.patch as kp  # noqa: E402
from utils.trace import OpLog  # noqa: E402

VOCAB = 128
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _llama(attn: str = "eager", **kw):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, **kw).to(DEVICE).eval()


def _ids(shape, seed):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)

def _compiled_logits(model, ids, **kwargs) -> tuple[torch.Tensor, set[str]]:
    """The logits of ``model`` compiled with ``fullgraph=True``, and the ops its graph calls (a backend
    that records the graph, then runs it as traced)."""
    seen: set[str] = set()

    def record(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=record, fullgraph=True)
    with torch.no_grad():
        got = compiled(ids, **kwargs).logits
    torch._dynamo.reset()
    return got, seen



def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _ops(model, *args, **kwargs) -> set[str]:
    with torch.no_grad(), OpLog() as log:
        model(*args, **kwargs)
    return log.names


def _instance_state(model: torch.nn.Module) -> dict:
    """What kernelize and patch_model may put on module instances: their own forward and kernels' record."""
    return {name: (m.__dict__.get("forward"), m.__dict__.get("_kernel_repo")) for name, m in model.named_modules()}


def _kernelized_funcs(model: torch.nn.Module) -> dict:
    """The forwards on the private function wrappers (transformers' rotary) that kernelize swaps."""
    return {(name, key): f.__dict__.get("forward") for name, m in model.named_modules()
            for key, f in getattr(m, "_kernel_funcs", {}).items()}


# ----------------------------------------------------------------------------- import and register


def test_importing_the_package_imports_neither_transformers_nor_kernels():
    code = ("import sys, kernel_ladder, kernel_ladder.hf, kernel_ladder.patch, kernel_ladder.hf_layers; "
            "bad = [m for m in ('transformers', 'kernels') if m in sys.modules]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_register_is_idempotent_and_returns_what_it_registered():
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    first = hf.register()
    assert first == {"AttentionInterface": hf.attention, "AttentionMaskInterface": flash_attention_mask,
                     "ExpertsInterface": hf.experts}
    assert hf.register() == first
    assert AttentionInterface()["kernel_ladder"] is hf.attention
    assert AttentionMaskInterface()["kernel_ladder"] is flash_attention_mask
    assert ExpertsInterface()["kernel_ladder"] is hf.experts
    assert hf.register("kernel_ladder_other")["AttentionInterface"] is AttentionInterface()["kernel_ladder_other"]
    for bad in ("my_flash_attention", "org/repo", ""):
        with pytest.raises(ValueError, match=r"kernel_ladder\.hf\.register: name must be a non-empty string without "
                                             r"'flash'"):
            hf.register(bad)


# ----------------------------------------------------------------------------- the attention adapter


def _reference(q, k, v, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention written out in float64 with a boolean (Tq, Tk) or (B, 1, Tq, Tk) mask; GQA by repeating K/V."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, Tq, H, D), the adapter's layout


def _qkv(tq=6, tk=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, tq, 16, generator=g)
    k, v = torch.randn(2, 2, tk, 16, generator=g), torch.randn(2, 2, tk, 16, generator=g)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _module(causal: bool = True):
    return types.SimpleNamespace(is_causal=causal)


def test_the_adapter_follows_the_mask_it_is_given():
    """None, a padding mask with nothing padded, and 4-D causal / windowed / all-visible masks (bool or
    additive) are each computed as they say, checked against attention written out with that mask."""
    q, k, v = _qkv()
    i, j = torch.arange(6, device=DEVICE)[:, None], torch.arange(6, device=DEVICE)[None, :]
    causal, full = j <= i, torch.ones(6, 6, dtype=torch.bool, device=DEVICE)
    windowed = causal & (j > i - 3)
    scale = 16**-0.5

    def additive(mask):
        return torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, torch.finfo(torch.float32).min)

    cases = [  # (mask passed, keywords, what it must compute, causal module)
        (None, {}, causal, True),
        (None, {}, full, False),
        (None, {"is_causal": False}, full, True),
        (torch.ones(2, 6, dtype=torch.bool, device=DEVICE), {}, causal, True),
        (causal[None, None].expand(2, 1, 6, 6), {}, causal, True),
        (additive(causal)[None, None].expand(2, 1, 6, 6), {}, causal, True),
        (full[None, None].expand(2, 1, 6, 6), {}, full, True),  # the mask, not the module, decides
        (None, {"sliding_window": 3}, windowed, True),
        (windowed[None, None].expand(2, 1, 6, 6), {"sliding_window": 3}, windowed, True),
        (None, {"sliding_window": 6}, causal, True),  # a window as wide as the keys hides nothing
    ]
    for mask, kw, visible, module_causal in cases:
        out, weights = hf.attention(_module(module_causal), q, k, v, mask, **kw)
        assert weights is None and out.shape == (2, 6, 4, 16)
        torch.testing.assert_close(out.double(), _reference(q, k, v, visible, scale), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, kw=kw: f"{kw}: {m}")
    # scaling is passed through (None: 1/sqrt(D))
    out, _ = hf.attention(_module(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal, 0.25), rtol=1e-4, atol=1e-5)
    # decoding: one query sees every cached key (bottom-right aligned), with and without a window
    q1, k1, v1 = _qkv(tq=1, tk=5, seed=1)
    out, _ = hf.attention(_module(), q1, k1, v1, None)
    torch.testing.assert_close(out.double(), _reference(q1, k1, v1, torch.ones(1, 5, dtype=torch.bool,
                                                                               device=DEVICE), scale),
                               rtol=1e-4, atol=1e-5)
    out, _ = hf.attention(_module(), q1, k1, v1, None, sliding_window=2)
    last_two = torch.tensor([[False, False, False, True, True]], device=DEVICE)
    torch.testing.assert_close(out.double(), _reference(q1, k1, v1, last_two, scale), rtol=1e-4, atol=1e-5)


def _padded_reference(q, k, v, keep, causal, window, scale):
    """What the adapter computes for a padded batch, written out: each query sees its row's real keys (causal and
    windowed by absolute position, as transformers' masks); a padded query of causal attention gives 0."""
    tq, tk = q.shape[2], k.shape[2]
    visible = keep[:, None, None, :] & hf._pattern(tq, tk, causal, window, DEVICE)
    query_real = keep[:, tk - tq:] if causal else torch.ones(keep.shape[0], tq, dtype=torch.bool, device=DEVICE)
    out = _reference(q, k, v, visible & query_real[:, None, :, None], scale)
    return torch.where(query_real[:, :, None, None], out, 0.0)


def test_the_adapter_unpads_a_padded_batch():
    """A (B, Tk) padding mask, left or right, causal or not, with a window, and decoding one query against a
    left-padded cache: the real queries against attention written out with the padding, padded ones 0."""
    q, k, v = _qkv()
    keep = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    keep[0, :2] = False  # left padding
    keep[1, 4:] = False  # right padding
    scale = 16**-0.5
    for causal, window in ((True, None), (False, None), (True, 3)):
        out, _ = hf.attention(_module(causal), q, k, v, keep.long(), sliding_window=window)
        want = _padded_reference(q, k, v, keep, causal, window, scale)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, c=causal: f"{c}: {m}")
        # the control: the padding changes the real queries' outputs
        assert (out.double() - _reference(q, k, v, hf._pattern(6, 6, causal, window, DEVICE), scale)).abs().max() > 1e-2
    q1, k1, v1 = _qkv(tq=1, tk=5, seed=1)
    cache_keep = torch.tensor([[False, False, True, True, True], [True] * 5], device=DEVICE)
    out, _ = hf.attention(_module(), q1, k1, v1, cache_keep)
    torch.testing.assert_close(out.double(), _padded_reference(q1, k1, v1, cache_keep, True, None, scale), rtol=1e-4,
                               atol=1e-5)
    # the plan read from a mask is reused by the next layer, but not once the mask has changed in place
    mask = keep.long()
    hf.attention(_module(), q, k, v, mask)
    mask[1, 3] = 0
    changed = mask.bool()
    out, _ = hf.attention(_module(), q, k, v, mask)
    torch.testing.assert_close(out.double(), _padded_reference(q, k, v, changed, True, None, scale), rtol=1e-4,
                               atol=1e-5)
    # gradients flow to the real tokens only
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    hf.attention(_module(), qg, kg, vg, keep)[0].sum().backward()
    assert not kg.grad[0, :, :2].any() and not qg.grad[1, :, 4:].any() and kg.grad[0, :, 2:].abs().sum() > 0


def test_the_adapter_attends_packed_sequences_apart():
    """Sequences packed into a row without padding, told by position_ids restarting or by flash-attention's
    cu_seq_lens_q / cu_seq_lens_k: each against attention written out within its own sequence."""
    q, k, v = _qkv()
    i, j = torch.arange(6, device=DEVICE)[:, None], torch.arange(6, device=DEVICE)[None, :]
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]], device=DEVICE)
    segment = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], device=DEVICE)
    same = segment[:, :, None] == segment[:, None, :]
    out, _ = hf.attention(_module(), q, k, v, None, position_ids=position_ids)
    torch.testing.assert_close(out.double(), _reference(q, k, v, (same & (j <= i))[:, None], 16**-0.5), rtol=1e-4,
                               atol=1e-5)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32, device=DEVICE)
    out, _ = hf.attention(_module(), q[:1], k[:1], v[:1], None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                          max_length_k=4)
    torch.testing.assert_close(out.double(), _reference(q[:1], k[:1], v[:1], (same[1:] & (j <= i))[:, None],
                                                        16**-0.5), rtol=1e-4, atol=1e-5)
    # one sequence (positions counting up from any start) is not packing
    out, _ = hf.attention(_module(), q, k, v, None, position_ids=position_ids[:1, :1] + 3 + j)
    torch.testing.assert_close(out.double(), _reference(q, k, v, j <= i, 16**-0.5), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q and cu_seq_lens_k describe one packed row"):
        hf.attention(_module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_the_adapter_refuses_what_it_cannot_compute():
    q, k, v = _qkv()
    i, j = torch.arange(6, device=DEVICE)[:, None], torch.arange(6, device=DEVICE)[None, :]
    causal = (j <= i)[None, None].expand(2, 1, 6, 6).clone()
    padded = causal.clone()
    padded[0, :, :, 0] = False  # sequence 0 starts with a padding token, in a 4-D mask
    with pytest.raises(ValueError, match=r"kernel_ladder\.hf\.attention: a 4-D attention_mask of shape \(2, 1, 6, 6\) "
                                         r"hides keys .* For padding pass the \(B, Tk\) padding mask"):
        hf.attention(_module(), q, k, v, padded)
    with pytest.raises(ValueError, match=r"a 2-D attention_mask must be the \(B, Tk\) = \(2, 6\) padding mask"):
        hf.attention(_module(), q, k, v, torch.ones(2, 4, dtype=torch.bool, device=DEVICE))  # a static cache's
    holes = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    holes[0, 2] = False
    with pytest.raises(ValueError, match=r"a sliding window \(3\) over a padded batch needs each row's real tokens "
                                         r"in one run"):
        hf.attention(_module(), q, k, v, holes, sliding_window=3)
    # the controls: the same masks without the padding, the hole without a window
    hf.attention(_module(), q, k, v, causal)
    hf.attention(_module(), q, k, v, torch.ones(2, 6, dtype=torch.long, device=DEVICE))
    hf.attention(_module(), q, k, v, holes)
    with pytest.raises(ValueError, match="attention dropout 0.1 is not supported"):
        hf.attention(_module(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="a sliding window .3. on a non-causal layer is not supported"):
        hf.attention(_module(False), q, k, v, None, sliding_window=3)
    with pytest.raises(ValueError, match=r"attention_mask must be None, \(B, Tk\) or \(B, 1 or H, Tq, Tk\)"):
        hf.attention(_module(), q, k, v, causal[0])
    with pytest.raises(ValueError, match=r"must end in \(Tq, Tk\) = \(6, 6\)"):
        hf.attention(_module(), q, k, v, causal[..., :5])


def test_the_adapter_passes_sinks_and_takes_values_of_another_head_dim():
    """GPT-OSS passes its sink logits as s_aux; DeepSeek-V3's values are narrower than its keys (Dv 8, D 16).
    Dense and padded (the varlen path): against attention written out, the sink a column of the softmax that is
    dropped after it, the padded queries 0."""
    q, k, _ = _qkv()
    v = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    i, j = torch.arange(6, device=DEVICE)[:, None], torch.arange(6, device=DEVICE)[None, :]

    def reference(visible):
        rep = q.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
        scores = ((q.double() @ kk.transpose(-1, -2)) * 0.25).masked_fill(~visible, float("-inf"))
        sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        p = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        return (p @ vv).transpose(1, 2)

    out, _ = hf.attention(_module(), q, k, v, None, scaling=0.25, s_aux=sinks)
    assert out.shape == (2, 6, 4, 8)
    torch.testing.assert_close(out.double(), reference((j <= i)[None, None]), rtol=1e-4, atol=1e-5)
    plain, _ = hf.attention(_module(), q, k, v, None, scaling=0.25)
    assert (plain - out).abs().max() > 1e-2  # the control: the sinks count
    keep = torch.ones(2, 6, dtype=torch.long, device=DEVICE)
    keep[1, :2] = 0  # row 1 left-padded by two
    out, _ = hf.attention(_module(), q, k, v, keep, scaling=0.25, s_aux=sinks)
    visible = (j <= i)[None, None] & keep.bool()[:, None, None, :]
    want = reference(visible)
    torch.testing.assert_close(out[0].double(), want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1, 2:].double(), want[1, 2:], rtol=1e-4, atol=1e-5)
    assert not out[1, :2].any()  # padded queries: 0


def test_the_experts_entry_refuses_a_layout_it_does_not_know():
    """The flags transformers' use_experts_implementation sets say the layout; one of neither supported kind, or
    GPT-OSS's flags without its activation's parameters, is refused by name."""
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    weights = torch.full((3, 2), 0.5)
    stacked = types.SimpleNamespace(gate_up_proj=torch.randn(2, 12, 8), down_proj=torch.randn(2, 8, 6),
                                    is_concatenated=True, is_transposed=True, has_bias=False, has_gate=True,
                                    has_post_expert_norm=False)
    with pytest.raises(ValueError, match=r"kernel_ladder\.hf\.experts: SimpleNamespace's layout is not supported: "
                                         r"is_concatenated, is_transposed, has_bias, has_gate, has_post_expert_norm "
                                         r"= \(True, True, False, True, False\)"):
        hf.experts(stacked, x, ids, weights)
    stacked.is_concatenated, stacked.has_bias = False, True
    with pytest.raises(ValueError, match=r"has GPT-OSS's layout .* but not its alpha, limit"):
        hf.experts(stacked, x, ids, weights)
    stacked.is_concatenated, stacked.is_transposed, stacked.has_bias = True, False, False  # the control: Mixtral's
    assert hf.experts(stacked, x, ids, weights).shape == (3, 8)


# ----------------------------------------------------------------------------- attn_implementation="kernel_ladder"


def test_from_pretrained_with_attn_implementation_kernel_ladder_matches_eager(tmp_path):
    hf.register()
    eager = _llama("eager")
    eager.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="kernel_ladder")
    loaded = loaded.to(DEVICE).eval()
    built = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA),
                                                          attn_implementation="kernel_ladder")
    built.load_state_dict(eager.state_dict())
    built = built.to(DEVICE).eval()
    ids = _ids((2, 13), 1)
    assert eager.config._attn_implementation == "eager"
    with torch.no_grad():
        want = eager(ids).logits
        for model in (loaded, built):
            assert model.config._attn_implementation == "kernel_ladder"
            assert not any("forward" in m.__dict__ for m in model.modules())  # nothing patched on an instance
            assert _rel(model(ids).logits, want) < 1e-4
            # an all-ones attention mask is no padding
            assert _rel(model(ids, attention_mask=torch.ones_like(ids)).logits, want) < 1e-4
    ours, theirs = _ops(loaded, ids), _ops(eager, ids)
    assert "kernel_ladder.flash_attention" in ours and "kernel_ladder.flash_attention" not in theirs
    assert any("softmax" in n for n in theirs) and not any("softmax" in n or "scaled_dot" in n for n in ours)
    # generation through the cache (one query against the cached keys) gives eager's tokens
    prompt = _ids((1, 5), 2)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(prompt, **kw), eager.generate(prompt, **kw))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0  # left padding: the real tokens' logits are eager's
    with torch.no_grad():
        assert _rel(loaded(ids, attention_mask=padded).logits[padded.bool()],
                    eager(ids, attention_mask=padded).logits[padded.bool()]) < 1e-4
    # batched generation from left-padded prompts gives eager's tokens
    prompts = _ids((2, 5), 3)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :2] = 0
    assert torch.equal(loaded.generate(prompts, attention_mask=prompt_mask, **kw),
                       eager.generate(prompts, attention_mask=prompt_mask, **kw))


def test_attn_implementation_kernel_ladder_compiles_in_one_graph():
    """Without padding the adapter reads no tensor value (position_ids, always passed, are not looked at for
    packing under torch.compile): the model traces into one graph that calls kernel_ladder.flash_attention."""
    hf.register()
    model = _llama("kernel_ladder")
    ids = _ids((2, 9), 12)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    got, seen = _compiled_logits(model, ids, use_cache=False)
    assert _rel(got, want) < 1e-5
    assert any("kernel_ladder.flash_attention" in target for target in seen), sorted(seen)


def _mixtral_config():
    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64)


def test_mixtral_experts_through_experts_interface():
    hf.register()
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(_mixtral_config(), attn_implementation="eager")
    eager = eager.to(DEVICE).eval()
    ours = transformers.AutoModelForCausalLM.from_config(_mixtral_config(), attn_implementation="kernel_ladder",
                                                         experts_implementation="kernel_ladder")
    ours.load_state_dict(eager.state_dict())
    ours = ours.to(DEVICE).eval()
    assert ours.config._experts_implementation == "kernel_ladder" != eager.config._experts_implementation
    ids = _ids((2, 7), 3)
    with torch.no_grad():
        assert _rel(ours(ids).logits, eager(ids).logits) < 1e-4
    ran = _ops(ours, ids)
    assert "kernel_ladder.grouped_matmul" in ran and "kernel_ladder.flash_attention" in ran, sorted(ran)
    assert "kernel_ladder.grouped_matmul" not in _ops(eager, ids)


# ----------------------------------------------------------------------------- kernels' layer mapping


def test_the_mapping_covers_transformers_decorated_layers():
    """Each name transformers' kernelizable layers carry (for those kernel_ladder computes) is in the mapping,
    and every repository in it loads from the folder shipped inside the package."""
    from transformers import activations
    from transformers.models.llama import modeling_llama

    names = {activations.SiLUActivation.kernel_layer_name, activations.GELUActivation.kernel_layer_name,
             activations.GELUTanh.kernel_layer_name, activations.NewGELUActivation.kernel_layer_name,
             activations.FastGELUActivation.kernel_layer_name, modeling_llama.LlamaRMSNorm.kernel_layer_name,
             modeling_llama.apply_rotary_pos_emb.kernel_layer_name}
    assert names <= set(hf.LAYERS)
    mapping = hf.kernel_mapping()
    assert set(mapping) == set(hf.LAYERS)
    folder = hf.layer_repository_path()
    assert (folder / "metadata.json").is_file() and (folder / "__init__.py").is_file()
    import kernel_ladder.hf_layers.layers as layers

    for name, devices in mapping.items():
        assert set(devices) == ({"cpu", "cuda"} if kernel_ladder.runtime.INTERPRETER else {"cuda"})
        for repo in devices.values():
            assert isinstance(repo, kernels.LocalLayerRepository) and repo._repo_path == folder
            loaded = repo.load()  # through kernels' own loader, offline
            assert loaded.__name__ == hf.LAYERS[name] and hasattr(layers, loaded.__name__)
    assert set(hf.kernel_mapping(devices=("cuda",))["RMSNorm"]) == {"cuda"}


def test_an_older_kernels_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(kernels, "__version__", "0.18.0")
    with pytest.raises(ImportError, match=r"kernel_ladder\.hf\.kernel_mapping: needs Hugging Face's kernels>=0\.19\.1 "
                                          r"\(its local layer repositories\), found 0\.18\.0"):
        hf.kernel_mapping()
    with pytest.raises(ImportError, match=r"kernel_ladder\.hf\.kernelize: needs"):
        hf.kernelize(torch.nn.Linear(2, 2))


def test_kernelize_runs_kernel_ladder_layers_and_matches():
    model = _llama("eager")
    ref = copy.deepcopy(model)
    ids = _ids((2, 9), 4)
    before = _ops(model, ids)
    assert not any(n.startswith("kernel_ladder.") for n in before)  # the control
    assert hf.kernelize(model) is model
    ran = _ops(model, ids)
    for op in ("kernel_ladder.rms_norm", "kernel_ladder.rope", "kernel_ladder.silu"):
        assert op in ran, (op, sorted(ran))
    assert "forward" in model.model.norm.__dict__ and isinstance(model.model.norm._kernel_repo,
                                                                 kernels.LocalLayerRepository)
    with torch.no_grad():
        assert _rel(model(ids).logits, ref(ids).logits) < 1e-5
    # the same as kernels' own kernelize under the mapping, by hand
    by_hand = copy.deepcopy(ref)
    with kernels.use_kernel_mapping(hf.kernel_mapping()):
        kernels.kernelize(by_hand, mode=kernels.Mode.INFERENCE, device="cpu" if DEVICE.type == "cpu" else "cuda")
    assert ({n: f and f.__func__ for n, (f, _) in _instance_state(by_hand).items()}
            == {n: f and f.__func__ for n, (f, _) in _instance_state(model).items()})
    by_hand.reset_kernels()  # transformers' own undo
    assert not any(n.startswith("kernel_ladder.") for n in _ops(by_hand, ids))
    # training: the layers are differentiable, gradients as the unkernelized model's
    model.train()
    ref.train()
    hf.kernelize(model)
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)
    # kernelize with an empty mapping puts every original forward back
    with kernels.use_kernel_mapping({}, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=DEVICE.type)
    assert not any(n.startswith("kernel_ladder.") for n in _ops(model.eval(), ids))


def test_a_kernelized_model_compiles_in_one_graph_with_the_ops_in_it():
    """The layers say can_torch_compile: the kernelized model traces into one graph that calls the
    kernel_ladder ops (a backend that records the graph, then runs it as traced)."""
    model = _llama("eager")
    ids = _ids((2, 9), 11)
    with torch.no_grad():
        want = model(ids).logits
    hf.kernelize(model, mode=kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE)
    got, seen = _compiled_logits(model, ids)
    assert _rel(got, want) < 1e-5
    for op in ("kernel_ladder.rms_norm", "kernel_ladder.rope", "kernel_ladder.silu"):
        assert any(op in target for target in seen), (op, sorted(seen))


def test_kernelize_activations_and_gated_layers():
    from transformers.activations import ACT2FN

    @kernels.use_kernel_forward_from_hub("SiluAndMul")
    class SiluAndMul(torch.nn.Module):
        def forward(self, x):
            d = x.shape[-1] // 2
            return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    @kernels.use_kernel_forward_from_hub("GeluTanhAndMul")
    class GeluTanhAndMul(torch.nn.Module):
        def forward(self, x):
            d = x.shape[-1] // 2
            return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]

    expect = {"silu": "kernel_ladder.silu", "gelu": "kernel_ladder.gelu", "gelu_pytorch_tanh": "kernel_ladder.gelu",
              "gelu_new": "kernel_ladder.gelu", "gelu_fast": "kernel_ladder.gelu"}
    layers = {name: ACT2FN[name] for name in expect}
    layers["swiglu"], expect["swiglu"] = SiluAndMul(), "kernel_ladder.swiglu"
    layers["geglu"], expect["geglu"] = GeluTanhAndMul(), "kernel_ladder.geglu"
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = {name: layer(x) for name, layer in layers.items()}
    holder = torch.nn.ModuleDict(layers)
    holder.register_buffer("anchor", torch.zeros(1, device=DEVICE))  # kernelize reads the device off the module
    hf.kernelize(holder, device=DEVICE.type)
    for name, layer in layers.items():
        with OpLog() as log:
            got = layer(x)
        assert expect[name] in log.names, (name, sorted(log.names))
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_norm_whose_weight_dtype_differs_keeps_transformers_promotion():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16).to(DEVICE)
    norm.weight.data.normal_(generator=torch.Generator(device=DEVICE).manual_seed(6))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    hf.kernelize(norm, device=DEVICE.type)
    with OpLog() as log:
        mixed = norm(x.to(torch.bfloat16))  # bf16 input, fp32 weight: transformers' forward gives fp32
    assert mixed.dtype == torch.float32 and "kernel_ladder.rms_norm" not in log.names
    with OpLog() as log:
        norm(x)
    assert "kernel_ladder.rms_norm" in log.names  # the control: same dtypes take the kernel


# ----------------------------------------------------------------------------- patch_model after kernelize


def test_patch_and_unpatch_compose_with_a_kernelized_model(tmp_path):
    _llama().save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE).eval()
    assert model.use_kernels  # from_pretrained kernelized it (transformers' mapping has nothing for the CPU)
    hf.kernelize(model)  # now the decorated layers hold kernel_ladder forwards
    ids = _ids((2, 9), 8)
    with torch.no_grad():
        before_logits = model(ids).logits
    before = (_instance_state(model), _kernelized_funcs(model), model.config._attn_implementation,
              model.use_kernels, model.kernels_mode)
    assert before[0]["model.norm"][0] is not None  # the test is about something

    kp.patch_model(model)
    assert model.model.norm.forward.__func__ is kp._rms_norm_forward
    with torch.no_grad():
        assert _rel(model(ids).logits, before_logits) < 1e-4
    model.train()  # a mode change: a kernelized model would kernelize itself again...
    model.eval()
    assert model.model.norm.forward.__func__ is kp._rms_norm_forward  # ...but not while patched

    kp.unpatch_model(model)
    after = (_instance_state(model), _kernelized_funcs(model), model.config._attn_implementation,
             model.use_kernels, model.kernels_mode)
    assert after[0].keys() == before[0].keys()
    for name in before[0]:
        assert after[0][name][0] is before[0][name][0] and after[0][name][1] is before[0][name][1], name
    assert after[1] == before[1] and after[2:] == before[2:]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before_logits)


def test_the_mode_switch_that_patch_model_guards_against_is_real(tmp_path):
    """The negative control of the test above: on a model from_pretrained kernelized, train() replaces a
    forward set on a decorated layer's instance."""
    _llama().save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model.model.norm.forward = types.MethodType(kp._rms_norm_forward, model.model.norm)
    model.train()
    assert "forward" not in model.model.norm.__dict__


def test_unpatch_restores_the_experts_implementation():
    model = transformers.AutoModelForCausalLM.from_config(_mixtral_config(), experts_implementation="batched_mm")
    kp.patch_model(model)
    assert model.config._experts_implementation == "kernel_ladder"
    kp.unpatch_model(model)
    assert model.config._experts_implementation == "batched_mm" and model.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------- training


def test_the_patched_loss_is_normalized_by_num_items_in_batch_like_transformers():
    """Trainer passes the number of targets of the whole accumulated batch; the loss is the sum over this
    micro-batch divided by it, as transformers' own loss is (the mean would weigh micro-batches wrongly)."""
    ref = _llama()
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    ids = _ids((2, 9), 9)
    with torch.no_grad():
        for n in (None, 40, torch.tensor(40)):
            torch.testing.assert_close(model(ids, labels=ids, num_items_in_batch=n).loss,
                                       ref(ids, labels=ids, num_items_in_batch=n).loss, rtol=1e-4, atol=1e-6)
        # the control: with 40 targets in the whole batch this micro-batch's 16 weigh 16/40 of its mean
        mean = ref(ids, labels=ids).loss
        assert math.isclose(float(model(ids, labels=ids, num_items_in_batch=40).loss), float(mean) * 16 / 40,
                            rel_tol=1e-4)


def test_trainer_trains_a_patched_llama_like_the_original(tmp_path):
    """Gradient accumulation (2 micro-batches of 2) over right-padded rows of 12, 7, 10 and 4 tokens, labels -100
    at the padding as transformers' collators make them: the micro-batches hold unequal numbers of targets, so
    only a loss normalized by Trainer's num_items_in_batch, over a correctly unpadded batch, logs the same losses
    and ends at the same weights as the unpatched model."""
    from transformers import Trainer, TrainingArguments

    ids = _ids((4, 12), 10).cpu()
    data = [{"input_ids": row[:n]} for row, n in zip(ids, (12, 7, 10, 4))]

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row["input_ids"])] = row["input_ids"]
            mask[i, : len(row["input_ids"])] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}

    def run(model, out):
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2,
                                 lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=DEVICE.type == "cpu", disable_tqdm=True, seed=0, dataloader_num_workers=0,
                                 remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    ref = _llama().train()
    model = copy.deepcopy(ref)
    kp.patch_model(model)
    theirs, ours = run(ref, "ref"), run(model, "patched")
    assert len(ours) == 3 and all(math.isfinite(x) for x in ours)
    assert ours[-1] < ours[0]  # it learns (the same four rows every step)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-3 * b, (ours, theirs)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert getattr(model, kp._STATE) is not None  # still patched after Trainer's train()/eval() switches
