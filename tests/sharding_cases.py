"""Sharded dense attention on 8 host devices (run as a script by tests/test_sharding.py, which sets
--xla_force_host_platform_device_count=8 before jax starts). Prints one JSON line per case:
{"case", "max_err_o", "max_err_lse", "o_ulp_ratio", "o_cp_ratio", "collectives": [[op, bytes], ...],
"out_spec", ...}: the errors of the sharded call against the unsharded one, and two error ratios (<= 1
passes; see tests/test_sharding.py for which applies to which case):
  o_ulp_ratio  max |got - want| / (eps_bf16 |want| + 1e-6): one bf16 rounding apart at most;
  o_cp_ratio   max |got - want| / (1.01 u (P|V| + 2 |want|) + 1e-6), P|V| the unsharded call with |V|:
               the bound for merged bf16 partials (context parallelism).
Every case goes through run_fn, so every case's collectives are parsed from its compiled HLO."""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax

# One HLO instruction that moves data between devices: `%x = SHAPE op(` on CPU, `op-start(` (async,
# SHAPE a tuple) on GPU; a collective wrapped in an async computation is printed there as `op(`.
COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (.*?) (all-gather|all-to-all|collective-permute|all-reduce|"
                        r"reduce-scatter)(?:-start)?\(", re.MULTILINE)
SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1}


def collectives(compiled_text: str):
    """[op, bytes of its largest result] for every collective of a compiled program's HLO text."""
    out = []
    for m in COLLECTIVE.finditer(compiled_text):
        sizes = [int(np.prod([int(x) for x in dims.split(",") if x] or [1])) * BYTES.get(t, 4)
                 for t, dims in SHAPE.findall(m.group(1))]
        out.append([m.group(2), max(sizes or [0])])
    return out


def inputs(b, s_q, s_k, h_q, h_k, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s_q, h_q, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s_k, h_k, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s_k, h_k, d), jnp.float32).astype(jnp.bfloat16)
    sinks = jax.random.normal(ks[3], (h_q,), jnp.float32)
    return q, k, v, sinks


def run(name, mesh, q_spec, kv_spec, *, h_q=8, h_k=8, s=64, d=64, sink_spec=None, **kw):
    q, k, v, sinks = inputs(4, s, s, h_q, h_k, d)
    use_sinks = sink_spec is not None
    f = lambda q, k, v, sk: fa4_jax.attention(q, k, v, sinks=sk if use_sinks else None, return_lse=True,  # noqa: E731
                                              implementation="xla", **kw)
    run_fn(name, mesh, f, (q, k, v, sinks), (q_spec, kv_spec, kv_spec, sink_spec or P()))


EPS_BF16 = 2.0**-7  # spacing of bf16 numbers in [1, 2); u = EPS_BF16 / 2 is its unit roundoff


def run_fn(name, mesh, f, arrays, specs, *, want_fn=None, cache_bytes=0, partial_bytes=0, tail_bytes=0):
    """f(*arrays) -> (o, lse) on sharded arrays vs want_fn (default f) on unsharded ones; reports the
    errors and the collectives of f's compiled program. arrays[2] is V (every case's layout)."""
    want_fn = f if want_fn is None else want_fn
    want = jax.jit(want_fn)(*arrays)
    # P|V|: the same unsharded attention with |V|, per element the weighted mean of |v| over the row's keys.
    p_abs_v = jax.jit(want_fn)(*arrays[:2], jnp.abs(arrays[2]), *arrays[3:])[0]
    args = tuple(jax.device_put(x, NamedSharding(mesh, sp)) for x, sp in zip(arrays, specs))
    jf = jax.jit(f)
    got = jf(*args)
    text = jf.lower(*args).compile().as_text()
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    err_o = np.abs(f32(got[0]) - f32(want[0]))
    with np.errstate(invalid="ignore"):  # -inf - -inf in rows without keys, masked out below
        err_lse = np.where(np.isfinite(f32(want[1])), f32(got[1]) - f32(want[1]), 0.0)
    u = EPS_BF16 / 2
    print(json.dumps(dict(
        case=name,
        max_err_o=float(err_o.max()),
        o_ulp_ratio=float((err_o / (EPS_BF16 * np.abs(f32(want[0])) + 1e-6)).max()),
        o_cp_ratio=float((err_o / (1.01 * u * (np.abs(f32(p_abs_v)) + 2 * np.abs(f32(want[0]))) + 1e-6)).max()),
        # -inf (rows without keys) must match exactly (lse_inf_match); compare the finite rest.
        max_err_lse=float(np.abs(err_lse).max()),
        lse_inf_match=bool((np.isneginf(f32(got[1])) == np.isneginf(f32(want[1]))).all()),
        collectives=collectives(text),
        out_spec=str(got[0].sharding.spec),
        q_bytes=int(arrays[0].size * 2), cache_bytes=int(cache_bytes), partial_bytes=int(partial_bytes),
        tail_bytes=int(tail_bytes),
    )), flush=True)


def kvcache_cases(m24, m8):
    b, cap, h_q, h_k, d = 4, 256, 8, 2, 64
    ks = jax.random.split(jax.random.key(1), 4)
    bf = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    kc, vc = bf(ks[1], (b, cap, h_k, d)), bf(ks[2], (b, cap, h_k, d))
    lens = jnp.array([0, 1, 100, 256], jnp.int32)
    sinks = jax.random.normal(ks[3], (h_q,), jnp.float32)
    kv = lambda **kw: (lambda q, k, v, n, *sk: fa4_jax.attention_with_kvcache(  # noqa: E731
        q, k, v, n, sinks=sk[0] if sk else None, return_lse=True, implementation="xla", **kw))
    q1 = bf(ks[0], (b, 1, h_q, d))
    q3 = bf(ks[0], (b, 3, h_q, d))
    run_fn("kv_batch", m24, kv(causal=True), (q3, kc, vc, lens), (P("data"), P("data"), P("data"), P("data")))
    run_fn("kv_batch_heads", m24, kv(causal=True), (q3, kc, vc, lens),
           (P("data", None, "model"), P("data"), P("data"), P("data")))
    cache_bytes = kc.size * 2
    partial = b * h_q * 1 * (d + 1) * 4
    # Context-parallel decode: the cache length over 8 devices (32 keys each); lengths 0 and 1 leave
    # most slices empty (lse = -inf partials).
    run_fn("kv_cp_decode", m8, kv(causal=True), (q1, kc, vc, lens, sinks), (P(), P(None, "x"), P(None, "x"), P(), P()),
           cache_bytes=cache_bytes, partial_bytes=partial)
    run_fn("kv_cp_decode_batch", m24, kv(), (q1, kc, vc, lens), (P("data"), P("data", "model"), P("data", "model"),
                                                                  P("data")), cache_bytes=cache_bytes, partial_bytes=partial)
    # Masks with s_q > 1 and windows: the keys every query sees stay where they are; the tail (the last
    # keys only some queries see, or a left window's keys) is assembled by one all-reduce.
    cp = (P(), P(None, "x"), P(None, "x"), P())
    tail = lambda t: b * t * h_k * d * 2  # noqa: E731  (bf16 bytes of one of K/V's tails)
    run_fn("kv_cp_causal_chunk", m8, kv(causal=True), (q3, kc, vc, lens, sinks), cp + (P(),),
           cache_bytes=cache_bytes, partial_bytes=b * h_q * 3 * (d + 1) * 4, tail_bytes=tail(2))
    run_fn("kv_cp_window_right", m8, kv(window_size=(-1, 1)), (q3, kc, vc, jnp.array([2, 40, 97, 250], jnp.int32)),
           cp, cache_bytes=cache_bytes, partial_bytes=b * h_q * 3 * (d + 1) * 4, tail_bytes=tail(1))
    run_fn("kv_cp_sliding_window", m8, kv(window_size=(40, 0)), (q1, kc, vc, lens), cp,
           cache_bytes=cache_bytes, tail_bytes=tail(41))
    run_fn("kv_cp_sliding_window_chunk_sinks", m8, kv(causal=True, window_size=(20, -1)),
           (q3, kc, vc, jnp.array([2, 33, 64, 200], jnp.int32), sinks), cp + (P(),), cache_bytes=cache_bytes,
           tail_bytes=tail(23))
    # A left window whose tail (s_q + left keys) spans the whole cache without covering every key from
    # every query (254 < capacity - 1: not trimmed to "unbounded"): the key axis is gathered. (A left
    # window of >= capacity - 1 keys is trimmed to none, and then the call is context parallel.)
    run_fn("kv_window_covers_cache_gathered", m8, kv(window_size=(254, 0)), (q3, kc, vc, lens), cp,
           cache_bytes=cache_bytes)
    # Paged: batch sharded, the pool replicated (every row may point at any page).
    ps, n_pages = 16, 70
    pool_k, pool_v = bf(ks[1], (n_pages, ps, h_k, d)), bf(ks[2], (n_pages, ps, h_k, d))
    table = jnp.asarray(np.random.default_rng(0).permutation(n_pages)[: b * 16].reshape(b, 16), jnp.int32)
    paged = lambda q, k, v, n, t: fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t, causal=True,  # noqa: E731
                                                                 return_lse=True, implementation="xla")
    run_fn("kv_paged_batch", m24, paged, (q3, pool_k, pool_v, lens, table), (P("data"), P(), P(), P("data"), P("data")))
    # Paged context parallelism: the pool split by pages over 8 devices (9 pages each of 72), pages of
    # one sequence scattered over devices, the partly filled last page anywhere.
    pool_k8, pool_v8 = bf(ks[1], (72, ps, h_k, d)), bf(ks[2], (72, ps, h_k, d))
    table8 = jnp.asarray(np.random.default_rng(1).permutation(72)[: b * 16].reshape(b, 16), jnp.int32)
    lens8 = jnp.array([0, 17, 100, 256], jnp.int32)
    run_fn("kv_cp_paged_decode", m8, paged, (q1, pool_k8, pool_v8, lens8, table8), (P(), P("x"), P("x"), P(), P()),
           cache_bytes=pool_k8.size * 2, partial_bytes=partial)
    full = lambda q, k, v, n, t, sk: fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t, sinks=sk,  # noqa: E731
                                                                    return_lse=True, implementation="xla")
    run_fn("kv_cp_paged_full_sinks", m8, full, (q3, pool_k8, pool_v8, lens8, table8, sinks),
           (P(), P("x"), P("x"), P(), P(), P()), cache_bytes=pool_k8.size * 2, partial_bytes=b * h_q * 3 * (d + 1) * 4)
    run_fn("kv_cp_paged_causal_chunk", m8, paged, (q3, pool_k8, pool_v8, lens8, table8), (P(), P("x"), P("x"), P(), P()),
           cache_bytes=pool_k8.size * 2, partial_bytes=b * h_q * 3 * (d + 1) * 4, tail_bytes=b * 2 * h_k * d * 2)
    window = lambda q, k, v, n, t: fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t, window_size=(30, 0),  # noqa: E731
                                                                  return_lse=True, implementation="xla")
    run_fn("kv_cp_paged_sliding_window", m8, window, (q1, pool_k8, pool_v8, lens8, table8),
           (P(), P("x"), P("x"), P(), P()), cache_bytes=pool_k8.size * 2, tail_bytes=b * 31 * h_k * d * 2)
    # FP8 caches (the reference on the dequantized cache): batch sharded, and heads sharded with the
    # per-head scales sharded alike, neither moving anything.
    k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (kc, vc))
    k_scale = jnp.array([0.5, 2.0], jnp.float32)
    fp8 = lambda q, k, v, n, s: fa4_jax.attention_with_kvcache(q, k, v, n, causal=True, k_scale=s, v_scale=0.25,  # noqa: E731
                                                               return_lse=True, implementation="xla")
    run_fn("kv_fp8_batch", m24, fp8, (q3, k8, v8, lens, k_scale), (P("data"), P("data"), P("data"), P("data"), P()))
    heads = P(None, None, "data")
    run_fn("kv_fp8_heads", m24, fp8, (q3, k8, v8, lens, k_scale), (heads, heads, heads, P(), P("data")))


def ragged_cases(m24):
    """Ragged continuous-batching calls (cu_seqlens_q; ops/kvcache/sharding.py): their rows mix
    sequences, so they shard by heads only, with no collective; any other sharded axis is gathered."""
    lens, counts = [40, 0, 7, 120, 33], [5, 0, 1, 3, 1]  # chunks, an empty sequence, decodes
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
    h_q, h_k, d, ps = 16, 4, 64, 16
    b, max_pages = len(lens), 8
    ks = jax.random.split(jax.random.key(3), 3)
    bf = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q = bf(ks[0], (int(cu[-1]) + 2, h_q, d))  # two rows past cu_seqlens_q[-1]: o = 0
    n_pages = b * max_pages + 3
    pool_k, pool_v = bf(ks[1], (n_pages, ps, h_k, d)), bf(ks[2], (n_pages, ps, h_k, d))
    table = jnp.asarray(np.random.default_rng(3).permutation(n_pages)[: b * max_pages].reshape(b, max_pages), jnp.int32)
    f = lambda q, k, v, n, c, t: fa4_jax.attention_with_kvcache(  # noqa: E731
        q, k, v, n, cu_seqlens_q=c, page_table=t, causal=True, return_lse=True, implementation="xla")
    arrays = (q, pool_k, pool_v, jnp.asarray(lens, jnp.int32), cu, table)
    heads = P(None, None, "model")
    run_fn("kv_ragged_heads", m24, f, arrays, (P(None, "model"), heads, heads, P(), P(), P()))
    run_fn("kv_ragged_rows_replicated", m24, f, arrays, (P("model"), P(), P(), P(), P(), P()))


def varlen_cases(m24):
    lens_q, lens_k = [5, 0, 40, 19], [9, 3, 40, 0]
    cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
    cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lens_k)]), jnp.int32)
    ks = jax.random.split(jax.random.key(2), 3)
    bf = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q, k, v = bf(ks[0], (68, 8, 64)), bf(ks[1], (54, 2, 64)), bf(ks[2], (54, 2, 64))
    f = lambda q, k, v, cq, ck: fa4_jax.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True,  # noqa: E731
                                                         implementation="xla")
    run_fn("varlen_heads", m24, f, (q, k, v, cu_q, cu_k), (P(None, "model"), P(), P(), P(), P()))
    run_fn("varlen_tokens_replicated", m24, f, (q, k, v, cu_q, cu_k), (P("model"), P(), P(), P(), P()))


def main():
    assert len(jax.devices()) == 8, jax.devices()
    m24 = jax.make_mesh((2, 4), ("data", "model"))
    m8 = jax.make_mesh((8,), ("x",))
    run("batch", m24, P("data"), P("data"))
    run("heads", m24, P(None, None, "model"), P(None, None, "model"), h_k=8)
    run("batch_heads", m24, P("data", None, "model"), P("data", None, "model"), causal=True)
    run("gqa_heads_divide_kv", m24, P("data", None, "model"), P("data", None, "model"), h_q=16, h_k=4)
    run("gqa_more_shards_than_kv", m24, P("data", None, "model"), P("data"), h_q=8, h_k=2, causal=True)
    run("mqa_8_shards", m8, P(None, None, "x"), P(), h_q=8, h_k=1)
    run("sinks_heads", m24, P("data", None, "model"), P("data", None, "model"), sink_spec=P("model"), causal=True)
    run("qseq_noncausal", m24, P(None, "model"), P(), window_size=(-1, -1))
    run("qseq_causal_replicated", m24, P(None, "model"), P(), causal=True)
    run("head_dim_replicated", m24, P(None, None, None, "model"), P(None, None, None, "model"))
    run("window", m24, P("data", None, "model"), P("data", None, "model"), window_size=(9, 3))
    # shard_map: the primitive on local shards, explicit specs.
    q, k, v, _ = inputs(4, 64, 64, 8, 8, 64)
    spec, lse_spec = P("data", None, "model"), P("data", "model", None)
    plain = lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="xla")  # noqa: E731
    sm = jax.jit(jax.shard_map(plain, mesh=m24, in_specs=(spec, spec, spec), out_specs=(spec, lse_spec)))
    run_fn("shard_map", m24, sm, (q, k, v), (spec, spec, spec), want_fn=plain)
    kvcache_cases(m24, m8)
    ragged_cases(m24)
    varlen_cases(m24)
    # vmap composes with the sharded lowering: vmap over 2 query sets, batch sharded.
    qs = jnp.stack([q, q[::-1]])
    fv = jax.vmap(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="xla"),
                  in_axes=(0, None, None))
    run_fn("vmap_batch", m24, fv, (qs, k, v), (P(None, "data"), P("data"), P("data")))
    # Export of a sharded program: shard_map (no custom_partitioning callback inside) serializes; the
    # deserialized program runs on the same 8-device mesh.
    exported = jax.export.export(sm)(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m24, spec))
                                       for x in (q, k, v)))
    restored = jax.export.deserialize(exported.serialize())
    run_fn("export_shard_map", m24, restored.call, (q, k, v), (spec, spec, spec), want_fn=plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
