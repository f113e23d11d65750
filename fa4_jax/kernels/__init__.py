"""CuTe-DSL kernels. Build time only: importing this package needs `nvidia-cutlass-dsl`.

`compile_fwd(variant)` compiles one FwdVariant GPU-blind (no device is queried) into an object
whose `export_to_c` writes the header + object file the AOT exporter links into libfa4_jax.so.
The fake tensors below define the exported C ABI (see BUILD.md): dynamic batch / seqlen / heads and
strides, static head_dim with unit stride, 16-byte aligned base pointers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import make_fake_tensor

from fa4_jax.variants import FwdVariant

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# Without an explicit host target the export fails on a GPU-less machine (GUIDE.md §2).
_HOST_TARGET = "--host-target 'llvm -mtriple=x86_64-unknown-linux-gnu'"
_GPU_ARCH = {"sm90": "sm_90a", "sm100": "sm_100a"}


# Dynamic strides must be 64-bit SymInts: the exported C struct always declares `int64_t
# dynamic_strides[]`, but a default (32-bit) SymInt stride makes the compiled code read the fields
# as packed int32 -- every stride but one silently becomes 0 (seen with cutlass-dsl 4.8.1).
def _stride(divisibility: int = 1):
    return cute.sym_int64(divisibility=divisibility)


def _fake_bshd(dtype, head_dim: int):
    # Strides are multiples of 8 elements (16 bytes) because head_dim is a multiple of 16: TMA
    # requires 16-byte aligned global strides, and declaring it lets the compiler prove it.
    b, s, h = cute.SymInt(), cute.SymInt(), cute.SymInt()
    sb, ss, sh = (_stride(8) for _ in range(3))
    return make_fake_tensor(dtype, (b, s, h, head_dim), (sb, ss, sh, 1), assumed_align=16)


def _fake_lse():
    b, h, s = cute.SymInt(), cute.SymInt(), cute.SymInt()
    sb, sh = _stride(), _stride()
    return make_fake_tensor(cutlass.Float32, (b, h, s), (sb, sh, 1), assumed_align=4)


def make_fwd_kernel(variant: FwdVariant):
    if variant.arch != "sm90":
        raise NotImplementedError(f"no forward kernel for {variant.arch=} yet")
    from fa4_jax.kernels.config import Sm90FwdConfig
    from fa4_jax.kernels.fwd_sm90 import FlashAttentionForwardSm90

    return FlashAttentionForwardSm90(Sm90FwdConfig.for_variant(variant), variant.causal)


def compile_fwd(variant: FwdVariant):
    """Compile one variant for its architecture, GPU-blind. Returns the compiled object."""
    dtype = _DTYPES[variant.dtype]
    q, k, v, o = (_fake_bshd(dtype, variant.head_dim) for _ in range(4))
    options = f"--gpu-arch {_GPU_ARCH[variant.arch]} {_HOST_TARGET}"
    return cute.compile(
        make_fwd_kernel(variant), q, k, v, o, _fake_lse(), cutlass.Float32(1.0), cuda.CUstream(0),
        options=options,
    )
