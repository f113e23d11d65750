#!/usr/bin/env python3
"""What a paged KV cache costs in a small decode step (issue 15: "head_dim 64 paged decode at
examples/generate.py's shape within 10% of contiguous"): attention_with_kvcache paged vs contiguous
beside cuDNN, and update_kvcache paged vs contiguous, as device time (LOOP dependent calls inside one
jitted, unrolled fori_loop: a rolled loop adds its own per-iteration cost, docs/BENCHMARKING.md).

    python3 tools/paged_overhead.py [--rounds 3] [--splits 1,2,4,8] [--head-dims 64,128]
    python3 tools/paged_overhead.py --head-dims 64 --lengths generate --cold-mb 200 --splits 1,2,3,4

Shape: examples/generate.py's 1b decode -- batch 8, 32/8 heads, 1500-2200 valid keys per row in a
4096-key cache, page 64 (and 16, 1); every row is checked against a float32 oracle first. `--lengths`
sets the rows' lengths instead (`generate`: the 1b config's prompts 64 steps into its decode, lengths
64-2048 as the model's step sees them); `--cold-mb` cycles cache sets of that many MB through the loop
so that each call reads its K/V from HBM, as each layer of the model does (L2-warm otherwise). cuDNN gets
what generate.py gives it: the contiguous cache with key_value_seq_lengths. Rounds alternate the
programs; the minimum over rounds is printed, with each column's ratio to the contiguous automatic one.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from benchmark import REL_ERR_LIMIT, time_per_call  # noqa: E402
from benchmark_decode import LOOP, looped, masked_oracle  # noqa: E402  (LOOP calls in one unrolled program)
from split_sweep import looped as cycled  # noqa: E402  (the same, cycling cache sets through the loop)

import fa4_jax  # noqa: E402

B, H_Q, H_K, CAP = 8, 32, 8, 4096
# examples/generate.py's "1b" prompts, 64 of its 128 decode steps in.
GENERATE_LENGTHS = tuple(n + 64 for n in (2048, 1537, 1024, 777, 2000, 64, 1500, 1999))


def updates(paged: bool):
    """LOOP cache updates, the cache carried through the loop (in place, as in a decode loop)."""
    def run(k, v, k_new, lens, *table):
        t = table[0] if paged else None
        body = lambda i, kv: fa4_jax.update_kvcache(*kv, k_new, k_new, lens + i, page_table=t)  # noqa: E731
        return jax.lax.fori_loop(0, LOOP, body, (k, v), unroll=True)[0].reshape(-1)[0]
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--splits", default="1,2,4,8", help="forced split counts timed beside the automatic one")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--pages", default="64,16,1")
    ap.add_argument("--lengths", default=None,
                    help="the rows' lengths, comma-separated (8 of them), or 'generate' (default: 1500-2200 drawn)")
    ap.add_argument("--cold-mb", type=float, default=0, metavar="MB",
                    help="cycle cache sets of this many MB in all through the loop (K/V from HBM)")
    args = ap.parse_args(argv)
    tp = dict(batches=3, target_batch_s=0.03)
    rng = np.random.default_rng(0)
    for d in (int(x) for x in args.head_dims.split(",")):
        bf = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
        if args.lengths is None:
            lens = jnp.asarray(rng.integers(1500, 2200, B), jnp.int32)
        else:
            given = GENERATE_LENGTHS if args.lengths == "generate" else tuple(int(x) for x in args.lengths.split(","))
            if len(given) != B or not all(1 <= n <= CAP for n in given):
                raise SystemExit(f"--lengths needs {B} lengths in [1, {CAP}]; got {given}")
            lens = jnp.asarray(given, jnp.int32)
        # Cache sets cycled through the loop: set 0 is the checked one; the others are its copies
        # rolled along the batch (the same lengths' work, other bytes).
        n_sets = min(LOOP, max(1, -(-int(args.cold_mb * 1e6) // (2 * B * CAP * H_K * d * 2))))
        q, k_new = bf(B, 1, H_Q, d), bf(B, 1, H_K, d)
        kc, vc = bf(B, CAP, H_K, d), bf(B, CAP, H_K, d)
        ref = masked_oracle(q, kc, vc, lens)
        progs = {}

        def attn(splits, paged):
            if paged:
                return lambda q, k, v, n, t: fa4_jax.attention_with_kvcache(
                    q, k, v, n, page_table=t, causal=True, num_splits=splits, implementation="fa4")
            return lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, causal=True, num_splits=splits,
                                                                    implementation="fa4")

        stacked = {}

        def add(name, step, call_args):
            err = float(jnp.abs(jax.jit(step)(*call_args).astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
            if err > REL_ERR_LIMIT:
                raise SystemExit(f"d{d} {name}: WRONG (rel err {err:.3g})")
            if n_sets == 1:
                progs[name] = (looped(step), call_args)
            else:
                q_, k_, v_, *rest = call_args
                if id(k_) not in stacked:
                    stacked[id(k_)] = [jnp.stack([jnp.roll(x, i, axis=0) for i in range(n_sets)]) for x in (k_, v_)]
                sets = stacked[id(k_)]
                progs[name] = (cycled(step), (q_, *sets, *rest))

        add("cuDNN", lambda q, k, v, n: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=n, implementation="cudnn"), (q, kc, vc, lens))
        splits = [None] + [int(x) for x in args.splits.split(",") if x]
        for n in splits:
            add(f"contig s{n or 'auto'}", attn(n, False), (q, kc, vc, lens))
        pools = {}
        for ps in (int(x) for x in args.pages.split(",")):
            mp = CAP // ps
            perm = rng.permutation(B * mp).astype(np.int32)
            table = jnp.asarray(perm.reshape(B, mp))
            inv = np.argsort(perm)
            kp, vp = (x.reshape(B * mp, ps, H_K, d)[inv] for x in (kc, vc))
            pools[ps] = (kp, vp, table)
            for n in splits if ps == 64 else [None]:
                add(f"page{ps} s{n or 'auto'}", attn(n, True), (q, kp, vp, lens, table))
        upd = {"update contig": (updates(False), (kc, vc, k_new, lens))}
        if 64 in pools:
            kp, vp, table = pools[64]
            upd["update page64"] = (updates(True), (kp, vp, k_new, lens, table))
        progs.update(upd)
        times = {name: [] for name in progs}
        for _ in range(args.rounds):
            for name, (f, a) in progs.items():
                times[name].append(time_per_call(f, [a], **tp) / LOOP * 1e6)
        best = {name: min(t) for name, t in times.items()}
        base = best["contig sauto"]
        where = "L2-warm" if n_sets == 1 else f"{n_sets} cache sets cycled (K/V from HBM)"
        print(f"\nb{B} h{H_Q}/{H_K} d{d}, lens {np.asarray(lens).tolist()}, cap {CAP}, {where}: us per call "
              f"(min of {args.rounds} rounds; ratio to contiguous auto)")
        for name, t in best.items():
            print(f"  {name:>16} {t:8.2f}  {t / base:6.3f}  (rounds {', '.join(f'{x:.2f}' for x in times[name])})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
