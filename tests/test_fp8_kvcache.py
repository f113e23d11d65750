"""FP8 (float8_e4m3fn) KV caches on CPU: update_kvcache's quantization bit for bit against an
ml_dtypes oracle, attention_with_kvcache on FP8 caches (contiguous, paged, ragged; per-head and
scalar scales, traced too) against the float64 oracle on the dequantized cache with NaN in every slot
a row may not read, and the errors. No kernel reads FP8 yet: every call here runs the reference."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fa4_jax import attention_with_kvcache, update_kvcache
from fa4_jax.ops.kvcache.quant import FP8_MAX, check_scale, quantize
from oracle import F32_ATOL, LSE_ATOL, UNIT_ROUNDOFF, attention_oracle, make_sinks

FP8 = jnp.float8_e4m3fn
D = 64
SCALE = D**-0.5
H_Q, H_K = 4, 2


def f64(x):
    return np.asarray(x, np.float64)


def fp8_oracle(x, scale) -> np.ndarray:
    """value / scale as update_kvcache's contract says: float32(x) * float32(1 / scale), saturated at
    +-448, rounded to nearest even (ml_dtypes' cast). The reciprocal is taken as the library takes it
    (XLA's float32 division), so this checks the product, the saturation and the rounding."""
    inv = np.asarray(jax.jit(lambda s: jnp.float32(1.0) / s)(jnp.asarray(scale, jnp.float32)))
    inv = inv if inv.ndim == 0 else inv[:, None]
    prod = np.asarray(x, np.float32) * inv
    return np.clip(prod, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def assert_same_fp8(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == np.dtype(ml_dtypes.float8_e4m3fn), (got.dtype, want.dtype)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan], err_msg=what)


def dequantized(cache, scale) -> np.ndarray:
    """float64 value * scale: exact (a 4-bit significand times a float32)."""
    s = f64(np.float32(scale)) if np.ndim(scale) == 0 else f64(np.asarray(scale, np.float32))[:, None]
    return f64(np.asarray(cache).astype(np.float32)) * s


def random_fp8(rng, shape, scale=1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.float8_e4m3fn)


NAN8 = np.array(np.nan, np.float32).astype(ml_dtypes.float8_e4m3fn)


# -- quantization -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("scale", [1.0, 0.37, np.float32(3.5), np.array([0.02, 7.0], np.float32)],
                         ids=["one", "python", "numpy", "per_head"])
def test_quantize_matches_oracle(dtype, scale):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 50, H_K, D), dtype=np.float32) * np.float32(40.0)
    # Saturation (past 448 * scale), values in e4m3's subnormal range, halfway cases, NaN and +-inf.
    x[0, 0, :, :4] = [1e6, -1e6, 1e-3, -3e-3]
    x[0, 1, :, :3] = [np.nan, np.inf, -np.inf]
    with np.errstate(over="ignore"):  # 1e6 is +-inf in float16: saturates all the same
        x = x.astype(dtype)
    got = quantize(x, check_scale("k_scale", scale, H_K))
    assert_same_fp8(got, fp8_oracle(np.asarray(x, np.float32), scale), f"{jnp.dtype(dtype).name} {scale=}")
    g = np.asarray(got).astype(np.float32)
    assert np.all(np.abs(g[np.isfinite(g)]) <= FP8_MAX)
    assert np.isfinite(g[0, 1, :, 1:3]).all(), "+-inf saturates to +-448, never NaN"
    assert np.isnan(g[0, 1, :, 0]).all(), "NaN stays NaN"


def test_quantize_traced_scale_under_jit():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, H_K, D), dtype=np.float32).astype(jnp.bfloat16)
    scale = jnp.array([0.5, 0.125], jnp.float32)
    got = jax.jit(lambda x, s: quantize(x, check_scale("k_scale", s, H_K)))(x, scale)
    assert_same_fp8(got, fp8_oracle(np.asarray(x, np.float32), scale))


# -- update_kvcache -----------------------------------------------------------------------------

def expected_update(cache, new_fp8, seq, pos, page_table=None):
    """The cache with new_fp8[i] at position pos[i] of sequence seq[i] (positions outside dropped)."""
    want = np.array(cache, copy=True)
    for i, (b, p) in enumerate(zip(seq, pos)):
        if page_table is None:
            if 0 <= p < cache.shape[1]:
                want[b, p] = new_fp8[i]
        elif 0 <= p < page_table.shape[1] * cache.shape[1]:
            want[page_table[b, p // cache.shape[1]], p % cache.shape[1]] = new_fp8[i]
    return want


@pytest.mark.parametrize("layout", ["contiguous", "paged", "ragged_paged"])
@pytest.mark.parametrize("scales", [(None, None), (0.25, np.array([2.0, 0.5], np.float32))], ids=["default", "set"])
def test_update_quantizes_into_the_cache(layout, scales):
    rng = np.random.default_rng(3)
    k_scale, v_scale = scales
    b, s_new = 3, 5
    if layout == "contiguous":
        shape, table = (b, 24), None
    else:
        shape = (12, 8)
        table = rng.permutation(12)[:9].reshape(b, 3).astype(np.int32)
    k_cache, v_cache = random_fp8(rng, (*shape, H_K, D)), random_fp8(rng, (*shape, H_K, D))
    lens = np.array([0, 7, 21], np.int32)  # the last sequence runs past its capacity: dropped
    if layout == "ragged_paged":
        cu = np.array([0, 1, 1, 6], np.int32)  # one token, none, five
        new = [rng.standard_normal((6, H_K, D), dtype=np.float32).astype(jnp.bfloat16) for _ in range(2)]
        seq, pos = [0, 2, 2, 2, 2, 2], [0, 21, 22, 23, 24, 25]
        kw = dict(cu_seqlens_new=cu)
    else:
        new = [rng.standard_normal((b, s_new, H_K, D), dtype=np.float32).astype(jnp.bfloat16) for _ in range(2)]
        seq = [i for i in range(b) for _ in range(s_new)]
        pos = [int(lens[i]) + t for i in range(b) for t in range(s_new)]
        kw = {}
    k2, v2 = update_kvcache(k_cache, v_cache, *new, lens, page_table=table, k_scale=k_scale, v_scale=v_scale, **kw)
    for name, got, cache, x, scale in (("k", k2, k_cache, new[0], k_scale), ("v", v2, v_cache, new[1], v_scale)):
        flat = np.asarray(x, np.float32).reshape(-1, H_K, D)
        want = expected_update(cache, fp8_oracle(flat, 1.0 if scale is None else scale), seq, pos, table)
        assert_same_fp8(got, want, f"{name}_cache {layout}")


def test_update_in_place_under_jit_with_traced_scales():
    rng = np.random.default_rng(4)
    k_cache, v_cache = (jnp.asarray(random_fp8(rng, (2, 16, H_K, D))) for _ in range(2))
    new = rng.standard_normal((2, 1, H_K, D), dtype=np.float32).astype(jnp.bfloat16)
    lens = jnp.array([3, 9], jnp.int32)
    step = jax.jit(lambda k, v, x, n, ks, vs: update_kvcache(k, v, x, x, n, k_scale=ks, v_scale=vs),
                   donate_argnums=(0, 1))
    ks, vs = jnp.float32(0.5), jnp.array([1.0, 4.0], jnp.float32)
    compiled = step.lower(k_cache, v_cache, new, lens, ks, vs).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == 2 * k_cache.nbytes, "the donated caches are aliased"
    assert not re.findall(r"f8e4m3fn\[2,16,2,64\]\{[0-9,]*\} copy\(", compiled.as_text()), "a cache is copied"
    plain = jax.jit(lambda k, v, x, n, ks, vs: update_kvcache(k, v, x, x, n, k_scale=ks, v_scale=vs))
    assert plain.lower(k_cache, v_cache, new, lens, ks, vs).compile().memory_analysis().alias_size_in_bytes == 0
    want_k = np.asarray(k_cache).copy()
    k2, _ = step(k_cache, v_cache, new, lens, ks, vs)
    q8 = fp8_oracle(np.asarray(new, np.float32)[:, 0], ks)
    want_k[0, 3], want_k[1, 9] = q8[0], q8[1]
    assert_same_fp8(k2, want_k)


# -- attention on FP8 caches --------------------------------------------------------------------

def oracle_per_sequence(q, k, v, lens, **kw):
    outs = [attention_oracle(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], xp=np, **kw)
            for i, n in enumerate(np.asarray(lens))]
    return np.concatenate([o for o, _ in outs]), np.concatenate([lse for _, lse in outs])


def check(o, lse, o_want, lse_want, dtype):
    assert o.dtype == dtype and lse.dtype == jnp.float32
    o, lse = f64(o), f64(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, o_want, rtol=1.01 * UNIT_ROUNDOFF[dtype], atol=F32_ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
    fin = np.isfinite(lse_want)
    np.testing.assert_allclose(lse[fin], lse_want[fin], rtol=0, atol=LSE_ATOL)


OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window_softcap_sinks": dict(window_size=(20, 0), softcap=5.0, sinks="sinks"),
}


@pytest.mark.parametrize("opts", sorted(OPTIONS))
@pytest.mark.parametrize("scales", [(None, None), (0.05, 0.3), (np.array([0.1, 0.02], np.float32), 2.0)],
                         ids=["default", "scalar", "per_head"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_contiguous_and_paged_match_the_oracle(opts, scales, dtype):
    rng = np.random.default_rng(5)
    b, s_q, cap, page = 4, 3, 72, 8
    k_scale, v_scale = scales
    kw = {k: (make_sinks(6, H_Q) if v == "sinks" else v) for k, v in OPTIONS[opts].items()}
    lens = np.array([0, 2, 37, cap], np.int32)
    q = rng.standard_normal((b, s_q, H_Q, D), dtype=np.float32).astype(dtype)
    k8, v8 = random_fp8(rng, (b, cap, H_K, D), 8.0), random_fp8(rng, (b, cap, H_K, D), 8.0)
    for i, n in enumerate(lens):  # what no row may read: NaN
        k8[i, n:], v8[i, n:] = NAN8, NAN8
    ks = 1.0 if k_scale is None else k_scale
    vs = 1.0 if v_scale is None else v_scale
    o_want, lse_want = oracle_per_sequence(q, dequantized(k8, ks), dequantized(v8, vs), lens, softmax_scale=SCALE, **kw)
    o, lse = attention_with_kvcache(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale, return_lse=True, **kw)
    check(o, lse, o_want, lse_want, dtype)
    # The same cache as shuffled pages of a larger pool; every page no sequence owns holds NaN.
    mp = cap // page
    table = rng.permutation(b * mp + 5)[: b * mp].reshape(b, mp).astype(np.int32)
    pool_k = np.full((b * mp + 5, page, H_K, D), NAN8)
    pool_v = np.full_like(pool_k, NAN8)
    pool_k[table], pool_v[table] = k8.reshape(b, mp, page, H_K, D), v8.reshape(b, mp, page, H_K, D)
    o_p, lse_p = attention_with_kvcache(q, pool_k, pool_v, lens, page_table=table, k_scale=k_scale, v_scale=v_scale,
                                        return_lse=True, **kw)
    check(o_p, lse_p, o_want, lse_want, dtype)


def test_ragged_matches_the_oracle():
    rng = np.random.default_rng(7)
    page, num_pages, mp = 5, 40, 6
    lens = np.array([12, 0, 30, 1], np.int32)
    cu = np.array([0, 4, 4, 14, 15], np.int32)  # a 4-token chunk, nothing, a 10-token chunk, a decode
    table = rng.permutation(num_pages)[: 4 * mp].reshape(4, mp).astype(np.int32)
    pool_k, pool_v = random_fp8(rng, (num_pages, page, H_K, D), 4.0), random_fp8(rng, (num_pages, page, H_K, D), 4.0)
    owned = np.zeros((num_pages, page), bool)
    for i, n in enumerate(lens):
        for p in range(n):
            owned[table[i, p // page], p % page] = True
    pool_k[~owned], pool_v[~owned] = NAN8, NAN8
    ks, vs = np.array([0.2, 0.7], np.float32), 0.9
    q = rng.standard_normal((16, H_Q, D), dtype=np.float32).astype(jnp.bfloat16)  # row 15: no sequence's
    o, lse = attention_with_kvcache(q, pool_k, pool_v, lens, cu_seqlens_q=cu, page_table=table, causal=True,
                                    k_scale=ks, v_scale=vs, return_lse=True)
    kc, vc = (dequantized(x, s)[table].reshape(4, mp * page, H_K, D) for x, s in ((pool_k, ks), (pool_v, vs)))
    for i in range(4):
        rows = slice(cu[i], cu[i + 1])
        if cu[i + 1] == cu[i]:
            continue
        o_w, lse_w = attention_oracle(np.asarray(q[rows])[None], kc[i:i + 1, :lens[i]], vc[i:i + 1, :lens[i]],
                                      softmax_scale=SCALE, causal=True, xp=np)
        check(o[rows][None], lse[:, rows][None], o_w, lse_w, jnp.bfloat16)
    assert np.all(f64(o[15]) == 0.0) and np.all(np.isneginf(lse[:, 15]))


def test_jit_with_traced_scales_and_vmap():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 1, H_Q, D), dtype=np.float32).astype(jnp.bfloat16)
    k8, v8 = random_fp8(rng, (2, 32, H_K, D)), random_fp8(rng, (2, 32, H_K, D))
    lens = jnp.array([5, 32], jnp.int32)
    f = jax.jit(lambda q, k, v, n, ks, vs: attention_with_kvcache(q, k, v, n, k_scale=ks, v_scale=vs))
    ks, vs = jnp.array([0.5, 2.0], jnp.float32), jnp.float32(0.25)
    o = f(q, k8, v8, lens, ks, vs)
    o_eager = attention_with_kvcache(q, k8, v8, lens, k_scale=np.array([0.5, 2.0], np.float32), v_scale=0.25)
    np.testing.assert_array_equal(f64(o), f64(o_eager))
    # vmap over the queries and the scales (a per-layer scale, say) with one cache
    qs = jnp.stack([q, q * 2])
    kss = jnp.stack([ks, ks * 3])
    ov = jax.vmap(lambda q, ks: attention_with_kvcache(q, k8, v8, lens, k_scale=ks, v_scale=vs))(qs, kss)
    for i in range(2):
        np.testing.assert_array_equal(f64(ov[i]), f64(attention_with_kvcache(qs[i], k8, v8, lens, k_scale=kss[i],
                                                                             v_scale=vs)))


# -- errors -------------------------------------------------------------------------------------

def _caches(dtype=FP8, shape=(2, 16, H_K, D)):
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@pytest.mark.parametrize("call,error,message", [
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.bfloat16), *_caches(jnp.bfloat16),
                                    jnp.array([1, 2], jnp.int32), k_scale=0.5),
     ValueError, "k_scale and v_scale apply to float8_e4m3fn caches only; the caches are bfloat16"),
    (lambda: update_kvcache(*_caches(jnp.bfloat16), jnp.zeros((2, 1, H_K, D), jnp.bfloat16),
                            jnp.zeros((2, 1, H_K, D), jnp.bfloat16), jnp.array([1, 2], jnp.int32), v_scale=2.0),
     ValueError, "k_scale and v_scale apply to float8_e4m3fn caches only"),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.bfloat16), _caches()[0], _caches(jnp.bfloat16)[1],
                                    jnp.array([1, 2], jnp.int32)),
     TypeError, "k_cache and v_cache must both be float8_e4m3fn or neither"),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.bfloat16), *_caches(), jnp.array([1, 2], jnp.int32),
                                    k_scale=np.ones(3, np.float32)),
     ValueError, r"k_scale must be a scalar or have shape \(heads_kv,\) = \(2,\); got shape \(3,\)"),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.bfloat16), *_caches(), jnp.array([1, 2], jnp.int32),
                                    v_scale=-1.0),
     ValueError, r"v_scale must be positive and finite; got v_scale=-1.0"),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, 96), jnp.bfloat16), *_caches(shape=(2, 16, H_K, 96)),
                                    jnp.array([1, 2], jnp.int32), implementation="fa4"),
     # (no FP8 kernel at head_dim 96: the library names the variant it lacks, or says it is not built)
     RuntimeError, r'implementation="fa4" cannot run here: .*(fa4_kvcache_sm\d+_bf16_hd96_local(_m16)?_kvfp8|library is unavailable)'),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.bfloat16), *_caches(), jnp.array([1, 2], jnp.int32),
                                    implementation="cudnn"),
     ValueError, r'implementation="cudnn" cannot read float8_e4m3fn KV caches'),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.float32), *_caches(), jnp.array([1, 2], jnp.int32)),
     TypeError, r"q must be bfloat16 or float16; got q.dtype=float32"),
    (lambda: attention_with_kvcache(jnp.zeros((2, 1, H_Q, D), jnp.bfloat16), *_caches(), jnp.array([1, 2], jnp.int32),
                                    window_size=(3, 4), causal=True),
     ValueError, "causal"),  # the 16-bit call's own checks run first
    (lambda: update_kvcache(*_caches(), jnp.zeros((2, 1, H_K, D), FP8), jnp.zeros((2, 1, H_K, D), FP8),
                            jnp.array([1, 2], jnp.int32)),
     ValueError, r"k_new must be \(batch, seqlen_new, heads_kv, head_dim\) with the cache's heads and a 16- or "
                 r"32-bit float dtype \(quantized into the FP8 cache\)"),
], ids=["attn_scale_16bit", "update_scale_16bit", "mixed", "scale_shape", "scale_negative", "fa4", "cudnn", "q_f32",
        "option_check", "update_fp8_new"])
def test_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_export_round_trip():
    """An FP8 decode step (update + attention, traced scales) through jax.export: the same bytes and
    results as the direct call."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 1, H_Q, D), dtype=np.float32).astype(jnp.bfloat16)
    new = rng.standard_normal((2, 1, H_K, D), dtype=np.float32).astype(jnp.bfloat16)
    k8, v8 = random_fp8(rng, (2, 32, H_K, D)), random_fp8(rng, (2, 32, H_K, D))
    lens = jnp.array([4, 20], jnp.int32)

    def step(q, k, v, x, n, ks, vs):
        k, v = update_kvcache(k, v, x, x, n, k_scale=ks, v_scale=vs)
        return attention_with_kvcache(q, k, v, n + 1, causal=True, k_scale=ks, v_scale=vs), k

    args = (q, k8, v8, new, lens, jnp.array([0.5, 1.5], jnp.float32), jnp.float32(0.75))
    restored = jax.export.deserialize(jax.export.export(jax.jit(step))(*args).serialize())
    (o, k), (o2, k2) = step(*args), restored.call(*args)
    np.testing.assert_array_equal(f64(o), f64(o2))
    assert_same_fp8(k2, k)


@pytest.mark.parametrize("s_q", [1, 8, 9, 16, 17, 32, 33, 512])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("page_rows", [16, 1])
def test_fp8_calls_take_an_fp8_tile_at_every_length(s_q, ragged, page_rows):
    """FP8 caches have three tiles (spec.FP8_TILE_MS): the 16-row decode tile while a sequence has at
    most 16 packed rows, the 64-row tile up to 64, else the two-warpgroup chunk tile -- except with
    one-row pages (page_rows 1), whose producer gathers rows and cannot widen: their chunks run as
    several 64-row tiles per sequence. The lowering picks a variant the menu has."""
    from fa4_jax.families import default_menu
    from fa4_jax.ops.kvcache import api
    from fa4_jax.ops.kvcache.primitive import kernel_variant

    rows = s_q * H_Q // H_K
    paged = ragged or page_rows == 1
    tile_m = api._tile_m(s_q, H_Q, H_K, True, page_rows)
    assert tile_m == (16 if rows <= 16 else 64 if rows <= 64 or page_rows == 1 else 128)
    assert api._tile_m(s_q, H_Q, H_K) == (64 if rows <= 64 else 128)
    params = dict(softmax_scale=SCALE, window_left=-1, window_right=0, softcap=0.0, has_sinks=False, paged=paged,
                  ragged=ragged, kv_fp8=True, max_seqlen_q=s_q if ragged else 0, tile_m=tile_m, page_rows=page_rows,
                  num_splits=0)
    assert kernel_variant("sm90", jnp.bfloat16, D, params) in default_menu()


def test_the_fp8_chunk_tile_has_no_one_row_pages():
    """The 128-row FP8 tile's producer widens K and V; one-row pages take its whole warpgroup to gather
    rows, so that variant is refused by name and absent from the menu."""
    from fa4_jax.families import KVCacheVariant, default_menu

    with pytest.raises(ValueError, match=r"the FP8 tile of 128 rows has page_rows in \(16,\): self.page_rows=1"):
        KVCacheVariant("sm90", "bf16", 128, "local", False, True, 128, 1, kv_fp8=True)
    fp8 = [v for v in default_menu() if isinstance(v, KVCacheVariant) and v.kv_fp8]
    assert {v.tile_m for v in fp8} == {16, 64, 128}
    assert not [v for v in fp8 if v.tile_m == 128 and v.page_rows == 1]
    assert len([v for v in fp8 if v.tile_m == 128]) == 16


@pytest.mark.parametrize("slices,tile", [(4, 16), (8, 16), (9, 64), (16, 64), (33, 128)])
def test_vmap_over_q_takes_the_fp8_tile_of_the_folded_rows(slices, tile):
    """vmap over q alone folds the slices into each KV head's packed rows (one launch, the cache read
    once); past 16 rows the 16-row FP8 tile would read the cache again per 16 rows, so the batch rule
    picks the tile for the folded rows (here 2 q-heads per KV head: 2 rows per slice; past 64, the
    two-warpgroup chunk tile)."""
    from fa4_jax.ops.kvcache.primitive import _join, fa4_kvcache_p

    q = jax.ShapeDtypeStruct((slices, 2, 1, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 64), FP8)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    scale = jax.ShapeDtypeStruct((2,), jnp.float32)

    def one(q, k, v, lens, ks, vs):
        return fa4_kvcache_p.bind(*_join(q, k, v, lens, None, None, None, ks, vs), softmax_scale=0.125,
                                  window_left=-1, window_right=-1, softcap=0.0, has_sinks=False, paged=False,
                                  ragged=False, kv_fp8=True, max_seqlen_q=0, tile_m=16, page_rows=16, num_splits=0,
                                  implementation="fa4")

    jaxpr = jax.make_jaxpr(jax.vmap(one, in_axes=(0, None, None, None, None, None)))(q, k, k, lens, scale, scale)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is fa4_kvcache_p]
    assert eqn.params["tile_m"] == tile
    assert eqn.invars[0].aval.shape == (2, 1, 4 * slices, 64)  # one launch, the slices among the heads


def _bound_tile(f, *args):
    """(tile_m, page_rows) of the one KV-cache primitive in f's jaxpr (the bound equation shows the
    variant the lowering picks; the CPU reference ignores both)."""
    from fa4_jax.ops.kvcache.primitive import fa4_kvcache_p

    (eqn,) = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive is fa4_kvcache_p]
    return eqn.params["tile_m"], eqn.params["page_rows"]


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("s_q,page_size,want", [
    (17, None, (64, 16)),    # 34 packed rows: the 64-row tile
    (512, None, (128, 16)),  # a chunk: the two-warpgroup chunk tile
    (512, 16, (128, 16)),    # ... in 16-row page pieces
    (512, 5, (64, 1)),       # one-row pages have no chunk tile
    (4, 5, (16, 1)),
])
def test_fp8_calls_bind_the_tile_and_page_pieces_they_need(ragged, s_q, page_size, want):
    """The public calls, not just api._tile_m: the page pieces reach the FP8 tile choice on the dense
    and the ragged paths (a chunk tile asked for with one-row pages would be a variant the menu lacks:
    the reference instead)."""
    b, pages = 2, 4
    cache = (b, 1024, H_K, D) if page_size is None else (b * pages, page_size, H_K, D)
    sds = jax.ShapeDtypeStruct
    k = sds(cache, FP8)
    table = None if page_size is None else sds((b, pages), jnp.int32)
    scale = jnp.ones((H_K,), jnp.float32)
    n = sds((b,), jnp.int32)
    if ragged:
        q = sds((b * s_q, H_Q, D), jnp.bfloat16)
        cu = sds((b + 1,), jnp.int32)
        f = lambda q, k, n, cu, t: attention_with_kvcache(  # noqa: E731
            q, k, k, n, cu_seqlens_q=cu, max_seqlen_q=s_q, page_table=t, k_scale=scale, v_scale=scale)
        assert _bound_tile(f, q, k, n, cu, table) == want
    else:
        q = sds((b, s_q, H_Q, D), jnp.bfloat16)
        f = lambda q, k, n, t: attention_with_kvcache(q, k, k, n, page_table=t, k_scale=scale, v_scale=scale)  # noqa: E731
        assert _bound_tile(f, q, k, n, table) == want


@pytest.mark.parametrize("kv_fp8,page_rows,heads,want", [
    (True, 16, (8, 2), 128),   # 20 queries x 4 q-heads per KV head: 80 rows
    (True, 16, (2, 1), 64),    # a shard holding one KV head and 2 of its q-heads: 40 rows
    (True, 1, (8, 2), 64),     # one-row pages: no chunk tile
    (True, 16, (1, 1), 64),
    (False, 16, (2, 1), 64),
    (False, 1, (8, 2), 128),
])
def test_retiled_picks_the_tile_for_a_rules_shapes(kv_fp8, page_rows, heads, want):
    """spec.retiled: the tile for the packed rows a shard (head sharding with fewer KV heads than
    shards) or a vmap fold actually has; a symbolic row count keeps the lowering's choice."""
    from fa4_jax.ops.kvcache.spec import retiled

    params = dict(ragged=False, max_seqlen_q=0, paged=page_rows == 1, page_rows=page_rows, kv_fp8=kv_fp8, tile_m=0)
    q_shape, k_shape = (3, 20, heads[0], D), (3, 64, heads[1], D)
    assert retiled(params, q_shape, k_shape)["tile_m"] == want
    ragged = dict(params, ragged=True, max_seqlen_q=20)
    assert retiled(ragged, (1, 60, heads[0], D), k_shape)["tile_m"] == want  # rows from max_seqlen_q
    assert retiled(dict(ragged, max_seqlen_q=0), (1, 60, heads[0], D), k_shape) == dict(ragged, max_seqlen_q=0)
