"""utils.coalescing against hand-counted warp requests: sectors, lines, efficiency, tiles split into warps."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from utils.coalescing import (  # noqa: E402
    LINE_BYTES,
    SECTOR_BYTES,
    WARP_SIZE,
    matrix_strides,
    strided_warp,
    tile_requests,
    warp_request,
)
from utils.plots import warp_access_chart  # noqa: E402


def _counts(request):
    return request.sectors.size, request.lines.size, request.useful_bytes, request.fetched_bytes


def test_constants():
    assert (WARP_SIZE, SECTOR_BYTES, LINE_BYTES) == (32, 32, 128)


def test_coalesced_fp32_warp_is_4_sectors_in_1_line():
    request = strided_warp(1, element_bytes=4)
    assert _counts(request) == (4, 1, 128, 128)
    assert request.efficiency == 1.0 and request.requested_bytes == 128 and request.lanes == 32
    # lanes 0-7 share sector 0, 8-15 sector 1, ...
    assert [int(s[0]) for s in request.lane_sectors()] == [lane // 8 for lane in range(32)]


@pytest.mark.parametrize(
    ("stride", "element_bytes", "sectors", "lines", "efficiency"),
    [
        (2, 4, 8, 2, 0.5),         # every other fp32: 256 bytes spanned
        (3, 4, 12, 3, 1 / 3),      # 12-byte steps: 372 + 4 bytes spanned = 12 sectors, 3 lines
        (4, 4, 16, 4, 0.25),
        (8, 4, 32, 8, 0.125),      # 32-byte steps: one sector per lane, four lanes per line
        (64, 4, 32, 32, 0.125),    # a column of a 64-column row-major fp32 matrix
        (1, 2, 2, 1, 1.0),         # fp16/bf16: 64 bytes
        (16, 2, 32, 8, 0.0625),    # bf16 column of a 16-column matrix: 2 useful bytes per sector
        (1, 8, 8, 2, 1.0),         # fp64 / 8-byte lanes
    ],
)
def test_strided_warps(stride, element_bytes, sectors, lines, efficiency):
    request = strided_warp(stride, element_bytes)
    assert request.sectors.size == sectors and request.lines.size == lines
    assert request.efficiency == pytest.approx(efficiency)
    assert request.useful_bytes == 32 * element_bytes


def test_misaligned_base_costs_one_more_sector_and_line():
    request = strided_warp(1, 4, base=16)  # bytes 16..143
    assert _counts(request) == (5, 2, 128, 160)
    assert request.efficiency == pytest.approx(0.8)


def test_vector_lanes_and_broadcast_and_masks():
    wide = warp_request(np.arange(32) * 16, bytes_per_lane=16)  # ld.global.v4 of fp32: 512 bytes
    assert _counts(wide) == (16, 4, 512, 512)
    same = warp_request(np.full(32, 64), bytes_per_lane=4)  # every lane reads one value
    assert _counts(same) == (1, 1, 4, 32) and same.requested_bytes == 128 and same.efficiency == 0.125
    half = warp_request(np.arange(32) * 4, active=np.arange(32) < 16)  # the mask switches off 16 lanes
    assert _counts(half) == (2, 1, 64, 64) and half.lanes == 16
    assert half.lane_sectors()[20].size == 0
    straddle = warp_request([30], bytes_per_lane=4)  # an unaligned element spans two sectors
    assert [s.tolist() for s in straddle.lane_sectors()] == [[0, 1]] and straddle.sectors.size == 2
    nobody = warp_request(np.arange(32), active=np.zeros(32, dtype=bool))
    assert _counts(nobody) == (0, 0, 0, 0) and nobody.efficiency == 1.0


def test_lane_order_does_not_matter_but_addresses_do():
    # Control: a permutation of the lanes of a coalesced request is still 4 sectors (the hardware
    # merges by address, not by lane order); shifting each lane by a sector's worth is not.
    permuted = warp_request(np.random.default_rng(0).permutation(32) * 4)
    assert _counts(permuted) == (4, 1, 128, 128)
    spread = warp_request(np.arange(32) * 4 + (np.arange(32) % 2) * 512)
    assert spread.sectors.size == 8 and spread.efficiency == 0.5


def test_bad_requests():
    with pytest.raises(ValueError, match="32 lanes"):
        warp_request(np.arange(33))
    with pytest.raises(ValueError, match="bytes_per_lane"):
        warp_request([0], bytes_per_lane=0)
    with pytest.raises(ValueError, match="active"):
        warp_request([0, 4], active=[True])


def test_tile_with_lanes_along_the_contiguous_dimension_is_coalesced():
    # A 32x32 fp32 tile of a row-major matrix with 1024 columns; lanes run along a row.
    tile = tile_requests((32, 32), matrix_strides(4096, 1024, "row-major"), element_bytes=4)
    assert tile.order == (1, 0)
    assert (tile.num_requests, tile.sectors, tile.lines, tile.unique_sectors) == (32, 128, 32, 128)
    assert tile.efficiency == 1.0 and tile.sectors_per_request == 4.0


def test_tile_with_lanes_across_the_contiguous_dimension_is_strided():
    tile = tile_requests((32, 32), (1024, 1), element_bytes=4, order=(0, 1))  # lanes down a column
    assert (tile.num_requests, tile.sectors, tile.lines) == (32, 1024, 1024)
    assert tile.efficiency == 0.125
    assert tile.unique_sectors == 128  # the same bytes: what a whole-block sector count sees


def test_column_major_tile_picks_lanes_down_columns():
    strides = matrix_strides(1024, 4096, "column-major")
    assert strides == (1, 1024)
    tile = tile_requests((64, 16), strides, element_bytes=2)  # bf16: a column of 64 = 128 bytes
    assert tile.order == (0, 1)
    assert (tile.num_requests, tile.sectors, tile.lines) == (32, 64, 32)  # 32 lanes = half a column
    assert tile.efficiency == 1.0


def test_vectorized_lanes():
    tile = tile_requests((16, 64), (4096, 1), element_bytes=4, elements_per_lane=4)
    # 256 lane-vectors of 16 bytes: 8 requests of 512 bytes, 16 sectors each
    assert (tile.num_requests, tile.sectors, tile.lines) == (8, 128, 32)
    assert all(r.bytes_per_lane == 16 for r in tile.requests) and tile.efficiency == 1.0
    # along a strided dimension the 4 elements of a lane are not adjacent: 4 scalar requests instead
    strided = tile_requests((64, 16), (4096, 1), element_bytes=4, order=(0, 1), elements_per_lane=4)
    assert strided.num_requests == 32 and all(r.bytes_per_lane == 4 for r in strided.requests)
    # each request: 16 rows x 2 adjacent columns (one sector per row) = 16 sectors for 128 useful bytes
    assert strided.sectors == 32 * 16 and strided.efficiency == 0.25


def test_narrow_tiles_spread_a_warp_over_rows():
    tile = tile_requests((8, 8), (1024, 1), element_bytes=4)  # rows of 32 bytes
    assert tile.num_requests == 2 and all(r.sectors.size == 4 and r.lines.size == 4 for r in tile.requests)
    assert tile.efficiency == 1.0
    bf16 = tile_requests((16, 8), (4096, 1), element_bytes=2)  # rows of 16 bytes: half a sector each
    assert bf16.sectors == 4 * 4 and bf16.efficiency == 0.5


def test_bad_tiles():
    with pytest.raises(ValueError, match="divide"):
        tile_requests((4, 6), (6, 1), elements_per_lane=4)
    with pytest.raises(ValueError, match="order"):
        tile_requests((4, 4), (4, 1), order=(1, 1))
    with pytest.raises(ValueError, match="positive"):
        tile_requests((0, 4), (4, 1))
    with pytest.raises(ValueError, match="layout"):
        matrix_strides(4, 4, "diagonal")


def test_warp_access_chart_draws_lanes_sectors_and_lines():
    request = strided_warp(2, 4)
    ax = warp_access_chart(request)
    rectangles = [p for p in ax.patches]
    assert len(rectangles) == 32 + 2 * 8  # lane boxes, sector outlines and their used fills
    assert "8 sectors in 2 lines, 50% of fetched bytes used" in ax.get_title()
    ax = warp_access_chart(warp_request(np.arange(32) * 4, active=np.arange(32) < 8), title="masked")
    assert ax.get_title() == "masked"
    plt.close("all")
