#!/usr/bin/env python3
"""Sharded inference with fa4_jax over a mesh of all local devices.

    python examples/sharded_inference.py        # all local GPUs, or 8 fake CPU devices without a GPU

1. Prefill with batch x heads sharding under jax.jit (NamedSharding inputs): every device runs the
   kernel (or the reference on CPU) on its shard, with no collective.
2. A context-parallel decode step: one sequence's KV cache split along its length over all devices;
   each device attends to its slice and one all-gather of the (o, lse) partials merges them.
Both print per-device shapes, the time per call and the agreement with the single-device result.
"""

from __future__ import annotations

import os
import sys
import time

# 8 fake devices when jax runs on the host CPU (set before jax starts; GPU runs ignore it).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax


def timed(fn, *args, n=10):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return out, (time.perf_counter() - t0) / n


def main() -> int:
    devices = jax.devices()
    n = len(devices)
    on_gpu = devices[0].platform == "gpu"
    print(f"{n} x {devices[0].device_kind} ({devices[0].platform})")
    data = 2 if n % 2 == 0 and n > 1 else 1
    mesh = jax.make_mesh((data, n // data), ("data", "model"))
    print(f"mesh {dict(mesh.shape)}")
    rng = np.random.default_rng(0)
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)  # noqa: E731

    # 1. Prefill, batch over "data", heads over "model".
    b, s, h_q, h_k, d = (8, 4096, 32, 8, 128) if on_gpu else (4, 256, 8, 8, 64)
    q, k, v = bf(b, s, h_q, d), bf(b, s, h_k, d), bf(b, s, h_k, d)
    attn = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))
    spec = NamedSharding(mesh, P("data", None, "model"))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    print(f"prefill: q {q.shape} -> per device {args[0].addressable_shards[0].data.shape}")
    o, t = timed(attn, *args)
    o_ref, t1 = timed(jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True)),
                      *[jax.device_put(x, devices[0]) for x in (q, k, v)])
    err = float(np.abs(np.asarray(o, np.float32) - np.asarray(o_ref, np.float32)).max())
    print(f"  sharded {t * 1e3:.2f} ms, one device {t1 * 1e3:.2f} ms; max |o - o_single| = {err:.2e}")

    # 2. Context-parallel decode: one sequence, the cache length over every device.
    cap, h_q, h_k = (262144, 32, 8) if on_gpu else (4096, 8, 2)
    cap -= cap % n
    q1, kc, vc = bf(1, 1, h_q, d), bf(1, cap, h_k, d), bf(1, cap, h_k, d)
    lens = jnp.array([cap - 3], jnp.int32)
    decode = jax.jit(lambda q, k, v, n_: fa4_jax.attention_with_kvcache(q, k, v, n_, causal=True))
    flat = jax.make_mesh((n,), ("seq",))
    cache = NamedSharding(flat, P(None, "seq"))
    rep = NamedSharding(flat, P())
    cargs = [jax.device_put(q1, rep), jax.device_put(kc, cache), jax.device_put(vc, cache), jax.device_put(lens, rep)]
    print(f"decode: cache {kc.shape} -> per device {cargs[1].addressable_shards[0].data.shape}")
    o1, t = timed(decode, *cargs)
    o1_ref, t1 = timed(decode, *[jax.device_put(x, devices[0]) for x in (q1, kc, vc, lens)])
    err2 = float(np.abs(np.asarray(o1, np.float32) - np.asarray(o1_ref, np.float32)).max())
    print(f"  context-parallel {t * 1e6:.0f} us, one device {t1 * 1e6:.0f} us; max |o - o_single| = {err2:.2e}")
    ok = err < 2e-2 and err2 < 2e-2
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
