"""fa4_jax.flax on CPU: the attention_fn drop-in and FA4Attention (prefill, KV-cache decode, paging).

On CPU every fa4_jax call runs the exact pure-JAX reference (float32 softmax), so these tests check the
glue: which calls reach fa4_jax and with what (masks, alignment, cache bookkeeping, RoPE positions),
and which fall back to flax. tests/test_gpu_flax.py runs the same paths on the kernels.

Tolerances. The modules compute in bfloat16 (unit roundoff u = 2**-8): projections, RoPE, attention
output and output projection each round to bf16, so two correct computations differ by a few u of the
output's magnitude; measured: <= 1.5 u * max|out| against the float64 oracle, <= 2 u between flax's and
fa4_jax's attention. TOL = 4 u * max|reference| leaves 2-3x margin, and every option the tests sweep
changes the output by far more (checked: each reference case also asserts that dropping its option
moves the result by more than TOL).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import fa4_jax
import fa4_jax.flax as fa4_flax
from fa4_jax.flax import FA4Attention, dot_product_attention
from oracle import attention_oracle, gather

U = 2.0**-8  # bfloat16 unit roundoff
F = 48  # model features: the projections map 48 -> heads x 64
S = 37  # an odd sequence length, not a multiple of any block or page size
BIAS_INIT = nnx.initializers.normal(1.0)  # non-zero biases, so a bias the glue drops shows


@pytest.fixture(autouse=True)
def fresh_fallback_warnings():
    # dot_product_attention warns once per reason per process; every test starts with none reported.
    fa4_flax._WARNED.clear()
    yield
    fa4_flax._WARNED.clear()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records each fa4_jax.attention call: the proof that dot_product_attention took the kernel path."""
    calls, real = [], fa4_jax.attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fa4_jax, "attention", spy)
    return calls


@contextlib.contextmanager
def fallback_warnings():
    """Yields a list that, after the block, holds the messages of the fallback warnings it raised."""
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield got
    got.extend(str(w.message) for w in caught if str(w.message).startswith("fa4_jax.flax"))


def f32(x):
    return np.asarray(x, np.float32)


def assert_close(got, want, tol_units=4):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol_units * U * np.abs(want).max())


def normal(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------------
# dot_product_attention as attention_fn


def mha(attention_fn, **kwargs):
    # The same seed gives the same parameters (and the same dropout stream): only attention_fn differs.
    kwargs = dict(num_heads=4, in_features=F, qkv_features=256, dtype=jnp.bfloat16, bias_init=BIAS_INIT,
                  decode=False) | kwargs
    return nnx.MultiHeadAttention(attention_fn=attention_fn, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)], ids=["no_batch_dim", "batch", "two_batch_dims"])
def test_mha_kernel_path_matches_default(kernel_calls, is_causal, num_kv_heads, batch):
    x = normal(0, (*batch, S, F))
    with fallback_warnings() as warned:
        got = mha(dot_product_attention, num_kv_heads=num_kv_heads)(x, is_causal=is_causal)
    want = mha(nnx.dot_product_attention, num_kv_heads=num_kv_heads)(x, is_causal=is_causal)
    assert warned == [] and len(kernel_calls) == 1 and kernel_calls[0]["causal"] is is_causal
    assert got.shape == want.shape == (*batch, S, F) and got.dtype == jnp.bfloat16
    assert_close(got, f32(want))


def test_mha_causal_mask_falls_back_once():
    x = normal(1, (2, S, F))
    mask = nnx.make_causal_mask(jnp.ones((2, S)))
    layer = mha(dot_product_attention)
    with fallback_warnings() as warned:
        got = [layer(x, mask=mask) for _ in range(2)]  # the second call must not warn again
    assert len(warned) == 1 and "an arbitrary boolean mask was given" in warned[0] and "is_causal=True" in warned[0]
    want = mha(nnx.dot_product_attention)(x, mask=mask)
    for g in got:  # the fallback is flax's own function with the same arguments: bit-identical
        np.testing.assert_array_equal(f32(g), f32(want))


def test_mha_decode_mode_falls_back_and_matches():
    # nnx decode mode masks the unwritten cache slots: a mask, so flax computes it.
    x = normal(2, (2, 7, F))
    outs = []
    for fn in (dot_product_attention, nnx.dot_product_attention):
        layer = mha(fn, decode=True)
        layer.init_cache((2, 16, F), dtype=jnp.bfloat16)
        with fallback_warnings() as warned:
            outs.append(np.concatenate([f32(layer(x[:, t:t + 1])) for t in range(x.shape[1])], axis=1))
        if fn is dot_product_attention:
            assert len(warned) == 1 and "mask" in warned[0]
    np.testing.assert_array_equal(*outs)


def test_mha_float32_falls_back():
    x = normal(3, (2, S, F))
    with fallback_warnings() as warned:
        got = mha(dot_product_attention, dtype=None)(x, is_causal=True)
    assert len(warned) == 1 and "float32 inputs: the FA4 kernels take bfloat16/float16" in warned[0]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, mha(nnx.dot_product_attention, dtype=None)(x, is_causal=True))


def test_mha_dropout(kernel_calls):
    x = normal(4, (2, S, F))
    with fallback_warnings() as warned:
        got = mha(dot_product_attention, dropout_rate=0.25)(x, deterministic=False)
    assert len(warned) == 1 and "active dropout" in warned[0] and not kernel_calls
    # Same seed, same dropout stream: flax's own dropout, bit for bit.
    np.testing.assert_array_equal(f32(got), f32(mha(nnx.dot_product_attention, dropout_rate=0.25)(x, deterministic=False)))
    # Dropout configured but off (deterministic): attention without it, on the kernel path.
    with fallback_warnings() as warned:
        got = mha(dot_product_attention, dropout_rate=0.25)(x, deterministic=True)
    assert warned == [] and len(kernel_calls) == 1
    assert_close(got, f32(mha(nnx.dot_product_attention, dropout_rate=0.25)(x, deterministic=True)))


def _qkv(seed, s_q=S, s_k=S, h=4, h_kv=4, d=64, dtype=jnp.bfloat16):
    return (jnp.asarray(normal(seed + i, (2, s, n, d)), dtype) for i, (s, n) in enumerate(((s_q, h), (s_k, h_kv),
                                                                                            (s_k, h_kv))))


@pytest.mark.parametrize("case, message", [
    (dict(bias=jnp.asarray(normal(9, (2, 4, S, S)))), "an attention bias was given"),
    (dict(mask=jnp.asarray(normal(9, (2, 1, S, S)) > 0)), "an arbitrary boolean mask"),
    (dict(dtype=jnp.float32), "float32 inputs"),
    (dict(d=32), "head_dim 32"),
    (dict(s_k=50, is_causal=True), "flax aligns the causal mask to the top-left corner"),
    (dict(unknown_future_flag=True), "unrecognised keyword arguments ['unknown_future_flag']"),
], ids=["bias", "mask", "float32", "head_dim", "causal_rectangular", "unknown_kwarg"])
def test_direct_call_fallbacks(kernel_calls, case, message):
    qkv_keys = {"s_k", "d"}
    q, k, v = _qkv(10, **{n: case[n] for n in qkv_keys & case.keys()})
    kwargs = {n: x for n, x in case.items() if n not in qkv_keys}
    with fallback_warnings() as warned:
        if "unknown_future_flag" in kwargs:  # flax itself rejects it: the fallback passes it on
            with pytest.raises(TypeError, match="unknown_future_flag"):
                dot_product_attention(q, k, v, **kwargs)
            got = None
        else:
            got = dot_product_attention(q, k, v, **kwargs)
    assert len(warned) == 1 and message in warned[0] and not kernel_calls
    if got is not None:
        np.testing.assert_array_equal(f32(got), f32(nnx.dot_product_attention(q, k, v, **kwargs)))


def test_sown_weights_fall_back():
    x = normal(5, (2, S, F))
    layer = mha(dot_product_attention)
    with fallback_warnings() as warned:
        got = layer(x, sow_weights=True)
    assert len(warned) == 1 and "sown" in warned[0]
    (weights,) = nnx.state(layer, nnx.Intermediate)["attention_weights"].get_value()  # flax sowed them
    assert weights.shape == (2, 4, S, S)
    # The fallback is flax's own function: the same weights and output as the plain flax layer.
    theirs = mha(nnx.dot_product_attention)
    want = theirs(x, sow_weights=True)
    (want_weights,) = nnx.state(theirs, nnx.Intermediate)["attention_weights"].get_value()
    np.testing.assert_array_equal(f32(weights), f32(want_weights))
    np.testing.assert_array_equal(f32(got), f32(want))


def test_linen_mha(kernel_calls):
    x = normal(6, (2, S, F))
    make = lambda **kw: linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=256, dtype=jnp.bfloat16,  # noqa: E731
                                                           bias_init=BIAS_INIT, **kw)
    params = make().init(jax.random.key(0), x)
    want = make().apply(params, x)
    with fallback_warnings() as warned:
        got = make(attention_fn=dot_product_attention).apply(params, x)
    assert warned == [] and len(kernel_calls) == 1
    # linen's default softmax runs in bf16 (force_fp32_for_softmax=False), the reference in float32.
    assert_close(got, f32(want))
    # A mask: linen's own function (recognised by the keywords only linen passes), bit for bit.
    mask = linen.make_causal_mask(jnp.ones((2, S)))
    with fallback_warnings() as warned:
        got = make(attention_fn=dot_product_attention).apply(params, x, mask=mask)
    assert len(warned) == 1 and "mask" in warned[0]
    np.testing.assert_array_equal(f32(got), f32(make().apply(params, x, mask=mask)))


# ---------------------------------------------------------------------------------------------------
# FA4Attention against an independent float64 computation from its own parameters


def f64(x):
    return np.asarray(x, np.float64)


def rope(x, positions, theta, interleaved=False):
    """Rotary embedding written with complex numbers: the rotate-half convention pairs dimension i with
    i + d/2 (interleaved: 2i with 2i + 1, the GPT-J convention, used only as a negative control)."""
    half = x.shape[-1] // 2
    re, im = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    z = (re + 1j * im) * np.exp(1j * f64(positions)[:, :, None, None] * theta ** (-np.arange(half) / half))
    if interleaved:
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    return np.concatenate([z.real, z.imag], axis=-1)


def reference(m, xq, xk=None, pos_q=None, pos_k=None, kv=None, **override):
    """The layer in float64 from m's parameters: einsum projections, RoPE, kv heads expanded by repeat,
    attention by tests/oracle.py, output projection. `override` replaces options (negative controls).
    kv: (keys, values) (b, s_k, heads_kv, d) as the cache holds them (after RoPE) instead of
    projections of xk (an FP8 cache's dequantized contents)."""
    opt = dict(causal=m.causal, window_size=m.window_size, softcap=m.softcap, rope_theta=m.rope_theta,
               sinks=None if m.sinks is None else f64(m.sinks[...]), expand=np.repeat, interleaved=False) | override
    xk = xq if xk is None else xk
    proj = lambda lin, x: np.einsum("bsf,fhd->bshd", f64(x), f64(lin.kernel[...])) + f64(lin.bias[...])  # noqa: E731
    q = proj(m.query, xq)
    k, v = (proj(m.key, xk), proj(m.value, xk)) if kv is None else (f64(kv[0]), f64(kv[1]))
    if opt["rope_theta"] is not None:
        q = rope(q, pos_q, opt["rope_theta"], opt["interleaved"])
        if kv is None:
            k = rope(k, pos_k, opt["rope_theta"], opt["interleaved"])
    g = m.num_heads // m.num_kv_heads  # query head h reads kv head h // g
    k, v = (opt["expand"](t, g, axis=2) for t in (k, v))
    o, _ = attention_oracle(q, k, v, softmax_scale=m.head_dim**-0.5, causal=opt["causal"],
                            window_size=opt["window_size"], softcap=opt["softcap"], sinks=opt["sinks"])
    return np.einsum("bshd,hdo->bso", o, f64(m.out.kernel[...])) + f64(m.out.bias[...])


def make_layer(seed=0, **kwargs):
    m = FA4Attention(**(dict(num_heads=4, in_features=F, qkv_features=256, dtype=jnp.bfloat16, bias_init=BIAS_INIT,
                             rngs=nnx.Rngs(seed)) | kwargs))
    if m.sinks is not None:  # learned sinks start at zero; give them values that move the softmax
        m.sinks[...] = jnp.asarray(2 * normal(seed + 100, (m.num_heads,)))
    return m


def tile_heads(t, g, axis):
    return np.concatenate([t] * g, axis=axis)


GQA = dict(num_heads=8, qkv_features=512, num_kv_heads=2)
POS = np.arange(S)[None].repeat(2, axis=0)
XK = normal(7, (2, 50, 24))
REFERENCE_CASES = {  # name: (layer options, call options, negative controls (reference overrides))
    "mha": (dict(), dict(), [dict(causal=False, window_size=(-1, -1))]),
    "gqa": (GQA, dict(), [dict(expand=tile_heads)]),  # control: query head h reading kv head h % heads_kv
    "window_softcap": (dict(causal=False, window_size=(7, 5), softcap=5.0), dict(),
                       [dict(window_size=(-1, -1)), dict(softcap=0.0)]),
    "sinks": (dict(GQA, use_sinks=True), dict(), [dict(sinks=None)]),
    "rope": (dict(rope_theta=10000.0), dict(), [dict(rope_theta=None), dict(interleaved=True)]),
    # RoPE sees only position differences: the given positions are spaced 3 apart (a shift alone
    # would not change the output).
    "rope_positions": (dict(rope_theta=10000.0), dict(positions=3 * POS + np.array([[0], [11]])),
                       [dict(pos_q=POS, pos_k=POS)]),
    # Causal cross-attention is bottom-right aligned (query i sees keys <= i + 13); the control is
    # flax's top-left alignment (keys <= i), i.e. square causal attention to the first S keys.
    "cross": (dict(in_kv_features=24), dict(inputs_k=XK), [dict(xk=XK[:, :S])]),
}


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_prefill_matches_reference(name):
    layer_opts, call_opts, controls = REFERENCE_CASES[name]
    m = make_layer(**layer_opts)
    x = normal(8, (2, S, F))
    got = m(x, **call_opts)
    pos = call_opts.get("positions", POS)
    args = dict(xk=call_opts.get("inputs_k"), pos_q=pos, pos_k=pos)
    want = reference(m, x, **args)
    assert got.shape == (2, S, F) and got.dtype == jnp.bfloat16
    assert_close(got, want)
    for control in controls:  # the option is visible: the reference without it is outside the tolerance
        wrong = reference(m, x, **(args | control))
        assert np.abs(f64(got) - wrong).max() > 4 * U * np.abs(want).max(), control


def test_same_parameters_and_output_as_nnx_multihead_attention():
    # The documented promise: one seed, the same parameters; then the same layer as flax's.
    ours = make_layer(causal=False, **GQA)
    theirs = mha(nnx.dot_product_attention, **GQA)
    for name in ("query", "key", "value", "out"):
        for p in ("kernel", "bias"):
            np.testing.assert_array_equal(getattr(getattr(ours, name), p)[...], getattr(getattr(theirs, name), p)[...])
    x = normal(16, (2, S, F))
    assert_close(ours(x), f32(theirs(x)))


# ---------------------------------------------------------------------------------------------------
# FA4Attention decode


@nnx.jit
def decode_step(m, x, lengths):
    return m(x, decode=True, lengths=lengths)


def test_decode_token_by_token_equals_prefill():
    m = make_layer(rope_theta=10000.0, use_sinks=True, **GQA)
    x = normal(11, (2, S, F))
    m.init_cache(2, 64)
    # Eager steps (no jit): the plain Python path of the cache update.
    steps = [m(x[:, t:t + 1], decode=True) for t in range(S)]
    np.testing.assert_array_equal(m.cache_lengths[...], [S, S])
    # Both sides compute the same bf16 projections; only the attention call differs (the KV-cache and
    # the dense reference, both float32 softmax), so they agree to output rounding.
    assert_close(jnp.concatenate(steps, axis=1), f32(m(x)), tol_units=2)


PADDED_CASES = {
    "causal_rope_gqa": dict(rope_theta=10000.0, **GQA),
    "bidirectional": dict(causal=False),  # queries placed by the real lengths, not the padded ones
    "sliding_window_sinks_softcap": dict(window_size=(6, 0), use_sinks=True, softcap=5.0),
}
PROMPT_LENGTHS = np.array([S, 5, 20], np.int32)
N_STEPS = 4


def run_padded_batch(m, seed=12, step=decode_step):
    """Right-padded prompts of PROMPT_LENGTHS prefilled in one decode call, then N_STEPS one-token
    steps (jitted by default). Returns the per-row token sequences and the output of every call."""
    b = len(PROMPT_LENGTHS)
    prompts = normal(seed, (b, S, F))  # the padding is random too: a padded key that leaks shows
    tokens = normal(seed + 1, (b, N_STEPS, F))
    outs = [m(prompts, decode=True, lengths=jnp.asarray(PROMPT_LENGTHS))]
    for t in range(N_STEPS):
        outs.append(step(m, tokens[:, t:t + 1], jnp.ones((b,), jnp.int32)))
    np.testing.assert_array_equal(m.cache_lengths[...], PROMPT_LENGTHS + N_STEPS)
    seqs = [np.concatenate([prompts[r, :n], tokens[r]]) for r, n in enumerate(PROMPT_LENGTHS)]
    return seqs, [f32(o) for o in outs]


@pytest.mark.parametrize("name", PADDED_CASES)
def test_decode_padded_batch_matches_per_row_reference(name):
    m = make_layer(**PADDED_CASES[name])
    m.init_cache(len(PROMPT_LENGTHS), 48)
    seqs, outs = run_padded_batch(m)
    for r, (seq, n) in enumerate(zip(seqs, PROMPT_LENGTHS)):
        # Each call's real queries are tokens [a, e) of the row, attending to its tokens [0, e): the
        # reference's bottom-right alignment puts them at positions a..e-1, as in one long sequence.
        got = [outs[0][r, :n]] + [o[r] for o in outs[1:]]
        bounds = [(0, n)] + [(n + t, n + t + 1) for t in range(N_STEPS)]
        for g, (a, e) in zip(got, bounds):
            pos = np.arange(e)[None]
            assert_close(g, reference(m, seq[None, a:e], seq[None, :e], pos_q=pos[:, a:], pos_k=pos)[0])


@pytest.mark.parametrize("page", [16, 64])
def test_paged_cache_equals_contiguous(page):
    opts = dict(rope_theta=10000.0, use_sinks=True, **GQA)
    # 3 pages per row: the prompts (up to 37 tokens) and the steps cross page boundaries at page 16;
    # at page 64 a row's tokens stay in its first page, which is not pool page 0.
    b, max_length = len(PROMPT_LENGTHS), 3 * page
    contiguous, paged = make_layer(**opts), make_layer(**opts)
    contiguous.init_cache(b, max_length)
    # 3 pages per row out of a pool of 13, in shuffled order (a row's pages are neither adjacent nor ordered).
    table = np.random.default_rng(13).permutation(13)[: b * 3].astype(np.int32).reshape(b, 3)
    paged.init_cache(b, max_length, page_size=page, num_pages=13, page_table=table)
    assert paged.cached_key.shape == (13, page, 2, 64) and paged.page_table[...].shape == (b, 3)
    _, want = run_padded_batch(contiguous)
    _, got = run_padded_batch(paged)
    for g, w in zip(got, want):
        # The same keys in another layout; the reference gathers the pages into the contiguous
        # layout and runs the same computation, so the results agree to float32 rounding.
        np.testing.assert_allclose(g, w, rtol=0, atol=U * np.abs(w).max())
    # The default page table: row b owns pages [3b, 3b + 3).
    paged.init_cache(b, max_length, page_size=page)
    np.testing.assert_array_equal(paged.page_table[...], np.arange(b * 3).reshape(b, 3))


FP8 = jnp.float8_e4m3fn
K_SCALE = np.array([0.5, 2.0], np.float32)  # per KV head (GQA: 2), powers of two: dequantized values are exact
V_SCALE = 0.25


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_fp8_cache_writes_quantized_tokens_and_attends_to_them(page):
    opts = dict(rope_theta=10000.0, use_sinks=True, **GQA)
    b, max_length = len(PROMPT_LENGTHS), 48
    fp8, twin = make_layer(**opts), make_layer(**opts)  # the same parameters; twin has a bfloat16 cache
    paging = {} if page is None else dict(
        page_size=page, num_pages=13, page_table=np.random.default_rng(5).permutation(13)[:9].reshape(3, 3))
    if page is None:
        fp8.init_cache(b, max_length, dtype=FP8, k_scale=K_SCALE, v_scale=V_SCALE)
    else:  # the scales as calibration would set them, after init_cache's defaults
        fp8.init_cache(b, max_length, dtype=FP8, **paging)
        np.testing.assert_array_equal(fp8.k_scale[...], [1.0, 1.0])
        fp8.k_scale[...], fp8.v_scale[...] = jnp.asarray(K_SCALE), jnp.full((2,), V_SCALE, jnp.float32)
    twin.init_cache(b, max_length, **paging)
    assert fp8.cached_key.dtype == FP8 and fp8.cached_value.dtype == FP8 and twin.cached_key.dtype == jnp.bfloat16
    assert fp8.k_scale[...].shape == (2,) and fp8.k_scale[...].dtype == jnp.float32
    # Eager steps: op by op, every bf16 op rounds, in both layers alike (under jit XLA may keep the
    # RoPE'd keys in float32 on their way into the quantization: codes one step apart at roundings).
    eager = lambda m, x, lengths: m(x, decode=True, lengths=lengths)  # noqa: E731
    seqs, outs = run_padded_batch(fp8, step=eager)
    _, twin_outs = run_padded_batch(twin, step=eager)
    table = None if page is None else fp8.page_table[...]
    # Writes: every token the twin cached (bf16), quantized with its head's scale, bit for bit.
    for cache, twin_cache, scale in ((fp8.cached_key, twin.cached_key, K_SCALE[:, None]),
                                     (fp8.cached_value, twin.cached_value, V_SCALE)):
        want = np.clip(f32(twin_cache[...]) * np.float32(1 / np.float32(scale)), -448, 448).astype(FP8)
        np.testing.assert_array_equal(np.asarray(cache[...]).view(np.uint8), want.view(np.uint8))
    # The prompts (into empty rows) attend to their own unquantized keys, as with a 16-bit cache.
    np.testing.assert_array_equal(outs[0], twin_outs[0])
    # Every step after them reads the FP8 cache as fp8 * scale.
    as_rows = lambda c: np.asarray(c) if table is None else gather(c, np.asarray(table))  # noqa: E731
    keys = as_rows(fp8.cached_key[...]).astype(np.float64) * K_SCALE[:, None]
    values = as_rows(fp8.cached_value[...]).astype(np.float64) * V_SCALE
    for r, (seq, n) in enumerate(zip(seqs, PROMPT_LENGTHS)):
        for t in range(N_STEPS):
            e = n + t + 1
            pos = np.arange(e)[None]
            args = dict(pos_q=pos[:, e - 1:], kv=(keys[None, r, :e], values[None, r, :e]))
            want = reference(fp8, seq[None, e - 1:e], **args)[0]
            assert_close(outs[1 + t][r], want)
            unscaled = reference(fp8, seq[None, e - 1:e], **(args | dict(kv=(keys[None, r, :e] / K_SCALE[:, None],
                                                                          values[None, r, :e]))))[0]
            assert np.abs(outs[1 + t][r] - unscaled).max() > 4 * U * np.abs(want).max()  # the scales matter


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k_scale=0.5), ValueError, "k_scale / v_scale belong to an FP8 cache"),
    (dict(dtype=FP8, k_scale=-1.0), ValueError, "k_scale must be positive and finite"),
    (dict(dtype=FP8, v_scale=np.ones(3, np.float32)), ValueError, r"v_scale must be a scalar or have shape \(heads_kv,\) = \(2,\)"),
    (dict(dtype=jnp.float8_e5m2), ValueError, "or jnp.float8_e4m3fn"),
], ids=["scale_without_fp8", "negative_scale", "scale_shape", "e5m2"])
def test_fp8_cache_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_layer(**GQA).init_cache(2, 32, **kwargs)


def test_fp8_cache_refuses_the_cudnn_implementation_with_the_reason():
    m = make_layer(implementation="cudnn", **GQA)
    m.init_cache(2, 32, dtype=FP8)
    with pytest.raises(ValueError, match='implementation="cudnn" cannot read float8_e4m3fn KV caches'):
        m(normal(0, (2, 1, F)), decode=True)


def test_jit_decode_step_updates_cache_in_place():
    m = make_layer(rope_theta=10000.0)
    x = normal(14, (2, 5, F))
    m.init_cache(2, 32)
    eager = make_layer(rope_theta=10000.0)
    eager.init_cache(2, 32)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    for t in range(x.shape[1]):
        got = step(m, x[:, t:t + 1])  # the module's cache variables come back updated
        np.testing.assert_array_equal(m.cache_lengths[...], [t + 1, t + 1])
        # Compiled and op-by-op bf16 programs may round differently (fusion): equal to a unit or two.
        assert_close(got, f32(eager(x[:, t:t + 1], decode=True)), tol_units=2)
    assert_close(m.cached_key[...], f32(eager.cached_key[...]), tol_units=2)
    assert np.abs(f32(m.cached_key[...][:, :5])).min() > 0 and not f32(m.cached_key[...][:, 5:]).any()


def test_reset_cache():
    m = make_layer()
    x = normal(15, (2, 9, F))
    m.init_cache(2, 32)
    first = f32(m(x, decode=True))
    m(x[:, :2], decode=True)
    m.reset_cache(rows=jnp.array([1]))
    np.testing.assert_array_equal(m.cache_lengths[...], [11, 0])
    m.reset_cache()
    np.testing.assert_array_equal(m.cache_lengths[...], [0, 0])
    np.testing.assert_array_equal(f32(m(x, decode=True)), first)  # the stale keys are invisible


@pytest.mark.parametrize("make, error, match", [
    (lambda: make_layer(dropout_rate=0.1), ValueError, "inference-only .* dropout_rate must be 0"),
    (lambda: make_layer(dtype=jnp.float32), ValueError, "dtype=float32. Use dtype=jnp.bfloat16"),
    (lambda: make_layer(num_heads=6, qkv_features=384, num_kv_heads=4), ValueError, "num_heads by num_kv_heads"),
    (lambda: make_layer(qkv_features=128), ValueError, r"head_dim = qkv_features // num_heads = 32"),
    (lambda: make_layer(causal=True, window_size=(4, 3)), ValueError, "causal=True means window_size"),
    (lambda: make_layer(causal=True, window_size=(4, 1)), ValueError, r"causal=True means window_size.*\(4, 1\)"),
    (lambda: make_layer().init_cache(4, 64, page_size=16, num_pages=10), ValueError, "num_pages=10 is too few"),
    (lambda: make_layer().init_cache(2, 64, page_size=0), ValueError, r"page_size must be an int >= 1"),
    (lambda: make_layer().init_cache(2, 64, page_size=16, num_pages=8, page_table=np.full((2, 4), 8)), ValueError,
     r"page_table ids must lie in \[0, num_pages=8\)"),
    (lambda: make_layer(dtype=None).init_cache(2, 64), ValueError, "init_cache needs dtype=jnp.bfloat16"),
    (lambda: make_layer()(normal(0, (2, 3, F)), decode=True), ValueError, r"needs a KV cache: call init_cache"),
    (lambda: make_layer(dtype=None)(normal(0, (2, 3, F))), TypeError, "computes in float32 .* dtype=jnp.bfloat16"),
    (lambda: make_layer()(normal(0, (2, 3, F)), lengths=jnp.array([3, 2])), ValueError, "decode=True only"),
], ids=["dropout", "float32", "kv_heads", "head_dim", "window", "window_right_1", "pages", "page_size", "page_ids",
        "cache_dtype", "no_cache", "inferred_float32", "lengths"])
def test_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_padded_rows_refuse_a_window_that_would_see_padding():
    m = make_layer(causal=False, window_size=(4, 2))
    m.init_cache(2, 32)
    with pytest.raises(ValueError, match="padded rows"):
        m(normal(0, (2, 3, F)), decode=True, lengths=jnp.array([3, 1]))
    m(normal(0, (2, 3, F)), decode=True)  # unpadded rows are fine with any window


# ---------------------------------------------------------------------------------------------------
# Packaging and the README


def test_flax_is_optional():
    code = ("import sys, fa4_jax; assert 'flax' not in sys.modules\n"
            "sys.modules['flax'] = None  # what a missing flax looks like to the import system\n"
            "try:\n    import fa4_jax.flax\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert "pip install 'fa4-jax[flax]'" in out


README_SNIPPET = '''\
import jax, jax.numpy as jnp
from flax import nnx
from fa4_jax.flax import FA4Attention, dot_product_attention

# A Llama-style layer: GQA, RoPE, causal; bfloat16 compute, float32 parameters.
attn = FA4Attention(num_heads=8, in_features=512, num_kv_heads=2, rope_theta=10000.0,
                    dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
attn.init_cache(batch_size=2, max_length=256)  # page_size=64 for a paged cache

prompts = jax.random.normal(jax.random.key(1), (2, 37, 512))  # right-padded to 37 tokens
lengths = jnp.array([37, 20], jnp.int32)                       # real tokens per row
y = attn(prompts, decode=True, lengths=lengths)                # prefill, (2, 37, 512)

@nnx.jit
def step(attn, x):                                             # the cache updates in place
    return attn(x, decode=True)

y = step(attn, jax.random.normal(jax.random.key(2), (2, 1, 512)))  # one token per row
print(attn.cache_lengths[...])                                 # [38 21]

# Or keep nnx.MultiHeadAttention and swap its attention function:
mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, dtype=jnp.bfloat16, decode=False,
                             attention_fn=dot_product_attention, rngs=nnx.Rngs(0))
y = mha(prompts, is_causal=True)
'''


def test_readme_snippet_runs(capsys):
    namespace = {}
    exec(compile(README_SNIPPET, "README.md (Flax)", "exec"), namespace)
    assert capsys.readouterr().out.strip() == "[38 21]"
    assert namespace["y"].shape == (2, 37, 512) and namespace["y"].dtype == jnp.bfloat16


def test_readme_has_the_snippet():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert README_SNIPPET in readme, "README.md's Flax section must show tests/test_flax.py:README_SNIPPET verbatim"
