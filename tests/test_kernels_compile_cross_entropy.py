"""The cross-entropy kernels compile for a Hopper GPU (sm_90), with vectorized loads and stores.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. Each switch of
the kernels is compiled at least once, in bf16 and fp32 logits: with and without the gradient pass
(and label smoothing), one block per row (short rows stacked ``ROWS`` high) and the chunked
long-row loop, contiguous (the launcher specializes a column stride of 1) and strided with int64
column offsets. The contiguous ones must read the logits with 128-bit loads (``ld.global.v4``)
and write the gradient with vector stores: what a memory-bound row op needs to approach copy
bandwidth.
"""

from __future__ import annotations

import textwrap

import pytest

from utils.aot import run_compiled

SCRIPT = textwrap.dedent(
    """
    import importlib, sys
    from utils.aot import compile_kernel, vectorized
    ce = importlib.import_module("kernels.cross_entropy")  # the module; kernels.cross_entropy is the op

    FLOATS = {"label_smoothing", "grad_scale"}
    # Divisible by 16, as Triton's launcher specializes them for torch allocations and 128k rows.
    ALIGNED = {"n_cols", "x_s0", "x_s1", "x_s2", "g_s0", "g_s1", "g_s2"}

    def compile_ptx(fn, pointers, constexprs, ones, num_warps):
        types = lambda name: "*" + pointers[name] if name.endswith("_ptr") else ("fp32" if name in FLOATS else "i32")
        return compile_kernel(fn, types, constexprs, ones=ones, divisible=ALIGNED, num_warps=num_warps).asm["ptx"]

    failures = []
    LONG, SHORT = (4, 131072), (64, 256)  # chunked long rows; short rows stacked ROWS high
    # (dtype, gradient pass?, rows x classes, contiguous?): every switch of the kernel, both dtypes.
    FORWARD = [("bf16", grad, shape, True) for grad in (False, True) for shape in (LONG, SHORT)]
    FORWARD += [("bf16", True, LONG, False), ("fp32", False, LONG, True), ("fp32", True, SHORT, True)]
    for dtype, grad, shape, contiguous in FORWARD:
        config = ce.cross_entropy_launch_config(*shape)
        pointers = {"logits_ptr": dtype, "target_ptr": "i64", "loss_ptr": "fp32", "grad_ptr": dtype}
        constexprs = {"COMPUTE_GRAD": grad, "SMOOTHING": grad, "ONE_CHUNK": config.one_chunk,
                      "INDEX_64": not contiguous, "ROWS": config.rows, "BLOCK": config.block}
        ones = ("x_cs", "g_cs") if contiguous else ()
        ptx = compile_ptx(ce.cross_entropy_forward_kernel, pointers, constexprs, ones, config.num_warps)
        what = f"forward {dtype} grad={grad} {config}"
        if contiguous and not vectorized(ptx, stores=False):
            failures.append(what + ": logits loads not vectorized")
        if contiguous and grad and not ("st.global.v4" in ptx or "st.global.v2" in ptx):
            failures.append(what + ": gradient stores not vectorized")
    for dtype, contiguous in (("bf16", True), ("fp32", False)):
        config = ce.cross_entropy_launch_config(*LONG)
        ptx = compile_ptx(ce.cross_entropy_backward_kernel, {"grad_ptr": dtype, "scale_ptr": dtype},
                          {"INDEX_64": not contiguous, "ROWS": config.rows, "BLOCK": config.block},
                          ("g_cs",) if contiguous else (), config.num_warps)
        if contiguous and not vectorized(ptx):
            failures.append(f"backward {dtype}: not vectorized")
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_cross_entropy_kernels_compile_for_sm90_and_vectorize(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
