"""Launch helpers every op imports: the one place for what each launcher needs to know.

* **Allocation.** Every buffer an op allocates — outputs, saved statistics, gradients, fp32
  workspaces — comes from :func:`empty` (usually through :func:`empty_output`). It is the one
  hook the tests replace to poison fresh memory with NaN, so an element a kernel forgets to write
  shows up as NaN. Ops call it as ``_launch.empty_output(...)`` (an attribute looked up at each
  call), never ``from ._launch import empty_output``, so the replacement reaches every op.
* **The machine.** :func:`num_sms` is the GPU's streaming-multiprocessor count, and
  :data:`INTERPRETER_SMS` the count Triton's interpreter acts as (it has no GPU to ask), so the
  CPU runs the same multi-program schedules with few program instances.
* **Index width.** :data:`INT32_MAX` and :func:`needs_int64`: offsets are computed in int32 while
  every one stays below 2**31, else in int64 (the ``INDEX_64`` constexpr every kernel takes).
* **Sizes.** :func:`next_power_of_2` (a block that holds ``n`` columns) and :func:`num_warps_for`
  (the warps rule: enough threads for a tile at a few values per thread).
* **Dims.** :func:`coalesce_dims` merges the dims every operand can walk as one stride, the first
  step of every strided launch (elementwise ops, row ops, matmul's batch dims).
* **Dots.** :func:`dot_input_precision`: TF32 or IEEE for fp32 ``tl.dot``, as torch's flag says.

The host work of a launch is on every call's path, so these helpers are plain integer arithmetic
(Triton's ``cdiv`` and ``next_power_of_2`` are constexpr functions, a few microseconds a call from
the host) and :func:`coalesce_dims` is cached on its shapes and strides (see
``utils/overhead.py`` for how the per-call host time is measured).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import runtime

__all__ = [
    "INT32_MAX",
    "INTERPRETER_SMS",
    "cdiv",
    "coalesce_dims",
    "dot_input_precision",
    "empty",
    "empty_output",
    "needs_int64",
    "next_power_of_2",
    "num_sms",
    "num_warps_for",
    "shape_cache",
]

#: The largest offset an int32 index can hold.
INT32_MAX: int = 2**31 - 1
#: The SM count assumed in Triton's interpreter (defined in :mod:`kernel_ladder.runtime`, the mode's home).
INTERPRETER_SMS: int = runtime.INTERPRETER_SMS


# ----------------------------------------------------------------------------------------------
# Caching the launch plan
# ----------------------------------------------------------------------------------------------


def shape_cache(fn):
    """``functools.lru_cache`` for a pure function of sizes, strides and limits on an op's launch path.

    Keyed on the arguments with their types (``True`` is never answered with a cached ``1``), so
    a caller passes every input of the result, the module limits it reads included. Under
    ``torch.compile`` sizes are symbolic ints, which cannot be hashed: the call then runs uncached
    (an error the function itself raises runs it a second time, harmlessly, and is raised).
    """
    cached = functools.lru_cache(maxsize=4096, typed=True)(fn)

    @functools.wraps(fn)
    def call(*args):
        try:
            return cached(*args)
        except TypeError:
            return fn(*args)

    call.cache_info, call.cache_clear = cached.cache_info, cached.cache_clear
    return call


# ----------------------------------------------------------------------------------------------
# Allocation: the one hook
# ----------------------------------------------------------------------------------------------


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A fresh contiguous tensor: every buffer an op allocates comes from here (tests poison it)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_output(shape: Sequence[int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous tensor on ``like``'s device, of ``like``'s dtype unless ``dtype`` is given.

    What the fake kernels promise too: outputs are new, contiguous tensors.
    """
    return empty(shape, dtype or like.dtype, like.device)


def empty_in_layout(like: torch.Tensor) -> torch.Tensor:
    """A fresh tensor of ``like``'s shape, dtype and device whose dims lie in memory in ``like``'s order.

    For the gradient of a view: the weight gradient of ``w.transpose(1, 2)`` allocated this way is,
    once autograd transposes it back, contiguous like the parameter itself (a contiguous gradient
    for a contiguous parameter, no copy in ``AccumulateGrad``). Dense outputs in every other case.
    """
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), -like.shape[d]))
    base = empty([like.shape[d] for d in order], like.dtype, like.device)
    inverse = [order.index(d) for d in range(like.dim())]
    return base.permute(inverse)


# ----------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of ``device`` (the current CUDA device if None); the interpreter's
    :data:`INTERPRETER_SMS` in interpreter mode or for a non-CUDA device."""
    if runtime.INTERPRETER or not torch.cuda.is_available():
        return INTERPRETER_SMS
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------
# Sizes and index widths
# ----------------------------------------------------------------------------------------------


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (at least 1): the block that holds ``n`` columns."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``triton.cdiv`` without its constexpr-function call cost)."""
    return -(-a // b)


def num_warps_for(values: int, values_per_thread: int = 16, max_warps: int = 16) -> int:
    """Warps for a tile of ``values`` elements: about ``values_per_thread`` a thread, 4 to ``max_warps``.

    16 values a thread is two 16-byte loads of bf16; the floor of 4 warps keeps small tiles from
    leaving an SM's schedulers idle, the ceiling bounds the registers a program asks for.
    """
    return max(4, min(max_warps, values // (32 * values_per_thread)))


def needs_int64(*extents: int) -> bool:
    """Whether any of these element offsets (largest index reached, padding included) passes int32."""
    return any(extent > INT32_MAX for extent in extents)


def dot_input_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: TF32 for fp32 when torch allows it on the GPU, else IEEE.

    fp16/bf16 ignore it. The interpreter always computes in IEEE fp32.
    """
    if dtype == torch.float32 and not runtime.INTERPRETER and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


# ----------------------------------------------------------------------------------------------
# Dims
# ----------------------------------------------------------------------------------------------


def coalesce_dims(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[list[int], list[list[int]]]:
    """Merge dims that every operand can walk as one; drop size-1 dims.

    ``strides[k]`` are operand k's strides over ``shape`` (0 for broadcast dims). Neighbouring
    dims ``d, d+1`` merge when ``stride[d] == stride[d+1] * size[d+1]`` for every operand. Returns
    the merged sizes and each operand's merged strides (outermost first). An empty result means a
    single element.
    """
    sizes, merged = _coalesce(tuple(shape), tuple(map(tuple, strides)))
    return list(sizes), [list(op) for op in merged]


@shape_cache
def _coalesce(shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...]) -> tuple[tuple, tuple]:
    # Pure function of its (hashable) arguments: cached, so a model calling an op with the same
    # shapes every step pays for the merge once.
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for dim, size in enumerate(shape):
        if size == 1:
            continue  # a size-1 dim's stride is never used
        if sizes and all(ops[-1] == op_strides[dim] * size for ops, op_strides in zip(merged, strides)):
            sizes[-1] *= size
            for ops, op_strides in zip(merged, strides):
                ops[-1] = op_strides[dim]
        else:
            sizes.append(size)
            for ops, op_strides in zip(merged, strides):
                ops.append(op_strides[dim])
    return tuple(sizes), tuple(tuple(op) for op in merged)
