"""The `fa4_kvcache` primitive: attention of new queries against a KV cache, two results (o, lse).

Operands: q, k_cache, v_cache, cache_seqlens, then page_table when `paged`, cu_seqlens_q when
`ragged`, sinks when `has_sinks`, k_scale and v_scale (float32 (heads_kv,)) when `kv_fp8` (the
caches float8_e4m3fn, holding value / scale). q is (batch, seqlen_q, heads_q, d), or ragged (1, total_q, heads_q, d)
(the API's packed q with a unit axis, so that o, lse and the kernel's layouts are those of a batch of
one). Params: softmax_scale, window_left / window_right (causal folded in), softcap, has_sinks, paged,
ragged, kv_fp8, max_seqlen_q (ragged: the bound on every sequence's queries; else 0), tile_m (the kernel's
query tile, spec.tile_m_for), page_rows (paged: rows per TMA piece, spec.page_rows_for), num_splits (0 = the handler picks from the SM count), implementation.
Lowering (fa4_jax/core/lowering.py, per platform): on CUDA, when the kernel can serve the call, the
family's FFI call (ffi/kvcache.cc) whose workspace results (the split-KV partials) are sized here
(fa4_jax.ops.kvcache.spec); otherwise the pure-JAX reference. Sharding: fa4_jax/ops/kvcache/sharding.py.
vmap: one kernel launch (see _batch_rule). Inference only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fa4_jax.core import compat, cudnn
from fa4_jax.core.ffi_call import kernel_call
from fa4_jax.core.primitive import OperandLayout, fold_query_slices, moved, primitive_pair, register
from fa4_jax.core.validation import check_index, check_kvcache, check_sinks, dtype_tag
from fa4_jax.families import KVCacheVariant
from fa4_jax.ops.kvcache import sharding
from fa4_jax.ops.kvcache.quant import dequantize, is_fp8
from fa4_jax.ops.kvcache.reference import attention_with_kvcache_reference, packed_cache
from fa4_jax.ops.varlen.reference import attention_varlen_reference
from fa4_jax.ops.kvcache.spec import KVCACHE, MAX_SPLITS, PAGE_ROWS, SPLIT_BLOCK_KEYS, auto_split_capacity, retiled
from fa4_jax.ops.kvcache.tiles import ragged_tile_list

OPERANDS = OperandLayout(KVCACHE, {"page_table": "paged", "cu_seqlens_q": "ragged", "sinks": "has_sinks",
                                   "k_scale": "kv_fp8", "v_scale": "kv_fp8"},
                         lowered=("tile_list",))


def _split(operands, paged: bool, ragged: bool, has_sinks: bool, kv_fp8: bool):
    x = OPERANDS.split(operands, dict(paged=paged, ragged=ragged, has_sinks=has_sinks, kv_fp8=kv_fp8))
    return (x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["page_table"], x["cu_seqlens_q"],
            x["sinks"], x["k_scale"], x["v_scale"])


def _join(q, k, v, seqlens, page_table, cu_seqlens_q, sinks, k_scale=None, v_scale=None):
    return OPERANDS.join(dict(q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens, page_table=page_table,
                              cu_seqlens_q=cu_seqlens_q, sinks=sinks, k_scale=k_scale, v_scale=v_scale))


def check_operands(q, k, v, seqlens, page_table, cu_seqlens_q, *, kernel_constraints: bool) -> None:
    """The shape checks of both layouts; ragged: q (1, total_q, heads_q, d) and cu_seqlens_q (b + 1,)."""
    if cu_seqlens_q is None:
        check_kvcache(q, k, v, seqlens, page_table, kernel_constraints=kernel_constraints)
        return
    if len(q.shape) != 4 or q.shape[0] != 1:
        raise ValueError(f"a ragged call's q must be (1, total_q, heads_q, head_dim); got {tuple(q.shape)}")
    if not (hasattr(seqlens, "shape") and len(seqlens.shape) == 1):
        raise ValueError(f"cache_seqlens must be int32 (batch,); got {getattr(seqlens, 'shape', seqlens)!r}")
    b = seqlens.shape[0]
    check_index("cu_seqlens_q", cu_seqlens_q, (b + 1,), "(batch + 1,): offsets of each sequence's queries in q")
    # The cache layout checks of the padded form, with a (batch, 1, heads_q, d) stand-in for q.
    check_kvcache(jax.ShapeDtypeStruct((b, 1, *q.shape[2:]), q.dtype), k, v, seqlens, page_table,
                  kernel_constraints=kernel_constraints)


def _abstract_eval(*operands, **params):
    """The operands the params say, with the shapes the API checks (a direct bind gets the same errors)."""
    x = OPERANDS.split(operands, params)
    q, k, v = x["q"], x["k_cache"], x["v_cache"]
    if params["kv_fp8"]:  # FP8 caches: the 16-bit call's checks on stand-ins, then the scales'
        if not (is_fp8(k) and is_fp8(v)):
            raise ValueError(f"kv_fp8=True needs float8_e4m3fn caches; got {k.dtype} and {v.dtype}")
        for name in ("k_scale", "v_scale"):
            if x[name].shape != (k.shape[2],) or x[name].dtype != jnp.float32:
                raise ValueError(f"{name} must be float32 (heads_kv,) = ({k.shape[2]},); got {x[name].dtype}"
                                 f"{tuple(x[name].shape)}")
        k = v = jax.ShapeDtypeStruct(k.shape, q.dtype)
    check_operands(q, k, v, x["cache_seqlens"], x["page_table"], x["cu_seqlens_q"], kernel_constraints=False)
    check_sinks(x["sinks"], q.shape[2])
    b, s_q, h_q, _ = q.shape
    return (compat.ShapedArray(q.shape, q.dtype), compat.ShapedArray((b, h_q, s_q), jnp.float32))


fa4_kvcache_p, fa4_kvcache_local_p = primitive_pair("fa4_kvcache", _abstract_eval)


def _reference(*operands, softmax_scale, window_left, window_right, softcap, has_sinks, paged, ragged, kv_fp8,
               max_seqlen_q, tile_m, page_rows, num_splits, implementation):
    del max_seqlen_q, tile_m, page_rows, num_splits, implementation
    q, k, v, seqlens, page_table, cu_q, sinks, k_scale, v_scale = _split(operands, paged, ragged, has_sinks, kv_fp8)
    options = dict(softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap, sinks=sinks)
    if not kv_fp8:
        return _exact(q, k, v, seqlens, page_table, cu_q, options)
    # Exactly, on the cache dequantized to float32: a paged cache's pages gathered first (only the
    # sequences' pages are widened, not the pool), q widened too; o in q's dtype.
    if paged:
        b, capacity = seqlens.shape[0], k.shape[1] * page_table.shape[1]
        k, v = (jnp.take(x, page_table, axis=0, mode="clip").reshape(b, capacity, *x.shape[2:]) for x in (k, v))
    o, lse = _exact(q.astype(jnp.float32), dequantize(k, k_scale), dequantize(v, v_scale), seqlens, None, cu_q,
                    options)
    return o.astype(q.dtype), lse


def _exact(q, k, v, seqlens, page_table, cu_q, options):
    """The family's exact reference on these caches: per batch entry, or (cu_q given) the varlen
    reference over the cache seen as packed sequences (one per batch entry)."""
    if cu_q is None:
        return attention_with_kvcache_reference(q, k, v, seqlens, page_table=page_table, **options)
    pk, pv, cu_k, used = packed_cache(k, v, seqlens, page_table)
    o, lse = attention_varlen_reference(q[0], pk, pv, cu_q, cu_k, seqused_k=used, **options)
    return o[None], lse[None]


def split_capacity(q_shape, k_shape, page_table_shape, num_splits: int) -> int:
    """The split workspace's extent: the forced count, or what num_splits=None may pick.

    Always a static int, also for symbolic (shape-polymorphic) dimensions: the extent is then an upper
    bound valid for every value they take at run time. auto_split_capacity grows with the keys and
    shrinks with batch x heads x query rows, so a symbolic factor of the latter counts as its least
    value 1, and symbolic keys as unbounded (MAX_SPLITS bounds the extent). The handler picks the
    split count within the extent it gets."""
    if num_splits:
        return num_splits
    static = lambda d: isinstance(d, int)  # noqa: E731
    b, s_q, h_q, _ = q_shape
    h_k = k_shape[2]
    group = h_q // h_k if static(h_q) and static(h_k) else 1
    # (A ragged q is (1, total_q, ...): the total's rows in one sequence, the fewest tiles they can
    # make, so the largest split count the handler may want.)
    rows = (s_q if static(s_q) else 1) * group
    key_dims = (k_shape[1], *(() if page_table_shape is None else (page_table_shape[1],)))
    keys = math.prod(key_dims) if all(map(static, key_dims)) else MAX_SPLITS * SPLIT_BLOCK_KEYS
    return auto_split_capacity(b if static(b) else 1, h_k if static(h_k) else 1, rows, keys)


def kernel_variant(arch: str, dtype, head_dim: int, params: dict) -> KVCacheVariant:
    """The kernel a call with these params needs on `arch` (the API and the lowering ask the same)."""
    mask = KVCACHE.kernel_mask(params["window_left"], params["window_right"])
    return KVCacheVariant(arch, dtype_tag(dtype), head_dim, mask, params["softcap"] > 0, params["paged"], params["tile_m"],
                          params["page_rows"] if params["paged"] else PAGE_ROWS, kv_fp8=params.get("kv_fp8", False))


def _kernel_call(*operands, softmax_scale, window_left, window_right, softcap, has_sinks, paged, ragged, kv_fp8,
                 max_seqlen_q, tile_m, page_rows, num_splits, implementation):
    named = OPERANDS.split(operands, dict(paged=paged, ragged=ragged, has_sinks=has_sinks, kv_fp8=kv_fp8))
    table = named["page_table"]
    splits = split_capacity(named["q"].shape, named["k_cache"].shape, None if table is None else table.shape,
                            num_splits)
    q, k = named["q"], named["k_cache"]
    qhead_per_kv = q.shape[2] // k.shape[2]
    if ragged and max_seqlen_q * qhead_per_kv > tile_m:
        # More than one query tile per sequence is possible: run only the tiles with rows, longest
        # first (tiles.py); a decode-only ragged call (one tile each) needs no list.
        named["tile_list"] = ragged_tile_list(
            named["cu_seqlens_q"], named["cache_seqlens"], total_q=q.shape[1], qhead_per_kv=qhead_per_kv,
            tile_m=tile_m, capacity=k.shape[1] * (1 if table is None else table.shape[1]))
    return kernel_call(KVCACHE, named, dict(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left,
                                            window_right=window_right, num_splits=num_splits,
                                            max_seqlen_q=max_seqlen_q, tile_m=tile_m, page_rows=page_rows),
                       dims=dict(splits=splits), opt_in=implementation == "fa4")


def _is_empty(avals, params) -> bool:
    """No batch, query, head, cache slot or page: the reference answers without a launch."""
    x = OPERANDS.split(avals, params)
    dims = (*x["q"].shape, *x["k_cache"].shape, *x["cache_seqlens"].shape,
            *(x["page_table"].shape if params["paged"] else ()))
    return any(isinstance(d, int) and d == 0 for d in dims)


def _batch_rule(args, dims, *, paged, has_sinks, kv_fp8, **params):
    """One kernel launch for any vmap:

    - Only q (and sinks) mapped, the cache shared: the mapped axis joins the query heads of each KV
      group (pack-GQA then reads every cache block once for all slices); the cache is not copied.
    - Sinks unmapped: the mapped axis folds into the batch. A mapped contiguous cache is reshaped, an
      unmapped one broadcast; a mapped page pool becomes one pool of size * num_pages pages with each
      slice's page ids offset, an unmapped one is shared as is.
    - Sinks mapped and the cache per slice: a sequential map over the slices (a rare combination:
      per-slice sinks belong to different models). So are mapped FP8 scales.
    """
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    ragged = params["ragged"]
    q, k, v, seqlens, page_table, cu_q, sinks, ks, vs = _split(args, paged, ragged, has_sinks, kv_fp8)
    dq, dk, dv, dl, dp, dc, ds, dks, dvs = _split(dims, paged, ragged, has_sinks, kv_fp8)
    kw = dict(paged=paged, has_sinks=has_sinks, kv_fp8=kv_fp8, **params)
    scales_mapped = dks is not None or dvs is not None
    if dk is None and dv is None and dl is None and dp is None and dc is None and not scales_mapped:
        qf, sf, unfold = fold_query_slices(q, dq, sinks, ds, size, k.shape[2])
        # The folded slices multiply each sequence's packed rows: a tile for fewer rows would read the
        # whole cache once per tile.
        kw = retiled(kw, qf.shape, k.shape)
        return unfold(*fa4_kvcache_p.bind(*_join(qf, k, v, seqlens, page_table, cu_q, sf, ks, vs), **kw)), (0, 0)
    if ds is not None or ragged or scales_mapped:
        # (A ragged batch whose cache or offsets differ per slice: a sequential map over the slices.)
        slices = [moved(x, d, size) if x is not None else None
                  for x, d in zip((q, k, v, seqlens, page_table, cu_q, sinks, ks, vs),
                                  (dq, dk, dv, dl, dp, dc, ds, dks, dvs))]
        o, lse = jax.lax.map(lambda xs: tuple(fa4_kvcache_p.bind(*_join(*xs), **kw)), tuple(slices))
        return (o, lse), (0, 0)

    def fold(x, d):  # (size, b, ...) -> (size * b, ...)
        x = moved(x, d, size)
        return x.reshape(size * x.shape[1], *x.shape[2:])

    qf, lf = fold(q, dq), fold(seqlens, dl)
    if not paged:
        kf, vf, pf = fold(k, dk), fold(v, dv), None
    else:
        pf = moved(page_table, dp, size)
        if dk is None and dv is None:
            kf, vf = k, v
        else:
            k, v = moved(k, dk, size), moved(v, dv, size)
            num_pages = k.shape[1]
            kf, vf = (x.reshape(size * num_pages, *x.shape[2:]) for x in (k, v))
            pf = pf + (jnp.arange(size, dtype=jnp.int32) * num_pages)[:, None, None]
        pf = pf.reshape(size * pf.shape[1], pf.shape[2])
    o, lse = fa4_kvcache_p.bind(*_join(qf, kf, vf, lf, pf, None, sinks, ks, vs), **kw)
    return (o.reshape(size, -1, *o.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (0, 0)


register(fa4_kvcache_p, fa4_kvcache_local_p, reference=_reference, kernel=_kernel_call, variant=kernel_variant,
         is_empty=_is_empty, sharding_rules=sharding.RULES, batch_rule=_batch_rule, cudnn_entry=cudnn.KVCACHE)
