"""bench/ch09_moe's own pieces that the report does not run: the torch._grouped_mm baseline of
``make gpu-check`` and its "unavailable" path (the smoke run of every chapter is tests/test_gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

import kernel_ladder
from bench import ch09_moe
from bench.gpu import Check, Timing
from solutions import ch09_moe as solutions


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("experts, top_k, renormalize, skew", [(4, 2, True, 0.0), (8, 3, False, 3.0)])
def test_grouped_mm_composition_matches_the_loop_over_experts(experts, top_k, renormalize, skew):
    a = ch09_moe.moe_inputs("cpu", torch.bfloat16, (37, 32, 16), experts, seed=3, skew=skew)
    assert ch09_moe.grouped_mm_unavailable(*a, top_k=top_k) == ""
    got = ch09_moe.grouped_mm_moe(*a, top_k, renormalize)
    want = solutions.experts_loop(*(t.float() for t in a), top_k, renormalize)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_gpu_checks_mark_grouped_mm_unavailable_without_it(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    entries = ch09_moe.gpu_checks("smoke")
    (timing,) = [e for e in entries if isinstance(e, Timing) and "_grouped_mm" in e.impl]
    assert timing.unavailable == f"torch {torch.__version__} has no torch._grouped_mm"
    assert not any("_grouped_mm" in e.op for e in entries if isinstance(e, Check))  # nothing to check it with
    assert any(e.impl == "kernel_ladder.moe" and not e.unavailable for e in entries if isinstance(e, Timing))


def test_block_sparse_ideal_counts_each_allowed_tile_once():
    q, k, v, mask = ch09_moe.bsa_inputs(kernel_ladder.runtime.DEVICE, torch.float32, "cpu")
    out = torch.empty_like(q)
    tiles = ch09_moe.visited_tiles(q, mask)
    block = q.shape[2] // mask.shape[-1]
    expected = 2 * q.numel() * 4 + q.shape[0] * q.shape[1] * q.shape[2] * 4 + tiles * block * 2 * q.shape[3] * 4
    assert ch09_moe.block_sparse_ideal(q, k, v, mask, out, block) == expected
