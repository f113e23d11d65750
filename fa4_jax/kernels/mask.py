"""Masking of the scores inside boundary blocks (see block_info.py for which blocks those are).

Keys past seqlen_k are always masked (TMA zero-fills them, but a zero score is not "no key").

Each row's visible keys are one interval of columns, so a thread turns the interval into bit masks
over its own accumulators (one bit per register, a 32-bit word per 32 registers) and selects with
the bits: ptxas moves a word's bits to predicates with R2P, seven at a time, where a compare per
score cost an ISETP (and its index arithmetic) per register. That needs each register's column
offset from the thread's first column to be a compile-time constant with a known shape; the SM90
wgmma accumulator has it (columns 0, 1, 8, 9, 16, 17, ... past the thread's 2 * (lane % 4); the
arithmetic is mask_bits.py's, CPU-tested), and a layout without it falls back to a compare per score.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fa4_jax.kernels.block_info import BlockInfo
from fa4_jax.kernels.mask_bits import BITS, keep_bits, registers_left_of, wgmma_column_offset
from fa4_jax.kernels.utils import acc_as_mn


@dsl_user_op
def _shl_b32(x, n, *, loc=None, ip=None) -> Uint32:
    """x << n as PTX's shl.b32 (n >= 32 gives 0; C and LLVM leave that undefined)."""
    return Uint32(llvm.inline_asm(T.i32(), [Uint32(x).ir_value(loc=loc, ip=ip), Int32(n).ir_value(loc=loc, ip=ip)],
                                  "shl.b32 $0, $1, $2;", "=r,r,r", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dataclass(frozen=True)  # frozen: usable inside a kernel's dynamic tile loop (see tile_scheduler.py)
class ScoreMask:
    """Sets masked scores of one accumulator tile to -inf, for the thread's own elements."""

    blocks: BlockInfo
    tScS_mn: cute.Tensor  # (row, col) coordinates of this thread's accumulators, as acc_as_mn(tScS)
    bitmask: bool = False  # the column offsets are wgmma's (see the module docstring)

    @staticmethod
    def create(blocks: BlockInfo, tScS: cute.Tensor, tiled_mma: cute.TiledMma | None = None) -> "ScoreMask":
        """tiled_mma: the QK^T gemm whose thread 0 shows the column offsets' shape (compile-time)."""
        bitmask = False
        if tiled_mma is not None:
            t0 = acc_as_mn(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((blocks.tile_m, blocks.tile_n))))
            cols = [t0[0, c][1] for c in range(cute.size(t0, mode=[1]))]
            bitmask = cols == [wgmma_column_offset(c) for c in range(len(cols))]
        return ScoreMask(blocks, acc_as_mn(tScS), bitmask)

    @cute.jit
    def apply(self, acc_S: cute.Tensor, m_block, n_block, seqlen: cutlass.Constexpr[bool],
              window: cutlass.Constexpr[bool]):
        """seqlen: mask keys >= seqlen_k; window: mask outside each row's [left, right] edges."""
        b = self.blocks
        tile_m, tile_n = b.tile_m, b.tile_n
        s_mn = acc_as_mn(acc_S)
        ncol = cute.size(s_mn, mode=[1])
        left = const_expr(window and b.has_left_edge)
        # Column bounds below are relative to col_base; with bit masks, to the thread's first column.
        col_base = n_block * tile_n
        if const_expr(self.bitmask):
            col_base = col_base + self.tScS_mn[0, 0][1]
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            # Exclusive upper and inclusive lower column bound for this row.
            hi = b.seqlen.seqlen_k - col_base
            lo = 0
            if const_expr(window and b.has_right_edge):
                query = b.query_of_row(m_block * tile_m + self.tScS_mn[r, 0][0])
                diag = query + b.diag_offset() - col_base
                right = diag + b.window_right + 1
                hi = cutlass.min(hi, right) if const_expr(seqlen) else right
                if const_expr(left):
                    lo = diag - b.window_left
            if const_expr(self.bitmask):
                keep_hi = registers_left_of(hi, cutlass.max, cutlass.min)
                keep_lo = registers_left_of(lo, cutlass.max, cutlass.min) if const_expr(left) else 0
                for w in cutlass.range_constexpr(cute.ceil_div(ncol, BITS)):
                    bits = keep_bits(keep_lo, keep_hi, w, left, _shl_b32, cutlass.max)
                    # Unrolled with constant bit positions: that is what ptxas turns into R2P.
                    for i in cutlass.range_constexpr(min(BITS, ncol - w * BITS)):
                        c = w * BITS + i
                        s_mn[r, c] = s_mn[r, c] if cutlass.Boolean(bits & (Uint32(1) << i)) else -Float32.inf
            else:
                for c in cutlass.range_constexpr(ncol):
                    col = self.tScS_mn[r, c][1]
                    if const_expr(left):
                        s_mn[r, c] = -Float32.inf if (col >= hi or col < lo) else s_mn[r, c]
                    else:
                        s_mn[r, c] = -Float32.inf if col >= hi else s_mn[r, c]


@cute.jit
def mask_row_in_order(s_row: cute.Tensor, hi, lo, left: cutlass.Constexpr[bool]):
    """-inf outside columns [lo, hi) of a row that one thread holds whole and in column order (the
    SM100 softmax: register i is column i of its TMEM lane), by the bit masks ScoreMask uses: with
    consecutive columns the registers left of a bound are the bound itself. `lo` only if `left`."""
    n = cute.size(s_row)
    keep_hi = cutlass.max(hi, 0)
    keep_lo = cutlass.max(lo, 0) if const_expr(left) else 0
    for w in cutlass.range_constexpr(cute.ceil_div(n, BITS)):
        bits = keep_bits(keep_lo, keep_hi, w, left, _shl_b32, cutlass.max)
        for i in cutlass.range_constexpr(min(BITS, n - w * BITS)):
            c = w * BITS + i
            s_row[c] = s_row[c] if cutlass.Boolean(bits & (Uint32(1) << i)) else -Float32.inf
