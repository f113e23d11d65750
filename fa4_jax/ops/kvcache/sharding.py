"""The KV-cache family's sharding rule, context-parallel decode included (machinery:
fa4_jax/core/partitioning.py).

Factors: q (b, sq, (hk g), d); contiguous caches (b, cap, hk, d) or
paged pools (pages, ps, hk, d) with page_table (b, mp); cache_seqlens (b); sinks ((hk g)); FP8 caches'
k_scale / v_scale (hk), sharded with the KV heads.
Batch and heads as for dense attention (an unsplit paged pool is replicated: every batch shard may
read any page). Context parallelism: a contiguous cache sharded along its length, or a paged pool
sharded by pages (each device holding its own pages); the cache never moves. With the queries at
positions len - s_q + i (bottom-right), the keys split in two:
- the "body" [0, len - T): visible to every query (T = 0 without a mask and for causal decode).
  Each device attends to its body keys with no mask (contiguous: local lengths
  clip(len - T - start, 0, slice); paged: the row's local pages compacted to the front) and the
  partial (o, lse) of all devices are all-gathered (b x h x s_q x (d + 1) values);
- the "tail" [len - T, len): the keys only some queries see (T = s_q - 1 - window_right for causal /
  right-windowed calls; with a left window every visible key, T = s_q + window_left, and no body).
  Every device assembles the tail from the devices holding it (one all-reduce of b x T x hk x d x 2
  values) and attends to it with the call's own mask, which stays exact because the tail ends at len.
The parts merge by their LSE (`merge_partials`). A left window at least as long as the cache gathers
the key axis first instead (the tail would be the whole cache).

A ragged batch (q (1, total_q, (hk g), d), cu_seqlens_q (b + 1)) shards by heads only: its rows mix
sequences, so batch, query and key axes are gathered (replicated) first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import PartitionSpec

from fa4_jax.core.partitioning import axes_of, head_plan, heads_factor, is_masked, named_shardings, sharding_rule
from fa4_jax.core.partitioning import slice_kv_heads, spec_entries, spec_entry
from fa4_jax.ops.kvcache.spec import PAGE_ROWS, retiled


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
    heads, sizes = heads_factor(q.shape[2], k.shape[2])
    paged, ragged = params["paged"], params["ragged"]
    cache = ArrayMapping("pages", "ps", "hk", "d") if paged else ArrayMapping("b", "cap", "hk", "d")
    qb = "qb" if ragged else "b"  # a ragged q's unit axis is not the batch
    operands = [ArrayMapping(qb, "sq", heads, "d"), cache, cache, ArrayMapping("b")]
    if paged:
        operands.append(ArrayMapping("b", "mp"))
    if ragged:
        operands.append(ArrayMapping("b1"))
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    if params["kv_fp8"]:
        operands += [ArrayMapping("hk"), ArrayMapping("hk")]
    results = (ArrayMapping(qb, "sq", heads, "d"), ArrayMapping(qb, heads, "sq"))
    cp = not ragged and _cp_allowed(params, q.shape[1],
                                    _capacity(params, k.shape, value_types[4].shape if paged else None))
    replicate = ("sq",) if is_masked(params) or ragged else ()
    if ragged:
        replicate += ("qb", "b", "b1")
    if paged:
        replicate += ("d",) + (() if cp else ("pages",)) + ("ps", "mp")
    else:
        replicate += ("d",) + (() if cp else ("cap",))
    return sharding_rule(operands, results, replicate, **sizes)


def _kvcache_plan(params: dict, mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    b, sq, h, _ = spec_entries(q.sharding, 4)
    k_batch_or_pages, cap, _, _ = spec_entries(k.sharding, 4)
    q_axes, kv_axes, kv_slice = head_plan(mesh, h, q.shape[2], k.shape[2])
    ragged = params["ragged"]
    sq = None if is_masked(params) or ragged else sq
    b = None if ragged else b
    h, kvh = spec_entry(q_axes), spec_entry(kv_axes)
    # The sharded key axis: a contiguous cache's length, or a paged pool's pages (device-local pages).
    split = k_batch_or_pages if params["paged"] else cap
    capacity = _capacity(params, k.shape, arg_shapes[4].shape if params["paged"] else None)
    cp_axes = (tuple(a for a in axes_of(split) if a not in axes_of(b) + q_axes)
               if not ragged and _cp_allowed(params, q.shape[1], capacity) else ())
    if params["paged"]:
        cache = PartitionSpec(spec_entry(cp_axes), None, kvh, None)
    else:
        cache = PartitionSpec(b, spec_entry(cp_axes), kvh, None)
    arg_specs = [PartitionSpec(b, sq, h, None), cache, cache, PartitionSpec(b)]
    if params["paged"]:
        arg_specs.append(PartitionSpec(b, None))
    if ragged:
        arg_specs.append(PartitionSpec(None))
    if params["has_sinks"]:
        arg_specs.append(PartitionSpec(h))
    if params["kv_fp8"]:
        arg_specs += [PartitionSpec(kvh), PartitionSpec(kvh)]
    out_specs = (PartitionSpec(b, sq, h, None), PartitionSpec(b, h, sq))
    return arg_specs, out_specs, q_axes, kv_slice, cp_axes


def _kvcache_out_shardings(params: dict, mesh, arg_shapes):
    return named_shardings(mesh, _kvcache_plan(params, mesh, arg_shapes)[1])


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

    def gather(x):
        if x.dtype == jnp.float8_e4m3fn:  # an FP8 cache's bytes: summed as integers (one nonzero, exact)
            bits = jax.lax.bitcast_convert_type(x[index], jnp.uint8)
            return jax.lax.bitcast_convert_type(jax.lax.psum(jnp.where(keep, bits, jnp.uint8(0)), axis), x.dtype)
        return jax.lax.psum(jnp.where(keep, x[index], jnp.zeros((), x.dtype)), axis)

    return gather(k), gather(v)


def _kvcache_partition(bind, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice, cp_axes = _kvcache_plan(params, mesh, arg_shapes)
    paged = params["paged"]
    capacity = _capacity(params, arg_shapes[1].shape, arg_shapes[4].shape if paged else None)  # global keys per row

    def impl(q, k, v, lens, *rest):
        k, v = slice_kv_heads(q_axes, kv_slice, k, v)
        scales = ()  # FP8 caches: (k_scale, v_scale), the last operands, sliced with the KV heads
        if params["kv_fp8"]:
            rest, scales = rest[:-2], slice_kv_heads(q_axes, kv_slice, *rest[-2:], axis=0)
        # A shard's packed rows per KV head (fewer where kv_slice gives it one KV head of a group).
        own = retiled(params, q.shape, k.shape)
        if not cp_axes:
            return bind(q, k, v, lens, *rest, *scales, **own)
        axis = spec_entry(cp_axes)
        sinks = rest[-1] if params["has_sinks"] else None
        table = rest[0] if paged else None
        shard = jax.lax.axis_index(axis)
        # Keys past the capacity do not exist (the kernel clamps lengths the same way).
        lens = jnp.clip(lens, 0, capacity)
        tail = _tail_length(params, q.shape[1])
        parts = []
        if params["window_left"] < 0:  # the body [0, len - tail): every query sees all of it
            body = dict(own, has_sinks=False, window_left=-1, window_right=-1)
            body_lens = lens - jnp.minimum(lens, tail)
            if paged:
                local_table, local = _local_pages(table, body_lens, shard * k.shape[0], k.shape[0], k.shape[1])
                o, lse = bind(q, k, v, local, local_table, *scales, **body)
            else:
                local = jnp.clip(body_lens - shard * k.shape[1], 0, k.shape[1]).astype(jnp.int32)
                o, lse = bind(q, k, v, local, *scales, **body)
            parts.append((jax.lax.all_gather(o, axis), jax.lax.all_gather(lse, axis)))
        if tail:  # the tail, with the call's own mask (it ends at len, so bottom-right alignment holds)
            tk, tv = _gather_tail(k, v, lens, table, tail, shard, axis)
            tail_lens = jnp.minimum(lens, tail).astype(jnp.int32)
            flat = retiled(dict(own, paged=False, page_rows=PAGE_ROWS), q.shape, tk.shape)  # gathered: contiguous
            if not parts:  # a left window: the tail is every visible key, the result itself
                return bind(q, tk, tv, tail_lens, *rest[1 if paged else 0:], *scales, **flat)
            o, lse = bind(q, tk, tv, tail_lens, *scales, **dict(flat, has_sinks=False))
            parts.append((o[None], lse[None]))
        return merge_partials(jnp.concatenate([o for o, _ in parts]), jnp.concatenate([lse for _, lse in parts]),
                              sinks)

    return impl, named_shardings(mesh, arg_specs), named_shardings(mesh, out_specs)


RULES = (_kvcache_rule, _kvcache_out_shardings, _kvcache_partition)
