"""The one place where fa4_jax touches JAX APIs that move between versions.

Supported: jax 0.10 (build host) and 0.11 (GPU host). Everything here is public API in both; the
fallbacks cover older spellings so a future rename breaks one file, not five.
"""

from __future__ import annotations

import jax
import jax.ffi

try:  # public home of Primitive since jax 0.4.36
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older jax
    from jax.core import Primitive  # type: ignore[no-redef]

try:
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - if jax.core drops the re-export
    from jax._src.core import ShapedArray  # type: ignore[no-redef]

from jax.interpreters import ad, batching, mlir

__all__ = [
    "Primitive",
    "ShapedArray",
    "ad",
    "batching",
    "mlir",
    "ffi_lowering",
    "register_lowering",
    "lower_fun",
    "register_batching",
    "register_jvp",
    "register_transpose",
]

ffi_lowering = jax.ffi.ffi_lowering
register_lowering = mlir.register_lowering
lower_fun = mlir.lower_fun

def register_batching(prim, rule) -> None:
    batching.primitive_batchers[prim] = rule


def register_jvp(prim, rule) -> None:
    ad.primitive_jvps[prim] = rule


def register_transpose(prim, rule) -> None:
    ad.primitive_transposes[prim] = rule
