"""The KV-cache family: new queries against a contiguous or paged KV cache, split-KV, pack-GQA.

One call computes attention of q (batch, seqlen_q, heads_q, d) against the first cache_seqlens[b]
keys of each sequence's cache -- or, ragged (a continuous-batching step), of packed queries
(total_q, heads_q, d) where sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]); the FFI call
then sees q as (1, total_q, heads_q, d). Its kernels (fa4_jax/kernels/fwd_sm90.py, configured by FwdSeams.kvcache) tile the query heads
that share a KV head together (pack-GQA: K/V are read once per KV head), may split each sequence's
keys over several CTAs (split-KV, `num_splits`), and merge the splits in the last split CTA of each
tile to finish (counting in on the device's zero-at-rest counters, ffi/runtime.h ZeroedCounters) or,
for ragged calls and when the counters cannot serve, with a combine kernel launched right after
(COMBINE: compiled once per arch, dtype and head dim, not into every variant). The handler is
ffi/kvcache.cc.

Compile-time: softcap on/off, paged or contiguous cache (the producer's address arithmetic), query
rows per tile (64 for decode, 128 for chunks). Run time: cache_seqlens, page table, page size, ragged
offsets, window bounds (one `local` kernel serves every window, full and causal included: MASK),
softcap value, sinks, num_splits.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4_jax.families.base import ARCH_CC, DTYPES, Attr, Buffer, CallSignature, Companion, Field, KernelFamily
from fa4_jax.families.base import KeyField, PublicEntry, TensorArg, Variant, bool_literal, int_literal
from fa4_jax.families.base import params_as_scalars, parse_hd
from fa4_jax.ops.fwd.spec import ARCHES, ATTENTION_KEY, HEAD_DIMS, SINKS, SOFTMAX_ATTRS, SOFTMAX_PARAMS, SOFTMAX_SCALARS
from fa4_jax.ops.fwd.spec import AttentionVariant

# The one mask kind this family compiles. The handler turns an unbounded window side into a bound that
# covers every key (handler_util.h ResolveAttention), so the `local` kernel computes full and causal
# calls as well -- at their own kernels' speed on this family's shapes (same run on the H200,
# docs/PERF.md: decode 1 x 8k .. 8 x 32k 0.98-1.00x, causal 512-row chunks 1.00x): decode is bound
# by K/V bandwidth, and only the diagonal blocks of a chunk pay the left-edge compare. One kind
# instead of three keeps the family at 120 variants, a third of the build.
MASK = "local"


def kernel_mask(window_left: int, window_right: int) -> str:
    """The family's kernel_mask: MASK for every window."""
    del window_left, window_right
    return MASK


# Packed query rows (queries x q-heads per KV head) of one tile: 64 (one consumer warpgroup) while a
# sequence has at most 64 rows (decode, speculative decode), else 128 (two warpgroups: chunked
# prefill at the dense kernel's efficiency). ffi/kvcache.cc picks the tile from max_seqlen_q.
TILE_MS = (64, 128)
TILE_M = TILE_MS[0]
# FP8 caches' decode tile (kernels/decode_fp8_sm90.py): 16 packed rows on warp mmas with K and V as
# register operands, for sequences of at most 16 packed rows; longer ones take the 64- or 128-row tile
# (FP8_TILE_MS, tile_m_for).
FP8_DECODE_TILE_M = 16
# Keys per split granule: the Python lowering sizes the split workspace and ffi/kvcache.cc picks
# num_splits in these units.
SPLIT_BLOCK_KEYS = 128
# Upper bound on the CTAs an automatic split count aims for (about two waves on any GPU up to 160
# SMs); the lowering sizes the workspace for it, the handler then picks within it.
AUTO_SPLIT_CTAS = 320
MAX_SPLITS = 256
# The kernel gathers a paged cache in TMA pieces of PAGE_ROWS rows when the page size is a multiple
# of it, else of one row (any page size): the variant field page_rows, picked by page_rows_for.
PAGE_ROWS = 16
PAGE_ROWS_CHOICES = (PAGE_ROWS, 1)
# Page sizes the support matrix lists and the tests cover (any size >= 1 is accepted).
PAGE_SIZES = (1, 5, 16, 32, 48, 64, 100, 128, 256)


def page_rows_for(page_size) -> int:
    """Rows per TMA piece for a paged cache of `page_size` (a symbolic size takes one-row pieces)."""
    return PAGE_ROWS if isinstance(page_size, int) and page_size % PAGE_ROWS == 0 else 1


def tile_m_for(rows: int, kv_fp8: bool = False, page_rows: int = PAGE_ROWS) -> int:
    """The query tile for sequences of up to `rows` packed rows (queries x q-heads per KV head); FP8
    caches: the 16-row decode tile, the 64-row one, or the two-warpgroup chunk tile (FP8_TILE_MS),
    which one-row pages do not have (FP8_WIDE_PAGE_ROWS): they keep the 64-row tile."""
    if kv_fp8:
        if rows <= FP8_DECODE_TILE_M:
            return FP8_DECODE_TILE_M
        return TILE_MS[1] if rows > TILE_M and page_rows in FP8_WIDE_PAGE_ROWS else TILE_M
    return TILE_MS[0] if rows <= TILE_MS[0] else TILE_MS[1]


def retiled(params: dict, q_shape, k_shape) -> dict:
    """params with the query tile picked again (tile_m_for) for a call of these shapes -- q
    (batch, s_q, heads_q, d) (ragged: (1, total_q, ...), rows from max_seqlen_q), k (..., heads_kv, d) --
    where a rule changed the packed rows per KV head after the lowering picked it: vmap folding slices
    into the heads, or head sharding that leaves a shard fewer q-heads per KV head. Unchanged where the
    rows are not a static count."""
    rows = params["max_seqlen_q"] if params["ragged"] else q_shape[1]
    if not (isinstance(rows, int) and rows > 0 and isinstance(q_shape[2], int) and isinstance(k_shape[2], int)):
        return params
    page_rows = params["page_rows"] if params["paged"] else PAGE_ROWS
    packed = rows * max(q_shape[2] // max(k_shape[2], 1), 1)
    return dict(params, tile_m=tile_m_for(packed, params["kv_fp8"], page_rows))


def auto_split_capacity(batch: int, heads_kv: int, rows: int, keys: int) -> int:
    """The largest split count `num_splits=None` may pick for this shape (the workspace's extent).

    `rows` = seqlen_q * heads_q / heads_kv (packed query rows per KV head), `keys` = the cache's
    capacity in keys."""
    tiles = max(1, batch * heads_kv * -(-rows // TILE_M))
    blocks = max(1, -(-keys // SPLIT_BLOCK_KEYS))
    return max(1, min(MAX_SPLITS, blocks, -(-AUTO_SPLIT_CTAS // tiles)))


@dataclass(frozen=True, order=True)
class KVCacheVariant(AttentionVariant):
    """One KV-cache attention kernel: AttentionVariant's fields (arch x dtype x head_dim x mask kind x
    softcap; the mask kind is always MASK), then paged (the producer's address arithmetic), the query
    tile and the rows per page piece."""

    FAMILY_PREFIX = "fa4_kvcache"

    paged: bool = False
    tile_m: int = TILE_M
    page_rows: int = PAGE_ROWS
    # FP8 (float8_e4m3fn) K/V with float32 per-KV-head scales: TMA brings the FP8 blocks, widened to
    # fp16 for the tensor cores in registers (the 16-row tile) or in shared memory (docs/DESIGN.md).
    kv_fp8: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check_fields({"mask": (MASK,), "tile_m": FP8_TILE_MS if self.kv_fp8 else TILE_MS,
                           "page_rows": PAGE_ROWS_CHOICES}, ("paged", "kv_fp8"))
        if not self.paged and self.page_rows != PAGE_ROWS:
            raise ValueError(f"page_rows applies to paged caches only: {self.page_rows=} with paged=False")
        if self.kv_fp8 and self.tile_m == TILE_MS[1] and self.page_rows not in FP8_WIDE_PAGE_ROWS:
            raise ValueError(f"the FP8 tile of {self.tile_m} rows has page_rows in {FP8_WIDE_PAGE_ROWS}: "
                             f"{self.page_rows=}")

    def _symbol_parts(self):
        parts = [self.arch, self.dtype, f"hd{self.head_dim}", self.mask]
        if self.softcap:
            parts.append("softcap")
        if self.paged:
            parts.append("paged")
        if self.tile_m != TILE_M:
            parts.append(f"m{self.tile_m}")
        if self.page_rows != PAGE_ROWS:
            parts.append(f"rows{self.page_rows}")
        if self.kv_fp8:
            parts.append("kvfp8")
        return tuple(parts)

    @classmethod
    def _from_parts(cls, parts):
        tiles = [f"m{m}" for m in sorted(set(TILE_MS + FP8_TILE_MS)) if m != TILE_M]
        rows = [f"rows{r}" for r in PAGE_ROWS_CHOICES if r != PAGE_ROWS]
        if len(parts) < 4 or any(p not in ("softcap", "paged", *tiles, *rows, "kvfp8") for p in parts[4:]):
            raise ValueError(f"expected arch_dtype_hdN_mask[_softcap][_paged][_m128][_rows1][_kvfp8], "
                             f"got {'_'.join(parts)!r}")
        arch, dtype, hd, mask = parts[:4]
        tile_m = next((int(p[1:]) for p in parts[4:] if p in tiles), TILE_M)
        page_rows = next((int(p[4:]) for p in parts[4:] if p in rows), PAGE_ROWS)
        return cls(arch=arch, dtype=dtype, head_dim=parse_hd(hd), mask=mask, softcap="softcap" in parts[4:],
                   paged="paged" in parts[4:], tile_m=tile_m, page_rows=page_rows, kv_fp8="kvfp8" in parts[4:])


# Rows per paged piece each architecture's kernel has: 16-row TMA pieces, and the one-row gather for
# page sizes that are not multiples of PAGE_ROWS (SM90: the producer warpgroup; SM100: the load warp).
PAGE_ROWS_BY_ARCH = {"sm90": PAGE_ROWS_CHOICES, "sm100": PAGE_ROWS_CHOICES}
# FP8 caches (issue 17): Hopper tiles of 16 rows (decode), 64 (speculative decode, many q-heads per KV
# head) and 128 (prefill chunks: two warpgroups on K/V the producer widens), at the head dims of the
# common models, so that the default build grows by 64 variants, not 360. Other calls on FP8 caches
# run the exact reference (api.py).
FP8_ARCHES = ("sm90",)
FP8_TILE_MS = (FP8_DECODE_TILE_M, TILE_M, TILE_MS[1])
FP8_HEAD_DIMS = (64, 128)
# Page pieces of the 128-row FP8 tile: its producer warps widen K and V, so one-row pages (whose whole
# producer warpgroup gathers rows) are not among them.
FP8_WIDE_PAGE_ROWS = (PAGE_ROWS,)


def ctas_per_sm(variant: KVCacheVariant) -> int:
    """CTAs of `variant` resident per SM: its SM90 kernel configuration's (kernels/config.py, plain
    Python; read by the code generator at build time only), 1 on other arches."""
    if variant.arch != "sm90":
        return 1
    from fa4_jax.kernels.config import kvcache_config

    return kvcache_config(variant.head_dim, variant.tile_m, variant.paged, variant.kv_fp8,
                          variant.page_rows).ctas_per_sm


def tile_handout(variant: KVCacheVariant) -> bool:
    """Whether `variant` takes its tiles from the handler's counter on a persistent grid (the SM90
    config's tile_handout: the 16-bit chunk tile); read by the code generator at build time only."""
    if variant.arch != "sm90":
        return False
    from fa4_jax.kernels.config import kvcache_config

    return kvcache_config(variant.head_dim, variant.tile_m, variant.paged, variant.kv_fp8,
                          variant.page_rows).tile_handout


def default_menu() -> tuple[KVCacheVariant, ...]:
    """Every arch (the SM100 kernels opt-in, as the dense ones: families.VALIDATED_ARCHES), dtype,
    head dim, softcap, cache layout, query tile and page piece."""
    wide = tuple(
        KVCacheVariant(arch, dtype, hd, MASK, softcap, paged, tile_m, page_rows)
        for arch in ARCHES
        for dtype in DTYPES
        for hd in HEAD_DIMS
        for softcap in (False, True)
        for paged in (False, True)
        for tile_m in TILE_MS
        for page_rows in (PAGE_ROWS_BY_ARCH[arch] if paged else (PAGE_ROWS,))
    )
    fp8 = tuple(
        KVCacheVariant(arch, dtype, hd, MASK, softcap, paged, tile_m, page_rows, kv_fp8=True)
        for arch in FP8_ARCHES
        for dtype in DTYPES
        for hd in FP8_HEAD_DIMS
        for softcap in (False, True)
        for paged in (False, True)
        for tile_m in FP8_TILE_MS
        for page_rows in (PAGE_ROWS_CHOICES if paged else (PAGE_ROWS,))
        if tile_m != TILE_MS[1] or page_rows in FP8_WIDE_PAGE_ROWS
    )
    return wide + fp8


@dataclass(frozen=True, order=True)
class CombineVariant(Variant):
    """The split combine (kernels/combine.py) a KV-cache variant launches when its splits were not
    merged by their last CTA: it reads only the float32 partials and writes o / lse, so it depends on
    the architecture, o's dtype and head_dim alone -- 20 objects instead of a copy in each of the
    family's 304 (0.8 s of each one's compile, BUILD.md "Build time")."""

    FAMILY_PREFIX = "fa4_combine"

    arch: str = "sm90"
    dtype: str = "bf16"
    head_dim: int = 128

    def __post_init__(self):
        self.check_fields({"arch": ARCH_CC, "dtype": DTYPES, "head_dim": HEAD_DIMS})

    def _symbol_parts(self):
        return (self.arch, self.dtype, f"hd{self.head_dim}")

    @classmethod
    def _from_parts(cls, parts):
        if len(parts) != 3:
            raise ValueError(f"expected arch_dtype_hdN, got {'_'.join(parts)!r}")
        return cls(arch=parts[0], dtype=parts[1], head_dim=parse_hd(parts[2]))


def combine_of(variant: KVCacheVariant) -> CombineVariant:
    return CombineVariant(variant.arch, variant.dtype, variant.head_dim)


def _strided(name: str, ptr: str, shapes: tuple[str, ...], stride: str, n_strides: int) -> TensorArg:
    return TensorArg(name, f"p.{ptr}", shapes, tuple(f"p.{stride}[{i}]" for i in range(n_strides)))


_PARAMS = (
    Field("void *", "q"), Field("void *", "k"), Field("void *", "v"), Field("void *", "o"),
    Field("float *", "lse"),
    Field("int32_t *", "page_table", "(b, max_pages) page ids; null (and max_pages 1) for a contiguous cache"),
    Field("int32_t *", "cache_seqlens", "(b,) valid keys per sequence"),
    Field("int32_t *", "cu_seqlens_q", "(b + 1,) ragged: each sequence's first row in q (qb = 1); else null"),
    Field("int32_t *", "tile_list", "(2 * n_listed,) ragged: (sequence, m_block) of each tile to run, in launch "
                                   "order; null = every m_block of every sequence"),
    Field("float *", "o_accum", "(splits, qb, s_q, h_q, d) per-split normalised O (workspace)"),
    Field("float *", "lse_accum", "(splits, qb, h_q, s_q) per-split LSE (workspace)"),
    Field("float *", "sinks", "(h_q,) per-head logits joining the softmax denominator; -inf = none"),
    Field("int32_t *", "semaphores", "(n_semaphores,) zeroed split counters, one per (b, h_k, m_block) tile, "
                                     "that the kernel leaves zeroed: the last split of a tile merges its "
                                     "splits; null = a combine kernel does"),
    Field("int32_t", "n_semaphores", "0, or b * h_k * m_blocks (non-ragged calls with splits only)"),
    Field("float *", "k_scale", "(h_k,) FP8 caches: attention reads k_cache * k_scale; else null"),
    Field("float *", "v_scale", "(h_k,) FP8 caches: attention reads v_cache * v_scale; else null"),
    Field("int32_t", "b", "sequences (cache_seqlens' extent)"),
    Field("int32_t", "qb", "q's extent 0: b, or 1 for a ragged batch (s_q = total_q)"),
    Field("int32_t", "s_q"), Field("int32_t", "h_q"), Field("int32_t", "h_k"),
    Field("int32_t", "kv_rows", "contiguous: batch; paged: num_pages"),
    Field("int32_t", "kv_len", "contiguous: capacity; paged: page_size"),
    Field("int32_t", "max_pages"),
    Field("int32_t", "splits_cap", "extent 0 of the workspace"),
    Field("int64_t", "q_stride[3]", "{batch, seq, head} in elements; head_dim stride is 1"),
    Field("int64_t", "kv_stride[3]", "{batch or page, position, head} of k_cache and v_cache"),
    Field("int64_t", "lse_stride[2]"),
    Field("int64_t", "o_accum_stride[4]"), Field("int64_t", "lse_accum_stride[3]"),
    *SOFTMAX_PARAMS,
    Field("int32_t", "num_splits", "KV splits of this call, 1 <= num_splits <= splits_cap"),
    Field("int32_t", "ragged", "1: rows from cu_seqlens_q (rows past cu_seqlens_q[b] get o = 0); 0: s_q per sequence"),
    Field("int32_t", "max_seqlen_q", "bounds every sequence's queries (s_q when not ragged): the grid's m-blocks"),
    Field("int32_t", "n_listed", "tiles in tile_list (the grid's (sequence, m_block) tiles); 0 = no list"),
    Field("int32_t *", "tile_counter", "(n_tile_counters,) a zero-at-rest counter (runtime.h ZeroedCounters) from "
                                       "which a tile_handout variant's persistent grid takes its tiles; null = "
                                       "one CTA per tile"),
    Field("int32_t", "n_tile_counters", "1 with tile_counter, else 0"),
    Field("int32_t", "max_ctas", "tile_handout variants: the persistent grid (the SM count; ignored by others)"),
)

CALL = CallSignature(
    operands=(
        Buffer("q", "input", ("qb", "s_q", "h_q", "d"), "(b, s_q, h_q, d), or ragged (1, total_q, h_q, d)"),
        Buffer("k_cache", "cache", ("kv_rows", "kv_len", "h_k", "d"),
               "contiguous (b, capacity, h_k, d) or paged (num_pages, page_size, h_k, d); q's dtype or "
               "float8_e4m3fn (then with k_scale / v_scale)", param="k"),
        Buffer("v_cache", "cache", ("kv_rows", "kv_len", "h_k", "d"), "k_cache's shape and dtype", param="v"),
        Buffer("cache_seqlens", "i32", ("b",), "valid keys per sequence (clamped to [0, capacity])"),
        Buffer("page_table", "i32", ("b", "max_pages"), "page ids (clamped to the pool); absent = contiguous",
               optional=True),
        Buffer("cu_seqlens_q", "i32", ("b1",), "(b + 1,) ragged row offsets into q; absent = s_q rows each",
               optional=True),
        Buffer("tile_list", "i32", ("n_tile_entries",),
               "ragged: (sequence, m_block) pairs, the tiles to run in launch order (ragged_tile_list); "
               "absent = every m_block of every sequence", optional=True),
        SINKS,
        Buffer("k_scale", "f32", ("h_k",), "FP8 caches: per-KV-head scale of k_cache; absent = 16-bit caches",
               optional=True),
        Buffer("v_scale", "f32", ("h_k",), "FP8 caches: per-KV-head scale of v_cache", optional=True),
    ),
    results=(
        Buffer("o", "input", ("qb", "s_q", "h_q", "d")),
        Buffer("lse", "f32", ("qb", "h_q", "s_q")),
        Buffer("o_accum", "f32", ("splits", "qb", "s_q", "h_q", "d"), "per-split normalised O", workspace=True),
        Buffer("lse_accum", "f32", ("splits", "qb", "h_q", "s_q"), "per-split LSE", workspace=True),
    ),
    attrs=SOFTMAX_ATTRS + (
        Attr("num_splits", "i32", "0 = the handler picks from the SM count; else 1..splits (the workspace)"),
        Attr("max_seqlen_q", "i32", "ragged: bounds every sequence's queries, 0 = total_q; else ignored (s_q)"),
        Attr("tile_m", "i32", "packed query rows per tile, one of TILE_MS (tile_m_for): picks the variant"),
        Attr("page_rows", "i32", "paged: rows per TMA piece, one of PAGE_ROWS_CHOICES dividing page_size "
                                 "(page_rows_for); ignored for a contiguous cache"),
    ),
    constants=(("tile_m", TILE_M), ("tile_m_wide", TILE_MS[1]), ("tile_m_fp8_decode", FP8_DECODE_TILE_M), ("split_block_keys", SPLIT_BLOCK_KEYS), ("page_rows", PAGE_ROWS),
               ("max_splits", MAX_SPLITS)),
)

def _shape_fields(seqlen_q: int, page_size: int | None) -> dict:
    """The variant fields that follow a call's shape: the query tile for (at least) seqlen_q packed
    rows, and the page pieces of a paged cache."""
    fields = dict(tile_m=tile_m_for(seqlen_q))
    if page_size is not None:
        fields["page_rows"] = page_rows_for(page_size)
    return fields


_TENSORS = (
    _strided("mQ", "q", ("p.qb", "p.s_q", "p.h_q"), "q_stride", 3),
    _strided("mK", "k", ("p.kv_rows", "p.kv_len", "p.h_k"), "kv_stride", 3),
    _strided("mV", "v", ("p.kv_rows", "p.kv_len", "p.h_k"), "kv_stride", 3),
    TensorArg("mPageTable", "p.page_table", ("p.b", "p.max_pages"), ("p.max_pages",)),
    TensorArg("mSeqlensK", "p.cache_seqlens", ("p.b",), ("1",)),
    TensorArg("mCuSeqlensQ", "p.cu_seqlens_q", ("p.b + 1",), ("1",)),
    TensorArg("mTileList", "p.tile_list", ("2 * p.n_listed",), ("1",)),
    _strided("mO", "o", ("p.qb", "p.s_q", "p.h_q"), "q_stride", 3),
    TensorArg("mLSE", "p.lse", ("p.qb", "p.h_q", "p.s_q"), ("p.lse_stride[0]", "p.lse_stride[1]")),
    TensorArg("mOaccum", "p.o_accum", ("p.splits_cap", "p.qb", "p.s_q", "p.h_q"),
              tuple(f"p.o_accum_stride[{i}]" for i in range(4))),
    TensorArg("mLSEaccum", "p.lse_accum", ("p.splits_cap", "p.qb", "p.h_q", "p.s_q"),
              tuple(f"p.lse_accum_stride[{i}]" for i in range(3))),
    TensorArg("mSinks", "p.sinks", ("p.h_q",), ("1",)),
    TensorArg("mSemaphores", "p.semaphores", ("p.n_semaphores",), ("1",)),
    TensorArg("mKScale", "p.k_scale", ("p.h_k",), ("1",)),
    TensorArg("mVScale", "p.v_scale", ("p.h_k",), ("1",)),
    TensorArg("mTileCounter", "p.tile_counter", ("p.n_tile_counters",), ("1",)),
)
_COMBINE_TENSORS = ("mOaccum", "mLSEaccum", "mO", "mLSE", "mSinks")

# With splits and no tile counters (a ragged call, FA4_JAX_FUSE_COMBINE=0, or a pool that cannot
# serve: ffi/kvcache.cc), the combine merges the partials the attention kernel left in the workspace.
COMBINE = Companion(
    name="combine",
    variant=CombineVariant,
    of=combine_of,
    tensors=tuple(next(t for t in _TENSORS if t.name == n) for n in _COMBINE_TENSORS),
    scalars=params_as_scalars(_PARAMS, "num_splits"),
    when="p.num_splits > 1 && p.semaphores == nullptr",
    compile="fa4_jax.kernels.combine:compile_variant",
)

KVCACHE = KernelFamily(
    name="kvcache",
    # v2: page_table optional (has_page_table), no `paged` attribute (v1 sent a dummy table and `paged`).
    # v3: ragged batches (optional cu_seqlens_q, max_seqlen_q; q's extent 0 may differ from b).
    # v4: an optional tile list (ragged: only the (sequence, m_block) tiles with rows, longest first).
    # v5: the generated unvalidated_ok attribute (families.base.OPT_IN_ATTR).
    # v6: FP8 caches (k_cache / v_cache float8_e4m3fn) with optional k_scale / v_scale operands.
    target="fa4_jax_kvcache_v6",
    variant=KVCacheVariant,
    params=_PARAMS,
    tensors=_TENSORS,
    scalars=params_as_scalars(_PARAMS, *SOFTMAX_SCALARS,
                              "num_splits", "ragged", "max_seqlen_q", "n_listed", "max_ctas"),
    key=ATTENTION_KEY + (KeyField("paged", "bool", bool_literal), KeyField("tile_m", "int", int_literal),
                         KeyField("page_rows", "int", int_literal), KeyField("kv_fp8", "bool", bool_literal)),
    enums={"Mask": (MASK,)},
    call=CALL,
    handler="ffi/kvcache.cc",
    compile="fa4_jax.kernels.kvcache:compile_variant",
    default_menu=default_menu,
    kernel_mask=kernel_mask,
    ctas_per_sm=ctas_per_sm,
    tile_handout=tile_handout,
    companions=(COMBINE,),
    entries=tuple(PublicEntry(f"attention_with_kvcache ({layout})", "attention_with_kvcache",
                              (("seqlen_q == 1", 1, 128), ("seqlen_q > 1", 16, 128), ("a prefill chunk", 512, 2048)),
                              (("paged", paged),), _shape_fields)
                  for layout, paged in (("contiguous", False), ("paged", True))),
    # (FP8 caches are not rows of the support matrix: README's FP8 paragraph says what runs them.)
)
