"""utils.aot: ahead-of-time compilation for a GPU this machine lacks, and what it reads from the result."""

from __future__ import annotations

import textwrap

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from utils.aot import Usage, launch_specialization, record_launches, run_compiled, vectorized

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


def _specialized_kernel(x_ptr, out_ptr, n, stride, length, scale, flag, BLOCK: tl.constexpr):
    pass


def _jit(**kwargs):
    # A JITFunction built directly: this process interprets kernels, and an interpreted kernel has no
    # parameter list; the launcher's rules are what is tested, nothing is compiled.
    return JITFunction(_specialized_kernel, **kwargs)


def test_launch_specialization_follows_the_launchers_rules():
    x = torch.empty(64, dtype=torch.bfloat16)
    values = dict(x_ptr=x, out_ptr=x[1:], n=128, stride=1, length=100, scale=0.5, flag=True)
    spec = launch_specialization(_jit(), values)
    assert spec.types == dict(x_ptr="*bf16", out_ptr="*bf16", n="i32", stride="i32", length="i32", scale="fp32",
                              flag="i1")
    assert spec.ones == {"stride"}  # an int equal to 1 becomes a constant
    assert spec.divisible == {"x_ptr", "n"}  # 128 is divisible by 16, x[1:] is 2 bytes off the 16-byte boundary
    big = launch_specialization(_jit(), {**values, "n": 2**31, "out_ptr": "*fp32"})
    assert big.types["n"] == "i64" and big.types["out_ptr"] == "*fp32" and {"n", "out_ptr"} <= big.divisible
    plain = launch_specialization(_jit(do_not_specialize=["n", "stride"]), values)
    assert plain.ones == set() and plain.divisible == {"x_ptr"}  # do_not_specialize: neither


def test_launch_specialization_agrees_with_tritons_own_launcher():
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    x = torch.empty(64, dtype=torch.float16)
    for value in (1, 0, 16, 128, 100, -16, -1, 2**31 - 1, 2**31, x, x[3:]):
        spec = launch_specialization(_jit(), {"x_ptr": x, "out_ptr": x, "n": value, "stride": 2, "length": 3,
                                              "scale": 1.0, "flag": False})
        kind, attr = native(BaseBackend, value, False, True, True)[:2]
        if kind == "constexpr":
            assert "n" in spec.ones
        else:
            assert spec.types["n"] == kind and ("n" in spec.divisible) == (attr == "D"), value


def test_launch_specialization_refuses_a_forgotten_argument_or_an_unknown_value():
    with pytest.raises(ValueError, match=r"utils.aot.launch_specialization: .*missing \['flag'\]"):
        launch_specialization(_jit(), dict(x_ptr="*fp32", out_ptr="*fp32", n=1, stride=1, length=1, scale=1.0))
    with pytest.raises(TypeError, match="x_ptr got 'fp32'"):
        launch_specialization(_jit(), dict(x_ptr="fp32", out_ptr="*fp32", n=1, stride=1, length=1, scale=1.0,
                                           flag=True))


def test_record_launches_captures_a_launchers_arguments_without_running():
    import types

    kernel = _jit()
    module = types.SimpleNamespace(copy_kernel=kernel)
    x = torch.zeros(8)
    with record_launches(module, "copy_kernel") as launches:
        module.copy_kernel[(2,)](x, x, 8, 1, 5, 0.25, True, BLOCK=4, num_warps=8)
    assert module.copy_kernel is kernel and x.eq(0).all()
    (launch,) = launches
    assert launch.grid == (2,) and launch.num_warps == 8 and launch.num_stages is None
    assert launch.constexprs == {"BLOCK": 4} and launch.values["length"] == 5 and launch.values["x_ptr"] is x
    assert launch_specialization(kernel, launch.values).ones == {"stride"}
