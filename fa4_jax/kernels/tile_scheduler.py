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

`TileHandout` (dense kernels with a zero-at-rest counter from the handler, ffi/fwd.cc): the same tile
order, but a persistent grid takes its tiles from the counter, each CTA its next one as it
finishes one, so CTAs stay busy to the end whatever the tiles' lengths (causal, windows), and each
CTA's next Q and K/V stream in under its current tile's last blocks and epilogue, which one CTA per
tile (the hardware's handout) cannot overlap.

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

from fa4_jax.kernels.named_barrier import NamedBarrierFwd
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


@dataclass(frozen=True)
class TileHandout:
    """Tiles handed out from a global counter (mCounter (1,), zero between launches; shape (0,): off,
    each CTA walks its static sequence, StaticPersistentTileScheduler.next). The grid's first tiles
    are its CTAs' indices; each further tile index is grid + the counter's value before an increment.
    The producer warp takes it (one atomic per tile), so its loads of that tile can start while the
    consumers are still on the current one, and passes it to the consumers through shared memory
    (sNext) with two named barriers: TILE_FULL (written) and TILE_EMPTY (read by every consumer, so it
    may be overwritten). Every CTA takes indices until it gets one past the last tile: `total`
    increments in all, and the one that returns total - 1 is the launch's last, which puts the
    counter back to zero. With producer_warps > 1 (paged copies spread over the producer warpgroup)
    warp 0 takes the indices and the other producer warps read them as the consumers do
    (consumers_begin, consumer_next)."""

    mCounter: cute.Tensor  # (n,) int32, n = 0 or 1
    sNext: cute.Tensor | None  # (1,) int32 shared memory
    total: Int32
    consumer_threads: int
    producer_warps: int = 1

    @property
    def _threads(self) -> int:
        return self.consumer_threads + 32 * self.producer_warps  # the consumers and the producer warps

    @cute.jit
    def consumers_begin(self):
        """The consumers' first TILE_EMPTY arrival: the slot starts out free (every later one follows a
        read)."""
        if self.mCounter.shape[0] > 0:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.TILE_EMPTY), number_of_threads=self._threads)

    @cute.jit
    def producer_next(self, idx: Int32) -> Int32:
        """The producer warp's next tile index (all 32 lanes call this)."""
        nxt = idx + Int32(cute.arch.grid_dim()[0])
        if self.mCounter.shape[0] > 0:
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.TILE_EMPTY), number_of_threads=self._threads)
            taken = Int32(0)
            if cute.arch.lane_idx() == 0:
                ptr = self.mCounter.iterator.llvm_ptr
                taken = cute.arch.atomic_add(ptr, Int32(1), sem="relaxed", scope="gpu")
                if taken == self.total - 1:
                    # The launch's last increment: nobody reads the counter again in this launch.
                    cute.arch.atomic_exch(ptr, Int32(0), sem="relaxed", scope="gpu")
            nxt = cute.arch.shuffle_sync(taken, 0) + Int32(cute.arch.grid_dim()[0])
            if cute.arch.lane_idx() == 0:
                self.sNext[0] = nxt
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.TILE_FULL), number_of_threads=self._threads)
        return nxt

    @cute.jit
    def consumer_next(self, idx: Int32) -> Int32:
        """A consumer thread's next tile index (every consumer thread calls this, after its tile)."""
        nxt = idx + Int32(cute.arch.grid_dim()[0])
        if self.mCounter.shape[0] > 0:
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.TILE_FULL), number_of_threads=self._threads)
            nxt = self.sNext[0]
            if nxt < self.total:  # the producer writes again only for another tile
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.TILE_EMPTY), number_of_threads=self._threads)
        return nxt
