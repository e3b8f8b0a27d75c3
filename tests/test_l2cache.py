"""utils.l2cache: exact LRU hit/miss sequences, the wave interleaving, the grouped launch order, and the
analytic matmul stream against the sectors a traced tiled kernel really touches."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernel_ladder  # noqa: E402
from utils.l2cache import (  # noqa: E402
    LRUCache,
    interleave,
    matmul_tile_programs,
    program_order,
    programs_from_launch,
    scaled_capacity,
    scaled_machine,
    simulate,
)
from utils.plots import launch_order_chart  # noqa: E402
from utils.trace import SectorAccess, trace  # noqa: E402


def _hits_and_misses(capacity_sectors: int, sequence: list[int]) -> tuple[list[bool], LRUCache]:
    cache = LRUCache(capacity_sectors * 32)
    return [bool(cache.access([s])) for s in sequence], cache


def test_lru_sequence_exactly():
    hits, cache = _hits_and_misses(2, [1, 2, 1, 3, 2, 1])
    # 1 miss, 2 miss, 1 hit (LRU order 2,1), 3 miss evicts 2, 2 miss evicts 1, 1 miss evicts 3
    assert hits == [False, False, True, False, False, False]
    assert (cache.hits, cache.misses, cache.contents()) == (1, 5, [2, 1])


def test_lru_is_not_fifo():
    # Negative control: a FIFO cache would evict 1 at the access to 3 (it came in first) and miss
    # on the last access; LRU keeps 1 because it was used more recently than 2.
    hits, cache = _hits_and_misses(2, [1, 2, 1, 3, 1])
    assert hits == [False, False, True, False, True]
    assert 2 not in cache and 1 in cache and 3 in cache


def test_lru_capacity_three_and_zero():
    hits, cache = _hits_and_misses(3, [1, 2, 3, 1, 4, 2, 1])
    # after 4: {3, 1, 4} (2 evicted); 2 misses, evicts 3; 1 hits
    assert hits == [False, False, False, True, False, False, True]
    assert cache.contents() == [4, 2, 1] and len(cache) == 3
    hits, cache = _hits_and_misses(0, [5, 5, 5])
    assert hits == [False] * 3 and len(cache) == 0
    with pytest.raises(ValueError, match="capacity"):
        LRUCache(-1)


def test_insert_allocates_without_counting():
    cache = LRUCache(2 * 32)
    cache.insert([7, 8])
    assert (cache.hits, cache.misses) == (0, 0) and cache.contents() == [7, 8]
    assert cache.access(np.array([7, 9])) == 1  # 7 hits; 9 evicts 8
    assert cache.contents() == [7, 9]


def _access(program, *sectors, kind="load", tensor="a"):
    return SectorAccess(program, kind, tensor, np.array(sectors, dtype=np.int64))


def test_interleave_waves():
    a = [_access(0, 0), _access(0, 1)]
    b = [_access(1, 2), _access(1, 3), _access(1, 4)]
    c = [_access(2, 5)]
    order = lambda programs, n: [int(x.sectors[0]) for x in interleave(programs, n)]  # noqa: E731
    assert order([a, b, c], 1) == [0, 1, 2, 3, 4, 5]
    assert order([a, b, c], 2) == [0, 2, 1, 3, 4, 5]  # wave {a, b}, then {c}
    assert order({2: c, 0: a, 1: b}, 3) == [0, 2, 5, 1, 3, 4]  # a mapping runs in program-id order
    with pytest.raises(ValueError, match="concurrent"):
        list(interleave([a], 0))


def test_simulate_counts_shared_loads_as_hits_only_when_they_run_together():
    # Two programs load the same 4 sectors, 4 other sectors each, and store 1.
    def program(pid):
        return [_access(pid, 0, 1, 2, 3, tensor="shared"), _access(pid, *range(10 + 4 * pid, 14 + 4 * pid)),
                _access(pid, 100 + pid, kind="store", tensor="c")]

    programs = [program(0), program(1)]
    together = simulate(programs, capacity_bytes=6 * 32, concurrent=2)
    # wave of 2: p0 shared (4 misses), p1 shared (4 hits), p0 own, p1 own (8 misses)
    assert (together.load_sectors, together.hits, together.misses) == (16, 4, 12)
    assert together.hit_rate == 0.25 and together.per_tensor == {"shared": (4, 4), "a": (0, 8)}
    assert together.dram_read_bytes == 12 * 32 and together.dram_write_bytes == 2 * 32
    assert together.requested_bytes == 16 * 32 and together.dram_bytes == 14 * 32
    # one after the other, the 6-sector cache has evicted the shared sectors by the time p1 runs
    apart = simulate(programs, capacity_bytes=6 * 32, concurrent=1)
    assert apart.hits == 0
    # ... unless it is big enough to keep them
    assert simulate(programs, capacity_bytes=64 * 32, concurrent=1).hits == 4
    assert "hit rate 25.0%" in str(together)


def test_program_order_by_hand():
    pid_m, pid_n = program_order(4, 3, group_m=2)
    assert pid_m.tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    assert pid_n.tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    pid_m, pid_n = program_order(3, 2, group_m=2)  # the last group has one row
    assert list(zip(pid_m.tolist(), pid_n.tolist())) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    pid_m, pid_n = program_order(2, 3, group_m=1)  # row-major
    assert pid_m.tolist() == [0, 0, 0, 1, 1, 1] and pid_n.tolist() == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match=">= 1"):
        program_order(2, 2, 0)


@pytest.mark.parametrize(("grid_m", "grid_n", "group_m"), [(7, 5, 3), (8, 8, 8), (1, 9, 4), (16, 3, 20)])
def test_program_order_visits_every_tile_once(grid_m, grid_n, group_m):
    pid_m, pid_n = program_order(grid_m, grid_n, group_m)
    tiles = set(zip(pid_m.tolist(), pid_n.tolist()))
    assert len(tiles) == grid_m * grid_n == pid_m.size
    assert all(0 <= m < grid_m and 0 <= n < grid_n for m, n in tiles)


def test_matmul_stream_sizes_and_perfect_cache():
    M, N, K, BM, BN, BK = 64, 96, 80, 32, 32, 32  # K has a remainder of 16
    programs = matmul_tile_programs(M, N, K, BM, BN, BK, element_bytes=2, group_m=2)
    assert sorted(programs) == list(range(2 * 3))
    first = programs[0]
    assert [a.kind for a in first] == ["load", "load"] * 3 + ["store"]
    assert [a.sectors.size for a in first[:6]] == [32 * 2, 32 * 2, 32 * 2, 32 * 2, 32, 16 * 2]
    # Every sector of A and B is loaded; an endless cache misses each exactly once.
    endless = simulate(programs, capacity_bytes=1 << 30, concurrent=3)
    assert endless.misses == (M * K + K * N) * 2 // 32
    assert endless.load_sectors == (M * K * 3 + K * N * 2) * 2 // 32  # A once per tile column, B per tile row
    assert endless.stored_sectors == M * N * 2 // 32
    assert simulate(programs, capacity_bytes=0).hits == 0


def test_grouped_order_hits_more_in_the_scaled_machine():
    M = 512
    capacity, concurrent = scaled_machine(M, M, M, 32, 32, element_bytes=2)
    assert (capacity, concurrent) == (50 * 1024 * 1024 // 256, 33)
    results = {g: simulate(matmul_tile_programs(M, M, M, 32, 32, 32, 2, group_m=g), capacity, concurrent)
               for g in (1, 8)}
    assert results[8].hit_rate > results[1].hit_rate
    assert results[8].dram_read_bytes < 0.8 * results[1].dram_read_bytes
    assert results[1].requested_bytes == results[8].requested_bytes  # same loads, different order


def test_scaling_helpers():
    assert scaled_capacity(100, 1000, 3200) == 320
    assert scaled_capacity(1, 1000, 3200) == 0  # whole sectors
    assert scaled_machine(8192, 8192, 8192, 128, 128) == (50 * 1024 * 1024, 132)
    assert scaled_machine(64, 64, 64, 32, 32)[1] == 4  # never more programs than the grid has


@triton.jit
def grouped_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * grid_n)) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % rows
    pid_n = (pid % (GROUP_M * grid_n)) // rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@pytest.mark.interpreter
@pytest.mark.skipif(not kernel_ladder.runtime.INTERPRETER, reason="the tracer watches the interpreter")
def test_analytic_stream_equals_the_traced_kernel():
    M, N, K, BM, BN, BK, group_m = 48, 64, 40, 16, 32, 16, 2  # remainders in M and K
    a = torch.randn(M, K, dtype=torch.float16)
    b = torch.randn(K, N, dtype=torch.float16)
    c = torch.empty(M, N, dtype=torch.float16)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    with trace(record_sectors=True) as t:
        grouped_matmul_kernel[grid](a, b, c, M, N, K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=group_m)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=2e-3, atol=2e-3)
    traced = programs_from_launch(t.launches[0])
    analytic = matmul_tile_programs(M, N, K, BM, BN, BK, 2, group_m, bases=(a.data_ptr(), b.data_ptr(), c.data_ptr()))
    assert sorted(traced) == sorted(analytic)
    for pid in analytic:
        assert [(x.kind, x.tensor) for x in traced[pid]] == [(x.kind, x.tensor) for x in analytic[pid]]
        for got, expected in zip(traced[pid], analytic[pid]):
            np.testing.assert_array_equal(got.sectors, expected.sectors)
    with trace() as plain:
        grouped_matmul_kernel[grid](a, b, c, M, N, K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=group_m)
    with pytest.raises(ValueError, match="record_sectors"):
        programs_from_launch(plain.launches[0])


def test_launch_order_chart_labels_every_tile():
    ax = launch_order_chart(*program_order(4, 6, 2), concurrent=5)
    labels = sorted(int(t.get_text()) for t in ax.texts)
    assert labels == list(range(24))
    ax = launch_order_chart(*program_order(4, 6, 1), numbers=False, title="row-major")
    assert len(ax.texts) == 0 and ax.get_title() == "row-major"
    plt.close("all")
