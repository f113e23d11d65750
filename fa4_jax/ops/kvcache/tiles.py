"""The tile list of a ragged KV-cache call: which (sequence, m_block) tiles the kernel runs, in
which order. Computed in the lowering (XLA ops on the call's own cu_seqlens_q and cache_seqlens,
so it is capture-safe and costs no host sync) when a ragged call can have more than one query tile
per sequence.

Why: without a list the grid is every m_block up to max_seqlen_q of every sequence. In a
continuous-batching step (a few 512-token chunks beside many one-token decodes) almost all of those
CTAs find no rows and exit; they still cost a launch and a prologue each (176 us of a 1.2 ms decode
batch on the H200). With the list the grid is the bound below and every listed tile has rows.

Order: longest first (LPT), the sequence's valid keys standing in for its tiles' work (chunk tiles
are compute-bound, decode tiles bandwidth-bound, both ~proportional to keys), so the longest tiles
do not start last and leave the tail to a few SMs. The rows past cu_seqlens_q[b] (the pseudo-sequence
b that writes o = 0 there) come after every sequence; the unused entries of the bound are last and
point at no rows (sequence 0, an m_block past any sequence's rows), so the kernel skips them.
"""

from __future__ import annotations

import jax.numpy as jnp


def tile_list_bound(total_q: int, qhead_per_kv: int, tile_m: int, batch: int) -> int:
    """Entries of the list: sum_b ceil(rows_b / tile_m) <= total rows / tile_m + (batch + 1), for
    the batch's sequences and the pseudo-sequence, whose rows never exceed total_q x qhead_per_kv."""
    return -(-total_q * qhead_per_kv // tile_m) + batch + 1


def ragged_tile_list(cu_seqlens_q, cache_seqlens, *, total_q: int, qhead_per_kv: int, tile_m: int,
                     capacity: int):
    """int32 (2 * tile_list_bound,): (sequence, m_block) pairs, longest sequence first.

    Rows are read as the kernel reads them (tile_problem.py, cache_seqlen): offsets clamped into
    [0, total_q], each sequence's end no lower than its start; sequence b = len(cache_seqlens) is the
    pseudo-sequence of the rows past cu_seqlens_q[b]."""
    b = cache_seqlens.shape[0]
    n_list = tile_list_bound(total_q, qhead_per_kv, tile_m, b)
    c = jnp.clip(cu_seqlens_q.astype(jnp.int32), 0, total_q)
    start = c[:-1]
    end = jnp.maximum(c[1:], start)
    rows = jnp.concatenate([end - start, (total_q - c[-1:])]) * qhead_per_kv  # (b + 1,)
    tiles = (rows + tile_m - 1) // tile_m
    ends = jnp.cumsum(tiles)
    t = jnp.arange(n_list, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, t, side="right", method="compare_all").astype(jnp.int32)
    valid = seq <= b
    seq = jnp.minimum(seq, b)
    m_block = t - (ends[seq] - tiles[seq])
    keys = jnp.concatenate([jnp.clip(cache_seqlens.astype(jnp.int32), 0, capacity), jnp.full((1,), -1, jnp.int32)])
    work = jnp.where(valid, keys[seq], -2)
    order = jnp.argsort(-work, stable=True)
    # Unused entries: sequence 0 at an m_block whose first row is past any sequence's rows.
    past = -(-total_q * qhead_per_kv // tile_m)
    seq = jnp.where(valid, seq, 0)[order]
    m_block = jnp.where(valid, m_block, past)[order]
    return jnp.stack([seq, m_block], axis=1).reshape(-1).astype(jnp.int32)
