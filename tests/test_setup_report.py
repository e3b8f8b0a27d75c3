"""What ``make setup`` prints about the environment is true (utils.setup_report)."""

from __future__ import annotations

from pathlib import Path

import torch

from utils import setup_report

REPO = Path(__file__).resolve().parent.parent


def test_the_torch_line_names_this_build_and_a_real_size() -> None:
    line = setup_report.torch_report()
    build = "CPU" if not torch.version.cuda and not getattr(torch.version, "hip", None) else "CUDA"
    assert f"torch {torch.__version__}, {build}" in line
    size_mb = setup_report.distribution_bytes("torch") / 2**20
    assert size_mb > 50, size_mb  # the files of torch's own distribution, counted from its RECORD
    assert setup_report.distribution_bytes("no-such-distribution") == 0


def test_the_import_check_accepts_this_repository_and_refuses_another() -> None:
    ok, line = setup_report.imports_report(REPO)
    assert ok, line
    wrong, message = setup_report.imports_report(REPO / "docs")  # negative control: not where it imports from
    assert not wrong and "not this repository's" in message
