"""The FP8 chunk tile's widening addresses (fa4_jax/kernels/fp8_widen_layout.py) on the CPU: the three
warps' lanes and passes copy every element of a block exactly once, inside their stage, and neither
the 8-byte loads nor the 16-byte stores conflict in shared-memory banks. (That the formulas are
CuTe's layouts of the stages, fwd_sm90.check_widen_layouts checks when the kernels compile.)"""

from __future__ import annotations

import itertools

import pytest

from fa4_jax.kernels import fp8_widen_layout as wl
from smem_banks import wavefronts

# Every (head_dim, block keys, widening warps) the chunk tile compiles: three warps beside the loads'
# (a fourth, the loads' warp widening too, measured slower on 2026-12-06: docs/PERF.md); 64-key blocks
# at hd128 under the experiment fp8_chunk_n64 (kernels/experiments.py).
SHAPES = pytest.mark.parametrize("hd,tile_n,warps", [(64, 128, wl.WARPS), (128, 128, wl.WARPS), (128, 64, wl.WARPS)])


def _copies(hd, tile_n, warps):
    """{(warp, lane, pass): (row, col)} for every copy a block takes."""
    out = {}
    for warp, lane, i in itertools.product(range(warps), range(32), range(wl.passes(tile_n, hd, warps))):
        e = wl.element_of(tile_n, hd, warps, warp, lane, i)
        if e is not None:
            out[warp, lane, i] = e
    return out


@SHAPES
def test_every_element_once(hd, tile_n, warps):
    copies = _copies(hd, tile_n, warps)
    want = {(r, c) for r in range(tile_n) for c in range(0, hd, wl.ELEMS)}
    assert sorted(copies.values()) == sorted(want)
    # Whole rounds: a warp's rows and the block's are multiples of round_rows (rounds are skipped whole),
    # and a round is whole periods of passes (widen_rows' offsets repeat each period).
    rounds = wl.round_rows(tile_n, warps)
    assert wl.rows_per_warp(tile_n, warps) % rounds == 0 and tile_n % rounds == 0
    assert rounds % wl.PERIOD_ROWS == 0 and wl.rows_per_warp(tile_n, warps) % wl.PERIOD_ROWS == 0


def test_round_rows():
    assert wl.round_rows(128) == wl.ROUND_ROWS == 16  # 48 rows per warp: three rounds of 16
    assert wl.round_rows(64) == 8  # 24 rows per warp: three rounds of 8


@pytest.mark.parametrize("hd,tile_n", [(64, 128), (128, 128), (128, 64)])
def test_offsets_are_bijections_within_a_stage(hd, tile_n):
    elems = [(r, c) for r in range(tile_n) for c in range(hd)]
    f8 = {wl.fp8_offset(hd, r, c) for r, c in elems}
    f16 = {wl.f16_offset(tile_n, r, c) for r, c in elems}
    assert f8 == set(range(wl.fp8_stage_bytes(tile_n, hd)))
    assert f16 == set(range(0, wl.f16_stage_bytes(tile_n, hd), 2))
    # A lane's 8 elements are contiguous at both ends (one 8-byte load, one 16-byte store).
    for r, c in itertools.product(range(tile_n), range(0, hd, wl.ELEMS)):
        a8, a16 = wl.fp8_offset(hd, r, c), wl.f16_offset(tile_n, r, c)
        assert [wl.fp8_offset(hd, r, c + k) for k in range(8)] == list(range(a8, a8 + 8))
        assert [wl.f16_offset(tile_n, r, c + k) for k in range(8)] == list(range(a16, a16 + 16, 2))


@SHAPES
def test_offsets_repeat_each_period_shifted_by_its_rows(hd, tile_n, warps):
    """What widen_offsets / widen_rows rely on: a lane's offsets at pass i are those at pass i % period
    plus (i // period) * 8 rows of bytes, from its warp's first row."""
    per = wl.period(hd)
    for warp, lane in itertools.product(range(warps), range(32)):
        for i in range(wl.passes(tile_n, hd, warps)):
            e, e0 = (wl.element_of(tile_n, hd, warps, warp, lane, j) for j in (i, i % per))
            if e is None:
                continue
            shift = i // per * wl.PERIOD_ROWS
            assert wl.fp8_offset(hd, *e) == wl.fp8_offset(hd, *e0) + shift * hd
            assert wl.f16_offset(tile_n, *e) == wl.f16_offset(tile_n, *e0) + shift * wl.F16_ROW_BYTES


@SHAPES
def test_no_bank_conflicts(hd, tile_n, warps):
    for warp, i in itertools.product(range(warps), range(wl.passes(tile_n, hd, warps))):
        elems = [wl.element_of(tile_n, hd, warps, warp, lane, i) for lane in range(32)]
        if elems[0] is None:
            continue
        loads = [wl.fp8_offset(hd, *e) for e in elems]
        stores = [wl.f16_offset(tile_n, *e) for e in elems]
        assert wavefronts(loads, 8) == 2, (warp, i)  # 256 bytes: two 128-byte wavefronts
        assert wavefronts(stores, 16) == 4, (warp, i)  # 512 bytes: four
