// The KV-cache handler's automatic split count (ffi/kvcache.cc), on its own so that a CPU test
// (tests/test_split_choice.py) can compile it and pin the choices measured on the H200.
//
// Plain integer arithmetic over the call's shape: no CUDA, no XLA, no generated constants.

#ifndef FA4_JAX_FFI_SPLITS_H_
#define FA4_JAX_FFI_SPLITS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fa4_jax::splits {

// The most splits a call may take: min(cap, blocks, max_splits), at least 1.
inline int64_t SplitBound(int64_t blocks, int64_t cap, int64_t max_splits) {
  return std::max<int64_t>(1, std::min({cap, blocks, max_splits}));
}

// Splits for `tiles` CTAs of work on `slots` CTA slots: none when the tiles already fill ~a wave;
// otherwise the smallest count whose last wave is nearly full (>= 95% of the best efficiency), since
// decode is bandwidth-bound and every idle SM is lost bandwidth. FlashAttention's heuristic, with a
// stricter threshold (it uses 85%). At most SplitBound(blocks, cap, max_splits).
inline int64_t FillWave(int64_t tiles, int64_t slots, int64_t blocks, int64_t cap, int64_t max_splits) {
  if (tiles * 5 >= slots * 4) return 1;
  const int64_t max_s = SplitBound(blocks, cap, max_splits);
  double best = 0;
  for (int64_t s = 1; s <= max_s; ++s) {
    const double waves = static_cast<double>(tiles * s) / slots;
    best = std::max(best, waves / std::ceil(waves));
  }
  for (int64_t s = 1; s <= max_s; ++s) {
    const double waves = static_cast<double>(tiles * s) / slots;
    if (waves / std::ceil(waves) >= 0.95 * best) return s;
  }
  return 1;
}

// A split count s leaves the longest split ceil(blocks / s) granules, and the last wave is as long
// as that split: the smallest count in [s, max_s] that shortens it without adding a wave. E.g. 1 x
// 32k FP8 (8 tiles, 264 slots): FillWave's 31 splits run 9 granules at the longest (17 kernel
// blocks of 64 keys against 16.5 on average), 32 splits 8 (2026-12-04: 36.6 vs 35.4 us).
inline int64_t EvenSplits(int64_t s, int64_t tiles, int64_t slots, int64_t blocks, int64_t max_s) {
  const int64_t waves = (tiles * s + slots - 1) / slots;
  const int64_t hi = std::min(max_s, waves * slots / tiles);
  int64_t best = s;
  for (int64_t t = s + 1; t <= hi; ++t)
    if ((blocks + t - 1) / t < (blocks + best - 1) / best) best = t;
  return best;
}

// Keys per FP8 split, in granules (kSplitBlockKeys keys each), below which a second CTA slot per SM
// is not filled (1024 keys at 128 per granule).
constexpr int64_t kMinFp8SplitGranules = 8;

// The split count num_splits = 0 (automatic) gets: `tiles` = batch x KV heads x query tiles, `sms`
// the device's SMs, `ctas_per_sm` the variant's residency, `blocks` the cache capacity in granules,
// `cap` the workspace's extent.
//
// 16-bit decode draws the bandwidth with one CTA per SM: issue 20's sweeps found no gain in more
// splits than fill one wave of those; so does the 16-row FP8 decode tile (its K/V are widened in
// registers). The 64-row FP8 tile (`widening_bound`: 17-64 packed rows, and chunks on one-row pages)
// is bound by its consumer widening each block in shared memory, not by HBM, so it fills every CTA
// slot (two per SM), as long as each split keeps kMinFp8SplitGranules granules of keys: shorter
// splits lose more to the merge than the second slot gains (2026-12-04, 1 x 8k: 32 splits 18.5 us vs
// 16 splits 17.0), and then take the count that divides the keys most evenly in that wave
// (EvenSplits).
inline int64_t AutoSplits(int64_t tiles, int64_t sms, int64_t ctas_per_sm, int64_t blocks, int64_t cap,
                          int64_t max_splits, bool widening_bound) {
  int64_t splits = FillWave(tiles, sms, blocks, cap, max_splits);
  if (widening_bound && ctas_per_sm > 1) {
    const int64_t slots = sms * ctas_per_sm;
    const int64_t fp8_blocks = blocks / kMinFp8SplitGranules;
    const int64_t fp8 = FillWave(tiles, slots, fp8_blocks, cap, max_splits);
    if (fp8 > splits)
      splits = EvenSplits(fp8, tiles, slots, blocks, SplitBound(fp8_blocks, cap, max_splits));
  }
  return splits;
}

}  // namespace fa4_jax::splits

#endif  // FA4_JAX_FFI_SPLITS_H_
