#!/usr/bin/env python3
"""First contact with a Blackwell GPU (issue 16): run every SM100 kernel the library holds against a
float64 oracle, time the dense ones against cuDNN in the same run, and print one screen saying which
of them may be switched on (added to VALIDATED_ARCHES, fa4_jax/families/base.py).

    python tools/validate_sm100.py                # on a B200 (compute capability 10.x)
    python tools/validate_sm100.py --quick        # fewer shapes, fewer timed rows
    python tools/validate_sm100.py --any-arch     # the same checks of the kernels this GPU runs (a dry
                                                  # run of the script on a Hopper GPU, say)
    python tools/validate_sm100.py --json out.json
    python tools/validate_sm100.py --family kvcache   # one family's variants (repeatable)

Correctness: for every built variant of the device's architecture in the dense family (dtype x head_dim
x mask x softcap), random normal inputs of odd sizes (GQA, seqlen_q == seqlen_k and a shorter query
block against more keys), the output and LSE against a float64 NumPy oracle on sampled rows, every
output finite, then a second call with other inputs (a kernel that keeps state between calls, or reads
uninitialised shared memory, shows here); with attention sinks per head (+inf, -inf, ordinary and
dominating logits: a +inf sink must give o = 0, lse = +inf, never NaN) against the float32 reference;
and, except with --quick, every row and head of a shape with more tiles than SMs. For every varlen variant, packed sequences of odd lengths
(one empty, one of a single token) plus padding rows past cu_seqlens_q[b]: each sequence against the
oracle, the padding rows o = 0 / lse = -inf, and every other sequence's K/V rows set to NaN must leave
a sequence's output bit for bit unchanged (the kernel zeroes V rows past a sequence's last key). For
every KV-cache variant (check_kvcache_variant), decode rows or a prefill chunk against contiguous or
paged caches of odd lengths (one empty), causal / windowed / unmasked, with and without splits, each
sequence against the oracle, and NaN in the slots past the lengths and in unowned pages must leave the
outputs bit for bit unchanged. Speed: causal and non-causal prefill at 16k tokens per call
(heads = 2048 / head_dim), TFLOP/s of ours and of cuDNN (`jax.nn.dot_product_attention`).

Isolation: each variant's checks run in child processes (this script with --child-results), so that a
kernel that hangs (a pipeline deadlock) or faults (a sticky CUDA error poisons the process) costs only
itself: a child that gives no result for CHILD_TIMEOUT_S is killed and its current variant recorded as
hung, one that dies as crashed, and a new child takes the remaining variants. --in-process runs
everything in this process (faster; for a second run once the kernels are known to behave).

Verdict per (head_dim, mask, softcap): "switch on" when every case of it passed and, where cuDNN runs
the same call, ours is at least 0.9x cuDNN's speed; "keep opt-in (slower than cuDNN)"; or "do not
use" with the first failure. The exit status is 0 when every kernel is correct (whether or not each
is fast enough), 1 when any failed, 2 when this is not the architecture asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

# The bf16 accuracy rule of the benchmarks (examples/benchmark.REL_ERR_LIMIT): max |error| over the
# sampled rows relative to the oracle's max |value|; LSE compared absolutely (natural log units).
REL_ERR_LIMIT = 2e-2
LSE_ATOL = 2e-2
FAST_ENOUGH = 0.9  # of cuDNN's TFLOP/s, on every timed row of a configuration
WINDOW = (61, 7)
SOFTCAP = 30.0


def call_params(jnp, variant):
    """(dtype, causal, window_size, softcap) with which the checks call a variant: its mask kind as a
    causal mask or the WINDOW, SOFTCAP for its softcap variants."""
    return ({"bf16": jnp.bfloat16, "fp16": jnp.float16}[variant.dtype], variant.mask == "causal",
            WINDOW if variant.mask == "local" else (-1, -1), SOFTCAP if variant.softcap else 0.0)


def verdict(correct: list[str], ratios: list[float]) -> str:
    """One configuration's verdict from its failures (empty: all passed) and its speed ratios to cuDNN
    (ours / cuDNN TFLOP/s; empty when cuDNN runs none of its calls)."""
    if correct:
        return f"do not use: {correct[0]}"
    if ratios and min(ratios) < FAST_ENOUGH:
        return f"keep opt-in: {min(ratios):.2f}x cuDNN at worst (below {FAST_ENOUGH}x)"
    return "switch on" + (f" ({min(ratios):.2f}x cuDNN at worst)" if ratios else " (no cuDNN row to compare)")


def oracle(q, k, v, rows, causal: bool, window, softcap: float, heads: int):
    """float64 output and LSE for batch 0, the first `heads` q-heads and the given query rows (GQA by
    repeat; masks aligned bottom-right as fa4_jax's)."""
    s_q, s_k, h_q, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    group = h_q // k.shape[2]
    qs = np.asarray(q[0, rows, :heads], np.float64)
    ks = np.repeat(np.asarray(k[0], np.float64), group, axis=1)[:, :heads]
    vs = np.repeat(np.asarray(v[0], np.float64), group, axis=1)[:, :heads]
    logits = np.einsum("rhd,shd->hrs", qs, ks) / math.sqrt(d)
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    diag = np.asarray(rows)[None, :, None] + (s_k - s_q)
    key = np.arange(s_k)[None, None, :]
    left, right = window
    right = 0 if causal else right
    visible = np.ones_like(logits, bool)
    if right >= 0:
        visible &= key <= diag + right
    if left >= 0:
        visible &= key >= diag - left
    logits = np.where(visible, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    lse = (np.log(p.sum(-1)) + m[..., 0])  # (h, r)
    return np.einsum("hrs,shd->rhd", p / p.sum(-1, keepdims=True), vs), lse


def check_variant(fa4_jax, jax, jnp, variant, shapes, seed: int) -> list[str]:
    """Failures of one variant over `shapes` ((b, s_q, s_k, h_q, h_k) each), two input sets each."""
    dtype, causal, window, softcap = call_params(jnp, variant)
    fn = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                                   return_lse=True, implementation="fa4"))
    failures = []
    for shape in shapes:
        b, s_q, s_k, h_q, h_k = shape
        for draw in range(2):
            keys = jax.random.split(jax.random.key(seed + 7919 * draw + s_q), 3)
            q, k, v = (jax.random.normal(kk, (b, s, h, variant.head_dim), jnp.float32).astype(dtype)
                       for kk, s, h in zip(keys, (s_q, s_k, s_k), (h_q, h_k, h_k)))
            try:
                o, lse = jax.block_until_ready(fn(q, k, v))
            except Exception as e:  # noqa: BLE001 - an FFI error is a finding, not a crash of the tool
                failures.append(f"{shape}: the call failed: {str(e).splitlines()[0][:120]}")
                break
            if not (np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all()):
                failures.append(f"{shape}: non-finite output")
                break
            rows = np.unique(np.r_[np.arange(min(16, s_q)), np.arange(max(0, s_q - 16), s_q)])
            ref_o, ref_lse = oracle(q, k, v, rows, causal, window, softcap, heads=min(h_q, 4))
            got = np.asarray(o[0, rows, : ref_o.shape[1]], np.float64)
            err = np.abs(got - ref_o).max() / max(np.abs(ref_o).max(), 1e-30)
            lse_err = np.abs(np.asarray(lse[0, : ref_o.shape[1]][:, rows], np.float64) - ref_lse).max()
            if err > REL_ERR_LIMIT or lse_err > LSE_ATOL:
                failures.append(f"{shape} draw {draw}: output error {err:.2e}, LSE error {lse_err:.2e}")
                break
    return failures


# More tiles than a B200 has SMs (148): 5 (two Q tiles per CTA) or 9 m-blocks x 64 heads. Full
# attention runs on a persistent grid there, each CTA taking several tiles in turn (their pipeline
# states carried across); the oracle's rows of batch 0 / four heads would see only first tiles.
EVERY_TILE_SHAPE = (1, 1040, 1040, 64, 8)


def check_every_tile(fa4_jax, jax, jnp, variant, seed: int, shape=EVERY_TILE_SHAPE) -> list[str]:
    """Failures of one dense variant on `shape`, every output row and head against the library's
    float32 reference (implementation="xla"): tiles a persistent CTA takes second or third."""
    dtype, causal, window, softcap = call_params(jnp, variant)
    b, s_q, s_k, h_q, h_k = shape
    keys = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, variant.head_dim), jnp.float32).astype(dtype)
               for kk, s, h in zip(keys, (s_q, s_k, s_k), (h_q, h_k, h_k)))
    outs = []
    for impl in ("fa4", "xla"):
        fn = jax.jit(lambda q, k, v, impl=impl: fa4_jax.attention(q, k, v, causal=causal, window_size=window,
                                                                   softcap=softcap, return_lse=True,
                                                                   implementation=impl))
        try:
            outs.append([np.asarray(x, np.float64) for x in jax.block_until_ready(fn(q, k, v))])
        except Exception as e:  # noqa: BLE001 - an FFI error is a finding
            return [f"{shape}: the call failed ({impl}): {str(e).splitlines()[0][:120]}"]
    (o, lse), (ref_o, ref_lse) = outs
    if not (np.isfinite(o).all() and np.isfinite(lse).all()):
        return [f"{shape}: non-finite output"]
    err = np.abs(o - ref_o).max(axis=(0, 1, 3)) / max(np.abs(ref_o).max(), 1e-30)  # per head
    lse_err = np.abs(lse - ref_lse).max(axis=(0, 2))
    bad = np.nonzero((err > REL_ERR_LIMIT) | (lse_err > LSE_ATOL))[0]
    if bad.size:
        return [f"{shape}: heads {bad[:8].tolist()} wrong (output error {err.max():.2e}, LSE error {lse_err.max():.2e})"]
    return []


# Attention sinks, one per q-head, with the special values: +inf takes the whole mass (o = 0,
# lse = +inf), -inf is no sink, a large one dominates, the rest ordinary logits.
SINKS = (float("inf"), float("-inf"), 0.5, -3.0, 2.0, 12.0, -0.7, 1.3)
SINKS_SHAPE = (2, 333, 333, len(SINKS), 2)


def check_sinks(fa4_jax, jax, jnp, variant, seed: int, shape=SINKS_SHAPE) -> list[str]:
    """Failures of one dense variant with SINKS against the library's float32 reference: every row
    and head, the +inf head exactly o = 0, lse = +inf, and no NaN anywhere."""
    dtype, causal, window, softcap = call_params(jnp, variant)
    b, s_q, s_k, h_q, h_k = shape
    keys = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, variant.head_dim), jnp.float32).astype(dtype)
               for kk, s, h in zip(keys, (s_q, s_k, s_k), (h_q, h_k, h_k)))
    sinks = jnp.asarray(SINKS[:h_q], jnp.float32)
    outs = []
    for impl in ("fa4", "xla"):
        fn = jax.jit(lambda q, k, v, s, impl=impl: fa4_jax.attention(
            q, k, v, causal=causal, window_size=window, softcap=softcap, sinks=s, return_lse=True,
            implementation=impl))
        try:
            outs.append([np.asarray(x, np.float64) for x in jax.block_until_ready(fn(q, k, v, sinks))])
        except Exception as e:  # noqa: BLE001 - an FFI error is a finding
            return [f"sinks {shape}: the call failed ({impl}): {str(e).splitlines()[0][:120]}"]
    (o, lse), (ref_o, ref_lse) = outs
    if np.isnan(o).any() or np.isnan(lse).any():
        heads = sorted({int(h) for h in np.nonzero(np.isnan(o))[2]} | {int(h) for h in np.nonzero(np.isnan(lse))[1]})
        return [f"sinks {shape}: NaN in heads {heads}"]
    inf_heads = [h for h in range(h_q) if SINKS[h] == float("inf")]
    if inf_heads and not ((o[:, :, inf_heads] == 0).all() and np.isposinf(lse[:, inf_heads]).all()):
        return [f"sinks {shape}: a +inf sink must give o = 0 and lse = +inf (heads {inf_heads})"]
    rest = [h for h in range(h_q) if h not in inf_heads]
    err = np.abs(o[:, :, rest] - ref_o[:, :, rest]).max() / max(np.abs(ref_o[:, :, rest]).max(), 1e-30)
    lse_err = np.abs(lse[:, rest] - ref_lse[:, rest]).max()
    if err > REL_ERR_LIMIT or lse_err > LSE_ATOL:
        return [f"sinks {shape}: output error {err:.2e}, LSE error {lse_err:.2e}"]
    return []


VARLEN_LENS = (77, 0, 300, 1, 129)  # packed sequences: odd lengths, an empty one and a single token
VARLEN_PAD = 5  # query rows past cu_seqlens_q[b]: o = 0, lse = -inf


def check_varlen_variant(fa4_jax, jax, jnp, variant, seed: int, heads=(8, 2)) -> list[str]:
    """Failures of one varlen variant: VARLEN_LENS self-attention sequences (cu_seqlens_q ==
    cu_seqlens_k) against the oracle, the padding rows, and isolation from the other sequences' K/V."""
    dtype, causal, window, softcap = call_params(jnp, variant)
    h_q, h_k = heads
    cu = np.concatenate([[0], np.cumsum(VARLEN_LENS)]).astype(np.int32)
    total = int(cu[-1])
    fn = jax.jit(lambda q, k, v: fa4_jax.attention_varlen(
        q, k, v, jnp.asarray(cu), jnp.asarray(cu), max_seqlen_q=max(VARLEN_LENS), causal=causal, window_size=window,
        softcap=softcap, return_lse=True, implementation="fa4"))
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (total + VARLEN_PAD, h_q, variant.head_dim), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, (total, h_k, variant.head_dim), jnp.float32).astype(dtype) for kk in keys[1:])
    try:
        o, lse = (np.asarray(x, np.float32) for x in jax.block_until_ready(fn(q, k, v)))
    except Exception as e:  # noqa: BLE001 - an FFI error is a finding
        return [f"varlen: the call failed: {str(e).splitlines()[0][:120]}"]
    failures = []
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if end == start:
            continue
        if not (np.isfinite(o[start:end]).all() and np.isfinite(lse[:, start:end]).all()):
            failures.append(f"varlen sequence {b}: non-finite output")
            continue
        rows = np.arange(end - start)
        ref_o, ref_lse = oracle(q[None, start:end], k[None, start:end], v[None, start:end], rows, causal, window,
                                softcap, heads=h_q)
        err = np.abs(o[start:end] - ref_o).max() / max(np.abs(ref_o).max(), 1e-30)
        lse_err = np.abs(lse[:, start:end] - ref_lse).max()
        if err > REL_ERR_LIMIT or lse_err > LSE_ATOL:
            failures.append(f"varlen sequence {b} ({end - start} tokens): output error {err:.2e}, "
                            f"LSE error {lse_err:.2e}")
    if (o[total:] != 0).any() or not (lse[:, total:] == -np.inf).all():
        failures.append("varlen: padding rows past cu_seqlens_q[b] are not o = 0, lse = -inf")
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if end == start:
            continue
        others = np.ones(total, bool)
        others[start:end] = False
        kp, vp = (jnp.where(jnp.asarray(others)[:, None, None], jnp.asarray(np.nan, dtype), x) for x in (k, v))
        op, lp = (np.asarray(x, np.float32) for x in jax.block_until_ready(fn(q, kp, vp)))
        if not (np.array_equal(op[start:end], o[start:end]) and np.array_equal(lp[:, start:end], lse[:, start:end])):
            failures.append(f"varlen sequence {b}: NaN in the other sequences' K/V changed it")
    return failures


KV_CAPACITY = 1008  # keys per sequence's cache: 21 pages of KV_PAGE, 144 of KV_ROW_PAGE
KV_PAGE = 48  # a multiple of the kernels' 16-row page pieces that is not a power of two
KV_ROW_PAGE = 7  # the one-row-piece variants' (page_rows 1): not a multiple of 16
KV_CALLS = ((True, (-1, -1), None), (False, WINDOW, 3), (False, (-1, -1), 1))  # (causal, window, num_splits)


def kv_lengths(s_q: int) -> np.ndarray:
    """cache_seqlens of the KV-cache check: an empty cache, exactly the new queries' keys, a partial
    last page, a full cache."""
    return np.asarray([0, s_q, 701, KV_CAPACITY], np.int32)


def to_pages(k, v, lens, seed: int, page: int = KV_PAGE):
    """The contiguous caches (b, KV_CAPACITY, h, d) as a shuffled pool of `page`-row pages with three
    pages no sequence owns; returns (k_pages, v_pages, page_table, owned) -- owned: (pages, page)
    True on the slots some sequence's length covers."""
    b = k.shape[0]
    per_seq = KV_CAPACITY // page
    pool = b * per_seq + 3
    perm = np.random.default_rng(seed).permutation(pool)
    table = perm[: b * per_seq].reshape(b, per_seq).astype(np.int32)
    owned = np.zeros((pool, page), bool)
    for i, n in enumerate(lens):
        for slot in range(int(n)):
            owned[table[i, slot // page], slot % page] = True

    def pages(x):
        x = np.asarray(x, np.float32).reshape(b * per_seq, page, *x.shape[2:])
        out = np.random.default_rng(seed + 1).standard_normal((pool, *x.shape[1:])).astype(np.float32)
        out[table.reshape(-1)] = x
        return out

    return pages(k), pages(v), table, owned


def check_kvcache_variant(fa4_jax, jax, jnp, variant, seed: int, heads=(8, 2)) -> list[str]:
    """Failures of one KV-cache variant: new queries (pack-GQA rows that pick the variant's query
    tile) against caches of kv_lengths -- contiguous, or paged with a shuffled page table when the
    variant is -- for KV_CALLS (causal with automatic splits, a window with forced splits, no mask
    without splits: the one `local` kernel serves all three); each sequence against the oracle, the
    empty one o = 0 / lse = -inf, and NaN in every slot past a sequence's length (and in pages no
    sequence owns) must leave the outputs bit for bit unchanged."""
    dtype, _, _, softcap = call_params(jnp, variant)
    h_q, h_k = heads
    s_q = 3 if variant.tile_m == 64 else 40  # x 4 q-heads per KV head: 12 rows (tile 64), 160 (tile 128)
    lens = kv_lengths(s_q)
    b = len(lens)
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, s_q, h_q, variant.head_dim), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, (b, KV_CAPACITY, h_k, variant.head_dim), jnp.float32).astype(dtype)
            for kk in keys[1:])
    past = np.arange(KV_CAPACITY)[None, :] >= lens[:, None]  # (b, capacity): slots past each length
    if variant.paged:
        kp, vp, table, owned = to_pages(k, v, lens, seed, KV_ROW_PAGE if variant.page_rows == 1 else KV_PAGE)
        caches = (jnp.asarray(kp, dtype), jnp.asarray(vp, dtype))
        poisoned = tuple(jnp.asarray(np.where(owned[:, :, None, None], x, np.nan), dtype) for x in (kp, vp))
        table = jnp.asarray(table)
    else:
        caches, table = (k, v), None
        poisoned = tuple(jnp.where(jnp.asarray(past)[:, :, None, None], jnp.asarray(np.nan, dtype), x) for x in (k, v))
    failures = []
    for causal, window, splits in KV_CALLS:
        fn = jax.jit(lambda q, kc, vc: fa4_jax.attention_with_kvcache(
            q, kc, vc, jnp.asarray(lens), page_table=table, causal=causal, window_size=window, softcap=softcap,
            num_splits=splits, return_lse=True, implementation="fa4"))
        what = f"kvcache {'causal' if causal else f'window {window}'}, splits {splits or 'auto'}"
        try:
            o, lse = (np.asarray(x, np.float32) for x in jax.block_until_ready(fn(q, *caches)))
            o_p, lse_p = (np.asarray(x, np.float32) for x in jax.block_until_ready(fn(q, *poisoned)))
        except Exception as e:  # noqa: BLE001 - an FFI error is a finding
            return failures + [f"{what}: the call failed: {str(e).splitlines()[0][:120]}"]
        for i, n in enumerate(lens):
            if n == 0:
                if (o[i] != 0).any() or not (lse[i] == -np.inf).all():
                    failures.append(f"{what}: an empty cache does not give o = 0, lse = -inf")
                continue
            if not (np.isfinite(o[i]).all() and np.isfinite(lse[i]).all()):
                failures.append(f"{what}, sequence {i} ({n} keys): non-finite output")
                continue
            ref_o, ref_lse = oracle(q[i][None], k[i, :n][None], v[i, :n][None], np.arange(s_q), causal, window,
                                    softcap, heads=h_q)
            err = np.abs(o[i] - ref_o).max() / max(np.abs(ref_o).max(), 1e-30)
            lse_err = np.abs(lse[i] - ref_lse).max()
            if err > REL_ERR_LIMIT or lse_err > LSE_ATOL:
                failures.append(f"{what}, sequence {i} ({n} keys): output error {err:.2e}, LSE error {lse_err:.2e}")
        if not (np.array_equal(o_p, o) and np.array_equal(lse_p, lse)):
            failures.append(f"{what}: NaN in the slots past the lengths (or in unowned pages) changed the output")
    return failures


def speed_rows(fa4_jax, jax, jnp, head_dim: int, causal: bool, seqlens, time_per_call) -> list[tuple]:
    """(seqlen, ours TFLOP/s, cuDNN TFLOP/s or None) of bf16 prefill at 16k tokens per call."""
    out = []
    for s in seqlens:
        b, h = max(1, 16384 // s), 2048 // head_dim
        keys = jax.random.split(jax.random.key(s + head_dim), 3)
        q, k, v = (jax.random.normal(kk, (b, s, h, head_dim), jnp.float32).astype(jnp.bfloat16) for kk in keys)
        flops = 4.0 * b * h * s * s * head_dim / (2 if causal else 1)
        tp = dict(batches=5, target_batch_s=0.05)
        ours = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, implementation="fa4"))
        t_ours = time_per_call(ours, [(q, k, v)], **tp)
        try:
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                         implementation="cudnn"))
            t_cudnn = time_per_call(cudnn, [(q, k, v)], **tp)
        except Exception:  # noqa: BLE001 - cuDNN may not serve the shape (e.g. head_dim 256)
            t_cudnn = None
        out.append((s, flops / t_ours / 1e12, None if t_cudnn is None else flops / t_cudnn / 1e12))
    return out


# A variant's checks take seconds (the first in a child also pays JAX's start and the reference's
# compiles); a child with no new result for this long is taken to hang.
CHILD_TIMEOUT_S = 300


def read_results(path: str) -> dict[str, list[str]]:
    """The {symbol: failures} a child has written so far (one JSON line per finished variant)."""
    done = {}
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    done[r["symbol"]] = r["failures"]
    except FileNotFoundError:
        pass
    except json.JSONDecodeError:  # a line cut short by a crash: the variants before it stand
        pass
    return done


def run_isolated(symbols: list[str], start_child, timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, list[str]]:
    """{symbol: failures} of `symbols`, checked by children: start_child(pending, results_path) returns
    a Popen-like object (poll(), kill(), wait(), a `stderr_tail()` of its last words) running the checks
    of `pending` in order and appending each result to results_path. A child silent for timeout_s is
    killed; the variant it was on is recorded as hung (or crashed, when it died), and a new child
    takes the rest."""
    failures: dict[str, list[str]] = {}
    pending = list(symbols)
    barren = 0  # children in a row that died before any result: the process, not a kernel, is broken
    while pending:
        with tempfile.TemporaryDirectory(prefix="validate_sm100_") as tmp:
            path = os.path.join(tmp, "results.jsonl")
            child = start_child(pending, path)
            seen, last_progress, killed = 0, time.monotonic(), False
            while child.poll() is None:
                n = len(read_results(path))
                if n != seen:
                    seen, last_progress = n, time.monotonic()
                elif time.monotonic() - last_progress > timeout_s:
                    child.kill()
                    child.wait()
                    killed = True
                    break
                time.sleep(0.2)
            rc = child.poll()
            done = read_results(path)
        failures.update({s: f for s, f in done.items() if s in pending})
        rest = [s for s in pending if s not in done]
        if rest:  # the child stopped on rest[0]: that variant is the one to blame
            why = f"hung: no result in {timeout_s:.0f} s (killed)" if killed else f"crashed (exit {rc})"
            tail = "" if killed else child.stderr_tail()
            why += f": {tail}" if tail else ""
            barren = 0 if done or killed else barren + 1
            if barren == 2:  # twice no result at all: every child would fail the same way
                failures.update({s: [f"not run: the checking process fails before any check ({why})"] for s in rest})
                break
            failures[rest[0]] = [why]
            rest = rest[1:]
        pending = rest
    return failures


class _Child:
    """A child process of this script checking `symbols` (start_child of run_isolated)."""

    def __init__(self, symbols: list[str], path: str, flags: list[str]):
        self._err = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the parent holds the GPU too
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-results", path,
                                       "--only", ",".join(symbols), *flags], stderr=self._err,
                                      env=env)

    def poll(self):
        return self._proc.poll()

    def kill(self):
        self._proc.kill()

    def wait(self):
        return self._proc.wait()

    def stderr_tail(self) -> str:
        self._err.seek(0)
        lines = [ln.strip() for ln in self._err.read().splitlines() if ln.strip()]
        return lines[-1][:200] if lines else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--any-arch", action="store_true", help="check the kernels of whatever GPU this is")
    ap.add_argument("--quick", action="store_true", help="one shape per variant, two timed sequence lengths")
    ap.add_argument("--json", default=None, help="write every result here too")
    ap.add_argument("--family", action="append", choices=("fwd", "varlen", "kvcache"),
                    help="check only this family's variants (repeatable; default: all three)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every check in this process (no isolation of hanging or faulting kernels)")
    ap.add_argument("--only", default=None, help="comma-separated symbols: check only these variants")
    ap.add_argument("--child-results", default=None, help=argparse.SUPPRESS)  # a child of run_isolated
    args = ap.parse_args(argv)
    child = args.child_results is not None
    if not args.in_process and not child:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # children share the GPU

    import jax
    import jax.numpy as jnp

    import fa4_jax
    from benchmark import time_per_call
    from fa4_jax.core import library, platform
    from fa4_jax.families import VALIDATED_ARCHES, FwdVariant, KVCacheVariant, VarlenVariant

    device = jax.devices()[0]
    arch = platform.device_arch(device) if device.platform == "gpu" else None
    if arch != "sm100" and not args.any_arch:
        print(f"validate_sm100: this is {device.device_kind} ({device.platform}, arch {arch}), not a Blackwell "
              "(sm_100) GPU; run it on a B200, or pass --any-arch to check the kernels this GPU runs",
              file=sys.stderr)
        return 2
    # (type, not isinstance: the KV-cache and varlen variants subclass the dense one.)
    variants = sorted((v for v in library.compiled_variants() if type(v) is FwdVariant and v.arch == arch),
                      key=lambda v: v.symbol)
    if not variants:
        print(f"validate_sm100: the kernel library holds no dense variant for {arch}: {library.library_status()}",
              file=sys.stderr)
        return 1
    varlen = sorted((v for v in library.compiled_variants() if type(v) is VarlenVariant and v.arch == arch),
                    key=lambda v: v.symbol)
    kvcache = sorted((v for v in library.compiled_variants() if type(v) is KVCacheVariant and v.arch == arch),
                     key=lambda v: v.symbol)
    if args.quick:  # the decode tile of each configuration, contiguous and paged (16-row pieces)
        kvcache = [v for v in kvcache if v.tile_m == 64 and v.page_rows == 16]
    families = set(args.family or ("fwd", "varlen", "kvcache"))
    checked_dense = variants if "fwd" in families else []
    varlen = varlen if "varlen" in families else []
    kvcache = kvcache if "kvcache" in families else []
    if not child:
        print(f"{device.device_kind}, arch {arch} ({'validated' if arch in VALIDATED_ARCHES else 'opt-in'}), "
              f"{len(checked_dense)} dense, {len(varlen)} varlen and {len(kvcache)} KV-cache variants, "
              f"jax {jax.__version__}")

    shapes = [(2, 333, 333, 8, 2)] if args.quick else [(2, 333, 333, 8, 2), (1, 77, 1000, 4, 4), (3, 1, 517, 8, 1)]
    # (variant, its checks) in the order they run; seeds by position in the full lists.
    checks = []
    for i, variant in enumerate(checked_dense):
        def dense(variant=variant, i=i):
            f = check_variant(fa4_jax, jax, jnp, variant, shapes, seed=i)
            f += check_sinks(fa4_jax, jax, jnp, variant, seed=500 + i)
            return f + ([] if args.quick else check_every_tile(fa4_jax, jax, jnp, variant, seed=i))
        checks.append((variant, dense))
    for i, variant in enumerate(varlen):
        checks.append((variant, lambda variant=variant, i=i: check_varlen_variant(fa4_jax, jax, jnp, variant,
                                                                                  seed=1000 + i)))
    for i, variant in enumerate(kvcache):
        checks.append((variant, lambda variant=variant, i=i: check_kvcache_variant(fa4_jax, jax, jnp, variant,
                                                                                   seed=2000 + i)))
    if args.only is not None:
        only = set(args.only.split(","))
        checks = [(v, run) for v, run in checks if v.symbol in only]
    failures = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "not yet validated" warning of the opt-in kernels
        if child or args.in_process:
            for variant, run in checks:
                failures[variant.symbol] = run()
                status = "ok" if not failures[variant.symbol] else failures[variant.symbol][0]
                print(f"  {variant.symbol:<44} {status}", flush=True)
                if child:
                    with open(args.child_results, "a") as f:
                        f.write(json.dumps({"symbol": variant.symbol, "failures": failures[variant.symbol]}) + "\n")
            if child:
                return 0
        else:
            flags = [a for a in ("--quick", "--any-arch") if getattr(args, a[2:].replace("-", "_"))]
            failures = run_isolated([v.symbol for v, _ in checks], lambda pending, path: _Child(pending, path, flags))
            for symbol in (v.symbol for v, _ in checks):
                if failures[symbol] and failures[symbol][0].startswith(("hung", "crashed")):
                    print(f"  {symbol:<44} {failures[symbol][0]}", flush=True)

        seqlens = (1024, 8192) if args.quick else (1024, 4096, 8192, 16384)
        speeds = {}
        for hd in sorted({v.head_dim for v in variants if v.dtype == "bf16" and not v.softcap}):
            for causal in (False, True):
                mask = "causal" if causal else "full"
                if "fwd" not in families or not any(
                        v.head_dim == hd and v.mask == mask and v.dtype == "bf16" and not v.softcap
                        for v in variants) or failures.get(FwdVariant(arch, "bf16", hd, mask, False).symbol):
                    continue
                speeds[(hd, mask)] = speed_rows(fa4_jax, jax, jnp, hd, causal, seqlens, time_per_call)

    print("\nbf16 prefill, 16k tokens per call, TFLOP/s ours / cuDNN:")
    for (hd, mask), rows in speeds.items():
        cells = "  ".join(f"{s // 1024}k {o:5.0f} / {'  -  ' if c is None else f'{c:5.0f}'}" for s, o, c in rows)
        print(f"  hd{hd:<4} {mask:<7} {cells}")

    print("\nverdict per configuration (every dtype's dense, varlen and -- for `local` -- KV-cache variant must "
          "pass):")
    checked = checked_dense + varlen + kvcache
    configs = sorted({(v.head_dim, v.mask, v.softcap) for v in checked})
    verdicts = {}
    for hd, mask, softcap in configs:
        fails = [f for v in checked if (v.head_dim, v.mask, v.softcap) == (hd, mask, softcap)
                 for f in failures[v.symbol]]
        ratios = [o / c for _, o, c in speeds.get((hd, mask), ()) if c] if not softcap else []
        verdicts[f"hd{hd}_{mask}{'_softcap' if softcap else ''}"] = verdict(fails, ratios)
    for name, text in verdicts.items():
        print(f"  {name:<22} {text}")
    bad = [s for s, f in failures.items() if f]
    print(f"\n{len(checked) - len(bad)} of {len(checked)} variants correct. "
          + ("Switching on means adding the architecture to VALIDATED_ARCHES (fa4_jax/families/base.py) and "
             "rebuilding; record this screen in the commit." if arch not in VALIDATED_ARCHES else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "arch": arch, "failures": failures, "verdicts": verdicts,
                       "speeds": {f"hd{hd}_{m}": r for (hd, m), r in speeds.items()}}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
