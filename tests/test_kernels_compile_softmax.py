"""The softmax kernels compile for a Hopper GPU (sm_90): every variant, at the sizes the launch rule
picks, without register spills, vectorized on contiguous rows and coalesced on transposed ones.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX and a cubin. This
proves on a CPU-only machine what the interpreter cannot:

* every kernel variant (softmax / log-softmax, forward / backward, one-block / online, linear or
  per-row row offsets, int32 or int64 column offsets, fp32 / fp16 / bf16) is valid compiled Triton;
* at the largest one-block sizes :func:`kernel_ladder.softmax.softmax_launch_config` chooses (32768
  columns forward, 16384 backward, 32 warps) and for the online chunks, ptxas allocates the
  registers without spilling to local memory (the reason for the limits);
* rows whose columns are contiguous get 128-bit loads and stores (``ld.global.v4``);
* when the rows are contiguous instead (a softmax over a non-innermost dim), the loads and stores
  are laid out along the rows (``order = [0, 1]``): neighbouring threads touch neighbouring addresses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "softmax.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_softmax_kernels_compile_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
