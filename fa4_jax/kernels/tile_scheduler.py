"""Tile schedulers: which (m_block, head, batch[, split]) tiles a CTA works on.

Every scheduler has a host half (`grid(...)`, the launch grid) and a device half (`first()`,
`next(idx)`, `tile(idx)`: a CTA walks tile indices from `first()` while they are below `total`). The grid is
one-dimensional: gridDim.x allows 2^31 - 1 CTAs, whereas gridDim.y and .z stop at 65535, which batch
or heads easily pass (vmap folds its axis into the batch; decode multiplies batch x heads x splits).

`StaticPersistentTileScheduler`: min(tiles, max_ctas) CTAs, CTA c takes tiles c, c + grid, ...;
the kernel overlaps one tile's epilogue with the next tile's loads. With max_ctas >= tiles it is the
plain one-CTA-per-tile launch. Tile indices run m-blocks fastest, so that the CTAs working at the
same time share one (head, batch)'s K/V in L2; `lpt` (causal and windowed masks) walks m-blocks from
the last one, which sees the most keys (longest processing time first shortens the tail). With
`lpt_section` > 1 (dense causal tiles, `lpt_section_pairs`) the (head, batch) pairs go in sections of
that many, and within a section m-blocks run slowest: all of the section's last m-blocks first, so the
longest tiles of every pair start early and the short ones fill the tail, while the K/V the CTAs
read at one time (a section's) still fit in L2. (Measured on the H200, hd256 causal 8k: 1.06-1.08x;
one section for all pairs instead, L2 thrashes: 0.82-0.94x at 1k; docs/PERF.md.)

A tile list (ragged KV-cache calls, ops/kvcache/tiles.py) replaces the (m_block, batch) part of the
index: tile t of the list is (mTileList[2t], mTileList[2t + 1]) = (batch, m_block), with heads and
splits fastest, so all of one listed (sequence, m_block)'s work starts together, in list order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4_jax.kernels.tile_order import lpt_tile


# Frozen dataclasses throughout: the DSL drops read-only frozen dataclasses from the values a
# dynamic loop carries, so kernels can use these objects inside their tile loops.
@dataclass(frozen=True)
class WorkTile:
    """The coordinates of one tile of work."""

    m_block: Int32
    head: Int32
    batch: Int32
    split: Int32


class TileScheduler(Protocol):
    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch, max_ctas, num_splits=1) -> tuple: ...

    def first(self) -> Int32: ...

    def next(self, idx: Int32) -> Int32: ...

    def tile(self, idx: Int32) -> WorkTile: ...


@dataclass(frozen=True)
class StaticPersistentTileScheduler:
    num_m_blocks: Int32
    num_heads: Int32
    total: Int32  # tiles in all
    num_splits: Int32 | int = 1
    lpt: bool = False
    mTileList: cute.Tensor | None = None  # (2 * n_listed,) int32 (batch, m_block) pairs
    n_listed: Int32 | None = None  # > 0: tiles come from mTileList
    lpt_section: Int32 | int = 1  # lpt: (head, batch) pairs per longest-first section (lpt_tile)

    @staticmethod
    def create(num_m_blocks: Int32, num_heads: Int32, num_batch: Int32, num_splits: Int32 | int = 1,
               lpt: bool = False, mTileList: cute.Tensor | None = None,
               n_listed: Int32 | None = None, lpt_section: Int32 | int = 1) -> "StaticPersistentTileScheduler":
        total = num_m_blocks * num_heads * num_batch * num_splits
        if const_expr(mTileList is not None):
            listed = cutlass.min(n_listed, 1)
            total = listed * n_listed * num_heads * num_splits + (1 - listed) * total
        return StaticPersistentTileScheduler(num_m_blocks, num_heads, total, num_splits, lpt, mTileList, n_listed,
                                             lpt_section)

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch, max_ctas, num_splits=1) -> tuple:
        total = num_m_blocks * num_heads * num_batch * num_splits
        return (cutlass.min(total, max_ctas), 1, 1)

    @cute.jit
    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    @cute.jit
    def next(self, idx: Int32) -> Int32:
        return idx + Int32(cute.arch.grid_dim()[0])

    @cute.jit
    def tile(self, idx: Int32) -> WorkTile:
        m_block = idx % self.num_m_blocks
        rest = idx // self.num_m_blocks
        split = Int32(0)
        if const_expr(not (isinstance(self.num_splits, int) and self.num_splits == 1)):
            split = rest % self.num_splits
            rest = rest // self.num_splits
        head = rest % self.num_heads
        batch = rest // self.num_heads
        if const_expr(self.lpt and isinstance(self.lpt_section, int) and self.lpt_section == 1):
            # lpt_tile with section 1, without its divisions (the windowed and varlen kernels' code)
            m_block = self.num_m_blocks - 1 - m_block
        elif const_expr(self.lpt):  # (no splits: the dense and varlen kernels)
            m_block, pair = lpt_tile(idx, self.num_m_blocks, self.total // self.num_m_blocks, self.lpt_section,
                                     hi=cutlass.min)
            head = pair % self.num_heads
            batch = pair // self.num_heads
        if const_expr(self.mTileList is not None):
            if self.n_listed > 0:
                rest = idx
                if const_expr(not (isinstance(self.num_splits, int) and self.num_splits == 1)):
                    split = rest % self.num_splits
                    rest = rest // self.num_splits
                head = rest % self.num_heads
                t = rest // self.num_heads
                batch = self.mTileList[2 * t]
                m_block = self.mTileList[2 * t + 1]
        return WorkTile(m_block, head, batch, split)
