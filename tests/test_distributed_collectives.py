"""kernel_ladder.distributed.collectives on real gloo worlds of 2, 3 and 4 processes, against torch's own
collectives and a float64 reference; the bytes each rank sends against the α–β model; and the
harness (utils.distributed.World) ending a failure or a deadlock with an error, not a hang."""

from __future__ import annotations

import math
import time

import pytest
import torch

from kernel_ladder.distributed import collectives as C
from tests import distributed_workers as W
from utils.distributed import World, WorldError, run_world

SIZES = (1, 5, 7, 12, 1023)  # 1 < p and n % p != 0 included
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"p{p}")
def world(request):
    with World(request.param, timeout=60) as w:
        yield w


def _reference(seed: int, p: int, n: int) -> torch.Tensor:
    return sum(W.rank_input(seed, r, n, torch.float64) for r in range(p))


def _abs_sum(seed: int, p: int, n: int) -> torch.Tensor:
    return sum(W.rank_input(seed, r, n, torch.float64).abs() for r in range(p))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def test_chunk_bounds_cover_any_length_in_order():
    for n in (0, 1, 5, 12, 13):
        for p in (1, 2, 3, 5):
            bounds = C.chunk_bounds(n, p)
            assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            lengths = [b - a for a, b in bounds]
            assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_the_world_has_its_ranks(world):
    assert world.run(W.identity) == [(r, world.size) for r in range(world.size)]


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_reduce_fp32_equals_torch_and_sends_the_ring_bytes(world, n):
    p, seed = world.size, 1000 + n
    results = world.run(W.all_reduce, seed, n, torch.float32)
    reference = _reference(seed, p, n)
    bounds = C.chunk_bounds(n, p)
    for r, res in enumerate(results):
        assert res["same_object"], "ring_all_reduce must work in place and return its tensor"
        torch.testing.assert_close(res["ours"].double(), reference, rtol=1e-5, atol=1e-5 * p)
        torch.testing.assert_close(res["ours"], res["theirs"], rtol=1e-5, atol=1e-5 * p)
        own, nxt = bounds[r], bounds[(r + 1) % p]
        expected = (2 * n - (own[1] - own[0]) - (nxt[1] - nxt[0])) * 4
        assert res["bytes"] == expected, (r, res["bytes"], expected)
        if n % p == 0:
            assert res["bytes"] == C.AlphaBeta.ring_bytes(n * 4, p, passes=2)


def _tree_sends(r: int, p: int) -> int:
    """Whole tensors rank r sends in tree_all_reduce: one up the tree (unless it is the root), and
    one to each child of the broadcast tree."""
    up = 0 if r == 0 else 1
    down = sum(1 for k in range(p.bit_length()) if r < 2**k and r + 2**k < p)
    return up + down


@pytest.mark.parametrize("name", ["star_all_reduce", "tree_all_reduce"])
@pytest.mark.parametrize("n", (1, 7, 1023))
def test_the_lower_rungs_equal_torch_and_send_what_their_model_says(world, name, n):
    p, seed = world.size, 2000 + n
    reference = _reference(seed, p, n)
    results = world.run(W.all_reduce_by, name, seed, n)
    for r, res in enumerate(results):
        assert res["same_object"]
        torch.testing.assert_close(res["ours"].double(), reference, rtol=1e-5, atol=1e-5 * p)
        torch.testing.assert_close(res["ours"], res["theirs"], rtol=1e-5, atol=1e-5 * p)
        whole = n * 4
        expected = ((p - 1) if r == 0 else 1) * whole if name == "star_all_reduce" else _tree_sends(r, p) * whole
        assert res["bytes"] == expected, (name, r, res["bytes"], expected)
    busiest = max(res["bytes"] for res in results)
    model = C.AlphaBeta(alpha=0.0, bandwidth=1.0)
    if name == "star_all_reduce":  # the model's bytes are the busiest rank's
        assert busiest == getattr(model, name)(n * 4, p)
    else:  # the tree's critical path: 2 log p whole tensors, at least the busiest rank's sends
        assert busiest <= getattr(model, name)(n * 4, p) == 2 * math.ceil(math.log2(p)) * n * 4


def test_ring_all_reduce_bf16_within_one_rounding_per_hop(world):
    p, n, seed = world.size, 1023, 77
    results = world.run(W.all_reduce, seed, n, torch.bfloat16)
    inputs = [W.rank_input(seed, r, n, torch.bfloat16).double() for r in range(p)]
    reference = sum(inputs)
    # p - 1 additions, each rounded to bf16 (8 bits: relative error <= 2**-8) of a partial sum
    # no larger than the sum of magnitudes; then copies (exact).
    bound = (p - 1) * 2.0**-8 * sum(x.abs() for x in inputs) + 1e-12
    for res in results:
        assert res["ours"].dtype == torch.bfloat16
        err = (res["ours"].double() - reference).abs()
        assert bool((err <= bound).all()), f"max error {float(err.max()):.3g} over the per-hop bound"
    assert all(torch.equal(res["ours"], results[0]["ours"]) for res in results), "ranks disagree"


def test_a_ring_without_its_all_gather_is_caught(world):
    """Negative control: the reduce-scatter alone leaves every chunk but one unfinished."""
    p, n, seed = world.size, 12, 5
    outs = world.run(W.broken_ring_all_reduce, seed, n)
    reference = _reference(seed, p, n).float()
    assert not all(torch.allclose(out, reference, rtol=1e-5, atol=1e-5) for out in outs)


@pytest.mark.parametrize("n", SIZES)
def test_ring_reduce_scatter_gives_each_rank_its_chunk_of_the_sum(world, n):
    p, seed = world.size, 2000 + n
    results = world.run(W.reduce_scatter, seed, n, torch.float32)
    reference = _reference(seed, p, n)
    for res, (start, stop) in zip(results, C.chunk_bounds(n, p)):
        assert res["unchanged"], "ring_reduce_scatter must leave its input alone"
        assert res["chunk"].shape == (stop - start,)
        torch.testing.assert_close(res["chunk"].double(), reference[start:stop], rtol=1e-5, atol=1e-5 * p)
        assert res["bytes"] == (n - (stop - start)) * 4


@pytest.mark.parametrize("shape", [(3,), (2, 5), ()], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ring_all_gather_equals_torch(world, shape, dtype):
    p = world.size
    results = world.run(W.all_gather, 31, shape, dtype)
    n = math.prod(shape)
    for res in results:
        assert torch.equal(res["ours"], res["theirs"])
        assert res["bytes"] == (p - 1) * n * _itemsize(dtype)


@pytest.mark.parametrize("src_kind", ["first", "last"])
def test_tree_broadcast_copies_src_in_log_rounds(world, src_kind):
    p, n = world.size, 9
    src = 0 if src_kind == "first" else p - 1
    results = world.run(W.broadcast, 44, n, src, torch.float32)
    expected = W.rank_input(44, src, n, torch.float32)
    for res in results:
        assert torch.equal(res["out"], expected)
    assert results[src]["messages"] == math.ceil(math.log2(p))  # the root sends every round
    assert sum(res["messages"] for res in results) == p - 1  # every other rank receives once
    model = C.AlphaBeta(alpha=1e-5, bandwidth=1e9)
    assert results[src]["bytes"] / model.bandwidth + results[src]["messages"] * model.alpha == pytest.approx(
        model.tree_broadcast(n * 4, p))


def test_all_reduce_within_subgroups():
    with World(4, timeout=60) as world:
        results = world.run(W.all_reduce_in_subgroup, 9, 10)
    for res in results:
        expected = sum(W.rank_input(9, r, 10, torch.float64) for r in res["members"]).float()
        torch.testing.assert_close(res["out"], expected, rtol=1e-5, atol=1e-5)


def test_alpha_beta_model_of_the_ring():
    model = C.AlphaBeta(alpha=2e-6, bandwidth=50e9)
    nbytes, p = 2**30, 8
    assert model.all_reduce(nbytes, p) == pytest.approx(2 * 7 * 2e-6 + 2 * 7 / 8 * nbytes / 50e9)
    assert model.reduce_scatter(nbytes, p) + model.all_gather(nbytes, p) == pytest.approx(model.all_reduce(nbytes, p))
    # Bandwidth-optimal: the bytes a rank sends approach 2n however large the ring grows.
    assert C.AlphaBeta.ring_bytes(nbytes, 1024, passes=2) < 2 * nbytes


@pytest.mark.parametrize("what, message", [
    ("noncontiguous", "kernel_ladder.distributed.ring_all_reduce: tensor must be contiguous"),
    ("list", "kernel_ladder.distributed.ring_all_reduce: tensor must be a torch.Tensor"),
    ("src", "kernel_ladder.distributed.tree_broadcast: src must be a rank of the group"),
    ("bool", "kernel_ladder.distributed.ring_all_gather: tensor must be a float or int32/int64 tensor"),
])
def test_bad_arguments_name_the_op_and_the_argument(world, what, message):
    assert all(message in text for text in world.run(W.refuses, what))


def test_without_a_process_group_the_error_says_what_to_do():
    with pytest.raises(RuntimeError, match="ring_all_reduce: no process group: call torch.distributed"):
        C.ring_all_reduce(torch.zeros(3))


# ----------------------------------------------------------------------------------------------
# The harness: failures and deadlocks end with an error
# ----------------------------------------------------------------------------------------------


def test_a_rank_that_raises_is_reported_and_the_world_restarts():
    with World(2, timeout=20) as world:
        with pytest.raises(WorldError, match=r"(?s)fails_on failed on rank\(s\) \[1\].*rank 1 raised on purpose"):
            world.run(W.fails_on, 1)
        assert world.run(W.identity) == [(0, 2), (1, 2)]  # a fresh world


def test_a_deadlock_ends_with_an_error_naming_the_stuck_ranks():
    start = time.monotonic()
    with World(2, timeout=4) as world:
        with pytest.raises(WorldError, match=r"did not answer in time|recv"):
            world.run(W.recv_that_never_comes, timeout=6)
    assert time.monotonic() - start < 40


def test_a_rank_that_never_answers_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(WorldError, match=r"rank\(s\) \[0\] did not answer in time"):
        run_world(W.waits_forever_on, 2, 0, timeout=3)
    assert time.monotonic() - start < 30


def test_functions_that_cannot_travel_are_refused():
    with pytest.raises(TypeError, match="module-level function"):
        run_world(lambda: 1, 2)
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        World(0)


def test_a_world_started_from_a_piped_script_does_not_rerun_it(tmp_path):
    """Workers never re-import __main__ (a script without a main guard, code piped into python -)."""
    import subprocess
    import sys

    code = ("from utils.distributed import run_world\n"
            "from tests import distributed_workers as W\n"
            "print('ranks', run_world(W.identity, 2, timeout=60))\n")
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env={**__import__("os").environ,
                                                 "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ranks") == 1 and "[(0, 2), (1, 2)]" in out.stdout


# ----------------------------------------------------------------------------------------------
# Empty tensors: every rank takes the same path (no message one side posts and the other skips)
# ----------------------------------------------------------------------------------------------

EMPTY_COLLECTIVES = ("star_all_reduce", "tree_all_reduce", "ring_all_reduce", "ring_reduce_scatter",
                     "ring_all_gather", "tree_broadcast", "ring_shift")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"p{p}")
def short_world(request):
    """A world whose collectives give up after 10 s: a hang fails the test quickly."""
    with World(request.param, timeout=10) as w:
        yield w


@pytest.mark.parametrize("shape", [(0,), (0, 3)], ids=str)
@pytest.mark.parametrize("name", EMPTY_COLLECTIVES)
def test_collectives_of_an_empty_tensor_return_at_once(short_world, name, shape):
    p = short_world.size
    results = short_world.run(W.empty_collective, name, shape, timeout=15)
    expected = {"ring_all_gather": [(0, *shape[1:])], "ring_reduce_scatter": [(0,)],
                "ring_shift": [shape, shape]}.get(name, [shape])
    for res in results:
        assert res["shapes"] == expected, (name, p, res["shapes"])
        assert res["bytes"] == 0  # nothing to send: no message at all
        if name in ("star_all_reduce", "tree_all_reduce", "ring_all_reduce", "tree_broadcast"):
            assert res["same_object"], f"{name} must work in place and return its tensor"
