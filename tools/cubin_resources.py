#!/usr/bin/env python3
"""Registers and stack frame of every kernel in the AOT-exported objects, read from the cubins
inside them (fa4_jax/aot/cubin.py; no CUDA tools needed).

    python tools/cubin_resources.py                          # build/inplace/kernels/*.o
    python tools/cubin_resources.py --only paged --frames    # variants with a stack frame only

A stack frame (EIATTR_FRAME_SIZE > 0) means local memory: usually register spills. The paged
KV-cache producer spilled at 24 registers (88-96 bytes), which is why kvcache_config gives it 64 at
tile_m 64. `regs` is the launch allocation per thread, which the build checks against the
warpgroups' setmaxnreg budgets (fa4_jax/aot/worker.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fa4_jax.aot.cubin import kernel_resources  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "inplace" / "kernels")
    ap.add_argument("--only", default="", help="substring of the variant symbol")
    ap.add_argument("--frames", action="store_true", help="only kernels with a stack frame")
    args = ap.parse_args(argv)
    objs = sorted(p for p in args.dir.glob("fa4_*.o") if args.only in p.stem)
    if not objs:
        print(f"no exported objects matching {args.only!r} in {args.dir}", file=sys.stderr)
        return 1
    for obj in objs:
        for kernel, res in kernel_resources(obj).items():
            if args.frames and not res.get("frame"):
                continue
            role = "combine" if "combine" in kernel else "attention"
            print(f"{obj.stem:<56} {role:<9} regs {res.get('regs', '?'):>3}  frame {res.get('frame', 0):>4} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
