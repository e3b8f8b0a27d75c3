"""Solutions to chapter 00, "the GPU model and measuring".

One solution per exercise, written for reading:

* :func:`grid_size` — how many programs a 1-D launch needs, and how many lanes of the last one idle;
* :func:`matmul_traffic` — the ideal bytes, FLOPs and arithmetic intensity of a matmul;
* :func:`add_kernel` — the masked vector-add Triton kernel;
* :func:`sectors_touched` — predicting the 32-byte sectors a strided load touches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (picks compiled vs interpreter; triton reads it when @triton.jit runs)

__all__ = ["grid_size", "matmul_traffic", "add_kernel", "sectors_touched", "SECTOR_BYTES"]

#: A GPU's memory system moves data in 32-byte sectors (four of them make a 128-byte cache line).
SECTOR_BYTES = 32


def grid_size(n: int, BLOCK: int) -> tuple[int, int]:
    """Programs needed to cover ``n`` elements with ``BLOCK`` lanes each, and the idle lanes.

    Teaches: a launch has a whole number of programs, so it rounds *up* (ceil division); the
    last program then has ``programs * BLOCK - n`` lanes with nothing to do — the lanes a mask
    switches off. ``n = 0`` needs no programs at all.
    """
    programs = (n + BLOCK - 1) // BLOCK  # ceil(n / BLOCK) in integers, no float rounding
    idle_lanes = programs * BLOCK - n
    return programs, idle_lanes


def matmul_traffic(M: int, N: int, K: int, dtype: torch.dtype) -> tuple[int, int, float]:
    """Ideal bytes, FLOPs and arithmetic intensity of ``C[M, N] = A[M, K] @ B[K, N]``.

    Teaches: the ideal traffic reads every input once and writes every output once —
    ``(M*K + K*N + M*N) * itemsize`` bytes — while the work is one multiply and one add per
    (m, n, k): ``2*M*N*K`` FLOPs. Their ratio, FLOPs per byte, is what places an op on the
    roofline: it grows with the sizes (matmuls can be compute-bound), and halves when the
    dtype doubles in size.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    ideal_bytes = (M * K + K * N + M * N) * itemsize
    flops = 2 * M * N * K
    return ideal_bytes, flops, flops / ideal_bytes


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[i] = x[i] + y[i]`` for ``i < n``; program ``pid`` handles ``[pid*BLOCK, (pid+1)*BLOCK)``.

    Teaches: a Triton program works on a whole BLOCK of elements at once (``tl.arange``), its
    place in the grid comes from ``tl.program_id``, and the mask keeps the last program's
    tail lanes from reading or writing past ``n`` (masked-off lanes move no bytes).
    """
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    x = tl.load(x_ptr + offsets, mask=in_bounds)
    y = tl.load(y_ptr + offsets, mask=in_bounds)
    tl.store(out_ptr + offsets, x + y, mask=in_bounds)


def sectors_touched(n: int, stride: int, BLOCK: int, elem_bytes: int = 4) -> int:
    """32-byte sectors touched by ``x[offsets * stride]`` for ``offsets < n``, one load per program.

    Teaches: memory is not moved element by element but in 32-byte sectors. A load instruction
    costs the number of *distinct* sectors its lanes' addresses fall in (``address // 32``),
    summed over the programs (each program issues its own load). Contiguous fp32 packs 8
    elements per sector; once ``stride * elem_bytes >= 32`` every element costs a whole sector.
    Assumes ``x`` starts on a 32-byte boundary (allocators align far more than that).
    """
    total = 0
    for start in range(0, n, BLOCK):  # one program per BLOCK of offsets
        lanes = range(start, min(start + BLOCK, n))  # the lanes the mask keeps
        total += len({(i * stride * elem_bytes) // SECTOR_BYTES for i in lanes})
    return total
