#!/usr/bin/env python3
"""Where the time of a small decode call goes: back-to-back jitted calls (docs/BENCHMARKING.md, includes host
dispatch) vs the same call repeated inside one jitted fori_loop (device time per call), for fa4_jax
and cuDNN, and a trivial jitted op (the dispatch floor)."""

import os
import sys
import jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from benchmark import time_per_call
import fa4_jax

H_Q, H_KV, D = 32, 8, 128


def looped(step, n):
    def run(q, k, v, *rest):
        def body(i, carry):
            o = step(q + carry.astype(q.dtype) * 0, k, v, *rest)  # data dependence keeps calls in order
            return carry + o[0, 0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, n, body, jnp.float32(0))
    return jax.jit(run)


def main():
    tp = dict(batches=5, target_batch_s=0.1)
    fa4 = lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, implementation="fa4")
    cud = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    triv = jax.jit(lambda q: q + 1)
    for b, s in [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]:
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (b, 1, H_Q, D), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s, H_KV, D), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, H_KV, D), jnp.float32).astype(jnp.bfloat16)
        n = jnp.full((b,), s, jnp.int32)
        t_f = time_per_call(jax.jit(fa4), [(q, k, v, n)], **tp)
        t_c = time_per_call(jax.jit(cud), [(q, k, v)], **tp)
        N = 50
        t_fl = time_per_call(looped(fa4, N), [(q, k, v, n)], **tp) / N
        t_cl = time_per_call(looped(cud, N), [(q, k, v)], **tp) / N
        t_t = time_per_call(triv, [(q,)], **tp)
        print(f"{b:>3} x {s:>6}: back-to-back fa4 {t_f*1e6:7.1f} cudnn {t_c*1e6:7.1f} | in-loop fa4 {t_fl*1e6:7.1f} "
              f"cudnn {t_cl*1e6:7.1f} (cudnn/fa4 {t_cl/t_fl:4.2f}) | trivial jit {t_t*1e6:5.1f}", flush=True)


if __name__ == "__main__" and "--splits" not in sys.argv:
    main()


def sweep_splits():
    """Time forced num_splits against the automatic choice on the bandwidth-bound rows."""
    tp = dict(batches=5, target_batch_s=0.1)
    for b, s, choices in [(1, 131072, (None, 16, 24, 33, 48, 66)), (8, 32768, (None, 1, 2, 3, 4, 8)),
                          (32, 8192, (None, 1, 2, 3, 4))]:
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (b, 1, H_Q, D), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s, H_KV, D), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, H_KV, D), jnp.float32).astype(jnp.bfloat16)
        n = jnp.full((b,), s, jnp.int32)
        row = []
        for ns in choices:
            f = jax.jit(lambda q, k, v, n, ns=ns: fa4_jax.attention_with_kvcache(q, k, v, n, num_splits=ns,
                                                                                 implementation="fa4"))
            t = time_per_call(f, [(q, k, v, n)], **tp)
            row.append(f"{ns}: {t * 1e6:6.1f}")
        print(f"{b:>3} x {s:>6}: " + "  ".join(row), flush=True)


if __name__ == "__main__" and "--splits" in sys.argv:
    sweep_splits()
