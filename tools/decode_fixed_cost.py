#!/usr/bin/env python3
"""Where a single-sequence decode call's device time goes (issue 20; docs/PERF.md): the same 1 x 8k
and 1 x 32k caches with 0 / 1 / 128 / 1024 / all valid keys, automatic splits, one split and 16, beside
cuDNN (all keys, and 128 keys) and the timing loop's own glue (`q * 2` in the attention's place).
Device time: 20 dependent calls in one unrolled jitted loop (benchmark_decode.looped), min of 2.

    python tools/decode_fixed_cost.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402
from benchmark import time_per_call  # noqa: E402
from benchmark_decode import LOOP, inputs, looped  # noqa: E402

TP = dict(batches=3, target_batch_s=0.03)


def device_us(f, args) -> float:
    return min(time_per_call(f, [args], **TP) for _ in range(2)) / LOOP * 1e6


def main() -> int:
    for b, s in [(1, 8192), (1, 32768)]:
        q, k, v = inputs(0, b, s)
        for n_keys in (0, 1, 128, 1024, s):
            lens = jnp.full((b,), n_keys, jnp.int32)
            for splits in (None, 1, 16):
                f = looped(lambda q, k, v, n, sp=splits: fa4_jax.attention_with_kvcache(
                    q, k, v, n, num_splits=sp, implementation="fa4"))
                print(f"{b}x{s} keys {n_keys:>6} splits {str(splits):>4}: {device_us(f, (q, k, v, lens)):7.1f} us",
                      flush=True)
        f = looped(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
        print(f"{b}x{s} cuDNN, all keys: {device_us(f, (q, k, v)):7.1f} us")
        f = looped(lambda q, k, v: jax.nn.dot_product_attention(q, k[:, :128], v[:, :128], implementation="cudnn"))
        print(f"{b}x{s} cuDNN, 128 keys: {device_us(f, (q, k, v)):7.1f} us")
        f = looped(lambda q, k, v: q * 2)
        print(f"{b}x{s} the loop's glue alone (q * 2): {device_us(f, (q, k, v)):7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
