"""nbval as ``make test`` runs it over the chapters (``utils/nbval_plugin.py``), on small notebooks made here.

Each case writes a one-cell notebook whose committed output is given, runs ``pytest --nbval`` on it in a
child process with the plugin loaded, and reads the verdict: the learner-mode environment reaches the
kernel, a rounding residue within the factor passes, and the negative controls — a residue beyond the
factor, a changed digit of an ordinary number, a kernel in solution mode, plain nbval without the
plugin — fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from utils.notebooks import KERNEL_DISPLAY_NAME, KERNEL_NAME, RESIDUE_FACTOR, chapter_notebooks

REPO = Path(__file__).resolve().parent.parent


def _nbval(tmp_path: Path, source: str, committed: str, plugin: bool = True) -> subprocess.CompletedProcess:
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=committed)]  # as if run and saved
    notebook = nbformat.v4.new_notebook(cells=[cell])
    notebook.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": KERNEL_DISPLAY_NAME, "language": "python"}
    path = tmp_path / "case.ipynb"
    nbformat.write(notebook, path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_LADDER_SOLUTIONS")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", *(["-p", "utils.nbval_plugin"] if plugin else []),
         "-p", "no:cacheprovider", "-q", "-p", "no:xdist", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def _passed(run: subprocess.CompletedProcess) -> bool:
    if run.returncode not in (0, 1):
        raise AssertionError(f"pytest did not run the notebook ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    return run.returncode == 0


@pytest.mark.slow
def test_the_kernel_runs_in_learner_mode_with_the_fixed_check_seed(tmp_path: Path) -> None:
    source = "import os\nprint(os.environ['KERNEL_LADDER_SOLUTIONS'], os.environ['KERNEL_LADDER_CHECK_SEED'])"
    assert _passed(_nbval(tmp_path, source, "0 0\n"))
    assert not _passed(_nbval(tmp_path, source, "1 0\n"))  # negative control: solution mode would differ


@pytest.mark.slow
def test_rounding_residues_match_within_the_factor_and_nothing_else_does(tmp_path: Path) -> None:
    source = "print('max error 2.9e-07 over 1,024 rows')"
    assert _passed(_nbval(tmp_path, source, "max error 2.9e-07 over 1,024 rows\n"))
    assert _passed(_nbval(tmp_path, source, "max error 6.1e-07 over 1,024 rows\n"))  # within the factor
    # negative control: plain nbval (no utils/nbval_plugin.py) refuses the same residue
    assert not _passed(_nbval(tmp_path, source, "max error 6.1e-07 over 1,024 rows\n", plugin=False))
    beyond = 2.9e-07 * RESIDUE_FACTOR * 1.5
    assert not _passed(_nbval(tmp_path, source, f"max error {beyond:.1e} over 1,024 rows\n"))
    assert not _passed(_nbval(tmp_path, source, "max error 2.9e-07 over 1,025 rows\n"))


def test_every_notebook_names_the_kernel_make_setup_installs() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^KERNEL_NAME := {re.escape(KERNEL_NAME)}$", makefile, re.MULTILINE)
    assert re.search(rf"^KERNEL_DISPLAY := {re.escape(KERNEL_DISPLAY_NAME)}$", makefile, re.MULTILINE)
    for path in chapter_notebooks(REPO / "chapters"):
        spec = nbformat.read(path, as_version=4).metadata.get("kernelspec", {})
        assert (spec.get("name"), spec.get("display_name")) == (KERNEL_NAME, KERNEL_DISPLAY_NAME), path.name
