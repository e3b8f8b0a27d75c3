"""``make gpu-check`` runs end to end: every chapter's checks, at tiny sizes, on the CPU.

A GPU run is rare and short, so the script must not die on a typo there. ``--smoke`` builds every
chapter's ``gpu_checks("smoke")`` entries and runs them on this machine's device (the
interpreter here): every correctness check must pass and every timing callable must run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import bench
import kernel_ladder
from bench import gpu_check
from bench.gpu import Check, Timing


@pytest.mark.slow
def test_smoke_run_passes_every_chapters_checks(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--profile", "--count-compiles"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    assert results["failures"] == []
    assert results["correctness"] and all(c["ok"] for c in results["correctness"])
    chapters_with_checks = [m for m in bench.CHAPTER_MODULES if hasattr(__import__(m, fromlist=["_"]), "gpu_checks")]
    assert len(chapters_with_checks) >= 2
    assert "correctness:" in out.stdout and "of copy" in out.stdout  # the table is printed last
    assert "kernel_ladder::" in out.stdout and (tmp_path / "profile" / "step_trace.json").exists()  # --profile
    compiles = results["compiles"]  # --count-compiles: every chapter's launches, counted per round
    assert 0 < compiles["quick"]["1"] < compiles["full"] and "matmul_kernel" in compiles["full_by_kernel"]


def test_a_wrong_result_fails_the_check_and_a_crash_is_reported(monkeypatch):
    x = torch.randn(10)
    entries = [
        Check("right", torch.float16, lambda: x.half(), lambda: x),
        Check("wrong", torch.float16, lambda: x.half() * 1.1, lambda: x),
        Check("crash", torch.float16, lambda: 1 / 0, lambda: x),
        Check("nan", torch.float16, lambda: x.half() * float("nan"), lambda: x),
        Check("tuple shape", torch.float16, lambda: (x.half(), x[:3]), lambda: (x, x)),
    ]
    results = {"correctness": []}
    failures = gpu_check.run_checks(entries, results)
    assert [c["ok"] for c in results["correctness"]] == [True, False, False, False, False]
    assert any("ZeroDivisionError" in f for f in failures) and len(failures) == 4


def test_timings_get_bandwidth_and_a_ratio_to_their_baseline():
    results = {}
    entries = [Timing("op", "base", lambda: None, bytes=10**6, baseline=True), Timing("op", "ours", lambda: None)]
    gpu_check.run_timings(entries, results, smoke=True, copy_gbps=1.0)
    base, ours = results["timings"]
    assert "GB/s" in base and "GB/s" not in ours and base["vs_baseline"] == 1.0 and ours["vs_baseline"] > 0


def test_an_unavailable_timing_is_recorded_with_its_reason_not_timed_nor_failed():
    def never():
        raise AssertionError("an unavailable implementation is not run")

    results = {"device": "cpu", "torch": "t", "triton": "t", "date": "d", "copy_GBps": 1.0, "correctness": [],
               "peaks": []}
    entries = [Timing("op", "base", lambda: None, bytes=10**6, baseline=True),
               Timing("op", "missing", never, bytes=10**6, unavailable="torch 0.0 has no torch._missing")]
    assert gpu_check.run_timings(entries, results, smoke=True, copy_gbps=1.0) == []
    base, missing = results["timings"]
    assert missing["ms"] is None and missing["vs_baseline"] is None and "GB/s" not in missing
    assert missing["unavailable"] == "torch 0.0 has no torch._missing" and base["vs_baseline"] == 1.0
    assert "unavailable: torch 0.0 has no torch._missing" in gpu_check.summary(results, [])


def test_mfu_round_trains_and_reports(monkeypatch):
    results = {}
    assert gpu_check.run_mfu(results, torch.device("cpu"), smoke=True) == []
    m = results["mfu"]
    assert m["tokens_per_s"] > 0 and m["step_s"] > 0
    params = m["non_embedding_params"]
    config = gpu_check.MFU_CONFIGS["smoke"]
    tokens = config["batch"] * config["seq"]
    # 6·N per token plus attention's 12·L·h·s
    assert m["model_flops_per_step"] == 6 * params * tokens + 12 * config["num_hidden_layers"] * \
        config["hidden_size"] * config["seq"] * tokens
    assert m["mfu_vs_h200_bf16_peak"] == pytest.approx(m["TFLOP/s"] * 1e12 / gpu_check.H200_BF16_PEAK)
    line = gpu_check.summary({"device": "d", "torch": "t", "triton": "t", "date": "x", "copy_GBps": 1.0,
                              "correctness": [], "timings": [], "peaks": [], **results}, [])
    assert "MFU" in line and "tokens/s" in line
    monkeypatch.setitem(gpu_check.MFU_CONFIGS, "smoke", {**config, "num_attention_heads": 5})  # a broken config
    assert gpu_check.run_mfu({}, torch.device("cpu"), smoke=True)[0].startswith("mfu: ValueError")


# ----------------------------------------------------------------------------------------------
# The candidate limit (kernel_ladder.autotune.limit_candidates): what --quick tunes
# ----------------------------------------------------------------------------------------------


def _counting_bench(benched):
    def bench(kernel_call, quantiles):
        kernel_call()
        benched.append(1)
        return [1.0 + len(benched)] * 3  # the first candidate benchmarked is the fastest

    return bench


@pytest.mark.parametrize("k", [1, 2, None])
def test_a_matmul_tuned_under_the_limit_benchmarks_only_its_first_k_candidates(monkeypatch, k):
    from kernel_ladder import autotune as at
    from kernel_ladder.autotune import MatmulConfig
    from kernel_ladder.ops import matmul as mm

    benched = []
    candidates = [MatmulConfig(32, 32, 32, 8, 4, 2), MatmulConfig(16, 16, 16, 1, 4, 2),
                  MatmulConfig(16, 32, 16, 1, 4, 2)]
    monkeypatch.setattr(at, "autotune_supports_disk_cache", lambda: False)
    tuned = at.make_autotuned(mm.matmul_kernel, candidates, do_bench=_counting_bench(benched))
    monkeypatch.setattr(mm, "_autotuned_matmul_kernel", lambda: tuned)
    a, b = torch.randn(40, 50), torch.randn(50, 30)
    c = torch.full((40, 30), float("nan"))
    (launch,) = mm._plan_launches(a, b, c, None, None)
    with at.limit_candidates(k):
        assert at.candidate_limit() == k
        mm._run_tiled(launch, None, "none")
    assert at.candidate_limit() is None  # the block restored it
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
    kept = 3 if k is None else k
    # one candidate left is launched without benchmarking; otherwise exactly the first k are benchmarked
    assert len(benched) == (0 if kept == 1 else kept)
    if kept > 1:
        assert [cfg.kwargs for cfg in tuned.configs_timings] == [cfg.meta for cfg in candidates[:kept]]
    assert tuned.best_config.kwargs == candidates[0].meta


def test_the_limit_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    from kernel_ladder import autotune as at

    monkeypatch.setenv(at.AUTOTUNE_LIMIT_ENV, "2")
    assert at.candidate_limit() == 2
    assert at.limited(lambda configs, named_args, **kw: configs)(["a", "b", "c"], {}) == ["a", "b"]
    with at.limit_candidates(None):  # an explicit block wins over the environment
        assert at.candidate_limit() is None
    monkeypatch.setenv(at.AUTOTUNE_LIMIT_ENV, "two")
    with pytest.raises(ValueError, match="kernel_ladder.autotune.limit_candidates: KERNEL_LADDER_AUTOTUNE_LIMIT"):
        at.candidate_limit()
    with pytest.raises(ValueError, match=r"kernel_ladder.autotune.limit_candidates: k must be .* got 0"):
        with at.limit_candidates(0):
            pass


def test_flash_attention_tuned_under_the_limit_benchmarks_k_candidates_per_kernel(monkeypatch):
    from kernel_ladder.autotune import limit_candidates
    from kernel_ladder.ops import attention

    benched = []
    candidates = tuple(attention.configs.AttentionConfig(m, n, 4, 1) for m, n in ((32, 32), (16, 16), (16, 32)))
    monkeypatch.setattr(attention.configs, "autotune_supports_disk_cache", lambda: False)
    tuned = {kind: attention.configs.make_autotuned(kind, candidates, do_bench=_counting_bench(benched))
             for kind in ("forward", "dkdv", "dq")}
    monkeypatch.setattr(attention.configs, "_fixed_config", lambda: None)
    monkeypatch.setattr(attention.configs, "_autotuned", tuned.__getitem__)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 20, 16, generator=gen).requires_grad_() for _ in range(3))
    with limit_candidates(2):
        out = kernel_ladder.flash_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
    assert len(benched) == 6  # 3 kernels x their first 2 candidates
    for kernel in tuned.values():
        assert [cfg.kwargs for cfg in kernel.configs_timings] == [{"BLOCK_M": 32, "BLOCK_N": 32},
                                                                   {"BLOCK_M": 16, "BLOCK_N": 16}]
    ref = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    torch.testing.assert_close(out.detach(), ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# The quick round, the budget, the compile count
# ----------------------------------------------------------------------------------------------


def test_the_quick_round_checks_every_op_once_and_times_the_headline_implementations():
    x = torch.randn(4)
    entries = [
        Check("op a", torch.bfloat16, lambda: x, lambda: x), Check("op a", torch.float16, lambda: x, lambda: x),
        Check("fp32 only", torch.float32, lambda: x, lambda: x),
        Timing("a", "torch eager", lambda: None, baseline=True), Timing("a", "torch.compile", lambda: None),
        Timing("a", "a middle step", lambda: None), Timing("a", "ours", lambda: None, target=">= 90% of copy"),
        Timing("b", "torch eager", lambda: None, baseline=True), Timing("b", "step 1", lambda: None),
        Timing("b", "top", lambda: None), Timing("b", "torch.compile", lambda: None),
        Timing("c", "forced", lambda: None, target="x", headline=False),
    ]
    kept = gpu_check.quick_entries(entries)
    assert [(e.op, str(e.dtype)) for e in kept if isinstance(e, Check)] == [("op a", "torch.bfloat16"),
                                                                          ("fp32 only", "torch.float32")]
    assert [(e.op, e.impl) for e in kept if isinstance(e, Timing)] == [
        ("a", "torch eager"), ("a", "ours"), ("b", "torch eager"), ("b", "top")]


def test_a_spent_budget_starts_no_new_entry_and_still_writes_the_json_and_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--smoke", "--quick", "--budget-s", "0", "--chapters", "00"]) == 0
    results = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    assert results["correctness"] == [] and results["timings"] == [] and "mfu" not in results
    assert results["not_started"]["correctness"] >= 1 and results["not_started"]["mfu"] == 1
    assert set(results["round_seconds"]) == {"correctness", "timings", "peaks"}
    out = capsys.readouterr().out
    assert "budget of 0 s spent: not started:" in out and "correctness: 0/0 ok" in out and "timings:" in out


def test_the_deadline_lets_entries_start_until_it_passes():
    now = [0.0]
    deadline = gpu_check.Deadline(10.0, clock=lambda: now[0])
    x = torch.randn(3)

    def slow():
        now[0] += 6.0
        return x

    results = {"correctness": []}
    entries = [Check(f"c{i}", torch.float32, slow, lambda: x) for i in range(4)]
    assert gpu_check.run_checks(entries, results, deadline) == []
    assert len(results["correctness"]) == 2 and deadline.skipped == {"correctness": 2}  # started at 0 s and 6 s


@triton.jit
def _count_me_kernel(x_ptr, n, stride, BLOCK: tl.constexpr):
    pass


def test_the_compile_counter_counts_distinct_specializations_and_configs():
    from bench.compile_count import CompileCounter

    counter = CompileCounter()
    x = torch.zeros(64)
    with counter.installed():
        for n, stride in ((64, 1), (128, 1), (100, 1), (64, 2), (64, 1)):
            _count_me_kernel[(1,)](x, n, stride, BLOCK=16)
        _count_me_kernel[(1,)](x, 64, 1, BLOCK=32)
        _count_me_kernel[(1,)](x, 64, 1, BLOCK=16, num_warps=8)
        counter.quick = False
        _count_me_kernel[(1,)](x[1:], 64, 1, BLOCK=16)  # unaligned: full round only
    _count_me_kernel[(1,)](x, 99, 3, BLOCK=64)  # not installed: not counted
    # 64 and 128 are both divisible by 16 (one binary); 100, stride 2, BLOCK 32, 8 warps, unaligned: one each
    assert len(counter.full_keys) == 6 and len(counter.quick_keys[1]) == len(counter.quick_keys[2]) == 5


@pytest.mark.slow
def test_count_compiles_limits_the_autotuned_kernels_of_the_quick_round(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--smoke", "--count-compiles", "--candidates", "2", "--chapters", "07"]) == 0
    compiles = json.loads((tmp_path / "gpu_check_smoke.json").read_text())["compiles"]
    quick1, quick2, full = (compiles["quick_by_kernel"]["1"], compiles["quick_by_kernel"]["2"],
                            compiles["full_by_kernel"])
    for kernel in ("flash_attention_forward_kernel", "flash_attention_backward_dkdv_kernel",
                   "flash_attention_backward_dq_kernel"):
        # one candidate per specialization at k = 1, at most two at k = 2, every candidate that fits in full
        assert 0 < quick1[kernel] < quick2[kernel] <= 2 * quick1[kernel] < full[kernel]
    assert compiles["quick"]["1"] < compiles["quick"]["2"] < compiles["full"]
    assert compiles["full_estimate_s"] > compiles["quick_estimate_s"]["2"] > compiles["quick_estimate_s"]["1"] > 0
    assert "kernel compilations a cold cache would build" in capsys.readouterr().out
