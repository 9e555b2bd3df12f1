// Standalone driver of the capsule prediction and fused routing GPU launchers
// (no TensorFlow).
//
//   sanitize_driver            check forward and gradient of every kernel path
//                              (tiled and generic; float, double, half,
//                              bfloat16) of both ops on small shapes against a
//                              host reference; exit 1 on any mismatch. Small
//                              enough to run under compute-sanitizer
//                              memcheck/racecheck.
//   sanitize_driver --bench [--iters N] [--repeats N] [--shape NAME] [--routing] [--leaky]
//                              time forward/backward at the benchmark shapes
//                              with CUDA events, next to a device-to-device copy;
//                              --shape keeps one shape (paper, batch512, large),
//                              --routing only the fused routing op (e.g. under
//                              ncu: --iters 1 --repeats 1 keeps the launches few),
//                              --leaky times the fused routing with leaky routing.
//
// Built by `python scripts/build_ops.py --driver` into build/sanitize_driver.
// Buffers are allocated at their exact size so memcheck sees any overrun, and
// outputs and workspaces are pre-filled with NaN bytes so an element a kernel
// forgets to write, or scratch it reads before writing, shows up as a mismatch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "capsnet_kernels.h"

using capsnet::CapsuleDims;
using capsnet::GpuAlgo;
using capsnet::int64;

#define CHECK_CUDA(expr)                                                   \
  do {                                                                     \
    cudaError_t err_ = (expr);                                             \
    if (err_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,   \
                   cudaGetErrorString(err_));                              \
      std::exit(2);                                                        \
    }                                                                      \
  } while (0)

#define CHECK_LAUNCH(expr)                                                 \
  do {                                                                     \
    int st_ = (expr);                                                      \
    if (st_ != 0) {                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,   \
                   capsnet::GpuErrorString(st_));                          \
      std::exit(2);                                                        \
    }                                                                      \
  } while (0)

// Host conversions of the storage types.
template <typename T>
struct Host;
template <>
struct Host<float> {
  static const char* name() { return "float"; }
  static float from(double x) { return static_cast<float>(x); }
  static double to(float x) { return x; }
  static double tol() { return 2e-5; }
};
template <>
struct Host<double> {
  static const char* name() { return "double"; }
  static double from(double x) { return x; }
  static double to(double x) { return x; }
  static double tol() { return 1e-12; }
};
template <>
struct Host<capsnet::half_t> {
  static const char* name() { return "half"; }
  static capsnet::half_t from(double x) {
    __half h = __float2half_rn(static_cast<float>(x));
    capsnet::half_t out;
    std::memcpy(&out, &h, 2);
    return out;
  }
  static double to(capsnet::half_t x) {
    __half h;
    std::memcpy(&h, &x, 2);
    return __half2float(h);
  }
  static double tol() { return 4e-3; }
};
template <>
struct Host<capsnet::bfloat16_t> {
  static const char* name() { return "bfloat16"; }
  static capsnet::bfloat16_t from(double x) {
    __nv_bfloat16 h = __float2bfloat16_rn(static_cast<float>(x));
    capsnet::bfloat16_t out;
    std::memcpy(&out, &h, 2);
    return out;
  }
  static double to(capsnet::bfloat16_t x) {
    __nv_bfloat16 h;
    std::memcpy(&h, &x, 2);
    return __bfloat162float(h);
  }
  static double tol() { return 3e-2; }
};

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  int64 n = 0;
  explicit DeviceBuffer(int64 count) : n(count) {
    if (n > 0) CHECK_CUDA(cudaMalloc(&ptr, n * sizeof(T)));
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& h) {
    if (n > 0) CHECK_CUDA(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    if (n > 0) CHECK_CUDA(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void fill_nan() {
    if (n > 0) CHECK_CUDA(cudaMemset(ptr, 0xFF, n * sizeof(T)));
  }
};

// Compares `got` (device result) with the double reference; the tolerance
// scales with the magnitude of the summed terms (`scale`, per element).
template <typename T>
bool Compare(const char* what, const std::vector<T>& got,
             const std::vector<double>& want, const std::vector<double>& scale) {
  int64 bad = 0;
  double worst = 0;
  int64 worst_at = -1;
  for (size_t x = 0; x < want.size(); ++x) {
    const double g = Host<T>::to(got[x]);
    const double err = std::fabs(g - want[x]);
    const double allowed = Host<T>::tol() * (scale[x] + 1e-30) + 1e-300;
    if (!(err <= allowed)) {  // also catches NaN
      ++bad;
      const double rel = err / allowed;
      if (!(rel <= worst)) {
        worst = rel;
        worst_at = static_cast<int64>(x);
      }
    }
  }
  if (bad > 0) {
    std::printf("    MISMATCH %s: %lld of %zu elements, e.g. [%lld] got %.9g want %.9g\n",
                what, static_cast<long long>(bad), want.size(),
                static_cast<long long>(worst_at), Host<T>::to(got[worst_at]),
                want[worst_at]);
  }
  return bad == 0;
}

template <typename T>
bool CheckShape(const CapsuleDims& d, GpuAlgo algo, std::mt19937& rng) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  const int64 B = d.batch, I = d.in_caps, K = d.in_dim, JD = d.rows_per_cap();
  const int64 R = d.rows();
  std::vector<T> hu(d.u_size()), hw(d.w_size()), hg(d.u_hat_size());
  std::vector<double> u(hu.size()), w(hw.size()), g(hg.size());
  // Quantize the inputs to T first so the reference sees what the device sees.
  for (size_t x = 0; x < hu.size(); ++x) { hu[x] = Host<T>::from(dist(rng)); u[x] = Host<T>::to(hu[x]); }
  for (size_t x = 0; x < hw.size(); ++x) { hw[x] = Host<T>::from(dist(rng)); w[x] = Host<T>::to(hw[x]); }
  for (size_t x = 0; x < hg.size(); ++x) { hg[x] = Host<T>::from(dist(rng)); g[x] = Host<T>::to(hg[x]); }

  // Host reference (double) and the magnitude of the summed terms.
  std::vector<double> u_hat(hg.size(), 0), s_hat(hg.size(), 0);
  std::vector<double> grad_u(hu.size(), 0), s_u(hu.size(), 0);
  std::vector<double> grad_w(hw.size(), 0), s_w(hw.size(), 0);
  for (int64 b = 0; b < B; ++b) {
    for (int64 r = 0; r < R; ++r) {
      const int64 i = r / JD;
      for (int64 k = 0; k < K; ++k) {
        const double wv = w[r * K + k], uv = u[(b * I + i) * K + k], gv = g[b * R + r];
        u_hat[b * R + r] += wv * uv;
        s_hat[b * R + r] += std::fabs(wv * uv);
        grad_u[(b * I + i) * K + k] += wv * gv;
        s_u[(b * I + i) * K + k] += std::fabs(wv * gv);
        grad_w[r * K + k] += gv * uv;
        s_w[r * K + k] += std::fabs(gv * uv);
      }
    }
  }

  DeviceBuffer<T> du(hu.size()), dw(hw.size()), dg(hg.size()), dout(hg.size());
  DeviceBuffer<T> dgu(hu.size()), dgw(hw.size());
  du.upload(hu);
  dw.upload(hw);
  dg.upload(hg);
  dout.fill_nan();
  dgu.fill_nan();
  dgw.fill_nan();
  const size_t ws_bytes = capsnet::CapsulePredictionGradWorkspaceBytes<T>(d, algo);
  void* ws = nullptr;
  if (ws_bytes > 0) {
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    CHECK_CUDA(cudaMemset(ws, 0xFF, ws_bytes));
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The NaN/zero fills above ran on the legacy stream, which a non-blocking stream does
  // not wait for: without this, a launcher's own cudaMemsetAsync (empty sums) could run
  // before the fill and have its zeros overwritten by NaN.
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_LAUNCH(capsnet::LaunchCapsulePredictionForward<T>(du.ptr, dw.ptr, dout.ptr, d, stream, algo));
  CHECK_LAUNCH(capsnet::LaunchCapsulePredictionGrad<T>(dg.ptr, du.ptr, dw.ptr, dgu.ptr, dgw.ptr,
                                                       ws, ws_bytes, d, stream, algo));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  bool ok = Compare("u_hat", dout.download(), u_hat, s_hat);
  const std::vector<T> gu1 = dgu.download(), gw1 = dgw.download();
  ok &= Compare("grad_u", gu1, grad_u, s_u);
  ok &= Compare("grad_W", gw1, grad_w, s_w);

  // Deterministic: a second run gives the same bits.
  CHECK_LAUNCH(capsnet::LaunchCapsulePredictionGrad<T>(dg.ptr, du.ptr, dw.ptr, dgu.ptr, dgw.ptr,
                                                       ws, ws_bytes, d, stream, algo));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const std::vector<T> gu2 = dgu.download(), gw2 = dgw.download();
  if ((!gu1.empty() && std::memcmp(gu1.data(), gu2.data(), gu1.size() * sizeof(T)) != 0) ||
      (!gw1.empty() && std::memcmp(gw1.data(), gw2.data(), gw1.size() * sizeof(T)) != 0)) {
    std::printf("    MISMATCH: gradient differs between two runs\n");
    ok = false;
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  if (ws != nullptr) CHECK_CUDA(cudaFree(ws));
  return ok;
}

// ---------------------------------------------------------------------------
// Fused routing: host reference in double (Procedure 1, as the CPU kernel; leaky:
// the softmax over [0, b_i1..b_iJ] with the zero logit's share dropped), with
// error scales for the tolerance. L[b, i] = the absolute sum of the terms of the
// logits b_i. (rounding them moves c_ij by about eps * L * c_ij, and by at most
// eps * L); s_j's terms are c_ij u_hat with u_hat itself a sum of K products, so
// its scale is sum_i c_ij (1 + L[b, i]) sum_k |W u|.

struct RoutingReference {
  std::vector<double> s, c;              // outputs
  std::vector<double> s_scale, c_scale;  // error scales, per element
};

RoutingReference HostRouting(const std::vector<double>& u, const std::vector<double>& w,
                             const CapsuleDims& d, int iterations, bool leaky) {
  const int64 B = d.batch, I = d.in_caps, J = d.out_caps, D = d.out_dim, K = d.in_dim;
  const int64 JD = J * D;
  RoutingReference ref;
  ref.s.assign(B * JD, 0);
  ref.s_scale.assign(B * JD, 0);
  ref.c.assign(B * I * J, 0);
  ref.c_scale.assign(B * I * J, 0);
  std::vector<double> u_hat(I * JD), u_hat_abs(I * JD), logits(I * J), c(I * J), s(JD), v(JD);
  std::vector<double> terms(I);
  if (J == 0) return ref;  // nothing to route: every output is empty
  for (int64 b = 0; b < B; ++b) {
    for (int64 i = 0; i < I; ++i) {
      for (int64 r = 0; r < JD; ++r) {
        double acc = 0, abs_acc = 0;
        for (int64 k = 0; k < K; ++k) {
          const double term = w[(i * JD + r) * K + k] * u[(b * I + i) * K + k];
          acc += term;
          abs_acc += std::fabs(term);
        }
        u_hat[i * JD + r] = acc;
        u_hat_abs[i * JD + r] = abs_acc;
      }
    }
    std::fill(logits.begin(), logits.end(), 0.0);
    std::fill(terms.begin(), terms.end(), 0.0);
    for (int t = 0; t < iterations; ++t) {
      for (int64 i = 0; i < I; ++i) {
        double m = leaky ? std::max(0.0, logits[i * J]) : logits[i * J];
        for (int64 j = 1; j < J; ++j) m = std::max(m, logits[i * J + j]);
        double sum = leaky ? std::exp(-m) : 0.0;
        for (int64 j = 0; j < J; ++j) sum += c[i * J + j] = std::exp(logits[i * J + j] - m);
        for (int64 j = 0; j < J; ++j) c[i * J + j] /= sum;
      }
      std::fill(s.begin(), s.end(), 0.0);
      for (int64 i = 0; i < I; ++i) {
        for (int64 r = 0; r < JD; ++r) s[r] += c[i * J + r / D] * u_hat[i * JD + r];
      }
      if (t == iterations - 1) break;
      for (int64 j = 0; j < J; ++j) {
        double sq = 0;
        for (int64 x = j * D; x < (j + 1) * D; ++x) sq += s[x] * s[x];
        const double scale = sq / (1 + sq) / std::sqrt(sq + capsnet::kSquashEpsilon);
        for (int64 x = j * D; x < (j + 1) * D; ++x) v[x] = scale * s[x];
      }
      for (int64 i = 0; i < I; ++i) {
        for (int64 j = 0; j < J; ++j) {
          double a = 0;
          for (int64 x = j * D; x < (j + 1) * D; ++x) {
            a += u_hat[i * JD + x] * v[x];
            terms[i] += u_hat_abs[i * JD + x] * std::fabs(v[x]);
          }
          logits[i * J + j] += a;
        }
      }
    }
    for (int64 i = 0; i < I; ++i) {
      for (int64 j = 0; j < J; ++j) {
        ref.c[(b * I + i) * J + j] = c[i * J + j];
        ref.c_scale[(b * I + i) * J + j] = 1 + terms[i];
      }
      for (int64 r = 0; r < JD; ++r) {
        ref.s_scale[b * JD + r] += c[i * J + r / D] * (1 + terms[i]) * u_hat_abs[i * JD + r];
      }
    }
    for (int64 r = 0; r < JD; ++r) ref.s[b * JD + r] = s[r];
  }
  return ref;
}

// The largest |got - want| / scale: how much of its allowance a result used.
template <typename T>
double WorstRatio(const std::vector<T>& got, const std::vector<double>& want,
                  const std::vector<double>& scale) {
  double worst = 0;
  for (size_t x = 0; x < want.size(); ++x) {
    worst = std::max(worst, std::fabs(Host<T>::to(got[x]) - want[x]) / (scale[x] + 1e-30));
  }
  return worst;
}

// Whether the launcher runs float32 on tensor cores, W and g split into bfloat16
// hi + lo (routing_mma.cuh): products within ~3 * 2^-16 instead of float32's
// rounding, so the checks allow kSplitSlack times the float32 allowance.
template <typename T>
bool SplitFloat32(const CapsuleDims& d, GpuAlgo algo) {
  return std::is_same<T, float>::value && algo == GpuAlgo::kAuto && d.in_dim == 8 && d.out_dim == 16 &&
         d.out_caps >= 1 && d.out_caps <= 10 && d.in_caps >= 1 && d.batch >= 1;
}
constexpr double kSplitSlack = 5.0;

// Compares with an error allowance of tol_acc * scale (propagated accumulation
// error: float, or double for double) plus T's rounding of the output.
template <typename T>
bool CompareRouted(const char* what, const std::vector<T>& got, const std::vector<double>& want,
                   const std::vector<double>& scale, double slack = 1.0) {
  const double tol_acc = (std::is_same<T, double>::value ? 1e-12 : 2e-5) * slack;
  std::vector<double> allowed(want.size());
  for (size_t x = 0; x < want.size(); ++x) {
    allowed[x] = (tol_acc * scale[x] + Host<T>::tol() * std::fabs(want[x])) / Host<T>::tol();
  }
  return Compare(what, got, want, allowed);
}

template <typename T>
bool CheckRouting(const CapsuleDims& d, int iterations, bool leaky, GpuAlgo algo, std::mt19937& rng) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  const int64 B = d.batch, I = d.in_caps, J = d.out_caps, D = d.out_dim, K = d.in_dim;
  const int64 JD = J * D;
  const int64 s_size = B * JD, c_size = B * I * J;
  std::vector<T> hu(d.u_size()), hw(d.w_size()), hc(c_size), hg(s_size);
  std::vector<double> u(hu.size()), w(hw.size()), cin(hc.size()), g(hg.size());
  // |u| ~ 1 / sqrt(K) like squashed capsules, so the agreements move the routing
  // without saturating the softmax.
  const double u_scale = 1.0 / std::sqrt(static_cast<double>(std::max<int64>(K, 1)));
  for (size_t x = 0; x < hu.size(); ++x) { hu[x] = Host<T>::from(u_scale * dist(rng)); u[x] = Host<T>::to(hu[x]); }
  for (size_t x = 0; x < hw.size(); ++x) { hw[x] = Host<T>::from(dist(rng)); w[x] = Host<T>::to(hw[x]); }
  // The gradient's own inputs: any c_ij in [0, 1] and grad_s.
  for (size_t x = 0; x < hc.size(); ++x) { hc[x] = Host<T>::from(0.5 + 0.5 * dist(rng)); cin[x] = Host<T>::to(hc[x]); }
  for (size_t x = 0; x < hg.size(); ++x) { hg[x] = Host<T>::from(dist(rng)); g[x] = Host<T>::to(hg[x]); }
  const RoutingReference ref = HostRouting(u, w, d, iterations, leaky);

  // Gradient reference: grad_u_hat = c ⊗ g, then the prediction gradient.
  std::vector<double> grad_u(hu.size(), 0), s_u(hu.size(), 0), grad_w(hw.size(), 0), s_w(hw.size(), 0);
  for (int64 b = 0; b < B; ++b) {
    for (int64 i = 0; i < I; ++i) {
      for (int64 r = 0; r < JD; ++r) {
        const double gh = cin[(b * I + i) * J + r / D] * g[b * JD + r];
        for (int64 k = 0; k < K; ++k) {
          const double wv = w[(i * JD + r) * K + k], uv = u[(b * I + i) * K + k];
          grad_u[(b * I + i) * K + k] += wv * gh;
          s_u[(b * I + i) * K + k] += std::fabs(wv * gh);
          grad_w[(i * JD + r) * K + k] += gh * uv;
          s_w[(i * JD + r) * K + k] += std::fabs(gh * uv);
        }
      }
    }
  }

  DeviceBuffer<T> du(hu.size()), dw(hw.size()), dc(hc.size()), dg(hg.size());
  DeviceBuffer<T> ds(s_size), dco(c_size), dgu(hu.size()), dgw(hw.size());
  du.upload(hu);
  dw.upload(hw);
  dc.upload(hc);
  dg.upload(hg);
  ds.fill_nan();
  dco.fill_nan();
  dgu.fill_nan();
  dgw.fill_nan();
  const size_t fwd_bytes = capsnet::CapsuleRoutingWorkspaceBytes<T>(d, iterations, algo);
  const size_t grad_bytes = capsnet::CapsuleRoutingGradWorkspaceBytes<T>(d, algo);
  void* fwd_ws = nullptr;
  void* grad_ws = nullptr;
  if (fwd_bytes > 0) {
    CHECK_CUDA(cudaMalloc(&fwd_ws, fwd_bytes));
    CHECK_CUDA(cudaMemset(fwd_ws, 0xFF, fwd_bytes));
  }
  if (grad_bytes > 0) {
    CHECK_CUDA(cudaMalloc(&grad_ws, grad_bytes));
    CHECK_CUDA(cudaMemset(grad_ws, 0xFF, grad_bytes));
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The NaN/zero fills above ran on the legacy stream, which a non-blocking stream does
  // not wait for: without this, a launcher's own cudaMemsetAsync (empty sums) could run
  // before the fill and have its zeros overwritten by NaN.
  CHECK_CUDA(cudaDeviceSynchronize());
  auto forward = [&] {
    CHECK_LAUNCH(capsnet::LaunchCapsuleRoutingForward<T>(du.ptr, dw.ptr, ds.ptr, dco.ptr, fwd_ws,
                                                         fwd_bytes, d, iterations, leaky, stream, algo));
  };
  auto backward = [&] {
    CHECK_LAUNCH(capsnet::LaunchCapsuleRoutingGrad<T>(dc.ptr, dg.ptr, du.ptr, dw.ptr, dgu.ptr,
                                                      dgw.ptr, grad_ws, grad_bytes, d, stream, algo));
  };
  forward();
  backward();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const std::vector<T> s1 = ds.download(), c1 = dco.download();
  const std::vector<T> gu1 = dgu.download(), gw1 = dgw.download();
  const bool split = SplitFloat32<T>(d, algo);
  const double slack = split ? kSplitSlack : 1.0;
  for (double& x : s_u) x *= slack;
  for (double& x : s_w) x *= slack;
  bool ok = CompareRouted("s_j", s1, ref.s, ref.s_scale, slack);
  ok &= CompareRouted("c_ij", c1, ref.c, ref.c_scale, slack);
  ok &= Compare("routing grad_u", gu1, grad_u, s_u);
  ok &= Compare("routing grad_W", gw1, grad_w, s_w);
  if (split) {
    // The margin, in units of the float32 allowance (2e-5 of the scale; the check allows kSplitSlack).
    std::printf("    float32 on tensor cores: worst error / (2e-5 scale): s_j %.2f c_ij %.2f grad_u %.2f grad_W %.2f\n",
                WorstRatio(s1, ref.s, ref.s_scale) / 2e-5, WorstRatio(c1, ref.c, ref.c_scale) / 2e-5,
                WorstRatio(gu1, grad_u, s_u) * slack / 2e-5, WorstRatio(gw1, grad_w, s_w) * slack / 2e-5);
  }

  // Deterministic: a second run gives the same bits (the workspace now holds the
  // first run's values, which must not matter either).
  forward();
  backward();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  auto same = [](const std::vector<T>& a, const std::vector<T>& b) {
    return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };
  if (!same(s1, ds.download()) || !same(c1, dco.download()) || !same(gu1, dgu.download()) ||
      !same(gw1, dgw.download())) {
    std::printf("    MISMATCH: routing differs between two runs\n");
    ok = false;
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  if (fwd_ws != nullptr) CHECK_CUDA(cudaFree(fwd_ws));
  if (grad_ws != nullptr) CHECK_CUDA(cudaFree(grad_ws));
  return ok;
}

int RunChecks() {
  // (batch, in_caps, out_caps, out_dim, in_dim): each line exercises a path.
  const std::vector<CapsuleDims> shapes = {
      {3, 5, 2, 4, 8},      // float4 rows, KMAX 8
      {2, 7, 3, 5, 3},      // odd JD (vector width 1), KMAX 4
      {1, 1, 1, 1, 1},      // all ones
      {4, 3, 1, 6, 16},     // width 2, KMAX 16
      {5, 9, 10, 16, 8},    // paper-like rows (40 vectors per capsule)
      {2, 4, 3, 3, 11},     // odd everything, KMAX 16
      {70, 2, 10, 16, 8},   // few capsule tiles: batch split + partials reduce
      {3, 2, 2, 4, 17},     // in_dim > 16: generic kernels
      {2, 1, 5, 820, 4},    // JD = 4100: too many vectors per capsule: generic
      {0, 4, 2, 4, 8},      // empty batch: empty u_hat, zero grad_W
      {3, 4, 2, 4, 0},      // in_dim 0: zero u_hat
      {3, 0, 2, 4, 8},      // no input capsules
      {3, 4, 0, 4, 8},      // no output capsules: zero grad_u
  };
  std::mt19937 rng(1234);
  int failures = 0, runs = 0;
  auto run_all = [&](auto tag) {
    using T = decltype(tag);
    for (const CapsuleDims& d : shapes) {
      for (GpuAlgo algo : {GpuAlgo::kAuto, GpuAlgo::kGeneric}) {
        const bool ok = CheckShape<T>(d, algo, rng);
        ++runs;
        if (!ok) ++failures;
        std::printf("%-4s %-8s B=%lld I=%lld J=%lld D=%lld K=%lld %s\n", ok ? "ok" : "FAIL",
                    Host<T>::name(), (long long)d.batch, (long long)d.in_caps,
                    (long long)d.out_caps, (long long)d.out_dim, (long long)d.in_dim,
                    algo == GpuAlgo::kAuto ? "auto" : "generic");
      }
    }
  };
  run_all(float());
  run_all(double());
  run_all(capsnet::half_t());
  run_all(capsnet::bfloat16_t());

  // Fused routing: (shape, iterations), each line a path of the routing plan, each
  // with and without leaky routing (the softmax with the extra zero logit).
  const std::vector<std::pair<CapsuleDims, int>> routing = {
      {{3, 5, 2, 16, 8}, 3},     // 4 rows per thread, in_dim 8
      {{2, 7, 3, 5, 3}, 3},      // odd out_dim: 1 row per thread, in_dim padded to 4
      {{1, 1, 1, 1, 1}, 1},      // all ones, no agreement
      {{1, 1, 1, 1, 1}, 3},
      {{4, 3, 1, 6, 16}, 2},     // one output capsule, 2 rows per thread, in_dim 16
      {{5, 9, 10, 16, 8}, 3},    // paper capsules, in_caps not a multiple of a sub-chunk
      {{2, 4, 3, 3, 11}, 3},     // in_dim padded 11 -> 16
      {{70, 2, 10, 16, 8}, 3},   // two batch stages, b_ij stored and read back
      {{3, 2000, 10, 16, 8}, 3}, // 2 sub-chunks per block, the last one short
      {{33, 37, 7, 16, 8}, 3},   // tensor cores: partial tiles, odd capsules, J < 10
      {{17, 1, 10, 16, 8}, 4},   // tensor cores: one capsule (a pair's second is padding), r = 4
      {{9, 6, 33, 2, 4}, 4},     // many output capsules, 4 iterations
      {{3, 2, 2, 4, 17}, 2},     // in_dim > 16: generic kernels
      {{2, 1, 5, 820, 4}, 2},    // J*D too wide for a block: generic kernels
      {{0, 4, 2, 4, 8}, 3},      // empty batch
      {{3, 4, 2, 4, 0}, 3},      // in_dim 0: s_j = 0, c_ij = 1/J
      {{3, 4, 2, 0, 8}, 3},      // out_dim 0: c_ij = 1/J
      {{3, 0, 2, 4, 8}, 3},      // no input capsules: s_j = 0
      {{3, 4, 0, 4, 8}, 3},      // no output capsules: everything empty
  };
  auto run_routing = [&](auto tag) {
    using T = decltype(tag);
    for (const auto& [d, iterations] : routing) {
      for (const bool leaky : {false, true}) {
        for (GpuAlgo algo : {GpuAlgo::kAuto, GpuAlgo::kCudaCores, GpuAlgo::kGeneric}) {
          const bool ok = CheckRouting<T>(d, iterations, leaky, algo, rng);
          ++runs;
          if (!ok) ++failures;
          std::printf("%-4s %-8s routing%s r=%d B=%lld I=%lld J=%lld D=%lld K=%lld %s\n", ok ? "ok" : "FAIL",
                      Host<T>::name(), leaky ? " leaky" : "", iterations, (long long)d.batch,
                      (long long)d.in_caps, (long long)d.out_caps, (long long)d.out_dim, (long long)d.in_dim,
                      algo == GpuAlgo::kAuto ? "auto" : (algo == GpuAlgo::kCudaCores ? "cuda-cores" : "generic"));
        }
      }
    }
  };
  run_routing(float());
  run_routing(double());
  run_routing(capsnet::half_t());
  run_routing(capsnet::bfloat16_t());
  std::printf("%d of %d checks passed\n", runs - failures, runs);
  return failures == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------
// Benchmark: median over repeats of `iters` back-to-back launches.

template <typename F>
double TimeUs(F&& f, int iters, int repeats, cudaStream_t stream) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int w = 0; w < 3; ++w) f();  // warm-up
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    for (int it = 0; it < iters; ++it) f();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(1000.0 * ms / iters);
  }
  std::sort(times.begin(), times.end());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return times[times.size() / 2];
}

struct BenchOptions {
  int iters = 50;
  int repeats = 7;
  std::string shape;     // empty: every shape
  bool routing = false;  // only the fused routing op
  bool leaky = false;    // the fused routing with leaky routing
};

int RunBench(const BenchOptions& opt) {
  const int iters = opt.iters;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  int dev = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  const int repeats = opt.repeats;
  // Copy bandwidth: read + write bytes of a 1 GiB device-to-device copy.
  const int64 copy_bytes = int64(1) << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 0, copy_bytes));
  const double copy_us = TimeUs([&] {
    CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
  }, 10, repeats, stream);
  const double copy_gbs = 2.0 * copy_bytes / (copy_us * 1e3);
  const double set_us = TimeUs([&] {
    CHECK_CUDA(cudaMemsetAsync(dst, 1, copy_bytes, stream));
  }, 10, repeats, stream);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  std::printf("device: %s (%d SMs); copy bandwidth %.0f GB/s (read+write), memset %.0f GB/s\n\n",
              prop.name, prop.multiProcessorCount, copy_gbs, copy_bytes / (set_us * 1e3));
  std::printf("| shape (B, I, J, D, K) | kernels | pass | us | GB/s | %% of copy | x floor |\n");
  std::printf("|---|---|---|---:|---:|---:|---:|\n");

  std::vector<std::pair<const char*, CapsuleDims>> shapes = {
      {"paper", {128, 1152, 10, 16, 8}},
      {"batch512", {512, 1152, 10, 16, 8}},
      {"large", {128, 4608, 32, 16, 8}},
  };
  if (!opt.shape.empty()) {
    shapes.erase(std::remove_if(shapes.begin(), shapes.end(),
                                [&](const auto& s) { return opt.shape != s.first; }),
                 shapes.end());
    if (shapes.empty()) {
      std::fprintf(stderr, "sanitize_driver: unknown --shape %s (paper, batch512, large)\n",
                   opt.shape.c_str());
      return 2;
    }
  }
  using T = float;
  for (const auto& named : opt.routing ? decltype(shapes){} : shapes) {
    const char* name = named.first;
    const CapsuleDims d = named.second;
    DeviceBuffer<T> u(d.u_size()), w(d.w_size()), out(d.u_hat_size());
    DeviceBuffer<T> gu(d.u_size()), gw(d.w_size());
    CHECK_CUDA(cudaMemset(u.ptr, 0, d.u_size() * sizeof(T)));
    CHECK_CUDA(cudaMemset(w.ptr, 0, d.w_size() * sizeof(T)));
    CHECK_CUDA(cudaMemset(out.ptr, 0, d.u_hat_size() * sizeof(T)));
    for (GpuAlgo algo : {GpuAlgo::kAuto, GpuAlgo::kGeneric}) {
      const size_t ws_bytes = capsnet::CapsulePredictionGradWorkspaceBytes<T>(d, algo);
      void* ws = nullptr;
      if (ws_bytes > 0) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
      const double fwd_us = TimeUs([&] {
        CHECK_LAUNCH(capsnet::LaunchCapsulePredictionForward<T>(u.ptr, w.ptr, out.ptr, d, stream, algo));
      }, iters, repeats, stream);
      const double bwd_us = TimeUs([&] {
        CHECK_LAUNCH(capsnet::LaunchCapsulePredictionGrad<T>(out.ptr, u.ptr, w.ptr, gu.ptr, gw.ptr,
                                                             ws, ws_bytes, d, stream, algo));
      }, iters, repeats, stream);
      const double small = double(d.u_size() + d.w_size()) * sizeof(T);
      const double big = double(d.u_hat_size()) * sizeof(T);
      const double fwd_bytes = small + big;
      const double bwd_bytes = 2 * small + big;
      for (int pass = 0; pass < 2; ++pass) {
        const double us = pass == 0 ? fwd_us : bwd_us;
        const double bytes = pass == 0 ? fwd_bytes : bwd_bytes;
        const double gbs = bytes / (us * 1e3);
        const double floor_us = bytes / (copy_gbs * 1e3);
        std::printf("| %s (%lld, %lld, %lld, %lld, %lld) | %s | %s | %.1f | %.0f | %.0f | %.2f |\n",
                    name, (long long)d.batch, (long long)d.in_caps, (long long)d.out_caps,
                    (long long)d.out_dim, (long long)d.in_dim,
                    algo == GpuAlgo::kAuto ? "tiled" : "generic", pass == 0 ? "forward" : "backward",
                    us, gbs, 100.0 * gbs / copy_gbs, us / floor_us);
      }
      if (ws != nullptr) CHECK_CUDA(cudaFree(ws));
    }
  }

  // Fused routing, r = 3, in float and in bfloat16 (the mixed_bfloat16 step's
  // type): the forward (prediction + 3 iterations) and the gradient. Bytes: the inputs and outputs once (u, W, s_j, c_ij; backward:
  // u, W, c_ij, grad_s, grad_u, grad_W), for comparison with the unfused path's
  // u_hat of B*I*J*D floats written once and read ~7 times.
  std::printf("\n| shape (B, I, J, D, K) | fused %srouting, r=3 | pass | us | bytes in+out (MB) | u_hat (MB) |\n",
              opt.leaky ? "leaky " : "");
  std::printf("|---|---|---|---:|---:|---:|\n");
  auto bench_routing = [&](auto type_tag, const char* type_name, GpuAlgo algo) {
    using T = decltype(type_tag);
    for (const auto& named : shapes) {
      const char* name = named.first;
      const CapsuleDims d = named.second;
      const int iterations = 3;
      const int64 s_size = d.batch * d.rows_per_cap(), c_size = d.batch * d.in_caps * d.out_caps;
      DeviceBuffer<T> u(d.u_size()), w(d.w_size()), s_j(s_size), c_ij(c_size), g(s_size);
      DeviceBuffer<T> gu(d.u_size()), gw(d.w_size());
      CHECK_CUDA(cudaMemset(u.ptr, 0, d.u_size() * sizeof(T)));
      CHECK_CUDA(cudaMemset(w.ptr, 0, d.w_size() * sizeof(T)));
      CHECK_CUDA(cudaMemset(g.ptr, 0, s_size * sizeof(T)));
      const size_t fwd_bytes = capsnet::CapsuleRoutingWorkspaceBytes<T>(d, iterations, algo);
      const size_t grad_bytes = capsnet::CapsuleRoutingGradWorkspaceBytes<T>(d, algo);
      void* fwd_ws = nullptr;
      void* grad_ws = nullptr;
      if (fwd_bytes > 0) CHECK_CUDA(cudaMalloc(&fwd_ws, fwd_bytes));
      if (grad_bytes > 0) CHECK_CUDA(cudaMalloc(&grad_ws, grad_bytes));
      const double fwd_us = TimeUs([&] {
        CHECK_LAUNCH(capsnet::LaunchCapsuleRoutingForward<T>(u.ptr, w.ptr, s_j.ptr, c_ij.ptr, fwd_ws,
                                                             fwd_bytes, d, iterations, opt.leaky, stream,
                                                             algo));
      }, iters, repeats, stream);
      const double bwd_us = TimeUs([&] {
        CHECK_LAUNCH(capsnet::LaunchCapsuleRoutingGrad<T>(c_ij.ptr, g.ptr, u.ptr, w.ptr, gu.ptr, gw.ptr,
                                                          grad_ws, grad_bytes, d, stream, algo));
      }, iters, repeats, stream);
      const double small = double(d.u_size() + d.w_size()) * sizeof(T);
      const double sc = double(s_size + c_size) * sizeof(T);
      const double u_hat_mb = double(d.u_hat_size()) * sizeof(T) / 1e6;
      std::printf("| %s (%lld, %lld, %lld, %lld, %lld) | tiled %s | forward | %.1f | %.1f | %.1f |\n", name,
                  (long long)d.batch, (long long)d.in_caps, (long long)d.out_caps, (long long)d.out_dim,
                  (long long)d.in_dim, type_name, fwd_us, (small + sc) / 1e6, u_hat_mb);
      std::printf("| %s (%lld, %lld, %lld, %lld, %lld) | tiled %s | backward | %.1f | %.1f | %.1f |\n", name,
                  (long long)d.batch, (long long)d.in_caps, (long long)d.out_caps, (long long)d.out_dim,
                  (long long)d.in_dim, type_name, bwd_us, (2 * small + sc) / 1e6, u_hat_mb);
      if (fwd_ws != nullptr) CHECK_CUDA(cudaFree(fwd_ws));
      if (grad_ws != nullptr) CHECK_CUDA(cudaFree(grad_ws));
    }
  };
  bench_routing(float(), "float", GpuAlgo::kAuto);
  bench_routing(float(), "float cuda-cores", GpuAlgo::kCudaCores);
  bench_routing(capsnet::bfloat16_t(), "bfloat16", GpuAlgo::kAuto);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

int main(int argc, char** argv) {
  bool bench = false;
  BenchOptions opt;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--bench") {
      bench = true;
    } else if (arg == "--iters" && a + 1 < argc) {
      opt.iters = std::max(1, std::atoi(argv[++a]));
    } else if (arg == "--repeats" && a + 1 < argc) {
      opt.repeats = std::max(1, std::atoi(argv[++a]));
    } else if (arg == "--shape" && a + 1 < argc) {
      opt.shape = argv[++a];
    } else if (arg == "--routing") {
      opt.routing = true;
    } else if (arg == "--leaky") {
      opt.leaky = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--bench [--iters N] [--repeats N] [--shape NAME] [--routing] [--leaky]]\n",
                   argv[0]);
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "sanitize_driver: no CUDA device\n");
    return 2;
  }
  return bench ? RunBench(opt) : RunChecks();
}
