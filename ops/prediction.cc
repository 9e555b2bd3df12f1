// TensorFlow op Capsnet>CapsulePrediction (u_hat[b, i, j, :] = W[i, j] · u[b, i])
// and Capsnet>CapsulePredictionGrad (its gradient): registration, shape
// functions, the CPU kernels, the CPU and GPU functors and one OpKernel per op
// over device and dtype. The CUDA kernels live in prediction.cu.cc behind the
// TF-free launchers of capsnet_kernels.h; the GPU functors only hand them the
// op's CUDA stream.
#include <algorithm>
#include <type_traits>

#include "capsnet_kernels.h"
#include "cpu_kernels.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/work_sharder.h"
#include "tf_glue.h"

// ============================================================================
// CPU kernels: forward units are (in capsule, batch block) pairs, run on any
// thread pool; each u_hat row is written by exactly one unit, so results do
// not depend on the pool. The gradient is cpu_kernels.h's RunGradUnits with
// grad_u_hat rows read from memory.

namespace capsnet {
namespace {

// Batch rows per forward unit: enough to amortize transposing W_i.
constexpr int64 kForwardBatchBlock = 32;

int64 ForwardUnitCount(const CapsuleDims& d) {
  return d.in_caps * ((d.batch + kForwardBatchBlock - 1) / kForwardBatchBlock);
}

// Accumulation values of scratch one call of ForwardUnits needs (-1 if that
// overflows int64): W_i transposed (JD x K), u[b, i] (K) and, for the 16-bit
// types, one output row (JD).
template <typename T>
int64 ForwardScratchSize(const CapsuleDims& d) {
  const int64 jd = SizeMul(d.out_caps, d.out_dim);
  return SizeAdd(SizeAdd(SizeMul(jd, d.in_dim), d.in_dim),
                 std::is_same_v<T, Accumulator<T>> ? 0 : jd);
}

template <typename T>
void ForwardUnits(const T* u, const T* W, T* u_hat, const CapsuleDims& d, int64 unit_begin,
                  int64 unit_end, Accumulator<T>* scratch) {
  using A = Accumulator<T>;
  const int64 jd = d.rows_per_cap(), K = d.in_dim, I = d.in_caps;
  const int64 blocks = (d.batch + kForwardBatchBlock - 1) / kForwardBatchBlock;
  A* wt = scratch;
  A* ub = wt + jd * K;
  A* out_row = ub + K;
  int64 cached_i = -1;
  for (int64 unit = unit_begin; unit < unit_end; ++unit) {
    const int64 i = unit / blocks;
    const int64 b_begin = (unit - i * blocks) * kForwardBatchBlock;
    const int64 b_end = std::min(d.batch, b_begin + kForwardBatchBlock);
    if (i != cached_i) {  // consecutive units usually share the capsule
      TransposeCapsule(W + i * jd * K, wt, jd, K);
      cached_i = i;
    }
    for (int64 b = b_begin; b < b_end; ++b) {
      const T* u_bi = u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) ub[k] = static_cast<A>(u_bi[k]);
      T* dst = u_hat + (b * I + i) * jd;  // u_hat[b, i, :, :] as JD rows
      if constexpr (std::is_same_v<T, A>) {
        MatVecRows(wt, ub, dst, jd, K);
      } else {
        MatVecRows(wt, ub, out_row, jd, K);
        for (int64 r = 0; r < jd; ++r) dst[r] = static_cast<T>(out_row[r]);
      }
    }
  }
}

// grad_u_hat rows for RunGradUnits from a u_hat-sized gradient in memory.
// The rows grad_u_hat[b, i, :, :] (JD values) the gradient units read, in the
// accumulation type. Two sources: a u_hat-sized gradient in memory (the
// prediction op's gradient) or c_ij * grad_s formed on the fly (the fused
// routing op's), so both ops share one gradient implementation.
template <typename T>
struct MemoryGradRows {
  using A = Accumulator<T>;
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

}  // namespace

// The whole op and its gradient without TensorFlow (cpu_kernels.h), as the
// CPU functors below run them.
template <typename T>
bool CpuCapsulePrediction(const T* u, const T* W, T* u_hat, const CapsuleDims& d,
                          int64 max_parts, const PartsRunner& run) {
  return RunUnitsInParts<Accumulator<T>>(
      ForwardUnitCount(d), ForwardScratchSize<T>(d), max_parts, run,
      [&](Accumulator<T>* ws, int64 begin, int64 end) {
        ForwardUnits(u, W, u_hat, d, begin, end, ws);
      });
}

template <typename T>
bool CpuCapsulePredictionGrad(const T* grad, const T* u, const T* W, T* grad_u, T* grad_W,
                              const CapsuleDims& d, int64 max_parts, const PartsRunner& run) {
  const MemoryGradRows<T> rows{grad, d.in_caps, d.rows_per_cap()};
  return CpuGrad(rows, u, W, grad_u, grad_W, d, max_parts, run);
}

#define CAPSNET_INSTANTIATE_PREDICTION(T)                                                   \
  template bool CpuCapsulePrediction<T>(const T*, const T*, T*, const CapsuleDims&, int64, \
                                        const PartsRunner&);                                \
  template bool CpuCapsulePredictionGrad<T>(const T*, const T*, const T*, T*, T*,          \
                                            const CapsuleDims&, int64, const PartsRunner&);
CAPSNET_INSTANTIATE_PREDICTION(float)
CAPSNET_INSTANTIATE_PREDICTION(double)
CAPSNET_INSTANTIATE_PREDICTION(Eigen::half)
CAPSNET_INSTANTIATE_PREDICTION(Eigen::bfloat16)
#undef CAPSNET_INSTANTIATE_PREDICTION

}  // namespace capsnet

// ============================================================================
// Capsnet>CapsulePrediction and Capsnet>CapsulePredictionGrad: the op
// definitions, shape functions, functors and kernels.

namespace tensorflow {
namespace capsnet_ops {
namespace {

constexpr char kGradLayout[] = "(batch, in_caps, out_caps, out_dim)";

absl::Status ForwardShape(InferenceContext* c) {
  ShapeHandle u, w;
  TF_RETURN_IF_ERROR(WithInputRanks(c, 0, 1, &u, &w, kPredictionOp));
  DimensionHandle in_caps, in_dim;
  TF_RETURN_IF_ERROR(MergeInputDims(c, u, w, &in_caps, &in_dim, kPredictionOp));
  ShapeHandle u_hat = c->MakeShape({c->Dim(u, 0), in_caps, c->Dim(w, 1), c->Dim(w, 2)});
  TF_RETURN_IF_ERROR(
      CheckOutputFits(c, u_hat, "u_hat (batch, in_caps, out_caps, out_dim)", kPredictionOp));
  c->set_output(0, u_hat);
  return absl::OkStatus();
}

absl::Status GradShape(InferenceContext* c) {
  ShapeHandle g, u, w;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 4, "grad", kGradLayout, &g, kPredictionOp));
  TF_RETURN_IF_ERROR(WithInputRanks(c, 1, 2, &u, &w, kPredictionOp));
  DimensionHandle in_caps, in_dim, batch, out_caps, out_dim;
  TF_RETURN_IF_ERROR(MergeInputDims(c, u, w, &in_caps, &in_dim, kPredictionOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 0, "grad", u, 0, "u", "batch", &batch, kPredictionOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 1, "grad", w, 0, "W", "in_caps", &in_caps, kPredictionOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 2, "grad", w, 1, "W", "out_caps", &out_caps, kPredictionOp));
  TF_RETURN_IF_ERROR(MergeNamed(c, g, 3, "grad", w, 2, "W", "out_dim", &out_dim, kPredictionOp));
  SetGradOutputShapes(c, batch, in_caps, in_dim, out_caps, out_dim);
  return absl::OkStatus();
}

REGISTER_OP("Capsnet>CapsulePrediction")
    .Input("u: T")
    .Input("weights: T")
    .Output("u_hat: T")
    .Attr(CAPSNET_TYPE_ATTR)
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
    .Attr(CAPSNET_TYPE_ATTR)
    .SetShapeFn(GradShape)
    .Doc(R"doc(
Gradient of Capsnet>CapsulePrediction.

grad: (batch, in_caps, out_caps, out_dim) gradient of u_hat.
grad_u[b, i, k] = sum_{j,d} weights[i, j, d, k] * grad[b, i, j, d].
grad_weights[i, j, d, k] = sum_b grad[b, i, j, d] * u[b, i, k].
)doc");

absl::Status CheckGradShapes(const TensorShape& g, const TensorShape& u,
                             const TensorShape& w, CapsuleDims* dims) {
  TensorShape want;
  TF_RETURN_IF_ERROR(CheckForwardShapes(u, w, dims, kPredictionOp, &want));
  if (g != want) {
    return errors::InvalidArgument(
        "capsule_prediction gradient: grad ", g.DebugString(), " must be ", want.DebugString(),
        " ", kGradLayout, " for u ", u.DebugString(), " and W ", w.DebugString());
  }
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Functors: the device-specific part of each kernel, on checked shapes and
// allocated, non-empty outputs.

template <typename Device, typename T>
struct PredictionFunctor;  // u, W -> u_hat
template <typename Device, typename T>
struct PredictionGradFunctor;  // grad, u, W -> grad_u, grad_W

template <typename T>
struct PredictionFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, const Tensor& u,
                          const Tensor& w, Tensor* u_hat) const {
    using A = capsnet::Accumulator<T>;
    PartScratch<A> scratch;
    TF_RETURN_IF_ERROR(AllocatePartScratch(ctx, capsnet::ForwardUnitCount(d),
                                           capsnet::ForwardScratchSize<T>(d), "forward",
                                           kPredictionOp, &scratch));
    const T* u_ptr = u.flat<T>().data();
    const T* w_ptr = w.flat<T>().data();
    T* out = u_hat->flat<T>().data();
    RunParts(ctx, scratch,
             ShardCost(scratch.units, {capsnet::kForwardBatchBlock, d.rows_per_cap(),
                                       2 * d.in_dim + 1}),
             [&](A* ws, int64_t begin, int64_t end) {
               capsnet::ForwardUnits(u_ptr, w_ptr, out, d, begin, end, ws);
             });
    return absl::OkStatus();
  }
};

template <typename T>
struct PredictionGradFunctor<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, const Tensor& g,
                          const Tensor& u, const Tensor& w, Tensor* grad_u,
                          Tensor* grad_w) const {
    const capsnet::MemoryGradRows<T> rows{g.flat<T>().data(), d.in_caps, d.rows_per_cap()};
    return RunCpuGrad<T>(ctx, d, rows, u, w, grad_u, grad_w, kPredictionOp);
  }
};

#if GOOGLE_CUDA

template <typename T>
struct PredictionFunctor<GPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, const Tensor& u,
                          const Tensor& w, Tensor* u_hat) const {
    return LaunchOnOpStream(ctx, 0, "forward", kPredictionOp,
                            [&](void*, capsnet::GpuStream stream) {
                              return capsnet::LaunchCapsulePredictionForward(
                                  DevPtr<T>(u), DevPtr<T>(w), DevPtr<T>(u_hat), d, stream);
                            });
  }
};

template <typename T>
struct PredictionGradFunctor<GPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const CapsuleDims& d, const Tensor& g,
                          const Tensor& u, const Tensor& w, Tensor* grad_u,
                          Tensor* grad_w) const {
    using G = typename GpuType<T>::type;
    const std::size_t ws_bytes = capsnet::CapsulePredictionGradWorkspaceBytes<G>(d);
    return LaunchOnOpStream(ctx, ws_bytes, "gradient", kPredictionOp,
                            [&](void* ws, capsnet::GpuStream stream) {
                              return capsnet::LaunchCapsulePredictionGrad(
                                  DevPtr<T>(g), DevPtr<T>(u), DevPtr<T>(w), DevPtr<T>(grad_u),
                                  DevPtr<T>(grad_w), ws, ws_bytes, d, stream);
                            });
  }
};

#endif  // GOOGLE_CUDA

// ----------------------------------------------------------------------------
// OpKernels: check the inputs at run time (shapes may be unknown at trace
// time), allocate the outputs, and hand non-empty work to the functor.

template <typename Device, typename T>
class CapsulePredictionOp : public OpKernel {
 public:
  explicit CapsulePredictionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& u = ctx->input(0);
    const Tensor& w = ctx->input(1);
    CapsuleDims d;
    TensorShape u_hat_shape;
    OP_REQUIRES_OK(ctx,
                   CheckForwardShapes(u.shape(), w.shape(), &d, kPredictionOp, &u_hat_shape));
    Tensor* u_hat = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, u_hat_shape, &u_hat));
    if (u_hat->NumElements() == 0) return;
    OP_REQUIRES_OK(ctx, PredictionFunctor<Device, T>()(ctx, d, u, w, u_hat));
  }
};

template <typename Device, typename T>
class CapsulePredictionGradOp : public OpKernel {
 public:
  explicit CapsulePredictionGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& u = ctx->input(1);
    const Tensor& w = ctx->input(2);
    CapsuleDims d;
    OP_REQUIRES_OK(ctx, CheckGradShapes(g.shape(), u.shape(), w.shape(), &d));
    Tensor* grad_u = nullptr;
    Tensor* grad_w = nullptr;
    OP_REQUIRES_OK(ctx, AllocateGradOutputs(ctx, u.shape(), w.shape(), &grad_u, &grad_w));
    if (grad_u->NumElements() == 0 && grad_w->NumElements() == 0) return;
    OP_REQUIRES_OK(ctx, PredictionGradFunctor<Device, T>()(ctx, d, g, u, w, grad_u, grad_w));
  }
};

CAPSNET_REGISTER_KERNELS("Capsnet>CapsulePrediction", CapsulePredictionOp)
CAPSNET_REGISTER_KERNELS("Capsnet>CapsulePredictionGrad", CapsulePredictionGradOp)

}  // namespace
}  // namespace capsnet_ops
}  // namespace tensorflow
