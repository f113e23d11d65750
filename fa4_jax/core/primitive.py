"""What every family's primitive shares: the outer/per-shard primitive pair, operand packing by the
family's CallSignature, eager execution, the inference-only rules, and one registration call.

A family's primitive module (fa4_jax/ops/<family>/primitive.py) describes its primitive with a
`FamilyPrimitive`: its kernel family (whose CallSignature orders the operands), which of the
operands the primitive may omit and the boolean param saying whether each is present, its abstract
evaluation, and its bodies (reference, kernel call, vmap rule, sharding rules). `register()` wires them
into jax: abstract evaluation, eager impl, lowering per platform (fa4_jax/core/lowering.py), custom
partitioning (fa4_jax/core/partitioning.py), batching, and the inference-only JVP/transpose.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from fa4_jax.core import compat, cudnn, partitioning, platform
from fa4_jax.core.lowering import register_local_lowerings
from fa4_jax.core.validation import check_flag
from fa4_jax.families.base import KernelFamily

NO_GRAD = (
    "fa4_jax is inference-only: differentiation of attention is not supported; "
    "use jax.nn.dot_product_attention for training"
)


def moved(x, d, size):
    """x with its mapped axis first (broadcast when unmapped): for vmap rules."""
    return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)


def fold_query_slices(q, dq, sinks, ds, size: int, heads_kv: int):
    """vmap of queries against K/V shared by every slice, in one launch: the mapped axis joins the
    query heads of each KV group, so K/V are read once and never copied.

    q (b, s, h_q, d) mapped on axis dq (sinks (h_q,) on ds, or None). Query head h of slice i reads KV
    head h // g; ordering the folded heads (kv head, slice, group member) keeps that: folded head
    (j * n + i) * g + r reads KV head j = folded // (n * g). Returns (q folded, sinks folded or None,
    unfold) where unfold(o, lse) gives the per-slice (o (n, b, s, h_q, d), lse (n, b, h_q, s))."""
    q = moved(q, dq, size)
    n, b, s_q, h_q, d = q.shape
    g = h_q // heads_kv
    qf = q.reshape(n, b, s_q, heads_kv, g, d).transpose(1, 2, 3, 0, 4, 5).reshape(b, s_q, heads_kv * n * g, d)
    sf = None if sinks is None else moved(sinks, ds, size).reshape(n, heads_kv, g).transpose(1, 0, 2).reshape(-1)

    def unfold(o, lse):
        o = o.reshape(b, s_q, heads_kv, n, g, d).transpose(3, 0, 1, 2, 4, 5).reshape(n, b, s_q, h_q, d)
        lse = lse.reshape(b, heads_kv, n, g, s_q).transpose(2, 0, 1, 3, 4).reshape(n, b, h_q, s_q)
        return o, lse

    return qf, sf, unfold


@dataclass(frozen=True)
class OperandLayout:
    """The primitive's operands: the family's call operands in ABI order, those named in `optional`
    present only when the boolean param `optional[name]` is True, less those in `lowered` (operands
    the lowering derives from the others, e.g. the kvcache tile list: never the primitive's)."""

    family: KernelFamily
    optional: dict  # operand name -> the primitive's presence param (e.g. {"sinks": "has_sinks"})
    lowered: tuple = ()

    def __post_init__(self):
        names = [b.name for b in self.family.call.operands]
        bad = (set(self.optional) | set(self.lowered)) - set(names)
        if bad:
            raise ValueError(f"{self.family.name}: {sorted(bad)} are not operands of its call ({names})")
        not_optional = [b.name for b in self.family.call.operands if b.name in self.lowered and not b.optional]
        if not_optional:
            raise ValueError(f"{self.family.name}: lowering-derived operands must be optional in the call: {not_optional}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.family.call.operands if b.name not in self.lowered)

    def present(self, params: dict) -> tuple[str, ...]:
        return tuple(n for n in self.names if n not in self.optional or params[self.optional[n]])

    def split(self, operands, params: dict) -> dict:
        """name -> operand (None where absent), checking the count against the params."""
        for p in self.optional.values():
            check_flag(p, params[p])
        present = self.present(params)
        if len(operands) != len(present):
            # Name the presence param that disagrees with the operands, where one flip explains it.
            flips = [(n, p) for n, p in self.optional.items()
                     if len(self.present(dict(params, **{p: not params[p]}))) == len(operands)]
            hint = "".join(f"{p}={params[p]} but {n} is {'absent' if params[p] else 'given'}; " for n, p in flips[:1])
            raise ValueError(f"{hint}fa4_{self.family.name} takes {len(present)} operands with these params "
                             f"({', '.join(present)}), got {len(operands)}")
        named = dict.fromkeys(self.names)
        named.update(zip(present, operands))
        return named

    def join(self, named: dict) -> tuple:
        """The operands to bind, in order (those that are None left out)."""
        return tuple(named[n] for n in self.names if named.get(n) is not None)


def define_jitted_impl(prim) -> None:
    """Eager calls of `prim` compile the same way jitted ones do: one cached executable per param set
    and per setting of the environment switches the lowering reads (FA4_JAX_DISABLE_KERNELS,
    FA4_JAX_DISABLE_CUDNN), so flipping one in a running process takes effect for eager calls too."""

    @functools.lru_cache(maxsize=None)
    def jitted(switches, **params):
        del switches  # part of the cache key only
        return jax.jit(functools.partial(prim.bind, **params))

    def impl(*operands, **params):
        switches = (platform.kernels_disabled(), cudnn.cudnn_disabled())
        return jitted(switches, **params)(*operands)

    prim.def_impl(impl)


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(NO_GRAD)


def _no_transpose(cotangents, *args, **params):
    raise NotImplementedError(NO_GRAD)


def register_inference_only(prim) -> None:
    """JVP and transpose of `prim` raise: fa4_jax is forward-only."""
    compat.register_jvp(prim, _no_jvp)
    compat.register_transpose(prim, _no_transpose)


def primitive_pair(name: str, abstract_eval: Callable):
    """The public primitive `name` (abstract eval, eager impl, inference only; vmap and lowering come
    with `register`) and its per-shard primitive `name_local`, into which the public one lowers through
    the sharding rule and whose lowering is the kernel call (CUDA) or the reference."""
    outer = compat.Primitive(name)
    local = compat.Primitive(f"{name}_local")
    for prim in (outer, local):
        prim.multiple_results = True
        prim.def_abstract_eval(abstract_eval)
    define_jitted_impl(outer)
    register_inference_only(outer)
    return outer, local


def register(outer, local, *, reference: Callable, kernel: Callable, variant: Callable, is_empty: Callable,
             sharding_rules: tuple, batch_rule: Callable, cudnn_entry: str | None = None,
             shape_reason: Callable | None = None) -> None:
    """Lowering (per platform), custom partitioning and vmap of a primitive pair (see the module
    docstring; the arguments are those of register_local_lowerings and partitioning.register)."""
    register_local_lowerings(local, reference=reference, kernel=kernel, variant=variant, is_empty=is_empty,
                             shape_reason=shape_reason, cudnn_entry=cudnn_entry)
    partitioning.register(outer, local, *sharding_rules)
    compat.register_batching(outer, batch_rule)
