// The tile geometry of the capsule-prediction kernels (see capsnet_kernels.h
// for the row view r = j * out_dim + d): the launch plan both tiled kernels
// start from, the shared-memory staging of u and the register load of W rows.
// Shared by the tiled forward (prediction.cu.cc) and the tiled gradient
// (prediction_grad.cuh, which the fused routing gradient also runs).
//
// A block owns `cpb` whole input capsules (all their JD rows) and a chunk of
// the batch. Each thread owns VEC consecutive rows of one capsule, keeps
// W[rows, :] in registers for the whole batch chunk, and per batch row moves
// one VEC-wide vector of u_hat / grad: a warp touches 32 consecutive vectors
// (512 bytes for float4), so global traffic is fully coalesced and every
// u_hat / grad byte crosses HBM once. u[b, capsule, :] (shared by all JD/VEC
// threads of a capsule) is staged in shared memory, zero-padded to KMAX so the
// inner loops need no bounds checks.
#ifndef CAPSNET_OPS_TILING_CUH_
#define CAPSNET_OPS_TILING_CUH_

#include "cuda_common.cuh"

namespace capsnet {
namespace {

// Launch plan: depends on the shape (and sizeof(T)) only, so the summation
// order, and with it every result bit, does too.

// Threads per tiled block: a thread keeps VEC * KMAX values of W (and, in the
// backward, as many grad_W sums) in registers, so big tiles get 256 threads
// (up to 255 registers each) and small ones 512 (up to 128).
constexpr int MaxThreadsFor(int vec, int kmax, int acc_bytes) {
  return vec * kmax * acc_bytes >= 256 ? 256 : 512;
}
// Shared memory of one block; stays under the 48 KiB available without opt-in.
constexpr int kForwardSmemBudget = 32 * 1024;
// Preferred threads per block. Measured on an H200 at the paper shape
// (u_hat 94 MB): 64-128-thread blocks (3 capsules, 120 threads) beat 128-256
// (4 capsules) by 10% forward and 15% backward; more, smaller blocks hide the
// per-block start (W and u loads) better.
constexpr int kBlockThreadsLo = 64;
constexpr int kBlockThreadsHi = 128;
// Batch rows per stage; the backward holds a stage's grad vectors in registers
// (kStage loads in flight per thread hide the HBM latency).
constexpr int kStage = 8;
// u elements per thread prefetched in registers; a tile needing more loads the
// rest synchronously (only shapes with tiny JD).
constexpr int kUPrefetch = 2;

struct Plan {
  bool tiled = false;
  int vec = 1;    // rows per thread
  int kmax = 4;   // in_dim padded up to 4, 8 or 16
  int qpc = 1;    // threads per capsule = JD / vec
  int cpb = 1;    // capsules per block
  int threads = 1;
  int64 tiles = 0;     // blocks along in_caps
  int64 b_chunk = 0;   // batch rows per block
  int64 chunks = 1;    // blocks along the batch
  int red_b = 1;       // backward: batch rows per grad_u reduction
  int red_stride = 1;  // padded row of the grad_u reduction buffer
  std::size_t smem = 0;
};

// The tile geometry shared by forward and backward; plan.tiled = false if the
// shape needs the generic kernels. The vector width divides `vec_unit`: the
// capsule's rows JD by default; out_dim for the routing gradient, whose threads
// then never straddle two output capsules (one c_ij per sample).
template <typename T>
Plan TileGeometry(const CapsuleDims& d, int64 vec_unit = 0) {
  Plan p;
  const int64 jd = d.rows_per_cap();
  if (d.in_dim > 16) return p;
  if (vec_unit == 0) vec_unit = jd;
  p.kmax = d.in_dim <= 4 ? 4 : (d.in_dim <= 8 ? 8 : 16);
  p.vec = 1;
  for (int v = MaxVec<T>(); v > 1; v /= 2) {
    if (vec_unit % v == 0 && jd % v == 0) {
      p.vec = v;
      break;
    }
  }
  const int64 qpc = jd / p.vec;
  const int max_threads = MaxThreadsFor(p.vec, p.kmax, sizeof(Acc<T>));
  if (qpc > max_threads) return p;
  p.qpc = static_cast<int>(qpc);
  // Capsules per block: whole warps (no idle lanes) and 128-256 threads when
  // possible; never more capsules than exist.
  double best = 1e30;
  // The forward double-buffers kStage batch rows of the u tile in shared memory.
  const int64 smem_cap = kForwardSmemBudget / (2 * kStage * p.kmax * sizeof(Acc<T>));
  const int64 max_cpb = std::min<int64>({max_threads / qpc, smem_cap,
                                         std::max<int64>(d.in_caps, 1)});
  if (max_cpb < 1) return p;
  for (int64 t = 1; t <= max_cpb; ++t) {
    const int64 threads = t * qpc;
    const int64 padded = CeilDiv(threads, 32) * 32;
    double score = 4.0 * (padded - threads) / padded;
    if (threads < kBlockThreadsLo) score += (kBlockThreadsLo - threads) / double(kBlockThreadsLo);
    if (threads > kBlockThreadsHi) score += (threads - double(kBlockThreadsHi)) / kBlockThreadsHi;
    if (score < best) {
      best = score;
      p.cpb = static_cast<int>(t);
    }
  }
  p.threads = p.cpb * p.qpc;
  p.tiles = CeilDiv(d.in_caps, p.cpb);
  p.tiled = true;
  return p;
}

// This thread's place in a tiled block (grid.x = tiles): capsule `cap` of the
// block's first capsule i0 (`active` if the last tile has that many: ncaps),
// and its share q of the capsule's JD / VEC row vectors, which start at global
// row `row` of W and of u_hat's non-batch part (`rows` long).
struct TileThread {
  int cap;
  int q;
  int64 i0;
  int ncaps;
  bool active;
  int64 rows;
  int64 row;
};

template <int VEC>
__device__ __forceinline__ TileThread TileThreadOf(int64 in_caps, int jd, int cpb) {
  const int qpc = jd / VEC;
  const int cap = threadIdx.x / qpc;
  const int q = threadIdx.x - cap * qpc;
  const int64 i0 = static_cast<int64>(blockIdx.x) * cpb;
  const int ncaps = static_cast<int>(min(static_cast<int64>(cpb), in_caps - i0));
  return {cap, q, i0, ncaps, cap < ncaps, in_caps * jd,
          (i0 + cap) * jd + static_cast<int64>(q) * VEC};
}

// Loads W[row, 0:in_dim] (zero-padded to KMAX) as Acc. When in_dim == KMAX the
// row is 16-byte aligned (rows start at multiples of KMAX elements) and moves
// in 16-byte vectors.
template <typename T, int KMAX>
__device__ __forceinline__ void LoadRow(const T* __restrict__ p, int in_dim,
                                        bool active, Acc<T> (&out)[KMAX]) {
  constexpr int kPer16 = 16 / sizeof(T);
  if constexpr (KMAX % kPer16 == 0) {
    if (active && in_dim == KMAX) {
#pragma unroll
      for (int c = 0; c < KMAX / kPer16; ++c) {
        const Vec<T, kPer16> v = reinterpret_cast<const Vec<T, kPer16>*>(p)[c];
#pragma unroll
        for (int e = 0; e < kPer16; ++e) out[c * kPer16 + e] = ToAcc(v.v[e]);
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < KMAX; ++k) out[k] = (active && k < in_dim) ? ToAcc(p[k]) : Acc<T>(0);
}

// ---------------------------------------------------------------------------
// Tiled kernels. Grid (tiles, chunks), block plan.threads, dynamic shared
// memory plan.smem. Batch rows are processed in stages of kStage rows; the
// u rows of a stage go through shared memory.

// u[b0:b0+nb, i0:i0+cpb, :] as a stage of the shared u tile, laid out
// [kStage][cpb][KMAX] and zero-padded past in_dim, the last capsule and nb, so
// the inner loops need no bounds checks. Element x of the tile lives at
// su[x]; thread t handles x = t + m * blockDim.x.
template <typename T, int KMAX>
struct UTile {
  const T* __restrict__ u;
  int64 in_caps;
  int64 i0;
  int in_dim;
  int ncaps;
  int cpb;
  // This thread's first kUPrefetch tile elements, decoded once: batch row in
  // the stage (-1: padding) and offset from u[b0, 0, 0].
  int slot_bb[kUPrefetch];
  int64 slot_off[kUPrefetch];

  __device__ __forceinline__ UTile(const T* __restrict__ u_, int64 in_caps_, int64 i0_,
                                   int in_dim_, int ncaps_, int cpb_)
      : u(u_), in_caps(in_caps_), i0(i0_), in_dim(in_dim_), ncaps(ncaps_), cpb(cpb_) {
#pragma unroll
    for (int m = 0; m < kUPrefetch; ++m) {
      const int x = threadIdx.x + m * blockDim.x;
      int bb, c, k;
      Decode(x, &bb, &c, &k);
      const bool real = x < size() && c < ncaps && k < in_dim;
      slot_bb[m] = real ? bb : -1;
      slot_off[m] = real ? (bb * in_caps + i0 + c) * in_dim + k : 0;
    }
  }

  __device__ __forceinline__ int size() const { return kStage * cpb * KMAX; }

  __device__ __forceinline__ void Decode(int x, int* bb, int* c, int* k) const {
    const int tile = cpb * KMAX;
    *bb = x / tile;
    const int rem = x - *bb * tile;
    *c = rem / KMAX;
    *k = rem % KMAX;
  }

  __device__ __forceinline__ Acc<T> Load(int x, int64 b0, int nb) const {
    int bb, c, k;
    Decode(x, &bb, &c, &k);
    if (bb < nb && c < ncaps && k < in_dim) {
      return ToAcc(u[((b0 + bb) * in_caps + i0 + c) * in_dim + k]);
    }
    return Acc<T>(0);
  }
  // Issues this thread's first kUPrefetch loads of a stage into registers.
  __device__ __forceinline__ void Prefetch(Acc<T> (&regs)[kUPrefetch], int64 b0,
                                           int nb) const {
    const T* base = u + b0 * in_caps * in_dim;
#pragma unroll
    for (int m = 0; m < kUPrefetch; ++m) {
      regs[m] = (slot_bb[m] >= 0 && slot_bb[m] < nb) ? ToAcc(base[slot_off[m]]) : Acc<T>(0);
    }
  }
  // Writes the prefetched registers (and loads any remainder) into `su`.
  __device__ __forceinline__ void Commit(const Acc<T> (&regs)[kUPrefetch],
                                         Acc<T>* su, int64 b0, int nb) const {
#pragma unroll
    for (int m = 0; m < kUPrefetch; ++m) {
      const int x = threadIdx.x + m * blockDim.x;
      if (x < size()) su[x] = regs[m];
    }
    for (int x = threadIdx.x + kUPrefetch * blockDim.x; x < size(); x += blockDim.x) {
      su[x] = Load(x, b0, nb);
    }
  }
};

template <typename F>
cudaError_t DispatchVecK(const Plan& p, F&& f) {
  return DispatchVecK(p.vec, p.kmax, std::forward<F>(f));
}

}  // namespace
}  // namespace capsnet

#endif  // CAPSNET_OPS_TILING_CUH_
