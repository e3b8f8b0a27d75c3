"""Running the chapter notebooks: committing what a learner first sees, proving solution mode.

The committed outputs of a chapter notebook are what a learner sees on first open: the lesson's
plots, tables and traces, and every check's verdict as the learner gets it (``❌ NOT SOLVED``,
``solution mode: False``). ``python -m utils.notebooks execute chapters`` (what ``make notebooks``
runs) produces them. For each ``chapters/*/*.ipynb`` it runs the notebook twice, top to bottom,
at the same time, each run in its own fresh ``python3`` kernel whose working directory is the
notebook's folder:

1. in solution mode (``KERNEL_LADDER_SOLUTIONS=1``): it must finish and every check must say
   ``✅ SOLVED``;
2. in learner mode (``KERNEL_LADDER_SOLUTIONS=0``, the stubs as written): it must finish and
   every check must say ``❌ NOT SOLVED``, the same checks in the same order;
3. every other output must be the same in both runs, compared as nbval compares them
   (:func:`output_differences`), except that a rounding residue (a number in e-notation below
   1e-3, an fp32 kernel's error say) may differ by up to :data:`RESIDUE_FACTOR` — its digits
   depend on the CPU the run had. A difference means that a later cell depends on the learner's
   code (it should use ``kernel_ladder`` or the solutions): the notebook is refused and the cell named.

Only then is the learner-mode run saved (execution counts 1..n, a run's metadata noise
removed). ``make test`` proves both modes against the committed outputs through
:func:`notebook_problems` (``tests/test_notebooks.py``): solution mode solves every check and
prints everything else as committed; learner mode prints exactly what is committed, verdicts
included — the comparison nbval makes, honouring the same cell tags, with both runs at once.

A NOT SOLVED verdict describes the random inputs it failed on (and prints their seed), so a
learner-mode run sets ``KERNEL_LADDER_CHECK_SEED`` (:data:`LEARNER_CHECK_SEED`): each check then
draws its inputs from a seed derived from that value and its name, and prints the same verdict
on every run. A learner's own runs leave it unset and get fresh inputs.

:func:`run_notebook` runs one notebook in either mode and returns it, for tests;
:func:`verdict_lines` and :func:`error_outputs` read what a run printed.

A cell that takes more than :data:`SLOW_CELL_S` must say so while it runs (``utils.progress``: a
progress line and its expected time). ``execute`` names the slow cells of each run that print no
such line, and ``python -m utils.notebooks slowest PATH`` runs a notebook and lists its slowest
cells (:func:`cell_times`, from the timings nbclient records).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat import NotebookNode

__all__ = [
    "SLOW_CELL_S",
    "cell_times",
    "KERNEL_DISPLAY_NAME",
    "KERNEL_NAME",
    "LEARNER_CHECK_SEED",
    "chapter_notebooks",
    "error_outputs",
    "execute_notebooks",
    "kernel_env",
    "main",
    "normalize",
    "notebook_problems",
    "output_differences",
    "RESIDUE_FACTOR",
    "run_notebook",
    "same_text",
    "solution_mode_problems",
    "verdict_lines",
]

#: The kernel every chapter notebook names and runs in: ``make setup`` installs it into the environment
#: under this name and display name, so that JupyterLab opens a notebook without changing its metadata.
KERNEL_NAME = "kernel-ladder"
KERNEL_DISPLAY_NAME = "Python 3 (kernel-ladder)"
#: Seconds one cell may take before the run is abandoned (notebooks are meant to take < 60 s in all).
CELL_TIMEOUT_S = 600
#: A cell that runs longer than this (seconds, on a 2-core CPU) prints a progress line and its expected time.
SLOW_CELL_S = 5.0
#: What utils.progress prints before a slow step (``progress`` and ``announce`` both).
_PROGRESS_MARK = "— expected: "
#: ``KERNEL_LADDER_CHECK_SEED`` in learner-mode runs (``make notebooks``, ``make test``):
#: the NOT SOLVED verdicts committed are then the ones every such run prints.
LEARNER_CHECK_SEED = "0"

# As utils.exercises.SOLUTIONS_ENV and CHECK_SEED_ENV (not imported: keeps this module light).
_SOLUTIONS_ENV = "KERNEL_LADDER_SOLUTIONS"
_CHECK_SEED_ENV = "KERNEL_LADDER_CHECK_SEED"
_SOLVED, _NOT_SOLVED = "✅ SOLVED", "❌ NOT SOLVED"
_VERDICT_MARKS = (_SOLVED, _NOT_SOLVED)
# A verdict block: its first line, then the lines indented under it — the first line's own continuations
# (utils.exercises.verdict wraps a long line with two spaces) and the lines a check indents (three).
_VERDICT_BLOCK = re.compile(r"^(?:✅ SOLVED|❌ NOT SOLVED) — ([^\s:]+)[^\n]*\n?(?:  [^\n]*(?:\n|$))*", re.MULTILINE)
# nbval neither runs nor compares cells so tagged; nor do we.
_NOT_COMPARED_TAGS = ("nbval-ignore-output", "nbval-skip")
# nbval's default skips: what a run may change without the lesson changing.
_SKIPPED_KEYS = frozenset(
    ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count")
    + ("application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")
)

# Cell metadata a run or an editor adds that says nothing about the lesson.
_NOISY_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled", "vscode")
_LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}
_KERNELSPEC = {"display_name": KERNEL_DISPLAY_NAME, "language": "python", "name": KERNEL_NAME}


def chapter_notebooks(root: str | os.PathLike = "chapters") -> list[Path]:
    """Every ``<root>/*/*.ipynb`` in order (checkpoints excluded); ``root`` may also be one notebook."""
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(p for p in root.glob("*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def kernel_env(solutions: bool) -> dict[str, str]:
    """The environment a notebook's kernel runs with, in solution or in learner mode (what nbval's run uses too)."""
    env = dict(os.environ)
    env[_SOLUTIONS_ENV] = "1" if solutions else "0"
    if not solutions:  # reproducible NOT SOLVED verdicts (solution mode keeps fresh inputs)
        env[_CHECK_SEED_ENV] = LEARNER_CHECK_SEED
    # Committed outputs are the interpreter's (its exact traffic counts are what the lessons
    # print), so notebooks are run and re-run there, on a GPU machine too.
    env.setdefault("KERNEL_LADDER_INTERPRET", "1")
    # The kernel must import this repository's utils/solutions/kernels from any working directory.
    repo_root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([repo_root, *paths])
    return env


def run_notebook(
    path: str | os.PathLike, solutions: bool, timeout: int = CELL_TIMEOUT_S, allow_errors: bool = False
) -> NotebookNode:
    """Execute the notebook at ``path`` top to bottom in a fresh ``python3`` kernel and return it.

    ``solutions=True`` runs it in solution mode (stubs replaced by their solutions),
    ``solutions=False`` in learner mode (stubs as written). The kernel's working directory is
    the notebook's folder; cells tagged ``nbval-skip`` are not run. A cell that raises stops the run with ``nbclient``'s
    ``CellExecutionError`` unless it is tagged ``raises-exception`` (or ``allow_errors``).
    The file on disk is not changed.
    """
    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name=KERNEL_NAME,
        allow_errors=allow_errors,
        skip_cells_with_tag="nbval-skip",  # as nbval: a cell so tagged is not run (nor compared)
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    client.execute(env=kernel_env(solutions))
    return notebook


def _cell_outputs_text(cell: NotebookNode) -> Iterable[str]:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            yield output.get("text", "")
        elif output.get("output_type") in ("execute_result", "display_data"):
            yield output.get("data", {}).get("text/plain", "")


def verdict_lines(notebook: NotebookNode) -> list[str]:
    """The first line of every check verdict the notebook printed (``✅ SOLVED — …`` / ``❌ NOT SOLVED — …``)."""
    lines = []
    for cell in notebook.cells:
        for text in _cell_outputs_text(cell):
            lines += [line for line in text.splitlines() if line.startswith(_VERDICT_MARKS)]
    return lines


def _verdict_name(line: str) -> str:
    """``'demo.answer'`` from ``'✅ SOLVED — demo.answer: …'`` or ``'❌ NOT SOLVED — demo.answer'``."""
    return line.split(" — ", 1)[-1].split(":", 1)[0].strip()


def error_outputs(notebook: NotebookNode, include_tagged: bool = False) -> list[str]:
    """``"cell N: Name: value"`` for every error output (cells tagged ``raises-exception`` skipped)."""
    errors = []
    for index, cell in enumerate(notebook.cells):
        if not include_tagged and "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                errors.append(f"cell {index}: {output.get('ename')}: {output.get('evalue')}")
    return errors


# ----------------------------------------------------------------------------------------------
# Comparing two runs as nbval does


def _without_verdicts(text: str) -> str:
    """``text`` with every verdict block replaced by ``<verdict NAME>`` (its name kept, its outcome not)."""
    return _VERDICT_BLOCK.sub(lambda m: f"<verdict {m.group(1)}>\n", text)


def _process_carriage_returns(text: str) -> str:
    # As nbval: a carriage return not followed by a newline discards the line so far (a progress bar).
    return re.sub(r"^.*\r(?=[^\n])", "", text, flags=re.MULTILINE)


def _comparable(cell: NotebookNode, strip_verdicts: bool) -> dict[str, list[object]]:
    """A cell's outputs the way nbval compares them: key (stream name, MIME type, ename, …) -> values.

    Streams of the same name are merged (how a print is split depends on flush timing), images
    and the run's bookkeeping are left out; with ``strip_verdicts`` every verdict block is reduced
    to the name of its check.
    """
    streams: dict[str, str] = {}
    compared: dict[str, list[object]] = defaultdict(list)
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            name = output.get("name", "stdout")
            streams[name] = streams.get(name, "") + output.get("text", "")
            continue
        for key, value in output.items():
            if key in _SKIPPED_KEYS:
                continue
            if key == "data":
                for mime, data in value.items():
                    if mime not in _SKIPPED_KEYS:
                        if isinstance(data, list):
                            data = "".join(data)
                        if strip_verdicts and mime == "text/plain" and isinstance(data, str):
                            data = _without_verdicts(data)
                        compared[mime].append(data)
            else:
                compared[key].append(value)
    for name, text in streams.items():
        text = _process_carriage_returns(text)
        if strip_verdicts:
            text = _without_verdicts(text)
        compared[name] = [text]
    return dict(compared)


#: A rounding residue a lesson prints: a number in e-notation below 1e-3 ("6.5e-07", "1.3e-06"), such as
#: the largest error of an fp32 kernel against a float64 reference. Its digits depend on the CPU (numpy's
#: BLAS picks its kernels, and so its summation order, by processor), so two runs agree when every such
#: number is within :data:`RESIDUE_FACTOR` of the other's and all the rest of the text is equal.
_RESIDUE = re.compile(r"(?<![\w.])(\d\.\d+)e-(0[4-9]|[1-9]\d)\b")
RESIDUE_FACTOR = 8.0


def same_text(a: str, b: str) -> bool:
    """Equal, or equal but for rounding residues within :data:`RESIDUE_FACTOR` of each other."""
    if a == b:
        return True
    left, right = _RESIDUE.split(a), _RESIDUE.split(b)
    if len(left) != len(right) or left[::3] != right[::3]:
        return False
    for i in range(1, len(left), 3):
        x, y = float(f"{left[i]}e-{left[i + 1]}"), float(f"{right[i]}e-{right[i + 1]}")
        if x != y and not (x > 0 and y > 0 and max(x, y) <= RESIDUE_FACTOR * min(x, y)):
            return False
    return True


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return same_text(a, b)
    return a == b


def _same_values(xs: list[object], ys: list[object]) -> bool:
    return len(xs) == len(ys) and all(map(_same_value, xs, ys))


def _same_outputs(a: dict[str, list[object]], b: dict[str, list[object]]) -> bool:
    return set(a) == set(b) and all(_same_values(a[k], b[k]) for k in a)


def _excerpt(text: str, at: int, width: int = 60) -> str:
    """``width`` characters of ``text`` around position ``at``, with … where it is cut."""
    start = max(0, min(at - width // 3, len(text) - width))
    piece = text[start : start + width]
    return ("…" if start > 0 else "") + piece + ("…" if start + width < len(text) else "")


def _first_difference(expected: object, got: object) -> str:
    """Where two compared values first differ: the line, and both versions around the first change."""
    if not (isinstance(expected, str) and isinstance(got, str)):
        return f"expected {_excerpt(str(expected), 0)!r}, got {_excerpt(str(got), 0)!r}"
    expected_lines, got_lines = expected.splitlines(), got.splitlines()
    for number, (left, right) in enumerate(zip(expected_lines, got_lines), start=1):
        if not same_text(left, right):
            at = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
            return f"line {number}: expected {_excerpt(left, at)!r}, got {_excerpt(right, at)!r}"
    if len(expected_lines) != len(got_lines):
        return f"expected {len(expected_lines)} lines, got {len(got_lines)}"
    return "the same lines, different line endings"


def _cell_label(index: int, cell: NotebookNode) -> str:
    first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
    return f"cell {index} ({first[:50]!r})"


def output_differences(
    expected: NotebookNode,
    got: NotebookNode,
    strip_verdicts: bool = True,
) -> list[str]:
    """One line per code cell whose outputs differ between two runs of the same notebook.

    Compared the way nbval compares a run with the committed outputs: cells tagged
    ``nbval-ignore-output`` or ``nbval-skip`` are left out, so are images and a run's
    bookkeeping (execution counts, metadata, tracebacks), and streams are merged per name. With
    ``strip_verdicts`` (the default) a check's verdict block counts only by its name, so a run
    in solution mode (✅) and one in learner mode (❌) compare equal where nothing else differs.
    Rounding residues (e-notation below 1e-3) match within :data:`RESIDUE_FACTOR` of each other.
    """
    if len(expected.cells) != len(got.cells):
        return [f"the notebooks have {len(expected.cells)} and {len(got.cells)} cells"]
    differences = []
    for index, (left, right) in enumerate(zip(expected.cells, got.cells)):
        if left.cell_type != "code":
            continue
        if left.source != right.source:
            differences.append(f"{_cell_label(index, left)}: the source differs")
            continue
        if any(tag in left.get("metadata", {}).get("tags", []) for tag in _NOT_COMPARED_TAGS):
            continue
        a, b = _comparable(left, strip_verdicts), _comparable(right, strip_verdicts)
        if _same_outputs(a, b):
            continue
        if set(a) != set(b):
            what = f"output kinds {sorted(a)} vs {sorted(b)}"
        else:
            key = next(k for k in a if not _same_values(a[k], b[k]))
            if len(a[key]) != len(b[key]):
                what = f"{key}: {len(a[key])} outputs vs {len(b[key])}"
            else:
                left_value, right_value = next((x, y) for x, y in zip(a[key], b[key]) if not _same_value(x, y))
                what = f"{key}: {_first_difference(left_value, right_value)}"
        differences.append(f"{_cell_label(index, left)}: {what}")
    return differences


# ----------------------------------------------------------------------------------------------
# The two modes


def _run(path: Path, solutions: bool, timeout: int) -> tuple[NotebookNode | None, list[str]]:
    """Run in one mode; return the notebook (None if it stopped) and its errors."""
    mode = "solution" if solutions else "learner"
    try:
        notebook = run_notebook(path, solutions=solutions, timeout=timeout)
    except CellExecutionError as error:
        stopped = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
        return None, [f"stopped in {mode} mode:", *(f"  {line}" for line in stopped[-15:])]
    errors = [f"{mode} mode: error output in {error}" for error in error_outputs(notebook)]
    return notebook, errors


def _verdict_problems(notebook: NotebookNode, solutions: bool) -> list[str]:
    """The verdicts that are not what the mode must print (all ✅ in solution mode, all ❌ in learner mode)."""
    wanted, mode = (_SOLVED, "solution") if solutions else (_NOT_SOLVED, "learner")
    verdicts = verdict_lines(notebook)
    wrong = [line for line in verdicts if not line.startswith(wanted + " — ")]
    if not wrong:
        return []
    return [f"{len(wrong)} of {len(verdicts)} checks do not say {wanted} in {mode} mode:",
            *(f"  {line}" for line in wrong)]


def _run_both(path: Path, timeout: int) -> tuple[tuple[NotebookNode | None, list[str]], ...]:
    """Run ``path`` in solution mode and in learner mode at once, each in its own kernel.

    The kernels are separate processes, so on two cores both runs take about the time of one.
    """
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="notebook-mode") as pool:
        solved = pool.submit(_run, path, True, timeout)
        learner = pool.submit(_run, path, False, timeout)
        return solved.result(), learner.result()


def _solution_run_problems(committed: NotebookNode, notebook: NotebookNode) -> list[str]:
    """A solution-mode run against the committed (learner-mode) outputs: all ✅, the same checks, the rest equal."""
    problems = _verdict_problems(notebook, solutions=True)
    committed_names = [_verdict_name(line) for line in verdict_lines(committed)]
    names = [_verdict_name(line) for line in verdict_lines(notebook)]
    if names != committed_names:
        problems.append(f"checks run in solution mode {names} are not the committed ones {committed_names}")
    problems += [
        f"solution mode differs from the committed outputs in {difference}"
        for difference in output_differences(committed, notebook)
    ]
    return problems


def _learner_run_problems(committed: NotebookNode, notebook: NotebookNode) -> list[str]:
    """A learner-mode run against the committed outputs: all ❌ and every output equal, verdicts included."""
    problems = _verdict_problems(notebook, solutions=False)
    problems += [
        f"learner mode differs from the committed outputs in {difference} (refresh them: make notebooks)"
        for difference in output_differences(committed, notebook, strip_verdicts=False)
    ]
    return problems


def solution_mode_problems(path: str | os.PathLike, timeout: int = CELL_TIMEOUT_S) -> list[str]:
    """What is wrong with the notebook at ``path`` when it runs in solution mode (empty if nothing).

    It must run to the end, every check must say ✅ SOLVED — the same checks, in the same order,
    as the committed (learner-mode) outputs show — and every other output must match the
    committed one (:func:`output_differences`): the test that the committed outputs, made in
    learner mode, are also what solution mode prints.
    """
    path = Path(path)
    committed = nbformat.read(path, as_version=4)
    notebook, problems = _run(path, solutions=True, timeout=timeout)
    if notebook is None:
        return problems
    return problems + _solution_run_problems(committed, notebook)


def notebook_problems(path: str | os.PathLike, timeout: int = CELL_TIMEOUT_S) -> list[str]:
    """What is wrong with the notebook at ``path`` in either mode (empty if nothing): ``make test``'s check.

    Both modes run at once, in two kernels. Solution mode as :func:`solution_mode_problems`
    requires; learner mode (with :data:`LEARNER_CHECK_SEED`) must run to the end, every check
    must say ❌ NOT SOLVED, and every output must be the committed one, verdicts included, the
    way nbval compares (``nbval-ignore-output`` and ``nbval-skip`` cells and images left out):
    the proof that the committed outputs are current and that an unsolved notebook runs through.
    """
    path = Path(path)
    committed = nbformat.read(path, as_version=4)
    (solved, solved_errors), (learner, learner_errors) = _run_both(path, timeout)
    problems = solved_errors + learner_errors
    if solved is not None:
        problems += _solution_run_problems(committed, solved)
    if learner is not None:
        problems += _learner_run_problems(committed, learner)
    return problems


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def cell_times(notebook: NotebookNode) -> list[tuple[int, float, str]]:
    """``(cell number, seconds, first source line)`` of every code cell a run executed, slowest first.

    The times are nbclient's own records (``cell.metadata.execution``: from the input's arrival to
    the kernel's reply), so they are those of the run that produced ``notebook``; cell numbers count
    every cell from 1, as :func:`output_differences` names them.
    """
    times = []
    for index, cell in enumerate(notebook.cells, start=1):
        stamps = cell.get("metadata", {}).get("execution", {})
        start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
        if cell.cell_type != "code" or not start or not end:
            continue
        first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
        times.append((index, _seconds(end) - _seconds(start), first[:70]))
    return sorted(times, key=lambda item: -item[1])


def _prints_progress(cell: NotebookNode) -> bool:
    return any(_PROGRESS_MARK in text for text in _cell_outputs_text(cell))


def _slow_cells_without_progress(notebook: NotebookNode, mode: str) -> list[str]:
    """A line per cell slower than :data:`SLOW_CELL_S` that printed no progress line (utils.progress)."""
    lines = []
    for index, seconds, first in cell_times(notebook):
        if seconds > SLOW_CELL_S and not _prints_progress(notebook.cells[index - 1]):
            lines.append(f"cell {index} took {seconds:.1f} s in {mode} mode without a progress line "
                         f"(utils.progress): {first}")
    return lines


def _learner_mode_notebook(path: Path, timeout: int) -> tuple[NotebookNode | None, list[str], str]:
    """Run ``path`` in both modes (at once); return the learner-mode run if it may be saved, the problems, time."""
    started = time.perf_counter()
    (solved, problems), (learner, learner_problems) = _run_both(path, timeout)
    if solved is None or learner is None:
        return None, problems + learner_problems, ""
    problems += _verdict_problems(solved, solutions=True) + learner_problems
    if problems:
        return None, problems, ""
    problems += _verdict_problems(learner, solutions=False)
    names = [_verdict_name(line) for line in verdict_lines(solved)]
    learner_names = [_verdict_name(line) for line in verdict_lines(learner)]
    if names != learner_names:
        problems.append(f"the checks differ between solution mode {names} and learner mode {learner_names}")
    problems += [
        f"{difference} — in solution and learner mode: a cell after an exercise depends on the learner's code "
        "(use kernels or the solutions there)"
        for difference in output_differences(solved, learner)
    ]
    notes = _slow_cells_without_progress(solved, "solution") + _slow_cells_without_progress(learner, "learner")
    seconds = f"{time.perf_counter() - started:.1f} s for both"
    return learner, problems, seconds + "".join(f"\n    slow: {note}" for note in notes)


def execute_notebooks(paths: Sequence[Path], timeout: int = CELL_TIMEOUT_S, stream=None) -> int:
    """Run ``paths`` in both modes and save the learner-mode outputs; print progress; return failures.

    A notebook is saved only if it runs to the end in both modes, every check says ✅ in
    solution mode and ❌ in learner mode, and every other output is the same in both; otherwise
    the file is left as it was and the reasons are printed.
    """
    stream = stream or sys.stdout
    failures = 0
    for number, path in enumerate(paths, start=1):
        prefix = f"[{number}/{len(paths)}] {path}"
        print(f"{prefix}: running in solution mode and in learner mode ...", file=stream, flush=True)
        try:
            notebook, problems, seconds = _learner_mode_notebook(Path(path), timeout)
        except Exception as error:  # a kernel that does not start, an unreadable file: go on with the others
            notebook, problems = None, [f"{type(error).__name__}: {error}"]
        if problems or notebook is None:
            failures += 1
            print(f"{prefix}: FAILED, not saved:", file=stream)
            for line in problems:
                print(f"    {line}", file=stream)
            continue
        nbformat.write(normalize(notebook), path)
        checks = len(verdict_lines(notebook))
        print(
            f"{prefix}: saved the learner-mode run, {len(notebook.cells)} cells, {checks} checks "
            f"(✅ in solution mode, ❌ in learner mode), {seconds}",
            file=stream,
            flush=True,
        )
    return failures


def normalize(notebook: NotebookNode) -> NotebookNode:
    """Remove a run's metadata noise (timings, Python version, widget state) in place, and return it."""
    metadata = notebook.metadata
    metadata["kernelspec"] = dict(_KERNELSPEC)
    metadata["language_info"] = dict(_LANGUAGE_INFO)
    for key in ("widgets", "toc", "varInspector", "vscode", "papermill"):
        metadata.pop(key, None)
    for cell in notebook.cells:
        for key in _NOISY_CELL_METADATA:
            cell.metadata.pop(key, None)
        if "outputs" in cell:
            cell.outputs = _coalesce_streams(cell.outputs)
            for output in cell.outputs:
                output.pop("transient", None)  # display ids differ from run to run
    return notebook


def _coalesce_streams(outputs: list[NotebookNode]) -> list[NotebookNode]:
    """Merge consecutive stdout (or stderr) chunks: how a print is split depends on flush timing."""
    merged: list[NotebookNode] = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (
            output.get("output_type") == "stream"
            and previous is not None
            and previous.get("output_type") == "stream"
            and previous.get("name") == output.get("name")
        ):
            previous["text"] = previous.get("text", "") + output.get("text", "")
        else:
            merged.append(output)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m utils.notebooks execute [PATH ...]`` (default ``chapters``)."""
    parser = argparse.ArgumentParser(prog="python -m utils.notebooks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    execute = commands.add_parser(
        "execute", help="run notebooks in solution and in learner mode, save the learner-mode outputs"
    )
    execute.add_argument(
        "paths", nargs="*", default=["chapters"], help="folders holding NN_topic/*.ipynb, or notebooks"
    )
    execute.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
    slowest = commands.add_parser("slowest", help="run notebooks once and list their slowest cells")
    slowest.add_argument("paths", nargs="*", default=["chapters"], help="folders or notebooks, as for execute")
    slowest.add_argument("--solutions", action="store_true", help="run in solution mode (default: learner mode)")
    slowest.add_argument("--top", type=int, default=5, help="how many cells to list per notebook")
    slowest.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
    args = parser.parse_args(argv)

    notebooks = [notebook for root in args.paths for notebook in chapter_notebooks(root)]
    if not notebooks:
        print(f"no notebooks found under {', '.join(args.paths)} (give the folder that holds the chapters, "
              "e.g. chapters, or the notebooks themselves, e.g. chapters/07_flash_attention/*.ipynb)",
              file=sys.stderr)
        return 1
    if args.command == "slowest":
        return _list_slowest(notebooks, args.solutions, args.top, args.timeout)
    failures = execute_notebooks(notebooks, timeout=args.timeout)
    print(f"{len(notebooks) - failures} of {len(notebooks)} notebooks executed and saved cleanly")
    return 1 if failures else 0


def _list_slowest(paths: Sequence[Path], solutions: bool, top: int, timeout: int, stream=None) -> int:
    """Run each notebook once and print its ``top`` slowest cells, marking slow ones without progress."""
    stream = stream or sys.stdout
    mode = "solution" if solutions else "learner"
    for path in paths:
        notebook = run_notebook(path, solutions=solutions, timeout=timeout)
        times = cell_times(notebook)
        total = sum(seconds for _, seconds, _ in times)
        print(f"{path} ({mode} mode, {total:.1f} s in its cells):", file=stream)
        for index, seconds, first in times[:top]:
            flag = ""
            if seconds > SLOW_CELL_S:
                flag = "  [progress line]" if _prints_progress(notebook.cells[index - 1]) else "  [NO progress line]"
            print(f"  cell {index:3d}  {seconds:6.1f} s  {first}{flag}", file=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
