"""Exact attention in plain JAX: the CPU path, the non-Hopper fallback and the tests' yardstick.

Same contract as the FA4 kernels: layout (batch, seqlen, heads, head_dim), GQA/MQA by head groups,
masks aligned to the bottom-right corner (query i sits at key position i + seqlen_k - seqlen_q), a
two-sided sliding window, tanh logit softcapping and per-head attention sinks; rows that see no key
give O = 0 and LSE = -inf (with sinks: LSE = the sink logit). A sink of -inf is no sink, +inf takes
the whole mass (O = 0, LSE = +inf), NaN makes the row NaN.

Isolation: a key or value outside a row's own sequence (past a KV cache's length, in another packed
sequence, past seqused_k) never changes that row, whatever it holds (NaN/Inf included): scores are
masked with a select, and such V rows are zeroed (a KV cache) or kept out of the P @ V product (packed
sequences) instead of being multiplied by P = 0, which would turn NaN into NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from fa4_jax._validation import check_kvcache, check_options, check_qkv, check_softmax_scale, check_varlen

# Score tiles above this many float32 elements (256 MiB) are computed a query block at a time;
# a 32-head 32k x 32k prefill would otherwise ask for 128 GiB.
SCORE_BUDGET = 1 << 26
# Shape-polymorphic export: a symbolic dimension's size is unknown until run time, so the chunk is
# sized as if the batch were 1 and seqlen_k this long (a tile of SCORE_BUDGET elements then holds
# e.g. 512 query rows of 8 heads). Larger symbolic batches or seqlen_k use proportionally more memory.
SYMBOLIC_SEQLEN_K_GUESS = 16384

# f32 matmuls may run as TF32 on GPUs by default; the reference must stay exact to f32.
_HIGHEST = lax.Precision.HIGHEST


def attention_reference(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False, softmax_scale: float,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: ArrayLike | None = None,
                        query_chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns (o, lse): o like q, lse float32 (batch, heads_q, seqlen_q) in natural log.

    Scores and the softmax are computed in float32 and the P @ V product accumulates in float32;
    only the output is rounded to q.dtype. float32 inputs are accepted too (useful as an oracle).
    Arguments mean what they mean for `fa4_jax.attention`.

    query_chunk: rows of queries processed per step. None picks one so each step's score tile
    stays under SCORE_BUDGET elements; the result is the same either way up to float32 summation
    order (each row is independent, but XLA may order a reduction by the array's size).
    """
    check_qkv(q, k, v, kernel_constraints=False)
    scale, cap, (left, right) = _options(causal, softmax_scale, window_size, softcap, sinks, q.shape[2])
    if query_chunk is None:
        query_chunk = _auto_chunk(q.shape[0], q.shape[1], q.shape[2], k.shape[1])
    elif isinstance(query_chunk, bool) or not (isinstance(query_chunk, int) and query_chunk >= 1):
        raise ValueError(f"query_chunk must be a positive int or None; got {query_chunk=}")
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    if any(_is_zero(d) for d in (q.shape[0], q.shape[1], k.shape[1])):
        return _empty(q, sinks)
    return _attention(q, k, v, sinks, None, left, right, scale, cap, query_chunk)


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
    scale, cap, (left, right) = _options(causal, softmax_scale, window_size, softcap, sinks, q.shape[2])
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    b, s_q, h_q, d = q.shape
    capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
    if any(_is_zero(x) for x in (b, s_q, capacity)):  # before the gather: a zero batch cannot reshape
        return _empty(q, sinks)
    if page_table is not None:
        # (num_pages, page_size, h_k, d)[page_table] -> (b, max_pages * page_size, h_k, d)
        k_cache, v_cache = (jnp.take(x, page_table, axis=0, mode="clip").reshape(b, capacity, *x.shape[2:])
                            for x in (k_cache, v_cache))
    if any(_is_zero(x) for x in (b, s_q, capacity)):
        return _empty(q, sinks)
    kv_len = jnp.clip(cache_seqlens, 0, capacity).astype(jnp.int32)
    # Slots past a sequence's length (and the pages they map to) may hold anything: their V rows must
    # not reach P @ V, where P = 0 would still turn NaN into NaN. (Scores are masked by a select.)
    used = jnp.arange(capacity, dtype=jnp.int32)[None, :, None, None] < kv_len[:, None, None, None]
    v_cache = jnp.where(used, v_cache, jnp.zeros((), v_cache.dtype))
    if query_chunk is None:
        query_chunk = _auto_chunk(b, s_q, h_q, capacity)
    return _attention(q, k_cache, v_cache, sinks, kv_len, left, right, scale, cap, query_chunk)


def attention_varlen_reference(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                               cu_seqlens_k: ArrayLike, *, seqused_k: ArrayLike | None = None, causal: bool = False,
                               softmax_scale: float,
                               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                               sinks: ArrayLike | None = None,
                               query_chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of packed variable-length sequences; returns (o (total_q, heads_q, d), lse float32
    (heads_q, total_q)). See `fa4_jax.attention_varlen` for the arguments.

    Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and keys [cu_seqlens_k[b],
    cu_seqlens_k[b] + n) with n = cu_seqlens_k[b+1] - cu_seqlens_k[b], or seqused_k[b] clamped to
    [0, n] if given; masks are bottom-right aligned per sequence. Query rows past cu_seqlens_q[-1]
    belong to no sequence and see no key.
    """
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, kernel_constraints=False)
    scale, cap, (left, right) = _options(causal, softmax_scale, window_size, softcap, sinks, q.shape[1])
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    total_q, h_q, d = q.shape
    total_k = k.shape[0]
    if _is_zero(total_q) or _is_zero(total_k) or _is_zero(cu_seqlens_q.shape[0] - 1):
        o, lse = _empty(q[None], sinks)
        return o[0], lse[0]
    if query_chunk is None:
        query_chunk = _auto_chunk(1, total_q, h_q, total_k)
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks, left, right, scale, cap,
                             query_chunk)


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10, 11))
def _attention_varlen(q, k, v, cu_q, cu_k, seqused_k, sinks, left: int, right: int, scale: float, softcap: float,
                      query_chunk: int):
    total_q, h_q, d = q.shape
    total_k, h_k, _ = k.shape
    g = h_q // h_k
    batch = cu_q.shape[0] - 1
    # One "batch" of packed rows: each row finds its sequence, and its keys by a mask.
    qh = q.reshape(total_q, h_k, g, d).transpose(1, 2, 0, 3)[None]  # (1, h_k, g, total_q, d)
    kh = k.transpose(1, 0, 2)[None]  # (1, h_k, total_k, d)
    # Every row's P @ V contracts over all packed keys, other sequences' with P = 0: a NaN/Inf value
    # there would still poison the row (0 * NaN). So P @ V runs on the finite part of V, and a
    # non-finite value reaches exactly the rows that see its key (one more product, only when V has one).
    finite = jnp.isfinite(v)
    has_nonfinite = jnp.logical_not(jnp.all(finite))
    vh = jnp.where(finite, v, jnp.zeros((), v.dtype)).transpose(1, 0, 2)[None]
    nonfinite = jnp.logical_not(finite).transpose(1, 0, 2).astype(jnp.float32)  # (h_k, total_k, d)
    sk = None if sinks is None else sinks.reshape(h_k, g)
    cols = jnp.arange(total_k, dtype=jnp.int32)
    k_end = cu_k[1:]

    def block(q_blk, row0):
        t = row0 + jnp.arange(q_blk.shape[3], dtype=jnp.int32)
        # The row's sequence: how many sequences end at or before it (batch when past the end). A
        # plain comparison, not searchsorted: that needs a static number of sequences.
        seq = jnp.sum(cu_q[1:][None, :] <= t[:, None], axis=1, dtype=jnp.int32)
        in_seq = seq < batch
        seq = jnp.minimum(seq, batch - 1)
        q_start, q_len = cu_q[seq], cu_q[seq + 1] - cu_q[seq]
        k_start = cu_k[seq]
        own = jnp.maximum(k_end[seq] - k_start, 0)
        k_len = own if seqused_k is None else jnp.clip(seqused_k[seq], 0, own)
        rel = cols[None, :] - k_start[:, None]  # key index within the row's sequence
        visible = in_seq[:, None] & (rel >= 0) & (rel < k_len[:, None])
        window = _window_mask((t - q_start + k_len - q_len)[:, None], rel, left, right)
        visible = visible if window is None else visible & window
        o, lse = _masked_attention(q_blk, kh, vh, visible, sk, scale, softcap)

        def poison(o):
            hits = jnp.einsum("ck,hkd->hcd", visible.astype(jnp.float32), nonfinite, precision=_HIGHEST)
            return jnp.where(hits[None, :, None] > 0, jnp.asarray(jnp.nan, o.dtype), o)

        return lax.cond(has_nonfinite, poison, lambda o: o, o), lse

    o, lse = _map_query_chunks(block, qh, query_chunk)
    return o[0].transpose(2, 0, 1, 3).reshape(total_q, h_q, d), lse[0].reshape(h_q, total_q)


def _options(causal, softmax_scale, window_size, softcap, sinks, heads_q):
    """check_options for the references, which take softmax_scale explicitly (no default)."""
    check_softmax_scale(softmax_scale)
    return check_options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                         sinks=sinks, heads_q=heads_q, head_dim=1)


def _is_zero(d) -> bool:
    return isinstance(d, int) and d == 0


def _empty(q, sinks):
    """No batch, no query or no key: o = 0; lse = -inf, or the sink logit (rows see only the sink)."""
    b, s_q, h_q, _ = q.shape
    o = jnp.zeros(q.shape, q.dtype)
    if sinks is None:
        return o, jnp.full((b, h_q, s_q), -jnp.inf, jnp.float32)
    o = jnp.where(jnp.isnan(sinks)[None, None, :, None], jnp.asarray(jnp.nan, q.dtype), o)  # a NaN sink: NaN rows
    return o, jnp.broadcast_to(sinks[None, :, None], (b, h_q, s_q))


# Eager callers get one compiled program instead of ~30 op-by-op dispatches (2.6 s -> 0.6 s on CPU).
@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8, 9))
def _attention(q, k, v, sinks, kv_len, left: int, right: int, scale: float, softcap: float, query_chunk: int):
    """kv_len: None (every key of k is valid) or int32 (b,): batch b has kv_len[b] valid keys, and its
    queries are the last s_q of them (bottom-right alignment per sequence, as for a KV cache)."""
    b, s_q, h_q, d = q.shape
    _, s_k, h_k, _ = k.shape
    g = h_q // h_k

    # Heads-major layout, one (rows, head_dim) matrix per (batch, kv head): plain batched matmuls
    # (a 5-D einsum on the native layout compiles ~3x slower on XLA:CPU). Query head h reads
    # key/value head h // g, so the g query heads of a group share one K/V matrix, never repeated.
    qh = q.reshape(b, s_q, h_k, g, d).transpose(0, 2, 3, 1, 4)  # (b, h_k, g, s_q, d)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (b, h_k, s_k, d)
    sk = None if sinks is None else sinks.reshape(h_k, g)

    def block(q_blk, row0):
        rows = row0 + jnp.arange(q_blk.shape[3], dtype=jnp.int32)
        cols = jnp.arange(s_k, dtype=jnp.int32)
        if kv_len is None:
            # Bottom-right aligned: query row i sits at key position i + s_k - s_q.
            visible = _window_mask(rows[:, None] + (s_k - s_q), cols[None, :], left, right)
        else:
            kl = kv_len[:, None, None, None, None]
            visible = cols < kl
            window = _window_mask(rows[:, None] + kl - s_q, cols, left, right)
            visible = visible if window is None else visible & window
        return _masked_attention(q_blk, kh, vh, visible, sk, scale, softcap)

    o, lse = _map_query_chunks(block, qh, query_chunk)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_q, d), lse.reshape(b, h_q, s_q)


def _map_query_chunks(block, qh, query_chunk: int):
    """block(q (..., c, d), row0) -> (o (..., c, d), lse (..., c)) over the rows (axis -2) of qh,
    `query_chunk` rows at a time (0: all at once)."""
    *lead, s_q, d = qh.shape
    if query_chunk == 0:
        return block(qh, 0)
    n = -(-s_q // query_chunk)
    # Padded rows are computed and dropped (a row's result depends only on its own index).
    pad = [(0, 0)] * len(lead) + [(0, n * query_chunk - s_q), (0, 0)]
    qs = jnp.moveaxis(jnp.pad(qh, pad).reshape(*lead, n, query_chunk, d), len(lead), 0)
    rows0 = jnp.arange(n, dtype=jnp.int32) * query_chunk
    o, lse = lax.map(lambda xs: block(*xs), (qs, rows0))
    o = jnp.moveaxis(o, 0, len(lead)).reshape(*lead, n * query_chunk, d)[..., :s_q, :]
    lse = jnp.moveaxis(lse, 0, len(lead)).reshape(*lead, n * query_chunk)[..., :s_q]
    return o, lse


def _window_mask(diag, cols, left: int, right: int):
    """Keys [diag - left, diag + right] (-1 = unbounded side); None when both sides are unbounded."""
    if left < 0 and right < 0:
        return None
    vis = None
    if right >= 0:
        vis = cols <= diag + right
    if left >= 0:
        lo = cols >= diag - left
        vis = lo if vis is None else vis & lo
    return vis


def _auto_chunk(b, s_q, h_q, s_k) -> int:
    """Rows per block: the largest power of two whose score tile fits the budget; 0 = all at once.

    With symbolic dimensions (shape-polymorphic export) the batch counts as 1 and seqlen_k as
    SYMBOLIC_SEQLEN_K_GUESS, and a symbolic seqlen_q is always chunked (lax.map handles a symbolic
    number of chunks).
    """
    b = b if isinstance(b, int) else 1
    h_q = h_q if isinstance(h_q, int) else 1
    s_k = s_k if isinstance(s_k, int) else SYMBOLIC_SEQLEN_K_GUESS
    rows = max(1, SCORE_BUDGET // max(1, b * h_q * s_k))
    if isinstance(s_q, int) and rows >= s_q:
        return 0
    return 1 << (rows.bit_length() - 1)


def _masked_attention(qh, kh, vh, visible, sinks, scale: float, softcap: float):
    """qh: (b, h_k, g, c, d); kh, vh: (b, h_k, s_k, d); visible: None or a bool mask broadcastable to
    (b, h_k, g, c, s_k); sinks: None or (h_k, g) float32.

    Returns o (b, h_k, g, c, d) in qh.dtype and lse (b, h_k, g, c) float32.
    """
    b, h_k, g, c, d = qh.shape
    s_k = kh.shape[2]
    u = jnp.einsum(
        "bhmd,bhkd->bhmk", qh.reshape(b, h_k, g * c, d), kh,
        preferred_element_type=jnp.float32, precision=_HIGHEST,
    ).reshape(b, h_k, g, c, s_k)
    # The scaled scores are mult * u: u the raw scores (or tanh of the scaled ones under a softcap),
    # mult the scale (or the cap), as in the kernel.
    if softcap:
        u, mult = jnp.tanh(u * (scale / softcap)), softcap
    else:
        mult = scale
    if visible is not None:
        u = jnp.where(visible, u, -jnp.inf)  # a select: a NaN score of a hidden key is dropped too

    # Exponents as (u - max u) * mult: the max's is exactly 0 whatever the magnitude. (u * mult - m
    # may be fused into one FMA whose rounding error, ~1e-7 of |m|, overflows exp at |m| > ~1e9.)
    u_max = jnp.max(u, axis=-1)
    m = u_max * mult  # the row max of the scaled scores; -inf for a row without a visible key
    big = m if sinks is None else jnp.maximum(m, sinks[None, :, :, None])
    # A row with no visible key (and no sink) has big = -inf; shifting by 0 instead keeps exp() at 0
    # and avoids inf - inf = NaN.
    big_safe = jnp.where(jnp.isneginf(big), 0.0, big)
    u_max_safe = jnp.where(jnp.isneginf(u_max), 0.0, u_max)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp((u - u_max_safe[..., None]) * mult + (m_safe - big_safe)[..., None])
    l = jnp.sum(p, axis=-1)
    if sinks is not None:
        l = l + jnp.exp(sinks[None, :, :, None] - big_safe)
    o = jnp.einsum(
        "bhmk,bhkd->bhmd", p.reshape(b, h_k, g * c, s_k), vh.astype(jnp.float32),
        preferred_element_type=jnp.float32, precision=_HIGHEST,
    ).reshape(b, h_k, g, c, d)
    has_mass = l > 0.0
    inv_l = jnp.where(has_mass, 1.0 / jnp.where(has_mass, l, 1.0), 0.0)
    lse = jnp.where(has_mass, big_safe + jnp.log(jnp.where(has_mass, l, 1.0)), -jnp.inf)
    o = o * inv_l[..., None]
    # NaN anywhere in what the row sees (a visible NaN key, a NaN sink) makes the row NaN, LSE too.
    lse = jnp.where(jnp.isnan(l), jnp.nan, lse)
    o = jnp.where(jnp.isnan(l)[..., None], jnp.nan, o)
    if sinks is not None:
        # A +inf sink takes the whole mass: O = 0, LSE = +inf.
        wins = jnp.isposinf(sinks)[None, :, :, None]
        o = jnp.where(wins[..., None], 0.0, o)
        lse = jnp.where(wins, jnp.inf, lse)
    return o.astype(qh.dtype), lse
