#!/usr/bin/env python3
"""Cost of window / softcap / sinks on the dense kernel (H200, bf16, hd128), same run, with cuDNN.

    python examples/bench_features.py              # ~1-2 min on an H200
    python examples/bench_features.py --seqlen 8192 --json out.json

Rows: the plain causal and non-causal kernels; the same with sinks, with softcap, with a window that
excludes almost nothing (the `local` kernel doing the plain kernel's work); sliding windows of 1k and
4k keys (time should follow the window, not s^2). TFLOP/s counts the scores actually computed:
4*b*h*d * (visible (query, key) pairs). cuDNN (`jax.nn.dot_product_attention`) runs the rows it can
express (causal, plain, left windows); it has no softcap and no sinks. Timing as in benchmark.py
(method: docs/BENCHMARKING.md); every row is checked against a float64 host oracle on a slice
first.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import REL_ERR_LIMIT, check_rows, kernel_device, make_inputs, short, time_per_call  # noqa: E402

import fa4_jax  # noqa: E402


def visible_pairs(s: int, causal: bool, window) -> int:
    left, right = window
    right = 0 if causal else right
    i = np.arange(s)
    hi = np.minimum(s - 1, i + right) if right >= 0 else np.full(s, s - 1)
    lo = np.maximum(0, i - left) if left >= 0 else np.zeros(s, int)
    return int(np.maximum(hi - lo + 1, 0).sum())


def oracle_rows(q, k, v, rows, *, causal, window, softcap, sinks, heads=2):
    """float64 attention for batch 0, the first `heads` heads, the given rows (s_q == s_k)."""
    d = q.shape[-1]
    qs = np.asarray(q[0, rows, :heads], np.float64)
    ks = np.asarray(k[0, :, :heads], np.float64)
    vs = np.asarray(v[0, :, :heads], np.float64)
    s = np.einsum("rhd,shd->hrs", qs, ks) / math.sqrt(d)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    left, right = window
    right = 0 if causal else right
    j = np.arange(ks.shape[0])[None, None, :]
    i = rows[None, :, None]
    vis = np.ones_like(s, bool)
    if right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    snk = None if sinks is None else np.asarray(sinks[:heads], np.float64)[:, None, None]
    if snk is not None:
        m = np.maximum(m, snk)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True) + (0 if snk is None else np.exp(snk - m))
    return np.einsum("hrs,shd->rhd", p / l, vs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--target-batch-s", type=float, default=0.2)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    device, why = kernel_device("fwd")
    if device is None:
        print(f"bench_features: nothing to measure: {why}")
        return 0

    s, d, h = args.seqlen, 128, 16
    b = max(1, 16384 // s)
    sets = [make_inputs(i, b, s, h, d, jnp.bfloat16) for i in range(2)]
    sinks = jax.random.normal(jax.random.key(7), (h,), jnp.float32)
    rows = check_rows(*sets[0])
    big = s - 2  # a window that excludes almost nothing: the `local` kernel doing full work
    cases = [  # name, causal, window, softcap, sinks, cuDNN local_window_size (None: not expressible)
        ("causal", True, (-1, -1), 0.0, False, "causal"),
        ("causal + sinks", True, (-1, -1), 0.0, True, None),
        ("causal + softcap 30", True, (-1, -1), 30.0, False, None),
        (f"causal + window ({big}, 0)", True, (big, -1), 0.0, False, (big, 0)),
        ("causal + window (4096, 0)", True, (4096, -1), 0.0, False, (4096, 0)),
        ("causal + window (1024, 0)", True, (1024, -1), 0.0, False, (1024, 0)),
        ("full", False, (-1, -1), 0.0, False, "full"),
        ("full + sinks", False, (-1, -1), 0.0, True, None),
        ("full + softcap 30", False, (-1, -1), 30.0, False, None),
        (f"window ({big}, {big})", False, (big, big), 0.0, False, None),
    ]
    print(f"bf16 hd{d} b{b} s{s} h{h}; {jax.devices()[0].device_kind}; jax {jax.__version__}")
    print(f"{'case':<32} {'fa4 us':>9} {'TFLOP/s':>8} | {'cuDNN us':>9} {'TFLOP/s':>8} | ratio")
    results = []
    for name, causal, window, softcap, use_sinks, cudnn in cases:
        flops = 4.0 * b * h * d * visible_pairs(s, causal, window)
        sk = sinks if use_sinks else None
        ref = oracle_rows(*sets[0], rows, causal=causal, window=window, softcap=softcap, sinks=sk)
        row = dict(case=name, flops=flops)
        fa4 = jax.jit(functools.partial(fa4_jax.attention, causal=causal, window_size=window, softcap=softcap,
                                        implementation="fa4"))
        fns = {"fa4": lambda q, k, v: fa4(q, k, v, sinks=sk)}
        if cudnn is not None:
            kw = dict(is_causal=causal, implementation="cudnn")
            if isinstance(cudnn, tuple):
                kw["local_window_size"] = cudnn
            fns["cudnn"] = jax.jit(functools.partial(jax.nn.dot_product_attention, **kw))
        for who, fn in fns.items():
            try:
                out = np.asarray(fn(*sets[0])[0, rows, :2], np.float64)
                err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
                if not err <= REL_ERR_LIMIT:
                    row[who] = f"WRONG ({err:.2e})"
                    continue
                t = time_per_call(fn, sets, batches=args.batches, target_batch_s=args.target_batch_s)
                row[who] = dict(us=t * 1e6, tflops=flops / t / 1e12, rel_err=err)
            except Exception as e:  # noqa: BLE001 - one failing competitor must not kill the table
                row[who] = f"n/a ({short(e)})"
        results.append(row)

        def cell(x):
            return f"{x['us']:>9.0f} {x['tflops']:>8.0f}" if isinstance(x, dict) else f"{str(x)[:18]:>18}"

        c = row.get("cudnn", "-")
        ratio = f"{c['us'] / row['fa4']['us']:.2f}" if isinstance(c, dict) and isinstance(row["fa4"], dict) else "-"
        print(f"{name:<32} {cell(row['fa4'])} | {cell(c) if c != '-' else '-':>18} | {ratio}", flush=True)

    base = {r["case"]: r["fa4"]["us"] for r in results if isinstance(r.get("fa4"), dict)}
    print("\nfa4 time relative to its plain kernel (same run):")
    for r in results:
        if not isinstance(r.get("fa4"), dict):
            continue
        ref_case = "causal" if r["case"].startswith("causal") else "full"
        if ref_case in base:
            print(f"  {r['case']:<32} {r['fa4']['us'] / base[ref_case]:.3f}x of {ref_case}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seqlen=s, batch=b, heads=h, head_dim=d, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
