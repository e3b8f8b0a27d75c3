"""utils.flamegraph: the sampler finds a known hot spot, folding round-trips, sync stacks are counted."""

from __future__ import annotations

import collections
import time

import pytest
import torch

from utils import flamegraph


def _spin(seconds: float) -> int:
    # Pure Python work, so the sampler (which needs the GIL) gets its turns.
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def hot_leaf() -> int:
    return _spin(0.12)


def cold_leaf() -> int:
    return _spin(0.02)


def workload() -> int:
    return hot_leaf() + cold_leaf()


def test_sampler_finds_the_known_hot_spot():
    with flamegraph.sample(interval=0.001) as profile:
        workload()
    assert profile.total >= 20, profile.total
    by_total = {h.frame.split(" (")[0]: h for h in flamegraph.hot_frames(profile, n=50, by="total")}
    hot, cold = by_total["hot_leaf"], by_total["cold_leaf"]
    assert hot.total_count > 2 * cold.total_count  # 6x the time: a clear margin for a statistical count
    assert by_total["workload"].total_count >= hot.total_count + cold.total_count
    # Self time lands in the spin loop, which both leaves call: the hot spot by self is _spin.
    assert flamegraph.hot_frames(profile, n=1, by="self")[0].frame.startswith("_spin (")
    # Every sampled stack of the workload starts at the test and passes through workload().
    inside = profile.restricted("workload (")
    assert inside.total >= hot.total_count + cold.total_count
    assert all(stack[0].startswith("workload (") for stack in inside.stacks)


def test_a_negative_control_the_cold_function_is_not_reported_hot():
    with flamegraph.sample(interval=0.001) as profile:
        workload()
    inside = profile.restricted("workload (")  # the workload's own subtree, without pytest's frames
    top = flamegraph.hot_frames(inside, n=2, by="total", exclude=("workload (", "_spin ("))
    assert [h.frame.split(" (")[0] for h in top] == ["hot_leaf", "cold_leaf"], top


def test_fold_writes_the_folded_format_and_reads_it_back(tmp_path):
    stacks = collections.Counter({("main", "a", "b"): 3, ("main", "a"): 2, ("main", "c"): 5})
    profile = flamegraph.Profile(stacks, interval=0.001)
    assert flamegraph.fold(profile) == ["main;c 5", "main;a;b 3", "main;a 2"]
    path = flamegraph.write_folded(profile, tmp_path / "out.folded")
    assert path.read_text() == "main;c 5\nmain;a;b 3\nmain;a 2\n"
    assert flamegraph.read_folded(path).stacks == stacks
    assert flamegraph.read_folded("x;y 1\nx;y 2\n").stacks == {("x", "y"): 3}  # repeated lines add up
    with pytest.raises(ValueError, match="read_folded: line 1"):
        flamegraph.read_folded("no count here\n")


def test_hot_frames_self_and_total_and_recursion_counted_once():
    stacks = collections.Counter({("main", "f", "f", "g"): 4, ("main", "h"): 6})
    profile = flamegraph.Profile(stacks)
    total = {h.frame: h for h in flamegraph.hot_frames(profile, n=10, by="total")}
    assert total["main"].total_count == 10 and total["f"].total_count == 4 and total["f"].self_count == 0
    assert [h.frame for h in flamegraph.hot_frames(profile, n=2, by="self")] == ["h", "g"]
    assert flamegraph.hot_frames(profile, n=1, by="self")[0].share == pytest.approx(0.6)
    with pytest.raises(ValueError, match="by must be"):
        flamegraph.hot_frames(profile, by="wall")


def test_frame_labels_name_the_function_and_carry_no_separator():
    label = flamegraph.frame_label(hot_leaf.__code__)
    assert label.startswith("hot_leaf (test_flamegraph.py:") and ";" not in label


def hidden_sync(x: torch.Tensor) -> int:
    return int(x.max().item())


def caller(x: torch.Tensor) -> torch.Tensor:
    hidden_sync(x)
    return x * 2


def test_dispatch_stacks_names_the_function_that_called_item():
    x = torch.randn(8)
    with flamegraph.dispatch_stacks() as syncs:
        caller(x)
        caller(x)
    assert syncs.total == 2
    (stack,) = syncs.stacks
    assert stack[-1] == "aten._local_scalar_dense" and stack[-2].startswith("hidden_sync (")
    with flamegraph.dispatch_stacks() as none:  # negative control: no .item(), no event
        x * 2
    assert none.total == 0


def test_plot_draws_one_bar_per_frame_position():
    import matplotlib

    matplotlib.use("Agg")
    stacks = collections.Counter({("main", "a", "b"): 3, ("main", "c"): 5})
    ax = flamegraph.plot(flamegraph.Profile(stacks, interval=0.001), title="t")
    assert len(ax.patches) == 4  # main, a, b, c
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_py_spy_record_says_clearly_when_py_spy_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(flamegraph.shutil, "which", lambda name: None)
    assert not flamegraph.py_spy_available()
    with pytest.raises(RuntimeError, match="py-spy is not installed"):
        flamegraph.py_spy_record(["python", "-c", "pass"], tmp_path / "x.folded")
