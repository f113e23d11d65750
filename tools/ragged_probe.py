#!/usr/bin/env python3
"""Where a one-call continuous-batching step loses time (issue 15; docs/PERF.md): the mixed step of
examples/benchmark_serving.py (8 x 512-token chunks + 56 decodes, shuffled pages) as one ragged call
in three sequence orders, the chunks alone, and the decodes alone with max_seqlen_q 1 and 512 (the
latter's grid, without a tile list, was mostly tiles with no rows). Device time per call.

    PS=64 python tools/ragged_probe.py      # page size (default 64)
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
    nc, nd, ps = sz.n_chunks, sz.n_decodes, int(os.environ.get("PS", "64"))
    chunk_lens = bs.spread(*sz.chunk_context, nc) + sz.chunk
    decode_lens = bs.spread(*sz.decode_keys, nd)
    lens_all = np.concatenate([chunk_lens, decode_lens]).astype(np.int32)
    k_tok, v_tok = bs.token_pool(2, lens_all, max(128, ps))
    paged = bs.paginate(k_tok, v_tok, lens_all, ps, seed=100 + ps)

    def case(name, idx, q_lens, max_q):
        idx = np.asarray(idx)
        cu = bs.offsets(q_lens)
        q = bs.normal(1, (int(cu[-1]), bs.H_Q, bs.D))
        f = bs.looped(functools.partial(bs.ragged_step, max_seqlen_q=max_q, impl="fa4"), sz.loop)
        args = (q, paged.k, paged.v, jnp.asarray(lens_all[idx]), jnp.asarray(cu), jnp.asarray(paged.table[idx]))
        t = min(time_per_call(f, [args], batches=3, target_batch_s=0.05) for _ in range(2)) / sz.loop * 1e6
        print(f"{name:<48} {t:9.1f} us", flush=True)

    chunks, decodes = list(range(nc)), list(range(nc, nc + nd))
    case("mixed: chunks, then decodes shortest first", chunks + decodes, [sz.chunk] * nc + [1] * nd, sz.chunk)
    case("mixed: decodes longest first, then chunks", decodes[::-1] + chunks, [1] * nd + [sz.chunk] * nc, sz.chunk)
    case("mixed: chunks, then decodes longest first", chunks + decodes[::-1], [sz.chunk] * nc + [1] * nd, sz.chunk)
    case("chunks only", chunks, [sz.chunk] * nc, sz.chunk)
    case("decodes only, max_seqlen_q 1", decodes, [1] * nd, 1)
    case(f"decodes only, max_seqlen_q {sz.chunk}", decodes, [1] * nd, sz.chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
