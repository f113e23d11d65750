#!/usr/bin/env python3
"""Where a paged KV cache costs time in a small decode step: attention_with_kvcache and
update_kvcache, paged vs contiguous, each repeated 100x inside one jitted fori_loop (device time per
call, no dispatch). Shape: examples/generate.py's 1b decode (batch 8, 32/8 heads of 64, ~2k keys per
row, capacity 4096, page 64), and a 128-head-dim variant."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from benchmark import time_per_call  # noqa: E402

import fa4_jax  # noqa: E402

N = 100


def looped(fn):
    """fn(carry, *args) -> array; N dependent calls in one program."""
    def run(*args):
        body = lambda i, c: c + fn(c, *args).ravel()[0].astype(jnp.float32) * 0  # noqa: E731
        return jax.lax.fori_loop(0, N, body, jnp.float32(0))
    return jax.jit(run)


@jax.jit
def updates(k, v, k_new, lens, table):
    """N cache updates, the cache carried through the loop (in place, as in a decode loop)."""
    body = lambda i, kv: fa4_jax.update_kvcache(*kv, k_new, k_new, lens + i, page_table=table)  # noqa: E731
    return jax.lax.fori_loop(0, N, body, (k, v))[0][0, 0, 0, 0]


def main():
    tp = dict(batches=5, target_batch_s=0.2)
    rng = np.random.default_rng(0)
    for b, h_q, h_k, d, cap, ps in [(8, 32, 8, 64, 4096, 64), (8, 32, 8, 128, 4096, 64), (8, 32, 8, 64, 4096, 16)]:
        bf = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
        lens = jnp.asarray(rng.integers(1500, 2200, b), jnp.int32)
        q, k_new = bf(b, 1, h_q, d), bf(b, 1, h_k, d)
        kc, vc = bf(b, cap, h_k, d), bf(b, cap, h_k, d)
        mp = cap // ps
        table = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
        kp, vp = bf(b * mp, ps, h_k, d), bf(b * mp, ps, h_k, d)
        attn = lambda c, q, k, v, n, t=None: fa4_jax.attention_with_kvcache(  # noqa: E731
            q + c.astype(q.dtype), k, v, n, page_table=t, causal=True, implementation="fa4")
        row = {}
        row["attn contiguous"] = time_per_call(looped(attn), [(q, kc, vc, lens)], **tp) / N
        row["attn paged"] = time_per_call(looped(attn), [(q, kp, vp, lens, table)], **tp) / N
        row["update contiguous"] = time_per_call(updates, [(kc, vc, k_new, lens, None)], **tp) / N
        row["update paged"] = time_per_call(updates, [(kp, vp, k_new, lens, table)], **tp) / N
        print(f"b{b} h{h_q}/{h_k} d{d} cap {cap} page {ps}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in row.items()),
              flush=True)


if __name__ == "__main__":
    main()
