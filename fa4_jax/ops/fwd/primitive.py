"""The `fa4_fwd` primitive: one forward attention, two results (o, lse).

Operands: q, k, v and, when has_sinks, sinks (heads_q,) float32.
Params: softmax_scale (float), window_left / window_right (ints, causal folded in: causal is
(-1, 0)), softcap (float, 0 = off), has_sinks (bool), implementation ("fa4" | "xla" | "auto":
the API's None, resolved per platform when lowering).
Lowering: through the sharding rule (fa4_jax/sharding.py) into the per-shard primitive
`fa4_fwd_local`, which lowers (fa4_jax/lowering.py, per platform) to a typed-FFI custom call to the
AOT-built kernel library on CUDA when the kernel can serve the call, else to the pure-JAX reference.
The primitive is inference-only: JVP and transpose raise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import _compat, _platform, cudnn, sharding
from fa4_jax._validation import (
    check_flag,
    check_implementation,
    check_qkv,
    check_sinks,
    check_softcap,
    check_softmax_scale,
    check_window,
    dtype_tag,
)
from fa4_jax.families import FWD, FwdVariant, mask_kind
from fa4_jax.lowering import register_local_lowerings
from fa4_jax.reference import attention_reference

fa4_fwd_p = _compat.Primitive("fa4_fwd")
fa4_fwd_p.multiple_results = True

_NO_GRAD = (
    "fa4_jax is inference-only: differentiation of attention is not supported; "
    "use jax.nn.dot_product_attention for training"
)


def check_params(q, k, v, sinks=None, *, softmax_scale, window_left, window_right, softcap, has_sinks,
                 implementation) -> dict:
    """Validates operands and params; returns the params normalised to their static types."""
    check_qkv(q, k, v)
    has_sinks = check_flag("has_sinks", has_sinks)
    if has_sinks != (sinks is not None):
        raise ValueError(f"has_sinks={has_sinks} but sinks is {'absent' if sinks is None else 'given'}")
    check_sinks(sinks, q.shape[2])
    scale = check_softmax_scale(softmax_scale)
    left, right = check_window((window_left, window_right), causal=False)
    return dict(
        softmax_scale=scale,
        window_left=left,
        window_right=right,
        softcap=check_softcap(softcap, scale),
        has_sinks=has_sinks,
        implementation=check_implementation(implementation),
    )


def fa4_fwd(q, k, v, sinks=None, *, softmax_scale: float, window_left: int = -1, window_right: int = -1,
            softcap: float = 0.0, implementation: str):
    """Binds the primitive as is: no device or library checks (`fa4_jax.attention` does those).

    This is the internal path for tracing or exporting the kernel's custom call without a GPU.
    """
    params = check_params(q, k, v, sinks, softmax_scale=softmax_scale, window_left=window_left,
                          window_right=window_right, softcap=softcap, has_sinks=sinks is not None,
                          implementation=implementation)
    operands = (q, k, v) if sinks is None else (q, k, v, sinks)
    return tuple(fa4_fwd_p.bind(*operands, **params))


def _abstract_eval(q, k, v, *sinks, **params):
    check_params(q, k, v, *sinks, **params)
    b, s_q, h_q, _ = q.shape
    return (
        _compat.ShapedArray(q.shape, q.dtype),
        _compat.ShapedArray((b, h_q, s_q), jnp.float32),
    )


fa4_fwd_p.def_abstract_eval(_abstract_eval)

# The per-shard primitive: fa4_fwd_p lowers through the sharding rule (fa4_jax/sharding.py) into
# this one, whose lowering is the kernel call (CUDA) or the reference.
fa4_fwd_local_p = _compat.Primitive("fa4_fwd_local")
fa4_fwd_local_p.multiple_results = True
fa4_fwd_local_p.def_abstract_eval(_abstract_eval)


def define_jitted_impl(prim) -> None:
    """Eager calls of `prim` compile the same way jitted ones do: one cached executable per param set
    and per setting of the environment switches the lowering reads (FA4_JAX_DISABLE_KERNELS,
    FA4_JAX_DISABLE_CUDNN), so flipping one in a running process takes effect for eager calls too."""

    @functools.lru_cache(maxsize=None)
    def jitted(switches, **params):
        del switches  # part of the cache key only
        return jax.jit(functools.partial(prim.bind, **params))

    def impl(*operands, **params):
        switches = (_platform.kernels_disabled(), cudnn.cudnn_disabled())
        return jitted(switches, **params)(*operands)

    prim.def_impl(impl)


define_jitted_impl(fa4_fwd_p)


def _reference(q, k, v, *sinks, softmax_scale, window_left, window_right, softcap, has_sinks, implementation):
    del implementation, has_sinks
    return attention_reference(q, k, v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                               softcap=softcap, sinks=sinks[0] if sinks else None)


def kernel_variant(arch: str, dtype, head_dim: int, params: dict) -> FwdVariant:
    """The kernel a call with these params needs on `arch` (the API and the lowering ask the same)."""
    return FwdVariant(arch, dtype_tag(dtype), head_dim, mask_kind(params["window_left"], params["window_right"]),
                      params["softcap"] > 0)


def _kernel_call(q, k, v, *sinks, softmax_scale, window_left, window_right, softcap, has_sinks, implementation):
    del has_sinks, implementation
    b, s_q, h_q, _ = q.shape
    # The kernel always takes a sinks operand: -inf logits add exp(-inf) = 0 to every denominator.
    sinks = sinks[0].astype(jnp.float32) if sinks else jnp.full((h_q,), -jnp.inf, jnp.float32)
    call = jax.ffi.ffi_call(
        FWD.target,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h_q, s_q), jnp.float32)),
    )
    # Attribute types are part of the FFI ABI (ffi/fwd.cc): f32 scale and cap, i32 window bounds.
    return call(q, k, v, sinks, softmax_scale=np.float32(softmax_scale), softcap=np.float32(softcap),
                window_left=np.int32(window_left), window_right=np.int32(window_right))


def _is_empty(avals, params) -> bool:
    """No batch, no query or no key: the reference answers (empty outputs, or rows that see no key)."""
    q, k = avals[0], avals[1]
    return any(isinstance(d, int) and d == 0 for d in (q.shape[0], q.shape[1], k.shape[1]))


register_local_lowerings(fa4_fwd_local_p, reference=_reference, kernel=_kernel_call, is_empty=_is_empty,
                         variant=kernel_variant)
sharding.register(fa4_fwd_p, fa4_fwd_local_p, *sharding.fwd_rules)


# --------------------------------------------------------------------------------------------------
# vmap


def _moved(x, d, size):
    """x with its mapped axis first (broadcast when unmapped)."""
    return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)


def _batch_rule(args, dims, **params):
    """vmap in one kernel launch, never a loop.

    - K and V unbatched (a shared KV cache, vmapped queries): the mapped axis joins the query heads
      of each KV group, so K/V are read once and never copied.
    - Otherwise, sinks unbatched: the mapped axis folds into the batch axis (a reshape).
    - Otherwise (per-slice sinks): the mapped axis folds into the heads of q, k, v and sinks alike.
    """
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    q, k, v = args[:3]
    dq, dk, dv = dims[:3]
    sinks, ds = (args[3], dims[3]) if params["has_sinks"] else (None, None)
    if dk is None and dv is None:
        return _fold_into_heads_shared_kv(size, q, dq, k, v, sinks, ds, params)
    if ds is None:
        folded = [_moved(x, d, size) for x, d in zip((q, k, v), (dq, dk, dv))]
        folded = [x.reshape(size * x.shape[1], *x.shape[2:]) for x in folded]
        extra = () if sinks is None else (sinks,)
        o, lse = fa4_fwd_p.bind(*folded, *extra, **params)
        return (o.reshape(size, -1, *o.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (0, 0)
    q, k, v = (_moved(x, d, size) for x, d in zip((q, k, v), (dq, dk, dv)))
    n, b, s_q, h_q, d = q.shape

    def heads(x):  # (n, b, s, h, d) -> (b, s, n * h, d): slice i's head h becomes head i * h + h
        return jnp.moveaxis(x, 0, 2).reshape(x.shape[1], x.shape[2], n * x.shape[3], x.shape[4])

    o, lse = fa4_fwd_p.bind(heads(q), heads(k), heads(v), _moved(sinks, ds, size).reshape(n * h_q), **params)
    o = jnp.moveaxis(o.reshape(b, s_q, n, h_q, d), 2, 0)
    lse = jnp.moveaxis(lse.reshape(b, n, h_q, s_q), 1, 0)
    return (o, lse), (0, 0)


def _fold_into_heads_shared_kv(size, q, dq, k, v, sinks, ds, params):
    q = _moved(q, dq, size)
    n, b, s_q, h_q, d = q.shape
    h_k = k.shape[2]
    g = h_q // h_k
    # Query head h of slice i reads KV head h // g. Ordering the folded heads (kv head, slice, group
    # member) keeps that: folded head (j * n + i) * g + r reads KV head j = folded // (n * g).
    qf = q.reshape(n, b, s_q, h_k, g, d).transpose(1, 2, 3, 0, 4, 5).reshape(b, s_q, h_k * n * g, d)
    extra = ()
    if sinks is not None:
        sf = _moved(sinks, ds, size).reshape(n, h_k, g).transpose(1, 0, 2).reshape(h_k * n * g)
        extra = (sf,)
    o, lse = fa4_fwd_p.bind(qf, k, v, *extra, **params)
    o = o.reshape(b, s_q, h_k, n, g, d).transpose(3, 0, 1, 2, 4, 5).reshape(n, b, s_q, h_q, d)
    lse = lse.reshape(b, h_k, n, g, s_q).transpose(2, 0, 1, 3, 4).reshape(n, b, h_q, s_q)
    return (o, lse), (0, 0)


_compat.register_batching(fa4_fwd_p, _batch_rule)


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(_NO_GRAD)


def _no_transpose(cotangents, *args, **params):
    raise NotImplementedError(_NO_GRAD)


def register_inference_only(prim) -> None:
    """JVP and transpose of `prim` raise: fa4_jax is forward-only."""
    _compat.register_jvp(prim, _no_jvp)
    _compat.register_transpose(prim, _no_transpose)


register_inference_only(fa4_fwd_p)
