"""The varlen family: attention over packed variable-length sequences (total_tokens, heads, d).

Its kernels (fa4_jax/kernels/fwd_sm90.py, configured by FwdSeams.varlen; on Blackwell fwd_sm100.py's
call_varlen, opt-in) are the dense kernel at per-sequence offsets read from cu_seqlens; handler
ffi/varlen.cc. Compile-time: mask kind and softcap, as for the dense family;
offsets, lengths, window bounds, softcap value, sinks and the grid bound max_seqlen_q are runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4_jax.families.base import Attr, Buffer, CallSignature, Field, KernelFamily, PublicEntry, TensorArg, params_as_scalars
from fa4_jax.ops.fwd.spec import ATTENTION_KEY, MASKS, SINKS, SOFTMAX_ATTRS, SOFTMAX_PARAMS, SOFTMAX_SCALARS, AttentionVariant
from fa4_jax.ops.fwd.spec import mask_kind
from fa4_jax.ops.fwd.spec import default_menu as fwd_default_menu


@dataclass(frozen=True, order=True)
class VarlenVariant(AttentionVariant):
    """One varlen kernel: AttentionVariant's fields (arch x dtype x head_dim x mask x softcap)."""

    FAMILY_PREFIX = "fa4_varlen"


def default_menu() -> tuple[VarlenVariant, ...]:
    """The dense family's default menu: every architecture, head dim, mask and softcap (the SM100
    kernels opt-in, as the dense ones: families.VALIDATED_ARCHES)."""
    return tuple(VarlenVariant(v.arch, v.dtype, v.head_dim, v.mask, v.softcap) for v in fwd_default_menu()
                 if v.tile_m == 0)


def _thd(name: str, ptr: str, total: str, heads: str, stride: str) -> TensorArg:
    return TensorArg(name, f"p.{ptr}", (f"p.{total}", f"p.{heads}"), (f"p.{stride}[0]", f"p.{stride}[1]"))


_PARAMS = (
    Field("void *", "q"), Field("void *", "k"), Field("void *", "v"), Field("void *", "o"),
    Field("float *", "lse", "(h_q, total_q)"),
    Field("int32_t *", "cu_seqlens_q", "(b + 1,)"), Field("int32_t *", "cu_seqlens_k", "(b + 1,)"),
    Field("int32_t *", "seqused_k", "(b,) keys used per sequence"),
    Field("float *", "sinks", "(h_q,) -inf = none"),
    Field("int32_t", "b"), Field("int32_t", "total_q"), Field("int32_t", "total_k"),
    Field("int32_t", "h_q"), Field("int32_t", "h_k"),
    Field("int64_t", "q_stride[2]", "{token, head} in elements; head_dim stride is 1"),
    Field("int64_t", "kv_stride[2]"),
    *SOFTMAX_PARAMS,
    Field("int32_t", "max_seqlen_q", "bounds every sequence's length: the grid's m-blocks"),
    Field("int32_t", "max_ctas", "persistent grid size (SM count) or INT32_MAX for one CTA per tile"),
)

CALL = CallSignature(
    operands=(
        Buffer("q", "input", ("total_q", "h_q", "d")),
        Buffer("k", "input", ("total_k", "h_k", "d")),
        Buffer("v", "input", ("total_k", "h_k", "d")),
        Buffer("cu_seqlens_q", "i32", ("b1",), "(batch + 1,) query offsets"),
        Buffer("cu_seqlens_k", "i32", ("b1",), "(batch + 1,) key offsets"),
        Buffer("seqused_k", "i32", ("b",), "keys used per sequence (the lowering passes the offsets' "
                                           "differences when the user gives none)"),
        SINKS,
    ),
    results=(
        Buffer("o", "input", ("total_q", "h_q", "d")),
        Buffer("lse", "f32", ("h_q", "total_q")),
    ),
    attrs=SOFTMAX_ATTRS + (
        Attr("max_seqlen_q", "i32", ">= 1, bounds every sequence's queries: the grid's m-blocks"),
    ),
)

VARLEN = KernelFamily(
    name="varlen",
    # v2: the generated unvalidated_ok attribute (families.base.OPT_IN_ATTR).
    target="fa4_jax_varlen_v2",
    variant=VarlenVariant,
    params=_PARAMS,
    tensors=(
        _thd("mQ", "q", "total_q", "h_q", "q_stride"),
        _thd("mK", "k", "total_k", "h_k", "kv_stride"),
        _thd("mV", "v", "total_k", "h_k", "kv_stride"),
        _thd("mO", "o", "total_q", "h_q", "q_stride"),
        TensorArg("mLSE", "p.lse", ("p.h_q", "p.total_q"), ("p.total_q",)),
        TensorArg("mCuSeqlensQ", "p.cu_seqlens_q", ("p.b + 1",), ("1",)),
        TensorArg("mCuSeqlensK", "p.cu_seqlens_k", ("p.b + 1",), ("1",)),
        TensorArg("mSequsedK", "p.seqused_k", ("p.b",), ("1",)),
        TensorArg("mSinks", "p.sinks", ("p.h_q",), ("1",)),
    ),
    scalars=params_as_scalars(_PARAMS, *SOFTMAX_SCALARS,
                              "max_seqlen_q", "max_ctas"),
    key=ATTENTION_KEY,
    enums={"Mask": MASKS},
    call=CALL,
    handler="ffi/varlen.cc",
    compile="fa4_jax.kernels.varlen:compile_variant",
    default_menu=default_menu,
    kernel_mask=mask_kind,
    entries=(PublicEntry("attention_varlen", "attention_varlen", (("any lengths", 32, 64),)),),
)
