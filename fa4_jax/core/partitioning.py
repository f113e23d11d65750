"""How a primitive runs on a sharded program (pjit / NamedSharding over a Mesh): the machinery every
family's sharding rule (fa4_jax/ops/<family>/sharding.py) plugs into, and the helpers they share.

Each public primitive (fa4_fwd, ...) lowers through `jax.experimental.custom_partitioning` (the
cuDNN attention's pattern in jax/_src/cudnn/fused_attention_stablehlo.py): the outer primitive keeps
abstract evaluation and vmap; its lowering is a custom-partitioned call of the *local* primitive,
which lowers to the kernel (CUDA) or the reference (elsewhere). On one device, and inside shard_map,
custom_partitioning inlines the local call: nothing changes there (no callback, exportable). Under
SPMD partitioning the family's Shardy rule says which dimensions may stay sharded; the partitioner
reshards the others and calls the local primitive on per-device shards.

A family provides three functions of its params (see `register`): the Shardy rule, the output
shardings inferred from the operands, and the partition (the per-shard function and the shardings
it needs).
"""

from __future__ import annotations

import functools

import jax

from jax.experimental.custom_partitioning import CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding

from fa4_jax.core import compat

def spec_entries(sharding, ndim: int) -> tuple:
    """The PartitionSpec entries of a NamedSharding, padded to ndim."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def sharding_rule(operands, results, replicate, **sizes) -> SdyShardingRule:
    """The Shardy rule of ArrayMappings `operands` -> `results` whose factors in `replicate` must be
    replicated. Shardy numbers factors in the order they first appear (operands, then results) and
    rejects special factors out of that order ("indices of special factors must be sorted"), so
    they are put in it here rather than by each family's hand."""
    order = []
    for mapping in (*operands, *results):
        for dim in mapping:
            for factor in (dim if isinstance(dim, CompoundFactor) else (dim,)):
                if factor not in order:
                    order.append(factor)
    replicate = tuple(sorted(set(replicate), key=order.index))
    return SdyShardingRule(tuple(operands), tuple(results), need_replication_factors=replicate, **sizes)


def heads_factor(heads_q: int, heads_kv: int):
    """The q-head dimension's factor and the factor sizes it needs: (hk g), kv-head-major. Shardy
    refuses size-1 factors inside a compound, so MHA maps q-heads to hk and MQA to g alone."""
    g = heads_q // heads_kv
    if g == 1:
        return "hk", {}
    if heads_kv == 1:
        return "g", {}
    return CompoundFactor("hk", "g"), {"g": g}


def is_masked(params: dict) -> bool:
    return params["window_left"] >= 0 or params["window_right"] >= 0


def axes_of(entry) -> tuple:
    """Mesh axis names of one PartitionSpec entry."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def axes_size(mesh, axes: tuple) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def spec_entry(axes: tuple):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def head_plan(mesh, q_heads_entry, heads_q: int, heads_kv: int):
    """How q-heads sharded by `q_heads_entry` meet the KV heads: (q head axes, kv head axes, kv slice).

    - shards divide heads_kv: K/V heads sharded the same way (each shard holds its KV heads);
    - heads_kv divides the shards: K/V replicated, each shard slices the one KV head its q-heads read
      (kv slice = number of q-head shards per KV head);
    - otherwise: q-heads replicated too (no per-shard grouping exists)."""
    axes = axes_of(q_heads_entry)
    n = axes_size(mesh, axes)
    if n == 1:
        return (), (), 0
    if heads_kv % n == 0:
        return axes, axes, 0
    if n % heads_kv == 0 and heads_q % n == 0:
        return axes, (), n // heads_kv
    return (), (), 0


def slice_kv_heads(q_axes: tuple, kv_slice: int, *kv, axis: int = 2):
    """K/V replicated over more head shards than KV heads: this shard's q-heads all read KV head
    axis_index // kv_slice (kv_slice = head shards per KV head); `axis` is K/V's head axis."""
    if not kv_slice:
        return kv
    kv_head = jax.lax.axis_index(spec_entry(q_axes)) // kv_slice
    return tuple(jax.lax.dynamic_slice_in_dim(x, kv_head, 1, axis=axis) for x in kv)


def named_shardings(mesh, specs) -> tuple:
    return tuple(NamedSharding(mesh, s) for s in specs)


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
        outs = compat.lower_fun(lambda *ops: fn(*ops, key), multiple_results=True)(ctx, *operands)
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
    ir = compat.mlir_ir
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
    compat.register_lowering(outer_prim, partitioned_lowering(local_prim, rule, out_shardings, plan))
    compat.mark_requires_devices_during_lowering(outer_prim)
