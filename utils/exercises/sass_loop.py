"""The instruction-level part of a check: a candidate kernel compiled for sm_90, its steady loop read.

An exercise that asks for fewer instructions, not only for the right values, needs the kernel
compiled — which the interpreter the checks run in never does. :func:`loop_report` takes the
candidate's ``@triton.jit`` function, writes its source into a script, and runs that script in a
child process in compiled mode (:func:`utils.aot.run_compiled`), which compiles it for an H100/H200
(:func:`utils.aot.compile_kernel`, the specialization a :class:`CompileSpec` states), disassembles
the cubin with the line table Triton puts in it (``nvdisasm -gi``) and reads it with
:mod:`utils.sass`: the steady loop (:func:`utils.sass.steady_loop`), its instructions by category,
opcode and *source line of the kernel*. A verdict can then say "line 7, ``b = rows // T``: 38
integer instructions (IMAD.HI ×4, ...)", not only a total.

The kernel must stand alone: the script holds its source and ``import triton``,
``import triton.language as tl``, nothing from the notebook (a helper or a global it uses is an
error the report carries, not an exception). A compile takes a few seconds: reports are kept by
the hash of the source, the specification and the tools (in memory, and as JSON files under the
system's temporary folder), so a check run twice compiles once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
import tempfile
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CompileSpec", "LoopReport", "SourceLine", "kernel_source", "loop_report"]

#: The categories counted as loop overhead by :attr:`LoopReport.integer_control` (:data:`utils.sass.CATEGORIES`).
OVERHEAD = ("integer", "control")

_CACHE_DIR = Path(tempfile.gettempdir()) / "kernel-ladder-sass-checks"
_MEMORY: dict[str, LoopReport] = {}


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """How to compile a candidate: the specialization Triton's launcher would build for one real call.

    ``types`` gives every runtime argument's Triton type (``"*fp32"``, ``"i32"``); ``constexprs``
    the constexpr values; ``ones`` the integer arguments equal to 1 (a unit stride, specialized to a
    constant); ``divisible`` those divisible by 16. ``label`` says which call that is, for the verdict.
    """

    label: str
    types: Mapping[str, str]
    constexprs: Mapping[str, Any]
    ones: tuple[str, ...] = ()
    divisible: tuple[str, ...] = ()
    num_warps: int = 4

    def __repr__(self) -> str:  # what a verdict's case line shows
        return f"sm_90 compile of {self.label}"

    def as_json(self) -> str:
        return json.dumps({"types": dict(self.types), "constexprs": dict(self.constexprs), "ones": list(self.ones),
                           "divisible": list(self.divisible), "num_warps": self.num_warps}, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class SourceLine:
    """One line of the kernel's source and what its instructions in the steady loop are."""

    number: int  # 1 = the ``def`` line
    text: str
    categories: dict[str, int]
    opcodes: dict[str, int]  # full opcodes (``IMAD.WIDE``, ``MUFU.RCP``), their counts

    @property
    def overhead(self) -> int:
        return sum(self.categories.get(c, 0) for c in OVERHEAD)


@dataclasses.dataclass(frozen=True)
class LoopReport:
    """What the sm_90 SASS of a kernel says about its steady loop (one pass of it).

    ``error`` is set (and the rest empty) when the kernel could not be compiled alone: the message,
    first line of the child's error. ``loop_found`` is False when the SASS has no loop.
    """

    kernel: str
    error: str | None = None
    registers: int | None = None
    spilled_bytes: int | None = None
    loop_found: bool = False
    loops: int = 0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    opcodes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    lines: tuple[SourceLine, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def integer_control(self) -> int:
        """Integer and control instructions in one pass of the steady loop: its overhead."""
        return sum(self.counts.get(c, 0) for c in OVERHEAD)

    def overhead_opcodes(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for category in OVERHEAD:
            for opcode, n in self.opcodes.get(category, {}).items():
                merged[opcode] = merged.get(opcode, 0) + n
        return dict(sorted(merged.items(), key=lambda item: -item[1]))

    @staticmethod
    def from_json(data: dict[str, Any]) -> LoopReport:
        lines = tuple(SourceLine(**line) for line in data.pop("lines", ()))
        return LoopReport(**data, lines=lines)


def kernel_source(kernel: Any) -> tuple[str, str]:
    """``(name, source)`` of a ``@triton.jit`` function, interpreted or compiled, from its ``def`` on."""
    function = getattr(kernel, "fn", kernel)
    src = getattr(kernel, "src", None)
    if not isinstance(src, str):
        try:
            src = textwrap.dedent(inspect.getsource(function))
        except (TypeError, OSError):  # a builtin, or a function whose source is gone
            src = ""
    start = re.search(r"^def\s+\w+\s*\(", src, re.MULTILINE)
    if start is None or not hasattr(kernel, "fn"):
        raise TypeError("utils.exercises.sass_loop: kernel must be a @triton.jit function, got "
                        f"{type(kernel).__name__}")
    return function.__name__, src[start.start():]


# The child's script: the kernel's source first (line numbers are counted from it), then the reading.
_HEADER = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
_READER = r'''


def _read_loop(compiled, source_lines, first_line):
    import collections
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    from utils import sass

    instructions = sass.parse(sass.disassemble(compiled))
    loop = sass.steady_loop(instructions)
    # The line table: nvdisasm -gi puts '//## File "...", line N' (and '... inlined at ..., line M')
    # before the instructions of each line; the last line number named is the kernel's own.
    nvdisasm = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([nvdisasm, "-c", "-gi", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    line_of, current = {}, None
    for row in text.splitlines():
        if row.lstrip().startswith("//##"):
            numbers = re.findall(r"line (\d+)", row)
            current = int(numbers[-1]) - first_line + 1 if numbers else None
            continue
        found = re.match(r"\s*/\*([0-9a-f]+)\*/\s", row)
        if found:
            line_of[int(found.group(1), 16)] = current
    counts, opcodes, by_line = collections.Counter(), {}, {}
    for instruction in (loop.instructions if loop else ()):
        category = sass.classify(instruction)
        counts[category] += 1
        opcodes.setdefault(category, collections.Counter())[instruction.opcode] += 1
        number = line_of.get(instruction.address)
        if number is not None and 1 <= number <= len(source_lines):
            entry = by_line.setdefault(number, (collections.Counter(), collections.Counter()))
            entry[0][category] += 1
            entry[1][instruction.opcode] += 1
    lines = [dict(number=n, text=source_lines[n - 1].strip(), categories=dict(c), opcodes=dict(o))
             for n, (c, o) in sorted(by_line.items())]
    return dict(loop_found=loop is not None, loops=len(sass.loops(instructions)), counts=dict(counts),
                opcodes={k: dict(v) for k, v in opcodes.items()}, lines=lines)


def _main():
    import json
    import sys

    from utils.aot import compile_kernel, resource_usage

    spec = json.loads(sys.argv[1])
    kernel = globals()[sys.argv[2]]

    def type_of(name):
        if name not in spec["types"]:
            raise TypeError(f"argument {name!r} is not one of the kernel's given arguments {sorted(spec['types'])}")
        return spec["types"][name]

    compiled = compile_kernel(kernel, type_of, spec["constexprs"], ones=spec["ones"], divisible=spec["divisible"],
                              num_warps=spec["num_warps"])
    usage = resource_usage(compiled)
    first, count = 6, int(sys.argv[3])  # the kernel's def is the script's line 6 (after _HEADER)
    with open(__file__) as script:
        source_lines = script.read().splitlines()[first - 1:first - 1 + count]
    report = _read_loop(compiled, source_lines, first)
    report.update(registers=usage and usage.registers, spilled_bytes=usage and usage.spilled_bytes)
    print("LOOP-REPORT " + json.dumps(report))


if __name__ == "__main__":
    _main()
'''


def _tools_hash() -> str:
    """What a report depends on besides the kernel: this module, utils.sass and utils.aot, Triton's version."""
    import triton

    digest = hashlib.sha256(triton.__version__.encode())
    here = Path(__file__).resolve()
    for path in (here, here.parent.parent / "sass.py", here.parent.parent / "aot.py"):
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()


def loop_report(kernel: Any, spec: CompileSpec, timeout: float = 300) -> LoopReport:
    """Compile ``kernel`` alone for sm_90 as ``spec`` says, in a child process, and read its steady loop.

    Never raises for the kernel's own faults (a name it cannot find, an argument the spec does not
    know, a compile error): the report carries them in ``error``.
    """
    from utils.aot import run_compiled

    name, source = kernel_source(kernel)
    script = _HEADER + source.rstrip() + "\n\n\n# --- reader ---" + _READER
    key = hashlib.sha256("\0".join((script, spec.as_json(), name, _tools_hash())).encode()).hexdigest()[:32]
    if key in _MEMORY:
        return _MEMORY[key]
    cached = _CACHE_DIR / f"{key}.json"
    if cached.exists():
        try:
            report = LoopReport.from_json(json.loads(cached.read_text()))
            _MEMORY[key] = report
            return report
        except (ValueError, TypeError):
            pass  # a damaged file: compile again
    _CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_CACHE_DIR) as work:
        Path(work, "triton-cache").mkdir()
        count = str(len(source.rstrip().splitlines()))
        result = run_compiled(script, work, timeout=timeout, args=(spec.as_json(), name, count))
    found = [line for line in result.stdout.splitlines() if line.startswith("LOOP-REPORT ")]
    if result.returncode != 0 or not found:
        errors = [line.strip() for line in result.stderr.strip().splitlines() if line.strip()]
        last = next((line for line in reversed(errors) if re.match(r"\w*(Error|Exception)\b", line)),
                    errors[-1] if errors else f"exit status {result.returncode}")
        report = LoopReport(kernel=name, error=last[:300])
    else:
        report = LoopReport.from_json({"kernel": name, **json.loads(found[-1].removeprefix("LOOP-REPORT "))})
        cached.write_text(json.dumps(dataclasses.asdict(report)))
    _MEMORY[key] = report
    return report
