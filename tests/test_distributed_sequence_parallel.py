"""Sequence parallelism (sequence_parallel=True on the tensor-parallel linears): the same outputs and
gradients as one process, with fewer activation bytes saved per rank than tensor parallelism alone."""

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


def _reference(seed: int):
    x, dout, norm_w, up, down = W.sp_inputs(seed)
    x, w = x.double().requires_grad_(True), norm_w.double().requires_grad_(True)
    up, down = up.double(), down.double()
    out = x + down(F.gelu(up(F.rms_norm(x, (x.shape[1],), w, 1e-6))))
    out.backward(dout.double())
    return out.detach(), x.grad, w.grad


def test_sequence_parallel_block_equals_one_process(world):
    out, dx, dw = _reference(3)
    results = world.run(W.sequence_parallel_block, 3, True)
    torch.testing.assert_close(torch.cat([res["out"] for res in results]).double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([res["dx"] for res in results]).double(), dx, rtol=1e-4, atol=1e-5)
    for res in results:
        torch.testing.assert_close(res["dw"].double(), dw, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_alone_is_the_same_block_on_every_rank(world):
    out, dx, dw = _reference(3)
    for res in world.run(W.sequence_parallel_block, 3, False):
        torch.testing.assert_close(res["out"].double(), out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["dx"].double(), dx, rtol=1e-4, atol=1e-5)


def test_sequence_parallel_saves_fewer_activation_bytes(world):
    sp = world.run(W.sequence_parallel_block, 3, True)[0]["saved_bytes"]
    tp = world.run(W.sequence_parallel_block, 3, False)[0]["saved_bytes"]
    assert sp < tp, (sp, tp)
