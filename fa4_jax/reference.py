"""Exact attention in plain JAX: the CPU path, the non-Hopper fallback and the tests' yardstick.

Same contract as the FA4 kernel: layout (batch, seqlen, heads, head_dim), GQA/MQA by head groups,
bottom-right-aligned causal mask, rows that see no key give O = 0 and LSE = -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fa4_jax._validation import check_flag, check_qkv, check_softmax_scale

# Score tiles above this many float32 elements (256 MiB) are computed a query block at a time;
# a 32-head 32k x 32k prefill would otherwise ask for 128 GiB.
SCORE_BUDGET = 1 << 26

# f32 matmuls may run as TF32 on GPUs by default; the reference must stay exact to f32.
_HIGHEST = lax.Precision.HIGHEST


def attention_reference(q, k, v, *, causal: bool, softmax_scale: float, query_chunk: int | None = None):
    """Returns (o, lse): o like q, lse float32 (batch, heads_q, seqlen_q) in natural log.

    Scores and the softmax are computed in float32 and the P @ V product accumulates in float32;
    only the output is rounded to q.dtype. float32 inputs are accepted too (useful as an oracle).

    query_chunk: rows of queries processed per step. None picks one so each step's score tile
    stays under SCORE_BUDGET elements; the result is the same either way (each row is independent).
    """
    check_qkv(q, k, v, kernel_constraints=False)
    causal = check_flag("causal", causal)
    scale = check_softmax_scale(softmax_scale)

    if query_chunk is None:
        query_chunk = _auto_chunk(q.shape[1], q.shape[0] * q.shape[2] * k.shape[1])
    elif isinstance(query_chunk, bool) or not (isinstance(query_chunk, int) and query_chunk >= 1):
        raise ValueError(f"query_chunk must be a positive int or None; got {query_chunk=}")
    return _attention(q, k, v, causal, scale, query_chunk)


# Eager callers get one compiled program instead of ~30 op-by-op dispatches (2.6 s -> 0.6 s on CPU).
@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _attention(q, k, v, causal: bool, scale: float, query_chunk: int):
    b, s_q, h_q, d = q.shape
    _, s_k, h_k, _ = k.shape
    g = h_q // h_k

    # Heads-major layout, one (rows, head_dim) matrix per (batch, kv head): plain batched matmuls
    # (a 5-D einsum on the native layout compiles ~3x slower on XLA:CPU). Query head h reads
    # key/value head h // g, so the g query heads of a group share one K/V matrix, never repeated.
    qh = q.reshape(b, s_q, h_k, g, d).transpose(0, 2, 3, 1, 4)  # (b, h_k, g, s_q, d)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (b, h_k, s_k, d)
    block = lambda q_blk, row0: _attend_block(q_blk, row0, kh, vh, causal, scale, s_q)

    if query_chunk == 0 or query_chunk >= s_q:
        o, lse = block(qh, 0)
    else:
        n = -(-s_q // query_chunk)
        # Padded rows are computed and dropped; with the bottom-right mask they only see more keys.
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, 0), (0, n * query_chunk - s_q), (0, 0)))
        qs = jnp.moveaxis(qh.reshape(b, h_k, g, n, query_chunk, d), 3, 0)
        rows0 = jnp.arange(n, dtype=jnp.int32) * query_chunk
        o, lse = lax.map(lambda xs: block(*xs), (qs, rows0))
        o = jnp.moveaxis(o, 0, 3).reshape(b, h_k, g, n * query_chunk, d)[..., :s_q, :]
        lse = jnp.moveaxis(lse, 0, 3).reshape(b, h_k, g, n * query_chunk)[..., :s_q]

    return o.transpose(0, 3, 1, 2, 4).reshape(b, s_q, h_q, d), lse.reshape(b, h_q, s_q)


def _auto_chunk(s_q, scores_per_query_row) -> int:
    """Rows per block: the largest power of two whose score tile fits the budget; 0 = all at once.

    Shape-polymorphic export (symbolic dims) gets one block: its sizes are unknown until run time.
    """
    if not (isinstance(s_q, int) and isinstance(scores_per_query_row, int)):
        return 0
    rows = max(1, SCORE_BUDGET // scores_per_query_row)
    return 0 if rows >= s_q else 1 << (rows.bit_length() - 1)


def _attend_block(qh, row0, kh, vh, causal: bool, scale: float, s_q: int):
    """qh: (b, h_k, g, c, d) queries whose first row is global row `row0`; kh, vh: (b, h_k, s_k, d).

    Returns o (b, h_k, g, c, d) in q.dtype and lse (b, h_k, g, c) float32.
    """
    b, h_k, g, c, d = qh.shape
    s_k = kh.shape[2]
    s = jnp.einsum(
        "bhmd,bhkd->bhmk", qh.reshape(b, h_k, g * c, d), kh,
        preferred_element_type=jnp.float32, precision=_HIGHEST,
    ).reshape(b, h_k, g, c, s_k)
    s = s * scale
    if causal:
        rows = row0 + jnp.arange(c, dtype=jnp.int32)[:, None]
        cols = jnp.arange(s_k, dtype=jnp.int32)[None, :]
        s = jnp.where(cols <= rows + (s_k - s_q), s, -jnp.inf)

    m = jnp.max(s, axis=-1)
    # A row with no visible key has m = -inf; shifting by 0 instead keeps exp() at 0 and avoids
    # inf - inf = NaN.
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum(
        "bhmk,bhkd->bhmd", p.reshape(b, h_k, g * c, s_k), vh.astype(jnp.float32),
        preferred_element_type=jnp.float32, precision=_HIGHEST,
    ).reshape(b, h_k, g, c, d)
    has_key = l > 0.0
    inv_l = jnp.where(has_key, 1.0 / jnp.where(has_key, l, 1.0), 0.0)
    lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
    return (o * inv_l[..., None]).astype(qh.dtype), lse
