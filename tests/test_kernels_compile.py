"""The elementwise kernels compile for a Hopper GPU (sm_90), and their flat path is vectorized.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. This proves, on a
CPU-only machine, what the interpreter cannot: that every kernel variant is valid compiled Triton,
and that the contiguous fast path issues 128-bit loads and stores (``ld.global.v4``) — the
instructions that let a memory-bound kernel approach copy bandwidth.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, re, sys
    os.environ["KERNEL_LADDER_INTERPRET"] = "0"  # compiled mode: real @triton.jit kernels
    import kernels, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

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
            signature = {}
            for i, name in enumerate(fn.arg_names):
                if fn.params[i].is_constexpr:
                    signature[name] = "constexpr"
                elif name.endswith("_ptr"):
                    signature[name] = "*i1" if fn is kernels.dropout_mask_kernel else "*" + dtype
                else:
                    signature[name] = SCALARS.get(name, int_type)
            # What Triton's launcher specializes for torch allocations and sizes divisible by 16.
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                     if name.endswith("_ptr") or name == "n_elements"}
            source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                               constexprs={**constexprs, "CONTIGUOUS": contiguous, "INDEX_64": index_64, "BLOCK": 1024})
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
            wide = "st.global.v" in ptx and (fn is kernels.dropout_mask_kernel or "ld.global.v4" in ptx)
            if contiguous and not wide:
                failures.append(f"{fn.__name__} {constexprs}: flat path not vectorized")
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_flat_path_is_vectorized(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    # This process runs the interpreter (TRITON_INTERPRET=1); the child must not inherit it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
