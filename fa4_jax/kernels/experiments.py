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
# fp8_loader_widens and dense_full_one_tile_per_cta went; the ninth session's fp8_chunk_q_in_regs and
# fp8_chunk_n64 went too: no gain, and 1.17-1.19x the time; the tenth session's
# paged_copies_by_warpgroup became the default: Sm90FwdConfig.copy_warps; the eleventh session's
# fp8_widen_wg too: Sm90FwdConfig.widen_wg.)
KNOWN: dict[str, str] = {
    # Issue 18's lever list: conditional rescaling. The 16-bit / FP8-chunk wgmma tiles multiply O (one
    # FMUL per O element, FMA pipe) by the running-max factors after every block, though on a long row
    # they are exactly 1 on most blocks (no row of the warp found a new max): skip those. A threshold
    # (FlashAttention-4's tau = 8: factors skipped while the max moved by < 2^8) measured 0.95-0.98x on
    # prefill rows but rounds a near-one-hot row's dominant P (no longer exactly 1) and broke the
    # accuracy rule at hd256 (0.0069 vs a bound of 0.0050): threshold 0 keeps the numbers bitwise.
    "conditional_rescale": "two-warpgroup wgmma tiles: a warp skips O's rescale when none of its rows found a new max",
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
