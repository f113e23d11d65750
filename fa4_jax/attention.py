"""Public entry point: `fa4_jax.attention`."""

from __future__ import annotations

import math

import jax

from fa4_jax._validation import check_flag, check_qkv, check_softmax_scale, dtype_tag
from fa4_jax.primitive import fa4_fwd_p
from fa4_jax.variants import FwdVariant

_BUILD_HINT = (
    "Build the kernel library with `pip install .` (or `python tools/build_inplace.py`) on a machine "
    "with the CUDA toolkit, or point FA4_JAX_LIBRARY at a built libfa4_jax.so."
)


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, implementation=None):
    """Scaled dot-product attention, forward only, FlashAttention-4 kernel on Hopper GPUs.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), bfloat16 or float16.
      k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype as q. heads_q must be a multiple of
        heads_kv (GQA / MQA: query head h reads key/value head h // (heads_q // heads_kv)).
        head_dim is one of 64, 96, 128, 192, 256. Any seqlens >= 1; seqlen_q may differ from seqlen_k.
      causal: mask aligned to the bottom-right corner: query i sees key j iff
        j <= i + seqlen_k - seqlen_q. Query rows that see no key (seqlen_q > seqlen_k) get
        o = 0 and lse = -inf.
      softmax_scale: multiplies q @ k^T before the softmax; default 1 / sqrt(head_dim).
      return_lse: also return the log-sum-exp of the scaled scores, float32
        (batch, heads_q, seqlen_q), natural log.
      implementation: None picks "fa4" when the default device is an sm_90 GPU and the built kernel
        library has the (dtype, head_dim, causal) variant, else "xla". "fa4" demands the kernel and
        raises if it cannot run here; "xla" is the exact pure-JAX reference (float32 softmax).

    Returns:
      o with q's shape and dtype, or (o, lse) when return_lse.

    Inference only: jax.grad through this function raises NotImplementedError.
    Under jax.jit every non-array argument must be static:
      jax.jit(attention, static_argnames=("causal", "softmax_scale", "return_lse", "implementation"))
    """
    check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    head_dim = q.shape[-1]
    scale = check_softmax_scale(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
    # Everything is validated before the device/library probe, so a bad argument is reported as such.
    implementation = resolve_implementation(implementation, dtype=q.dtype, head_dim=head_dim, causal=causal)
    o, lse = fa4_fwd_p.bind(q, k, v, softmax_scale=scale, causal=causal, implementation=implementation)
    return (o, lse) if return_lse else o


def resolve_implementation(implementation, *, dtype, head_dim: int, causal: bool) -> str:
    """Maps the user's choice to "fa4" or "xla"; for "fa4" also registers the FFI target."""
    if implementation == "xla":
        return "xla"
    if implementation is None:
        return "fa4" if _fa4_unavailable_reason(dtype, head_dim, causal) is None else "xla"
    if implementation == "fa4":
        reason = _fa4_unavailable_reason(dtype, head_dim, causal)
        if reason is not None:
            raise RuntimeError(f'implementation="fa4" cannot run here: {reason}')
        return "fa4"
    raise ValueError(f'implementation must be None, "fa4" or "xla"; got {implementation=}')


def _default_device():
    return jax.devices()[0]


def _fa4_unavailable_reason(dtype, head_dim: int, causal: bool) -> str | None:
    """None when the FA4 kernel can serve this call on the default device; else why not."""
    device = _default_device()
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return (
            f"the default device is {device.platform!r} ({device.device_kind}), not an NVIDIA Hopper GPU; "
            'use implementation="xla" or None'
        )
    # The kernels are compiled for sm_90a, whose instructions (wgmma, setmaxnreg) exist only on 9.0.
    if str(capability) != "9.0":
        return (
            f"the default GPU ({device.device_kind}) has compute capability {capability}; the FA4 kernels "
            'are built for 9.0 (Hopper) only; use implementation="xla" or None'
        )
    try:
        from fa4_jax import _ffi
    except ImportError as e:
        return f"the FFI loader fa4_jax._ffi cannot be imported ({e}). {_BUILD_HINT}"
    variant = FwdVariant("sm90", dtype_tag(dtype), head_dim, causal)
    built = _ffi.compiled_variants()
    if not built:  # library missing or unloadable; library_status() says which and what to do
        return f"the kernel library is unavailable: {_ffi.library_status()}"
    if variant not in built:
        return (
            f"the kernel library has no variant {variant.symbol} (it has {len(built)}: "
            f"{', '.join(sorted(v.symbol for v in built))}). Rebuild with that variant in "
            f"FA4_JAX_VARIANTS (unset means the full default menu). {_BUILD_HINT}"
        )
    if not _ffi.register_targets():
        return f"registering the FFI target {_ffi.FWD_TARGET} failed: {_ffi.library_status()}"
    return None

