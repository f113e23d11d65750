"""Shared-memory bank arithmetic for the layout tests (test_fp8_decode_layout.py,
test_fp8_widen_layout.py): how many wavefronts one warp-wide access takes."""

from __future__ import annotations


def wavefronts(addrs, width):
    """Shared-memory wavefronts of one warp-wide access of `width` bytes per lane at byte addresses
    `addrs` (one per lane): lanes go in phases of 128 bytes; within a phase, distinct 4-byte words in
    one bank serialise."""
    per_phase = 128 // width
    total = 0
    for p in range(0, 32, per_phase):
        banks = {}
        for a in addrs[p:p + per_phase]:
            for w in range(a // 4, (a + width) // 4):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(s) for s in banks.values())
    return total
