"""tools/kv_scatter.py (issue 15's generate.py row): both caches' update as one variadic scatter must
write exactly what update_kvcache's two scatters write -- contiguous and paged, a dropped token at the
capacity included -- and compile to one scatter op where update_kvcache compiles to two. The GPU timing
is the tool's own run (docs/PERF.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import kv_scatter  # noqa: E402


def test_one_scatter_matches_update_kvcache_bitwise():
    kv_scatter.check(64)


def test_one_scatter_op_instead_of_two():
    """On XLA's CPU backend (the GPU backend's count is what the tool itself reports on a GPU)."""
    cpu = jax.devices("cpu")[0]
    for paged in (False, True):
        args = jax.device_put(kv_scatter.problem(64, seed=1, paged=paged), cpu)
        assert kv_scatter.scatter_kernels(kv_scatter.two_scatters, args) == 2
        assert kv_scatter.scatter_kernels(kv_scatter.update_both, args) == 1


def test_out_of_range_rows_are_dropped_and_eager_calls_work():
    """Index rows past the pool (what update_both sends a position outside the cache to) write nothing,
    the others land at [row, slot]; called eagerly, outside jit."""
    k = jax.random.normal(jax.random.key(0), (3, 4, 2, 8), jnp.float32)
    v = k + 1
    idx = jnp.asarray([[0, 1], [3, 0], [2, 3]], jnp.int32)  # row 3 is past the 3-page pool
    ku = jnp.full((3, 2, 8), 7.0)
    vu = jnp.full((3, 2, 8), -7.0)
    k2, v2 = kv_scatter.update_both_p.bind(k, v, idx, ku, vu)
    want_k = k.at[0, 1].set(7.0).at[2, 3].set(7.0)
    want_v = v.at[0, 1].set(-7.0).at[2, 3].set(-7.0)
    assert bool(jnp.array_equal(k2, want_k)) and bool(jnp.array_equal(v2, want_v))
