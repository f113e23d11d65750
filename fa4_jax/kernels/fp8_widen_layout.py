"""Where the producer warps of the FP8 chunk tile (fwd_sm90.py, widen_rows) read FP8 bytes and write
their fp16 values: plain Python, the address arithmetic the kernel traces (on DSL integers: shifts,
masks and xor only) and tests/test_fp8_widen_layout.py checks on the CPU (every element once, no
shared-memory bank conflict). The kernel checks both formulas against CuTe's layouts of the stages
when it compiles.

The tile's widening warps (a warpgroup of its own, one warp per SM sub-partition) share each block by
rows: warp w takes rows [w R, (w + 1) R), R the rows per warp rounded up to the swizzles' 8-row period
(the last warp may have fewer: none at tile_n 128). Within its rows a
warp copies as CuTe's row_thread_layout of 32 threads would: head_dim / 8 lanes per row, 8 elements
(8 FP8 bytes in, 16 fp16 bytes out) per lane, 32 / (head_dim / 8) rows per pass. Because a warp's
first row is a multiple of 8, its addresses are one runtime base plus per-lane offsets that repeat
every 8 rows (PERIOD_ROWS) plus compile-time constants: few registers, which the 40-register
widening warps need (CuTe's copies kept one address register per pass: a 64-136 byte stack frame).
"""

from __future__ import annotations

from fa4_jax.kernels.fp8_decode_layout import swizzle as fp8_swizzle

HEAD_DIMS = (64, 128)  # the FP8 swizzles fp8_offset knows (fp8_decode_layout.swizzle)
WARPS = 4  # widening warps: the chunk tile's widening warpgroup (Sm90FwdConfig.widen_wg)
PERIOD_ROWS = 8  # both swizzles repeat every 8 rows
F16_HALF_COLS = 64  # an fp16 swizzle atom is 64 columns wide
F16_ROW_BYTES = 2 * F16_HALF_COLS  # ... so a widened stage's rows are 128 bytes (per 64-column half)
ELEMS = 8  # elements per lane and copy
# Rows a warp loads before it converts and stores them (8 loads per lane at head_dim 128, 4 at 64: the
# 40-register widening warps hold them); a round past the block's end is skipped, so a warp's rows and the
# block's are multiples of it.
ROUND_ROWS = 16


def rows_per_warp(tile_n: int, warps: int) -> int:
    """Rows of a block each widening warp takes (a multiple of PERIOD_ROWS)."""
    return -(-tile_n // (PERIOD_ROWS * warps)) * PERIOD_ROWS


def lanes_per_row(head_dim: int) -> int:
    return head_dim // ELEMS


def rows_per_pass(head_dim: int) -> int:
    return 32 // lanes_per_row(head_dim)


def lane_position(head_dim: int, lane):
    """(row within the pass, first column) of a lane."""
    tpr = lanes_per_row(head_dim)
    return lane // tpr, (lane % tpr) * ELEMS


def fp8_offset(head_dim: int, row, col):
    """Byte offset of FP8 element (row, col) in a stage (CuTe's Hopper K-major atom for 1-byte
    elements, rows of head_dim bytes)."""
    return fp8_swizzle(head_dim, row * head_dim + col)


def f16_offset(tile_n: int, row, col):
    """Byte offset of fp16 element (row, col) in a widened stage: 64-column halves of tile_n rows of
    128 bytes one after the other, each Swizzle<3,4,3> on bytes (CuTe's 128-byte K-major atom)."""
    x = row * F16_ROW_BYTES + (col % F16_HALF_COLS) * 2
    return (col // F16_HALF_COLS) * tile_n * F16_ROW_BYTES + (x ^ (((x >> 7) & 7) << 4))


def fp8_stage_bytes(tile_n: int, head_dim: int) -> int:
    return tile_n * head_dim


def f16_stage_bytes(tile_n: int, head_dim: int) -> int:
    return tile_n * head_dim * 2


def passes(tile_n: int, head_dim: int, warps: int) -> int:
    """Passes of the warp with the most rows."""
    return rows_per_warp(tile_n, warps) // rows_per_pass(head_dim)


def period(head_dim: int) -> int:
    """Passes after which a lane's offsets repeat (shifted by PERIOD_ROWS rows)."""
    return PERIOD_ROWS // rows_per_pass(head_dim)


def element_of(tile_n: int, head_dim: int, warps: int, warp: int, lane: int, i: int):
    """(row, first column) a lane of a warp copies at pass i (None past the block's rows)."""
    r, col = lane_position(head_dim, lane)
    row = warp * rows_per_warp(tile_n, warps) + i * rows_per_pass(head_dim) + r
    return (row, col) if row < tile_n else None
