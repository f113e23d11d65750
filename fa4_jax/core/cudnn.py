"""cuDNN flash attention, where it computes exactly what fa4_jax computes: the fast path on CUDA GPUs
that our kernels cannot serve (A100, L40, B200, a Hopper without the kernel library), and
`implementation="cudnn"`.

fa4_jax calls jax's own cuDNN fused attention (jax/_src/cudnn/fused_attention_stablehlo.py, through
fa4_jax.core.compat: the `__cudnn$fmha*` custom call XLA compiles into a cuDNN graph) and asks it for the
softmax statistics too, which are our float32 natural-log LSE (b, h_q, s_q). The mapping is exact or
not used: `cudnn_reason` is None only for calls whose every output element cuDNN defines as we do.

When cuDNN computes the call (`cudnn_reason(...) is None`, a pure function of shapes, dtypes and the
primitive's params; `feature_reason` is the same test on plain values, e.g. for a support matrix):

| | cuDNN | otherwise |
|---|---|---|
| entry point | `attention`, `attention_with_kvcache` with a contiguous cache | paged caches and `attention_varlen`: reference (see below) |
| dtype | bfloat16, float16 | reference |
| head_dim | multiple of 8, <= 256 (<= 128 below compute capability 9.0) | reference |
| softcap, sinks | off | reference: cuDNN has neither |
| shapes | static and non-empty | symbolic (shape-polymorphic) or zero-size: reference |
| `attention` mask | none (any seqlens); causal or a causal left window `(left, 0)` when seqlen_q == seqlen_k | reference |
| `attention_with_kvcache` mask | none (any seqlen_q); with seqlen_q == 1 also causal and any right window (the one query is the last key: every valid key is visible) | reference |
| GPU | compute capability >= 8.0 and cuDNN >= 9.0 on every target GPU (10.3 needs cuDNN 9.11) | reference |

Why the masks stop there: jax exposes cuDNN's causal mask and sliding window only aligned to the
top-left corner (query i sees keys j <= i; a window of length w keeps i - w < j), while fa4_jax
aligns them to the bottom-right corner (query i sits at key position i + seqlen_k - seqlen_q, or at
cache_seqlens[b] - seqlen_q + i). The two agree when seqlen_q == seqlen_k, and for a one-query KV
cache step, where the padding mask (`key_value_seq_lengths`) alone is the whole mask. cuDNN's window
has no right bound apart from the causal one. A right or left window bound that reaches past every
key is unbounded and counts as absent (as the API trims it).

Per-sequence key lengths (`cache_seqlens`, clamped to [0, capacity] as everywhere) become cuDNN's
padding mask; a row with no key gets o = 0 and lse = -inf by a select after the call (cuDNN leaves
such rows undefined), so rows that see nothing match the reference exactly.

Not mapped (reference): paged caches (jax's cuDNN paged attention requires num_pages ==
batch * max_pages and has no page-id clamping) and packed varlen batches (cuDNN's packed layout
requires Hopper and per-segment top-left masks; a causal mask there matches ours only for sequences
with as many queries as keys, which is not known while lowering).

Where it is used (fa4_jax/core/lowering.py): `implementation=None` on CUDA takes our kernel when it can
serve the call; else cuDNN when `cudnn_reason` is None and every GPU the program is lowered for passes
`device_reason` (jax's own conditions: compute capability, cuDNN version; they need the GPU, so a
program lowered without known GPUs, e.g. exported from a CPU host, keeps the kernel-or-reference
choice); else the reference. FA4_JAX_DISABLE_CUDNN=1 takes cuDNN out of that choice.
`implementation="cudnn"` demands it: the call raises ValueError with `cudnn_reason` when the mapping
does not exist, RuntimeError when the GPU cannot run it, and lowering for another platform raises.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from fa4_jax.core import compat

ATTENTION, KVCACHE, VARLEN = "attention", "attention_with_kvcache", "attention_varlen"
ENTRIES = (ATTENTION, KVCACHE, VARLEN)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256  # compute capability >= 9.0
MAX_HEAD_DIM_PRE_HOPPER = 128
MIN_CAPABILITY = (8, 0)
MIN_CUDNN = 90000  # 9.0.0 (cuDNN 9 numbers versions major * 10000 + minor * 100 + patch)
DISABLE_CUDNN_ENV = "FA4_JAX_DISABLE_CUDNN"

_NOT_MAPPED = {
    VARLEN: "packed varlen batches have no exact cuDNN mapping in fa4_jax (cuDNN's packed layout aligns "
            "masks top-left per segment); they run the reference",
}
_PAGED = ("paged KV caches have no exact cuDNN mapping in fa4_jax (jax's cuDNN paged attention needs "
          "num_pages == batch * max_pages and does not clamp page ids); they run the reference")


def cudnn_disabled() -> bool:
    """FA4_JAX_DISABLE_CUDNN is set to a true value (read at every lowering)."""
    return os.environ.get(DISABLE_CUDNN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------------
# Can cuDNN express the call? Pure: shapes, dtypes and params only.


def _static(*dims) -> bool:
    return all(isinstance(d, (int, np.integer)) for d in dims)


def _trim(left: int, right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A side that reaches past every key is unbounded (as fa4_jax.attention trims it)."""
    if left >= max(seqlen_k - 1, 0):
        left = -1
    if right >= max(seqlen_q - 1, 0):
        right = -1
    return left, right


def mask_spec(entry: str, seqlen_q: int, seqlen_k: int, window: tuple[int, int]):
    """("none" | "causal" | "padding", sliding_window_length or None) for jax's cuDNN call, or a str
    saying why cuDNN has no mask equal to ours. seqlen_k: keys (attention) or cache capacity."""
    left, right = _trim(*window, seqlen_q, seqlen_k)
    if entry == KVCACHE:
        if left < 0 and right < 0:
            return "padding", None
        return (f"window_size=({window[0]}, {window[1]}) on a KV cache with seqlen_q={seqlen_q}: fa4_jax's masks "
                "follow each row's length (its queries are the last seqlen_q keys), cuDNN's (through jax) are "
                "aligned to the top-left corner; they agree only without a mask, or with seqlen_q == 1 and no "
                "left window")
    if left < 0 and right < 0:
        return "none", None
    if right != 0:
        return (f"window_size=({window[0]}, {window[1]}): cuDNN (through jax) has only a causal mask and a causal "
                "left window, no right window bound and no left window without causal")
    if seqlen_q != seqlen_k:
        return (f"a causal mask or window with seqlen_q={seqlen_q} != seqlen_k={seqlen_k}: cuDNN (through jax) "
                "aligns masks to the top-left corner, fa4_jax to the bottom-right; they agree only when "
                "seqlen_q == seqlen_k")
    return "causal", (None if left < 0 else left + 1)  # cuDNN keeps keys i - w < j <= i


def capability_reason(compute_capability, head_dim: int, cudnn_version: int | None = None) -> str | None:
    """None when a GPU of `compute_capability` ("8.0", "9.0", (9, 0) or 9.0) runs cuDNN flash
    attention at `head_dim` (and with `cudnn_version`, when given); else why not."""
    cc = _capability(compute_capability)
    if cc is None:
        return f"unknown compute capability {compute_capability!r}"
    name = f"{cc[0]}.{cc[1]}"
    if cc < MIN_CAPABILITY:
        return f"cuDNN flash attention needs compute capability >= 8.0; the GPU has {name}"
    if head_dim > MAX_HEAD_DIM_PRE_HOPPER and cc < (9, 0):
        return (f"cuDNN flash attention supports head_dim <= {MAX_HEAD_DIM_PRE_HOPPER} below compute capability 9.0; "
                f"got head_dim={head_dim} on compute capability {name}")
    if cudnn_version is not None and cc == (10, 3) and cudnn_version < 91100:
        return f"compute capability 10.3 needs cuDNN >= 9.11; jax uses cuDNN {_version_name(cudnn_version)}"
    return None


def feature_reason(entry: str, *, dtype, head_dim: int, seqlen_q: int, seqlen_k: int,
                   window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: bool = False,
                   paged: bool = False, compute_capability=None) -> str | None:
    """None when cuDNN computes exactly this kind of call, else why not (a sentence).

    entry: "attention", "attention_with_kvcache" or "attention_varlen"; seqlen_k: the key count
    (attention) or the cache capacity in keys (attention_with_kvcache); window: (left, right) with
    causal folded in as (-1, 0); compute_capability: that of the GPU, or None to leave the device
    conditions to `device_reason`. Pure: no jax backend, no GPU (a docs generator may call it)."""
    if entry not in ENTRIES:
        raise ValueError(f"entry must be one of {ENTRIES}; got {entry=}")
    if entry in _NOT_MAPPED:
        return _NOT_MAPPED[entry]
    if paged:
        return _PAGED
    if jnp.dtype(dtype) not in DTYPES:
        return f"cuDNN flash attention takes bfloat16 or float16; got {jnp.dtype(dtype).name}"
    if softcap:
        return "cuDNN has no logit softcapping (softcap > 0)"
    if sinks:
        return "cuDNN has no attention sinks"
    if not _static(seqlen_q, seqlen_k, head_dim):
        return "symbolic (shape-polymorphic) dimensions: jax's cuDNN attention needs static shapes"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"cuDNN flash attention needs head_dim a multiple of 8 and <= {MAX_HEAD_DIM}; got {head_dim}"
    if seqlen_q == 0 or seqlen_k == 0:
        return "zero-size shapes run the reference"
    spec = mask_spec(entry, seqlen_q, seqlen_k, window)
    if isinstance(spec, str):
        return spec
    if compute_capability is not None:
        return capability_reason(compute_capability, head_dim)
    return None


def cudnn_reason(entry: str, avals, params: dict, *, compute_capability=None) -> str | None:
    """None when cuDNN computes exactly the call of the primitive of `entry` with operands `avals`
    (anything with .shape and .dtype, in the primitive's operand order: q, k, v, ...) and `params`
    (the primitive's params); else why not. Pure, like `feature_reason`."""
    if entry not in ENTRIES:
        raise ValueError(f"entry must be one of {ENTRIES}; got {entry=}")
    if entry in _NOT_MAPPED:
        return _NOT_MAPPED[entry]
    q, k = avals[0], avals[1]
    if any(_static(d) and d == 0 for a in avals[:3] for d in a.shape):
        return "zero-size shapes run the reference"
    if entry == KVCACHE and params.get("kv_fp8"):
        return "cuDNN has no FP8 KV-cache attention in jax"
    if entry == KVCACHE and params.get("paged"):
        return _PAGED
    if entry == KVCACHE and params.get("ragged"):
        return _NOT_MAPPED[VARLEN].replace("packed varlen batches", "ragged KV-cache batches")
    return feature_reason(entry, dtype=q.dtype, head_dim=q.shape[-1], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                          window=(params["window_left"], params["window_right"]), softcap=params["softcap"],
                          sinks=params["has_sinks"], compute_capability=compute_capability)


def mask_requirement(entry: str, window: tuple[int, int]) -> str | None:
    """What the sequence lengths must satisfy for cuDNN to express this mask (for documentation):
    None (any lengths), "seqlen_q == seqlen_k", "seqlen_q == 1", or "never"."""
    if entry not in (ATTENTION, KVCACHE):
        return "never"
    left, right = window
    if left < 0 and right < 0:
        return None
    if entry == KVCACHE:
        return "seqlen_q == 1" if left < 0 else "never"
    return "seqlen_q == seqlen_k" if right == 0 else "never"


# --------------------------------------------------------------------------------------------------
# Can the GPUs run it? Needs jax's CUDA backend (the cuDNN version) and the devices.


def _capability(value) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, tuple):
        return (int(value[0]), int(value[1]))
    text = str(value)
    major, _, minor = text.partition(".")
    try:
        return (int(major), int(minor or 0))
    except ValueError:
        return None


def _version_name(version: int) -> str:
    if version >= 10000:
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def device_reason(devices, head_dim: int) -> str | None:
    """None when jax's cuDNN attention runs at `head_dim` on every one of `devices` (GPUs of this
    process) with the cuDNN jax loaded; else why not."""
    api = compat.cudnn_api_reason()
    if api is not None:
        return api
    if not devices:
        return "no CUDA GPU is known for this program (jax's cuDNN attention reads the GPU while lowering)"
    version = compat.cudnn_version()
    if version is None:
        return "jax has no cuDNN in this process (a CPU jaxlib, or the CUDA plugin did not load)"
    if version < MIN_CUDNN:
        return f"fa4_jax uses cuDNN flash attention from cuDNN 9.0; jax loaded cuDNN {_version_name(version)}"
    for device in devices:
        if getattr(device, "platform", None) != "gpu":
            return f"{getattr(device, 'device_kind', device)!r} is not a CUDA GPU"
        reason = capability_reason(getattr(device, "compute_capability", None), head_dim, version)
        if reason is not None:
            return f"{getattr(device, 'device_kind', 'the GPU')}: {reason}"
    return None


def local_cuda_gpus() -> tuple:
    """This process's CUDA GPUs (jax's cuDNN checks read the first), () without any."""
    import jax

    try:
        return tuple(jax.devices("cuda"))
    except Exception:  # noqa: BLE001 - a CPU jaxlib raises RuntimeError; a failed plugin other errors
        return ()


def auto_reason(entry: str, avals, params: dict, devices) -> str | None:
    """None when implementation=None should lower to cuDNN for these target `devices` (after our
    kernel declined): the call maps exactly and every device is a GPU that runs it. Without known
    GPUs (jax.export, an export from a CPU host) the answer is no: the choice stays kernel-or-reference."""
    if cudnn_disabled():
        return f"cuDNN is disabled by {DISABLE_CUDNN_ENV}={os.environ[DISABLE_CUDNN_ENV]}"
    reason = cudnn_reason(entry, avals, params)
    if reason is not None:
        return reason
    if not devices or any(getattr(d, "platform", None) != "gpu" for d in devices):
        return "the GPUs this program runs on are not known while lowering"
    return device_reason(devices, avals[0].shape[-1])


# --------------------------------------------------------------------------------------------------
# The lowering bodies (traceable; the primitive's operands and params, results (o, lse)).


def _attention(q, k, v, *sinks, softmax_scale, window_left, window_right, softcap, has_sinks, implementation):
    del sinks, softcap, has_sinks, implementation  # cudnn_reason excluded them
    mask, window = mask_spec(ATTENTION, q.shape[1], k.shape[1], (window_left, window_right))
    return compat.cudnn_attention(q, k, v, q_seqlen=None, kv_seqlen=None, scale=softmax_scale, mask=mask,
                                   sliding_window_length=window)


def _kvcache(q, k, v, seqlens, *rest, softmax_scale, window_left, window_right, softcap, has_sinks, paged,
             ragged, kv_fp8, max_seqlen_q, tile_m, page_rows, num_splits, implementation):
    # contiguous, not ragged, no sinks, 16-bit caches (cudnn_reason)
    del rest, softcap, has_sinks, paged, ragged, kv_fp8, max_seqlen_q, tile_m, page_rows, num_splits, implementation
    b, s_q = q.shape[:2]
    mask, window = mask_spec(KVCACHE, s_q, k.shape[1], (window_left, window_right))
    kv_len = jnp.clip(seqlens, 0, k.shape[1]).astype(jnp.int32)
    o, lse = compat.cudnn_attention(q, k, v, q_seqlen=jnp.full((b,), s_q, jnp.int32), kv_seqlen=kv_len,
                                     scale=softmax_scale, mask=mask, sliding_window_length=window)
    seen = kv_len > 0  # a row without keys: o = 0, lse = -inf (cuDNN leaves it undefined)
    o = jnp.where(seen[:, None, None, None], o, jnp.zeros((), o.dtype))
    lse = jnp.where(seen[:, None, None], lse, -jnp.inf)
    return o, lse


BODIES = {ATTENTION: _attention, KVCACHE: _kvcache}


def body(entry: str):
    """The cuDNN lowering body of `entry`'s per-shard primitive (None: never cuDNN)."""
    return BODIES.get(entry)
