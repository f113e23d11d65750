"""The dense causal kernels' tile order (fa4_jax/kernels/tile_order.py, the arithmetic the device
scheduler runs): every tile exactly once, longest first within each section of (head, batch) pairs,
and sections sized to the L2 budget. No GPU, no cutlass."""

from __future__ import annotations

import pytest

from fa4_jax.kernels.tile_order import LPT_SECTION_MAX_PAIRS, lpt_section_pairs, lpt_tile


@pytest.mark.parametrize("num_m_blocks,pairs,section", [
    (8, 256, 4), (8, 256, 1), (64, 16, 4), (128, 8, 2), (5, 7, 4), (1, 3, 4), (3, 1, 4), (6, 10, 3),
])
def test_every_tile_once_longest_first_in_its_section(num_m_blocks, pairs, section):
    order = [lpt_tile(i, num_m_blocks, pairs, section) for i in range(num_m_blocks * pairs)]
    assert sorted(order) == [(m, p) for m in range(num_m_blocks) for p in range(pairs)]
    for start in range(0, pairs, section):  # the tiles of one section are contiguous in the order
        lo, hi = start * num_m_blocks, min(pairs, start + section) * num_m_blocks
        chunk = order[lo:hi]
        assert {p for _, p in chunk} == set(range(start, min(pairs, start + section)))
        m_blocks = [m for m, _ in chunk]
        assert m_blocks == sorted(m_blocks, reverse=True)  # the longest (last) m-blocks first
        assert m_blocks[0] == num_m_blocks - 1


def test_one_pair_per_section_is_the_per_pair_order():
    # section 1 keeps the order the kernels had before sections (and the windowed / varlen kernels keep).
    nmb, pairs = 7, 5
    assert [lpt_tile(i, nmb, pairs, 1) for i in range(nmb * pairs)] == \
        [(nmb - 1 - i % nmb, i // nmb) for i in range(nmb * pairs)]


@pytest.mark.parametrize("seqlen_k,head_dim,want", [
    (1024, 64, LPT_SECTION_MAX_PAIRS), (8192, 256, 4), (16384, 128, 4), (16384, 256, 2), (32768, 256, 1),
    (1 << 22, 256, 1), (1, 64, LPT_SECTION_MAX_PAIRS),
])
def test_section_pairs_keep_the_section_in_l2(seqlen_k, head_dim, want):
    assert lpt_section_pairs(seqlen_k, head_dim) == want
