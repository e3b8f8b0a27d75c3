"""Context parallelism: ring attention over a sequence split across ranks.

Each of ``p`` ranks holds a slice of the sequence: its queries, keys and values, ``(B, H, T_local,
D)``. Attention needs every query against every key, so the K/V blocks travel around the ring:
in step ``s`` rank ``r`` holds the block of rank ``r − s`` and computes ``kernel_ladder.flash_attention``
of its queries against it while the block it will need next is already on its way
(:func:`kernel_ladder.distributed.collectives.ring_shift`: the transfer overlaps the compute). Each
step gives a partial output and its log-sum-exp; partials merge exactly:

    lse = logaddexp(lse_a, lse_b),   out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse)

The backward runs the same ring with the *final* output and log-sum-exp, so that each block's
``flash_attention_backward`` gives exactly its share of ``dq`` (summed locally) and of its own
``dk``/``dv`` — which travel the ring with the block and arrive back at its owner after a full
turn.

**Layouts.** The sequence is cut into chunks. ``layout="contiguous"``: rank ``r`` holds chunk ``r``
of ``p``. Under a causal mask rank ``r``'s queries see only the keys of ranks ``≤ r``: rank 0 does
half a block of work and rank ``p − 1`` does ``p − ½`` — the ring waits for the slowest.
``layout="zigzag"``: the sequence is cut into ``2p`` chunks and rank ``r`` holds chunks ``r`` and
``2p − 1 − r`` (one early, one late), so every rank does ``2p`` half-chunk blocks of work.
:func:`causal_work` counts it; :func:`zigzag_shard` / :func:`zigzag_unshard` convert layouts.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .collectives import ring_shift

__all__ = ["causal_work", "chunk_ids", "ring_attention", "zigzag_shard", "zigzag_unshard"]

_OP = "kernel_ladder.distributed.ring_attention"
LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(rank: int, world: int, layout: str) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in its local order (``p`` or ``2p`` chunks in all)."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def causal_work(rank: int, world: int, layout: str) -> float:
    """Attention work of ``rank`` under a causal mask, in blocks of (its chunk) x (one chunk): a full
    block counts 1, the diagonal block ½, a block entirely in the future 0."""
    mine = chunk_ids(rank, world, layout)
    total = 0.0
    for owner in range(world):
        for qc in mine:
            for kc in chunk_ids(owner, world, layout):
                total += 1.0 if kc < qc else 0.5 if kc == qc else 0.0
    return total


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zigzag slice of the full sequence ``x`` along ``dim`` (chunks r and 2p − 1 − r)."""
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, "zigzag")], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's zigzag slice (rank order)."""
    world = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * world - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)


def _pairs(q_ids: list[int], k_ids: list[int], causal: bool, q_len: int, k_len: int):
    """``(q slice, k slice, diagonal?)`` for every query-chunk x key-chunk pair with work to do."""
    q_size, k_size = q_len // len(q_ids), k_len // len(k_ids)
    for a, qc in enumerate(q_ids):
        for b, kc in enumerate(k_ids):
            if causal and kc > qc:
                continue
            yield slice(a * q_size, (a + 1) * q_size), slice(b * k_size, (b + 1) * k_size), causal and kc == qc


def _merge(out, lse, part_out, part_lse):
    """Fold a partial (out, lse) into the running one, in place (float32)."""
    new = torch.logaddexp(lse, part_lse)
    old_w = torch.exp(lse - new).nan_to_num(0.0)  # -inf - -inf: nothing seen yet
    out.mul_(old_w.unsqueeze(-1)).add_(part_out.float() * torch.exp(part_lse - new).nan_to_num(0.0).unsqueeze(-1))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group):
        r, p = dist.get_rank(group), dist.get_world_size(group)
        q_ids = chunk_ids(r, p, layout)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(p):
            owner = (r - step) % p
            shift = ring_shift(kv, group, _OP) if step < p - 1 else None  # the next block, in flight
            for qs, ks, diagonal in _pairs(q_ids, chunk_ids(owner, p, layout), causal, q.shape[2], k.shape[2]):
                part_out, part_lse = torch.ops.kernel_ladder.flash_attention(
                    q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], diagonal, scale, None, None)
                _merge(out[:, :, qs], lse[:, :, qs], part_out, part_lse)
            if shift is not None:
                kv = shift.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.layout, ctx.group = causal, scale, layout, group
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, scale = ctx.group, ctx.layout, ctx.causal, ctx.scale
        r, p = dist.get_rank(group), dist.get_world_size(group)
        q_ids = chunk_ids(r, p, layout)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        travelling = [k.contiguous(), v.contiguous(), torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                      torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(p):
            owner = (r - step) % p
            kb, vb, dk, dv = travelling
            for qs, ks, diagonal in _pairs(q_ids, chunk_ids(owner, p, layout), causal, q.shape[2], k.shape[2]):
                dq_part, dk_part, dv_part, _no_sinks = torch.ops.kernel_ladder.flash_attention_backward(
                    grad_out[:, :, qs], None, q[:, :, qs], kb[:, :, ks], vb[:, :, ks], out[:, :, qs], lse[:, :, qs],
                    diagonal, scale, None, None)
                dq[:, :, qs] += dq_part.float()
                dk[:, :, ks] += dk_part.float()
                dv[:, :, ks] += dv_part.float()
            # The block and its gradient accumulators move on; after the last step only the
            # accumulators make one more hop, which brings each block's dk/dv home to its owner.
            if step < p - 1:
                travelling = ring_shift(travelling, group, _OP).wait()
            elif p > 1:
                dk, dv = ring_shift([dk, dv], group, _OP).wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   softmax_scale: float | None = None, group=None, layout: str = "contiguous",
                   return_lse: bool = False):
    """Attention over a sequence split across the ranks of ``group``, the K/V blocks passed around a ring.

    Args:
        q, k, v: this rank's ``(B, H, T_local, D)`` slices (``k``/``v`` may have fewer heads: GQA),
            the same shapes on every rank; chunks in rank order for ``layout="contiguous"``, chunks
            ``r`` and ``2p − 1 − r`` of ``2p`` for ``"zigzag"`` (``T_local`` even).
        causal: the causal mask over the *global* positions.
        softmax_scale: default ``1/sqrt(D)``.
    Returns:
        This rank's output ``(B, H, T_local, D)`` in q's dtype (and the float32 log-sum-exp
        ``(B, H, T_local)`` with ``return_lse``). Differentiable in q, k and v.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_OP}: no process group: call torch.distributed.init_process_group first")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be a 4-D (B, H, T_local, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"{_OP}: layout must be 'contiguous' or 'zigzag', got {layout!r}")
    if k.shape[2] != q.shape[2] and causal:
        raise ValueError(f"{_OP}: a causal ring needs the same T_local for q and k, got {q.shape[2]} and {k.shape[2]}")
    if layout == "zigzag" and (q.shape[2] % 2 or k.shape[2] % 2):
        raise ValueError(f"{_OP}: layout='zigzag' holds two chunks per rank: T_local must be even, got "
                         f"{q.shape[2]}")
    g = dist.group.WORLD if group is None else group
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttention.apply(q, k, v, bool(causal), scale, layout, g)
    return (out, lse) if return_lse else out
