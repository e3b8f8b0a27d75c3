"""Every chapter notebook, run in solution mode, solves every check and prints what is committed.

The committed outputs are a learner-mode run (``make notebooks``; ``test_notebooks_learner.py``
reads them, ``make test``'s nbval re-runs learner mode against them). This test runs each
notebook in solution mode (stubs replaced by the solutions in ``solutions/``), in a fresh kernel
whatever the test run's own ``KERNEL_LADDER_SOLUTIONS``, and asserts that it runs to the end,
that every check says ✅ SOLVED — the same checks as committed — and that every other output
matches the committed one, compared as nbval compares (``utils.notebooks.output_differences``).
The runner's negative controls are in ``test_notebooks_runner.py``.
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
def test_notebook_in_solution_mode_solves_every_check_and_matches_the_committed_outputs(path: Path) -> None:
    problems = solution_mode_problems(path, timeout=600)
    if problems:
        pytest.fail(f"{path.name} in solution mode:\n" + "\n".join(problems), pytrace=False)
