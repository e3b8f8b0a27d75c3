"""Compiling CUDA C++ for a GPU this machine may not have, and reading what came out.

``nvcc`` compiles CUDA C++ for any architecture without a GPU: :func:`compile_cuda` builds a source (a
string or a ``.cu``/``.cuh`` file) for ``sm_90`` into a cubin, keeps what ``ptxas -v`` says about every
kernel (registers, spills, stack, shared memory) and disassembles the cubin with the ``nvdisasm`` Triton
ships (:func:`utils.sass.disassemble`), split kernel by kernel::

    from utils.nvcc import compile_cuda
    build = compile_cuda(path_to_cu, instantiate=["template __global__ void k<float>(const float*, float*, int);"])
    build.ptxas["k"].registers, build.ptxas["k"].spill_stores
    build.instructions("k")           # utils.sass.Instruction rows of that kernel's SASS

Kernels are named by their *base* name (``rms_norm_forward`` for ``void rms_norm_forward<float, 4>(...)``);
when several instantiations share a base name, name one by its full demangled signature's start
(``"rms_norm_forward<float, 4>"``). A templated kernel in a header produces no code until it is instantiated:
``instantiate`` appends explicit instantiations to the compiled text.

Where ``nvcc`` is found: ``$KERNEL_LADDER_NVCC``, ``nvcc`` on the ``PATH``, ``$CUDA_HOME/bin``,
``/usr/local/cuda/bin``, then PyPI's ``nvidia-cuda-nvcc`` package. :func:`find_nvcc` returns ``None``
where there is none, and :func:`compile_cuda` then raises :class:`NvccNotFound` saying what to install.
Builds are cached by content (source, flags, nvcc version) under ``~/.cache/kernel_ladder/nvcc``
(``$XDG_CACHE_HOME`` in place of ``~/.cache`` when set; ``$KERNEL_LADDER_NVCC_CACHE`` overrides both),
written atomically so that parallel test workers can share it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kernel_ladder.native._build import cache_folder

from . import sass as _sass

__all__ = ["CudaCompile", "CudaCompileError", "NvccNotFound", "PtxasInfo", "compile_cuda", "find_nvcc", "nvcc_version"]


class NvccNotFound(RuntimeError):
    """No ``nvcc`` on this machine."""


class CudaCompileError(RuntimeError):
    """``nvcc`` refused the source; ``log`` holds what it printed."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class PtxasInfo:
    """What ``ptxas -v`` reports for one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    barriers: int


@dataclass
class CudaCompile:
    """One compiled source: its cubin, ptxas's per-kernel report and the kernels' SASS."""

    cubin: bytes
    log: str
    ptxas: dict[str, PtxasInfo]
    #: mangled name -> demangled signature, for every kernel in the cubin
    kernels: dict[str, str]
    arch: str
    _sass: str | None = field(default=None, repr=False)

    @property
    def sass(self) -> str:
        """The whole cubin's SASS (``nvdisasm -c``)."""
        if self._sass is None:
            self._sass = _sass.disassemble(self.cubin)
        return self._sass

    def mangled(self, kernel: str) -> str:
        """The mangled name of ``kernel`` (a base name, a demangled prefix, or the mangled name itself)."""
        if kernel in self.kernels:
            return kernel
        # an exact base name first ("scale" must not also find "scale_racy"), then a signature's start
        found = [m for m, d in self.kernels.items() if _base_name(d) == kernel]
        if not found:
            found = [m for m, d in self.kernels.items() if d.removeprefix("void ").startswith(kernel)]
        if len(found) != 1:
            names = sorted(self.kernels.values())
            what = "no kernel" if not found else f"{len(found)} kernels"
            raise KeyError(f"utils.nvcc: {what} named {kernel!r} in this build; its kernels: {names}")
        return found[0]

    def kernel_sass(self, kernel: str) -> str:
        """The SASS of one kernel: its ``.text.<mangled>`` section of :attr:`sass`."""
        mangled = self.mangled(kernel)
        sections = re.split(r"^//-+ \.text\.", self.sass, flags=re.M)
        for section in sections[1:]:
            if section.split(None, 1)[0] == mangled:
                return section
        raise KeyError(f"utils.nvcc: no SASS section for {mangled}")

    def instructions(self, kernel: str) -> list[_sass.Instruction]:
        """The parsed SASS instructions of one kernel (:func:`utils.sass.parse`)."""
        return _sass.parse(self.kernel_sass(kernel))

    def info(self, kernel: str) -> PtxasInfo:
        """ptxas's report for one kernel."""
        return self.ptxas[self.mangled(kernel)]


def _base_name(demangled: str) -> str:
    # "void ns::name<float, 4>(float const*, ...)" -> "name"; "name(float*)" -> "name"
    head = demangled.split("(", 1)[0]
    head = re.sub(r"<.*>$", "", head.strip())
    head = head.split()[-1] if head.split() else head
    return head.split("::")[-1]


@functools.cache
def find_nvcc() -> str | None:
    """The path of ``nvcc``, or ``None`` where this machine has none (see the module docstring)."""
    candidates = [os.environ.get("KERNEL_LADDER_NVCC"), shutil.which("nvcc")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"], "bin", "nvcc")))
    candidates.append("/usr/local/cuda/bin/nvcc")
    try:
        import nvidia.cuda_nvcc  # PyPI's nvidia-cuda-nvcc

        candidates.append(str(Path(next(iter(nvidia.cuda_nvcc.__path__)), "bin", "nvcc")))
    except Exception:  # noqa: BLE001 - not installed, or a namespace package without that module
        pass
    for path in candidates:
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return path
    return None


@functools.cache
def nvcc_version() -> str:
    """``nvcc --version``'s last line (``Build cuda_13.0...``), part of every cache key."""
    nvcc = _require_nvcc()
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def _require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise NvccNotFound(
            "utils.nvcc: no nvcc found: install the CUDA toolkit, or `pip install nvidia-cuda-nvcc`, "
            "or point KERNEL_LADDER_NVCC at an nvcc binary"
        )
    return nvcc


def _cache_dir() -> Path:
    path = cache_folder("nvcc", "KERNEL_LADDER_NVCC_CACHE")
    path.mkdir(parents=True, exist_ok=True)
    return path


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, PtxasInfo]:
    """Per-kernel registers, spills, stack and shared memory from ``ptxas -v`` output (mangled names)."""
    found: dict[str, PtxasInfo] = {}
    current, props = None, (0, 0, 0)
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current, props = entry.group(1), (0, 0, 0)
            continue
        p = _PROPS.search(line)
        if p and current:
            props = tuple(int(v) for v in p.groups())
            continue
        used = _USED.search(line)
        if used and current:
            # the clauses after the registers vary ("N bytes cumulative stack size" may come before the smem)
            registers = int(used.group(1))
            barriers, smem = (int(m.group(1)) if (m := pattern.search(line)) else 0 for pattern in (_BARRIERS, _SMEM))
            found[current] = PtxasInfo(registers, props[1], props[2], props[0], smem, barriers)
            current = None
    return found


def _demangle(names: Iterable[str]) -> dict[str, str]:
    names = list(names)
    if not names:
        return {}
    tool = shutil.which("c++filt")
    if tool is None:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out if len(out) == len(names) else names))


def compile_cuda(
    source: str | Path,
    *,
    arch: str = "sm_90",
    defines: dict[str, object] | None = None,
    include_dirs: Sequence[str | Path] = (),
    instantiate: Sequence[str] = (),
    flags: Sequence[str] = (),
) -> CudaCompile:
    """Compile CUDA C++ for ``arch`` into a cubin, with ptxas's report (see the module docstring).

    ``source`` is the text itself or a path to it (its folder is then on the include path). ``defines``
    become ``-D`` flags; ``instantiate`` lines are appended to the text; ``flags`` go to ``nvcc`` as they are.
    Raises :class:`CudaCompileError` with nvcc's output when the source does not compile.
    """
    nvcc = _require_nvcc()
    dirs = [str(Path(d).resolve()) for d in include_dirs]
    is_path = isinstance(source, Path) or ("\n" not in source and source.endswith((".cu", ".cuh")))
    if is_path:
        path = Path(source).resolve()
        text = path.read_text()
        dirs.insert(0, str(path.parent))
        label = path.name
    else:
        text, label = str(source), "source.cu"
    text = text + ("\n" + "\n".join(instantiate) + "\n" if instantiate else "")
    args = [f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-lineinfo", "-std=c++17", *map(str, flags)]
    args += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    args += [f"-I{d}" for d in dirs]
    included = "".join(_included_text(text, dirs))
    key = hashlib.sha256("\0".join([text, included, *args, nvcc_version()]).encode()).hexdigest()[:24]
    folder = _cache_dir() / key
    cubin_path, log_path = folder / "kernel.cubin", folder / "ptxas.log"
    if not (cubin_path.is_file() and log_path.is_file()):
        tmp = Path(tempfile.mkdtemp(dir=_cache_dir(), prefix=".build-"))
        try:
            src = tmp / (label if label.endswith(".cu") else label + ".cu")
            src.write_text(text)
            command = [nvcc, *args, "-o", str(tmp / "kernel.cubin"), str(src)]
            result = subprocess.run(command, capture_output=True, text=True)
            log = (result.stdout + result.stderr).replace(str(src), label)
            if result.returncode != 0:
                raise CudaCompileError(f"utils.nvcc: nvcc could not compile {label} for {arch}:\n{log.strip()}", log)
            (tmp / "ptxas.log").write_text(log)
            try:
                os.rename(tmp, folder)  # atomic; a racing worker's identical build may have won
            except OSError:
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log = log_path.read_text()
    ptxas = parse_ptxas(log)
    return CudaCompile(cubin_path.read_bytes(), log, ptxas, _demangle(ptxas), arch)


def _included_text(text: str, dirs: Sequence[str]) -> Iterable[str]:
    """The text of every local ``#include "..."`` file found on ``dirs`` (recursively), for the cache key."""
    seen: set[Path] = set()
    pending = [text]
    while pending:
        for name in re.findall(r'#\s*include\s*"([^"]+)"', pending.pop()):
            for d in dirs:
                candidate = Path(d, name).resolve()
                if candidate.is_file() and candidate not in seen:
                    seen.add(candidate)
                    body = candidate.read_text()
                    pending.append(body)
                    yield body
                    break
