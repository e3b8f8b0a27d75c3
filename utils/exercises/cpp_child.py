"""The child process of :mod:`utils.exercises.cpp_kernel`: calls a learner's C++ function on prepared buffers.

Runs as a script (``python cpp_child.py SPEC.json``), importing only the standard library, so that it starts
in milliseconds and a crash in the learner's code (a segfault) ends this process, not the notebook's. The spec
names the library, the function, its argument kinds and, per case, the buffers (raw float32 files, guards
included) and scalars. For each case it loads the buffers, prints where each one lies (``BUFFER <case>
<buffer> <address>``), calls the function with pointers past each buffer's front guard, writes the buffers
back, and prints ``DONE <case>``: the parent knows which case a crash happened in, and which buffer an
address is in.

With ``"asan": true`` the library was built with AddressSanitizer and this process runs with its runtime
preloaded: before the call, each buffer's ``poison`` byte ranges (its guards, the padding between its rows)
are marked unaddressable (``__asan_poison_memory_region``), so that a load or store there is reported on
stderr (after the line ``CASE <case>``) — even one that reads a value and then discards it, or writes back the
bytes it read — and the call goes on. They are made addressable again after the call, before the buffers are
copied out.

A buffer with ``"page_end": true`` is placed so that its last element ends exactly where a page ends, with a page
mapped ``PROT_NONE`` after it (an anonymous ``mmap``, then ``mprotect``; the guard after it in the file is kept
aside and written back unchanged): any byte read or written past its end faults, whatever the instruction — a
masked load or store whose mask enables lanes past the end, a gather, which AddressSanitizer does not instrument.
A fault's address is printed (``FAULT <address>``) before the process dies of it, so that the parent can name the
buffer.
"""

import ctypes
import json
import mmap
import os
import sys

SIGSEGV, SIGBUS = 11, 7
SA_SIGINFO, SA_RESETHAND = 0x4, 0x80000000
_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class _Sigaction(ctypes.Structure):  # glibc's struct sigaction on Linux x86-64
    _fields_ = [
        ("handler", _HANDLER),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


def _on_fault(signum: int, info: int, context: int) -> None:
    """Say where the fault was (``si_addr``: after three ints and their padding in ``siginfo_t``), then return: the
    handler was installed once (``SA_RESETHAND``), so the instruction faults again and the process dies of it."""
    address = ctypes.c_void_p.from_address(info + 16).value or 0
    os.write(1, f"FAULT {address}\n".encode())


_fault_handler = _HANDLER(_on_fault)


def _report_faults() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    action = _Sigaction(handler=_fault_handler, flags=SA_SIGINFO | SA_RESETHAND)
    for signum in (SIGSEGV, SIGBUS):
        libc.sigaction(signum, ctypes.byref(action), None)


def _at_page_end(data: bytes, placed: int) -> tuple[ctypes.Array, mmap.mmap]:
    """The first ``placed`` bytes of ``data`` copied so that they end where a page ends, and a page that may not be
    touched right after them."""
    page = mmap.PAGESIZE
    body = -(-placed // page) * page
    region = mmap.mmap(-1, body + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    array = (ctypes.c_char * placed).from_buffer(region, body - placed)
    ctypes.memmove(array, data, placed)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(ctypes.addressof(array) + placed, page, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    return array, region


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    library = ctypes.CDLL(spec["library"])
    try:
        function = getattr(library, spec["function"])
    except AttributeError:
        print(f"MISSING {spec['function']}", flush=True)
        return 3
    kinds = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "f32": ctypes.c_float}
    function.argtypes = [kinds[k] for k in spec["argtypes"]]
    function.restype = None
    poison = unpoison = None
    if spec.get("asan"):
        runtime = ctypes.CDLL(None)  # the preloaded AddressSanitizer runtime is in the global namespace
        poison, unpoison = runtime.__asan_poison_memory_region, runtime.__asan_unpoison_memory_region
        for marker in (poison, unpoison):
            marker.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            marker.restype = None
    _report_faults()
    for index, case in enumerate(spec["cases"]):
        arrays, kept = [], []
        for buf in case["buffers"]:
            with open(buf["file"], "rb") as f:
                data = f.read()
            if buf.get("page_end"):
                array, region = _at_page_end(data, buf["page_end"])
                arrays.append(array)
                kept.append((region, data[buf["page_end"] :]))
            else:
                arrays.append((ctypes.c_char * len(data)).from_buffer_copy(data))
                kept.append((None, b""))
        for number, (buf, array) in enumerate(zip(case["buffers"], arrays)):
            print(f"BUFFER {index} {number} {ctypes.addressof(array)}", flush=True)
            if poison is not None:
                for start, length in buf.get("poison", []):
                    if start < len(array):  # a buffer at a page's end has no guard after it here
                        poison(ctypes.addressof(array) + start, min(length, len(array) - start))
        args = []
        for arg in case["args"]:
            if "buffer" in arg:
                args.append(ctypes.addressof(arrays[arg["buffer"]]) + 4 * case["buffers"][arg["buffer"]]["offset"])
            else:
                args.append(arg["value"])
        os.write(2, f"CASE {index}\n".encode())  # on stderr, where AddressSanitizer writes its reports
        function(*args)
        for buf, array, (_, rest) in zip(case["buffers"], arrays, kept):
            if unpoison is not None:
                unpoison(ctypes.addressof(array), len(array))
            with open(buf["file"] + ".out", "wb") as f:
                f.write(bytes(array) + rest)
        print(f"DONE {index}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
