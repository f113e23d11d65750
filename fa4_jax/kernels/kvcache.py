"""Entry point of the KV-cache family (fa4_jax/ops/kvcache/spec.py): compile one KVCacheVariant.

The fake tensors below are the family's exported C ABI (KVCACHE.tensors / KVCACHE.scalars); the
exporter checks the generated header against it.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from fa4_jax.ops.kvcache.spec import KVCacheVariant
from fa4_jax.kernels.common import DTYPES, compile_options, fake_bshd, fake_f32, fake_i32, fake_o_accum


def make_kernel(variant: KVCacheVariant):
    if variant.arch == "sm90":
        from fa4_jax.kernels.config import kvcache_config
        from fa4_jax.kernels.fwd_sm90 import FlashAttentionForwardSm90
        from fa4_jax.kernels.seams import FwdSeams

        kernel = FlashAttentionForwardSm90(kvcache_config(variant.head_dim, variant.tile_m, variant.paged,
                                                          variant.kv_fp8, variant.page_rows), variant.mask,
                                           variant.softcap, FwdSeams.kvcache(variant.paged),
                                           page_rows=variant.page_rows)
        return kernel.call_kvcache
    if variant.arch == "sm100":
        from fa4_jax.kernels.config_sm100 import sm100_fwd_config
        from fa4_jax.kernels.fwd_sm100 import FlashAttentionForwardSm100
        from fa4_jax.kernels.seams import FwdSeams

        # One 128-row Q tile per CTA (q_stage 1) holding the variant's tile_m pack-GQA rows (opt-in,
        # as the dense SM100 kernel).
        cfg = sm100_fwd_config(variant.head_dim, packed_rows=128)
        kernel = FlashAttentionForwardSm100(cfg, variant.mask, variant.softcap, FwdSeams.kvcache(variant.paged),
                                            tile_rows=variant.tile_m, page_rows=variant.page_rows)
        return kernel.call_kvcache
    raise NotImplementedError(f"no KV-cache kernel for {variant.arch=} yet")


def compile_variant(variant: KVCacheVariant):
    dtype = DTYPES[variant.dtype]
    kv_dtype = cutlass.Float8E4M3FN if variant.kv_fp8 else dtype
    q, o = (fake_bshd(dtype, variant.head_dim) for _ in range(2))
    k, v = (fake_bshd(kv_dtype, variant.head_dim) for _ in range(2))
    page_table, seqlens, cu_seqlens_q, tile_list = fake_i32(2), fake_i32(1), fake_i32(1), fake_i32(1)
    lse, lse_accum = fake_f32(3), fake_f32(4)
    o_accum = fake_o_accum(variant.head_dim)
    sinks = fake_f32(1, unit_stride=False)
    semaphores = fake_i32(1)
    k_scale, v_scale = fake_f32(1, unit_stride=False), fake_f32(1, unit_stride=False)
    tile_counter = fake_i32(1)
    f32, i32 = cutlass.Float32(1.0), cutlass.Int32(1)
    return cute.compile(
        make_kernel(variant), q, k, v, page_table, seqlens, cu_seqlens_q, tile_list, o, lse, o_accum, lse_accum,
        sinks, semaphores, k_scale, v_scale, tile_counter, f32, f32, i32, i32, i32, i32, i32, i32, i32,
        cuda.CUstream(0), options=compile_options(variant.arch),
    )
