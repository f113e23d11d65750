"""FA4 Hopper kernel vs an fp32 oracle, on the GPU (every test here is `@pytest.mark.gpu`).

Accuracy rule (FlashAttention's): with ref32 = attention of the fp32-upcast inputs computed in fp32 (the
shared oracle, tests/oracle.py),
  max|ours - ref32| <= 2 * max|xla - ref32| + atol,
where `xla` is fa4_jax's own XLA path on the same bf16/f16 inputs. The XLA path's error is the error any
correct same-precision implementation is allowed, so the bound scales itself with dtype, head_dim and
sequence length instead of needing a hand-tuned tolerance per case.

The kernel must write every element of O and LSE. XLA allocates custom-call results itself, so a buffer
cannot be pre-filled from JAX; instead each case (a) fills and frees NaN buffers of the outputs' sizes
just before the call, which XLA's best-fit allocator tends to hand straight back, (b) requires no NaN
anywhere and agreement with the reference everywhere, and (c) runs twice with fresh inputs, so a tile the
kernel skipped would carry either NaN or the previous run's numbers and fail the comparison.

Runtime on an H200: ~300 cases, each mostly one XLA compile; ~1-2 minutes with `-n 8`.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import fa4_jax
from fa4_jax.families import FWD, FwdVariant, default_menu, mask_kind
from fa4_jax.ops.fwd.spec import SHORT_TILES
from accuracy import check_against_reference, poison_allocator as _poison_allocator
from gpu_menu import device_arch, require_variant, validated
from oracle import attention_oracle, visible_mask

pytestmark = [pytest.mark.gpu, pytest.mark.kernel_family("fwd")]

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
HIGHEST = jax.lax.Precision.HIGHEST


def ref32(q, k, v, **kw):
    """The shared oracle in float32 on the device (see tests/oracle.py)."""
    return attention_oracle(q, k, v, xp=jnp, **kw)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def built_variants(kernel_variants) -> frozenset:
    return kernel_variants  # tests/conftest.py: fails on a missing or empty kernel library


def _variant(dtype_name: str, head_dim: int, causal: bool, window_size=(-1, -1), softcap=0.0) -> FwdVariant:
    left, right = window_size
    right = 0 if causal else right
    return FwdVariant(device_arch(), dtype_name, head_dim, mask_kind(left, right), softcap > 0)


def _require(built_variants, dtype_name, head_dim, causal, window_size=(-1, -1), softcap=0.0):
    # Skips only for a narrowed build menu; fails for a default-menu variant the library lacks.
    require_variant(built_variants, _variant(dtype_name, head_dim, causal, window_size, softcap))


def _inputs(seed, b, s_q, s_k, h_q, h_k, d, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    # Normal, never zeros: zeros would make every softmax uniform and hide indexing bugs.
    q = jax.random.normal(kq, (b, s_q, h_q, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s_k, h_k, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s_k, h_k, d), jnp.float32).astype(dtype)
    return q, k, v


@functools.lru_cache(maxsize=None)
def _triple(causal: bool, softmax_scale: float | None, window_size=(-1, -1), softcap=0.0):
    """One jitted program computing ours, the same-precision XLA path and the fp32 oracle.

    A single program per shape costs one XLA compile instead of three, which is most of the test time.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, return_lse=True)
    ours = functools.partial(fa4_jax.attention, implementation="fa4", **kw)
    xla = functools.partial(fa4_jax.attention, implementation="xla", **kw)

    def run(q, k, v, sinks):
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return (ours(q, k, v, sinks=sinks), xla(q, k, v, sinks=sinks),
                ref32(q, k, v, causal=causal, softmax_scale=scale, window_size=window_size, softcap=softcap,
                      sinks=sinks))

    return jax.jit(run)


def run_case(built_variants, *, dtype_name, head_dim, causal, b, s_q, s_k, h_q, h_k, seed=0,
             softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=False, shape_inputs=None, label=""):
    """The kernel, the XLA path and the fp32 oracle on fresh inputs, twice; `shape_inputs(q, k, v)`
    may reshape the random inputs' statistics first (e.g. scores that rise block after block)."""
    _require(built_variants, dtype_name, head_dim, causal, window_size, softcap)
    dtype = DTYPES[dtype_name]
    fn = _triple(causal, softmax_scale, tuple(window_size), softcap)
    what = (f"{dtype_name} hd{head_dim} causal={causal} window={window_size} softcap={softcap} sinks={sinks} "
            f"b={b} s_q={s_q} s_k={s_k} h={h_q}/{h_k}{label}")
    no_key = ~np.asarray(visible_mask(s_q, s_k, window_size, causal)).any(axis=1)
    # Twice with fresh inputs: a tile the kernel never writes would keep the first run's values.
    for run in range(2):
        q, k, v = _inputs(seed * 2 + run + 1, b, s_q, s_k, h_q, h_k, head_dim, dtype)
        if shape_inputs is not None:
            q, k, v = shape_inputs(q, k, v)
        # Sink logits around the scores' scale (|s| ~ 1-3): they change every row's normalisation.
        sk = jax.random.normal(jax.random.key(seed * 2 + run + 99), (h_q,), jnp.float32) * 2 if sinks else None
        _poison_allocator(((b, s_q, h_q, head_dim), dtype), ((b, h_q, s_q), jnp.float32))
        ours, xla, ref = fn(q, k, v, sk)
        check_against_reference(ours, xla, ref, what=f"{what} run {run}", no_key=no_key)
        if sinks and no_key.any():  # rows with only the sink: LSE is exactly the sink logit
            lse = np.asarray(ours[1])
            np.testing.assert_allclose(lse[:, :, no_key], np.broadcast_to(np.asarray(sk)[None, :, None], lse[:, :, no_key].shape),
                                       rtol=0, atol=1e-5, err_msg=what)
        del ours, xla, ref


# --------------------------------------------------------------------------------------------------
# accuracy sweeps
# --------------------------------------------------------------------------------------------------

# Full dtype x head_dim x causal grid on two sizes: one ragged tile (129 = one full 128-row tile + 1),
# one with several ragged kv blocks and GQA.
GRID_SHAPES = {
    "b2_s129_mha4": dict(b=2, s_q=129, s_k=129, h_q=4, h_k=4),
    "b1_s1000_gqa8:2": dict(b=1, s_q=1000, s_k=1000, h_q=8, h_k=2),
}


@pytest.mark.parametrize("shape", list(GRID_SHAPES), ids=list(GRID_SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=[f"hd{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_dtype_headdim_grid(built_variants, dtype_name, head_dim, causal, shape):
    run_case(built_variants, dtype_name=dtype_name, head_dim=head_dim, causal=causal, **GRID_SHAPES[shape])


# Sequence-length sweep (bf16): tiny, odd, long, s_q != s_k both ways, decode-like, mostly-masked.
SEQLENS = [
    (1, 1),
    (7, 7),
    (4097, 4097),  # one past a tile boundary at length where the causal schedule matters
    (128, 1000),   # s_q < s_k: causal rows see a long prefix
    (1000, 128),   # s_q > s_k: causal leaves the first 872 rows empty
    (1, 4097),     # decode-like
    (4097, 7),     # almost every causal row empty
    (333, 777),
    (777, 333),
]


@pytest.mark.parametrize("s_q,s_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256], ids=["hd64", "hd96", "hd128", "hd256"])
def test_seqlen_sweep(built_variants, head_dim, causal, s_q, s_k):
    long = max(s_q, s_k) > 2048
    run_case(built_variants, dtype_name="bf16", head_dim=head_dim, causal=causal,
             b=1 if long else 2, s_q=s_q, s_k=s_k, h_q=4, h_k=2)


@pytest.mark.parametrize("s_q,s_k", [(4097, 4097), (1000, 128), (1, 4097)], ids=["4097", "1000x128", "1x4097"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [96, 128], ids=["hd96", "hd128"])
def test_seqlen_sweep_fp16(built_variants, head_dim, causal, s_q, s_k):
    run_case(built_variants, dtype_name="fp16", head_dim=head_dim, causal=causal, b=1, s_q=s_q, s_k=s_k, h_q=4, h_k=2)


# MHA, GQA 4:1, MQA, and ratios that are not powers of two (3:1, 5:1) or odd head counts.
HEAD_CONFIGS = [(4, 4), (32, 8), (8, 1), (6, 2), (12, 4), (10, 2), (3, 3)]


@pytest.mark.parametrize("h_q,h_k", HEAD_CONFIGS, ids=[f"h{a}:{b}" for a, b in HEAD_CONFIGS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["hd64", "hd128"])
def test_head_configs(built_variants, head_dim, causal, h_q, h_k):
    run_case(built_variants, dtype_name="bf16", head_dim=head_dim, causal=causal,
             b=2, s_q=513, s_k=513, h_q=h_q, h_k=h_k)


def test_head_configs_long_gqa(built_variants):
    # GQA 32:8 with a long sequence: many CTAs per kv head, the layout a Llama-class model uses.
    run_case(built_variants, dtype_name="bf16", head_dim=128, causal=True, b=1, s_q=2048, s_k=2048, h_q=32, h_k=8)


@pytest.mark.parametrize("softmax_scale", [0.05, 0.5], ids=["scale0.05", "scale0.5"])
def test_explicit_softmax_scale(built_variants, softmax_scale):
    # 0.5 on hd128 makes the softmax peaky (logits ~ N(0, 5.6^2)): exercises the running-max rescale.
    run_case(built_variants, dtype_name="bf16", head_dim=128, causal=True, b=1, s_q=700, s_k=900,
             h_q=4, h_k=4, softmax_scale=softmax_scale)


@pytest.mark.parametrize("growth", [0.5, 3.0, 40.0], ids=["rise0.5", "rise3", "rise40"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=["hd64", "hd128", "hd256"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_running_max_growth(built_variants, dtype_name, head_dim, causal, growth):
    """Scores that rise key block after key block in the order the kernel visits them (the highest
    block first): every 128 keys the row max gains `growth` log2 units on top of normal scores, so
    the running max moves on every block (random scores stop moving it after a few) and O and the
    running sum are rescaled each time -- by factors near 1 at 0.5, by ~2^-40 at 40 -- and the rows
    end near one-hot, where P's rounding shows: a rescale threshold above 0 (FlashAttention-4's
    tau = 8; docs/PERF.md, 2026-12-06 twelfth session) leaves the dominant P a rounded 2^x and failed
    this at bf16 hd256."""
    s_k = 1500
    # Column 0: q = 1, k = a ramp falling with the key index, so key j scores
    # growth * (s_k - j) / 128 (log2 units) above its normal part.
    ramp = growth * (s_k - jnp.arange(s_k, dtype=jnp.float32)) / (128 * math.log2(math.e) / math.sqrt(head_dim))

    def rising(q, k, v):
        k0 = jnp.broadcast_to(ramp[None, :, None], k.shape[:3]).astype(k.dtype)
        return q.at[..., 0].set(1), k.at[..., 0].set(k0), v

    run_case(built_variants, dtype_name=dtype_name, head_dim=head_dim, causal=causal, b=1, s_q=777, s_k=s_k, h_q=4,
             h_k=4, seed=15, shape_inputs=rising, label=f" rise {growth}")


# --------------------------------------------------------------------------------------------------
# semantics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s_q,s_k", [(300, 100), (4097, 7), (129, 1)])
def test_rows_without_keys(built_variants, s_q, s_k):
    """Causal with s_q > s_k: the first s_q - s_k rows see no key -> exactly O = 0, LSE = -inf."""
    _require(built_variants, "bf16", 128, True)
    q, k, v = _inputs(7, 1, s_q, s_k, 4, 4, 128, jnp.bfloat16)
    _poison_allocator(((1, s_q, 4, 128), jnp.bfloat16), ((1, 4, s_q), jnp.float32))
    ours = jax.jit(functools.partial(fa4_jax.attention, causal=True, return_lse=True, implementation="fa4"))(q, k, v)
    o, lse = np.asarray(ours[0], np.float32), np.asarray(ours[1])
    n_empty = s_q - s_k
    assert (o[:, :n_empty] == 0).all(), "O must be exactly 0 in rows that see no key"
    assert np.isneginf(lse[:, :, :n_empty]).all(), "LSE must be -inf in rows that see no key"
    assert np.isfinite(o[:, n_empty:]).all() and np.isfinite(lse[:, :, n_empty:]).all()
    # The first visible row sees exactly key 0: its softmax is the one weight 1, so O is v[:, 0] up to
    # one rounding of the output (|dO| <= u |v|, u = 2**-8 for bf16).
    np.testing.assert_allclose(o[:, n_empty], np.asarray(v[:, 0], np.float32), rtol=2.0**-8, atol=0)
    xla = fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="xla")
    check_against_reference(ours, xla, ref32(q, k, v, causal=True, softmax_scale=1 / math.sqrt(128)),
                            what=f"rows without keys {s_q}x{s_k}", no_key=np.arange(s_q) < n_empty)


def test_default_implementation_is_fa4(built_variants):
    """implementation=None on a GPU whose kernels are validated (Hopper) with the variant built must be the
    kernel, bit for bit; where they are opt-in (Blackwell until a run validates them, issue 16) it must
    not be."""
    _require(built_variants, "bf16", 128, False)
    q, k, v = _inputs(11, 1, 256, 256, 4, 4, 128, jnp.bfloat16)
    auto = jax.jit(functools.partial(fa4_jax.attention, return_lse=True))
    if not validated():
        assert FWD.target not in auto.lower(q, k, v).compile().as_text(), "an unvalidated kernel ran by default"
        return
    default = auto(q, k, v)
    fa4 = jax.jit(functools.partial(fa4_jax.attention, return_lse=True, implementation="fa4"))(q, k, v)
    # The forward kernel has no split-KV reduction, so it is deterministic: equality, not closeness.
    for a, b in zip(default, fa4):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_jit_with_transposed_inputs(built_variants):
    """Inputs produced by a transpose inside jit (XLA must hand the kernel row-major copies)."""
    _require(built_variants, "bf16", 128, True)
    q, k, v = _inputs(13, 2, 300, 300, 4, 2, 128, jnp.bfloat16)

    @jax.jit
    def f(qt, kt, vt):  # (b, h, s, d) -> (b, s, h, d)
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (qt, kt, vt))
        ours = fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="fa4")
        xla = fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="xla")
        return ours, xla, ref32(q, k, v, causal=True, softmax_scale=1 / math.sqrt(128))

    ours, xla, ref = f(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)))
    check_against_reference(ours, xla, ref, what="transposed inputs")


# (q, k, v, sinks) vmapped axes: everything mapped; a shared KV cache (only q mapped: folded into the
# query heads of each KV group); per-slice sinks (folded into the heads of q, k, v and sinks).
VMAP_AXES = {"all": (0, 0, 0, None), "q_only": (0, None, None, None), "sinks_too": (0, 0, 0, 0),
             "q_sinks": (0, None, None, 0)}


@pytest.mark.parametrize("axes", list(VMAP_AXES), ids=list(VMAP_AXES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmap(built_variants, causal, axes):
    """vmap goes through the primitive's batching rule into one kernel call, whichever operands are mapped."""
    _require(built_variants, "bf16", 128, causal)
    in_axes = VMAP_AXES[axes]
    n, b, s_q, s_k, h_q, h_k, d = 3, 2, 200, 260, 4, 2, 128
    q, k, v = _inputs(17, n * b, s_q, s_k, h_q, h_k, d, jnp.bfloat16)
    q5, k5, v5 = (x.reshape(n, b, *x.shape[1:]) for x in (q, k, v))
    if in_axes[1] is None:  # one KV shared by the n slices
        k5, v5 = k5[0], v5[0]
    sinks = jax.random.normal(jax.random.key(5), (n, h_q), jnp.float32)
    sinks_in = sinks if in_axes[3] == 0 else sinks[0]

    def attn(impl):
        f = functools.partial(fa4_jax.attention, causal=causal, return_lse=True, implementation=impl)
        return jax.jit(jax.vmap(lambda q, k, v, s: f(q, k, v, sinks=s), in_axes=in_axes))

    ours = attn("fa4")(q5, k5, v5, sinks_in)
    xla = attn("xla")(q5, k5, v5, sinks_in)
    for i in range(n):
        ki, vi = (k5, v5) if in_axes[1] is None else (k5[i], v5[i])
        si = sinks_in[i] if in_axes[3] == 0 else sinks_in
        ref = ref32(q5[i], ki, vi, causal=causal, softmax_scale=1 / math.sqrt(d), sinks=si)
        pick = lambda t: tuple(x[i] for x in t)  # noqa: E731
        check_against_reference(pick(ours), pick(xla), ref, what=f"vmap {axes} causal={causal} slice {i}")


def test_two_calls_in_one_program(built_variants):
    """Two kernel calls with different variants in one jitted program (dispatch per call, not per process)."""
    _require(built_variants, "bf16", 64, False)
    _require(built_variants, "bf16", 128, True)
    qa, ka, va = _inputs(19, 1, 257, 257, 4, 4, 64, jnp.bfloat16)
    qb, kb, vb = _inputs(23, 1, 257, 511, 4, 1, 128, jnp.bfloat16)

    @jax.jit
    def f(qa, ka, va, qb, kb, vb):
        a = fa4_jax.attention(qa, ka, va, return_lse=True, implementation="fa4")
        b = fa4_jax.attention(qb, kb, vb, causal=True, return_lse=True, implementation="fa4")
        return a, b

    a, b = f(qa, ka, va, qb, kb, vb)
    xa = fa4_jax.attention(qa, ka, va, return_lse=True, implementation="xla")
    xb = fa4_jax.attention(qb, kb, vb, causal=True, return_lse=True, implementation="xla")
    check_against_reference(a, xa, ref32(qa, ka, va, causal=False, softmax_scale=1 / 8), what="program call a")
    check_against_reference(b, xb, ref32(qb, kb, vb, causal=True, softmax_scale=1 / math.sqrt(128)),
                            what="program call b")


# Causal and windowed calls (tiles of unequal work): more tiles than SMs in some (the handout hands
# out the rest), fewer in one, the default tile of each head dim with a persistent grid. At hd192/256
# O is staged in Q's buffer, and a CTA's next Q load waits for its O store to have read it: the
# causal, windowed and full (static round robin, both settings alike) cases there have 3-4 tiles per
# SM, so almost every tile's Q lands in a buffer a previous tile's O store has just read.
HANDOUT_CASES = {
    "hd256_causal_b2_s2100": dict(head_dim=256, causal=True, b=2, s_q=2100, s_k=2100, h_q=16, h_k=2),
    "hd192_window_b3_s1500": dict(head_dim=192, causal=False, window_size=(900, 40), b=3, s_q=1500, s_k=1537,
                                  h_q=12, h_k=4),
    "hd256_full_b3_s1200": dict(head_dim=256, causal=False, b=3, s_q=1200, s_k=999, h_q=16, h_k=16),
    "hd128_causal_b4_s3000": dict(head_dim=128, causal=True, b=4, s_q=3000, s_k=3000, h_q=16, h_k=4),
    "hd64_causal_b2_s2500": dict(head_dim=64, causal=True, b=2, s_q=2500, s_k=1900, h_q=12, h_k=12),
    # hd96's 192-row causal tile (past SHORT_TILES' 2k): s_q > s_k leaves the first 267 rows empty.
    "hd96_causal_b2_s2600": dict(head_dim=96, causal=True, b=2, s_q=2600, s_k=2333, h_q=12, h_k=4),
    "hd96_window_b3_s4000": dict(head_dim=96, causal=False, window_size=(1700, 300), b=3, s_q=4000, s_k=4000,
                                 h_q=8, h_k=2),
    "hd128_causal_few_tiles": dict(head_dim=128, causal=True, b=1, s_q=300, s_k=700, h_q=2, h_k=1),
}


@pytest.mark.parametrize("case", list(HANDOUT_CASES), ids=list(HANDOUT_CASES))
def test_tile_handout_matches_one_cta_per_tile(built_variants, monkeypatch, case):
    """Tiles of unequal work run on a persistent grid that takes them from one zero-at-rest counter
    (ffi/fwd.cc, kernels/tile_scheduler.py TileHandout; the default) or one CTA each
    (FA4_JAX_DYNAMIC_TILES=0, as when the counter pool cannot serve a call). A tile computes the same
    way whichever CTA runs it, so both give the same bits; the handout is also checked against the
    oracle, and three handout calls in one program are each right: a counter a launch left non-zero
    would hand the next launch's tiles out from the middle, leaving its first tiles unwritten
    (poisoned)."""
    kw = dict(HANDOUT_CASES[case])
    head_dim, causal, window = kw.pop("head_dim"), kw.pop("causal"), kw.pop("window_size", (-1, -1))
    _require(built_variants, "bf16", head_dim, causal, window)
    run_case(built_variants, dtype_name="bf16", head_dim=head_dim, causal=causal, window_size=window, seed=7,
             **kw)
    b, s_q, s_k, h_q, h_k = (kw[n] for n in ("b", "s_q", "s_k", "h_q", "h_k"))
    q, k, v = _inputs(31, b, s_q, s_k, h_q, h_k, head_dim, jnp.bfloat16)
    call = functools.partial(fa4_jax.attention, causal=causal, window_size=window, return_lse=True,
                             implementation="fa4")

    def three(order):  # the two settings run two programs: see below
        @jax.jit
        def run(q, k, v):
            xs = (q, -q, (0.5 * q).astype(q.dtype))
            outs = {i: call(xs[i], k, v) for i in order}
            return [outs[i] for i in range(3)]
        return run

    # The handler reads FA4_JAX_DYNAMIC_TILES when XLA runs it, and an executable's command buffer
    # replays what it recorded: the same program run again could compare the handout with itself.
    outs = {}
    for dynamic, order in (("1", (0, 1, 2)), ("0", (2, 1, 0))):
        monkeypatch.setenv("FA4_JAX_DYNAMIC_TILES", dynamic)
        _poison_allocator(*[((b, s_q, h_q, head_dim), jnp.bfloat16), ((b, h_q, s_q), jnp.float32)] * 3)
        outs[dynamic] = jax.device_get(three(order)(q, k, v))
    for i, x in enumerate((q, -q, (0.5 * q).astype(q.dtype))):
        for j in range(2):  # o, lse
            np.testing.assert_array_equal(outs["1"][i][j], outs["0"][i][j],
                                          err_msg=f"{case} call {i}: handout vs one CTA per tile, output {j}")
        scale = 1.0 / math.sqrt(head_dim)
        check_against_reference(outs["1"][i], fa4_jax.attention(x, k, v, causal=causal, window_size=window,
                                                                 return_lse=True, implementation="xla"),
                                ref32(x, k, v, causal=causal, softmax_scale=scale, window_size=window),
                                what=f"{case}: call {i} of three in one program, tiles handed out")


# --------------------------------------------------------------------------------------------------
# errors surface as Python exceptions, and the process survives them
# --------------------------------------------------------------------------------------------------


def _raw_ffi_call(q, k, v, sinks=None, *, lse_shape=None, softmax_scale=0.125, softcap=0.0, window=(-1, -1)):
    """The FFI target called directly, bypassing fa4_jax's Python-side validation."""
    b, s_q, h_q, d = q.shape
    sinks = jnp.full((h_q,), -jnp.inf, jnp.float32) if sinks is None else sinks
    call = jax.ffi.ffi_call(
        FWD.target,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape or (b, h_q, s_q), jnp.float32)),
    )
    return call(q, k, v, sinks, softmax_scale=np.float32(softmax_scale), softcap=np.float32(softcap),
                window_left=np.int32(window[0]), window_right=np.int32(window[1]), unvalidated_ok=np.bool_(False))


def _assert_still_healthy(built_variants):
    # After an FFI error the CUDA context must still work: a normal call of any built variant must run
    # and be right (a sticky CUDA error would poison every later call in the process).
    var = min((v for v in built_variants if v.arch == device_arch()), key=lambda v: v.symbol)
    run_case(built_variants, dtype_name=var.dtype, head_dim=var.head_dim, causal=var.mask == "causal",
             window_size=(64, 16) if var.mask == "local" else (-1, -1), softcap=5.0 if var.softcap else 0.0,
             b=1, s_q=130, s_k=130, h_q=2, h_k=2)


@pytest.mark.parametrize(
    "head_dim,dtype,message",
    [(32, jnp.bfloat16, r"no kernel for arch=ARCH, dtype=bf16, head_dim=32, mask=full, softcap=false, tile_m=0 on device \d"),
     (128, jnp.float32, r"q must be bfloat16 or float16")],
    ids=["hd32", "f32"],
)
def test_ffi_error_is_python_exception(built_variants, head_dim, dtype, message):
    """A variant no build can contain (head_dim 32, fp32) -> the handler's ffi::Error -> a Python exception
    that carries the handler's message (not a crash, not silent garbage)."""
    q, k, v = _inputs(29, 1, 64, 64, 2, 2, head_dim, dtype)
    message = message.replace("ARCH", device_arch())  # the GPU's architecture, named by the handler
    with pytest.raises(jax.errors.JaxRuntimeError, match=FWD.target + ": " + message):
        jax.block_until_ready(jax.jit(_raw_ffi_call)(q, k, v))
    _assert_still_healthy(built_variants)


RAW_BAD = {
    "lse_shape": (dict(lse_shape=(1, 64, 2)), r"lse must be \(batch, heads_q, seqlen_q\) = \(1, 2, 64\); got \(1, 64, 2\)"),
    "sinks_shape": (dict(sinks=jnp.zeros((3,), jnp.float32)), r"sinks must be float32 \(heads_q,\) = \(2,\); got \(3\)"),
    "sinks_dtype": (dict(sinks=jnp.zeros((2,), jnp.bfloat16)), r"sinks must be float32"),
    "window": (dict(window=(-2, 0)), r"window bounds must be >= -1 \(-1 = unbounded\); got \(-2, 0\)"),
    "softcap": (dict(softcap=-1.0), r"softcap must be 0 or a positive float32"),
    "scale_inf": (dict(softmax_scale=np.inf), r"softmax_scale must be a positive normal float32"),
    "scale_denormal": (dict(softmax_scale=1e-40), r"softmax_scale must be a positive normal float32"),
}


@pytest.mark.parametrize("case", sorted(RAW_BAD))
def test_raw_handler_validates(built_variants, case):
    """The handler checks what the Python API checks: another caller of the FFI target (e.g. a
    deserialized jax.export artifact) gets a clear error, never a launch on bad arguments."""
    kwargs, message = dict(RAW_BAD[case][0]), RAW_BAD[case][1]
    sinks = kwargs.pop("sinks", None)
    q, k, v = _inputs(37, 1, 64, 64, 2, 2, 128, jnp.bfloat16)
    with pytest.raises(jax.errors.JaxRuntimeError, match=FWD.target + ": " + message):
        jax.block_until_ready(jax.jit(functools.partial(_raw_ffi_call, **kwargs))(q, k, v, sinks))


def test_raw_handler_validates_heads(built_variants):
    q, _, _ = _inputs(38, 1, 64, 64, 6, 4, 128, jnp.bfloat16)
    _, k, v = _inputs(38, 1, 64, 64, 4, 4, 128, jnp.bfloat16)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"heads_q \(6\) must be a multiple of heads_kv \(4\)"):
        jax.block_until_ready(jax.jit(_raw_ffi_call)(q, k, v))


def test_missing_variant_raises(built_variants, monkeypatch):
    """implementation="fa4" for a variant the (narrowed) build lacks must raise, not crash or fall back.

    With the full default menu built nothing is missing: the Python side is then shown a library
    without one variant (the FFI-level error path is test_ffi_error_is_python_exception's)."""
    from fa4_jax.core import library as _ffi

    # Dense variants only: a library narrowed to other families misses variants attention() never asks for.
    # (Not a short-problem tile: the handler picks those and falls back to the default tile without one.)
    missing = [v for v in default_menu()
               if isinstance(v, FwdVariant) and not v.tile_m and v.arch == device_arch() and v not in built_variants]
    narrowed = bool(missing)
    if not narrowed:
        missing = [FwdVariant(device_arch(), "fp16", 192, "local", True)]
        monkeypatch.setattr(_ffi, "compiled_variants", lambda: built_variants - frozenset(missing))
    var = missing[0]
    dtype = DTYPES[var.dtype]
    q, k, v = _inputs(31, 1, 64, 64, 2, 2, var.head_dim, dtype)
    window = {"full": (-1, -1), "causal": (-1, 0), "local": (16, 16)}[var.mask]
    softcap = 5.0 if var.softcap else 0.0
    with pytest.raises(RuntimeError, match=f"has no variant {var.symbol}"):
        fa4_jax.attention(q, k, v, window_size=window, softcap=softcap, implementation="fa4")
    if narrowed:
        # And the same variant through the raw FFI target: the C++ side's error, also as an exception.
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"no kernel for .*this library was built with"):
            jax.block_until_ready(jax.jit(functools.partial(_raw_ffi_call, window=window, softcap=softcap))(q, k, v))
    monkeypatch.undo()
    _assert_still_healthy(built_variants)


# --------------------------------------------------------------------------------------------------
# window, softcap, sinks
# --------------------------------------------------------------------------------------------------

# (causal, window_size): causal, causal + left window, two-sided, diagonal only, right-only, left-only.
WINDOWS = {
    "causal": (True, (-1, -1)),
    "causal_w300": (True, (300, -1)),
    "w128_0": (False, (128, 0)),
    "w100_50": (False, (100, 50)),
    "w0_0": (False, (0, 0)),
    "right37": (False, (-1, 37)),
    "left300": (False, (300, -1)),
}
FEATURE_SHAPES = {"777x1000": (777, 1000), "1000x777": (1000, 777)}


@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["nocap", "cap5"])
@pytest.mark.parametrize("window", list(WINDOWS), ids=list(WINDOWS))
@pytest.mark.parametrize("shape", list(FEATURE_SHAPES), ids=list(FEATURE_SHAPES))
def test_window_softcap_sinks(built_variants, shape, window, softcap, sinks):
    causal, window_size = WINDOWS[window]
    s_q, s_k = FEATURE_SHAPES[shape]
    run_case(built_variants, dtype_name="bf16", head_dim=128, causal=causal, window_size=window_size,
             softcap=softcap, sinks=sinks, b=2, s_q=s_q, s_k=s_k, h_q=8, h_k=2)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 96, 192, 256], ids=lambda d: f"hd{d}")
@pytest.mark.parametrize("window", ["causal_w300", "w100_50"])
def test_window_softcap_sinks_head_dims(built_variants, dtype_name, head_dim, window):
    causal, window_size = WINDOWS[window]
    run_case(built_variants, dtype_name=dtype_name, head_dim=head_dim, causal=causal, window_size=window_size,
             softcap=20.0, sinks=True, b=1, s_q=515, s_k=1031, h_q=6, h_k=2)


@pytest.mark.parametrize("h_q,h_k", [(4, 4), (8, 1), (12, 4)], ids=["mha", "mqa", "gqa3"])
def test_window_gqa(built_variants, h_q, h_k):
    run_case(built_variants, dtype_name="bf16", head_dim=128, causal=False, window_size=(64, 64), softcap=0.0,
             sinks=True, b=2, s_q=300, s_k=300, h_q=h_q, h_k=h_k)


@pytest.mark.parametrize("window_size,s_q,s_k", [((0, 0), 300, 100), ((10, 0), 400, 129), ((3, 2), 1, 7)])
@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
def test_window_rows_without_keys(built_variants, window_size, s_q, s_k, sinks):
    """Windows that leave rows (and whole tiles) without keys: o = 0, lse = -inf or the sink logit."""
    run_case(built_variants, dtype_name="bf16", head_dim=128, causal=False, window_size=window_size,
             sinks=sinks, b=1, s_q=s_q, s_k=s_k, h_q=4, h_k=2)


def test_sinks_dominate_without_overflow(built_variants):
    """A sink logit far above every score: O -> ~0 and LSE = the sink, never inf/NaN."""
    _require(built_variants, "bf16", 128, True)
    q, k, v = _inputs(41, 1, 256, 256, 2, 2, 128, jnp.bfloat16)
    sinks = jnp.array([80.0, -80.0], jnp.float32)
    o, lse = jax.jit(functools.partial(fa4_jax.attention, causal=True, return_lse=True, implementation="fa4"))(
        q, k, v, sinks=sinks)
    ours = (o, lse)
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    # Head 0 (sink +80): O ~ e^-80 |v|, LSE the sink logit.
    assert np.abs(o[:, :, 0]).max() < 1e-30 and np.allclose(lse[:, 0], 80.0, atol=1e-4)
    # Every head against the oracle, head 1 (sink -80: no weight at all) included, O and LSE.
    xla = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, implementation="xla")
    ref = ref32(q, k, v, causal=True, softmax_scale=1 / math.sqrt(128), sinks=sinks)
    check_against_reference(ours, xla, ref, what="sinks +80 / -80")
    head1 = lambda t: (t[0][:, :, 1:], t[1][:, 1:])  # noqa: E731
    check_against_reference(head1(ours), head1(xla), head1(ref), what="sink -80 head")


# --------------------------------------------------------------------------------------------------
# launch limits, command buffers, module loading
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,h", [(70000, 1), (1, 70000)], ids=["batch70000", "heads70000"])
def test_grid_beyond_65535(built_variants, b, h):
    """More than 65535 (batch x heads) tiles: the linear tile scheduler's 1-D grid takes them all
    (a (m, head, batch) grid would fail at launch: gridDim.y/z <= 65535)."""
    run_case(built_variants, dtype_name="bf16", head_dim=64, causal=True, b=b, s_q=3, s_k=5, h_q=h, h_k=h)


def _run_subprocess(code: str, env_extra: dict, timeout=240) -> str:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.path.dirname(__file__),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"subprocess failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res.stdout


COMMAND_BUFFER_SCRIPT = """
import functools, numpy as np, jax, jax.numpy as jnp, fa4_jax
from accuracy import check_against_reference
from oracle import attention_oracle
opts = dict(causal=True, window_size=(200, -1), softcap=10.0, return_lse=True)
f = jax.jit(functools.partial(fa4_jax.attention, implementation="fa4", **opts))
x = jax.jit(functools.partial(fa4_jax.attention, implementation="xla", **opts))
g = jax.jit(lambda q, k, v, s: f(q, k, v, sinks=s)[0] * 2)  # the call inside a larger captured program
for i in range(6):  # new input buffers every call: the recorded graph must follow them
    key = jax.random.key(i)
    q, k, v = (jax.random.normal(kk, (2, 300 + 64 * (i % 2), 4, 128), jnp.float32).astype(jnp.bfloat16)
               for kk in jax.random.split(key, 3))
    s = jax.random.normal(jax.random.key(100 + i), (4,), jnp.float32)
    o, lse = f(q, k, v, sinks=s)
    o2 = g(q, k, v, s)
    ref = attention_oracle(q, k, v, xp=jnp, causal=True, window_size=(200, -1), softcap=10.0,
                           sinks=s, softmax_scale=128 ** -0.5)
    check_against_reference((o, lse), x(q, k, v, sinks=s), ref, what=f"command buffers, call {i}")
    assert bool(jnp.all(o2 == o * 2)), i
print("COMMAND_BUFFERS_OK")
"""


def test_command_buffers_forced_on(built_variants):
    """XLA captures the custom call into CUDA graphs (command buffers forced on for every custom call,
    even single-op graphs) across repeated calls with fresh buffers: results stay right."""
    _require(built_variants, "bf16", 128, True, (200, -1), 10.0)
    out = _run_subprocess(COMMAND_BUFFER_SCRIPT, {
        "XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert "COMMAND_BUFFERS_OK" in out


LOAD_FAILURE_SCRIPT = """
import functools, os, numpy as np, jax, jax.numpy as jnp, fa4_jax
from accuracy import check_against_reference
from oracle import attention_oracle
from fa4_jax.ops.fwd.primitive import fa4_fwd_p
q, k, v = (jax.random.normal(kk, (1, 200, 2, 128), jnp.float32).astype(jnp.bfloat16)
           for kk in jax.random.split(jax.random.key(0), 3))
want = fa4_jax.attention(q, k, v, implementation="xla")
xla = fa4_jax.attention(q, k, v, return_lse=True, implementation="xla")
ref = attention_oracle(q, k, v, softmax_scale=128 ** -0.5, xp=jnp)
# 1. The kernel does not load: implementation=None lowers to the XLA path, "fa4" says why.
assert "fa4_jax_fwd" not in jax.jit(fa4_jax.attention).lower(q, k, v).as_text()
got = fa4_jax.attention(q, k, v)
assert float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()) == 0.0
try:
    fa4_jax.attention(q, k, v, implementation="fa4")
    raise SystemExit("expected RuntimeError")
except RuntimeError as e:
    assert "simulated by FA4_JAX_FAIL_MODULE_LOAD" in str(e), e
# 2. The FFI handler itself (the Python checks of the call and of the lowering bypassed): an FFI
#    error, not a crash.
from fa4_jax.core import platform as _platform
_platform.lowering_reason = lambda make_variant, devices: None
raw = jax.jit(lambda q, k, v: tuple(fa4_fwd_p.bind(q, k, v, softmax_scale=128 ** -0.5, window_left=-1,
                                                   window_right=-1, softcap=0.0, has_sinks=False, implementation="fa4")))
try:
    jax.block_until_ready(raw(q, k, v))
    raise SystemExit("expected an FFI error")
except jax.errors.JaxRuntimeError as e:
    assert "simulated by FA4_JAX_FAIL_MODULE_LOAD" in str(e), e
# 3. The failure is not permanent: once loading works, both paths run the kernel.
del os.environ["FA4_JAX_FAIL_MODULE_LOAD"]
check_against_reference(fa4_jax.attention(q, k, v, return_lse=True, implementation="fa4"), xla, ref,
                        what="after the load failure, public API")
check_against_reference(raw(q, k, v), xla, ref, what="after the load failure, raw bind")
print("LOAD_FAILURE_OK")
"""


def test_module_load_failure_is_reported_and_recoverable(built_variants):
    _require(built_variants, "bf16", 128, False)
    # cuDNN out of the choice: with it, implementation=None on a kernel that does not load lowers to
    # cuDNN (tests/test_gpu_cudnn.py); this test is about the kernel's failure and the XLA path.
    out = _run_subprocess(LOAD_FAILURE_SCRIPT, {"FA4_JAX_FAIL_MODULE_LOAD": "all", "FA4_JAX_DISABLE_CUDNN": "1",
                                                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert "LOAD_FAILURE_OK" in out


SHORT_TILE_SCRIPT = """
import os, jax, jax.numpy as jnp, fa4_jax
from fa4_jax.ops.fwd.spec import SHORT_TILES
hd = int(os.environ["SHORT_HD"])
tile_m, N = SHORT_TILES[hd]
def run(s_q, s_k, causal=True, hd=hd):
    ks = jax.random.split(jax.random.key(s_q * 7 + s_k), 3)
    q = jax.random.normal(ks[0], (1, s_q, 2, hd), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, s_k, 2, hd), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:])
    return jax.block_until_ready(fa4_jax.attention(q, k, v, causal=causal, implementation="fa4"))
# Longer than the short tile's bound on either side, full attention, another head dim: the default tile.
for s_q, s_k, causal, d in [(N + 1, N + 1, True, hd), (N, N + 1, True, hd), (N + 1, N, True, hd),
                            (N, N, False, hd), (N, N, True, 128)]:
    assert bool(jnp.all(jnp.isfinite(run(s_q, s_k, causal, d).astype(jnp.float32)))), (s_q, s_k, causal, d)
# Within it (both sides), causal: the handler takes the short tile, whose load fails here. (A causal
# 1 x 1 call is full attention to the API: its window is trimmed to the keys.)
for s_q, s_k in [(N, N), (2, 2), (777, 1000), (1000, 129), (N - 1, N // 2 + 3)]:
    try:
        run(s_q, s_k)
        raise SystemExit(f"expected the short tile at {s_q}x{s_k}")
    except jax.errors.JaxRuntimeError as e:
        assert f"hd{hd}_causal_m{tile_m} on device" in str(e) and "simulated by FA4_JAX_FAIL_MODULE_LOAD" in str(e), e
print("SHORT_TILE_OK")
"""


@pytest.mark.parametrize("hd", sorted(SHORT_TILES))
def test_short_causal_problems_take_the_short_tile(built_variants, hd):
    """The handler routes causal problems of a head dim with a short-problem tile (SHORT_TILES: hd64's
    64 rows up to 1k, hd96's 128 rows up to 2k) and max(s_q, s_k) within its bound to that tile
    (FwdVariant.tile_m; its results are checked by every short causal case above) and everything else
    to the default tile: shown by making only the short tile's module fail to load."""
    tile_m, _ = SHORT_TILES[hd]
    short = FwdVariant(device_arch(), "bf16", hd, "causal", False, tile_m=tile_m)
    if short not in default_menu():
        pytest.skip(f"no short-problem tile on {device_arch()}")
    require_variant(built_variants, short)
    _require(built_variants, "bf16", hd, True)
    _require(built_variants, "bf16", hd, False)
    _require(built_variants, "bf16", 128, True)
    out = _run_subprocess(SHORT_TILE_SCRIPT, {"FA4_JAX_FAIL_MODULE_LOAD": f"hd{hd}_causal_m{tile_m}", "SHORT_HD": str(hd),
                                              "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert "SHORT_TILE_OK" in out
