"""Compile the routing kernels for sm_90 at the launcher's blocks for real routers, with no register spills:
Mixtral (8 experts, top-2, softmax), Qwen3-MoE (128, top-8, softmax), GPT-OSS-20b (32, top-4), and DeepSeek-V3
(256 experts, top-8, sigmoid with the correction bias, 8 groups of 32 of which 4 are kept); the backward at the
same sizes, with DeepSeek's scale.

Run by tests/test_kernels_compile_topk_routing.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

from kernel_ladder.ops import topk_routing as tr
from utils.aot import compile_kernel, resource_usage

failures, count = [], 0
ROUTERS = [  # (experts, k, sigmoid, bias, groups, kept groups)
    (8, 2, False, False, 1, 1), (128, 8, False, False, 1, 1), (32, 4, False, False, 1, 1), (256, 8, True, True, 8, 4),
]


def types(name):
    if name in ("ids_ptr",):
        return "*i64"
    if name in ("x_ptr", "w_ptr", "dw_ptr", "bias_ptr", "dx_ptr"):
        return "*fp32"
    return "fp32" if name == "scale" else "i32"


for experts, k, sigmoid, bias, groups, kept in ROUTERS:
    block_t, block_e, block_k, warps, block_g, block_s = tr._config(8192, experts, k, groups)
    common = {"K": k, "BLOCK_T": block_t, "BLOCK_E": block_e, "BLOCK_K": block_k, "SIGMOID": sigmoid,
              "RENORMALIZE": True}
    forward = {**common, "HAS_BIAS": bias, "GROUPED": groups > 1, "TOPK_GROUPS": kept, "BLOCK_G": block_g,
               "BLOCK_S": block_s}
    for kernel, constexprs in ((tr.topk_routing_kernel, forward), (tr.topk_routing_backward_kernel, common)):
        unit = [n for n in ("stride_xe", "stride_b", "stride_ik", "stride_dwk") if n in kernel.arg_names]
        compiled = compile_kernel(kernel, types, constexprs, ones=unit,
                                  divisible=lambda name, unit=unit: name not in unit and name != "n_tokens",
                                  num_warps=warps)
        count += 1
        usage = resource_usage(compiled)
        if usage is not None and usage.spilled_bytes:
            failures.append(f"{kernel.__name__} E={experts} k={k} groups={groups}: spills {usage.spilled_bytes} bytes")
print(f"{count} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
