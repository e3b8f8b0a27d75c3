"""Chapter 07's ladders: attention forward (materialized torch -> a program per query block holding its
whole score row -> the online softmax over key tiles -> kernel_ladder.flash_attention), causal attention
(masked torch -> block skipping), grouped-query attention (repeat_kv, then attention -> grouped), and
the bytes of the forward as the sequence grows (the report's plot)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import Figure, Ladder, Step, register, register_figure
from solutions import ch07_flash_attention as solutions

#: (B, Hq, Hkv, T, D): small on the CPU (the interpreter), Llama-3-8B's attention at 4k tokens on a GPU.
SIZES = {"cpu": (1, 4, 2, 256, 64), "gpu": (4, 32, 8, 4096, 128)}
#: The production forward may move at most this multiple of its ideal bytes (see ``forward_ideal``).
FLASH_BOUND = 1.1
#: Sequence lengths of the traffic sweep (docs/results.md's plot), at B=1, H=4, D=64, fp32.
SWEEP_LENGTHS = (128, 256, 512, 1024, 2048)


def _inputs(device, dtype, size, gqa: bool = False):
    batch, hq, hkv, seq, d = SIZES[size]
    hkv = hkv if gqa else hq
    gen = torch.Generator(device="cpu").manual_seed(7)
    q = torch.randn(batch, hq, seq, d, generator=gen).to(device, dtype)
    k = torch.randn(batch, hkv, seq, d, generator=gen).to(device, dtype)
    v = torch.randn(batch, hkv, seq, d, generator=gen).to(device, dtype)
    return q, k, v


def attention_torch(q, k, v, causal: bool = False):
    """Eager attention: the (T, T) scores written, softmaxed, read back (HF's eager_attention_forward)."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def repeat_kv(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """Hugging Face's repeat_kv: each key/value head repeated for its group of query heads (a copy)."""
    return torch.repeat_interleave(x, n_q_heads // x.shape[1], dim=1)


def reference(q, k, v, causal: bool = False):
    return attention_torch(q.double(), repeat_kv(k.double(), q.shape[1]), repeat_kv(v.double(), q.shape[1]), causal)


def _dense(kernel, launcher):
    """A chapter kernel over contiguous (BH, T, D) views of (B, H, T, D) inputs."""

    def run(q, k, v):
        b, h, seq_q, d = q.shape
        flat = [t.reshape(b * h, t.shape[2], d) for t in (q, k, v)]
        out = torch.empty_like(flat[0])
        lse = torch.empty(b * h, seq_q, device=q.device, dtype=torch.float32)
        launcher(kernel, *flat, out, lse)
        return out.view(b, h, seq_q, d)

    return run


def forward_ideal(q, k, v, out, causal: bool = False) -> int:
    """q read once, out and the log-sum-exp written once, k and v read once per query block.

    Every query block of ``kernel_ladder.flash_attention`` needs its head's keys and values — with
    ``causal``, only the keys its last row sees (bottom-right aligned): the bytes its programs must
    load. On a GPU the re-reads are served by L2; what DRAM sees is closer to each tensor once (the
    tracer's distinct sectors, the report's bytes-against-length figure).
    """
    config = kernel_ladder.ops.attention.INTERPRETER_CONFIG
    block_m = config.BLOCK_M if kernel_ladder.runtime.INTERPRETER else 128  # autotuned on a GPU: 64 or 128
    seq_q, seq_k = q.shape[2], k.shape[2]
    keys_read = 0
    for m0 in range(0, seq_q, block_m):
        last_row = min(m0 + block_m, seq_q) - 1
        keys_read += min(seq_k, max(0, last_row + seq_k - seq_q + 1)) if causal else seq_k
    per_key = 2 * q.shape[0] * q.shape[1] * q.shape[3] * k.element_size()  # a k and a v row, every q head
    lse_bytes = q.shape[0] * q.shape[1] * seq_q * 4
    return q.numel() * q.element_size() + out.numel() * out.element_size() + lse_bytes + keys_read * per_key


register(
    Ladder(
        chapter="07_flash_attention",
        op="attention forward",
        make_inputs=_inputs,
        reference=reference,
        steps=[
            Step("torch: scores materialized (eager)", attention_torch, baseline=True),
            Step("Triton: a query block per program, whole score row",
                 _dense(solutions.attention_row_kernel, solutions.launch_attention_rows), on_gpu=False),
            Step("Triton: online softmax over key tiles", _dense(solutions.flash_forward_kernel,
                                                                 solutions.launch_flash_forward), on_gpu=False),
            Step("kernel_ladder.flash_attention", kernel_ladder.flash_attention, bound=FLASH_BOUND),
        ],
        ideal_bytes=forward_ideal,
        note="B=1 H=4 T=256 D=64 on the CPU; the ideal reads k and v once per query block (see forward_ideal)",
    )
)

register(
    Ladder(
        chapter="07_flash_attention",
        op="attention forward, causal",
        make_inputs=_inputs,
        reference=lambda q, k, v: reference(q, k, v, causal=True),
        steps=[
            Step("torch: masked scores (eager)", lambda q, k, v: attention_torch(q, k, v, causal=True), baseline=True),
            Step("kernel_ladder.flash_attention(causal=True)",
                 lambda q, k, v: kernel_ladder.flash_attention(q, k, v, causal=True),
                 bound=FLASH_BOUND),
        ],
        ideal_bytes=lambda q, k, v, out: forward_ideal(q, k, v, out, causal=True),
        note="key blocks past the diagonal skipped: about half the FLOPs and of the k/v reads (the ideal: "
             "each query block reads the keys it sees)",
    )
)

register(
    Ladder(
        chapter="07_flash_attention",
        op="attention forward, GQA",
        make_inputs=lambda device, dtype, size: _inputs(device, dtype, size, gqa=True),
        reference=reference,
        steps=[
            Step("torch: repeat_kv, then scores materialized",
                 lambda q, k, v: attention_torch(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])),
                 baseline=True),
            Step("repeat_kv, then kernel_ladder.flash_attention",
                 lambda q, k, v: kernel_ladder.flash_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]))),
            Step("kernel_ladder.flash_attention (grouped, no copy)", kernel_ladder.flash_attention, bound=FLASH_BOUND),
        ],
        ideal_bytes=forward_ideal,
        note="Hq=4 on Hkv=2 on the CPU, Hq=32 on Hkv=8 on a GPU: the copy writes and re-reads K and V",
    )
)


def _traffic_against_length(ax) -> str:
    """Forward bytes of materialized attention and of kernel_ladder.flash_attention, T = 128 .. 2048 (traced)."""
    from utils.trace import trace

    heads, d = 4, 64
    rows = []
    for seq in SWEEP_LENGTHS:
        gen = torch.Generator(device="cpu").manual_seed(seq)
        q, k, v = (torch.randn(1, heads, seq, d, generator=gen).to(kernel_ladder.runtime.DEVICE) for _ in range(3))
        with trace() as eager:
            attention_torch(q, k, v)
        with trace() as flash:
            out = kernel_ladder.flash_attention(q, k, v)
        rows.append((seq, eager.bytes, flash.bytes, flash.unique_sectors * 32, forward_ideal(q, k, v, out)))
    lengths = [r[0] for r in rows]
    ax.loglog(lengths, [r[1] for r in rows], "o-", label="torch, scores materialized")
    ax.loglog(lengths, [r[2] for r in rows], "s-", label="kernel_ladder.flash_attention: bytes loaded and stored")
    ax.loglog(lengths, [r[3] for r in rows], "^-", label="kernel_ladder.flash_attention: distinct bytes")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("bytes, forward")
    ax.set_title(f"attention forward, B=1 H={heads} D={d} fp32 (traced)")
    ax.legend(fontsize=8)
    first, last = rows[0], rows[-1]
    growth = last[0] / first[0]
    return (f"Forward bytes against the sequence length, traced in the interpreter (B=1, H={heads}, D={d}, fp32). "
            f"From T={first[0]} to T={last[0]} ({growth:.0f}x): torch's grow {last[1] / first[1]:.0f}x "
            f"({last[1]:,} bytes at T={last[0]}); kernel_ladder.flash_attention's distinct bytes "
            f"{last[3] / first[3]:.0f}x (q, k, v, out and the log-sum-exp, once), its loads and stores "
            f"{last[2] / first[2]:.0f}x, {last[2] / last[4]:.2f}x the ideal at T={last[0]} (k and v re-read by "
            "each query block, from L2 on a GPU).")


register_figure(Figure(chapter="07_flash_attention", name="bytes_vs_length", draw=_traffic_against_length))


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------


def _attention_flops(batch, heads, seq_q, seq_k, d, causal):
    flops = 4 * batch * heads * seq_q * seq_k * d
    return flops // 2 if causal else flops


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: flash attention in bf16/fp16 at real sizes against fp32 SDPA (forward,
    backward, causal, GQA, varlen), then timed forward and forward+backward against SDPA's flash backend."""
    from bench.gpu import Check, Peak, Timing, grads

    device = kernel_ladder.runtime.DEVICE
    real = size == "gpu"
    batch, hq, hkv, seq, d = (2, 32, 8, 2048, 128) if real else (1, 4, 2, 40, 32)
    entries = []
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator(device="cpu").manual_seed(11)
        q = torch.randn(batch, hq, seq, d, generator=gen).to(device, dtype)
        k = torch.randn(batch, hkv, seq, d, generator=gen).to(device, dtype)
        v = torch.randn(batch, hkv, seq, d, generator=gen).to(device, dtype)

        def sdpa32(q, k, v, causal=False, window=None):
            return attention_torch(q.float(), repeat_kv(k.float(), q.shape[1]), repeat_kv(v.float(), q.shape[1]),
                                   causal)

        for causal in (False, True):
            entries.append(Check(f"flash_attention{' causal' if causal else ''}", dtype,
                                 lambda q=q, k=k, v=v, c=causal: kernel_ladder.flash_attention(q, k, v, causal=c),
                                 lambda q=q, k=k, v=v, c=causal: sdpa32(q, k, v, c)))
            g = torch.randn(q.shape, generator=gen).to(device, dtype)
            entries.append(Check(f"flash_attention backward{' causal' if causal else ''}", dtype,
                                 lambda a=(q, k, v), g=g, c=causal: grads(
                                     lambda *t: kernel_ladder.flash_attention(*t, causal=c), a, g),
                                 lambda a=(q, k, v), g=g, c=causal: grads(
                                     lambda *t: sdpa32(*t, causal=c), a, g, upcast=True), tol=3e-2))
        # Head dims that are not powers of two, through the same kernels.
        for head_dim in (80, 256) if real else (48,):
            qd, kd, vd = (torch.randn(1, 4, 300 if real else 20, head_dim, generator=gen).to(device, dtype)
                          for _ in range(3))
            entries.append(Check(f"flash_attention hd{head_dim} causal", dtype,
                                 lambda a=(qd, kd, vd): kernel_ladder.flash_attention(*a, causal=True),
                                 lambda a=(qd, kd, vd): sdpa32(*a, causal=True)))
        # Varlen against the dense op per sequence.
        lengths = [1, 700, 33, 1500, 0, 257] if real else [1, 9, 0, 17]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        total = int(cu[-1])
        qp, kp, vp = (torch.randn(total, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))

        def per_sequence(qp=qp, kp=kp, vp=vp, cu=cu):
            outs = []
            for b in range(len(cu) - 1):
                s, e = int(cu[b]), int(cu[b + 1])
                one = [t[s:e].transpose(0, 1)[None] for t in (qp, kp, vp)]
                outs.append(sdpa32(*one, causal=True)[0].transpose(0, 1) if e > s else qp[s:e].float())
            return torch.cat(outs)

        entries.append(Check("flash_attention_varlen causal", dtype,
                             lambda a=(qp, kp, vp, cu, max(lengths)): kernel_ladder.flash_attention_varlen(
                                 a[0], a[1], a[2], a[3], a[3], a[4], a[4], causal=True), per_sequence))

    # Timings: Llama-3-8B's attention (32 query heads on 8 kv heads, hd 128) at 4k tokens, bf16.
    batch, hq, hkv, seq, d = SIZES["gpu"] if real else (1, 2, 2, 64, 64)
    gen = torch.Generator(device="cpu").manual_seed(12)
    q = torch.randn(batch, hq, seq, d, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(batch, hkv, seq, d, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(batch, hkv, seq, d, generator=gen).to(device, torch.bfloat16)
    k_rep, v_rep = repeat_kv(k, hq), repeat_kv(v, hq)  # SDPA's flash backend takes Hq == Hkv here

    def sdpa(q, k, v, causal):
        if q.is_cuda:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for causal in (False, True):
        flops = _attention_flops(batch, hq, seq, seq, d, causal)
        label = f"attention{' causal' if causal else ''} bf16 B{batch} H{hq}/{hkv} T{seq} D{d}"
        entries += [
            Timing(f"{label} fwd", "SDPA (flash backend, K/V repeated)",
                   lambda c=causal: sdpa(q, k_rep, v_rep, c), flops=flops, baseline=True),
            Timing(f"{label} fwd", "kernel_ladder.flash_attention",
                   lambda c=causal: kernel_ladder.flash_attention(q, k, v, causal=c),
                   flops=flops, target=">= 1.1x SDPA, >= 550 TFLOP/s"),
        ]
        grad = torch.randn(q.shape, generator=gen).to(device, torch.bfloat16)

        def step(fn, c=causal, grad=grad):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            if fn == "sdpa":
                out = sdpa(qg, repeat_kv(kg, hq), repeat_kv(vg, hq), c)
            else:
                out = kernel_ladder.flash_attention(qg, kg, vg, causal=c)
            out.backward(grad)

        entries += [
            Timing(f"{label} fwd+bwd", "SDPA (flash backend, K/V repeated)", lambda s=step: s("sdpa"),
                   flops=int(3.5 * flops), baseline=True),
            Timing(f"{label} fwd+bwd", "kernel_ladder.flash_attention", lambda s=step: s("kernels"),
                   flops=int(3.5 * flops), target="backward >= 400 TFLOP/s"),
        ]
    op = f"attention bf16 B{batch} H{hq}/{hkv} T{seq} D{d} fwd+bwd"
    entries += [
        Peak(op, "eager (scores materialized)", lambda: _eager_step(q, k, v, hq), baseline=True),
        Peak(op, "kernel_ladder.flash_attention", lambda: _flash_step(q, k, v), target="no T x T tensor"),
    ]
    return entries


def _eager_step(q, k, v, hq):
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    attention_torch(qg, repeat_kv(kg, hq), repeat_kv(vg, hq)).sum().backward()


def _flash_step(q, k, v):
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    kernel_ladder.flash_attention(qg, kg, vg).sum().backward()
