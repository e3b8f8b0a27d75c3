"""C++ on the CPU from Python: compile with g++, load with ctypes, call on torch tensors, read the vectorizer.

Chapter 13 takes a kernel below Triton. On the CPU that is plain C++: this module compiles a source
(a string or a file) into a shared library with g++, keeps it by the hash of everything that goes
into it, and calls its ``extern "C"`` functions on tensors' data pointers:

* :func:`compile_shared` — g++ into a ``.so`` under ``~/.cache/kernel_ladder/cpp`` (or
  ``$KERNEL_LADDER_CPP_CACHE``), named by a hash of the source, the flags and the compiler's version.
  The library is written under a temporary name and renamed into place, so two processes that build
  the same source at once both end up loading one complete file. A compile error raises
  :class:`CompileError`, which holds the compiler's first lines with the source's own line numbers;
* :class:`CppLibrary` — :meth:`CppLibrary.function` (a ctypes function) and :meth:`CppLibrary.kernel`
  (the same, called on tensors: each tensor's device, dtype and layout checked before its pointer is
  passed, each scalar converted to the type the signature says);
* :func:`vectorization_report` — what GCC's auto-vectorizer did with each loop
  (``-fopt-info-vec-all``), tied to the source's lines: vectorized (and how wide) or why not;
* :func:`harness` — a small native executable that calls one exported function on generated inputs a
  given number of times and prints a checksum of its outputs: what :mod:`utils.valgrind` runs, so that
  valgrind never runs Python.

Flags are :data:`DEFAULT_FLAGS`: ``-O3 -march=x86-64-v3`` (AVX2 and FMA, which any x86-64 laptop of
the last decade has and valgrind can run: never ``-march=native``, whose AVX-512 valgrind 3.19 cannot
execute and whose code differs from machine to machine; on another ISA, arm64 say, or an older x86, the
compiler's default target, :data:`X86_64_V3` false) and ``-fopenmp-simd`` (``#pragma omp simd``
without the OpenMP runtime); ``openmp=True`` adds ``-fopenmp`` for ``#pragma omp parallel``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernel_ladder.native._build import cache_folder, host_is_x86_64_v3

__all__ = [
    "ASAN_FLAGS",
    "CACHE_ENV",
    "DEFAULT_FLAGS",
    "CompileError",
    "CppKernel",
    "CppLibrary",
    "HARNESS_SOURCE",
    "HarnessArg",
    "VecNote",
    "asan_runtime",
    "buffer",
    "build_shared",
    "cache_dir",
    "compile_shared",
    "compiler_available",
    "compiler_version",
    "harness",
    "scalar",
    "set_openmp_threads",
    "vectorization_report",
    "omp_pragmas",
]

#: The environment variable naming the folder compiled libraries are kept in.
CACHE_ENV = "KERNEL_LADDER_CPP_CACHE"

#: g++ flags of every CPU kernel of the course: see the module's docstring for why these.
#: ``-march=x86-64-v3`` where this CPU runs it (:func:`kernel_ladder.native._build.host_is_x86_64_v3`); on
#: another ISA or an older x86 the compiler's default target, and the AVX2 rungs are not built.
X86_64_V3: bool = host_is_x86_64_v3()
DEFAULT_FLAGS: tuple[str, ...] = ("-O3", *(("-march=x86-64-v3",) if X86_64_V3 else ()), "-fopenmp-simd", "-std=c++17")

_COMPILER = "g++"

#: The file name a source is compiled under (in compiler messages, and in a harness's debug info: valgrind's
#: per-file counts name it so).
HARNESS_SOURCE = "source.cpp"
_ERROR_LINES = 12  # the compiler's first lines a CompileError keeps


class CompileError(RuntimeError):
    """g++ refused the source. ``lines``: its first lines, the source's file named ``source.cpp`` and its
    lines numbered as in the source; ``log``: everything it printed; ``error_lines``: the source lines an
    ``error:`` points at."""

    def __init__(self, lines: list[str], log: str, error_lines: list[int]) -> None:
        self.lines = lines
        self.log = log
        self.error_lines = error_lines
        super().__init__("utils.cpp.compile_shared: g++ failed:\n" + "\n".join(lines))


def cache_dir() -> Path:
    """Where compiled libraries and executables are kept (created if missing)."""
    path = cache_folder("cpp", CACHE_ENV)
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiler_available() -> bool:
    """Whether ``g++`` is on the PATH."""
    return shutil.which(_COMPILER) is not None


@functools.lru_cache(maxsize=1)
def compiler_version() -> str:
    """The first line of ``g++ --version`` (part of every cache key: a new compiler builds anew)."""
    if not compiler_available():
        raise RuntimeError("utils.cpp: g++ is not on the PATH (apt install g++, or build-essential)")
    result = subprocess.run([_COMPILER, "--version"], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()[0].strip()


def _source_text(source: str | os.PathLike) -> tuple[str, Path | None]:
    """``(text, folder)``: a path's contents and its folder (for its ``#include "..."``), or a string as is."""
    if isinstance(source, os.PathLike):
        path = Path(source)
        return path.read_text(), path.resolve().parent
    if not isinstance(source, str):
        raise TypeError(f"utils.cpp: source must be C++ text (str) or a path, got {type(source).__name__}")
    return source, None


def _key(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in (*parts, compiler_version()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _compile_messages(log: str, source_file: Path) -> tuple[list[str], list[int]]:
    """The compiler's first lines with the source's path shortened to ``source.cpp``; the lines of its errors."""
    text = log.replace(str(source_file), "source.cpp")
    lines = [line for line in text.splitlines() if line.strip()]
    errors = sorted({int(m) for m in re.findall(r"^source\.cpp:(\d+):(?:\d+:)? (?:fatal )?error:", text, re.M)})
    return lines[:_ERROR_LINES], errors


def _build(command_tail: list[str], text: str, folder: Path | None, target: Path, flags: Sequence[str],
           extra_sources: Sequence[Path] = ()) -> None:
    """Compile ``text`` (plus ``extra_sources``) to ``target`` with ``flags``, atomically."""
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    try:
        source_file = work / "source.cpp"
        source_file.write_text(text)
        partial = work / target.name
        command = [_COMPILER, *flags, str(source_file), *map(str, extra_sources), "-o", str(partial), *command_tail]
        if folder is not None:
            command.insert(1, f"-I{folder}")
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            lines, errors = _compile_messages(result.stderr or result.stdout, source_file)
            raise CompileError(lines, result.stderr, errors)
        os.replace(partial, target)  # atomic: another process sees no file, or a whole one
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compile_shared(source: str | os.PathLike, *, flags: Sequence[str] = DEFAULT_FLAGS,
                   openmp: bool = False) -> CppLibrary:
    """Compile C++ ``source`` (text, or a path to a file) into a shared library and load it.

    Kept by a hash of the source, the flags and the compiler's version: a second call (in any process)
    loads the library built the first time. ``openmp`` adds ``-fopenmp``. Raises :class:`CompileError`
    (the compiler's first lines) when g++ refuses the source, ``RuntimeError`` when there is no g++.
    """
    text, _ = _source_text(source)
    target = build_shared(source, flags=flags, openmp=openmp)
    return CppLibrary(target, text, (*flags, *_SHARED_FLAGS, *(["-fopenmp"] if openmp else [])))


_SHARED_FLAGS = ("-fPIC", "-shared")


def build_shared(source: str | os.PathLike, *, flags: Sequence[str] = DEFAULT_FLAGS, openmp: bool = False) -> Path:
    """:func:`compile_shared` without loading: the library's path (for a child process to load: a check never
    runs a learner's code, static initializers included, in its own process)."""
    text, folder = _source_text(source)
    all_flags = [*flags, *_SHARED_FLAGS, *(["-fopenmp"] if openmp else [])]
    key = _key("shared", text, " ".join(all_flags), str(folder or ""))
    target = cache_dir() / f"lib{key}.so"
    if not target.exists():
        _build([], text, folder, target, all_flags)
    return target


# --------------------------------------------------------------------------------------------
# Calling a library's functions
# --------------------------------------------------------------------------------------------

# Argument spellings a kernel's signature may use: C type -> (ctypes type, torch dtype name or None).
_POINTER_TYPES = {"float*": ("float32", ctypes.c_float), "double*": ("float64", ctypes.c_double),
                  "int32_t*": ("int32", ctypes.c_int32), "int64_t*": ("int64", ctypes.c_int64)}
_SCALAR_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int,
                 "float": ctypes.c_float, "double": ctypes.c_double}


def _parse_argument(spelling: str) -> tuple[str, bool]:
    """``"const float*"`` -> ``("float*", True)``; checks the spelling is one :meth:`CppLibrary.kernel` knows."""
    text = " ".join(spelling.replace("*", " * ").split()).replace(" *", "*")
    const = text.startswith("const ")
    base = text.removeprefix("const ").strip()
    if base not in _POINTER_TYPES and base not in _SCALAR_TYPES:
        known = sorted([*_POINTER_TYPES, *_SCALAR_TYPES])
        raise ValueError(f"utils.cpp: argument type {spelling!r} is not one of {known} (optionally const)")
    return base, const


class CppLibrary:
    """A compiled shared library: ``path``, the ``source`` it came from and the ``flags`` it was built with."""

    def __init__(self, path: Path, source: str, flags: tuple[str, ...]) -> None:
        self.path = Path(path)
        self.source = source
        self.flags = flags
        self._dll = ctypes.CDLL(str(self.path))

    def __repr__(self) -> str:
        return f"CppLibrary({self.path.name})"

    def has(self, name: str) -> bool:
        """Whether the library exports a symbol ``name``."""
        try:
            getattr(self._dll, name)
        except AttributeError:
            return False
        return True

    def function(self, name: str, argtypes: Sequence[Any], restype: Any = None) -> Any:
        """The exported function ``name`` as a ctypes function taking ``argtypes`` (ctypes types)."""
        if not self.has(name):
            raise ValueError(f"utils.cpp.CppLibrary.function: the library exports no function {name!r} — is it "
                             f"declared extern \"C\" (no C++ name mangling) and spelled the same?")
        function = getattr(self._dll, name)
        function.argtypes = list(argtypes)
        function.restype = restype
        return function

    def kernel(self, name: str, signature: Sequence[str]) -> CppKernel:
        """The function ``name`` as a :class:`CppKernel` called on tensors and numbers; ``signature`` spells each
        argument's C type: ``"const float*"``, ``"float*"``, ``"double*"``, ``"int64_t"``, ``"float"``..."""
        parsed = [_parse_argument(s) for s in signature]
        argtypes = [ctypes.c_void_p if base in _POINTER_TYPES else _SCALAR_TYPES[base] for base, _ in parsed]
        return CppKernel(name, self.function(name, argtypes), tuple(signature), tuple(parsed))


@dataclasses.dataclass(frozen=True)
class CppKernel:
    """A library function called on torch tensors (for its pointer arguments) and Python numbers.

    Each tensor must be on the CPU, of the dtype its pointer type says, and dense in its last
    dimension (stride 1): the kernels of this course take every other stride (a row stride, a leading
    dimension) as an argument, and a pointer says nothing of strides. A tensor passed for a ``const``
    pointer may be read-only; one passed for a non-const pointer is written in place. Anything else
    raises ``TypeError``/``ValueError`` naming the argument, before the call.
    """

    name: str
    function: Any
    signature: tuple[str, ...]
    parsed: tuple[tuple[str, bool], ...]

    def __call__(self, *args: Any) -> None:
        import torch

        if len(args) != len(self.parsed):
            raise TypeError(f"utils.cpp: {self.name} takes {len(self.parsed)} arguments "
                            f"({', '.join(self.signature)}), got {len(args)}")
        converted = []
        for position, (arg, (base, _)) in enumerate(zip(args, self.parsed)):
            label = f"{self.name}: argument {position + 1} ({self.signature[position]})"
            if base in _POINTER_TYPES:
                if not isinstance(arg, torch.Tensor):
                    raise TypeError(f"utils.cpp.{label}: expected a torch.Tensor, got {type(arg).__name__}")
                dtype = getattr(torch, _POINTER_TYPES[base][0])
                if arg.device.type != "cpu":
                    raise ValueError(f"utils.cpp.{label}: expected a CPU tensor, got one on {arg.device}")
                if arg.dtype != dtype:
                    raise TypeError(f"utils.cpp.{label}: expected dtype {dtype}, got {arg.dtype}")
                if arg.dim() and arg.numel() > 1 and arg.stride(-1) != 1 and arg.shape[-1] > 1:
                    raise ValueError(f"utils.cpp.{label}: expected the last dimension dense (stride 1), got "
                                     f"strides {tuple(arg.stride())}: pass .contiguous(), or a view whose rows are "
                                     "dense with its row stride as an argument")
                converted.append(arg.data_ptr() or None)
            else:
                if isinstance(arg, bool) or not isinstance(arg, (int, float)):
                    raise TypeError(f"utils.cpp.{label}: expected a Python number, got {type(arg).__name__}")
                if base in ("int64_t", "int32_t", "int") and not isinstance(arg, int):
                    raise TypeError(f"utils.cpp.{label}: expected an int, got {arg!r}")
                converted.append(arg)
        self.function(*converted)


#: Flags that add AddressSanitizer to a build (:func:`asan_runtime` says whether this compiler has it), able to
#: go on after a report (with ``halt_on_error=0`` in ``ASAN_OPTIONS``: each faulty instruction reported once).
ASAN_FLAGS: tuple[str, ...] = ("-fsanitize=address", "-fsanitize-recover=address", "-fno-omit-frame-pointer")


@functools.lru_cache(maxsize=1)
def asan_runtime() -> str | None:
    """The path of GCC's AddressSanitizer runtime (``libasan.so``), for a process that loads an ``ASAN_FLAGS``
    library to preload (``LD_PRELOAD``: the runtime must come first), or None where this compiler cannot build
    with it. A library built with :data:`ASAN_FLAGS` reports any access to memory marked unaddressable — past a
    heap block, or marked by ``__asan_poison_memory_region``."""
    if not compiler_available():
        return None
    found = subprocess.run([_COMPILER, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = found.stdout.strip()
    if found.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        return None
    try:
        build_shared('extern "C" int kl_asan_probe(const int* p) { return p[0]; }\n',
                     flags=(*DEFAULT_FLAGS, *ASAN_FLAGS))
    except CompileError:
        return None
    return path


@functools.lru_cache(maxsize=1)
def _libgomp() -> Any:
    return ctypes.CDLL("libgomp.so.1")


def set_openmp_threads(count: int) -> None:
    """Set the thread count of the OpenMP runtime that ``openmp=True`` libraries use (GCC's libgomp, which
    is not the copy torch's wheel bundles: torch's own threads are set with ``torch.set_num_threads``)."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"utils.cpp.set_openmp_threads: count must be an int >= 1, got {count!r}")
    _libgomp().omp_set_num_threads(ctypes.c_int(count))


# --------------------------------------------------------------------------------------------
# The auto-vectorizer's report
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VecNote:
    """What the vectorizer said of the loop on source ``line``: ``loop_vectorized`` and ``why`` (the vector
    width it used, or the reason it gave up), in GCC's words."""

    line: int
    loop_vectorized: bool
    why: str


def omp_pragmas(source: str | os.PathLike, flags: Sequence[str] = DEFAULT_FLAGS) -> list[tuple[int, str]]:
    """``(line, pragma)`` for every ``#pragma omp ...`` of ``source`` itself (not of the headers it includes), as
    the compiler sees it: preprocessed (``g++ -E``) with ``flags`` and ``-fopenmp`` in place of ``-fopenmp-simd``, so
    that a ``_Pragma("omp ...")`` and a pragma spelled through macros come out as the ``#pragma`` line they are,
    at the line of the source where they are used. Empty when the source does not preprocess (the compiler then
    says why)."""
    text, folder = _source_text(source)
    with tempfile.TemporaryDirectory(prefix="pre-", dir=cache_dir()) as work:
        source_file = Path(work, "source.cpp")
        source_file.write_text(text)
        command = [_COMPILER, *(f for f in flags if f != "-fopenmp-simd"), "-fopenmp", "-E", str(source_file)]
        if folder is not None:
            command.insert(1, f"-I{folder}")
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return []
    found, line, ours = [], 0, False
    for output_line in result.stdout.splitlines():
        marker = re.match(r'#\s*(\d+)\s+"(.*?)"', output_line)
        if marker:
            line, ours = int(marker.group(1)), marker.group(2) == str(source_file)
            continue
        if ours and re.match(r"\s*#\s*pragma\s+omp\b", output_line):
            found.append((line, " ".join(output_line.split())))
        line += 1
    return found


def vectorization_report(source: str | os.PathLike, flags: Sequence[str] = DEFAULT_FLAGS,
                         openmp: bool = False) -> list[VecNote]:
    """One :class:`VecNote` per loop of ``source`` GCC's vectorizer spoke of (``-fopt-info-vec-all``), by line.

    A loop is vectorized if any of its notes says so (GCC also keeps a scalar copy for a tail, or a
    version for when the pointers overlap: ``why`` names those too); otherwise ``why`` is GCC's most
    specific reason (the line after its ``couldn't vectorize loop``). Lines of headers are left out.
    """
    text, folder = _source_text(source)
    all_flags = [*flags, "-fopt-info-vec-all", "-c", *(["-fopenmp"] if openmp else [])]
    work = Path(tempfile.mkdtemp(prefix="vec-", dir=cache_dir()))
    try:
        source_file = work / "source.cpp"
        source_file.write_text(text)
        command = [_COMPILER, *all_flags, str(source_file), "-o", str(work / "source.o")]
        if folder is not None:
            command.insert(1, f"-I{folder}")
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            lines, errors = _compile_messages(result.stderr, source_file)
            raise CompileError(lines, result.stderr, errors)
        log = result.stderr.replace(str(source_file), "source.cpp")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    notes: dict[int, dict[str, list[str]]] = {}
    for line in log.splitlines():
        found = re.match(r"source\.cpp:(\d+):\d+: (optimized|missed): (.*)", line)
        if not found:
            continue
        number, kind, said = int(found.group(1)), found.group(2), found.group(3).strip()
        if kind == "optimized" and "vectorized" not in said and "versioned" not in said:
            continue
        if kind == "missed" and not (said.startswith("couldn't vectorize loop") or said.startswith("not vectorized")):
            continue
        entry = notes.setdefault(number, {"optimized": [], "missed": []})
        if said not in entry[kind]:
            entry[kind].append(said)
    report = []
    for number in sorted(notes):
        entry = notes[number]
        if any(s.startswith("loop vectorized") or "basic block" in s for s in entry["optimized"]):
            report.append(VecNote(number, True, "; ".join(entry["optimized"])))
        elif entry["missed"]:
            reasons = [s for s in entry["missed"] if not s.startswith("couldn't vectorize loop")]
            report.append(VecNote(number, False, "; ".join(reasons or entry["missed"])))
    return report


# --------------------------------------------------------------------------------------------
# A native harness: one exported function called on generated inputs, no Python
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HarnessArg:
    """One argument of the harnessed function: a buffer (``count`` elements of ``ctype``, filled with seeded
    values in [-1, 1), or zeros when ``fill="zeros"``) or a scalar ``value``."""

    ctype: str  # "float*", "const float*", "int64_t", "float", ...
    count: int = 0
    value: float | int = 0
    fill: str = "random"


def buffer(ctype: str, count: int, fill: str = "random") -> HarnessArg:
    """A buffer argument of the harness: ``count`` elements, seeded random values in [-1, 1) or ``"zeros"``."""
    base, _ = _parse_argument(ctype)
    if base not in _POINTER_TYPES:
        raise ValueError(f"utils.cpp.buffer: {ctype!r} is not a pointer type")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"utils.cpp.buffer: count must be an int >= 0, got {count!r}")
    if fill not in ("random", "zeros"):
        raise ValueError(f"utils.cpp.buffer: fill must be 'random' or 'zeros', got {fill!r}")
    return HarnessArg(ctype, count=count, fill=fill)


def scalar(ctype: str, value: float | int) -> HarnessArg:
    """A scalar argument of the harness."""
    base, _ = _parse_argument(ctype)
    if base not in _SCALAR_TYPES:
        raise ValueError(f"utils.cpp.scalar: {ctype!r} is not a scalar type")
    return HarnessArg(ctype, value=value)


def _harness_main(function: str, args: Sequence[HarnessArg], calls: int) -> str:
    declared, setup, passed, checksum = [], [], [], []
    for i, arg in enumerate(args):
        base, const = _parse_argument(arg.ctype)
        if base in _POINTER_TYPES:
            element = base[:-1]
            declared.append(f"{'const ' if const else ''}{element}*")
            setup.append(f"  {element}* b{i} = static_cast<{element}*>(std::aligned_alloc(64, "
                         f"(({arg.count} * sizeof({element}) + 63) / 64) * 64 + 64));")
            if arg.fill == "random":
                setup.append(f"  for (long long j = 0; j < {arg.count}LL; ++j) b{i}[j] = "
                             f"static_cast<{element}>(next_value());")
            else:
                setup.append(f"  for (long long j = 0; j < {arg.count}LL; ++j) b{i}[j] = 0;")
            passed.append(f"b{i}")
            if not const:
                checksum.append(f"  for (long long j = 0; j < {arg.count}LL; ++j) sum += static_cast<double>(b{i}[j]);")
        else:
            declared.append(base)
            literal = repr(float(arg.value)) if base in ("float", "double") else f"{int(arg.value)}LL"
            passed.append(f"static_cast<{base}>({literal})")
    return "\n".join([
        "#include <cstdint>", "#include <cstdio>", "#include <cstdlib>", "",
        f'extern "C" void {function}({", ".join(declared)});', "",
        "static uint64_t state = 0x9E3779B97F4A7C15ULL;",
        "static double next_value() {  // xorshift64*: the same inputs on every machine",
        "  state ^= state >> 12; state ^= state << 25; state ^= state >> 27;",
        "  return static_cast<double>((state * 0x2545F4914F6CDD1DULL) >> 11) / 9007199254740992.0 * 2.0 - 1.0;",
        "}", "",
        "int main() {",
        *setup,
        f"  for (int call = 0; call < {calls}; ++call) {function}({', '.join(passed)});",
        "  double sum = 0.0;",
        *checksum,
        '  std::printf("checksum %.17g\\n", sum);',
        "  return 0;",
        "}", "",
    ])


def harness(source: str | os.PathLike, function: str, args: Sequence[HarnessArg], *, calls: int = 1,
            flags: Sequence[str] = DEFAULT_FLAGS, openmp: bool = False) -> Path:
    """A native executable that calls ``function`` of ``source`` ``calls`` times on ``args`` and prints
    ``checksum <sum of its outputs>``. Built with ``-g`` (valgrind names functions and lines), the source and
    the ``main`` in separate translation units (the function is not inlined into ``main``: callgrind counts it
    as itself), and kept by content hash like :func:`compile_shared`."""
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"utils.cpp.harness: calls must be an int >= 1, got {calls!r}")
    if not re.fullmatch(r"[A-Za-z_]\w*", function):
        raise ValueError(f"utils.cpp.harness: function must be a C identifier, got {function!r}")
    text, folder = _source_text(source)
    main = _harness_main(function, args, calls)
    all_flags = [*flags, "-g", *(["-fopenmp"] if openmp else [])]
    key = _key("harness", text, main, " ".join(all_flags), str(folder or ""))
    target = cache_dir() / f"harness-{key}"
    if not target.exists():
        work = Path(tempfile.mkdtemp(prefix="main-", dir=cache_dir()))
        try:
            (work / "main.cpp").write_text(main)
            _build([], text, folder, target, all_flags, extra_sources=[work / "main.cpp"])
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target
