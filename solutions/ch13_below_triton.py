"""Solutions to chapter 13, "below Triton: C++ and CUDA".

One solution per exercise of ``chapters/13_below_triton/13_below_triton.ipynb``, written for reading. Each
exercise has its own section below.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------------------
# Exercise 4: a bank-conflict-free layout of the GEMM's transposed A tile (shared memory)
# ----------------------------------------------------------------------------------------------


def smem_swizzle(row: int, col: int) -> int:
    """The 4-byte word where element ``(row, col)`` of the transposed A tile (16 rows of k, 128 columns of m) is
    kept in shared memory: an XOR swizzle.

    What it teaches: the kernel's store writes, per warp, 8 rows m of A for each of the 4 groups of k (rows
    0-3, 4-7, 8-11, 12-15 of the tile); stored at ``row * 128 + col``, the 4 groups land in the same 8 banks
    (128 is a multiple of 32): a 4-way conflict. Padding each row by 4 words moves each group by 16 banks, so
    groups 0 and 2 still collide; a pad that is not a multiple of 4 would break the float4 reads. XOR-ing the
    column with ``8 * (row // 4)`` gives group g its own 8 banks (``8 g`` .. ``8 g + 7``), and, being a multiple
    of 4, keeps every aligned group of 4 columns 4 consecutive, 16-byte aligned words — with no padding at all.
    """
    return row * 128 + (col ^ (8 * (row // 4)))
