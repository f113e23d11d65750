"""fa4_jax.flax on the GPU (`@pytest.mark.gpu`): FA4Attention and the attention_fn drop-in running the
FA4 kernels (implementation="fa4", which raises rather than falls back), against the same modules on
the pure-JAX reference or flax's own attention.

Tolerance: both sides compute in bfloat16 with float32 softmax; they differ by the kernels' accumulation
order and the rounding of P to bf16 before P @ V, a few units of bf16 roundoff u = 2**-8 of the output
magnitude. 4 u * max|reference| as in tests/test_flax.py; a wrong mask, position or cache slot moves
the output by tens of u (tests/test_flax.py checks that on CPU).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fa4_jax.flax import FA4Attention, dot_product_attention

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_variants")]

U = 2.0**-8


def assert_close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * U * np.abs(want).max())


def layer_pair(**options):
    """The same layer (one seed: one set of parameters) on the kernels and on the reference."""
    layers = [FA4Attention(num_heads=8, in_features=256, qkv_features=1024, num_kv_heads=2, dtype=jnp.bfloat16,
                           bias_init=nnx.initializers.normal(1.0), implementation=impl, rngs=nnx.Rngs(0), **options)
              for impl in ("fa4", "xla")]
    if options.get("use_sinks"):
        sinks = 2 * jax.random.normal(jax.random.key(5), (8,), jnp.float32)
        for m in layers:
            m.sinks[...] = sinks
    return layers


@nnx.jit
def decode(m, x, lengths):
    return m(x, decode=True, lengths=lengths)


@pytest.mark.kernel_family("fwd", "kvcache")
@pytest.mark.parametrize("options", [dict(rope_theta=10000.0, use_sinks=True), dict(window_size=(100, 0), softcap=5.0)],
                         ids=["rope_sinks", "window_softcap"])
def test_fa4attention_kernels_match_reference(options):
    fa4, xla = layer_pair(**options)
    x = jax.random.normal(jax.random.key(1), (2, 300, 256), jnp.float32)
    assert_close(fa4(x), xla(x))  # prefill, head_dim 128, GQA 8/2

    # Paged decode: shuffled pages of 64 tokens, right-padded prompts, then jitted one-token steps.
    table = np.random.default_rng(2).permutation(20)[:16].astype(np.int32).reshape(2, 8)
    for m in (fa4, xla):
        m.init_cache(2, 512, page_size=64, num_pages=20, page_table=table)
    lengths = jnp.array([300, 123], jnp.int32)
    assert_close(decode(fa4, x, lengths), decode(xla, x, lengths))
    for t in range(3):
        token = jax.random.normal(jax.random.key(10 + t), (2, 1, 256), jnp.float32)
        ones = jnp.ones((2,), jnp.int32)
        assert_close(decode(fa4, token, ones), decode(xla, token, ones))
    np.testing.assert_array_equal(fa4.cache_lengths[...], [303, 126])


@pytest.mark.kernel_family("fwd")
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_fn_in_multihead_attention(is_causal):
    x = jax.random.normal(jax.random.key(3), (2, 300, 256), jnp.float32)
    layers = [nnx.MultiHeadAttention(num_heads=4, in_features=256, dtype=jnp.bfloat16, decode=False,
                                     attention_fn=fn, rngs=nnx.Rngs(0))
              for fn in (functools.partial(dot_product_attention, implementation="fa4"), nnx.dot_product_attention)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fa4_jax.flax")  # a fallback would not run the kernel
        got = layers[0](x, is_causal=is_causal)
    want = layers[1](x, is_causal=is_causal)
    assert_close(got, want)
