// Resolve of the KV-cache family (fa4_jax/ops/kvcache/spec.py): the checks its CallSignature cannot
// express, the split count, the variant and its Params. The binding, the Call struct, the
// dtype/rank/alignment checks and both stages are generated into fa4_kvcache.inc.
//
// The workspace (o_accum, lse_accum) is an XLA-allocated result (CUDA-graph safe: no allocation
// here); its extent `splits` is what the lowering sized it for, and bounds num_splits. With
// splits, the attention kernel's last split CTA of each tile merges the tile's partials, counting
// splits in one of the device's zero-at-rest counters (runtime.h ZeroedCounters); a ragged call, or
// one the pool cannot serve, gets the combine kernel launched right after instead.
//
// What cannot be checked without reading device memory, and what the kernel does instead:
// cache_seqlens[b] is clamped to [0, capacity] (capacity = cache length, or max_pages * page_size);
// page ids are clamped to [0, num_pages). Out-of-range values therefore read only cache memory
// (the results for such a sequence are unspecified) and nothing is ever written outside o/lse and
// the workspace.

#include "runtime.h"
#include "splits.h"

#include "fa4_kvcache.inc"  // generated: Params, Key, kVariants, Call, Resolved, kTileM, ..., the binding

#include <algorithm>
#include <limits>
#include <string>

namespace fa4_jax::gen::kvcache {
namespace {

ffi::Error Invalid(const std::string &msg) { return InvalidArgument(kTarget, msg); }

bool FuseCombineEnabled() { return EnvSwitchOn("FA4_JAX_FUSE_COMBINE"); }

}  // namespace

ffi::Error Resolve(const Call &c, Resolved &r) {
  auto qd = c.q.dimensions(), kd = c.k_cache.dimensions(), vd = c.v_cache.dimensions(), od = c.o.dimensions();
  // q is (b, s_q, h_q, d), or for a ragged batch (1, total_q, h_q, d) with cu_seqlens_q (b + 1,).
  const int64_t qb = qd[0], s_q = qd[1], h_q = qd[2], d = qd[3];
  const int64_t b = c.cache_seqlens.dimensions()[0];
  const bool ragged = c.cu_seqlens_q.has_value();
  const int64_t kv_rows = kd[0], kv_len = kd[1], h_k = kd[2];
  for (int i = 0; i < 4; ++i)
    if (vd[i] != kd[i]) return Invalid("k_cache and v_cache must have one shape; got " + DimsText(kd) + " and " + DimsText(vd));
  if (kd[3] != d) return Invalid("the caches' head_dim must be q's; got q" + DimsText(qd) + " k_cache" + DimsText(kd));
  if (od[0] != qb || od[1] != s_q || od[2] != h_q || od[3] != d) return Invalid("o must have q's shape " + DimsText(qd));
  auto ld = c.lse.dimensions();
  if (ld[0] != qb || ld[1] != h_q || ld[2] != s_q)
    return Invalid("lse must be (q.shape[0], heads_q, q.shape[1]); got " + DimsText(ld));
  if (h_k == 0 || h_q % h_k != 0)
    return Invalid("heads_q (" + std::to_string(h_q) + ") must be a multiple of heads_kv (" + std::to_string(h_k) + ")");
  int64_t max_seqlen_q = s_q;
  if (ragged) {
    if (qb != 1) return Invalid("a ragged batch's q must be (1, total_q, heads_q, head_dim); got " + DimsText(qd));
    auto cd = c.cu_seqlens_q->dimensions();
    if (cd[0] != b + 1)
      return Invalid("cu_seqlens_q must be int32 (batch + 1,) = (" + std::to_string(b + 1) + ",); got " + DimsText(cd));
    if (c.max_seqlen_q < 0) return Invalid("max_seqlen_q must be >= 0; got " + std::to_string(c.max_seqlen_q));
    // 0: no bound given (total_q); no sequence has more rows than q.
    if (c.max_seqlen_q > 0) max_seqlen_q = std::min<int64_t>(c.max_seqlen_q, s_q);
  } else if (qb != b) {
    return Invalid("cache_seqlens must be int32 (batch,) = (" + std::to_string(qb) + ",); got (" + std::to_string(b) + ",)");
  }
  // A tile list (ragged only): the (sequence, m_block) pairs to run, built by the lowering
  // (fa4_jax/ops/kvcache/tiles.py); the kernel skips entries that hold no rows.
  int64_t n_listed = 0;
  if (c.tile_list.has_value()) {
    const int64_t entries = c.tile_list->dimensions()[0];
    if (!ragged) return Invalid("tile_list needs a ragged batch (cu_seqlens_q)");
    if (entries < 2 || entries % 2 != 0)
      return Invalid("tile_list must be int32 (2 * tiles,) (sequence, m_block) pairs; got (" + std::to_string(entries) + ",)");
    n_listed = entries / 2;
  }
  const bool paged = c.page_table.has_value();
  int64_t capacity = kv_len, max_pages = 1;
  if (paged) {
    auto pd = c.page_table->dimensions();
    if (pd[0] != b) return Invalid("page_table must be (batch, max_pages); got " + DimsText(pd));
    max_pages = pd[1];
    if (max_pages < 1) return Invalid("page_table must have at least one page per sequence");
    // TMA pieces of page_rows rows: 16 when the page size is a multiple of 16, else 1 (any size).
    if (c.page_rows != kPageRows && c.page_rows != 1)
      return Invalid("page_rows must be " + std::to_string(kPageRows) + " or 1; got " + std::to_string(c.page_rows));
    if (kv_len < 1 || kv_len % c.page_rows != 0)
      return Invalid("page_size (k_cache.shape[1]) must be a positive multiple of page_rows (" +
                     std::to_string(c.page_rows) + "); got " + std::to_string(kv_len));
    capacity = kv_len * max_pages;
  } else if (kv_rows != b) {
    return Invalid("a contiguous cache must be (batch, capacity, heads_kv, head_dim); got " + DimsText(kd));
  }
  // FP8 caches (float8_e4m3fn, both) come with their per-KV-head float32 scales; 16-bit caches without.
  const bool kv_fp8 = c.k_cache.element_type() == ffi::DataType::F8E4M3FN;
  if (c.v_cache.element_type() != c.k_cache.element_type())
    return Invalid("k_cache and v_cache must have one dtype (q's, or float8_e4m3fn for both)");
  if (kv_fp8 != c.k_scale.has_value() || kv_fp8 != c.v_scale.has_value())
    return Invalid(kv_fp8 ? "float8_e4m3fn caches need k_scale and v_scale (float32 (heads_kv,))"
                          : "k_scale / v_scale go with float8_e4m3fn caches only");
  for (const auto *scale : {&c.k_scale, &c.v_scale})
    if (scale->has_value() && (*scale)->dimensions()[0] != h_k)
      return Invalid("k_scale and v_scale must be float32 (heads_kv,) = (" + std::to_string(h_k) + ",); got " +
                     DimsText((*scale)->dimensions()));
  auto sk = c.sinks.dimensions();
  if (sk[0] != h_q) return Invalid("sinks must be float32 (heads_q,); got " + DimsText(sk));
  auto oad = c.o_accum.dimensions(), lad = c.lse_accum.dimensions();
  if (oad[0] < 1 || oad[1] != qb || oad[2] != s_q || oad[3] != h_q || oad[4] != d)
    return Invalid("o_accum must be float32 (splits, q.shape[0], q.shape[1], heads_q, head_dim); got " + DimsText(oad));
  if (lad[0] != oad[0] || lad[1] != qb || lad[2] != h_q || lad[3] != s_q)
    return Invalid("lse_accum must be float32 (splits, q.shape[0], heads_q, q.shape[1]); got " + DimsText(lad));
  const int64_t splits_cap = oad[0];
  for (int64_t x : {b + 1, s_q, h_q, h_k, kv_rows, kv_len, max_pages, capacity, splits_cap})
    if (!FitsInt32(x)) return Invalid("a dimension exceeds int32");

  DType dtype;
  SoftmaxArgs softmax;
  if (ffi::Error err = ResolveAttention(kTarget, c, dtype, softmax); err.failure()) return err;
  if (c.num_splits < 0 || c.num_splits > splits_cap)
    return Invalid("num_splits must be 0 (auto) or in [1, " + std::to_string(splits_cap) +
                   "] (the workspace's extent); got " + std::to_string(c.num_splits));

  // (A ragged batch of no sequence still owes its rows o = 0: the lowering answers it without a launch.)
  if (b == 0 || s_q == 0 || h_q == 0) {
    r.empty = true;
    return ffi::Error::Success();
  }
  // The lowering picks the tile from the longest sequence's packed rows (spec.tile_m_for): 64 rows
  // (one consumer warpgroup) for decode; 128 for chunks, as efficient per key block as the dense kernel.
  // FP8 caches: 16 rows (the warp-mma decode tile), 64 or 128 (api._tile_m; no 128 for one-row pages:
  // PickVariant refuses the variant the menu lacks).
  const int tile_m = c.tile_m;
  if ((tile_m != kTileM && tile_m != kTileMWide) && !(kv_fp8 && tile_m == kTileMFp8Decode))
    return Invalid("tile_m must be " +
                   (kv_fp8 ? std::to_string(kTileMFp8Decode) + ", " + std::to_string(kTileM) + " or " +
                                 std::to_string(kTileMWide)
                           : std::to_string(kTileM) + " or " + std::to_string(kTileMWide)) +
                   "; got " + std::to_string(tile_m));
  const int64_t rows = max_seqlen_q * (h_q / h_k);
  const int64_t m_blocks = (rows + tile_m - 1) / tile_m;
  // Without a list: every m_block of every sequence (ragged: and of the pseudo-sequence).
  const int64_t tiles = (n_listed > 0 ? n_listed : m_blocks * b) * h_k;

  DeviceInfo dev;
  // One `local` kernel serves every window (spec.MASK): ResolveAttention turned an unbounded side into
  // a bound that covers every key.
  if (ffi::Error err = PickVariant({0, dtype, static_cast<int>(d), Mask::kLocal, c.softcap > 0, paged, tile_m,
                                    static_cast<int>(paged ? c.page_rows : kPageRows), kv_fp8},
                  dev, r);
      err.failure())
    return err;

  const int64_t blocks = std::max<int64_t>(1, (capacity + kSplitBlockKeys - 1) / kSplitBlockKeys);
  // The 64-row FP8 tile is bound by its consumer's widening and fills both CTA slots of an SM; the
  // 16-row FP8 decode tile draws the bandwidth like the 16-bit tiles, with one wave of one CTA per SM
  // (H100 sweep, docs/PERF.md: 1 x 128k 16 splits 101 us vs 32 at 110; 8 x 32k 2 vs 4: 188 vs 202);
  // the 128-row FP8 chunk tile (producer widening, one CTA per SM) splits as the 16-bit chunk tile.
  const bool widening_bound = kv_fp8 && tile_m == kTileM;
  const int64_t splits =
      c.num_splits != 0 ? c.num_splits
                        : ::fa4_jax::splits::AutoSplits(tiles, dev.num_sms, r.variant->ctas_per_sm, blocks, splits_cap,
                                                        kMaxSplits, widening_bound);
  if (!FitsInt32((tiles + m_blocks * h_k) * splits) || !FitsInt32(2 * n_listed))
    return Invalid("batch x heads_kv x query tiles x num_splits exceeds int32");

  Params &p = r.params;
  BindBuffers(c, p);  // the contiguous kernel never reads the (null) page table: described as (b, 1)
  p.max_pages = static_cast<int32_t>(max_pages);
  p.splits_cap = static_cast<int32_t>(splits_cap);
  p.qb = static_cast<int32_t>(qb);
  p.ragged = ragged ? 1 : 0;
  p.max_seqlen_q = static_cast<int32_t>(max_seqlen_q);
  p.n_listed = static_cast<int32_t>(n_listed);
  const int64_t q_strides[3] = {s_q * h_q * d, h_q * d, d};
  const int64_t kv_strides[3] = {kv_len * h_k * d, h_k * d, d};
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = q_strides[i];
    p.kv_stride[i] = kv_strides[i];
  }
  p.lse_stride[0] = h_q * s_q;
  p.lse_stride[1] = s_q;
  p.o_accum_stride[0] = qb * s_q * h_q * d;
  p.o_accum_stride[1] = s_q * h_q * d;
  p.o_accum_stride[2] = h_q * d;
  p.o_accum_stride[3] = d;
  p.lse_accum_stride[0] = qb * h_q * s_q;
  p.lse_accum_stride[1] = h_q * s_q;
  p.lse_accum_stride[2] = s_q;
  SetSoftmaxAndWindow(p, softmax, c.window_left, c.window_right, capacity, max_seqlen_q);
  p.num_splits = static_cast<int32_t>(splits);
  // With splits, the last split CTA of each tile merges the tile (one launch) when the device's
  // counter pool serves the call; otherwise the generated Variant::launch runs the family's
  // companion combine kernel after it (its condition: splits > 1 and no counters).
  // FA4_JAX_FUSE_COMBINE=0 forces the latter (tests and A/B timing of both paths).
  p.semaphores = nullptr;
  p.n_semaphores = 0;
  const int64_t counters = b * h_k * m_blocks;
  if (splits > 1 && !ragged && FuseCombineEnabled()) {
    if (int32_t *pool = ZeroedCounters(dev.device, c.stream, counters)) {
      p.semaphores = pool;
      p.n_semaphores = static_cast<int32_t>(counters);
    }
  }
  // A variant with a tile handout (the 16-bit chunk tile: spec.tile_handout) runs a persistent grid of
  // one CTA per SM slot when the call has more tiles than slots: each CTA takes its next tile from one
  // zero-at-rest counter as it finishes one, in the launch's order (the ragged list's longest first),
  // and its next tile's K/V stream in under its current tile's last blocks and stores. Not with split
  // counters: the fused merge walks each CTA's static tiles (so splits > 1 keep one CTA per tile).
  p.tile_counter = nullptr;
  p.n_tile_counters = 0;
  p.max_ctas = std::numeric_limits<int32_t>::max();
  const int64_t slots = int64_t{dev.num_sms} * r.variant->ctas_per_sm;
  if (r.variant->tile_handout && splits == 1 && tiles > slots && DynamicTilesEnabled()) {
    if (int32_t *pool = ZeroedCounters(dev.device, c.stream, 1)) {
      p.tile_counter = pool;
      p.n_tile_counters = 1;
      p.max_ctas = dev.num_sms;
    }
  }
  p.stream = c.stream;
  return ffi::Error::Success();
}

}  // namespace fa4_jax::gen::kvcache
