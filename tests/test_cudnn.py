"""cuDNN on GPUs without our kernels (fa4_jax/core/cudnn.py), on the CPU: when the mapping is exact
(cudnn_reason), what implementation="cudnn" refuses and how, and which path the CUDA lowering picks.

The lowering tests export for CUDA from this host with the target GPUs and cuDNN version mocked (the
GPUs are what decides, and jax's own cuDNN checks read them while lowering); the emitted module then
shows the choice: jax's `__cudnn$fmha*` custom call, ours (`fa4_jax_*`), or neither (the reference).
tests/test_gpu_cudnn.py runs the same paths on a GPU."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.core import compat as _compat, cudnn, lowering

BF16 = jnp.bfloat16
CUDNN_TARGET = "__cudnn$fmhaSoftmax"  # forward with softmax statistics (the LSE)


def spec(*shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


def params(left=-1, right=-1, softcap=0.0, sinks=False, **extra):
    return dict(softmax_scale=0.1, window_left=left, window_right=right, softcap=softcap, has_sinks=sinks, **extra)


# --------------------------------------------------------------------------------------------------
# cudnn_reason: pure, no GPU


DENSE_CASES = {
    # name: (s_q, s_k, params, reason regex or None)
    "full_sq_ne_sk": (100, 333, params(), None),
    "causal_sq_eq_sk": (128, 128, params(right=0), None),
    "causal_left_window": (128, 128, params(left=20, right=0), None),
    "left_window_reaching_past_every_key": (128, 128, params(left=127, right=0), None),
    "right_window_reaching_past_every_key": (128, 128, params(right=127), None),
    "causal_sq_lt_sk": (100, 333, params(right=0), r"seqlen_q=100 != seqlen_k=333: .*top-left"),
    "causal_sq_gt_sk": (333, 100, params(right=0), r"seqlen_q=333 != seqlen_k=100"),
    "two_sided_window": (128, 128, params(left=20, right=3), r"window_size=\(20, 3\): .*no right window bound"),
    "left_window_not_causal": (128, 128, params(left=20), r"window_size=\(20, -1\)"),
    "softcap": (128, 128, params(softcap=5.0), r"no logit softcapping"),
    "sinks": (128, 128, params(sinks=True), r"no attention sinks"),
}


@pytest.mark.parametrize("name", sorted(DENSE_CASES))
def test_cudnn_reason_dense(name):
    s_q, s_k, p, want = DENSE_CASES[name]
    avals = (spec(2, s_q, 8, 128), spec(2, s_k, 2, 128), spec(2, s_k, 2, 128))
    reason = cudnn.cudnn_reason("attention", avals, p)
    if want is None:
        assert reason is None, reason
    else:
        assert reason is not None and re.search(want, reason), reason


KV_CASES = {
    # name: (s_q, params, reason regex or None)
    "decode": (1, params(), None),
    "decode_causal": (1, params(right=0), None),
    "decode_right_window": (1, params(right=5), None),
    "prefill_chunk_no_mask": (5, params(), None),
    "decode_left_window": (1, params(left=100, right=0), r"window_size=\(100, 0\) on a KV cache with seqlen_q=1"),
    "chunk_causal": (5, params(right=0), r"seqlen_q=5: fa4_jax's masks follow each row's length"),
    "softcap": (1, params(softcap=3.0), r"softcap"),
}


@pytest.mark.parametrize("name", sorted(KV_CASES))
def test_cudnn_reason_kvcache(name):
    s_q, p, want = KV_CASES[name]
    avals = (spec(3, s_q, 8, 64), spec(3, 1000, 2, 64), spec(3, 1000, 2, 64), spec(3, dtype=jnp.int32))
    reason = cudnn.cudnn_reason("attention_with_kvcache", avals, dict(p, paged=False, num_splits=0))
    if want is None:
        assert reason is None, reason
    else:
        assert reason is not None and re.search(want, reason), reason


def test_cudnn_reason_paged_varlen_zero_size_symbolic():
    kv = (spec(3, 1, 8, 64), spec(20, 64, 2, 64), spec(20, 64, 2, 64), spec(3, dtype=jnp.int32),
          spec(3, 4, dtype=jnp.int32))
    assert "paged KV caches" in cudnn.cudnn_reason("attention_with_kvcache", kv, params(paged=True, num_splits=0))
    varlen = (spec(40, 8, 64), spec(40, 2, 64), spec(40, 2, 64), spec(3, dtype=jnp.int32), spec(3, dtype=jnp.int32))
    assert "packed varlen" in cudnn.cudnn_reason("attention_varlen", varlen, params(has_seqused=False, max_seqlen_q=0))
    for q, k in [((0, 64, 8, 64), (0, 64, 2, 64)), ((2, 0, 8, 64), (2, 64, 2, 64)), ((2, 64, 8, 64), (2, 0, 2, 64))]:
        reason = cudnn.cudnn_reason("attention", (spec(*q), spec(*k), spec(*k)), params())
        assert reason == "zero-size shapes run the reference", (q, k, reason)
    b, s = jax.export.symbolic_shape("b, s")
    reason = cudnn.cudnn_reason("attention", (spec(b, s, 8, 64), spec(b, s, 2, 64), spec(b, s, 2, 64)), params())
    assert "symbolic" in reason


@pytest.mark.parametrize("dtype,head_dim,cc,want", [
    (BF16, 128, None, None),
    (jnp.float16, 96, "8.0", None),
    (BF16, 256, "9.0", None),
    (BF16, 256, "10.0", None),
    (BF16, 256, "8.6", r"head_dim <= 128 below compute capability 9.0; got head_dim=256"),
    (BF16, 128, "7.5", r"compute capability >= 8.0; the GPU has 7.5"),
    (jnp.float32, 128, None, r"bfloat16 or float16; got float32"),
    (BF16, 260, None, r"multiple of 8 and <= 256; got 260"),
    (BF16, 100, None, r"multiple of 8 and <= 256; got 100"),
])
def test_feature_reason_dtype_head_dim_capability(dtype, head_dim, cc, want):
    reason = cudnn.feature_reason("attention", dtype=dtype, head_dim=head_dim, seqlen_q=64, seqlen_k=64,
                                  window=(-1, 0), compute_capability=cc)
    if want is None:
        assert reason is None, reason
    else:
        assert reason is not None and re.search(want, reason), reason


def test_mask_spec_and_requirement():
    assert cudnn.mask_spec("attention", 64, 64, (-1, 0)) == ("causal", None)
    assert cudnn.mask_spec("attention", 64, 64, (10, 0)) == ("causal", 11)  # cuDNN keeps i - 11 < j <= i
    assert cudnn.mask_spec("attention", 64, 99, (-1, -1)) == ("none", None)
    assert cudnn.mask_spec("attention_with_kvcache", 1, 99, (-1, 0)) == ("padding", None)
    assert cudnn.mask_spec("attention_with_kvcache", 4, 99, (-1, -1)) == ("padding", None)
    assert cudnn.mask_requirement("attention", (-1, 0)) == "seqlen_q == seqlen_k"
    assert cudnn.mask_requirement("attention", (5, 2)) == "never"
    assert cudnn.mask_requirement("attention", (-1, -1)) is None
    assert cudnn.mask_requirement("attention_with_kvcache", (-1, 0)) == "seqlen_q == 1"
    assert cudnn.mask_requirement("attention_with_kvcache", (7, 0)) == "never"
    assert cudnn.mask_requirement("attention_varlen", (-1, -1)) == "never"
    with pytest.raises(ValueError, match="entry must be one of"):
        cudnn.feature_reason("attn", dtype=BF16, head_dim=64, seqlen_q=1, seqlen_k=1)


# --------------------------------------------------------------------------------------------------
# implementation="cudnn" at the API (this host has no GPU)


def _qkv(b=2, s_q=64, s_k=64, h_q=4, h_k=2, d=64):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((b, s_q, h_q, d)), BF16), jnp.asarray(rng.standard_normal((b, s_k, h_k, d)), BF16),
            jnp.asarray(rng.standard_normal((b, s_k, h_k, d)), BF16))


API_REFUSALS = {
    "softcap": (dict(softcap=5.0), r"cuDNN has no logit softcapping"),
    "sinks": (dict(sinks=jnp.zeros(4, jnp.float32)), r"cuDNN has no attention sinks"),
    "causal_sq_ne_sk": (dict(causal=True, s_k=100), r"a causal mask or window with seqlen_q=64 != seqlen_k=100"),
    "two_sided_window": (dict(window_size=(8, 8)), r"window_size=\(8, 8\)"),
}


@pytest.mark.parametrize("name", sorted(API_REFUSALS))
def test_api_cudnn_refuses_with_the_reason(name):
    kw, want = API_REFUSALS[name]
    kw = dict(kw)
    q, k, v = _qkv(s_k=kw.pop("s_k", 64))
    with pytest.raises(ValueError, match=r'implementation="cudnn" cannot express this call: ' + want):
        fa4_jax.attention(q, k, v, implementation="cudnn", **kw)


def test_api_cudnn_refuses_paged_varlen_and_kvcache_masks():
    q, k, v = _qkv()
    lens = jnp.asarray([10, 64], jnp.int32)
    with pytest.raises(ValueError, match=r'"cudnn" cannot express this call: .*seqlen_q=64: fa4_jax\'s masks follow'):
        fa4_jax.attention_with_kvcache(q, k, v, lens, causal=True, implementation="cudnn")
    pages = jnp.zeros((4, 16, 2, 64), BF16)
    with pytest.raises(ValueError, match=r'"cudnn" cannot express this call: paged KV caches'):
        fa4_jax.attention_with_kvcache(q[:, :1], pages, pages, lens, page_table=jnp.zeros((2, 2), jnp.int32),
                                       implementation="cudnn")
    cu = jnp.asarray([0, 30, 64], jnp.int32)
    with pytest.raises(ValueError, match=r'"cudnn" cannot express this call: packed varlen batches'):
        fa4_jax.attention_varlen(q[0], k[0], v[0], cu, cu, implementation="cudnn")


def test_api_cudnn_on_a_cpu_raises_when_lowered():
    # Expressible, but this program is lowered for the CPU: like "fa4", an error, never a fallback.
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r'implementation="cudnn" cannot run here: the program is lowered for cpu'):
        fa4_jax.attention(q, k, v, causal=True, implementation="cudnn")


def test_export_cudnn_for_cuda_without_a_gpu_raises():
    # jax's cuDNN attention reads the GPU and the cuDNN version while lowering: none here.
    f = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, implementation="cudnn"))
    with pytest.raises(RuntimeError, match=r'implementation="cudnn" cannot run here: (no CUDA GPU|jax has no cuDNN)'):
        jax.export.export(f, platforms=["cuda"])(spec(2, 64, 4, 64), spec(2, 64, 2, 64), spec(2, 64, 2, 64))


def test_unknown_implementation_names_cudnn():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r'implementation must be None, "fa4", "cudnn" or "xla"; got implementation=\'cuDNN\''):
        fa4_jax.attention(q, k, v, implementation="cuDNN")


def test_disable_kernels_env_hides_the_kernels(monkeypatch):
    monkeypatch.setenv("FA4_JAX_DISABLE_KERNELS", "1")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r'"fa4" cannot run here: .*hidden by FA4_JAX_DISABLE_KERNELS=1'):
        fa4_jax.attention(q, k, v, implementation="fa4")


# --------------------------------------------------------------------------------------------------
# The CUDA lowering's choice, with the target GPUs mocked


def gpu(cc: str, kind: str):
    return types.SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=kind, id=0,
                                 local_hardware_id=0)


A100, H100, T4 = gpu("8.0", "NVIDIA A100"), gpu("9.0", "NVIDIA H100"), gpu("7.5", "Tesla T4")


@pytest.fixture
def target(monkeypatch):
    """target(device or None): the GPUs the CUDA lowering sees (None: unknown, as in a plain export),
    with jax's cuDNN 9.10 in this process (a CPU jaxlib has none)."""
    from jax._src.cudnn import fused_attention_stablehlo as fas  # jax's own check, called while tracing

    monkeypatch.setattr(_compat, "cudnn_version", lambda: 91000)
    monkeypatch.setattr(fas, "check_cudnn_version", lambda: 91000)
    monkeypatch.delenv("FA4_JAX_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("FA4_JAX_DISABLE_CUDNN", raising=False)

    def set_target(device):
        monkeypatch.setattr(lowering, "target_devices", lambda ctx: () if device is None else (device,))

    return set_target


def cuda_module(fn, *specs) -> str:
    checks = (*fa4_jax.export_safety_checks(), jax.export.DisabledSafetyCheck.custom_call(CUDNN_TARGET))
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*specs).mlir_module()


def path(text: str) -> str:
    cudnn_call = f"stablehlo.custom_call @{CUDNN_TARGET}(" in text
    kernel_call = re.search(r"stablehlo\.custom_call @fa4_jax_\w+\(", text) is not None
    assert not (cudnn_call and kernel_call), "both a cuDNN and a kernel call"
    return "cudnn" if cudnn_call else "kernel" if kernel_call else "reference"


def cudnn_masks(text: str) -> list[str]:
    return re.findall(r'mask_type\\22: \\22(\w+)\\22', text)


DENSE = (spec(2, 64, 4, 64), spec(2, 64, 2, 64), spec(2, 64, 2, 64))


def dense(**kw):
    return lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, **kw)


def test_gpu_without_kernels_lowers_to_cudnn(target):
    target(A100)
    text = cuda_module(dense(causal=True), *DENSE)
    assert path(text) == "cudnn" and cudnn_masks(text) == ["CAUSAL"]
    text = cuda_module(dense(causal=True, window_size=(9, 0)), *DENSE)
    assert path(text) == "cudnn" and re.search(r"sliding_window_length\\22: 10\b", text), "window 9 = cuDNN length 10"
    text = cuda_module(dense(), spec(2, 30, 4, 64), spec(2, 70, 2, 64), spec(2, 70, 2, 64))
    assert path(text) == "cudnn" and cudnn_masks(text) == ["NO_MASK"]


@pytest.mark.parametrize("kw,specs", [
    (dict(causal=True, softcap=5.0), DENSE),
    (dict(causal=True), (spec(2, 30, 4, 64), spec(2, 70, 2, 64), spec(2, 70, 2, 64))),
    (dict(window_size=(4, 4)), DENSE),
], ids=["softcap", "causal_sq_ne_sk", "two_sided_window"])
def test_gpu_without_kernels_and_no_cudnn_mapping_lowers_to_the_reference(target, kw, specs):
    target(A100)
    assert path(cuda_module(dense(**kw), *specs)) == "reference"


@pytest.mark.parametrize("device,head_dim", [(T4, 64), (A100, 256)], ids=["sm75", "sm80_hd256"])
def test_gpu_cudnn_cannot_run_lowers_to_the_reference(target, device, head_dim):
    target(device)
    s = (spec(2, 64, 4, head_dim), spec(2, 64, 2, head_dim), spec(2, 64, 2, head_dim))
    assert path(cuda_module(dense(causal=True), *s)) == "reference"


def test_kernel_first_then_cudnn_when_hidden(target, monkeypatch):
    target(H100)
    # A Hopper whose kernel loads (the device probe needs a GPU: stubbed) runs the kernel ...
    with monkeypatch.context() as m:
        m.setattr(lowering.platform, "lowering_reason", lambda make_variant, devices: None)
        assert path(cuda_module(dense(causal=True), *DENSE)) == "kernel"
    # ... and with the kernels hidden, cuDNN (the real device probe stops at the variable).
    monkeypatch.setenv("FA4_JAX_DISABLE_KERNELS", "1")
    assert path(cuda_module(dense(causal=True), *DENSE)) == "cudnn"
    monkeypatch.setenv("FA4_JAX_DISABLE_CUDNN", "1")
    assert path(cuda_module(dense(causal=True), *DENSE)) == "reference"


def test_kvcache_decode_lowers_to_cudnn_with_lengths(target):
    target(A100)
    kv = (spec(2, 1, 8, 64), spec(2, 100, 2, 64), spec(2, 100, 2, 64), spec(2, dtype=jnp.int32))
    f = lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, causal=True, return_lse=True)  # noqa: E731
    text = cuda_module(f, *kv)
    assert path(text) == "cudnn" and cudnn_masks(text) == ["PADDING"]
    f = lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, causal=True)  # noqa: E731
    chunk = (spec(2, 5, 8, 64), *kv[1:])
    assert path(cuda_module(f, *chunk)) == "reference"  # causal s_q > 1: bottom-right per row


def test_kvcache_head_dim_without_kernel_lowers_to_cudnn_on_hopper(target):
    # No KV-cache kernel at head_dim 96: None binds "auto" (no longer "xla"), and the lowering picks cuDNN.
    target(H100)
    kv = (spec(2, 1, 8, 96), spec(2, 100, 2, 96), spec(2, 100, 2, 96), spec(2, dtype=jnp.int32))
    assert path(cuda_module(lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n), *kv)) == "cudnn"


def test_unknown_target_gpus_keep_kernel_or_reference(target, monkeypatch):
    # jax.export does not know the GPUs: cuDNN is never chosen, the library decides as before.
    target(None)
    with monkeypatch.context() as m:  # (the kernel_library fixture's stub: a library holding every variant)
        m.setattr(lowering.platform, "library_reason", lambda make_variant: None)
        assert path(cuda_module(dense(causal=True), *DENSE)) == "kernel"
    monkeypatch.setenv("FA4_JAX_DISABLE_KERNELS", "1")
    assert path(cuda_module(dense(causal=True), *DENSE)) == "reference"


def test_explicit_cudnn_lowers_to_cudnn_and_fa4_still_raises(target):
    target(A100)
    assert path(cuda_module(dense(causal=True, implementation="cudnn"), *DENSE)) == "cudnn"
    with pytest.raises(RuntimeError, match=r'implementation="fa4" cannot run here'):
        cuda_module(dense(causal=True, implementation="fa4"), *DENSE)
    target(T4)
    with pytest.raises(RuntimeError, match=r'implementation="cudnn" cannot run here: Tesla T4: .*>= 8.0'):
        cuda_module(dense(causal=True, implementation="cudnn"), *DENSE)


def test_cudnn_api_check_is_reported_when_jax_changes(monkeypatch):
    # A jax whose cuDNN function lost a keyword we pass: never chosen, "cudnn" says why.
    monkeypatch.setattr(_compat, "_CUDNN_KEYWORDS", _compat._CUDNN_KEYWORDS + ("no_such_keyword",))
    reason = cudnn.device_reason([A100], 64)
    assert reason is not None and "lacks no_such_keyword" in reason
