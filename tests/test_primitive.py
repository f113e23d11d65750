"""The fa4_fwd primitive's lowerings, checked without a GPU through jax.export.

Exporting for platforms=["cuda"] runs the CUDA lowering rule on this CPU-only machine, so the
StableHLO the GPU host would compile can be inspected here. The FFI target does not need to be
registered for that; jax.export only insists that custom calls it cannot vouch for are named in
`disabled_checks`.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax.core.reference as reference
from fa4_jax import attention_reference
from fa4_jax.families import FWD
from fa4_jax.ops.fwd.primitive import fa4_fwd, fa4_fwd_p
from oracle import attention_oracle

# What the CUDA lowering emits must not depend on which variants this host's build has.
pytestmark = pytest.mark.usefixtures("kernel_library")

# The FFI ABI name: the C++ handler (ffi/fwd.cc) registers it and serialized exports name it, so a
# change must be deliberate (a new version suffix), never a side effect. See test_target_is_the_v2_abi.
TARGET = FWD.target
ALLOW_TARGET = [jax.export.DisabledSafetyCheck.custom_call(TARGET)]
NEG_INF_F32 = "0xFF800000"  # how StableHLO spells float32 -inf


def specs(*, b=2, s_q=128, s_k=384, h_q=8, h_k=2, d=128, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((b, s_q, h_q, d), dtype)
    kv = jax.ShapeDtypeStruct((b, s_k, h_k, d), dtype)
    return q, kv, kv


def export_text(fn, args, platforms, disabled_checks=ALLOW_TARGET):
    exported = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=disabled_checks)(*args)
    return exported, exported.mlir_module()


def custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(\w+)\(.*", text)


def kernel_call_line(text):
    (line,) = [l for l in text.splitlines() if f"stablehlo.custom_call @{TARGET}(" in l]
    return line


def operand_names(line):
    (names,) = re.findall(rf"@{TARGET}\(([^)]*)\)", line)
    return [n.strip() for n in names.split(",")]


def is_neg_inf_splat(text, name, shape):
    """Whether SSA value `name` is a float32 -inf array of `shape` (a splat constant, or a
    broadcast of a scalar -inf constant: whichever the JAX version emits)."""
    t = f"tensor<{'x'.join(map(str, shape))}xf32>"
    defs = dict(re.findall(r"^\s*(%[\w#]+) = (.*)$", text, flags=re.M))
    d = defs[name]
    if re.match(rf"stablehlo\.constant dense<{NEG_INF_F32}> : {t}", d):
        return True
    m = re.match(rf"stablehlo\.broadcast_in_dim (%\w+), dims = \[\] : \(tensor<f32>\) -> {t}", d)
    scalar = rf"stablehlo\.constant dense<{NEG_INF_F32}> : tensor<f32>"
    return bool(m) and re.match(scalar, defs[m.group(1)]) is not None


def random_inputs(seed, *specs_):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s.shape, dtype=np.float32).astype(s.dtype) for s in specs_]


def f32(x):
    return np.asarray(x, np.float32)


def test_target_is_the_v3_abi():
    # v2 = the sinks operand and the window/softcap attributes, v3 = the opt-in attribute. A GPU host
    # with an older library must
    # fail to find the target rather than call a handler with the wrong operands.
    assert TARGET == "fa4_jax_fwd_v4", f"{TARGET=}"


@pytest.mark.parametrize("dtype,elt", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16")])
@pytest.mark.parametrize(
    "window,softcap",
    [((-1, -1), 0.0), ((-1, 0), 0.0), ((100, 0), 30.0), ((7, 3), 0.0)],
    ids=["full", "causal", "local_left_softcap", "local_two_sided"],
)
def test_cuda_lowering_emits_ffi_call(dtype, elt, window, softcap):
    f = functools.partial(fa4_fwd, softmax_scale=0.0625, window_left=window[0], window_right=window[1],
                          softcap=softcap, implementation="fa4")
    exported, text = export_text(f, specs(dtype=dtype), ["cuda"])

    line = kernel_call_line(text)
    assert custom_calls(text) == [TARGET]
    # Four operands always: q, k, v and sinks; without sinks a constant -inf per query head (no mass).
    names = operand_names(line)
    assert names[:3] == ["%arg0", "%arg1", "%arg2"] and len(names) == 4, f"{names=}"
    assert is_neg_inf_splat(text, names[3], (8,)), f"sinks operand {names[3]} is not a -inf constant"
    # Typed-FFI attributes, with the types ffi/fwd.cc decodes: f32 scale and cap, i32 window bounds.
    assert "softmax_scale = 6.250000e-02 : f32" in line
    assert f"softcap = {softcap:.6e} : f32" in line
    assert f"window_left = {window[0]} : i32" in line
    assert f"window_right = {window[1]} : i32" in line
    assert "causal" not in line, "v1's causal attribute is gone (folded into the window)"
    # implementation="fa4" opts in to kernels no hardware run has validated (families.VALIDATED_ARCHES).
    assert "unvalidated_ok = true" in line
    assert (
        f"(tensor<2x128x8x128x{elt}>, tensor<2x384x2x128x{elt}>, tensor<2x384x2x128x{elt}>, tensor<8xf32>) -> "
        f"(tensor<2x128x8x128x{elt}>, tensor<2x8x128xf32>)"
    ) in line
    # Row-major operands and results: the handler derives strides from dims alone.
    assert (
        "operand_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<[3, 2, 1, 0]> : tensor<4xindex>, "
        "dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<0> : tensor<1xindex>]"
    ) in line
    assert "result_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<[2, 1, 0]> : tensor<3xindex>]" in line
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [((2, 128, 8, 128), dtype), ((2, 8, 128), jnp.float32)]


@pytest.mark.parametrize("sinks_dtype,converted", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_cuda_lowering_passes_sinks(sinks_dtype, converted):
    # Given sinks are the fourth operand as float32 (the kernel reads float *), converted if need be.
    f = functools.partial(fa4_fwd, softmax_scale=0.125, window_left=-1, window_right=0, implementation="fa4")
    _, text = export_text(f, (*specs(), jax.ShapeDtypeStruct((8,), sinks_dtype)), ["cuda"])
    line = kernel_call_line(text)
    names = operand_names(line)
    assert names[:3] == ["%arg0", "%arg1", "%arg2"] and len(names) == 4, f"{names=}"
    if converted:
        convert = rf"{re.escape(names[3])} = stablehlo\.convert %arg3 : \(tensor<8xbf16>\) -> tensor<8xf32>"
        assert re.search(convert, text), "bf16 sinks must be converted to float32"
    else:
        assert names[3] == "%arg3"
    assert ", tensor<8xf32>) -> (tensor<2x128x8x128xbf16>, tensor<2x8x128xf32>)" in line
    assert NEG_INF_F32 not in text, "given sinks must not be replaced by the -inf default"


def test_softmax_scale_and_softcap_are_float32_exact():
    # 1/sqrt(96) and 1/3 are not float32s: the attributes carry their float32 roundings, not truncations.
    scale, cap = 1 / np.sqrt(96), 1 / 3
    f = functools.partial(fa4_fwd, softmax_scale=scale, window_left=-1, window_right=0, softcap=cap,
                          implementation="fa4")
    _, text = export_text(f, specs(d=96), ["cuda"])
    (value,) = re.findall(r"softmax_scale = ([0-9.e+-]+) : f32", text)
    assert np.float32(float(value)) == np.float32(scale), f"{value=}"
    (value,) = re.findall(r"softcap = ([0-9.e+-]+) : f32", text)
    assert np.float32(float(value)) == np.float32(cap), f"{value=}"


def test_export_requires_allowing_the_custom_call():
    # jax.export refuses custom calls without compatibility guarantees: users exporting the kernel
    # must allow the target explicitly (the .so must be registered wherever it is deserialized).
    f = functools.partial(fa4_fwd, softmax_scale=0.1, implementation="fa4")
    with pytest.raises(ValueError, match=TARGET):
        export_text(f, specs(), ["cuda"], disabled_checks=())


@pytest.mark.parametrize(
    "implementation,platforms",
    [("xla", ["cuda"]), ("auto", ["cpu"]), ("xla", ["cpu"])],
)
def test_reference_lowering_has_no_custom_call(implementation, platforms):
    f = functools.partial(fa4_fwd, softmax_scale=0.1, window_left=-1, window_right=0, implementation=implementation)
    _, text = export_text(f, specs(s_q=64, s_k=64), platforms, disabled_checks=())
    assert custom_calls(text) == []
    assert "stablehlo.dot_general" in text and "stablehlo.exponential" in text


@pytest.mark.parametrize("b,s_q,s_k", [(0, 64, 64), (2, 0, 64), (2, 64, 0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_zero_size_never_reaches_the_kernel(b, s_q, s_k, with_sinks):
    # No work, or rows that see no key: the CUDA lowering answers with the reference (no custom
    # call), and the multi-platform artifact gives o = 0, lse = -inf / the sink when called here.
    q_spec, kv_spec, _ = specs(b=b, s_q=s_q, s_k=s_k, h_q=4, h_k=2, d=64)
    args = [q_spec, kv_spec, kv_spec] + ([jax.ShapeDtypeStruct((4,), jnp.float32)] if with_sinks else [])
    f = lambda *a: fa4_fwd(*a, softmax_scale=0.1, window_left=3, window_right=0, implementation="auto")
    _, text = export_text(f, args, ["cuda"], disabled_checks=())
    assert custom_calls(text) == [], f"{custom_calls(text)=}"

    exported, _ = export_text(f, args, ["cpu", "cuda"], disabled_checks=())
    sinks = np.array([0.5, -1.0, 2.0, -np.inf], np.float32)
    o, lse = exported.call(*random_inputs(1, q_spec, kv_spec, kv_spec), *([sinks] if with_sinks else []))
    assert (o.shape, o.dtype) == ((b, s_q, 4, 64), jnp.bfloat16), f"{o.shape=} {o.dtype=}"
    assert (lse.shape, lse.dtype) == ((b, 4, s_q), jnp.float32), f"{lse.shape=} {lse.dtype=}"
    assert np.all(f32(o) == 0.0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None] if with_sinks else -np.inf, (b, 4, s_q)))


def test_multi_platform_export_runs_reference_on_cpu():
    # One artifact for CPU and CUDA: the CUDA branch calls the kernel, the CPU branch is the
    # reference, and calling the artifact here must give the reference's numbers.
    q_spec, kv_spec, _ = specs(b=1, s_q=40, s_k=24, h_q=4, h_k=1, d=64)
    s_spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    kwargs = dict(softmax_scale=0.125, window_left=5, window_right=0, softcap=6.0)
    f = functools.partial(fa4_fwd, implementation="auto", **kwargs)
    exported, text = export_text(f, (q_spec, kv_spec, kv_spec, s_spec), ["cpu", "cuda"])
    assert custom_calls(text) == [TARGET]

    q, k, v = random_inputs(7, q_spec, kv_spec, kv_spec)
    sinks = np.array([0.0, 1.5, -2.0, 3.0], np.float32)
    o, lse = exported.call(q, k, v, sinks)
    ref_kwargs = dict(softmax_scale=0.125, window_size=(5, 0), softcap=6.0, sinks=sinks)
    o_want, lse_want = attention_reference(q, k, v, **ref_kwargs)
    np.testing.assert_array_equal(f32(o), f32(o_want))
    np.testing.assert_array_equal(lse, lse_want)
    # ... and right: the float64 oracle, within the reference's own error (see test_reference.py).
    o64, lse64 = attention_oracle(q, k, v, xp=np, **ref_kwargs)
    np.testing.assert_allclose(np.asarray(o, np.float64), o64, rtol=1.01 * 2.0**-8, atol=2e-5)
    np.testing.assert_allclose(lse, lse64, rtol=0, atol=1e-4)


def _vmap_export(in_axes, with_sinks, n=3):
    """Exports jax.vmap(fa4_fwd) for CUDA; returns (exported, the custom call line)."""
    b, s_q, s_k, h_q, h_k, d = 2, 64, 96, 4, 2, 64

    def spec(axis, shape, dtype=jnp.bfloat16):
        shape = list(shape)
        if axis is not None:
            shape.insert(axis, n)
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    args = [spec(in_axes[0], (b, s_q, h_q, d)), spec(in_axes[1], (b, s_k, h_k, d)), spec(in_axes[2], (b, s_k, h_k, d))]
    if with_sinks:
        args.append(spec(in_axes[3], (h_q,), jnp.float32))
    f = jax.vmap(functools.partial(fa4_fwd, softmax_scale=0.125, window_left=16, window_right=0, softcap=5.0,
                                   implementation="fa4"), in_axes=in_axes[: len(args)])
    exported, text = export_text(f, args, ["cuda"])
    assert custom_calls(text) == [TARGET], "vmap must be one kernel launch, not a loop"
    return exported, kernel_call_line(text)


@pytest.mark.parametrize(
    "in_axes,with_sinks,operand_types",
    [
        # Shared K/V (a KV cache, vmapped queries): the mapped axis joins the query heads; K and V
        # go to the kernel unchanged (%arg1/%arg2, not a broadcast copy).
        ((0, None, None), False, "tensor<2x64x12x64xbf16>, tensor<2x96x2x64xbf16>, tensor<2x96x2x64xbf16>, tensor<12xf32>"),
        ((0, None, None, 0), True, "tensor<2x64x12x64xbf16>, tensor<2x96x2x64xbf16>, tensor<2x96x2x64xbf16>, tensor<12xf32>"),
        # Batched K/V, shared sinks: the mapped axis folds into the batch.
        ((0, 0, 0), False, "tensor<6x64x4x64xbf16>, tensor<6x96x2x64xbf16>, tensor<6x96x2x64xbf16>, tensor<4xf32>"),
        ((0, 0, 0, None), True, "tensor<6x64x4x64xbf16>, tensor<6x96x2x64xbf16>, tensor<6x96x2x64xbf16>, tensor<4xf32>"),
        # Batched K/V and per-slice sinks: into the heads of q, k, v and sinks.
        ((0, 0, 0, 0), True, "tensor<2x64x12x64xbf16>, tensor<2x96x6x64xbf16>, tensor<2x96x6x64xbf16>, tensor<12xf32>"),
    ],
    ids=["shared_kv", "shared_kv_sinks", "batch", "batch_shared_sinks", "heads"],
)
def test_vmap_folds_into_one_custom_call(in_axes, with_sinks, operand_types):
    exported, line = _vmap_export(in_axes, with_sinks)
    assert f"({operand_types}) -> " in line, line
    q_type = operand_types.split(", ")[0]
    lse_shape = {"tensor<6x64x4x64xbf16>": "6x4x64", "tensor<2x64x12x64xbf16>": "2x12x64"}[q_type]
    assert f"-> ({q_type}, tensor<{lse_shape}xf32>)" in line, line
    if in_axes[1] is None:
        assert operand_names(line)[1:3] == ["%arg1", "%arg2"], "K/V must not be copied"
    # The window and cap survive the folding.
    for attribute in ("window_left = 16 : i32", "window_right = 0 : i32", "softcap = 5.000000e+00 : f32"):
        assert attribute in line, f"{attribute=}"
    assert [a.shape for a in exported.out_avals] == [(3, 2, 64, 4, 64), (3, 2, 4, 64)]


@pytest.mark.parametrize(
    "params,error,message",
    [
        (dict(softmax_scale=-1.0), ValueError, r"softmax_scale must be finite and > 0; got softmax_scale=-1\.0"),
        (dict(softmax_scale=1e39), ValueError, r"softmax_scale must be a normal float32"),
        (dict(implementation="triton"), ValueError, r"implementation must be one of \('fa4', 'xla', 'auto', 'cudnn'\); got implementation='triton'"),
        (dict(window_left=-2), ValueError, r"window_size values must be >= -1 \(-1 = unbounded\); got window_size=\(-2, -1\)"),
        (dict(window_right=1.5), TypeError, r"window_size must be a pair of Python ints.*\(right is float\)"),
        (dict(window_left=True), TypeError, r"window_size must be a pair of Python ints.*\(left is bool\)"),
        (dict(softcap=-1.0), ValueError, r"softcap must be in \[0, 1e\+06\] \(0 = off\); got softcap=-1\.0"),
        (dict(softcap="30"), TypeError, r"softcap must be a Python float; got '30'"),
        (dict(softcap=1e38), ValueError, r"softcap must be in \[0, 1e\+06\] \(0 = off\); got softcap=1e\+38"),
        # softcap * log2(e) is subnormal while softmax_scale / softcap is still normal (it can no longer
        # overflow: softcap <= 1e6).
        (dict(softcap=5e-39, softmax_scale=1e-30), ValueError, r"softcap=5e-39 with softmax_scale=1e-30 is out of float32 range"),
        (dict(has_sinks=1), TypeError, r"has_sinks must be a Python bool; got has_sinks=1"),
        (dict(has_sinks=True), ValueError, r"has_sinks=True but sinks is absent"),
        # v1's `causal` param no longer exists: a stale caller fails loudly instead of being ignored.
        (dict(causal=True), TypeError, r"unexpected keyword argument 'causal'"),
    ],
)
def test_direct_bind_validates_params(params, error, message):
    # The shape rule guards binds that bypass fa4_jax.attention (same checks, one function).
    params = dict(dict(softmax_scale=0.1, window_left=-1, window_right=-1, softcap=0.0, has_sinks=False,
                       implementation="fa4"), **params)
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q, k, v: fa4_fwd_p.bind(q, k, v, **params), *specs())


@pytest.mark.parametrize(
    "sinks,has_sinks,error,message",
    [
        (jax.ShapeDtypeStruct((8,), jnp.float32), False, ValueError, r"has_sinks=False but sinks is given"),
        (jax.ShapeDtypeStruct((2,), jnp.float32), True, ValueError, r"sinks must have shape \(heads_q,\) = \(8,\); got sinks\.shape=\(2,\)"),
        (jax.ShapeDtypeStruct((8,), jnp.int32), True, TypeError, r"sinks must be a floating-point array \(used as float32\); got sinks\.dtype=int32"),
    ],
)
def test_direct_bind_validates_sinks(sinks, has_sinks, error, message):
    params = dict(softmax_scale=0.1, window_left=-1, window_right=-1, softcap=0.0, has_sinks=has_sinks,
                  implementation="fa4")
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q, k, v, s: fa4_fwd_p.bind(q, k, v, s, **params), *specs(), sinks)


@pytest.mark.parametrize("window_size", [(-1, 1), (3, 1)])
@pytest.mark.parametrize("entry", ["dense", "kvcache", "varlen"])
def test_references_reject_causal_with_a_right_window(entry, window_size):
    # The primitives' XLA bodies take causal too (the primitives themselves take it folded into
    # window_right): causal with a right window of even one key contradicts itself.
    from fa4_jax import attention_varlen_reference, attention_with_kvcache_reference

    rng = np.random.default_rng(3)
    x = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)  # noqa: E731
    kw = dict(causal=True, window_size=window_size, softmax_scale=0.125)
    message = (r"causal=True means window_size\[1\] = 0 \(no key after the diagonal\); "
               rf"got window_size=\({window_size[0]}, 1\)")
    with pytest.raises(ValueError, match=message):
        if entry == "dense":
            attention_reference(x(1, 4, 2, 64), x(1, 6, 2, 64), x(1, 6, 2, 64), **kw)
        elif entry == "kvcache":
            attention_with_kvcache_reference(x(1, 2, 2, 64), x(1, 8, 2, 64), x(1, 8, 2, 64), np.array([5], np.int32),
                                             **kw)
        else:
            cu = np.array([0, 4], np.int32)
            attention_varlen_reference(x(4, 2, 64), x(4, 2, 64), x(4, 2, 64), cu, cu, **kw)


def test_fa4_fwd_validates_before_binding():
    # The internal binder checks too, with the same messages as the public API.
    with pytest.raises(ValueError, match=r"window_size values must be >= -1"):
        jax.eval_shape(functools.partial(fa4_fwd, softmax_scale=0.1, window_left=-3, implementation="fa4"), *specs())
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads_q,\) = \(8,\)"):
        jax.eval_shape(functools.partial(fa4_fwd, softmax_scale=0.1, implementation="fa4"), *specs(),
                       jax.ShapeDtypeStruct((3,), jnp.float32))


def test_direct_bind_validates_operands():
    q, kv, _ = specs(dtype=jnp.float32)
    params = dict(softmax_scale=0.1, window_left=-1, window_right=-1, softcap=0.0, has_sinks=False,
                  implementation="xla")
    with pytest.raises(TypeError, match=r"bfloat16 or float16.*q\.dtype=float32"):
        jax.eval_shape(lambda q, k, v: fa4_fwd_p.bind(q, k, v, **params), q, kv, kv)


def test_eager_auto_param_on_cpu_uses_reference():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 10, 2, 64), dtype=np.float32).astype(jnp.float16) for _ in range(3))
    sinks = np.array([0.3, -0.7], np.float32)
    o, lse = fa4_fwd(q, k, v, sinks, softmax_scale=0.2, window_left=2, window_right=1, softcap=4.0,
                     implementation="auto")
    o_want, lse_want = attention_reference(q, k, v, softmax_scale=0.2, window_size=(2, 1), softcap=4.0, sinks=sinks)
    np.testing.assert_array_equal(f32(o), f32(o_want))
    np.testing.assert_array_equal(lse, lse_want)
    o64, lse64 = attention_oracle(q, k, v, softmax_scale=0.2, window_size=(2, 1), softcap=4.0, sinks=sinks, xp=np)
    np.testing.assert_allclose(np.asarray(o, np.float64), o64, rtol=1.01 * 2.0**-11, atol=2e-5)
    np.testing.assert_allclose(lse, lse64, rtol=0, atol=1e-4)


@pytest.mark.parametrize("platforms", [["cpu"], ["cpu", "cuda"]])
def test_fa4_param_lowered_for_cpu_raises(platforms):
    # "fa4" demands the kernel: a lowering for a platform without it is an error, never a fallback
    # (a multi-platform export wants implementation=None, i.e. "auto").
    f = functools.partial(fa4_fwd, softmax_scale=0.1, implementation="fa4")
    message = (r'implementation="fa4" cannot run here: the program is lowered for cpu, not an NVIDIA Hopper GPU '
               r'\(CUDA\)\. Use implementation=None')
    with pytest.raises(RuntimeError, match=message):
        export_text(f, specs(s_q=64, s_k=64), platforms)


def test_auto_without_the_variant_lowers_the_reference_for_cuda(monkeypatch):
    # Exported for CUDA from a host whose library lacks the kernel: "auto" carries the reference,
    # "fa4" says why it cannot.
    from fa4_jax.core import platform as _platform

    monkeypatch.setattr(_platform, "library_reason", lambda make_variant: f"no {make_variant('sm90').symbol}")
    f = functools.partial(fa4_fwd, softmax_scale=0.1, implementation="auto")
    _, text = export_text(f, specs(s_q=64, s_k=64), ["cuda"], disabled_checks=())
    assert custom_calls(text) == []
    f = functools.partial(fa4_fwd, softmax_scale=0.1, implementation="fa4")
    with pytest.raises(RuntimeError, match=r'implementation="fa4" cannot run here: no fa4_fwd_sm90_bf16_hd128_full'):
        export_text(f, specs(s_q=64, s_k=64), ["cuda"])


def test_shape_polymorphic_export():
    # One artifact for every (batch, seqlen): both branches must lower with symbolic dims. The
    # reference branch (the one this CPU runs) cannot know the score tile's size, so it loops over
    # query chunks (see reference.SYMBOLIC_SEQLEN_K_GUESS) instead of baking in "one block".
    b, s = jax.export.symbolic_shape("b, s")
    q_spec = jax.ShapeDtypeStruct((b, s, 8, 128), jnp.bfloat16)
    kv_spec = jax.ShapeDtypeStruct((b, s, 8, 128), jnp.bfloat16)
    s_spec = jax.ShapeDtypeStruct((8,), jnp.float32)
    kwargs = dict(softmax_scale=0.125, window_left=9, window_right=0, softcap=12.0)
    f = functools.partial(fa4_fwd, implementation="auto", **kwargs)
    exported, text = export_text(f, (q_spec, kv_spec, kv_spec, s_spec), ["cpu", "cuda"])
    # (jax adds shape_assertion custom calls that check the dims at call time)
    assert [c for c in custom_calls(text) if c != "shape_assertion"] == [TARGET]
    assert "stablehlo.while" in text, "the symbolic reference branch must chunk the queries"
    chunk = reference.auto_chunk(b, s, 8, s)

    sinks = np.linspace(-1.0, 2.0, 8).astype(np.float32)
    ref_kwargs = dict(softmax_scale=0.125, window_size=(9, 0), softcap=12.0, sinks=sinks)
    for batch, seqlen in [(1, 5), (3, 33)]:
        q, k, v = random_inputs(9 + seqlen, *(jax.ShapeDtypeStruct((batch, seqlen, 8, 128), jnp.bfloat16),) * 3)
        o, lse = exported.call(q, k, v, sinks)
        # Bit for bit the reference with the chunk the export chose ...
        o_want, lse_want = attention_reference(q, k, v, query_chunk=chunk, **ref_kwargs)
        np.testing.assert_array_equal(f32(o), f32(o_want), err_msg=f"{batch=} {seqlen=}")
        np.testing.assert_array_equal(lse, lse_want, err_msg=f"{batch=} {seqlen=}")
        # ... and right (float64 oracle; the reference's own error bound, see test_reference.py).
        o64, lse64 = attention_oracle(q, k, v, xp=np, **ref_kwargs)
        np.testing.assert_allclose(np.asarray(o, np.float64), o64, rtol=1.01 * 2.0**-8, atol=2e-5)
        np.testing.assert_allclose(lse, lse64, rtol=0, atol=1e-4)
