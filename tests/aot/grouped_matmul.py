"""Compile the grouped-GEMM kernels for sm_90 at the tiles grouped_config picks: the forward (the in-kernel
tile search over offsets, at 8 and 128 experts) and the weight gradient, in bf16, fp16 and fp32 (TF32),
with no register spills and the 16-bit dots on tensor cores; the int64-offset forward once; and kernel_ladder.moe's
variants (rows gathered through the permutation, the SwiGLU epilogue and its backward, the gathered dw), and its
GPT-OSS and DeepSeek-V3 variants at their sizes: interleaved gate/up weights (a column stride of 2) with biases and
the clamped SwiGLU, forward and backward, the dw kernel with the bias's column sums, the down GEMM with its bias.

Run by tests/test_kernels_compile_grouped_matmul.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

import torch

from kernel_ladder.ops import grouped_matmul as gm
from utils.aot import compile_kernel, resource_usage

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Unit strides of contiguous operands (x (M, K), w (E, K, N), out/dy (M, N), dw (E, K, N)) become constants.
UNIT = {"stride_xk", "stride_wn", "stride_on", "stride_yn", "stride_dn", "stride_bn", "stride_dbn"}
RUNTIME = {"M", "E"}  # the token count changes with every batch; E is small

failures, count = [], 0


def check(kernel, dtype, constexprs, config):
    global count

    def types(name):
        if name in ("offs_ptr", "idx_ptr"):
            return "*i32"
        if name in ("alpha", "limit"):
            return "fp32"
        if name in ("bias_ptr", "db_ptr"):
            return "*fp32" if constexprs.get("HAS_BIAS") else "*" + TYPES[dtype]  # GPT-OSS keeps biases in fp32
        return "*" + TYPES[dtype] if name.endswith("_ptr") else "i32"

    defaults = {"GATHER_K": 0, "EPILOGUE": 0, "HAS_BIAS": False, "CLAMPED": False, "INTERLEAVED": False}
    constexprs = {**{k: v for k, v in defaults.items() if k in kernel.arg_names}, **constexprs}
    what = f"{kernel.__name__} {TYPES[dtype]} {constexprs} {config}"
    compiled = compile_kernel(kernel, types, constexprs, ones=[n for n in kernel.arg_names if n in UNIT],
                              divisible=lambda name: name not in UNIT and name not in RUNTIME,
                              **config.launch_options)
    count += 1
    usage = resource_usage(compiled)
    if usage is not None and usage.spilled_bytes:
        failures.append(f"{what}: spills {usage.spilled_bytes} bytes")
    ptx = compiled.asm["ptx"]
    if dtype != torch.float32 and "wgmma.mma_async" not in ptx and "mma.sync" not in ptx:
        failures.append(f"{what}: no tensor-core dot")


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    precision = "tf32" if dtype == torch.float32 else "ieee"
    config = gm.grouped_config(8192, 2048, 7168, dtype)  # a DeepSeek-V3-sized expert up projection
    tiles = {"BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N, "BLOCK_K": config.BLOCK_K}
    for experts in (8, 128):
        check(gm.grouped_matmul_kernel, dtype, {"BLOCK_E": experts, "EVEN_K": True, "INPUT_PRECISION": precision,
                                                "INDEX_64": False, **tiles}, config)
    dw = gm.grouped_config(8192, 2048, 7168, dtype, backward=True)
    check(gm.grouped_matmul_dw_kernel, dtype, {"INPUT_PRECISION": precision, "INDEX_64": False,
                                               "BLOCK_M": dw.BLOCK_M, "BLOCK_N": dw.BLOCK_N, "BLOCK_K": dw.BLOCK_K},
          dw)
config = gm.grouped_config(8192, 2048, 7168, torch.bfloat16)
check(gm.grouped_matmul_kernel, torch.bfloat16, {"BLOCK_E": 16, "EVEN_K": False, "INPUT_PRECISION": "ieee",
                                                 "INDEX_64": True, "BLOCK_M": config.BLOCK_M,
                                                 "BLOCK_N": config.BLOCK_N, "BLOCK_K": config.BLOCK_K}, config)
for dtype in (torch.bfloat16, torch.float16):  # kernel_ladder.moe at Mixtral's sizes: H = 4096, F = 14336
    config = gm.grouped_config(8192, 14336, 4096, dtype, paired=True)
    tiles = {"BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N, "BLOCK_K": config.BLOCK_K}
    for epilogue in (1, 2):  # the SwiGLU, its backward
        check(gm.grouped_matmul_kernel, dtype, {"BLOCK_E": 8, "EVEN_K": True, "INPUT_PRECISION": "ieee",
                                                "INDEX_64": False, "GATHER_K": 2, "EPILOGUE": epilogue, **tiles},
              config)
    dw = gm.grouped_config(8192, 28672, 4096, dtype, backward=True)
    check(gm.grouped_matmul_dw_kernel, dtype, {"INPUT_PRECISION": "ieee", "INDEX_64": False, "GATHER_K": 2,
                                               "BLOCK_M": dw.BLOCK_M, "BLOCK_N": dw.BLOCK_N, "BLOCK_K": dw.BLOCK_K},
          dw)
for dtype in (torch.bfloat16, torch.float16):
    # GPT-OSS-120b's experts: H = 2880, F = 2880, 128 experts; gate_up_proj (E, H, 2F) interleaved, biases in fp32.
    for epilogue in (1, 2):
        config = gm.grouped_config(8192, 2880, 2880, dtype, paired=True, interleaved=epilogue == 2)
        tiles = {"BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N, "BLOCK_K": config.BLOCK_K}
        check(gm.grouped_matmul_kernel, dtype, {"BLOCK_E": 128, "EVEN_K": True, "INPUT_PRECISION": "ieee",
                                                "INDEX_64": False, "GATHER_K": 4, "EPILOGUE": epilogue,
                                                "HAS_BIAS": True, "CLAMPED": True, "INTERLEAVED": True, **tiles},
              config)
    down = gm.grouped_config(8192, 2880, 2880, dtype)
    check(gm.grouped_matmul_kernel, dtype, {"BLOCK_E": 128, "EVEN_K": True, "INPUT_PRECISION": "ieee",
                                            "INDEX_64": False, "HAS_BIAS": True, "BLOCK_M": down.BLOCK_M,
                                            "BLOCK_N": down.BLOCK_N, "BLOCK_K": down.BLOCK_K}, down)
    dw = gm.grouped_config(8192, 5760, 2880, dtype, backward=True)
    check(gm.grouped_matmul_dw_kernel, dtype, {"INPUT_PRECISION": "ieee", "INDEX_64": False, "GATHER_K": 4,
                                               "HAS_BIAS": True, "BLOCK_M": dw.BLOCK_M, "BLOCK_N": dw.BLOCK_N,
                                               "BLOCK_K": dw.BLOCK_K}, dw)
    # DeepSeek-V3's routed experts: H = 7168, F = 2048, 256 experts, top-8 (the Mixtral layout, SwiGLU).
    config = gm.grouped_config(8192, 2048, 7168, dtype, paired=True)
    check(gm.grouped_matmul_kernel, dtype, {"BLOCK_E": 256, "EVEN_K": True, "INPUT_PRECISION": "ieee",
                                            "INDEX_64": False, "GATHER_K": 8, "EPILOGUE": 1, "BLOCK_M": config.BLOCK_M,
                                            "BLOCK_N": config.BLOCK_N, "BLOCK_K": config.BLOCK_K}, config)
print(f"{count} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
