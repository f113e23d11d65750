"""Mutation check of the CPU tests: plausible bugs that the tests must catch.

    python tools/mutants.py            # every mutant; exit 1 if one survives or its anchor is gone
    python tools/mutants.py --list     # names, files and descriptions
    python tools/mutants.py --only update_page_size_16 no_clamp --jobs 1

Each mutant replaces one exact snippet of a source file (its anchor; it must occur exactly once, so a
mutant whose code moved fails loudly instead of silently testing nothing) in a temporary copy of the
checkout (fa4_jax/, tests/, pyproject.toml), runs the CPU tests named for it (pytest -x, that copy first
on sys.path), and is killed when they fail. The named tests first run on the unmutated copy: they must
pass there, or a "kill" would prove nothing. Two mutants run at a time (--jobs), each in its own copy.
tests/test_mutants_tool.py checks every anchor against the current sources as part of the test suite.

A new feature adds its mutants here: the bug a reviewer would fear, and the fastest test that kills it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("fa4_jax", "tests", "pyproject.toml")
PYTEST = ("-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly")

# The child process: pytest on the mutated copy. An editable install of fa4_jax (`pip install -e`, as
# .ci/run does) puts a meta path finder ahead of sys.path that maps `fa4_jax` to the original checkout,
# so the copy's mutated sources would never be imported and every mutant would "survive". The child
# drops any finder that resolves fa4_jax outside the copy and checks which fa4_jax it imports.
_CHILD = """
import sys
copy = sys.argv[1]
for finder in list(sys.meta_path):
    if type(finder).__module__ == "_frozen_importlib_external" or not hasattr(finder, "find_spec"):
        continue
    try:
        spec = finder.find_spec("fa4_jax", None)
    except Exception:
        continue
    if spec is not None and not str(spec.origin or "").startswith(copy):
        sys.meta_path.remove(finder)
import fa4_jax
if not fa4_jax.__file__.startswith(copy):
    sys.exit(f"mutants: fa4_jax imported from {fa4_jax.__file__}, not from the mutated copy {copy}")
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the checkout
    original: str  # exact snippet, exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest arguments (node ids, -k expressions) that must fail on the mutant
    description: str


# The shared reference, the validation, and each family's public function / reference.
R, V = "fa4_jax/core/reference.py", "fa4_jax/core/validation.py"
K, KR, VR = "fa4_jax/ops/kvcache/api.py", "fa4_jax/ops/kvcache/reference.py", "fa4_jax/ops/varlen/reference.py"
CAUSAL_RIGHT = ("        if right > 0:\n            raise ValueError(\n                f\"causal=True means",
                "        if right > 1:\n            raise ValueError(\n                f\"causal=True means")

MUTANTS: tuple[Mutant, ...] = (
    # -- surviving until issue 19 ---------------------------------------------------------------
    Mutant("update_page_size_16", K,
           "page_size, max_pages = cache_shape[1], page_table.shape[1]",
           "page_size, max_pages = 16, page_table.shape[1]",
           ("tests/test_kvcache.py", "-k", "test_update_paged_page_sizes"),
           "update_kvcache assumes pages of 16 tokens"),
    Mutant("update_page_size_16_flax", K,
           "page_size, max_pages = cache_shape[1], page_table.shape[1]",
           "page_size, max_pages = 16, page_table.shape[1]",
           ("tests/test_flax.py::test_paged_cache_equals_contiguous[64]",),
           "the same, caught by the Flax module's paged cache"),
    Mutant("no_clamp", KR,
           "kv_len = jnp.clip(cache_seqlens, 0, capacity).astype(jnp.int32)",
           "kv_len = cache_seqlens.astype(jnp.int32)",
           ("tests/test_kvcache.py", "-k", "test_cache_seqlens_are_clamped_to_the_capacity"),
           "cache_seqlens not clamped to [0, capacity] (a length past it shifts the causal diagonal)"),
    Mutant("softcap_log2e_check", V,
           "not (_usable_f32(cap * _LOG2E) and _usable_f32(softmax_scale / cap))",
           "not _usable_f32(softmax_scale / cap)",
           ("tests/test_api.py", "-k", "softcap_log2e_subnormal"),
           "softcap * log2(e) not checked to be a normal float32"),
    Mutant("softcap_ratio_check", V,
           "not (_usable_f32(cap * _LOG2E) and _usable_f32(softmax_scale / cap))",
           "not _usable_f32(cap * _LOG2E)",
           ("tests/test_api.py", "-k", "softcap_scale_ratio_underflows"),
           "softmax_scale / softcap not checked to be a normal float32"),
    # The same bug, killed by each entry point's own test.
    *(Mutant(f"causal_right_1_{suffix}", V, *CAUSAL_RIGHT, (test_file, "-k", test_expr),
             f"causal=True accepts window_size=(l, 1) ({where})")
      for suffix, test_file, test_expr, where in (
          ("api", "tests/test_api.py", "causal_with_right_window_1", "API test"),
          ("kvcache", "tests/test_kvcache.py", "test_causal_with_a_right_window_rejected", "KV-cache test"),
          ("varlen", "tests/test_varlen.py", "causal_right_window", "varlen test"),
          ("primitive", "tests/test_primitive.py", "test_references_reject_causal_with_a_right_window",
           "the primitives' reference bodies"))),
    Mutant("softmax_no_max_subtraction", R,
           "    big_safe = jnp.where(jnp.isneginf(big), 0.0, big)\n"
           "    u_max_safe = jnp.where(jnp.isneginf(u_max), 0.0, u_max)\n"
           "    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)\n",
           "    big_safe = jnp.zeros_like(big)\n"
           "    u_max_safe = jnp.zeros_like(u_max)\n"
           "    m_safe = jnp.zeros_like(m)\n",
           ("tests/test_api.py::test_large_scores_against_oracle",),
           "softmax exponentiates the raw scores (no row-max shift: exp overflows above ~88)"),
    # -- what the features added since need -----------------------------------------------------
    Mutant("num_splits_ignored", K,
           "                  num_splits=num_splits or 0)",
           "                  num_splits=0)",
           ("tests/test_kvcache.py", "-k", "test_num_splits_reaches_the_primitive"),
           "attention_with_kvcache drops num_splits (the kernel always picks its own)"),
    Mutant("num_splits_unbounded", V,
           "if not 1 <= num_splits <= MAX_SPLITS:",
           "if not 1 <= num_splits:",
           ("tests/test_kvcache.py", "-k", "test_bad_num_splits"),
           "num_splits above the kernel's maximum accepted"),
    Mutant("softmax_scale_unbounded", V,
           " or scale > MAX_SOFTMAX_SCALE:",
           ":",
           ("tests/test_api.py", "-k", "scale_above_max or scale_1e8"),
           "softmax_scale above the resolvable range accepted"),
    Mutant("ragged_key_offsets", KR,
           "cu_k = jnp.arange(b + 1, dtype=jnp.int32) * capacity",
           "cu_k = jnp.arange(b + 1, dtype=jnp.int32) * (capacity - 1)",
           ("tests/test_kvcache.py", "-k", "ragged"),
           "the ragged reference reads each sequence's keys one slot early (the next sequence's last key)"),
    Mutant("scale_applied_twice", R,
           "    else:\n        mult = scale\n",
           "    else:\n        mult = scale * scale\n",
           ("tests/test_kvcache.py", "-k", "test_contiguous_matches_oracle and plain"),
           "softmax_scale applied twice"),
    Mutant("length_mask_lets_slot_len_through", R,
           "visible = cols < kl",
           "visible = cols <= kl",
           ("tests/test_kvcache.py", "-k", "test_contiguous_matches_oracle and plain"),
           "the KV-cache length mask lets slot cache_seqlens[b] through"),
    Mutant("update_negative_positions_wrap", K,
           "outside = (pos < 0) | (pos >= cache_shape[1])",
           "outside = pos >= cache_shape[1]",
           ("tests/test_kvcache.py", "-k", "test_update_drops_positions_outside_the_cache and negative"),
           "update_kvcache writes negative positions (they wrap to the end of the row)"),
    # -- already dying before issue 19 (masking, softcap, sinks, LSE, alignment, varlen offsets) -----
    Mutant("causal_mask_off_by_one", R,
           "vis = cols <= diag + right",
           "vis = cols < diag + right",
           ("tests/test_api.py", "-k", "test_new_options_reach_the_computation or test_large_scores"),
           "the right edge of the mask (causal diagonal) excludes the diagonal key"),
    Mutant("left_window_off_by_one", R,
           "lo = cols >= diag - left",
           "lo = cols > diag - left",
           ("tests/test_api.py::test_new_options_reach_the_computation",),
           "a left window one key short"),
    Mutant("softcap_dropped", R,
           "u, mult = jnp.tanh(u * (scale / softcap)), softcap",
           "u, mult = u, scale",
           ("tests/test_kvcache.py", "-k", "test_contiguous_matches_oracle and softcap"),
           "softcap ignored"),
    Mutant("sinks_dropped", R,
           "l = l + jnp.exp(sinks[None, :, :, None] - big_safe)",
           "l = l",
           ("tests/test_kvcache.py", "-k", "test_contiguous_matches_oracle and sinks"),
           "sinks left out of the softmax denominator"),
    Mutant("lse_without_max", R,
           "lse = jnp.where(has_mass, big_safe + jnp.log(",
           "lse = jnp.where(has_mass, jnp.log(",
           ("tests/test_kvcache.py", "-k", "test_contiguous_matches_oracle and plain"),
           "LSE misses the row max it was shifted by"),
    Mutant("top_left_alignment", R,
           "visible = window_mask(rows[:, None] + (s_k - s_q), cols[None, :], left, right)",
           "visible = window_mask(rows[:, None], cols[None, :], left, right)",
           ("tests/test_api.py::test_new_options_reach_the_computation",),
           "dense masks aligned top-left instead of bottom-right"),
    Mutant("kvcache_top_left_alignment", R,
           "window = window_mask(rows[:, None] + kl - s_q, cols, left, right)",
           "window = window_mask(rows[:, None], cols, left, right)",
           ("tests/test_kvcache.py", "-k", "test_contiguous_matches_oracle and causal"),
           "KV-cache queries placed at the start of the cache instead of its end"),
    Mutant("varlen_key_offset", VR,
           "rel = cols[None, :] - k_start[:, None]",
           "rel = cols[None, :] - q_start[:, None]",
           ("tests/test_varlen.py", "-k", "test_matches_oracle and plain"),
           "varlen keys located by the query offsets"),
    Mutant("varlen_seqused_ignored", VR,
           "k_len = own if seqused_k is None else jnp.clip(seqused_k[seq], 0, own)",
           "k_len = own",
           ("tests/test_varlen.py::test_seqused_k_hides_the_rest_of_the_segment",),
           "seqused_k ignored"),
    Mutant("lpt_last_section_full", "fa4_jax/kernels/tile_order.py",
           "n = hi(section, pairs - first)",
           "n = section",
           ("tests/test_tile_order.py", "-k", "every_tile_once"),
           "the last longest-first section assumed full: tiles of pairs past the batch, others never run"),
    Mutant("mask_bits_pair_tail", "fa4_jax/kernels/mask_bits.py",
           "hi(lim & 7, 2)",
           "hi(lim & 7, 1)",
           ("tests/test_mask_bits.py", "-k", "registers_left_of"),
           "a bound inside an 8-column group keeps one of the thread's pair of columns, not both"),
    Mutant("mask_bits_lower_edge", "fa4_jax/kernels/mask_bits.py",
           "lo(keep_lo - word * BITS, 0)",
           "lo(keep_lo - word * BITS - 1, 0)",
           ("tests/test_mask_bits.py", "-k", "visible_columns"),
           "the window's left edge one register too far left: a key outside the window kept"),
)


def anchor_problems(mutants=MUTANTS, root: Path = ROOT) -> list[str]:
    """Mutants whose anchor is not exactly once in its file (or that change nothing)."""
    problems = []
    for m in mutants:
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.name}: {m.file} does not exist")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            problems.append(f"{m.name}: its anchor occurs {n} times in {m.file} (must be exactly once): "
                            f"{m.original!r}")
        if m.original == m.replacement:
            problems.append(f"{m.name}: the replacement changes nothing")
    return problems


def make_copy(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "_lib", "*.so", ".pytest_cache")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def run_pytest(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), str(copy / "tests")]), JAX_PLATFORMS="cpu",
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("FA4_JAX_REQUIRE_GPU", None)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(copy), *PYTEST, *tests], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {timeout} s\n{e.stdout or ''}"
    return rc, out, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per pytest run")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()

    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"unknown mutants {sorted(unknown)}")
        mutants = tuple(m for m in MUTANTS if m.name in args.only)
    if args.list:
        for m in mutants:
            print(f"{m.name:36s} {m.file:24s} {m.description}\n{'':36s} kill: pytest {' '.join(m.tests)}")
        return 0

    problems = anchor_problems(mutants)
    if problems:
        print("mutants out of sync with the sources (update tools/mutants.py):", *problems, sep="\n  ")
        print(f"FAILED: {len(problems)} mutants out of sync ({time.perf_counter() - t0:.0f} s)")
        return 1

    jobs = max(1, min(args.jobs, len(mutants)))
    with tempfile.TemporaryDirectory(prefix="fa4_mutants_") as tmp:
        copies = [make_copy(Path(tmp) / f"copy{i}") for i in range(jobs)]
        free, lock = list(copies), threading.Lock()

        # The named tests must pass unmutated; each job's copy checks a share of them.
        selections = sorted({m.tests for m in mutants})
        failures = []

        def baseline(tests):
            with lock:
                copy = free.pop()
            try:
                rc, out, secs = run_pytest(copy, tests, args.timeout)
            finally:
                with lock:
                    free.append(copy)
            if rc != 0:
                failures.append(f"pytest {' '.join(tests)} fails without any mutant (rc {rc}):\n{out[-3000:]}")
            return secs

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(baseline, selections))
        print(f"baseline: {len(selections)} test selections pass unmutated ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if failures:
            print(*failures, sep="\n")
            print(f"FAILED: {len(failures)} test selections fail unmutated ({time.perf_counter() - t0:.0f} s)")
            return 1

        def run(m: Mutant):
            with lock:
                copy = free.pop()
            path = copy / m.file
            source = path.read_text()
            try:
                path.write_text(source.replace(m.original, m.replacement, 1))
                rc, out, secs = run_pytest(copy, m.tests, args.timeout)
            finally:
                path.write_text(source)
                with lock:
                    free.append(copy)
            verdict = "killed" if rc == 1 else "SURVIVED" if rc == 0 else f"ERROR (pytest rc {rc})"
            print(f"{verdict:9s} {m.name:36s} {secs:5.1f} s  {m.description}", flush=True)
            if rc not in (0, 1):
                print(out[-3000:], flush=True)
            return m, verdict

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(run, mutants))

    bad = [(m, v) for m, v in results if v != "killed"]
    print(f"{len(results) - len(bad)} of {len(results)} mutants killed in {time.perf_counter() - t0:.0f} s "
          f"({jobs} at a time)")
    for m, v in bad:
        print(f"  {v}: {m.name} ({m.file}): {m.description}; kill with: pytest {' '.join(m.tests)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
