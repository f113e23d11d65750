"""Build-time kernel experiments: changes that compile, and are checked on the CPU (SASS, registers,
tests/test_sass.py), but await a GPU's verdict -- the tests on a library built with them, and an A/B
against the shipped one (tools/ab_kernels.py). Plain Python, build time only.

    FA4_JAX_EXPERIMENTS=name,other_name python tools/build_inplace.py ...

turns the named ones on for every kernel the build compiles; the exporter's object cache keys on the
set (aot/cache.fingerprint). Unset, the kernels are the shipped ones. An experiment that measures
well becomes the default, one that does not goes, in the session that measures it (docs/PERF.md
records which), so this list stays short.
"""

from __future__ import annotations

import os

ENV = "FA4_JAX_EXPERIMENTS"

# Name -> one line on what it changes, with a comment on why it might pay. (2026-12-06 measured the
# eighth session's three, docs/PERF.md: fp8_unmasked_full_blocks became the default,
# fp8_loader_widens and dense_full_one_tile_per_cta went; then fp8_chunk_q_in_regs went: no gain.)
KNOWN: dict[str, str] = {
    # At hd128 the FP8 chunk tile's shared memory holds two stages of 128 keys in each ring (Q 32 KB,
    # the FP8 stages 2 x 32 KB, the fp16 rings 2 x 64 KB), where the bf16 chunk tile has three and the
    # hd64 FP8 one four; its ratio to the bf16 cache is 0.86-0.91 at hd128 against 0.95 at hd64. The
    # widening is one more hop between a block's TMA load and its gemms, so with two stages a late
    # widening stalls both warpgroups. 64-key blocks give four stages of each in the same bytes.
    "fp8_chunk_n64": "the hd128 FP8 chunk tile runs 64-key blocks, four stages per ring instead of two",
}


def active() -> tuple[str, ...]:
    """The experiments FA4_JAX_EXPERIMENTS names, sorted. An unknown name is an error (a typo must not
    build the shipped kernels under an experiment's name)."""
    names = sorted({n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()})
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ValueError(f"{ENV}: unknown experiment(s) {unknown}; known: {sorted(KNOWN)}")
    return tuple(names)


def enabled(name: str) -> bool:
    if name not in KNOWN:
        raise KeyError(f"not an experiment: {name!r}; known: {sorted(KNOWN)}")
    return name in active()
