"""2^x on the FMA pipe (FlashAttention-4's software exp2), for the softmax's exponentials beside
MUFU.EX2, whose 16 results per clock per SM bind at head_dim <= 128 on Blackwell (FA4_NOTES.md).

The arithmetic and its constants are config_sm100's (EXP2_POLY, EXP2_MIN_X), modelled step for step
in tests/sm100_models.py and checked there on the CPU: max relative error 9.4e-5, the bf16 rounding
equal to that of the exact value on 99% of [-126, 0] and of (0, 8] (scores above a stale max), 0
below -126 as MUFU's ex2.approx.ftz, NaN for NaN.
Arch-neutral PTX (add.rm, fma.rn, shl, selp): used by the SM100 kernel.
"""

from __future__ import annotations

import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fa4_jax.kernels.config_sm100 import EXP2_MIN_X, EXP2_POLY

# x + 1.5 * 2^23, rounded down, is 1.5 * 2^23 + floor(x) for |x| < 2^22: floor without a convert, and
# the integer sits in the low mantissa bits, from which a shift by 23 makes the exponent-field add.
_MAGIC = 12582912.0


def _hex(x: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


_ASM = "\n\t".join([
    "{",
    ".reg .f32 xc, r, n, f, p;",
    ".reg .b32 e, b;",
    ".reg .pred low, nan;",
    f"setp.lt.f32 low, $1, {_hex(EXP2_MIN_X)};",
    f"max.f32 xc, $1, {_hex(EXP2_MIN_X)};",
    f"add.rm.ftz.f32 r, xc, {_hex(_MAGIC)};",
    f"sub.f32 n, r, {_hex(_MAGIC)};",
    "sub.f32 f, xc, n;",
    f"fma.rn.f32 p, {_hex(EXP2_POLY[3])}, f, {_hex(EXP2_POLY[2])};",
    f"fma.rn.f32 p, p, f, {_hex(EXP2_POLY[1])};",
    f"fma.rn.f32 p, p, f, {_hex(EXP2_POLY[0])};",
    "mov.b32 e, r;",
    "shl.b32 e, e, 23;",
    "mov.b32 b, p;",
    "add.s32 b, b, e;",
    "mov.b32 $0, b;",
    "selp.f32 $0, 0f00000000, $0, low;",
    # A NaN score stays NaN, as through MUFU (max.f32 would have replaced it by EXP2_MIN_X).
    "setp.nan.f32 nan, $1, $1;",
    "selp.f32 $0, $1, $0, nan;",
    "}",
])


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x by a degree-3 polynomial on the FMA pipe, for the softmax's x <= RESCALE_THRESHOLD_LOG2 (a
    stale max lets a score exceed it by that much; any x < 128 works): 0 for x < EXP2_MIN_X and
    -inf, NaN for NaN."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _ASM, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))
