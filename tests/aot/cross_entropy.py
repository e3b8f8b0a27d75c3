"""Compile the cross-entropy kernels for sm_90 (every switch, bf16 and fp32, and the launches of the fused linear
cross-entropy): logits loads and gradient stores vectorized on contiguous rows.

Run by tests/test_kernels_compile_cross_entropy.py in a compiled-mode child process.
"""

import sys

from kernel_ladder.ops import cross_entropy as ce
from utils.aot import compile_kernel, vectorized

FLOATS = {"label_smoothing", "softcap", "z_loss"}
# Divisible by 16, as Triton's launcher specializes them for torch allocations and 128k rows.
ALIGNED = {"n_cols", "stride_x0", "stride_x1", "stride_x2", "stride_g0", "stride_g1", "stride_g2"}


def compile_ptx(fn, pointers, constexprs, ones, num_warps):
    types = lambda name: "*" + pointers[name] if name.endswith("_ptr") else ("fp32" if name in FLOATS else "i32")
    return compile_kernel(fn, types, constexprs, ones=ones, divisible=ALIGNED, num_warps=num_warps).asm["ptx"]


failures = []
LONG, SHORT = (4, 131072), (64, 256)  # chunked long rows; short rows stacked BLOCK_ROWS high
# (dtype, gradient pass?, rows x classes, contiguous?): every switch of the kernel, both dtypes.
FORWARD = [("bf16", grad, shape, True) for grad in (False, True) for shape in (LONG, SHORT)]
FORWARD += [("bf16", True, LONG, False), ("fp32", False, LONG, True), ("fp32", True, SHORT, True)]
for i, (dtype, grad, shape, contiguous) in enumerate(FORWARD):
    config = ce.cross_entropy_launch_config(*shape)
    pointers = {"logits_ptr": dtype, "target_ptr": "i64", "loss_ptr": "fp32", "z_ptr": "fp32", "grad_ptr": dtype,
                "weight_ptr": "fp32", "scale_ptr": "fp32"}
    options = i % 2 == 1  # every other variant with class weights, soft-capping and the z-loss
    constexprs = {"COMPUTE_GRAD": grad, "SMOOTHING": grad, "HAS_WEIGHT": options, "SOFTCAP": options,
                  "Z_LOSS": options, "RETURN_Z": options, "CHUNKED": config.chunked,
                  "INDEX_64": not contiguous, "BLOCK_ROWS": config.block_rows, "BLOCK_COLS": config.block_cols}
    ones = ("stride_xcol", "stride_gcol") if contiguous else ()
    ptx = compile_ptx(ce.cross_entropy_forward_kernel, pointers, constexprs, ones, config.num_warps)
    what = f"forward {dtype} grad={grad} options={options} {config}"
    if contiguous and not vectorized(ptx, stores=False):
        failures.append(what + ": logits loads not vectorized")
    if contiguous and grad and not ("st.global.v4" in ptx or "st.global.v2" in ptx):
        failures.append(what + ": gradient stores not vectorized")
for dtype, contiguous in (("bf16", True), ("fp32", False)):
    config = ce.cross_entropy_launch_config(*LONG)
    ptx = compile_ptx(ce.cross_entropy_backward_kernel, {"grad_ptr": dtype, "scale_ptr": dtype},
                      {"INDEX_64": not contiguous, "BLOCK_ROWS": config.block_rows, "BLOCK_COLS": config.block_cols},
                      ("stride_gcol",) if contiguous else (), config.num_warps)
    if contiguous and not vectorized(ptx):
        failures.append(f"backward {dtype}: not vectorized")
for has_weight, mean in ((False, True), (True, True), (True, False)):
    compile_ptx(ce.cross_entropy_targets_kernel, {"target_ptr": "i64", "weight_ptr": "fp32", "check_ptr": "i64",
                                                  "scale_ptr": "fp32"},
                {"HAS_WEIGHT": has_weight, "CLASS_WEIGHT_SUM": has_weight, "MEAN": mean, "BLOCK": 1024}, (), 4)
    compile_ptx(ce.cross_entropy_reduce_kernel, {"loss_rows_ptr": "fp32", "z_rows_ptr": "fp32", "scale_ptr": "fp32",
                                                 "loss_ptr": "bf16", "z_ptr": "bf16"},
                {"RETURN_Z": has_weight, "MEAN": mean, "BLOCK": 1024}, (), 4)
# kernel_ladder.fused_linear_cross_entropy's launches: a chunk of bf16 logits with its gradient written over it,
# class weights of another dtype (ce_weight), the z term returned; its reduce writes a float32 loss and z term.
config = ce.cross_entropy_launch_config(256, 128256)
ptx = compile_ptx(ce.cross_entropy_forward_kernel,
                  {"logits_ptr": "bf16", "target_ptr": "i64", "loss_ptr": "fp32", "z_ptr": "fp32", "grad_ptr": "bf16",
                   "weight_ptr": "fp32", "scale_ptr": "fp32"},
                  {"COMPUTE_GRAD": True, "SMOOTHING": True, "HAS_WEIGHT": True, "SOFTCAP": False, "Z_LOSS": True,
                   "RETURN_Z": True, "CHUNKED": config.chunked, "INDEX_64": False, "BLOCK_ROWS": config.block_rows,
                   "BLOCK_COLS": config.block_cols}, ("stride_xcol", "stride_gcol"), config.num_warps)
if not vectorized(ptx, stores=False) or not ("st.global.v4" in ptx or "st.global.v2" in ptx):
    failures.append(f"fused linear cross-entropy forward {config}: logits loads or gradient stores not vectorized")
compile_ptx(ce.cross_entropy_reduce_kernel, {"loss_rows_ptr": "fp32", "z_rows_ptr": "fp32", "scale_ptr": "fp32",
                                             "loss_ptr": "fp32", "z_ptr": "fp32"},
            {"RETURN_Z": True, "MEAN": True, "BLOCK": 1024}, (), 4)
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
