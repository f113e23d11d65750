#!/usr/bin/env python3
"""Decode device time against the split count, over many shapes: the data the handler's automatic
split choice (ffi/splits.h AutoSplits) is judged by. For each shape it times the automatic choice
and every forced count that gives each split at least one 128-key granule, beside cuDNN
(`jax.nn.dot_product_attention` with key_value_seq_lengths, as examples/generate.py calls it), and
prints the best forced count, auto's time over it (issue 20: within 3%) and over cuDNN's.

    python3 tools/split_sweep.py [--rounds 2] [--head-dims 64,128] [--shapes 1x2k,8x2k~,...]
    python3 tools/split_sweep.py --cold-mb 200      # K/V from HBM: cache sets of 200 MB cycled
    python3 tools/split_sweep.py --json out.json
    python3 tools/split_sweep.py --fp8 --splits 16,24,32,48,64   # FP8 caches (cuDNN on the bf16 ones)

A shape is batch x keys (k = 1024), each row's cache full; a trailing `~` draws each row's length
from [0.7, 1.0] x keys in a cache of 2 x keys (examples/generate.py's decode: rows of different
lengths in a larger cache, whose capacity is all the handler sees). bf16, seqlen_q 1, 32 q-heads /
8 KV heads; device time = LOOP dependent calls in one jitted, unrolled fori_loop, the minimum over
rounds interleaved across the programs of a shape. Every shape is checked against a float32 oracle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from benchmark import REL_ERR_LIMIT, time_per_call  # noqa: E402
from benchmark_decode import LOOP, masked_oracle  # noqa: E402

import fa4_jax  # noqa: E402

H_Q, H_K = 32, 8
SHAPES = "1x1k,1x2k,1x4k,1x8k,1x32k,2x8k,4x4k,4x16k,8x2k~,8x8k,8x32k,16x2k~,32x1k"
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def parse_shape(text: str) -> tuple[int, int, bool]:
    b, _, keys = text.partition("x")
    ragged = keys.endswith("~")
    keys = keys.rstrip("~")
    n = int(keys[:-1]) * 1024 if keys.endswith("k") else int(keys)
    return int(b), n, ragged


def looped(step):
    """LOOP dependent calls of step(q, k, v, *rest), call i on cache set i % len(ks) (ks, vs: lists or
    stacked arrays of sets): with several sets (--cold-mb) larger than the L2 together, each call reads
    its K/V from HBM, as each layer of a model's decode step does."""
    def run(q, ks, vs, *rest):
        carry = jnp.float32(0)
        for i in range(LOOP):
            o = step(q + carry.astype(q.dtype) * 0, ks[i % len(ks)], vs[i % len(vs)], *rest)
            carry = carry + o.reshape(-1)[0].astype(jnp.float32)
        return carry
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)), help="forced counts to time")
    ap.add_argument("--cold-mb", type=float, default=0, metavar="MB",
                    help="cycle as many cache sets through the loop as make MB together (> the 50 MB L2: each "
                         "call's K/V from HBM); 0 = one set, L2-warm")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 (e4m3) caches with per-KV-head scales (the cuDNN column reads the bf16 caches)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tp = dict(batches=3, target_batch_s=0.02)
    rng = np.random.default_rng(0)
    results = []
    for d in (int(x) for x in args.head_dims.split(",")):
        print(f"\nhead_dim {d}, {'L2-warm' if not args.cold_mb else f'{args.cold_mb:g} MB of caches cycled'}: us per call (min of {args.rounds} rounds) by split count; auto / best forced")
        for shape in args.shapes.split(","):
            b, keys, ragged = parse_shape(shape)
            cap = 2 * keys if ragged else keys
            lens = rng.integers(int(0.7 * keys), keys + 1, b) if ragged else np.full(b, keys)
            lens = jnp.asarray(lens, jnp.int32)
            bf = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
            q = bf(b, 1, H_Q, d)
            sets = min(LOOP, max(1, -(-int(args.cold_mb * 1e6) // (2 * b * cap * H_K * d * 2))))
            ks = tuple(bf(b, cap, H_K, d) for _ in range(sets))
            vs = tuple(bf(b, cap, H_K, d) for _ in range(sets))
            kw = {}
            ks16, vs16 = ks, vs
            if args.fp8:
                from fa4_jax.ops.kvcache.quant import dequantize, quantize

                kw = dict(k_scale=jnp.full((H_K,), 0.005, jnp.float32), v_scale=jnp.full((H_K,), 0.006, jnp.float32))
                ks = tuple(quantize(x, kw["k_scale"]) for x in ks)
                vs = tuple(quantize(x, kw["v_scale"]) for x in vs)
            k, v = ks[0], vs[0]
            step = lambda n: (lambda q, k, v, l: fa4_jax.attention_with_kvcache(  # noqa: E731
                q, k, v, l, num_splits=n, implementation="fa4", **kw))
            if args.fp8:
                ref = masked_oracle(q, dequantize(k, kw["k_scale"]),
                                    dequantize(v, kw["v_scale"]), lens)
            else:
                ref = masked_oracle(q, k, v, lens)
            err = float(jnp.abs(jax.jit(step(None))(q, k, v, lens).astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
            if err > REL_ERR_LIMIT:
                raise SystemExit(f"d{d} {shape}: WRONG (rel err {err:.3g})")
            counts = [n for n in map(int, args.splits.split(",")) if n <= max(1, cap // 128)]
            cudnn = lambda q, k, v, l: jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, key_value_seq_lengths=l, implementation="cudnn")
            progs = {"cuDNN": looped(cudnn), "auto": looped(step(None)), **{n: looped(step(n)) for n in counts}}
            times = {name: [] for name in progs}
            for _ in range(args.rounds):
                for name, f in progs.items():
                    try:
                        caches = (ks16, vs16) if name == "cuDNN" else (ks, vs)
                        times[name].append(time_per_call(f, [(q, *caches, lens)], **tp) / LOOP * 1e6)
                    except Exception as e:  # noqa: BLE001 - cuDNN may refuse a shape: report, go on
                        times[name].append(float("nan"))
                        print(f"  {shape} {name}: {type(e).__name__}: {str(e)[:120]}")
            best = {name: min(t) for name, t in times.items()}
            forced = {n: best[n] for n in counts}
            n_best = min(forced, key=forced.get)
            print(f"  {shape:>7} ({sets} set{'s' if sets > 1 else ''}) auto {best['auto']:7.2f}  best {forced[n_best]:7.2f} ({n_best:>2})  "
                  f"auto/best {best['auto'] / forced[n_best]:5.3f}  cuDNN {best['cuDNN']:7.2f} "
                  f"auto/cuDNN {best['auto'] / best['cuDNN']:5.3f} | "
                  + " ".join(f"{n}:{t:.1f}" for n, t in forced.items()), flush=True)
            results.append(dict(head_dim=d, shape=shape, auto=best["auto"], cudnn=best["cuDNN"], forced=forced))
            del q, k, v, ks, vs, progs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
