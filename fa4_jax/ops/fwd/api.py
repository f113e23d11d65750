"""The dense family's public function: `fa4_jax.attention`."""

from __future__ import annotations

import jax
from jax.typing import ArrayLike

from fa4_jax.core import cudnn
from fa4_jax.core.implementation import Implementation, resolve_implementation, trim_window
from fa4_jax.core.validation import check_flag, check_options, check_qkv
from fa4_jax.ops.fwd.primitive import fa4_fwd_p, kernel_variant

STATIC_ARGNAMES = ("causal", "softmax_scale", "window_size", "softcap", "return_lse", "implementation")

def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False, softmax_scale: float | None = None,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: ArrayLike | None = None,
              return_lse: bool = False,
              implementation: Implementation | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, forward only, FlashAttention-4 kernel on Hopper GPUs.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), bfloat16 or float16.
      k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype as q. heads_q must be a multiple of
        heads_kv (GQA / MQA: query head h reads key/value head h // (heads_q // heads_kv)).
        head_dim is one of 64, 96, 128, 192, 256. seqlen_q may differ from seqlen_k; a zero batch or
        seqlen gives empty outputs, seqlen_k = 0 rows that see no key.
      causal: mask aligned to the bottom-right corner: query i sees key j iff
        j <= i + seqlen_k - seqlen_q. Same as window_size=(-1, 0).
      softmax_scale: multiplies q @ k^T before the softmax; default 1 / sqrt(head_dim).
      window_size: (left, right) sliding window in keys around the bottom-right-aligned diagonal:
        query i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right;
        -1 = unbounded on that side. With causal=True, right must be 0 or -1 (both mean 0).
      softcap: if > 0, scores become softcap * tanh(scores / softcap) after scaling, before the
        softmax (Gemma-2 style logit capping); 0 = off.
      sinks: None or float (heads_q,) per-head logits that join each row's softmax denominator with
        no value row (gpt-oss attention sinks); may be a traced array. LSE includes the sink term.
      return_lse: also return the log-sum-exp of the (scaled, capped) scores, float32
        (batch, heads_q, seqlen_q), natural log.
      implementation: None runs the kernel where it can (decided per platform when the program is
        lowered: on CUDA when the GPU is a Hopper and the built kernel library has and loads the
        variant); on other CUDA GPUs cuDNN flash attention where it computes exactly this call (no
        softcap or sinks; a causal mask or window only with seqlen_q == seqlen_k: see
        fa4_jax/core/cudnn.py); the reference otherwise and on every other platform, so one traced
        program also exports for several platforms. "fa4" demands the kernel and raises if it
        cannot run here (at the call on a GPU host, otherwise when the program is lowered for a
        platform without it); "cudnn" demands cuDNN and raises likewise (ValueError at the call
        when cuDNN cannot express it); "xla" is the exact pure-JAX reference (float32 softmax).

    A query row with no visible key returns o = 0 and lse = -inf (with sinks: lse = its sink logit).

    Returns:
      o with q's shape and dtype, or (o, lse) when return_lse.

    Inference only: jax.grad through this function raises NotImplementedError.
    Under jax.jit every non-array argument must be static:
      jax.jit(attention, static_argnames=fa4_jax.attention.STATIC_ARGNAMES)
    """
    check_qkv(q, k, v)
    return_lse = check_flag("return_lse", return_lse)
    head_dim = q.shape[-1]
    scale, cap, window = check_options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                       softcap=softcap, sinks=sinks, heads_q=q.shape[2], head_dim=head_dim)
    left, right = trim_window(*window, q.shape[1], k.shape[1])
    # Everything is validated before the device/library probe, so a bad argument is reported as such.
    params = dict(softmax_scale=scale, window_left=left, window_right=right, softcap=cap, has_sinks=sinks is not None)
    operands = (q, k, v) if sinks is None else (q, k, v, sinks)
    implementation = resolve_implementation(implementation, lambda arch: kernel_variant(arch, q.dtype, head_dim, params),
                                            (cudnn.ATTENTION, operands, params))
    o, lse = fa4_fwd_p.bind(*operands, **params, implementation=implementation)
    return (o, lse) if return_lse else o


attention.STATIC_ARGNAMES = STATIC_ARGNAMES
