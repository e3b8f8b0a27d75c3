"""bench.ch11_distributed: the all-reduce ladder's counted bytes equal the α–β model's, its results
equal torch's, and the α–β fit recovers a known latency and bandwidth."""

from __future__ import annotations

import math

import pytest

from bench import ch11_distributed as B

pytestmark = pytest.mark.timeout(300)


def test_a_small_run_counts_the_model_bytes_and_matches_torch(tmp_path):
    rows = B.collect(4, (64, 1000), repeats=1)
    ops = {r.op for r in rows}
    assert ops == {*B.ALL_REDUCES, *B.RING, "torch.all_reduce", "torch.reduce_scatter", "torch.all_gather"}
    ours = [r for r in rows if not r.op.startswith("torch.")]
    assert all(r.counted_matches_model for r in ours), [(r.op, r.n, r.busiest_bytes, r.model_bytes) for r in ours]
    assert all(r.max_error < 1e-5 for r in ours) and all(r.seconds > 0 for r in rows)
    by = {(r.op, r.n): r.busiest_bytes for r in ours}
    n = 1000  # a multiple of 4: the ladder's predictions, exactly
    assert by[("star_all_reduce", n)] == 3 * n * 4  # rank 0 sends p - 1 whole tensors
    assert by[("tree_all_reduce", n)] == 2 * n * 4  # the root's two broadcast children
    assert by[("ring_all_reduce", n)] == 2 * 3 / 4 * n * 4  # 2 (p - 1) / p of the tensor
    fits = {4: B.fit_alpha_beta(rows, 4)}
    out = tmp_path / "results.md"
    B.write(rows, fits, "test machine", out)
    text = out.read_text()
    assert B.BEGIN in text and B.END in text and "| `ring_all_reduce` | 4 | 3.90625 KiB |" in text
    assert f"Counted bytes equal to the model: {len(ours)} of {len(ours)}." in text


def test_a_wrong_count_is_flagged():  # negative control: a row off its model is not passed
    row = B.CollectiveRow("ring_all_reduce", 4, 1000, busiest_bytes=4000, model_bytes=6000.0, max_error=0.0,
                          seconds=1e-3)
    assert row.counted_matches_model is False


def test_the_fit_recovers_a_known_alpha_and_bandwidth():
    alpha, bandwidth = 50e-6, 2e9
    rows = []
    for n in (256, 4096, 65536, 2**20):
        sent = 2 * 3 / 4 * n * 4
        rows.append(B.CollectiveRow("ring_all_reduce", 4, n, int(sent), sent, 0.0,
                                    B.messages("ring_all_reduce", 4) * alpha + sent / bandwidth))
    got_alpha, got_bandwidth = B.fit_alpha_beta(rows, 4)
    assert math.isclose(got_alpha, alpha, rel_tol=1e-6) and math.isclose(got_bandwidth, bandwidth, rel_tol=1e-6)
