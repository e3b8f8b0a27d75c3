"""ZeRO: shard the optimizer state (stage 1), the gradients (stage 2) and the parameters (stage 3).

Plain data parallelism keeps a full copy of everything on every rank: parameters, gradients, and
an optimizer's state (Adam: two more tensors per parameter, in fp32). ZeRO (Rajbhandari et al.
2020, arXiv:1910.02054) cuts each of them into ``p`` shards, one per rank:

* **Stage 1** — :class:`ZeroOptimizer` with ``stage=1``: every rank all-reduces the full gradients,
  updates only its shard of the parameters (so it holds only that shard's optimizer state), then
  the updated shards are all-gathered back into every rank's parameters.
* **Stage 2** — ``stage=2``: the gradients are reduce-scattered instead (each rank receives only
  the averaged gradient of its shard — the reduce-scatter half of an all-reduce; the all-gather of
  the updated parameters is the other half), bucket by bucket *during* the backward: a hook takes
  each parameter's gradient as soon as it is final, copies it into its bucket and frees it; a full
  bucket's reduce-scatter is launched asynchronously while autograd goes on, and at most two
  buckets are in flight. So the full gradients never all exist at once: the most a rank holds is
  a few buckets plus its shard (:meth:`ZeroOptimizer.memory`'s ``gradients_peak``).
* **Stage 3** — :func:`shard_module`: the parameters themselves live as shards. Before each
  layer's forward its full parameters are all-gathered, and freed after; in the backward they are
  gathered again, the layer is recomputed, and its gradients are reduce-scattered to the shards.

The parameters are grouped into buckets as :class:`kernel_ladder.distributed.DataParallel` groups them
(:func:`kernel_ladder.distributed.plan_buckets`); each bucket's flat buffer is padded to a multiple of
``p`` and rank ``r`` owns its ``r``-th chunk, so a rank's shard is its chunk of every bucket. Any
optimizer that works elementwise (SGD, Adam, AdamW) gives exactly the single-process update.
:meth:`ZeroOptimizer.memory` and :func:`module_memory` count the bytes each rank holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_gather_into, reduce_scatter_into
from .data_parallel import Bucket, plan_buckets

__all__ = ["ZeroOptimizer", "module_memory", "shard_module"]

_OP = "kernel_ladder.distributed.ZeroOptimizer"


def _world(op: str, group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: no process group: call torch.distributed.init_process_group first")
    g = dist.group.WORLD if group is None else group
    return g, dist.get_rank(g), dist.get_world_size(g)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class _ZeroBucket(Bucket):
    """A :class:`Bucket` whose buffer (``chunk * p`` elements, allocated when its first gradient
    arrives) is reduce-scattered: this rank receives ``out``, its ``chunk`` elements, which land at
    ``shard_offset`` in its shard."""

    chunk: int = 0
    shard_offset: int = 0
    out: torch.Tensor | None = None


class ZeroOptimizer:
    """``optimizer_class`` over this rank's shard of ``params`` (ZeRO stage 1 or 2).

    Call :meth:`step` after every rank's ``backward()`` (the local gradients are averaged here,
    so do not wrap the model in a data-parallel wrapper too). ``kwargs`` go to the optimizer.
    ``bucket_cap_mb`` (megabytes of 2**20 bytes) sizes the gradient buckets.

    Stage 1 all-reduces the gradients in :meth:`step` and keeps them in ``param.grad``. Stage 2
    reduce-scatters them during the backward, through hooks, and leaves ``param.grad`` empty:
    several backwards before one :meth:`step` accumulate into the shard's gradient. Every rank
    must run the same backward; a parameter that gets no gradient counts as a zero gradient.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, stage: int = 1, group=None, *,
                 bucket_cap_mb: float = 25, **kwargs) -> None:
        self.group, self.rank, self.world = _world(_OP, group)
        if stage not in (1, 2):
            raise ValueError(f"{_OP}: stage must be 1 or 2 (stage 3 shards the module: shard_module), got {stage!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"{_OP}: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError(f"{_OP}: params is empty (no tensor that requires a gradient)")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"{_OP}: every parameter must have one dtype, got {sorted(map(str, dtypes))}")
        self.stage = stage
        self.numel = sum(p.numel() for p in self.params)
        named = [(f"params[{i}]", p) for i, p in enumerate(self.params)]
        self.buckets: list[_ZeroBucket] = []
        self._where: dict[int, tuple[_ZeroBucket, int]] = {}
        shard_offset = 0
        for members in plan_buckets(named, int(bucket_cap_mb * 2**20)):
            offsets, total = [], 0
            for _, p in members:
                offsets.append(total)
                total += p.numel()
            chunk = math.ceil(total / self.world)
            bucket = _ZeroBucket([p for _, p in members], offsets, None, names=[n for n, _ in members],
                                 chunk=chunk, shard_offset=shard_offset)
            self.buckets.append(bucket)
            for index, (_, p) in enumerate(members):
                self._where[id(p)] = (bucket, index)
            shard_offset += chunk
        self.shard_size = shard_offset
        with torch.no_grad():
            shard = torch.cat([self._flat(b, [p.detach() for p in b.params]).view(self.world, b.chunk)[self.rank]
                               for b in self.buckets])
        self.shard = torch.nn.Parameter(shard.clone())
        self.optimizer = optimizer_class([self.shard], **kwargs)
        self.peak_gradient_bytes = 0
        self._inflight: list[_ZeroBucket] = []
        self._launched: set[int] = set()
        self._callback_queued = False
        self._arrived = 0
        self._handles = ([p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
                         if stage == 2 else [])

    def _flat(self, bucket: _ZeroBucket, tensors) -> torch.Tensor:
        first = bucket.params[0]
        flat = torch.zeros(bucket.chunk * self.world, dtype=first.dtype, device=first.device)
        for t, start in zip(tensors, bucket.offsets):
            flat[start:start + t.numel()] = t.reshape(-1)
        return flat

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if set_to_none:
            self.shard.grad = None
        elif self.shard.grad is not None:
            self.shard.grad.zero_()

    # -- stage 2: the hooks --------------------------------------------------------------------

    def _gradient_bytes(self) -> int:
        return (sum(_nbytes(b.buffer) + _nbytes(b.out) for b in self.buckets) + _nbytes(self.shard.grad)
                + sum(_nbytes(p.grad) for p in self.params))

    @torch.no_grad()
    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._arrived = 0
            self._launched.clear()
            self.peak_gradient_bytes = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, index = self._where[id(param)]
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(bucket.chunk * self.world, dtype=param.dtype, device=param.device)
        start = bucket.offsets[index]
        bucket.buffer[start:start + param.numel()].copy_(param.grad.reshape(-1))
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, self._gradient_bytes())
        param.grad = None  # the full gradient is freed as soon as it is in its bucket
        bucket.ready += 1
        self._arrived += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _ZeroBucket) -> None:
        bucket.launched_at, bucket.launched_after = time.perf_counter(), self._arrived
        self._launched.add(id(bucket))
        bucket.out = torch.empty(bucket.chunk, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
        bucket.work = reduce_scatter_into(bucket.out, bucket.buffer, self.group, async_op=True)
        self._inflight.append(bucket)
        if len(self._inflight) > 2:  # bound the memory: finish the oldest before going on
            self._land(self._inflight.pop(0))

    def _land(self, bucket: _ZeroBucket) -> None:
        bucket.work.wait()
        if self.shard.grad is None:
            self.shard.grad = torch.zeros_like(self.shard)
        self.shard.grad[bucket.shard_offset:bucket.shard_offset + bucket.chunk].add_(bucket.out, alpha=1 / self.world)
        bucket.buffer = bucket.out = bucket.work = None
        bucket.ready = 0

    @torch.no_grad()
    def _finish(self) -> None:
        self._callback_queued = False
        for b in self.buckets:  # a bucket left incomplete (or empty): its missing gradients count as zeros
            if id(b) not in self._launched:
                if b.buffer is None:
                    b.buffer = torch.zeros(b.chunk * self.world, dtype=self.shard.dtype, device=self.shard.device)
                self._launch(b)
        while self._inflight:
            self._land(self._inflight.pop(0))

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients (stage 1; stage 2 did it in the backward), update this rank's
        shard, and all-gather the updated parameters into every rank's ``params``."""
        if self.stage == 1:
            mine = []
            for b in self.buckets:
                flat = self._flat(b, [torch.zeros_like(p) if p.grad is None else p.grad for p in b.params])
                dist.all_reduce(flat, group=self.group)
                flat.div_(self.world)
                for p, start in zip(b.params, b.offsets):  # every rank keeps the averaged full gradients
                    p.grad = flat[start:start + p.numel()].view_as(p).clone()
                mine.append(flat.view(self.world, b.chunk)[self.rank])
            self.shard.grad = torch.cat(mine)
        self.optimizer.step()
        for b in self.buckets:
            gathered = torch.empty(b.chunk * self.world, dtype=self.shard.dtype, device=self.shard.device)
            all_gather_into(gathered, self.shard[b.shard_offset:b.shard_offset + b.chunk].detach().contiguous(),
                            self.group)
            for p, start in zip(b.params, b.offsets):
                p.copy_(gathered[start:start + p.numel()].view_as(p))
        self.shard.grad = None

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: the full parameters, the gradients it keeps, the optimizer
        state; and ``gradients_peak``, the most gradient bytes it held at once during the last
        backward (stage 2; stage 1 holds the full gradients, so there it is their size)."""
        param_bytes = sum(_nbytes(p) for p in self.params)
        grads = sum(_nbytes(p.grad) for p in self.params) + _nbytes(self.shard.grad)
        peak = self.peak_gradient_bytes if self.stage == 2 else param_bytes
        return {"parameters": param_bytes, "gradients": grads, "optimizer_state": _state_bytes(self.optimizer),
                "gradients_peak": peak}

    def timeline(self) -> list[dict]:
        """Stage 2: when each bucket's reduce-scatter was launched in the last backward — its
        parameters, bytes, and how many of the backward's gradients had arrived by then."""
        return [{"bucket": k, "params": list(b.names), "bytes": b.chunk * self.world * self.shard.element_size(),
                 "launched_after": b.launched_after, "launched_at": b.launched_at} for k, b in enumerate(self.buckets)]


# ----------------------------------------------------------------------------------------------
# Stage 3: the parameters sharded
# ----------------------------------------------------------------------------------------------


class _ShardedCall(torch.autograd.Function):
    """Forward: gather a layer's parameters, run it without keeping them. Backward: gather them
    again, recompute, and reduce-scatter the parameters' gradients to the shards."""

    @staticmethod
    def forward(ctx, shard, x, layer):
        full = layer._zero_gather(shard)
        with torch.no_grad():
            out = torch.func.functional_call(layer._zero_module, layer._zero_unflatten(full), (x,))
        del full  # freed: only the shard stays
        ctx.layer = layer
        ctx.save_for_backward(shard, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        shard, x = ctx.saved_tensors
        layer = ctx.layer
        full = layer._zero_gather(shard).requires_grad_(True)
        x = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            out = torch.func.functional_call(layer._zero_module, layer._zero_unflatten(full), (x,))
            inputs = [full] + ([x] if x.requires_grad else [])
            grads = torch.autograd.grad(out, inputs, grad_out)
        grad_shard = torch.empty_like(shard)
        reduce_scatter_into(grad_shard, grads[0].contiguous(), layer._zero_group)
        grad_shard.div_(layer._zero_world)
        return grad_shard, (grads[1] if x.requires_grad else None), None


class _ShardedLayer(torch.nn.Module):
    """One layer whose parameters are a flat shard (``zero_shard``); its forward gathers them."""

    def __init__(self, module: torch.nn.Module, group, rank: int, world: int) -> None:
        super().__init__()
        params = dict(module.named_parameters(recurse=False))
        self._zero_names = list(params)
        self._zero_shapes = [p.shape for p in params.values()]
        self._zero_numel = sum(p.numel() for p in params.values())
        self._zero_group, self._zero_world = group, world
        shard_size = math.ceil(self._zero_numel / world)
        flat = torch.zeros(shard_size * world, dtype=next(iter(params.values())).dtype)
        flat[:self._zero_numel] = torch.cat([p.detach().reshape(-1) for p in params.values()])
        self.zero_shard = torch.nn.Parameter(flat[rank * shard_size:(rank + 1) * shard_size].clone())
        for name in self._zero_names:
            del module._parameters[name]
        object.__setattr__(self, "_zero_module", module)  # not a submodule: its parameters are gone

    def _zero_gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(shard.numel() * self._zero_world, dtype=shard.dtype, device=shard.device)
        all_gather_into(full, shard.detach().contiguous(), self._zero_group)
        return full

    def _zero_unflatten(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in zip(self._zero_names, self._zero_shapes):
            n = math.prod(shape)
            out[name] = full[offset:offset + n].view(shape)
            offset += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ShardedCall.apply(self.zero_shard, x, self)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the layer, gathered (a collective: call it on every rank)."""
        with torch.no_grad():
            return {k: v.clone() for k, v in self._zero_unflatten(self._zero_gather(self.zero_shard)).items()}


def shard_module(module: torch.nn.Module, group=None) -> torch.nn.Module:
    """ZeRO stage 3 on ``module``, in place: every submodule that holds parameters of its own (a
    ``Linear``, a norm) is replaced by a layer that keeps ``1/p`` of them and gathers the rest for
    its forward and its backward. Returns ``module``. Layers must take one tensor and return one."""
    op = "kernel_ladder.distributed.shard_module"
    g, r, p = _world(op, group)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{op}: module must be a torch.nn.Module, got {type(module).__name__}")
    for name, child in list(module.named_children()):
        if any(True for _ in child.parameters(recurse=False)):
            setattr(module, name, _ShardedLayer(child, g, r, p))
        else:
            shard_module(child, g)
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"{op}: the top module holds parameters of its own; wrap it in a container")
    return module


def module_memory(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters and gradients ``module`` holds on this rank (after :func:`shard_module`: shards),
    and with ``optimizer`` (a plain torch optimizer over them) its state's bytes as ``"optimizer_state"``
    (:meth:`ZeroOptimizer.memory` counts its own)."""
    params = list(module.parameters())
    memory = {"parameters": sum(_nbytes(q) for q in params), "gradients": sum(_nbytes(q.grad) for q in params)}
    if optimizer is not None:
        memory["optimizer_state"] = _state_bytes(optimizer)
    return memory
