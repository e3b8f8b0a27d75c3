"""kernel_ladder.models.Engine against Hugging Face's greedy generate (tiny random configs, fp32): prompts
of different lengths batched together with chunked prefill, a sliding window, prefix caching,
stop tokens, seeded sampling and nucleus filtering, and speculative decoding (a draft model,
prompt lookup) whose acceptance rule keeps the target's distribution exact."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_ladder.models import CausalLM, Engine  # noqa: E402
from tests.helpers import hf_greedy, random_prompts  # noqa: E402

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             max_position_embeddings=128)


def _hf(family: str = "llama", layers: int = 2, seed: int = 0):
    t = transformers
    config = (t.MistralConfig(**SMALL, num_hidden_layers=layers, num_key_value_heads=1, sliding_window=5)
              if family == "mistral" else t.LlamaConfig(**SMALL, num_hidden_layers=layers, num_key_value_heads=2))
    torch.manual_seed(seed)
    return t.AutoModelForCausalLM.from_config(config).float().eval()


@pytest.fixture(scope="module")
def llama():
    hf = _hf()
    return hf, CausalLM.from_hf(hf)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_batched_generation_equals_hugging_face(family, llama):
    hf, model = llama if family == "llama" else (lambda h: (h, CausalLM.from_hf(h)))(_hf("mistral"))
    prompts = random_prompts((5, 13, 2), VOCAB)
    engine = Engine(model, num_blocks=16, block_size=8, max_tokens_per_step=10)  # the 13-token prompt in chunks
    ours = engine.generate(prompts, max_new_tokens=7)
    assert engine.stats.max_batch == 3 and engine.stats.steps < 3 * 7  # batched: fewer steps than one by one
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, 7)


def test_streaming_yields_every_token_as_it_comes(llama):
    _, model = llama
    prompts = random_prompts((4, 6), VOCAB)
    engine = Engine(model, num_blocks=16, block_size=8)
    streamed = list(engine.stream(prompts, max_new_tokens=3))
    assert sorted(i for i, _ in streamed) == [0, 0, 0, 1, 1, 1]
    assert [[t for i, t in streamed if i == k] for k in range(2)] == engine.generate(prompts, max_new_tokens=3)


def test_prefix_caching_reuses_a_shared_prompt(llama):
    hf, model = llama
    shared = random_prompts((16,), VOCAB, seed=5)[0]
    first, second = shared + [7, 8], shared + [9]
    engine = Engine(model, num_blocks=16, block_size=8)
    engine.generate([first], max_new_tokens=2)
    assert engine.stats.cached_prompt_tokens == 0
    out = engine.generate([second], max_new_tokens=4)
    assert engine.stats.cached_prompt_tokens == 16  # the two full blocks of the shared prefix
    assert engine.stats.tokens_computed == 1 + 3  # only the new prompt token, then the decodes
    assert out[0] == hf_greedy(hf, second, 4)


def test_stop_tokens_end_a_prompt_and_are_kept(llama):
    _, model = llama
    prompts = random_prompts((5, 7), VOCAB)
    engine = Engine(model, num_blocks=16, block_size=8)
    full = engine.generate(prompts, max_new_tokens=6)
    stop = full[0][2]
    stopped = engine.generate(prompts, max_new_tokens=6, stop_token_ids=[stop])
    assert stopped[0] == full[0][:full[0].index(stop) + 1]
    cut = full[1].index(stop) + 1 if stop in full[1] else 6
    assert stopped[1] == full[1][:cut]


def test_sampling_is_seeded_and_top_p_narrows_it(llama):
    _, model = llama
    prompts = random_prompts((4,), VOCAB)
    engine = Engine(model, num_blocks=8, block_size=8)
    a = engine.generate(prompts, max_new_tokens=6, temperature=1.0, seed=1)
    assert a == engine.generate(prompts, max_new_tokens=6, temperature=1.0, seed=1)
    assert a != engine.generate(prompts, max_new_tokens=6, temperature=1.0, seed=2)
    greedy = engine.generate(prompts, max_new_tokens=6)
    assert engine.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_the_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Engine.distribution(logits, 1.0, 0.7)
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(Engine.distribution(logits, 1.0, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


@pytest.fixture(scope="module")
def plain_greedy(llama):
    """Two prompts and the target's plain greedy continuation of each (computed once for the module)."""
    prompts = random_prompts((5, 9), VOCAB)
    return prompts, Engine(llama[1], num_blocks=16, block_size=8).generate(prompts, max_new_tokens=6)


@pytest.mark.parametrize("draft_kind", ["prompt_lookup", "draft model", "the target itself"])
def test_speculative_greedy_output_is_the_targets(draft_kind, llama, plain_greedy):
    _, model = llama
    draft = {"prompt_lookup": "prompt_lookup", "draft model": CausalLM.from_hf(_hf(layers=1, seed=1)),
             "the target itself": model}[draft_kind]
    prompts, base = plain_greedy
    engine = Engine(model, num_blocks=16, block_size=8, draft_model=draft, num_speculative_tokens=3)
    assert engine.generate(prompts, max_new_tokens=6) == base
    stats = engine.stats
    assert stats.generated_tokens == 12 and stats.target_steps <= stats.generated_tokens
    if draft_kind == "the target itself":  # a perfect draft: every proposal accepted, k + 1 tokens per step
        # per prompt: the prefill's token, then 6 − 1 = 5 tokens in steps of up to 3 + 1: 1 + 2 target passes
        assert stats.acceptance_rate == 1.0 and stats.target_steps == 2 * 3 and stats.tokens_per_target_step == 2.0


def test_the_acceptance_rule_keeps_the_target_distribution_exactly():
    """Monte Carlo of one speculative position: the kept token is distributed as p, not as q."""
    g = torch.Generator().manual_seed(0)
    vocab, trials = 6, 6000
    p_logits = torch.randn(2, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    p = torch.softmax(p_logits[0], -1)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        draft = int(torch.multinomial(q, 1, generator=g))
        kept, _ = Engine.verify(p_logits, [draft], [q], 1.0, 1.0, g)
        counts[kept[0]] += 1
    empirical = counts / trials
    assert float((empirical - p).abs().max()) < 0.025, (empirical, p)
    assert float((empirical - q).abs().max()) > 0.05  # the control: q itself is far from p here
    # deterministic drafts (prompt lookup: q one-hot) keep p too
    counts.zero_()
    for _ in range(trials):
        kept, _ = Engine.verify(p_logits, [0], None, 1.0, 1.0, g)
        counts[kept[0]] += 1
    assert float((counts / trials - p).abs().max()) < 0.025


def test_bad_input_is_refused(llama):
    _, model = llama
    with pytest.raises(TypeError, match="must be a kernel_ladder.models.CausalLM"):
        Engine(torch.nn.Linear(2, 2), num_blocks=4)
    engine = Engine(model, num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match=r"prompt 1 must be a non-empty list of token ids in \[0, 64\)"):
        engine.generate([[1, 2], [99]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate([[1]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match=r"got a 2-D tensor \(a \(batch, length\) tensor: pass input_ids.tolist\(\)"):
        engine.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="needs up to"):
        engine.generate([list(range(3, 60))], max_new_tokens=2)  # more blocks than the cache has
    other = CausalLM.from_hf(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **{**SMALL, "vocab_size": 32}, num_hidden_layers=1, num_key_value_heads=2)))
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(32\) must be the target's \(64\)"):
        Engine(model, num_blocks=4, draft_model=other)
    with pytest.raises(ValueError, match="draft_model must be"):
        Engine(model, num_blocks=4, draft_model="ngram")


# ----------------------------------------------------------------------------------------------
# Chunked prefill: the model runs on every scheduled token, every step
# ----------------------------------------------------------------------------------------------


class _TokenSpy:
    """Counts the tokens the model itself processes (rows through layer 0's MLP, a module the packed
    step calls) and the tokens the scheduler hands out (``Scheduler.step``'s ``total_tokens``)."""

    def __init__(self, model, monkeypatch):
        from kernel_ladder.serving import scheduler as scheduler_module

        self.processed, self.scheduled, self.steps = [], [], []
        self._hook = model.model.layers[0].mlp.register_forward_hook(
            lambda module, args, out: self.processed.append(args[0].shape[0]))
        step = scheduler_module.Scheduler.step

        def spied_step(scheduler):
            out = step(scheduler)
            self.scheduled.append(out.total_tokens)
            self.steps.append(out)
            return out

        monkeypatch.setattr(scheduler_module.Scheduler, "step", spied_step)

    def close(self):
        self._hook.remove()


@pytest.fixture
def spy(llama, monkeypatch):
    spy = _TokenSpy(llama[1], monkeypatch)
    yield spy
    spy.close()


def test_a_step_of_partial_prompt_chunks_only_still_runs_the_model(llama, spy):
    """Budget 2, a 3-token prompt: the first step holds only a chunk that ends mid-prompt (nothing
    samples); its K/V must still be computed, or the next steps attend to zeros."""
    hf, model = llama
    prompt = random_prompts((3,), VOCAB, seed=11)[0]
    engine = Engine(model, num_blocks=8, block_size=8, max_tokens_per_step=2)
    out = engine.generate([prompt], max_new_tokens=4)
    assert not spy.steps[0].sample_request_ids, "the first step was meant to sample nothing"
    assert spy.processed == spy.scheduled == [2, 1, 1, 1, 1]
    assert out[0] == hf_greedy(hf, prompt, 4)


@pytest.fixture(scope="module")
def chunk_prompts(llama):
    """Four prompts of different lengths and HF's greedy continuations (computed once)."""
    prompts = random_prompts((11, 4, 17, 2), VOCAB, seed=12)
    return prompts, [hf_greedy(llama[0], p, 4) for p in prompts]


@pytest.mark.parametrize("budget", [3, 8, 16])
def test_prompts_longer_than_the_step_budget_equal_hugging_face(budget, llama, chunk_prompts, spy):
    """Several requests of different lengths prefilled in chunks under budgets below the longest
    prompts (3: every prompt but one in chunks; 16: the 17-token one), decoding beside each other."""
    _, model = llama
    prompts, expected = chunk_prompts
    engine = Engine(model, num_blocks=24, block_size=8, max_tokens_per_step=budget)
    assert engine.generate(prompts, max_new_tokens=4) == expected
    assert any(not s.sample_request_ids for s in spy.steps) or budget == 16
    assert engine.stats.max_batch > 1 and engine.stats.preemptions == 0
    assert sum(spy.processed) == sum(spy.scheduled) == engine.stats.tokens_computed
    assert spy.processed == spy.scheduled, "a step's tokens were scheduled but not run through the model"
    assert engine.stats.tokens_computed == sum(len(p) + 4 - 1 for p in prompts)


def test_a_later_request_reuses_correct_blocks_of_a_chunked_prefix(llama, spy):
    """A 16-token shared prefix prefilled 4 tokens a step: its two full blocks go into the prefix
    cache; a later request (same call, admitted once the first finished its prompt) and one in a
    later call reuse them, and their outputs still equal Hugging Face's."""
    hf, model = llama
    shared = random_prompts((16,), VOCAB, seed=13)[0]
    first, second, third = shared + [7, 8], shared + [9, 10, 11], shared + [12]
    engine = Engine(model, num_blocks=24, block_size=8, max_tokens_per_step=4)
    out = engine.generate([first, second], max_new_tokens=3)
    assert engine.stats.cached_prompt_tokens == 16, "the second request found the first's two full blocks"
    assert out == [hf_greedy(hf, first, 3), hf_greedy(hf, second, 3)]
    assert engine.generate([third], max_new_tokens=3) == [hf_greedy(hf, third, 3)]
    assert engine.stats.cached_prompt_tokens == 16 and engine.stats.tokens_computed == 1 + 2
    assert spy.processed == spy.scheduled


def test_a_prompt_longer_than_the_default_budget_runs_every_token(monkeypatch):
    """300 prompt tokens at the default budget of 256: two prefill steps, both through the model."""
    t = transformers
    torch.manual_seed(3)
    hf = t.AutoModelForCausalLM.from_config(t.LlamaConfig(
        **{**SMALL, "max_position_embeddings": 512}, num_hidden_layers=1, num_key_value_heads=2)).float().eval()
    model = CausalLM.from_hf(hf)
    spy = _TokenSpy(model, monkeypatch)
    try:
        prompt = random_prompts((300,), VOCAB, seed=14)[0]
        engine = Engine(model, num_blocks=24, block_size=16)
        out = engine.generate([prompt], max_new_tokens=2)
        assert spy.processed == spy.scheduled == [256, 44, 1]
        assert out[0] == hf_greedy(hf, prompt, 2)
    finally:
        spy.close()


def test_a_failed_model_step_leaves_no_unwritten_block_in_the_prefix_cache(llama):
    """Full blocks are keyed when the scheduler hands out their slots; if the model step that was to
    write them fails, they must not stay findable, or the next request with that prefix reuses them."""
    hf, model = llama
    prompt = random_prompts((18,), VOCAB, seed=15)[0]
    engine = Engine(model, num_blocks=16, block_size=8)

    class StepFailed(Exception):
        pass

    def failing_step(step):
        raise StepFailed

    engine.forward_step = failing_step
    with pytest.raises(StepFailed):
        engine.generate([prompt], max_new_tokens=2)
    del engine.forward_step
    assert engine.cache.num_free_blocks == engine.num_blocks and not engine.cache.seq_ids
    assert engine.cache.allocator.num_evictable == 0, "blocks that were never written stay in the prefix cache"
    assert engine.generate([prompt], max_new_tokens=3) == [hf_greedy(hf, prompt, 3)]
    assert engine.stats.cached_prompt_tokens == 0
    engine.cache.check_invariants()


def test_requests_with_different_cache_salts_share_no_prefix(llama, spy):
    hf, model = llama
    shared = random_prompts((16,), VOCAB, seed=16)[0]
    first, second = shared + [5], shared + [6, 7]
    expected = [hf_greedy(hf, first, 2), hf_greedy(hf, second, 2)]
    engine = Engine(model, num_blocks=24, block_size=8)
    assert engine.generate([first], max_new_tokens=2, cache_salt="alice") == expected[:1]
    assert engine.generate([second], max_new_tokens=2, cache_salt="bob") == expected[1:]
    assert engine.stats.cached_prompt_tokens == 0, "bob found alice's blocks"
    assert engine.generate([second], max_new_tokens=2) == expected[1:]
    assert engine.stats.cached_prompt_tokens == 0, "an unsalted request found a salted one's blocks"
    assert engine.generate([first, second], max_new_tokens=2, cache_salt=[b"alice", "bob"]) == expected
    assert engine.stats.cached_prompt_tokens == 32, "each found the blocks of its own salt"
    with pytest.raises(ValueError, match=r"Engine.generate: cache_salt must be one salt or a list of 2 \(one per "
                                         r"prompt\), got a list of 1"):
        engine.generate([first, second], max_new_tokens=2, cache_salt=["alice"])
    with pytest.raises(TypeError, match=r"Engine.generate: cache_salt must be a str, bytes or None, got int"):
        engine.generate([first], max_new_tokens=2, cache_salt=7)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_blocks=0), ValueError, r"num_blocks must be a positive int, got 0"),
    (dict(num_blocks=8.0), TypeError, r"num_blocks must be an int, got float 8.0"),
    (dict(num_blocks=True), TypeError, r"num_blocks must be an int, got bool True"),
    (dict(block_size=12), ValueError, r"block_size must be one of \(8, 16, 32, 64, 128\) \(the cache block sizes "
                                      r"kernel_ladder.paged_attention supports\), got 12"),
    (dict(block_size=4), ValueError, r"block_size must be one of \(8, 16, 32, 64, 128\)"),
    (dict(block_size="16"), TypeError, r"block_size must be an int, got str '16'"),
    (dict(num_blocks=2**28, block_size=16), ValueError, r"num_blocks \* block_size = 4294967296 slots do not fit"),
    (dict(max_batch_size=0), ValueError, r"max_batch_size must be a positive int or None, got 0"),
    (dict(max_tokens_per_step=0), ValueError, r"max_tokens_per_step must be a positive int, got 0"),
    (dict(max_tokens_per_step=None), TypeError, r"max_tokens_per_step must be an int, got NoneType None"),
    (dict(num_speculative_tokens=0), ValueError, r"num_speculative_tokens must be a positive int, got 0"),
    (dict(lookup_ngram=-1), ValueError, r"lookup_ngram must be a positive int, got -1"),
    (dict(draft_model="ngram"), ValueError, r"draft_model must be a kernel_ladder.models.CausalLM, 'prompt_lookup' "
                                           r"or None, got 'ngram'"),
])
def test_engine_arguments_are_checked_at_construction(kwargs, error, message, llama):
    _, model = llama
    with pytest.raises(error, match=r"^kernel_ladder.models.Engine: " + message):
        Engine(model, **{"num_blocks": 8, **kwargs})


def test_a_draft_model_of_another_dtype_is_refused_at_construction(llama):
    _, model = llama
    draft = CausalLM.from_hf(_hf(layers=1, seed=2)).to(torch.float16)
    with pytest.raises(TypeError, match=r"^kernel_ladder.models.Engine: draft_model's parameters must be the target's "
                                        r"dtype \(torch.float32\) and device \(cpu\), got torch.float16 on cpu"):
        Engine(model, num_blocks=8, draft_model=draft)


# ----------------------------------------------------------------------------------------------
# The layer protocol's cache: what each layer holds per token (CacheSpec)
# ----------------------------------------------------------------------------------------------


def test_the_engine_allocates_what_the_models_cache_spec_says(llama):
    from kernel_ladder.serving import CacheSpec

    _, model = llama
    assert model.cache_spec() == [CacheSpec.kv(2, 8)] * 2  # Llama: K and V of (Hkv, D) in every layer
    engine = Engine(model, num_blocks=4, block_size=8)
    assert engine.cache.k.shape == engine.cache.v.shape == (2, 4, 8, 2, 8)
    assert engine.cache.bytes_per_token() == 2 * 2 * (2 * 8) * 4  # layers x (K, V) x Hkv·D x fp32


def test_a_latent_cache_holds_one_vector_per_token_and_copies_it_on_write():
    from kernel_ladder.serving import CacheSpec, PagedKVCache

    spec = CacheSpec.latent(kv_lora_rank=12, rope_dim=4)
    cache = PagedKVCache(2, num_blocks=6, block_size=8, spec=spec, dtype=torch.float64)
    assert cache.latent.shape == (2, 6, 8, 16) and cache.latent_cache(1).shape == (6, 8, 16)
    assert cache.bytes_per_token() == 2 * 16 * 8 and spec.bytes_per_token(torch.bfloat16) == 32
    with pytest.raises(KeyError, match=r"layer 0 holds \['latent'\] \(latent cache\), not 'k'"):
        cache.k_cache(0)
    with pytest.raises(AttributeError, match=r"\.k is the one 'k' tensor"):
        _ = cache.k
    cache.allocate("a", 0)
    slots = cache.append_slots("a", 5)
    for layer in range(2):  # what write_latent_cache would store: token t's vector is t + layer everywhere
        flat = cache.latent_cache(layer).view(-1, 16)
        flat[slots.long()] = (torch.arange(5, dtype=torch.float64) + layer)[:, None].expand(5, 16)
    cache.fork("a", "b")
    cache.append_slots("b", 1)  # writes into the shared block: b gets a copy of its first 5 slots
    assert cache.block_table("a")[0] != cache.block_table("b")[0]
    for layer in range(2):
        (history,) = cache.gather("b", layer)
        assert history.shape == (6, 16)
        assert torch.equal(history[:5, 0], torch.arange(5, dtype=torch.float64) + layer)
    cache.check_invariants()


def test_layers_of_different_specs_get_their_own_tensors():
    from kernel_ladder.serving import CacheSpec, PagedKVCache

    specs = [CacheSpec.kv(2, 8), CacheSpec.kv(1, 16, v_head_dim=4), CacheSpec.kv(2, 8)]
    cache = PagedKVCache(3, num_blocks=4, block_size=8, spec=specs)
    assert [tuple(cache.k_cache(i).shape) for i in range(3)] == [(4, 8, 2, 8), (4, 8, 1, 16), (4, 8, 2, 8)]
    assert tuple(cache.v_cache(1).shape) == (4, 8, 1, 4)
    assert cache.k_cache(0).data_ptr() != cache.k_cache(2).data_ptr()
    assert cache.bytes_per_token() == 4 * (2 * 2 * 8 + 16 + 4 + 2 * 2 * 8)
    with pytest.raises(ValueError, match=r"spec must be a CacheSpec or a list of 3 \(one per layer\)"):
        PagedKVCache(3, num_blocks=4, block_size=8, spec=specs[:2])
    with pytest.raises(ValueError, match=r"give num_kv_heads and head_dim, or spec"):
        PagedKVCache(3, num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match=r"CacheSpec.latent: rope_dim must be a positive int, got 0"):
        CacheSpec.latent(8, 0)
