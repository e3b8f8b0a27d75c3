"""Compile every norm kernel variant for sm_90 at the sizes the launch rule picks: no spills on the fused path,
128-bit accesses on contiguous rows.

Run by tests/test_kernels_compile_norm.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import sys

from kernel_ladder.ops import norm as _norm
from kernel_ladder.ops.add_rms_norm import add_rms_norm_kernel
from kernel_ladder.ops.layer_norm import layer_norm_backward_kernel, layer_norm_kernel
from kernel_ladder.ops.rms_norm import rms_norm_backward_kernel, rms_norm_kernel
from utils.aot import compile_kernel, resource_usage

FP32_POINTERS = {"rstd_ptr", "mean_ptr", "scratch_ptr", "dw_partial_ptr", "db_partial_ptr", "partial_ptr"}
COLUMN_STRIDES = {"stride_xcol", "stride_ycol", "stride_w", "stride_b", "stride_rcol", "stride_scol",
                  "stride_dycol", "stride_dxcol", "stride_dscol"}
UNSPECIALIZED = {"n_rows", "rows_per_program", "size2", "n_partials", "eps", "offset"}


def compile_variant(fn, constexprs, dtype, contiguous, index_64, num_warps):
    def types(name):
        if name.endswith("_ptr"):
            return "*fp32" if name in FP32_POINTERS else "*" + dtype
        return "fp32" if name in ("eps", "offset") else ("i64" if index_64 else "i32")

    # Triton specializes ints equal to 1; torch allocations and strides like 4096 are divisible by 16.
    ones = [n for n in fn.arg_names if contiguous and (n in COLUMN_STRIDES or n == "size1")]
    divisible = lambda name: contiguous and name not in UNSPECIALIZED
    return compile_kernel(fn, types, constexprs, ones=ones, divisible=divisible, num_warps=num_warps)


def stack_bytes(compiled):
    usage = resource_usage(compiled)
    return usage.spilled_bytes if usage else None


RMS = {"HAS_WEIGHT": True, "HAS_OFFSET": True, "ROUND_BEFORE_SCALE": True}
ADD_RMS = {"HAS_WEIGHT": True}
LN = {"HAS_WEIGHT": True, "HAS_BIAS": True}
RMS_BACKWARD = {"HAS_WEIGHT": True, "HAS_OFFSET": True, "HAS_GRAD_SUM": True, "WEIGHT_GRAD": True}
LN_BACKWARD = {"HAS_WEIGHT": True, "WEIGHT_GRAD": True, "BIAS_GRAD": True}
SHORT, FUSED_MAX = (8192, 256, "bf16", True, False), (8192, 16384, "fp16", True, False)
CHUNKED = (64, 20000, "bf16", True, False)
STRIDED_INT64 = (512, 1000, "fp32", False, True)
# (kernel, flags, backward?, (n_rows, n_cols, dtype, contiguous, index_64)): every kernel with all
# its inputs on short stacked rows, the largest fused row and chunked rows; the flags off once;
# a strided int64 launch once per direction.
VARIANTS = [
    *[(fn, flags, False, shape) for fn, flags in ((rms_norm_kernel, RMS), (layer_norm_kernel, LN),
                                                  (add_rms_norm_kernel, ADD_RMS))
      for shape in (SHORT, FUSED_MAX, CHUNKED)],
    *[(fn, flags, True, shape) for fn, flags in ((rms_norm_backward_kernel, RMS_BACKWARD),
                                                 (layer_norm_backward_kernel, LN_BACKWARD))
      for shape in (SHORT, FUSED_MAX, CHUNKED)],
    (rms_norm_kernel, {"HAS_WEIGHT": False, "HAS_OFFSET": False, "ROUND_BEFORE_SCALE": False}, False, SHORT),
    (layer_norm_kernel, {"HAS_WEIGHT": False, "HAS_BIAS": False}, False, SHORT),
    (rms_norm_backward_kernel, {"HAS_WEIGHT": False, "HAS_OFFSET": False, "HAS_GRAD_SUM": False,
                                "WEIGHT_GRAD": False}, True, SHORT),
    (layer_norm_backward_kernel, {"HAS_WEIGHT": False, "WEIGHT_GRAD": False, "BIAS_GRAD": True}, True, SHORT),
    (layer_norm_kernel, LN, False, STRIDED_INT64),
    (rms_norm_backward_kernel, RMS_BACKWARD, True, STRIDED_INT64),
]
failures, checked = [], 0
for fn, flags, backward, (n_rows, n_cols, dtype, contiguous, index_64) in VARIANTS:
    if backward and n_cols == 16384:  # the backward's largest fused row
        n_cols = _norm.MAX_FUSED_BLOCK_BACKWARD
    config = _norm.norm_launch_config(n_rows, n_cols, backward=backward)
    constexprs = {**flags, "BLOCK_ROWS": config.block_rows, "BLOCK_COLS": config.block_cols,
                  "CHUNKED": config.chunked, "INDEX_64": index_64}
    what = f"{fn.__name__} {flags} {n_rows}x{n_cols} {dtype} {config}"
    try:
        compiled = compile_variant(fn, constexprs, dtype, contiguous, index_64, config.num_warps)
    except Exception as error:  # noqa: BLE001
        failures.append(f"{what}: {type(error).__name__}: {error}")
        continue
    checked += 1
    ptx = compiled.asm["ptx"]
    if contiguous and not ("ld.global.v4" in ptx and "st.global.v4" in ptx):
        failures.append(f"{what}: contiguous path not vectorized")
    stack = stack_bytes(compiled)
    if not config.chunked and stack:
        failures.append(f"{what}: {stack} bytes of stack (register spills)")
compiled = compile_variant(_norm.column_sum_kernel, {"BLOCK_P": 32, "BLOCK_N": 128}, "fp32", False, False, 4)
checked += 1
print(f"{checked} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
