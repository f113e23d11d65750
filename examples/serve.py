#!/usr/bin/env python3
"""A small continuous-batching inference engine (vLLM/SGLang style) on fa4_jax's ragged KV-cache API.

    python examples/serve.py --tiny                     # CPU, under a minute: 8 requests, page size 5
    python examples/serve.py --tiny --page-size 1 --poison
    python examples/serve.py                            # GPU: a 300M-parameter model, 64 requests

What it is:
- a Llama-style decoder (RMSNorm -> GQA attention with RoPE -> RMSNorm -> SwiGLU, tied embeddings;
  the architecture of examples/generate.py), random weights from a fixed seed, written as plain
  functions of packed tokens (total_tokens, d_model): a continuous-batching step has no batch axis;
- a paged KV cache per layer: pools (num_pages, page_size, heads_kv, head_dim), a page allocator
  with a LIFO free list (a freed page is the next one handed out, so recycled pages are exercised at
  once), page 0 reserved as the null page that unused page-table entries point at, a fixed number of
  slots (max concurrent requests) with one page-table row each;
- a scheduler: requests arrive over time with prompts of mixed lengths and their own
  max_new_tokens; each step builds ONE ragged batch of at most --token-budget tokens: one decode
  token for every running request (decodes first: they never wait behind a prefill), then prefill
  chunks of up to --chunk tokens of the requests still reading their prompt (chunked prefill);
- one jitted step with fixed shapes (tokens padded to the budget, sequences to the slot count; the
  caches donated, so the KV writes are in place): per layer one `fa4_jax.update_kvcache` and one
  `fa4_jax.attention_with_kvcache` over the whole ragged batch, then greedy sampling at each
  sequence's last token;
- a baseline mode, the same engine and the same batches, with prefill and decode attention as two
  calls per layer (the prefill chunks as one ragged call, the decodes as a batched decode call);
- a check: every request's tokens are those of the same model run without any cache (dense causal
  attention over the request's whole sequence, in plain jnp), and, with --poison, freed pages and the
  null page are filled with NaN, so a recycled page leaking into a new request would show.

Prints throughput, time to first token and inter-token latency percentiles for both modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax



@dataclasses.dataclass(frozen=True)
class Config:
    # model
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    # engine
    slots: int              # max concurrent requests (rows of the page table)
    page_size: int
    chunk: int              # max prefill tokens per request per step
    token_budget: int       # tokens per step (the padded, compiled size)
    num_pages: int | None   # pool size incl. the null page; None: enough for every slot's longest request
    # workload
    requests: int
    prompt_len: tuple[int, int]      # inclusive range
    max_new: tuple[int, int]         # each request's max_new_tokens, inclusive range
    arrival_gap: float               # mean steps between arrivals (exponential); 0: all at step 0
    rope_theta: float = 10000.0

    @property
    def max_pages(self) -> int:
        """Page-table width: the longest request's cache (its last token is sampled, never fed)."""
        return -(-(self.prompt_len[1] + self.max_new[1] - 1) // self.page_size)


CONFIGS = {
    # CPU, seconds: 2 layers, d_model 128, 8/2 heads of 64; 8 requests through 4 slots so that later
    # requests run on pages the earlier ones freed.
    "tiny": Config(vocab=512, dim=128, layers=2, heads=8, kv_heads=2, head_dim=64, ffn=256, slots=4, page_size=5,
                   chunk=32, token_budget=0, num_pages=None, requests=8, prompt_len=(5, 70), max_new=(12, 12),
                   arrival_gap=1.0),
    # GPU: ~300M parameters (8 layers, d_model 1024, 8/2 heads of 128, 32k vocab), 64 requests, 16 slots.
    "gpu": Config(vocab=32000, dim=1024, layers=8, heads=8, kv_heads=2, head_dim=128, ffn=4096, slots=16, page_size=16,
                  chunk=512, token_budget=0, num_pages=None, requests=64, prompt_len=(16, 1536), max_new=(32, 128),
                  arrival_gap=2.0),
}


# ----------------------------------------------------------------------------------------------
# The model: plain functions of packed tokens. `forward` takes the attention as a callback, so the
# engine (paged cache, ragged fa4_jax calls) and the reference (no cache, dense causal attention)
# run literally the same projections, norms and MLP.
# ----------------------------------------------------------------------------------------------

def init_params(c: Config, dtype, seed: int):
    """Random weights, initialised like flax's defaults in generate.py: fan-in-scaled normal
    matrices, unit RMSNorm scales, a tied embedding of std 1/sqrt(d_model) (logits of O(1))."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 7 * c.layers))

    def dense(n_in, n_out):
        return (jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / math.sqrt(n_in)).astype(dtype)

    q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim
    layers = [dict(attn_norm=jnp.ones((c.dim,), dtype), wq=dense(c.dim, q_dim), wk=dense(c.dim, kv_dim),
                   wv=dense(c.dim, kv_dim), wo=dense(q_dim, c.dim), mlp_norm=jnp.ones((c.dim,), dtype),
                   w_gate=dense(c.dim, c.ffn), w_up=dense(c.dim, c.ffn), w_down=dense(c.ffn, c.dim))
              for _ in range(c.layers)]
    embed = (jax.random.normal(next(keys), (c.vocab, c.dim), jnp.float32) / math.sqrt(c.dim)).astype(dtype)
    return dict(embed=embed, layers=layers, final_norm=jnp.ones((c.dim,), dtype))


def rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype) * scale


def rope(x, positions, theta):
    """Rotate-half rotary embedding (fa4_jax.flax.rotary_embedding's convention) of x (tokens, heads,
    d) at absolute positions (tokens,)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None, None] * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def forward(c: Config, params, tokens, positions, attention):
    """tokens, positions (T,) -> hidden states (T, d_model). attention(layer, q, k, v) -> o gets
    q (T, heads, d), k/v (T, kv_heads, d) in the compute dtype and returns o like q."""
    x = params["embed"][tokens]
    t = tokens.shape[0]
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])
        q = rope((h @ p["wq"]).reshape(t, c.heads, c.head_dim), positions, c.rope_theta)
        k = rope((h @ p["wk"]).reshape(t, c.kv_heads, c.head_dim), positions, c.rope_theta)
        v = (h @ p["wv"]).reshape(t, c.kv_heads, c.head_dim)
        x = x + attention(i, q, k, v).reshape(t, -1) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"])
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    return x


def logits_of(params, x):
    return (rms_norm(x, params["final_norm"]) @ params["embed"].T).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# The engine's jitted step
# ----------------------------------------------------------------------------------------------

def make_step(c: Config, kv_dtype, mode: str, implementation):
    """The jitted step of `mode` ("mixed": one ragged attention call per layer; "baseline": a ragged
    prefill call and a decode call per layer). step(params, pools, batch) -> (next_token (S,),
    all_finite, pools); pools is donated, so update_kvcache writes the caches in place."""
    max_q = min(c.chunk, c.token_budget)  # no sequence has more queries in a step (the kernel's grid bound)
    attn_kw = dict(causal=True, implementation=implementation)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, pools, batch):
        cu, before, pt = batch["cu"], batch["cache_before"], batch["page_table"]
        after = before + (cu[1:] - cu[:-1])  # valid keys per sequence once this step's tokens are written
        new_pools = list(pools)

        def attention(layer, q, k, v):
            k_pool, v_pool = new_pools[layer]
            # The cache holds bf16 (the kernels' dtype) whatever the model computes in.
            k_pool, v_pool = fa4_jax.update_kvcache(k_pool, v_pool, k.astype(kv_dtype), v.astype(kv_dtype), before,
                                                    cu_seqlens_new=cu, page_table=pt)
            new_pools[layer] = (k_pool, v_pool)
            q = q.astype(kv_dtype)
            if mode == "mixed":
                o = fa4_jax.attention_with_kvcache(q, k_pool, v_pool, after, cu_seqlens_q=cu, max_seqlen_q=max_q,
                                                   page_table=pt, **attn_kw)
            else:
                # Prefill sequences come first in the batch (the host orders them so), so clipping the
                # offsets at the end of the prefill rows leaves the decode sequences empty and their
                # rows past cu_prefill[-1], in no sequence (o = 0 there).
                o = fa4_jax.attention_with_kvcache(q, k_pool, v_pool, after, cu_seqlens_q=batch["cu_prefill"],
                                                   max_seqlen_q=max_q, page_table=pt, **attn_kw)
                # Decodes: one query per sequence (its first row), a decoding sequence keeping its
                # length and every other one 0 keys (o = 0, dropped below).
                is_dec = batch["is_decode"]
                q_dec = q[cu[:-1]]
                lens_dec = jnp.where(is_dec, after, 0)
                # The split-KV paged decode call, reading pages in place.
                o_dec = fa4_jax.attention_with_kvcache(q_dec[:, None], k_pool, v_pool, lens_dec, page_table=pt,
                                                       **attn_kw)[:, 0]
                rows = jnp.where(is_dec, cu[:-1], q.shape[0])  # out of range: dropped
                o = o.at[rows].set(o_dec, mode="drop")
            return o.astype(k.dtype)

        x = forward(c, params, batch["tokens"], batch["positions"], attention)
        # Logits only at each sequence's last row of this step (vLLM's logits_indices): (S, vocab).
        logits = logits_of(params, x[batch["sample_rows"]])
        live = cu[1:] > cu[:-1]
        all_finite = jnp.all(jnp.isfinite(logits) | ~live[:, None])
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), all_finite, tuple(new_pools)

    return step


@functools.partial(jax.jit, donate_argnums=(0,))
def poison_pages(pools, page_ids):
    """NaN into the pages page_ids (padded with an out-of-range id: dropped) of every layer's pools."""
    nan = lambda p: p.at[page_ids].set(jnp.nan, mode="drop")  # noqa: E731
    return tuple((nan(k), nan(v)) for k, v in pools)


# ----------------------------------------------------------------------------------------------
# Requests, pages, scheduler
# ----------------------------------------------------------------------------------------------

class NonFiniteLogits(RuntimeError):
    pass


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    arrival_step: int
    out: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0             # tokens already in the cache
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    t_arrival: float = 0.0
    t_tokens: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def worst_tokens(self) -> int:
        """The most tokens its cache ever holds (the last generated token is never fed back)."""
        return len(self.prompt) + self.max_new - 1


def make_requests(c: Config, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(c.arrival_gap, c.requests) if c.arrival_gap > 0 else np.zeros(c.requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    out = []
    for i in range(c.requests):
        n = int(rng.integers(c.prompt_len[0], c.prompt_len[1] + 1))
        out.append(dict(rid=i, prompt=rng.integers(0, c.vocab, n).tolist(),
                        max_new=int(rng.integers(c.max_new[0], c.max_new[1] + 1)), arrival_step=int(arrivals[i])))
    return out


class PageAllocator:
    """A LIFO free list over pages 1..num_pages-1 (page 0 is the null page). `reused` counts pages
    handed out that an earlier request had held."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, 0, -1))  # pop() hands out page 1 first
        self.ever_freed: set[int] = set()
        self.reused = 0

    def alloc(self, n: int) -> list[int]:
        assert n <= len(self.free), "admission control keeps every request's worst case available"
        pages = [self.free.pop() for _ in range(n)]
        self.reused += sum(p in self.ever_freed for p in pages)
        return pages

    def release(self, pages: list[int]) -> None:
        self.ever_freed.update(pages)
        self.free.extend(reversed(pages))


class Engine:
    """Slots, pages and the step loop of one mode. run(specs) serves every request to completion and
    returns the outputs and the timings."""

    def __init__(self, c: Config, params, compute_dtype, kv_dtype, mode: str, implementation, poison: bool):
        self.c, self.params, self.mode, self.poison = c, params, mode, poison
        self.num_pages = c.num_pages or 1 + c.slots * c.max_pages
        pool_shape = (self.num_pages, c.page_size, c.kv_heads, c.head_dim)
        self.pools = tuple((jnp.zeros(pool_shape, kv_dtype), jnp.zeros(pool_shape, kv_dtype)) for _ in range(c.layers))
        self.step_fn = make_step(c, kv_dtype, mode, implementation)
        self.alloc = PageAllocator(self.num_pages)
        self.page_table = np.zeros((c.slots, c.max_pages), np.int32)  # 0: the null page
        self.free_slots = list(range(c.slots - 1, -1, -1))
        if poison:  # the null page too: unused page-table entries point at it
            self._poison([0])

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.c.page_size)

    def warm_up(self):
        """Compiles the step on an empty batch (every sequence empty: nothing written or read)."""
        s, t = self.c.slots, self.c.token_budget
        batch = dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), cu=np.zeros(s + 1, np.int32),
                     cache_before=np.zeros(s, np.int32), page_table=np.zeros_like(self.page_table),
                     sample_rows=np.zeros(s, np.int32), cu_prefill=np.zeros(s + 1, np.int32),
                     is_decode=np.zeros(s, bool))
        *_, self.pools = self.step_fn(self.params, self.pools, batch)
        jax.block_until_ready(self.pools)

    def _poison(self, pages: list[int]):
        # One compiled shape: the ids padded to the page-table width with an out-of-range id (dropped).
        ids = np.full(self.c.max_pages, self.num_pages, np.int32)
        ids[:len(pages)] = pages
        self.pools = jax.block_until_ready(poison_pages(self.pools, ids))

    def _release(self, r: Request):
        if self.poison:  # what the next owner of these pages finds past its own tokens: NaN
            self._poison(r.pages)
        self.alloc.release(r.pages)
        self.page_table[r.slot] = 0
        self.free_slots.append(r.slot)
        r.pages, r.slot = [], -1

    def run(self, specs: list[dict]) -> dict:
        c = self.c
        pending = deque(Request(**s) for s in sorted(specs, key=lambda s: s["arrival_step"]))
        waiting: deque[Request] = deque()
        running: list[Request] = []
        finished: list[Request] = []
        step_times, batch_tokens = [], []
        step = 0
        t_start = time.perf_counter()
        while pending or waiting or running:
            now = time.perf_counter()
            while pending and pending[0].arrival_step <= step:
                r = pending.popleft()
                r.t_arrival = now
                waiting.append(r)
            # Admission (FCFS): a free slot, and pages for the worst case of every admitted request
            # (prompt + max_new - 1 tokens), so a running request never needs preempting.
            reserved = sum(self._pages_for(r.worst_tokens) - len(r.pages) for r in running)
            while waiting and self.free_slots and (
                    len(self.alloc.free) - reserved >= self._pages_for(waiting[0].worst_tokens)):
                r = waiting.popleft()
                r.slot = self.free_slots.pop()
                reserved += self._pages_for(r.worst_tokens)
                running.append(r)
            if not running:  # idle until the next arrival
                step += 1
                continue

            # This step's work: decodes first (one token each), then prefill chunks in the budget left.
            budget = c.token_budget
            decodes = [r for r in running if r.computed >= len(r.prompt)][:budget]
            budget -= len(decodes)
            prefills = []
            for r in running:
                if r.computed < len(r.prompt) and budget > 0:
                    n = min(c.chunk, len(r.prompt) - r.computed, budget)
                    prefills.append((r, n))
                    budget -= n
            # Prefill sequences first: the baseline's prefill call then owns one contiguous range of rows.
            work = prefills + [(r, 1) for r in decodes]
            batch = self._build_batch(work)

            t0 = time.perf_counter()
            next_tok, finite, self.pools = self.step_fn(self.params, self.pools, batch)
            next_tok = np.asarray(jax.block_until_ready(next_tok))
            t1 = time.perf_counter()
            step_times.append(t1 - t0)
            batch_tokens.append(sum(n for _, n in work))
            if not bool(finite):
                raise NonFiniteLogits(f"step {step}: non-finite logits (a poisoned page leaked into a request?)")

            for b, (r, n) in enumerate(work):
                r.computed += n
                if r.computed == len(r.tokens):  # the whole sequence is cached: its next token is real
                    r.out.append(int(next_tok[b]))
                    r.t_tokens.append(t1)
                    if len(r.out) == r.max_new:
                        running.remove(r)
                        self._release(r)
                        finished.append(r)
            step += 1
        wall = time.perf_counter() - t_start
        return self._metrics(finished, step_times, batch_tokens, wall)

    def _build_batch(self, work) -> dict:
        c = self.c
        s, t = c.slots, c.token_budget
        tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
        cu = np.zeros(s + 1, np.int32)
        before = np.zeros(s, np.int32)
        table = np.zeros((s, c.max_pages), np.int32)
        is_decode = np.zeros(s, bool)
        row = 0
        for b, (r, n) in enumerate(work):
            need = self._pages_for(r.computed + n) - len(r.pages)
            if need > 0:  # pages on demand, as the sequence grows
                new = self.alloc.alloc(need)
                self.page_table[r.slot, len(r.pages):len(r.pages) + need] = new
                r.pages += new
            tokens[row:row + n] = r.tokens[r.computed:r.computed + n]
            positions[row:row + n] = np.arange(r.computed, r.computed + n)
            before[b] = r.computed
            table[b] = self.page_table[r.slot]
            is_decode[b] = r.computed >= len(r.prompt)
            row += n
            cu[b + 1] = row
        cu[len(work) + 1:] = row  # sequences past the work are empty; rows past `row` are padding
        sample_rows = np.maximum(cu[1:] - 1, 0)
        n_prefill_rows = int(cu[int((~is_decode[:len(work)]).sum())])
        return dict(tokens=tokens, positions=positions, cu=cu, cache_before=before, page_table=table,
                    sample_rows=sample_rows, cu_prefill=np.minimum(cu, n_prefill_rows), is_decode=is_decode)

    def _metrics(self, finished, step_times, batch_tokens, wall) -> dict:
        ttft = [r.t_tokens[0] - r.t_arrival for r in finished]
        itl = [b - a for r in finished for a, b in zip(r.t_tokens, r.t_tokens[1:])]
        pct = lambda x: {f"p{q}": float(np.percentile(x, q)) * 1e3 for q in (50, 90, 99)} if x else {}  # noqa: E731
        generated = sum(len(r.out) for r in finished)
        return dict(
            outputs={r.rid: r.out for r in finished}, steps=len(step_times), wall_s=wall,
            step_s=float(np.sum(step_times)), generated_tokens=generated,
            processed_tokens=int(np.sum(batch_tokens)), output_tokens_per_s=generated / wall,
            processed_tokens_per_s=float(np.sum(batch_tokens)) / wall, mean_batch_tokens=float(np.mean(batch_tokens)),
            ttft_ms=pct(ttft), itl_ms=pct(itl), pages_reused=self.alloc.reused, num_pages=self.num_pages)


# ----------------------------------------------------------------------------------------------
# The reference: no cache, dense causal attention over the whole sequence
# ----------------------------------------------------------------------------------------------

def make_reference(c: Config, kv_dtype, length: int):
    """jitted ref(params, tokens (length,), targets (length,)) -> (argmax, max logit, targets' logit)
    at every position, for one request's sequence right-padded to `length` (causal: the padding after
    a token never reaches it). Attention sees q, k, v rounded to the cache dtype, as the engine's do,
    and computes a float32 softmax (fa4_jax's semantics), in plain jnp."""
    group = c.heads // c.kv_heads

    def dense_attention(layer, q, k, v):
        q32, k32, v32 = (x.astype(kv_dtype).astype(jnp.float32) for x in (q, k, v))
        k32, v32 = jnp.repeat(k32, group, axis=1), jnp.repeat(v32, group, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q32, k32, precision="highest") / math.sqrt(c.head_dim)
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v32, precision="highest")
        return o.astype(kv_dtype).astype(q.dtype)

    @jax.jit
    def ref(params, tokens, targets):
        logits = logits_of(params, forward(c, params, tokens, jnp.arange(length), dense_attention))
        return jnp.argmax(logits, -1), logits.max(-1), jnp.take_along_axis(logits, targets[:, None], -1)[:, 0]

    return ref


def check(c: Config, params, kv_dtype, specs: list[dict], outputs: dict, tie_tol: float) -> dict:
    """Each request's generated tokens against greedy generation by the reference model.

    Teacher-forced, one reference pass per request over prompt + generated tokens: if at every
    position the engine's token is the reference's argmax, the reference's own greedy generation
    produces exactly these tokens (by induction over the positions). A position where they differ by
    less than tie_tol in the reference's logits is a near-tie (rounding can pick either) and the rest
    of that request is still checked, against the engine's choice."""
    length = c.prompt_len[1] + c.max_new[1]
    ref = make_reference(c, kv_dtype, length)
    agree = ties = total = 0
    bad = []
    worst_gap = 0.0
    for s in specs:
        seq = s["prompt"] + outputs[s["rid"]]
        tokens = np.zeros(length, np.int32)
        tokens[:len(seq) - 1] = seq[:-1]
        targets = np.zeros(length, np.int32)
        targets[:len(seq) - 1] = seq[1:]
        am, top, tgt = (np.asarray(x) for x in ref(params, tokens, targets))
        pos = slice(len(s["prompt"]) - 1, len(seq) - 1)  # positions whose next token was generated
        same = am[pos] == targets[pos]
        gap = (top - tgt)[pos]
        agree += int(same.sum())
        total += len(same)
        n_ties = int(((~same) & (gap <= tie_tol)).sum())
        ties += n_ties
        if not same.all():
            worst_gap = max(worst_gap, float(gap.max()))
        if (~same & (gap > tie_tol)).any():
            bad.append(s["rid"])
    return dict(requests=len(specs), requests_ok=len(specs) - len(bad), mismatched_requests=bad, tokens=total,
                tokens_exact=agree, near_ties=ties, worst_gap=worst_gap, tie_tol=tie_tol)


# ----------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the CPU config (default off a GPU)")
    parser.add_argument("--page-size", type=int, help="tokens per KV page (any >= 1)")
    parser.add_argument("--chunk", type=int, help="max prefill tokens per request per step")
    parser.add_argument("--token-budget", type=int, help="tokens per step (default chunk + slots: every "
                        "running request's decode plus one full prefill chunk)")
    parser.add_argument("--slots", type=int, help="max concurrent requests")
    parser.add_argument("--num-pages", type=int, help="pages per pool, the null page included")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--head-dim", type=int, choices=(64, 96, 128, 192, 256))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="model compute dtype (default float32 on CPU, bfloat16 on GPU); the cache is bf16")
    parser.add_argument("--implementation", choices=("auto", "fa4", "xla"), default="auto",
                        help="fa4_jax implementation (auto: kernels on Hopper, the XLA reference elsewhere)")
    parser.add_argument("--poison", action="store_true",
                        help="fill freed pages (and the null page) with NaN: a recycled page must never leak "
                        "(the timings then include those fills)")
    parser.add_argument("--modes", default="mixed,baseline", help="engine modes to run, comma-separated: mixed "
                        "(one ragged attention call per layer), baseline (separate prefill and decode calls)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    c = CONFIGS["tiny" if args.tiny or not on_gpu else "gpu"]
    overrides = {k: v for k, v in dict(page_size=args.page_size, chunk=args.chunk, slots=args.slots,
                                       num_pages=args.num_pages, requests=args.requests,
                                       head_dim=args.head_dim).items() if v is not None}
    c = dataclasses.replace(c, **overrides)
    c = dataclasses.replace(c, token_budget=args.token_budget or c.chunk + c.slots)
    if c.page_size < 1 or c.chunk < 1 or c.slots < 1 or c.token_budget < 1:
        parser.error("page size, chunk, slots and token budget must be >= 1")
    if c.num_pages is not None and c.num_pages - 1 < c.max_pages:
        parser.error(f"--num-pages must leave room for the longest request: >= {c.max_pages + 1}")
    compute_dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    kv_dtype = jnp.bfloat16
    implementation = None if args.implementation == "auto" else args.implementation
    params = init_params(c, compute_dtype, args.seed)
    specs = make_requests(c, args.seed + 1)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"{device.device_kind}: {n_params / 1e6:.1f}M-parameter decoder ({c.layers} layers, d {c.dim}, "
          f"{c.heads}/{c.kv_heads} heads of {c.head_dim}), {compute_dtype.name} compute, bf16 paged KV cache")
    print(f"engine: {c.slots} slots, page size {c.page_size}, chunk {c.chunk}, token budget {c.token_budget}/step; "
          f"{c.requests} requests, prompts {c.prompt_len[0]}-{c.prompt_len[1]} tokens, max_new {c.max_new[0]}-"
          f"{c.max_new[1]}; poison {'on' if args.poison else 'off'}")

    # float32 model: the engine and the reference round the same values to bf16 for attention, but
    # float32 sums in another order (other shapes) can flip one such rounding and nudge the logits,
    # far less than 1e-3 (logits are O(1)); a cache or scheduling bug moves them by O(1). bf16 model
    # (GPU): the kernels and the reference round differently all along, so near-ties happen:
    # agreement is reported, and fails only below 90%.
    exact = compute_dtype == jnp.float32
    tie_tol = 1e-3 if exact else 0.0
    results = dict(config=dataclasses.asdict(c), device=device.device_kind, dtype=compute_dtype.name,
                   poison=args.poison, modes={})
    ok = True
    labels = dict(mixed="prefill chunks + decodes in one ragged attention call per layer",
                  baseline="separate calls per layer: a ragged prefill call + a decode call")
    modes = args.modes.split(",")
    if not modes or set(modes) - set(labels):
        parser.error(f"--modes: comma-separated names from {sorted(labels)}; got {args.modes!r}")
    for mode in modes:
        engine = Engine(c, params, compute_dtype, kv_dtype, mode, implementation, args.poison)
        engine.warm_up()
        try:
            m = engine.run(specs)
        except NonFiniteLogits as e:
            print(f"\n[{mode}] {e}\nMISMATCH")
            return 1
        agreement = check(c, params, kv_dtype, specs, m["outputs"], tie_tol)
        pct = agreement["tokens_exact"] / agreement["tokens"]
        if exact:
            mode_ok = agreement["requests_ok"] == agreement["requests"]
        else:
            mode_ok = pct >= 0.9
        ok &= mode_ok
        print(f"\n[{mode}] {labels.get(mode, mode)}: {m['steps']} steps, {m['wall_s']:.2f} s, "
              f"{m['mean_batch_tokens']:.1f} real tokens/step of {c.token_budget}")
        print(f"  throughput: {m['output_tokens_per_s']:.1f} output tokens/s, "
              f"{m['processed_tokens_per_s']:.1f} processed tokens/s")
        for name, key in (("time to first token", "ttft_ms"), ("inter-token latency", "itl_ms")):
            p = m[key]
            print(f"  {name:20s} p50 {p['p50']:8.2f} ms   p90 {p['p90']:8.2f} ms   p99 {p['p99']:8.2f} ms")
        print(f"  pages reused: {m['pages_reused']} (pool of {m['num_pages']} pages)")
        ties = f", {agreement['near_ties']} near-ties within {tie_tol:g}" if agreement["near_ties"] else ""
        if agreement["tokens_exact"] < agreement["tokens"]:  # how close the differing tokens were
            ties += f", largest reference-logit gap at a differing token {agreement['worst_gap']:.3g}"
        print(f"  agreement: {agreement['requests_ok']}/{agreement['requests']} requests match the reference greedy "
              f"generation ({agreement['tokens_exact']}/{agreement['tokens']} tokens the reference's argmax, "
              f"{pct:.1%}{ties})" + ("" if mode_ok else "  <-- MISMATCH"))
        m["outputs"] = {str(k): v for k, v in m["outputs"].items()}
        results["modes"][mode] = dict(metrics=m, agreement=agreement, ok=mode_ok)

    if len(results["modes"]) == 2:
        a, b = (results["modes"][k]["metrics"] for k in ("mixed", "baseline"))
        print(f"\nmixed vs baseline: throughput {a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x, "
              f"TTFT p50 {b['ttft_ms']['p50'] / a['ttft_ms']['p50']:.2f}x, "
              f"ITL p50 {b['itl_ms']['p50'] / a['itl_ms']['p50']:.2f}x (>1: mixed faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
