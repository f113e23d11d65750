"""Exports one inference step that calls every fa4_jax entry point, as a CPU-only host would.

    JAX_PLATFORMS=cpu python tests/export_case.py OUT_DIR PLATFORMS   # PLATFORMS: "cuda" or "cpu,cuda"

Writes OUT_DIR/step.bin (the serialized jax.export artifact, traced with implementation=None and
fa4_jax.export_safety_checks()) and OUT_DIR/inputs.npz (fresh random inputs for it). Used by
tests/test_export.py on the CPU and by tests/test_gpu_export.py, which runs this in a CPU-only
subprocess and then deserializes and runs the artifact on the GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax

B, S, H_Q, H_K, D, CAP = 2, 197, 8, 2, 128, 640


def step(q, k, v, q1, k_cache, v_cache, lens, cu, sinks):
    """Prefill (causal GQA with sinks), a decode step against a cache, and a packed varlen call."""
    o = fa4_jax.attention(q, k, v, causal=True, sinks=sinks)
    o1 = fa4_jax.attention_with_kvcache(q1, k_cache, v_cache, lens, causal=True)
    t = q.shape[0] * q.shape[1]
    ov = fa4_jax.attention_varlen(q.reshape(t, H_Q, D), k.reshape(t, H_K, D), v.reshape(t, H_K, D), cu, cu,
                                  causal=True)
    return o, o1, ov


def inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    bf = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)  # noqa: E731
    return dict(q=bf(B, S, H_Q, D), k=bf(B, S, H_K, D), v=bf(B, S, H_K, D), q1=bf(B, 1, H_Q, D),
                k_cache=bf(B, CAP, H_K, D), v_cache=bf(B, CAP, H_K, D), lens=np.array([1, 600], np.int32),
                cu=np.array([0, 150, B * S], np.int32), sinks=rng.standard_normal(H_Q).astype(np.float32))


def main() -> int:
    out, platforms = Path(sys.argv[1]), tuple(sys.argv[2].split(","))
    args = inputs()
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args.values()]
    exported = jax.export.export(jax.jit(step), platforms=platforms,
                                 disabled_checks=fa4_jax.export_safety_checks())(*specs)
    (out / "step.bin").write_bytes(exported.serialize())
    np.savez(out / "inputs.npz", **{k: np.asarray(v, np.float32) if v.dtype == jnp.bfloat16 else v
                                    for k, v in args.items()})
    print(jax.devices()[0].platform, platforms, len(exported.mlir_module()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
