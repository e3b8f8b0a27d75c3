"""Counting what native code does, exactly: instructions (callgrind) and cache misses (cachegrind).

A CPU's time depends on its load, its clock and the other processes; what valgrind counts does not.
It runs a program on a simulated CPU and counts each instruction it executes — the same count on
every run, on every x86-64 machine that runs the same binary — and, with its cache simulator, the
misses a given cache would take. This module runs a native executable (a :func:`utils.cpp.harness`:
never Python, whose interpreter would drown the kernel) under it and reads what it wrote:

* :func:`callgrind` — :class:`Counts`: the total instructions (``Ir``), each function's own and
  inclusive instructions (itself and what it calls), and the call graph (``calls=`` records);
* :func:`cachegrind` — :class:`CacheCounts`: instructions, data reads and writes, D1 read and
  write misses and last-level (LL) misses, in all and per function, for a cache whose sizes are
  given explicitly (``--D1`` and ``--LL``: the counts are the simulated cache's, not the host's,
  and say which they are);
* :func:`folded_stacks` — the call graph as folded stacks weighted by inclusive instructions,
  which :func:`utils.flamegraph.plot` draws as a native flame graph (:func:`plot_flame`: its axis
  says "instructions (callgrind)": instructions, not time).

valgrind 3.19 cannot run AVX-512: programs are built for x86-64-v3 (AVX2, FMA;
:data:`utils.cpp.DEFAULT_FLAGS`). Where valgrind is absent, :func:`available` is False and the
runners raise :class:`ValgrindMissing` with what to install (tests skip on it).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CacheConfig",
    "CacheCounts",
    "Counts",
    "DEFAULT_CACHE",
    "inside",
    "ValgrindMissing",
    "available",
    "cachegrind",
    "callgrind",
    "folded_stacks",
    "line_profile",
    "parse_cachegrind",
    "parse_callgrind",
    "plot_flame",
    "version",
]


class ValgrindMissing(RuntimeError):
    """valgrind is not installed (or not on the PATH)."""


#: How :func:`callgrind` and :func:`cachegrind` run a program (environment, working directory, its name): part of
#: the key of any cache of their counts, so that a change here never serves counts measured the old way.
RUN_METHOD = "env: only the variables asked for; the program copied to /tmp/kl-vg-XXXXXXXX/program, run from there"


def available() -> bool:
    """Whether a ``valgrind`` executable is on the PATH."""
    return shutil.which("valgrind") is not None


def version() -> str:
    """``valgrind --version`` (``valgrind-3.19.0``)."""
    _require()
    return subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()


def _require() -> str:
    exe = shutil.which("valgrind")
    if exe is None:
        raise ValgrindMissing("utils.valgrind: valgrind is not installed (apt install valgrind; brew has no build "
                              "for Apple silicon): instruction and cache-miss counts need it")
    return exe


def _run(tool_args: list[str], executable: str | os.PathLike, args: Sequence[str], out_file: Path,
         env: Mapping[str, str] | None, timeout: float) -> str:
    # Only the variables asked for, and the program copied to a folder whose path always has the same length
    # (``/tmp/kl-vg-XXXXXXXX/program``), run from there: the caller's environment (its size), its working
    # directory and the program's path all sit on the program's stack and move it, and with it which cache sets
    # its lines take — the counts would change with whoever runs them, and where (a notebook's solution and
    # learner runs, another home folder, another checkout).
    environment = dict(env or {})
    base = "/tmp" if os.path.isdir("/tmp") else None
    with tempfile.TemporaryDirectory(prefix="kl-vg-", dir=base) as folder:
        program = Path(folder, "program")
        shutil.copy2(executable, program)
        command = [_require(), "--quiet", *tool_args, "./program", *map(str, args)]
        result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout,
                                cwd=folder)
    if result.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"utils.valgrind: {Path(str(executable)).name} under {tool_args[0]} exited with "
                           f"{result.returncode}: {(result.stderr or result.stdout).strip()[-600:]}")
    return result.stdout


# --------------------------------------------------------------------------------------------
# callgrind
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Counts:
    """Instructions executed (``Ir``) by a program under callgrind.

    ``total``: all of them (the dynamic loader's and the C library's start-up included);
    ``self_ir[f]``: instructions in function ``f``'s own code; ``inclusive[f]``: in ``f`` and everything
    it called; ``calls[(caller, callee)]``: the inclusive instructions of the calls from one to the
    other; ``files[f]``: the source file ``f`` was compiled from (as the debug info names it).
    """

    total: int
    self_ir: dict[str, int]
    inclusive: dict[str, int]
    calls: dict[tuple[str, str], int]
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    stdout: str = ""

    def of(self, function: str) -> int:
        """Inclusive instructions of ``function`` (0 if it never ran)."""
        return self.inclusive.get(function, 0)


def _name(value: str, table: dict[str, str]) -> str:
    """A callgrind name with or without compression: ``(3) name`` defines id 3, ``(3)`` refers to it."""
    found = re.match(r"\((\d+)\)(?:\s+(.*))?$", value.strip())
    if not found:
        return value.strip()
    if found.group(2) is not None:
        table[found.group(1)] = found.group(2)
        return found.group(2)
    return table.get(found.group(1), value.strip())


def parse_callgrind(text: str) -> Counts:
    """Read a ``callgrind.out`` file's text (first event counted: ``Ir``)."""
    names: dict[str, str] = {}
    file_names: dict[str, str] = {}
    files: dict[str, str] = {}
    self_ir: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    current, current_file, callee, total = "", "", None, None
    pending_call = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line[0].isdigit() or line[0] in "+-*":
            parts = line.split()
            cost = int(parts[1]) if len(parts) > 1 and parts[1].lstrip("-").isdigit() else 0
            if pending_call and callee is not None:
                calls[(current, callee)] += cost
                pending_call = False
            else:
                self_ir[current] += cost
            continue
        key, _, value = line.partition("=")
        if key == "fn":
            current = _name(value, names)
            files.setdefault(current, current_file)
        elif key in ("fl", "fi", "fe"):
            name = _name(value, file_names)
            if key == "fl":
                current_file = name
        elif key == "cfn":
            callee = _name(value, names)
        elif key == "calls":
            pending_call = True
        elif line.startswith("totals:") or line.startswith("summary:"):
            total = int(line.split(":", 1)[1].split()[0])
    inclusive = dict(self_ir)
    for (caller, _), cost in calls.items():
        inclusive[caller] = inclusive.get(caller, 0) + cost
    for (_, callee_name) in calls:
        inclusive.setdefault(callee_name, 0)
    if total is None:
        total = sum(self_ir.values())
    return Counts(total=total, self_ir=dict(self_ir), inclusive=inclusive, calls=dict(calls), files=files)


def _callgrind_out(options: Sequence[str], executable: str | os.PathLike, args: Sequence[str],
                   env: Mapping[str, str] | None, timeout: float, *, cache: bool = False,
                   keep: str | os.PathLike | None = None) -> tuple[str, str]:
    """Run ``executable`` under callgrind with ``options`` (and the cache simulator on :data:`DEFAULT_CACHE` where
    ``cache``): the ``callgrind.out`` text and the program's stdout. ``keep``: also copy the raw file there."""
    tool = ["--tool=callgrind", "--compress-strings=no", "--compress-pos=no", *options]
    if cache:
        tool += ["--cache-sim=yes", *(f"--{name}={config.option()}" for name, config in DEFAULT_CACHE.items())]
    with tempfile.TemporaryDirectory(prefix="callgrind-") as work:
        out = Path(work) / "callgrind.out"
        stdout = _run([tool[0], f"--callgrind-out-file={out}", *tool[1:]], executable, args, out, env, timeout)
        if keep is not None:
            shutil.copyfile(out, keep)
        return out.read_text(), stdout


def callgrind(executable: str | os.PathLike, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
              timeout: float = 300, keep: str | os.PathLike | None = None) -> Counts:
    """Run ``executable args`` under callgrind and count its instructions (see :class:`Counts`).

    ``keep``: also copy the raw ``callgrind.out`` there (for :func:`folded_stacks`, or KCachegrind). ``env``: the
    program's whole environment — nothing of the caller's is passed on, and it runs in its own folder, so that the
    counts do not move with the caller's environment or working directory.
    """
    text, stdout = _callgrind_out([], executable, args, env, timeout, keep=keep)
    counts = parse_callgrind(text)
    counts.stdout = stdout
    return counts


def folded_stacks(callgrind_out: str | os.PathLike | Counts, root: str | None = None) -> collections.Counter:
    """Folded stacks ``{(root, ..., leaf): instructions}`` from callgrind's call graph.

    ``callgrind_out``: a ``callgrind.out`` file (its path or text) or :class:`Counts`. Every stack starts at
    ``root`` — by default ``main`` where the program has one (the C library's start-up around it calls back
    into itself, a cycle whose inclusive counts are doubled), else every function nobody calls — and each
    function's inclusive instructions are shared among its callees as the ``calls=`` records say, the rest
    being its own: a callee reached along two paths is split between them in proportion to what each caller
    spent on it (callgrind keeps one level of callers, not whole stacks). Recursion is cut where a function
    reappears on its own stack.
    """
    if isinstance(callgrind_out, Counts):
        counts = callgrind_out
    else:
        text = str(callgrind_out)
        if "\n" not in text:
            text = Path(text).read_text()
        counts = parse_callgrind(text)
    callees: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    callers: collections.Counter = collections.Counter()
    for (caller, callee), cost in counts.calls.items():
        if caller != callee:
            callees[caller].append((callee, cost))
            callers[callee] += 1
    if root is None and counts.inclusive.get("main"):
        root = "main"  # below main, the C library's start-up calls back into itself: a cycle, counted twice
    roots = [root] if root is not None else [f for f, n in counts.inclusive.items() if n and not callers[f]]
    stacks: collections.Counter = collections.Counter()

    def walk(stack: tuple[str, ...], weight: float) -> None:
        function = stack[-1]
        inclusive = counts.inclusive.get(function, 0)
        if inclusive <= 0 or weight < 1:
            return
        spent = 0.0
        for callee, cost in sorted(callees.get(function, [])):
            share = weight * cost / inclusive
            if callee in stack or len(stack) > 64:
                continue  # recursion: counted as the caller's own
            spent += share
            walk((*stack, callee), share)
        own = round(weight - spent)
        if own > 0:
            stacks[stack] += own

    for function in sorted(roots):
        walk((function,), float(counts.inclusive.get(function, 0)))
    return stacks


def plot_flame(callgrind_out: str | os.PathLike | Counts, ax: Any = None, title: str | None = None,
               root: str | None = None) -> Any:
    """Draw :func:`folded_stacks` with :func:`utils.flamegraph.plot`, its axis labelled as instructions counted
    by callgrind (not time, not samples)."""
    from utils import flamegraph

    profile = flamegraph.Profile(folded_stacks(callgrind_out, root=root))
    ax = flamegraph.plot(profile, ax=ax, title=title)
    ax.set_xlabel(f"instructions (callgrind), {profile.total:,} in all")
    return ax


def inside(executable: str | os.PathLike, function: str, args: Sequence[str] = (), *, cache: bool = True,
           env: Mapping[str, str] | None = None, timeout: float = 300) -> dict[str, int]:
    """Events counted while ``function`` runs, everything it calls and inlines included: ``{"Ir": ..., "D1mr": ...}``.

    callgrind collects only inside ``function`` (``--toggle-collect``), with its cache simulator on the caches of
    :data:`DEFAULT_CACHE` where ``cache``. Unlike a count per source file, nothing the function does is charged
    elsewhere: an intrinsic's load (whose debug line is in ``immintrin.h``'s headers) or a helper in an
    ``#include``d file counts as the function's. The caches start cold at the program's start, as they do under
    :func:`cachegrind`; the harness's set-up before the call is not counted but does warm them as it would.
    """
    text, _ = _callgrind_out([f"--toggle-collect={function}"], executable, args, env, timeout, cache=cache)
    events: list[str] = []
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split(":", 1)[1].split()
        elif line.startswith(("summary:", "totals:")):
            values = list(map(int, line.split(":", 1)[1].split()))
            # callgrind leaves trailing zero counts out of the line
            return {event: values[i] if i < len(values) else 0 for i, event in enumerate(events)}
    raise RuntimeError(f"utils.valgrind: callgrind wrote no totals for {function!r}")


def line_profile(executable: str | os.PathLike, source: str, args: Sequence[str] = (), *, cache: bool = False,
                 env: Mapping[str, str] | None = None, timeout: float = 300) -> dict[int, dict[str, int]]:
    """Events counted per line of the source file named ``source`` (a base name: ``"source.cpp"``), for the
    functions compiled from it: ``{line: {"Ir": ..., ...}}``.

    callgrind runs ``executable`` with ``--dump-instr=yes`` (a count per instruction address), and ``cache=True``
    adds its cache simulator (the events of :data:`DEFAULT_CACHE`'s caches: ``Dr``, ``D1mr``, ...; callgrind's
    simulator, so its totals can differ a little from :func:`cachegrind`'s). Each address is charged to a line of
    ``source`` by ``addr2line -i``: code inlined from a header — an intrinsic, ``std::min`` — counts at the line of
    ``source`` it was inlined into, which is the line the programmer wrote. A call's inclusive cost counts at the
    line of the call.
    """
    text, _ = _callgrind_out(["--dump-instr=yes"], executable, args, env, timeout, cache=cache)
    events: list[str] = []
    by_address: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    current_file = ""
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split(":", 1)[1].split()
        elif line.startswith("fl="):
            current_file = line[3:].strip()
        elif line.startswith("0x") and os.path.basename(current_file) == source:
            parts = line.split()
            for event, value in zip(events, parts[2:]):
                by_address[int(parts[0], 16)][event] += int(value)
    profile: dict[int, dict[str, int]] = {}
    if not by_address:
        return profile
    addresses = sorted(by_address)
    tool_path = shutil.which("addr2line")
    if tool_path is None:
        raise RuntimeError("utils.valgrind.line_profile: addr2line is not on the PATH (binutils: apt install binutils)")
    mapped = subprocess.run([tool_path, "-a", "-i", "-e", str(executable), *map(hex, addresses)], capture_output=True,
                            text=True, timeout=timeout).stdout
    lines_of: dict[int, int] = {}
    address = None
    for entry in mapped.splitlines():
        if entry.startswith("0x"):
            address = int(entry, 16)
            continue
        found = re.match(r"(.*):(\d+)", entry.split(" (discriminator")[0])
        if address is not None and address not in lines_of and found and os.path.basename(found.group(1)) == source:
            lines_of[address] = int(found.group(2))
    for address, counts in by_address.items():
        number = lines_of.get(address, 0)  # 0: an address no line of the source claims
        entry = profile.setdefault(number, {})
        for event, value in counts.items():
            entry[event] = entry.get(event, 0) + value
    return profile


# --------------------------------------------------------------------------------------------
# cachegrind
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """A simulated cache: ``size`` bytes, ``ways``-way set associative, ``line`` bytes per line."""

    size: int
    ways: int
    line: int = 64

    def option(self) -> str:
        return f"{self.size},{self.ways},{self.line}"

    def __str__(self) -> str:
        size = f"{self.size // 2**20} MiB" if self.size >= 2**20 else f"{self.size // 2**10} KiB"
        return f"{size} {self.ways}-way, {self.line}-byte lines"


#: The simulated caches when none are given: a 32 KiB 8-way L1 for data and for instructions, an 8 MiB 16-way
#: last level — a common laptop core's (Intel from Skylake to Alder Lake's E-cores, AMD Zen 1-4 L1d).
DEFAULT_CACHE = {"I1": CacheConfig(32 * 2**10, 8), "D1": CacheConfig(32 * 2**10, 8), "LL": CacheConfig(8 * 2**20, 16)}

# cachegrind's event names, and what CacheCounts calls them.
_EVENTS = {"Ir": "ir", "Dr": "data_reads", "Dw": "data_writes", "D1mr": "d1_read_misses", "D1mw": "d1_write_misses",
           "DLmr": "ll_read_misses", "DLmw": "ll_write_misses", "I1mr": "i1_misses", "ILmr": "il_misses"}


@dataclasses.dataclass
class CacheCounts:
    """What cachegrind counted, in all (``totals``) and per function (``functions``), by event name
    (``Ir``, ``Dr``, ``Dw``, ``D1mr``, ``D1mw``, ``DLmr``, ``DLmw``, ``I1mr``, ``ILmr``), and the
    caches it simulated (``caches``: ``{"I1": ..., "D1": ..., "LL": ...}``)."""

    totals: dict[str, int]
    functions: dict[str, dict[str, int]]
    caches: dict[str, CacheConfig]
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    stdout: str = ""

    def __getattr__(self, name: str) -> int:
        for event, attribute in _EVENTS.items():
            if attribute == name:
                return self.totals.get(event, 0)
        raise AttributeError(name)

    @property
    def ll_misses(self) -> int:
        """Last-level misses, reads and writes."""
        return self.totals.get("DLmr", 0) + self.totals.get("DLmw", 0)

    def of(self, function: str, event: str) -> int:
        """``event`` counted in ``function``'s own code (0 if it never ran)."""
        return self.functions.get(function, {}).get(event, 0)

    def in_file(self, basename: str, event: str) -> int:
        """``event`` counted in every function compiled from the file named ``basename`` (its own code)."""
        return sum(counts.get(event, 0) for function, counts in self.functions.items()
                   if os.path.basename(self.files.get(function, "")) == basename)

    def describe(self) -> str:
        """The simulated caches in words, for a table's caption."""
        return f"D1 {self.caches['D1']}, LL {self.caches['LL']} (simulated by cachegrind)"


def parse_cachegrind(text: str, caches: Mapping[str, CacheConfig] | None = None) -> CacheCounts:
    """Read a ``cachegrind.out`` file's text."""
    events: list[str] = []
    totals: dict[str, int] = {}
    functions: dict[str, collections.Counter] = {}
    files: dict[str, str] = {}
    current_file, current = "", None
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split(":", 1)[1].split()
        elif line.startswith("fl="):
            current_file = line[3:].strip()
        elif line.startswith("fn="):
            current = line[3:].strip()
            functions.setdefault(current, collections.Counter())
            files.setdefault(current, current_file)
        elif line.startswith("summary:"):
            totals = dict(zip(events, map(int, line.split(":", 1)[1].split())))
        elif line[:1].isdigit() and current is not None:
            values = line.split()[1:]
            for event, value in zip(events, values):
                functions[current][event] += int(value)
    return CacheCounts(totals=totals, functions={f: dict(c) for f, c in functions.items()},
                       caches=dict(caches or DEFAULT_CACHE), files=files)


def cachegrind(executable: str | os.PathLike, args: Sequence[str] = (), *, d1: CacheConfig | None = None,
               ll: CacheConfig | None = None, i1: CacheConfig | None = None, env: Mapping[str, str] | None = None,
               timeout: float = 300) -> CacheCounts:
    """Run ``executable args`` under cachegrind with its cache simulator on, for the caches given (default
    :data:`DEFAULT_CACHE`: passed explicitly, so the counts do not depend on the host's caches). ``env``: the
    program's whole environment, as for :func:`callgrind`."""
    caches = {"I1": i1 or DEFAULT_CACHE["I1"], "D1": d1 or DEFAULT_CACHE["D1"], "LL": ll or DEFAULT_CACHE["LL"]}
    with tempfile.TemporaryDirectory(prefix="cachegrind-") as work:
        out = Path(work) / "cachegrind.out"
        stdout = _run(["--tool=cachegrind", "--cache-sim=yes", f"--I1={caches['I1'].option()}",
                       f"--D1={caches['D1'].option()}", f"--LL={caches['LL'].option()}",
                       f"--cachegrind-out-file={out}"], executable, args, out, env, timeout)
        counts = parse_cachegrind(out.read_text(), caches)
    counts.stdout = stdout
    return counts
