"""bench.overhead (``make report``'s host-overhead table): it measures, writes between its markers, and
leaves the value-check policy as it found it."""

from __future__ import annotations

import pytest
import torch

import kernel_ladder
from bench import overhead as bo


@pytest.fixture(scope="module")
def measured():
    before = kernel_ladder.runtime.values_checked()
    rows, floor = bo.run(["gelu", "softmax", "moe_permute"], number=2, repeat=1, warmup=1)
    assert kernel_ladder.runtime.values_checked() == before, "bench.overhead left the value-check policy changed"
    return rows, floor


def test_rows_are_measured_with_launches_counted(measured):
    rows, floor = measured
    assert [r.op for r in rows] == ["gelu", "softmax", "moe_permute"]
    assert floor.median_us > 0
    gelu, softmax, permute = rows
    assert gelu.family == "elementwise" and softmax.family == "rows" and permute.family == ""
    assert gelu.launches == 1 and gelu.backward_launches == 2  # the forward, then forward + backward
    assert permute.backward_us is None and permute.meets_goal is None
    for r in rows:
        assert r.forward_us > 0 and r.calls is not None and r.calls > 1
        assert r.floor_us > 0 and r.of_floor == pytest.approx(r.forward_us / r.floor_us)
        assert r.meets_goal is None or r.meets_goal == (r.forward_us <= bo.GOAL_US)


def test_value_checks_are_off_while_measuring_and_restored(monkeypatch):
    seen = []
    real = bo.measure

    def spy(case, *args):
        seen.append(kernel_ladder.runtime.values_checked())
        return real(case, *args)

    monkeypatch.setattr(bo, "measure", spy)
    before = kernel_ladder.runtime.values_checked()
    kernel_ladder.runtime.check_values(True)
    try:
        bo.run(["gelu"], number=1, repeat=1, warmup=0)
        assert seen == [False]
        assert kernel_ladder.runtime.values_checked() is True
    finally:
        kernel_ladder.runtime.check_values(before)


def test_an_unknown_op_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"bench.overhead: no op case named \['gleu'\]; known: .*'gelu'"):
        bo.run(["gleu"], number=1, repeat=1, warmup=0)


def test_write_replaces_only_between_the_markers(measured, tmp_path):
    rows, floor = measured
    path = tmp_path / "results.md"
    path.write_text(f"# Results\n\nbefore\n\n{bo.BEGIN}\nold table\n{bo.END}\n\nafter\n")
    bo.write(rows, floor, "a test machine", path)
    text = path.read_text()
    assert text.startswith("# Results\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old table" not in text and text.count(bo.BEGIN) == 1 and text.count(bo.END) == 1
    assert "Machine: a test machine." in text
    assert "| gelu | 1 / 2 |" in text and "| moe_permute | 3 |" in text
    bo.write(rows, floor, "a test machine", path)  # idempotent
    assert path.read_text() == text


def test_write_appends_where_there_are_no_markers(measured, tmp_path):
    rows, floor = measured
    path = tmp_path / "results.md"
    path.write_text("# Results\n\nkept\n")
    bo.write(rows, floor, "m", path)
    text = path.read_text()
    assert text.startswith("# Results\n\nkept\n\n" + bo.BEGIN) and text.rstrip().endswith(bo.END)


def test_the_plot_is_written(measured, tmp_path):
    rows, floor = measured
    path = bo.plot(rows, floor, tmp_path / "img" / "overhead.png")
    assert path.exists() and path.stat().st_size > 1000


def test_the_native_rows_sit_beside_the_triton_op_on_its_input():
    """kernel_ladder.native.rms_norm against the same C++ kernels behind a Python custom_op, and the Triton op."""
    from kernel_ladder import native

    if not native.available():
        pytest.skip("no C++ compiler or ninja: the extension cannot be built")
    names = ["rms_norm", "rms_norm[native]", "rms_norm[native kernel, Python custom_op]"]
    rows, _ = bo.run(names, number=5, repeat=1, warmup=1)
    assert [r.op for r in rows] == names
    triton, cpp, python_op = rows
    assert triton.launches == 1 and cpp.launches == 0 and python_op.launches == 0  # the C++ kernels are no launches
    assert all(r.family == "rows" and r.backward_us is not None and r.torch_us is not None for r in rows)
    # A count, not a time: the C++ op's Python calls are its wrapper's few checks; the custom_op's are
    # torch's Python custom-op machinery, which the floor (a custom op doing nothing) also pays.
    assert cpp.calls < bo.floor_python_calls() <= python_op.calls
    x, w = torch.randn(8, 64), torch.randn(64)
    torch.testing.assert_close(bo.native_custom_op()(x, w), native.rms_norm(x, w))  # the same computation
    assert bo.run(["softmax"], number=1, repeat=1, warmup=0)[0][0].op == "softmax"  # no native row unless named
