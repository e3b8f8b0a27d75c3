"""utils.overhead: no_launch really skips every kernel and puts everything back; the timers are sane."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import autotuner, interpreter, jit

import kernel_ladder
from utils import overhead
from utils.overhead import Overhead, dispatch_floor, eager_time, host_overhead, no_launch

DEVICE = kernel_ladder.runtime.DEVICE


@triton.jit
def fill_kernel(out_ptr, value, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.zeros((BLOCK,), tl.float32) + value, mask=offsets < n)


def _patched_attributes():
    return {(cls, name): cls.__dict__[name] for cls, name, _ in overhead._PATCHES}


def test_no_launch_leaves_the_output_unwritten(poisoned, gen):
    x = torch.randn(3, 50, generator=gen).to(DEVICE)
    with no_launch() as block:
        out = kernel_ladder.gelu(x)
    assert torch.isnan(out).all(), "a kernel ran under no_launch: its output was written"
    assert block.launches == 1
    assert block.by_kernel == {"gelu_kernel": 1}


def test_no_launch_skips_a_raw_triton_launch_and_restores_it():
    out = torch.full((40,), -1.0, device=DEVICE)
    with no_launch() as block:
        fill_kernel[(1,)](out, 7.0, out.numel(), BLOCK=64)
    assert (out == -1.0).all()
    assert block.launches == 1 and block.by_kernel["fill_kernel"] == 1
    # Negative control: the same launch outside the block writes the buffer, so the check above
    # would have caught a launch that ran.
    fill_kernel[(1,)](out, 7.0, out.numel(), BLOCK=64)
    assert (out == 7.0).all()


def test_no_launch_restores_every_patched_attribute_and_kernels_run_again(poisoned, gen):
    before = _patched_attributes()
    with no_launch():
        assert all(cls.__dict__[name] is stub for cls, name, stub in overhead._PATCHES)
    assert _patched_attributes() == before
    x = torch.randn(2, 33, generator=gen).to(DEVICE)
    torch.testing.assert_close(kernel_ladder.gelu(x), torch.nn.functional.gelu(x))


def test_no_launch_restores_after_an_exception():
    before = _patched_attributes()
    with pytest.raises(ZeroDivisionError), no_launch():
        raise ZeroDivisionError("inside the block")
    assert _patched_attributes() == before


def test_no_launch_counts_forward_and_backward_launches(gen):
    x = torch.randn(4, 30, generator=gen, device=DEVICE, requires_grad=True)
    with no_launch() as block:
        y = kernel_ladder.softmax(x, dim=-1)
        y.backward(torch.ones_like(y))
    assert block.launches == 2
    assert block.by_kernel == {"softmax_kernel": 1, "softmax_backward_kernel": 1}


def test_nested_blocks_both_count_and_unwind():
    before = _patched_attributes()
    out = torch.zeros(8, device=DEVICE)
    with no_launch() as outer:
        fill_kernel[(1,)](out, 1.0, 8, BLOCK=8)
        with no_launch() as inner:
            fill_kernel[(1,)](out, 1.0, 8, BLOCK=8)
        assert all(cls.__dict__[name] is stub for cls, name, stub in overhead._PATCHES)
    assert (outer.launches, inner.launches) == (2, 1)
    assert _patched_attributes() == before
    assert (out == 0).all()


def test_a_block_runs_once():
    block = no_launch()
    with block:
        pass
    with pytest.raises(RuntimeError, match="runs once"), block:
        pass


def test_no_launch_covers_the_autotuner_and_the_jit_launch():
    # The compiled-mode launch paths are replaced too (without a GPU they are only checked to be
    # swapped for the counting stub, and an autotuned launch is counted once, never benchmarked).
    with no_launch():
        assert jit.JITFunction.run is overhead._skip_run
        assert interpreter.InterpretedFunction.run is overhead._skip_run
        assert autotuner.Autotuner.__dict__["run"] is overhead._skip_autotuned

    def refuse_to_bench(*args, **kwargs):
        raise AssertionError("the autotuner benchmarked under no_launch")

    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK": 8}), triton.Config({"BLOCK": 16})], key=["n"], do_bench=refuse_to_bench
    )(fill_kernel)
    out = torch.zeros(8, device=DEVICE)
    with no_launch() as block:
        tuned[(1,)](out, 1.0, 8)
    assert block.launches == 1 and block.by_kernel["fill_kernel"] == 1
    assert (out == 0).all()


def test_host_overhead_gives_sane_positive_numbers(gen):
    x = torch.randn(4, 64, generator=gen).to(DEVICE)
    result = host_overhead(kernel_ladder.gelu, x, number=20, repeat=3, warmup=2)
    assert isinstance(result, Overhead)
    assert 0 < result.min_us <= result.median_us
    assert result.launches_per_call == 1
    assert "us/call" in str(result)


def test_host_overhead_of_forward_and_backward_counts_both_launches(gen):
    x = torch.randn(4, 64, generator=gen, device=DEVICE, requires_grad=True)
    g = torch.ones(4, 64, device=DEVICE)
    result = host_overhead(lambda: kernel_ladder.silu(x).backward(g), number=10, repeat=3, warmup=1)
    assert result.launches_per_call == 2
    assert result.median_us > 0


def test_eager_time_and_the_dispatch_floor_are_positive_and_launch_nothing():
    x = torch.randn(4, 64)
    eager = eager_time(torch.nn.functional.gelu, x, number=20, repeat=3)
    floor = dispatch_floor(number=20, repeat=3)
    for result in (eager, floor):
        assert 0 < result.min_us <= result.median_us
        assert result.launches_per_call == 0


@pytest.mark.parametrize("bad", [{"number": 0}, {"repeat": True}, {"warmup": -1}, {"number": 1.5}])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="utils.overhead.host_overhead"):
        host_overhead(lambda: None, **bad)


def test_python_calls_counts_calls_exactly():
    def three():
        len([])
        abs(-1)

    assert overhead.python_calls(lambda: None) == 1.0  # the function itself
    assert overhead.python_calls(three) == 3.0
    assert overhead.python_calls(torch.add, torch.ones(2), torch.ones(2)) == 1.0  # all C++


def test_python_calls_sees_the_validation_a_wrapper_skips(gen):
    # The public wrappers check only what the op's schema would refuse (the op checks values):
    # calling the wrapper costs at most a handful of calls more than calling the op directly.
    x, w = torch.randn(8, 64, generator=gen).to(DEVICE), torch.randn(64, generator=gen).to(DEVICE)
    before = kernel_ladder.runtime.values_checked()
    kernel_ladder.runtime.check_values(False)
    try:
        wrapper = overhead.python_calls(kernel_ladder.rms_norm, x, w)
        op = overhead.python_calls(torch.ops.kernel_ladder.rms_norm, x, w, 1e-6)
        floor = overhead.python_calls(overhead.floor_op(), x)
    finally:
        kernel_ladder.runtime.check_values(before)
    assert floor < op <= wrapper <= op + 10, (floor, op, wrapper)


def test_python_calls_restores_the_previous_profiler():
    import sys

    seen = []
    previous = lambda frame, event, arg: seen.append(event)  # noqa: E731
    sys.setprofile(previous)
    try:
        overhead.python_calls(lambda: None)
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)


def test_python_calls_refuses_bad_counts():
    with pytest.raises(ValueError, match="utils.overhead.python_calls"):
        overhead.python_calls(lambda: None, number=0)
