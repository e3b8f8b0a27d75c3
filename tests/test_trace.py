"""utils.trace counts exactly the traffic that hand-counted kernels move."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp

import kernel_ladder
from utils.trace import Trace, format_bytes, ideal_bytes, tensor_bytes, trace

pytestmark = pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER, reason="the tracer watches the interpreter")

BLOCK = 1024


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask),
             mask=mask)


@triton.jit
def add_kernel_no_mask(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


@triton.jit
def strided_copy_kernel(x_ptr, out_ptr, n, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets * STRIDE, mask=mask), mask=mask)


@triton.jit
def same_block_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # Every program reads the same BLOCK elements: many requests, few distinct sectors.
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + offsets, tl.load(x_ptr + offsets))


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    acc = tl.zeros((M, N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def atomic_count_kernel(counts_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.atomic_add(counts_ptr + offsets, 1.0, mask=offsets < n)


@triton.jit
def tile_owner_kernel(x_ptr, out_ptr, stride_xr, stride_xc, ROWS: tl.constexpr, COLS: tl.constexpr):
    # Program (i, j) copies the ROWS x COLS tile (i, j) of a 2-D view, honouring its strides.
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    tile = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc)
    tl.store(out_ptr + r[:, None] * (2 * COLS) + c[None, :], tile)


def _aligned(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.data_ptr() % 32 == 0, "sector counts below assume sector-aligned tensors"


def _builder_methods() -> dict[str, object]:
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
             "create_dot", "set_grid_dim")
    methods = {name: interp.InterpreterBuilder.__dict__[name] for name in names}
    methods["__call__"] = interp.GridExecutor.__dict__["__call__"]
    methods["_init_args_hst"] = interp.GridExecutor.__dict__["_init_args_hst"]
    return methods


# ----------------------------------------------------------------------------------------------
# Triton side
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4 * BLOCK, 4 * BLOCK - 904])
def test_vector_add_moves_exactly_12n_bytes(n):
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    _aligned(x, y, out)
    programs = triton.cdiv(n, BLOCK)
    with trace() as t:
        add_kernel[(programs,)](x, y, out, n, BLOCK=BLOCK)
    torch.testing.assert_close(out, x + y)
    (launch,) = t.launches
    assert launch.kernel == "add_kernel"
    assert launch.grid == (programs,) and launch.programs == programs
    # Masked-off lanes of the tail program move nothing.
    assert (launch.bytes_read, launch.bytes_written, launch.bytes) == (8 * n, 4 * n, 12 * n)
    assert (launch.loads, launch.stores, launch.atomics) == (2 * programs, programs, 0)
    assert launch.flops == 0 and launch.out_of_bounds == 0
    assert set(launch.per_tensor) == {"x_ptr", "y_ptr", "out_ptr"}
    assert launch.per_tensor["x_ptr"].bytes_read == 4 * n and launch.per_tensor["x_ptr"].bytes_written == 0
    assert launch.per_tensor["out_ptr"].bytes_written == 4 * n and launch.per_tensor["out_ptr"].bytes_read == 0
    sectors_per_tensor = triton.cdiv(4 * n, 32)
    assert all(tt.sectors == sectors_per_tensor for tt in launch.per_tensor.values())
    assert launch.sectors == launch.unique_sectors == 3 * sectors_per_tensor
    assert launch.access == {}
    assert (t.bytes, t.bytes_read, t.bytes_written, t.num_launches) == (12 * n, 8 * n, 4 * n, 1)
    assert t.torch_ops == []  # the interpreter's own argument copies are not counted


def test_by_kernel_sums_launches_and_torch_ops_per_name():
    n = 2 * BLOCK
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    _aligned(x, y, out)
    with trace() as t:
        for _ in range(3):
            add_kernel[(2,)](x, y, out, n, BLOCK=BLOCK)
        z = x * y  # one aten op that launches a kernel
        z.view(2, -1)  # a view: no kernel, left out
    totals = {k.name: k for k in t.by_kernel()}
    assert set(totals) == {"add_kernel", "torch.aten.mul.Tensor"}
    assert (totals["add_kernel"].launches, totals["add_kernel"].bytes) == (3, 3 * 12 * n)
    assert (totals["torch.aten.mul.Tensor"].launches, totals["torch.aten.mul.Tensor"].bytes) == (1, 12 * n)
    assert [k.name for k in t.by_kernel()] == ["add_kernel", "torch.aten.mul.Tensor"]  # most bytes first
    assert sum(k.bytes for k in t.by_kernel()) == t.bytes


@pytest.mark.parametrize("stride, useful_per_sector", [(1, 8), (2, 4), (8, 1), (16, 1)])
def test_strided_load_touches_one_sector_per_useful_32_bytes(stride, useful_per_sector):
    n = 2 * BLOCK
    x, out = torch.randn(n * stride), torch.empty(n)
    _aligned(x, out)
    with trace() as t:
        strided_copy_kernel[(2,)](x, out, n, STRIDE=stride, BLOCK=BLOCK)
    torch.testing.assert_close(out, x[::stride])
    (launch,) = t.launches
    x_traffic = launch.per_tensor["x_ptr"]
    # Bytes count the elements asked for; sectors count what the memory system must move.
    assert x_traffic.bytes_read == 4 * n
    assert x_traffic.sectors == n // useful_per_sector
    assert launch.per_tensor["out_ptr"].sectors == 4 * n // 32
    assert launch.sectors == launch.unique_sectors == n // useful_per_sector + 4 * n // 32


def test_sectors_per_request_versus_unique_sectors():
    programs, block = 4, 256
    x, out = torch.randn(block), torch.empty(programs * block)
    _aligned(x, out)
    with trace() as t:
        same_block_kernel[(programs,)](x, out, BLOCK=block)
    (launch,) = t.launches
    x_sectors = 4 * block // 32
    out_sectors = 4 * programs * block // 32
    assert launch.per_tensor["x_ptr"].sectors == programs * x_sectors  # every request pays again
    assert launch.sectors == programs * x_sectors + out_sectors
    assert launch.unique_sectors == x_sectors + out_sectors  # a perfect cache pays once
    assert launch.per_tensor["x_ptr"].bytes_read == programs * block * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dot_counts_2mnk_flops_and_composes_with_bf16_numerics(dtype):
    M, N, K, BLOCK_K = 16, 32, 64, 32
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(K, N).to(dtype)
    c = torch.empty(M, N, dtype=dtype)
    before = _builder_methods()
    with trace() as t:
        matmul_kernel[(1,)](a, b, c, M=M, N=N, K=K, BLOCK_K=BLOCK_K)
    assert _builder_methods() == before  # the bf16 wrappers are back, untouched
    expected = (a.double() @ b.double()).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(c, expected, rtol=tol, atol=tol)
    (launch,) = t.launches
    assert launch.flops == 2 * M * N * K == t.flops
    size = a.element_size()
    assert launch.per_tensor["a_ptr"].bytes_read == M * K * size
    assert launch.per_tensor["b_ptr"].bytes_read == K * N * size
    assert launch.bytes_written == M * N * size


def test_missing_mask_reports_out_of_bounds_accesses():
    n = BLOCK - 24
    # Each tensor is a slice of a larger buffer, so the unmasked tail reads and writes land in
    # the buffer (memory we own), never in arbitrary host memory.
    x_buf, y_buf, out_buf = torch.randn(3 * BLOCK), torch.randn(3 * BLOCK), torch.zeros(3 * BLOCK)
    x, y, out = x_buf[BLOCK:BLOCK + n], y_buf[BLOCK:BLOCK + n], out_buf[BLOCK:BLOCK + n]
    with trace() as t:
        add_kernel_no_mask[(1,)](x, y, out, BLOCK=BLOCK)
    (launch,) = t.launches
    assert launch.out_of_bounds == 3 * 24 == t.out_of_bounds
    assert (launch.out_of_bounds_reads, launch.out_of_bounds_writes) == (48, 24)
    assert launch.per_tensor["x_ptr"].bytes_read == 4 * n  # attribution keeps in-bounds only
    assert launch.bytes == 12 * BLOCK  # the stray accesses still moved bytes
    assert torch.count_nonzero(out_buf[BLOCK + n:2 * BLOCK]) == 24  # faithful: it did write there
    assert t.table().splitlines()[0].endswith("OOB") and t.table().splitlines()[-1].endswith(" 72")

    with trace() as t_masked:
        add_kernel[(1,)](x, y, out, n, BLOCK=BLOCK)
    assert t_masked.launches[0].out_of_bounds == 0
    assert "OOB" not in t_masked.table()  # the column appears only when something went out of bounds


def test_block_out_of_bounds_stops_stray_accesses_before_they_happen():
    n = BLOCK - 24
    x_buf, y_buf, out_buf = torch.randn(3 * BLOCK), torch.randn(3 * BLOCK), torch.zeros(3 * BLOCK)
    x, y, out = x_buf[BLOCK:BLOCK + n], y_buf[BLOCK:BLOCK + n], out_buf[BLOCK:BLOCK + n]
    with trace(block_out_of_bounds=True) as t:
        add_kernel_no_mask[(1,)](x, y, out, BLOCK=BLOCK)
    assert t.launches[0].out_of_bounds == 72
    torch.testing.assert_close(out, x + y)
    assert torch.count_nonzero(out_buf[BLOCK + n:]) == 0  # the guard region was never written


def test_atomics_count_a_read_and_a_write():
    n = 100
    counts = torch.zeros(128)
    with trace() as t:
        atomic_count_kernel[(3,)](counts, n, BLOCK=128)
    assert torch.equal(counts[:n], torch.full((n,), 3.0)) and counts[n:].sum() == 0
    (launch,) = t.launches
    assert launch.atomics == 3 and launch.loads == launch.stores == 0
    assert launch.bytes_read == launch.bytes_written == 3 * 4 * n


def test_two_dimensional_grid_and_access_map_of_a_strided_view():
    rows, cols = 4, 8
    base = torch.randn(2 * cols, 2 * rows)
    x = base.t()  # (2*rows, 2*cols) view with strides (1, 2*rows): not contiguous
    out = torch.empty(2 * rows, 2 * cols)
    with trace(record_access=True) as t:
        tile_owner_kernel[(2, 2)](x, out, x.stride(0), x.stride(1), ROWS=rows, COLS=cols)
    torch.testing.assert_close(out, x)
    (launch,) = t.launches
    assert launch.grid == (2, 2) and launch.programs == 4
    # Program (i, j) has linear id i + 2*j and owns tile (i, j) of the logical view.
    expected = np.empty((2 * rows, 2 * cols), dtype=np.int32)
    for i in range(2):
        for j in range(2):
            expected[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = i + 2 * j
    for name in ("x_ptr", "out_ptr"):
        assert launch.access[name].shape == (2 * rows, 2 * cols)
        np.testing.assert_array_equal(launch.access[name], expected)


def test_access_map_marks_untouched_elements():
    n = 1000
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    with trace(record_access=True) as t:
        add_kernel[(1,)](x[:600], y[:600], out[:600], 600, BLOCK=BLOCK)
        add_kernel[(2,)](x, y, out, n, BLOCK=512)
    first, second = t.launches
    assert first.access["out_ptr"].shape == (600,) and (first.access["out_ptr"] == 0).all()
    np.testing.assert_array_equal(second.access["x_ptr"], np.repeat([0, 1], [512, n - 512]))
    with trace() as t_plain:
        add_kernel[(1,)](x, y, out, n, BLOCK=BLOCK)
    assert t_plain.launches[0].access == {}


def test_wrappers_exist_only_during_a_trace_and_nest():
    before = _builder_methods()
    n = 512
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    with trace() as outer:
        add_kernel[(1,)](x, y, out, n, BLOCK=BLOCK)
        with trace() as inner:
            assert _builder_methods() != before
            add_kernel[(1,)](x, y, out, n, BLOCK=BLOCK)
        assert _builder_methods() != before
    assert _builder_methods() == before
    assert len(inner.launches) == 1 and len(outer.launches) == 2
    assert outer.bytes == 2 * inner.bytes == 2 * 12 * n

    with pytest.raises(ZeroDivisionError):
        with trace():
            _ = 1 / 0
    assert _builder_methods() == before  # restored after an exception too


@triton.jit
def failing_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.static_assert(BLOCK < 0, "this kernel always fails")


def test_a_failing_launch_is_not_recorded_and_the_trace_goes_on():
    x = torch.randn(64)
    n = 64
    out = torch.empty(n)
    with trace() as t:
        with pytest.raises(Exception, match="always fails"):
            failing_kernel[(1,)](x, BLOCK=64)
        add_kernel[(1,)](x, x, out, n, BLOCK=64)
    assert [launch.kernel for launch in t.launches] == ["add_kernel"] and t.bytes == 12 * n


def test_out_of_order_exit_is_refused_and_a_trace_records_once():
    a, b = trace(), trace()
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="records once"):
        a.__enter__()


def test_table_and_summary_name_the_rows_and_totals():
    n = 2048
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    with trace() as t:
        add_kernel[(2,)](x, y, out, n, BLOCK=BLOCK)
        _ = x * y
    assert isinstance(t, Trace)
    text = str(t)
    assert "add_kernel" in text and "aten.mul.Tensor" in text and f"{12 * n + 12 * n:,}" in text
    assert "sectors" in text.splitlines()[0]
    with trace() as torch_only:
        _ = x * y
    assert "sectors" not in torch_only.table() and "aten.mul.Tensor" in torch_only.table()  # Triton-only columns
    s = t.summary()
    assert s["launches"] == 2 and s["triton_launches"] == 1 and s["torch_ops"] == 1
    assert s["bytes"] == 24 * n and s["bytes_read"] == 16 * n and s["bytes_written"] == 8 * n
    assert "launches=2" in repr(t)


# ----------------------------------------------------------------------------------------------
# Torch side
# ----------------------------------------------------------------------------------------------


def test_torch_x_times_y_plus_z_is_two_ops_and_24n_bytes():
    n = 1000
    x, y, z = torch.randn(n), torch.randn(n), torch.randn(n)
    with trace() as t:
        r = x * y + z
    assert [op.name for op in t.torch_ops] == ["aten.mul.Tensor", "aten.add.Tensor"]
    # mul reads x, y (8n) and writes x*y (4n); add reads x*y, z (8n) and writes r (4n).
    assert [(op.bytes_read, op.bytes_written) for op in t.torch_ops] == [(8 * n, 4 * n)] * 2
    assert t.bytes == 2 * 3 * 4 * n and t.num_launches == 2 and t.flops == 0
    assert t.launches == []
    torch.testing.assert_close(r, x * y + z)


def test_torch_views_and_allocations_move_nothing():
    x = torch.randn(64, 32)
    with trace() as t:
        v = x.t().view(32, 64)[1:].unsqueeze(0)
        e = torch.empty(1000)
        torch.empty_like(x)
    assert v.shape == (1, 31, 64) and e.numel() == 1000
    assert t.torch_ops and all(op.bytes == 0 and op.launches == 0 for op in t.torch_ops)
    assert t.num_launches == 0 and t.bytes == 0


def test_torch_matmul_flops_and_bytes():
    M, N, K = 8, 16, 32
    a, b, bias = torch.randn(M, K), torch.randn(K, N), torch.randn(N)
    with trace() as t:
        a @ b
        torch.addmm(bias, a, b)
        torch.bmm(a.expand(3, M, K), b.expand(3, K, N))
    mm, addmm, bmm = (op for op in t.torch_ops if op.launches)
    assert mm.flops == addmm.flops == 2 * M * N * K and bmm.flops == 3 * 2 * M * N * K
    assert (mm.bytes_read, mm.bytes_written) == (4 * (M * K + K * N), 4 * M * N)
    assert addmm.bytes_read == 4 * (M * K + K * N + N)
    assert bmm.bytes_read == 4 * (M * K + K * N)  # a broadcast batch reads its memory once
    assert t.flops == 5 * 2 * M * N * K


def test_a_batched_matmul_is_one_launch_its_reshape_a_view():
    # torch.matmul of 4-D operands folds them into a bmm and reshapes its result with
    # aten._unsafe_view, which moves nothing (its schema does not mark it a view).
    q, k = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 8, 16)
    with trace() as t:
        q @ k
    assert [op.name for op in t.torch_ops if op.launches] == ["aten.bmm.default"]
    assert t.bytes == 4 * (2 * 3 * 16 * 8 * 2 + 2 * 3 * 16 * 16) and t.num_launches == 1


def test_torch_in_place_and_out_variants():
    n = 256
    x, y, o = torch.randn(n), torch.randn(n), torch.empty(n)
    with trace() as t:
        x.add_(y)
        torch.mul(x, y, out=o)
        o.copy_(y)
        o.zero_()
        torch.ones_like(x)
    add_, mul_out, copy_, zero_, ones_like = t.torch_ops
    assert (ones_like.bytes_read, ones_like.bytes_written) == (0, 4 * n)
    assert (add_.bytes_read, add_.bytes_written) == (8 * n, 4 * n)
    assert (mul_out.bytes_read, mul_out.bytes_written) == (8 * n, 4 * n)
    assert (copy_.bytes_read, copy_.bytes_written) == (4 * n, 4 * n)
    assert (zero_.bytes_read, zero_.bytes_written) == (0, 4 * n)


_double_lib_defined = False


def _double_op():
    """A custom op in the ``kernel_ladder`` namespace whose body launches a Triton kernel."""
    global _double_lib_defined
    if not _double_lib_defined:

        @torch.library.custom_op("kernel_ladder::_trace_test_double", mutates_args=())
        def _trace_test_double(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            add_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, x, out, x.numel(), BLOCK=BLOCK)
            return out

        _double_lib_defined = True
    return torch.ops.kernel_ladder._trace_test_double


def test_kernels_custom_ops_are_counted_by_their_triton_launches_only():
    op = _double_op()
    n = 1500
    x = torch.randn(n)
    with trace() as t:
        y = op(x)
        z = y + 1
    torch.testing.assert_close(z, 2 * x + 1)
    assert [o.name for o in t.torch_ops] == ["aten.add.Tensor"]
    (launch,) = t.launches
    assert launch.kernel == "add_kernel" and launch.bytes == 12 * n
    assert t.num_launches == 2


_hidden_lib_defined = False


def _hidden_work_op():
    """A ``kernel_ladder`` custom op that hides torch work behind its Triton launch: a sum, a host sync, a copy."""
    global _hidden_lib_defined
    if not _hidden_lib_defined:

        @torch.library.custom_op("kernel_ladder::_trace_test_hidden_work", mutates_args=())
        def _trace_test_hidden_work(x: torch.Tensor) -> torch.Tensor:
            scale = x.sum()  # an aten reduction: a kernel and n * 4 bytes
            if scale.item() > 1e30:  # a host synchronization
                raise AssertionError("unreachable")
            flat = x.t().contiguous().t()  # a composite op: a copy (aten.clone)
            out = torch.empty_like(flat)  # an allocation: moves nothing, not listed
            add_kernel[(triton.cdiv(x.numel(), BLOCK),)](flat, flat, out, x.numel(), BLOCK=BLOCK)
            return out

        @_trace_test_hidden_work.register_fake
        def _(x):
            return torch.empty_like(x)

        _hidden_lib_defined = True
    return torch.ops.kernel_ladder._trace_test_hidden_work


def test_torch_work_inside_a_kernels_op_is_counted_and_attributed_to_it():
    op = _hidden_work_op()
    x = torch.randn(30, 50)
    with trace() as t:
        y = op(x)
        z = y + 1
    torch.testing.assert_close(z, 2 * x + 1)
    inside = "kernel_ladder._trace_test_hidden_work.default"
    assert [(o.name, o.inside) for o in t.torch_ops] == [
        ("aten.sum.default", inside), ("aten._local_scalar_dense.default", inside), ("aten.clone.default", inside),
        ("aten.add.Tensor", ""),
    ]
    summed, synced, copied, _ = t.torch_ops
    assert (summed.bytes_read, summed.bytes_written) == (x.nbytes, 4)
    assert (synced.bytes_read, copied.bytes_read, copied.bytes_written) == (4, x.nbytes, x.nbytes)
    (launch,) = t.launches  # the Triton launch inside is still a launch, with its exact traffic
    assert launch.kernel == "add_kernel" and launch.bytes == 3 * x.nbytes
    assert t.num_launches == 1 + 4


def test_negative_control_an_opaque_kernels_op_hides_its_torch_work(monkeypatch):
    """What the test above catches: counting the custom op as one opaque op (the tracer's old view)."""
    from utils import trace as tracing

    opaque = lambda self, func, args, kwargs: func(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(tracing._TorchCounter, "_run_kernels_op", opaque)
    x = torch.randn(30, 50)
    with trace() as t:
        _hidden_work_op()(x)
    assert t.torch_ops == [] and t.num_launches == 1  # the sum, the sync and the copy unseen


def test_kernels_ops_torch_work_composes_with_peak_memory_in_either_order():
    from utils.memory import peak_memory

    op = _hidden_work_op()
    x = torch.randn(30, 50)
    with trace() as outer, peak_memory(cuda=False) as inner:
        op(x)
    with peak_memory(cuda=False) as memory, trace() as t:
        op(x)
    assert inner.peak_bytes == memory.peak_bytes >= 2 * x.nbytes  # the copy and the output
    # With peak_memory on top, it runs the op's body itself: the tracer sees the same work, unattributed.
    assert [o.name for o in outer.torch_ops if o.launches] == [o.name for o in t.torch_ops]
    assert outer.bytes == t.bytes and outer.num_launches == t.num_launches == 4


def test_composite_ops_under_inference_mode_are_counted_by_what_they_run():
    x = torch.randn(40, 30)
    with torch.inference_mode():
        y = torch.randn(40, 30)
        with trace() as t:
            y.t().contiguous()
    assert [o.name for o in t.torch_ops if o.launches] == ["aten.clone.default"]
    assert t.bytes == 2 * x.nbytes


def test_torch_ops_can_be_left_out():
    x = torch.randn(10)
    with trace(torch_ops=False) as t:
        x * 2
    assert t.torch_ops == [] and t.num_launches == 0


def test_ideal_bytes_and_helpers():
    x = torch.randn(10, 4)
    assert ideal_bytes(x, x[:, :2]) == 160 + 80
    assert tensor_bytes(torch.randn(4).expand(3, 4)) == 16
    assert tensor_bytes(torch.empty(0, 3)) == 0
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.54 kB" and format_bytes(4.8e12) == "4.8 TB"


def test_library_op_forward_and_backward_are_traced_as_triton_launches():
    n = 3000
    x, y = torch.randn(n), torch.randn(n)
    with trace() as t:
        out = kernel_ladder.add(x, y)
    torch.testing.assert_close(out, x + y)
    assert t.torch_ops == [] and t.num_launches == len(t.launches) == 1
    assert t.bytes == 12 * n == ideal_bytes(x, y, out)

    x.requires_grad_(True)
    with trace() as t:
        kernel_ladder.gelu(x).backward(torch.ones(n))
    assert [launch.kernel for launch in t.launches] == ["gelu_kernel", "gelu_backward_kernel"]
    forward, backward = t.launches
    assert forward.bytes == 8 * n and backward.bytes == 12 * n  # backward reads x and grad, writes grad_x
