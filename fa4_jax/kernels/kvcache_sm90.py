"""KV-cache attention for Hopper (SM90), CuTe DSL: pack-GQA, split-KV, contiguous or paged cache.
Build time only.

The inner loop is the dense kernel's (fwd_sm90.py: TMA producer warp, register-sourced PV wgmma,
intra-warpgroup overlap, masks from block_info.py); what differs is who a tile is and where its data
lives:
- Pack-GQA: a tile is (m_block, kv head, batch, split). Its TILE_M rows are the (query, q-head)
  pairs of the q-heads that share the KV head, row = query * qhead_per_kv + member, so each K/V
  block is read once for the whole group instead of once per q-head (decode with 32 q-heads over 8
  KV heads: 4 rows of one tile instead of 4 tiles). The row-to-(query, head) map is a runtime
  division, so Q is gathered row by row with cp.async (not one TMA box) and O/LSE are stored from
  registers with per-row addresses.
- Split-KV: when there are too few tiles to fill the GPU (decode: batch x heads_kv CTAs), each
  sequence's key blocks are divided over `num_splits` CTAs. Every split writes its normalised O and
  its LSE (float32) to a workspace; a combine kernel, launched by the same exported function right
  after, merges them: o = sum_s exp(lse_s - lse) o_s with lse = log(sum_s exp(lse_s) + exp(sink)).
  Sinks join only there (a split must not count them). With num_splits == 1 the attention kernel
  writes o and lse itself and the combine kernel is not launched.
- Per-sequence lengths: seqlen_k = cache_seqlens[b], clamped to [0, capacity] (capacity = cache
  length, or max_pages * page_size), so a bad length reads no memory outside the cache.
- Paged cache (k_cache (num_pages, page_size, h_k, d)): K/V blocks are gathered by TMA in
  PAGE_ROWS-row pieces, each from the page the page table names (page_size is a runtime value,
  any multiple of PAGE_ROWS); page ids are clamped to [0, num_pages).
- One CTA per tile (no persistence): decode tiles are uniform and short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.fwd_sm90 import FlashAttentionForwardSm90
from fa4_jax.kernels.mask import ScoreMask
from fa4_jax.kernels.named_barrier import NamedBarrierFwd
from fa4_jax.kernels.seqlen import SeqlenInfo
from fa4_jax.kernels.softmax import OnlineSoftmax
from fa4_jax.kernels.tile_scheduler import StaticPersistentTileScheduler
from fa4_jax.kernels.utils import acc_as_mn, permute_modes

_LOG2E = 1.4426950408889634
# Rows of one paged TMA piece: the smallest supported page size (fa4_jax._validation.PAGE_SIZES).
PAGE_ROWS = 16
# Combine kernel: one warp per output row, four rows per CTA.
COMBINE_ROWS_PER_CTA = 4


class FlashAttentionKVCacheSm90(FlashAttentionForwardSm90):
    # A cache's slots past cache_seqlens[b] (and the pages they map to) hold anything: see
    # FlashAttentionForwardSm90.CLEAR_V_TAIL.
    CLEAR_V_TAIL = True

    def __init__(self, cfg, mask: str, softcap: bool, paged: bool):
        super().__init__(cfg, mask, softcap)
        self.paged = paged
        if cfg.num_consumer_wg != 1 or cfg.warpgroup_pingpong or cfg.separate_o:
            raise ValueError("the KV-cache kernel uses one consumer warpgroup, no ping-pong, no O staging")
        if paged and cfg.tile_n % PAGE_ROWS:
            raise ValueError(f"paged tiles need tile_n % {PAGE_ROWS} == 0: {cfg.tile_n=}")

    # ------------------------------------------------------------------------------------------
    # Host side.
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h_q, d)
        mK: cute.Tensor,  # contiguous (b, capacity, h_k, d) | paged (num_pages, page_size, h_k, d)
        mV: cute.Tensor,
        mPageTable: cute.Tensor,  # (b, max_pages) int32 (paged only)
        mSeqlensK: cute.Tensor,  # (b,) int32
        mO: cute.Tensor,  # (b, s_q, h_q, d)
        mLSE: cute.Tensor,  # (b, h_q, s_q) float32
        mOaccum: cute.Tensor,  # (splits_cap, b, s_q, h_q, d) float32
        mLSEaccum: cute.Tensor,  # (splits_cap, b, h_q, s_q) float32
        mSinks: cute.Tensor,  # (h_q,) float32, -inf = none
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        dtype = mQ.element_type
        if const_expr(not (dtype == mK.element_type == mV.element_type == mO.element_type)):
            raise TypeError("q, k, v and o must share one dtype")
        # K/V: (rows, d, h_k, batch-or-page) for TMA, head_dim contiguous.
        mK, mV = [permute_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]

        tiled_mma_qk, tiled_mma_pv = self.make_tiled_mmas(dtype, 1)
        sQ_layout, sKV_layout = self.make_smem_layouts(dtype)
        kv_tile = cute.select(sKV_layout, mode=[0, 1])
        # A paged block is tile_n / PAGE_ROWS TMA pieces, each into its rows of the stage's tile.
        box_rows = PAGE_ROWS if const_expr(self.paged) else cfg.tile_n
        kv_box = cute.composition(kv_tile, (box_rows, cfg.head_dim)) if const_expr(self.paged) else kv_tile
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, kv_box, (box_rows, cfg.head_dim), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, kv_box, (box_rows, cfg.head_dim), 1)
        self.kv_bytes = cute.size_in_bytes(dtype, kv_tile)

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]

        self.shared_storage = SharedStorage

        qhead_per_kv = mQ.shape[2] // mK.shape[2]
        num_m_blocks = cute.ceil_div(mQ.shape[1] * qhead_per_kv, cfg.tile_m)
        # One CTA per tile: "max_ctas" = every tile.
        total = num_m_blocks * mK.shape[2] * mQ.shape[0] * num_splits
        self.kernel(
            mQ, tma_K, tma_V, mPageTable, mSeqlensK, mO, mLSE, mOaccum, mLSEaccum, mSinks,
            tma_atom_K, tma_atom_V, softmax_scale_log2, softcap_prescale, window_left, window_right,
            num_splits, mK.shape[0], sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv,
        ).launch(
            grid=StaticPersistentTileScheduler.grid(num_m_blocks, mK.shape[2], mQ.shape[0], total, num_splits),
            block=[cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )
        if num_splits > 1:
            rows = mQ.shape[0] * mQ.shape[1] * mQ.shape[2]
            self.combine(mOaccum, mLSEaccum, mO, mLSE, mSinks, num_splits).launch(
                grid=[cute.ceil_div(rows, COMBINE_ROWS_PER_CTA), 1, 1],
                block=[32 * COMBINE_ROWS_PER_CTA, 1, 1],
                stream=stream,
            )

    # ------------------------------------------------------------------------------------------
    # Attention kernel.
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPageTable: cute.Tensor,
        mSeqlensK: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOaccum: cute.Tensor,
        mLSEaccum: cute.Tensor,
        mSinks: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,
        kv_len: Int32,  # contiguous: capacity; paged: page_size
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        _, pipe_k, pipe_v = self.make_pipelines(storage, with_q=False)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)

        qhead_per_kv = mQ.shape[2] // mK.shape[2]
        num_m_blocks = cute.ceil_div(mQ.shape[1] * qhead_per_kv, cfg.tile_m)
        scheduler = StaticPersistentTileScheduler.create(num_m_blocks, mK.shape[2], mQ.shape[0], num_splits)
        ctx = _TileContext(mSeqlensK, mQ.shape[1], qhead_per_kv, window_left, window_right, num_splits,
                           kv_len * (mPageTable.shape[1] if const_expr(self.paged) else 1))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                self.load_kv(mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, pipe_k, pipe_v,
                             scheduler, ctx, kv_len)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume_kv(mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv,
                            pipe_k, pipe_v, softmax_scale_log2, softcap_prescale, scheduler, ctx)

    @cute.jit
    def blocks_of(self, ctx, batch: Int32) -> BlockInfo:
        seqlen_k = cutlass.max(cutlass.min(ctx.mSeqlensK[batch], ctx.capacity), 0)
        return BlockInfo.create(self.cfg.tile_m, self.cfg.tile_n, self.mask, SeqlenInfo(ctx.seqlen_q, seqlen_k),
                                ctx.window_left, ctx.window_right, ctx.qhead_per_kv)

    @cute.jit
    def load_kv(self, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, pipe_k, pipe_v,
                scheduler: StaticPersistentTileScheduler, ctx, kv_len):
        """Producer warp: K_j / V_j from block n_block_max - 1 down to n_block_min of the tile's
        split, K one block ahead of V (the order the consumer uses them)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            blocks = self.blocks_of(ctx, work.batch)
            n_block_min, n_block_max = blocks.n_block_min_max(work.m_block, work.split, ctx.num_splits)
            if n_block_max > n_block_min:
                load = _KVLoader.create(self, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V,
                                        work.head, work.batch, kv_len)
                state, _ = self.load_blocks(load.k, load.v, None, None, None, pipe_k, pipe_v, state,
                                            n_block_min, n_block_max)
            tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def consume_kv(self, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv,
                   pipe_k, pipe_v, softmax_scale_log2, softcap_prescale,
                   scheduler: StaticPersistentTileScheduler, ctx):
        cfg = self.cfg
        dtype = sQ.element_type
        tidx = cute.arch.thread_idx()[0] - 128
        tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape = self.consumer_fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, 0)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        # (row, col) of each O accumulator this thread holds.
        tOcO = acc_as_mn(tiled_mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))))
        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(acc_as_mn(acc_O), mode=[0]))
        o_scale = cute.make_rmem_tensor(softmax.row_max.layout, Float32)
        sink_log2 = cute.make_rmem_tensor(softmax.row_max.layout, Float32)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            blocks = self.blocks_of(ctx, work.batch)
            n_block_min, n_block_max = blocks.n_block_min_max(work.m_block, work.split, ctx.num_splits)
            acc_O.fill(0.0)
            softmax.row_max.fill(-Float32.inf)
            softmax.row_sum.fill(0.0)
            o_scale.fill(1.0)
            if n_block_max > n_block_min:
                self.load_q(mQ, sQ, tidx, work, ctx)
                state = self.mainloop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale,
                                      s_shape, state, None, None, pipe_k, pipe_v, ScoreMask.create(blocks, tScS),
                                      softmax, softcap_prescale, blocks, work.m_block, n_block_min, n_block_max,
                                      0, dtype, sV, tidx)
            # Sinks join the final denominator once: here without splits, in the combine with them.
            for r in cutlass.range_constexpr(cute.size(sink_log2)):
                sink_log2[r] = -Float32.inf
                if ctx.num_splits == 1:
                    row = work.m_block * cfg.tile_m + tOcO[r, 0][0]
                    head = work.head * ctx.qhead_per_kv + row % ctx.qhead_per_kv
                    sink_log2[r] = mSinks[head] * _LOG2E
            inv_sum = softmax.finalize(sink_log2)
            OnlineSoftmax.rescale(acc_O, inv_sum)
            self.store_o(acc_O, softmax.row_sum, tOcO, mO, mLSE, mOaccum, mLSEaccum, work, ctx)
            tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def load_q(self, mQ, sQ, tidx, work, ctx):
        """Gather the tile's packed Q rows with 16-byte cp.async (rows past seqlen_q are left as they
        are: they only ever feed rows that are not stored), then make them visible to wgmma."""
        cfg = self.cfg
        dtype = mQ.element_type
        vec = 128 // dtype.width
        threads_per_row = cfg.head_dim // vec
        copy_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(
            copy_atom,
            cute.make_ordered_layout((128 // threads_per_row, threads_per_row), order=(1, 0)),
            cute.make_layout((1, vec)),
        )
        thr = tiled.get_slice(tidx)
        tQsQ = thr.partition_D(sQ)
        tQcQ = thr.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim)))
        for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            row = work.m_block * cfg.tile_m + tQcQ[0, m, 0][0]
            query = row // ctx.qhead_per_kv
            if query < ctx.seqlen_q:
                head = work.head * ctx.qhead_per_kv + row - query * ctx.qhead_per_kv
                start = mQ.iterator + cute.crd2idx((work.batch, query, head, 0), mQ.layout)
                src_row = cute.make_tensor(
                    cute.make_ptr(dtype, start.toint(), cute.AddressSpace.gmem, assumed_align=16),
                    (cfg.head_dim,))
                src = cute.tiled_divide(src_row, (vec,))
                for k in cutlass.range_constexpr(cute.size(tQsQ, mode=[2])):
                    cute.copy(copy_atom, src[None, tQcQ[0, m, k][1] // vec], tQsQ[None, m, k])
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        # cp.async writes are generic-proxy writes; wgmma reads shared memory through the async proxy.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=128)

    @cute.jit
    def store_o(self, acc_O, lse, tOcO, mO, mLSE, mOaccum, mLSEaccum, work, ctx):
        """O and LSE of the tile's valid rows, straight from registers: the final o (in q's dtype) and
        lse without splits, else this split's float32 partials."""
        cfg = self.cfg
        o_mn = acc_as_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = work.m_block * cfg.tile_m + tOcO[r, 0][0]
            query = row // ctx.qhead_per_kv
            if query < ctx.seqlen_q:
                head = work.head * ctx.qhead_per_kv + row - query * ctx.qhead_per_kv
                if ctx.num_splits == 1:
                    o_row = mO[work.batch, query, head, None]
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        o_row[tOcO[r, c][1]] = o_mn[r, c].to(mO.element_type)
                    if tOcO[r, 0][1] == 0:
                        mLSE[work.batch, head, query] = lse[r]
                else:
                    o_row = mOaccum[work.split, work.batch, query, head, None]
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        o_row[tOcO[r, c][1]] = o_mn[r, c]
                    if tOcO[r, 0][1] == 0:
                        mLSEaccum[work.split, work.batch, head, query] = lse[r]

    # ------------------------------------------------------------------------------------------
    # Combine kernel: one warp per (batch, query, q-head) row.
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def combine(self, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                mSinks: cute.Tensor, num_splits: Int32):
        d = self.cfg.head_dim
        per_lane = d // 32
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % 32
        row = cute.arch.block_idx()[0] * COMBINE_ROWS_PER_CTA + tidx // 32
        h_q, s_q = mO.shape[2], mO.shape[1]
        if row < mO.shape[0] * s_q * h_q:
            head = row % h_q
            query = (row // h_q) % s_q
            batch = row // (h_q * s_q)
            # lse = log(sum_s exp(lse_s) + exp(sink)), computed against M = max(lse_s, sink) in log2
            # units; every split with lse_s = -inf (no key in its range) weighs 0.
            big = mSinks[head] * _LOG2E
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                big = cute.arch.fmax(big, mLSEaccum[s, batch, head, query] * _LOG2E)
            for off in cutlass.range_constexpr(int(math.log2(32))):
                big = cute.arch.fmax(big, cute.arch.shuffle_sync_bfly(big, offset=1 << off))
            big_safe = 0.0 if big == -Float32.inf else big
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                total += cute.math.exp2(mLSEaccum[s, batch, head, query] * _LOG2E - big_safe, fastmath=True)
            for off in cutlass.range_constexpr(int(math.log2(32))):
                total += cute.arch.shuffle_sync_bfly(total, offset=1 << off)
            total += cute.math.exp2(mSinks[head] * _LOG2E - big_safe, fastmath=True)
            empty = total == 0.0
            # A +inf sink takes the whole mass (o = 0, lse = +inf; inf - inf would make total NaN);
            # a NaN sink leaves total NaN, so o and lse come out NaN (softmax.finalize does the same).
            sink_wins = mSinks[head] == Float32.inf
            inv = 0.0 if (empty or sink_wins) else cute.arch.rcp_approx(total)
            acc = cute.make_rmem_tensor(per_lane, Float32)
            acc.fill(0.0)
            for s in cutlass.range(num_splits, unroll=4):
                w = cute.math.exp2(mLSEaccum[s, batch, head, query] * _LOG2E - big_safe, fastmath=True) * inv
                o_row = mOaccum[s, batch, query, head, None]
                for i in cutlass.range_constexpr(per_lane):
                    acc[i] += w * o_row[lane * per_lane + i]
            out = mO[batch, query, head, None]
            for i in cutlass.range_constexpr(per_lane):
                out[lane * per_lane + i] = acc[i].to(mO.element_type)
            if lane == 0:
                lse = -Float32.inf if empty else (big_safe + cute.math.log2(total, fastmath=True)) * math.log(2.0)
                mLSE[batch, head, query] = Float32.inf if sink_wins else lse


@dataclass(frozen=True)  # frozen: read inside the dynamic tile loop (see tile_scheduler.py)
class _TileContext:
    """Per-launch values every tile needs."""

    mSeqlensK: cute.Tensor
    seqlen_q: Int32
    qhead_per_kv: Int32
    window_left: Int32
    window_right: Int32
    num_splits: Int32
    capacity: Int32  # keys a sequence can hold: cache_seqlens are clamped to it


@dataclass(frozen=True)
class _KVLoader:
    """TMA copies of one tile's K/V blocks into pipeline stages: one box per block from a contiguous
    cache, tile_n / PAGE_ROWS boxes (one per page piece) from a paged one."""

    kernel: object
    gK: cute.Tensor
    gV: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    tma_atom_K: cute.CopyAtom
    tma_atom_V: cute.CopyAtom
    page_row: cute.Tensor | None  # paged: mPageTable[batch, None]
    kv_len: Int32  # paged: page_size

    @staticmethod
    def create(kernel, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, head, batch, kv_len):
        cfg = kernel.cfg
        if const_expr(kernel.paged):
            # (page_size, d, num_pages) per head, tiled in PAGE_ROWS-row pieces.
            # (PAGE_ROWS, d, pieces per page, 1, num_pages)
            gK = cute.flat_divide(mK[None, None, head, None], (PAGE_ROWS, cfg.head_dim))
            gV = cute.flat_divide(mV[None, None, head, None], (PAGE_ROWS, cfg.head_dim))
            return _KVLoader(kernel, gK, gV, sK, sV, tma_atom_K, tma_atom_V, mPageTable[batch, None], kv_len)
        gK = cute.local_tile(mK[None, None, head, batch], (cfg.tile_n, cfg.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head, batch], (cfg.tile_n, cfg.head_dim), (None, 0))
        return _KVLoader(kernel, gK, gV, sK, sV, tma_atom_K, tma_atom_V, None, kv_len)

    @cute.jit
    def k(self, n_block, stage, barrier):
        self._copy(self.tma_atom_K, self.gK, self.sK, n_block, stage, barrier)

    @cute.jit
    def v(self, n_block, stage, barrier):
        self._copy(self.tma_atom_V, self.gV, self.sV, n_block, stage, barrier)

    @cute.jit
    def _copy(self, atom, g, s, n_block, stage, barrier):
        cfg = self.kernel.cfg
        one = cute.make_layout(1)
        if const_expr(self.kernel.paged):
            pieces_per_page = self.kv_len // PAGE_ROWS
            num_pages = g.shape[4]
            s_pieces = cute.flat_divide(s[None, None, stage], (PAGE_ROWS, cfg.head_dim))
            for j in cutlass.range_constexpr(cfg.tile_n // PAGE_ROWS):
                piece = n_block * (cfg.tile_n // PAGE_ROWS) + j
                slot = piece // pieces_per_page
                # Positions past the page table read its last entry; ids are clamped into the pool.
                slot = cutlass.min(slot, self.page_row.shape[0] - 1)
                page = cutlass.max(cutlass.min(self.page_row[slot], num_pages - 1), 0)
                src = g[None, None, piece - slot * pieces_per_page, 0, page]
                dst = s_pieces[None, None, j, 0]
                tS, tG = cpasync.tma_partition(atom, 0, one, cute.group_modes(dst, 0, 2), cute.group_modes(src, 0, 2))
                cute.copy(atom, tG, tS, tma_bar_ptr=barrier)
        else:
            tS, tG = cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))
            cute.copy(atom, tG[None, n_block], tS[None, stage], tma_bar_ptr=barrier)
