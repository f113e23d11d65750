"""Entry point of the varlen family (fa4_jax/ops/varlen/spec.py): compile one VarlenVariant.

The fake tensors below are the family's exported C ABI (VARLEN.tensors / VARLEN.scalars)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from fa4_jax.ops.varlen.spec import VarlenVariant
from fa4_jax.kernels.common import DTYPES, compile_options, fake_f32, stride


def make_kernel(variant: VarlenVariant):
    if variant.arch == "sm90":
        from fa4_jax.ops.fwd.spec import FwdVariant
        from fa4_jax.kernels.config import Sm90FwdConfig
        from fa4_jax.kernels.fwd_sm90 import FlashAttentionForwardSm90
        from fa4_jax.kernels.seams import FwdSeams

        # The dense kernel's tiles for the same head_dim (varlen is the dense kernel at offsets).
        dense = FwdVariant(variant.arch, variant.dtype, variant.head_dim, variant.mask, variant.softcap)
        kernel = FlashAttentionForwardSm90(Sm90FwdConfig.for_variant(dense, varlen=True), variant.mask, variant.softcap,
                                           FwdSeams.varlen())
        return kernel.call_varlen
    if variant.arch == "sm100":
        from fa4_jax.kernels.config_sm100 import sm100_fwd_config
        from fa4_jax.kernels.fwd_sm100 import FlashAttentionForwardSm100
        from fa4_jax.kernels.seams import FwdSeams

        # The dense SM100 kernel's configuration (two Q tiles per CTA at head_dim <= 128), at
        # per-sequence offsets (opt-in, as the dense one).
        cfg = sm100_fwd_config(variant.head_dim)
        return FlashAttentionForwardSm100(cfg, variant.mask, variant.softcap, FwdSeams.varlen()).call_varlen
    raise NotImplementedError(f"no varlen kernel for {variant.arch=} yet")


def _fake_thd(dtype, head_dim: int):
    """(total_tokens, heads, head_dim): dynamic t/h and strides (multiples of 8 elements for TMA)."""
    return make_fake_tensor(dtype, (cute.SymInt(), cute.SymInt(), head_dim), (stride(8), stride(8), 1),
                            assumed_align=16)


def _fake_index():
    return make_fake_tensor(cutlass.Int32, (cute.SymInt(),), (stride(),), assumed_align=4)


def compile_variant(variant: VarlenVariant):
    dtype = DTYPES[variant.dtype]
    q, k, v, o = (_fake_thd(dtype, variant.head_dim) for _ in range(4))
    lse = fake_f32(2)
    cu_q, cu_k, used_k = _fake_index(), _fake_index(), _fake_index()
    sinks = fake_f32(1, unit_stride=False)
    f32, i32 = cutlass.Float32(1.0), cutlass.Int32(1)
    return cute.compile(
        make_kernel(variant), q, k, v, o, lse, cu_q, cu_k, used_k, sinks, f32, f32, i32, i32, i32, i32,
        cuda.CUstream(0), options=compile_options(variant.arch),
    )
