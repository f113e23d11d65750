"""Small device-side helpers shared by the forward kernels (CuTe DSL, build time only)."""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import warpgroup


def permute_modes(t: cute.Tensor, order: list[int]) -> cute.Tensor:
    """A view of `t` with its modes reordered (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def transpose_2d(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled) smem tensor, keeping the rest."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def _acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """SM90 wgmma accumulators are ((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N) per thread.

    Returns a layout over the same registers indexed as (rows, cols) =
    ((2 rows, MMA_M), (2 cols, N/8, MMA_N)), so that softmax and masking can walk rows.
    """
    natural = cute.make_layout(acc_layout.shape)  # logical coordinate -> register index order
    s, d = natural.shape, natural.stride
    rows = ((s[0][1], s[1]), (d[0][1], d[1]))
    cols = ((s[0][0], s[0][2], s[2]), (d[0][0], d[0][2], d[2]))
    mn = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.composition(acc_layout, mn)


def acc_as_mn(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, _acc_mn_layout(acc.layout))


@cute.jit
def _acc_frag_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """Reinterpret a QK^T accumulator ((2,2,N/8),M,N) as the register A operand of the PV wgmma,
    ((2,2,2), M, (N/16, N)): one A k-block (16 keys) is two adjacent 8-column accumulator groups.
    This is what lets P stay in registers between the two gemms (no smem round trip)."""
    div = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    s, d = div.shape, div.stride
    return cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
    )


def acc_as_frag_a(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, _acc_frag_a_layout(acc.layout))


@cute.jit
def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool] = False,
    wait: cutlass.Constexpr[int] = 0,
):
    """Issue one warpgroup gemm over all k-blocks, commit it, and optionally wait.

    `wait` < 0 leaves the gemm in flight so the caller can overlap it with other work and retire it
    later with `warpgroup.wait_group(n)`.
    """
    warpgroup.fence()
    # A fresh atom per call: the ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


@cute.jit
def _row_reduce(x: cute.TensorSSA, op: cutlass.Constexpr, init: Float32) -> Float32:
    """Reduce one row's registers with four independent chains (ILP), then fold in `init`."""
    r = cute.make_rmem_tensor(x.shape, Float32)
    r.store(x)
    acc = [r[i] for i in range(4)]
    for i in cutlass.range_constexpr(4, cute.size(x.shape), 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = op(acc[j], r[i + j])
    return op(op(op(acc[0], acc[1]), op(acc[2], acc[3])), init)


def row_max(x: cute.TensorSSA, init: Float32) -> Float32:
    return _row_reduce(x, cute.arch.fmax, init)


def row_sum(x: cute.TensorSSA, init: Float32) -> Float32:
    return _row_reduce(x, operator.add, init)


@cute.jit
def quad_allreduce_max(v: Float32) -> Float32:
    """The 4 threads of a quad hold one accumulator row between them."""
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1))
    return cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2))


@cute.jit
def quad_allreduce_sum(v: Float32) -> Float32:
    v = v + cute.arch.shuffle_sync_bfly(v, offset=1)
    return v + cute.arch.shuffle_sync_bfly(v, offset=2)


@cute.jit
def pow2(e: Int32) -> Float32:
    """2^e exactly, for an integer e in [-126, 127] (the float32 bits (e + 127) << 23; MUFU's ex2 is
    not specified to be exact even at integers)."""
    return Float32(llvm.bitcast(Float32.mlir_type, Int32((e + 127) << 23).ir_value()))


# FP8 K/V: the bound of q's power of two (2^e and 2^-e stay normal floats; bf16's largest, ~2^128,
# needs -116).
Q_E_BOUND = 125


@cute.jit
def fp8_q_exponent(amax: Float32, scale_log2: Float32, k_scale: Float32) -> Int32:
    """FP8 K/V tiles scale q by 2^e into fp16 (fwd_sm90.quantize_q, decode_fp8_sm90.load_q), one integer e
    per tile: trunc(12 - log2(amax)) for the tile's largest finite |q| amax (the approximate log2 moves
    it by less than a factor of 2 around 2^12), within [-Q_E_BOUND, Q_E_BOUND], and at most where the
    scores' factor scale_log2 * k_scale * 2^-e (the softmax's, without softcap) stays a normal float:
    a factor of 0 times a masked score (-inf) is NaN. (An all-zero tile, e.g. a zero-padded decode
    slot's q, would otherwise get the bound, 2^-125 times a small softmax scale and k_scale: 0.) The
    cap's margin of 2 covers the approximate log2 and the truncation."""
    e = cute.arch.fmin(cute.arch.fmax(12.0 - cute.math.log2(amax, fastmath=True), Float32(-Q_E_BOUND)),
                       Float32(Q_E_BOUND))
    e = cute.arch.fmin(e, cute.math.log2(scale_log2 * k_scale, fastmath=True) + 124.0)
    return Int32(cute.arch.fmax(e, Float32(-Q_E_BOUND)))


@dsl_user_op
def pack_f32x2(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """(lo, hi) rounded to nearest even into one 32-bit register of two 16-bit floats, lo in the low
    half: one `cvt.rn.{bf16x2,f16x2}.f32`. (A TensorSSA `.to(bf16)` compiles to one F2FP per element
    with the other half zero and a PRMT per pair to join them: three instructions where this is one.)"""
    kind = "bf16x2" if bf16 else "f16x2"
    # PTX: cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower.
    return Int32(llvm.inline_asm(T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
                                 f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def store_16bit(dst: cute.Tensor, src: cute.Tensor):
    """dst (a bf16 / fp16 register tensor, compact) = src (float32 registers of the same shape), rounded
    to nearest even, two elements per instruction: elements 2i and 2i + 1 (in dst's layout order, which
    for a compact fragment is register order) share one 32-bit register."""
    dst32 = cute.recast_tensor(dst, Int32)
    bf16 = const_expr(dst.element_type is cutlass.BFloat16)
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = pack_f32x2(src[2 * i], src[2 * i + 1], bf16)
