"""The `fa4_fwd` primitive: one forward attention, two results (o, lse).

Params: softmax_scale (float), causal (bool), implementation ("fa4" | "xla").
Lowering: on CUDA with implementation="fa4" a typed-FFI custom call to the AOT-built kernel
library; everywhere else (CPU, or "xla") the pure-JAX reference, so a function traced for the
kernel still runs if it ends up compiled for another platform.
The primitive is inference-only: JVP and transpose raise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import _compat
from fa4_jax._validation import check_flag, check_implementation, check_qkv, check_softmax_scale
from fa4_jax.families import FWD
from fa4_jax.reference import attention_reference

fa4_fwd_p = _compat.Primitive("fa4_fwd")
fa4_fwd_p.multiple_results = True

_NO_GRAD = (
    "fa4_jax is inference-only: differentiation of attention is not supported; "
    "use jax.nn.dot_product_attention for training"
)


def check_params(q, k, v, *, softmax_scale, causal, implementation) -> dict:
    """Validates operands and params; returns the params normalised to their static types."""
    check_qkv(q, k, v)
    return dict(
        softmax_scale=check_softmax_scale(softmax_scale),
        causal=check_flag("causal", causal),
        implementation=check_implementation(implementation),
    )


def fa4_fwd(q, k, v, *, softmax_scale: float, causal: bool, implementation: str):
    """Binds the primitive as is: no device or library checks (`fa4_jax.attention` does those).

    This is the internal path for tracing or exporting the kernel's custom call without a GPU.
    """
    params = check_params(q, k, v, softmax_scale=softmax_scale, causal=causal, implementation=implementation)
    return tuple(fa4_fwd_p.bind(q, k, v, **params))


def _abstract_eval(q, k, v, *, softmax_scale, causal, implementation):
    check_params(q, k, v, softmax_scale=softmax_scale, causal=causal, implementation=implementation)
    b, s_q, h_q, _ = q.shape
    return (
        _compat.ShapedArray(q.shape, q.dtype),
        _compat.ShapedArray((b, h_q, s_q), jnp.float32),
    )


fa4_fwd_p.def_abstract_eval(_abstract_eval)


@functools.lru_cache(maxsize=None)
def _jitted(softmax_scale, causal, implementation):
    return jax.jit(
        functools.partial(fa4_fwd_p.bind, softmax_scale=softmax_scale, causal=causal, implementation=implementation)
    )


def _impl(q, k, v, *, softmax_scale, causal, implementation):
    # Eager calls compile the same way jitted ones do; one cached executable per param set.
    return _jitted(softmax_scale, causal, implementation)(q, k, v)


fa4_fwd_p.def_impl(_impl)


def _reference(q, k, v, *, softmax_scale, causal, implementation):
    del implementation
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)


_reference_lowering = _compat.lower_fun(_reference, multiple_results=True)


def _cuda_lowering(ctx, q, k, v, *, softmax_scale, causal, implementation):
    if implementation != "fa4":
        return _reference_lowering(ctx, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   implementation=implementation)
    # Attribute types are part of the FFI ABI: the handler binds causal as bool (i1), scale as f32.
    return _compat.ffi_lowering(FWD.target)(
        ctx, q, k, v, causal=bool(causal), softmax_scale=np.float32(softmax_scale)
    )


_compat.register_lowering(fa4_fwd_p, _reference_lowering)
_compat.register_lowering(fa4_fwd_p, _cuda_lowering, platform="cuda")


def _batch_rule(args, dims, **params):
    """vmap folds the mapped axis into the batch axis: one bigger launch, not a loop."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    folded = []
    for x, d in zip(args, dims):
        # Unbatched operands have no mapped axis (dim None) and are shared by every vmapped slice.
        x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        folded.append(x.reshape(size * x.shape[1], *x.shape[2:]))
    o, lse = fa4_fwd_p.bind(*folded, **params)
    return (o.reshape(size, -1, *o.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (0, 0)


_compat.register_batching(fa4_fwd_p, _batch_rule)


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(_NO_GRAD)


def _no_transpose(cotangents, *args, **params):
    raise NotImplementedError(_NO_GRAD)


_compat.register_jvp(fa4_fwd_p, _no_jvp)
_compat.register_transpose(fa4_fwd_p, _no_transpose)
