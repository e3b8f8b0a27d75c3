"""Compile the gated-MLP kernels for sm_90 at the tiles gated_config picks: the forward's two and the
backward's three fp32 accumulators stay in registers (no spills), and 16-bit dots run on wgmma.

Run by tests/test_kernels_compile_gated_mlp.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

import torch

from kernel_ladder.ops import gated_mlp as gm
from utils.aot import compile_kernel, resource_usage

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
UNIT = {"stride_xh", "stride_gh", "stride_uh", "stride_gk", "stride_uk", "stride_df", "size1", "size2"}

failures, count = [], 0
for kernel, backward in ((gm.gated_mlp_kernel, False), (gm.gated_mlp_backward_kernel, True)):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for activation in ("silu", "gelu_tanh"):
            config = gm.gated_config(4096, 14336, 4096, dtype, backward=backward)  # Llama-3-8B's MLP
            constexprs = {"ACTIVATION": activation, "INPUT_PRECISION": "tf32" if dtype == torch.float32 else "ieee",
                          "EVEN_K": True, **config.meta}

            def types(name, dtype=dtype):
                return "*" + TYPES[dtype] if name.endswith("_ptr") else "i32"

            what = f"{kernel.__name__} {TYPES[dtype]} {activation} {config}"
            compiled = compile_kernel(kernel, types, constexprs, ones=[n for n in kernel.arg_names if n in UNIT],
                                      divisible=lambda name: name not in UNIT, **config.launch_options)
            count += 1
            usage = resource_usage(compiled)
            if usage is not None and usage.spilled_bytes:
                failures.append(f"{what}: spills {usage.spilled_bytes} bytes")
            ptx = compiled.asm["ptx"]
            if dtype != torch.float32 and "wgmma.mma_async" not in ptx and "mma.sync" not in ptx:
                failures.append(f"{what}: no tensor-core dot")
config = gm.gated_config(4096, 4096, 14336, torch.bfloat16)
compile_kernel(gm.dual_matmul_kernel, lambda name: "*bf16" if name.endswith("_ptr") else "i32",
               {"INPUT_PRECISION": "ieee", "EVEN_K": True, "INDEX_64": False, **config.meta}, **config.launch_options)
count += 1
print(f"{count} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
