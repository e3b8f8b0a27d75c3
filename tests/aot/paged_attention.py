"""Compile the paged-attention kernels for sm_90 without register spills: decode with the GQA group as
the rows of a ``tl.dot`` (group 4 and 8, padded to 16 rows) and with the elementwise path (group 1), an
fp8 cache feeding bf16 dots, split-KV partials, packed queries (the binary search over cu_seqlens_q)
with a window and soft-capping, fp32 (TF32), head dim 256, int64 offsets, attention sinks (GPT-OSS, head
dim 64), v's own head dim (DeepSeek-V3's MLA prefill, 192/128), and the merge kernel (with sinks); the
block products of the dot paths on tensor cores. Prints each variant's registers, spills and shared memory.

Each variant is the one a launch builds: the op's launcher (``paged_attention._forward``) runs on CPU tensors
of real sizes (a decode batch of 32 sequences of up to 4,096 tokens, 8 KV heads) with its kernels replaced by
recorders (``utils.aot.record_launches``), and each recorded call is compiled at the specialization Triton's
launcher derives from its values (``utils.aot.compile_launched``: unit strides become constants, a head dim of
128 and strides of real shapes are divisible by 16, a split count of 1 is a constant). Listing the runtime
arguments by hand compiled a variant no launch runs: ``head_dim`` without its divisibility gave the bf16 GQA-4
decode 156 registers and scalar loads, where the launched one streams K and V with 16-byte ``cp.async`` copies.

Run by tests/test_kernels_compile_paged_attention.py in a compiled-mode child process (utils.aot.run_compiled).
``--quick`` (what ``make test`` runs) compiles the first four variants, the sinks decode, the MLA prefill and
the merge.
"""

import re
import sys

import torch

from kernel_ladder.ops import paged_attention as pa
from utils.aot import record_launches, resource_usage
from utils.sass import features

quick = "--quick" in sys.argv
failures, rows = [], []

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8e4nv": torch.float8_e4m3fn}
BATCH, KV_HEADS, MAX_LEN = 32, 8, 4096  # a decode batch at real sizes
PACKED_LENGTHS = [1, 700, 33, 1500, 257, 64, 2000, 5]  # queries per sequence when packed (prefill + decode)
#: The bf16 GQA-4 decode's register bound: the launched variant allocates 107 (the mis-specialized one 156).
DECODE_REGISTER_BOUND = 128
#: A 16-byte asynchronous global -> shared copy (how the pipelined loop streams K and V).
CP_ASYNC_16 = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\d+B)?\s+\[[^]]+\],\s*\[[^]]+\],\s*(?:16|0x10)\b")


def launches(q_dtype, cache_dtype, head_dim, block_size, group, varlen=False, split=False, window=False,
             softcap=False, index_64=False, sinks=False, head_dim_v=None):
    """The kernel calls the op's launcher makes for this variant, recorded (nothing runs)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q_type, cache_type = DTYPES[q_dtype], DTYPES[cache_dtype]
    heads_q = KV_HEADS * group
    max_blocks = MAX_LEN // block_size
    # int64 offsets: a cache past 2**31 elements (never touched: torch.empty only reserves it)
    num_blocks = (2**31 // (block_size * KV_HEADS * head_dim) + 1) if index_64 else BATCH * max_blocks
    lengths = PACKED_LENGTHS if varlen else [1] * BATCH
    num_seqs, rows_q = len(lengths), sum(lengths)
    q = torch.empty(rows_q, heads_q, head_dim, dtype=q_type)
    k_cache = torch.empty(num_blocks, block_size, KV_HEADS, head_dim, dtype=cache_type)
    v_cache = torch.empty(num_blocks, block_size, KV_HEADS, head_dim_v, dtype=cache_type)
    out = torch.empty(rows_q, heads_q, head_dim_v, dtype=q_type)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), MAX_LEN, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if varlen else None
    scale = torch.ones((), dtype=torch.float32)
    sink_logits = torch.zeros(heads_q, dtype=torch.float32) if sinks else None
    torch.backends.cuda.matmul.allow_tf32 = q_dtype == "fp32"  # the fp32 variant: a caller who allows TF32
    with record_launches(pa, "paged_attention_kernel") as attention, \
            record_launches(pa, "paged_attention_merge_kernel") as merge:
        pa._forward(q, k_cache, v_cache, block_tables, seq_lens, cu, scale, scale, out, head_dim**-0.5,
                    128 if window else None, 30.0 if softcap else None, 4 if split else 1, sinks=sink_logits)
    assert len(attention) == 1 and len(merge) == int(split), (len(attention), len(merge))
    assert attention[0].constexprs["INDEX_64"] or not index_64  # (a large split may need int64 offsets too)
    return attention[0], merge


def variant(what, q_dtype, cache_dtype, head_dim, block_size, group, **flags):
    launch, merges = launches(q_dtype, cache_dtype, head_dim, block_size, group, **flags)
    c = launch.constexprs
    label = (f"{what:34s} {q_dtype}/{cache_dtype} D={head_dim}/{c['BLOCK_DV']} bs={block_size} rows={c['BLOCK_R']} "
             f"pages={c['PAGES']} w{launch.num_warps}")
    try:
        kernel = launch.compile(pa.paged_attention_kernel)
    except Exception as error:  # noqa: BLE001  (report every variant)
        failures.append(f"{label}: does not compile: {error}")
        return
    usage = resource_usage(kernel)
    spilled = 0 if usage is None else usage.spilled_bytes
    ptx = kernel.asm["ptx"]
    copies = "cp.async 16 B" if CP_ASYNC_16.search(ptx) else ("v4 loads" if "ld.global.v4" in ptx else "scalar")
    rows.append(f"{label:90s} registers {'?' if usage is None else usage.registers:>3}  spilled {spilled} B  "
                f"shared {kernel.metadata.shared} B  K/V: {copies}")
    if spilled:
        failures.append(f"{label}: spills {spilled} bytes")
    if c["USE_DOT"] and "mma" not in ptx:
        failures.append(f"{label}: the block products are not on tensor cores")
    if c["USE_DOT"] and q_dtype != "fp32" and not (CP_ASYNC_16.search(ptx) and features(kernel).cp_async):
        failures.append(f"{label}: K and V are not streamed by 16-byte cp.async copies (LDGSTS in the SASS)")
    if (what.startswith("decode, GQA 4") and usage is not None and usage.registers > DECODE_REGISTER_BOUND):
        failures.append(f"{label}: {usage.registers} registers > {DECODE_REGISTER_BOUND}")
    for merge in merges:
        merge_variant(f"merge of: {what}", merge)


def merge_variant(label, launch):
    try:
        kernel = launch.compile(pa.paged_attention_merge_kernel)
    except Exception as error:  # noqa: BLE001
        failures.append(f"{label}: does not compile: {error}")
        return
    usage = resource_usage(kernel)
    rows.append(f"{label:90s} registers {'?' if usage is None else usage.registers:>3}  "
                f"spilled {0 if usage is None else usage.spilled_bytes} B")
    if usage is not None and usage.spilled_bytes:
        failures.append(f"{label}: spills {usage.spilled_bytes} bytes")


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
    ("decode, GQA 8, sinks (GPT-OSS), split", "bf16", "bf16", 64, 16, 8, {"sinks": True, "split": True}),
    ("packed, GQA 8, sinks, window, split", "bf16", "bf16", 64, 16, 8, {"varlen": True, "sinks": True,
                                                                        "window": True, "split": True}),
    ("packed, MLA prefill 192/128", "bf16", "bf16", 192, 16, 1, {"varlen": True, "head_dim_v": 128}),
]
QUICK = VARIANTS[:4] + VARIANTS[-3:-2] + VARIANTS[-1:]
for what, q_dtype, cache_dtype, head_dim, block_size, group, flags in QUICK if quick else VARIANTS:
    variant(what, q_dtype, cache_dtype, head_dim, block_size, group, **flags)

print("\n".join(rows))
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
