#!/usr/bin/env python3
"""Is fp16 prefill slower than bf16 because of the data, not the code? (issue 18: "fp16 within 3% of
bf16").

The sm90 fp16 and bf16 dense kernels compile to the same SASS but for the wgmma's input type (same
instruction counts per opcode, docs/PERF.md 2026-12-06 thirteenth session), yet earlier tables had
fp16 3-5% slower. A tensor core multiplying 11-bit significands toggles more bits than one
multiplying 8-bit ones, so with random data fp16 may draw more power and run at a lower SM clock.
This times the same kernel on three inputs of the same logical problem, alternated over rounds:

  bf16           N(0, 1) in bfloat16 (benchmark.py's inputs);
  fp16           N(0, 1) in float16;
  fp16 (bf16 values)  the bf16 inputs' values in float16: fp16 arithmetic, 8 significant bits.

If fp16 (bf16 values) runs at bf16's speed and plain fp16 does not, the gap is the data's. The SM
clock is sampled by nvidia-smi in the background and printed per input kind.

    python3 tools/dtype_probe.py [--hd 128] [--seqlen 16384] [--causal 0] [--rounds 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from benchmark import attention_flops, make_inputs, time_per_call  # noqa: E402

import fa4_jax  # noqa: E402


class ClockSampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 50 ms, stamped with the wall clock, read back per
    time window (time.time() values)."""

    def __init__(self):
        query = "--query-gpu=timestamp,clocks.sm,power.draw"
        try:
            self.proc = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "50"],
                                         stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
        self.samples: list[tuple[float, float, float]] = []

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate()
        for line in out.splitlines():
            try:
                stamp, clk, pwr = (v.strip() for v in line.split(","))
                t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((t, float(clk), float(pwr)))
            except ValueError:
                continue

    def window(self, a: float, b: float):
        sel = [(c, p) for t, c, p in self.samples if a <= t <= b]
        if not sel:
            return None
        return statistics.median(c for c, _ in sel), statistics.median(p for _, p in sel)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    d, s, causal = args.hd, args.seqlen, bool(args.causal)
    h = 2048 // d
    b = max(1, 16384 // s)
    fn = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, implementation="fa4"))
    bf = make_inputs(0, b, s, h, d, jnp.bfloat16)
    kinds = {
        "bf16": bf,
        "fp16": make_inputs(0, b, s, h, d, jnp.float16),
        "fp16 (bf16 values)": tuple(x.astype(jnp.float16) for x in bf),
    }
    flops = attention_flops(b, h, s, d, causal)
    sampler = ClockSampler()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    windows: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for name, xs in kinds.items():
            a = time.time()
            times[name].append(time_per_call(fn, [xs], batches=5, target_batch_s=0.2))
            windows[name].append((a, time.time()))
    sampler.stop()
    print(f"{jax.devices()[0].device_kind}: hd{d} s{s} b{b} h{h} {'causal' if causal else 'full'}, "
          f"{args.rounds} alternated rounds (TFLOP/s per round; SM clock MHz / power W, medians)")
    base = min(times["bf16"])
    for name in kinds:
        clocks = [w for w in (sampler.window(*x) for x in windows[name]) if w]
        clk = f"{statistics.median(c for c, _ in clocks):6.0f} MHz {statistics.median(p for _, p in clocks):5.0f} W" \
            if clocks else "   (no clock samples)"
        tf = [flops / t / 1e12 for t in times[name]]
        print(f"  {name:20s} best {max(tf):6.1f} TFLOP/s  time / bf16's {min(times[name]) / base:6.3f}  {clk}  "
              f"rounds {' '.join(f'{x:.0f}' for x in tf)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
