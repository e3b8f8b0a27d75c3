"""Pipeline parallelism (kernel_ladder.distributed.Pipeline): GPipe and 1F1B on gloo worlds against one
process and against torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B; the schedules'
orders, their memory, and the bubble against (p - 1)/(m + p - 1)."""

from __future__ import annotations

import pytest
import torch

from kernel_ladder.distributed import bubble_fraction, logical_timeline, schedule_order
from tests import distributed_workers as W
from utils.distributed import World

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p{p}")
def world(request):
    with World(request.param, timeout=60) as w:
        yield w


def _single_process(seed: int, p: int, m: int):
    model = W.pipeline_model(seed, p).double()
    x, y = W.pipeline_batch(seed)
    total = sum(torch.nn.functional.mse_loss(model(xc.double()), yc.double()) for xc, yc in zip(x.chunk(m), y.chunk(m)))
    (total / m).backward()
    stages = [model[4 * r:4 * (r + 1)] for r in range(p)]
    return total.detach() / m, [{n: q.grad for n, q in s.named_parameters()} for s in stages]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4])
def test_pipeline_equals_one_process_and_torch_pipelining(world, schedule, m):
    p, seed = world.size, 6
    loss, grads = _single_process(seed, p, m)
    results = world.run(W.pipeline_run, seed, schedule, m)
    torch.testing.assert_close(results[-1]["loss"].double(), loss, rtol=1e-5, atol=1e-6)
    compared = results[-1]["their_loss"] is not None  # torch's 1F1B needs m >= p
    assert compared or (schedule == "1f1b" and m < p)
    if compared:
        torch.testing.assert_close(results[-1]["loss"], results[-1]["their_loss"], rtol=1e-5, atol=1e-6)
    for r, res in enumerate(results):
        assert res["order"] == schedule_order(schedule, r, p, m)
        for name, g in res["ours"].items():
            torch.testing.assert_close(g.double(), grads[r][name], rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
            if compared:
                torch.testing.assert_close(g, res["theirs"][name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {r} {name} vs torch")


def test_1f1b_keeps_fewer_microbatches_in_flight(world):
    p, m = world.size, 8
    gpipe = world.run(W.pipeline_run, 1, "gpipe", m)
    one_f_one_b = world.run(W.pipeline_run, 1, "1f1b", m)
    assert [res["peak"] for res in gpipe] == [m] * p
    assert [res["peak"] for res in one_f_one_b] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_bubble_of_the_schedule_matches_the_formula(schedule):
    for p in (2, 4, 8):
        for m in (1, 4, 16):
            orders = [schedule_order(schedule, r, p, m) for r in range(p)]
            assert bubble_fraction(logical_timeline(orders)) == pytest.approx((p - 1) / (m + p - 1))


def test_an_order_that_cannot_run_is_refused():
    # Rank 1 wants micro-batch 1 before 0, but rank 0 is waiting for rank 1's gradient of 0 first.
    orders = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        logical_timeline(orders)
