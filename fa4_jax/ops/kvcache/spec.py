"""The KV-cache family: new queries against a contiguous or paged KV cache, split-KV, pack-GQA.

One call computes attention of q (batch, seqlen_q, heads_q, d) against the first cache_seqlens[b]
keys of each sequence's cache. Its kernels (fa4_jax/kernels/fwd_sm90.py, configured by FwdSeams.kvcache) tile the query heads
that share a KV head together (pack-GQA: K/V are read once per KV head), may split each sequence's
keys over several CTAs (split-KV, `num_splits`), and merge the splits with a combine kernel launched
by the same exported function. The handler is ffi/kvcache.cc.

Compile-time: mask kind, softcap on/off, paged or contiguous cache (the producer's address
arithmetic). Run time: cache_seqlens, page table, page size, window bounds, softcap value, sinks,
num_splits.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4_jax.families.base import DTYPES, Attr, Buffer, CallSignature, Field, KernelFamily, KeyField
from fa4_jax.families.base import PublicEntry, TensorArg, bool_literal, params_as_scalars, parse_hd
from fa4_jax.ops.fwd.spec import ATTENTION_KEY, MASKS, SINKS, SOFTMAX_ATTRS, FwdVariant

HEAD_DIMS = (64, 128, 256)
# Rows of one query tile (one consumer warpgroup) and keys per split granule: the Python lowering
# sizes the split workspace and ffi/kvcache.cc picks num_splits in these units.
TILE_M = 64
SPLIT_BLOCK_KEYS = 128
# Upper bound on the CTAs an automatic split count aims for (about two waves on any GPU up to 160
# SMs); the lowering sizes the workspace for it, the handler then picks within it.
AUTO_SPLIT_CTAS = 320
MAX_SPLITS = 256
# The kernel gathers a paged cache in PAGE_ROWS-row TMA pieces: a page size must be a multiple.
PAGE_ROWS = 16
# Page sizes a paged cache may have (the validation, the Flax cache and the support matrix read this):
# multiples of PAGE_ROWS; these are the sizes tested.
PAGE_SIZES = (16, 32, 64, 128, 256)


def auto_split_capacity(batch: int, heads_kv: int, rows: int, keys: int) -> int:
    """The largest split count `num_splits=None` may pick for this shape (the workspace's extent).

    `rows` = seqlen_q * heads_q / heads_kv (packed query rows per KV head), `keys` = the cache's
    capacity in keys."""
    tiles = max(1, batch * heads_kv * -(-rows // TILE_M))
    blocks = max(1, -(-keys // SPLIT_BLOCK_KEYS))
    return max(1, min(MAX_SPLITS, blocks, -(-AUTO_SPLIT_CTAS // tiles)))


@dataclass(frozen=True, order=True)
class KVCacheVariant(FwdVariant):
    """One KV-cache attention kernel: the dense variant's fields (arch x dtype x head_dim x mask kind x
    softcap), then paged (the producer's address arithmetic)."""

    FAMILY_PREFIX = "fa4_kvcache"

    paged: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check_fields({"head_dim": HEAD_DIMS}, ("paged",))

    def _symbol_parts(self):
        parts = [self.arch, self.dtype, f"hd{self.head_dim}", self.mask]
        if self.softcap:
            parts.append("softcap")
        if self.paged:
            parts.append("paged")
        return tuple(parts)

    @classmethod
    def _from_parts(cls, parts):
        if len(parts) < 4 or any(p not in ("softcap", "paged") for p in parts[4:]):
            raise ValueError(f"expected arch_dtype_hdN_mask[_softcap][_paged], got {'_'.join(parts)!r}")
        arch, dtype, hd, mask = parts[:4]
        return cls(arch=arch, dtype=dtype, head_dim=parse_hd(hd), mask=mask,
                   softcap="softcap" in parts[4:], paged="paged" in parts[4:])


def default_menu() -> tuple[KVCacheVariant, ...]:
    return tuple(
        KVCacheVariant("sm90", dtype, hd, mask, softcap, paged)
        for dtype in DTYPES
        for hd in HEAD_DIMS
        for mask in MASKS
        for softcap in (False, True)
        for paged in (False, True)
    )


def _strided(name: str, ptr: str, shapes: tuple[str, ...], stride: str, n_strides: int) -> TensorArg:
    return TensorArg(name, f"p.{ptr}", shapes, tuple(f"p.{stride}[{i}]" for i in range(n_strides)))


_PARAMS = (
    Field("void *", "q"), Field("void *", "k"), Field("void *", "v"), Field("void *", "o"),
    Field("float *", "lse"),
    Field("int32_t *", "page_table", "(b, max_pages) page ids; null (and max_pages 1) for a contiguous cache"),
    Field("int32_t *", "cache_seqlens", "(b,) valid keys per sequence"),
    Field("float *", "o_accum", "(splits, b, s_q, h_q, d) per-split normalised O (workspace)"),
    Field("float *", "lse_accum", "(splits, b, h_q, s_q) per-split LSE (workspace)"),
    Field("float *", "sinks", "(h_q,) per-head logits joining the softmax denominator; -inf = none"),
    Field("int32_t", "b"), Field("int32_t", "s_q"), Field("int32_t", "h_q"), Field("int32_t", "h_k"),
    Field("int32_t", "kv_rows", "contiguous: batch; paged: num_pages"),
    Field("int32_t", "kv_len", "contiguous: capacity; paged: page_size"),
    Field("int32_t", "max_pages"),
    Field("int32_t", "splits_cap", "extent 0 of the workspace"),
    Field("int64_t", "q_stride[3]", "{batch, seq, head} in elements; head_dim stride is 1"),
    Field("int64_t", "kv_stride[3]", "{batch or page, position, head} of k_cache and v_cache"),
    Field("int64_t", "lse_stride[2]"),
    Field("int64_t", "o_accum_stride[4]"), Field("int64_t", "lse_accum_stride[3]"),
    Field("float", "softmax_scale_log2", "log2(e) * (softcap if softcap else softmax_scale)"),
    Field("float", "softcap_prescale", "softmax_scale / softcap"),
    Field("int32_t", "window_left", "clamped like the dense family's"),
    Field("int32_t", "window_right"),
    Field("int32_t", "num_splits", "KV splits of this call, 1 <= num_splits <= splits_cap"),
)

CALL = CallSignature(
    operands=(
        Buffer("q", "input", ("b", "s_q", "h_q", "d")),
        Buffer("k_cache", "input", ("kv_rows", "kv_len", "h_k", "d"),
               "contiguous (b, capacity, h_k, d) or paged (num_pages, page_size, h_k, d)", param="k"),
        Buffer("v_cache", "input", ("kv_rows", "kv_len", "h_k", "d"), "k_cache's shape", param="v"),
        Buffer("cache_seqlens", "i32", ("b",), "valid keys per sequence (clamped to [0, capacity])"),
        Buffer("page_table", "i32", ("b", "max_pages"), "page ids (clamped to the pool); absent = contiguous",
               optional=True),
        SINKS,
    ),
    results=(
        Buffer("o", "input", ("b", "s_q", "h_q", "d")),
        Buffer("lse", "f32", ("b", "h_q", "s_q")),
        Buffer("o_accum", "f32", ("splits", "b", "s_q", "h_q", "d"), "per-split normalised O", workspace=True),
        Buffer("lse_accum", "f32", ("splits", "b", "h_q", "s_q"), "per-split LSE", workspace=True),
    ),
    attrs=SOFTMAX_ATTRS + (
        Attr("num_splits", "i32", "0 = the handler picks from the SM count; else 1..splits (the workspace)"),
    ),
    constants=(("tile_m", TILE_M), ("split_block_keys", SPLIT_BLOCK_KEYS), ("page_rows", PAGE_ROWS),
               ("max_splits", MAX_SPLITS)),
)

KVCACHE = KernelFamily(
    name="kvcache",
    # v2: page_table optional (has_page_table), no `paged` attribute (v1 sent a dummy table and `paged`).
    target="fa4_jax_kvcache_v2",
    variant=KVCacheVariant,
    params=_PARAMS,
    tensors=(
        _strided("mQ", "q", ("p.b", "p.s_q", "p.h_q"), "q_stride", 3),
        _strided("mK", "k", ("p.kv_rows", "p.kv_len", "p.h_k"), "kv_stride", 3),
        _strided("mV", "v", ("p.kv_rows", "p.kv_len", "p.h_k"), "kv_stride", 3),
        TensorArg("mPageTable", "p.page_table", ("p.b", "p.max_pages"), ("p.max_pages",)),
        TensorArg("mSeqlensK", "p.cache_seqlens", ("p.b",), ("1",)),
        _strided("mO", "o", ("p.b", "p.s_q", "p.h_q"), "q_stride", 3),
        TensorArg("mLSE", "p.lse", ("p.b", "p.h_q", "p.s_q"), ("p.lse_stride[0]", "p.lse_stride[1]")),
        TensorArg("mOaccum", "p.o_accum", ("p.splits_cap", "p.b", "p.s_q", "p.h_q"),
                  tuple(f"p.o_accum_stride[{i}]" for i in range(4))),
        TensorArg("mLSEaccum", "p.lse_accum", ("p.splits_cap", "p.b", "p.h_q", "p.s_q"),
                  tuple(f"p.lse_accum_stride[{i}]" for i in range(3))),
        TensorArg("mSinks", "p.sinks", ("p.h_q",), ("1",)),
    ),
    scalars=params_as_scalars(_PARAMS, "softmax_scale_log2", "softcap_prescale", "window_left", "window_right",
                              "num_splits"),
    key=ATTENTION_KEY + (KeyField("paged", "bool", bool_literal),),
    enums={"Mask": MASKS},
    call=CALL,
    handler="ffi/kvcache.cc",
    compile="fa4_jax.kernels.kvcache:compile_variant",
    default_menu=default_menu,
    entries=tuple(PublicEntry(f"attention_with_kvcache ({layout})", "attention_with_kvcache",
                              (("seqlen_q == 1", 1, 128), ("seqlen_q > 1", 16, 128)), (("paged", paged),))
                  for layout, paged in (("contiguous", False), ("paged", True))),
)
