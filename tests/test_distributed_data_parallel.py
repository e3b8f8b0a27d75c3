"""kernel_ladder.distributed.DataParallel on gloo worlds against torch's DistributedDataParallel on the
same model and data, and against one process doing the whole batch; its buckets and their overlap."""

from __future__ import annotations

import pytest
import torch

from kernel_ladder.distributed import plan_buckets
from tests import distributed_workers as W
from utils.distributed import World

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"p{p}")
def world(request):
    with World(request.param, timeout=60) as w:
        yield w


def _single_process_grads(init: dict, seed: int, p: int, micro_batches: int = 1) -> dict:
    """The gradient of the mean over ranks of each rank's loss, in one process, in float64."""
    model = W._mlp(seed).double()
    model.load_state_dict({k: v.double() for k, v in init.items()})
    for k in range(micro_batches):
        for r in range(p):
            (model(W._batch(seed + 17 * k, r).double()).pow(2).mean() / p).backward()
    return {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.parametrize("cap", [25, 1e-4], ids=["one bucket", "a bucket per parameter"])
def test_gradients_equal_torch_ddp_and_the_single_process_average(world, cap):
    results = world.run(W.data_parallel_vs_ddp, 3, cap)
    reference = _single_process_grads(results[0]["init"], 3, world.size)
    for res in results:
        for name, grad in res["ours"].items():
            torch.testing.assert_close(grad, res["theirs"][name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad.double(), reference[name], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(res["init"][k], results[0]["init"][k]) for res in results for k in res["init"]), \
        "every rank must start from rank 0's parameters"


def test_accumulating_under_no_sync_equals_ddp(world):
    results = world.run(W.data_parallel_vs_ddp, 5, 25, 3)
    reference = _single_process_grads(results[0]["init"], 5, world.size, micro_batches=3)
    for res in results:
        for name, grad in res["ours"].items():
            torch.testing.assert_close(grad, res["theirs"][name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad.double(), reference[name], rtol=1e-5, atol=1e-6)


def test_small_buckets_are_launched_while_the_backward_runs(world):
    results = world.run(W.data_parallel_vs_ddp, 3, 1e-4)
    timeline, n_params = results[0]["timeline"], results[0]["n_params"]
    assert len(timeline) == n_params  # each parameter exceeds 104 bytes: a bucket each
    assert timeline[0]["params"] == ["4.bias"]  # the last registered parameter first
    # The first bucket went out before the backward had produced every gradient: overlap.
    assert timeline[0]["launched_after"] < n_params
    assert sorted(b["launched_after"] for b in timeline) == [b["launched_after"] for b in timeline]


def test_one_large_bucket_waits_for_every_gradient(world):
    timeline = world.run(W.data_parallel_vs_ddp, 3, 25)[0]["timeline"]
    assert len(timeline) == 1 and timeline[0]["launched_after"] == len(timeline[0]["params"])


def test_an_unused_parameter_is_named(world):
    messages = world.run(W.data_parallel_unused_param)
    assert all("no gradient reached ['spare.bias', 'spare.weight']" in m for m in messages), messages


def test_plan_buckets_reverses_caps_and_splits_dtypes():
    a, b = torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(10))
    c = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    d = torch.nn.Parameter(torch.zeros(100))
    named = [("a", a), ("b", b), ("c", c), ("d", d)]
    names = [[n for n, _ in bucket] for bucket in plan_buckets(named, cap_bytes=100)]
    assert names == [["d"], ["c"], ["b", "a"]]  # d alone (over the cap), c alone (its dtype), b + a = 80 bytes
    assert [[n for n, _ in bucket] for bucket in plan_buckets(named, cap_bytes=10**6)] == [["d"], ["c"], ["b", "a"]]
