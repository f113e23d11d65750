"""Online softmax over register-resident accumulator rows (FlashAttention style)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4_jax.kernels.utils import acc_as_mn, quad_allreduce_max, quad_allreduce_sum, row_max, row_sum


@dataclass(frozen=True)  # frozen: usable inside a kernel's dynamic tile loop (see tile_scheduler.py)
class OnlineSoftmax:
    """Running row max / row sum for the rows this thread owns.

    Scores arrive unscaled; `scale_log2` = softmax_scale * log2(e) folds the softmax scale and the
    change of base into one FFMA per element, so every exponential is a single MUFU ex2.
    `row_sum` is a per-thread partial (the quad's columns are summed once, in `finalize`): every
    thread of a quad applies the same rescale factor, so partial sums stay consistent.
    """

    scale_log2: Float32
    # Per row this thread owns (the tensors' contents change, the fields do not): the running max of
    # the scaled scores (m * scale_log2, -inf before any key), and the running sum.
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, num_rows: int) -> "OnlineSoftmax":
        return OnlineSoftmax(scale_log2, cute.make_rmem_tensor(num_rows, Float32),
                             cute.make_rmem_tensor(num_rows, Float32))

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool], rows=None, live_rows=None) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return the factor by which the
        running output must be rescaled.

        `live_rows` (with `rows`, the tile rows of the thread's accumulators as acc_as_mn of the
        identity partition) bounds the tile rows whose results are stored: a row of the thread's
        that no lane of its warp holds below the bound is left as it is (its scores go on into P
        and O rows that nothing stores; its rescale factor is 1). A pack-GQA decode tile holds
        one query x its q-heads, 4 or 8 of 64 rows, so three warps of four and half of the
        fourth skip the ex2 and the reductions of every block. The test is warp-uniform (a vote),
        so the quad shuffles below are never reached by part of a warp.

        `row_max` holds the running max already scaled (m * scale_log2, rounded once to float32)
        and every exponent and rescale factor is taken against that stored value, so the rounding
        of m * scale_log2 is common to all of a row's terms and cancels in O and the LSE, whichever
        way the compiler fuses s * scale_log2 - shift into an FMA. (A rescale computed as
        (m_prev - m) * scale_log2 is consistent with the exponents only if the FMA takes the shift
        exactly; the old form also let the max's exponent reach ulp(|m * scale_log2|): NaN rows at
        softmax_scale 1e8.) The exponent of the max is now the product's rounding error, at most
        ulp/2, so probabilities stay finite while |m * scale_log2| < 2^28 (fp16 P: 2^15 is its
        largest power); P's rounding to 16 bits then costs O up to 2^-9 relative, unaveraged when
        attention is one-hot.
        """
        s_mn = acc_as_mn(acc_S)
        scale = cute.make_rmem_tensor(self.row_max.layout, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            if const_expr(live_rows is None):
                self._row_step(s_mn, scale, r, is_first)
            else:
                scale[r] = 1.0
                if cute.arch.vote_any_sync(rows[r, 0][0] < live_rows):
                    self._row_step(s_mn, scale, r, is_first)
        return scale

    @cute.jit
    def _row_step(self, s_mn: cute.Tensor, scale: cute.Tensor, r: cutlass.Constexpr[int],
                  is_first: cutlass.Constexpr[bool]):
        """step() for the thread's row r (its quad holds the row between them)."""
        row = s_mn[r, None].load()
        prev = self.row_max[r]
        block_max = quad_allreduce_max(row_max(row, -Float32.inf)) * self.scale_log2
        cur = block_max if const_expr(is_first) else cute.arch.fmax(prev, block_max)
        self.row_max[r] = cur
        # A row masked so far has max -inf; exponentiate against 0 instead so that masked
        # entries give exp2(-inf) = 0 rather than NaN from (-inf) - (-inf).
        cur_safe = 0.0 if cur == -Float32.inf else cur
        p = cute.math.exp2(row * self.scale_log2 - cur_safe, fastmath=True)
        s_mn[r, None].store(p)
        if const_expr(is_first):
            scale[r] = 1.0
            self.row_sum[r] = row_sum(p, Float32(0.0))
        else:
            scale[r] = cute.math.exp2(prev - cur_safe, fastmath=True)
            self.row_sum[r] = row_sum(p, self.row_sum[r] * scale[r])

    @cute.jit
    def finalize(self, sink_log2) -> cute.Tensor:
        """Return the factor that normalises each row of O, and overwrite `row_sum` with the LSE
        (natural log).

        `sink_log2` is the rows' attention-sink logit times log2(e) (-inf: no sink), one Float32 for
        all rows or an rmem tensor with one per row (pack-GQA tiles mix heads): it joins the
        denominator with no value row. The running sum is relative to the scaled row max m', so with
        M = max(m', sink_log2) the denominator is 2^M * (sum * 2^(m' - M) + 2^(sink - M)) and O's
        factor 2^(m' - M) / (...): both exponents are <= 0, so a sink far above the scores cannot
        overflow. A row that saw no key and has no sink has sum 0: its output stays 0 and its LSE is
        -inf; with a sink its LSE is the sink logit. A sink of +inf takes the whole mass (o = 0,
        lse = +inf); a NaN sink makes the row NaN (o and lse), as in the reference.
        """
        inv = cute.make_rmem_tensor(self.row_max.layout, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = quad_allreduce_sum(self.row_sum[r])
            m_scaled = self.row_max[r]
            sink = sink_log2[r] if const_expr(isinstance(sink_log2, cute.Tensor)) else sink_log2
            finalize_row(inv, self.row_sum, r, total, m_scaled, sink)
        return inv

    @staticmethod
    @cute.jit
    def softcap(acc_S: cute.Tensor, prescale: Float32, rows=None, live_rows=None):
        """Logit softcapping, in place: s -> tanh(s * softmax_scale / cap). The cap itself and
        log2(e) live in `scale_log2`, so the softmax then sees cap * tanh(s * softmax_scale / cap).
        `rows` / `live_rows` as in step(): rows no lane of the warp stores skip the tanh (MUFU, like
        the ex2 step() skips for them); their scores go on unused."""
        if const_expr(live_rows is None):
            acc_S.store(cute.math.tanh(acc_S.load() * prescale, fastmath=True))
        else:
            s_mn = acc_as_mn(acc_S)
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                if cute.arch.vote_any_sync(rows[r, 0][0] < live_rows):
                    s_mn[r, None].store(cute.math.tanh(s_mn[r, None].load() * prescale, fastmath=True))

    @staticmethod
    @cute.jit
    def rescale(acc_O: cute.Tensor, scale: cute.Tensor):
        o_mn = acc_as_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(scale)):
            o_mn[r, None].store(o_mn[r, None].load() * scale[r])


@cute.jit
def finalize_row(inv: cute.Tensor, lse: cute.Tensor, r, total: Float32, m_scaled: Float32, sink: Float32):
    """inv[r] = O's factor and lse[r] = the LSE (natural log) of one row, as OnlineSoftmax.finalize
    documents them: `total` the row's running sum relative to its scaled max `m_scaled` (-inf: no
    key), `sink` the sink logit times log2(e) (-inf: none). Every architecture's kernel normalises its
    rows with this (register tensors and an index: the Hopper kernel's rows, a one-element tensor for
    the Blackwell kernel's one row per thread)."""
    big = cute.arch.fmax(m_scaled, sink)
    big_safe = 0.0 if big == -Float32.inf else big
    o_scale = cute.math.exp2(m_scaled - big_safe, fastmath=True)
    denom = total * o_scale + cute.math.exp2(sink - big_safe, fastmath=True)
    empty = denom == 0.0
    inv[r] = 0.0 if empty else o_scale * cute.arch.rcp_approx(denom)
    value = (big_safe + cute.math.log2(denom, fastmath=True)) * math.log(2.0)
    lse[r] = -Float32.inf if empty else value
    if sink == Float32.inf:
        inv[r] = 0.0
        lse[r] = Float32.inf
    if sink != sink:
        inv[r] = sink
        lse[r] = sink


@cute.jit
def empty_row_o(sink: Float32) -> Float32:
    """The O of a row that sees no key, for the kernels that write such rows directly (padding rows
    no sequence owns, tiles without keys): 0, as finalize_row's factor makes it whatever the sink,
    but NaN with a NaN sink, whose row is NaN, o and lse (the reference's semantics)."""
    fill = Float32(0.0)
    if sink != sink:
        fill = sink
    return fill
