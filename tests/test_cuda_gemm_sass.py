"""The CUDA GEMM ladder (chapters/13_below_triton/src/cuda/gemm_*.cuh) compiled for sm_90 and read as SASS.

Each rung is compiled with explicit instantiations (``utils.nvcc.compile_cuda``) and checked for what it is
meant to change: no spills and a register budget that keeps the intended occupancy; the naive rung touches no
shared memory; the tiled rungs use it (``LDS``, ``BAR.SYNC``); the register-tiled rung's inner loop reads it
only with 16-byte loads (``LDS.128``); the cp.async rung copies with ``LDGSTS`` and waits with
``LDGDEPBAR``/``DEPBAR``; the tensor-core rung issues ``HMMA.16816.F32.BF16``; and the share of FFMA in the
steady loop's instructions (``utils.sass.steady_loop``) rises rung by rung. Every assertion helper is also
shown to reject a rung or build that lacks its property (negative controls).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from utils import nvcc, sass

pytestmark = pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc on this machine")

SRC = Path(__file__).resolve().parents[1] / "chapters" / "13_below_triton" / "src" / "cuda"
F32 = "(const float*, const float*, float*, long long, long long, long long);"
BF16 = "(const __nv_bfloat16*, const __nv_bfloat16*, float*, long long, long long, long long);"
REGTILE = [(bk, layout, vec) for bk in (8, 16) for layout in (0, 1, 2) for vec in ("true", "false")]

#: file, explicit instantiations, the kernel that stands for the rung
RUNGS = {
    "naive": ("gemm_naive.cuh", (), "gemm_naive"),
    "smem": ("gemm_smem.cuh", (f"template __global__ void gemm_smem<32>{F32}",), "gemm_smem<32>"),
    "regtile": (
        "gemm_regtile.cuh",
        tuple(f"template __global__ void gemm_regtile<{bk}, {layout}, {vec}>{F32}" for bk, layout, vec in REGTILE),
        "gemm_regtile<8, 1, true>",
    ),
    "cp_async": (
        "gemm_cp_async.cuh",
        tuple(f"template __global__ void gemm_cp_async<{vec}>{F32}" for vec in ("true", "false")),
        "gemm_cp_async<true>",
    ),
    "wmma": (
        "gemm_wmma.cuh",
        tuple(f"template __global__ void gemm_wmma<{vec}>{BF16}" for vec in ("true", "false")),
        "gemm_wmma<true>",
    ),
}


@functools.cache
def build(rung: str, defines: tuple[tuple[str, int], ...] = ()) -> nvcc.CudaCompile:
    file, instantiate, _ = RUNGS[rung]
    return nvcc.compile_cuda(SRC / file, instantiate=list(instantiate), defines=dict(defines))


def kernel_of(rung: str) -> str:
    return RUNGS[rung][2]


def instructions(rung: str, kernel: str | None = None) -> list[sass.Instruction]:
    return build(rung).instructions(kernel or kernel_of(rung))


def executed(instrs) -> list[sass.Instruction]:
    """Without ptxas's never-executed placeholders (``@!PT LDS RZ, [RZ]``)."""
    return [i for i in instrs if i.predicate != "!PT"]


def steady(rung: str, kernel: str | None = None) -> list[sass.Instruction]:
    loop = sass.steady_loop(instructions(rung, kernel))
    assert loop is not None, f"{rung}: no loop in its SASS"
    return executed(loop.instructions)


def ffma_share(loop) -> float:
    return sum(i.base == "FFMA" for i in loop) / len(loop)


# ----------------------------------------------------------------------------------------------
# Assertion helpers (each has a negative control below)
# ----------------------------------------------------------------------------------------------


def assert_no_spills(build_: nvcc.CudaCompile, kernel: str) -> None:
    info = build_.info(kernel)
    assert info.spill_stores == info.spill_loads == 0, (
        f"{kernel}: {info.spill_stores} bytes spill stores, {info.spill_loads} bytes spill loads"
    )


def assert_registers_at_most(build_: nvcc.CudaCompile, kernel: str, bound: int) -> None:
    registers = build_.info(kernel).registers
    assert registers <= bound, f"{kernel}: {registers} registers a thread, more than {bound}"


def assert_no_shared_memory(instrs) -> None:
    shared = sorted({i.opcode for i in executed(instrs) if sass.classify(i) == "shared"})
    assert not shared, f"shared-memory instructions: {shared}"


def assert_tiled_in_shared_memory(instrs) -> None:
    ops = {i.opcode for i in executed(instrs)}
    assert any(op.startswith("LDS") for op in ops), "no LDS: the tiles are not read from shared memory"
    assert any(op.startswith("BAR.SYNC") for op in ops), "no BAR.SYNC: nothing waits for the tile"


def assert_loop_reads_shared_128(loop) -> None:
    loads = [i.opcode for i in loop if i.base == "LDS"]
    narrow = sorted({op for op in loads if ".128" not in op})
    assert loads, "the steady loop reads no shared memory"
    assert not narrow, f"the steady loop reads shared memory with {narrow}, not only LDS.128"


def assert_cp_async(instrs) -> None:
    ops = [i.opcode for i in executed(instrs)]
    assert any(op.startswith("LDGSTS") and ".128" in op for op in ops), "no 16-byte LDGSTS (cp.async)"
    assert "LDGDEPBAR" in ops, "no LDGDEPBAR (cp.async commit)"
    assert any(op.startswith("DEPBAR") for op in ops), "no DEPBAR (cp.async wait)"


def assert_tensor_cores(loop) -> None:
    hmma = [i.opcode for i in loop if i.base == "HMMA"]
    assert hmma, "no HMMA in the steady loop"
    assert set(hmma) == {"HMMA.16816.F32.BF16"}, f"tensor-core instructions {sorted(set(hmma))}"


# ----------------------------------------------------------------------------------------------
# Spills and registers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rung", list(RUNGS))
def test_no_rung_spills(rung):
    b = build(rung)
    assert b.kernels, rung
    for mangled in b.kernels:
        assert_no_spills(b, mangled)


def test_register_budgets():
    # naive and smem: at most 32, so that 2,048 threads (64 warps, the sm_90 maximum) fit the SM's 65,536.
    for rung in ("naive", "smem"):
        assert_registers_at_most(build(rung), kernel_of(rung), 32)
    # register tiles, cp.async and wmma (16-byte path): 64 accumulators (or 8 fragments) a thread; the
    # launch bounds ask for two 256-thread blocks per SM, at most 65,536 / 512 = 128 registers.
    for kernel in [f"gemm_regtile<{bk}, {layout}, {vec}>" for bk, layout, vec in REGTILE]:
        assert_registers_at_most(build("regtile"), kernel, 128)
        assert build("regtile").info(kernel).registers >= 64  # the accumulators do live in registers
    assert_registers_at_most(build("cp_async"), "gemm_cp_async<true>", 128)
    assert_registers_at_most(build("wmma"), "gemm_wmma<true>", 128)
    # the element-by-element paths: one block per SM, the 255-register ceiling
    assert_registers_at_most(build("cp_async"), "gemm_cp_async<false>", 255)
    assert_registers_at_most(build("wmma"), "gemm_wmma<false>", 255)


def test_spill_and_register_helpers_reject_a_squeezed_build():
    # launch bounds asking for 4 blocks of 256 threads a SM: 64 registers a thread, fewer than the accumulators
    squeezed = build("regtile", (("GEMM_REGTILE_MIN_BLOCKS", 4),))
    with pytest.raises(AssertionError, match="spill stores"):
        assert_no_spills(squeezed, "gemm_regtile<8, 1, true>")
    with pytest.raises(AssertionError, match="more than 128"):
        assert_registers_at_most(build("cp_async"), "gemm_cp_async<false>", 128)


# ----------------------------------------------------------------------------------------------
# What each rung changes
# ----------------------------------------------------------------------------------------------


def test_naive_rung_touches_no_shared_memory():
    assert_no_shared_memory(instructions("naive"))
    with pytest.raises(AssertionError, match="shared-memory instructions"):
        assert_no_shared_memory(instructions("smem"))


@pytest.mark.parametrize("rung", ["smem", "regtile", "cp_async", "wmma"])
def test_tiled_rungs_use_shared_memory_and_barriers(rung):
    assert_tiled_in_shared_memory(instructions(rung))


def test_tiled_helper_rejects_the_naive_rung():
    with pytest.raises(AssertionError, match="no LDS"):
        assert_tiled_in_shared_memory(instructions("naive"))


@pytest.mark.parametrize("kernel", [f"gemm_regtile<{bk}, {layout}, true>" for bk in (8, 16) for layout in (0, 1, 2)])
def test_register_tiled_inner_loop_reads_shared_memory_128_bits_wide(kernel):
    loop = steady("regtile", kernel)
    assert_loop_reads_shared_128(loop)
    lds = sum(i.opcode.startswith("LDS.128") for i in loop)
    ffma = sum(i.base == "FFMA" for i in loop)
    assert ffma == 64 * lds // 4  # per k: 2 float4 of A, 2 of B, 64 FMAs
    # the transposed store is four 4-byte STS per float4 of A; B's tile goes in as STS.128
    ops = [i.opcode for i in loop]
    assert "STS" in ops and "STS.128" in ops


def test_shared_128_helper_rejects_the_smem_rung():
    # gemm_smem reads its A row 4 words at a time (one address for the warp) but B's column one word at a time
    with pytest.raises(AssertionError, match="not only LDS.128"):
        assert_loop_reads_shared_128(steady("smem"))


def test_cp_async_rung_copies_asynchronously():
    assert_cp_async(instructions("cp_async"))
    loop = steady("cp_async")
    ops = [i.opcode for i in loop]
    assert sum(op.startswith("LDGSTS") for op in ops) == 2  # a 16-byte chunk of each tile a thread
    assert not any(i.base == "LDG" for i in loop), "the steady loop still loads global memory into registers"
    assert_loop_reads_shared_128(loop)
    # the element-by-element path copies 4 bytes at a time, still asynchronously
    assert any(op == "LDGSTS.E" for op in (i.opcode for i in instructions("cp_async", "gemm_cp_async<false>")))


def test_cp_async_helper_rejects_the_register_tiled_rung():
    with pytest.raises(AssertionError, match="no 16-byte LDGSTS"):
        assert_cp_async(instructions("regtile"))


def test_tensor_core_rung_issues_hmma():
    loop = steady("wmma")
    assert_tensor_cores(loop)
    # per step of BK = 32: 2 x 8 wmma 16x16x16 products, each two m16n8k16 HMMAs
    assert sum(i.base == "HMMA" for i in loop) == 32
    assert sass.mix(loop).tensor_fma == 32 * 16 * 8 * 16
    assert sass.features(build("wmma").kernel_sass("gemm_wmma<true>")).tensor_op == "mma.sync"
    assert_cp_async(instructions("wmma"))


def test_tensor_core_helper_rejects_the_cp_async_rung():
    with pytest.raises(AssertionError, match="no HMMA"):
        assert_tensor_cores(steady("cp_async"))


def test_ffma_share_of_the_steady_loop_rises_rung_by_rung():
    naive, smem, regtile, cp_async = (ffma_share(steady(r)) for r in ("naive", "smem", "regtile", "cp_async"))
    # naive: 2 global loads and their address arithmetic per FMA; smem: 2 shared loads per FMA;
    # register tiles: 64 FMAs per 4 LDS.128 — the loop is mostly FFMA
    assert naive < 0.2 < smem < 0.4 < 0.8 < regtile
    # cp.async changes when the loads happen, not the loop's mix: the same share within a few points
    assert cp_async > 0.8 and abs(cp_async - regtile) < 0.05
    assert sass.mix(steady("regtile"))["fp32"] >= 512
