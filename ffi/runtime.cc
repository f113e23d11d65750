// Shared runtime of the FFI handlers (see runtime.h) and the library's exported C ABI, which
// fa4_jax/core/library.py reads with ctypes:
//   fa4_jax_num_targets / fa4_jax_target_name(i)     the FFI targets this build has
//   fa4_jax_ffi_handler(target, stage)                 their XLA_FFI_Handler* per stage
//   fa4_jax_num_variants / fa4_jax_variant_symbol(i)  every kernel variant, all families
//   fa4_jax_prepare_variant(symbol, device, err, n)   load one variant on one device (0 = ok)
// Everything else in the library stays hidden (ffi/fa4_jax.map).

#include "runtime.h"

#include <cstdlib>
#include <cstring>

#include "fa4_registry.inc"  // generated: kFamilies, one row per kernel family in this build

#define FA4_JAX_EXPORT extern "C" __attribute__((visibility("default")))

namespace fa4_jax {

namespace {

// Fault injection for tests: FA4_JAX_FAIL_MODULE_LOAD=all (or a substring of a variant's or a
// companion's symbol, e.g. fa4_combine_: a variant then fails on its companion) makes loading fail
// as a broken driver or an exclusive-process GPU would. Read at every load attempt (loads are rare:
// once per variant and device), so a test can switch it off again.
bool SimulatedLoadFailure(const char *symbol) {
  const char *v = std::getenv("FA4_JAX_FAIL_MODULE_LOAD");
  if (v == nullptr || *v == '\0') return false;
  return std::strcmp(v, "all") == 0 || std::strstr(symbol, v) != nullptr;
}

// Per-device attribute caches (0 = not queried yet): execute asks on every call.
std::atomic<int> g_cc_cache[kMaxDevices];
std::atomic<int> g_sm_cache[kMaxDevices];

int CachedAttribute(std::atomic<int> *cache, int device, int (*query)(int)) {
  if (device >= 0 && device < kMaxDevices) {
    if (int cached = cache[device].load(std::memory_order_relaxed); cached > 0) return cached;
  }
  const int value = query(device);
  if (value > 0 && device >= 0 && device < kMaxDevices) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

}  // namespace

std::string CudaErrorText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

std::string DimsText(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

std::string EnsureLoaded(const VariantInfo &v, int device) {
  if (device < 0 || device >= kMaxDevices)
    return "CUDA device " + std::to_string(device) + " is out of range (this library serves devices 0.." +
           std::to_string(kMaxDevices - 1) + ")";
  if (IsLoaded(v, device)) return "";
  for (int i = 0; i < v.num_companions; ++i)  // their own modules and locks; they have no companions
    if (std::string err = EnsureLoaded(*v.companions[i], device); !err.empty()) return err;
  Module &m = *v.module;
  std::lock_guard<std::mutex> lock(m.mu);
  if (IsLoaded(v, device)) return "";
  if (SimulatedLoadFailure(v.symbol))
    return std::string("loading ") + v.symbol + " on device " + std::to_string(device) +
           " failed: simulated by FA4_JAX_FAIL_MODULE_LOAD";
  if (!m.initialized) {
    if (cudaError_t err = m.init(m.state); err != cudaSuccess)
      return std::string("loading the kernel library of ") + v.symbol + " failed: " + CudaErrorText(err);
    m.initialized = true;
  }
  if (cudaError_t err = m.load_to_device(m.state, device); err != cudaSuccess)
    return std::string("loading ") + v.symbol + " on device " + std::to_string(device) +
           " failed: " + CudaErrorText(err);
  m.devices.fetch_or(uint64_t{1} << device, std::memory_order_acq_rel);
  return "";
}

int CurrentDevice() {
  int dev = -1;
  cudaError_t err = cudaGetDevice(&dev);
  return err == cudaSuccess ? dev : -static_cast<int>(err);
}

int ComputeCapability(int device) {
  return CachedAttribute(g_cc_cache, device, [](int dev) {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return err == cudaSuccess ? major * 10 + minor : -static_cast<int>(err);
  });
}

int MultiprocessorCount(int device) {
  return CachedAttribute(g_sm_cache, device, [](int dev) {
    int n = 0;
    cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return err == cudaSuccess ? n : -static_cast<int>(err);
  });
}

namespace {
std::atomic<int32_t *> g_counters[kMaxDevices];
std::mutex g_counters_mu;

// cudaMalloc + zeroing on a private stream, waited for: the pool is zero before any kernel can see it.
int32_t *AllocateZeroedCounters() {
  void *ptr = nullptr;
  const size_t bytes = sizeof(int32_t) * kCounterPoolSize;
  if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  cudaStream_t s = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(ptr, 0, bytes, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (s != nullptr) (void)cudaStreamDestroy(s);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaFree(ptr);
    return nullptr;
  }
  return static_cast<int32_t *>(ptr);
}
}  // namespace

int32_t *ZeroedCounters(int device, cudaStream_t stream, int64_t count) {
  if (device < 0 || device >= kMaxDevices || count > kCounterPoolSize) return nullptr;
  if (int32_t *pool = g_counters[device].load(std::memory_order_acquire)) return pool;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  std::lock_guard<std::mutex> lock(g_counters_mu);
  if (int32_t *pool = g_counters[device].load(std::memory_order_acquire)) return pool;
  // Never freed: a CUDA graph captured with the pool's address may replay at any later time.
  int32_t *pool = AllocateZeroedCounters();
  if (pool != nullptr) g_counters[device].store(pool, std::memory_order_release);
  return pool;
}

ffi::Error PrepareForLaunch(const char *target, const VariantInfo &v, cudaStream_t stream, int device) {
  if (IsLoaded(v, device)) return ffi::Error::Success();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess)
    return ffi::Error::Internal(std::string(target) + ": " + v.symbol +
                                ": cudaStreamIsCapturing failed: " + CudaErrorText(err));
  if (capture != cudaStreamCaptureStatusNone)
    return ffi::Error::Internal(
        std::string(target) + ": " + v.symbol + " is not loaded on device " + std::to_string(device) +
        " and the stream is being captured into a CUDA graph, where loading is illegal (the handler's "
        "initialize stage did not run first); run the computation once without command buffers "
        "(XLA_FLAGS=--xla_gpu_enable_command_buffer=)");
  if (std::string err = EnsureLoaded(v, device); !err.empty())
    return ffi::Error::Internal(std::string(target) + ": " + v.symbol + " cannot run: " + err);
  return ffi::Error::Success();
}

}  // namespace fa4_jax

// ---- exported C ABI -----------------------------------------------------------------------------

namespace {

using fa4_jax::gen::kFamilies;
using fa4_jax::gen::kNumFamilies;

const fa4_jax::VariantInfo *VariantAt(int i) {
  if (i < 0) return nullptr;
  for (const auto &f : kFamilies) {
    if (i < *f.num_variants) return &f.variants[i];
    i -= *f.num_variants;
  }
  return nullptr;
}

}  // namespace

FA4_JAX_EXPORT int fa4_jax_num_targets(void) { return kNumFamilies; }

FA4_JAX_EXPORT const char *fa4_jax_target_name(int i) {
  return (i >= 0 && i < kNumFamilies) ? kFamilies[i].target : nullptr;
}

FA4_JAX_EXPORT void *fa4_jax_ffi_handler(const char *target, const char *stage) {
  if (target == nullptr || stage == nullptr) return nullptr;
  for (const auto &f : kFamilies) {
    if (std::strcmp(f.target, target) != 0) continue;
    if (std::strcmp(stage, "initialize") == 0) return reinterpret_cast<void *>(f.handlers->initialize);
    if (std::strcmp(stage, "execute") == 0) return reinterpret_cast<void *>(f.handlers->execute);
  }
  return nullptr;
}

FA4_JAX_EXPORT int fa4_jax_num_variants(void) {
  int n = 0;
  for (const auto &f : kFamilies) n += *f.num_variants;
  return n;
}

FA4_JAX_EXPORT const char *fa4_jax_variant_symbol(int i) {
  const fa4_jax::VariantInfo *v = VariantAt(i);
  return v ? v->symbol : nullptr;
}

// Loads `symbol` on CUDA device `device` (the ordinal of this process's runtime, i.e. jax's
// local_hardware_id). Returns 0, or nonzero with the reason in err (NUL-terminated, truncated).
// Python calls this before choosing the kernel, so "can run here" includes "loads here".
FA4_JAX_EXPORT int fa4_jax_prepare_variant(const char *symbol, int device, char *err, int err_len) {
  std::string msg;
  const fa4_jax::VariantInfo *found = nullptr;
  for (int i = 0; const fa4_jax::VariantInfo *v = VariantAt(i); ++i)
    if (symbol != nullptr && std::strcmp(v->symbol, symbol) == 0) found = v;
  if (found == nullptr) {
    msg = std::string("this library has no variant ") + (symbol ? symbol : "(null)");
  } else {
    msg = fa4_jax::EnsureLoaded(*found, device);
  }
  if (msg.empty()) return 0;
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, msg.c_str(), static_cast<size_t>(err_len) - 1);
    err[err_len - 1] = '\0';
  }
  return 1;
}
