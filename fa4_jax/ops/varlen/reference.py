"""The varlen family's exact pure-JAX reference: `fa4_jax.attention_varlen_reference`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from fa4_jax.core.reference import HIGHEST, auto_chunk, empty_result, is_zero, map_query_chunks, masked_attention
from fa4_jax.core.reference import reference_options, window_mask
from fa4_jax.core.validation import check_varlen

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
    scale, cap, (left, right) = reference_options(causal, softmax_scale, window_size, softcap, sinks, q.shape[1])
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    total_q, h_q, d = q.shape
    total_k = k.shape[0]
    if is_zero(total_q) or is_zero(total_k) or is_zero(cu_seqlens_q.shape[0] - 1):
        o, lse = empty_result(q[None], sinks)
        return o[0], lse[0]
    if query_chunk is None:
        query_chunk = auto_chunk(1, total_q, h_q, total_k)
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
        window = window_mask((t - q_start + k_len - q_len)[:, None], rel, left, right)
        visible = visible if window is None else visible & window
        o, lse = masked_attention(q_blk, kh, vh, visible, sk, scale, softcap)

        def poison(o):
            hits = jnp.einsum("ck,hkd->hcd", visible.astype(jnp.float32), nonfinite, precision=HIGHEST)
            return jnp.where(hits[None, :, None] > 0, jnp.asarray(jnp.nan, o.dtype), o)

        return lax.cond(has_nonfinite, poison, lambda o: o, o), lse

    o, lse = map_query_chunks(block, qh, query_chunk)
    return o[0].transpose(2, 0, 1, 3).reshape(total_q, h_q, d), lse[0].reshape(h_q, total_q)
