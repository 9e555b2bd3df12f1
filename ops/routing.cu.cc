// CUDA kernels and TF-free launchers of the fused routing op
// Capsnet>CapsuleRouting (capsule prediction + all routing iterations, u_hat
// never in memory) and of its gradient, which is the prediction gradient of
// prediction_grad.cuh with grad_u_hat = c_ij * grad_s formed on the fly.
//
// Free of TensorFlow: built by scripts/build_ops.py into the op library and, with
// ops/sanitize_driver.cu, into a standalone program for compute-sanitizer.
//
// Why fused: routing is memory bound in TensorFlow (u_hat, 737 KB per image, is
// read ~7 times in 3 iterations and products of its size are written), while
// recomputing u_hat = W u costs in_dim FMAs per element, far below what an H100/
// H200 does per byte of HBM. So no u_hat ever goes to memory: every iteration
// recomputes it from u and W in registers.
//
// One iteration t = one RoutingIterationKernel + one RoutingReduceKernel. For
// 16-bit u and W at the paper's dims the iteration kernel and the gradient are
// the tensor-core ones of routing_mma.cuh (same workspace, same reduce kernel).
// - Grid (cap_blocks, batch_blocks). A block owns a range of input capsules
//   (`subs` sub-chunks of `ic` capsules) and strides over batch stages of
//   `stage` samples. Thread (g, q) owns `vec` rows r = q*vec .. q*vec+vec-1 of a
//   capsule's J*D rows (vec divides out_dim, so all its rows belong to one output
//   capsule j) and kRouteSamples samples of the stage (group g).
// - Per sub-chunk, W[i0:i0+ic] and u[stage, i0:i0+ic] are staged in shared
//   memory (zero-padded to KMAX, W rows interleaved so that a warp reads
//   consecutive 16-byte vectors) and used in three phases:
//   (1) t > 0: per (sample, capsule), the thread's share of the agreement
//       u_hat_j|i . v_j over its rows (v_j of the previous iteration, from L1);
//   (2) one thread per (sample, capsule): b_ij (+= the agreement, summed over the
//       out_dim / vec shares in order), stored for the next iteration; c_ij =
//       softmax_j (leaky: with the extra zero logit, capsnet_kernels.h); the last
//       iteration writes c_ij out;
//   (3) per (sample, capsule) the thread recomputes its u_hat rows and adds
//       c_ij u_hat to its share of s_j, kept in registers over all the block's
//       capsules.
//   Recomputing u_hat in (3) instead of keeping it costs in_dim FMAs per element
//   and keeps the registers for the s_j and v_j rows of 8 samples.
// - Each block writes its partial s_j (cap_blocks x B x J*D); the reduce kernel
//   sums them in block order (deterministic, no atomics) and squashes into v_j,
//   or, after the last iteration, writes s_j out.
// b_ij (B x I x J) lives in the workspace between iterations (needed only for
// r >= 3: iteration 1 starts from b = 0 plus its agreement).
// Shapes the tiled kernel cannot take (in_dim > 16, J*D / vec > 256 threads, or
// shared memory for one capsule exceeded) run the generic kernels: one thread per
// (b, i) for the softmax, one per (b, j, d) for s_j.
#include "capsnet_kernels.h"
#include "cuda_common.cuh"
#include "prediction_grad.cuh"
#include "routing_mma.cuh"

namespace capsnet {
namespace {

__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }

// Samples per thread per stage: the size of the register arrays of v_j and s_j
// rows (2 * kRouteSamples * vec values).
constexpr int kRouteSamples = 8;
// Threads per block at most.
constexpr int kRouteMaxThreads = 256;
// Blocks of the iteration kernel resident on one SM, which its launch bounds cap
// the registers for (65536 / (3 * 256) -> 85 per thread). 3 for in_dim <= 8:
// at 2 (126 registers, 25% occupancy) Nsight Compute found the warps waiting on
// each other's latency (0.45 issued per scheduler cycle); at 3, with 112 bytes
// spilled, the forward at batch 512 took 740 instead of 838 us in float32 and
// 715 instead of 774 us in bfloat16 on an H100 (scripts/benchmark_ops.py).
// 2 above in_dim 8, where 85 registers spill 600 bytes (not measured).
constexpr int RouteBlocksPerSm(int kmax) { return kmax <= 8 ? 3 : 2; }
// Capsules staged in shared memory per sub-chunk at most, and the budget (no
// opt-in above 48 KiB needed).
constexpr int kRouteMaxCaps = 8;
constexpr int64 kRouteSmemBudget = 46 * 1024;
// Blocks the plan aims for: RouteBlocksPerSm resident blocks on each of an
// H100/H200's 132 SMs. Fixed, not queried: the plan (and so the summation order)
// must depend on the shape only. More blocks mean more partial sums to write and
// reduce.
constexpr int64 kRouteSms = 132;
constexpr int kReduceThreads = 256;

struct RoutePlan {
  bool tiled = false;
  int vec = 1;         // rows per thread; divides out_dim
  int kmax = 4;        // in_dim padded to 4, 8 or 16
  int qpc = 1;         // threads per sample group: J * D / vec
  int groups = 1;      // sample groups per block
  int stage = 1;       // samples per block stage: groups * kRouteSamples
  int ic = 1;          // capsules per shared-memory sub-chunk
  int agr_stride = 1;  // odd row stride of the agreement buffer (no bank conflicts)
  int64 subs = 1;          // sub-chunks per block
  int64 cap_blocks = 1;    // grid.x = partial sums of s_j per sample
  int64 batch_blocks = 1;  // grid.y; blocks stride over further stages
  std::size_t smem = 0;
  MmaPlan mma;  // the tensor-core iteration kernel's (16-bit types at the paper's dims)
};

template <typename T>
RoutePlan RoutingPlan(const CapsuleDims& d) {
  RoutePlan p;
  const int64 jd = d.rows_per_cap();
  if (d.in_dim > 16 || d.in_dim < 1 || jd < 1 || d.in_caps < 1 || d.batch < 1) return p;
  p.kmax = d.in_dim <= 4 ? 4 : (d.in_dim <= 8 ? 8 : 16);
  p.vec = 1;
  for (int v = MaxVec<T>(); v > 1; v /= 2) {
    if (d.out_dim % v == 0) {
      p.vec = v;
      break;
    }
  }
  const int64 qpc = jd / p.vec;
  if (qpc > kRouteMaxThreads) return p;
  p.qpc = static_cast<int>(qpc);
  p.agr_stride = p.qpc | 1;
  const int64 a = sizeof(Acc<T>);
  // As many sample groups as fit in the thread budget (no more than the batch
  // needs), then as many capsules per sub-chunk as fit in shared memory.
  int64 groups = std::min<int64>(kRouteMaxThreads / qpc, CeilDiv(d.batch, kRouteSamples));
  for (; groups >= 1 && !p.tiled; groups = groups / 2) {
    const int64 stage = groups * kRouteSamples;
    for (int64 ic = std::min<int64>(kRouteMaxCaps, d.in_caps); ic >= 1; --ic) {
      const int64 bytes = a * (ic * jd * p.kmax + stage * ic * p.kmax + stage * ic * p.agr_stride);
      if (bytes <= kRouteSmemBudget) {
        p.groups = static_cast<int>(groups);
        p.stage = static_cast<int>(stage);
        p.ic = static_cast<int>(ic);
        p.smem = static_cast<std::size_t>(bytes);
        p.tiled = true;
        break;
      }
    }
  }
  if (!p.tiled) return p;
  p.batch_blocks = std::min<int64>(CeilDiv(d.batch, p.stage), 65535);
  const int64 subs_total = CeilDiv(d.in_caps, p.ic);
  const int64 target_blocks = kRouteSms * RouteBlocksPerSm(p.kmax);
  const int64 want = std::min(subs_total, std::max<int64>(1, CeilDiv(target_blocks, p.batch_blocks)));
  p.subs = CeilDiv(subs_total, want);
  p.cap_blocks = CeilDiv(subs_total, p.subs);  // every block has >= 1 capsule
  p.mma = RoutingMmaPlan<T>(d, kRouteSms);
  return p;
}

// Partial sums of s_j per sample the workspace holds: the launch picks the
// tensor-core kernel only for aligned pointers, so room for either kernel's.
int64 RouteChunks(const RoutePlan& p, bool tiled) {
  if (!tiled) return 1;
  return p.mma.ok ? std::max(p.cap_blocks, p.mma.cap_blocks) : p.cap_blocks;
}

// The workspace: b_ij (r >= 3), c_ij (generic kernels), the partial sums of s_j,
// v_j (r >= 2), each in Acc<T>, and W's split parts for the float32 tensor-core
// kernels, each 256-byte aligned. With base == nullptr only `bytes` is meaningful.
template <typename T>
struct RouteWorkspace {
  using S = typename MmaIo<T>::S;
  Acc<T>* b_ij = nullptr;
  Acc<T>* c_ij = nullptr;
  Acc<T>* partials = nullptr;
  Acc<T>* v_j = nullptr;
  S* w_hi = nullptr;
  S* w_lo = nullptr;
  std::size_t bytes = 0;
};

// Whether the tensor-core kernels take W split into the workspace (float32 at
// their shapes), for either tiled algo: kAuto and kCudaCores size the same.
template <typename T>
bool SplitsW(const CapsuleDims& d, GpuAlgo algo) {
  return MmaIo<T>::kSplit && Tiled(algo) && MmaShape<T>(d);
}

bool RoutingIsEmpty(const CapsuleDims& d) { return d.u_hat_size() == 0 || d.in_dim == 0; }

template <typename T>
RouteWorkspace<T> RouteLayout(const CapsuleDims& d, int iterations, GpuAlgo algo, bool tiled, int64 chunks,
                              void* base) {
  RouteWorkspace<T> w;
  if (RoutingIsEmpty(d)) return w;
  auto carve = [&](auto type_tag, int64 count) {
    using E = decltype(type_tag);
    if (count <= 0) return static_cast<E*>(nullptr);
    const std::size_t offset = w.bytes;
    w.bytes += (static_cast<std::size_t>(count) * sizeof(E) + 255) / 256 * 256;
    return base == nullptr ? nullptr : reinterpret_cast<E*>(static_cast<unsigned char*>(base) + offset);
  };
  const int64 bij = d.batch * d.in_caps * d.out_caps;
  const int64 sj = d.batch * d.rows_per_cap();
  w.b_ij = carve(Acc<T>(), iterations >= 3 ? bij : 0);
  w.c_ij = carve(Acc<T>(), tiled ? 0 : bij);
  w.partials = carve(Acc<T>(), chunks * sj);
  w.v_j = carve(Acc<T>(), iterations >= 2 ? sj : 0);
  using S = typename MmaIo<T>::S;
  const int64 split = SplitsW<T>(d, algo) ? d.w_size() : 0;
  w.w_hi = carve(S(), split);
  w.w_lo = carve(S(), split);
  return w;
}

// W rows of capsule slot c for this thread from the interleaved w_s.
template <typename A, int VEC, int KMAX>
__device__ __forceinline__ void LoadWTile(const Vec<A, 16 / sizeof(A)>* __restrict__ w_v,
                                          int c, int jd, int qpc, int q, A (&w)[VEC][KMAX]) {
  constexpr int kLane = 16 / sizeof(A);
  constexpr int K4 = KMAX / kLane;
#pragma unroll
  for (int n = 0; n < VEC; ++n) {
#pragma unroll
    for (int k4 = 0; k4 < K4; ++k4) {
      const Vec<A, kLane> x = w_v[(c * K4 + k4) * jd + n * qpc + q];
#pragma unroll
      for (int e = 0; e < kLane; ++e) w[n][k4 * kLane + e] = x.v[e];
    }
  }
}

// u[b, i, :] of stage row `row` (= sample * ic + capsule slot), zero-padded.
template <typename A, int KMAX>
__device__ __forceinline__ void LoadURow(const Vec<A, 16 / sizeof(A)>* __restrict__ u_v,
                                         int row, A (&uk)[KMAX]) {
  constexpr int kLane = 16 / sizeof(A);
  constexpr int K4 = KMAX / kLane;
#pragma unroll
  for (int k4 = 0; k4 < K4; ++k4) {
    const Vec<A, kLane> x = u_v[row * K4 + k4];
#pragma unroll
    for (int e = 0; e < kLane; ++e) uk[k4 * kLane + e] = x.v[e];
  }
}

// One routing iteration (see the design notes above). v == nullptr at t = 0
// (no agreement yet); read_b / write_b say whether b_ij is read (t >= 2) and
// stored (t >= 1 and not last); c_out != nullptr at the last iteration; leaky:
// the softmax over [0, b_i1..b_iJ] with the zero logit's share dropped.
template <typename T, int VEC, int KMAX>
__global__ void __launch_bounds__(kRouteMaxThreads, RouteBlocksPerSm(KMAX))
    RoutingIterationKernel(const T* __restrict__ u, const T* __restrict__ W,
                           const Acc<T>* __restrict__ v, Acc<T>* __restrict__ b_ij,
                           T* __restrict__ c_out, Acc<T>* __restrict__ partials,
                           int64 batch, int64 in_caps, int in_dim, int out_caps,
                           int out_dim, int ic, int64 subs, int stage, int agr_stride,
                           int read_b, int write_b, int leaky) {
  using A = Acc<T>;
  constexpr int kLane = 16 / sizeof(A);  // A values per 16-byte vector
  constexpr int K4 = KMAX / kLane;
  using AV = Vec<A, kLane>;
  const int jd = out_caps * out_dim;
  const int qpc = jd / VEC;
  const int dv = out_dim / VEC;  // threads sharing an output capsule j
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* w_s = reinterpret_cast<A*>(smem_raw);  // [ic][K4][jd, interleaved][kLane]
  A* u_s = w_s + ic * jd * KMAX;            // [stage][ic][KMAX]
  A* agr = u_s + stage * ic * KMAX;         // [stage * ic][agr_stride]
  const AV* w_v = reinterpret_cast<const AV*>(w_s);
  const AV* u_v = reinterpret_cast<const AV*>(u_s);

  const int g = threadIdx.x / qpc;
  const int q = threadIdx.x - g * qpc;
  const int rloc = q * VEC;         // first row of this thread within a capsule
  const int jq = rloc / out_dim;    // its output capsule
  const int s0 = g * kRouteSamples;  // its first sample within the stage
  const int64 cap_begin = static_cast<int64>(blockIdx.x) * subs * ic;
  const int64 cap_end = min(in_caps, cap_begin + subs * ic);

  for (int64 b0 = static_cast<int64>(blockIdx.y) * stage; b0 < batch;
       b0 += static_cast<int64>(gridDim.y) * stage) {
    const int nb = static_cast<int>(min(static_cast<int64>(stage), batch - b0));
    // This thread's s_j rows of its samples, summed over the block's capsules.
    // (Its v_j rows are re-read from L1 per capsule rather than held: 32 more
    // registers would halve the resident blocks at the paper shape.)
    A acc[kRouteSamples][VEC];
#pragma unroll
    for (int s = 0; s < kRouteSamples; ++s) {
#pragma unroll
      for (int n = 0; n < VEC; ++n) acc[s][n] = A(0);
    }
    const A* v_rows = v == nullptr ? nullptr : v + (b0 + s0) * jd + rloc;

    for (int64 i0 = cap_begin; i0 < cap_end; i0 += ic) {
      const int nc = static_cast<int>(min(static_cast<int64>(ic), cap_end - i0));
      __syncthreads();  // the previous sub-chunk is done with w_s, u_s and agr
      // Row r = q' * VEC + n' of a capsule goes to position n' * qpc + q'.
      for (int c = 0; c < ic; ++c) {
        for (int x = threadIdx.x; x < jd * KMAX; x += blockDim.x) {
          const int r = x / KMAX;
          const int k = x - r * KMAX;
          A val = A(0);
          if (c < nc && k < in_dim) val = ToAcc(W[((i0 + c) * jd + r) * in_dim + k]);
          const int qq = r / VEC;
          const int nn = r - qq * VEC;
          w_s[((c * K4 + k / kLane) * jd + nn * qpc + qq) * kLane + k % kLane] = val;
        }
      }
      for (int x = threadIdx.x; x < stage * ic * KMAX; x += blockDim.x) {
        const int sc = x / KMAX;
        const int k = x - sc * KMAX;
        const int s = sc / ic;
        const int c = sc - s * ic;
        A val = A(0);
        if (s < nb && c < nc && k < in_dim) {
          val = ToAcc(u[((b0 + s) * in_caps + i0 + c) * in_dim + k]);
        }
        u_s[x] = val;
      }
      __syncthreads();

      // (1) agreement shares: sum over this thread's rows of u_hat * v_j.
      if (v != nullptr) {
        for (int c = 0; c < nc; ++c) {
          A w[VEC][KMAX];
          LoadWTile<A, VEC, KMAX>(w_v, c, jd, qpc, q, w);
#pragma unroll
          for (int s = 0; s < kRouteSamples; ++s) {
            Vec<A, VEC> vs{};  // v_j[b, rows]; zero for padding samples (their u is 0 too)
            if (s0 + s < nb) vs = *reinterpret_cast<const Vec<A, VEC>*>(v_rows + s * jd);
            A uk[KMAX];
            LoadURow<A, KMAX>(u_v, (s0 + s) * ic + c, uk);
            A share = A(0);
#pragma unroll
            for (int n = 0; n < VEC; ++n) {
              A uh = A(0);
#pragma unroll
              for (int k = 0; k < KMAX; ++k) uh = fma(w[n][k], uk[k], uh);
              share = fma(uh, vs.v[n], share);
            }
            agr[((s0 + s) * ic + c) * agr_stride + q] = share;
          }
        }
      }
      __syncthreads();

      // (2) b_ij and c_ij = softmax_j(b_ij), one thread per (sample, capsule);
      // c_ij replaces the row's first out_caps entries in place. Leaky: the zero
      // logit counts in the max (m starts at 0) and first in the sum.
      for (int pi = threadIdx.x; pi < stage * ic; pi += blockDim.x) {
        const int s = pi / ic;
        const int c = pi - s * ic;
        A* row = agr + pi * agr_stride;
        if (s >= nb || c >= nc) {  // padding: contributes c_ij = 0
          for (int j = 0; j < out_caps; ++j) row[j] = A(0);
          continue;
        }
        const int64 bij = ((b0 + s) * in_caps + i0 + c) * out_caps;
        A m = A(0);
        for (int j = 0; j < out_caps; ++j) {
          A logit = read_b ? b_ij[bij + j] : A(0);
          if (v != nullptr) {
            A agreement = A(0);
            for (int t = 0; t < dv; ++t) agreement += row[j * dv + t];
            logit += agreement;
          }
          if (write_b) b_ij[bij + j] = logit;
          // Entry j belongs to the shares of capsule j / dv <= j, already read.
          row[j] = logit;
          m = (j == 0 && !leaky) ? logit : max(m, logit);
        }
        A sum = leaky ? Exp(-m) : A(0);
        for (int j = 0; j < out_caps; ++j) {
          const A e = Exp(row[j] - m);
          row[j] = e;
          sum += e;
        }
        for (int j = 0; j < out_caps; ++j) {
          const A cij = row[j] / sum;
          row[j] = cij;
          if (c_out != nullptr) c_out[bij + j] = FromAcc<T>(cij);
        }
      }
      __syncthreads();

      // (3) s_j shares: c_ij * u_hat over this thread's rows, capsules in order.
      for (int c = 0; c < nc; ++c) {
        A w[VEC][KMAX];
        LoadWTile<A, VEC, KMAX>(w_v, c, jd, qpc, q, w);
#pragma unroll
        for (int s = 0; s < kRouteSamples; ++s) {
          const A cij = agr[((s0 + s) * ic + c) * agr_stride + jq];
          A uk[KMAX];
          LoadURow<A, KMAX>(u_v, (s0 + s) * ic + c, uk);
#pragma unroll
          for (int n = 0; n < VEC; ++n) {
            A uh = A(0);
#pragma unroll
            for (int k = 0; k < KMAX; ++k) uh = fma(w[n][k], uk[k], uh);
            acc[s][n] = fma(cij, uh, acc[s][n]);
          }
        }
      }
    }

    A* dst = partials + (static_cast<int64>(blockIdx.x) * batch + b0 + s0) * jd + rloc;
#pragma unroll
    for (int s = 0; s < kRouteSamples; ++s) {
      if (s0 + s < nb) {
        Vec<A, VEC> x;
#pragma unroll
        for (int n = 0; n < VEC; ++n) x.v[n] = acc[s][n];
        *reinterpret_cast<Vec<A, VEC>*>(dst + s * jd) = x;
      }
    }
  }
}

// s_j = sum of the `chunks` partial sums (in order); then the output s_j
// (s_out != nullptr, last iteration) or v_j = squash(s_j) (v != nullptr), with
// squash as capsnet.routing.squash computes it. One warp per (b, j): lane
// (part, d) sums chunks part, part + parts, ... of row d, the parts are added by
// a fixed butterfly, and |s_j|^2 by another (deterministic).
template <typename T>
__global__ void RoutingReduceKernel(const Acc<T>* __restrict__ partials, int64 chunks,
                                    int64 batch, int out_caps, int out_dim, int dpow,
                                    T* __restrict__ s_out, Acc<T>* __restrict__ v) {
  using A = Acc<T>;
  const int lane = threadIdx.x & 31;
  const int parts = 32 / dpow;  // dpow: power of 2 >= out_dim, at most 32
  const int part = lane / dpow;
  const int dl = lane - part * dpow;
  const int64 jd = static_cast<int64>(out_caps) * out_dim;
  const int64 stride = batch * jd;  // between two chunks
  const int64 warps = static_cast<int64>(gridDim.x) * (blockDim.x / 32);
  for (int64 bj = static_cast<int64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       bj < batch * out_caps; bj += warps) {
    const int64 base = (bj / out_caps) * jd + (bj % out_caps) * out_dim;  // s_j[b, j, 0]
    A sq = A(0);
    for (int d0 = 0; d0 < out_dim; d0 += dpow) {  // the same trip count on every lane
      const int d = d0 + dl;
      const bool mine = d < out_dim;
      A sum = A(0);
      if (mine) {
        const A* p = partials + base + d;
        for (int64 c = part; c < chunks; c += parts) sum += p[c * stride];
      }
      for (int off = dpow; off < 32; off *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (mine && part == 0) {
        if (s_out != nullptr) {
          s_out[base + d] = FromAcc<T>(sum);
        } else {
          v[base + d] = sum;  // scaled below
        }
        sq = fma(sum, sum, sq);
      }
    }
    if (v == nullptr) continue;
    for (int off = 1; off < 32; off *= 2) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    const A scale = sq / (A(1) + sq) / sqrt(sq + static_cast<A>(kSquashEpsilon));
    for (int d = dl; d < out_dim; d += dpow) {
      if (part == 0) v[base + d] *= scale;  // this lane's own writes above
    }
  }
}

// Generic kernels (any shape; one thread per output, 64-bit indices).
// Logits b_ij (+ agreement with v_j) and c_ij = softmax_j (leaky: with the zero
// logit, as the tiled kernel), one thread per (b, i).
template <typename T>
__global__ void RoutingSoftmaxGenericKernel(const T* __restrict__ u, const T* __restrict__ W,
                                            const Acc<T>* __restrict__ v,
                                            Acc<T>* __restrict__ b_ij, Acc<T>* __restrict__ c,
                                            T* __restrict__ c_out, int64 batch, int64 in_caps,
                                            int64 out_caps, int64 out_dim, int64 in_dim,
                                            int read_b, int write_b, int leaky) {
  using A = Acc<T>;
  const int64 jd = out_caps * out_dim;
  for (const int64 x : GridStride(batch * in_caps)) {
    const int64 b = x / in_caps;
    const int64 i = x - b * in_caps;
    const T* ub = u + x * in_dim;
    A* cx = c + x * out_caps;
    A m = A(0);
    for (int64 j = 0; j < out_caps; ++j) {
      A logit = read_b ? b_ij[x * out_caps + j] : A(0);
      if (v != nullptr) {
        A agreement = A(0);
        for (int64 d = 0; d < out_dim; ++d) {
          const A uh = RowDot(W + ((i * out_caps + j) * out_dim + d) * in_dim, ub, in_dim);
          agreement = fma(uh, v[b * jd + j * out_dim + d], agreement);
        }
        logit += agreement;
      }
      if (write_b) b_ij[x * out_caps + j] = logit;
      cx[j] = logit;
      m = (j == 0 && !leaky) ? logit : max(m, logit);
    }
    A sum = leaky ? Exp(-m) : A(0);
    for (int64 j = 0; j < out_caps; ++j) {
      cx[j] = Exp(cx[j] - m);
      sum += cx[j];
    }
    for (int64 j = 0; j < out_caps; ++j) {
      cx[j] /= sum;
      if (c_out != nullptr) c_out[x * out_caps + j] = FromAcc<T>(cx[j]);
    }
  }
}

// s_j[b, j, d] = sum_i c_ij u_hat (i in order), one thread per (b, j, d), into
// the single chunk of partials.
template <typename T>
__global__ void RoutingSumGenericKernel(const T* __restrict__ u, const T* __restrict__ W,
                                        const Acc<T>* __restrict__ c, Acc<T>* __restrict__ s,
                                        int64 batch, int64 in_caps, int64 out_caps,
                                        int64 out_dim, int64 in_dim) {
  using A = Acc<T>;
  const int64 jd = out_caps * out_dim;
  for (const int64 x : GridStride(batch * jd)) {
    const int64 b = x / jd;
    const int64 r = x - b * jd;
    const int64 j = r / out_dim;
    A acc = A(0);
    for (int64 i = 0; i < in_caps; ++i) {
      const A uh = RowDot(W + (i * jd + r) * in_dim, u + (b * in_caps + i) * in_dim, in_dim);
      acc = fma(c[(b * in_caps + i) * out_caps + j], uh, acc);
    }
    s[x] = acc;
  }
}

template <typename T>
__global__ void FillKernel(T* __restrict__ p, int64 n, Acc<T> value) {
  for (const int64 x : GridStride(n)) {
    p[x] = FromAcc<T>(value);
  }
}

template <typename T, int VEC, int KMAX>
cudaError_t LaunchRoutingIteration(const T* u, const T* W, const Acc<T>* v, Acc<T>* b_ij,
                                   T* c_out, Acc<T>* partials, const CapsuleDims& d,
                                   const RoutePlan& p, bool read_b, bool write_b, bool leaky,
                                   cudaStream_t stream) {
  if constexpr (VEC > MaxVec<T>()) {
    return cudaErrorInvalidValue;  // never planned
  } else {
    return Launch(RoutingIterationKernel<T, VEC, KMAX>,
                  dim3(static_cast<unsigned>(p.cap_blocks), static_cast<unsigned>(p.batch_blocks)),
                  dim3(p.groups * p.qpc), p.smem, stream, u, W, v, b_ij, c_out, partials,
                  d.batch, d.in_caps, static_cast<int>(d.in_dim), static_cast<int>(d.out_caps),
                  static_cast<int>(d.out_dim), p.ic, p.subs, p.stage, p.agr_stride,
                  read_b ? 1 : 0, write_b ? 1 : 0, leaky ? 1 : 0);
  }
}

// grad_u_hat[b, i, j, d] = c_ij[b, i, j] * grad_s[b, j, d], formed on the fly
// (stop-gradient routing): reads c_ij (1 / out_dim of grad_u_hat) and grad_s
// (tiny) instead of a u_hat-sized gradient. Interface in prediction_grad.cuh.
template <typename T>
struct GradFromCoupling {
  const T* __restrict__ c_ij;    // (batch, in_caps, out_caps)
  const T* __restrict__ grad_s;  // (batch, out_caps * out_dim)
  int64 in_caps;
  int64 out_caps;
  int64 out_dim;
  int64 jd;  // out_caps * out_dim

  // The plan's vector width divides out_dim, so a thread's VEC rows belong to
  // one output capsule j and a stage holds one c_ij per sample.
  static int64 VecUnit(const CapsuleDims& d) { return d.out_dim; }

  template <int VEC>
  struct Raw {
    Vec<T, VEC> g;  // grad_s[b, j, d : d + VEC]
    T c;            // c_ij[b, i, j]
  };
  template <int VEC>
  struct Thread {
    int rloc;  // first row within the capsule, j * out_dim + d (< J*D, a tiled plan's row)
    int j;
  };
  template <int VEC>
  __device__ __forceinline__ Thread<VEC> ForThread(int rloc) const {
    return {rloc, static_cast<int>(rloc / out_dim)};
  }
  template <int VEC>
  __device__ __forceinline__ Raw<VEC> Load(const Thread<VEC>& th, int64 b, int64 i,
                                           int64) const {
    // b * jd + rloc is a multiple of VEC (VEC divides out_dim): aligned.
    return {*reinterpret_cast<const Vec<T, VEC>*>(grad_s + b * jd + th.rloc),
            c_ij[(b * in_caps + i) * out_caps + th.j]};
  }
  template <int VEC>
  __device__ __forceinline__ void Convert(const Raw<VEC>& raw, Acc<T> (&out)[VEC]) const {
    const Acc<T> c = ToAcc(raw.c);
#pragma unroll
    for (int n = 0; n < VEC; ++n) out[n] = c * ToAcc(raw.g.v[n]);
  }
  __device__ __forceinline__ Acc<T> At(int64 b, int64 row) const {
    const int64 i = row / jd;
    const int64 r = row - i * jd;
    return ToAcc(c_ij[(b * in_caps + i) * out_caps + r / out_dim]) * ToAcc(grad_s[b * jd + r]);
  }
};

// ---------------------------------------------------------------------------
// Tiled kernels. Grid (tiles, chunks), block plan.threads, dynamic shared

}  // namespace

template <typename T>
std::size_t CapsuleRoutingWorkspaceBytes(const CapsuleDims& d, int iterations, GpuAlgo algo) {
  const RoutePlan p = RoutingPlan<T>(d);
  const bool tiled = Tiled(algo) && p.tiled;
  return RouteLayout<T>(d, iterations, algo, tiled, RouteChunks(p, tiled), nullptr).bytes;
}

template <typename T>
int LaunchCapsuleRoutingForward(const T* u, const T* W, T* s_j, T* c_ij, void* workspace,
                                std::size_t workspace_bytes, const CapsuleDims& d,
                                int iterations, bool leaky, GpuStream stream, GpuAlgo algo) {
  using A = Acc<T>;
  if (iterations < 1) return cudaErrorInvalidValue;
  if (RoutingIsEmpty(d)) {
    // u_hat empty or zero: s_j = 0 and c_ij = softmax(0) = 1 / out_caps (leaky:
    // 1 / (out_caps + 1), the zero logit's share dropped).
    const int64 s_size = d.batch * d.rows_per_cap();
    const int64 c_size = d.batch * d.in_caps * d.out_caps;
    cudaError_t err = cudaSuccess;
    if (s_size > 0) err = cudaMemsetAsync(s_j, 0, s_size * sizeof(T), stream);
    if (err == cudaSuccess && c_size > 0) {
      err = Launch(FillKernel<T>, GenericGrid(c_size), dim3(kGenericThreads), 0, stream, c_ij,
                   c_size, A(1) / static_cast<A>(d.out_caps + (leaky ? 1 : 0)));
    }
    return err;
  }
  const RoutePlan p = RoutingPlan<T>(d);
  const bool tiled = Tiled(algo) && p.tiled;
  const RouteWorkspace<T> ws = RouteLayout<T>(d, iterations, algo, tiled, RouteChunks(p, tiled), workspace);
  if (workspace == nullptr || workspace_bytes < ws.bytes) return cudaErrorInvalidValue;
  using S = typename MmaIo<T>::S;
  const bool mma = tiled && algo == GpuAlgo::kAuto && p.mma.ok && Aligned(u, 2 * sizeof(T)) &&
                   (MmaIo<T>::kSplit || Aligned(W, 16));
  const int64 chunks = !tiled ? 1 : (mma ? p.mma.cap_blocks : p.cap_blocks);
  // The tensor-core kernel's W: W itself, or its split parts.
  const S* w_hi = reinterpret_cast<const S*>(W);
  const S* w_lo = nullptr;
  if (mma) {
    if constexpr (kHasMma<T>) {
      // Its shared memory (51 KB at J = 10; 92 KB in float32) is above the 48 KB a
      // launch gets without opting in; set on every call, as the device may differ
      // between calls.
      cudaError_t err = cudaFuncSetAttribute(RoutingIterationMmaKernel<T>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(p.mma.smem));
      if (err != cudaSuccess) return err;
      if constexpr (MmaIo<T>::kSplit) {
        err = Launch(SplitKernel<S>, GenericGrid(d.w_size()), dim3(kGenericThreads), 0, stream, W,
                     ws.w_hi, ws.w_lo, d.w_size());
        if (err != cudaSuccess) return err;
        w_hi = ws.w_hi;
        w_lo = ws.w_lo;
      }
    }
  }
  int dpow = 1;
  while (dpow < d.out_dim && dpow < 32) dpow *= 2;
  const int64 reduce_warps = d.batch * d.out_caps;
  const dim3 reduce_grid(static_cast<unsigned>(std::clamp<int64>(
      CeilDiv(reduce_warps, kReduceThreads / 32), 1, kGenericMaxBlocks)));
  for (int t = 0; t < iterations; ++t) {
    const bool last = t == iterations - 1;
    const A* v = t > 0 ? ws.v_j : nullptr;
    const bool read_b = t >= 2;            // b_ij = sum of the earlier agreements
    const bool write_b = t >= 1 && !last;  // ... needed by the next iteration
    T* c_out = last ? c_ij : nullptr;
    cudaError_t err = cudaSuccess;
    if (mma) {
      if constexpr (kHasMma<T>) {
        err = Launch(RoutingIterationMmaKernel<T>,
                     dim3(static_cast<unsigned>(p.mma.cap_blocks), static_cast<unsigned>(p.mma.tiles)),
                     dim3(kMmaThreads), p.mma.smem, stream, u, w_hi, w_lo, v, ws.b_ij, c_out, ws.partials,
                     d.batch, d.in_caps, static_cast<int>(d.out_caps), p.mma.cpb, read_b ? 1 : 0,
                     write_b ? 1 : 0, leaky ? 1 : 0);
      }
    } else if (tiled) {
      err = DispatchVecK(p.vec, p.kmax, [&](auto vec, auto kmax) {
        return LaunchRoutingIteration<T, decltype(vec)::value, decltype(kmax)::value>(
            u, W, v, ws.b_ij, c_out, ws.partials, d, p, read_b, write_b, leaky, stream);
      });
    } else {
      err = Launch(RoutingSoftmaxGenericKernel<T>, GenericGrid(d.batch * d.in_caps),
                   dim3(kGenericThreads), 0, stream, u, W, v, ws.b_ij, ws.c_ij, c_out, d.batch,
                   d.in_caps, d.out_caps, d.out_dim, d.in_dim, read_b ? 1 : 0, write_b ? 1 : 0,
                   leaky ? 1 : 0);
      if (err == cudaSuccess) {
        err = Launch(RoutingSumGenericKernel<T>, GenericGrid(d.batch * d.rows_per_cap()),
                     dim3(kGenericThreads), 0, stream, u, W, ws.c_ij, ws.partials, d.batch,
                     d.in_caps, d.out_caps, d.out_dim, d.in_dim);
      }
    }
    if (err != cudaSuccess) return err;
    err = Launch(RoutingReduceKernel<T>, reduce_grid, dim3(kReduceThreads), 0, stream,
                 ws.partials, chunks, d.batch, static_cast<int>(d.out_caps),
                 static_cast<int>(d.out_dim), dpow, last ? s_j : nullptr,
                 last ? nullptr : ws.v_j);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The gradient's workspace: W's split parts for the float32 tensor-core kernel
// first (their bytes: SplitBytes), then the CUDA-core kernels' partials.
template <typename T>
std::size_t SplitBytes(const CapsuleDims& d, GpuAlgo algo) {
  if (!SplitsW<T>(d, algo)) return 0;
  return 2 * ((static_cast<std::size_t>(d.w_size()) * sizeof(typename MmaIo<T>::S) + 255) / 256 * 256);
}

template <typename T>
std::size_t CapsuleRoutingGradWorkspaceBytes(const CapsuleDims& d, GpuAlgo algo) {
  return SplitBytes<T>(d, algo) + GradWorkspaceBytes<T>(d, algo, GradFromCoupling<T>::VecUnit(d));
}

template <typename T>
int LaunchCapsuleRoutingGrad(const T* c_ij, const T* grad_s, const T* u, const T* W,
                             T* grad_u, T* grad_W, void* workspace,
                             std::size_t workspace_bytes, const CapsuleDims& d,
                             GpuStream stream, GpuAlgo algo) {
  const std::size_t split_bytes = SplitBytes<T>(d, algo);
  if constexpr (kHasMma<T>) {
    // Tensor cores where the shape and the pointers allow.
    using Io = MmaIo<T>;
    using S = typename Io::S;
    const MmaGradPlan mp = RoutingMmaGradPlan<T>(d);
    const std::uintptr_t pair = 2 * sizeof(T);
    if (algo == GpuAlgo::kAuto && mp.ok && (Io::kSplit || Aligned(W, 16)) && Aligned(grad_s, 16) &&
        Aligned(u, pair) && Aligned(grad_u, pair) && Aligned(grad_W, pair)) {
      const S* w_hi = reinterpret_cast<const S*>(W);
      const S* w_lo = nullptr;
      if constexpr (Io::kSplit) {
        if (workspace == nullptr || workspace_bytes < split_bytes) return cudaErrorInvalidValue;
        S* hi = static_cast<S*>(workspace);
        S* lo = reinterpret_cast<S*>(static_cast<unsigned char*>(workspace) + split_bytes / 2);
        const cudaError_t err = Launch(SplitKernel<S>, GenericGrid(d.w_size()), dim3(kGenericThreads), 0,
                                       stream, W, hi, lo, d.w_size());
        if (err != cudaSuccess) return err;
        w_hi = hi;
        w_lo = lo;
      }
      return Launch(RoutingGradMmaKernel<T>, dim3(static_cast<unsigned>(mp.blocks)), dim3(kMmaThreads),
                    mp.smem, stream, c_ij, grad_s, u, w_hi, w_lo, grad_u, grad_W, d.batch, d.in_caps,
                    static_cast<int>(d.out_caps), mp.g_stride);
    }
  }
  const GradFromCoupling<T> src{c_ij, grad_s, d.in_caps, d.out_caps, d.out_dim, d.rows_per_cap()};
  void* rest = workspace == nullptr ? nullptr : static_cast<unsigned char*>(workspace) + split_bytes;
  return LaunchGradFrom(src, u, W, grad_u, grad_W, rest, workspace_bytes - std::min(split_bytes, workspace_bytes),
                        d, stream, algo);
}

#define CAPSNET_INSTANTIATE_ROUTING(T)                                                   \
  template std::size_t CapsuleRoutingWorkspaceBytes<T>(const CapsuleDims&, int, GpuAlgo); \
  template std::size_t CapsuleRoutingGradWorkspaceBytes<T>(const CapsuleDims&, GpuAlgo);   \
  template int LaunchCapsuleRoutingForward<T>(const T*, const T*, T*, T*, void*,          \
                                              std::size_t, const CapsuleDims&, int, bool, \
                                              GpuStream, GpuAlgo);                       \
  template int LaunchCapsuleRoutingGrad<T>(const T*, const T*, const T*, const T*, T*, T*, \
                                           void*, std::size_t, const CapsuleDims&,       \
                                           GpuStream, GpuAlgo);

CAPSNET_INSTANTIATE_ROUTING(float)
CAPSNET_INSTANTIATE_ROUTING(double)
CAPSNET_INSTANTIATE_ROUTING(half_t)
CAPSNET_INSTANTIATE_ROUTING(bfloat16_t)
#undef CAPSNET_INSTANTIATE_ROUTING

}  // namespace capsnet
