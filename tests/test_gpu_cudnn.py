"""cuDNN as the path of a GPU without our kernels (issue 13 §4), on the H200 (`@pytest.mark.gpu`).

FA4_JAX_DISABLE_KERNELS=1 hides the fa4_jax kernels, so implementation=None takes the path of an
A100/L40/B200: cuDNN where it computes exactly the call (fa4_jax/core/cudnn.py), else the reference. Each
case checks the compiled program (it holds the cuDNN custom call and no fa4_jax call, or neither) and
the numbers (tests/accuracy.py's rule against the fp32 oracle, the XLA path as the yardstick).
Every program is jitted afresh after the variable is set: the choice is made while lowering.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from accuracy import check_against_reference
from gpu_menu import validated
from oracle import attention_oracle, make_sinks

pytestmark = pytest.mark.gpu

CUDNN_CALL = re.compile(r'custom_call_target="__cudnn\$fmha')
KERNEL_CALL = re.compile(r'custom_call_target="fa4_jax_')


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setenv("FA4_JAX_DISABLE_KERNELS", "1")
    monkeypatch.delenv("FA4_JAX_DISABLE_CUDNN", raising=False)


def _bf(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dtype)


def _compile(fn, *args):
    """(compiled program, its HLO text): the very executable the test then runs."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, compiled.as_text()


def _assert_path(text: str, path: str, what: str):
    cudnn, kernel = bool(CUDNN_CALL.search(text)), bool(KERNEL_CALL.search(text))
    want = {"cudnn": (True, False), "kernel": (False, True), "reference": (False, False)}[path]
    assert (cudnn, kernel) == want, f"{what}: expected the {path} path; cuDNN call {cudnn}, fa4_jax call {kernel}"


def _dense(no_kernels_path: str, *, b, s_q, s_k, h_q, h_k, d, dtype=jnp.bfloat16, seed=0, **opts):
    rng = np.random.default_rng(seed)
    q, k, v = _bf(rng, (b, s_q, h_q, d), dtype), _bf(rng, (b, s_k, h_k, d), dtype), _bf(rng, (b, s_k, h_k, d), dtype)
    what = f"dense b{b} s_q{s_q} s_k{s_k} h{h_q}/{h_k} d{d} {jnp.dtype(dtype).name} {opts}"
    compiled, text = _compile(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, **opts), q, k, v)
    _assert_path(text, no_kernels_path, what)
    ours = compiled(q, k, v)
    xla = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, implementation="xla", **opts))(q, k, v)
    ref = attention_oracle(q, k, v, softmax_scale=d ** -0.5, xp=jnp, **opts)
    check_against_reference(ours, xla, ref, what=what)


@pytest.mark.parametrize("case", [
    dict(b=2, s_q=384, s_k=384, h_q=8, h_k=2, d=128, causal=True),  # causal, s_q == s_k, GQA
    dict(b=2, s_q=200, s_k=333, h_q=8, h_k=8, d=64),  # no mask, s_q != s_k
    dict(b=3, s_q=77, s_k=1, h_q=4, h_k=4, d=128),  # one key
    dict(b=1, s_q=257, s_k=257, h_q=8, h_k=1, d=128, causal=True),  # MQA
    dict(b=2, s_q=300, s_k=300, h_q=8, h_k=2, d=128, causal=True, window_size=(63, 0)),  # causal left window
    dict(b=2, s_q=130, s_k=130, h_q=4, h_k=2, d=96, causal=True),  # head_dim 96
    dict(b=2, s_q=200, s_k=200, h_q=4, h_k=2, d=256, causal=True),  # head_dim 256 (Hopper)
    dict(b=2, s_q=200, s_k=450, h_q=4, h_k=2, d=128, dtype=jnp.float16),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items() if k not in ("h_k",)).replace(" ", ""))
def test_dense_auto_is_cudnn(no_kernels, case):
    _dense("cudnn", **case)


@pytest.mark.parametrize("case", [
    dict(b=2, s_q=128, s_k=128, h_q=8, h_k=2, d=128, softcap=5.0),
    dict(b=2, s_q=128, s_k=128, h_q=8, h_k=2, d=128, causal=True, sinks=jnp.asarray(make_sinks(3, 8))),
    dict(b=2, s_q=100, s_k=300, h_q=8, h_k=2, d=128, causal=True),  # bottom-right != top-left
    dict(b=2, s_q=128, s_k=128, h_q=8, h_k=2, d=128, window_size=(20, 7)),  # a right window bound
], ids=["softcap", "sinks", "causal_sq_ne_sk", "two_sided_window"])
def test_dense_auto_without_cudnn_mapping_is_the_reference(no_kernels, case):
    _dense("reference", **case)


def _kvcache(path: str, *, lens, s_q, capacity=1000, h_q=16, h_k=4, d=128, seed=0, poison=None, **opts):
    rng = np.random.default_rng(seed)
    b = len(lens)
    lens = np.asarray(lens, np.int32)
    q = _bf(rng, (b, s_q, h_q, d))
    k = rng.standard_normal((b, capacity, h_k, d), dtype=np.float32)
    v = rng.standard_normal((b, capacity, h_k, d), dtype=np.float32)
    what = f"kvcache s_q{s_q} lens{lens.tolist()} h{h_q}/{h_k} d{d} {opts}"

    def fn(impl):
        return lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, return_lse=True, implementation=impl,
                                                                 **opts)

    args = (q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), jnp.asarray(lens))
    compiled, text = _compile(fn(None), *args)
    _assert_path(text, path, what)
    ours = compiled(*args)
    xla = jax.jit(fn("xla"))(*args)
    refs = [attention_oracle(q[i:i + 1], args[1][i:i + 1, :lens[i]], args[2][i:i + 1, :lens[i]], xp=jnp,
                             softmax_scale=d ** -0.5, **opts) for i in range(b)]
    ref = tuple(jnp.concatenate([r[j] for r in refs]) for j in range(2))
    check_against_reference(ours, xla, ref, what=what)
    if poison is not None:
        # Slots no length covers hold NaN/Inf (a recycled cache): the rows must not change at all.
        hidden = np.arange(capacity)[None, :] >= lens[:, None]
        kp, vp = k.copy(), v.copy()
        kp[hidden], vp[hidden] = poison, poison
        poisoned = compiled(q, jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16), jnp.asarray(lens))
        # Not bitwise, unlike our kernels (test_gpu_isolation.py): cuDNN's split decode reduces its
        # partial LSEs in an order that depends on timing. Measured on the H200 (one program, 400 calls
        # while another process loaded the GPU): two distinct results, o identical, lse 1 float32 ulp
        # apart; 200 calls on an idle GPU: one result. So the poisoned call is held to the clean one
        # up to that -- same finiteness, o within a bf16 ulp, lse within 4 float32 ulps -- which a
        # leak of NaN/Inf or of a hidden key would break by far.
        for name, a, p, rtol in zip(("o", "lse"), ours, poisoned, (2.0 ** -7, 2.0 ** -21)):
            a, p = np.asarray(a, np.float32), np.asarray(p, np.float32)
            assert np.array_equal(np.isfinite(a), np.isfinite(p)), f"{what}: {name} changed by {poison} past the lengths"
            np.testing.assert_allclose(p, a, rtol=rtol, atol=0, err_msg=f"{what}: {name} changed by {poison} past the lengths")


def test_kvcache_decode_auto_is_cudnn(no_kernels):
    # One query per row against per-row lengths, an empty row and a full one included; causal is the
    # padding mask alone when the query is the last key.
    _kvcache("cudnn", lens=[333, 0, 1, 1000, 700], s_q=1, causal=True)


def test_kvcache_prefill_chunk_without_mask_is_cudnn(no_kernels):
    _kvcache("cudnn", lens=[333, 4, 1000], s_q=5, h_q=8, h_k=8, d=64)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
def test_kvcache_cudnn_isolation(no_kernels, poison):
    _kvcache("cudnn", lens=[333, 700, 1, 128], s_q=1, poison=poison)


@pytest.mark.parametrize("opts", [dict(s_q=5, causal=True), dict(s_q=1, window_size=(100, 0)),
                                  dict(s_q=1, softcap=5.0)], ids=["causal_s_q5", "left_window", "softcap"])
def test_kvcache_auto_without_cudnn_mapping_is_the_reference(no_kernels, opts):
    _kvcache("reference", lens=[333, 700], **opts)


def test_paged_and_varlen_are_the_reference(no_kernels):
    rng = np.random.default_rng(5)
    q = _bf(rng, (2, 1, 8, 128))
    pages = _bf(rng, (8, 64, 2, 128))
    table = jnp.asarray([[3, 1, 4, 0], [7, 2, 6, 5]], jnp.int32)
    lens = jnp.asarray([100, 250], jnp.int32)
    _, text = _compile(lambda q, k, t: fa4_jax.attention_with_kvcache(q, k, k, lens, page_table=t), q, pages, table)
    _assert_path(text, "reference", "paged")
    qv, kv = _bf(rng, (40, 8, 128)), _bf(rng, (40, 2, 128))
    cu = jnp.asarray([0, 15, 40], jnp.int32)
    _, text = _compile(lambda q, k: fa4_jax.attention_varlen(q, k, k, cu, cu, causal=True), qv, kv)
    _assert_path(text, "reference", "varlen")


def test_vmap_auto_is_cudnn(no_kernels):
    rng = np.random.default_rng(6)
    q, k = _bf(rng, (3, 2, 128, 8, 64)), _bf(rng, (3, 2, 128, 2, 64))
    f = jax.vmap(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, return_lse=True))
    compiled, text = _compile(f, q, k, k)
    _assert_path(text, "cudnn", "vmap")
    o, lse = compiled(q, k, k)
    for i in range(3):
        ours = (o[i], lse[i])
        xla = fa4_jax.attention(q[i], k[i], k[i], causal=True, return_lse=True, implementation="xla")
        ref = attention_oracle(q[i], k[i], k[i], causal=True, softmax_scale=1 / 8, xp=jnp)
        check_against_reference(ours, xla, ref, what=f"vmap slice {i}")


def test_disable_cudnn_gives_the_reference(no_kernels, monkeypatch):
    monkeypatch.setenv("FA4_JAX_DISABLE_CUDNN", "1")
    rng = np.random.default_rng(7)
    q = _bf(rng, (1, 128, 4, 128))
    _, text = _compile(lambda q: fa4_jax.attention(q, q, q, causal=True), q)
    _assert_path(text, "reference", "FA4_JAX_DISABLE_CUDNN=1")


def test_explicit_cudnn_with_the_kernels_present():
    # implementation="cudnn" does not need the variable: it is asked for by name.
    rng = np.random.default_rng(8)
    q, k = _bf(rng, (2, 256, 8, 128)), _bf(rng, (2, 256, 2, 128))
    f = lambda impl: lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation=impl)  # noqa: E731
    compiled, text = _compile(f("cudnn"), q, k, k)
    _assert_path(text, "cudnn", 'implementation="cudnn"')
    ref = attention_oracle(q, k, k, causal=True, softmax_scale=128 ** -0.5, xp=jnp)
    check_against_reference(compiled(q, k, k), jax.jit(f("xla"))(q, k, k), ref, what='implementation="cudnn"')


def test_explicit_cudnn_refuses_what_it_cannot_express():
    rng = np.random.default_rng(9)
    q = _bf(rng, (1, 64, 4, 128))
    with pytest.raises(ValueError, match=r'implementation="cudnn" cannot express this call: cuDNN has no logit softcap'):
        fa4_jax.attention(q, q, q, softcap=5.0, implementation="cudnn")
    with pytest.raises(ValueError, match=r"cannot express this call: .*seqlen_q=64 != seqlen_k=32"):
        fa4_jax.attention(q, q[:, :32], q[:, :32], causal=True, implementation="cudnn")


def test_auto_with_kernels_prefers_the_kernel():
    # Without the variable a GPU whose kernels are validated (Hopper) runs our kernel, not cuDNN; where
    # they are opt-in (Blackwell until a run validates them, issue 16), cuDNN.
    from fa4_jax.core import library as _ffi

    if not _ffi.compiled_variants():
        pytest.skip(f"no kernel library: {_ffi.library_status()}")
    rng = np.random.default_rng(10)
    q = _bf(rng, (1, 256, 8, 128))
    _, text = _compile(lambda q: fa4_jax.attention(q, q, q, causal=True), q)
    _assert_path(text, "kernel" if validated() else "cudnn", "implementation=None with the kernels")
