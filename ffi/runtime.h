// Shared runtime of the XLA FFI handlers: module loading per device, device queries, error text,
// and the types the generated family tables (fa4_<family>.inc, from `python -m fa4_jax.aot`) use.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fa4_jax {

namespace ffi = ::xla::ffi;

enum class DType : int { kBF16 = 0, kFP16 = 1 };

inline const char *DTypeName(DType d) { return d == DType::kBF16 ? "bf16" : "fp16"; }
inline std::string ArchName(int cc) { return "sm" + std::to_string(cc); }
inline const char *BoolName(bool b) { return b ? "true" : "false"; }

// One exported kernel's module. `init` loads the embedded cubin as a context-independent CUDA
// library (no device involved); `load_to_device` resolves its kernels on one device and sets their
// attributes there. Both are generated thunks around the exported object's own functions. The
// loader keeps which devices are ready; a failure is not remembered, so a later call retries.
struct Module {
  using InitFn = cudaError_t (*)(void *state);
  using LoadFn = cudaError_t (*)(void *state, int device);

  Module(InitFn init, LoadFn load_to_device, void *state)
      : init(init), load_to_device(load_to_device), state(state) {}

  const InitFn init;
  const LoadFn load_to_device;
  void *const state;  // <symbol>_Kernel_Module_t
  std::mutex mu;
  bool initialized = false;           // guarded by mu
  std::atomic<uint64_t> devices{0};  // bit d: ready on CUDA device d (d < 64)
};

// What the library-wide registry knows of each variant (the family tables know more).
struct VariantInfo {
  const char *symbol;
  Module *module;
  // Kernels compiled apart that this variant's launch may run after its own (families.base.Companion,
  // e.g. the KV-cache split combine): loaded on a device before the variant itself, so a variant
  // that is ready there has them ready too.
  const VariantInfo *const *companions = nullptr;
  int num_companions = 0;
};

// A family's FFI handler stages, defined by its hand-written ffi/<family>.cc.
struct FamilyHandlers {
  XLA_FFI_Handler *initialize;
  XLA_FFI_Handler *execute;
};

constexpr int kMaxDevices = 64;

// Loads `v` (its companions first) on `device` if it is not ready yet. Returns "" on success, else
// why it failed.
// Illegal during CUDA-graph capture (module loading is); see PrepareForLaunch.
std::string EnsureLoaded(const VariantInfo &v, int device);

inline bool IsLoaded(const VariantInfo &v, int device) {
  return device >= 0 && device < kMaxDevices &&
         (v.module->devices.load(std::memory_order_acquire) >> device & 1u);
}

// The device XLA made current for this call (its stream's device), or a negative cudaError_t.
// Not cudaStreamGetDevice: that one fails with cudaErrorStreamCaptureUnsupported while XLA captures
// the call into a command buffer (seen with jax 0.11.2), cudaGetDevice does not.
int CurrentDevice();
// major*10+minor of `device` (cached), or a negative cudaError_t.
int ComputeCapability(int device);
// The number of SMs of `device` (cached), or a negative cudaError_t: persistent kernels' grid size.
int MultiprocessorCount(int device);

// A per-device pool of int32 counters that are zero at rest: a kernel that counts its CTAs in (the
// KV-cache family's fused split combine) puts every counter it used back to zero before it ends, so
// the pool is zeroed once, when it is allocated. Returns the pool of `device`, or null when it
// cannot hold `count` counters, or does not exist yet and cannot be made now (the stream is being
// captured into a CUDA graph; the handlers' initialize stage, run before any capture, normally made
// it) -- the caller then takes a path without counters. Calls on one device share the pool, so
// they must run in stream order, as XLA runs a device's computations on its one compute stream.
int32_t *ZeroedCounters(int device, cudaStream_t stream, int64_t count);
constexpr int64_t kCounterPoolSize = int64_t{1} << 16;  // 256 KB per device

std::string CudaErrorText(cudaError_t e);
std::string DimsText(ffi::AnyBuffer::Dimensions dims);
inline bool Aligned(const void *p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Makes `v` ready on the stream's device before a launch: already loaded -> nothing; otherwise
// loads it, unless the stream is being captured into a CUDA graph (loading is illegal there; the
// initialize stage, which XLA runs before any capture, normally did it already).
ffi::Error PrepareForLaunch(const char *target, const VariantInfo &v, cudaStream_t stream, int device);

// Runs `launch` (the generated Variant::launch: one exported wrapper, then its companions') and turns
// its return code or a launch error into an ffi::Error naming the kernel: `launch(&failed)` points
// `failed` at the symbol of the wrapper it is about to call (initially `symbol`, the variant's).
// Clears this library's own (static) CUDA runtime's last error first, so only this launch is
// reported; XLA's runtime state is not touched.
template <typename Launch>
ffi::Error CheckedLaunch(const char *target, const char *symbol, Launch &&launch) {
  (void)cudaGetLastError();
  const char *failed = symbol;
  const int32_t ret = launch(&failed);
  cudaError_t err = ret != 0 ? static_cast<cudaError_t>(ret) : cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  std::string which = failed == symbol ? std::string(symbol) : std::string(failed) + " (after " + symbol + ")";
  return ffi::Error::Internal(std::string(target) + ": " + which + ": kernel launch failed: " + CudaErrorText(err));
}

}  // namespace fa4_jax
