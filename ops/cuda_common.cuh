// Device code shared by the CUDA kernels of both ops (prediction.cu.cc,
// routing.cu.cc): accumulation and storage-type conversions, vector accesses,
// the checked launch helper, grid-stride loops, the (VEC, KMAX) dispatch and
// the scalar dot product of the generic kernels. TF-free, like the launchers.
//
// Everything is in an anonymous namespace on purpose: each .cu.cc is compiled
// as its own CUDA module (no -rdc), so each gets its own instantiations of the
// kernels it launches, registered with its own module, and none is merged
// across translation units by the host linker.
#ifndef CAPSNET_OPS_CUDA_COMMON_CUH_
#define CAPSNET_OPS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "capsnet_kernels.h"

namespace capsnet {
namespace {

// Accumulation type (capsnet_kernels.h): 16-bit types accumulate in float.
template <typename T>
using Acc = Accumulator<T>;

// Widest vector (elements) for a 16-byte-or-less access; 16-bit types stop at 4
// (8 bytes) to bound the W registers (VEC * KMAX floats per thread).
template <typename T>
constexpr int MaxVec() {
  return sizeof(T) == 8 ? 2 : 4;
}

__device__ __forceinline__ float ToAcc(float x) { return x; }
__device__ __forceinline__ double ToAcc(double x) { return x; }
__device__ __forceinline__ float ToAcc(half_t x) {
  return __half2float(__ushort_as_half(x.bits));
}
__device__ __forceinline__ float ToAcc(bfloat16_t x) {
  return __bfloat162float(__ushort_as_bfloat16(x.bits));
}

template <typename T>
__device__ __forceinline__ T FromAcc(Acc<T> x);
template <>
__device__ __forceinline__ float FromAcc<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ double FromAcc<double>(double x) {
  return x;
}
template <>
__device__ __forceinline__ half_t FromAcc<half_t>(float x) {
  return half_t{__half_as_ushort(__float2half_rn(x))};
}
template <>
__device__ __forceinline__ bfloat16_t FromAcc<bfloat16_t>(float x) {
  return bfloat16_t{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
}

// N elements moved by one load/store instruction (aligned to its size).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Launches with cudaLaunchKernel so the return value is this launch's status
// (a <<<>>> launch leaves it to cudaGetLastError, which also reports older
// errors of the thread). Arguments are converted to the kernel's parameter
// types first so the pointers in `params` point at correctly typed values.
template <typename... KArgs, typename... Args>
cudaError_t Launch(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                   std::size_t smem, cudaStream_t stream, Args... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "kernel argument count");
  std::tuple<KArgs...> values(static_cast<KArgs>(args)...);
  return std::apply(
      [&](auto&... v) {
        void* params[] = {const_cast<void*>(static_cast<const void*>(&v))...};
        return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid,
                                block, params, smem, stream);
      },
      values);
}

inline int64 CeilDiv(int64 a, int64 b) { return (a + b - 1) / b; }

// The indices x < n this thread visits in a grid-stride loop, 64-bit:
//   for (const int64 x : GridStride(n)) ...
// (every generic kernel is one such loop over its outputs).
class GridStride {
 public:
  class Iterator {
   public:
    __device__ __forceinline__ Iterator(int64 x, int64 step) : x_(x), step_(step) {}
    __device__ __forceinline__ int64 operator*() const { return x_; }
    __device__ __forceinline__ Iterator& operator++() {
      x_ += step_;
      return *this;
    }
    // Not equality: the last step jumps past n.
    __device__ __forceinline__ bool operator!=(const Iterator& end) const { return x_ < end.x_; }

   private:
    int64 x_;
    int64 step_;
  };
  __device__ __forceinline__ explicit GridStride(int64 n) : n_(n) {}
  __device__ __forceinline__ Iterator begin() const {
    return {static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x,
            static_cast<int64>(blockDim.x) * gridDim.x};
  }
  __device__ __forceinline__ Iterator end() const { return {n_, 0}; }

 private:
  int64 n_;
};

// Launch shape of the grid-stride kernels.
constexpr int kGenericThreads = 256;
constexpr int64 kGenericMaxBlocks = 8192;

inline dim3 GenericGrid(int64 total) {
  return dim3(static_cast<unsigned>(
      std::clamp<int64>(CeilDiv(total, kGenericThreads), 1, kGenericMaxBlocks)));
}

// One element of u_hat: sum_k W[row, k] u[k] in k order, accumulated in Acc<T>.
// The generic kernels of both ops compute u_hat with it, so they agree bitwise.
template <typename T>
__device__ __forceinline__ Acc<T> RowDot(const T* __restrict__ w_row, const T* __restrict__ u_row,
                                         int64 in_dim) {
  Acc<T> s = Acc<T>(0);
  for (int64 k = 0; k < in_dim; ++k) s = fma(ToAcc(w_row[k]), ToAcc(u_row[k]), s);
  return s;
}

// Calls f(integral_constant VEC, integral_constant KMAX) for the (vec, kmax)
// instance of a tiled kernel: VEC rows per thread, in_dim padded to KMAX.
template <typename F>
cudaError_t DispatchVecK(int vec, int kmax, F&& f) {
#define CAPSNET_CASE(V, K) \
  if (vec == V && kmax == K) return f(std::integral_constant<int, V>(), std::integral_constant<int, K>());
  CAPSNET_CASE(4, 4)
  CAPSNET_CASE(4, 8)
  CAPSNET_CASE(4, 16)
  CAPSNET_CASE(2, 4)
  CAPSNET_CASE(2, 8)
  CAPSNET_CASE(2, 16)
  CAPSNET_CASE(1, 4)
  CAPSNET_CASE(1, 8)
  CAPSNET_CASE(1, 16)
#undef CAPSNET_CASE
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace capsnet

#endif  // CAPSNET_OPS_CUDA_COMMON_CUH_
