"""One tiny call of every public kernel_ladder op: forward, forward + backward, and torch's matching op.

For measuring what a call costs outside its kernels (:mod:`utils.overhead`), for checking that
every op shows up by name in a profiler trace, and for the chapter 10 report. Sizes are tiny (one
or two programs per launch), so that the host work, not the kernel, is what a call is made of.

Each :class:`OpCase` builds its inputs when :meth:`OpCase.build` is called (never at import) and
returns three callables that take no arguments: ``forward``, ``backward`` (forward and backward of
a loss, or None for an op without a gradient) and ``eager`` (torch's own op on the same inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernel_ladder

__all__ = ["ELEMENTWISE", "ROWS", "Built", "OpCase", "op_cases"]

#: The op families the 20 µs host-overhead goal applies to (read by bench.overhead).
ELEMENTWISE: tuple[str, ...] = ("add", "gelu", "silu", "swiglu", "geglu", "dropout", "dropout_mask")
ROWS: tuple[str, ...] = ("softmax", "log_softmax", "rms_norm", "layer_norm", "add_rms_norm", "cross_entropy")


@dataclass(frozen=True)
class Built:
    """A case's callables, inputs bound."""

    forward: Callable[[], object]
    backward: Callable[[], object] | None
    eager: Callable[[], object] | None


@dataclass(frozen=True)
class OpCase:
    """One public op: its name, its ``kernel_ladder::`` custom ops (forward, backward) and a builder."""

    name: str
    custom_ops: tuple[str, ...]  # the custom ops a forward call goes through
    backward_ops: tuple[str, ...]  # and those its backward adds
    make: Callable[[torch.device, torch.Generator], Built]

    def build(self, device: torch.device | None = None, seed: int = 0) -> Built:
        """The callables on ``device`` (kernel_ladder's default device if None), inputs drawn from ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        return self.make(device or kernel_ladder.runtime.DEVICE, gen)


def _randn(gen: torch.Generator, device: torch.device, *shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device).requires_grad_(grad)


def _loss_of(out: object) -> torch.Tensor:
    first = out[0] if isinstance(out, tuple) else out
    return first.sum() if first.dim() else first


def _with_backward(forward_grad: Callable[[], object]) -> Callable[[], object]:
    """``forward_grad`` (a forward on inputs that need gradients) then its backward."""
    def step():
        out = forward_grad()
        first = out[0] if isinstance(out, tuple) else out
        first.backward(torch.ones_like(first))
    return step


def _unary(op: Callable, eager: Callable) -> Callable[[torch.device, torch.Generator], Built]:
    def make(device, gen):
        x = _randn(gen, device, 8, 64)
        xg = x.clone().requires_grad_(True)
        return Built(lambda: op(x), _with_backward(lambda: op(xg)), lambda: eager(x))
    return make


def _binary(op: Callable, eager: Callable) -> Callable[[torch.device, torch.Generator], Built]:
    def make(device, gen):
        a, b = _randn(gen, device, 8, 64), _randn(gen, device, 8, 64)
        ag, bg = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        return Built(lambda: op(a, b), _with_backward(lambda: op(ag, bg)), lambda: eager(a, b))
    return make


def _rows(op: Callable, eager: Callable) -> Callable[[torch.device, torch.Generator], Built]:
    return _unary(op, eager)


def _rms_norm(device, gen):
    x, w = _randn(gen, device, 8, 64), _randn(gen, device, 64)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.rms_norm(x, w), _with_backward(lambda: kernel_ladder.rms_norm(xg, wg)),
                 lambda: F.rms_norm(x, (64,), w, 1e-6))


def _layer_norm(device, gen):
    x, w, b = _randn(gen, device, 8, 64), _randn(gen, device, 64), _randn(gen, device, 64)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    return Built(lambda: kernel_ladder.layer_norm(x, 64, w, b),
                 _with_backward(lambda: kernel_ladder.layer_norm(xg, 64, wg, bg)),
                 lambda: F.layer_norm(x, (64,), w, b))


def _add_rms_norm(device, gen):
    x, r, w = _randn(gen, device, 8, 64), _randn(gen, device, 8, 64), _randn(gen, device, 64)
    xg, rg, wg = (t.clone().requires_grad_(True) for t in (x, r, w))
    return Built(lambda: kernel_ladder.add_rms_norm(x, r, w),
                 _with_backward(lambda: kernel_ladder.add_rms_norm(xg, rg, wg)),
                 lambda: F.rms_norm(x + r, (64,), w, 1e-6))


def _cross_entropy(device, gen):
    logits = _randn(gen, device, 8, 64)
    target = torch.randint(0, 64, (8,), generator=gen).to(device)
    lg = logits.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.cross_entropy(logits, target),
                 _with_backward(lambda: kernel_ladder.cross_entropy(lg, target)),
                 lambda: F.cross_entropy(logits, target))


def _in_place(op: Callable, eager: Callable, *extra: int) -> Callable[[torch.device, torch.Generator], Built]:
    """A gated/norm op with ``in_place_backward=True`` (its backward writes into the incoming gradient)."""
    def make(device, gen):
        a, b = _randn(gen, device, 8, 64), _randn(gen, device, *(extra or (8, 64)))
        ag, bg = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        return Built(lambda: op(a, b, in_place_backward=True),
                     _with_backward(lambda: op(ag, bg, in_place_backward=True)), lambda: eager(a, b))
    return make


def _dropout(device, gen):
    x = _randn(gen, device, 8, 64)
    xg = x.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.dropout(x, 0.5, seed=1),
                 _with_backward(lambda: kernel_ladder.dropout(xg, 0.5, seed=1)),
                 lambda: F.dropout(x, 0.5))


def _dropout_mask(device, gen):
    return Built(lambda: kernel_ladder.dropout_mask((8, 64), 0.5, 1, device), None,
                 lambda: torch.rand(8, 64, device=device) >= 0.5)


def _matmul(device, gen):
    a, b = _randn(gen, device, 16, 32), _randn(gen, device, 32, 16)
    ag, bg = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.matmul(a, b), _with_backward(lambda: kernel_ladder.matmul(ag, bg)),
                 lambda: a @ b)


def _linear(device, gen):
    x, w, b = _randn(gen, device, 16, 32), _randn(gen, device, 16, 32), _randn(gen, device, 16)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    return Built(lambda: kernel_ladder.linear(x, w, b), _with_backward(lambda: kernel_ladder.linear(xg, wg, bg)),
                 lambda: F.linear(x, w, b))


def _quantize_weight(device, gen):
    w = _randn(gen, device, 16, 64)
    return Built(lambda: kernel_ladder.quantize_weight(w, "int8"), None, lambda: w.abs().amax(1))


def _quantize_weight_int4(device, gen):
    w = _randn(gen, device, 16, 64)
    return Built(lambda: kernel_ladder.quantize_weight(w, "int4", group_size=32), None, lambda: w.abs().amax(1))


def _quantize_activations(device, gen):
    x = _randn(gen, device, 8, 64)
    return Built(lambda: kernel_ladder.quantize_activations(x), None, lambda: x.abs().amax(1))


def _quantized_linear(device, gen):
    x, w = _randn(gen, device, 8, 64), _randn(gen, device, 16, 64)
    qw = kernel_ladder.quantize_weight(w, "int8")
    xg = x.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.quantized_linear(x, qw),
                 _with_backward(lambda: kernel_ladder.quantized_linear(xg, qw)),
                 lambda: F.linear(x, w))


def _rope(device, gen):
    q, k = _randn(gen, device, 1, 2, 8, 16), _randn(gen, device, 1, 2, 8, 16)
    cos, sin = kernel_ladder.rope_cos_sin(torch.arange(8, device=device), 16)
    qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.rope(q, k, cos, sin),
                 _with_backward(lambda: kernel_ladder.rope(qg, kg, cos, sin)),
                 lambda: (q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin))


def _gated_mlp(device, gen):
    x, wg, wu, wd = (_randn(gen, device, *s) for s in ((8, 32), (16, 32), (16, 32), (32, 16)))
    grads = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    return Built(lambda: kernel_ladder.gated_mlp(x, wg, wu, wd),
                 _with_backward(lambda: kernel_ladder.gated_mlp(*grads)),
                 lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd))


def _grouped_matmul(device, gen):
    x, w = _randn(gen, device, 16, 32), _randn(gen, device, 2, 32, 16)
    offsets = torch.tensor([8, 16], dtype=torch.int32, device=device)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.grouped_matmul(x, w, offsets),
                 _with_backward(lambda: kernel_ladder.grouped_matmul(xg, wg, offsets)),
                 lambda: torch.cat([x[:8] @ w[0], x[8:] @ w[1]]))


def _fused_linear_cross_entropy(device, gen):
    x, w = _randn(gen, device, 8, 32), _randn(gen, device, 64, 32)
    target = torch.randint(0, 64, (8,), generator=gen).to(device)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.fused_linear_cross_entropy(x, w, target),
                 _with_backward(lambda: kernel_ladder.fused_linear_cross_entropy(xg, wg, target)),
                 lambda: F.cross_entropy(F.linear(x, w), target))


def _fused_linear_cross_entropy_none(device, gen):
    x, w = _randn(gen, device, 8, 32), _randn(gen, device, 64, 32)
    target = torch.randint(0, 64, (8,), generator=gen).to(device)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.fused_linear_cross_entropy(x, w, target, reduction="none"),
                 _with_backward(lambda: kernel_ladder.fused_linear_cross_entropy(xg, wg, target, reduction="none")),
                 lambda: F.cross_entropy(F.linear(x, w), target, reduction="none"))


def _attention_inputs(device, gen):
    return tuple(_randn(gen, device, 1, 2, 16, 16) for _ in range(3))


def _flash_attention(device, gen):
    q, k, v = _attention_inputs(device, gen)
    grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
    return Built(lambda: kernel_ladder.flash_attention(q, k, v, causal=True),
                 _with_backward(lambda: kernel_ladder.flash_attention(*grads, causal=True)),
                 lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))


def _flash_attention_varlen(device, gen):
    q, k, v = (_randn(gen, device, 16, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=device)
    grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
    return Built(lambda: kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, 9, 9),
                 _with_backward(lambda: kernel_ladder.flash_attention_varlen(*grads, cu, cu, 9, 9)),
                 lambda: F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)))


def _block_sparse_attention(device, gen):
    q, k, v = _attention_inputs(device, gen)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    grads = [t.clone().requires_grad_(True) for t in (q, k, v)]
    return Built(lambda: kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=16),
                 _with_backward(lambda: kernel_ladder.block_sparse_attention(*grads, mask, block_size=16)),
                 lambda: F.scaled_dot_product_attention(q, k, v))


def _paged_attention(device, gen):
    q = _randn(gen, device, 2, 2, 16)
    k_cache, v_cache = _randn(gen, device, 4, 8, 2, 16), _randn(gen, device, 4, 8, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([9, 16], dtype=torch.int32, device=device)
    return Built(lambda: kernel_ladder.paged_attention(q, k_cache, v_cache, tables, seq_lens), None,
                 lambda: F.scaled_dot_product_attention(q[:, :, None], k_cache[:2].flatten(0, 1).transpose(0, 1)[None],
                                                        v_cache[:2].flatten(0, 1).transpose(0, 1)[None]))


def _mla_attention(device, gen):
    q_latent, q_rope = _randn(gen, device, 2, 4, 32), _randn(gen, device, 2, 4, 16)
    cache = _randn(gen, device, 4, 8, 48)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([9, 16], dtype=torch.int32, device=device)
    return Built(lambda: kernel_ladder.mla_attention(q_latent, q_rope, cache, tables, seq_lens, 0.2, 32), None, None)


def _write_latent_cache(device, gen):
    c_kv, k_rope = _randn(gen, device, 4, 32), _randn(gen, device, 4, 16)
    cache = torch.zeros(4, 8, 48, device=device)
    slots = torch.tensor([0, 3, 9, 20], dtype=torch.int64, device=device)
    flat = cache.view(-1, 48)
    return Built(lambda: kernel_ladder.write_latent_cache(c_kv, k_rope, cache, slots), None,
                 lambda: flat.index_copy_(0, slots, torch.cat([c_kv, k_rope], 1)))


def _write_kv_cache(device, gen):
    k, v = _randn(gen, device, 4, 2, 16), _randn(gen, device, 4, 2, 16)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16, device=device), torch.zeros(4, 8, 2, 16, device=device)
    slots = torch.tensor([0, 3, 9, 20], dtype=torch.int64, device=device)
    flat_k = k_cache.view(-1, 2, 16)
    return Built(lambda: kernel_ladder.write_kv_cache(k, v, k_cache, v_cache, slots), None,
                 lambda: flat_k.index_copy_(0, slots, k))


def _topk_routing(device, gen):
    logits = _randn(gen, device, 8, 8)
    lg = logits.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.topk_routing(logits, 2),
                 _with_backward(lambda: kernel_ladder.topk_routing(lg, 2)),
                 lambda: torch.topk(torch.softmax(logits, -1), 2))


def _routing(device, gen, tokens=8, experts=4, top_k=2):
    logits = _randn(gen, device, tokens, experts)
    weights, ids = kernel_ladder.topk_routing(logits, top_k)
    return logits, weights, ids


def _moe_permute(device, gen):
    _, _, ids = _routing(device, gen)
    return Built(lambda: kernel_ladder.moe_permute(ids, 4), None, lambda: torch.sort(ids.flatten(), stable=True))


def _moe_gather(device, gen):
    _, _, ids = _routing(device, gen)
    perm, _ = kernel_ladder.moe_permute(ids, 4)
    x = _randn(gen, device, 8, 32)
    xg = x.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.moe_gather(x, perm, 2),
                 _with_backward(lambda: kernel_ladder.moe_gather(xg, perm, 2)),
                 lambda: x.index_select(0, perm.long() // 2))


def _moe_combine(device, gen):
    _, weights, ids = _routing(device, gen)
    perm, _ = kernel_ladder.moe_permute(ids, 4)
    y = _randn(gen, device, 16, 32)
    yg, wg = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.moe_combine(y, perm, weights),
                 _with_backward(lambda: kernel_ladder.moe_combine(yg, perm, wg)),
                 lambda: (y.view(8, 2, 32) * weights[..., None]).sum(1))


def _moe(device, gen):
    x, logits = _randn(gen, device, 8, 32), _randn(gen, device, 8, 4)
    w_gate_up, w_down = _randn(gen, device, 4, 32, 32), _randn(gen, device, 4, 32, 16)
    grads = [t.clone().requires_grad_(True) for t in (x, logits, w_gate_up, w_down)]
    return Built(lambda: kernel_ladder.moe(x, logits, w_gate_up, w_down, 2),
                 _with_backward(lambda: kernel_ladder.moe(*grads, 2)), None)


def _load_balancing_loss(device, gen):
    logits, _, ids = _routing(device, gen)
    lg = logits.clone().requires_grad_(True)
    return Built(lambda: kernel_ladder.moe_load_balancing_loss(logits, ids, 4),
                 _with_backward(lambda: kernel_ladder.moe_load_balancing_loss(lg, ids, 4)),
                 lambda: torch.softmax(logits, -1).mean(0).sum())


def op_cases() -> list[OpCase]:
    """Every public op of :mod:`kernel_ladder` that runs a kernel, with a tiny call each."""
    return [
        OpCase("add", ("add",), (), _binary(kernel_ladder.add, torch.add)),
        OpCase("gelu", ("gelu",), ("gelu_backward",), _unary(kernel_ladder.gelu, F.gelu)),
        OpCase("silu", ("silu",), ("silu_backward",), _unary(kernel_ladder.silu, F.silu)),
        OpCase("swiglu", ("swiglu",), ("swiglu_backward",), _binary(kernel_ladder.swiglu, lambda g, u: F.silu(g) * u)),
        OpCase("geglu", ("geglu",), ("geglu_backward",),
               _binary(kernel_ladder.geglu, lambda g, u: F.gelu(g, approximate="tanh") * u)),
        OpCase("swiglu[in_place_backward]", ("swiglu",), ("swiglu_backward_inplace",),
               _in_place(kernel_ladder.swiglu, lambda g, u: F.silu(g) * u)),
        OpCase("geglu[in_place_backward]", ("geglu",), ("geglu_backward_inplace",),
               _in_place(kernel_ladder.geglu, lambda g, u: F.gelu(g, approximate="tanh") * u)),
        OpCase("dropout", ("dropout",), (), _dropout),
        OpCase("dropout_mask", ("dropout_mask",), (), _dropout_mask),
        OpCase("softmax", ("softmax",), ("softmax_backward",),
               _rows(kernel_ladder.softmax, lambda x: torch.softmax(x, -1))),
        OpCase("log_softmax", ("log_softmax",), ("log_softmax_backward",),
               _rows(kernel_ladder.log_softmax, lambda x: torch.log_softmax(x, -1))),
        OpCase("rms_norm", ("rms_norm",), ("rms_norm_backward",), _rms_norm),
        OpCase("rms_norm[in_place_backward]", ("rms_norm",), ("rms_norm_backward_inplace",),
               _in_place(kernel_ladder.rms_norm, lambda x, w: F.rms_norm(x, (64,), w, 1e-6), 64)),
        OpCase("layer_norm", ("layer_norm",), ("layer_norm_backward",), _layer_norm),
        OpCase("add_rms_norm", ("add_rms_norm",), ("add_rms_norm_backward",), _add_rms_norm),
        OpCase("cross_entropy", ("cross_entropy",), ("cross_entropy_backward",), _cross_entropy),
        OpCase("matmul", ("matmul",), ("matmul_backward",), _matmul),
        OpCase("linear", ("linear",), ("linear_backward",), _linear),
        OpCase("quantize_weight", ("quantize_rows",), (), _quantize_weight),
        OpCase("quantize_weight_int4", ("quantize_int4",), (), _quantize_weight_int4),
        OpCase("quantize_activations", ("quantize_rows",), (), _quantize_activations),
        OpCase("quantized_linear", ("quantized_linear",), ("quantized_linear_backward",), _quantized_linear),
        OpCase("rope", ("rope",), ("rope_backward",), _rope),
        OpCase("gated_mlp", ("gated_mlp",), ("gated_mlp_backward",), _gated_mlp),
        OpCase("grouped_matmul", ("grouped_matmul",), ("grouped_matmul_backward",), _grouped_matmul),
        OpCase("fused_linear_cross_entropy", ("fused_linear_cross_entropy",), ("cross_entropy_backward",),
               _fused_linear_cross_entropy),
        OpCase("fused_linear_cross_entropy[none]", ("fused_linear_cross_entropy",),
               ("fused_linear_cross_entropy_backward",), _fused_linear_cross_entropy_none),
        OpCase("flash_attention", ("flash_attention",), ("flash_attention_backward",), _flash_attention),
        OpCase("flash_attention_varlen", ("flash_attention_varlen",), ("flash_attention_varlen_backward",),
               _flash_attention_varlen),
        OpCase("block_sparse_attention", ("block_sparse_attention",), ("block_sparse_attention_backward",),
               _block_sparse_attention),
        OpCase("paged_attention", ("paged_attention",), (), _paged_attention),
        OpCase("write_kv_cache", ("write_kv_cache",), (), _write_kv_cache),
        OpCase("mla_attention", ("mla_attention",), (), _mla_attention),
        OpCase("write_latent_cache", ("write_latent_cache",), (), _write_latent_cache),
        OpCase("topk_routing", ("topk_routing",), ("topk_routing_backward",), _topk_routing),
        OpCase("moe_permute", ("moe_permute",), (), _moe_permute),
        OpCase("moe_gather", ("moe_gather",), ("moe_combine",), _moe_gather),
        OpCase("moe_combine", ("moe_combine",), ("moe_combine_backward", "moe_gather"), _moe_combine),
        OpCase("moe", ("topk_routing", "moe_permute", "moe_gate_up", "grouped_matmul", "moe_combine"),
               ("moe_gate_up_backward", "grouped_matmul_backward", "moe_combine_backward", "moe_gather",
                "topk_routing_backward"), _moe),
        OpCase("moe_load_balancing_loss", ("softmax",), ("softmax_backward",), _load_balancing_loss),
    ]
