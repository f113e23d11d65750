#!/usr/bin/env python3
"""Where examples/generate.py's decode step spends its device time, kernel by kernel, for fa4_jax
(paged and contiguous caches) and for the cuDNN model: the CUPTI timeline `jax.profiler.trace`
records of one jitted loop of decode steps (tools/decode_timeline.py's reader), so a gap between the
models' ms/token can be put on the kernel (attention, cache update, the rest) that makes it.

    python tools/model_timeline.py [--steps 16] [--top 12]

Prints, per model, the device time per decode step and the kernels that take it (count per step,
mean duration, share of the step), largest first, then where the GPU sits idle between kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import re  # noqa: E402
import tempfile  # noqa: E402

import generate  # noqa: E402
from decode_timeline import gpu_kernels  # noqa: E402


def kernels(f, args) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of the GPU kernels of one profiled run of f(*args) (after two
    unprofiled ones: compiled, caches warm). args is a callable giving fresh arguments per run: the
    decode loop donates its cache."""
    for _ in range(2):
        jax.block_until_ready(f(*args()))
    fresh = args()
    jax.block_until_ready(fresh)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(f(*fresh))
        return gpu_kernels(d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16, help="decode steps in the profiled loop")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per model")
    args = ap.parse_args()
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("model_timeline.py reads a GPU's kernel timeline: run it on a GPU host")
    c = generate.CONFIGS["1b"]
    models = [("fa4_jax paged", generate.Decoder(c, rngs=nnx.Rngs(0)), True),
              ("fa4_jax contiguous", generate.Decoder(c, rngs=nnx.Rngs(0)), False),
              ("cuDNN contiguous", generate.Decoder(c, generate.CudnnAttention, rngs=nnx.Rngs(0)), False)]
    tokens, lengths = generate.prompts(c, seed=1)
    for name, model, paged in models:
        model.init_cache(c, paged)
        graphdef, cache, rest = generate.split(model)
        last, cache = generate.prefill(graphdef, cache, rest, tokens, lengths)
        token = jnp.argmax(last, -1).astype(jnp.int32)
        # The loop donates its cache: each run gets its own copy of the prefilled one, made (and
        # finished) before the profiled run starts.
        run = lambda cache, token: generate.decode_loop(graphdef, cache, rest, token, args.steps)[0]  # noqa: E731
        events = kernels(run, lambda: (jax.tree.map(jnp.copy, cache), token))
        short = lambda n: re.sub(r"_\d+$", "", n[:60])  # noqa: E731  (one row for a fusion's copies)
        per, idle = {}, {}
        for i, (start, dur, kname) in enumerate(events):
            per.setdefault(short(kname), []).append(dur)
            if i:  # the idle time in front of a kernel, by (previous kernel, kernel)
                prev = events[i - 1]
                key = (short(prev[2]), short(kname))
                idle[key] = idle.get(key, 0) + max(start - prev[0] - prev[1], 0)
        total = sum(d for _, d, _ in events) / args.steps
        span = (events[-1][0] + events[-1][1] - events[0][0]) / args.steps
        print(f"\n{name}: {total / 1e3:.1f} us of kernels per step, {span / 1e3:.1f} us span per step "
              f"({(span - total) / 1e3:.1f} us idle)")
        for kname, durs in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
            print(f"  {len(durs) / args.steps:5.1f} x {statistics.mean(durs) / 1e3:7.2f} us  "
                  f"{sum(durs) / args.steps / total:6.1%}  {kname}")
        print("  idle per step, largest (between two kernels):")
        for (a, b), t in sorted(idle.items(), key=lambda kv: -kv[1])[:4]:
            print(f"    {t / args.steps / 1e3:6.1f} us  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
