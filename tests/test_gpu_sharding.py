"""Sharded attention on two or more Hopper GPUs (`@pytest.mark.gpu`; skipped with fewer than two).

Every case runs the kernels (implementation="fa4", so a missing kernel fails instead of falling back)
under jax.jit with NamedSharding inputs over a mesh of the first two GPUs, and checks
- against the single-device call: batch/head shards run the same kernel on the same rows, so dense
  and varlen results are bitwise equal; KV-cache calls may pick another split count per shard and
  context-parallel decode merges partials in fp32, so those are judged by the accuracy rule;
- against the fp32 oracle with tests/accuracy.py's rule (the XLA path on the same inputs as the
  yardstick), fresh random inputs, odd sizes, empty sequences;
- the compiled program's collectives: none for batch/head sharding, for context parallelism only
  all-gathers of the (o, lse) partials, never of the cache.
The same rules are checked on 8 CPU devices by tests/test_sharding.py; this file proves them on GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from accuracy import check_against_reference, poison_allocator
from oracle import attention_oracle, make_sinks
from sharding_cases import collectives

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_variants")]


@pytest.fixture(scope="module")
def mesh():
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs two GPUs, found {len(gpus)}")
    return jax.sharding.Mesh(np.array(gpus[:2]), ("x",))


def bf16(rng, *shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def run_sharded(mesh, f, arrays, specs):
    """(outputs of jit(f) on the sharded arrays, outputs on one device, the compiled collectives)."""
    args = tuple(jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs))
    jf = jax.jit(f)
    compiled = jf.lower(*args).compile()
    poison_allocator(*[(o.shape, o.dtype) for o in jax.eval_shape(f, *arrays)])
    got = compiled(*args)
    one = jax.devices("gpu")[0]
    single = jax.jit(f)(*(jax.device_put(x, one) for x in arrays))
    return got, single, collectives(compiled.as_text())


def assert_bitwise(got, single, what):
    for a, b in zip(got, single):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=what)


# --------------------------------------------------------------------------------------------------
# dense prefill

DENSE = {
    # name: (h_q, h_k, q spec, k/v spec, sinks spec or None, options)
    "batch_gqa_causal": (16, 4, P("x"), P("x"), None, dict(causal=True)),
    "heads_gqa_causal": (16, 4, P(None, None, "x"), P(None, None, "x"), None, dict(causal=True)),
    # two head shards, one KV head: K/V replicated, each shard reads the one head
    "heads_mqa_more_shards_than_kv": (8, 1, P(None, None, "x"), P(), None, dict(causal=True)),
    "heads_sinks_window": (8, 8, P(None, None, "x"), P(None, None, "x"), P("x"), dict(window_size=(100, 0))),
    # query rows are independent without a mask: the query sequence stays split, K/V replicated
    "qseq_full_mask": (8, 2, P(None, "x"), P(), None, dict()),
}


@pytest.mark.kernel_family("fwd")
@pytest.mark.parametrize("case", list(DENSE))
def test_dense_prefill_sharded(mesh, case):
    h_q, h_k, spec, kv_spec, sink_spec, opts = DENSE[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    b, s, d = 4, 1000, 128
    q, k, v = bf16(rng, b, s, h_q, d), bf16(rng, b, s, h_k, d), bf16(rng, b, s, h_k, d)
    sinks = jnp.asarray(make_sinks(3, h_q)) if sink_spec is not None else None

    def f(q, k, v, *sk, implementation="fa4"):
        return fa4_jax.attention(q, k, v, sinks=sk[0] if sk else None, return_lse=True,
                                 implementation=implementation, **opts)

    arrays = (q, k, v) + ((sinks,) if sinks is not None else ())
    specs = (spec, kv_spec, kv_spec) + ((sink_spec,) if sinks is not None else ())
    got, single, coll = run_sharded(mesh, f, arrays, specs)
    assert coll == [], f"{case}: collectives {coll}"
    assert_bitwise(got, single, case)
    xla = f(*arrays, implementation="xla")
    ref = attention_oracle(q, k, v, softmax_scale=d ** -0.5, sinks=sinks, xp=jnp, **opts)
    check_against_reference(got, xla, ref, what=case)


# --------------------------------------------------------------------------------------------------
# varlen, heads sharded (token axes are replicated by the rule)


@pytest.mark.kernel_family("varlen")
def test_varlen_heads_sharded(mesh):
    rng = np.random.default_rng(7)
    lens_q, lens_k = [300, 0, 1000, 17], [300, 5, 1200, 17]
    h_q, h_k, d = 16, 4, 128
    cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32) for x in (lens_q, lens_k))
    q, k, v = bf16(rng, sum(lens_q), h_q, d), bf16(rng, sum(lens_k), h_k, d), bf16(rng, sum(lens_k), h_k, d)

    def f(q, k, v, cu_q, cu_k, implementation="fa4"):
        return fa4_jax.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), causal=True, return_lse=True,
                                        implementation=implementation)

    heads = P(None, "x")
    got, single, coll = run_sharded(mesh, f, (q, k, v, cu_q, cu_k), (heads, heads, heads, P(), P()))
    assert coll == [], f"varlen heads: collectives {coll}"
    assert_bitwise(got, single, "varlen heads")
    xla = f(q, k, v, cu_q, cu_k, implementation="xla")
    for i in range(len(lens_q)):
        if not lens_q[i]:
            continue
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref = attention_oracle(q[None, rq], k[None, rk], v[None, rk], softmax_scale=d ** -0.5, causal=True, xp=jnp)
        pick = lambda t: (t[0][None, rq], t[1][None, :, rq])  # noqa: E731
        check_against_reference(pick(got), pick(xla), ref, what=f"varlen heads, sequence {i}")


# --------------------------------------------------------------------------------------------------
# KV-cache decode: batch sharding and context parallelism (contiguous and paged)


def kv_oracle(q, k_rows, v_rows, *, d, sinks=None, **opts):
    """The fp32 oracle per batch row; k_rows[i] holds row i's valid keys."""
    outs = [attention_oracle(q[i:i + 1], k[None], v[None], softmax_scale=d ** -0.5, sinks=sinks, xp=jnp, **opts)
            for i, (k, v) in enumerate(zip(k_rows, v_rows))]
    return jnp.concatenate([o for o, _ in outs]), jnp.concatenate([lse for _, lse in outs])


def kvcache_fn(**opts):
    def f(q, k, v, lens, *rest, implementation="fa4"):
        table = rest[0] if "paged" in opts else None
        sinks = rest[-1] if opts.get("sinks") else None
        kw = {k_: v_ for k_, v_ in opts.items() if k_ not in ("paged", "sinks")}
        return fa4_jax.attention_with_kvcache(q, k, v, lens, page_table=table, sinks=sinks, return_lse=True,
                                              implementation=implementation, **kw)
    return f


CP_CASES = {
    # name: (s_q, options, sinks, bytes of the keys all-reduced per K/V: the tail, 0 = none)
    "decode_causal_sinks": (1, dict(causal=True), True, 0),
    "decode_full": (1, dict(), False, 0),
    "chunk_full_sinks": (5, dict(), True, 0),
    # speculative decode / chunked prefill: the last s_q - 1 keys are a tail all-reduced to every device
    "chunk_causal": (4, dict(causal=True), False, 3),
    # a sliding window: only its keys (s_q + left) are assembled, the rest of the cache is never read
    "decode_sliding_window_sinks": (1, dict(window_size=(1000, 0)), True, 1001),
}


@pytest.mark.kernel_family("kvcache")
@pytest.mark.parametrize("case", list(CP_CASES))
def test_kvcache_context_parallel_contiguous(mesh, case):
    """The cache split along its length over two GPUs; row 0 lives entirely on the first device (the
    second's slice is empty: lse -inf there), row 1 spans both, row 2 is empty everywhere."""
    s_q, opts, use_sinks, tail = CP_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    b, cap, h_q, h_k, d = 3, 8192, 32, 8, 128
    q, kc, vc = bf16(rng, b, s_q, h_q, d), bf16(rng, b, cap, h_k, d), bf16(rng, b, cap, h_k, d)
    lens = jnp.array([1000, 8000, 0], jnp.int32)
    sinks = jnp.asarray(make_sinks(5, h_q))
    f = kvcache_fn(sinks=use_sinks, **opts)
    arrays = (q, kc, vc, lens) + ((sinks,) if use_sinks else ())
    specs = (P(), P(None, "x"), P(None, "x"), P()) + ((P(),) if use_sinks else ())
    got, _, coll = run_sharded(mesh, f, arrays, specs)
    partial_bytes = 2 * b * s_q * h_q * (d + 1) * 4
    tail_bytes = 2 * b * tail * h_k * d * 2
    for op, n in coll:
        assert (op == "all-gather" and n <= partial_bytes) or (op == "all-reduce" and n <= tail_bytes), (case, coll)
    assert coll and any(op == "all-reduce" for op, _ in coll) == bool(tail), (case, coll)
    xla = f(*arrays, implementation="xla")
    ref = kv_oracle(q, [kc[i, :n] for i, n in enumerate(lens.tolist())], [vc[i, :n] for i, n in enumerate(lens.tolist())],
                    d=d, sinks=sinks if use_sinks else None, **opts)
    check_against_reference(got, xla, ref, what=f"context-parallel {case}")


@pytest.mark.kernel_family("kvcache")
@pytest.mark.parametrize("s_q", [1, 3])
def test_kvcache_context_parallel_paged(mesh, s_q):
    """A page pool split by pages over two GPUs (pages 0..31 on the first, 32..63 on the second), the
    rows' pages scattered over both, the last page of each row partly filled; causal, so s_q 3 also
    all-reduces each row's last two keys."""
    rng = np.random.default_rng(21 + s_q)
    b, h_q, h_k, d, ps, n_pages, max_pages = 3, 16, 2, 128, 64, 64, 20
    q = bf16(rng, b, s_q, h_q, d)
    kp, vp = bf16(rng, n_pages, ps, h_k, d), bf16(rng, n_pages, ps, h_k, d)
    table = jnp.asarray(rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages), jnp.int32)
    lens = jnp.array([1, 700, 20 * 64 - 9], jnp.int32)
    f = kvcache_fn(causal=True, paged=True)
    got, _, coll = run_sharded(mesh, f, (q, kp, vp, lens, table), (P(), P("x"), P("x"), P(), P()))
    partial_bytes = 2 * b * s_q * h_q * (d + 1) * 4
    tail_bytes = 2 * b * (s_q - 1) * h_k * d * 2
    for op, n in coll:
        assert (op == "all-gather" and n <= partial_bytes) or (op == "all-reduce" and n <= tail_bytes), coll
    assert coll and any(op == "all-reduce" for op, _ in coll) == (s_q > 1), coll
    xla = f(q, kp, vp, lens, table, implementation="xla")
    rows = lambda pool: [pool[table[i]].reshape(-1, h_k, d)[:n] for i, n in enumerate(lens.tolist())]  # noqa: E731
    check_against_reference(got, xla, kv_oracle(q, rows(kp), rows(vp), d=d, causal=True),
                            what=f"paged context-parallel s_q={s_q}")


@pytest.mark.kernel_family("kvcache")
def test_kvcache_batch_and_heads_sharded(mesh):
    """Decode with batch over one axis of a 2-device mesh, then heads: no collective; per-shard split
    counts may differ from the single-device call, so the rule judges it against the oracle."""
    rng = np.random.default_rng(31)
    b, cap, h_q, h_k, d = 4, 4096, 32, 8, 128
    q, kc, vc = bf16(rng, b, 1, h_q, d), bf16(rng, b, cap, h_k, d), bf16(rng, b, cap, h_k, d)
    lens = jnp.array([0, 5, 3001, 4096], jnp.int32)
    f = kvcache_fn(causal=True)
    xla = f(q, kc, vc, lens, implementation="xla")
    ref = kv_oracle(q, [kc[i, :n] for i, n in enumerate(lens.tolist())], [vc[i, :n] for i, n in enumerate(lens.tolist())],
                    d=d, causal=True)
    for name, qs, cs in [("batch", P("x"), P("x")), ("heads", P(None, None, "x"), P(None, None, "x"))]:
        got, _, coll = run_sharded(mesh, f, (q, kc, vc, lens), (qs, cs, cs, P("x") if name == "batch" else P()))
        assert coll == [], f"kvcache {name}: collectives {coll}"
        check_against_reference(got, xla, ref, what=f"kvcache {name}")
