"""Compile the flash-attention kernels for sm_90: forward, dK/dV, dQ and the preprocess, in bf16 at head dims
64, 128 and 256 — every GPU tile configuration at every head dim up to its ``max_head_dim`` — with no
register spills and the block products on tensor cores (Hopper's warp-group ``wgmma`` where a product
has 64 rows or more); soft-capping (with a window) and fp32 (TF32 products) at each config's own
limits for them; the other switches (non-causal, varlen, int64 offsets) once at head dim 128; the
attention sinks (GPT-OSS: head dim 64, with a window) and v's own head dim (DeepSeek-V3's MLA prefill:
q/k 192, padded to a 256 tile, and v 128) at every config that the pruner keeps for them.
Prints each variant's registers, spills and shared memory.

Run by tests/test_kernels_compile_flash_attention.py in a compiled-mode child process (utils.aot.run_compiled).
``--quick`` (what ``make test`` runs) compiles one configuration per kernel at head dims 64 and 128, and
the preprocess, and the sinks and MLA-prefill specializations once per kernel;
``KERNEL_LADDER_AOT_FULL=1`` runs everything.
"""

import sys

from kernel_ladder.ops.attention import backward, forward, problem
from kernel_ladder.ops.attention.configs import _GPU_CONFIGS, fits
from utils.aot import compile_kernel, resource_usage

FLOATS = {"sm_scale", "qk_scale", "softcap"}
STATS = {"lse_ptr", "lse2_ptr", "delta_ptr", "dlse_ptr", "sinks_ptr", "dsink_ptr"}
CU = {"cu_seqlens_q_ptr", "cu_seqlens_k_ptr", "check_ptr", "block_count_ptr", "block_index_ptr"}
# Unit feature strides become constants (Triton's launcher specializes 1); strides and head dims of
# real shapes are multiples of 16. Lengths, the group size and the window are runtime values.
UNIT = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod", "stride_dkd", "stride_dvd", "stride_dqd",
        "stride_lm", "stride_gm", "stride_dm", "stride_sink"}
RUNTIME = {"seqlen_q", "seqlen_k", "group_size", "window", "n_rows", "n_heads", "BUCKET_Q", "BUCKET_K"}
KERNELS = {"forward": forward.flash_attention_forward_kernel, "dkdv": backward.flash_attention_backward_dkdv_kernel,
           "dq": backward.flash_attention_backward_dq_kernel}


def compile_one(fn, dtype, constexprs, num_warps, num_stages=None):
    def types(name):
        if name in STATS:
            return "*fp32"
        if name in CU:
            return "*i32"
        if name.endswith("_ptr"):
            return "*" + dtype
        return "fp32" if name in FLOATS else "i32"

    divisible = lambda name: name not in RUNTIME and name not in UNIT and name not in FLOATS  # noqa: E731
    return compile_kernel(fn, types, constexprs, ones=UNIT, divisible=divisible, num_warps=num_warps,
                          num_stages=num_stages)


def switches(causal=True, window=False, softcap=False, varlen=False, index_64=False, precision="ieee",
             block_sparse=False):
    return {"CAUSAL": causal, "HAS_WINDOW": window, "SOFTCAP": softcap, "VARLEN": varlen, "INDEX_64": index_64,
            "INPUT_PRECISION": precision, "BLOCK_SPARSE": block_sparse}


quick = "--quick" in sys.argv
failures, rows = [], []


def run(kind, dtype, head_dim, config, flags, head_dim_v=None, sinks=False):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    constexprs = {**flags, "BLOCK_D": head_dim, "BLOCK_DV": head_dim_v, "SAME_DV": head_dim_v == head_dim,
                  "BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N}
    if kind == "forward":  # the sinks are the forward's switch (the backward reads lse as it is)
        constexprs["HAS_SINKS"] = sinks
    what = (f"{kind:7s} {dtype} D={head_dim:3d}" + (f"/{head_dim_v}" if head_dim_v != head_dim else "")
            + f" {str(config):16s} " + " ".join(name.lower() for name, on in flags.items() if on is True)
            + (" sinks" if sinks else ""))
    try:
        kernel = compile_one(KERNELS[kind], dtype, constexprs, config.num_warps, config.num_stages)
    except Exception as error:  # noqa: BLE001  (report every variant)
        failures.append(f"{what}: does not compile: {error}")
        return
    usage = resource_usage(kernel)
    registers = "?" if usage is None else usage.registers
    spilled = 0 if usage is None else usage.spilled_bytes
    rows.append(f"{what:56s} registers {registers:>3}  spilled {spilled} B  shared {kernel.metadata.shared} B")
    if spilled:
        failures.append(f"{what}: spills {spilled} bytes")
    ptx = kernel.asm["ptx"]
    # The block products' M dim is BLOCK_M (forward, dQ) or BLOCK_N (dK/dV, computed transposed):
    # Hopper's warp-group MMA needs 64 rows; below that, mma.sync tensor-core ops.
    rows_of_products = config.BLOCK_N if kind == "dkdv" else config.BLOCK_M
    if dtype == "bf16" and rows_of_products >= 64 and "wgmma.mma_async" not in ptx:
        failures.append(f"{what}: the block products are not wgmma")
    if "mma" not in ptx:
        failures.append(f"{what}: the block products are not on tensor cores")


def kept_for(kind, block_d, block_dv=None, window=False):
    """The configs the pruner keeps for a 16-bit launch at head-dim tiles ``block_d``, ``block_dv`` (no soft-cap)."""
    return [c for c in _GPU_CONFIGS[kind]
            if fits(c, kind, block_d, 2, shared_memory=227 * 1024, block_dv=block_dv, window=window)]


for kind in ("forward", "dkdv", "dq"):
    # DeepSeek-V3's MLA prefill: q/k 192 (a 256 tile), v 128 (every config kept for it: ptxas allocates the
    # mixed tiles differently, see AttentionConfig.max_head_dim_narrow_v); GPT-OSS: sinks at head dim 64
    for config in kept_for(kind, 256, 128)[:1] if quick else kept_for(kind, 256, 128):
        run(kind, "bf16", 256, config, switches(), head_dim_v=128, sinks=kind == "forward")
    if not quick:  # and each config at its own limit for a narrower v, v half as wide
        for config in _GPU_CONFIGS[kind]:
            limit = config.head_dim_limit(2, narrow_v=True)
            if 64 <= limit < 256:
                run(kind, "bf16", limit, config, switches(), head_dim_v=limit // 2)
    if kind == "forward":
        for config in kept_for(kind, 64, window=True)[:1] if quick else kept_for(kind, 64, window=True):
            run(kind, "bf16", 64, config, switches(window=True), sinks=True)
    configs = _GPU_CONFIGS[kind]
    for head_dim in (64, 128) if quick else (64, 128, 256):  # bf16, causal: each config up to its limit
        kept = [c for c in configs if head_dim <= c.max_head_dim]
        for config in kept[:1] if quick else kept:
            run(kind, "bf16", head_dim, config, switches())
    if quick:
        continue
    for config in configs:  # soft-capping (with a window) at each config's limit for it
        limit = config.head_dim_limit(2, softcap=True)
        if limit >= 64:
            run(kind, "bf16", limit, config, switches(window=True, softcap=True))
    for config in configs:  # a sliding window without soft-capping (Mistral, GPT-OSS) at each config's limit for it
        run(kind, "bf16", config.head_dim_limit(2, window=True), config, switches(window=True))
    for config in configs:  # fp32 operands (TF32 products) at their own limit
        if config.head_dim_limit(4) >= 64:
            run(kind, "fp32", config.head_dim_limit(4), config, switches(precision="tf32"))
    config = next(c for c in configs if c.max_head_dim >= 128)  # the other switches once, at D = 128
    for flags in (switches(causal=False), switches(varlen=True), switches(index_64=True),
                  switches(causal=False, block_sparse=True)):
        run(kind, "bf16", 128, config, flags)
for dtype in ("bf16",) if quick else ("bf16", "fp32"):
    for index_64 in (False,) if quick else (False, True):
        compile_one(backward.flash_attention_backward_preprocess_kernel, dtype,
                    {"HAS_DLSE": index_64, "HAS_SINKS": not index_64, "INDEX_64": index_64, "BLOCK_M": 64,
                     "BLOCK_D": 128}, num_warps=4)
compile_one(problem.flash_attention_cu_seqlens_kernel, "bf16", {"BLOCK": 1024}, num_warps=4)
print("\n".join(rows))
print(f"{len(rows)} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
