"""Chapter 04's ladders: matmul from one program per output to the autotuned kernel; the fused linear
epilogue; split-K for skinny (decode-shaped) problems.

* **matmul** — torch.matmul (cuBLAS on a GPU) as the baseline, then the chapter's steps: one
  program per output element (``solutions.ch04_matmul.matmul_naive_kernel``), tiles in row-major
  order (``matmul_tiled_kernel``), the same tiles in grouped order (``matmul_grouped_kernel``,
  GROUP_M = 8), and ``kernel_ladder.matmul`` (autotuned on a GPU). Two ladders: 4096³ and 8192³ bf16 on
  a GPU; tiny sizes on the CPU, where the tracer counts every byte.
* **linear + GELU** — torch unfused (``x @ W.T``, ``+ b``, ``gelu``: three launches; and
  ``F.linear`` + ``F.gelu``: two) against ``kernel_ladder.linear(..., activation="gelu")``: one launch.
* **skinny matmul** (M = 1 and M = 16 rows, a decode step) — torch, the tiled kernel alone, split-K,
  and ``kernel_ladder.matmul``'s own dispatch.

``gpu_checks(size)`` adds the chapter's entries to ``make gpu-check``: correctness in bf16 and fp16
at real sizes (matmul 2-D, batched, broadcast, transposed views, odd sizes, each kernel variant,
split-K at decode shapes, linear forward and backward), and timings against torch.matmul (cuBLAS)
with the FLOPs and bytes each must do — the target being >= 95% of cuBLAS at 4096³ and 8192³ bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernel_ladder
from bench import Ladder, Step, register
from kernel_ladder import MatmulConfig, linear, matmul, matmul_persistent, matmul_split_k, matmul_tiled
from solutions import ch04_matmul as solutions

#: (M, N, K) of each matmul ladder: tiny on the CPU (the naive step runs M*N interpreted programs).
MATMUL_SIZES = {
    "4096": {"cpu": (16, 32, 64), "gpu": (4096, 4096, 4096)},
    "8192": {"cpu": (32, 48, 32), "gpu": (8192, 8192, 8192)},
}
#: (M, N, K) of the linear layer: tokens, out_features, in_features (a LLaMA-3-8B MLP up-projection on a GPU).
LINEAR_SIZES = {"cpu": (64, 96, 64), "gpu": (8192, 14336, 4096)}
#: (N, K) of the skinny problems (a 4096 x 4096 projection on a GPU), and the split used by the split-K step.
SKINNY_SIZES = {"cpu": (128, 1024), "gpu": (4096, 4096)}
SKINNY_SPLIT = 4

#: This chapter's ladders by op name (the notebook's results table runs one of them).
LADDERS: dict[str, Ladder] = {}


def _register(ladder: Ladder) -> None:
    LADDERS[ladder.op] = register(ladder)


def _tiles() -> dict:
    """Tile sizes of the chapter's tiled kernels: small in the interpreter, Hopper-sized compiled."""
    if kernel_ladder.runtime.INTERPRETER:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def naive(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One program per output element; K read in chunks of 64 (128 compiled)."""
    return solutions.naive_matmul(a, b, BLOCK_K=64 if kernel_ladder.runtime.INTERPRETER else 128)


def tiled_row_major(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return solutions.tiled_matmul(a, b, **_tiles())


def tiled_grouped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return solutions.grouped_matmul(a, b, GROUP_M=8, **_tiles())


def _randn(shape, device, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)


def _matmul_inputs(sizes):
    def make(device, dtype, size):
        M, N, K = sizes[size]
        return _randn((M, K), device, dtype, 0), _randn((K, N), device, dtype, 1)

    return make


def _matmul_reference(a, b):
    return a.double() @ b.double()


for _label, _sizes in MATMUL_SIZES.items():
    _m, _n, _k = _sizes["cpu"]
    _register(
        Ladder(
            chapter="04_matmul",
            op=f"matmul {_label}³",
            make_inputs=_matmul_inputs(_sizes),
            reference=_matmul_reference,
            dtype=torch.bfloat16,
            steps=[
                Step("torch.matmul (cuBLAS)", torch.matmul, baseline=True),
                # One program per output: 2^26 programs at 8192², each walking all of K — minutes per call.
                Step("naive: one program per output", naive, on_gpu=_label == "4096"),
                Step("tiled, row-major (GROUP_M=1)", tiled_row_major),
                Step("tiled, grouped (GROUP_M=8)", tiled_grouped),
                Step("kernel_ladder.matmul (autotuned)", matmul),
            ],
            note=(f"{_m}x{_n}x{_k} bf16 on the CPU (tiles 16x16x32); {_label}³ bf16 on a GPU (tiles 128x128x64, "
                  "8 warps, 3 stages; kernel_ladder.matmul autotuned). torch's bytes are its operands and result "
                  "(what cuBLAS must move at least); the Triton steps' are every load the kernel issues."),
        )
    )


def linear_gelu_three_ops(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ W.T``, ``+ b``, ``gelu``: the (M, N) result makes two extra round trips through memory."""
    return F.gelu(x @ w.t() + b)


def linear_gelu_torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.linear`` (cuBLAS adds the bias in its epilogue) then ``F.gelu``: one extra round trip."""
    return F.gelu(F.linear(x, w, b))


def linear_gelu_fused(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return linear(x, w, b, activation="gelu")


def _linear_inputs(device, dtype, size):
    M, N, K = LINEAR_SIZES[size]
    return (_randn((M, K), device, dtype, 2), _randn((N, K), device, dtype, 3, scale=K**-0.5),
            _randn((N,), device, dtype, 4))


_register(
    Ladder(
        chapter="04_matmul",
        op="linear + gelu",
        make_inputs=_linear_inputs,
        reference=lambda x, w, b: F.gelu(x.double() @ w.double().t() + b.double()),
        dtype=torch.bfloat16,
        steps=[
            Step("torch: x @ W.T, + b, gelu", linear_gelu_three_ops),
            Step("torch: F.linear, F.gelu", linear_gelu_torch, baseline=True),
            Step("kernel_ladder.linear(activation='gelu')", linear_gelu_fused),
        ],
        note=("x 64x64, W 96x64 bf16 on the CPU; x 8192x4096, W 14336x4096 bf16 on a GPU (a LLaMA-3-8B MLP "
              "up-projection); the fused epilogue writes the output once"),
    )
)


def skinny_split_k(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return matmul_split_k(a, b, SKINNY_SPLIT)


def skinny_no_split(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return matmul_tiled(a, b)


def _skinny_inputs(rows):
    def make(device, dtype, size):
        N, K = SKINNY_SIZES[size]
        return _randn((rows, K), device, dtype, 5), _randn((K, N), device, dtype, 6, scale=K**-0.5)

    return make


for _rows in (1, 16):
    _register(
        Ladder(
            chapter="04_matmul",
            op=f"skinny matmul M={_rows}",
            make_inputs=_skinny_inputs(_rows),
            reference=_matmul_reference,
            dtype=torch.bfloat16,
            steps=[
                Step("torch.matmul (cuBLAS)", torch.matmul, baseline=True),
                Step("kernel_ladder.matmul_tiled (no split)", skinny_no_split),
                Step(f"kernel_ladder.matmul_split_k (split {SKINNY_SPLIT})", skinny_split_k),
                Step("kernel_ladder.matmul (dispatch)", matmul),
            ],
            note=(f"({_rows} x 1024) @ (1024 x 128) bf16 on the CPU; ({_rows} x 4096) @ (4096 x 4096) on a GPU: "
                  "a decode step's projection, too few output tiles to fill the GPU without splitting K"),
        )
    )


# ----------------------------------------------------------------------------------------------
# make gpu-check
# ----------------------------------------------------------------------------------------------

#: Shapes of gpu_checks at each size.
CHECK_SIZES = {
    "gpu": {"square": 4096, "batched": (8, 1024, 768, 512), "odd": (1000, 1001, 999), "linear": (4096, 11008, 4096),
            "timed": (4096, 8192), "decode": (1, 4, 16), "decode_nk": (4096, 4096),
            "linear_timed": (8192, 14336, 4096)},
    "smoke": {"square": 64, "batched": (2, 24, 40, 32), "odd": (17, 33, 20), "linear": (24, 40, 32),
              "timed": (64,), "decode": (1, 16), "decode_nk": (64, 512), "linear_timed": (32, 48, 64)},
}


def _float_matmul(a, b):
    return a.float() @ b.float()


def _linear_grads(fn, x, w, b, upcast=False):
    """Output and gradients (x, W, b) of ``fn(x, w, b)`` with a fixed upstream gradient."""
    leaves = [(t.float() if upcast else t).detach().requires_grad_(True) for t in (x, w, b)]
    out = fn(*leaves)
    g = torch.ones_like(out) / out.shape[-1] ** 0.5
    return (out.detach(), *torch.autograd.grad(out, leaves, g))


def gpu_checks(size: str = "gpu") -> list:
    """Correctness (bf16 and fp16) and timings (bf16) of the chapter's kernels at real sizes.

    ``size="gpu"``: on CUDA, 4096³ and 8192³ matmuls, batches, odd sizes, decode shapes
    (M = 1, 4, 16 against 4096 x 4096) and a linear layer. ``size="smoke"``: tiny versions of the
    same on ``kernel_ladder.runtime.DEVICE`` (the CPU interpreter included). References are torch in
    float32; every timing declares its FLOPs (2·M·N·K) and the bytes it must move at least.
    """
    from bench.gpu import Check, Timing

    device = torch.device("cuda") if size == "gpu" else kernel_ladder.runtime.DEVICE
    shapes = CHECK_SIZES["gpu" if size == "gpu" else "smoke"]
    entries: list = []
    n = shapes["square"]
    batch, bm, bn, bk = shapes["batched"]
    om, on, ok = shapes["odd"]
    for dtype in (torch.bfloat16, torch.float16):
        a, b = _randn((n, n), device, dtype, 10), _randn((n, n), device, dtype, 11)
        ab, bb = _randn((batch, bm, bk), device, dtype, 12), _randn((batch, bk, bn), device, dtype, 13)
        b2 = _randn((bk, bn), device, dtype, 14)
        oa, ob = _randn((om, ok), device, dtype, 15), _randn((ok, on), device, dtype, 16)
        ta, tb = _randn((n, n), device, dtype, 17).t(), _randn((n, n), device, dtype, 18).t()
        entries += [
            Check(f"matmul {n}x{n}x{n}", dtype, lambda a=a, b=b: matmul(a, b), lambda a=a, b=b: _float_matmul(a, b)),
            Check(f"matmul batched ({batch},{bm},{bk})@({batch},{bk},{bn})", dtype,
                  lambda a=ab, b=bb: matmul(a, b), lambda a=ab, b=bb: _float_matmul(a, b)),
            Check(f"matmul broadcast ({batch},{bm},{bk})@({bk},{bn})", dtype,
                  lambda a=ab, b=b2: matmul(a, b), lambda a=ab, b=b2: _float_matmul(a, b)),
            Check(f"matmul transposed views a.T @ b.T {n}³", dtype,
                  lambda a=ta, b=tb: matmul(a, b), lambda a=ta, b=tb: _float_matmul(a, b)),
            Check(f"matmul odd sizes {om}x{on}x{ok}", dtype,
                  lambda a=oa, b=ob: matmul(a, b), lambda a=oa, b=ob: _float_matmul(a, b)),
            Check(f"matmul_tiled GROUP_M=1 {om}x{on}x{ok}", dtype,
                  lambda a=oa, b=ob: matmul_tiled(a, b, MatmulConfig(GROUP_M=1)),
                  lambda a=oa, b=ob: _float_matmul(a, b)),
            Check(f"matmul_persistent {n}³", dtype, lambda a=a, b=b: matmul_persistent(a, b),
                  lambda a=a, b=b: _float_matmul(a, b)),
            Check(f"ch04 tiled kernel (grouped) {om}x{on}x{ok}", dtype, lambda a=oa, b=ob: tiled_grouped(a, b),
                  lambda a=oa, b=ob: _float_matmul(a, b)),
        ]
        dn, dk = shapes["decode_nk"]
        w = _randn((dk, dn), device, dtype, 19, scale=dk**-0.5)
        for rows in shapes["decode"]:
            x = _randn((rows, dk), device, dtype, 20 + rows)
            entries += [
                Check(f"matmul_split_k decode ({rows},{dk})@({dk},{dn}) split {SKINNY_SPLIT}", dtype,
                      lambda x=x, w=w: matmul_split_k(x, w, SKINNY_SPLIT), lambda x=x, w=w: _float_matmul(x, w)),
                Check(f"matmul decode ({rows},{dk})@({dk},{dn}) dispatch", dtype,
                      lambda x=x, w=w: matmul(x, w), lambda x=x, w=w: _float_matmul(x, w)),
            ]
        lm, ln, lk = shapes["linear"]
        x = _randn((lm, lk), device, dtype, 30)
        lw = _randn((ln, lk), device, dtype, 31, scale=lk**-0.5)
        lb = _randn((ln,), device, dtype, 32)
        entries += [
            Check(f"linear+gelu forward ({lm},{lk})x({ln},{lk})", dtype,
                  lambda x=x, w=lw, b=lb: linear(x, w, b, activation="gelu"),
                  lambda x=x, w=lw, b=lb: F.gelu(F.linear(x.float(), w.float(), b.float()))),
            Check(f"linear+gelu forward+backward (y, dx, dW, db) ({lm},{lk})x({ln},{lk})", dtype,
                  lambda x=x, w=lw, b=lb: _linear_grads(lambda *t: linear(*t, activation="gelu"), x, w, b),
                  lambda x=x, w=lw, b=lb: _linear_grads(lambda *t: F.gelu(F.linear(*t)), x, w, b, upcast=True)),
        ]

    dtype = torch.bfloat16
    for n in shapes["timed"]:
        a, b = _randn((n, n), device, dtype, 40), _randn((n, n), device, dtype, 41)
        op, flops, moved = f"matmul {n}³ bf16", 2 * n**3, 3 * n * n * 2
        entries += [
            Timing(op, "torch.matmul (cuBLAS)", lambda a=a, b=b: torch.matmul(a, b), bytes=moved, flops=flops,
                   baseline=True),
            Timing(op, "kernel_ladder.matmul", lambda a=a, b=b: matmul(a, b), bytes=moved, flops=flops,
                   target=">= 95% of cuBLAS"),
            Timing(op, "kernel_ladder.matmul_tiled GROUP_M=1", lambda a=a, b=b: matmul_tiled(a, b, _fixed(a, 1)),
                   bytes=moved, flops=flops, target="grouped order's gain: compare with GROUP_M=8"),
            Timing(op, "kernel_ladder.matmul_tiled GROUP_M=8", lambda a=a, b=b: matmul_tiled(a, b, _fixed(a, 8)),
                   bytes=moved, flops=flops),
            Timing(op, "kernel_ladder.matmul_persistent", lambda a=a, b=b: matmul_persistent(a, b), bytes=moved,
                   flops=flops),
            Timing(op, "ch04 tiled, grouped", lambda a=a, b=b: tiled_grouped(a, b), bytes=moved, flops=flops),
        ]
    dn, dk = shapes["decode_nk"]
    w = _randn((dk, dn), device, dtype, 42, scale=dk**-0.5)
    for rows in shapes["decode"]:
        x = _randn((rows, dk), device, dtype, 43 + rows)
        op, flops, moved = f"matmul decode M={rows} ({dk}x{dn}) bf16", 2 * rows * dn * dk, (rows * dk + dk * dn
                                                                                            + rows * dn) * 2
        entries += [
            Timing(op, "torch.matmul (cuBLAS)", lambda x=x, w=w: torch.matmul(x, w), bytes=moved, flops=flops,
                   baseline=True),
            Timing(op, "kernel_ladder.matmul_tiled (no split)", lambda x=x, w=w: matmul_tiled(x, w), bytes=moved,
                   flops=flops),
            Timing(op, f"kernel_ladder.matmul_split_k {SKINNY_SPLIT}",
                   lambda x=x, w=w: matmul_split_k(x, w, SKINNY_SPLIT),
                   bytes=moved, flops=flops),
            Timing(op, "kernel_ladder.matmul (dispatch)", lambda x=x, w=w: matmul(x, w), bytes=moved, flops=flops,
                   target="faster than the unsplit tiled kernel; memory-bound: GB/s near copy"),
        ]
    lm, ln, lk = shapes["linear_timed"]
    x = _randn((lm, lk), device, dtype, 50)
    lw = _randn((ln, lk), device, dtype, 51, scale=lk**-0.5)
    lb = _randn((ln,), device, dtype, 52)
    op, flops, moved = f"linear+gelu ({lm},{lk})x({ln},{lk}) bf16", 2 * lm * ln * lk, (lm * lk + ln * lk + ln
                                                                                       + lm * ln) * 2
    entries += [
        Timing(op, "torch F.linear + F.gelu", lambda: linear_gelu_torch(x, lw, lb), bytes=moved, flops=flops,
               baseline=True),
        Timing(op, "torch x @ W.T, + b, gelu", lambda: linear_gelu_three_ops(x, lw, lb), bytes=moved, flops=flops),
        Timing(op, "kernel_ladder.linear (fused gelu)", lambda: linear_gelu_fused(x, lw, lb), bytes=moved, flops=flops,
               target="faster than torch's two launches"),
    ]
    return entries


def _fixed(a: torch.Tensor, group_m: int) -> MatmulConfig | None:
    """A fixed tiled config (128x128x64, 8 warps, 3 stages on a GPU) with the given GROUP_M."""
    if kernel_ladder.runtime.INTERPRETER:
        return MatmulConfig(64, 64, 32, group_m, 4, 2)
    return MatmulConfig(128, 128, 32 if a.dtype == torch.float32 else 64, group_m, 8, 3)
