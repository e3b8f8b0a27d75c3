"""Chapter 09's ladders: the mixture-of-experts block (a Python loop over experts -> the chapter's ops
composed, seven of them -> kernel_ladder.moe) at 4, 8 and 16 experts, the grouped GEMM alone (a matmul per
expert -> kernel_ladder.grouped_matmul, one launch), block-sparse attention (SDPA with the block mask as a
token mask -> dense flash attention -> kernel_ladder.block_sparse_attention), and the FLOPs of block-sparse
attention against the mask's density (the report's plot)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import Figure, Ladder, Step, register, register_figure
from kernel_ladder.ops.block_sparse_attention import bigbird_mask, sliding_window_mask
from solutions import ch09_moe as solutions
from utils.traffic import moe_ideal_bytes

#: Experts per token in every MoE ladder (Mixtral's top 2).
TOP_K = 2
#: (tokens, hidden, ffn) of the MoE block: small on the CPU (H = F = 64: the interpreter's grouped GEMM
#: tiles are 64 columns wide, so down is one column tile and gate/up, 2F wide, two), Mixtral-8x7B's
#: experts on a GPU.
MOE_SIZES = {"cpu": (128, 64, 64), "gpu": (4096, 4096, 14336)}
#: The expert counts of the MoE ladders: the loop's launches grow with E, the composed ops' do not.
MOE_EXPERTS = (4, 8, 16)
#: (tokens, K, N, experts) of the grouped GEMM ladder: the block's down projection (K = ffn, N = hidden)
#: over tokens * TOP_K rows sorted by expert.
GROUPED_SIZES = {"cpu": (128, 64, 64, 8), "gpu": (4096, 14336, 4096, 8)}
#: (B, H, T, D, block size) of the block-sparse attention ladder and figure.
BSA_SIZES = {"cpu": (1, 1, 1024, 64, 64), "gpu": (1, 16, 16384, 128, 128)}
#: The chapter's target for its production forward kernels: at most this multiple of the
#: ideal bytes. Enforced as a bound on grouped_matmul and block_sparse_attention; kernel_ladder.moe is reported
#: against it but not bound: it composes routing, permutation, two grouped GEMMs and a combine, and its
#: bytes move with how the router spreads the tokens.
TARGET_BOUND = 1.1


# ----------------------------------------------------------------------------------------------
# The MoE block
# ----------------------------------------------------------------------------------------------


def moe_inputs(device, dtype, shape: tuple[int, int, int], experts: int, seed: int = 9, skew: float = 0.0):
    """``(x, router_logits, w_gate_up, w_down)`` for ``shape = (tokens, hidden, ffn)`` in HF's MixtralExperts
    layout; fp32 logits (``skew`` favours the low experts), weights scaled by 1/sqrt(fan-in) so that every
    activation is O(1)."""
    tokens, hidden, ffn = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    logits = solutions.router_inputs(tokens, experts, skew=skew, seed=seed + 1, device=device)
    w_gate_up = (torch.randn(experts, 2 * ffn, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    w_down = (torch.randn(experts, hidden, ffn, generator=gen) * ffn**-0.5).to(device, dtype)
    return x, logits, w_gate_up, w_down


def routed_experts(router_logits: torch.Tensor, top_k: int = TOP_K) -> torch.Tensor:
    """The ``(T, k)`` expert ids Mixtral's router picks (a float64 softmax, then the top k)."""
    return solutions.routing_reference(router_logits, top_k, True)[1]


def moe_reference(x, router_logits, w_gate_up, w_down, top_k: int = TOP_K, renormalize: bool = True):
    return solutions.experts_loop(x.double(), router_logits.double(), w_gate_up.double(), w_down.double(), top_k,
                                  renormalize)


def moe_ideal(x, router_logits, w_gate_up, w_down, out) -> int:
    return moe_ideal_bytes(x, router_logits, w_gate_up, w_down, routed_experts(router_logits))


MOE_LOOP = "torch: a loop over experts (HF MixtralExperts)"
MOE_NOTE = ("T=128 tokens, H=64, F=64, top 2, fp16 on the CPU; Mixtral-8x7B's experts (T=4096, H=4096, "
            "F=14336) on a GPU. The ideal (utils.traffic.moe_ideal_bytes) reads x, the logits and each used "
            "expert's weights once, writes out once, and keeps the activated rows (T·k, F) and the down "
            "rows (T·k, H) one round trip each. The chapter's target for kernel_ladder.moe is at most "
            f"{TARGET_BOUND}× the ideal, enforced from E=8, where every expert's rows fit one 64-row tile of "
            "the interpreter's config; at E=4 the groups average 64 rows, so most take two row tiles and "
            "each of those reads its expert's weights again (the trace has no cache; on a GPU the L2 serves "
            "the second read). The torch loop is a launch and traffic baseline, "
            "unchecked: in fp16 on the CPU it casts the routing weights to fp16 and sums with an fp16 "
            "index_add_, which lands at the edge of the fp16 tolerance. Its FLOPs are the useful 2·T·k·3·H·F; "
            "the grouped GEMMs' count whole row tiles (64 rows in the interpreter, about T·k/E rows per "
            "expert here), so they grow with E")


def _moe_ladder(experts: int) -> Ladder:
    return register(
        Ladder(
            chapter="09_moe",
            op=f"moe block, E={experts}",
            make_inputs=lambda device, dtype, size, e=experts: moe_inputs(device, dtype, MOE_SIZES[size], e),
            reference=moe_reference,
            dtype=torch.float16,
            steps=[
                Step(MOE_LOOP, lambda *a: solutions.experts_loop(*a, TOP_K), baseline=True),
                Step("kernel_ladder ops composed (route, sort, gather, GEMM, swiglu, GEMM, combine)",
                     lambda *a: solutions.moe_unfused(*a, TOP_K)),
                Step("kernel_ladder.moe", lambda *a: kernel_ladder.moe(*a, TOP_K),
                     bound=TARGET_BOUND if experts >= 8 else None),
            ],
            ideal_bytes=moe_ideal,
            note=MOE_NOTE if experts == MOE_EXPERTS[0] else f"as at E={MOE_EXPERTS[0]}, with {experts} experts",
            tags={"unchecked_steps": [MOE_LOOP]},
        )
    )


for _experts in MOE_EXPERTS:
    _moe_ladder(_experts)


# ----------------------------------------------------------------------------------------------
# The grouped GEMM
# ----------------------------------------------------------------------------------------------


def grouped_inputs(device, dtype, size: str, seed: int = 10):
    """``(x, w, offsets)``: the activated rows of ``tokens * TOP_K`` routed entries, sorted by expert
    (``(M, K)``), the down weights read transposed as ``kernel_ladder.moe`` reads them (``w_down (E, N, K)``
    viewed ``(E, K, N)``, no copy), and each expert's cumulative end (int32)."""
    tokens, k_dim, n_dim, experts = GROUPED_SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = routed_experts(solutions.router_inputs(tokens, experts, seed=seed))
    _, offsets = solutions.counting_sort(ids, experts)
    x = torch.randn(tokens * TOP_K, k_dim, generator=gen).to(device, dtype)
    w = (torch.randn(experts, n_dim, k_dim, generator=gen) * k_dim**-0.5).to(device, dtype).transpose(1, 2)
    return x, w, offsets.to(device)


def grouped_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A matmul per expert into its rows of the output (the group sizes read on the host: a sync);
    rows past the last group zeroed, as kernel_ladder.grouped_matmul does."""
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    if start < x.shape[0]:
        out[start:].zero_()
    return out


register(
    Ladder(
        chapter="09_moe",
        op="grouped GEMM (down projection)",
        make_inputs=grouped_inputs,
        reference=lambda x, w, offsets: grouped_loop(x.double(), w.double(), offsets),
        dtype=torch.float16,
        steps=[
            Step("torch: a matmul per expert (sizes read on the host)", grouped_loop, baseline=True),
            Step("kernel_ladder.grouped_matmul (one launch)", kernel_ladder.grouped_matmul, bound=TARGET_BOUND),
        ],
        ideal_bytes=kernel_ladder.grouped_matmul_ideal_bytes,
        note=("256 rows (128 tokens, top 2) over 8 experts, K=64, N=64, fp16 on the CPU (N is one column "
              "tile: a wider N reads x once per column tile); Mixtral's down projection "
              "(8192 rows, K=14336, N=4096) on a GPU. The ideal reads x and each used expert's weight once "
              "and writes out once. On the CPU the op also checks its offsets with a few torch ops (and one "
              "host read), counted in its launches; its FLOPs count whole 64-row tiles (about 32 rows per "
              "expert here), torch's only the rows"),
    )
)


# ----------------------------------------------------------------------------------------------
# Block-sparse attention
# ----------------------------------------------------------------------------------------------


def token_mask(block_mask: torch.Tensor, block_size: int, seq_q: int, seq_k: int) -> torch.Tensor:
    """The ``(.., Tq, Tk)`` token mask of a ``(.., Q, K)`` block mask: every entry of an allowed tile."""
    expanded = block_mask.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    return expanded[..., :seq_q, :seq_k]


def masked_attention(q, k, v, block_mask, block_size: int):
    """Eager attention over the mask's tiles only (grouped-query heads repeated): the reference."""
    visible = token_mask(block_mask, block_size, q.shape[2], k.shape[2])
    group = q.shape[1] // k.shape[1]
    k, v = (torch.repeat_interleave(t, group, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def sdpa_masked(q, k, v, visible):
    """What torch does without a block-sparse kernel: SDPA with a dense ``(.., Tq, Tk)`` token mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])


def visited_tiles(q: torch.Tensor, block_mask: torch.Tensor) -> int:
    """Allowed (batch, head, query block, key block) tiles: the tiles block-sparse attention computes."""
    batch, heads = q.shape[:2]
    return int(block_mask.expand(batch, heads, *block_mask.shape[2:]).sum())


def block_sparse_ideal(q, k, v, block_mask, out, block_size: int) -> int:
    """q, out and the log-sum-exp once; the K and V rows of every allowed tile once per query block
    (what the kernel's programs must load, like chapter 07's ``forward_ideal``)."""
    batch, heads, seq_k = q.shape[0], q.shape[1], k.shape[2]
    rows = torch.tensor([min(block_size, seq_k - j * block_size) for j in range(block_mask.shape[-1])])
    allowed = block_mask.expand(batch, heads, *block_mask.shape[2:]).cpu()
    kv_rows = int((allowed.sum(dim=(0, 1, 2)) * rows).sum())
    per_row = 2 * q.shape[3] * k.element_size()
    return (q.numel() * q.element_size() + out.numel() * out.element_size() + batch * heads * q.shape[2] * 4
            + kv_rows * per_row)


def _ladder_block(q: torch.Tensor, block_mask: torch.Tensor) -> int:
    """The ladder's block size: its sequences are whole blocks (BSA_SIZES)."""
    block, rest = divmod(q.shape[2], block_mask.shape[-2])
    assert rest == 0, "the ladder's sequence length is a multiple of its block size"
    return block


def bsa_inputs(device, dtype, size: str, seed: int = 11):
    """``(q, k, v, block_mask)``: a BigBird mask (3 window blocks, 1 global, 2 random per query block)."""
    batch, heads, seq, d, block = BSA_SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, d, generator=gen).to(device, dtype) for _ in range(3))
    blocks = -(-seq // block)
    return q, k, v, bigbird_mask(blocks, blocks, num_heads=heads, seed=seed, device=device)


BSA_DENSE = "kernel_ladder.flash_attention (dense: every block)"

register(
    Ladder(
        chapter="09_moe",
        op="block-sparse attention (BigBird)",
        make_inputs=bsa_inputs,
        reference=lambda q, k, v, m: masked_attention(q.double(), k.double(), v.double(), m, _ladder_block(q, m)),
        steps=[
            Step("torch: SDPA, the block mask as a token mask",
                 lambda q, k, v, m: sdpa_masked(q, k, v, token_mask(m, _ladder_block(q, m), q.shape[2], k.shape[2])),
                 baseline=True),
            Step(BSA_DENSE, lambda q, k, v, m: kernel_ladder.flash_attention(q, k, v)),
            Step("kernel_ladder.block_sparse_attention",
                 lambda q, k, v, m: kernel_ladder.block_sparse_attention(q, k, v, m, _ladder_block(q, m)),
                 bound=TARGET_BOUND),
        ],
        ideal_bytes=lambda q, k, v, m, out: block_sparse_ideal(q, k, v, m, out, _ladder_block(q, m)),
        note=("B=1 H=1 T=1024 D=64 fp32, blocks of 64 (16 x 16) on the CPU, a BigBird mask (3 window blocks, "
              "1 global, 2 random); the ideal reads q once and K/V once per allowed tile. Dense flash "
              "attention computes every tile (unchecked: another function, kept as the dense FLOPs and "
              "bytes baseline)"),
        tags={"unchecked_steps": [BSA_DENSE]},
    )
)


def density_masks(blocks: int, heads: int = 1) -> dict[str, torch.Tensor]:
    """The figure's masks, of distinct densities: sliding windows of several widths, one with a global
    block, BigBird (3 window blocks, 1 global, 2 random), every block."""
    masks = {f"window {w} block{'s' if w > 1 else ''}": sliding_window_mask(blocks, blocks, w)
             for w in (1, 2, 4, 12) if w <= blocks}
    masks["window 3 + 1 global block"] = sliding_window_mask(blocks, blocks, 3, 1)
    masks["BigBird (3, 1, 2)"] = bigbird_mask(blocks, blocks, num_heads=heads)
    masks["every block"] = torch.ones(1, 1, blocks, blocks, dtype=torch.bool)
    return masks


def _flops_against_density(ax) -> str:
    """Traced FLOPs of kernel_ladder.block_sparse_attention against the mask's density, with the line
    density x the dense kernel_ladder.flash_attention's traced FLOPs."""
    from utils.trace import trace

    batch, heads, seq, d, block = BSA_SIZES["cpu"]
    device = kernel_ladder.runtime.DEVICE
    gen = torch.Generator(device="cpu").manual_seed(12)
    q, k, v = (torch.randn(batch, heads, seq, d, generator=gen).to(device) for _ in range(3))
    with trace() as dense:
        kernel_ladder.flash_attention(q, k, v)
    points = []
    for name, mask in density_masks(-(-seq // block), heads).items():
        mask = mask.to(device)
        with trace() as t:
            kernel_ladder.block_sparse_attention(q, k, v, mask, block)
        density = visited_tiles(q, mask) / (batch * heads * mask.shape[-2] * mask.shape[-1])
        points.append((name, density, t.flops, t.flops / (density * dense.flops)))
    points.sort(key=lambda p: p[1])
    ax.plot([0, 1], [0, dense.flops], "--", color="gray", label="density × dense flash_attention FLOPs")
    ax.plot([p[1] for p in points], [p[2] for p in points], "o", label="kernel_ladder.block_sparse_attention (traced)")
    for name, density, flops, _ in points:
        ax.annotate(name, (density, flops), textcoords="offset points", xytext=(6, -12), fontsize=7)
    ax.set_xlabel("mask density (allowed tiles / all tiles)")
    ax.set_ylabel("FLOPs, forward")
    ax.set_title(f"block-sparse attention, B={batch} H={heads} T={seq} D={d}, blocks of {block} (traced)", fontsize=10)
    ax.legend(fontsize=8)
    worst = max(abs(p[3] - 1) for p in points)
    listed = "; ".join(f"{name} (density {density:.3f}) {ratio:.3f}×" for name, density, _, ratio in points)
    return (f"Forward FLOPs of kernel_ladder.block_sparse_attention against the mask's density, traced in the "
            f"interpreter (B={batch}, H={heads}, T={seq}, D={d}, blocks of {block}), as a multiple of density × "
            f"the dense kernel_ladder.flash_attention's {dense.flops:,} FLOPs: {listed}. Every mask is within "
            f"{100 * worst:.1f}% of the line (the target: 5%): the kernel computes the allowed tiles and no others.")


register_figure(Figure(chapter="09_moe", name="flops_vs_density", draw=_flops_against_density))


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------


def grouped_mm_moe(x, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool = True):
    """The MoE block on ``torch._grouped_mm``: torch routing (softmax, top k), a stable argsort by expert,
    the rows gathered, gate/up and down as two grouped GEMMs (``mat_b`` ``(E, K, N)``: the weights read
    transposed, no copy; ``offs`` int32 cumulative ends), the SwiGLU between them, weighted ``index_add_``."""
    experts, two_f, _ = w_gate_up.shape
    ffn = two_f // 2
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=experts), dim=0).to(torch.int32)
    token = order // top_k
    gate_up = torch._grouped_mm(x[token], w_gate_up.transpose(1, 2), offs=offsets)
    hidden = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
    down = torch._grouped_mm(hidden, w_down.transpose(1, 2), offs=offsets)
    down = down * weights.flatten()[order, None].to(down.dtype)
    return torch.zeros_like(x).index_add_(0, token, down)


def grouped_mm_unavailable(*inputs, top_k: int = TOP_K) -> str:
    """Why :func:`grouped_mm_moe` cannot run on these inputs here ("" if it can): tried once."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        grouped_mm_moe(*inputs, top_k)
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
    except Exception as error:  # the reason is the result
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
    return ""


def _moe_flops(tokens: int, hidden: int, ffn: int, top_k: int) -> int:
    return 2 * tokens * top_k * 3 * hidden * ffn  # gate, up and down for every routed entry


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: kernel_ladder.moe in bf16 (forward and backward) against the torch loop over
    experts in float32, block-sparse attention against eager attention over the same tiles; then the MoE
    block timed at Mixtral-8x7B's sizes against the loop and a torch._grouped_mm composition, and
    block-sparse attention at a long sequence against SDPA with a token mask and dense flash attention."""
    from bench.gpu import Check, Timing, grads

    device = kernel_ladder.runtime.DEVICE
    real = size == "gpu"
    dtype = torch.bfloat16
    entries = []

    # Correctness: kernel_ladder.moe against the loop over experts in float32, forward and backward. The second
    # case is skewed (uneven, some empty groups), with more experts, top 6 and no renormalization.
    cases = ([(1000, 1024, 1536, 8, 2, True, 0.0), (333, 512, 768, 64, 6, False, 3.0)] if real
             else [(40, 32, 32, 4, 2, True, 0.0), (17, 32, 16, 8, 3, False, 3.0)])
    for tokens, hidden, ffn, experts, top_k, renormalize, skew in cases:
        a = moe_inputs(device, dtype, (tokens, hidden, ffn), experts, seed=13, skew=skew)
        label = f"moe T{tokens} H{hidden} F{ffn} E{experts} top{top_k}{'' if renormalize else ' unnormalized'}"

        def ours(*t, k=top_k, r=renormalize):
            return kernel_ladder.moe(*t, k, renormalize=r)

        def loop32(*t, k=top_k, r=renormalize):
            return solutions.experts_loop(*(u.float() for u in t), k, renormalize=r)

        entries.append(Check(label, dtype, lambda a=a, f=ours: f(*a), lambda a=a, f=loop32: f(*a)))
        g = torch.randn(a[0].shape, generator=torch.Generator().manual_seed(14)).to(device, dtype)
        entries.append(Check(f"{label} backward", dtype, lambda a=a, g=g, f=ours: grads(f, a, g),
                             lambda a=a, g=g, f=loop32: grads(f, a, g, upcast=True), tol=3e-2))
        if not grouped_mm_unavailable(*a, top_k=top_k):  # the timings' baseline, checked like ours
            entries.append(Check(f"{label}, torch._grouped_mm composition", dtype,
                                 lambda a=a, k=top_k, r=renormalize: grouped_mm_moe(*a, k, r),
                                 lambda a=a, f=loop32: f(*a)))

    # Correctness: block-sparse attention (grouped-query heads; off the GPU, a partial last block) against
    # eager attention over the same tiles in float32.
    batch, hq, hkv, seq, d = (2, 8, 2, 2048, 128) if real else (1, 2, 1, 100, 32)
    gen = torch.Generator(device="cpu").manual_seed(15)
    qkv = (torch.randn(batch, hq, seq, d, generator=gen).to(device, dtype),
           *(torch.randn(batch, hkv, seq, d, generator=gen).to(device, dtype) for _ in range(2)))
    for block in (64, 128) if real else (32,):
        blocks = -(-seq // block)
        for name, mask in (("BigBird", bigbird_mask(blocks, blocks, num_heads=hq, seed=block, device=device)),
                           ("sliding window", sliding_window_mask(blocks, blocks, 4, 1, device=device))):
            label = f"block_sparse_attention {name}, blocks of {block}"

            def bsa(*t, m=mask, b=block):
                return kernel_ladder.block_sparse_attention(*t, m, b)

            def eager32(*t, m=mask, b=block):
                return masked_attention(*(u.float() for u in t), m, b)

            entries.append(Check(label, dtype, lambda f=bsa: f(*qkv), lambda f=eager32: f(*qkv)))
            g = torch.randn(qkv[0].shape, generator=gen).to(device, dtype)
            entries.append(Check(f"{label} backward", dtype, lambda f=bsa, g=g: grads(f, qkv, g),
                                 lambda f=eager32, g=g: grads(f, qkv, g, upcast=True), tol=3e-2))

    # Timings: the MoE block at Mixtral-8x7B's sizes, bf16: the loop of F.linear per expert (HF's
    # MixtralExperts), the same block on torch._grouped_mm where this torch has it, and kernel_ladder.moe.
    tokens, hidden, ffn = MOE_SIZES["gpu"] if real else (64, 32, 32)
    a = moe_inputs(device, dtype, (tokens, hidden, ffn), 8, seed=16)
    op = f"moe bf16 T{tokens} H{hidden} F{ffn} E8 top{TOP_K}"
    common = {"bytes": moe_ideal_bytes(*a, routed_experts(a[1])),
              "flops": _moe_flops(tokens, hidden, ffn, TOP_K)}
    entries += [
        Timing(op, "torch loop, F.linear per expert", lambda a=a: solutions.experts_loop(*a, TOP_K),
               baseline=True, **common),
        Timing(op, "torch._grouped_mm composition", lambda a=a: grouped_mm_moe(*a, TOP_K),
               unavailable=grouped_mm_unavailable(*a), **common),
        Timing(op, "kernel_ladder.moe", lambda a=a: kernel_ladder.moe(*a, TOP_K), **common),
    ]

    # Timings: block-sparse attention at a long sequence, bf16, a few masks, against SDPA with the mask
    # expanded to a token mask (torch without a block-sparse kernel) and dense flash attention; then dense
    # flash attention against SDPA's flash backend.
    batch, heads, seq, d, block = BSA_SIZES["gpu"] if real else (1, 2, 128, 32, 32)
    gen = torch.Generator(device="cpu").manual_seed(17)
    q, k, v = (torch.randn(batch, heads, seq, d, generator=gen).to(device, dtype) for _ in range(3))
    blocks = -(-seq // block)
    dense_flops = 4 * batch * heads * seq * seq * d
    shape = f"bf16 B{batch} H{heads} T{seq} D{d}"
    masks = {f"window {w * block}": sliding_window_mask(blocks, blocks, w, device=device)
             for w in ((8, 32) if real else (1, 2))}
    masks["BigBird (3, 1, 2)"] = bigbird_mask(blocks, blocks, device=device)
    for name, mask in masks.items():
        tiles = visited_tiles(q, mask)
        label = f"block-sparse attn {shape}, {name} ({tiles / (batch * heads * blocks * blocks):.1%})"
        visible = token_mask(mask, block, seq, seq)
        entries += [
            Timing(label, "SDPA, token mask", lambda m=visible: sdpa_masked(q, k, v, m), flops=dense_flops,
                   baseline=True),
            Timing(label, "flash_attention dense", lambda: kernel_ladder.flash_attention(q, k, v), flops=dense_flops),
            Timing(label, "block_sparse_attention",
                   lambda m=mask: kernel_ladder.block_sparse_attention(q, k, v, m, block),
                   flops=4 * tiles * block * block * d),
        ]

    def sdpa_flash():
        if q.is_cuda:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v)

    entries += [
        Timing(f"attention {shape}, dense", "SDPA (flash backend)", sdpa_flash, flops=dense_flops, baseline=True),
        Timing(f"attention {shape}, dense", "kernel_ladder.flash_attention",
               lambda: kernel_ladder.flash_attention(q, k, v),
               flops=dense_flops),
    ]
    return entries
