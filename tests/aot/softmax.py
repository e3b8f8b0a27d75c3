"""Compile every softmax kernel variant for sm_90 at the sizes the launch rule picks: no spills, 128-bit
accesses on contiguous rows, accesses laid out along the rows on transposed ones.

Run by tests/test_kernels_compile_softmax.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import re
import sys

import torch

from kernel_ladder.ops import softmax as sm
from utils.aot import compile_kernel, resource_usage

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
SIZE_ARGS = ("n_rows", "size1", "size2")


def compile_variant(fn, dtype, config, log, layout, linear_rows, index_64):
    constexprs = {"LOG": log, "BLOCK_COLS": config.block_cols, "BLOCK_ROWS": config.block_rows,
                  "LINEAR_ROWS": linear_rows, "INDEX_64": index_64}
    # what Triton specializes for a stride of 1
    pattern = {"contiguous": r"stride_\w+col$", "transposed": r"stride_\w+2$"}.get(layout)
    ones = [name for name in fn.arg_names if pattern and re.fullmatch(pattern, name)]
    # What Triton's launcher specializes for torch allocations and sizes divisible by 16.
    divisible = (lambda name: False) if layout == "general" else (lambda name: name not in SIZE_ARGS)
    types = lambda name: "*" + TYPES[dtype] if name.endswith("_ptr") else "i32"
    return compile_kernel(fn, types, constexprs, ones=ones, divisible=divisible,
                          aligned_pointers=layout != "general", num_warps=config.num_warps)


def access_orders(ttgir):
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{.*?order = \[([\d, ]+)\]", ttgir, re.M))
    accesses = re.findall(r"tt\.(?:load|store) [^:]*: tensor<[^,]+, (#blocked\d*)>", ttgir)
    return {layouts[name] for name in accesses}


failures, rows = [], []
KERNELS = [(sm.softmax_kernel, False, 32768), (sm.softmax_online_kernel, False, 100_000),
           (sm.softmax_backward_kernel, True, 32768), (sm.softmax_backward_online_kernel, True, 100_000)]
for fn, backward, n_cols in KERNELS:
    for log in (False, True):
        variants = [
            # the largest size of this kernel's path, contiguous rows
            ("contiguous", torch.bfloat16 if log else torch.float32, n_cols if fn is not sm.softmax_backward_kernel
             else 16384, True, False),
            # a softmax over a non-innermost dim, with int64 column offsets
            ("transposed", torch.float16, 1000 if not fn.__name__.endswith("online_kernel") else n_cols,
             True, True),
        ]
        if not log:  # per-row offsets, no specialization at all
            variants.append(("general", torch.float32, 300 if "online" not in fn.__name__ else n_cols,
                             False, False))
        if fn is sm.softmax_backward_kernel:  # its limits: 16384 fp32, 32768 for 16-bit y and dy
            variants += [("contiguous", dtype, 32768, True, False) for dtype in (torch.bfloat16, torch.float16)]
            if log:  # (fp32 at 16384 without LOG is the first variant)
                variants.append(("contiguous", torch.float32, 16384, True, False))
        for layout, dtype, cols, linear_rows, index_64 in variants:
            config = sm.softmax_launch_config(cols, dtype, transposed=layout == "transposed", backward=backward)
            assert config.chunked == ("online" in fn.__name__), (fn.__name__, config)
            name = f"{fn.__name__} LOG={log} {layout} {TYPES[dtype]} {config}"
            try:
                compiled = compile_variant(fn, dtype, config, log, layout, linear_rows, index_64)
            except Exception as error:  # report every variant, not just the first
                failures.append(f"{name}: does not compile: {error}")
                continue
            ptx = compiled.asm["ptx"]
            usage = resource_usage(compiled)
            registers, spilled = (usage.registers, usage.spilled_bytes) if usage else ("?", "?")
            rows.append(f"{name}: registers {registers}, spilled bytes {spilled}")
            if usage is not None and usage.spilled_bytes:
                failures.append(f"{name}: spills {usage.spilled_bytes} bytes to local memory")
            if layout == "contiguous" and not ("ld.global.v4" in ptx and "st.global.v4" in ptx):
                failures.append(f"{name}: contiguous rows not vectorized")
            orders = access_orders(compiled.asm["ttgir"])
            if layout == "transposed" and orders != {"0, 1"}:
                failures.append(f"{name}: accesses not laid out along the rows: {orders}")
print("\n".join(rows))
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
