"""Isolation on the kernels (H200): tests/isolation_cases.py with implementation="fa4", KV-cache
cases at head_dim 128 / GQA 16:4 (the issue's repro), split counts 1 / automatic / forced, pages 16
and 64 and contiguous; plus the sink and large-scale semantics of the kernels against the reference
(tests/test_hardening.py holds the CPU side)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from isolation_cases import (OPTIONS, POISONS, SPECIAL_SINKS, check_sink_semantics, kvcache_case, varlen_case,
                             varlen_vmap_case)
from oracle import attention_oracle

pytestmark = pytest.mark.gpu
KV_FAMILY, VARLEN_FAMILY = pytest.mark.kernel_family("kvcache"), pytest.mark.kernel_family("varlen")

KV = dict(hd=128, h_q=16, h_k=4)


@KV_FAMILY
@pytest.mark.parametrize("num_splits", [1, None, 4])
@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("where", ["boundary", "tile", "all"])
def test_kvcache_contiguous_unused_slots(where, poison, num_splits):
    kvcache_case(implementation="fa4", poison=POISONS[poison], where=where, opts={}, num_splits=num_splits, **KV)


@KV_FAMILY
@pytest.mark.parametrize("num_splits", [1, None, 7])
@pytest.mark.parametrize("case", sorted(OPTIONS))
@pytest.mark.parametrize("s_q", [1, 5])
def test_kvcache_contiguous_options(case, s_q, num_splits):
    kvcache_case(implementation="fa4", poison=np.nan, where="all", opts=OPTIONS[case], s_q=s_q,
                 num_splits=num_splits, **KV)


@KV_FAMILY
@pytest.mark.parametrize("num_splits", [1, None, 4])
@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("page_size", [16, 64])
def test_kvcache_paged_unowned_pages(page_size, poison, num_splits):
    kvcache_case(implementation="fa4", poison=POISONS[poison], where="all", opts={}, page_size=page_size,
                 num_splits=num_splits, **KV)


@KV_FAMILY
@pytest.mark.parametrize("case", sorted(OPTIONS))
@pytest.mark.parametrize("page_size", [16, 64])
def test_kvcache_paged_options(case, page_size):
    kvcache_case(implementation="fa4", poison=np.nan, where="all", opts=OPTIONS[case], s_q=3,
                 page_size=page_size, **KV)


@KV_FAMILY
@pytest.mark.parametrize("hd", [64, 96, 192, 256])
def test_kvcache_other_head_dims(hd):
    kvcache_case(implementation="fa4", poison=np.nan, where="tile", opts=dict(causal=True), s_q=2, hd=hd)


@VARLEN_FAMILY
@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_varlen_neighbouring_sequence(poison, case):
    varlen_case(implementation="fa4", poison=POISONS[poison], opts=OPTIONS[case])


@VARLEN_FAMILY
@pytest.mark.parametrize("hd", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_varlen_each_victim(hd, victim):
    varlen_case(implementation="fa4", poison=np.nan, opts=dict(causal=True), victim=victim, hd=hd,
                seqlens=(130, 7, 300))


@VARLEN_FAMILY
def test_varlen_keys_past_seqused_and_oversized_seqused():
    varlen_case(implementation="fa4", poison=np.nan, opts=dict(causal=True), seqused=(7, 1000, 20), victim=1)
    varlen_case(implementation="fa4", poison=np.nan, opts={}, seqused=(50, 60, 37), victim=1)


@VARLEN_FAMILY
def test_varlen_vmap_slices():
    varlen_vmap_case(implementation="fa4", poison=np.nan)


# -- sinks, scales: the kernels agree with the reference's semantics --------------------------------

@pytest.mark.kernel_family("fwd")
def test_sink_semantics_dense():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 70, 8, 128)), jnp.bfloat16) for _ in range(3))
    sinks = jnp.asarray(SPECIAL_SINKS)
    for impl in ("fa4", "xla"):
        o, lse = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, implementation=impl)
        check_sink_semantics(o, lse, 2, 1, SPECIAL_SINKS, f"dense {impl}")
    finite = np.isfinite(SPECIAL_SINKS)
    o_k, l_k = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, implementation="fa4")
    o_x, l_x = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(o_k, np.float32)[:, :, finite], np.asarray(o_x, np.float32)[:, :, finite],
                               atol=2e-2)
    np.testing.assert_allclose(np.asarray(l_k)[:, finite], np.asarray(l_x)[:, finite], atol=1e-3)


@KV_FAMILY
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sink_semantics_kvcache(num_splits):
    # num_splits 1: the attention kernel's finalize; 4: the split combine kernel.
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 128)), jnp.bfloat16)
    kc, vc = (jnp.asarray(rng.standard_normal((2, 2048, 2, 128)), jnp.bfloat16) for _ in range(2))
    lens = jnp.asarray([2048, 0], jnp.int32)  # row 1 sees no key: only the sink
    for impl in ("fa4", "xla"):
        o, lse = fa4_jax.attention_with_kvcache(q, kc, vc, lens, sinks=jnp.asarray(SPECIAL_SINKS), return_lse=True,
                                                num_splits=num_splits, implementation=impl)
        check_sink_semantics(o, lse, 2, 1, SPECIAL_SINKS, f"kvcache {impl} splits={num_splits}")


@VARLEN_FAMILY
@pytest.mark.parametrize("end", [170, 150])
def test_sink_semantics_varlen(end):
    # end 150: rows 150..169 belong to no sequence (the kernels' padding pseudo-batch): no key, so the
    # same semantics, a NaN sink making o NaN too (softmax.empty_row_o).
    rng = np.random.default_rng(2)
    cu = jnp.asarray([0, 50, end], jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((170, 8, 64)), jnp.bfloat16) for _ in range(3))
    for impl in ("fa4", "xla"):
        o, lse = fa4_jax.attention_varlen(q, k, v, cu, cu, causal=True, sinks=jnp.asarray(SPECIAL_SINKS),
                                          return_lse=True, implementation=impl)
        check_sink_semantics(o, lse, 1, 0, SPECIAL_SINKS, f"varlen {impl} end={end}")


@KV_FAMILY
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sink_semantics_ragged_kvcache_padding(num_splits):
    # A ragged batch whose rows 40..47 belong to no sequence: split or not, they get the semantics of a
    # row without keys (without splits the pseudo-batch writes o itself, with them the combine merges).
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((48, 8, 128)), jnp.bfloat16)
    kc, vc = (jnp.asarray(rng.standard_normal((2, 2048, 2, 128)), jnp.bfloat16) for _ in range(2))
    cu, lens = jnp.asarray([0, 1, 40], jnp.int32), jnp.asarray([2048, 1500], jnp.int32)
    for impl in ("fa4", "xla"):
        o, lse = fa4_jax.attention_with_kvcache(q, kc, vc, lens, cu_seqlens_q=cu, sinks=jnp.asarray(SPECIAL_SINKS),
                                                return_lse=True, num_splits=num_splits, implementation=impl)
        check_sink_semantics(o, lse, 1, 0, SPECIAL_SINKS, f"ragged kvcache {impl} splits={num_splits}")


def _integer_qkv(seed, shape_q, shape_kv, top):
    """q, k with integer entries in [-top, top] (exact in bf16 for top <= 256) and d = 128: every score
    is an integer below 2^24, exact in float32 whatever the summation order, so large scales compare
    exactly computed softmaxes (with real-valued data a 1e4 scale amplifies the ~1e-7 relative
    rounding of the scores into percent-level differences between any two implementations)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.integers(-top, top + 1, shape_q), jnp.bfloat16)
    k = jnp.asarray(rng.integers(-top, top + 1, shape_kv), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape_kv), jnp.bfloat16)
    return q, k, v


def _check_large(ours, xla, ref, what):
    """O per row within 2x the XLA path's error plus one bf16/fp16 ulp of the row's magnitude, LSE
    relative to its magnitude.

    At these scales attention is (nearly) one-hot and the row max's exponent is the rounding error of
    m * scale * log2(e) (up to +-4 at 1.2e8): P = 2^delta is then not a power of two, and its rounding
    to bf16 for the PV gemm (relative 2^-9) reaches O unaveraged, while the normaliser sums P in
    float32. So O may land one output ulp from the correctly rounded result: the shared rule's 1e-3
    relative atol (a quarter ulp) assumes errors averaged over many keys. An LSE of ~1e8 is a float32
    with an ulp of 8, so the rule's absolute 1e-3 cannot apply to it either (the kernel forms it in
    log2 units, the reference in natural log: each rounds once)."""
    o, o_x, o_r = (np.asarray(x[0], np.float32) for x in (ours, xla, ref))
    eps = float(jnp.finfo(ours[0].dtype).eps)
    assert np.isfinite(o).all(), f"{what}: O not finite"
    row_err, row_err_x = np.abs(o - o_r).max(-1), np.abs(o_x - o_r).max(-1)
    bound = 2 * row_err_x + eps * np.abs(o_r).max(-1) + 1e-6
    assert (row_err <= bound).all(), f"{what}: O off by {row_err.max():.3g} (bound there {bound.min():.3g})"
    lse, lse_x, lse_r = (np.asarray(x[1], np.float32) for x in (ours, xla, ref))
    ulp = np.spacing(np.abs(lse_r))
    assert (np.abs(lse - lse_r) <= 2 * np.abs(lse_x - lse_r) + 4 * ulp + 1e-3).all(), (
        f"{what}: LSE off by {np.abs(lse - lse_r).max():.3g} (|lse| up to {np.abs(lse_r).max():.3g})")


@pytest.mark.kernel_family("fwd")
# (1.0, 256): |s| up to ~1e6 exact, m * log2(e) ~ 1e6 with an ulp of 1/8: rescaling blocks by
# (m_prev - m) * scale (the old kernel) instead of against the stored rounded maxima is off by up to 9%.
@pytest.mark.parametrize("scale,top", [(1e4, 8), (1.0, 256), (0.125, 64), (1e-3, 2), (1e-30, 4)])
def test_large_scaled_scores_dense(scale, top):
    """Scaled scores up to |s * scale * log2(e)| ~ 1.2e8 (scale 1e4, |s| <= 8192) or |s| ~ 1e5 at an
    ordinary scale: the online softmax stays exact (issue 13: 1e8 gave NaN rows; the rescale against
    differently rounded maxima was off by ~2% at 1e6). Accuracy rule vs the fp32 oracle."""
    q, k, v = _integer_qkv(3, (1, 300, 4, 128), (1, 300, 4, 128), top)
    ours = fa4_jax.attention(q, k, v, softmax_scale=scale, return_lse=True, implementation="fa4")
    xla = fa4_jax.attention(q, k, v, softmax_scale=scale, return_lse=True, implementation="xla")
    ref = attention_oracle(q, k, v, softmax_scale=scale, xp=jnp)
    _check_large(ours, xla, ref, f"dense scale={scale} top={top}")


@KV_FAMILY
@pytest.mark.parametrize("num_splits", [1, 3])
def test_large_scaled_scores_kvcache(num_splits):
    q, kc, vc = _integer_qkv(4, (2, 1, 8, 128), (2, 1000, 2, 128), 8)
    lens = np.array([1000, 613], np.int32)
    ours = fa4_jax.attention_with_kvcache(q, kc, vc, jnp.asarray(lens), softmax_scale=1e4, return_lse=True,
                                          num_splits=num_splits, implementation="fa4")
    xla = fa4_jax.attention_with_kvcache(q, kc, vc, jnp.asarray(lens), softmax_scale=1e4, return_lse=True,
                                         implementation="xla")
    refs = [attention_oracle(q[i:i + 1], kc[i:i + 1, :lens[i]], vc[i:i + 1, :lens[i]], softmax_scale=1e4, xp=jnp)
            for i in range(2)]
    ref = tuple(jnp.concatenate([r[j] for r in refs]) for j in range(2))
    _check_large(ours, xla, ref, f"kvcache scale=1e4 splits={num_splits}")
