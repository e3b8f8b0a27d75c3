"""utils.isa_report: the instruction-level view, in its --quick form, compiled in a compiled-mode child process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from utils.aot import run_compiled
from utils.isa_report import BEGIN, END, TITLE, Row, section, table

REPORT = Path(__file__).resolve().parent.parent / "utils" / "isa_report.py"


@pytest.mark.slow
def test_quick_report_rows_read_real_properties_of_the_compiled_kernels(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    out, results = tmp_path / "rows.json", tmp_path / "results.md"
    results.write_text("# Results\n\nkept before\n")
    result = run_compiled(
        REPORT, tmp_path, timeout=900, args=("--quick", "--json", str(out), "--results", str(results))
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert rows and not [r for r in rows if r["error"]]
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    matmul = by_case["matmul"][0]
    assert matmul["kernel"] == "matmul_kernel" and matmul["tensor_op"] == "wgmma"
    assert matmul["choice"].startswith("autotuned") and matmul["loop"]["tensor"] > 0
    assert 0 < matmul["model"]["tensor_use"] <= 1 and matmul["blocks_per_sm"] >= 1
    norm = by_case["RMSNorm"][0]
    assert norm["tensor_op"] is None and norm["vector_128"] and norm["choice"] == "static"
    assert norm["loop"] is None or norm["loop"]["tensor"] == 0
    compiled = [r for r in rows if not r["same_as"]]
    assert all(r["spilled"] == 0 for r in compiled)
    assert all(r["registers"] and r["registers"] <= 255 for r in compiled)
    text = results.read_text()
    assert text.startswith("# Results\n\nkept before\n") and text.count(BEGIN) == 1 and TITLE in text
    assert "matmul_kernel" in text and text.rstrip().endswith(END)


def test_table_says_same_as_errors_and_no_loop():
    rows = [
        Row(
            "op",
            "k1",
            "BLOCK=1 w4 s3",
            "static",
            registers=32,
            spilled=0,
            shared=0,
            blocks_per_sm=16,
            occupancy_limiter="warps",
            vector_128=True,
            extra={"sizes": "8 x 8"},
        ),
        Row("op", "k2", "BLOCK=1 w4 s3", "static", same_as="other: k2"),
        Row("op2", "k3", "", "static", error="ValueError: bad"),
    ]
    text = table(rows)
    assert "| op (8 x 8) | k1 |" in text and "no loop" in text and "16 (warps)" in text
    assert "same as other: k2" in text and "not compiled: ValueError: bad" in text
    assert section(rows).startswith(BEGIN) and section(rows).endswith(END)
