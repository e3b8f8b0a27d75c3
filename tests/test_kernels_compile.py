"""The elementwise kernels compile for a Hopper GPU (sm_90), and their flat path is vectorized.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. This proves, on a
CPU-only machine, what the interpreter cannot: that every kernel variant is valid compiled Triton,
and that the contiguous fast path issues 128-bit loads and stores (``ld.global.v4``) — the
instructions that let a memory-bound kernel approach copy bandwidth.
"""

from __future__ import annotations

import textwrap

import pytest

from utils.aot import run_compiled

SCRIPT = textwrap.dedent(
    """
    import sys
    import kernels
    from utils.aot import compile_kernel, vectorized

    SCALARS = {"p": "fp32", "scale": "fp32", "seed": "i64"}
    CASES = [
        (kernels.add_kernel, {}), (kernels.gelu_kernel, {"APPROXIMATE_TANH": False}),
        (kernels.gelu_kernel, {"APPROXIMATE_TANH": True}), (kernels.gelu_backward_kernel, {"APPROXIMATE_TANH": True}),
        (kernels.silu_kernel, {}), (kernels.silu_backward_kernel, {}), (kernels.swiglu_kernel, {}),
        (kernels.swiglu_backward_kernel, {}), (kernels.dropout_kernel, {}), (kernels.dropout_mask_kernel, {}),
    ]
    failures = []
    for fn, constexprs in CASES:
        for dtype, contiguous, index_64 in (("bf16", True, False), ("fp32", False, True)):
            int_type = "i64" if index_64 else "i32"
            pointer = "*i1" if fn is kernels.dropout_mask_kernel else "*" + dtype
            compiled = compile_kernel(
                fn, lambda name: pointer if name.endswith("_ptr") else SCALARS.get(name, int_type),
                {**constexprs, "CONTIGUOUS": contiguous, "INDEX_64": index_64, "BLOCK": 1024},
                divisible={"n_elements"},  # as the launcher marks sizes divisible by 16
            )
            ptx = compiled.asm["ptx"]
            wide = vectorized(ptx, loads=fn is not kernels.dropout_mask_kernel) or (
                fn is kernels.dropout_mask_kernel and "st.global.v" in ptx)
            if contiguous and not wide:
                failures.append(f"{fn.__name__} {constexprs}: flat path not vectorized")
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_flat_path_is_vectorized(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
