"""FlashAttention forward kernel for Hopper (SM90), CuTe DSL: dense, varlen and KV-cache attention.
Build time only.

One kernel body; `FwdSeams` (seams.py) picks at compile time what plugs into each seam: where
sequence lengths come from (tile_problem.py), how Q and K/V reach shared memory (loaders.py),
which tiles a CTA takes (tile_scheduler.py) and how O leaves (epilogue_sm90.py, split_epilogue.py).
Each family's exported function is one host entry below (call_dense, call_varlen, call_kvcache):
it adapts the family's C ABI and launches the same `kernel`.

Design (FlashAttention-3/4 on Hopper, see docs/DESIGN.md):
- Warp specialisation: warpgroup 0 is the producer (one warp issues TMA loads of Q once and of K/V
  tiles through a `stages`-deep mbarrier pipeline); warpgroups 1..n are consumers, 64 query rows each,
  issuing wgmma and doing the softmax in registers. setmaxnreg moves registers from producer to
  consumers. (The FP8 chunk tile adds a warpgroup after the consumers' that widens K and V to fp16:
  cfg.widen_wg, widen_kv.)
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
- A linear tile scheduler (tile_scheduler.py) maps a 1-D grid to (m-block, head, batch[, split]);
  causal and local tiles are issued longest first (reverse m-block order) to shorten the tail.

What the seams change (seams.py lists them):
- Varlen: a tile is (m_block, head, batch) of packed (total_tokens, heads, head_dim) tensors, with
  batch's rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b], + seqused_k[b])
  (clamped to the sequence's own keys). Tiles whose m_block starts past the sequence's end exit at
  once; the grid is sized by max_seqlen_q. Q and K/V are TMA boxes at the sequence's offset
  (`cute.domain_offset`): a box may run into the next sequence's rows, which only feed masked scores
  or rows that are not stored. O and LSE are stored from registers with a row predicate. Rows past
  cu_seqlens_q[batch] (padding) get o = 0 and lse = -inf (or the sink) from an extra pseudo-batch.
- KV cache (decode): pack-GQA tiles are (m_block, kv head, batch, split) whose TILE_M rows are the
  (query, q-head) pairs of the q-heads sharing the KV head, so each K/V block is read once per group.
  seqlen_k = cache_seqlens[b] clamped to the capacity; K/V come from a contiguous cache or, paged,
  in page_rows-row TMA pieces (16, or 1 for other page sizes) from the pages the page table names
  (ids clamped into the pool).
  Split-KV divides a tile's key blocks over num_splits CTAs; the last of them to finish merges the
  partials (split_epilogue.merge_splits_if_last), or the combine kernel does.
- Keys past a sequence's end that a K/V block still covers (varlen, KV cache) are masked to -inf,
  but the tensor core computes 0 * NaN = NaN, so their V rows are zeroed in shared memory before the
  PV gemm (clear_v_rows; FwdSeams.keys_past_end).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from fa4_jax.kernels import epilogue_sm90 as epi
from fa4_jax.kernels import fp8_widen_layout as wl
from fa4_jax.kernels import split_epilogue
from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.config import Sm90FwdConfig
from fa4_jax.kernels.decode_fp8_sm90 import Fp8DecodeTile
from fa4_jax.kernels.fp8_decode_layout import merge_smem_bytes
from fa4_jax.kernels.loaders import PAGE_ROWS, PAGE_ROWS_CHOICES, KVLoader, gather_packed_q, sequence_rows
from fa4_jax.kernels.loaders import row_thread_layout, tma_tile_copy
from fa4_jax.kernels.mask import ScoreMask
from fa4_jax.kernels import phase_times
from fa4_jax.kernels.named_barrier import NamedBarrierFwd
from fa4_jax.kernels.seams import Epilogue, FwdSeams, KVLoad, QLoad, Scheduler, Seqlens
from fa4_jax.kernels.seqlen import SeqlenInfo
from fa4_jax.kernels.softmax import OnlineSoftmax
from fa4_jax.kernels.tile_problem import TileProblem
from fa4_jax.kernels.tile_order import lpt_section_pairs
from fa4_jax.kernels.tile_scheduler import StaticPersistentTileScheduler, TileHandout
from fa4_jax.kernels.utils import acc_as_frag_a, acc_as_mn, permute_modes, pow2, row_max, store_16bit, transpose_2d
from fa4_jax.kernels.utils import fp8_q_exponent, wgmma
from fa4_jax.kernels.warp_ptx import e4m3x4_to_f16x2x2, lds, sts_b32x4

# FP8 K/V with cfg.producer_widens_v: the producer warps that widen V blocks (warp 0 issues the loads);
# with cfg.producer_widens_k (and cfg.widen_wg) the widening warpgroup after the consumers' instead.
WIDEN_WARPS = (1, 2)
# ... each thread's copies of a block in rounds of this many loads, then their stores (40 registers).
WIDEN_LOADS_PER_ROUND = 8

_LOG2E = 1.4426950408889634
# (tile_n, head_dim, stages, layouts) that check_widen_layouts has checked in this process.
_WIDEN_LAYOUTS_CHECKED: set = set()


class FlashAttentionForwardSm90:
    """One compiled instance per variant; `__init__` holds compile-time configuration only."""

    def __init__(self, cfg: Sm90FwdConfig, mask: str, softcap: bool, seams: FwdSeams | None = None,
                 page_rows: int = PAGE_ROWS):
        # FP8 K/V (cfg.kv_fp8, KV-cache tiles): see dequant(), widen_kv() and quantize_q().
        self.kv_fp8 = cfg.kv_fp8
        # ... whose V (and K) the consumer widens itself (else self.widen_warps do, producer warps or the
        # widening warpgroup: widen_kv), unless the tile is the few-row FP8 decode tile, which widens nothing in shared memory.
        self.fp8_decode = cfg.fp8_decode
        self.consumer_widens_v = cfg.kv_fp8 and not cfg.producer_widens_v and not cfg.fp8_decode
        self.consumer_widens_k = cfg.kv_fp8 and not cfg.producer_widens_k and not cfg.fp8_decode
        self.widen_warps = WIDEN_WARPS
        if cfg.widen_wg:
            # K and V, by the warpgroup after the consumers' (one warp per SM sub-partition: their
            # conversions share the ALU pipe with the consumer warps there, docs/PERF.md).
            first = 4 * (1 + cfg.num_consumer_wg)
            self.widen_warps = tuple(range(first, first + wl.WARPS))
        # With cfg.producer_widens_k, V blocks without a sequence end widen unmasked (the row masks
        # cost one SEL per stored word, as much as the conversions: docs/PERF.md 2026-12-06). The
        # widening loop then runs in two phases of (first block index, V rows masked): the highest
        # block alone -- the only one that can hold the sequence's end, as n_block_max <=
        # ceil(seqlen_k / tile_n) -- then the others without masks. Else one phase, every block masked.
        self.widen_phases = ((0, True), (1, False)) if cfg.producer_widens_k else ((0, True),)
        # Softcapped tiles of two or more consumer warpgroups skip O's rescale in a warp whose rows all
        # kept their max (_rescale_o): bitwise the same numbers; the softcapped softmax's extra MUFU op
        # per score makes the saved multiplies count there (H100 2026-12-06: softcapped prefill and
        # chunk rows 0.94-0.97x the time in two calls; plain rows gained nothing, docs/PERF.md).
        self.skip_unit_rescale = softcap and cfg.num_consumer_wg > 1
        self.cfg = cfg
        self.mask = mask  # "full" | "causal" | "local" (see block_info.py)
        self.softcap = softcap
        self.seams = FwdSeams.dense() if seams is None else seams
        self.page_rows = page_rows  # paged K/V: rows per piece (loaders.PAGE_ROWS_CHOICES)
        # Per-CTA phase timestamps for tools/decode_phases.py: KV-cache kernels built with
        # FA4_JAX_PHASE_TIMES=1 only (phase_times.py).
        self.stamps = phase_times.Stamps(phase_times.ENABLED and self.seams.seqlens is Seqlens.CACHE)
        # One-row pieces: the producer warpgroup gathers K/V rows with cp.async (KVLoader), since one
        # TMA box per 256-byte row is issue-bound (measured: 0.5 TB/s at page size 1).
        self.kv_gather = self.seams.kv_load is KVLoad.PAGED and page_rows == 1
        if self.seams.q_load is QLoad.PACKED_GQA and (cfg.num_consumer_wg > 2 or cfg.separate_o):
            # The row gather and the per-row stores are written for one or two warpgroups that store
            # O from registers.
            raise ValueError("pack-GQA tiles use one or two consumer warpgroups and no O staging")
        if self.kv_fp8 and (self.seams.q_load is not QLoad.PACKED_GQA
                            or cfg.num_consumer_wg != (2 if cfg.producer_widens_k else 1)):
            # A buffer the consumer widens is one warpgroup's: it converts a block, then its gemms read
            # it. Two warpgroups read rings the producer widens (cfg.producer_widens_k).
            raise ValueError("FP8 K/V: KV-cache tiles of one consumer warpgroup, or two with producer_widens_k")
        if cfg.producer_widens_v and (not self.kv_fp8 or self.kv_gather):
            # One-row pages take the whole producer warpgroup to gather rows: no warps left to widen V.
            raise ValueError("producer_widens_v: FP8 K/V loaded by TMA only")
        # The FP8 decode tile's consumer (decode_fp8_sm90.py; None: the wgmma consumer of this file).
        self.fp8_tile = Fp8DecodeTile(cfg, softcap) if cfg.fp8_decode else None
        if cfg.fp8_decode and not (self.seams.q_load is QLoad.PACKED_GQA and mask == "local"
                                   and self.seams.epilogue is Epilogue.SPLIT_PARTIALS):
            # It gathers pack-GQA rows, masks by runtime window bounds and stores as split_store does.
            raise ValueError("the FP8 decode tile is the KV-cache family's (pack-GQA rows, `local` mask, split partials)")
        if page_rows not in PAGE_ROWS_CHOICES:
            raise ValueError(f"page_rows must be one of {PAGE_ROWS_CHOICES}; got {page_rows}")
        # Tiles from the handler's counter (TileHandout) when it passes one: every dense kernel; the
        # KV-cache tiles whose config says so (cfg.tile_handout: the 16-bit chunk tile). The handout
        # counts the TMA producer warps in its barriers (warp 0, or cfg.copy_warps of them) and allows
        # no warps that walk the tiles on their own (the FP8 widening warps, the row gather's).
        self.tile_handout = self.seams.seqlens is Seqlens.DENSE or (self.seams.seqlens is Seqlens.CACHE
                                                                     and cfg.tile_handout)
        if self.tile_handout and (self.kv_gather or cfg.producer_widens_v):
            raise ValueError("tile_handout: TMA producer warps only (no row gather, no widening warps)")
        if cfg.copy_warps > 1 and not (self.seams.kv_load is KVLoad.PAGED and not self.kv_gather
                                       and not (cfg.producer_widens_v and not cfg.widen_wg) and cfg.copy_warps <= 4
                                       and (cfg.tile_n // page_rows) % cfg.copy_warps == 0
                                       and self.seams.q_load is QLoad.PACKED_GQA):
            # Each warp issues whole pieces of every block; the widening warps are not free to; a TMA Q
            # (armed once per tile, load_blocks) would be armed by every copy warp.
            raise ValueError("copy_warps: paged TMA pieces shared out evenly over up to four producer warps")
        if self.seams.kv_load is KVLoad.PAGED and (cfg.tile_n % page_rows or cfg.tile_n % 32):
            raise ValueError(f"paged tiles need tile_n % {page_rows} == 0 and tile_n % 32 == 0: {cfg.tile_n=}")

    # ------------------------------------------------------------------------------------------
    # Host side: one entry per family's C ABI (fa4_jax/ops/<family>/spec.py), then one launch.
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def call_dense(
        self,
        mQ: cute.Tensor,  # (b, s_q, h_q, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, d)
        mO: cute.Tensor,  # (b, s_q, h_q, d)
        mLSE: cute.Tensor,  # (b, h_q, s_q) float32
        mSinks: cute.Tensor,  # (h_q,) float32 sink logits, -inf = none
        mTileCounter: cute.Tensor,  # (1,) int32 zero-at-rest counter: tiles handed out (TileHandout); (0,): static
        softmax_scale_log2: Float32,  # log2(e) * (softcap if softcap else softmax_scale)
        softcap_prescale: Float32,  # softmax_scale / softcap (softcap variants only)
        window_left: Int32,  # local variants only, clamped by the handler
        window_right: Int32,
        max_ctas: Int32,  # CTAs that fit on the device at once (SM count): the persistent grid
        stream: cuda.CUstream,
    ):
        self.expect(Seqlens.DENSE)
        self.check_dtypes(mQ, mK, mV, mO)
        # (b, s, h, d) -> (s, d, h, b): tiles are (rows, head_dim) with head_dim contiguous.
        mQ, mK, mV, mO = [permute_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = permute_modes(mLSE, [2, 1, 0])  # (s_q, h_q, b)
        num_m_blocks = cute.ceil_div(mQ.shape[0], self.cfg.tile_m)
        # The handler passes the SM count (persistent grid; with a tile counter where tiles differ in
        # work: TileHandout, see ffi/fwd.cc) or max_ctas >= tiles (one CTA per tile). Without a separate
        # O buffer (hd > 128) a CTA's next Q load waits for its O store to have read Q's buffer
        # (consume_tile), while the next tile's first K/V stream in under the epilogue.
        if const_expr(self.cfg.ctas_per_sm > 1):  # max_ctas counts SMs: a persistent grid fills every slot
            max_ctas = cutlass.min(max_ctas, Int32((2**31 - 1) // self.cfg.ctas_per_sm)) * self.cfg.ctas_per_sm
        grid = StaticPersistentTileScheduler.grid(num_m_blocks, mQ.shape[2], mQ.shape[3], max_ctas)
        self.launch(grid, stream, mQ, mK, mV, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale,
                    window_left, window_right, mTileCounter=mTileCounter)

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
        max_ctas: Int32,  # persistent grid (full masks: tiles carry similar work) or every tile
        stream: cuda.CUstream,
    ):
        self.expect(Seqlens.VARLEN)
        self.check_dtypes(mQ, mK, mV, mO)
        # (t, h, d) -> (t, d, h): tiles are (rows, head_dim) with head_dim contiguous.
        mQ, mK, mV, mO = [permute_modes(t, [0, 2, 1]) for t in (mQ, mK, mV, mO)]
        num_m_blocks = cute.ceil_div(max_seqlen_q, self.cfg.tile_m)
        # batch + 1: the last "batch" zero-fills the rows past cu_seqlens_q[batch]. The handler asks
        # for a persistent grid where tiles carry similar work (as for the dense kernel, ffi/fwd.cc).
        grid = StaticPersistentTileScheduler.grid(num_m_blocks, mQ.shape[2], mCuSeqlensQ.shape[0], max_ctas)
        self.launch(grid, stream, mQ, mK, mV, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale,
                    window_left, window_right, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK,
                    mSequsedK=mSequsedK, num_m_blocks=num_m_blocks)

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
        mKScale: cute.Tensor,  # (h_k,) float32: FP8 caches' scales (read by kv_fp8 variants only)
        mVScale: cute.Tensor,
        mTileCounter: cute.Tensor,  # (1,) int32 zero-at-rest counter: tiles handed out (cfg.tile_handout
        # variants, TileHandout); (0,): each CTA walks its static sequence
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,
        ragged: Int32,  # 1: sequence b's rows are [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of s_q
        max_seqlen_q: Int32,  # bounds every sequence's rows (s_q when not ragged): the grid
        n_listed: Int32,  # > 0: the grid is mTileList's tiles (ops/kvcache/tiles.py), else every m-block
        max_ctas: Int32,  # cfg.tile_handout variants: the persistent grid (the SM count), else ignored
        stream: cuda.CUstream,
    ):
        self.expect(Seqlens.CACHE)
        self.check_dtypes(mQ, mK, mV, mO, self.kv_fp8)
        # K/V: (rows, d, h_k, batch-or-page) for TMA, head_dim contiguous. Q, O and LSE keep their
        # layout: pack-GQA rows are gathered and stored one by one.
        mK, mV = [permute_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]
        qhead_per_kv = mQ.shape[2] // mK.shape[2]
        num_m_blocks = cute.ceil_div(max_seqlen_q * qhead_per_kv, self.cfg.tile_m)
        # One CTA per tile, or (cfg.tile_handout, as the handler asks) a persistent grid of max_ctas
        # per SM-slot that takes its tiles from mTileCounter. A ragged batch adds the pseudo-batch that
        # writes the rows no sequence owns.
        # A tile list replaces the (m_block, sequence) grid by its n_listed entries.
        batches = mSeqlensK.shape[0] + ragged
        listed = cutlass.min(n_listed, 1)
        blocks_x_batches = listed * n_listed + (1 - listed) * num_m_blocks * batches
        ctas = blocks_x_batches * mK.shape[2] * num_splits
        if const_expr(self.tile_handout):
            ctas = cutlass.min(ctas, cutlass.min(max_ctas, Int32((2**31 - 1) // self.cfg.ctas_per_sm))
                               * self.cfg.ctas_per_sm)
        grid = StaticPersistentTileScheduler.grid(blocks_x_batches, mK.shape[2], 1, ctas, num_splits)
        self.launch(grid, stream, mQ, mK, mV, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale,
                    window_left, window_right, mPageTable=mPageTable, mSeqlensK=mSeqlensK, mOaccum=mOaccum,
                    mLSEaccum=mLSEaccum, mCuSeqlensQ=mCuSeqlensQ, num_splits=num_splits, kv_len=mK.shape[0],
                    num_m_blocks=num_m_blocks, ragged=ragged, mTileList=mTileList, n_listed=n_listed,
                    mSemaphores=mSemaphores, mKScale=mKScale, mVScale=mVScale, mTileCounter=mTileCounter)

    def expect(self, seqlens: Seqlens):
        """An entry point adapts one family's C ABI, i.e. the tensors of one seqlens seam."""
        if self.seams.seqlens is not seqlens:
            raise TypeError(f"this kernel is configured for {self.seams}, not {seqlens}")

    @staticmethod
    def check_dtypes(mQ, mK, mV, mO, kv_fp8: bool = False):
        if const_expr(kv_fp8):
            if const_expr(not (mQ.element_type == mO.element_type
                               and mK.element_type == mV.element_type == cutlass.Float8E4M3FN)):
                raise TypeError("FP8 K/V: k and v float8_e4m3fn, q and o of one 16-bit dtype")
        elif const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type)):
            raise TypeError("q, k, v and o must share one dtype")

    def launch(self, grid, stream, mQ, mK, mV, mO, mLSE, mSinks, softmax_scale_log2, softcap_prescale,
               window_left, window_right, mPageTable=None, mSeqlensK=None, mOaccum=None, mLSEaccum=None,
               mCuSeqlensQ=None, mCuSeqlensK=None, mSequsedK=None, num_splits=None, kv_len=None,
               num_m_blocks=None, ragged=None, mTileList=None, n_listed=None, mSemaphores=None, mKScale=None,
               mVScale=None, mTileCounter=None):
        """TMA descriptors, shared storage and the launch of `kernel`, for the seams' tensors (the
        others None). K/V, and Q and O where TMA moves them, are (rows, d, h[, b]) here."""
        cfg, seams = self.cfg, self.seams
        dtype = mQ.element_type
        kv_dtype = mK.element_type  # (mK becomes a TMA coordinate tensor below)
        # FP8 K/V: the gemms run in fp16 on Q scaled into fp16's range and the widened K/V. (The FP8
        # decode tile's warp mmas need no tiled MMA objects.)
        tiled_mma_qk = tiled_mma_pv = None
        if const_expr(not self.fp8_decode):
            tiled_mma_qk, tiled_mma_pv = self.make_tiled_mmas(self.mma_dtype(dtype), cfg.num_consumer_wg)
        sQ_layout, sKV_layout = self.make_smem_layouts(dtype)
        sKV16_layout = sV16_layout = None
        if const_expr(self.fp8_decode):
            sKV_layout = self.make_smem_layouts(kv_dtype)[1]
            Fp8DecodeTile.check_stage_layout(sKV_layout, cfg.head_dim, cfg.stages)
        elif const_expr(self.kv_fp8):
            sKV16_layout = self.make_smem_layouts(cutlass.Float16, stages=cfg.stages if cfg.producer_widens_k else 1)[1]
            sV16_layout = self.make_smem_layouts(cutlass.Float16, stages=cfg.stages)[1] if cfg.producer_widens_v \
                else sKV16_layout
            sKV_layout = self.make_smem_layouts(kv_dtype)[1]  # the FP8 stages TMA fills
            if const_expr(cfg.producer_widens_k):
                self.check_widen_layouts(sKV_layout, sKV16_layout, sV16_layout, cfg.tile_n, cfg.head_dim, cfg.stages)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q = tma_atom_O = None
        if const_expr(seams.q_load is QLoad.TMA):
            tma_atom_Q, mQ = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (cfg.tile_m, cfg.head_dim))
            self.q_bytes = cute.size_in_bytes(dtype, sQ_layout)
        kv_tile = cute.select(sKV_layout, mode=[0, 1])
        self.kv_bytes = cute.size_in_bytes(kv_dtype, kv_tile)
        tma_atom_K = tma_atom_V = None  # kv_gather: cp.async from the tensors themselves
        if const_expr(not self.kv_gather):
            # A paged block is tile_n / page_rows TMA pieces, each into its rows of the stage's tile.
            paged = seams.kv_load is KVLoad.PAGED
            box_rows = self.page_rows if const_expr(paged) else cfg.tile_n
            kv_box = cute.composition(kv_tile, (box_rows, cfg.head_dim)) if const_expr(paged) else kv_tile
            tma_atom_K, mK = cpasync.make_tiled_tma_atom(load_op, mK, kv_box, (box_rows, cfg.head_dim), 1)
            tma_atom_V, mV = cpasync.make_tiled_tma_atom(load_op, mV, kv_box, (box_rows, cfg.head_dim), 1)
        sO_size = 0
        if const_expr(seams.epilogue is Epilogue.TMA_STORE):
            # O has Q's smem layout (its own buffer when cfg.separate_o, else Q's); the TMA unit
            # clips rows past seqlen_q.
            tma_atom_O, mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (cfg.tile_m, cfg.head_dim)
            )
            sO_size = cute.cosize(sQ_layout) if cfg.separate_o else 0
        self.shared_storage = self.make_shared_storage(dtype, sQ_layout, sKV_layout, sO_size, kv_dtype, sKV16_layout,
                                                       sV16_layout)
        # The launch takes the struct's size: past cfg.smem_limit, fewer CTAs than cfg.ctas_per_sm
        # would be resident (silently: the three 2-CTA decode configs of 2026-12-02 ran one per SM).
        if self.shared_storage.size_in_bytes() > cfg.smem_limit:
            raise ValueError(f"shared storage of {self.shared_storage.size_in_bytes()} bytes > {cfg.smem_limit} "
                             f"({cfg.ctas_per_sm} CTAs per SM); the config counted {cfg.smem_bytes}")

        self.kernel(
            mQ, mK, mV, mPageTable, mSeqlensK, mO, mLSE, mOaccum, mLSEaccum, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
            mTileList, mSemaphores, mKScale, mVScale, mTileCounter,
            mSinks, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, softmax_scale_log2, softcap_prescale,
            window_left, window_right, num_splits, kv_len, num_m_blocks, ragged, n_listed, sQ_layout, sKV_layout,
            sKV16_layout, sV16_layout, tiled_mma_qk, tiled_mma_pv,
        ).launch(grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream, **self.residency_kwargs())

    def residency_kwargs(self) -> dict:
        """Launch options: registers bounded for cfg.launch_ctas CTAs per SM. With more than one, the
        all-shared-memory carveout is stated (percent): the DSL would otherwise ask the device for its
        per-SM shared memory at compile time, and the build runs GPU-blind."""
        if self.cfg.launch_ctas == 1:
            return dict(min_blocks_per_mp=1)
        return dict(min_blocks_per_mp=self.cfg.launch_ctas, preferred_smem_carveout=100)

    # ------------------------------------------------------------------------------------------
    # Building blocks (called while tracing: plain Python that emits the same code wherever used).
    # ------------------------------------------------------------------------------------------
    def make_shared_storage(self, dtype, sQ_layout, sKV_layout, sO_size: int | None, kv_dtype=None,
                            sKV16_layout=None, sV16_layout=None):
        """Q's mbarriers only where TMA loads Q; the sO field only for the TMA_STORE epilogue
        (size 0 when O reuses Q's buffer). FP8 K/V (sKV16_layout given): the stages in kv_dtype, the
        widened fp16 K buffer (a ring of stages with its mbarriers when the producer widens K) and V
        buffer (sV16_layout: likewise when the producer widens V), the Q scale's cross-warp slots."""
        cfg = self.cfg
        mbar = cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]

        def smem(n, t=dtype):
            return cute.struct.Align[cute.struct.MemRange[t, n], 1024]

        fields = {}
        if self.seams.q_load is QLoad.TMA:
            fields["mbar_q"] = cute.struct.MemRange[cutlass.Int64, 2]
        # (Shared-memory structs hold DSL scalar types: FP8 stages are bytes, viewed as FP8 in kernel.)
        kv_dtype = dtype if kv_dtype is None else (cutlass.Uint8 if self.kv_fp8 else kv_dtype)
        fields.update(mbar_k=mbar, mbar_v=mbar)
        if cfg.producer_widens_v:
            fields["mbar_v16"] = mbar  # the fp16 V ring (make_pipelines)
        if cfg.producer_widens_k:
            fields["mbar_k16"] = mbar  # ... and K's
        if not self.fp8_decode:  # (the FP8 decode tile keeps Q in registers)
            fields["sQ"] = smem(cute.cosize(sQ_layout))
        fields.update(sK=smem(cute.cosize(sKV_layout), kv_dtype), sV=smem(cute.cosize(sKV_layout), kv_dtype))
        if self.fp8_decode:
            fields["merge"] = smem(merge_smem_bytes(cfg.head_dim) // 4, Float32)  # the warps' partial results
        elif self.kv_fp8:
            fields.update(sK16=smem(cute.cosize(sKV16_layout), cutlass.Float16),
                          sV16=smem(cute.cosize(sV16_layout), cutlass.Float16),
                          q_amax=cute.struct.MemRange[Float32, 4 * cfg.num_consumer_wg])
        if self.seams.epilogue is Epilogue.TMA_STORE:
            fields["sO"] = smem(sO_size)
        if self.seams.epilogue is Epilogue.SPLIT_PARTIALS:
            fields["merge_flag"] = cute.struct.MemRange[Int32, 1]  # split_epilogue.merge_splits_if_last's verdict
        if self.tile_handout:
            fields["next_tile"] = cute.struct.MemRange[Int32, 1]  # TileHandout's slot
        fields.update(phase_times.smem_fields(self.stamps.on))
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

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

    def make_smem_layouts(self, dtype, stages: int | None = None):
        """(sQ_layout (tile_m, d), sKV_layout (tile_n, d, stages: cfg.stages unless given)), swizzled
        rows (128 bytes where the row is that long)."""
        cfg = self.cfg
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cfg.head_dim), dtype
        )
        sQ_layout = cute.tile_to_shape(atom, (cfg.tile_m, cfg.head_dim), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (cfg.tile_n, cfg.head_dim, cfg.stages if stages is None else stages),
                                        order=(0, 1, 2))
        return sQ_layout, sKV_layout

    def mma_dtype(self, dtype):
        """The gemms' operand type: q's, or fp16 with FP8 K/V (e4m3 widens to fp16 exactly)."""
        return cutlass.Float16 if self.kv_fp8 else dtype

    def make_pipelines(self, storage, with_q: bool = True):
        """TMA pipelines for Q (one stage; None without with_q), K and V (cfg.stages each), from the
        storage's mbar_q / mbar_k / mbar_v, and with cfg.producer_widens_v the fp16 V ring's
        (mbar_v16; else None): its producers are self.widen_warps' threads, which are also the FP8 V
        stages' consumers (one signalling lane per warp releases); likewise K's with
        cfg.producer_widens_k (mbar_k16). Ends with the barrier-init fence and a CTA sync. Returns
        (pipe_q, pipe_k, pipe_v, pipe_k16, pipe_v16)."""
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
        if const_expr(self.kv_gather):
            # Every producer thread's cp.async copies arrive on the full barrier (noinc) when they land;
            # every consumer thread releases a stage.
            pipe_k, pipe_v = (
                pipeline.PipelineCpAsync.create(
                    barrier_storage=mbar.data_ptr(), num_stages=cfg.stages,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * cfg.num_consumer_wg),
                    defer_sync=True,
                )
                for mbar in (storage.mbar_k, storage.mbar_v)
            )
        else:
            widen_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, len(self.widen_warps))
            k_consumers = widen_warps if const_expr(cfg.producer_widens_k) else consumers
            v_consumers = widen_warps if const_expr(cfg.producer_widens_v) else consumers
            pipe_k, pipe_v = (
                pipeline.PipelineTmaAsync.create(
                    barrier_storage=mbar.data_ptr(), num_stages=cfg.stages, producer_group=producer,
                    consumer_group=group, tx_count=self.kv_bytes, defer_sync=True,
                )
                for mbar, group in ((storage.mbar_k, k_consumers), (storage.mbar_v, v_consumers))
            )

        def widened_ring(mbar):
            # Every widening thread arrives once its stores are fenced; every consumer thread releases.
            return pipeline.PipelineAsync.create(
                barrier_storage=mbar.data_ptr(), num_stages=cfg.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.widen_warps)),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * cfg.num_consumer_wg),
                defer_sync=True,
            )

        pipe_k16 = widened_ring(storage.mbar_k16) if const_expr(cfg.producer_widens_k) else None
        pipe_v16 = widened_ring(storage.mbar_v16) if const_expr(cfg.producer_widens_v) else None
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipe_q, pipe_k, pipe_v, pipe_k16, pipe_v16

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
    def load_blocks(self, copy_k, copy_v, copy_q, pipe_q, q_state, pipe_k, pipe_v, state, n_block_min, n_block_max,
                    lookup=None):
        """The producer's order for one tile: K of the first (highest) block, then Q (copy_q, unless
        None: pack-GQA consumers gather Q themselves), then K_{j-1} and V_j in turn, V of the lowest
        block last -- the order the consumers use them. K comes before Q because its stage frees
        during the previous tile's last blocks, while Q's buffer frees only after that tile's last
        QK gemm. copy_k / copy_v(n_block, stage, barrier, page, within), copy_q(barrier) issue the
        copies. lookup(n_block) (paged caches: KVLoader.lookup) is issued one block ahead of the
        copies that use it; K_j and V_j share one lookup. Returns the advanced (state, q_state)."""
        if const_expr(lookup is None):
            lookup = lambda n: (Int32(0), Int32(0))  # noqa: E731 - contiguous: nothing to look up
        acquire = self._producer_acquire
        # producer_commit: a no-op for TMA (the copies complete the barrier's transaction bytes); the
        # cp.async gather's arrive on the full barrier once the thread's copies have landed.
        k_page, k_within = lookup(n_block_max - 1)
        next_page, next_within = lookup(n_block_max - 2)
        acquire(pipe_k, state)
        copy_k(n_block_max - 1, state.index, pipe_k.producer_get_barrier(state), k_page, k_within)
        pipe_k.producer_commit(state)
        self.stamps.producer_at(phase_times.FIRST_K_ISSUED)
        v_page, v_within = k_page, k_within
        if const_expr(copy_q is not None):
            pipe_q.producer_acquire(q_state)
            copy_q(pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_prev = n_block_max - 1 - i
            k_page, k_within = next_page, next_within
            next_page, next_within = lookup(n_prev - 2)
            prev = state.clone()
            state.advance()
            acquire(pipe_k, state)
            copy_k(n_prev - 1, state.index, pipe_k.producer_get_barrier(state), k_page, k_within)
            pipe_k.producer_commit(state)
            acquire(pipe_v, prev)
            copy_v(n_prev, prev.index, pipe_v.producer_get_barrier(prev), v_page, v_within)
            pipe_v.producer_commit(prev)
            v_page, v_within = k_page, k_within
        acquire(pipe_v, state)
        copy_v(n_block_min, state.index, pipe_v.producer_get_barrier(state), v_page, v_within)
        pipe_v.producer_commit(state)
        state.advance()
        return state, q_state

    @cute.jit
    def _producer_acquire(self, pipe, state):
        """A K/V stage for the producer's copies: wait until it is free, and (warp 0) arm its full
        barrier for the block's bytes. With cfg.copy_warps > 1 the other warps only wait: their TMA
        pieces complete transaction bytes on the same barrier, which cannot complete its phase before
        warp 0's arrive (the arrive and its expected bytes come together, and a transaction count may
        run below zero until then)."""
        if const_expr(self.cfg.copy_warps > 1):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                pipe.producer_acquire(state)
            else:
                pipe.sync_object_empty.wait(state.index, state.phase)
        else:
            pipe.producer_acquire(state)

    # ------------------------------------------------------------------------------------------
    # Device side.
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA Q: the TMA tensor; pack-GQA: (b, s_q, h_q, d)
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPageTable: Optional[cute.Tensor],
        mSeqlensK: Optional[cute.Tensor],
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOaccum: Optional[cute.Tensor],
        mLSEaccum: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        mTileList: Optional[cute.Tensor],  # KV cache: (sequence, m_block) pairs when n_listed > 0
        mSemaphores: Optional[cute.Tensor],  # KV cache: zero-at-rest counters of the fused combine (TileProblem)
        mKScale: Optional[cute.Tensor],  # FP8 K/V: (h_k,) float32 scales
        mVScale: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],  # self.tile_handout: (1,) the handout's counter, or (0,)
        mSinks: cute.Tensor,
        tma_atom_Q: Optional[cute.CopyAtom],
        tma_atom_K: Optional[cute.CopyAtom],  # None: K/V gathered by cp.async (kv_gather)
        tma_atom_V: Optional[cute.CopyAtom],
        tma_atom_O: Optional[cute.CopyAtom],
        softmax_scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Optional[Int32],
        kv_len: Optional[Int32],  # KV cache: contiguous: capacity; paged: page_size
        num_m_blocks: Optional[Int32],  # varlen / KV cache: from max_seqlen_q
        ragged: Optional[Int32],  # KV cache: rows from cu_seqlens_q
        n_listed: Optional[Int32],  # KV cache: entries of mTileList (0: no list)
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sKV16_layout: Optional[cute.ComposedLayout],  # FP8 K/V: the widened fp16 K buffer (a ring with
        sV16_layout: Optional[cute.ComposedLayout],  # cfg.producer_widens_k) and V's (cfg.producer_widens_v)
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        self.stamps.start(storage)
        pipe_q, pipe_k, pipe_v, pipe_k16, pipe_v16 = self.make_pipelines(storage,
                                                                         with_q=self.seams.q_load is QLoad.TMA)

        sQ = None
        if const_expr(not self.fp8_decode):
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        kv_dtype = cutlass.Float8E4M3FN if const_expr(self.kv_fp8) else None  # (mK is TMA coordinates here)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner, dtype=kv_dtype)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner, dtype=kv_dtype)
        sO = None
        if const_expr(self.seams.epilogue is Epilogue.TMA_STORE):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner) if const_expr(cfg.separate_o) else sQ
        sMergeFlag = None
        if const_expr(self.seams.epilogue is Epilogue.SPLIT_PARTIALS):
            sMergeFlag = storage.merge_flag.get_tensor(cute.make_layout(1))
        fp8 = None
        if const_expr(self.kv_fp8 and not self.fp8_decode):
            fp8 = _Fp8Tile(sK, sV, storage.sK16.get_tensor(sKV16_layout.outer, swizzle=sKV16_layout.inner),
                           storage.sV16.get_tensor(sV16_layout.outer, swizzle=sV16_layout.inner),
                           storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner, dtype=cutlass.Float16),
                           storage.q_amax.get_tensor(cute.make_layout(4 * cfg.num_consumer_wg)), mKScale, mVScale,
                           tuple(x.data_ptr().toint() for x in (storage.sK, storage.sV, storage.sK16, storage.sV16)))

        scheduler, problem = self.make_tile_problem(mQ, mK, mPageTable, mSeqlensK, mCuSeqlensQ, mCuSeqlensK,
                                                    mSequsedK, window_left, window_right, num_splits, kv_len,
                                                    num_m_blocks, ragged, mTileList, n_listed, mSemaphores)
        handout = None  # tiles from the handler's counter when it passes one (TileHandout)
        if const_expr(self.tile_handout):
            handout = TileHandout(mTileCounter, storage.next_tile.get_tensor(cute.make_layout(1)), scheduler.total,
                                  128 * cfg.num_consumer_wg, cfg.copy_warps)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if const_expr(self.kv_gather):  # the whole producer warpgroup gathers K/V rows
                self.load(mQ, mK, mV, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                          pipe_q, pipe_k, pipe_v, scheduler, problem, kv_len)
            elif warp_idx < cfg.copy_warps:  # warp 0, or (paged, cfg.copy_warps) warps sharing its copies
                self.load(mQ, mK, mV, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                          pipe_q, pipe_k, pipe_v, scheduler, problem, kv_len, handout)
            elif const_expr(cfg.producer_widens_v and not cfg.widen_wg):
                if warp_idx <= self.widen_warps[-1]:
                    self.widen_kv(pipe_k, pipe_v, pipe_k16, pipe_v16, fp8, scheduler, problem)
        elif const_expr(cfg.widen_wg):
            # The widening warpgroup comes after the consumers': warps self.widen_warps.
            if warp_idx >= self.widen_warps[0]:
                cute.arch.setmaxregister_decrease(cfg.widen_regs)
                self.widen_kv(pipe_k, pipe_v, pipe_k16, pipe_v16, fp8, scheduler, problem)
            else:
                self.consumers(mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale, mVScale, storage, sQ, sK, sV, sO,
                               tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, pipe_k16, pipe_v16,
                               softmax_scale_log2, softcap_prescale, scheduler, problem, sMergeFlag, fp8, handout)
        else:
            self.consumers(mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale, mVScale, storage, sQ, sK, sV, sO,
                           tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, pipe_k16, pipe_v16,
                           softmax_scale_log2, softcap_prescale, scheduler, problem, sMergeFlag, fp8, handout)

    @cute.jit
    def consumers(self, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale, mVScale, storage, sQ, sK, sV, sO,
                  tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, pipe_k16, pipe_v16,
                  softmax_scale_log2, softcap_prescale, scheduler, problem, sMergeFlag, fp8, handout):
        """The consumer warpgroups' part of the kernel: their registers, then their tiles."""
        cfg = self.cfg
        cute.arch.setmaxregister_increase(cfg.consumer_regs)
        if const_expr(self.fp8_decode):
            self.fp8_tile.consume(mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale, mVScale,
                                  storage.sK.data_ptr().toint(), storage.sV.data_ptr().toint(),
                                  storage.merge.data_ptr().toint(), pipe_k, pipe_v, softmax_scale_log2,
                                  softcap_prescale, scheduler, problem, sMergeFlag)
        else:
            # With the producer widening V (and K), the consumers' V (and K) pipeline is the fp16
            # ring: they read it as the 16-bit kernels do (fp8.sV16 / fp8.sK16 hold its stages).
            self.consume(mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk,
                         tiled_mma_pv, pipe_q, pipe_k16 if const_expr(cfg.producer_widens_k) else pipe_k,
                         pipe_v16 if const_expr(cfg.producer_widens_v) else pipe_v,
                         softmax_scale_log2, softcap_prescale, scheduler, problem, sMergeFlag, fp8, handout)

    @cute.jit
    def make_tile_problem(self, mQ, mK, mPageTable, mSeqlensK, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
                          window_left, window_right, num_splits, kv_len, num_m_blocks, ragged, mTileList=None,
                          n_listed=None, mSemaphores=None):
        """The tile scheduler and the TileProblem of the seqlens seam: (m_block, head, batch) tiles
        of dense (s, d, h, b) tensors; of packed (t, d, h) ones, plus the padding pseudo-batch; of
        pack-GQA rows per KV head, times num_splits (ragged: plus the padding pseudo-batch)."""
        cfg = self.cfg
        seqlens = self.seams.seqlens
        lpt = self.mask != "full" and self.seams.scheduler is Scheduler.PERSISTENT
        if const_expr(seqlens is Seqlens.DENSE):
            section = 1
            if const_expr(self.mask == "causal"):  # longest first over a few pairs at a time
                section = lpt_section_pairs(mK.shape[0], cfg.head_dim, lo=cutlass.max, hi=cutlass.min)
            scheduler = StaticPersistentTileScheduler.create(cute.ceil_div(mQ.shape[0], cfg.tile_m), mQ.shape[2],
                                                             mQ.shape[3], lpt=lpt, lpt_section=section)
            seqlen = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
            blocks = BlockInfo.create(cfg.tile_m, cfg.tile_n, self.mask, seqlen, window_left, window_right)
            problem = TileProblem(seqlens, cfg.tile_m, cfg.tile_n, self.mask, window_left, window_right,
                                  dense_blocks=blocks)
        elif const_expr(seqlens is Seqlens.VARLEN):
            scheduler = StaticPersistentTileScheduler.create(num_m_blocks, mQ.shape[2], mCuSeqlensQ.shape[0],
                                                             lpt=lpt)
            problem = TileProblem(seqlens, cfg.tile_m, cfg.tile_n, self.mask, window_left, window_right,
                                  mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, mSequsedK=mSequsedK,
                                  num_batch=mCuSeqlensQ.shape[0] - 1, total_q=mQ.shape[0], num_m_blocks=num_m_blocks)
        else:
            qhead_per_kv = mQ.shape[2] // mK.shape[2]
            num_batch = mSeqlensK.shape[0]
            scheduler = StaticPersistentTileScheduler.create(num_m_blocks, mK.shape[2], num_batch + ragged,
                                                             num_splits, mTileList=mTileList, n_listed=n_listed)
            capacity = kv_len * (mPageTable.shape[1] if const_expr(self.seams.kv_load is KVLoad.PAGED) else 1)
            problem = TileProblem(seqlens, cfg.tile_m, cfg.tile_n, self.mask, window_left, window_right,
                                  mCuSeqlensQ=mCuSeqlensQ, num_batch=num_batch, num_m_blocks=num_m_blocks,
                                  mSeqlensK=mSeqlensK, seqlen_q=mQ.shape[1], ragged=ragged,
                                  qhead_per_kv=qhead_per_kv, num_splits=num_splits, capacity=capacity,
                                  mSemaphores=mSemaphores, heads_kv=mK.shape[2])
        return scheduler, problem

    @cute.jit
    def load(self, mQ, mK, mV, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
             pipe_q, pipe_k, pipe_v, scheduler: StaticPersistentTileScheduler, problem: TileProblem, kv_len,
             handout: TileHandout | None = None):
        """Producer warp, for each of the CTA's tiles: Q once (TMA Q), then K_j / V_j from block
        n_block_max - 1 down to n_block_min, in the order the consumers use them (K_j is needed
        one step before V_j). The pipeline states run on across tiles, so the next tile's Q and
        first K/V stream in while the consumers finish the current one. With a handout the producer
        takes each next tile index and passes it on to the consumers."""
        cfg = self.cfg
        heads_per_kv = 1  # pack-GQA: a tile's head is its KV head
        q_state = None  # pack-GQA: the consumers gather Q themselves
        if const_expr(self.seams.q_load is QLoad.TMA):
            heads_per_kv = mQ.shape[2] // mK.shape[2]  # GQA/MQA: q heads share kv heads in groups
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        self.stamps.begin_producer()
        copy_warp = 0  # cfg.copy_warps > 1: which of the warps sharing the copies (warp 0 takes the tiles)
        if const_expr(cfg.copy_warps > 1):
            copy_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if const_expr(handout is not None):
                if copy_warp > 0:
                    handout.consumers_begin()
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            if const_expr(problem.seqlens is not Seqlens.DENSE):
                if work.batch < problem.num_batch:  # the padding pseudo-batch loads nothing
                    state, q_state = self.load_tile(mQ, mK, mV, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K,
                                                    tma_atom_V, pipe_q, pipe_k, pipe_v, state, q_state, work,
                                                    problem, heads_per_kv, kv_len)
            else:
                state, q_state = self.load_tile(mQ, mK, mV, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K,
                                                tma_atom_V, pipe_q, pipe_k, pipe_v, state, q_state, work,
                                                problem, heads_per_kv, kv_len)
            if const_expr(handout is not None):
                if const_expr(cfg.copy_warps > 1):
                    if copy_warp == 0:
                        tile_idx = handout.producer_next(tile_idx)
                    else:
                        tile_idx = handout.consumer_next(tile_idx)
                else:
                    tile_idx = handout.producer_next(tile_idx)
            else:
                tile_idx = scheduler.next(tile_idx)
        if const_expr(self.kv_gather):
            # This thread's last copies must land before it exits (their barrier arrives are pending).
            cute.arch.cp_async_wait_group(0)
        self.stamps.end_producer()

    @cute.jit
    def load_tile(self, mQ, mK, mV, mPageTable, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                  pipe_q, pipe_k, pipe_v, state, q_state, work, problem: TileProblem, heads_per_kv, kv_len):
        cfg = self.cfg
        varlen = problem.seqlens is Seqlens.VARLEN
        seqlen = problem.seqlen(work.batch)
        blocks = problem.blocks(seqlen)
        n_block_min, n_block_max = problem.n_block_range(blocks, work)
        if const_expr(problem.seqlens is not Seqlens.DENSE):
            # The consumers skip tiles past their sequence's rows (consume): so must the loads.
            has_work = problem.has_rows(work, seqlen) and n_block_max > n_block_min
        else:
            has_work = n_block_max > n_block_min
        if has_work:
            kv = self.kv_loader(mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, work.head // heads_per_kv,
                                work.batch, seqlen, varlen, kv_len)
            if const_expr(self.seams.q_load is QLoad.TMA):
                gQ = cute.local_tile(sequence_rows(mQ, work.head, work.batch, seqlen.offset_q, varlen),
                                     (cfg.tile_m, cfg.head_dim), (work.m_block, 0))
                tQsQ, tQgQ = tma_tile_copy(tma_atom_Q, gQ, sQ)
                state, q_state = self.load_blocks(
                    kv.k, kv.v, lambda bar: cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=bar),
                    pipe_q, q_state, pipe_k, pipe_v, state, n_block_min, n_block_max,
                    kv.lookup if const_expr(kv.paged) else None)
            else:
                state, q_state = self.load_blocks(kv.k, kv.v, None, None, None, pipe_k, pipe_v, state,
                                                  n_block_min, n_block_max, kv.lookup if const_expr(kv.paged) else None)
        return state, q_state

    def kv_loader(self, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, head_kv, batch, seqlen, varlen: bool,
                  kv_len) -> KVLoader:
        """The K/V copies of one tile's (KV head, sequence) (loaders.KVLoader)."""
        return KVLoader.create(self.cfg, self.seams.kv_load is KVLoad.PAGED, mK, mV, mPageTable, sK, sV, tma_atom_K,
                               tma_atom_V, head_kv, batch, seqlen.offset_k, varlen, kv_len, self.page_rows,
                               cute.arch.thread_idx()[0] % 128, self.cfg.copy_warps)

    @cute.jit
    def widen_kv(self, pipe_k, pipe_v, pipe_k16, pipe_v16, fp8, scheduler: StaticPersistentTileScheduler,
                 problem: TileProblem):
        """FP8 K/V with cfg.producer_widens_v, on self.widen_warps: every V block of the CTA's tiles,
        and every K block with cfg.producer_widens_k, in the order the loads and the consumers take
        them (K of the highest block, then K_{j-1} before V_j, highest first: load_blocks), each
        widened from its FP8 stage into the fp16 ring's stage of the same index (the consumers' one
        pipeline state indexes their K and V rings alike), V's rows past the sequence's end zeroed
        (K's are masked). A block waits for its FP8 stage (TMA) and its fp16 stage (freed by the
        consumers' gemm of `stages` blocks earlier); neither waits on a later load, so the loads,
        the widening and the gemms cannot deadlock. The tiles and blocks are those of load_tile: the
        same skips (padding pseudo-batch, tiles without rows or blocks)."""
        cfg = self.cfg
        tidx = cute.arch.thread_idx()[0] - 32 * self.widen_warps[0]
        v8_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        v16_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        k8_state = k16_state = offs = None
        if const_expr(cfg.producer_widens_k):
            k8_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            k16_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
            offs = self.widen_offsets(tidx)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            if work.batch < problem.num_batch:  # the padding pseudo-batch loads nothing
                seqlen = problem.seqlen(work.batch)
                blocks = problem.blocks(seqlen)
                n_block_min, n_block_max = problem.n_block_range(blocks, work)
                if problem.has_rows(work, seqlen) and n_block_max > n_block_min:
                    for p in cutlass.range_constexpr(len(self.widen_phases)):
                        first, masked = self.widen_phases[p]
                        for i in cutlass.range(first, 1 if const_expr(p + 1 < len(self.widen_phases))
                                               else n_block_max - n_block_min, unroll=1):
                            n_block = n_block_max - 1 - i
                            if const_expr(cfg.producer_widens_k):
                                if const_expr(p == 0):
                                    if i == 0:  # K of the highest block
                                        k8_state, k16_state = self._widen_one(pipe_k, k8_state, fp8.sK8, pipe_k16,
                                                                              k16_state, fp8.sK16, tidx, offs,
                                                                              (fp8.addrs[0], fp8.addrs[2]))
                                if n_block > n_block_min:  # K_{j-1} before V_j
                                    k8_state, k16_state = self._widen_one(pipe_k, k8_state, fp8.sK8, pipe_k16,
                                                                          k16_state, fp8.sK16, tidx, offs,
                                                                          (fp8.addrs[0], fp8.addrs[2]))
                            v8_state, v16_state = self._widen_one(
                                pipe_v, v8_state, fp8.sV8, pipe_v16, v16_state, fp8.sV16, tidx, offs,
                                (fp8.addrs[1], fp8.addrs[3]), seqlen.seqlen_k - n_block * cfg.tile_n if masked else None)
            tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def _widen_one(self, pipe8, state8, s8, pipe16, state16, s16, tidx, offs=None, addrs=None, valid_rows=None):
        """widen_kv's step: the next FP8 stage of pipe8 into the next fp16 stage of pipe16. Returns
        both states, advanced."""
        pipe8.consumer_wait(state8)
        pipe16.producer_acquire(state16)
        if const_expr(self.cfg.producer_widens_k):
            self.widen_rows(addrs[0], state8.index, addrs[1], state16.index, tidx, offs, valid_rows)
        else:
            self.widen_block(s8, state8.index, s16, state16.index, tidx, 32 * len(self.widen_warps), valid_rows,
                             loads_per_round=WIDEN_LOADS_PER_ROUND)
        pipe16.producer_commit(state16)
        # One lane per warp releases the FP8 stage: the warp's other lanes' loads of it must be done
        # before TMA may overwrite it.
        cute.arch.sync_warp()
        pipe8.consumer_release(state8)
        state8.advance()
        state16.advance()
        return state8, state16

    @cute.jit
    def consume(self, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk,
                tiled_mma_pv, pipe_q, pipe_k, pipe_v, softmax_scale_log2, softcap_prescale,
                scheduler: StaticPersistentTileScheduler, problem: TileProblem, sMergeFlag=None, fp8=None,
                handout: TileHandout | None = None):
        cfg = self.cfg
        tidx = cute.arch.thread_idx()[0] - 128
        self.stamps.begin_consumer()
        wg = 0  # one consumer warpgroup: a compile-time 0
        if const_expr(cfg.num_consumer_wg > 1):
            wg = cute.arch.make_warp_uniform(tidx // 128)
        if const_expr(fp8 is not None):  # the gemms read fp16 Q and the widened K/V
            frags = self.consumer_fragments(tiled_mma_qk, tiled_mma_pv, fp8.sQ16, fp8.sK16, fp8.sV16, wg)
        else:
            frags = self.consumer_fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, wg)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        tOcO = None  # (row, col) of each O accumulator this thread holds, for stores from registers
        if const_expr(self.seams.epilogue is not Epilogue.TMA_STORE):
            tOcO = acc_as_mn(tiled_mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))))
        acc_O = frags[4]
        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(acc_as_mn(acc_O), mode=[0]))
        # Rescale factor carried to the next step when O is rescaled just before its PV gemm.
        o_scale = cute.make_rmem_tensor(softmax.row_max.layout, Float32)
        sink_log2 = None  # pack-GQA: one sink per row (rows mix q-heads)
        if const_expr(self.seams.q_load is QLoad.PACKED_GQA):
            sink_log2 = cute.make_rmem_tensor(softmax.row_max.layout, Float32)
        tile = _ConsumerTile(frags, tScS, tOcO, softmax, o_scale, sink_log2, tidx, wg, fp8)

        if const_expr(cfg.warpgroup_pingpong):
            # The gemm-issue token starts with the first warpgroup. Each tile passes it around the
            # ring once per K/V block and leaves it where it started (the last warpgroup's final
            # arrive is the next tile's first turn), so this happens once per CTA, not per tile.
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.turn(0), number_of_threads=256)
        q_state = None
        if const_expr(self.seams.q_load is QLoad.TMA):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        args = (mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, sQ, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                pipe_q, pipe_k, pipe_v, softcap_prescale, problem, tile)
        if const_expr(handout is not None):
            handout.consumers_begin()
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            if const_expr(problem.seqlens is not Seqlens.DENSE):
                if work.batch < problem.num_batch:
                    seqlen = problem.seqlen(work.batch)
                    if problem.has_rows(work, seqlen):
                        state, q_state = self.consume_tile(work, seqlen, state, q_state, *args)
                elif const_expr(problem.seqlens is Seqlens.VARLEN):
                    epi.fill_unowned_rows(cfg, mO, mLSE, mSinks, tidx, work, problem)
                else:  # a ragged KV-cache batch's pseudo-batch
                    split_epilogue.fill_unowned_packed_rows(cfg.tile_m, cfg.head_dim, 128 * cfg.num_consumer_wg, mO,
                                                            mLSE, mOaccum, mLSEaccum, mSinks, tidx, work,
                                                            problem.seqlen(work.batch), problem)
            else:
                state, q_state = self.consume_tile(work, problem.seqlen(work.batch), state, q_state, *args)
            if const_expr(handout is not None):
                tile_idx = handout.consumer_next(tile_idx)
            else:
                tile_idx = scheduler.next(tile_idx)
        if const_expr(self.seams.epilogue is Epilogue.TMA_STORE):
            epi.tma_store_drain(cfg, tidx)
        if const_expr(self.seams.epilogue is Epilogue.SPLIT_PARTIALS):
            # The fused combine runs after the CTA's tiles (one per CTA in a split launch), where
            # nothing of the mainloop is live: in the epilogue it made causal softcap spill. It walks
            # the static sequence: the handler never passes split counters with a tile counter.
            self.stamps.consumer_at(phase_times.MERGE_START)
            if problem.fused_combine():
                tile_idx = scheduler.first()
                while tile_idx < num_tiles:
                    work = scheduler.tile(tile_idx)
                    split_epilogue.merge_splits_if_last(cfg.tile_m, cfg.head_dim, 128 * cfg.num_consumer_wg,
                                                        int(NamedBarrierFwd.EPILOGUE), mO, mLSE, mOaccum, mLSEaccum,
                                                        mSinks, sMergeFlag, tidx, work, problem.seqlen(work.batch),
                                                        problem)
                    tile_idx = scheduler.next(tile_idx)
            if const_expr(self.stamps.on):
                self.stamps.end_consumer(tidx, sMergeFlag[0] if problem.fused_combine() else Int32(0))

    @cute.jit
    def consume_tile(self, work, seqlen: SeqlenInfo, state, q_state, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks,
                     sQ, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, softcap_prescale,
                     problem: TileProblem, tile):
        """One tile on the consumer warpgroups: Q, the mainloop over its K/V blocks, the epilogue."""
        cfg, seams = self.cfg, self.seams
        tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape = tile.frags
        softmax, o_scale = tile.softmax, tile.o_scale
        dtype = self.mma_dtype(sQ.element_type)
        blocks = problem.blocks(seqlen)
        n_block_min, n_block_max = problem.n_block_range(blocks, work)
        live_rows = None  # every row's results are stored
        if const_expr(seams.q_load is QLoad.PACKED_GQA and cfg.num_consumer_wg == 1):
            # The tile's packed rows (queries x q-heads per KV head): a decode tile has 4 or 8 of its
            # 64, and the softmax skips the warps' rows past them (OnlineSoftmax.step). Not in the
            # two-warpgroup chunk tiles: their rows are nearly all live, and the votes and branches
            # in their compute-bound, ping-ponged mainloop cost ~10% (8 x 512 chunks, docs/PERF.md).
            live_rows = seqlen.seqlen_q * problem.qhead_per_kv - work.m_block * cfg.tile_m
        # O staged in Q's buffer (TMA_STORE without cfg.separate_o): Q is released after the O store
        # has read the buffer, at the end of the epilogue, so that the CTA's next tile may load Q.
        q_after_store = seams.epilogue is Epilogue.TMA_STORE and not cfg.separate_o
        acc_O.fill(0.0)
        softmax.row_max.fill(-Float32.inf)
        softmax.row_sum.fill(0.0)
        o_scale.fill(1.0)
        if n_block_max > n_block_min:
            if const_expr(seams.q_load is QLoad.TMA):
                pipe_q.consumer_wait(q_state)
            else:
                gather_packed_q(cfg, mQ, sQ, tile.tidx, work, seqlen, problem)
            tile_softmax, tile_prescale = softmax, softcap_prescale
            if const_expr(tile.fp8 is not None):
                # Q in fp16, scaled by 2^e into its range: the scores come out 2^e / k_scale times the
                # true ones, which the tile's softmax factor takes back.
                q_rows = seqlen.seqlen_q * problem.qhead_per_kv - work.m_block * cfg.tile_m
                unscale = self.quantize_q(sQ, tile.fp8, tile.tidx, work, q_rows, softmax.scale_log2)
                if const_expr(self.softcap):
                    tile_prescale = softcap_prescale * unscale
                else:
                    tile_softmax = OnlineSoftmax(softmax.scale_log2 * unscale, softmax.row_max, softmax.row_sum)
            self.stamps.consumer_at(phase_times.Q_READY)
            state = self.mainloop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale,
                                  s_shape, state, pipe_q, q_state, pipe_k, pipe_v, ScoreMask.create(blocks, tile.tScS, tiled_mma_qk),
                                  tile_softmax, tile_prescale, blocks, work.m_block, n_block_min, n_block_max, tile.wg,
                                  dtype, sV, tile.tidx, live_rows, tile.fp8)
            self.stamps.consumer_at(phase_times.MAINLOOP_END)
            if const_expr(seams.q_load is QLoad.TMA and not q_after_store):
                if const_expr(not cfg.separate_o):
                    # The mainloop keeps Q when O would reuse its buffer; this epilogue stores O
                    # from registers, so the next tile's Q may come in now.
                    pipe_q.consumer_release(q_state)
                q_state.advance()

        if const_expr(seams.q_load is QLoad.PACKED_GQA):
            sink = epi.packed_sinks_log2(cfg, tile.sink_log2, tile.tOcO, mSinks, work, problem, _LOG2E)
        else:
            sink = mSinks[work.head] * _LOG2E
        inv_sum = softmax.finalize(sink)
        if const_expr(tile.fp8 is not None):  # O = P (V_fp8 * v_scale): the scale is the KV head's
            v_scale = tile.fp8.mVScale[work.head]
            for r in cutlass.range_constexpr(cute.size(inv_sum)):
                inv_sum[r] = inv_sum[r] * v_scale
        OnlineSoftmax.rescale(acc_O, inv_sum)
        if const_expr(seams.epilogue is Epilogue.TMA_STORE):
            epi.tma_store(cfg, acc_O, softmax.row_sum, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tile.tidx,
                          work.m_block, work.head, work.batch, seqlen.seqlen_q)
            if const_expr(q_after_store):
                # Every warp has written its O into Q's buffer (the epilogue's second barrier), and the
                # storing warp returns from tma_store only once the bulk copy has read it: each warp's
                # release follows its last use, and the producer's next Q waits for all of them.
                if n_block_max > n_block_min:
                    pipe_q.consumer_release(q_state)
                    q_state.advance()
        elif const_expr(seams.epilogue is Epilogue.ROW_STORE):
            epi.row_store(acc_O, softmax.row_sum, tile.tOcO, mO, mLSE, work.head,
                          seqlen.offset_q + work.m_block * cfg.tile_m, seqlen.seqlen_q - work.m_block * cfg.tile_m)
        else:
            epi.split_store(cfg, acc_O, softmax.row_sum, tile.tOcO, mO, mLSE, mOaccum, mLSEaccum, work, seqlen,
                            problem)
            self.stamps.consumer_at(phase_times.STORED)
        return state, q_state

    @cute.jit
    def mainloop(self, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale, s_shape,
                 state, pipe_q, q_state, pipe_k, pipe_v, mask: ScoreMask, softmax: OnlineSoftmax, softcap_prescale,
                 blocks: BlockInfo, m_block, n_block_min, n_block_max, wg, dtype, sV=None, tidx=None, live_rows=None,
                 fp8=None):
        """All K/V blocks of one query tile (Q already in smem), from the highest block index down:
        the first block carries the seqlen_k boundary and the window's right edge; the phases after
        it are listed in block_info.py. `state` is the K/V consumer state; returns it advanced past
        this tile's blocks. sV and tidx (the consumer thread index) are needed with FwdSeams.keys_past_end;
        live_rows bounds the rows whose results are stored (OnlineSoftmax.step; None: all). fp8 (a
        _Fp8Tile): the consumer widens FP8 stages into the fp16 buffer the gemm reads (dequant) where
        the producer does not (consumer_widens_k / _v); else pipe_k / pipe_v are the fp16 rings."""
        cfg = self.cfg

        # First block (highest index): S only; its PV gemm is issued in the next step.
        n_block = n_block_max - 1
        self._kv_wait(pipe_k, state)
        self.stamps.consumer_at(phase_times.FIRST_K)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        if const_expr(self.consumer_widens_k):
            self.dequant(fp8.sK8, state.index, fp8.sK16, tidx, wg)
            pipe_k.consumer_release(state)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, 0], zero_init=True, wait=0)
        else:
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True, wait=0)
            pipe_k.consumer_release(state)
        if const_expr(self.softcap):
            OnlineSoftmax.softcap(acc_S, softcap_prescale, mask.tScS_mn, live_rows)
        mask.apply(acc_S, m_block, n_block, seqlen=True, window=True)
        softmax.step(acc_S, is_first=True, rows=mask.tScS_mn, live_rows=live_rows)
        store_16bit(tOrP, acc_as_frag_a(acc_S))
        if const_expr(self.seams.keys_past_end and fp8 is None):
            # (FP8: dequant zeroes these rows as it widens the block.)
            # Only the first block can hold the sequence's last key (later ones are full); its V
            # arrives right behind the next K, so waiting for it here costs little, and only tiles
            # whose sequence ends inside the block pay anything beyond a compare.
            keys_in_block = blocks.seqlen.seqlen_k - n_block * cfg.tile_n
            if keys_in_block < cfg.tile_n:
                self._kv_wait(pipe_v, state)
                self.clear_v_rows(sV, state.index, keys_in_block, tidx, wg)

        step = partial(self.step, tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv,
                       tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tOrP=tOrP, acc_O=acc_O, o_scale=o_scale,
                       s_shape=s_shape, pipe_k=pipe_k, pipe_v=pipe_v, mask=mask, softmax=softmax,
                       softcap_prescale=softcap_prescale, m_block=m_block, wg=wg, dtype=dtype, live_rows=live_rows,
                       fp8=fp8, tidx=tidx, seqlen_k=blocks.seqlen.seqlen_k)
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
        # gemm and the epilogue run. (Without a separate O buffer O is about to overwrite Q: Q is
        # released after the epilogue, consume_tile.)
        if const_expr(cfg.separate_o):
            pipe_q.consumer_release(q_state)

        # Last PV gemm, for the lowest block.
        if const_expr(cfg.rescale_o_before_gemm):
            self._rescale_o(acc_O, o_scale)
        self._kv_wait(pipe_v, state)
        if const_expr(self.consumer_widens_v):
            self.dequant(fp8.sV8, state.index, fp8.sV16, tidx, wg,
                         blocks.seqlen.seqlen_k - n_block_min * cfg.tile_n)
            pipe_v.consumer_release(state)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, 0], wait=0)
        else:
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, state.index], wait=0)
            pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def step(self, state, n_block, masked: cutlass.Constexpr[bool], tiled_mma_qk, tiled_mma_pv,
             tSrQ, tSrK, tOrVt, tOrP, acc_O, o_scale, s_shape, pipe_k, pipe_v,
             mask: ScoreMask, softmax: OnlineSoftmax, softcap_prescale, m_block, wg, dtype, live_rows=None,
             fp8=None, tidx=None, seqlen_k=None):
        """One K/V block: S_j = Q K_j^T and O += P_{j+1} V_{j+1} in flight together, softmax of
        S_j overlapping the PV gemm. `state` points at block j+1's stage on entry. fp8: K_j is
        widened before its gemm (the buffer's last reader, S_{j+1}, is done), and V_{j+1}, unless the
        producer widens V (then pipe_v is its fp16 ring), while S_j runs (its buffer's last reader, the
        PV gemm of block j+2, is done), each FP8 stage released as soon as it is widened."""
        cfg = self.cfg
        v_state = state.clone()
        state.advance()
        self._kv_wait(pipe_k, state)
        k_stage, v_stage = state.index, v_state.index
        if const_expr(self.consumer_widens_k):
            self.dequant(fp8.sK8, state.index, fp8.sK16, tidx, wg)
            pipe_k.consumer_release(state)
            k_stage = 0
        if const_expr(self.consumer_widens_v):
            v_stage = 0
        self._pingpong_wait(wg)
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_stage], zero_init=True, wait=-1)
        if const_expr(cfg.rescale_o_before_gemm):
            self._rescale_o(acc_O, o_scale)
        self._kv_wait(pipe_v, v_state)
        if const_expr(self.consumer_widens_v):
            self.dequant(fp8.sV8, v_state.index, fp8.sV16, tidx, wg, seqlen_k - (n_block + 1) * cfg.tile_n)
            pipe_v.consumer_release(v_state)
        wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_stage], wait=-1)
        self._pingpong_signal(wg)
        warpgroup.wait_group(1)  # S_j ready; PV still running
        if const_expr(not self.consumer_widens_k):
            pipe_k.consumer_release(state)
        if const_expr(self.softcap):
            OnlineSoftmax.softcap(acc_S, softcap_prescale, mask.tScS_mn, live_rows)
        if const_expr(masked):
            mask.apply(acc_S, m_block, n_block, seqlen=False, window=True)
        scale = softmax.step(acc_S, is_first=False, rows=mask.tScS_mn, live_rows=live_rows)
        warpgroup.wait_group(0)  # PV done: P and V's stage may be reused
        if const_expr(not self.consumer_widens_v):
            pipe_v.consumer_release(v_state)
        store_16bit(tOrP, acc_as_frag_a(acc_S))
        if const_expr(cfg.rescale_o_before_gemm):
            o_scale.store(scale.load())
        else:
            self._rescale_o(acc_O, scale)
        return state

    @cute.jit
    def _rescale_o(self, acc_O, factors):
        """O *= a block's running-max factors (after its PV gemm, or before the next one at hd > 128).
        With self.skip_unit_rescale a warp skips the multiplies when every factor of its rows is
        exactly 1 (no row found a new max: most blocks of a long row), so the numbers stay bitwise
        those of the plain rescale. The factors are exp2(old max - new max) <= 1 (0 for a row without
        keys yet): a warp-uniform vote on the smallest."""
        if const_expr(self.skip_unit_rescale):
            low = Float32(-1.0)
            for r in cutlass.range_constexpr(cute.size(factors)):
                low = cute.arch.fmax(low, -factors[r])
            if cute.arch.vote_any_sync(low > -1.0):
                OnlineSoftmax.rescale(acc_O, factors)
        else:
            OnlineSoftmax.rescale(acc_O, factors)

    @cute.jit
    def clear_v_rows(self, sV, stage, first_row, tidx, wg):
        """Zero rows [first_row, tile_n) of V stage `stage` with 16-byte stores by the 128 threads of
        consumer warpgroup `wg`, and make them visible to its wgmma (async proxy) before any of its
        threads goes on. With several consumer warpgroups each clears the rows itself: they all
        write the same zeros, so one warpgroup's gemm never depends on another's progress."""
        cfg = self.cfg
        dtype = sV.element_type
        vec = 128 // dtype.width
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, *row_thread_layout(dtype, cfg.head_dim, 128))
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
    def dequant(self, s8, stage, s16, tidx, wg, valid_rows=None):
        """FP8 K/V, widened by the consumer: widen_block by the 128 threads of consumer warpgroup
        `wg` into the one fp16 buffer s16, then the warpgroup syncs, so that its wgmma may read s16
        and the FP8 stage may be released."""
        self.widen_block(s8, stage, s16, 0, tidx % 128, 128, valid_rows)
        cute.arch.barrier(barrier_id=NamedBarrierFwd.v_tail(wg), number_of_threads=128)

    @cute.jit
    def widen_block(self, s8, stage8, s16, stage16, tidx, n_threads: int, valid_rows=None, loads_per_round: int = 0):
        """Widen block `stage8` of the FP8 stages s8 into stage `stage16` of the fp16 buffers s16
        (e4m3 -> fp16 is exact: every e4m3 value, subnormals included, is an fp16 number), by
        n_threads threads (tidx in [0, n_threads)), 8 elements per copy (an 8-byte load, a 16-byte
        store). Rows from `valid_rows` on (keys past the sequence's end, whose slots or unowned pages
        may hold anything, NaN included) become zeros, as clear_v_rows does for 16-bit V: P is 0
        there, and 0 * NaN would be NaN. The writes are then fenced into the async proxy (the
        wgmma's); the caller syncs or arrives. loads_per_round > 0 splits a thread's copies into rounds
        of that many loads, then their stores (fewer registers: the producer's budget); 0: one round."""
        cfg = self.cfg
        f16 = cutlass.Float16
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), f16, num_bits_per_copy=128)
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), s8.element_type, num_bits_per_copy=64)
        tiled = cute.make_tiled_copy_tv(store, *row_thread_layout(f16, cfg.head_dim, n_threads))
        thr = tiled.get_slice(tidx)
        t8 = thr.partition_S(s8[None, None, stage8])
        t16 = thr.partition_D(s16[None, None, stage16])
        tc = thr.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        # Every load first, then the conversions and stores: loads and stores of shared memory may
        # alias as far as the compiler knows, so interleaved they ran one chunk at a time (load
        # latency each; the first version reached 1.66 TB/s of FP8 bytes at 1 x 128k).
        n_m, n_k = cute.size(t8, mode=[1]), cute.size(t8, mode=[2])
        per = n_m if loads_per_round == 0 else max(loads_per_round // n_k, 1)
        assert n_m % per == 0, (n_m, n_k, loads_per_round)
        batches = n_m // per
        r8 = cute.make_rmem_tensor(cute.make_layout((8, per, n_k)), s8.element_type)
        r16 = cute.make_rmem_tensor(cute.make_layout(8), f16)
        for b in cutlass.range_constexpr(batches):
            for m in cutlass.range_constexpr(per):
                for k in cutlass.range_constexpr(n_k):
                    cute.copy(load, t8[None, b * per + m, k], r8[None, m, k])
            for m in cutlass.range_constexpr(per):
                for k in cutlass.range_constexpr(n_k):
                    r16.store(r8[None, m, k].load().to(f16))
                    if const_expr(valid_rows is not None):
                        if tc[0, b * per + m, k][0] >= valid_rows:
                            r16.fill(0.0)
                    cute.copy(store, r16, t16[None, b * per + m, k])
        cute.arch.fence_view_async_shared()

    @cute.jit
    def widen_offsets(self, tidx):
        """A widening thread's byte offsets within a stage (fp8_widen_layout): its warp's first row,
        then the FP8 and fp16 offsets of its element at each pass of one swizzle period. Returns
        (rows_first, off8, off16); widen_rows adds the stage and the period's multiples."""
        cfg = self.cfg
        hd = cfg.head_dim
        warp, lane = tidx // 32, tidx % 32
        first = warp * wl.rows_per_warp(cfg.tile_n, len(self.widen_warps))
        r, col = wl.lane_position(hd, lane)
        off8 = cute.make_rmem_tensor(cute.make_layout(wl.period(hd)), Int32)
        off16 = cute.make_rmem_tensor(cute.make_layout(wl.period(hd)), Int32)
        for j in cutlass.range_constexpr(wl.period(hd)):
            row = first + j * wl.rows_per_pass(hd) + r
            off8[j] = wl.fp8_offset(hd, row, col)
            off16[j] = wl.f16_offset(cfg.tile_n, row, col)
        return first, off8, off16

    @cute.jit
    def widen_rows(self, base8, stage8, base16, stage16, tidx, offs, valid_rows=None):
        """FP8 block `stage8` at shared address base8 -> fp16 stage `stage16` at base16, by
        len(self.widen_warps) warps that need not divide the block's rows (fp8_widen_layout: warp w
        takes rows [w R, (w + 1) R), the last warp fewer), a round of fp8_widen_layout.ROUND_ROWS rows
        at a time (skipped past the block's end): its 8-byte loads, one per pass, then their
        conversions and 16-byte stores, at offs' per-lane registers (widen_offsets) plus compile-time
        constants. Rows from
        `valid_rows` on become zeros (their FP8 words are zeroed before the conversion: two masks a
        pass, not four). The stores are fenced into the async proxy; the caller arrives.
        (Sm90FwdConfig checks that the warps' rounds end exactly at tile_n.)"""
        cfg = self.cfg
        hd = cfg.head_dim
        first, off8, off16 = offs
        a8 = base8 + stage8 * wl.fp8_stage_bytes(cfg.tile_n, hd)
        a16 = base16 + stage16 * wl.f16_stage_bytes(cfg.tile_n, hd)
        lane_row = first + (tidx % 32) // wl.lanes_per_row(hd)
        rpp, per = wl.rows_per_pass(hd), wl.period(hd)
        n = wl.passes(cfg.tile_n, hd, len(self.widen_warps))
        round_passes = wl.ROUND_ROWS // rpp
        assert n % round_passes == 0 and round_passes % per == 0, (n, round_passes, per)
        for b in cutlass.range_constexpr(n // round_passes):
            if first + b * round_passes * rpp < cfg.tile_n:
                words = []
                for m in cutlass.range_constexpr(round_passes):
                    i = b * round_passes + m
                    words.append(lds(a8 + off8[i % per] + (i // per) * wl.PERIOD_ROWS * hd, 2))
                for m in cutlass.range_constexpr(round_passes):
                    i = b * round_passes + m
                    word01, word23 = words[m][0], words[m][1]
                    if const_expr(valid_rows is not None):
                        # Zero bytes past the sequence's end widen to zeros: two masks a pass, not four.
                        keep = Int32(0) - Int32(lane_row + i * rpp < valid_rows)
                        word01, word23 = word01 & keep, word23 & keep
                    w01 = e4m3x4_to_f16x2x2(word01)
                    w23 = e4m3x4_to_f16x2x2(word23)
                    out = [w01[0], w01[1], w23[0], w23[1]]
                    sts_b32x4(a16 + off16[i % per] + (i // per) * wl.PERIOD_ROWS * wl.F16_ROW_BYTES, out)
        cute.arch.fence_view_async_shared()

    @staticmethod
    def check_widen_layouts(sKV_layout, sK16_layout, sV16_layout, tile_n: int, head_dim: int, stages: int):
        """widen_rows computes its addresses itself (fp8_widen_layout): check that against the FP8
        stages' layout and the fp16 rings' (K's and V's) at every stage, row and 8-element chunk. The
        layouts are composed: a linear layout in elements, no offset, then the swizzle, which the
        shared-memory pointer applies to byte addresses (from 1 KB-aligned buffers). Once per shape:
        the 16 chunk-tile variants share two."""
        layouts = tuple((str(x.inner), str(x.offset), str(x.outer)) for x in (sKV_layout, sK16_layout, sV16_layout))
        key = (layouts, tile_n, head_dim, stages)
        if key in _WIDEN_LAYOUTS_CHECKED:
            return

        def byte_offset(layout, elem_bytes, coord):
            off = layout.offset
            if any(o != 0 for o in (cute.flatten(off) if isinstance(off, tuple) else (off,))):
                raise ValueError(f"fp8_widen_layout assumes composed layouts without an offset: {layout}")
            sw, x = layout.inner, elem_bytes * layout.outer(coord)
            yyy = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
            return x ^ ((x & yyy) >> sw.num_shift)

        for stage in range(stages):
            for row in range(tile_n):
                for col in range(0, head_dim, wl.ELEMS):
                    c = (row, col, stage)
                    got = (byte_offset(sKV_layout, 1, c), byte_offset(sK16_layout, 2, c), byte_offset(sV16_layout, 2, c))
                    w16 = stage * wl.f16_stage_bytes(tile_n, head_dim) + wl.f16_offset(tile_n, row, col)
                    want = (stage * wl.fp8_stage_bytes(tile_n, head_dim) + wl.fp8_offset(head_dim, row, col), w16, w16)
                    if got != want:
                        raise ValueError(f"fp8_widen_layout disagrees with the stages' layouts at {c}: {got} != {want}")
        _WIDEN_LAYOUTS_CHECKED.add(key)

    @cute.jit
    def quantize_q(self, sQ, fp8, tidx, work, q_rows, scale_log2: Float32) -> Float32:
        """FP8 K/V: rewrite the gathered 16-bit Q tile in place as fp16 q * 2^e, e an integer (one per
        tile) that puts the largest |q| of the tile's live rows near 2^12, well inside fp16's range
        (65504) whatever q's range (bf16 reaches 3e38). A power of two and fp16's 11 significant bits
        (bf16 has 8) make this exact for every element within 2^-26 of the largest; smaller ones,
        which move no score, may round. Returns k_scale * 2^-e, the factor the tile's scores need
        (folded into the softmax scale or softcap's prescale, float32). Rows from q_rows on (the
        tile's rows past the sequence's, left as they were by the gather) are rewritten too but never
        stored. e comes from the finite elements only: an infinite one spoils its own row (NaN, as in
        the 16-bit kernels), not the tile's other rows' scale (with it, e was the bound and their q
        flushed to zero). Every consumer thread takes part (the two-warpgroup tile's threads each
        rewrite rows of both halves, as the gather wrote them), with two barriers of all of them."""
        cfg = self.cfg
        dtype = sQ.element_type
        f16 = cutlass.Float16
        n_threads = 128 * cfg.num_consumer_wg
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), f16, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(atom, *row_thread_layout(dtype, cfg.head_dim, n_threads))
        thr = tiled.get_slice(tidx % n_threads)
        tQ = thr.partition_S(sQ)
        tQ16 = thr.partition_D(fp8.sQ16)
        tc = thr.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim)))
        r = cute.make_rmem_tensor(cute.make_layout(128 // dtype.width), dtype)
        r16 = cute.make_rmem_tensor(cute.make_layout(128 // dtype.width), f16)
        amax = Float32(0.0)
        for m in cutlass.range_constexpr(cute.size(tQ, mode=[1])):
            if tc[0, m, 0][0] < q_rows:
                for k in cutlass.range_constexpr(cute.size(tQ, mode=[2])):
                    cute.copy(atom, tQ[None, m, k], r)
                    a = abs(r.load().to(Float32))
                    amax = row_max(cute.where(a < Float32.inf, a, Float32(0.0)), amax)  # finite ones only
        amax = cute.arch.warp_reduction_max(amax)
        warp = (tidx % n_threads) // 32
        if cute.arch.lane_idx() == 0:
            fp8.sAmax[warp] = amax
        self._consumers_sync()
        amax = cute.arch.fmax(cute.arch.fmax(fp8.sAmax[0], fp8.sAmax[1]), cute.arch.fmax(fp8.sAmax[2], fp8.sAmax[3]))
        for w in cutlass.range_constexpr(4, 4 * cfg.num_consumer_wg):
            amax = cute.arch.fmax(amax, fp8.sAmax[w])
        k_scale = fp8.mKScale[work.head]
        e = fp8_q_exponent(amax, scale_log2, k_scale)
        factor = pow2(e)
        for m in cutlass.range_constexpr(cute.size(tQ, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tQ, mode=[2])):
                cute.copy(atom, tQ[None, m, k], r)
                r16.store((r.load().to(Float32) * factor).to(f16))
                cute.copy(store, r16, tQ16[None, m, k])
        cute.arch.fence_view_async_shared()
        self._consumers_sync()
        return k_scale * pow2(-e)

    def _consumers_sync(self):
        """A barrier of every consumer thread: one warpgroup's (as it always was) or both."""
        if const_expr(self.cfg.num_consumer_wg == 1):
            cute.arch.barrier(barrier_id=NamedBarrierFwd.v_tail(0), number_of_threads=128)
        else:
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE),
                              number_of_threads=128 * self.cfg.num_consumer_wg)

    @cute.jit
    def _kv_wait(self, pipe, state):
        """Wait for a K/V stage. Rows gathered by cp.async are generic-proxy writes: each consumer
        thread fences them into the async proxy that its wgmma reads shared memory through."""
        pipe.consumer_wait(state)
        if const_expr(self.kv_gather):
            cute.arch.fence_view_async_shared()

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


@dataclass(frozen=True)
class _Fp8Tile:
    """FP8 K/V: the FP8 stages, the widened fp16 K/V buffers the gemms read, sQ seen as fp16 (the Q
    gather's buffer, rewritten in place by quantize_q), quantize_q's cross-warp slots, the scales."""

    sK8: cute.Tensor
    sV8: cute.Tensor
    sK16: cute.Tensor
    sV16: cute.Tensor
    sQ16: cute.Tensor
    sAmax: cute.Tensor
    mKScale: cute.Tensor
    mVScale: cute.Tensor
    # The four buffers' shared-memory byte addresses (K8, V8, K16, V16), for widen_rows.
    addrs: tuple = ()


@dataclass(frozen=True)  # frozen: read inside the dynamic tile loop (see tile_scheduler.py)
class _ConsumerTile:
    """A consumer thread's per-CTA state that every tile reuses (the tensors' contents change)."""

    frags: tuple  # consumer_fragments(): tSrQ, tSrK, tOrVt, tOrP, acc_O, QK^T accumulator shape
    tScS: cute.Tensor  # (row, col) of each QK^T accumulator
    tOcO: cute.Tensor | None  # (row, col) of each O accumulator (register-store epilogues)
    softmax: OnlineSoftmax
    o_scale: cute.Tensor
    sink_log2: cute.Tensor | None  # pack-GQA: the rows' sinks
    tidx: Int32  # consumer thread index
    wg: Int32 | int  # consumer warpgroup
    fp8: _Fp8Tile | None = None  # FP8 K/V only
