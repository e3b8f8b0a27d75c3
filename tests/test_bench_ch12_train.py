"""bench.ch12_train: the patched and unpatched runs agree step by step, the loss falls, and the
script fails when they part or the loss does not fall (negative controls)."""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("transformers")

import bench.ch12_train as ct  # noqa: E402


def test_text_round_trips_and_batches_are_windows():
    vocab, ids = ct.load_text()
    assert "".join(vocab[i] for i in ids.tolist()) == ct.TEXT.read_text()
    config = ct.TrainConfig(steps=3, batch_size=2, seq_len=8)
    data = ct.batches(ids, config)
    assert len(data) == 3 and data[0].shape == (2, 8)
    text = ids.tolist()
    for row in data[1].tolist():  # each row is a contiguous window of the text
        assert any(text[s: s + 8] == row for s in range(len(text) - 7))
    assert ct.batches(ids[:8], config)[0].shape == (2, 8)  # the whole text is one window
    with pytest.raises(ValueError, match="fewer than seq_len"):
        ct.batches(ids[:5], config)


def test_patched_training_follows_transformers():
    run = ct.train(ct.TrainConfig(steps=3, batch_size=2, seq_len=16, num_hidden_layers=1))
    assert run.replaced["attention (AttentionInterface)"] == 1 and run.replaced["rms_norm"] == 3
    assert run.max_relative_gap < 1e-4
    assert run.patched_loss[-1] < run.patched_loss[0]
    table = ct.table(run)
    assert "| 3 |" in table and ct.BEGIN in table and run.machine in table


def _fake_run(reference, patched):
    config = ct.TrainConfig(steps=len(reference))
    return ct.TrainRun(config, "ab", 10, {}, list(reference), list(patched), machine="test")


def test_main_fails_when_the_runs_part(monkeypatch, capsys):  # a patch that changes the training
    monkeypatch.setattr(ct, "train", lambda config: _fake_run([3.0, 2.5, 2.0], [3.0, 2.0, 1.5]))
    assert ct.main(["--steps", "3", "--no-write"]) == 1
    assert "left the reference's" in capsys.readouterr().err


def test_main_fails_when_loss_does_not_fall(monkeypatch, capsys):
    monkeypatch.setattr(ct, "train", lambda config: _fake_run([3.0, 3.1, 3.2], [3.0, 3.1, 3.2]))
    assert ct.main(["--steps", "3", "--no-write"]) == 1
    assert "did not fall" in capsys.readouterr().err
    monkeypatch.setattr(ct, "train", lambda config: _fake_run([3.0, 2.5, 2.0], [3.0, 2.5, 2.0]))
    assert ct.main(["--steps", "3", "--no-write"]) == 0


def test_the_committed_curve_is_a_full_run_and_is_tracked():
    """The chapter plots this file: it has to be in every clone (not ignored), a full default run,
    and one that passed the script's own checks."""
    assert ct.CURVE.exists(), f"{ct.CURVE} is missing: run `python -m bench.ch12_train` and commit it"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(ct.CURVE)], cwd=ct.ROOT, capture_output=True)
    assert ignored.returncode != 0, f"{ct.CURVE.relative_to(ct.ROOT)} is git-ignored: no clone would have it"
    run = json.loads(ct.CURVE.read_text())
    steps = ct.TrainConfig().steps
    assert run["config"] == vars(ct.TrainConfig()) and len(run["patched_loss"]) == len(run["reference_loss"]) == steps
    gaps = [abs(p - r) / r for p, r in zip(run["patched_loss"], run["reference_loss"])]
    assert max(gaps) == pytest.approx(run["max_relative_gap"]) and max(gaps) <= ct.GAP_LIMIT
    assert run["patched_loss"][-1] < run["patched_loss"][0]
