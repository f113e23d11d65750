#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples: the totals per
stall reason, the same within SASS address ranges (a loop of `tools/sass_loops.py`), and the
instructions with the most samples -- for one profile, or two side by side (how the paged chunk
kernel's extra waits were found at the ping-pong turn, docs/PERF.md 2026-12-06, tenth session).

On the GPU host (ncu there; a scratch script that makes a few calls of the kernel):

    ncu --clock-control none -k regex:FlashAttention --launch-skip 3 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o prof -f python3 script.py
    ncu --import prof.ncu-rep --page source --print-source sass --csv > prof.csv

Here (plain Python, no CUDA):

    python tools/ncu_stalls.py prof.csv                       # totals and the top instructions
    python tools/ncu_stalls.py a.csv b.csv --range 0xb0f0-0xcfb0 --range 0xe660-0x104f0
                                                              # two profiles; a range per profile,
                                                              # in order (offsets from the kernel's start)
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys
from dataclasses import dataclass

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass(frozen=True)
class Instruction:
    offset: int  # bytes from the kernel's first instruction
    source: str  # the SASS text
    samples: int  # all warp-stall samples at this instruction
    executed: int  # warp-level instructions executed
    stalls: dict  # stall reason (without the "stall_" prefix) -> samples


def load(path: str) -> list[Instruction]:
    """The instructions of ncu's `--page source --print-source sass --csv` output: a line naming the
    kernel, a header, then one row per instruction (absolute addresses, made relative here)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[header_at]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out, base = [], None
    for r in rows[header_at + 1:]:
        if not r or not r[0].startswith("0x"):
            continue
        d = dict(zip(header, r))
        addr = int(d["Address"], 16)
        base = addr if base is None else base
        out.append(Instruction(addr - base, d["Source"].strip(), _int(d.get(SAMPLES)), _int(d.get(EXECUTED)),
                               {h[len("stall_"):]: _int(d[h]) for h in reasons}))
    return out


def _int(x) -> int:
    return int(x) if x not in (None, "", "-") else 0


def totals(instrs) -> collections.Counter:
    """Samples per stall reason over `instrs`."""
    t = collections.Counter()
    for ins in instrs:
        t.update(ins.stalls)
    return t


def within(instrs, lo: int, hi: int) -> list[Instruction]:
    return [i for i in instrs if lo <= i.offset <= hi]


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = text.split("-")
    return int(lo, 16), int(hi, 16)


def report(names, profiles, top: int) -> str:
    lines = []
    sums = [totals(p) for p in profiles]
    reasons = sorted(set().union(*sums), key=lambda r: -sum(s[r] for s in sums))
    lines.append(f"{'stall reason':<18}" + "".join(f"{n[-22:]:>24}" for n in names))
    for r in reasons[:12]:
        cells = []
        for s in sums:
            whole = sum(s.values()) or 1
            cells.append(f"{s[r]:>14d} {100 * s[r] / whole:5.1f}%  ")
        lines.append(f"{r:<18}" + "".join(cells))
    lines.append(f"{'all':<18}" + "".join(f"{sum(s.values()):>14d}         " for s in sums))
    for n, p in zip(names, profiles):
        lines.append(f"\ntop {top} instructions of {n} (offset, samples, executed, the two largest reasons):")
        for ins in sorted(p, key=lambda i: -i.samples)[:top]:
            two = sorted(ins.stalls.items(), key=lambda kv: -kv[1])[:2]
            lines.append(f"  {ins.offset:#07x} {ins.samples:7d} {ins.executed:10d}  {ins.source[:56]:<56} "
                         + ", ".join(f"{k} {v}" for k, v in two))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", help="ncu source-page CSV files")
    parser.add_argument("--range", action="append", default=[],
                        help="hex offsets lo-hi: only these instructions (one per profile, in order, or one for all)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    profiles = [load(p) for p in args.profiles]
    if args.range:
        ranges = [parse_range(r) for r in args.range]
        if len(ranges) == 1:
            ranges *= len(profiles)
        if len(ranges) != len(profiles):
            parser.error("give one --range for all profiles or one per profile")
        profiles = [within(p, lo, hi) for p, (lo, hi) in zip(profiles, ranges)]
    print(report([os.path.basename(p) for p in args.profiles], profiles, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
