"""The dense family's sharding rule (see fa4_jax/core/partitioning.py for the machinery).

Factors: q (b, sq, (hk g), d), k and v (b, sk, hk, d), sinks ((hk g)), o like q, lse (b, (hk g), sq).
- batch and heads: sharded freely, no collective. GQA heads are kv-head-major (q-head h reads kv-head
  h // g): a mesh axis on the heads splits hk first; with more shards than KV heads it also splits
  g, and every KV head is then replicated on the shards of its q-heads.
- head_dim and the key sequence are always replicated first (an all-gather: a shard of either would
  need a reduction across devices the kernel does not do).
- the query sequence stays sharded without a mask (query rows are independent); with a causal or
  windowed mask the mask depends on each row's absolute position, so it is replicated first.
"""

from __future__ import annotations

from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import PartitionSpec

from fa4_jax.core.partitioning import head_plan, heads_factor, is_masked, named_shardings, sharding_rule
from fa4_jax.core.partitioning import slice_kv_heads, spec_entries, spec_entry

def _fwd_rule(params: dict, value_types, result_types) -> SdyShardingRule:
    q, k = value_types[0], value_types[1]
    heads, sizes = heads_factor(q.shape[2], k.shape[2])
    operands = [ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", "sk", "hk", "d"),
                ArrayMapping("b", "sk", "hk", "d")]
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    results = (ArrayMapping("b", "sq", heads, "d"), ArrayMapping("b", heads, "sq"))
    replicate = (("sq",) if is_masked(params) else ()) + ("d", "sk")
    return sharding_rule(operands, results, replicate, **sizes)


def _fwd_plan(params: dict, mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    b, sq, h, _ = spec_entries(q.sharding, 4)
    q_axes, kv_axes, kv_slice = head_plan(mesh, h, q.shape[2], k.shape[2])
    sq = None if is_masked(params) else sq
    h = spec_entry(q_axes)
    arg_specs = [PartitionSpec(b, sq, h, None), PartitionSpec(b, None, spec_entry(kv_axes), None),
                 PartitionSpec(b, None, spec_entry(kv_axes), None)]
    if params["has_sinks"]:
        arg_specs.append(PartitionSpec(h))
    out_specs = (PartitionSpec(b, sq, h, None), PartitionSpec(b, h, sq))
    return arg_specs, out_specs, q_axes, kv_slice


def _fwd_out_shardings(params: dict, mesh, arg_shapes):
    _, out_specs, _, _ = _fwd_plan(params, mesh, arg_shapes)
    return named_shardings(mesh, out_specs)


def _fwd_partition(bind, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice = _fwd_plan(params, mesh, arg_shapes)

    def impl(q, k, v, *rest):
        k, v = slice_kv_heads(q_axes, kv_slice, k, v)
        return bind(q, k, v, *rest, **params)

    return impl, named_shardings(mesh, arg_specs), named_shardings(mesh, out_specs)


RULES = (_fwd_rule, _fwd_out_shardings, _fwd_partition)
