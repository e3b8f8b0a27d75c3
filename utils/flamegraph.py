"""Host-side flame graphs: where the Python side of a launch or a training step spends its time.

A GPU profiler (Nsight Systems, ``torch.profiler``) shows kernels and the gaps between them; what
fills the gaps is Python on the host — argument checks, dispatch, the launcher, a hidden sync.
This module finds it on any machine, in a notebook, with nothing to install:

* :func:`sample` is a context manager that starts a thread which, every ``interval`` seconds,
  reads the stack of the thread that entered it (``sys._current_frames()``) and counts it. A
  stack is a tuple of frames, root first, each labelled ``function (file.py:line)`` where the
  line is the function's first line, so that every sample inside one function folds together;
* the counts are *folded stacks*, the text format that ``flamegraph.pl``, speedscope and
  ``py-spy record -f raw`` all read and write: one line per distinct stack, frames joined by
  ``;``, a space, the count (:func:`fold`, :func:`write_folded`, :func:`read_folded`);
* :func:`hot_frames` ranks frames by *self* samples (the frame was the innermost one: time spent
  in its own code) or *total* samples (it was anywhere on the stack: time spent in it and in what
  it called), so a check can name a hot spot;
* :func:`plot` draws the flame graph with matplotlib: the root at the bottom, each frame a bar as
  wide as its total samples, the widest ones labelled;
* :func:`dispatch_stacks` folds the Python stack at every dispatch of chosen aten ops instead of
  at clock ticks — one count per ``.item()`` (``aten._local_scalar_dense``), say: a flame graph
  of host syncs, which on a CPU cost nothing and so never show up in a time-sampled graph;
* :func:`py_spy_record` uses ``py-spy`` (``pip install py-spy``) where it is installed and allowed
  to read another process (it needs ptrace rights): it also sees native frames and other threads.

A sampler in the profiled process has a cost: the sampling thread needs the GIL, so samples land
where the main thread releases it (every bytecode switch interval, which :func:`sample` shortens
while it runs, or in a blocking call). Counts are proportional to time only statistically; a
frame needs many samples before its share means anything.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "HotFrame",
    "Profile",
    "dispatch_stacks",
    "fold",
    "format_hot",
    "frame_label",
    "hot_frames",
    "plot",
    "py_spy_available",
    "py_spy_record",
    "read_folded",
    "sample",
    "write_folded",
]

Stack = tuple[str, ...]


@dataclasses.dataclass
class Profile:
    """Folded stacks and how they were taken.

    ``stacks`` maps a stack (root first) to its count — samples for :func:`sample`, events for
    :func:`dispatch_stacks`. ``interval`` is the sampling period in seconds (None for event counts),
    ``duration`` the wall time the profile covers.
    """

    stacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    interval: float | None = None
    duration: float = 0.0

    @property
    def total(self) -> int:
        """Samples (or events) in all."""
        return sum(self.stacks.values())

    def restricted(self, frame_substring: str) -> Profile:
        """The stacks that pass through a frame containing ``frame_substring``, cut to start at it."""
        kept: collections.Counter = collections.Counter()
        for stack, count in self.stacks.items():
            for i, frame in enumerate(stack):
                if frame_substring in frame:
                    kept[stack[i:]] += count
                    break
        return Profile(kept, self.interval, self.duration)


def frame_label(code: Any) -> str:
    """``function (file.py:first line)`` for a code object: one label per function, ``;``-free."""
    name = getattr(code, "co_qualname", code.co_name)
    label = f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return label.replace(";", ":")


def _stack_of(frame: Any) -> Stack:
    labels = []
    while frame is not None:
        labels.append(frame_label(frame.f_code))
        frame = frame.f_back
    return tuple(reversed(labels))


class _Sampler(threading.Thread):
    def __init__(self, target_ident: int, interval: float, profile: Profile) -> None:
        super().__init__(name="flamegraph-sampler", daemon=True)
        self.target_ident = target_ident
        self.interval = interval
        self.profile = profile
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            frame = sys._current_frames().get(self.target_ident)
            if frame is None:
                continue
            stack = _stack_of(frame)
            # The sampler sees the `with sample()` block's own exit as a few last frames: harmless.
            if stack:
                self.profile.stacks[stack] += 1


@contextlib.contextmanager
def sample(interval: float = 0.001, switch_interval: float | None = 0.0005) -> Iterator[Profile]:
    """Sample the calling thread's Python stack every ``interval`` seconds while the block runs.

    Yields a :class:`Profile` that is filled when the block ends::

        with flamegraph.sample() as profile:
            train_step()
        flamegraph.hot_frames(profile)

    ``switch_interval`` (seconds) temporarily shortens ``sys.setswitchinterval`` so that a
    CPU-bound main thread hands the GIL to the sampler about as often as it asks; None leaves it.
    """
    if interval <= 0:
        raise ValueError(f"utils.flamegraph.sample: interval must be > 0 seconds, got {interval!r}")
    profile = Profile(interval=interval)
    sampler = _Sampler(threading.get_ident(), interval, profile)
    previous = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    start = time.perf_counter()
    sampler.start()
    try:
        yield profile
    finally:
        sampler.stopped.set()
        sampler.join()
        profile.duration = time.perf_counter() - start
        sys.setswitchinterval(previous)


# --------------------------------------------------------------------------------------------
# The folded format
# --------------------------------------------------------------------------------------------


def fold(profile: Profile | collections.Counter) -> list[str]:
    """Folded lines ``root;...;leaf count``, the most frequent stack first (ties by text)."""
    stacks = profile.stacks if isinstance(profile, Profile) else profile
    items = sorted(stacks.items(), key=lambda item: (-item[1], ";".join(item[0])))
    return [f"{';'.join(stack)} {count}" for stack, count in items if count > 0]


def write_folded(profile: Profile, path: str | os.PathLike) -> Path:
    """Write ``profile`` as folded stacks (flamegraph.pl, speedscope and inferno read it)."""
    path = Path(path)
    path.write_text("\n".join(fold(profile)) + "\n")
    return path


def read_folded(path_or_text: str | os.PathLike) -> Profile:
    """A :class:`Profile` from folded stacks: a file's path, or the text itself (it contains a newline)."""
    text = str(path_or_text)
    if "\n" not in text:
        text = Path(path_or_text).read_text()
    stacks: collections.Counter = collections.Counter()
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"utils.flamegraph.read_folded: line {number} is not 'frame;frame;... count': {line!r}")
        stacks[tuple(stack.split(";"))] += int(count)
    return Profile(stacks)


# --------------------------------------------------------------------------------------------
# Reading a profile
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HotFrame:
    """A frame's samples: ``self_count`` as the innermost frame, ``total_count`` anywhere on the stack."""

    frame: str
    self_count: int
    total_count: int
    share: float  # of all samples, by the ranking asked for


def hot_frames(profile: Profile, n: int = 10, by: str = "self", exclude: Sequence[str] = ()) -> list[HotFrame]:
    """The ``n`` frames with the most samples, ``by="self"`` or ``"total"``.

    A frame that appears twice in one stack (recursion) counts once for its total. Frames whose
    label contains any of ``exclude`` are left out of the ranking (not out of the counts).
    """
    if by not in ("self", "total"):
        raise ValueError(f"utils.flamegraph.hot_frames: by must be 'self' or 'total', got {by!r}")
    self_counts: collections.Counter = collections.Counter()
    total_counts: collections.Counter = collections.Counter()
    for stack, count in profile.stacks.items():
        if not stack:
            continue
        self_counts[stack[-1]] += count
        for frame in set(stack):
            total_counts[frame] += count
    ranking = self_counts if by == "self" else total_counts
    everything = max(1, profile.total)
    frames = [f for f in total_counts if not any(e in f for e in exclude)]
    frames.sort(key=lambda f: (-ranking[f], -total_counts[f], f))
    return [HotFrame(f, self_counts[f], total_counts[f], ranking[f] / everything) for f in frames[:n]]


def _layout(stacks: collections.Counter) -> list[tuple[int, float, float, str]]:
    """Bars ``(depth, start, width, frame)``: children in a row above their parent, sorted by name."""
    tree: dict = {}
    for stack, count in stacks.items():
        node = tree
        for frame in stack:
            entry = node.setdefault(frame, [0, {}])
            entry[0] += count
            node = entry[1]
    bars: list[tuple[int, float, float, str]] = []

    def place(node: dict, depth: int, start: float) -> None:
        for frame in sorted(node):
            count, children = node[frame]
            bars.append((depth, start, float(count), frame))
            place(children, depth + 1, start)
            start += count

    place(tree, 0, 0.0)
    return bars


def plot(profile: Profile, ax: Any = None, top: int = 12, title: str | None = None,
         min_share: float = 0.002) -> Any:
    """Draw ``profile`` as a flame graph (root at the bottom); returns the matplotlib axes.

    Each bar is a frame, as wide as its samples; the ``top`` frames by total samples that are not
    the root are labelled where their bars are wide enough, and bars narrower than ``min_share``
    of the whole are not drawn.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.5))
    total = max(1, profile.total)
    bars = [b for b in _layout(profile.stacks) if b[2] / total >= min_share]
    depth_max = max((b[0] for b in bars), default=0)
    labelled = {h.frame for h in hot_frames(profile, n=top, by="total")}
    colours = plt.get_cmap("autumn")
    for depth, start, width, frame in bars:
        colour = colours((hash(frame) % 97) / 140.0)
        ax.barh(depth, width, left=start, height=0.9, color=colour, edgecolor="white", linewidth=0.3)
        if frame in labelled and width / total > 0.06:
            text = frame if len(frame) * 0.009 < width / total else frame.split(" (")[0]
            ax.text(start + width / 2, depth, text, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_xlim(0, total)
    ax.set_ylim(-0.6, depth_max + 0.6)
    unit = "samples" if profile.interval else "events"
    ax.set_xlabel(f"{unit} ({total} in all)")
    ax.set_ylabel("stack depth")
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    return ax


# --------------------------------------------------------------------------------------------
# Stacks at chosen aten ops (host syncs)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def dispatch_stacks(*op_names: str) -> Iterator[Profile]:
    """Count the Python stack at every dispatch of the named aten ops while the block runs.

    ``op_names`` are overload packets as the dispatcher names them, without the namespace's
    ``aten.`` (default: ``"_local_scalar_dense"``, what ``.item()``, ``int(t)``, ``bool(t)`` and a
    tensor in an ``if`` all become: a host sync on a GPU). The profile counts events, one per call,
    and draws as a flame graph like a sampled one.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    wanted = set(op_names or ("_local_scalar_dense",))
    profile = Profile()
    torch_dir = os.path.dirname(torch.__file__) + os.sep

    def caller_frame() -> Any:
        # The innermost frame outside torch's own package: the code that asked for the op.
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
            frame = frame.f_back
        return frame

    class _StackAtOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in wanted:
                stack = _stack_of(caller_frame())
                profile.stacks[(*stack, f"aten.{func.overloadpacket.__name__}")] += 1
            return func(*args, **(kwargs or {}))

    start = time.perf_counter()
    with _StackAtOp():
        yield profile
    profile.duration = time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# py-spy, where it is installed and allowed
# --------------------------------------------------------------------------------------------


def py_spy_available() -> bool:
    """Whether a ``py-spy`` executable is on the PATH (it may still lack ptrace rights)."""
    return shutil.which("py-spy") is not None


def py_spy_record(argv: Sequence[str], output: str | os.PathLike, rate: int = 1000,
                  native: bool = False, timeout: float = 300) -> Profile:
    """Run ``argv`` under ``py-spy record -f raw`` (folded stacks), then read what it wrote.

    Raises ``RuntimeError`` with py-spy's own message when it is missing or fails (commonly: no
    ptrace permission in a container; ``--cap-add SYS_PTRACE`` or running as root fixes that).
    py-spy labels frames ``function (file.py:line)`` with the line sampled, not the function's
    first line: its stacks fold per line.
    """
    exe = shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("utils.flamegraph.py_spy_record: py-spy is not installed (pip install py-spy); "
                           "utils.flamegraph.sample works without it")
    command = [exe, "record", "-f", "raw", "-r", str(rate), "-o", str(output)]
    if native:
        command.append("--native")
    result = subprocess.run([*command, "--", *argv], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 or not Path(output).exists():
        raise RuntimeError(f"utils.flamegraph.py_spy_record: py-spy failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-500:]}")
    return read_folded(output)


def format_hot(frames: Sequence[HotFrame], width: int = 100) -> str:
    """A small table of :func:`hot_frames`' result (frame, self, total), each line within ``width``."""
    lines = [f"{'self':>6} {'total':>6}  frame"]
    for h in frames:
        lines.append(f"{h.self_count:>6} {h.total_count:>6}  {h.frame}"[:width])
    return "\n".join(lines)

