"""Run a tests/aot compile script (its ``--quick`` set) timing each ``triton.compile``; print the seconds as JSON.

Run in a compiled-mode child by :func:`bench.compile_count.measure_compile_seconds`; the last line is the list.
"""

import json
import runpy
import sys
import time

import triton

seconds = []
_compile = triton.compile


def timed_compile(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _compile(*args, **kwargs)
    finally:
        seconds.append(time.perf_counter() - start)


triton.compile = timed_compile  # utils.aot.compile_kernel calls triton.compile through the module
script = sys.argv[1]
sys.argv = [script, "--quick"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
print(json.dumps(seconds))
