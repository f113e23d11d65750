"""The dense forward family: one (q, k, v) -> (o, lse) attention per call.

Its C ABI (what `fa4_jax.kernels.fwd` compiles and `ffi/fwd.cc` fills) is described here once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from fa4_jax.families.base import ARCH_CC, DTYPES, Attr, Buffer, CallSignature, Field, KernelFamily, KeyField
from fa4_jax.families.base import TensorArg, Variant, arch_literal, bool_literal, dtype_literal, enum_literal
from fa4_jax.families.base import PublicEntry, int_literal, params_as_scalars, parse_hd

HEAD_DIMS = (64, 96, 128, 192, 256)
# What the inner loop must know at compile time about masking: none (only the ragged seqlen_k tail),
# causal (bottom-right diagonal), local (a two-sided window whose bounds are kernel arguments).
MASKS = ("full", "causal", "local")


def mask_kind(window_left: int, window_right: int) -> str:
    """The kernel's mask kind for a normalised window (see fa4_jax.core.validation.check_window)."""
    if window_left < 0 and window_right < 0:
        return "full"
    if window_left < 0 and window_right == 0:
        return "causal"
    return "local"


@dataclass(frozen=True, order=True)
class AttentionVariant(Variant):
    """The fields every attention family's kernels are compiled for: architecture x dtype x head_dim x
    mask kind x softcap. The families' variants extend it (FwdVariant, VarlenVariant, KVCacheVariant).

    Runtime values (window bounds, softcap value, sinks, scale) are kernel arguments; only what
    changes the inner loop is here: the mask kind and whether scores go through a tanh cap.
    """

    arch: str = "sm90"
    dtype: str = "bf16"
    head_dim: int = 128
    mask: str = "full"
    softcap: bool = False

    def __post_init__(self):
        self.check_fields({"arch": ARCH_CC, "dtype": DTYPES, "head_dim": HEAD_DIMS, "mask": MASKS}, ("softcap",))

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    def _symbol_parts(self):
        parts = [self.arch, self.dtype, f"hd{self.head_dim}", self.mask]
        return (*parts, "softcap") if self.softcap else tuple(parts)

    @classmethod
    def _from_parts(cls, parts):
        if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "softcap"):
            raise ValueError(f"expected arch_dtype_hdN_mask[_softcap], got {'_'.join(parts)!r}")
        arch, dtype, hd, mask = parts[:4]
        return cls(arch=arch, dtype=dtype, head_dim=parse_hd(hd), mask=mask, softcap=len(parts) == 5)


# Short causal problems on Hopper take a smaller query tile than the head dim's default, where one
# pays: the default tile's rows per K/V load win on long sequences, but a short causal problem has few
# of its tiles per sequence, of unequal work, and the longest make the tail.
# - hd64 (default 192 rows): 64-row tiles at two CTAs per SM divide such sequences and balance
#   (measured 1.15-1.19x at 1k, equal at 1.5k, 0.97x at 2k: docs/PERF.md).
# - hd96 (default 192 x 96 over three consumer warpgroups): the 128-row tile of hd128 (the 192-row
#   tile took 1.115 / 1.023 / 0.986 / 0.948 / 0.947x the 128-row tile's time at 1k / 2k / 4k / 8k /
#   16k causal, H100 2026-12-06).
# The handler takes a head dim's short tile where the library has it for the device and max(s_q, s_k)
# is at most that tile's bound; every other call takes the default tile (tile_m 0). The default menu
# builds them for SHORT_TILE_ARCHES only (the SM100 kernel has no such tiles).
SHORT_TILES = {64: (64, 1024), 96: (128, 2048)}  # head_dim -> (tile_m, max(s_q, s_k) it serves)
SHORT_TILE_MASKS = ("causal",)
SHORT_TILE_ARCHES = ("sm90",)


@dataclass(frozen=True, order=True)
class FwdVariant(AttentionVariant):
    """One dense forward kernel: AttentionVariant's fields and the query tile (0: the head dim's
    default; else the head dim's short-problem tile, SHORT_TILES above)."""

    FAMILY_PREFIX = "fa4_fwd"

    tile_m: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.check_fields({"tile_m": (0, *sorted({m for m, _ in SHORT_TILES.values()}))})
        short = SHORT_TILES.get(self.head_dim, (0, 0))[0]
        if self.tile_m and (self.tile_m != short or self.mask not in SHORT_TILE_MASKS):
            tiles = ", ".join(f"{m} at head_dim {hd}" for hd, (m, _) in SHORT_TILES.items())
            raise ValueError(f"tile_m {self.tile_m} is not a short-problem tile of head_dim {self.head_dim}, "
                             f"mask {self.mask} (short tiles: {tiles}; mask {SHORT_TILE_MASKS})")

    def _symbol_parts(self):
        parts = super()._symbol_parts()
        return (*parts, f"m{self.tile_m}") if self.tile_m else parts

    @classmethod
    def _from_parts(cls, parts):
        tile_m = 0
        if parts and re.fullmatch(r"m[0-9]+", parts[-1]):
            tile_m, parts = int(parts[-1][1:]), parts[:-1]
        base = AttentionVariant._from_parts(parts)
        return cls(**{f.name: getattr(base, f.name) for f in fields(AttentionVariant)}, tile_m=tile_m)


# The architectures this family has kernels for: Hopper, and Blackwell opt-in (not yet validated on
# hardware: families.base.VALIDATED_ARCHES).
ARCHES = ("sm90", "sm100")


def default_menu() -> tuple[FwdVariant, ...]:
    """Every forward variant `pip install` builds by default."""
    plain = tuple(
        FwdVariant(arch, dtype, hd, mask, softcap)
        for arch in ARCHES
        for dtype in DTYPES
        for hd in HEAD_DIMS
        for mask in MASKS
        for softcap in (False, True)
    )
    short = tuple(
        FwdVariant(arch, dtype, hd, mask, softcap, tile_m=tile_m)
        for arch in SHORT_TILE_ARCHES
        for dtype in DTYPES
        for hd, (tile_m, _) in SHORT_TILES.items()
        for mask in SHORT_TILE_MASKS
        for softcap in (False, True)
    )
    return plain + short


def _bshd(name: str, ptr: str, seq: str, heads: str, stride: str) -> TensorArg:
    # (batch, seqlen, heads, head_dim) with head_dim static and unit-stride in the kernel: three
    # dynamic shapes and three int64 element strides {batch, seq, head}.
    return TensorArg(name, f"p.{ptr}", ("p.b", f"p.{seq}", f"p.{heads}"),
                     tuple(f"p.{stride}[{i}]" for i in range(3)))


# The softmax and window params every attention family's kernels take (their Params fields, in this
# order, and the kernel scalars of the same names).
SOFTMAX_PARAMS = (
    Field("float", "softmax_scale_log2", "log2(e) * (softcap if softcap else softmax_scale): the kernels use exp2"),
    Field("float", "softcap_prescale", "softmax_scale / softcap: scores become tanh(s * this)"),
    Field("int32_t", "window_left", "local mask: keys [i + s_k - s_q - left, i + s_k - s_q + right], clamped by "
                                    "the handler"),
    Field("int32_t", "window_right", "clamped by the handler when unbounded"),
)
SOFTMAX_SCALARS = tuple(f.name for f in SOFTMAX_PARAMS)

_PARAMS = (
    # void* rather than const: the exported structs hold `void *data`; q/k/v are read-only.
    Field("void *", "q"), Field("void *", "k"), Field("void *", "v"), Field("void *", "o"),
    Field("float *", "lse"),
    Field("float *", "sinks", "(h_q,) per-head logits joining the softmax denominator; -inf = none"),
    Field("int32_t", "b"), Field("int32_t", "s_q"), Field("int32_t", "s_k"),
    Field("int32_t", "h_q"), Field("int32_t", "h_k"),
    Field("int64_t", "q_stride[3]", "{batch, seq, head} in elements; head_dim stride is 1"),
    Field("int64_t", "k_stride[3]"), Field("int64_t", "v_stride[3]"), Field("int64_t", "o_stride[3]"),
    Field("int64_t", "lse_stride[2]", "{batch, head}; the seq stride is 1"),
    *SOFTMAX_PARAMS,
    Field("int32_t", "max_ctas", "persistent grid size: the device's SM count"),
    Field("int32_t *", "tile_counter", "(n_tile_counters,) a zero-at-rest counter (runtime.h ZeroedCounters) "
                                       "from which a persistent grid takes its tiles, which the kernel leaves "
                                       "zeroed; null: CTA c takes tiles c, c + grid, ..."),
    Field("int32_t", "n_tile_counters", "1 with tile_counter, else 0"),
)


# The dispatch key every attention family starts from (the variant fields the handler derives from a
# call: device, dtype, head_dim, mask kind, softcap); families with more fields extend it.
ATTENTION_KEY = (
    KeyField("arch", "int", arch_literal),
    KeyField("dtype", "::fa4_jax::DType", dtype_literal),
    KeyField("head_dim", "int", int_literal),
    KeyField("mask", "Mask", enum_literal("Mask")),
    KeyField("softcap", "bool", bool_literal),
)

# The attributes every attention family's call starts with.
SOFTMAX_ATTRS = (
    Attr("softmax_scale", "f32", "multiplies q @ k^T; a positive normal float32 <= 1e4"),
    Attr("softcap", "f32", "0 = off, else scores become softcap * tanh(scores / softcap)"),
    Attr("window_left", "i32", "-1 = unbounded; relative to the bottom-right diagonal (causal = (-1, 0))"),
    Attr("window_right", "i32", "-1 = unbounded"),
)
# Per-head logits joining each row's softmax denominator with no value row; -inf adds nothing.
SINKS = Buffer("sinks", "f32", ("h_q",), "per-head sink logits", fill=float("-inf"))

CALL = CallSignature(
    operands=(
        Buffer("q", "input", ("b", "s_q", "h_q", "d")),
        Buffer("k", "input", ("b", "s_k", "h_k", "d")),
        Buffer("v", "input", ("b", "s_k", "h_k", "d")),
        SINKS,
    ),
    results=(
        Buffer("o", "input", ("b", "s_q", "h_q", "d")),
        Buffer("lse", "f32", ("b", "h_q", "s_q"), "natural-log units"),
    ),
    attrs=SOFTMAX_ATTRS,
    # SHORT_TILES as three parallel arrays for the handler's choice of tile.
    constants=(("short_tile_head_dims", tuple(SHORT_TILES)),
               ("short_tile_ms", tuple(m for m, _ in SHORT_TILES.values())),
               ("short_tile_max_seqlens", tuple(n for _, n in SHORT_TILES.values()))),
)

FWD = KernelFamily(
    name="fwd",
    # v2: sinks operand, window/softcap attributes (v1 had q, k, v and causal/softmax_scale only).
    # v3: the generated unvalidated_ok attribute (families.base.OPT_IN_ATTR).
    # v4: tile_counter (dynamic tile handout for causal and windowed calls).
    target="fa4_jax_fwd_v4",
    variant=FwdVariant,
    params=_PARAMS,
    tensors=(
        _bshd("mQ", "q", "s_q", "h_q", "q_stride"),
        _bshd("mK", "k", "s_k", "h_k", "k_stride"),
        _bshd("mV", "v", "s_k", "h_k", "v_stride"),
        _bshd("mO", "o", "s_q", "h_q", "o_stride"),
        TensorArg("mLSE", "p.lse", ("p.b", "p.h_q", "p.s_q"), ("p.lse_stride[0]", "p.lse_stride[1]")),
        TensorArg("mSinks", "p.sinks", ("p.h_q",), ("1",)),
        TensorArg("mTileCounter", "p.tile_counter", ("p.n_tile_counters",), ("1",)),
    ),
    scalars=params_as_scalars(_PARAMS, *SOFTMAX_SCALARS,
                              "max_ctas"),
    # tile_m: the handler's choice (SHORT_TILE_*), not the caller's.
    key=ATTENTION_KEY + (KeyField("tile_m", "int", int_literal),),
    enums={"Mask": MASKS},
    call=CALL,
    handler="ffi/fwd.cc",
    compile="fa4_jax.kernels.fwd:compile_variant",
    default_menu=default_menu,
    kernel_mask=mask_kind,
    entries=(PublicEntry("attention", "attention", (("seqlen_q == seqlen_k", 64, 64), ("seqlen_q != seqlen_k", 32, 64))),),
)
