#!/usr/bin/env python3
"""Build libfa4_jax.so into the checkout (fa4_jax/_lib/, git-ignored), without pip.

    python tools/build_inplace.py [--jobs N] [--clean] [--build-dir DIR] [--lib-dir DIR]
    FA4_JAX_VARIANTS="dtype=bf16,head_dim=128" python tools/build_inplace.py   # a quick subset
    FA4_JAX_EXPERIMENTS=name python tools/build_inplace.py --build-dir build/name \
        --lib-dir build/ab/name     # a library for tools/ab_kernels.py, fa4_jax/_lib/ left alone

For the GPU workflow: the checkout plus fa4_jax/_lib/ is all the GPU host needs (it has no
nvidia-cutlass-dsl); there, `PYTHONPATH=$PWD python3 -m pytest -m gpu -q tests`.

Runs CMake directly with this interpreter (it must have nvidia-cutlass-dsl[cu13], jax and ninja or
make); the build dir (default build/inplace) keeps the exporter's kernel object cache, so rebuilding
after a C++ change or with the same menu does not recompile kernels.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator_args() -> list[str]:
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "inplace")
    parser.add_argument("--jobs", type=int, default=None, help="parallel kernel compiles (default: all CPUs)")
    parser.add_argument("--clean", action="store_true", help="delete the build dir (and kernel cache) first")
    parser.add_argument("--lib-dir", type=Path, default=None,
                        help="put libfa4_jax.so and its fa4_menu.json here instead of fa4_jax/_lib/ (A/B builds)")
    args = parser.parse_args()

    cmake = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if cmake is None:
        print("build_inplace: cmake not found on PATH", file=sys.stderr)
        return 1
    build = args.build_dir.resolve()
    if args.clean and build.exists():
        shutil.rmtree(build)
    fresh = not (build / "CMakeCache.txt").exists()

    variants = os.environ.get("FA4_JAX_VARIANTS", "")
    configure = [
        cmake, "-S", str(ROOT), "-B", str(build),
        f"-DPython_EXECUTABLE={sys.executable}",
        # Passed on every run (also when empty) so a cached value never outlives the environment.
        f"-DFA4_JAX_VARIANTS={variants}",
        f"-DFA4_JAX_AOT_JOBS={args.jobs or ''}",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    if fresh:
        configure += _generator_args()  # the generator can only be chosen at the first configure
    t0 = time.perf_counter()
    try:
        subprocess.run(configure, check=True)
        subprocess.run([cmake, "--build", str(build)], check=True)
        # `cmake --install` with the checkout as prefix puts the library (and its fa4_menu.json)
        # exactly where fa4_jax/core/library.py looks: <checkout>/fa4_jax/_lib/. With --lib-dir, into
        # <build>/install first, then both files into the directory (FA4_JAX_LIBRARY=<dir>/libfa4_jax.so).
        prefix = ROOT if args.lib_dir is None else build / "install"
        subprocess.run([cmake, "--install", str(build), "--prefix", str(prefix)], check=True)
    except subprocess.CalledProcessError as e:
        print(f"build_inplace: `{' '.join(map(str, e.cmd[:3]))} ...` failed (exit {e.returncode})", file=sys.stderr)
        return 1
    lib = prefix / "fa4_jax" / "_lib" / "libfa4_jax.so"
    if args.lib_dir is not None:
        args.lib_dir.mkdir(parents=True, exist_ok=True)
        for f in (lib, lib.parent / "fa4_menu.json"):
            shutil.copy2(f, args.lib_dir / f.name)
        lib = args.lib_dir / lib.name
    print(f"build_inplace: {lib} ({lib.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
