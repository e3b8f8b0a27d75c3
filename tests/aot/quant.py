"""Compile the quantizers and the quantized linear kernels for sm_90: IEEE division and saturating fp8
conversion, tensor-core dots for every scheme, a pipelined weight stream, int8 x int8 -> int32 MMA.

Run by tests/test_kernels_compile_quant.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

import kernel_ladder
from utils.aot import compile_kernel

kq = kl = kernel_ladder  # the kernels are exported by the package

# What Triton's launcher specializes: integer arguments equal to 1 become constants, integers
# and pointers divisible by 16 are marked so (torch allocations; K, N, row strides of real sizes).
ONES = {"stride_xcol", "stride_wk", "stride_xk", "stride_sn", "stride_bias",
        "size1", "size2", "stride_x1", "stride_x2", "stride_g1", "stride_g2", "stride_gn"}
DIV16 = {"n_cols", "stride_qrow", "stride_wn", "stride_pn", "stride_sg", "M", "K", "N",
         "w_cols", "stride_x0", "stride_xqm", "n_elements", "stride_g0"}


def compile_ptx(fn, pointers, constexprs, ints="i32", num_warps=4, num_stages=3):
    types = lambda name: "*" + pointers[name] if name.endswith("_ptr") else ints
    ones = [name for name in fn.arg_names if name in ONES]
    return compile_kernel(fn, types, constexprs, ones=ones, divisible=DIV16, num_warps=num_warps,
                          num_stages=num_stages).asm["ptx"]


failures = []


def expect(ok, what):
    if not ok:
        failures.append(what)

# -- quantizers
for dtype in ("fp32", "bf16", "fp16"):
    for fp8 in (False, True):
        for single in (True, False):
            ptx = compile_ptx(kq.quantize_rows_kernel,
                              {"x_ptr": dtype, "q_ptr": "fp8e4nv" if fp8 else "i8", "scale_ptr": "fp32"},
                              {"FP8": fp8, "BLOCK_ROWS": 4, "BLOCK_COLS": 1024, "CHUNKED": not single})
            expect("div.rn.f32" in ptx, f"quantize_rows {dtype} fp8={fp8}: no IEEE division")
            if fp8:
                expect("satfinite.e4m3x2" in ptx, f"quantize_rows {dtype}: fp8 conversion not saturating")
            else:
                expect("0f4B400000" in ptx, f"quantize_rows {dtype}: rounding constant folded away")
    for group in (32, 128, 4096):
        ptx = compile_ptx(kq.quantize_int4_kernel, {"w_ptr": dtype, "packed_ptr": "u8", "scale_ptr": "fp16"},
                          {"GROUP_SIZE": group, "BLOCK_ROWS": 8 if group < 4096 else 1})
        expect("0f4B400000" in ptx, f"quantize_int4 {dtype} g{group}: rounding constant folded away")

# -- weight-only linear: every scheme x dot dtype; decode tiles (pipelined weight stream checked),
#    a prefill tile, split-K, bias, int64 offsets
STORAGE = {0: "i8", 1: "u8", 2: "fp8e4nv"}
DECODE = [(16, 64, 256, 4, 4), (16, 128, 128, 4, 4)]
PREFILL = (128, 128, 64, 8, 3)
for scheme in (0, 1, 2):
    for dtype in ("bf16", "fp16", "fp32"):
        configs = DECODE + [PREFILL] if dtype == "bf16" else DECODE[1:]
        for i, (bm, bn, bk, warps, stages) in enumerate(configs):
            split, bias, index_64 = [(1, True, False), (4, False, False), (1, True, True)][i]
            pointers = {"x_ptr": dtype, "w_ptr": STORAGE[scheme], "scale_ptr": "fp32", "bias_ptr": dtype,
                        "out_ptr": dtype, "partial_ptr": "fp32"}
            constexprs = {"SCHEME": scheme, "GROUP_SIZE": 128 if scheme == 1 else 1, "HAS_BIAS": bias,
                          "SPLIT_K": split, "INPUT_PRECISION": "tf32", "INDEX_64": index_64,
                          "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": min(bk, 128) if scheme == 1 else bk}
            ptx = compile_ptx(kl.quantized_linear_kernel, pointers, constexprs, num_warps=warps,
                              num_stages=stages)
            what = f"quantized_linear scheme={scheme} {dtype} {(bm, bn, bk)}"
            if dtype != "fp32":
                ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
                mma = ("mma.sync" in ptx or "wgmma" in ptx) and f".{ptx_type}.{ptx_type}" in ptx
                expect(mma, what + ": no 16-bit tensor-core dot")
            if bm == 16:
                expect("cp.async.cg.shared.global" in ptx, what + ": weight stream not pipelined (cp.async)")
            if scheme == 2:
                expect("e4m3x2" in ptx, what + ": fp8 not converted in hardware")

# -- the backward (grad_x = grad_out @ dequant(W), a reduction over N)
for scheme in (0, 1, 2):
    for dtype, bm in (("bf16", 16), ("bf16", 64), ("fp16", 64), ("fp32", 16)):
        pointers = {"grad_ptr": dtype, "w_ptr": STORAGE[scheme], "scale_ptr": "fp32", "grad_x_ptr": dtype}
        constexprs = {"SCHEME": scheme, "GROUP_SIZE": 128 if scheme == 1 else 1, "INPUT_PRECISION": "tf32",
                      "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128}
        ptx = compile_ptx(kl.quantized_linear_backward_kernel, pointers, constexprs, num_warps=4, num_stages=3)
        if dtype != "fp32":
            expect("mma" in ptx, f"quantized_linear_backward scheme={scheme} {dtype}: no tensor-core dot")

# -- W8A8 and the split-K reduction
for bm, bn, bk, warps, stages in DECODE + [PREFILL]:
    for split, out in ((1, "bf16"), (4, "fp16"), (1, "fp32")):
            pointers = {"xq_ptr": "i8", "x_scale_ptr": "fp32", "w_ptr": "i8", "w_scale_ptr": "fp32",
                        "bias_ptr": out, "out_ptr": out, "partial_ptr": "fp32"}
            constexprs = {"HAS_BIAS": split == 1, "SPLIT_K": split, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
            ptx = compile_ptx(kl.w8a8_linear_kernel, pointers, constexprs, num_warps=warps, num_stages=stages)
            expect(".s8" in ptx and ".s32" in ptx and ("mma" in ptx),
                   f"w8a8 {(bm, bn, bk)} split={split} {out}: no int8 x int8 -> int32 MMA")
for out in ("bf16", "fp16", "fp32"):
    for split in (2, 16):
        compile_ptx(kl.quantized_linear_reduce_kernel, {"partial_ptr": "fp32", "bias_ptr": out, "out_ptr": out},
                    {"HAS_BIAS": True, "SPLIT_K": split, "BLOCK": 1024}, ints="i64")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
