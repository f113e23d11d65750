"""Where each thread of the FP8 decode tile (decode_fp8_sm90.py) finds its operands: plain Python, the
arithmetic the kernel traces and tests/test_fp8_decode_layout.py checks on the CPU (bijections, and
shared-memory bank conflicts under the stages' swizzle).

The tile swaps the gemms' operands: S^T = K Q^T and O^T = V^T P^T on the warp's synchronous mma
(m16n8k16), so that keys and head-dim columns are the M side, which comes from registers -- each
FP8 byte goes shared memory -> register -> fp16 (cvt) -> tensor core, never back to shared memory --
and the few packed query rows (TILE_M) are the N side. Each of the WARPS consumer warps takes 16 keys
of every TILE_N-key stage and keeps its own online softmax; the warps merge at the end of the tile.

Both gemms sum over an index whose order is free as long as both operands agree:
- QK^T sums over the head dim. Logical column j (0..15) of k-step s is physical column
  `qk_column(s, j)`: thread quad q's columns of four consecutive k-steps are 16 consecutive bytes of
  a K row, one 16-byte load (and the same for Q, loaded once per tile).
- PV sums over the block's keys. Logical key m (0..15) of a warp's 16 is physical row `key_row(hd, m)`
  of the warp's 16: ordered so that the eight lanes of a 16-byte load phase hit eight different
  16-byte bank groups under the swizzle.
O^T's rows (head-dim columns of O) are free too: lane group g holds columns `v_chunk(hd, g)` *
head_dim / 8 onwards, head_dim / 8 consecutive bytes of each V row (one load per key).
"""

from __future__ import annotations

from fa4_jax.ops.kvcache.spec import FP8_DECODE_TILE_M

TILE_M = FP8_DECODE_TILE_M  # packed query rows per tile: N of the mma (two n8 halves)
TILE_N = 64  # keys per K/V stage
WARPS = 4  # consumer warps, 16 keys of each stage each
KEYS_PER_WARP = TILE_N // WARPS
HEAD_DIMS = (64, 128)

# Physical key (row of the warp's 16) of logical key m % 8, per head dim: rows that share a load phase
# land in different bank groups (the search in the test finds no conflict left).
_KEY_ORDER = {128: (0, 4, 1, 5, 2, 6, 3, 7), 64: (0, 1, 2, 3, 5, 4, 7, 6)}
# Which head_dim / 8 chunk of a V row lane group g (lane // 4) holds.
_V_CHUNK = {128: (0, 4, 1, 5, 2, 6, 3, 7), 64: (0, 4, 1, 5, 2, 6, 3, 7)}


def key_row(head_dim: int, m):
    """The row, within the warp's 16 keys, of logical key m (0..15; a Python or a DSL integer: bit
    arithmetic only, _KEY_ORDER's table as a formula)."""
    low = m & 7
    if head_dim == 128:
        low = (low >> 1) | ((low & 1) << 2)
    else:
        low = low ^ ((low >> 2) & 1)
    return low | (m & 8)


def v_chunk(head_dim: int, g):
    """The head_dim / 8-byte chunk of each V row that lane group g (0..7) holds (_V_CHUNK's table)."""
    return (g >> 1) | ((g & 1) << 2)


def qk_column(s: int, j: int) -> int:
    """The physical head-dim column of logical column j (0..15) of QK^T's k-step s: quad q = (j % 8) // 2
    holds bytes [64 (s // 4) + 16 q, + 16), k-step s % 4's four of them at 4 (s % 4): j % 2 and
    j // 8 pick one of the four (the mma's columns 2q, 2q+1, 2q+8, 2q+9)."""
    q = (j % 8) // 2
    return 64 * (s // 4) + 16 * q + 4 * (s % 4) + (j % 2) + 2 * (j // 8)


def o_column(head_dim: int, i: int, g: int, half: int) -> int:
    """The head-dim column of O^T's row g + 8 half of m-tile i (0..head_dim/16-1) for lane group g."""
    return v_chunk(head_dim, g) * (head_dim // 8) + 2 * i + half


def swizzle(head_dim: int, offset: int) -> int:
    """The swizzled byte offset of an FP8 stage element: CuTe's Hopper K-major atoms for 1-byte
    elements, 128-byte rows (Swizzle<3,4,3>) at head_dim 128, 64-byte rows (Swizzle<2,4,3>) at 64. The
    kernel checks this against the stage's layout when it compiles."""
    if head_dim == 128:
        return offset ^ (((offset >> 7) & 7) << 4)
    if head_dim == 64:
        return offset ^ (((offset >> 7) & 3) << 4)
    raise ValueError(f"no FP8 decode tile at {head_dim=}")


def stage_smem_bytes(head_dim: int, stages: int) -> int:
    """K and V stages of FP8 bytes."""
    return 2 * stages * TILE_N * head_dim


def merge_row_stride(head_dim: int) -> int:
    """Floats per row of a warp's partial O in the merge buffer: padded by 4 so that the rows a store
    phase writes start in different banks."""
    return head_dim + 4


def merge_smem_bytes(head_dim: int) -> int:
    """The end-of-tile merge buffer: each warp's partial O (TILE_M rows), row max and row sum."""
    return 4 * WARPS * TILE_M * (merge_row_stride(head_dim) + 2)
