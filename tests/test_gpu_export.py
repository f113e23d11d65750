"""A program exported for CUDA on a CPU-only host runs on the GPU (`@pytest.mark.gpu`).

tests/export_case.py runs in a subprocess with JAX_PLATFORMS=cpu (as on a build host without a GPU)
and serializes an inference step that calls every entry point with implementation=None; this
process (where `import fa4_jax` registered the kernels) deserializes and runs it. The result must be
the kernels' (bitwise equal to calling fa4_jax here) and right (against the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from export_case import step
from test_export import export_from_cpu_host, kernel_calls
from fa4_jax.export import ffi_targets

pytestmark = pytest.mark.gpu


def test_cpu_host_export_runs_on_the_gpu(tmp_path):
    exported = export_from_cpu_host(tmp_path, "cuda")
    assert kernel_calls(exported) == sorted(ffi_targets())
    args = {k: jnp.asarray(v, jnp.bfloat16) if v.dtype == np.float32 and k != "sinks" else jnp.asarray(v)
            for k, v in np.load(tmp_path / "inputs.npz").items()}
    got = exported.call(*args.values())
    here = jax.jit(step)(*args.values())  # traced here, on the GPU: the same kernels
    for name, g, h in zip(("prefill", "decode", "varlen"), got, here):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32), err_msg=name)
    # ... and right: the XLA reference on the same inputs, within bf16 rounding of the output.
    ref = jax.jit(step_reference)(*args.values())
    for name, g, r in zip(("prefill", "decode", "varlen"), got, ref):
        err = np.abs(np.asarray(g, np.float32) - np.asarray(r, np.float32)).max()
        assert err < 2e-2, f"{name}: max |exported - reference| = {err}"


def step_reference(q, k, v, q1, k_cache, v_cache, lens, cu, sinks):
    o = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, implementation="xla")
    o1 = fa4_jax.attention_with_kvcache(q1, k_cache, v_cache, lens, causal=True, implementation="xla")
    t = q.shape[0] * q.shape[1]
    ov = fa4_jax.attention_varlen(q.reshape(t, *q.shape[2:]), k.reshape(t, *k.shape[2:]), v.reshape(t, *v.shape[2:]),
                                  cu, cu, causal=True, implementation="xla")
    return o, o1, ov
