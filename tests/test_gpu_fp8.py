"""The FP8 (float8_e4m3fn) KV-cache kernels on the GPU (`@pytest.mark.gpu`): the 16-row decode tile,
which widens each thread's FP8 bytes in registers for warp mmas (fa4_jax/kernels/decode_fp8_sm90.py:
calls of up to 16 packed rows per sequence), the 64-row tile up to 64, which widens K and V to fp16
in shared memory, V by two producer warps except with one-row pages, and the two-warpgroup chunk
tile past 64 rows, whose producer widens both (fa4_jax/kernels/fwd_sm90.py: dequant, widen_kv,
quantize_q; one-row pages run chunks as 64-row tiles).

Every case: implementation="fa4" (a missing kernel fails, tests/gpu_menu.py says when one may skip),
fresh random inputs twice after poisoning the allocator, the cache quantized with per-head scales,
every slot past a sequence's length and every page no sequence owns filled with FP8 NaN (0x7F), and
the accuracy rule of tests/accuracy.py with
  - the oracle: float64 attention of q on the dequantized cache (fp8 * scale, exact in float64),
  - the yardstick: fa4_jax's XLA path on the same FP8 call (the exact reference on the dequantized
    cache, o rounded once to q's dtype), so the bound is the 16-bit kernels' rule: about one ulp
    of q's dtype beyond that rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from accuracy import check_against_reference, poison_allocator
from fa4_jax.families import KVCacheVariant
from fa4_jax.ops.kvcache.spec import FP8_TILE_MS, FP8_WIDE_PAGE_ROWS, MASK, PAGE_ROWS, page_rows_for
from gpu_menu import device_arch, require_variant
from oracle import OPTION_CASES, attention_oracle, gather, make_sinks

pytestmark = [pytest.mark.gpu, pytest.mark.kernel_family("kvcache")]
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
FP8 = jnp.float8_e4m3fn
FP8_NAN = np.array(0x7F, np.uint8).view(FP8)  # e4m3fn's NaN (it has no inf)


@pytest.fixture(scope="module")
def built(kernel_variants):
    return kernel_variants


def _require(built, dtype, hd, softcap, page_size):
    """Every FP8 tile the cache layout has (a call takes the one its rows need: api._tile_m; one-row
    pages have no 128-row tile)."""
    paged = page_size is not None
    page_rows = page_rows_for(page_size) if paged else PAGE_ROWS
    for tile_m in FP8_TILE_MS:
        if tile_m == max(FP8_TILE_MS) and page_rows not in FP8_WIDE_PAGE_ROWS:
            continue
        require_variant(built, KVCacheVariant(device_arch(), dtype, hd, MASK, softcap, paged, tile_m, page_rows,
                                              kv_fp8=True))


def _oracle(q, k32, v32, lens, opts, sinks):
    """float64, per row over its valid keys; k32 / v32 the dequantized contiguous caches."""
    b, s_q, h_q, d = q.shape
    kw = dict(opts, softmax_scale=opts.get("softmax_scale", d ** -0.5))
    if sinks is not None:
        kw["sinks"] = np.asarray(sinks)
    o = np.zeros(q.shape, np.float64)
    lse = np.zeros((b, h_q, s_q), np.float64)
    q64 = np.asarray(q, np.float32)
    for n in np.unique(lens):
        rows = np.flatnonzero(lens == n)
        o_n, lse_n = attention_oracle(q64[rows], k32[rows, :n], v32[rows, :n], xp=np, **kw)
        o[rows], lse[rows] = o_n, lse_n
    return o, lse


def run_fp8_case(built, *, b=3, s_q=1, h_q=8, h_k=2, lens, capacity, opts=None, dtype="bf16", hd=128,
                 page_size=None, num_splits=None, q_scale=1.0, seed=0):
    opts = dict(opts or {})
    sinks = opts.pop("sinks", None)
    _require(built, dtype, hd, opts.get("softcap", 0.0) > 0, page_size)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    sinks = None if sinks is None else jnp.asarray(make_sinks(seed + 5, h_q))
    k_scale = rng.uniform(0.002, 0.02, h_k).astype(np.float32)  # per KV head, values up to ~9
    v_scale = rng.uniform(0.002, 0.02, h_k).astype(np.float32)
    what = (f"fp8 kvcache {dtype} hd{hd} b={b} s_q={s_q} h={h_q}/{h_k} lens={lens.tolist()} page={page_size} "
            f"splits={num_splits} {opts} sinks={sinks is not None} q_scale={q_scale}")
    for run in range(2):
        ks = jax.random.split(jax.random.key(seed * 2 + run), 3)
        q = (q_scale * jax.random.normal(ks[0], (b, s_q, h_q, hd), jnp.float32)).astype(dt)
        # Contiguous logical caches first, quantized as update_kvcache does (value / scale, RNE, +-448).
        k_log = np.asarray(2.0 * jax.random.normal(ks[1], (b, capacity, h_k, hd), jnp.float32))
        v_log = np.asarray(jax.random.normal(ks[2], (b, capacity, h_k, hd), jnp.float32))
        k8 = np.clip(k_log / k_scale[:, None], -448, 448).astype(FP8)
        v8 = np.clip(v_log / v_scale[:, None], -448, 448).astype(FP8)
        for x in (k8, v8):  # poison: what no row may read
            for i, n in enumerate(lens):
                x[i, max(int(n), 0):] = FP8_NAN
        k32, v32 = (x.astype(np.float32) * s[:, None] for x, s in ((k8, k_scale), (v8, v_scale)))
        table = None
        kc, vc = k8, v8
        if page_size is not None:
            max_pages = -(-capacity // page_size)
            num_pages = b * max_pages + 3
            table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
            kc = np.full((num_pages, page_size, h_k, hd), FP8_NAN, FP8)  # unowned pages stay NaN
            vc = kc.copy()
            pad = max_pages * page_size - capacity
            for x_pool, x in ((kc, k8), (vc, v8)):
                full = np.concatenate([x, np.full((b, pad, h_k, hd), FP8_NAN, FP8)], axis=1)
                x_pool[table.reshape(-1)] = full.reshape(b * max_pages, page_size, h_k, hd)
            np.testing.assert_array_equal(gather(kc, table)[:, :capacity].view(np.uint8), k8.view(np.uint8))
        kw = dict(return_lse=True, num_splits=num_splits, **opts)

        @jax.jit
        def both(q, kc, vc, n, t, s, kscale, vscale):
            return tuple(fa4_jax.attention_with_kvcache(q, kc, vc, n, page_table=t, sinks=s, k_scale=kscale,
                                                        v_scale=vscale, implementation=impl, **kw)
                         for impl in ("fa4", "xla"))

        poison_allocator((q.shape, q.dtype), ((b, h_q, s_q), jnp.float32))
        ours, xla = both(q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(lens),
                         None if table is None else jnp.asarray(table), sinks, jnp.asarray(k_scale),
                         jnp.asarray(v_scale))
        assert ours[0].dtype == dt
        ref = _oracle(q, k32, v32, lens, opts, sinks)
        check_against_reference(ours, xla, ref, what=f"{what} run {run}")


GQA = {"mha": 8, "gqa4": 2, "mqa": 1}


@pytest.mark.parametrize("heads_kv", list(GQA), ids=list(GQA))
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_fp8_decode_options_gqa(built, case, heads_kv):
    """Every mask, softcap and sinks, MHA / GQA / MQA, odd lengths incl. an empty row and a full one."""
    run_fp8_case(built, h_k=GQA[heads_kv], lens=[0, 37, 300], capacity=300, opts=OPTION_CASES[case],
                 seed=len(case))


@pytest.mark.parametrize("num_splits", [1, None, 3, 64])
def test_fp8_decode_splits(built, num_splits):
    run_fp8_case(built, b=2, lens=[4099, 1000], capacity=4099, num_splits=num_splits, seed=3)


@pytest.mark.parametrize("fuse", ["1", "0"], ids=["merged_by_last_split", "combine_kernel"])
def test_fp8_split_merge_paths(built, monkeypatch, fuse):
    monkeypatch.setenv("FA4_JAX_FUSE_COMBINE", fuse)
    run_fp8_case(built, b=1, lens=[8191], capacity=8192, num_splits=8, opts=dict(causal=True), seed=4)


@pytest.mark.parametrize("page_size", [1, 5, 16, 48, 64, 256])
@pytest.mark.parametrize("case", ["plain", "everything"])
def test_fp8_paged(built, page_size, case):
    """Shuffled page tables, unowned pages NaN, page sizes in TMA pieces (16 | size) or gathered rows."""
    run_fp8_case(built, lens=[1, 257, 777], capacity=800, page_size=page_size, opts=OPTION_CASES[case],
                 seed=page_size)


@pytest.mark.parametrize("dtype,hd", [("fp16", 128), ("bf16", 64), ("fp16", 64)])
@pytest.mark.parametrize("page_size", [None, 16, 1], ids=["contiguous", "page16", "page1"])
def test_fp8_dtypes_head_dims(built, dtype, hd, page_size):
    run_fp8_case(built, lens=[5, 129, 1000], capacity=1000, dtype=dtype, hd=hd, page_size=page_size,
                 opts=dict(causal=True), seed=hd)


@pytest.mark.parametrize("dtype,hd", [("bf16", 128), ("fp16", 128), ("bf16", 64), ("fp16", 64)])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("s_q,tile_m", [(9, 64), (100, 128)], ids=["m64_tile", "m128_tile"])
def test_fp8_wgmma_tiles_dtypes_head_dims(built, dtype, hd, page_size, s_q, tile_m):
    """Each wgmma FP8 tile at both head dims and q dtypes, contiguous and in 16-row page pieces: s_q 9
    (36 packed rows: the 64-row tile, V widened by two producer warps, K by the consumer) and s_q 100
    (400 rows: the 128-row chunk tile, K and V widened by its widening warpgroup: fp8_widen_layout's
    hd64 and hd128 row maps); a sequence shorter than the chunk, one ending inside a block, one long."""
    from fa4_jax.ops.kvcache import api

    assert api._tile_m(s_q, 8, 2, True, PAGE_ROWS) == tile_m  # the tile this case is for
    run_fp8_case(built, s_q=s_q, lens=[s_q // 2, 129 + s_q, 1000], capacity=1000, dtype=dtype, hd=hd,
                 page_size=page_size, opts=dict(causal=True), seed=hd + s_q + (page_size or 0))


@pytest.mark.parametrize("hd", [128, 64])
def test_fp8_speculative_rows(built, hd):
    """s_q 3 (three draft tokens): 12 packed rows per tile (both n8 halves of the 16-row tile),
    bottom-right causal."""
    run_fp8_case(built, s_q=3, lens=[3, 64, 2000], capacity=2000, opts=dict(causal=True), hd=hd, seed=7)


def test_fp8_sixteen_q_heads_per_kv_head(built):
    """16 q-heads per KV head: the 16-row tile full, with windows, softcap and sinks."""
    run_fp8_case(built, h_q=16, h_k=1, lens=[1, 130, 999], capacity=999, opts=OPTION_CASES["everything"], seed=8)


@pytest.mark.parametrize("num_splits", [1, None])
def test_fp8_decode_rescales(built, num_splits):
    """softmax_scale 1: scores spread over tens of log2 units, so a warp's running max trails the
    blocks' maxima by more than the rescaling threshold (8) after O and the sum are nonzero."""
    run_fp8_case(built, lens=[77, 1000, 4099], capacity=4099, num_splits=num_splits, opts=dict(softmax_scale=1.0),
                 seed=9)


@pytest.mark.parametrize("s_q", [1, 37], ids=["decode_tile", "chunk_tile"])
def test_fp8_zero_q_tiny_softmax_scale(built, s_q):
    """An all-zero q (a zero-padded slot) with a tiny softmax scale: every score is 0, so each row is
    the mean of its V rows. q's power of two must not push the scores' factor to 0 (0 times a
    masked score, -inf, is NaN; fp8_q_exponent caps it)."""
    run_fp8_case(built, s_q=s_q, lens=[17, 300, 300], capacity=300, q_scale=0.0, opts=dict(softmax_scale=1e-6),
                 seed=12)


@pytest.mark.parametrize("q_scale", [3e4, 1e-5, 1e33], ids=["q_large", "q_tiny", "q_huge"])
def test_fp8_q_outside_fp16_range(built, q_scale):
    """q far outside fp16's range times k_scale (3e4 * ~9 overflows fp16, 1e-5 underflows its normals,
    1e33 ~ 2^110): the per-tile power of two keeps the fp16 gemm exact enough (fwd_sm90.quantize_q).
    The softmax scale keeps the scores moderate."""
    run_fp8_case(built, lens=[17, 300, 300], capacity=300, q_scale=q_scale,
                 opts=dict(softmax_scale=0.1 / (q_scale * 128 ** 0.5)), seed=11)


def test_fp8_saturated_and_subnormal_cache(built):
    """Cache bytes at +-448 (saturation) and in e4m3's subnormal range: the widening is exact."""
    _require(built, "bf16", 128, False, None)
    b, cap, h_q, h_k, d = 2, 130, 8, 2, 128
    rng = np.random.default_rng(5)
    codes = rng.choice(np.r_[np.arange(0x01, 0x08), np.arange(0x79, 0x7F), np.arange(0x81, 0x88),
                             np.arange(0xF9, 0xFF)].astype(np.uint8), (b, cap, h_k, d))
    k8, v8 = codes.view(FP8), rng.permutation(codes.reshape(-1)).reshape(codes.shape).view(FP8)
    ks, vs = np.float32(0.01), np.float32(0.5)
    q = jax.random.normal(jax.random.key(0), (b, 1, h_q, d), jnp.float32).astype(jnp.bfloat16)
    lens = np.array([130, 77], np.int32)
    k32, v32 = k8.astype(np.float32) * ks, v8.astype(np.float32) * vs
    ours = fa4_jax.attention_with_kvcache(q, jnp.asarray(k8), jnp.asarray(v8), jnp.asarray(lens), k_scale=ks,
                                          v_scale=vs, return_lse=True, implementation="fa4")
    xla = fa4_jax.attention_with_kvcache(q, jnp.asarray(k8), jnp.asarray(v8), jnp.asarray(lens), k_scale=ks,
                                         v_scale=vs, return_lse=True, implementation="xla")
    check_against_reference(ours, xla, _oracle(q, k32, v32, lens, {}, None), what="saturated/subnormal cache")


@pytest.mark.parametrize("s_q", [37, 128])
@pytest.mark.parametrize("page_size", [None, 16, 1], ids=["contiguous", "page16", "page1"])
def test_fp8_prefill_chunks(built, s_q, page_size):
    """A prefill chunk on an FP8 cache (s_q x 4 q-heads per KV head = 148 / 512 packed rows): the
    128-row chunk tile (one-row pages: several 64-row tiles) per sequence, bottom-right causal; the
    first sequence is shorter than its chunk (its first rows see no key)."""
    run_fp8_case(built, s_q=s_q, lens=[20, 300, 1999], capacity=1999, page_size=page_size,
                 opts=dict(causal=True), seed=s_q + (page_size or 0))


def test_fp8_inf_in_q_stays_in_its_row(built):
    """An infinite q element makes its own row's output non-finite (as the exact reference does) and
    no other: the tile's other rows (other q heads of the KV head) keep their power of two."""
    _require(built, "bf16", 128, False, None)
    b, cap, h_q, h_k, d = 2, 300, 8, 2, 128
    rng = np.random.default_rng(21)
    k = rng.standard_normal((b, cap, h_k, d)).astype(np.float32)
    v = rng.standard_normal((b, cap, h_k, d)).astype(np.float32)
    ks, vs = np.float32(0.02), np.float32(0.03)
    k8, v8 = (jnp.asarray(x / s).astype(FP8) for x, s in ((k, ks), (v, vs)))
    q = np.array(jax.random.normal(jax.random.key(4), (b, 1, h_q, d), jnp.float32))
    q[0, 0, 3, 5] = np.inf
    q = jnp.asarray(q, jnp.bfloat16)
    lens = jnp.asarray([300, 123], jnp.int32)
    call = lambda impl: np.asarray(fa4_jax.attention_with_kvcache(  # noqa: E731
        q, k8, v8, lens, k_scale=ks, v_scale=vs, implementation=impl), np.float32)
    ours, xla = call("fa4"), call("xla")
    bad = np.zeros((b, 1, h_q), bool)
    bad[0, 0, 3] = True
    assert not np.isfinite(ours[bad]).all() and not np.isfinite(xla[bad]).all()
    assert np.isfinite(ours[~bad]).all()
    np.testing.assert_allclose(ours[~bad], xla[~bad], atol=2e-2 * np.abs(xla[~bad]).max(), rtol=0)


@pytest.mark.parametrize("case", ["plain", "window_two_sided", "everything"])
def test_fp8_prefill_chunk_options(built, case):
    run_fp8_case(built, s_q=100, lens=[100, 555, 1000], capacity=1000, opts=OPTION_CASES[case], seed=len(case) + 40)


RAGGED_STEPS = {"chunks_and_decodes": [40, 0, 1, 130, 1], "decodes": [1, 0, 1, 1, 1], "drafts": [3, 1, 0, 4, 2]}
# Rows of q past cu_seqlens_q[-1] that no sequence owns (o = 0, lse = -inf).
RAGGED_PADDING = {"chunks_and_decodes": 0, "decodes": 3, "drafts": 5}


@pytest.mark.parametrize("step", list(RAGGED_STEPS))
@pytest.mark.parametrize("page_size", [None, 16, 5], ids=["contiguous", "page16", "page5"])
def test_fp8_ragged_chunks_and_decodes(built, page_size, step):
    """One ragged call (cu_seqlens_q) mixing prefill chunks, an empty sequence and one-token decodes
    on an FP8 cache, as a serving step does (the 128-row chunk tile; page 5: the 64-row one), or
    decodes and draft tokens only (the 16-row tile: 4 q-heads per KV head x up to 4 queries, with the
    padding rows' pseudo-batch); slots past each length and unowned pages NaN."""
    _require(built, "bf16", 128, False, page_size)
    h_q, h_k, d, cap = 8, 2, 128, 700
    q_lens = np.array(RAGGED_STEPS[step], np.int32)
    lens = np.array([300, 5, 699, 130, 1], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    b, total = len(lens), int(cu[-1]) + RAGGED_PADDING[step]
    rng = np.random.default_rng(17 + (page_size or 0))
    k_scale = rng.uniform(0.002, 0.02, h_k).astype(np.float32)
    v_scale = rng.uniform(0.002, 0.02, h_k).astype(np.float32)
    ks = jax.random.split(jax.random.key(page_size or 0), 3)
    q = jax.random.normal(ks[0], (total, h_q, d), jnp.float32).astype(jnp.bfloat16)
    k8 = np.clip(np.asarray(2.0 * jax.random.normal(ks[1], (b, cap, h_k, d))) / k_scale[:, None], -448, 448).astype(FP8)
    v8 = np.clip(np.asarray(jax.random.normal(ks[2], (b, cap, h_k, d))) / v_scale[:, None], -448, 448).astype(FP8)
    for x in (k8, v8):
        for i, n in enumerate(lens):
            x[i, n:] = FP8_NAN
    k32, v32 = (x.astype(np.float32) * s[:, None] for x, s in ((k8, k_scale), (v8, v_scale)))
    kc, vc, table = k8, v8, None
    if page_size is not None:
        mp = -(-cap // page_size)
        table = rng.permutation(b * mp + 3)[: b * mp].reshape(b, mp).astype(np.int32)
        full = lambda x: np.concatenate([x, np.full((b, mp * page_size - cap, h_k, d), FP8_NAN, FP8)], axis=1)  # noqa: E731
        kc, vc = (np.full((b * mp + 3, page_size, h_k, d), FP8_NAN, FP8) for _ in range(2))
        kc[table.reshape(-1)] = full(k8).reshape(b * mp, page_size, h_k, d)
        vc[table.reshape(-1)] = full(v8).reshape(b * mp, page_size, h_k, d)

    @jax.jit
    def both(q, kc, vc, n, cu, t, kscale, vscale):
        return tuple(fa4_jax.attention_with_kvcache(q, kc, vc, n, cu_seqlens_q=cu, max_seqlen_q=int(q_lens.max()),
                                                    page_table=t, causal=True, k_scale=kscale, v_scale=vscale,
                                                    return_lse=True, implementation=impl) for impl in ("fa4", "xla"))

    poison_allocator((q.shape, q.dtype), ((h_q, total), jnp.float32))
    ours, xla = both(q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(lens), jnp.asarray(cu),
                     None if table is None else jnp.asarray(table), jnp.asarray(k_scale), jnp.asarray(v_scale))
    o_ref, lse_ref = np.zeros((total, h_q, d)), np.full((h_q, total), -np.inf)
    for i in range(b):
        r = slice(cu[i], cu[i + 1])
        if cu[i + 1] > cu[i]:
            o_i, lse_i = attention_oracle(np.asarray(q[r], np.float32)[None], k32[i:i + 1, :lens[i]],
                                          v32[i:i + 1, :lens[i]], softmax_scale=d ** -0.5, causal=True, xp=np)
            o_ref[r], lse_ref[:, r] = o_i[0], lse_i[0]
    lift = lambda o, lse: (np.asarray(o)[None], np.asarray(lse)[None])  # noqa: E731  (b = 1 for the rule)
    check_against_reference(lift(*ours), lift(*xla), lift(o_ref, lse_ref),
                            what=f"fp8 ragged q_lens={q_lens.tolist()} lens={lens.tolist()} page={page_size}")
