"""The report's registry: every chapter's ladder of implementations, measured the same way.

A :class:`Ladder` is one operator at one problem size with its steps, naive to top. For every
step the report checks the output against a float64 reference, counts the bytes and FLOPs it
moves (``utils.trace``), compares them with the ideal (each input read once, each output written
once), models the time on a named GPU (``utils.roofline``), and — on a GPU only — measures it.

Chapters register ladders in ``bench/chNN_topic.py`` modules, listed in :data:`CHAPTER_MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

#: What a production forward kernel may move at most, as a multiple of the ideal bytes.
FORWARD_BOUND = 1.05

#: Modules that register ladders, in chapter order. A new chapter adds its module here.
CHAPTER_MODULES = [
    "bench.ch00_gpu_model",
    "bench.ch01_elementwise",
    "bench.ch02_softmax",
    "bench.ch03_normalization",
    "bench.ch04_matmul",
    "bench.ch05_quantization",
    "bench.ch06_fused_ops",
    "bench.ch07_flash_attention",
    "bench.ch08_kv_cache",
    "bench.ch09_moe",
    "bench.ch13_below_triton",
]


@dataclass
class Step:
    """One rung: ``fn(*inputs)`` returns the output (a tensor or a tuple).

    ``baseline`` marks the torch step that speedups refer to.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    baseline: bool = False
    #: Whether to time it on a GPU at the GPU size (a Python loop over 2^24 elements is not).
    on_gpu: bool = True
    #: Whether to trace it at the CPU size (a compiled baseline like torch.compile is not).
    on_cpu: bool = True
    #: The most bytes / ideal this step may move at the CPU size; the report fails a step over it
    #: (set for the production forward kernels: :data:`FORWARD_BOUND`).
    bound: float | None = None


@dataclass
class Ladder:
    """An operator's ladder at a CPU size (traced) and a GPU size (timed)."""

    chapter: str
    op: str
    #: make_inputs(device, dtype, size) -> tuple of tensors; size is "cpu" or "gpu".
    make_inputs: Callable[[torch.device, torch.dtype, str], tuple]
    #: reference(*inputs) -> expected output (a tensor or a tuple of them), computed in float64.
    reference: Callable[..., torch.Tensor]
    steps: Sequence[Step]
    dtype: torch.dtype = torch.float32
    note: str = ""
    #: Bytes of the ideal implementation for these inputs and this output (default: all read once,
    #: the output written once).
    ideal_bytes: Callable[..., int] | None = None
    tags: dict = field(default_factory=dict)

    def ideal(self, inputs: tuple, output: torch.Tensor) -> int:
        if self.ideal_bytes is not None:
            return int(self.ideal_bytes(*inputs, output))
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        tensors = [t for t in (*inputs, *outputs) if isinstance(t, torch.Tensor)]
        return int(sum(t.numel() * t.element_size() for t in tensors))


@dataclass
class Figure:
    """A chart the report draws beside the ladders' (for example bytes against the sequence length).

    ``draw(ax)`` measures what it plots (traced, like a ladder), draws it on the matplotlib axes and
    returns a caption stating the numbers; the report saves it as ``docs/img/ch<chapter>_<name>.png``.
    """

    chapter: str
    name: str
    draw: Callable[..., str]


_LADDERS: list[Ladder] = []
_FIGURES: list[Figure] = []


def register(ladder: Ladder) -> Ladder:
    """Add a ladder to the report (called at import by the chapter modules)."""
    _LADDERS.append(ladder)
    return ladder


def register_figure(figure: Figure) -> Figure:
    """Add a figure to the report (called at import by the chapter modules)."""
    _FIGURES.append(figure)
    return figure


def figures(chapters: Sequence[str] | None = None) -> list[Figure]:
    """Every registered figure (importing the chapter modules), optionally only some chapters'."""
    for module in CHAPTER_MODULES:
        importlib.import_module(module)
    return [f for f in _FIGURES if not chapters or any(f.chapter.startswith(c) for c in chapters)]


def ladders(chapters: Sequence[str] | None = None) -> list[Ladder]:
    """Every registered ladder (importing the chapter modules), optionally only some chapters."""
    for module in CHAPTER_MODULES:
        importlib.import_module(module)
    if not chapters:
        return list(_LADDERS)
    return [ladder for ladder in _LADDERS if any(ladder.chapter.startswith(c) for c in chapters)]
