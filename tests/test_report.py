"""The report: every registered ladder step runs, is checked, counted and modelled."""

from __future__ import annotations

import subprocess
import sys

import pytest

import bench
from bench import report

CHAPTERS = sorted({ladder.chapter for ladder in bench.ladders()})


@pytest.mark.interpreter
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_ladder_step_is_correct_and_counted(chapter):
    rows = []
    for ladder in bench.ladders([chapter]):
        rows += report.run_ladder(ladder, gpu=False)
    assert rows
    for r in rows:
        assert r.correct in ("ok", "n/a"), (r.op, r.step, r.correct, r.max_error)
        assert r.bytes > 0 and r.launches >= 1 and r.model_us > 0
    # Every production forward kernel moves at most its bound (1.05x the ideal bytes unless its ladder
    # says otherwise); the first chapters all mark one.
    bounded = [r for r in rows if r.max_ratio is not None]
    if chapter in ("00_gpu_model", "01_elementwise", "02_softmax", "03_normalization"):
        assert bounded
    for r in bounded:
        assert r.bytes_ratio <= r.max_ratio <= 1.1, (r.op, r.step, r.bytes_ratio)
    by = {(r.op, r.step): r for r in rows}
    if chapter == "00_gpu_model":
        # Exact traffic of the top step: vector add reads two fp32 vectors and writes one.
        add = by[("vector add", "triton kernel_ladder.add")]
        assert add.bytes == add.ideal_bytes == 12 * 2048 and add.launches == 1
        # The Python loop launches two kernels per element (add, copy_); its selects are views.
        assert by[("vector add", "python loop")].launches == 2 * 2048
    if chapter == "01_elementwise":
        # Fusion: the fused SwiGLU moves the ideal bytes in one launch; the 3-launch chain moves more.
        fused = by[("swiglu", "triton kernel_ladder.swiglu (fused)")]
        chain = by[("swiglu", "torch sigmoid, mul, mul")]
        assert fused.launches == 1 and fused.bytes_ratio <= 1.05
        assert chain.launches == 3 and chain.bytes > 2 * fused.bytes
    if chapter == "09_moe":
        # The loop over experts launches more with every expert; the composed ops and kernel_ladder.moe do not.
        from bench.ch09_moe import MOE_EXPERTS, MOE_LOOP

        def launches(step):
            return [by[(f"moe block, E={e}", step)].launches for e in MOE_EXPERTS]

        loop = launches(MOE_LOOP)
        assert loop == sorted(loop) and len(set(loop)) == len(loop), loop
        for step in ("kernel_ladder ops composed (route, sort, gather, GEMM, swiglu, GEMM, combine)",
                     "kernel_ladder.moe"):
            assert len(set(launches(step))) == 1, (step, launches(step))


def test_results_keep_the_hand_written_sections_and_show_the_figures(tmp_path):
    rows = report.run_ladder(bench.ladders(["00"])[0], gpu=False)

    def draw(ax):
        ax.plot([1, 2], [3, 4])
        return "a caption with its numbers: 3 and 4"

    drawn = report.draw_figures([bench.Figure("99_test", "demo", draw)], tmp_path / "img")
    assert [(p.name, c) for p, c in drawn] == [("ch99_test_demo.png", "a caption with its numbers: 3 and 4")]
    assert drawn[0][0].stat().st_size > 0
    path = tmp_path / "results.md"
    path.write_text("# Results\n\nhand-written GPU section\n")
    report.write_results(rows, report.machine(), [], path, drawn)
    text = path.read_text()
    assert "hand-written GPU section" in text and "| vector add |" in text and "model" in text
    assert "![ch99_test_demo](img/ch99_test_demo.png)" in text and "a caption with its numbers" in text
    report.write_results(rows, "again", [], path)  # regenerates in place, keeps the rest
    assert path.read_text().count(report.BEGIN) == 1 and "again" in path.read_text()


def test_negative_control_wrong_step_is_reported():
    ladder = bench.ladders(["00"])[0]
    wrong = bench.Ladder(ladder.chapter, "broken add", ladder.make_inputs, ladder.reference,
                         [bench.Step("ignores y", lambda x, y: x * 1.0)])
    rows = report.run_ladder(wrong, gpu=False)
    assert rows[0].correct == "WRONG"


def test_negative_control_a_step_over_its_bound_is_reported():
    # Right values, but every input read twice: 5/3 of the ideal bytes for an add.
    ladder = bench.ladders(["00"])[0]
    wasteful = bench.Ladder(ladder.chapter, "wasteful add", ladder.make_inputs, ladder.reference,
                            [bench.Step("reads twice", lambda x, y: (x + 0 * x.clone()) + y, bound=1.05)])
    (row,) = report.run_ladder(wasteful, gpu=False)
    assert row.over_bound and row.correct.startswith("OVER")


def test_gpu_check_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no CUDA device" in out.stdout


def test_summary_replaces_only_the_text_between_its_markers(tmp_path):
    rows = report.run_ladder(bench.ladders(["00"])[0], gpu=False)
    path = tmp_path / "README.md"
    path.write_text(f"intro\n{report.SUMMARY_BEGIN}\nold\n{report.SUMMARY_END}\noutro\n")
    assert report.write_summary(rows, "a machine", path)
    text = path.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| 00_gpu_model | vector add | python loop: 4,096 launches, 1.67× |" in text and "a machine" in text
    assert not report.write_summary(rows, "x", tmp_path / "missing.md")
