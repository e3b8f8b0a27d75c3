"""utils.memory.peak_memory: exact byte counts for known allocations, frees, views, autograd, our ops."""

from __future__ import annotations

import pytest
import torch

import kernel_ladder
from utils.memory import peak_memory
from utils.trace import trace


def test_known_allocations_exact():
    with peak_memory(cuda=False) as m:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(250, dtype=torch.float64)  # 2000 B
        c = torch.ones(3, 5, dtype=torch.int16)  # 30 B
    assert m.peak_bytes == 6030
    assert m.allocated_bytes == 6030
    assert m.total_allocated_bytes == 6030
    assert [x.nbytes for x in m.allocations] == [4000, 2000, 30]
    assert [x.op for x in m.allocations] == ["aten.empty", "aten.empty", "aten.ones"]
    assert m.allocations[1].dtype == torch.float64 and m.allocations[2].shape == (3, 5)
    del a, b, c


def test_frees_are_seen():
    with peak_memory(cuda=False) as m:
        for _ in range(10):
            t = torch.empty(1000)
            del t
        keep = torch.empty(500)
    # Negative control: without frees, the peak would be the total (42,000 B).
    assert m.total_allocated_bytes == 42_000
    assert m.peak_bytes == 4000
    assert m.allocated_bytes == 2000
    assert [x.alive for x in m.allocations] == [False] * 10 + [True]
    del keep


def test_peak_is_the_maximum_not_the_end():
    with peak_memory(cuda=False) as m:
        a = torch.empty(2000)  # 8000
        b = torch.empty(1000)  # 4000 -> 12000 alive
        del a
        c = torch.empty(1500)  # 6000 -> 10000 alive
    assert m.peak_bytes == 12_000
    assert m.allocated_bytes == 10_000
    assert sorted(x.nbytes for x in m.at_peak) == [4000, 8000]
    del b, c


def test_views_and_inplace_share_their_storage():
    with peak_memory(cuda=False) as m:
        a = torch.randn(40, 25)  # 4000 B
        views = [a.view(1000), a[::2], a.t(), a.unsqueeze(0), a[3], a.as_strided((10,), (3,)), a.detach()]
        a.mul_(2.0).add_(1.0)
        a[0].zero_()
    assert m.peak_bytes == 4000
    assert m.allocated_bytes == 4000
    assert len(m.allocations) == 1
    # A view keeps its storage alive after the base is dropped.
    with peak_memory(cuda=False) as m2:
        base = torch.empty(1000)
        view = base[10:20]
        del base
        after_base = torch.empty(1)
        del view
    assert m2.peak_bytes == 4004
    assert m2.allocated_bytes == 4
    del a, views, after_base


def test_tensors_from_before_are_not_counted():
    x = torch.randn(1000)
    with peak_memory(cuda=False) as m:
        x.add_(1.0)
        v = x[::2]
        y = x * 2  # 4000 B, new
    assert m.peak_bytes == 4000
    assert len(m.allocations) == 1
    del v, y


def test_out_argument_grows_a_storage_in_place():
    a, b = torch.randn(100), torch.randn(100)
    with peak_memory(cuda=False) as m:
        out = torch.empty(0)
        torch.add(a, b, out=out)  # resizes `out`'s storage to 400 B
    assert m.peak_bytes == 400
    assert m.allocated_bytes == 400
    del out


def test_forward_and_backward_through_autograd():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 100, generator=gen, requires_grad=True)
    w = torch.randn(64, 100, generator=gen)
    with peak_memory(cuda=False) as m:
        p = x * w  # 25,600 B, kept alive
        p.sum().backward()  # the backward's grad * w (25,600 B) becomes x.grad
    assert x.grad is not None
    by_op = {r.op: r for r in m.by_op()}
    assert by_op["aten.mul"].total_bytes == 2 * x.nbytes  # forward product and backward product
    assert by_op["aten.mul"].alive_bytes == 2 * x.nbytes
    # Only scalars (the sum, its ones-gradient) come on top of the two N-sized tensors.
    assert 2 * x.nbytes < m.peak_bytes <= 2 * x.nbytes + 16
    del p
    # Same without keeping the product: it is freed right after the sum, before the backward.
    x.grad = None
    with peak_memory(cuda=False) as m:
        (x * w).sum().backward()
    assert x.nbytes < m.peak_bytes <= x.nbytes + 16
    assert m.allocated_bytes == x.nbytes


def test_our_triton_ops_outputs_are_seen_and_credited():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1000, generator=gen, requires_grad=True)
    with peak_memory(cuda=False) as m:
        y = kernel_ladder.gelu(x)
        y.backward(torch.ones_like(y))
    by_op = {r.op: r for r in m.by_op()}
    assert by_op["kernel_ladder.gelu"].total_bytes == x.nbytes  # its torch.empty output, once
    assert by_op["kernel_ladder.gelu_backward"].total_bytes == x.nbytes
    assert by_op["aten.ones_like"].total_bytes == x.nbytes
    assert m.peak_bytes == 3 * x.nbytes
    assert m.allocated_bytes == 3 * x.nbytes  # y, the ones, x.grad
    assert {a.inner for a in m.allocations if a.op.startswith("kernel_ladder.")} == {"aten.empty"}
    del y


def test_table_and_by_op():
    with peak_memory(cuda=False) as m:
        a = torch.empty(1000)
        b = torch.zeros(10)
        c = a + 1
        del a
    rows = m.by_op()
    assert [r.op for r in rows] == ["aten.add", "aten.empty", "aten.zeros"]
    assert rows[1].at_peak_bytes == 4000 and rows[1].alive_bytes == 0
    text = m.table()
    for s in ("aten.add", "aten.empty", "aten.zeros", "8,040", "peak"):
        assert s in text
    assert "more ops" in m.table(top=1)
    assert "peak=" in repr(m)
    del b, c


def test_misuse_is_explained():
    m = peak_memory(cuda=False)
    with pytest.raises(RuntimeError, match="after the `with peak_memory"):
        _ = m.peak_bytes
    with m:
        pass
    with pytest.raises(RuntimeError, match="measures once"):
        with m:
            pass
    assert m.peak_bytes == 0 and m.allocated_bytes == 0 and m.table()


def test_composes_with_the_tracer():
    x = torch.randn(1000)
    with trace() as t, peak_memory(cuda=False) as m:
        y = kernel_ladder.gelu(x)
    assert m.peak_bytes == x.nbytes
    assert t.num_launches == 1
    del y


@pytest.mark.gpu
def test_cuda_allocator_peak_agrees():
    x = torch.randn(1 << 20, device="cuda")
    with peak_memory() as m:
        y = x * 2
        z = y + 1
        del y
    assert m.peak_bytes == 2 * x.nbytes
    assert m.cuda_peak_bytes is not None and m.cuda_peak_bytes >= 2 * x.nbytes
    del z
