"""The split-KV merge of one output row (the SPLIT_PARTIALS epilogue's second half, seams.py), the
same code on every architecture.

With num_splits > 1 every split of a KV-cache tile writes its normalised O and its LSE (float32) to
a workspace, and the splits are merged: o = sum_s exp(lse_s - lse) o_s with lse = log(sum_s
exp(lse_s) + exp(sink)). Sinks join only here (a split must not count them). `merge_row` is the
merge of one (batch, query, q-head) row by one warp. Two places run it:
- the last split CTA of each tile to finish (split_epilogue.merge_splits_if_last), when the handler
  hands the kernel a zeroed semaphore per tile (ffi/kvcache.cc): no second launch;
- otherwise the combine kernel (kernels/combine.py), one warp per row: its own exported object
  per (arch, dtype, head_dim), the KV-cache family's companion COMBINE (ops/kvcache/spec.py), which
  the handler's generated launch runs right after the attention kernel.
Kept apart from that kernel so that editing it recompiles the 20 combine objects only, not every
KV-cache variant (the object cache follows each entry module's imports: aot/cache.py).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

_LOG2E = 1.4426950408889634


def merge_chunk(head_dim: int) -> int:
    """Splits whose partials one warp's merge loads together: per lane head_dim / 32 floats of each,
    64 registers in all (16 splits at hd <= 128). The merge sits at the tail of every split decode and
    its cost is latency: a merge of up to this many splits waits for one round of L2 loads, not one
    per few splits (issue 20, docs/PERF.md)."""
    return max(1, min(16, 64 // (head_dim // 32)))


@cute.jit
def _load_partials(buf_o: cute.Tensor, buf_lse: cute.Tensor, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor,
                   num_splits: Int32, first: Int32, batch: Int32, query: Int32, head: Int32, lane: Int32,
                   per_lane: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int]):
    """Splits [first, first + chunk) of the row into registers: this lane's slice of each partial O and
    each LSE. Indices past the last split load the last split again (its weight is then taken as 0)."""
    for j in cutlass.range_constexpr(chunk):
        s = cutlass.min(first + j, num_splits - 1)
        buf_lse[j] = mLSEaccum[s, batch, head, query]
        o_row = mOaccum[s, batch, query, head, None]
        for i in cutlass.range_constexpr(per_lane):
            buf_o[j * per_lane + i] = o_row[lane * per_lane + i]


@cute.jit
def merge_row(mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
              mSinks: cute.Tensor, num_splits: Int32, batch: Int32, query: Int32, head: Int32, lane: Int32,
              head_dim: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int] = 0):
    """One warp merges the num_splits partials of row (batch, query, head) into mO / mLSE, loading
    `chunk` splits' partials together (0: merge_chunk(head_dim); fewer where registers are scarcer)."""
    per_lane = head_dim // 32
    if const_expr(chunk == 0):
        chunk = merge_chunk(head_dim)
    # The first chunk of partials goes out before the LSE reduction, so that both arrive together.
    buf_o = cute.make_rmem_tensor(chunk * per_lane, Float32)
    buf_lse = cute.make_rmem_tensor(chunk, Float32)
    _load_partials(buf_o, buf_lse, mOaccum, mLSEaccum, num_splits, Int32(0), batch, query, head, lane, per_lane, chunk)
    # lse = log(sum_s exp(lse_s) + exp(sink)), computed against M = max(lse_s, sink) in log2 units;
    # every split with lse_s = -inf (no key in its range) weighs 0.
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
    for c in cutlass.range(0, num_splits, chunk, unroll=1):
        for j in cutlass.range_constexpr(chunk):
            w = cute.math.exp2(buf_lse[j] * _LOG2E - big_safe, fastmath=True) * inv
            w = Float32(0.0) if c + j >= num_splits else w
            for i in cutlass.range_constexpr(per_lane):
                acc[i] += w * buf_o[j * per_lane + i]
        if c + chunk < num_splits:
            _load_partials(buf_o, buf_lse, mOaccum, mLSEaccum, num_splits, c + chunk, batch, query, head, lane,
                           per_lane, chunk)
    out = mO[batch, query, head, None]
    for i in cutlass.range_constexpr(per_lane):
        out[lane * per_lane + i] = acc[i].to(mO.element_type)
    if lane == 0:
        lse = -Float32.inf if empty else (big_safe + cute.math.log2(total, fastmath=True)) * math.log(2.0)
        mLSE[batch, head, query] = Float32.inf if sink_wins else lse
