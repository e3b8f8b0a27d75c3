"""The RoPE kernel compiles for a Hopper GPU (sm_90) in every variant, without register spills, with vector
loads on contiguous halves (see tests/aot/rope.py). No GPU is needed: Triton compiles ahead of time."""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "rope.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_rope_kernel_compiles_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
