"""Masking of the scores inside boundary blocks (see block_info.py for which blocks those are).

Keys past seqlen_k are always masked (TMA zero-fills them, but a zero score is not "no key").
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.utils import acc_as_mn


@dataclass(frozen=True)  # frozen: usable inside a kernel's dynamic tile loop (see tile_scheduler.py)
class ScoreMask:
    """Sets masked scores of one accumulator tile to -inf, for the thread's own elements."""

    blocks: BlockInfo
    tScS_mn: cute.Tensor  # (row, col) coordinates of this thread's accumulators, as acc_as_mn(tScS)

    @staticmethod
    def create(blocks: BlockInfo, tScS: cute.Tensor) -> "ScoreMask":
        return ScoreMask(blocks, acc_as_mn(tScS))

    @cute.jit
    def apply(self, acc_S: cute.Tensor, m_block, n_block, seqlen: cutlass.Constexpr[bool],
              window: cutlass.Constexpr[bool]):
        """seqlen: mask keys >= seqlen_k; window: mask outside each row's [left, right] edges."""
        b = self.blocks
        tile_m, tile_n = b.tile_m, b.tile_n
        s_mn = acc_as_mn(acc_S)
        col_base = n_block * tile_n
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            # Exclusive upper and inclusive lower column bound for this row, relative to col_base.
            hi = b.seqlen.seqlen_k - col_base
            lo = 0
            if const_expr(window and b.has_right_edge):
                query = b.query_of_row(m_block * tile_m + self.tScS_mn[r, 0][0])
                diag = query + b.diag_offset() - col_base
                right = diag + b.window_right + 1
                hi = cutlass.min(hi, right) if const_expr(seqlen) else right
                if const_expr(b.has_left_edge):
                    lo = diag - b.window_left
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                col = self.tScS_mn[r, c][1]
                if const_expr(window and b.has_left_edge):
                    s_mn[r, c] = -Float32.inf if (col >= hi or col < lo) else s_mn[r, c]
                else:
                    s_mn[r, c] = -Float32.inf if col >= hi else s_mn[r, c]
