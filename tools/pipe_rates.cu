// Issue rates of the instructions the attention kernels' non-gemm work is made of, per SM and clock,
// alone and in pairs (tools/pipe_rates.py builds and runs it; docs/PERF.md records what it said).
//
// Why: several open levers turn on which pipe an instruction runs on and how fast. The FP8 chunk
// tile's widening converts e4m3 pairs with F2FP.F16.E4M3.UNPACK_B (issue 17: is that conversion the
// bound, and would PRMT/LOP3/HMUL2 on other pipes be faster?); softcap costs a MUFU.TANH per score
// beside the MUFU.EX2 (issue 18: does tanh.approx.f16x2 halve that, and what do the packing
// conversions around it cost?); the consumers pack P with F2FP.BF16.F32.PACK_AB (does that share a
// pipe with MUFU or with the e4m3 widening?). Vendor tables do not list these SASS forms.
//
// Method: one CTA per SM (dynamic shared memory forces it), W warps per SM sub-partition; each
// thread runs CHAINS independent dependency chains of one operation (or of two, alternating by
// chain) for ITERS rounds, so that issue rate, not latency, bounds it at W >= 2. Each CTA reads
// clock64 around its loop after a barrier: rates are per SM cycle, whatever the clock. Each chain
// feeds an operation its own previous result (no value is constant, so nothing folds); the chains
// are xor-ed into one word per thread and stored, so nothing is dead.
//
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/pipe_rates.cu -o pipe_rates
// Run:   ./pipe_rates [warps per sub-partition ...]   (default 1 2 4 8)

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int kChains = 8;
constexpr int kIters = 2048;
constexpr int kUnroll = 4;
constexpr int kSmemBytes = 160 * 1024;  // more than half an SM: one CTA per SM

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t err_ = (x);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// Each operation: a struct with its name, the SASS opcode it should compile to (tests/test_pipe_rates.py
// checks), how many values one operation produces, and apply(r): the operation on r, in place (PTX
// text with r as %0). Packed operations keep their 32-bit result; those with a 16-bit input take its
// low half; those with f32 inputs read r's bits as one.
#define OP(Struct, ptx_name, sass_opcode, n_values, ptx)                       \
  struct Struct {                                                              \
    static constexpr const char* name = ptx_name;                              \
    static constexpr const char* sass = sass_opcode;                           \
    static constexpr int values = n_values;                                    \
    __device__ static void apply(uint32_t& r) { asm volatile(ptx : "+r"(r)); } \
  };

// The softmax's exponential and softcap's tanh, and their packed forms.
OP(Ex2, "ex2.approx.ftz.f32", "MUFU.EX2", 1, "ex2.approx.ftz.f32 %0, %0;")
OP(Tanh, "tanh.approx.f32", "MUFU.TANH", 1, "tanh.approx.f32 %0, %0;")
OP(TanhF16x2, "tanh.approx.f16x2", "MUFU.TANH.F16", 2, "tanh.approx.f16x2 %0, %0;")
OP(TanhBf16x2, "tanh.approx.bf16x2", "MUFU.TANH.BF16", 2, "tanh.approx.bf16x2 %0, %0;")
OP(Ex2F16x2, "ex2.approx.f16x2", "MUFU.EX2.F16", 2, "ex2.approx.f16x2 %0, %0;")
OP(Ex2Bf16x2, "ex2.approx.ftz.bf16x2", "MUFU.EX2.BF16", 2, "ex2.approx.ftz.bf16x2 %0, %0;")
// The FP8 widening's conversion; the consumers' packing of P (bf16 q; fp16 q and f16x2 MUFU operands);
// unpacking an f16 for fp32 arithmetic.
OP(E4m3x2ToF16x2, "cvt.rn.f16x2.e4m3x2", "F2FP.F16.E4M3.UNPACK_B", 2,
   "{.reg .b16 lo, hi; mov.b32 {lo, hi}, %0; cvt.rn.f16x2.e4m3x2 %0, lo;}")
OP(F32x2ToBf16x2, "cvt.rn.bf16x2.f32", "F2FP.BF16.F32.PACK_AB", 2,
   "{.reg .f32 f; mov.b32 f, %0; cvt.rn.bf16x2.f32 %0, f, f;}")
OP(F32x2ToF16x2, "cvt.rn.f16x2.f32", "F2FP.F16.F32.PACK_AB", 2,
   "{.reg .f32 f; mov.b32 f, %0; cvt.rn.f16x2.f32 %0, f, f;}")
OP(F16ToF32, "cvt.f32.f16", "HADD2.F32", 1,
   "{.reg .b16 lo, hi; .reg .f32 f; mov.b32 {lo, hi}, %0; cvt.f32.f16 f, lo; mov.b32 %0, f;}")
// The FMA pipe (e.g. scaling widened pairs by 2^8 with HFMA2) and the integer ones.
OP(Ffma, "fma.rn.f32", "FFMA", 1,
   "{.reg .f32 f; mov.b32 f, %0; fma.rn.f32 f, f, 0f3F7FF000, 0f3A800000; mov.b32 %0, f;}")
OP(Hfma2, "fma.rn.f16x2", "HFMA2", 2,
   "{.reg .b32 a, b; mov.b32 a, 0x3BFF3BFF; mov.b32 b, 0x14001400; fma.rn.f16x2 %0, %0, a, b;}")
OP(Prmt, "prmt.b32", "PRMT", 1, "prmt.b32 %0, %0, 0x00C0FFEE, 0x5140;")
OP(Lop3, "lop3.b32", "LOP3.LUT", 1, "lop3.b32 %0, %0, 0x3F803F80, 0x80008000, 0xB8;")
OP(Shf, "shf.r.wrap.b32", "SHF.R.W", 1, "shf.r.wrap.b32 %0, %0, %0, 7;")
// e4m3 pair -> f16 pair on the integer pipes, each value times 2^-8 (a scale can take the 2^8 back):
// an e4m3 byte's 7 magnitude bits shifted to bits 13..7 of an fp16 are that fp16's exponent (bias 15
// instead of 7, hence 2^-8) and mantissa, subnormals included; the sign goes to bit 15. NaN (0x7F)
// becomes 1.875, i.e. 480 * 2^-8 (tests/test_pipe_rates.py checks all 65536 pairs against this). Four
// instructions per pair against F2FP's one: it pays only if F2FP issues at under a quarter of their rate.
OP(E4m3x2ToF16x2Int, "e4m3x2 -> f16x2 by prmt/shr/and/add", "PRMT", 2,
   "{.reg .b32 x, y, t;\n"
   " prmt.b32 x, %0, 0, 0x1404;\n"  // byte 1 = b0, byte 3 = b1, bytes 0 and 2 zero
   " shr.b32 y, x, 1;\n"            // each byte's bits to 14..7 (sign at 14)
   " and.b32 t, y, 0x40004000;\n"   // the signs ...
   " add.u32 %0, y, t;}")           // ... carried from bit 14 to 15 (bit 15 of y is zero)

// Two operations, alternating by chain: if their pipes differ, a pair costs about what the slower one
// does alone; if they share one, the sum.
template <class A, class B>
struct Pair {
  using First = A;
  using Second = B;
};

template <class Op>
struct Apply {
  __device__ static void chains(uint32_t (&r)[kChains]) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) Op::apply(r[c]);
  }
};
template <class A, class B>
struct Apply<Pair<A, B>> {
  __device__ static void chains(uint32_t (&r)[kChains]) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if (c % 2 == 0) {
        A::apply(r[c]);
      } else {
        B::apply(r[c]);
      }
    }
  }
};

template <class Op>
__global__ void rate_kernel(uint32_t seed, uint32_t* out, long long* cycles) {
  extern __shared__ uint32_t smem[];  // only to keep one CTA per SM
  uint32_t r[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    // Small positive floats in both halves (e4m3 / f16 / bf16 / f32 alike stay finite for a while).
    r[c] = 0x3C003C00u ^ ((seed + threadIdx.x * kChains + c) & 0x00FF00FFu);
  }
  __syncthreads();
  long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < kIters; i += kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) Apply<Op>::chains(r);  // the loop's branch: 1 in 32 instructions
  }
  __syncthreads();
  long long t1 = clock64();
  uint32_t x = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) x ^= r[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
  if (threadIdx.x == 0) {
    cycles[blockIdx.x] = t1 - t0;
    smem[0] = x;
  }
}

struct Row {
  const char* kernel;  // the operation's struct (pairs: "A,B"): tests/test_pipe_rates.py finds its SASS
  const char* name;
  const char* sass;
  int values_per_instr;  // pairs: 1 (their values differ)
  void (*launch)(int, int, uint32_t*, long long*);
  void (*prepare)();
};

template <class Op>
void launch(int blocks, int threads, uint32_t* out, long long* cycles) {
  rate_kernel<Op><<<blocks, threads, kSmemBytes>>>(0x1234u, out, cycles);
}

template <class Op>
void allow_smem() {
  CHECK(cudaFuncSetAttribute(rate_kernel<Op>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
}

#define ROW(Op) Row{#Op, Op::name, Op::sass, Op::values, &launch<Op>, &allow_smem<Op>}
#define PAIR(A, B, name) Row{#A "," #B, name, "pair", 1, &launch<Pair<A, B>>, &allow_smem<Pair<A, B>>}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Row> rows = {
      ROW(Ffma), ROW(Hfma2), ROW(Ex2), ROW(Tanh), ROW(TanhF16x2), ROW(TanhBf16x2), ROW(Ex2F16x2), ROW(Ex2Bf16x2),
      ROW(E4m3x2ToF16x2), ROW(F32x2ToBf16x2), ROW(F32x2ToF16x2), ROW(F16ToF32), ROW(Prmt), ROW(Lop3), ROW(Shf),
      ROW(E4m3x2ToF16x2Int),
      PAIR(Ex2, Tanh, "ex2 | tanh.f32"),
      PAIR(Ex2, TanhF16x2, "ex2 | tanh.f16x2"),
      PAIR(Ex2, F32x2ToBf16x2, "ex2 | cvt.bf16x2.f32"),
      PAIR(Ex2, E4m3x2ToF16x2, "ex2 | cvt.f16x2.e4m3x2"),
      PAIR(E4m3x2ToF16x2, F32x2ToBf16x2, "cvt.f16x2.e4m3x2 | cvt.bf16x2.f32"),
      PAIR(E4m3x2ToF16x2, Prmt, "cvt.f16x2.e4m3x2 | prmt"),
      PAIR(E4m3x2ToF16x2, Hfma2, "cvt.f16x2.e4m3x2 | hfma2"),
      PAIR(Ex2, Ffma, "ex2 | ffma"),
      PAIR(Ex2, F16ToF32, "ex2 | cvt.f32.f16"),
      PAIR(Prmt, Lop3, "prmt | lop3"),
      PAIR(E4m3x2ToF16x2, E4m3x2ToF16x2Int, "cvt.f16x2.e4m3x2 | the integer pair"),
  };
  if (argc > 1 && std::string(argv[1]) == "--list") {  // no GPU needed: what each kernel should compile to
    for (const Row& rw : rows) std::printf("%s\t%s\t%s\n", rw.kernel, rw.name, rw.sass);
    return 0;
  }
  std::vector<int> warps_per_smsp;
  for (int i = 1; i < argc; ++i) warps_per_smsp.push_back(std::atoi(argv[i]));
  if (warps_per_smsp.empty()) warps_per_smsp = {1, 2, 4, 8};
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  for (const Row& rw : rows) rw.prepare();

  std::printf("device %s, %d SMs; %d chains x %d rounds per thread; one CTA per SM\n", prop.name, sms, kChains,
              kIters);
  std::printf("PTX operations per SM per cycle (warp-wide: one = 32 threads' worth), by warps per "
              "sub-partition; values/cycle = the best x values per operation x 32\n");
  std::printf("%-36s %-24s", "operation", "sass");
  for (int w : warps_per_smsp) std::printf("  w=%-2d instr", w);
  std::printf("  values/cycle\n");

  uint32_t* out = nullptr;
  long long* cycles = nullptr;
  int max_threads = 0;
  for (int w : warps_per_smsp) max_threads = w * 4 * 32 > max_threads ? w * 4 * 32 : max_threads;
  CHECK(cudaMalloc(&out, sizeof(uint32_t) * sms * max_threads));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  std::vector<long long> host(sms);
  for (const Row& rw : rows) {
    std::printf("%-36s %-24s", rw.name, rw.sass);
    double best = 0;
    for (int w : warps_per_smsp) {
      int threads = w * 4 * 32;
      rw.launch(sms, threads, out, cycles);  // warm-up
      CHECK(cudaGetLastError());
      rw.launch(sms, threads, out, cycles);
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(host.data(), cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
      // The median CTA: a CTA that shared its SM (should none) or started late does not count.
      std::vector<long long> sorted = host;
      std::nth_element(sorted.begin(), sorted.begin() + sms / 2, sorted.end());
      double cyc = static_cast<double>(sorted[sms / 2]);
      double warp_instr = static_cast<double>(threads / 32) * kIters * kChains;
      double rate = warp_instr / cyc;  // warp instructions per SM cycle
      best = rate > best ? rate : best;
      std::printf("  %10.3f", rate);
    }
    std::printf("  %8.1f\n", best * 32 * rw.values_per_instr);
  }
  CHECK(cudaFree(out));
  CHECK(cudaFree(cycles));
  return 0;
}
