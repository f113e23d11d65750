"""Packed variable-length attention for Hopper (SM90), CuTe DSL. Build time only.

The dense kernel (fwd_sm90.py: warp-specialised TMA producer, two or three consumer warpgroups with
ping-pong, register-sourced PV) on packed (total_tokens, heads, head_dim) tensors. What changes:
- A tile is (m_block, head, batch) with batch's rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys
  [cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b]) (SeqlenInfo with offsets; seqused_k clamped to
  [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]]). Tiles whose m_block
  starts past the sequence's end exit at once; the grid is sized by max_seqlen_q (a static hint, or
  the total when there is none).
- Persistent CTAs for full masks (max_ctas = SM count from the handler), one CTA per tile otherwise.
- Q and K/V tiles are TMA boxes at the sequence's offset (`cute.domain_offset`): a box may run into
  the next sequence's rows, which only ever feed masked scores (their V rows are zeroed in shared
  memory first, CLEAR_V_TAIL: a NaN there must not reach this sequence) or rows that are not stored.
- O and LSE are stored from registers with a row predicate, never as a TMA box, which would clobber
  the next sequence's rows.
- Rows past cu_seqlens_q[batch] (padding at the end of the packed tensor) belong to no sequence: an
  extra pseudo-batch of tiles writes o = 0 there and lse = -inf (or the sink logit), as the reference
  defines them.
"""

from __future__ import annotations

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


class FlashAttentionVarlenSm90(FlashAttentionForwardSm90):
    # A sequence's last K/V tile runs into the next sequence's keys: see
    # FlashAttentionForwardSm90.CLEAR_V_TAIL.
    CLEAR_V_TAIL = True

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (total_q, h_q, d)
        mK: cute.Tensor,  # (total_k, h_k, d)
        mV: cute.Tensor,
        mO: cute.Tensor,  # (total_q, h_q, d)
        mLSE: cute.Tensor,  # (h_q, total_q) float32
        mCuSeqlensQ: cute.Tensor,  # (b + 1,) int32
        mCuSeqlensK: cute.Tensor,  # (b + 1,) int32
        mSequsedK: cute.Tensor,  # (b,) int32: keys used per sequence
        mSinks: cute.Tensor,  # (h_q,) float32, -inf = none
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,
        max_ctas: Int32,  # persistent grid (full masks: tiles carry similar work) or every tile
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        dtype = mQ.element_type
        if const_expr(not (dtype == mK.element_type == mV.element_type == mO.element_type)):
            raise TypeError("q, k, v and o must share one dtype")
        # (t, h, d) -> (t, d, h): tiles are (rows, head_dim) with head_dim contiguous.
        mQ, mK, mV, mO = [permute_modes(t, [0, 2, 1]) for t in (mQ, mK, mV, mO)]

        tiled_mma_qk, tiled_mma_pv = self.make_tiled_mmas(dtype, cfg.num_consumer_wg)
        sQ_layout, sKV_layout = self.make_smem_layouts(dtype)
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (cfg.tile_m, cfg.head_dim))
        kv_tile = cute.select(sKV_layout, mode=[0, 1])
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, kv_tile, (cfg.tile_n, cfg.head_dim), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, kv_tile, (cfg.tile_n, cfg.head_dim), 1)
        self.q_bytes = cute.size_in_bytes(dtype, sQ_layout)
        self.kv_bytes = cute.size_in_bytes(dtype, kv_tile)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024]

        self.shared_storage = SharedStorage

        num_m_blocks = cute.ceil_div(max_seqlen_q, cfg.tile_m)
        # batch + 1: the last "batch" zero-fills the rows past cu_seqlens_q[batch]. The handler asks
        # for a persistent grid where tiles carry similar work (as for the dense kernel, ffi/fwd.cc).
        num_batch = mCuSeqlensQ.shape[0]
        self.kernel(
            tma_Q, tma_K, tma_V, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK, mSinks,
            tma_atom_Q, tma_atom_K, tma_atom_V, softmax_scale_log2, softcap_prescale, window_left, window_right,
            num_m_blocks, sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv,
        ).launch(
            grid=StaticPersistentTileScheduler.grid(num_m_blocks, mQ.shape[2], num_batch, max_ctas),
            block=[cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mSequsedK: cute.Tensor,
        mSinks: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_m_blocks: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        pipe_q, pipe_k, pipe_v = self.make_pipelines(storage)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        scheduler = StaticPersistentTileScheduler.create(num_m_blocks, mQ.shape[2], mCuSeqlensQ.shape[0],
                                                         lpt=self.mask != "full")
        ctx = _VarlenContext(mCuSeqlensQ, mCuSeqlensK, mSequsedK, mCuSeqlensQ.shape[0] - 1, mQ.shape[0],
                             window_left, window_right, num_m_blocks)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                self.load_varlen(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                                 pipe_q, pipe_k, pipe_v, scheduler, ctx)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume_varlen(mO, mLSE, mSinks, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv,
                                pipe_q, pipe_k, pipe_v, softmax_scale_log2, softcap_prescale, scheduler, ctx)

    @cute.jit
    def seqlen_of(self, ctx, batch: Int32) -> SeqlenInfo:
        offset_q = ctx.mCuSeqlensQ[batch]
        offset_k = ctx.mCuSeqlensK[batch]
        # seqused_k is clamped to the sequence's own keys: a larger value must not read the next
        # sequence's (as cache_seqlens is clamped to the capacity).
        own_keys = cutlass.max(ctx.mCuSeqlensK[batch + 1] - offset_k, 0)
        seqlen_k = cutlass.min(cutlass.max(ctx.mSequsedK[batch], 0), own_keys)
        return SeqlenInfo(ctx.mCuSeqlensQ[batch + 1] - offset_q, seqlen_k, offset_q, offset_k)

    @cute.jit
    def load_varlen(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k, pipe_v,
                    scheduler: StaticPersistentTileScheduler, ctx):
        """Producer warp: as the dense kernel's `load`, with every tile at its sequence's offsets."""
        cfg = self.cfg
        one = cute.make_layout(1)
        heads_per_kv = mQ.shape[2] // mK.shape[2]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            if work.batch < ctx.num_batch:
                seqlen = self.seqlen_of(ctx, work.batch)
                blocks = BlockInfo.create(cfg.tile_m, cfg.tile_n, self.mask, seqlen, ctx.window_left,
                                          ctx.window_right)
                n_block_min, n_block_max = blocks.n_block_min_max(work.m_block)
                if work.m_block * cfg.tile_m < seqlen.seqlen_q and n_block_max > n_block_min:
                    head_kv = work.head // heads_per_kv
                    gQ = cute.local_tile(cute.domain_offset((seqlen.offset_q, 0), mQ[None, None, work.head]),
                                         (cfg.tile_m, cfg.head_dim), (work.m_block, 0))
                    gK = cute.local_tile(cute.domain_offset((seqlen.offset_k, 0), mK[None, None, head_kv]),
                                         (cfg.tile_n, cfg.head_dim), (None, 0))
                    gV = cute.local_tile(cute.domain_offset((seqlen.offset_k, 0), mV[None, None, head_kv]),
                                         (cfg.tile_n, cfg.head_dim), (None, 0))
                    tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2),
                                                       cute.group_modes(gQ, 0, 2))
                    tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2),
                                                       cute.group_modes(gK, 0, 2))
                    tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2),
                                                       cute.group_modes(gV, 0, 2))
                    state, q_state = self.load_blocks(
                        lambda n, stage, bar: cute.copy(tma_atom_K, tKgK[None, n], tKsK[None, stage], tma_bar_ptr=bar),
                        lambda n, stage, bar: cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, stage], tma_bar_ptr=bar),
                        lambda bar: cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=bar),
                        pipe_q, q_state, pipe_k, pipe_v, state, n_block_min, n_block_max)
            tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def consume_varlen(self, mO, mLSE, mSinks, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v,
                       softmax_scale_log2, softcap_prescale, scheduler: StaticPersistentTileScheduler, ctx):
        cfg = self.cfg
        dtype = sQ.element_type
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape = self.consumer_fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, wg)
        tScS = tiled_mma_qk.get_slice(tidx).partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        tOcO = acc_as_mn(tiled_mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))))
        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(acc_as_mn(acc_O), mode=[0]))
        o_scale = cute.make_rmem_tensor(softmax.row_max.layout, Float32)

        if const_expr(cfg.warpgroup_pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.turn(0), number_of_threads=256)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            if work.batch < ctx.num_batch:
                seqlen = self.seqlen_of(ctx, work.batch)
                if work.m_block * cfg.tile_m < seqlen.seqlen_q:
                    blocks = BlockInfo.create(cfg.tile_m, cfg.tile_n, self.mask, seqlen, ctx.window_left,
                                              ctx.window_right)
                    n_block_min, n_block_max = blocks.n_block_min_max(work.m_block)
                    acc_O.fill(0.0)
                    softmax.row_max.fill(-Float32.inf)
                    softmax.row_sum.fill(0.0)
                    o_scale.fill(1.0)
                    if n_block_max > n_block_min:
                        pipe_q.consumer_wait(q_state)
                        state = self.mainloop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale,
                                              s_shape, state, pipe_q, q_state, pipe_k, pipe_v,
                                              ScoreMask.create(blocks, tScS), softmax, softcap_prescale, blocks,
                                              work.m_block, n_block_min, n_block_max, wg, dtype, sV, tidx)
                        if const_expr(not cfg.separate_o):
                            # The mainloop keeps Q when O would reuse its buffer; this kernel stores O
                            # from registers, so the next tile's Q may come in now.
                            pipe_q.consumer_release(q_state)
                        q_state.advance()
                    inv_sum = softmax.finalize(mSinks[work.head] * _LOG2E)
                    OnlineSoftmax.rescale(acc_O, inv_sum)
                    self.store_rows(acc_O, softmax.row_sum, tOcO, mO, mLSE, work.head,
                                    seqlen.offset_q + work.m_block * cfg.tile_m,
                                    seqlen.seqlen_q - work.m_block * cfg.tile_m)
            else:
                self.fill_unowned_rows(mO, mLSE, mSinks, tidx, work, ctx)
            tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def store_rows(self, acc_O, lse, tOcO, mO, mLSE, head, first_row, num_rows):
        """Rows [first_row, first_row + min(num_rows, tile_m)) of head `head`, from registers. Rows
        outside [0, total_q) are dropped, so offsets that break the contract never write out of bounds."""
        o_mn = acc_as_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = tOcO[r, 0][0]
            if row < num_rows and first_row + row >= 0 and first_row + row < mO.shape[0]:
                o_row = mO[first_row + row, None, head]
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_row[tOcO[r, c][1]] = o_mn[r, c].to(mO.element_type)
                if tOcO[r, 0][1] == 0:
                    mLSE[head, first_row + row] = lse[r]

    @cute.jit
    def fill_unowned_rows(self, mO, mLSE, mSinks, tidx, work, ctx):
        """Pseudo-batch tile (m_block, head): rows past cu_seqlens_q[batch], strided over the
        pseudo-batch's m-blocks, get o = 0 and lse = the sink logit (-inf without sinks)."""
        cfg = self.cfg
        n_threads = 128 * cfg.num_consumer_wg
        # Clamped: a negative offset (a broken contract) must not write before the tensor.
        start = cutlass.max(ctx.mCuSeqlensQ[ctx.num_batch], 0)
        stride = ctx.num_m_blocks * cfg.tile_m
        zero = Float32(0.0).to(mO.element_type)
        row0 = start + work.m_block * cfg.tile_m
        while row0 < ctx.total_q:
            for i in cutlass.range(tidx, cfg.tile_m * cfg.head_dim, n_threads, unroll=1):
                row = row0 + i // cfg.head_dim
                if row < ctx.total_q:
                    mO[row, i % cfg.head_dim, work.head] = zero
            for i in cutlass.range(tidx, cfg.tile_m, n_threads, unroll=1):
                if row0 + i < ctx.total_q:
                    mLSE[work.head, row0 + i] = mSinks[work.head]
            row0 += stride


@dataclass(frozen=True)  # frozen: read inside the dynamic tile loop (see tile_scheduler.py)
class _VarlenContext:
    mCuSeqlensQ: cute.Tensor
    mCuSeqlensK: cute.Tensor
    mSequsedK: cute.Tensor
    num_batch: Int32
    total_q: Int32
    window_left: Int32
    window_right: Int32
    num_m_blocks: Int32
