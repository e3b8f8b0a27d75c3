"""Compile three small kernels for sm_90 and print what utils.sass reads from their SASS, as JSON.

Run by tests/test_sass.py in a compiled-mode child process (utils.aot.run_compiled): a tl.dot loop, an
elementwise kernel, and one loop whose index is divided by a runtime width in every iteration or carried.
"""

import json

import triton
import triton.language as tl

from utils import sass
from utils.aot import compile_kernel, occupancy, resource_usage


@triton.jit
def dot_loop_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, cols, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * K + (k + ks)[None, :])
        b = tl.load(b_ptr + (k + ks)[:, None] * BLOCK_N + cols[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * BLOCK_N + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)


@triton.jit
def tile_sum_kernel(x_ptr, out_ptr, n_tiles, width, stride_row, BLOCK: tl.constexpr, CARRY: tl.constexpr):
    # Sums tiles i = 0 .. n_tiles-1 of a (rows x width) grid of BLOCK-wide tiles, row-major.
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    row = tl.program_id(0) * 0
    col = tl.program_id(0) * 0
    for i in range(n_tiles):
        if not CARRY:  # the tile's (row, col) recomputed from i by a division by the runtime width
            row = i // width
            col = i % width
        acc += tl.load(x_ptr + row * stride_row + col * BLOCK + offsets)
        if CARRY:  # the same (row, col) carried from the previous iteration: no division
            col += 1
            wrap = col == width
            col = tl.where(wrap, 0, col)
            row += wrap.to(tl.int32)
    tl.store(out_ptr + offsets, acc)


def summary(compiled, num_warps):
    instrs = sass.parse(sass.disassemble(compiled))
    loop = sass.steady_loop(instrs)
    usage = resource_usage(compiled)
    out = {
        "features": sass.features(compiled).__dict__,
        "loops": len(sass.loops(instrs)),
        "registers": usage.registers,
        "shared": compiled.metadata.shared,
    }
    out["occupancy"] = occupancy(usage.registers, compiled.metadata.shared, num_warps).__dict__
    if loop is None:
        out["loop"] = None
        out["mix"] = sass.mix(instrs).counts
    else:
        m = sass.mix(loop.instructions)
        cycles = sass.cycle_model(m, num_warps)
        out["loop"] = {
            "mix": m.counts,
            "total": m.total,
            "tensor_fma": m.tensor_fma,
            "opcodes": sorted({i.base for i in loop.instructions}),
            "bound": cycles.bound,
            "limiter": cycles.limiter,
            "tensor_use": cycles.tensor_use,
        }
    return out


pointers = lambda name: "*bf16" if name.endswith("_ptr") else "i32"
fp32 = lambda name: "*fp32" if name.endswith("_ptr") else "i32"
results = {
    "dot": summary(
        compile_kernel(
            dot_loop_kernel,
            pointers,
            {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64},
            divisible={"K"},
            num_warps=4,
            num_stages=3,
        ),
        4,
    ),
    "elementwise": summary(compile_kernel(scale_kernel, fp32, {"BLOCK": 1024}, divisible={"n"}, num_warps=4), 4),
}
for carry in (False, True):
    compiled = compile_kernel(
        tile_sum_kernel, fp32, {"BLOCK": 512, "CARRY": carry}, divisible={"stride_row"}, num_warps=4
    )
    results["carried" if carry else "divided"] = summary(compiled, 4)
print(json.dumps(results))
