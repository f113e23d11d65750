"""The public API on CPU: validation, defaults, implementation choice and JAX transformations."""

from __future__ import annotations

import functools
import importlib
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import FwdVariant, _platform, attention, attention_reference
from fa4_jax.primitive import fa4_fwd_p

# `fa4_jax.attention` the attribute is the function; the module is only reachable by its import name.
api = importlib.import_module("fa4_jax.attention")

STATIC = ("causal", "softmax_scale", "return_lse", "implementation")
BF16_U = 2.0**-8


def make_qkv(seed, *, b=2, s_q=24, s_k=40, h_q=4, h_k=2, d=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    draw = lambda s, h, dd=d: rng.standard_normal((b, s, h, dd), dtype=np.float32).astype(dtype)
    return draw(s_q, h_q), draw(s_k, h_k), draw(s_k, h_k)


def f64(x):
    return np.asarray(x, np.float64)


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
    "empty_seqlen_q": (_replace("q", dims={1: 0}), ValueError, r"every dimension of q must be >= 1"),
    "empty_seqlen_k": (_replace("kv", dims={1: 0}), ValueError, r"every dimension of k must be >= 1"),
    "list_input": (lambda: [make_qkv(0)[0].tolist(), *make_qkv(0)[1:]], TypeError, r"q must be an array"),
}

BAD_OPTIONS = {
    "scale_zero": (dict(softmax_scale=0.0), ValueError, r"finite and > 0.*softmax_scale=0\.0"),
    "scale_negative": (dict(softmax_scale=-0.125), ValueError, r"softmax_scale=-0\.125"),
    "scale_nan": (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale=nan"),
    "scale_inf": (dict(softmax_scale=math.inf), ValueError, r"softmax_scale=inf"),
    "scale_str": (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a Python float; got '0\.1'"),
    "scale_bool": (dict(softmax_scale=True), TypeError, r"softmax_scale must be a Python float"),
    "scale_vector": (dict(softmax_scale=np.array([0.1, 0.2])), TypeError, r"scalar"),
    "causal_int": (dict(causal=1), TypeError, r"causal must be a Python bool; got causal=1\. Under jax\.jit, mark it static"),
    "causal_none": (dict(causal=None), TypeError, r"causal=None"),
    "return_lse_str": (dict(return_lse="yes"), TypeError, r"return_lse must be a Python bool.*'yes'"),
    "implementation_unknown": (dict(implementation="cudnn"), ValueError, r"implementation must be None, \"fa4\" or \"xla\"; got implementation='cudnn'"),
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


def test_bad_option_beats_fa4_availability(no_launch):
    # A bad scale is reported as such even when the requested kernel could not run either.
    with pytest.raises(ValueError, match="softmax_scale"):
        attention(*make_qkv(0), softmax_scale=-1.0, implementation="fa4")


def test_traced_arguments_explain_static_args():
    q, k, v = make_qkv(1)
    f = jax.jit(lambda q, k, v, s: attention(q, k, v, softmax_scale=s))
    with pytest.raises(TypeError, match=r"softmax_scale must be known at trace time.*static_argnames"):
        f(q, k, v, 0.1)
    g = jax.jit(lambda q, k, v, c: attention(q, k, v, causal=c))
    with pytest.raises(TypeError, match=r"causal must be a Python bool.*mark it static"):
        g(q, k, v, True)


def test_concrete_array_scale_accepted():
    q, k, v = make_qkv(1)
    got = attention(q, k, v, softmax_scale=jnp.float32(0.3))
    want = attention(q, k, v, softmax_scale=0.3)
    np.testing.assert_array_equal(f64(got), f64(want))


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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_agrees_with_jax_nn_attention(causal, dtype):
    # An independent implementation; with s_q == s_k its top-left causal mask equals ours.
    q, k, v = make_qkv(4 + causal, s_q=40, s_k=40, dtype=dtype)
    got = f64(attention(q, k, v, causal=causal))
    want = f64(jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"))
    u = {jnp.bfloat16: BF16_U, jnp.float16: 2.0**-11}[dtype]
    # Both round to the same dtype, jax.nn also rounds its softmax: a few units of roundoff apart.
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * u * np.abs(want).max())


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


# -- implementation choice ----------------------------------------------------------------------

def test_fa4_on_cpu_raises_clear_error():
    with pytest.raises(RuntimeError, match=r'implementation="fa4" cannot run here: .*not an NVIDIA Hopper GPU'):
        attention(*make_qkv(6), implementation="fa4")


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_cpu_runs_xla(implementation):
    q, k, v = make_qkv(7)
    (eqn,) = bound_primitives(functools.partial(attention, implementation=implementation), q, k, v)
    assert eqn.params["implementation"] == "xla"


class FakeDevice:
    platform = "gpu"
    id = 0
    local_hardware_id = 3

    def __init__(self, capability="9.0", kind="NVIDIA H200"):
        self.compute_capability = capability
        self.device_kind = kind


def fake_ffi(built=(), status="loaded /opt/libfa4_jax.so", registers=True, load_error=None):
    """Stands in for fa4_jax._ffi (contract: compiled_variants, register_targets, library_status,
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
        monkeypatch.setitem(sys.modules, "fa4_jax._ffi", module)
        monkeypatch.setattr(fa4_jax, "_ffi", module, raising=False)
        return calls

    return install


def test_resolves_fa4_when_variant_built(hopper):
    calls = hopper(built=[FwdVariant("sm90", "bf16", 64, True)])
    q, k, v = make_qkv(8)
    assert api.resolve_implementation(None, dtype=q.dtype, head_dim=64, causal=True) == "fa4"
    # Registered, then loaded on the device's CUDA ordinal, before the kernel is chosen.
    assert calls == ["register", ("prepare", "fa4_fwd_sm90_bf16_hd64_causal", 3)], calls
    # Bound with "fa4", but compiled here for CPU: the platform-specific lowering falls back to the
    # reference, so the result is still right.
    (eqn,) = bound_primitives(functools.partial(attention, causal=True), q, k, v)
    assert eqn.params["implementation"] == "fa4"
    want, _ = attention_reference(q, k, v, causal=True, softmax_scale=1 / 8)
    np.testing.assert_array_equal(f64(attention(q, k, v, causal=True)), f64(want))


def test_missing_variant(hopper):
    hopper(built=[FwdVariant("sm90", "bf16", 64, True)])
    q, k, v = make_qkv(9)
    assert api.resolve_implementation(None, dtype=q.dtype, head_dim=64, causal=False) == "xla"
    with pytest.raises(RuntimeError, match=r"no variant fa4_fwd_sm90_bf16_hd64_full.*fa4_fwd_sm90_bf16_hd64_causal.*FA4_JAX_VARIANTS"):
        attention(q, k, v, implementation="fa4")


@pytest.mark.parametrize(
    "ffi_kwargs,message",
    [
        (dict(status="libfa4_jax.so was not built (looked for ...)"), r"library is unavailable: libfa4_jax.so was not built"),
        (
            dict(built=[FwdVariant("sm90", "fp16", 128, False)], registers=False, status="jax said no"),
            r"registering the FFI targets failed: jax said no",
        ),
    ],
)
def test_library_problems(hopper, ffi_kwargs, message):
    hopper(**ffi_kwargs)
    q, k, v = make_qkv(10, d=128, dtype=jnp.float16)
    assert api.resolve_implementation(None, dtype=q.dtype, head_dim=128, causal=False) == "xla"
    with pytest.raises(RuntimeError, match=message):
        attention(q, k, v, implementation="fa4")


def test_module_load_failure_falls_back(hopper):
    # The library and variant are there, but the kernel does not load on this device (a broken
    # driver, an exclusive-process GPU): None must pick the XLA path, "fa4" must say why.
    calls = hopper(built=[FwdVariant("sm90", "bf16", 64, False)], load_error="cudaErrorNoKernelImageForDevice")
    q, k, v = make_qkv(9)
    assert api.resolve_implementation(None, dtype=q.dtype, head_dim=64, causal=False) == "xla"
    with pytest.raises(RuntimeError, match=r"fa4_fwd_sm90_bf16_hd64_full does not load on NVIDIA H200 \(device 0\): cudaErrorNoKernelImageForDevice"):
        attention(q, k, v, implementation="fa4")
    assert ("prepare", "fa4_fwd_sm90_bf16_hd64_full", 3) in calls


def test_non_hopper_gpu(monkeypatch):
    monkeypatch.setattr(_platform, "default_device", lambda: FakeDevice("8.0", "NVIDIA A100"))
    q, k, v = make_qkv(11)
    assert api.resolve_implementation(None, dtype=q.dtype, head_dim=64, causal=False) == "xla"
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0"):
        attention(q, k, v, implementation="fa4")


def test_missing_ffi_module(monkeypatch):
    monkeypatch.setattr(_platform, "default_device", lambda: FakeDevice())
    monkeypatch.setitem(sys.modules, "fa4_jax._ffi", None)  # makes the import raise ImportError
    monkeypatch.delattr(fa4_jax, "_ffi", raising=False)
    q, k, v = make_qkv(12)
    assert api.resolve_implementation(None, dtype=q.dtype, head_dim=64, causal=False) == "xla"
    with pytest.raises(RuntimeError, match="fa4_jax._ffi cannot be imported"):
        attention(q, k, v, implementation="fa4")


# -- transformations ----------------------------------------------------------------------------

def test_jit_with_static_arguments():
    q, k, v = make_qkv(13, s_q=33, s_k=20)
    f = jax.jit(attention, static_argnames=STATIC)
    o, lse = f(q, k, v, causal=True, softmax_scale=0.2, return_lse=True, implementation="xla")
    o_eager, lse_eager = attention(q, k, v, causal=True, softmax_scale=0.2, return_lse=True)
    np.testing.assert_array_equal(f64(o), f64(o_eager))
    np.testing.assert_array_equal(lse, lse_eager)


def test_eval_shape():
    q = jax.ShapeDtypeStruct((2, 1000, 16, 128), jnp.float16)
    kv = jax.ShapeDtypeStruct((2, 3000, 4, 128), jnp.float16)
    o, lse = jax.eval_shape(functools.partial(attention, causal=True, return_lse=True), q, kv, kv)
    assert (o.shape, o.dtype) == ((2, 1000, 16, 128), jnp.float16)
    assert (lse.shape, lse.dtype) == ((2, 16, 1000), jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        jax.eval_shape(attention, q, jax.ShapeDtypeStruct((2, 3000, 4, 64), jnp.float16), kv)


@pytest.mark.parametrize(
    "in_axes",
    [(0, 0, 0), (1, None, None), (None, 2, 2)],
    ids=["all_batched", "q_only_axis1", "kv_only_axis2"],
)
def test_vmap_matches_loop(in_axes):
    n, b, s_q, s_k, h_q, h_k, d = 3, 2, 9, 14, 4, 2, 64
    rng = np.random.default_rng(14)

    def operand(axis, shape):
        shape = list(shape)
        if axis is not None:
            shape.insert(axis, n)
        return rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)

    q = operand(in_axes[0], (b, s_q, h_q, d))
    k = operand(in_axes[1], (b, s_k, h_k, d))
    v = operand(in_axes[2], (b, s_k, h_k, d))
    f = functools.partial(attention, causal=True, return_lse=True)
    o, lse = jax.vmap(f, in_axes=in_axes)(q, k, v)

    take = lambda x, axis, i: x if axis is None else np.take(x, i, axis=axis)
    for i in range(n):
        o_i, lse_i = f(*(take(x, a, i) for x, a in zip((q, k, v), in_axes)))
        np.testing.assert_array_equal(f64(o[i]), f64(o_i))
        np.testing.assert_array_equal(lse[i], lse_i)

    # One launch over the folded batch, not a loop of n launches.
    (eqn,) = bound_primitives(jax.vmap(f, in_axes=in_axes), q, k, v)
    assert eqn.invars[0].aval.shape == (n * b, s_q, h_q, d)


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
