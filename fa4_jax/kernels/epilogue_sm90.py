"""The SM90 epilogues behind the epilogue seam (seams.py): how a tile's normalised O and its LSE
leave the CTA. All run on the consumer warpgroups; `tidx` is the consumer thread index."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from fa4_jax.kernels.named_barrier import NamedBarrierFwd
from fa4_jax.kernels.softmax import empty_row_o
from fa4_jax.kernels.utils import acc_as_mn, store_16bit


@cute.jit
def tma_store(cfg, acc_O, lse, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tidx, m_block, head, batch, seqlen_q):
    """TMA_STORE: O written with stmatrix into sO (Q's buffer, dead by then, unless cfg.separate_o)
    and stored with one TMA bulk copy, which clips rows past the tensor's end; LSE straight from
    registers."""
    n_consumer = 128 * cfg.num_consumer_wg

    # LSE straight from registers: the thread holding column 0 of a row writes it.
    thr_mma_pv = tiled_mma_pv.get_slice(tidx)
    tOcO = acc_as_mn(thr_mma_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))))
    if tOcO[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = m_block * cfg.tile_m + tOcO[r, 0][0]
            if row < seqlen_q:
                mLSE[row, head, batch] = lse[r]

    dtype = sO.element_type
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    store_16bit(rO, acc_O)
    if const_expr(cfg.separate_o):
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
        if const_expr(not cfg.separate_o):
            # sO is Q's buffer: the caller releases Q for the CTA's next tile (and the CTA's smem
            # must outlive the copy) once it has been read. With a separate sO the next tile's
            # epilogue, or tma_store_drain, waits instead: the store overlaps work.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def tma_store_drain(cfg, tidx):
    """After a CTA's last tile: the CTA's smem must outlive the last O store's reads."""
    if const_expr(cfg.separate_o):
        if tidx < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def row_store(acc_O, lse, tOcO, mO, mLSE, head, first_row, num_rows):
    """ROW_STORE: rows [first_row, first_row + min(num_rows, tile_m)) of head `head` of packed
    (t, d, h) O / (h, t) LSE, from registers. Rows outside [0, total_q) are dropped, so offsets that
    break the contract never write out of bounds."""
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
def fill_unowned_rows(cfg, mO, mLSE, mSinks, tidx, work, problem):
    """ROW_STORE's padding: a pseudo-batch tile (m_block, head) covers the rows past
    cu_seqlens_q[batch], strided over the pseudo-batch's m-blocks: o = 0 (NaN with a NaN sink) and
    lse = the sink logit (-inf without sinks), as the reference defines them."""
    n_threads = 128 * cfg.num_consumer_wg
    # Clamped: a negative offset (a broken contract) must not write before the tensor.
    start = cutlass.max(problem.mCuSeqlensQ[problem.num_batch], 0)
    stride = problem.num_m_blocks * cfg.tile_m
    fill = empty_row_o(mSinks[work.head]).to(mO.element_type)
    row0 = start + work.m_block * cfg.tile_m
    while row0 < problem.total_q:
        for i in cutlass.range(tidx, cfg.tile_m * cfg.head_dim, n_threads, unroll=1):
            row = row0 + i // cfg.head_dim
            if row < problem.total_q:
                mO[row, i % cfg.head_dim, work.head] = fill
        for i in cutlass.range(tidx, cfg.tile_m, n_threads, unroll=1):
            if row0 + i < problem.total_q:
                mLSE[work.head, row0 + i] = mSinks[work.head]
        row0 += stride


@cute.jit
def packed_sinks_log2(cfg, sink_log2, tOcO, mSinks, work, problem, log2e):
    """SPLIT_PARTIALS' sink logits (times log2(e)) of the thread's pack-GQA rows: each row has its
    own q-head. Sinks join the final denominator once: here without splits, in the combine with
    them (-inf: none)."""
    for r in cutlass.range_constexpr(cute.size(sink_log2)):
        sink_log2[r] = -Float32.inf
        if problem.num_splits == 1:
            row = work.m_block * cfg.tile_m + tOcO[r, 0][0]
            head = work.head * problem.qhead_per_kv + row % problem.qhead_per_kv
            sink_log2[r] = mSinks[head] * log2e
    return sink_log2


@cute.jit
def split_store(cfg, acc_O, lse, tOcO, mO, mLSE, mOaccum, mLSEaccum, work, seqlen, problem):
    """SPLIT_PARTIALS: O and LSE of the tile's valid pack-GQA rows, straight from registers: the
    final o (in q's dtype) and lse without splits, else this split's float32 partials. A row's
    query sits at (seqlen.batch_q, seqlen.offset_q + query) of q's (qb, s_q) extents; rows outside
    them are dropped (offsets are clamped, this is the second guard)."""
    o_mn = acc_as_mn(acc_O)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        row = work.m_block * cfg.tile_m + tOcO[r, 0][0]
        query = row // problem.qhead_per_kv
        pos = seqlen.offset_q + query
        if query < seqlen.seqlen_q and pos < mO.shape[1]:
            head = work.head * problem.qhead_per_kv + row - query * problem.qhead_per_kv
            if problem.num_splits == 1:
                o_row = mO[seqlen.batch_q, pos, head, None]
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_row[tOcO[r, c][1]] = o_mn[r, c].to(mO.element_type)
                if tOcO[r, 0][1] == 0:
                    mLSE[seqlen.batch_q, head, pos] = lse[r]
            else:
                o_row = mOaccum[work.split, seqlen.batch_q, pos, head, None]
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_row[tOcO[r, c][1]] = o_mn[r, c]
                if tOcO[r, 0][1] == 0:
                    mLSEaccum[work.split, seqlen.batch_q, head, pos] = lse[r]
