"""Every chapter notebook, in both modes, against its committed outputs.

The committed outputs are a learner-mode run (``make notebooks``). For each notebook,
``utils.notebooks.notebook_problems`` runs it twice at once, in two fresh kernels:

* in solution mode (stubs replaced by the solutions in ``solutions/``), whatever this run's own
  ``KERNEL_LADDER_SOLUTIONS``: it must run to the end, every check must say ✅ SOLVED — the same
  checks as committed — and every other output must match the committed one;
* in learner mode (the stubs as written, ``KERNEL_LADDER_CHECK_SEED`` as the outputs were made
  with): it must run to the end and print exactly what is committed, verdicts included — the
  comparison nbval makes (the same tags honoured), so the checks are shown to catch the stubs
  and an unsolved notebook to run through.

``test_notebooks_learner.py`` reads the committed files; the runner's negative controls are in
``test_notebooks_runner.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.notebooks import chapter_notebooks, notebook_problems

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = chapter_notebooks(REPO / "chapters")

if NOTEBOOKS:
    PARAMS = [pytest.param(path, id=path.stem) for path in NOTEBOOKS]
else:
    PARAMS = [
        pytest.param(None, id="none", marks=pytest.mark.skip(reason="no chapter notebooks yet (chapters/*/*.ipynb)"))
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", PARAMS)
def test_notebook_in_both_modes_matches_the_committed_outputs(path: Path) -> None:
    problems = notebook_problems(path, timeout=600)
    if problems:
        pytest.fail(f"{path.name}:\n" + "\n".join(problems), pytrace=False)
