"""CUDA C++ kernels run on the CPU, thread by thread: a laptop checks CUDA code for real.

The header ``utils/simt/simt.h`` (with stub ``cuda_runtime.h``, ``cuda_bf16.h``, ``cuda_fp16.h``, ``mma.h``,
``cuda_pipeline.h`` beside it, first on the include path) lets a ``.cuh`` written for ``nvcc`` compile
unchanged with ``g++``: every CUDA thread of a block becomes a fiber, the blocks of the grid run one after
another, and a scheduler switches fibers at ``__syncthreads()``, the warp shuffles, ``__syncwarp`` and the
``nvcuda::wmma`` calls. The header's comment says what differs from a GPU (deferred ``cp.async`` copies,
poisoned shared memory, whole-tile wmma fragments, the C library's math).

:func:`launch` runs one kernel on CPU tensors in this process::

    from utils import simt
    simt.launch(path_to_cuh, "rms_norm_warp", grid=rows, block=32, args=[x, w, y, rows, cols, stride, 1e-6])

It generates a small ``extern "C"`` entry for that kernel instantiation (``kernel`` is written as C++ calls
it: ``"rms_norm_warp<4>"``), compiles it with ``g++ -std=c++20 -O1`` into a shared library cached by content
hash (``~/.cache/kernel_ladder/simt``, or ``$KERNEL_LADDER_SIMT_CACHE``) and calls it with ctypes. Arguments:
a CPU tensor is a pointer of its dtype (``float*``, ``double*``, ``__nv_bfloat16*``, ``__half*``, ``int*``,
``long long*``, ...), a Python ``int`` a ``long long``, a ``float`` a ``float``, a ``bool`` a ``bool``; the
kernel's own parameter types take them as a C++ call would (``long long`` -> ``int``). :class:`Arg` passes an
exact C++ type (``Arg(4, "unsigned")``, ``Arg(x, "const float4*")``). A deadlock or a misuse the emulator
sees (a divergent ``__syncthreads()``, one that completes while part of a warp returned without reaching it, a
shuffle whose mask leaves out its own lane, a misaligned ``__ldg`` or ``cp.async``) raises :class:`SimtError`
with the emulator's message.

:func:`run_checked` is for checkers: it runs the kernel in a child process, on copies of the tensors placed
between guard regions (NaN around inputs, a canary byte pattern around outputs and in the gaps between a
strided view's rows), with the sanitizers for misaligned accesses and out-of-range indices into fixed-size
arrays, and AddressSanitizer where g++ has it: every byte of a copy that is no element of its view (guards,
padding between rows) is poisoned, so a read there, or a write that puts back the bytes it found (which no
canary sees), is reported (:class:`BadAccess`: the tensor, the row, the bytes, the line, the thread); the fiber
switches are announced to it as it asks of user-level context switching. It returns a :class:`RunReport` —
``ok``, a compile error with its lines, a deadlock, a crash (SIGSEGV: where, which thread), a timeout, writes
into the guards, accesses outside the views — instead of raising or crashing. The tensors' new values are
copied back.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kernel_ladder.native._build import cache_folder

__all__ = [
    "Arg",
    "BadAccess",
    "GuardHit",
    "HEADER_DIR",
    "RunReport",
    "SimtCompileError",
    "SimtError",
    "build",
    "launch",
    "run_checked",
]

#: The folder holding ``simt.h`` and the stub CUDA headers (first on g++'s include path).
HEADER_DIR = Path(__file__).resolve().with_name("simt")

_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-shared", "-fno-strict-aliasing", "-pthread", "-w", "-x", "c++")
#: What :func:`run_checked` adds: a misaligned access (a float4 load from an address not a multiple of 16) and
#: an index past a fixed-size array (a __shared__ tile) stop the kernel with the line that did it; AddressSanitizer
#: reports every read or write of a byte that is no element of a tensor argument's view (run_checked poisons the
#: guards and the padding between a strided view's rows) and lets the kernel run on (``-fsanitize-recover``), so
#: that the guards still show what it wrote. ``-g1``: the line tables its reports name lines with. Every local variable
#: starts as 0xFE bytes (``-ftrivial-auto-var-init=pattern``: a float -1.7e38, an int -16843010), as a register nobody
#: wrote holds garbage on a GPU; ``-fno-tree-fre`` keeps g++ from taking an uninitialized value for whatever suits it
#: (``float sum; if (lane == 0) sum = 0.0f;`` would otherwise be 0 in every lane).
_CHECKED_FLAGS = (
    "-fsanitize=alignment,bounds,address",
    "-fno-sanitize-recover=all",
    "-fsanitize-recover=address",
    "-fno-tree-sra",
    "-g1",
    "-ftrivial-auto-var-init=pattern",
    "-fno-tree-fre",
)

_DTYPES = {
    torch.float32: ("float", ctypes.c_float),
    torch.float64: ("double", ctypes.c_double),
    torch.bfloat16: ("__nv_bfloat16", None),
    torch.float16: ("__half", None),
    torch.int32: ("int", ctypes.c_int),
    torch.int64: ("long long", ctypes.c_longlong),
    torch.int16: ("short", ctypes.c_short),
    torch.int8: ("signed char", ctypes.c_byte),
    torch.uint8: ("unsigned char", ctypes.c_ubyte),
    torch.bool: ("bool", ctypes.c_bool),
}

_SCALARS = {
    "bool": ctypes.c_bool,
    "char": ctypes.c_char,
    "signed char": ctypes.c_byte,
    "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short,
    "unsigned short": ctypes.c_ushort,
    "int": ctypes.c_int,
    "unsigned": ctypes.c_uint,
    "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}

_POINTER_TYPE = re.compile(r"^\s*(const\s+)?[A-Za-z_][\w:]*(\s+[A-Za-z_]\w*)*\s*(const\s*)?\*(\s*__restrict__)?\s*$")
_KERNEL_NAME = re.compile(r"^[A-Za-z_][\w:]*(<[\w:<>,.\s*&()+-]*>)?$")
_ERRLEN = 1 << 15


class SimtError(RuntimeError):
    """The emulator stopped the kernel: a deadlock, or a misuse it detects. ``kind``: ``"deadlock"`` or
    ``"error"``; the message is the emulator's (which barrier, which block, which threads)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


class SimtCompileError(RuntimeError):
    """g++ refused the source: ``log`` is what it printed, ``errors`` its ``(file, line, message)`` errors."""

    def __init__(self, message: str, log: str, errors: list[tuple[str, int, str]]):
        super().__init__(message)
        self.log = log
        self.errors = errors


@dataclasses.dataclass(frozen=True)
class Arg:
    """An argument with an exact C++ type: ``Arg(4, "unsigned")``, ``Arg(x, "const float4*")``."""

    value: Any
    ctype: str


# ------------------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    path = cache_folder("simt", "KERNEL_LADDER_SIMT_CACHE")
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def _compiler() -> tuple[str, str]:
    gxx = os.environ.get("CXX") if os.environ.get("CXX", "").endswith("g++") else None
    gxx = gxx or shutil.which("g++")
    if gxx is None:
        raise SimtCompileError(
            "utils.simt: no g++ found: install g++ (build-essential) to run CUDA kernels on the CPU", "", []
        )
    version = subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return gxx, version


@functools.cache
def _asan_runtime() -> str | None:
    """The path of g++'s AddressSanitizer runtime (preloaded into run_checked's child), or None without one."""
    gxx, _ = _compiler()
    found = subprocess.run([gxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def _checked_flags() -> tuple[str, ...]:
    if _asan_runtime() is None:  # no AddressSanitizer here: the guards alone see writes outside the views
        return tuple(f.replace(",address", "") for f in _CHECKED_FLAGS if "recover=address" not in f)
    return _CHECKED_FLAGS


def _header_text() -> str:
    return "".join(p.read_text() for p in sorted(HEADER_DIR.glob("*.h")))


def _source_of(source: str | Path) -> tuple[str, str, list[str]]:
    """``(text to include, label, include dirs)``: a path is included as it is (its folder on the path)."""
    is_path = isinstance(source, Path) or ("\n" not in source and source.endswith((".cu", ".cuh", ".h", ".hpp")))
    if is_path:
        path = Path(source).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"utils.simt: no source file {path}")
        return f'#include "{path}"\n', path.name, [str(path.parent)]
    return f'#line 1 "kernel.cu"\n{source}\n', "kernel.cu", []


def _included(text: str, dirs: Sequence[str]) -> str:
    from .nvcc import _included_text

    found = "".join(_included_text(text, dirs))
    for name in re.findall(r'#\s*include\s*"(/[^"]+)"', text):  # a path source, included by its absolute path
        if Path(name).is_file():
            body = Path(name).read_text()
            found += body + "".join(_included_text(body, [str(Path(name).parent), *dirs]))
    return found


def _entry(kernel: str, ctypes_: Sequence[str]) -> str:
    fields = "".join(f"  {t} a{i};\n" for i, t in enumerate(ctypes_))
    call = ", ".join(f"a.a{i}" for i in range(len(ctypes_)))
    init = ", ".join(f"*static_cast<{t}*>(args[{i}])" for i, t in enumerate(ctypes_))
    return f"""
#line 1 "simt-entry"
#include <dlfcn.h>
namespace simt_entry {{
struct Args {{
{fields}}};
void body(void* p) {{
  Args& a = *static_cast<Args*>(p);
  (void)a;
  {kernel}({call});
}}
}}  // namespace simt_entry
extern "C" int simt_entry_run(const long long* dims, void** args, char* err, long long errlen,
                              const long long* options, const long long* poison, int npoison) {{
  (void)args;
  simt_entry::Args a{{{init}}};
  Dl_info info;
  dladdr((void*)&simt_entry_run, &info);
  long long* where = (long long*)malloc(sizeof(long long) * (2 * npoison + 2));
  for (int i = 0; i < npoison; ++i) {{
    where[2 * i] = (long long)(uintptr_t)info.dli_fbase + poison[2 * i];
    where[2 * i + 1] = poison[2 * i + 1];
  }}
  if (options && options[2]) ::simt::detail::install_fault_handler();
  int rc = ::simt::detail::launch(dims, simt_entry::body, &a, err, errlen, options, where, npoison);
  free(where);
  return rc;
}}
// Counts of the last launch: the ranges whose 16-byte reads are counted ((first byte, bytes) pairs, at most 16), the
// reads counted (built with SIMT_COUNT_READS), and the warp shuffles each thread executed.
extern "C" void simt_entry_count_reads(const long long* ranges, int n) {{
  n = n < 16 ? n : 16;
  for (int i = 0; i < n; ++i) {{
    ::simt::detail::g_read_ranges[2 * i] = ranges[2 * i];
    ::simt::detail::g_read_ranges[2 * i + 1] = ranges[2 * i] + ranges[2 * i + 1];
    ::simt::detail::g_reads16[i] = 0;
  }}
  ::simt::detail::g_nread_ranges = n;
}}
extern "C" void simt_entry_reads(long long* out, int n) {{
  for (int i = 0; i < n && i < 16; ++i) out[i] = ::simt::detail::g_reads16[i];
}}
extern "C" long long simt_entry_shuffles(long long* out, long long n) {{
  for (long long i = 0; i < n && i < ::simt::detail::g_nshuffles; ++i) out[i] = ::simt::detail::g_shuffles[i];
  return ::simt::detail::g_nshuffles;
}}
"""


@dataclasses.dataclass(frozen=True)
class _Library:
    path: Path
    #: (offset from the library's base, bytes) of every __shared__ variable: poisoned before each block
    shared: tuple[tuple[int, int], ...]
    shared_names: tuple[str, ...]


_LOADED: dict[str, ctypes.CDLL] = {}
_LOCK = threading.Lock()
_ERROR_LINE = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?:\d+:)?\s*(?:fatal )?error:\s*(?P<message>.*)$", re.M)


def _shared_variables(lib: Path) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """The zero-initialized static variables of the kernel's code (its ``__shared__`` arrays): function-local
    statics (``_ZZ``) and namespace-scope ones (``_ZL``), not the runtime's own (``simt::``)."""
    nm = shutil.which("nm")
    if nm is None:
        return (), ()
    out = subprocess.run([nm, "-S", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    found, names = [], []
    for row in out.splitlines():
        parts = row.split()
        if len(parts) != 4 or parts[2] not in ("b", "B", "u", "V"):
            continue
        address, size, _, name = parts
        if not name.startswith(("_ZZ", "_ZL")) or name.startswith(("_ZZN4simt", "_ZZN6nvcuda", "_ZZNSt", "_ZZN9__gnu")):
            continue
        found.append((int(address, 16), int(size, 16)))
        names.append(name)
    return tuple(found), tuple(names)


def build(
    source: str | Path,
    kernel: str,
    ctypes_: Sequence[str],
    include_dirs: Sequence[str | Path] = (),
    defines: Mapping[str, object] | None = None,
    *,
    checked: bool = False,
) -> _Library:
    """Compile ``kernel`` of ``source`` with an entry taking arguments of the C++ types ``ctypes_`` (cached).
    Raises :class:`SimtCompileError` with g++'s errors when it does not compile."""
    if not isinstance(kernel, str) or not _KERNEL_NAME.match(kernel.strip()):
        raise ValueError(
            f"utils.simt: kernel must name a kernel as C++ calls it ('name' or 'name<4, float>'), got {kernel!r}"
        )
    text, label, dirs = _source_of(source)
    dirs += [str(Path(d).resolve()) for d in include_dirs]
    gxx, version = _compiler()
    wrapper = '#include "simt.h"\n' + text + _entry(kernel.strip(), ctypes_)
    args = [*_FLAGS, *(_checked_flags() if checked else ()), f"-I{HEADER_DIR}", *(f"-I{d}" for d in dirs)]
    args += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    key_text = "\0".join([wrapper, _included(text, dirs), _header_text(), *args, version])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    folder = _cache_dir() / key
    lib, meta = folder / "kernel.so", folder / "shared.json"
    if not (lib.is_file() and meta.is_file()):
        tmp = Path(tempfile.mkdtemp(dir=_cache_dir(), prefix=".build-"))
        try:
            (tmp / "entry.cpp").write_text(wrapper)
            command = [gxx, *args, "-o", str(tmp / "kernel.so"), str(tmp / "entry.cpp"), "-ldl"]
            result = subprocess.run(command, capture_output=True, text=True)
            log = (result.stdout + result.stderr).replace(str(tmp / "entry.cpp"), "simt-entry")
            if result.returncode != 0:
                errors = [
                    (Path(m["file"]).name, int(m["line"]), m["message"].strip()) for m in _ERROR_LINE.finditer(log)
                ]
                shown = "\n".join(f"{f}:{n}: {msg}" for f, n, msg in errors[:8]) or log.strip()[-2000:]
                raise SimtCompileError(f"utils.simt: g++ could not compile {label} ({kernel}):\n{shown}", log, errors)
            shared, names = _shared_variables(tmp / "kernel.so")
            (tmp / "shared.json").write_text(json.dumps({"shared": shared, "names": names}))
            try:
                os.rename(tmp, folder)  # atomic; a racing build of the same source may have won
            except OSError:
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    data = json.loads(meta.read_text())
    return _Library(lib, tuple(tuple(s) for s in data["shared"]), tuple(data["names"]))


# ------------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------------


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if (
        not isinstance(value, (tuple, list))
        or not 1 <= len(value) <= 3
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(f"utils.simt: {what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    dims = (*value, *(1,) * (3 - len(value)))
    if any(v < 0 for v in dims):
        raise ValueError(f"utils.simt: {what} must not be negative, got {tuple(value)}")
    return dims


@dataclasses.dataclass
class _Argument:
    ctype: str
    tensor: torch.Tensor | None = None
    scalar: Any = None
    storage: type | None = None  # the ctypes type of a scalar


def _arguments(args: Sequence[Any]) -> list[_Argument]:
    if not isinstance(args, (list, tuple)):
        raise TypeError(
            f"utils.simt: args must be a list or tuple of the kernel's arguments, got {type(args).__name__}"
        )
    found = []
    for i, value in enumerate(args):
        ctype = None
        if isinstance(value, Arg):
            value, ctype = value.value, " ".join(value.ctype.split())
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise ValueError(
                    f"utils.simt: argument {i} must be a CPU tensor (the kernel runs on the CPU), got "
                    f"one on {value.device}"
                )
            if value.dtype not in _DTYPES:
                raise TypeError(
                    f"utils.simt: argument {i} has dtype {value.dtype}; supported: "
                    f"{sorted(str(d).removeprefix('torch.') for d in _DTYPES)}"
                )
            if ctype is not None and not _POINTER_TYPE.match(ctype):
                raise ValueError(f"utils.simt: argument {i}: a tensor is passed as a pointer, got type {ctype!r}")
            found.append(_Argument(ctype or _DTYPES[value.dtype][0] + "*", tensor=value))
            continue
        if ctype is not None:
            if ctype not in _SCALARS:
                raise ValueError(
                    f"utils.simt: argument {i}: unsupported scalar type {ctype!r}; supported: {sorted(_SCALARS)}"
                )
            if not isinstance(value, (int, float, bool)):
                raise TypeError(
                    f"utils.simt: argument {i}: Arg({ctype!r}) needs an int, float or bool, got {type(value).__name__}"
                )
            found.append(_Argument(ctype, scalar=value, storage=_SCALARS[ctype]))
        elif isinstance(value, bool):
            found.append(_Argument("bool", scalar=value, storage=ctypes.c_bool))
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"utils.simt: argument {i} = {value} does not fit a long long")
            found.append(_Argument("long long", scalar=value, storage=ctypes.c_longlong))
        elif isinstance(value, float):
            found.append(_Argument("float", scalar=value, storage=ctypes.c_float))
        else:
            raise TypeError(
                f"utils.simt: argument {i} is a {type(value).__name__}; pass CPU tensors, ints, floats, "
                "bools, or utils.simt.Arg(value, 'C++ type')"
            )
    return found


def _poison_array(lib: _Library) -> tuple[Any, int]:
    flat = [v for pair in lib.shared for v in pair]
    return (ctypes.c_longlong * max(len(flat), 1))(*flat), len(lib.shared)


def _options(order: str, stack_size: int | None, fault_handler: bool) -> Any:
    if order not in ("forward", "reverse"):
        raise ValueError(f"utils.simt: order must be 'forward' or 'reverse', got {order!r}")
    return (ctypes.c_longlong * 3)(order == "reverse", stack_size or 0, fault_handler)


def _load(lib: _Library) -> Any:
    key = str(lib.path)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = ctypes.CDLL(key)
        function = _LOADED[key].simt_entry_run
    function.restype = ctypes.c_int
    return function


def launch(
    source: str | Path,
    kernel: str,
    grid: Any,
    block: Any,
    args: Sequence[Any],
    include_dirs: Sequence[str | Path] = (),
    defines: Mapping[str, object] | None = None,
    *,
    order: str = "forward",
    stack_size: int | None = None,
) -> None:
    """Run ``kernel<<<grid, block>>>(*args)`` of ``source`` (CUDA C++ text, or a ``.cu``/``.cuh`` path) on the
    CPU, in this process (see the module docstring). ``order="reverse"`` starts the threads of each block
    last to first (a missing barrier shows in one order or the other). Raises :class:`SimtCompileError`,
    :class:`SimtError` (a deadlock or a detected misuse), ``TypeError``/``ValueError`` for bad arguments."""
    grid3, block3 = _dims(grid, "grid"), _dims(block, "block")
    arguments = _arguments(args)
    lib = build(source, kernel, [a.ctype for a in arguments], include_dirs, defines)
    entry = _load(lib)
    keep, pointers = [], (ctypes.c_void_p * max(len(arguments), 1))()
    for i, a in enumerate(arguments):
        cell = ctypes.c_void_p(a.tensor.data_ptr()) if a.tensor is not None else a.storage(a.scalar)
        keep.append(cell)
        pointers[i] = ctypes.cast(ctypes.pointer(cell), ctypes.c_void_p)
    err = ctypes.create_string_buffer(_ERRLEN)
    poison, count = _poison_array(lib)
    rc = entry(
        (ctypes.c_longlong * 6)(*grid3, *block3),
        pointers,
        err,
        ctypes.c_longlong(_ERRLEN),
        _options(order, stack_size, False),
        poison,
        ctypes.c_int(count),
    )
    if rc:
        raise SimtError("utils.simt: " + err.value.decode(errors="replace"), "deadlock" if rc == 1 else "error")


# ------------------------------------------------------------------------------------------------------
# run_checked: a child process, guard regions
# ------------------------------------------------------------------------------------------------------

_GUARD = 4096  # bytes of guard before and after each tensor
_CANARY = 0xA5  # the byte an output's guards hold
_NAN_BYTES = {
    torch.float32: bytes.fromhex("0000c07f"),
    torch.float64: bytes.fromhex("000000000000f87f"),
    torch.bfloat16: bytes.fromhex("c07f"),
    torch.float16: bytes.fromhex("007e"),
}


@dataclasses.dataclass(frozen=True)
class GuardHit:
    """Writes outside one tensor argument: element offsets from its first element (negative: before it)."""

    arg: str
    before: tuple[int, ...]  # offsets < 0
    gaps: tuple[int, ...]  # offsets inside the span that are no element of the view (between strided rows)
    after: tuple[int, ...]  # offsets past the last element
    count: int

    def __str__(self) -> str:
        parts = []
        for name, offsets in (
            ("before its first element", self.before),
            ("between its rows (outside the view)", self.gaps),
            ("past its last element", self.after),
        ):
            if offsets:
                shown = ", ".join(map(str, offsets[:6])) + (", ..." if len(offsets) > 6 else "")
                parts.append(f"{len(offsets)} {name} (element offsets {shown})")
        return f"{self.arg}: wrote " + "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class BadAccess:
    """A read or write that AddressSanitizer caught touching bytes that are no element of a tensor argument's view:
    its guards, or the padding between a strided view's rows (the first such access of each source line).

    ``arg``: the argument's name (None: memory outside every tensor argument); ``size``: the access's bytes,
    ``outside`` of them no element of the view; ``place``: where those bytes are ("past the end of row 3, into
    the padding between rows"); ``row``: that row of a 2-d view (or None); ``line``: ``"kernel.cu:31"``;
    ``thread``: which thread of which block; ``kind``: AddressSanitizer's name for it."""

    arg: str | None
    write: bool
    size: int
    outside: int
    place: str
    row: int | None
    line: str
    thread: str
    kind: str

    def __str__(self) -> str:
        verb = "wrote" if self.write else "read"
        what = f"{self.outside} byte{'s' if self.outside != 1 else ''} {self.place}"
        access = f"a {self.size}-byte {'write' if self.write else 'read'} at {self.line or '?'}"
        who = f", {self.thread}" if self.thread else ""
        return f"{self.arg}: {verb} {what} ({access}{who})" if self.arg else f"{verb} {what} ({access}{who})"


@dataclasses.dataclass
class RunReport:
    """What happened to one :func:`run_checked` launch.

    ``status``: ``"ok"``, ``"compile_error"``, ``"deadlock"``, ``"error"`` (a misuse the emulator detects),
    ``"misaligned"`` (an access to an address not a multiple of its type's size), ``"out_of_bounds"`` (an
    index past a fixed-size array), ``"crash"`` (a signal: ``message`` says where), ``"timeout"``.
    ``guard_hits``: writes outside the tensors (even when ``status`` is ``"ok"``); ``changed_inputs``: input
    arguments whose elements changed; ``bad_accesses``: reads and writes of bytes that are no element of a view
    (AddressSanitizer's, where g++ has it). ``shuffles``: the warp shuffles (``__shfl_*_sync``) each thread
    executed, thread after thread (``threadIdx.x`` fastest, then ``y``, ``z``, then block after block in the same
    order); ``reads16``: with ``count_reads``, the 16-byte vector reads (a ``float4``, ``int4`` or ``uint4`` copied
    from the tensor's memory) of each tensor argument, by name. ``ok`` is true when the kernel ran to the end and
    touched nothing else.
    """

    status: str
    message: str = ""
    compile_errors: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    guard_hits: list[GuardHit] = dataclasses.field(default_factory=list)
    changed_inputs: list[str] = dataclasses.field(default_factory=list)
    bad_accesses: list[BadAccess] = dataclasses.field(default_factory=list)
    shuffles: list[int] = dataclasses.field(default_factory=list)
    reads16: dict[str, int] = dataclasses.field(default_factory=dict)
    output: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok" and not self.guard_hits and not self.changed_inputs and not self.bad_accesses

    def __str__(self) -> str:
        lines = [f"{self.status}: {self.message}" if self.message else self.status]
        lines += [str(a) for a in self.bad_accesses]
        lines += [str(h) for h in self.guard_hits]
        lines += [f"{name}: an input changed in place" for name in self.changed_inputs]
        return "\n".join(lines)


@dataclasses.dataclass
class _Member:
    index: int
    label: str
    tensor: torch.Tensor
    data: int  # the tensor's first element: its byte offset in the shared file
    output: bool


@dataclasses.dataclass
class _Region:
    """The guarded copy of one storage: the tensors on it (several if arguments alias), between guards."""

    start: int  # the region's offset in the shared file
    size: int
    base: int  # the lowest byte any of its tensors addresses
    nbytes: int  # from that byte to the end of the highest element addressed
    members: list[_Member]

    @property
    def label(self) -> str:
        return "/".join(dict.fromkeys(m.label for m in self.members))

    @property
    def first(self) -> _Member:
        return min(self.members, key=lambda m: m.data)


_CHILD = r"""
import ctypes, json, mmap, os, sys
spec = json.loads(sys.stdin.read())
lib = ctypes.CDLL(spec["lib"])
fd = os.open(spec["memory"], os.O_RDWR)
mem = mmap.mmap(fd, spec["size"])
base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
sys.stdout.write("SIMT-BASE %d\n" % base)
sys.stdout.flush()
types = {"bool": ctypes.c_bool, "char": ctypes.c_char, "signed char": ctypes.c_byte, "unsigned char": ctypes.c_ubyte,
         "short": ctypes.c_short, "unsigned short": ctypes.c_ushort, "int": ctypes.c_int, "unsigned": ctypes.c_uint,
         "unsigned int": ctypes.c_uint, "long": ctypes.c_long, "unsigned long": ctypes.c_ulong,
         "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong, "int32_t": ctypes.c_int32,
         "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
         "size_t": ctypes.c_size_t, "float": ctypes.c_float, "double": ctypes.c_double}
if spec["asan"]:  # every byte of each tensor's copy that is no element of its view
    poison_region = ctypes.CDLL(None).__asan_poison_memory_region
    poison_region.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    for start, length in spec["asan"]:
        poison_region(base + start, length)
cells = []
pointers = (ctypes.c_void_p * max(len(spec["args"]), 1))()
for i, (kind, ctype, value) in enumerate(spec["args"]):
    cell = ctypes.c_void_p(base + value) if kind == "tensor" else types[ctype](value)
    cells.append(cell)
    pointers[i] = ctypes.cast(ctypes.pointer(cell), ctypes.c_void_p)
err = ctypes.create_string_buffer(1 << 15)
poison = spec["poison"]
ranges = [v for start, length in spec["ranges"] for v in (base + start, length)]
lib.simt_entry_count_reads((ctypes.c_longlong * max(len(ranges), 1))(*ranges), ctypes.c_int(len(ranges) // 2))
entry = lib.simt_entry_run
entry.restype = ctypes.c_int
rc = entry((ctypes.c_longlong * 6)(*spec["dims"]), pointers, err, ctypes.c_longlong(1 << 15),
           (ctypes.c_longlong * 3)(*spec["options"]), (ctypes.c_longlong * max(len(poison), 1))(*poison),
           ctypes.c_int(len(poison) // 2))
ctypes.CDLL(None).fflush(None)
reads = (ctypes.c_longlong * 16)()
lib.simt_entry_reads(reads, ctypes.c_int(16))
lib.simt_entry_shuffles.restype = ctypes.c_longlong
count = lib.simt_entry_shuffles(None, ctypes.c_longlong(0))
shuffles = (ctypes.c_longlong * max(count, 1))()
lib.simt_entry_shuffles(shuffles, ctypes.c_longlong(count))
sys.stdout.write("\nSIMT-COUNTS " + json.dumps({"reads16": list(reads)[:len(ranges) // 2],
                                                 "shuffles": list(shuffles)[:count]}) + "\n")
sys.stdout.write("\nSIMT-RESULT " + json.dumps({"rc": rc, "message": err.value.decode(errors="replace")}) + "\n")
sys.stdout.flush()
"""


def _span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def _fill_pattern(dtype: torch.dtype, output: bool, nbytes: int) -> bytes:
    unit = bytes([_CANARY]) if output or dtype not in _NAN_BYTES else _NAN_BYTES[dtype]
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


def _owned(t: torch.Tensor, span: int) -> torch.Tensor:
    mask = torch.zeros(max(span, 1), dtype=torch.bool)
    if t.numel():
        mask.as_strided(t.shape, t.stride()).fill_(True)
    return mask[:span]


def _parse_fault(stderr: str, base: int | None, regions: list[_Region]) -> str | None:
    match = re.search(r"SIMT-FAULT (\w+) addr=(\S+)(?: block=(\S+) thread=(\S+))?( stack)?", stderr)
    if not match:
        return None
    signame, address, block, thread = match.group(1), match.group(2), match.group(3), match.group(4)
    who = f" in block ({block.replace(',', ', ')}), thread ({thread.replace(',', ', ')})" if block else ""
    if signame == "SIGFPE":
        return f"SIGFPE{who}: an integer division by zero"
    try:
        at = int(address, 16)
    except ValueError:
        at = None
    where = f"at address {address}"
    if at is not None and base is not None:
        for r in regions:
            if base + r.start <= at < base + r.start + r.size:
                itemsize = r.first.tensor.element_size()
                offset = (at - (base + r.first.data)) // itemsize
                side = "before its first element" if offset < 0 else "past its last element"
                where = f"{r.label}: element offset {offset} ({side})"
                break
        else:
            where = f"at address {address}, outside every tensor argument and its guards"
    if match.group(5):
        where = "a stack overflow (a large local array?)"
    return f"{signame}{who}: {where}"


def run_checked(
    source: str | Path,
    kernel: str,
    grid: Any,
    block: Any,
    args: Sequence[Any],
    include_dirs: Sequence[str | Path] = (),
    defines: Mapping[str, object] | None = None,
    *,
    outputs: Sequence[int] = (),
    names: Sequence[str] | None = None,
    order: str = "forward",
    timeout: float = 60.0,
    stack_size: int | None = None,
    count_reads: bool = False,
) -> RunReport:
    """Run ``kernel<<<grid, block>>>(*args)`` in a child process on guarded copies of the tensors, and say what
    happened (a :class:`RunReport`; never raises for the kernel's own faults). ``outputs``: the indices of
    the output tensors (their guards hold a canary; the others' hold NaN); ``names``: the arguments' names
    for the report. ``count_reads``: count each tensor's 16-byte vector reads (``RunReport.reads16``; float4, int4
    and uint4 are then built with constructors, not as aggregates). The tensors' new values are copied back into
    ``args``."""
    started = time.perf_counter()
    grid3, block3 = _dims(grid, "grid"), _dims(block, "block")
    arguments = _arguments(args)
    labels = list(names) if names is not None else [f"argument {i}" for i in range(len(arguments))]
    asan = _asan_runtime()
    try:
        if count_reads:
            defines = {**(defines or {}), "SIMT_COUNT_READS": 1}
        lib = build(source, kernel, [a.ctype for a in arguments], include_dirs, defines, checked=True)
    except SimtCompileError as error:
        return RunReport(
            "compile_error", str(error).split(":\n", 1)[-1], error.errors, seconds=time.perf_counter() - started
        )
    regions: list[_Region] = []
    offset = 0
    by_storage: dict[int, list[int]] = {}
    for i, a in enumerate(arguments):
        if a.tensor is not None:
            by_storage.setdefault(a.tensor.untyped_storage().data_ptr(), []).append(i)
    for indices in by_storage.values():
        tensors = [arguments[i].tensor for i in indices]
        low = min(t.data_ptr() for t in tensors)
        high = max(t.data_ptr() + _span(t) * t.element_size() for t in tensors)
        size = -(-(2 * _GUARD + 256 + (high - low)) // 4096) * 4096
        base = offset + _GUARD + low % 256
        members = [
            _Member(i, labels[i], arguments[i].tensor, base + arguments[i].tensor.data_ptr() - low, i in outputs)
            for i in indices
        ]
        regions.append(_Region(offset, size, base, high - low, members))
        offset += size
    total = max(offset, 4096)
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.NamedTemporaryFile(dir=folder, prefix="simt-", suffix=".mem") as handle:
        handle.truncate(total)
        handle.flush()
        with mmap.mmap(handle.fileno(), total) as memory:
            whole = torch.frombuffer(memory, dtype=torch.uint8, count=total)
            views: dict[int, torch.Tensor] = {}
            for r in regions:
                output = any(m.output for m in r.members)
                pattern = _fill_pattern(r.first.tensor.dtype, output, r.size)
                whole[r.start : r.start + r.size] = torch.frombuffer(bytearray(pattern), dtype=torch.uint8)
                for m in r.members:
                    views[m.index] = _view(whole, m)
                    if m.tensor.numel():
                        views[m.index].copy_(m.tensor)
            before = whole.clone()
            spec = {
                "lib": str(lib.path),
                "memory": handle.name,
                "size": total,
                "dims": [*grid3, *block3],
                "options": [order == "reverse", stack_size or 0, 1],
                "poison": [v for pair in lib.shared for v in pair],
                "asan": _poison_ranges(regions) if asan else [],
                "ranges": [
                    [m.data, _span(m.tensor) * m.tensor.element_size()]
                    for i in range(len(arguments))
                    for r in regions
                    for m in r.members
                    if m.index == i
                ],
                "args": [
                    ["tensor", a.ctype, next(m.data for r in regions for m in r.members if m.index == i)]
                    if a.tensor is not None
                    else ["scalar", a.ctype, a.scalar]
                    for i, a in enumerate(arguments)
                ],
            }
            env = {**os.environ, "UBSAN_OPTIONS": "print_stacktrace=0:halt_on_error=1:print_summary=0"}
            if asan:
                env["LD_PRELOAD"] = " ".join(filter(None, [asan, os.environ.get("LD_PRELOAD")]))
                env["ASAN_OPTIONS"] = _ASAN_OPTIONS
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            try:
                stdout, stderr = child.communicate(json.dumps(spec), timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                stdout, stderr = child.communicate()
                timed_out = True
            report = _outcome(child.returncode, stdout, stderr, timed_out, timeout, regions)
            report.bad_accesses = _bad_accesses(stderr, _child_base(stdout), regions)
            counted = re.search(r"^SIMT-COUNTS (.*)$", stdout, re.M)
            if counted:
                data = json.loads(counted.group(1))
                report.shuffles = data["shuffles"]
                tensors = [labels[i] for i, a in enumerate(arguments) if a.tensor is not None]
                report.reads16 = dict(zip(tensors, data["reads16"], strict=False)) if count_reads else {}
            _guards(report, regions, whole, before, views)
            for index, view in views.items():  # the kernel's writes, back into the caller's tensors
                if view.numel():
                    arguments[index].tensor.copy_(view)
            view = None  # every view of the shared memory goes before it is unmapped
            views.clear()
            del whole
    report.seconds = time.perf_counter() - started
    return report


#: AddressSanitizer in the child: report and go on (the kernel finishes, its guards still tell what it wrote), no
#: leak check of the Python process, the emulator's own SIGSEGV handler (it names the thread), one report per line.
_ASAN_OPTIONS = ":".join(
    [
        "halt_on_error=0",
        "detect_leaks=0",
        "handle_segv=0",
        "handle_sigbus=0",
        "handle_sigfpe=0",
        "allow_user_segv_handler=1",
        "detect_stack_use_after_return=0",
        "detect_odr_violation=0",
        "suppress_equal_pcs=1",
        "print_summary=0",
    ]
)


def _poison_ranges(regions: list[_Region]) -> list[list[int]]:
    """``[offset in the shared file, bytes]`` of every byte of the regions that is no element of a view."""
    ranges = []
    for r in regions:
        poison = torch.ones(r.size, dtype=torch.int8)
        low = r.base - r.start
        poison[low : low + r.nbytes] = (~_owned_bytes(r)).to(torch.int8)
        edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), poison, torch.zeros(1, dtype=torch.int8)]))
        starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
        ranges += [[r.start + int(a), int(b - a)] for a, b in zip(starts, ends, strict=True)]
    return ranges


def _child_base(stdout: str) -> int | None:
    found = re.search(r"^SIMT-BASE (\d+)$", stdout, re.M)
    return int(found.group(1)) if found else None


_ASAN_RECORD = re.compile(r"^SIMT-ASAN(?: block=(\S+) thread=(\S+))?\n(.*?)\nSIMT-ASAN-END$", re.M | re.S)
_HEADERS = {p.name for p in HEADER_DIR.glob("*.h")} | {"simt-entry"}


def _place(m: _Member, start: int, size: int) -> tuple[int, str, int | None]:
    """How many of the bytes ``[start, start + size)`` (from ``m``'s first element) are no element of its view,
    where the first of them lies, and its row (a 2-d view) or None."""
    t, itemsize = m.tensor, m.tensor.element_size()
    span = _span(t) * itemsize
    owned = _owned(t, _span(t)).repeat_interleave(itemsize) if t.numel() else torch.zeros(0, dtype=torch.bool)
    offsets = torch.arange(start, start + size)
    inside = (offsets >= 0) & (offsets < span)
    mine = torch.zeros(size, dtype=torch.bool)
    mine[inside] = owned[offsets[inside]]
    outside = int((~mine).sum())
    if outside == 0:
        return 0, "inside the view", None
    first = int(offsets[~mine][0])
    rows = t.shape[0] if t.dim() == 2 else None
    if first < 0:
        return outside, "before its first element", None
    if first >= span:
        if rows is not None and t.stride(1) == 1:
            return outside, f"past the end of row {rows - 1} (the last row), outside the tensor", rows - 1
        return outside, f"past its last element (element offset {first // itemsize})", None
    if rows is not None and t.stride(1) == 1:
        row = first // itemsize // t.stride(0)
        return outside, f"past the end of row {row}, into the padding between rows", row
    return outside, f"between its elements, outside the view (element offset {first // itemsize})", None


def _bad_accesses(stderr: str, base: int | None, regions: list[_Region]) -> list[BadAccess]:
    found = []
    for block, thread, text in _ASAN_RECORD.findall(stderr):
        kind = re.search(r"AddressSanitizer: ([\w-]+)", text)
        access = re.search(r"\b(READ|WRITE) of size (\d+) at (0x[0-9a-f]+)", text)
        if not access:
            continue
        frames = re.findall(r"^\s*#\d+ 0x[0-9a-f]+ in .*? (\S+?):(\d+)(?::\d+)?$", text, re.M)
        ours = [(f, n) for f, n in frames if Path(f).name not in _HEADERS and "sanitizer" not in f]
        line = f"{Path((ours or frames)[0][0]).name}:{(ours or frames)[0][1]}" if frames else ""
        who = ""
        if block:
            who = f"block ({block.replace(',', ', ')}), thread ({thread.replace(',', ', ')})"
        write, size, address = access.group(1) == "WRITE", int(access.group(2)), int(access.group(3), 16)
        arg, outside, place, row = None, size, f"outside every tensor argument ({kind.group(1) if kind else '?'})", None
        if base is not None:
            for r in regions:
                if base + r.start <= address < base + r.start + r.size:
                    at = address - base
                    m = next(
                        (m for m in r.members if m.data <= at < m.data + _span(m.tensor) * m.tensor.element_size()),
                        r.first,
                    )
                    outside, place, row = _place(m, at - m.data, size)
                    arg = r.label
                    break
        found.append(BadAccess(arg, write, size, outside, place, row, line, who, kind.group(1) if kind else ""))
    return found


def _outcome(
    returncode: int, stdout: str, stderr: str, timed_out: bool, timeout: float, regions: list[_Region]
) -> RunReport:
    base_match = re.search(r"^SIMT-BASE (\d+)$", stdout, re.M)
    base = int(base_match.group(1)) if base_match else None
    result = re.search(r"^SIMT-RESULT (.*)$", stdout, re.M)
    printed = re.sub(r"^SIMT-(BASE|RESULT|COUNTS) .*\n?", "", stdout, flags=re.M).strip("\n")
    if timed_out:
        return RunReport("timeout", f"the kernel ran past {timeout:g} s (an endless loop?)", output=printed)
    if result:
        data = json.loads(result.group(1))
        if data["rc"] == 0:
            return RunReport("ok", output=printed)
        return RunReport("deadlock" if data["rc"] == 1 else "error", data["message"], output=printed)
    sanitizer = re.search(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): runtime error: (?P<what>.*)$", stderr, re.M)
    if sanitizer:
        what = sanitizer["what"].strip()
        status = "misaligned" if "misaligned" in what else "out_of_bounds" if "out of bounds" in what else "error"
        return RunReport(status, f"{Path(sanitizer['file']).name}:{sanitizer['line']}: {what}", output=printed)
    fault = _parse_fault(stderr, base, regions)
    if fault:
        return RunReport("crash", fault, output=printed)
    tail = stderr.strip().splitlines()[-3:]
    how = f"signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
    return RunReport(
        "crash", f"the child process died ({how})" + (": " + " | ".join(tail) if tail else ""), output=printed
    )


def _view(whole: torch.Tensor, m: _Member) -> torch.Tensor:
    t = m.tensor
    flat = whole[m.data : m.data + _span(t) * t.element_size()].view(t.dtype)
    return flat.as_strided(t.shape, t.stride()) if t.numel() else flat[:0]


def _owned_bytes(r: _Region) -> torch.Tensor:
    """Which bytes of ``r`` (from its lowest addressed byte) belong to an element of one of its tensors."""
    owned = torch.zeros(r.nbytes, dtype=torch.bool)
    for m in r.members:
        t = m.tensor
        elements = _owned(t, _span(t)).repeat_interleave(t.element_size())
        owned[m.data - r.base : m.data - r.base + elements.numel()] |= elements
    return owned


def _guards(
    report: RunReport, regions: list[_Region], whole: torch.Tensor, before: torch.Tensor, views: dict[int, torch.Tensor]
) -> None:
    changed = (whole != before).nonzero().flatten()
    for r in regions:
        inside = changed[(changed >= r.start) & (changed < r.start + r.size)] - r.base
        if inside.numel() == 0:
            continue
        owned = _owned_bytes(r)
        in_span = (inside >= 0) & (inside < r.nbytes)
        gap = in_span.clone()
        gap[in_span] = ~owned[inside[in_span]]
        first = r.first
        size, shift = first.tensor.element_size(), first.data - r.base

        def elements(byte_offsets: torch.Tensor, size: int = size, shift: int = shift) -> tuple[int, ...]:
            return tuple(torch.unique(torch.div(byte_offsets - shift, size, rounding_mode="floor")).tolist())

        hit = GuardHit(
            r.label, elements(inside[inside < 0]), elements(inside[gap]), elements(inside[inside >= r.nbytes]), 0
        )
        hit = dataclasses.replace(hit, count=len(hit.before) + len(hit.gaps) + len(hit.after))
        if hit.count:
            report.guard_hits.append(hit)
        for m in r.members:
            if m.output or not m.tensor.numel():
                continue
            mine = _owned(m.tensor, _span(m.tensor)).repeat_interleave(m.tensor.element_size())
            start = m.data - r.base
            touched = inside[(inside >= start) & (inside < start + mine.numel())] - start
            if bool(mine[touched].any()):
                report.changed_inputs.append(m.label)
