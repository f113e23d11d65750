"""Build-time kernel experiments: changes that compile, and are checked on the CPU (SASS, registers,
tests/test_sass.py), but await a GPU's verdict -- the tests on a library built with them, and an A/B
against the shipped one (tools/ab_kernels.py). Plain Python, build time only.

    FA4_JAX_EXPERIMENTS=fp8_loader_widens,fp8_unmasked_full_blocks python tools/build_inplace.py ...

turns the named ones on for every kernel the build compiles; the exporter's object cache keys on the
set (aot/cache.fingerprint). Unset, the kernels are the shipped ones. An experiment that measures
well becomes the default, one that does not goes, in the session that measures it (docs/PERF.md
records which), so this list stays short.
"""

from __future__ import annotations

import os

ENV = "FA4_JAX_EXPERIMENTS"

KNOWN = {
    # The FP8 chunk tile's loads' warp widens a quarter of each block too: four widening warps of 32
    # rows instead of three of 48 / 48 / 32 (Sm90FwdConfig.loader_widens, fwd_sm90.load_and_widen).
    "fp8_loader_widens": "the FP8 chunk tile's loads' warp widens too (four widening warps)",
    # The FP8 chunk tile widens a V block without its per-row zeroing when every row is a key of the
    # sequence (all blocks but the one holding the sequence's end): the masks cost as many SEL
    # instructions as the block has conversions (fwd_sm90._widen_one).
    "fp8_unmasked_full_blocks": "the FP8 chunk tile skips the V row masks on blocks without a sequence end",
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
