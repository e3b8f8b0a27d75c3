"""Compile the RoPE kernel for sm_90: every switch (rotate-half / interleaved, forward / backward, partial
rotary, the fused QK-norm of q and k), bf16 and fp32, without register spills; contiguous rotate-half halves
load 128 bits at a time.

Run by tests/test_kernels_compile_rope.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

from kernel_ladder import _launch
from kernel_ladder.ops import rope as rope_module
from utils.aot import compile_kernel, resource_usage

# What Triton's launcher specializes: unit feature strides become constants; sizes and strides of
# real shapes (D = 128, H * D, T * H * D) are divisible by 16.
UNIT = {"stride_qd", "stride_kd", "stride_qod", "stride_kod", "stride_cd", "stride_sd", "stride_qsd", "stride_ksd",
        "stride_qw", "stride_kw"}
UNSPECIALIZED = {"n_units", "batch", "seq_len", "units_per_program", "n_heads_q", "n_heads_k", "stride_cb", "stride_sb",
                 "norm_eps", "norm_offset"}
FP32 = {"cos_ptr", "sin_ptr", "dq_weight_ptr", "dk_weight_ptr"}

failures, compiled_count = [], 0
# (rest, shared, norm): full rotary; partial rotary with a shared table; Qwen3's QK-norm of q and k
# (head dim 128, 64 query and 8 key heads: the launcher's head tiles, halved for the norm's backward).
for dtype in ("bf16", "fp32"):
    for interleaved in (False, True):
        for backward in (False, True):
            for rest, shared, norm in ((False, False, False), (True, True, False), (False, False, True),
                                       (True, False, True)):
                half = 32 if rest else 64  # head dim 128: full rotary, or R = 64 (partial)
                heads_q = 16 if norm and backward else 32
                constexprs = {"INTERLEAVED": interleaved, "BACKWARD": backward, "HAS_REST": rest,
                              "SHARED_TABLE": shared, "NORM_Q": norm, "NORM_K": norm, "BLOCK_HQ": heads_q,
                              "BLOCK_HK": 8, "BLOCK_HALF": half, "BLOCK_REST": 64 if rest else 1}

                def types(name):
                    if name in FP32:
                        return "*fp32"
                    if name in ("norm_eps", "norm_offset"):
                        return "fp32"
                    return "*" + dtype if name.endswith("_ptr") else "i32"

                what = f"rope {dtype} interleaved={interleaved} backward={backward} partial={rest} norm={norm}"
                # the launcher's warps for this tile
                warps = _launch.num_warps_for(heads_q * rope_module._held_features(half, 64 if rest else 1, rest, norm))
                try:
                    kernel = compile_kernel(rope_module.rope_kernel, types, constexprs, ones=UNIT,
                                            divisible=lambda name: name not in UNSPECIALIZED and name not in UNIT,
                                            num_warps=warps)
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
