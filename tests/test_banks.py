"""utils.banks: a warp's shared-memory access in wavefronts — hand-checked cases, and the GEMM ladder's tiles.

The GEMM cases mirror the index expressions of chapters/13_below_triton/src/cuda/gemm_*.cuh lane by lane: the
register-tiled rung's transposed A-tile store is (BK/4)-way conflicted without padding, conflict-free padded
(BK = 8) or swizzled (any BK up to 32); a pad that keeps rows 16-byte aligned cannot fix BK = 16.
"""

import pytest

from utils import banks


def lanes(fn, count=32):
    return [fn(lane) for lane in range(count)]


# ----------------------------------------------------------------------------------------------
# Hand-checked accesses
# ----------------------------------------------------------------------------------------------


def test_bank_of_an_address():
    assert [banks.bank(a) for a in (0, 3, 4, 124, 128, 132)] == [0, 0, 1, 31, 0, 1]


def test_stride_1_is_one_wavefront():
    access = banks.warp_access(lanes(lambda i: 4 * i))
    assert (access.wavefronts, access.ideal, access.conflicts, access.ways) == (1, 1, 0, 1)


def test_stride_2_is_a_2_way_conflict():
    # words 0, 2, ..., 62: banks 0, 2, ..., 30 twice each (word 0 and word 32 in bank 0)
    access = banks.warp_access(lanes(lambda i: 8 * i))
    assert (access.wavefronts, access.conflicts, access.ways) == (2, 1, 2)
    assert access.worst_bank == 0 and access.worst_words == (0, 32) and access.worst_lanes == (0, 16)
    assert "2-way conflict on bank 0" in access.describe() and "lane 16 word 32" in access.describe()


def test_stride_32_is_a_32_way_conflict():
    assert banks.wavefronts(lanes(lambda i: 128 * i)) == 32
    assert banks.conflicts(lanes(lambda i: 128 * i)) == 31


def test_odd_stride_is_conflict_free():
    assert banks.wavefronts(lanes(lambda i: 4 * 33 * i)) == 1  # a padded column: stride 33 words


def test_broadcast_of_one_word_is_one_wavefront():
    assert banks.wavefronts([64] * 32) == 1
    # two words of one bank read by 16 lanes each: 2-way, however many lanes read each word
    assert banks.wavefronts(lanes(lambda i: 0 if i % 2 else 128)) == 2
    # bytes within one word are the same word (sub-word accesses)
    assert banks.wavefronts(lanes(lambda i: i), width=1) == 1


def test_inactive_lanes_do_not_count():
    addresses = [128 * i if i < 4 else None for i in range(32)]
    assert banks.wavefronts(addresses) == 4
    assert banks.wavefronts([None] * 32) == 0 and banks.warp_access([None] * 32).ideal == 0


def test_8_byte_accesses_run_in_two_half_warps():
    assert banks.wavefronts(lanes(lambda i: 8 * i), width=8) == 2  # 256 consecutive bytes: ideal
    assert banks.conflicts(lanes(lambda i: 8 * i), width=8) == 0
    # stride of 2 doubles: each half warp's 16 lanes cover 64 words, two per bank
    assert banks.wavefronts(lanes(lambda i: 16 * i), width=8) == 4


def test_16_byte_accesses_run_in_four_quarter_warps():
    assert banks.wavefronts(lanes(lambda i: 16 * i), width=16) == 4  # 512 consecutive bytes: ideal
    access = banks.warp_access(lanes(lambda i: 32 * i), width=16)  # every other float4
    assert (access.wavefronts, access.ideal, access.ways) == (8, 4, 2)
    assert access.worst_phase == 0 and access.worst_lanes == (0, 4)
    # one float4 for all lanes of a quarter: a broadcast, one wavefront per phase
    assert banks.wavefronts(lanes(lambda i: 16 * (i // 8)), width=16) == 4
    # a quarter warp reading one column of 8 rows of a 32-float row-major tile: 8 words of one bank
    assert banks.warp_access(lanes(lambda i: 128 * (i % 8)), width=16).ways == 8


def test_bad_accesses_raise():
    with pytest.raises(ValueError, match="width must be one of"):
        banks.wavefronts([0], width=12)
    with pytest.raises(ValueError, match="not a non-negative multiple of the access width 16"):
        banks.wavefronts([8], width=16)
    with pytest.raises(ValueError, match="a warp has 32 lanes"):
        banks.wavefronts([0] * 33)


def test_tile_access_groups_threads_into_warps():
    # 64 threads storing a 64-float row, then each storing down a 64-float column of a 64 x 64 tile
    row = banks.tile_access(lambda t, s: t, threads=64, label="row")
    column = banks.tile_access(lambda t, s: 64 * t, threads=64, label="column")
    assert (len(row.accesses), row.wavefronts, row.conflicts) == (2, 2, 0)
    assert (column.wavefronts, column.ideal, column.ways) == (64, 2, 32)
    assert "worst: warp 0, step 0: 32 wavefronts (ideal 1): 32-way conflict" in str(column)
    # a partial last warp and inactive threads
    part = banks.tile_access(lambda t, s: t if t % 2 == 0 else None, threads=40, steps=3)
    assert len(part.accesses) == 6 and part.conflicts == 0


# ----------------------------------------------------------------------------------------------
# The GEMM ladder's shared-memory tiles, mirrored from gemm_*.cuh
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bk, ways", [(8, 2), (16, 4), (32, 8)])
def test_transposed_store_without_padding_is_bk_over_4_way(bk, ways):
    store = banks.a_tile_store(banks.a_tile_offset("plain", bk), bk)
    assert store.ways == ways
    assert store.wavefronts == ways * store.ideal  # every warp's every store, not one unlucky warp
    warp, step, worst = store.worst
    # lanes 0 .. BK/4-1 hold the same row m of A, one group of k each: the same bank, BK/4 words
    assert worst.worst_lanes[: bk // 4] == tuple(range(bk // 4))


def test_padding_by_4_removes_the_conflicts_at_bk_8():
    store = banks.a_tile_store(banks.a_tile_offset("padded", 8), 8)
    assert store.conflicts == 0 and store.wavefronts == 32


def test_aligned_padding_cannot_fix_bk_16():
    # rows must stay 16-byte aligned for the float4 reads: pads of 4, 8, ... words; each leaves conflicts
    for pad in (4, 8, 12, 16, 20):
        store = banks.a_tile_store(lambda k, m, p=pad: k * (128 + p) + m, 16)
        assert store.ways >= 2, pad
    # an unaligned pad of 2 words would be conflict-free for the store, but breaks the 16-byte reads
    assert banks.a_tile_store(lambda k, m: k * 130 + m, 16).conflicts == 0
    with pytest.raises(ValueError, match="not a non-negative multiple of the access width 16"):
        banks.a_tile_load(lambda k, m: k * 130 + m, 16)


@pytest.mark.parametrize("bk", [8, 16, 32])
def test_swizzle_removes_the_conflicts_at_any_bk(bk):
    offset = banks.a_tile_offset("swizzled", bk)
    assert banks.a_tile_store(offset, bk).conflicts == 0
    assert banks.a_tile_load(offset, bk).conflicts == 0
    # a bijection onto the unpadded tile, and every aligned group of 4 m's stays 4 consecutive words
    words = {offset(k, m) for k in range(bk) for m in range(128)}
    assert words == set(range(bk * 128))
    assert all(offset(k, m + j) == offset(k, m) + j for k in range(bk) for m in range(0, 128, 4) for j in range(4))


@pytest.mark.parametrize("layout", banks.LAYOUTS)
def test_inner_loop_a_reads_are_broadcasts(layout):
    # each quarter warp (tx = 0..7 of one ty) reads one float4: 4 wavefronts per warp access, the ideal
    reads = banks.a_tile_load(banks.a_tile_offset(layout, 8), 8)
    assert reads.conflicts == 0 and reads.wavefronts == 4 * len(reads.accesses)


def test_inner_loop_b_reads_split_columns_to_stay_conflict_free():
    # gemm_regtile/gemm_cp_async: thread t (tx = t % 16) reads Bs[k][4 tx ..] and Bs[k][64 + 4 tx ..]
    split = banks.tile_access(lambda t, s: s * 128 + (s % 2) * 64 + 4 * (t % 16), threads=256, steps=2, width=16)
    assert split.conflicts == 0
    # 8 consecutive columns per thread (float4 at 8 tx, 8 tx + 4) would be 2-way conflicted
    packed = banks.tile_access(lambda t, s: 8 * (t % 16) + 4 * s, threads=256, steps=2, width=16)
    assert packed.ways == 2


def test_smem_rung_reads_are_conflict_free():
    # gemm_smem<32>: warp = one row ty of the block; As[ty][k] is one word for all lanes, Bs[k][tx] 32 words
    tile = 32
    a_reads = banks.tile_access(lambda t, k: (t // tile) * tile + k, threads=tile * tile, steps=tile)
    b_reads = banks.tile_access(lambda t, k: k * tile + t % tile, threads=tile * tile, steps=tile)
    stores = banks.tile_access(lambda t, s: (t // tile) * tile + t % tile, threads=tile * tile)
    assert a_reads.conflicts == b_reads.conflicts == stores.conflicts == 0


def test_cp_async_rung_tiles_are_conflict_free():
    # gemm_cp_async (BK = 8): 16-byte copies into the row-major A tile (2 chunks a row) and the B tile, and the
    # inner loop's float4 reads of A along k (As[m][kk..kk+3], rows 4 ty + i and 64 + 4 ty + i)
    bk = 8
    a_copy = banks.tile_access(lambda t, s: (t // 2) * bk + (t % 2) * 4, threads=256, width=16)
    b_copy = banks.tile_access(lambda t, s: (t // 32) * 128 + (t % 32) * 4, threads=256, width=16)

    def a_read(t, step):
        i, kk = divmod(step, 2)
        return ((0 if i < 4 else 64) + 4 * (t // 16) + i % 4) * bk + 4 * kk

    reads = banks.tile_access(a_read, threads=256, steps=16, width=16)
    assert a_copy.conflicts == b_copy.conflicts == reads.conflicts == 0
    # padding is not free: the same copy into rows padded by 4 floats would be 2-way conflicted
    padded = banks.tile_access(lambda t, s: (t // 2) * (bk + 4) + (t % 2) * 4, threads=256, width=16)
    assert padded.ways == 2
