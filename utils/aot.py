"""Compile a Triton kernel ahead of time for an NVIDIA GPU this machine does not have.

Triton compiles for a named target (``GPUTarget("cuda", 90, 32)`` is a Hopper H100/H200) down
to PTX and, with the ptxas it ships, to a cubin — no GPU and no driver needed. That proves on a
laptop what the interpreter cannot: that a kernel is valid compiled Triton for every
specialization the launcher will create, which instructions it becomes (128-bit vector loads,
``wgmma`` tensor-core ops), and whether ptxas had to spill registers to local memory.

Two halves, because kernels are interpreted or compiled per *process* (``kernel_ladder.runtime``):

* in the test (interpreter) process, :func:`run_compiled` runs a script in a child process
  with compiled mode forced and its own Triton cache;
* in that script, :func:`compile_kernel` builds the signature Triton's launcher would build for
  real arguments (pointer element types, integers equal to 1 turned into constants, arguments
  divisible by 16 marked so) and compiles it; :func:`resource_usage` reads registers and spilled
  bytes from the cubin; :func:`vectorized` looks for 128-bit accesses in the PTX.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HOPPER",
    "Launch",
    "Occupancy",
    "Specialization",
    "Usage",
    "compile_kernel",
    "compile_launched",
    "launch_specialization",
    "occupancy",
    "record_launches",
    "resource_usage",
    "run_compiled",
    "vectorized",
]

#: (backend, compute capability, warp size) of an H100/H200.
HOPPER = ("cuda", 90, 32)

_VECTOR_LOADS = ("ld.global.v4", "ld.global.nc.v4")
_VECTOR_STORES = ("st.global.v4",)


def run_compiled(script: str | os.PathLike, tmp_path: Path | str, timeout: float = 600,
                 args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` in a child Python in compiled mode (kernels not interpreted), a fresh Triton cache.

    ``script`` is the path of a Python file (the compile scripts live in ``tests/aot/``, real files
    that ruff checks), or the text of one, which is written to ``tmp_path`` first (``@triton.jit``
    needs a kernel's source file). The calling process runs the interpreter
    (``TRITON_INTERPRET=1``); the child must not inherit it. The repository is put on the child's
    ``PYTHONPATH`` so that it imports this checkout's ``kernel_ladder`` and ``utils``.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = str(Path(__file__).resolve().parent.parent)
    env.update(KERNEL_LADDER_INTERPRET="0", TRITON_CACHE_DIR=str(Path(tmp_path) / "triton-cache"),
               TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([repo, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]))
    if isinstance(script, str) and "\n" in script:
        path = Path(tmp_path) / "aot_script.py"
        path.write_text(script)
    else:
        path = Path(script)
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def compile_kernel(
    fn,
    types: Mapping[str, str] | Callable[[str], str],
    constexprs: Mapping[str, object] | None = None,
    *,
    ones: Collection[str] = (),
    divisible: Collection[str] | Callable[[str], bool] = (),
    aligned_pointers: bool = True,
    num_warps: int = 4,
    num_stages: int | None = None,
    target: tuple[str, int, int] = HOPPER,
):
    """Compile ``fn`` (a ``@triton.jit`` function, in compiled mode) for ``target``; returns Triton's kernel.

    Args:
        types: each runtime argument's type as Triton spells it (``"*bf16"``, ``"i32"``, ``"fp32"``),
            as a mapping or a function of the argument's name.
        constexprs: values of the constexpr parameters (and of any runtime argument to fix).
        ones: integer arguments whose value is 1 (a unit stride): Triton's launcher specializes
            those into constants, so the compiled code is the one a real call gets.
        divisible: arguments to mark divisible by 16, as the launcher does for torch allocations and
            sizes like 4096 (names, or a predicate on the name).
        aligned_pointers: mark every pointer 16-byte aligned (a fresh torch allocation is; a view
            sliced off an element boundary is not — pass False for the unspecialized case).
        num_warps, num_stages: the launch options.

    The result's ``.asm`` holds ``"ttgir"``, ``"ptx"`` and (with ptxas) ``"cubin"``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs or {})
    is_divisible = divisible if callable(divisible) else (lambda name, names=frozenset(divisible): name in names)
    type_of = types if callable(types) else types.__getitem__
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr or name in constexprs:
            signature[name] = "constexpr"
        elif name in ones:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = type_of(name)
            if (aligned_pointers and name.endswith("_ptr")) or is_divisible(name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    source = ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget(*target), options=options)


# ----------------------------------------------------------------------------------------------
# The launcher's specialization, from the values a real launch passes
# ----------------------------------------------------------------------------------------------

#: torch dtypes as Triton's signature spells a pointer to them (what the launcher writes for a tensor).
_POINTER_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
    "bool": "i1",
}


@dataclass(frozen=True)
class Specialization:
    """What Triton's launcher makes of a call's runtime arguments: each one's type, the integers equal to 1
    (turned into constants), and the arguments marked divisible by 16 (integers that are, 16-byte aligned
    pointers) — the arguments of :func:`compile_kernel` that reproduce the launched variant."""

    types: dict[str, str]
    ones: frozenset[str]
    divisible: frozenset[str]


def launch_specialization(fn, values: Mapping[str, object]) -> Specialization:
    """The specialization Triton's launcher derives from ``values``, one example value per runtime argument of ``fn``.

    The launcher's rules (``triton.runtime.jit``): an ``int`` equal to 1 becomes a constant; an ``int``
    divisible by 16 (0 included) gets the divisibility attribute; an ``int`` outside int32 is ``i64``; a
    ``float`` is ``fp32``; a ``bool`` is ``i1``; a tensor is a pointer to its dtype, divisible when its
    address is a multiple of 16 (a fresh torch allocation). Parameters in ``do_not_specialize`` get neither
    the constant nor the attribute; those in ``do_not_specialize_on_alignment`` no pointer alignment. A value
    may also be a pointer's type written as a string (``"*bf16"``: a 16-byte aligned allocation of that
    dtype). Every runtime argument needs a value (constexpr parameters are left to ``constexprs``): one
    forgotten would silently compile a variant no launch builds.
    """
    types, ones, divisible = {}, set(), set()
    missing = [p.name for p in fn.params if not p.is_constexpr and p.name not in values]
    if missing:
        raise ValueError(f"utils.aot.launch_specialization: values must hold every runtime argument of "
                         f"{fn.__name__}; missing {missing}")
    for param in fn.params:
        if param.is_constexpr:
            continue
        name, value = param.name, values[param.name]
        specialize = not param.do_not_specialize
        if isinstance(value, str):
            if not value.startswith("*"):
                raise TypeError(f"utils.aot.launch_specialization: a string value is a pointer type like '*bf16'; "
                                f"{name} got {value!r}")
            types[name] = value
            if specialize and not param.do_not_specialize_on_alignment:
                divisible.add(name)
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else ("i64" if -(2**63) <= value < 2**63 else "u64")
            if specialize and value == 1:
                ones.add(name)
            elif specialize and value % 16 == 0:
                divisible.add(name)
        elif isinstance(value, float):
            types[name] = "fp32"
        elif hasattr(value, "data_ptr") and hasattr(value, "dtype"):
            types[name] = "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            if specialize and not param.do_not_specialize_on_alignment and value.data_ptr() % 16 == 0:
                divisible.add(name)
        else:
            raise TypeError(f"utils.aot.launch_specialization: {name} must be an int, float, bool, tensor or "
                            f"pointer type string; got {type(value).__name__}")
    return Specialization(types, frozenset(ones), frozenset(divisible))


def compile_launched(fn, values: Mapping[str, object], constexprs: Mapping[str, object] | None = None, *,
                     num_warps: int = 4, num_stages: int | None = None, target: tuple[str, int, int] = HOPPER):
    """:func:`compile_kernel` at the specialization a launch with ``values`` builds (:func:`launch_specialization`).

    ``values`` holds the launch's runtime arguments by name (the recorded ones of :func:`record_launches`, or
    examples: ``{"head_dim": 128, "q_ptr": "*bf16", ...}``); ``constexprs`` its constexpr arguments.
    """
    spec = launch_specialization(fn, values)
    return compile_kernel(fn, spec.types, constexprs, ones=spec.ones, divisible=spec.divisible,
                          aligned_pointers=False, num_warps=num_warps, num_stages=num_stages, target=target)


@dataclass
class Launch:
    """One recorded ``kernel[grid](...)`` call: its runtime arguments and constexprs by name, and its options."""

    grid: object
    values: dict[str, object]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int | None = None

    def compile(self, fn, target: tuple[str, int, int] = HOPPER):
        """The launched variant, compiled for ``target`` (:func:`compile_launched`)."""
        return compile_launched(fn, self.values, self.constexprs, num_warps=self.num_warps,
                                num_stages=self.num_stages, target=target)


class record_launches:  # noqa: N801  (a context manager used like a function)
    """Within ``with record_launches(module, "kernel_name") as launches:``, ``module.kernel_name[grid](...)``
    records a :class:`Launch` in ``launches`` instead of running: the exact arguments a launcher passes
    (call it with CPU tensors of real shapes; nothing executes, so no GPU is needed)."""

    def __init__(self, module, name: str):
        self.module, self.name, self.launches = module, name, []

    def __enter__(self) -> list[Launch]:
        self.kernel = getattr(self.module, self.name)
        kernel, launches = self.kernel, self.launches

        class Recorder:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
                    bound = dict(zip(kernel.arg_names, args)) | kwargs
                    constexpr = {p.name for p in kernel.params if p.is_constexpr}
                    launches.append(Launch(grid, {k: v for k, v in bound.items() if k not in constexpr},
                                           {k: v for k, v in bound.items() if k in constexpr}, **options))

                return call

        setattr(self.module, self.name, Recorder())
        return launches

    def __exit__(self, *exc) -> None:
        setattr(self.module, self.name, self.kernel)


@dataclass(frozen=True)
class Usage:
    """What ptxas allocated per thread: registers, and bytes spilled to stack/local memory."""

    registers: int
    spilled_bytes: int


def resource_usage(compiled) -> Usage | None:
    """Registers and spilled bytes of a compiled kernel, from its cubin (None without cuobjdump)."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(cuobjdump) or "cubin" not in compiled.asm:
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    if not found:
        return None
    return Usage(registers=int(found.group(1)), spilled_bytes=int(found.group(2)) + int(found.group(3)))


def vectorized(ptx: str, loads: bool = True, stores: bool = True) -> bool:
    """Whether the PTX has 128-bit global loads (and/or stores): what a streaming kernel needs."""
    return (not loads or any(v in ptx for v in _VECTOR_LOADS)) and (
        not stores or any(v in ptx for v in _VECTOR_STORES)
    )


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks and warps per SM, and which limit set them."""

    blocks_per_sm: int
    warps_per_sm: int
    limiter: str  # "registers", "shared memory", "warps" or "blocks"


def occupancy(registers: int, shared_bytes: int, num_warps: int, machine=None) -> Occupancy:
    """How many blocks of ``num_warps`` warps fit on one SM (sm_90 unless ``machine`` says otherwise).

    The CUDA occupancy calculator's rules for compute capability 9.0 (``utils.sass.SM90`` holds the figures):
    registers are allocated per warp in units of 256 (``registers`` per thread x 32, rounded up) from 65,536;
    shared memory per block is rounded up to 128 bytes plus the runtime's 1 KiB, from 228 KiB (a block over
    227 KiB cannot launch: 0 blocks); at most 64 warps and 32 blocks. The limiter is the smallest of the four;
    on a tie the fixed limits (warps, then blocks) are named before the resources (registers, shared memory).
    """
    from utils.sass import SM90

    m = machine or SM90
    if num_warps < 1:
        raise ValueError(f"kernel_ladder.occupancy: num_warps must be >= 1, got {num_warps}")
    if not 0 <= registers <= m.max_registers_per_thread:
        raise ValueError(
            f"kernel_ladder.occupancy: registers must be in [0, {m.max_registers_per_thread}], got {registers}"
        )
    if shared_bytes < 0:
        raise ValueError(f"kernel_ladder.occupancy: shared_bytes must be >= 0, got {shared_bytes}")
    per_warp = -(-registers * 32 // m.register_unit) * m.register_unit
    by_registers = (m.registers // per_warp) // num_warps if per_warp else m.max_blocks
    if shared_bytes > m.max_shared_per_block:
        by_shared = 0
    else:
        per_block = -(-shared_bytes // m.shared_unit) * m.shared_unit + m.shared_reserved_per_block
        by_shared = m.shared_bytes // per_block
    limits = {
        "warps": m.max_warps // num_warps,
        "blocks": m.max_blocks,
        "registers": by_registers,
        "shared memory": by_shared,
    }
    limiter = min(limits, key=limits.get)
    blocks = limits[limiter]
    return Occupancy(blocks_per_sm=blocks, warps_per_sm=blocks * num_warps, limiter=limiter)
