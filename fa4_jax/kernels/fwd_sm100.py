"""FlashAttention forward for SM100 (Blackwell) (issue 16; compiled GPU-blind and never run: no
Blackwell GPU is available to this project).

The FlashAttention-4 structure (FA4_NOTES.md). Dense and varlen prefill at head_dim <= 128 run two
128-row Q tiles per CTA in ping-pong (q_stage 2, 16 warps); head_dim 192/256 and the KV cache one
(q_stage 1, 12 warps). The roles (config_sm100.WARP_ROLES_BY_Q_STAGE):

  softmax warpgroup t (warps 4t..4t+3), one per Q tile: thread i owns row i of tile t (TMEM lane
              i). Per key block it loads its row of S from Tensor Memory, masks (bit masks over the
              row, in a copy of the step of its own for the blocks that need them), updates the
              running max (kept stale unless it grows by more than RESCALE_THRESHOLD_LOG2,
              config_sm100), exponentiates (a share config_sm100.exp2_fma_fraction of each row on
              the FMA pipe, exp2_fma.py), writes P (bf16/fp16) back over the upper half of the same
              S buffer in 16-column chunks, and hands the row's O scale to the correction warpgroup.
  correction warpgroup: thread i rescales row i of each tile's O in Tensor Memory between two P.V
              gemms (skipped by a warp whose 32 rows all kept their max), and at the end divides by
              the row sum and stores O.
  MMA warp:   one thread issues tcgen05.mma and tcgen05.commit for every handoff. One Q tile:
              S_j = Q K_j^T into one S stage while the softmax works on the other, then
              O += P_(j-1) V_(j-1). Two: per key block, for t = 0, 1, O_t += P_t V_(j-1) then
              S_t = Q_t K_j^T into S_t, so that one tile's softmax runs beside the other's gemms.
  load warp:  TMA of Q (the second tile after the first K), K_j and V_j into their rings.
  the rest idle at the smallest budget (`other_regs` covers the MMA / load warpgroup).

Handoffs (mbarrier pipelines of cutlass.pipeline): Q, K, V (TMA -> UMMA); S (UMMA -> softmax, two
buffers); P (softmax -> UMMA, two buffers); O (UMMA -> correction, a stage per Q tile: a P.V gemm has
completed, and the correction's release lets the next P.V gemm accumulate into the rescaled O); row
scales (softmax -> correction, two slots per Q tile in shared memory: N - 1 scales per tile, then
the final 1 / row sum). With two Q tiles, softmax warpgroup t uses stage t of S and P and slots t,
t + 2 of the scales (its states start at t and advance by two); the MMA warp and the correction
warpgroup take the stages in turn. tests/test_sm100_handoffs.py runs these handoffs as a CPU model.

The MMA warp issues the P.V gemm that reads a P before the Q K^T gemm that overwrites it, and the
tensor core runs one thread's MMAs in order: so P in the upper half of S is read before it is
overwritten, without a barrier.

Masks (full, causal, local windows), softcap, sinks, GQA and the LSE follow the Hopper kernel's
conventions (block_info.py, softmax.py). The family a kernel serves is its `FwdSeams` (seams.py), as
for fwd_sm90: dense, varlen or KV cache.

Scheduling (dense, varlen): full attention on a persistent grid of at most the SM count (_grid),
each CTA walking tiles c, c + grid, ...: every role loops over the CTA's tiles with its pipeline
states carried from one tile to the next (the load warp's next Q waits for the MMA warp to release
the previous one, the first P.V gemm of a tile for the correction to have stored the previous O),
so one tile's epilogue overlaps the next one's loads and gemms. Causal and windowed tiles: one CTA
per tile, launched longest first (config_sm100.tile_of_block). Not yet (the next steps, measured on
hardware first): tuning the FMA-pipe exp2's share (exp2_fma.py), a persistent longest-first handout
for causal tiles, TMA store of O, two Q tiles for KV-cache prefill chunks.

Varlen (call_varlen, `varlen=True`): the same kernel on packed (total, h, d) tensors. A tile (m_block,
head, sequence) reads its sequence's lengths from cu_seqlens (keys clamped to the sequence's own, as
fwd_sm90's TileProblem does) and its Q / K / V boxes start at the sequence's offsets; a box may run
into the next sequence's rows, which only feed masked scores (K), rows not stored (Q) or V rows that
the MMA warp zeroes in shared memory before the block's P.V gemm (_clear_v_keys: P = 0 there, but
0 * NaN = NaN in the tensor core). The grid has one more "sequence", whose tiles write the rows past
cu_seqlens_q[b] (o = 0, lse = the sink), striding over them.

KV cache (call_kvcache, FwdSeams.kvcache; the family's C ABI, the same as fwd_sm90's): one CTA per
(m_block, KV head, sequence, split) tile, numbered as fwd_sm90's split scheduler numbers them
(tile_scheduler.py, tile_problem.py: cache_seqlens clamped to the capacity, a ragged batch's rows
from cu_seqlens_q and its tile list), so the handler's grid, workspace and tile counters serve both
architectures. A tile's rows are pack-GQA rows (query, q-head of the KV head), tile_rows of them
(the variant's tile_m, 64 or 128; the MMA runs 128 rows either way). The load warp issues the first
K block, gathers the tile's Q rows with cp.async (a runtime division maps rows to q rows: no TMA box)
and hands them to the MMA warp through an mbarrier, then streams K/V blocks by TMA: whole blocks from
a contiguous cache, 16-row pieces from the pages a page table names (loaders.KVLoader, as on SM90),
or -- page sizes that are not multiples of 16 -- row by row with cp.async (_load_gathered). The
operands live in (rows, head_dim) shared-memory views that the gathers and page pieces address;
the MMA warp partitions the same views into its operands (_mma_operands). V rows past a sequence's
last key are zeroed before that block's P.V gemm (cache slots past a length may hold anything). The
softmax hands each row's LSE to the correction warpgroup, which stores O and the LSE -- the final
ones, or a split's float32 partials -- and, with the combine fused, counts the tile's splits in and
lets the last one merge them (split_epilogue.py); without tile counters the combine kernel follows.
Each role finds its tile itself after its setmaxnreg (_cache_tile): values computed before the role
split stay live into every role and spilled.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator

from fa4_jax.kernels import split_epilogue
from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.config_sm100 import RESCALE_THRESHOLD_LOG2, WARP_ROLES_BY_Q_STAGE, Sm100FwdConfig, tile_of_block
from fa4_jax.kernels.exp2_fma import exp2_fma
from fa4_jax.kernels.mask import mask_row_in_order
from fa4_jax.kernels.loaders import (PAGE_ROWS, KVLoader, gather_packed_q_warp, row_copy, row_thread_layout,
                                     threads_per_row)
from fa4_jax.kernels.seams import FwdSeams, KVLoad, Seqlens
from fa4_jax.kernels.seqlen import SeqlenInfo
from fa4_jax.kernels.softmax import OnlineSoftmax, empty_row_o, finalize_row
from fa4_jax.kernels.tile_problem import TileProblem
from fa4_jax.kernels.tile_scheduler import StaticPersistentTileScheduler
from fa4_jax.kernels.utils import permute_modes, transpose_2d

_LOG2E = 1.4426950408889634
# Named barriers (0 is __syncthreads).
_BAR_TMEM_ALLOC = 1
_BAR_TMEM_FREE = 2
_BAR_EPILOGUE = 3  # KV cache: the correction warpgroup's split merge (split_epilogue)
# One warpgroup corrects (and stores) O whatever the Q tiles per CTA (config_sm100.WARP_ROLES_BY_Q_STAGE).
_CORRECTION_THREADS = 32 * len(WARP_ROLES_BY_Q_STAGE[1]["correction"])
assert all(len(r["correction"]) * 32 == _CORRECTION_THREADS for r in WARP_ROLES_BY_Q_STAGE.values())
# Splits whose partials one correction warp holds at once in the fused merge: 16 (split_merge's
# default at head_dim <= 128) spilled at the correction warpgroup's 152-168 registers.
_MERGE_CHUNK = 8


def _tcgen05_fence_before():
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def _tcgen05_fence_after():
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


def _tmem_base(tmem: TmemAllocator):
    """The allocation's base address, once the MMA warp's tcgen05.alloc has published it."""
    _tcgen05_fence_before()
    tmem.wait_for_alloc()
    _tcgen05_fence_after()
    return tmem.retrieve_ptr(Float32)


class FlashAttentionForwardSm100:
    def __init__(self, cfg: Sm100FwdConfig, mask: str, softcap: bool, seams: FwdSeams | None = None,
                 tile_rows: int | None = None, page_rows: int = PAGE_ROWS):
        if mask not in ("full", "causal", "local"):
            raise ValueError(f"unknown mask kind {mask=}")
        self.cfg = cfg
        self.mask = mask
        self.softcap = softcap
        self.seams = FwdSeams.dense() if seams is None else seams
        if cfg.q_stage != 1 and self.seams.seqlens is Seqlens.CACHE:
            # The KV-cache tiles are numbered as the handler's grid, workspace and tile counters count
            # them (fwd_sm90's split scheduler): tile_m rows each, one tile per CTA.
            raise NotImplementedError("the SM100 KV-cache kernel runs one Q tile per CTA (q_stage 1)")
        # The warps' roles (config_sm100.WARP_ROLES_BY_Q_STAGE): with two Q tiles, softmax warpgroup t
        # owns tile t; one correction warpgroup, one MMA warp and one load warp serve both.
        roles = cfg.warp_roles
        self.q_stage = cfg.q_stage
        self.mma_warp = roles["mma"][0]
        self.load_warp = roles["load"][0]
        self.last_softmax_warp = roles[f"softmax{cfg.q_stage - 1}"][-1]
        self.correction_warps = roles["correction"]
        # The threads that touch Tensor Memory (allocation and free barriers): MMA, softmax, correction.
        self.tmem_threads = 32 * (1 + 4 * cfg.q_stage + len(roles["correction"]))
        # A CTA's query rows: q_stage tiles of tile_m (a dense / varlen m-block counts these).
        self.cta_rows = cfg.q_stage * cfg.tile_m
        # Varlen (call_varlen): the same kernel on packed (total, h, d) tensors, each tile at its
        # sequence's offsets (as fwd_sm90.py's FwdSeams.varlen); see _varlen_seqlen.
        self.varlen = self.seams.seqlens is Seqlens.VARLEN
        # KV cache (call_kvcache): pack-GQA tiles of one KV head against a contiguous or paged cache,
        # split-KV; see the module docstring.
        self.cache = self.seams.seqlens is Seqlens.CACHE
        self.paged = self.seams.kv_load is KVLoad.PAGED
        # The query rows a tile owns: the MMA's 128 (cfg.tile_m), or fewer for a KV-cache variant
        # whose tile_m is 64 (the family's decode tile, which the handler's grid and tile counters
        # count in): the MMA still runs 128 rows, the upper ones belong to no row and are not stored.
        self.tile_rows = cfg.tile_m if tile_rows is None else tile_rows
        if not 0 < self.tile_rows <= cfg.tile_m:
            raise ValueError(f"tile_rows must be in [1, {cfg.tile_m}]: {self.tile_rows=}")
        if self.tile_rows != cfg.tile_m and not self.cache:
            raise ValueError("fewer tile rows than the MMA's are a KV-cache tile only")
        if self.paged and page_rows not in (PAGE_ROWS, 1):
            raise ValueError(f"pages are read in {PAGE_ROWS}-row TMA pieces or row by row: {page_rows=}")
        self.page_rows = page_rows
        # One-row pieces (page sizes that are not multiples of 16): the load warp gathers K/V rows
        # with cp.async (_gather_rows), and their stages are handed over by its 32 lanes' arrivals
        # rather than a TMA transaction count.
        self.gather_kv = self.paged and page_rows == 1
        # Separate K and V rings, each half of what the shared memory holds beside Q (O leaves
        # from registers in this version: no staging tile): config_sm100's ring_stages.
        self.stages = cfg.ring_stages
        if self.stages < 2:
            raise ValueError(f"{cfg.head_dim=}: fewer than two K/V stages fit")

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def call_dense(
        self,
        mQ: cute.Tensor,  # (b, s_q, h_q, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, d)
        mO: cute.Tensor,  # (b, s_q, h_q, d)
        mLSE: cute.Tensor,  # (b, h_q, s_q) float32
        mSinks: cute.Tensor,  # (h_q,) float32, -inf = none
        mTileCounter: cute.Tensor,  # (n,) int32: the family's dynamic tile handout; unused here (_grid)
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        if const_expr(self.seams.seqlens is not Seqlens.DENSE):
            raise TypeError(f"this kernel is configured for {self.seams}, not dense tensors")
        # Q, K, O: (s, d, h, b), head_dim contiguous (K-major operands); V: (d, s, h, b), the P.V
        # gemm's B operand with N = head_dim contiguous (MN-major).
        mQ, mK, mO = [permute_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        mVt = permute_modes(mV, [3, 1, 2, 0])
        mLSE = permute_modes(mLSE, [2, 1, 0])  # (s_q, h_q, b)
        num_m_blocks = cute.ceil_div(mQ.shape[0], self.cta_rows)
        self.launch(mQ, mK, mVt, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale, window_left, window_right,
                    mQ.shape[0], mK.shape[0], num_m_blocks, num_m_blocks * mQ.shape[2] * mQ.shape[3], None, None,
                    None, Int32(0), max_ctas, stream)

    @cute.jit
    def call_varlen(
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
        max_ctas: Int32,  # the persistent grid of full attention (_grid)
        stream: cuda.CUstream,
    ):
        if const_expr(not self.varlen):
            raise TypeError(f"this kernel is configured for {self.seams}, not varlen tensors")
        # (t, h, d) -> (t, d, h); V: (d, t, h). A tile reads its sequence's rows at the sequence's
        # offset (domain_offset in `load`); LSE stays (h, t).
        mQ, mK, mO = [permute_modes(t, [0, 2, 1]) for t in (mQ, mK, mO)]
        mVt = permute_modes(mV, [2, 0, 1])
        num_m_blocks = cute.ceil_div(max_seqlen_q, self.cta_rows)
        # b + 1 "batches": the last one writes the rows past cu_seqlens_q[b] (o = 0, lse = the sink).
        tiles = num_m_blocks * mQ.shape[2] * mCuSeqlensQ.shape[0]
        self.launch(mQ, mK, mVt, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale, window_left, window_right,
                    Int32(0), Int32(0), num_m_blocks, tiles, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
                    mCuSeqlensQ.shape[0] - 1, max_ctas, stream)

    @cute.jit
    def call_kvcache(
        self,
        mQ: cute.Tensor,  # (qb, s_q, h_q, d): (b, s_q, h_q, d), or ragged (1, total_q, h_q, d)
        mK: cute.Tensor,  # contiguous (b, capacity, h_k, d) | paged (num_pages, page_size, h_k, d)
        mV: cute.Tensor,
        mPageTable: cute.Tensor,  # (b, max_pages) int32 (paged only)
        mSeqlensK: cute.Tensor,  # (b,) int32
        mCuSeqlensQ: cute.Tensor,  # (b + 1,) int32 (ragged only)
        mTileList: cute.Tensor,  # (2 * n_listed,) int32 (sequence, m_block) pairs (ragged, n_listed > 0)
        mO: cute.Tensor,  # (qb, s_q, h_q, d)
        mLSE: cute.Tensor,  # (qb, h_q, s_q) float32
        mOaccum: cute.Tensor,  # (splits_cap, qb, s_q, h_q, d) float32
        mLSEaccum: cute.Tensor,  # (splits_cap, qb, h_q, s_q) float32
        mSinks: cute.Tensor,  # (h_q,) float32, -inf = none
        mSemaphores: cute.Tensor,  # (n,) int32 zeroed tile counters: the combine fused; (0,): the combine
        # kernel follows (ops/kvcache/spec.py COMBINE, launched by the handler)
        mKScale: cute.Tensor,  # (h_k,) FP8 caches' scales: no SM100 variant reads FP8 caches (spec.FP8_ARCHES)
        mVScale: cute.Tensor,
        mTileCounter: cute.Tensor,  # the tile handout's counter: no SM100 KV-cache variant has one (shape (0,))
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,
        ragged: Int32,  # 1: sequence b's rows are [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of s_q
        max_seqlen_q: Int32,  # bounds every sequence's rows (s_q when not ragged): the grid
        n_listed: Int32,  # > 0: the grid is mTileList's tiles (ops/kvcache/tiles.py), else every m-block
        max_ctas: Int32,  # the tile handout's persistent grid: ignored (one CTA per tile)
        stream: cuda.CUstream,
    ):
        """The KV-cache family's C ABI (the same as fwd_sm90's call_kvcache): one CTA per (m_block, KV
        head, sequence, split) tile, as the handler (ffi/kvcache.cc) sizes the workspace and the tile
        counters for; with splits and no counters, the handler launches the combine kernel after it."""
        if const_expr(not self.cache):
            raise TypeError(f"this kernel is configured for {self.seams}, not a KV cache")
        cfg = self.cfg
        dtype = mQ.element_type
        self.dtype = dtype
        if const_expr(not (dtype == mK.element_type == mV.element_type == mO.element_type)):
            raise TypeError("q, k, v and o must share one dtype")
        # K/V: (rows, d, h_k, batch-or-page), head_dim contiguous, for TMA. Q, O and LSE keep their
        # layout: pack-GQA rows are gathered and stored one by one.
        mK, mV = [permute_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]
        qhead_per_kv = mQ.shape[2] // mK.shape[2]
        num_m_blocks = cute.ceil_div(max_seqlen_q * qhead_per_kv, self.tile_rows)
        batches = mSeqlensK.shape[0] + ragged
        listed = cutlass.min(n_listed, 1)
        tiles = (listed * n_listed + (1 - listed) * num_m_blocks * batches) * mK.shape[2] * num_splits

        tiled_mma_qk, tiled_mma_pv, _, mma_pv = self._tiled_mmas(dtype)
        # Row views of the operands (rows, head_dim), head_dim contiguous, as the row gathers and the
        # paged TMA pieces address them; the MMA warp partitions the same views (mma_operands).
        major_k = cute.nvgpu.OperandMajorMode.K
        sQ_layout = sm100_utils.make_smem_layout(major_k, (cfg.tile_m, cfg.head_dim), dtype, 1)
        sKV_layout = sm100_utils.make_smem_layout(major_k, (cfg.tile_n, cfg.head_dim), dtype, self.stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, mma_pv, dtype, 1)
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        kv_tile = cute.select(sKV_layout, mode=[0, 1])
        self.kv_bytes = cute.size_in_bytes(dtype, kv_tile)
        # A paged block is tile_n / page_rows TMA pieces, each into its rows of the stage's tile.
        tma_atom_K, tma_K, tma_atom_V, tma_V = None, mK, None, mV  # one-row pieces: gathered, no TMA
        if const_expr(not self.gather_kv):
            box_rows = self.page_rows if const_expr(self.paged) else cfg.tile_n
            kv_box = cute.composition(kv_tile, (box_rows, cfg.head_dim)) if const_expr(self.paged) else kv_tile
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, kv_box, (box_rows, cfg.head_dim), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, kv_box, (box_rows, cfg.head_dim), 1)
        self.kernel(
            tiled_mma_qk, tiled_mma_pv, None, mQ, tma_atom_K, tma_K, tma_atom_V, tma_V, mO, mLSE, mSinks,
            softmax_scale_log2, softcap_prescale, window_left, window_right, Int32(0), Int32(0), qhead_per_kv,
            num_m_blocks, mCuSeqlensQ, None, None, mSeqlensK.shape[0],
            sQ_layout, sKV_layout, sKV_layout, tP_layout,
            mPageTable, mSeqlensK, mOaccum, mLSEaccum, mTileList, mSemaphores, num_splits, mK.shape[0], ragged, n_listed,
            None,
        ).launch(grid=[tiles, 1, 1], block=[cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _tiled_mmas(self, dtype):
        """(tiled_mma_qk, tiled_mma_pv, their MNK tiles): S = Q K^T with both operands K-major from
        shared memory; O = P V with P from Tensor Memory and V (keys, head_dim) read MN-major."""
        cfg = self.cfg
        mma_qk = (cfg.tile_m, cfg.tile_n, cfg.head_dim)
        mma_pv = (cfg.tile_m, cfg.head_dim, cfg.tile_n)
        major_k, major_mn = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(dtype, dtype, major_k, major_k, Float32,
                                                          tcgen05.CtaGroup.ONE, mma_qk[:2])
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(dtype, dtype, major_k, major_mn, Float32,
                                                          tcgen05.CtaGroup.ONE, mma_pv[:2], tcgen05.OperandSource.TMEM)
        return tiled_mma_qk, tiled_mma_pv, mma_qk, mma_pv

    @cute.jit
    def launch(self, mQ, mK, mVt, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale, window_left, window_right,
               seqlen_q, seqlen_k, num_m_blocks, tiles, mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, max_ctas,
               stream):
        """TMA atoms, shared-memory layouts and the launch (_grid). Q, K, O are (rows, d,
        h[, b]) and V (d, rows, h[, b]); dense calls give seqlen_q / seqlen_k, varlen ones the
        cu_seqlens tensors and num_batch."""
        cfg = self.cfg
        dtype = mQ.element_type
        self.dtype = dtype
        if const_expr(not (dtype == mK.element_type == mVt.element_type == mO.element_type)):
            raise TypeError("q, k, v and o must share one dtype")

        # P comes from Tensor Memory (the A operand), V from shared memory.
        tiled_mma_qk, tiled_mma_pv, mma_qk, mma_pv = self._tiled_mmas(dtype)
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, mma_qk, dtype, self.q_stage)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, mma_qk, dtype, self.stages)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, mma_pv, dtype, self.stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, mma_pv, dtype, 1)

        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma_qk.thr_id.shape,))
        load_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        one = lambda layout: cute.select(layout, mode=[0, 1, 2])  # noqa: E731 - one stage
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(load_op, mQ, one(sQ_layout), mma_qk, tiled_mma_qk,
                                                             cluster.shape)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(load_op, mK, one(sK_layout), mma_qk, tiled_mma_qk,
                                                             cluster.shape)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(load_op, mVt, one(sV_layout), mma_pv, tiled_mma_pv,
                                                             cluster.shape)
        self.q_bytes = cute.size_in_bytes(dtype, one(sQ_layout))
        self.kv_bytes = cute.size_in_bytes(dtype, one(sK_layout))

        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, mO, mLSE, mSinks,
            softmax_scale_log2, softcap_prescale, window_left, window_right, seqlen_q, seqlen_k,
            mQ.shape[2] // mK.shape[2], num_m_blocks, mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch,
            sQ_layout, sK_layout, sV_layout, tP_layout, None, None, None, None, None, None, None, None, None, None,
            tiles,
        ).launch(grid=[self._grid(tiles, max_ctas), 1, 1], block=[cfg.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    def _grid(self, tiles, max_ctas):
        """CTAs of a dense / varlen launch. Full attention: a persistent grid of at most max_ctas (the
        handler's SM count), each CTA walking tiles c, c + grid, ... so that its next tile's loads
        and gemms overlap this one's last blocks and epilogue (FlashAttention-4's static persistent
        scheduler; every tile has the same work). Causal and windowed tiles: one CTA per tile,
        launched longest first (tile_of_block), which the hardware hands to SMs as they free up --
        the handler's tile counter (the SM90 kernel's dynamic handout) is not used here."""
        if const_expr(self.mask == "full"):
            return cutlass.min(tiles, cutlass.max(max_ctas, 1))
        return tiles

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_Q: Optional[cute.CopyAtom],  # None: the KV cache's pack-GQA rows, gathered (load_cache)
        mQ: cute.Tensor,  # TMA coordinates; KV cache: q itself, (qb, s_q, h_q, d)
        tma_atom_K: Optional[cute.CopyAtom],  # None: one-row page pieces, gathered (_gather_rows)
        mK: cute.Tensor,
        tma_atom_V: Optional[cute.CopyAtom],
        mVt: cute.Tensor,  # V's TMA coordinates: (d, rows, ...); KV cache (rows, d, h_k, batch-or-page)
        mO: cute.Tensor,  # (s_q, d, h_q, b); varlen (total_q, d, h_q); KV cache (qb, s_q, h_q, d)
        mLSE: cute.Tensor,  # (s_q, h_q, b); varlen (h_q, total_q); KV cache (qb, h_q, s_q)
        mSinks: cute.Tensor,
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        qhead_per_kv: Int32,
        num_m_blocks: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],  # varlen; a ragged KV-cache batch
        mCuSeqlensK: Optional[cute.Tensor],  # varlen only
        mSequsedK: Optional[cute.Tensor],
        num_batch: Int32,  # varlen, KV cache: sequences (a varlen grid has one more "batch": the padding rows)
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        mPageTable: Optional[cute.Tensor],  # KV cache only, from here on (call_kvcache)
        mSeqlensK: Optional[cute.Tensor],
        mOaccum: Optional[cute.Tensor],
        mLSEaccum: Optional[cute.Tensor],
        mTileList: Optional[cute.Tensor],
        mSemaphores: Optional[cute.Tensor],
        num_splits: Optional[Int32],
        kv_len: Optional[Int32],  # contiguous: capacity; paged: page_size
        ragged: Optional[Int32],
        n_listed: Optional[Int32],
        num_tiles: Optional[Int32],  # dense / varlen: the call's tiles, which the grid's CTAs walk (`launch`)
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx = cute.arch.thread_idx()[0]
        # Each role finds its tile itself (_cache_tile, _prefill_tile), after its setmaxnreg: values
        # computed here would stay live into every role's branch, which spilled them (the MMA and
        # load warps keep 48 registers with two Q tiles per CTA).
        cache_args = None
        prefill_args = None
        if const_expr(self.cache):
            cache_args = (mQ, mK, mPageTable, mSeqlensK, mCuSeqlensQ, mTileList, window_left, window_right, num_splits,
                          kv_len, num_m_blocks, ragged, n_listed, mSemaphores, qhead_per_kv, num_batch)
        else:
            prefill_args = (mO, num_m_blocks, qhead_per_kv, mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, seqlen_q,
                            seqlen_k, window_left, window_right)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self._shared_storage())
        dtype = mO.element_type  # mQ, mK, mVt are TMA coordinate tensors
        sQ = smem.allocate_tensor(dtype, sQ_layout.outer, 1024, sQ_layout.inner)
        sK = smem.allocate_tensor(dtype, sK_layout.outer, 1024, sK_layout.inner)
        sV = smem.allocate_tensor(dtype, sV_layout.outer, 1024, sV_layout.inner)

        if warp_idx == self.load_warp:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        # --- the handoffs
        cta = cute.make_layout((1, 1, 1, 1))
        load_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        wg_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
        # Every barrier is initialised here and made visible by the one sync below (defer_sync).
        def make(kind, stages, producer, consumer, mbar, **kw):
            return kind.create(num_stages=stages, producer_group=producer, consumer_group=consumer,
                               barrier_storage=mbar.data_ptr(), defer_sync=True, **kw)

        tma_umma = partial(make, pipeline.PipelineTmaUmma, producer=load_thread, consumer=mma_thread,
                           cta_layout_vmnk=cta)
        if const_expr(self.cache):
            # The load warp's 32 lanes gather Q with cp.async; each arrives once its copies landed.
            pipe_q = make(pipeline.PipelineAsyncUmma, 1, pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                          mma_thread, storage.mbar_q, cta_layout_vmnk=cta)
        else:
            pipe_q = tma_umma(self.q_stage, mbar=storage.mbar_q, tx_count=self.q_bytes)
        if const_expr(self.gather_kv):
            lanes = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32)
            pipe_k = make(pipeline.PipelineAsyncUmma, self.stages, lanes, mma_thread, storage.mbar_k,
                          cta_layout_vmnk=cta)
            pipe_v = make(pipeline.PipelineAsyncUmma, self.stages, lanes, mma_thread, storage.mbar_v,
                          cta_layout_vmnk=cta)
        else:
            pipe_k = tma_umma(self.stages, mbar=storage.mbar_k, tx_count=self.kv_bytes)
            pipe_v = tma_umma(self.stages, mbar=storage.mbar_v, tx_count=self.kv_bytes)
        # S and P: two buffers -- one Q tile: S_j in the next stage (the next block's scores computed while
        # the softmax works on this one's); two Q tiles: S_t is tile t's, and only softmax
        # warpgroup t waits on (or arrives at) stage t, so 128 threads is each stage's count either
        # way. O: a stage per Q tile. Row scales: two slots per Q tile (tile t's are t, t + q_stage).
        pipe_s = make(pipeline.PipelineUmmaAsync, 2, mma_thread, wg_threads, storage.mbar_s, cta_layout_vmnk=cta)
        pipe_p = make(pipeline.PipelineAsyncUmma, 2, wg_threads, mma_thread, storage.mbar_p, cta_layout_vmnk=cta)
        pipe_o = make(pipeline.PipelineUmmaAsync, self.q_stage, mma_thread, wg_threads, storage.mbar_o,
                      cta_layout_vmnk=cta)
        pipe_scale = make(pipeline.PipelineAsync, 2 * self.q_stage, wg_threads, wg_threads, storage.mbar_scale)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # --- Tensor Memory: allocated by the MMA warp, its address read by every role that uses it.
        # TmemAllocator's allocate / relinquish / free act only in its allocator warp (warp 0 unless
        # told): without allocator_warp_id the MMA warp's calls compiled to nothing.
        tmem = TmemAllocator(storage.tmem_holding.ptr,
                             barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=_BAR_TMEM_ALLOC,
                                                                        num_threads=self.tmem_threads),
                             allocator_warp_id=self.mma_warp)
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        s_acc = thr_qk.make_fragment_C(thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n)))
        o_acc = thr_pv.make_fragment_C(thr_pv.partition_shape_C((cfg.tile_m, cfg.head_dim)))
        tmap = cfg.tmem_map
        # (row, slot) softmax -> correction; tile t's slots are t and t + q_stage (pipe_scale)
        sScale = storage.row_scale.get_tensor(cute.make_layout((128, 2 * self.q_stage)))
        sLse = None
        if const_expr(self.cache):
            sLse = storage.row_lse.get_tensor(cute.make_layout(128))  # the final LSE, softmax -> correction

        if warp_idx == self.load_warp:
            cute.arch.setmaxregister_decrease(cfg.other_regs)
            if const_expr(self.cache):
                self.load_cache(cache_args, mVt, sQ, sK, sV, tma_atom_K, tma_atom_V, pipe_q, pipe_k, pipe_v)
            else:
                producer = pipeline.PipelineUserType.Producer
                states = (pipeline.make_pipeline_state(producer, self.q_stage),
                          pipeline.make_pipeline_state(producer, self.stages))
                for tile in cutlass.range(cute.arch.block_idx()[0], num_tiles, cute.arch.grid_dim()[0], unroll=1):
                    m_block, head, head_kv, batch, seqlen, _, _, n_block_min, n_blocks = self._prefill_tile(
                        tile, *prefill_args)
                    states = self.load(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sV, thr_qk, thr_pv,
                                       pipe_q, pipe_k, pipe_v, m_block, head, head_kv, batch, n_block_min, n_blocks,
                                       seqlen, states)
        elif warp_idx == self.mma_warp:
            cute.arch.setmaxregister_decrease(cfg.other_regs)
            tmem.allocate(cfg.tmem_alloc_columns)
            base = _tmem_base(tmem)
            tmem.relinquish_alloc_permit()
            tS0 = cute.make_tensor(base + tmap["S0"][0], s_acc.layout)
            tO = cute.make_tensor(base + tmap["O0"][0], o_acc.layout)
            o_step = tmap["O1"][0] - tmap["O0"][0] if const_expr(self.q_stage == 2) else 0
            # P as the P.V gemm's A operand in TMEM; its iterator counts P elements, two per column.
            # The fragment keeps `base`'s layout, not its address (the SASS has absolute columns):
            # right because the allocation starts at column 0, one CTA per SM taking the register
            # file (config_sm100: the budgets fill SM100_REGS) and every column it allocates.
            tP = thr_pv.make_fragment_A(cute.make_tensor(base, tP_layout.outer))[None, None, None, 0]
            per_col = Float32.width // mO.element_type.width
            tP0 = cute.make_tensor(tP.iterator + per_col * tmap["P0"][0], tP.layout)
            p_step = per_col * (tmap["P1"][0] - tmap["P0"][0])
            s_step = tmap["S1"][0] - tmap["S0"][0]
            mma_args = (tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tS0, s_step, tO, o_step, tP0, p_step, pipe_q, pipe_k,
                        pipe_v, pipe_s, pipe_p, pipe_o)
            if const_expr(self.cache):
                self._mma_cache(cache_args, mma_args, thr_qk, thr_pv)
            else:
                states = self._mma_states()
                for tile in cutlass.range(cute.arch.block_idx()[0], num_tiles, cute.arch.grid_dim()[0], unroll=1):
                    _, _, _, _, seqlen, _, _, n_block_min, n_blocks = self._prefill_tile(tile, *prefill_args)
                    states = self.mma(*mma_args, n_blocks, thr_qk, thr_pv,
                                      seqlen.seqlen_k - (n_block_min + n_blocks - 1) * cfg.tile_n, states)
            # Every role is done with Tensor Memory before it is freed.
            _tcgen05_fence_before()
            cute.arch.barrier(barrier_id=_BAR_TMEM_FREE, number_of_threads=self.tmem_threads)
            _tcgen05_fence_after()
            tmem.free(base)
        elif warp_idx <= self.last_softmax_warp:
            cute.arch.setmaxregister_increase(cfg.softmax_regs)
            if const_expr(self.cache):
                self._softmax_cache(cache_args, _tmem_base(tmem), s_acc, pipe_s, pipe_p, pipe_scale, sScale, mLSE,
                                    mSinks, softmax_scale_log2, softcap_prescale, tidx, sLse)
            else:
                base = _tmem_base(tmem)
                states = self._softmax_states(tidx)
                for tile in cutlass.range(cute.arch.block_idx()[0], num_tiles, cute.arch.grid_dim()[0], unroll=1):
                    m_block, head, _, batch, _, pad, blocks, n_block_min, n_blocks = self._prefill_tile(
                        tile, *prefill_args)
                    states = self.softmax(base, s_acc, pipe_s, pipe_p, pipe_scale, sScale, mLSE, mSinks,
                                          softmax_scale_log2, softcap_prescale, blocks, m_block, head, batch,
                                          n_block_min, n_blocks, tidx, pad, num_m_blocks, mCuSeqlensQ, mCuSeqlensK,
                                          mSequsedK, num_batch, states)
            _tcgen05_fence_before()
            cute.arch.barrier(barrier_id=_BAR_TMEM_FREE, number_of_threads=self.tmem_threads)
        elif warp_idx <= self.correction_warps[-1]:
            cute.arch.setmaxregister_decrease(cfg.correction_regs)
            ctidx = tidx - 32 * self.correction_warps[0]
            if const_expr(self.cache):
                self._correction_cache(cache_args, _tmem_base(tmem), o_acc, pipe_o, pipe_scale, sScale, mO, mLSE,
                                       mOaccum, mLSEaccum, mSinks, sLse, storage.merge_flag.get_tensor(cute.make_layout(1)),
                                       ctidx)
            else:
                base = _tmem_base(tmem)
                states = self._correction_states()
                for tile in cutlass.range(cute.arch.block_idx()[0], num_tiles, cute.arch.grid_dim()[0], unroll=1):
                    m_block, head, _, batch, seqlen, pad, _, _, n_blocks = self._prefill_tile(tile, *prefill_args)
                    states = self.correction(base, o_acc, pipe_o, pipe_scale, sScale, mO, m_block, head, batch,
                                             seqlen, n_blocks, ctidx, pad, num_m_blocks, states, mSinks=mSinks)
                _tcgen05_fence_before()
                cute.arch.barrier(barrier_id=_BAR_TMEM_FREE, number_of_threads=self.tmem_threads)
        else:
            cute.arch.setmaxregister_decrease(cfg.other_regs)

    def _shared_storage(self):
        """The CTA's barriers and small buffers (the operand tiles are allocated after it). The KV cache
        adds the final LSE handed from the softmax to the correction warpgroup, which stores it beside
        O, and the split merge's verdict."""
        mbar = cutlass.Int64
        fields = dict(
            mbar_q=cute.struct.MemRange[mbar, 2 * self.q_stage],
            mbar_k=cute.struct.MemRange[mbar, 2 * self.stages],
            mbar_v=cute.struct.MemRange[mbar, 2 * self.stages],
            mbar_s=cute.struct.MemRange[mbar, 4],
            mbar_p=cute.struct.MemRange[mbar, 4],
            mbar_o=cute.struct.MemRange[mbar, 2 * self.q_stage],
            mbar_scale=cute.struct.MemRange[mbar, 4 * self.q_stage],
            tmem_holding=Int32,
            row_scale=cute.struct.MemRange[Float32, 2 * self.q_stage * 128],
        )
        if self.cache:
            fields.update(row_lse=cute.struct.MemRange[Float32, 128], merge_flag=cute.struct.MemRange[Int32, 1])
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def _prefill_tile(self, tile, mO, num_m_blocks, qhead_per_kv, mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch,
                      seqlen_q, seqlen_k, window_left, window_right):
        """Dense / varlen: tile `tile` of the call and what its roles need of it, (m_block, head,
        head_kv, batch, seqlen, pad, blocks, n_block_min, n_blocks). Tiles are numbered in one
        dimension, m-blocks fastest (tile_of_block): gridDim.y and .z stop at 65535, which heads x
        batch (vmap folds its axis into the batch) easily pass. m_block counts the CTA's q_stage
        tiles of rows; its key blocks cover all of them (a row that sees none of a block's keys gets
        P = 0 there), and `blocks` (128-row tiles) gives each softmax warpgroup its own masks. pad:
        the varlen pseudo-batch of the rows past cu_seqlens_q[b]; n_blocks is 0 for a tile past its
        sequence's rows (a varlen grid follows max_seqlen_q)."""
        cfg = self.cfg
        m_block, head, batch = tile_of_block(tile, num_m_blocks, mO.shape[2], self.mask != "full")
        pad = False
        if const_expr(self.varlen):
            seqlen, pad = self._varlen_seqlen(mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, mO.shape[0], batch)
        else:
            seqlen = SeqlenInfo.dense(seqlen_q, seqlen_k)
        # The block ranges and masks need the lengths only; a varlen tile's offsets are read where
        # they are used (see the masking in `softmax`).
        lengths = SeqlenInfo(seqlen.seqlen_q, seqlen.seqlen_k)
        n_block_min, n_block_max = BlockInfo.create(self.cta_rows, cfg.tile_n, self.mask, lengths, window_left,
                                                    window_right).n_block_min_max(m_block)
        blocks = BlockInfo.create(cfg.tile_m, cfg.tile_n, self.mask, lengths, window_left, window_right)
        n_blocks = cutlass.max(n_block_max - n_block_min, 0)
        if m_block * self.cta_rows >= seqlen.seqlen_q:
            n_blocks = Int32(0)
        return m_block, head, head // qhead_per_kv, batch, seqlen, pad, blocks, n_block_min, n_blocks

    @cute.jit
    def _cache_tile(self, mQ, mK, mPageTable, mSeqlensK, mCuSeqlensQ, mTileList, window_left, window_right, num_splits,
                    kv_len, num_m_blocks, ragged, n_listed, mSemaphores, qhead_per_kv, num_batch):
        """KV cache: this CTA's tile and what its roles need of it, (problem, work, seqlen, blocks,
        n_block_min, n_blocks, pad). The tile is (m_block, KV head, sequence, split) as fwd_sm90's
        split scheduler numbers them (a tile list for ragged calls), so that the handler's grid,
        workspace and tile counters agree; pad: the ragged pseudo-batch (no keys, cache_epilogue
        writes its rows); n_blocks is 0 for a tile without keys or rows."""
        problem = self._cache_problem(mQ, mK, mPageTable, mSeqlensK, mCuSeqlensQ, window_left, window_right,
                                      num_splits, kv_len, num_m_blocks, ragged, mSemaphores, qhead_per_kv)
        work = StaticPersistentTileScheduler.create(num_m_blocks, mK.shape[2], num_batch + ragged, num_splits,
                                                    mTileList=mTileList, n_listed=n_listed).tile(
                                                        cute.arch.block_idx()[0])
        seqlen = problem.seqlen(work.batch)
        pad = work.batch >= problem.num_batch
        blocks = problem.blocks(seqlen)
        n_block_min, n_block_max = problem.n_block_range(blocks, work)
        n_blocks = cutlass.max(n_block_max - n_block_min, 0)
        if pad or not problem.has_rows(work, seqlen):
            n_blocks = Int32(0)
        return problem, work, seqlen, blocks, n_block_min, n_blocks, pad

    @cute.jit
    def _cache_problem(self, mQ, mK, mPageTable, mSeqlensK, mCuSeqlensQ, window_left, window_right, num_splits,
                       kv_len, num_m_blocks, ragged, mSemaphores, qhead_per_kv):
        """The KV-cache TileProblem (tile_problem.py), as fwd_sm90 builds it: pack-GQA rows of
        `tile_rows` per tile, cache_seqlens clamped to the capacity, split-KV."""
        capacity = kv_len * (mPageTable.shape[1] if const_expr(self.paged) else 1)
        return TileProblem(Seqlens.CACHE, self.tile_rows, self.cfg.tile_n, self.mask, window_left, window_right,
                           mCuSeqlensQ=mCuSeqlensQ, num_batch=mSeqlensK.shape[0], num_m_blocks=num_m_blocks,
                           mSeqlensK=mSeqlensK, seqlen_q=mQ.shape[1], ragged=ragged, qhead_per_kv=qhead_per_kv,
                           num_splits=num_splits, capacity=capacity, mSemaphores=mSemaphores, heads_kv=mK.shape[2])

    @cute.jit
    def load(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mVt, sQ, sK, sV, thr_qk, thr_pv, pipe_q, pipe_k,
             pipe_v, m_block, head, head_kv, batch, n_block_min, n_blocks, seqlen: SeqlenInfo, states):
        """Q once, then K_j and V_j from the highest block down (the order the MMA warp uses them); a
        second Q tile between the first K and V, so that S_0 = Q_0 K^T can start before it lands.
        `states` (Q, K/V producer states) carry over from the CTA's previous tile; returned advanced.
        Varlen: the boxes start at the sequence's offsets; a box may run into the next sequence's
        rows, which only feed masked scores (K), zeroed rows (V, see `mma`) or rows not stored (Q)."""
        cfg = self.cfg
        if const_expr(self.varlen):
            mQh = cute.domain_offset((seqlen.offset_q, 0), mQ[None, None, head])
            mKh = cute.domain_offset((seqlen.offset_k, 0), mK[None, None, head_kv])
            mVh = cute.domain_offset((0, seqlen.offset_k), mVt[None, None, head_kv])
        else:
            mQh, mKh, mVh = mQ[None, None, head, batch], mK[None, None, head_kv, batch], mVt[None, None, head_kv, batch]
        gQ = cute.local_tile(mQh, (cfg.tile_m, cfg.head_dim), (None, 0))  # every 128-row tile
        gK = cute.local_tile(mKh, (cfg.tile_n, cfg.head_dim), (None, 0))
        gV = cute.local_tile(mVh, (cfg.head_dim, cfg.tile_n), (0, None))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 3),
                                           cute.group_modes(thr_qk.partition_A(gQ), 0, 3))
        m_tile = m_block * self.q_stage  # the CTA's first 128-row tile
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 3),
                                           cute.group_modes(thr_qk.partition_B(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 3),
                                           cute.group_modes(thr_pv.partition_B(gV), 0, 3))
        q_state, kv_state = states[0].clone(), states[1].clone()
        if n_blocks > 0:
            # Q's stages are free once the MMA warp has issued the previous tile's last Q K^T gemm.
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ[None, m_tile], tQsQ[None, 0], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            for i in cutlass.range(n_blocks, unroll=1):
                n_block = n_block_min + n_blocks - 1 - i
                pipe_k.producer_acquire(kv_state)
                cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                if const_expr(self.q_stage == 2):
                    if i == 0:
                        pipe_q.producer_acquire(q_state)
                        cute.copy(tma_atom_Q, tQgQ[None, m_tile + 1], tQsQ[None, 1],
                                  tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                        q_state.advance()
                pipe_v.producer_acquire(kv_state)
                cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()
        return q_state, kv_state

    # KV cache: each role's entry finds the CTA's tile itself (_cache_tile) -- see `kernel`.
    @cute.jit
    def _mma_cache(self, cache_args, mma_args, thr_qk, thr_pv):
        _, _, seqlen, _, n_block_min, n_blocks, _ = self._cache_tile(*cache_args)
        self.mma(*mma_args, n_blocks, thr_qk, thr_pv, seqlen.seqlen_k - (n_block_min + n_blocks - 1) * self.cfg.tile_n,
                 self._mma_states())

    @cute.jit
    def _softmax_cache(self, cache_args, base, s_acc, pipe_s, pipe_p, pipe_scale, sScale, mLSE, mSinks,
                       softmax_scale_log2, softcap_prescale, tidx, sLse):
        problem, work, _, blocks, n_block_min, n_blocks, pad = self._cache_tile(*cache_args)
        self.softmax(base, s_acc, pipe_s, pipe_p, pipe_scale, sScale, mLSE, mSinks, softmax_scale_log2,
                     softcap_prescale, blocks, work.m_block, work.head, work.batch, n_block_min, n_blocks, tidx, pad,
                     problem.num_m_blocks, None, None, None, problem.num_batch, self._softmax_states(tidx), sLse,
                     problem.num_splits)

    @cute.jit
    def _correction_cache(self, cache_args, base, o_acc, pipe_o, pipe_scale, sScale, mO, mLSE, mOaccum, mLSEaccum,
                          mSinks, sLse, sMergeFlag, tidx):
        problem, work, seqlen, _, _, n_blocks, pad = self._cache_tile(*cache_args)
        self.correction(base, o_acc, pipe_o, pipe_scale, sScale, mO, work.m_block, work.head, work.batch, seqlen,
                        n_blocks, tidx, pad, problem.num_m_blocks, self._correction_states(), mOaccum, work, problem)
        _tcgen05_fence_before()
        cute.arch.barrier(barrier_id=_BAR_TMEM_FREE, number_of_threads=self.tmem_threads)
        # After the TMEM handoff (nothing here reads Tensor Memory): the tile's LSE, the padding rows
        # of a ragged batch, the fused split merge.
        self.cache_epilogue(mO, mLSE, mOaccum, mLSEaccum, mSinks, sLse, sMergeFlag, tidx, work, seqlen, problem,
                            n_blocks, pad)

    @cute.jit
    def load_cache(self, cache_args, mV, sQ, sK, sV, tma_atom_K, tma_atom_V, pipe_q, pipe_k, pipe_v):
        """KV cache, the load warp: K of the first (highest) block, then the tile's pack-GQA Q rows
        (gathered by the warp's lanes with cp.async while that K is in flight), then K_j and V_j from
        the highest block down. K/V come from a contiguous cache, or in page_rows-row TMA pieces from
        the pages the page table names (loaders.KVLoader; each block's page lookups are issued a
        block ahead of the copies that use them)."""
        cfg = self.cfg
        mQ, mK, mPageTable, kv_len = cache_args[0], cache_args[1], cache_args[2], cache_args[9]
        problem, work, seqlen, _, n_block_min, n_blocks, _ = self._cache_tile(*cache_args)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if const_expr(self.gather_kv):
            if n_blocks > 0:
                self._load_gathered(mQ, mK, mV, mPageTable, kv_len, sQ, sK, sV, pipe_q, pipe_k, pipe_v, q_state,
                                    kv_state, problem, work, seqlen, n_block_min + n_blocks - 1, n_blocks)
        elif n_blocks > 0:
            kv = KVLoader.create(cfg, self.paged, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, work.head,
                                 work.batch, 0, False, kv_len, self.page_rows)
            n_hi = n_block_min + n_blocks - 1
            page, within = kv.lookup(n_hi)
            next_page, next_within = kv.lookup(n_hi - 1)
            pipe_k.producer_acquire(kv_state)
            kv.k(n_hi, kv_state.index, pipe_k.producer_get_barrier(kv_state), page, within)
            pipe_q.producer_acquire(q_state)
            gather_packed_q_warp(self.tile_rows, cfg.head_dim, mQ, sQ[None, None, 0], cute.arch.lane_idx(), work,
                                 seqlen, problem)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            # cp.async writes are generic-proxy writes; the tensor core reads through the async proxy.
            cute.arch.fence_view_async_shared()
            pipe_q.producer_commit(q_state)
            pipe_v.producer_acquire(kv_state)
            kv.v(n_hi, kv_state.index, pipe_v.producer_get_barrier(kv_state), page, within)
            kv_state.advance()
            for i in cutlass.range(n_blocks - 1, unroll=1):
                n_block = n_hi - 1 - i
                page, within = next_page, next_within
                next_page, next_within = kv.lookup(n_block - 1)
                pipe_k.producer_acquire(kv_state)
                kv.k(n_block, kv_state.index, pipe_k.producer_get_barrier(kv_state), page, within)
                pipe_v.producer_acquire(kv_state)
                kv.v(n_block, kv_state.index, pipe_v.producer_get_barrier(kv_state), page, within)
                kv_state.advance()

    @cute.jit
    def _load_gathered(self, mQ, mK, mV, mPageTable, page_size, sQ, sK, sV, pipe_q, pipe_k, pipe_v, q_state, kv_state,
                       problem, work, seqlen, n_hi, n_blocks):
        """KV cache with one-row page pieces, the load warp: the tile's Q rows, then K_j and V_j row by
        row from the highest block down (_gather_rows). A block's stages are handed over one block
        late: the warp issues block j's K copies, then waits for block j - 1's (cp.async groups
        complete in order: K and V a group each), fences them into the async proxy the tensor core
        reads through and arrives, then issues block j's V; so one block's copies are in flight while
        the previous block's land. Needs two stages per ring (every SM100 configuration has them)."""
        lane = cute.arch.lane_idx()
        pipe_q.producer_acquire(q_state)
        gather_packed_q_warp(self.tile_rows, self.cfg.head_dim, mQ, sQ[None, None, 0], lane, work, seqlen, problem)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()  # cp.async writes are generic-proxy writes
        pipe_q.producer_commit(q_state)
        page_row = mPageTable[work.batch, None]
        gK, gV = mK[None, None, work.head, None], mV[None, None, work.head, None]  # (page_size, d, pages)
        prev = kv_state.clone()
        for i in cutlass.range(n_blocks, unroll=1):
            n_block = n_hi - i
            pipe_k.producer_acquire(kv_state)
            self._gather_rows(gK, sK[None, None, kv_state.index], page_row, page_size, n_block, lane)
            cute.arch.cp_async_commit_group()
            if i > 0:
                # The previous block's K and V have landed (all groups but this K's): hand them over
                # before waiting for a V stage, which the MMA warp frees only after its gemm with
                # the previous K (with two stages, waiting first deadlocked: tests/test_sm100_handoffs.py).
                cute.arch.cp_async_wait_group(1)
                cute.arch.fence_view_async_shared()
                pipe_k.producer_commit(prev)
                pipe_v.producer_commit(prev)
            pipe_v.producer_acquire(kv_state)
            self._gather_rows(gV, sV[None, None, kv_state.index], page_row, page_size, n_block, lane)
            cute.arch.cp_async_commit_group()
            prev = kv_state.clone()
            kv_state.advance()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        pipe_k.producer_commit(prev)
        pipe_v.producer_commit(prev)

    @cute.jit
    def _gather_rows(self, g, s, page_row, page_size, n_block, lane):
        """Block n_block's tile_n rows of one head of a paged cache (g: (page_size, head_dim, pages))
        into the stage s ((tile_n, head_dim), swizzled) with 16-byte cp.async by the load warp. Row r
        is key n_block * tile_n + r: slot key % page_size of page page_table[key // page_size] (both
        clamped into the table and the pool: a row past the sequence's keys reads some row of the
        pool, which only feeds masked scores and V rows the MMA warp zeroes). Lane i looks up rows
        i, i + 32, ... and computes their addresses once; row_copy gives lane t the column chunk
        t % tpr of row t / tpr of each pass, which takes its row's address from the owning lane by a
        (64-bit) shuffle."""
        cfg = self.cfg
        dtype = g.element_type
        copy_atom, tiled, vec = row_copy(dtype, cfg.head_dim, 32)
        tpr = threads_per_row(dtype, cfg.head_dim)
        rows_per_pass = 32 // tpr
        thr = tiled.get_slice(lane)
        tKsK = thr.partition_D(s)
        tKcK = thr.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        owned = []
        for k in cutlass.range_constexpr(cfg.tile_n // 32):
            key = n_block * cfg.tile_n + k * 32 + lane
            entry = key // page_size
            slot = key - entry * page_size
            entry = cutlass.max(cutlass.min(entry, page_row.shape[0] - 1), 0)
            page = cutlass.max(cutlass.min(page_row[entry], g.shape[2] - 1), 0)
            owned.append((g.iterator + cute.crd2idx((slot, 0, page), g.layout)).toint())
        passes_per_group = 32 // rows_per_pass  # tpr divides 32: a pass's rows are one lane group's
        for k in cutlass.range_constexpr(cfg.tile_n // 32):
            # Rows 32 k + [0, 32), rows_per_pass a pass. Unrolled (static shared-memory addresses)
            # up to 16 passes a group; past that (head_dim 256: 32) ptxas hoisted the shuffles of many
            # passes and the 104-register load warp spilled, so the loop stays rolled (by 4) there.
            # Rolled at head_dim 96, it spilled the other way (each stage's swizzled addresses hoisted).
            if const_expr(passes_per_group <= 16):
                for mm in cutlass.range_constexpr(passes_per_group):
                    self._gather_pass(copy_atom, vec, tKsK, tKcK, k * passes_per_group + mm,
                                      cute.arch.shuffle_sync(owned[k], mm * rows_per_pass + lane // tpr), dtype)
            else:
                for mm in cutlass.range(passes_per_group, unroll=4):
                    self._gather_pass(copy_atom, vec, tKsK, tKcK, k * passes_per_group + mm,
                                      cute.arch.shuffle_sync(owned[k], mm * rows_per_pass + lane // tpr), dtype)

    @cute.jit
    def _gather_pass(self, copy_atom, vec: cutlass.Constexpr[int], tKsK, tKcK, m, row_addr, dtype: cutlass.Constexpr):
        """One pass of _gather_rows: the lane's column chunks of the row at `row_addr` into pass m."""
        src_row = cute.make_tensor(cute.make_ptr(dtype, row_addr, cute.AddressSpace.gmem, assumed_align=16),
                                   (self.cfg.head_dim,))
        src = cute.tiled_divide(src_row, (vec,))
        for c in cutlass.range_constexpr(cute.size(tKsK, mode=[2])):
            # The lane's column chunks are the same in every pass (row_thread_layout).
            cute.copy(copy_atom, src[None, tKcK[0, 0, c][1] // vec], tKsK[None, m, c])

    def _mma_operands(self, tiled_mma_qk, tiled_mma_pv, thr_qk, thr_pv, sQ, sK, sV):
        """(tSrQ, tSrK, tOrV): the gemms' shared-memory operands. Dense and varlen allocate them in
        the MMA's partitioned layouts; the KV cache allocates (rows, head_dim) views (row gathers, paged
        pieces) and partitions them here -- V's transposed, (head_dim, keys), the MN-major B operand."""
        if const_expr(self.cache):
            return (tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ)),
                    tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sK)),
                    tiled_mma_pv.make_fragment_B(thr_pv.partition_B(transpose_2d(sV))))
        return tiled_mma_qk.make_fragment_A(sQ), tiled_mma_qk.make_fragment_B(sK), tiled_mma_pv.make_fragment_B(sV)

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tS0, s_step: cutlass.Constexpr[int], tO,
            o_step: cutlass.Constexpr[int], tP0, p_step: cutlass.Constexpr[int], pipe_q, pipe_k, pipe_v, pipe_s, pipe_p,
            pipe_o, n_blocks, thr_qk, thr_pv, keys_in_first, states):
        """One thread issues every gemm of the tile: S_j = Q K_j^T into S's next stage, then
        O (+)= P_(j-1) V_(j-1) once the softmax has written P_(j-1) and the correction has rescaled O.
        `keys_in_first`: the sequence's keys in the first (highest) block; varlen and the KV cache
        zero V's rows past them before that block's P.V gemm. Two Q tiles per CTA: mma_two_tiles.
        `states` (_mma_states) carry over from the CTA's previous tile; returned advanced."""
        if const_expr(self.q_stage == 2):
            return self.mma_two_tiles(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tS0, s_step, tO, o_step, tP0, p_step,
                                      pipe_q, pipe_k, pipe_v, pipe_s, pipe_p, pipe_o, n_blocks, thr_qk, thr_pv,
                                      keys_in_first, states)
        tSrQ, tSrK, tOrV = self._mma_operands(tiled_mma_qk, tiled_mma_pv, thr_qk, thr_pv, sQ, sK, sV)
        q_state, kv_state, v_state, s_state, p_state, o_state = [st.clone() for st in states]
        if n_blocks > 0:
            pipe_q.consumer_wait(q_state)
            for j in cutlass.range(n_blocks + 1, unroll=1):
                if j == n_blocks:
                    # Every Q K^T gemm of the tile is issued: Q's stage goes back to the load warp
                    # (the commit lands when they complete; before O's last commit, see below).
                    pipe_q.consumer_release(q_state)
                    q_state.advance()
                if j < n_blocks:
                    # S_j = Q K_j^T into S's stage (free once the softmax has read S_(j-2)). The
                    # buffer is the pipeline stage, not j's parity: the states carry over a
                    # persistent CTA's tiles, and after a tile of odd length stage 1 comes first.
                    pipe_k.consumer_wait(kv_state)
                    pipe_s.producer_acquire(s_state)
                    _tcgen05_fence_after()  # the softmax's reads of this buffer came before
                    self._gemm(tiled_mma_qk, self._stage(tS0, s_step, s_state.index), tSrQ[None, None, None, 0],
                               tSrK[None, None, None, kv_state.index])
                    # Commits complete in issue order once the gemm has: the stage's release
                    # first, so that the kernel's last arrive is one a consumer waits for (none
                    # lands in shared memory after the CTA has exited).
                    pipe_k.consumer_release(kv_state)
                    pipe_s.producer_commit(s_state)
                    s_state.advance()
                    kv_state.advance()
                if j > 0:
                    # O (+)= P_(j-1) V_(j-1), after the softmax wrote P_(j-1) and the correction
                    # released the previous O (rescaled, when the max moved).
                    pipe_p.consumer_wait(p_state)
                    pipe_v.consumer_wait(v_state)
                    if const_expr(self.seams.keys_past_end):
                        if j == 1 and keys_in_first < self.cfg.tile_n:
                            if const_expr(self.cache):
                                self._clear_v_rows(sV, v_state.index, keys_in_first)
                            else:
                                self._clear_v_keys(sV, thr_pv, v_state.index, keys_in_first)
                    pipe_o.producer_acquire(o_state)
                    _tcgen05_fence_after()  # P's stores and O's rescale (tcgen05.st) came before
                    self._gemm(tiled_mma_pv, tO, self._stage(tP0, p_step, p_state.index),
                               tOrV[None, None, None, v_state.index], accumulate=j > 1)
                    pipe_v.consumer_release(v_state)
                    pipe_p.consumer_release(p_state)
                    pipe_o.producer_commit(o_state)
                    o_state.advance()
                    v_state.advance()
                    p_state.advance()
        return q_state, kv_state, v_state, s_state, p_state, o_state

    def _mma_states(self):
        """The MMA warp's pipeline states, in the usual order (every stage in turn): (Q, K, V, S, P,
        O); Q and O have a stage per Q tile, S and P two."""
        consumer, producer = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
        return (pipeline.make_pipeline_state(consumer, self.q_stage),
                pipeline.make_pipeline_state(consumer, self.stages),
                pipeline.make_pipeline_state(consumer, self.stages),
                pipeline.make_pipeline_state(producer, 2),
                pipeline.make_pipeline_state(consumer, 2),
                pipeline.make_pipeline_state(producer, self.q_stage))

    @cute.jit
    def mma_two_tiles(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tS0, s_step: cutlass.Constexpr[int], tO,
                      o_step: cutlass.Constexpr[int], tP0, p_step: cutlass.Constexpr[int], pipe_q, pipe_k, pipe_v,
                      pipe_s, pipe_p, pipe_o, n_blocks, thr_qk, thr_pv, keys_in_first, states):
        """Two Q tiles in ping-pong (FlashAttention-4's order): per key block j, for t = 0, 1,
        O_t (+)= P_t V_(j-1) and then S_t = Q_t K_j^T. While softmax warpgroup 0 works on S_0 the
        tensor core computes tile 1's gemms, and the other way round. P_t lives in the upper half of
        S_t: the P.V gemm that reads it is issued before the Q K^T gemm that overwrites it, and one
        thread's tcgen05.mma run in order. Each K and V tile serves both Q tiles before its release."""
        tSrQ, tSrK, tOrV = self._mma_operands(tiled_mma_qk, tiled_mma_pv, thr_qk, thr_pv, sQ, sK, sV)
        # An MMA object per tile and gemm: _gemm sets its accumulate field inside a branch (j > 0,
        # j < n_blocks, once per tile), and a value set in one branch cannot feed another branch's
        # gemm (shared objects fail the DSL's IR verification: "does not dominate this use").
        mmas = [self._tiled_mmas(self.dtype)[:2] for _ in range(2)]
        # S, P, O: stage t is tile t's, used in turn (0, 1, 0, ...): the usual state order.
        q_state, kv_state, v_state, s_state, p_state, o_state = [st.clone() for st in states]
        if n_blocks > 0:
            for j in cutlass.range(n_blocks + 1, unroll=1):
                if j == n_blocks:
                    # Every Q K^T gemm of the tile is issued: Q's stages go back to the load warp
                    # (the commits land when they complete; before O_1's last commit, see below).
                    # (q_state already stands past both: it advanced at each tile's wait.)
                    for t in cutlass.range_constexpr(2):
                        pipe_q.consumer_release(pipeline.PipelineState(2, Int32(0), Int32(t), Int32(0)))
                if j < n_blocks:
                    pipe_k.consumer_wait(kv_state)
                if j > 0:
                    pipe_v.consumer_wait(v_state)
                    if const_expr(self.seams.keys_past_end):
                        if j == 1 and keys_in_first < self.cfg.tile_n:
                            self._clear_v_keys(sV, thr_pv, v_state.index, keys_in_first)
                for t in cutlass.range_constexpr(2):
                    if j > 0:
                        # O_t (+)= P_t V_(j-1), once softmax t wrote P_t and the correction released
                        # O_t (rescaled, when the max moved).
                        pipe_p.consumer_wait(p_state)
                        pipe_o.producer_acquire(o_state)
                        _tcgen05_fence_after()
                        self._gemm(mmas[t][1], self._stage(tO, o_step, t), self._stage(tP0, p_step, t),
                                   tOrV[None, None, None, v_state.index], accumulate=j > 1)
                        pipe_p.consumer_release(p_state)
                        if const_expr(t == 1):
                            # V_(j-1) served both tiles. Released before O_1's commit: commits land in
                            # issue order, so the kernel's last arrive is one the correction waits for.
                            pipe_v.consumer_release(v_state)
                            v_state.advance()
                        pipe_o.producer_commit(o_state)
                        o_state.advance()
                        p_state.advance()
                    if j < n_blocks:
                        if j == 0:
                            pipe_q.consumer_wait(q_state)  # Q_t (Q_1 is loaded after the first K)
                            q_state.advance()
                        # S_t = Q_t K_j^T (S_t free: softmax t read it before writing P_t, which the
                        # P.V gemm above waited for).
                        pipe_s.producer_acquire(s_state)
                        _tcgen05_fence_after()
                        self._gemm(mmas[t][0], self._stage(tS0, s_step, t), tSrQ[None, None, None, t],
                                   tSrK[None, None, None, kv_state.index])
                        if const_expr(t == 1):
                            pipe_k.consumer_release(kv_state)
                            kv_state.advance()
                        pipe_s.producer_commit(s_state)
                        s_state.advance()
        return q_state, kv_state, v_state, s_state, p_state, o_state

    @cute.jit
    def _varlen_seqlen(self, mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, total_q, batch):
        """(SeqlenInfo, pad) of a varlen tile's batch index: sequence `batch`, as fwd_sm90's tiles
        read it (TileProblem.seqlen: keys clamped to the sequence's own), or for batch == num_batch
        the pseudo-batch of the rows past cu_seqlens_q[num_batch] (no keys: o = 0, lse = the sink;
        pad True). num_batch may be 0 (every row is padding)."""
        offset_q = cutlass.min(cutlass.max(mCuSeqlensQ[num_batch], 0), total_q)
        seqlen_q = total_q - offset_q
        offset_k = Int32(0)
        seqlen_k = Int32(0)
        pad = Boolean(True)
        if batch < num_batch:
            problem = TileProblem(Seqlens.VARLEN, self.cfg.tile_m, self.cfg.tile_n, self.mask, Int32(0), Int32(0),
                                  mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, mSequsedK=mSequsedK,
                                  num_batch=num_batch, total_q=total_q)
            seq = problem.seqlen(batch)
            offset_q, seqlen_q, offset_k, seqlen_k = seq.offset_q, seq.seqlen_q, seq.offset_k, seq.seqlen_k
            pad = Boolean(False)
        return SeqlenInfo(seqlen_q, seqlen_k, offset_q, offset_k), pad

    @cute.jit
    def _clear_v_keys(self, sV, thr_pv, stage, keys):
        """Zero V's rows of keys >= `keys` in stage `stage` (the MMA warp's 32 lanes, then a fence into
        the async proxy that the tensor core reads shared memory through). Varlen: the block past a
        sequence's last key holds the next sequence's rows (NaN / Inf possible, and P = 0 there does
        not help: 0 * NaN = NaN in the tensor core). The smem tile is in the MMA's partitioned shape;
        an identity tensor partitioned the same way names each element's (head_dim, key)."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        tVcV = thr_pv.partition_B(cute.make_identity_tensor((cfg.head_dim, cfg.tile_n)))
        tVsV = sV[None, None, None, stage]
        k_blocks = cute.size(tVcV, mode=[2])
        keys_per_k_block = cfg.tile_n // k_blocks
        zero = Float32(0.0).to(sV.element_type)
        for kb in cutlass.range(keys // keys_per_k_block, k_blocks, unroll=1):
            cV, sVk = tVcV[None, None, kb], tVsV[None, None, kb]
            for i in cutlass.range(lane, cute.size(cV), 32, unroll=1):
                if cV[i][1] >= keys:
                    sVk[i] = zero
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()

    @cute.jit
    def _clear_v_rows(self, sV, stage, keys):
        """KV cache: zero rows [keys, tile_n) of V stage `stage` -- a (keys, head_dim) view -- with
        16-byte stores by the MMA warp's 32 lanes, in passes of whole rows from the first pass that
        holds such a row; then a fence into the async proxy. A cache's slots (or pages) past a
        sequence's length may hold anything, NaN included, and 0 * NaN = NaN in the tensor core."""
        cfg = self.cfg
        dtype = sV.element_type
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        thr_layout, val_layout = row_thread_layout(dtype, cfg.head_dim, 32)
        thr = cute.make_tiled_copy_tv(atom, thr_layout, val_layout).get_slice(cute.arch.lane_idx())
        tVsV = thr.partition_D(sV[None, None, stage])
        tVcV = thr.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        zeros = cute.make_rmem_tensor(cute.make_layout(128 // dtype.width), dtype)
        zeros.fill(0.0)
        rows_per_pass = cute.size(thr_layout, mode=[0])
        for m in cutlass.range(keys // rows_per_pass, cute.size(tVsV, mode=[1]), unroll=1):
            if tVcV[0, m, 0][0] >= keys:
                for k in cutlass.range_constexpr(cute.size(tVsV, mode=[2])):
                    cute.copy(atom, zeros, tVsV[None, m, k])
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()

    def _tile_state(self, stages: int, t, producer: bool):
        """A softmax warpgroup's pipeline state: one Q tile, the usual one (every stage in turn); two,
        tile t's stages only -- it starts at stage t and its users advance it by q_stage (stage t
        again, or t + 2 of the row scales' four, the phase flipping on each wrap)."""
        kind = pipeline.PipelineUserType.Producer if producer else pipeline.PipelineUserType.Consumer
        if const_expr(self.q_stage == 1):
            return pipeline.make_pipeline_state(kind, stages)
        return pipeline.PipelineState(stages, Int32(0), Int32(t), Int32(1 if producer else 0))

    @staticmethod
    def _stage(t0, step: int, stage):
        """Buffer `stage` (runtime) of two same-layout TMEM buffers `step` elements apart: by address,
        since a runtime choice between two tensors is not a value the DSL can carry."""
        return cute.make_tensor(t0.iterator + stage * step, t0.layout)

    @cute.jit
    def _gemm(self, tiled_mma, acc, tA, tB, accumulate=False):
        """acc (=|+=) A B over the k-blocks of one tile, called by the whole MMA warp: the DSL elects
        the thread that issues each tcgen05.mma itself (an `elect.sync` of the full warp). Called from
        inside `elect_one()`, that inner elect.sync ran in one thread while the other 31 waited at the
        branch's end: every SM100 kernel deadlocked at its first gemm (ptxas compiled it to an ELECT
        under WARPSYNC.COLLECTIVE; tests/test_sass.py checks there is none)."""
        tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)

    @cute.jit
    def softmax(self, base, s_acc, pipe_s, pipe_p, pipe_scale, sScale, mLSE, mSinks, softmax_scale_log2,
                softcap_prescale, blocks, m_block, head, batch, n_block_min, n_blocks, tidx, pad, num_m_blocks,
                mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, states, sLse=None, num_splits=None):
        """Thread tidx owns row tidx % 128 of Q tile tidx // 128 (softmax warpgroup t, tile t, with two
        Q tiles per CTA; one tile: tile 0, the stages in turn): its scores come from TMEM lane tidx % 128
        of the tile's S buffer. `pad`: the tile belongs to
        the varlen padding pseudo-batch (_pad_stride). Varlen: the tile's row offset is read again
        at the end, for the LSE store (_varlen_seqlen). KV cache: the row is a pack-GQA row of KV head
        `head` (its query is row // qhead_per_kv, for the masks; its q-head's sink joins here only
        without splits), and its LSE goes to the correction warpgroup through sLse. `states`
        (_softmax_states) carry over from the CTA's previous tile; returned advanced."""
        cfg = self.cfg
        tmap = cfg.tmem_map
        # Two Q tiles: this warpgroup's tile t (runtime: one copy of the code serves both) owns S_t, P_t
        # and the row-scale slots t, t + 2; its pipeline states start at stage t and step by q_stage.
        t, tidx = self._softmax_lane(tidx)
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition.x32), Float32)
        tS0 = cute.make_tensor(base + tmap["S0"][0], s_acc.layout)[((None, None), 0, 0)]
        s_step = tmap["S1"][0] - tmap["S0"][0]
        cS = cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))
        t2r = tcgen05.make_tmem_copy(ld_atom, tS0).get_slice(tidx)
        tScS = t2r.partition_D(cS)
        if const_expr([tScS[i][1] for i in range(cute.size(tScS))] != list(range(cfg.tile_n))):
            raise ValueError("the softmax expects its row of S in column order (mask_row_in_order, P's stores)")
        # P_i: tile_n bf16 per row packed two to a 32-bit column, the upper half of S_i, stored in
        # chunks of 16 columns (32 P values) as they are computed: each chunk's scores are dead once
        # stored, so a row of S and one chunk of P are live at a time (the whole row's P beside S
        # took ~192 registers, past two Q tiles' softmax budget).
        p_chunk = 16
        st_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition.x16), Float32)
        tPt0 = cute.make_tensor(base + tmap["P0"][0], cute.composition(tS0.layout, cute.make_layout((128, p_chunk))))
        r2t = tcgen05.make_tmem_copy(st_atom, tPt0).get_slice(tidx)
        tPr_shape = cute.make_layout(r2t.partition_S(cute.make_identity_tensor((cfg.tile_m, p_chunk))).shape)
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        s_state, p_state, sc_state = [st.clone() for st in states]
        # The tile's m-block in 128-row units (its masks' edges are its own, tighter than the CTA's).
        m_tile = m_block * self.q_stage + t
        row = m_tile * self.tile_rows + tidx
        fma_per_16 = round(cfg.exp2_fma_fraction * 16)  # config_sm100: e.g. 2 of 16 at hd128
        n_block_max = n_block_min + n_blocks
        n_block_right = blocks.n_block_right(m_tile) if const_expr(blocks.has_right_edge) else n_block_max
        n_block_left = blocks.n_block_left(m_tile) if const_expr(blocks.has_left_edge) else n_block_min
        # Tensors and values every block step uses (_softmax_block).
        step = (t2r, tS0, s_step, tScS, r2t, tPt0, tPr_shape, p_chunk, pipe_s, pipe_p, pipe_scale, sScale,
                softmax_scale_log2, softcap_prescale, blocks, row, tidx, fma_per_16, mCuSeqlensQ, mCuSeqlensK,
                mSequsedK, num_batch, mLSE, batch)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = n_block_min + n_blocks - 1 - j
            # Masks, in the blocks that need them (block_info.py): the sequence's last block (keys
            # past seqlen_k), and with a window the blocks its right (causal: the diagonal) or
            # left edge crosses; bottom-right aligned, as everywhere in this library. A copy of the
            # step per case: a masking branch inside one step was if-converted by ptxas into
            # predicated copies of the row, which spilled at two Q tiles' 200 registers.
            need_mask = n_block == n_block_max - 1
            if const_expr(blocks.has_right_edge):
                need_mask = need_mask or n_block >= n_block_right
            if const_expr(blocks.has_left_edge):
                need_mask = need_mask or n_block < n_block_left
            if need_mask:
                row_max, row_sum, s_state, p_state, sc_state = self._softmax_block(
                    True, j, n_block, row_max, row_sum, s_state, p_state, sc_state, *step)
            else:
                row_max, row_sum, s_state, p_state, sc_state = self._softmax_block(
                    False, j, n_block, row_max, row_sum, s_state, p_state, sc_state, *step)
        # The final entry: 1 / row sum, sinks included (a sink adds exp(sink) to the denominator).
        if const_expr(self.cache):
            # Splits leave the sinks to the merge (a split must not count them).
            sink = -Float32.inf
            if num_splits == 1:
                sink = mSinks[head * blocks.qhead_per_kv + row % blocks.qhead_per_kv] * _LOG2E
        else:
            sink = mSinks[head] * _LOG2E
        max_scaled = row_max  # (scaled already: _softmax_block)
        # The Hopper kernel's normalisation (a +inf sink takes the whole mass: o = 0, lse = +inf).
        inv_t, lse_t = cute.make_rmem_tensor(1, Float32), cute.make_rmem_tensor(1, Float32)
        finalize_row(inv_t, lse_t, 0, row_sum, max_scaled, sink)
        inv, lse = inv_t[0], lse_t[0]
        if n_blocks > 0:
            pipe_scale.producer_acquire(sc_state)
            sScale[tidx, sc_state.index] = inv
            if const_expr(self.cache):
                sLse[tidx] = lse  # published by the commit below, with inv
            pipe_scale.producer_commit(sc_state)
            sc_state.advance(self.q_stage)
        if const_expr(not self.cache):
            self._store_lse_rows(mLSE, blocks, row, head, batch, lse, pad, num_m_blocks, mCuSeqlensQ, mCuSeqlensK,
                                 mSequsedK, num_batch)
        return s_state, p_state, sc_state

    def _softmax_lane(self, tidx):
        """(Q tile, row in it) of softmax thread tidx: warpgroup t owns tile t with two Q tiles."""
        if const_expr(self.q_stage == 2):
            return tidx // self.cfg.tile_m, tidx % self.cfg.tile_m
        return 0, tidx

    def _softmax_states(self, tidx):
        """A softmax warpgroup's (S, P, row scale) states before its first tile (_tile_state): with two
        Q tiles, warpgroup tidx // 128 takes that tile's stages."""
        t, _ = self._softmax_lane(tidx)
        return (self._tile_state(2, t, producer=False), self._tile_state(2, t, producer=True),
                self._tile_state(2 * self.q_stage, t, producer=True))

    @cute.jit
    def _softmax_block(self, masked: cutlass.Constexpr[bool], j, n_block, row_max, row_sum, s_state, p_state, sc_state,
                       t2r, tS0, s_step: cutlass.Constexpr[int], tScS, r2t, tPt0, tPr_shape,
                       p_chunk: cutlass.Constexpr[int],
                       pipe_s, pipe_p, pipe_scale, sScale, softmax_scale_log2, softcap_prescale, blocks, row, tidx,
                       fma_per_16: cutlass.Constexpr[int], mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, mLSE,
                       batch):
        """One key block of the softmax (see `softmax`): S from Tensor Memory, softcap, the masks if
        `masked`, the running max (conditional rescaling), P into Tensor Memory in chunks, the row
        sum, O's scale to the correction warpgroup. Returns the loop's state; the pipeline states
        are advanced on clones, as the caller's branches must each yield their own."""
        cfg = self.cfg
        s_state, p_state, sc_state = s_state.clone(), p_state.clone(), sc_state.clone()
        dtype_p = self.dtype  # P has V's type: the P.V gemm's A operand
        hi, lo = Int32(0), Int32(0)
        if const_expr(masked):
            # This block's bounds, before S arrives: only they stay live beside the row of scores.
            mb = blocks
            if const_expr(self.varlen):
                # The lengths again (L1 hits), rather than kept live through the loop: the softmax
                # threads' registers are all in use at head_dim 64-128 (kept, they spilled 8-64
                # bytes; the dense kernel reads them as parameters).
                fresh, _ = self._varlen_seqlen(mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, mLSE.shape[1], batch)
                mb = dataclasses.replace(blocks, seqlen=fresh)
            col0 = n_block * cfg.tile_n
            hi = mb.seqlen.seqlen_k - col0
            if const_expr(blocks.has_right_edge):
                diag = mb.query_of_row(row) + mb.diag_offset() - col0
                hi = cutlass.min(hi, diag + mb.window_right + 1)
                if const_expr(blocks.has_left_edge):
                    lo = diag - mb.window_left
        stage = s_state.index  # alternating with one Q tile (across a CTA's tiles too), t with two
        pipe_s.consumer_wait(s_state)
        _tcgen05_fence_after()
        tSrc = t2r.partition_S(self._stage(tS0, s_step, stage))
        rS = cute.make_rmem_tensor(tScS.shape, Float32)
        cute.copy(t2r, tSrc, rS)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read
        if const_expr(self.softcap):
            OnlineSoftmax.softcap(rS, softcap_prescale)
        if const_expr(masked):
            # Register i is column i (checked in `softmax`): one bit mask per 32 columns, no
            # compare per score (a branch per score became ~60 selects per score in SASS).
            mask_row_in_order(rS, hi, lo, blocks.has_left_edge)
        block_max = rS[0]
        for i in cutlass.range_constexpr(1, cute.size(rS)):
            block_max = cute.arch.fmax(block_max, rS[i])
        # row_max is the running max already scaled (m * scale_log2, rounded once), as in
        # softmax.OnlineSoftmax: every exponent and every rescale factor is taken against that one
        # stored value, so its rounding is common to all of a row's terms and cancels in O and the
        # LSE. (A factor computed as (m_prev - m) * scale_log2 disagrees with the exponents by up to
        # ulp(|m * scale_log2|): 4-9% off at scale 1 with scores near 2^20, tests/test_gpu_isolation.)
        block_max = block_max * softmax_scale_log2
        # Conditional rescaling: keep the stale max unless it grows by more than the threshold.
        new_max = row_max
        if row_max == -Float32.inf or block_max - row_max > RESCALE_THRESHOLD_LOG2:
            new_max = block_max
        scale = Float32(1.0)
        if new_max != row_max:
            scale = 0.0 if row_max == -Float32.inf else cute.math.exp2(row_max - new_max, fastmath=True)
        row_max = new_max
        max_scaled = 0.0 if row_max == -Float32.inf else row_max
        # S is in registers (tcgen05.wait::ld above): its buffer may take P now. tcgen05.fence
        # before each hand-over of Tensor Memory to the MMA warp, which fences after its wait: the
        # PTX ISA's pattern for tcgen05 accesses ordered through a thread synchronization.
        _tcgen05_fence_before()
        pipe_s.consumer_release(s_state)
        s_state.advance(self.q_stage)
        # P over the upper half of S's stage (two Q tiles: of S_t), as 32-bit pairs.
        pipe_p.producer_acquire(p_state)
        tPdst = self._stage(tPt0, s_step, stage)
        block_sum = Float32(0.0)
        per_chunk = 2 * p_chunk
        for c in cutlass.range_constexpr(cute.size(rS) // per_chunk):
            rP = cute.make_rmem_tensor(per_chunk, dtype_p)
            for k in cutlass.range_constexpr(per_chunk):
                i = c * per_chunk + k
                x = rS[i] * softmax_scale_log2 - max_scaled
                # A fixed share of each row's exponentials on the FMA pipe, the rest on MUFU.
                p = exp2_fma(x) if const_expr(i % 16 < fma_per_16) else cute.math.exp2(x, fastmath=True)
                block_sum += p
                rP[k] = p.to(dtype_p)
            # rS holds the row in column order (tScS), so rP's 32-bit pairs are P's packed
            # columns [c * p_chunk, (c + 1) * p_chunk) in order: the register side of the store.
            rP32 = cute.make_tensor(cute.recast_tensor(rP, Float32).iterator, tPr_shape)
            cute.copy(r2t, rP32, r2t.partition_D(cute.make_tensor(tPdst.iterator + c * p_chunk, tPdst.layout)))
        row_sum = row_sum * scale + block_sum
        cute.arch.fence_view_async_tmem_store()
        _tcgen05_fence_before()
        pipe_p.producer_commit(p_state)
        p_state.advance(self.q_stage)
        if j > 0:
            # O's scale for this step, to the correction thread of the same row.
            pipe_scale.producer_acquire(sc_state)
            sScale[tidx, sc_state.index] = scale
            pipe_scale.producer_commit(sc_state)
            sc_state.advance(self.q_stage)
        return row_max, row_sum, s_state, p_state, sc_state

    @cute.jit
    def _store_lse_rows(self, mLSE, blocks, row, head, batch, lse, pad, num_m_blocks, mCuSeqlensQ, mCuSeqlensK,
                        mSequsedK, num_batch):
        """Dense and varlen: the softmax thread's row's LSE (and a varlen padding tile's rows)."""
        at = blocks.seqlen  # dense: the rows are the tile's own
        if const_expr(self.varlen):
            at, _ = self._varlen_seqlen(mCuSeqlensQ, mCuSeqlensK, mSequsedK, num_batch, mLSE.shape[1], batch)
        # The bounds check takes the offsets the store uses (blocks.seqlen has the lengths only: a
        # varlen row at a broken cu_seqlens_q offset would pass it and write outside mLSE).
        if self._row_stored(mLSE.shape[1], at, row):
            self._store_lse(mLSE, at, row, head, batch, lse)
        if const_expr(self.varlen):
            if pad:
                stride = self._pad_stride(num_m_blocks)
                for r in cutlass.range(row + stride, blocks.seqlen.seqlen_q, stride, unroll=1):
                    self._store_lse(mLSE, at, r, head, batch, lse)

    @cute.jit
    def correction(self, base, o_acc, pipe_o, pipe_scale, sScale, mO, m_block, head, batch, seqlen: SeqlenInfo,
                   n_blocks, tidx, pad, num_m_blocks, states, mOaccum=None, work=None, problem=None, mSinks=None):
        """Thread tidx (0..127) owns row tidx of O (TMEM lane tidx) -- of each Q tile's O, with two
        tiles per CTA (tile 0's step j, then tile 1's, the order the MMA warp accumulates them in):
        rescales it in TMEM between P.V gemms, then stores O / row sum. A row is head_dim fp32
        values, more than the warpgroup's registers: it is done in 32-column chunks (one 32x32b load
        or store each). KV cache: the row is a pack-GQA row (_cache_row), stored as o, or with
        splits as this split's float32 partial; cache_epilogue does the rest. `states` (O, row scale:
        _correction_states) carry over from the CTA's previous tile; returned advanced."""
        cfg = self.cfg
        chunk = 32
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition.x32), Float32)
        st_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition.x32), Float32)
        tO = cute.make_tensor(base + cfg.tmem_map["O0"][0], o_acc.layout)[((None, None), 0, 0)]
        tO_chunks = cute.flat_divide(tO, (cfg.tile_m, chunk))  # (128, 32, 1, d / 32)
        t2r = tcgen05.make_tmem_copy(ld_atom, tO_chunks[None, None, 0, 0]).get_slice(tidx)
        r2t = tcgen05.make_tmem_copy(st_atom, tO_chunks[None, None, 0, 0]).get_slice(tidx)
        tOcO = t2r.partition_D(cute.make_identity_tensor((cfg.tile_m, chunk)))
        o_state, sc_state = states[0].clone(), states[1].clone()
        seqlen_q = seqlen.seqlen_q
        dest = None
        if const_expr(self.cache):
            dest = self._cache_row(mO, work, seqlen, problem, tidx)
        for j in cutlass.range(n_blocks, unroll=1):
            for t in cutlass.range_constexpr(self.q_stage):
                row = (m_block * self.q_stage + t) * cfg.tile_m + tidx
                # Tile t's O: tile 0's columns moved by a compile-time offset.
                tOt = cute.make_tensor(tO_chunks.iterator + (cfg.tmem_map[f"O{t}"][0] - cfg.tmem_map["O0"][0]),
                                       tO_chunks.layout)
                pipe_o.consumer_wait(o_state)  # P_j V_j has landed in tile t's O
                pipe_scale.consumer_wait(sc_state)
                scale = sScale[tidx, sc_state.index]
                pipe_scale.consumer_release(sc_state)
                sc_state.advance()
                _tcgen05_fence_after()
                last = j == n_blocks - 1
                # Not last: rescale for the next step's max (a warp whose rows all kept theirs skips
                # it). Last: scale is 1 / row sum, and O leaves.
                if last or cute.arch.vote_any_sync(scale != 1.0):
                    for c in cutlass.range_constexpr(cfg.head_dim // chunk):
                        rO = cute.make_rmem_tensor(tOcO.shape, Float32)
                        cute.copy(t2r, t2r.partition_S(tOt[None, None, 0, c]), rO)
                        cute.arch.fence_view_async_tmem_load()
                        for i in cutlass.range_constexpr(cute.size(rO)):
                            rO[i] = rO[i] * scale
                        if last:
                            if const_expr(self.cache):
                                self._store_cache_o(mO, mOaccum, rO, tOcO, c * chunk, dest, seqlen, work, problem)
                            elif self._row_stored(mO.shape[0], seqlen, row):
                                out = self._o_row(mO, seqlen, row, head, batch)
                                for i in cutlass.range_constexpr(cute.size(rO)):
                                    out[c * chunk + tOcO[i][1]] = rO[i].to(mO.element_type)
                        else:
                            cute.copy(r2t, rO, r2t.partition_D(tOt[None, None, 0, c]))
                    if not last:
                        cute.arch.fence_view_async_tmem_store()
                _tcgen05_fence_before()
                pipe_o.consumer_release(o_state)
                o_state.advance()
        if const_expr(not self.cache):
            if n_blocks == 0:
                # No key: O = 0, or NaN with a NaN sink (the softmax wrote lse).
                fill = empty_row_o(mSinks[head])
                for t in cutlass.range_constexpr(self.q_stage):
                    row = (m_block * self.q_stage + t) * cfg.tile_m + tidx
                    if self._row_stored(mO.shape[0], seqlen, row):
                        self._fill_o_row(mO, seqlen, row, head, batch, fill)
                    if const_expr(self.varlen):
                        if pad:
                            stride = self._pad_stride(num_m_blocks)
                            for r in cutlass.range(row + stride, seqlen_q, stride, unroll=1):
                                self._fill_o_row(mO, seqlen, r, head, batch, fill)
        return o_state, sc_state

    def _correction_states(self):
        consumer = pipeline.PipelineUserType.Consumer
        return (pipeline.make_pipeline_state(consumer, self.q_stage),
                pipeline.make_pipeline_state(consumer, 2 * self.q_stage))

    @cute.jit
    def _cache_row(self, mO, work, seqlen: SeqlenInfo, problem: TileProblem, tidx):
        """KV cache: (stored, position, q-head) of tile row tidx -- query row // qhead_per_kv of q-head
        kv_head * qhead_per_kv + row % qhead_per_kv at (seqlen.batch_q, position) of q / o. Stored: a
        row of the tile's tile_rows that is one of its sequence's (not the ragged pseudo-batch's:
        cache_epilogue writes those), within o's extent."""
        qpk = problem.qhead_per_kv
        row = work.m_block * self.tile_rows + tidx
        query = row // qpk
        pos = seqlen.offset_q + query
        stored = tidx < self.tile_rows and work.batch < problem.num_batch and query < seqlen.seqlen_q \
            and pos < mO.shape[1]
        return stored, pos, work.head * qpk + row - query * qpk

    @cute.jit
    def _store_cache_o(self, mO, mOaccum, rO, tOcO, col0: cutlass.Constexpr[int], dest, seqlen: SeqlenInfo, work,
                       problem: TileProblem):
        """KV cache: columns [col0, col0 + chunk) of the thread's row, O in q's dtype or, with splits,
        this split's float32 partial."""
        stored, pos, head_q = dest
        if stored:
            if problem.num_splits == 1:
                out = mO[seqlen.batch_q, pos, head_q, None]
                for i in cutlass.range_constexpr(cute.size(rO)):
                    out[col0 + tOcO[i][1]] = rO[i].to(mO.element_type)
            else:
                part = mOaccum[work.split, seqlen.batch_q, pos, head_q, None]
                for i in cutlass.range_constexpr(cute.size(rO)):
                    part[col0 + tOcO[i][1]] = rO[i]

    @cute.jit
    def cache_epilogue(self, mO, mLSE, mOaccum, mLSEaccum, mSinks, sLse, sMergeFlag, tidx, work, seqlen: SeqlenInfo,
                       problem: TileProblem, n_blocks, pad):
        """KV cache, the correction warpgroup after its O stores: the row's LSE (from the softmax, or
        for a tile without keys o = 0 and lse = the sink -- -inf with splits: a split's empty
        partial), the ragged pseudo-batch's rows, and with the combine fused the split merge of the
        last split CTA of the tile (split_epilogue). Every partial of this CTA is stored by these 128
        threads, which the merge's release relies on."""
        cfg = self.cfg
        stored, pos, head_q = self._cache_row(mO, work, seqlen, problem, tidx)
        if stored:
            lse = -Float32.inf
            if n_blocks > 0:
                lse = sLse[tidx]
            elif problem.num_splits == 1:
                lse = mSinks[head_q]
            if problem.num_splits == 1:
                if n_blocks == 0:
                    fill = empty_row_o(mSinks[head_q])
                    out = mO[seqlen.batch_q, pos, head_q, None]
                    for i in cutlass.range_constexpr(cfg.head_dim):
                        out[i] = fill.to(mO.element_type)
                mLSE[seqlen.batch_q, head_q, pos] = lse
            else:
                if n_blocks == 0:
                    part = mOaccum[work.split, seqlen.batch_q, pos, head_q, None]
                    for i in cutlass.range_constexpr(cfg.head_dim):
                        part[i] = Float32(0.0)
                mLSEaccum[work.split, seqlen.batch_q, head_q, pos] = lse
        if pad:
            split_epilogue.fill_unowned_packed_rows(self.tile_rows, cfg.head_dim, _CORRECTION_THREADS, mO, mLSE, mOaccum,
                                                    mLSEaccum, mSinks, tidx, work, seqlen, problem)
        if problem.fused_combine():
            split_epilogue.merge_splits_if_last(self.tile_rows, cfg.head_dim, _CORRECTION_THREADS, _BAR_EPILOGUE, mO,
                                                mLSE, mOaccum, mLSEaccum, mSinks, sMergeFlag, tidx, work, seqlen,
                                                problem, _MERGE_CHUNK)

    def _pad_stride(self, num_m_blocks):
        """The varlen padding pseudo-batch's rows past cu_seqlens_q[b] may outnumber its tiles' rows
        (the grid follows max_seqlen_q): each of its tiles writes its rows this far apart. Computed
        where used, from kernel parameters, so that nothing extra stays live through the mainloop."""
        return num_m_blocks * self.cta_rows

    @cute.jit
    def _row_stored(self, total_q, seqlen: SeqlenInfo, row) -> Boolean:
        """Whether the tile's row `row` is one to store: below its sequence's length, and for varlen
        inside the packed tensors' [0, total_q) -- cu_seqlens_q that break their contract (not
        ascending, past total_q) must not make a store go out of bounds (the Hopper epilogue's
        rule, epilogue_sm90.row_store). Dense rows are the tile's own (`total_q` unused)."""
        stored = row < seqlen.seqlen_q
        if const_expr(self.varlen):
            at = seqlen.offset_q + row
            if at < 0 or at >= total_q:
                stored = Boolean(False)
        return stored

    @cute.jit
    def _fill_o_row(self, mO, seqlen: SeqlenInfo, row, head, batch, fill=None):
        """Row `row` of O set to `fill` (default 0) in every column."""
        out = self._o_row(mO, seqlen, row, head, batch)
        value = Float32(0.0) if const_expr(fill is None) else fill
        for i in cutlass.range_constexpr(self.cfg.head_dim):
            out[i] = value.to(mO.element_type)

    def _o_row(self, mO, seqlen: SeqlenInfo, row, head, batch):
        """Row `row` of the tile's sequence in O: (s_q, d, h, b) dense, packed (t, d, h) varlen."""
        if const_expr(self.varlen):
            return mO[seqlen.offset_q + row, None, head]
        return mO[row, None, head, batch]

    def _store_lse(self, mLSE, seqlen: SeqlenInfo, row, head, batch, lse):
        """LSE of row `row`: (s_q, h, b) dense, packed (h, t) varlen."""
        if const_expr(self.varlen):
            mLSE[head, seqlen.offset_q + row] = lse
        else:
            mLSE[row, head, batch] = lse
