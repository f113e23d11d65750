#!/usr/bin/env python3
"""Packed variable-length prefill on a Hopper GPU: fa4_jax.attention_varlen vs the dense kernel.

    python examples/benchmark_varlen.py            # ~1 min on an H200

Rows (bf16, head_dim 128, 16 q-heads / 16 kv-heads):
- equal lengths, 8 x 2048 (and 4 x 4096), causal and not: varlen TFLOP/s next to dense
  `fa4_jax.attention` on the (batch, seqlen) view of the same tokens; the ratio should be ~1;
- a mix of 1 x 8192 + 15 x 512 causal tokens: varlen against the same batch padded to 16 x 8192
  through dense `attention` (what a user without varlen runs); 15x fewer FLOPs, so a good kernel is
  > 5x faster.
TFLOP/s counts visible (query, key) pairs: 4 * h * d * pairs. Timing as in benchmark.py (method:
docs/BENCHMARKING.md); each row is checked against a float32 oracle on a slice first.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import REL_ERR_LIMIT, header_lines, kernel_device, time_per_call  # noqa: E402

import fa4_jax  # noqa: E402

H, D = 16, 128


def pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def packed(seed: int, total: int):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(x, (total, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)


def check(o, q, k, v, start: int, length: int, causal: bool, rows: int = 64) -> float:
    """Relative error of the last `rows` query rows of the sequence at [start, start + length)."""
    qs = q[start + length - rows:start + length].astype(jnp.float32)
    ks, vs = (x[start:start + length].astype(jnp.float32) for x in (k, v))
    s = jnp.einsum("qhd,khd->hqk", qs, ks, precision="highest") * D ** -0.5
    if causal:
        pos = jnp.arange(length - rows, length)[:, None]
        s = jnp.where(jnp.arange(length)[None, :] <= pos, s, -jnp.inf)
    ref = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), vs, precision="highest")
    got = o[start + length - rows:start + length].astype(jnp.float32)
    return float(jnp.abs(got - ref).max() / jnp.abs(ref).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--target-batch-s", type=float, default=0.2)
    args = ap.parse_args(argv)
    device, why = kernel_device("varlen")
    if device is None:
        print(f"benchmark_varlen: nothing to measure: {why}")
        return 0
    print("\n".join(header_lines(device)))
    tp = dict(batches=args.batches, target_batch_s=args.target_batch_s)

    def varlen_fn(causal, max_s):
        return jax.jit(lambda q, k, v, cu: fa4_jax.attention_varlen(q, k, v, cu, cu, max_seqlen_q=max_s, causal=causal,
                                                                    implementation="fa4"))

    def dense_fn(causal):
        return jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, implementation="fa4"))

    print(f"\nEqual lengths (bf16, hd{D}, h{H}): varlen vs dense on the same tokens")
    print(f"{'batch x seqlen':>15} {'causal':>6} {'varlen TF/s':>12} {'dense TF/s':>11} {'varlen/dense':>13}")
    for b, s in [(8, 2048), (4, 4096)]:
        for causal in (False, True):
            sets = [packed(i, b * s) for i in range(2)]
            cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * s)
            fv, fd = varlen_fn(causal, s), dense_fn(causal)
            err = check(fv(*sets[0], cu), *sets[0], (b - 1) * s, s, causal)
            if err > REL_ERR_LIMIT:
                print(f"{b:>6} x {s:>6} {causal!s:>6} WRONG (rel err {err:.3g})")
                continue
            flops = 4 * H * D * b * pairs(s, causal)
            tv = time_per_call(fv, [(*x, cu) for x in sets], **tp)
            td = time_per_call(fd, [tuple(x.reshape(b, s, H, D) for x in xs) for xs in sets], **tp)
            print(f"{b:>6} x {s:>6} {causal!s:>6} {flops / tv / 1e12:12.0f} {flops / td / 1e12:11.0f} {td / tv:13.3f}")

    print("\nMix 1 x 8192 + 15 x 512, causal: varlen vs the batch padded to 16 x 8192 (dense)")
    lens = [8192] + [512] * 15
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    total = int(cu[-1])
    sets = [packed(i, total) for i in range(2)]
    fv = varlen_fn(True, max(lens))
    err = max(check(fv(*sets[0], cu), *sets[0], 0, 8192, True), check(fv(*sets[0], cu), *sets[0], 8192, 512, True))
    if err > REL_ERR_LIMIT:
        print(f"varlen WRONG (rel err {err:.3g})")
        return 1

    def pad(x):
        out = jnp.zeros((16, 8192, H, D), x.dtype)
        out = out.at[0].set(x[:8192])
        return out.at[1:, :512].set(x[8192:].reshape(15, 512, H, D))

    padded = [tuple(pad(x) for x in xs) for xs in sets]
    tv = time_per_call(fv, [(*x, cu) for x in sets], **tp)
    tpad = time_per_call(dense_fn(True), padded, **tp)
    flops = 4 * H * D * sum(pairs(n, True) for n in lens)
    print(f"varlen {tv * 1e6:9.1f} us ({flops / tv / 1e12:4.0f} TF/s useful)   padded dense {tpad * 1e6:9.1f} us   "
          f"speed-up {tpad / tv:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
