"""Public entry point: `fa4_jax.attention`."""

from __future__ import annotations

from typing import Literal

import jax
from jax.typing import ArrayLike

from fa4_jax import _platform, cudnn
from fa4_jax._validation import check_flag, check_options, check_qkv
from fa4_jax.primitive import fa4_fwd_p, kernel_variant

STATIC_ARGNAMES = ("causal", "softmax_scale", "window_size", "softcap", "return_lse", "implementation")

# The public entry points' `implementation` argument (None: the kernel where it can run, else cuDNN
# where it computes exactly the call on a GPU, else the reference).
Implementation = Literal["fa4", "cudnn", "xla"]


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
        fa4_jax/cudnn.py); the reference otherwise and on every other platform, so one traced
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
    left, right = _trim_window(*window, q.shape[1], k.shape[1])
    # Everything is validated before the device/library probe, so a bad argument is reported as such.
    params = dict(softmax_scale=scale, window_left=left, window_right=right, softcap=cap, has_sinks=sinks is not None)
    operands = (q, k, v) if sinks is None else (q, k, v, sinks)
    implementation = resolve_implementation(implementation, lambda arch: kernel_variant(arch, q.dtype, head_dim, params),
                                            (cudnn.ATTENTION, operands, params))
    o, lse = fa4_fwd_p.bind(*operands, **params, implementation=implementation)
    return (o, lse) if return_lse else o


attention.STATIC_ARGNAMES = STATIC_ARGNAMES


def _trim_window(left: int, right: int, s_q, s_k) -> tuple[int, int]:
    """A side that reaches past every key is unbounded: (left >= s_k - 1) sees key 0 from every row,
    (right >= s_q - 1) sees key s_k - 1. Unbounded sides let the plain or causal kernel serve the
    call instead of the windowed one (same result, no per-element window test)."""
    if isinstance(s_k, int) and left >= max(s_k - 1, 0):
        left = -1
    if isinstance(s_q, int) and right >= max(s_q - 1, 0):
        right = -1
    return left, right


def resolve_implementation(implementation, variant, cudnn_call: tuple | None = None) -> str:
    """Maps the user's choice to the primitive's param: "xla", "fa4", "cudnn" or "auto" (None).

    "auto" is decided per platform when the program is lowered (fa4_jax/lowering.py), so a program
    traced on a CPU host and exported for CUDA carries the kernel. "fa4" is checked now as far as it
    can be: on a GPU default device everything (device, library, module load: see fa4_jax._platform),
    elsewhere (tracing for export) that the library holds the kernel `variant(arch)`; lowering it for
    a platform without the kernel raises. "cudnn" likewise: `cudnn_call` = (entry point, operands,
    primitive params) must map exactly onto cuDNN (ValueError otherwise), and a GPU default device
    must run it (RuntimeError otherwise)."""
    if implementation == "xla":
        return "xla"
    if implementation is None:
        return "auto"
    if implementation == "cudnn":
        return _resolve_cudnn(*cudnn_call)
    if implementation != "fa4":
        raise ValueError(f'implementation must be None, "fa4", "cudnn" or "xla"; got {implementation=}')
    device = _platform.default_device()
    if getattr(device, "platform", None) == "gpu":
        reason = _platform.unavailable_reason(variant, device)
    else:
        reason = _platform.library_reason(variant)
    if reason is not None:
        raise RuntimeError(f'implementation="fa4" cannot run here: {reason}')
    return "fa4"


def _resolve_cudnn(entry: str, operands: tuple, params: dict) -> str:
    reason = cudnn.cudnn_reason(entry, operands, params)
    if reason is not None:
        raise ValueError(f'implementation="cudnn" cannot express this call: {reason}. Use implementation=None '
                         '(the kernel, cuDNN or the reference, whichever computes it here) or "xla"')
    device = _platform.default_device()
    if getattr(device, "platform", None) == "gpu":
        reason = cudnn.device_reason([device], operands[0].shape[-1])
        if reason is not None:
            raise RuntimeError(f'implementation="cudnn" cannot run here: {reason}')
    return "cudnn"


def resolve_with_head_dims(implementation, variant, head_dim: int, kernel_head_dims: tuple, entry_point: str,
                           cudnn_call: tuple | None = None) -> str:
    """resolve_implementation for an entry point whose kernels cover only `kernel_head_dims`: with
    other head dims "fa4" raises before any library probe, None stays "auto" (the lowering then
    picks cuDNN or the reference)."""
    if head_dim not in kernel_head_dims and implementation == "fa4":
        raise RuntimeError(f'implementation="fa4" cannot run here: the {entry_point} kernels support head_dim '
                           f'{kernel_head_dims}, got {head_dim}; use implementation="xla" or None')
    return resolve_implementation(implementation, variant, cudnn_call)
