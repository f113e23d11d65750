"""The `fa4_varlen` primitive: attention over packed variable-length sequences, results (o, lse).

Operands: q (total_q, h_q, d), k, v (total_k, h_k, d), cu_seqlens_q, cu_seqlens_k, then seqused_k
when `has_seqused`, then sinks when `has_sinks`. Params: softmax_scale, window_left / window_right
(causal folded in), softcap, has_seqused, has_sinks, max_seqlen_q (0 = unknown: total_q bounds it),
implementation. Lowering (fa4_jax/core/lowering.py, per platform): on CUDA, when the kernel can serve the
call, the family's FFI call (ffi/varlen.cc); otherwise the pure-JAX reference. Sharding:
fa4_jax/ops/varlen/sharding.py. vmap: one launch (see _batch_rule). Inference only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fa4_jax.core import compat, cudnn
from fa4_jax.core.ffi_call import kernel_call
from fa4_jax.core.primitive import OperandLayout, moved, primitive_pair, register
from fa4_jax.core.validation import check_sinks, check_varlen, dtype_tag
from fa4_jax.families import VarlenVariant, mask_kind
from fa4_jax.ops.varlen import sharding
from fa4_jax.ops.varlen.reference import attention_varlen_reference
from fa4_jax.ops.varlen.spec import VARLEN

OPERANDS = OperandLayout(VARLEN, {"seqused_k": "has_seqused", "sinks": "has_sinks"})
_NAMES = OPERANDS.names  # q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks


def _split(operands, has_seqused: bool, has_sinks: bool):
    named = OPERANDS.split(operands, dict(has_seqused=has_seqused, has_sinks=has_sinks))
    return tuple(named[n] for n in _NAMES)


def _join(*xs):
    return OPERANDS.join(dict(zip(_NAMES, xs)))


def _abstract_eval(*operands, **params):
    """The operands the params say, with the shapes the API checks (a direct bind gets the same errors)."""
    x = OPERANDS.split(operands, params)
    q = x["q"]
    check_varlen(q, x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"], x["seqused_k"], kernel_constraints=False)
    check_sinks(x["sinks"], q.shape[1])
    total_q, h_q, _ = q.shape
    return (compat.ShapedArray(q.shape, q.dtype), compat.ShapedArray((h_q, total_q), jnp.float32))


fa4_varlen_p, fa4_varlen_local_p = primitive_pair("fa4_varlen", _abstract_eval)


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
    named = OPERANDS.split(operands, dict(has_seqused=has_seqused, has_sinks=has_sinks))
    cu_k = named["cu_seqlens_k"]
    if named["seqused_k"] is None:  # the kernel always reads seqused_k: every sequence's own keys
        named["seqused_k"] = cu_k[1:] - cu_k[:-1]
    return kernel_call(VARLEN, named, dict(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left,
                                           window_right=window_right,
                                           max_seqlen_q=_grid_rows(named["q"].shape[0], max_seqlen_q)),
                       opt_in=implementation == "fa4")


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


def _batch_rule(args, dims, *, has_seqused, has_sinks, max_seqlen_q, **params):
    """One kernel launch: slice i's packed tokens follow slice i-1's, its offsets shift by i * total,
    and the rows between its last sequence's end and the next slice become a sequence with no keys
    (o = 0 there, as for rows past cu_seqlens_q[-1] of one call). Per-slice sinks: a sequential map."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    kw = dict(has_seqused=has_seqused, has_sinks=has_sinks, **params)
    q, k, v, cu_q, cu_k, used, sinks = (None if x is None else moved(x, d, size)
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


register(fa4_varlen_p, fa4_varlen_local_p, reference=_reference, kernel=_kernel_call, variant=kernel_variant,
         is_empty=_is_empty, sharding_rules=sharding.RULES, batch_rule=_batch_rule, cudnn_entry=cudnn.VARLEN,
         shape_reason=_symbolic_reason)
