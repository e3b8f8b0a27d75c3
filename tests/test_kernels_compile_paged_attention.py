"""The paged-attention kernels compile for a Hopper GPU (sm_90) without register spills, their dot paths on
tensor cores (see tests/aot/paged_attention.py). No GPU is needed: Triton compiles ahead of time.

By default (``make test``) the quick set: decode with a GQA group as dot rows and with the elementwise
path, an fp8 cache with split-KV, packed queries with a window and soft-capping, and the merge;
``KERNEL_LADDER_AOT_FULL=1`` adds fp32, head dim 256, int64 offsets and 8-token blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "paged_attention.py"  # run in a compiled-mode child process
FULL_ENV = "KERNEL_LADDER_AOT_FULL"


@pytest.mark.slow
def test_paged_attention_kernels_compile_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    full = os.environ.get(FULL_ENV, "") == "1"
    result = run_compiled(SCRIPT, tmp_path, timeout=900, args=() if full else ("--quick",))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
