"""kernel_ladder.distributed.plan_layout: the counts of a 3-D mesh follow from the sizes."""

from __future__ import annotations

import pytest

from kernel_ladder.distributed import AlphaBeta, plan_layout

SIZES = dict(layers=8, hidden=1024, seq=2048, micro_batch=1, microbatches=8)


def test_one_gpu_holds_sixteen_bytes_a_parameter_and_sends_nothing():
    one = plan_layout(**SIZES, tp=1, pp=1, dp=1)
    assert one.parameters_per_gpu == 12 * 1024**2 * 8
    assert one.memory_bytes == 16 * one.parameters_per_gpu
    assert one.tp_bytes == one.pp_bytes == one.dp_bytes == 0 and one.bubble == 0


def test_each_dimension_divides_what_it_should():
    one = plan_layout(**SIZES, tp=1, pp=1, dp=1)
    tp = plan_layout(**SIZES, tp=4, pp=1, dp=1)
    pp = plan_layout(**SIZES, tp=1, pp=4, dp=1)
    dp = plan_layout(**SIZES, tp=1, pp=1, dp=4)
    assert tp.parameters_per_gpu == pp.parameters_per_gpu == one.parameters_per_gpu / 4
    assert dp.parameters_per_gpu == one.parameters_per_gpu and dp.optimizer_bytes == one.optimizer_bytes / 4
    assert plan_layout(**SIZES, tp=1, pp=1, dp=4, zero1=False).optimizer_bytes == one.optimizer_bytes
    activation = 2048 * 1024 * 2
    assert tp.tp_bytes == 4 * 8 * 8 * activation * 2 * 3 / 4  # 4 all-reduces a block, 8 blocks, 8 micro-batches
    assert pp.bubble == pytest.approx(3 / 11) and pp.pp_bytes == 2 * 8 * activation
    assert dp.dp_bytes == 2 * 3 / 4 * one.parameters_per_gpu * 2


def test_seconds_come_from_the_alpha_beta_links():
    layout = plan_layout(**SIZES, tp=2, pp=2, dp=2)
    secs = layout.comm_seconds(AlphaBeta(0.0, 100e9), AlphaBeta(0.0, 10e9))
    assert secs == {"tp": layout.tp_bytes / 100e9, "pp": layout.pp_bytes / 10e9, "dp": layout.dp_bytes / 10e9}


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="layers \\(8\\) must be divisible by pp \\(3\\)"):
        plan_layout(**SIZES, tp=1, pp=3, dp=1)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        plan_layout(**SIZES, tp=0, pp=1, dp=1)
