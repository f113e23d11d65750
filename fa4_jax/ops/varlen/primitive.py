"""The `fa4_varlen` primitive: attention over packed variable-length sequences, results (o, lse).

Operands: q (total_q, h_q, d), k, v (total_k, h_k, d), cu_seqlens_q, cu_seqlens_k, then seqused_k
when `has_seqused`, then sinks when `has_sinks`. Params: softmax_scale, window_left / window_right
(causal folded in), softcap, has_seqused, has_sinks, max_seqlen_q (0 = unknown: total_q bounds it),
implementation. Lowering (fa4_jax/lowering.py, per platform): on CUDA, when the kernel can serve the call, a typed-FFI
custom call (ffi/varlen.cc); otherwise the pure-JAX reference. vmap: one launch (see _batch_rule). Inference only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import _compat, sharding
from fa4_jax._validation import dtype_tag
from fa4_jax.families import VarlenVariant, mask_kind
from fa4_jax.families.varlen import VARLEN
from fa4_jax.lowering import register_local_lowerings
from fa4_jax.primitive import _moved, define_jitted_impl, register_inference_only
from fa4_jax.reference import attention_varlen_reference

fa4_varlen_p = _compat.Primitive("fa4_varlen")
fa4_varlen_p.multiple_results = True


def _split(operands, has_seqused: bool, has_sinks: bool):
    q, k, v, cu_q, cu_k, *rest = operands
    return q, k, v, cu_q, cu_k, (rest[0] if has_seqused else None), (rest[-1] if has_sinks else None)


def _join(*xs):
    return tuple(x for x in xs if x is not None)


def _abstract_eval(q, *operands, **params):
    total_q, h_q, _ = q.shape
    return (_compat.ShapedArray(q.shape, q.dtype), _compat.ShapedArray((h_q, total_q), jnp.float32))


fa4_varlen_p.def_abstract_eval(_abstract_eval)

# The per-shard primitive (see fa4_jax/sharding.py): fa4_varlen_p lowers through the sharding rule into it.
fa4_varlen_local_p = _compat.Primitive("fa4_varlen_local")
fa4_varlen_local_p.multiple_results = True
fa4_varlen_local_p.def_abstract_eval(_abstract_eval)


define_jitted_impl(fa4_varlen_p)


def _reference(*operands, softmax_scale, window_left, window_right, softcap, has_seqused, has_sinks, max_seqlen_q,
               implementation):
    del max_seqlen_q, implementation
    q, k, v, cu_q, cu_k, used, sinks = _split(operands, has_seqused, has_sinks)
    return attention_varlen_reference(q, k, v, cu_q, cu_k, seqused_k=used, softmax_scale=softmax_scale,
                                      window_size=(window_left, window_right), softcap=softcap, sinks=sinks)


def kernel_variant(arch: str, dtype, head_dim: int, params: dict) -> VarlenVariant:
    """The kernel a call with these params needs on `arch` (the API and the lowering ask the same)."""
    return VarlenVariant(arch, dtype_tag(dtype), head_dim, mask_kind(params["window_left"], params["window_right"]),
                         params["softcap"] > 0)


def _kernel_call(*operands, softmax_scale, window_left, window_right, softcap, has_seqused, has_sinks, max_seqlen_q,
                 implementation):
    del implementation
    q, k, v, cu_q, cu_k, used, sinks = _split(operands, has_seqused, has_sinks)
    total_q, h_q, _ = q.shape
    used = cu_k[1:] - cu_k[:-1] if used is None else used
    sinks = jnp.full((h_q,), -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(
        VARLEN.target,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((h_q, total_q), jnp.float32)),
    )
    return call(q, k, v, cu_q, cu_k, used, sinks, softmax_scale=np.float32(softmax_scale),
                softcap=np.float32(softcap), window_left=np.int32(window_left), window_right=np.int32(window_right),
                max_seqlen_q=np.int32(_grid_rows(total_q, max_seqlen_q)))


def _grid_rows(total_q, max_seqlen_q: int) -> int:
    """The static bound on a sequence's queries that sizes the grid (the handler clamps it to total_q)."""
    if not isinstance(total_q, int):  # symbolic: _symbolic_reason made sure a hint is given
        return max_seqlen_q
    return min(max_seqlen_q, total_q) if max_seqlen_q else total_q


def _symbolic_reason(avals, params) -> str | None:
    """The kernel's grid needs a static bound on each sequence's queries: total_q, or the max_seqlen_q hint."""
    total_q = avals[0].shape[0]
    if isinstance(total_q, int) or params["max_seqlen_q"]:
        return None
    return (f"q has a symbolic number of tokens ({total_q}); the varlen kernel needs a static bound on each "
            "sequence's queries: pass max_seqlen_q")


def _is_empty(avals, params) -> bool:
    """No query, key, head or sequence: the reference answers without a launch."""
    q, k, cu_q = avals[0], avals[1], avals[3]
    return any(isinstance(x, int) and x == 0 for x in (*q.shape, *k.shape, cu_q.shape[0] - 1))


register_local_lowerings(fa4_varlen_local_p, reference=_reference, kernel=_kernel_call, is_empty=_is_empty,
                         variant=kernel_variant, shape_reason=_symbolic_reason)
sharding.register(fa4_varlen_p, fa4_varlen_local_p, *sharding.varlen_rules)


def _batch_rule(args, dims, *, has_seqused, has_sinks, max_seqlen_q, **params):
    """One kernel launch: slice i's packed tokens follow slice i-1's, its offsets shift by i * total,
    and the rows between its last sequence's end and the next slice become a sequence with no keys
    (o = 0 there, as for rows past cu_seqlens_q[-1] of one call). Per-slice sinks: a sequential map."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    kw = dict(has_seqused=has_seqused, has_sinks=has_sinks, **params)
    q, k, v, cu_q, cu_k, used, sinks = (None if x is None else _moved(x, d, size)
                                        for x, d in zip(_split(args, has_seqused, has_sinks),
                                                        _split(dims, has_seqused, has_sinks)))
    if sinks is not None and _split(dims, has_seqused, has_sinks)[-1] is not None:
        o, lse = jax.lax.map(lambda xs: tuple(fa4_varlen_p.bind(*_join(*xs), max_seqlen_q=max_seqlen_q, **kw)),
                             (q, k, v, cu_q, cu_k, used, sinks))
        return (o, lse), (0, 0)
    if sinks is not None:
        sinks = sinks[0]
    n, total_q = q.shape[:2]
    total_k = k.shape[1]
    i = jnp.arange(n, dtype=jnp.int32)[:, None]
    used = cu_k[:, 1:] - cu_k[:, :-1] if used is None else used
    # Per slice: its b sequences, then the gap sequence [cu_q[b], total_q) with no keys.
    cu_qf = jnp.concatenate([cu_q + i * total_q], axis=1).reshape(-1)
    cu_qf = jnp.concatenate([cu_qf, jnp.array([n * total_q], jnp.int32)])
    cu_kf = jnp.concatenate([(cu_k + i * total_k).reshape(-1), jnp.array([n * total_k], jnp.int32)])
    used_f = jnp.concatenate([used, jnp.zeros((n, 1), jnp.int32)], axis=1).reshape(-1)
    o, lse = fa4_varlen_p.bind(
        *_join(q.reshape(n * total_q, *q.shape[2:]), k.reshape(n * total_k, *k.shape[2:]),
               v.reshape(n * total_k, *v.shape[2:]), cu_qf, cu_kf, used_f, sinks),
        max_seqlen_q=0, **dict(kw, has_seqused=True))
    return (o.reshape(n, total_q, *o.shape[1:]), jnp.moveaxis(lse.reshape(lse.shape[0], n, total_q), 1, 0)), (0, 0)


_compat.register_batching(fa4_varlen_p, _batch_rule)


register_inference_only(fa4_varlen_p)
