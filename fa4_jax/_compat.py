"""The one place where fa4_jax touches JAX APIs that move between versions.

Supported: jax 0.10 (build host) and 0.11 (GPU host). Every name is taken from its public home
first; only if that is gone or deprecated there (jax warns before it removes) do we reach into
jax._src, so a rename costs a warning-free fallback here instead of a crash elsewhere.
"""

from __future__ import annotations

import importlib
import warnings

import jax.ffi


def _public_or_private(name: str, public: str, private: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return getattr(importlib.import_module(public), name)
        except (ImportError, AttributeError, DeprecationWarning):
            pass
    return getattr(importlib.import_module(private), name)


Primitive = _public_or_private("Primitive", "jax.extend.core", "jax._src.core")
ShapedArray = _public_or_private("ShapedArray", "jax.core", "jax._src.core")
lower_fun = _public_or_private("lower_fun", "jax.interpreters.mlir", "jax._src.interpreters.mlir")
register_lowering = _public_or_private("register_lowering", "jax.interpreters.mlir", "jax._src.interpreters.mlir")
_primitive_jvps = _public_or_private("primitive_jvps", "jax.interpreters.ad", "jax._src.interpreters.ad")
_primitive_transposes = _public_or_private("primitive_transposes", "jax.interpreters.ad", "jax._src.interpreters.ad")
_primitive_batchers = _public_or_private(
    "primitive_batchers", "jax.interpreters.batching", "jax._src.interpreters.batching"
)

ffi_lowering = jax.ffi.ffi_lowering
mlir_ir = _public_or_private("ir", "jax.interpreters.mlir", "jax._src.interpreters.mlir")


def register_batching(prim, rule) -> None:
    """rule(args, dims, **params) -> (outs, out_dims); an unbatched operand has dim None."""
    _primitive_batchers[prim] = rule


def register_jvp(prim, rule) -> None:
    _primitive_jvps[prim] = rule


def register_transpose(prim, rule) -> None:
    _primitive_transposes[prim] = rule


def mark_requires_devices_during_lowering(prim) -> None:
    """`prim` lowers through custom_partitioning, which needs the device assignment while lowering;
    jax only provides it to jaxprs containing a primitive in this set (as for its cuDNN attention)."""
    from jax._src import dispatch  # private: no public home

    dispatch.prim_requires_devices_during_lowering.add(prim)
