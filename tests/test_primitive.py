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

from fa4_jax import attention_reference
from fa4_jax.primitive import fa4_fwd, fa4_fwd_p

TARGET = "fa4_jax_fwd_v1"  # the FFI ABI name in the contract; must not drift
ALLOW_TARGET = [jax.export.DisabledSafetyCheck.custom_call(TARGET)]


def specs(*, b=2, s_q=128, s_k=384, h_q=8, h_k=2, d=128, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((b, s_q, h_q, d), dtype)
    kv = jax.ShapeDtypeStruct((b, s_k, h_k, d), dtype)
    return q, kv, kv


def export_text(fn, args, platforms, disabled_checks=ALLOW_TARGET):
    exported = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=disabled_checks)(*args)
    return exported, exported.mlir_module()


def custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(\w+)\(.*", text)


@pytest.mark.parametrize("dtype,elt", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16")])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_lowering_emits_ffi_call(dtype, elt, causal):
    f = functools.partial(fa4_fwd, softmax_scale=0.0625, causal=causal, implementation="fa4")
    exported, text = export_text(f, specs(dtype=dtype), ["cuda"])

    (line,) = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
    assert f"stablehlo.custom_call @{TARGET}(%arg0, %arg1, %arg2)" in line
    # Typed-FFI attributes: the handler decodes causal as bool (i1) and softmax_scale as f32.
    assert f"causal = {str(causal).lower()}" in line
    assert "softmax_scale = 6.250000e-02 : f32" in line
    assert (
        f"(tensor<2x128x8x128x{elt}>, tensor<2x384x2x128x{elt}>, tensor<2x384x2x128x{elt}>) -> "
        f"(tensor<2x128x8x128x{elt}>, tensor<2x8x128xf32>)"
    ) in line
    # Row-major operands and results: the handler derives strides from dims alone.
    assert "operand_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>" in line
    assert "result_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<[2, 1, 0]> : tensor<3xindex>]" in line
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [((2, 128, 8, 128), dtype), ((2, 8, 128), jnp.float32)]


def test_softmax_scale_is_float32_exact():
    # 1/sqrt(96) is not a float32: the attribute carries its float32 rounding, not a truncation.
    scale = 1 / np.sqrt(96)
    f = functools.partial(fa4_fwd, softmax_scale=scale, causal=True, implementation="fa4")
    _, text = export_text(f, specs(d=96), ["cuda"])
    (value,) = re.findall(r"softmax_scale = ([0-9.e+-]+) : f32", text)
    assert np.float32(float(value)) == np.float32(scale)


def test_export_requires_allowing_the_custom_call():
    # jax.export refuses custom calls without compatibility guarantees: users exporting the kernel
    # must allow the target explicitly (the .so must be registered wherever it is deserialized).
    f = functools.partial(fa4_fwd, softmax_scale=0.1, causal=False, implementation="fa4")
    with pytest.raises(ValueError, match=TARGET):
        export_text(f, specs(), ["cuda"], disabled_checks=())


@pytest.mark.parametrize(
    "implementation,platforms",
    [("xla", ["cuda"]), ("fa4", ["cpu"]), ("xla", ["cpu"])],
)
def test_reference_lowering_has_no_custom_call(implementation, platforms):
    f = functools.partial(fa4_fwd, softmax_scale=0.1, causal=True, implementation=implementation)
    _, text = export_text(f, specs(s_q=64, s_k=64), platforms, disabled_checks=())
    assert custom_calls(text) == []
    assert "stablehlo.dot_general" in text and "stablehlo.exponential" in text


def test_multi_platform_export_runs_reference_on_cpu():
    # One artifact for CPU and CUDA: the CUDA branch calls the kernel, the CPU branch is the
    # reference, and calling the artifact here must give the reference's numbers.
    q_spec, kv_spec, _ = specs(b=1, s_q=40, s_k=24, h_q=4, h_k=1, d=64)
    f = functools.partial(fa4_fwd, softmax_scale=0.125, causal=True, implementation="fa4")
    exported, text = export_text(f, (q_spec, kv_spec, kv_spec), ["cpu", "cuda"])
    assert custom_calls(text) == [TARGET]

    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s.shape, dtype=np.float32).astype(s.dtype) for s in (q_spec, kv_spec, kv_spec))
    o, lse = exported.call(q, k, v)
    o_want, lse_want = attention_reference(q, k, v, causal=True, softmax_scale=0.125)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_want, np.float32))
    np.testing.assert_array_equal(lse, lse_want)


def test_vmap_folds_into_one_custom_call():
    q_spec, kv_spec, _ = specs(b=2, s_q=64, s_k=64, h_q=4, h_k=4, d=64)
    batched = jax.ShapeDtypeStruct((3, *q_spec.shape), q_spec.dtype)
    f = jax.vmap(functools.partial(fa4_fwd, softmax_scale=0.125, causal=False, implementation="fa4"),
                 in_axes=(0, None, None))
    exported, text = export_text(f, (batched, kv_spec, kv_spec), ["cuda"])
    (line,) = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
    assert "-> (tensor<6x64x4x64xbf16>, tensor<6x4x64xf32>)" in line
    assert [a.shape for a in exported.out_avals] == [(3, 2, 64, 4, 64), (3, 2, 4, 64)]


@pytest.mark.parametrize(
    "params,error,message",
    [
        (dict(softmax_scale=0.1, causal=1, implementation="fa4"), TypeError, "causal"),
        (dict(softmax_scale=-1.0, causal=False, implementation="fa4"), ValueError, "softmax_scale"),
        (dict(softmax_scale=0.1, causal=False, implementation="triton"), ValueError, "implementation"),
    ],
)
def test_direct_bind_validates_params(params, error, message):
    # The shape rule guards binds that bypass fa4_jax.attention (same checks, one function).
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda q, k, v: fa4_fwd_p.bind(q, k, v, **params), *specs())


def test_direct_bind_validates_operands():
    q, kv, _ = specs(dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"bfloat16 or float16.*q\.dtype=float32"):
        jax.eval_shape(
            lambda q, k, v: fa4_fwd_p.bind(q, k, v, softmax_scale=0.1, causal=False, implementation="xla"), q, kv, kv
        )


def test_eager_fa4_param_on_cpu_uses_reference():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 10, 2, 64), dtype=np.float32).astype(jnp.float16) for _ in range(3))
    o, lse = fa4_fwd(q, k, v, softmax_scale=0.2, causal=False, implementation="fa4")
    o_want, lse_want = attention_reference(q, k, v, causal=False, softmax_scale=0.2)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_want, np.float32))
    np.testing.assert_array_equal(lse, lse_want)


def test_shape_polymorphic_export():
    # One artifact for every (batch, seqlen): both branches must lower with symbolic dims, and the
    # reference branch (the one this CPU runs) must not bake a chunking decision into it.
    b, s = jax.export.symbolic_shape("b, s")
    q_spec = jax.ShapeDtypeStruct((b, s, 8, 64), jnp.bfloat16)
    kv_spec = jax.ShapeDtypeStruct((b, s, 2, 64), jnp.bfloat16)
    f = functools.partial(fa4_fwd, softmax_scale=0.125, causal=True, implementation="fa4")
    exported, text = export_text(f, (q_spec, kv_spec, kv_spec), ["cpu", "cuda"])
    # (jax adds shape_assertion custom calls that check the dims at call time)
    assert [c for c in custom_calls(text) if c != "shape_assertion"] == [TARGET]

    rng = np.random.default_rng(9)
    for batch, seqlen in [(1, 5), (3, 33)]:
        q = rng.standard_normal((batch, seqlen, 8, 64), dtype=np.float32).astype(jnp.bfloat16)
        k, v = (rng.standard_normal((batch, seqlen, 2, 64), dtype=np.float32).astype(jnp.bfloat16) for _ in range(2))
        o, lse = exported.call(q, k, v)
        o_want, lse_want = attention_reference(q, k, v, causal=True, softmax_scale=0.125)
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_want, np.float32))
        np.testing.assert_array_equal(lse, lse_want)
