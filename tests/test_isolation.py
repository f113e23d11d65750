"""Isolation on the reference path (CPU): see tests/isolation_cases.py. The kernels' twin is
tests/test_gpu_isolation.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isolation_cases import OPTIONS, POISONS, kvcache_case, varlen_case, varlen_vmap_case


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("where", ["boundary", "tile", "all"])
def test_kvcache_contiguous_unused_slots(poison, where):
    kvcache_case(implementation="xla", poison=POISONS[poison], where=where, opts={})


@pytest.mark.parametrize("case", sorted(OPTIONS))
@pytest.mark.parametrize("s_q", [1, 3])
def test_kvcache_contiguous_options(case, s_q):
    kvcache_case(implementation="xla", poison=np.nan, where="all", opts=OPTIONS[case], s_q=s_q)


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("page_size", [16, 64])
def test_kvcache_paged_unowned_pages(poison, page_size):
    kvcache_case(implementation="xla", poison=POISONS[poison], where="all", opts={}, page_size=page_size)


@pytest.mark.parametrize("case", ["causal", "softcap_sinks"])
def test_kvcache_paged_options(case):
    kvcache_case(implementation="xla", poison=np.nan, where="all", opts=OPTIONS[case], s_q=3, page_size=16)


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_varlen_neighbouring_sequence(poison, case):
    varlen_case(implementation="xla", poison=POISONS[poison], opts=dict(OPTIONS[case], causal=True)
                if case == "plain" else OPTIONS[case])


def test_varlen_keys_past_seqused_and_oversized_seqused():
    # seqused_k below the key count (the rest poisoned), and above it (clamped: the next sequence,
    # poisoned, is not read).
    varlen_case(implementation="xla", poison=np.nan, opts=dict(causal=True), seqused=(7, 1000, 20), victim=1)
    varlen_case(implementation="xla", poison=np.nan, opts={}, seqused=(50, 60, 37), victim=1)


def test_seqused_k_is_clamped_to_the_sequence():
    """seqused_k > the sequence's key count reads only its own keys: the same result as seqused_k
    equal to the count (issue 13: it used to read the next sequence's)."""
    rng = np.random.default_rng(3)
    cu = jnp.asarray([0, 20, 50], jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((50, 4, 64)), jnp.bfloat16) for _ in range(3))
    import fa4_jax

    big = fa4_jax.attention_varlen(q, k, v, cu, cu, seqused_k=jnp.asarray([25, 400], jnp.int32), return_lse=True)
    exact = fa4_jax.attention_varlen(q, k, v, cu, cu, return_lse=True)
    np.testing.assert_array_equal(np.asarray(big[0], np.float32), np.asarray(exact[0], np.float32))
    np.testing.assert_array_equal(np.asarray(big[1]), np.asarray(exact[1]))


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_varlen_vmap_slices(poison):
    varlen_vmap_case(implementation="xla", poison=POISONS[poison])


def test_flax_reset_cache_row_with_nan():
    """A row that held NaN, reset and refilled by a prefill, gives what a fresh cache gives."""
    from flax import nnx

    from fa4_jax.flax import FA4Attention

    def layer():
        attn = FA4Attention(num_heads=4, in_features=256, num_kv_heads=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        attn.init_cache(batch_size=2, max_length=64)
        return attn

    x = jax.random.normal(jax.random.key(1), (2, 9, 256))
    poisoned = layer()
    poisoned(jnp.full((2, 20, 256), jnp.nan), decode=True)  # both rows full of NaN keys and values
    poisoned.reset_cache(rows=[1])
    poisoned.reset_cache(rows=[0])
    y, fresh = poisoned(x, decode=True), layer()(x, decode=True)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(fresh, np.float32))
    step = jax.random.normal(jax.random.key(2), (2, 1, 256))
    fresh_layer = layer()
    fresh_layer(x, decode=True)
    np.testing.assert_array_equal(np.asarray(poisoned(step, decode=True), np.float32),
                                  np.asarray(fresh_layer(step, decode=True), np.float32))
