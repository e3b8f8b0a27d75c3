"""kernel_ladder.autotune: the fixed interpreter config, the GPU autotuner's wiring, pruning, the CPU timer.

The GPU path is checked without a GPU: the ``triton.autotune`` wrapper is built (that needs no
driver), its configs, key, pruner, heuristic and disk-cache request are inspected, and its tuning
loop is run end to end in the interpreter with a stand-in benchmarker.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton

import kernel_ladder
from kernel_ladder import autotune as at
from kernel_ladder.autotune import GPU_CONFIGS, INTERPRETER_CONFIG, MatmulConfig
from kernel_ladder.ops import matmul as mm

DEVICE = kernel_ladder.runtime.DEVICE


def test_matmul_config_validates_and_converts():
    cfg = MatmulConfig(32, 64, 16, GROUP_M=4, num_warps=2, num_stages=3)
    assert cfg.meta == {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 4}
    tc = cfg.to_triton()
    assert tc.kwargs == cfg.meta and tc.num_warps == 2 and tc.num_stages == 3
    assert cfg.shared_memory_bytes(2) == 3 * (32 * 16 + 16 * 64) * 2
    assert str(cfg) == "32x64x16 G4 w2 s3"
    for bad, message in [
        (dict(BLOCK_M=24), r"kernel_ladder\.MatmulConfig: BLOCK_M must be a power of two >= 16, got 24"),
        (dict(BLOCK_K=8), r"BLOCK_K must be a power of two >= 16, got 8"),
        (dict(GROUP_M=0), r"GROUP_M must be an int >= 1, got 0"),
        (dict(num_warps=3), r"num_warps must be a power of two in \[1, 32\], got 3"),
        (dict(num_stages=0), r"num_stages must be an int >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            MatmulConfig(**bad)


def test_buckets_and_fitting():
    assert [at.size_bucket(n) for n in (1, 16, 17, 100, 4096, 4097)] == [16, 16, 32, 128, 4096, 8192]
    assert at.fit_config(INTERPRETER_CONFIG, 1, 300, 20) == MatmulConfig(16, 64, 32, 8, 4, 2)
    assert at.fit_config(INTERPRETER_CONFIG, 1000, 1000, 1000) == INTERPRETER_CONFIG


@pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER, reason="the interpreter's configuration")
def test_interpreter_uses_the_fixed_config(monkeypatch):
    for kind in ("tiled", "split_k", "persistent"):
        assert at.default_config(100, 130, 70, torch.float16, kind) == INTERPRETER_CONFIG
    # matmul never reaches the autotuner in the interpreter; it launches the fixed config's grid.
    monkeypatch.setattr(mm, "_autotuned_matmul_kernel", lambda: pytest.fail("autotuner used in the interpreter"))
    from utils.trace import trace

    a, b = torch.randn(100, 70), torch.randn(70, 130)
    with trace(torch_ops=False) as t:
        out = kernel_ladder.matmul(a, b)
    (launch,) = t.launches
    assert launch.grid == (triton.cdiv(100, 64) * triton.cdiv(130, 64), 1)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)


def test_gpu_autotuner_wiring_is_built_without_a_gpu(monkeypatch):
    recorded = {}
    real = triton.autotune

    def spy(*args, **kwargs):
        recorded.clear()
        recorded.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton, "autotune", spy)
    tuned = at.make_autotuned(mm.matmul_kernel)
    assert isinstance(tuned, triton.runtime.Autotuner)
    assert tuned.keys == list(at.TUNING_KEY)
    assert set(at.TUNING_KEY) <= set(mm.matmul_kernel.arg_names)
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in tuned.configs] == [
        (c.meta, c.num_warps, c.num_stages) for c in GPU_CONFIGS]
    assert tuned.early_config_prune.__wrapped__ is at.prune_configs  # followed by the candidate limit
    heuristic = tuned.fn
    assert isinstance(heuristic, triton.runtime.Heuristics) and heuristic.fn is mm.matmul_kernel
    assert heuristic.values["EVEN_K"]({"K": 64, "BLOCK_K": 32}) is True
    assert heuristic.values["EVEN_K"]({"K": 65, "BLOCK_K": 32}) is False
    # Tunings are cached on disk where this Triton supports it, and not asked for where it does not.
    assert recorded.get("cache_results") is (True if at.autotune_supports_disk_cache() else None)
    monkeypatch.setattr(at, "autotune_supports_disk_cache", lambda: False)
    at.make_autotuned(mm.matmul_kernel)
    assert "cache_results" not in recorded


def test_gpu_config_list_is_sensible():
    assert len(set(GPU_CONFIGS)) == len(GPU_CONFIGS) >= 8
    # Every config fits Hopper's shared memory for 16-bit inputs; the biggest tiles use 8 warps.
    assert all(c.shared_memory_bytes(2) <= 227 * 1024 for c in GPU_CONFIGS)
    assert all(c.num_warps == 8 for c in GPU_CONFIGS if c.BLOCK_M * c.BLOCK_N >= 128 * 256)
    assert any(c.BLOCK_M <= 32 for c in GPU_CONFIGS)  # short-M problems have a fitting tile


def test_pruning_drops_what_cannot_fit_and_keeps_one(monkeypatch):
    monkeypatch.setattr(at, "_shared_memory_limit", lambda: 163 * 1024)
    configs = [c.to_triton() for c in GPU_CONFIGS]

    def args(M, N, K, dtype):
        return {"M": M, "N": N, "K": K, "a_ptr": torch.empty(0, dtype=dtype)}

    big16 = at.prune_configs(configs, args(4096, 4096, 4096, torch.float16))
    # all fit at 163 KiB in fp16; the 16- and 32-row tiles (mma.sync on sm_90) are only for short M
    assert [c for c in configs if c not in big16] == [c for c in configs if c.kwargs["BLOCK_M"] < 64]
    assert at.prune_configs(configs, args(at.SHORT_TILE_MAX_M - 1, 4096, 4096, torch.float16)) == configs
    big32 = at.prune_configs(configs, args(4096, 4096, 4096, torch.float32))
    assert all(c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 4 <= 163 * 1024
               for c in big32) and len(big32) < len(configs)
    skinny = at.prune_configs(configs, args(16, 4096, 4096, torch.float16))
    assert skinny and all(c.kwargs["BLOCK_M"] <= 64 for c in skinny)
    tiny = at.prune_configs(configs, args(1, 1, 1, torch.float32))
    assert tiny and all(c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_K"] <= 32 for c in tiny)
    monkeypatch.setattr(at, "_shared_memory_limit", lambda: 1024)  # nothing fits: the smallest is kept
    assert len(at.prune_configs(configs, args(64, 64, 64, torch.float32))) == 1


def test_autotuned_launch_tunes_once_per_bucket_in_the_interpreter(monkeypatch, device):
    """The GPU launch path, end to end, with a stand-in benchmarker: the faster config wins and is cached."""
    timings = itertools.cycle([2.0, 1.0])  # the second candidate is "faster"
    benched = []

    def bench(kernel_call, quantiles):
        kernel_call()
        benched.append(1)
        t = next(timings)
        return [t, t, t]

    candidates = [MatmulConfig(16, 16, 16, 1, 4, 2), MatmulConfig(32, 32, 32, 8, 4, 2)]
    monkeypatch.setattr(at, "autotune_supports_disk_cache", lambda: False)  # a GPU run would reuse its disk cache
    tuned = at.make_autotuned(mm.matmul_kernel, candidates, do_bench=bench)
    monkeypatch.setattr(mm, "_autotuned_matmul_kernel", lambda: tuned)

    def run(M, N, K):
        a, b = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
        c = torch.full((M, N), float("nan"), device=device)
        (launch,) = mm._plan_launches(a, b, c, None, None)
        mm._run_tiled(launch, None, "none")
        torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)

    run(40, 30, 50)
    assert len(benched) == 2 and tuned.best_config.kwargs == candidates[1].meta
    run(35, 20, 60)  # same buckets (64, 32, 64): no new tuning
    assert len(benched) == 2
    run(3, 30, 50)  # M bucket 16: tuned again
    assert len(benched) == 4


def test_autotune_cpu_times_each_config_and_labels_them():
    ticks = iter(range(100))
    ran = []
    report = at.autotune_cpu(lambda c: ran.append(c), ["a", "b", "c"], timer=lambda: next(ticks) * (1.0),
                             repeats=2, warmup=1)
    assert ran == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert [t.seconds for t in report.timings] == [(1.0, 1.0)] * 3
    assert report.best == "a"
    assert "not GPU speed" in str(report) and "interpreter" in str(report)
    with pytest.raises(ValueError, match=r"kernel_ladder\.autotune\.autotune_cpu: repeats must be an int >= 1"):
        at.autotune_cpu(lambda c: None, ["a"], repeats=0)
    with pytest.raises(ValueError, match=r"kernel_ladder\.autotune\.autotune_cpu: configs must not be empty"):
        at.autotune_cpu(lambda c: None, [])


def test_autotune_cpu_on_real_launches(device):
    a, b = torch.randn(32, 32, device=device), torch.randn(32, 32, device=device)
    configs = [MatmulConfig(16, 16, 16, 1), MatmulConfig(32, 32, 32, 8)]
    report = at.autotune_cpu(lambda c: kernel_ladder.matmul_tiled(a, b, c), configs, repeats=1, warmup=0)
    assert report.best in configs and all(t.median > 0 for t in report.timings)
    assert str(configs[0]) in report.table()
