"""utils.trace(record_sectors=True): every memory instruction, in order, with its program and sectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
from utils.trace import SectorAccess, trace

pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER, reason="the tracer watches the interpreter")]


@triton.jit
def tile_copy_kernel(x_ptr, out_ptr, n_cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    # program (i, j) copies rows [i*ROWS, (i+1)*ROWS) x cols [j*COLS, (j+1)*COLS) of a row-major matrix
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    offsets = r[:, None] * n_cols + c[None, :]
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))


@triton.jit
def two_tensor_kernel(x_ptr, y_ptr, DISTANCE: tl.constexpr, BLOCK: tl.constexpr):
    # one load whose lanes fall partly in x and partly in y (y sits DISTANCE elements after x)
    offsets = tl.arange(0, BLOCK)
    values = tl.load(x_ptr + offsets * DISTANCE // (BLOCK - 1))
    tl.store(y_ptr + offsets, values)


def _sectors(t: torch.Tensor, element_offsets: np.ndarray) -> np.ndarray:
    return np.unique((t.data_ptr() + element_offsets * t.element_size()) // 32)


def test_sector_log_follows_programs_in_order_with_exact_sectors():
    rows, cols, n_cols = 4, 16, 32  # 16 fp32 = 64 bytes = 2 sectors per tile row
    x = torch.randn(2 * rows, n_cols)
    out = torch.empty_like(x)
    with trace(record_sectors=True) as t:
        tile_copy_kernel[(2, 2)](x, out, n_cols, ROWS=rows, COLS=cols)
    torch.testing.assert_close(out, x)
    (launch,) = t.launches
    log = launch.sector_log
    assert all(isinstance(a, SectorAccess) for a in log)
    assert [(a.kind, a.tensor) for a in log] == [("load", "x_ptr"), ("store", "out_ptr")] * 4
    # The interpreter runs x outermost; the linear id is x + 2*y, so execution order is 0, 2, 1, 3.
    assert [a.program for a in log[::2]] == [0, 2, 1, 3]
    grouped = launch.program_sectors()
    assert list(grouped) == [0, 1, 2, 3]
    for program, accesses in grouped.items():
        i, j = program % 2, program // 2
        r = i * rows + np.arange(rows)
        c = j * cols + np.arange(cols)
        offsets = (r[:, None] * n_cols + c[None, :]).reshape(-1)
        load, store = accesses
        np.testing.assert_array_equal(load.sectors, _sectors(x, offsets))
        np.testing.assert_array_equal(store.sectors, _sectors(out, offsets))
        assert load.sectors.size == rows * 2
    # The log's sectors add up to the launch's counters.
    assert sum(a.sectors.size for a in log) == launch.sectors
    assert np.unique(np.concatenate([a.sectors for a in log])).size == launch.unique_sectors


def test_an_instruction_spanning_two_tensors_is_logged_without_a_name():
    block = 8
    buffer = torch.zeros(64)
    x, y = buffer[:16], buffer[32:40]  # one load from x's start to y's start: lanes in both
    with trace(record_sectors=True) as t:
        two_tensor_kernel[(1,)](x, y, DISTANCE=32, BLOCK=block)
    (load, store) = t.launches[0].sector_log
    assert load.kind == "load" and load.tensor == ""
    assert store.tensor == "y_ptr"


def test_sector_log_is_empty_unless_asked_for():
    x = torch.randn(8, 32)
    out = torch.empty_like(x)
    with trace() as t:
        tile_copy_kernel[(2, 2)](x, out, 32, ROWS=4, COLS=16)
    assert t.launches[0].sector_log == [] and t.launches[0].program_sectors() == {}
    with trace(record_sectors=True) as outer:
        with trace() as inner:  # any active trace that asks gets it; every trace sees the same launch
            tile_copy_kernel[(1, triton.cdiv(32, 16))](x, out, 32, ROWS=4, COLS=16)
    assert len(outer.launches[0].sector_log) == 4 and inner.launches[0] is outer.launches[0]
