"""One process of tests/test_sharding.py's compilation-cache check: compiles a shard_map program
that calls fa4_jax.attention on 8 host devices with jax's persistent compilation cache in argv[1],
then prints the cache entries."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

mesh = jax.make_mesh((2, 4), ("data", "model"))
spec = P("data", None, "model")
q = jax.device_put(jnp.ones((4, 64, 8, 64), jnp.bfloat16), NamedSharding(mesh, spec))
step = jax.jit(jax.shard_map(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation="xla"),
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
jax.block_until_ready(step(q, q, q))
print("\n".join(sorted(n for n in os.listdir(sys.argv[1]) if "lambda" in n)))
