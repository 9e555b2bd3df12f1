// The TF-free interface of the capsnet kernels: sizes, storage and accumulation
// types, and the CUDA launchers of both ops (capsule prediction and fused
// routing). Free of TensorFlow and CUDA types so that the launchers can be
// driven without TensorFlow (ops/sanitize_driver.cu) and the TensorFlow glue
// (prediction.cc, routing.cc) compiles without CUDA headers.
//
// Capsule prediction u_hat[b, i, j, :] = W[i, j] · u[b, i]:
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
#ifndef CAPSNET_OPS_CAPSNET_KERNELS_H_
#define CAPSNET_OPS_CAPSNET_KERNELS_H_

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

// The type every sum is accumulated in, for a storage type T: double for
// double, float for float and for the 16-bit types (half_t, bfloat16_t, and
// the CPU code's Eigen::half, Eigen::bfloat16). The CPU and the CUDA code both
// read it from here, so storage and accumulation types are already separate
// template facts: a mixed-precision variant (16-bit u or W with float32
// accumulation and outputs) adds storage-type parameters to the launchers and
// functors and keeps using Accumulator<> for the sums, without touching the
// kernels' arithmetic.
template <typename T>
struct AccumulatorOf {
  using type = float;
};
template <>
struct AccumulatorOf<double> {
  using type = double;
};
template <typename T>
using Accumulator = typename AccumulatorOf<T>::type;

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

// ============================================================================
// Capsule prediction launchers (prediction.cu.cc; T = float, double, half_t,
// bfloat16_t). All pointers are device pointers; the work is enqueued on
// `stream`. The return value is a cudaError_t as int (0 = cudaSuccess): the
// launch status of every kernel, checked in order. Results are deterministic
// (no atomics; fixed reduction order that depends on the shape only).

// Which kernels to use: kAuto picks the tiled register kernels when the shape
// allows (in_dim <= 16 and out_caps * out_dim / vector width within one block:
// 256 or 512 threads) and the simple one-thread-per-output kernels otherwise;
// kGeneric forces the latter (the sanitizer driver tests both). kCudaCores is
// kAuto without the fused routing's tensor-core kernels: for float32 those take
// W (and grad_s) as two bfloat16 parts, within 2^-16 of the float32 values,
// so the TensorFlow glue picks them only while TensorFloat-32 execution is on
// (TensorFlow's switch for its own float32 matmuls and convolutions, on by
// default, which round to 2^-11); 16-bit types lose nothing on them. The
// workspace sizes are the same for kAuto and kCudaCores.
enum class GpuAlgo { kAuto = 0, kGeneric = 1, kCudaCores = 2 };

// The tiled kernels (kAuto or kCudaCores), as opposed to the generic ones.
inline bool Tiled(GpuAlgo algo) { return algo != GpuAlgo::kGeneric; }

// The routing launchers' algo on TensorFlow's side (the OpKernels and the XLA
// handlers), given tensorflow's tensor_float_32_execution_enabled(): kCudaCores
// for float32 while TensorFloat-32 is off, kAuto otherwise.
template <typename T>
GpuAlgo RoutingAlgo(bool tensor_float_32) {
  return std::is_same<T, float>::value && !tensor_float_32 ? GpuAlgo::kCudaCores : GpuAlgo::kAuto;
}

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

// ============================================================================
// Fused dynamic routing (op Capsnet>CapsuleRouting): the prediction above plus
// all r routing iterations (Sabour et al. 2017, Procedure 1), without writing
// u_hat to memory.
//
//   u (B, I, K), W (I, J, D, K), iterations r >= 1  ->
//     s_j  (B, J, D)  the last iteration's s_j = sum_i c_ij u_hat_j|i, before
//                     the squash (the caller squashes, so that gradient is its own)
//     c_ij (B, I, J)  the last iteration's coupling coefficients
//   b_ij = 0; r times: c_ij = softmax_j(b_ij); s_j = sum_i c_ij u_hat_j|i;
//   v_j = squash(s_j); b_ij += u_hat_j|i . v_j except after the last iteration.
//
// leaky = true (the authors' CIFAR-10 routing, capsnet.routing.routing_softmax):
// every c_ij, the first iteration's included, is the softmax over
// [0, b_i1, ..., b_iJ] with the extra zero logit ("none of the above") dropped,
//   c_ij = exp(b_ij - m) / (exp(-m) + sum_k exp(b_ik - m)),  m = max(0, max_k b_ik),
// so each row sums to below 1 (1 / (J + 1) per entry in the first iteration).
// leaky = false does exactly the arithmetic it did before the option existed.
//
// The gradient is that of stop-gradient routing (capsnet/routing.py): the c_ij
// are constants (leaky or not: the gradient op takes the forward's c_ij as an
// input), so with g = dL/ds_j the only path is the last s_j, and
//   grad_u_hat[b, i, j, d] = c_ij[b, i, j] * g[b, j, d]
// goes through the capsule-prediction gradient kernels (prediction_grad.cuh on
// the GPU, RunGradUnits in cpu_kernels.h on the CPU), which compute c_ij * g on
// the fly instead of reading a u_hat-sized gradient. On the GPU, u and W at
// in_dim 8, out_dim 16 and out_caps <= 10 take tensor-core kernels instead,
// forward and gradient (routing_mma.cuh): 16-bit types with float32-accurate sums,
// float32 within ~2^-15 (kAuto; kCudaCores keeps float32 rounding). The gradient
// with respect to the c_ij output is zero by that same rule.
//
// Empty sums follow the math: with in_dim, out_dim or in_caps 0, u_hat is
// empty or zero, so s_j = 0 and c_ij = 1 / out_caps (leaky: 1 / (out_caps + 1)).

// squash's epsilon inside the norm, |s| = sqrt(|s|^2 + epsilon): the default of
// capsnet.routing.squash (tests check that the two agree).
constexpr double kSquashEpsilon = 1e-7;

// Routing launchers (routing.cu.cc; T = float, double, half_t, bfloat16_t),
// same conventions as above: device pointers, work enqueued on `stream`,
// cudaError_t as int, deterministic (fixed reduction order, no atomics, launch
// plan a function of the shape only).
//
// Bytes of device scratch LaunchCapsuleRoutingForward needs: the routing
// logits b_ij, the per-block partial sums of s_j and v_j, in the accumulation
// type. Depends on the shape, `iterations` and `algo` only.
template <typename T>
std::size_t CapsuleRoutingWorkspaceBytes(const CapsuleDims& dims, int iterations,
                                         GpuAlgo algo = GpuAlgo::kAuto);

// u, W -> s_j (B, J, D), c_ij (B, I, J). kAuto uses the tiled kernels when the
// shape allows (in_dim <= 16, out_caps * out_dim within one block) and the
// simple one-thread-per-output kernels otherwise; kGeneric forces the latter.
// `leaky`: the softmax above with the extra zero logit (the workspace is the same).
template <typename T>
int LaunchCapsuleRoutingForward(const T* u, const T* W, T* s_j, T* c_ij,
                                void* workspace, std::size_t workspace_bytes,
                                const CapsuleDims& dims, int iterations, bool leaky,
                                GpuStream stream, GpuAlgo algo = GpuAlgo::kAuto);

// Bytes of device scratch LaunchCapsuleRoutingGrad needs (the prediction
// gradient's batch-split partials of grad_W; 0 when the batch is not split).
template <typename T>
std::size_t CapsuleRoutingGradWorkspaceBytes(const CapsuleDims& dims,
                                             GpuAlgo algo = GpuAlgo::kAuto);

// c_ij (B, I, J), grad_s (B, J, D) -> grad_u (shape of u), grad_W (shape of W),
// with the prediction gradient's kernels (their row width then divides out_dim).
// `workspace` must hold CapsuleRoutingGradWorkspaceBytes<T>(dims, algo).
template <typename T>
int LaunchCapsuleRoutingGrad(const T* c_ij, const T* grad_s, const T* u,
                             const T* W, T* grad_u, T* grad_W, void* workspace,
                             std::size_t workspace_bytes, const CapsuleDims& dims,
                             GpuStream stream, GpuAlgo algo = GpuAlgo::kAuto);

}  // namespace capsnet

#endif  // CAPSNET_OPS_CAPSNET_KERNELS_H_
