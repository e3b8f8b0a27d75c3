"""Every chapter notebook, run as a learner gets it (stubs unsolved), runs to the end and says NOT SOLVED.

This proves two things the solution-mode run (nbval) cannot: the checker catches every stub as
committed, and a notebook whose exercises are not done still runs top to bottom (later cells use
``kernels`` or the solutions, never the learner's code). Each notebook runs in a fresh kernel
with ``KERNEL_LADDER_SOLUTIONS=0`` whatever the test run's own setting.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from utils.notebooks import chapter_notebooks, error_outputs, main, run_notebook, verdict_lines

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = chapter_notebooks(REPO / "chapters")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

if NOTEBOOKS:
    PARAMS = [pytest.param(path, id=path.stem) for path in NOTEBOOKS]
else:
    PARAMS = [
        pytest.param(None, id="none", marks=pytest.mark.skip(reason="no chapter notebooks yet (chapters/*/*.ipynb)"))
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", PARAMS)
def test_notebook_runs_to_the_end_in_learner_mode_and_every_check_says_not_solved(path: Path) -> None:
    try:
        notebook = run_notebook(path, solutions=False, timeout=600)
    except CellExecutionError as error:
        stopped = _ANSI.sub("", str(error))[-4000:]
    else:
        stopped = None
    if stopped is not None:
        pytest.fail(f"{path.name} stopped in learner mode:\n{stopped}", pytrace=False)

    assert error_outputs(notebook) == [], "error output in a cell not tagged raises-exception"
    verdicts = verdict_lines(notebook)
    assert verdicts, f"{path.name} printed no check verdict (expected at least one ✅/❌ line)"
    not_refused = [line for line in verdicts if not line.startswith("❌ NOT SOLVED — ")]
    assert not_refused == [], f"{path.name}: stubs as committed must not pass their checks"


# ----------------------------------------------------------------------------------------------
# The runner itself, on small notebooks made here


def _notebook(*cells: tuple[str, list[str]]) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["language_info"] = {"name": "python", "version": "3.0.0"}  # noise to be removed
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["tags"] = tags
        cell.metadata["execution"] = {"iopub.status.busy": "a run's timestamp"}
        notebook.cells.append(cell)
    return notebook


CHECKING_CELLS = (
    ("import os\nfrom utils.exercises import check, solution_mode\nprint(solution_mode(), os.getcwd())", []),
    ("import sys\nfor part in ('a', 'b'):\n    print(part, flush=True)\n    sys.stdout.flush()", []),
    ("check('demo.answer', lambda: 42 if solution_mode() else 0, lambda: 42, [()])", []),
    ("raise ValueError('shown on purpose')", ["raises-exception"]),
)


@pytest.mark.slow
def test_run_notebook_modes_cwd_and_tagged_errors(tmp_path: Path) -> None:
    folder = tmp_path / "99_demo"
    folder.mkdir()
    path = folder / "99_demo.ipynb"
    nbformat.write(_notebook(*CHECKING_CELLS), path)

    learner = run_notebook(path, solutions=False)
    assert learner.cells[0].outputs[0]["text"] == f"False {folder}\n"  # learner mode, cwd = the folder
    assert verdict_lines(learner) == ["❌ NOT SOLVED — demo.answer"]
    assert error_outputs(learner) == []  # the error is in a raises-exception cell
    assert error_outputs(learner, include_tagged=True) == ["cell 3: ValueError: shown on purpose"]
    assert nbformat.read(path, as_version=4).cells[0].outputs == []  # the file is not changed


@pytest.mark.slow
def test_execute_saves_solution_mode_outputs_and_refuses_failures(tmp_path: Path, capsys) -> None:
    good = tmp_path / "98_good" / "98_good.ipynb"
    broken = tmp_path / "99_broken" / "99_broken.ipynb"
    for path in (good, broken):
        path.parent.mkdir()
    nbformat.write(_notebook(*CHECKING_CELLS), good)
    nbformat.write(_notebook(("print('before')", []), ("1 / 0", [])), broken)
    broken_before = broken.read_text()

    assert main(["execute", str(tmp_path)]) == 1  # one notebook failed
    printed = capsys.readouterr().out
    assert f"[1/2] {good}: saved, 4 cells, 1 checks solved" in printed
    assert f"[2/2] {broken}: FAILED, not saved: CellExecutionError" in printed
    assert "1 of 2 notebooks executed and saved cleanly" in printed
    assert broken.read_text() == broken_before

    saved = nbformat.read(good, as_version=4)
    assert [cell.execution_count for cell in saved.cells] == [1, 2, 3, 4]  # one kernel, top to bottom
    assert verdict_lines(saved) == ["✅ SOLVED — demo.answer: the case matches the reference"]
    assert saved.cells[1].outputs == [nbformat.v4.new_output("stream", name="stdout", text="a\nb\n")]
    assert "version" not in saved.metadata["language_info"]
    assert saved.metadata["kernelspec"]["name"] == "python3"
    assert all(set(cell.metadata) == {"tags"} for cell in saved.cells)


def test_chapter_notebooks_lists_chapter_folders_only(tmp_path: Path) -> None:
    for relative in ("00_a/00_a.ipynb", "01_b/01_b.ipynb", "01_b/.ipynb_checkpoints/01_b.ipynb", "top.ipynb"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("{}")
    assert chapter_notebooks(tmp_path) == [tmp_path / "00_a/00_a.ipynb", tmp_path / "01_b/01_b.ipynb"]
