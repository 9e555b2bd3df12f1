// CUDA kernels and launchers of the capsule prediction op (see capsule_prediction.h
// for the math and the row view r = j * out_dim + d used throughout).
//
// Free of TensorFlow: built by scripts/build_ops.py into the op library and, with
// ops/sanitize_driver.cu, into a standalone program for compute-sanitizer.
//
// Design (memory bound: u_hat is ~20x larger than u and W at the paper shape):
// - Tiled kernels: a block owns `cpb` whole input capsules (all their JD rows)
//   and a chunk of the batch. Each thread owns VEC consecutive rows of one
//   capsule, keeps W[rows, :] in registers for the whole batch chunk, and per
//   batch row moves one VEC-wide vector of u_hat / grad: a warp touches 32
//   consecutive vectors (512 bytes for float4), so global traffic is fully
//   coalesced and every u_hat / grad byte crosses HBM once. u[b, capsule, :]
//   (shared by all JD/VEC threads of a capsule) is staged in shared memory,
//   zero-padded to KMAX so the inner loops need no bounds checks.
// - Backward is one kernel: per batch row a thread reads its grad vector once
//   and (a) accumulates grad_W for its rows in registers over the batch,
//   (b) writes its share of grad_u[b, i, :] to shared memory, which the block
//   then sums over the capsule's threads in a fixed order. A block owns its
//   capsules, so grad_W needs no atomics; when the shape has too few capsule
//   tiles to fill the GPU the batch is split into chunks whose grad_W partials
//   a second kernel sums in chunk order. The chunking depends on the shape only,
//   so results are bitwise reproducible (also across GPU models).
// - Generic kernels (one thread per output element) cover in_dim > 16 and
//   capsules with more vectors than a tiled block may have threads (256 or 512,
//   i.e. out_caps * out_dim beyond 1024-2048 for float).
//
// Measured on an H200 (standalone driver, CUDA events, copy 4.25 TB/s), float:
//   paper (128, 1152 -> 10 x 16, in_dim 8): forward 27 us = 1.10x the
//   bandwidth floor; backward 81 us = 2.96x. batch 512: 120 / 242 us (1.27x /
//   2.40x). 4608 -> 32 x 16: 368 / 718 us (1.20x / 2.18x). The naive
//   one-thread-per-output kernels (kGeneric) take 220 / 360 us at the paper
//   shape. The backward is bound by instruction issue, not HBM (ncu: IPC 1.85,
//   ~11 warps per SM because the paper shape has only 46k row vectors): it
//   does 2 * VEC * KMAX FMAs per grad vector plus the shared-memory reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>

#include "capsule_prediction.h"

namespace capsnet {
namespace {

// Accumulation type: 16-bit types accumulate in float.
template <typename T>
struct AccOf {
  using type = T;
};
template <>
struct AccOf<half_t> {
  using type = float;
};
template <>
struct AccOf<bfloat16_t> {
  using type = float;
};
template <typename T>
using Acc = typename AccOf<T>::type;

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

// ---------------------------------------------------------------------------
// Launch plan: depends on the shape (and sizeof(T)) only.

// Threads per tiled block: a thread keeps VEC * KMAX values of W (and, in the
// backward, as many grad_W sums) in registers, so big tiles get 256 threads
// (up to 255 registers each) and small ones 512 (up to 128).
constexpr int MaxThreadsFor(int vec, int kmax, int acc_bytes) {
  return vec * kmax * acc_bytes >= 256 ? 256 : 512;
}
// Shared memory of one block; stays under the 48 KiB available without opt-in.
constexpr int kForwardSmemBudget = 32 * 1024;
constexpr int kGradSmemBudget = 46 * 1024;
// Preferred threads per block. Measured on an H200 at the paper shape
// (u_hat 94 MB): 64-128-thread blocks (3 capsules, 120 threads) beat 128-256
// (4 capsules) by 10% forward and 15% backward; more, smaller blocks hide the
// per-block start (W and u loads) better.
constexpr int kBlockThreadsLo = 64;
constexpr int kBlockThreadsHi = 128;
// Forward: split the batch only while there are fewer capsule tiles than this.
// A batch split reloads W per block, and at the paper shape 1 chunk (384
// blocks) took 27 us against 32 us for 4 chunks (H200).
constexpr int64 kForwardTargetBlocks = 288;
// Backward: split the batch (paying a partials round trip through global
// memory and a reduction kernel) only below this many capsule tiles; a
// 2-way split of the paper shape was 25% slower than none.
constexpr int64 kGradMinTiles = 256;
constexpr int64 kGradMinChunk = 16;
// Batch rows per stage; the backward holds a stage's grad vectors in registers
// (kStage loads in flight per thread hide the HBM latency).
constexpr int kStage = 8;
// u elements per thread prefetched in registers; a tile needing more loads the
// rest synchronously (only shapes with tiny JD).
constexpr int kUPrefetch = 2;

constexpr int kGenericThreads = 256;
constexpr int64 kGenericMaxBlocks = 8192;

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

int64 CeilDiv(int64 a, int64 b) { return (a + b - 1) / b; }

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

// ---------------------------------------------------------------------------
// Where the gradient kernels read grad_u_hat[b, i, j, d] (row r = j * out_dim + d
// of capsule i) from. GradFromMemory: a u_hat-sized tensor (the prediction op's
// gradient). GradFromCoupling: c_ij[b, i, j] * grad_s[b, j, d], formed on the fly
// (the fused routing op's gradient, stop-gradient routing), which reads c_ij
// (1 / out_dim of grad_u_hat) and grad_s (tiny) instead.
//
// The tiled kernel prefetches a stage of Raw values per thread (all loads in
// flight before the first use), then converts them to the accumulation type:
//   ForThread<VEC>(rloc)       per-thread constants for rows rloc .. rloc+VEC-1
//   Load<VEC>(th, b, i, row)   issue the loads of rows `row` (global row index)
//   Convert<VEC>(raw, out)     the VEC values as Acc<T>
// and the generic kernels read single elements with At(b, row).

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

template <typename T, int VEC, int KMAX>
__global__ void __launch_bounds__(MaxThreadsFor(VEC, KMAX, sizeof(Acc<T>)))
    ForwardTiledKernel(const T* __restrict__ u, const T* __restrict__ W,
                       T* __restrict__ u_hat, int64 batch, int64 in_caps,
                       int in_dim, int jd, int cpb, int64 b_chunk) {
  using A = Acc<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* su = reinterpret_cast<A*>(smem_raw);  // 2 stages, double-buffered

  const int qpc = jd / VEC;
  const int cap = threadIdx.x / qpc;  // this thread's capsule in the tile
  const int q = threadIdx.x - cap * qpc;
  const int64 i0 = static_cast<int64>(blockIdx.x) * cpb;
  const int ncaps = static_cast<int>(min(static_cast<int64>(cpb), in_caps - i0));
  const bool active = cap < ncaps;
  const int64 rows = in_caps * jd;
  const int64 row = (i0 + cap) * jd + static_cast<int64>(q) * VEC;
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

  const int qpc = jd / VEC;
  const int cap = threadIdx.x / qpc;
  const int q = threadIdx.x - cap * qpc;
  const int64 i0 = static_cast<int64>(blockIdx.x) * cpb;
  const int ncaps = static_cast<int>(min(static_cast<int64>(cpb), in_caps - i0));
  const bool active = cap < ncaps;
  const int64 rows = in_caps * jd;
  const int64 row = (i0 + cap) * jd + static_cast<int64>(q) * VEC;
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
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < n; x += static_cast<int64>(blockDim.x) * gridDim.x) {
    Acc<T> s = Acc<T>(0);
    for (int64 c = 0; c < chunks; ++c) s += partials[c * n + x];
    grad_W[x] = FromAcc<T>(s);
  }
}

// ---------------------------------------------------------------------------
// Generic kernels: one thread per output element, grid-stride, 64-bit indices.

// One element of u_hat: sum_k W[row, k] u[k] in k order, accumulated in Acc<T>.
template <typename T>
__device__ __forceinline__ Acc<T> RowDot(const T* __restrict__ w_row, const T* __restrict__ u_row,
                                         int64 in_dim) {
  Acc<T> s = Acc<T>(0);
  for (int64 k = 0; k < in_dim; ++k) s = fma(ToAcc(w_row[k]), ToAcc(u_row[k]), s);
  return s;
}

template <typename T>
__global__ void ForwardGenericKernel(const T* __restrict__ u,
                                     const T* __restrict__ W,
                                     T* __restrict__ u_hat, int64 batch,
                                     int64 in_caps, int64 in_dim, int64 jd) {
  const int64 rows = in_caps * jd;
  const int64 total = batch * rows;
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < total; x += static_cast<int64>(blockDim.x) * gridDim.x) {
    const int64 b = x / rows;
    const int64 r = x - b * rows;
    u_hat[x] = FromAcc<T>(RowDot(W + r * in_dim, u + (b * in_caps + r / jd) * in_dim, in_dim));
  }
}

template <typename T, typename Src>
__global__ void GradUGenericKernel(const Src src, const T* __restrict__ W,
                                   T* __restrict__ grad_u, int64 batch,
                                   int64 in_caps, int64 in_dim, int64 jd) {
  const int64 total = batch * in_caps * in_dim;
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < total; x += static_cast<int64>(blockDim.x) * gridDim.x) {
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
  const int64 rows = in_caps * jd;
  const int64 total = rows * in_dim;
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < total; x += static_cast<int64>(blockDim.x) * gridDim.x) {
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

dim3 GenericGrid(int64 total) {
  return dim3(static_cast<unsigned>(
      std::clamp<int64>(CeilDiv(total, kGenericThreads), 1, kGenericMaxBlocks)));
}

// ---------------------------------------------------------------------------
// Dispatch of the (VEC, KMAX) template instances.

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

// Calls f(integral_constant VEC, integral_constant KMAX) for the (vec, kmax) instance.
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

template <typename F>
cudaError_t DispatchVecK(const Plan& p, F&& f) {
  return DispatchVecK(p.vec, p.kmax, std::forward<F>(f));
}

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
  if (algo == GpuAlgo::kAuto && p.tiled) {
    return DispatchVecK(p, [&](auto vec, auto kmax) {
      return LaunchForwardTiled<T, decltype(vec)::value, decltype(kmax)::value>(
          u, W, u_hat, d, p, stream);
    });
  }
  return Launch(ForwardGenericKernel<T>, GenericGrid(n), dim3(kGenericThreads), 0,
                stream, u, W, u_hat, d.batch, d.in_caps, d.in_dim,
                d.rows_per_cap());
}

namespace {

template <typename T>
std::size_t GradWorkspaceBytes(const CapsuleDims& d, GpuAlgo algo, int64 vec_unit) {
  if (algo != GpuAlgo::kAuto || d.u_hat_size() == 0 || d.in_dim == 0) return 0;
  const Plan p = GradPlan<T>(d, vec_unit);
  if (!p.tiled || p.chunks <= 1) return 0;
  return static_cast<std::size_t>(p.chunks * d.w_size()) * sizeof(Acc<T>);
}

}  // namespace

template <typename T>
std::size_t CapsulePredictionGradWorkspaceBytes(const CapsuleDims& d,
                                                GpuAlgo algo) {
  return GradWorkspaceBytes<T>(d, algo, GradFromMemory<T>::VecUnit(d));
}

template <typename T>
std::size_t CapsuleRoutingGradWorkspaceBytes(const CapsuleDims& d, GpuAlgo algo) {
  return GradWorkspaceBytes<T>(d, algo, GradFromCoupling<T>::VecUnit(d));
}

namespace {

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
  if (algo == GpuAlgo::kAuto && p.tiled) {
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

template <typename T>
int LaunchCapsulePredictionGrad(const T* grad, const T* u, const T* W,
                                T* grad_u, T* grad_W, void* workspace,
                                std::size_t workspace_bytes,
                                const CapsuleDims& d, GpuStream stream,
                                GpuAlgo algo) {
  return LaunchGradFrom(GradFromMemory<T>{grad, d.rows()}, u, W, grad_u, grad_W, workspace,
                        workspace_bytes, d, stream, algo);
}

namespace {

// ============================================================================
// Fused dynamic routing (math in capsule_prediction.h).
//
// Why fused: routing is memory bound in TensorFlow (u_hat, 737 KB per image, is
// read ~7 times in 3 iterations and products of its size are written), while
// recomputing u_hat = W u costs in_dim FMAs per element, far below what an H100/
// H200 does per byte of HBM. So no u_hat ever goes to memory: every iteration
// recomputes it from u and W in registers.
//
// One iteration t = one RoutingIterationKernel + one RoutingReduceKernel.
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
//       softmax_j; the last iteration writes c_ij out;
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

__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }

// Samples per thread per stage: the size of the register arrays of v_j and s_j
// rows (2 * kRouteSamples * vec values).
constexpr int kRouteSamples = 8;
// Threads per block at most (launch bounds: up to 255 registers per thread).
constexpr int kRouteMaxThreads = 256;
// Capsules staged in shared memory per sub-chunk at most, and the budget (no
// opt-in above 48 KiB needed).
constexpr int kRouteMaxCaps = 8;
constexpr int64 kRouteSmemBudget = 46 * 1024;
// Blocks the plan aims for: about 2 resident blocks on each of an H100/H200's
// 132 SMs. Fixed, not queried: the plan (and so the summation order) must depend
// on the shape only. More blocks mean more partial sums to write and reduce.
constexpr int64 kRouteTargetBlocks = 264;
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
  const int64 want = std::min(subs_total, std::max<int64>(1, CeilDiv(kRouteTargetBlocks, p.batch_blocks)));
  p.subs = CeilDiv(subs_total, want);
  p.cap_blocks = CeilDiv(subs_total, p.subs);  // every block has >= 1 capsule
  return p;
}

// The workspace: b_ij (r >= 3), c_ij (generic kernels), the partial sums of s_j,
// v_j (r >= 2), each in Acc<T> and 256-byte aligned. With base == nullptr only
// `bytes` is meaningful.
template <typename T>
struct RouteWorkspace {
  Acc<T>* b_ij = nullptr;
  Acc<T>* c_ij = nullptr;
  Acc<T>* partials = nullptr;
  Acc<T>* v_j = nullptr;
  std::size_t bytes = 0;
};

bool RoutingIsEmpty(const CapsuleDims& d) { return d.u_hat_size() == 0 || d.in_dim == 0; }

template <typename T>
RouteWorkspace<T> RouteLayout(const CapsuleDims& d, int iterations, bool tiled, int64 chunks,
                              void* base) {
  RouteWorkspace<T> w;
  if (RoutingIsEmpty(d)) return w;
  auto carve = [&](int64 count) -> Acc<T>* {
    if (count <= 0) return nullptr;
    const std::size_t offset = w.bytes;
    w.bytes += (static_cast<std::size_t>(count) * sizeof(Acc<T>) + 255) / 256 * 256;
    return base == nullptr ? nullptr
                           : reinterpret_cast<Acc<T>*>(static_cast<unsigned char*>(base) + offset);
  };
  const int64 bij = d.batch * d.in_caps * d.out_caps;
  const int64 sj = d.batch * d.rows_per_cap();
  w.b_ij = carve(iterations >= 3 ? bij : 0);
  w.c_ij = carve(tiled ? 0 : bij);
  w.partials = carve(chunks * sj);
  w.v_j = carve(iterations >= 2 ? sj : 0);
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
// stored (t >= 1 and not last); c_out != nullptr at the last iteration.
template <typename T, int VEC, int KMAX>
__global__ void __launch_bounds__(kRouteMaxThreads)
    RoutingIterationKernel(const T* __restrict__ u, const T* __restrict__ W,
                           const Acc<T>* __restrict__ v, Acc<T>* __restrict__ b_ij,
                           T* __restrict__ c_out, Acc<T>* __restrict__ partials,
                           int64 batch, int64 in_caps, int in_dim, int out_caps,
                           int out_dim, int ic, int64 subs, int stage, int agr_stride,
                           int read_b, int write_b) {
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
      // c_ij replaces the row's first out_caps entries in place.
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
          m = j == 0 ? logit : max(m, logit);
        }
        A sum = A(0);
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
// Logits b_ij (+ agreement with v_j) and c_ij = softmax_j, one thread per (b, i).
template <typename T>
__global__ void RoutingSoftmaxGenericKernel(const T* __restrict__ u, const T* __restrict__ W,
                                            const Acc<T>* __restrict__ v,
                                            Acc<T>* __restrict__ b_ij, Acc<T>* __restrict__ c,
                                            T* __restrict__ c_out, int64 batch, int64 in_caps,
                                            int64 out_caps, int64 out_dim, int64 in_dim,
                                            int read_b, int write_b) {
  using A = Acc<T>;
  const int64 jd = out_caps * out_dim;
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < batch * in_caps; x += static_cast<int64>(blockDim.x) * gridDim.x) {
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
      m = j == 0 ? logit : max(m, logit);
    }
    A sum = A(0);
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
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < batch * jd; x += static_cast<int64>(blockDim.x) * gridDim.x) {
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
  for (int64 x = static_cast<int64>(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += static_cast<int64>(blockDim.x) * gridDim.x) {
    p[x] = FromAcc<T>(value);
  }
}

template <typename T, int VEC, int KMAX>
cudaError_t LaunchRoutingIteration(const T* u, const T* W, const Acc<T>* v, Acc<T>* b_ij,
                                   T* c_out, Acc<T>* partials, const CapsuleDims& d,
                                   const RoutePlan& p, bool read_b, bool write_b,
                                   cudaStream_t stream) {
  if constexpr (VEC > MaxVec<T>()) {
    return cudaErrorInvalidValue;  // never planned
  } else {
    return Launch(RoutingIterationKernel<T, VEC, KMAX>,
                  dim3(static_cast<unsigned>(p.cap_blocks), static_cast<unsigned>(p.batch_blocks)),
                  dim3(p.groups * p.qpc), p.smem, stream, u, W, v, b_ij, c_out, partials,
                  d.batch, d.in_caps, static_cast<int>(d.in_dim), static_cast<int>(d.out_caps),
                  static_cast<int>(d.out_dim), p.ic, p.subs, p.stage, p.agr_stride,
                  read_b ? 1 : 0, write_b ? 1 : 0);
  }
}

}  // namespace

template <typename T>
std::size_t CapsuleRoutingWorkspaceBytes(const CapsuleDims& d, int iterations, GpuAlgo algo) {
  const RoutePlan p = RoutingPlan<T>(d);
  const bool tiled = algo == GpuAlgo::kAuto && p.tiled;
  return RouteLayout<T>(d, iterations, tiled, tiled ? p.cap_blocks : 1, nullptr).bytes;
}

template <typename T>
int LaunchCapsuleRoutingForward(const T* u, const T* W, T* s_j, T* c_ij, void* workspace,
                                std::size_t workspace_bytes, const CapsuleDims& d,
                                int iterations, GpuStream stream, GpuAlgo algo) {
  using A = Acc<T>;
  if (iterations < 1) return cudaErrorInvalidValue;
  if (RoutingIsEmpty(d)) {
    // u_hat empty or zero: s_j = 0 and c_ij = softmax(0) = 1 / out_caps.
    const int64 s_size = d.batch * d.rows_per_cap();
    const int64 c_size = d.batch * d.in_caps * d.out_caps;
    cudaError_t err = cudaSuccess;
    if (s_size > 0) err = cudaMemsetAsync(s_j, 0, s_size * sizeof(T), stream);
    if (err == cudaSuccess && c_size > 0) {
      err = Launch(FillKernel<T>, GenericGrid(c_size), dim3(kGenericThreads), 0, stream, c_ij,
                   c_size, A(1) / static_cast<A>(d.out_caps));
    }
    return err;
  }
  const RoutePlan p = RoutingPlan<T>(d);
  const bool tiled = algo == GpuAlgo::kAuto && p.tiled;
  const int64 chunks = tiled ? p.cap_blocks : 1;
  const RouteWorkspace<T> ws = RouteLayout<T>(d, iterations, tiled, chunks, workspace);
  if (workspace == nullptr || workspace_bytes < ws.bytes) return cudaErrorInvalidValue;
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
    cudaError_t err;
    if (tiled) {
      err = DispatchVecK(p.vec, p.kmax, [&](auto vec, auto kmax) {
        return LaunchRoutingIteration<T, decltype(vec)::value, decltype(kmax)::value>(
            u, W, v, ws.b_ij, c_out, ws.partials, d, p, read_b, write_b, stream);
      });
    } else {
      err = Launch(RoutingSoftmaxGenericKernel<T>, GenericGrid(d.batch * d.in_caps),
                   dim3(kGenericThreads), 0, stream, u, W, v, ws.b_ij, ws.c_ij, c_out, d.batch,
                   d.in_caps, d.out_caps, d.out_dim, d.in_dim, read_b ? 1 : 0, write_b ? 1 : 0);
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

template <typename T>
int LaunchCapsuleRoutingGrad(const T* c_ij, const T* grad_s, const T* u, const T* W,
                             T* grad_u, T* grad_W, void* workspace,
                             std::size_t workspace_bytes, const CapsuleDims& d,
                             GpuStream stream, GpuAlgo algo) {
  const GradFromCoupling<T> src{c_ij, grad_s, d.in_caps, d.out_caps, d.out_dim, d.rows_per_cap()};
  return LaunchGradFrom(src, u, W, grad_u, grad_W, workspace, workspace_bytes, d, stream, algo);
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

#define CAPSNET_INSTANTIATE_ROUTING(T)                                                   \
  template std::size_t CapsuleRoutingWorkspaceBytes<T>(const CapsuleDims&, int, GpuAlgo); \
  template std::size_t CapsuleRoutingGradWorkspaceBytes<T>(const CapsuleDims&, GpuAlgo);   \
  template int LaunchCapsuleRoutingForward<T>(const T*, const T*, T*, T*, void*,          \
                                              std::size_t, const CapsuleDims&, int,      \
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
