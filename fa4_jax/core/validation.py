"""Argument checks shared by the public API, the primitive's shape rule and the reference.

One function, so that `attention()` (which must fail before anything is traced or launched) and the
primitive's abstract evaluation (which guards direct `bind` calls) cannot disagree.
Works on anything with `.shape` and `.dtype`: arrays, tracers, `ShapedArray`, `ShapeDtypeStruct`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from fa4_jax.families import HEAD_DIMS
from fa4_jax.families.base import MAX_SOFTCAP, MAX_SOFTMAX_SCALE
from fa4_jax.ops.kvcache.spec import MAX_SPLITS

# The kernels are compiled for these input dtypes only (see fa4_jax.families.DTYPES).
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
IMPLEMENTATIONS = ("fa4", "xla", "auto", "cudnn")  # the primitives' param; "auto" = the API's None


def dtype_tag(dtype) -> str:
    """The FwdVariant spelling of a kernel dtype."""
    return {"bfloat16": "bf16", "float16": "fp16"}[jnp.dtype(dtype).name]


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be a Python bool; got {name}={value!r}. Under jax.jit, mark it static "
            f"(static_argnames=({name!r}, ...))."
        )
    return bool(value)


_LOG2E = 1.4426950408889634
_F32 = np.finfo(np.float32)

# Upper bounds of softmax_scale and softcap, MAX_SOFTMAX_SCALE and MAX_SOFTCAP (fa4_jax/families/base.py,
# generated into every handler's checks too). Why these values: the kernels' float32
# softmax exponentiates every score against the row's scaled max m' = max|s| * scale * log2(e),
# rounded once; that rounding is common to the row and cancels, as long as 2^(ulp(m') / 2) stays
# finite in the fp16/bf16 P operand: |m'| < 2^28. A scale of at most 1e4 keeps that true for scores
# |q . k| up to ~1.8e4 (N(0, 1) inputs give |q . k| of a few dozen); beyond ~1e8 even a score of 1
# would not be resolved. Under a softcap the scaled scores are cap * tanh(...), so the cap alone
# bounds m': 1e6 (a cap far above any score is no cap).


def _static_float(name: str, value, default_hint: str) -> float:
    """`value` as a Python float, or a TypeError that says how to pass it under jit."""
    static_hint = f"Under jax.jit, pass it as a static argument (static_argnames=('{name}', ...)){default_hint}."
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        raise TypeError(f"{name} must be a Python float; got {value!r}. {static_hint}")
    if np.ndim(value) != 0:
        raise TypeError(f"{name} must be a scalar; got shape {np.shape(value)}")
    try:
        return float(value)  # concrete NumPy/JAX scalars are fine; tracers are not
    except TypeError as e:  # includes jax.errors.ConcretizationTypeError
        raise TypeError(f"{name} must be known at trace time, not a traced value ({type(value).__name__}). "
                        + static_hint) from e


def _usable_f32(x: float) -> bool:
    """The kernels take scales as float32 and exponentiate with exp2: a value must stay a finite,
    positive, normal float32 (a denormal is flushed to zero on the GPU)."""
    with np.errstate(over="ignore", under="ignore"):
        f = np.float32(x)
    return bool(np.isfinite(f) and f >= _F32.tiny)


def check_softmax_scale(softmax_scale) -> float:
    """Returns the scale as a Python float: it becomes a static primitive parameter.

    Checked as the kernel uses it, after float32 rounding: 1e39 would become inf (NaN output) and
    1e-46 zero (uniform attention) if only the Python float were checked.
    """
    scale = _static_float("softmax_scale", softmax_scale, " or leave it None for 1/sqrt(head_dim)")
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be finite and > 0; got {softmax_scale=}")
    if not (_usable_f32(scale) and _usable_f32(scale * _LOG2E)) or scale > MAX_SOFTMAX_SCALE:
        raise ValueError(
            f"softmax_scale must be a normal float32 in about 1.2e-38 .. {MAX_SOFTMAX_SCALE:g} (larger scales "
            f"turn the float32 softmax into an argmax it cannot resolve); got {softmax_scale=}"
        )
    return scale


def check_softcap(softcap, softmax_scale: float) -> float:
    """0.0 (off) or the cap c of `c * tanh(s / c)` on the scaled scores, as a Python float."""
    cap = _static_float("softcap", softcap, " or leave it 0.0 (off)")
    if not math.isfinite(cap) or cap < 0.0 or cap > MAX_SOFTCAP:
        raise ValueError(f"softcap must be in [0, {MAX_SOFTCAP:g}] (0 = off); got {softcap=}")
    # With a cap the kernel computes tanh(s * (softmax_scale / c)) and exponentiates with c * log2(e).
    if cap > 0.0 and not (_usable_f32(cap * _LOG2E) and _usable_f32(softmax_scale / cap)):
        raise ValueError(
            f"softcap={cap!r} with softmax_scale={softmax_scale!r} is out of float32 range: softcap * log2(e) "
            "and softmax_scale / softcap must both be normal float32 numbers"
        )
    return cap


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """Normalises (left, right) so that causal is folded in: causal == (-1, 0).

    Both are Python ints >= -1 (-1 = unbounded). causal=True with right = -1 means right = 0; with
    right > 0 it contradicts itself and raises.
    """
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints; got {window_size=!r}")
    out = []
    for side, x in zip(("left", "right"), window_size):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise TypeError(
                f"window_size must be a pair of Python ints; got {window_size=!r} ({side} is "
                f"{type(x).__name__}). Under jax.jit, mark it static (static_argnames=('window_size', ...))."
            )
        if x < -1:
            raise ValueError(f"window_size values must be >= -1 (-1 = unbounded); got {window_size=!r}")
        out.append(int(x))
    left, right = out
    if causal:
        if right > 0:
            raise ValueError(
                f"causal=True means window_size[1] = 0 (no key after the diagonal); got {window_size=!r}. "
                "Pass causal=False with that window, or right = 0 / -1."
            )
        right = 0
    return left, right


def check_sinks(sinks, heads_q: int) -> None:
    """sinks: None or a float array (heads_q,) of per-head logits (traced values are fine)."""
    if sinks is None:
        return
    if not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        raise TypeError(f"sinks must be None or an array of shape (heads_q,); got {type(sinks).__name__}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape (heads_q,) = ({heads_q},); got sinks.shape={tuple(sinks.shape)}")
    if not jnp.issubdtype(jnp.dtype(sinks.dtype), jnp.floating):
        raise TypeError(f"sinks must be a floating-point array (used as float32); got sinks.dtype={jnp.dtype(sinks.dtype).name}")


def check_options(*, causal, softmax_scale, window_size, softcap, sinks, heads_q: int, head_dim: int):
    """The options every attention entry point shares, checked in one order. Returns
    (softmax_scale, softcap, (window_left, window_right)) with causal folded into the window;
    softmax_scale None means 1/sqrt(head_dim)."""
    causal = check_flag("causal", causal)
    scale = check_softmax_scale(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
    cap = check_softcap(softcap, scale)
    window = check_window(window_size, causal)
    check_sinks(sinks, heads_q)
    return scale, cap, window


def check_implementation(implementation) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation=}")
    return implementation


_LAYOUTS = {4: "(batch, seqlen, heads, head_dim)", 3: "(total_tokens, heads, head_dim)"}


def check_tensors(named: dict, rank: int, kernel_constraints: bool) -> None:
    """Per-array checks: an array of `rank` (heads on axis -2), >= 1 heads, a float dtype."""
    for name, x in named.items():
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array with .shape and .dtype; got {type(x).__name__}")
        if len(x.shape) != rank:
            raise ValueError(f"{name} must have rank {rank} {_LAYOUTS[rank]}; got {name}.shape={tuple(x.shape)}")
        if any(d < 0 for d in x.shape) or x.shape[-2] < 1:
            # Zero batch or sequence length is fine (empty outputs, or rows that see no key); a
            # tensor without heads is not attention.
            raise ValueError(f"{name} must have >= 1 heads and no negative dimension; got {name}.shape={tuple(x.shape)}")
        dtype = jnp.dtype(x.dtype)
        if kernel_constraints and dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float16; got {name}.dtype={dtype.name}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array; got {name}.dtype={dtype.name}")
    names = list(named)
    dtypes = [jnp.dtype(x.dtype) for x in named.values()]
    if len(set(dtypes)) != 1:
        got = ", ".join(f"{n}.dtype={d.name}" for n, d in zip(names, dtypes))
        raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must share one dtype; got {got}")


def _check_head_dim(q, k, v, names, kernel_constraints: bool) -> None:
    nq, nk, nv = names
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"{nq}, {nk} and {nv} must share head_dim (last axis); got {nq}.shape={tuple(q.shape)}, "
                         f"{nk}.shape={tuple(k.shape)}, {nv}.shape={tuple(v.shape)}")
    if kernel_constraints and q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}; got head_dim={q.shape[-1]} ({nq}.shape={tuple(q.shape)})")


def _check_kv_heads(q, k, v, names, layout: str) -> None:
    """k and v alike, query heads a multiple of kv heads."""
    _, nk, nv = names
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"{nk} and {nv} must have the same shape {layout}; got {nk}.shape={tuple(k.shape)}, "
                         f"{nv}.shape={tuple(v.shape)}")
    h_q, h_k = q.shape[-2], k.shape[-2]
    if h_q % h_k != 0:
        raise ValueError(
            f"query heads must be a multiple of key/value heads (GQA/MQA); got heads_q={h_q}, heads_kv={h_k}"
        )


def check_qkv(q, k, v, *, kernel_constraints: bool = True) -> None:
    """Raises TypeError/ValueError naming the offending argument.

    kernel_constraints=False relaxes dtype to any float and head_dim to any size: the pure-JAX
    reference accepts those (e.g. float32 inputs for an accuracy oracle); the kernel and the API do not.
    """
    check_tensors({"q": q, "k": k, "v": v}, 4, kernel_constraints)
    _check_head_dim(q, k, v, ("q", "k", "v"), kernel_constraints)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k and v must share the batch size (axis 0); got q.shape={tuple(q.shape)}, "
            f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    _check_kv_heads(q, k, v, ("q", "k", "v"), "(batch, seqlen_k, heads_kv, head_dim)")


def check_index(name: str, x, shape: tuple, meaning: str) -> None:
    """An int32 index array of exactly `shape` (traced values are fine)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an int32 array {meaning}; got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32 {meaning}; got {name}.dtype={jnp.dtype(x.dtype).name}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} {meaning}; got {name}.shape={tuple(x.shape)}")




def check_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=None, *, kernel_constraints: bool = True) -> None:
    """q (b, s_q, h_q, d); contiguous caches (b, capacity, h_k, d), or with page_table int32
    (b, max_pages) paged caches (num_pages, page_size, h_k, d); cache_seqlens int32 (b,)."""
    names = ("q", "k_cache", "v_cache")
    check_tensors(dict(zip(names, (q, k_cache, v_cache))), 4, kernel_constraints)
    _check_head_dim(q, k_cache, v_cache, names, kernel_constraints)
    _check_kv_heads(q, k_cache, v_cache, names, "((batch or num_pages), (capacity or page_size), heads_kv, head_dim)")
    b = q.shape[0]
    check_index("cache_seqlens", cache_seqlens, (b,), "(batch,): valid keys per sequence, new tokens included")
    if page_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(
                f"a contiguous cache is (batch, capacity, heads_kv, head_dim) with q's batch; got "
                f"q.shape={tuple(q.shape)}, k_cache.shape={tuple(k_cache.shape)} (pass page_table for a paged cache)"
            )
        return
    if not (hasattr(page_table, "shape") and len(page_table.shape) == 2):
        raise ValueError(f"page_table must be int32 (batch, max_pages); got {getattr(page_table, 'shape', page_table)!r}")
    check_index("page_table", page_table, (b, page_table.shape[1]), "(batch, max_pages): page ids of each sequence")
    # Any page size >= 1 (0 is a zero-size cache, answered without a launch): the kernel reads pages
    # whose size is a multiple of 16 in 16-row TMA pieces, others row by row.


def check_num_splits(num_splits) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be None (pick at run time) or a Python int >= 1; got {num_splits=!r}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}] (the kernel's maximum; or None: pick at run "
                         f"time); got {num_splits=}")
    return int(num_splits)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
                 kernel_constraints: bool = True) -> int:
    """Packed q (total_q, h_q, d), k/v (total_k, h_k, d); int32 offsets (batch + 1,); optional
    seqused_k int32 (batch,); optional static max_seqlen hints. Returns the batch size."""
    check_tensors({"q": q, "k": k, "v": v}, 3, kernel_constraints)
    _check_head_dim(q, k, v, ("q", "k", "v"), kernel_constraints)
    _check_kv_heads(q, k, v, ("q", "k", "v"), "(total_tokens_k, heads_kv, head_dim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not (hasattr(cu, "shape") and len(cu.shape) == 1 and cu.shape[0] >= 1):
            raise ValueError(f"{name} must be int32 (batch + 1,) offsets; got {getattr(cu, 'shape', cu)!r}")
    batch = cu_seqlens_q.shape[0] - 1
    check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,), "(batch + 1,): offsets of the query sequences")
    check_index("cu_seqlens_k", cu_seqlens_k, (batch + 1,),
                f"(batch + 1,) = ({batch + 1},) like cu_seqlens_q: offsets of the key sequences")
    if seqused_k is not None:
        check_index("seqused_k", seqused_k, (batch,), "(batch,): keys used per sequence")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if x is not None and (isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0):
            raise TypeError(f"{name} must be None or a static Python int >= 0 (a hint); got {name}={x!r}")
    return batch
