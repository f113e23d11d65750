#!/usr/bin/env python3
"""Both caches' update in one scatter: a probe for issue 15's generate.py row.

`fa4_jax.update_kvcache` writes K and V with two XLA scatters, and the model's decode step pays two
kernel launches per layer for them (2 x 2.75 us paged in `tools/model_timeline.py`, docs/PERF.md
2026-12-02) -- about the whole gap between generate.py's paged decode and the cuDNN model. StableHLO's
scatter is variadic: several operands and updates under one set of indices. This tool lowers the same
update as ONE variadic scatter (`update_both`, a primitive of this file only) and, on a GPU, says how
many scatter kernels each version compiles to and what each costs as device time (LOOP dependent
updates in one unrolled jitted loop, the caches carried through it as in a decode loop), at
examples/generate.py's shape (batch 8, 8 KV heads, head_dim 64, one token per row, a 4096-key cache,
page 64 shuffled). Every version is first checked bitwise against update_kvcache, dropped positions
included (on any backend: the CPU check is tests/test_kv_scatter_tool.py).

    python3 tools/kv_scatter.py [--rounds 3] [--head-dim 64]

If one scatter measures clearly cheaper than two, the library's update_kvcache takes it (its own
primitive with vmap and sharding rules, in fa4_jax/ops/kvcache/).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir
from jax._src import core, dispatch
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import fa4_jax  # noqa: E402
from fa4_jax.ops.kvcache.api import cache_index  # noqa: E402

B, H_K, CAP, PAGE = 8, 8, 4096, 64

# (k_cache, v_cache, indices (n, 2) int32 of (row, slot), k_upd, v_upd (n, heads, d)) -> (k_cache, v_cache)
# with k_upd[i] / v_upd[i] at [row_i, slot_i]; an index out of range drops its update (XLA's scatter
# skips out-of-bounds windows, which is what update_kvcache's mode="drop" lowers to).
update_both_p = core.Primitive("kv_update_both")
update_both_p.multiple_results = True
update_both_p.def_impl(partial(dispatch.apply_primitive, update_both_p))
update_both_p.def_abstract_eval(lambda k, v, idx, ku, vu: (core.ShapedArray(k.shape, k.dtype),
                                                          core.ShapedArray(v.shape, v.dtype)))


def _lower(ctx, k, v, idx, ku, vu):
    k_aval, v_aval = ctx.avals_out
    dnums = hlo.ScatterDimensionNumbers.get(
        update_window_dims=[1, 2], inserted_window_dims=[0, 1], input_batching_dims=[],
        scatter_indices_batching_dims=[], scattered_dims_to_operand_dims=[0, 1], index_vector_dim=1)
    types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in (k_aval, v_aval)]
    op = hlo.ScatterOp(types, [k, v], idx, [ku, vu], dnums, indices_are_sorted=ir.BoolAttr.get(False),
                       unique_indices=ir.BoolAttr.get(False))
    scalars = [mlir.aval_to_ir_type(ctx.module_context, core.ShapedArray((), a.dtype)) for a in (k_aval, v_aval)]
    block = op.update_computation.blocks.append(*scalars, *scalars)  # (k_old, v_old, k_new, v_new)
    with ir.InsertionPoint(block):
        hlo.return_([block.arguments[2], block.arguments[3]])
    return op.results


mlir.register_lowering(update_both_p, _lower)


def update_both(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None):
    """update_kvcache's contiguous / paged (batch, s_new, heads_kv, d) case as one variadic scatter."""
    b, s_new = k_new.shape[:2]
    seq = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, s_new)).reshape(-1)
    pos = (cache_seqlens[:, None] + jnp.arange(s_new, dtype=jnp.int32)[None, :]).reshape(-1)
    rows, slots = cache_index(k_cache.shape, seq, pos, page_table)  # update_kvcache's own indices
    idx = jnp.stack([rows, slots], axis=1).astype(jnp.int32)
    flat = lambda x: x.reshape(b * s_new, *x.shape[2:])  # noqa: E731
    return tuple(update_both_p.bind(k_cache, v_cache, idx, flat(k_new), flat(v_new)))


def two_scatters(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None):
    return fa4_jax.update_kvcache(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=page_table)


def problem(d: int, seed: int = 0, paged: bool = False):
    """generate.py-like caches (random, never zeros), one new token per row; the last row sits at the
    capacity, so its token is dropped."""
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 4)
    kc, vc = (jax.random.normal(k, (B, CAP, H_K, d), jnp.float32).astype(jnp.bfloat16) for k in ks[:2])
    k_new, v_new = (jax.random.normal(k, (B, 1, H_K, d), jnp.float32).astype(jnp.bfloat16) for k in ks[2:])
    lens = jnp.asarray(list(rng.integers(64, 2200, B - 1)) + [CAP], jnp.int32)
    if not paged:
        return kc, vc, k_new, v_new, lens
    mp = CAP // PAGE
    perm = rng.permutation(B * mp).astype(np.int32)
    inv = np.argsort(perm)
    kp, vp = (x.reshape(B * mp, PAGE, H_K, d)[inv] for x in (kc, vc))
    return kp, vp, k_new, v_new, lens, jnp.asarray(perm.reshape(B, mp))


def check(d: int = 64) -> None:
    """update_both == update_kvcache bitwise, contiguous and paged, the dropped token included."""
    for paged in (False, True):
        args = problem(d, paged=paged)
        ours = jax.jit(update_both)(*args)
        ref = jax.jit(two_scatters)(*args)
        for a, r, name in zip(ours, ref, ("k", "v")):
            if not bool(jnp.array_equal(a, r)):
                raise SystemExit(f"update_both differs from update_kvcache ({name}, paged={paged})")


def looped(update):
    from benchmark_decode import LOOP

    def run(k, v, k_new, v_new, lens, *table):
        body = lambda i, kv: update(*kv, k_new, v_new, lens + i, *table)  # noqa: E731
        return jax.lax.fori_loop(0, LOOP, body, (k, v), unroll=True)[0].reshape(-1)[0]
    return jax.jit(run)


def scatter_kernels(fn, args) -> int:
    """Scatter ops in the optimized HLO (each a kernel of its own on the GPU)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines() if " scatter(" in line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    check(args.head_dim)
    print(f"update_both == update_kvcache bitwise (contiguous, page {PAGE}; a dropped token) on {jax.devices()[0]}")
    from benchmark import time_per_call
    from benchmark_decode import LOOP

    progs = {}
    for paged in (False, True):
        a = problem(args.head_dim, paged=paged)
        where = f"page{PAGE}" if paged else "contig"
        for name, fn in (("two scatters", two_scatters), ("one scatter", update_both)):
            print(f"  {where:>7} {name}: {scatter_kernels(fn, a)} scatter op(s) in the optimized HLO")
            progs[f"{where} {name}"] = (looped(fn), a)
    times = {n: [] for n in progs}
    for _ in range(args.rounds):
        for n, (f, a) in progs.items():
            times[n].append(time_per_call(f, [a], batches=3, target_batch_s=0.02) / LOOP * 1e6)
    print(f"\nb{B} h_kv {H_K} d{args.head_dim}, one token per row: us per update of both caches "
          f"({LOOP} in one unrolled loop; min of {args.rounds} rounds)")
    for n, t in times.items():
        print(f"  {n:>22} {min(t):7.2f}  (rounds {', '.join(f'{x:.2f}' for x in t)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
