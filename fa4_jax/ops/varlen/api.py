"""Packed variable-length batches: `attention_varlen` (FlashAttention's `flash_attn_varlen_func`
conventions: (total_tokens, heads, head_dim) tensors and int32 cumulative offsets)."""

from __future__ import annotations

import jax
from jax.typing import ArrayLike

from fa4_jax.core import cudnn
from fa4_jax.core.implementation import Implementation, resolve_implementation, trim_window
from fa4_jax.core.validation import check_flag, check_options, check_varlen
from fa4_jax.ops.varlen.primitive import fa4_varlen_p, kernel_variant

STATIC_ARGNAMES = ("max_seqlen_q", "max_seqlen_k", "causal", "softmax_scale", "window_size", "softcap", "return_lse",
                   "implementation")


def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     seqused_k: ArrayLike | None = None, causal: bool = False, softmax_scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: ArrayLike | None = None,
                     return_lse: bool = False,
                     implementation: Implementation | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a batch of sequences of different lengths, packed without padding.

    Args:
      q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); bfloat16 or float16.
      cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,): sequence b owns query rows
        [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]). Empty
        sequences are allowed. Offsets must be non-decreasing and within the tensors (not checked:
        that needs a device sync; violations give unspecified results, never out-of-bounds writes).
      max_seqlen_q, max_seqlen_k: optional static hints (ints) bounding the sequence lengths. The
        kernel's grid is sized by max_seqlen_q (default: total_q): a tighter bound launches fewer
        empty tiles. It must hold: query rows of a sequence past max_seqlen_q are not computed.
        Exporting with a symbolic token count, the kernel needs max_seqlen_q (without it the CUDA
        lowering runs the reference, and "fa4" raises).
      seqused_k: optional int32 (batch,): use only the first seqused_k[b] keys of sequence b.
      causal, softmax_scale, window_size, softcap, sinks, return_lse: as for `fa4_jax.attention`, with
        masks aligned to the bottom-right corner of each sequence.
      implementation: None, "fa4", "cudnn" or "xla" as for `fa4_jax.attention` (kernels at every
        head_dim). Packed batches have no exact cuDNN mapping: None runs the reference where no
        kernel serves the call, and "cudnn" raises ValueError.

    Query rows past cu_seqlens_q[-1] belong to no sequence: o = 0 there.
    Returns o like q, or (o, lse) with lse float32 (heads_q, total_q).
    Under jax.jit mark the non-array arguments static: attention_varlen.STATIC_ARGNAMES.
    """
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    return_lse = check_flag("return_lse", return_lse)
    scale, cap, window = check_options(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                       softcap=softcap, sinks=sinks, heads_q=q.shape[1], head_dim=q.shape[-1])
    left, right = trim_window(*window, q.shape[0], k.shape[0])
    head_dim = q.shape[-1]
    params = dict(softmax_scale=scale, window_left=left, window_right=right, softcap=cap,
                  has_seqused=seqused_k is not None, has_sinks=sinks is not None, max_seqlen_q=int(max_seqlen_q or 0))
    operands = tuple(x for x in (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks) if x is not None)
    implementation = resolve_implementation(implementation, lambda arch: kernel_variant(arch, q.dtype, head_dim, params),
                                            (cudnn.VARLEN, operands, params))
    o, lse = fa4_varlen_p.bind(*operands, **params, implementation=implementation)
    return (o, lse) if return_lse else o


attention_varlen.STATIC_ARGNAMES = STATIC_ARGNAMES
