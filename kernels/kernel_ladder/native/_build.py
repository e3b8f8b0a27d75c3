"""Building and loading the compiled library of :mod:`kernel_ladder.native` (see its docstring)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import sys
import sysconfig
import time

import torch

__all__ = ["NativeBuildError", "available", "build", "build_config", "cache_dir", "load", "loaded_library"]

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
NAME = "kernel_ladder_native"
#: The library's sources, relative to ``csrc`` (``cuda/ops_cuda.cu`` joins them where CUDA builds).
CPP_SOURCES = ("checks.cpp", "ops.cpp", "autograd.cpp", "meta.cpp", "cpu/rms_norm.cpp", "cpu/softmax.cpp")
CUDA_SOURCE = "cuda/ops_cuda.cu"

_LOADED: pathlib.Path | None = None


class NativeBuildError(RuntimeError):
    """The extension cannot be built here (no C++ compiler, no ninja) or its build failed."""


#: The CPU features ``-march=x86-64-v3`` assumes beyond x86-64 (as /proc/cpuinfo names them; lzcnt is "abm").
_X86_64_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})


def host_is_x86_64_v3() -> bool:
    """Whether this machine runs ``-march=x86-64-v3`` code (AVX2, FMA, BMI2...): an x86-64 CPU of the last
    decade. False on other ISAs (arm64 laptops), on older x86 CPUs, and where the CPU's flags cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return _X86_64_V3_FLAGS <= set(line.split(":", 1)[1].split())
    return False


def _openmp() -> bool:
    """Whether torch's ``at::parallel_for`` runs on OpenMP (then the extension is compiled with it)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _ninja() -> str | None:
    """ninja on PATH, beside this Python (a venv's bin, not activated), or the ninja package's."""
    found = shutil.which("ninja") or shutil.which("ninja", path=str(pathlib.Path(sys.executable).parent))
    if found:
        return found
    try:
        import ninja  # the PyPI package (pip install ninja)

        return shutil.which("ninja", path=ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return None


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (pathlib.Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(pathlib.Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _with_cuda() -> bool:
    """CUDA kernels are compiled in when torch is a CUDA build, nvcc is found and the source exists."""
    return torch.version.cuda is not None and (CSRC / CUDA_SOURCE).exists() and _nvcc() is not None


def build_config() -> dict:
    """What a build uses: sources, flags, and what the compiled library depends on (the cache key's inputs)."""
    cflags = ["-O3"]
    if host_is_x86_64_v3():
        cflags.append("-march=x86-64-v3")  # AVX2 + FMA + F16C: any x86 of the last decade, never -march=native
    openmp = _openmp()
    # at::parallel_for's OpenMP backend is inline in ATen's headers: it needs -fopenmp. Otherwise the
    # `#pragma omp simd` loops still need -fopenmp-simd (no runtime).
    cflags.append("-fopenmp" if openmp else "-fopenmp-simd")
    cuda = _with_cuda()
    return {
        "sources": [*CPP_SOURCES, *([CUDA_SOURCE] if cuda else [])],
        "extra_cflags": cflags,
        "extra_ldflags": ["-fopenmp"] if openmp else [],
        "extra_cuda_cflags": ["-O3", "-lineinfo"] if cuda else [],
        "with_cuda": cuda,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else "",
        "python_abi": sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag,
        "machine": platform.machine(),
    }


def _key(config: dict) -> str:
    digest = hashlib.sha256(repr(sorted(config.items())).encode())
    for path in sorted(CSRC.rglob("*")):  # every source and header: a header change rebuilds too
        if path.is_file() and path.suffix in (".cpp", ".h", ".cu", ".cuh"):
            digest.update(str(path.relative_to(CSRC)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_folder(kind: str, env: str | None = None) -> pathlib.Path:
    """The project's cache folder for ``kind`` (``native``, and the course's ``cpp``, ``nvcc``, ``simt``):
    ``$<env>`` when that variable is set, else ``$XDG_CACHE_HOME/kernel_ladder/<kind>``, else
    ``~/.cache/kernel_ladder/<kind>``. Not created here."""
    root = os.environ.get(env) if env else None
    if root:
        return pathlib.Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "kernel_ladder" / kind


def cache_dir(config: dict | None = None) -> pathlib.Path:
    """Where the library for this configuration is built: ``$KERNEL_LADDER_NATIVE_DIR/<key>``, else
    ``~/.cache/kernel_ladder/native/<key>`` (``$XDG_CACHE_HOME`` in place of ``~/.cache`` when set)."""
    config = build_config() if config is None else config
    return cache_folder("native", "KERNEL_LADDER_NATIVE_DIR") / _key(config)


def _library(directory: pathlib.Path) -> pathlib.Path:
    return directory / f"{NAME}.so"


def _missing_tools() -> list[str]:
    missing = []
    if _compiler() is None:
        missing.append(f"no C++ compiler (looked for {os.environ.get('CXX', 'c++')!r} and 'g++' on PATH): install "
                       "one (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++; macOS: xcode-select "
                       "--install; conda: conda install gxx_linux-64), or set CXX")
    if _ninja() is None:
        missing.append("no ninja: pip install ninja")
    return missing


def available() -> bool:
    """Whether :func:`load` can succeed without raising for missing tools: the library is loaded or
    already built for this configuration, or a C++ compiler and ninja are there to build it.
    (It does not compile anything; a build can still fail.)"""
    if _LOADED is not None:
        return True
    if _library(cache_dir()).exists():
        return True
    return not _missing_tools()


def loaded_library() -> pathlib.Path | None:
    """The library loaded in this process, if any."""
    return _LOADED


def build(verbose: bool = False) -> pathlib.Path:
    """Compile the library if this configuration's cache has none; return its path (not loaded).

    Two processes (pytest-xdist workers) may call it at once: a file lock in the cache directory makes
    the second wait for the first's build and use it.
    """
    from filelock import FileLock  # a dependency of torch

    config = build_config()
    directory = cache_dir(config)
    library = _library(directory)
    if library.exists():
        return library
    missing = _missing_tools()
    if missing:
        raise NativeBuildError("kernel_ladder.native: cannot build the C++ extension: " + "; ".join(missing)
                               + ". The Triton ops (kernel_ladder.rms_norm, kernel_ladder.softmax) need none of it.")
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / "build.lock")):
        if library.exists():  # another process built it while this one waited
            return library
        from torch.utils import cpp_extension

        ninja_dir = str(pathlib.Path(_ninja()).parent)
        old_path = os.environ.get("PATH", "")
        os.environ["PATH"] = ninja_dir + os.pathsep + old_path  # torch's build runs `ninja` from PATH
        try:
            cpp_extension.load(
                name=NAME, sources=[str(CSRC / s) for s in config["sources"]],
                extra_cflags=config["extra_cflags"], extra_ldflags=config["extra_ldflags"],
                extra_cuda_cflags=config["extra_cuda_cflags"] or None, extra_include_paths=[str(CSRC)],
                build_directory=str(directory), with_cuda=config["with_cuda"], is_python_module=False,
                verbose=verbose,
            )
        except Exception as error:  # compiler errors come as RuntimeError/CalledProcessError
            raise NativeBuildError(f"kernel_ladder.native: the C++ extension failed to build in {directory}: "
                                   f"{error}") from error
        finally:
            os.environ["PATH"] = old_path
    return library


def load(verbose: bool = False) -> pathlib.Path:
    """Build if needed, then load the library into this process (once); returns its path.

    After this, ``torch.ops.kernel_ladder_native`` holds the operators.
    """
    global _LOADED
    if _LOADED is None:
        library = build(verbose=verbose)
        torch.ops.load_library(str(library))
        _LOADED = library
    return _LOADED


def timed_build(verbose: bool = False) -> tuple[pathlib.Path, float, bool]:
    """:func:`build`, timed: ``(library, seconds, whether it compiled anything)``."""
    already = _library(cache_dir()).exists()
    start = time.perf_counter()
    library = build(verbose=verbose)
    return library, time.perf_counter() - start, not already
