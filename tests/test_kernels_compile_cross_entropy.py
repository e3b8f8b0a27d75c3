"""The cross-entropy kernels compile for a Hopper GPU (sm_90), with vectorized loads and stores.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. Each switch of
the kernels is compiled at least once, in bf16 and fp32 logits: with and without the gradient pass
(and label smoothing), one block per row (short rows stacked ``ROWS`` high) and the chunked
long-row loop, contiguous (the launcher specializes a column stride of 1) and strided with int64
column offsets. The contiguous ones must read the logits with 128-bit loads (``ld.global.v4``)
and write the gradient with vector stores: what a memory-bound row op needs to approach copy
bandwidth.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "cross_entropy.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_cross_entropy_kernels_compile_for_sm90_and_vectorize(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
