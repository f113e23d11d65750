"""The KV-cache handler's automatic split count (ffi/splits.h), compiled on the CPU with the host's C++
compiler and driven over the decode rows measured on the H200 (docs/PERF.md; issues 17 and 20).

The expected counts are the ones the device sweeps chose or confirmed: 16-bit decode fills one wave of
one CTA per SM (`tools/split_sweep.py`, 2026-12-02: the best forced count, or within 1.2% of it, on
every row from HBM); FP8 fills both CTA slots of its two-CTA tiles with splits of >= 1024 keys, in the
count that divides the keys most evenly (1 x 32k: 32, not 31). Shapes: 32 q-heads / 8 KV heads,
seqlen_q 1 (one 64-row tile per sequence and KV head), 132 SMs (H200), the workspace's extent from
`auto_split_capacity` as the lowering sizes it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fa4_jax.ops.kvcache.spec import MAX_SPLITS, SPLIT_BLOCK_KEYS, auto_split_capacity

ROOT = Path(__file__).resolve().parents[1]
H200_SMS = 132
H_KV, ROWS = 8, 4  # KV heads; packed query rows per KV head (seqlen_q 1 x 4 q-heads per KV head)
# ffi/splits.h kMinFp8SplitGranules: FP8 splits keep at least this many granules (1024 keys).
MIN_FP8_GRANULES = 8

_DRIVER = r"""
#include <cstdio>
#include "splits.h"
int main() {
  long long tiles, sms, ctas, blocks, cap, max_splits, fp8;
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld", &tiles, &sms, &ctas, &blocks, &cap, &max_splits, &fp8) == 7)
    std::printf("%lld\n", static_cast<long long>(
        fa4_jax::splits::AutoSplits(tiles, sms, ctas, blocks, cap, max_splits, fp8 != 0)));
  return 0;
}
"""


@pytest.fixture(scope="module")
def auto_splits(tmp_path_factory):
    """auto_splits([(batch, keys, ctas_per_sm, widening_bound), ...]) -> the handler's counts on an H200
    (widening_bound: the 64-row FP8 tile, ffi/kvcache.cc)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("no C++ compiler on PATH (the library's build needs one too)", pytrace=False)
    out = tmp_path_factory.mktemp("splits")
    (out / "driver.cc").write_text(_DRIVER)
    exe = out / "driver"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'ffi'}", str(out / "driver.cc"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)

    def run(rows):
        lines = []
        for batch, keys, ctas, fp8 in rows:
            tiles = batch * H_KV
            blocks = -(-keys // SPLIT_BLOCK_KEYS)
            cap = auto_split_capacity(batch, H_KV, ROWS, keys)
            lines.append(f"{tiles} {H200_SMS} {ctas} {blocks} {cap} {MAX_SPLITS} {int(fp8)}")
        proc = subprocess.run([str(exe)], input="\n".join(lines) + "\n", check=True, capture_output=True, text=True)
        return [int(x) for x in proc.stdout.split()]

    return run


# (batch, keys) -> splits. The 16-bit hd128 decode tile has two CTAs per SM but draws the bandwidth
# with one per SM: its count ignores the second slot. So does the 16-row FP8 decode tile (the handler
# passes widening_bound = false for it: H100 sweep, docs/PERF.md 2026-12-05 sixth session).
SIXTEEN_BIT = {(1, 8192): 16, (1, 32768): 16, (1, 131072): 16, (8, 32768): 2, (32, 8192): 1, (64, 4096): 1}
# The 64-row FP8 tile (two CTAs per SM, bound by its widening): 1 x 8k keeps 16 (32 splits of 256 keys measured slower), 1 x 32k takes 32
# (31 leaves one split 17 blocks of 64 keys long), 1 x 128k 32, 8 x 32k 4.
FP8 = {(1, 8192): 16, (1, 32768): 32, (1, 131072): 32, (8, 32768): 4, (32, 8192): 1, (64, 4096): 1}


@pytest.mark.parametrize("ctas", [1, 2])
def test_sixteen_bit_decode_fills_one_wave(auto_splits, ctas):
    rows = list(SIXTEEN_BIT)
    assert dict(zip(rows, auto_splits([(b, k, ctas, False) for b, k in rows]))) == SIXTEEN_BIT


def test_widening_bound_fp8_tile_fills_both_slots_in_even_splits(auto_splits):
    rows = list(FP8)
    assert dict(zip(rows, auto_splits([(b, k, 2, True) for b, k in rows]))) == FP8
    # An FP8 tile of one CTA per SM counts as 16-bit decode does.
    assert auto_splits([(b, k, 1, True) for b, k in rows]) == [SIXTEEN_BIT[r] for r in rows]


def test_fp8_split_count_properties(auto_splits):
    """Over a grid of shapes: the FP8 count is at least the 16-bit one and within the workspace; where
    it is larger, each split keeps >= 1024 keys and no larger count fitting the same number of waves
    of two CTAs per SM would shorten the longest split (EvenSplits went as far as that pays)."""
    shapes = [(b, k) for b in (1, 2, 3, 5, 8, 13) for k in (2048, 5000, 8192, 20000, 32768, 100000, 131072)]
    fp8 = auto_splits([(b, k, 2, True) for b, k in shapes])
    plain = auto_splits([(b, k, 1, False) for b, k in shapes])
    slots = 2 * H200_SMS
    for (b, k), s8, s16 in zip(shapes, fp8, plain):
        cap = auto_split_capacity(b, H_KV, ROWS, k)
        assert s16 <= s8 <= cap, (b, k, s16, s8, cap)
        if s8 == s16:
            continue
        blocks, tiles = -(-k // SPLIT_BLOCK_KEYS), b * H_KV
        assert s8 <= blocks // MIN_FP8_GRANULES, (b, k, s8)
        waves = -(-tiles * s8 // slots)
        longest = -(-blocks // s8)
        for t in range(s8 + 1, min(cap, blocks // MIN_FP8_GRANULES) + 1):
            if -(-tiles * t // slots) == waves:
                assert -(-blocks // t) >= longest, (b, k, s8, t)
