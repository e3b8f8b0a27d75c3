"""``make gpu-check``: correctness at real sizes, then bandwidth against torch, on an NVIDIA GPU.

Runs with the GPU machine's own ``python3`` (the repository on ``PYTHONPATH``, nothing installed):
it needs only torch, triton and ``kernels``. Without a CUDA device it says so and exits 0.

1. Correctness of every op in bf16 and fp16 at 2^24 elements (forward, and backward where the op
   has one) against torch computed in fp32.
2. Bandwidth of add, gelu, swiglu and dropout at 2^26 elements against torch eager,
   ``torch.compile`` and a device-to-device copy (``triton.testing.do_bench`` medians).

Full results go to ``$OUT/gpu_check.json`` (or ``results/gpu_check.json``); a short table is
printed last. Target (a benchmark, not a test): >= 90% of the copy bandwidth at 2^26 elements.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def correctness(kernels, results: dict) -> list[str]:
    failures = []
    n_rows, n_cols = 4096, 4096  # 2^24 elements
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype, generator=gen)
        y = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype, generator=gen)
        cases = {
            "add": (lambda: kernels.add(x, y), lambda: x.float() + y.float()),
            "add (broadcast row)": (lambda: kernels.add(x, y[:1]), lambda: x.float() + y[:1].float()),
            "add (transposed)": (lambda: kernels.add(x.t(), y), lambda: x.t().float() + y.float()),
            "gelu": (lambda: kernels.gelu(x), lambda: F.gelu(x.float())),
            "gelu tanh": (lambda: kernels.gelu(x, approximate="tanh"), lambda: F.gelu(x.float(), approximate="tanh")),
            "silu": (lambda: kernels.silu(x), lambda: F.silu(x.float())),
            "swiglu": (lambda: kernels.swiglu(x, y), lambda: F.silu(x.float()) * y.float()),
        }
        for name, (ours, ref) in cases.items():
            err = _rel_err(ours(), ref())
            ok = err <= TOL[dtype]
            results.setdefault("correctness", []).append({"op": name, "dtype": str(dtype), "rel_err": err, "ok": ok})
            if not ok:
                failures.append(f"{name} {dtype}: relative error {err:.3g}")
        # backward
        for name, ours_fn, ref_fn in (
            ("gelu backward", kernels.gelu, F.gelu),
            ("silu backward", kernels.silu, F.silu),
            ("swiglu backward", lambda a: kernels.swiglu(a, y), lambda a: F.silu(a) * y.float()),
        ):
            a = x.clone().requires_grad_(True)
            af = x.float().clone().requires_grad_(True)
            g = torch.randn_like(x)
            (ga,) = torch.autograd.grad(ours_fn(a), a, g)
            (gf,) = torch.autograd.grad(ref_fn(af), af, g.float())
            err = _rel_err(ga, gf)
            ok = err <= TOL[dtype]
            results["correctness"].append({"op": name, "dtype": str(dtype), "rel_err": err, "ok": ok})
            if not ok:
                failures.append(f"{name} {dtype}: relative error {err:.3g}")
        # dropout: the mask is deterministic in the seed, kept values are scaled, the fraction is ~1-p
        p = 0.1
        out = kernels.dropout(x, p, seed=7)
        again = kernels.dropout(x, p, seed=7)
        kept = out != 0
        frac = kept.float().mean().item()
        scaled_ok = torch.allclose(out[kept].float(), x[kept].float() / (1 - p), rtol=TOL[dtype], atol=TOL[dtype])
        ok = torch.equal(out, again) and abs(frac - (1 - p)) < 1e-3 and scaled_ok
        results["correctness"].append({"op": "dropout", "dtype": str(dtype), "kept": frac, "ok": ok})
        if not ok:
            failures.append(f"dropout {dtype}: kept {frac:.4f}, deterministic/scaled check failed")
    return failures


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float(((out - ref).abs() / (ref.abs() + 1.0)).max())


def bandwidth(kernels, results: dict) -> list[dict]:
    from triton.testing import do_bench

    n = 1 << 26
    rows = []
    dtype = torch.bfloat16
    x = torch.randn(n, device="cuda", dtype=dtype)
    y = torch.randn(n, device="cuda", dtype=dtype)
    dst = torch.empty_like(x)
    size = x.element_size()
    copy_ms = do_bench(lambda: dst.copy_(x), warmup=50, rep=300)
    copy_gbps = 2 * n * size / copy_ms / 1e6
    rows.append({"op": "copy (device to device)", "impl": "torch", "ms": copy_ms, "GB/s": copy_gbps, "of_copy": 1.0})
    ops = {
        "add": (3, lambda: kernels.add(x, y), lambda a, b: a + b, (x, y)),
        "gelu": (2, lambda: kernels.gelu(x), F.gelu, (x,)),
        "swiglu": (3, lambda: kernels.swiglu(x, y), lambda a, b: F.silu(a) * b, (x, y)),
        "dropout p=0.1": (2, lambda: kernels.dropout(x, 0.1, seed=1), lambda a: F.dropout(a, 0.1), (x,)),
    }
    for name, (passes, ours, torch_fn, args) in ops.items():
        moved = passes * n * size
        impls = {"kernels": ours, "torch eager": lambda f=torch_fn, a=args: f(*a)}
        try:
            compiled = torch.compile(torch_fn)
            compiled(*args)
            impls["torch.compile"] = lambda f=compiled, a=args: f(*a)
        except Exception as error:  # a compile failure is a result, not a crash
            _log(f"torch.compile failed for {name}: {error}")
        for impl, fn in impls.items():
            ms = do_bench(fn, warmup=50, rep=300)
            gbps = moved / ms / 1e6
            rows.append({"op": name, "impl": impl, "ms": ms, "GB/s": gbps, "of_copy": gbps / copy_gbps})
    results["bandwidth"] = rows
    results["bandwidth_config"] = {"n": n, "dtype": str(dtype), "copy_GBps": copy_gbps}
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("make gpu-check: no CUDA device is visible here, so there is nothing to check.\n"
              "Run it on a machine with an NVIDIA GPU (it uses that machine's python3, torch and triton, "
              "with this repository on PYTHONPATH). On the CPU, `make test` and `make report` cover "
              "correctness and traffic.")
        return 0
    import triton

    import kernels

    out_dir = pathlib.Path(os.environ.get("OUT") or "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mode": kernels.runtime.mode(),
        "date": time.strftime("%Y-%m-%d"),
    }
    _log(f"{results['device']}; torch {results['torch']}, triton {results['triton']}")
    _log("correctness (bf16, fp16; 2^24 elements) ...")
    failures = correctness(kernels, results)
    _log("bandwidth (bf16; 2^26 elements) ...")
    rows = bandwidth(kernels, results)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2))
    _log(f"wrote {out_dir / 'gpu_check.json'}")

    print()
    print(f"gpu-check on {results['device']} (torch {results['torch']}, triton {results['triton']})")
    print(f"correctness: {len(results['correctness']) - len(failures)}/{len(results['correctness'])} ok")
    for f in failures:
        print(f"  FAIL {f}")
    print(f"{'op':<24}{'impl':<15}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    for r in rows:
        print(f"{r['op']:<24}{r['impl']:<15}{r['ms']:>9.3f}{r['GB/s']:>9.0f}{r['of_copy']:>9.0%}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
