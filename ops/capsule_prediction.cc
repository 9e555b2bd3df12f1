// TensorFlow op Capsnet>CapsulePrediction (u_hat[b, i, j, :] = W[i, j] · u[b, i])
// and Capsnet>CapsulePredictionGrad (its gradient), with the CPU kernels.
// The CUDA kernels live in capsule_prediction.cu.cc behind the launchers of
// capsule_prediction.h; this file only hands them the op's CUDA stream.
#include "capsule_prediction.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/work_sharder.h"
#if GOOGLE_CUDA
#include "tensorflow/core/framework/device_base.h"
#include "xla/stream_executor/stream.h"
#endif

namespace capsnet {

// ============================================================================
// CPU kernels.
//
// Per input capsule i the op is a (JD x K) matrix W_i times K-vectors. The hot
// loops run over the JD rows of W_i transposed to (K x JD) so every inner loop
// is a contiguous, vectorizable axpy or dot over JD. They are compiled twice
// (AVX2+FMA and AVX-512 clones next to the baseline) and picked at load time,
// because TensorFlow's flags target baseline x86-64.

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CAPSNET_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CAPSNET_CLONES
#endif

namespace {

template <typename T>
using CpuAcc = std::conditional_t<std::is_same_v<T, double>, double, float>;

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

// The two passes of a routing iteration over one sample's u_hat (I x J x D):
// s[j, d] += sum_i c[i, j] u_hat[i, j, d] (i in order) and
// b[i, j] += sum_d u_hat[i, j, d] v[j, d].
template <typename A>
inline void WeightedSumImpl(const A* __restrict c, const A* __restrict u_hat,
                            A* __restrict s, int64 I, int64 J, int64 D) {
  for (int64 i = 0; i < I; ++i) {
    const A* uh = u_hat + i * J * D;
    for (int64 j = 0; j < J; ++j) {
      const A cij = c[i * J + j];
      for (int64 x = j * D; x < (j + 1) * D; ++x) s[x] += cij * uh[x];
    }
  }
}

template <typename A>
inline void AddAgreementImpl(const A* __restrict u_hat, const A* __restrict v,
                             A* __restrict b, int64 I, int64 J, int64 D) {
  for (int64 i = 0; i < I; ++i) {
    const A* uh = u_hat + i * J * D;
    for (int64 j = 0; j < J; ++j) {
      A agreement = A(0);
      for (int64 x = j * D; x < (j + 1) * D; ++x) agreement += uh[x] * v[x];
      b[i * J + j] += agreement;
    }
  }
}

CAPSNET_CLONES void WeightedSum(const float* c, const float* u_hat, float* s, int64 I, int64 J,
                                int64 D) {
  WeightedSumImpl(c, u_hat, s, I, J, D);
}
CAPSNET_CLONES void WeightedSum(const double* c, const double* u_hat, double* s, int64 I,
                                int64 J, int64 D) {
  WeightedSumImpl(c, u_hat, s, I, J, D);
}
CAPSNET_CLONES void AddAgreement(const float* u_hat, const float* v, float* b, int64 I, int64 J,
                                 int64 D) {
  AddAgreementImpl(u_hat, v, b, I, J, D);
}
CAPSNET_CLONES void AddAgreement(const double* u_hat, const double* v, double* b, int64 I,
                                 int64 J, int64 D) {
  AddAgreementImpl(u_hat, v, b, I, J, D);
}

// Batch rows per forward unit: enough to amortize transposing W_i.
constexpr int64 kForwardBatchBlock = 32;
// The backward splits the batch only when there are fewer capsules than this,
// so small layers still use every thread (shape-only: results do not depend on
// the thread count).
constexpr int64 kGradMinUnits = 64;
constexpr int64 kGradMinChunk = 32;

// W_i (JD x K, row-major) -> wt (K x JD) in the accumulation type.
template <typename T, typename A>
void TransposeCapsule(const T* W_i, A* wt, int64 jd, int64 K) {
  for (int64 r = 0; r < jd; ++r) {
    for (int64 k = 0; k < K; ++k) wt[k * jd + r] = static_cast<A>(W_i[r * K + k]);
  }
}

}  // namespace

template <typename T>
int64 CapsulePredictionCpu<T>::ForwardUnits(const CapsuleDims& d) {
  return d.in_caps * ((d.batch + kForwardBatchBlock - 1) / kForwardBatchBlock);
}

template <typename T>
void CapsulePredictionCpu<T>::Forward(const T* u, const T* W, T* u_hat,
                                      const CapsuleDims& d, int64 unit_begin,
                                      int64 unit_end) {
  using A = CpuAcc<T>;
  const int64 jd = d.rows_per_cap(), K = d.in_dim, I = d.in_caps;
  const int64 blocks = (d.batch + kForwardBatchBlock - 1) / kForwardBatchBlock;
  std::vector<A> wt(jd * K), ub(K), out_row(std::is_same_v<T, A> ? 0 : jd);
  int64 cached_i = -1;
  for (int64 unit = unit_begin; unit < unit_end; ++unit) {
    const int64 i = unit / blocks;
    const int64 b_begin = (unit - i * blocks) * kForwardBatchBlock;
    const int64 b_end = std::min(d.batch, b_begin + kForwardBatchBlock);
    if (i != cached_i) {  // consecutive units usually share the capsule
      TransposeCapsule(W + i * jd * K, wt.data(), jd, K);
      cached_i = i;
    }
    for (int64 b = b_begin; b < b_end; ++b) {
      const T* u_bi = u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) ub[k] = static_cast<A>(u_bi[k]);
      T* dst = u_hat + (b * I + i) * jd;  // u_hat[b, i, :, :] as JD rows
      if constexpr (std::is_same_v<T, A>) {
        MatVecRows(wt.data(), ub.data(), dst, jd, K);
      } else {
        MatVecRows(wt.data(), ub.data(), out_row.data(), jd, K);
        for (int64 r = 0; r < jd; ++r) dst[r] = static_cast<T>(out_row[r]);
      }
    }
  }
}

template <typename T>
int64 CapsulePredictionCpu<T>::GradChunks(const CapsuleDims& d) {
  if (d.in_caps >= kGradMinUnits || d.in_caps == 0) return 1;
  const int64 want = (kGradMinUnits + d.in_caps - 1) / d.in_caps;
  const int64 most = std::max<int64>(1, d.batch / kGradMinChunk);
  return std::max<int64>(1, std::min(want, most));
}

template <typename T>
int64 CapsulePredictionCpu<T>::GradUnits(const CapsuleDims& d) {
  return d.in_caps * GradChunks(d);
}

template <typename T>
int64 CapsulePredictionCpu<T>::GradPartialsSize(const CapsuleDims& d) {
  const int64 chunks = GradChunks(d);
  return chunks > 1 ? chunks * d.w_size() : 0;
}

namespace {

// The rows grad_u_hat[b, i, :, :] (JD values) the gradient units read, in the
// accumulation type. Two sources: a u_hat-sized gradient in memory (the
// prediction op's gradient) or c_ij * grad_s formed on the fly (the fused
// routing op's), so both ops share one gradient implementation.
template <typename T>
struct MemoryGradRows {
  using A = CpuAcc<T>;
  const T* grad;  // (batch, in_caps, out_caps, out_dim)
  int64 in_caps, jd;
  // Returns a pointer to the JD values; `scratch` holds JD values if needed.
  const A* Row(int64 b, int64 i, A* scratch) const {
    const T* g_bi = grad + (b * in_caps + i) * jd;  // grad[b, i, :, :] as JD rows
    if constexpr (std::is_same_v<T, A>) {
      return g_bi;
    } else {
      for (int64 r = 0; r < jd; ++r) scratch[r] = static_cast<A>(g_bi[r]);
      return scratch;
    }
  }
};

template <typename T>
struct CouplingGradRows {
  using A = CpuAcc<T>;
  const T* c_ij;    // (batch, in_caps, out_caps)
  const T* grad_s;  // (batch, out_caps, out_dim)
  int64 in_caps, out_caps, out_dim;
  const A* Row(int64 b, int64 i, A* scratch) const {
    const T* c = c_ij + (b * in_caps + i) * out_caps;
    const T* g = grad_s + b * out_caps * out_dim;
    for (int64 j = 0; j < out_caps; ++j) {
      const A cj = static_cast<A>(c[j]);
      for (int64 x = j * out_dim; x < (j + 1) * out_dim; ++x) {
        scratch[x] = cj * static_cast<A>(g[x]);
      }
    }
    return scratch;
  }
};

// The body of CapsulePredictionCpu<T>::Grad for any row source.
template <typename T, typename Rows>
void RunGradUnits(const Rows& rows_of, const T* u, const T* W, T* grad_u, T* grad_W,
                  void* partials, const CapsuleDims& d, int64 chunks, int64 unit_begin,
                  int64 unit_end) {
  using A = CpuAcc<T>;
  const int64 jd = d.rows_per_cap(), K = d.in_dim, I = d.in_caps;
  const int64 per_chunk = (d.batch + chunks - 1) / chunks;
  std::vector<A> wt(jd * K), gwt(jd * K), ub(K), gu(K), g_row(jd);
  for (int64 unit = unit_begin; unit < unit_end; ++unit) {
    const int64 i = unit / chunks;
    const int64 chunk = unit - i * chunks;
    const int64 b_begin = std::min(d.batch, chunk * per_chunk);
    const int64 b_end = std::min(d.batch, b_begin + per_chunk);
    TransposeCapsule(W + i * jd * K, wt.data(), jd, K);
    std::fill(gwt.begin(), gwt.end(), A(0));
    for (int64 b = b_begin; b < b_end; ++b) {
      const T* u_bi = u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) ub[k] = static_cast<A>(u_bi[k]);
      const A* g = rows_of.Row(b, i, g_row.data());
      GradRows(wt.data(), g, ub.data(), gu.data(), gwt.data(), jd, K);
      T* gu_bi = grad_u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) gu_bi[k] = static_cast<T>(gu[k]);
    }
    // gwt (K x JD) back to grad_W's (JD x K) layout.
    if (chunks == 1) {
      T* dst = grad_W + i * jd * K;
      for (int64 r = 0; r < jd; ++r) {
        for (int64 k = 0; k < K; ++k) dst[r * K + k] = static_cast<T>(gwt[k * jd + r]);
      }
    } else {
      A* dst = static_cast<A*>(partials) + chunk * d.w_size() + i * jd * K;
      for (int64 r = 0; r < jd; ++r) {
        for (int64 k = 0; k < K; ++k) dst[r * K + k] = gwt[k * jd + r];
      }
    }
  }
}

}  // namespace

template <typename T>
void CapsulePredictionCpu<T>::Grad(const T* grad, const T* u, const T* W,
                                   T* grad_u, T* grad_W, void* partials,
                                   const CapsuleDims& d, int64 unit_begin,
                                   int64 unit_end) {
  const MemoryGradRows<T> rows{grad, d.in_caps, d.rows_per_cap()};
  RunGradUnits(rows, u, W, grad_u, grad_W, partials, d, GradChunks(d), unit_begin, unit_end);
}

template <typename T>
void CapsulePredictionCpu<T>::ReduceGradW(const void* partials, T* grad_W,
                                          const CapsuleDims& d, int64 cap_begin,
                                          int64 cap_end) {
  using A = CpuAcc<T>;
  const int64 chunks = GradChunks(d);
  const int64 per_cap = d.rows_per_cap() * d.in_dim;
  const A* p = static_cast<const A*>(partials);
  for (int64 x = cap_begin * per_cap; x < cap_end * per_cap; ++x) {
    A s = A(0);
    for (int64 c = 0; c < chunks; ++c) s += p[c * d.w_size() + x];
    grad_W[x] = static_cast<T>(s);
  }
}

template struct CapsulePredictionCpu<float>;
template struct CapsulePredictionCpu<double>;
template struct CapsulePredictionCpu<Eigen::half>;
template struct CapsulePredictionCpu<Eigen::bfloat16>;

// ----------------------------------------------------------------------------
// Fused routing on the CPU. A unit is one sample: its u_hat (I x JD values,
// 737 KB at the paper shape) is computed once into a buffer that stays in the
// core's cache for the r iterations, with the same mat-vec as the prediction
// op; W is transposed once per call (TransposeW) and shared by all units.

template <typename T>
int64 CapsuleRoutingCpu<T>::TransposedWSize(const CapsuleDims& d) {
  return d.w_size();
}

template <typename T>
void CapsuleRoutingCpu<T>::TransposeW(const T* W, void* wt, const CapsuleDims& d,
                                      int64 cap_begin, int64 cap_end) {
  using A = CpuAcc<T>;
  const int64 per_cap = d.rows_per_cap() * d.in_dim;
  for (int64 i = cap_begin; i < cap_end; ++i) {
    TransposeCapsule(W + i * per_cap, static_cast<A*>(wt) + i * per_cap, d.rows_per_cap(),
                     d.in_dim);
  }
}

template <typename T>
void CapsuleRoutingCpu<T>::Forward(const T* u, const void* wt_void, T* s_out, T* c_out,
                                   const CapsuleDims& d, int iterations, int64 b_begin,
                                   int64 b_end) {
  using A = CpuAcc<T>;
  const int64 I = d.in_caps, J = d.out_caps, D = d.out_dim, K = d.in_dim;
  const int64 jd = d.rows_per_cap();
  const A* wt = static_cast<const A*>(wt_void);
  const A eps = static_cast<A>(kSquashEpsilon);
  if (J == 0) return;  // nothing to route (the op's kernel never calls this then)
  std::vector<A> u_hat(I * jd), b_ij(I * J), c(I * J), s(jd), v(jd), ub(K);
  for (int64 b = b_begin; b < b_end; ++b) {
    for (int64 i = 0; i < I; ++i) {
      const T* u_bi = u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) ub[k] = static_cast<A>(u_bi[k]);
      MatVecRows(wt + i * K * jd, ub.data(), u_hat.data() + i * jd, jd, K);
    }
    std::fill(b_ij.begin(), b_ij.end(), A(0));
    for (int t = 0; t < iterations; ++t) {
      // c_ij = softmax_j(b_ij), as exp(b - max) / sum.
      for (int64 i = 0; i < I; ++i) {
        const A* bi = b_ij.data() + i * J;
        A* ci = c.data() + i * J;
        A m = bi[0];
        for (int64 j = 1; j < J; ++j) m = std::max(m, bi[j]);
        A sum = A(0);
        for (int64 j = 0; j < J; ++j) {
          ci[j] = std::exp(bi[j] - m);
          sum += ci[j];
        }
        for (int64 j = 0; j < J; ++j) ci[j] /= sum;
      }
      // s_j = sum_i c_ij u_hat_j|i, i in order.
      std::fill(s.begin(), s.end(), A(0));
      WeightedSum(c.data(), u_hat.data(), s.data(), I, J, D);
      if (t == iterations - 1) break;
      // v_j = squash(s_j), written as capsnet.routing.squash computes it.
      for (int64 j = 0; j < J; ++j) {
        A sq = A(0);
        for (int64 x = j * D; x < (j + 1) * D; ++x) sq += s[x] * s[x];
        const A scale = sq / (A(1) + sq) / std::sqrt(sq + eps);
        for (int64 x = j * D; x < (j + 1) * D; ++x) v[x] = scale * s[x];
      }
      // b_ij += u_hat_j|i . v_j
      AddAgreement(u_hat.data(), v.data(), b_ij.data(), I, J, D);
    }
    T* s_b = s_out + b * jd;
    for (int64 x = 0; x < jd; ++x) s_b[x] = static_cast<T>(s[x]);
    T* c_b = c_out + b * I * J;
    for (int64 x = 0; x < I * J; ++x) c_b[x] = static_cast<T>(c[x]);
  }
}

template <typename T>
void CapsuleRoutingCpu<T>::Grad(const T* c_ij, const T* grad_s, const T* u, const T* W,
                                T* grad_u, T* grad_W, void* partials, const CapsuleDims& d,
                                int64 unit_begin, int64 unit_end) {
  const CouplingGradRows<T> rows{c_ij, grad_s, d.in_caps, d.out_caps, d.out_dim};
  RunGradUnits(rows, u, W, grad_u, grad_W, partials, d, CapsulePredictionCpu<T>::GradChunks(d),
               unit_begin, unit_end);
}

template struct CapsuleRoutingCpu<float>;
template struct CapsuleRoutingCpu<double>;
template struct CapsuleRoutingCpu<Eigen::half>;
template struct CapsuleRoutingCpu<Eigen::bfloat16>;

}  // namespace capsnet

// ============================================================================
// TensorFlow op and kernels.

namespace tensorflow {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Merges dimension `a_dim` of `a` with dimension `b_dim` of `b`, with an error
// naming both full shapes when both are known and differ.
// `op` prefixes the message: the Python name of the op whose inputs disagree.
constexpr char kPredictionOp[] = "capsule_prediction";
constexpr char kRoutingOp[] = "capsule_routing";

absl::Status MergeNamed(InferenceContext* c, ShapeHandle a, int a_dim,
                        const char* a_name, ShapeHandle b, int b_dim,
                        const char* b_name, const char* what,
                        DimensionHandle* out, const char* op = kPredictionOp) {
  DimensionHandle da = c->Dim(a, a_dim), db = c->Dim(b, b_dim);
  if (c->ValueKnown(da) && c->ValueKnown(db) && c->Value(da) != c->Value(db)) {
    return errors::InvalidArgument(
        op, ": ", what, " disagrees between ", a_name, " ",
        c->DebugString(a), " (dim ", a_dim, " = ", c->Value(da), ") and ", b_name,
        " ", c->DebugString(b), " (dim ", b_dim, " = ", c->Value(db), ")");
  }
  return c->Merge(da, db, out);
}

absl::Status WithRankNamed(InferenceContext* c, int input, int rank,
                           const char* name, const char* layout,
                           ShapeHandle* out, const char* op = kPredictionOp) {
  ShapeHandle s = c->input(input);
  if (c->RankKnown(s) && c->Rank(s) != rank) {
    std::string all;
    for (int x = 0; x < c->num_inputs(); ++x) {
      all += (x ? ", " : "") + c->DebugString(c->input(x));
    }
    return errors::InvalidArgument(op, ": ", name, " must have rank ",
                                   rank, " ", layout, " but has shape ",
                                   c->DebugString(s), " (input shapes: ", all, ")");
  }
  return c->WithRank(s, rank, out);
}

constexpr char kULayout[] = "(batch, in_caps, in_dim)";
constexpr char kWLayout[] = "(in_caps, out_caps, out_dim, in_dim)";
constexpr char kGradLayout[] = "(batch, in_caps, out_caps, out_dim)";

absl::Status ForwardShape(InferenceContext* c) {
  ShapeHandle u, w;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 3, "u", kULayout, &u));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 1, 4, "W", kWLayout, &w));
  DimensionHandle in_caps, in_dim;
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 1, "u", w, 0, "W", "in_caps", &in_caps));
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 2, "u", w, 3, "W", "in_dim", &in_dim));
  c->set_output(0, c->MakeShape({c->Dim(u, 0), in_caps, c->Dim(w, 1), c->Dim(w, 2)}));
  return absl::OkStatus();
}

absl::Status GradShape(InferenceContext* c) {
  ShapeHandle g, u, w;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 4, "grad", kGradLayout, &g));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 1, 3, "u", kULayout, &u));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 2, 4, "W", kWLayout, &w));
  DimensionHandle in_caps, in_dim, batch, out_caps, out_dim;
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 1, "u", w, 0, "W", "in_caps", &in_caps));
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 2, "u", w, 3, "W", "in_dim", &in_dim));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 0, "grad", u, 0, "u", "batch", &batch));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 1, "grad", w, 0, "W", "in_caps", &in_caps));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 2, "grad", w, 1, "W", "out_caps", &out_caps));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 3, "grad", w, 2, "W", "out_dim", &out_dim));
  c->set_output(0, c->MakeShape({batch, in_caps, in_dim}));
  c->set_output(1, c->MakeShape({in_caps, out_caps, out_dim, in_dim}));
  return absl::OkStatus();
}

REGISTER_OP("Capsnet>CapsulePrediction")
    .Input("u: T")
    .Input("weights: T")
    .Output("u_hat: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(ForwardShape)
    .Doc(R"doc(
Capsule prediction u_hat[b, i, j, :] = weights[i, j] . u[b, i].

u: (batch, in_caps, in_dim) input capsule vectors.
weights: (in_caps, out_caps, out_dim, in_dim) transformation matrices W.
u_hat: (batch, in_caps, out_caps, out_dim) predictions.
)doc");

REGISTER_OP("Capsnet>CapsulePredictionGrad")
    .Input("grad: T")
    .Input("u: T")
    .Input("weights: T")
    .Output("grad_u: T")
    .Output("grad_weights: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(GradShape)
    .Doc(R"doc(
Gradient of Capsnet>CapsulePrediction.

grad: (batch, in_caps, out_caps, out_dim) gradient of u_hat.
grad_u[b, i, k] = sum_{j,d} weights[i, j, d, k] * grad[b, i, j, d].
grad_weights[i, j, d, k] = sum_b grad[b, i, j, d] * u[b, i, k].
)doc");

// Run-time shape checks (shapes may be unknown when the graph is built).
absl::Status CheckForwardShapes(const TensorShape& u, const TensorShape& w,
                                capsnet::CapsuleDims* dims, const char* op = kPredictionOp) {
  if (u.dims() != 3 || w.dims() != 4) {
    return errors::InvalidArgument(
        op, ": u must be ", kULayout, " and W ", kWLayout,
        ", got u ", u.DebugString(), " and W ", w.DebugString());
  }
  if (u.dim_size(1) != w.dim_size(0)) {
    return errors::InvalidArgument(
        op, ": in_caps disagrees between u ", u.DebugString(),
        " (dim 1) and W ", w.DebugString(), " (dim 0)");
  }
  if (u.dim_size(2) != w.dim_size(3)) {
    return errors::InvalidArgument(
        op, ": in_dim disagrees between u ", u.DebugString(),
        " (dim 2) and W ", w.DebugString(), " (dim 3)");
  }
  *dims = {u.dim_size(0), u.dim_size(1), w.dim_size(1), w.dim_size(2), u.dim_size(2)};
  return absl::OkStatus();
}

absl::Status CheckGradShapes(const TensorShape& g, const TensorShape& u,
                             const TensorShape& w, capsnet::CapsuleDims* dims) {
  TF_RETURN_IF_ERROR(CheckForwardShapes(u, w, dims));
  const TensorShape want({dims->batch, dims->in_caps, dims->out_caps, dims->out_dim});
  if (g != want) {
    return errors::InvalidArgument(
        "capsule_prediction gradient: grad ", g.DebugString(), " must be ", want.DebugString(),
        " ", kGradLayout, " for u ", u.DebugString(), " and W ", w.DebugString());
  }
  return absl::OkStatus();
}

// The CPU and GPU kernels share their prologue: check the inputs at run time (shapes
// may be unknown at trace time) and allocate the outputs.
absl::Status PrepareForward(OpKernelContext* ctx, capsnet::CapsuleDims* d, Tensor** u_hat) {
  TF_RETURN_IF_ERROR(CheckForwardShapes(ctx->input(0).shape(), ctx->input(1).shape(), d));
  return ctx->allocate_output(0, TensorShape({d->batch, d->in_caps, d->out_caps, d->out_dim}),
                              u_hat);
}

// Both gradient ops' outputs: dL/du and dL/dW, shaped like u and W.
absl::Status AllocateGradOutputs(OpKernelContext* ctx, const TensorShape& u, const TensorShape& w,
                                 Tensor** grad_u, Tensor** grad_w) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, u, grad_u));
  return ctx->allocate_output(1, w, grad_w);
}

absl::Status PrepareGrad(OpKernelContext* ctx, capsnet::CapsuleDims* d, Tensor** grad_u,
                         Tensor** grad_w) {
  const TensorShape& u = ctx->input(1).shape();
  const TensorShape& w = ctx->input(2).shape();
  TF_RETURN_IF_ERROR(CheckGradShapes(ctx->input(0).shape(), u, w, d));
  return AllocateGradOutputs(ctx, u, w, grad_u, grad_w);
}

template <typename T>
class CapsulePredictionCpuOp : public OpKernel {
 public:
  explicit CapsulePredictionCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& w = ctx->input(1);
    capsnet::CapsuleDims d;
    Tensor* u_hat = nullptr;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, &d, &u_hat));
    if (u_hat->NumElements() == 0) return;
    using Cpu = capsnet::CapsulePredictionCpu<T>;
    const T* u_ptr = u.flat<T>().data();
    const T* w_ptr = w.flat<T>().data();
    T* out = u_hat->flat<T>().data();
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t units = Cpu::ForwardUnits(d);
    const int64_t cost = 32 * (2 * d.rows_per_cap() * d.in_dim + d.rows_per_cap());
    Shard(workers->num_threads, workers->workers, units, cost,
          [&](int64_t begin, int64_t end) { Cpu::Forward(u_ptr, w_ptr, out, d, begin, end); });
  }
};

// Runs gradient units unit_fn(partials, begin, end) (CapsulePredictionCpu's
// units, from either gradient op) on the CPU pool, then sums the grad_W partials
// over batch chunks in chunk order.
template <typename T, typename UnitFn>
void ShardGradUnits(OpKernelContext* ctx, const capsnet::CapsuleDims& d, Tensor* grad_w,
                    UnitFn unit_fn) {
  using Cpu = capsnet::CapsulePredictionCpu<T>;
  using A = capsnet::CpuAcc<T>;
  Tensor partials;
  void* partials_ptr = nullptr;
  const int64_t partials_size = Cpu::GradPartialsSize(d);
  if (partials_size > 0) {
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<A>::value,
                                           TensorShape({partials_size}), &partials));
    partials_ptr = partials.flat<A>().data();
  }
  T* gw_ptr = grad_w->flat<T>().data();
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t chunk_batch = (d.batch + Cpu::GradChunks(d) - 1) / Cpu::GradChunks(d);
  const int64_t cost = (chunk_batch + 1) * 4 * d.rows_per_cap() * (d.in_dim + 1);
  Shard(workers->num_threads, workers->workers, Cpu::GradUnits(d), cost,
        [&](int64_t begin, int64_t end) { unit_fn(partials_ptr, begin, end); });
  if (partials_ptr != nullptr) {
    Shard(workers->num_threads, workers->workers, d.in_caps,
          Cpu::GradChunks(d) * d.rows_per_cap() * d.in_dim,
          [&](int64_t begin, int64_t end) {
            Cpu::ReduceGradW(partials_ptr, gw_ptr, d, begin, end);
          });
  }
}

template <typename T>
class CapsulePredictionGradCpuOp : public OpKernel {
 public:
  explicit CapsulePredictionGradCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& u = ctx->input(1);
    const Tensor& w = ctx->input(2);
    capsnet::CapsuleDims d;
    Tensor* grad_u = nullptr;
    Tensor* grad_w = nullptr;
    OP_REQUIRES_OK(ctx, PrepareGrad(ctx, &d, &grad_u, &grad_w));
    if (grad_u->NumElements() == 0 && grad_w->NumElements() == 0) return;
    const T* g_ptr = g.flat<T>().data();
    const T* u_ptr = u.flat<T>().data();
    const T* w_ptr = w.flat<T>().data();
    T* gu_ptr = grad_u->flat<T>().data();
    T* gw_ptr = grad_w->flat<T>().data();
    ShardGradUnits<T>(ctx, d, grad_w, [&](void* partials, int64_t begin, int64_t end) {
      capsnet::CapsulePredictionCpu<T>::Grad(g_ptr, u_ptr, w_ptr, gu_ptr, gw_ptr, partials, d,
                                             begin, end);
    });
  }
};

#define CAPSNET_REGISTER_CPU(T)                                                  \
  REGISTER_KERNEL_BUILDER(                                                       \
      Name("Capsnet>CapsulePrediction").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      CapsulePredictionCpuOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("Capsnet>CapsulePredictionGrad")                  \
                              .Device(DEVICE_CPU)                                \
                              .TypeConstraint<T>("T"),                           \
                          CapsulePredictionGradCpuOp<T>);
CAPSNET_REGISTER_CPU(float)
CAPSNET_REGISTER_CPU(double)
CAPSNET_REGISTER_CPU(Eigen::half)
CAPSNET_REGISTER_CPU(Eigen::bfloat16)
#undef CAPSNET_REGISTER_CPU

#if GOOGLE_CUDA

// TensorFlow element type -> the launchers' storage type (same bits).
template <typename T>
struct GpuType {
  using type = T;
};
template <>
struct GpuType<Eigen::half> {
  using type = capsnet::half_t;
};
template <>
struct GpuType<Eigen::bfloat16> {
  using type = capsnet::bfloat16_t;
};
static_assert(sizeof(Eigen::half) == sizeof(capsnet::half_t), "half layout");
static_assert(sizeof(Eigen::bfloat16) == sizeof(capsnet::bfloat16_t), "bfloat16 layout");

template <typename T>
const typename GpuType<T>::type* DevPtr(const Tensor& t) {
  return reinterpret_cast<const typename GpuType<T>::type*>(t.flat<T>().data());
}
template <typename T>
typename GpuType<T>::type* DevPtr(Tensor* t) {
  return reinterpret_cast<typename GpuType<T>::type*>(t->flat<T>().data());
}

// The CUDA stream TensorFlow runs this op's kernels on.
absl::Status GetGpuStream(OpKernelContext* ctx, capsnet::GpuStream* stream) {
  const DeviceContext* dc = ctx->op_device_context();
  if (dc == nullptr || dc->stream() == nullptr ||
      dc->stream()->platform_specific_handle().stream == nullptr) {
    return errors::Internal("capsule_prediction: no CUDA stream for device ",
                            ctx->device()->name());
  }
  *stream = static_cast<capsnet::GpuStream>(dc->stream()->platform_specific_handle().stream);
  return absl::OkStatus();
}

absl::Status LaunchStatus(int status, const char* what, const char* op) {
  if (status == 0) return absl::OkStatus();
  return errors::Internal(op, ": CUDA launch of the ", what,
                          " kernels failed: ", capsnet::GpuErrorString(status));
}

// The GPU ops' shared epilogue: `launch(ws, stream)` with a device scratch buffer of
// `ws_bytes` (nullptr for 0) on the CUDA stream TensorFlow runs this op on. The buffer's
// Tensor may go before the kernels finish: TensorFlow reuses the memory only for work
// queued later on the same stream.
template <typename Launch>
absl::Status LaunchOnOpStream(OpKernelContext* ctx, std::size_t ws_bytes, const char* what,
                              const char* op, Launch launch) {
  Tensor workspace;
  void* ws = nullptr;
  if (ws_bytes > 0) {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        DT_UINT8, TensorShape({static_cast<int64_t>(ws_bytes)}), &workspace));
    ws = workspace.flat<uint8_t>().data();
  }
  capsnet::GpuStream stream;
  TF_RETURN_IF_ERROR(GetGpuStream(ctx, &stream));
  return LaunchStatus(launch(ws, stream), what, op);
}

template <typename T>
class CapsulePredictionGpuOp : public OpKernel {
 public:
  explicit CapsulePredictionGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& w = ctx->input(1);
    capsnet::CapsuleDims d;
    Tensor* u_hat = nullptr;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, &d, &u_hat));
    if (u_hat->NumElements() == 0) return;
    OP_REQUIRES_OK(ctx, LaunchOnOpStream(ctx, 0, "forward", kPredictionOp,
                                         [&](void*, capsnet::GpuStream stream) {
                                           return capsnet::LaunchCapsulePredictionForward(
                                               DevPtr<T>(u), DevPtr<T>(w), DevPtr<T>(u_hat), d,
                                               stream);
                                         }));
  }
};

template <typename T>
class CapsulePredictionGradGpuOp : public OpKernel {
 public:
  explicit CapsulePredictionGradGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& u = ctx->input(1);
    const Tensor& w = ctx->input(2);
    capsnet::CapsuleDims d;
    Tensor* grad_u = nullptr;
    Tensor* grad_w = nullptr;
    OP_REQUIRES_OK(ctx, PrepareGrad(ctx, &d, &grad_u, &grad_w));
    if (grad_u->NumElements() == 0 && grad_w->NumElements() == 0) return;
    using G = typename GpuType<T>::type;
    const std::size_t ws_bytes = capsnet::CapsulePredictionGradWorkspaceBytes<G>(d);
    OP_REQUIRES_OK(ctx, LaunchOnOpStream(ctx, ws_bytes, "gradient", kPredictionOp,
                                         [&](void* ws, capsnet::GpuStream stream) {
                                           return capsnet::LaunchCapsulePredictionGrad(
                                               DevPtr<T>(g), DevPtr<T>(u), DevPtr<T>(w),
                                               DevPtr<T>(grad_u), DevPtr<T>(grad_w), ws,
                                               ws_bytes, d, stream);
                                         }));
  }
};

#define CAPSNET_REGISTER_GPU(T)                                                  \
  REGISTER_KERNEL_BUILDER(                                                       \
      Name("Capsnet>CapsulePrediction").Device(DEVICE_GPU).TypeConstraint<T>("T"), \
      CapsulePredictionGpuOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("Capsnet>CapsulePredictionGrad")                  \
                              .Device(DEVICE_GPU)                                \
                              .TypeConstraint<T>("T"),                           \
                          CapsulePredictionGradGpuOp<T>);
CAPSNET_REGISTER_GPU(float)
CAPSNET_REGISTER_GPU(double)
CAPSNET_REGISTER_GPU(Eigen::half)
CAPSNET_REGISTER_GPU(Eigen::bfloat16)
#undef CAPSNET_REGISTER_GPU

#endif  // GOOGLE_CUDA

// ============================================================================
// Fused dynamic routing: Capsnet>CapsuleRouting and Capsnet>CapsuleRoutingGrad
// (math and gradient rule in capsule_prediction.h).

constexpr char kSLayout[] = "(batch, out_caps, out_dim)";
constexpr char kCLayout[] = "(batch, in_caps, out_caps)";

absl::Status RoutingShape(InferenceContext* c) {
  ShapeHandle u, w;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 3, "u", kULayout, &u, kRoutingOp));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 1, 4, "W", kWLayout, &w, kRoutingOp));
  DimensionHandle in_caps, in_dim;
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 1, "u", w, 0, "W", "in_caps", &in_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 2, "u", w, 3, "W", "in_dim", &in_dim, kRoutingOp));
  c->set_output(0, c->MakeShape({c->Dim(u, 0), c->Dim(w, 1), c->Dim(w, 2)}));
  c->set_output(1, c->MakeShape({c->Dim(u, 0), in_caps, c->Dim(w, 1)}));
  return absl::OkStatus();
}

absl::Status RoutingGradShape(InferenceContext* c) {
  ShapeHandle u, w, cij, g;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 3, "u", kULayout, &u, kRoutingOp));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 1, 4, "W", kWLayout, &w, kRoutingOp));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 2, 3, "c_ij", kCLayout, &cij, kRoutingOp));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 3, 3, "grad_s", kSLayout, &g, kRoutingOp));
  DimensionHandle in_caps, in_dim, batch, out_caps, out_dim;
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 1, "u", w, 0, "W", "in_caps", &in_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, u, 2, "u", w, 3, "W", "in_dim", &in_dim, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, cij, 0, "c_ij", u, 0, "u", "batch", &batch, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 0, "grad_s", u, 0, "u", "batch", &batch, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, cij, 1, "c_ij", w, 0, "W", "in_caps", &in_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, cij, 2, "c_ij", w, 1, "W", "out_caps", &out_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 1, "grad_s", w, 1, "W", "out_caps", &out_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 2, "grad_s", w, 2, "W", "out_dim", &out_dim, kRoutingOp));
  c->set_output(0, c->MakeShape({batch, in_caps, in_dim}));
  c->set_output(1, c->MakeShape({in_caps, out_caps, out_dim, in_dim}));
  return absl::OkStatus();
}

REGISTER_OP("Capsnet>CapsuleRouting")
    .Input("u: T")
    .Input("weights: T")
    .Output("s_j: T")
    .Output("c_ij: T")
    .Attr("iterations: int >= 1")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(RoutingShape)
    .Doc(R"doc(
Capsule prediction and `iterations` rounds of dynamic routing, fused: u_hat is
never written to memory.

u: (batch, in_caps, in_dim) input capsules.
weights: (in_caps, out_caps, out_dim, in_dim) transformation matrices W.
s_j: (batch, out_caps, out_dim) the last iteration's s_j = sum_i c_ij u_hat_j|i,
  before the squash.
c_ij: (batch, in_caps, out_caps) the last iteration's coupling coefficients.
)doc");

REGISTER_OP("Capsnet>CapsuleRoutingGrad")
    .Input("u: T")
    .Input("weights: T")
    .Input("c_ij: T")
    .Input("grad_s: T")
    .Output("grad_u: T")
    .Output("grad_weights: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(RoutingGradShape)
    .Doc(R"doc(
Gradient of Capsnet>CapsuleRouting under stop-gradient routing (c_ij constant):
with grad_u_hat[b, i, j, d] = c_ij[b, i, j] * grad_s[b, j, d] (not materialised),
grad_u[b, i, k] = sum_{j,d} weights[i, j, d, k] * grad_u_hat[b, i, j, d] and
grad_weights[i, j, d, k] = sum_b grad_u_hat[b, i, j, d] * u[b, i, k].
)doc");

absl::Status CheckRoutingGradShapes(const TensorShape& u, const TensorShape& w,
                                    const TensorShape& cij, const TensorShape& g,
                                    capsnet::CapsuleDims* d) {
  TF_RETURN_IF_ERROR(CheckForwardShapes(u, w, d, kRoutingOp));
  const TensorShape want_c({d->batch, d->in_caps, d->out_caps});
  const TensorShape want_g({d->batch, d->out_caps, d->out_dim});
  if (cij != want_c || g != want_g) {
    return errors::InvalidArgument(
        "capsule_routing gradient: c_ij ", cij.DebugString(), " and grad_s ", g.DebugString(),
        " must be ", want_c.DebugString(), " ", kCLayout, " and ", want_g.DebugString(), " ",
        kSLayout, " for u ", u.DebugString(), " and W ", w.DebugString());
  }
  return absl::OkStatus();
}

// The routing kernels' shared prologue, as PrepareForward / PrepareGrad.
absl::Status PrepareRouting(OpKernelContext* ctx, capsnet::CapsuleDims* d, Tensor** s_j,
                            Tensor** c_ij) {
  TF_RETURN_IF_ERROR(
      CheckForwardShapes(ctx->input(0).shape(), ctx->input(1).shape(), d, kRoutingOp));
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(0, TensorShape({d->batch, d->out_caps, d->out_dim}), s_j));
  return ctx->allocate_output(1, TensorShape({d->batch, d->in_caps, d->out_caps}), c_ij);
}

absl::Status PrepareRoutingGrad(OpKernelContext* ctx, capsnet::CapsuleDims* d, Tensor** grad_u,
                                Tensor** grad_w) {
  const TensorShape& u = ctx->input(0).shape();
  const TensorShape& w = ctx->input(1).shape();
  TF_RETURN_IF_ERROR(
      CheckRoutingGradShapes(u, w, ctx->input(2).shape(), ctx->input(3).shape(), d));
  return AllocateGradOutputs(ctx, u, w, grad_u, grad_w);
}

template <typename T>
class CapsuleRoutingCpuOp : public OpKernel {
 public:
  explicit CapsuleRoutingCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("iterations", &iterations_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& w = ctx->input(1);
    capsnet::CapsuleDims d;
    Tensor* s_j = nullptr;
    Tensor* c_ij = nullptr;
    OP_REQUIRES_OK(ctx, PrepareRouting(ctx, &d, &s_j, &c_ij));
    if (s_j->NumElements() == 0 && c_ij->NumElements() == 0) return;
    using A = capsnet::CpuAcc<T>;
    if (d.u_hat_size() == 0 || d.in_dim == 0) {
      // u_hat is empty or zero: s_j = 0, every b_ij stays 0, c_ij = 1 / out_caps.
      s_j->flat<T>().setZero();
      c_ij->flat<T>().setConstant(static_cast<T>(A(1) / static_cast<A>(d.out_caps)));
      return;
    }
    using Cpu = capsnet::CapsuleRoutingCpu<T>;
    Tensor wt;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<A>::value,
                                           TensorShape({Cpu::TransposedWSize(d)}), &wt));
    const T* u_ptr = u.flat<T>().data();
    const T* w_ptr = w.flat<T>().data();
    A* wt_ptr = wt.flat<A>().data();
    T* s_ptr = s_j->flat<T>().data();
    T* c_ptr = c_ij->flat<T>().data();
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t per_cap = d.rows_per_cap() * d.in_dim;
    Shard(workers->num_threads, workers->workers, d.in_caps, 2 * per_cap,
          [&](int64_t begin, int64_t end) { Cpu::TransposeW(w_ptr, wt_ptr, d, begin, end); });
    // Per sample: the prediction (K FMAs per u_hat element), then per iteration
    // the weighted sum and the agreement (one FMA each per element).
    const int64_t cost = d.in_caps * d.rows_per_cap() * (2 * d.in_dim + 4 * iterations_);
    const int iterations = iterations_;
    Shard(workers->num_threads, workers->workers, d.batch, cost,
          [&](int64_t begin, int64_t end) {
            Cpu::Forward(u_ptr, wt_ptr, s_ptr, c_ptr, d, iterations, begin, end);
          });
  }

 private:
  int iterations_;
};

template <typename T>
class CapsuleRoutingGradCpuOp : public OpKernel {
 public:
  explicit CapsuleRoutingGradCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    capsnet::CapsuleDims d;
    Tensor* grad_u = nullptr;
    Tensor* grad_w = nullptr;
    OP_REQUIRES_OK(ctx, PrepareRoutingGrad(ctx, &d, &grad_u, &grad_w));
    if (grad_u->NumElements() == 0 && grad_w->NumElements() == 0) return;
    const T* u_ptr = ctx->input(0).flat<T>().data();
    const T* w_ptr = ctx->input(1).flat<T>().data();
    const T* c_ptr = ctx->input(2).flat<T>().data();
    const T* g_ptr = ctx->input(3).flat<T>().data();
    T* gu_ptr = grad_u->flat<T>().data();
    T* gw_ptr = grad_w->flat<T>().data();
    ShardGradUnits<T>(ctx, d, grad_w, [&](void* partials, int64_t begin, int64_t end) {
      capsnet::CapsuleRoutingCpu<T>::Grad(c_ptr, g_ptr, u_ptr, w_ptr, gu_ptr, gw_ptr, partials,
                                          d, begin, end);
    });
  }
};

#define CAPSNET_REGISTER_CPU(T)                                                          \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Capsnet>CapsuleRouting").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      CapsuleRoutingCpuOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Capsnet>CapsuleRoutingGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
      CapsuleRoutingGradCpuOp<T>);
CAPSNET_REGISTER_CPU(float)
CAPSNET_REGISTER_CPU(double)
CAPSNET_REGISTER_CPU(Eigen::half)
CAPSNET_REGISTER_CPU(Eigen::bfloat16)
#undef CAPSNET_REGISTER_CPU

#if GOOGLE_CUDA

template <typename T>
class CapsuleRoutingGpuOp : public OpKernel {
 public:
  explicit CapsuleRoutingGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("iterations", &iterations_));
  }

  void Compute(OpKernelContext* ctx) override {
    capsnet::CapsuleDims d;
    Tensor* s_j = nullptr;
    Tensor* c_ij = nullptr;
    OP_REQUIRES_OK(ctx, PrepareRouting(ctx, &d, &s_j, &c_ij));
    if (s_j->NumElements() == 0 && c_ij->NumElements() == 0) return;
    using G = typename GpuType<T>::type;
    const std::size_t ws_bytes = capsnet::CapsuleRoutingWorkspaceBytes<G>(d, iterations_);
    OP_REQUIRES_OK(ctx, LaunchOnOpStream(ctx, ws_bytes, "routing", kRoutingOp,
                                         [&](void* ws, capsnet::GpuStream stream) {
                                           return capsnet::LaunchCapsuleRoutingForward(
                                               DevPtr<T>(ctx->input(0)),
                                               DevPtr<T>(ctx->input(1)), DevPtr<T>(s_j),
                                               DevPtr<T>(c_ij), ws, ws_bytes, d, iterations_,
                                               stream);
                                         }));
  }

 private:
  int iterations_;
};

template <typename T>
class CapsuleRoutingGradGpuOp : public OpKernel {
 public:
  explicit CapsuleRoutingGradGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    capsnet::CapsuleDims d;
    Tensor* grad_u = nullptr;
    Tensor* grad_w = nullptr;
    OP_REQUIRES_OK(ctx, PrepareRoutingGrad(ctx, &d, &grad_u, &grad_w));
    if (grad_u->NumElements() == 0 && grad_w->NumElements() == 0) return;
    using G = typename GpuType<T>::type;
    const std::size_t ws_bytes = capsnet::CapsuleRoutingGradWorkspaceBytes<G>(d);
    OP_REQUIRES_OK(ctx, LaunchOnOpStream(ctx, ws_bytes, "routing gradient", kRoutingOp,
                                         [&](void* ws, capsnet::GpuStream stream) {
                                           return capsnet::LaunchCapsuleRoutingGrad(
                                               DevPtr<T>(ctx->input(2)),
                                               DevPtr<T>(ctx->input(3)),
                                               DevPtr<T>(ctx->input(0)),
                                               DevPtr<T>(ctx->input(1)), DevPtr<T>(grad_u),
                                               DevPtr<T>(grad_w), ws, ws_bytes, d, stream);
                                         }));
  }
};

#define CAPSNET_REGISTER_GPU(T)                                                          \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Capsnet>CapsuleRouting").Device(DEVICE_GPU).TypeConstraint<T>("T"),          \
      CapsuleRoutingGpuOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Capsnet>CapsuleRoutingGrad").Device(DEVICE_GPU).TypeConstraint<T>("T"),      \
      CapsuleRoutingGradGpuOp<T>);
CAPSNET_REGISTER_GPU(float)
CAPSNET_REGISTER_GPU(double)
CAPSNET_REGISTER_GPU(Eigen::half)
CAPSNET_REGISTER_GPU(Eigen::bfloat16)
#undef CAPSNET_REGISTER_GPU

#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tensorflow
