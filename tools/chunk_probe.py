#!/usr/bin/env python3
"""Where a chunked prefill against the KV cache loses to the dense kernel (issue 15; docs/PERF.md):
examples/benchmark_serving.py's prefill workload (8 x 512-token chunks on 2k-16k tokens of context,
32/8 heads, d 128, bf16, causal) as one ragged call on a paged (page 64) and on a contiguous cache,
as a batched (8, 512) call on both, and as the dense kernel per sequence. Device time per call and
TFLOP/s of the visible (query, key) pairs.

    python tools/chunk_probe.py            # every row
    QUICK=1 python tools/chunk_probe.py    # the ragged rows only (paged shuffled / contiguous / paged in order)
"""

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import benchmark_serving as bs  # noqa: E402
from benchmark import time_per_call  # noqa: E402


def main() -> int:
    sz = bs.FULL
    n, c = sz.n_chunks, sz.chunk
    lens = (bs.spread(*sz.chunk_context, n) + c).astype(np.int32)
    cu = bs.offsets([c] * n)
    q = bs.normal(21, (n * c, bs.H_Q, bs.D))
    flops = 4 * bs.H_Q * bs.D * sum(c * (int(length) - c) + c * (c + 1) // 2 for length in lens)
    k_tok, v_tok = bs.token_pool(22, lens, sz.prefill_page)
    paged = bs.paginate(k_tok, v_tok, lens, sz.prefill_page, seed=300)
    cap = int(-(-lens.max() // 128) * 128)
    kc, vc = bs.normal(7, (n, cap, bs.H_KV, bs.D)), bs.normal(8, (n, cap, bs.H_KV, bs.D))
    lens_d, cu_d, table = jnp.asarray(lens), jnp.asarray(cu), jnp.asarray(paged.table)

    times = {}

    def row(name, step, carry, operands):
        f = bs.looped(step, sz.loop)
        t = min(time_per_call(f, [(carry, *operands)], batches=3, target_batch_s=0.05) for _ in range(2))
        t = t / sz.loop * 1e6
        times[name] = t
        print(f"{name:<44} {t:9.1f} us {flops / t / 1e6:7.1f} TFLOP/s", flush=True)

    ragged = functools.partial(bs.ragged_step, max_seqlen_q=c, impl="fa4")
    row(f"ragged, paged {sz.prefill_page}", ragged, q, (paged.k, paged.v, lens_d, cu_d, table))
    row("ragged, contiguous", ragged, q, (kc, vc, lens_d, cu_d, None))
    in_order = bs.paginate(k_tok, v_tok, lens, sz.prefill_page, seed=None)
    row(f"ragged, paged {sz.prefill_page}, pages in order", ragged, q,
        (in_order.k, in_order.v, lens_d, cu_d, jnp.asarray(in_order.table)))
    if os.environ.get("QUICK"):
        return 0
    batched = functools.partial(bs.kvcache_step, impl="fa4")
    q4 = q.reshape(n, c, bs.H_Q, bs.D)
    row(f"batched ({n}, {c}), contiguous", batched, q4, (kc, vc, lens_d, None))
    row(f"batched ({n}, {c}), paged {sz.prefill_page}", batched, q4, (paged.k, paged.v, lens_d, table))
    dense_kv = [bs.sequence_kv_device(paged, i, int(lens[i])) for i in range(n)]
    row("dense per sequence", functools.partial(bs.dense_step, impl="fa4"),
        tuple(q[i * c:(i + 1) * c][None] for i in range(n)),
        (tuple(kv[0] for kv in dense_kv), tuple(kv[1] for kv in dense_kv)))
    # Issue 15's ratio: chunked prefill's TFLOP/s over the dense kernel's on the same problem.
    dense = times["dense per sequence"]
    print("speed / dense: " + ", ".join(f"{name} {dense / t:.3f}" for name, t in times.items()
                                          if name != "dense per sequence"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
