"""A row's visible keys as bit masks over a thread's SM90 accumulators (mask.py), as plain integer
arithmetic shared by the device code (mask.py passes the DSL's Int32 values, cutlass.max / min and a
PTX shift) and the CPU tests (Python ints, max / min and a model of the shift): no cutlass import here.

A thread holds, per row, the accumulators at columns first + wgmma_column_offset(c), c = 0, 1, ...:
pairs of adjacent columns, one pair per 8-column group (first = 2 * (lane % 4)). The offsets rise with
c, so "column < bound" holds for a prefix of the registers and "column >= bound" for a suffix, and
each is one count.
"""

from __future__ import annotations

BITS = 32  # registers per mask word


def wgmma_column_offset(c: int) -> int:
    """Column of a thread's c-th accumulator in a row, past its first."""
    return 8 * (c // 2) + c % 2


def registers_left_of(limit, lo=max, hi=min):
    """How many of a thread's accumulators in a row lie at column offsets < limit: two per full
    8-column group, then up to two more; 0 for limit <= 0."""
    lim = lo(limit, 0)
    return (lim >> 3) * 2 + hi(lim & 7, 2)


def keep_bits(keep_lo, keep_hi, word: int, lower: bool, shl, lo=max):
    """Bit i set for register word * BITS + i in [keep_lo, keep_hi) ([0, keep_hi) unless `lower`).
    shl(x, n) is a 32-bit shift left that gives 0 for n >= 32 (PTX's shl.b32; C leaves it undefined),
    so a word wholly below keep_hi becomes all ones (0 - 1) and one wholly below keep_lo all zeros."""
    bits = shl(1, lo(keep_hi - word * BITS, 0)) - 1
    if lower:
        bits = bits & shl(0xFFFFFFFF, lo(keep_lo - word * BITS, 0))
    return bits
