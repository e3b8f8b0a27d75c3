"""Every op shows up by name in a ``torch.profiler`` trace, and so does every kernel launch.

A custom op is recorded by the dispatcher as ``kernel_ladder::<op>`` (its backward as
``kernel_ladder::<op>_backward``); in interpreter mode each Triton launch is wrapped in a
``triton::<kernel>`` range (:mod:`kernel_ladder._profiling`); compiled, the CUDA activity names the
kernel after its Triton function. The cases are :mod:`utils.op_cases`' tiny calls, one per public op.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

import kernel_ladder
from kernel_ladder import _profiling
from utils.op_cases import op_cases

CASES = op_cases()


def _event_names(fn, activities=(ProfilerActivity.CPU,)) -> set[str]:
    with profile(activities=list(activities)) as prof:
        fn()
    return {event.name for event in prof.events()}


def missing_names(names: set[str], custom_ops: tuple[str, ...], launches: bool = True) -> list[str]:
    """What a trace with event ``names`` lacks: a ``kernel_ladder::<op>`` per custom op, and a named launch."""
    missing = [f"kernel_ladder::{op}" for op in custom_ops if f"kernel_ladder::{op}" not in names]
    if launches and not any(name.startswith(_profiling.PREFIX) for name in names):
        missing.append(f"{_profiling.PREFIX}<kernel>")
    return missing


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_forward_and_backward_are_named_in_a_cpu_trace(case):
    built = case.build()
    names = _event_names(built.forward)
    assert not missing_names(names, case.custom_ops, launches=kernel_ladder.runtime.INTERPRETER), sorted(names)
    if built.backward is not None and case.backward_ops:
        names = _event_names(built.backward)
        assert not missing_names(names, case.custom_ops + case.backward_ops,
                                 launches=kernel_ladder.runtime.INTERPRETER), sorted(names)


def test_every_public_custom_op_has_a_case():
    """A new op without a case here fails: each ``kernel_ladder::`` op (not a backward) is profiled by some case."""
    covered = {op for case in CASES for op in case.custom_ops + case.backward_ops}
    public = {name for name in dir(torch.ops.kernel_ladder)
              if not name.startswith("_") and "_backward" not in name
              and hasattr(getattr(torch.ops.kernel_ladder, name), "default")}
    assert public - covered == set()


@pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER, reason="the launch ranges exist in interpreter mode")
def test_launch_ranges_carry_the_triton_kernel_name():
    x = torch.randn(100, device=kernel_ladder.runtime.DEVICE)
    names = _event_names(lambda: kernel_ladder.gelu(x))
    assert "triton::gelu_kernel" in names


@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def test_negative_control_a_bare_launch_has_no_op_name():
    """A Triton launch outside any custom op leaves no ``kernel_ladder::`` name: the check above would say so."""
    x = torch.randn(100, device=kernel_ladder.runtime.DEVICE)
    out = torch.empty_like(x)
    names = _event_names(lambda: _copy_kernel[(1,)](x, out, 100, BLOCK=128))
    assert missing_names(names, ("copy",), launches=False) == ["kernel_ladder::copy"]
    torch.testing.assert_close(out, x)


def test_launches_run_normally_without_a_profiler():
    """With no profiler recording, launches run (and stay correct) without any range."""
    x = torch.randn(100, device=kernel_ladder.runtime.DEVICE)
    torch.testing.assert_close(kernel_ladder.gelu(x), torch.nn.functional.gelu(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_trace_names_the_triton_kernels():
    x = torch.randn(4096, device="cuda")
    names = _event_names(lambda: (kernel_ladder.gelu(x), torch.cuda.synchronize()),
                         activities=(ProfilerActivity.CPU, ProfilerActivity.CUDA))
    assert "kernel_ladder::gelu" in names
    assert any("gelu_kernel" in name for name in names), sorted(names)
