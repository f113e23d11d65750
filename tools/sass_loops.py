#!/usr/bin/env python3
"""The loops of AOT-exported kernels, side by side: each backward branch's body with its instruction
count and the opcodes that matter for the attention mainloops (HGMMA, MUFU, F2FP, LDS, STS, ...).
How the FP8 chunk tile's consumer block loop was found equal to the bf16 tile's, and its widening
warps' loop counted (docs/PERF.md, 2026-12-06, ninth session).

    python tools/sass_loops.py fa4_kvcache_sm90_bf16_hd128_local_m128 fa4_kvcache_sm90_bf16_hd128_local_m128_kvfp8
    python tools/sass_loops.py --dir build/t path/to/object.o --min 200

Arguments are exported objects (.o) or variant symbols looked up in --dir. Loops of fewer than --min
instructions are left out unless they hold an HGMMA. Needs nvdisasm (fa4_jax.aot.sass.find_nvdisasm).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fa4_jax.aot import sass  # noqa: E402

SHOWN = ("HGMMA", "MUFU", "F2FP", "FMNMX", "FFMA", "LDS", "STS", "UTMALDG", "SYNCS", "BAR")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objects", nargs="+", help="exported objects (.o) or variant symbols in --dir")
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "dev" / "kernels")
    ap.add_argument("--kernel", default="FlashAttentionForward", help="substring of the kernel's name")
    ap.add_argument("--min", type=int, default=150, help="smallest loop body shown (HGMMA loops always)")
    args = ap.parse_args(argv)
    for obj in args.objects:
        path = Path(obj) if obj.endswith(".o") else args.dir / f"{obj}.o"
        kernels = {n: t for n, t in sass.kernel_sass(path).items() if args.kernel in n}
        print(f"{path.name}:")
        for name, text in kernels.items():
            for target, branch, ops in sass.loop_bodies(text):
                n = sum(ops.values())
                if n < args.min and not ops["HGMMA"]:
                    continue
                counts = " ".join(f"{op} {ops[op]}" for op in SHOWN if ops[op])
                print(f"  {target:#07x}-{branch:#07x} {n:5d} instructions: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
