// Capsule prediction u_hat[b, i, j, :] = W[i, j] · u[b, i] and its gradient.
//
//   u      (batch, in_caps, in_dim)
//   W      (in_caps, out_caps, out_dim, in_dim)
//   u_hat  (batch, in_caps, out_caps, out_dim)
//
// Flattening (out_caps, out_dim) into one "row" axis r = j * out_dim + d makes the
// whole op a per-capsule matrix-vector product: with JD = out_caps * out_dim,
//   u_hat[b, i*JD + r]  = sum_k W[i*JD + r, k] * u[b, i, k]
//   grad_u[b, i, k]     = sum_r W[i*JD + r, k] * g[b, i*JD + r]
//   grad_W[i*JD + r, k] = sum_b g[b, i*JD + r] * u[b, i, k]
// and the row index of W equals the non-batch part of the u_hat index, which is
// what the kernels exploit (one thread owns a few consecutive rows for all b).
//
// This header is free of TensorFlow and CUDA types so that the kernels can be
// driven without TensorFlow (ops/sanitize_driver.cu) and the TensorFlow glue
// (capsule_prediction.cc) compiles without CUDA headers.
#ifndef CAPSNET_OPS_CAPSULE_PREDICTION_H_
#define CAPSNET_OPS_CAPSULE_PREDICTION_H_

#include <cstddef>
#include <cstdint>

// cudaStream_t is `CUstream_st*`; declaring the struct lets callers pass streams
// without including cuda_runtime.h.
struct CUstream_st;

namespace capsnet {

using int64 = std::int64_t;
using GpuStream = CUstream_st*;

// 16-bit float storage types, bit-compatible with Eigen::half / __half and
// Eigen::bfloat16 / __nv_bfloat16 (callers reinterpret_cast their pointers).
struct half_t {
  std::uint16_t bits;
};
struct bfloat16_t {
  std::uint16_t bits;
};

// Sizes of one capsule prediction; all int64 so that no index overflows.
struct CapsuleDims {
  int64 batch;
  int64 in_caps;
  int64 out_caps;
  int64 out_dim;
  int64 in_dim;

  int64 rows_per_cap() const { return out_caps * out_dim; }  // JD
  int64 rows() const { return in_caps * out_caps * out_dim; }  // rows of W
  int64 u_size() const { return batch * in_caps * in_dim; }
  int64 w_size() const { return rows() * in_dim; }
  int64 u_hat_size() const { return batch * rows(); }
};

// ----------------------------------------------------------------------------
// CPU kernels (defined and instantiated in capsule_prediction.cc for float,
// double, Eigen::half, Eigen::bfloat16). They work on a range of "units" so the
// caller can run them on any thread pool; each output element is written by
// exactly one unit, in a fixed order, so results do not depend on the pool.
template <typename T>
struct CapsulePredictionCpu {
  // Forward units are (in capsule, batch block) pairs.
  static int64 ForwardUnits(const CapsuleDims& dims);
  static void Forward(const T* u, const T* W, T* u_hat, const CapsuleDims& dims,
                      int64 unit_begin, int64 unit_end);

  // Backward units are (in capsule, batch chunk) pairs. With more than one
  // chunk, grad_W partial sums go to `partials` (GradPartialsSize() elements of
  // the accumulation type: float for float/half/bfloat16, double for double)
  // and ReduceGradW() sums them over chunks in a fixed order.
  static int64 GradChunks(const CapsuleDims& dims);
  static int64 GradUnits(const CapsuleDims& dims);
  static int64 GradPartialsSize(const CapsuleDims& dims);
  static void Grad(const T* grad, const T* u, const T* W, T* grad_u, T* grad_W,
                   void* partials, const CapsuleDims& dims, int64 unit_begin,
                   int64 unit_end);
  // Sums the partials of capsules [cap_begin, cap_end) into grad_W.
  static void ReduceGradW(const void* partials, T* grad_W,
                          const CapsuleDims& dims, int64 cap_begin,
                          int64 cap_end);
};

// ----------------------------------------------------------------------------
// GPU launchers (capsule_prediction.cu.cc; T = float, double, half_t,
// bfloat16_t). All pointers are device pointers; the work is enqueued on
// `stream`. The return value is a cudaError_t as int (0 = cudaSuccess): the
// launch status of every kernel, checked in order. Results are deterministic
// (no atomics; fixed reduction order that depends on the shape only).

// Which kernels to use: kAuto picks the tiled register kernels when the shape
// allows (in_dim <= 16 and out_caps * out_dim / vector width within one block:
// 256 or 512 threads) and the simple one-thread-per-output kernels otherwise;
// kGeneric forces the latter (the sanitizer driver tests both).
enum class GpuAlgo { kAuto = 0, kGeneric = 1 };

template <typename T>
int LaunchCapsulePredictionForward(const T* u, const T* W, T* u_hat,
                                   const CapsuleDims& dims, GpuStream stream,
                                   GpuAlgo algo = GpuAlgo::kAuto);

// Bytes of device scratch LaunchCapsulePredictionGrad needs for `dims` (0 when
// the batch is not split across blocks). Depends on the shape only.
template <typename T>
std::size_t CapsulePredictionGradWorkspaceBytes(const CapsuleDims& dims,
                                                GpuAlgo algo = GpuAlgo::kAuto);

// grad (batch, in_caps, out_caps, out_dim) -> grad_u (shape of u), grad_W
// (shape of W). `workspace` must hold CapsulePredictionGradWorkspaceBytes().
template <typename T>
int LaunchCapsulePredictionGrad(const T* grad, const T* u, const T* W,
                                T* grad_u, T* grad_W, void* workspace,
                                std::size_t workspace_bytes,
                                const CapsuleDims& dims, GpuStream stream,
                                GpuAlgo algo = GpuAlgo::kAuto);

// cudaGetErrorString for a launcher's return value.
const char* GpuErrorString(int status);

}  // namespace capsnet

#endif  // CAPSNET_OPS_CAPSULE_PREDICTION_H_
