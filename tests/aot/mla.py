"""Compile the MLA kernels for sm_90 without register spills at a real launch's specialization: DeepSeek-V3's
kv_lora_rank 512 and RoPE dim 64 in bf16, decode with 16 heads (one program, the tensor-parallel shard of 128
heads over 8 GPUs) and 128 heads (4 programs of 32), split-KV with its merge over 512-wide partials, packed
prefill (the binary search over cu_seqlens_q), fp32 (TF32) and int64 offsets; the dots on tensor cores; and the
latent cache write. Prints each variant's registers, spills and shared memory.

Run by tests/test_kernels_mla.py in a compiled-mode child process (utils.aot.run_compiled).
``--quick`` compiles the first three variants, the merge and the write.
"""

import sys

from kernel_ladder.ops import mla
from kernel_ladder.ops import paged_attention as pa
from utils.aot import compile_kernel, resource_usage

FLOATS = {"sm_scale"}
FP32_POINTERS = {"partial_out_ptr", "partial_lse_ptr"}
INT_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"}
UNIT = {"stride_qld", "stride_qrd", "stride_cd", "stride_od", "stride_pod", "stride_btp", "stride_sl", "stride_plh"}
RUNTIME = {"num_seqs", "num_heads", "heads_per_program", "kv_lora_rank", "rope_dim", "num_splits", "num_rows",
           "num_blocks", "max_blocks", "stride_btb", "stride_pls", "stride_plt", "head_dim"}

quick = "--quick" in sys.argv
failures, rows = [], []


def compile_one(fn, dtype, constexprs, num_warps, num_stages, int_pointers=INT_POINTERS, unit=UNIT, runtime=RUNTIME):
    def types(name):
        if name in FP32_POINTERS:
            return "*fp32"
        if name in int_pointers:
            return "*i32" if name != "slot_ptr" else "*i64"
        if name.endswith("_ptr"):
            return "*" + dtype
        return "fp32" if name in FLOATS else "i32"

    divisible = lambda name: name not in runtime and name not in unit and name not in FLOATS  # noqa: E731
    return compile_kernel(fn, types, constexprs, ones=unit, divisible=divisible, num_warps=num_warps,
                          num_stages=num_stages)


def report(label, kernel, dots=True):
    usage = resource_usage(kernel)
    spilled = 0 if usage is None else usage.spilled_bytes
    rows.append(f"{label:72s} registers {'?' if usage is None else usage.registers:>3}  spilled {spilled} B  "
                f"shared {kernel.metadata.shared} B")
    if spilled:
        failures.append(f"{label}: spills {spilled} bytes")
    if dots and "mma" not in kernel.asm["ptx"]:
        failures.append(f"{label}: the dots are not on tensor cores")


def variant(what, dtype, heads, block_size, varlen=False, split=False, index_64=False, rank=512, rope=64):
    config = mla.GPU_CONFIG
    plan = mla._Launch(1024, 8, heads, varlen, config, dtype == "fp32")
    pages, block_n = config.step(block_size, dtype == "fp32", index_64)
    constexprs = dict(VARLEN=varlen, SPLIT=split, INDEX_64=index_64,
                      INPUT_PRECISION="tf32" if dtype == "fp32" else "ieee", BLOCK_SIZE=block_size,
                      PAGES=pages, BLOCK_N=block_n, BLOCK_R=plan.block_rows, GROUP_P=plan.group_p,
                      BLOCK_L=rank, BLOCK_RD=rope)
    label = (f"{what:30s} {dtype} L={rank} R={rope} H={heads} bs={block_size} n={block_n} rows={plan.block_rows} "
             f"w{config.num_warps}")
    try:
        kernel = compile_one(mla.mla_attention_kernel, dtype, constexprs, config.num_warps, config.num_stages)
    except Exception as error:  # noqa: BLE001  (report every variant)
        failures.append(f"{label}: does not compile: {error}")
        return
    report(label, kernel)


VARIANTS = [
    ("decode, 16 heads", "bf16", 16, 64, {}),
    ("decode, 128 heads (4 programs)", "bf16", 128, 64, {}),
    ("decode, 16 heads, split", "bf16", 16, 16, {"split": True}),
    ("packed prefill, 16 heads", "bf16", 16, 64, {"varlen": True}),
    ("decode, fp32 (tf32), 128 heads", "fp32", 128, 64, {}),
    ("decode, fp16, int64, 128 heads", "fp16", 128, 128, {"index_64": True}),
]
for what, dtype, heads, block_size, flags in VARIANTS[:3] if quick else VARIANTS:
    variant(what, dtype, heads, block_size, **flags)

try:  # the merge at the launcher's tiles for 16 heads, 4 splits, 512-wide partials
    block_s, block_d = 4, 512
    merge = compile_one(pa.paged_attention_merge_kernel, "bf16",
                        dict(INDEX_64=False, HAS_SINKS=False, BLOCK_H=max(1, min(16, 8192 // (block_s * block_d))),
                             BLOCK_S=block_s, BLOCK_D=block_d), 4, None, unit=UNIT | {"stride_oh"} - {"stride_oh"})
    report("merge (512-wide partials)", merge, dots=False)
except Exception as error:  # noqa: BLE001
    failures.append(f"merge: does not compile: {error}")

try:
    write = compile_one(mla.write_latent_cache_kernel, "bf16", dict(INDEX_64=False, BLOCK_T=4, BLOCK_W=1024), 4, None,
                        int_pointers={"slot_ptr"}, unit={"stride_cd", "stride_rd", "stride_cw", "stride_slot"},
                        runtime={"n_tokens", "num_slots", "block_size", "kv_lora_rank", "rope_dim"})
    report("write_latent_cache (576-wide rows)", write, dots=False)
except Exception as error:  # noqa: BLE001
    failures.append(f"write_latent_cache: does not compile: {error}")

print("\n".join(rows))
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
