#!/usr/bin/env python3
"""Decode against a KV cache on a Hopper GPU: fa4_jax.attention_with_kvcache vs cuDNN, same run.

    python examples/benchmark_decode.py               # the issue's decode table + paged rows (~1 min)
    python examples/benchmark_decode.py --json out.json

Setting (Llama-style decode): bf16, one new query per sequence (seqlen_q = 1), 32 q-heads over 8
KV heads, head_dim 128, every sequence's cache full (cache_seqlens = capacity). TB/s counts the K
and V bytes each call must read (2 * b * s_k * h_kv * d * 2 bytes) over the time: the HBM ceiling is
~4.3 TB/s on an H200. cuDNN is `jax.nn.dot_product_attention(implementation="cudnn")` on the same
q/k/v (it has no cache lengths, so it gets exactly the valid keys). Paged rows: the same cache cut into
pages of 16 / 64 / 256 tokens scattered in a shuffled pool, compared with the contiguous cache.

Timing as in benchmark.py (method: docs/BENCHMARKING.md): jitted, warmed up, batches of back-to-back
calls over two input sets, median of batches. Every row is checked against a float32 oracle before it
is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import REL_ERR_LIMIT, header_lines, hopper_device, short, time_per_call  # noqa: E402

import fa4_jax  # noqa: E402

H_Q, H_KV, D = 32, 8, 128
ROWS = [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]
PAGED_ROWS = [(8, 32768), (1, 131072)]
PAGE_SIZES = (16, 64, 256)


def inputs(seed: int, b: int, s: int):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, 1, H_Q, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, H_KV, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, H_KV, D), jnp.float32).astype(jnp.bfloat16)
    return q, k, v


def to_paged(k, v, page_size: int, seed: int):
    """The contiguous cache scattered over a shuffled page pool; returns (k_pages, v_pages, table)."""
    b, s = k.shape[:2]
    per_seq = s // page_size
    perm = np.random.default_rng(seed).permutation(b * per_seq).astype(np.int32)
    table = perm.reshape(b, per_seq)
    inv = np.argsort(perm)

    def pool(x):
        pages = x.reshape(b * per_seq, page_size, H_KV, D)  # page i of the flattened caches
        return pages[inv]  # pool slot perm[i] holds page i

    return pool(k), pool(v), jnp.asarray(table)


def rel_err(out, q, k, v, rows=4):
    """Relative error of out[:rows] against a float32 oracle (GQA by repeat)."""
    qf = q[:rows].astype(jnp.float32)
    kf = jnp.repeat(k[:rows].astype(jnp.float32), H_Q // H_KV, axis=2)
    vf = jnp.repeat(v[:rows].astype(jnp.float32), H_Q // H_KV, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest") * D ** -0.5
    ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vf, precision="highest")
    o = out[:rows].astype(jnp.float32)
    return float(jnp.abs(o - ref).max() / jnp.abs(ref).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--target-batch-s", type=float, default=0.1)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--no-paged", action="store_true")
    args = ap.parse_args(argv)
    device = hopper_device()
    if device is None:
        print("benchmark_decode: no Hopper GPU with the fa4_jax kernels here; nothing to measure")
        return 0
    print("\n".join(header_lines(device)))
    tp = dict(batches=args.batches, target_batch_s=args.target_batch_s)

    fa4 = jax.jit(lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, implementation="fa4"))
    fa4_paged = jax.jit(lambda q, k, v, n, t: fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t,
                                                                             implementation="fa4"))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    results = []
    print(f"\nDecode, bf16, seqlen_q 1, heads {H_Q}/{H_KV}, head_dim {D}, full caches")
    print(f"{'batch x keys':>14} {'fa4 us':>8} {'TB/s':>6} {'cuDNN us':>9} {'TB/s':>6} {'cuDNN/fa4':>10}")
    for b, s in ROWS:
        sets = [inputs(i, b, s) for i in range(2)]
        lens = jnp.full((b,), s, jnp.int32)
        kv_bytes = 2 * b * s * H_KV * D * 2
        row = dict(batch=b, keys=s)
        err = rel_err(fa4(*sets[0], lens), *sets[0])
        if err > REL_ERR_LIMIT:
            print(f"{b:>5} x {s:>6}: fa4 WRONG (rel err {err:.3g})")
            results.append(dict(row, fa4="WRONG"))
            continue
        t = time_per_call(fa4, [(*x, lens) for x in sets], **tp)
        row["fa4_us"] = t * 1e6
        try:
            t_c = time_per_call(cudnn, sets, **tp)
            row["cudnn_us"] = t_c * 1e6
        except Exception as e:  # noqa: BLE001 - report, keep going
            row["cudnn_error"] = short(e)
            t_c = None
        c = f"{t_c * 1e6:9.1f} {kv_bytes / t_c / 1e12:6.2f} {t_c / t:10.2f}" if t_c else f"{'n/a':>9}"
        print(f"{b:>5} x {s:>6} {t * 1e6:8.1f} {kv_bytes / t / 1e12:6.2f} {c}")
        results.append(row)
        if args.no_paged or (b, s) not in PAGED_ROWS:
            continue
        for ps in PAGE_SIZES:
            kp, vp, table = to_paged(sets[0][1], sets[0][2], ps, seed=ps)
            kp1, vp1, _ = to_paged(sets[1][1], sets[1][2], ps, seed=ps)
            err = rel_err(fa4_paged(sets[0][0], kp, vp, lens, table), *sets[0])
            if err > REL_ERR_LIMIT:
                print(f"{'':>14} paged {ps}: WRONG (rel err {err:.3g})")
                continue
            t_p = time_per_call(fa4_paged, [(sets[0][0], kp, vp, lens, table), (sets[1][0], kp1, vp1, lens, table)], **tp)
            print(f"{'':>8} page {ps:>3} {t_p * 1e6:8.1f} {kv_bytes / t_p / 1e12:6.2f}   paged/contiguous {t_p / t:5.3f}")
            results.append(dict(row, page_size=ps, fa4_us=t_p * 1e6, vs_contiguous=t_p / t))
            del kp, vp, kp1, vp1
        del sets
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
