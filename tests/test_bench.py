"""utils.bench: CPU timings are labelled as the interpreter's; the GPU path goes through do_bench."""

from __future__ import annotations

import pytest
import torch
import triton.testing

from utils import bench
from utils.bench import CPU_NOTE, Row, Timing, compare, format_table, gbps, measure


def test_cpu_measure_never_calls_do_bench_and_says_so(monkeypatch):
    if not bench._gpu_timing_available():
        monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: pytest.fail("do_bench needs a GPU"))
    calls = []
    x = torch.randn(1000)
    timing = measure(lambda v: calls.append(1) or v * 2, x, rep=5)
    assert isinstance(timing, Timing)
    if bench._gpu_timing_available():
        return
    assert timing.device == "cpu" and timing.note == CPU_NOTE
    assert CPU_NOTE == "CPU time (torch's CPU kernels or Triton's interpreter), not a GPU's"
    assert timing.runs >= 3 and len(calls) == timing.runs + 1  # one warm-up call
    assert 0 <= timing.p20_ms <= timing.median_ms <= timing.p80_ms
    # str() is one short line: the times, the device, and that they are not a GPU's.
    text = str(timing)
    assert "ms" in text and "on cpu" in text and "CPU time, not a GPU's" in text and len(text) <= 80, text


def test_gpu_path_uses_do_bench_quantiles(monkeypatch):
    seen = {}

    def fake_do_bench(fn, warmup, rep, quantiles):
        fn()
        seen.update(warmup=warmup, rep=rep, quantiles=quantiles)
        return [2.0, 1.5, 2.5]

    monkeypatch.setattr(bench, "_gpu_timing_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    timing = measure(lambda: None, warmup=10, rep=50)
    assert (timing.median_ms, timing.p20_ms, timing.p80_ms) == (2.0, 1.5, 2.5)
    assert seen == {"warmup": 10, "rep": 50, "quantiles": [0.5, 0.2, 0.8]}
    assert timing.device == "NVIDIA H200" and "do_bench" in timing.note


def test_compare_and_format_table(monkeypatch):
    medians = iter([4.0, 1.0])

    def fake_measure(fn, *args, warmup, rep):
        m = next(medians)
        return Timing(m, m, m, device="cpu", note=CPU_NOTE, runs=3)

    monkeypatch.setattr(bench, "measure", fake_measure)
    rows = compare({"torch": lambda: None, "fused": lambda: None}, bytes={"torch": 36e6, "fused": 12e6})
    assert [r.name for r in rows] == ["torch", "fused"] and all(isinstance(r, Row) for r in rows)
    assert rows[0].speedup == 1.0 and rows[1].speedup == 4.0
    assert rows[0].gbps == pytest.approx(9.0) and rows[1].gbps == pytest.approx(12.0)
    text = format_table(rows)
    assert "torch" in text and "fused" in text and "4.00×" in text and CPU_NOTE in text


def test_compare_really_times_on_the_cpu():
    rows = compare({"a": lambda x: x + 1, "b": lambda x: x * 2}, torch.randn(100), rep=1)
    assert len(rows) == 2 and rows[0].gbps is None and rows[0].speedup == 1.0


def test_gbps():
    assert gbps(1e9, 1.0) == pytest.approx(1000.0)
    assert gbps(4.8e12, 1000.0) == pytest.approx(4800.0)
    assert gbps(1, 0) == float("inf")
