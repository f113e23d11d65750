"""A ragged batch against a KV cache (attention_with_kvcache with cu_seqlens_q) on the GPU
(`@pytest.mark.gpu`): one KV-cache kernel launch over the cache in place (contiguous, or paged at any
page size: 16-row TMA pieces for multiples of 16, one-row pieces otherwise), 64- or 128-row query
tiles, split-KV. Checked with the accuracy rule of tests/accuracy.py against the XLA path and the
fp32 oracle per sequence, with NaN poison past every length and in every page no sequence owns, and
rows past cu_seqlens_q[-1] (o = 0, lse = -inf or the sink)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from accuracy import check_against_reference, poison_allocator
from fa4_jax.families import KVCACHE, KVCacheVariant
from fa4_jax.ops.kvcache.spec import MASK, PAGE_ROWS, page_rows_for, tile_handout, tile_m_for
from gpu_menu import device_arch, require_variant
from oracle import OPTION_CASES, attention_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.kernel_family("kvcache")]

# A mixed step: a prefill chunk, decodes, an empty row, an odd chunk, a short chunk.
MIXED = ((700, 1, 300, 0, 129, 64), (512, 1, 1, 0, 129, 3))
# Decodes only (one query each): the 64-row tile.
DECODE = ((700, 1, 300, 0, 767, 64, 5), (1, 1, 1, 0, 1, 1, 1))
H_Q, H_K, HD, CAP = 8, 2, 128, 768


def _case(seed, page_size, lens_counts=MIXED, hd=HD, cap=CAP):
    LENS, COUNTS = lens_counts
    CAP = cap
    rng = np.random.default_rng(seed)
    b = len(LENS)
    cu = np.concatenate([[0], np.cumsum(COUNTS)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]) + 2, H_Q, hd), np.float32)
    dense = [rng.standard_normal((b, CAP, H_K, hd), np.float32) for _ in range(2)]
    for x in dense:
        for i, n in enumerate(LENS):
            x[i, n:] = np.nan
    if page_size is None:
        k, v, table = dense[0], dense[1], None
    else:
        max_pages = -(-CAP // page_size)  # the last page may run past CAP: NaN there
        num_pages = b * max_pages + 5
        table = np.random.default_rng(seed + 1).permutation(num_pages)[:b * max_pages].astype(np.int32)
        table = table.reshape(b, max_pages)
        k, v = (np.full((num_pages, page_size, H_K, hd), np.nan, np.float32) for _ in range(2))
        pad = ((0, 0), (0, max_pages * page_size - CAP), (0, 0), (0, 0))
        for x, d in ((k, dense[0]), (v, dense[1])):
            x[table] = np.pad(d, pad, constant_values=np.nan).reshape(b, max_pages, page_size, H_K, hd)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), jnp.asarray(np.array(LENS, np.int32)), jnp.asarray(cu), table, dense


def _variant(page_size, opts, max_rows, hd=HD):
    softcap = opts.get("softcap", 0.0) > 0
    return KVCacheVariant(device_arch(), "bf16", hd, MASK, softcap, page_size is not None,
                          tile_m_for(max_rows * (H_Q // H_K)), page_rows_for(page_size) if page_size else PAGE_ROWS)


def _oracle(q, cu, lens, dense, opts, hd):
    """The fp32 oracle of a ragged call, per sequence on its keys (dense: the unpoisoned caches):
    o (total_q, H_Q, hd) and lse (H_Q, total_q); rows no sequence owns get o = 0 and lse = -inf or
    the sink."""
    o_r = jnp.zeros(q.shape, jnp.float32)
    lse_r = jnp.full((H_Q, q.shape[0]), -jnp.inf, jnp.float32)
    if opts.get("sinks") is not None:
        lse_r = jnp.broadcast_to(jnp.asarray(opts["sinks"], jnp.float32)[:, None], lse_r.shape)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        kd, vd = (jnp.asarray(d[b:b + 1, :n], jnp.bfloat16) for d in dense)
        ob, lb = attention_oracle(q[None, rows], kd, vd, softmax_scale=hd ** -0.5, xp=jnp, **opts)
        o_r, lse_r = o_r.at[rows].set(ob[0]), lse_r.at[:, rows].set(lb[0])
    return o_r, lse_r


@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto_splits", "splits3"])
@pytest.mark.parametrize("options", ["causal", "everything"])
@pytest.mark.parametrize("page_size", [None, 1, 5, 16, 48, 64],
                         ids=["contiguous", "page1", "page5", "page16", "page48", "page64"])
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_ragged_kernel_matches_oracle(kernel_variants, batch, page_size, options, num_splits, hd=HD):
    opts = dict(OPTION_CASES[options])
    lens_counts = MIXED if batch == "mixed" else DECODE
    LENS, COUNTS = lens_counts
    hint = None if batch == "mixed" else 1  # mixed: max_seqlen_q = total_q (the 128-row tile)
    q, k, v, lens, cu, table, dense = _case(130 + (page_size or 0) + hd, page_size, lens_counts, hd)
    require_variant(kernel_variants, _variant(page_size, opts, q.shape[0] if hint is None else hint, hd))
    table = None if table is None else jnp.asarray(table)
    splits = num_splits

    def run(implementation):
        fn = jax.jit(lambda *a: fa4_jax.attention_with_kvcache(
            *a[:4], cu_seqlens_q=a[4], page_table=a[5], max_seqlen_q=hint, num_splits=splits, return_lse=True,
            implementation=implementation, **opts))
        return fn(q, k, v, lens, cu, table)

    o, lse = run("fa4")
    o_x, lse_x = run("xla")
    o_r, lse_r = _oracle(q, cu, LENS, dense, opts, hd)
    assert bool(jnp.all(jnp.isfinite(o))), "a ragged row came out non-finite"
    check_against_reference((o[None], lse[None]), (o_x[None], lse_x[None]), (o_r[None], lse_r[None]),
                            what=f"ragged {batch} hd{hd} page={page_size} {options} splits={num_splits}")


@pytest.mark.parametrize("page_size", [None, 5, 16, 64], ids=["contiguous", "page5", "page16", "page64"])
@pytest.mark.parametrize("hd", [64, 96, 192, 256])
def test_ragged_head_dims(kernel_variants, hd, page_size):
    """The mixed step at every other head dim (hd 128 above): 128-row chunk tiles and decode rows in
    one launch, through each K/V path."""
    test_ragged_kernel_matches_oracle(kernel_variants, "mixed", page_size, "everything", None, hd=hd)


def test_ragged_kernel_is_one_launch_reading_pages_in_place(kernel_variants):
    """The kernel path must not gather the pool: one custom call on the pool as given, no gather of
    K/V values (the lowering's tile list gathers int32 indices only, ops/kvcache/tiles.py)."""
    require_variant(kernel_variants, KVCacheVariant(device_arch(), "bf16", HD, MASK, False, True, 128))
    q, k, v, lens, cu, table, _ = _case(7, 16)
    fn = jax.jit(lambda *a: fa4_jax.attention_with_kvcache(*a[:4], cu_seqlens_q=a[4], page_table=a[5], causal=True,
                                                           max_seqlen_q=512, implementation="fa4"))
    text = fn.lower(q, k, v, lens, cu, jnp.asarray(table)).as_text()
    assert text.count(KVCACHE.target) == 1, text
    gathers = [line for line in text.splitlines() if "stablehlo.gather" in line]
    assert not [g for g in gathers if "bf16" in g], f"the page pool must be read in place: {gathers}"
    assert "has_tile_list = true" in text, "max_seqlen_q 512: the tiles with rows, listed"


# More 128-row chunk tiles than an H100/H200 has SMs (132): 123 (sequence, m_block) entries with rows
# (the pseudo-sequence's included), 128 listed with the list's padding (ops/kvcache/tiles.py), x 2 KV
# heads = 256 tiles; chunks from 1 to 1500 rows, some starting at the sequence's first key
# (count == length), some on top of a cached context.
HANDOUT = ((2048, 1500, 2000, 1, 0, 700, 1100), (1024, 1500, 77, 1, 0, 700, 513))
HANDOUT_CAP = 2048


@pytest.mark.parametrize("page_size,options,hd", [(None, "causal", 128), (None, "everything", 128),
                                                  (64, "causal", 128), (64, "everything", 128), (64, "causal", 256)],
                         ids=["contiguous-causal", "contiguous-everything", "page64-causal", "page64-everything",
                              "page64-causal-hd256"])
def test_ragged_chunk_tiles_handed_out(kernel_variants, monkeypatch, page_size, options, hd):
    """With more chunk tiles than SM slots, the 16-bit chunk tile runs a persistent grid that takes its
    tiles from one zero-at-rest counter (ffi/kvcache.cc, spec.tile_handout; the default) instead of one
    CTA per tile (FA4_JAX_DYNAMIC_TILES=0, as when the counter pool cannot serve a call). A tile
    computes the same way whichever CTA runs it: both give the same bits. Against the oracle per
    sequence, with NaN past every length and in every page no sequence owns; three calls in one
    program, each right -- a counter a launch left non-zero would hand the next launch's tiles out
    from the middle, leaving its first tiles unwritten (the outputs are poisoned first). hd256: 64-key
    blocks, one 16-row piece per producer warp and block (paged).

    The two settings run two different programs (the calls in another order): the handler reads
    FA4_JAX_DYNAMIC_TILES when XLA runs it, and an executable's command buffer replays what it
    recorded, so re-running the same program could time the handout against itself."""
    opts = dict(OPTION_CASES[options])
    LENS, COUNTS = HANDOUT
    q, k, v, lens, cu, table, dense = _case(41 + (page_size or 0) + hd, page_size, HANDOUT, hd, HANDOUT_CAP)
    variant = _variant(page_size, opts, max(COUNTS), hd)
    require_variant(kernel_variants, variant)
    if variant.arch != "sm90":
        pytest.skip("the KV-cache tile handout is SM90's")
    assert variant.tile_m == 128 and tile_handout(variant), variant
    table = None if table is None else jnp.asarray(table)
    call = functools.partial(fa4_jax.attention_with_kvcache, cu_seqlens_q=cu, page_table=table,
                             max_seqlen_q=max(COUNTS), return_lse=True, **opts)
    qs = (q, -q, (0.5 * q).astype(q.dtype))

    def three(order):
        @jax.jit
        def run(q, k, v, lens):
            xs = (q, -q, (0.5 * q).astype(q.dtype))
            outs = {i: call(xs[i], k, v, lens, implementation="fa4") for i in order}
            return [outs[i] for i in range(3)]
        return run

    outs = {}
    for dynamic, order in (("1", (0, 1, 2)), ("0", (2, 1, 0))):
        monkeypatch.setenv("FA4_JAX_DYNAMIC_TILES", dynamic)
        poison_allocator(*[(q.shape, q.dtype), ((H_Q, q.shape[0]), jnp.float32)] * 3)
        outs[dynamic] = jax.device_get(three(order)(q, k, v, lens))
    for i, x in enumerate(qs):
        for j in range(2):  # o, lse
            np.testing.assert_array_equal(outs["1"][i][j], outs["0"][i][j],
                                          err_msg=f"call {i}: tiles handed out vs one CTA per tile, output {j}")
    xla = jax.jit(lambda *a: call(*a, implementation="xla"))
    for i, x in enumerate(qs):
        o_r, lse_r = _oracle(x, cu, LENS, dense, opts, hd)
        o, lse = (jnp.asarray(y) for y in outs["1"][i])
        assert bool(jnp.all(jnp.isfinite(o))), f"call {i}: a ragged row came out non-finite"
        o_x, lse_x = xla(x, k, v, lens)
        check_against_reference((o[None], lse[None]), (o_x[None], lse_x[None]), (o_r[None], lse_r[None]),
                                what=f"call {i} of three in one program, tiles handed out, page={page_size} {options}")
