"""utils.plots draws labelled charts and returns their Axes (Agg backend, no display)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.image import AxesImage  # noqa: E402

from utils.plots import access_map, bytes_bars, roofline_chart  # noqa: E402
from utils.roofline import GPUS  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_roofline_chart_is_log_log_with_roof_ridge_and_points():
    points = [("vector add", 12e6, 0), ("matmul 4096", 3 * 4096**2 * 2, 2 * 4096**3), ("softmax", 8e6, 4e6)]
    ax = roofline_chart(points, gpu="H100", dtype="bf16")
    assert isinstance(ax, Axes)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "intensity" in ax.get_xlabel() and "FLOP/s" in ax.get_ylabel()
    assert "model" in ax.get_title() and "H100" in ax.get_title()
    roof = ax.lines[0]
    assert roof.get_ydata().max() == pytest.approx(GPUS["H100"].peak("bf16") / 1e12)
    ridge_x = GPUS["H100"].ridge_point("bf16")
    assert any(np.allclose(line.get_xdata(), [ridge_x]) for line in ax.lines[1:])
    assert sum(isinstance(c, PathCollection) for c in ax.collections) == len(points)
    labels = _texts(ax)
    assert "vector add (no FLOPs)" in labels and "matmul 4096" in labels
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("ridge point" in t for t in legend) and any("roof" in t for t in legend)
    # The matmul is right of the ridge, so it sits on the flat compute roof.
    matmul = ax.collections[1].get_offsets()[0]
    assert matmul[0] > ridge_x and matmul[1] == pytest.approx(GPUS["H100"].peak("bf16") / 1e12)


def test_roofline_chart_measured_point_and_given_axes():
    fig, ax = plt.subplots()
    out = roofline_chart([("measured", 1e6, 1e9, 1e-3)], gpu="A100", dtype="fp16", ax=ax)
    assert out is ax
    assert ax.collections[0].get_offsets()[0][1] == pytest.approx(1e12 / 1e12)


def test_bytes_bars_with_ideal_line_and_ratios():
    steps = [("torch: 3 ops", 36_000_000), ("fused kernel", 12_000_000)]
    ax = bytes_bars(steps, ideal=12_000_000, title="GELU")
    assert isinstance(ax, Axes) and ax.get_title() == "GELU"
    assert len(ax.patches) == 2
    assert [p.get_height() for p in ax.patches] == pytest.approx([36, 12])
    assert ax.get_ylabel() == "bytes moved (MB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["torch: 3 ops", "fused kernel"]
    assert "3.00× ideal" in " ".join(_texts(ax)) and "1.00× ideal" in " ".join(_texts(ax))
    ideal_line = ax.lines[0]
    assert ideal_line.get_linestyle() == "--" and ideal_line.get_ydata()[0] == pytest.approx(12)
    assert len(bytes_bars([("a", 10)]).lines) == 0  # no ideal, no line


def test_access_map_colours_programs_and_leaves_untouched_white():
    access = np.array([[0, 0, 1, 1], [2, 2, -1, -1]], dtype=np.int32)
    ax = access_map(access, title="tiles")
    assert isinstance(ax, Axes) and ax.get_title() == "tiles"
    (image,) = ax.images
    assert isinstance(image, AxesImage)
    data = image.get_array()
    assert data.mask.tolist() == [[False] * 4, [False, False, True, True]]
    rgba = image.to_rgba(data)
    assert tuple(rgba[1, 3]) == (1.0, 1.0, 1.0, 1.0)  # untouched -> white
    assert tuple(rgba[0, 0]) != tuple(rgba[0, 2])  # different programs, different colours
    colorbar_axes = [a for a in ax.figure.axes if a is not ax]
    assert colorbar_axes and colorbar_axes[0].get_ylabel() == "program id"


def test_access_map_accepts_1d_tensors_and_a_shape():
    ax = access_map(torch.tensor([0, 0, 1, 1, -1]))
    assert ax.images[0].get_array().shape == (1, 5)
    ax = access_map(np.arange(6), shape=(2, 3))
    assert ax.images[0].get_array().shape == (2, 3)


def test_overhead_bars_draws_both_bars_floor_and_goal():
    from utils.plots import overhead_bars

    ax = overhead_bars([("gelu", 25.0, 12.0), ("moe", 480.0, None), ("add", 40.0)], floor=15.0, goal=20.0)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["gelu", "moe", "add"]
    widths = sorted(round(p.get_width(), 3) for p in ax.patches)
    assert widths == [12.0, 25.0, 40.0, 480.0]  # three kernels bars, one torch bar (the others have none)
    assert {round(line.get_xdata()[0], 3) for line in ax.lines} == {15.0, 20.0}
    assert ax.get_xscale() == "log"  # 12 to 480 spans more than 30x
    small = overhead_bars([("a", 10.0, 12.0), ("b", 30.0, 5.0)])
    assert small.get_xscale() == "linear" and not small.lines
