"""fa4_jax in one screen: causal GQA prefill, then one decode step against a KV cache, both checked
against a float32 oracle.

    python examples/quickstart.py            # after `pip install .`; in a checkout: PYTHONPATH=.

On an H100/H200 with the kernel library built this runs the FA4 kernel; anywhere else (CPU, other
GPUs) `fa4_jax.attention` falls back to its exact pure-JAX reference, and says so.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax


def implementation(jitted, *args) -> str:
    """What the compiled program runs: the kernel (its FFI call is in the HLO) or the XLA reference."""
    text = jitted.lower(*args).as_text()
    return "fa4 kernel" if any(t in text for t in fa4_jax.export.ffi_targets()) else "xla reference"


def main() -> int:
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    # A prefill-sized problem on a GPU, a small one on CPU so the demo stays at a few seconds.
    b, s, h_q, h_k, d = (4, 4096, 32, 8, 128) if on_gpu else (1, 512, 8, 2, 128)
    dtype = jnp.bfloat16

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, s, h_q, d), dtype=np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, h_k, d), dtype=np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, h_k, d), dtype=np.float32), dtype)

    attn = jax.jit(functools.partial(fa4_jax.attention, causal=True, return_lse=True))
    print(f"fa4_jax {fa4_jax.__version__} on {device.device_kind} ({device.platform}): {implementation(attn, q, k, v)}")
    print(f"q {q.shape} {q.dtype.name}, k/v {k.shape} (GQA {h_q // h_k}:1), causal")

    o, lse = jax.block_until_ready(attn(q, k, v))  # compiles
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(attn(q, k, v))
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    flops = 4 * b * h_q * s * s * d / 2  # causal: half the score matrix
    print(f"{t * 1e3:.2f} ms per call, {flops / t / 1e12:.2f} TFLOP/s")

    # Oracle: the same math on float32 copies of the inputs. The bar (FlashAttention's rule): our
    # error is at most twice that of the bf16 XLA reference, plus a small absolute slack.
    scale = 1 / np.sqrt(d)
    f32 = lambda x: x.astype(jnp.float32)
    o_ref32, lse_ref32 = fa4_jax.attention_reference(f32(q), f32(k), f32(v), causal=True, softmax_scale=scale)
    o_ref16, _ = fa4_jax.attention_reference(q, k, v, causal=True, softmax_scale=scale)
    err = float(jnp.max(jnp.abs(f32(o) - o_ref32)))
    ref_err = float(jnp.max(jnp.abs(f32(o_ref16) - o_ref32)))
    lse_err = float(jnp.max(jnp.abs(lse - lse_ref32)))
    print(f"max |o - o_fp32| = {err:.3e}  (bf16 reference: {ref_err:.3e});  max |lse - lse_fp32| = {lse_err:.3e}")

    ok = err <= 2 * ref_err + 1e-3 and lse_err <= 1e-2 and bool(jnp.all(jnp.isfinite(o)))

    # Decode: append one new token per sequence to a KV cache (in place under donation) and attend
    # with one new query per sequence (split-KV kernel on Hopper).
    capacity = s + 256
    k_cache = jnp.zeros((b, capacity, h_k, d), dtype).at[:, :s].set(k)
    v_cache = jnp.zeros((b, capacity, h_k, d), dtype).at[:, :s].set(v)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, 1, h_k, d), dtype=np.float32), dtype) for _ in range(2))
    q_new = jnp.asarray(rng.standard_normal((b, 1, h_q, d), dtype=np.float32), dtype)
    lens = jnp.full((b,), s, jnp.int32)
    k_cache, v_cache = jax.jit(fa4_jax.update_kvcache, donate_argnums=(0, 1))(k_cache, v_cache, k_new, v_new, lens)
    decode = jax.jit(functools.partial(fa4_jax.attention_with_kvcache, causal=True))
    new_lens = lens + 1
    impl = implementation(decode, q_new, k_cache, v_cache, new_lens)
    o1 = jax.block_until_ready(decode(q_new, k_cache, v_cache, new_lens))
    t0 = time.perf_counter()
    for _ in range(100):  # back to back, one block at the end (per-call wall clock is mostly dispatch)
        o1 = decode(q_new, k_cache, v_cache, new_lens)
    jax.block_until_ready(o1)
    t = (time.perf_counter() - t0) / 100
    k_all, v_all = (jnp.concatenate([x, x_new], axis=1) for x, x_new in ((k, k_new), (v, v_new)))
    o1_ref, _ = fa4_jax.attention_reference(f32(q_new), f32(k_all), f32(v_all), causal=True, softmax_scale=scale)
    o1_ref16, _ = fa4_jax.attention_reference(q_new, k_all, v_all, causal=True, softmax_scale=scale)
    err1 = float(jnp.max(jnp.abs(f32(o1) - o1_ref)))
    ref_err1 = float(jnp.max(jnp.abs(f32(o1_ref16) - o1_ref)))
    print(f"decode step ({impl}): {b} x {s + 1} cached keys, {t * 1e6:.0f} us per call; "
          f"max |o - o_fp32| = {err1:.3e} (bf16 reference: {ref_err1:.3e})")
    ok = ok and err1 <= 2 * ref_err1 + 1e-3 and bool(jnp.all(jnp.isfinite(o1)))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
