"""``make gpu-check``: correctness at real sizes, then timings against torch, on an NVIDIA GPU.

Runs with the GPU machine's own ``python3`` (the repository on ``PYTHONPATH``, nothing installed):
it needs only torch, triton and ``kernel_ladder``. Without a CUDA device it says so and exits 0.

Every chapter module in :data:`bench.CHAPTER_MODULES` may define ``gpu_checks(size)`` returning
:mod:`bench.gpu` entries. This script runs them in three rounds:

1. every :class:`~bench.gpu.Check` (bf16/fp16 at real sizes against a float32 reference);
2. a device-to-device copy (the bandwidth every memory-bound op is judged against), then every
   :class:`~bench.gpu.Timing` (``triton.testing.do_bench`` medians), as GB/s, TFLOP/s, a
   fraction of the copy bandwidth and a ratio against the op's baseline (an implementation marked
   ``unavailable`` is listed with its reason instead);
3. every :class:`~bench.gpu.Peak` (peak CUDA memory of the callable);
4. MFU: training steps of a ~1B-parameter Llama-shaped :class:`kernel_ladder.models.CausalLM` in bf16
   (fused loss, AdamW), timed by the wall clock between synchronizations; tokens/s, and the model FLOPs of
   :func:`solutions.ch12_end_to_end.step_flops` over the time against the H200's dense bf16 peak;
5. with ``--profile`` (``make gpu-check PROFILE=1``): a ``torch.profiler`` trace of a training
   step of a small decoder, its top-ops table and its events as JSON under ``$OUT/profile``
   (:mod:`bench.profile_step`).

**Rounds and budget.** ``--quick`` (what ``make gpu-check`` runs; ``make gpu-check FULL=1`` runs all)
keeps every op's correctness checks at real sizes (in bf16 where the op has it; the full round adds the other
dtypes) and every peak, times the headline implementations only
(:func:`is_headline`: each op's baseline, those with a target, else the ladder's top; never ``torch.compile``,
whose Inductor compiles cost minutes on a cold cache) and tunes every autotuned kernel over its first
``--candidates`` (1) candidates after pruning (:func:`kernel_ladder.autotune.limit_candidates`: the lists are
ordered best-first). ``--budget-s`` (450 with ``--quick``) stops starting new entries once that many seconds
have passed: what finished is reported, what did not is listed as not started, and the JSON and table are still
written. Each round logs its time. ``--smoke --count-compiles`` counts the kernels a compiled quick and full
run would build (:mod:`bench.compile_count`), for the cold-cache estimate in ``docs/gpu.md``.

Full results go to ``$OUT/gpu_check.json`` (or ``results/gpu_check.json``); a short table is
printed last. ``--smoke`` runs every chapter's checks at tiny sizes on whatever device
``kernel_ladder`` uses (the CPU interpreter included), timing each callable once with a wall clock
and skipping ``torch.compile`` implementations — the test suite uses it so that a rare GPU run
does not die on a typo.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import pathlib
import sys
import time
import traceback

import torch


def _log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Deadline:
    """The run's time budget: ``expired()`` once ``budget_s`` seconds have passed since it was made (never with
    None). Entries not started because of it are counted per round in ``skipped``."""

    def __init__(self, budget_s: float | None, clock=time.monotonic):
        self.budget_s, self.clock, self.start = budget_s, clock, clock()
        self.skipped: dict[str, int] = {}

    def elapsed(self) -> float:
        return self.clock() - self.start

    def expired(self) -> bool:
        return self.budget_s is not None and self.elapsed() > self.budget_s

    def skip(self, round_name: str) -> None:
        self.skipped[round_name] = self.skipped.get(round_name, 0) + 1


#: No deadline (the functions' default: every entry runs).
NO_DEADLINE = Deadline(None)


def is_headline(timing, timings: list) -> bool:
    """Whether ``--quick`` times ``timing``: the op's baseline, an implementation with a target, or — for an op
    where none has a target — its last non-``torch.compile`` implementation (the top of the ladder). Never a
    ``torch.compile`` implementation. A Timing's ``headline`` (True/False) overrides the rule."""
    if timing.headline is not None:
        return timing.headline
    if "compile" in timing.impl:
        return False
    if timing.baseline or timing.target:
        return True
    same_op = [t for t in timings if t.op == timing.op and "compile" not in t.impl]
    return not any(t.target for t in same_op) and same_op[-1] is timing


def quick_entries(entries: list) -> list:
    """The ``--quick`` round's entries: every op's Checks in one dtype (bf16 where the op has it: a second
    16-bit dtype compiles every kernel again), every Peak, and the headline Timings (:func:`is_headline`)."""
    import torch

    from bench.gpu import Check, Timing

    timings = [e for e in entries if isinstance(e, Timing)]
    bf16_ops = {e.op for e in entries if isinstance(e, Check) and e.dtype == torch.bfloat16}

    def kept(entry) -> bool:
        if isinstance(entry, Timing):
            return is_headline(entry, timings)
        if isinstance(entry, Check):
            return entry.dtype == torch.bfloat16 or entry.op not in bf16_ops
        return True

    return [e for e in entries if kept(e)]


def rel_err(out, ref) -> float:
    """``max |out - ref| / (|ref| + 1)`` over every tensor of a (tuple) result."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if len(outs) != len(refs):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, refs):
        o, r = torch.as_tensor(o).float(), torch.as_tensor(r).float().to(torch.as_tensor(o).device)
        if o.shape != r.shape:
            return float("inf")
        if o.numel():
            err = ((o - r).abs() / (r.abs() + 1.0)).max()
            worst = max(worst, float("inf") if torch.isnan(err) else float(err))
    return worst


def collect(size: str, chapters: list[str] | None = None) -> tuple[list, list[str]]:
    """Every chapter's entries for ``size``, and the chapters whose checks could not be built."""
    import bench

    entries, broken = [], []
    for name in bench.CHAPTER_MODULES:
        if chapters and not any(name.split(".")[-1].removeprefix("ch").startswith(c) for c in chapters):
            continue
        try:
            module = importlib.import_module(name)
            if hasattr(module, "gpu_checks"):
                entries += list(module.gpu_checks(size))
        except Exception:  # one chapter's bug must not hide the others' results
            broken.append(f"{name}: {traceback.format_exc(limit=3)}")
    return entries, broken


def _timer(smoke: bool):
    if smoke:
        def once(fn) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return once
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=100)


def run_checks(entries, results: dict, deadline: Deadline = NO_DEADLINE) -> list[str]:
    from bench.gpu import Check

    failures = []
    for check in (e for e in entries if isinstance(e, Check)):
        if deadline.expired():
            deadline.skip("correctness")
            continue
        try:
            err = rel_err(check.run(), check.reference())
            ok = err <= check.tolerance
        except Exception as error:  # a crash is a failed check, with its reason
            err, ok = float("inf"), False
            failures.append(f"{check.op} {check.dtype}: {type(error).__name__}: {error}")
        else:
            if not ok:
                failures.append(f"{check.op} {check.dtype}: relative error {err:.3g} > {check.tolerance:g}")
        results["correctness"].append(
            {"op": check.op, "dtype": str(check.dtype), "rel_err": err, "tol": check.tolerance, "ok": ok}
        )
    return failures


def copy_bandwidth(device, smoke: bool) -> float:
    """GB/s of a device-to-device copy of 2^26 bf16 elements (2^12 in smoke mode)."""
    n = 1 << (12 if smoke else 26)
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    ms = _timer(smoke)(lambda: dst.copy_(x))
    return 2 * n * x.element_size() / ms / 1e6


def run_timings(entries, results: dict, smoke: bool, copy_gbps: float, deadline: Deadline = NO_DEADLINE) -> list[str]:
    from bench.gpu import Timing

    timer, failures, rows = _timer(smoke), [], []
    for timing in (e for e in entries if isinstance(e, Timing)):
        if smoke and "compile" in timing.impl:
            continue  # compiling costs minutes on a CPU; the GPU run covers it
        if deadline.expired():
            deadline.skip("timings")
            continue
        if timing.unavailable:  # recorded with its reason, not timed and not a failure
            rows.append({"op": timing.op, "impl": timing.impl, "ms": None, "target": timing.target,
                         "baseline": timing.baseline, "unavailable": timing.unavailable})
            continue
        try:
            ms = timer(timing.fn)
        except Exception as error:
            failures.append(f"timing {timing.op} / {timing.impl}: {type(error).__name__}: {error}")
            continue
        row = {"op": timing.op, "impl": timing.impl, "ms": ms, "target": timing.target, "baseline": timing.baseline}
        if timing.bytes:
            row["GB/s"] = timing.bytes / ms / 1e6
            row["of_copy"] = row["GB/s"] / copy_gbps
        if timing.flops:
            row["TFLOP/s"] = timing.flops / ms / 1e9
        rows.append(row)
    for row in rows:
        base = next((r["ms"] for r in rows if r["op"] == row["op"] and r["baseline"]), None)
        row["vs_baseline"] = base / row["ms"] if base and row["ms"] else None
    results["timings"] = rows
    return failures


def run_peaks(entries, results: dict, device, deadline: Deadline = NO_DEADLINE) -> list[str]:
    from bench.gpu import Peak

    failures, rows = [], []
    for peak in (e for e in entries if isinstance(e, Peak)):
        if deadline.expired():
            deadline.skip("peaks")
            continue
        try:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                peak.fn()
                torch.cuda.synchronize()
                used = torch.cuda.max_memory_allocated() - start
            else:
                peak.fn()
                used = None  # CPU peak memory is the lesson's business (utils.memory)
        except Exception as error:
            failures.append(f"peak {peak.op} / {peak.impl}: {type(error).__name__}: {error}")
            continue
        rows.append({"op": peak.op, "impl": peak.impl, "peak_bytes": used, "target": peak.target,
                     "baseline": peak.baseline})
    for row in rows:
        base = next((r["peak_bytes"] for r in rows if r["op"] == row["op"] and r["baseline"]), None)
        row["of_baseline"] = row["peak_bytes"] / base if base and row["peak_bytes"] is not None else None
    results["peaks"] = rows
    return failures


#: The ~1B-parameter config of chapter 12's MFU section (smoke: a toy of the same shape).
MFU_CONFIGS = {
    "gpu": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=4, batch=4, seq=2048, steps=5, warmup=2),
    "smoke": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, batch=1, seq=16, steps=1, warmup=1),
}
#: Dense bf16 tensor-core peak of an H200 SXM (NVIDIA's datasheet), what MFU is measured against.
H200_BF16_PEAK = 989e12


def run_mfu(results: dict, device, smoke: bool) -> list[str]:
    """Train a Llama-shaped CausalLM for a few steps; tokens/s and MFU (model FLOPs / time / peak)."""
    from kernel_ladder.models import CausalLM, CausalLMConfig
    from solutions.ch12_end_to_end import step_flops

    spec = dict(MFU_CONFIGS["smoke" if smoke else "gpu"])
    batch, seq, steps, warmup = (spec.pop(k) for k in ("batch", "seq", "steps", "warmup"))
    _log(f"MFU: {spec['num_hidden_layers']} layers of hidden {spec['hidden_size']}, {batch} x {seq} tokens ...")
    try:
        config = CausalLMConfig(**spec, head_dim=spec["hidden_size"] // spec["num_attention_heads"],
                                max_position_embeddings=seq)
        dtype = torch.float32 if smoke else torch.bfloat16
        model = CausalLM(config).to(device=device, dtype=dtype)
        # N of 6·N: every parameter that takes part in a GEMM — all but the token embedding (a gather)
        params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)

        def step() -> float:
            loss = model(ids, labels=ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses = [step() for _ in range(steps)]  # float(loss) synchronizes every step
        seconds = (time.perf_counter() - start) / steps
        if not all(math.isfinite(v) for v in losses):
            return [f"mfu: the training loss is not finite: {losses}"]
    except Exception as error:
        return [f"mfu: {type(error).__name__}: {error}"]
    tokens = batch * seq
    flops = step_flops(params, config.num_hidden_layers, config.hidden_size, seq, tokens)
    results["mfu"] = {"config": {**spec, "batch": batch, "seq": seq}, "non_embedding_params": params,
                      "dtype": str(dtype), "step_s": seconds, "tokens_per_s": tokens / seconds,
                      "model_flops_per_step": flops, "TFLOP/s": flops / seconds / 1e12,
                      "mfu_vs_h200_bf16_peak": flops / seconds / H200_BF16_PEAK}
    return []


def run_profile(out_dir: pathlib.Path, results: dict, smoke: bool) -> list[str]:
    """``--profile``: :func:`bench.profile_step.profile_training_step` under ``out_dir/profile``."""
    from bench.profile_step import kernel_ops, profile_training_step

    _log("profiling a training step ...")
    try:
        data = profile_training_step(out_dir, size="smoke" if smoke else "gpu", steps=1 if smoke else 3,
                                     warmup=1 if smoke else 2)
    except Exception as error:
        return [f"profile: {type(error).__name__}: {error}"]
    key = data["time_key"]
    results["profile"] = {"dir": str(out_dir / "profile"), "time_key": key,
                          "top_kernels_ops": [{"name": e["name"], key: e[key]} for e in kernel_ops(data)[:10]]}
    return []


def summary(results: dict, failures: list[str]) -> str:
    lines = [f"gpu-check on {results['device']} (torch {results['torch']}, triton {results['triton']}, "
             f"{results['date']}); copy {results['copy_GBps']:.0f} GB/s"]
    if results.get("round"):
        lines.append(f"round: {results['round']}" + "".join(
            f"; {name} {sec:.0f} s" for name, sec in results.get("round_seconds", {}).items()))
    if results.get("not_started"):
        lines.append("budget of {:.0f} s spent: not started: {}".format(results["budget_s"], ", ".join(
            f"{n} {name}" for name, n in results["not_started"].items())))
    n_ok = sum(c["ok"] for c in results["correctness"])
    lines.append(f"correctness: {n_ok}/{len(results['correctness'])} ok")
    lines += [f"  FAIL {f}" for f in failures]
    lines.append(f"{'op':<34}{'impl':<22}{'ms':>9}{'GB/s':>8}{'of copy':>8}{'TFLOP/s':>9}{'vs base':>8}  target")
    for r in results["timings"]:
        if r["ms"] is None:
            lines.append(f"{r['op']:<34}{r['impl']:<22}  unavailable: {r.get('unavailable', '')}")
            continue
        gbps = f"{r['GB/s']:.0f}" if "GB/s" in r else "—"
        of_copy = f"{r['of_copy']:.0%}" if "of_copy" in r else "—"
        tflops = f"{r['TFLOP/s']:.1f}" if "TFLOP/s" in r else "—"
        vs = f"{r['vs_baseline']:.2f}×" if r["vs_baseline"] else "—"
        lines.append(f"{r['op']:<34}{r['impl']:<22}{r['ms']:>9.3f}{gbps:>8}{of_copy:>8}{tflops:>9}{vs:>8}  "
                     f"{r['target']}")
    for r in results["peaks"]:
        used = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f} MiB"
        ratio = f"{r['of_baseline']:.2f}× of baseline" if r["of_baseline"] else ""
        lines.append(f"peak memory {r['op']:<22}{r['impl']:<22}{used:>12}  {ratio}  {r['target']}")
    if "mfu" in results:
        m = results["mfu"]
        lines.append(f"training step ({m['non_embedding_params'] / 1e9:.2f}B non-embedding params, {m['dtype']}): "
                     f"{m['step_s'] * 1e3:.1f} ms, {m['tokens_per_s']:,.0f} tokens/s, {m['TFLOP/s']:.1f} model "
                     f"TFLOP/s = MFU {m['mfu_vs_h200_bf16_peak']:.1%} of an H200's {H200_BF16_PEAK / 1e12:.0f}")
    if "profile" in results:
        prof = results["profile"]
        lines.append(f"profile ({prof['dir']}): top kernel_ladder ops by {prof['time_key']}")
        lines += [f"  {e['name']:<44}{e[prof['time_key']] / 1e3:>10.3f} ms" for e in prof["top_kernels_ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device (a test of this script)")
    parser.add_argument("--quick", action="store_true",
                        help="every check and peak, the headline timings, autotuning over the first --candidates "
                             "candidates, within --budget-s (make gpu-check; FULL=1 drops it)")
    parser.add_argument("--candidates", type=int, default=1,
                        help="with --quick: candidates each autotuned kernel keeps after pruning (default 1: "
                             "the likeliest winner, compiled alone, no benchmarking)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new entries after this many seconds (default: 450 with --quick, "
                             "none otherwise); the JSON and table are still written")
    parser.add_argument("--count-compiles", action="store_true",
                        help="with --smoke: count the kernels a compiled quick and full run would build "
                             "(bench.compile_count) into the JSON and the table")
    parser.add_argument("--chapters", nargs="*", help="only these chapters (e.g. 02 04)")
    parser.add_argument("--profile", action="store_true",
                        help="also write a torch.profiler trace of a training step under $OUT/profile "
                             "(bench.profile_step; make gpu-check PROFILE=1)")
    args = parser.parse_args(argv)
    if args.count_compiles and not args.smoke:
        parser.error("--count-compiles counts in the interpreter: use it with --smoke")
    if not args.smoke and not torch.cuda.is_available():
        print("make gpu-check: no CUDA device is visible here, so there is nothing to check.\n"
              "Run it on a machine with an NVIDIA GPU (it uses that machine's python3, torch and triton, "
              "with this repository on PYTHONPATH). On the CPU, `make test` and `make report` cover "
              "correctness and traffic.")
        return 0
    import triton

    import kernel_ladder
    from kernel_ladder.autotune import limit_candidates

    budget = args.budget_s if args.budget_s is not None else (450.0 if args.quick else None)
    deadline = Deadline(budget)
    device = kernel_ladder.runtime.DEVICE
    out_dir = pathlib.Path(os.environ.get("OUT") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "device": (torch.cuda.get_device_name() if device.type == "cuda"
                   else f"{device} ({kernel_ladder.runtime.mode()})"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mode": kernel_ladder.runtime.mode(),
        "date": time.strftime("%Y-%m-%d"),
        "size": "smoke" if args.smoke else "gpu",
        "round": f"quick (first {args.candidates} autotune candidates)" if args.quick else "full",
        "budget_s": budget,
        "correctness": [],
    }
    _log(f"{results['device']}; torch {results['torch']}, triton {results['triton']}; {results['round']} round"
         + (f", budget {budget:.0f} s" if budget is not None else ""))
    entries, broken = collect(results["size"], args.chapters)
    failures = [f"could not build checks: {b}" for b in broken]
    counter = None
    if args.count_compiles:  # every entry runs; the counter knows which ones the quick round keeps
        from bench.compile_count import CompileCounter

        counter = CompileCounter(limits=tuple(sorted({1, args.candidates})))
        quick_ids = {id(e) for e in quick_entries(entries)}
        entries = [_counted(e, counter, id(e) in quick_ids) for e in entries]
    elif args.quick:
        entries = quick_entries(entries)
    seconds: dict[str, float] = {}
    results["round_seconds"] = seconds

    def timed_round(name: str, fn):
        start = time.monotonic()
        found = fn()
        seconds[name] = time.monotonic() - start
        _log(f"{name}: {seconds[name]:.1f} s (run {deadline.elapsed():.0f} s"
             + (f" of {budget:.0f}" if budget is not None else "") + ")")
        return found

    limit = limit_candidates(args.candidates if args.quick else None)
    installed = counter.installed() if counter is not None else contextlib.nullcontext()
    with limit, installed:
        _log(f"{len(entries)} entries from the chapters; correctness ...")
        failures += timed_round("correctness", lambda: run_checks(entries, results, deadline))
        results["copy_GBps"] = copy_bandwidth(device, args.smoke)
        _log(f"copy {results['copy_GBps']:.0f} GB/s; timings ...")
        failures += timed_round("timings", lambda: run_timings(entries, results, args.smoke, results["copy_GBps"],
                                                               deadline))
        failures += timed_round("peaks", lambda: run_peaks(entries, results, device, deadline))
        if deadline.expired():
            deadline.skip("mfu")
        else:
            if counter is not None:
                counter.quick = True
            failures += timed_round("mfu", lambda: run_mfu(results, device, args.smoke))
        if args.profile:
            if deadline.expired():
                deadline.skip("profile")
            else:
                failures += timed_round("profile", lambda: run_profile(out_dir, results, args.smoke))
    results["not_started"] = deadline.skipped
    if deadline.skipped:
        _log(f"budget of {budget:.0f} s spent: not started: {deadline.skipped}")
    if counter is not None:
        results["compiles"] = compile_summary(counter, entries)
    results["failures"] = failures
    path = out_dir / ("gpu_check_smoke.json" if args.smoke else "gpu_check.json")
    path.write_text(json.dumps(results, indent=2, default=str))
    _log(f"wrote {path}")
    print()
    print(summary(results, failures))
    if counter is not None:
        print(compile_table(results["compiles"]))
    return 1 if failures else 0


def _counted(entry, counter, in_quick: bool):
    """``entry`` with its callable wrapped to tell ``counter`` which round it belongs to."""
    import dataclasses

    name = "fn" if hasattr(entry, "fn") else "run"

    def wrapped(fn=getattr(entry, name)):
        counter.quick = in_quick
        return fn()

    return dataclasses.replace(entry, **{name: wrapped})


#: Seconds per sm_90 compile measured on a 2-core CPU (bench.compile_count.measure_compile_seconds over the quick
#: sets of tests/aot: flash attention 12 compiles, matmul 16, paged attention 8, norms 22; means), by kernel family.
COMPILE_SECONDS = {"flash_attention": 3.7, "matmul": 1.6, "paged_attention": 1.6, "other": 0.7}
_MATMUL_FAMILY = ("matmul", "gated_mlp", "dual_matmul", "quantized_linear", "w8a8", "linear_activation")


def compile_seconds(kernel: str) -> float:
    """The measured seconds of one compile of ``kernel``'s family (:data:`COMPILE_SECONDS`)."""
    if kernel.startswith("flash_attention") and "preprocess" not in kernel and "cu_seqlens" not in kernel:
        return COMPILE_SECONDS["flash_attention"]
    if kernel.startswith("paged_attention_kernel"):
        return COMPILE_SECONDS["paged_attention"]
    if any(kernel.startswith(prefix) or prefix in kernel for prefix in _MATMUL_FAMILY):
        return COMPILE_SECONDS["matmul"]
    return COMPILE_SECONDS["other"]


def compile_summary(counter, entries) -> dict:
    """The counted compilations of a quick round (per candidate limit) and a full one (:mod:`bench.compile_count`),
    per kernel, with the compile time they would take at :data:`COMPILE_SECONDS` (an estimate from a 2-core CPU)."""
    from bench.gpu import Timing

    def estimate(by_kernel: dict) -> float:
        return sum(n * compile_seconds(name) for name, n in by_kernel.items())

    inductor = [e for e in entries if isinstance(e, Timing) and "compile" in e.impl and not e.unavailable]
    full = counter.by_kernel(counter.full_keys)
    quick = {k: counter.by_kernel(keys) for k, keys in sorted(counter.quick_keys.items())}
    return {
        "full": len(counter.full_keys), "full_by_kernel": full, "full_estimate_s": estimate(full),
        "quick": {k: sum(v.values()) for k, v in quick.items()}, "quick_by_kernel": quick,
        "quick_estimate_s": {k: estimate(v) for k, v in quick.items()},
        "seconds_per_compile": COMPILE_SECONDS, "torch_compile_timings_full_only": len(inductor),
    }


def compile_table(compiles: dict) -> str:
    limits = list(compiles["quick"])
    lines = ["kernel compilations a cold cache would build (counted in the interpreter at smoke sizes: an upper-bound "
             "estimate), and their compile time at the seconds per compile measured on a 2-core CPU (an estimate "
             "from that machine, not the GPU machine's)",
             f"{'kernel':<44}" + "".join(f"{f'quick k={k}':>12}" for k in limits) + f"{'full':>8}"]
    for name, full in compiles["full_by_kernel"].items():
        lines.append(f"{name:<44}" + "".join(f"{compiles['quick_by_kernel'][k].get(name, 0):>12}" for k in limits)
                     + f"{full:>8}")
    lines.append(f"{'total':<44}" + "".join(f"{compiles['quick'][k]:>12}" for k in limits) + f"{compiles['full']:>8}")
    lines.append(f"{'compile seconds (estimate)':<44}" + "".join(f"{compiles['quick_estimate_s'][k]:>12.0f}"
                                                                 for k in limits)
                 + f"{compiles['full_estimate_s']:>8.0f}")
    lines.append(f"plus {compiles['torch_compile_timings_full_only']} torch.compile timings in the full round "
                 "(Inductor's compiles, not counted here)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
