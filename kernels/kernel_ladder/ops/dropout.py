"""Dropout with a counter-based RNG, forward and backward, as ``kernel_ladder::dropout``.

Each element draws ``u = tl.rand(seed, i)``, where ``i`` is its logical row-major index in the
tensor, and is kept when ``u >= p`` (probability ``1 - p``), scaled by ``1 / (1 - p)``. Because
the random number is a pure function of (seed, index) — Philox, no state — nothing needs to be
stored for the backward: it recomputes the same mask from the seed, and a strided view gets the
same mask as its contiguous copy. ``u`` lies in [0, 1), so ``p = 0`` keeps everything (times
exactly 1) and ``p = 1`` drops everything (exact zeros, even where x is NaN or inf).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import _launch, runtime
from .._elementwise import block_indices, launch_elementwise, operand_offset
from .._validate import (
    check_bool,
    check_float_dtype,
    check_probability,
    check_seed,
    check_shape,
    check_tensor,
)

__all__ = ["dropout", "dropout_mask", "dropout_kernel", "dropout_mask_kernel"]


@triton.jit
def dropout_kernel(
    x_ptr, out_ptr,                                   # input (any strides), output (contiguous)
    p, scale, seed,                                   # drop probability, 1 / (1 - p), Philox key
    n_elements, index_base, size1, size2, size3,      # the (slice of the) iteration space
    stride_x0, stride_x1, stride_x2, stride_x3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[idx] = x[idx] * scale where tl.rand(seed, index_base + idx) >= p, else 0.

    ``index_base + idx`` is the element's logical row-major index in the whole tensor.
    """
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    x_offset = operand_offset(idx, size1, size2, size3, stride_x0, stride_x1, stride_x2, stride_x3, CONTIGUOUS)
    x = tl.load(x_ptr + x_offset, mask=mask).to(tl.float32)
    # The counter is the element's logical index: the same in every launch layout.
    keep = tl.rand(seed, index_base + idx) >= p
    # Select before scaling: dropped inf/NaN become 0, never 0 * inf.
    out = tl.where(keep, x, 0.0) * scale
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dropout_mask_kernel(
    mask_out_ptr,                                     # the boolean mask (contiguous)
    p, seed,
    n_elements, index_base, size1, size2, size3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr,
):
    """mask_out[idx] = tl.rand(seed, index_base + idx) >= p: the elements dropout_kernel keeps."""
    idx, mask = block_indices(n_elements, INDEX_64, BLOCK)
    keep = tl.rand(seed, index_base + idx) >= p
    tl.store(mask_out_ptr + idx, keep, mask=mask)


def _keep_scale(p: float) -> float:
    # p == 1 keeps nothing; 0 avoids an inf that the kernel would never use anyway.
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


@torch.library.custom_op("kernel_ladder::dropout", mutates_args=())
def _dropout_op(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    op = "kernel_ladder.dropout"
    check_float_dtype(op, "x", x)
    p = check_probability(op, "p", p)
    seed = check_seed(op, "seed", seed)
    runtime.require_launchable(op, x)
    out = _launch.empty_output(x.shape, x)
    launch_elementwise(dropout_kernel, x.shape, [x], [out], (p, _keep_scale(p), seed), with_index_base=True)
    return out


@_dropout_op.register_fake
def _dropout_fake(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    return _launch.empty_output(x.shape, x)


def _dropout_setup_context(ctx, inputs, output) -> None:
    _, ctx.p, ctx.seed = inputs


def _dropout_backward(ctx, grad_out: torch.Tensor):
    # The same mask and scale applied to the gradient: the op is its own backward.
    return _dropout_op(grad_out, ctx.p, ctx.seed), None, None


_dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)


@torch.library.custom_op("kernel_ladder::dropout_mask", mutates_args=())
def _dropout_mask_op(shape: Sequence[int], p: float, seed: int, device: torch.device) -> torch.Tensor:
    op = "kernel_ladder.dropout_mask"
    shape = check_shape(op, "shape", shape)
    p = check_probability(op, "p", p)
    seed = check_seed(op, "seed", seed)
    if torch.device(device).type == "meta":
        raise ValueError(f"{op}: device must hold data (cpu or cuda), got meta; "
                         "under torch.compile or FakeTensorMode the mask's shape comes from the fake kernel")
    mask = _launch.empty(shape, torch.bool, device)
    runtime.require_launchable(op, mask)
    launch_elementwise(dropout_mask_kernel, mask.shape, [], [mask], (p, seed), with_index_base=True)
    return mask


@_dropout_mask_op.register_fake
def _dropout_mask_fake(shape: Sequence[int], p: float, seed: int, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=torch.bool, device=device)


def _draw_seed() -> int:
    """A seed from torch's default (CPU) generator, so ``torch.manual_seed`` makes dropout reproducible.

    A host-side draw, never a device synchronization. Refused while a CUDA graph is captured: the
    seed would be frozen into the graph and every replay would drop the same elements.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kernel_ladder.dropout: seed=None while a CUDA graph is captured would freeze one mask into "
                           "the graph (every replay drops the same elements); pass a seed, e.g. a step counter")
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def dropout(
    x: torch.Tensor, p: float = 0.5, seed: int | None = None, training: bool = True
) -> torch.Tensor:
    """Zero each element of ``x`` with probability ``p``, scale the rest by ``1 / (1 - p)``.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape and strides (not copied).
        p: drop probability in [0, 1]. ``p = 0`` returns an exact copy, ``p = 1`` exact zeros.
        seed: int in [0, 2**63 - 1]; the same seed gives the same mask for the same shape, whatever
            ``x``'s strides or dtype. ``None`` draws one from torch's default (CPU) generator; that
            reads a CPU tensor's value (``.item()``: no device synchronization), which
            ``torch.compile`` may answer with a graph break and a CUDA graph would freeze (refused
            while capturing), so pass a seed in compiled and captured code.
        training: ``False`` returns ``x`` itself, like ``torch.nn.functional.dropout``.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype. Differentiable: the backward
        regenerates the mask from the seed, so no mask is stored.
    """
    op = "kernel_ladder.dropout"
    check_tensor(op, "x", x)
    check_float_dtype(op, "x", x)
    p = check_probability(op, "p", p)
    check_bool(op, "training", training)
    if seed is not None:
        seed = check_seed(op, "seed", seed)
    if not training:
        return x
    if seed is None:
        seed = _draw_seed()
    return _dropout_op(x, p, seed)


def dropout_mask(
    shape: Sequence[int], p: float, seed: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The boolean keep-mask that ``dropout(x, p, seed)`` applies to any ``x`` of ``shape``.

    Args:
        shape: the tensor's shape (a ``torch.Size`` or sequence of ints).
        p: drop probability in [0, 1].
        seed: int in [0, 2**63 - 1], as given to :func:`dropout`.
        device: where to put the mask; defaults to ``kernel_ladder.runtime.DEVICE``.

    Returns:
        A contiguous ``torch.bool`` tensor, True where the element is kept.
    """
    op = "kernel_ladder.dropout_mask"
    shape = check_shape(op, "shape", shape)
    p = check_probability(op, "p", p)
    seed = check_seed(op, "seed", seed)
    device = _check_mask_device(op, device)
    return _dropout_mask_op(list(shape), p, seed, device)


def _check_mask_device(op: str, device: object) -> torch.device:
    """``device`` as a torch.device that holds data and can run the kernels here."""
    if device is None:
        return runtime.DEVICE
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{op}: device must be a torch.device or a name like 'cpu' or 'cuda', got {device!r}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{op}: device {str(device)!r} was asked for, but no CUDA device is visible; "
            f"pass device=None (kernel_ladder.runtime.DEVICE, here {runtime.DEVICE}) or 'cpu'"
        )
    if device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{op}: device must be 'cpu' or 'cuda', got {str(device)!r}")
    return device
