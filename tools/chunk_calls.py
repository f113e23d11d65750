#!/usr/bin/env python3
"""A few calls of one chunked-prefill row of tools/chunk_probe.py, and nothing else: the program to
put under Nsight Compute (`ncu ... --launch-skip 3 --launch-count 1`, then tools/ncu_stalls.py) when
asking where one row's kernel waits. Rows: the ragged step of 8 x 512-token chunks on 2k-16k of
context (32 / 8 heads, d 128, causal) on a paged pool (page 64, shuffled) or a contiguous cache, on
an FP8 copy of either (per-head scales), or the dense kernel on the longest sequence alone (one
(1, 512) x (1, 16.9k) call: its tiles against the chunk tiles' per-block profile).

    python tools/chunk_calls.py --row paged           # the default: 6 calls
    python tools/chunk_calls.py --row fp8-contiguous --calls 4
    python tools/chunk_calls.py --row dense --quick --xla   # small sizes on the XLA path (CPU check)

    ncu --clock-control none -k regex:FlashAttention --launch-skip 3 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o paged -f python3 tools/chunk_calls.py --row paged
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import benchmark_serving as bs  # noqa: E402
import fa4_jax  # noqa: E402
from fa4_jax.ops.kvcache.quant import quantize  # noqa: E402

ROWS = ("paged", "contiguous", "fp8-paged", "fp8-contiguous", "dense")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", choices=ROWS, default="paged")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="benchmark_serving's QUICK sizes")
    ap.add_argument("--xla", action="store_true", help="the XLA reference instead of the kernels")
    args = ap.parse_args(argv)
    impl = "xla" if args.xla else "fa4"
    sz = bs.QUICK if args.quick else bs.FULL
    n, c = sz.n_chunks, sz.chunk
    lens = (bs.spread(*sz.chunk_context, n) + c).astype(np.int32)
    cu = bs.offsets([c] * n)
    q = bs.normal(21, (n * c, bs.H_Q, bs.D))
    k_tok, v_tok = bs.token_pool(22, lens, sz.prefill_page)
    paged = bs.paginate(k_tok, v_tok, lens, sz.prefill_page, seed=300)
    if args.row == "dense":
        last = n - 1
        k, v = bs.sequence_kv_device(paged, last, int(lens[last]))
        qd = q[last * c:(last + 1) * c][None]
        f = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation=impl))
        args_ = (qd, k, v)
    else:
        if args.row.endswith("paged"):
            k, v, table = paged.k, paged.v, jnp.asarray(paged.table)
        else:  # contiguous: each sequence's keys in its own row of a (n, capacity) cache
            cap = int(-(-lens.max() // 128) * 128)
            rows = [bs.sequence_kv_device(paged, i, int(lens[i])) for i in range(n)]
            pad = lambda x: jnp.pad(x, ((0, 0), (0, cap - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
            k = jnp.concatenate([pad(r[0]) for r in rows])
            v = jnp.concatenate([pad(r[1]) for r in rows])
            table = None
        scales = {}
        if args.row.startswith("fp8"):
            k_scale = jnp.max(jnp.abs(k.astype(jnp.float32)), axis=(0, 1, 3)) / 448.0
            v_scale = jnp.max(jnp.abs(v.astype(jnp.float32)), axis=(0, 1, 3)) / 448.0
            k, v = quantize(k, k_scale), quantize(v, v_scale)
            scales = dict(k_scale=k_scale, v_scale=v_scale)
        f = jax.jit(lambda q, k, v, lens, cu, table, scales: fa4_jax.attention_with_kvcache(
            q, k, v, lens, cu_seqlens_q=cu, max_seqlen_q=c, page_table=table, causal=True, implementation=impl,
            **scales))
        args_ = (q, k, v, jnp.asarray(lens), jnp.asarray(cu), table, scales)
    out = None
    for _ in range(args.calls):
        out = f(*args_)
    out = jax.block_until_ready(out)
    print(f"{args.row}: {args.calls} calls, mean |o| {float(jnp.mean(jnp.abs(out.astype(jnp.float32)))):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
