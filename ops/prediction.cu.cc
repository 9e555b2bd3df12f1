// CUDA kernels and TF-free launchers of the capsule prediction op
// (capsnet_kernels.h has the math and the row view r = j * out_dim + d used
// throughout): the tiled and generic forward kernels, and the gradient with
// grad_u_hat read from memory through prediction_grad.cuh.
//
// Free of TensorFlow: built by scripts/build_ops.py into the op library and, with
// ops/sanitize_driver.cu, into a standalone program for compute-sanitizer.
//
// Design (memory bound: u_hat is ~20x larger than u and W at the paper shape):
// the tiled forward (tiling.cuh has the geometry) keeps W rows in registers,
// stages u through shared memory double-buffered by kStage batch rows, and
// streams u_hat out in VEC-wide evict-first stores. Generic kernels (one thread
// per output element) cover in_dim > 16 and capsules with more vectors than a
// tiled block may have threads (256 or 512, i.e. out_caps * out_dim beyond
// 1024-2048 for float).
//
// Measured on an H200 (standalone driver, CUDA events, copy 4.25 TB/s), float:
//   paper (128, 1152 -> 10 x 16, in_dim 8): forward 27 us = 1.10x the
//   bandwidth floor; backward 81 us = 2.96x. batch 512: 120 / 242 us (1.27x /
//   2.40x). 4608 -> 32 x 16: 368 / 718 us (1.20x / 2.18x). The naive
//   one-thread-per-output kernels (kGeneric) take 220 / 360 us at the paper
//   shape.
#include "capsnet_kernels.h"
#include "cuda_common.cuh"
#include "prediction_grad.cuh"
#include "tiling.cuh"

namespace capsnet {
namespace {

// Forward: split the batch only while there are fewer capsule tiles than this.
// A batch split reloads W per block, and at the paper shape 1 chunk (384
// blocks) took 27 us against 32 us for 4 chunks (H200).
constexpr int64 kForwardTargetBlocks = 288;

template <typename T>
Plan ForwardPlan(const CapsuleDims& d) {
  Plan p = TileGeometry<T>(d);
  if (!p.tiled) return p;
  const int64 want = std::max<int64>(1, CeilDiv(kForwardTargetBlocks, p.tiles));
  const int64 chunks = std::min<int64>({want, CeilDiv(d.batch, 8), 65535});
  p.b_chunk = CeilDiv(d.batch, std::max<int64>(chunks, 1));
  p.chunks = CeilDiv(d.batch, p.b_chunk);
  p.smem = static_cast<std::size_t>(2 * kStage * p.cpb * p.kmax * sizeof(Acc<T>));
  return p;
}

// Stores one vector of u_hat marked evict-first (st.global.cs): u_hat is far
// larger than L2 and is not read again by this kernel, so it should not push
// u and W out (measured 42 -> 39 us at the paper shape on an H200).
template <typename T, int N>
__device__ __forceinline__ void StoreVec(T* p, const Vec<T, N>& v) {
  if constexpr (sizeof(v) == 16) {
    int4 x;
    memcpy(&x, &v, 16);
    __stcs(reinterpret_cast<int4*>(p), x);
  } else if constexpr (sizeof(v) == 8) {
    int2 x;
    memcpy(&x, &v, 8);
    __stcs(reinterpret_cast<int2*>(p), x);
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  }
}

template <typename T, int VEC, int KMAX>
__global__ void __launch_bounds__(MaxThreadsFor(VEC, KMAX, sizeof(Acc<T>)))
    ForwardTiledKernel(const T* __restrict__ u, const T* __restrict__ W,
                       T* __restrict__ u_hat, int64 batch, int64 in_caps,
                       int in_dim, int jd, int cpb, int64 b_chunk) {
  using A = Acc<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* su = reinterpret_cast<A*>(smem_raw);  // 2 stages, double-buffered

  const auto [cap, q, i0, ncaps, active, rows, row] = TileThreadOf<VEC>(in_caps, jd, cpb);
  const UTile<T, KMAX> tile(u, in_caps, i0, in_dim, ncaps, cpb);
  const int stage_elems = tile.size();

  const int64 b_begin = static_cast<int64>(blockIdx.y) * b_chunk;
  const int64 b_end = min(batch, b_begin + b_chunk);
  A upre[kUPrefetch];
  tile.Prefetch(upre, b_begin, static_cast<int>(min(static_cast<int64>(kStage), b_end - b_begin)));

  // W[row:row+VEC, :] stays in registers for the whole batch chunk.
  A w[VEC][KMAX];
#pragma unroll
  for (int n = 0; n < VEC; ++n) LoadRow<T, KMAX>(W + (row + n) * in_dim, in_dim, active, w[n]);
  tile.Commit(upre, su, b_begin, static_cast<int>(min(static_cast<int64>(kStage), b_end - b_begin)));

  int buf = 0;
  for (int64 b0 = b_begin; b0 < b_end; b0 += kStage, buf ^= 1) {
    const int nb = static_cast<int>(min(static_cast<int64>(kStage), b_end - b0));
    const int64 b_next = b0 + kStage;
    const int nb_next = static_cast<int>(max(int64(0), min(static_cast<int64>(kStage), b_end - b_next)));
    // The next stage's u loads fly while this stage's stores are issued.
    if (nb_next > 0) tile.Prefetch(upre, b_next, nb_next);
    __syncthreads();  // su[buf] is complete
    if (active) {
      const A* ucap = su + buf * stage_elems + cap * KMAX;
      T* out = u_hat + b0 * rows + row;
#pragma unroll 2
      for (int bb = 0; bb < nb; ++bb) {
        A uk[KMAX];
#pragma unroll
        for (int k = 0; k < KMAX; ++k) uk[k] = ucap[bb * cpb * KMAX + k];
        Vec<T, VEC> o;
#pragma unroll
        for (int n = 0; n < VEC; ++n) {
          A s = A(0);
#pragma unroll
          for (int k = 0; k < KMAX; ++k) s = fma(w[n][k], uk[k], s);
          o.v[n] = FromAcc<T>(s);
        }
        StoreVec<T, VEC>(out + bb * rows, o);
      }
    }
    // su[buf ^ 1] was last read in the previous stage, before this stage's
    // barrier, so it can be refilled now.
    if (nb_next > 0) tile.Commit(upre, su + (buf ^ 1) * stage_elems, b_next, nb_next);
  }
}

template <typename T>
__global__ void ForwardGenericKernel(const T* __restrict__ u,
                                     const T* __restrict__ W,
                                     T* __restrict__ u_hat, int64 batch,
                                     int64 in_caps, int64 in_dim, int64 jd) {
  const int64 rows = in_caps * jd;
  for (const int64 x : GridStride(batch * rows)) {
    const int64 b = x / rows;
    const int64 r = x - b * rows;
    u_hat[x] = FromAcc<T>(RowDot(W + r * in_dim, u + (b * in_caps + r / jd) * in_dim, in_dim));
  }
}

template <typename T, int VEC, int KMAX>
cudaError_t LaunchForwardTiled(const T* u, const T* W, T* u_hat,
                               const CapsuleDims& d, const Plan& p,
                               cudaStream_t stream) {
  if constexpr (VEC > MaxVec<T>()) {
    return cudaErrorInvalidValue;  // never planned
  } else {
    return Launch(ForwardTiledKernel<T, VEC, KMAX>,
                  dim3(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.chunks)),
                  dim3(p.threads), p.smem, stream, u, W, u_hat, d.batch,
                  d.in_caps, static_cast<int>(d.in_dim),
                  static_cast<int>(d.rows_per_cap()), p.cpb, p.b_chunk);
  }
}

// grad_u_hat from a u_hat-sized tensor (the prediction op's gradient); the
// interface is described in prediction_grad.cuh.
template <typename T>
struct GradFromMemory {
  const T* __restrict__ grad;  // (batch, in_caps * jd)
  int64 rows;                  // in_caps * jd

  static int64 VecUnit(const CapsuleDims& d) { return d.rows_per_cap(); }

  template <int VEC>
  struct Raw {
    Vec<T, VEC> g;
  };
  template <int VEC>
  struct Thread {};
  template <int VEC>
  __device__ __forceinline__ Thread<VEC> ForThread(int) const {
    return {};
  }
  template <int VEC>
  __device__ __forceinline__ Raw<VEC> Load(const Thread<VEC>&, int64 b, int64,
                                           int64 row) const {
    return {*reinterpret_cast<const Vec<T, VEC>*>(grad + b * rows + row)};
  }
  template <int VEC>
  __device__ __forceinline__ void Convert(const Raw<VEC>& raw, Acc<T> (&out)[VEC]) const {
#pragma unroll
    for (int n = 0; n < VEC; ++n) out[n] = ToAcc(raw.g.v[n]);
  }
  __device__ __forceinline__ Acc<T> At(int64 b, int64 row) const {
    return ToAcc(grad[b * rows + row]);
  }
};

}  // namespace

template <typename T>
int LaunchCapsulePredictionForward(const T* u, const T* W, T* u_hat,
                                   const CapsuleDims& d, GpuStream stream,
                                   GpuAlgo algo) {
  const int64 n = d.u_hat_size();
  if (n == 0) return cudaSuccess;
  if (d.in_dim == 0) {  // empty sum
    return cudaMemsetAsync(u_hat, 0, n * sizeof(T), stream);
  }
  const Plan p = ForwardPlan<T>(d);
  if (Tiled(algo) && p.tiled) {
    return DispatchVecK(p, [&](auto vec, auto kmax) {
      return LaunchForwardTiled<T, decltype(vec)::value, decltype(kmax)::value>(
          u, W, u_hat, d, p, stream);
    });
  }
  return Launch(ForwardGenericKernel<T>, GenericGrid(n), dim3(kGenericThreads), 0,
                stream, u, W, u_hat, d.batch, d.in_caps, d.in_dim,
                d.rows_per_cap());
}

template <typename T>
std::size_t CapsulePredictionGradWorkspaceBytes(const CapsuleDims& d,
                                                GpuAlgo algo) {
  return GradWorkspaceBytes<T>(d, algo, GradFromMemory<T>::VecUnit(d));
}

template <typename T>
int LaunchCapsulePredictionGrad(const T* grad, const T* u, const T* W,
                                T* grad_u, T* grad_W, void* workspace,
                                std::size_t workspace_bytes,
                                const CapsuleDims& d, GpuStream stream,
                                GpuAlgo algo) {
  return LaunchGradFrom(GradFromMemory<T>{grad, d.rows()}, u, W, grad_u, grad_W, workspace,
                        workspace_bytes, d, stream, algo);
}

const char* GpuErrorString(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

#define CAPSNET_INSTANTIATE(T)                                                  \
  template int LaunchCapsulePredictionForward<T>(const T*, const T*, T*,        \
                                                 const CapsuleDims&, GpuStream, \
                                                 GpuAlgo);                      \
  template std::size_t CapsulePredictionGradWorkspaceBytes<T>(                  \
      const CapsuleDims&, GpuAlgo);                                             \
  template int LaunchCapsulePredictionGrad<T>(                                  \
      const T*, const T*, const T*, T*, T*, void*, std::size_t,                 \
      const CapsuleDims&, GpuStream, GpuAlgo);

CAPSNET_INSTANTIATE(float)
CAPSNET_INSTANTIATE(double)
CAPSNET_INSTANTIATE(half_t)
CAPSNET_INSTANTIATE(bfloat16_t)
#undef CAPSNET_INSTANTIATE

}  // namespace capsnet
