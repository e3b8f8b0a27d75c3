"""Compile every elementwise kernel for sm_90; the flat (contiguous) path must issue 128-bit accesses.

Run by tests/test_kernels_compile.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

import kernel_ladder
from utils.aot import compile_kernel, vectorized

SCALARS = {"p": "fp32", "scale": "fp32", "seed": "i64"}
CASES = [
    (kernel_ladder.add_kernel, {}), (kernel_ladder.gelu_kernel, {"ACTIVATION": "gelu"}),
    (kernel_ladder.gelu_kernel, {"ACTIVATION": "gelu_tanh"}),
    (kernel_ladder.gelu_backward_kernel, {"ACTIVATION": "gelu"}),
    (kernel_ladder.gelu_backward_kernel, {"ACTIVATION": "gelu_tanh"}),
    *[(kernel_ladder.linear_activation_backward_kernel, {"ACTIVATION": a}) for a in ("relu", "gelu", "gelu_tanh",
                                                                                     "silu")],
    (kernel_ladder.silu_kernel, {}), (kernel_ladder.silu_backward_kernel, {}), (kernel_ladder.swiglu_kernel, {}),
    (kernel_ladder.swiglu_backward_kernel, {}), (kernel_ladder.dropout_kernel, {}),
    (kernel_ladder.dropout_mask_kernel, {}),
]
failures = []
for fn, constexprs in CASES:
    for dtype, contiguous, index_64 in (("bf16", True, False), ("fp32", False, True)):
        int_type = "i64" if index_64 else "i32"
        pointer = "*i1" if fn is kernel_ladder.dropout_mask_kernel else "*" + dtype
        compiled = compile_kernel(
            fn, lambda name: pointer if name.endswith("_ptr") else SCALARS.get(name, int_type),
            {**constexprs, "CONTIGUOUS": contiguous, "INDEX_64": index_64, "BLOCK": 1024},
            divisible={"n_elements"},  # as the launcher marks sizes divisible by 16
        )
        ptx = compiled.asm["ptx"]
        wide = vectorized(ptx, loads=fn is not kernel_ladder.dropout_mask_kernel) or (
            fn is kernel_ladder.dropout_mask_kernel and "st.global.v" in ptx)
        if contiguous and not wide:
            failures.append(f"{fn.__name__} {constexprs}: flat path not vectorized")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
