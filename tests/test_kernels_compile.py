"""The elementwise kernels compile for a Hopper GPU (sm_90), and their flat path is vectorized.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. This proves, on a
CPU-only machine, what the interpreter cannot: that every kernel variant is valid compiled Triton,
and that the contiguous fast path issues 128-bit loads and stores (``ld.global.v4``) — the
instructions that let a memory-bound kernel approach copy bandwidth.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "elementwise.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_flat_path_is_vectorized(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
