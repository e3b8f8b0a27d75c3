"""Every matmul kernel variant compiles for a Hopper GPU (sm_90), and the dots run on tensor cores.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. This proves what
the interpreter cannot: that each variant (tile loop with and without K masks, epilogues, int64
offsets, split-K partials and their reduction, the persistent loop) is valid compiled Triton, that
fp16/bf16 tiles become Hopper warp-group MMAs (``wgmma``), that fp32 with ``input_precision="tf32"``
uses tensor cores too, and that ``"ieee"`` fp32 does not (exact fp32 products need the FMA units).
Each variant is compiled at the specialization a launch gives it (which strides are 1), and none may spill
registers; the launched layouts keep a margin under the 255-register limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "matmul.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_matmul_kernels_compile_for_sm90_on_tensor_cores(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
