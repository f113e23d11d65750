"""Tile orders as plain integer arithmetic, shared by the device code (tile_scheduler.py passes the
DSL's Int32 values and cutlass.min / cutlass.max) and the CPU tests (Python ints, min / max): no
cutlass import here."""

from __future__ import annotations

# Dense causal tiles: (head, batch) pairs per longest-first section, as many as keep the section's K and
# V within this many bytes of L2 (the H100/H200 have 50 MB), and at most LPT_SECTION_MAX_PAIRS (what
# was measured on the H200: sections of 4 pairs gained 2-9% at 4k-8k and cost nothing at 1k; one
# section of every pair lost 6-20% at 1k-4k, its K/V no longer in L2; docs/PERF.md 2026-12-03).
LPT_SECTION_L2_BYTES = 32 * 1024 * 1024
LPT_SECTION_MAX_PAIRS = 4


def lpt_section_pairs(seqlen_k, head_dim: int, elem_bytes: int = 2, lo=max, hi=min):
    """(head, batch) pairs per longest-first section for keys of seqlen_k x head_dim (K and V). Plain
    arithmetic: device code passes lo=cutlass.max, hi=cutlass.min and an Int32 seqlen_k."""
    fit = (LPT_SECTION_L2_BYTES // (2 * elem_bytes * head_dim)) // seqlen_k
    return lo(1, hi(LPT_SECTION_MAX_PAIRS, fit))


def lpt_tile(idx, num_m_blocks, pairs, section, hi=min):
    """(m_block, pair) of tile `idx` in the sectioned longest-first order: sections of `section`
    (head, batch) pairs (the last one may hold fewer), m-blocks from the last, slowest within a
    section. section 1 is the per-pair order (m-blocks fastest, from the last). Plain arithmetic,
    shared by the device code (hi=cutlass.min) and the tests."""
    per_section = section * num_m_blocks
    s = idx // per_section
    first = s * section
    n = hi(section, pairs - first)
    j = idx - s * per_section
    return num_m_blocks - 1 - j // n, first + j % n
