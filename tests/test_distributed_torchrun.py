"""The production path: kernels.distributed under torchrun's own launcher and rendezvous (gloo)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_selfcheck_passes_under_torchrun():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kernels.distributed.selfcheck", "--timeout", "60"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "selfcheck on 2 ranks (gloo)" in out.stdout
    assert out.stdout.count("  ok   ") == 3 and "FAIL" not in out.stdout
