#!/usr/bin/env python3
"""Decode against a KV cache on a Hopper GPU: fa4_jax.attention_with_kvcache vs cuDNN, same run.

    python examples/benchmark_decode.py               # the issue's decode table + paged rows (~1 min)
    python examples/benchmark_decode.py --json out.json
    python examples/benchmark_decode.py --device-time  # kernel time alone, automatic vs forced splits

Setting (Llama-style decode): bf16, one new query per sequence (seqlen_q = 1), 32 q-heads over 8
KV heads, head_dim 128, every sequence's cache full (cache_seqlens = capacity). TB/s counts the K
and V bytes each call must read (2 * b * s_k * h_kv * d * 2 bytes) over the time: the HBM ceiling is
~4.3 TB/s on an H200. cuDNN is `jax.nn.dot_product_attention(implementation="cudnn")` on the same
q/k/v (it has no cache lengths, so it gets exactly the valid keys). Paged rows: the same cache cut into
pages of 16 / 64 / 256 tokens scattered in a shuffled pool, compared with the contiguous cache.

Timing as in benchmark.py (method: docs/BENCHMARKING.md): jitted, warmed up, batches of back-to-back
calls over two input sets, median of batches. Every row is checked against a float32 oracle before it
is timed.

--device-time measures what the GPU spends per call: LOOP dependent calls inside one jitted, unrolled
fori_loop (back-to-back calls add host dispatch, a rolled loop 15-30 us per iteration), rounds
interleaved so that board drift hits every column alike, the minimum over rounds per column. Beside
cuDNN and the automatic split count it times every forced count in SPLIT_SWEEP and names the best,
with the HBM floor (K/V bytes at 4.3 TB/s).
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
from benchmark import REL_ERR_LIMIT, header_lines, kernel_device, short, time_per_call  # noqa: E402

import fa4_jax  # noqa: E402

H_Q, H_KV, D = 32, 8, 128
ROWS = [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]
PAGED_ROWS = [(8, 32768), (1, 131072)]
PAGE_SIZES = (16, 64, 256)
SPLIT_SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48)
LOOP = 20
HBM_TB_S = 4.3


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


def masked_oracle(q, k, v, lens):
    """float32 attention of each sequence's queries over its first lens[b] keys of k / v
    (batch, capacity, heads_kv, d), GQA by repeat (the tools' check of caches longer than the rows)."""
    g = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), jnp.repeat(k.astype(jnp.float32), g, axis=2),
                   precision="highest") * q.shape[-1] ** -0.5
    s = jnp.where(jnp.arange(k.shape[1])[None, None, None] < lens[:, None, None, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), jnp.repeat(v.astype(jnp.float32), g, axis=2),
                      precision="highest")


def looped(step, n: int = LOOP):
    """One jitted program of n dependent calls of step(q, *rest) (unrolled: no per-iteration loop cost)."""
    def run(q, *rest):
        def body(i, carry):
            o = step(q + carry.astype(q.dtype) * 0, *rest)  # data dependence keeps the calls in order
            return carry + o.reshape(-1)[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, n, body, jnp.float32(0), unroll=True)
    return jax.jit(run)


def device_time_table(rounds: int, tp: dict, json_path=None) -> int:
    """Issue 20's table: device time per call of cuDNN, fa4 with automatic splits and with every forced
    split count, for the decode rows and their paged variants."""
    rows = [(b, s, None) for b, s in ROWS] + [(b, s, ps) for b, s in PAGED_ROWS for ps in PAGE_SIZES]
    print(f"\nDecode device time (us per call: {LOOP} dependent calls in one unrolled jitted loop, min over "
          f"{rounds} interleaved rounds), bf16, seqlen_q 1, heads {H_Q}/{H_KV}, head_dim {D}, full caches")
    print(f"{'batch x keys':>14} {'page':>5} {'cuDNN':>7} {'auto':>7} {'best forced':>11} {'splits':>6} "
          f"{'floor':>6} {'auto/best':>9} {'auto/cuDNN':>10}")
    results = []
    for b, s, ps in rows:
        q, k, v = inputs(0, b, s)
        lens = jnp.full((b,), s, jnp.int32)
        kv_bytes = 2 * b * s * H_KV * D * 2
        if ps is None:
            args, kw = (q, k, v, lens), {}
        else:
            kp, vp, table = to_paged(k, v, ps, seed=ps)
            args, kw = (q, kp, vp, lens, table), {}
        def fa4_step(splits):
            if ps is None:
                return lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, num_splits=splits,
                                                                         implementation="fa4")
            return lambda q, k, v, n, t: fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t, num_splits=splits,
                                                                        implementation="fa4")
        err = rel_err(jax.jit(fa4_step(None))(*args), q, k, v)
        if err > REL_ERR_LIMIT:
            print(f"{b:>5} x {s:>6} {ps or '-':>5}: fa4 WRONG (rel err {err:.3g})")
            results.append(dict(batch=b, keys=s, page_size=ps, fa4="WRONG"))
            continue
        max_splits = max(1, min(s // 128, 128))
        progs = {"auto": (looped(fa4_step(None)), args)}
        progs.update({f"s{n}": (looped(fa4_step(n)), args) for n in SPLIT_SWEEP if n <= max_splits})
        if ps is None:
            progs["cudnn"] = (looped(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
                              (q, k, v))
        times: dict[str, list[float]] = {name: [] for name in progs}
        for _ in range(rounds):
            for name, (f, a) in progs.items():
                try:
                    times[name].append(time_per_call(f, [a], **tp) / LOOP * 1e6)
                except Exception as e:  # noqa: BLE001 - cuDNN may refuse; report and go on
                    times[name].append(float("nan"))
                    print(f"   {name}: {short(e)}")
        best = {name: min(t) for name, t in times.items()}
        forced = {int(n[1:]): t for n, t in best.items() if n.startswith("s")}
        b_n = min(forced, key=forced.get)
        auto = best["auto"]
        cud = best.get("cudnn", float("nan"))
        floor = kv_bytes / (HBM_TB_S * 1e12) * 1e6
        print(f"{b:>5} x {s:>6} {ps or '-':>5} {cud:7.1f} {auto:7.1f} {forced[b_n]:11.1f} {b_n:>6} {floor:6.1f} "
              f"{auto / forced[b_n]:9.3f} {auto / cud:10.3f}", flush=True)
        results.append(dict(batch=b, keys=s, page_size=ps, cudnn_us=cud, auto_us=auto, forced_us=forced,
                            best_splits=b_n, floor_us=floor))
        del progs, args
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--target-batch-s", type=float, default=0.1)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--no-paged", action="store_true")
    ap.add_argument("--device-time", action="store_true",
                    help="kernel time alone (unrolled jitted loop), automatic vs every forced split count")
    ap.add_argument("--rounds", type=int, default=3, help="--device-time: interleaved repeats")
    args = ap.parse_args(argv)
    device, why = kernel_device("kvcache")
    if device is None:
        print(f"benchmark_decode: nothing to measure: {why}")
        return 0
    print("\n".join(header_lines(device)))
    tp = dict(batches=args.batches, target_batch_s=args.target_batch_s)
    if args.device_time:
        return device_time_table(args.rounds, dict(batches=3, target_batch_s=0.03), args.json)

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
