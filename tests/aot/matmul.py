"""Compile the matmul kernels for sm_90: fp16/bf16 tiles become wgmma, TF32 becomes mma, IEEE fp32 FMAs.

Every case is compiled at the specialization a launch gives it. Triton's launcher turns an integer argument
equal to 1 into a constant and marks those divisible by 16, so the operands' layout decides the code: which
strides are 1 says along which dimension loads can be 128-bit (or cp.async) vectors. The layouts:

* ``matmul``: row-major A and B (``kernel_ladder.matmul`` of contiguous tensors): A's, B's and C's last
  strides are 1;
* ``linear``: B is a weight's transpose (``x @ W.t()``, ``kernel_ladder.linear``): A's and B's K strides are 1;
* ``grad_w``: A is a transpose (``dW = X.t() @ G``, a fused linear cross-entropy's weight gradient);
* ``strided``: no unit stride in A or B (strided views, e.g. every other column): every element is its own
  2-byte load, the loads are not pipelined, and each thread addresses 64 elements per K step at 128 x 128 x 64.
  C is contiguous in every layout: the launchers allocate it.

No case may spill registers, and the launched layouts keep a margin under the 255-register limit
(:data:`REGISTER_BUDGET`). Each case prints its registers, spills, and its steady K loop's warp-instructions.

Run by tests/test_kernels_compile_matmul.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

from kernel_ladder.ops import matmul as mm
from utils import sass
from utils.aot import compile_kernel, resource_usage

#: The registers per thread a case in a launched layout (not ``strided``) may use: 31 under the limit.
REGISTER_BUDGET = 224

UNIT_STRIDES = {
    "matmul": ("stride_ak", "stride_bn", "stride_cn", "stride_bias"),
    "linear": ("stride_ak", "stride_bk", "stride_cn", "stride_bias"),
    "grad_w": ("stride_am", "stride_bn", "stride_cn", "stride_bias"),
    "strided": ("stride_cn", "stride_bias"),
}
# Sizes divisible by 16 (4096, ...), batch strides (0 for one matrix), the split-K slice (a multiple of BLOCK_K).
DIVISIBLE = ("M", "N", "K", "stride_ab", "stride_am", "stride_ak", "stride_bb", "stride_bk", "stride_bn",
             "stride_cb", "stride_cm", "K_PER_SPLIT")


def compile_one(fn, dtype, constexprs, layout, num_warps=8, num_stages=3, out_dtype=None):
    def types(name):
        if name == "ws_ptr":
            return "*fp32"
        if name in ("c_ptr", "preact_ptr"):
            return "*" + (out_dtype or dtype)
        return "*" + dtype if name.endswith("_ptr") else "i32"

    if "ACCUMULATE" in fn.arg_names:
        constexprs = {"ACCUMULATE": False, **constexprs}  # C = A @ B unless a case asks for C += A @ B
    ones = [name for name in UNIT_STRIDES[layout] if name in fn.arg_names and name not in constexprs]
    return compile_kernel(fn, types, constexprs, ones=ones, divisible=DIVISIBLE, num_warps=num_warps,
                          num_stages=num_stages)


TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
TILE32 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
EPI_NONE = dict(HAS_BIAS=False, ACTIVATION="none", STORE_PREACT=False)
GELU_PREACT = dict(HAS_BIAS=True, ACTIVATION="gelu", STORE_PREACT=True)
RELU_BIAS = dict(HAS_BIAS=True, ACTIVATION="relu", STORE_PREACT=False)
# (kernel, dtype, constexprs, layout, expect, num_stages): expect "wgmma", "mma" (any tensor-core op),
# "fma" (none) or "any".
CASES = [
    (mm.matmul_kernel, "fp16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "INDEX_64": False}, "matmul", "wgmma", 3),
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "INDEX_64": False}, "strided", "wgmma", 3),
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", **GELU_PREACT,
                                 "INDEX_64": False}, "linear", "wgmma", 3),
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", **GELU_PREACT,
                                 "INDEX_64": False}, "strided", "wgmma", 3),
    (mm.matmul_kernel, "bf16", {**TILE, "GROUP_M": 1, "EVEN_K": True, "INPUT_PRECISION": "ieee",
                                 "HAS_BIAS": True, "ACTIVATION": "silu", "STORE_PREACT": False,
                                 "INDEX_64": True}, "linear", "wgmma", 3),
    (mm.matmul_kernel, "fp32", {**TILE32, "EVEN_K": False, "INPUT_PRECISION": "tf32", **RELU_BIAS,
                                 "INDEX_64": False}, "matmul", "mma", 3),
    (mm.matmul_kernel, "fp32", {**TILE32, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "INDEX_64": True}, "matmul", "fma", 3),
    (mm.matmul_kernel, "fp32", {**TILE32, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "INDEX_64": True}, "strided", "fma", 3),
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "HAS_BIAS": False,
                                 "ACTIVATION": "gelu_tanh", "STORE_PREACT": True, "INDEX_64": False},
     "linear", "wgmma", 3),
    # Integer arguments equal to 1 reach the compiler as constants (a one-row problem, unit strides).
    (mm.matmul_kernel, "bf16", {**TILE, "BLOCK_M": 16, "EVEN_K": False, "INPUT_PRECISION": "ieee",
                                 "HAS_BIAS": True, "ACTIVATION": "gelu", "STORE_PREACT": False,
                                 "INDEX_64": False, "M": 1, "K": 1, "stride_ak": 1, "stride_bn": 1,
                                 "stride_cn": 1, "stride_bias": 1}, "matmul", "any", 3),
    (mm.matmul_persistent_kernel, "fp16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", **RELU_BIAS,
                                            "INDEX_64": False}, "matmul", "wgmma", 3),
    (mm.matmul_persistent_kernel, "fp16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", **RELU_BIAS,
                                            "INDEX_64": False}, "strided", "wgmma", 3),
    (mm.matmul_persistent_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                            "INDEX_64": False}, "matmul", "wgmma", 3),
    (mm.matmul_persistent_kernel, "fp32", {**TILE32, "EVEN_K": True, "INPUT_PRECISION": "tf32", **EPI_NONE,
                                            "INDEX_64": True}, "matmul", "mma", 3),
    # C += A @ B into an fp32 gradient buffer (the fused linear cross-entropy's weight gradient)
    (mm.matmul_kernel, "bf16", {**TILE, "EVEN_K": False, "INPUT_PRECISION": "ieee", **EPI_NONE,
                                 "ACCUMULATE": True, "INDEX_64": False}, "grad_w", "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
                                         "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": False},
     "linear", "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
                                         "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": False},
     "strided", "wgmma", 3),
    (mm.matmul_split_k_kernel, "fp32", {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                                         "EVEN_K": False, "INPUT_PRECISION": "tf32", "INDEX_64": True},
     "strided", "mma", 3),
]
# Short-M, long-K split-K (default_config(M > 64, ..., "split_k") on a GPU; a fused linear cross-entropy's
# grad_x = G @ W, both row-major): 128 x 128 tiles, 8 warps; BLOCK_K 64 and 3 stages for a K of whole 64-slices
# (V = 128,256), 32 and 4 for a ragged K or fp32.
TILE_RAGGED = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
CASES += [
    (mm.matmul_split_k_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": False},
     "matmul", "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": True},
     "matmul", "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {**TILE, "EVEN_K": True, "INPUT_PRECISION": "ieee", "INDEX_64": True},
     "strided", "wgmma", 3),
    (mm.matmul_split_k_kernel, "bf16", {**TILE_RAGGED, "EVEN_K": False, "INPUT_PRECISION": "ieee",
                                         "INDEX_64": True}, "matmul", "wgmma", 4),
    (mm.matmul_split_k_kernel, "fp32", {**TILE_RAGGED, "EVEN_K": False, "INPUT_PRECISION": "tf32",
                                         "INDEX_64": True}, "matmul", "mma", 4),
]
failures = []
for fn, dtype, constexprs, layout, expect, stages in CASES:
    warps = 4 if constexprs["BLOCK_M"] <= 64 else 8
    compiled = compile_one(fn, dtype, constexprs, layout, num_warps=warps, num_stages=stages)
    ptx = compiled.asm["ptx"]
    tensor_cores = "mma" in ptx  # mma.sync or wgmma.mma_async
    ok = {"wgmma": "wgmma.mma_async" in ptx, "mma": tensor_cores, "fma": not tensor_cores, "any": True}[expect]
    name = f"{fn.__name__} {dtype} {layout} {constexprs}"
    if not ok:
        failures.append(f"{name}: expected {expect}")
    usage = resource_usage(compiled)
    if usage is None:
        continue
    loop = sass.steady_loop(sass.parse(sass.disassemble(compiled)))
    print(f"{fn.__name__} {dtype} {layout} {constexprs['BLOCK_M']}x{constexprs['BLOCK_N']}x{constexprs['BLOCK_K']} "
          f"w{warps} s{stages}: {usage.registers} registers, {usage.spilled_bytes} bytes spilled, "
          f"{len(loop.instructions) if loop else 0} warp-instructions per K step")
    if usage.spilled_bytes:
        failures.append(f"{name}: spills {usage.spilled_bytes} bytes")
    if layout != "strided" and usage.registers > REGISTER_BUDGET:
        failures.append(f"{name}: {usage.registers} registers, over the budget of {REGISTER_BUDGET}")
for dtype, out_dtype, epilogue in (("bf16", "bf16", GELU_PREACT), ("fp32", "fp32", EPI_NONE)):
    for index_64 in (False, True):
        compiled = compile_one(mm.matmul_split_k_reduce_kernel, dtype,
                               {**epilogue, "INDEX_64": index_64, "BLOCK_M": 16, "BLOCK_N": 64}, "matmul",
                               num_warps=4, out_dtype=out_dtype)
        usage = resource_usage(compiled)
        if usage is not None and usage.spilled_bytes:
            failures.append(f"matmul_split_k_reduce_kernel {dtype} INDEX_64={index_64}: spills")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
