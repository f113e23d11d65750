#!/usr/bin/env python3
"""Build and run tools/pipe_rates.cu: how many of each non-gemm instruction the kernels use (MUFU
exponentials and tanh, the F2FP conversions of the FP8 widening and of P, the integer and FMA-pipe
alternatives) an SM issues per cycle, alone and in pairs. Levers of issues 17 and 18 turn on these
numbers (docs/PERF.md).

    python3 tools/pipe_rates.py                      # build with nvcc, run, print
    python3 tools/pipe_rates.py --out $OUT 1 2 4 8   # ... and save the table as $OUT/pipe_rates.txt

Builds with $NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc (the GPU machines have one;
a binary built elsewhere may not match their system libraries). CUDA C++ only: no JAX, no library.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tools" / "pipe_rates.cu"
# -gencode, not -arch=sm_90a: with CUDA 13.0 the shorthand also ran a plain sm_90 pass (HOPPER.md).
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def find_nvcc() -> str:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("nvcc not found ($NVCC, PATH, /usr/local/cuda/bin)")


def build(out_dir: Path, cubin: bool = False) -> Path:
    """The benchmark as an executable (or, with cubin, its device code alone) in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / ("pipe_rates.cubin" if cubin else "pipe_rates")
    cmd = [find_nvcc(), "-O3", "-std=c++17", GENCODE, *(["-cubin"] if cubin else []), str(SOURCE), "-o", str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("warps", nargs="*", type=int, help="warps per SM sub-partition to try (default 1 2 4 8)")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "pipe_rates")
    ap.add_argument("--out", type=Path, help="also write the table to OUT/pipe_rates.txt")
    args = ap.parse_args(argv)
    exe = build(args.build_dir)
    proc = subprocess.run([str(exe), *map(str, args.warps)], capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pipe_rates.txt").write_text(proc.stdout + proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
