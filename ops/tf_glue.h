// TensorFlow-side glue shared by the OpKernels of both ops (prediction.cc,
// routing.cc): the dtype list, the device tags, the shape checks with the
// errors that name both shapes, the CPU thread-pool run of the gradient units,
// and on the GPU the stream fetch, the launch of a TF-free launcher on it and
// the TensorFlow-to-launcher type mapping. Each op file keeps only what is its
// own: REGISTER_OP, its shape functions, functors and kernels.
#ifndef CAPSNET_OPS_TF_GLUE_H_
#define CAPSNET_OPS_TF_GLUE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "capsnet_kernels.h"
#include "cpu_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/work_sharder.h"

// The element types both ops register, as the REGISTER_OP attr and as a list
// for the kernel registrations, kept side by side so they cannot drift apart.
// CAPSNET_FOR_EACH_TYPE(m, args...) expands m(T, args...) for each type.
#define CAPSNET_TYPE_ATTR "T: {half, bfloat16, float, double}"
#define CAPSNET_FOR_EACH_TYPE(m, ...) \
  m(float, __VA_ARGS__) m(double, __VA_ARGS__) m(Eigen::half, __VA_ARGS__) \
  m(Eigen::bfloat16, __VA_ARGS__)

// Registers KERNEL<CPUDevice, T> for op NAME and every type (and, built with
// CUDA, KERNEL<GPUDevice, T>): each op is one template over device and dtype.
#define CAPSNET_REGISTER_ONE(T, DEVICE_NAME, DEVICE_TYPE, NAME, KERNEL)                  \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(DEVICE_NAME).TypeConstraint<T>("T"), \
                          KERNEL<DEVICE_TYPE, T>);
#if GOOGLE_CUDA
#define CAPSNET_REGISTER_KERNELS(NAME, KERNEL)                                        \
  CAPSNET_FOR_EACH_TYPE(CAPSNET_REGISTER_ONE, DEVICE_CPU, CPUDevice, NAME, KERNEL) \
  CAPSNET_FOR_EACH_TYPE(CAPSNET_REGISTER_ONE, DEVICE_GPU, GPUDevice, NAME, KERNEL)
#else
#define CAPSNET_REGISTER_KERNELS(NAME, KERNEL) \
  CAPSNET_FOR_EACH_TYPE(CAPSNET_REGISTER_ONE, DEVICE_CPU, CPUDevice, NAME, KERNEL)
#endif

namespace tensorflow {
namespace capsnet_ops {

using ::capsnet::CapsuleDims;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Device tags of the OpKernel and functor templates (TensorFlow's convention;
// op_kernel.h declares both, and nothing here needs their definitions).
using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;

// The Python name of each op: error messages start with it.
inline constexpr char kPredictionOp[] = "capsule_prediction";
inline constexpr char kRoutingOp[] = "capsule_routing";

// Shape functions. Merges dimension `a_dim` of `a` with dimension `b_dim` of
// `b`, with an error naming both full shapes when both are known and differ.
absl::Status MergeNamed(InferenceContext* c, ShapeHandle a, int a_dim, const char* a_name,
                        ShapeHandle b, int b_dim, const char* b_name, const char* what,
                        DimensionHandle* out, const char* op);
// Input `input` with rank `rank`, else an error naming all input shapes.
absl::Status WithRankNamed(InferenceContext* c, int input, int rank, const char* name,
                           const char* layout, ShapeHandle* out, const char* op);

// u (input `u_input`, rank 3) and W (input `w_input`, rank 4), checked in that
// order: every op of both families takes them.
absl::Status WithInputRanks(InferenceContext* c, int u_input, int w_input, ShapeHandle* u,
                            ShapeHandle* w, const char* op);
// in_caps and in_dim, each shared by u and W.
absl::Status MergeInputDims(InferenceContext* c, ShapeHandle u, ShapeHandle w,
                            DimensionHandle* in_caps, DimensionHandle* in_dim, const char* op);
// Both gradient ops' outputs: grad_u (batch, in_caps, in_dim), shaped like u,
// and grad_W (in_caps, out_caps, out_dim, in_dim), shaped like W.
void SetGradOutputShapes(InferenceContext* c, DimensionHandle batch, DimensionHandle in_caps,
                         DimensionHandle in_dim, DimensionHandle out_caps,
                         DimensionHandle out_dim);

// An output `what` (e.g. "u_hat (batch, in_caps, out_caps, out_dim)") of
// sizes `dims` must fit a TensorShape: once all its sizes are known, an
// InvalidArgument naming it and all input shapes when its element count
// overflows int64 (the graph is rejected when built, not the process aborted
// when run).
absl::Status CheckOutputFits(InferenceContext* c, ShapeHandle out, const char* what,
                             const char* op);

// Run-time checks (shapes may be unknown when the graph is built): u and W of
// one prediction, whose sizes go to `dims`. Also checks that the prediction
// u_hat (batch, in_caps, out_caps, out_dim) has an element count int64 can
// hold, so no size the kernels compute from `dims` overflows; its shape goes
// to `u_hat` if given.
absl::Status CheckForwardShapes(const TensorShape& u, const TensorShape& w, CapsuleDims* dims,
                                const char* op, TensorShape* u_hat = nullptr);

// TensorShape `dims` (sizes of the tensor `what`, e.g. "s_j (batch, out_caps,
// out_dim)") in `out`, or, when its element count overflows int64, an
// InvalidArgument naming it, u and W: never TensorShape's CHECK failure.
absl::Status CheckedShape(std::initializer_list<int64_t> dims, const char* what,
                          const TensorShape& u, const TensorShape& w, const char* op,
                          TensorShape* out);

// Both gradient ops' outputs: dL/du and dL/dW, shaped like u and W.
absl::Status AllocateGradOutputs(OpKernelContext* ctx, const TensorShape& u,
                                 const TensorShape& w, Tensor** grad_u, Tensor** grad_w);

// A cost per unit for Shard of `factors` multiplied, saturated so that `units`
// times it cannot overflow int64 (huge costs only mean "use every thread").
inline int64_t ShardCost(int64_t units, std::initializer_list<int64_t> factors) {
  const int64_t most = std::numeric_limits<int64_t>::max() / 1024 / std::max<int64_t>(units, 1);
  int64_t cost = 1;
  for (int64_t f : factors) cost = ::capsnet::SizeMul(cost, f);
  return (cost < 0 || cost > most) ? most : std::max<int64_t>(cost, 1);
}

// Per-thread scratch of the CPU kernels, from allocate_temp so that a failing
// allocation is a ResourceExhausted error (a std::vector would throw
// std::bad_alloc through the thread pool and kill the process). The units
// [0, units) are split into `parts` contiguous ranges, at most one per thread,
// each with `per_part` values of its own.
template <typename A>
struct PartScratch {
  Tensor tensor;
  A* base = nullptr;
  int64_t per_part = 0;
  int64_t parts = 0;
  int64_t units = 0;
};

// Allocates `per_part` values (-1: the size overflowed int64) for each part of
// `units` units; `what` names the kernels in the error.
template <typename A>
absl::Status AllocatePartScratch(OpKernelContext* ctx, int64_t units, int64_t per_part,
                                 const char* what, const char* op, PartScratch<A>* s) {
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  s->units = units;
  s->parts = std::max<int64_t>(1, std::min<int64_t>(workers->num_threads, units));
  s->per_part = per_part;
  const int64_t total = ::capsnet::SizeMul(s->parts, per_part);
  if (total < 0 && units > 0) {
    return errors::ResourceExhausted(op, ": the ", what, " scratch (", s->parts, " x ",
                                     per_part < 0 ? std::string("more than int64 can count")
                                                  : std::to_string(per_part),
                                     " values) overflows int64");
  }
  if (total > 0 && units > 0) {
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(DataTypeToEnum<A>::value, TensorShape({total}), &s->tensor));
    s->base = s->tensor.template flat<A>().data();
  }
  return absl::OkStatus();
}

// fn(scratch, begin, end) for the unit ranges of `s`'s parts on TensorFlow's
// CPU pool; `unit_cost` is Shard's cost of one unit.
template <typename A, typename Fn>
void RunParts(OpKernelContext* ctx, const PartScratch<A>& s, int64_t unit_cost, Fn fn) {
  if (s.units <= 0) return;
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t per = s.units / s.parts, extra = s.units % s.parts;
  Shard(workers->num_threads, workers->workers, s.parts,
        ShardCost(s.parts, {unit_cost, per + 1}), [&](int64_t begin, int64_t end) {
          for (int64_t p = begin; p < end; ++p) {
            const int64_t first = p * per + std::min(p, extra);
            const int64_t last = first + per + (p < extra ? 1 : 0);
            fn(s.base == nullptr ? nullptr : s.base + p * s.per_part, first, last);
          }
        });
}

// The CPU gradient of either op on TensorFlow's CPU pool: the gradient units
// (cpu_kernels.h) with grad_u_hat rows from `rows_of`, then, when the batch was
// split, the grad_W partials summed over chunks in chunk order.
template <typename T, typename Rows>
absl::Status RunCpuGrad(OpKernelContext* ctx, const CapsuleDims& d, const Rows& rows_of,
                        const Tensor& u, const Tensor& w, Tensor* grad_u, Tensor* grad_w,
                        const char* op) {
  using A = ::capsnet::Accumulator<T>;
  PartScratch<A> scratch;
  TF_RETURN_IF_ERROR(AllocatePartScratch(ctx, ::capsnet::GradUnits(d),
                                         ::capsnet::GradScratchSize(d), "gradient", op,
                                         &scratch));
  Tensor partials;
  A* partials_ptr = nullptr;
  const int64_t partials_size = ::capsnet::GradPartialsSize(d);
  if (partials_size < 0) {
    return errors::ResourceExhausted(op, ": the gradient's grad_W partials overflow int64");
  }
  if (partials_size > 0) {
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(DataTypeToEnum<A>::value, TensorShape({partials_size}), &partials));
    partials_ptr = partials.flat<A>().data();
  }
  const T* u_ptr = u.flat<T>().data();
  const T* w_ptr = w.flat<T>().data();
  T* gu_ptr = grad_u->flat<T>().data();
  T* gw_ptr = grad_w->flat<T>().data();
  const int64_t chunks = ::capsnet::GradChunks(d);
  const int64_t chunk_batch = (d.batch + chunks - 1) / chunks;
  RunParts(ctx, scratch,
           ShardCost(scratch.units, {chunk_batch + 1, 4, d.rows_per_cap(), d.in_dim + 1}),
           [&](A* ws, int64_t begin, int64_t end) {
             ::capsnet::RunGradUnits(rows_of, u_ptr, w_ptr, gu_ptr, gw_ptr, partials_ptr, d,
                                     begin, end, ws);
           });
  if (partials_ptr != nullptr) {
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    Shard(workers->num_threads, workers->workers, d.in_caps,
          ShardCost(d.in_caps, {chunks, d.rows_per_cap(), d.in_dim}),
          [&](int64_t begin, int64_t end) {
            ::capsnet::ReduceGradW(partials_ptr, gw_ptr, d, begin, end);
          });
  }
  return absl::OkStatus();
}

#if GOOGLE_CUDA

// TensorFlow element type -> the launchers' storage type (same bits).
template <typename T>
struct GpuType {
  using type = T;
};
template <>
struct GpuType<Eigen::half> {
  using type = ::capsnet::half_t;
};
template <>
struct GpuType<Eigen::bfloat16> {
  using type = ::capsnet::bfloat16_t;
};
static_assert(sizeof(Eigen::half) == sizeof(::capsnet::half_t), "half layout");
static_assert(sizeof(Eigen::bfloat16) == sizeof(::capsnet::bfloat16_t), "bfloat16 layout");

template <typename T>
const typename GpuType<T>::type* DevPtr(const Tensor& t) {
  return reinterpret_cast<const typename GpuType<T>::type*>(t.flat<T>().data());
}
template <typename T>
typename GpuType<T>::type* DevPtr(Tensor* t) {
  return reinterpret_cast<typename GpuType<T>::type*>(t->flat<T>().data());
}

// The CUDA stream TensorFlow runs this op's kernels on.
absl::Status GetGpuStream(OpKernelContext* ctx, ::capsnet::GpuStream* stream);

// OK for a launcher's status 0, else an Internal error naming the op and the
// kernels (`what`) with CUDA's error string.
absl::Status LaunchStatus(int status, const char* what, const char* op);

// The GPU functors' shared epilogue: `launch(ws, stream)` with a device scratch
// buffer of `ws_bytes` (nullptr for 0) on the CUDA stream TensorFlow runs this
// op on. The buffer's Tensor may go before the kernels finish: TensorFlow
// reuses the memory only for work queued later on the same stream.
template <typename Launch>
absl::Status LaunchOnOpStream(OpKernelContext* ctx, std::size_t ws_bytes, const char* what,
                              const char* op, Launch launch) {
  Tensor workspace;
  void* ws = nullptr;
  if (ws_bytes > static_cast<std::size_t>(std::numeric_limits<int64_t>::max())) {
    return errors::ResourceExhausted(op, ": the ", what, " kernels' workspace (", ws_bytes,
                                     " bytes) overflows int64");
  }
  if (ws_bytes > 0) {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        DT_UINT8, TensorShape({static_cast<int64_t>(ws_bytes)}), &workspace));
    ws = workspace.flat<uint8_t>().data();
  }
  ::capsnet::GpuStream stream;
  TF_RETURN_IF_ERROR(GetGpuStream(ctx, &stream));
  return LaunchStatus(launch(ws, stream), what, op);
}

#endif  // GOOGLE_CUDA

}  // namespace capsnet_ops
}  // namespace tensorflow

#endif  // CAPSNET_OPS_TF_GLUE_H_
