#!/usr/bin/env python3
"""Forward-attention throughput on a Hopper GPU: fa4_jax vs cuDNN vs Pallas Mosaic-GPU.

    python examples/benchmark.py                     # full table (~3-4 min on an H200)
    python examples/benchmark.py --quick             # two rows, hd128 at 4k
    python examples/benchmark.py --hd 128 --seqlens 1k,8k --causal 1 --json out.json
    python examples/benchmark.py --seqlens 1k,4k,8k,16k --dtype bf16 --json docs/prefill_h200.json --plot docs/prefill_h200.png
    python examples/benchmark.py --from-json docs/prefill_h200.json --plot docs/prefill_h200.png   # re-plot, no GPU
    python examples/benchmark.py --hd 64,96,128,192,256 --seqlens 1k,4k,16k   # + issue 18's consistency lines

After the table (and with --from-json) it prints issue 18's consistency lines: fa4_jax's fp16 / bf16 TFLOP/s
over the rows that have both (target: within 3%), and hd96 / hd192 against the mean of their neighbouring
head dims' rows at the same (causal, seqlen) (target: within 5%).

Setting (the one the project's bar was measured in): 16k tokens per call (batch = 16384 // seqlen),
heads = 2048 // head_dim, self-attention (seqlen_q = seqlen_k), layout (batch, seqlen, heads, head_dim)
for all three. TFLOP/s = 4 * b * h * s^2 * d / t, halved for causal. bf16 for fa4_jax and cuDNN; Pallas
Mosaic-GPU attention is fp16-only, so fa4_jax also runs in fp16 to give a same-dtype ratio.

Timing: each function is jitted and warmed up; a batch is n back-to-back calls (rotating among two input
sets) with one block_until_ready on the last, divided by n, because a single call's wall clock carries
~20-50 us of dispatch. The reported time is the median of several batches. Every competitor's output is
checked against a float64 host reference on a slice before it is timed; a wrong result is reported as
WRONG and not timed.

FlashAttention-4 (flash-attn-4, PyTorch) gets a bf16 column beside cuDNN when its wheels import (the
header says whether they do; docs/BENCHMARKING.md says how to bring them to a GPU host without them),
timed with CUDA events over the same back-to-back batches, checked on the same slice first.

Without a Hopper GPU it says so and runs a small correctness demo of the XLA reference path instead.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time

# The FlashAttention-4 column's PyTorch shares the GPU with jax: jax must not grab 75% of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402

TOKENS_PER_CALL = 16384
MODEL_WIDTH = 2048  # heads * head_dim
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
# Largest dynamic shared memory per block on sm_90 (227 KiB); Pallas configs above it fail to compile.
SM90_SMEM_BYTES = 227 * 1024
# A wrong kernel is off by O(1); a right one by ~1 bf16 ulp (~4e-3 of the max). 2e-2 separates them.
REL_ERR_LIMIT = 2e-2


# --------------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------------


def kernel_device(family: str = "fwd"):
    """(the first GPU, None) when the default build has kernels of `family` (fa4_jax.families: "fwd",
    "kvcache", "varlen") for it, else (None, why). A Blackwell GPU has every family's kernels, opt-in:
    implementation="fa4" runs them (kvcache_page_sizes says which page sizes)."""
    from fa4_jax.core import platform as _platform
    from fa4_jax.families import default_menu, family_of

    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        return None, f"no GPU (default backend {jax.default_backend()!r})"
    reason = _platform.device_unavailable_reason(devices[0])
    if reason is not None:
        return None, reason
    arch = _platform.device_arch(devices[0])
    if not any(v.arch == arch and family_of(v).name == family for v in default_menu()):
        return None, f"the default build has no {family} kernels for {arch} ({devices[0].device_kind}) yet"
    return devices[0], None


def kvcache_page_sizes(device, sizes) -> tuple:
    """The page sizes of `sizes` that the default build's KV-cache kernels serve on `device` (every
    size on Hopper and Blackwell: 16-row pieces or rows); with a menu that lacks the one-row pieces,
    multiples of 16 (another size would run cuDNN or the reference, not the kernel being timed)."""
    from fa4_jax.core import platform as _platform
    from fa4_jax.families import default_menu
    from fa4_jax.ops.kvcache.spec import KVCacheVariant, page_rows_for

    arch = _platform.device_arch(device)
    rows = {v.page_rows for v in default_menu() if isinstance(v, KVCacheVariant) and v.arch == arch and v.paged}
    return tuple(ps for ps in sizes if page_rows_for(ps) in rows)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def header_lines(device) -> list[str]:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    gpu = f"{device.device_kind} (cc {getattr(device, 'compute_capability', '?')})" if device else "none"
    lines = [
        f"fa4_jax benchmark  {now}",
        f"GPU: {gpu}   jax {jax.__version__}   jaxlib {_dist_version('jaxlib')}   "
        f"python {sys.version.split()[0]}   fa4_jax {getattr(fa4_jax, '__version__', '?')}",
    ]
    try:
        from fa4_jax.core import library

        lines.append(f"kernel library: {library.library_path()} ({len(library.compiled_variants())} variants)")
    except Exception as err:  # the header must not be what kills the benchmark
        lines.append(f"kernel library: unavailable ({type(err).__name__}: {err})")
    return lines


# --------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------


def attention_flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


# WARM_BATCH: every timed row, ours and each competitor's, runs one untimed batch of the size it is
# then timed at before its timed batches. On 2026-12-04 (H200, docs/PERF.md) the same hd64 1k call
# measured 371 TFLOP/s as a run's first row and 389 as its third, and the median of five batches did
# not absorb it: the first full-length batch after a change of call (or an idle GPU) runs slower than
# the next ones -- clocks and caches settling -- so the row that happened to come first, or the side
# timed first within a row, paid for it.
def time_per_call(fn, input_sets, *, batches: int, target_batch_s: float) -> float:
    """Median over `batches` of (time of n back-to-back calls, blocked on the last) / n, in seconds.
    One untimed batch of n calls runs first (warm_batch), as for every competitor."""
    for xs in input_sets:  # compile + first touch of every input set
        jax.block_until_ready(fn(*xs))
    # Calibrate n so one batch lasts ~target_batch_s: long enough to bury dispatch and timer noise.
    t0 = time.perf_counter()
    out = None
    for xs in input_sets:
        out = fn(*xs)
    jax.block_until_ready(out)
    per_call = (time.perf_counter() - t0) / len(input_sets)
    n = max(4, min(500, int(target_batch_s / max(per_call, 1e-6))))
    warm = None
    for i in range(n):  # warm_batch: see WARM_BATCH
        warm = fn(*input_sets[i % len(input_sets)])
    jax.block_until_ready(warm)
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for i in range(n):
            out = fn(*input_sets[i % len(input_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def make_inputs(seed: int, b: int, s: int, h: int, d: int, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    # Normal inputs, never zeros (zeros make every softmax uniform and hide bugs, and can be faster).
    return tuple(jax.random.normal(key, (b, s, h, d), jnp.float32).astype(dtype) for key in (kq, kk, kv))


def check_rows(q, k, v):
    """Query rows checked against the host reference: the first 64 (few keys when causal) and last 128."""
    s = q.shape[1]
    return np.unique(np.concatenate([np.arange(min(64, s)), np.arange(max(0, s - 128), s)]))


def reference_slice(q, k, v, rows, causal: bool, heads: int = 2):
    """float64 attention for batch 0, the first `heads` heads and the given query rows (host, numpy)."""
    d = q.shape[-1]
    qs = np.asarray(q[0, rows, :heads], np.float64)  # (r, h, d)
    ks = np.asarray(k[0, :, :heads], np.float64)  # (s, h, d)
    vs = np.asarray(v[0, :, :heads], np.float64)
    logits = np.einsum("rhd,shd->hrs", qs, ks) / math.sqrt(d)
    if causal:  # s_q == s_k here, so bottom-right and top-left alignment coincide
        logits = np.where(np.arange(ks.shape[0])[None, None, :] <= rows[None, :, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hrs,shd->rhd", p, vs)


def relative_error(out, ref, rows, heads: int = 2) -> float:
    got = np.asarray(out[0, rows, :heads], np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


# --------------------------------------------------------------------------------------------------
# competitors: each returns a jitted fn(q, k, v) -> o, or raises
# --------------------------------------------------------------------------------------------------


def fa4_fn(causal: bool):
    return jax.jit(functools.partial(fa4_jax.attention, causal=causal, implementation="fa4"))


def cudnn_fn(causal: bool):
    return jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"))


def pallas_configs(head_dim: int, causal: bool):
    """Block configs for attention_mgpu that fit in shared memory (its kernel stages fp16 tiles)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    configs = []
    for block_q, block_kv, steps in ((64, 128, 2), (64, 64, 2), (64, 256, 2)):
        # Two compute warpgroups each hold a (block_q, d) Q/O tile; K and V are staged `steps` deep.
        smem = 2 * (2 * block_q * head_dim) + 2 * (2 * steps * block_kv * head_dim)
        if smem > SM90_SMEM_BYTES - 4096:  # leave room for barriers
            continue
        configs.append(attention_mgpu.TuningConfig(
            block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=causal))
    return configs


def pallas_fn(config):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    # Positional: `attention` is a custom_vjp whose config/save_residuals are nondiff_argnums.
    return jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, config, False))


def short(err: BaseException, limit: int = 110) -> str:
    msg = " ".join(f"{type(err).__name__}: {err}".split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


class TorchFA4:
    """FlashAttention-4 (PyTorch: `flash_attn.cute.interface.<function>`) on the same values, when its
    wheels import here, or the reason it is not here (printed in the header: the table says which).
    The GPU host lacks the wheels by default; docs/BENCHMARKING.md says how to bring them. Its time is
    the median of batches of n back-to-back calls between CUDA events (its own launch path, no jax
    dispatch), n calibrated to about target_batch_s as time_per_call does."""

    def __init__(self, device, function: str = "flash_attn_func"):
        self.fn, self.torch, self.reason, self.function = None, None, None, function
        try:
            import torch
            from flash_attn.cute import interface
            fn = getattr(interface, function)
        except Exception as err:  # noqa: BLE001 - any import failure means "no column"
            self.reason = f"not importable ({short(err)})"
            return
        if device is None or not torch.cuda.is_available():
            self.reason = "importable, but no Hopper GPU here for the comparison"
            return
        self.fn, self.torch = fn, torch

    def line(self) -> str:
        version = _dist_version("flash-attn-4")
        return "FlashAttention-4: " + (self.reason or f"flash-attn-4 {version}, flash_attn.cute.interface."
                                       f"{self.function} (PyTorch, CUDA events)")

    def tensor(self, x):
        """A CUDA torch tensor with x's values, through numpy (bf16 travels as its 16-bit pattern)."""
        a = np.array(x)  # a writable host copy (torch warns on read-only numpy views of jax arrays)
        if a.dtype == jnp.bfloat16:
            return self.torch.from_numpy(a.view(np.int16)).cuda().view(self.torch.bfloat16)
        return self.torch.from_numpy(a).cuda()

    def time_per_call(self, calls, *, batches: int, target_batch_s: float) -> float:
        """Median over `batches` of (CUDA-event time of n calls, rotating among `calls`) / n, seconds."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def batch(n):
            start.record()
            for i in range(n):
                calls[i % len(calls)]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n

        for _ in calls:
            batch(len(calls))  # compile + first touch of every input set
        n = max(4, min(500, int(target_batch_s / max(batch(len(calls)), 1e-6))))
        batch(n)  # one untimed batch, as time_per_call's (WARM_BATCH)
        return statistics.median(batch(n) for _ in range(batches))

    def release(self):
        if self.torch is not None:
            import gc

            gc.collect()
            self.torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------


def checked_then_timed(name, setup, rows, ref, *, flops, notes):
    """setup() -> (once, timer): once() is one call's output on the first input set, checked against the
    reference slice; timer() is the time per call, taken only when that check passed. Returns (tflops
    or None, seconds or None); why a competitor has no number goes to notes."""
    try:
        once, timer = setup()
        err = relative_error(once(), ref, rows)
        if not err <= REL_ERR_LIMIT:
            notes.append(f"{name}: WRONG (relative error {err:.2e} > {REL_ERR_LIMIT:g} on the checked slice); not timed")
            return None, None
        t = timer()
        return flops / t / 1e12, t
    except Exception as err:  # noqa: BLE001 - one competitor failing must not kill the table
        notes.append(f"{name}: n/a ({short(err)})")
        return None, None


def measure(name, make_fn, input_sets, rows, ref, *, flops, args, notes):
    """A jitted competitor (make_fn() -> fn(q, k, v)), timed with time_per_call."""
    def setup():
        fn = make_fn()
        return (lambda: fn(*input_sets[0][:3]),
                lambda: time_per_call(fn, input_sets, batches=args.batches, target_batch_s=args.target_batch_s))

    return checked_then_timed(name, setup, rows, ref, flops=flops, notes=notes)


def measure_flash4(flash4: TorchFA4, input_sets, rows, ref, causal: bool, *, flops, args, notes, name):
    """FlashAttention-4 on the same values, timed with CUDA events."""
    def setup():
        torch_sets = [tuple(flash4.tensor(x) for x in xs) for xs in input_sets]

        def call(q, k, v):
            out = flash4.fn(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) in the versions we know

        return (lambda: call(*torch_sets[0]).float().cpu().numpy(),
                lambda: flash4.time_per_call([functools.partial(call, *xs) for xs in torch_sets],
                                             batches=args.batches, target_batch_s=args.target_batch_s))

    try:
        return checked_then_timed(name, setup, rows, ref, flops=flops, notes=notes)
    finally:
        flash4.release()


def run_row(hd: int, causal: bool, seqlen: int, args) -> dict:
    b, h = max(1, TOKENS_PER_CALL // seqlen), MODEL_WIDTH // hd
    flops = attention_flops(b, h, seqlen, hd, causal)
    row = dict(head_dim=hd, causal=causal, seqlen=seqlen, batch=b, heads=h, flops=flops, notes=[])
    notes = row["notes"]
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        sets = [make_inputs(1000 * i + seqlen + hd, b, seqlen, h, hd, dtype) for i in range(2)]
        rows = check_rows(*sets[0])
        ref = reference_slice(*sets[0], rows, causal)
        tf, t = measure(f"fa4 {dname}", lambda: fa4_fn(causal), sets, rows, ref, flops=flops, args=args, notes=notes)
        row[f"fa4_{dname}_tflops"], row[f"fa4_{dname}_s"] = tf, t
        if dname == "bf16" and args.flash4.fn is not None:
            tf, t = measure_flash4(args.flash4, sets, rows, ref, causal, flops=flops, args=args,
                                   notes=notes, name=f"FlashAttention-4 {dname}")
            row[f"flash4_{dname}_tflops"], row[f"flash4_{dname}_s"] = tf, t
        if dname == "bf16" or args.cudnn_fp16:
            tf, t = measure(f"cuDNN {dname}", lambda: cudnn_fn(causal), sets, rows, ref,
                            flops=flops, args=args, notes=notes)
            row[f"cudnn_{dname}_tflops"], row[f"cudnn_{dname}_s"] = tf, t
        if dname == "fp16":
            best, best_cfg = None, None
            try:
                configs = pallas_configs(hd, causal)
                if not configs:
                    notes.append(f"Pallas: n/a (no block config fits shared memory at hd{hd})")
            except Exception as err:
                configs = []
                notes.append(f"Pallas: n/a ({short(err)})")
            # attention_mgpu applies no softmax scale (its own reference uses raw q.k logits), so
            # it gets q pre-scaled by 1/sqrt(d): the same function, with the multiply kept outside
            # the timed call.
            scale = hd ** -0.5
            pallas_sets = [((s[0].astype(jnp.float32) * scale).astype(dtype), *s[1:]) for s in sets]
            for cfg in configs:
                label = f"Pallas bq{cfg.block_q}/bkv{cfg.block_kv}/st{cfg.max_concurrent_steps}"
                tf, t = measure(label, functools.partial(pallas_fn, cfg), pallas_sets, rows, ref,
                                flops=flops, args=args, notes=notes)
                if tf is not None and (best is None or tf > best):
                    best, best_cfg = tf, label.split(" ", 1)[1]
            row["pallas_fp16_tflops"], row["pallas_fp16_config"] = best, best_cfg
        del sets
    return row


def fmt(x, width=8, prec=0):
    return f"{x:{width}.{prec}f}" if x is not None else f"{'n/a':>{width}}"


def ratio(a, b, width=7):
    return f"{a / b:{width}.2f}" if a is not None and b is not None and b > 0 else f"{'-':>{width}}"


def table_header(dtypes, flash4: bool = False) -> str:
    cols = f"{'hd':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5} |"
    if "bf16" in dtypes:
        cols += f" {'fa4 bf16':>8} {'cuDNN':>8} {'fa4/cuD':>7} |"
        if flash4:
            cols += f" {'FA4':>8} {'fa4/FA4':>7} |"
    if "fp16" in dtypes:
        cols += f" {'fa4 fp16':>8} {'Pallas':>8} {'fa4/Pal':>7} | Pallas best config"
    return cols


def table_line(r, dtypes, flash4: bool = False) -> str:
    line = f"{r['head_dim']:>4} {('yes' if r['causal'] else 'no'):>6} {r['seqlen']:>6} {r['batch']:>5} {r['heads']:>5} |"
    if "bf16" in dtypes:
        a, c = r.get("fa4_bf16_tflops"), r.get("cudnn_bf16_tflops")
        line += f" {fmt(a)} {fmt(c)} {ratio(a, c)} |"
        if flash4:
            f4 = r.get("flash4_bf16_tflops")
            line += f" {fmt(f4)} {ratio(a, f4)} |"
    if "fp16" in dtypes:
        a, p = r.get("fa4_fp16_tflops"), r.get("pallas_fp16_tflops")
        line += f" {fmt(a)} {fmt(p)} {ratio(a, p)} | {r.get('pallas_fp16_config') or ''}"
    return line


# Issue 18's consistency targets: fp16 within 3% of bf16, and head dims 96 / 192 within 5% of their
# neighbours' efficiency (TFLOP/s against the mean of the two neighbouring head dims' rows).
NEIGHBOURS = {96: (64, 128), 192: (128, 256)}


def consistency_lines(rows) -> list[str]:
    """fa4_jax's fp16 / bf16 TFLOP/s over the rows that have both, and hd96 / hd192 against the mean
    of their neighbours' rows at the same (causal, seqlen), per dtype: min-max and the row of the min."""
    lines = []

    def span(what, pairs):
        if pairs:
            (lo, at), hi = min(pairs), max(p for p, _ in pairs)
            lines.append(f"{what}: {lo:.3f}-{hi:.3f} over {len(pairs)} rows (min at {at})")

    def where(r):
        return f"hd{r['head_dim']} {'causal' if r['causal'] else 'full'} {r['seqlen']}"

    span("fa4_jax fp16 / bf16", [(r["fa4_fp16_tflops"] / r["fa4_bf16_tflops"], where(r)) for r in rows
                                 if r.get("fa4_fp16_tflops") and r.get("fa4_bf16_tflops")])
    by = {(r["head_dim"], r["causal"], r["seqlen"]): r for r in rows}
    for hd, (lo, hi) in NEIGHBOURS.items():
        for dtype in ("bf16", "fp16"):
            key = f"fa4_{dtype}_tflops"
            pairs = []
            for (h, causal, seqlen), r in by.items():
                a, b = by.get((lo, causal, seqlen)), by.get((hi, causal, seqlen))
                if h == hd and r.get(key) and a and b and a.get(key) and b.get(key):
                    pairs.append((2 * r[key] / (a[key] + b[key]), where(r)))
            span(f"fa4_jax {dtype} hd{hd} / mean(hd{lo}, hd{hi})", pairs)
    return lines


def parse_seqlens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hd", default="64,128,256", help="head dims, comma-separated (default 64,128,256)")
    p.add_argument("--seqlens", default="1k,2k,4k,8k,16k", help="sequence lengths, e.g. 1k,4k,16384")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16", "both"), default="both",
                   help="bf16: fa4 vs cuDNN; fp16: fa4 vs Pallas MGPU; both (default)")
    p.add_argument("--quick", action="store_true", help="two rows: hd128, 4k, causal no/yes")
    p.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON")
    p.add_argument("--batches", type=int, default=5, help="timed batches per measurement; median reported (>= 5)")
    p.add_argument("--target-batch-s", type=float, default=0.04, help="approximate duration of one timed batch")
    p.add_argument("--cudnn-fp16", action="store_true", help="also time cuDNN in fp16")
    p.add_argument("--plot", metavar="PNG", help="also draw TFLOP/s against sequence length per head dim "
                   "(fa4_jax, cuDNN, FlashAttention-4 when timed; bf16) into this PNG (needs matplotlib)")
    p.add_argument("--from-json", metavar="PATH", help="measure nothing: plot a --json file of an earlier run "
                   "(with --plot; e.g. on a machine that has matplotlib when the GPU host has not)")
    args = p.parse_args(argv)
    if args.from_json and not args.plot:
        p.error("--from-json needs --plot")
    args.hds = [int(x) for x in args.hd.split(",") if x.strip()]
    args.seqlen_list = parse_seqlens(args.seqlens)
    args.causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    args.dtypes = ["bf16", "fp16"] if args.dtype == "both" else [args.dtype]
    if args.quick:
        args.hds, args.seqlen_list, args.causals = [128], [4096], [False, True]
    if args.batches < 1:
        p.error("--batches must be >= 1")
    return args


# --------------------------------------------------------------------------------------------------
# the plot
# --------------------------------------------------------------------------------------------------

PLOT_SERIES = (("fa4_bf16_tflops", "fa4_jax", "C0", "o"), ("cudnn_bf16_tflops", "cuDNN", "C1", "s"),
               ("flash4_bf16_tflops", "FlashAttention-4", "C2", "^"))


def plot_rows(rows: list[dict], path: str, title: str) -> list[str]:
    """TFLOP/s against sequence length, one panel per (causal, head_dim), one line per competitor
    timed in bf16 (a competitor with no number in a panel is left out of it). Returns the competitors
    drawn. matplotlib is imported here only: the benchmark itself does not need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hds = sorted({r["head_dim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(causals), len(hds), figsize=(4.2 * len(hds), 3.4 * len(causals)),
                             squeeze=False, sharey=True)
    drawn = []
    for i, causal in enumerate(causals):
        for j, hd in enumerate(hds):
            ax = axes[i][j]
            panel = sorted((r for r in rows if r["head_dim"] == hd and r["causal"] == causal),
                           key=lambda r: r["seqlen"])
            for key, label, color, marker in PLOT_SERIES:
                pts = [(r["seqlen"], r[key]) for r in panel if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), label=label, color=color, marker=marker)
                    drawn.append(label)
            ax.set_xscale("log", base=2)
            ax.set_xticks([r["seqlen"] for r in panel], [f"{r['seqlen'] // 1024}k" if r["seqlen"] % 1024 == 0
                                                          else str(r["seqlen"]) for r in panel])
            ax.minorticks_off()
            ax.set_title(f"head_dim {hd}, {'causal' if causal else 'full'}", fontsize=10)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s (bf16)")
            if i == len(causals) - 1:
                ax.set_xlabel("sequence length (16k tokens per call)")
    labels = [label for _, label, _, _ in PLOT_SERIES if label in drawn]
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend([handles[label] for label in labels], labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.suptitle(title, fontsize=9, y=0.005, va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


def plot_title(meta: dict) -> str:
    date = str(meta.get("date", ""))[:16].replace("T", " ")
    commit = f"fa4_jax {meta['commit']}, " if meta.get("commit") else ""
    return f"{meta.get('device', '?')}, {commit}jax {meta.get('jax', '?')}, {date}; one run, back-to-back calls " \
           f"(FlashAttention-4: CUDA events); examples/benchmark.py"


def checkout_commit() -> str | None:
    """The checkout's short commit (with "+" when it has local changes), or None outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+" if dirty else "")


def write_plot(rows, meta, path) -> None:
    try:
        labels = plot_rows(rows, path, plot_title(meta))
    except ImportError as err:
        print(f"benchmark: no plot ({short(err)}): pip install matplotlib, or plot the --json file later "
              f"with --from-json on a machine that has it")
        return
    print(f"plot ({', '.join(labels)}) written to {path}")


# --------------------------------------------------------------------------------------------------
# CPU fallback: the reference path's correctness, in a few seconds
# --------------------------------------------------------------------------------------------------


def cpu_demo() -> int:
    print("No Hopper (compute capability 9.x) GPU visible to jax: the FA4 kernel cannot run here, so there is\n"
          "nothing to time. Running a small correctness demo of the XLA reference path instead.\n")
    cases = [  # (dtype, b, s_q, s_k, h_q, h_k, d, causal)
        ("bf16", 2, 128, 128, 4, 4, 64, False),
        ("bf16", 1, 200, 200, 8, 2, 128, True),
        ("fp16", 1, 77, 300, 6, 2, 96, True),
        ("bf16", 1, 300, 100, 4, 1, 256, True),  # rows that see no key -> O = 0, LSE = -inf
    ]
    ok = True
    for dname, b, s_q, s_k, h_q, h_k, d, causal in cases:
        # numpy's generator: jax.random would spend seconds compiling on CPU for a few small arrays.
        rng = np.random.default_rng(s_q * 7 + d)
        q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32).astype(DTYPES[dname]))
                   for shape in ((b, s_q, h_q, d), (b, s_k, h_k, d), (b, s_k, h_k, d)))
        t0 = time.perf_counter()
        o, lse = fa4_jax.attention(q, k, v, causal=causal, return_lse=True)  # implementation=None -> xla
        o = np.asarray(o, np.float64)
        dt = time.perf_counter() - t0
        # float64 oracle with the contract's semantics: bottom-right causal mask, GQA head groups.
        q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
        k64, v64 = (np.repeat(x, h_q // h_k, axis=2) for x in (k64, v64))
        logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(d)
        if causal:
            visible = np.arange(s_k)[None, :] <= np.arange(s_q)[:, None] + (s_k - s_q)
            logits = np.where(visible, logits, -np.inf)
        m = logits.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(logits - m)
        l = p.sum(-1, keepdims=True)
        ref = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1.0), v64)
        ref_lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
        err = np.abs(o - ref).max() / np.abs(ref).max()
        lse_ok = np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
        good = err < REL_ERR_LIMIT and lse_ok and np.isfinite(o).all()
        ok &= good
        print(f"  {dname} b={b} s_q={s_q} s_k={s_k} h={h_q}/{h_k} d={d} causal={causal!s:5}: "
              f"max rel err {err:.1e}, empty rows {int(np.isneginf(ref_lse).sum())}, {dt * 1e3:.0f} ms "
              f"{'ok' if good else 'WRONG'}")
    print("\nreference path " + ("agrees with the float64 oracle." if ok else "DISAGREES with the float64 oracle!"))
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        for line in consistency_lines(data["rows"]):
            print(line)
        write_plot(data["rows"], data["meta"], args.plot)
        return 0
    device, why = kernel_device("fwd")
    if device is None:
        print(f"benchmark: no fa4_jax kernels to measure here ({why}); the CPU demo instead")
    for line in header_lines(device):
        print(line)
    if device is None:
        return cpu_demo()

    args.flash4 = TorchFA4(device)
    print(args.flash4.line())
    flash4 = args.flash4.fn is not None and "bf16" in args.dtypes
    print(f"setting: {TOKENS_PER_CALL} tokens/call, heads = {MODEL_WIDTH} // hd, TFLOP/s = 4*b*h*s^2*d/t "
          f"(/2 causal), median of {args.batches} batches of back-to-back calls, 2 input sets")
    print(table_header(args.dtypes, flash4))
    print("-" * len(table_header(args.dtypes, flash4)))
    t_start = time.perf_counter()
    results = []
    for hd in args.hds:
        for causal in args.causals:
            for seqlen in args.seqlen_list:
                r = run_row(hd, causal, seqlen, args)
                results.append(r)
                print(table_line(r, args.dtypes, flash4), flush=True)
                for note in r["notes"]:
                    print(f"{'':>31}  ^ {note}", flush=True)
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(results)} rows in {elapsed:.0f} s. Ratios > 1 mean fa4_jax is faster (same run, same dtype).")
    for line in consistency_lines(results):
        print(line)

    meta = dict(header=header_lines(device), flash4=args.flash4.line(), commit=checkout_commit(),
                device=device.device_kind, jax=jax.__version__,
                date=datetime.datetime.now().astimezone().isoformat(), tokens_per_call=TOKENS_PER_CALL,
                model_width=MODEL_WIDTH, batches=args.batches, elapsed_s=elapsed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=results), f, indent=1)
        print(f"raw numbers written to {args.json}")
    if args.plot:
        write_plot(results, meta, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
