"""utils.transformer: a decoder block built only from kernel_ladder ops, against its float64 reference;
opcheck of every op it runs; torch.compile(fullgraph=True, dynamic=True) without graph breaks."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DEVICE
from utils.trace import OpLog, trace
from utils.transformer import (
    BlockConfig,
    DecoderBlock,
    TinyDecoder,
    block_training_step,
    reference_block,
    reference_decoder,
    rotary_tables,
)

#: The ops the block and its loss head are made of (their backwards run in the backward pass).
BLOCK_OPS = {"rms_norm", "linear", "rope", "flash_attention", "add", "gated_mlp", "fused_linear_cross_entropy"}

# fp32 against float64 through a dozen ops: a few fp32 roundings each (TF32 on a GPU needs more).
RTOL, ATOL = (1e-4, 1e-5) if DEVICE.type == "cpu" else (2e-2, 2e-3)


def _model(gen, config: BlockConfig = BlockConfig(n_kv_heads=1)) -> TinyDecoder:
    return TinyDecoder(config, gen, device=DEVICE)


def _batch(gen, config: BlockConfig, batch: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab, (batch, seq), generator=gen).to(DEVICE)
    targets = torch.randint(0, config.vocab, (batch, seq), generator=gen)
    targets[0, :3] = -100  # some ignored positions: the mean is over the others
    return tokens, targets.to(DEVICE)


def _params64(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["mha", "gqa"])
def test_block_matches_float64_reference_forward_and_backward(n_kv_heads, gen):
    config = BlockConfig(n_kv_heads=n_kv_heads)
    block = DecoderBlock(config, gen, device=DEVICE)
    x = torch.randn(2, 12, config.hidden, generator=gen).to(DEVICE).requires_grad_()
    cos, sin = rotary_tables(12, config.head_dim, device=DEVICE)
    out = block(x, cos, sin)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    out.backward(grad_out)

    params = _params64(block)
    x64 = x.detach().double().requires_grad_()
    want = reference_block(params, config, x64)
    want.backward(grad_out.double())
    _assert_close(out, want, "block output")
    _assert_close(x.grad, x64.grad, "grad of x")
    for name, p in block.named_parameters():
        _assert_close(p.grad, params[name].grad, f"grad of {name}")


def test_training_step_matches_float64_reference(gen):
    model = _model(gen)
    tokens, targets = _batch(gen, model.config)
    loss = block_training_step(model, tokens, targets)
    params = _params64(model)
    want = reference_decoder(params, model.config, tokens, targets)
    want.backward()
    _assert_close(loss, want, "loss")
    for name, p in model.named_parameters():
        _assert_close(p.grad, params[name].grad, f"grad of {name}")


def test_training_step_applies_the_optimizer(gen):
    model = _model(gen)
    tokens, targets = _batch(gen, model.config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    block_training_step(model, tokens, targets, optimizer)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] - 0.1 * p.grad, msg=name)


def test_reference_rejects_a_wrong_block(gen):
    """Negative control: the comparison catches a block that rotates the wrong way (sin negated).

    (Tables shifted by a position would not do: attention after RoPE sees relative positions only.)"""
    config = BlockConfig()
    block = DecoderBlock(config, gen, device=DEVICE)
    x = torch.randn(1, 8, config.hidden, generator=gen).to(DEVICE)
    cos, sin = rotary_tables(8, config.head_dim, device=DEVICE)
    with torch.no_grad():
        out = block(x, cos, -sin)
    want = reference_block(_params64(block), config, x.double())
    with pytest.raises(AssertionError, match="block output"):
        _assert_close(out, want.detach(), "block output")


def _clone_args(args, requires_grad: bool):
    def one(a):
        if not isinstance(a, torch.Tensor):
            return a
        c = a.detach().clone()
        return c.requires_grad_() if requires_grad and c.is_floating_point() and a.requires_grad else c

    return tuple(one(a) for a in args)


def test_opcheck_every_op_of_the_block(gen):
    model = _model(gen)
    tokens, targets = _batch(gen, model.config, batch=1, seq=8)
    recorder = OpLog(keep_calls="kernel_ladder")  # every kernel_ladder:: call, forwards and the backwards they launch
    loss = model.loss(tokens, targets)
    with recorder:
        loss = model.loss(tokens, targets)
        loss.backward()
    names = {func.__name__.split(".")[0] for func, _, _ in recorder.calls}
    assert BLOCK_OPS <= names, f"the block ran {sorted(names)}"
    seen = set()
    for func, args, kwargs in recorder.calls:
        if func in seen:  # one opcheck per op: each runs the op a dozen times in the interpreter
            continue
        seen.add(func)
        is_backward = func.__name__.split(".")[0].endswith("_backward")
        torch.library.opcheck(func, _clone_args(args, requires_grad=not is_backward), kwargs)


def test_compiled_block_has_no_graph_breaks_and_matches_eager(gen):
    model = _model(gen)
    tokens, targets = _batch(gen, model.config)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.loss)(tokens, targets)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    torch._dynamo.reset()
    compiled = torch.compile(model.loss, fullgraph=True, dynamic=True, backend="aot_eager")
    loss = compiled(tokens, targets)
    loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    want = model.loss(tokens, targets)
    want.backward()
    # The same aten ops around the same kernels: bit for bit.
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0, msg=name)

    # dynamic=True: another batch size and sequence length reuse the graph instead of recompiling.
    tokens2, targets2 = _batch(gen, model.config, batch=3, seq=8)  # sizes 0 and 1 are specialized
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss2 = compiled(tokens2, targets2)
    torch.testing.assert_close(loss2, model.loss(tokens2, targets2).detach(), rtol=0, atol=0)


def test_block_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        BlockConfig(hidden=30, n_heads=4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        BlockConfig(n_heads=3, n_kv_heads=2, hidden=48)
    with pytest.raises(ValueError, match="even for RoPE"):
        BlockConfig(hidden=6, n_heads=2, n_kv_heads=1)


def test_block_uses_only_kernels_ops_for_its_math(gen):
    """The block's compute is kernel_ladder ops: the only aten ops around them are views, copies and tables."""
    config = BlockConfig()
    block = DecoderBlock(config, gen, device=DEVICE)
    x = torch.randn(1, 8, config.hidden, generator=gen).to(DEVICE)
    cos, sin = rotary_tables(8, config.head_dim, device=DEVICE)
    with torch.no_grad(), trace() as t:
        block(x, cos, sin)
    outside = {op.name for op in t.torch_ops if not op.inside and op.launches}
    assert outside <= {"aten.clone.default", "aten._unsafe_view.default", "aten.copy_.default"}, outside
    assert not [op.name for op in t.torch_ops if "mm" in op.name or "softmax" in op.name]
