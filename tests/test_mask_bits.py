"""The bit masks of kernels/mask.py (SM90 boundary blocks), with the arithmetic the kernel traces
(fa4_jax/kernels/mask_bits.py) run on Python ints: for every thread of a quad, tile width and bound,
the registers a row keeps are exactly those whose column lies in [lower, upper). No GPU, no cutlass."""

from __future__ import annotations

import itertools

import pytest

from fa4_jax.kernels.mask_bits import BITS, keep_bits, registers_left_of, wgmma_column_offset


def shl_b32(x: int, n: int) -> int:
    """PTX shl.b32: a 32-bit result, 0 once the shift reaches the width."""
    assert n >= 0
    return (x << n) & 0xFFFFFFFF if n < 32 else 0


def kept(ncol: int, first: int, lower: int | None, upper: int) -> list[int]:
    """The registers kept by the bit masks of a row whose visible columns are [lower, upper) (relative
    to the block), for a thread whose first column is `first`: what ScoreMask.apply computes."""
    keep_hi = registers_left_of(upper - first)
    keep_lo = registers_left_of(lower - first) if lower is not None else 0
    out = []
    for w in range((ncol + BITS - 1) // BITS):
        bits = keep_bits(keep_lo, keep_hi, w, lower is not None, shl_b32)
        out += [w * BITS + i for i in range(min(BITS, ncol - w * BITS)) if (bits >> i) & 1]
    return out


def test_column_offsets_are_pairs_per_8_column_group():
    assert [wgmma_column_offset(c) for c in range(8)] == [0, 1, 8, 9, 16, 17, 24, 25]


def test_registers_left_of_counts_offsets_below_the_limit():
    for limit in range(-40, 300):
        assert registers_left_of(limit) == sum(wgmma_column_offset(c) < limit for c in range(80)), limit


@pytest.mark.parametrize("tile_n", [64, 80, 96, 112, 128, 144, 176, 192, 256])
@pytest.mark.parametrize("lane", range(4))
def test_bit_masks_keep_exactly_the_visible_columns(tile_n, lane):
    first = 2 * lane
    ncol = tile_n // 4  # registers per row and thread: tile_n / 8 groups of 2
    cols = [first + wgmma_column_offset(c) for c in range(ncol)]
    assert max(cols) < tile_n
    bounds = range(-9, tile_n + 10)
    for upper in bounds:  # seqlen / causal / right window edge only
        assert kept(ncol, first, None, upper) == [c for c, col in enumerate(cols) if col < upper], upper
    for lower, upper in itertools.product(range(-9, tile_n + 10, 3), range(-9, tile_n + 10, 5)):
        want = [c for c, col in enumerate(cols) if lower <= col < upper]
        assert kept(ncol, first, lower, upper) == want, (lower, upper)
