"""ZeRO: shard the optimizer state (stage 1), the gradients (stage 2) and the parameters (stage 3).

Plain data parallelism keeps a full copy of everything on every rank: parameters, gradients, and
an optimizer's state (Adam: two more tensors per parameter, in fp32). ZeRO (Rajbhandari et al.
2020, arXiv:1910.02054) cuts each of them into ``p`` shards, one per rank:

* **Stage 1** — :class:`ZeroOptimizer` with ``stage=1``: every rank all-reduces the full gradients,
  updates only its shard of the parameters (so it holds only that shard's optimizer state), then
  the updated shards are all-gathered back into every rank's parameters.
* **Stage 2** — ``stage=2``: the gradients are reduce-scattered instead (each rank receives only
  the averaged gradient of its shard — the reduce-scatter half of an all-reduce; the all-gather of
  the updated parameters is the other half) and the full gradients are freed. Here that happens
  in :meth:`ZeroOptimizer.step`, after the whole backward has produced the full gradients; a
  production ZeRO-2 reduce-scatters bucket by bucket during the backward, so that the full
  gradients never all exist at once. What this version saves is the gradients held *between*
  steps.
* **Stage 3** — :func:`shard_module`: the parameters themselves live as shards. Before each
  layer's forward its full parameters are all-gathered, and freed after; in the backward they are
  gathered again, the layer is recomputed, and its gradients are reduce-scattered to the shards.

The shards are element ranges of the flattened parameters (:func:`kernels.distributed.chunk_bounds`
of the padded total), so any optimizer that works elementwise (SGD, Adam, AdamW) gives exactly
the single-process update. :meth:`ZeroOptimizer.memory` and :func:`module_memory` count the bytes
each rank holds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .collectives import all_gather_into, reduce_scatter_into

__all__ = ["ZeroOptimizer", "module_memory", "shard_module"]

_OP = "kernels.distributed.ZeroOptimizer"


def _world(op: str, group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: no process group: call torch.distributed.init_process_group first")
    g = dist.group.WORLD if group is None else group
    return g, dist.get_rank(g), dist.get_world_size(g)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


class ZeroOptimizer:
    """``optimizer_class`` over this rank's shard of ``params`` (ZeRO stage 1 or 2).

    Call :meth:`step` after every rank's ``backward()`` (the local gradients are averaged here,
    so do not wrap the model in a data-parallel wrapper too). ``kwargs`` go to the optimizer.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, stage: int = 1, group=None, **kwargs) -> None:
        self.group, self.rank, self.world = _world(_OP, group)
        if stage not in (1, 2):
            raise ValueError(f"{_OP}: stage must be 1 or 2 (stage 3 shards the module: shard_module), got {stage!r}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError(f"{_OP}: params is empty (no tensor that requires a gradient)")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"{_OP}: every parameter must have one dtype, got {sorted(map(str, dtypes))}")
        self.stage = stage
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / self.world)
        self.padded = self.shard_size * self.world
        start = self.rank * self.shard_size
        flat = self._flat([p.detach() for p in self.params])
        self.shard = torch.nn.Parameter(flat[start:start + self.shard_size].clone())
        self.optimizer = optimizer_class([self.shard], **kwargs)

    def _flat(self, tensors) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.params[0].device)
        offset = 0
        for t in tensors:
            flat[offset:offset + t.numel()] = t.reshape(-1)
            offset += t.numel()
        return flat

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients, update this rank's shard, and all-gather the parameters."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        flat = self._flat(grads)
        if self.stage == 1:
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            offset = 0
            for p in self.params:  # every rank keeps the averaged full gradients, as data parallelism does
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            mine = flat[self.rank * self.shard_size:(self.rank + 1) * self.shard_size].clone()
        else:
            mine = torch.empty(self.shard_size, dtype=flat.dtype, device=flat.device)
            reduce_scatter_into(mine, flat, self.group)
            mine.div_(self.world)
            for p in self.params:  # stage 2: this rank keeps no full gradient
                p.grad = None
        self.shard.grad = mine
        self.optimizer.step()
        gathered = torch.empty(self.padded, dtype=flat.dtype, device=flat.device)
        all_gather_into(gathered, self.shard.detach().contiguous(), self.group)
        offset = 0
        for p in self.params:
            p.copy_(gathered[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.shard.grad = None

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: the full parameters, the gradients it keeps, the optimizer state."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        return {"parameters": param_bytes, "gradients": grad_bytes, "optimizer_state": _state_bytes(self.optimizer)}


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
    op = "kernels.distributed.shard_module"
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


def module_memory(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters and gradients ``module`` holds on this rank (after :func:`shard_module`: shards)."""
    params = list(module.parameters())
    return {"parameters": sum(q.numel() * q.element_size() for q in params),
            "gradients": sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None)}
