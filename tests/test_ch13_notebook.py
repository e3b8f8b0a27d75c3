"""Chapter 13's notebook holds its C++ and CUDA exercise stubs written out: they must be the stubs the checkers'
tests prove NOT SOLVED (``utils.exercises.cpp_kernel`` and ``cuda_kernel``), linked to the solutions' names."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from utils.exercises import cpp_kernel, cuda_kernel

NOTEBOOK = Path(__file__).resolve().parent.parent / "chapters" / "13_below_triton" / "13_below_triton.ipynb"
STUB = re.compile(r'^(\w+) = exercise\("(ch13_below_triton\.\w+)"\)\(r"""(.*?)"""\)\s*$', re.S)


def stubs(notebook: nbformat.NotebookNode) -> dict[str, tuple[str, str]]:
    """``{variable: (exercise name, source)}`` of every cell that writes a source-string stub out."""
    found = {}
    for cell in notebook.cells:
        match = STUB.match(cell.source.strip()) if cell.cell_type == "code" else None
        if match:
            found[match.group(1)] = (match.group(2), match.group(3))
    return found


@pytest.fixture(scope="module")
def notebook_stubs() -> dict[str, tuple[str, str]]:
    return stubs(nbformat.read(NOTEBOOK, as_version=4))


@pytest.mark.parametrize(
    "variable, expected",
    [
        ("RMS_NORM_SIMD", cpp_kernel.RMS_NORM_SIMD_STUB),
        ("GEMM_BLOCKED", cpp_kernel.GEMM_BLOCKED_STUB),
        ("RMS_NORM_WARP", cuda_kernel.RMS_NORM_WARP_STUB),
    ],
)
def test_the_notebook_writes_out_the_checkers_stub(notebook_stubs, variable, expected):
    assert variable in notebook_stubs, f'no cell `{variable} = exercise(...)(r"""...""")` in {NOTEBOOK.name}'
    name, source = notebook_stubs[variable]
    assert name == f"ch13_below_triton.{variable}"
    assert source == expected


def test_a_changed_stub_is_told_apart():
    # negative control: the parser finds a stub whose text differs from the checker's, and reports that text
    cell = nbformat.v4.new_code_cell('RMS_NORM_SIMD = exercise("ch13_below_triton.RMS_NORM_SIMD")(r"""int x;\n""")')
    found = stubs(nbformat.v4.new_notebook(cells=[cell]))
    assert found == {"RMS_NORM_SIMD": ("ch13_below_triton.RMS_NORM_SIMD", "int x;\n")}
    assert found["RMS_NORM_SIMD"][1] != cpp_kernel.RMS_NORM_SIMD_STUB
