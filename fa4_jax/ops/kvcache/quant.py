"""FP8 (e4m3) KV caches: the cache holds value / scale in float8_e4m3fn, attention reads fp8 * scale.

Serving engines' convention (vLLM `kv_cache_dtype="fp8"` with `k_scale` / `v_scale`): one float32
scale per cache tensor, or one per KV head. `update_kvcache` quantizes new tokens as

    q = float8_e4m3fn(clip(float32(x) * float32(1 / scale), -448, 448))     (round to nearest even)

-- the product by the reciprocal, not a division: XLA's float32 division is not correctly rounded on
every backend, a product is, so the same inputs give the same cache bytes on CPU and GPU. Saturation
keeps finite inputs finite (e4m3fn has no infinity: an unclipped overflow would become NaN); a NaN
input stays NaN. `dequantize` is float32(q) * scale, exact in float32 (a 4-bit significand times a
24-bit one).

Scales: None (= 1.0), a Python or NumPy number, or a float32 array of shape () or (heads_kv,),
traced values allowed (calibrated scales live in model state). Positive and finite: checked for
Python and NumPy values, the caller's contract for jax arrays (checking one would sync the device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # the largest finite e4m3fn value


def is_fp8(x) -> bool:
    return jnp.dtype(x.dtype) == FP8


def check_scale(name: str, scale, heads_kv: int) -> jax.Array:
    """The scale as a float32 array of shape () or (heads_kv,): None -> 1.0."""
    if scale is None:
        return jnp.ones((), jnp.float32)
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{name} must be a float32 scale (a number, or an array of shape () or (heads_kv,)); "
                        f"got {name}={scale!r}")
    shape = tuple(np.shape(scale))
    dtype = jnp.dtype(scale.dtype if hasattr(scale, "dtype") else np.asarray(scale).dtype)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name} must be a real number or float32 array; got dtype {dtype.name}")
    if shape not in ((), (heads_kv,)):
        raise ValueError(f"{name} must be a scalar or have shape (heads_kv,) = ({heads_kv},); got shape {shape}")
    if isinstance(scale, (int, float, np.ndarray, np.generic)):  # host values; a jax array is not synced
        concrete = np.asarray(scale, np.float64)
        if not (np.all(np.isfinite(concrete)) and np.all(concrete > 0)):
            raise ValueError(f"{name} must be positive and finite; got {name}={concrete.tolist()!r}")
    return jnp.asarray(scale, jnp.float32)


def _per_head(scale: jax.Array) -> jax.Array:
    """A () or (heads_kv,) scale broadcastable against (..., heads_kv, head_dim)."""
    return scale if scale.ndim == 0 else scale[:, None]


def quantize(x, scale: jax.Array) -> jax.Array:
    """x (..., heads_kv, head_dim) in any float dtype -> float8_e4m3fn value / scale (module docstring)."""
    inv = _per_head(jnp.float32(1.0) / scale)
    return jnp.clip(jnp.asarray(x).astype(jnp.float32) * inv, -FP8_MAX, FP8_MAX).astype(FP8)


def dequantize(x, scale: jax.Array) -> jax.Array:
    """float8_e4m3fn (..., heads_kv, head_dim) -> float32 value * scale."""
    return jnp.asarray(x).astype(jnp.float32) * _per_head(scale)


def check_fp8_caches(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are FP8 (both or neither: a clear error otherwise); scales only with FP8."""
    fp8 = (is_fp8(k_cache), is_fp8(v_cache))
    if fp8[0] != fp8[1]:
        raise TypeError(f"k_cache and v_cache must both be float8_e4m3fn or neither; got "
                        f"k_cache {jnp.dtype(k_cache.dtype).name}, v_cache {jnp.dtype(v_cache.dtype).name}")
    if not fp8[0] and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale and v_scale apply to float8_e4m3fn caches only; the caches are "
                         f"{jnp.dtype(k_cache.dtype).name}")
    return fp8[0]
