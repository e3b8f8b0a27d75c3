"""Chapter 00's solutions pass their checks on fresh inputs, and wrong variants do not.

Each exercise is checked the way the notebook checks it (same references: a slow loop, or a
measurement by the tracer), on cases drawn from the checker's freshly seeded generator. The
negative controls are the mistakes a learner makes — a stub, a missing mask, an off-by-one
offset, an ignored input, a wrong formula — and each must come back NOT SOLVED.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernel_ladder
import solutions.ch00_gpu_model as sol
from utils.exercises import check
from utils.roofline import arithmetic_intensity
from utils.trace import trace

# The checker's out-of-bounds diagnoses and the traced references need the interpreter.
pytestmark = pytest.mark.interpreter

DEVICE = kernel_ladder.runtime.DEVICE


# ----------------------------------------------------------------------------------------------
# References (as in the notebook)


def grid_by_handing_out_blocks(n: int, BLOCK: int) -> tuple[int, int]:
    programs, covered = 0, 0
    while covered < n:
        programs, covered = programs + 1, covered + BLOCK
    return programs, covered - n


def traced_matmul_traffic(M: int, N: int, K: int, dtype: torch.dtype) -> tuple[int, int, float]:
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    with trace() as traced:
        torch.matmul(a, b)
    return traced.bytes, traced.flops, arithmetic_intensity(traced.bytes, traced.flops)


@triton.jit
def strided_read_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n
    values = tl.load(x_ptr + offsets * stride, mask=in_bounds)
    tl.store(out_ptr + offsets, values, mask=in_bounds)


def traced_sectors(n: int, stride: int, BLOCK: int, elem_bytes: int = 4) -> int:
    dtype = {4: torch.float32, 2: torch.float16}[elem_bytes]
    x = torch.randn(n * stride, device=DEVICE).to(dtype)
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    with trace() as traced:
        strided_read_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, stride, BLOCK=BLOCK)
    return traced.launches[0].per_tensor["x_ptr"].sectors


def launch_add(kernel, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, BLOCK: int = 1024) -> torch.Tensor:
    n = out.numel()
    kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)
    return out


# ----------------------------------------------------------------------------------------------
# Fresh cases from the checker's generator


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high, (1,), generator=gen))


def grid_cases(gen: torch.Generator) -> list[tuple[int, int]]:
    cases = [(0, 128), (1024, 1024), (1025, 1024), (7, 8)]  # the edges, every time
    for _ in range(12):
        BLOCK = 2 ** _randint(gen, 0, 12)
        cases.append((_randint(gen, 0, 50 * BLOCK), BLOCK))
    return cases


def matmul_cases(gen: torch.Generator) -> list[tuple[int, int, int, torch.dtype]]:
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    cases = [(1, 33, 17, torch.bfloat16)]  # a decode-shaped one
    for _ in range(4):
        cases.append((_randint(gen, 1, 70), _randint(gen, 1, 70), _randint(gen, 1, 70), dtypes[_randint(gen, 0, 3)]))
    return cases


#: The notebook's fixed cases before the last one was added: BLOCK * stride * elem_bytes is a multiple of
#: 32 in every one, so no sector is shared by two programs and one global set of sectors gives the same count.
NOTEBOOK_SECTOR_CASES_ALIGNED = [(1000, 1, 256, 4), (1000, 2, 256, 4), (999, 3, 256, 4), (500, 8, 128, 4),
                                 (100, 16, 64, 4), (300, 5, 64, 2), (70, 16, 32, 2)]
#: The case the notebook adds: 8 * 3 * 2 = 48 bytes per program, so neighbouring programs share sectors.
SHARED_SECTOR_CASE = (100, 3, 8, 2)
NOTEBOOK_SECTOR_CASES = [*NOTEBOOK_SECTOR_CASES_ALIGNED, SHARED_SECTOR_CASE]


def sector_cases(gen: torch.Generator) -> list[tuple[int, int, int, int]]:
    # The notebook's cases, every time. (100, 16, 64, 4): 64-byte steps skip every other sector, so dividing
    # the span by 32 is wrong; (100, 3, 8, 2): programs share sectors, so one global set undercounts.
    cases = list(NOTEBOOK_SECTOR_CASES)
    for _ in range(4):
        BLOCK = 2 ** _randint(gen, 2, 9)  # small BLOCKs too: there a program's span need not end on a sector
        n = _randint(gen, 1, 4 * BLOCK)  # at most 4 programs
        cases.append((n, _randint(gen, 1, 20), BLOCK, (2, 4)[_randint(gen, 0, 2)]))
    return cases


def add_cases(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cases = []
    for n, dtype in [(1, torch.float32), (1000, torch.float32), (1024, torch.float32),
                     (_randint(gen, 1025, 3072), torch.float32), (_randint(gen, 2, 1024), torch.float16),
                     (_randint(gen, 2, 1024), torch.bfloat16)]:
        x = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE)
        y = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE)
        cases.append((x, y))
    return cases


def check_grid(candidate):
    return check("ch00_gpu_model.grid_size", candidate, grid_by_handing_out_blocks, grid_cases)


def check_matmul(candidate):
    return check("ch00_gpu_model.matmul_traffic", candidate, traced_matmul_traffic, matmul_cases)


def check_sectors(candidate):
    return check("ch00_gpu_model.sectors_touched", candidate, traced_sectors, sector_cases)


def check_add(kernel):
    return check("ch00_gpu_model.add_kernel", lambda x, y, out: launch_add(kernel, x, y, out), torch.add,
                 add_cases, out=True)


def assert_not_solved(verdict) -> None:
    assert not verdict.solved, verdict.message
    assert verdict.message.startswith("❌ NOT SOLVED — ch00_gpu_model."), verdict.message


# ----------------------------------------------------------------------------------------------
# The solutions pass


def test_grid_size_solution_is_solved():
    verdict = check_grid(sol.grid_size)
    assert verdict.solved, verdict.message
    assert verdict.message.startswith("✅ SOLVED — ch00_gpu_model.grid_size")


def test_matmul_traffic_solution_is_solved():
    verdict = check_matmul(sol.matmul_traffic)
    assert verdict.solved, verdict.message


def test_sectors_touched_solution_is_solved():
    verdict = check_sectors(sol.sectors_touched)
    assert verdict.solved, verdict.message


def test_add_kernel_solution_is_solved():
    verdict = check_add(sol.add_kernel)
    assert verdict.solved, verdict.message


def test_solutions_have_docstrings_saying_what_they_teach():
    for name in ["grid_size", "matmul_traffic", "add_kernel", "sectors_touched"]:
        obj = getattr(sol, name)
        doc = getattr(obj, "__doc__", None) or getattr(getattr(obj, "fn", None), "__doc__", None)
        assert doc and "Teaches:" in doc, name


def test_known_values():
    # Pinned by hand, independent of the tracer: the numbers the notebook's prose relies on.
    assert sol.grid_size(2500, 1024) == (3, 572)
    assert sol.grid_size(0, 1024) == (0, 0)
    assert sol.matmul_traffic(1, 14336, 4096, torch.bfloat16)[:2] == ((4096 + 4096 * 14336 + 14336) * 2,
                                                                       2 * 14336 * 4096)
    assert sol.sectors_touched(4096, 1, 1024) == 4096 // 8
    assert sol.sectors_touched(4096, 8, 1024) == 4096


# ----------------------------------------------------------------------------------------------
# Negative controls: wrong variants are NOT SOLVED


def _stub(*args):
    raise NotImplementedError


@pytest.mark.parametrize("wrong", [
    _stub,
    lambda n, BLOCK: (n // BLOCK, n % BLOCK),  # rounds down: misses the tail
    lambda n, BLOCK: (n // BLOCK + 1, BLOCK - n % BLOCK),  # one too many when BLOCK divides n
    lambda n, BLOCK: (-(-n // BLOCK), 0),  # right programs, forgets the idle lanes
], ids=["stub", "floor", "always-plus-one", "no-idle-lanes"])
def test_grid_size_wrong_variants_not_solved(wrong):
    assert_not_solved(check_grid(wrong))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("wrong", [
    _stub,
    lambda M, N, K, dtype: ((M * K + K * N) * _itemsize(dtype), 2 * M * N * K,
                            2 * M * N * K / ((M * K + K * N) * _itemsize(dtype))),  # forgets writing C
    lambda M, N, K, dtype: ((M * K + K * N + M * N) * _itemsize(dtype), M * N * K,
                            M * N * K / ((M * K + K * N + M * N) * _itemsize(dtype))),  # FLOPs without the 2
    lambda M, N, K, dtype: ((M * K + K * N + M * N) * 4, 2 * M * N * K,
                            2 * M * N * K / ((M * K + K * N + M * N) * 4)),  # ignores the dtype
], ids=["stub", "no-output-bytes", "flops-missing-2", "ignores-dtype"])
def test_matmul_traffic_wrong_variants_not_solved(wrong):
    assert_not_solved(check_matmul(wrong))


def _sectors_one_per_element(n, stride, BLOCK, elem_bytes=4):
    return n


def _sectors_from_total_bytes(n, stride, BLOCK, elem_bytes=4):
    # Divides the span by 32: right for contiguous loads, wrong once lanes skip whole sectors.
    return -(-(n * stride * elem_bytes) // 32)


def _sectors_ignoring_mask(n, stride, BLOCK, elem_bytes=4):
    programs = -(-n // BLOCK)
    return sol.sectors_touched(programs * BLOCK, stride, BLOCK, elem_bytes)


def _sectors_global_set(n, stride, BLOCK, elem_bytes=4):
    # One set over every lane of the launch: what a perfect cache would fetch, not what the loads touch
    # (each program's load pays for its own sectors, even those its neighbour also fetched).
    return len({(i * stride * elem_bytes) // 32 for i in range(n)})


@pytest.mark.parametrize("wrong", [_stub, _sectors_one_per_element, _sectors_from_total_bytes,
                                   _sectors_ignoring_mask, _sectors_global_set],
                         ids=["stub", "one-per-element", "total-bytes-over-32", "ignores-mask", "global-set"])
def test_sectors_touched_wrong_variants_not_solved(wrong):
    assert_not_solved(check_sectors(wrong))


def test_global_set_passes_aligned_cases_and_only_the_shared_sector_case_catches_it():
    # Why the notebook has the case (100, 3, 8, 2): on the seven cases before it, the global-set
    # variant is indistinguishable from the per-program count, since no program's span ends mid-sector.
    assert all((BLOCK * stride * elem_bytes) % 32 == 0
               for _, stride, BLOCK, elem_bytes in NOTEBOOK_SECTOR_CASES_ALIGNED)
    assert check("ch00_gpu_model.sectors_touched", _sectors_global_set, traced_sectors,
                 NOTEBOOK_SECTOR_CASES_ALIGNED).solved
    assert sol.sectors_touched(*SHARED_SECTOR_CASE) == 25 and _sectors_global_set(*SHARED_SECTOR_CASE) == 19
    assert_not_solved(check("ch00_gpu_model.sectors_touched", _sectors_global_set, traced_sectors,
                            NOTEBOOK_SECTOR_CASES))
    assert check("ch00_gpu_model.sectors_touched", sol.sectors_touched, traced_sectors, NOTEBOOK_SECTOR_CASES).solved


@triton.jit
def add_kernel_stub(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def add_kernel_missing_mask(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


@triton.jit
def add_kernel_off_by_one(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK) + 1
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def add_kernel_ignores_y(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


@triton.jit
def add_kernel_forgets_block_offset(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) + tl.arange(0, BLOCK)  # pid instead of pid * BLOCK
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@pytest.mark.parametrize("wrong", [add_kernel_stub, add_kernel_missing_mask, add_kernel_off_by_one,
                                   add_kernel_ignores_y, add_kernel_forgets_block_offset],
                         ids=["stub", "missing-mask", "off-by-one", "ignores-y", "forgets-block-offset"])
def test_add_kernel_wrong_variants_not_solved(wrong):
    assert_not_solved(check_add(wrong))
