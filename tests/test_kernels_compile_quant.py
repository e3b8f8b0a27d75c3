"""The quantization kernels compile for a Hopper GPU (sm_90), every variant the launchers use.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. Besides proving
every variant is valid compiled Triton, the PTX is checked for what the design relies on:

* weight-only kernels run ``tl.dot`` on 16-bit tensor cores (``mma``/``wgmma`` with f16/bf16
  operands), the fp8 path converts e4m3 in hardware (``cvt...e4m3x2``), and W8A8 multiplies
  int8 by int8 into int32 (an ``.s8`` MMA);
* the quantizers keep the round-half-to-even trick (the constant 1.5 * 2**23 is not folded
  away) and divide with IEEE rounding (``div.rn.f32``);
* the fp8 quantizer's conversion saturates (``satfinite``).
"""

from __future__ import annotations

import textwrap

import pytest

from utils.aot import run_compiled

SCRIPT = textwrap.dedent(
    """
    import sys
    import kernels
    from utils.aot import compile_kernel
    kq = kl = kernels  # the kernels are exported by the package (kernels.quantized_linear is the op)

    # What Triton's launcher specializes: integer arguments equal to 1 become constants, integers
    # and pointers divisible by 16 are marked so (torch allocations; K, N, row strides of real sizes).
    ONES = {"x_col_stride", "w_col_stride", "x_stride_k", "w_stride_k", "scale_stride_n", "bias_stride",
            "size1", "size2", "x_stride1", "x_stride2", "g_stride1", "g_stride2", "g_stride_n"}
    DIV16 = {"n_cols", "q_row_stride", "w_row_stride", "packed_row_stride", "scale_group_stride", "M", "K", "N",
             "w_cols", "x_stride0", "w_stride_n", "scale_stride_g", "xq_stride_m", "n_elements", "g_stride0"}

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
                                  {"FP8": fp8, "ROWS": 4, "BLOCK": 1024, "SINGLE_BLOCK": single})
                expect("div.rn.f32" in ptx, f"quantize_rows {dtype} fp8={fp8}: no IEEE division")
                if fp8:
                    expect("satfinite.e4m3x2" in ptx, f"quantize_rows {dtype}: fp8 conversion not saturating")
                else:
                    expect("0f4B400000" in ptx, f"quantize_rows {dtype}: rounding constant folded away")
        for group in (32, 128, 4096):
            ptx = compile_ptx(kq.quantize_int4_kernel, {"w_ptr": dtype, "packed_ptr": "u8", "scale_ptr": "fp16"},
                              {"GROUP_SIZE": group, "ROWS": 8 if group < 4096 else 1})
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
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_quantization_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
