// TensorFlow-side glue shared by the OpKernels of both ops (prediction.cc,
// routing.cc): the dtype list, the device tags, the shape checks with the
// errors that name both shapes, the CPU thread-pool run of the gradient units,
// and on the GPU the stream fetch, the launch of a TF-free launcher on it and
// the TensorFlow-to-launcher type mapping. Each op file keeps only what is its
// own: REGISTER_OP, its shape functions, functors and kernels.
#ifndef CAPSNET_OPS_TF_GLUE_H_
#define CAPSNET_OPS_TF_GLUE_H_

#include <cstddef>
#include <cstdint>

#include "capsnet_kernels.h"
#include "cpu_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
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

// Run-time checks (shapes may be unknown when the graph is built): u and W of
// one prediction, whose sizes go to `dims`.
absl::Status CheckForwardShapes(const TensorShape& u, const TensorShape& w, CapsuleDims* dims,
                                const char* op);

// Both gradient ops' outputs: dL/du and dL/dW, shaped like u and W.
absl::Status AllocateGradOutputs(OpKernelContext* ctx, const TensorShape& u,
                                 const TensorShape& w, Tensor** grad_u, Tensor** grad_w);

// The CPU gradient of either op on TensorFlow's CPU pool: the gradient units
// (cpu_kernels.h) with grad_u_hat rows from `rows_of`, then, when the batch was
// split, the grad_W partials summed over chunks in chunk order.
template <typename T, typename Rows>
absl::Status RunCpuGrad(OpKernelContext* ctx, const CapsuleDims& d, const Rows& rows_of,
                        const Tensor& u, const Tensor& w, Tensor* grad_u, Tensor* grad_w) {
  using A = ::capsnet::Accumulator<T>;
  Tensor partials;
  A* partials_ptr = nullptr;
  const int64_t partials_size = ::capsnet::GradPartialsSize(d);
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
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t chunk_batch = (d.batch + chunks - 1) / chunks;
  const int64_t cost = (chunk_batch + 1) * 4 * d.rows_per_cap() * (d.in_dim + 1);
  Shard(workers->num_threads, workers->workers, ::capsnet::GradUnits(d), cost,
        [&](int64_t begin, int64_t end) {
          ::capsnet::RunGradUnits(rows_of, u_ptr, w_ptr, gu_ptr, gw_ptr, partials_ptr, d, begin,
                                  end);
        });
  if (partials_ptr != nullptr) {
    Shard(workers->num_threads, workers->workers, d.in_caps,
          chunks * d.rows_per_cap() * d.in_dim, [&](int64_t begin, int64_t end) {
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
