"""The KV-cache entry points on the GPU (`@pytest.mark.gpu`): in-place cache updates in bf16 (XLA:CPU
converts bf16 scatters through float32, so only a GPU shows the real program), and the KV-cache kernel
(fa4_jax/kernels/fwd_sm90.py, configured by FwdSeams.kvcache) against the fp32 oracle with the accuracy rule of tests/accuracy.py
(O and LSE; the XLA path on the same inputs is the yardstick), each case twice with fresh inputs after
poisoning the allocator. Every kernel call is implementation="fa4": a missing kernel fails, never
falls back to the reference (tests/gpu_menu.py says when a case may skip)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from accuracy import check_against_reference, poison_allocator
from fa4_jax.families import KVCacheVariant
from fa4_jax.ops.kvcache.spec import MASK, PAGE_ROWS, page_rows_for, tile_m_for
from gpu_menu import device_arch, require_variant
from oracle import OPTION_CASES, attention_oracle, make_sinks

pytestmark = [pytest.mark.gpu, pytest.mark.kernel_family("kvcache")]
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


@pytest.mark.kernel_family()  # update_kvcache is a plain XLA scatter: no kernel
def test_update_kvcache_donated_bf16_is_in_place():
    shape = (4, 4096, 8, 128)
    k_cache = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)
    k_new = jax.random.normal(jax.random.key(2), (4, 2, 8, 128), jnp.float32).astype(jnp.bfloat16)
    lens = jnp.array([0, 17, 4094, 4095], jnp.int32)  # the last one runs one token past the capacity
    want_k = np.asarray(k_cache, np.float32).copy()
    for b, n in enumerate(np.asarray(lens)):
        for t in range(2):
            if n + t < shape[1]:
                want_k[b, n + t] = np.asarray(k_new[b, t], np.float32)

    f = jax.jit(fa4_jax.update_kvcache, donate_argnums=(0, 1))
    compiled = f.lower(k_cache, v_cache, k_new, k_new, lens).compile()
    cache_bytes = np.prod(shape) * 2
    assert compiled.memory_analysis().alias_size_in_bytes == 2 * cache_bytes
    copies = re.findall(r"bf16\[4,4096,8,128\]\{[0-9,]*\} copy\(", compiled.as_text())
    assert not copies, f"the donated cache is copied: {copies}"
    k2, _ = f(k_cache, v_cache, k_new, k_new, lens)
    np.testing.assert_array_equal(np.asarray(k2, np.float32), want_k)


@pytest.mark.kernel_family()
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_update_kvcache_paged_bf16(page_size):
    """Paged writes in bf16 on the device, every page size: token p of row b lands in page
    table[b, p // page_size] at slot p % page_size; writes past the row's pages are dropped."""
    n_pages, max_pages, s_new = 9, 2, 5
    rng = np.random.default_rng(page_size)
    table = rng.permutation(n_pages)[:3 * max_pages].reshape(3, max_pages).astype(np.int32)
    k_cache = jax.random.normal(jax.random.key(3), (n_pages, page_size, 2, 128), jnp.float32).astype(jnp.bfloat16)
    k_new = jax.random.normal(jax.random.key(4), (3, s_new, 2, 128), jnp.float32).astype(jnp.bfloat16)
    lens = np.array([3, page_size - 2, 2 * page_size - 3], np.int32)  # in a page, across, past the last page
    want = np.asarray(k_cache, np.float32).copy()
    for b, n in enumerate(lens):
        for t in range(s_new):
            p = int(n) + t
            if p < max_pages * page_size:
                want[table[b, p // page_size], p % page_size] = np.asarray(k_new[b, t], np.float32)
    f = jax.jit(fa4_jax.update_kvcache, donate_argnums=(0, 1))
    k2, _ = f(k_cache, k_cache + 0, k_new, k_new, jnp.asarray(lens), page_table=jnp.asarray(table))
    np.testing.assert_array_equal(np.asarray(k2, np.float32), want)


# --------------------------------------------------------------------------------------------------
# The KV-cache kernel against the fp32 oracle
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(kernel_variants):
    return kernel_variants


def _require(built, dtype, hd, opts, paged, page_size=None, rows=1):
    """The variant the call needs: `rows` = seqlen_q x q-heads per KV head picks the query tile (one
    mask kind, spec.MASK, serves every window)."""
    require_variant(built, KVCacheVariant(device_arch(), dtype, hd, MASK, opts.get("softcap", 0.0) > 0,
                                          paged, tile_m_for(rows),
                                          page_rows_for(page_size) if paged and page_size else PAGE_ROWS))


def _oracle(q, kc, vc, lens, table, opts):
    """The shared oracle in fp32, per row over its valid keys: lengths clamped to [0, capacity] and page
    ids to the pool, as the contract's clamping does (tests/test_kvcache.py checks the reference does).
    Rows of equal length share one call."""
    b, s_q, h_q, d = q.shape
    kw = dict(opts)
    kw.setdefault("softmax_scale", d ** -0.5)
    if table is not None:
        table = np.clip(np.asarray(table), 0, kc.shape[0] - 1)
        kc, vc = (x[table].reshape(b, -1, *x.shape[2:]) for x in (kc, vc))
    lens = np.clip(np.asarray(lens), 0, kc.shape[1])
    o = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.zeros((b, h_q, s_q), jnp.float32)
    for n in np.unique(lens):
        rows = np.flatnonzero(lens == n)
        o_n, lse_n = attention_oracle(q[rows], kc[rows, :n], vc[rows, :n], xp=jnp, **kw)
        o, lse = o.at[rows].set(o_n), lse.at[rows].set(lse_n)
    return o, lse


def check_kv_call(q, kc, vc, lens, table=None, sinks=None, *, opts, num_splits=None, what):
    """Runs the kernel and the XLA path on these inputs (one jitted program) and applies the accuracy rule."""
    kw = dict(return_lse=True, num_splits=num_splits, **opts)

    @jax.jit
    def both(q, kc, vc, n, t, s):
        return (fa4_jax.attention_with_kvcache(q, kc, vc, n, page_table=t, sinks=s, implementation="fa4", **kw),
                fa4_jax.attention_with_kvcache(q, kc, vc, n, page_table=t, sinks=s, implementation="xla", **kw))

    poison_allocator((q.shape, q.dtype), ((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))
    ours, xla = both(q, kc, vc, jnp.asarray(lens), None if table is None else jnp.asarray(table), sinks)
    ref = _oracle(q, kc, vc, lens, table, dict(opts, **({} if sinks is None else {"sinks": sinks})))
    check_against_reference(ours, xla, ref, what=what)
    return ours


def run_kv_case(built, *, b, s_q, h_q, h_k, lens, capacity, opts=None, dtype="bf16", hd=128, page_size=None,
                num_splits=None, seed=0):
    opts = dict(opts or {})
    _require(built, dtype, hd, opts, page_size is not None, page_size, s_q * (h_q // h_k))
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    scale = 2.0 if opts.get("softcap") else 1.0  # scores must reach the cap
    table = None
    if page_size is not None:
        max_pages = -(-capacity // page_size)
        num_pages = b * max_pages + 3
        table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
        if b > 1:
            table[1, 0] = table[0, 0]  # a shared (prefix) page
        kv_shape = (num_pages, page_size, h_k, hd)
    else:
        kv_shape = (b, capacity, h_k, hd)
    sinks = opts.pop("sinks", None)
    sinks = None if sinks is None else jnp.asarray(make_sinks(seed + 5, h_q))
    what = f"kvcache {dtype} hd{hd} b={b} s_q={s_q} h={h_q}/{h_k} lens={lens.tolist()} page={page_size} " \
           f"splits={num_splits} {opts} sinks={sinks is not None}"
    for run in range(2):
        ks = jax.random.split(jax.random.key(seed * 2 + run), 3)
        q = (scale * jax.random.normal(ks[0], (b, s_q, h_q, hd), jnp.float32)).astype(dt)
        kc = (scale * jax.random.normal(ks[1], kv_shape, jnp.float32)).astype(dt)
        vc = jax.random.normal(ks[2], kv_shape, jnp.float32).astype(dt)
        check_kv_call(q, kc, vc, lens, table, sinks, opts=opts, num_splits=num_splits, what=f"{what} run {run}")


GQA = {"mha": 8, "gqa4": 2, "mqa": 1}


@pytest.mark.parametrize("heads_kv", list(GQA), ids=list(GQA))
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_kvcache_options_gqa(built, case, heads_kv):
    # Lengths 0 (no key), 1, not multiples of the 128-key block, and the full capacity.
    run_kv_case(built, b=4, s_q=3, h_q=8, h_k=GQA[heads_kv], lens=[0, 1, 300, 512], capacity=512,
                opts=OPTION_CASES[case], seed=len(case))


@pytest.mark.parametrize("num_splits", [1, None, 7, 64])
def test_kvcache_decode_splits(built, num_splits):
    # Decode: one query, 32 q-heads over 8 KV heads; a forced 64 splits leaves most of them empty. Every
    # split count against the oracle: the splits and their LSE-weighted combine must not change the
    # result beyond the rule (tests/test_kvcache.py can only pass num_splits through on CPU).
    run_kv_case(built, b=2, s_q=1, h_q=32, h_k=8, lens=[4000, 1537], capacity=4096, num_splits=num_splits)


@pytest.mark.parametrize("fuse", ["1", "0"], ids=["merged_by_last_split", "combine_kernel"])
def test_kvcache_split_merge_paths(built, monkeypatch, fuse):
    """Splits are merged by the last split CTA of each tile to finish (the default: it counts in on a
    per-device counter pool that every launch leaves zeroed, ffi/runtime.h ZeroedCounters) or by a
    second kernel (FA4_JAX_FUSE_COMBINE=0, as when the pool cannot serve a call). Both against the
    oracle, sinks and a causal window included; then three calls in one program, back to back on the
    stream and re-using the same counters, each right -- a counter left non-zero would leave a tile
    unmerged (o as poisoned) in the calls after it."""
    monkeypatch.setenv("FA4_JAX_FUSE_COMBINE", fuse)
    run_kv_case(built, b=3, s_q=2, h_q=32, h_k=8, lens=[4000, 1, 2500], capacity=4096, num_splits=6,
                opts=dict(causal=True, window_size=(3000, -1), sinks=True), seed=11)
    _require(built, "bf16", 128, {}, False, rows=4)
    lens = np.array([4096, 777], np.int32)
    ks = jax.random.split(jax.random.key(12), 3)
    q = jax.random.normal(ks[0], (2, 1, 32, 128), jnp.float32).astype(jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (2, 4096, 8, 128), jnp.float32).astype(jnp.bfloat16) for k in ks[1:])
    qs = (q, -q, (0.5 * q).astype(q.dtype))

    @jax.jit
    def three(q, kc, vc, n):
        call = functools.partial(fa4_jax.attention_with_kvcache, return_lse=True, num_splits=6)
        xs = (q, -q, (0.5 * q).astype(q.dtype))
        return ([call(x, kc, vc, n, implementation="fa4") for x in xs],
                [call(x, kc, vc, n, implementation="xla") for x in xs])

    poison_allocator((q.shape, q.dtype), ((2, 32, 1), jnp.float32))
    ours, xla = three(q, kc, vc, jnp.asarray(lens))
    for i, x in enumerate(qs):
        check_against_reference(ours[i], xla[i], _oracle(x, kc, vc, lens, None, {}),
                                what=f"call {i} of three in one program, FA4_JAX_FUSE_COMBINE={fuse}")


@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "page64"])
def test_kvcache_chunk_batch_tiles_handed_out(built, page_size):
    """A (batch, seqlen_q) chunk call with more 128-row tiles than SM slots (4 x ceil(700 x 4 / 128) x
    2 KV heads = 176 > 132) takes the chunk tile's handout (ffi/kvcache.cc: one split, a counter): the
    non-ragged grid (every m-block of every sequence, no tile list), a short sequence whose rows end
    inside the chunk (700 queries on 700 keys) and a shared first page; against the oracle, twice."""
    run_kv_case(built, b=4, s_q=700, h_q=8, h_k=2, lens=[2048, 700, 1500, 1999], capacity=2048,
                opts=dict(causal=True), page_size=page_size, seed=23)


@pytest.mark.parametrize("num_splits", [2, 17])
@pytest.mark.parametrize("rows", ["rows4", "rows64", "rows128"])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_kvcache_split_merge_sizes(built, hd, rows, num_splits):
    """The fused split merge (split_epilogue.merge_splits_if_last) at the sizes that shape it: 4
    packed rows (decode), 64 (the one-warpgroup tile full) and 128 (two consumer warpgroups, tile_m
    128, each merging its share of the rows); 2 and 17 splits (more than merge_row loads in one
    round: a second round of partials); head dims with different partial row lengths. A sequence
    with no keys and a short one leave most of their splits empty."""
    s_q, h_q = {"rows4": (1, 32), "rows64": (8, 64), "rows128": (16, 64)}[rows]
    run_kv_case(built, b=3, s_q=s_q, h_q=h_q, h_k=8, lens=[4000, 0, 130], capacity=4096, hd=hd,
                num_splits=num_splits, opts=dict(causal=True, sinks=True), seed=hd + num_splits)


@pytest.mark.parametrize("num_splits", [1, None, 5])
@pytest.mark.parametrize("case", ["plain", "everything"])
@pytest.mark.parametrize("page_size", [1, 5, 16, 32, 48, 64, 128, 256])
def test_kvcache_paged(built, page_size, case, num_splits):
    # Shuffled pages, one page shared by two sequences, lengths not multiples of the page.
    run_kv_case(built, b=3, s_q=2, h_q=8, h_k=2, lens=[page_size * 3 + 5, 1, 700], capacity=768,
                page_size=page_size, opts=OPTION_CASES[case], num_splits=num_splits, seed=page_size)


def test_attention_with_kvcache_paged_causal(built):
    # Pages of 64 in shuffled order, page 5 shared by both rows, three speculative queries.
    _require(built, "bf16", 128, dict(causal=True), True)
    rng = np.random.default_rng(3)
    b, s_q, h_q, h_k, d, page, n_pages = 2, 3, 8, 2, 128, 64, 12
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, d), np.float32), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((n_pages, page, h_k, d), np.float32), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((n_pages, page, h_k, d), np.float32), jnp.bfloat16)
    table = np.array([[5, 0, 7, 2], [9, 5, 11, 1]], np.int32)
    check_kv_call(q, kp, vp, np.array([130, 201], np.int32), table, opts=dict(causal=True), what="paged causal")


@pytest.mark.parametrize("page_size", [None, 64, 256], ids=["contiguous", "page64", "page256"])
@pytest.mark.parametrize("num_splits", [1, None, 3])
def test_kvcache_chunked_prefill(built, num_splits, page_size):
    # 70 queries x 4 q-heads per KV head = 280 packed rows: five query tiles per KV head (128 rows
    # each), from a contiguous or a paged cache.
    run_kv_case(built, b=2, s_q=70, h_q=8, h_k=2, lens=[70, 900], capacity=1024, opts=dict(causal=True),
                num_splits=num_splits, page_size=page_size)


@pytest.mark.parametrize("dtype,hd", [("fp16", 128), ("bf16", 64), ("bf16", 256), ("fp16", 64), ("bf16", 96),
                                     ("fp16", 96), ("bf16", 192), ("fp16", 192)])
def test_kvcache_dtypes_head_dims(built, dtype, hd):
    run_kv_case(built, b=2, s_q=2, h_q=16, h_k=4, lens=[333, 1000], capacity=1024, dtype=dtype, hd=hd,
                opts=dict(causal=True, sinks=make_sinks(0, 16)))
    run_kv_case(built, b=2, s_q=1, h_q=16, h_k=4, lens=[2000, 47], capacity=2048, dtype=dtype, hd=hd,
                page_size=64, seed=3)


@pytest.mark.parametrize("page_size", [None, 1, 48, 128], ids=["contiguous", "page1", "page48", "page128"])
@pytest.mark.parametrize("hd", [64, 96, 192, 256])
def test_kvcache_head_dims_pages_and_chunks(built, hd, page_size):
    """Every head dim through every K/V path (contiguous TMA, 16-row TMA pieces at pages 48 and 128,
    the one-row gather, whose threads per row differ at 96 and 192: 4 and 8, three 16-byte chunks
    each) and both query tiles: decode rows (64) with splits, a 70-query chunk (128) with every
    option."""
    run_kv_case(built, b=3, s_q=1, h_q=16, h_k=4, lens=[1000, 0, 77], capacity=1024, hd=hd, page_size=page_size,
                opts=dict(causal=True, sinks=make_sinks(0, 16)), num_splits=None, seed=hd)
    run_kv_case(built, b=2, s_q=70, h_q=8, h_k=2, lens=[70, 900], capacity=1024, hd=hd, page_size=page_size,
                opts=OPTION_CASES["everything"], num_splits=3, seed=hd + 1)


def test_kvcache_vmap(built):
    _require(built, "bf16", 128, {}, False)
    b, cap, h_q, h_k, d, n = 2, 384, 8, 2, 128, 3
    ks = jax.random.split(jax.random.key(11), 4)
    q = jax.random.normal(ks[0], (n, b, 1, h_q, d), jnp.float32).astype(jnp.bfloat16)
    kc = jax.random.normal(ks[1], (n, b, cap, h_k, d), jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[2], (n, b, cap, h_k, d), jnp.float32).astype(jnp.bfloat16)
    lens = jnp.array([[100, 384], [1, 200], [383, 0]], jnp.int32)
    f = functools.partial(fa4_jax.attention_with_kvcache, implementation="fa4", return_lse=True)
    x = functools.partial(fa4_jax.attention_with_kvcache, implementation="xla", return_lse=True)
    # Everything mapped (folds into the batch), and only q mapped (a shared cache: folds into heads).
    all_mapped = jax.jit(jax.vmap(f))(q, kc, vc, lens)
    q_only = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(q, kc[0], vc[0], lens[0])
    for i in range(n):
        pick = lambda t: tuple(a[i] for a in t)  # noqa: E731
        # The same kernel on the same rows as the unmapped call: the same numbers ...
        want = f(q[i], kc[i], vc[i], lens[i])
        for a, w in zip(pick(all_mapped), want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))
        # ... and right: each slice against the oracle.
        check_against_reference(pick(all_mapped), x(q[i], kc[i], vc[i], lens[i]),
                                _oracle(q[i], kc[i], vc[i], lens[i], None, {}), what=f"vmap all, slice {i}")
        check_against_reference(pick(q_only), x(q[i], kc[0], vc[0], lens[0]),
                                _oracle(q[i], kc[0], vc[0], lens[0], None, {}), what=f"vmap q only, slice {i}")


def test_kvcache_ffi_rejects_num_splits_over_workspace(built):
    _require(built, "bf16", 128, {}, False)
    from fa4_jax.families import KVCACHE

    from fa4_jax.core.ffi_call import kernel_call

    q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)
    kc = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
    operands = dict(q=q, k_cache=kc, v_cache=kc, cache_seqlens=jnp.array([10], jnp.int32))
    attrs = dict(softmax_scale=0.1, softcap=0.0, window_left=-1, window_right=-1, num_splits=3, max_seqlen_q=0,
                 tile_m=64, page_rows=16)
    # The family's own FFI call with a workspace of 2 splits, asked for 3 (the API never does this).
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"num_splits must be 0 \(auto\) or in \[1, 2\] \(the workspace's extent\); got 3"):
        jax.block_until_ready(kernel_call(KVCACHE, operands, attrs, dims=dict(splits=2)))
    # A query tile no variant has, and a ragged call whose q is not one packed batch.
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"tile_m must be 64 or 128; got 96"):
        jax.block_until_ready(kernel_call(KVCACHE, operands, dict(attrs, num_splits=1, tile_m=96),
                                          dims=dict(splits=2)))
    ragged = dict(operands, q=jnp.ones((2, 1, 8, 128), jnp.bfloat16), k_cache=jnp.ones((2, 256, 2, 128), jnp.bfloat16),
                  v_cache=jnp.ones((2, 256, 2, 128), jnp.bfloat16), cache_seqlens=jnp.array([10, 3], jnp.int32),
                  cu_seqlens_q=jnp.array([0, 1, 2], jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"a ragged batch's q must be \(1, total_q, heads_q, head_dim\)"):
        jax.block_until_ready(kernel_call(KVCACHE, ragged, dict(attrs, num_splits=1), dims=dict(splits=2)))
    # A tile list belongs to a ragged call and holds (sequence, m_block) pairs.
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"tile_list needs a ragged batch \(cu_seqlens_q\)"):
        jax.block_until_ready(kernel_call(KVCACHE, dict(operands, tile_list=jnp.zeros((2,), jnp.int32)),
                                          dict(attrs, num_splits=1), dims=dict(splits=2)))
    packed = dict(ragged, q=jnp.ones((1, 2, 8, 128), jnp.bfloat16), tile_list=jnp.zeros((3,), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"tile_list must be int32 \(2 \* tiles,\) \(sequence, m_block\) pairs; got \(3,\)"):
        jax.block_until_ready(kernel_call(KVCACHE, packed, dict(attrs, num_splits=1), dims=dict(splits=2)))


@pytest.mark.parametrize("s_q", [1, 2])
def test_kvcache_out_of_range_indices_are_clamped(built, s_q):
    """cache_seqlens outside [0, capacity] and page ids outside the pool: the kernel clamps them the
    way the reference does (the results are unspecified by the contract, but must stay in bounds and
    match the reference's clamping). Causal, so that a length past the capacity shows if unclamped
    (its queries would see every key); a correct call afterwards still works."""
    _require(built, "bf16", 128, dict(causal=True), True)
    b, h_q, h_k, d, ps, n_pages = 3, 8, 2, 128, 16, 10
    ks = jax.random.split(jax.random.key(21), 3)
    q = jax.random.normal(ks[0], (b, s_q, h_q, d), jnp.float32).astype(jnp.bfloat16)
    kp = jax.random.normal(ks[1], (n_pages, ps, h_k, d), jnp.float32).astype(jnp.bfloat16)
    vp = jax.random.normal(ks[2], (n_pages, ps, h_k, d), jnp.float32).astype(jnp.bfloat16)
    table = np.array([[0, 1, 2, 3], [-7, 4, 99, 5], [6, 7, 8, 1 << 30]], np.int32)
    lens = np.array([-5, 1 << 30, 50], np.int32)
    check_kv_call(q, kp, vp, lens, table, opts=dict(causal=True), what=f"out-of-range indices s_q={s_q}")
    test_kvcache_decode_splits(built, None)  # the device is still healthy


def test_kvcache_grid_beyond_65535_tiles(built):
    """batch x heads_kv = 98304 tiles: the 1-D tile scheduler, not gridDim.y/z, bounds the grid."""
    _require(built, "bf16", 128, {}, False)
    b, h, cap, d = 3072, 32, 16, 128
    ks = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(ks[0], (b, 1, h, d), jnp.float32).astype(jnp.bfloat16)
    kc = jax.random.normal(ks[1], (b, cap, h, d), jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[2], (b, cap, h, d), jnp.float32).astype(jnp.bfloat16)
    lens = np.random.default_rng(0).integers(0, cap + 1, b).astype(np.int32)
    check_kv_call(q, kc, vc, lens, opts={}, what="grid beyond 65535 tiles")
