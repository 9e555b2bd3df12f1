// The XLA side of both ops: typed-FFI custom-call handlers that XLA runs where
// a jit-compiled computation contains one of our ops (xla_kernels.cc lowers the
// ops to custom calls to these targets). One handler per op and platform:
// "Host" runs the CPU kernels (cpu_kernels.h, the OpKernels' code and units),
// "CUDA" the CUDA launchers (capsnet_kernels.h) on XLA's stream.
//
// Operands and results arrive as XLA buffers in the default (row-major)
// layout, the OpKernels' layouts: u, W (and grad / c_ij, grad_s), then the
// outputs, then on CUDA one uint8 workspace the lowering sized with the
// launchers' *WorkspaceBytes (XLA allocates it, so a step allocates nothing).
// Sizes come from the buffers' dimensions, already checked when lowering.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "Eigen/Core"
#include "capsnet_kernels.h"
#include "cpu_kernels.h"
#include "tsl/platform/tensor_float_32_utils.h"
#include "xla/ffi/api/ffi.h"

// xla/ffi/ffi_api.h declares this but includes MLIR headers the pip wheel does
// not ship; the function is exported by libtensorflow_framework.
namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi

namespace capsnet {
namespace {

namespace ffi = ::xla::ffi;

// u (B, I, K) and W (I, J, D, K) buffers -> the launchers' sizes.
CapsuleDims DimsOf(const ffi::AnyBuffer& u, const ffi::AnyBuffer& w) {
  const auto ud = u.dimensions();
  const auto wd = w.dimensions();
  return CapsuleDims{ud[0], ud[1], wd[1], wd[2], ud[2]};
}

template <typename T>
const T* In(const ffi::AnyBuffer& b) {
  return reinterpret_cast<const T*>(b.untyped_data());
}
template <typename T>
T* Out(ffi::Result<ffi::AnyBuffer>& b) {
  return reinterpret_cast<T*>(b->untyped_data());
}

ffi::Error Unsupported(const char* op, const ffi::AnyBuffer& u) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(op) + ": no kernel for element type " +
                        std::to_string(static_cast<int>(u.element_type())));
}

// Calls fn(T{}) with T the storage type of `type` on `platform`'s side
// (Eigen's 16-bit types on the host, the launchers' on CUDA).
template <typename F16, typename BF16, typename Fn>
ffi::Error ByType(ffi::DataType type, const char* op, const ffi::AnyBuffer& u, Fn fn) {
  switch (type) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::F64:
      return fn(double{});
    case ffi::DataType::F16:
      return fn(F16{});
    case ffi::DataType::BF16:
      return fn(BF16{});
    default:
      return Unsupported(op, u);
  }
}

// ----------------------------------------------------------------------------
// Host. A legacy-free custom call gets no thread pool of TensorFlow's, so the
// parts run on threads of their own, at most one per hardware thread; the
// work split depends on the shape only, so the results do not depend on it.

int64 HostParts() { return std::max<int64>(1, std::thread::hardware_concurrency()); }

void RunOnThreads(int64 parts, const std::function<void(int64)>& fn) {
  if (parts <= 1) {
    if (parts == 1) fn(0);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(parts - 1);
  for (int64 p = 1; p < parts; ++p) threads.emplace_back(fn, p);
  fn(0);
  for (auto& t : threads) t.join();
}

ffi::Error OutOfMemory(const char* op) {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    std::string(op) + ": the CPU kernels' scratch cannot be allocated");
}

ffi::Error PredictionHost(ffi::AnyBuffer u, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> u_hat) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.u_hat_size() == 0) return ffi::Error::Success();
  return ByType<Eigen::half, Eigen::bfloat16>(u.element_type(), "capsule_prediction", u,
                                               [&](auto t) {
    using T = decltype(t);
    return CpuCapsulePrediction(In<T>(u), In<T>(w), Out<T>(u_hat), d, HostParts(), RunOnThreads)
               ? ffi::Error::Success()
               : OutOfMemory("capsule_prediction");
  });
}

ffi::Error PredictionGradHost(ffi::AnyBuffer grad, ffi::AnyBuffer u, ffi::AnyBuffer w,
                              ffi::Result<ffi::AnyBuffer> grad_u,
                              ffi::Result<ffi::AnyBuffer> grad_w) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.u_size() == 0 && d.w_size() == 0) return ffi::Error::Success();
  return ByType<Eigen::half, Eigen::bfloat16>(u.element_type(), "capsule_prediction", u,
                                               [&](auto t) {
    using T = decltype(t);
    return CpuCapsulePredictionGrad(In<T>(grad), In<T>(u), In<T>(w), Out<T>(grad_u),
                                    Out<T>(grad_w), d, HostParts(), RunOnThreads)
               ? ffi::Error::Success()
               : OutOfMemory("capsule_prediction gradient");
  });
}

ffi::Error RoutingHost(ffi::AnyBuffer u, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> s_j,
                       ffi::Result<ffi::AnyBuffer> c_ij, int32_t iterations, bool leaky) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.batch * d.out_caps == 0) return ffi::Error::Success();  // s_j and c_ij empty
  return ByType<Eigen::half, Eigen::bfloat16>(u.element_type(), "capsule_routing", u,
                                               [&](auto t) {
    using T = decltype(t);
    return CpuCapsuleRouting(In<T>(u), In<T>(w), Out<T>(s_j), Out<T>(c_ij), d, iterations,
                             leaky, HostParts(), RunOnThreads)
               ? ffi::Error::Success()
               : OutOfMemory("capsule_routing");
  });
}

ffi::Error RoutingGradHost(ffi::AnyBuffer u, ffi::AnyBuffer w, ffi::AnyBuffer c_ij,
                           ffi::AnyBuffer grad_s, ffi::Result<ffi::AnyBuffer> grad_u,
                           ffi::Result<ffi::AnyBuffer> grad_w) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.u_size() == 0 && d.w_size() == 0) return ffi::Error::Success();
  return ByType<Eigen::half, Eigen::bfloat16>(u.element_type(), "capsule_routing", u,
                                               [&](auto t) {
    using T = decltype(t);
    return CpuCapsuleRoutingGrad(In<T>(u), In<T>(w), In<T>(c_ij), In<T>(grad_s),
                                 Out<T>(grad_u), Out<T>(grad_w), d, HostParts(), RunOnThreads)
               ? ffi::Error::Success()
               : OutOfMemory("capsule_routing gradient");
  });
}

XLA_FFI_DEFINE_HANDLER(kPredictionHost, PredictionHost,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Ret<ffi::AnyBuffer>()  // u_hat
);
XLA_FFI_DEFINE_HANDLER(kPredictionGradHost, PredictionGradHost,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // grad
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Ret<ffi::AnyBuffer>()  // grad_u
                           .Ret<ffi::AnyBuffer>()  // grad_W
);
XLA_FFI_DEFINE_HANDLER(kRoutingHost, RoutingHost,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Ret<ffi::AnyBuffer>()  // s_j
                           .Ret<ffi::AnyBuffer>()  // c_ij
                           .Attr<int32_t>("iterations")
                           .Attr<bool>("leaky"));
XLA_FFI_DEFINE_HANDLER(kRoutingGradHost, RoutingGradHost,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Arg<ffi::AnyBuffer>()  // c_ij
                           .Arg<ffi::AnyBuffer>()  // grad_s
                           .Ret<ffi::AnyBuffer>()  // grad_u
                           .Ret<ffi::AnyBuffer>()  // grad_W
);

// ----------------------------------------------------------------------------
// CUDA: the launchers on the stream XLA runs the computation on.

#if GOOGLE_CUDA

ffi::Error LaunchError(int status, const char* what) {
  if (status == 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(what) + " kernels failed: " + GpuErrorString(status));
}

ffi::Error PredictionCuda(GpuStream stream, ffi::AnyBuffer u, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> u_hat) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.u_hat_size() == 0) return ffi::Error::Success();
  return ByType<half_t, bfloat16_t>(u.element_type(), "capsule_prediction", u, [&](auto t) {
    using T = decltype(t);
    return LaunchError(
        LaunchCapsulePredictionForward(In<T>(u), In<T>(w), Out<T>(u_hat), d, stream),
        "capsule_prediction forward");
  });
}

ffi::Error PredictionGradCuda(GpuStream stream, ffi::AnyBuffer grad, ffi::AnyBuffer u,
                              ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> grad_u,
                              ffi::Result<ffi::AnyBuffer> grad_w,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.u_size() == 0 && d.w_size() == 0) return ffi::Error::Success();
  return ByType<half_t, bfloat16_t>(u.element_type(), "capsule_prediction", u, [&](auto t) {
    using T = decltype(t);
    return LaunchError(
        LaunchCapsulePredictionGrad(In<T>(grad), In<T>(u), In<T>(w), Out<T>(grad_u),
                                    Out<T>(grad_w), workspace->untyped_data(),
                                    workspace->size_bytes(), d, stream),
        "capsule_prediction gradient");
  });
}

ffi::Error RoutingCuda(GpuStream stream, ffi::AnyBuffer u, ffi::AnyBuffer w,
                       ffi::Result<ffi::AnyBuffer> s_j, ffi::Result<ffi::AnyBuffer> c_ij,
                       ffi::Result<ffi::AnyBuffer> workspace, int32_t iterations, bool leaky) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.batch * d.out_caps == 0) return ffi::Error::Success();
  return ByType<half_t, bfloat16_t>(u.element_type(), "capsule_routing", u, [&](auto t) {
    using T = decltype(t);
    return LaunchError(
        LaunchCapsuleRoutingForward(In<T>(u), In<T>(w), Out<T>(s_j), Out<T>(c_ij),
                                    workspace->untyped_data(), workspace->size_bytes(), d,
                                    iterations, leaky, stream,
                                    RoutingAlgo<T>(tsl::tensor_float_32_execution_enabled())),
        "capsule_routing");
  });
}

ffi::Error RoutingGradCuda(GpuStream stream, ffi::AnyBuffer u, ffi::AnyBuffer w,
                           ffi::AnyBuffer c_ij, ffi::AnyBuffer grad_s,
                           ffi::Result<ffi::AnyBuffer> grad_u, ffi::Result<ffi::AnyBuffer> grad_w,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  const CapsuleDims d = DimsOf(u, w);
  if (d.u_size() == 0 && d.w_size() == 0) return ffi::Error::Success();
  return ByType<half_t, bfloat16_t>(u.element_type(), "capsule_routing", u, [&](auto t) {
    using T = decltype(t);
    return LaunchError(
        LaunchCapsuleRoutingGrad(In<T>(c_ij), In<T>(grad_s), In<T>(u), In<T>(w),
                                 Out<T>(grad_u), Out<T>(grad_w), workspace->untyped_data(),
                                 workspace->size_bytes(), d, stream,
                                 RoutingAlgo<T>(tsl::tensor_float_32_execution_enabled())),
        "capsule_routing gradient");
  });
}

XLA_FFI_DEFINE_HANDLER(kPredictionCuda, PredictionCuda,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<GpuStream>>()
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Ret<ffi::AnyBuffer>()  // u_hat
);
XLA_FFI_DEFINE_HANDLER(kPredictionGradCuda, PredictionGradCuda,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<GpuStream>>()
                           .Arg<ffi::AnyBuffer>()  // grad
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Ret<ffi::AnyBuffer>()  // grad_u
                           .Ret<ffi::AnyBuffer>()  // grad_W
                           .Ret<ffi::AnyBuffer>()  // workspace
);
XLA_FFI_DEFINE_HANDLER(kRoutingCuda, RoutingCuda,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<GpuStream>>()
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Ret<ffi::AnyBuffer>()  // s_j
                           .Ret<ffi::AnyBuffer>()  // c_ij
                           .Ret<ffi::AnyBuffer>()  // workspace
                           .Attr<int32_t>("iterations")
                           .Attr<bool>("leaky"));
XLA_FFI_DEFINE_HANDLER(kRoutingGradCuda, RoutingGradCuda,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<GpuStream>>()
                           .Arg<ffi::AnyBuffer>()  // u
                           .Arg<ffi::AnyBuffer>()  // W
                           .Arg<ffi::AnyBuffer>()  // c_ij
                           .Arg<ffi::AnyBuffer>()  // grad_s
                           .Ret<ffi::AnyBuffer>()  // grad_u
                           .Ret<ffi::AnyBuffer>()  // grad_W
                           .Ret<ffi::AnyBuffer>()  // workspace
);

#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace capsnet

// The targets' names are xla_kernels.cc's kXla*Target; both files spell them
// out so that neither depends on the other's headers.
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_prediction", "Host",
                         capsnet::kPredictionHost);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_prediction_grad", "Host",
                         capsnet::kPredictionGradHost);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_routing", "Host",
                         capsnet::kRoutingHost);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_routing_grad", "Host",
                         capsnet::kRoutingGradHost);
#if GOOGLE_CUDA
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_prediction", "CUDA",
                         capsnet::kPredictionCuda);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_prediction_grad", "CUDA",
                         capsnet::kPredictionGradCuda);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_routing", "CUDA",
                         capsnet::kRoutingCuda);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "capsnet_capsule_routing_grad", "CUDA",
                         capsnet::kRoutingGradCuda);
#endif  // GOOGLE_CUDA
