"""Sharding rules: how each primitive runs on a sharded program (pjit / NamedSharding over a Mesh).

Each public primitive (fa4_fwd, ...) lowers through `jax.experimental.custom_partitioning` (the
cuDNN attention's pattern in jax/_src/cudnn/fused_attention_stablehlo.py): the outer primitive keeps
abstract evaluation and vmap; its lowering is a custom-partitioned call of the *local* primitive,
which lowers to the kernel (CUDA) or the reference (elsewhere). On one device, and inside shard_map,
custom_partitioning inlines the local call: nothing changes there (no callback, exportable). Under
SPMD partitioning the Shardy rule below says which dimensions may stay sharded; the partitioner
reshards the others and calls the local primitive on per-device shards.

Dense attention (fa4_fwd), factors: q (b, sq, (hk g), d), k and v (b, sk, hk, d), sinks ((hk g)),
o like q, lse (b, (hk g), sq).
- batch and heads: sharded freely, no collective. GQA heads are kv-head-major (q-head h reads kv-head
  h // g): a mesh axis on the heads splits hk first; with more shards than KV heads it also splits
  g, and every KV head is then replicated on the shards of its q-heads.
- head_dim and the key sequence are always replicated first (an all-gather: a shard of either would
  need a reduction across devices the kernel does not do).
- the query sequence stays sharded without a mask (query rows are independent); with a causal or
  windowed mask the mask depends on each row's absolute position, so it is replicated first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from fa4_jax import _compat


def _spec(sharding, ndim: int) -> tuple:
    """The PartitionSpec entries of a NamedSharding, padded to ndim."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


# --------------------------------------------------------------------------------------------------
# dense attention


def _heads_factor(heads_q: int, heads_kv: int):
    """The q-head dimension's factor and the factor sizes it needs: (hk g), kv-head-major. Shardy
    refuses size-1 factors inside a compound, so MHA maps q-heads to hk and MQA to g alone."""
    g = heads_q // heads_kv
    if g == 1:
        return "hk", {}
    if heads_kv == 1:
        return "g", {}
    return CompoundFactor("hk", "g"), {"g": g}


def _masked(params: dict) -> bool:
    return params["window_left"] >= 0 or params["window_right"] >= 0


def _fwd_rule(params: dict, value_types, result_types) -> SdyShardingRule:
    q, k = value_types[0], value_types[1]
    heads, sizes = _heads_factor(q.shape[2], k.shape[2])
    operands = [ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", "sk", "hk", "d"),
                ArrayMapping("b", "sk", "hk", "d")]
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    results = (ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", heads, "sq"))
    # Shardy wants special factors in the order the factors first appear (b, sq, hk, g, d, sk).
    replicate = (("sq",) if _masked(params) else ()) + ("d", "sk")
    return SdyShardingRule(tuple(operands), results, need_replication_factors=replicate, **sizes)


def _axes(entry) -> tuple:
    """Mesh axis names of one PartitionSpec entry."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _axes_size(mesh, axes: tuple) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _entry(axes: tuple):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _head_plan(mesh, q_heads_entry, heads_q: int, heads_kv: int):
    """How q-heads sharded by `q_heads_entry` meet the KV heads: (q head axes, kv head axes, kv slice).

    - shards divide heads_kv: K/V heads sharded the same way (each shard holds its KV heads);
    - heads_kv divides the shards: K/V replicated, each shard slices the one KV head its q-heads read
      (kv slice = number of q-head shards per KV head);
    - otherwise: q-heads replicated too (no per-shard grouping exists)."""
    axes = _axes(q_heads_entry)
    n = _axes_size(mesh, axes)
    if n == 1:
        return (), (), 0
    if heads_kv % n == 0:
        return axes, axes, 0
    if n % heads_kv == 0 and heads_q % n == 0:
        return axes, (), n // heads_kv
    return (), (), 0


def _fwd_plan(params: dict, mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    b, sq, h, _ = _spec(q.sharding, 4)
    q_axes, kv_axes, kv_slice = _head_plan(mesh, h, q.shape[2], k.shape[2])
    sq = None if _masked(params) else sq
    h = _entry(q_axes)
    arg_specs = [PartitionSpec(b, sq, h, None), PartitionSpec(b, None, _entry(kv_axes), None),
                 PartitionSpec(b, None, _entry(kv_axes), None)]
    if params["has_sinks"]:
        arg_specs.append(PartitionSpec(h))
    out_specs = (PartitionSpec(b, sq, h, None), PartitionSpec(b, h, sq))
    return arg_specs, out_specs, q_axes, kv_slice


def _fwd_out_shardings(params: dict, mesh, arg_shapes):
    _, out_specs, _, _ = _fwd_plan(params, mesh, arg_shapes)
    return tuple(NamedSharding(mesh, s) for s in out_specs)


def _slice_kv_heads(q_axes: tuple, kv_slice: int, *kv):
    """K/V replicated over more head shards than KV heads: this shard's q-heads all read KV head
    axis_index // kv_slice (kv_slice = head shards per KV head)."""
    if not kv_slice:
        return kv
    kv_head = jax.lax.axis_index(_entry(q_axes)) // kv_slice
    return tuple(jax.lax.dynamic_slice_in_dim(x, kv_head, 1, axis=2) for x in kv)


def _shardings(mesh, specs) -> tuple:
    return tuple(NamedSharding(mesh, s) for s in specs)


def _fwd_partition(bind, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice = _fwd_plan(params, mesh, arg_shapes)

    def impl(q, k, v, *rest):
        k, v = _slice_kv_heads(q_axes, kv_slice, k, v)
        return bind(q, k, v, *rest, **params)

    return impl, _shardings(mesh, arg_specs), _shardings(mesh, out_specs)


# --------------------------------------------------------------------------------------------------
# KV-cache attention (fa4_kvcache). Factors: q (b, sq, (hk g), d); contiguous caches (b, cap, hk, d) or
# paged pools (pages, ps, hk, d) with page_table (b, mp); cache_seqlens (b); sinks ((hk g)).
# Batch and heads as for dense attention (an unsplit paged pool is replicated: every batch shard may
# read any page). Context parallelism: a contiguous cache sharded along its length, or a paged pool
# sharded by pages (each device holding its own pages); the cache never moves. With the queries at
# positions len - s_q + i (bottom-right), the keys split in two:
# - the "body" [0, len - T): visible to every query (T = 0 without a mask and for causal decode).
#   Each device attends to its body keys with no mask (contiguous: local lengths
#   clip(len - T - start, 0, slice); paged: the row's local pages compacted to the front) and the
#   partial (o, lse) of all devices are all-gathered (b x h x s_q x (d + 1) values);
# - the "tail" [len - T, len): the keys only some queries see (T = s_q - 1 - window_right for causal /
#   right-windowed calls; with a left window every visible key, T = s_q + window_left, and no body).
#   Every device assembles the tail from the devices holding it (one all-reduce of b x T x hk x d x 2
#   values) and attends to it with the call's own mask, which stays exact because the tail ends at len.
# The parts merge by their LSE (`merge_partials`). A left window at least as long as the cache gathers
# the key axis first instead (the tail would be the whole cache).


def _tail_length(params: dict, s_q: int) -> int:
    """T: how many of a row's last keys some query cannot see (the tail; 0 = every key is body)."""
    left, right = params["window_left"], params["window_right"]
    if left >= 0:
        return s_q + left
    return 0 if right < 0 else max(s_q - 1 - right, 0)


def _cp_allowed(params: dict, s_q: int, capacity: int) -> bool:
    """Whether a sharded key axis can stay sharded: always, unless a left window's tail (every key it
    can see) would be the whole cache anyway."""
    return params["window_left"] < 0 or _tail_length(params, s_q) < capacity


def _capacity(params: dict, k_shape, table_shape) -> int:
    return table_shape[1] * k_shape[1] if params["paged"] else k_shape[1]


def _kvcache_rule(params: dict, value_types, result_types) -> SdyShardingRule:
    q, k = value_types[0], value_types[1]
    heads, sizes = _heads_factor(q.shape[2], k.shape[2])
    paged = params["paged"]
    cache = ArrayMapping("pages", "ps", "hk", "d") if paged else ArrayMapping("b", "cap", "hk", "d")
    operands = [ArrayMapping("b", "sq", heads, "d"), cache, cache, ArrayMapping("b")]
    if paged:
        operands.append(ArrayMapping("b", "mp"))
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    results = (ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", heads, "sq"))
    cp = _cp_allowed(params, q.shape[1], _capacity(params, k.shape, value_types[4].shape if paged else None))
    replicate = ("sq",) if _masked(params) else ()
    if paged:
        replicate += ("d",) + (() if cp else ("pages",)) + ("ps", "mp")
    else:
        replicate += ("d",) + (() if cp else ("cap",))
    return SdyShardingRule(tuple(operands), results, need_replication_factors=replicate, **sizes)


def _kvcache_plan(params: dict, mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    b, sq, h, _ = _spec(q.sharding, 4)
    k_batch_or_pages, cap, _, _ = _spec(k.sharding, 4)
    q_axes, kv_axes, kv_slice = _head_plan(mesh, h, q.shape[2], k.shape[2])
    sq = None if _masked(params) else sq
    h, kvh = _entry(q_axes), _entry(kv_axes)
    # The sharded key axis: a contiguous cache's length, or a paged pool's pages (device-local pages).
    split = k_batch_or_pages if params["paged"] else cap
    capacity = _capacity(params, k.shape, arg_shapes[4].shape if params["paged"] else None)
    cp_axes = (tuple(a for a in _axes(split) if a not in _axes(b) + q_axes)
               if _cp_allowed(params, q.shape[1], capacity) else ())
    if params["paged"]:
        cache = PartitionSpec(_entry(cp_axes), None, kvh, None)
    else:
        cache = PartitionSpec(b, _entry(cp_axes), kvh, None)
    arg_specs = [PartitionSpec(b, sq, h, None), cache, cache, PartitionSpec(b)]
    if params["paged"]:
        arg_specs.append(PartitionSpec(b, None))
    if params["has_sinks"]:
        arg_specs.append(PartitionSpec(h))
    out_specs = (PartitionSpec(b, sq, h, None), PartitionSpec(b, h, sq))
    return arg_specs, out_specs, q_axes, kv_slice, cp_axes


def _kvcache_out_shardings(params: dict, mesh, arg_shapes):
    return _shardings(mesh, _kvcache_plan(params, mesh, arg_shapes)[1])


def merge_partials(o: jax.Array, lse: jax.Array,
                   sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Exact attention from partials over disjoint key sets: o (n, b, s_q, h, d) each normalised over
    its own keys, lse (n, b, h, s_q); sinks (h,) join the denominator once. A part with lse = -inf
    (no key) weighs 0; a row with no key anywhere gives o = 0, lse = -inf (or the sink logit)."""
    lse = lse.astype(jnp.float32)
    big = lse.max(axis=0)
    if sinks is not None:
        big = jnp.maximum(big, sinks.astype(jnp.float32)[None, :, None])
    big = jnp.where(jnp.isfinite(big), big, 0.0)
    w = jnp.exp(lse - big[None])  # (n, b, h, s_q)
    denom = w.sum(axis=0)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[None, :, None] - big)
    scale = jnp.where(denom > 0, w / jnp.where(denom > 0, denom, 1.0)[None], 0.0)
    out = jnp.einsum("nbhq,nbqhd->bqhd", scale, o.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(o.dtype), jnp.where(denom > 0, big + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)


def _local_pages(table, lens, first_page, num_pages: int, page_size: int):
    """A device's view of a paged cache whose pool is split by pages: each sequence's pages that live
    here, moved to the front of its row (order kept, so the one partly filled page stays last) and
    renumbered locally, and the number of valid keys they hold. Keys elsewhere are other devices'
    part of the merge."""
    slot_start = jnp.arange(table.shape[1], dtype=jnp.int32)[None, :] * page_size
    valid = jnp.clip(lens[:, None] - slot_start, 0, page_size)
    keep = (table >= first_page) & (table < first_page + num_pages) & (valid > 0)
    order = jnp.argsort(~keep, axis=1, stable=True)
    local_table = jnp.clip(jnp.take_along_axis(table - first_page, order, axis=1), 0, num_pages - 1)
    return local_table.astype(jnp.int32), jnp.where(keep, valid, 0).sum(axis=1).astype(jnp.int32)


def _gather_tail(k, v, lens, table, tail: int, shard, axis):
    """Every device's copy of each row's tail: keys [max(len - tail, 0), len) of the sharded cache
    (b, tail, hk, d), zero past len. Each key lives on one device: the others add zeros (exact)."""
    pos = jnp.maximum(lens - tail, 0)[:, None] + jnp.arange(tail, dtype=jnp.int32)[None, :]  # (b, tail)
    if table is None:
        local = pos - shard * k.shape[1]
        rows = jnp.arange(k.shape[0])[:, None]
        index = (rows, jnp.clip(local, 0, k.shape[1] - 1))
        mine = (local >= 0) & (local < k.shape[1])
    else:
        num_pages, page_size = k.shape[0], k.shape[1]
        slot = jnp.clip(pos // page_size, 0, table.shape[1] - 1)
        page = jnp.take_along_axis(table, slot, axis=1) - shard * num_pages
        index = (jnp.clip(page, 0, num_pages - 1), pos % page_size)
        mine = (page >= 0) & (page < num_pages)
    keep = (mine & (pos < lens[:, None]))[:, :, None, None]
    return tuple(jax.lax.psum(jnp.where(keep, x[index], jnp.zeros((), x.dtype)), axis) for x in (k, v))


def _kvcache_partition(bind, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice, cp_axes = _kvcache_plan(params, mesh, arg_shapes)
    paged = params["paged"]
    capacity = _capacity(params, arg_shapes[1].shape, arg_shapes[4].shape if paged else None)  # global keys per row

    def impl(q, k, v, lens, *rest):
        k, v = _slice_kv_heads(q_axes, kv_slice, k, v)
        if not cp_axes:
            return bind(q, k, v, lens, *rest, **params)
        axis = _entry(cp_axes)
        sinks = rest[-1] if params["has_sinks"] else None
        table = rest[0] if paged else None
        shard = jax.lax.axis_index(axis)
        # Keys past the capacity do not exist (the kernel clamps lengths the same way).
        lens = jnp.clip(lens, 0, capacity)
        tail = _tail_length(params, q.shape[1])
        parts = []
        if params["window_left"] < 0:  # the body [0, len - tail): every query sees all of it
            body = dict(params, has_sinks=False, window_left=-1, window_right=-1)
            body_lens = lens - jnp.minimum(lens, tail)
            if paged:
                local_table, local = _local_pages(table, body_lens, shard * k.shape[0], k.shape[0], k.shape[1])
                o, lse = bind(q, k, v, local, local_table, **body)
            else:
                local = jnp.clip(body_lens - shard * k.shape[1], 0, k.shape[1]).astype(jnp.int32)
                o, lse = bind(q, k, v, local, **body)
            parts.append((jax.lax.all_gather(o, axis), jax.lax.all_gather(lse, axis)))
        if tail:  # the tail, with the call's own mask (it ends at len, so bottom-right alignment holds)
            tk, tv = _gather_tail(k, v, lens, table, tail, shard, axis)
            tail_lens = jnp.minimum(lens, tail).astype(jnp.int32)
            if not parts:  # a left window: the tail is every visible key, the result itself
                return bind(q, tk, tv, tail_lens, *rest[1 if paged else 0:], **dict(params, paged=False))
            o, lse = bind(q, tk, tv, tail_lens, **dict(params, paged=False, has_sinks=False))
            parts.append((o[None], lse[None]))
        return merge_partials(jnp.concatenate([o for o, _ in parts]), jnp.concatenate([lse for _, lse in parts]),
                              sinks)

    return impl, _shardings(mesh, arg_specs), _shardings(mesh, out_specs)


# --------------------------------------------------------------------------------------------------
# varlen attention (fa4_varlen). Factors: q (tq, (hk g), d), k and v (tk, hk, d), cu_seqlens (b1),
# seqused_k (bu), sinks ((hk g)). Heads shard as for dense attention; the packed token axes and the
# offsets are replicated first (a token shard would cut sequences).


def _varlen_rule(params: dict, value_types, result_types) -> SdyShardingRule:
    q, k = value_types[0], value_types[1]
    heads, sizes = _heads_factor(q.shape[1], k.shape[1])
    operands = [ArrayMapping("tq", heads, "d"), ArrayMapping("tk", "hk", "d"), ArrayMapping("tk", "hk", "d"),
                ArrayMapping("b1"), ArrayMapping("b1")]
    if params["has_seqused"]:
        operands.append(ArrayMapping("bu"))
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    results = (ArrayMapping("tq", heads, "d"), ArrayMapping(heads, "tq"))
    replicate = ("tq", "d", "tk", "b1") + (("bu",) if params["has_seqused"] else ())
    return SdyShardingRule(tuple(operands), results, need_replication_factors=replicate, **sizes)


def _varlen_plan(params: dict, mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    _, h, _ = _spec(q.sharding, 3)
    q_axes, kv_axes, kv_slice = _head_plan(mesh, h, q.shape[1], k.shape[1])
    h, kvh = _entry(q_axes), _entry(kv_axes)
    arg_specs = [PartitionSpec(None, h, None), PartitionSpec(None, kvh, None), PartitionSpec(None, kvh, None),
                 PartitionSpec(None), PartitionSpec(None)]
    if params["has_seqused"]:
        arg_specs.append(PartitionSpec(None))
    if params["has_sinks"]:
        arg_specs.append(PartitionSpec(h))
    return arg_specs, (PartitionSpec(None, h, None), PartitionSpec(h, None)), q_axes, kv_slice


def _varlen_out_shardings(params: dict, mesh, arg_shapes):
    return _shardings(mesh, _varlen_plan(params, mesh, arg_shapes)[1])


def _varlen_partition(bind, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice = _varlen_plan(params, mesh, arg_shapes)

    def impl(q, k, v, *rest):
        if kv_slice:  # (t, h, d): heads are axis 1 here
            kv_head = jax.lax.axis_index(_entry(q_axes)) // kv_slice
            k, v = (jax.lax.dynamic_slice_in_dim(x, kv_head, 1, axis=1) for x in (k, v))
        return bind(q, k, v, *rest, **params)

    return impl, _shardings(mesh, arg_specs), _shardings(mesh, out_specs)


# --------------------------------------------------------------------------------------------------
# the custom_partitioning plumbing shared by the primitives


@functools.lru_cache(maxsize=None)
def _partitioned(local_prim, num_operands: int, rule, out_shardings, plan):
    """custom_partitioning of `local_prim.bind` over num_operands arrays; the primitive's params
    travel as one static argument (a sorted tuple of items). `plan(bind, params, mesh, arg_shapes)`
    returns the per-shard function (which binds the local primitive through `bind(*operands,
    **params)`) and the operand/result shardings it needs (the partitioner reshards operands that
    arrive otherwise)."""

    def bind(*operands, **params):
        return tuple(local_prim.bind(*operands, **params))

    fn = custom_partitioning(lambda *args: bind(*args[:num_operands], **dict(args[num_operands])),
                             static_argnums=(num_operands,))

    def partition(params, mesh, arg_shapes, result_shape):
        impl, arg_shardings, result_shardings = plan(bind, dict(params), mesh, arg_shapes)
        return mesh, impl, result_shardings, arg_shardings

    def infer(params, mesh, arg_shapes, result_shape):
        return out_shardings(dict(params), mesh, arg_shapes)

    def sharding_rule(params, mesh, value_types, result_types):
        return rule(dict(params), value_types, result_types)

    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule)
    return fn


def partitioned_lowering(local_prim, rule, out_shardings, plan):
    """A lowering rule for an outer primitive: its operands and params, through custom_partitioning,
    into `local_prim`."""

    def lower(ctx, *operands, **params):
        fn = _partitioned(local_prim, len(operands), rule, out_shardings, plan)
        key = tuple(sorted(params.items()))
        outs = _compat.lower_fun(lambda *ops: fn(*ops, key), multiple_results=True)(ctx, *operands)
        _record_params(outs, f"{local_prim.name}{key!r}")
        return outs

    return lower


PARAMS_ATTRIBUTE = "fa4_jax.params"


def _record_params(outs, text: str) -> None:
    """Write the primitive's params into the partitioned custom call as a frontend attribute.

    Under SPMD partitioning the call's params live only in the Python partition callback, whose
    address (backend_config) differs in every process, so jax's persistent-cache key changes each
    run. jax can drop that address from the key (jax_remove_custom_partitioning_ptr_from_cache_key),
    which is only safe if two calls that differ in params differ in their HLO: this attribute makes
    them differ. Nothing reads it back. On one device or in shard_map no such call exists (inlined)."""
    ir = _compat.mlir_ir
    first = outs[0] if outs else None
    first = first[0] if isinstance(first, (list, tuple)) else first
    op = getattr(first, "owner", None)
    if op is None or getattr(op, "name", "") != "stablehlo.custom_call":
        return
    target = op.attributes["call_target_name"]
    if ir.StringAttr(target).value != "CustomSPMDPartitioning":
        return
    op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get({PARAMS_ATTRIBUTE: ir.StringAttr.get(text)})


def register(outer_prim, local_prim, rule, out_shardings, plan) -> None:
    _compat.register_lowering(outer_prim, partitioned_lowering(local_prim, rule, out_shardings, plan))
    _compat.mark_requires_devices_during_lowering(outer_prim)


fwd_rules = (_fwd_rule, _fwd_out_shardings, _fwd_partition)
kvcache_rules = (_kvcache_rule, _kvcache_out_shardings, _kvcache_partition)
varlen_rules = (_varlen_rule, _varlen_out_shardings, _varlen_partition)
