// What every family's FFI handler does the same way: argument checks with the target's name in the
// message, the dtype and scale/softcap rules, device queries, and the two stages' common tail
// (initialize loads the variant on the device; execute makes sure it is loaded and launches it).
// Included by each family's generated fa4_<family>.inc (fa4_jax/aot/codegen.py).
#pragma once

#include "runtime.h"

#include "fa4_shared.inc"  // generated: kMaxSoftmaxScale, kMaxSoftcap (fa4_jax/families/base.py)

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>

namespace fa4_jax {

inline ffi::Error InvalidArgument(const char *target, const std::string &msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

inline bool FitsInt32(int64_t x) { return x >= 0 && x <= std::numeric_limits<int32_t>::max(); }

// A handler's switch for tests and A/B timing of two launch paths: on unless the variable is "0".
inline bool EnvSwitchOn(const char *name) {
  const char *v = std::getenv(name);
  return v == nullptr || std::string(v) != "0";
}

// Persistent grids that take their tiles from a zero-at-rest counter (kernels/tile_scheduler.py
// TileHandout: dense causal/windowed calls, the KV-cache chunk tile). FA4_JAX_DYNAMIC_TILES=0 gives
// one CTA per tile instead.
inline bool DynamicTilesEnabled() { return EnvSwitchOn("FA4_JAX_DYNAMIC_TILES"); }

// The kernels take scales as float32 and exponentiate with exp2: each must be a positive normal
// float32 (a denormal is flushed to zero on the GPU; inf would turn every row into NaN).
inline bool UsableF32(double x) {
  const float f = static_cast<float>(x);
  return std::isfinite(f) && f >= std::numeric_limits<float>::min();
}

// The mask kind for window bounds (-1 = unbounded); fa4_jax.ops.fwd.spec.mask_kind says the same in
// Python. `MaskEnum` is a family's generated Mask (kFull, kCausal, kLocal).
template <typename MaskEnum>
MaskEnum MaskKindOf(int32_t left, int32_t right) {
  if (left < 0 && right < 0) return MaskEnum::kFull;
  if (left < 0 && right == 0) return MaskEnum::kCausal;
  return MaskEnum::kLocal;
}

// q's dtype (bf16 or f16); the generated checks made every other "input" buffer share it.
inline ffi::Error ResolveDType(const char *target, ffi::DataType q, DType &out) {
  if (q == ffi::DataType::BF16) {
    out = DType::kBF16;
  } else if (q == ffi::DataType::F16) {
    out = DType::kFP16;
  } else {
    return InvalidArgument(target, "q must be bfloat16 or float16");
  }
  return ffi::Error::Success();
}

// The kernels' softmax arguments: with a cap they compute tanh(s * scale / cap) and exponentiate
// with cap * log2(e), else they exponentiate s with scale * log2(e).
struct SoftmaxArgs {
  float scale_log2;
  float softcap_prescale;
};

inline std::string NumberText(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

inline ffi::Error ResolveSoftmax(const char *target, double scale, double cap, SoftmaxArgs &out) {
  constexpr double kLog2e = 1.4426950408889634;
  if (!(UsableF32(scale) && UsableF32(scale * kLog2e) && scale <= kMaxSoftmaxScale))
    return InvalidArgument(target, "softmax_scale must be a positive normal float32 <= " +
                                       NumberText(kMaxSoftmaxScale) + "; got " + std::to_string(scale));
  if (!(std::isfinite(cap) && cap >= 0 && cap <= kMaxSoftcap) ||
      (cap > 0 && !(UsableF32(cap * kLog2e) && UsableF32(scale / cap))))
    return InvalidArgument(target, "softcap must be 0 or a positive float32 with softcap * log2(e) and "
                                   "softmax_scale / softcap normal float32 numbers; got " + std::to_string(cap));
  out.scale_log2 = static_cast<float>((cap > 0 ? cap : scale) * kLog2e);
  out.softcap_prescale = cap > 0 ? static_cast<float>(scale / cap) : 1.0f;
  return ffi::Error::Success();
}

inline ffi::Error CheckWindow(const char *target, int32_t left, int32_t right) {
  if (left < -1 || right < -1)
    return InvalidArgument(target, "window bounds must be >= -1 (-1 = unbounded); got (" + std::to_string(left) +
                                       ", " + std::to_string(right) + ")");
  return ffi::Error::Success();
}

// What every attention family resolves alike from its generated Call: q's dtype, the softmax
// arguments, the window bounds.
template <typename Call>
ffi::Error ResolveAttention(const char *target, const Call &c, DType &dtype, SoftmaxArgs &softmax) {
  if (ffi::Error err = ResolveDType(target, c.q.element_type(), dtype); err.failure()) return err;
  if (ffi::Error err = ResolveSoftmax(target, c.softmax_scale, c.softcap, softmax); err.failure()) return err;
  return CheckWindow(target, c.window_left, c.window_right);
}

// The kernels' softmax and window arguments. An unbounded side becomes a bound that covers every key:
// left = `keys` reaches key 0 from every row, right = `queries` reaches the last key (and keeps the
// kernel's index arithmetic in int32).
template <typename Params>
void SetSoftmaxAndWindow(Params &p, const SoftmaxArgs &softmax, int32_t left, int32_t right, int64_t keys,
                         int64_t queries) {
  p.softmax_scale_log2 = softmax.scale_log2;
  p.softcap_prescale = softmax.softcap_prescale;
  p.window_left = static_cast<int32_t>(left < 0 ? keys : std::min<int64_t>(left, keys));
  p.window_right = static_cast<int32_t>(right < 0 ? queries : std::min<int64_t>(right, queries));
}

// The current device, its compute capability and SM count.
struct DeviceInfo {
  int device = -1;
  int cc = -1;
  int num_sms = -1;
};

inline ffi::Error QueryDevice(const char *target, DeviceInfo &d) {
  d.device = CurrentDevice();
  if (d.device < 0)
    return ffi::Error::Internal(std::string(target) + ": cudaGetDevice failed: " +
                                CudaErrorText(static_cast<cudaError_t>(-d.device)));
  for (int *x : {&d.cc, &d.num_sms}) {
    *x = x == &d.cc ? ComputeCapability(d.device) : MultiprocessorCount(d.device);
    if (*x < 0)
      return ffi::Error::Internal(std::string(target) + ": querying device " + std::to_string(d.device) +
                                  " failed: " + CudaErrorText(static_cast<cudaError_t>(-*x)));
  }
  return ffi::Error::Success();
}

// The error for a key the library has no variant for.
inline ffi::Error NoVariant(const char *target, const std::string &key, int device, const std::string &built) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string(target) + ": no kernel for " + key + " on device " +
                                                        std::to_string(device) + "; this library was built with: " +
                                                        built);
}

// The error for a call that did not opt in (attribute unvalidated_ok, set by implementation="fa4")
// on a device whose kernels no hardware run has validated yet (families.VALIDATED_ARCHES): typically
// a program exported with implementation=None and served on such a GPU.
inline ffi::Error NotValidated(const char *target, const char *symbol, int device) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string(target) + ": " + symbol + " would run on device " + std::to_string(device) +
                        ", whose fa4_jax kernels have not been validated on hardware yet; this call did not opt in. "
                        "Lower or export the program with implementation=\"fa4\" to run them (compare with "
                        "implementation=\"xla\" first), or with implementation=\"xla\" or \"cudnn\"");
}

// The common tail of both stages (the generated Stage of each family calls it after the checks).
// Initialize (run by XLA before any CUDA-graph capture) loads the variant on the device. Execute
// loads it if needed (refused under capture) and launches.
template <ffi::ExecutionStage kStage, typename Variant, typename Launch>
ffi::Error FinishStage(const char *target, const Variant &variant, int device, cudaStream_t stream, Launch &&launch) {
  if constexpr (kStage == ffi::ExecutionStage::kInitialize) {
    if (std::string err = EnsureLoaded(variant.info(), device); !err.empty())
      return ffi::Error::Internal(std::string(target) + ": " + variant.symbol + " cannot run: " + err);
    return ffi::Error::Success();
  } else {
    if (ffi::Error err = PrepareForLaunch(target, variant.info(), stream, device); err.failure()) return err;
    return CheckedLaunch(target, variant.symbol, launch);
  }
}

}  // namespace fa4_jax
