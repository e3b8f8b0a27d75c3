"""Every chapter notebook in solution mode, against its committed outputs.

The committed outputs are a learner-mode run (``make notebooks``); nbval checks that learner mode
still prints exactly them (``make test`` runs ``pytest --nbval -p utils.nbval_plugin chapters``, set up by
``utils/nbval_plugin.py``). What nbval cannot do is run here: each notebook in solution mode (stubs
replaced by the solutions in ``solutions/``), whatever this run's own ``KERNEL_LADDER_SOLUTIONS``
(``utils.notebooks.solution_mode_problems``): it must run to the end, every check must say
✅ SOLVED — the same checks as committed — and every other output must match the committed one.

``test_notebooks_learner.py`` reads the committed files; the runner's negative controls are in
``test_notebooks_runner.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from utils.notebooks import chapter_notebooks, solution_mode_problems

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
def test_notebook_in_solution_mode_solves_every_check_and_matches_the_rest(path: Path) -> None:
    problems = solution_mode_problems(path, timeout=600)
    if problems:
        pytest.fail(f"{path.name}:\n" + "\n".join(problems), pytrace=False)
