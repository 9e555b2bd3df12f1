// The capsule-prediction gradient on the GPU, templated over where
// grad_u_hat comes from (the `Src` below): the tiled kernel, the generic
// kernels, the batch-split partials and LaunchGradFrom, which picks among them.
// prediction.cu.cc runs it with GradFromMemory (a u_hat-sized gradient), and
// routing.cu.cc with GradFromCoupling (c_ij * grad_s formed on the fly, the
// fused routing op's stop-gradient gradient), so both ops share one gradient.
//
// Design: one kernel. Per batch row a thread reads its grad vector once and
// (a) accumulates grad_W for its rows in registers over the batch, (b) writes
// its share of grad_u[b, i, :] to shared memory, which the block then sums
// over the capsule's threads in a fixed order. A block owns its capsules, so
// grad_W needs no atomics; when the shape has too few capsule tiles to fill
// the GPU the batch is split into chunks whose grad_W partials a second kernel
// sums in chunk order. The chunking depends on the shape only, so results are
// bitwise reproducible (also across GPU models). Shapes the tiles cannot take
// (in_dim > 16, too many rows per capsule) run one thread per output element.
//
// Measured on an H200, float, paper shape (128, 1152 -> 10 x 16, in_dim 8):
// 81 us = 2.96x the bandwidth floor; the naive generic kernels take 360 us.
// Bound by instruction issue, not HBM (ncu: IPC 1.85, ~11 warps per SM because
// the paper shape has only 46k row vectors): it does 2 * VEC * KMAX FMAs per
// grad vector plus the shared-memory reduction.
//
// A grad source Src provides, for grad_u_hat[b, i, j, d] (row r = j * out_dim + d
// of capsule i):
//   VecUnit(dims)              what the plan's vector width must divide
// and, since the tiled kernel prefetches a stage of Raw values per thread (all
// loads in flight before the first use), then converts them to Acc<T>:
//   ForThread<VEC>(rloc)       per-thread constants for rows rloc .. rloc+VEC-1
//   Load<VEC>(th, b, i, row)   issue the loads of rows `row` (global row index)
//   Convert<VEC>(raw, out)     the VEC values as Acc<T>
// while the generic kernels read single elements with At(b, row).
#ifndef CAPSNET_OPS_PREDICTION_GRAD_CUH_
#define CAPSNET_OPS_PREDICTION_GRAD_CUH_

#include "tiling.cuh"

namespace capsnet {
namespace {

// Shared memory of one gradient block (u stage + grad_u reduction buffer);
// stays under the 48 KiB available without opt-in.
constexpr int kGradSmemBudget = 46 * 1024;
// Backward: split the batch (paying a partials round trip through global
// memory and a reduction kernel) only below this many capsule tiles; a
// 2-way split of the paper shape was 25% slower than none.
constexpr int64 kGradMinTiles = 256;
constexpr int64 kGradMinChunk = 16;

template <typename T>
Plan GradPlan(const CapsuleDims& d, int64 vec_unit = 0) {
  Plan p = TileGeometry<T>(d, vec_unit);
  if (!p.tiled) return p;
  // A (b, capsule, k) row of the reduction buffer holds the capsule's qpc
  // shares, padded to whole 16-byte vectors and to an odd number of them, so
  // lanes summing consecutive rows with 16-byte loads hit distinct banks.
  const int per16 = static_cast<int>(16 / sizeof(Acc<T>));
  int vecs = (p.qpc + per16 - 1) / per16;
  if (vecs % 2 == 0) ++vecs;
  p.red_stride = vecs * per16;
  const int64 su_bytes = static_cast<int64>(kStage) * p.cpb * p.kmax * sizeof(Acc<T>);
  const int64 per_b = static_cast<int64>(p.cpb) * p.kmax * p.red_stride * sizeof(Acc<T>);
  p.red_b = static_cast<int>(std::min<int64>((kGradSmemBudget - su_bytes) / per_b, kStage));
  if (p.red_b < 1) {  // a single batch row does not fit
    p.tiled = false;
    return p;
  }
  p.smem = static_cast<std::size_t>(su_bytes + p.red_b * per_b);
  int64 chunks = 1;
  if (p.tiles < kGradMinTiles) {
    chunks = std::min<int64>({CeilDiv(kGradMinTiles, p.tiles),
                              CeilDiv(d.batch, kGradMinChunk), 65535});
    chunks = std::max<int64>(chunks, 1);
  }
  p.b_chunk = CeilDiv(d.batch, chunks);
  p.chunks = CeilDiv(d.batch, p.b_chunk);
  return p;
}

template <typename T, int VEC, int KMAX, typename Src>
__global__ void __launch_bounds__(MaxThreadsFor(VEC, KMAX, sizeof(Acc<T>)))
    GradTiledKernel(const Src src, const T* __restrict__ u,
                    const T* __restrict__ W, T* __restrict__ grad_u,
                    T* __restrict__ grad_W, Acc<T>* __restrict__ partials,
                    int64 batch, int64 in_caps, int in_dim, int jd, int cpb,
                    int64 b_chunk, int red_b, int red_stride) {
  using A = Acc<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* su = reinterpret_cast<A*>(smem_raw);  // one stage of u
  // Per-thread shares of grad_u for red_b batch rows:
  // red[((bb * cpb + c) * KMAX + k) * red_stride + q].
  A* red = su + kStage * cpb * KMAX;

  const auto [cap, q, i0, ncaps, active, rows, row] = TileThreadOf<VEC>(in_caps, jd, cpb);
  const auto th = src.template ForThread<VEC>(q * VEC);
  const UTile<T, KMAX> tile(u, in_caps, i0, in_dim, ncaps, cpb);
  // Zero the reduction buffer once: the padding past qpc in each row is never
  // written and must read as zero.
  constexpr int kPer16 = 16 / sizeof(A);
  using RedVec = Vec<A, kPer16>;
  const int red_vecs = red_b * cpb * KMAX * red_stride / kPer16;
  for (int x = threadIdx.x; x < red_vecs; x += blockDim.x) {
    reinterpret_cast<RedVec*>(red)[x] = RedVec{};
  }

  A w[VEC][KMAX];
  A gw[VEC][KMAX];  // grad_W[row:row+VEC, :] summed over this block's batch
#pragma unroll
  for (int n = 0; n < VEC; ++n) {
    LoadRow<T, KMAX>(W + (row + n) * in_dim, in_dim, active, w[n]);
#pragma unroll
    for (int k = 0; k < KMAX; ++k) gw[n][k] = A(0);
  }

  const int64 b_begin = static_cast<int64>(blockIdx.y) * b_chunk;
  const int64 b_end = min(batch, b_begin + b_chunk);
  A* my_red = red + static_cast<int64>(cap) * KMAX * red_stride + q;
  const float inv_cpb = 1.0f / cpb;
  for (int64 b0 = b_begin; b0 < b_end; b0 += kStage) {
    const int nb = static_cast<int>(min(static_cast<int64>(kStage), b_end - b0));
    // All loads of the stage are issued before the first use.
    typename Src::template Raw<VEC> gv[kStage];
#pragma unroll
    for (int bb = 0; bb < kStage; ++bb) {
      if (active && bb < nb) gv[bb] = src.template Load<VEC>(th, b0 + bb, i0 + cap, row);
    }
    A upre[kUPrefetch];
    tile.Prefetch(upre, b0, nb);
    __syncthreads();  // the previous stage's su and red reads are done
    tile.Commit(upre, su, b0, nb);
    __syncthreads();
    for (int sb = 0; sb < nb; sb += red_b) {
      const int se = min(nb, sb + red_b);
      if (active) {
        // Fully unrolled with a predicate so gv stays in registers.
#pragma unroll
        for (int bb = 0; bb < kStage; ++bb) {
          if (bb < sb || bb >= se) continue;
          A gf[VEC];
          src.template Convert<VEC>(gv[bb], gf);
          const A* ub = su + (bb * cpb + cap) * KMAX;
          A uk[KMAX];
#pragma unroll
          for (int k = 0; k < KMAX; ++k) uk[k] = ub[k];
#pragma unroll
          for (int n = 0; n < VEC; ++n) {
#pragma unroll
            for (int k = 0; k < KMAX; ++k) gw[n][k] = fma(gf[n], uk[k], gw[n][k]);
          }
          A* dst = my_red + static_cast<int64>(bb - sb) * cpb * KMAX * red_stride;
#pragma unroll
          for (int k = 0; k < KMAX; ++k) {
            A part = A(0);
#pragma unroll
            for (int n = 0; n < VEC; ++n) part = fma(w[n][k], gf[n], part);
            dst[k * red_stride] = part;
          }
        }
      }
      __syncthreads();
      // grad_u[b, i0 + c, k] = sum over the capsule's qpc threads, in order.
      const int nout = (se - sb) * cpb * KMAX;
      const int row_vecs = red_stride / kPer16;
      for (int o = threadIdx.x; o < nout; o += blockDim.x) {
        const int k = o % KMAX;
        const int bc = o / KMAX;
        // bc / cpb without an integer division: bc < kStage * cpb, so the
        // fraction of (bc + 0.5) / cpb stays 0.5 / cpb away from an integer,
        // far above float rounding.
        const int bq = __float2int_rd((bc + 0.5f) * inv_cpb);
        const int c = bc - bq * cpb;
        if (c >= ncaps || k >= in_dim) continue;
        const RedVec* src = reinterpret_cast<const RedVec*>(red + o * red_stride);
        A acc[kPer16] = {};
        for (int t = 0; t < row_vecs; ++t) {
          const RedVec v = src[t];
#pragma unroll
          for (int e = 0; e < kPer16; ++e) acc[e] += v.v[e];
        }
        A sum = acc[0];
#pragma unroll
        for (int e = 1; e < kPer16; ++e) sum += acc[e];
        grad_u[((b0 + sb + bq) * in_caps + i0 + c) * in_dim + k] = FromAcc<T>(sum);
      }
      if (se < nb) __syncthreads();  // red is reused by the next sub-stage
    }
  }

  if (!active) return;
  if (partials == nullptr) {
#pragma unroll
    for (int n = 0; n < VEC; ++n) {
#pragma unroll
      for (int k = 0; k < KMAX; ++k) {
        if (k < in_dim) grad_W[(row + n) * in_dim + k] = FromAcc<T>(gw[n][k]);
      }
    }
  } else {
    A* dst = partials + static_cast<int64>(blockIdx.y) * rows * in_dim;
#pragma unroll
    for (int n = 0; n < VEC; ++n) {
#pragma unroll
      for (int k = 0; k < KMAX; ++k) {
        if (k < in_dim) dst[(row + n) * in_dim + k] = gw[n][k];
      }
    }
  }
}

// grad_W[x] = sum over chunks c (in order) of partials[c][x].
template <typename T>
__global__ void ReducePartialsKernel(const Acc<T>* __restrict__ partials,
                                     T* __restrict__ grad_W, int64 n,
                                     int64 chunks) {
  for (const int64 x : GridStride(n)) {
    Acc<T> s = Acc<T>(0);
    for (int64 c = 0; c < chunks; ++c) s += partials[c * n + x];
    grad_W[x] = FromAcc<T>(s);
  }
}

// ---------------------------------------------------------------------------
// Generic kernels: one thread per output element, grid-stride, 64-bit indices.

template <typename T, typename Src>
__global__ void GradUGenericKernel(const Src src, const T* __restrict__ W,
                                   T* __restrict__ grad_u, int64 batch,
                                   int64 in_caps, int64 in_dim, int64 jd) {
  for (const int64 x : GridStride(batch * in_caps * in_dim)) {
    const int64 k = x % in_dim;
    const int64 bi = x / in_dim;
    const int64 i = bi % in_caps;
    const int64 b = bi / in_caps;
    const T* wc = W + i * jd * in_dim + k;
    Acc<T> s = Acc<T>(0);
    for (int64 r = 0; r < jd; ++r) s = fma(ToAcc(wc[r * in_dim]), src.At(b, i * jd + r), s);
    grad_u[x] = FromAcc<T>(s);
  }
}

template <typename T, typename Src>
__global__ void GradWGenericKernel(const Src src, const T* __restrict__ u,
                                   T* __restrict__ grad_W, int64 batch,
                                   int64 in_caps, int64 in_dim, int64 jd) {
  for (const int64 x : GridStride(in_caps * jd * in_dim)) {
    const int64 k = x % in_dim;
    const int64 r = x / in_dim;
    const T* uc = u + (r / jd) * in_dim + k;
    Acc<T> s = Acc<T>(0);
    for (int64 b = 0; b < batch; ++b) {
      s = fma(src.At(b, r), ToAcc(uc[b * in_caps * in_dim]), s);
    }
    grad_W[x] = FromAcc<T>(s);
  }
}

template <typename T, int VEC, int KMAX, typename Src>
cudaError_t LaunchGradTiled(const Src& src, const T* u, const T* W, T* grad_u,
                            T* grad_W, Acc<T>* partials, const CapsuleDims& d,
                            const Plan& p, cudaStream_t stream) {
  if constexpr (VEC > MaxVec<T>()) {
    return cudaErrorInvalidValue;
  } else {
    return Launch(GradTiledKernel<T, VEC, KMAX, Src>,
                  dim3(static_cast<unsigned>(p.tiles), static_cast<unsigned>(p.chunks)),
                  dim3(p.threads), p.smem, stream, src, u, W, grad_u, grad_W,
                  partials, d.batch, d.in_caps, static_cast<int>(d.in_dim),
                  static_cast<int>(d.rows_per_cap()), p.cpb, p.b_chunk, p.red_b,
                  p.red_stride);
  }
}

template <typename T>
std::size_t GradWorkspaceBytes(const CapsuleDims& d, GpuAlgo algo, int64 vec_unit) {
  if (!Tiled(algo) || d.u_hat_size() == 0 || d.in_dim == 0) return 0;
  const Plan p = GradPlan<T>(d, vec_unit);
  if (!p.tiled || p.chunks <= 1) return 0;
  return static_cast<std::size_t>(p.chunks * d.w_size()) * sizeof(Acc<T>);
}

// The gradient launch for either source of grad_u_hat (GradFromMemory or
// GradFromCoupling): the tiled kernel (+ the partials reduction when the batch is
// split) or the generic kernels. The plan is the same for both sources.
template <typename T, typename Src>
cudaError_t LaunchGradFrom(const Src& src, const T* u, const T* W, T* grad_u, T* grad_W,
                           void* workspace, std::size_t workspace_bytes,
                           const CapsuleDims& d, cudaStream_t stream, GpuAlgo algo) {
  if (d.u_hat_size() == 0 || d.in_dim == 0) {
    // Empty sums: zero gradients (the batch, in_caps or the rows are empty, or
    // in_dim is and then both gradients are empty too).
    cudaError_t err = cudaSuccess;
    if (d.u_size() > 0) err = cudaMemsetAsync(grad_u, 0, d.u_size() * sizeof(T), stream);
    if (err == cudaSuccess && d.w_size() > 0) {
      err = cudaMemsetAsync(grad_W, 0, d.w_size() * sizeof(T), stream);
    }
    return err;
  }
  const Plan p = GradPlan<T>(d, Src::VecUnit(d));
  if (Tiled(algo) && p.tiled) {
    Acc<T>* partials = nullptr;
    if (p.chunks > 1) {
      if (workspace == nullptr ||
          workspace_bytes < GradWorkspaceBytes<T>(d, algo, Src::VecUnit(d))) {
        return cudaErrorInvalidValue;
      }
      partials = static_cast<Acc<T>*>(workspace);
    }
    cudaError_t err = DispatchVecK(p, [&](auto vec, auto kmax) {
      return LaunchGradTiled<T, decltype(vec)::value, decltype(kmax)::value>(
          src, u, W, grad_u, grad_W, partials, d, p, stream);
    });
    if (err != cudaSuccess || partials == nullptr) return err;
    const int64 n = d.w_size();
    return Launch(ReducePartialsKernel<T>, GenericGrid(n), dim3(kGenericThreads),
                  0, stream, partials, grad_W, n, p.chunks);
  }
  cudaError_t err = Launch(GradUGenericKernel<T, Src>, GenericGrid(d.u_size()),
                           dim3(kGenericThreads), 0, stream, src, W, grad_u,
                           d.batch, d.in_caps, d.in_dim, d.rows_per_cap());
  if (err != cudaSuccess) return err;
  return Launch(GradWGenericKernel<T, Src>, GenericGrid(d.w_size()),
                dim3(kGenericThreads), 0, stream, src, u, grad_W, d.batch,
                d.in_caps, d.in_dim, d.rows_per_cap());
}

}  // namespace
}  // namespace capsnet

#endif  // CAPSNET_OPS_PREDICTION_GRAD_CUH_
