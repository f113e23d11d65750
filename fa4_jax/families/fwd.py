"""The dense forward family: one (q, k, v) -> (o, lse) attention per call.

Its C ABI (what `fa4_jax.kernels.fwd` compiles and `ffi/fwd.cc` fills) is described here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4_jax.families.base import (
    ARCH_CC,
    DTYPES,
    Field,
    KernelFamily,
    KeyField,
    ScalarArg,
    TensorArg,
    Variant,
    arch_literal,
    bool_literal,
    dtype_literal,
    int_literal,
    parse_hd,
)

HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True, order=True)
class FwdVariant(Variant):
    """One forward-attention kernel: architecture x dtype x head_dim x mask kind."""

    FAMILY_PREFIX = "fa4_fwd"

    arch: str = "sm90"
    dtype: str = "bf16"
    head_dim: int = 128
    causal: bool = False

    def __post_init__(self):
        if self.arch not in ARCH_CC:
            raise ValueError(f"unsupported arch: {self.arch=}; expected one of {tuple(ARCH_CC)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype: {self.dtype=}; expected one of {DTYPES}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"unsupported head_dim: {self.head_dim=}; expected one of {HEAD_DIMS}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool: {self.causal=}")

    def _symbol_parts(self):
        return (self.arch, self.dtype, f"hd{self.head_dim}", "causal" if self.causal else "full")

    @classmethod
    def _from_parts(cls, parts):
        arch, dtype, hd, mask = parts
        if mask not in ("causal", "full"):
            raise ValueError(f"unknown mask {mask!r}")
        return cls(arch=arch, dtype=dtype, head_dim=parse_hd(hd), causal=(mask == "causal"))


def default_menu() -> tuple[FwdVariant, ...]:
    """Every forward variant `pip install` builds by default (Hopper kernels only for now)."""
    return tuple(
        FwdVariant("sm90", dtype, hd, causal)
        for dtype in DTYPES
        for hd in HEAD_DIMS
        for causal in (False, True)
    )


def _bshd(name: str, ptr: str, seq: str, heads: str, stride: str) -> TensorArg:
    # (batch, seqlen, heads, head_dim) with head_dim static and unit-stride in the kernel: three
    # dynamic shapes and three int64 element strides {batch, seq, head}.
    return TensorArg(name, f"p.{ptr}", ("p.b", f"p.{seq}", f"p.{heads}"),
                     tuple(f"p.{stride}[{i}]" for i in range(3)))


FWD = KernelFamily(
    name="fwd",
    target="fa4_jax_fwd_v1",
    variant=FwdVariant,
    params=(
        # void* rather than const: the exported structs hold `void *data`; q/k/v are read-only.
        Field("void *", "q"), Field("void *", "k"), Field("void *", "v"), Field("void *", "o"),
        Field("float *", "lse"),
        Field("int32_t", "b"), Field("int32_t", "s_q"), Field("int32_t", "s_k"),
        Field("int32_t", "h_q"), Field("int32_t", "h_k"),
        Field("int64_t", "q_stride[3]", "{batch, seq, head} in elements; head_dim stride is 1"),
        Field("int64_t", "k_stride[3]"), Field("int64_t", "v_stride[3]"), Field("int64_t", "o_stride[3]"),
        Field("int64_t", "lse_stride[2]", "{batch, head}; the seq stride is 1"),
        Field("float", "softmax_scale_log2", "softmax_scale * log2(e): the kernels use exp2"),
    ),
    tensors=(
        _bshd("mQ", "q", "s_q", "h_q", "q_stride"),
        _bshd("mK", "k", "s_k", "h_k", "k_stride"),
        _bshd("mV", "v", "s_k", "h_k", "v_stride"),
        _bshd("mO", "o", "s_q", "h_q", "o_stride"),
        TensorArg("mLSE", "p.lse", ("p.b", "p.h_q", "p.s_q"), ("p.lse_stride[0]", "p.lse_stride[1]")),
    ),
    scalars=(ScalarArg("float", "softmax_scale_log2", "p.softmax_scale_log2"),),
    key=(
        KeyField("arch", "int", arch_literal),
        KeyField("dtype", "::fa4_jax::DType", dtype_literal),
        KeyField("head_dim", "int", int_literal),
        KeyField("causal", "bool", bool_literal),
    ),
    enums={},
    handler="ffi/fwd.cc",
    compile="fa4_jax.kernels.fwd:compile_variant",
    default_menu=default_menu,
)
