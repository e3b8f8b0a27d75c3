"""Ring attention (kernel_ladder.distributed.ring_attention) on gloo worlds against attention over the
whole sequence in one process, in float64: outputs and every gradient, both layouts, causal or
not, GQA; the zigzag layout's balance of causal work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_ladder.distributed import causal_work, zigzag_shard, zigzag_unshard
from tests import distributed_workers as W
from utils.distributed import World

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p{p}")
def world(request):
    with World(request.param, timeout=120) as w:
        yield w


def _reference(seed: int, causal: bool, kv_heads: int):
    q, k, v, dout = (t.double() for t in W.attention_inputs(seed, kv_heads=kv_heads))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != q.shape[1])
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_equals_whole_sequence_attention(world, layout, causal):
    seed = 21
    reference = _reference(seed, causal, kv_heads=2)
    results = world.run(W.ring_attention_run, seed, causal, layout)
    for name in ("out", "dq", "dk", "dv"):
        if layout == "contiguous":
            got = torch.cat([res[name] for res in results], dim=2)
        else:
            got = zigzag_unshard([res[name] for res in results])
        torch.testing.assert_close(got.double(), reference[name], rtol=2e-4, atol=2e-4, msg=f"{name}")


def test_ring_attention_with_grouped_query_heads(world):
    reference = _reference(8, True, kv_heads=1)
    results = world.run(W.ring_attention_run, 8, True, "zigzag", 1)
    for name in ("out", "dq", "dk", "dv"):
        got = zigzag_unshard([res[name] for res in results])
        torch.testing.assert_close(got.double(), reference[name], rtol=2e-4, atol=2e-4, msg=name)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    for p in (2, 4, 8):
        zigzag = [causal_work(r, p, "zigzag") for r in range(p)]
        contiguous = [causal_work(r, p, "contiguous") for r in range(p)]
        assert len(set(zigzag)) == 1 and zigzag[0] == 2 * p  # half-chunk blocks: 2p each
        assert contiguous == [r + 0.5 for r in range(p)]  # rank p - 1 waits on nobody; rank 0 idles
        assert sum(zigzag) / 4 == pytest.approx(sum(contiguous))  # the same total work (zigzag blocks are 1/4)


def test_zigzag_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 3 * 16 * 2).reshape(2, 3, 16, 2)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, r, 4) for r in range(4)]), x)
    assert zigzag_shard(x, 0, 4)[0, 0, :, 0].tolist() == [0, 2, 28, 30]  # chunks 0 and 7 of 8
