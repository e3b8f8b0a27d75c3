"""The normalization kernels compile for a Hopper GPU (sm_90): vectorized, and without register spills.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX and (with ptxas)
a cubin. Every kernel variant the launchers can pick is compiled with the tile, block and warp
count :func:`kernel_ladder._norm.norm_launch_config` chooses, specialized the way Triton's launcher
specializes a contiguous tensor (column strides equal to 1, sizes and strides divisible by 16).
The test proves what the interpreter cannot: that each variant is valid compiled Triton, that the
contiguous fused path issues 128-bit loads and stores, and that the fused paths fit in registers
(no local-memory stack) at their largest blocks — the measurement behind
``MAX_FUSED_BLOCK_BACKWARD``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "norm.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_norm_kernels_compile_for_sm90_vectorized_and_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
