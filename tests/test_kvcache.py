"""fa4_jax.attention_with_kvcache and fa4_jax.update_kvcache on CPU, against the shared float64 oracle.

This build has no KV-cache kernel, so None / "xla" run the pure-JAX reference, whose error against the
exact result is one rounding of the output plus float32 noise: the tolerances of test_reference.py.
The oracle knows nothing about caches: sequence b is plain attention over its first cache_seqlens[b]
keys, where bottom-right alignment puts query i at key position cache_seqlens[b] - seqlen_q + i, which
is exactly what the contract says. A paged cache is first gathered into the contiguous cache it
stands for, with NumPy indexing rather than the library's gather.
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax import attention_with_kvcache, update_kvcache
from oracle import (F32_ATOL, LSE_ATOL, OPTION_CASES, UNIT_ROUNDOFF, attention_oracle, gather, make_sinks,
                    refuse_to_run, visible_mask)

# The module itself: the no_run fixture replaces the reference it calls.
kvcache = importlib.import_module("fa4_jax.ops.kvcache.api")

STATIC = attention_with_kvcache.STATIC_ARGNAMES
D = 64
SCALE = D**-0.5  # the default softmax_scale at head_dim 64


def f64(x):
    return np.asarray(x, np.float64)


def draw(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    # NumPy arrays of the target dtype: no per-shape XLA conversion to compile.
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)



def make_inputs(seed, *, b, s_q, cache_shape, h_q, h_k, dtype=jnp.bfloat16, scale=1.0):
    """q (b, s_q, h_q, D) and k/v caches of cache_shape + (h_k, D): (batch, capacity) or (num_pages,
    page_size). Every slot holds a random key, stale ones included, so a key that leaks through the
    cache_seqlens / page bookkeeping changes the result."""
    rng = np.random.default_rng(seed)
    q = draw(rng, (b, s_q, h_q, D), dtype, scale)
    k, v = (draw(rng, (*cache_shape, h_k, D), dtype, scale) for _ in range(2))
    return q, k, v


def shuffled_page_table(seed, b, max_pages, num_pages, *, share=True):
    """Distinct, shuffled page ids; with share, sequence 1 reuses sequence 0's first page (a common
    prefix), as attention may but concurrent writes must not."""
    ids = np.random.default_rng(seed).permutation(num_pages)[: b * max_pages].astype(np.int32)
    table = ids.reshape(b, max_pages)
    if share:
        table[1, 0] = table[0, 0]
    return table


def kvcache_oracle(q, k_cache, v_cache, cache_seqlens, *, page_table=None, softmax_scale=SCALE, **kwargs):
    """float64 (o (b, s_q, h_q, d), lse (b, h_q, s_q)), one sequence at a time."""
    if page_table is not None:
        k_cache, v_cache = gather(k_cache, page_table), gather(v_cache, page_table)
    outs = [attention_oracle(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], softmax_scale=softmax_scale,
                             xp=np, **kwargs) for i, n in enumerate(np.asarray(cache_seqlens))]
    return np.concatenate([o for o, _ in outs]), np.concatenate([lse for _, lse in outs])


def check_result(o, lse, q, k_cache, v_cache, cache_seqlens, *, page_table=None, softmax_scale=SCALE, **kwargs):
    """Compares (o, lse) with the oracle, and rows that see no key exactly (o = 0; lse = -inf or the
    head's sink logit). Returns the (batch, seqlen_q) mask of those rows."""
    o_want, lse_want = kvcache_oracle(q, k_cache, v_cache, cache_seqlens, page_table=page_table,
                                      softmax_scale=softmax_scale, **kwargs)
    b, s_q, h_q, _ = q.shape
    assert (o.shape, o.dtype) == (q.shape, q.dtype), f"{o.shape=} {o.dtype=}"
    assert (lse.shape, lse.dtype) == ((b, h_q, s_q), jnp.float32), f"{lse.shape=} {lse.dtype=}"
    o, lse = f64(o), f64(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()

    np.testing.assert_allclose(o, o_want, rtol=1.01 * UNIT_ROUNDOFF[q.dtype.type], atol=F32_ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
    finite = np.isfinite(lse_want)
    np.testing.assert_allclose(lse[finite], lse_want[finite], rtol=0, atol=LSE_ATOL)

    window, causal, sinks = kwargs.get("window_size", (-1, -1)), kwargs.get("causal", False), kwargs.get("sinks")
    empty = np.stack([~visible_mask(s_q, int(n), window, causal).any(1) for n in np.asarray(cache_seqlens)])
    assert np.all(o[empty] == 0.0), "rows that see no key must give o = 0 exactly"
    for i in range(b):
        got = lse[i][:, empty[i]]
        want = -np.inf if sinks is None else f64(np.float32(sinks))[:, None]
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape), err_msg=f"empty rows of sequence {i}")
    return empty


# -- accuracy -----------------------------------------------------------------------------------

# 0 (no key at all), 1 (fewer keys than speculative queries), 37 (no multiple of 16 or 64) and the
# full capacity (the last slot is read).
CAPACITY = 80
SEQLENS = np.array([0, 1, 37, CAPACITY], np.int32)

CASES = OPTION_CASES  # shared with the other entry points' tests (tests/oracle.py)


# Every case with 4 speculative queries; decode (1 query, where causal hides nothing) with a few.
@pytest.mark.parametrize(
    "case,s_q", [(c, 4) for c in sorted(CASES)] + [(c, 1) for c in ("plain", "window_two_sided", "everything")]
)
def test_contiguous_matches_oracle(case, s_q):
    kwargs = CASES[case]
    q, k, v = make_inputs(10 + s_q + len(case), b=4, s_q=s_q, cache_shape=(4, CAPACITY), h_q=8, h_k=2,
                          scale=2.0 if "softcap" in kwargs else 1.0)
    o, lse = attention_with_kvcache(q, k, v, SEQLENS, return_lse=True, **kwargs)
    empty = check_result(o, lse, q, k, v, SEQLENS, **kwargs)

    # cache_seqlens = 0 leaves its sequence with nothing to see; with 4 queries and one key, causal
    # hides that key from all but the last query.
    assert empty[0].all() and not empty[2:].any()
    if kwargs.get("causal") and s_q == 4:
        assert empty[1].tolist() == [True, True, True, False]
    if "sinks" in kwargs:
        # Rows that see only the sink: its logit is the whole log-sum-exp.
        np.testing.assert_array_equal(lse[0], np.broadcast_to(kwargs["sinks"][:, None], (8, s_q)))
    if kwargs and s_q == 4:
        # The options must matter on these inputs, or the comparison above proves nothing about them.
        o_plain, _ = kvcache_oracle(q, k, v, SEQLENS)
        assert np.abs(f64(o) - o_plain).max() > 1e-2, "the options had no visible effect"


@pytest.mark.parametrize("h_q,h_k", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_and_dtypes(dtype, h_q, h_k):
    # GQA ratios 1, 4 and 8; per-query-head sinks catch a query-head/kv-head mix-up.
    kwargs = dict(causal=True, window_size=(20, -1), sinks=make_sinks(h_q + h_k, h_q))
    q, k, v = make_inputs(20 + h_q * h_k + (dtype == jnp.float16), b=4, s_q=4, cache_shape=(4, CAPACITY),
                          h_q=h_q, h_k=h_k, dtype=dtype)
    o, lse = attention_with_kvcache(q, k, v, SEQLENS, softmax_scale=0.1, return_lse=True, **kwargs)
    check_result(o, lse, q, k, v, SEQLENS, softmax_scale=0.1, **kwargs)


@pytest.mark.parametrize(
    "page_size,num_pages,max_pages,seqlens",
    [(16, 16, 5, [37, 21, 70]), (64, 10, 3, [100, 70, 150])],
)
def test_paged_matches_oracle_and_contiguous(page_size, num_pages, max_pages, seqlens):
    seqlens = np.array(seqlens, np.int32)
    assert np.all(seqlens % page_size != 0)
    table = shuffled_page_table(page_size, 3, max_pages, num_pages)
    kwargs = dict(causal=True, softcap=5.0, sinks=make_sinks(page_size, 8))
    q, kp, vp = make_inputs(30 + page_size, b=3, s_q=4, cache_shape=(num_pages, page_size), h_q=8, h_k=2, scale=2.0)
    o, lse = attention_with_kvcache(q, kp, vp, seqlens, page_table=table, return_lse=True, **kwargs)
    check_result(o, lse, q, kp, vp, seqlens, page_table=table, **kwargs)

    # The paged layout is only an addressing scheme: the same computation as on the gathered cache.
    o_c, lse_c = attention_with_kvcache(q, gather(kp, table), gather(vp, table), seqlens, return_lse=True, **kwargs)
    np.testing.assert_array_equal(f64(o), f64(o_c))
    np.testing.assert_array_equal(lse, lse_c)


@pytest.mark.parametrize("page_size", [1, 5, 8, 32, 48, 128, 256, 512])
def test_paged_page_sizes_match_oracle(page_size):
    # Every page size the kernels tile, pages shuffled and one shared; lengths inside the first page,
    # across a boundary and into the last page.
    max_pages, num_pages = 3, 10
    seqlens = np.array([5, page_size + 3, 3 * page_size - 1], np.int32)
    table = shuffled_page_table(page_size + 1, 3, max_pages, num_pages)
    kwargs = dict(causal=True, window_size=(page_size + 7, -1), sinks=make_sinks(page_size, 8))
    q, kp, vp = make_inputs(35 + page_size, b=3, s_q=4, cache_shape=(num_pages, page_size), h_q=8, h_k=2)
    o, lse = attention_with_kvcache(q, kp, vp, seqlens, page_table=table, return_lse=True, **kwargs)
    check_result(o, lse, q, kp, vp, seqlens, page_table=table, **kwargs)


# Lengths outside [0, capacity] break the contract ("results unspecified"), but attention clamps them
# to the capacity, never reading past it; the kernel clamps the same way (tests/test_gpu_kvcache.py).
# Causal, so that the clamp is visible: a length past the capacity, unclamped, would put the queries
# past the last key and let every query see every key.
OUT_OF_RANGE_LENGTHS = {
    "contiguous": (None, [-5, CAPACITY + 1, 1 << 30, 37]),
    "paged": (16, [-1, 3 * 16 + 9, 1 << 30, 20]),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE_LENGTHS))
@pytest.mark.parametrize("s_q", [1, 4])
def test_cache_seqlens_are_clamped_to_the_capacity(case, s_q):
    page_size, seqlens = OUT_OF_RANGE_LENGTHS[case]
    seqlens = np.array(seqlens, np.int32)
    if page_size is None:
        table, cache_shape, capacity = None, (4, CAPACITY), CAPACITY
    else:
        table = shuffled_page_table(7, 4, 3, 14)
        cache_shape, capacity = (14, page_size), 3 * page_size
    kwargs = dict(causal=True, sinks=make_sinks(3, 8))
    q, k, v = make_inputs(45 + s_q, b=4, s_q=s_q, cache_shape=cache_shape, h_q=8, h_k=2)
    o, lse = attention_with_kvcache(q, k, v, seqlens, page_table=table, return_lse=True, **kwargs)
    clamped = np.clip(seqlens, 0, capacity)
    check_result(o, lse, q, k, v, clamped, page_table=table, **kwargs)
    if s_q > 1:  # the clamp is visible: without it, the causal mask of the long rows would hide nothing
        o_unclamped, _ = kvcache_oracle(q, k, v, np.full(4, capacity, np.int32), page_table=table,
                                        sinks=kwargs["sinks"])
        assert np.abs(f64(o[1:3]) - o_unclamped[1:3]).max() > 1e-2


def test_num_splits_does_not_change_the_result():
    # On CPU num_splits only passes through (the reference has no split): each value must still give
    # the oracle's result. That the kernel's splits do not change it is tests/test_gpu_kvcache.py's
    # (test_kvcache_decode_splits, test_kvcache_paged, test_kvcache_chunked_prefill: every split count
    # against the oracle).
    q, k, v = make_inputs(40, b=4, s_q=4, cache_shape=(4, CAPACITY), h_q=8, h_k=2)
    for n in (None, 1, 3):
        o, lse = attention_with_kvcache(q, k, v, SEQLENS, causal=True, num_splits=n, return_lse=True)
        check_result(o, lse, q, k, v, SEQLENS, causal=True)


@pytest.mark.parametrize("num_splits,param", [(None, 0), (1, 1), (3, 3), (256, 256)])
def test_num_splits_reaches_the_primitive(num_splits, param):
    # The kernel's split count is the primitive's param (0 = pick at run time); the reference ignores it,
    # so only the bound equation shows whether the API passed it on.
    from fa4_jax.ops.kvcache.primitive import fa4_kvcache_p

    q, k, v = make_inputs(42, b=2, s_q=1, cache_shape=(2, 16), h_q=4, h_k=2)
    jaxpr = jax.make_jaxpr(lambda q, k, v, n: attention_with_kvcache(q, k, v, n, num_splits=num_splits))(
        q, k, v, np.array([3, 16], np.int32))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is fa4_kvcache_p]
    assert eqn.params["num_splits"] == param, eqn.params


@pytest.mark.parametrize("s_q,page_size,tile_m,page_rows", [
    (1, None, 64, 16),    # decode: 4 pack-GQA rows, one consumer warpgroup
    (16, 48, 64, 16),     # 64 rows: still one warpgroup; 48 = three 16-row TMA pieces per page
    (17, 5, 128, 1),      # 68 rows: the two-warpgroup tile; page size 5: rows gathered one by one
    (512, 1, 128, 1),
])
def test_kernel_tile_and_page_pieces_reach_the_primitive(s_q, page_size, tile_m, page_rows):
    # The variant the lowering picks from the call's shape (spec.tile_m_for, page_rows_for): only the
    # bound equation shows it on CPU, where the reference ignores both.
    from fa4_jax.ops.kvcache.primitive import fa4_kvcache_p

    paged = page_size is not None
    q, k, v = make_inputs(43, b=2, s_q=s_q, cache_shape=(6, page_size) if paged else (2, 16), h_q=8, h_k=2)
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32) if paged else None
    jaxpr = jax.make_jaxpr(lambda q, k, v, n: attention_with_kvcache(q, k, v, n, page_table=table))(
        q, k, v, np.array([3, 16], np.int32))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is fa4_kvcache_p]
    assert (eqn.params["tile_m"], eqn.params["page_rows"]) == (tile_m, page_rows), eqn.params


# -- validation ---------------------------------------------------------------------------------

@pytest.fixture
def no_run(monkeypatch):
    """Any bind of the primitive (kernel or reference) fails the test: validation must come first."""
    refuse_to_run(monkeypatch, kvcache, "fa4_kvcache_p", "attention_with_kvcache")


@pytest.mark.parametrize(
    "num_splits,error,message",
    [
        (0, ValueError, r"num_splits must be in \[1, 256\] \(the kernel's maximum; or None: pick at run time\); "
                        r"got num_splits=0"),
        (-1, ValueError, r"num_splits must be in \[1, 256\].*got num_splits=-1"),
        (257, ValueError, r"num_splits must be in \[1, 256\].*got num_splits=257"),
        (True, TypeError, r"num_splits must be None \(pick at run time\) or a Python int >= 1; got num_splits=True"),
        (1.5, TypeError, r"num_splits must be None \(pick at run time\) or a Python int >= 1; got num_splits=1\.5"),
    ],
)
def test_bad_num_splits(num_splits, error, message, no_run):
    q, k, v = make_inputs(41, b=2, s_q=3, cache_shape=(2, 8), h_q=4, h_k=2)
    with pytest.raises(error, match=message):
        attention_with_kvcache(q, k, v, np.array([3, 8], np.int32), num_splits=num_splits)


def _args(*, b=2, h_q=4, h_k=2, d=D, q_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, cache_batch=None,
          seqlens=None, paged=False, page_size=16, page_table=None):
    """Valid (q, k_cache, v_cache, cache_seqlens, page_table) but for whatever the caller overrides."""
    rng = np.random.default_rng(42)
    q = draw(rng, (b, 3, h_q, d), q_dtype)
    lead = (4, page_size) if paged else (b if cache_batch is None else cache_batch, 8)
    k, v = (draw(rng, (*lead, h_k, d), cache_dtype) for _ in range(2))
    seqlens = np.array([3, 5][:b] + [4] * max(0, b - 2), np.int32) if seqlens is None else seqlens
    if paged and page_table is None:
        page_table = np.arange(b * 2, dtype=np.int32).reshape(b, 2) % 4
    return q, k, v, seqlens, page_table


BAD_KVCACHE = {
    "seqlens_int64": (lambda: _args(seqlens=np.array([3, 5], np.int64)), TypeError,
                      r"cache_seqlens must be int32 \(batch,\): valid keys per sequence, new tokens included; "
                      r"got cache_seqlens\.dtype=int64"),
    "seqlens_float32": (lambda: _args(seqlens=np.array([3, 5], np.float32)), TypeError,
                        r"cache_seqlens must be int32 .*got cache_seqlens\.dtype=float32"),
    "seqlens_wrong_length": (lambda: _args(seqlens=np.array([3, 5, 1], np.int32)), ValueError,
                             r"cache_seqlens must have shape \(2,\) \(batch,\).*got cache_seqlens\.shape=\(3,\)"),
    "seqlens_2d": (lambda: _args(seqlens=np.array([[3], [5]], np.int32)), ValueError,
                   r"cache_seqlens must have shape \(2,\).*got cache_seqlens\.shape=\(2, 1\)"),
    "seqlens_list": (lambda: _args(seqlens=[3, 5]), TypeError, r"cache_seqlens must be an int32 array.*got list"),
    "page_table_int64": (lambda: _args(paged=True, page_table=np.zeros((2, 2), np.int64)), TypeError,
                         r"page_table must be int32 \(batch, max_pages\): page ids of each sequence; "
                         r"got page_table\.dtype=int64"),
    "page_table_wrong_batch": (lambda: _args(paged=True, page_table=np.zeros((3, 2), np.int32)), ValueError,
                               r"page_table must have shape \(2, 2\) \(batch, max_pages\).*"
                               r"got page_table\.shape=\(3, 2\)"),
    "page_table_rank1": (lambda: _args(paged=True, page_table=np.zeros(2, np.int32)), ValueError,
                         r"page_table must be int32 \(batch, max_pages\); got \(2,\)"),
    "contiguous_batch_mismatch": (lambda: _args(cache_batch=3), ValueError,
                                  r"a contiguous cache is \(batch, capacity, heads_kv, head_dim\) with q's batch; "
                                  r"got q\.shape=\(2, 3, 4, 64\), k_cache\.shape=\(3, 8, 2, 64\) "
                                  r"\(pass page_table for a paged cache\)"),
    "head_dim_80": (lambda: _args(d=80), ValueError,
                    r"head_dim must be one of \(64, 96, 128, 192, 256\); got head_dim=80 \(q\.shape=\(2, 3, 4, 80\)\)"),
    "dtype_mismatch": (lambda: _args(cache_dtype=jnp.float16), TypeError,
                       r"q, k_cache and v_cache must share one dtype; got q\.dtype=bfloat16, k_cache\.dtype=float16, "
                       r"v_cache\.dtype=float16"),
    "float32": (lambda: _args(q_dtype=np.float32, cache_dtype=np.float32), TypeError,
                r"q must be bfloat16 or float16; got q\.dtype=float32"),
    "heads_not_multiple": (lambda: _args(h_k=3), ValueError,
                           r"query heads must be a multiple of key/value heads \(GQA/MQA\); got heads_q=4, heads_kv=3"),
}


@pytest.mark.parametrize("case", sorted(BAD_KVCACHE))
def test_bad_inputs_rejected_before_running(case, no_run):
    make, error, message = BAD_KVCACHE[case]
    q, k, v, seqlens, table = make()
    with pytest.raises(error, match=message):
        attention_with_kvcache(q, k, v, seqlens, page_table=table)


@pytest.mark.parametrize("window_size", [(-1, 1), (5, 1), (0, 7)])
def test_causal_with_a_right_window_rejected(window_size, no_run):
    # causal=True means no key after the diagonal: a right window of even one key contradicts it.
    q, k, v, seqlens, _ = _args()
    with pytest.raises(ValueError, match=r"causal=True means window_size\[1\] = 0 \(no key after the diagonal\); "
                                         rf"got window_size=\({window_size[0]}, {window_size[1]}\)"):
        attention_with_kvcache(q, k, v, seqlens, causal=True, window_size=window_size)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="checks the CPU message")
def test_implementation_choice(no_run):
    q, k, v, seqlens, _ = _args()
    with pytest.raises(ValueError, match=r'implementation must be None, "fa4", "cudnn" or "xla"; got implementation=\'triton\''):
        attention_with_kvcache(q, k, v, seqlens, implementation="triton")


def test_fa4_on_cpu_raises_when_lowered():
    # "fa4" traces here (the program could be exported for CUDA) but cannot be lowered for this CPU.
    q, k, v, seqlens, _ = _args()
    with pytest.raises(RuntimeError, match=r'implementation="fa4" cannot run here: (the program is lowered for cpu, '
                                           r'not an NVIDIA Hopper GPU|the kernel library)'):
        attention_with_kvcache(q, k, v, seqlens, implementation="fa4")


def test_xla_and_default_agree():
    q, k, v, seqlens, table = _args(paged=True)
    runs = [attention_with_kvcache(q, k, v, seqlens, page_table=table, causal=True, return_lse=True,
                                   implementation=impl) for impl in (None, "xla")]
    np.testing.assert_array_equal(f64(runs[0][0]), f64(runs[1][0]))
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    check_result(*runs[0], q, k, v, seqlens, page_table=table, causal=True)


# -- transformations ----------------------------------------------------------------------------

def test_jit_with_traced_seqlens_page_table_and_sinks():
    page_size, num_pages, max_pages = 16, 12, 4
    q, kp, vp = make_inputs(50, b=3, s_q=4, cache_shape=(num_pages, page_size), h_q=8, h_k=2)
    kwargs = dict(causal=True, window_size=(25, -1), softcap=20.0, return_lse=True)
    f = jax.jit(attention_with_kvcache, static_argnames=STATIC)
    # Two different sets of run-time values through one compiled program: none of them is baked in.
    for seed, seqlens in [(51, [9, 40, 63]), (52, [64, 17, 2])]:
        seqlens = np.array(seqlens, np.int32)
        table = shuffled_page_table(seed, 3, max_pages, num_pages)
        sinks = make_sinks(seed, 8)
        o, lse = f(q, kp, vp, jnp.asarray(seqlens), page_table=jnp.asarray(table), sinks=jnp.asarray(sinks), **kwargs)
        o_eager, lse_eager = attention_with_kvcache(q, kp, vp, seqlens, page_table=table, sinks=sinks, **kwargs)
        np.testing.assert_array_equal(f64(o), f64(o_eager), err_msg=f"{seed=}")
        np.testing.assert_array_equal(lse, lse_eager, err_msg=f"{seed=}")
        check_result(o, lse, q, kp, vp, seqlens, page_table=table, sinks=sinks, causal=True, window_size=(25, -1),
                     softcap=20.0)
    assert f._cache_size() == 1, "cache_seqlens, page_table or sinks was treated as static"


def test_vmap_matches_loop():
    # Paged, so that every array argument (page_table too) carries the mapped axis.
    n, b, h_q, h_k = 2, 3, 4, 2
    rng = np.random.default_rng(60)
    q = draw(rng, (n, b, 4, h_q, D))
    k, v = (draw(rng, (n, 6, 16, h_k, D)) for _ in range(2))
    seqlens = np.array([[0, 13, 32], [4, 29, 1]], np.int32)  # capacity: 2 pages of 16
    sinks = np.stack([make_sinks(61, h_q), make_sinks(62, h_q)])
    tables = np.stack([shuffled_page_table(63, b, 2, 6), shuffled_page_table(64, b, 2, 6)])
    f = lambda q, k, v, lens, table, sinks: attention_with_kvcache(  # noqa: E731
        q, k, v, lens, page_table=table, sinks=sinks, causal=True, window_size=(9, -1), return_lse=True)
    args = (q, k, v, seqlens, tables, sinks)
    o, lse = jax.vmap(f)(*args)
    assert (o.shape, lse.shape) == ((n, b, 4, h_q, D), (n, b, h_q, 4)), f"{o.shape=} {lse.shape=}"
    for i in range(n):
        o_i, lse_i = f(*(x[i] for x in args))
        np.testing.assert_array_equal(f64(o[i]), f64(o_i), err_msg=f"slice {i=}")
        np.testing.assert_array_equal(lse[i], lse_i, err_msg=f"slice {i=}")


# -- update_kvcache -----------------------------------------------------------------------------

def expected_update(cache, new, cache_seqlens, page_table=None):
    """The cache after writing new[b, t] at position cache_seqlens[b] + t of sequence b, by the
    contract's rules, one token at a time. Returns (cache, number of tokens written)."""
    want, written = np.array(cache, copy=True), 0
    for i, n in enumerate(np.asarray(cache_seqlens)):
        for t in range(new.shape[1]):
            pos = int(n) + t
            if pos < 0:
                continue
            if page_table is None:
                row, slot = i, pos
                if pos >= cache.shape[1]:
                    continue
            else:
                page_size = cache.shape[1]
                if pos // page_size >= page_table.shape[1]:
                    continue
                row, slot = int(page_table[i, pos // page_size]), pos % page_size
                if not 0 <= row < cache.shape[0]:
                    continue
            want[row, slot] = new[i, t]
            written += 1
    return want, written


def check_update(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None):
    """update_kvcache against expected_update, bit for bit, k and v alike; returns tokens written."""
    k2, v2 = update_kvcache(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=page_table)
    written = None
    for name, got, cache, new in (("k", k2, k_cache, k_new), ("v", v2, v_cache, v_new)):
        want, written = expected_update(cache, new, cache_seqlens, page_table)
        assert (got.shape, got.dtype) == (cache.shape, cache.dtype), f"{name}: {got.shape=} {got.dtype=}"
        np.testing.assert_array_equal(f64(got), f64(want), err_msg=f"{name}_cache")
    return written


def _update_inputs(seed, cache_shape, b, s_new, h_k=2):
    rng = np.random.default_rng(seed)
    k, v = (draw(rng, (*cache_shape, h_k, D)) for _ in range(2))
    k_new, v_new = (draw(rng, (b, s_new, h_k, D)) for _ in range(2))
    return k, v, k_new, v_new


def test_update_contiguous():
    k, v, k_new, v_new = _update_inputs(70, (3, 20), 3, 4)
    seqlens = np.array([0, 9, 16], np.int32)  # the last write ends on the last slot
    assert check_update(k, v, k_new, v_new, seqlens) == 12


def test_update_paged():
    table = shuffled_page_table(71, 3, 3, 10, share=False)  # two sequences writing one slot would race
    k, v, k_new, v_new = _update_inputs(72, (10, 16), 3, 4)
    # Sequence 0 writes inside a page, 1 and 2 across a page boundary.
    seqlens = np.array([5, 14, 30], np.int32)
    assert check_update(k, v, k_new, v_new, seqlens, table) == 12


@pytest.mark.parametrize("page_size", [32, 64, 128, 256])
def test_update_paged_page_sizes(page_size):
    # The page size is the pool's axis 1, whatever it is: a writer that assumed 16 would put tokens
    # into the wrong page and slot here.
    table = shuffled_page_table(74 + page_size, 3, 2, 7, share=False)
    k, v, k_new, v_new = _update_inputs(75, (7, page_size), 3, 5)
    # Inside the first page, across the page boundary, and past the last page (the last 2 dropped).
    seqlens = np.array([3, page_size - 2, 2 * page_size - 3], np.int32)
    assert check_update(k, v, k_new, v_new, seqlens, table) == 13


# Each case drops some tokens and writes others: a dropped write that wraps (a negative index) or
# clamps onto a real slot changes the cache where it must stay unchanged.
OUT_OF_RANGE = {
    "past_capacity": (None, [17, 20, 35], 3),
    "negative_seqlens": (None, [-2, -9, 4], 6),
    "past_max_pages": ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [46, 48, 3], 6),
    "paged_negative_seqlens": ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [-3, -40, 0], 5),
    "page_id_minus_one": ([[0, -1, 2], [3, 4, -1], [6, 7, 8]], [14, 30, 0], 8),
    "page_id_too_large": ([[0, 10, 2], [3, 4, 123], [6, 7, 8]], [14, 30, 0], 8),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_update_drops_positions_outside_the_cache(case):
    table, seqlens, n_written = OUT_OF_RANGE[case]
    table = None if table is None else np.array(table, np.int32)
    k, v, k_new, v_new = _update_inputs(73 + len(case), (3, 20) if table is None else (10, 16), 3, 4)
    assert check_update(k, v, k_new, v_new, np.array(seqlens, np.int32), table) == n_written


@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=["contiguous", "paged16", "paged64", "paged256"])
def test_update_then_attend_equals_dense_attention(page_size):
    # Speculative decode: append 3 tokens, then let those 3 queries attend causally to everything.
    b, s_new, h_q, h_k = 3, 3, 8, 2
    paged = page_size is not None
    ps = page_size or 16
    seqlens = np.array([0, ps - 3, 2 * ps - 3], np.int32)  # the last two write across a page boundary
    table = shuffled_page_table(80, b, 3, 10, share=False) if paged else None
    k, v, k_new, v_new = _update_inputs(81 + paged, (10, ps) if paged else (b, 48), b, s_new, h_k)
    q = draw(np.random.default_rng(83), (b, s_new, h_q, D))
    sinks = make_sinks(84, h_q)

    k2, v2 = update_kvcache(k, v, k_new, v_new, seqlens, page_table=table)
    o, lse = attention_with_kvcache(q, k2, v2, seqlens + s_new, page_table=table, causal=True, sinks=sinks,
                                    return_lse=True)

    k_old, v_old = (gather(x, table) if paged else x for x in (k, v))
    for i, n in enumerate(seqlens):
        keys = np.concatenate([k_old[i, :n], k_new[i]])[None]
        values = np.concatenate([v_old[i, :n], v_new[i]])[None]
        o_want, lse_want = attention_oracle(q[i:i + 1], keys, values, softmax_scale=SCALE, causal=True, sinks=sinks,
                                            xp=np)
        np.testing.assert_allclose(f64(o[i:i + 1]), o_want, rtol=1.01 * 2.0**-8, atol=F32_ATOL, err_msg=f"{i=}")
        np.testing.assert_allclose(f64(lse[i:i + 1]), lse_want, rtol=0, atol=LSE_ATOL, err_msg=f"{i=}")


def test_update_with_donated_caches_is_in_place():
    # float16: XLA:CPU converts bf16 scatters through float32, which needs a copy whatever is donated
    # (tests/test_gpu_kvcache.py checks bf16 on the GPU).
    shape = (2, 256, 2, D)
    rng = np.random.default_rng(90)
    k_np, v_np = (draw(rng, shape, np.float16) for _ in range(2))
    k_new, v_new = (jnp.asarray(draw(rng, (2, 3, 2, D), np.float16)) for _ in range(2))
    seqlens = jnp.array([5, 254], jnp.int32)  # the second one runs a token past the capacity
    cache_bytes = 2 * k_np.nbytes
    copy = re.compile(r"f16\[2,256,2,64\]\{[0-9,]*\} copy\(")

    donated = jax.jit(update_kvcache, donate_argnums=(0, 1))
    k, v = jnp.asarray(k_np), jnp.asarray(v_np)
    compiled = donated.lower(k, v, k_new, v_new, seqlens).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == cache_bytes
    assert not copy.findall(compiled.as_text()), "the donated caches are copied"

    # The same checks on the undonated program must fail, or they would not tell the two apart.
    plain = jax.jit(update_kvcache).lower(k, v, k_new, v_new, seqlens).compile()
    assert plain.memory_analysis().alias_size_in_bytes == 0
    assert copy.findall(plain.as_text())

    k2, v2 = donated(k, v, k_new, v_new, seqlens)
    for got, cache, new in ((k2, k_np, k_new), (v2, v_np, v_new)):
        want, written = expected_update(cache, np.asarray(new), np.asarray(seqlens))
        assert written == 5
        np.testing.assert_array_equal(f64(got), f64(want))


def _bad_update(*, new_heads=2, new_dtype=jnp.bfloat16, v_new_len=3, v_dtype=None, seqlens=None):
    rng = np.random.default_rng(91)
    k, v = (draw(rng, (2, 8, 2, D)) for _ in range(2))
    k_new = draw(rng, (2, 3, new_heads, D), new_dtype)
    v_new = draw(rng, (2, v_new_len, new_heads, D), v_dtype or new_dtype)
    return k, v, k_new, v_new, np.array([1, 2], np.int32) if seqlens is None else seqlens


def _k_new_message(k_new):
    """The message for a k_new (regex of its shape and dtype) that does not fit the (2, 8, 2, 64) cache."""
    return (r"k_new must be \(batch, seqlen_new, heads_kv, head_dim\) with the cache's heads and dtype; "
            rf"got k_new {k_new}, k_cache \(2, 8, 2, 64\) bfloat16")


def _v_new_message(v_new):
    """The message for a v_new (regex of its shape and dtype) unlike the (2, 3, 2, 64) bfloat16 k_new."""
    return rf"k_new and v_new must have the same shape and dtype; got k_new \(2, 3, 2, 64\) bfloat16, v_new {v_new}"


BAD_UPDATES = {
    # The kv heads must match the cache's; the message must be about k_new (there is no q here).
    "k_new_more_heads": (lambda: _bad_update(new_heads=4), ValueError, _k_new_message(r"\(2, 3, 4, 64\) bfloat16")),
    "k_new_fewer_heads": (lambda: _bad_update(new_heads=1), ValueError, _k_new_message(r"\(2, 3, 1, 64\) bfloat16")),
    "k_new_dtype": (lambda: _bad_update(new_dtype=jnp.float16), ValueError,
                    _k_new_message(r"\(2, 3, 2, 64\) float16")),
    "v_new_shape": (lambda: _bad_update(v_new_len=2), ValueError, _v_new_message(r"\(2, 2, 2, 64\) bfloat16")),
    "v_new_dtype": (lambda: _bad_update(v_dtype=jnp.float16), ValueError, _v_new_message(r"\(2, 3, 2, 64\) float16")),
    "seqlens_int64": (lambda: _bad_update(seqlens=np.array([1, 2], np.int64)), TypeError,
                      r"cache_seqlens must be int32 \(batch,\).*got cache_seqlens\.dtype=int64"),
    "seqlens_float32": (lambda: _bad_update(seqlens=np.array([1, 2], np.float32)), TypeError,
                        r"cache_seqlens must be int32 \(batch,\).*got cache_seqlens\.dtype=float32"),
}


@pytest.mark.parametrize("case", sorted(BAD_UPDATES))
def test_update_rejects_bad_inputs(case):
    make, error, message = BAD_UPDATES[case]
    with pytest.raises(error, match=message):
        update_kvcache(*make())


# -- update_kvcache, ragged (cu_seqlens_new): a continuous-batching step's writes in one scatter -------


def expected_ragged_update(cache, new, cache_seqlens, cu, page_table=None):
    """The cache after writing new[cu[b] + t] at position cache_seqlens[b] + t of sequence b, one token
    at a time by the contract's rules (rows past cu[-1] belong to no sequence). Returns (cache, written)."""
    want, written = np.array(cache, copy=True), 0
    for i, n in enumerate(np.asarray(cache_seqlens)):
        for t in range(int(cu[i + 1] - cu[i])):
            pos = int(n) + t
            if page_table is None:
                if not 0 <= pos < cache.shape[1]:
                    continue
                row, slot = i, pos
            else:
                page_size = cache.shape[1]
                if pos < 0 or pos // page_size >= page_table.shape[1]:
                    continue
                row, slot = int(page_table[i, pos // page_size]), pos % page_size
                if not 0 <= row < cache.shape[0]:
                    continue
            want[row, slot] = new[int(cu[i]) + t]
            written += 1
    return want, written


def check_ragged_update(k, v, k_new, v_new, seqlens, cu, table=None):
    k2, v2 = update_kvcache(k, v, k_new, v_new, seqlens, cu_seqlens_new=cu, page_table=table)
    written = None
    for name, got, cache, new in (("k", k2, k, k_new), ("v", v2, v, v_new)):
        want, written = expected_ragged_update(cache, new, seqlens, cu, table)
        assert (got.shape, got.dtype) == (cache.shape, cache.dtype), f"{name}: {got.shape=} {got.dtype=}"
        np.testing.assert_array_equal(f64(got), f64(want), err_msg=f"{name}_cache")
    return written


# (lengths before, tokens per sequence): a 7-token prefill chunk, one-token decodes, an empty sequence.
RAGGED_STEP = (np.array([0, 9, 30, 4, 17], np.int32), np.array([7, 1, 1, 0, 3]))


@pytest.mark.parametrize("page_size", [None, 1, 5, 16, 100], ids=["contiguous", "page1", "page5", "page16", "page100"])
def test_update_ragged(page_size):
    seqlens, counts = RAGGED_STEP
    b, h_k = len(seqlens), 2
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    total = int(cu[-1]) + 2  # two trailing rows that belong to no sequence: never written
    rng = np.random.default_rng(95 + (page_size or 0))
    if page_size is None:
        k, v = (draw(rng, (b, 40, h_k, D)) for _ in range(2))
        table = None
    else:
        max_pages = -(-40 // page_size)
        table = shuffled_page_table(96, b, max_pages, b * max_pages + 3, share=False)
        k, v = (draw(rng, (b * max_pages + 3, page_size, h_k, D)) for _ in range(2))
    k_new, v_new = (draw(rng, (total, h_k, D)) for _ in range(2))
    assert check_ragged_update(k, v, k_new, v_new, seqlens, cu, table) == int(cu[-1])


def test_update_ragged_drops_positions_outside_the_cache():
    # Sequence 0 runs 3 tokens past the capacity, sequence 1 starts at a negative length.
    rng = np.random.default_rng(97)
    k, v = (draw(rng, (2, 12, 2, D)) for _ in range(2))
    k_new, v_new = (draw(rng, (6, 2, D)) for _ in range(2))
    cu = np.array([0, 4, 6], np.int32)
    assert check_ragged_update(k, v, k_new, v_new, np.array([11, -1], np.int32), cu) == 2


def test_update_ragged_equals_the_padded_update():
    # The same tokens written by the (batch, seqlen_new) form, one sequence at a time, give the same cache.
    seqlens, counts = RAGGED_STEP
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rng = np.random.default_rng(98)
    k, v = (draw(rng, (5, 40, 2, D)) for _ in range(2))
    k_new, v_new = (draw(rng, (int(cu[-1]), 2, D)) for _ in range(2))
    k2, v2 = update_kvcache(k, v, k_new, v_new, seqlens, cu_seqlens_new=cu)
    k3, v3 = jnp.asarray(k), jnp.asarray(v)
    for i in range(5):
        if counts[i]:
            one = np.zeros(5, bool)
            one[i] = True
            # Other rows write past the capacity (dropped), so only sequence i changes.
            lens = np.where(one, seqlens, 10**6).astype(np.int32)
            kn = np.broadcast_to(k_new[cu[i]:cu[i + 1]][None], (5, counts[i], 2, D))
            vn = np.broadcast_to(v_new[cu[i]:cu[i + 1]][None], (5, counts[i], 2, D))
            k3, v3 = update_kvcache(k3, v3, kn, vn, lens)
    np.testing.assert_array_equal(f64(k2), f64(k3))
    np.testing.assert_array_equal(f64(v2), f64(v3))


def test_update_ragged_with_donated_caches_is_in_place():
    shape = (2, 256, 2, D)
    rng = np.random.default_rng(99)
    k_np, v_np = (draw(rng, shape, np.float16) for _ in range(2))
    k_new, v_new = (jnp.asarray(draw(rng, (5, 2, D), np.float16)) for _ in range(2))
    seqlens, cu = jnp.array([5, 254], jnp.int32), jnp.array([0, 2, 5], jnp.int32)  # the second runs 1 past
    copy = re.compile(r"f16\[2,256,2,64\]\{[0-9,]*\} copy\(")
    fn = lambda k, v, kn, vn, lens, cu: update_kvcache(k, v, kn, vn, lens, cu_seqlens_new=cu)  # noqa: E731
    k, v = jnp.asarray(k_np), jnp.asarray(v_np)
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(k, v, k_new, v_new, seqlens, cu).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == 2 * k_np.nbytes
    assert not copy.findall(compiled.as_text()), "the donated caches are copied"
    k2, v2 = compiled(k, v, k_new, v_new, seqlens, cu)
    for got, cache, new in ((k2, k_np, k_new), (v2, v_np, v_new)):
        want, written = expected_ragged_update(cache, np.asarray(new), np.asarray(seqlens), np.asarray(cu))
        assert written == 4
        np.testing.assert_array_equal(f64(got), f64(want))


BAD_RAGGED_UPDATES = {
    "cu_length": (dict(cu=np.array([0, 2], np.int32)), ValueError,
                  r"cu_seqlens_new must have shape \(3,\) \(batch \+ 1,\)"),
    "cu_int64": (dict(cu=np.array([0, 2, 3], np.int64)), TypeError, r"cu_seqlens_new must be int32"),
    "new_rank_4": (dict(new_shape=(1, 3, 2, D)), ValueError, r"k_new must have rank 3"),
    "new_heads": (dict(new_shape=(3, 4, D)), ValueError,
                  r"k_new must be \(total_new, heads_kv, head_dim\) with the cache's heads and dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD_RAGGED_UPDATES))
def test_update_ragged_rejects_bad_inputs(case):
    kw, error, message = BAD_RAGGED_UPDATES[case]
    rng = np.random.default_rng(100)
    k, v = (draw(rng, (2, 8, 2, D)) for _ in range(2))
    new = draw(rng, kw.get("new_shape", (3, 2, D)))
    cu = kw.get("cu", np.array([0, 2, 3], np.int32))
    with pytest.raises(error, match=message):
        update_kvcache(k, v, new, new, np.array([1, 2], np.int32), cu_seqlens_new=cu)


# -- attention_with_kvcache, ragged (cu_seqlens_q): prefill chunks and decodes against the cache -------


def _ragged_case(seed, page_size, *, h_q=8, h_k=2, lens=(23, 1, 40, 0, 17), counts=(5, 1, 1, 0, 17)):
    """Caches holding `lens` keys per sequence (the last `counts` of them the queries' own), poisoned
    with NaN past each length (and in every page no sequence owns): packed q with two trailing rows that
    belong to no sequence."""
    rng = np.random.default_rng(seed)
    b, cap = len(lens), 48
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q = draw(rng, (int(cu[-1]) + 2, h_q, D))
    dense_k, dense_v = (draw(rng, (b, cap, h_k, D)) for _ in range(2))
    for x in (dense_k, dense_v):
        for i, n in enumerate(lens):
            x[i, n:] = np.nan
    if page_size is None:
        return q, dense_k, dense_v, np.array(lens, np.int32), cu, None, dense_k, dense_v
    max_pages = -(-cap // page_size)
    num_pages = b * max_pages + 3
    table = shuffled_page_table(seed + 1, b, max_pages, num_pages, share=False)
    k, v = (np.full((num_pages, page_size, h_k, D), np.nan, dense_k.dtype) for _ in range(2))
    for i in range(b):
        for p in range(max_pages):
            rows = dense_k[i, p * page_size:(p + 1) * page_size]
            k[table[i, p], :len(rows)] = rows
            v[table[i, p], :len(rows)] = dense_v[i, p * page_size:(p + 1) * page_size]
    return q, k, v, np.array(lens, np.int32), cu, table, dense_k, dense_v


@pytest.mark.parametrize("options", ["causal", "everything", "window_two_sided"])
@pytest.mark.parametrize("page_size", [None, 1, 5, 16], ids=["contiguous", "page1", "page5", "page16"])
def test_ragged_matches_oracle_per_sequence(page_size, options):
    opts = dict(OPTION_CASES[options])
    q, k, v, lens, cu, table, dense_k, dense_v = _ragged_case(110 + (page_size or 0), page_size)
    o, lse = attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, page_table=table, return_lse=True, **opts)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]), (o.shape, lse.shape)
    assert np.isfinite(f64(o)).all(), "a NaN past a length or in an unowned page reached a row"
    for i, n in enumerate(lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if rows.start == rows.stop:
            continue
        o_want, lse_want = attention_oracle(q[None, rows], dense_k[i:i + 1, :n], dense_v[i:i + 1, :n],
                                            softmax_scale=SCALE, xp=np, **opts)
        np.testing.assert_allclose(f64(o[rows]), o_want[0], rtol=1.01 * 2.0**-8, atol=F32_ATOL, err_msg=f"{i=}")
        np.testing.assert_allclose(f64(lse[:, rows]), lse_want[0], rtol=0, atol=LSE_ATOL, err_msg=f"{i=}")
    # Rows past cu_seqlens_q[-1] belong to no sequence.
    np.testing.assert_array_equal(f64(o[int(cu[-1]):]), 0.0)


def test_ragged_equals_the_padded_call():
    # One sequence at a time through the (batch, seqlen_q) form gives the same numbers (the same kernel
    # or reference arithmetic on the same keys).
    q, k, v, lens, cu, _, _, _ = _ragged_case(120, None)
    o = attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, causal=True, implementation="xla")
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if rows.start == rows.stop:
            continue
        want = attention_with_kvcache(q[None, rows], k[i:i + 1], v[i:i + 1], lens[i:i + 1], causal=True,
                                      implementation="xla")
        np.testing.assert_allclose(f64(o[rows]), f64(want[0]), rtol=1.01 * 2.0**-8, atol=F32_ATOL, err_msg=f"{i=}")


BAD_RAGGED_CALLS = {
    "cu_length": (dict(cu=np.array([0, 1], np.int32)), ValueError, r"cu_seqlens_q must have shape \(6,\)"),
    "q_rank_4": (dict(q_shape=(1, 3, 8, D)), ValueError, r"q must have rank 3"),
    "hint_without_cu": (dict(cu=None, max_seqlen_q=4), ValueError, r"max_seqlen_q is a hint for a ragged batch"),
    "num_splits_bad": (dict(num_splits=0), ValueError, r"num_splits"),
    "hint_zero": (dict(max_seqlen_q=0), ValueError, r"max_seqlen_q bounds every sequence's queries: None or a static "
                                                    r"int >= 1; got max_seqlen_q=0"),
    "hint_traced_like": (dict(max_seqlen_q=2.5), ValueError, r"got max_seqlen_q=2\.5"),
}


@pytest.mark.parametrize("case", sorted(BAD_RAGGED_CALLS))
def test_ragged_rejects_bad_inputs(case):
    kw, error, message = BAD_RAGGED_CALLS[case]
    kw = dict(kw)
    q, k, v, lens, cu, _, _, _ = _ragged_case(121, None)
    if "q_shape" in kw:
        q = draw(np.random.default_rng(122), kw.pop("q_shape"))
    cu = kw.pop("cu", cu)
    with pytest.raises(error, match=message):
        attention_with_kvcache(q if cu is not None or "max_seqlen_q" not in kw else q[None], k, v, lens,
                               cu_seqlens_q=cu, **kw)
