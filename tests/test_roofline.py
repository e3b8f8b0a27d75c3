"""utils.roofline: datasheet peaks, predictions labelled as a model."""

from __future__ import annotations

import math

import pytest
import torch

from utils.roofline import GPU, GPUS, Prediction, arithmetic_intensity, dtype_key, get_gpu, predict, predict_trace

TB = 1e12


def test_datasheet_bandwidths_and_sources():
    expected = {"H100": 3.35 * TB, "H200": 4.8 * TB, "A100": 2.039 * TB, "RTX 4090": 1.008 * TB}
    assert set(GPUS) == set(expected)
    for key, bandwidth in expected.items():
        gpu = GPUS[key]
        assert isinstance(gpu, GPU)
        assert gpu.hbm_bytes_per_s == pytest.approx(bandwidth)
        assert "datasheet" in gpu.source or "whitepaper" in gpu.source
        assert gpu.sm_count > 0 and gpu.l2_bytes > 0
        assert {"fp32", "tf32", "bf16", "fp16", "int8"} <= set(gpu.peak_flops)


def test_dense_tensor_core_peaks():
    assert GPUS["H100"].peak("bf16") == pytest.approx(989.5 * TB)
    assert GPUS["H200"].peak(torch.bfloat16) == GPUS["H100"].peak("bf16")  # same chip, faster memory
    assert GPUS["H100"].peak("fp8") == pytest.approx(1979 * TB)
    assert GPUS["A100"].peak("fp16") == pytest.approx(312 * TB)
    assert GPUS["A100"].peak("tf32") == pytest.approx(156 * TB)
    assert GPUS["RTX 4090"].peak("bf16") == pytest.approx(165.2 * TB)
    assert GPUS["A100"].peak("fp32") == pytest.approx(19.5 * TB)
    with pytest.raises(ValueError, match="no peak"):
        GPUS["A100"].peak("fp8")


def test_memory_bound_prediction_is_bytes_over_bandwidth():
    p = predict(4.8e9, gpu="H200")
    assert isinstance(p, Prediction)
    assert p.time_s == pytest.approx(1e-3) and p.memory_time_s == pytest.approx(1e-3)
    assert p.compute_time_s == 0 and p.bound == "memory" and p.label == "model"
    assert "model" in str(p) and "not a measurement" in str(p) and "H200" in str(p)


def test_compute_bound_prediction_and_ridge_point():
    gpu = GPUS["H100"]
    ridge = gpu.ridge_point("bf16")
    assert ridge == pytest.approx(989.5 / 3.35)
    n = 4096  # a square bf16 matmul: far right of the ridge
    bytes_, flops = 3 * n * n * 2, 2 * n**3
    assert arithmetic_intensity(bytes_, flops) > ridge
    p = predict(bytes_, flops, gpu="h100 sxm", dtype="bfloat16")
    assert p.bound == "compute" and p.time_s == pytest.approx(flops / gpu.peak("bf16"))
    assert p.arithmetic_intensity == pytest.approx(flops / bytes_)


def test_predict_trace_uses_totals():
    class FakeTrace:
        bytes = 3.35e9
        flops = 0

    assert predict_trace(FakeTrace(), gpu="H100", dtype=torch.float16).time_s == pytest.approx(1e-3)


def test_lookups_and_edge_cases():
    assert get_gpu("4090") is GPUS["RTX 4090"] and get_gpu(GPUS["A100"]) is GPUS["A100"]
    assert dtype_key(torch.float8_e4m3fn) == "fp8" and dtype_key("float32") == "fp32"
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("V100")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_key("complex64")
    assert arithmetic_intensity(0, 0) == 0.0 and math.isinf(arithmetic_intensity(0, 5))
    assert predict(0).time_s == 0 and predict(0).bound == "memory"
