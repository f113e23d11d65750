#!/usr/bin/env python3
"""Sharded inference with fa4_jax over a mesh of all local devices.

    python examples/sharded_inference.py        # all local GPUs, or 8 fake CPU devices without a GPU

1. Prefill under jax.jit with NamedSharding inputs, batch over one mesh axis and heads over another
   (and each alone): every device runs the kernel (the reference on CPU) on its shard, no collective.
2. A context-parallel decode step: one sequence's KV cache split along its length over all devices;
   each device attends to its slice and one all-gather of the (o, lse) partials merges them.
Each prints per-device shapes, the time per call (median of 5 batches of back-to-back calls), the
speed-up over one device holding everything, and the agreement with the single-device result. The
decode step is also timed inside one jitted loop (50 dependent steps), which hides host dispatch.
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


def timed(fn, *args, n=10, batches=5):
    """(result, seconds per call): median over `batches` of n back-to-back calls (docs/BENCHMARKING.md)."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return out, float(np.median(times))


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def main() -> int:
    devices = jax.devices()
    n = len(devices)
    on_gpu = devices[0].platform == "gpu"
    print(f"{n} x {devices[0].device_kind} ({devices[0].platform})")
    rng = np.random.default_rng(0)
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)  # noqa: E731
    one = devices[0]
    ok = True

    # 1. Prefill: causal GQA, batch and/or heads sharded.
    b, s, h_q, h_k, d = (8, 4096, 32, 8, 128) if on_gpu else (8, 256, 8, 8, 64)
    q, k, v = bf(b, s, h_q, d), bf(b, s, h_k, d), bf(b, s, h_k, d)
    attn = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))
    o_ref, t1 = timed(attn, *[jax.device_put(x, one) for x in (q, k, v)])
    flops = 2 * b * h_q * s * s * d  # causal: half of 4*b*h*s^2*d
    print(f"prefill b{b} s{s} h{h_q}/{h_k} d{d} causal: one device {t1 * 1e3:.2f} ms ({flops / t1 / 1e12:.0f} TFLOP/s)")
    data = 2 if n % 2 == 0 and n > 2 else 1
    layouts = {"batch": ((n,), ("data",), P("data")), "heads": ((n,), ("model",), P(None, None, "model"))}
    if data > 1:
        layouts["batch x heads"] = ((data, n // data), ("data", "model"), P("data", None, "model"))
    for name, (shape, axes, spec) in layouts.items():
        mesh = jax.make_mesh(shape, axes)
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        o, t = timed(attn, *args)
        err = max_diff(o, o_ref)
        ok &= err < 2e-2
        print(f"  {name:13s} mesh {dict(mesh.shape)}: per device q {args[0].addressable_shards[0].data.shape}, "
              f"{t * 1e3:.2f} ms ({flops / t / 1e12:.0f} TFLOP/s), {t1 / t:.2f}x one device; "
              f"max |o - o_single| = {err:.2e}")

    # 2. Context-parallel decode: one sequence, the cache length over every device.
    cap, h_q, h_k = (262144, 32, 8) if on_gpu else (4096, 8, 2)
    cap -= cap % n
    q1, kc, vc = bf(1, 1, h_q, d), bf(1, cap, h_k, d), bf(1, cap, h_k, d)
    lens = jnp.array([cap - 3], jnp.int32)
    decode = jax.jit(lambda q, k, v, n_: fa4_jax.attention_with_kvcache(q, k, v, n_, causal=True))

    def loop(q, k, v, n_, steps=50):
        """`steps` dependent decode steps in one program: the output feeds the next query."""
        body = lambda _, q: fa4_jax.attention_with_kvcache(q, k, v, n_, causal=True)  # noqa: E731
        return jax.lax.fori_loop(0, steps, body, q)

    in_loop = jax.jit(loop)
    flat = jax.make_mesh((n,), ("seq",))
    cache = NamedSharding(flat, P(None, "seq"))
    rep = NamedSharding(flat, P())
    cargs = [jax.device_put(q1, rep), jax.device_put(kc, cache), jax.device_put(vc, cache), jax.device_put(lens, rep)]
    single = [jax.device_put(x, one) for x in (q1, kc, vc, lens)]
    print(f"decode 1 x {cap} keys, h{h_q}/{h_k} d{d}: cache {kc.shape} -> per device "
          f"{cargs[1].addressable_shards[0].data.shape}")
    o1, t = timed(decode, *cargs)
    o1_ref, t1 = timed(decode, *single)
    err = max_diff(o1, o1_ref)
    ok &= err < 2e-2
    print(f"  back to back: context-parallel {t * 1e6:.0f} us, one device {t1 * 1e6:.0f} us "
          f"({t1 / t:.2f}x); max |o - o_single| = {err:.2e}")
    ol, tl = timed(in_loop, *cargs, n=2)
    ol_ref, tl1 = timed(in_loop, *single, n=2)
    err = max_diff(ol, ol_ref)
    ok &= err < 5e-2
    print(f"  in one jitted loop of 50 steps: context-parallel {tl / 50 * 1e6:.0f} us/step, one device "
          f"{tl1 / 50 * 1e6:.0f} us/step ({tl1 / tl:.2f}x); max |o - o_single| after 50 steps = {err:.2e}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
