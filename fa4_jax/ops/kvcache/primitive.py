"""The `fa4_kvcache` primitive: attention of new queries against a KV cache, two results (o, lse).

Operands: q, k_cache, v_cache, cache_seqlens, then page_table when `paged`, then sinks when
`has_sinks`. Params: softmax_scale, window_left / window_right (causal folded in), softcap,
has_sinks, paged, num_splits (0 = the handler picks from the SM count), implementation.
Lowering (fa4_jax/lowering.py, per platform): on CUDA, when the kernel can serve the call, a
typed-FFI custom call (ffi/kvcache.cc) whose extra float32 results are the split-KV workspace, sized
here (fa4_jax.families.kvcache); otherwise the pure-JAX reference. vmap: one kernel launch (see
_batch_rule). Inference only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax import _compat, sharding
from fa4_jax._validation import dtype_tag
from fa4_jax.families import KVCacheVariant, mask_kind
from fa4_jax.families.kvcache import KVCACHE, MAX_SPLITS, SPLIT_BLOCK_KEYS, auto_split_capacity
from fa4_jax.lowering import register_local_lowerings
from fa4_jax.primitive import _moved, define_jitted_impl, register_inference_only
from fa4_jax.reference import attention_with_kvcache_reference

fa4_kvcache_p = _compat.Primitive("fa4_kvcache")
fa4_kvcache_p.multiple_results = True


def _split(operands, paged: bool, has_sinks: bool):
    q, k, v, seqlens, *rest = operands
    page_table = rest[0] if paged else None
    sinks = rest[-1] if has_sinks else None
    return q, k, v, seqlens, page_table, sinks


def _join(q, k, v, seqlens, page_table, sinks):
    return tuple(x for x in (q, k, v, seqlens, page_table, sinks) if x is not None)


def _abstract_eval(*operands, paged, has_sinks, **params):
    q = operands[0]
    if len(operands) != 4 + paged + has_sinks:
        raise ValueError(f"fa4_kvcache takes {4 + paged + has_sinks} operands here, got {len(operands)}")
    b, s_q, h_q, _ = q.shape
    return (_compat.ShapedArray(q.shape, q.dtype), _compat.ShapedArray((b, h_q, s_q), jnp.float32))


fa4_kvcache_p.def_abstract_eval(_abstract_eval)

# The per-shard primitive (see fa4_jax/sharding.py): fa4_kvcache_p lowers through the sharding rule into it.
fa4_kvcache_local_p = _compat.Primitive("fa4_kvcache_local")
fa4_kvcache_local_p.multiple_results = True
fa4_kvcache_local_p.def_abstract_eval(_abstract_eval)


define_jitted_impl(fa4_kvcache_p)


def _reference(*operands, softmax_scale, window_left, window_right, softcap, has_sinks, paged, num_splits,
               implementation):
    del num_splits, implementation
    q, k, v, seqlens, page_table, sinks = _split(operands, paged, has_sinks)
    return attention_with_kvcache_reference(q, k, v, seqlens, page_table=page_table, softmax_scale=softmax_scale,
                                            window_size=(window_left, window_right), softcap=softcap, sinks=sinks)


def split_capacity(q_shape, k_shape, page_table_shape, num_splits: int) -> int:
    """The split workspace's extent: the forced count, or what num_splits=None may pick.

    Always a static int, also for symbolic (shape-polymorphic) dimensions: the extent is then an upper
    bound valid for every value they take at run time. auto_split_capacity grows with the keys and
    shrinks with batch x heads x query rows, so a symbolic factor of the latter counts as its least
    value 1, and symbolic keys as unbounded (MAX_SPLITS bounds the extent). The handler picks the
    split count within the extent it gets."""
    if num_splits:
        return num_splits
    static = lambda d: isinstance(d, int)  # noqa: E731
    b, s_q, h_q, _ = q_shape
    h_k = k_shape[2]
    group = h_q // h_k if static(h_q) and static(h_k) else 1
    rows = (s_q if static(s_q) else 1) * group
    key_dims = (k_shape[1], *(() if page_table_shape is None else (page_table_shape[1],)))
    keys = math.prod(key_dims) if all(map(static, key_dims)) else MAX_SPLITS * SPLIT_BLOCK_KEYS
    return auto_split_capacity(b if static(b) else 1, h_k if static(h_k) else 1, rows, keys)


def kernel_variant(arch: str, dtype, head_dim: int, params: dict) -> KVCacheVariant:
    """The kernel a call with these params needs on `arch` (the API and the lowering ask the same)."""
    return KVCacheVariant(arch, dtype_tag(dtype), head_dim, mask_kind(params["window_left"], params["window_right"]),
                          params["softcap"] > 0, params["paged"])


def _kernel_call(*operands, softmax_scale, window_left, window_right, softcap, has_sinks, paged, num_splits,
                 implementation):
    del implementation
    q, k, v, seqlens, page_table, sinks = _split(operands, paged, has_sinks)
    b, s_q, h_q, d = q.shape
    cap = split_capacity(q.shape, k.shape, None if page_table is None else page_table.shape, num_splits)
    # The kernel always takes a page table and sinks: the contiguous kernel ignores the table, -inf
    # sinks add nothing.
    page_table = jnp.zeros((1, 1), jnp.int32) if page_table is None else page_table
    sinks = jnp.full((h_q,), -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(
        KVCACHE.target,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h_q, s_q), jnp.float32),
            jax.ShapeDtypeStruct((cap, b, s_q, h_q, d), jnp.float32),  # workspace: per-split O
            jax.ShapeDtypeStruct((cap, b, h_q, s_q), jnp.float32),  # workspace: per-split LSE
        ),
    )
    o, lse, _, _ = call(q, k, v, seqlens, page_table, sinks, softmax_scale=np.float32(softmax_scale),
                        softcap=np.float32(softcap), window_left=np.int32(window_left),
                        window_right=np.int32(window_right), num_splits=np.int32(num_splits), paged=bool(paged))
    return o, lse


def _is_empty(avals, params) -> bool:
    """No batch, query, head, cache slot or page: the reference answers without a launch."""
    q, k = avals[0], avals[1]
    dims = (*q.shape, *k.shape, *(avals[4].shape if params["paged"] else ()))
    return any(isinstance(x, int) and x == 0 for x in dims)


register_local_lowerings(fa4_kvcache_local_p, reference=_reference, kernel=_kernel_call, is_empty=_is_empty,
                         variant=kernel_variant)
sharding.register(fa4_kvcache_p, fa4_kvcache_local_p, *sharding.kvcache_rules)


# --------------------------------------------------------------------------------------------------
# vmap


def _batch_rule(args, dims, *, paged, has_sinks, **params):
    """One kernel launch for any vmap:

    - Only q (and sinks) mapped, the cache shared: the mapped axis joins the query heads of each KV
      group (pack-GQA then reads every cache block once for all slices); the cache is not copied.
    - Sinks unmapped: the mapped axis folds into the batch. A mapped contiguous cache is reshaped, an
      unmapped one broadcast; a mapped page pool becomes one pool of size * num_pages pages with each
      slice's page ids offset, an unmapped one is shared as is.
    - Sinks mapped and the cache per slice: a sequential map over the slices (a rare combination:
      per-slice sinks belong to different models).
    """
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    q, k, v, seqlens, page_table, sinks = _split(args, paged, has_sinks)
    dq, dk, dv, dl, dp, ds = _split(dims, paged, has_sinks)
    kw = dict(paged=paged, has_sinks=has_sinks, **params)
    if dk is None and dv is None and dl is None and dp is None:
        q = _moved(q, dq, size)
        n, b, s_q, h_q, d = q.shape
        h_k = k.shape[2]
        g = h_q // h_k
        # Folded head (j * n + i) * g + r of slice i reads KV head j = folded // (n * g).
        qf = q.reshape(n, b, s_q, h_k, g, d).transpose(1, 2, 3, 0, 4, 5).reshape(b, s_q, h_k * n * g, d)
        sf = None if sinks is None else _moved(sinks, ds, size).reshape(n, h_k, g).transpose(1, 0, 2).reshape(-1)
        o, lse = fa4_kvcache_p.bind(*_join(qf, k, v, seqlens, page_table, sf), **kw)
        o = o.reshape(b, s_q, h_k, n, g, d).transpose(3, 0, 1, 2, 4, 5).reshape(n, b, s_q, h_q, d)
        lse = lse.reshape(b, h_k, n, g, s_q).transpose(2, 0, 1, 3, 4).reshape(n, b, h_q, s_q)
        return (o, lse), (0, 0)
    if ds is not None:
        moved = [_moved(x, d, size) if x is not None else None for x, d in zip((q, k, v, seqlens, page_table, sinks),
                                                                              (dq, dk, dv, dl, dp, ds))]
        o, lse = jax.lax.map(lambda xs: tuple(fa4_kvcache_p.bind(*_join(*xs), **kw)), tuple(moved))
        return (o, lse), (0, 0)

    def fold(x, d):  # (size, b, ...) -> (size * b, ...)
        x = _moved(x, d, size)
        return x.reshape(size * x.shape[1], *x.shape[2:])

    qf, lf = fold(q, dq), fold(seqlens, dl)
    if not paged:
        kf, vf, pf = fold(k, dk), fold(v, dv), None
    else:
        pf = _moved(page_table, dp, size)
        if dk is None and dv is None:
            kf, vf = k, v
        else:
            k, v = _moved(k, dk, size), _moved(v, dv, size)
            num_pages = k.shape[1]
            kf, vf = (x.reshape(size * num_pages, *x.shape[2:]) for x in (k, v))
            pf = pf + (jnp.arange(size, dtype=jnp.int32) * num_pages)[:, None, None]
        pf = pf.reshape(size * pf.shape[1], pf.shape[2])
    o, lse = fa4_kvcache_p.bind(*_join(qf, kf, vf, lf, pf, sinks), **kw)
    return (o.reshape(size, -1, *o.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (0, 0)


_compat.register_batching(fa4_kvcache_p, _batch_rule)


register_inference_only(fa4_kvcache_p)
