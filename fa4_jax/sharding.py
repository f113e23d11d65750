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

from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from fa4_jax import _compat


def _spec(sharding, ndim: int) -> tuple:
    """The PartitionSpec entries of a NamedSharding, padded to ndim."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


# --------------------------------------------------------------------------------------------------
# dense attention


def _fwd_rule(params: dict, value_types, result_types) -> SdyShardingRule:
    q, k = value_types[0], value_types[1]
    g = q.shape[2] // k.shape[2]
    # Shardy refuses size-1 factors inside a compound: MHA maps q-heads to hk, MQA to g alone.
    heads = "hk" if g == 1 else ("g" if k.shape[2] == 1 else CompoundFactor("hk", "g"))
    operands = [ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", "sk", "hk", "d"),
                ArrayMapping("b", "sk", "hk", "d")]
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    results = (ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", heads, "sq"))
    masked = params["window_left"] >= 0 or params["window_right"] >= 0
    # Shardy wants special factors in the order the factors first appear (b, sq, hk, g, d, sk).
    replicate = (("sq",) if masked else ()) + ("d", "sk")
    sizes = {"g": g} if isinstance(heads, CompoundFactor) else {}
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
    masked = params["window_left"] >= 0 or params["window_right"] >= 0
    sq = None if masked else sq
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


def _fwd_partition(call, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice = _fwd_plan(params, mesh, arg_shapes)

    def impl(q, k, v, *rest):
        if kv_slice:
            # K/V replicated over more head shards than KV heads: this shard's q-heads all read KV
            # head axis_index // kv_slice.
            kv_head = jax.lax.axis_index(_entry(q_axes)) // kv_slice
            k, v = (jax.lax.dynamic_slice_in_dim(x, kv_head, 1, axis=2) for x in (k, v))
        return call(q, k, v, *rest)

    return impl, tuple(NamedSharding(mesh, s) for s in arg_specs), tuple(NamedSharding(mesh, s) for s in out_specs)


# --------------------------------------------------------------------------------------------------
# the custom_partitioning plumbing shared by the primitives


@functools.lru_cache(maxsize=None)
def _partitioned(local_prim, num_operands: int, rule, out_shardings, plan):
    """custom_partitioning of `local_prim.bind` over num_operands arrays; the primitive's params
    travel as one static argument (a sorted tuple of items). `plan(call, params, mesh, arg_shapes)`
    returns the per-shard function and the operand/result shardings it needs (the partitioner
    reshards operands that arrive otherwise)."""

    def call_with(params):
        return lambda *operands: tuple(local_prim.bind(*operands, **dict(params)))

    fn = custom_partitioning(lambda *args: call_with(args[num_operands])(*args[:num_operands]),
                             static_argnums=(num_operands,))

    def partition(params, mesh, arg_shapes, result_shape):
        impl, arg_shardings, result_shardings = plan(call_with(params), dict(params), mesh, arg_shapes)
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
        return _compat.lower_fun(lambda *ops: fn(*ops, key), multiple_results=True)(ctx, *operands)

    return lower


def register(outer_prim, local_prim, rule, out_shardings, plan) -> None:
    _compat.register_lowering(outer_prim, partitioned_lowering(local_prim, rule, out_shardings, plan))
    _compat.mark_requires_devices_during_lowering(outer_prim)


fwd_rules = (_fwd_rule, _fwd_out_shardings, _fwd_partition)
