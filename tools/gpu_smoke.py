"""Quick kernel check on a Hopper GPU: a few shapes vs an fp32 reference, then one timing.

For kernel development between full test runs (one device call, a short table). Usage:
    PYTHONPATH=$PWD python tools/gpu_smoke.py [--time]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax
from fa4_jax.core import library as _ffi

CASES = [  # (dtype, b, s_q, s_k, h_q, h_k, d, causal)
    ("bf16", 1, 128, 128, 2, 2, 128, False),
    ("bf16", 2, 1000, 1000, 4, 2, 128, False),
    ("bf16", 2, 1000, 1000, 4, 2, 128, True),
    ("bf16", 1, 1, 1, 4, 1, 128, False),
    ("bf16", 1, 7, 7, 4, 4, 128, True),
    ("bf16", 1, 129, 300, 8, 1, 128, True),
    ("bf16", 1, 300, 129, 8, 1, 128, True),
    ("bf16", 1, 4097, 4097, 2, 2, 128, True),
    ("bf16", 1, 1, 4097, 8, 2, 128, False),
]


def ref32(q, k, v, causal, scale):
    """The package's reference on float32-upcast inputs: the fp32 oracle."""
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    return fa4_jax.attention_reference(*up, causal=causal, softmax_scale=scale)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    print("devices:", jax.devices(), "variants:", sorted(v.symbol for v in _ffi.compiled_variants()))
    rng = np.random.default_rng(0)
    for dt, b, sq, sk, hq, hk, d, causal in CASES:
        dtype = jnp.bfloat16 if dt == "bf16" else jnp.float16
        q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
        k = jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype)
        v = jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype)
        scale = d ** -0.5
        try:
            o, lse = fa4_jax.attention(q, k, v, causal=causal, return_lse=True, implementation="fa4")
            o = np.asarray(o.astype(jnp.float32)); lse = np.asarray(lse)
        except Exception as e:  # report and go on: one table per device call
            print(f"{dt} b{b} sq{sq} sk{sk} h{hq}/{hk} d{d} causal={causal}: ERROR {type(e).__name__}: {e}")
            continue
        ro, rl = (np.asarray(x) for x in ref32(q, k, v, causal, scale))
        xo = np.asarray(fa4_jax.attention(q, k, v, causal=causal, implementation="xla").astype(jnp.float32))
        err = np.nanmax(np.abs(o - ro)); xerr = np.max(np.abs(xo - ro))
        fin = np.isfinite(rl)
        lerr = np.max(np.abs(np.where(fin, lse - rl, 0))) if fin.any() else 0.0
        lse_inf_ok = np.array_equal(np.isneginf(lse), ~fin)
        bad_rows = np.argwhere(np.abs(o - ro).max(axis=(0, 2, 3)) > 2 * xerr + 1e-2)[:, 0]
        print(f"{dt} b{b} sq{sq} sk{sk} h{hq}/{hk} d{d} causal={causal}: err={err:.4f} xla_err={xerr:.4f} "
              f"nan={np.isnan(o).sum()} lse_err={lerr:.5f} lse_inf_ok={lse_inf_ok} "
              f"bad_rows={bad_rows[:8].tolist()}{'...' if len(bad_rows) > 8 else ''}")
    if args.time:
        for causal in (False, True):
            b, s, h, d = 2, 8192, 16, 128
            q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            fns = {
                "fa4": jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, implementation="fa4")),
                "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")),
            }
            res = {}
            for name, fn in fns.items():
                fn(q, k, v).block_until_ready()
                ts = []
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(20):
                        out = fn(q, k, v)
                    out.block_until_ready()
                    ts.append((time.perf_counter() - t) / 20)
                res[name] = flops / np.median(ts) / 1e12
            print(f"hd128 s8192 b2 h16 causal={causal}: fa4 {res['fa4']:.0f} TFLOP/s, cudnn {res['cudnn']:.0f}, ratio {res['fa4']/res['cudnn']:.2f}")


if __name__ == "__main__":
    main()
