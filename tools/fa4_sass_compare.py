#!/usr/bin/env python3
"""Our SM90 forward kernel's SASS beside FlashAttention-4's, GPU-blind: where the instructions go.

    python tools/fa4_sass_compare.py --site DIR --ours build/inplace/kernels/fa4_fwd_sm90_bf16_hd256_full.o \
        --head-dim 256 [--causal] [--tile-n 80]

--site is a folder with the FlashAttention-4 wheels extracted (flash-attn-4, quack-kernels, the same
nvidia-cutlass-dsl as ours: `pip download --no-deps flash-attn-4==4.0.0b36 quack-kernels` and unzip
each wheel into it; tools/flash4_site.sh names the set). Measurement only: FA4's code is imported from
there at run time, nothing of it is copied. It needs torch only for its host-side API, so every
`torch` / `triton` module is replaced by an inert stand-in while its kernel class is imported and
compiled for sm_90a with fake tensors (the CuTe DSL keeps the cubin: CUTE_DSL_KEEP=cubin).

For each kernel it prints the static instruction count and, for every loop of the SASS that issues
at least four HGMMA (the mainloop per K/V block, its masked twin, the tile loop), the opcode histogram:
the per-block instruction budget the two kernels spend around the same tensor-core work
(docs/PERF.md, 2026-12-03 evening). Static counts, not executed ones: Nsight Compute's
`--metrics sass__inst_executed_per_opcode --print-metric-instances values` gives those on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# --- an inert stand-in for the torch / triton modules FA4's host code imports ----------------------
def _inert(name: str):
    return _InertMeta(name, (), dict(_INERT_BODY))


class _Decorated:
    """What a stand-in decorator returns: the function, callable, with any attribute a decorator."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *a, **k):
        return self._fn(*a, **k)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: a[0] if len(a) == 1 and callable(a[0]) else (lambda f: f)


def _call(self, *a, **k):
    return _Decorated(a[0]) if len(a) == 1 and callable(a[0]) and not k else self


def _attribute(self, name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _inert(name)


_INERT_BODY = {
    "__init__": lambda self, *a, **k: None,
    "__call__": _call,
    "__getattr__": _attribute,
    "__getitem__": lambda self, i: 9,  # a "device capability" of (9, 0): Hopper
    "__iter__": lambda self: iter((9, 0)),
    "__bool__": lambda self: False,
}


def _cached_inert(owner, name):
    """owner.name as a stand-in, created on first use and kept (so `torch.float16` is one object)."""
    if name.startswith("__"):
        raise AttributeError(name)
    value = _inert(name)
    setattr(owner, name, value)
    return value


class _InertMeta(type):
    __getattr__ = _cached_inert

    def __call__(cls, *a, **k):
        return _Decorated(a[0]) if len(a) == 1 and callable(a[0]) and not k else type.__call__(cls, *a, **k)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _InertModule(types.ModuleType):
    __getattr__ = _cached_inert


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("torch", "triton", "tvm_ffi", "torch_c_dlpack_ext")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _import_fa4(site: Path):
    sys.meta_path.insert(0, _InertFinder())
    sys.path.append(str(site))
    # The package __init__ imports the torch interface; the kernel modules need only the folders.
    for name, sub in (("flash_attn", "flash_attn"), ("flash_attn.cute", "flash_attn/cute")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(site / sub)]
        sys.modules[name] = pkg
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    return FlashAttentionForwardSm90


# --- SASS -----------------------------------------------------------------------------------------
def _lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = re.sub(r"/\*[0-9a-f]*\*/", "", line).strip()
        if line:
            out.append(line)
    return out


def _opcode(line: str) -> str:
    tokens = line.split()
    op = tokens[1] if tokens[0].startswith("@") else tokens[0]
    return op.split(".")[0].rstrip(";")


def loop_bodies(sass: str, min_hgmma: int = 4) -> list[list[str]]:
    """The instructions of every backward-branch loop that issues at least min_hgmma HGMMA, smallest
    first: the per-block mainloop, then its masked twin; the larger ones nest the tile's prologue and
    epilogue around them."""
    lines = _lines(sass)
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.startswith(".L_x_") and line.endswith(":")}
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [b for b in lines[labels[m.group(1)]:i + 1] if not b.startswith(".") and not b.endswith(":")]
            if sum(_opcode(b) == "HGMMA" for b in body) >= min_hgmma:
                out.append(body)
    return sorted(out, key=len)


def histogram(body: list[str]) -> collections.Counter:
    """Opcode counts of a list of SASS instructions."""
    return collections.Counter(_opcode(b) for b in body)


def loop_histograms(sass: str, min_hgmma: int = 4) -> list[collections.Counter]:
    """Opcode histograms of loop_bodies(sass, min_hgmma), in the same order."""
    return [histogram(body) for body in loop_bodies(sass, min_hgmma)]


def report(name: str, sass: str, top: int, loops: int, print_loop: int | None = None) -> None:
    static = sum(1 for line in _lines(sass) if not line.startswith(".") and not line.endswith(":"))
    print(f"== {name}: {static} static instructions")
    bodies = loop_bodies(sass)
    for body in bodies[:loops]:
        counts = histogram(body)
        print(f"   loop of {len(body):5}: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))
    if print_loop is not None:
        for line in bodies[print_loop]:
            print(f"      {line}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", type=Path, required=True, help="folder with the FA4 wheels extracted")
    ap.add_argument("--ours", type=Path, required=True, help="our kernel object (a build's kernels/*.o)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument("--tile-n", type=int, default=None, help="FA4's SM90 choice by default (80 at hd256)")
    ap.add_argument("--top", type=int, default=24, help="opcodes shown per loop")
    ap.add_argument("--loops", type=int, default=4, help="loops shown per kernel, smallest first")
    ap.add_argument("--print-loop", type=int, default=None, metavar="I",
                    help="also print the SASS of each kernel's I-th loop as listed, smallest first")
    args = ap.parse_args()

    dump = Path(tempfile.mkdtemp(prefix="fa4_sass_"))
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump))
    sys.path.insert(0, str(ROOT))
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda

    from fa4_jax.aot.sass import disassemble, kernel_sass, split_functions
    from fa4_jax.kernels.common import compile_options, fake_bshd, fake_f32

    fa4_cls = _import_fa4(args.site.resolve())
    hd = args.head_dim
    tile_n = args.tile_n or (80 if hd > 192 else 112 if hd > 128 else 128)
    kernel = fa4_cls(cutlass.BFloat16, hd, hd, 1, is_causal=args.causal, is_local=False, pack_gqa=False,
                     tile_m=args.tile_m, tile_n=tile_n, num_stages=2, num_threads=128 * (args.tile_m // 64 + 1),
                     Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True)
    q, k, v, o = (fake_bshd(cutlass.BFloat16, hd) for _ in range(4))
    cute.compile(kernel, q, k, v, o, fake_f32(3), cutlass.Float32(0.1), stream=cuda.CUstream(0),
                 options=compile_options("sm90"))
    cubins = glob.glob(str(dump / "*.cubin"))
    if not cubins:
        print(f"no cubin in {dump}: the DSL did not keep one", file=sys.stderr)
        return 1
    functions = split_functions(disassemble(Path(cubins[0]).read_bytes()))
    theirs = max(functions.values(), key=len)
    what = f"hd{hd} {'causal' if args.causal else 'full'}, tile {args.tile_m} x {tile_n}"
    report(f"FlashAttention-4 {what}", theirs, args.top, args.loops, args.print_loop)
    for fn, sass in kernel_sass(args.ours).items():
        if "combine" not in fn.lower():
            report(f"ours {args.ours.name}", sass, args.top, args.loops, args.print_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
