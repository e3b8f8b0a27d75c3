"""utils.aot: ahead-of-time compilation for a GPU this machine lacks, and what it reads from the result."""

from __future__ import annotations

import textwrap

import pytest

from utils.aot import Usage, run_compiled, vectorized

SCRIPT = textwrap.dedent(
    """
    import sys
    import triton, triton.language as tl
    from utils.aot import compile_kernel, resource_usage, vectorized

    @triton.jit
    def copy_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets * stride, mask=mask), mask=mask)

    types = lambda name: "*fp32" if name.endswith("_ptr") else "i32"
    unit = compile_kernel(copy_kernel, types, {"BLOCK": 1024}, ones={"stride"}, divisible={"n"})
    strided = compile_kernel(copy_kernel, types, {"BLOCK": 1024}, divisible={"n"})
    usage = resource_usage(unit)
    print(vectorized(unit.asm["ptx"]), vectorized(strided.asm["ptx"]), usage is None or usage.spilled_bytes == 0)
    """
)


@pytest.mark.slow
def test_a_unit_stride_specialized_like_the_launcher_vectorizes_and_a_runtime_stride_does_not(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True"]  # the strided load is the negative control


def test_vectorized_reads_128_bit_accesses_from_ptx():
    assert vectorized("ld.global.v4.b32 ...\nst.global.v4.b32 ...")
    assert not vectorized("ld.global.b32 ...\nst.global.v4.b32 ...")
    assert vectorized("ld.global.nc.v4.b32", stores=False) and not vectorized("st.global.b32", loads=False)
    assert Usage(registers=32, spilled_bytes=0).spilled_bytes == 0
