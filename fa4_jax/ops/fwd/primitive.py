"""The `fa4_fwd` primitive: one forward attention, two results (o, lse).

Operands: q, k, v and, when has_sinks, sinks (heads_q,) float32.
Params: softmax_scale (float), window_left / window_right (ints, causal folded in: causal is
(-1, 0)), softcap (float, 0 = off), has_sinks (bool), implementation ("fa4" | "xla" | "auto":
the API's None, resolved per platform when lowering).
Lowering: through the sharding rule (fa4_jax/ops/fwd/sharding.py) into the per-shard primitive
`fa4_fwd_local`, which lowers (fa4_jax/core/lowering.py, per platform) to the family's FFI call
(fa4_jax/core/ffi_call.py) on CUDA when the kernel can serve the call, else to the pure-JAX
reference. The primitive is inference-only: JVP and transpose raise.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa4_jax.core import compat, cudnn
from fa4_jax.core.ffi_call import kernel_call
from fa4_jax.core.primitive import OperandLayout, fold_query_slices, moved, primitive_pair, register
from fa4_jax.core.validation import check_flag, check_implementation, check_qkv, check_sinks, check_softcap
from fa4_jax.core.validation import check_softmax_scale, check_window, dtype_tag
from fa4_jax.families import FWD, FwdVariant, mask_kind
from fa4_jax.ops.fwd import sharding
from fa4_jax.ops.fwd.reference import attention_reference

OPERANDS = OperandLayout(FWD, {"sinks": "has_sinks"})


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
    return tuple(fa4_fwd_p.bind(*OPERANDS.join(dict(q=q, k=k, v=v, sinks=sinks)), **params))


def _abstract_eval(*operands, **params):
    x = OPERANDS.split(operands, params)
    check_params(x["q"], x["k"], x["v"], x["sinks"], **params)
    b, s_q, h_q, _ = x["q"].shape
    return (
        compat.ShapedArray(x["q"].shape, x["q"].dtype),
        compat.ShapedArray((b, h_q, s_q), jnp.float32),
    )


fa4_fwd_p, fa4_fwd_local_p = primitive_pair("fa4_fwd", _abstract_eval)


def _reference(q, k, v, *sinks, softmax_scale, window_left, window_right, softcap, has_sinks, implementation):
    del implementation, has_sinks
    return attention_reference(q, k, v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                               softcap=softcap, sinks=sinks[0] if sinks else None)


def kernel_variant(arch: str, dtype, head_dim: int, params: dict) -> FwdVariant:
    """The kernel a call with these params needs on `arch` (the API and the lowering ask the same)."""
    return FwdVariant(arch, dtype_tag(dtype), head_dim, mask_kind(params["window_left"], params["window_right"]),
                      params["softcap"] > 0)


def _kernel_call(*operands, softmax_scale, window_left, window_right, softcap, has_sinks, implementation):
    named = OPERANDS.split(operands, dict(has_sinks=has_sinks))
    return kernel_call(FWD, named, dict(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left,
                                        window_right=window_right), opt_in=implementation == "fa4")


def _is_empty(avals, params) -> bool:
    """No batch, no query or no key: the reference answers (empty outputs, or rows that see no key)."""
    q, k = avals[0], avals[1]
    return any(isinstance(d, int) and d == 0 for d in (q.shape[0], q.shape[1], k.shape[1]))


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
        qf, sf, unfold = fold_query_slices(q, dq, sinks, ds, size, k.shape[2])
        return unfold(*fa4_fwd_p.bind(*OPERANDS.join(dict(q=qf, k=k, v=v, sinks=sf)), **params)), (0, 0)
    if ds is None:
        folded = [moved(x, d, size) for x, d in zip((q, k, v), (dq, dk, dv))]
        folded = [x.reshape(size * x.shape[1], *x.shape[2:]) for x in folded]
        extra = () if sinks is None else (sinks,)
        o, lse = fa4_fwd_p.bind(*folded, *extra, **params)
        return (o.reshape(size, -1, *o.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (0, 0)
    q, k, v = (moved(x, d, size) for x, d in zip((q, k, v), (dq, dk, dv)))
    n, b, s_q, h_q, d = q.shape

    def heads(x):  # (n, b, s, h, d) -> (b, s, n * h, d): slice i's head h becomes head i * h + h
        return jnp.moveaxis(x, 0, 2).reshape(x.shape[1], x.shape[2], n * x.shape[3], x.shape[4])

    o, lse = fa4_fwd_p.bind(heads(q), heads(k), heads(v), moved(sinks, ds, size).reshape(n * h_q), **params)
    o = jnp.moveaxis(o.reshape(b, s_q, n, h_q, d), 2, 0)
    lse = jnp.moveaxis(lse.reshape(b, n, h_q, s_q), 1, 0)
    return (o, lse), (0, 0)


register(fa4_fwd_p, fa4_fwd_local_p, reference=_reference, kernel=_kernel_call, variant=kernel_variant,
         is_empty=_is_empty, sharding_rules=sharding.RULES, batch_rule=_batch_rule, cudnn_entry=cudnn.ATTENTION)
