"""The row launch planner shared by the row-wise ops (softmax, cross-entropy, norms)."""

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder  # noqa: F401  (fixes the mode before the kernel below is defined)
from kernel_ladder._launch import next_power_of_2
from kernel_ladder._rows import merge_trailing, plan_rows, row_start


@triton.jit
def _row_sum_kernel(
    x_ptr, out_ptr, n_rows, n_cols, size1, size2, xs0, xs1, xs2, xc, os0, os1, os2, oc, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row_start(row, size1, size2, xs0, xs1, xs2) + cols * xc, mask=mask, other=0.0)
    total = tl.sum(x, 0)
    tl.store(out_ptr + row_start(row, size1, size2, os0, os1, os2) + cols * oc, x * 0.0 + total, mask=mask)


def _row_sum(x, dim):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launches = plan_rows([x.movedim(dim, -1), out.movedim(dim, -1)])
    for launch in launches:
        _row_sum_kernel[(launch.n_rows,)](*launch.tensors, *launch.args(), BLOCK=next_power_of_2(launch.n_cols))
    return out, launches


CASES = [
    ((5, 7), -1, lambda t: t),
    ((5, 7), 0, lambda t: t),
    ((3, 4, 5), 1, lambda t: t),
    ((6, 5), 0, lambda t: t.t()),
    ((4, 9), 1, lambda t: t[:, ::2]),
    ((1, 1), 0, lambda t: t),
    ((2, 3, 4, 5, 6), 2, lambda t: t.permute(4, 0, 3, 1, 2)),  # 4 leading dims no operand can merge
    ((2, 2, 2, 2, 3), -1, lambda t: t[:, :, :, :, ::1].permute(3, 2, 1, 0, 4)),
]


@pytest.mark.parametrize("shape, dim, make", CASES)
def test_row_sum_matches_torch_on_strided_views(shape, dim, make):
    x = make(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    got, _ = _row_sum(x, dim)
    torch.testing.assert_close(got, x.sum(dim, keepdim=True).expand_as(x), atol=1e-5, rtol=1e-5)


def test_contiguous_rows_merge_into_one_launch_and_leading_dims_beyond_three_are_sliced():
    x = torch.randn(2, 3, 4, 5)
    (launch,) = plan_rows([x])
    assert (launch.n_rows, launch.n_cols, launch.sizes, launch.strides) == (24, 5, (1, 24), (0, 0, 5, 1))
    y = torch.randn(2, 3, 4, 5, 6).permute(4, 0, 3, 1, 2)  # leading dims (6, 2, 5, 3) merge nowhere
    assert len(plan_rows([y])) == 6


def test_merge_trailing_refuses_dims_one_stride_cannot_walk():
    x = torch.randn(4, 5, 6)
    assert merge_trailing(x, 2) == ([4], [30], 30, 1)
    assert merge_trailing(x.transpose(1, 2), 2) is None
    assert merge_trailing(x[:, :, ::2], 1) == ([4, 5], [30, 6], 3, 2)


def test_empty_tensors_plan_no_launch():
    assert plan_rows([torch.empty(0, 5)]) == []
    assert plan_rows([torch.empty(5, 0)]) == []
