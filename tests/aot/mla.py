"""Compile the MLA kernels for sm_90 without register spills at a real launch's specialization: DeepSeek-V3's
kv_lora_rank 512 and RoPE dim 64 in bf16, decode with 16 heads (one program, the tensor-parallel shard of 128
heads over 8 GPUs) and 128 heads (4 programs of 32), split-KV with its merge over 512-wide partials, packed
prefill (the binary search over cu_seqlens_q), fp32 (TF32) and int64 offsets; the dots on tensor cores; and the
latent cache write. Prints each variant's registers, spills and shared memory.

Run by tests/test_kernels_mla.py in a compiled-mode child process (utils.aot.run_compiled).
``--quick`` compiles the first three variants, the merge and the write.
"""

import sys

import torch

from kernel_ladder.ops import mla
from kernel_ladder.ops import paged_attention as pa
from utils.aot import compile_kernel, record_launches, resource_usage

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
    """The launch the op's launcher (``mla._forward``) makes at real sizes (a decode batch of 32 sequences of up to
    4,096 tokens, CPU tensors that are never read), recorded and compiled at the launcher's specialization."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    lengths = [1, 700, 33, 1500, 257, 64, 2000, 5] if varlen else [1] * 32
    rows_q, max_blocks = sum(lengths), 4096 // block_size
    num_blocks = (2**31 // (block_size * (rank + rope)) + 1) if index_64 else len(lengths) * max_blocks
    q_latent = torch.empty(rows_q, heads, rank, dtype=torch_dtype)
    q_rope = torch.empty(rows_q, heads, rope, dtype=torch_dtype)
    cache = torch.empty(num_blocks, block_size, rank + rope, dtype=torch_dtype)
    out = torch.empty(rows_q, heads, rank, dtype=torch_dtype)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    seq_lens = torch.full((len(lengths),), 4096, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if varlen else None
    torch.backends.cuda.matmul.allow_tf32 = dtype == "fp32"  # the fp32 variant: a caller who allows TF32
    with record_launches(mla, "mla_attention_kernel") as launches, record_launches(pa, "paged_attention_merge_kernel"):
        mla._forward(q_latent, q_rope, cache, tables, seq_lens, cu, out, 0.1, rank, 4 if split else 1)
    (launch,) = launches
    c = launch.constexprs
    assert c["INDEX_64"] or not index_64
    label = (f"{what:30s} {dtype} L={rank} R={rope} H={heads} bs={block_size} n={c['BLOCK_N']} rows={c['BLOCK_R']} "
             f"w{launch.num_warps}")
    try:
        kernel = launch.compile(mla.mla_attention_kernel)
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
