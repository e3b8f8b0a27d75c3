"""Every ``kernel_ladder`` op under ``torch.compile(fullgraph=True)``, called at three sizes, with automatic
dynamic shapes and with ``dynamic=True``: forward and (where the op has one) backward equal eager, bit for
bit, and the graph holds the op's custom op(s) (no graph break, no decomposition around it).

The sizes change every dimension a caller changes between steps: the tokens, sequence lengths and the
``max_seqlen`` ints of packed attention, the batch of a decode step, the experts of an MoE layer. With
automatic dynamic shapes the first call compiles a static graph and the second a dynamic one, which must
serve the third; with ``dynamic=True`` the checks see ``SymInt`` sizes from the first call on. What the
graphs' checks receive — ``SymInt`` where the eager call has an ``int`` — is what these tests exercise:
each op's argument checks must accept a symbolic int wherever a size may flow in.

``aot_eager`` runs the same kernels as eager around the same aten ops (Inductor is exercised by the ops'
own test files), so the comparisons are exact. :func:`test_every_op_has_a_compile_case` keeps the list
complete: a new custom op or public function without a case fails it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import kernel_ladder
from kernel_ladder import _autocast
from tests.helpers import DEVICE

SIZES = (0, 1, 2)


def _r(gen, *shape, grad=False, dtype=torch.float32, scale=1.0):
    t = (torch.randn(shape, generator=gen) * scale).to(DEVICE, dtype)
    return t.requires_grad_() if grad else t


def _i(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _cumsum(lengths) -> list[int]:
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


@dataclass(frozen=True)
class Case:
    """``make(size, gen)``: the call's arguments at size 0, 1 or 2 (tensors that need a gradient have
    ``requires_grad``); ``call(*args)``: the op, outputs returned; ``ops``: the custom ops the graph holds."""

    make: Callable[[int, torch.Generator], tuple]
    call: Callable[..., object]
    ops: tuple[str, ...]


# ----------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------

_ROWS = (3, 5, 8)
_COLS = (6, 11, 16)


def _rows_cols(size, gen, count=1, grad=True):
    return tuple(_r(gen, _ROWS[size], _COLS[size], grad=grad) for _ in range(count))


def _cross_entropy_args(size, gen, hidden=None):
    vocab = (7, 9, 12)[size]
    target = torch.randint(0, vocab, (_ROWS[size],), generator=gen).to(DEVICE)
    target[1] = -100
    if hidden is None:
        return _r(gen, _ROWS[size], vocab, grad=True), target
    return _r(gen, _ROWS[size], hidden, grad=True), _r(gen, vocab, hidden, grad=True), target


def _matmul_args(size, gen, grad=True):
    m, k, n = (5, 7, 9)[size], (16, 24, 33)[size], (8, 10, 17)[size]
    return _r(gen, m, k, grad=grad), _r(gen, k, n, grad=grad)


def _quantized_args(size, gen):
    weight = kernel_ladder.quantize_weight(_r(gen, 16, 64), "int8")
    return _r(gen, _ROWS[size], 64, grad=True), weight, _r(gen, 16, grad=True)


def _quantize_weight(w):
    weight = kernel_ladder.quantize_weight(w, "int4", group_size=32)
    return weight.data, weight.scales


def _rope_args(size, gen):
    seqlen, dim = (3, 5, 8)[size], 8
    positions = torch.arange(seqlen, device=DEVICE) + size
    return _r(gen, 1, 2, seqlen, dim, grad=True), _r(gen, 1, 1, seqlen, dim, grad=True), positions


def _rope(q, k, positions):
    cos, sin = kernel_ladder.rope_cos_sin(positions, q.shape[-1])
    return kernel_ladder.rope(q, k, cos, sin)


def _rope_qk_norm(q, k, positions, q_norm_weight, k_norm_weight):
    cos, sin = kernel_ladder.rope_cos_sin(positions, q.shape[-1])
    return kernel_ladder.rope(q, k, cos, sin, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                              norm_offset=1.0)


def _attention_args(size, gen):
    tq, tk = (3, 6, 9)[size], (5, 6, 12)[size]
    return _r(gen, 1, 2, tq, 16, grad=True), _r(gen, 1, 1, tk, 16, grad=True), _r(gen, 1, 1, tk, 16, grad=True)


def _varlen_args(size, gen):
    lengths_q, lengths_k = ([2, 3], [4, 1, 6], [9, 2, 5])[size], ([3, 3], [4, 2, 6], [9, 7, 5])[size]
    q = _r(gen, sum(lengths_q), 2, 16, grad=True)
    k, v = (_r(gen, sum(lengths_k), 1, 16, grad=True) for _ in range(2))
    return q, k, v, _i(_cumsum(lengths_q)), _i(_cumsum(lengths_k)), max(lengths_q), max(lengths_k)


def _attention_sinks_args(size, gen):
    """Sinks and a v head dim (8) other than q's and k's (16)."""
    q, k, _ = _attention_args(size, gen)
    return q, k, _r(gen, 1, 1, k.shape[2], 8, grad=True), _r(gen, 2, grad=True)


def _varlen_sinks_args(size, gen):
    q, k, _, *rest = _varlen_args(size, gen)
    return q, k, _r(gen, k.shape[0], 1, 8, grad=True), *rest, _r(gen, 2, grad=True)


def _block_sparse_args(size, gen):
    blocks = (3, 4, 5)[size]
    q, k, v = (_r(gen, 1, 2, blocks * 16, 16, grad=True) for _ in range(3))
    return q, k, v, kernel_ladder.sliding_window_mask(blocks, blocks, 1, device=DEVICE)


def _paged_cache(seq_lens, gen, block_size=8, heads_kv=1, dim=16):
    used = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(used) + 1
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(len(seq_lens), max(used) + 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = order[start:start + n]
        start += n
    k_cache, v_cache = (_r(gen, num_blocks, block_size, heads_kv, dim) for _ in range(2))
    return k_cache, v_cache, table.to(DEVICE), _i(seq_lens)


def _paged_decode_args(size, gen):
    seq_lens = ([9, 5], [3, 17, 8], [30, 1, 12, 20])[size]
    return (_r(gen, len(seq_lens), 2, 16), *_paged_cache(seq_lens, gen))


def _paged_prefill_args(size, gen):
    seq_lens, q_lens = ([9, 5], [3, 17, 8], [30, 1, 12, 20])[size], ([4, 5], [3, 2, 1], [7, 1, 12, 3])[size]
    return (_r(gen, sum(q_lens), 2, 16), *_paged_cache(seq_lens, gen), _i(_cumsum(q_lens)))


def _paged_sinks_args(size, gen):
    """Decode over a cache whose v head dim (8) is not k's (16), with sinks and two splits (merged once)."""
    q, k_cache, v_cache, table, lens = _paged_decode_args(size, gen)
    return q, k_cache, _r(gen, *v_cache.shape[:3], 8), table, lens, _r(gen, 2)


def _write_kv_cache_args(size, gen):
    tokens, num_blocks = (3, 5, 9)[size], (2, 3, 4)[size]
    slots = torch.randperm(num_blocks * 8, generator=gen)[:tokens].to(DEVICE)
    slots[0] = -1  # padding
    return (_r(gen, tokens, 1, 16), _r(gen, tokens, 1, 16), torch.zeros(num_blocks, 8, 1, 16, device=DEVICE),
            torch.zeros(num_blocks, 8, 1, 16, device=DEVICE), slots)


def _write_kv_cache(k, v, k_cache, v_cache, slots):
    kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache


def _mla_args(size, gen, prefill=False):
    seq_lens, q_lens = ([9, 5], [3, 17, 8], [30, 1, 12, 20])[size], ([4, 5], [3, 2, 1], [7, 1, 12, 3])[size]
    latent_cache, _, table, lens = _paged_cache(seq_lens, gen, heads_kv=1, dim=24)
    rows = sum(q_lens) if prefill else len(seq_lens)
    args = (_r(gen, rows, 2, 16), _r(gen, rows, 2, 8), latent_cache[:, :, 0], table, lens)
    return (*args, _i(_cumsum(q_lens))) if prefill else args


def _write_latent_cache_args(size, gen):
    tokens, num_blocks = (3, 5, 9)[size], (2, 3, 4)[size]
    slots = torch.randperm(num_blocks * 8, generator=gen)[:tokens].to(DEVICE)
    slots[0] = -1  # padding
    return _r(gen, tokens, 16), _r(gen, tokens, 8), torch.zeros(num_blocks, 8, 24, device=DEVICE), slots


def _write_latent_cache(c_kv, k_rope, latent_cache, slots):
    kernel_ladder.write_latent_cache(c_kv, k_rope, latent_cache, slots)
    return latent_cache


_EXPERTS = (4, 6, 7)


def _moe_args(size, gen):
    experts, hidden, ffn = _EXPERTS[size], 16, 16
    return (_r(gen, _ROWS[size], hidden, grad=True), _r(gen, _ROWS[size], experts, grad=True),
            _r(gen, experts, 2 * ffn, hidden, grad=True, scale=0.3),
            _r(gen, experts, hidden, ffn, grad=True, scale=0.3))


def _gpt_oss_moe_args(size, gen):
    """GPT-OSS's experts: gate_up (E, H, 2F) interleaved, both biases."""
    experts, hidden, ffn = _EXPERTS[size], 16, 8
    return (_r(gen, _ROWS[size], hidden, grad=True), _r(gen, _ROWS[size], experts, grad=True),
            _r(gen, experts, hidden, 2 * ffn, grad=True), _r(gen, experts, 2 * ffn, grad=True),
            _r(gen, experts, ffn, hidden, grad=True, scale=0.3), _r(gen, experts, hidden, grad=True))


def _gpt_oss_moe(x, logits, w_gate_up, gate_up_bias, w_down, down_bias):
    return kernel_ladder.moe(x, logits, w_gate_up, w_down, 2, activation="swiglu_oai", limit=1.0,
                             gate_up_bias=gate_up_bias, down_bias=down_bias, gate_up_layout="gpt_oss")


_GROUPED_EXPERTS = (4, 6, 8)  # four groups of 4, 6 and 8


def _expert_ids(size, gen):
    rows, experts = _ROWS[size], _EXPERTS[size]
    return torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(rows)]).to(DEVICE)


def _routing_args(size, gen):
    ids = _expert_ids(size, gen)
    return _r(gen, ids.shape[0], _EXPERTS[size], grad=True), ids


def _permute_args(size, gen):
    ids = _expert_ids(size, gen)
    permutation, _ = kernel_ladder.moe_permute(ids, _EXPERTS[size])
    return ids, permutation


def _gather_args(size, gen):
    ids, permutation = _permute_args(size, gen)
    return _r(gen, ids.shape[0], 16, grad=True), permutation


def _combine_args(size, gen):
    ids, permutation = _permute_args(size, gen)
    return _r(gen, ids.numel(), 16, grad=True), permutation, _r(gen, *ids.shape, grad=True)


CASES: dict[str, Case] = {
    "add": Case(lambda s, g: (*_rows_cols(s, g), _r(g, _COLS[s], grad=True)), kernel_ladder.add, ("add",)),
    "gelu": Case(_rows_cols, lambda x: kernel_ladder.gelu(x, approximate="tanh"), ("gelu",)),
    "silu": Case(_rows_cols, kernel_ladder.silu, ("silu",)),
    "swiglu": Case(lambda s, g: _rows_cols(s, g, 2), kernel_ladder.swiglu, ("swiglu",)),
    "geglu": Case(lambda s, g: _rows_cols(s, g, 2), kernel_ladder.geglu, ("geglu",)),
    "dropout": Case(_rows_cols, lambda x: kernel_ladder.dropout(x, 0.3, seed=7), ("dropout",)),
    "dropout_mask": Case(lambda s, g: _rows_cols(s, g, grad=False),
                         lambda x: kernel_ladder.dropout_mask(x.shape, 0.3, seed=7, device=x.device),
                         ("dropout_mask",)),
    "cross_entropy": Case(_cross_entropy_args, lambda logits, target: kernel_ladder.cross_entropy(
        logits, target, label_smoothing=0.1), ("cross_entropy",)),
    "fused_linear_cross_entropy": Case(lambda s, g: _cross_entropy_args(s, g, hidden=16),
                                       kernel_ladder.fused_linear_cross_entropy, ("fused_linear_cross_entropy",)),
    "softmax": Case(_rows_cols, kernel_ladder.softmax, ("softmax",)),
    "log_softmax": Case(_rows_cols, kernel_ladder.log_softmax, ("log_softmax",)),
    "matmul": Case(_matmul_args, kernel_ladder.matmul, ("matmul",)),
    "linear": Case(lambda s, g: (_r(g, _ROWS[s], 16, grad=True), _r(g, _COLS[s], 16, grad=True),
                                 _r(g, _COLS[s], grad=True)),
                   lambda x, w, b: kernel_ladder.linear(x, w, b, activation="gelu"), ("linear",)),
    "quantize_weight": Case(lambda s, g: (_r(g, _COLS[s], 64),),
                            _quantize_weight,
                            ("quantize_int4",)),
    "quantize_activations": Case(lambda s, g: (_r(g, _ROWS[s], 64),), kernel_ladder.quantize_activations,
                                 ("quantize_rows",)),
    "quantized_linear": Case(_quantized_args, kernel_ladder.quantized_linear, ("quantized_linear",)),
    "rms_norm": Case(lambda s, g: (*_rows_cols(s, g), _r(g, _COLS[s], grad=True)), kernel_ladder.rms_norm,
                     ("rms_norm",)),
    "layer_norm": Case(lambda s, g: (*_rows_cols(s, g), _r(g, _COLS[s], grad=True), _r(g, _COLS[s], grad=True)),
                       lambda x, w, b: kernel_ladder.layer_norm(x, x.shape[-1], w, b), ("layer_norm",)),
    "add_rms_norm": Case(lambda s, g: (*_rows_cols(s, g, 2), _r(g, _COLS[s], grad=True)), kernel_ladder.add_rms_norm,
                         ("add_rms_norm",)),
    "rope": Case(_rope_args, _rope, ("rope",)),
    "rope_qk_norm": Case(lambda s, g: (*_rope_args(s, g), _r(g, 8, grad=True), _r(g, 8, grad=True)), _rope_qk_norm,
                         ("rope",)),
    "gated_mlp": Case(lambda s, g: (_r(g, _ROWS[s], 16, grad=True), _r(g, _COLS[s], 16, grad=True),
                                    _r(g, _COLS[s], 16, grad=True), _r(g, 16, _COLS[s], grad=True)),
                      kernel_ladder.gated_mlp, ("gated_mlp",)),
    "grouped_matmul": Case(lambda s, g: (_r(g, _ROWS[s] + 4, 16, grad=True), _r(g, _EXPERTS[s], 16, 8, grad=True),
                                         _i(torch.linspace(0, _ROWS[s] + 4, _EXPERTS[s] + 1)[1:].int().tolist())),
                           kernel_ladder.grouped_matmul, ("grouped_matmul",)),
    "flash_attention": Case(_attention_args, lambda q, k, v: kernel_ladder.flash_attention(
        q, k, v, causal=True, return_lse=True), ("flash_attention",)),
    "flash_attention_varlen": Case(_varlen_args, lambda *args: kernel_ladder.flash_attention_varlen(
        *args, causal=True, return_lse=True), ("flash_attention_varlen",)),
    "flash_attention_sinks": Case(_attention_sinks_args, lambda q, k, v, sinks: kernel_ladder.flash_attention(
        q, k, v, causal=True, return_lse=True, sinks=sinks), ("flash_attention",)),
    "flash_attention_varlen_sinks": Case(_varlen_sinks_args, lambda *args: kernel_ladder.flash_attention_varlen(
        *args[:-1], causal=True, return_lse=True, sinks=args[-1]), ("flash_attention_varlen",)),
    "block_sparse_attention": Case(_block_sparse_args, lambda q, k, v, mask: kernel_ladder.block_sparse_attention(
        q, k, v, mask, block_size=16), ("block_sparse_attention",)),
    "paged_attention": Case(_paged_decode_args, kernel_ladder.paged_attention, ("paged_attention",)),
    "paged_attention_prefill": Case(_paged_prefill_args, lambda q, k, v, table, lens, cu: kernel_ladder.paged_attention(
        q, k, v, table, lens, cu_seqlens_q=cu, window=6), ("paged_attention",)),
    "paged_attention_sinks": Case(_paged_sinks_args, lambda q, k, v, table, lens, sinks: kernel_ladder.paged_attention(
        q, k, v, table, lens, num_splits=2, sinks=sinks), ("paged_attention",)),
    "write_kv_cache": Case(_write_kv_cache_args, _write_kv_cache, ("write_kv_cache",)),
    "mla_attention": Case(_mla_args, lambda ql, qr, cache, table, lens: kernel_ladder.mla_attention(
        ql, qr, cache, table, lens, 0.2, 16), ("mla_attention",)),
    "mla_attention_prefill": Case(lambda s, g: _mla_args(s, g, prefill=True), lambda *args: kernel_ladder.mla_attention(
        *args[:5], 0.2, 16, args[5], num_splits=2), ("mla_attention",)),
    "write_latent_cache": Case(_write_latent_cache_args, _write_latent_cache, ("write_latent_cache",)),
    "topk_routing": Case(lambda s, g: (_r(g, _ROWS[s], _EXPERTS[s], grad=True),),
                         lambda logits: kernel_ladder.topk_routing(logits, 2), ("topk_routing",)),
    "moe": Case(_moe_args, lambda x, logits, w1, w2: kernel_ladder.moe(x, logits, w1, w2, top_k=2),
                ("topk_routing", "moe_permute", "moe_gate_up", "grouped_matmul", "moe_combine")),
    "topk_routing_grouped": Case(lambda s, g: (_r(g, _ROWS[s], 4 * _GROUPED_EXPERTS[s], grad=True),
                                               _r(g, 4 * _GROUPED_EXPERTS[s], scale=0.1)),
                                 lambda logits, bias: kernel_ladder.topk_routing(
                                     logits, 3, True, "sigmoid", bias=bias, num_groups=4, topk_groups=2, scale=2.5),
                                 ("topk_routing",)),
    "moe_gpt_oss": Case(_gpt_oss_moe_args, _gpt_oss_moe,
                        ("topk_routing", "moe_permute", "moe_gate_up", "grouped_matmul", "moe_combine")),
    "moe_load_balancing_loss": Case(_routing_args, lambda logits, ids: kernel_ladder.moe_load_balancing_loss(
        logits, ids, logits.shape[-1]), ()),
    "moe_permute": Case(lambda s, g: (_expert_ids(s, g), _EXPERTS[s]), kernel_ladder.moe_permute, ("moe_permute",)),
    "moe_gather": Case(_gather_args, lambda x, permutation: kernel_ladder.moe_gather(x, permutation, 2),
                       ("moe_gather",)),
    "moe_combine": Case(_combine_args, kernel_ladder.moe_combine, ("moe_combine",)),
}

#: Public names of kernel_ladder that are not ops: modules, classes, the kernels themselves, launch rules,
#: and helpers that build an op's constant inputs (masks, RoPE's table: called inside the cases above).
NOT_OPS = {"runtime", "ops", "autotune", "kv_cache", "serving", "RowConfig", "MatmulConfig", "QuantizedWeight",
           "QuantizedLinearConfig", "norm_launch_config", "softmax_launch_config", "plan_matmul", "grouped_tile_map",
           "grouped_matmul_ideal_bytes", "quantization_error", "sliding_window_mask", "bigbird_mask", "rope_cos_sin"}
#: matmul's launchers with an explicit MatmulConfig: chapter 04's ladder steps, which launch a Triton kernel
#: directly (not a custom op), so torch.compile cannot trace them; the op they rank is kernel_ladder.matmul.
LAUNCHERS = {"matmul_tiled", "matmul_split_k", "matmul_persistent"}


def test_every_op_has_a_compile_case():
    """Every custom op is in some case's graph, and every public function is a case (or named as no op)."""
    covered = {op for case in CASES.values() for op in case.ops}
    assert covered == set(_autocast.public_ops()), sorted(set(_autocast.public_ops()) ^ covered)
    functions = {name for name in kernel_ladder.__all__ if not name.endswith("_kernel")} - NOT_OPS - LAUNCHERS
    assert functions <= set(CASES), sorted(functions - set(CASES))


# ----------------------------------------------------------------------------------------------
# The test
# ----------------------------------------------------------------------------------------------


class _Recorder:
    """An ``aot_eager`` backend that keeps each graph's ``kernel_ladder`` ops (a trace Dynamo restarts hands
    its graph over again: the compiled versions are counted by Dynamo's cache instead)."""

    def __init__(self) -> None:
        self.graphs: list[set[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        ops = set()
        for node in gm.graph.nodes:
            name = getattr(node.target, "name", None)
            if node.op == "call_function" and callable(name) and name().startswith("kernel_ladder::"):
                ops.add(name().removeprefix("kernel_ladder::").split(".")[0])
        self.graphs.append(ops)
        return lookup_backend("aot_eager")(gm, example_inputs)


def _fresh(args: tuple) -> tuple:
    """Copies of the arguments (the compiled and the eager call each get their own: some ops write in place)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach().clone().requires_grad_(a.requires_grad)
        out.append(a)
    return tuple(out)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


def _run(args: tuple, fn, seed: int):
    """The outputs of ``fn(*args)`` and the gradients of the differentiable inputs under random cotangents."""
    outs = _tensors(fn(*args))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with_grad = [o for o in outs if o.requires_grad]
    if not leaves or not with_grad:
        return outs, []
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in with_grad]
    grads = torch.autograd.grad(with_grad, leaves, cotangents, allow_unused=True)
    return outs, list(grads)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("name", sorted(CASES))
@torch.fx.experimental._config.patch(use_duck_shape=False)  # sizes that happen to be equal stay two symbols
def test_op_compiles_fullgraph_at_three_sizes(name, dynamic, gen):
    case = CASES[name]
    torch._dynamo.reset()
    backend = _Recorder()
    compiled = torch.compile(case.call, fullgraph=True, dynamic=dynamic, backend=backend)
    for size in SIZES:
        args = case.make(size, gen)
        got = _run(_fresh(args), compiled, seed=size)
        want = _run(_fresh(args), case.call, seed=size)
        for kind, g, w in (("output", *[x[0] for x in (got, want)]), ("gradient", got[1], want[1])):
            assert len(g) == len(w), f"{name} at size {size}: {len(g)} {kind}s compiled, {len(w)} eager"
            for i, (a, b) in enumerate(zip(g, w)):
                assert (a is None) == (b is None), f"{name} at size {size}: {kind} {i}"
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                               msg=lambda m: f"{name} at size {size}, {kind} {i}: {m}")
    assert backend.graphs, f"{name}: nothing was compiled"
    for ops in backend.graphs:
        assert set(case.ops) <= ops, f"{name}: the graph holds {sorted(ops)}, expected {list(case.ops)}"
    # One dynamic graph serves every later size: automatic dynamic shapes compile a static graph, then a
    # dynamic one at the first change of size; dynamic=True compiles the dynamic one at once.
    entries = len(_debug_get_cache_entry_list(case.call.__code__))
    assert entries == (1 if dynamic else 2), f"{name}: {entries} compiled versions for 3 sizes"


def test_compiled_quantize_weight_still_rejects_a_non_finite_weight(gen):
    """Eager quantize_weight checks on the host (a ValueError); a traced graph cannot, so it asserts in the graph."""
    torch._dynamo.reset()
    compiled = torch.compile(_quantize_weight, fullgraph=True, backend="aot_eager")
    w = _r(gen, 4, 64)
    compiled(w)
    w[1, 5] = float("inf")
    with pytest.raises(RuntimeError, match=r"kernel_ladder\.quantize_weight: w holds a non-finite value"):
        compiled(w)
    with pytest.raises(ValueError, match=r"kernel_ladder\.quantize_weight: w has 1 non-finite value"):
        _quantize_weight(w)
