"""Argument checks shared by the public API, the primitive's shape rule and the reference.

One function, so that `attention()` (which must fail before anything is traced or launched) and the
primitive's abstract evaluation (which guards direct `bind` calls) cannot disagree.
Works on anything with `.shape` and `.dtype`: arrays, tracers, `ShapedArray`, `ShapeDtypeStruct`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from fa4_jax.families import HEAD_DIMS

# The kernels are compiled for these input dtypes only (see fa4_jax.families.DTYPES).
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
IMPLEMENTATIONS = ("fa4", "xla")


def dtype_tag(dtype) -> str:
    """The FwdVariant spelling of a kernel dtype."""
    return {"bfloat16": "bf16", "float16": "fp16"}[jnp.dtype(dtype).name]


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be a Python bool; got {name}={value!r}. Under jax.jit, mark it static "
            f"(static_argnames=({name!r}, ...))."
        )
    return bool(value)


def check_softmax_scale(softmax_scale) -> float:
    """Returns the scale as a Python float: it becomes a static primitive parameter."""
    static_hint = (
        "Under jax.jit, pass it as a static argument (static_argnames=('softmax_scale', ...)) or leave "
        "it None for 1/sqrt(head_dim)."
    )
    if isinstance(softmax_scale, (bool, np.bool_, str, bytes)) or softmax_scale is None:
        raise TypeError(f"softmax_scale must be a Python float; got {softmax_scale!r}. {static_hint}")
    if np.ndim(softmax_scale) != 0:
        raise TypeError(f"softmax_scale must be a scalar; got shape {np.shape(softmax_scale)}")
    try:
        scale = float(softmax_scale)  # concrete NumPy/JAX scalars are fine; tracers are not
    except TypeError as e:  # includes jax.errors.ConcretizationTypeError
        raise TypeError(
            f"softmax_scale must be known at trace time, not a traced value ({type(softmax_scale).__name__}). "
            + static_hint
        ) from e
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be finite and > 0; got {softmax_scale=}")
    return scale


def check_implementation(implementation) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation=}")
    return implementation


def check_qkv(q, k, v, *, kernel_constraints: bool = True) -> None:
    """Raises TypeError/ValueError naming the offending argument.

    kernel_constraints=False relaxes dtype to any float and head_dim to any size: the pure-JAX
    reference accepts those (e.g. float32 inputs for an accuracy oracle); the kernel and the API do not.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array with .shape and .dtype; got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 (batch, seqlen, heads, head_dim); got {name}.shape={tuple(x.shape)}"
            )
        if any(d < 1 for d in x.shape):
            raise ValueError(f"every dimension of {name} must be >= 1; got {name}.shape={tuple(x.shape)}")
        dtype = jnp.dtype(x.dtype)
        if kernel_constraints and dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float16; got {name}.dtype={dtype.name}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array; got {name}.dtype={dtype.name}")

    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype; got q.dtype={jnp.dtype(q.dtype).name}, "
            f"k.dtype={jnp.dtype(k.dtype).name}, v.dtype={jnp.dtype(v.dtype).name}"
        )

    (b, _, h_q, d), (b_k, s_k, h_k, d_k) = q.shape, k.shape
    if not (d == d_k == v.shape[3]):
        raise ValueError(
            f"q, k and v must share head_dim (last axis); got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if kernel_constraints and d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}; got head_dim={d} (q.shape={tuple(q.shape)})")
    if not (b == b_k == v.shape[0]):
        raise ValueError(
            f"q, k and v must share the batch size (axis 0); got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"k and v must have the same shape (batch, seqlen_k, heads_kv, head_dim); "
            f"got k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if h_q % h_k != 0:
        raise ValueError(
            f"query heads must be a multiple of key/value heads (GQA/MQA); got heads_q={h_q}, heads_kv={h_k}"
        )
