"""Compile the paged-attention kernels for sm_90 without register spills: decode with the GQA group as
the rows of a ``tl.dot`` (group 4 and 8, padded to 16 rows) and with the elementwise path (group 1), an
fp8 cache feeding bf16 dots, split-KV partials, packed queries (the binary search over cu_seqlens_q)
with a window and soft-capping, fp32 (TF32), head dim 256, int64 offsets, attention sinks (GPT-OSS, head
dim 64), v's own head dim (DeepSeek-V3's MLA prefill, 192/128), and the merge kernel (with sinks); the
block products of the dot paths on tensor cores. Prints each variant's registers, spills and shared memory.

Run by tests/test_kernels_compile_paged_attention.py in a compiled-mode child process (utils.aot.run_compiled).
``--quick`` (what ``make test`` runs) compiles the first four variants, the sinks decode, the MLA prefill and
the merge.
"""

import sys

from kernel_ladder.ops import paged_attention as pa
from utils.aot import compile_kernel, resource_usage

FLOATS = {"sm_scale", "softcap"}
FP32_POINTERS = {"partial_out_ptr", "partial_lse_ptr", "k_scale_ptr", "v_scale_ptr", "sinks_ptr"}
INT_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"}
# Unit strides become constants (Triton's launcher specializes 1); strides of real shapes are multiples of
# 16; lengths, counts and the window are runtime values.
UNIT = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_pod", "stride_btp", "stride_sl", "stride_plh",
        "stride_sink"}
RUNTIME = {"num_seqs", "head_dim", "group_size", "heads_per_program", "num_splits", "window", "num_heads",
           "num_rows", "num_blocks", "max_blocks", "stride_btb", "stride_pls", "stride_plt"}

quick = "--quick" in sys.argv
failures, rows = [], []


def compile_one(fn, q_dtype, cache_dtype, constexprs, num_warps=4, num_stages=2):
    def types(name):
        if name in FP32_POINTERS:
            return "*fp32"
        if name in INT_POINTERS:
            return "*i32"
        if name in ("k_cache_ptr", "v_cache_ptr"):
            return "*" + cache_dtype
        if name.endswith("_ptr"):
            return "*" + q_dtype
        return "fp32" if name in FLOATS else "i32"

    divisible = lambda name: name not in RUNTIME and name not in UNIT and name not in FLOATS  # noqa: E731
    return compile_kernel(fn, types, constexprs, ones=UNIT, divisible=divisible, num_warps=num_warps,
                          num_stages=num_stages)


def variant(what, q_dtype, cache_dtype, head_dim, block_size, group, varlen=False, split=False, window=False,
            softcap=False, index_64=False, sinks=False, head_dim_v=None):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    widest = max(head_dim, head_dim_v)  # the launcher sizes the key step and warps by the wider tile
    plan = pa._Launch(1024, 8, 8 * group, 8, widest, block_size, True, varlen)
    config = pa.GPU_CONFIG
    constexprs = dict(VARLEN=varlen, HAS_WINDOW=window, SOFTCAP=softcap, FP8=cache_dtype == "fp8e4nv", SPLIT=split,
                      USE_DOT=plan.use_dot, INDEX_64=index_64,
                      INPUT_PRECISION="tf32" if q_dtype == "fp32" else "ieee", HAS_SINKS=sinks,
                      SAME_DV=head_dim_v == head_dim,
                      BLOCK_SIZE=block_size, PAGES=config.pages(block_size, widest), BLOCK_R=plan.block_rows,
                      GROUP_P=plan.group_p, BLOCK_D=head_dim, BLOCK_DV=head_dim_v)
    label = (f"{what:34s} {q_dtype}/{cache_dtype} D={head_dim}/{head_dim_v} bs={block_size} rows={plan.block_rows} "
             f"pages={constexprs['PAGES']} w{config.warps(block_size, widest)}")
    try:
        kernel = compile_one(pa.paged_attention_kernel, q_dtype, cache_dtype, constexprs,
                             config.warps(block_size, widest), config.num_stages)
    except Exception as error:  # noqa: BLE001  (report every variant)
        failures.append(f"{label}: does not compile: {error}")
        return
    usage = resource_usage(kernel)
    spilled = 0 if usage is None else usage.spilled_bytes
    rows.append(f"{label:90s} registers {'?' if usage is None else usage.registers:>3}  spilled {spilled} B  "
                f"shared {kernel.metadata.shared} B")
    if spilled:
        failures.append(f"{label}: spills {spilled} bytes")
    if plan.use_dot and "mma" not in kernel.asm["ptx"]:
        failures.append(f"{label}: the block products are not on tensor cores")


VARIANTS = [
    ("decode, GQA 4 (dot on 16 rows)", "bf16", "bf16", 128, 16, 4, {}),
    ("decode, MHA (elementwise)", "bf16", "bf16", 128, 16, 1, {}),
    ("decode, fp8 cache, GQA 8, split", "bf16", "fp8e4nv", 128, 16, 8, {"split": True}),
    ("packed, GQA 4, window, softcap", "bf16", "bf16", 128, 16, 4, {"varlen": True, "window": True,
                                                                   "softcap": True}),
    ("decode, fp32 (tf32), GQA 4", "fp32", "fp32", 64, 32, 4, {}),
    ("decode, D=256, GQA 8", "bf16", "bf16", 256, 16, 8, {}),
    ("decode, fp16, bs=128, int64", "fp16", "fp16", 128, 128, 4, {"index_64": True}),
    ("packed, GQA 8, bs=8, split", "bf16", "bf16", 64, 8, 8, {"varlen": True, "split": True}),
    ("packed, D=256, GQA 2, softcap", "bf16", "bf16", 256, 16, 2, {"varlen": True, "softcap": True}),
    ("decode, GQA 8, sinks (GPT-OSS)", "bf16", "bf16", 64, 16, 8, {"sinks": True}),
    ("packed, GQA 8, sinks, window", "bf16", "bf16", 64, 16, 8, {"varlen": True, "sinks": True, "window": True}),
    ("packed, MLA prefill 192/128", "bf16", "bf16", 256, 16, 1, {"varlen": True, "head_dim_v": 128}),
]
QUICK = VARIANTS[:4] + VARIANTS[-3:-2] + VARIANTS[-1:]
for what, q_dtype, cache_dtype, head_dim, block_size, group, flags in QUICK if quick else VARIANTS:
    variant(what, q_dtype, cache_dtype, head_dim, block_size, group, **flags)

try:
    merge = compile_one(pa.paged_attention_merge_kernel, "bf16", "bf16",
                        dict(INDEX_64=False, HAS_SINKS=True, BLOCK_H=8, BLOCK_S=8, BLOCK_D=128))
    usage = resource_usage(merge)
    rows.append(f"{'merge':90s} registers {'?' if usage is None else usage.registers:>3}  "
                f"spilled {0 if usage is None else usage.spilled_bytes} B")
    if usage is not None and usage.spilled_bytes:
        failures.append(f"merge: spills {usage.spilled_bytes} bytes")
except Exception as error:  # noqa: BLE001
    failures.append(f"merge: does not compile: {error}")

print("\n".join(rows))
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
