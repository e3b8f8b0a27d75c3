"""The flash-attention kernels compile for a Hopper GPU (sm_90) without register spills, with the block
products on tensor cores (see tests/aot/flash_attention.py). No GPU is needed: Triton compiles ahead of time.

What it proves that the interpreter cannot: every tile configuration the autotuner may pick on a GPU is
valid compiled Triton at the head dims it is allowed (64, 128, and 256 for the smallest tiles), in bf16,
with soft-capping, in fp32, varlen and with int64 offsets — each as the op's launcher builds it for an 8k
context (int64 offsets) and for 1000 tokens — and ptxas fits each in the register file
(``AttentionConfig.max_head_dim`` and its variants are exactly these measurements); and that the
products with 64 rows or more become Hopper's warp-group MMAs (``wgmma``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "flash_attention.py"  # run in a compiled-mode child process


#: Set to 1 to compile every tile configuration and switch at both lengths (about 470 variants, 9 minutes on 2
#: cores); by default one configuration per kernel at head dims 64 and 128 and every dK/dV one at 128 (what
#: ``make test`` can afford, about 20 seconds).
FULL_ENV = "KERNEL_LADDER_AOT_FULL"


@pytest.mark.slow
def test_flash_attention_kernels_compile_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    full = os.environ.get(FULL_ENV, "") == "1"
    result = run_compiled(SCRIPT, tmp_path, timeout=1800, args=() if full else ("--quick",))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
