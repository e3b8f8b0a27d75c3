"""Read a compiled kernel's SASS: its instructions, its loops, the mix of its steady loop, and a cycle model.

A Triton kernel compiled for sm_90 (``utils.aot.compile_kernel``) carries a cubin; NVIDIA's disassembler
(``nvdisasm``, shipped with Triton) turns it into SASS, the instructions the GPU really runs. Without a GPU
this is the closest look at speed there is: which instructions the steady loop issues per iteration, how
many of them do tensor-core work, and what a simple per-SM model says bounds one iteration.

* :func:`disassemble` — SASS text of a compiled kernel;
* :func:`parse` — its :class:`Instruction` list (address, predicate, opcode with modifiers, operands);
* :func:`loops`, :func:`steady_loop` — backward branches, and the innermost loop doing the main work;
* :func:`classify`, :data:`CATEGORIES`, :func:`mix` — what each instruction is, counted;
* :func:`cycle_model` — the model of one loop iteration of one CTA on one SM (:data:`SM90`);
* :func:`features` — wgmma or mma.sync, TMA, cp.async, 128-bit global accesses.

Every time figure here is a **model**, never a measurement.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

__all__ = [
    "CATEGORIES",
    "SM90",
    "Cycles",
    "Features",
    "Instruction",
    "Loop",
    "Machine",
    "Mix",
    "classify",
    "cycle_model",
    "disassemble",
    "features",
    "loops",
    "mix",
    "parse",
    "steady_loop",
]


@dataclass(frozen=True)
class Machine:
    """Per-SM limits of a GPU generation, for :func:`cycle_model` and ``utils.aot.occupancy``."""

    name: str
    sms: int
    sub_partitions: int  # each issues one warp-instruction per clock
    tensor_fma_per_clock: dict  # dense FMA per SM per clock, by operand dtype
    mufu_lanes_per_clock: int
    shared_bytes_per_clock: int
    registers: int  # 32-bit registers per SM
    max_registers_per_thread: int
    register_unit: int  # registers are allocated per warp in units of this many
    shared_bytes: int  # shared memory per SM
    max_shared_per_block: int
    shared_reserved_per_block: int  # the CUDA runtime's reservation per block
    shared_unit: int  # shared memory is allocated in units of this many bytes
    max_warps: int
    max_blocks: int
    clock_hz: float  # the clock the dense tensor peak implies
    sustained_flops: float  # launch-level assumptions (whole-op figures), not per-SM limits
    sustained_bytes_per_s: float


#: An H200 SXM (sm_90, the GH100 die of the H100 SXM).
#:
#: Sources: NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100): 132 SMs in the SXM part, four
#: SM sub-partitions each with one warp scheduler dispatching one warp-instruction per clock, 16 SFU
#: (MUFU) lanes per SM (4 per sub-partition), 65,536 32-bit registers and up to 228 KiB of shared memory per
#: SM, at most 227 KiB per block; the dense bf16/fp16 tensor rate of 1,024 FMA per clock per SM on A100
#: doubled on H100 (2,048 FMA = 4,096 FLOP per clock per SM; tf32 half of that, fp8 twice). The datasheet's
#: 989 TFLOP/s dense bf16 at 132 SMs implies 989e12 / (132 x 4096) = 1.83 GHz. CUDA C Programming Guide,
#: "Compute Capabilities" table for 9.0: 64 resident warps and 32 resident blocks per SM, 255 registers per
#: thread, 1 KiB of shared memory reserved by the runtime per block; the CUDA occupancy calculator's
#: allocation units for 9.0: registers per warp in units of 256, shared memory in units of 128 bytes.
#: Shared memory bandwidth: 32 banks x 4 bytes = 128 bytes per clock per SM. Sustained whole-op figures
#: (790 TFLOP/s dense bf16, 4.3 TB/s) are assumptions, about 80% and 90% of the datasheet's 989 TFLOP/s and
#: 4.8 TB/s (``utils.roofline`` holds the datasheet figures).
SM90 = Machine(
    name="H200 SXM (sm_90)",
    sms=132,
    sub_partitions=4,
    tensor_fma_per_clock={"bf16": 2048, "fp16": 2048, "tf32": 1024, "fp32": 1024, "fp8": 4096, "int8": 4096},
    mufu_lanes_per_clock=16,
    shared_bytes_per_clock=128,
    registers=65536,
    max_registers_per_thread=255,
    register_unit=256,
    shared_bytes=228 * 1024,
    max_shared_per_block=227 * 1024,
    shared_reserved_per_block=1024,
    shared_unit=128,
    max_warps=64,
    max_blocks=32,
    clock_hz=989e12 / (132 * 4096),
    sustained_flops=790e12,
    sustained_bytes_per_s=4.3e12,
)

CATEGORIES = ("tensor", "fp32", "mufu", "integer", "control", "shared", "global", "async_copy", "sync", "other")


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction. ``opcode`` is in full (``"HGMMA.64x128x16.F32.BF16"``), ``base`` its first part."""

    address: int
    predicate: str | None
    opcode: str
    base: str
    operands: str
    target: int | None = None  # a branch's target address


@dataclass(frozen=True)
class Loop:
    """The instructions from a backward branch's target (``start``) to the branch (``end``), both included."""

    start: int
    end: int
    instructions: tuple
    innermost: bool


@dataclass(frozen=True)
class Mix:
    """Instructions counted by category (warp-instructions of one warp's pass over the code), and the bytes
    that pass moves through shared memory (see :func:`mix`)."""

    counts: dict
    total: int
    tensor_fma: int  # FMA per warp per pass
    shared_bytes: int = 0  # bytes one warp's explicit shared-memory instructions (LDS/STS/LDSM/...) move per pass
    operand_bytes: int = 0  # bytes of wgmma operands read from shared memory, per warp (a warpgroup's / 4)
    copy_bytes: int = 0  # bytes one warp's cp.async (LDGSTS) writes into shared memory per pass
    tma_bytes: int = 0  # bytes the TMA copies (UTMALDG) write into shared memory per pass, per CTA

    def __getitem__(self, category: str) -> int:
        return self.counts.get(category, 0)


@dataclass(frozen=True)
class Cycles:
    """Modelled SM clocks per loop iteration of one CTA, by the resource that would take them."""

    tensor: float
    issue: float
    mufu: float
    shared: float
    bound: float
    limiter: str
    tensor_use: float  # tensor / bound: the share of the bound the tensor cores are busy


@dataclass(frozen=True)
class Features:
    """Which memory and tensor-core instructions a kernel uses anywhere in its code."""

    tensor_op: str | None  # "wgmma", "mma.sync" or None
    tma: bool
    cp_async: bool
    vector_128: bool  # 128-bit global loads/stores (or 16-byte cp.async)


def _tool(name: str) -> str:
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} not found beside Triton's NVIDIA backend ({path})")
    return path


def disassemble(compiled) -> str:
    """The SASS of ``compiled.asm["cubin"]`` (or of cubin bytes), by Triton's bundled ``nvdisasm``."""
    cubin = compiled if isinstance(compiled, bytes | bytearray) else compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        result = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {result.stderr.strip()}")
    return result.stdout


_LINE = re.compile(r"/\*([0-9a-fA-F]+)\*/\s+(?:\{\s*)?(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L\w+|[A-Za-z_]\w*):\s*$")
_TARGET_LABEL = re.compile(r"`\(([^)]+)\)")
_TARGET_HEX = re.compile(r"^(?:0x)?([0-9a-fA-F]+)\b")
_BRANCHES = ("BRA", "JMP", "BRX", "JMX")


def parse(sass: str) -> list[Instruction]:
    """Instructions of SASS text (``nvdisasm`` or ``cuobjdump -sass`` output), in address order.

    Branch targets (a label such as ``.L_x_1`` or a hexadecimal address) are resolved into ``target``.
    """
    rows, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _LINE.search(line)
        if not found:
            continue
        address = int(found.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        predicate = found.group(2).strip()[1:] if found.group(2) else None
        opcode, operands = found.group(3), found.group(4).strip()
        rows.append((address, predicate, opcode, operands))
    out = []
    for address, predicate, opcode, operands in rows:
        base = opcode.split(".")[0]
        target = None
        if base in _BRANCHES:
            by_label = _TARGET_LABEL.search(operands)
            if by_label:
                target = labels.get(by_label.group(1))
            else:
                by_hex = _TARGET_HEX.match(operands)
                target = int(by_hex.group(1), 16) if by_hex else None
        out.append(Instruction(address, predicate, opcode, base, operands, target))
    return sorted(out, key=lambda i: i.address)


_TENSOR = {"HGMMA", "HMMA", "IMMA", "QGMMA", "IGMMA", "BGMMA", "BMMA", "DMMA", "OMMA", "QMMA"}
_FP32 = {
    "FFMA",
    "FADD",
    "FMUL",
    "FMNMX",
    "FSETP",
    "FSET",
    "FSEL",
    "FCHK",
    "FRND",
    "FSWZADD",
    "F2F",
    "F2FP",
    "F2I",
    "I2F",
    "I2FP",
    "F2IP",
    "HADD2",
    "HFMA2",
    "HMUL2",
    "HMNMX2",
    "HSETP2",
    "HSET2",
    "FMUL2",
    "FADD2",
    "FFMA2",
    "DADD",
    "DFMA",
    "DMUL",
    "DSETP",
    "DMNMX",
}
_INTEGER = {
    "IMAD",
    "IADD3",
    "IADD",
    "IADD32I",
    "VIADD",
    "VIADDMNMX",
    "VIMNMX",
    "VIMNMX3",
    "IMNMX",
    "IABS",
    "IDP",
    "IMUL",
    "ISCADD",
    "ISETP",
    "LEA",
    "LOP3",
    "LOP",
    "SHF",
    "SHL",
    "SHR",
    "SEL",
    "SGXT",
    "PRMT",
    "POPC",
    "FLO",
    "BREV",
    "BMSK",
    "MOV",
    "MOV32I",
    "CS2R",
    "S2R",
    "S2UR",
    "R2UR",
    "REDUX",
    "CREDUX",
    "LDC",
    "ULDC",
    "PLOP3",
    "P2R",
    "R2P",
    "PSETP",
    "BMOV",
    "UIADD3",
    "UIMAD",
    "ULEA",
    "ULOP3",
    "USHF",
    "USEL",
    "USGXT",
    "UMOV",
    "UISETP",
    "UPRMT",
    "UPOPC",
    "UFLO",
    "UBREV",
    "UBMSK",
    "ULOP",
    "USHL",
    "USHR",
    "UPLOP3",
    "UP2UR",
    "UR2UP",
    "UVIADD",
    "UIMNMX",
    "UCLEA",
    "VOTEU",
}
_CONTROL = {
    "BRA",
    "BRX",
    "JMP",
    "JMX",
    "EXIT",
    "RET",
    "CALL",
    "BSSY",
    "BSYNC",
    "WARPSYNC",
    "NOP",
    "YIELD",
    "BPT",
    "BREAK",
    "KILL",
    "VOTE",
    "NANOSLEEP",
    "ACQBULK",
    "ELECT",
    "PREEXIT",
}
_SHARED = {"LDS", "STS", "LDSM", "STSM", "ATOMS", "LDSU"}
_GLOBAL = {"LDG", "STG", "LD", "ST", "LDL", "STL", "RED", "ATOM", "ATOMG", "REDG", "LDGMC", "REDAS"}
_ASYNC = {"LDGSTS", "UBLKCP", "UBLKRED", "UBLKPF", "UTMALDG", "UTMASTG", "UTMAPF", "UTMAREDG", "UTMACCTL"}
_SYNC = {
    "BAR",
    "DEPBAR",
    "MEMBAR",
    "FENCE",
    "WARPGROUP",
    "SYNCS",
    "LDGDEPBAR",
    "ERRBAR",
    "CCTL",
    "CCTLL",
    "ARRIVES",
    "BSYNC_DUMMY",
    "UCGABAR_ARV",
    "UCGABAR_WAIT",
}
_CATEGORY = {
    **{b: "tensor" for b in _TENSOR},
    **{b: "fp32" for b in _FP32},
    "MUFU": "mufu",
    **{b: "integer" for b in _INTEGER},
    **{b: "control" for b in _CONTROL},
    **{b: "shared" for b in _SHARED},
    **{b: "global" for b in _GLOBAL},
    **{b: "async_copy" for b in _ASYNC},
    **{b: "sync" for b in _SYNC},
}


def classify(instr: Instruction) -> str:
    """The category of an instruction, one of :data:`CATEGORIES`.

    tensor: HGMMA (wgmma), HMMA (mma.sync) and their integer/fp8 kin; fp32: the FMA-pipe float work (FFMA,
    FADD, FMNMX, conversions, packed half ops); mufu: MUFU.EX2/RCP/...; integer: index and predicate
    arithmetic, moves and constant loads, the uniform datapath's U* included (each takes an issue slot);
    control: branches, reconvergence, votes; shared: LDS/STS/LDSM/STSM; global: LDG/STG/atomics and local
    memory (spills); async_copy: cp.async (LDGSTS) and TMA (UTMALDG/UTMASTG/UBLKCP); sync: barriers,
    fences, mbarrier (SYNCS) and warpgroup arrive/wait; other: the rest, shuffles included, and any
    instruction predicated ``@!PT`` (never executed: ptxas's placeholders).
    """
    if instr.predicate == "!PT":
        return "other"
    return _CATEGORY.get(instr.base, "other")


def _shared_bytes(instr: Instruction) -> int:
    """Bytes one warp moves through shared memory with an explicit shared instruction (0 for others)."""
    if classify(instr) != "shared":
        return 0
    parts = instr.opcode.split(".")
    if instr.base in ("LDSM", "STSM"):  # 8x8 matrices of 16-bit elements, 128 bytes each: .x1 (no suffix), .2, .4
        return 128 * (int(parts[-1]) if parts[-1] in ("2", "4") else 1)
    width = 4
    for p in parts[1:]:
        if p in ("128",):
            width = 16
        elif p == "64":
            width = 8
        elif p in ("U8", "S8"):
            width = 1
        elif p in ("U16", "S16"):
            width = 2
    return 32 * width


def _tensor_fma(instr: Instruction) -> int:
    """FMA per warp of one tensor instruction: HGMMA mxnxk is one warpgroup's (4 warps') m*n*k; HMMA is a warp's."""
    if classify(instr) != "tensor":
        return 0
    shape = re.search(r"\.(\d+)x(\d+)x(\d+)", instr.opcode)
    if shape:  # HGMMA.64x128x16
        m, n, k = (int(g) for g in shape.groups())
    else:  # HMMA.16816 -> m16 n8 k16; HMMA.1688 -> m16 n8 k8
        digits = instr.opcode.split(".")[1] if "." in instr.opcode else ""
        if not (digits.isdigit() and len(digits) >= 4):
            return 0
        m, n, k = int(digits[:2]), int(digits[2]), int(digits[3:])
    per_group = m * n * k
    return per_group // 4 if instr.base.endswith("GMMA") else per_group


#: Bytes per element of a wgmma operand, by the input type its opcode names last (HGMMA.64x128x16.F32.BF16).
_OPERAND_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1, "S8": 1, "U8": 1}


def _operand_bytes(instr: Instruction) -> int:
    """Bytes of its operands one warp's share of a wgmma reads from shared memory (0 for other instructions).

    ``xGMMA.MxNxK`` is one warpgroup's (4 warps') product: it reads its B tile (K x N elements) from shared
    memory, and its A tile (M x K) too when the A operand is a descriptor (``gdesc[...]``) rather than registers;
    a quarter of that is counted per warp.
    """
    if classify(instr) != "tensor" or not instr.base.endswith("GMMA"):
        return 0
    shape = re.search(r"\.(\d+)x(\d+)x(\d+)", instr.opcode)
    if not shape:
        return 0
    m, n, k = (int(g) for g in shape.groups())
    element = _OPERAND_BYTES.get(instr.opcode.split(".")[-1], 2)
    operands = [o.strip() for o in instr.operands.split(",")]
    a_shared = len(operands) > 1 and operands[1].startswith("gdesc")
    return ((m * k if a_shared else 0) + k * n) * element // 4


def _copy_bytes(instr: Instruction) -> int:
    """Bytes one warp's cp.async (``LDGSTS``) writes into shared memory: 32 lanes x the width its modifier names
    (``.128``: 16 bytes, ``.64``: 8, none: 4)."""
    if instr.base != "LDGSTS" or instr.predicate == "!PT":
        return 0
    parts = instr.opcode.split(".")
    return 32 * (16 if "128" in parts else 8 if "64" in parts else 4)


_IMMEDIATE = re.compile(r"^-?0x[0-9a-fA-F]+$|^-?\d+$")


_UNWRITTEN = object()


def _immediate_of(register: str, before: list[Instruction]):
    """The constant the nearest preceding instruction of ``before`` (searched backwards) moved into
    ``register`` (``MOV``, ``IMAD.MOV``, ``UMOV`` of an immediate); None if the last write is anything else,
    ``_UNWRITTEN`` if nothing in ``before`` writes it."""
    for instr in reversed(before):
        operands = [o.strip() for o in instr.operands.split(",")]
        if not operands or operands[0] != register:
            continue
        if instr.opcode.startswith(("MOV", "IMAD.MOV", "UMOV")) and _IMMEDIATE.match(operands[-1]):
            return int(operands[-1], 0)
        return None
    return _UNWRITTEN


def _tma_bytes(instrs: list[Instruction], kernel: list[Instruction] | None = None) -> int:
    """Bytes the TMA copies of a pass write into shared memory, per CTA.

    A TMA load (``UTMALDG``) names only its descriptor, not its size: the size is the transaction count the
    mbarrier it completes is told to expect (``SYNCS.ARRIVE.TRANS64 ..., Rn`` / an immediate), which the CTA's one
    elected thread sets once per stage. Read from the constant last moved into that register inside the pass
    (the loop is searched cyclically: a value set at the bottom serves the next iteration), else, when the pass
    never writes it and ``kernel`` (the whole kernel's instructions) is given, before the pass; 0 when the pass
    has no TMA load or the count is not such a constant.
    """
    if not any(i.base in ("UTMALDG", "UBLKCP") and i.predicate != "!PT" for i in instrs):
        return 0
    start = instrs[0].address if instrs else 0
    total = 0
    for index, instr in enumerate(instrs):
        parts = instr.opcode.split(".")
        if instr.base != "SYNCS" or "ARRIVE" not in parts or "TRANS64" not in parts or instr.predicate == "!PT":
            continue
        count = instr.operands.split(",")[-1].strip()
        if _IMMEDIATE.match(count):
            total += int(count, 0)
            continue
        value = _immediate_of(count, instrs[index + 1 :] + instrs[:index])
        if value is _UNWRITTEN and kernel is not None:
            value = _immediate_of(count, [i for i in kernel if i.address < start])
        total += value if isinstance(value, int) else 0
    return total


def mix(instrs, kernel=None) -> Mix:
    """Count instructions by category; FMA per warp of the tensor instructions; bytes through shared memory.

    Shared-memory bytes of one pass, four kinds: the explicit loads/stores of one warp (``shared_bytes``); the
    operands one warp's share of each wgmma reads from shared memory (``operand_bytes``, :func:`_operand_bytes`);
    one warp's cp.async writes (``copy_bytes``); the CTA's TMA writes (``tma_bytes``, :func:`_tma_bytes`).
    ``kernel``: the whole kernel's instructions, where ``instrs`` is a loop of it (a TMA stage's byte count may be
    set before the loop).
    """
    instrs = list(instrs)
    counts = Counter(classify(i) for i in instrs)
    return Mix(
        counts={c: counts.get(c, 0) for c in CATEGORIES},
        total=len(instrs),
        tensor_fma=sum(_tensor_fma(i) for i in instrs),
        shared_bytes=sum(_shared_bytes(i) for i in instrs),
        operand_bytes=sum(_operand_bytes(i) for i in instrs),
        copy_bytes=sum(_copy_bytes(i) for i in instrs),
        tma_bytes=_tma_bytes(instrs, None if kernel is None else sorted(kernel, key=lambda i: i.address)),
    )


def _has_work(loop_instrs) -> bool:
    work = {"tensor", "fp32", "mufu", "shared", "global", "async_copy"}
    return any(classify(i) in work for i in loop_instrs)


def loops(instrs) -> list[Loop]:
    """One :class:`Loop` per backward branch (a branch to an address at or before its own), except a branch from
    past a loop's end back into its middle (an out-of-line slow path returning, not a loop).

    ``innermost``: no other loop that does work (any tensor, float, MUFU, memory instruction) lies inside
    it — a spin-wait on an mbarrier (``SYNCS`` + branch) does not make its enclosing loop an outer one.
    """
    instrs = sorted(instrs, key=lambda i: i.address)
    backward = [
        (i.target, i.address) for i in instrs if i.base in _BRANCHES and i.target is not None and i.target <= i.address
    ]
    found = []
    for start, end in backward:
        # A branch back into the middle of a loop that ends before it is no loop of its own: ptxas moves slow
        # paths (an mbarrier's spin-wait) past the kernel's EXIT, and they jump back to where they left.
        if any(s < start <= e < end for s, e in backward):
            continue
        body = tuple(x for x in instrs if start <= x.address <= end)
        found.append((start, end, body))
    out = []
    for start, end, body in found:
        nested = any(s >= start and e <= end and (s, e) != (start, end) and _has_work(b) for s, e, b in found)
        out.append(Loop(start, end, body, innermost=not nested))
    return out


def steady_loop(instrs) -> Loop | None:
    """The innermost loop doing the kernel's main work: most tensor-core work, else most global/shared
    traffic (instruction count), else the longest. None for straight-line code."""
    candidates = [loop for loop in loops(instrs) if loop.innermost and _has_work(loop.instructions)]
    if not candidates:
        return None

    def key(loop):
        m = mix(loop.instructions)
        return (m.tensor_fma, m["global"] + m["shared"] + m["async_copy"], m.total)

    return max(candidates, key=key)


def cycle_model(loop_mix: Mix, num_warps: int, dtype: str = "bf16", machine: Machine = SM90) -> Cycles:
    """Modelled SM clocks for one loop iteration of one CTA of ``num_warps`` warps (a **model**).

    * tensor = FMA of all warps / the SM's dense tensor rate for ``dtype`` (2,048 bf16/fp16 FMA per clock on
      sm_90; mma.sync counted at the wgmma rate);
    * issue = warp-instructions of all warps / 4 schedulers (each warp is bound to one sub-partition, so a
      CTA of fewer than 4 warps still takes one clock per instruction of its busiest warp);
    * mufu = lanes of all MUFU instructions / 16 lanes per clock;
    * shared = every byte the iteration moves through shared memory / 128 bytes per clock per SM:
      - explicit loads/stores (LDS, STS, LDSM, STSM, ...): 32 lanes x their width per warp (LDSM: 128 bytes per
        8x8 matrix), times the warps;
      - wgmma operand reads: each ``xGMMA.MxNxK`` (one warpgroup's product) reads its B tile, K x N elements,
        and its A tile, M x K, when A is a shared-memory descriptor (``gdesc``) rather than registers; elements
        of the input type the opcode names (bf16/fp16 2 bytes, tf32 4, fp8/int8 1); once per warpgroup;
      - cp.async (``LDGSTS``) writes: 32 lanes x the width its modifier names (``.128`` 16 bytes, ``.64`` 8,
        none 4) per warp, times the warps;
      - TMA (``UTMALDG``) writes: the bytes the stage's mbarrier is told to expect (``SYNCS.ARRIVE.TRANS64``),
        once per CTA;
      no bank conflicts (every access at the full 128 bytes per clock), no multicast;
    * bound = the largest of the four: the pipes are assumed to overlap perfectly; tensor_use = tensor / bound.

    Not modelled: memory latency and bandwidth (global traffic is a launch-level question), dependency
    stalls and wgmma's own latency, occupancy (other CTAs on the SM scale all four terms alike).
    """
    if num_warps < 1:
        raise ValueError(f"kernel_ladder.cycle_model: num_warps must be >= 1, got {num_warps}")
    if dtype not in machine.tensor_fma_per_clock:
        raise ValueError(
            f"kernel_ladder.cycle_model: dtype must be one of {sorted(machine.tensor_fma_per_clock)}, got {dtype!r}"
        )
    tensor = loop_mix.tensor_fma * num_warps / machine.tensor_fma_per_clock[dtype]
    issue = loop_mix.total * math.ceil(num_warps / machine.sub_partitions)
    mufu = loop_mix["mufu"] * 32 * num_warps / machine.mufu_lanes_per_clock
    per_warp = loop_mix.shared_bytes + loop_mix.operand_bytes + loop_mix.copy_bytes
    shared = (per_warp * num_warps + loop_mix.tma_bytes) / machine.shared_bytes_per_clock
    terms = {"tensor": tensor, "issue": issue, "mufu": mufu, "shared": shared}
    limiter = max(terms, key=terms.get)
    bound = terms[limiter]
    return Cycles(
        tensor=tensor,
        issue=issue,
        mufu=mufu,
        shared=shared,
        bound=bound,
        limiter=limiter,
        tensor_use=tensor / bound if bound else 0.0,
    )


def features(compiled) -> Features:
    """Tensor-core op, TMA, cp.async and 128-bit global accesses anywhere in a kernel (compiled or SASS text)."""
    instrs = parse(compiled if isinstance(compiled, str) else disassemble(compiled))
    bases = {i.base for i in instrs if i.predicate != "!PT"}
    tensor_op = (
        "wgmma"
        if bases & {"HGMMA", "QGMMA", "IGMMA", "BGMMA"}
        else "mma.sync"
        if bases & {"HMMA", "IMMA", "QMMA", "BMMA"}
        else None
    )
    tma = bool(bases & {"UTMALDG", "UTMASTG", "UBLKCP", "UTMAREDG", "UBLKRED"})
    vector = any(i.base in ("LDG", "STG", "LDGSTS", "LD", "ST") and "128" in i.opcode.split(".") for i in instrs)
    return Features(tensor_op=tensor_op, tma=tma, cp_async="LDGSTS" in bases, vector_128=vector)
