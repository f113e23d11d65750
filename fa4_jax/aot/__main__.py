"""CLI of the AOT exporter; see fa4_jax/aot/__init__.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fa4_jax.aot.build import PREFIX, build
from fa4_jax.aot.cmake import sorted_menu, write_cmake_config
from fa4_jax.aot.worker import AotError
from fa4_jax.families import MENU_ENV, objects_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax.aot",
                                     description="AOT-compile the fa4_jax kernel menu GPU-blind.")
    parser.add_argument("--out", type=Path, help="output directory for S.o, S.h and the generated .inc files")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel worker processes")
    parser.add_argument("--force", action="store_true", help="recompile even if the cache is valid")
    parser.add_argument("--list", action="store_true",
                        help="print the variant menu (then the companions its variants launch, marked) and exit")
    # Used by CMakeLists.txt only.
    parser.add_argument("--cmake-config", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--request", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.cmake_config is not None:
            if args.out is None:
                parser.error("--cmake-config needs --out")
            write_cmake_config(args.cmake_config.resolve(), args.out.resolve())
            return 0
        if args.list:
            menu = sorted_menu(os.environ.get(MENU_ENV, ""))
            for v in objects_of(menu):
                print(v.symbol if v in menu else f"{v.symbol}  (companion)")
            return 0
        if args.out is None:
            parser.error("--out is required (unless --list)")
        build(args.out.resolve(), args.jobs, force=args.force, request=args.request)
        return 0
    except (AotError, ValueError) as e:
        print(f"{PREFIX} error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
