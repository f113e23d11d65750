"""Which K/V blocks a query tile visits, and which of them need masking.

Masks are aligned to the bottom-right corner (FlashAttention convention): query row i sits at key
position i + seqlen_k - seqlen_q ("the diagonal"); a window (left, right) lets it see keys
[diag - left, diag + right]. Causal is (inf, 0); `full` sees every key. Window bounds are kernel
arguments (the handler clamps "unbounded" to a bound that covers every key), so one compiled
`local` kernel serves every window.

For a tile of rows [m_block * tile_m, (m_block + 1) * tile_m) the blocks [n_block_min, n_block_max)
hold every visible key. Processing runs from the highest block down:
  n_block_max - 1                       first block: ragged seqlen_k tail + window masks
  [n_block_right, n_block_max - 1)      right-edge (causal/local) masking
  [n_block_left, n_block_right)         no masking
  [n_block_min, n_block_left)           left-edge (local) masking
With splits (split-KV decode) each split takes an equal share of [n_block_min, n_block_max).

Pack-GQA (the KV-cache family): a tile's rows are (query, head-in-group) pairs of the q-heads that
share one KV head, row r = query * qhead_per_kv + member, so the query of row r is r // qhead_per_kv.
Every bound below is in queries (`query_lo`/`query_hi`); with qhead_per_kv = 1 (a compile-time 1, the
dense family) that is the row itself and no division is emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4_jax.kernels.seqlen import SeqlenInfo


@dataclass(frozen=True)  # frozen: usable inside a kernel's dynamic tile loop (see tile_scheduler.py)
class BlockInfo:
    tile_m: int
    tile_n: int
    mask: str  # "full" | "causal" | "local"
    seqlen: SeqlenInfo
    window_left: Int32 | None = None
    window_right: Int32 | None = None
    qhead_per_kv: Int32 | int = 1  # pack-GQA rows per query (see the module docstring)

    @staticmethod
    def create(tile_m: int, tile_n: int, mask: str, seqlen: SeqlenInfo,
               window_left: Int32 | None = None, window_right: Int32 | None = None,
               qhead_per_kv: Int32 | int = 1) -> "BlockInfo":
        if mask not in ("full", "causal", "local"):
            raise ValueError(f"unknown mask kind {mask=}")
        # Causal is a window with right = 0, known at compile time.
        return BlockInfo(tile_m, tile_n, mask, seqlen, window_left, Int32(0) if mask == "causal" else window_right,
                         qhead_per_kv)

    @property
    def packed(self) -> bool:
        return not (isinstance(self.qhead_per_kv, int) and self.qhead_per_kv == 1)

    @cute.jit
    def query_of_row(self, row: Int32) -> Int32:
        """The query index of tile row `row` (absolute: m_block * tile_m + local row)."""
        if const_expr(self.packed):
            return row // self.qhead_per_kv
        return row

    @cute.jit
    def query_lo(self, m_block: Int32) -> Int32:
        """The first query of tile m_block."""
        return self.query_of_row(m_block * self.tile_m)

    @cute.jit
    def query_hi(self, m_block: Int32) -> Int32:
        """One past the last query of tile m_block."""
        return self.query_of_row((m_block + 1) * self.tile_m - 1) + 1

    @property
    def has_right_edge(self) -> bool:
        return self.mask in ("causal", "local")

    @property
    def has_left_edge(self) -> bool:
        return self.mask == "local"

    @cute.jit
    def diag_offset(self) -> Int32:
        return self.seqlen.seqlen_k - self.seqlen.seqlen_q

    @cute.jit
    def n_block_min_max(self, m_block: Int32, split: Int32 | int = 0, num_splits: Int32 | int = 1):
        """[n_block_min, n_block_max) of this tile (and split); empty when min >= max."""
        n_max = cute.ceil_div(self.seqlen.seqlen_k, self.tile_n)
        if const_expr(self.has_right_edge):
            # Exclusive bound on the keys the tile's last row may see.
            end = self.query_hi(m_block) + self.diag_offset() + self.window_right
            n_max = cutlass.min(n_max, cute.ceil_div(cutlass.max(end, 0), self.tile_n))
        n_min = Int32(0)
        if const_expr(self.has_left_edge):
            start = self.query_lo(m_block) + self.diag_offset() - self.window_left
            n_min = cutlass.max(start, 0) // self.tile_n
        if const_expr(not (isinstance(num_splits, int) and num_splits == 1)):
            per_split = cute.ceil_div(cutlass.max(n_max - n_min, 0), num_splits)
            n_min = n_min + split * per_split
            n_max = cutlass.min(n_max, n_min + per_split)
        return n_min, n_max

    @cute.jit
    def n_block_right(self, m_block: Int32) -> Int32:
        """Blocks below this index are entirely left of (or on) every row's right edge."""
        first = self.query_lo(m_block) + self.diag_offset() + self.window_right + 1
        return cutlass.max(first, 0) // self.tile_n

    @cute.jit
    def n_block_left(self, m_block: Int32) -> Int32:
        """Blocks at or above this index are entirely right of every row's left edge."""
        last = self.query_hi(m_block) - 1 + self.diag_offset() - self.window_left
        return cute.ceil_div(cutlass.max(last, 0), self.tile_n)
