"""Megatron-style tensor parallelism: linears split across ranks, and the vocabulary too.

A transformer's MLP is ``down(act(up(x)))``. Split ``up``'s *output* features across ``p``
ranks (:class:`ColumnParallelLinear`) and ``down``'s *input* features the same way
(:class:`RowParallelLinear`): each rank computes ``act`` on its own slice of the hidden features
and a partial ``down`` product, and one all-reduce sums the partials. Two conjugate operators
carry the communication (the ``f`` and ``g`` of the Megatron-LM paper, Shoeybi et al. 2019,
arXiv:1909.08053), each written here as an autograd function:

* ``f`` = :func:`copy_to_parallel` — forward: identity (the replicated input enters each rank's
  shard); backward: all-reduce (each rank's shard contributed part of the input's gradient).
* ``g`` = :func:`reduce_from_parallel` — forward: all-reduce (sum the partial products);
  backward: identity (the output is replicated, so is its gradient).

So every rank computes the same loss from the replicated output and gets exactly the
single-process gradients for its shards. The local products are ``kernel_ladder.linear``.

The vocabulary splits the same way: :class:`VocabParallelEmbedding` holds rows ``[V·r/p,
V·(r+1)/p)`` of the table (an id outside them reads zeros; the all-reduce of ``g`` fills it in),
and :func:`vocab_parallel_cross_entropy` takes each rank's ``(N, V/p)`` slice of the logits and
never gathers them: the row max and the sum of exponentials are all-reduced (a max and a sum of
``N`` numbers), and so is the target's logit, which lives on one rank.

**Sequence parallelism** (Korthikanti et al. 2022, arXiv:2205.05198): outside the linears — the
norms, dropout, the residual adds — tensor parallelism leaves every rank computing the same thing
on the whole sequence. With ``sequence_parallel=True`` those regions hold ``1/p`` of the
sequence (dim 0) instead: the column-parallel linear all-gathers the sequence on the way in
(:func:`gather_sequence`) and the row-parallel one reduce-scatters it on the way out
(:func:`reduce_scatter_sequence`) — the same bytes as the all-reduce they replace (an all-reduce
is a reduce-scatter plus an all-gather), and ``1/p`` of the activations in those regions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import kernel_ladder

from .collectives import all_gather_into, reduce_scatter_into

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_parallel",
    "gather_from_parallel",
    "gather_sequence",
    "reduce_from_parallel",
    "reduce_scatter_sequence",
    "shard_range",
    "vocab_parallel_cross_entropy",
]


def _world(op: str, group) -> tuple[object, int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: no process group: call torch.distributed.init_process_group first")
    g = dist.group.WORLD if group is None else group
    return g, dist.get_rank(g), dist.get_world_size(g)


def shard_range(n: int, rank: int, world: int, op: str = "kernel_ladder.distributed", what: str = "features") -> range:
    """Rank ``rank``'s slice ``[n·rank/world, n·(rank+1)/world)`` of ``n``; ``world`` must divide ``n``."""
    if n % world:
        raise ValueError(f"{op}: {what} ({n}) must be divisible by the tensor-parallel world size ({world})")
    size = n // world
    return range(rank * size, (rank + 1) * size)


# ----------------------------------------------------------------------------------------------
# f and g
# ----------------------------------------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """Forward: all-gather the last dim in rank order; backward: each rank keeps its slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None


class _SequenceCollective(torch.autograd.Function):
    """The sequence (dim 0) between ranks, a pair of mirror images: ``gather=True`` all-gathers it in
    rank order forward and reduce-scatters the gradient back; ``gather=False`` reduce-scatters
    forward (sum the ranks' partials, keep this rank's rows) and all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, gather):
        ctx.group, ctx.gather = group, gather
        return _gather_rows(x, group) if gather else _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_rows(grad, ctx.group) if ctx.gather else _gather_rows(grad, ctx.group)), None, None


class _SequenceParallelLinear(torch.autograd.Function):
    """Megatron-SP's column-parallel linear: all-gather the sequence, multiply, and keep only this
    rank's rows for the backward — which all-gathers them again for the weight's gradient and
    reduce-scatters the input's gradient. What stays saved between forward and backward is
    ``1/p`` of the input, the point of sequence parallelism."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.save_for_backward(x, weight, bias)
        return kernel_ladder.linear(_gather_rows(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        gathered = _gather_rows(x, ctx.group)  # again: the full input lives only during this backward
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w, grad_b = torch.ops.kernel_ladder.linear_backward(
            grad.contiguous(), gathered, weight, bias, None, "none", need_x, need_w, need_b and bias is not None)
        return (_reduce_scatter_rows(grad_x, ctx.group) if need_x else None, grad_w if need_w else None,
                grad_b if need_b and bias is not None else None, None)


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    p = dist.get_world_size(group)
    if x.shape[0] % p:
        raise ValueError(f"kernel_ladder.distributed: the sequence ({x.shape[0]} rows) must be divisible by the "
                         f"sequence-parallel world size ({p})")
    out = torch.empty((x.shape[0] // p, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x.contiguous(), group)
    return out


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's entry to a tensor-parallel region: all-gather dim 0; backward reduce-scatter."""
    return _SequenceCollective.apply(x, dist.group.WORLD if group is None else group, True)


def reduce_scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's exit: sum the partial products and keep this rank's rows of dim 0."""
    return _SequenceCollective.apply(x, dist.group.WORLD if group is None else group, False)


def copy_to_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToParallel.apply(x, dist.group.WORLD if group is None else group)


def reduce_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward, identity backward."""
    return _ReduceFromParallel.apply(x, dist.group.WORLD if group is None else group)


def gather_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (rank order); the backward splits it back."""
    return _GatherFromParallel.apply(x, dist.group.WORLD if group is None else group)


# ----------------------------------------------------------------------------------------------
# The layers
# ----------------------------------------------------------------------------------------------


class ColumnParallelLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W``'s rows (the output features) split across the ranks in rank order.

    Rank ``r`` holds ``W[out·r/p : out·(r+1)/p]`` and that slice of ``b``. Its input is replicated;
    its output is this rank's slice of the features (``gather_output=False``, the input a
    :class:`RowParallelLinear` expects), or every rank's, concatenated (``gather_output=True``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.out_features, self.gather_output = group, out_features, gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group=None, gather_output: bool = False,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (a copy: ``linear`` is left as it was).

        ``sequence_parallel``: the input is this rank's rows of the sequence (dim 0); it is
        all-gathered on the way in and again in the backward, so only this rank's rows stay saved
        between the two (Megatron-SP); the backward reduce-scatters the input's gradient (the job
        ``f`` does otherwise)."""
        op = "kernel_ladder.distributed.ColumnParallelLinear"
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"{op}.from_linear: linear must be a torch.nn.Linear, got {type(linear).__name__}")
        g, r, p = _world(op, group)
        rows = shard_range(linear.out_features, r, p, op, "out_features")
        w = linear.weight.detach()[rows.start:rows.stop].clone()
        b = None if linear.bias is None else linear.bias.detach()[rows.start:rows.stop].clone()
        return cls(w, b, linear.out_features, g, gather_output, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = _SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)
        else:
            y = kernel_ladder.linear(copy_to_parallel(x, self.group), self.weight, self.bias)
        return gather_from_parallel(y, self.group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W``'s columns (the input features) split across the ranks in rank order.

    Rank ``r`` holds ``W[:, in·r/p : in·(r+1)/p]``; its input is that slice of the features (a
    :class:`ColumnParallelLinear`'s output). The partial products are all-reduced (``g``) and the
    bias, held whole by every rank, is added once after the sum. The output is replicated.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.in_features, self.sequence_parallel = group, in_features, sequence_parallel
        self.weight = torch.nn.Parameter(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group=None, sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's shard of ``linear`` (a copy). ``sequence_parallel``: the partial products are
        reduce-scattered along dim 0 (:func:`reduce_scatter_sequence`) instead of all-reduced, so the
        output is this rank's rows of the sequence."""
        op = "kernel_ladder.distributed.RowParallelLinear"
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"{op}.from_linear: linear must be a torch.nn.Linear, got {type(linear).__name__}")
        g, r, p = _world(op, group)
        cols = shard_range(linear.in_features, r, p, op, "in_features")
        w = linear.weight.detach()[:, cols.start:cols.stop].clone()
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, linear.in_features, g, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = kernel_ladder.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.group)
        else:
            y = reduce_from_parallel(partial, self.group)
        return y if self.bias is None else kernel_ladder.add(y, self.bias)


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows are split across the ranks: rank ``r`` holds ids ``[V·r/p, V·(r+1)/p)``.

    Each rank looks up the ids in its range (the others read zeros) and ``g`` sums the ranks'
    lookups: every rank gets the full ``(..., D)`` embeddings; the table's gradient lands on the
    rank that holds each row.
    """

    def __init__(self, weight: torch.Tensor, num_embeddings: int, vocab_start: int, group=None) -> None:
        super().__init__()
        self.group, self.num_embeddings, self.vocab_start = group, num_embeddings, vocab_start
        self.weight = torch.nn.Parameter(weight)

    @classmethod
    def from_embedding(cls, embedding: torch.nn.Embedding, group=None) -> VocabParallelEmbedding:
        op = "kernel_ladder.distributed.VocabParallelEmbedding"
        if not isinstance(embedding, torch.nn.Embedding):
            raise TypeError(f"{op}.from_embedding: embedding must be a torch.nn.Embedding, "
                            f"got {type(embedding).__name__}")
        g, r, p = _world(op, group)
        rows = shard_range(embedding.num_embeddings, r, p, op, "num_embeddings")
        return cls(embedding.weight.detach()[rows.start:rows.stop].clone(), embedding.num_embeddings, rows.start, g)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = torch.nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return reduce_from_parallel(rows * mine.unsqueeze(-1).to(rows.dtype), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group):
        z = logits.float()
        row_max = z.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z = z - row_max.unsqueeze(-1)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local = target - vocab_start
        valid = target != ignore_index
        mine = valid & (local >= 0) & (local < z.shape[-1])
        safe = torch.where(mine, local, 0)
        target_logit = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        loss = (sum_exp.log() - target_logit) * valid
        count = valid.sum().clamp_min(1)  # the same on every rank: the targets are replicated
        ctx.save_for_backward(exp, sum_exp, safe, mine, valid, count)
        ctx.dtype = logits.dtype
        return loss.sum() / count

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, safe, mine, valid, count = ctx.saved_tensors
        g = exp / sum_exp.unsqueeze(-1)  # this rank's slice of the softmax
        g.scatter_add_(-1, safe.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g = g * (valid.to(g.dtype) * grad / count).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy of ``(N, V)`` logits of which this rank holds columns ``[V·r/p, V·(r+1)/p)``.

    ``logits``: this rank's ``(N, V/p)`` slice (a :class:`ColumnParallelLinear` LM head with
    ``gather_output=False``); ``target``: the ``(N,)`` class ids, the same on every rank. Three
    all-reduces of ``N`` numbers (the row max, the sum of exponentials, the target's logit); the
    ``(N, V)`` logits are never gathered. Rows whose target is ``ignore_index`` count for nothing.
    Differentiable in ``logits`` (the gradient needs no communication).
    """
    op = "kernel_ladder.distributed.vocab_parallel_cross_entropy"
    g, r, p = _world(op, group)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{op}: logits must be a 2-D (N, V/p) tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not isinstance(target, torch.Tensor) or target.shape != logits.shape[:1] or target.is_floating_point():
        raise ValueError(f"{op}: target must be an integer tensor of shape ({logits.shape[0]},), got "
                         f"{getattr(target, 'shape', type(target).__name__)}")
    vocab_start = r * logits.shape[1]
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, ignore_index, g)
