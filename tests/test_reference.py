"""fa4_jax.attention_reference against the shared float64 oracle (tests/oracle.py).

The reference computes scores, softmax and P @ V in float32 and rounds only the output, so its
error against the exact result is one rounding of the output (unit roundoff u of the dtype, times
|o|) plus float32 noise. The tolerances below are exactly that: a masking, GQA-mapping, softcap,
sink or normalisation bug moves outputs by O(0.1), far outside them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax.core.reference as reference
from fa4_jax import attention_reference
from oracle import F32_ATOL, LSE_ATOL, UNIT_ROUNDOFF, attention_oracle, check_empty_result, make_sinks, visible_mask


def make_qkv(seed, *, b=2, s_q=33, s_k=33, h_q=4, h_k=2, d=64, dtype=jnp.bfloat16, scale=1.0):
    rng = np.random.default_rng(seed)
    # NumPy arrays of the target dtype (ml_dtypes for bf16): no per-shape XLA conversion to compile.
    draw = lambda s, h: (scale * rng.standard_normal((b, s, h, d), dtype=np.float32)).astype(dtype)
    return draw(s_q, h_q), draw(s_k, h_k), draw(s_k, h_k)



def f64(x):
    return np.asarray(x, np.float64)


def check_against_oracle(q, k, v, *, softmax_scale, query_chunk=None, **kwargs):
    """attention_reference(q, k, v, ...) checked by check_result; returns (o, lse) as float64."""
    o, lse = attention_reference(q, k, v, softmax_scale=softmax_scale, query_chunk=query_chunk, **kwargs)
    return check_result(o, lse, q, k, v, softmax_scale=softmax_scale, **kwargs)


def check_result(o, lse, q, k, v, *, softmax_scale, **kwargs):
    """Compares (o, lse) with the float64 oracle; also checks rows that see no key exactly (o = 0
    and lse = -inf, or lse = the sink logit). Returns (o, lse) as float64 NumPy arrays."""
    o_want, lse_want = attention_oracle(q, k, v, softmax_scale=softmax_scale, xp=np, **kwargs)

    assert o.shape == q.shape and o.dtype == q.dtype, f"{o.shape=} {o.dtype=}"
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32, f"{lse.shape=} {lse.dtype=}"
    o, lse = f64(o), f64(lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()

    u = UNIT_ROUNDOFF[q.dtype.type]
    np.testing.assert_allclose(o, o_want, rtol=1.01 * u, atol=F32_ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
    finite = np.isfinite(lse_want)
    np.testing.assert_allclose(lse[finite], lse_want[finite], rtol=0, atol=LSE_ATOL)

    # Rows with no visible key are defined exactly, not to a tolerance: the kernel's contract.
    window, causal = kwargs.get("window_size", (-1, -1)), kwargs.get("causal", False)
    empty = ~visible_mask(q.shape[1], k.shape[1], window, causal).any(1)
    assert np.all(o[:, empty] == 0.0), "rows that see no key must give o = 0 exactly"
    sinks = kwargs.get("sinks")
    want_empty = -np.inf if sinks is None else np.float32(sinks).astype(np.float64)[None, :, None]
    np.testing.assert_array_equal(lse[:, :, empty], np.broadcast_to(want_empty, lse[:, :, empty].shape))
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


@pytest.mark.parametrize("h_q,h_k", [(4, 4), (4, 2), (8, 2), (8, 1), (6, 3)])
def test_gqa_head_mapping(h_q, h_k):
    q, k, v = make_qkv(7 * h_q + h_k, s_q=17, s_k=23, h_q=h_q, h_k=h_k)
    check_against_oracle(q, k, v, causal=False, softmax_scale=0.125)


@pytest.mark.parametrize("h_q,h_k", [(8, 2), (8, 1)])
def test_gqa_with_window_and_sinks(h_q, h_k):
    # Sinks are per *query* head: a mix-up with the KV-head grouping moves a whole head's output.
    q, k, v = make_qkv(9 * h_q + h_k, s_q=29, s_k=41, h_q=h_q, h_k=h_k)
    check_against_oracle(q, k, v, window_size=(9, 4), sinks=make_sinks(h_q + h_k, h_q), softmax_scale=0.125)


@pytest.mark.parametrize(
    "s_q,s_k",
    [(1, 1), (1, 129), (7, 129), (129, 7), (129, 1), (33, 65)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(s_q, s_k, causal):
    q, k, v = make_qkv(1000 + 7 * s_q + s_k + causal, s_q=s_q, s_k=s_k)
    check_against_oracle(q, k, v, causal=causal, softmax_scale=0.125)


# Windows relative to the bottom-right diagonal; causal=True folds into right = 0.
WINDOWS = {
    "left_only": dict(window_size=(8, -1)),
    "right_only": dict(window_size=(-1, 8)),
    "two_sided": dict(window_size=(5, 3)),
    "diagonal_only": dict(window_size=(0, 0)),
    "causal_left": dict(causal=True, window_size=(6, -1)),
}


@pytest.mark.parametrize("s_q,s_k", [(37, 129), (129, 37)])
@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_windows(case, s_q, s_k):
    kwargs = WINDOWS[case]
    q, k, v = make_qkv(2000 + 3 * s_q + s_k + len(case), s_q=s_q, s_k=s_k)
    check_against_oracle(q, k, v, softmax_scale=0.125, **kwargs)


def test_window_bounds_that_cover_every_key():
    # left = s_k - 1 (right = s_q - 1) is the smallest bound that reaches key 0 (key s_k - 1) from
    # every row: it must hide nothing, and one less must hide something. The API trims such
    # bounds to -1 (fa4_jax.attention._trim_window) on exactly this premise.
    s_q, s_k = 37, 50
    q, k, v = make_qkv(2500, s_q=s_q, s_k=s_k)
    o_full, lse_full = (f64(x) for x in attention_reference(q, k, v, softmax_scale=0.125))
    for window in [(s_k - 1, -1), (-1, s_q - 1)]:
        o, lse = (f64(x) for x in attention_reference(q, k, v, softmax_scale=0.125, window_size=window))
        np.testing.assert_array_equal(o, o_full, err_msg=f"{window=}")
        np.testing.assert_array_equal(lse, lse_full, err_msg=f"{window=}")
    for window in [(s_k - 2, -1), (-1, s_q - 2)]:
        o, _ = check_against_oracle(q, k, v, softmax_scale=0.125, window_size=window)
        assert np.abs(o - o_full).max() > 1e-3, f"{window=} should hide a key from some row"


@pytest.mark.parametrize("softcap", [5.0])
def test_softcap(softcap):
    # Inputs scaled so raw scores reach ~±30: the cap changes them substantially.
    q, k, v = make_qkv(3100 + int(softcap), s_q=37, s_k=45, scale=3.0)
    o, lse = check_against_oracle(q, k, v, causal=True, softcap=softcap, softmax_scale=0.125)
    o_uncapped, _ = attention_oracle(q, k, v, causal=True, softmax_scale=0.125, xp=np)
    assert np.abs(o - o_uncapped).max() > 0.05, "softcap had no visible effect; the test is not sensitive"
    # tanh caps every score at softcap, so lse <= softcap + log(number of visible keys).
    assert np.all(lse <= softcap + np.log(45) + LSE_ATOL), f"{lse.max()=}"


def test_sinks():
    h_q = 4
    sinks = make_sinks(3200, h_q)
    sinks[1] = 40.0  # a sink that dominates every score: o ~ 0 and lse ~ 40 for that head
    q, k, v = make_qkv(3201, s_q=37, s_k=45, h_q=h_q)
    o, lse = check_against_oracle(q, k, v, causal=True, sinks=sinks, softmax_scale=0.125)
    assert np.abs(o[:, :, 1]).max() < 1e-6 and np.allclose(lse[:, 1], 40.0, atol=1e-5)
    o_plain, lse_plain = attention_oracle(q, k, v, causal=True, softmax_scale=0.125, xp=np)
    assert np.all(lse > lse_plain), "a sink adds mass to every row's denominator"
    assert np.abs(o - o_plain)[:, :, [0, 2, 3]].max() > 0.01


def test_negative_infinite_sink_is_no_sink():
    # The kernel is always given a sinks operand, -inf standing for "none": the two must agree bitwise.
    q, k, v = make_qkv(3300, s_q=40, s_k=9)
    no_sink = attention_reference(q, k, v, causal=True, softmax_scale=0.125)
    inf_sink = attention_reference(q, k, v, causal=True, softmax_scale=0.125, sinks=np.full(4, -np.inf, np.float32))
    np.testing.assert_array_equal(f64(inf_sink[0]), f64(no_sink[0]))
    np.testing.assert_array_equal(inf_sink[1], no_sink[1])


@pytest.mark.parametrize("dtype,s_q,s_k", [(jnp.bfloat16, 37, 129), (jnp.float16, 129, 37)])
def test_all_features_combined(dtype, s_q, s_k):
    q, k, v = make_qkv(3400 + s_q + (dtype == jnp.float16), s_q=s_q, s_k=s_k, h_q=8, h_k=2, dtype=dtype, scale=2.0)
    check_against_oracle(q, k, v, causal=True, window_size=(11, -1), softcap=8.0, sinks=make_sinks(s_k, 8),
                         softmax_scale=0.1, query_chunk=16)


@pytest.mark.parametrize(
    "s_q,s_k,kwargs,with_sinks",
    [
        (40, 9, dict(causal=True), False),
        (40, 9, dict(causal=True), True),
        (40, 9, dict(window_size=(3, 2)), True),  # rows whose window ends before key 0
        (40, 9, dict(window_size=(0, 0)), True),
    ],
)
def test_rows_without_visible_keys(s_q, s_k, kwargs, with_sinks):
    # (test_windows meets empty rows too; check_result checks them wherever they occur.)
    q, k, v = make_qkv(5 + s_q + len(kwargs), s_q=s_q, s_k=s_k)
    sinks = make_sinks(s_q, 4) if with_sinks else None
    # check_against_oracle asserts o == 0 and lse == -inf / sink exactly on the empty rows.
    o, lse = check_against_oracle(q, k, v, softmax_scale=0.125, sinks=sinks, **kwargs)
    empty = ~visible_mask(s_q, s_k, kwargs.get("window_size", (-1, -1)), kwargs.get("causal", False)).any(1)
    assert empty.any() and not empty.all(), f"{empty.sum()=}: the case should mix empty and non-empty rows"
    assert np.all(np.isfinite(lse[:, :, ~empty])) and np.all(np.abs(o[:, ~empty]).sum(-1) > 0)


@pytest.mark.parametrize("b,s_q,s_k", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_zero_size(b, s_q, s_k, with_sinks):
    # Empty batch/queries give empty outputs; no keys means every row sees nothing (o = 0, lse =
    # -inf or the sink), as jax.nn.dot_product_attention does.
    q, k, v = make_qkv(6, b=b, s_q=s_q, s_k=s_k)
    sinks = make_sinks(7, 4) if with_sinks else None
    o, lse = attention_reference(q, k, v, causal=True, softmax_scale=0.125, sinks=sinks)
    check_empty_result(o, lse, b=b, s_q=s_q, h_q=4, d=64, dtype=jnp.bfloat16, sinks=sinks)


def test_causal_decode_sees_every_key():
    # With one query row and bottom-right alignment the causal mask hides nothing.
    q, k, v = make_qkv(11, s_q=1, s_k=77)
    full = attention_reference(q, k, v, causal=False, softmax_scale=0.125)
    masked = attention_reference(q, k, v, causal=True, softmax_scale=0.125)
    np.testing.assert_array_equal(f64(full[0]), f64(masked[0]))
    np.testing.assert_array_equal(full[1], masked[1])


def test_large_scores_are_stable():
    # Scores of magnitude ~ hundreds: a softmax without max-subtraction overflows float32 exp.
    q, k, v = make_qkv(12, s_q=31, s_k=45, scale=3.0)
    check_against_oracle(q, k, v, causal=True, softmax_scale=1.0)
    # A sink far above every score must not overflow either (it joins the running max).
    check_against_oracle(q, k, v, causal=True, softmax_scale=1.0, sinks=np.array([300, -300, 0, 80], np.float32))


@pytest.mark.parametrize(
    "chunk,s_q,s_k,kwargs",
    [
        (1, 40, 129, dict(causal=True)),
        (16, 129, 129, dict(causal=True)),
        (16, 129, 40, dict(causal=True)),
        (50, 129, 40, dict(causal=True)),
        (50, 40, 129, dict(causal=True)),
        # The window is placed from each chunk's first global row (row0): an offset bug shifts it.
        (16, 129, 40, dict(window_size=(5, 3), sinks=make_sinks(8, 4))),
        (7, 37, 129, dict(window_size=(20, 0), softcap=5.0)),
    ],
)
def test_query_chunks(chunk, s_q, s_k, kwargs):
    q, k, v = make_qkv(3000 + chunk + s_q + 2 * s_k, s_q=s_q, s_k=s_k, h_q=4, h_k=1)
    check_against_oracle(q, k, v, softmax_scale=0.125, query_chunk=chunk, **kwargs)


@pytest.mark.parametrize("s_q,s_k", [(129, 37)])
def test_query_chunk_does_not_change_the_result(s_q, s_k):
    # Each query row is computed independently of the others, so a small forced chunk (with a
    # padded last chunk: 129 = 8 * 16 + 1) must give the unchunked result up to float32 summation
    # order: XLA:CPU picks the order of a row sum by the array's total size, so bits may differ
    # (seen: |d lse| ~ 2 float32 ulps, o one bf16 rounding flip). A wrong chunk offset or mask row
    # moves results by orders of magnitude more.
    q, k, v = make_qkv(3500 + s_q, s_q=s_q, s_k=s_k, h_q=8, h_k=2)
    kwargs = dict(softmax_scale=0.125, window_size=(13, 2), softcap=10.0, sinks=make_sinks(3501, 8))
    assert reference.auto_chunk(2, s_q, 8, s_k) == 0, "the default must be the unchunked path here"
    o, lse = attention_reference(q, k, v, **kwargs)
    o16, lse16 = attention_reference(q, k, v, query_chunk=16, **kwargs)
    mag = np.maximum(np.maximum(np.abs(f64(o)), np.abs(f64(o16))), 2.0**-126)
    ulp_o = 2.0 ** (np.floor(np.log2(mag)) - 7)  # bf16: 8 significant bits
    # + 1e-6: a row whose output cancels to ~1e-6 keeps float32 accumulation noise (~1e-7 * |v|).
    assert (np.abs(f64(o16) - f64(o)) <= ulp_o + 1e-6).all(), "chunking moved o by more than one bf16 ulp"
    np.testing.assert_allclose(lse16, lse, rtol=8 * 2.0**-24, atol=1e-6)


def test_automatic_chunking(monkeypatch):
    # Shrink the budget so a small problem takes the chunked path the default would take at scale.
    b, h_q, s_k = 2, 4, 96
    monkeypatch.setattr(reference, "SCORE_BUDGET", b * h_q * s_k * 8)
    assert reference.auto_chunk(b, 70, h_q, s_k) == 8
    q, k, v = make_qkv(21, b=b, s_q=70, s_k=s_k, h_q=h_q, h_k=2)
    jaxpr = str(jax.make_jaxpr(lambda *a: attention_reference(*a, causal=True, softmax_scale=0.1))(q, k, v))
    assert "scan" in jaxpr or "while" in jaxpr, "expected lax.map over query chunks"
    check_against_oracle(q, k, v, causal=True, softmax_scale=0.1)


def test_auto_chunk_default_budget():
    # A 32k x 32k, 32-head prefill must not ask for one 128 GiB score tile ...
    rows = reference.auto_chunk(1, 32768, 32, 32768)
    assert rows == 64 and rows * 32 * 32768 <= reference.SCORE_BUDGET, f"{rows=}"
    # ... the batch counts too ...
    assert reference.auto_chunk(4, 32768, 32, 32768) == 16
    # ... while anything that fits runs as one block (no sequential loop), and 1-row budgets still work.
    assert reference.auto_chunk(1, 4096, 4, 4096) == 0
    assert reference.auto_chunk(1, 10, 1, reference.SCORE_BUDGET * 3) == 1


def test_auto_chunk_symbolic_dims():
    # Under shape-polymorphic export the sizes are unknown: batch counts as 1, a symbolic seqlen_k as
    # SYMBOLIC_SEQLEN_K_GUESS, and a symbolic seqlen_q is always chunked.
    b, s = jax.export.symbolic_shape("b, s")
    want = reference.SCORE_BUDGET // (8 * reference.SYMBOLIC_SEQLEN_K_GUESS)
    assert want == 512
    assert reference.auto_chunk(b, s, 8, s) == want
    assert reference.auto_chunk(b, s, 8, 100) > 0  # small known seqlen_k, unknown seqlen_q: still a loop
    assert reference.auto_chunk(b, 100, 8, 100) == 0  # everything that matters is known and small


def test_symbolic_export_chunks_queries():
    # One artifact for every (batch, seqlen): the score tile's size is unknown at export time, so the
    # reference must loop over query chunks (a 16k-key, 8-head tile per 512 rows) instead of
    # materialising (b, 8, s, s) scores that would not fit for long sequences.
    b, s = jax.export.symbolic_shape("b, s")
    spec = jax.ShapeDtypeStruct((b, s, 8, 128), jnp.bfloat16)
    kwargs = dict(causal=True, softmax_scale=0.1, softcap=20.0, window_size=(6, -1))
    f = jax.jit(lambda q, k, v, sinks: attention_reference(q, k, v, sinks=sinks, **kwargs))
    exported = jax.export.export(f, platforms=["cpu"])(spec, spec, spec, jax.ShapeDtypeStruct((8,), jnp.float32))
    text = exported.mlir_module()
    assert "stablehlo.while" in text, "the symbolic path must chunk the queries"

    chunk = reference.auto_chunk(b, s, 8, s)
    sinks = make_sinks(22, 8)
    for batch, seqlen in [(1, 5), (2, 37)]:
        q, k, v = make_qkv(23 + seqlen, b=batch, s_q=seqlen, s_k=seqlen, h_q=8, h_k=8, d=128)
        o, lse = exported.call(q, k, v, sinks)
        # The same computation as the concrete reference with the chunk the export chose ...
        o_want, lse_want = attention_reference(q, k, v, sinks=sinks, query_chunk=chunk, **kwargs)
        np.testing.assert_array_equal(f64(o), f64(o_want), err_msg=f"{batch=} {seqlen=}")
        np.testing.assert_array_equal(lse, lse_want, err_msg=f"{batch=} {seqlen=}")
        # ... and right (the oracle is NumPy: no second compilation).
        check_result(o, lse, q, k, v, sinks=sinks, **kwargs)


def test_static_small_shapes_do_not_loop():
    # The counterpart: a concrete shape that fits the budget is one block, no sequential loop.
    q, k, v = make_qkv(24, s_q=37, s_k=37, h_q=8, h_k=8, d=128)
    f = jax.jit(lambda q, k, v: attention_reference(q, k, v, causal=True, softmax_scale=0.1))
    assert "stablehlo.while" not in f.lower(q, k, v).as_text()


def test_float32_inputs_for_oracle_use():
    q, k, v = make_qkv(31, s_q=19, s_k=26, dtype=jnp.float32)
    check_against_oracle(q, k, v, causal=True, softmax_scale=0.2)
    check_against_oracle(q, k, v, window_size=(4, 4), softcap=3.0, sinks=make_sinks(32, 4), softmax_scale=0.2)


def test_under_jit():
    # Every option but sinks is static; sinks may be traced.
    q, k, v = make_qkv(41, s_q=12, s_k=30)
    sinks = make_sinks(42, 4)
    static = ("causal", "softmax_scale", "window_size", "softcap", "query_chunk")
    f = jax.jit(attention_reference, static_argnames=static)
    kwargs = dict(causal=True, softmax_scale=0.125, window_size=(7, -1), softcap=6.0)
    o, lse = f(q, k, v, sinks=jnp.asarray(sinks), query_chunk=5, **kwargs)
    o_want, lse_want = attention_oracle(q, k, v, sinks=sinks, xp=np, **kwargs)
    np.testing.assert_allclose(f64(o), o_want, rtol=1.01 * 2.0**-8, atol=F32_ATOL)
    np.testing.assert_allclose(lse, lse_want, atol=LSE_ATOL)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(causal=1, softmax_scale=0.1), TypeError, r"causal must be a Python bool; got causal=1"),
        (dict(softmax_scale=0.0), ValueError, r"softmax_scale must be finite and > 0; got softmax_scale=0\.0"),
        (dict(softmax_scale=1e39), ValueError, r"softmax_scale must be a normal float32"),
        (dict(softmax_scale=0.1, query_chunk=0), ValueError, r"query_chunk must be a positive int or None; got query_chunk=0"),
        (dict(softmax_scale=0.1, query_chunk=True), ValueError, r"query_chunk=True"),
        (dict(softmax_scale=0.1, window_size=(-2, 0)), ValueError, r"window_size values must be >= -1"),
        (dict(softmax_scale=0.1, window_size=3), TypeError, r"window_size must be a pair \(left, right\) of ints"),
        (dict(softmax_scale=0.1, causal=True, window_size=(2, 1)), ValueError, r"causal=True means window_size\[1\] = 0"),
        (dict(softmax_scale=0.1, softcap=-1.0), ValueError, r"softcap must be in \[0, 1e\+06\] \(0 = off\); got softcap=-1\.0"),
        (dict(softmax_scale=0.1, sinks=np.zeros(3, np.float32)), ValueError, r"sinks must have shape \(heads_q,\) = \(4,\); got sinks\.shape=\(3,\)"),
        (dict(softmax_scale=0.1, sinks=np.zeros(4, np.int32)), TypeError, r"sinks must be a floating-point array.*int32"),
    ],
)
def test_rejects_bad_arguments(kwargs, error, message):
    q, k, v = make_qkv(51, s_q=4, s_k=4)
    with pytest.raises(error, match=message):
        attention_reference(q, k, v, **kwargs)


def test_rejects_bad_shapes():
    q, k, v = make_qkv(52, s_q=4, s_k=4, h_q=3, h_k=2)
    with pytest.raises(ValueError, match=r"multiple of key/value heads.*heads_q=3, heads_kv=2"):
        attention_reference(q, k, v, causal=False, softmax_scale=0.1)
    q, k, v = make_qkv(53, s_q=4, s_k=4, h_q=0, h_k=2)
    with pytest.raises(ValueError, match=r"q must have >= 1 heads and no negative dimension"):
        attention_reference(q, k, v, softmax_scale=0.1)
