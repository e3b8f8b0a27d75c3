"""bench.profile_step (``make gpu-check PROFILE=1``): the trace, the table and the data of a profiled
training step, here at the smoke size on the CPU (the times are the interpreter's and are not
asserted; the names and the files are)."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from bench import gpu_check  # noqa: E402
from bench import profile_step as ps  # noqa: E402

# Every op of the decoder's training step (utils.transformer): each must show up under its name.
STEP_OPS = {"kernel_ladder::rms_norm", "kernel_ladder::linear", "kernel_ladder::rope",
            "kernel_ladder::flash_attention", "kernel_ladder::add",
            "kernel_ladder::gated_mlp", "kernel_ladder::fused_linear_cross_entropy", "kernel_ladder::rms_norm_backward",
            "kernel_ladder::linear_backward", "kernel_ladder::flash_attention_backward"}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    return out, ps.profile_training_step(out, size="smoke", steps=1, warmup=0)


def test_the_trace_table_and_data_are_written(profiled):
    out, data = profiled
    where = out / "profile"
    trace = json.loads((where / "step_trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert STEP_OPS <= names, f"missing from the chrome trace: {sorted(STEP_OPS - names)}"
    assert "kernel_ladder::rms_norm" in (where / "top_ops.txt").read_text()
    assert json.loads((where / "profile.json").read_text()) == data
    assert data["size"] == "smoke" and data["steps"] == 1 and data["time_key"] == "self_cpu_us"
    ops = {e["name"] for e in ps.kernel_ops(data)}
    assert STEP_OPS <= ops
    times = [e[data["time_key"]] for e in data["events"]]
    assert times == sorted(times, reverse=True) and times[0] > 0


def test_the_plot_draws_the_kernels_ops(profiled):
    _, data = profiled
    ax = ps.plot_profile(data, top=5)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 5 and all(label.startswith("kernel_ladder::") for label in labels)
    assert all(p.get_width() >= 0 for p in ax.patches)
    plt.close("all")
    with pytest.raises(ValueError, match="plot_profile: the profile has no kernel_ladder:: events"):
        ps.plot_profile({**data, "events": [e for e in data["events"] if not e["name"].startswith("kernel_ladder::")]})


@pytest.mark.parametrize("kwargs, message", [({"size": "huge"}, "size must be one of"),
                                             ({"steps": 0}, "steps must be an int >= 1"),
                                             ({"warmup": True}, "warmup must be an int >= 0")])
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=f"bench.profile_step: {message}"):
        ps.profile_training_step(tmp_path, **{"size": "smoke", **kwargs})


def test_gpu_check_records_a_failed_profile_as_a_failure(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no trace today")

    monkeypatch.setattr(ps, "profile_training_step", broken)
    results: dict = {}
    failures = gpu_check.run_profile(tmp_path, results, smoke=True)
    assert failures == ["profile: RuntimeError: no trace today"] and "profile" not in results


def test_gpu_check_summary_lists_the_profiled_ops(profiled):
    out, data = profiled
    results = {"device": "d", "torch": "t", "triton": "tr", "date": "today", "copy_GBps": 1.0, "correctness": [],
               "timings": [], "peaks": [],
               "profile": {"dir": str(out / "profile"), "time_key": data["time_key"],
                           "top_kernels_ops": [{"name": "kernel_ladder::linear", data["time_key"]: 1500.0}]}}
    text = gpu_check.summary(results, [])
    assert "top kernel_ladder ops by self_cpu_us" in text and "kernel_ladder::linear" in text and "1.500 ms" in text
