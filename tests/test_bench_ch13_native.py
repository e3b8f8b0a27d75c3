"""bench.ch13_native_cuda: the GPU checks of the native extension's CUDA ops, run on the CPU.

On a GPU run the entries call ``torch.ops.kernel_ladder_native``; here a stand-in computing the same four ops
with torch on the CPU takes its place, so that every check and every timing callable runs once before a rare
GPU run does. Without the extension (a smoke run) the native timings are listed as unavailable with a reason.
"""

from __future__ import annotations

import torch

from bench import ch13_below_triton, gpu_check
from bench import ch13_native_cuda as ch13
from bench.gpu import Check, Timing


class CpuOps:
    """``torch.ops.kernel_ladder_native``'s four backend ops, as torch computes them in float32."""

    def __init__(self, dw_scale: float = 1.0):
        self.dw_scale = dw_scale  # != 1: a wrong weight gradient, which the check must catch

    def rms_norm_forward(self, x, w, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        return (xf * rstd[..., None] * w.float()).to(x.dtype), rstd

    def rms_norm_backward(self, g, x, w, rstd):
        xhat = x.float() * rstd[..., None]
        gw = g.float() * w.float()
        dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd[..., None]
        dw = (g.float() * xhat).sum(0) * self.dw_scale
        return dx.to(x.dtype), dw.to(w.dtype)

    def softmax_forward(self, x):
        return torch.softmax(x.float(), -1).to(x.dtype)

    def softmax_backward(self, g, y):
        yf, gf = y.float(), g.float()
        return (yf * (gf - (gf * yf).sum(-1, keepdim=True))).to(y.dtype)


def test_every_native_check_and_timing_runs_and_passes_with_the_ops():
    entries = ch13._native_op_gpu_checks("smoke", ops=CpuOps())
    checks = [e for e in entries if isinstance(e, Check)]
    timings = [e for e in entries if isinstance(e, Timing)]
    assert len(checks) == 4 * len(ch13.NATIVE_SIZES["smoke"])
    results = {"correctness": []}
    assert gpu_check.run_checks(checks, results) == []
    assert all(c["ok"] for c in results["correctness"])
    assert timings and not any(t.unavailable for t in timings)
    for timing in timings:  # twice: the backward timings run their forward on the first call only
        timing.fn()
        timing.fn()
    ops = {t.op for t in timings}
    for op in ops:  # one torch baseline per op, and the native implementation with its target
        impls = [t for t in timings if t.op == op]
        assert sum(t.baseline for t in impls) == 1 and any(t.target for t in impls)


def test_a_wrong_weight_gradient_fails_its_check():
    entries = ch13._native_op_gpu_checks("smoke", ops=CpuOps(dw_scale=1.1))
    checks = [e for e in entries if isinstance(e, Check)]
    failures = gpu_check.run_checks(checks, {"correctness": []})
    assert failures and all("rms_norm_backward" in f for f in failures)


def test_without_the_extension_native_timings_are_unavailable_with_a_reason():
    entries = ch13._native_op_gpu_checks("smoke")
    assert not any(isinstance(e, Check) for e in entries)
    native = [e for e in entries if isinstance(e, Timing) and e.impl.startswith("native")]
    others = [e for e in entries if isinstance(e, Timing) and not e.impl.startswith("native")]
    assert native and all("smoke run" in t.unavailable for t in native)
    assert others and not any(t.unavailable for t in others)


def test_the_chapter_gathers_every_part():
    entries = ch13_below_triton.gpu_checks("smoke")
    impls = {e.impl for e in entries}
    assert {e.impl for e in ch13._native_op_gpu_checks("smoke")} <= impls
    assert any(i.startswith("native") for i in impls) and any(i.startswith("ch13 CUDA") for i in impls)
