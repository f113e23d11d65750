"""fa4_jax.attention_reference against a float64 NumPy oracle.

The reference computes scores, softmax and P @ V in float32 and rounds only the output, so its
error against the exact result is one rounding of the output (unit roundoff u of the dtype, times
|o|) plus float32 noise. The tolerances below are exactly that: a masking, GQA-mapping or
normalisation bug moves outputs by O(0.1), far outside them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax.reference as reference
from fa4_jax import attention_reference

# Unit roundoff (half the gap between 1 and the next number): 7 and 10 stored mantissa bits.
UNIT_ROUNDOFF = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11, jnp.float32: 2.0**-24}
F32_ATOL = 2e-5  # float32 accumulation over <= 256-term dot products and <= 300-key softmax sums
LSE_ATOL = 1e-4


def oracle(q, k, v, *, causal, softmax_scale):
    """Textbook attention in float64; materialises repeated K/V heads (independent GQA mapping)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s_q, h_q, s_k, h_k = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    k = np.repeat(k, h_q // h_k, axis=2)
    v = np.repeat(v, h_q // h_k, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if causal:
        visible = np.arange(s_k)[None, :] <= np.arange(s_q)[:, None] + (s_k - s_q)
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, np.log(l[..., 0]) + m[..., 0], -np.inf)
    return o, lse


def make_qkv(seed, *, b=2, s_q=33, s_k=33, h_q=4, h_k=2, d=64, dtype=jnp.bfloat16, scale=1.0):
    rng = np.random.default_rng(seed)
    # NumPy arrays of the target dtype (ml_dtypes for bf16): no per-shape XLA conversion to compile.
    draw = lambda s, h: (scale * rng.standard_normal((b, s, h, d), dtype=np.float32)).astype(dtype)
    return draw(s_q, h_q), draw(s_k, h_k), draw(s_k, h_k)


def check_against_oracle(q, k, v, *, causal, softmax_scale, **kwargs):
    o, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, **kwargs)
    o_want, lse_want = oracle(q, k, v, causal=causal, softmax_scale=softmax_scale)

    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(o).any() and not np.isnan(lse).any()

    u = UNIT_ROUNDOFF[q.dtype.type]
    np.testing.assert_allclose(o, o_want, rtol=1.01 * u, atol=F32_ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
    finite = np.isfinite(lse_want)
    np.testing.assert_allclose(lse[finite], lse_want[finite], rtol=0, atol=LSE_ATOL)
    return o, lse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_oracle(dtype, head_dim, causal):
    seed = 100 + 10 * head_dim + 2 * causal + (dtype == jnp.float16)
    q, k, v = make_qkv(seed, s_q=129, s_k=129, d=head_dim, dtype=dtype)
    check_against_oracle(q, k, v, causal=causal, softmax_scale=head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [96, 192, 256])
def test_other_head_dims(head_dim):
    q, k, v = make_qkv(head_dim, b=1, s_q=20, s_k=37, d=head_dim)
    check_against_oracle(q, k, v, causal=True, softmax_scale=head_dim**-0.5)


@pytest.mark.parametrize("h_q,h_k", [(4, 4), (4, 2), (8, 1), (6, 3)])
def test_gqa_head_mapping(h_q, h_k):
    q, k, v = make_qkv(7 * h_q + h_k, s_q=17, s_k=23, h_q=h_q, h_k=h_k)
    check_against_oracle(q, k, v, causal=False, softmax_scale=0.125)


@pytest.mark.parametrize(
    "s_q,s_k",
    [(1, 1), (1, 129), (7, 129), (129, 7), (129, 1), (33, 65)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(s_q, s_k, causal):
    q, k, v = make_qkv(1000 + 7 * s_q + s_k + causal, s_q=s_q, s_k=s_k)
    check_against_oracle(q, k, v, causal=causal, softmax_scale=0.125)


def test_causal_rows_without_keys_are_zero():
    s_q, s_k = 40, 9
    q, k, v = make_qkv(5, s_q=s_q, s_k=s_k)
    o, lse = check_against_oracle(q, k, v, causal=True, softmax_scale=0.125)
    empty = s_q - s_k  # bottom-right alignment: rows 0 .. s_q - s_k - 1 see nothing
    assert np.all(o[:, :empty] == 0.0)
    assert np.all(np.isneginf(lse[:, :, :empty]))
    assert np.all(np.isfinite(lse[:, :, empty:])) and np.all(np.abs(o[:, empty:]).sum(-1) > 0)


def test_causal_decode_sees_every_key():
    # With one query row and bottom-right alignment the causal mask hides nothing.
    q, k, v = make_qkv(11, s_q=1, s_k=77)
    full = attention_reference(q, k, v, causal=False, softmax_scale=0.125)
    masked = attention_reference(q, k, v, causal=True, softmax_scale=0.125)
    np.testing.assert_array_equal(np.asarray(full[0], np.float32), np.asarray(masked[0], np.float32))
    np.testing.assert_array_equal(full[1], masked[1])


def test_large_scores_are_stable():
    # Scores of magnitude ~ hundreds: a softmax without max-subtraction overflows float32 exp.
    q, k, v = make_qkv(12, s_q=31, s_k=45, scale=3.0)
    check_against_oracle(q, k, v, causal=True, softmax_scale=1.0)


@pytest.mark.parametrize(
    "chunk,s_q,s_k",
    [(1, 40, 129), (16, 129, 129), (16, 129, 40), (50, 129, 40), (50, 40, 129)],
)
def test_query_chunks(chunk, s_q, s_k):
    q, k, v = make_qkv(3000 + chunk + s_q + 2 * s_k, s_q=s_q, s_k=s_k, h_q=4, h_k=1)
    check_against_oracle(q, k, v, causal=True, softmax_scale=0.125, query_chunk=chunk)


def test_automatic_chunking(monkeypatch):
    # Shrink the budget so a small problem takes the chunked path the default would take at scale.
    b, h_q, s_k = 2, 4, 96
    monkeypatch.setattr(reference, "SCORE_BUDGET", b * h_q * s_k * 8)
    assert reference._auto_chunk(70, b * h_q * s_k) == 8
    q, k, v = make_qkv(21, b=b, s_q=70, s_k=s_k, h_q=h_q, h_k=2)
    jaxpr = str(jax.make_jaxpr(lambda *a: attention_reference(*a, causal=True, softmax_scale=0.1))(q, k, v))
    assert "scan" in jaxpr or "while" in jaxpr, "expected lax.map over query chunks"
    check_against_oracle(q, k, v, causal=True, softmax_scale=0.1)


def test_auto_chunk_default_budget():
    # A 32k x 32k, 32-head prefill must not ask for one 128 GiB score tile ...
    rows = reference._auto_chunk(32768, 32 * 32768)
    assert rows == 64 and rows * 32 * 32768 <= reference.SCORE_BUDGET
    # ... while anything that fits runs as one block (no sequential loop), and 1-row budgets still work.
    assert reference._auto_chunk(4096, 4 * 4096) == 0
    assert reference._auto_chunk(10, reference.SCORE_BUDGET * 3) == 1


def test_float32_inputs_for_oracle_use():
    q, k, v = make_qkv(31, s_q=19, s_k=26, dtype=jnp.float32)
    check_against_oracle(q, k, v, causal=True, softmax_scale=0.2)


def test_under_jit():
    q, k, v = make_qkv(41, s_q=12, s_k=30)
    f = jax.jit(attention_reference, static_argnames=("causal", "softmax_scale", "query_chunk"))
    o, lse = f(q, k, v, causal=True, softmax_scale=0.125, query_chunk=5)
    o_want, lse_want = oracle(q, k, v, causal=True, softmax_scale=0.125)
    np.testing.assert_allclose(np.asarray(o, np.float64), o_want, rtol=1.01 * 2.0**-8, atol=F32_ATOL)
    np.testing.assert_allclose(lse, lse_want, atol=LSE_ATOL)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(causal=1, softmax_scale=0.1), TypeError),
        (dict(causal=False, softmax_scale=0.0), ValueError),
        (dict(causal=False, softmax_scale=0.1, query_chunk=0), ValueError),
    ],
)
def test_rejects_bad_arguments(kwargs, error):
    q, k, v = make_qkv(51, s_q=4, s_k=4)
    with pytest.raises(error):
        attention_reference(q, k, v, **kwargs)


def test_rejects_bad_shapes():
    q, k, v = make_qkv(52, s_q=4, s_k=4, h_q=3, h_k=2)
    with pytest.raises(ValueError, match="multiple"):
        attention_reference(q, k, v, causal=False, softmax_scale=0.1)
