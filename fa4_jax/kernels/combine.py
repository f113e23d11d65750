"""Entry point of the KV-cache family's companion COMBINE (fa4_jax/ops/kvcache/spec.py): compile one
CombineVariant, the split combine of kernels/combine_sm90.py for one (arch, dtype, head_dim).

Its fake tensors are the KV-cache variants' own for the same arguments (kernels/kvcache.py), so the
wrapper reads the KV-cache Params exactly as the attention kernel's does.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from fa4_jax.kernels.combine_sm90 import SplitCombineSm90
from fa4_jax.kernels.common import DTYPES, compile_options, fake_bshd, fake_f32, fake_o_accum
from fa4_jax.ops.kvcache.spec import CombineVariant


def compile_variant(variant: CombineVariant):
    o = fake_bshd(DTYPES[variant.dtype], variant.head_dim)
    lse, lse_accum = fake_f32(3), fake_f32(4)
    o_accum = fake_o_accum(variant.head_dim)
    sinks = fake_f32(1, unit_stride=False)
    return cute.compile(SplitCombineSm90(variant.head_dim), o_accum, lse_accum, o, lse, sinks, cutlass.Int32(1),
                        cuda.CUstream(0), options=compile_options(variant.arch))
