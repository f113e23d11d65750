"""Per-launch values a tile needs to find its sequence and its key blocks, for each `Seqlens` seam
(seams.py): dense extents, varlen offsets (cu_seqlens), KV-cache lengths (cache_seqlens)."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.seams import Seqlens
from fa4_jax.kernels.seqlen import SeqlenInfo


@dataclass(frozen=True)  # frozen: read inside the dynamic tile loop (see tile_scheduler.py)
class TileProblem:
    """Fields of the other seams stay None (or 1)."""

    seqlens: Seqlens
    tile_m: int
    tile_n: int
    mask: str
    window_left: Int32
    window_right: Int32
    # DENSE: every tile has the same lengths, so one BlockInfo, built once, serves them all.
    dense_blocks: BlockInfo | None = None
    # VARLEN (and ragged CACHE): tiles of batch index num_batch form a pseudo-batch over the rows no
    # sequence owns.
    mCuSeqlensQ: cute.Tensor | None = None
    mCuSeqlensK: cute.Tensor | None = None
    mSequsedK: cute.Tensor | None = None
    num_batch: Int32 | None = None
    total_q: Int32 | None = None
    num_m_blocks: Int32 | None = None
    # CACHE: pack-GQA rows (block_info.py), split-KV; ragged != 0: rows from mCuSeqlensQ into a
    # (1, total_q, h, d) q (total_q = seqlen_q), else seqlen_q rows per batch entry.
    mSeqlensK: cute.Tensor | None = None
    seqlen_q: Int32 | None = None
    ragged: Int32 | None = None
    qhead_per_kv: Int32 | int = 1
    num_splits: Int32 | int = 1
    capacity: Int32 | None = None  # keys a sequence can hold: cache_seqlens are clamped to it
    # CACHE with the combine fused (split_epilogue.merge_splits_if_last): one zeroed int32 counter per
    # (batch, KV head, m_block) tile, (batch * heads_kv + head) * num_m_blocks + m_block; extent 0:
    # the combine kernel merges the splits instead.
    mSemaphores: cute.Tensor | None = None
    heads_kv: Int32 | None = None

    @cute.jit
    def seqlen(self, batch: Int32) -> SeqlenInfo:
        if const_expr(self.seqlens is Seqlens.DENSE):
            info = self.dense_blocks.seqlen
        elif const_expr(self.seqlens is Seqlens.VARLEN):
            offset_q = self.mCuSeqlensQ[batch]
            offset_k = self.mCuSeqlensK[batch]
            # seqused_k is clamped to the sequence's own keys: a larger value must not read the
            # next sequence's (as cache_seqlens is clamped to the capacity).
            own_keys = cutlass.max(self.mCuSeqlensK[batch + 1] - offset_k, 0)
            seqlen_k = cutlass.min(cutlass.max(self.mSequsedK[batch], 0), own_keys)
            info = SeqlenInfo(self.mCuSeqlensQ[batch + 1] - offset_q, seqlen_k, offset_q, offset_k)
        else:
            info = self.cache_seqlen(batch)
        return info

    @cute.jit
    def cache_seqlen(self, batch: Int32) -> SeqlenInfo:
        """CACHE: batch < num_batch is a sequence (its keys clamped to the capacity); ragged, batch ==
        num_batch is the pseudo-batch of the rows past cu_seqlens_q[num_batch] (no keys)."""
        seqlen_k = Int32(0)
        if batch < self.num_batch:
            seqlen_k = cutlass.max(cutlass.min(self.mSeqlensK[batch], self.capacity), 0)
        seqlen_q, offset_q, batch_q = self.seqlen_q, Int32(0), batch
        if self.ragged != 0:
            # Offsets are clamped into [0, total_q]: a broken contract must not address outside q / o.
            offset_q = cutlass.min(cutlass.max(self.mCuSeqlensQ[batch], 0), self.seqlen_q)
            end = self.seqlen_q
            if batch < self.num_batch:
                end = cutlass.min(cutlass.max(self.mCuSeqlensQ[batch + 1], offset_q), self.seqlen_q)
            seqlen_q, batch_q = end - offset_q, Int32(0)
        return SeqlenInfo(seqlen_q, seqlen_k, offset_q, 0, batch_q)

    @cute.jit
    def has_rows(self, work, seqlen: SeqlenInfo):
        """Whether tile `work` holds any of its sequence's rows (a grid sized by max_seqlen_q has
        tiles past shorter sequences' ends)."""
        return work.m_block * self.tile_m < seqlen.seqlen_q * self.qhead_per_kv

    @cute.jit
    def blocks(self, seqlen: SeqlenInfo) -> BlockInfo:
        if const_expr(self.seqlens is Seqlens.DENSE):
            return self.dense_blocks
        return BlockInfo.create(self.tile_m, self.tile_n, self.mask, seqlen, self.window_left, self.window_right,
                                self.qhead_per_kv)

    @cute.jit
    def n_block_range(self, blocks: BlockInfo, work):
        """[n_block_min, n_block_max) of the tile (and its split)."""
        return blocks.n_block_min_max(work.m_block, work.split, self.num_splits)

    @cute.jit
    def fused_combine(self):
        """CACHE: whether the last split CTA of each tile merges the tile's splits itself (not for a
        ragged batch: its pseudo-batch rows belong to no tile's counter; the handler never asks)."""
        return self.num_splits > 1 and self.mSemaphores.shape[0] > 0 and self.ragged == 0
