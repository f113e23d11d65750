#!/usr/bin/env python3
"""Where each CTA of one KV-cache decode call spends its time (issue 20): the kernel's own %globaltimer
stamps, per phase, over the call's CTAs (min / median / max, ns).

Needs a library built with the stamps (kernels/phase_times.py; the default build has none):

    FA4_JAX_PHASE_TIMES=1 FA4_JAX_VARIANTS="kvcache:dtype=bf16,head_dim=128" \\
        python tools/build_inplace.py --build-dir build/phases
    python tools/decode_phases.py [--rows 1x1024,1x8192,1x32768] [--splits N]

Each row runs in a child process (device printf goes to its stdout): four calls of one jitted
decode (32 / 8 heads, d 128, bf16, full caches, as examples/benchmark_decode.py), the last one's
lines summarised. These are isolated calls, not the back-to-back loop of the device-time table:
the cache may be colder in L2, so phases that stream K/V run longer than in the loop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS = 4

# (label, end stamp, start stamp) over the PHASE fields <entry> <consume> <q_ready> <first_k>
# <mainloop_end> <stored> <merge_start> <end> (indices 0-7), see kernels/phase_times.py.
CONSUMER_PHASES = (
    ("consumer: entry -> consume", 1, 0),
    ("consumer: Q gathered", 2, 1),
    ("consumer: first K block arrived", 3, 2),
    ("consumer: mainloop", 4, 3),
    ("consumer: finalize + store", 5, 4),
    ("consumer: to the split merge", 6, 5),
)


def _child(row: str, splits: int | None) -> int:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import jax
    import jax.numpy as jnp

    import fa4_jax
    from benchmark_decode import inputs

    b, s = (int(x) for x in row.split("x"))
    q, k, v = inputs(0, b, s)
    lens = jnp.full((b,), s, jnp.int32)
    f = jax.jit(lambda q, k, v, n: fa4_jax.attention_with_kvcache(q, k, v, n, num_splits=splits,
                                                                  implementation="fa4"))
    for i in range(CALLS):
        jax.block_until_ready(f(q, k, v, lens))  # the sync flushes the device printf buffer
        sys.stdout.flush()
        print(f"CALL {i}", flush=True)
    return 0


def last_call(text: str) -> tuple[list[list[int]], dict[int, list[int]]]:
    """The PHASE rows and the PROD rows (by CTA) printed before the last CALL marker."""
    calls, cur = [], []
    for line in text.splitlines():
        if line.startswith("CALL"):
            calls.append(cur)
            cur = []
        elif line.startswith(("PHASE ", "PROD ")):
            cur.append(line.split())
    if not calls or not any(f[0] == "PHASE" for f in calls[-1]):
        raise SystemExit("no phase stamps: build the library with FA4_JAX_PHASE_TIMES=1 (see this tool's doc)")
    phases = [[int(x) for x in f[1:]] for f in calls[-1] if f[0] == "PHASE"]
    prods = {int(f[1]): [int(x) for x in f[2:]] for f in calls[-1] if f[0] == "PROD"}
    return phases, prods


def summarize(phases: list[list[int]], prods: dict[int, list[int]]) -> list[tuple[str, int, int, int, int]]:
    """(label, CTAs, min, median, max) in ns per phase. A PHASE row is [cta, merged, 8 stamps]; a
    stamp of 0 is a phase the CTA skipped (no keys in its split). Producer rows: [load_start,
    first_k_issued, last_issued]."""
    t0 = min(p[2] for p in phases)
    out = []

    def add(label, xs):
        xs = sorted(xs)
        if xs:
            out.append((label, len(xs), xs[0], xs[len(xs) // 2], xs[-1]))

    add("kernel entry (after the first CTA's)", [p[2] - t0 for p in phases])
    add("producer: entry -> load start", [prods[p[0]][0] - p[2] for p in phases if p[0] in prods])
    add("producer: -> first K copy issued", [prods[p[0]][1] - prods[p[0]][0] for p in phases
                                             if p[0] in prods and prods[p[0]][1]])
    add("producer: -> last copy issued", [prods[p[0]][2] - prods[p[0]][1] for p in phases
                                          if p[0] in prods and prods[p[0]][1]])
    for label, end, start in CONSUMER_PHASES:
        add(label, [p[2 + end] - p[2 + start] for p in phases if p[2 + end] and p[2 + start]])
    add("consumer: merge protocol (not last)", [p[9] - p[8] for p in phases if p[8] and not p[1]])
    add("consumer: merge protocol + merge (last)", [p[9] - p[8] for p in phases if p[8] and p[1]])
    add("CTA end (after the first CTA's entry)", [p[9] - t0 for p in phases])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1x1024,1x8192,1x32768", help="comma-separated BATCHxKEYS")
    ap.add_argument("--splits", type=int, default=None, help="forced num_splits (default: automatic)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child, args.splits)
    for row in args.rows.split(","):
        cmd = [sys.executable, __file__, "--child", row] + (["--splits", str(args.splits)] if args.splits else [])
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        if res.returncode:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        phases, prods = last_call(res.stdout)
        print(f"\n{row} keys, splits {args.splits or 'auto'}: {len(phases)} CTAs (ns)")
        for label, n, lo, med, hi in summarize(phases, prods):
            print(f"  {label:<42} {n:4d} CTAs  min {lo:7d}  median {med:7d}  max {hi:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
