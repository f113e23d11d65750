"""FlashAttention forward kernel for Hopper (SM90), CuTe DSL. Build time only.

Design (FlashAttention-3/4 on Hopper, see ../shared/FA4_NOTES.md and GUIDE.md §6):
- Warp specialisation: warpgroup 0 is the producer (one warp issues TMA loads of Q once and of K/V
  tiles through a `stages`-deep mbarrier pipeline); warpgroups 1..n are consumers, 64 query rows each,
  issuing wgmma and doing the softmax in registers. setmaxnreg moves registers from producer to
  consumers.
- P never touches shared memory: the QK^T accumulator is converted in registers to the A operand of
  the PV wgmma (register-sourced wgmma).
- Intra-warpgroup overlap: in each step the consumer issues S = Q K_j^T and O += P_{j-1} V_{j-1}
  back to back and runs the softmax of S_j while the PV gemm is still in flight.
- Inter-warpgroup ping-pong (hd <= 128): named barriers make the consumer warpgroups take turns
  issuing gemms, so one warpgroup's softmax (MUFU) overlaps the other's tensor-core work.
- Softmax scale and log2(e) are folded into one FFMA before ex2 (`softmax_scale_log2`). With a
  softcap the scores first go through tanh(s * softmax_scale / cap) and the cap joins that factor.
- Masks (block_info.py): causal and local windows skip the blocks no row of the tile sees and mask
  only the blocks on the window's edges; window bounds are runtime arguments.
- Attention sinks join each row's denominator in the final normalisation (softmax.finalize).
- A linear tile scheduler (tile_scheduler.py) maps a 1-D grid to (m-block, head, batch); causal and
  local tiles are issued longest first (reverse m-block order) to shorten the tail.
- Epilogue: O is normalised, converted, written with stmatrix into Q's shared buffer (Q is dead by
  then) and stored with one TMA bulk copy; LSE goes straight from registers to global memory.
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.config import Sm90FwdConfig
from fa4_jax.kernels.mask import ScoreMask
from fa4_jax.kernels.named_barrier import NamedBarrierFwd
from fa4_jax.kernels.seqlen import SeqlenInfo
from fa4_jax.kernels.softmax import OnlineSoftmax
from fa4_jax.kernels.tile_scheduler import StaticPersistentTileScheduler
from fa4_jax.kernels.utils import acc_as_frag_a, acc_as_mn, permute_modes, transpose_2d, wgmma

_LOG2E = 1.4426950408889634


class FlashAttentionForwardSm90:
    """One compiled instance per FwdVariant; `__init__` holds compile-time configuration only."""

    # Whether a K/V tile may run past the sequence's last key into memory the sequence does not own:
    # a KV cache's unused slots or pages, the next packed sequence. Those keys' scores are masked to
    # -inf (P = 0), but the tensor core computes 0 * NaN = NaN, so their V rows are zeroed in shared
    # memory before the PV gemm (clear_v_rows). Dense tensors end where the sequence ends (TMA fills
    # zeros past it): off here, so the dense kernel is unchanged.
    CLEAR_V_TAIL = False

    def __init__(self, cfg: Sm90FwdConfig, mask: str, softcap: bool):
        self.cfg = cfg
        self.mask = mask  # "full" | "causal" | "local" (see block_info.py)
        self.softcap = softcap

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, TMA descriptors, grid, launch.
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h_q, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, d)
        mO: cute.Tensor,  # (b, s_q, h_q, d)
        mLSE: cute.Tensor,  # (b, h_q, s_q) float32
        mSinks: cute.Tensor,  # (h_q,) float32 sink logits, -inf = none
        softmax_scale_log2: Float32,  # log2(e) * (softcap if softcap else softmax_scale)
        softcap_prescale: Float32,  # softmax_scale / softcap (softcap variants only)
        window_left: Int32,  # local variants only, clamped by the handler
        window_right: Int32,
        max_ctas: Int32,  # CTAs that fit on the device at once (SM count): the persistent grid
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        dtype = mQ.element_type
        if const_expr(not (dtype == mK.element_type == mV.element_type == mO.element_type)):
            raise TypeError("q, k, v and o must share one dtype")
        # (b, s, h, d) -> (s, d, h, b): tiles are (rows, head_dim) with head_dim contiguous.
        mQ, mK, mV, mO = [permute_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = permute_modes(mLSE, [2, 1, 0])  # (s_q, h_q, b)

        tiled_mma_qk, tiled_mma_pv = self.make_tiled_mmas(dtype, cfg.num_consumer_wg)
        sQ_layout, sKV_layout = self.make_smem_layouts(dtype)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (cfg.tile_m, cfg.head_dim))
        kv_tile = cute.select(sKV_layout, mode=[0, 1])
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, kv_tile, (cfg.tile_n, cfg.head_dim), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, kv_tile, (cfg.tile_n, cfg.head_dim), 1)
        # O has Q's smem layout (its own buffer when cfg.separate_o, else Q's); the TMA unit clips
        # rows past seqlen_q.
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (cfg.tile_m, cfg.head_dim)
        )
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
            sO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout) if cfg.separate_o else 0], 1024]

        self.shared_storage = SharedStorage

        num_m_blocks = cute.ceil_div(mQ.shape[0], cfg.tile_m)
        # Persistent only with a separate O buffer: with O in Q's buffer a CTA would have to hold the
        # next tile's Q load until its O store has read the buffer, and gain little. The handler
        # also passes max_ctas >= tiles where tiles differ in work (see ffi/fwd.cc).
        if const_expr(not cfg.separate_o):
            max_ctas = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, mSinks,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            softmax_scale_log2, softcap_prescale, window_left, window_right,
            sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv,
        ).launch(
            grid=StaticPersistentTileScheduler.grid(num_m_blocks, mQ.shape[2], mQ.shape[3], max_ctas),
            block=[cfg.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------------------------------
    # Pieces every SM90 attention kernel here builds the same way (dense, KV-cache, varlen; the
    # latter two subclass this one). Called while tracing: plain Python that emits the same code
    # wherever it is used.
    # ------------------------------------------------------------------------------------------
    def make_tiled_mmas(self, dtype, num_wg: int):
        cfg = self.cfg
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            (num_wg, 1, 1), (64, cfg.tile_n),
        )
        # V tiles are (keys, head_dim) in smem; as the B operand of P @ V they are read transposed,
        # i.e. MN-major, which wgmma supports for 16-bit types without a transpose pass.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            (num_wg, 1, 1), (64, cfg.head_dim), a_source=warpgroup.OperandSource.RMEM,
        )
        return tiled_mma_qk, tiled_mma_pv

    def make_smem_layouts(self, dtype):
        """(sQ_layout (tile_m, d), sKV_layout (tile_n, d, stages)), 128-byte swizzled rows."""
        cfg = self.cfg
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cfg.head_dim), dtype
        )
        sQ_layout = cute.tile_to_shape(atom, (cfg.tile_m, cfg.head_dim), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (cfg.tile_n, cfg.head_dim, cfg.stages), order=(0, 1, 2))
        return sQ_layout, sKV_layout

    def make_pipelines(self, storage, with_q: bool = True):
        """TMA pipelines for Q (one stage; None without with_q), K and V (cfg.stages each), from the
        storage's mbar_q / mbar_k / mbar_v; ends with the barrier-init fence and a CTA sync."""
        cfg = self.cfg
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # TMA pipelines release with one elected thread per consumer warp.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * cfg.num_consumer_wg)
        pipe_q = None
        if const_expr(with_q):
            pipe_q = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
                consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True,
            )
        pipe_k, pipe_v = (
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=cfg.stages, producer_group=producer,
                consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True,
            )
            for mbar in (storage.mbar_k, storage.mbar_v)
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipe_q, pipe_k, pipe_v

    def consumer_fragments(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, wg):
        """A consumer warpgroup's gemm operands and accumulators: (tSrQ, tSrK, tOrVt, tOrP, acc_O,
        the QK^T accumulator shape)."""
        cfg = self.cfg
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        return (
            wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ)),
            wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK)),
            wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_2d(sV))),
            wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((cfg.tile_m, cfg.tile_n))),
            cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((cfg.tile_m, cfg.head_dim)), Float32),
            wg_mma_qk.partition_shape_C((cfg.tile_m, cfg.tile_n)),
        )

    @cute.jit
    def load_blocks(self, copy_k, copy_v, copy_q, pipe_q, q_state, pipe_k, pipe_v, state, n_block_min, n_block_max):
        """The producer's order for one tile: K of the first (highest) block, then Q (copy_q, unless
        None: the KV-cache kernel gathers Q itself), then K_{j-1} and V_j in turn, V of the lowest
        block last -- the order the consumers use them. K comes before Q because its stage frees
        during the previous tile's last blocks, while Q's buffer frees only after that tile's last
        QK gemm. copy_k / copy_v(n_block, stage, barrier), copy_q(barrier) issue the copies.
        Returns the advanced (state, q_state)."""
        pipe_k.producer_acquire(state)
        copy_k(n_block_max - 1, state.index, pipe_k.producer_get_barrier(state))
        if const_expr(copy_q is not None):
            pipe_q.producer_acquire(q_state)
            copy_q(pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_prev = n_block_max - 1 - i
            prev = state.clone()
            state.advance()
            pipe_k.producer_acquire(state)
            copy_k(n_prev - 1, state.index, pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(prev)
            copy_v(n_prev, prev.index, pipe_v.producer_get_barrier(prev))
        pipe_v.producer_acquire(state)
        copy_v(n_block_min, state.index, pipe_v.producer_get_barrier(state))
        state.advance()
        return state, q_state

    # ------------------------------------------------------------------------------------------
    # Device side.
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        pipe_q, pipe_k, pipe_v = self.make_pipelines(storage)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)

        sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner) if const_expr(cfg.separate_o) else sQ

        scheduler = StaticPersistentTileScheduler.create(cute.ceil_div(mQ.shape[0], cfg.tile_m), mQ.shape[2], mQ.shape[3],
                                                  lpt=self.mask != "full")
        seqlen = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
        blocks = BlockInfo.create(cfg.tile_m, cfg.tile_n, self.mask, seqlen, window_left, window_right)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                          pipe_q, pipe_k, pipe_v, scheduler, blocks)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self.consume(mO, mLSE, mSinks, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                         pipe_q, pipe_k, pipe_v, softmax_scale_log2, softcap_prescale, blocks, scheduler)

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
             pipe_q, pipe_k, pipe_v, scheduler: StaticPersistentTileScheduler, blocks: BlockInfo):
        """Producer warp, for each of the CTA's tiles: Q once, then K_j / V_j from block
        n_block_max - 1 down to n_block_min, in the order the consumers use them (K_j is needed
        one step before V_j). The pipeline states run on across tiles, so the next tile's Q and
        first K/V stream in while the consumers finish the current one."""
        cfg = self.cfg
        one = cute.make_layout(1)
        heads_per_kv = mQ.shape[2] // mK.shape[2]  # GQA/MQA: q heads share kv heads in groups
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            n_block_min, n_block_max = blocks.n_block_min_max(work.m_block)
            if n_block_max > n_block_min:
                head_kv = work.head // heads_per_kv
                gQ = cute.local_tile(mQ[None, None, work.head, work.batch], (cfg.tile_m, cfg.head_dim),
                                     (work.m_block, 0))
                gK = cute.local_tile(mK[None, None, head_kv, work.batch], (cfg.tile_n, cfg.head_dim), (None, 0))
                gV = cute.local_tile(mV[None, None, head_kv, work.batch], (cfg.tile_n, cfg.head_dim), (None, 0))
                tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

                state, q_state = self.load_blocks(
                    lambda n, stage, bar: cute.copy(tma_atom_K, tKgK[None, n], tKsK[None, stage], tma_bar_ptr=bar),
                    lambda n, stage, bar: cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, stage], tma_bar_ptr=bar),
                    lambda bar: cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=bar),
                    pipe_q, q_state, pipe_k, pipe_v, state, n_block_min, n_block_max)
            tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def consume(self, mO, mLSE, mSinks, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                pipe_q, pipe_k, pipe_v, softmax_scale_log2, softcap_prescale, blocks: BlockInfo,
                scheduler: StaticPersistentTileScheduler):
        cfg = self.cfg
        dtype = sQ.element_type
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape = self.consumer_fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, wg)

        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        mask = ScoreMask.create(blocks, tScS)
        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(acc_as_mn(acc_O), mode=[0]))
        # Rescale factor carried to the next step when O is rescaled just before its PV gemm.
        o_scale = cute.make_rmem_tensor(softmax.row_max.layout, Float32)

        if const_expr(cfg.warpgroup_pingpong):
            # The gemm-issue token starts with the first warpgroup. Each tile passes it around the
            # ring once per K/V block and leaves it where it started (the last warpgroup's final
            # arrive is the next tile's first turn), so this happens once per CTA, not per tile.
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.turn(0), number_of_threads=256)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            n_block_min, n_block_max = blocks.n_block_min_max(work.m_block)
            acc_O.fill(0.0)
            softmax.row_max.fill(-Float32.inf)
            softmax.row_sum.fill(0.0)
            o_scale.fill(1.0)
            if n_block_max > n_block_min:
                pipe_q.consumer_wait(q_state)
                state = self.mainloop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale,
                                      s_shape, state, pipe_q, q_state, pipe_k, pipe_v, mask, softmax,
                                      softcap_prescale, blocks, work.m_block, n_block_min, n_block_max, wg, dtype)
                q_state.advance()

            inv_sum = softmax.finalize(mSinks[work.head] * _LOG2E)
            OnlineSoftmax.rescale(acc_O, inv_sum)
            self.epilogue(acc_O, softmax.row_sum, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tidx,
                          work.m_block, work.head, work.batch, blocks.seqlen.seqlen_q)
            tile_idx = scheduler.next(tile_idx)
        if const_expr(cfg.separate_o):
            if tidx < 32:
                # The CTA's smem must outlive the last O store's reads.
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mainloop(self, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale, s_shape,
                 state, pipe_q, q_state, pipe_k, pipe_v, mask: ScoreMask, softmax: OnlineSoftmax, softcap_prescale,
                 blocks: BlockInfo, m_block, n_block_min, n_block_max, wg, dtype, sV=None, tidx=None):
        """All K/V blocks of one query tile (Q already in smem), from the highest block index down:
        the first block carries the seqlen_k boundary and the window's right edge; the phases after
        it are listed in block_info.py. `state` is the K/V consumer state; returns it advanced past
        this tile's blocks. sV and tidx (the consumer thread index) are needed with CLEAR_V_TAIL."""
        cfg = self.cfg

        # First block (highest index): S only; its PV gemm is issued in the next step.
        n_block = n_block_max - 1
        pipe_k.consumer_wait(state)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True, wait=0)
        pipe_k.consumer_release(state)
        if const_expr(self.softcap):
            OnlineSoftmax.softcap(acc_S, softcap_prescale)
        mask.apply(acc_S, m_block, n_block, seqlen=True, window=True)
        softmax.step(acc_S, is_first=True)
        tOrP.store(acc_as_frag_a(acc_S).load().to(dtype))
        if const_expr(self.CLEAR_V_TAIL):
            # Only the first block can hold the sequence's last key (later ones are full); its V
            # arrives right behind the next K, so waiting for it here costs little, and only tiles
            # whose sequence ends inside the block pay anything beyond a compare.
            keys_in_block = blocks.seqlen.seqlen_k - n_block * cfg.tile_n
            if keys_in_block < cfg.tile_n:
                pipe_v.consumer_wait(state)
                self.clear_v_rows(sV, state.index, keys_in_block, tidx, wg)

        step = partial(self.step, tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv,
                       tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tOrP=tOrP, acc_O=acc_O, o_scale=o_scale,
                       s_shape=s_shape, pipe_k=pipe_k, pipe_v=pipe_v, mask=mask, softmax=softmax,
                       softcap_prescale=softcap_prescale, m_block=m_block, wg=wg, dtype=dtype)
        # Blocks left to do: [n_block_min, n_block_max - 1), highest first.
        hi = n_block_max - 1
        if const_expr(blocks.has_right_edge):
            n_right = cutlass.max(cutlass.min(blocks.n_block_right(m_block), hi), n_block_min)
            for i in cutlass.range(hi - n_right, unroll=1):
                state = step(state, hi - 1 - i, True)
            hi = n_right
        lo = n_block_min
        if const_expr(blocks.has_left_edge):
            lo = cutlass.max(cutlass.min(blocks.n_block_left(m_block), hi), n_block_min)
        for i in cutlass.range(hi - lo, unroll=1):
            state = step(state, hi - 1 - i, False)
        if const_expr(blocks.has_left_edge):
            for i in cutlass.range(lo - n_block_min, unroll=1):
                state = step(state, lo - 1 - i, True)

        # Every gemm that reads Q is done: the producer may load the next tile's Q while the last PV
        # gemm and the epilogue run. (Without a separate O buffer each CTA has one tile and O is
        # about to overwrite Q: no release.)
        if const_expr(cfg.separate_o):
            pipe_q.consumer_release(q_state)

        # Last PV gemm, for the lowest block.
        if const_expr(cfg.rescale_o_before_gemm):
            OnlineSoftmax.rescale(acc_O, o_scale)
        pipe_v.consumer_wait(state)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], wait=0)
        pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def step(self, state, n_block, masked: cutlass.Constexpr[bool], tiled_mma_qk, tiled_mma_pv,
             tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale, s_shape, pipe_k, pipe_v,
             mask: ScoreMask, softmax: OnlineSoftmax, softcap_prescale, m_block, wg, dtype):
        """One K/V block: S_j = Q K_j^T and O += P_{j+1} V_{j+1} in flight together, softmax of
        S_j overlapping the PV gemm. `state` points at block j+1's stage on entry."""
        cfg = self.cfg
        v_state = state.clone()
        state.advance()
        pipe_k.consumer_wait(state)
        self._pingpong_wait(wg)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True, wait=-1)
        if const_expr(cfg.rescale_o_before_gemm):
            OnlineSoftmax.rescale(acc_O, o_scale)
        pipe_v.consumer_wait(v_state)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], wait=-1)
        self._pingpong_signal(wg)
        warpgroup.wait_group(1)  # S_j ready; PV still running
        pipe_k.consumer_release(state)
        if const_expr(self.softcap):
            OnlineSoftmax.softcap(acc_S, softcap_prescale)
        if const_expr(masked):
            mask.apply(acc_S, m_block, n_block, seqlen=False, window=True)
        scale = softmax.step(acc_S, is_first=False)
        warpgroup.wait_group(0)  # PV done: P and V's stage may be reused
        pipe_v.consumer_release(v_state)
        tOrP.store(acc_as_frag_a(acc_S).load().to(dtype))
        if const_expr(cfg.rescale_o_before_gemm):
            o_scale.store(scale.load())
        else:
            OnlineSoftmax.rescale(acc_O, scale)
        return state

    @cute.jit
    def clear_v_rows(self, sV, stage, first_row, tidx, wg):
        """Zero rows [first_row, tile_n) of V stage `stage` with 16-byte stores by the 128 threads of
        consumer warpgroup `wg`, and make them visible to its wgmma (async proxy) before any of its
        threads goes on. With several consumer warpgroups each clears the rows itself: they all
        write the same zeros, so one warpgroup's gemm never depends on another's progress."""
        cfg = self.cfg
        dtype = sV.element_type
        vec = 128 // dtype.width
        threads_per_row = cfg.head_dim // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(
            atom,
            cute.make_ordered_layout((128 // threads_per_row, threads_per_row), order=(1, 0)),
            cute.make_layout((1, vec)),
        )
        thr = tiled.get_slice(tidx % 128)
        tVsV = thr.partition_D(sV[None, None, stage])
        tVcV = thr.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        zeros = cute.make_rmem_tensor(cute.make_layout(vec), dtype)
        zeros.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tVsV, mode=[1])):
            if tVcV[0, m, 0][0] >= first_row:
                for k in cutlass.range_constexpr(cute.size(tVsV, mode=[2])):
                    cute.copy(atom, zeros, tVsV[None, m, k])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=NamedBarrierFwd.v_tail(wg), number_of_threads=128)

    @cute.jit
    def _pingpong_wait(self, wg):
        if const_expr(self.cfg.warpgroup_pingpong):
            cute.arch.barrier(barrier_id=NamedBarrierFwd.turn(wg), number_of_threads=256)

    @cute.jit
    def _pingpong_signal(self, wg):
        if const_expr(self.cfg.warpgroup_pingpong):
            nxt = wg + 1
            if nxt == self.cfg.num_consumer_wg:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.turn(nxt), number_of_threads=256)

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tidx, m_block, head,
                 batch, seqlen_q):
        cfg = self.cfg
        dtype = sO.element_type
        n_consumer = 128 * cfg.num_consumer_wg

        # LSE straight from registers: the thread holding column 0 of a row writes it.
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tOcO = acc_as_mn(thr_mma_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * cfg.tile_m + tOcO[r, 0][0]
                if row < seqlen_q:
                    mLSE[row, head, batch] = lse[r]

        rO = cute.make_rmem_tensor_like(acc_O, dtype)
        rO.store(acc_O.load().to(dtype))
        if const_expr(self.cfg.separate_o):
            # The previous tile's O store must have read sO before it is overwritten.
            if tidx < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Everyone waits: for the store above, or (sO aliasing sQ) for every warpgroup to be done
        # reading Q, before anyone writes O.
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=n_consumer)
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))
        # Generic-proxy smem writes must be made visible to the TMA (async proxy) before the store.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=n_consumer)
        if tidx < 32:
            gO = cute.local_tile(mO[None, None, head, batch], (cfg.tile_m, cfg.head_dim), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                               cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.cfg.separate_o):
                # The CTA's smem must outlive the bulk copy's reads (with a separate sO the next
                # tile's epilogue, or the end of consume(), waits instead: the store overlaps work).
                cute.arch.cp_async_bulk_wait_group(0, read=True)
