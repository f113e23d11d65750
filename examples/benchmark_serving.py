#!/usr/bin/env python3
"""Ragged paged serving (issue 15): one continuous-batching step in one call, on a Hopper GPU.

    python examples/benchmark_serving.py                  # the three tables (several minutes on an H200)
    python examples/benchmark_serving.py --quick          # small sizes; also runs on CPU (XLA reference)
    python examples/benchmark_serving.py --workloads decode --json out.json

Setting: bf16, 32 query heads over 8 KV heads, head_dim 128, causal (bottom-right per sequence). Every
paged cache is a shuffled pool: each sequence's pages are scattered at random in a pool ~25% larger
than the pages in use, so neighbouring pages of a sequence are never neighbours in memory.

1. mixed: one continuous-batching step. 8 sequences each add a 512-token prefill chunk on top of
   2k-16k tokens of context (np.linspace), and 56 sequences decode one token with 1k-32k keys,
   all in ONE call: `attention_with_kvcache(q_packed, k_pages, v_pages, cache_seqlens,
   cu_seqlens_q=cu, max_seqlen_q=512, page_table=pt, causal=True)`. Beside it the two-call
   baseline of the non-ragged API: q (8, 512, 32, 128) for the chunks and q (56, 1, 32, 128) for the
   decodes, same pool, the page table's rows split.
2. decode: 64 sequences, 1k-32k keys, one query each, as a ragged call (cu_seqlens_q = arange(65)) and
   as the plain (64, 1, 32, 128) call; paged with pages of 1/16/64/128 tokens and contiguous
   (64, 32768, 8, 128). TB/s = the K and V bytes a call must read (2 * sum(keys) * 8 * 128 * 2) / time.
3. chunked prefill: the 8 chunks of 1 alone, ragged-paged (page 64) vs the dense kernel
   `fa4_jax.attention(q, k, v, causal=True)` on the same logical problem, one (1, 512) x (1, L) call per
   sequence (the dense API has one key length per call). TFLOP/s = the visible (query, key) pairs:
   4 * 32 * 128 * sum over chunk rows i of (L - 512 + i + 1), over the time.

Timing (docs/BENCHMARKING.md, "device time inside one program"): `--loop` (20) dependent calls run in
one jitted, unrolled `jax.lax.fori_loop`, each call's output being the next call's q, timed with
`time_per_call` (benchmark.py) and divided by the loop count; the competitors of a row are timed in
turn, `--rounds` (5) times interleaved, and each cell is the median [min-max] over the rounds, in
microseconds per call. A single row's K/V is far larger than the GPU's L2 cache except in the chunked
prefill table (compute-bound), so one input set is used. In the loop our page table and lengths get
a run-time zero that depends on the previous output (`tie`), so nothing of a call can be computed
once for all n; that costs us one elementwise pass over the page table per call (8 MB at page size 1).

FlashAttention-4 column: when `torch` and `flash_attn.cute.interface.flash_attn_varlen_func` import
and a CUDA device is visible, the mixed and decode rows also run FA4 on the same values (copied through
numpy), timed with CUDA events over back-to-back calls. ours/FA4 = FA4 time / our one-call time (> 1:
ours is faster), the repository's convention for same-run ratios.

Correctness first: before a row is timed, every competitor's output is compared, on the inputs that
are then timed, with a float32 numpy reference computed here from the keys gathered through the page
table: up to 3 chunk sequences (their first and last 64 query rows) and 5 decode sequences. A
competitor whose max abs error, or error relative to the largest reference value, exceeds 2e-2
(or that returns NaN/Inf) is reported as WRONG and not timed.

Without a Hopper GPU the --quick sizes run through the XLA reference (implementation=None), so the
tables print, but their timings are those of the CPU reference, not of the kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import statistics
import sys
import time

# The FA4 column's PyTorch shares the GPU with jax: jax must not grab 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import TorchFA4, header_lines, kernel_device, kvcache_page_sizes, short, time_per_call  # noqa: E402

import fa4_jax  # noqa: E402

H_Q, H_KV, D = 32, 8, 128
# A correct bf16 result is ~1 ulp off (~4e-3 relative); a wrong mask, page or sequence offset is O(1)
# relative. The outputs here are small (softmax averages of N(0, 1) values over thousands of keys), so
# the relative test is the one that catches a wrong kernel; the absolute one is the bar.
ERR_LIMIT = 2e-2
CHECK_ROWS = 64  # first and last query rows of a checked chunk: the fewest and the most visible keys
POOL_SLACK = 1.25  # the page pool is this much larger than the pages in use


@dataclasses.dataclass(frozen=True)
class Sizes:
    chunk: int  # prefill chunk length (queries per chunk sequence)
    n_chunks: int
    chunk_context: tuple[int, int]  # existing context under the chunks, spread over [lo, hi]
    n_decodes: int  # one-token decodes in the mixed step
    decode_keys: tuple[int, int]  # keys of a decoding sequence (the new token included), spread
    decode_batch: int  # sequences of the decode table
    page_sizes: tuple[int, ...]
    prefill_page: int  # page size of the chunked-prefill table
    contiguous_capacity: int  # capacity of the decode table's contiguous cache
    loop: int  # dependent calls per timed program
    rounds: int  # interleaved repeats of a row's competitors
    batches: int  # time_per_call batches per measurement
    target_batch_s: float


FULL = Sizes(chunk=512, n_chunks=8, chunk_context=(2048, 16384), n_decodes=56, decode_keys=(1024, 32768),
             decode_batch=64, page_sizes=(1, 16, 64, 128), prefill_page=64, contiguous_capacity=32768,
             loop=20, rounds=5, batches=3, target_batch_s=0.05)
QUICK = Sizes(chunk=64, n_chunks=2, chunk_context=(256, 1024), n_decodes=6, decode_keys=(128, 1024),
              decode_batch=8, page_sizes=(1, 16), prefill_page=16, contiguous_capacity=1024,
              loop=2, rounds=1, batches=1, target_batch_s=0.01)


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------


def normal(seed: int, shape) -> jax.Array:
    """bf16 N(0, 1) values (never zeros: they make every softmax uniform and hide bugs)."""
    if math.prod(shape) <= 1 << 24:
        # numpy: on CPU jax.random would spend longer compiling for each shape than drawing.
        return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(jnp.bfloat16))
    # Large pools (GBs): drawn on the device (a host round trip would dominate the setup), in pieces
    # along axis 0 so the float32 draw stays ~1 GB and far from the 2**32-count limit of jax.random.
    step = max(1, (1 << 28) // math.prod(shape[1:]))
    return jnp.concatenate([
        jax.random.normal(jax.random.key(seed * 1000 + i), (min(step, shape[0] - start), *shape[1:]),
                          jnp.float32).astype(jnp.bfloat16)
        for i, start in enumerate(range(0, shape[0], step))])


def spread(lo: int, hi: int, n: int) -> np.ndarray:
    return np.linspace(lo, hi, n).round().astype(np.int64)


def offsets(q_lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def token_pool(seed: int, lengths: np.ndarray, max_page: int):
    """(k, v) of (tokens, H_KV, D): room for every sequence with POOL_SLACK to spare, a whole number
    of pages of every page size used (max_page a multiple of each); cut into pages by `paginate`."""
    tokens = int(math.ceil(POOL_SLACK * lengths.sum())) + len(lengths) * max_page
    tokens = -(-tokens // max_page) * max_page
    return normal(seed, (tokens, H_KV, D)), normal(seed + 1, (tokens, H_KV, D))


@dataclasses.dataclass
class Paged:
    k: jax.Array  # (num_pages, page_size, H_KV, D)
    v: jax.Array
    table: np.ndarray  # int32 (batch, max_pages)
    page_size: int


def paginate(k_tok, v_tok, lengths: np.ndarray, page_size: int, seed: int | None) -> Paged:
    """The token pool seen as pages of `page_size`, each sequence owning pages drawn at random from the
    whole pool (a shuffled, partly free pool, as a serving engine's page allocator leaves it); with
    seed None, consecutive pages in order (a diagnostic: what shuffling itself costs)."""
    num_pages = k_tok.shape[0] // page_size
    need = -(-lengths // page_size)
    perm = (np.arange(num_pages) if seed is None else np.random.default_rng(seed).permutation(num_pages)).astype(np.int32)
    assert need.sum() <= num_pages
    table = np.zeros((len(lengths), int(need.max())), np.int32)  # entries past a sequence's pages: never read
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    pages = lambda x: x.reshape(num_pages, page_size, H_KV, D)  # noqa: E731 - free reshape
    return Paged(pages(k_tok), pages(v_tok), table, page_size)


def sequence_kv(cache, b: int, length: int):
    """Sequence b's first `length` keys and values as float32 numpy (L, H_KV, D), gathered the way the
    kernels must: through the page table (or a contiguous cache's row)."""
    if isinstance(cache, Paged):
        ids = jnp.asarray(cache.table[b, :-(-length // cache.page_size)])
        get = lambda x: np.asarray(jnp.take(x, ids, axis=0)).reshape(-1, H_KV, D)[:length]  # noqa: E731
    else:
        get = lambda x: np.asarray(x[b, :length])  # noqa: E731
    k, v = cache if not isinstance(cache, Paged) else (cache.k, cache.v)
    return get(k).astype(np.float32), get(v).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# the float32 reference and the check
# --------------------------------------------------------------------------------------------------


def reference_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, last_key: np.ndarray) -> np.ndarray:
    """float32 attention of query rows q (r, H_Q, D) over keys (L, H_KV, D); row i sees keys 0 ...
    last_key[i] (causal, bottom-right). GQA: query head h reads KV head h // (H_Q // H_KV)."""
    r, g, length = q.shape[0], H_Q // H_KV, k.shape[0]
    qg = q.reshape(r, H_KV, g, D).transpose(1, 0, 2, 3).reshape(H_KV, r * g, D)
    s = (qg @ k.transpose(1, 2, 0)).reshape(H_KV, r, g, length) * D ** -0.5
    visible = np.arange(length)[None, :] <= last_key[:, None]  # (r, L)
    s = np.where(visible[None, :, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p.reshape(H_KV, r * g, length) @ v.transpose(1, 0, 2)  # (H_KV, r * g, D)
    return o.reshape(H_KV, r, g, D).transpose(1, 0, 2, 3).reshape(r, H_Q, D)


def checked(n: int, k: int) -> list[int]:
    """Up to k sequence indices spread over 0 ... n - 1 (the shortest, the longest, between)."""
    return sorted(set(np.linspace(0, n - 1, min(k, n)).round().astype(int).tolist())) if n else []


def reference(q_packed: np.ndarray, cu: np.ndarray, lens: np.ndarray, seqs, cache):
    """(packed query rows, their float32 reference outputs (r, H_Q, D)) for the first and last
    CHECK_ROWS queries of each sequence in seqs."""
    rows, refs = [], []
    for b in seqs:
        n_q = int(cu[b + 1] - cu[b])
        local = np.unique(np.concatenate([np.arange(min(CHECK_ROWS, n_q)), np.arange(max(0, n_q - CHECK_ROWS), n_q)]))
        k, v = sequence_kv(cache, b, int(lens[b]))
        last_key = int(lens[b]) - n_q + local  # query i is key position lens - n_q + i
        refs.append(reference_rows(q_packed[cu[b] + local], k, v, last_key))
        rows.append(cu[b] + local)
    return np.concatenate(rows), np.concatenate(refs)


def errors(out: np.ndarray, ref) -> tuple[float, float]:
    """(max abs error, max abs error / max |reference|) over the checked rows; inf if not finite."""
    rows, want = ref
    got = out[rows]
    if not np.isfinite(got).all():
        return math.inf, math.inf
    err = float(np.abs(got - want).max())
    return err, err / max(float(np.abs(want).max()), 1e-30)


# --------------------------------------------------------------------------------------------------
# our calls, and n of them in one program
# --------------------------------------------------------------------------------------------------


def tie(x, carry):
    """x + 0, where the 0 depends on carry at run time: an integer operand (page table, lengths) made
    different in every iteration of the timed loop. Without it, work that does not depend on q (the
    paged cache gathered into a contiguous copy, scheduling metadata) is the same expression in all
    unrolled iterations, and XLA computes it once: the loop would time less than n real calls."""
    first = jax.tree_util.tree_leaves(carry)[0].reshape(-1)[0]
    return x + jax.lax.ne(first, first).astype(x.dtype)  # x != x holds for NaN: XLA cannot fold it to 0


def ragged_step(q, k, v, lens, cu, table, *, max_seqlen_q, impl):
    return fa4_jax.attention_with_kvcache(q, k, v, tie(lens, q), cu_seqlens_q=cu, max_seqlen_q=max_seqlen_q,
                                          page_table=None if table is None else tie(table, q), causal=True,
                                          implementation=impl)


def kvcache_step(q, k, v, lens, table, *, impl):
    """The non-ragged API: q (batch, seqlen_q, H_Q, D)."""
    return fa4_jax.attention_with_kvcache(q, k, v, tie(lens, q), page_table=None if table is None else tie(table, q),
                                          causal=True, implementation=impl)


def two_call_step(carry, k, v, lens_c, lens_d, table_c, table_d, *, impl):
    q_chunks, q_decodes = carry
    return (kvcache_step(q_chunks, k, v, lens_c, table_c, impl=impl),
            kvcache_step(q_decodes, k, v, lens_d, table_d, impl=impl))


def dense_step(qs, ks, vs, *, impl):
    """One dense causal call per sequence: (1, chunk, H_Q, D) x (1, L, H_KV, D)."""
    return tuple(fa4_jax.attention(q, k, v, causal=True, implementation=impl) for q, k, v in zip(qs, ks, vs))


def looped(step, n: int):
    """jit of n dependent calls: step(carry, *operands) -> carry (the output is the next call's q),
    unrolled (a rolled fori_loop adds per-iteration overhead of its own: docs/BENCHMARKING.md).
    o has q's shape and dtype and stays finite, so it is a valid q; the kernels do the same work
    whatever the values. Returns (last output, first output): the first is the one-call result the
    correctness check reads, so one compiled program serves the check and the timing."""
    def run(carry, *operands):
        first = step(carry, *operands)
        last = jax.lax.fori_loop(1, n, lambda i, c: step(c, *operands), first, unroll=True)
        return last, first
    return jax.jit(run)


def packed(out) -> np.ndarray:
    """Any of our outputs (one array or a tuple of per-group arrays) as float32 (total_q, H_Q, D)."""
    parts = out if isinstance(out, tuple) else (out,)
    return np.concatenate([np.asarray(x).astype(np.float32).reshape(-1, H_Q, D) for x in parts])


@dataclasses.dataclass
class Competitor:
    name: str
    once: object  # () -> float32 packed output (np)
    measure: object  # () -> seconds per call
    result: dict = dataclasses.field(default_factory=dict)


def ours(name, step, carry, operands, sz: Sizes) -> Competitor:
    timed = looped(step, sz.loop)
    args = (carry, *operands)
    return Competitor(
        name,
        once=lambda: packed(timed(*args)[1]),
        measure=lambda: time_per_call(timed, [args], batches=sz.batches, target_batch_s=sz.target_batch_s) / sz.loop)


# --------------------------------------------------------------------------------------------------
# FlashAttention-4 (PyTorch), optional
# --------------------------------------------------------------------------------------------------


class FlashAttention4(TorchFA4):
    """flash_attn.cute's flash_attn_varlen_func on the same values, or the reason it is not here."""

    def __init__(self, device):
        super().__init__(device, "flash_attn_varlen_func")

    def competitor(self, sz: Sizes, q_packed, k, v, cu, lens, max_seqlen_q, table) -> Competitor:
        """k, v: pages (num_pages, page_size, H_KV, D) with table, or a contiguous (batch, capacity,
        H_KV, D) cache (table None); the sequences' used keys are seqused_k = lens."""
        tq, tk, tv = self.tensor(q_packed), self.tensor(k), self.tensor(v)
        tcu, tlens = self.tensor(np.asarray(cu, np.int32)), self.tensor(np.asarray(lens, np.int32))
        ttable = None if table is None else self.tensor(np.asarray(table, np.int32))

        def call():
            out = self.fn(tq, tk, tv, cu_seqlens_q=tcu, max_seqlen_q=max_seqlen_q, seqused_k=tlens,
                          page_table=ttable, causal=True)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) in the versions we know

        return Competitor("FA4", once=lambda: call().float().cpu().numpy(),
                          measure=lambda: self.time_per_call([call], batches=sz.batches,
                                                             target_batch_s=sz.target_batch_s))


# --------------------------------------------------------------------------------------------------
# checking and timing a row's competitors
# --------------------------------------------------------------------------------------------------


def run_row(competitors: list[Competitor], ref, sz: Sizes, notes: list[str]) -> dict[str, dict]:
    """Check each competitor (errors, or why it cannot run), then time the good ones, interleaved."""
    live = []
    for c in competitors:
        try:
            err, rel = errors(c.once(), ref)
        except ValueError as e:  # our API refusing the call (e.g. a page size the non-ragged kernel lacks)
            c.result = dict(status="refused", reason=short(e, 300))
            notes.append(f"{c.name}: refused ({short(e, 300)})")
            continue
        except Exception as e:  # noqa: BLE001 - one competitor failing must not stop the table
            c.result = dict(status="n/a", reason=short(e))
            notes.append(f"{c.name}: n/a ({short(e)})")
            continue
        c.result = dict(max_abs_err=err, rel_err=rel)
        good = err < ERR_LIMIT and rel < ERR_LIMIT
        notes.append(f"{c.name}: max abs err {err:.1e} (rel {rel:.1e}) vs float32 reference "
                     f"{'ok' if good else f'WRONG, over {ERR_LIMIT:g}: not timed'}")
        if good:
            live.append(c)
        else:
            c.result["status"] = "WRONG"
    samples = {c.name: [] for c in live}
    for _ in range(sz.rounds):  # interleaved: board drift during the row hits every competitor alike
        for c in live:
            if "status" in c.result:
                continue
            try:
                samples[c.name].append(c.measure())
            except Exception as e:  # noqa: BLE001
                c.result.update(status="n/a", reason=short(e))
                notes.append(f"{c.name}: timing failed ({short(e)})")
    for c in live:
        if "status" not in c.result:
            us = [t * 1e6 for t in samples[c.name]]
            c.result.update(us=statistics.median(us), us_min=min(us), us_max=max(us), us_rounds=us)
    return {c.name: c.result for c in competitors}


def us(r: dict | None) -> float | None:
    return None if not r else r.get("us")


def cell(r: dict | None, width: int = 24) -> str:
    """median [min-max] in microseconds, or why there is no number."""
    if r is None:
        return f"{'-':>{width}}"
    if "us" not in r:
        return f"{r.get('status', 'n/a'):>{width}}"
    text = f"{r['us']:.1f}" if r["us_min"] == r["us_max"] else f"{r['us']:.1f} [{r['us_min']:.0f}-{r['us_max']:.0f}]"
    return f"{text:>{width}}"


def speed_ratio(slow: float | None, fast: float | None, width: int = 8) -> str:
    """slow / fast (times): > 1 means the second is faster."""
    return f"{slow / fast:{width}.2f}" if slow and fast else f"{'-':>{width}}"


def rate(amount: float, t_us: float | None, unit: float, width: int = 7) -> str:
    return f"{amount / (t_us * 1e-6) / unit:{width}.2f}" if t_us else f"{'-':>{width}}"


def print_notes(notes):
    for note in notes:
        print(f"{'':>6}^ {note}", flush=True)


# --------------------------------------------------------------------------------------------------
# the workloads
# --------------------------------------------------------------------------------------------------


def mixed(sz: Sizes, impl, fa4: FlashAttention4) -> list[dict]:
    nc, nd = sz.n_chunks, sz.n_decodes
    chunk_lens = spread(*sz.chunk_context, nc) + sz.chunk  # keys: context + the chunk itself
    decode_lens = spread(*sz.decode_keys, nd)  # keys, the new token included
    lens = np.concatenate([chunk_lens, decode_lens]).astype(np.int32)
    cu = offsets([sz.chunk] * nc + [1] * nd)
    q = normal(1, (int(cu[-1]), H_Q, D))
    q_np = np.asarray(q).astype(np.float32)
    k_tok, v_tok = token_pool(2, lens, max(sz.page_sizes))
    label = f"mixed {nc}x{sz.chunk}+{nd}x1"
    print(f"\n[1] mixed step: {nc} prefill chunks of {sz.chunk} on {sz.chunk_context[0]}-{sz.chunk_context[1]} "
          f"tokens of context + {nd} decodes on {sz.decode_keys[0]}-{sz.decode_keys[1]} keys "
          f"({int(cu[-1])} queries, {int(lens.sum())} keys), pool {k_tok.shape[0]} tokens")
    print("    one call = ragged attention_with_kvcache; two calls = (nc, chunk) + (nd, 1) non-ragged calls; "
          "us per call, median [min-max] of rounds")
    head = f"{'workload':<22} {'page':>5} | {'ours one call (us)':>24} {'ours two calls (us)':>24} {'2/1':>6}"
    if fa4.fn is not None:  # without FlashAttention-4 its columns are left out
        head += f" | {'FA4 (us)':>24} {'ours/FA4':>8}"
    print(head + "\n" + "-" * len(head), flush=True)
    rows = []
    for ps in sz.page_sizes:
        paged = paginate(k_tok, v_tok, lens, ps, seed=100 + ps)
        table = jnp.asarray(paged.table)
        ref = reference(q_np, cu, lens, checked(nc, 3) + [nc + i for i in checked(nd, 5)], paged)
        chunk_width = -(-int(chunk_lens.max()) // ps)  # the chunk rows need fewer table columns
        comps = [
            ours("ours one call", functools.partial(ragged_step, max_seqlen_q=sz.chunk, impl=impl), q,
                 (paged.k, paged.v, jnp.asarray(lens), jnp.asarray(cu), table), sz),
            ours("ours two calls", functools.partial(two_call_step, impl=impl),
                 (q[:nc * sz.chunk].reshape(nc, sz.chunk, H_Q, D), q[nc * sz.chunk:].reshape(nd, 1, H_Q, D)),
                 (paged.k, paged.v, jnp.asarray(lens[:nc]), jnp.asarray(lens[nc:]),
                  table[:nc, :chunk_width], table[nc:]), sz),
        ]
        if fa4.fn is not None:
            try:
                comps.append(fa4.competitor(sz, q, paged.k, paged.v, cu, lens, sz.chunk, paged.table))
            except Exception as e:  # noqa: BLE001 - e.g. out of GPU memory for the copies
                comps.append(Competitor("FA4", once=functools.partial(_raise, e), measure=None))
        notes = []
        res = run_row(comps, ref, sz, notes)
        one, two, fa = (res.get(n) for n in ("ours one call", "ours two calls", "FA4"))
        line = f"{label:<22} {ps:>5} | {cell(one)} {cell(two)} {speed_ratio(us(two), us(one), 6)}"
        if fa4.fn is not None:
            line += f" | {cell(fa)} {speed_ratio(us(fa), us(one))}"
        print(line, flush=True)
        print_notes(notes)
        rows.append(dict(workload="mixed", page_size=ps, ours_one_call=one, ours_two_calls=two, fa4=fa, notes=notes))
        del comps, paged, table
        fa4.release()
    print("    2/1 = two-call time / one-call time (> 1: one call is faster)"
          + ("; ours/FA4 = FA4 time / our one-call time (> 1: ours faster)" if fa4.fn is not None else ""))
    return rows


def _raise(err):
    raise err


def decode(sz: Sizes, impl, fa4: FlashAttention4) -> list[dict]:
    b = sz.decode_batch
    lens = spread(*sz.decode_keys, b).astype(np.int32)
    cu = offsets([1] * b)
    q = normal(11, (b, H_Q, D))
    q_np = np.asarray(q).astype(np.float32)
    kv_bytes = 2 * int(lens.sum()) * H_KV * D * 2
    k_tok, v_tok = token_pool(12, lens, max(sz.page_sizes))
    print(f"\n[2] decode: {b} sequences x 1 query, {sz.decode_keys[0]}-{sz.decode_keys[1]} keys "
          f"({int(lens.sum())} keys, {kv_bytes / 1e9:.2f} GB of K and V per call)")
    print("    ragged = cu_seqlens_q = arange(b + 1), q (b, 32, 128); plain = q (b, 1, 32, 128); "
          "TB/s = K+V bytes / time")
    head = f"{'workload':<22} {'page':>5} | {'ours ragged (us)':>24} {'TB/s':>7} {'ours plain (us)':>24} {'TB/s':>7}"
    if fa4.fn is not None:
        head += f" | {'FA4 (us)':>24} {'TB/s':>7} {'ours/FA4':>8}"
    print(head + "\n" + "-" * len(head), flush=True)
    seqs = checked(b, 5)
    rows = []
    for ps in (*sz.page_sizes, "contiguous"):
        if ps == "contiguous":
            cap = sz.contiguous_capacity
            assert lens.max() <= cap
            cache = (normal(13, (b, cap, H_KV, D)), normal(14, (b, cap, H_KV, D)))
            k, v, table, np_table = *cache, None, None
        else:
            cache = paginate(k_tok, v_tok, lens, ps, seed=200 + ps)
            k, v, np_table = cache.k, cache.v, cache.table
            table = jnp.asarray(np_table)
        ref = reference(q_np, cu, lens, seqs, cache)
        comps = [
            ours("ours ragged", functools.partial(ragged_step, max_seqlen_q=1, impl=impl), q,
                 (k, v, jnp.asarray(lens), jnp.asarray(cu), table), sz),
            ours("ours plain", functools.partial(kvcache_step, impl=impl), q.reshape(b, 1, H_Q, D),
                 (k, v, jnp.asarray(lens), table), sz),
        ]
        if fa4.fn is not None:
            try:
                comps.append(fa4.competitor(sz, q, k, v, cu, lens, 1, np_table))
            except Exception as e:  # noqa: BLE001
                comps.append(Competitor("FA4", once=functools.partial(_raise, e), measure=None))
        notes = []
        res = run_row(comps, ref, sz, notes)
        rag, plain, fa = (res.get(n) for n in ("ours ragged", "ours plain", "FA4"))
        line = (f"{f'decode {b}x1':<22} {ps if ps != 'contiguous' else 'cont':>5} | "
                f"{cell(rag)} {rate(kv_bytes, us(rag), 1e12)} {cell(plain)} {rate(kv_bytes, us(plain), 1e12)}")
        if fa4.fn is not None:
            line += f" | {cell(fa)} {rate(kv_bytes, us(fa), 1e12)} {speed_ratio(us(fa), us(rag))}"
        print(line, flush=True)
        print_notes(notes)
        rows.append(dict(workload="decode", page_size=ps, kv_bytes=kv_bytes, ours_ragged=rag, ours_plain=plain,
                         fa4=fa, notes=notes))
        del comps, cache, k, v, table
        fa4.release()
    if fa4.fn is not None:
        print("    ours/FA4 = FA4 time / our ragged time (> 1: ours faster)")
    return rows


def chunked_prefill(sz: Sizes, impl) -> list[dict]:
    n, c = sz.n_chunks, sz.chunk
    lens = (spread(*sz.chunk_context, n) + c).astype(np.int32)
    cu = offsets([c] * n)
    q = normal(21, (n * c, H_Q, D))
    q_np = np.asarray(q).astype(np.float32)
    # Visible (query, key) pairs: chunk row i of a sequence with L keys sees L - c + i + 1 of them.
    flops = 4 * H_Q * D * sum(c * (int(L) - c) + c * (c + 1) // 2 for L in lens)
    k_tok, v_tok = token_pool(22, lens, sz.prefill_page)
    paged = paginate(k_tok, v_tok, lens, sz.prefill_page, seed=300)
    print(f"\n[3] chunked prefill: {n} chunks of {c} on {sz.chunk_context[0]}-{sz.chunk_context[1]} tokens of "
          f"context, page {sz.prefill_page} ({flops / 1e9:.1f} GFLOP of visible pairs per call)")
    print(f"    ours = one ragged paged call; dense = fa4_jax.attention, one (1, {c}) x (1, L) call per sequence "
          "on the same keys (contiguous copies), all in one program")
    head = (f"{'workload':<22} {'page':>5} | {'ours ragged (us)':>24} {'TFLOP/s':>7} | {'dense per seq (us)':>24} "
            f"{'TFLOP/s':>7} | {'ours/dense':>10}")
    print(head + "\n" + "-" * len(head), flush=True)
    ref = reference(q_np, cu, lens, checked(n, 3), paged)
    dense_kv = [sequence_kv_device(paged, i, int(lens[i])) for i in range(n)]
    comps = [
        ours("ours ragged", functools.partial(ragged_step, max_seqlen_q=c, impl=impl), q,
             (paged.k, paged.v, jnp.asarray(lens), jnp.asarray(cu), jnp.asarray(paged.table)), sz),
        ours("dense per sequence", functools.partial(dense_step, impl=impl),
             tuple(q[i * c:(i + 1) * c][None] for i in range(n)),
             (tuple(kv[0] for kv in dense_kv), tuple(kv[1] for kv in dense_kv)), sz),
    ]
    notes = []
    res = run_row(comps, ref, sz, notes)
    rag, dense = res.get("ours ragged"), res.get("dense per sequence")
    print(f"{f'prefill {n}x{c}':<22} {sz.prefill_page:>5} | {cell(rag)} {rate(flops, us(rag), 1e12)} | "
          f"{cell(dense)} {rate(flops, us(dense), 1e12)} | {speed_ratio(us(dense), us(rag), 10)}", flush=True)
    print_notes(notes)
    print("    ours/dense = dense time / ours (> 1: the ragged paged call is faster)")
    return [dict(workload="chunked_prefill", page_size=sz.prefill_page, flops=flops, ours_ragged=rag,
                 dense_per_sequence=dense, notes=notes)]


def sequence_kv_device(paged: Paged, b: int, length: int):
    """Sequence b's keys and values as a contiguous (1, L, H_KV, D) device copy (the dense kernel's input)."""
    ids = jnp.asarray(paged.table[b, :-(-length // paged.page_size)])
    return tuple(jnp.take(x, ids, axis=0).reshape(-1, H_KV, D)[:length][None] for x in (paged.k, paged.v))


# --------------------------------------------------------------------------------------------------


WORKLOADS = ("mixed", "decode", "prefill")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes (2 chunks of 64 on 256-1k context + 6 decodes, pages 1 and 16, 1 round); "
                        "runs on CPU through the XLA reference")
    p.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, help="interleaved repeats per row (default 5, --quick 1)")
    p.add_argument("--loop", type=int, help="dependent calls per timed program (default 20, --quick 2)")
    args = p.parse_args(argv)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workload_list) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    for name in ("rounds", "loop"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, why = kernel_device("kvcache")
    quick = args.quick or device is None
    sz = QUICK if quick else FULL
    sz = dataclasses.replace(sz, rounds=args.rounds or sz.rounds, loop=args.loop or sz.loop)
    served = kvcache_page_sizes(device, sz.page_sizes) if device is not None else sz.page_sizes
    # "fa4": the kernels or an error, never a silent fallback timed as the kernel. Without a Hopper
    # GPU, None: the platform's choice (the XLA reference on CPU).
    impl = "fa4" if device is not None else None
    header = header_lines(device)
    print("\n".join(header))
    if device is None:
        backend = jax.default_backend()
        print(f"NOTE: no fa4_jax KV-cache kernels here ({why}): the --quick sizes run with implementation=None on "
              f"{backend.upper()}{' (the XLA reference)' if backend == 'cpu' else ''}; the timings below are "
              "CPU/reference numbers, not kernel numbers" + ("" if args.quick else " (--quick implied)"))
    if served != sz.page_sizes:
        print(f"NOTE: the KV-cache kernels for {device.device_kind} have no page size "
              f"{', '.join(str(p) for p in sz.page_sizes if p not in served)} (pieces of 16 rows only, so far): "
              "those rows are left out")
        sz = dataclasses.replace(sz, page_sizes=served)
    fa4 = FlashAttention4(device)
    print(fa4.line())
    print(f"setting: bf16, heads {H_Q}/{H_KV}, head_dim {D}, causal, shuffled page pools ({POOL_SLACK:g}x the pages "
          f"in use); implementation={impl!r}; {sz.loop} dependent calls per timed program (unrolled fori_loop), "
          f"{sz.rounds} interleaved round(s)", flush=True)
    t0 = time.perf_counter()
    results = {}
    if "mixed" in args.workload_list:
        results["mixed"] = mixed(sz, impl, fa4)
        gc.collect()
    if "decode" in args.workload_list:
        results["decode"] = decode(sz, impl, fa4)
        gc.collect()
    if "prefill" in args.workload_list:
        results["chunked_prefill"] = chunked_prefill(sz, impl)
    elapsed = time.perf_counter() - t0
    print(f"\ndone in {elapsed:.0f} s" + ("  (CPU/reference timings: not kernel numbers)" if device is None else ""))
    if args.json:
        meta = dict(header=header, device=device.device_kind if device else jax.default_backend(),
                    implementation=impl, quick=quick, sizes=dataclasses.asdict(sz), fa4=fa4.line(),
                    date=datetime.datetime.now().astimezone().isoformat(), elapsed_s=elapsed)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, **results), f, indent=1, default=str)
        print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
