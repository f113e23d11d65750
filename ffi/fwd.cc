// Resolve of the dense forward family (fa4_jax/ops/fwd/spec.py): the checks the call's signature
// cannot express, the variant for (device compute capability, dtype, head_dim, mask kind, softcap)
// and its Params. The binding, the Call struct, the dtype/rank/alignment checks and both stages are
// generated from the family's CallSignature into fa4_fwd.inc (`python -m fa4_jax.aot`).
//
// All buffers are dense row-major: XLA gives custom-call operands and results their default
// (major-to-minor) layout unless the lowering asks otherwise, and jax.ffi.ffi_call does not.

#include "runtime.h"

#include "fa4_fwd.inc"  // generated: Params, Key, kVariants, Call, Resolved, the binding

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <limits>
#include <string>

namespace fa4_jax::gen::fwd {
namespace {
ffi::Error Invalid(const std::string &msg) { return InvalidArgument(kTarget, msg); }
}  // namespace

ffi::Error Resolve(const Call &c, Resolved &r) {
  auto qd = c.q.dimensions(), kd = c.k.dimensions(), vd = c.v.dimensions();
  auto od = c.o.dimensions(), ld = c.lse.dimensions();
  const int64_t b = qd[0], s_q = qd[1], h_q = qd[2], d = qd[3];
  const int64_t s_k = kd[1], h_k = kd[2];
  if (kd[0] != b || kd[3] != d || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != d)
    return Invalid("k and v must both be (batch, seqlen_k, heads_kv, head_dim) with q's batch and "
                   "head_dim; got q" + DimsText(qd) + " k" + DimsText(kd) + " v" + DimsText(vd));
  if (od[0] != b || od[1] != s_q || od[2] != h_q || od[3] != d)
    return Invalid("o must have q's shape " + DimsText(qd) + "; got " + DimsText(od));
  if (ld[0] != b || ld[1] != h_q || ld[2] != s_q)
    return Invalid("lse must be (batch, heads_q, seqlen_q) = (" + std::to_string(b) + ", " +
                   std::to_string(h_q) + ", " + std::to_string(s_q) + "); got " + DimsText(ld));
  if (h_k == 0 || h_q % h_k != 0)
    return Invalid("heads_q (" + std::to_string(h_q) + ") must be a multiple of heads_kv (" +
                   std::to_string(h_k) + ")");
  for (int64_t x : {b, s_q, s_k, h_q, h_k})
    if (!FitsInt32(x)) return Invalid("a dimension exceeds int32: q" + DimsText(qd) + " k" + DimsText(kd));

  if (c.sinks.dimensions()[0] != h_q)
    return Invalid("sinks must be float32 (heads_q,) = (" + std::to_string(h_q) + ",); got " +
                   DimsText(c.sinks.dimensions()));
  DType dtype;
  SoftmaxArgs softmax;
  if (ffi::Error err = ResolveAttention(kTarget, c, dtype, softmax); err.failure()) return err;

  // Empty outputs: nothing to compute (and a zero-size grid would be a launch error).
  if (b == 0 || s_q == 0 || h_q == 0) {
    r.empty = true;
    return ffi::Error::Success();
  }
  if (s_k == 0) return Invalid("seqlen_k must be >= 1 when seqlen_q >= 1");

  DeviceInfo dev;
  const Mask mask = MaskKindOf<Mask>(c.window_left, c.window_right);
  Key key{0, dtype, static_cast<int>(d), mask, c.softcap > 0, 0};
  // Short causal problems take their head dim's short-problem tile where the library has one for
  // this device and max(s_q, s_k) is within the tile's bound (spec.SHORT_TILES: hd64 and hd96 on
  // sm90); everything else the head dim's default tile.
  for (size_t i = 0; i < std::size(kShortTileHeadDims); ++i) {
    if (mask != Mask::kCausal || d != kShortTileHeadDims[i] || std::max(s_q, s_k) > kShortTileMaxSeqlens[i])
      continue;
    if (ffi::Error err = QueryDevice(kTarget, dev); err.failure()) return err;
    Key short_key = key;
    short_key.arch = dev.cc;
    short_key.tile_m = static_cast<int>(kShortTileMs[i]);
    if (Find(short_key) != nullptr) key.tile_m = short_key.tile_m;
  }
  if (ffi::Error err = PickVariant(key, dev, r); err.failure()) return err;

  Params &p = r.params;
  BindBuffers(c, p);
  const int64_t q_strides[3] = {s_q * h_q * d, h_q * d, d};
  const int64_t kv_strides[3] = {s_k * h_k * d, h_k * d, d};
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = p.o_stride[i] = q_strides[i];
    p.k_stride[i] = p.v_stride[i] = kv_strides[i];
  }
  p.lse_stride[0] = h_q * s_q;
  p.lse_stride[1] = s_q;
  SetSoftmaxAndWindow(p, softmax, c.window_left, c.window_right, s_k, s_q);
  // Persistent grid (one CTA per SM: the kernels use most of the shared memory and registers,
  // each CTA walks tiles c, c + grid, ...) only where every tile has about the same work: the
  // static round robin cannot balance causal tiles, where one CTA per tile lets the hardware hand
  // out tiles as SMs free up, nor windows whose ramp-up at the sequence start is a large share of
  // the tiles; full attention and short windows gain. Measurements: docs/PERF.md, "persistent CTAs" (2026-11-30).
  const bool uniform_tiles =
      mask == Mask::kFull || (mask == Mask::kLocal && c.window_left >= 0 && c.window_right >= 0 &&
                              int64_t{c.window_left} + c.window_right <= s_k / 8);
  p.max_ctas = uniform_tiles ? dev.num_sms : std::numeric_limits<int32_t>::max();
  // Tiles of unequal work (causal, long windows) on a persistent grid after all, when the device's
  // counter pool serves the call: each CTA takes its next tile from one zero-at-rest counter as it
  // finishes one (kernels/tile_scheduler.py TileHandout), in the same longest-first order, and its next
  // tile's loads overlap its current tile's last blocks and epilogue. Otherwise one CTA per tile.
  // FA4_JAX_DYNAMIC_TILES=0 forces the latter (tests and A/B timing of both paths).
  p.tile_counter = nullptr;
  p.n_tile_counters = 0;
  if (!uniform_tiles && DynamicTilesEnabled()) {
    if (int32_t *pool = ZeroedCounters(dev.device, c.stream, 1)) {
      p.tile_counter = pool;
      p.n_tile_counters = 1;
      p.max_ctas = dev.num_sms;
    }
  }
  p.stream = c.stream;
  return ffi::Error::Success();
}

}  // namespace fa4_jax::gen::fwd
