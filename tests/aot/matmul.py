"""Compile the matmul kernels for sm_90: fp16/bf16 tiles become wgmma, TF32 becomes mma, IEEE fp32 FMAs.

The split-K kernel at the 128 x 128 tiles its short-M, long-K problems get on a GPU (a fused linear
cross-entropy's grad_x) must also compile without spilling registers.

Run by tests/test_kernels_compile_matmul.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

from kernel_ladder.ops import matmul as mm
from utils.aot import compile_kernel, resource_usage


def compile_one(fn, dtype, constexprs, num_warps=8, num_stages=3, out_dtype=None):
    def types(name):
        if name == "ws_ptr":
            return "*fp32"
        if name in ("c_ptr", "preact_ptr"):
            return "*" + (out_dtype or dtype)
        return "*" + dtype if name.endswith("_ptr") else "i32"

    # What Triton's launcher specializes for torch allocations and sizes divisible by 16.
    divisible = ("M", "N", "K", "stride_am", "stride_bk", "stride_cm")
    if "ACCUMULATE" in fn.arg_names:
        constexprs = {"ACCUMULATE": False, **constexprs}  # C = A @ B unless a case asks for C += A @ B
    return compile_kernel(fn, types, constexprs, divisible=divisible, num_warps=num_warps, num_stages=num_stages)


TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
TILE32 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
EPI_NONE = dict(HAS_BIAS=False, ACTIVATION="none", STORE_PREACT=False)
# (kernel, dtype, constexprs, expect): "wgmma", "mma" (any tensor-core op), "fma" (none) or "any".
CASES = [
    (mm.matmul_kernel, "fp16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "INDEX_64": False}, "wgmma"),
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", "HAS_BIAS": True,
                                 "ACTIVATION": "gelu", "STORE_PREACT": True, "INDEX_64": False}, "wgmma"),
    (mm.matmul_kernel, "bf16", {**TILE, "GROUP_M": 1, "EVEN_K": True, "INPUT_PRECISION": "ieee",
                                 "HAS_BIAS": True, "ACTIVATION": "silu", "STORE_PREACT": False,
                                 "INDEX_64": True}, "wgmma"),
    (mm.matmul_kernel, "fp32", {**TILE32, "EVEN_K": False, "INPUT_PRECISION": "tf32", "HAS_BIAS": True,
                                 "ACTIVATION": "relu", "STORE_PREACT": False, "INDEX_64": False}, "mma"),
    (mm.matmul_kernel, "fp32", {**TILE32, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "INDEX_64": True}, "fma"),
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "HAS_BIAS": False,
                                 "ACTIVATION": "gelu_tanh", "STORE_PREACT": True, "INDEX_64": False}, "wgmma"),
    # Integer arguments equal to 1 reach the compiler as constants (a one-row problem, unit strides).
    (mm.matmul_kernel, "bf16", {**TILE, "BLOCK_M": 16, "EVEN_K": False, "INPUT_PRECISION": "ieee",
                                 "HAS_BIAS": True, "ACTIVATION": "gelu", "STORE_PREACT": False,
                                 "INDEX_64": False, "M": 1, "K": 1, "stride_ak": 1, "stride_bn": 1,
                                 "stride_cn": 1, "stride_bias": 1}, "any"),
    (mm.matmul_persistent_kernel, "fp16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee",
                                            "HAS_BIAS": True, "ACTIVATION": "relu", "STORE_PREACT": False,
                                            "INDEX_64": False}, "wgmma"),
    (mm.matmul_persistent_kernel, "fp32", {**TILE32, "EVEN_K": True, "INPUT_PRECISION": "tf32", **EPI_NONE,
                                            "INDEX_64": True}, "mma"),
    # C += A @ B into an fp32 gradient buffer (the fused linear cross-entropy's weight gradient)
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "ACCUMULATE": True, "INDEX_64": False}, "wgmma"),
    (mm.matmul_split_k_kernel, "bf16", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
                                         "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": False}, "wgmma"),
    (mm.matmul_split_k_kernel, "fp32", {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                                         "EVEN_K": False, "INPUT_PRECISION": "tf32", "INDEX_64": True}, "mma"),
]
# Short-M, long-K split-K (default_config(M > 64, ..., "split_k") on a GPU): 128 x 128 tiles, 8 warps; BLOCK_K 64
# and 3 stages for a K of whole 64-slices (V = 128,256), 32 and 4 for a ragged K or fp32. No spills allowed.
TILE_RAGGED = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
NO_SPILL_CASES = [  # (kernel, dtype, constexprs, expect, num_stages)
    (mm.matmul_split_k_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": False},
     "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": True},
     "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {**TILE_RAGGED, "EVEN_K": False, "INPUT_PRECISION": "ieee",
                                         "INDEX_64": True}, "wgmma", 4),
    (mm.matmul_split_k_kernel, "fp32", {**TILE_RAGGED, "EVEN_K": False, "INPUT_PRECISION": "tf32",
                                         "INDEX_64": True}, "mma", 4),
]
failures = []
for fn, dtype, constexprs, expect, stages in [(*case, 3) for case in CASES] + NO_SPILL_CASES:
    warps = 4 if constexprs["BLOCK_M"] <= 64 else 8
    compiled = compile_one(fn, dtype, constexprs, num_warps=warps, num_stages=stages)
    ptx = compiled.asm["ptx"]
    tensor_cores = "mma" in ptx  # mma.sync or wgmma.mma_async
    ok = {"wgmma": "wgmma.mma_async" in ptx, "mma": tensor_cores, "fma": not tensor_cores, "any": True}[expect]
    if not ok:
        failures.append(f"{fn.__name__} {dtype} {constexprs}: expected {expect}")
    usage = resource_usage(compiled)
    if usage is not None:
        print(f"{fn.__name__} {dtype} {constexprs['BLOCK_M']}x{constexprs['BLOCK_N']}x{constexprs['BLOCK_K']} "
              f"w{warps} s{stages}: {usage.registers} registers, {usage.spilled_bytes} bytes spilled")
        if usage.spilled_bytes and (fn, dtype, constexprs, expect, stages) in NO_SPILL_CASES:
            failures.append(f"{fn.__name__} {dtype} {constexprs}: spills {usage.spilled_bytes} bytes")
for dtype, out_dtype, epilogue in (("bf16", "bf16", dict(HAS_BIAS=True, ACTIVATION="gelu", STORE_PREACT=True)),
                                   ("fp32", "fp32", dict(EPI_NONE))):
    for index_64 in (False, True):
        compile_one(mm.matmul_split_k_reduce_kernel, dtype,
                    {**epilogue, "INDEX_64": index_64, "BLOCK_M": 16, "BLOCK_N": 64}, num_warps=4,
                    out_dtype=out_dtype)
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
