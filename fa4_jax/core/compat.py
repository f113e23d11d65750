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


# --------------------------------------------------------------------------------------------------
# jax's cuDNN fused attention (fa4_jax/core/cudnn.py). Private in every jax version: jax.nn's public
# dot_product_attention(implementation="cudnn") returns no float32 LSE (it casts the residual to the
# output dtype), so fa4_jax calls the function underneath it, after checking that it takes what we pass.

_CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
_CUDNN_KEYWORDS = ("q_seqlen", "kv_seqlen", "scale", "mask_type", "qkv_layout", "sliding_window_length",
                   "return_residual")
_CUDNN_MASKS = {"none": "NO_MASK", "causal": "CAUSAL", "padding": "PADDING"}


def _cudnn_module():
    """jax's cuDNN attention module, or a str saying why this jax's one is not usable."""
    import inspect

    try:
        module = importlib.import_module(_CUDNN_MODULE)
        params = inspect.signature(module.dot_product_attention).parameters
        mask_type = module.MaskType
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return f"this jax has no usable cuDNN attention ({_CUDNN_MODULE}: {e})"
    missing = [name for name in _CUDNN_KEYWORDS if name not in params]
    missing += [f"MaskType.{m}" for m in _CUDNN_MASKS.values() if not hasattr(mask_type, m)]
    if missing:
        return (f"this jax's cuDNN attention ({_CUDNN_MODULE}.dot_product_attention) lacks {', '.join(missing)}, "
                "which fa4_jax passes")
    return module


def cudnn_api_reason() -> str | None:
    """None when this jax's cuDNN attention takes the arguments fa4_jax passes, else why not."""
    module = _cudnn_module()
    return module if isinstance(module, str) else None


def cudnn_version() -> int | None:
    """The cuDNN version jax uses in this process (e.g. 91000 for 9.10.0), None without one (a CPU
    jaxlib, or the CUDA plugin did not load)."""
    module = _cudnn_module()
    if isinstance(module, str):
        return None
    try:
        return int(module.check_cudnn_version())
    except Exception:  # noqa: BLE001 - jax raises RuntimeError("cuDNN is not detected."); older ones other types
        return None


def cudnn_attention(q, k, v, *, q_seqlen, kv_seqlen, scale: float, mask: str, sliding_window_length):
    """jax's cuDNN flash attention, (b, s, h, d) layout: returns (o like q, float32 (b, h_q, s_q)
    natural-log softmax statistics, i.e. the LSE). mask: "none", "causal" (top-left) or "padding"
    (q_seqlen / kv_seqlen int32 (b,)). Traceable; it reads the cuDNN version and the default GPU
    while tracing (jax's own checks)."""
    module = _cudnn_module()
    if isinstance(module, str):
        raise RuntimeError(module)
    mask_type = getattr(module.MaskType, _CUDNN_MASKS[mask])
    o, stats = module.dot_product_attention(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, scale=scale,
                                            mask_type=mask_type, qkv_layout="BTNH",
                                            sliding_window_length=sliding_window_length, return_residual=True)
    return o, stats
