"""The varlen family's sharding rule (machinery: fa4_jax/core/partitioning.py).

Factors: q (tq, (hk g), d), k and v (tk, hk, d), cu_seqlens (b1),
seqused_k (bu), sinks ((hk g)). Heads shard as for dense attention; the packed token axes and the
offsets are replicated first (a token shard would cut sequences).
"""

from __future__ import annotations

from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import PartitionSpec

from fa4_jax.core.partitioning import head_plan, heads_factor, named_shardings, sharding_rule, slice_kv_heads
from fa4_jax.core.partitioning import spec_entries, spec_entry

def _varlen_rule(params: dict, value_types, result_types) -> SdyShardingRule:
    q, k = value_types[0], value_types[1]
    heads, sizes = heads_factor(q.shape[1], k.shape[1])
    operands = [ArrayMapping("tq", heads, "d"), ArrayMapping("tk", "hk", "d"), ArrayMapping("tk", "hk", "d"),
                ArrayMapping("b1"), ArrayMapping("b1")]
    if params["has_seqused"]:
        operands.append(ArrayMapping("bu"))
    if params["has_sinks"]:
        operands.append(ArrayMapping(heads))
    results = (ArrayMapping("tq", heads, "d"), ArrayMapping(heads, "tq"))
    replicate = ("tq", "d", "tk", "b1") + (("bu",) if params["has_seqused"] else ())
    return sharding_rule(operands, results, replicate, **sizes)


def _varlen_plan(params: dict, mesh, arg_shapes):
    q, k = arg_shapes[0], arg_shapes[1]
    _, h, _ = spec_entries(q.sharding, 3)
    q_axes, kv_axes, kv_slice = head_plan(mesh, h, q.shape[1], k.shape[1])
    h, kvh = spec_entry(q_axes), spec_entry(kv_axes)
    arg_specs = [PartitionSpec(None, h, None), PartitionSpec(None, kvh, None), PartitionSpec(None, kvh, None),
                 PartitionSpec(None), PartitionSpec(None)]
    if params["has_seqused"]:
        arg_specs.append(PartitionSpec(None))
    if params["has_sinks"]:
        arg_specs.append(PartitionSpec(h))
    return arg_specs, (PartitionSpec(None, h, None), PartitionSpec(h, None)), q_axes, kv_slice


def _varlen_out_shardings(params: dict, mesh, arg_shapes):
    return named_shardings(mesh, _varlen_plan(params, mesh, arg_shapes)[1])


def _varlen_partition(bind, params: dict, mesh, arg_shapes):
    arg_specs, out_specs, q_axes, kv_slice = _varlen_plan(params, mesh, arg_shapes)

    def impl(q, k, v, *rest):
        k, v = slice_kv_heads(q_axes, kv_slice, k, v, axis=1)  # (t, h, d): heads are axis 1 here
        return bind(q, k, v, *rest, **params)

    return impl, named_shardings(mesh, arg_specs), named_shardings(mesh, out_specs)


RULES = (_varlen_rule, _varlen_out_shardings, _varlen_partition)
