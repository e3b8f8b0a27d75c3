"""The grouped-GEMM kernels compile for a Hopper GPU (sm_90) at every tile the autotuner may pick
(kernel_ladder.ops.moe_configs), without register spills, with wgmma wherever a dot has 64 rows or more (see
tests/aot/grouped_matmul.py). No GPU is needed: Triton compiles ahead of time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "grouped_matmul.py"  # run in a compiled-mode child process

#: Set to 1 to compile every candidate of every kind at each of its sizes (145 variants, 2-6 minutes on 2
#: cores); by default the default table's entries (what ``make test`` can afford).
FULL_ENV = "KERNEL_LADDER_AOT_FULL"


@pytest.mark.slow
def test_grouped_matmul_kernels_compile_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    full = os.environ.get(FULL_ENV, "") == "1"
    result = run_compiled(SCRIPT, tmp_path, timeout=1800, args=() if full else ("--quick",))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
