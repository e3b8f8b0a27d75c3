"""Tensor parallelism (kernel_ladder.distributed.tensor_parallel) on gloo worlds: the same outputs and
shard gradients as one process and as DTensor's parallelize_module; the vocabulary split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import distributed_workers as W
from utils.distributed import World

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p{p}")
def world(request):
    with World(request.param, timeout=60) as w:
        yield w


def _single_process_mlp(seed: int):
    model = W._tp_mlp(seed).double()
    x = W.tp_batch(seed).double().requires_grad_(True)
    out = model(x)
    out.pow(2).mean().backward()
    return model, x, out


def test_column_then_row_parallel_mlp_equals_one_process_and_dtensor(world):
    p, seed = world.size, 11
    model, x, out = _single_process_mlp(seed)
    rows = 16 // p
    for r, res in enumerate(world.run(W.tensor_parallel_mlp, seed)):
        ours, theirs = res["ours"], res["theirs"]
        shard = slice(r * rows, (r + 1) * rows)
        expected = {"out": out.detach(), "x_grad": x.grad, "up.weight": model[0].weight.grad[shard],
                    "up.bias": model[0].bias.grad[shard], "down.weight": model[2].weight.grad[:, shard],
                    "down.bias": model[2].bias.grad}
        for name, want in expected.items():
            torch.testing.assert_close(ours[name].double(), want, rtol=1e-4, atol=1e-5, msg=f"rank {r} {name}")
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5,
                                       msg=f"rank {r} {name} vs DTensor")


def test_vocab_parallel_embedding_and_loss_equal_one_process(world):
    p, seed, vocab, dim = world.size, 4, 12, 6
    torch.manual_seed(seed)
    embed, head = torch.nn.Embedding(vocab, dim).double(), torch.nn.Linear(dim, vocab, bias=False).double()
    gen = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, vocab, (7,), generator=gen)
    target = torch.randint(0, vocab, (7,), generator=gen)
    target[2] = -100
    loss = F.cross_entropy(head(embed(ids)), target, ignore_index=-100)
    loss.backward()
    shard = vocab // p
    for r, res in enumerate(world.run(W.vocab_parallel, seed, vocab, dim)):
        assert res["local_logits_shape"] == (7, shard), "the (N, V) logits must never be gathered"
        rows = slice(r * shard, (r + 1) * shard)
        torch.testing.assert_close(res["loss"].double(), loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["embed_grad"].double(), embed.weight.grad[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["head_grad"].double(), head.weight.grad[rows], rtol=1e-5, atol=1e-6)


def test_a_split_that_does_not_divide_is_refused_naming_the_layer():
    from kernel_ladder.distributed import shard_range

    assert shard_range(12, 1, 3) == range(4, 8)
    with pytest.raises(ValueError, match=r"kernel_ladder.distributed.ColumnParallelLinear: out_features \(10\) must be "
                                         r"divisible by the tensor-parallel world size \(4\)"):
        shard_range(10, 0, 4, "kernel_ladder.distributed.ColumnParallelLinear", "out_features")


def test_tensor_times_data_parallel_on_a_world_of_four():
    """TP within pairs of ranks, DP across the pairs: every shard gets the gradient of the mean loss
    over both replicas' batches."""
    seed, tp = 11, 2
    model = W._tp_mlp(seed).double()
    loss = sum(model(W.tp_batch(seed + d).double()).pow(2).mean() for d in range(2)) / 2
    loss.backward()
    rows = 16 // tp
    with World(4, timeout=60) as world:
        results = world.run(W.two_d_parallel, seed, tp)
    for res in results:
        shard = slice(res["tp_rank"] * rows, (res["tp_rank"] + 1) * rows)
        torch.testing.assert_close(res["up.weight"].double(), model[0].weight.grad[shard], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["down.weight"].double(), model[2].weight.grad[:, shard], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["down.bias"].double(), model[2].bias.grad, rtol=1e-4, atol=1e-5)


def test_head_parallel_attention_equals_one_process(world):
    seed, heads, dim = 5, 4, 16
    torch.manual_seed(seed)
    wq, wk, wv, wo = (torch.nn.Linear(dim, dim).double() for _ in range(4))
    x = torch.randn(2, 6, dim, generator=torch.Generator().manual_seed(seed + 1)).double().requires_grad_(True)

    def split(t):
        return t.view(2, 6, heads, dim // heads).transpose(1, 2)

    attn = F.scaled_dot_product_attention(split(wq(x)), split(wk(x)), split(wv(x)), is_causal=True)
    out = wo(attn.transpose(1, 2).reshape(2, 6, dim))
    out.pow(2).mean().backward()
    cols = dim // world.size
    for r, res in enumerate(world.run(W.head_parallel_attention, seed, heads, dim)):
        torch.testing.assert_close(res["out"].double(), out.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["x_grad"].double(), x.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["wo_grad"].double(), wo.weight.grad[:, r * cols:(r + 1) * cols],
                                   rtol=1e-4, atol=1e-5)
