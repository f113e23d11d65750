// Resolve of the varlen family (fa4_jax/ops/varlen/spec.py): the checks its CallSignature cannot
// express, the variant and its Params. The binding, the Call struct, the dtype/rank/alignment checks
// and both stages are generated into fa4_varlen.inc.
//
// Not checkable without reading device memory, and what the kernel assumes: offsets are
// non-decreasing, cu_seqlens_q[0] = 0 and cu_seqlens_q[b] <= total_q, every sequence has at most
// max_seqlen_q queries (rows past it are not computed), cu_seqlens_k[b] + seqused_k[b] <= total_k.
// Violations give unspecified results but no out-of-bounds access: TMA reads rows outside the
// tensors as zeros, and the kernel drops every write to a row outside [0, total_q).

#include "runtime.h"

#include "fa4_varlen.inc"  // generated: Params, Key, kVariants, Call, Resolved, the binding

#include <algorithm>
#include <limits>
#include <string>

namespace fa4_jax::gen::varlen {
namespace {

ffi::Error Invalid(const std::string &msg) { return InvalidArgument(kTarget, msg); }

}  // namespace

ffi::Error Resolve(const Call &c, Resolved &r) {
  auto qd = c.q.dimensions(), kd = c.k.dimensions(), vd = c.v.dimensions(), od = c.o.dimensions(),
       ld = c.lse.dimensions();
  const int64_t total_q = qd[0], h_q = qd[1], d = qd[2], total_k = kd[0], h_k = kd[1];
  if (kd[2] != d || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != d)
    return Invalid("k and v must both be (total_k, heads_kv, head_dim) with q's head_dim");
  if (od[0] != total_q || od[1] != h_q || od[2] != d) return Invalid("o must have q's shape");
  if (ld[0] != h_q || ld[1] != total_q) return Invalid("lse must be (heads_q, total_q)");
  if (h_k == 0 || h_q % h_k != 0) return Invalid("heads_q must be a multiple of heads_kv");
  const int64_t b = c.cu_seqlens_q.dimensions()[0] - 1;
  if (b < 0 || c.cu_seqlens_k.dimensions()[0] != b + 1)
    return Invalid("cu_seqlens_q and cu_seqlens_k must be int32 (batch + 1,); got " +
                   DimsText(c.cu_seqlens_q.dimensions()) + " and " + DimsText(c.cu_seqlens_k.dimensions()));
  if (c.seqused_k.dimensions()[0] != b)
    return Invalid("seqused_k must be int32 (batch,); got " + DimsText(c.seqused_k.dimensions()));
  if (c.sinks.dimensions()[0] != h_q) return Invalid("sinks must be float32 (heads_q,)");
  for (int64_t x : {total_q, total_k, h_q, h_k, b + 1})
    if (!FitsInt32(x)) return Invalid("a dimension exceeds int32");
  DType dtype;
  SoftmaxArgs softmax;
  if (ffi::Error err = ResolveAttention(kTarget, c, dtype, softmax); err.failure()) return err;
  if (c.max_seqlen_q < 1) return Invalid("max_seqlen_q must be >= 1; got " + std::to_string(c.max_seqlen_q));
  if (total_q == 0 || h_q == 0) {
    r.empty = true;
    return ffi::Error::Success();
  }

  DeviceInfo dev;
  const Mask mask = MaskKindOf<Mask>(c.window_left, c.window_right);
  if (ffi::Error err = PickVariant({0, dtype, static_cast<int>(d), mask, c.softcap > 0}, dev, r); err.failure())
    return err;
  // Tiles: m-blocks of max_seqlen_q (at most 64 rows each) x heads x (batch + 1) must fit int32.
  if (!FitsInt32((int64_t{c.max_seqlen_q} + 63) / 64 * h_q * (b + 1)))
    return Invalid("max_seqlen_q x heads x batch exceeds the grid's int32 range");

  Params &p = r.params;
  BindBuffers(c, p);
  p.q_stride[0] = h_q * d;
  p.q_stride[1] = d;
  p.kv_stride[0] = h_k * d;
  p.kv_stride[1] = d;
  const int64_t max_q = std::min<int64_t>(c.max_seqlen_q, total_q);
  SetSoftmaxAndWindow(p, softmax, c.window_left, c.window_right, total_k, total_q);
  p.max_seqlen_q = static_cast<int32_t>(max_q);
  // Persistent CTAs (one per SM) only without a mask, where tiles of one sequence carry equal work;
  // causal/local tiles are handed out by the hardware as SMs free up (see ffi/fwd.cc).
  p.max_ctas = mask == Mask::kFull ? dev.num_sms : std::numeric_limits<int32_t>::max();
  p.stream = c.stream;
  return ffi::Error::Success();
}

}  // namespace fa4_jax::gen::varlen
