"""Compile the flash-attention kernels for sm_90: forward, dK/dV, dQ and the preprocess, in bf16 at head dims
64, 128 and 256 — every GPU tile configuration at every head dim up to its ``max_head_dim`` — with no
register spills and the block products on tensor cores (Hopper's warp-group ``wgmma`` where a product
has 64 rows or more); soft-capping (with a window) and fp32 (TF32 products) at each config's own
limits for them; the other switches (non-causal, varlen, int64 offsets, block-sparse) once at head dim 128;
the attention sinks (GPT-OSS: head dim 64, with a window) and v's own head dim (DeepSeek-V3's MLA prefill:
q/k 192, padded to a 256 tile, and v 128) at every config that the pruner keeps for them.
The forward compiles each variant twice, with K and V through ``cp.async`` (masked loads) and through tensor
descriptors (``USE_TMA``, the TMA), each at its own limits. Prints each variant's registers, spills and shared
memory.

Each variant is the one a launch builds: the op's public function (``flash_attention``,
``flash_attention_varlen``, ``block_sparse_attention``, and autograd for the backward) runs on CPU tensors of
real sizes (one sequence, 32 query heads over 8 KV heads) with the tile config under test forced and its kernels
replaced by recorders (``utils.aot.record_launches``); each recorded call is compiled at the specialization
Triton's launcher derives from its values (``utils.aot.compile_launched``) with the constexprs the launcher
chose. The length decides that specialization (the lengths and buckets themselves are never specialized: the
kernels' ``do_not_specialize``), so each variant stands for one of two sets of launches:

* ``T=8192``, lengths divisible by 16 (an 8k context; every power-of-two context): the window argument (4,096,
  Mistral's; 0 without a window), the lse rows' stride and the preprocess's row count get the divisibility
  attribute; and the int64 offsets are on (``INDEX_64``, marked "int64 offsets"), because the launcher's bound
  on a tile's overrun (256 times the largest stride, here the batch stride of 32 x 8192 x D) passes 2**31;
* ``T=1000``, lengths not divisible by 16 (and a window of 300): those are plain runtime values, and the
  offsets 32-bit.

ptxas allocates int64 offsets in more registers: the hand-listed signature this replaced compiled them once (the
first config at head dim 128), and missed that the dK/dV 32 x 64 w4 s3 tiles at head dim 128 spill 32 bytes at
255 registers when an 8k context launches them (238 registers, no spill, with 32-bit offsets), and the forward's
64 x 128 w8 s2 with ``cp.async`` 112 bytes.

Run by tests/test_kernels_compile_flash_attention.py in a compiled-mode child process (utils.aot.run_compiled).
``--quick`` (what ``make test`` runs) compiles, at ``T=8192``, one configuration per kernel at head dims 64 and
128, every dK/dV configuration the pruner keeps at head dim 128, the preprocess, the sinks and MLA-prefill
specializations once per kernel, and the forward's 128 x 128 tiles at head dim 128 with tensor descriptors;
``KERNEL_LADDER_AOT_FULL=1`` runs everything, at both ``T=8192`` and ``T=1000``.
"""

import contextlib
import sys

import torch

import kernel_ladder
from kernel_ladder import runtime
from kernel_ladder.ops import block_sparse_attention as block_sparse
from kernel_ladder.ops.attention import backward, configs, forward, launch, problem
from kernel_ladder.ops.attention.configs import _GPU_CONFIGS, fits
from utils.aot import record_launches, resource_usage

KERNELS = {"forward": forward.flash_attention_forward_kernel, "dkdv": backward.flash_attention_backward_dkdv_kernel,
           "dq": backward.flash_attention_backward_dq_kernel}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HEADS, KV_HEADS = 32, 8  # grouped-query attention, a group of 4 (Llama-3 8B's heads)
#: The two sets of launches (see the module): the lengths, and the sliding window used with them.
LENGTHS = {8192: 4096, 1000: 300}

quick = "--quick" in sys.argv
failures, rows = [], []


class _Table:
    """A dict's entries as attributes: ``record_launches`` patches an attribute, the launcher looks its kernels
    up in ``configs._KERNELS``."""

    def __init__(self, table):
        object.__setattr__(self, "table", table)

    def __getattr__(self, name):
        return self.table[name]

    def __setattr__(self, name, value):
        self.table[name] = value


@contextlib.contextmanager
def launcher(config, tma):
    """The op's launcher with ``config`` forced (on every kernel) and ``tma`` the forward's choice, its kernels
    recorded, not run: yields {name: [Launch]}."""
    saved = (configs._fixed_config, block_sparse._config, launch._use_tma, runtime.require_launchable,
             problem.check_values)
    configs._fixed_config = lambda: config
    block_sparse._config = lambda block_size: config
    launch._use_tma = lambda k, v: tma
    runtime.require_launchable = lambda *args, **kwargs: None  # CPU tensors: a plan for sm_90, nothing launches
    problem.check_values = lambda tensors, ok, *args, **kwargs: ok()  # the cu_seqlens check's launch, its flag unread
    try:
        with contextlib.ExitStack() as stack:
            table = _Table(configs._KERNELS)
            recorded = {kind: stack.enter_context(record_launches(table, kind)) for kind in KERNELS}
            recorded["preprocess"] = stack.enter_context(
                record_launches(launch, "flash_attention_backward_preprocess_kernel"))
            recorded["cu_seqlens"] = stack.enter_context(record_launches(problem, "flash_attention_cu_seqlens_kernel"))
            yield recorded
    finally:
        (configs._fixed_config, block_sparse._config, launch._use_tma, runtime.require_launchable,
         problem.check_values) = saved


def launches(backward_too, dtype, head_dim, head_dim_v, length, config, causal=True, window=False, softcap=False,
             varlen=False, index_64=False, block_sparse_on=False, sinks=False, tma=False, dlse=False):
    """Every kernel call of one forward (and backward) of the op at ``length`` queries and keys, recorded."""
    t = DTYPES[dtype]
    grad = backward_too

    def empty(*shape, dtype=t):
        return torch.empty(shape, dtype=dtype).requires_grad_(grad and dtype.is_floating_point)

    if varlen:  # three packed sequences, ``length`` rows in all
        parts = [length // 2, length // 4, length - length // 2 - length // 4]
        q, k, v = empty(length, HEADS, head_dim), empty(length, KV_HEADS, head_dim), empty(length, KV_HEADS,
                                                                                           head_dim_v)
        cu = torch.tensor([0, *torch.tensor(parts).cumsum(0).tolist()], dtype=torch.int32)
    else:
        q = empty(1, HEADS, length, head_dim)
        if index_64:  # q's batch stride past 2**31 elements (reserved, never touched)
            base = torch.empty(2**31 + HEADS * length * head_dim, dtype=t)
            q = base.as_strided((2, HEADS, length, head_dim), (2**31, length * head_dim, head_dim, 1))
            q.requires_grad_(grad)
        batch = q.shape[0]
        k, v = empty(batch, KV_HEADS, length, head_dim), empty(batch, KV_HEADS, length, head_dim_v)
    sink_logits = torch.zeros(HEADS, dtype=torch.float32) if sinks else None
    options = dict(window=LENGTHS[length] if window else None, softcap=30.0 if softcap else None)
    torch.backends.cuda.matmul.allow_tf32 = dtype == "fp32"  # fp32: a caller who allows TF32
    with launcher(config, tma) as recorded:
        if block_sparse_on:
            blocks = -(-length // config.BLOCK_M)  # (the lists' block; the tiles are the config under test)
            mask = torch.ones(1, 1, blocks, blocks, dtype=torch.bool)
            out = kernel_ladder.block_sparse_attention(q, k, v, mask, block_size=config.BLOCK_M, return_lse=dlse)
        elif varlen:
            out = kernel_ladder.flash_attention_varlen(q, k, v, cu, cu, max(parts), max(parts), causal, **options,
                                                       return_lse=dlse, sinks=sink_logits)
        else:
            out = kernel_ladder.flash_attention(q, k, v, causal, **options, return_lse=dlse, sinks=sink_logits)
        if backward_too:
            outs = out if dlse else (out,)
            torch.autograd.grad(outs, (q, k, v), [torch.empty_like(o) for o in outs])
    return recorded


def switches(causal=True, window=False, softcap=False, varlen=False, index_64=False, precision="ieee",
             block_sparse=False):
    return {"causal": causal, "window": window, "softcap": softcap, "varlen": varlen, "index_64": index_64,
            "precision": precision, "block_sparse": block_sparse}


def lengths():
    return (8192,) if quick else tuple(LENGTHS)


def compile_launch(what, fn, launch_):
    try:
        kernel = launch_.compile(fn)
    except Exception as error:  # noqa: BLE001  (report every variant)
        failures.append(f"{what}: does not compile: {error}")
        return None
    usage = resource_usage(kernel)
    registers = "?" if usage is None else usage.registers
    spilled = 0 if usage is None else usage.spilled_bytes
    rows.append(f"{what:70s} registers {registers:>3}  spilled {spilled} B  shared {kernel.metadata.shared} B")
    print(rows[-1], flush=True)  # (the full run takes minutes: each row as it comes)
    if spilled:
        failures.append(f"{what}: spills {spilled} bytes")
    return kernel


def run(kind, dtype, head_dim, config, flags, head_dim_v=None, sinks=False, tma=False, length=None):
    """``kind`` at ``config`` as the launcher builds it, at each set of lengths (or ``length``)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    precision = flags["precision"]
    if (precision == "tf32") != (dtype == "fp32"):
        raise ValueError(f"tf32 products are fp32 inputs', got {dtype} with {precision}")
    for t in lengths() if length is None else (length,):
        what = (f"{kind:7s} {dtype} D={head_dim:3d}" + (f"/{head_dim_v}" if head_dim_v != head_dim else "")
                + f" {str(config):16s} T={t:<5d}" + " ".join(name for name, on in flags.items() if on is True)
                + (" sinks" if sinks else "") + (" tma" if tma else ""))
        recorded = launches(kind != "forward", dtype, head_dim, head_dim_v, t, config, flags["causal"],
                            flags["window"], flags["softcap"], flags["varlen"], flags["index_64"],
                            flags["block_sparse"], sinks=sinks, tma=tma)
        (launch_,) = recorded[kind]
        c = launch_.constexprs
        if c["INDEX_64"] and not flags["index_64"]:  # (an 8k context of 32 heads: a tile's overrun may pass 2**31)
            what += " (int64 offsets)"
        expected = {"BLOCK_M": config.BLOCK_M, "BLOCK_N": config.BLOCK_N, "INPUT_PRECISION": precision,
                    "BLOCK_SPARSE": flags["block_sparse"]}
        if flags["index_64"]:
            expected["INDEX_64"] = True
        if kind == "forward":
            expected |= {"USE_TMA": tma, "HAS_SINKS": sinks}
        wrong = {name: (c[name], value) for name, value in expected.items() if c[name] != value}
        if wrong or (launch_.num_warps, launch_.num_stages) != (config.num_warps, config.num_stages):
            failures.append(f"{what}: the launcher built another variant: {wrong}")
            continue
        kernel = compile_launch(what, KERNELS[kind], launch_)
        if kernel is None:
            continue
        ptx = kernel.asm["ptx"]
        # The block products' M dim is BLOCK_M (forward, dQ) or BLOCK_N (dK/dV, computed transposed):
        # Hopper's warp-group MMA needs 64 rows; below that, mma.sync tensor-core ops.
        rows_of_products = config.BLOCK_N if kind == "dkdv" else config.BLOCK_M
        if dtype == "bf16" and rows_of_products >= 64 and "wgmma.mma_async" not in ptx:
            failures.append(f"{what}: the block products are not wgmma")
        if "mma" not in ptx:
            failures.append(f"{what}: the block products are not on tensor cores")
        if tma and "cp.async.bulk.tensor" not in ptx:
            failures.append(f"{what}: K and V are not loaded through tensor descriptors")


def kept_for(kind, block_d, block_dv=None, window=False, tma=False):
    """The configs the pruner keeps for a 16-bit launch at head-dim tiles ``block_d``, ``block_dv`` (no soft-cap)."""
    return [c for c in _GPU_CONFIGS[kind]
            if fits(c, kind, block_d, 2, shared_memory=227 * 1024, block_dv=block_dv, window=window, tma=tma)]


def forward_with_tma():
    """The forward's own limits with K and V through tensor descriptors (``USE_TMA``, what aligned inputs get): each
    config where that raises its bf16 limit (quick: the first such), and in full every variant again with TMA."""
    widened = [c for c in _GPU_CONFIGS["forward"] if c.head_dim_limit(2, tma=True) > c.max_head_dim]
    for config in widened[:1] if quick else widened:
        run("forward", "bf16", config.head_dim_limit(2, tma=True), config, switches(), tma=True)
    if quick:
        return
    for head_dim in (64, 128, 256):
        for config in _GPU_CONFIGS["forward"]:
            if head_dim <= config.head_dim_limit(2, tma=True):
                run("forward", "bf16", head_dim, config, switches(), tma=True)
    for config in kept_for("forward", 256, 128, tma=True):
        run("forward", "bf16", 256, config, switches(), head_dim_v=128, sinks=True, tma=True)
    for config in kept_for("forward", 64, window=True, tma=True):
        run("forward", "bf16", 64, config, switches(window=True), sinks=True, tma=True)
    for config in _GPU_CONFIGS["forward"]:
        run("forward", "bf16", config.head_dim_limit(2, window=True, tma=True), config, switches(window=True),
            tma=True)
        limit = config.head_dim_limit(2, softcap=True, tma=True)
        if limit:
            run("forward", "bf16", limit, config, switches(window=True, softcap=True), tma=True)
        if config.head_dim_limit(4, tma=True):
            run("forward", "fp32", config.head_dim_limit(4, tma=True), config, switches(precision="tf32"), tma=True)
        if config.head_dim_limit(2, tma=True) >= 128:
            for flags in (switches(causal=False), switches(varlen=True), switches(index_64=True),
                          switches(causal=False, block_sparse=True)):
                run("forward", "bf16", 128, config, flags, tma=True)


forward_with_tma()
for kind in ("forward", "dkdv", "dq"):
    # DeepSeek-V3's MLA prefill: q/k 192 (a 256 tile), v 128 (every config kept for it: ptxas allocates the
    # mixed tiles differently, see AttentionConfig.max_head_dim_narrow_v); GPT-OSS: sinks at head dim 64
    for config in kept_for(kind, 256, 128)[:1] if quick else kept_for(kind, 256, 128):
        run(kind, "bf16", 192, config, switches(), head_dim_v=128, sinks=kind == "forward")
    if not quick:  # and each config at its own limit for a narrower v, v half as wide
        for config in _GPU_CONFIGS[kind]:
            limit = config.head_dim_limit(2, narrow_v=True)
            if 64 <= limit < 256:
                run(kind, "bf16", limit, config, switches(), head_dim_v=limit // 2)
    if kind == "forward":
        for config in kept_for(kind, 64, window=True)[:1] if quick else kept_for(kind, 64, window=True):
            run(kind, "bf16", 64, config, switches(window=True), sinks=True)
    configs_ = _GPU_CONFIGS[kind]
    for head_dim in (64, 128) if quick else (64, 128, 256):  # bf16, causal: each config up to its limit
        kept = [c for c in configs_ if head_dim <= c.max_head_dim]
        # quick: the first at each; every dK/dV config at 128 (the 8k-context training launch's candidates)
        for config in kept if not quick or (kind, head_dim) == ("dkdv", 128) else kept[:1]:
            run(kind, "bf16", head_dim, config, switches())
    if quick:
        continue
    for config in configs_:  # soft-capping (with a window) at each config's limit for it
        limit = config.head_dim_limit(2, softcap=True)
        if limit:  # (0: never with soft-capping)
            run(kind, "bf16", limit, config, switches(window=True, softcap=True))
    for config in configs_:  # a sliding window without soft-capping (Mistral, GPT-OSS) at each config's limit for it
        run(kind, "bf16", config.head_dim_limit(2, window=True), config, switches(window=True))
    for config in configs_:  # fp32 operands (TF32 products) at their own limit
        if config.head_dim_limit(4):
            run(kind, "fp32", config.head_dim_limit(4), config, switches(precision="tf32"))
    config = next(c for c in configs_ if c.max_head_dim >= 128)  # the other switches once, at D = 128
    for flags in (switches(causal=False), switches(varlen=True), switches(index_64=True),
                  switches(causal=False, block_sparse=True)):
        run(kind, "bf16", 128, config, flags)

# The preprocess (delta, lse2, the sinks' terms) and the cu_seqlens check, as a backward and a varlen call launch them
for dtype in ("bf16",) if quick else ("bf16", "fp32"):
    for t in lengths():
        for index_64 in (False,) if quick else (False, True):
            recorded = launches(True, dtype, 128, 128, t, _GPU_CONFIGS["dkdv"][1], index_64=index_64,
                                sinks=not index_64, dlse=index_64)
            (pre,) = recorded["preprocess"]
            c = pre.constexprs
            compile_launch(f"preprocess {dtype} D=128 T={t:<5d}" + " ".join(
                name.lower() for name in ("HAS_DLSE", "HAS_SINKS", "INDEX_64") if c[name]),
                backward.flash_attention_backward_preprocess_kernel, pre)
recorded = launches(False, "bf16", 128, 128, 8192, _GPU_CONFIGS["forward"][0], varlen=True)
for check in recorded["cu_seqlens"]:
    compile_launch("cu_seqlens check", problem.flash_attention_cu_seqlens_kernel, check)
print(f"{len(rows)} variants compiled")
print("\n".join(failures) or "ok")
sys.exit(1 if failures else 0)
