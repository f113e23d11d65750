#!/usr/bin/env python3
"""FP8 (e4m3) KV-cache decode beside the bf16 cache, same run, on a Hopper GPU (issue 17's table).

    python tools/fp8_decode_bench.py              # rows of issue 17, contiguous and paged 16/64/256
    python tools/fp8_decode_bench.py --rounds 3 --json out.json

Setting as examples/benchmark_decode.py: bf16 q, seqlen_q 1, 32 q-heads / 8 KV heads, head_dim 128,
full caches. Device time per call: LOOP dependent calls in one unrolled jitted loop (benchmark_decode.
looped), every column timed once per round, rounds interleaved, the minimum over rounds. TB/s counts
the K/V bytes a call must read: 2 bytes per element for bf16, 1 for FP8 (the scales are 64 bytes). The
FP8 cache is the bf16 one quantized with per-head scales (fa4_jax.update_kvcache's rounding); each
column is checked against a float32 oracle on its own cache (dequantized) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from benchmark import header_lines, time_per_call  # noqa: E402
from benchmark_decode import D, H_KV, H_Q, LOOP, inputs, looped, masked_oracle, to_paged  # noqa: E402

import fa4_jax  # noqa: E402
from fa4_jax.ops.kvcache.quant import quantize  # noqa: E402

ROWS = [(1, 131072), (8, 32768), (32, 8192), (64, 4096)]
PAGE_SIZES = (None, 16, 64, 256)
REL_ERR_LIMIT = 3e-2  # FP8 caches: the oracle reads the same dequantized cache, so this is kernel error


def rel_err(out, q, k, v, lens, rows=2):
    ref = masked_oracle(q[:rows], k[:rows], v[:rows], lens[:rows])
    return float(jnp.abs(out[:rows].astype(jnp.float32) - ref).max() / jnp.abs(ref).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--target-batch-s", type=float, default=0.05)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fp8-only", action="store_true", help="time the FP8 cache alone (a library of FP8 variants)")
    args = ap.parse_args(argv)
    for line in header_lines(jax.devices()[0]):
        print(line)
    tp = dict(batches=args.batches, target_batch_s=args.target_batch_s)
    k_scale = jnp.asarray(np.linspace(0.004, 0.006, H_KV), jnp.float32)  # N(0, 1) keys: codes up to ~1000 -> saturate rarely
    v_scale = jnp.asarray(np.linspace(0.005, 0.007, H_KV), jnp.float32)
    print(f"\nDecode device time, us per call ({LOOP} dependent calls, unrolled; min of {args.rounds} rounds); "
          f"heads {H_Q}/{H_KV}, d {D}, q bf16")
    print(f"{'batch x keys':>14} {'page':>5} {'bf16 us':>8} {'TB/s':>5} {'fp8 us':>8} {'TB/s':>5} "
          f"{'speedup':>7} {'fp8 err':>8}")
    results = []
    for b, s in ROWS:
        q, k, v = inputs(0, b, s)
        lens = jnp.full((b,), s, jnp.int32)
        k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
        deq = lambda x, sc: x.astype(jnp.float32) * sc[:, None]  # noqa: E731
        contiguous = None
        for ps in PAGE_SIZES:
            if ps is None:
                a16, a8, table = (q, k, v, lens), (q, k8, v8, lens), None
            else:
                kp, vp, table = to_paged(k, v, ps, seed=ps)
                kp8, vp8, _ = to_paged(k8, v8, ps, seed=ps)
                a16, a8 = (q, kp, vp, lens, table), (q, kp8, vp8, lens, table)

            def step16(q, k, v, n, t=None):
                return fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t, implementation="fa4")

            def step8(q, k, v, n, t=None):
                return fa4_jax.attention_with_kvcache(q, k, v, n, page_table=t, k_scale=k_scale, v_scale=v_scale,
                                                      implementation="fa4")

            err = rel_err(jax.jit(step8)(*a8), q, deq(k8, k_scale), deq(v8, v_scale), lens)
            if err > REL_ERR_LIMIT:
                print(f"{b:>5} x {s:>6} {ps or '-':>5}: fp8 WRONG (rel err {err:.3g})", flush=True)
                results.append(dict(batch=b, keys=s, page_size=ps, fp8="WRONG", err=err))
                continue
            progs = {"fp8": (looped(step8), a8)} if args.fp8_only else {"bf16": (looped(step16), a16),
                                                                         "fp8": (looped(step8), a8)}
            times = {n: [] for n in progs}
            for _ in range(args.rounds):
                for n, (f, a) in progs.items():
                    times[n].append(time_per_call(f, [a], **tp) / LOOP * 1e6)
            t16, t8 = min(times.get("bf16", [float("nan")])), min(times["fp8"])
            elems = 2 * b * s * H_KV * D
            print(f"{b:>5} x {s:>6} {ps or '-':>5} {t16:8.1f} {elems * 2 / t16 / 1e6:5.2f} {t8:8.1f} "
                  f"{elems / t8 / 1e6:5.2f} {t16 / t8:7.2f} {err:8.1e}"
                  + ("" if ps is None else f"   fp8 paged/contiguous {t8 / contiguous:.3f}"), flush=True)
            if ps is None:
                contiguous = t8
            results.append(dict(batch=b, keys=s, page_size=ps, bf16_us=t16, fp8_us=t8, err=err,
                                bf16_rounds=times.get("bf16"), fp8_rounds=times["fp8"]))
            del progs, a16, a8
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
