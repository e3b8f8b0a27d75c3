"""The committed chapter notebooks are what a learner sees on first open: no exercise shown solved.

Their outputs are a learner-mode run (``make notebooks`` saves it, ``utils.notebooks``): every
check's verdict is ``❌ NOT SOLVED`` and the first cell says ``solution mode: False``.
nbval (``pytest --nbval -p utils.nbval_plugin chapters``, in ``make test``) proves that learner mode still
prints exactly these outputs, and ``test_notebooks.py`` that solution mode solves every check and prints
everything else the same. These tests only read the files.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from utils.notebooks import chapter_notebooks, error_outputs, verdict_lines

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = chapter_notebooks(REPO / "chapters")

if NOTEBOOKS:
    PARAMS = [pytest.param(path, id=path.stem) for path in NOTEBOOKS]
else:
    PARAMS = [
        pytest.param(None, id="none", marks=pytest.mark.skip(reason="no chapter notebooks yet (chapters/*/*.ipynb)"))
    ]


def _all_text(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts += [value for value in output.get("data", {}).values() if isinstance(value, str)]
    return "\n".join(parts)


@pytest.mark.parametrize("path", PARAMS)
def test_committed_outputs_show_every_exercise_unsolved(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), f"{path.name}: not a full run (make notebooks)"
    verdicts = verdict_lines(notebook)
    assert verdicts, f"{path.name} shows no check verdict (expected at least one ❌ NOT SOLVED line)"
    solved = [line for line in verdicts if not line.startswith("❌ NOT SOLVED — ")]
    assert solved == [], f"{path.name}: committed outputs must be a learner's first open (make notebooks)"
    text = _all_text(notebook)
    assert "solution mode: True" not in text  # chapter 00 prints the mode in its first cell
    assert error_outputs(notebook) == [], "error output in a cell not tagged raises-exception"
