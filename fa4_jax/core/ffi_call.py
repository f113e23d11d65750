"""The Python side of a family's FFI call, generated from its CallSignature (fa4_jax/families/base.py).

`kernel_call(family, arrays, attrs, dims)` packs the operands in ABI order (an absent optional operand
becomes a zero-size array plus has_<name> = False; an absent filled one an array of its fill value),
gives every attribute its declared type, derives the result shapes from the operands' dims, and
returns the results that are not workspace. The C++ side is generated from the same signature
(fa4_jax/aot/codegen.py); tests/test_call_signature.py checks that the two agree for every family.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.families.base import ATTR_TYPES, OPT_IN_ATTR, Buffer, KernelFamily

_JNP_DTYPES = {"f32": jnp.float32, "i32": jnp.int32}


def bind_dims(buffers, arrays: dict, dims: dict | None = None) -> dict:
    """Symbolic dim name -> size, from the given operands' shapes (and `dims` for names no operand has)."""
    sizes = dict(dims or {})
    for b in buffers:
        x = arrays.get(b.name)
        if x is None:
            continue
        if len(x.shape) != len(b.dims):
            raise ValueError(f"{b.name} must be rank {len(b.dims)} {b.dims}; got shape {tuple(x.shape)}")
        for name, size in zip(b.dims, x.shape):
            sizes.setdefault(name, size)
    return sizes


def _dtype(b: Buffer, input_dtype):
    return input_dtype if b.dtype in ("input", "cache") else _JNP_DTYPES[b.dtype]


def pack_operands(family: KernelFamily, arrays: dict, sizes: dict) -> tuple[list, dict]:
    """(operands in ABI order, presence attributes) for `arrays` (name -> array or None)."""
    call = family.call
    unknown = set(arrays) - {b.name for b in call.operands}
    if unknown:
        raise ValueError(f"{family.name}: not operands of its call: {sorted(unknown)}")
    input_dtype = arrays[call.operands[0].name].dtype
    out, presence = [], {}
    for b in call.operands:
        x = arrays.get(b.name)
        if b.optional:
            presence[f"has_{b.name}"] = x is not None
            if x is None:
                x = jnp.zeros((0,) * len(b.dims), _dtype(b, input_dtype))
        elif x is None and b.fill is not None:
            x = jnp.full(tuple(sizes[d] for d in b.dims), b.fill, _dtype(b, input_dtype))
        elif x is None:
            raise ValueError(f"{family.name}: operand {b.name} is required")
        elif b.dtype not in ("input", "cache"):  # a cache keeps its own dtype (16-bit or FP8)
            x = jnp.asarray(x).astype(_dtype(b, input_dtype))
        out.append(x)
    return out, presence


def kernel_call(family: KernelFamily, arrays: dict, attrs: dict, dims: dict | None = None, *,
                opt_in: bool = False) -> tuple:
    """The family's FFI custom call on `arrays` (operand name -> array, None = absent) with `attrs`
    (every declared attribute, by name; the presence ones are derived) and `dims` (sizes of result
    dims no operand binds, e.g. the workspace's "splits"). `opt_in` (implementation="fa4") becomes the
    generated OPT_IN_ATTR: the handler then also runs kernels outside VALIDATED_ARCHES. Returns the
    non-workspace results."""
    call = family.call
    missing = {a.name for a in call.attrs} ^ set(attrs)
    if missing:
        raise ValueError(f"{family.name}: attributes must be exactly {[a.name for a in call.attrs]}; "
                         f"got {sorted(attrs)}")
    sizes = bind_dims(call.operands, arrays, dims)
    operands, presence = pack_operands(family, arrays, sizes)
    input_dtype = operands[0].dtype
    results = tuple(jax.ShapeDtypeStruct(tuple(sizes[d] for d in b.dims), _dtype(b, input_dtype))
                    for b in call.results)
    # Attribute types are part of the FFI ABI: each goes as its declared numpy type.
    derived = dict(presence, **{OPT_IN_ATTR.name: bool(opt_in)})
    typed = {a.name: getattr(np, ATTR_TYPES[a.dtype][1])(attrs.get(a.name, derived.get(a.name)))
             for a in call.all_attrs}
    outs = jax.ffi.ffi_call(family.target, results)(*operands, **typed)
    return tuple(o for o, b in zip(outs, call.results) if not b.workspace)
