"""The arch-neutral half of the SPLIT_PARTIALS epilogue (seams.py): what a KV-cache tile writes
besides its own rows, with plain loads, stores and atomics that every architecture's kernel runs on
whichever threads it gives the epilogue (SM90: the consumer warpgroups; SM100: the correction
warpgroup).

- fill_unowned_packed_rows: a ragged batch's pseudo-batch tile writes the rows no sequence owns;
- merge_splits_if_last: the last split CTA of a (batch, KV head, m_block) tile to finish merges the
  tile's splits (split_merge.merge_row, one warp per row), so a split decode is one launch.

`tile_m` is the tile's query rows (pack-GQA rows: query * qhead_per_kv + member), `n_threads` the
threads taking part (`tidx` in [0, n_threads)), `barrier_id` a named barrier of exactly those threads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4_jax.kernels.softmax import empty_row_o
from fa4_jax.kernels.split_merge import merge_row


@cute.jit
def fill_unowned_packed_rows(tile_m: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                             n_threads: cutlass.Constexpr[int], mO, mLSE, mOaccum, mLSEaccum, mSinks, tidx, work,
                             seqlen, problem):
    """A ragged batch's padding: the pseudo-batch's tile (m_block, kv-head, split) covers the pack-GQA
    rows past cu_seqlens_q[batch] (seqlen: no keys), strided over the pseudo-batch's m-blocks. What a
    row without visible keys gets: o = 0 (NaN with a NaN sink: softmax.empty_row_o) and lse = the
    sink logit (-inf without sinks); with splits, this split's partial (0, -inf), which the combine
    turns into the same."""
    stride = problem.num_m_blocks * tile_m
    rows = seqlen.seqlen_q * problem.qhead_per_kv
    group = problem.qhead_per_kv
    row0 = work.m_block * tile_m
    while row0 < rows:
        for i in cutlass.range(tidx, tile_m * head_dim, n_threads, unroll=1):
            row = row0 + i // head_dim
            if row < rows:
                query = row // group
                head = work.head * group + row - query * group
                pos = seqlen.offset_q + query
                col = i % head_dim
                if problem.num_splits == 1:
                    mO[seqlen.batch_q, pos, head, col] = empty_row_o(mSinks[head]).to(mO.element_type)
                else:
                    mOaccum[work.split, seqlen.batch_q, pos, head, col] = Float32(0.0)
        for i in cutlass.range(tidx, tile_m, n_threads, unroll=1):
            row = row0 + i
            if row < rows:
                query = row // group
                head = work.head * group + row - query * group
                pos = seqlen.offset_q + query
                if problem.num_splits == 1:
                    mLSE[seqlen.batch_q, head, pos] = mSinks[head]
                else:
                    mLSEaccum[work.split, seqlen.batch_q, head, pos] = -Float32.inf
        row0 += stride


@cute.jit
def merge_splits_if_last(tile_m: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                         n_threads: cutlass.Constexpr[int], barrier_id: cutlass.Constexpr[int], mO, mLSE, mOaccum,
                         mLSEaccum, mSinks, sMergeFlag, tidx, work, seqlen, problem, chunk: cutlass.Constexpr[int] = 0):
    """With the combine fused (problem.mSemaphores has a counter per (batch, KV head, m_block) tile,
    zero between launches): after its partial stores, each split CTA of a tile counts itself in; the
    last one to arrive merges the tile's rows from the workspace (merge_row, one warp per row) and
    puts the counter back to zero for the next launch. Saves the combine kernel's launch and its
    wait for the attention kernel's tail (issue 20). Every partial store of the CTA must have been
    made by the n_threads threads taking part (sMergeFlag: one int32 of shared memory). `chunk`:
    merge_row's, splits whose partials a warp holds at once (0: its default)."""
    # Release by thread 0 alone (CUTLASS's GenericBarrier::arrive_inc): the barrier orders every
    # thread's partial stores before thread 0's increment, and a release is cumulative over what
    # precedes it in causality order, so the other splits see them once they see the count. A fence
    # in every thread before the barrier (the threadfence-reduction sample's pattern, for data that
    # the fencing thread wrote itself) made the protocol ~1.3 us of every split CTA (docs/PERF.md).
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=n_threads)
    if tidx == 0:
        counter = (work.batch * problem.heads_kv + work.head) * problem.num_m_blocks + work.m_block
        ptr = (problem.mSemaphores.iterator + counter).llvm_ptr
        # acq_rel: release for this CTA's partials, acquire for the other splits' (every increment
        # is a release, and they form one release sequence on the counter).
        arrived = cute.arch.atomic_add(ptr, Int32(1), sem="acq_rel", scope="gpu")
        last = Int32(0)
        if arrived == problem.num_splits - 1:
            # Every split has counted in: nobody touches this counter again in this launch.
            cute.arch.atomic_exch(ptr, Int32(0), sem="relaxed", scope="gpu")
            last = Int32(1)
        sMergeFlag[0] = last
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=n_threads)
    if sMergeFlag[0] != 0:
        # Thread 0's acquire, then the barrier: the other splits' partials are visible to every
        # thread (CUTLASS's wait_eq: one acquiring thread, then the CTA barrier).
        lane = tidx % 32
        rows = cutlass.min(tile_m, seqlen.seqlen_q * problem.qhead_per_kv - work.m_block * tile_m)
        for r in cutlass.range(tidx // 32, rows, n_threads // 32, unroll=1):
            row = work.m_block * tile_m + r
            query = row // problem.qhead_per_kv
            pos = seqlen.offset_q + query
            if pos < mO.shape[1]:
                head = work.head * problem.qhead_per_kv + row - query * problem.qhead_per_kv
                merge_row(mOaccum, mLSEaccum, mO, mLSE, mSinks, problem.num_splits, seqlen.batch_q, pos, head, lane,
                          head_dim, chunk)
