"""Inference against a KV cache: `attention_with_kvcache` and `update_kvcache`.

Layouts (FlashAttention's `flash_attn_with_kvcache` conventions):
  contiguous cache  k_cache, v_cache (batch, capacity, heads_kv, head_dim)
  paged cache       k_cache, v_cache (num_pages, page_size, heads_kv, head_dim) with page_table int32
                    (batch, max_pages): token p of sequence b lives in page page_table[b, p // page_size]
                    at slot p % page_size
  cache_seqlens     int32 (batch,)

What is not checked (it would need a device-to-host sync): page ids in [0, num_pages) and
cache_seqlens in [0, capacity]. Violations never write out of bounds (update_kvcache drops such
writes; attention clamps cache_seqlens to the capacity and page ids to the cache), but their results
are unspecified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from fa4_jax.core import cudnn
from fa4_jax.core.implementation import Implementation, resolve_implementation, trim_window
from fa4_jax.core.validation import check_flag, check_index, check_kvcache, check_num_splits, check_options, check_tensors
from fa4_jax.ops.kvcache.primitive import check_operands, fa4_kvcache_p, kernel_variant
from fa4_jax.ops.kvcache.quant import check_fp8_caches, check_scale, is_fp8, quantize
from fa4_jax.ops.kvcache.spec import PAGE_ROWS, page_rows_for, tile_m_for

STATIC_ARGNAMES = ("max_seqlen_q", "causal", "softmax_scale", "window_size", "softcap", "num_splits", "return_lse",
                   "implementation")


def attention_with_kvcache(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, cache_seqlens: ArrayLike, *,
                           cu_seqlens_q: ArrayLike | None = None, max_seqlen_q: int | None = None,
                           page_table: ArrayLike | None = None, causal: bool = False,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, sinks: ArrayLike | None = None, num_splits: int | None = None,
                           return_lse: bool = False, k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                           implementation: Implementation | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of new queries against a KV cache (decode, speculative decode, chunked prefill).

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), bfloat16 or float16; seqlen_q >= 1.
      k_cache, v_cache: contiguous (batch, capacity, heads_kv, head_dim), or with page_table paged
        (num_pages, page_size, heads_kv, head_dim), any page_size >= 1 (multiples of 16 are read in
        16-row TMA pieces, other sizes row by row).
      cache_seqlens: int32 (batch,), valid keys per sequence, the new tokens included: the queries are
        the last seqlen_q of them (query i sits at key position cache_seqlens[b] - seqlen_q + i), which
        is what causal and window_size are relative to.
      cu_seqlens_q: None, or int32 (batch + 1,) offsets of a ragged batch (a continuous-batching step:
        prefill chunks and one-token decodes in one call). q is then packed (total_q, heads_q, head_dim):
        sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], the last of its cache_seqlens[b]
        keys (bottom-right aligned per sequence); empty sequences allowed; rows past cu_seqlens_q[-1]
        belong to no sequence (o = 0, lse = -inf or the sink logit). One kernel launch reads the cache in
        place (pack-GQA, split-KV with num_splits as below), at any page size.
      max_seqlen_q: optional static bound on a ragged batch's queries per sequence (default: total_q;
        only with cu_seqlens_q). It picks the kernel's query tile (64 rows while max_seqlen_q x q-heads
        per KV head fit in 64, else 128): when every sequence fits one tile the kernel runs one tile
        per sequence, otherwise the tiles that hold rows, listed from cu_seqlens_q. A tight bound (1
        for pure decode, the chunk size for chunked prefill) thus picks the smaller tile and skips the
        list. It must hold: the results of a sequence's queries past max_seqlen_q are unspecified.
      page_table: None, or int32 (batch, max_pages) page ids of each sequence.
      causal, softmax_scale, window_size, softcap, sinks, return_lse: as for `fa4_jax.attention`.
      num_splits: None picks the number of KV splits at run time from batch, heads, cache length and
        the GPU's SM count; an int >= 1 forces it (kernel only; the result does not depend on it
        beyond float rounding). Splits are merged by an LSE-weighted combine in the same call.
      k_scale, v_scale: with FP8 caches (float8_e4m3fn, both; every layout above), the float32 scales
        the cache was quantized with (update_kvcache): the cache holds value / scale and attention reads
        fp8 * scale. A scalar or (heads_kv,), traced values allowed; None = 1.0. Scales with 16-bit
        caches are an error. q stays bfloat16/float16 and o has its dtype. On Hopper the FP8 kernels
        serve every call at head_dim 64 and 128 (decode, prefill chunks, ragged batches), contiguous
        and paged, with every mask, softcap and sinks: they widen FP8 to fp16 (in registers for up to
        16 packed rows per sequence, in shared memory for longer ones) and compute with q * k_scale in
        fp16 (scaled per tile into fp16's range); a symbolic query count takes the chunk tile. Other
        FP8 calls (other head dims or GPUs) run the exact reference on the dequantized (float32) cache
        (implementation None or "xla"; "fa4" says when it has no kernel; cuDNN has no FP8 path).
      implementation: None, "fa4", "cudnn" or "xla" as for `fa4_jax.attention` (kernels at every
        head_dim). cuDNN (None on a GPU without our kernels, or "cudnn") serves contiguous caches without
        softcap or sinks, and a causal mask or window only when seqlen_q == 1 (no left window).

    A row with no visible key (cache_seqlens 0, a window that excludes everything) gives o = 0 and
    lse = -inf (with sinks: lse = the sink logit).

    Returns o like q, or (o, lse) with lse float32 (batch, heads_q, seqlen_q); ragged: (heads_q, total_q).
    Under jax.jit mark the non-array arguments static: attention_with_kvcache.STATIC_ARGNAMES.
    """
    options = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, page_table=page_table, causal=causal,
                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, sinks=sinks,
                   num_splits=num_splits, return_lse=return_lse)
    if check_fp8_caches(k_cache, v_cache, k_scale, v_scale):
        return _fp8(q, k_cache, v_cache, cache_seqlens, k_scale, v_scale, implementation, options)
    return _attention(q, k_cache, v_cache, cache_seqlens, **options, implementation=implementation)


attention_with_kvcache.STATIC_ARGNAMES = STATIC_ARGNAMES


def _fp8(q, k_cache, v_cache, cache_seqlens, k_scale, v_scale, implementation, options):
    """A call on FP8 caches: every check of the same call on 16-bit caches, then the primitive with
    the scales (float32 (heads_kv,)): the FP8 kernel where the library has one for the call (decode
    tiles on Hopper, spec.FP8_HEAD_DIMS), else the exact reference on the dequantized cache."""
    if implementation == "cudnn":
        raise ValueError('implementation="cudnn" cannot read float8_e4m3fn KV caches (cuDNN has no FP8 KV-cache '
                         'attention in jax); implementation=None, "fa4" or "xla"')
    ragged = options["cu_seqlens_q"] is not None
    check_tensors({"q": q}, 3 if ragged else 4, kernel_constraints=True)  # q stays bfloat16 / float16
    heads_kv = k_cache.shape[2]
    scales = tuple(jnp.broadcast_to(check_scale(name, x, heads_kv), (heads_kv,))
                   for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
    return _attention(q, k_cache, v_cache, cache_seqlens, **options, implementation=implementation, scales=scales)


def _attention(q, k_cache, v_cache, cache_seqlens, *, cu_seqlens_q, max_seqlen_q, page_table, causal, softmax_scale,
               window_size, softcap, sinks, num_splits, return_lse, implementation, scales=None):
    """attention_with_kvcache: 16-bit caches, or FP8 ones with `scales` (k_scale, v_scale), each
    float32 (heads_kv,)."""
    if cu_seqlens_q is not None:
        return _ragged(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                       page_table=page_table, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                       softcap=softcap, sinks=sinks, num_splits=num_splits, return_lse=return_lse,
                       implementation=implementation, scales=scales)
    if max_seqlen_q is not None:
        raise ValueError("max_seqlen_q is a hint for a ragged batch: pass it with cu_seqlens_q (q packed), or not at all")
    check_kvcache(q, *_checked_caches(q, k_cache, v_cache, scales), cache_seqlens, page_table, kernel_constraints=True)
    return_lse = check_flag("return_lse", return_lse)
    scale, cap, window = check_options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                       softcap=softcap, sinks=sinks, heads_q=q.shape[2], head_dim=q.shape[-1])
    num_splits = check_num_splits(num_splits)
    paged = page_table is not None
    capacity = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    left, right = trim_window(*window, q.shape[1], capacity)
    head_dim = q.shape[-1]
    params = dict(softmax_scale=scale, window_left=left, window_right=right, softcap=cap, has_sinks=sinks is not None,
                  paged=paged, ragged=False, kv_fp8=scales is not None,
                  max_seqlen_q=0, tile_m=_tile_m(q.shape[1], q.shape[2], k_cache.shape[2], scales is not None,
                                                 _page_rows(k_cache, paged)),
                  page_rows=_page_rows(k_cache, paged),
                  num_splits=num_splits or 0)
    operands = tuple(x for x in (q, k_cache, v_cache, cache_seqlens, page_table, sinks, *(scales or ()))
                     if x is not None)
    implementation = resolve_implementation(implementation, lambda arch: kernel_variant(arch, q.dtype, head_dim, params),
                                            (cudnn.KVCACHE, operands, params))
    o, lse = fa4_kvcache_p.bind(*operands, **params, implementation=implementation)
    return (o, lse) if return_lse else o


def _checked_caches(q, k_cache, v_cache, scales):
    """The caches the shape checks see: FP8 ones as stand-ins of q's dtype (their own dtype rule is
    quant.check_fp8_caches')."""
    if scales is None:
        return k_cache, v_cache
    return tuple(jax.ShapeDtypeStruct(x.shape, q.dtype) for x in (k_cache, v_cache))


def _tile_m(rows_per_sequence, heads_q, heads_kv, kv_fp8: bool = False, page_rows: int = PAGE_ROWS) -> int:
    """The kernel's query tile for sequences of up to `rows_per_sequence` queries (spec.tile_m_for; a
    symbolic count takes the wide tile: correct for any value, fastest for long ones). FP8 caches have
    three (spec.FP8_TILE_MS): the 16-row decode tile, the 64-row tile, and the two-warpgroup chunk
    tile, which one-row pages (page_rows 1) do not have: their chunks run as 64-row tiles."""
    if not (isinstance(rows_per_sequence, int) and isinstance(heads_q, int) and isinstance(heads_kv, int)):
        return tile_m_for(1 << 30, kv_fp8, page_rows)
    return tile_m_for(rows_per_sequence * max(heads_q // max(heads_kv, 1), 1), kv_fp8, page_rows)


def _page_rows(k_cache, paged: bool) -> int:
    """The kernel's page pieces (variant field page_rows): spec.page_rows_for a paged cache's page size."""
    return page_rows_for(k_cache.shape[1]) if paged else PAGE_ROWS


def _ragged(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, *, max_seqlen_q, page_table, causal, softmax_scale,
            window_size, softcap, sinks, num_splits, return_lse, implementation, scales=None):
    check_tensors({"q": q}, 3, kernel_constraints=False)
    q4 = jax.ShapeDtypeStruct((1, *q.shape), q.dtype)
    check_operands(q4, *_checked_caches(q, k_cache, v_cache, scales), cache_seqlens, page_table, cu_seqlens_q,
                   kernel_constraints=False)
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, (bool, np.bool_)) or
                                     not isinstance(max_seqlen_q, (int, np.integer)) or max_seqlen_q < 1):
        raise ValueError(f"max_seqlen_q bounds every sequence's queries: None or a static int >= 1; "
                         f"got max_seqlen_q={max_seqlen_q!r}")
    num_splits = check_num_splits(num_splits)
    return_lse = check_flag("return_lse", return_lse)
    scale, cap, window = check_options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                       softcap=softcap, sinks=sinks, heads_q=q.shape[1], head_dim=q.shape[-1])
    total_q = q.shape[0]
    max_q = total_q if max_seqlen_q is None else int(max_seqlen_q)
    if isinstance(total_q, int):
        max_q = min(max_q, max(total_q, 1))
    paged = page_table is not None
    capacity = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    left, right = trim_window(*window, max_q, capacity)
    head_dim = q.shape[-1]
    params = dict(softmax_scale=scale, window_left=left, window_right=right, softcap=cap, has_sinks=sinks is not None,
                  paged=paged, ragged=True, kv_fp8=scales is not None, max_seqlen_q=max_q if isinstance(max_q, int) else 0,
                  tile_m=_tile_m(max_q, q.shape[1], k_cache.shape[2], scales is not None, _page_rows(k_cache, paged)),
                  page_rows=_page_rows(k_cache, paged), num_splits=num_splits or 0)
    q4 = jnp.asarray(q)[None]
    operands = tuple(x for x in (q4, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, sinks, *(scales or ()))
                     if x is not None)
    implementation = resolve_implementation(implementation, lambda arch: kernel_variant(arch, q.dtype, head_dim, params),
                                            None)
    o, lse = fa4_kvcache_p.bind(*operands, **params, implementation=implementation)
    return (o[0], lse[0]) if return_lse else o[0]


def update_kvcache(k_cache: ArrayLike, v_cache: ArrayLike, k_new: ArrayLike, v_new: ArrayLike, cache_seqlens: ArrayLike,
                   *, cu_seqlens_new: ArrayLike | None = None, page_table: ArrayLike | None = None,
                   k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
    """The caches with k_new / v_new written at positions cache_seqlens[b], cache_seqlens[b] + 1, ...
    of each sequence b.

    k_new, v_new: (batch, seqlen_new, heads_kv, head_dim), every sequence getting seqlen_new tokens; or,
      with cu_seqlens_new (int32 (batch + 1,) offsets), packed (total_new, heads_kv, head_dim) where
      sequence b's tokens are rows [cu_seqlens_new[b], cu_seqlens_new[b + 1]) (empty sequences allowed;
      rows past cu_seqlens_new[-1] belong to no sequence and are not written). The continuous-batching
      step: prefill chunks and one-token decodes in one update.
    cache_seqlens are the lengths *before* the update (pass cache_seqlens + the tokens written to
    attention_with_kvcache afterwards). Contiguous caches (batch, capacity, heads_kv, head_dim), or paged
    pools (num_pages, page_size, heads_kv, head_dim) of any page size >= 1 with page_table.

    FP8 caches (float8_e4m3fn, both): k_new / v_new in any float dtype are quantized on the way in,
    value / scale rounded to nearest even and saturated at +-448 (a NaN stays NaN), with k_scale /
    v_scale float32 scalars or (heads_kv,) arrays (None = 1.0; traced values allowed): the cache
    attention_with_kvcache reads with the same scales. Scales with a 16-bit cache are an error.

    A plain XLA scatter: under jax.jit with the caches donated (donate_argnums=(0, 1)) it updates them in
    place, without a copy. Positions past the capacity (or past max_pages * page_size, or in a page id
    out of range) are dropped, never written.
    """
    ragged = cu_seqlens_new is not None
    rank = 3 if ragged else 4
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        check_tensors({name: x}, rank, kernel_constraints=False)  # each an array of its rank first
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensors({name: x}, 4, kernel_constraints=False)
    fp8 = check_fp8_caches(k_cache, v_cache, k_scale, v_scale)
    if tuple(k_new.shape) != tuple(v_new.shape) or k_new.dtype != v_new.dtype:
        raise ValueError(f"k_new and v_new must have the same shape and dtype; got k_new {tuple(k_new.shape)} "
                         f"{jnp.dtype(k_new.dtype).name}, v_new {tuple(v_new.shape)} {jnp.dtype(v_new.dtype).name}")
    if k_new.shape[-2:] != k_cache.shape[2:] or (k_new.dtype != k_cache.dtype and not fp8) or is_fp8(k_new):
        layout = "(total_new, heads_kv, head_dim)" if ragged else "(batch, seqlen_new, heads_kv, head_dim)"
        dtype = "a 16- or 32-bit float dtype (quantized into the FP8 cache)" if fp8 else "dtype"
        raise ValueError(
            f"k_new must be {layout} with the cache's heads and {dtype}; got "
            f"k_new {tuple(k_new.shape)} {jnp.dtype(k_new.dtype).name}, k_cache {tuple(k_cache.shape)} "
            f"{jnp.dtype(k_cache.dtype).name}"
        )
    if fp8:
        scales = (check_scale("k_scale", k_scale, k_cache.shape[2]), check_scale("v_scale", v_scale, k_cache.shape[2]))
    b = cache_seqlens.shape[0] if hasattr(cache_seqlens, "shape") and len(cache_seqlens.shape) == 1 else None
    if ragged:
        if b is None:
            raise ValueError(f"cache_seqlens must be int32 (batch,); got {getattr(cache_seqlens, 'shape', cache_seqlens)!r}")
        check_index("cu_seqlens_new", cu_seqlens_new, (b + 1,), "(batch + 1,): offsets of each sequence's new tokens")
    # The cache layout checks of attention, with a (batch, 1, heads_kv, d) stand-in in q's place.
    q_like = jax.ShapeDtypeStruct(k_new.shape if not ragged else (b, 1, *k_new.shape[1:]), k_cache.dtype)
    check_kvcache(q_like, k_cache, v_cache, cache_seqlens, page_table, kernel_constraints=False)
    k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)  # (NumPy inputs; no copy for jax arrays)
    if ragged:
        t = jnp.arange(k_new.shape[0], dtype=jnp.int32)
        cu = jnp.asarray(cu_seqlens_new)
        # Each row's sequence: how many sequences end at or before it (b past the last one).
        seq = jnp.sum(cu[1:][None, :] <= t[:, None], axis=1, dtype=jnp.int32)
        owned = seq < b
        seq = jnp.minimum(seq, b - 1)
        pos = jnp.where(owned, cache_seqlens[seq] + t - cu[seq], -1)  # -1: dropped below
    else:
        s_new = k_new.shape[1]
        seq = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, s_new))
        pos = cache_seqlens[:, None] + jnp.arange(s_new, dtype=jnp.int32)[None, :]  # (b, s_new)
    if fp8:
        k_new, v_new = quantize(k_new, scales[0]), quantize(v_new, scales[1])
    return _scatter(k_cache, v_cache, k_new, v_new, seq, pos, page_table)


def _scatter(k_cache, v_cache, k_new, v_new, seq, pos, page_table):
    """k_new[i] / v_new[i] written at position pos[i] of sequence seq[i] (any index shape); positions
    outside the cache are dropped."""
    rows, slots = cache_index(k_cache.shape, seq, pos, page_table)
    return (k_cache.at[rows, slots].set(k_new, mode="drop"), v_cache.at[rows, slots].set(v_new, mode="drop"))


def cache_index(cache_shape, seq, pos, page_table):
    """(rows, slots): where position pos[i] of sequence seq[i] sits in a cache of cache_shape, contiguous
    (rows = sequences) or paged (rows = pages of page_table); a position outside the cache gets row
    cache_shape[0], past the end, which a scatter with mode="drop" skips."""
    if page_table is None:
        rows, slots = seq, pos
        outside = (pos < 0) | (pos >= cache_shape[1])
    else:
        page_size, max_pages = cache_shape[1], page_table.shape[1]
        page_idx = pos // page_size
        rows = jnp.asarray(page_table)[seq, jnp.clip(page_idx, 0, max_pages - 1)]
        slots = pos % page_size
        outside = (pos < 0) | (page_idx >= max_pages) | (rows < 0) | (rows >= cache_shape[0])
    # An index past the end is dropped by the scatter (mode="drop"); negative ones would wrap, so
    # every position outside the cache is sent past the end first.
    return jnp.where(outside, cache_shape[0], rows), slots
