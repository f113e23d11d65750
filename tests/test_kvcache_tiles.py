"""The ragged tile list the lowering builds (fa4_jax/ops/kvcache/tiles.py), against a NumPy oracle:
every (sequence, m_block) tile with rows exactly once, the pseudo-sequence's tiles for the rows past
cu_seqlens_q[b], longest sequences first, the rest of the bound pointing at no rows."""

import numpy as np
import pytest

import jax.numpy as jnp

from fa4_jax.ops.kvcache.tiles import ragged_tile_list, tile_list_bound


def oracle(cu, keys, total_q, g, tile_m, capacity):
    b = len(keys)
    tiles = []
    for s in range(b + 1):
        start = min(max(cu[s], 0), total_q)
        end = total_q if s == b else max(min(max(cu[s + 1], 0), total_q), start)
        rows = (end - start) * g
        work = -1 if s == b else min(max(keys[s], 0), capacity)
        tiles += [(work, s, m) for m in range(-(-rows // tile_m))]
    # Stable sort by work, descending: sequences in index order within one length.
    tiles.sort(key=lambda x: -x[0])
    return [(s, m) for _, s, m in tiles]


def check(cu, keys, total_q, g, tile_m, capacity=1 << 20):
    cu, keys = np.asarray(cu, np.int32), np.asarray(keys, np.int32)
    out = np.asarray(ragged_tile_list(jnp.asarray(cu), jnp.asarray(keys), total_q=total_q, qhead_per_kv=g,
                                      tile_m=tile_m, capacity=capacity))
    bound = tile_list_bound(total_q, g, tile_m, len(keys))
    assert out.dtype == np.int32 and out.shape == (2 * bound,)
    pairs = [tuple(p) for p in out.reshape(-1, 2)]
    want = oracle(cu, keys, total_q, g, tile_m, capacity)
    assert len(want) <= bound
    assert pairs[:len(want)] == want
    past = -(-total_q * g // tile_m)
    assert all(p == (0, past) for p in pairs[len(want):]), pairs[len(want):]
    return pairs


def test_mixed_step_chunks_and_decodes():
    # 3 chunks of 40 queries on different contexts, 5 decodes, 4 q-heads per KV head, tile 128.
    q_lens = [40, 40, 40, 1, 1, 1, 1, 1]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    keys = [300, 5000, 90, 7000, 10, 5000, 1, 0]
    pairs = check(cu, keys, int(cu[-1]), 4, 128)
    # The 7000-key decode first; then the 5000-key chunk's two tiles before the 5000-key decode (index order).
    assert pairs[:4] == [(3, 0), (1, 0), (1, 1), (5, 0)]


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 40))
    q_lens = rng.choice([0, 1, 1, 2, 7, 33, 64, 129, 512], size=b)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    pad = int(rng.integers(0, 50))  # rows past cu[b]: the pseudo-sequence's tiles
    keys = rng.integers(-5, 3000, size=b)
    g = int(rng.choice([1, 4, 7]))
    check(cu, keys, int(cu[-1]) + pad, g, int(rng.choice([64, 128])), capacity=2048)


def test_empty_and_all_padding():
    check([0, 0, 0], [5, 9], 0, 4, 64)  # no rows at all: only unused entries
    pairs = check([0, 0], [100], 10, 8, 64)  # all 10 rows past cu[1]: the pseudo-sequence's 2 tiles
    assert pairs[:2] == [(1, 0), (1, 1)]


def test_broken_offsets_stay_in_range():
    # Decreasing / out-of-range offsets break the contract: the list still only names real
    # sequences and in-range m_blocks (the kernel clamps the same way).
    cu = np.array([0, 90, 10, 500, -3], np.int32)
    out = np.asarray(ragged_tile_list(jnp.asarray(cu), jnp.asarray(np.array([1, 2, 3, 4], np.int32)), total_q=100,
                                      qhead_per_kv=4, tile_m=64, capacity=64)).reshape(-1, 2)
    assert out[:, 0].min() >= 0 and out[:, 0].max() <= 4
    assert out[:, 1].min() >= 0 and out[:, 1].max() <= -(-100 * 4 // 64)
