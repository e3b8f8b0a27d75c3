"""Chapter 06's ladders: RoPE (HF's torch code -> a kernel per tensor -> q and k in one launch, in
place), the gated MLP (three GEMMs and a swiglu -> gate/up in one GEMM with the gate in its
epilogue), and the fused linear + cross-entropy (materialized logits -> chunks -> fused chunks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import FORWARD_BOUND, Ladder, Step, register
from solutions import ch06_fused_ops as solutions

#: RoPE: (B, Hq, Hkv, T, D): a small GQA attention on the CPU, Llama-3-8B's heads on a GPU.
ROPE_SIZES = {"cpu": (2, 8, 2, 64, 64), "gpu": (8, 32, 8, 4096, 128)}
#: Gated MLP: (tokens, hidden, intermediate).
MLP_SIZES = {"cpu": (64, 128, 256), "gpu": (4096, 4096, 14336)}
#: Fused linear + cross-entropy: (tokens, hidden, vocab); on a GPU Llama-3-8B's head at 8k tokens.
LOSS_SIZES = {"cpu": (64, 32, 1024), "gpu": (8192, 4096, 128256)}


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def _rope_inputs(device, dtype, size):
    batch, hq, hk, seq_len, d = ROPE_SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(6)
    qkv = torch.randn(batch, seq_len, (hq + 2 * hk) * d, generator=gen).to(device, dtype)
    q = qkv[..., : hq * d].view(batch, seq_len, hq, d).transpose(1, 2)  # views of the fused projection
    k = qkv[..., hq * d : (hq + hk) * d].view(batch, seq_len, hk, d).transpose(1, 2)
    positions = torch.arange(seq_len, device=device)
    cos, sin = kernel_ladder.rope_cos_sin(positions, d, base=500000.0, dtype=dtype)
    return q, k, cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_torch(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb (with (T, D) tables): about five kernels per tensor."""
    cos, sin = cos[None, None], sin[None, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_reference(q, k, cos, sin):
    return rope_torch(q.double(), k.double(), cos.double(), sin.double())


def _per_tensor(kernel_launch, kernel):
    def run(q, k, cos, sin):
        outs = []
        for x in (q, k):
            dense = x.contiguous()  # these kernels take a contiguous (B, H, T, D): a copy of the view
            outs.append(kernel_launch(kernel, dense, cos, sin, torch.empty_like(dense)))
        return tuple(outs)

    return run


register(
    Ladder(
        chapter="06_fused_ops",
        op="rope q and k",
        make_inputs=_rope_inputs,
        reference=rope_reference,
        steps=[
            Step("torch (HF apply_rotary_pos_emb)", rope_torch, baseline=True),
            Step("Triton: a program per row, per tensor", _per_tensor(solutions.launch_rope_rows,
                                                                       solutions.rope_row_kernel)),
            Step("Triton: a program per token, per tensor", _per_tensor(solutions.launch_rope_tokens,
                                                                         solutions.rope_token_kernel)),
            Step("kernel_ladder.rope (q and k, one launch, in place)", kernel_ladder.rope, bound=FORWARD_BOUND),
        ],
        note="q and k are views of one fused qkv projection; B=2 Hq=8 Hkv=2 T=64 D=64 on the CPU",
    )
)


# ----------------------------------------------------------------------------------------------
# Gated MLP
# ----------------------------------------------------------------------------------------------


def _mlp_inputs(device, dtype, size):
    tokens, hidden, inter = MLP_SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w_gate = (torch.randn(inter, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    w_up = (torch.randn(inter, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    w_down = (torch.randn(hidden, inter, generator=gen) * inter**-0.5).to(device, dtype)
    return x, w_gate, w_up, w_down


def mlp_torch(x, w_gate, w_up, w_down):
    """LlamaMLP: down(silu(gate(x)) * up(x)) — three GEMMs, silu, multiply."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def mlp_unfused_kernels(x, w_gate, w_up, w_down):
    """The same chain from kernel_ladder ops: gate and up written and read back by swiglu."""
    return kernel_ladder.linear(kernel_ladder.swiglu(kernel_ladder.linear(x, w_gate), kernel_ladder.linear(x, w_up)),
                                w_down)


register(
    Ladder(
        chapter="06_fused_ops",
        op="gated mlp (SwiGLU)",
        make_inputs=_mlp_inputs,
        reference=lambda x, g, u, d: mlp_torch(x.double(), g.double(), u.double(), d.double()),
        steps=[
            Step("torch: 3 GEMMs, silu, mul", mlp_torch, baseline=True),
            Step("kernels: linear x2, swiglu, linear", mlp_unfused_kernels),
            Step("kernel_ladder.gated_mlp (gate in the epilogue)", kernel_ladder.gated_mlp),
        ],
        note="64 tokens, hidden 128, intermediate 256 on the CPU; Llama-3-8B's MLP (4096 tokens) on a GPU",
    )
)


# ----------------------------------------------------------------------------------------------
# Fused linear + cross-entropy
# ----------------------------------------------------------------------------------------------


def _loss_inputs(device, dtype, size):
    tokens, hidden, vocab = LOSS_SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(8)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return x, weight, target


def _with_grads(loss_fn):
    """A step returning the loss and the gradients of x and the weight (forward + backward)."""

    def step(x, weight, target):
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        loss = loss_fn(x, weight, target)
        grad_x, grad_w = torch.autograd.grad(loss, (x, weight))
        return loss.detach(), grad_x, grad_w

    return step


def loss_torch(x, weight, target):
    """HF's LM head and loss: the (N, V) logits, upcast to fp32, F.cross_entropy."""
    return F.cross_entropy(F.linear(x, weight).float(), target)


def loss_reference(x, weight, target):
    return _with_grads(lambda a, w, t: F.cross_entropy(F.linear(a, w), t))(x.double(), weight.double(), target)


register(
    Ladder(
        chapter="06_fused_ops",
        op="linear + cross-entropy fwd+bwd",
        make_inputs=_loss_inputs,
        reference=loss_reference,
        steps=[
            Step("torch: logits, .float(), F.cross_entropy", _with_grads(loss_torch), baseline=True),
            Step("kernel_ladder.fused_linear_cross_entropy (chunks)",
                 _with_grads(lambda x, w, t: kernel_ladder.fused_linear_cross_entropy(x, w, t))),
        ],
        ideal_bytes=lambda x, w, t, out: 2 * (x.numel() + w.numel()) * x.element_size() + t.numel() * 8,
        note="64 tokens, hidden 32, vocab 1024 on the CPU; the ideal reads x and W and writes their gradients",
    )
)


def gpu_checks(size: str) -> list:
    """``make gpu-check`` entries: rope and the gated MLP in bf16/fp16, then timed against torch."""
    from bench.gpu import Check, Timing, compiled, grads

    entries = []
    for dtype in (torch.bfloat16, torch.float16):
        device = kernel_ladder.runtime.DEVICE
        q, k, cos, sin = _rope_inputs(device, dtype, "gpu" if size == "gpu" else "cpu")
        entries.append(Check("rope", dtype, lambda q=q, k=k, c=cos, s=sin: kernel_ladder.rope(q, k, c, s),
                             lambda q=q, k=k, c=cos, s=sin: rope_torch(q.float(), k.float(), c.float(), s.float())))
        x, wg, wu, wd = _mlp_inputs(device, dtype, "gpu" if size == "gpu" else "cpu")
        if size != "gpu":
            x = x[:16]
        entries.append(Check("gated_mlp", dtype, lambda a=(x, wg, wu, wd): kernel_ladder.gated_mlp(*a),
                             lambda a=(x, wg, wu, wd): mlp_torch(*(t.float() for t in a))))
        g = torch.randn(x.shape, device=device, dtype=dtype)
        entries.append(Check("gated_mlp backward", dtype,
                             lambda a=(x, wg, wu, wd), g=g: grads(kernel_ladder.gated_mlp, a, g),
                             lambda a=(x, wg, wu, wd), g=g: grads(mlp_torch, a, g, upcast=True), tol=3e-2))
    from bench.gpu import Peak

    device = kernel_ladder.runtime.DEVICE
    for dtype in (torch.bfloat16,):
        x, w, t = _loss_inputs(device, dtype, "gpu" if size == "gpu" else "cpu")
        entries.append(Check("fused_linear_cross_entropy fwd+bwd", dtype,
                             lambda a=(x, w, t): _with_grads(lambda p, q, r: kernel_ladder.fused_linear_cross_entropy(
                                 p, q, r))(*a),
                             lambda a=(x, w, t): _with_grads(loss_torch)(a[0].float(), a[1].float(), a[2]), tol=3e-2))
    x, w, t = _loss_inputs(device, torch.bfloat16, "gpu" if size == "gpu" else "cpu")
    tokens, hidden, vocab = LOSS_SIZES["gpu" if size == "gpu" else "cpu"]
    op = f"linear+CE fwd+bwd bf16 {tokens}x{hidden}x{vocab}"
    loss_flops = 3 * 2 * tokens * hidden * vocab
    fused = _with_grads(lambda p, q, r: kernel_ladder.fused_linear_cross_entropy(p, q, r))
    entries += [
        Timing(op, "torch eager", lambda: _with_grads(loss_torch)(x, w, t), flops=loss_flops, baseline=True),
        Timing(op, "kernel_ladder.fused_linear_cross_entropy", lambda: fused(x, w, t), flops=loss_flops,
               target="no slower than torch eager at <= 1/5 of its peak memory"),
        Peak(op, "torch eager", lambda: _with_grads(loss_torch)(x, w, t), baseline=True),
        Peak(op, "kernel_ladder.fused_linear_cross_entropy", lambda: fused(x, w, t), target="<= 1/5 of torch's"),
    ]
    q, k, cos, sin = _rope_inputs(device, torch.bfloat16, size if size == "gpu" else "cpu")
    rope_bytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
    op = "rope bf16 " + "x".join(map(str, ROPE_SIZES["gpu" if size == "gpu" else "cpu"]))
    entries += [
        Timing(op, "torch eager", lambda: rope_torch(q, k, cos, sin), bytes=rope_bytes, baseline=True),
        Timing(op, "torch.compile", compiled(rope_torch, q, k, cos, sin), bytes=rope_bytes),
        Timing(op, "kernel_ladder.rope", lambda: kernel_ladder.rope(q, k, cos, sin), bytes=rope_bytes,
               target=">= 90% of copy bandwidth"),
    ]
    args = _mlp_inputs(device, torch.bfloat16, size if size == "gpu" else "cpu")
    tokens, hidden, inter = MLP_SIZES["gpu" if size == "gpu" else "cpu"]
    flops = 2 * tokens * hidden * inter * 3
    op = f"gated mlp bf16 {tokens}x{hidden}x{inter}"
    entries += [
        Timing(op, "torch eager", lambda: mlp_torch(*args), flops=flops, baseline=True),
        Timing(op, "torch.compile", compiled(mlp_torch, *args), flops=flops),
        Timing(op, "kernel_ladder.gated_mlp", lambda: kernel_ladder.gated_mlp(*args), flops=flops,
               target="faster than torch eager (two F-wide tensors never written)"),
    ]
    return entries
