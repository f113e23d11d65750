"""Which K/V blocks a query tile visits, and masking of the scores inside boundary blocks.

Causal masking is bottom-right aligned (FlashAttention convention): query i sees key j iff
j <= i + seqlen_k - seqlen_q. Keys past seqlen_k are always masked (TMA zero-fills them).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_jax.kernels.utils import acc_as_mn


class BlockRange:
    """K/V block bounds for one query tile (m_block). Built inside the kernel."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool, seqlen_q: Int32, seqlen_k: Int32):
        self.tile_m, self.tile_n, self.causal = tile_m, tile_n, causal
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k

    @cute.jit
    def n_block_max(self, m_block: Int32) -> Int32:
        """One past the last K/V block any row of the tile may see (0: the tile sees no key)."""
        n_max = (self.seqlen_k + self.tile_n - 1) // self.tile_n
        if const_expr(self.causal):
            # Exclusive bound on visible keys for the tile's last row.
            last = (m_block + 1) * self.tile_m + self.seqlen_k - self.seqlen_q
            last = cutlass.max(last, 0)
            n_max = cutlass.min(n_max, (last + self.tile_n - 1) // self.tile_n)
        return n_max

    @cute.jit
    def n_block_causal_min(self, m_block: Int32) -> Int32:
        """Blocks at or above this index may hold keys hidden from some row of the tile: they need
        the causal mask; blocks below it are fully visible to every row."""
        first = m_block * self.tile_m + self.seqlen_k - self.seqlen_q + 1
        return cutlass.max(first, 0) // self.tile_n


class ScoreMask:
    """Applies -inf to masked scores of one accumulator tile, for the thread's own elements."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool, seqlen_q: Int32, seqlen_k: Int32,
                 tScS: cute.Tensor):
        self.tile_m, self.tile_n, self.causal = tile_m, tile_n, causal
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.tScS_mn = acc_as_mn(tScS)  # (row, col) coordinates of this thread's accumulators

    @cute.jit
    def apply(self, acc_S: cute.Tensor, m_block: Int32, n_block: Int32,
              seqlen: cutlass.Constexpr[bool], causal: cutlass.Constexpr[bool]):
        s_mn = acc_as_mn(acc_S)
        col_base = n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            limit = self.seqlen_k - col_base  # exclusive column bound within this block
            if const_expr(causal):
                row = m_block * self.tile_m + self.tScS_mn[r, 0][0]
                causal_limit = row + 1 + self.seqlen_k - self.seqlen_q - col_base
                limit = cutlass.min(limit, causal_limit) if const_expr(seqlen) else causal_limit
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[r, c] = -Float32.inf if self.tScS_mn[r, c][1] >= limit else s_mn[r, c]
