"""Block-sparse attention, forward and backward, as ``kernel_ladder::block_sparse_attention``.

Attention in SDPA's ``(B, H, T, D)`` layout where a boolean ``block_mask`` says which
``block_size x block_size`` tiles of the ``Tq x Tk`` score matrix exist: query block ``i`` of
``(b, h)`` sees key block ``j`` iff ``block_mask[b, h, i, j]`` (a batch or head dim of 1 broadcasts).
Inside an allowed tile every entry is visible; outside, none is. The sliding-window, global and
random patterns of Longformer (Beltagy et al. 2020) and BigBird (Zaheer et al. 2020) are such
masks (:func:`sliding_window_mask`, :func:`bigbird_mask`).

**The work is proportional to the mask's density.** The kernels are flash attention's own
(:mod:`kernel_ladder.ops.attention`), run with their ``BLOCK_SPARSE`` switch: a program's key loop
does not walk a range of consecutive blocks but reads the next block index from a per-row list, so
it visits exactly the allowed blocks — no loop over all blocks with a skip branch, and no K/V load
for a skipped block. The tiles are the mask's blocks (``BLOCK_M = BLOCK_N = block_size``), so a
visited tile is a whole allowed block and FLOPs and K/V bytes are ``density x`` the dense ones.

**The lists (a padded CSR), built on the device with no host synchronization.** For each row of
the mask (a query block of one batch and head)::

    counts[b, h, i]  = block_mask[b, h, i, :].sum()                      (int32)
    indices[b, h, i] = argsort(~block_mask[b, h, i, :], stable=True)     (int32)

A stable sort of ``~mask`` puts the allowed blocks first, in ascending order, then the others; the
kernel reads only the first ``counts`` entries. This is a CSR whose rows are padded to the number of
key blocks (the same size as the mask, in int32), so no ``torch.nonzero`` (whose output size is
data-dependent, a host sync) and no ``cumsum`` of row offsets is needed: the row's list starts at a
fixed offset. Ascending order makes the key loop walk K/V forward, as the dense kernel does.

**Backward.** The dQ program of a query block walks the same list as the forward. The dK/dV
program of a key block needs the query blocks that attend to it: the transposed lists, the same
construction on ``block_mask.transpose(-1, -2)`` (for grouped-query attention, one list per query
head of the group, summed inside the program as in flash attention). Both are rebuilt in the
backward op from the mask (cheap: one sort of a mask-sized tensor), so the forward saves only what
flash attention saves (``out`` and ``lse``).

**Empty rows.** A query block whose row allows no key block outputs 0 and ``lse = -inf`` (flash
attention's convention for a row that sees no key); its gradient is 0.

**Tiles.** ``block_size`` in {16, 32, 64, 128}: one fixed configuration per block size (no
autotuning: the tile is the mask's block), 4 warps (8 for 128), 2 pipeline stages on a GPU.
"""

from __future__ import annotations

import torch

from .. import _launch, runtime
from .._validate import check_attention_options, check_bool, check_same_device, check_tensor, schema_types
from .._validate import is_int as _is_int
from .attention.configs import AttentionConfig
from .attention.launch import _backward, _forward
from .attention.op import _output_gradients
from .attention.problem import BlockLists, _check_tensors, _dense_problem, _Problem, _scale

__all__ = ["BLOCK_SIZES", "bigbird_mask", "block_lists", "block_sparse_attention", "sliding_window_mask"]

_OP = "kernel_ladder.block_sparse_attention"

#: The block sizes the kernels take (the tiles are the blocks; 16 is ``tl.dot``'s smallest).
BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128)


def _config(block_size: int) -> AttentionConfig:
    """The tile of every kernel at ``block_size``: the mask's block on both sides."""
    if runtime.INTERPRETER:
        return AttentionConfig(block_size, block_size, 4, 1)
    return AttentionConfig(block_size, block_size, 8 if block_size >= 128 else 4, 2)


def block_lists(block_mask: torch.Tensor, block_size: int) -> BlockLists:
    """Each row's allowed blocks of a ``(Bm, Hm, R, C)`` bool mask: counts ``(Bm, Hm, R)`` and, first in
    each row of ``indices`` ``(Bm, Hm, R, C)``, their indices in ascending order (see the module).

    A batch or head dim that is broadcast in memory (stride 0, ``expand``) is sorted once, not per copy.
    All torch ops on the mask's device, no host synchronization.
    """
    if block_mask.dim() == 4:
        if block_mask.shape[0] > 1 and block_mask.stride(0) == 0:
            block_mask = block_mask[:1]
        if block_mask.shape[1] > 1 and block_mask.stride(1) == 0:
            block_mask = block_mask[:, :1]
    counts = block_mask.sum(-1, dtype=torch.int32)
    indices = torch.sort((~block_mask).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return BlockLists(counts.contiguous(), indices.contiguous(), _config(block_size))


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _check(q, k, v, block_mask, block_size, softmax_scale, return_lse) -> None:
    _check_tensors(_OP, q, k, v, 4, "(B, H, T, D)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{_OP}: q and k must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    check_bool(_OP, "return_lse", return_lse)
    check_attention_options(_OP, softmax_scale, None, None)
    if not _is_int(block_size):
        raise TypeError(f"{_OP}: block_size must be an int, one of {BLOCK_SIZES}, got {type(block_size).__name__}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{_OP}: block_size must be one of {BLOCK_SIZES} (the kernels' tile), got {block_size}")
    check_tensor(_OP, "block_mask", block_mask)
    if block_mask.dtype != torch.bool:
        raise TypeError(f"{_OP}: block_mask must be a bool tensor (True: the block is attended), got "
                        f"{block_mask.dtype}; convert with .bool()")
    check_same_device(_OP, "q", q, "block_mask", block_mask)
    batch, heads, seqlen_q, _ = q.shape
    expected = (_blocks(seqlen_q, block_size), _blocks(k.shape[2], block_size))
    if (block_mask.dim() != 4 or block_mask.shape[0] not in (1, batch) or block_mask.shape[1] not in (1, heads)
            or tuple(block_mask.shape[2:]) != expected):
        raise ValueError(f"{_OP}: block_mask must be (B or 1, H or 1, ceil(Tq / block_size), ceil(Tk / block_size)) "
                         f"= ({batch} or 1, {heads} or 1, {expected[0]}, {expected[1]}) for q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)} and block_size {block_size}; got {tuple(block_mask.shape)}")


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _problem(q, k, softmax_scale) -> _Problem:
    return _dense_problem(q, k, False, softmax_scale, None, None)


@torch.library.custom_op("kernel_ladder::block_sparse_attention", mutates_args=())
def _block_sparse_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor,
                               block_size: int, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out ``(B, H, Tq, D)`` in q's dtype, lse ``(B, H, Tq)`` float32."""
    _check(q, k, v, block_mask, block_size, softmax_scale, False)
    runtime.require_launchable(_OP, q, k, v, block_mask)
    batch, heads, seqlen_q, head_dim = q.shape
    out = _launch.empty_output((batch, heads, seqlen_q, head_dim), q)
    lse = _launch.empty((batch, heads, seqlen_q), torch.float32, q.device)
    _forward(_problem(q, k, softmax_scale), q, k, v, out, lse, lse, lse, blocks=block_lists(block_mask, block_size))
    return out, lse


@_block_sparse_attention_op.register_fake
def _block_sparse_attention_fake(q, k, v, block_mask, block_size, softmax_scale):
    _check(q, k, v, block_mask, block_size, softmax_scale, False)
    batch, heads, seqlen_q, head_dim = q.shape
    return (_launch.empty_output((batch, heads, seqlen_q, head_dim), q),
            _launch.empty_output((batch, heads, seqlen_q), q, torch.float32))


@torch.library.custom_op("kernel_ladder::block_sparse_attention_backward", mutates_args=())
def _block_sparse_attention_backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, block_mask: torch.Tensor, block_size: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, new contiguous tensors of q's, k's and v's shapes."""
    runtime.require_launchable(f"{_OP} (backward)", grad_out, q, k, v, out, lse, block_mask)
    dq, dk, dv = _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)
    _backward(_problem(q, k, softmax_scale), grad_out, grad_lse, q, k, v, out, lse, lse, lse, dq, dk, dv,
              rows=block_lists(block_mask, block_size),
              cols=block_lists(block_mask.transpose(-1, -2), block_size))
    return dq, dk, dv


@_block_sparse_attention_backward_op.register_fake
def _block_sparse_attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, block_mask, block_size,
                                          softmax_scale):
    return _launch.empty_output(q.shape, q), _launch.empty_output(k.shape, k), _launch.empty_output(v.shape, v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, block_mask, block_size, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, block_mask)
    ctx.options = (block_size, softmax_scale)
    ctx.set_materialize_grads(False)  # no zeros for an output the loss does not use


def _backward_formula(ctx, grad_out, grad_lse):
    if grad_out is None and grad_lse is None:
        return None, None, None, None, None, None
    q, k, v, out, lse, block_mask = ctx.saved_tensors
    grad_out, grad_lse = _output_gradients(ctx, grad_out, grad_lse, out)
    dq, dk, dv = _block_sparse_attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, block_mask, *ctx.options)
    return dq, dk, dv, None, None, None


_block_sparse_attention_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# The public function
# ----------------------------------------------------------------------------------------------


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int = 64,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(scale * q k^T + mask) v`` over the allowed blocks of ``block_mask`` only.

    Args:
        q: float32, float16 or bfloat16 queries ``(B, H, Tq, D)``, any strides, ``D <= 256``.
        k, v: keys and values ``(B, Hkv, Tk, D)``, q's dtype; ``H`` a multiple of ``Hkv`` (grouped-query
            attention as in :func:`kernel_ladder.flash_attention`).
        block_mask: bool ``(B or 1, H or 1, ceil(Tq / block_size), ceil(Tk / block_size))``: query block
            ``i`` sees key block ``j`` iff True (a dim of 1, or a stride-0 ``expand``, broadcasts over
            batch or heads). The last blocks may be partial (``T`` need not be a multiple).
        block_size: the blocks' side, one of 16, 32, 64, 128 (also the kernels' tile).
        softmax_scale: the scale of ``q k^T``; ``None`` for ``1 / sqrt(D)``.
        return_lse: also return each row's log-sum-exp over its visible keys.

    Returns:
        ``out``, a new contiguous ``(B, H, Tq, D)`` tensor of q's dtype, or ``(out, lse)`` with ``lse``
        ``(B, H, Tq)`` float32. Rows whose mask row allows no block give 0 and ``lse = -inf``.
        Differentiable in q, k and v (``kernel_ladder::block_sparse_attention_backward``, deterministic).
        FLOPs and K/V traffic are the mask's density times the dense ones.
    """
    if not (schema_types(tensors=(q, k, v, block_mask), ints=(block_size,), optional_reals=(softmax_scale,),
                         flags=(return_lse,)) and q.dim()):
        _check(q, k, v, block_mask, block_size, softmax_scale, return_lse)  # the op checks values
    scale = _scale(softmax_scale, q.shape[-1])
    out, lse = _block_sparse_attention_op(q, k, v, block_mask, int(block_size), scale)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Mask builders
# ----------------------------------------------------------------------------------------------


def sliding_window_mask(num_q_blocks: int, num_k_blocks: int, window_blocks: int, global_blocks: int = 0,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """A Longformer-style ``(1, 1, num_q_blocks, num_k_blocks)`` bool block mask.

    Query block ``i`` sees the ``window_blocks`` key blocks ending at its diagonal block
    ``d = i + num_k_blocks - num_q_blocks`` (bottom-right aligned, like ``flash_attention``'s causal:
    ``d - window_blocks < j <= d``), plus the first ``global_blocks`` key blocks; the first
    ``global_blocks`` query blocks (global tokens) see every key block. The diagonal block itself is
    whole: causality inside it is not expressed (the mask is per block).
    """
    if window_blocks < 0 or global_blocks < 0:
        raise ValueError("kernel_ladder.ops.block_sparse_attention.sliding_window_mask: window_blocks and "
                         f"global_blocks must be >= 0, got {window_blocks} and {global_blocks}")
    i = torch.arange(num_q_blocks, device=device)[:, None]
    j = torch.arange(num_k_blocks, device=device)[None, :]
    diagonal = i + num_k_blocks - num_q_blocks
    mask = (j <= diagonal) & (j > diagonal - window_blocks)
    mask |= j < global_blocks
    mask |= i < global_blocks
    return mask[None, None]


def bigbird_mask(num_q_blocks: int, num_k_blocks: int, window_blocks: int = 3, global_blocks: int = 1,
                 random_blocks: int = 2, num_heads: int = 1, seed: int = 0,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """A BigBird-style ``(1, num_heads, num_q_blocks, num_k_blocks)`` bool block mask.

    :func:`sliding_window_mask` (window and global blocks), plus for every query block and head
    ``random_blocks`` distinct key blocks drawn uniformly (fewer if the row has fewer keys) from a
    CPU ``torch.Generator`` seeded with ``seed``, so the same arguments give the same mask anywhere.
    """
    mask = sliding_window_mask(num_q_blocks, num_k_blocks, window_blocks, global_blocks).expand(
        1, num_heads, num_q_blocks, num_k_blocks).clone()
    picks = min(random_blocks, num_k_blocks)
    if picks > 0 and num_q_blocks > 0:
        gen = torch.Generator().manual_seed(seed)
        keys = torch.rand((1, num_heads, num_q_blocks, num_k_blocks), generator=gen)
        chosen = keys.argsort(dim=-1)[..., :picks]  # a random permutation's first picks: distinct blocks
        mask.scatter_(-1, chosen, True)
    return mask.to(device) if device is not None else mask
