"""The one attention oracle every test compares against: textbook attention in high precision.

Written independently of fa4_jax.reference (the implementation's own fallback): K/V heads are
materialised with repeat instead of grouped by reshape, and the mask is built from the definition
("query i sits at key position i + s_k - s_q; a window (left, right) sees keys [pos - left, pos +
right]") rather than from block arithmetic.

`xp=np` computes in float64 on the host (CPU tests); `xp=jnp` in float32 on the default device with
Precision.HIGHEST (GPU tests: JAX's default f32 matmul on Hopper may use TF32, which would make the
oracle less precise than the bf16 kernel it judges).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def visible_mask(s_q: int, s_k: int, window_size=(-1, -1), causal: bool = False, xp=np):
    """(s_q, s_k) bool: may query i see key j?"""
    left, right = window_size
    if causal:
        right = 0 if right < 0 else right
    pos = xp.arange(s_q)[:, None] + (s_k - s_q)
    j = xp.arange(s_k)[None, :]
    vis = xp.ones((s_q, s_k), dtype=bool)
    if right >= 0:
        vis = vis & (j <= pos + right)
    if left >= 0:
        vis = vis & (j >= pos - left)
    return vis


def attention_oracle(q, k, v, *, softmax_scale: float, causal: bool = False, window_size=(-1, -1),
                     softcap: float = 0.0, sinks=None, xp=np):
    """Returns (o (b, s_q, h_q, d), lse (b, h_q, s_q)) in float64 (xp=np) or float32 (xp=jnp).

    Rows that see no key: o = 0, lse = -inf; with sinks, lse = the sink logit.
    """
    dtype = np.float64 if xp is np else jnp.float32
    q, k, v = (xp.asarray(x).astype(dtype) for x in (q, k, v))
    b, s_q, h_q, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    g = h_q // h_k  # query head h reads kv head h // g
    k, v = xp.repeat(k, g, axis=2), xp.repeat(v, g, axis=2)
    kw = {} if xp is np else {"precision": jax.lax.Precision.HIGHEST}
    s = xp.einsum("bqhd,bkhd->bhqk", q, k, **kw) * softmax_scale
    if softcap:
        s = softcap * xp.tanh(s / softcap)
    s = xp.where(visible_mask(s_q, s_k, window_size, causal, xp)[None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if s_k else xp.full((b, h_q, s_q, 1), -np.inf, dtype)
    if sinks is not None:
        sk = xp.asarray(sinks).astype(dtype)[None, :, None, None]
        m = xp.maximum(m, sk)
    m = xp.where(xp.isfinite(m), m, 0.0)  # empty rows: exp(-inf - 0) = 0 instead of NaN
    p = xp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + xp.exp(sk - m)
    o = xp.einsum("bhqk,bkhd->bqhd", p / xp.where(l > 0, l, 1.0), v, **kw)
    lse = xp.where(l > 0, xp.log(xp.where(l > 0, l, 1.0)) + m, -np.inf)[..., 0]
    return o, lse


# The CPU tests' tolerances for fa4_jax's pure-JAX reference against this oracle (test_reference.py
# derives them; test_kvcache.py and test_varlen.py run that reference too): one rounding of the output
# plus float32 noise.
# Unit roundoff (half the gap between 1 and the next number): 7 and 10 stored mantissa bits.
UNIT_ROUNDOFF = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11, jnp.float32: 2.0**-24}
F32_ATOL = 2e-5  # float32 accumulation over <= 256-term dot products and <= 300-key softmax sums
LSE_ATOL = 1e-4


def make_sinks(seed, h_q, scale=2.0):
    """Per-head sink logits of the same order as the scores (|s| ~ 1-3), so they move the softmax visibly."""
    return (scale * np.random.default_rng(seed).standard_normal(h_q)).astype(np.float32)


# The option combinations every entry point's accuracy tests sweep (8 query heads). Softcap cases
# want inputs at scale 2 so the scaled scores (std ~4) reach the cap of 5.
OPTION_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_left": dict(window_size=(9, -1)),
    "window_two_sided": dict(window_size=(6, 2)),
    "causal_window": dict(causal=True, window_size=(5, -1)),
    "softcap": dict(softcap=5.0),
    "sinks": dict(sinks=make_sinks(1, 8)),
    "everything": dict(causal=True, window_size=(11, -1), softcap=5.0, sinks=make_sinks(2, 8)),
}


def check_empty_result(o, lse, *, b, s_q, h_q, d, dtype, sinks=None):
    """What attention answers for zero-size inputs (as jax.nn.dot_product_attention does): o of shape
    (b, s_q, h_q, d) in the input dtype, all zero; lse (b, h_q, s_q) float32, -inf where a row sees no
    key, or the head's sink logit when there are sinks."""
    assert (o.shape, o.dtype) == ((b, s_q, h_q, d), dtype), f"{o.shape=} {o.dtype=}"
    assert (lse.shape, lse.dtype) == ((b, h_q, s_q), jnp.float32), f"{lse.shape=} {lse.dtype=}"
    assert np.all(np.asarray(o, np.float64) == 0.0)
    want = np.broadcast_to(-np.inf if sinks is None else sinks[None, :, None], (b, h_q, s_q))
    np.testing.assert_array_equal(lse, want)


def refuse_to_run(monkeypatch, module, primitive_name: str, api_name: str):
    """Make any bind of `module.<primitive_name>` (kernel or reference) fail the test: for the
    validation tests, whose arguments must be rejected before anything runs."""

    class Refuse:
        def bind(self, *args, **kwargs):
            raise AssertionError(f"{api_name} ran before its arguments were validated")

    monkeypatch.setattr(module, primitive_name, Refuse())


def gather(cache, page_table):
    """The contiguous (batch, max_pages * page_size, h, d) cache a paged one stands for."""
    cache = np.asarray(cache)
    return cache[page_table].reshape(page_table.shape[0], -1, *cache.shape[2:])
