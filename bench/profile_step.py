"""``make gpu-check PROFILE=1``: a ``torch.profiler`` trace of a small training step, kept as data.

:func:`profile_training_step` builds :class:`utils.transformer.TinyDecoder` (every op a ``kernel_ladder``
custom op), runs a few untimed steps (compiles and autotuning done), then profiles ``steps``
training steps with ``torch.profiler`` (CPU activity, and CUDA where there is a device) and writes
under ``<out>/profile/``:

* ``step_trace.json`` — the chrome trace (open it in ui.perfetto.dev or chrome://tracing);
* ``top_ops.txt`` — ``key_averages()`` as a table, sorted by device time on a GPU (CPU time here);
* ``profile.json`` — the machine, the sizes, and one record per event name (count, self and
  total CPU and device microseconds): the data a chapter plots with :func:`plot_profile`.

Nothing here is a figure for the docs unless it came from a run on a GPU: on the CPU the times are
the Triton interpreter's. ``python -m bench.profile_step --plot <profile.json> [--image out.png]``
draws a committed run's top events.

Runs with the GPU machine's own ``python3`` like the rest of ``make gpu-check``: it needs torch,
triton, ``kernel_ladder`` and ``utils`` only (matplotlib only for ``--plot``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

SIZES = {
    # hidden, heads, kv heads, ffn, vocab; batch, sequence; dtype
    "gpu": dict(hidden=1024, n_heads=16, n_kv_heads=4, ffn=2816, vocab=32000, batch=4, seq=1024,
                dtype=torch.bfloat16),
    "smoke": dict(hidden=32, n_heads=2, n_kv_heads=2, ffn=64, vocab=64, batch=2, seq=16, dtype=torch.float32),
}


def _event_record(evt) -> dict:
    def us(*names: str) -> float:
        for name in names:  # torch renamed cuda_* to device_* (2.4); read whichever this one has
            value = getattr(evt, name, None)
            if value is not None:
                return float(value)
        return 0.0

    return {
        "name": evt.key,
        "count": int(evt.count),
        "self_cpu_us": us("self_cpu_time_total"),
        "cpu_total_us": us("cpu_time_total"),
        "self_device_us": us("self_device_time_total", "self_cuda_time_total"),
        "device_total_us": us("device_time_total", "cuda_time_total"),
    }


def profile_training_step(out_dir: pathlib.Path | str, size: str = "gpu", steps: int = 3, warmup: int = 2,
                          seed: int = 0) -> dict:
    """Profile ``steps`` training steps of a :class:`~utils.transformer.TinyDecoder`; write and return the data.

    ``size`` is a key of :data:`SIZES` (``"gpu"``: a 1024-wide block at 4 x 1024 tokens in bf16;
    ``"smoke"``: the interpreter-sized model). Returns the ``profile.json`` contents.
    """
    if size not in SIZES:
        raise ValueError(f"bench.profile_step: size must be one of {sorted(SIZES)}, got {size!r}")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"bench.profile_step: {name} must be an int >= {least}, got {value!r}")
    import triton
    from torch.profiler import ProfilerActivity, profile

    import kernel_ladder
    from utils.transformer import BlockConfig, TinyDecoder, block_training_step

    s = SIZES[size]
    device = kernel_ladder.runtime.DEVICE
    cuda = device.type == "cuda"
    config = BlockConfig(hidden=s["hidden"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"], ffn=s["ffn"],
                         vocab=s["vocab"])
    gen = torch.Generator().manual_seed(seed)
    model = TinyDecoder(config, gen, dtype=s["dtype"], device=device)
    tokens = torch.randint(0, config.vocab, (s["batch"], s["seq"]), generator=gen).to(device)
    targets = torch.randint(0, config.vocab, (s["batch"], s["seq"]), generator=gen).to(device)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        block_training_step(model, tokens, targets)

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()

    where = pathlib.Path(out_dir) / "profile"
    where.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(where / "step_trace.json"))
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (where / "top_ops.txt").write_text(averages.table(sort_by=sort, row_limit=30, max_name_column_width=48))
    events = sorted((_event_record(e) for e in averages),
                    key=lambda r: r["self_device_us" if cuda else "self_cpu_us"], reverse=True)
    data = {
        "device": torch.cuda.get_device_name() if cuda else f"{device} ({kernel_ladder.runtime.mode()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mode": kernel_ladder.runtime.mode(),
        "date": time.strftime("%Y-%m-%d"),
        "size": size,
        "sizes": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in s.items()},
        "steps": steps,
        "time_key": "self_device_us" if cuda else "self_cpu_us",
        "events": events,
    }
    (where / "profile.json").write_text(json.dumps(data, indent=2))
    return data


def kernel_ops(data: dict) -> list[dict]:
    """The events of ``kernel_ladder``' custom ops (``kernel_ladder::<name>``), in the data's order."""
    return [e for e in data["events"] if e["name"].startswith("kernel_ladder::")]


def plot_profile(data: dict, top: int = 15, ax=None):
    """Horizontal bars of the ``top`` ``kernel_ladder::`` ops by their self time (device time on a GPU run)."""
    import matplotlib.pyplot as plt

    key = data["time_key"]
    ops = [e for e in kernel_ops(data) if e[key] > 0][:top] or kernel_ops(data)[:top]
    if not ops:
        raise ValueError("bench.profile_step.plot_profile: the profile has no kernel_ladder:: events")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 0.32 * len(ops) + 1.5))
    per_step = [e[key] / data["steps"] / 1e3 for e in ops]
    ax.barh(range(len(ops)), per_step, color="tab:blue")
    ax.set_yticks(range(len(ops)), [e["name"] for e in ops], fontsize=8)
    ax.invert_yaxis()
    kind = "device" if key == "self_device_us" else "CPU"
    ax.set_xlabel(f"self {kind} time per step (ms)")
    ax.set_title(f"torch.profiler, one training step — {data['device']}, {data['date']}", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    return ax


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model size (default: gpu on a CUDA device, smoke elsewhere)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--plot", type=pathlib.Path, help="draw this profile.json instead of profiling")
    parser.add_argument("--image", type=pathlib.Path, help="where --plot saves (default: beside the json)")
    args = parser.parse_args(argv)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        data = json.loads(args.plot.read_text())
        ax = plot_profile(data)
        image = args.image or args.plot.with_suffix(".png")
        ax.figure.tight_layout()
        ax.figure.savefig(image, dpi=110)
        print(f"profile_step: wrote {image}")
        return 0
    size = args.size or ("gpu" if torch.cuda.is_available() else "smoke")
    data = profile_training_step(args.out, size=size, steps=args.steps)
    print((args.out / "profile" / "top_ops.txt").read_text())
    print(f"profile_step: wrote {args.out / 'profile'} ({len(data['events'])} event names)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
