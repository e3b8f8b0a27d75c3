"""The course's charts: a roofline, bytes per ladder step, access maps and host time per op.

Each function draws on ``ax`` (or a new figure) and returns the ``Axes``; end the notebook cell
with ``plt.show()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from utils.roofline import arithmetic_intensity, dtype_key, get_gpu
from utils.trace import format_bytes

__all__ = ["roofline_chart", "bytes_bars", "access_map", "warp_access_chart", "launch_order_chart", "overhead_bars"]

_BYTE_UNITS = (("B", 1.0), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))


def _new_axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    _, ax = plt.subplots(figsize=size)
    return ax


def roofline_chart(points: Sequence[tuple], gpu: Any = "H200", dtype: Any = "bf16", ax: Axes | None = None,
                   title: str | None = None) -> Axes:
    """Log-log roofline of ``gpu`` with each point placed at its arithmetic intensity.

    ``points`` are ``(label, bytes, flops)``: the point sits on the roof (the model's attainable
    performance at that intensity). A fourth element, a measured time in seconds, places it at
    ``flops / time`` instead. A point without FLOPs is drawn at the left edge, marked "no FLOPs".
    """
    spec = get_gpu(gpu)
    key = dtype_key(dtype)
    peak, bandwidth = spec.peak(key), spec.hbm_bytes_per_s
    ridge = peak / bandwidth
    ax = _new_axes(ax, (7, 4.5))

    intensities = [arithmetic_intensity(p[1], p[2]) for p in points]
    finite = [i for i in intensities if 0 < i < math.inf]
    lo = min([ridge / 1000, *(i / 4 for i in finite)])
    hi = max([ridge * 100, *(i * 4 for i in finite)])
    xs = np.logspace(math.log10(lo), math.log10(hi), 256)
    tera = 1e12
    ax.plot(xs, np.minimum(peak, xs * bandwidth) / tera, color="black", linewidth=2,
            label=f"roof: {format_bytes(bandwidth)}/s HBM, {peak / tera:,.0f} TFLOP/s {key}")
    ax.axvline(ridge, color="gray", linestyle=":", linewidth=1)
    ax.plot([ridge], [peak / tera], marker="o", color="gray", linestyle="none",
            label=f"ridge point: {ridge:,.0f} FLOP/byte")

    for point, intensity in zip(points, intensities):
        label = str(point[0])
        x = min(max(intensity, lo), hi)
        if len(point) > 3 and point[3]:
            y, kind = point[2] / point[3], "measured"
        else:
            y, kind = min(peak, x * bandwidth), "model"
        if intensity == 0:
            label += " (no FLOPs)"
        ax.scatter([x], [y / tera], zorder=3, marker="o" if kind == "model" else "*", s=50)
        ax.annotate(label, (x, y / tera), textcoords="offset points", xytext=(6, -12), fontsize=9)

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable performance (TFLOP/s)")
    ax.set_title(title or f"Roofline model — {spec.name}, {key} (datasheet peaks)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return ax


def bytes_bars(steps: Sequence[tuple[str, float]], ideal: float | None = None, ax: Axes | None = None,
               title: str = "Bytes moved per step") -> Axes:
    """Bar per ladder step of the bytes it moves, with the ideal (each input read once, each output
    written once) as a dashed line and each bar labelled with its multiple of the ideal."""
    labels = [str(s[0]) for s in steps]
    values = [float(s[1]) for s in steps]
    top = max([*values, ideal or 0, 1.0])
    unit, scale = next(((u, s) for u, s in reversed(_BYTE_UNITS) if top >= s), _BYTE_UNITS[0])
    ax = _new_axes(ax, (max(4.0, 1.3 * len(steps) + 2), 4))
    bars = ax.bar(range(len(values)), [v / scale for v in values], color="tab:blue")
    for bar, value in zip(bars, values):
        text = format_bytes(value)
        if ideal:
            text += f"\n{value / ideal:.2f}× ideal"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), textcoords="offset points",
                    xytext=(0, 3), ha="center", va="bottom", fontsize=8)
    if ideal:
        ax.axhline(ideal / scale, color="black", linestyle="--", linewidth=1, label=f"ideal: {format_bytes(ideal)}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20 if max(map(len, labels), default=0) > 10 else 0,
                  ha="right" if max(map(len, labels), default=0) > 10 else "center")
    ax.set_ylabel(f"bytes moved ({unit})")
    ax.set_ylim(0, top / scale * 1.25)
    ax.set_title(title)
    return ax


def access_map(access: Any, shape: tuple[int, ...] | None = None, ax: Axes | None = None,
               title: str = "Which program touched each element") -> Axes:
    """Colour every element by the id of the program that touched it; white = never touched.

    ``access`` is a ``Launch.access[name]`` array (or any int array / tensor of program ids, -1 for
    none). ``shape`` reshapes it; 1-D maps are drawn as one row, >2-D as rows of the last dim.
    """
    if hasattr(access, "detach"):
        access = access.detach().cpu().numpy()
    ids = np.asarray(access)
    if shape is not None:
        ids = ids.reshape(shape)
    if ids.ndim == 0:
        ids = ids.reshape(1, 1)
    elif ids.ndim == 1:
        ids = ids[None, :]
    elif ids.ndim > 2:
        ids = ids.reshape(-1, ids.shape[-1])
    programs = max(int(ids.max(initial=-1)) + 1, 1)
    base = "tab10" if programs <= 10 else "tab20" if programs <= 20 else "viridis"
    cmap = matplotlib.colormaps[base].resampled(programs).with_extremes(bad="white")
    rows, cols = ids.shape
    ax = _new_axes(ax, (min(10.0, max(4.0, cols / 4)), min(6.0, max(1.5, rows / 4 + 1))))
    image = ax.imshow(np.ma.masked_less(ids, 0), cmap=cmap, vmin=-0.5, vmax=programs - 0.5,
                      interpolation="nearest", aspect="auto" if rows == 1 else "equal")
    colorbar = ax.figure.colorbar(image, ax=ax)
    colorbar.set_label("program id")
    if programs <= 20:
        colorbar.set_ticks(range(programs))
    ax.set_xlabel("column (element index)" if rows == 1 else "column")
    ax.set_ylabel("row")
    if rows == 1:
        ax.set_yticks([])
    ax.set_title(title)
    return ax


def warp_access_chart(request: Any, ax: Axes | None = None, title: str | None = None) -> Axes:
    """A warp request as a picture: 32 lanes on top, the sectors they touch below, one line per lane.

    ``request`` is a :class:`utils.coalescing.WarpRequest`. Only sectors that are fetched are
    drawn, in address order; a gap marks skipped memory. Each sector box is filled in proportion
    to the bytes of it the lanes use, and brackets group the sectors into 128-byte lines.
    """
    from matplotlib.patches import Rectangle

    from utils.coalescing import LINE_BYTES, SECTOR_BYTES

    ax = _new_axes(ax, (10, 3))
    lanes = request.addresses.size
    sectors = [int(s) for s in request.sectors]
    gap = 0.35
    # x position of each fetched sector: adjacent sectors touch, a jump leaves a gap
    starts, x = {}, 0.0
    for i, sector in enumerate(sectors):
        if i and sector != sectors[i - 1] + 1:
            x += gap
        starts[sector] = x
        x += 1.0
    scale = lanes / max(x, 1.0)  # the sector row spans the same width as the lanes
    useful = np.unique(np.concatenate([np.arange(a, a + request.bytes_per_lane)
                                       for a, on in zip(request.addresses, request.active) if on])
                       ) if request.lanes else np.empty(0, dtype=np.int64)
    used_per_sector = {s: int(np.count_nonzero(useful // SECTOR_BYTES == s)) for s in sectors}
    for lane in range(lanes):
        color = "tab:blue" if request.active[lane] else "lightgray"
        ax.add_patch(Rectangle((lane + 0.05, 1.6), 0.9, 0.5, facecolor=color, edgecolor="black", linewidth=0.5))
        if request.active[lane]:
            address = int(request.addresses[lane])
            sector = address // SECTOR_BYTES
            target = (starts[sector] + (address % SECTOR_BYTES + request.bytes_per_lane / 2) / SECTOR_BYTES) * scale
            ax.plot([lane + 0.5, target], [1.6, 0.75], color="tab:blue", linewidth=0.6, alpha=0.8)
    for sector in sectors:
        left, width = starts[sector] * scale, scale
        ax.add_patch(Rectangle((left, 0.25), width, 0.5, facecolor="white", edgecolor="black", linewidth=0.8))
        ax.add_patch(Rectangle((left, 0.25), width * used_per_sector[sector] / SECTOR_BYTES, 0.5,
                               facecolor="tab:orange", alpha=0.8, linewidth=0))
    per_line = LINE_BYTES // SECTOR_BYTES
    lines = sorted({s // per_line for s in sectors})
    for line in lines:
        members = [s for s in sectors if s // per_line == line]
        left = starts[members[0]] * scale
        right = (starts[members[-1]] + 1) * scale
        ax.plot([left + 0.05, left + 0.05, right - 0.05, right - 0.05], [0.2, 0.1, 0.1, 0.2],
                color="gray", linewidth=0.8)
    ax.text(-0.5, 1.85, "lanes", ha="right", va="center", fontsize=8)
    ax.text(-0.5, 0.5, "sectors", ha="right", va="center", fontsize=8)
    ax.set_xlim(-4, lanes + 0.5)
    ax.set_ylim(-0.1, 2.3)
    ax.axis("off")
    sectors_text = f"{request.sectors.size} sector{'' if request.sectors.size == 1 else 's'}"
    lines_text = f"{request.lines.size} line{'' if request.lines.size == 1 else 's'}"
    ax.set_title(title or f"{sectors_text} in {lines_text}, {request.efficiency:.0%} of fetched bytes used",
                 fontsize=10)
    return ax


def launch_order_chart(pid_m: Any, pid_n: Any, concurrent: int | None = None, ax: Axes | None = None,
                       title: str = "Launch order on the output grid", numbers: bool | None = None) -> Axes:
    """The output tile grid, each tile labelled with the program id that computes it.

    ``pid_m[pid], pid_n[pid]`` is program ``pid``'s tile (``utils.l2cache.program_order``). With
    ``concurrent``, tiles are coloured by the wave of that many programs they run in; else by
    launch position.
    """
    pid_m, pid_n = np.asarray(pid_m), np.asarray(pid_n)
    grid_m, grid_n = int(pid_m.max()) + 1, int(pid_n.max()) + 1
    order = np.full((grid_m, grid_n), -1, dtype=np.int64)
    order[pid_m, pid_n] = np.arange(pid_m.size)
    ax = _new_axes(ax, (min(8.0, 1.0 + grid_n * 0.45), min(8.0, 0.8 + grid_m * 0.45)))
    if concurrent:
        waves = order // concurrent
        count = int(waves.max()) + 1
        cmap = matplotlib.colormaps["tab20" if count <= 20 else "viridis"].resampled(count)
        image = ax.imshow(waves, cmap=cmap, vmin=-0.5, vmax=count - 0.5, interpolation="nearest")
        colorbar = ax.figure.colorbar(image, ax=ax)
        colorbar.set_label(f"wave ({concurrent} programs at a time)")
        if count <= 20:
            colorbar.set_ticks(range(count))
    else:
        image = ax.imshow(order, cmap="viridis", interpolation="nearest")
        ax.figure.colorbar(image, ax=ax).set_label("launch position (program id)")
    if numbers is None:
        numbers = grid_m * grid_n <= 256
    if numbers:
        for m in range(grid_m):
            for n in range(grid_n):
                ax.text(n, m, str(order[m, n]), ha="center", va="center", fontsize=7 if grid_n <= 12 else 5,
                        color="black")
    ax.set_xlabel("tile column (pid_n)")
    ax.set_ylabel("tile row (pid_m)")
    ax.set_title(title, fontsize=10)
    return ax


def overhead_bars(items: Sequence[tuple], floor: float | None = None, goal: float | None = None,
                  ax: Axes | None = None, title: str = "Host time per forward call (launches skipped)") -> Axes:
    """Horizontal bar per op of its host time per call in microseconds.

    ``items`` are ``(op, kernels_us)`` or ``(op, kernels_us, torch_us)``: the kernel_ladder op's bar, and
    torch's own eager op on the same input as a thin grey bar beside it (left out where None).
    ``floor`` (the cheapest possible custom op) and ``goal`` are drawn as vertical lines. The axis
    is logarithmic when the bars span more than a factor of 30.
    """
    labels = [str(item[0]) for item in items]
    ours = [float(item[1]) for item in items]
    theirs = [item[2] if len(item) > 2 else None for item in items]
    ax = _new_axes(ax, (7.5, max(3.0, 0.32 * len(items) + 1.2)))
    ys = np.arange(len(items))
    ax.barh(ys - 0.18, ours, height=0.36, color="tab:blue", label="kernel_ladder (host only)")
    torch_ys = [y for y, t in zip(ys, theirs) if t is not None]
    if torch_ys:
        ax.barh(np.asarray(torch_ys) + 0.18, [t for t in theirs if t is not None], height=0.36,
                color="tab:gray", label="torch eager op")
    if floor is not None:
        ax.axvline(floor, color="black", linestyle=":", linewidth=1.2, label=f"custom-op floor: {floor:.1f} µs")
    if goal is not None:
        ax.axvline(goal, color="tab:red", linestyle="--", linewidth=1.2, label=f"goal: {goal:g} µs")
    values = [v for v in [*ours, *(t for t in theirs if t is not None)] if v > 0]
    if values and max(values) / min(values) > 30:
        ax.set_xscale("log")
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs per call")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return ax
