"""utils.sass: SASS parsed into instructions, loops and a steady-loop mix, the cycle model; utils.aot.occupancy.

The compile test builds small kernels for sm_90 in a compiled-mode child (tests/aot/sass_kernels.py); the rest
read hand-written SASS lines and hand-computed occupancy cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from utils import sass
from utils.aot import occupancy, run_compiled

SCRIPT = Path(__file__).parent / "aot" / "sass_kernels.py"

# A hand-written loop in nvdisasm's form: a label, a wgmma body, a backward branch; a spin-wait inside it.
LOOP_SASS = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   DEPBAR.LE SB0, 0x2 ;
        /*0020*/                   UIADD3 UR4, UR4, 0x40, URZ ;
.L_x_2:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3 ;
        /*0040*/              @!P1 BRA `(.L_x_2) ;
        /*0050*/                   WARPGROUP.ARRIVE ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20].tnspB, R88 ;
        /*0070*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16].tnspB, R88, gsb0 ;
        /*0080*/                   LDGSTS.E.BYPASS.128 [R55], desc[UR26][R24.64], P0 ;
        /*0090*/                   ISETP.GE.AND P0, PT, R8, UR4, PT ;
        /*00a0*/               @P0 BRA `(.L_x_1) ;
        /*00b0*/                   EXIT ;
"""


def instr(text: str) -> sass.Instruction:
    (parsed,) = sass.parse(f"        /*0000*/                   {text} ;")
    return parsed


def test_parse_reads_address_predicate_opcode_operands_and_resolves_labels():
    instrs = sass.parse(LOOP_SASS)
    assert [i.address for i in instrs] == list(range(0, 0xC0, 0x10))
    hgmma = instrs[6]
    assert (hgmma.opcode, hgmma.base, hgmma.predicate) == ("HGMMA.64x128x16.F32.BF16", "HGMMA", None)
    assert hgmma.operands == "R88, gdesc[UR20].tnspB, R88"
    assert (instrs[4].predicate, instrs[4].target) == ("!P1", 0x30)
    assert (instrs[10].predicate, instrs[10].target) == ("P0", 0x10)
    # cuobjdump's form: a hexadecimal target, and the encoding comment ignored
    (bra,) = sass.parse("        /*1790*/              @!P0 BRA 0x1040 ;    /* 0x000fe2000000000 */")
    assert (bra.target, bra.predicate) == (0x1040, "!P0")


def test_loops_and_the_steady_loop_skip_a_spin_wait():
    instrs = sass.parse(LOOP_SASS)
    found = {(loop.start, loop.end): loop for loop in sass.loops(instrs)}
    assert set(found) == {(0x10, 0xA0), (0x30, 0x40)}
    assert found[(0x10, 0xA0)].innermost  # the mbarrier wait inside does no work: still the innermost loop
    steady = sass.steady_loop(instrs)
    assert (steady.start, steady.end, len(steady.instructions)) == (0x10, 0xA0, 10)
    m = sass.mix(steady.instructions)
    assert (m["tensor"], m["sync"], m["async_copy"], m["control"], m["integer"]) == (2, 3, 1, 2, 2)
    assert m.total == 10 and m.tensor_fma == 2 * 64 * 128 * 16 // 4
    assert sass.steady_loop(sass.parse("        /*0000*/                   EXIT ;")) is None


@pytest.mark.parametrize(
    "text, category",
    [
        ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24", "tensor"),
        ("HMMA.16816.F32.BF16 R4, R8, R12, R4", "tensor"),
        ("FFMA R3, R4, R5, R3", "fp32"),
        ("FMNMX R2, R2, R3, !PT", "fp32"),
        ("F2FP.BF16.F32.PACK_AB R4, R5, R4", "fp32"),
        ("MUFU.EX2 R7, R7", "mufu"),
        ("IMAD.WIDE R162, R164, 0x2, R10", "integer"),
        ("UIADD3 UR7, UR7, 0x1, URZ", "integer"),
        ("LOP3.LUT R9, R9, 0x5c00, RZ, 0xfc, !PT", "integer"),
        ("BRA `(.L_x_0)", "control"),
        ("BSSY B0, `(.L_x_3)", "control"),
        ("LDS.128 R4, [R2]", "shared"),
        ("LDSM.16.M88.4 R8, [R2]", "shared"),
        ("STS [R3], R4", "shared"),
        ("LDG.E.128 R4, desc[UR4][R2.64]", "global"),
        ("STL [R1], R4", "global"),
        ("LDGSTS.E.BYPASS.128 [R55], desc[UR26][R24.64], P0", "async_copy"),
        ("UTMALDG.2D [UR8], [UR4]", "async_copy"),
        ("BAR.SYNC.DEFER_BLOCKING 0x0", "sync"),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", "sync"),
        ("SHFL.BFLY PT, R3, R2, 0x10, 0x1f", "other"),
        ("@!PT LDS RZ, [RZ]", "other"),  # never executed: ptxas's placeholder
    ],
)
def test_classify_hand_written_sass(text, category):
    assert sass.classify(instr(text)) == category
    assert category in sass.CATEGORIES


def test_mix_counts_tensor_fma_and_shared_bytes_per_warp():
    lines = [
        "HMMA.16816.F32.BF16 R4, R8, R12, R4",
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24",
        "LDS.128 R4, [R2]",
        "LDSM.16.M88.4 R8, [R2]",
        "STS.U16 [R3], R4",
        "FFMA R1, R2, R3, R1",
    ]
    m = sass.mix(instr(line) for line in lines)
    assert m.tensor_fma == 16 * 8 * 16 + 64 * 64 * 16 // 4
    assert m.shared_bytes == 32 * 16 + 4 * 128 + 32 * 2
    assert (m.total, m["tensor"], m["shared"], m["fp32"]) == (6, 2, 3, 1)


def test_cycle_model_bound_and_limiter_on_a_hand_built_mix():
    counts = dict.fromkeys(sass.CATEGORIES, 0)
    # 8 HGMMA 64x128x16 per warp, 4 warps: 8 * 32768 * 4 FMA / 2048 per clock = 512 tensor clocks;
    # 118 instructions on each of 4 schedulers: 118 issue clocks.
    tensor_loop = sass.Mix(counts={**counts, "tensor": 8, "integer": 110}, total=118, tensor_fma=8 * 32768)
    c = sass.cycle_model(tensor_loop, num_warps=4)
    assert (c.tensor, c.issue, c.bound, c.limiter, c.tensor_use) == (512, 118, 512, "tensor", 1.0)
    # twice the warps: both terms double
    c8 = sass.cycle_model(tensor_loop, num_warps=8)
    assert (c8.tensor, c8.issue) == (1024, 236)
    # a softmax-like loop: 40 MUFU of 32 lanes per warp, 8 warps, 16 lanes/clock = 640 clocks
    # against 300 instructions x 2 per scheduler = 600 issue clocks and 64 x 512 B x 8 warps / 128 B = 2048
    # shared clocks; the tensor term 8 x 4096 x 8 / 2048 = 128
    softmax = sass.Mix(
        counts={**counts, "mufu": 40, "shared": 64}, total=300, tensor_fma=8 * 4096, shared_bytes=64 * 512
    )
    c = sass.cycle_model(softmax, num_warps=8)
    assert (c.mufu, c.issue, c.shared, c.tensor) == (640, 600, 2048, 128)
    assert (c.limiter, c.bound, c.tensor_use) == ("shared", 2048, 128 / 2048)
    assert sass.cycle_model(softmax, num_warps=8, dtype="fp8").tensor == 64
    with pytest.raises(ValueError, match="kernel_ladder.cycle_model: dtype"):
        sass.cycle_model(softmax, 4, dtype="int4")


# A TMA loop as ptxas lays it out: the mbarrier spin-wait's slow path is moved out of line, after the EXIT, and
# jumps back into the loop (an unconditional backward branch that is no loop of its own); the epilogue between
# them stores through shared memory.
OUT_OF_LINE_WAIT_SASS = """
.L_x_10:
        /*0100*/                   UIADD3 UR23, UR23, 0x1, URZ ;
        /*0110*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR12+0x18000], R4 ;
        /*0120*/              @!P0 BRA `(.L_x_9) ;
.L_x_11:
        /*0130*/                   WARPGROUP.ARRIVE ;
        /*0140*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24].tnspB, R24 ;
        /*0150*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24].tnspB, R24, gsb0 ;
        /*0160*/               @P0 IMAD.MOV.U32 R4, RZ, RZ, 0x8000 ;
        /*0170*/               @P0 SYNCS.ARRIVE.TRANS64 RZ, [UR19+0x18000], R4 ;
        /*0180*/                   @UP1 UTMALDG.2D [UR12], [UR20] ;
        /*0190*/                   @UP2 UTMALDG.2D [UR16], [UR10] ;
        /*01a0*/              @!P0 BRA `(.L_x_10) ;
        /*01b0*/                   STS.128 [R21+UR8], R8 ;
        /*01c0*/                   LDSM.16.M88.4 R4, [R50+UR8] ;
        /*01d0*/                   STG.E.128 desc[UR28][R36.64], R4 ;
        /*01e0*/                   STG.E.128 desc[UR28][R38.64], R8 ;
        /*01f0*/                   EXIT ;
.L_x_9:
        /*0200*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR12+0x18000], R4 ;
        /*0210*/              @!P0 BRA `(.L_x_9) ;
        /*0220*/                   BRA `(.L_x_11) ;
"""


def test_a_jump_back_from_an_out_of_line_wait_is_not_a_loop():
    instrs = sass.parse(OUT_OF_LINE_WAIT_SASS)
    spans = {(loop.start, loop.end) for loop in sass.loops(instrs)}
    assert (0x130, 0x220) not in spans  # the slow path's jump back into the loop
    assert {(0x100, 0x1A0), (0x200, 0x210)} <= spans
    steady = sass.steady_loop(instrs)
    assert (steady.start, steady.end) == (0x100, 0x1A0)
    m = sass.mix(steady.instructions)
    # the TMA copies of one stage: the mbarrier's expected bytes (0x8000), once per CTA however many warps
    assert (m.tma_bytes, m.copy_bytes, m.shared_bytes) == (0x8000, 0, 0)
    assert m.operand_bytes == 2 * (64 * 16 + 16 * 128) * 2 // 4
    # the count set only before the loop (hoisted): found in the kernel, not in the loop
    hoisted = [i for i in instrs if i.address != 0x160]
    prologue = sass.parse("        /*0010*/                   MOV R4, 0x4000 ;")
    loop = next(x for x in sass.loops(hoisted) if x.start == 0x100)
    assert sass.mix(loop.instructions).tma_bytes == 0
    assert sass.mix(loop.instructions, kernel=prologue + hoisted).tma_bytes == 0x4000


def test_mix_counts_wgmma_operand_and_copy_bytes_into_the_shared_term():
    lines = [
        # A and B from shared memory (a descriptor as the A operand): (64 x 16 + 16 x 128) bf16 per warpgroup
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspB, R24",
        # A from registers: only B (16 x 64) from shared memory
        "HGMMA.64x64x16.F32.BF16 R88, R152, gdesc[UR8], R88",
        # fp8 operands are one byte: A 64 x 32, B 32 x 64
        "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24",
        "LDGSTS.E.BYPASS.LTC128B.128 [R55], desc[UR26][R24.64], P0",  # 16 bytes per lane
        "LDGSTS.E.64 [R57], desc[UR26][R26.64]",  # 8 bytes per lane
        "LDGSTS.E [R59], desc[UR26][R28.64]",  # 4 bytes per lane
        "LDS.128 R4, [R2]",
        "@!PT LDS RZ, [RZ]",  # never executed
        "IMAD.MOV.U32 R7, RZ, RZ, 0x4000",
        "SYNCS.ARRIVE.TRANS64 RZ, [UR19+0x18000], R7",
        "UTMALDG.2D [UR12], [UR20]",
    ]
    m = sass.mix(instr(line) for line in lines)
    per_warp_operands = ((64 * 16 + 16 * 128) * 2 + 16 * 64 * 2 + (64 * 32 + 32 * 64) * 1) // 4
    assert m.operand_bytes == per_warp_operands == 3072
    assert m.copy_bytes == 32 * (16 + 8 + 4) == 896
    assert (m.shared_bytes, m.tma_bytes) == (32 * 16, 0x4000)
    # 8 warps: per-warp bytes x 8, the TMA stage once: (512 + 3072 + 896) x 8 + 16384 = 52,224 B at 128 B/clk
    c = sass.cycle_model(m, num_warps=8)
    assert c.shared == (512 + 3072 + 896) * 8 / 128 + 16384 / 128 == 408
    # tensor: (64 x 128 x 16 + 64 x 64 x 16 + 64 x 64 x 32) / 4 FMA per warp, 8 warps, 2,048 FMA per clock
    assert m.tensor_fma == 81920 and c.tensor == 81920 * 8 / 2048 == 320
    assert (c.limiter, c.bound, c.tensor_use) == ("shared", 408, 320 / 408)


@pytest.mark.slow
def test_moe_tiles_modelled_tensor_use_from_their_compiles(tmp_path):
    """The grouped GEMM's steady loops at Mixtral's sizes (tests/aot/grouped_matmul.py --count): the shared term
    with wgmma's operand reads and cp.async's writes gives 57% / 89% (gate/up, 64- and 128-row tiles) and
    67% / 100% (down)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = Path(__file__).parent / "aot" / "grouped_matmul.py"
    result = run_compiled(script, tmp_path, timeout=900, args=("--count",))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    got = {r["label"]: (r["tensor"], r["shared"], r["limiter"], round(100 * r["tensor_use"])) for r in rows}
    assert got == {
        "gate/up + SwiGLU, before": (256, 448, "shared", 57),
        "gate/up + SwiGLU, after": (1024, 1152, "shared", 89),
        "down, before": (256, 384, "shared", 67),
        "down, after": (1024, 1024, "tensor", 100),
    }


@pytest.mark.parametrize(
    "registers, shared, warps, blocks, limiter",
    [
        (255, 0, 8, 1, "registers"),  # 256 x 32 = 8192 registers a warp: 8 warps fill 65,536
        (168, 0, 4, 3, "registers"),  # 168 x 32 = 5376: 12 warps (64,512 registers) -> 3 blocks of 4
        (128, 0, 8, 2, "registers"),  # 4096 a warp: 16 warps -> 2 blocks of 8
        (64, 200 * 1024, 4, 1, "shared memory"),  # 200 KiB + 1 KiB: one block in 228 KiB
        (64, 100 * 1024, 4, 2, "shared memory"),  # 101 KiB each: two
        (32, 0, 4, 16, "warps"),  # 64 warps / 4 (registers allow 16 too: the fixed limit is named)
        (16, 0, 1, 32, "blocks"),  # 1-warp blocks: 32 blocks before 64 warps
        (32, 228 * 1024, 4, 0, "shared memory"),  # over 227 KiB a block: cannot launch
        (42, 0, 4, 10, "registers"),  # 42 x 32 = 1344, rounded up to 1536: 42 warps -> 10 blocks of 4
    ],
)
def test_occupancy_cases_computed_by_hand(registers, shared, warps, blocks, limiter):
    got = occupancy(registers, shared, warps)
    assert (got.blocks_per_sm, got.limiter, got.warps_per_sm) == (blocks, limiter, blocks * warps)


def test_occupancy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kernel_ladder.occupancy: registers"):
        occupancy(300, 0, 4)
    with pytest.raises(ValueError, match="kernel_ladder.occupancy: num_warps"):
        occupancy(32, 0, 0)


@pytest.mark.slow
def test_compiled_kernels_dot_loop_elementwise_and_integer_overhead(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    result = run_compiled(SCRIPT, tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    dot = found["dot"]
    assert dot["features"]["tensor_op"] == "wgmma" and dot["features"]["cp_async"]
    assert "HGMMA" in dot["loop"]["opcodes"]
    # one iteration of the 128x128x64 tile loop: its FMAs, shared by the 4 warps
    assert dot["loop"]["tensor_fma"] * 4 == 128 * 128 * 64
    assert dot["loop"]["tensor_use"] > 0 and dot["occupancy"]["blocks_per_sm"] >= 1
    element = found["elementwise"]
    assert element["features"]["tensor_op"] is None and element["loop"] is None
    assert element["mix"]["tensor"] == 0 and element["features"]["vector_128"]
    divided, carried = found["divided"]["loop"], found["carried"]["loop"]
    # the division by a runtime width costs integer instructions in every iteration (and a reciprocal)
    assert divided["mix"]["integer"] > carried["mix"]["integer"]
    assert divided["mix"]["mufu"] >= 1 and carried["mix"]["mufu"] == 0
    assert divided["mix"]["global"] == carried["mix"]["global"] > 0
