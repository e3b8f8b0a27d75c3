"""``torchrun --standalone --nproc-per-node 4 -m kernel_ladder.distributed.train``: train a small language
model with tensor parallelism inside each row of a ``dp × tp`` mesh and data parallelism down its
columns, and check it against the same model trained in one process.

The mesh is torch's own (:func:`torch.distributed.device_mesh.init_device_mesh`); the parallel
layers are this package's: a vocabulary-parallel embedding, Megatron MLP blocks (a
:class:`ColumnParallelLinear` then a :class:`RowParallelLinear`, replicated RMS norms), a
column-parallel LM head whose ``(N, V/tp)`` logits go straight into
:func:`vocab_parallel_cross_entropy`, and :class:`DataParallel` over the data-parallel group.

The task is synthetic and learnable: each sequence follows ``next = (a·token + b) mod V``, so the
loss falls from ``ln V`` towards zero. Every data-parallel replica draws its own batches; the
reference (``--reference``, on by default) trains the unsharded model on all of them at once in
every process, and the run fails unless the two losses agree at every step.

gloo on CPUs; NCCL when every rank has a GPU (``--backend auto`` picks). Several nodes: the same
command with torchrun's ``--nnodes``, ``--rdzv-backend c10d`` and ``--rdzv-endpoint``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys

import torch
import torch.distributed as dist

import kernel_ladder

__all__ = ["TinyLM", "main", "parallelize", "synthetic_batch", "train"]


class _Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(dim))
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(kernel_ladder.gelu(self.up(kernel_ladder.rms_norm(x, self.norm)), approximate="tanh"))


class TinyLM(torch.nn.Module):
    """Embedding → ``layers`` residual MLP blocks (RMS norm, up, GELU, down) → RMS norm → LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, hidden) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.ones(dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(kernel_ladder.rms_norm(x, self.norm))


def parallelize(model: TinyLM, tp_group) -> TinyLM:
    """``model``, in place, tensor parallel over ``tp_group``: the embedding and the LM head split
    by vocabulary, each block's ``up`` by columns and ``down`` by rows; the norms replicated. The
    head then returns this rank's ``(…, V/tp)`` slice of the logits."""
    from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    model.embed = VocabParallelEmbedding.from_embedding(model.embed, group=tp_group)
    for block in model.blocks:
        block.up = ColumnParallelLinear.from_linear(block.up, group=tp_group)
        block.down = RowParallelLinear.from_linear(block.down, group=tp_group)
    model.head = ColumnParallelLinear.from_linear(model.head, group=tp_group)
    return model


def synthetic_batch(step: int, replica: int, batch: int, seq: int, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """``(ids, targets)`` of replica ``replica`` at ``step``: sequences of ``next = (5·t + 3) mod V``."""
    g = torch.Generator().manual_seed(10_000 * step + replica)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = [start]
    for _ in range(seq):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    seqs = torch.cat(tokens, dim=1).to(device)
    return seqs[:, :-1], seqs[:, 1:]


def _device(backend: str) -> torch.device:
    if backend.startswith("nccl"):
        local = dist.get_rank() % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m kernel_ladder.distributed.train",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the world size)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel replica per step")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also train the unsharded model in each process and require equal losses")
    parser.add_argument("--log-every", type=int, default=10)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        return 0 if train(args, verbose=True)["ok"] else 1
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace | list[str] | None = None, verbose: bool = False) -> dict:
    """The training run on the initialized world (``args``: parsed options, or a command line).
    Returns the first and last loss, the largest relative difference from one process, and ``ok``
    (the loss fell, and agreed with one process to 1e-3 at every step)."""
    from torch.distributed.device_mesh import init_device_mesh

    from .data_parallel import DataParallel
    from .tensor_parallel import vocab_parallel_cross_entropy

    if not isinstance(args, argparse.Namespace):
        args = _parser().parse_args(args or [])
    backend = dist.get_backend()
    p, r = dist.get_world_size(), dist.get_rank()
    if args.tp < 1 or p % args.tp:
        raise SystemExit(f"kernel_ladder.distributed.train: --tp {args.tp} must divide the world size {p}")
    dp = p // args.tp
    device = _device(backend)
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    replica = mesh.get_local_rank("dp")

    def build() -> TinyLM:
        torch.manual_seed(0)
        return TinyLM(args.vocab, args.dim, 2 * args.dim, args.layers).to(device)

    reference = build() if args.reference else None
    model = DataParallel(parallelize(build(), tp_group), group=dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None
    if verbose and r == 0:
        print(f"kernel_ladder.distributed.train: {p} ranks ({backend}) as dp {dp} x tp {args.tp}; "
              f"{sum(q.numel() for q in build().parameters())} parameters, vocabulary {args.vocab}")
    first = last = math.nan
    worst = 0.0
    for step in range(args.steps):
        ids, targets = synthetic_batch(step, replica, args.batch, args.seq, args.vocab, device)
        opt.zero_grad()
        logits = model(ids)  # (B, T, V/tp): this rank's vocabulary slice
        loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), tp_group)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)  # the global batch's loss: the mean over replicas
        mean = float(mean) / dp
        if reference is not None:
            batches = [synthetic_batch(step, d, args.batch, args.seq, args.vocab, device) for d in range(dp)]
            all_ids, all_targets = (torch.cat(t) for t in zip(*batches))
            ref_opt.zero_grad()
            ref_loss = torch.nn.functional.cross_entropy(reference(all_ids).reshape(-1, args.vocab),
                                                         all_targets.reshape(-1))
            ref_loss.backward()
            ref_opt.step()
            ref_loss = float(ref_loss.detach())
            worst = max(worst, abs(mean - ref_loss) / max(abs(ref_loss), 1e-6))
        first = mean if step == 0 else first
        last = mean
        if verbose and r == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            extra = f"   one process {ref_loss:.4f}" if reference is not None else ""
            print(f"step {step:>4}  loss {mean:.4f}{extra}")
    ok = last < first
    if reference is not None:
        ok = ok and worst < 1e-3
    if verbose and r == 0:
        summary = f"loss {first:.4f} -> {last:.4f}"
        if reference is not None:
            summary += f"; largest relative difference from one process {worst:.1e} (must be < 1e-3)"
        print(("ok: " if ok else "FAILED: ") + summary)
    return {"first": first, "last": last, "worst": worst, "ok": ok}


if __name__ == "__main__":
    sys.exit(main())
