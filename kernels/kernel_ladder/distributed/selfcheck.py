"""``torchrun --nproc-per-node N -m kernel_ladder.distributed.selfcheck``: check every form of parallelism
of :mod:`kernel_ladder.distributed` on the world torchrun launched, against torch's own implementation.

The same code the chapter runs through :class:`utils.distributed.World`, here under torchrun's
rendezvous (one node or several: ``--nnodes``, ``--rdzv-endpoint``). gloo on CPUs; NCCL when every
rank has a GPU (``--backend nccl``). Each rank prints nothing but failures; rank 0 prints one line
per check and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist


def _checks(device: torch.device) -> list[tuple[str, bool, str]]:
    import kernel_ladder.distributed as kd

    r, p = dist.get_rank(), dist.get_world_size()
    results = []

    def record(name: str, ok: bool, detail: str = "") -> None:
        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)  # a check passes only if it passed on every rank
        results.append((name, int(flag.item()) == 0, detail))

    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(1001, generator=g).to(device)
    ours, theirs = x.clone(), x.clone()
    with kd.count_bytes() as stats:
        kd.ring_all_reduce(ours)
    dist.all_reduce(theirs)
    bounds = kd.chunk_bounds(x.numel(), p)
    own, nxt = bounds[r], bounds[(r + 1) % p]
    expected = (2 * x.numel() - (own[1] - own[0]) - (nxt[1] - nxt[0])) * x.element_size()
    record("ring_all_reduce = all_reduce", torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5 * p)
           and stats.bytes_sent == expected, f"{stats.bytes_sent} bytes sent by rank 0" if r == 0 else "")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device)
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device)
    twin.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(twin)
    dp = kd.DataParallel(model, bucket_cap_mb=1e-4)
    batch = torch.randn(4, 8, generator=g).to(device)
    dp(batch).pow(2).mean().backward()
    ddp(batch).pow(2).mean().backward()
    pairs = zip(model.parameters(), twin.parameters())
    record("DataParallel = DistributedDataParallel",
           all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6) for a, b in pairs))

    torch.manual_seed(1)
    full = torch.randn(1, 2, 4 * p, 16).to(device)
    q = kd.zigzag_shard(full, r, p).contiguous()
    out = kd.ring_attention(q, q, q, causal=True, layout="zigzag")
    gathered = [torch.empty_like(out) for _ in range(p)]
    dist.all_gather(gathered, out.contiguous())
    reference = torch.nn.functional.scaled_dot_product_attention(full, full, full, is_causal=True)
    record("ring_attention (zigzag, causal) = SDPA",
           torch.allclose(kd.zigzag_unshard(gathered), reference, rtol=1e-3, atol=1e-3))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernel_ladder.distributed.selfcheck", description=__doc__)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    args = parser.parse_args(argv)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if args.backend == "nccl" \
        else torch.device("cpu")
    try:
        results = _checks(device)
    finally:
        dist.barrier()
    failed = [name for name, ok, _ in results if not ok]
    if dist.get_rank() == 0:
        print(f"kernel_ladder.distributed selfcheck on {dist.get_world_size()} ranks ({args.backend}):")
        for name, ok, detail in results:
            print(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f"  ({detail})" if detail else ""))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
