"""Public entry point: `fa4_jax.attention`."""

from __future__ import annotations

import math

from fa4_jax import _platform
from fa4_jax._validation import check_flag, check_qkv, check_softmax_scale, dtype_tag
from fa4_jax.families import FwdVariant
from fa4_jax.primitive import fa4_fwd_p


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
    """Maps the user's choice to "fa4" or "xla"; for "fa4" the kernel is also loaded on the device."""
    if implementation == "xla":
        return "xla"
    if implementation not in (None, "fa4"):
        raise ValueError(f'implementation must be None, "fa4" or "xla"; got {implementation=}')
    reason = _platform.unavailable_reason(lambda arch: FwdVariant(arch, dtype_tag(dtype), head_dim, causal))
    if reason is None:
        return "fa4"
    if implementation == "fa4":
        raise RuntimeError(f'implementation="fa4" cannot run here: {reason}')
    return "xla"
