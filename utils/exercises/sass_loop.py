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

import collections
import contextlib
import dataclasses
import hashlib
import inspect
import json
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["CompileSpec", "LoopReport", "LoopView", "Op", "SourceLine", "def_line", "kernel_source", "loop_report",
           "loop_reports", "path_load_bytes", "recorded_loads"]

#: The categories counted as loop overhead by :attr:`LoopReport.integer_control` (:data:`utils.sass.CATEGORIES`).
OVERHEAD = ("integer", "control")

#: Conversions between integers and floats (and float rounding): the FP32 pipe's share of index arithmetic
#: (a division done in floats, an integer index rebuilt from one), counted apart by :meth:`LoopView.conversions`.
CONVERSIONS = ("I2F", "F2I", "I2FP", "F2IP", "FRND")

#: Instructions that load from global memory into registers, or copy from it into shared memory (cp.async).
_LOADS = ("LDG", "LD", "LDGSTS")

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
    """One line of the kernel's source and what its instructions in a loop are."""

    number: int  # 1 = the ``def`` line
    text: str
    categories: dict[str, int]
    opcodes: dict[str, int]  # full opcodes (``IMAD.WIDE``, ``MUFU.RCP``), their counts

    @property
    def overhead(self) -> int:
        return sum(self.categories.get(c, 0) for c in OVERHEAD)


@dataclasses.dataclass(frozen=True)
class Op:
    """One SASS instruction: its address, predicate, full opcode, base, category
    (:func:`utils.sass.classify`) and the kernel's source line it comes from (1 = ``def``; None if unknown)."""

    address: int
    predicate: str | None
    opcode: str
    base: str
    category: str
    line: int | None
    operands: str = ""
    target: int | None = None  # a branch's target address

    @property
    def load_bytes(self) -> int:
        """Bytes one thread reads from global memory with this instruction (0 if it is not a load)."""
        if self.base not in _LOADS or self.predicate == "!PT":
            return 0
        width = 4
        for part in self.opcode.split(".")[1:]:
            width = {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(part, width)
        return width

    @property
    def address_operand(self) -> str:
        """A load's address as the SASS writes it (``desc[UR4][R2.64+0x10]``): its operands after the first."""
        return self.operands.split(",", 1)[1].strip() if "," in self.operands else ""

    def written(self) -> set[str]:
        """The registers this instruction writes (its first operand, the width its opcode says), as far as
        this reading needs: whether a load's address register changed between two loads."""
        first = re.match(r"\s*R(\d+)\b", self.operands)
        if first is None or self.base.startswith(("ST", "RED", "ATOM")) or self.base in _BRANCH_BASES:
            return set()
        width = 4 if ".128" in self.opcode else 2 if (".64" in self.opcode or ".WIDE" in self.opcode) else 1
        return {f"R{int(first.group(1)) + i}" for i in range(width)}


_BRANCH_BASES = ("BRA", "JMP", "BRX", "JMX")
_PATH_LIMIT = 256  # paths through one pass enumerated at most; past that, the pass is counted whole


def _registers_of(address: str) -> set[str]:
    """The registers an address operand reads: ``[R2.64+0x10]`` reads R2 and R3."""
    found = set()
    for number, wide in re.findall(r"\bR(\d+)(\.64)?", address):
        found.update(f"R{int(number) + i}" for i in range(2 if wide else 1))
    return found


def path_load_bytes(ops: tuple[Op, ...] | list[Op], counted: Callable[[Op], bool] | None = None) -> int:
    """Bytes one thread loads from global memory on one path through a pass: a load of an address already
    loaded on the path (the same address operand, its registers unchanged since) counts once, and of loads
    under complementary predicates (``@P0`` / ``@!P0``: an if/else the compiler predicated) only the larger
    side counts — at most one of them runs. ``counted``: which loads count at all (default: every one; e.g.
    :meth:`LoopReport.loads_elements`, a load whose line loaded in the interpreted runs)."""
    seen: dict[str, int] = {}  # address operand -> its bytes, while its registers are unchanged
    by_predicate: dict[str, int] = collections.Counter()
    for op in ops:
        if op.load_bytes and (counted is None or counted(op)):
            address = op.address_operand
            if address not in seen:
                seen[address] = op.load_bytes
                by_predicate[(op.predicate or "PT")] += op.load_bytes
        written = op.written()
        for address in [a for a in seen if _registers_of(a) & written]:
            del seen[address]
    total = by_predicate.pop("PT", 0)
    registers = {p.lstrip("!") for p in by_predicate}
    for register in registers:
        total += max(by_predicate.get(register, 0), by_predicate.get("!" + register, 0))
    return total


@dataclasses.dataclass(frozen=True)
class LoopView:
    """One loop of the SASS (a backward branch and its target): every instruction between them, the
    instructions of the loops nested in it included, each once — one pass of the loop and of each
    loop inside it. ``depth``: how many loops enclose it; ``innermost``: no loop lies inside it."""

    start: int
    end: int
    ops: tuple[Op, ...]
    depth: int
    innermost: bool
    inner: tuple[tuple[int, int], ...] = ()  # the spans of the loops inside it

    def paths(self) -> list[tuple[Op, ...]] | None:
        """Every path through one pass, from the loop's first instruction to its backward branch: a forward
        branch taken or not (both, if predicated), each loop inside run once (its backward branch falls
        through, and a branch that skips a whole inner loop is not taken). A path that leaves the loop or
        exits is no pass. None if there are more than a few hundred paths, or a branch with no known target."""
        index = {op.address: i for i, op in enumerate(self.ops)}
        done: list[tuple[Op, ...]] = []
        pending: list[tuple[int, tuple[Op, ...]]] = [(0, ())]
        while pending:
            i, path = pending.pop()
            while i < len(self.ops):
                op = self.ops[i]
                path += (op,)
                conditional = op.predicate not in (None, "PT")
                if op.base in ("EXIT", "RET") and not conditional:
                    break
                if op.base in _BRANCH_BASES:
                    if op.address == self.end:
                        done.append(path)
                        break
                    if op.target is None:
                        return None
                    if op.target <= op.address or (op.target > self.end and conditional):
                        i += 1  # an inner loop's back edge (run once), or a conditional exit not taken
                        continue
                    if op.target > self.end or op.target not in index:
                        break  # leaves the loop: no pass
                    skips_inner = any(op.address < s and e < op.target for s, e in self.inner)
                    if conditional and not skips_inner:
                        pending.append((index[op.target], path))
                    i = i + 1 if conditional else index[op.target]
                    continue
                i += 1
            if len(done) + len(pending) > _PATH_LIMIT:
                return None
        return done or None

    @property
    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(op.category for op in self.ops))

    @property
    def load_bytes(self) -> int:
        return sum(op.load_bytes for op in self.ops)

    @property
    def loads(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.load_bytes)

    def conversions(self) -> int:
        return sum(op.base in CONVERSIONS for op in self.ops)

    def opcodes(self, categories: tuple[str, ...] | None = None) -> dict[str, int]:
        """Full opcodes and their counts, most frequent first (of ``categories`` only, if given)."""
        found = collections.Counter(op.opcode for op in self.ops if categories is None or op.category in categories)
        return dict(sorted(found.items(), key=lambda item: -item[1]))

    def lines(self, source: tuple[str, ...]) -> tuple[SourceLine, ...]:
        """The loop's instructions by the kernel's source line they come from."""
        by_line: dict[int, tuple[collections.Counter, collections.Counter]] = {}
        for op in self.ops:
            if op.line is not None and 1 <= op.line <= len(source):
                entry = by_line.setdefault(op.line, (collections.Counter(), collections.Counter()))
                entry[0][op.category] += 1
                entry[1][op.opcode] += 1
        return tuple(SourceLine(number=n, text=source[n - 1].strip(), categories=dict(c), opcodes=dict(o))
                     for n, (c, o) in sorted(by_line.items()))


@dataclasses.dataclass(frozen=True)
class LoopReport:
    """What the sm_90 SASS of a kernel says about its loops.

    ``error`` is set (and the rest empty) when the kernel could not be compiled alone: the message,
    first line of the child's error. ``ops`` holds the kernel's instructions, ``spans`` its loops
    (``(start, end)`` addresses), ``source`` the kernel's source lines (1 = the ``def`` line). The
    *steady loop* here is the innermost loop that loads the most bytes from global memory per pass
    (:attr:`steady`): the one that walks the data. ``counts``, ``opcodes``, ``lines`` and ``total``
    describe one pass of it.
    """

    kernel: str
    error: str | None = None
    registers: int | None = None
    spilled_bytes: int | None = None
    source: tuple[str, ...] = ()
    ops: tuple[Op, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()
    narrow_products: tuple[int, ...] = ()  # lines with a 32-bit product of a loop's index and a stride
    stride_products: tuple[int, ...] = ()  # lines with another 32-bit product of a stride (cols * stride_d)
    first_line: int = 1  # the line of the ``def`` in the file (or notebook cell) that holds the kernel
    #: The lines (1 = the ``def``) whose ``tl.load`` loaded at least one element when the kernel ran (in the
    #: interpreter, :func:`recorded_loads`); None if it was not run: every load is then taken to load.
    loaded_lines: frozenset[int] | None = None

    def loads_elements(self, op: Op) -> bool:
        """Whether ``op`` is a load that really loads: a load of a line that loaded an element when the kernel
        ran, or of no known line of the kernel (a load of a line that never did — masked off in every case,
        or in a branch no case took — reads nothing, whatever its SASS says)."""
        if not op.load_bytes:
            return False
        return self.loaded_lines is None or op.line is None or op.line in self.loaded_lines

    def idle_load_lines(self, ops: tuple[Op, ...] | list[Op]) -> list[int]:
        """The lines of the loads among ``ops`` that never loaded an element when the kernel ran."""
        return sorted({op.line for op in ops if op.load_bytes and not self.loads_elements(op) and op.line})

    def where(self, number: int) -> str:
        """``line N of kernel `text```: source line ``number`` (1 = the ``def``) as tracebacks number it."""
        text = self.source[number - 1].strip() if 1 <= number <= len(self.source) else "?"
        return f"line {self.first_line + number - 1} of {self.kernel} `{text[:70]}`"

    def all_loops(self) -> list[LoopView]:
        """Every loop, outermost first."""
        views = []
        for start, end in self.spans:
            depth = sum(s <= start and end <= e and (s, e) != (start, end) for s, e in self.spans)
            inner = any(start <= s and e <= end and (s, e) != (start, end) for s, e in self.spans)
            ops = tuple(op for op in self.ops if start <= op.address <= end)
            if all(op.category == "control" for op in ops):
                continue  # the branch-to-itself after EXIT, or a spin: no loop of the kernel's
            nested = tuple((s, e) for s, e in self.spans if start <= s and e <= end and (s, e) != (start, end))
            views.append(LoopView(start, end, ops, depth, not inner, nested))
        return sorted(views, key=lambda view: (view.start, -view.end))

    def loading_loops(self) -> list[LoopView]:
        """The loops that load from global memory (in their own body or a loop nested in it)."""
        return [view for view in self.all_loops() if view.load_bytes]

    @property
    def steady(self) -> LoopView | None:
        innermost = [view for view in self.loading_loops() if view.innermost]
        return max(innermost, key=lambda view: (view.load_bytes, len(view.ops)), default=None)

    @property
    def loop_found(self) -> bool:
        return bool(self.all_loops())

    @property
    def loops(self) -> int:
        return len(self.all_loops())

    @property
    def counts(self) -> dict[str, int]:
        return self.steady.counts if self.steady else {}

    @property
    def opcodes(self) -> dict[str, dict[str, int]]:
        steady = self.steady
        if steady is None:
            return {}
        return {category: steady.opcodes((category,)) for category in steady.counts}

    @property
    def lines(self) -> tuple[SourceLine, ...]:
        return self.steady.lines(self.source) if self.steady else ()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def integer_control(self) -> int:
        """Integer and control instructions in one pass of the steady loop."""
        return sum(self.counts.get(c, 0) for c in OVERHEAD)

    def overhead_opcodes(self) -> dict[str, int]:
        return self.steady.opcodes(OVERHEAD) if self.steady else {}

    def as_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "error": self.error, "registers": self.registers,
                "spilled_bytes": self.spilled_bytes, "source": list(self.source),
                "ops": [list(dataclasses.astuple(op)) for op in self.ops], "spans": [list(s) for s in self.spans],
                "narrow_products": list(self.narrow_products), "stride_products": list(self.stride_products)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> LoopReport:
        return LoopReport(kernel=data["kernel"], error=data.get("error"), registers=data.get("registers"),
                          spilled_bytes=data.get("spilled_bytes"), source=tuple(data.get("source", ())),
                          ops=tuple(Op(*op) for op in data.get("ops", ())),
                          spans=tuple(tuple(span) for span in data.get("spans", ())),
                          narrow_products=tuple(data.get("narrow_products", ())),
                          stride_products=tuple(data.get("stride_products", ())))


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


@contextlib.contextmanager
def recorded_loads(kernel: Any) -> Iterator[collections.Counter]:
    """While in the block, count the elements each ``tl.load`` of ``kernel`` loads when Triton's interpreter
    runs it, by line of the kernel (1 = the ``def``, as :class:`LoopReport` numbers its SASS): a line appears
    once one of its loads runs, with the number of lanes its mask let through (0: masked off every time).
    Wraps the interpreter's ``create_masked_load`` (every load goes through it: unmasked, atomic, descriptor
    loads) for the block only; yields the counter, filled as the kernel runs."""
    import numpy as np
    from triton.runtime import interpreter

    function = getattr(kernel, "fn", kernel)
    name, filename, first = function.__name__, function.__code__.co_filename, def_line(kernel)
    builder = interpreter.InterpreterBuilder
    original = builder.__dict__["create_masked_load"]
    counts: collections.Counter = collections.Counter()

    def create_masked_load(self, ptrs, mask, *rest, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name == name and frame.f_code.co_filename == filename):
            frame = frame.f_back
        if frame is not None:
            shape = np.shape(ptrs.data)
            lanes = (int(np.prod(shape, dtype=np.int64)) if mask is None
                     else int(np.count_nonzero(np.broadcast_to(np.asarray(mask.data), shape))))
            counts[frame.f_lineno - first + 1] += lanes
        return original(self, ptrs, mask, *rest, **kwargs)

    builder.create_masked_load = create_masked_load
    try:
        yield counts
    finally:
        if builder.__dict__.get("create_masked_load") is create_masked_load:
            builder.create_masked_load = original


def def_line(kernel: Any) -> int:
    """The line of a ``@triton.jit`` function's ``def`` in the file (or notebook cell) holding it, as Python's
    tracebacks number it; 1 if its source cannot be found."""
    function = getattr(kernel, "fn", kernel)
    try:
        lines, start = inspect.getsourcelines(function)
    except (TypeError, OSError):
        return 1
    return start + next((i for i, line in enumerate(lines) if re.match(r"\s*def\s", line)), 0)


# The child's script: the kernel's source first (line numbers are counted from it), then the reading.
_HEADER = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
_FIRST_LINE = 6  # the kernel's def is the script's line 6 (after _HEADER)
_READER = r"""


def _read(compiled, first_line):
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    from utils import sass

    instructions = sass.parse(sass.disassemble(compiled))
    # The line table: nvdisasm -gi puts '//## File "...", line N' (and '... inlined at "...", line M')
    # before the instructions of each line. The kernel's line is the last one named in this script's
    # own file; a line of another file (Triton's library: tl.zeros, tl.sum...) is none of the kernel's.
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
            numbers = [int(n) for name, n in re.findall(r'"([^"]+)", line (\d+)', row)
                       if os.path.basename(name) == os.path.basename(__file__)]
            current = numbers[-1] - first_line + 1 if numbers else None
            continue
        found = re.match(r"\s*/\*([0-9a-f]+)\*/\s", row)
        if found:
            line_of[int(found.group(1), 16)] = current
    # A load Triton emits as inline PTX (a vector load with its `other` values: one `mov` per register, then
    # the `ld`) is numbered by ptxas one line further per line of the asm text: its SASS line is the load's
    # line plus the registers it fills less one. Put each such load back on the line of its `tl.load`.
    shifted = _inline_asm_load_lines(compiled.asm["ptx"], first_line)
    ops = [[i.address, i.predicate, i.opcode, i.base, sass.classify(i),
            shifted.get(line_of.get(i.address), line_of.get(i.address)) if i.base in ("LDG", "LD", "LDGSTS")
            else line_of.get(i.address), i.operands, i.target] for i in instructions]
    spans = sorted({(loop.start, loop.end) for loop in sass.loops(instructions)})
    narrow, scaled = _narrow_products(compiled.asm["ttir"], first_line)
    return dict(ops=ops, spans=spans, narrow_products=narrow, stride_products=scaled)


def _inline_asm_load_lines(ptx, first_line):
    # {the line ptxas gives a global load inside an inline asm block: the line of the block's own .loc},
    # both in this script's file, numbered as the SASS line table numbers them (see _read).
    import os
    import re

    files = {number for number, name in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.MULTILINE)
             if os.path.basename(name) == os.path.basename(__file__)}
    mapping, current, block = {}, None, None
    for row in ptx.splitlines():
        text = row.strip()
        loc = re.match(r"\.loc\s+(\d+)\s+(\d+)\s", text)
        if loc:
            current = (loc.group(1), int(loc.group(2)) - first_line + 1)
        elif text.startswith("// begin inline asm"):
            block = current
        elif text.startswith("// end inline asm"):
            block = None
        elif block is not None and current is not None and re.match(r"(@!?%\w+\s+)?ld\.global", text):
            if current[0] in files and block[0] in files and current[1] != block[1]:
                mapping.setdefault(current[1], set()).add(block[1])
    return {line: lines.pop() for line, lines in mapping.items() if len(lines) == 1}


def _narrow_products(ttir, first_line):
    # Lines of the kernel where a value derived from a stride argument is multiplied in 32 bits: an
    # offset that grows with the tensor and wraps past 2**31 elements. Read from Triton's IR, which
    # names both. Two lists: the products with a value derived from a loop's index (an scf.for
    # induction variable: b * stride_b), and the others (cols * stride_d, BLOCK_R * stride_t).
    import re

    locs = {}
    for name, body in re.findall(r"^#(loc\d*) = loc\((.*)\)$", ttir, re.MULTILINE):
        locs[name] = body

    def line_of(loc, depth=0):
        body = locs.get(loc, "")
        direct = re.match(r'"[^"]*":(\d+):\d+', body)
        if direct:
            return int(direct.group(1)) - first_line + 1
        inner = re.findall(r"#(loc\d*)", body)
        return line_of(inner[-1], depth + 1) if inner and depth < 20 else None

    loop_derived, stride_derived, found, scaled = set(), set(), set(), set()
    for row in ttir.splitlines():
        induction = re.search(r"scf\.for (%[\w.]+) = ", row)
        if induction:
            loop_derived.add(induction.group(1))
        head = re.match(r"\s*(%[\w.#:]+) = ([\w.]+) (.*)", row)
        if not head:
            continue
        result, op, rest = head.group(1).split(":")[0].split("#")[0], head.group(2), head.group(3)
        operands = set(re.findall(r"%[\w.]+", rest.split(" : ")[0].split(" loc(")[0]))
        if op.startswith(("arith.", "tt.splat", "tt.broadcast", "tt.expand_dims")):
            if operands & loop_derived:
                loop_derived.add(result)
            if any(o.startswith("%stride") for o in operands) or operands & stride_derived:
                stride_derived.add(result)
        narrow = re.search(r": (?:i32|tensor<[\dx]*xi32>)\s*loc", rest)
        if op == "arith.muli" and narrow and (
                operands & stride_derived or any(o.startswith("%stride") for o in operands)):
            loc = re.search(r"loc\(#(loc\d*)\)", rest)
            number = line_of(loc.group(1)) if loc else None
            if number is not None:
                (found if operands & loop_derived else scaled).add(number)
    return sorted(found), sorted(scaled - found)


def _main():
    import json
    import sys

    from utils.aot import compile_kernel, resource_usage

    kernel = globals()[sys.argv[1]]
    for spec in json.loads(sys.argv[2]):

        def type_of(name, spec=spec):
            if name not in spec["types"]:
                raise TypeError(f"argument {name!r} is not one of the kernel's given arguments {sorted(spec['types'])}")
            return spec["types"][name]

        compiled = compile_kernel(kernel, type_of, spec["constexprs"], ones=spec["ones"],
                                  divisible=spec["divisible"], num_warps=spec["num_warps"])
        usage = resource_usage(compiled)
        report = _read(compiled, int(sys.argv[3]))
        report.update(registers=usage and usage.registers, spilled_bytes=usage and usage.spilled_bytes)
        print("LOOP-REPORT " + json.dumps(report))


if __name__ == "__main__":
    _main()
"""


def _tools_hash() -> str:
    """What a report depends on besides the kernel: the child's reader, utils.sass and utils.aot, Triton's version."""
    import triton

    digest = hashlib.sha256((triton.__version__ + _HEADER + _READER).encode())
    utils_dir = Path(__file__).resolve().parent.parent
    for path in (utils_dir / "sass.py", utils_dir / "aot.py"):
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()


def loop_report(kernel: Any, spec: CompileSpec, timeout: float = 300) -> LoopReport:
    """Compile ``kernel`` alone for sm_90 as ``spec`` says, in a child process, and read its loops.

    Never raises for the kernel's own faults (a name it cannot find, an argument the spec does not
    know, a compile error): the report carries them in ``error``.
    """
    return loop_reports(kernel, (spec,), timeout)[0]


def loop_reports(kernel: Any, specs: tuple[CompileSpec, ...], timeout: float = 300) -> list[LoopReport]:
    """:func:`loop_report` for several specializations of one kernel: those not kept yet are compiled in
    one child process (one Python start, one import of Triton, for all of them)."""
    from utils.aot import run_compiled

    name, source = kernel_source(kernel)
    lines = tuple(source.rstrip().splitlines())
    script = _HEADER + source.rstrip() + "\n\n\n# --- reader ---" + _READER
    tools = _tools_hash()
    keys = [hashlib.sha256("\0".join((script, spec.as_json(), name, tools)).encode()).hexdigest()[:32]
            for spec in specs]
    for key in keys:
        if key not in _MEMORY and (_CACHE_DIR / f"{key}.json").exists():
            try:
                _MEMORY[key] = LoopReport.from_json(json.loads((_CACHE_DIR / f"{key}.json").read_text()))
            except (ValueError, TypeError, KeyError):
                pass  # a damaged file: compile again
    missing = [(key, spec) for key, spec in zip(keys, specs, strict=True) if key not in _MEMORY]
    if missing:
        _CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=_CACHE_DIR) as work:
            Path(work, "triton-cache").mkdir()
            specs_json = "[" + ", ".join(spec.as_json() for _, spec in missing) + "]"
            result = run_compiled(script, work, timeout=timeout, args=(name, specs_json, str(_FIRST_LINE)))
        found = [line for line in result.stdout.splitlines() if line.startswith("LOOP-REPORT ")]
        errors = [line.strip() for line in result.stderr.strip().splitlines() if line.strip()]
        last = next((line for line in reversed(errors) if re.match(r"\w*(Error|Exception)\b", line)),
                    errors[-1] if errors else f"exit status {result.returncode}")
        for i, (key, _) in enumerate(missing):
            if i < len(found):
                data = json.loads(found[i].removeprefix("LOOP-REPORT "))
                for op in data["ops"]:  # a line past the kernel's source is none of its own
                    op[5] = op[5] if op[5] is not None and 1 <= op[5] <= len(lines) else None
                report = LoopReport.from_json({"kernel": name, "source": lines, **data})
                (_CACHE_DIR / f"{key}.json").write_text(json.dumps(report.as_json()))
            else:
                report = LoopReport(kernel=name, error=last[:300], source=lines)
            _MEMORY[key] = report
    first = def_line(kernel)
    return [dataclasses.replace(_MEMORY[key], first_line=first) for key in keys]
