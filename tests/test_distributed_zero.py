"""ZeRO stages 1, 2 (kernel_ladder.distributed.ZeroOptimizer) and 3 (shard_module) on gloo worlds: the
parameters after several Adam steps equal one process's and torch's ZeroRedundancyOptimizer's;
the bytes each rank holds shrink as the stages promise."""

from __future__ import annotations

import pytest
import torch

from tests import distributed_workers as W
from utils.distributed import World

pytestmark = pytest.mark.timeout(300)
STEPS = 3


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"p{p}")
def world(request):
    with World(request.param, timeout=60) as w:
        yield w


def _single_process(seed: int, p: int) -> dict:
    model = W.zero_model(seed).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x.double()), y.double())
                   for x, y in (W.zero_batch(seed, r, step) for r in range(p))) / p
        loss.backward()
        opt.step()
    return {n: q.detach() for n, q in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_one_process_and_zero_redundancy_optimizer(world, stage):
    seed = 12
    reference = _single_process(seed, world.size)
    for res in world.run(W.zero_run, seed, stage, STEPS):
        assert set(res["ours"]) == set(reference)
        for name, want in reference.items():
            torch.testing.assert_close(res["ours"][name].double(), want, rtol=1e-4, atol=1e-5, msg=name)
            torch.testing.assert_close(res["ours"][name], res["theirs"][name], rtol=1e-4, atol=1e-5, msg=name)


def test_each_stage_holds_less(world):
    p = world.size
    numel = sum(q.numel() for q in W.zero_model(0).parameters())
    full = numel * 4
    shard = -(-numel // p) * 4  # the padded shard, fp32
    memory = {stage: world.run(W.zero_run, 12, stage, 1)[0]["memory"] for stage in (1, 2, 3)}
    assert memory[1] == {"parameters": full, "gradients": full, "optimizer_state": 2 * shard + 4,  # Adam: m, v, step
                         "gradients_peak": full}
    assert {k: v for k, v in memory[2].items() if k != "gradients_peak"} == {
        "parameters": full, "gradients": 0, "optimizer_state": 2 * shard + 4}
    assert memory[2]["gradients_peak"] >= full  # one bucket: the whole padded gradient is in it at once
    assert memory[3]["parameters"] < full and memory[3]["gradients"] == memory[3]["parameters"]
    assert memory[3]["parameters"] <= full / p + 4 * 3 * p  # each layer's shard, padded


def test_stage_3_equals_fsdp2_fully_shard(world):
    ours = world.run(W.zero_run, 12, 3, STEPS)
    theirs = world.run(W.fsdp2_run, 12, STEPS)
    for mine, fsdp in zip(ours, theirs):
        for name, want in fsdp.items():
            torch.testing.assert_close(mine["ours"][name], want, rtol=1e-4, atol=1e-5, msg=name)


def _deep_single_process(seed: int, p: int, steps: int, micro_batches: int) -> dict:
    model = W.deep_model(seed).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            loss = sum(torch.nn.functional.mse_loss(model(x.double()), y.double())
                       for x, y in (W.deep_batch(seed, r, step, micro) for r in range(p))) / p
            loss.backward()
        opt.step()
    return {n: q.detach() for n, q in model.named_parameters()}


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-backward", "accumulate-2"])
def test_zero2_reduce_scatters_bucket_by_bucket_during_the_backward(world, micro_batches):
    seed, steps = 5, 2
    cap = 16 * 16 * 4 + 16 * 4  # one layer's weight and bias per bucket
    reference = _deep_single_process(seed, world.size, steps, micro_batches)
    for res in world.run(W.zero2_bucketed_run, seed, steps, cap, micro_batches):
        for name, want in reference.items():
            torch.testing.assert_close(res["params"][name].double(), want, rtol=1e-4, atol=1e-5, msg=name)
        assert res["param_grads_left"] == [0] * (steps * micro_batches)  # every full gradient freed in the backward
        timeline = res["timeline"]
        assert len(timeline) == 16
        total = 32  # gradients per backward
        assert timeline[0]["launched_after"] == 2 < total  # the last layer's bucket left while autograd went on
        assert [t["launched_after"] for t in timeline] == list(range(2, total + 1, 2))
        full = res["full_gradient_bytes"]
        assert res["memory"]["gradients"] == 0
        # the peak: this rank's shard plus at most three buckets (two in flight, one filling) — less than full
        shard = res["memory"]["optimizer_state"] // 2
        assert res["memory"]["gradients_peak"] <= shard + 3 * (cap + cap // world.size + 8) + cap
        assert res["memory"]["gradients_peak"] < full
