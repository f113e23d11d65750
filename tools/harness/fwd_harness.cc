// Standalone check of one exported forward kernel without JAX/XLA: poisoned outputs, a CPU fp32
// reference, launch + synchronise with full error reporting. Built by tools/harness/build.sh for a
// variant header/object pair from the AOT exporter; for kernel debugging on the GPU host.
#include VARIANT_HEADER

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s -> %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define P(x) CAT(VARIANT, x)

static float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

// usage: harness [seqlen_q] [seqlen_k] [window_left] [window_right] [softcap] [sink]
// MASK (0 full, 1 causal, 2 local) and SOFTCAP (0/1) come from the variant's symbol (build.sh).
int main(int argc, char **argv) {
  int b = 1, sq = argc > 1 ? atoi(argv[1]) : 128, sk = argc > 2 ? atoi(argv[2]) : 128, hq = 2, hk = 1;
  const int d = HEAD_DIM;
  int left = argc > 3 ? atoi(argv[3]) : -1, right = argc > 4 ? atoi(argv[4]) : -1;
  if (MASK == 1) { left = -1; right = 0; }
  if (MASK == 0) { left = -1; right = -1; }
  const float cap = (SOFTCAP && argc > 5) ? (float)atof(argv[5]) : (SOFTCAP ? 30.f : 0.f);
  const float sink = argc > 6 ? (float)atof(argv[6]) : -INFINITY;
  size_t nq = (size_t)b * sq * hq * d, nk = (size_t)b * sk * hk * d;
  std::vector<__nv_bfloat16> hq_(nq), hk_(nk), hv_(nk), ho(nq);
  std::vector<float> fq(nq), fk(nk), fv(nk);
  srand(1);
  auto rnd = [] { return (float)rand() / RAND_MAX * 2.f - 1.f; };
  for (size_t i = 0; i < nq; ++i) { fq[i] = bf(rnd()); hq_[i] = __float2bfloat16(fq[i]); }
  for (size_t i = 0; i < nk; ++i) { fk[i] = bf(rnd()); hk_[i] = __float2bfloat16(fk[i]); fv[i] = bf(rnd()); hv_[i] = __float2bfloat16(fv[i]); }
  void *dq, *dk, *dv, *dout; float *dl, *ds;
  std::vector<float> hs(hq, sink);
  CK(cudaMalloc(&ds, hq * 4));
  CK(cudaMemcpy(ds, hs.data(), hq * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dq, nq * 2)); CK(cudaMalloc(&dk, nk * 2)); CK(cudaMalloc(&dv, nk * 2));
  CK(cudaMalloc(&dout, nq * 2)); CK(cudaMalloc(&dl, (size_t)b * hq * sq * 4));
  CK(cudaMemcpy(dq, hq_.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, hk_.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv_.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(dout, 0xFF, nq * 2));  // NaN poison
  CK(cudaMemset(dl, 0xFF, (size_t)b * hq * sq * 4));
  P(_Kernel_Module_t) mod;
  P(_Kernel_Module_Load)(&mod);  // every device; fine for a one-GPU debugging run
  CK(cudaGetLastError());
  P(_Tensor_mQ_t) tq{dq, {b, sq, hq}, {(int64_t)sq * hq * d, (int64_t)hq * d, d}};
  P(_Tensor_mK_t) tk{dk, {b, sk, hk}, {(int64_t)sk * hk * d, (int64_t)hk * d, d}};
  P(_Tensor_mV_t) tv{dv, {b, sk, hk}, {(int64_t)sk * hk * d, (int64_t)hk * d, d}};
  P(_Tensor_mO_t) to{dout, {b, sq, hq}, {(int64_t)sq * hq * d, (int64_t)hq * d, d}};
  P(_Tensor_mLSE_t) tl{dl, {b, hq, sq}, {(int64_t)hq * sq, sq}};
  P(_Tensor_mSinks_t) tsk{ds, {hq}, {1}};
  float scale = 1.f / sqrtf((float)d);
  // As ffi/fwd.cc fills them: scale (or cap) * log2(e), scale / cap, unbounded sides clamped.
  float scale_log2 = (cap > 0 ? cap : scale) * 1.4426950408889634f, prescale = cap > 0 ? scale / cap : 1.f;
  int wl = left < 0 ? sk : left, wr = right < 0 ? sq : right;
  int sms = 0;  // the persistent grid size, as the handler passes it
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int ret = CAT(cute_dsl_, CAT(VARIANT, _wrapper))(&mod, &tq, &tk, &tv, &to, &tl, &tsk, scale_log2, prescale, wl, wr,
                                                   sms, 0);
  printf("wrapper ret=%d lasterr=%s\n", ret, cudaGetErrorString(cudaGetLastError()));
  CK(cudaDeviceSynchronize());
  std::vector<float> hl((size_t)b * hq * sq);
  CK(cudaMemcpy(ho.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hl.data(), dl, hl.size() * 4, cudaMemcpyDeviceToHost));
  double maxerr = 0, maxlerr = 0; long nan = 0, bad = 0;
  for (int h = 0; h < hq; ++h) {
    int hkv = h / (hq / hk);
    for (int i = 0; i < sq; ++i) {
      std::vector<double> s(sk); double m = -INFINITY;
      for (int j = 0; j < sk; ++j) {
        double acc = 0;
        for (int t = 0; t < d; ++t) acc += fq[((size_t)i * hq + h) * d + t] * fk[((size_t)j * hk + hkv) * d + t];
        s[j] = acc * scale;
        if (cap > 0) s[j] = cap * tanh(s[j] / cap);
        const int diag = i + sk - sq;
        if ((right >= 0 && j > diag + right) || (left >= 0 && j < diag - left)) s[j] = -INFINITY;
        m = fmax(m, s[j]);
      }
      m = fmax(m, (double)sink);
      double l = std::isinf(m) ? 0 : exp((double)sink - m);
      for (int j = 0; j < sk; ++j) { s[j] = std::isinf(m) ? 0 : exp(s[j] - m); l += s[j]; }
      for (int t = 0; t < d; ++t) {
        double o = 0; for (int j = 0; j < sk; ++j) o += s[j] * fv[((size_t)j * hk + hkv) * d + t];
        o = l > 0 ? o / l : 0;
        float got = __bfloat162float(ho[((size_t)i * hq + h) * d + t]);
        if (std::isnan(got)) ++nan; else { double e = fabs(got - o); maxerr = fmax(maxerr, e); if (e > 0.02) ++bad; }
        if (i < 2 && h == 0 && t < 4) printf("o[%d,%d,%d] got %f want %f\n", i, h, t, got, o);
      }
      double lse = l > 0 ? m + log(l) : -INFINITY;
      float gl = hl[(size_t)h * sq + i];
      if (i < 2 && h == 0) printf("lse[%d] got %f want %f\n", i, gl, lse);
      if (!std::isinf(lse)) maxlerr = fmax(maxlerr, fabs(gl - lse));
    }
  }
  printf("RESULT sq=%d sk=%d window=(%d,%d) softcap=%g sink=%g: max_err=%g bad=%ld nan=%ld max_lse_err=%g\n",
         sq, sk, left, right, cap, sink, maxerr, bad, nan, maxlerr);
  return 0;
}
