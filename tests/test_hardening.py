"""Hostile inputs that used to be accepted and give garbage or a raw error (issue 13 §2), on the
reference path; the kernels' side is in tests/test_gpu_isolation.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from isolation_cases import SPECIAL_SINKS, check_sink_semantics
from oracle import attention_oracle



def _qkv(seed, shape_q, shape_kv, magnitude=1.0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(magnitude * rng.standard_normal(shape_q), jnp.bfloat16),
            jnp.asarray(magnitude * rng.standard_normal(shape_kv), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(shape_kv), jnp.bfloat16))


def test_sink_semantics_dense_matches_oracle_for_finite_and_minus_inf():
    q, k, v = _qkv(0, (2, 9, 8, 64), (2, 13, 2, 64))
    sinks = jnp.asarray(SPECIAL_SINKS)
    o, lse = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    check_sink_semantics(o, lse, 2, 1, SPECIAL_SINKS, "dense")
    # -inf is no sink at all; a finite sink is the oracle's.
    o_none, lse_none = fa4_jax.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(o)[:, :, 1], np.asarray(o_none)[:, :, 1])
    o_r, lse_r = attention_oracle(q, k, v, causal=True, softmax_scale=0.125, sinks=np.where(
        np.isfinite(SPECIAL_SINKS), SPECIAL_SINKS, -np.inf))
    np.testing.assert_allclose(np.asarray(o, np.float32)[:, :, 3], o_r[:, :, 3], atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse)[:, 3], lse_r[:, 3], atol=1e-4)


def test_sink_semantics_rows_without_keys_kvcache_and_varlen():
    q, k, v = _qkv(1, (2, 1, 8, 64), (2, 40, 2, 64))
    sinks = jnp.asarray(SPECIAL_SINKS)
    o, lse = fa4_jax.attention_with_kvcache(q, k, v, jnp.asarray([40, 0], jnp.int32), sinks=sinks, return_lse=True)
    check_sink_semantics(o, lse, 2, 1, SPECIAL_SINKS, "kvcache")
    cu = jnp.asarray([0, 5, 5], jnp.int32)  # the second sequence is empty
    o, lse = fa4_jax.attention_varlen(q.reshape(2, 8, 64)[:1].repeat(5, 0), k[0, :5], v[0, :5], cu, cu, sinks=sinks,
                                      return_lse=True)
    check_sink_semantics(o, lse, 1, 0, SPECIAL_SINKS, "varlen")


def test_sink_semantics_padding_rows_varlen_and_ragged_kvcache():
    """Rows past cu_seqlens_q[-1] belong to no sequence and see no key: the same semantics as any such
    row (a NaN sink makes o NaN too), which the kernels' padding paths follow (softmax.empty_row_o)."""
    q, k, v = _qkv(4, (1, 9, 8, 64), (1, 9, 2, 64))
    sinks = jnp.asarray(SPECIAL_SINKS)
    cu = jnp.asarray([0, 3, 6], jnp.int32)  # rows 6..8: padding
    o, lse = fa4_jax.attention_varlen(q[0], k[0], v[0], cu, cu, sinks=sinks, return_lse=True, implementation="xla")
    check_sink_semantics(o[6:], lse[:, 6:], 1, 0, SPECIAL_SINKS, "varlen padding rows")
    kc, vc = (jnp.asarray(np.random.default_rng(5).standard_normal((2, 32, 2, 64)), jnp.bfloat16) for _ in range(2))
    o, lse = fa4_jax.attention_with_kvcache(q[0], kc, vc, jnp.asarray([32, 16], jnp.int32), cu_seqlens_q=cu,
                                            sinks=sinks, return_lse=True, implementation="xla")
    check_sink_semantics(o[6:], lse[:, 6:], 1, 0, SPECIAL_SINKS, "ragged kvcache padding rows")


# (1.0, 256): |s| up to ~1e6 exact, m * log2(e) ~ 1e6 with an ulp of 1/8: rescaling blocks by
# (m_prev - m) * scale (the old kernel) instead of against the stored rounded maxima is off by up to 9%.
@pytest.mark.parametrize("scale,top", [(1e4, 8), (1.0, 256), (0.125, 64), (1e-3, 2), (1e-30, 4)])
def test_large_scaled_scores_are_exact(scale, top):
    """Scaled scores up to ~1e8 (in log2 units): the reference stays exact (the oracle in float64).
    Integer q, k (exact in bf16; every score an integer, exact in float32): with real-valued data a 1e4
    scale turns the ~1e-7 rounding of the scores into percent-level differences between any two
    implementations. 1e8 used to return NaN; scales above 1e4 are now rejected."""
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.integers(-top, top + 1, (1, n, 4, 64)), jnp.bfloat16) for n in (33, 47))
    v = jnp.asarray(rng.standard_normal((1, 47, 4, 64)), jnp.bfloat16)
    o, lse = fa4_jax.attention(q, k, v, softmax_scale=scale, return_lse=True)
    o_r, lse_r = attention_oracle(q, k, v, softmax_scale=scale)
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), o_r, atol=8e-3 * np.abs(o_r).max())
    np.testing.assert_allclose(np.asarray(lse), lse_r, rtol=1e-6, atol=1e-4)


def test_softmax_scale_above_the_resolvable_range_is_rejected():
    q, k, v = _qkv(3, (1, 4, 2, 64), (1, 4, 2, 64))
    for scale in (1e8, 1e38):
        with pytest.raises(ValueError, match=r"softmax_scale must be a normal float32 in about 1\.2e-38 \.\. 10000"):
            fa4_jax.attention(q, k, v, softmax_scale=scale)
        with pytest.raises(ValueError, match=r"\.\. 10000"):
            fa4_jax.attention_with_kvcache(q, k, v, jnp.asarray([4], jnp.int32), softmax_scale=scale)


@pytest.mark.parametrize("num_splits", [257, 10**6, 2**40])
def test_num_splits_above_the_kernel_maximum_is_rejected(num_splits):
    q, k, v = _qkv(4, (1, 1, 2, 64), (1, 8, 2, 64))
    with pytest.raises(ValueError, match=rf"num_splits must be in \[1, 256\] \(the kernel's maximum; or None: pick at "
                                         rf"run time\); got num_splits={num_splits}"):
        fa4_jax.attention_with_kvcache(q, k, v, jnp.asarray([8], jnp.int32), num_splits=num_splits)


def test_num_splits_at_the_maximum_is_accepted():
    q, k, v = _qkv(5, (1, 1, 2, 64), (1, 8, 2, 64))
    o = fa4_jax.attention_with_kvcache(q, k, v, jnp.asarray([8], jnp.int32), num_splits=256)
    o_r, _ = attention_oracle(q, k, v, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(o, np.float32), o_r, atol=1e-2)
