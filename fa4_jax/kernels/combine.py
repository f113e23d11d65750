"""The split combine kernel and the entry point of the KV-cache family's companion COMBINE
(fa4_jax/ops/kvcache/spec.py): compile one CombineVariant, for one (arch, dtype, head_dim). The
kernel is one warp per output row running split_merge.merge_row, launched by the handler's generated
row after a split attention kernel whose last split CTAs did not merge (no tile counters).

Its fake tensors are the KV-cache variants' own for the same arguments (kernels/kvcache.py), so the
wrapper reads the KV-cache Params exactly as the attention kernel's does.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from fa4_jax.kernels.common import DTYPES, compile_options, fake_bshd, fake_f32, fake_o_accum
from fa4_jax.kernels.split_merge import merge_row
from fa4_jax.ops.kvcache.spec import CombineVariant

# One warp per output row, four rows per CTA.
COMBINE_ROWS_PER_CTA = 4


class SplitCombine:
    """The combine kernel: one warp per (batch, query, q-head) row merges its num_splits partials."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mOaccum: cute.Tensor,  # (splits_cap, qb, s_q, h_q, d) float32
        mLSEaccum: cute.Tensor,  # (splits_cap, qb, h_q, s_q) float32
        mO: cute.Tensor,  # (qb, s_q, h_q, d)
        mLSE: cute.Tensor,  # (qb, h_q, s_q) float32
        mSinks: cute.Tensor,  # (h_q,) float32, -inf = none
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        """The exported C ABI (ops/kvcache/spec.py COMBINE): one warp per (batch, query, q-head) row."""
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.combine(mOaccum, mLSEaccum, mO, mLSE, mSinks, num_splits).launch(
            grid=[cute.ceil_div(rows, COMBINE_ROWS_PER_CTA), 1, 1],
            block=[32 * COMBINE_ROWS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def combine(self, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                mSinks: cute.Tensor, num_splits: Int32):
        tidx = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0] * COMBINE_ROWS_PER_CTA + tidx // 32
        h_q, s_q = mO.shape[2], mO.shape[1]
        if row < mO.shape[0] * s_q * h_q:
            merge_row(mOaccum, mLSEaccum, mO, mLSE, mSinks, num_splits, row // (h_q * s_q), (row // h_q) % s_q,
                      row % h_q, tidx % 32, self.head_dim)


def compile_variant(variant: CombineVariant):
    o = fake_bshd(DTYPES[variant.dtype], variant.head_dim)
    lse, lse_accum = fake_f32(3), fake_f32(4)
    o_accum = fake_o_accum(variant.head_dim)
    sinks = fake_f32(1, unit_stride=False)
    return cute.compile(SplitCombine(variant.head_dim), o_accum, lse_accum, o, lse, sinks, cutlass.Int32(1),
                        cuda.CUstream(0), options=compile_options(variant.arch))
