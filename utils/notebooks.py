"""Running the chapter notebooks: in solution mode to commit their outputs, in learner mode to test them.

``python -m utils.notebooks execute chapters`` (what ``make notebooks`` runs) re-executes every
``chapters/*/*.ipynb`` in solution mode (``KERNEL_LADDER_SOLUTIONS=1``), top to bottom in one
fresh ``python3`` kernel whose working directory is the notebook's folder, and saves it with its
new outputs (execution counts 1..n) and with the metadata noise of a run (timings, the machine's
Python version) removed, so that a re-run changes only what really changed.

:func:`run_notebook` runs one notebook in either mode and returns it, for tests;
:func:`verdict_lines` and :func:`error_outputs` read what a run printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat import NotebookNode

__all__ = [
    "KERNEL_NAME",
    "chapter_notebooks",
    "error_outputs",
    "execute_notebooks",
    "main",
    "normalize",
    "run_notebook",
    "verdict_lines",
]

#: The kernel every chapter notebook names and runs in.
KERNEL_NAME = "python3"
#: Seconds one cell may take before the run is abandoned (notebooks are meant to take < 60 s in all).
CELL_TIMEOUT_S = 600

_SOLUTIONS_ENV = "KERNEL_LADDER_SOLUTIONS"  # as utils.exercises.SOLUTIONS_ENV (not imported: keeps this light)
_VERDICT_MARKS = ("✅ SOLVED", "❌ NOT SOLVED")

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
_KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": KERNEL_NAME}


def chapter_notebooks(root: str | os.PathLike = "chapters") -> list[Path]:
    """Every ``<root>/*/*.ipynb`` in order (checkpoints excluded); ``root`` may also be one notebook."""
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(p for p in root.glob("*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _kernel_env(solutions: bool) -> dict[str, str]:
    env = dict(os.environ)
    env[_SOLUTIONS_ENV] = "1" if solutions else "0"
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
    the notebook's folder. A cell that raises stops the run with ``nbclient``'s
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
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    client.execute(env=_kernel_env(solutions))
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


def execute_notebooks(paths: Sequence[Path], timeout: int = CELL_TIMEOUT_S, stream=None) -> int:
    """Re-execute ``paths`` in solution mode and save them; print one progress line each; return failures."""
    stream = stream or sys.stdout
    failures = 0
    for number, path in enumerate(paths, start=1):
        prefix = f"[{number}/{len(paths)}] {path}"
        print(f"{prefix}: running in solution mode ...", file=stream, flush=True)
        started = time.perf_counter()
        try:
            notebook = run_notebook(path, solutions=True, timeout=timeout)
        except Exception as error:  # report and go on with the others; the file is left as it was
            failures += 1
            summary = str(error).strip().splitlines()
            print(f"{prefix}: FAILED, not saved: {type(error).__name__}", file=stream)
            for line in summary[-15:]:
                print(f"    {line}", file=stream)
            continue
        seconds = time.perf_counter() - started
        verdicts = verdict_lines(notebook)
        unsolved = [v for v in verdicts if not v.startswith(_VERDICT_MARKS[0])]
        if unsolved:  # solution mode must solve every exercise; keep the committed outputs
            failures += 1
            print(f"{prefix}: FAILED, not saved: {len(unsolved)} of {len(verdicts)} checks NOT SOLVED", file=stream)
            for line in unsolved:
                print(f"    {line}", file=stream)
            continue
        nbformat.write(normalize(notebook), path)
        print(
            f"{prefix}: saved, {len(notebook.cells)} cells, {len(verdicts)} checks solved, {seconds:.1f} s",
            file=stream,
            flush=True,
        )
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m utils.notebooks execute [PATH ...]`` (default ``chapters``)."""
    parser = argparse.ArgumentParser(prog="python -m utils.notebooks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    execute = commands.add_parser("execute", help="re-execute notebooks in solution mode and save their outputs")
    execute.add_argument(
        "paths", nargs="*", default=["chapters"], help="folders holding NN_topic/*.ipynb, or notebooks"
    )
    execute.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
    args = parser.parse_args(argv)

    notebooks = [notebook for root in args.paths for notebook in chapter_notebooks(root)]
    if not notebooks:
        print(f"no notebooks found under {', '.join(args.paths)}", file=sys.stderr)
        return 1
    failures = execute_notebooks(notebooks, timeout=args.timeout)
    print(f"{len(notebooks) - failures} of {len(notebooks)} notebooks executed and saved cleanly")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
