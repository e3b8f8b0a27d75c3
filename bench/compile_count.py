"""How many kernels a cold-cache ``make gpu-check`` compiles: counted in the interpreter, estimated in seconds.

A compiled run builds one binary per distinct (kernel, specialization, config): the specialization is what
Triton's launcher derives from the arguments (pointer dtypes and 16-byte alignment, integers equal to 1 or
divisible by 16: :func:`utils.aot.launch_specialization`) with the constexpr values; the config is the launch's
``num_warps``/``num_stages`` and, for an autotuned kernel, each candidate its pruner keeps (the autotuner
compiles every one the first time it meets a tuning key; later keys at the same specialization reuse them).

:class:`CompileCounter` records every launch of ``python -m bench.gpu_check --smoke --count-compiles`` (the
interpreter runs the same entries at tiny sizes) and counts those keys. The interpreter launches an autotuned
kernel with its one fixed tile, so for those kernels (:data:`AUTOTUNED`) the counter replaces the tile by the
GPU candidates the kernel's own pruner keeps for the recorded arguments, under the candidate limit of the round
(:func:`kernel_ladder.autotune.limit_candidates`), at an H200's shared memory. The count is an upper-bound
estimate, not the GPU run's exact figure: smoke sizes are tiny, so matmul's size rule is not applied (every
candidate that fits shared memory is counted, as at 4096³), smaller head dims let more attention tiles fit than
at 128, and an explicit matmul tile is counted as if autotuned. ``torch.compile`` timings (Inductor's own
compiles, skipped by ``--smoke``) are counted apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

#: The kernels autotuned on a GPU: name -> (candidates as triton.Config, pruner), built lazily.
AUTOTUNED = ("matmul_kernel", "flash_attention_forward_kernel", "flash_attention_backward_dkdv_kernel",
             "flash_attention_backward_dq_kernel")
#: The constexprs an autotuned kernel's config sets (replaced by each candidate's).
_TILE_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
#: Shared memory per block of an H200 (227 KiB): what the pruners are evaluated against.
H200_SHARED_MEMORY = 227 * 1024


def _candidates(name: str, named_args: dict, constexprs: dict) -> list:
    """The GPU candidates ``name``'s pruner keeps for a launch with these arguments, under the current limit."""
    from kernel_ladder import autotune as at

    if name == "matmul_kernel":
        # the size rule is left out (smoke sizes are tiny): every candidate that fits, as at real sizes
        sized = {**named_args, "M": 1 << 16, "N": 1 << 16, "K": 1 << 16}
        kept = at.limited(at.prune_configs)([c.to_triton() for c in at.GPU_CONFIGS], sized)
        return [(dict(c.kwargs, EVEN_K=named_args["K"] % c.kwargs["BLOCK_K"] == 0), c.num_warps, c.num_stages)
                for c in kept]
    from kernel_ladder.ops.attention import configs

    kind = {"flash_attention_forward_kernel": "forward", "flash_attention_backward_dkdv_kernel": "dkdv",
            "flash_attention_backward_dq_kernel": "dq"}[name]
    candidates = configs._GPU_CONFIGS[kind]
    kept = at.limited(configs._pruner(kind, candidates))([c.to_triton() for c in candidates], named_args,
                                                         **constexprs)
    return [(dict(c.kwargs), c.num_warps, c.num_stages) for c in kept]


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(sorted(map(str, value)))
    return str(value)


@dataclass
class CompileCounter:
    """Distinct (kernel, specialization, config) keys of the launches seen, split by round.

    ``quick`` says whether the entry now running is in the ``--quick`` round (set by ``bench.gpu_check``).
    Keys are kept per round: ``full_keys`` (every entry, every candidate) and ``quick_keys[k]`` for each
    candidate limit ``k`` of ``limits`` (the quick round's entries, the first ``k`` candidates).
    """

    limits: tuple[int, ...] = (1, 2)
    quick: bool = True
    full_keys: set = field(default_factory=set)
    quick_keys: dict = field(default_factory=dict)
    _jit: dict = field(default_factory=dict)

    def _params(self, fn):
        from triton.runtime.jit import JITFunction

        if fn.fn not in self._jit:
            names = ("do_not_specialize", "do_not_specialize_on_alignment")
            self._jit[fn.fn] = JITFunction(fn.fn, **{k: fn.kwargs[k] for k in names if fn.kwargs.get(k)})
        return self._jit[fn.fn]

    def record(self, fn, args: tuple, kwargs: dict) -> None:
        from kernel_ladder.autotune import limit_candidates
        from utils.aot import launch_specialization

        jit = self._params(fn)
        kwargs = dict(kwargs)
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        bound = dict(zip(jit.arg_names, args)) | kwargs
        constexpr_names = {p.name for p in jit.params if p.is_constexpr}
        values = {k: v for k, v in bound.items() if k not in constexpr_names}
        constexprs = {k: v for k, v in bound.items() if k in constexpr_names}
        spec = launch_specialization(jit, values)
        name = fn.fn.__name__
        base = (name, _freeze(spec.types), _freeze(spec.ones), _freeze(spec.divisible))
        if name in AUTOTUNED:
            fixed = {k: v for k, v in constexprs.items() if k not in _TILE_KEYS}
            rounds = [(self.full_keys, None)]
            if self.quick:
                rounds += [(self.quick_keys.setdefault(k, set()), k) for k in self.limits]
            for keys, limit in rounds:
                with limit_candidates(limit):
                    for tiles, warps, stages in _candidates(name, values, constexprs):
                        keys.add(base + (_freeze({**fixed, **tiles}), warps, stages))
            return
        key = base + (_freeze(constexprs), options.get("num_warps", 4), options.get("num_stages", 3))
        self.full_keys.add(key)
        if self.quick:
            for k in self.limits:
                self.quick_keys.setdefault(k, set()).add(key)

    def by_kernel(self, keys: set) -> dict[str, int]:
        counts: dict[str, int] = {}
        for key in keys:
            counts[key[0]] = counts.get(key[0], 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    @contextlib.contextmanager
    def installed(self) -> Iterator[CompileCounter]:
        """Record every interpreted launch (they still run) while the block runs, at an H200's shared memory."""
        from triton.runtime.interpreter import InterpretedFunction

        from kernel_ladder import autotune as at

        real_run, real_limit = InterpretedFunction.run, at._shared_memory_limit
        counter = self

        def run(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                counter.record(fn, args, kwargs)
            return real_run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        at._shared_memory_limit = lambda: H200_SHARED_MEMORY
        import kernel_ladder.ops.attention.configs as attention_configs

        attention_configs._shared_memory_limit = at._shared_memory_limit
        try:
            yield self
        finally:
            InterpretedFunction.run = real_run
            at._shared_memory_limit = real_limit
            attention_configs._shared_memory_limit = real_limit


#: The compile scripts of tests/aot timed by :func:`measure_compile_seconds` (their quick sets): the hot kernels.
TIMED_SCRIPTS = ("flash_attention", "matmul", "paged_attention", "norm")


def measure_compile_seconds(tmp_path, scripts: tuple[str, ...] = TIMED_SCRIPTS) -> dict[str, list[float]]:
    """Seconds of each sm_90 compile on this machine: each ``tests/aot/<script>.py`` (its ``--quick`` set) run in
    a compiled-mode child with a fresh Triton cache (:func:`utils.aot.run_compiled`), every ``triton.compile``
    that :func:`utils.aot.compile_kernel` makes timed (``bench/_compile_time.py``)."""
    import json
    import pathlib

    from utils.aot import run_compiled

    here = pathlib.Path(__file__).resolve().parent
    measured = {}
    for name in scripts:
        script = here.parent / "tests" / "aot" / f"{name}.py"
        result = run_compiled(here / "_compile_time.py", pathlib.Path(tmp_path) / name, timeout=900,
                              args=(str(script),))
        lines = result.stdout.strip().splitlines()
        if not lines:
            raise RuntimeError(f"bench.compile_count: timing {name} failed: {result.stderr[-2000:]}")
        measured[name] = json.loads(lines[-1])
    return measured
