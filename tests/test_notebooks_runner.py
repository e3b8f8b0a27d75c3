"""The notebook runner (utils.notebooks) on small notebooks made here.

``execute`` must save the learner-mode run only when solution mode solves every check, learner
mode solves none, and nothing else differs between the two; ``notebook_problems`` (what
``test_notebooks.py`` asserts empty for every chapter) must find a solution that does not solve,
a cell that depends on the learner's code, and committed outputs that a learner-mode run no
longer prints. Each notebook here runs in a fresh
kernel (a few seconds each).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import nbformat
import pytest

from utils.notebooks import (
    KERNEL_NAME,
    RESIDUE_FACTOR,
    chapter_notebooks,
    error_outputs,
    main,
    normalize,
    notebook_problems,
    output_differences,
    run_notebook,
    solution_mode_problems,
    verdict_lines,
)

REPO = Path(__file__).resolve().parent.parent


def _notebook(*cells: tuple[str, list[str]]) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["language_info"] = {"name": "python", "version": "3.0.0"}  # noise to be removed
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["tags"] = tags
        cell.metadata["execution"] = {"iopub.status.busy": "a run's timestamp"}
        notebook.cells.append(cell)
    return notebook


def _write(folder: Path, name: str, *cells: tuple[str, list[str]]) -> Path:
    path = folder / name / f"{name}.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(_notebook(*cells), path)
    return path


# A chapter in miniature: the mode in an ignored first cell, an exercise (its stub returns 0, its
# solution 42), its check, a check on drawn random inputs, a lesson cell, an error shown on purpose.
HEADER = ("import os\nfrom utils.exercises import check, solution_mode\n"
          "print('solution mode:', solution_mode(), 'in', os.getcwd())", ["nbval-ignore-output"])
EXERCISE = ("def answer():  # the stub in learner mode, the solution in solution mode\n"
            "    return 42 if solution_mode() else 0", [])
CHECK = ("check('demo.answer', answer, lambda: 42, [()])", [])
DRAWN = ("import torch\n"
         "check('demo.double', lambda x: x * (2 if solution_mode() else 0), lambda x: 2 * x,\n"
         "      lambda gen: [(torch.randn(3, generator=gen),)])", [])
LESSON = ("import sys\nfor part in ('a', 'b'):\n    print(part, flush=True)\n    sys.stdout.flush()", [])
SHOWN_ERROR = ("raise ValueError('shown on purpose')", ["raises-exception"])
GOOD = (HEADER, EXERCISE, CHECK, DRAWN, LESSON, SHOWN_ERROR)

# Negative controls. A solution that does not solve its exercise:
WRONG_SOLUTION = ("def answer():\n    return 41 if solution_mode() else 0", [])
UNSOLVED = (HEADER, WRONG_SOLUTION, CHECK, LESSON)
# A lesson cell after the exercise that uses the learner's code (its output follows the mode):
USES_THE_LEARNERS_CODE = ("print('twice the answer:', 2 * answer())", [])
DEPENDENT = (HEADER, EXERCISE, CHECK, USES_THE_LEARNERS_CODE, LESSON)
# Both at once, for the solution-mode test (which reports every problem of one run):
BOTH = (HEADER, WRONG_SOLUTION, CHECK, USES_THE_LEARNERS_CODE, LESSON)


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
    """``execute`` over four notebooks (good, unsolved, dependent, broken), once for the module."""
    folder = tmp_path_factory.mktemp("chapters")
    paths = {
        "good": _write(folder, "01_good", *GOOD),
        "unsolved": _write(folder, "02_unsolved", *UNSOLVED),
        "dependent": _write(folder, "03_dependent", *DEPENDENT),
        "broken": _write(folder, "04_broken", ("print('before')", []), ("1 / 0", [])),
    }
    before = {name: path.read_text() for name, path in paths.items()}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = main(["execute", str(folder)])
    return {"folder": folder, "paths": paths, "before": before, "returned": returned, "printed": printed.getvalue()}


@pytest.mark.slow
def test_execute_saves_the_learner_mode_run(executed) -> None:
    path = executed["paths"]["good"]
    assert f"[1/4] {path}: saved the learner-mode run, 6 cells, 2 checks" in executed["printed"]
    saved = nbformat.read(path, as_version=4)
    assert [cell.execution_count for cell in saved.cells] == [1, 2, 3, 4, 5, 6]  # one kernel, top to bottom
    assert saved.cells[0].outputs[0]["text"] == f"solution mode: False in {path.parent}\n"  # cwd: its folder
    verdicts = verdict_lines(saved)
    assert verdicts == ["❌ NOT SOLVED — demo.answer", "❌ NOT SOLVED — demo.double"]
    # The drawn inputs come from KERNEL_LADDER_CHECK_SEED, so the committed verdict is reproducible.
    assert "(random inputs; check(..., seed=" in saved.cells[3].outputs[0]["text"]
    assert saved.cells[4].outputs == [nbformat.v4.new_output("stream", name="stdout", text="a\nb\n")]
    assert error_outputs(saved) == [] and error_outputs(saved, include_tagged=True) == [
        "cell 5: ValueError: shown on purpose"
    ]
    assert "version" not in saved.metadata["language_info"]
    assert saved.metadata["kernelspec"]["name"] == KERNEL_NAME
    assert all(set(cell.metadata) == {"tags"} for cell in saved.cells)


@pytest.mark.slow
def test_execute_refuses_a_solution_that_does_not_solve(executed) -> None:
    path = executed["paths"]["unsolved"]
    printed = executed["printed"]
    assert f"[2/4] {path}: FAILED, not saved:" in printed
    assert "1 of 1 checks do not say ✅ SOLVED in solution mode:" in printed
    assert "      ❌ NOT SOLVED — demo.answer" in printed
    assert path.read_text() == executed["before"]["unsolved"]


@pytest.mark.slow
def test_execute_refuses_a_later_cell_that_depends_on_the_learners_code(executed) -> None:
    path = executed["paths"]["dependent"]
    printed = executed["printed"]
    assert f"[3/4] {path}: FAILED, not saved:" in printed
    assert (
        "cell 3 (\"print('twice the answer:', 2 * answer())\"): stdout: line 1: "
        "expected 'twice the answer: 84', got 'twice the answer: 0' — in solution and learner mode: "
        "a cell after an exercise depends on the learner's code"
    ) in printed
    assert "cell 4" not in printed  # the lesson cell after it is the same in both modes
    assert path.read_text() == executed["before"]["dependent"]


@pytest.mark.slow
def test_execute_refuses_a_notebook_that_stops(executed) -> None:
    path = executed["paths"]["broken"]
    assert f"[4/4] {path}: FAILED, not saved:\n    stopped in solution mode:" in executed["printed"]
    assert "ZeroDivisionError" in executed["printed"]
    assert path.read_text() == executed["before"]["broken"]
    assert executed["returned"] == 1 and executed["printed"].endswith("1 of 4 notebooks executed and saved cleanly\n")


def test_execute_with_nothing_to_run_fails(tmp_path: Path) -> None:
    assert main(["execute", str(tmp_path / "nothing here")]) == 1


# ----------------------------------------------------------------------------------------------
# The solution-mode test and its negative controls


def _commit_learner_run(folder: Path, name: str, cells) -> Path:
    """A notebook whose committed outputs are its learner-mode run (as execute would save it)."""
    path = _write(folder, name, *cells)
    nbformat.write(normalize(run_notebook(path, solutions=False)), path)
    return path


@pytest.mark.slow
def test_solution_mode_problems_is_empty_for_a_good_notebook(executed) -> None:
    assert solution_mode_problems(executed["paths"]["good"]) == []


@pytest.mark.slow
def test_solution_mode_problems_finds_an_unsolved_check_and_a_cell_that_depends_on_the_learner(tmp_path) -> None:
    problems = solution_mode_problems(_commit_learner_run(tmp_path, "02_both", BOTH))
    assert problems == [
        "1 of 1 checks do not say ✅ SOLVED in solution mode:",
        "  ❌ NOT SOLVED — demo.answer",
        "solution mode differs from the committed outputs in cell 3 (\"print('twice the answer:', 2 * answer())\"): "
        "stdout: line 1: expected 'twice the answer: 0', got 'twice the answer: 82'",
    ]


# ----------------------------------------------------------------------------------------------
# Comparing two runs, without a kernel


def _outputs(*outputs: nbformat.NotebookNode, tags: tuple[str, ...] = (), source: str = "f()") -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.metadata["tags"] = list(tags)
    cell.outputs = list(outputs)
    notebook.cells.append(cell)
    return notebook


def _stdout(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("stream", name="stdout", text=text)


SOLVED_BLOCK = "✅ SOLVED — demo.answer: the case matches the reference\n"
NOT_SOLVED_BLOCK = ("❌ NOT SOLVED — demo.answer\n   case 1 of 1: no arguments\n"
                    "   • wrong value: got 0, expected 42\n")


def test_output_differences_counts_a_verdict_by_its_name_only() -> None:
    solved = _outputs(_stdout("before\n" + SOLVED_BLOCK + "after\n"))
    learner = _outputs(_stdout("before\n"), _stdout(NOT_SOLVED_BLOCK + "after\n"))  # split chunks merge
    assert output_differences(solved, learner) == []
    assert output_differences(solved, learner, strip_verdicts=False) != []
    other_check = _outputs(_stdout("before\n" + NOT_SOLVED_BLOCK.replace("demo.answer", "demo.other") + "after\n"))
    assert output_differences(solved, other_check) == ["cell 0 ('f()'): stdout: line 2: expected "
                                                       "'<verdict demo.answer>', got '<verdict demo.other>'"]
    changed_after = _outputs(_stdout("before\n" + NOT_SOLVED_BLOCK + "after, changed\n"))
    assert output_differences(solved, changed_after) == [
        "cell 0 ('f()'): stdout: line 3: expected 'after', got 'after, changed'"
    ]


def test_a_verdict_whose_first_line_wraps_is_counted_whole() -> None:
    # A long first line is wrapped by utils.exercises.verdict._wrapped, its continuation indented by two spaces
    # (the lines under it by three): the whole block is the verdict, not only its first line.
    from utils.exercises.verdict import SOLVED_MARK, _wrapped

    first = f"{SOLVED_MARK} — demo.answer: " + "all eight cases match the float64 reference " * 3
    wrapped = "\n".join(_wrapped([first, "   measured: 1.2 instructions per element"])) + "\n"
    assert "\n  all" in wrapped or "\n  " in wrapped  # the case this test is about: a wrapped first line
    solved = _outputs(_stdout("before\n" + wrapped + "after\n"))
    learner = _outputs(_stdout("before\n" + NOT_SOLVED_BLOCK + "after\n"))
    assert output_differences(solved, learner) == []
    changed_after = _outputs(_stdout("before\n" + NOT_SOLVED_BLOCK + "after, changed\n"))
    assert output_differences(solved, changed_after) != []  # what follows the block is still compared


def test_output_differences_skips_what_nbval_skips() -> None:
    figure = {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure size 640x480 with 1 Axes>"}
    other_figure = {"image/png": "AAAAAAAA", "text/plain": "<Figure size 640x480 with 1 Axes>"}
    assert output_differences(_outputs(nbformat.v4.new_output("display_data", data=figure)),
                              _outputs(nbformat.v4.new_output("display_data", data=other_figure))) == []
    ignored = _outputs(_stdout("12.3 ms\n"), tags=("nbval-ignore-output",))
    assert output_differences(ignored, _outputs(_stdout("9.9 ms\n"), tags=("nbval-ignore-output",))) == []
    assert output_differences(_outputs(_stdout("50%\r100%\n")), _outputs(_stdout("100%\n"))) == []
    error = nbformat.v4.new_output("error", ename="ValueError", evalue="shown", traceback=["a run's frames"])
    same_error = nbformat.v4.new_output("error", ename="ValueError", evalue="shown", traceback=["other frames"])
    assert output_differences(_outputs(error), _outputs(same_error)) == []
    assert output_differences(_outputs(_stdout("x\n")), _outputs()) == ["cell 0 ('f()'): output kinds ['stdout'] vs []"]


def test_output_differences_lets_rounding_residues_move_within_a_factor() -> None:
    """An fp32 error printed as 2.9e-07 on one CPU may be 6.5e-07 on another (numpy's BLAS picks its
    kernels by processor): such residues may differ up to RESIDUE_FACTOR; nothing else may."""
    def differ(a: str, b: str) -> list[str]:
        return output_differences(_outputs(_stdout(a)), _outputs(_stdout(b)))

    assert differ("max |error| 2.9e-07, 4,096 bytes\n", "max |error| 6.5e-07, 4,096 bytes\n") == []
    assert differ("err 1.0e-06\n", "err 9.5e-07\n") == []
    # negative controls: beyond the factor, a changed count beside a residue, a larger number, a zero
    assert differ("err 2.9e-07\n", f"err {2.9e-07 * RESIDUE_FACTOR * 1.5:.1e}\n") != []
    assert differ("err 2.9e-07, 4,096 bytes\n", "err 2.9e-07, 4,097 bytes\n") == [
        "cell 0 ('f()'): stdout: line 1: expected 'err 2.9e-07, 4,096 bytes', got 'err 2.9e-07, 4,097 bytes'"]
    assert differ("loss 3.1e-02\n", "loss 3.0e-02\n") != []  # not a residue (>= 1e-3): exact
    assert differ("err 0.0e+00\n", "err 1.0e-07\n") != []
    assert differ("a 1.0e-06 b 2.0e-06\n", "a 1.0e-06\n") != []


# ----------------------------------------------------------------------------------------------
# Finding notebooks


def test_chapter_notebooks_lists_chapter_folders_only(tmp_path: Path) -> None:
    for relative in ("00_a/00_a.ipynb", "01_b/01_b.ipynb", "01_b/.ipynb_checkpoints/01_b.ipynb", "top.ipynb"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("{}")
    assert chapter_notebooks(tmp_path) == [tmp_path / "00_a/00_a.ipynb", tmp_path / "01_b/01_b.ipynb"]


@pytest.mark.slow
def test_notebook_problems_is_empty_for_a_good_notebook(executed) -> None:
    assert notebook_problems(executed["paths"]["good"]) == []


@pytest.mark.slow
def test_notebook_problems_finds_stale_committed_outputs_and_a_changed_verdict(tmp_path) -> None:
    path = _commit_learner_run(tmp_path, "05_stale", GOOD)
    notebook = nbformat.read(path, as_version=4)
    lesson = next(i for i, cell in enumerate(notebook.cells) if cell.source == LESSON[0])
    notebook.cells[lesson].outputs[0]["text"] = "a\nc\n"  # committed before the lesson changed
    check = next(i for i, cell in enumerate(notebook.cells) if cell.source == CHECK[0])
    assert notebook.cells[check].outputs[0]["text"].startswith("❌ NOT SOLVED — demo.answer")
    nbformat.write(notebook, path)
    problems = notebook_problems(path)
    assert problems == [
        "solution mode differs from the committed outputs in cell 4 ('import sys'): stdout: line 2: "
        "expected 'c', got 'b'",
        "learner mode differs from the committed outputs in cell 4 ('import sys'): stdout: line 2: "
        "expected 'c', got 'b' (refresh them: make notebooks)",
    ]
    # A learner-mode verdict that differs from the committed one (another seed, another diagnosis):
    notebook.cells[lesson].outputs[0]["text"] = "a\nb\n"
    notebook.cells[check].outputs[0]["text"] = notebook.cells[check].outputs[0]["text"].replace("got 0", "got 1")
    nbformat.write(notebook, path)
    (problem,) = notebook_problems(path)
    assert problem.startswith("learner mode differs from the committed outputs in cell 2 (\"check('demo.answer'")


def test_make_test_runs_the_tests_in_two_processes_with_the_notebooks_among_them() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ntest: setup\n", 1)[1].split("\n\n", 1)[0]
    assert "-m pytest tests" in recipe and "-n $(TEST_WORKERS)" in recipe and "TEST_WORKERS ?= 2" in makefile
    assert (REPO / "tests" / "test_notebooks.py").exists()


@pytest.mark.slow
def test_a_cell_tagged_nbval_skip_is_not_run(tmp_path: Path) -> None:
    path = _write(tmp_path, "06_skip", ("print('runs')", []), ("1 / 0", ["nbval-skip"]), ("print('after')", []))
    notebook = run_notebook(path, solutions=False)
    assert [cell.get("outputs", []) == [] for cell in notebook.cells] == [False, True, False]


def test_cell_times_and_the_slow_cells_without_a_progress_line() -> None:
    from utils.notebooks import SLOW_CELL_S, _slow_cells_without_progress, cell_times

    loop = "for s in progress(steps, 'tracing', expected='8 s'): pass"
    notebook = _notebook(("x = 1", []), ("train()", []), (loop, []))
    stamps = [("10:00:00.000", "10:00:00.500"), ("10:00:01.000", "10:00:09.250"), ("10:00:10.000", "10:00:30.000")]
    for cell, (start, end) in zip(notebook.cells, stamps):
        cell.metadata["execution"] = {"iopub.execute_input": f"2025-01-01T{start}Z",
                                      "shell.execute_reply": f"2025-01-01T{end}Z"}
    notebook.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                        text="⏳ tracing: 4 steps — expected: 8 s\n")]
    times = [(index, round(seconds, 2)) for index, seconds, _ in cell_times(notebook)]
    assert times == [(3, 20.0), (2, 8.25), (1, 0.5)]
    assert cell_times(notebook)[1][2] == "train()"
    assert 0.5 < SLOW_CELL_S < 8.25
    assert _slow_cells_without_progress(notebook, "learner") == [
        "cell 2 took 8.2 s in learner mode without a progress line (utils.progress): train()"]
