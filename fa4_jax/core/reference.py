"""The exact pure-JAX attention every family's reference is built on (fa4_jax/ops/<family>/reference.py).

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

from fa4_jax.core.validation import check_options, check_softmax_scale

# Score tiles above this many float32 elements (256 MiB) are computed a query block at a time;
# a 32-head 32k x 32k prefill would otherwise ask for 128 GiB.
SCORE_BUDGET = 1 << 26


# Shape-polymorphic export: a symbolic dimension's size is unknown until run time, so the chunk is
# sized as if the batch were 1 and seqlen_k this long (a tile of SCORE_BUDGET elements then holds
# e.g. 512 query rows of 8 heads). Larger symbolic batches or seqlen_k use proportionally more memory.
SYMBOLIC_SEQLEN_K_GUESS = 16384


# f32 matmuls may run as TF32 on GPUs by default; the reference must stay exact to f32.
HIGHEST = lax.Precision.HIGHEST


def reference_options(causal, softmax_scale, window_size, softcap, sinks, heads_q):
    """check_options for the references, which take softmax_scale explicitly (no default)."""
    check_softmax_scale(softmax_scale)
    return check_options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                         sinks=sinks, heads_q=heads_q, head_dim=1)


def is_zero(d) -> bool:
    return isinstance(d, int) and d == 0


def empty_result(q, sinks):
    """No batch, no query or no key: o = 0; lse = -inf, or the sink logit (rows see only the sink)."""
    b, s_q, h_q, _ = q.shape
    o = jnp.zeros(q.shape, q.dtype)
    if sinks is None:
        return o, jnp.full((b, h_q, s_q), -jnp.inf, jnp.float32)
    o = jnp.where(jnp.isnan(sinks)[None, None, :, None], jnp.asarray(jnp.nan, q.dtype), o)  # a NaN sink: NaN rows
    return o, jnp.broadcast_to(sinks[None, :, None], (b, h_q, s_q))


# Eager callers get one compiled program instead of ~30 op-by-op dispatches (2.6 s -> 0.6 s on CPU).
@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8, 9))
def dense_attention(q, k, v, sinks, kv_len, left: int, right: int, scale: float, softcap: float, query_chunk: int):
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
            visible = window_mask(rows[:, None] + (s_k - s_q), cols[None, :], left, right)
        else:
            kl = kv_len[:, None, None, None, None]
            visible = cols < kl
            window = window_mask(rows[:, None] + kl - s_q, cols, left, right)
            visible = visible if window is None else visible & window
        return masked_attention(q_blk, kh, vh, visible, sk, scale, softcap)

    o, lse = map_query_chunks(block, qh, query_chunk)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_q, d), lse.reshape(b, h_q, s_q)


def map_query_chunks(block, qh, query_chunk: int):
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


def window_mask(diag, cols, left: int, right: int):
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


def auto_chunk(b, s_q, h_q, s_k) -> int:
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


def masked_attention(qh, kh, vh, visible, sinks, scale: float, softcap: float):
    """qh: (b, h_k, g, c, d); kh, vh: (b, h_k, s_k, d); visible: None or a bool mask broadcastable to
    (b, h_k, g, c, s_k); sinks: None or (h_k, g) float32.

    Returns o (b, h_k, g, c, d) in qh.dtype and lse (b, h_k, g, c) float32.
    """
    b, h_k, g, c, d = qh.shape
    s_k = kh.shape[2]
    u = jnp.einsum(
        "bhmd,bhkd->bhmk", qh.reshape(b, h_k, g * c, d), kh,
        preferred_element_type=jnp.float32, precision=HIGHEST,
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
        preferred_element_type=jnp.float32, precision=HIGHEST,
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
