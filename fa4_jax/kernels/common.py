"""Build-time helpers shared by the kernel families' entry modules: fake tensors and compile options."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from fa4_jax.families.base import GPU_ARCH_FLAG

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# Without an explicit host target the export fails on a GPU-less machine (BUILD.md, Pitfalls).
_HOST_TARGET = "--host-target 'llvm -mtriple=x86_64-unknown-linux-gnu'"


def compile_options(arch: str) -> str:
    return f"--gpu-arch {GPU_ARCH_FLAG[arch]} {_HOST_TARGET}"


# Dynamic strides must be 64-bit SymInts: the exported C struct always declares `int64_t
# dynamic_strides[]`, but a default (32-bit) SymInt stride makes the compiled code read the fields
# as packed int32 -- every stride but one silently becomes 0 (seen with cutlass-dsl 4.8.1).
def stride(divisibility: int = 1):
    return cute.sym_int64(divisibility=divisibility)


def fake_bshd(dtype, head_dim: int):
    """(batch, seqlen, heads, head_dim): dynamic b/s/h and strides, static unit-stride head_dim.

    Strides are multiples of 16 bytes (8 16-bit or 16 FP8 elements) because head_dim is a multiple
    of 16: TMA requires 16-byte aligned global strides, and declaring it lets the compiler prove it."""
    b, s, h = cute.SymInt(), cute.SymInt(), cute.SymInt()
    sb, ss, sh = (stride(128 // dtype.width) for _ in range(3))
    return make_fake_tensor(dtype, (b, s, h, head_dim), (sb, ss, sh, 1), assumed_align=16)


def fake_f32(rank: int, unit_stride: bool = True):
    """A float32 tensor of `rank` dynamic modes, the last one unit-stride (e.g. LSE (b, h, s)) unless
    `unit_stride` is False (then every stride is dynamic: the exported struct always has a strides
    array, which keeps every tensor argument of the ABI the same shape)."""
    shape = tuple(cute.SymInt() for _ in range(rank))
    strides = tuple(stride() for _ in range(rank - 1)) + ((1,) if unit_stride else (stride(),))
    return make_fake_tensor(cutlass.Float32, shape, strides, assumed_align=4)


def fake_i32(rank: int):
    """int32 index tensor: (b, max_pages) row-major with unit last stride; (n,) with a dynamic stride
    (the exported struct then has a strides array, like every tensor of the ABI)."""
    shape = tuple(cute.SymInt() for _ in range(rank))
    strides = (stride(), 1) if rank == 2 else (stride(),)
    return make_fake_tensor(cutlass.Int32, shape, strides, assumed_align=4)


def fake_o_accum(head_dim: int):
    """The split workspace's partial O: (splits, b, s_q, h_q, d) float32, d static and unit-stride."""
    shape = tuple(cute.SymInt() for _ in range(4)) + (head_dim,)
    return make_fake_tensor(cutlass.Float32, shape, tuple(stride(4) for _ in range(4)) + (1,), assumed_align=16)
