"""Compile the grouped-GEMM kernels for sm_90 at every GPU tile of kernel_ladder.ops.moe_configs, with no register
spills, and the 16-bit dots on tensor cores: ``wgmma`` (HGMMA in the SASS) wherever the dot has 64 rows or more
(the gate/up and plain kernels' BLOCK_M, the weight gradient's BLOCK_K), ``mma.sync`` (HMMA) below.

Each kind at its sizes: the plain product at Mixtral's down projection (K = 14,336, N = 4,096) and, with its bias,
GPT-OSS's (fp32 biases, 128 experts) and DeepSeek-V3's expert count (256); the gate/up pair with the SwiGLU, and its
backward, at Mixtral's (H = 4,096, F = 14,336, rows gathered through the top-2 permutation) and, for the tiles
marked ``interleaved``, GPT-OSS's (interleaved gate/up columns with a stride of 2, biases, the clamped SwiGLU); the
weight gradient gathered, with and without the bias's column sums; float32 (TF32) candidates at Mixtral's sizes;
the int64-offset forward once.

``--quick`` (what ``make test`` runs): the default table's entries at Mixtral's sizes, the H200-class pairs with
GPT-OSS's interleaved columns, the float32 entries. Without it: every candidate of every kind. ``--count``
instead prints the steady loop's counts and cycle model (utils.sass) of the gate/up and down GEMMs at Mixtral's
sizes, the 64-row tiles the kernels had before against the default table's (docs/architecture.md), and the
rows as a last JSON line (tests/test_sass.py checks the modelled tensor use).

Run by tests/test_kernels_compile_grouped_matmul.py in a compiled-mode child process (utils.aot.run_compiled).
"""

import json
import sys

import torch

from kernel_ladder.ops import grouped_matmul as gm
from kernel_ladder.ops import moe_configs as mc
from utils import sass
from utils.aot import compile_kernel, resource_usage

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Unit strides of contiguous operands (x (M, K), w (E, K, N), out/dy (M, N), dw (E, K, N)) become constants.
UNIT = {"stride_xk", "stride_wn", "stride_on", "stride_yn", "stride_dn", "stride_bn", "stride_dbn"}
RUNTIME = {"M", "E"}  # the token count changes with every batch; E is small

quick = "--quick" in sys.argv
failures, count = [], 0


def compile_for(kind, config, dtype, constexprs):
    """``kind``'s kernel compiled for sm_90 at ``config`` with these switches (what the launcher specializes)."""
    kernel = gm.grouped_matmul_dw_kernel if kind == "dw" else gm.grouped_matmul_kernel
    epilogue = {"matmul": 0, "gate_up": 1, "gate_up_backward": 2, "dw": None}[kind]

    def types(name):
        if name in ("offs_ptr", "idx_ptr"):
            return "*i32"
        if name in ("alpha", "limit"):
            return "fp32"
        if name in ("bias_ptr", "db_ptr"):
            return "*fp32" if constexprs.get("HAS_BIAS") else "*" + TYPES[dtype]  # GPT-OSS keeps biases in fp32
        return "*" + TYPES[dtype] if name.endswith("_ptr") else "i32"

    defaults = {"GATHER_K": 0, "HAS_BIAS": False, "CLAMPED": False, "INTERLEAVED": False, "INDEX_64": False,
                "INPUT_PRECISION": "tf32" if dtype == torch.float32 else "ieee"}
    if kind != "dw":
        defaults.update(EPILOGUE=epilogue, BLOCK_E=8, EVEN_K=True)
    constexprs = {**{k: v for k, v in defaults.items() if k in kernel.arg_names}, **constexprs,
                  "BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N, "BLOCK_K": config.BLOCK_K}
    compiled = compile_kernel(kernel, types, constexprs, ones=[n for n in kernel.arg_names if n in UNIT],
                              divisible=lambda name: name not in UNIT and name not in RUNTIME,
                              num_warps=config.num_warps, num_stages=config.num_stages)
    return compiled, f"{kind} {config} {TYPES[dtype]} {constexprs}"


def check(kind, config, dtype, constexprs):
    """Compile ``kind``'s kernel at ``config`` with these switches; record spills and a missing tensor-core op."""
    global count
    compiled, what = compile_for(kind, config, dtype, constexprs)
    count += 1
    usage = resource_usage(compiled)
    if usage is not None and usage.spilled_bytes:
        failures.append(f"{what}: spills {usage.spilled_bytes} bytes ({usage.registers} registers)")
    if "cubin" not in compiled.asm:
        return
    tensor_op = sass.features(compiled).tensor_op
    dot_rows = config.BLOCK_K if kind == "dw" else config.BLOCK_M
    if dtype != torch.float32 and dot_rows >= 64 and tensor_op != "wgmma":
        failures.append(f"{what}: no wgmma (HGMMA) in the SASS, {tensor_op}")
    elif dtype != torch.float32 and tensor_op is None:
        failures.append(f"{what}: no tensor-core op in the SASS")


# The sizes of each kind: (dtype, constexprs) variants. GPT-OSS-120b: H = F = 2,880, 128 experts, top-4,
# interleaved gate/up columns, fp32 biases, the clamped SwiGLU. DeepSeek-V3: H = 7,168, F = 2,048, 256 experts, top-8.
MIXTRAL = {
    "matmul": {"BLOCK_E": 8},
    "gate_up": {"BLOCK_E": 8, "GATHER_K": 2},
    "gate_up_backward": {"BLOCK_E": 8, "GATHER_K": 2},
    "dw": {"GATHER_K": 2},
}
GPT_OSS = {
    "matmul": {"BLOCK_E": 128, "HAS_BIAS": True},
    "gate_up": {"BLOCK_E": 128, "GATHER_K": 4, "HAS_BIAS": True, "CLAMPED": True, "INTERLEAVED": True},
    "gate_up_backward": {"BLOCK_E": 128, "GATHER_K": 4, "HAS_BIAS": True, "CLAMPED": True, "INTERLEAVED": True},
    "dw": {"GATHER_K": 4, "HAS_BIAS": True},
}
DEEPSEEK = {"matmul": {"BLOCK_E": 256}, "gate_up": {"BLOCK_E": 256, "GATHER_K": 8}, "dw": {}}


def variants(kind, config):
    """Every (dtype, constexprs) a 16-bit candidate of ``kind`` must compile at."""
    yield torch.bfloat16, MIXTRAL[kind]
    if kind in GPT_OSS and (config.interleaved or not kind.startswith("gate_up")):
        yield torch.bfloat16, GPT_OSS[kind]
    if kind in DEEPSEEK:
        yield torch.bfloat16, DEEPSEEK[kind]
    yield torch.float16, MIXTRAL[kind]


def table_entries(wide):
    return {kind: sorted({c for (k, w), rows in mc.DEFAULT_TABLE.items() if k == kind and w == wide for _, c in rows},
                         key=str) for kind in mc.KINDS}


def steady_loop_table(cases):
    """The steady loop of each (label, kind, config, FLOPs of the launch) at Mixtral's sizes in bf16, counted
    with utils.sass: warp-instructions and tensor FMA per warp per K step, and utils.sass.cycle_model (a
    **model**; its shared term counts the bytes the loop's wgmma read from shared memory and its cp.async write
    into it). Prints the table, then its rows as one JSON line."""
    print("| kernel | tile | warp-instr / warp / K step | tensor FMA / warp | instr per 1,000 FMA | tensor cycles "
          "| issue cycles | shared cycles (wgmma operands + cp.async) | tensor use (model) "
          "| launch at 790 TFLOP/s (model) |")
    print("|---" * 10 + "|")
    rows = []
    for label, kind, config, flops in cases:
        compiled, _ = compile_for(kind, config, torch.bfloat16, MIXTRAL[kind])
        loop = sass.steady_loop(sass.parse(sass.disassemble(compiled)))
        mix = sass.mix(loop.instructions)
        cycles = sass.cycle_model(mix, config.num_warps)
        print(f"| {label} | {config} | {mix.total} | {mix.tensor_fma:,} | {1000 * mix.total / mix.tensor_fma:.3f} "
              f"| {cycles.tensor:,.0f} | {cycles.issue:,.0f} | {cycles.shared:,.0f} "
              f"| {cycles.tensor_use:.0%} ({cycles.limiter}) "
              f"| {flops / sass.SM90.sustained_flops / cycles.tensor_use * 1e3:.2f} ms |")
        rows.append({"label": label, "total": mix.total, "tensor_fma": mix.tensor_fma, "tensor": cycles.tensor,
                     "issue": cycles.issue, "shared": cycles.shared, "limiter": cycles.limiter,
                     "tensor_use": cycles.tensor_use})
    print(json.dumps(rows))


if "--count" in sys.argv:  # Mixtral 8x7B's experts, 4,096 tokens, top-2: 8,192 rows, 1,024 per expert
    rows, H, F = 8192, 4096, 14336
    before = {"gate_up": mc.GroupedConfig(64, 64, 64, 4, 3), "matmul": mc.GroupedConfig(64, 128, 64, 4, 3)}
    after = {kind: mc.default_config(kind, rows // 8, 0, 0, torch.bfloat16) for kind in before}
    steady_loop_table([("gate/up + SwiGLU, before", "gate_up", before["gate_up"], 2 * rows * H * 2 * F),
           ("gate/up + SwiGLU, after", "gate_up", after["gate_up"], 2 * rows * H * 2 * F),
           ("down, before", "matmul", before["matmul"], 2 * rows * F * H),
           ("down, after", "matmul", after["matmul"], 2 * rows * F * H)])
    sys.exit(0)
if quick:
    for kind, entries in table_entries(False).items():
        for config in entries:
            check(kind, config, torch.bfloat16, MIXTRAL[kind])
    for kind in ("gate_up", "gate_up_backward"):  # what the table gives GPT-OSS's interleaved columns at prefill
        config = mc.default_config(kind, 1024, 2880, 2880, torch.bfloat16, interleaved=True)
        check(kind, config, torch.bfloat16, GPT_OSS[kind])
    for kind, entries in table_entries(True).items():
        for config in entries:
            check(kind, config, torch.float32, MIXTRAL[kind])
else:
    for kind in mc.KINDS:
        for config in mc.GPU_CANDIDATES[kind]:
            for dtype, constexprs in variants(kind, config):
                check(kind, config, dtype, constexprs)
        for config in mc.GPU_CANDIDATES_FP32[kind]:
            check(kind, config, torch.float32, MIXTRAL[kind])
big = mc.default_config("matmul", 1024, 4096, 14336, torch.bfloat16)
check("matmul", big, torch.bfloat16, {"BLOCK_E": 16, "EVEN_K": False, "INDEX_64": True})
print(f"{count} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
