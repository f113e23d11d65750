"""The KV-cache entry points on the GPU (`@pytest.mark.gpu`): in-place cache updates in bf16 (XLA:CPU
converts bf16 scatters through float32, so only a GPU shows the real program) and the reference
path of attention_with_kvcache on the device."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from oracle import attention_oracle

pytestmark = pytest.mark.gpu


def test_update_kvcache_donated_bf16_is_in_place():
    shape = (4, 4096, 8, 128)
    k_cache = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)
    k_new = jax.random.normal(jax.random.key(2), (4, 2, 8, 128), jnp.float32).astype(jnp.bfloat16)
    lens = jnp.array([0, 17, 4094, 4095], jnp.int32)  # the last one runs one token past the capacity
    want_k = np.asarray(k_cache, np.float32).copy()
    for b, n in enumerate(np.asarray(lens)):
        for t in range(2):
            if n + t < shape[1]:
                want_k[b, n + t] = np.asarray(k_new[b, t], np.float32)

    f = jax.jit(fa4_jax.update_kvcache, donate_argnums=(0, 1))
    compiled = f.lower(k_cache, v_cache, k_new, k_new, lens).compile()
    cache_bytes = np.prod(shape) * 2
    assert compiled.memory_analysis().alias_size_in_bytes == 2 * cache_bytes
    copies = re.findall(r"bf16\[4,4096,8,128\]\{[0-9,]*\} copy\(", compiled.as_text())
    assert not copies, f"the donated cache is copied: {copies}"
    k2, _ = f(k_cache, v_cache, k_new, k_new, lens)
    np.testing.assert_array_equal(np.asarray(k2, np.float32), want_k)


def test_attention_with_kvcache_paged_on_gpu():
    rng = np.random.default_rng(3)
    b, s_q, h_q, h_k, d, page, n_pages = 2, 3, 8, 2, 128, 64, 12
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, d), np.float32), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((n_pages, page, h_k, d), np.float32), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((n_pages, page, h_k, d), np.float32), jnp.bfloat16)
    table = np.array([[5, 0, 7, 2], [9, 5, 11, 1]], np.int32)  # page 5 shared
    lens = np.array([130, 201], np.int32)
    o, lse = jax.jit(lambda *a: fa4_jax.attention_with_kvcache(*a[:4], page_table=a[4], causal=True, return_lse=True))(
        q, kp, vp, jnp.asarray(lens), jnp.asarray(table))
    for i in range(b):
        k = np.asarray(kp, np.float32)[table[i]].reshape(-1, h_k, d)[: lens[i]][None]
        v = np.asarray(vp, np.float32)[table[i]].reshape(-1, h_k, d)[: lens[i]][None]
        ro, rl = attention_oracle(q[i:i + 1], k, v, causal=True, softmax_scale=d ** -0.5, xp=jnp)
        np.testing.assert_allclose(np.asarray(o[i:i + 1], np.float32), np.asarray(ro), atol=2e-2, rtol=0)
        np.testing.assert_allclose(np.asarray(lse[i:i + 1]), np.asarray(rl), atol=1e-3, rtol=0)
