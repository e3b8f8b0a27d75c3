"""The routing kernels compile for a Hopper GPU (sm_90) at real routers' sizes (DeepSeek-V3's group-limited
routing included) without register spills (see tests/aot/topk_routing.py). No GPU is needed: Triton compiles
ahead of time."""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "topk_routing.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_topk_routing_kernels_compile_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
