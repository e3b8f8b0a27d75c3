"""Compile the RoPE kernel for sm_90: every switch (rotate-half / interleaved, forward / backward, partial
rotary), bf16 and fp32, without register spills; contiguous rotate-half halves load 128 bits at a time.

Run by tests/test_kernels_compile_rope.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

from kernel_ladder.ops import rope as rope_module
from utils.aot import compile_kernel, resource_usage

# What Triton's launcher specializes: unit feature strides become constants; sizes and strides of
# real shapes (D = 128, H * D, T * H * D) are divisible by 16.
UNIT = {"stride_qd", "stride_kd", "stride_qod", "stride_kod", "stride_cd", "stride_sd"}
UNSPECIALIZED = {"n_units", "batch", "seq_len", "units_per_program", "n_heads_q", "n_heads_k", "stride_cb", "stride_sb"}

failures, compiled_count = [], 0
for dtype in ("bf16", "fp32"):
    for interleaved in (False, True):
        for backward in (False, True):
            for rest, shared in ((False, False), (True, True)):
                half = 32 if rest else 64  # head dim 128: full rotary, or R = 64 (partial)
                constexprs = {"INTERLEAVED": interleaved, "BACKWARD": backward, "HAS_REST": rest,
                              "SHARED_TABLE": shared, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": half,
                              "BLOCK_REST": 64 if rest else 1}

                def types(name):
                    if name in ("cos_ptr", "sin_ptr"):
                        return "*fp32"
                    return "*" + dtype if name.endswith("_ptr") else "i32"

                what = f"rope {dtype} interleaved={interleaved} backward={backward} partial={rest}"
                try:
                    kernel = compile_kernel(rope_module.rope_kernel, types, constexprs, ones=UNIT,
                                            divisible=lambda name: name not in UNSPECIALIZED and name not in UNIT,
                                            num_warps=8)
                except Exception as error:  # noqa: BLE001  (report every variant)
                    failures.append(f"{what}: does not compile: {error}")
                    continue
                compiled_count += 1
                usage = resource_usage(kernel)
                if usage is not None and usage.spilled_bytes:
                    failures.append(f"{what}: spills {usage.spilled_bytes} bytes")
                ptx = kernel.asm["ptx"]
                if dtype == "bf16" and not interleaved and not ("ld.global.v4" in ptx or "ld.global.v2" in ptx):
                    failures.append(f"{what}: contiguous halves not loaded as vectors")
print(f"{compiled_count} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
