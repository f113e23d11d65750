"""The FP8 KV-cache decode tile on Hopper (issue 17): the consumer warpgroup of a KV-cache kernel
whose tile is a few pack-GQA rows (cfg.fp8_decode: TILE_M = 16) over FP8 K/V stages. The producer is
fwd_sm90's (TMA pieces or the cp.async row gather); this replaces the wgmma consumer.

Why a tile of its own: decode's tile holds one query x the q-heads of a KV head (4-16 rows), and the
wgmma consumer (64 rows, K/V as shared-memory operands) had to widen every FP8 block to fp16 in
shared memory first -- a store and a reload of twice the bytes it loaded, and a warpgroup barrier
per block, which bound the kernel at ~3 TB/s of FP8 bytes (docs/PERF.md). Here the gemms' operands
are swapped (fp8_decode_layout.py): S^T = K Q^T and O^T = V^T P^T on the warp's synchronous mma
(m16n8k16, fp16 x fp16 -> float32), K and V the register A operands, loaded from the FP8 stage by
each thread as 16 contiguous bytes, widened in registers (cvt.e4m3x2, exact) and fed to the tensor
core; the packed rows are N (8 or 16). Nothing goes back to shared memory in the mainloop, and no
barrier: each of the four warps takes 16 keys of every 64-key stage with its own online softmax
(max, sum and O over its keys), like a split inside the CTA, and the warps merge through shared
memory once per tile (merge_tile).

Numerics as in the wgmma FP8 tile: q is scaled by a power of two of the tile into fp16 (exact for
every element within 2^-26 of the tile's largest; the factor is folded into the softmax scale), the
cache's e4m3 widens exactly, products accumulate in float32, P is rounded to fp16. The running max
is rescaled only when a row's block max exceeds it by more than RESCALE_LOG2 (in log2 units;
FlashAttention-4's conditional rescaling): P then stays below 2^RESCALE_LOG2, far inside fp16, and
the max, sum and O stay mutually consistent (O and the sum are always relative to the stored max).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr

from fa4_jax.kernels import split_epilogue
from fa4_jax.kernels import fp8_decode_layout as lay
from fa4_jax.kernels.named_barrier import NamedBarrierFwd
from fa4_jax.kernels.softmax import finalize_row
from fa4_jax.kernels.utils import fp8_q_exponent, pack_f32x2, pow2
from fa4_jax.kernels.warp_ptx import e4m3x4_to_f16x2x2, lds, lds_f32, lds_f32x4, mma_16816, movmatrix_trans, prmt
from fa4_jax.kernels.warp_ptx import sts_f32, sts_f32x4

_LOG2E = 1.4426950408889634
# Conditional rescaling: a row's stored max moves only when a block max exceeds it by more than this
# (log2 units), so P < 2^8 in fp16.
RESCALE_LOG2 = 8.0


class Fp8DecodeTile:
    """Compile-time configuration of the consumer; `consume` runs on the consumer warpgroup."""

    def __init__(self, cfg, softcap: bool):
        if cfg.head_dim not in lay.HEAD_DIMS or cfg.tile_m != lay.TILE_M or cfg.tile_n != lay.TILE_N:
            raise ValueError(f"FP8 decode tile: head_dim in {lay.HEAD_DIMS}, tile {lay.TILE_M} x {lay.TILE_N}; "
                             f"got {cfg.head_dim=} {cfg.tile_m=} {cfg.tile_n=}")
        self.cfg = cfg
        self.hd = cfg.head_dim
        self.softcap = softcap
        self.k_steps = cfg.head_dim // 16  # QK^T's k-steps = PV's m-tiles
        self.groups = cfg.head_dim // 64  # 16-byte K loads per key row
        self.v_words = cfg.head_dim // 32  # 32-bit words of a thread's V chunk (head_dim / 8 bytes)
        self.stage_bytes = lay.TILE_N * cfg.head_dim

    @staticmethod
    def check_stage_layout(layout, head_dim: int, stages: int):
        """The loads compute swizzled addresses themselves (stage s at s * TILE_N * head_dim, then
        fp8_decode_layout.swizzle): check that against the FP8 stages' layout (which TMA fills) at every
        stage, row and 16-byte unit."""
        for stage in range(stages):
            for row, col in ((r, c) for r in range(lay.TILE_N) for c in range(0, head_dim, 16)):
                got = layout((row, col, stage))
                want = stage * lay.TILE_N * head_dim + lay.swizzle(head_dim, row * head_dim + col)
                if got != want:
                    raise ValueError(f"FP8 stage layout disagrees with fp8_decode_layout.swizzle at {(row, col, stage)}: "
                                     f"{got} != {want}")

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale, mVScale, k_base: Int32, v_base: Int32,
                merge_base: Int32, pipe_k, pipe_v, softmax_scale_log2: Float32, softcap_prescale: Float32,
                scheduler, problem, sMergeFlag):
        """Every tile of the CTA, then (split launches with the combine fused) the split merges."""
        cfg = self.cfg
        tidx = cute.arch.thread_idx()[0] - 128
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g, q = lane // 4, lane % 4
        # Each thread's byte offsets in a stage (swizzled; a stage starts on a 1 KB boundary, which the
        # swizzle leaves alone): K rows key_row(g) and key_row(g + 8) of the warp's 16, 16 bytes per
        # 64 columns; V rows key_row(2q + {0, 1, 8, 9}), the lane group's chunk.
        k_off = cute.make_rmem_tensor(cute.make_layout((2, self.groups)), Int32)
        for h in cutlass.range_constexpr(2):
            for G in cutlass.range_constexpr(self.groups):
                row = lay.KEYS_PER_WARP * warp + lay.key_row(self.hd, g + 8 * h)
                k_off[h, G] = lay.swizzle(self.hd, row * self.hd + 64 * G + 16 * q)
        v_off = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for kv in cutlass.range_constexpr(4):
            row = lay.KEYS_PER_WARP * warp + lay.key_row(self.hd, 2 * q + (kv % 2) + 8 * (kv // 2))
            v_off[kv] = lay.swizzle(self.hd, row * self.hd + lay.v_chunk(self.hd, g) * (self.hd // 8))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        tile_idx, num_tiles = scheduler.first(), scheduler.total
        while tile_idx < num_tiles:
            work = scheduler.tile(tile_idx)
            if work.batch < problem.num_batch:
                seqlen = problem.seqlen(work.batch)
                if problem.has_rows(work, seqlen):
                    rows = seqlen.seqlen_q * problem.qhead_per_kv - work.m_block * lay.TILE_M
                    # Decode tiles of up to 8 rows (4 or 8 q-heads per KV head) run the mma's first
                    # n8 half only.
                    if rows > 8:
                        state = self.tile(2, work, seqlen, state, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale,
                                          mVScale, k_base, v_base, merge_base, k_off, v_off, pipe_k, pipe_v,
                                          softmax_scale_log2, softcap_prescale, problem, tidx, warp, lane)
                    else:
                        state = self.tile(1, work, seqlen, state, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks, mKScale,
                                          mVScale, k_base, v_base, merge_base, k_off, v_off, pipe_k, pipe_v,
                                          softmax_scale_log2, softcap_prescale, problem, tidx, warp, lane)
            else:  # a ragged batch's pseudo-batch
                split_epilogue.fill_unowned_packed_rows(lay.TILE_M, self.hd, 128, mO, mLSE, mOaccum, mLSEaccum,
                                                        mSinks, tidx, work, problem.seqlen(work.batch), problem)
            tile_idx = scheduler.next(tile_idx)
        if problem.fused_combine():
            tile_idx = scheduler.first()
            while tile_idx < num_tiles:
                work = scheduler.tile(tile_idx)
                # Eight splits' partials at a time: sixteen (merge_chunk) spilled beside this tile's
                # per-CTA registers.
                split_epilogue.merge_splits_if_last(lay.TILE_M, self.hd, 128, int(NamedBarrierFwd.EPILOGUE), mO,
                                                    mLSE, mOaccum, mLSEaccum, mSinks, sMergeFlag, tidx, work,
                                                    problem.seqlen(work.batch), problem, chunk=8)
                tile_idx = scheduler.next(tile_idx)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def tile(self, nj: cutlass.Constexpr[int], work, seqlen, state, mQ, mO, mLSE, mOaccum, mLSEaccum, mSinks,
             mKScale, mVScale, k_base, v_base, merge_base, k_off, v_off, pipe_k, pipe_v, softmax_scale_log2,
             softcap_prescale, problem, tidx, warp, lane):
        """One tile of nj n8 halves (8 nj packed rows): Q, every K/V block of its split, the merge of
        the warps and the stores. Returns the pipeline state past the tile's blocks."""
        g, q = lane // 4, lane % 4
        blocks = problem.blocks(seqlen)
        n_block_min, n_block_max = problem.n_block_range(blocks, work)
        live_rows = cutlass.min(seqlen.seqlen_q * problem.qhead_per_kv - work.m_block * lay.TILE_M, lay.TILE_M)

        # Q^T as the B operand, in registers for the whole tile: (half j, k-step s, register).
        q_frag = cute.make_rmem_tensor(cute.make_layout((nj, self.k_steps, 2)), Int32)
        unscale = self.load_q(nj, q_frag, mQ, mKScale, softmax_scale_log2, work, seqlen, problem, g, q)
        scale_log2 = softmax_scale_log2
        prescale = softcap_prescale
        if const_expr(self.softcap):
            prescale = softcap_prescale * unscale
        else:
            scale_log2 = softmax_scale_log2 * unscale

        # Each of the thread's rows (half j, column b: row 8 j + 2 q + b): its visible keys [lo, hi).
        lo = cute.make_rmem_tensor(cute.make_layout(2 * nj), Int32)
        hi = cute.make_rmem_tensor(cute.make_layout(2 * nj), Int32)
        for r in cutlass.range_constexpr(2 * nj):
            row = work.m_block * lay.TILE_M + 8 * (r // 2) + 2 * q + (r % 2)
            diag = row // problem.qhead_per_kv + seqlen.seqlen_k - seqlen.seqlen_q
            hi[r] = cutlass.min(seqlen.seqlen_k, diag + blocks.window_right + 1)
            lo[r] = diag - blocks.window_left

        acc_o = cute.make_rmem_tensor(cute.make_layout((self.k_steps, nj, 4)), Float32)
        acc_o.fill(0.0)
        row_max = cute.make_rmem_tensor(cute.make_layout(2 * nj), Float32)
        row_max.fill(-Float32.inf)
        row_sum = cute.make_rmem_tensor(cute.make_layout(2 * nj), Float32)
        row_sum.fill(0.0)
        for i in cutlass.range(n_block_max - n_block_min, unroll=1):
            n_block = n_block_max - 1 - i
            state = self.block(nj, n_block, state, q_frag, acc_o, row_max, row_sum, lo, hi, seqlen.seqlen_k, k_base,
                               v_base, k_off, v_off, pipe_k, pipe_v, scale_log2, prescale, warp, lane)
        self.merge_tile(nj, acc_o, row_max, row_sum, mO, mLSE, mOaccum, mLSEaccum, mSinks, mVScale, merge_base, work,
                        seqlen, problem, live_rows, tidx, warp, lane)
        return state

    @cute.jit
    def load_q(self, nj: cutlass.Constexpr[int], q_frag, mQ, mKScale, softmax_scale_log2, work, seqlen, problem, g,
               q) -> Float32:
        """The B fragments of Q^T: lane (g, q) holds rows 8 j + g, columns [64 G + 16 q, + 16) of each 64
        (fp8_decode_layout.qk_column), as fp16 q * 2^e with one e per tile putting the tile's largest
        finite |q| near 2^12 (utils.fp8_q_exponent; every warp computes it over the whole tile: its lanes
        hold all of it).
        Rows past the sequence's are zeros. Returns k_scale * 2^-e, the scores' factor."""
        hd = self.hd
        dtype = mQ.element_type
        vals = cute.make_rmem_tensor(cute.make_layout((nj, self.groups, 16)), Float32)
        vals.fill(0.0)
        chunk = cute.make_rmem_tensor(cute.make_layout(8), dtype)
        for j in cutlass.range_constexpr(nj):
            row = work.m_block * lay.TILE_M + 8 * j + g
            query = row // problem.qhead_per_kv
            pos = seqlen.offset_q + query
            if query < seqlen.seqlen_q and pos < mQ.shape[1]:
                head = work.head * problem.qhead_per_kv + row - query * problem.qhead_per_kv
                start = mQ.iterator + cute.crd2idx((seqlen.batch_q, pos, head, 0), mQ.layout)
                src = cute.tiled_divide(cute.make_tensor(
                    cute.make_ptr(dtype, start.toint(), cute.AddressSpace.gmem, assumed_align=16), (hd,)), (8,))
                for G in cutlass.range_constexpr(self.groups):
                    for half in cutlass.range_constexpr(2):
                        cute.autovec_copy(src[None, (64 * G + 16 * q) // 8 + half], chunk)
                        for e in cutlass.range_constexpr(8):
                            vals[j, G, 8 * half + e] = chunk[e].to(Float32)
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(vals)):
            a = cute.arch.fmax(vals[i], -vals[i])
            amax = cute.arch.fmax(amax, a if a < Float32.inf else Float32(0.0))  # finite ones only
        for off in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
        k_scale = mKScale[work.head]
        e = fp8_q_exponent(amax, softmax_scale_log2, k_scale)
        factor = pow2(e)
        for j in cutlass.range_constexpr(nj):
            for s in cutlass.range_constexpr(self.k_steps):
                G, u = s // 4, s % 4
                for reg in cutlass.range_constexpr(2):  # columns 2q, 2q+1 | 2q+8, 2q+9: bytes 4u + 2 reg + {0, 1}
                    q_frag[j, s, reg] = pack_f32x2(vals[j, G, 4 * u + 2 * reg] * factor,
                                                   vals[j, G, 4 * u + 2 * reg + 1] * factor, False)
        return k_scale * pow2(-e)

    @cute.jit
    def block(self, nj: cutlass.Constexpr[int], n_block, state, q_frag, acc_o, row_max, row_sum, lo, hi, seqlen_k,
              k_base, v_base, k_off, v_off, pipe_k, pipe_v, scale_log2, prescale, warp, lane):
        """One K/V block: the warp's 16 keys of it (S^T, softmax, O^T += V^T P^T). Returns the pipeline
        state past it."""
        hd = self.hd
        g, q = lane // 4, lane % 4
        stage = state.index * self.stage_bytes
        # The warp's bytes of the stage, then the stage goes back to the producer: one lane per warp
        # releases it, once every lane's loads are done (sync_warp; the release orders them).
        kw = cute.make_rmem_tensor(cute.make_layout((2, self.groups, 4)), Int32)
        vw = cute.make_rmem_tensor(cute.make_layout((4, self.v_words)), Int32)
        pipe_k.consumer_wait(state)
        for h in cutlass.range_constexpr(2):
            for G in cutlass.range_constexpr(self.groups):
                w4 = lds(k_base + stage + k_off[h, G], 4)
                for u in cutlass.range_constexpr(4):
                    kw[h, G, u] = w4[u]
        pipe_v.consumer_wait(state)
        for kv in cutlass.range_constexpr(4):
            wv = lds(v_base + stage + v_off[kv], self.v_words)
            for w in cutlass.range_constexpr(self.v_words):
                vw[kv, w] = wv[w]
        cute.arch.sync_warp()
        pipe_k.consumer_release(state)
        pipe_v.consumer_release(state)
        state.advance()

        # S^T = K Q^T: two accumulators per half (even / odd k-steps) halve the mma chain.
        acc_s = cute.make_rmem_tensor(cute.make_layout((nj, 2, 4)), Float32)
        acc_s.fill(0.0)
        for s in cutlass.range_constexpr(self.k_steps):
            G, u = s // 4, s % 4
            a02 = e4m3x4_to_f16x2x2(kw[0, G, u])
            a13 = e4m3x4_to_f16x2x2(kw[1, G, u])
            a = [a02[0], a13[0], a02[1], a13[1]]
            for j in cutlass.range_constexpr(nj):
                acc = mma_16816(a, [q_frag[j, s, 0], q_frag[j, s, 1]],
                              [acc_s[j, s % 2, 0], acc_s[j, s % 2, 1], acc_s[j, s % 2, 2], acc_s[j, s % 2, 3]])
                for c in cutlass.range_constexpr(4):
                    acc_s[j, s % 2, c] = acc[c]

        # The softmax of the warp's keys: key_row(g) for accumulators 0, 1 and key_row(g + 8) for 2, 3.
        base = n_block * lay.TILE_N + lay.KEYS_PER_WARP * warp
        keys = (base + lay.key_row(hd, g), base + lay.key_row(hd, g + 8))
        sc = cute.make_rmem_tensor(cute.make_layout((nj, 4)), Float32)
        new_max = cute.make_rmem_tensor(cute.make_layout(2 * nj), Float32)
        grow = Float32(0.0)
        for j in cutlass.range_constexpr(nj):
            for b in cutlass.range_constexpr(2):
                r = 2 * j + b
                blk = -Float32.inf
                for h in cutlass.range_constexpr(2):
                    c = b + 2 * h
                    x = acc_s[j, 0, c] + acc_s[j, 1, c]
                    if const_expr(self.softcap):
                        x = cute.math.tanh(x * prescale, fastmath=True)
                    x = x if (keys[h] >= lo[r] and keys[h] < hi[r]) else -Float32.inf
                    sc[j, c] = x
                    blk = cute.arch.fmax(blk, x)
                for o in cutlass.range_constexpr(3):  # the lanes of quad position q hold the row's other keys
                    blk = cute.arch.fmax(blk, cute.arch.shuffle_sync_bfly(blk, offset=4 << o))
                new_max[r] = cute.arch.fmax(row_max[r], blk * scale_log2)
                grow = cute.arch.fmax(grow, new_max[r] - row_max[r])  # +inf from -inf; NaN never wins
        if cute.arch.vote_any_sync(grow > RESCALE_LOG2):
            for r in cutlass.range_constexpr(2 * nj):
                cur = new_max[r]
                cur_safe = 0.0 if cur == -Float32.inf else cur
                factor = cute.math.exp2(row_max[r] - cur_safe, fastmath=True)
                row_max[r] = cur
                row_sum[r] = row_sum[r] * factor
                for i in cutlass.range_constexpr(self.k_steps):
                    acc_o[i, r // 2, r % 2] = acc_o[i, r // 2, r % 2] * factor
                    acc_o[i, r // 2, r % 2 + 2] = acc_o[i, r // 2, r % 2 + 2] * factor

        # P (fp16) as the B operand of O^T = V^T P^T: each 8 x 8 quarter of the 16 x 8 accumulator tile
        # (keys g | g + 8 by rows 2q, 2q+1) transposed into rows 2q, 2q+1 | 2q+8, 2q+9 of column g.
        p_frag = cute.make_rmem_tensor(cute.make_layout((nj, 2)), Int32)
        for j in cutlass.range_constexpr(nj):
            p = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            for c in cutlass.range_constexpr(4):
                r = 2 * j + c % 2
                m_safe = 0.0 if row_max[r] == -Float32.inf else row_max[r]
                p[c] = cute.math.exp2(sc[j, c] * scale_log2 - m_safe, fastmath=True)
            row_sum[2 * j] = row_sum[2 * j] + p[0] + p[2]
            row_sum[2 * j + 1] = row_sum[2 * j + 1] + p[1] + p[3]
            p_frag[j, 0] = movmatrix_trans(pack_f32x2(p[0], p[1], False))
            p_frag[j, 1] = movmatrix_trans(pack_f32x2(p[2], p[3], False))

        # V rows past the sequence's end (slots of a partial block, unowned pages: anything, NaN
        # included) become zeros, since P = 0 there and 0 * NaN = NaN. Only a tail block has them.
        if base + lay.KEYS_PER_WARP > seqlen_k:
            for kv in cutlass.range_constexpr(4):
                if base + lay.key_row(hd, 2 * q + (kv % 2) + 8 * (kv // 2)) >= seqlen_k:
                    for w in cutlass.range_constexpr(self.v_words):
                        vw[kv, w] = Int32(0)

        # O^T += V^T P^T. Word w of a V chunk holds head-dim columns 4w..4w+3 of the lane group's:
        # m-tiles 2w (bytes 0, 1: rows g, g + 8) and 2w + 1 (bytes 2, 3); the byte permutes pair keys
        # 2q, 2q+1 (A's columns) per column.
        for w in cutlass.range_constexpr(self.v_words):
            for t in cutlass.range_constexpr(2):
                i = 2 * w + t
                sel = 0x5140 if t == 0 else 0x7362
                a01 = e4m3x4_to_f16x2x2(prmt(vw[0, w], vw[1, w], sel))
                a23 = e4m3x4_to_f16x2x2(prmt(vw[2, w], vw[3, w], sel))
                a = [a01[0], a01[1], a23[0], a23[1]]
                for j in cutlass.range_constexpr(nj):
                    acc = mma_16816(a, [p_frag[j, 0], p_frag[j, 1]],
                                  [acc_o[i, j, 0], acc_o[i, j, 1], acc_o[i, j, 2], acc_o[i, j, 3]])
                    for c in cutlass.range_constexpr(4):
                        acc_o[i, j, c] = acc[c]
        return state

    @cute.jit
    def merge_tile(self, nj: cutlass.Constexpr[int], acc_o, row_max, row_sum, mO, mLSE, mOaccum, mLSEaccum, mSinks,
                   mVScale, merge_base, work, seqlen, problem, live_rows, tidx, warp, lane):
        """The four warps' partial results merged through shared memory, normalised (sinks join the
        denominator without splits), and stored as split_epilogue / epilogue_sm90.split_store store
        them: the final o and lse, or this split's float32 partials."""
        hd = self.hd
        g, q = lane // 4, lane % 4
        stride = lay.merge_row_stride(hd)
        o_base = merge_base + 4 * warp * lay.TILE_M * stride
        ml_base = merge_base + 4 * lay.WARPS * lay.TILE_M * stride + 4 * warp * 2 * lay.TILE_M
        # Row sums over the 8 lanes of each quad position (each holds its own keys' share).
        for r in cutlass.range_constexpr(2 * nj):
            for o in cutlass.range_constexpr(3):
                row_sum[r] = row_sum[r] + cute.arch.shuffle_sync_bfly(row_sum[r], offset=4 << o)
        # Each warp's partial O: row n = 8 j + 2 q + b, columns o_column(i, g, half) = the lane group's
        # chunk + 2 i + half, written four floats at a time (i = 2 i2, 2 i2 + 1).
        for j in cutlass.range_constexpr(nj):
            for b in cutlass.range_constexpr(2):
                n = 8 * j + 2 * q + b
                row_addr = o_base + 4 * (n * stride + lay.v_chunk(hd, g) * (hd // 8))
                for i2 in cutlass.range_constexpr(self.k_steps // 2):
                    sts_f32x4(row_addr + 16 * i2, [acc_o[2 * i2, j, b], acc_o[2 * i2, j, b + 2],
                                                  acc_o[2 * i2 + 1, j, b], acc_o[2 * i2 + 1, j, b + 2]])
        if g == 0:
            for r in cutlass.range_constexpr(2 * nj):
                n = 8 * (r // 2) + 2 * q + (r % 2)
                sts_f32(ml_base + 4 * n, row_max[r])
                sts_f32(ml_base + 4 * (lay.TILE_M + n), row_sum[r])
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=128)

        # Thread t: row t / 8, columns [(t % 8) hd / 8, + hd / 8).
        n = tidx // 8
        part = tidx % 8
        cols = hd // 8
        if n < live_rows:
            ml0 = merge_base + 4 * lay.WARPS * lay.TILE_M * stride
            big = -Float32.inf
            for w in cutlass.range_constexpr(lay.WARPS):
                big = cute.arch.fmax(big, lds_f32(ml0 + 4 * (w * 2 * lay.TILE_M + n)))
            big_safe = 0.0 if big == -Float32.inf else big
            total = Float32(0.0)
            o = cute.make_rmem_tensor(cute.make_layout(cols), Float32)
            o.fill(0.0)
            for w in cutlass.range_constexpr(lay.WARPS):
                wt = cute.math.exp2(lds_f32(ml0 + 4 * (w * 2 * lay.TILE_M + n)) - big_safe, fastmath=True)
                total = total + wt * lds_f32(ml0 + 4 * (w * 2 * lay.TILE_M + lay.TILE_M + n))
                src = merge_base + 4 * (w * lay.TILE_M * stride + n * stride + part * cols)
                for c4 in cutlass.range_constexpr(cols // 4):
                    v = lds_f32x4(src + 16 * c4)
                    for c in cutlass.range_constexpr(4):
                        o[4 * c4 + c] = o[4 * c4 + c] + wt * v[c]
            row = work.m_block * lay.TILE_M + n
            query = row // problem.qhead_per_kv
            pos = seqlen.offset_q + query
            head = work.head * problem.qhead_per_kv + row - query * problem.qhead_per_kv
            sink = -Float32.inf
            if problem.num_splits == 1:
                sink = mSinks[head] * _LOG2E
            inv = cute.make_rmem_tensor(cute.make_layout(1), Float32)
            lse = cute.make_rmem_tensor(cute.make_layout(1), Float32)
            finalize_row(inv, lse, 0, total, big, sink)
            f = inv[0] * mVScale[work.head]
            if query < seqlen.seqlen_q and pos < mO.shape[1]:
                if problem.num_splits == 1:
                    o_row = mO[seqlen.batch_q, pos, head, None]
                    for c in cutlass.range_constexpr(cols):
                        # The columns of O^T row c of the chunk (o_column): chunk part, in order.
                        o_row[part * cols + c] = (o[c] * f).to(mO.element_type)
                    if part == 0:
                        mLSE[seqlen.batch_q, head, pos] = lse[0]
                else:
                    o_row = mOaccum[work.split, seqlen.batch_q, pos, head, None]
                    for c in cutlass.range_constexpr(cols):
                        o_row[part * cols + c] = o[c] * f
                    if part == 0:
                        mLSEaccum[work.split, seqlen.batch_q, head, pos] = lse[0]
        # The next tile's merge writes this buffer again.
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=128)
