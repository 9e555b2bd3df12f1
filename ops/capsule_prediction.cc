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

template <typename T>
void CapsulePredictionCpu<T>::Grad(const T* grad, const T* u, const T* W,
                                   T* grad_u, T* grad_W, void* partials,
                                   const CapsuleDims& d, int64 unit_begin,
                                   int64 unit_end) {
  using A = CpuAcc<T>;
  const int64 jd = d.rows_per_cap(), K = d.in_dim, I = d.in_caps;
  const int64 rows = d.rows();
  const int64 chunks = GradChunks(d);
  const int64 per_chunk = (d.batch + chunks - 1) / chunks;
  std::vector<A> wt(jd * K), gwt(jd * K), ub(K), gu(K);
  std::vector<A> g_row(std::is_same_v<T, A> ? 0 : jd);
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
      const T* g_bi = grad + b * rows + i * jd;  // grad[b, i, :, :] as JD rows
      const A* g;
      if constexpr (std::is_same_v<T, A>) {
        g = g_bi;
      } else {
        for (int64 r = 0; r < jd; ++r) g_row[r] = static_cast<A>(g_bi[r]);
        g = g_row.data();
      }
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
absl::Status MergeNamed(InferenceContext* c, ShapeHandle a, int a_dim,
                        const char* a_name, ShapeHandle b, int b_dim,
                        const char* b_name, const char* what,
                        DimensionHandle* out) {
  DimensionHandle da = c->Dim(a, a_dim), db = c->Dim(b, b_dim);
  if (c->ValueKnown(da) && c->ValueKnown(db) && c->Value(da) != c->Value(db)) {
    return errors::InvalidArgument(
        "capsule_prediction: ", what, " disagrees between ", a_name, " ",
        c->DebugString(a), " (dim ", a_dim, " = ", c->Value(da), ") and ", b_name,
        " ", c->DebugString(b), " (dim ", b_dim, " = ", c->Value(db), ")");
  }
  return c->Merge(da, db, out);
}

absl::Status WithRankNamed(InferenceContext* c, int input, int rank,
                           const char* name, const char* layout,
                           ShapeHandle* out) {
  ShapeHandle s = c->input(input);
  if (c->RankKnown(s) && c->Rank(s) != rank) {
    std::string all;
    for (int x = 0; x < c->num_inputs(); ++x) {
      all += (x ? ", " : "") + c->DebugString(c->input(x));
    }
    return errors::InvalidArgument("capsule_prediction: ", name, " must have rank ",
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
                                capsnet::CapsuleDims* dims) {
  if (u.dims() != 3 || w.dims() != 4) {
    return errors::InvalidArgument(
        "capsule_prediction: u must be ", kULayout, " and W ", kWLayout,
        ", got u ", u.DebugString(), " and W ", w.DebugString());
  }
  if (u.dim_size(1) != w.dim_size(0)) {
    return errors::InvalidArgument(
        "capsule_prediction: in_caps disagrees between u ", u.DebugString(),
        " (dim 1) and W ", w.DebugString(), " (dim 0)");
  }
  if (u.dim_size(2) != w.dim_size(3)) {
    return errors::InvalidArgument(
        "capsule_prediction: in_dim disagrees between u ", u.DebugString(),
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

absl::Status PrepareGrad(OpKernelContext* ctx, capsnet::CapsuleDims* d, Tensor** grad_u,
                         Tensor** grad_w) {
  const TensorShape& u = ctx->input(1).shape();
  const TensorShape& w = ctx->input(2).shape();
  TF_RETURN_IF_ERROR(CheckGradShapes(ctx->input(0).shape(), u, w, d));
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, u, grad_u));
  return ctx->allocate_output(1, w, grad_w);
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
    const T* g_ptr = g.flat<T>().data();
    const T* u_ptr = u.flat<T>().data();
    const T* w_ptr = w.flat<T>().data();
    T* gu_ptr = grad_u->flat<T>().data();
    T* gw_ptr = grad_w->flat<T>().data();
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t chunk_batch = (d.batch + Cpu::GradChunks(d) - 1) / Cpu::GradChunks(d);
    const int64_t cost = (chunk_batch + 1) * 4 * d.rows_per_cap() * (d.in_dim + 1);
    Shard(workers->num_threads, workers->workers, Cpu::GradUnits(d), cost,
          [&](int64_t begin, int64_t end) {
            Cpu::Grad(g_ptr, u_ptr, w_ptr, gu_ptr, gw_ptr, partials_ptr, d, begin, end);
          });
    if (partials_ptr != nullptr) {
      Shard(workers->num_threads, workers->workers, d.in_caps,
            Cpu::GradChunks(d) * d.rows_per_cap() * d.in_dim,
            [&](int64_t begin, int64_t end) {
              Cpu::ReduceGradW(partials_ptr, gw_ptr, d, begin, end);
            });
    }
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

absl::Status LaunchStatus(int status, const char* what) {
  if (status == 0) return absl::OkStatus();
  return errors::Internal("capsule_prediction: CUDA launch of the ", what,
                          " kernels failed: ", capsnet::GpuErrorString(status));
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
    capsnet::GpuStream stream;
    OP_REQUIRES_OK(ctx, GetGpuStream(ctx, &stream));
    OP_REQUIRES_OK(ctx, LaunchStatus(capsnet::LaunchCapsulePredictionForward(
                                         DevPtr<T>(u), DevPtr<T>(w), DevPtr<T>(u_hat),
                                         d, stream),
                                     "forward"));
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
    Tensor workspace;
    void* ws = nullptr;
    if (ws_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_UINT8,
                                             TensorShape({static_cast<int64_t>(ws_bytes)}),
                                             &workspace));
      ws = workspace.flat<uint8_t>().data();
    }
    capsnet::GpuStream stream;
    OP_REQUIRES_OK(ctx, GetGpuStream(ctx, &stream));
    OP_REQUIRES_OK(ctx, LaunchStatus(capsnet::LaunchCapsulePredictionGrad(
                                         DevPtr<T>(g), DevPtr<T>(u), DevPtr<T>(w),
                                         DevPtr<T>(grad_u), DevPtr<T>(grad_w), ws,
                                         ws_bytes, d, stream),
                                     "gradient"));
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

}  // namespace
}  // namespace tensorflow
