"""Sharded dense attention on 8 host devices (run as a script by tests/test_sharding.py, which sets
--xla_force_host_platform_device_count=8 before jax starts). Prints one JSON line per case:
{"case", "max_err_o", "max_err_lse", "collectives": [[op, bytes], ...], "out_spec"}."""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax

COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^=]* (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)\(")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1}


def collectives(compiled_text: str):
    out = []
    for m in COLLECTIVE.finditer(compiled_text):
        dims = [int(x) for x in m.group(2).split(",") if x]
        out.append([m.group(3), int(np.prod(dims or [1])) * BYTES.get(m.group(1), 4)])
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
    want = jax.jit(f)(q, k, v, sinks)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(sinks, sink_spec or P()))
    jf = jax.jit(f)
    got = jf(*args)
    text = jf.lower(*args).compile().as_text()
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    print(json.dumps(dict(
        case=name,
        max_err_o=float(np.abs(f32(got[0]) - f32(want[0])).max()),
        max_err_lse=float(np.abs(f32(got[1]) - f32(want[1])).max()),
        collectives=collectives(text),
        out_spec=str(got[0].sharding.spec),
        q_bytes=int(q.size * 2),
    )), flush=True)


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
    spec = P("data", None, "model")
    sm = jax.jit(jax.shard_map(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation="xla"),
                               mesh=m24, in_specs=(spec, spec, spec), out_specs=spec))
    got = sm(*(jax.device_put(x, NamedSharding(m24, spec)) for x in (q, k, v)))
    want = fa4_jax.attention(q, k, v, causal=True, implementation="xla")
    print(json.dumps(dict(case="shard_map", max_err_o=float(np.abs(np.asarray(got, np.float32)
                                                                       - np.asarray(want, np.float32)).max()),
                          max_err_lse=0.0, collectives=[], out_spec=str(spec), q_bytes=0)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
