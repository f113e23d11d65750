"""The public API on CPU: validation, defaults, implementation choice and JAX transformations."""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import FwdVariant, attention, attention_reference
from fa4_jax.core import platform as _platform
from fa4_jax.families import default_menu
from fa4_jax.ops.fwd.primitive import fa4_fwd_p
from oracle import attention_oracle, check_empty_result, make_sinks as _make_sinks


def make_sinks(seed, h_q=4):
    return _make_sinks(seed, h_q)

# `fa4_jax.attention` the attribute is the function; the module is only reachable by its import name.
api = importlib.import_module("fa4_jax.ops.fwd.api")

STATIC = attention.STATIC_ARGNAMES
BF16_U = 2.0**-8
F32_ATOL = 2e-5  # float32 noise of the reference (see test_reference.py)
LSE_ATOL = 1e-4


def make_qkv(seed, *, b=2, s_q=24, s_k=40, h_q=4, h_k=2, d=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    draw = lambda s, h, dd=d: rng.standard_normal((b, s, h, dd), dtype=np.float32).astype(dtype)
    return draw(s_q, h_q), draw(s_k, h_k), draw(s_k, h_k)



def f64(x):
    return np.asarray(x, np.float64)


def variant_fn(dtype="bf16", head_dim=64, mask="full", softcap=False):
    """What attention() hands resolve_implementation: the kernel it needs, given the device's arch."""
    return lambda arch: FwdVariant(arch, dtype, head_dim, mask, softcap)


def bound_primitives(fn, *args):
    """The fa4_fwd equations `fn` binds at its top level."""
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive is fa4_fwd_p]


# -- validation ---------------------------------------------------------------------------------

def _replace(which, **kw):
    """A case that swaps one of q/k/v (or all three) for an array of another shape/dtype."""

    def make():
        q, k, v = make_qkv(0)
        shapes = dict(q=q.shape, k=k.shape, v=v.shape)
        dtypes = dict(q=q.dtype, k=k.dtype, v=v.dtype)
        names = ("q", "k", "v") if which == "qkv" else tuple(which)
        for n in names:
            shape = list(shapes[n])
            for axis, size in kw.get("dims", {}).items():
                shape[axis] = size
            shapes[n] = tuple(shape)
            dtypes[n] = kw.get("dtype", dtypes[n])
        return [np.ones(shapes[n], np.float32).astype(dtypes[n]) for n in ("q", "k", "v")]

    return make


BAD_INPUTS = {
    "rank3_q": (lambda: [make_qkv(0)[0][0], *make_qkv(0)[1:]], ValueError, r"q must have rank 4.*q\.shape=\(24, 4, 64\)"),
    "float32": (_replace("qkv", dtype=np.float32), TypeError, r"bfloat16 or float16.*q\.dtype=float32"),
    "int8_k": (_replace("k", dtype=np.int8), TypeError, r"k must be bfloat16 or float16.*int8"),
    "mixed_dtypes": (_replace("kv", dtype=jnp.float16), TypeError, r"share one dtype.*k\.dtype=float16"),
    "head_dim_80": (_replace("qkv", dims={3: 80}), ValueError, r"head_dim must be one of \(64, 96, 128, 192, 256\); got head_dim=80"),
    "head_dim_mismatch": (_replace("kv", dims={3: 128}), ValueError, r"share head_dim"),
    "batch_mismatch": (_replace("kv", dims={0: 3}), ValueError, r"batch size"),
    "k_v_seqlen_mismatch": (_replace("v", dims={1: 41}), ValueError, r"k and v must have the same shape"),
    "kv_heads_mismatch": (_replace("v", dims={2: 1}), ValueError, r"k and v must have the same shape"),
    "heads_not_multiple": (_replace("kv", dims={2: 3}), ValueError, r"multiple of key/value heads.*heads_q=4, heads_kv=3"),
    # Zero batch/seqlen is valid now (see test_zero_size_inputs); zero heads is still not attention.
    "zero_heads_q": (_replace("q", dims={2: 0}), ValueError, r"q must have >= 1 heads and no negative dimension; got q\.shape=\(2, 24, 0, 64\)"),
    "zero_heads_kv": (_replace("kv", dims={2: 0}), ValueError, r"k must have >= 1 heads.*k\.shape=\(2, 40, 0, 64\)"),
    "list_input": (lambda: [make_qkv(0)[0].tolist(), *make_qkv(0)[1:]], TypeError, r"q must be an array"),
}

BAD_OPTIONS = {
    "scale_zero": (dict(softmax_scale=0.0), ValueError, r"finite and > 0.*softmax_scale=0\.0"),
    "scale_negative": (dict(softmax_scale=-0.125), ValueError, r"softmax_scale=-0\.125"),
    "scale_nan": (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale=nan"),
    "scale_inf": (dict(softmax_scale=math.inf), ValueError, r"softmax_scale=inf"),
    "scale_str": (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a Python float; got '0\.1'"),
    "scale_bool": (dict(softmax_scale=True), TypeError, r"softmax_scale must be a Python float"),
    "scale_vector": (dict(softmax_scale=np.array([0.1, 0.2])), TypeError, r"softmax_scale must be a scalar; got shape \(2,\)"),
    # Finite Python floats that are not usable float32 scales (the kernel takes float32 and exp2).
    "scale_overflows_f32": (dict(softmax_scale=1e39), ValueError, r"softmax_scale must be a normal float32 in about 1\.2e-38 \.\. 10000 \(larger scales turn the float32 softmax into an argmax it cannot resolve\); got softmax_scale=1e\+39"),
    "scale_underflows_f32": (dict(softmax_scale=1e-46), ValueError, r"normal float32.*got softmax_scale=1e-46"),
    "scale_denormal_f32": (dict(softmax_scale=1e-39), ValueError, r"normal float32.*got softmax_scale=1e-39"),
    # Above the largest scale the float32 softmax resolves (fa4_jax.core.validation.MAX_SOFTMAX_SCALE),
    # though a finite float32: 1e8 with N(0, 1) inputs used to return NaN rows.
    "scale_above_max": (dict(softmax_scale=1.0001e4), ValueError, r"softmax_scale must be a normal float32 in about 1\.2e-38 \.\. 10000.*got softmax_scale=10001\.0"),
    "scale_1e8": (dict(softmax_scale=1e8), ValueError, r"\.\. 10000 .*got softmax_scale=100000000\.0"),
    "softcap_negative": (dict(softcap=-1.0), ValueError, r"softcap must be in \[0, 1e\+06\] \(0 = off\); got softcap=-1\.0"),
    "softcap_inf": (dict(softcap=math.inf), ValueError, r"softcap must be in \[0, 1e\+06\].*softcap=inf"),
    "softcap_nan": (dict(softcap=float("nan")), ValueError, r"softcap must be in \[0, 1e\+06\].*softcap=nan"),
    "softcap_bool": (dict(softcap=True), TypeError, r"softcap must be a Python float; got True\. Under jax\.jit, pass it as a static argument \(static_argnames=\('softcap', \.\.\.\)\) or leave it 0\.0 \(off\)"),
    "softcap_str": (dict(softcap="30"), TypeError, r"softcap must be a Python float; got '30'"),
    "softcap_none": (dict(softcap=None), TypeError, r"softcap must be a Python float; got None"),
    "softcap_vector": (dict(softcap=np.array([1.0, 2.0])), TypeError, r"softcap must be a scalar; got shape \(2,\)"),
    # softcap * log2(e) and softmax_scale / softcap are what the kernel receives, as float32.
    "softcap_too_large": (dict(softcap=1e38), ValueError, r"softcap must be in \[0, 1e\+06\] \(0 = off\); got softcap=1e\+38"),
    "softcap_above_max": (dict(softcap=1.5e6), ValueError, r"softcap must be in \[0, 1e\+06\] \(0 = off\); got softcap=1500000\.0"),
    "softcap_denormal": (dict(softcap=1e-40), ValueError, r"softcap=1e-40 with softmax_scale=0\.125 is out of float32 range"),
    # Each half of that check alone: softcap * log2(e) subnormal (5e-39 * 1.44) while softmax_scale /
    # softcap stays a normal float32 (the bound on softcap keeps softcap * log2(e) from overflowing) ...
    "softcap_log2e_subnormal": (dict(softcap=5e-39, softmax_scale=1e-30), ValueError,
                                r"softcap=5e-39 with softmax_scale=1e-30 is out of float32 range"),
    # ... then softmax_scale / softcap subnormal (the bounds on both keep it from overflowing).
    "softcap_scale_ratio_underflows": (dict(softcap=1e5, softmax_scale=1e-36), ValueError,
                                       r"softcap=100000\.0 with softmax_scale=1e-36 is out of float32 range"),
    "window_int": (dict(window_size=5), TypeError, r"window_size must be a pair \(left, right\) of ints; got window_size=5"),
    "window_triple": (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a pair \(left, right\) of ints; got window_size=\(1, 2, 3\)"),
    "window_str": (dict(window_size="ab"), TypeError, r"window_size must be a pair \(left, right\) of ints; got window_size='ab'"),
    "window_none": (dict(window_size=None), TypeError, r"window_size must be a pair \(left, right\) of ints; got window_size=None"),
    "window_float": (dict(window_size=(4.0, 0)), TypeError, r"window_size must be a pair of Python ints; got window_size=\(4\.0, 0\) \(left is float\)\. Under jax\.jit, mark it static"),
    "window_bool": (dict(window_size=(0, True)), TypeError, r"window_size must be a pair of Python ints.*\(right is bool\)"),
    "window_below_minus_one": (dict(window_size=(-2, 0)), ValueError, r"window_size values must be >= -1 \(-1 = unbounded\); got window_size=\(-2, 0\)"),
    "window_right_below_minus_one": (dict(window_size=(3, -5)), ValueError, r"window_size values must be >= -1.*window_size=\(3, -5\)"),
    "causal_with_right_window": (dict(causal=True, window_size=(4, 3)), ValueError, r"causal=True means window_size\[1\] = 0 \(no key after the diagonal\); got window_size=\(4, 3\)"),
    "causal_with_right_window_1": (dict(causal=True, window_size=(4, 1)), ValueError, r"causal=True means window_size\[1\] = 0 \(no key after the diagonal\); got window_size=\(4, 1\)"),
    "causal_with_right_only_1": (dict(causal=True, window_size=(-1, 1)), ValueError, r"causal=True means window_size\[1\] = 0.*got window_size=\(-1, 1\)"),
    "sinks_wrong_length": (dict(sinks=np.zeros(5, np.float32)), ValueError, r"sinks must have shape \(heads_q,\) = \(4,\); got sinks\.shape=\(5,\)"),
    "sinks_2d": (dict(sinks=np.zeros((1, 4), np.float32)), ValueError, r"sinks must have shape \(heads_q,\) = \(4,\); got sinks\.shape=\(1, 4\)"),
    # One sink per KV head (2) instead of per query head (4): a plausible GQA mix-up.
    "sinks_per_kv_head": (dict(sinks=np.zeros(2, np.float32)), ValueError, r"\(heads_q,\) = \(4,\); got sinks\.shape=\(2,\)"),
    "sinks_int": (dict(sinks=np.zeros(4, np.int32)), TypeError, r"sinks must be a floating-point array \(used as float32\); got sinks\.dtype=int32"),
    "sinks_bool": (dict(sinks=np.zeros(4, bool)), TypeError, r"sinks must be a floating-point array.*sinks\.dtype=bool"),
    "sinks_list": (dict(sinks=[0.0, 0.0, 0.0, 0.0]), TypeError, r"sinks must be None or an array of shape \(heads_q,\); got list"),
    "sinks_float": (dict(sinks=0.5), TypeError, r"sinks must be None or an array of shape \(heads_q,\); got float"),
    "causal_int": (dict(causal=1), TypeError, r"causal must be a Python bool; got causal=1\. Under jax\.jit, mark it static"),
    "causal_none": (dict(causal=None), TypeError, r"causal=None"),
    "return_lse_str": (dict(return_lse="yes"), TypeError, r"return_lse must be a Python bool.*'yes'"),
    "implementation_unknown": (dict(implementation="triton"), ValueError, r"implementation must be None, \"fa4\", \"cudnn\" or \"xla\"; got implementation='triton'"),
    "implementation_case": (dict(implementation="FA4"), ValueError, r"got implementation='FA4'"),
}


@pytest.fixture
def no_launch(monkeypatch):
    """Any bind of the primitive fails the test: validation must happen before it."""

    def bind(*args, **params):
        raise AssertionError("fa4_fwd was bound before the arguments were validated")

    monkeypatch.setattr(fa4_fwd_p, "bind", bind)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_rejected_before_launch(case, no_launch):
    make, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        attention(*make())


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_options_rejected_before_launch(case, no_launch):
    kwargs, error, message = BAD_OPTIONS[case]
    with pytest.raises(error, match=message):
        attention(*make_qkv(0), **kwargs)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(softmax_scale=-1.0), ValueError, r"softmax_scale must be finite and > 0"),
        (dict(softcap=-1.0), ValueError, r"softcap must be in \[0, 1e\+06\]"),
        (dict(window_size=(-3, 0)), ValueError, r"window_size values must be >= -1"),
        (dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks must have shape \(heads_q,\)"),
    ],
)
def test_bad_option_beats_fa4_availability(kwargs, error, message, no_launch):
    # A bad argument is reported as such even when the requested kernel could not run either.
    with pytest.raises(error, match=message):
        attention(*make_qkv(0), implementation="fa4", **kwargs)


def test_validation_precedes_the_device_probe(hopper, no_launch):
    # On a GPU host a bad argument must not first register targets or load a kernel.
    calls = hopper(built=default_menu())
    with pytest.raises(ValueError, match=r"causal=True means window_size\[1\] = 0"):
        attention(*make_qkv(0), causal=True, window_size=(3, 2))
    with pytest.raises(TypeError, match=r"sinks must be a floating-point array"):
        attention(*make_qkv(0), sinks=np.zeros(4, np.int8))
    assert calls == [], f"{calls=}"


def test_static_argnames_cover_every_option():
    # Every keyword but the one array (sinks) must be static under jit; a new option missing from
    # STATIC_ARGNAMES would make the documented jit recipe fail with a tracer error.
    params = inspect.signature(attention).parameters
    keyword_only = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(STATIC) == keyword_only - {"sinks"}, f"{STATIC=} {keyword_only=}"
    assert len(STATIC) == len(set(STATIC)) and STATIC is api.STATIC_ARGNAMES


def test_traced_arguments_explain_static_args():
    q, k, v = make_qkv(1)
    f = jax.jit(lambda q, k, v, s: attention(q, k, v, softmax_scale=s))
    with pytest.raises(TypeError, match=r"softmax_scale must be known at trace time.*static_argnames"):
        f(q, k, v, 0.1)
    g = jax.jit(lambda q, k, v, c: attention(q, k, v, causal=c))
    with pytest.raises(TypeError, match=r"causal must be a Python bool.*mark it static"):
        g(q, k, v, True)
    h = jax.jit(lambda q, k, v, c: attention(q, k, v, softcap=c))
    with pytest.raises(TypeError, match=r"softcap must be known at trace time.*static_argnames=\('softcap', \.\.\.\)"):
        h(q, k, v, 30.0)
    w = jax.jit(lambda q, k, v, left: attention(q, k, v, window_size=(left, 0)))
    message = r"window_size must be a pair of Python ints.*\(left is \w*Tracer\).*mark it static"
    with pytest.raises(TypeError, match=message):
        w(q, k, v, 8)


def test_concrete_array_scale_accepted():
    q, k, v = make_qkv(1)
    got = attention(q, k, v, softmax_scale=jnp.float32(0.3))
    want = attention(q, k, v, softmax_scale=0.3)
    np.testing.assert_array_equal(f64(got), f64(want))
    # Concrete NumPy scalars work for softcap and window bounds too.
    got = attention(q, k, v, softcap=np.float32(5.0), window_size=(np.int64(7), np.int32(-1)))
    want = attention(q, k, v, softcap=5.0, window_size=(7, -1))
    np.testing.assert_array_equal(f64(got), f64(want))


@pytest.mark.parametrize("scale", [1e4, 1.2e-38, float(np.finfo(np.float32).tiny)])
def test_softmax_scale_float32_edges_accepted(scale):
    # The documented range's ends are usable float32 scales (scale and scale * log2(e) both normal).
    q, k, v = make_qkv(1)
    (eqn,) = bound_primitives(functools.partial(attention, softmax_scale=scale), q, k, v)
    assert eqn.params["softmax_scale"] == scale, f"{eqn.params['softmax_scale']=}"


# -- semantics ----------------------------------------------------------------------------------

def test_default_softmax_scale_is_inverse_sqrt_head_dim():
    q, k, v = make_qkv(2, d=128)
    got = attention(q, k, v, causal=True)
    want, _ = attention_reference(q, k, v, causal=True, softmax_scale=1 / math.sqrt(128))
    np.testing.assert_array_equal(f64(got), f64(want))


def test_softmax_scale_override():
    q, k, v = make_qkv(3)
    got = attention(q, k, v, softmax_scale=0.3)
    want, _ = attention_reference(q, k, v, causal=False, softmax_scale=0.3)
    np.testing.assert_array_equal(f64(got), f64(want))
    default = attention(q, k, v)
    assert np.abs(f64(got) - f64(default)).max() > 0.05  # the scale is honoured, not ignored


@pytest.mark.parametrize("causal,s_q,s_k", [(False, 24, 40), (False, 40, 24), (True, 40, 40), (True, 24, 40)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_agrees_with_jax_nn_attention(causal, s_q, s_k, dtype):
    """An independent implementation. jax.nn's causal mask is top-left aligned (query i sees keys
    j <= i), ours bottom-right (j <= i + s_k - s_q): for s_q < s_k, jax.nn runs on q padded on the
    left to s_k rows, where the two alignments coincide, and the last s_q rows are compared. (Causal
    with s_q > s_k leaves rows without keys, which jax.nn does not define as o = 0: not compared.)

    Tolerance, per element: ours is the exact result rounded once (<= u |o|, u the unit roundoff);
    jax.nn rounds P to the input dtype before P @ V (<= u (P |V|)) and rounds its output (<= u |o|).
    So |ours - jax.nn| <= u (2 |o| + P |V|) + float32 noise, computed from the float64 oracle."""
    q, k, v = make_qkv(4 + causal + s_q, s_q=s_q, s_k=s_k, dtype=dtype)
    got = f64(attention(q, k, v, causal=causal))
    if causal and s_q < s_k:
        pad = np.zeros((q.shape[0], s_k - s_q, *q.shape[2:]), q.dtype)
        want = jax.nn.dot_product_attention(np.concatenate([pad, q], axis=1), k, v, is_causal=True,
                                            implementation="xla")[:, s_k - s_q:]
    else:
        want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    want = f64(want)
    u = {jnp.bfloat16: BF16_U, jnp.float16: 2.0**-11}[dtype]
    o, _ = attention_oracle(q, k, v, softmax_scale=1 / 8, causal=causal, xp=np)
    p_abs_v, _ = attention_oracle(q, k, np.abs(f64(v)), softmax_scale=1 / 8, causal=causal, xp=np)
    bound = 1.01 * u * (2 * np.abs(o) + p_abs_v) + F32_ATOL
    worst = np.unravel_index(np.argmax(np.abs(got - want) / bound), got.shape)
    assert (np.abs(got - want) <= bound).all(), f"at {worst}: {got[worst]} vs jax.nn {want[worst]}, bound {bound[worst]}"


def test_large_scores_against_oracle():
    # Scores of a few hundred (q, k ~ N(0, 64), softmax_scale 1/8): exp() of an unshifted score
    # overflows float32 (above ~88), so only a softmax that subtracts the row maximum survives.
    q, k, v = make_qkv(40, s_q=24, s_k=40)
    q, k = (np.asarray(8 * f64(x), np.float32).astype(jnp.bfloat16) for x in (q, k))
    for kwargs in (dict(), dict(causal=True, sinks=make_sinks(41))):
        o, lse = attention(q, k, v, return_lse=True, **kwargs)
        o_want, lse_want = attention_oracle(q, k, v, softmax_scale=1 / 8, xp=np, **kwargs)
        assert np.abs(lse_want).max() > 100, "the scores are not large"
        np.testing.assert_allclose(f64(o), o_want, rtol=1.01 * BF16_U, atol=F32_ATOL, err_msg=f"{kwargs}")
        # LSE ~ the largest score: float32 resolves it to ~1e-7 relative.
        np.testing.assert_allclose(lse, lse_want, rtol=1e-6, atol=LSE_ATOL, err_msg=f"{kwargs}")


def test_return_lse():
    q, k, v = make_qkv(5, b=3, s_q=17, s_k=9, h_q=8, h_k=1)
    o = attention(q, k, v, causal=True)
    o2, lse = attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(o, jax.Array) and o.shape == q.shape and o.dtype == q.dtype
    assert o2.shape == q.shape and o2.dtype == q.dtype
    assert lse.shape == (3, 8, 17) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(f64(o), f64(o2))
    _, lse_want = attention_reference(q, k, v, causal=True, softmax_scale=1 / 8)
    np.testing.assert_array_equal(lse, lse_want)
    assert np.isneginf(lse[:, :, : 17 - 9]).all() and np.isfinite(lse[:, :, 17 - 9 :]).all()


def test_new_options_reach_the_computation():
    # Window, softcap and sinks are passed through unchanged: the same numbers as the reference
    # given the same arguments (left/right swapped, or a dropped option, would not be).
    q, k, v = make_qkv(20, s_q=24, s_k=40, h_q=4, h_k=2)
    kwargs = dict(softmax_scale=0.2, window_size=(7, 2), softcap=5.0)
    sinks = make_sinks(21)
    o, lse = attention(q, k, v, sinks=sinks, return_lse=True, **kwargs)
    o_ref, lse_ref = attention_reference(q, k, v, sinks=sinks, **kwargs)
    np.testing.assert_array_equal(f64(o), f64(o_ref))
    np.testing.assert_array_equal(lse, lse_ref)
    # ... and right, against the shared float64 oracle.
    o_want, lse_want = attention_oracle(q, k, v, sinks=sinks, xp=np, **kwargs)
    np.testing.assert_allclose(f64(o), o_want, rtol=1.01 * BF16_U, atol=F32_ATOL)
    np.testing.assert_allclose(lse, lse_want, rtol=0, atol=LSE_ATOL)


def test_sinks_are_used_as_float32():
    # A bf16 sinks array means its float32 value (documented: "used as float32").
    q, k, v = make_qkv(22)
    sinks = make_sinks(23).astype(jnp.bfloat16)
    got = attention(q, k, v, sinks=sinks, return_lse=True)
    want = attention(q, k, v, sinks=sinks.astype(np.float32), return_lse=True)
    np.testing.assert_array_equal(f64(got[0]), f64(want[0]))
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("left", [-1, 5])
def test_causal_is_window_right_zero(left):
    # causal=True with right = -1 means right = 0: all three spellings are one computation.
    q, k, v = make_qkv(24, s_q=24, s_k=40)
    spellings = [
        dict(causal=True, window_size=(left, -1)),
        dict(causal=True, window_size=(left, 0)),
        dict(causal=False, window_size=(left, 0)),
    ]
    outs = [attention(q, k, v, return_lse=True, **kw) for kw in spellings]
    for kw, (o, lse) in zip(spellings[1:], outs[1:]):
        np.testing.assert_array_equal(f64(o), f64(outs[0][0]), err_msg=f"{kw=}")
        np.testing.assert_array_equal(lse, outs[0][1], err_msg=f"{kw=}")
    params = [bound_primitives(functools.partial(attention, **kw), q, k, v)[0].params for kw in spellings]
    assert all((p["window_left"], p["window_right"]) == (left, 0) for p in params), f"{params=}"


# (s_q, s_k, kwargs) -> the (window_left, window_right) the primitive is bound with. A side that
# reaches past every key (left >= s_k - 1, right >= s_q - 1) is trimmed to -1.
TRIMS = {
    "left_covers": (24, 40, dict(window_size=(39, -1)), (-1, -1)),
    "left_one_short": (24, 40, dict(window_size=(38, -1)), (38, -1)),
    "right_covers": (24, 40, dict(window_size=(-1, 23)), (-1, -1)),
    "right_one_short": (24, 40, dict(window_size=(-1, 22)), (-1, 22)),
    "both_huge": (24, 40, dict(window_size=(10**6, 10**6)), (-1, -1)),
    "left_covers_right_zero": (24, 40, dict(window_size=(39, 0)), (-1, 0)),
    "causal_left_covers": (24, 40, dict(causal=True, window_size=(100, -1)), (-1, 0)),
    "causal_left_one_short": (24, 40, dict(causal=True, window_size=(38, -1)), (38, 0)),
    # One query row sits on the last key: causal hides nothing there.
    "causal_decode": (1, 40, dict(causal=True), (-1, -1)),
    "right_covers_more_queries_than_keys": (40, 24, dict(window_size=(3, 39)), (3, -1)),
}


@pytest.mark.parametrize("case", sorted(TRIMS))
def test_window_trimming(case):
    s_q, s_k, kwargs, want = TRIMS[case]
    q, k, v = make_qkv(25, s_q=s_q, s_k=s_k)
    (eqn,) = bound_primitives(functools.partial(attention, **kwargs), q, k, v)
    assert (eqn.params["window_left"], eqn.params["window_right"]) == want, f"{eqn.params=}"


def test_window_covering_everything_equals_no_window():
    q, k, v = make_qkv(26, s_q=24, s_k=40)
    plain = attention(q, k, v, return_lse=True)
    for window in [(39, 23), (500, -1), (-1, 500)]:
        o, lse = attention(q, k, v, window_size=window, return_lse=True)
        np.testing.assert_array_equal(f64(o), f64(plain[0]), err_msg=f"{window=}")
        np.testing.assert_array_equal(lse, plain[1], err_msg=f"{window=}")
    causal = attention(q, k, v, causal=True, return_lse=True)
    o, lse = attention(q, k, v, causal=True, window_size=(39, -1), return_lse=True)
    np.testing.assert_array_equal(f64(o), f64(causal[0]))
    np.testing.assert_array_equal(lse, causal[1])


@pytest.mark.parametrize("b,s_q,s_k", [(0, 24, 40), (2, 0, 40), (2, 24, 0), (0, 0, 0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_zero_size_inputs(b, s_q, s_k, with_sinks):
    # Like jax.nn: empty batch/queries give empty outputs, no keys gives rows that see nothing.
    q, k, v = make_qkv(27, b=b, s_q=s_q, s_k=s_k)
    sinks = make_sinks(28) if with_sinks else None
    for f in (attention, jax.jit(attention, static_argnames=STATIC)):
        o, lse = f(q, k, v, causal=True, sinks=sinks, return_lse=True)
        check_empty_result(o, lse, b=b, s_q=s_q, h_q=4, d=64, dtype=jnp.bfloat16, sinks=sinks)


# -- implementation choice ----------------------------------------------------------------------

def test_fa4_on_cpu_raises_clear_error():
    # Traced fine (it could be exported for CUDA), but lowered for this CPU: the kernel cannot run.
    with pytest.raises(RuntimeError, match=r'implementation="fa4" cannot run here: (the program is lowered for cpu, '
                                           r'not an NVIDIA Hopper GPU|the kernel library)'):
        attention(*make_qkv(6), implementation="fa4")


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_cpu_runs_xla(implementation):
    q, k, v = make_qkv(7)
    (eqn,) = bound_primitives(functools.partial(attention, implementation=implementation), q, k, v)
    # None is decided per platform when lowering ("auto"): here, for the CPU, the reference.
    assert eqn.params["implementation"] == ("auto" if implementation is None else "xla")
    hlo = jax.jit(functools.partial(attention, implementation=implementation)).lower(q, k, v).compile().as_text()
    assert "fa4_jax_" not in hlo  # no kernel call (FFI targets are named fa4_jax_<family>_v<N>)
    want, _ = attention_reference(q, k, v, softmax_scale=1 / 8)
    np.testing.assert_array_equal(f64(attention(q, k, v, implementation=implementation)), f64(want))


class FakeDevice:
    platform = "gpu"
    id = 0
    local_hardware_id = 3

    def __init__(self, capability="9.0", kind="NVIDIA H200"):
        self.compute_capability = capability
        self.device_kind = kind


def fake_ffi(built=(), status="loaded /opt/libfa4_jax.so", registers=True, load_error=None):
    """Stands in for fa4_jax.core.library (contract: compiled_variants, register_targets, library_status,
    prepare_variant)."""
    calls = []
    module = types.SimpleNamespace(
        library_status=lambda: status,
        compiled_variants=lambda: frozenset(built),
        register_targets=lambda: calls.append("register") or registers,
        prepare_variant=lambda variant, ordinal: calls.append(("prepare", variant.symbol, ordinal)) or load_error,
    )
    return module, calls


@pytest.fixture
def hopper(monkeypatch):
    """Pretends the default device is an H200 and installs a fake FFI loader; returns the installer."""
    monkeypatch.setattr(_platform, "default_device", lambda: FakeDevice())

    def install(**kw):
        module, calls = fake_ffi(**kw)
        monkeypatch.setitem(sys.modules, "fa4_jax.core.library", module)
        monkeypatch.setattr(fa4_jax.core, "library", module, raising=False)
        return calls

    return install


def falls_back(variant, device=None) -> bool:
    """Whether implementation=None runs the reference when lowered for CUDA on `device` (the fake
    H200 by default): the question fa4_jax.core.lowering asks fa4_jax.core.platform."""
    return _platform.lowering_reason(variant, [device or FakeDevice()]) is not None


def test_resolves_fa4_when_variant_built(hopper):
    calls = hopper(built=[FwdVariant("sm90", "bf16", 64, "causal", False)])
    q, k, v = make_qkv(8)
    assert api.resolve_implementation(None, variant_fn(mask="causal")) == "auto"
    assert not falls_back(variant_fn(mask="causal"))
    # Registered, then loaded on the device's CUDA ordinal, before the kernel is chosen.
    assert calls == ["register", ("prepare", "fa4_fwd_sm90_bf16_hd64_causal", 3)], calls
    assert api.resolve_implementation("fa4", variant_fn(mask="causal")) == "fa4"


@pytest.mark.parametrize("capability,kind,arch", [("9.0", "NVIDIA H200", "sm90"), ("10.0", "NVIDIA B200", "sm100")])
def test_kvcache_dispatch_picks_the_devices_architecture(monkeypatch, capability, kind, arch):
    # A KV-cache call asks for the variant of the GPU's own architecture (issue 16's SM100 kernels on a
    # B200, the SM90 ones on an H200), page pieces included; on Blackwell only implementation="fa4"
    # picks it (not validated on hardware yet). A library built without the one-row variant of the
    # device's architecture names it.
    from fa4_jax.ops.kvcache.spec import KVCacheVariant

    built = [KVCacheVariant(a, "bf16", 128, "local", False, True, 64, rows)
             for a in ("sm90", "sm100") for rows in ((16, 1) if a == "sm90" else (16,))]
    module, calls = fake_ffi(built=built)
    monkeypatch.setitem(sys.modules, "fa4_jax.core.library", module)
    monkeypatch.setattr(fa4_jax.core, "library", module, raising=False)
    device = FakeDevice(capability, kind)
    paged = lambda rows: lambda a: KVCacheVariant(a, "bf16", 128, "local", False, True, 64, rows)  # noqa: E731
    assert _platform.unavailable_reason(paged(16), device) is None
    assert calls[-1] == ("prepare", f"fa4_kvcache_{arch}_bf16_hd128_local_paged", 3), calls
    assert (_platform.unvalidated_reason(device) is None) == (arch == "sm90")
    reason = _platform.unavailable_reason(paged(1), device)
    if arch == "sm90":
        assert reason is None
    else:
        assert reason.startswith("the kernel library has no variant fa4_kvcache_sm100_bf16_hd128_local_paged_rows1 "), reason


def test_missing_variant(hopper):
    hopper(built=[FwdVariant("sm90", "bf16", 64, "causal", False)])
    q, k, v = make_qkv(9)
    assert falls_back(variant_fn())
    message = (r"no variant fa4_fwd_sm90_bf16_hd64_full \(it has 1 of its family: fa4_fwd_sm90_bf16_hd64_causal\)\. "
               r"Rebuild with that variant in FA4_JAX_VARIANTS")
    with pytest.raises(RuntimeError, match=message):
        attention(q, k, v, implementation="fa4")
    # The softcap kernel is a separate variant: having the plain one does not serve a capped call.
    with pytest.raises(RuntimeError, match=r"no variant fa4_fwd_sm90_bf16_hd64_causal_softcap "):
        attention(q, k, v, causal=True, softcap=30.0, implementation="fa4")


@pytest.mark.parametrize(
    "ffi_kwargs,message",
    [
        (dict(status="libfa4_jax.so was not built (looked for ...)"), r"library is unavailable: libfa4_jax.so was not built"),
        (
            dict(built=[FwdVariant("sm90", "fp16", 128, "full", False)], registers=False, status="jax said no"),
            r"registering the FFI targets failed: jax said no",
        ),
    ],
)
def test_library_problems(hopper, ffi_kwargs, message):
    hopper(**ffi_kwargs)
    q, k, v = make_qkv(10, d=128, dtype=jnp.float16)
    assert falls_back(variant_fn("fp16", 128))
    with pytest.raises(RuntimeError, match=message):
        attention(q, k, v, implementation="fa4")


def test_module_load_failure_falls_back(hopper):
    # The library and variant are there, but the kernel does not load on this device (a broken
    # driver, an exclusive-process GPU): None must pick the XLA path, "fa4" must say why.
    calls = hopper(built=[FwdVariant("sm90", "bf16", 64, "full", False)], load_error="cudaErrorNoKernelImageForDevice")
    q, k, v = make_qkv(9)
    assert falls_back(variant_fn())
    with pytest.raises(RuntimeError, match=r"fa4_fwd_sm90_bf16_hd64_full does not load on NVIDIA H200 \(device 0\): cudaErrorNoKernelImageForDevice"):
        attention(q, k, v, implementation="fa4")
    assert ("prepare", "fa4_fwd_sm90_bf16_hd64_full", 3) in calls


def test_non_hopper_gpu(monkeypatch):
    monkeypatch.setattr(_platform, "default_device", lambda: FakeDevice("8.0", "NVIDIA A100"))
    q, k, v = make_qkv(11)
    assert falls_back(variant_fn(), FakeDevice("8.0", "NVIDIA A100"))
    message = r"the default GPU \(NVIDIA A100\) has compute capability 8\.0; the fa4_jax kernels are built for 9\.0 \(Hopper\), 10\.0 \(Blackwell\) only"
    with pytest.raises(RuntimeError, match=message):
        attention(q, k, v, implementation="fa4")


def test_missing_ffi_module(monkeypatch):
    monkeypatch.setattr(_platform, "default_device", lambda: FakeDevice())
    monkeypatch.setitem(sys.modules, "fa4_jax.core.library", None)  # makes the import raise ImportError
    monkeypatch.delattr(fa4_jax.core, "library", raising=False)
    q, k, v = make_qkv(12)
    assert falls_back(variant_fn())
    with pytest.raises(RuntimeError, match=r"the FFI loader fa4_jax\.core\.library cannot be imported"):
        attention(q, k, v, implementation="fa4")


# (make_qkv kwargs, attention kwargs) -> the kernel symbol the call asks the library for.
VARIANTS = {
    "plain": (dict(), dict(), "fa4_fwd_sm90_bf16_hd64_full"),
    "causal": (dict(), dict(causal=True), "fa4_fwd_sm90_bf16_hd64_causal"),
    "window_left_right0": (dict(), dict(window_size=(100, 0)), "fa4_fwd_sm90_bf16_hd64_local"),
    "window_right_only": (dict(), dict(window_size=(-1, 5)), "fa4_fwd_sm90_bf16_hd64_local"),
    "causal_with_left": (dict(), dict(causal=True, window_size=(100, -1)), "fa4_fwd_sm90_bf16_hd64_local"),
    "softcap": (dict(), dict(softcap=30.0), "fa4_fwd_sm90_bf16_hd64_full_softcap"),
    "causal_softcap": (dict(), dict(causal=True, softcap=30.0), "fa4_fwd_sm90_bf16_hd64_causal_softcap"),
    "local_softcap": (dict(), dict(window_size=(8, 8), softcap=30.0), "fa4_fwd_sm90_bf16_hd64_local_softcap"),
    "softcap_zero_is_off": (dict(), dict(softcap=0.0), "fa4_fwd_sm90_bf16_hd64_full"),
    # Sinks are a kernel operand, not a variant.
    "sinks": (dict(), dict(sinks=np.zeros(4, np.float32)), "fa4_fwd_sm90_bf16_hd64_full"),
    # Bounds that reach past every key (s_k = 128) are trimmed: the plain / causal kernel serves them.
    "window_covers_every_key": (dict(), dict(window_size=(127, -1)), "fa4_fwd_sm90_bf16_hd64_full"),
    "window_covers_left_right0": (dict(), dict(window_size=(500, 0)), "fa4_fwd_sm90_bf16_hd64_causal"),
    "causal_left_covers": (dict(), dict(causal=True, window_size=(127, -1)), "fa4_fwd_sm90_bf16_hd64_causal"),
    "window_one_short": (dict(), dict(window_size=(126, -1)), "fa4_fwd_sm90_bf16_hd64_local"),
    "causal_decode": (dict(s_q=1), dict(causal=True), "fa4_fwd_sm90_bf16_hd64_full"),
    "fp16_hd128": (dict(d=128, dtype=jnp.float16), dict(window_size=(9, 0), softcap=5.0), "fa4_fwd_sm90_fp16_hd128_local_softcap"),
}


@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_variant_reflects_mask_and_softcap(hopper, case):
    # Every variant is "built": the one the fake library is asked to load is the one the call needs.
    shape_kw, kwargs, symbol = VARIANTS[case]
    calls = hopper(built=default_menu())
    q, k, v = make_qkv(29, **{"s_q": 24, "s_k": 128, **shape_kw})
    (eqn,) = bound_primitives(functools.partial(attention, implementation="fa4", **kwargs), q, k, v)
    assert calls == ["register", ("prepare", symbol, 3)], f"{calls=}"
    assert eqn.params["implementation"] == "fa4"


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(window_size=(16, 0)), dict(window_size=(-1, 3)),
                                    dict(causal=True, window_size=(7, -1))],
                         ids=["none", "causal", "causal_window", "right_window", "causal_left"])
@pytest.mark.parametrize("s_q", [1, 24])
def test_kvcache_calls_of_every_window_need_the_local_variant(hopper, kwargs, s_q):
    # The KV-cache family compiles one mask kind (spec.MASK): the plain and causal calls too are served
    # by the window kernel, the handler bounding an unbounded side by the keys.
    calls = hopper(built=default_menu())
    q, k, v = make_qkv(31, s_q=s_q, s_k=96)
    lens = jnp.asarray([96, 50], jnp.int32)
    jax.make_jaxpr(functools.partial(fa4_jax.attention_with_kvcache, implementation="fa4", **kwargs))(q, k, v, lens)
    assert calls == ["register", ("prepare", "fa4_kvcache_sm90_bf16_hd64_local", 3)], f"{calls=}"


# -- transformations ----------------------------------------------------------------------------

def test_jit_with_static_arguments():
    q, k, v = make_qkv(13, s_q=33, s_k=20)
    f = jax.jit(attention, static_argnames=STATIC)
    o, lse = f(q, k, v, causal=True, softmax_scale=0.2, return_lse=True, implementation="xla")
    o_eager, lse_eager = attention(q, k, v, causal=True, softmax_scale=0.2, return_lse=True)
    np.testing.assert_array_equal(f64(o), f64(o_eager))
    np.testing.assert_array_equal(lse, lse_eager)


def test_sinks_may_be_traced():
    # sinks is an array argument (e.g. a learned parameter): traced under jit, not static.
    q, k, v = make_qkv(30, s_q=33, s_k=20)
    kwargs = dict(causal=True, window_size=(9, -1), softcap=7.0, return_lse=True)
    f = jax.jit(attention, static_argnames=STATIC)
    for seed in (31, 32):
        sinks = jnp.asarray(make_sinks(seed))
        o, lse = f(q, k, v, sinks=sinks, **kwargs)
        o_eager, lse_eager = attention(q, k, v, sinks=np.asarray(sinks), **kwargs)
        np.testing.assert_array_equal(f64(o), f64(o_eager), err_msg=f"{seed=}")
        np.testing.assert_array_equal(lse, lse_eager, err_msg=f"{seed=}")
    # The sinks reach the primitive as an operand, not a baked-in constant.
    jaxpr = jax.make_jaxpr(lambda q, k, v, s: attention(q, k, v, sinks=s))(q, k, v, sinks)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is fa4_fwd_p]
    assert eqn.invars[3] is jaxpr.jaxpr.invars[3] and eqn.params["has_sinks"] is True


def test_eval_shape():
    q = jax.ShapeDtypeStruct((2, 1000, 16, 128), jnp.float16)
    kv = jax.ShapeDtypeStruct((2, 3000, 4, 128), jnp.float16)
    o, lse = jax.eval_shape(functools.partial(attention, causal=True, return_lse=True), q, kv, kv)
    assert (o.shape, o.dtype) == ((2, 1000, 16, 128), jnp.float16)
    assert (lse.shape, lse.dtype) == ((2, 16, 1000), jnp.float32)
    with pytest.raises(ValueError, match=r"q, k and v must share head_dim"):
        jax.eval_shape(attention, q, jax.ShapeDtypeStruct((2, 3000, 4, 64), jnp.float16), kv)
    sinks = jax.ShapeDtypeStruct((16,), jnp.float32)
    f = functools.partial(attention, window_size=(256, 0), softcap=50.0, return_lse=True)
    o, lse = jax.eval_shape(f, q, kv, kv, sinks=sinks)
    assert (o.shape, lse.shape) == ((2, 1000, 16, 128), (2, 16, 1000))


# in_axes for (q, k, v[, sinks]) -> how the batching rule folds the mapped axis into one launch:
# "shared_kv" into the query heads (K/V read as they are), "batch" into the batch axis, "heads" into
# the heads of q, k, v and sinks (per-slice sinks cannot share a batch-folded launch).
VMAP_CASES = {
    "q_only_axis1": ((1, None, None), "shared_kv"),
    "q_only_shared_sinks": ((0, None, None, None), "shared_kv"),
    "q_and_sinks": ((0, None, None, 0), "shared_kv"),
    "sinks_only": ((None, None, None, 0), "shared_kv"),
    "all_batched": ((0, 0, 0), "batch"),
    "all_batched_shared_sinks": ((0, 0, 0, None), "batch"),
    "kv_only_axis2": ((None, 2, 2), "batch"),
    "k_only": ((None, 0, None, None), "batch"),
    "all_and_sinks": ((0, 0, 0, 0), "heads"),
    "kv_and_sinks_axis1": ((None, 1, 1, 0), "heads"),
}


@pytest.mark.parametrize("case", sorted(VMAP_CASES))
def test_vmap_matches_loop(case):
    in_axes, fold = VMAP_CASES[case]
    n, b, s_q, s_k, h_q, h_k, d = 3, 2, 9, 14, 4, 2, 64
    rng = np.random.default_rng(14)

    def operand(axis, shape, dtype=jnp.bfloat16):
        shape = list(shape)
        if axis is not None:
            shape.insert(axis, n)
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    args = [
        operand(in_axes[0], (b, s_q, h_q, d)),
        operand(in_axes[1], (b, s_k, h_k, d)),
        operand(in_axes[2], (b, s_k, h_k, d)),
    ]
    if len(in_axes) == 4:
        args.append(operand(in_axes[3], (h_q,), np.float32))
    # GQA, a window, a cap and (maybe) sinks: every param must survive the folding.
    f = lambda q, k, v, sinks=None: attention(q, k, v, causal=True, window_size=(6, -1), softcap=4.0, sinks=sinks,
                                              return_lse=True)
    o, lse = jax.vmap(f, in_axes=in_axes)(*args)
    assert o.shape == (n, b, s_q, h_q, d) and lse.shape == (n, b, h_q, s_q), f"{o.shape=} {lse.shape=}"

    take = lambda x, axis, i: x if axis is None else np.take(x, i, axis=axis)
    for i in range(n):
        o_i, lse_i = f(*(take(x, a, i) for x, a in zip(args, in_axes)))
        np.testing.assert_array_equal(f64(o[i]), f64(o_i), err_msg=f"slice {i=}")
        np.testing.assert_array_equal(lse[i], lse_i, err_msg=f"slice {i=}")

    # One launch over the folded axis, not a loop of n launches.
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(*args).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is fa4_fwd_p]
    shapes = [x.aval.shape for x in eqn.invars]
    if fold == "shared_kv":
        assert shapes[:3] == [(b, s_q, n * h_q, d), (b, s_k, h_k, d), (b, s_k, h_k, d)], f"{shapes=}"
        # K and V go in as the caller's arrays: no broadcast, no copy of the KV cache.
        assert eqn.invars[1] is jaxpr.invars[1] and eqn.invars[2] is jaxpr.invars[2]
    elif fold == "batch":
        assert shapes[:3] == [(n * b, s_q, h_q, d), (n * b, s_k, h_k, d), (n * b, s_k, h_k, d)], f"{shapes=}"
    else:
        assert shapes[:3] == [(b, s_q, n * h_q, d), (b, s_k, n * h_k, d), (b, s_k, n * h_k, d)], f"{shapes=}"
    if len(in_axes) == 4:
        assert shapes[3] == ((h_q,) if fold == "batch" else (n * h_q,)), f"{shapes=}"


def test_nested_vmap():
    q, k, v = make_qkv(15, b=2, s_q=5, s_k=6)
    stack = lambda x: np.stack([x, x[::-1]])  # (2, b, ...): two different outer slices
    f = jax.vmap(jax.vmap(attention))
    o = f(stack(q)[:, :, None], stack(k)[:, :, None], stack(v)[:, :, None])
    assert o.shape == (2, 2, 1, 5, 4, 64)
    np.testing.assert_array_equal(f64(o[1, 0, 0]), f64(attention(q[1:], k[1:], v[1:])[0]))


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, q: jax.grad(lambda q: f(q).astype(jnp.float32).sum())(q),
        lambda f, q: jax.jvp(f, (q,), (q,)),
        lambda f, q: jax.jit(jax.vjp, static_argnums=0)(f, q),
    ],
    ids=["grad", "jvp", "jit_vjp"],
)
def test_differentiation_is_refused(transform):
    q, k, v = make_qkv(16)
    f = lambda q: attention(q, k, v)
    with pytest.raises(NotImplementedError, match="inference-only.*jax.nn.dot_product_attention"):
        transform(f, q)


def test_differentiation_through_new_options_is_refused():
    # Sinks are a differentiable-looking array argument; their gradient is refused just the same.
    q, k, v = make_qkv(17)
    loss = lambda s: attention(q, k, v, sinks=s, window_size=(5, 5), softcap=3.0).astype(jnp.float32).sum()
    with pytest.raises(NotImplementedError, match="inference-only.*jax.nn.dot_product_attention"):
        jax.grad(loss)(jnp.asarray(make_sinks(18)))
