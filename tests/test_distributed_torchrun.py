"""The production path: kernel_ladder.distributed under torchrun's own launcher and rendezvous (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def torchrun(ranks: int, module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args`` on ``ranks`` processes under torchrun (standalone rendezvous); fails the
    test, with the end of both streams, unless every rank exits 0."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(ranks), "-m", module, *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.timeout(300)
def test_selfcheck_passes_under_torchrun():
    out = torchrun(2, "kernel_ladder.distributed.selfcheck", "--timeout", "60")
    assert "selfcheck on 2 ranks (gloo)" in out.stdout
    assert out.stdout.count("  ok   ") == 3 and "FAIL" not in out.stdout


TRAIN = ["--steps", "4", "--layers", "1", "--log-every", "1"]


@pytest.mark.timeout(300)
def test_tp_dp_training_example_under_torchrun():
    out = torchrun(4, "kernel_ladder.distributed.train", *TRAIN)
    assert "4 ranks (gloo) as dp 2 x tp 2" in out.stdout
    assert out.stdout.count("   one process") == 4 and "\nok: loss" in out.stdout


@pytest.mark.timeout(300)
def test_the_training_example_catches_a_broken_parallelism():
    from tests import distributed_workers as W
    from utils.distributed import World

    with World(4, timeout=60) as world:
        good = world.run(W.train_example, TRAIN)
        assert all(r["ok"] for r in good) and good[0]["worst"] < 1e-5
        for broken in ("no-dp", "no-tp-reduce"):  # negative controls: the comparison with one process fails
            bad = world.run(W.train_example, TRAIN, broken)
            assert not any(r["ok"] for r in bad) and bad[0]["worst"] > 1e-3, broken


def test_utils_distributed_runs_a_worker_function_under_torchrun():
    out = torchrun(2, "utils.distributed", "solutions.ch11_distributed:world_all_reduce", "1000")
    assert "world_all_reduce on 2 ranks (gloo)" in out.stdout
    assert "rank 0: {'bytes': 4000, 'max_error': 0.0" in out.stdout and "rank 1:" in out.stdout


def test_utils_distributed_without_torchrun_says_how_to_launch():
    out = subprocess.run([sys.executable, "-m", "utils.distributed", "solutions.ch11_distributed:world_all_reduce"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert out.returncode != 0 and "launch it with torchrun" in out.stderr
