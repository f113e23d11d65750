"""The KV-cache family's exact pure-JAX reference: `fa4_jax.attention_with_kvcache_reference`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from fa4_jax.core.reference import auto_chunk, dense_attention, empty_result, is_zero, reference_options
from fa4_jax.core.validation import check_kvcache

def attention_with_kvcache_reference(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, cache_seqlens: ArrayLike, *,
                                     page_table: ArrayLike | None = None, causal: bool = False, softmax_scale: float,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     sinks: ArrayLike | None = None,
                                     query_chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of q (batch, seqlen_q, heads_q, d) against a KV cache; returns (o, lse) like
    `attention_reference`. See `fa4_jax.attention_with_kvcache` for the arguments.

    Sequence b has min(cache_seqlens[b], capacity) valid keys and its queries are the last seqlen_q
    of them (query i sits at key position cache_seqlens[b] - seqlen_q + i). A paged cache is gathered
    through page_table first; page ids out of range are clamped (the contract leaves their result
    unspecified; nothing is written either way).
    """
    check_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, kernel_constraints=False)
    scale, cap, (left, right) = reference_options(causal, softmax_scale, window_size, softcap, sinks, q.shape[2])
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    b, s_q, h_q, d = q.shape
    capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
    if any(is_zero(x) for x in (b, s_q, capacity)):  # before the gather: a zero batch cannot reshape
        return empty_result(q, sinks)
    if page_table is not None:
        # (num_pages, page_size, h_k, d)[page_table] -> (b, max_pages * page_size, h_k, d)
        k_cache, v_cache = (jnp.take(x, page_table, axis=0, mode="clip").reshape(b, capacity, *x.shape[2:])
                            for x in (k_cache, v_cache))
    if any(is_zero(x) for x in (b, s_q, capacity)):
        return empty_result(q, sinks)
    kv_len = jnp.clip(cache_seqlens, 0, capacity).astype(jnp.int32)
    # Slots past a sequence's length (and the pages they map to) may hold anything: their V rows must
    # not reach P @ V, where P = 0 would still turn NaN into NaN. (Scores are masked by a select.)
    used = jnp.arange(capacity, dtype=jnp.int32)[None, :, None, None] < kv_len[:, None, None, None]
    v_cache = jnp.where(used, v_cache, jnp.zeros((), v_cache.dtype))
    if query_chunk is None:
        query_chunk = auto_chunk(b, s_q, h_q, capacity)
    return dense_attention(q, k_cache, v_cache, sinks, kv_len, left, right, scale, cap, query_chunk)


def packed_cache(k_cache, v_cache, cache_seqlens, page_table):
    """A KV cache as packed varlen sequences: (k, v) (batch * capacity, heads_kv, d), cu_seqlens_k with
    sequence b's keys at [b * capacity, (b + 1) * capacity), and seqused_k = its lengths clamped to
    [0, capacity]. A contiguous cache is reshaped (free); a paged one is gathered (page ids clamped)."""
    b = cache_seqlens.shape[0]
    if page_table is None:
        capacity = k_cache.shape[1]
        k, v = (jnp.asarray(x).reshape(b * capacity, *x.shape[2:]) for x in (k_cache, v_cache))
    else:
        capacity = k_cache.shape[1] * page_table.shape[1]
        k, v = (jnp.take(jnp.asarray(x), page_table, axis=0, mode="clip").reshape(b * capacity, *x.shape[2:])
                for x in (k_cache, v_cache))
    cu_k = jnp.arange(b + 1, dtype=jnp.int32) * capacity
    return k, v, cu_k, jnp.clip(cache_seqlens, 0, capacity).astype(jnp.int32)
