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
"""

import ctypes
import json
import os
import sys


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
    for index, case in enumerate(spec["cases"]):
        arrays = []
        for buf in case["buffers"]:
            with open(buf["file"], "rb") as f:
                data = f.read()
            arrays.append((ctypes.c_char * len(data)).from_buffer_copy(data))
        for number, (buf, array) in enumerate(zip(case["buffers"], arrays)):
            print(f"BUFFER {index} {number} {ctypes.addressof(array)}", flush=True)
            if poison is not None:
                for start, length in buf.get("poison", []):
                    poison(ctypes.addressof(array) + start, length)
        args = []
        for arg in case["args"]:
            if "buffer" in arg:
                args.append(ctypes.addressof(arrays[arg["buffer"]]) + 4 * case["buffers"][arg["buffer"]]["offset"])
            else:
                args.append(arg["value"])
        os.write(2, f"CASE {index}\n".encode())  # on stderr, where AddressSanitizer writes its reports
        function(*args)
        for buf, array in zip(case["buffers"], arrays):
            if unpoison is not None:
                unpoison(ctypes.addressof(array), len(array))
            with open(buf["file"] + ".out", "wb") as f:
                f.write(bytes(array))
        print(f"DONE {index}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
