"""One process of tests/test_sharding.py's compilation-cache checks, on 8 host devices.

    python cache_key_case.py CACHE_DIR shard_map      # a shard_map program (custom_partitioning inlined)
    python cache_key_case.py CACHE_DIR jit            # jit over NamedSharding inputs (partitioned call),
                                                      # with jax_remove_custom_partitioning_ptr_from_cache_key
Compiles the program(s) with jax's persistent compilation cache in CACHE_DIR, checks the results
against the single-device reference, and prints the cache entries of our programs. The `jit` mode
compiles two programs that differ only in the softmax_scale of the attention call: they
must get two entries (softmax_scale 0.125 and 0.5), and a second process must read both back with the right results."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax

cache_dir, mode = sys.argv[1], sys.argv[2]
jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

mesh = jax.make_mesh((2, 4), ("data", "model"))
spec = P("data", None, "model")
rng = np.random.default_rng(0)
q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((4, 64, 8, 64)), jnp.bfloat16), NamedSharding(mesh, spec))
           for _ in range(3))


def check(out, scale=None):
    want = fa4_jax.attention(*(jax.device_put(x, jax.devices()[0]) for x in (q, k, v)), causal=True,
                             softmax_scale=scale, implementation="xla")
    err = float(np.abs(np.asarray(out, np.float32) - np.asarray(want, np.float32)).max())
    assert err < 1e-2, (scale, err)


if mode == "shard_map":
    step = jax.jit(jax.shard_map(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation="xla"),
                                 mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    check(step(q, k, v))
else:
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)

    # Two programs with the same name (jax puts it in the entry's name) whose partitioned calls differ
    # only in softmax_scale, which changes neither shapes nor the sharding rule.
    for scale in (0.125, 0.5):
        def fa4_step(q, k, v, scale=scale):
            return fa4_jax.attention(q, k, v, causal=True, softmax_scale=scale, implementation="xla")

        check(jax.jit(fa4_step)(q, k, v), scale)
print("\n".join(sorted(n for n in os.listdir(cache_dir) if "lambda" in n or "fa4_step" in n)))
