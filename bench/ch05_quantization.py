"""Chapter 05's ladders: a decode-shaped linear layer with bf16, int8, int4, fp8 and W8A8 weights.

One ladder per weight format and batch size (M = 1 and M = 16 tokens: a decode step), each with
the same steps:

* torch ``F.linear`` on the bf16 weight (the baseline) and ``kernel_ladder.linear`` on it;
* torch: ``qweight.dequantize()`` then ``F.linear`` — writes a bf16 copy of the weight and reads
  it back;
* ``kernel_ladder.quantized_linear`` — dequantizes inside the K loop and reads only the packed weight
  and its scales (W8A8 ladder: ``activations="int8"``, and the weight-only int8 kernel beside it).

So that every step computes the *same* function and the report's check tests the kernels, not the
quantization error, each ladder's weight is drawn on its format's grid (:func:`weight_on_grid`:
integers or e4m3 values times power-of-two scales), so that quantizing it loses nothing and its bf16
copy is exactly the dequantized weight; the reference is the float64 product with the dequantized
weight (``q * s``, exact). In the W8A8
ladders the activations are drawn on the int8 grid (``x = q * 2**-5`` with ``|q| <= 127`` and
each row reaching 127), so per-token quantization is exact and W8A8 computes that same function.
The ideal bytes are those of the quantized layer: x and the output once, the packed weight and
its scales once — the bf16 steps then show the factor (about 2x for int8, 4x for int4) that
quantization saves.

On the CPU: K = 512 -> N = 256, traced. On a GPU: a LLaMA-3-8B-style MLP up-projection,
K = 4096 -> N = 14336, timed.

``gpu_checks(size)`` adds to ``make gpu-check``: correctness at real sizes (bf16 and fp16
activations, every scheme, several batch sizes, odd shapes, a bias) against the float32 product
with the dequantized weight, and timings at batch 1, 4 and 16 against ``F.linear`` on the bf16
weight, each declaring the weight bytes it reads — the targets being int4 and int8 weight-only
at >= 80 % of HBM bandwidth (counting weight bytes) and faster than the bf16 linear at batch 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import Ladder, Step, register
from kernel_ladder import QuantizedWeight, quantize_weight, quantized_linear

#: (N, K) of the ladders' layer: out_features, in_features.
SIZES = {"cpu": (256, 512), "gpu": (14336, 4096)}
#: Tokens per decode step in the ladders.
BATCHES = (1, 16)
#: (label, scheme, group size, activations) of each ladder's quantized layer.
FORMATS = [
    ("int8", "int8", None, None),
    ("int4 g128", "int4", 128, None),
    ("fp8 e4m3", "fp8", None, None),
    ("W8A8", "int8", None, "int8"),
]

#: This chapter's ladders by op name.
LADDERS: dict[str, Ladder] = {}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def make_weight(n: int, k: int, device, seed: int = 0) -> torch.Tensor:
    """An ``(n, k)`` float32 weight with ``nn.Linear``-like scale (std ``1/sqrt(k)``)."""
    return (torch.randn(n, k, generator=_generator(seed)) / k**0.5).to(device)


def weight_on_grid(n: int, k: int, scheme: str, group_size: int | None, device, seed: int = 0) -> torch.Tensor:
    """A float32 ``(n, k)`` weight that ``scheme`` quantizes without loss, exactly representable in bf16.

    Values are the scheme's integers (or e4m3 values) times a power-of-two scale per row (per
    group for int4), and every row (group) reaches the scheme's largest magnitude, so the
    quantizer's scale ``amax / QMAX`` is that power of two exactly and ``q * s`` gives the weight
    back. The scales vary between 2**-12 and 2**-10 (about ``1/sqrt(k)`` for the sizes here).
    """
    gen = _generator(seed)
    if scheme == "fp8":
        q = (100 * torch.randn(n, k, generator=gen)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        qmax, block = 448.0, k
    else:
        qmax = 127.0 if scheme == "int8" else 7.0
        q = torch.randint(-int(qmax), int(qmax) + 1, (n, k), generator=gen).float()
        block = k if scheme == "int8" else group_size
    blocks = -(-k // block)
    starts = torch.arange(blocks) * block
    widths = (k - starts).clamp(max=block)
    columns = starts + (torch.rand(n, blocks, generator=gen) * widths).long()  # one entry per block at +-QMAX
    q[torch.arange(n)[:, None], columns] = qmax * torch.sign(torch.randn(n, blocks, generator=gen) + 1e-9)
    exponents = torch.randint(-12, -9, (n, blocks), generator=gen).float()
    scales = torch.exp2(exponents).repeat_interleave(block, dim=1)[:, :k]
    return (q * scales).to(device)


def activations_on_int8_grid(m: int, k: int, device, dtype, seed: int = 1) -> torch.Tensor:
    """``x = q * 2**-5``, q integers in [-127, 127], every row reaching +-127: per-token int8 is exact."""
    gen = _generator(seed)
    q = torch.randint(-127, 128, (m, k), generator=gen)
    q[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] = 127
    return (q.float() * 2.0**-5).to(device=device, dtype=dtype)


def qweight_of(data: torch.Tensor, scales: torch.Tensor, k: int, scheme: str, group_size: int | None,
               dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """A ``QuantizedWeight`` around existing values and scales (no copy)."""
    return QuantizedWeight(scheme, data, scales, (data.shape[0], k), dtype, group_size)


def _register(label: str, scheme: str, group_size: int | None, activations: str | None, m: int) -> None:
    def make_inputs(device, dtype, size):
        n, k = SIZES[size]
        w = weight_on_grid(n, k, scheme, group_size, device)
        qweight = quantize_weight(w, scheme, group_size=group_size)
        if activations == "int8":
            x = activations_on_int8_grid(m, k, device, dtype)
        else:
            x = torch.randn(m, k, generator=_generator(1)).to(device=device, dtype=dtype)
        return x, w.to(dtype), qweight.data, qweight.scales  # w is exactly q * s, in bf16 too

    def rebuild(x, data, scales):
        return qweight_of(data, scales, x.shape[-1], scheme, group_size, x.dtype)

    def reference(x, w_bf16, data, scales):
        return x.double() @ rebuild(x, data, scales).dequantize(torch.float64).T

    def dequantize_then_linear(x, w_bf16, data, scales):
        return F.linear(x, rebuild(x, data, scales).dequantize())

    def fused(x, w_bf16, data, scales):
        with torch.no_grad():
            return quantized_linear(x, rebuild(x, data, scales), activations=activations)

    def weight_only(x, w_bf16, data, scales):
        with torch.no_grad():
            return quantized_linear(x, rebuild(x, data, scales))

    def ideal(x, w_bf16, data, scales, out):
        return x.nbytes + data.nbytes + scales.nbytes + out.nbytes

    fused_name = ("kernel_ladder.quantized_linear(activations='int8')" if activations
                  else f"kernel_ladder.quantized_linear ({label}, fused)")
    steps = [
        Step("torch F.linear, bf16 weight", lambda x, w, d, s: F.linear(x, w), baseline=True),
        Step("kernel_ladder.linear, bf16 weight", lambda x, w, d, s: kernel_ladder.linear(x, w)),
        Step(f"torch: dequantize ({label.split()[0] if not activations else 'int8'}), then F.linear",
             dequantize_then_linear),
    ]
    if activations:
        steps.append(Step("kernel_ladder.quantized_linear (int8 weight-only)", weight_only))
    steps.append(Step(fused_name, fused))
    n_cpu, k_cpu = SIZES["cpu"]
    n_gpu, k_gpu = SIZES["gpu"]
    op = f"decode linear {label} M={m}"
    LADDERS[op] = register(
        Ladder(
            chapter="05_quantization",
            op=op,
            make_inputs=make_inputs,
            reference=reference,
            dtype=torch.bfloat16,
            steps=steps,
            ideal_bytes=ideal,
            note=(f"x ({m}, K) bf16 times W.T, W {label}: K={k_cpu} -> N={n_cpu} on the CPU, K={k_gpu} -> "
                  f"N={n_gpu} on a GPU (a LLaMA-3-8B-style MLP up-projection). The weight is on the format's grid "
                  "(quantizing it is lossless), so every step computes the same function; ideal bytes count the "
                  "packed weight and its scales" + ("; x is on the int8 grid (per-token int8 is exact)"
                                                    if activations else "")),
        )
    )


for _label, _scheme, _group, _acts in FORMATS:
    for _m in BATCHES:
        _register(_label, _scheme, _group, _acts, _m)


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------

#: Shapes of gpu_checks at each size: layers (N, K) checked, batch sizes checked, the timed layer and batches.
CHECK_SIZES = {
    "gpu": {"layers": [(14336, 4096), (4096, 14336), (1000, 4000)], "batches": (1, 4, 16, 100),
            "timed": (14336, 4096), "timed_batches": (1, 4, 16)},
    "smoke": {"layers": [(96, 256)], "batches": (3,), "timed": (64, 256), "timed_batches": (1,)},
}
#: (label, scheme, group size, activations) of every format gpu_checks covers.
CHECK_FORMATS = [
    ("int8", "int8", None, None),
    ("int4 g128", "int4", 128, None),
    ("int4 g32", "int4", 32, None),
    ("fp8 e4m3", "fp8", None, None),
    ("W8A8", "int8", None, "int8"),
]


def per_token_dequantized(x: torch.Tensor) -> torch.Tensor:
    """x after symmetric per-token int8 quantization and back, in float32 (torch; the W8A8 reference's input)."""
    x = x.float()
    scales = x.abs().amax(dim=-1, keepdim=True) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / scales).clamp(-127, 127) * scales


def _reference(x, qweight, bias, activations):
    """float32 ``F.linear`` with the dequantized weight (and per-token quantized x for W8A8)."""
    xs = per_token_dequantized(x) if activations else x.float()
    return F.linear(xs, qweight.dequantize(torch.float32), None if bias is None else bias.float())


def _run(x, qweight, bias, activations):
    with torch.no_grad():
        return quantized_linear(x, qweight, bias, activations=activations)


def gpu_checks(size: str = "gpu") -> list:
    """Correctness (bf16 and fp16 activations) and decode timings (bf16) of ``kernel_ladder.quantized_linear``.

    ``size="gpu"``: on CUDA, the LLaMA-3-8B-style MLP up- (4096 -> 14336) and down-projection
    (14336 -> 4096) and an odd 4000 -> 1000 layer, at 1, 4, 16 and 100 tokens, every format, a
    bias on the odd layer; timings at 1, 4 and 16 tokens of the up-projection. ``size="smoke"``:
    a tiny layer on ``kernel_ladder.runtime.DEVICE`` (the CPU interpreter included).
    """
    from bench.gpu import Check, Timing

    device = torch.device("cuda") if size == "gpu" else kernel_ladder.runtime.DEVICE
    shapes = CHECK_SIZES["gpu" if size == "gpu" else "smoke"]
    entries: list = []
    for index, (n, k) in enumerate(shapes["layers"]):
        w = make_weight(n, k, device, seed=10 + index)
        qweights = {label: quantize_weight(w, scheme, group_size=group) for label, scheme, group, _ in CHECK_FORMATS}
        odd = (n, k) == (1000, 4000)
        for dtype in (torch.bfloat16, torch.float16):
            bias = (0.1 * torch.randn(n, generator=_generator(20 + index))).to(device, dtype) if odd else None
            for m in shapes["batches"]:
                x = torch.randn(m, k, generator=_generator(30 + m)).to(device, dtype)
                for label, _scheme, _group, acts in CHECK_FORMATS:
                    qw = qweights[label]
                    entries.append(Check(
                        f"quantized_linear {label} ({m},{k})x({n},{k}){' +bias' if odd else ''}", dtype,
                        lambda x=x, qw=qw, b=bias, a=acts: _run(x, qw, b, a),
                        lambda x=x, qw=qw, b=bias, a=acts: _reference(x, qw, b, a)))

    n, k = shapes["timed"]
    w = make_weight(n, k, device, seed=40).to(torch.bfloat16)
    qweights = {label: quantize_weight(w, scheme, group_size=group) for label, scheme, group, _ in CHECK_FORMATS}
    bf16_bytes = w.nbytes
    target = ">= 80% of HBM bandwidth (weight bytes); faster than F.linear bf16 at M=1"
    for m in shapes["timed_batches"]:
        x = torch.randn(m, k, generator=_generator(50 + m)).to(device, torch.bfloat16)
        op = f"decode linear M={m} {k}->{n}"
        int4 = qweights["int4 g128"]
        entries += [
            Timing(op, "torch F.linear bf16", lambda x=x: F.linear(x, w), bytes=bf16_bytes, baseline=True),
            Timing(op, "kernel_ladder.linear bf16", lambda x=x: kernel_ladder.linear(x, w), bytes=bf16_bytes),
            # reads the packed weight, writes a bf16 copy, reads that back
            Timing(op, "torch dequant int4 + F.linear", lambda x=x: F.linear(x, int4.dequantize()),
                   bytes=int4.nbytes + 2 * bf16_bytes),
        ]
        for label, _scheme, _group, acts in CHECK_FORMATS:
            qw = qweights[label]
            weight_only_target = target if label in ("int8", "int4 g128") and acts is None else ""
            entries.append(Timing(op, f"quantized_linear {label}", lambda x=x, qw=qw, a=acts: _run(x, qw, None, a),
                                  bytes=qw.nbytes, target=weight_only_target))
    return entries
