"""Chapter 08's ladders: decode attention over a paged KV cache (gather the blocks, then SDPA -> a
program per query head walking the block table -> kernel_ladder.paged_attention, a program per KV head's
query group), split-KV decoding of a few long sequences (one program per KV head -> split and
merged), and the cache memory a request mix reserves (the report's plot)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import FORWARD_BOUND, Figure, Ladder, Step, register, register_figure
from solutions import ch08_kv_cache as solutions

#: (sequence lengths, Hq, Hkv, D, block size): small on the CPU (the interpreter); on a GPU, Llama-3-8B's
#: attention (32 query heads on 8 kv heads, hd 128) decoding 64 sequences of 4096 tokens.
SIZES = {
    "cpu": ([100, 257, 33, 180], 8, 2, 64, 16),
    "gpu": ([4096] * 64, 32, 8, 128, 16),
}
#: A few long sequences: B * Hkv programs cannot fill the GPU, so the kernel splits each sequence.
SPLIT_SIZES = {
    "cpu": ([1500], 8, 2, 64, 16),
    "gpu": ([32768] * 4, 32, 8, 128, 16),
}


def _inputs(device, dtype, size, sizes=SIZES):
    lengths, hq, hkv, d, block = sizes[size]
    return solutions.paged_inputs(lengths, hq, hkv, d, block, dtype=dtype, device=device, seed=8)


def gather_sdpa(q, k_cache, v_cache, block_tables, seq_lens):
    """The torch baseline: every sequence's blocks gathered into a dense padded (B, Hkv, T, D) copy,
    then one masked SDPA call (what a server without a paged kernel does)."""
    batch, hq, d = q.shape
    _, block, hkv, _ = k_cache.shape
    blocks = block_tables.clamp(min=0).long()
    k = k_cache[blocks].reshape(batch, -1, hkv, d).transpose(1, 2)
    v = v_cache[blocks].reshape(batch, -1, hkv, d).transpose(1, 2)
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                         enable_gqa=True)
    return out[:, :, 0, :]


def per_query_head(q, k_cache, v_cache, block_tables, seq_lens):
    """Exercise 2's kernel: one program per (sequence, query head)."""
    out = torch.empty_like(q)
    return solutions.launch_paged_decode(solutions.paged_decode_kernel, q, k_cache, v_cache, block_tables,
                                         seq_lens, out)


register(
    Ladder(
        chapter="08_kv_cache",
        op="paged decode attention",
        make_inputs=_inputs,
        reference=solutions.paged_reference,
        steps=[
            Step("torch: gather the blocks, then SDPA", gather_sdpa, baseline=True),
            Step("Triton: a program per query head (exercise 2)", per_query_head, on_gpu=False),
            Step("kernel_ladder.paged_attention (a program per KV head's group)", kernel_ladder.paged_attention,
                 bound=FORWARD_BOUND),
        ],
        ideal_bytes=solutions.decode_ideal_bytes,
        note="4 sequences of 33..257 tokens, Hq=8 on Hkv=2, D=64, blocks of 16 on the CPU; the ideal reads "
             "each sequence's K/V once per KV head",
    )
)

register(
    Ladder(
        chapter="08_kv_cache",
        op="paged decode attention, split-KV",
        make_inputs=lambda device, dtype, size: _inputs(device, dtype, size, SPLIT_SIZES),
        reference=solutions.paged_reference,
        steps=[
            Step("torch: gather the blocks, then SDPA", gather_sdpa, baseline=True),
            Step("kernel_ladder.paged_attention(num_splits=1)",
                 lambda *a: kernel_ladder.paged_attention(*a, num_splits=1), bound=FORWARD_BOUND),
            Step("kernel_ladder.paged_attention (splits chosen: plan_paged_attention)", kernel_ladder.paged_attention,
                 bound=FORWARD_BOUND),
        ],
        ideal_bytes=solutions.decode_ideal_bytes,
        note="1 sequence of 1500 tokens on the CPU (the interpreter acts as a 4-SM GPU: 4 splits), 4 of 32768 "
             "on a GPU; the partials' round trip is the split's only extra traffic",
    )
)


def _cache_memory(ax) -> str:
    """Reserved against used KV-cache memory for one request mix: contiguous slabs, then pages."""
    max_len, bytes_per_token = 4096, 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads, hd 128, bf16
    lengths = [p + o for p, o in solutions.request_mix(256, max_len=max_len)]
    reserved, used = solutions.contiguous_cache_bytes(lengths, max_len, bytes_per_token)
    labels, waste = [f"contiguous\n({max_len})"], [1 - used / reserved]
    for block in (8, 16, 32, 64, 128):
        r, u = solutions.paged_cache_bytes(lengths, block, bytes_per_token)
        labels.append(f"blocks\nof {block}")
        waste.append(1 - u / r)
    bars = ax.bar(labels, [100 * w for w in waste], color=["tab:red"] + ["tab:blue"] * 5)
    ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    ax.set_ylabel("reserved but unused, %")
    ax.set_title(f"KV cache of {len(lengths)} requests (Llama-3-8B layout, bf16)")
    return (f"KV-cache memory reserved but never used for {len(lengths)} requests of the chapter's mix (mean "
            f"{sum(lengths) / len(lengths):.0f} tokens, at most {max_len}), counted exactly: a {max_len}-token slab "
            f"per sequence wastes {100 * waste[0]:.0f}%; blocks of 16 tokens waste {100 * waste[2]:.1f}% "
            f"(at most one partly filled block per sequence), blocks of 128 {100 * waste[-1]:.1f}%.")


register_figure(Figure(chapter="08_kv_cache", name="cache_memory", draw=_cache_memory))


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: paged attention in bf16/fp16 (decode, split-KV, chunked prefill, an fp8
    cache) against the float32 gather + SDPA baseline, then decode timed against it."""
    from bench.gpu import Check, Timing

    device = kernel_ladder.runtime.DEVICE
    real = size == "gpu"
    entries = []
    for dtype in (torch.bfloat16, torch.float16):
        lengths = [1, 16, 17, 4096, 700, 3000, 33, 128] if real else [1, 16, 17, 40]
        a = solutions.paged_inputs(lengths, 32 if real else 4, 8 if real else 2, 128 if real else 32, 16,
                                   dtype=dtype, device=device, seed=3)

        def baseline32(q, kc, vc, bt, sl):
            return gather_sdpa(q.float(), kc.float(), vc.float(), bt, sl)

        entries.append(Check("paged_attention decode", dtype, lambda a=a: kernel_ladder.paged_attention(*a),
                             lambda a=a: baseline32(*a)))
        entries.append(Check("paged_attention decode, 4 splits", dtype,
                             lambda a=a: kernel_ladder.paged_attention(*a, num_splits=4), lambda a=a: baseline32(*a)))
        # An fp8 e4m3 cache with per-tensor scales, against the baseline on the dequantized cache.
        q, kc, vc, bt, sl = a
        k_scale, v_scale = (t.abs().amax().float() / 448 for t in (kc, vc))
        k8, v8 = (kc.float() / k_scale).to(torch.float8_e4m3fn), (vc.float() / v_scale).to(torch.float8_e4m3fn)
        entries.append(Check("paged_attention decode, fp8 cache", dtype,
                             lambda q=q, k8=k8, v8=v8, bt=bt, sl=sl, ks=k_scale, vs=v_scale:
                             kernel_ladder.paged_attention(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs),
                             lambda q=q, k8=k8, v8=v8, bt=bt, sl=sl, ks=k_scale, vs=v_scale: baseline32(
                                 q, k8.float() * ks, v8.float() * vs, bt, sl)))
        # Chunked prefill: each sequence's newest tokens, causal among themselves, seeing the cache.
        q_lens = [1, 16, 5, 300, 1, 64, 33, 2] if real else [1, 8, 5, 3]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        gen = torch.Generator().manual_seed(4)
        qp = torch.randn(int(cu[-1]), q.shape[1], q.shape[2], generator=gen).to(device, dtype)

        def prefill_reference(qp=qp, kc=kc, vc=vc, bt=bt, sl=sl, cu=cu):
            outs = []
            for b, (k_b, v_b) in enumerate(kernel_ladder.ops.paged_attention.gather_kv(kc, vc, bt, sl)):
                s, e = int(cu[b]), int(cu[b + 1])
                one = qp[s:e].float().transpose(0, 1)[None]
                kk, vv = (t.float().transpose(0, 1)[None] for t in (k_b, v_b))
                n, m = e - s, kk.shape[2]
                visible = torch.ones(n, m, dtype=torch.bool, device=qp.device).tril(m - n)
                outs.append(F.scaled_dot_product_attention(one, kk, vv, attn_mask=visible,
                                                           enable_gqa=True)[0].transpose(0, 1))
            return torch.cat(outs)

        entries.append(Check("paged_attention chunked prefill", dtype,
                             lambda qp=qp, kc=kc, vc=vc, bt=bt, sl=sl, cu=cu: kernel_ladder.paged_attention(
                                 qp, kc, vc, bt, sl, cu_seqlens_q=cu), prefill_reference))

    # Timings: decode, bf16, against the gather + SDPA baseline, as a fraction of copy bandwidth.
    for sizes, label in ((SIZES, "decode"), (SPLIT_SIZES, "decode, long (split-KV)")):
        lengths, hq, hkv, d, block = sizes["gpu"] if real else ([64, 40], 4, 2, 32, 16)
        a = solutions.paged_inputs(lengths, hq, hkv, d, block, dtype=torch.bfloat16, device=device, seed=5)
        ideal = solutions.decode_ideal_bytes(*a)
        op = f"paged {label} bf16 B{len(lengths)} T{max(lengths)} H{hq}/{hkv} D{d}"
        entries += [
            Timing(op, "torch: gather the blocks, then SDPA", lambda a=a: gather_sdpa(*a), bytes=ideal,
                   baseline=True),
            Timing(op, "kernel_ladder.paged_attention", lambda a=a: kernel_ladder.paged_attention(*a), bytes=ideal,
                   target=">= 85% of copy bandwidth"),
        ]
    return entries
