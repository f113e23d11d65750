"""Flax integration: an `attention_fn` drop-in and an inference attention layer with a KV cache.

    from fa4_jax.flax import FA4Attention, dot_product_attention

    layer = nnx.MultiHeadAttention(..., dtype=jnp.bfloat16, attention_fn=dot_product_attention)
    attn = FA4Attention(num_heads=8, in_features=512, num_kv_heads=2, rope_theta=10000.0,
                        dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    attn.init_cache(batch_size, max_length)
    y = attn(prompt, decode=True, lengths=prompt_lengths)   # prefill (right-padded rows)
    y = attn(next_token, decode=True)                       # one decode step per row

Flax is an optional dependency (`pip install 'fa4-jax[flax]'`): `import fa4_jax` never imports it,
only `import fa4_jax.flax` does. Inference only, like the rest of fa4_jax (no gradients).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

try:
    from flax import linen, nnx
    from flax.nnx.nn import dtypes as nnx_dtypes
    from flax.nnx.nn.linear import default_kernel_init
except ModuleNotFoundError as e:  # only a missing flax; a broken install reports its own error
    if e.name is None or e.name.split(".")[0] != "flax":
        raise
    raise ImportError("fa4_jax.flax needs flax; install it with: pip install 'fa4-jax[flax]'") from e

import fa4_jax
from fa4_jax.core.implementation import Implementation
from fa4_jax.core.validation import KERNEL_DTYPES, check_options
from fa4_jax.families import HEAD_DIMS
from fa4_jax.ops.kvcache.quant import FP8, check_scale

__all__ = ["FA4Attention", "dot_product_attention", "rotary_embedding"]

Array = jax.Array

# Reasons already reported by dot_product_attention: each is warned about once per process (the
# reasons are static, so a jitted model warns while it traces, not on every step).
_WARNED: set[str] = set()


def _fall_back(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"fa4_jax.flax.dot_product_attention falls back to flax's attention: {reason}", stacklevel=3)


def _kernel_blocker(q, k, v, *, bias, mask, dropout_active: bool, module, is_causal: bool, custom_einsum: bool,
                    unknown: dict) -> str | None:
    """Why fa4_jax.attention cannot compute exactly what flax would (None: it can). The first reason
    found is reported; each message names the way out."""
    if unknown:
        return f"unrecognised keyword arguments {sorted(unknown)} (a newer flax?); fa4_jax cannot know their meaning"
    if module is not None:
        return "attention weights are sown (sow_weights=True / module=...); the FA4 kernels never materialise them"
    if dropout_active:
        return ("active dropout (dropout_rate > 0 and deterministic=False); fa4_jax is inference-only: "
                "pass deterministic=True")
    if bias is not None:
        return "an attention bias was given; fa4_jax supports no additive bias"
    if mask is not None:
        return ("an arbitrary boolean mask was given; fa4_jax runs only causal/no-mask attention: use is_causal=True "
                "or FA4Attention (whose KV cache needs no mask)")
    if custom_einsum:
        return "a custom einsum / dot_general was given (e.g. quantization); the FA4 kernels run their own matmuls"
    if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
        return (f"{jnp.dtype(q.dtype).name} inputs: the FA4 kernels take bfloat16/float16; "
                "set dtype=jnp.bfloat16 on the attention module")
    if not (q.ndim == k.ndim == v.ndim >= 3 and q.shape[:-3] == k.shape[:-3] and k.shape == v.shape
            and q.shape[-1] == k.shape[-1] and q.shape[-2] % k.shape[-2] == 0):
        return (f"shapes q {q.shape}, k {k.shape}, v {v.shape} are not (batch..., length, heads, head_dim) with "
                "shared head_dim, equal k/v shapes and query heads a multiple of key/value heads")
    if q.shape[-1] not in HEAD_DIMS:
        return f"head_dim {q.shape[-1]}: the FA4 kernels support head_dim {HEAD_DIMS}"
    if is_causal and q.shape[-3] != k.shape[-3]:
        return (f"is_causal with q_length {q.shape[-3]} != kv_length {k.shape[-3]}: flax aligns the causal mask to "
                "the top-left corner, fa4_jax to the bottom-right")
    return None


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
    is_causal: bool = False,
    force_fp32_for_softmax: bool | None = None,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
    implementation: Implementation | None = None,
    **kwargs: Any,
) -> Array:
    """`flax.nnx.dot_product_attention` / `flax.linen.dot_product_attention` on the FA4 kernels.

    A drop-in `attention_fn=` for `nnx.MultiHeadAttention` and linen `MultiHeadDotProductAttention`,
    with their arguments and meaning: query (batch..., q_length, heads, head_dim), key/value
    (batch..., kv_length, kv_heads, head_dim) (any number of leading batch dims, or none; GQA when
    kv_heads divides heads), softmax scale 1/sqrt(head_dim), output (batch..., q_length, heads, head_dim)
    in the compute dtype (`dtype`, else promoted from the inputs by `promote_dtype`).

    `fa4_jax.attention` (the FA4 kernel on a Hopper GPU, its exact reference elsewhere) runs when the
    call is attention it computes exactly: no `mask`, no `bias`, no active dropout (dropout_rate == 0 or
    deterministic), no weight sowing (`module` None), no custom einsum, bfloat16/float16 compute dtype,
    a head_dim the kernels support, and `is_causal` only with q_length == kv_length (flax aligns the
    causal mask top-left, fa4_jax bottom-right; they agree on square masks). `precision` is ignored
    there, as flax's own fast path (jax.nn.dot_product_attention) ignores it.

    Anything else is not guessed at: the call goes to flax's own function with the same arguments
    (linen's `dot_product_attention` for a linen caller, recognised by the keywords only linen passes:
    force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum, or a
    linen `module`; `nnx.dot_product_attention` otherwise), and a warning says why, once per distinct
    reason per process. nnx's own decode mode (`decode=True` with `init_cache`) always passes a mask
    built from its cache index, so it falls back; FA4Attention has a mask-free KV cache instead.
    Silence the warnings with `warnings.filterwarnings("ignore", message="fa4_jax.flax")`.

    implementation: None, "fa4", "cudnn" or "xla", passed to fa4_jax.attention (use it with functools.partial).
    **kwargs: keywords of a newer flax; any given means fallback (with their meaning unknown).
    """
    linen_call = (any(x is not None for x in (force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum,
                                               attn_weights_value_einsum)) or isinstance(module, linen.Module))
    q, k, v = promote_dtype((query, key, value), dtype=dtype)
    reason = _kernel_blocker(
        q, k, v, bias=bias, mask=mask, dropout_active=dropout_rate > 0.0 and not deterministic, module=module,
        is_causal=is_causal, unknown=kwargs,
        custom_einsum=any(x is not None for x in (einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum)))
    if reason is None:
        lead = q.shape[:-3]
        flat = lambda x: x.reshape((math.prod(lead), *x.shape[-3:]))  # noqa: E731
        out = fa4_jax.attention(flat(q), flat(k), flat(v), causal=bool(is_causal), implementation=implementation)
        return out.reshape(q.shape)
    _fall_back(reason)
    if not linen_call:
        return nnx.dot_product_attention(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                                         deterministic, dtype, precision, module, promote_dtype, is_causal, **kwargs)
    if is_causal:  # linen's function has no is_causal: the same top-left mask nnx would build
        causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    return linen.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision,
        module, bool(force_fp32_for_softmax), einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum,
        **kwargs)


def rotary_embedding(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding, rotate-half convention (Llama / GPT-NeoX): dimension i < d/2 pairs with
    i + d/2 and turns by positions * theta**(-2i/d). x (b, s, heads, d), positions int (b, s).
    FA4Attention applies it to q and k (rope_theta); public for layers that build their own core."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # (b, s, 1, half)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class FA4Attention(nnx.Module):
    """Multi-head attention for inference on the FA4 kernels, with a per-row KV cache.

    Projections as in `nnx.MultiHeadAttention` (same submodule names `query`, `key`, `value`, `out`,
    same initializers and parameter shapes, built in the same order, so one seed gives both modules the
    same parameters): inputs (batch, length, features) -> q (batch, length, num_heads, head_dim) and
    k/v (batch, length, num_kv_heads, head_dim) -> attention -> out_features.

    Args:
      num_heads: query heads; qkv_features must be divisible by it (head_dim = qkv_features // num_heads,
        one of 64, 96, 128, 192, 256).
      in_features: features of inputs_q.
      qkv_features: query/key/value features over all heads (default in_features).
      out_features: output features (default in_features).
      num_kv_heads: key/value heads (GQA / MQA), dividing num_heads; default num_heads.
      in_kv_features: features of inputs_k / inputs_v for cross-attention (default in_features).
      causal: causal self-attention (bottom-right aligned, as in fa4_jax.attention).
      window_size, softcap: as for fa4_jax.attention.
      use_sinks: a learnable per-head sink logit (`sinks`, float32 (num_heads,), initialised to zero)
        joins every softmax denominator (gpt-oss).
      rope_theta: None (no positional encoding here) or the base of a rotary embedding (rotate-half
        convention) applied to q and k, at absolute token positions, before k is cached.
      dropout_rate: must be 0: this layer is inference-only (fa4_jax has no backward pass).
      dtype: compute dtype, bfloat16 or float16 (the kernels' dtypes); None infers it from the inputs
        and parameters as nnx does, and the call raises if that is not bfloat16/float16. float32 is
        refused rather than silently cast: pass dtype=jnp.bfloat16 (param_dtype may stay float32).
      param_dtype, kernel_init, bias_init, use_bias, precision: as for nnx.MultiHeadAttention.
      implementation: None, "fa4", "cudnn" or "xla", passed to the fa4_jax calls ("fa4" demands the kernels,
        "cudnn" jax's cuDNN attention, which has no paged cache).
      rngs: nnx.Rngs for the parameter initializers.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        use_sinks: bool = False,
        rope_theta: float | None = None,
        dropout_rate: float = 0.0,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = default_kernel_init,
        bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
        use_bias: bool = True,
        precision: Any = None,
        implementation: Implementation | None = None,
        rngs: nnx.Rngs,
    ):
        if dropout_rate != 0.0:
            raise ValueError(f"FA4Attention is inference-only (fa4_jax has no backward pass): dropout_rate must be 0, "
                             f"got {dropout_rate}")
        if dtype is not None and jnp.dtype(dtype) not in KERNEL_DTYPES:
            raise ValueError(f"FA4Attention computes in bfloat16 or float16 (the FA4 kernels' dtypes); got dtype="
                             f"{jnp.dtype(dtype).name}. Use dtype=jnp.bfloat16 (param_dtype may stay float32).")
        qkv_features = in_features if qkv_features is None else qkv_features
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if qkv_features % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads}) and "
                             f"num_heads by num_kv_heads ({num_kv_heads})")
        self.head_dim = qkv_features // num_heads
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim = qkv_features // num_heads = {self.head_dim}; the FA4 kernels support "
                             f"head_dim {HEAD_DIMS}")
        if implementation not in (None, "fa4", "cudnn", "xla"):
            raise ValueError(f'implementation must be None, "fa4", "cudnn" or "xla"; got {implementation!r}')
        # fa4_jax's own checks, now rather than at the first call. self.window_size is the normalised
        # window, causal folded in ((-1, 0) for plain causal): the decode alignment reads it.
        _, self.softcap, self.window_size = check_options(
            causal=causal, softmax_scale=None, window_size=window_size, softcap=softcap, sinks=None,
            heads_q=num_heads, head_dim=self.head_dim)
        self.num_heads, self.num_kv_heads, self.in_features = num_heads, num_kv_heads, in_features
        self.causal, self.rope_theta, self.dtype, self.implementation = causal, rope_theta, dtype, implementation

        linear = lambda n_in, n_out, **kw: nnx.LinearGeneral(  # noqa: E731
            n_in, n_out, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
            use_bias=use_bias, precision=precision, rngs=rngs, **kw)
        in_kv = in_features if in_kv_features is None else in_kv_features
        self.query = linear(in_features, (num_heads, self.head_dim))
        self.key = linear(in_kv, (num_kv_heads, self.head_dim))
        self.value = linear(in_kv, (num_kv_heads, self.head_dim))
        self.out = linear((num_heads, self.head_dim), in_features if out_features is None else out_features,
                          axis=(-2, -1))
        self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if use_sinks else nnx.data(None)
        # The KV cache (nnx.Cache variables), created by init_cache.
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_lengths: nnx.Cache | None = nnx.data(None)
        self.page_table: nnx.Cache | None = nnx.data(None)
        self.k_scale: nnx.Cache | None = nnx.data(None)  # FP8 caches only (init_cache)
        self.v_scale: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, *, page_size: int | None = None,
                   num_pages: int | None = None, page_table: Array | None = None, dtype: Any = None,
                   k_scale: Any = None, v_scale: Any = None) -> None:
        """Creates an empty KV cache (replacing any earlier one) as nnx.Cache variables.

        Contiguous: `cached_key` / `cached_value` (batch_size, max_length, num_kv_heads, head_dim).
        Paged (page_size given, any int >= 1): a page pool (num_pages, page_size,
        num_kv_heads, head_dim) and `page_table` int32 (batch_size, ceil(max_length / page_size)), by
        default row b owning pages [b * max_pages, (b + 1) * max_pages); num_pages defaults to
        batch_size * max_pages. Rows may share pages (a common prefix) as long as no two rows write them.
        `cache_lengths` int32 (batch_size,) counts the valid tokens of each row (zeros here).

        dtype: the cache dtype, default the module's dtype (required when that is None): the compute
        dtype, or jnp.float8_e4m3fn for an FP8 cache (half the bytes; fa4_jax.update_kvcache and
        attention_with_kvcache with k_scale / v_scale). An FP8 cache keeps its scales as cache
        variables `k_scale` / `v_scale`, float32 (num_kv_heads,), from `k_scale` / `v_scale` here
        (a number or a (num_kv_heads,) array; default 1.0) and settable later, e.g. from calibration
        (`layer.k_scale[...] = ...`): the cache holds value / scale and attention reads fp8 * scale.
        A prompt into empty rows still attends to its own unquantized keys through the dense kernel
        (as with a 16-bit cache); every later call reads the FP8 cache. The caller keeps every row
        within max_length: writes past it are dropped and the results of that row are unspecified.
        """
        dtype = self.dtype if dtype is None else dtype
        fp8 = dtype is not None and jnp.dtype(dtype) == FP8
        if dtype is None or not (fp8 or jnp.dtype(dtype) in KERNEL_DTYPES):
            raise ValueError(f"init_cache needs dtype=jnp.bfloat16 or jnp.float16 (the compute dtype) or "
                             f"jnp.float8_e4m3fn (an FP8 cache); got {dtype} with the module's dtype {self.dtype}")
        if not fp8 and (k_scale is not None or v_scale is not None):
            raise ValueError(f"k_scale / v_scale belong to an FP8 cache (dtype=jnp.float8_e4m3fn); got dtype="
                             f"{jnp.dtype(dtype).name}")
        scales = None
        if fp8:  # checked (and for host values: positive and finite) before anything is allocated
            scales = tuple(jnp.broadcast_to(check_scale(name, x, self.num_kv_heads), (self.num_kv_heads,))
                           for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1; got {batch_size}, {max_length}")
        tail = (self.num_kv_heads, self.head_dim)
        if page_size is None:
            if page_table is not None or num_pages is not None:
                raise ValueError("page_table / num_pages describe a paged cache: pass page_size too")
            shape, table = (batch_size, max_length, *tail), None
        else:
            if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
                raise ValueError(f"page_size must be an int >= 1 (tokens per page); got {page_size!r}")
            max_pages = -(-max_length // page_size)
            num_pages = batch_size * max_pages if num_pages is None else num_pages
            if page_table is None:
                if num_pages < batch_size * max_pages:
                    raise ValueError(f"num_pages={num_pages} is too few for the default page table "
                                     f"({batch_size} rows x {max_pages} pages); pass a page_table or more pages")
                table = jnp.arange(batch_size * max_pages, dtype=jnp.int32).reshape(batch_size, max_pages)
            else:
                table = jnp.asarray(page_table, jnp.int32)
                if table.shape != (batch_size, max_pages):
                    raise ValueError(f"page_table must have shape (batch_size, ceil(max_length / page_size)) = "
                                     f"{(batch_size, max_pages)}; got {table.shape}")
                if not isinstance(table, jax.core.Tracer) and not bool(((table >= 0) & (table < num_pages)).all()):
                    raise ValueError(f"page_table ids must lie in [0, num_pages={num_pages})")
            shape = (num_pages, page_size, *tail)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_lengths = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))
        self.page_table = nnx.data(None) if table is None else nnx.Cache(table)
        self.k_scale = nnx.data(None) if scales is None else nnx.Cache(scales[0])
        self.v_scale = nnx.data(None) if scales is None else nnx.Cache(scales[1])

    def reset_cache(self, rows: Array | None = None) -> None:
        """Empties the cache rows `rows` (int indices; None = all) by zeroing their lengths, e.g. to
        start new sequences in those rows. The stale keys stay in memory but are never attended to."""
        if self.cache_lengths is None:
            raise ValueError("FA4Attention has no cache to reset: call init_cache first")
        lengths = self.cache_lengths[...]
        self.cache_lengths[...] = jnp.zeros_like(lengths) if rows is None else lengths.at[jnp.asarray(rows)].set(0)

    def __call__(self, inputs_q: Array, inputs_k: Array | None = None, inputs_v: Array | None = None, *,
                 decode: bool = False, lengths: Array | None = None, positions: Array | None = None) -> Array:
        """Attention of inputs_q (batch, length, in_features) -> (batch, length, out_features).

        decode=False: self-attention over inputs_q, or cross-attention to inputs_k (and inputs_v,
        default inputs_k), through fa4_jax.attention; the cache is neither read nor written.

        decode=True (after init_cache): the s_new tokens of inputs_q (a whole prompt, or one token per
        step) are appended to each row's own cache at its current length, then attend to everything
        cached for that row (through fa4_jax.attention_with_kvcache), and the row lengths advance.
        `lengths` int32 (batch,): how many of the s_new tokens of each row are real (rows are
        right-padded; default all). Padding tokens are invisible to the real ones and are overwritten by
        the next call; their outputs are meaningless. With padded rows the mask must be causal, or
        right-window 0, or no mask at all (a key right of a real query could be padding).

        positions: int (batch, length) or (length,) absolute token positions for RoPE (unused without
        rope_theta); default arange(length), or with decode each row's cache positions (its length
        before the call + i).

        Under nnx.jit pass the module as an argument: the cache variables are updated in place.
        """
        if inputs_q.ndim != 3 or inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"inputs_q must be (batch, length, in_features={self.in_features}); got {inputs_q.shape}")
        if decode and (inputs_k is not None or inputs_v is not None):
            raise ValueError("decode=True is self-attention over the cache: pass inputs_q only")
        if inputs_k is None and inputs_v is not None:
            raise ValueError("inputs_v needs inputs_k")
        if inputs_k is not None and self.rope_theta is not None:
            raise ValueError("rope_theta with cross-attention (inputs_k) has no defined key positions; "
                             "apply the rotary embedding outside this layer")
        if lengths is not None and not decode:
            raise ValueError("lengths (right-padded rows) applies to decode=True only")
        kv_in = inputs_q if inputs_k is None else inputs_k
        q, k, v = self.query(inputs_q), self.key(kv_in), self.value(kv_in if inputs_v is None else inputs_v)
        if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
            raise TypeError(f"FA4Attention computes in {jnp.dtype(q.dtype).name} (inferred from the inputs and "
                            "parameters); the FA4 kernels take bfloat16/float16: construct it with dtype=jnp.bfloat16")
        b, s = q.shape[:2]
        options = dict(window_size=self.window_size, softcap=self.softcap, implementation=self.implementation,
                       sinks=None if self.sinks is None else self.sinks[...])
        old = None
        if decode:
            if self.cache_lengths is None:
                raise ValueError("FA4Attention(decode=True) needs a KV cache: call init_cache(batch_size, max_length) "
                                 "first")
            old = self.cache_lengths[...]
            if old.shape[0] != b:
                raise ValueError(f"inputs_q has batch {b} but the cache was made for batch {old.shape[0]}")
        if self.rope_theta is not None:
            if positions is None:
                positions = jnp.arange(s, dtype=jnp.int32)[None] + (0 if old is None else old[:, None])
            positions = jnp.broadcast_to(jnp.asarray(positions), (b, s))
            q, k = rotary_embedding(q, positions, self.rope_theta), rotary_embedding(k, positions, self.rope_theta)
        if not decode:
            o = fa4_jax.attention(q, k, v, causal=self.causal, **options)
            return self.out(o)

        fp8 = jnp.dtype(self.cached_key.dtype) == FP8
        if self.cached_key.dtype != k.dtype and not fp8:
            raise TypeError(f"the cache holds {jnp.dtype(self.cached_key.dtype).name} but the module computes in "
                            f"{jnp.dtype(k.dtype).name}: call init_cache(..., dtype={jnp.dtype(k.dtype).name})")
        scales = dict(k_scale=self.k_scale[...], v_scale=self.v_scale[...]) if fp8 else {}
        lengths_given = lengths is not None
        if lengths is None:
            lengths, seqlens = jnp.full((b,), s, jnp.int32), old + s
        else:
            lengths = jnp.asarray(lengths, jnp.int32)
            if lengths.shape != (b,):
                raise ValueError(f"lengths must be int32 (batch,) = ({b},); got shape {lengths.shape}")
            left, right = self.window_size
            if right == 0:  # real query i sits at old + i; the padding after it lies right of the window
                seqlens = old + s
            elif (left, right) == (-1, -1):  # positions do not matter: the keys are exactly the real ones
                seqlens = old + lengths
            else:
                raise ValueError(f"padded rows (lengths) need a causal window or none; window_size={self.window_size} "
                                 "would show padding to real queries")
        table = None if self.page_table is None else self.page_table[...]
        k_cache, v_cache = fa4_jax.update_kvcache(self.cached_key[...], self.cached_value[...], k, v, old,
                                                  page_table=table, **scales)
        self.cached_key[...], self.cached_value[...] = k_cache, v_cache
        self.cache_lengths[...] = old + lengths
        def from_cache():
            return fa4_jax.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table,
                                                  causal=self.causal, **options, **scales)

        if s > 1 and (lengths_given is False or self.window_size[1] == 0):
            # A prompt into empty rows (the usual prefill): the cache holds exactly these s tokens and
            # query i sits at position i, so this is plain attention over the new tokens, which the
            # dense prefill kernel runs faster than the decode-shaped cache kernel. Padding (if any)
            # lies right of every real query's causal window either way.
            o = jax.lax.cond(jnp.all(old == 0), lambda: fa4_jax.attention(q, k, v, causal=self.causal, **options),
                             from_cache)
        else:
            o = from_cache()
        return self.out(o)
