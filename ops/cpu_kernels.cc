// The CPU hot loops shared by both ops (declared, with the why of their layout,
// in cpu_kernels.h), compiled in target clones, and the gradient's work split.
#include "cpu_kernels.h"

namespace capsnet {
namespace {

// out[r] = sum_k wt[k * jd + r] * u[k] for r < jd; k runs in order 0..K-1 as on
// the GPU. Blocks of 32 rows keep their sums in vector registers across k.
template <typename A>
inline void MatVecRowsImpl(const A* __restrict wt, const A* __restrict u,
                           A* __restrict out, int64 jd, int64 K) {
  constexpr int64 kBlock = 32;
  int64 r0 = 0;
  for (; r0 + kBlock <= jd; r0 += kBlock) {
    A acc[kBlock] = {};
    for (int64 k = 0; k < K; ++k) {
      const A uk = u[k];
      const A* w = wt + k * jd + r0;
      for (int64 t = 0; t < kBlock; ++t) acc[t] += w[t] * uk;
    }
    for (int64 t = 0; t < kBlock; ++t) out[r0 + t] = acc[t];
  }
  for (int64 r = r0; r < jd; ++r) {
    A acc = A(0);
    for (int64 k = 0; k < K; ++k) acc += wt[k * jd + r] * u[k];
    out[r] = acc;
  }
}

// gu[k] = sum_r wt[k * jd + r] * g[r] and gwt[k * jd + r] += u[k] * g[r]. The
// dot product keeps 16 independent partial sums (added in a fixed order) so it
// vectorizes without reassociating floating point.
template <typename A>
inline void GradRowsImpl(const A* __restrict wt, const A* __restrict g,
                         const A* __restrict u, A* __restrict gu,
                         A* __restrict gwt, int64 jd, int64 K) {
  constexpr int64 kLanes = 16;
  for (int64 k = 0; k < K; ++k) {
    const A* w = wt + k * jd;
    A* gw = gwt + k * jd;
    const A uk = u[k];
    A lanes[kLanes] = {};
    int64 r = 0;
    for (; r + kLanes <= jd; r += kLanes) {
      for (int64 t = 0; t < kLanes; ++t) {
        lanes[t] += w[r + t] * g[r + t];
        gw[r + t] += uk * g[r + t];
      }
    }
    A s = A(0);
    for (int64 t = 0; t < kLanes; ++t) s += lanes[t];
    for (; r < jd; ++r) {
      s += w[r] * g[r];
      gw[r] += uk * g[r];
    }
    gu[k] = s;
  }
}

}  // namespace

CAPSNET_CLONES void MatVecRows(const float* wt, const float* u, float* out, int64 jd, int64 K) {
  MatVecRowsImpl(wt, u, out, jd, K);
}
CAPSNET_CLONES void MatVecRows(const double* wt, const double* u, double* out, int64 jd, int64 K) {
  MatVecRowsImpl(wt, u, out, jd, K);
}
CAPSNET_CLONES void GradRows(const float* wt, const float* g, const float* u, float* gu,
                             float* gwt, int64 jd, int64 K) {
  GradRowsImpl(wt, g, u, gu, gwt, jd, K);
}
CAPSNET_CLONES void GradRows(const double* wt, const double* g, const double* u, double* gu,
                             double* gwt, int64 jd, int64 K) {
  GradRowsImpl(wt, g, u, gu, gwt, jd, K);
}

// The backward splits the batch only when there are fewer capsules than this,
// so small layers still use every thread (shape-only: results do not depend on
// the thread count).
constexpr int64 kGradMinUnits = 64;
constexpr int64 kGradMinChunk = 32;

int64 GradChunks(const CapsuleDims& d) {
  if (d.in_caps >= kGradMinUnits || d.in_caps == 0) return 1;
  const int64 want = (kGradMinUnits + d.in_caps - 1) / d.in_caps;
  const int64 most = std::max<int64>(1, d.batch / kGradMinChunk);
  return std::max<int64>(1, std::min(want, most));
}

}  // namespace capsnet
