"""Warp-level PTX the FP8 decode tile (decode_fp8_sm90.py) is made of, and the FP8 chunk tile's
widening uses (fwd_sm90.widen_rows), as inline assembly on 32-bit registers: the synchronous
tensor-core mma (m16n8k16, fp16 in, float32 accumulate), the e4m3 -> fp16 conversion, the 8x8
transpose between an accumulator's layout and an operand's (movmatrix), byte permutes and vector
loads and stores of shared memory at computed addresses.

Why not CuTe's warp MMA atoms and copies: that tile places every operand register itself (keys and
head-dim columns permuted so that each thread's bytes are contiguous in the swizzled FP8 stage,
fp8_decode_layout.py), so the PTX register order is the contract, and spelling it out keeps it
checkable against the PTX ISA's fragment tables. Arch-neutral from sm_80 on (cvt.e4m3x2: sm_89).
"""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _i32(x, loc, ip):
    return Int32(x).ir_value(loc=loc, ip=ip)


def _f32(x, loc, ip):
    return Float32(x).ir_value(loc=loc, ip=ip)


def _struct(n, t):
    return llvm.StructType.get_literal([t] * n)


@dsl_user_op
def mma_16816(a, b, c, *, loc=None, ip=None):
    """d = a @ b + c for one m16n8k16 tile: a 4 x Int32 (f16x2: rows g / g+8, columns 2q..2q+1 /
    2q+8..2q+9 of the 16 x 16 A, g = lane / 4, q = lane % 4), b 2 x Int32 (f16x2: rows 2q..2q+1 /
    2q+8..2q+9 of column g of the 16 x 8 B), c 4 x Float32 ((g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)).
    Returns d as a list of 4 Float32 in c's order."""
    res = llvm.inline_asm(
        _struct(4, T.f32()),
        [_i32(x, loc, ip) for x in a] + [_i32(x, loc, ip) for x in b] + [_f32(x, loc, ip) for x in c],
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def e4m3x4_to_f16x2x2(word, *, loc=None, ip=None):
    """The four e4m3 bytes of `word` as two f16x2 words: (bytes 0, 1) and (bytes 2, 3), the lower byte
    in the lower half. Exact: every e4m3 value, subnormals included, is an fp16 number."""
    res = llvm.inline_asm(
        _struct(2, T.i32()), [_i32(word, loc, ip)],
        "{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, lo;\n\tcvt.rn.f16x2.e4m3x2 $1, hi;\n\t}",
        "=r,=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def prmt(a, b, selector: int, *, loc=None, ip=None) -> Int32:
    """PTX prmt.b32: byte i of the result is byte selector[4i:4i+4] of the pair (a = bytes 0-3, b = 4-7)."""
    return Int32(llvm.inline_asm(
        T.i32(), [_i32(a, loc, ip), _i32(b, loc, ip)], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def movmatrix_trans(x, *, loc=None, ip=None) -> Int32:
    """The warp's 8 x 8 matrix of 16-bit elements (lane l holds row l / 4, columns 2 (l % 4) and
    2 (l % 4) + 1, the lower column in the lower half: an mma accumulator's layout) transposed, in the
    same layout: what lane l gets is column l / 4, rows 2 (l % 4), 2 (l % 4) + 1 of the input."""
    return Int32(llvm.inline_asm(
        T.i32(), [_i32(x, loc, ip)], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def lds(addr, words: int, *, loc=None, ip=None):
    """`words` (1, 2 or 4) 32-bit words of shared memory at byte address `addr` (Int32, aligned to
    4 * words). A side effect as far as the compiler knows, so that it stays after the pipeline wait
    that makes the bytes valid."""
    regs = ", ".join(f"${i}" for i in range(words))
    vec = {1: "", 2: ".v2", 4: ".v4"}[words]
    op = f"ld.shared{vec}.b32 {{{regs}}}, [${words}];" if words > 1 else "ld.shared.b32 $0, [$1];"
    res = llvm.inline_asm(
        _struct(words, T.i32()) if words > 1 else T.i32(), [_i32(addr, loc, ip)], op,
        ",".join(["=r"] * words + ["r"]), has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    if words == 1:
        return [Int32(res)]
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(words)]


def _sts_v4(addr, values, ptx_type: str, constraint: str, cast, loc, ip):
    llvm.inline_asm(
        None, [_i32(addr, loc, ip)] + [cast(x, loc, ip) for x in values],
        f"st.shared.v4.{ptx_type} [$0], {{$1, $2, $3, $4}};", ",".join(["r"] + [constraint] * 4),
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def sts_f32x4(addr, v, *, loc=None, ip=None):
    """Four float32 to shared memory at byte address `addr` (16-byte aligned)."""
    _sts_v4(addr, v, "f32", "f", _f32, loc, ip)


@dsl_user_op
def lds_f32x4(addr, *, loc=None, ip=None):
    """Four float32 of shared memory at byte address `addr` (16-byte aligned)."""
    res = llvm.inline_asm(
        _struct(4, T.f32()), [_i32(addr, loc, ip)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def sts_f32(addr, v, *, loc=None, ip=None):
    """One float32 to shared memory at byte address `addr`."""
    llvm.inline_asm(None, [_i32(addr, loc, ip), _f32(v, loc, ip)], "st.shared.f32 [$0], $1;", "r,f",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def lds_f32(addr, *, loc=None, ip=None) -> Float32:
    """One float32 of shared memory at byte address `addr`."""
    return Float32(llvm.inline_asm(T.f32(), [_i32(addr, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r",
                                   has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def sts_b32x4(addr, words, *, loc=None, ip=None):
    """Four 32-bit words (e.g. f16x2) to shared memory at byte address `addr` (16-byte aligned)."""
    _sts_v4(addr, words, "b32", "r", _i32, loc, ip)
