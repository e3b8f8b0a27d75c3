"""nbval runs every chapter notebook in learner mode against its committed outputs (``make test``).

A pytest plugin, loaded by name (``pytest --nbval -p utils.nbval_plugin chapters``; a ``conftest.py`` in
``chapters/`` would clash with ``tests/conftest.py``, which tests import as ``conftest``). nbval executes each
notebook cell by cell in a fresh kernel of the notebooks' own kernelspec (``kernel-ladder``, installed by
``make setup``) and compares every output with the committed one, honouring the ``nbval-ignore-output`` /
``nbval-skip`` / ``raises-exception`` tags the notebooks carry. Two things are set here, and nothing else is
changed in nbval:

* the kernel runs in **learner mode** (the stubs as written, ``KERNEL_LADDER_CHECK_SEED`` fixed), the
  mode the committed outputs were made in (:func:`utils.notebooks.kernel_env`): so every check must
  print its committed ``❌ NOT SOLVED`` verdict, and an unsolved notebook is shown to run to the end;
* **rounding residues** (numbers in e-notation below 1e-3, such as an fp32 kernel's error against a
  float64 reference, whose digits depend on the CPU's BLAS kernels) match within
  :data:`utils.notebooks.RESIDUE_FACTOR` of the committed value (:func:`utils.notebooks.same_text`);
  every other character must be equal;
* nothing for pytest-xdist: all cells of one notebook must run on one worker, in order (they share one
  kernel), which ``--dist loadfile`` guarantees (``make test`` uses it; ``loadgroup`` does not group
  nbval's items under pytest 9.2 with pytest-xdist 3.8).

Solution mode (every check ✅) is what nbval cannot do: ``tests/test_notebooks.py`` runs it.
"""

from __future__ import annotations

import copy

from utils.notebooks import kernel_env, same_text


def _residue_tolerant(compare_outputs):
    """nbval's ``compare_outputs`` with each committed text replacing a run's text it equals up to residues."""

    def compare(self, test, ref, skip_compare=None):
        test = copy.deepcopy(test)
        for got, want in zip(test, ref):
            if got.get("output_type") != want.get("output_type"):
                continue
            if got.get("output_type") == "stream":
                if got.get("name") == want.get("name") and same_text(want.get("text", ""), got.get("text", "")):
                    got["text"] = want.get("text", "")
            elif "data" in got and "data" in want:
                text, expected = got["data"].get("text/plain"), want["data"].get("text/plain")
                if isinstance(text, list):
                    text = "".join(text)
                if isinstance(expected, list):
                    expected = "".join(expected)
                if isinstance(text, str) and isinstance(expected, str) and same_text(expected, text):
                    got["data"]["text/plain"] = want["data"]["text/plain"]
        return compare_outputs(self, test, ref, skip_compare)

    compare.__wrapped__ = compare_outputs
    return compare


def _learner_kernel(start_new_kernel):
    """nbval's ``start_new_kernel`` with the learner-mode environment given to the kernel."""

    def start(*args, **kwargs):
        kwargs.setdefault("env", kernel_env(solutions=False))
        return start_new_kernel(*args, **kwargs)

    start.__wrapped__ = start_new_kernel
    return start


def pytest_configure(config) -> None:
    if not (getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False)):
        return
    import nbval.kernel
    import nbval.plugin

    if not hasattr(nbval.kernel.start_new_kernel, "__wrapped__"):
        nbval.kernel.start_new_kernel = _learner_kernel(nbval.kernel.start_new_kernel)
    if not hasattr(nbval.plugin.IPyNbCell.compare_outputs, "__wrapped__"):
        nbval.plugin.IPyNbCell.compare_outputs = _residue_tolerant(nbval.plugin.IPyNbCell.compare_outputs)
