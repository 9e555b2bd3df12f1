// The fused routing on tensor cores, for 16-bit u and W (half, bfloat16) and
// for float32 at in_dim 8, out_dim 16 and up to 10 output capsules (the paper's
// DigitCaps and MultiMNIST's): one routing iteration, and the gradient further
// below.
// Included by routing.cu.cc, which plans and launches them; its CUDA-core
// kernels stay the path of every other shape and type.
//
// Why: at 25% occupancy the CUDA-core kernel waits on latency (Nsight Compute
// on an H100), and in bfloat16 its three iterations
// took 0.7 ms of a ~3.9 ms train step at batch 512, against ~0.8 ms for XLA's
// tensor-core fusions of the whole unfused routing. Both products of an
// iteration are small matrix products once the sum over k (or d) is moved:
//   agreement  a[b, i, j] = sum_d v[b, j, d] u_hat[b, i, j, d]
//                         = sum_k u[b, i, k] T[b, k],  T = v_j (16 x D) . W_ij (D x K)
//   s_j        s[b, j, :] += sum_{i, k} (c[b, i, j] u[b, i, k]) W[i, j, :, k]
//                         = (c u) (16 x 2K, two capsules) . W_j (2K x D)
// so per 16 samples, capsule pair and output capsule j they are mma.m16n8k16
// tiles: one for T per capsule, two for s_j (D = 16 is two n = 8 halves).
//
// Float32 sums: v and c u are float32 values that the mma takes as 16-bit
// operands, so each is split into hi = round16(x) and lo = round16(x - hi) and
// both are multiplied (two mmas, float32 accumulation): the error is that of
// the lo rounding, at most 2^-16 relative in bfloat16 (2^-22 in half), within
// the tolerance of the CUDA-core kernel's float32 sums (the driver's checks).
// u, W and grad_s are exact operands.
//
// Float32: the mma has no float32 operands, so W (split once per call by
// SplitKernel) and the staged grad_s enter as bfloat16 hi + lo too, and each
// product of two split operands takes three mmas (hi hi, lo hi, hi lo; lo lo
// is below 2^-16): within ~2^-15 of float32 products, against TensorFloat-32's
// 2^-11 for TensorFlow's own float32 matmuls, which is why the glue runs these
// only while TensorFloat-32 is on (GpuAlgo::kCudaCores otherwise). u stays a
// float32 register operand in the forward (the agreement's last sum over k).
//
// Layout: a block of kMmaWarps warps owns a 16-sample tile (grid.y) and a
// range of capsule pairs (grid.x), split evenly over its warps. Each warp
// stages its next pair's W (2 x J x D rows of 8 values, 16 bytes each) in
// shared memory with cp.async while it works on the current one, and reads the
// mma's B fragments with ldmatrix (transposed for T). v's A fragments (hi and
// lo) are built once per block in shared memory. The mma fragments spread each
// sample's values over a quad of lanes, and a quad holds two samples of two
// capsules: each lane routes one of those four (its logits summed over the quad
// by a reduce-scatter, its softmax, b_ij and c_ij), and shuffles hand the c_ij
// back to the quad for the s_j products. At the end the warps' s_j
// fragments are summed in warp order (deterministic) into the block's partial
// sums, which RoutingReduceKernel adds over the blocks as for the other kernel.
#ifndef CAPSNET_OPS_ROUTING_MMA_CUH_
#define CAPSNET_OPS_ROUTING_MMA_CUH_

#include "cuda_common.cuh"

namespace capsnet {
namespace {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaJMax = 10;  // output capsules at most (s_j fragments: 8 * J registers)
constexpr int kMmaDim = 16;   // out_dim
constexpr int kMmaK = 8;      // in_dim
constexpr int kMmaRows = 16;  // samples per tile (the mma's m)

// Two 16-bit values of a storage type in one 32-bit register (the lower column in
// the low half), as CUDA's paired type: rounding two floats into it and back.
template <typename T>
struct Pair16;
template <>
struct Pair16<bfloat16_t> {
  using V = __nv_bfloat162;
  static __device__ __forceinline__ V From(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 To(V v) { return __bfloat1622float2(v); }
};
template <>
struct Pair16<half_t> {
  using V = __half2;
  static __device__ __forceinline__ V From(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 To(V v) { return __half22float2(v); }
};

// What the kernels do with mma operands of a storage type: pack two floats, split
// them into hi and lo, unpack two stored values, and the mma itself.
template <typename T>
struct MmaOps {
  using P = Pair16<T>;
  using V = typename P::V;
  static __device__ __forceinline__ uint32_t Bits(V h) { return *reinterpret_cast<uint32_t*>(&h); }
  static __device__ __forceinline__ uint32_t Pack(float a, float b) { return Bits(P::From(a, b)); }
  static __device__ __forceinline__ void Split(float a, float b, uint32_t& hi, uint32_t& lo) {
    const V h = P::From(a, b);
    const float2 f = P::To(h);
    hi = Bits(h);
    lo = Bits(P::From(a - f.x, b - f.y));
  }
  static __device__ __forceinline__ float2 Unpack(uint32_t x) { return P::To(*reinterpret_cast<V*>(&x)); }
  // c (16 x 8, float) += a (16 x 16, row-major) . b (16 x 8, column-major).
  static __device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#define CAPSNET_MMA(TYPE)                                                                   \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                       \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"              \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      CAPSNET_MMA("bf16");
    } else {
      CAPSNET_MMA("f16");
    }
#undef CAPSNET_MMA
  }
};

// What the kernels need of a storage type T: the mma's operand type S, whether
// W and grad_s are split into S parts (float32), u's loads (raw, converted only
// when used, so that a load issued one pair ahead stays in flight), and the
// resident blocks per SM their launch bounds size the registers for. float32
// runs 2 forward blocks: its double W buffers (hi and lo) make 92 KB a block.
template <typename T>
struct MmaIo {
  using S = T;
  static constexpr bool kSplit = false;
  static constexpr int kBlocksPerSm = 3;      // 168 registers (4 was slower: 328 against 294 us)
  static constexpr int kGradBlocksPerSm = 4;  // 128 registers
  using URaw = uint32_t;                      // two values
  static __device__ __forceinline__ URaw Load(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }
  static __device__ __forceinline__ float2 Unraw(URaw x) { return MmaOps<T>::Unpack(x); }
  static __device__ __forceinline__ void Store(T* p, float a, float b) {
    *reinterpret_cast<uint32_t*>(p) = MmaOps<T>::Pack(a, b);
  }
};
template <>
struct MmaIo<float> {
  using S = bfloat16_t;
  static constexpr bool kSplit = true;
  static constexpr int kBlocksPerSm = 2;
  static constexpr int kGradBlocksPerSm = 3;  // W's lo fragments: 20 more registers
  using URaw = float2;
  static __device__ __forceinline__ URaw Load(const float* p) { return *reinterpret_cast<const float2*>(p); }
  static __device__ __forceinline__ float2 Unraw(URaw x) { return x; }
  static __device__ __forceinline__ void Store(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  }
};

template <typename T>
constexpr bool kHasMma = std::is_same<T, bfloat16_t>::value || std::is_same<T, half_t>::value ||
                         std::is_same<T, float>::value;

// hi = round(x), lo = round(x - hi) in S, for float32 W: the kernels' split operand.
template <typename S>
__global__ void SplitKernel(const float* __restrict__ x, S* __restrict__ hi, S* __restrict__ lo, int64 n) {
  for (const int64 i : GridStride(n)) {
    const float v = x[i];
    const S h = FromAcc<S>(v);
    hi[i] = h;
    lo[i] = FromAcc<S>(v - ToAcc(h));
  }
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices from shared memory; lanes 8m .. 8m+7 give matrix m's
// row addresses. Lane l receives, of matrix m, the elements (l / 4, 2 (l % 4) + {0, 1})
// (with .trans: (2 (l % 4) + {0, 1}, l / 4)).
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16 bytes global -> shared without registers; src_bytes 0 writes zeros.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Whether p is a multiple of n bytes: the kernels load W (16-bit) and grad_s rows in
// 16-byte pieces, and load u and store grad_u and grad_W two values at a time.
inline bool Aligned(const void* p, std::uintptr_t n) { return reinterpret_cast<std::uintptr_t>(p) % n == 0; }

// The shapes and types the tensor-core kernels take (non-empty, too).
template <typename T>
bool MmaShape(const CapsuleDims& d) {
  return kHasMma<T> && d.in_dim == kMmaK && d.out_dim == kMmaDim && d.out_caps >= 1 &&
         d.out_caps <= kMmaJMax && d.in_caps >= 1 && d.batch >= 1;
}

// The launch plan (a function of the shape only). ok = false: use the CUDA-core kernel.
struct MmaPlan {
  bool ok = false;
  int64 tiles = 0;       // 16-sample tiles (grid.y)
  int64 cap_blocks = 0;  // grid.x = partial sums of s_j per sample
  int64 cpb = 0;         // capsules per block (even)
  std::size_t smem = 0;
};

// Bytes of one capsule pair's W rows in shared memory: 2 capsules x J x D rows of
// 16 bytes, twice (hi, lo) when split.
template <typename T>
constexpr int MmaPairBytes(int J) {
  return (MmaIo<T>::kSplit ? 2 : 1) * 2 * J * kMmaDim * 16;
}

// sms: the SMs the plan fills (a constant, so the plan depends on the shape only).
template <typename T>
MmaPlan RoutingMmaPlan(const CapsuleDims& d, int64 sms) {
  MmaPlan p;
  if (!MmaShape<T>(d)) return p;
  p.tiles = CeilDiv(d.batch, kMmaRows);
  if (p.tiles > 65535) return p;
  const int64 pairs = CeilDiv(d.in_caps, 2);
  // Blocks per tile such that one wave holds them all (396 blocks on an H100: 13 per
  // tile at batch 512 would make a second wave of 20 blocks).
  const int64 target_blocks = sms * MmaIo<T>::kBlocksPerSm;
  const int64 want = std::min(pairs, std::max<int64>(1, target_blocks / p.tiles));
  p.cpb = 2 * CeilDiv(pairs, want);
  p.cap_blocks = CeilDiv(d.in_caps, p.cpb);
  const int J = static_cast<int>(d.out_caps);
  // v's fragments (J x hi/lo x 32 lanes x 16 bytes) and two W pair buffers per
  // warp, which the end reuses for the warps' s_j (16 x J x D floats each: no
  // more than the buffers).
  p.smem = static_cast<std::size_t>(J * 2 * 32 * 16 + kMmaWarps * 2 * MmaPairBytes<T>(J));
  p.ok = true;
  return p;
}

// W: W_hi = W for 16-bit T (W_lo unused), its split parts for float32.
template <typename T>
__global__ void __launch_bounds__(kMmaThreads, MmaIo<T>::kBlocksPerSm)
    RoutingIterationMmaKernel(const T* __restrict__ u, const typename MmaIo<T>::S* __restrict__ W_hi,
                              const typename MmaIo<T>::S* __restrict__ W_lo,
                              const float* __restrict__ v, float* __restrict__ b_ij,
                              T* __restrict__ c_out, float* __restrict__ partials, int64 batch,
                              int64 in_caps, int out_caps, int64 cpb, int read_b, int write_b,
                              int leaky) {
  using Io = MmaIo<T>;
  using S = typename Io::S;
  using Ops = MmaOps<S>;
  constexpr int JM = kMmaJMax;
  constexpr int D = kMmaDim;
  constexpr int K = kMmaK;
  const int J = out_caps;
  const int JD = J * D;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* vfrag = reinterpret_cast<uint4*>(smem_raw);  // [J][hi, lo][32 lanes]
  // [warp][2 buffers][hi, lo when split][2 caps][J][D][16 B]
  unsigned char* wbase = smem_raw + J * 2 * 32 * 16;
  const int lo_bytes = 2 * J * D * 16;  // offset of a buffer's lo rows
  const int pair_bytes = MmaPairBytes<T>(J);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // rows g and g + 8 of the tile
  const int t = lane & 3;   // columns 2t, 2t + 1 (+ 8)
  const int64 b0 = static_cast<int64>(blockIdx.y) * kMmaRows;
  const int64 rows[2] = {b0 + g, b0 + g + 8};
  const bool row_ok[2] = {rows[0] < batch, rows[1] < batch};

  // v_j's A fragments: A[m][d] = v[b0 + m, j, d], split into hi and lo.
  if (v != nullptr) {
    for (int x = threadIdx.x; x < J * 32; x += blockDim.x) {
      const int j = x >> 5;
      const int l = x & 31;
      const int gg = l >> 2;
      const int tt = l & 3;
      float e[2][4];  // [row g / g + 8][d = 2t, 2t + 1, 2t + 8, 2t + 9]
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int64 b = b0 + gg + 8 * rr;
        const float* vr = v + b * JD + j * D;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int dd = 2 * tt + (q & 1) + 8 * (q >> 1);
          e[rr][q] = b < batch ? vr[dd] : 0.0f;
        }
      }
      uint4 hi, lo;
      Ops::Split(e[0][0], e[0][1], hi.x, lo.x);  // (g, 2t)
      Ops::Split(e[1][0], e[1][1], hi.y, lo.y);  // (g + 8, 2t)
      Ops::Split(e[0][2], e[0][3], hi.z, lo.z);  // (g, 2t + 8)
      Ops::Split(e[1][2], e[1][3], hi.w, lo.w);  // (g + 8, 2t + 8)
      vfrag[(j * 2) * 32 + l] = hi;
      vfrag[(j * 2 + 1) * 32 + l] = lo;
    }
  }
  __syncthreads();

  // This warp's capsule pairs.
  const int64 cap_begin = static_cast<int64>(blockIdx.x) * cpb;
  const int64 block_caps = min(in_caps, cap_begin + cpb) - cap_begin;  // >= 1 by the plan
  const int64 block_pairs = (block_caps + 1) / 2;
  const int64 per_warp = (block_pairs + kMmaWarps - 1) / kMmaWarps;
  const int64 p_begin = min(block_pairs, warp * per_warp);
  const int64 p_end = min(block_pairs, p_begin + per_warp);
  unsigned char* wbuf = wbase + warp * 2 * pair_bytes;
  const uint32_t wbuf_s = SharedAddress(wbuf);

  // Stage pair p's W rows (capsules cap_begin + 2p, + 1; a missing second capsule as zeros).
  auto stage = [&](int64 p, int buf) {
    const int64 i0 = cap_begin + 2 * p;
    const int chunks_per_cap = J * D;  // 16-byte rows
    const int64 at = i0 * JD * K;
    const uint32_t dst = wbuf_s + buf * pair_bytes;
    for (int x = lane; x < 2 * chunks_per_cap; x += 32) {
      const bool ok = i0 + x / chunks_per_cap < in_caps;
      CpAsync16(dst + x * 16, ok ? W_hi + at + x * K : W_hi, ok ? 16 : 0);
      if constexpr (Io::kSplit) CpAsync16(dst + lo_bytes + x * 16, ok ? W_lo + at + x * K : W_lo, ok ? 16 : 0);
    }
    CpAsyncCommit();
  };

  float s_acc[JM][2][4];
#pragma unroll
  for (int j = 0; j < JM; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < 4; ++q) s_acc[j][h][q] = 0.0f;
    }
  }

  // u[row, capsule, 2t .. 2t + 1] of a pair, as stored (zero outside the batch
  // or the capsules); loaded one pair ahead.
  using URaw = typename Io::URaw;
  auto load_u = [&](int64 p, URaw (&raw)[2][2]) {
    const int64 i0 = cap_begin + 2 * p;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        raw[c][rr] = URaw{};
        if (i0 + c < in_caps && row_ok[rr]) raw[c][rr] = Io::Load(u + ((rows[rr] * in_caps + i0 + c) * K + 2 * t));
      }
    }
  };
  // Lane t of a quad routes one (capsule, row) of the four the quad holds:
  // capsule t >> 1, row g + 8 (t & 1).
  const int my_c = t >> 1;
  const int my_rr = t & 1;
  const int64 my_row = b0 + g + 8 * my_rr;
  const int quad = lane & ~3;
  const int m8 = lane >> 3;  // the 8x8 matrix whose row this lane addresses in an ldmatrix
  const int r8 = lane & 7;

  URaw u_next[2][2] = {};
  if (p_begin < p_end) {
    stage(p_begin, 0);
    load_u(p_begin, u_next);
  }
  for (int64 p = p_begin; p < p_end; ++p) {
    const int buf = static_cast<int>((p - p_begin) & 1);
    float uf[2][2][2];  // [capsule][row][column 2t, 2t + 1]
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const float2 f = Io::Unraw(u_next[c][rr]);
        uf[c][rr][0] = f.x;
        uf[c][rr][1] = f.y;
      }
    }
    if (p + 1 < p_end) {
      stage(p + 1, buf ^ 1);
      load_u(p + 1, u_next);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncwarp();
    const uint32_t wb = wbuf_s + buf * pair_bytes;
    const int64 i0 = cap_begin + 2 * p;
    const bool my_ok = i0 + my_c < in_caps && my_row < batch;
    const int64 my_at = (my_row * in_caps + i0 + my_c) * J;  // b_ij / c_ij row of this lane

    // This lane's logits: b_ij (+ the agreement with v_j, summed over the quad).
    float logit[JM];
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      if (j >= J) break;
      float z = 0.0f;
      if (v != nullptr) {
        // B fragments of W_ij^T for both capsules: matrices (c, d 0-7), (c, d 8-15).
        const uint32_t at = wb + ((((m8 >> 1) * J + j) * D + (m8 & 1) * 8 + r8) * 16);
        uint32_t bt[4], btl[4];
        LdMatrixX4Trans(bt, at);
        if constexpr (Io::kSplit) LdMatrixX4Trans(btl, at + lo_bytes);
        const uint4 vh = vfrag[(j * 2) * 32 + lane];
        const uint4 vl = vfrag[(j * 2 + 1) * 32 + lane];
        const uint32_t ah[4] = {vh.x, vh.y, vh.z, vh.w};
        const uint32_t al[4] = {vl.x, vl.y, vl.z, vl.w};
        float x[4];  // this lane's share of the agreement of (capsule q >> 1, row q & 1)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float tk[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // T[g][2t..], T[g + 8][2t..]
          Ops::Mma(tk, ah, bt[2 * c], bt[2 * c + 1]);
          Ops::Mma(tk, al, bt[2 * c], bt[2 * c + 1]);
          if constexpr (Io::kSplit) Ops::Mma(tk, ah, btl[2 * c], btl[2 * c + 1]);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            x[2 * c + rr] = fmaf(tk[2 * rr], uf[c][rr][0], tk[2 * rr + 1] * uf[c][rr][1]);
          }
        }
        // Reduce-scatter over the quad: lane t ends with the sum of entry t.
        const bool t0 = t & 1;
        const float keep0 = t0 ? x[1] : x[0], send0 = t0 ? x[0] : x[1];
        const float keep1 = t0 ? x[3] : x[2], send1 = t0 ? x[2] : x[3];
        const float y0 = keep0 + __shfl_xor_sync(0xffffffffu, send0, 1);  // entry t0
        const float y1 = keep1 + __shfl_xor_sync(0xffffffffu, send1, 1);  // entry 2 + t0
        const bool t1 = t & 2;
        z = (t1 ? y1 : y0) + __shfl_xor_sync(0xffffffffu, t1 ? y0 : y1, 2);
      }
      logit[j] = (read_b && my_ok ? b_ij[my_at + j] : 0.0f) + z;
    }
    // c_ij = softmax_j of this lane's logits; leaky: over [0, logits], the zero
    // logit in the max and first in the sum, its share dropped.
    float m = leaky ? max(0.0f, logit[0]) : logit[0];
#pragma unroll
    for (int j = 1; j < JM; ++j) {
      if (j < J) m = max(m, logit[j]);
    }
    float sum = leaky ? __expf(-m) : 0.0f;
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      if (j < J) {
        if (write_b && my_ok) b_ij[my_at + j] = logit[j];
        logit[j] = __expf(logit[j] - m);
        sum += logit[j];
      }
    }
    const float inv = 1.0f / sum;
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      if (j < J) {
        logit[j] *= inv;  // now c_ij
        if (c_out != nullptr && my_ok) c_out[my_at + j] = FromAcc<T>(logit[j]);
      }
    }

    // s_j += (c u)(16 x 2K) . W_j(2K x D), D in two halves.
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      if (j >= J) break;
      // B fragments: matrices (capsule 0, d 0-7), (capsule 1, d 0-7), (0, d 8-15), (1, d 8-15).
      const uint32_t at = wb + ((((m8 & 1) * J + j) * D + (m8 >> 1) * 8 + r8) * 16);
      uint32_t bw[4], bwl[4];
      LdMatrixX4(bw, at);
      if constexpr (Io::kSplit) LdMatrixX4(bwl, at + lo_bytes);
      uint32_t ah[4], al[4];
      // A[m][c * 8 + k] = c_ij[row m, capsule c, j] u[row m, capsule c, k]; c_ij of
      // (capsule c, row rr) is held by quad lane 2c + rr.
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float cv = __shfl_sync(0xffffffffu, logit[j], quad | (2 * c + rr));
          Ops::Split(cv * uf[c][rr][0], cv * uf[c][rr][1], ah[2 * c + rr], al[2 * c + rr]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        Ops::Mma(s_acc[j][h], ah, bw[2 * h], bw[2 * h + 1]);
        Ops::Mma(s_acc[j][h], al, bw[2 * h], bw[2 * h + 1]);
        if constexpr (Io::kSplit) Ops::Mma(s_acc[j][h], ah, bwl[2 * h], bwl[2 * h + 1]);
      }
    }
    __syncwarp();  // every lane is done with this buffer before it is staged again
  }

  // The block's partial s_j: the warps' fragments summed in warp order.
  __syncthreads();  // all warps are done with their W buffers, reused here
  float* red = reinterpret_cast<float*>(wbase);  // [warp][16 rows][J * D]
  float* mine = red + warp * kMmaRows * JD;
#pragma unroll
  for (int j = 0; j < JM; ++j) {
    if (j >= J) break;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = j * D + h * 8 + 2 * t;
      mine[g * JD + col] = s_acc[j][h][0];
      mine[g * JD + col + 1] = s_acc[j][h][1];
      mine[(g + 8) * JD + col] = s_acc[j][h][2];
      mine[(g + 8) * JD + col + 1] = s_acc[j][h][3];
    }
  }
  __syncthreads();
  const int nb = static_cast<int>(min(static_cast<int64>(kMmaRows), batch - b0));
  float* dst = partials + (static_cast<int64>(blockIdx.x) * batch + b0) * JD;
  for (int x = threadIdx.x; x < nb * JD; x += blockDim.x) {
    float s = red[x];
#pragma unroll
    for (int w = 1; w < kMmaWarps; ++w) s += red[w * kMmaRows * JD + x];
    dst[x] = s;
  }
}


// ---------------------------------------------------------------------------
// The gradient on tensor cores (stop-gradient routing: grad_u_hat = c_ij g_j,
// g = dL/ds_j), at the same shapes. Per 16-sample tile and capsule i:
//   grad_u[b, i, :] = sum_j c[b, i, j] (g_j (16 x D) . W_ij (D x K))
//   grad_W[i, j]   += g_j^T (D x 16) . (c_ij u_i) (16 x K), summed over the tiles
// One warp owns one capsule for the whole batch (W_ij's fragments stay in
// registers, grad_W's sums too: no partials, no atomics); the block's warps
// share each tile's g in shared memory. g, u and W are exact 16-bit operands;
// c u is split into hi and lo as in the forward. In float32, W and g are split
// too: three mmas per product, as in the forward.

struct MmaGradPlan {
  bool ok = false;
  int64 blocks = 0;
  std::size_t smem = 0;
  int g_stride = 0;  // bytes per sample row of the staged g (padded: ldmatrix without bank conflicts)
};

template <typename T>
MmaGradPlan RoutingMmaGradPlan(const CapsuleDims& d) {
  MmaGradPlan p;
  if (!MmaShape<T>(d)) return p;
  const int64 JD = d.out_caps * kMmaDim;
  p.g_stride = static_cast<int>(JD * 2 + 16);
  p.blocks = CeilDiv(d.in_caps, kMmaWarps);
  if (p.blocks > 0x7fffffff) return p;
  // g tile (hi and lo when split), then per warp: W_i (J x D rows of 16 bytes; its
  // lo part follows the hi part through the same space), c (16 x J floats), u (16 x K floats).
  p.smem = static_cast<std::size_t>((MmaIo<T>::kSplit ? 2 : 1) * kMmaRows * p.g_stride +
                                    kMmaWarps * (JD * 16 + kMmaRows * d.out_caps * 4 + kMmaRows * kMmaK * 4));
  p.ok = true;
  return p;
}

__device__ __forceinline__ void LdMatrixX2Trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// W: as for the forward kernel.
template <typename T>
__global__ void __launch_bounds__(kMmaThreads, MmaIo<T>::kGradBlocksPerSm)
    RoutingGradMmaKernel(const T* __restrict__ c_ij, const T* __restrict__ grad_s,
                         const T* __restrict__ u, const typename MmaIo<T>::S* __restrict__ W_hi,
                         const typename MmaIo<T>::S* __restrict__ W_lo, T* __restrict__ grad_u,
                         T* __restrict__ grad_W, int64 batch, int64 in_caps, int out_caps,
                         int g_stride) {
  using Io = MmaIo<T>;
  using S = typename Io::S;
  using Ops = MmaOps<S>;
  constexpr int JM = kMmaJMax;
  constexpr int D = kMmaDim;
  constexpr int K = kMmaK;
  constexpr int kParts = Io::kSplit ? 2 : 1;
  const int J = out_caps;
  const int JD = J * D;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* g_s = smem_raw;  // [hi, lo when split][16 samples][g_stride bytes]
  const int g_lo = kMmaRows * g_stride;  // offset of the lo tile
  const int warp_bytes = JD * 16 + kMmaRows * J * 4 + kMmaRows * K * 4;
  unsigned char* wsm = smem_raw + kParts * kMmaRows * g_stride + warp_bytes * (threadIdx.x >> 5);
  float* c_s = reinterpret_cast<float*>(wsm + JD * 16);  // [16][J]
  float* u_s = c_s + kMmaRows * J;                         // [16][K]

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int64 i = static_cast<int64>(blockIdx.x) * kMmaWarps + warp;
  const bool cap_ok = i < in_caps;

  // W_ij^T's B fragments for every j (the agreement's, transposed load), kept
  // (part 1: W's lo part, when split).
  uint32_t wf[kParts][JM][2];
  const uint32_t wsm_s = SharedAddress(wsm);
#pragma unroll
  for (int part = 0; part < kParts; ++part) {
    __syncwarp();  // the previous part's fragments are read
    if (cap_ok) {
      const S* wi = (part == 0 ? W_hi : W_lo) + i * JD * K;
      for (int x = lane; x < JD; x += 32) {
        *reinterpret_cast<uint4*>(wsm + x * 16) = *reinterpret_cast<const uint4*>(wi + x * K);
      }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      wf[part][j][0] = wf[part][j][1] = 0;
      // Lanes 0-15 address rows d = lane of W_ij (matrices d 0-7, 8-15).
      if (j < J && cap_ok) LdMatrixX2Trans(wf[part][j], wsm_s + ((j * D + (lane & 15)) * 16));
    }
  }

  float gw[JM][4];  // grad_W[i, j, g (+8), 2t .. 2t + 1]
#pragma unroll
  for (int j = 0; j < JM; ++j) {
#pragma unroll
    for (int q = 0; q < 4; ++q) gw[j][q] = 0.0f;
  }
  const uint32_t g_s_addr = SharedAddress(g_s);
  const int m8 = lane >> 3;  // which 8x8 block this lane addresses
  const int r8 = lane & 7;

  for (int64 b0 = 0; b0 < batch; b0 += kMmaRows) {
    __syncthreads();  // the previous tile's g is read by all warps
    // g tile: 16 rows of JD values (pieces of 8), zero past the batch.
    const int pieces = JD / 8;
    for (int x = threadIdx.x; x < kMmaRows * pieces; x += blockDim.x) {
      const int r = x / pieces;
      const int q = x - r * pieces;
      unsigned char* dst = g_s + r * g_stride + q * 16;
      const bool ok = b0 + r < batch;
      if constexpr (Io::kSplit) {
        const float4* src = reinterpret_cast<const float4*>(grad_s + (b0 + r) * JD + q * 8);
        const float4 e0 = ok ? src[0] : make_float4(0, 0, 0, 0);
        const float4 e1 = ok ? src[1] : make_float4(0, 0, 0, 0);
        uint4 hi, lo;
        Ops::Split(e0.x, e0.y, hi.x, lo.x);
        Ops::Split(e0.z, e0.w, hi.y, lo.y);
        Ops::Split(e1.x, e1.y, hi.z, lo.z);
        Ops::Split(e1.z, e1.w, hi.w, lo.w);
        *reinterpret_cast<uint4*>(dst) = hi;
        *reinterpret_cast<uint4*>(dst + g_lo) = lo;
      } else {
        uint4 val = make_uint4(0, 0, 0, 0);
        if (ok) val = *reinterpret_cast<const uint4*>(grad_s + (b0 + r) * JD + q * 8);
        *reinterpret_cast<uint4*>(dst) = val;
      }
    }
    // This warp's c[b, i, :] and u[b, i, :] as floats.
    for (int x = lane; x < kMmaRows * J; x += 32) {
      const int r = x / J;
      const int j = x - r * J;
      c_s[x] = cap_ok && b0 + r < batch ? ToAcc(c_ij[((b0 + r) * in_caps + i) * J + j]) : 0.0f;
    }
    for (int x = lane; x < kMmaRows * K; x += 32) {
      const int r = x / K;
      const int k = x - r * K;
      u_s[x] = cap_ok && b0 + r < batch ? ToAcc(u[((b0 + r) * in_caps + i) * K + k]) : 0.0f;
    }
    __syncthreads();
    if (!cap_ok) continue;

    float gu[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // grad_u[row g (+8), i, 2t .. 2t + 1]
#pragma unroll
    for (int j = 0; j < JM; ++j) {
      if (j >= J) break;
      // The tile's four 8x8 blocks of g_j: lane group m8 addresses block
      // (samples 8 (m8 & 1) .., d 8 (m8 >> 1) ..) for the A of grad_u, and
      // (samples 8 (m8 >> 1) .., d 8 (m8 & 1) ..) transposed for the A of grad_W.
      const uint32_t a_at = g_s_addr + (8 * (m8 & 1) + r8) * g_stride + (j * D + 8 * (m8 >> 1)) * 2;
      const uint32_t t_at = g_s_addr + (8 * (m8 >> 1) + r8) * g_stride + (j * D + 8 * (m8 & 1)) * 2;
      uint32_t ga[4], gt[4], gal[4], gtl[4];
      LdMatrixX4(ga, a_at);
      LdMatrixX4Trans(gt, t_at);
      if constexpr (Io::kSplit) {
        LdMatrixX4(gal, a_at + g_lo);
        LdMatrixX4Trans(gtl, t_at + g_lo);
      }
      // grad_u: T = g_j . W_ij, then c_ij T summed over j.
      float tk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      Ops::Mma(tk, ga, wf[0][j][0], wf[0][j][1]);
      if constexpr (Io::kSplit) {
        Ops::Mma(tk, gal, wf[0][j][0], wf[0][j][1]);
        Ops::Mma(tk, ga, wf[1][j][0], wf[1][j][1]);
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const float cv = c_s[(g + 8 * rr) * J + j];
        gu[rr][0] = fmaf(cv, tk[2 * rr], gu[rr][0]);
        gu[rr][1] = fmaf(cv, tk[2 * rr + 1], gu[rr][1]);
      }
      // grad_W: B[b][k] = c[b, i, j] u[b, i, k] at b = 2t, 2t + 1 (+ 8), k = g.
      uint32_t bh[2], bl[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r0 = 2 * t + 8 * h;
        Ops::Split(c_s[r0 * J + j] * u_s[r0 * K + g], c_s[(r0 + 1) * J + j] * u_s[(r0 + 1) * K + g],
                   bh[h], bl[h]);
      }
      Ops::Mma(gw[j], gt, bh[0], bh[1]);
      Ops::Mma(gw[j], gt, bl[0], bl[1]);
      if constexpr (Io::kSplit) Ops::Mma(gw[j], gtl, bh[0], bh[1]);
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int64 b = b0 + g + 8 * rr;
      if (b < batch) Io::Store(grad_u + (b * in_caps + i) * K + 2 * t, gu[rr][0], gu[rr][1]);
    }
  }
  if (!cap_ok) return;
#pragma unroll
  for (int j = 0; j < JM; ++j) {
    if (j >= J) break;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      Io::Store(grad_W + ((i * J + j) * D + g + 8 * rr) * K + 2 * t, gw[j][2 * rr], gw[j][2 * rr + 1]);
    }
  }
}

}  // namespace
}  // namespace capsnet

#endif  // CAPSNET_OPS_ROUTING_MMA_CUH_
