// TensorFlow op Capsnet>CapsuleRouting (capsule prediction and all dynamic
// routing iterations, fused: u_hat is never written to memory) and
// Capsnet>CapsuleRoutingGrad (its stop-gradient gradient): registration, shape
// functions, the CPU kernels, the CPU and GPU functors and one OpKernel per op
// over device and dtype. Math and gradient rule in capsnet_kernels.h; the CUDA
// kernels live in routing.cu.cc behind its TF-free launchers.
#include <algorithm>
#include <cmath>

#include "capsnet_kernels.h"
#include "cpu_kernels.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/work_sharder.h"
#include "tsl/platform/tensor_float_32_utils.h"
#include "tf_glue.h"

// ============================================================================
// Fused routing on the CPU. A unit is one sample: its u_hat (I x JD values,
// 737 KB at the paper shape) is computed once into a buffer that stays in the
// core's cache for the r iterations, with the same mat-vec as the prediction
// op; W is transposed once per call (TransposeW) and shared by all units.
// Deterministic: every output element is computed by one unit in a fixed order.

namespace capsnet {
namespace {

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

// W transposed per capsule to (K x JD) in the accumulation type, the layout
// MatVecRows reads, for capsules [cap_begin, cap_end).
template <typename T>
void TransposeW(const T* W, Accumulator<T>* wt, const CapsuleDims& d, int64 cap_begin,
                int64 cap_end) {
  const int64 per_cap = d.rows_per_cap() * d.in_dim;
  for (int64 i = cap_begin; i < cap_end; ++i) {
    TransposeCapsule(W + i * per_cap, wt + i * per_cap, d.rows_per_cap(),
                     d.in_dim);
  }
}

// Accumulation values of scratch one call of RouteSamples needs (-1 if that
// overflows int64): one sample's u_hat (I x JD), b_ij and c_ij (I x J each),
// s_j and v_j (JD each) and u[b, i] (K).
int64 RouteScratchSize(const CapsuleDims& d) {
  const int64 jd = SizeMul(d.out_caps, d.out_dim);
  const int64 ij = SizeMul(d.in_caps, d.out_caps);
  return SizeAdd(SizeAdd(SizeAdd(SizeMul(d.in_caps, jd), SizeMul(2, ij)), SizeMul(2, jd)),
                 d.in_dim);
}

// Routes samples [b_begin, b_end) start to finish, their u_hat in `scratch`
// (RouteScratchSize(d) values, allocated by the caller); `leaky`: the softmax with
// the extra zero logit (capsnet_kernels.h).
template <typename T>
void RouteSamples(const T* u, const Accumulator<T>* wt, T* s_out, T* c_out,
                  const CapsuleDims& d, int iterations, bool leaky, int64 b_begin,
                  int64 b_end, Accumulator<T>* scratch) {
  using A = Accumulator<T>;
  const int64 I = d.in_caps, J = d.out_caps, D = d.out_dim, K = d.in_dim;
  const int64 jd = d.rows_per_cap();
  const A eps = static_cast<A>(kSquashEpsilon);
  if (J == 0) return;  // nothing to route (the op's kernel never calls this then)
  A* u_hat = scratch;
  A* b_ij = u_hat + I * jd;
  A* c = b_ij + I * J;
  A* s = c + I * J;
  A* v = s + jd;
  A* ub = v + jd;
  for (int64 b = b_begin; b < b_end; ++b) {
    for (int64 i = 0; i < I; ++i) {
      const T* u_bi = u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) ub[k] = static_cast<A>(u_bi[k]);
      MatVecRows(wt + i * K * jd, ub, u_hat + i * jd, jd, K);
    }
    std::fill_n(b_ij, I * J, A(0));
    for (int t = 0; t < iterations; ++t) {
      // c_ij = softmax_j(b_ij), as exp(b - max) / sum. Leaky: the softmax over
      // [0, b_i1..b_iJ], the zero logit in the max and (first) in the sum, not kept.
      for (int64 i = 0; i < I; ++i) {
        const A* bi = b_ij + i * J;
        A* ci = c + i * J;
        A m = leaky ? std::max(A(0), bi[0]) : bi[0];
        for (int64 j = 1; j < J; ++j) m = std::max(m, bi[j]);
        A sum = leaky ? std::exp(-m) : A(0);
        for (int64 j = 0; j < J; ++j) {
          ci[j] = std::exp(bi[j] - m);
          sum += ci[j];
        }
        for (int64 j = 0; j < J; ++j) ci[j] /= sum;
      }
      // s_j = sum_i c_ij u_hat_j|i, i in order.
      std::fill_n(s, jd, A(0));
      WeightedSum(c, u_hat, s, I, J, D);
      if (t == iterations - 1) break;
      // v_j = squash(s_j), written as capsnet.routing.squash computes it.
      for (int64 j = 0; j < J; ++j) {
        A sq = A(0);
        for (int64 x = j * D; x < (j + 1) * D; ++x) sq += s[x] * s[x];
        const A scale = sq / (A(1) + sq) / std::sqrt(sq + eps);
        for (int64 x = j * D; x < (j + 1) * D; ++x) v[x] = scale * s[x];
      }
      // b_ij += u_hat_j|i . v_j
      AddAgreement(u_hat, v, b_ij, I, J, D);
    }
    T* s_b = s_out + b * jd;
    for (int64 x = 0; x < jd; ++x) s_b[x] = static_cast<T>(s[x]);
    T* c_b = c_out + b * I * J;
    for (int64 x = 0; x < I * J; ++x) c_b[x] = static_cast<T>(c[x]);
  }
}

// grad_u_hat rows for RunGradUnits formed on the fly as c_ij * grad_s.
template <typename T>
struct CouplingGradRows {
  using A = Accumulator<T>;
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

}  // namespace

// The whole op and its gradient without TensorFlow (cpu_kernels.h), as the
// CPU functors below run them.
template <typename T>
bool CpuCapsuleRouting(const T* u, const T* W, T* s_j, T* c_ij, const CapsuleDims& d,
                       int iterations, bool leaky, int64 max_parts, const PartsRunner& run) {
  using A = Accumulator<T>;
  if (d.u_hat_size() == 0 || d.in_dim == 0) {
    // u_hat is empty or zero: s_j = 0, every b_ij stays 0, c_ij = 1 / out_caps
    // (leaky: 1 / (out_caps + 1), the zero logit's share left out).
    std::fill_n(s_j, d.batch * d.rows_per_cap(), static_cast<T>(A(0)));
    std::fill_n(c_ij, d.batch * d.in_caps * d.out_caps,
                static_cast<T>(A(1) / static_cast<A>(d.out_caps + (leaky ? 1 : 0))));
    return true;
  }
  std::unique_ptr<A[]> wt = TryAllocate<A>(d.w_size());
  if (wt == nullptr) return false;
  if (!RunUnitsInParts<A>(d.in_caps, 0, max_parts, run, [&](A*, int64 begin, int64 end) {
        TransposeW(W, wt.get(), d, begin, end);
      })) {
    return false;
  }
  return RunUnitsInParts<A>(d.batch, RouteScratchSize(d), max_parts, run,
                            [&](A* ws, int64 begin, int64 end) {
                              RouteSamples(u, wt.get(), s_j, c_ij, d, iterations, leaky, begin,
                                           end, ws);
                            });
}

template <typename T>
bool CpuCapsuleRoutingGrad(const T* u, const T* W, const T* c_ij, const T* grad_s, T* grad_u,
                           T* grad_W, const CapsuleDims& d, int64 max_parts,
                           const PartsRunner& run) {
  const CouplingGradRows<T> rows{c_ij, grad_s, d.in_caps, d.out_caps, d.out_dim};
  return CpuGrad(rows, u, W, grad_u, grad_W, d, max_parts, run);
}

#define CAPSNET_INSTANTIATE_ROUTING(T)                                                        \
  template bool CpuCapsuleRouting<T>(const T*, const T*, T*, T*, const CapsuleDims&, int,     \
                                     bool, int64, const PartsRunner&);                        \
  template bool CpuCapsuleRoutingGrad<T>(const T*, const T*, const T*, const T*, T*, T*,      \
                                         const CapsuleDims&, int64, const PartsRunner&);
CAPSNET_INSTANTIATE_ROUTING(float)
CAPSNET_INSTANTIATE_ROUTING(double)
CAPSNET_INSTANTIATE_ROUTING(Eigen::half)
CAPSNET_INSTANTIATE_ROUTING(Eigen::bfloat16)
#undef CAPSNET_INSTANTIATE_ROUTING

}  // namespace capsnet

// ============================================================================
// Capsnet>CapsuleRouting and Capsnet>CapsuleRoutingGrad: the op definitions,
// shape functions, functors and kernels.

namespace tensorflow {
namespace capsnet_ops {
namespace {

#define CAPSNET_S_LAYOUT "(batch, out_caps, out_dim)"
#define CAPSNET_C_LAYOUT "(batch, in_caps, out_caps)"
constexpr char kSLayout[] = CAPSNET_S_LAYOUT;
constexpr char kCLayout[] = CAPSNET_C_LAYOUT;

absl::Status RoutingShape(InferenceContext* c) {
  ShapeHandle u, w;
  TF_RETURN_IF_ERROR(WithInputRanks(c, 0, 1, &u, &w, kRoutingOp));
  DimensionHandle in_caps, in_dim;
  TF_RETURN_IF_ERROR(MergeInputDims(c, u, w, &in_caps, &in_dim, kRoutingOp));
  // u_hat is never materialised, but the kernels size their work by it (as the
  // run-time check in CheckForwardShapes does).
  TF_RETURN_IF_ERROR(CheckOutputFits(
      c, c->MakeShape({c->Dim(u, 0), in_caps, c->Dim(w, 1), c->Dim(w, 2)}),
      "u_hat (batch, in_caps, out_caps, out_dim)", kRoutingOp));
  ShapeHandle s_j = c->MakeShape({c->Dim(u, 0), c->Dim(w, 1), c->Dim(w, 2)});
  ShapeHandle c_ij = c->MakeShape({c->Dim(u, 0), in_caps, c->Dim(w, 1)});
  TF_RETURN_IF_ERROR(CheckOutputFits(c, s_j, "s_j (batch, out_caps, out_dim)", kRoutingOp));
  TF_RETURN_IF_ERROR(CheckOutputFits(c, c_ij, "c_ij (batch, in_caps, out_caps)", kRoutingOp));
  c->set_output(0, s_j);
  c->set_output(1, c_ij);
  return absl::OkStatus();
}

absl::Status RoutingGradShape(InferenceContext* c) {
  ShapeHandle u, w, cij, g;
  TF_RETURN_IF_ERROR(WithInputRanks(c, 0, 1, &u, &w, kRoutingOp));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 2, 3, "c_ij", kCLayout, &cij, kRoutingOp));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 3, 3, "grad_s", kSLayout, &g, kRoutingOp));
  DimensionHandle in_caps, in_dim, batch, out_caps, out_dim;
  TF_RETURN_IF_ERROR(MergeInputDims(c, u, w, &in_caps, &in_dim, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, cij, 0, "c_ij", u, 0, "u", "batch", &batch, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 0, "grad_s", u, 0, "u", "batch", &batch, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, cij, 1, "c_ij", w, 0, "W", "in_caps", &in_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, cij, 2, "c_ij", w, 1, "W", "out_caps", &out_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 1, "grad_s", w, 1, "W", "out_caps", &out_caps, kRoutingOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 2, "grad_s", w, 2, "W", "out_dim", &out_dim, kRoutingOp));
  SetGradOutputShapes(c, batch, in_caps, in_dim, out_caps, out_dim);
  return absl::OkStatus();
}

REGISTER_OP("Capsnet>CapsuleRouting")
    .Input("u: T")
    .Input("weights: T")
    .Output("s_j: T")
    .Output("c_ij: T")
    .Attr("iterations: int >= 1")
    .Attr("leaky: bool = false")
    .Attr(CAPSNET_TYPE_ATTR)
    .SetShapeFn(RoutingShape)
    .Doc(R"doc(
Capsule prediction and `iterations` rounds of dynamic routing, fused: u_hat is
never written to memory. leaky: every c_ij is the softmax over [0, b_i1..b_iJ]
with the extra zero logit ("none of the above") dropped, so a row sums to < 1
(the first round's c_ij = 1 / (out_caps + 1)); false (the default, and every
graph written before the attr existed): softmax_j(b_ij).

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
    .Attr(CAPSNET_TYPE_ATTR)
    .SetShapeFn(RoutingGradShape)
    .Doc(R"doc(
Gradient of Capsnet>CapsuleRouting under stop-gradient routing (c_ij constant:
the forward's output, leaky or not): with
grad_u_hat[b, i, j, d] = c_ij[b, i, j] * grad_s[b, j, d] (not materialised),
grad_u[b, i, k] = sum_{j,d} weights[i, j, d, k] * grad_u_hat[b, i, j, d] and
grad_weights[i, j, d, k] = sum_b grad_u_hat[b, i, j, d] * u[b, i, k].
)doc");

absl::Status CheckRoutingGradShapes(const TensorShape& u, const TensorShape& w,
                                    const TensorShape& cij, const TensorShape& g,
                                    CapsuleDims* d) {
  TF_RETURN_IF_ERROR(CheckForwardShapes(u, w, d, kRoutingOp));
  TensorShape want_c, want_g;
  TF_RETURN_IF_ERROR(CheckedShape({d->batch, d->in_caps, d->out_caps}, "c_ij " CAPSNET_C_LAYOUT,
                                  u, w, kRoutingOp, &want_c));
  TF_RETURN_IF_ERROR(CheckedShape({d->batch, d->out_caps, d->out_dim}, "s_j " CAPSNET_S_LAYOUT,
                                  u, w, kRoutingOp, &want_g));
  if (cij != want_c || g != want_g) {
    return errors::InvalidArgument(
        "capsule_routing gradient: c_ij ", cij.DebugString(), " and grad_s ", g.DebugString(),
        " must be ", want_c.DebugString(), " ", kCLayout, " and ", want_g.DebugString(), " ",
        kSLayout, " for u ", u.DebugString(), " and W ", w.DebugString());
  }
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Functors: the device-specific part of each kernel, on checked shapes and
// allocated, not wholly empty outputs.

template <typename Device, typename T>
struct RoutingFunctor;  // u, W -> s_j, c_ij
template <typename Device, typename T>
struct RoutingGradFunctor;  // u, W, c_ij, grad_s -> grad_u, grad_W

template <typename T>
struct RoutingFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, int iterations,
                          bool leaky, const Tensor& u, const Tensor& w, Tensor* s_j,
                          Tensor* c_ij) const {
    using A = capsnet::Accumulator<T>;
    if (d.u_hat_size() == 0 || d.in_dim == 0) {
      // u_hat is empty or zero: s_j = 0, every b_ij stays 0, c_ij = 1 / out_caps
      // (leaky: 1 / (out_caps + 1)).
      s_j->flat<T>().setZero();
      c_ij->flat<T>().setConstant(
          static_cast<T>(A(1) / static_cast<A>(d.out_caps + (leaky ? 1 : 0))));
      return absl::OkStatus();
    }
    // The per-thread scratch first: it is the larger allocation when in_dim is 1.
    PartScratch<A> scratch;
    TF_RETURN_IF_ERROR(AllocatePartScratch(ctx, d.batch, capsnet::RouteScratchSize(d),
                                           "routing", kRoutingOp, &scratch));
    Tensor wt;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(DataTypeToEnum<A>::value, TensorShape({d.w_size()}), &wt));
    const T* u_ptr = u.flat<T>().data();
    const T* w_ptr = w.flat<T>().data();
    A* wt_ptr = wt.flat<A>().data();
    T* s_ptr = s_j->flat<T>().data();
    T* c_ptr = c_ij->flat<T>().data();
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t per_cap = d.rows_per_cap() * d.in_dim;
    Shard(workers->num_threads, workers->workers, d.in_caps, ShardCost(d.in_caps, {2, per_cap}),
          [&](int64_t begin, int64_t end) { capsnet::TransposeW(w_ptr, wt_ptr, d, begin, end); });
    // Per sample: the prediction (K FMAs per u_hat element), then per iteration
    // the weighted sum and the agreement (one FMA each per element).
    RunParts(ctx, scratch,
             ShardCost(d.batch, {d.in_caps, d.rows_per_cap(),
                                 capsnet::SizeAdd(2 * d.in_dim, 4 * int64_t{iterations})}),
             [&](A* ws, int64_t begin, int64_t end) {
               capsnet::RouteSamples(u_ptr, wt_ptr, s_ptr, c_ptr, d, iterations, leaky, begin,
                                     end, ws);
             });
    return absl::OkStatus();
  }
};

template <typename T>
struct RoutingGradFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, const Tensor& u,
                          const Tensor& w, const Tensor& c_ij, const Tensor& grad_s,
                          Tensor* grad_u, Tensor* grad_w) const {
    const capsnet::CouplingGradRows<T> rows{c_ij.flat<T>().data(), grad_s.flat<T>().data(),
                                            d.in_caps, d.out_caps, d.out_dim};
    return RunCpuGrad<T>(ctx, d, rows, u, w, grad_u, grad_w, kRoutingOp);
  }
};

#if GOOGLE_CUDA

template <typename T>
struct RoutingFunctor<GPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, int iterations,
                          bool leaky, const Tensor& u, const Tensor& w, Tensor* s_j,
                          Tensor* c_ij) const {
    using G = typename GpuType<T>::type;
    const capsnet::GpuAlgo algo = capsnet::RoutingAlgo<G>(tsl::tensor_float_32_execution_enabled());
    const std::size_t ws_bytes = capsnet::CapsuleRoutingWorkspaceBytes<G>(d, iterations, algo);
    return LaunchOnOpStream(ctx, ws_bytes, "routing", kRoutingOp,
                            [&](void* ws, capsnet::GpuStream stream) {
                              return capsnet::LaunchCapsuleRoutingForward(
                                  DevPtr<T>(u), DevPtr<T>(w), DevPtr<T>(s_j), DevPtr<T>(c_ij),
                                  ws, ws_bytes, d, iterations, leaky, stream, algo);
                            });
  }
};

template <typename T>
struct RoutingGradFunctor<GPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, const Tensor& u,
                          const Tensor& w, const Tensor& c_ij, const Tensor& grad_s,
                          Tensor* grad_u, Tensor* grad_w) const {
    using G = typename GpuType<T>::type;
    const capsnet::GpuAlgo algo = capsnet::RoutingAlgo<G>(tsl::tensor_float_32_execution_enabled());
    const std::size_t ws_bytes = capsnet::CapsuleRoutingGradWorkspaceBytes<G>(d, algo);
    return LaunchOnOpStream(ctx, ws_bytes, "routing gradient", kRoutingOp,
                            [&](void* ws, capsnet::GpuStream stream) {
                              return capsnet::LaunchCapsuleRoutingGrad(
                                  DevPtr<T>(c_ij), DevPtr<T>(grad_s), DevPtr<T>(u), DevPtr<T>(w),
                                  DevPtr<T>(grad_u), DevPtr<T>(grad_w), ws, ws_bytes, d, stream,
                                  algo);
                            });
  }
};

#endif  // GOOGLE_CUDA

// ----------------------------------------------------------------------------
// OpKernels: check the inputs at run time (shapes may be unknown at trace
// time), allocate the outputs, and hand work to the functor unless every
// output is empty.

template <typename Device, typename T>
class CapsuleRoutingOp : public OpKernel {
 public:
  explicit CapsuleRoutingOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("iterations", &iterations_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("leaky", &leaky_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& w = ctx->input(1);
    CapsuleDims d;
    OP_REQUIRES_OK(ctx, CheckForwardShapes(u.shape(), w.shape(), &d, kRoutingOp));
    TensorShape s_shape, c_shape;
    OP_REQUIRES_OK(ctx, CheckedShape({d.batch, d.out_caps, d.out_dim}, "s_j " CAPSNET_S_LAYOUT,
                                     u.shape(), w.shape(), kRoutingOp, &s_shape));
    OP_REQUIRES_OK(ctx, CheckedShape({d.batch, d.in_caps, d.out_caps}, "c_ij " CAPSNET_C_LAYOUT,
                                     u.shape(), w.shape(), kRoutingOp, &c_shape));
    Tensor* s_j = nullptr;
    Tensor* c_ij = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, s_shape, &s_j));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, c_shape, &c_ij));
    if (s_j->NumElements() == 0 && c_ij->NumElements() == 0) return;
    OP_REQUIRES_OK(ctx,
                   RoutingFunctor<Device, T>()(ctx, d, iterations_, leaky_, u, w, s_j, c_ij));
  }

 private:
  int iterations_;
  bool leaky_;
};

template <typename Device, typename T>
class CapsuleRoutingGradOp : public OpKernel {
 public:
  explicit CapsuleRoutingGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& w = ctx->input(1);
    const Tensor& c_ij = ctx->input(2);
    const Tensor& grad_s = ctx->input(3);
    CapsuleDims d;
    OP_REQUIRES_OK(ctx,
                   CheckRoutingGradShapes(u.shape(), w.shape(), c_ij.shape(), grad_s.shape(), &d));
    Tensor* grad_u = nullptr;
    Tensor* grad_w = nullptr;
    OP_REQUIRES_OK(ctx, AllocateGradOutputs(ctx, u.shape(), w.shape(), &grad_u, &grad_w));
    if (grad_u->NumElements() == 0 && grad_w->NumElements() == 0) return;
    OP_REQUIRES_OK(ctx, RoutingGradFunctor<Device, T>()(ctx, d, u, w, c_ij, grad_s, grad_u,
                                                        grad_w));
  }
};

CAPSNET_REGISTER_KERNELS("Capsnet>CapsuleRouting", CapsuleRoutingOp)
CAPSNET_REGISTER_KERNELS("Capsnet>CapsuleRoutingGrad", CapsuleRoutingGradOp)

}  // namespace
}  // namespace capsnet_ops
}  // namespace tensorflow
