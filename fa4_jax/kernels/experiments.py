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
# fp8_widen_wg too: Sm90FwdConfig.widen_wg; the twelfth session's conditional_rescale went: no gain
# at threshold 0 or with sums of the rounded P, and tau 8 alone broke the accuracy rule; the thirteenth
# session's softcap_skip_unit_rescale (fwd_sm90.skip_unit_rescale) and hd96_three_warpgroups
# (Sm90FwdConfig.for_variant; now causal past 2k too) became the defaults once the GPU suite had run
# on them, in the fourteenth.)
KNOWN: dict[str, str] = {}


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
