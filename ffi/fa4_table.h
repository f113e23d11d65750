// Types shared by the FFI handler (ffi/fa4_jax_ffi.cc) and the dispatch table that
// `python -m fa4_jax.aot` generates (fa4_variants.inc). Include this before fa4_variants.inc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fa4_jax {

enum class DType : int { kBF16 = 0, kFP16 = 1 };

// Everything one forward launch needs, in elements (not bytes). Each generated launch thunk copies
// these into the tensor structs of its kernel's exported C wrapper, in the mode order that
// TENSOR_ABI in fa4_jax/aot.py describes, so the handler itself never depends on that order.
struct FwdParams {
  void *q;  // non-const only because the exported structs hold `void *data`; q/k/v are read-only
  void *k;
  void *v;
  void *o;
  float *lse;
  int32_t b, s_q, s_k, h_q, h_k;
  int64_t q_stride[3];  // {batch, seq, head}; the head_dim stride is a static 1 in the kernel
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t o_stride[3];
  int64_t lse_stride[2];  // {batch, head}; the seq stride is a static 1
  float softmax_scale_log2;
  cudaStream_t stream;
};

using LaunchFn = int32_t (*)(void *module, const FwdParams &params);
using LoadFn = cudaError_t (*)(void *module);

// One row of the generated table: the dispatch key, the two thunks and the kernel's module state.
struct VariantEntry {
  const char *symbol;  // fa4_jax.variants.FwdVariant.symbol, e.g. "fa4_fwd_sm90_bf16_hd128_causal"
  int arch;            // compute capability major*10+minor the cubin runs on (sm_90a -> 90)
  DType dtype;
  int head_dim;
  bool causal;
  LaunchFn launch;
  LoadFn load;
  void *module;  // <symbol>_Kernel_Module_t, owned by the generated code
};

namespace detail {
// The exported headers report cudaLibraryLoadData/... failures through CUTE_DSL_CUDA_ERROR_CHECK,
// which by default printf()s and carries on. The handler must turn such a failure into an
// ffi::Error instead, so the macro below records the first error here and returns from the
// (void) load function; the generated load thunk resets and reads it around each call.
inline thread_local cudaError_t load_error = cudaSuccess;
}  // namespace detail

}  // namespace fa4_jax

#ifdef CUTE_DSL_CUDA_ERROR_CHECK
#error "CUTE_DSL_CUDA_ERROR_CHECK is already defined; ffi/fa4_table.h must be included first"
#endif
#define CUTE_DSL_CUDA_ERROR_CHECK(err)                \
  do {                                                \
    cudaError_t fa4_jax_err_ = (err);                 \
    if (fa4_jax_err_ != cudaSuccess) {                \
      ::fa4_jax::detail::load_error = fa4_jax_err_;   \
      return;                                         \
    }                                                 \
  } while (0)
