"""The SM90 loaders behind the q_load and kv_load seams (seams.py): TMA K/V blocks from a contiguous
or a paged cache, and pack-GQA Q rows gathered with cp.async."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from fa4_jax.kernels.named_barrier import NamedBarrierFwd
# Rows of one paged piece (the family's spec): 16 for page sizes that are multiples of 16 (one TMA
# box each, 8 per 128-key block), else 1 (any page size, e.g. 1): rows gathered with 16-byte
# cp.async by the 128 threads of the producer warpgroup (one TMA box per row would be issue-bound).
from fa4_jax.ops.kvcache.spec import PAGE_ROWS, PAGE_ROWS_CHOICES


def sequence_rows(mX: cute.Tensor, head, batch, offset, varlen: bool) -> cute.Tensor:
    """The (rows, head_dim) matrix of one sequence and head: mX[:, :, head, batch] of a dense
    (s, d, h, b) tensor, or the rows from `offset` on of a packed (t, d, h) one."""
    if varlen:
        return cute.domain_offset((offset, 0), mX[None, None, head])
    return mX[None, None, head, batch]


def threads_per_row(dtype, head_dim: int) -> int:
    """Threads sharing one row in the 16-byte row copies (row_copy, clear_v_rows): the largest power
    of two (<= 32) dividing the row's 16-byte chunks (head_dim / 8 for bf16), so that a warp and a
    warpgroup hold whole rows. 8 / 16 / 32 threads at head_dim 64 / 128 / 256, one chunk each; 4 at
    96 and 8 at 192 (12 and 24 chunks), three chunks each, threads_per_row chunks apart."""
    return math.gcd(head_dim // (128 // dtype.width), 32)


def row_thread_layout(dtype, head_dim: int, n_threads: int):
    """(thread layout, value layout) for make_tiled_copy_tv: n_threads / tpr rows per pass, thread t
    at row t / tpr and column chunk t % tpr (then + tpr, + 2 tpr, ... over the row)."""
    tpr = threads_per_row(dtype, head_dim)
    return (cute.make_ordered_layout((n_threads // tpr, tpr), order=(1, 0)),
            cute.make_layout((1, 128 // dtype.width)))


def row_copy(dtype, head_dim: int, n_threads: int):
    """16-byte cp.async of (rows, head_dim) tiles by `n_threads` threads (row_thread_layout). Returns
    (copy atom, tiled copy, elements per copy)."""
    vec = 128 // dtype.width
    # cp.async.cg: through L2 only. The default .ca allocates every line in L1, which is what shared
    # memory leaves of the SM's 256 KB (~28 KB here): that capped the bytes in flight of the
    # one-row K/V gather at a small fraction of what the HBM latency needs.
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=128)
    tiled = cute.make_tiled_copy_tv(atom, *row_thread_layout(dtype, head_dim, n_threads))
    return atom, tiled, vec


def tma_tile_copy(atom, g_tiles: cute.Tensor, s_tiles: cute.Tensor):
    """(global tiles, smem stages) partitioned for one TMA atom, issued by one thread."""
    one = cute.make_layout(1)
    return cpasync.tma_partition(atom, 0, one, cute.group_modes(s_tiles, 0, 2), cute.group_modes(g_tiles, 0, 2))


@dataclass(frozen=True)
class KVLoader:
    """Copies of one tile's K/V blocks into pipeline stages: one TMA box per block from contiguous
    rows, tile_n / 16 boxes (one per 16-row page piece) from a paged cache with page_rows 16, or
    rows gathered by cp.async with page_rows 1. `k` and `v` have the (n_block, stage, barrier)
    signature of FlashAttentionForwardSm90.load_blocks. TMA: the producer warp calls them (one
    elected lane issues each box; paged with copy_warps > 1, each producer warp its share of the
    pieces); gather: the whole producer warpgroup does."""

    cfg: object
    paged: bool
    tKgK: cute.Tensor  # contiguous: partitioned (box, n_block); paged: (16, d, piece, 1, page); gather: (ps, d, page)
    tKsK: cute.Tensor  # contiguous: partitioned (box, stage); paged: the smem stages
    tVgV: cute.Tensor
    tVsV: cute.Tensor
    tma_atom_K: cute.CopyAtom
    tma_atom_V: cute.CopyAtom
    page_row: cute.Tensor | None  # paged: mPageTable[batch, None]
    page_size: Int32 | None  # paged only
    page_rows: int = PAGE_ROWS  # paged: rows per piece (PAGE_ROWS_CHOICES)
    tidx: Int32 | None = None  # paged: the thread's index in the producer warpgroup
    copy_warps: int = 1  # paged TMA pieces: the producer warps sharing each block's (SM90 cfg.copy_warps)

    @staticmethod
    def create(cfg, paged: bool, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, head, batch, offset_k,
               varlen: bool, page_size, page_rows: int = PAGE_ROWS, tidx=None, copy_warps: int = 1):
        if const_expr(paged and page_rows == 1):
            # (page_size, d, num_pages) of this head: rows are addressed one by one.
            return KVLoader(cfg, paged, mK[None, None, head, None], sK, mV[None, None, head, None], sV, None, None,
                            mPageTable[batch, None], page_size, page_rows, tidx)
        if const_expr(paged):
            # (page_size, d, num_pages) per head, tiled in page_rows-row pieces:
            # (page_rows, d, pieces per page, 1, num_pages)
            gK = cute.flat_divide(mK[None, None, head, None], (page_rows, cfg.head_dim))
            gV = cute.flat_divide(mV[None, None, head, None], (page_rows, cfg.head_dim))
            return KVLoader(cfg, paged, gK, sK, gV, sV, tma_atom_K, tma_atom_V, mPageTable[batch, None], page_size,
                            page_rows, tidx, copy_warps)
        tile = (cfg.tile_n, cfg.head_dim)
        gK = cute.local_tile(sequence_rows(mK, head, batch, offset_k, varlen), tile, (None, 0))
        gV = cute.local_tile(sequence_rows(mV, head, batch, offset_k, varlen), tile, (None, 0))
        tKsK, tKgK = tma_tile_copy(tma_atom_K, gK, sK)
        tVsV, tVgV = tma_tile_copy(tma_atom_V, gV, sV)
        return KVLoader(cfg, paged, tKgK, tKsK, tVgV, tVsV, tma_atom_K, tma_atom_V, None, None)

    @cute.jit
    def lookup(self, n_block):
        """Paged: this lane's share of block n_block's page lookups, (page, position in the page) of
        the piece (TMA: lane j, piece j) or of the row (gather: see _gather_rows) it owns, for the
        copies to take by shuffle. One page-table load per lane for the whole block; load_blocks
        issues it a block ahead of the copies that use it, so its latency (a dependent load in
        front of every copy, then in front of every block: paged decode ran at 3.4 TB/s, page 1 at
        0.8, then 2.6) hides behind the copies in flight. A block outside the table (the
        look-ahead past the last one) reads its first or last entry; the copies clamp ids into the
        pool. Contiguous: (0, 0), unused."""
        cfg = self.cfg
        if const_expr(not self.paged):
            return Int32(0), Int32(0)
        lane = cute.arch.lane_idx()
        if const_expr(self.page_rows == 1):
            tpr = threads_per_row(self.tKgK.element_type, cfg.head_dim)
            rows_per_pass = 128 // tpr
            rows_per_warp_pass = 32 // tpr
            # Index i of the warp's tile_n / 4 rows: row (i // rpwp) * rows_per_pass + warp * rpwp + i % rpwp.
            i = lane % (cfg.tile_n // 4)
            row = (i // rows_per_warp_pass) * rows_per_pass + (self.tidx // 32) * rows_per_warp_pass \
                + i % rows_per_warp_pass
            unit = n_block * cfg.tile_n + row
            per_page = self.page_size
        else:
            pieces = cfg.tile_n // self.page_rows
            unit = n_block * pieces + lane % pieces
            per_page = self.page_size // self.page_rows
        entry = unit // per_page
        within = unit - entry * per_page
        entry = cutlass.max(cutlass.min(entry, self.page_row.shape[0] - 1), 0)
        # The raw id: the copies clamp it a block later (_copy, _gather_rows), when the load has
        # landed. Clamped here, the producer waited for the load right away: a page-table latency
        # in front of every block's copies (paged decode at 1 x 32k: 2-4% faster without it).
        return self.page_row[entry], within

    @cute.jit
    def k(self, n_block, stage, barrier, page, within):
        """K block n_block into `stage`; paged: (page, within) = lookup(n_block) of this lane (load_blocks
        issues it a block ahead), ignored for a contiguous cache."""
        self._copy(self.tma_atom_K, self.tKgK, self.tKsK, n_block, stage, barrier, page, within)

    @cute.jit
    def v(self, n_block, stage, barrier, page, within):
        self._copy(self.tma_atom_V, self.tVgV, self.tVsV, n_block, stage, barrier, page, within)

    @cute.jit
    def _copy(self, atom, g, s, n_block, stage, barrier, page, within):
        cfg = self.cfg
        if const_expr(self.paged and self.page_rows == 1):
            self._gather_rows(g, s, stage, page, within)
        elif const_expr(self.paged):
            # Box j takes piece j's page from lane j. With copy_warps > 1, producer warp w issues
            # pieces w, w + copy_warps, ... (every warp looked up the whole block).
            s_pieces = cute.flat_divide(s[None, None, stage], (self.page_rows, cfg.head_dim))
            page = cutlass.max(cutlass.min(page, g.shape[4] - 1), 0)  # into the pool (lookup)
            warp = 0  # one copy warp: j is a compile-time index
            if const_expr(self.copy_warps > 1):
                warp = cute.arch.make_warp_uniform(self.tidx // 32)
            for jj in cutlass.range_constexpr(cfg.tile_n // self.page_rows // self.copy_warps):
                j = jj * self.copy_warps + warp
                src = g[None, None, cute.arch.shuffle_sync(within, j), 0, cute.arch.shuffle_sync(page, j)]
                tS, tG = tma_tile_copy(atom, src, s_pieces[None, None, j, 0])
                cute.copy(atom, tG, tS, tma_bar_ptr=barrier)
        else:
            cute.copy(atom, g[None, n_block], s[None, stage], tma_bar_ptr=barrier)

    @cute.jit
    def _gather_rows(self, g, s, stage, my_page, my_slot):
        """One-row pieces (any page size): the producer warpgroup's 128 threads copy the block's rows
        with 16-byte cp.async. row_copy gives thread t the column chunk t % tpr (tpr = threads per
        row) of rows pass * (128 / tpr) + t / tpr, so each warp copies tile_n / 4 rows <= 32; lane i
        looked up the warp's i-th row (lookup) and computes its global address once; each pass
        takes its row's address from the owning lane with a (64-bit) shuffle. Before, every thread
        shuffled (page, slot) and redid the 64-bit address arithmetic of its row: ~15 instructions
        per 16-byte copy, which left the producer behind the tile_m-128 consumers (chunks at page 1
        1.37x page 64's time). Row r is key n_block * tile_n + r: slot pos % page_size of page
        page_table[pos // page_size]. The caller's producer_commit arrives on the stage's barrier
        when the copies have landed."""
        cfg = self.cfg
        dtype = g.element_type
        copy_atom, tiled, vec = row_copy(dtype, cfg.head_dim, 128)
        tpr = threads_per_row(dtype, cfg.head_dim)
        rows_per_warp_pass = 32 // tpr
        thr = tiled.get_slice(self.tidx)
        tKsK = thr.partition_D(s[None, None, stage])
        tKcK = thr.partition_S(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim)))
        src_lane_in_pass = cute.arch.lane_idx() // tpr
        page = cutlass.max(cutlass.min(my_page, g.shape[2] - 1), 0)
        my_row = (g.iterator + cute.crd2idx((my_slot, 0, page), g.layout)).toint()
        for m in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
            row = cute.arch.shuffle_sync(my_row, m * rows_per_warp_pass + src_lane_in_pass)
            src_row = cute.make_tensor(cute.make_ptr(dtype, row, cute.AddressSpace.gmem, assumed_align=16),
                                       (cfg.head_dim,))
            src = cute.tiled_divide(src_row, (vec,))
            for k in cutlass.range_constexpr(cute.size(tKsK, mode=[2])):
                cute.copy(copy_atom, src[None, tKcK[0, m, k][1] // vec], tKsK[None, m, k])


def _pass_columns(tXcX) -> tuple:
    """The first column of each of a thread's chunks in one pass of a row copy (row_copy's
    partition of an identity tensor): static, and the same in every pass."""
    return tuple(tXcX[0, 0, k][1] for k in range(cute.size(tXcX, mode=[2])))


@cute.jit
def _gather_q_row(copy_atom, vec: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int], mQ, dst, cols, row,
                  work, seqlen, problem):
    """One pass of the pack-GQA Q gather: the thread's chunks (dst: (vec, chunks) of shared memory,
    cols: their first columns, the same in every pass) of tile row `row` (absolute: m_block * tile_m + local row), if that
    row is one of the sequence's. Row r is query r // qhead_per_kv of q-head kv_head * qhead_per_kv +
    r % qhead_per_kv -- a runtime division, hence no TMA box -- at (seqlen.batch_q,
    seqlen.offset_q + query) of q."""
    dtype = mQ.element_type
    query = row // problem.qhead_per_kv
    pos = seqlen.offset_q + query
    if query < seqlen.seqlen_q and pos < mQ.shape[1]:
        head = work.head * problem.qhead_per_kv + row - query * problem.qhead_per_kv
        start = mQ.iterator + cute.crd2idx((seqlen.batch_q, pos, head, 0), mQ.layout)
        src_row = cute.make_tensor(cute.make_ptr(dtype, start.toint(), cute.AddressSpace.gmem, assumed_align=16),
                                   (head_dim,))
        src = cute.tiled_divide(src_row, (vec,))
        for k in cutlass.range_constexpr(len(cols)):
            cute.copy(copy_atom, src[None, cols[k] // vec], dst[None, k])


@cute.jit
def gather_packed_q(cfg, mQ, sQ, tidx, work, seqlen, problem):
    """Pack-GQA Q on SM90: gather the tile's (query, q-head) rows with 16-byte cp.async by the
    consumer warpgroups (rows past seqlen_q are left as they are: they only ever feed rows that are
    not stored), then make them visible to wgmma."""
    dtype = mQ.element_type
    n_threads = 128 * cfg.num_consumer_wg
    if const_expr(cfg.num_consumer_wg > 1):
        # The rows are shared out over every consumer thread, so a warpgroup writes rows of the
        # other's half: it may do so only once the other's gemms of the previous tile (which read
        # them) are done. (Decode tiles have one warpgroup, whose own waits order it.)
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=n_threads)
    copy_atom, tiled, vec = row_copy(dtype, cfg.head_dim, n_threads)
    thr = tiled.get_slice(tidx)
    tQsQ = thr.partition_D(sQ)
    tQcQ = thr.partition_S(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim)))
    for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
        _gather_q_row(copy_atom, vec, cfg.head_dim, mQ, tQsQ[None, m, None], _pass_columns(tQcQ),
                      work.m_block * cfg.tile_m + tQcQ[0, m, 0][0], work, seqlen, problem)
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    # cp.async writes are generic-proxy writes; wgmma reads shared memory through the async proxy.
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=n_threads)


@cute.jit
def gather_packed_q_warp(tile_rows: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int], mQ, sQ, lane, work,
                         seqlen, problem):
    """Pack-GQA Q by one warp (SM100's load warp): the tile's first `tile_rows` rows of sQ (an
    (M, head_dim) view, M >= tile_rows) with 16-byte cp.async, in passes of 32 / threads_per_row
    rows; only the passes that hold rows of the sequence run (a decode tile has a few). Rows left
    out keep what shared memory held: they feed only rows that are not stored. The caller waits for
    the copies and fences them into the async proxy."""
    dtype = mQ.element_type
    copy_atom, tiled, vec = row_copy(dtype, head_dim, 32)
    thr = tiled.get_slice(lane)
    tQsQ = thr.partition_D(sQ)
    tQcQ = thr.partition_S(cute.make_identity_tensor((cute.size(sQ, mode=[0]), head_dim)))
    tpr = threads_per_row(dtype, head_dim)
    rows_per_pass = 32 // tpr
    rows = cutlass.min(tile_rows, seqlen.seqlen_q * problem.qhead_per_kv - work.m_block * tile_rows)
    for m in cutlass.range(cute.ceil_div(cutlass.max(rows, 0), rows_per_pass), unroll=1):
        local = m * rows_per_pass + lane // tpr  # row_thread_layout: lane t at row t / tpr of the pass
        if local < rows:
            _gather_q_row(copy_atom, vec, head_dim, mQ, tQsQ[None, m, None], _pass_columns(tQcQ),
                          work.m_block * tile_rows + local, work, seqlen, problem)
