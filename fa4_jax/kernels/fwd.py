"""Entry point of the dense forward family (fa4_jax/ops/fwd/spec.py): compile one FwdVariant.

The fake tensors below are the family's exported C ABI; `fa4_jax.aot` checks the generated header
against FWD.tensors / FWD.scalars, so a change here that is not mirrored there fails the build.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from fa4_jax.ops.fwd.spec import FwdVariant
from fa4_jax.kernels.common import DTYPES, compile_options, fake_bshd, fake_f32, fake_i32


def make_kernel(variant: FwdVariant):
    if variant.arch == "sm90":
        from fa4_jax.kernels.config import Sm90FwdConfig
        from fa4_jax.kernels.fwd_sm90 import FlashAttentionForwardSm90
        from fa4_jax.kernels.seams import FwdSeams

        kernel = FlashAttentionForwardSm90(Sm90FwdConfig.for_variant(variant), variant.mask, variant.softcap,
                                           FwdSeams.dense())
        return kernel.call_dense
    if variant.arch == "sm100":
        if variant.tile_m:
            raise NotImplementedError(f"the SM100 kernel has no short-problem tile: {variant.symbol}")
        from fa4_jax.kernels.config_sm100 import sm100_fwd_config
        from fa4_jax.kernels.fwd_sm100 import FlashAttentionForwardSm100

        # Prefill: two 128-row Q tiles per CTA in ping-pong where Tensor Memory holds both O
        # accumulators (head_dim <= 128), one past that (config_sm100.sm100_fwd_config).
        cfg = sm100_fwd_config(variant.head_dim)
        return FlashAttentionForwardSm100(cfg, variant.mask, variant.softcap).call_dense
    raise NotImplementedError(f"no forward kernel for {variant.arch=} yet")


def compile_variant(variant: FwdVariant):
    """Compile one variant for its architecture, GPU-blind. Returns the compiled object."""
    dtype = DTYPES[variant.dtype]
    q, k, v, o = (fake_bshd(dtype, variant.head_dim) for _ in range(4))
    lse, sinks, tile_counter = fake_f32(3), fake_f32(1, unit_stride=False), fake_i32(1)
    scale_log2, softcap_prescale = cutlass.Float32(1.0), cutlass.Float32(1.0)
    window_left, window_right, max_ctas = cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1)
    return cute.compile(
        make_kernel(variant), q, k, v, o, lse, sinks, tile_counter, scale_log2, softcap_prescale, window_left,
        window_right, max_ctas, cuda.CUstream(0), options=compile_options(variant.arch),
    )
