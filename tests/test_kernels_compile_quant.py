"""The quantization kernels compile for a Hopper GPU (sm_90), every variant the launchers use.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX. Besides proving
every variant is valid compiled Triton, the PTX is checked for what the design relies on:

* weight-only kernels run ``tl.dot`` on 16-bit tensor cores (``mma``/``wgmma`` with f16/bf16
  operands), the fp8 path converts e4m3 in hardware (``cvt...e4m3x2``), and W8A8 multiplies
  int8 by int8 into int32 (an ``.s8`` MMA);
* the quantizers keep the round-half-to-even trick (the constant 1.5 * 2**23 is not folded
  away) and divide with IEEE rounding (``div.rn.f32``);
* the fp8 quantizer's conversion saturates (``satfinite``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.aot import run_compiled

SCRIPT = Path(__file__).parent / "aot" / "quant.py"  # run in a compiled-mode child process


@pytest.mark.slow
def test_quantization_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
