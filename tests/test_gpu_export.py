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
from accuracy import check_o_against_reference
from export_case import step
from gpu_menu import device_arch, validated
from oracle import attention_oracle
from test_export import export_from_cpu_host, kernel_calls
from fa4_jax.export import ffi_targets

pytestmark = [pytest.mark.gpu]


@pytest.mark.kernel_family("fwd", "kvcache", "varlen")
def test_cpu_host_export_runs_on_the_gpu(tmp_path, kernel_variants):
    if not validated():
        pytest.skip(f"{device_arch()}: a program exported with implementation=None may not run its unvalidated "
                    "kernels (test_cpu_host_export_refuses_unvalidated_kernels)")
    exported = export_from_cpu_host(tmp_path, "cuda")
    assert kernel_calls(exported) == sorted(ffi_targets())
    args = {k: jnp.asarray(v, jnp.bfloat16) if v.dtype == np.float32 and k != "sinks" else jnp.asarray(v)
            for k, v in np.load(tmp_path / "inputs.npz").items()}
    got = exported.call(*args.values())
    here = jax.jit(step)(*args.values())  # traced here, on the GPU: the same kernels
    for name, g, h in zip(("prefill", "decode", "varlen"), got, here):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32), err_msg=name)
    # ... and right: the accuracy rule (the step returns O only: the rule's O part) against the fp32
    # oracle, with the XLA path on the same inputs as the yardstick.
    xla = jax.jit(step_reference)(*args.values())
    for name, g, x, r in zip(("prefill", "decode", "varlen"), got, xla, step_oracle(*args.values())):
        check_o_against_reference(g, x, r, what=f"exported {name}")


def test_cpu_host_export_refuses_unvalidated_kernels(tmp_path, kernel_variants):
    # On a GPU whose kernels no hardware run has validated (families.VALIDATED_ARCHES), a program
    # exported with implementation=None did not opt in: the handler refuses with what to do instead
    # of running them (or of falling back, which it cannot do from inside the program).
    if validated():
        pytest.skip(f"{device_arch()}: validated, the exported program runs the kernels (the test above)")
    exported = export_from_cpu_host(tmp_path, "cuda")
    args = [jnp.asarray(v, jnp.bfloat16) if v.dtype == np.float32 and k != "sinks" else jnp.asarray(v)
            for k, v in np.load(tmp_path / "inputs.npz").items()]
    with pytest.raises(Exception, match=r"have not been validated on hardware yet; this call did not opt in\. "
                                        r"Lower or export the program with implementation=\"fa4\""):
        jax.block_until_ready(exported.call(*args))


def step_oracle(q, k, v, q1, k_cache, v_cache, lens, cu, sinks):
    """export_case.step by the fp32 oracle: prefill, each decode row over its valid keys, each packed
    sequence over its own keys (cu splits the flattened batch)."""
    d = q.shape[-1]
    o, _ = attention_oracle(q, k, v, causal=True, sinks=sinks, softmax_scale=d ** -0.5, xp=jnp)
    o1 = jnp.concatenate([attention_oracle(q1[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], causal=True,
                                           softmax_scale=d ** -0.5, xp=jnp)[0] for i, n in enumerate(np.asarray(lens))])
    t = q.shape[0] * q.shape[1]
    qf, kf, vf = (x.reshape(t, *x.shape[2:]) for x in (q, k, v))
    cu = np.asarray(cu)
    ov = jnp.concatenate([attention_oracle(*(x[None, cu[i]:cu[i + 1]] for x in (qf, kf, vf)), causal=True,
                                           softmax_scale=d ** -0.5, xp=jnp)[0][0] for i in range(len(cu) - 1)])
    return o, o1, ov


def step_reference(q, k, v, q1, k_cache, v_cache, lens, cu, sinks):
    o = fa4_jax.attention(q, k, v, causal=True, sinks=sinks, implementation="xla")
    o1 = fa4_jax.attention_with_kvcache(q1, k_cache, v_cache, lens, causal=True, implementation="xla")
    t = q.shape[0] * q.shape[1]
    ov = fa4_jax.attention_varlen(q.reshape(t, *q.shape[2:]), k.reshape(t, *k.shape[2:]), v.reshape(t, *v.shape[2:]),
                                  cu, cu, causal=True, implementation="xla")
    return o, o1, ov
