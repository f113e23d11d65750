"""The dense family's exact pure-JAX reference: `fa4_jax.attention_reference`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from fa4_jax.core.reference import auto_chunk, dense_attention, empty_result, is_zero, reference_options
from fa4_jax.core.validation import check_qkv

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
    scale, cap, (left, right) = reference_options(causal, softmax_scale, window_size, softcap, sinks, q.shape[2])
    if query_chunk is None:
        query_chunk = auto_chunk(q.shape[0], q.shape[1], q.shape[2], k.shape[1])
    elif isinstance(query_chunk, bool) or not (isinstance(query_chunk, int) and query_chunk >= 1):
        raise ValueError(f"query_chunk must be a positive int or None; got {query_chunk=}")
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    if any(is_zero(d) for d in (q.shape[0], q.shape[1], k.shape[1])):
        return empty_result(q, sinks)
    return dense_attention(q, k, v, sinks, None, left, right, scale, cap, query_chunk)
