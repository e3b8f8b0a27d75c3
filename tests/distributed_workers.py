"""Functions the distributed tests run on every rank of a :class:`utils.distributed.World`.

They live in a module (not in the test files) because each rank imports them by name. Each
returns plain data (tensors, ints) that the test process compares; the inputs are drawn from a
seed and the rank, so the parent can rebuild every rank's input for its float64 reference.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from kernel_ladder.distributed import collectives as C


def rank_input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: ``n`` normal draws from ``seed + rank``, in ``dtype``."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64).to(dtype)


def identity() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def fails_on(rank: int) -> int:
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} raised on purpose")
    return dist.get_rank()


def waits_forever_on(rank: int, seconds: float = 600.0) -> int:
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def recv_that_never_comes() -> None:
    """Every rank receives from its left neighbour and nobody sends: a deadlock."""
    r, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty(4)
    dist.recv(buf, (r - 1) % p)


def all_reduce(seed: int, n: int, dtype: torch.dtype) -> dict:
    """Ours and torch's all-reduce of the same input, and the bytes ours sent."""
    x = rank_input(seed, dist.get_rank(), n, dtype)
    theirs = x.clone()
    dist.all_reduce(theirs)
    ours = x.clone()
    with C.count_bytes() as stats:
        out = C.ring_all_reduce(ours)
    return {"ours": ours, "theirs": theirs, "same_object": out is ours, "bytes": stats.bytes_sent,
            "messages": stats.messages}


def all_reduce_by(name: str, seed: int, n: int) -> dict:
    """One of the ladder's all-reduces (star, tree, ring) against torch's, and the bytes it sent."""
    x = rank_input(seed, dist.get_rank(), n, torch.float32)
    theirs = x.clone()
    dist.all_reduce(theirs)
    ours = x.clone()
    with C.count_bytes() as stats:
        out = getattr(C, name)(ours)
    return {"ours": ours, "theirs": theirs, "same_object": out is ours, "bytes": stats.bytes_sent}


def reduce_scatter(seed: int, n: int, dtype: torch.dtype) -> dict:
    x = rank_input(seed, dist.get_rank(), n, dtype)
    before = x.clone()
    with C.count_bytes() as stats:
        chunk = C.ring_reduce_scatter(x)
    return {"chunk": chunk, "unchanged": torch.equal(x, before), "bytes": stats.bytes_sent}


def all_gather(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    r, p = dist.get_rank(), dist.get_world_size()
    x = rank_input(seed, r, math.prod(shape), dtype).reshape(shape)
    theirs = torch.empty((p * shape[0], *shape[1:]) if shape else (p,), dtype=dtype)
    C.all_gather_into(theirs, x.reshape(1) if x.dim() == 0 else x.contiguous())  # gloo: no 0-d
    with C.count_bytes() as stats:
        ours = C.ring_all_gather(x)
    return {"ours": ours, "theirs": theirs, "bytes": stats.bytes_sent}


def broadcast(seed: int, n: int, src: int, dtype: torch.dtype) -> dict:
    r = dist.get_rank()
    x = rank_input(seed, r, n, dtype)
    with C.count_bytes() as stats:
        C.tree_broadcast(x, src=src)
    return {"out": x, "bytes": stats.bytes_sent, "messages": stats.messages}


def all_reduce_in_subgroup(seed: int, n: int) -> dict:
    """All-reduce within the even ranks and within the odd ranks (two groups of the world)."""
    r, p = dist.get_rank(), dist.get_world_size()
    evens, odds = list(range(0, p, 2)), list(range(1, p, 2))
    groups = [dist.new_group(evens), dist.new_group(odds)]
    mine = groups[r % 2]
    x = rank_input(seed, r, n, torch.float32)
    C.ring_all_reduce(x, group=mine)
    return {"out": x, "members": evens if r % 2 == 0 else odds}


def broken_ring_all_reduce(seed: int, n: int) -> torch.Tensor:
    """A negative control: reduce-scatter without the all-gather (each rank has only its chunk)."""
    from kernel_ladder.distributed.collectives import _reduce_scatter_ring, chunk_bounds

    r, p = dist.get_rank(), dist.get_world_size()
    x = rank_input(seed, r, n, torch.float32)
    _reduce_scatter_ring("broken", x, dist.group.WORLD, r, p, chunk_bounds(n, p))
    return x


def empty_collective(name: str, shape: tuple[int, ...]) -> dict:
    """One collective of the module on an empty tensor of ``shape``: what it returned, or the tensors
    ``ring_shift`` received. A rank that posts a message the others skip hangs here (the caller's deadline)."""
    x = torch.empty(shape)
    with C.count_bytes() as stats:
        if name == "ring_shift":
            out = C.ring_shift([x, x.clone()]).wait()
        elif name == "tree_broadcast":
            out = C.tree_broadcast(x, src=dist.get_world_size() - 1)
        else:
            out = getattr(C, name)(x)
    same = out is x
    out = list(out) if isinstance(out, list) else [out]
    return {"shapes": [tuple(t.shape) for t in out], "same_object": same, "bytes": stats.bytes_sent}


def refuses(what: str) -> str:
    """The error message of a bad call (the tests check it names the op and the argument)."""
    try:
        if what == "noncontiguous":
            C.ring_all_reduce(torch.zeros(4, 4).t())
        elif what == "list":
            C.ring_all_reduce([1.0, 2.0])
        elif what == "src":
            C.tree_broadcast(torch.zeros(3), src=dist.get_world_size())
        elif what == "bool":
            C.ring_all_gather(torch.zeros(3, dtype=torch.bool))
    except (TypeError, ValueError) as error:
        return str(error)
    return "no error"


# ----------------------------------------------------------------------------------------------
# Data parallel
# ----------------------------------------------------------------------------------------------


class _WithSpare(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body, self.spare = body, torch.nn.Linear(4, 4)  # spare: never called in forward

    def forward(self, x):
        return self.body(x)


def _mlp(seed: int, unused: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)]
    model = torch.nn.Sequential(*layers)
    return _WithSpare(model) if unused else model


def _batch(seed: int, rank: int, rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed + 1000 + rank))


def data_parallel_vs_ddp(seed: int, bucket_cap_mb: float, micro_batches: int = 1) -> dict:
    """Ours and torch's DDP on the same model (rank 0's init), each rank its own data."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from kernel_ladder.distributed import DataParallel

    r = dist.get_rank()
    model = _mlp(seed)
    if r != 0:  # a different init everywhere but rank 0: both wrappers must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    twin = copy.deepcopy(model)
    ours, theirs = DataParallel(model, bucket_cap_mb=bucket_cap_mb), DDP(twin, bucket_cap_mb=bucket_cap_mb)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    for k in range(micro_batches):
        x = _batch(seed + 17 * k, r)
        last = k == micro_batches - 1
        ctx_ours = contextlib.nullcontext() if last else ours.no_sync()
        ctx_theirs = contextlib.nullcontext() if last else theirs.no_sync()
        with ctx_ours:
            ours(x).pow(2).mean().backward()
        with ctx_theirs:
            theirs(x).pow(2).mean().backward()
    return {"ours": {n: p.grad.clone() for n, p in model.named_parameters()},
            "theirs": {n: p.grad.clone() for n, p in twin.named_parameters()},
            "init": init, "timeline": ours.timeline(), "n_params": len(list(model.parameters()))}


def data_parallel_unused_param() -> str:
    from kernel_ladder.distributed import DataParallel

    model = DataParallel(_mlp(0, unused=True))
    try:
        model(_batch(0, dist.get_rank())).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


# ----------------------------------------------------------------------------------------------
# Tensor parallel
# ----------------------------------------------------------------------------------------------


def _tp_mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(16, 8))


def tp_batch(seed: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(seed + 7))


def tensor_parallel_mlp(seed: int) -> dict:
    """Megatron's MLP (ours) and DTensor's ColwiseParallel/RowwiseParallel on the same weights and input."""
    import copy

    import kernel_ladder
    from kernel_ladder.distributed import ColumnParallelLinear, RowParallelLinear

    p = dist.get_world_size()
    model = _tp_mlp(seed)
    up, down = ColumnParallelLinear.from_linear(model[0]), RowParallelLinear.from_linear(model[2])
    x = tp_batch(seed).requires_grad_(True)
    out = down(kernel_ladder.gelu(up(x), approximate="tanh"))
    out.pow(2).mean().backward()
    ours = {"out": out.detach(), "x_grad": x.grad.clone(), "up.weight": up.weight.grad.clone(),
            "up.bias": up.bias.grad.clone(), "down.weight": down.weight.grad.clone(),
            "down.bias": down.bias.grad.clone()}

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    twin = parallelize_module(copy.deepcopy(model), init_device_mesh("cpu", (p,)),
                              {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x2 = tp_batch(seed).requires_grad_(True)
    out2 = twin(x2)
    out2.pow(2).mean().backward()
    theirs = {"out": out2.detach(), "x_grad": x2.grad.clone(),
              "up.weight": twin[0].weight.grad.to_local(), "up.bias": twin[0].bias.grad.to_local(),
              "down.weight": twin[2].weight.grad.to_local(), "down.bias": twin[2].bias.grad.full_tensor()}
    return {"ours": ours, "theirs": theirs}


def vocab_parallel(seed: int, vocab: int = 12, dim: int = 6) -> dict:
    """An embedding and an LM head split over the vocabulary, the loss never gathering the logits."""
    from kernel_ladder.distributed import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy

    torch.manual_seed(seed)
    embed, head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab, bias=False)
    gen = torch.Generator().manual_seed(seed + 3)
    ids = torch.randint(0, vocab, (7,), generator=gen)
    target = torch.randint(0, vocab, (7,), generator=gen)
    target[2] = -100
    e, h = VocabParallelEmbedding.from_embedding(embed), ColumnParallelLinear.from_linear(head)
    local_logits = h(e(ids))
    loss = vocab_parallel_cross_entropy(local_logits, target)
    loss.backward()
    return {"loss": loss.detach(), "local_logits_shape": tuple(local_logits.shape),
            "embed_grad": e.weight.grad.clone(), "head_grad": h.weight.grad.clone(),
            "vocab_start": e.vocab_start}


# ----------------------------------------------------------------------------------------------
# Context parallel
# ----------------------------------------------------------------------------------------------


def attention_inputs(seed: int, heads: int = 2, kv_heads: int = 2, seq: int = 16, dim: int = 16):
    """Full-sequence (1, H, T, D) q, k, v and an upstream gradient, float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, dim, generator=g)
    k = torch.randn(1, kv_heads, seq, dim, generator=g)
    v = torch.randn(1, kv_heads, seq, dim, generator=g)
    dout = torch.randn(1, heads, seq, dim, generator=g)
    return q, k, v, dout


def local_slice(x: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    from kernel_ladder.distributed import zigzag_shard

    return x.chunk(world, dim=2)[rank] if layout == "contiguous" else zigzag_shard(x, rank, world)


def ring_attention_run(seed: int, causal: bool, layout: str, kv_heads: int = 2) -> dict:
    from kernel_ladder.distributed import collectives, ring_attention

    r, p = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (local_slice(t, r, p, layout).contiguous() for t in attention_inputs(seed, kv_heads=kv_heads))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with collectives.count_bytes() as stats:
        out = ring_attention(q, k, v, causal=causal, layout=layout)
        out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "bytes": stats.bytes_sent}


# ----------------------------------------------------------------------------------------------
# Pipeline parallel
# ----------------------------------------------------------------------------------------------


def pipeline_model(seed: int, world: int) -> torch.nn.Sequential:
    """Two (Linear, Tanh) pairs per stage, the same init on every rank."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(world):
        layers += [torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def pipeline_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 99)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def _stages(model: torch.nn.Sequential, world: int) -> list[torch.nn.Sequential]:
    return [model[4 * r:4 * (r + 1)] for r in range(world)]


def pipeline_run(seed: int, schedule: str, microbatches: int) -> dict:
    import copy

    from kernel_ladder.distributed import Pipeline

    r, p = dist.get_rank(), dist.get_world_size()
    model = pipeline_model(seed, p)
    x, y = pipeline_batch(seed)
    pipe = Pipeline(_stages(model, p), schedule=schedule, num_microbatches=microbatches)
    loss = pipe.step(x if r == 0 else None, y if r == p - 1 else None)
    ours = {n: q.grad.clone() for n, q in pipe.stage.named_parameters()}

    run = {"ours": ours, "loss": loss, "order": pipe.order(), "peak": pipe.peak_in_flight, "theirs": None,
           "their_loss": None}
    if schedule == "1f1b" and microbatches < p:
        return run  # torch's Schedule1F1B refuses fewer micro-batches than stages; ours runs them

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    twin = copy.deepcopy(_stages(pipeline_model(seed, p), p)[r])
    stage = PipelineStage(twin, r, p, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=microbatches, loss_fn=torch.nn.functional.mse_loss)
    losses: list = []
    if r == 0:
        sched.step(x)
    elif r == p - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    run["theirs"] = {n: q.grad.clone() for n, q in twin.named_parameters()}
    run["their_loss"] = torch.stack(losses).mean() if losses else None
    return run


# ----------------------------------------------------------------------------------------------
# ZeRO
# ----------------------------------------------------------------------------------------------


def zero_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3))


def zero_batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank * 10 + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def zero_run(seed: int, stage: int, steps: int = 3) -> dict:
    """ZeRO stage 1/2/3 (ours) and torch's ZeroRedundancyOptimizer, Adam, a few steps on each rank's data."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from kernel_ladder.distributed import ZeroOptimizer, module_memory, shard_module

    r = dist.get_rank()
    model, twin = zero_model(seed), zero_model(seed)
    if stage == 3:
        shard_module(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=1e-2)
    theirs = ZeroRedundancyOptimizer(twin.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    memory = None
    for step in range(steps):
        x, y = zero_batch(seed, r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if memory is None:
            memory = opt.memory() if stage != 3 else module_memory(model, opt)
        theirs.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        for q in twin.parameters():  # ZeroRedundancyOptimizer expects averaged gradients (DDP's job)
            dist.all_reduce(q.grad)
            q.grad.div_(dist.get_world_size())
        theirs.step()
    if stage == 3:
        ours = {}
        for name, layer in model.named_children():
            if hasattr(layer, "full_parameters"):
                ours.update({f"{name}.{k}": v for k, v in layer.full_parameters().items()})
    else:
        ours = {n: q.detach().clone() for n, q in model.named_parameters()}
    return {"ours": ours, "theirs": {n: q.detach().clone() for n, q in twin.named_parameters()}, "memory": memory}


def deep_model(seed: int, layers: int = 16, width: int = 16) -> torch.nn.Sequential:
    """Many small layers: enough buckets for ZeRO-2's in-backward reduce-scatter to matter."""
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def deep_batch(seed: int, rank: int, step: int, micro: int = 0, width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 100 + step * 10 + micro)
    return torch.randn(4, width, generator=g), torch.randn(4, width, generator=g)


def zero2_bucketed_run(seed: int, steps: int, cap_bytes: int, micro_batches: int = 1) -> dict:
    """ZeRO-2 with small buckets: parameters after ``steps`` Adam steps (each over ``micro_batches``
    backwards), the gradient bytes held at the peak of the last backward, and its launch timeline."""
    from kernel_ladder.distributed import ZeroOptimizer

    r = dist.get_rank()
    model = deep_model(seed)
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-2, bucket_cap_mb=cap_bytes / 2**20)
    held_between = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            x, y = deep_batch(seed, r, step, micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
            held_between.append(sum(q.grad is not None for q in model.parameters()))
        opt.step()
    return {"params": {n: q.detach().clone() for n, q in model.named_parameters()}, "memory": opt.memory(),
            "timeline": opt.timeline(), "param_grads_left": held_between,
            "full_gradient_bytes": sum(q.numel() * q.element_size() for q in model.parameters())}


def fsdp2_run(seed: int, steps: int = 3) -> dict:
    """torch's FSDP2 (fully_shard) on the ZeRO test's model and data, for comparison with stage 3."""
    from torch.distributed.fsdp import fully_shard

    r = dist.get_rank()
    model = zero_model(seed)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = zero_batch(seed, r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {n: q.full_tensor().detach().clone() for n, q in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# Sequence parallel
# ----------------------------------------------------------------------------------------------


def sp_inputs(seed: int, tokens: int = 8, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    norm_w = 1 + 0.1 * torch.randn(dim, generator=g)
    up, down = torch.nn.Linear(dim, 16), torch.nn.Linear(16, dim)
    return torch.randn(tokens, dim, generator=g), torch.randn(tokens, dim, generator=g), norm_w, up, down


def sequence_parallel_block(seed: int, sequence_parallel: bool) -> dict:
    """``x + down(gelu(up(rms_norm(x))))``, tensor parallel, with or without sequence parallelism."""
    import kernel_ladder
    from kernel_ladder.distributed import ColumnParallelLinear, RowParallelLinear

    r, p = dist.get_rank(), dist.get_world_size()
    x, dout, norm_w, up, down = sp_inputs(seed)
    rows = slice(r * x.shape[0] // p, (r + 1) * x.shape[0] // p)
    if sequence_parallel:
        x, dout = x[rows], dout[rows]
    x = x.clone().requires_grad_(True)
    w = norm_w.clone().requires_grad_(True)
    col = ColumnParallelLinear.from_linear(up, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(down, sequence_parallel=sequence_parallel)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kernel_ladder.add(x, row(kernel_ladder.gelu(col(kernel_ladder.rms_norm(x, w)))))
    out.backward(dout)
    if sequence_parallel:  # the norm's weight saw only this rank's rows: its gradient is a partial sum
        dist.all_reduce(w.grad)
    return {"out": out.detach(), "dx": x.grad, "dw": w.grad, "saved_bytes": saved[0]}


# ----------------------------------------------------------------------------------------------
# 2-D: tensor x data parallel
# ----------------------------------------------------------------------------------------------


class _TPMLP(torch.nn.Module):
    def __init__(self, up, down) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        import kernel_ladder

        return self.down(kernel_ladder.gelu(self.up(x), approximate="tanh"))


def two_d_parallel(seed: int, tp: int = 2) -> dict:
    """A world of tp x dp ranks: tensor parallel within rows of the mesh, data parallel down its columns."""
    from kernel_ladder.distributed import ColumnParallelLinear, DataParallel, RowParallelLinear

    r, p = dist.get_rank(), dist.get_world_size()
    dp = p // tp
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    dp_groups = [dist.new_group(list(range(t, p, tp))) for t in range(tp)]
    tp_group, dp_group = tp_groups[r // tp], dp_groups[r % tp]
    model = _tp_mlp(seed)
    layer = _TPMLP(ColumnParallelLinear.from_linear(model[0], group=tp_group),
                   RowParallelLinear.from_linear(model[2], group=tp_group))
    wrapped = DataParallel(layer, group=dp_group)
    x = tp_batch(seed + r // tp)  # one batch per data-parallel replica
    wrapped(x).pow(2).mean().backward()
    return {"tp_rank": r % tp, "dp_rank": r // tp, "up.weight": layer.up.weight.grad.clone(),
            "down.weight": layer.down.weight.grad.clone(), "down.bias": layer.down.bias.grad.clone()}


def head_parallel_attention(seed: int, heads: int = 4, dim: int = 16) -> dict:
    """Attention with its heads split across ranks: q, k, v column parallel (whole heads per rank),
    kernel_ladder.flash_attention on the local heads, the output projection row parallel."""
    import kernel_ladder
    from kernel_ladder.distributed import ColumnParallelLinear, RowParallelLinear

    p = dist.get_world_size()
    torch.manual_seed(seed)
    wq, wk, wv, wo = (torch.nn.Linear(dim, dim) for _ in range(4))
    x = torch.randn(2, 6, dim, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_(True)
    q_, k_, v_ = (ColumnParallelLinear.from_linear(w) for w in (wq, wk, wv))
    o_ = RowParallelLinear.from_linear(wo)
    local_heads, head_dim = heads // p, dim // heads

    def split(t):  # (B, T, local_heads * head_dim) -> (B, local_heads, T, head_dim)
        return t.view(t.shape[0], t.shape[1], local_heads, head_dim).transpose(1, 2)

    attn = kernel_ladder.flash_attention(split(q_(x)), split(k_(x)), split(v_(x)), causal=True)
    out = o_(attn.transpose(1, 2).reshape(x.shape[0], x.shape[1], local_heads * head_dim))
    out.pow(2).mean().backward()
    return {"out": out.detach(), "x_grad": x.grad, "wo_grad": o_.weight.grad}


# ----------------------------------------------------------------------------------------------
# The torchrun training example (kernel_ladder.distributed.train) on a World
# ----------------------------------------------------------------------------------------------


def train_example(argv: list[str], broken: str | None = None) -> dict:
    """kernel_ladder.distributed.train on this world; ``broken="no-dp"`` swaps DataParallel for the bare
    module (no gradient averaging), ``"no-tp-reduce"`` drops the row-parallel all-reduce — both
    must be caught by the example's comparison with one process."""
    import kernel_ladder.distributed.data_parallel as dp_module
    import kernel_ladder.distributed.tensor_parallel as tp_module
    from kernel_ladder.distributed import train

    saved = dp_module.DataParallel, tp_module.reduce_from_parallel
    if broken == "no-dp":
        dp_module.DataParallel = lambda module, group=None: module
    elif broken == "no-tp-reduce":
        tp_module.reduce_from_parallel = lambda x, group=None: x
    try:
        return train.train(argv)
    finally:
        dp_module.DataParallel, tp_module.reduce_from_parallel = saved
