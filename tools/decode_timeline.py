#!/usr/bin/env python3
"""What the GPU runs, kernel by kernel, in issue 20's device-time loop: fa4_jax's decode against
cuDNN's, from the CUPTI timeline that `jax.profiler.trace` records (no Nsight tools needed).

    python tools/decode_timeline.py                  # 1 x 8k and 1 x 32k, both implementations
    python tools/decode_timeline.py --rows 1x131072 --splits 16

For each row and implementation it profiles two runs of the jitted loop of 20 dependent calls
(examples/benchmark_decode.looped), takes the last run's kernels on the compute stream and prints,
per kernel name, how many ran, their mean duration and the mean idle gap in front of them, then the
mean time per loop iteration. Unlike Nsight Compute (which serialises and replays kernels), these are
the kernels as they ran back to back, with L2 as warm as the loop leaves it: the sum of a call's
kernels against cuDNN's says whether a gap is in our kernel or between kernels (docs/PERF.md).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import sys
import tempfile
from collections import OrderedDict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.profiler import ProfileData  # noqa: E402  (jax's own reader of the xplane protobuf)

import fa4_jax  # noqa: E402
from benchmark_decode import LOOP, inputs, looped  # noqa: E402


def gpu_kernels(trace_dir) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of every GPU kernel in the jax.profiler.trace written to trace_dir."""
    data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    return sorted((e.start_ns, e.duration_ns, e.name)
                  for plane in data.planes if plane.name.startswith("/device:GPU:")
                  for line in plane.lines if "Stream" in line.name
                  for e in line.events)


def kernels_of_last_run(f, args) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of the GPU kernels of the last of two profiled runs of f."""
    for _ in range(3):
        jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(2):
                jax.block_until_ready(f(*args))
        events = gpu_kernels(d)
    # The two runs are separated by the host's synchronisation: split at the largest gap.
    gaps = [events[i + 1][0] - (events[i][0] + events[i][1]) for i in range(len(events) - 1)]
    cut = max(range(len(gaps)), key=gaps.__getitem__) + 1
    return events[cut:]


def summarize(events) -> tuple[OrderedDict, float]:
    per = OrderedDict()
    prev_end = None
    for start, dur, name in events:
        key = re.sub(r"_\d+$", "", name[:72])  # XLA numbers each copy of a fusion: one row for all
        gap = 0 if prev_end is None else start - prev_end
        per.setdefault(key, ([], []))
        per[key][0].append(dur)
        per[key][1].append(gap)
        prev_end = start + dur
    span = (events[-1][0] + events[-1][1] - events[0][0]) / LOOP
    return per, span


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1x8192,1x32768", help="comma-separated BATCHxKEYS")
    ap.add_argument("--splits", type=int, default=None, help="forced num_splits (default: automatic)")
    args = ap.parse_args()
    for row in args.rows.split(","):
        b, s = (int(x) for x in row.split("x"))
        q, k, v = inputs(0, b, s)
        lens = jnp.full((b,), s, jnp.int32)
        impls = {
            "fa4_jax": looped(lambda q, k, v, n: fa4_jax.attention_with_kvcache(
                q, k, v, n, num_splits=args.splits, implementation="fa4")),
            "cuDNN": looped(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
        }
        for impl, f in impls.items():
            per, span = summarize(kernels_of_last_run(f, (q, k, v, lens)))
            print(f"\n{b} x {s} keys, {impl}: {span / 1e3:.2f} us per loop iteration")
            for name, (durs, gaps) in per.items():
                print(f"  {len(durs):3d} x {statistics.mean(durs) / 1e3:7.2f} us  (gap before "
                      f"{statistics.mean(gaps) / 1e3:5.2f} us)  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
