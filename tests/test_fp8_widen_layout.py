"""The FP8 chunk tile's widening addresses (fa4_jax/kernels/fp8_widen_layout.py) on the CPU: the widening
warps' lanes and passes copy every element of a block exactly once, inside their stage, and neither
the 8-byte loads nor the 16-byte stores conflict in shared-memory banks. (That the formulas are
CuTe's layouts of the stages, fwd_sm90.check_widen_layouts checks when the kernels compile.)"""

from __future__ import annotations

import itertools

import pytest

from fa4_jax.kernels import fp8_widen_layout as wl
from smem_banks import wavefronts

TILE_N = 128
# Every (head_dim, widening warps) the chunk tile compiles: its widening warpgroup's four (three producer
# warps beside the loads' ran until 2026-12-06's eleventh session, docs/PERF.md).
SHAPES = pytest.mark.parametrize("hd,warps", [(hd, wl.WARPS) for hd in wl.HEAD_DIMS])


def _copies(hd, warps):
    """{(warp, lane, pass): (row, col)} for every copy a block takes."""
    out = {}
    for warp, lane, i in itertools.product(range(warps), range(32), range(wl.passes(TILE_N, hd, warps))):
        e = wl.element_of(TILE_N, hd, warps, warp, lane, i)
        if e is not None:
            out[warp, lane, i] = e
    return out


@SHAPES
def test_every_element_once(hd, warps):
    copies = _copies(hd, warps)
    want = {(r, c) for r in range(TILE_N) for c in range(0, hd, wl.ELEMS)}
    assert sorted(copies.values()) == sorted(want)
    # Whole rounds: a warp's rows and the block's are multiples of ROUND_ROWS (rounds are skipped whole).
    assert wl.rows_per_warp(TILE_N, warps) % wl.ROUND_ROWS == 0 and TILE_N % wl.ROUND_ROWS == 0
    assert wl.rows_per_warp(TILE_N, warps) % wl.PERIOD_ROWS == 0


@pytest.mark.parametrize("hd", [64, 128])
def test_offsets_are_bijections_within_a_stage(hd):
    elems = [(r, c) for r in range(TILE_N) for c in range(hd)]
    f8 = {wl.fp8_offset(hd, r, c) for r, c in elems}
    f16 = {wl.f16_offset(TILE_N, r, c) for r, c in elems}
    assert f8 == set(range(wl.fp8_stage_bytes(TILE_N, hd)))
    assert f16 == set(range(0, wl.f16_stage_bytes(TILE_N, hd), 2))
    # A lane's 8 elements are contiguous at both ends (one 8-byte load, one 16-byte store).
    for r, c in itertools.product(range(TILE_N), range(0, hd, wl.ELEMS)):
        a8, a16 = wl.fp8_offset(hd, r, c), wl.f16_offset(TILE_N, r, c)
        assert [wl.fp8_offset(hd, r, c + k) for k in range(8)] == list(range(a8, a8 + 8))
        assert [wl.f16_offset(TILE_N, r, c + k) for k in range(8)] == list(range(a16, a16 + 16, 2))


@SHAPES
def test_offsets_repeat_each_period_shifted_by_its_rows(hd, warps):
    """What widen_offsets / widen_rows rely on: a lane's offsets at pass i are those at pass i % period
    plus (i // period) * 8 rows of bytes, from its warp's first row."""
    per = wl.period(hd)
    for warp, lane in itertools.product(range(warps), range(32)):
        for i in range(wl.passes(TILE_N, hd, warps)):
            e, e0 = (wl.element_of(TILE_N, hd, warps, warp, lane, j) for j in (i, i % per))
            if e is None:
                continue
            shift = i // per * wl.PERIOD_ROWS
            assert wl.fp8_offset(hd, *e) == wl.fp8_offset(hd, *e0) + shift * hd
            assert wl.f16_offset(TILE_N, *e) == wl.f16_offset(TILE_N, *e0) + shift * wl.F16_ROW_BYTES


@SHAPES
def test_no_bank_conflicts(hd, warps):
    for warp, i in itertools.product(range(warps), range(wl.passes(TILE_N, hd, warps))):
        elems = [wl.element_of(TILE_N, hd, warps, warp, lane, i) for lane in range(32)]
        if elems[0] is None:
            continue
        loads = [wl.fp8_offset(hd, *e) for e in elems]
        stores = [wl.f16_offset(TILE_N, *e) for e in elems]
        assert wavefronts(loads, 8) == 2, (warp, i)  # 256 bytes: two 128-byte wavefronts
        assert wavefronts(stores, 16) == 4, (warp, i)  # 512 bytes: four
