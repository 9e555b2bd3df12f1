// CPU building blocks shared by the CPU functors of both ops (prediction.cc,
// routing.cc): the capsule mat-vec and its gradient rows, W transposition, and
// the gradient's work split into units, which the fused routing gradient runs
// with c_ij * grad_s as its grad_u_hat rows (capsnet_kernels.h has the math).
//
// Per input capsule i the op is a (JD x K) matrix W_i times K-vectors. The hot
// loops run over the JD rows of W_i transposed to (K x JD) so every inner loop
// is a contiguous, vectorizable axpy or dot over JD. They are compiled in
// several clones (cpu_kernels.cc) and picked at load time, because
// TensorFlow's flags target baseline x86-64.
//
// Deterministic: each output element is written by exactly one unit, in a
// fixed order, and the work split depends on the shape only, so results do not
// depend on the thread pool.
#ifndef CAPSNET_OPS_CPU_KERNELS_H_
#define CAPSNET_OPS_CPU_KERNELS_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <new>

#include "capsnet_kernels.h"

// AVX2+FMA and AVX-512 clones next to the baseline, dispatched at load time
// (GCC's target_clones; other compilers get the baseline only).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CAPSNET_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CAPSNET_CLONES
#endif

namespace capsnet {

// a * b and a + b for sizes: -1 when either is negative (an earlier overflow)
// or the result overflows int64, so scratch sizes are checked before the
// allocation that uses them.
inline int64 SizeMul(int64 a, int64 b) {
  int64 r;
  return (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) ? -1 : r;
}
inline int64 SizeAdd(int64 a, int64 b) {
  int64 r;
  return (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) ? -1 : r;
}

// out[r] = sum_k wt[k * jd + r] * u[k] for r < jd; k runs in order 0..K-1 as on
// the GPU. Only for the accumulation types: the callers convert 16-bit inputs
// once per row rather than per FMA.
void MatVecRows(const float* wt, const float* u, float* out, int64 jd, int64 K);
void MatVecRows(const double* wt, const double* u, double* out, int64 jd, int64 K);

// gu[k] = sum_r wt[k * jd + r] * g[r] and gwt[k * jd + r] += u[k] * g[r].
void GradRows(const float* wt, const float* g, const float* u, float* gu, float* gwt, int64 jd,
              int64 K);
void GradRows(const double* wt, const double* g, const double* u, double* gu, double* gwt,
              int64 jd, int64 K);

// W_i (JD x K, row-major) -> wt (K x JD) in the accumulation type.
template <typename T, typename A>
void TransposeCapsule(const T* W_i, A* wt, int64 jd, int64 K) {
  for (int64 r = 0; r < jd; ++r) {
    for (int64 k = 0; k < K; ++k) wt[k * jd + r] = static_cast<A>(W_i[r * K + k]);
  }
}

// ----------------------------------------------------------------------------
// The gradient's units are (in capsule, batch chunk) pairs. The batch is split
// into chunks only when there are too few capsules to use every thread; then
// each chunk's grad_W goes to its own slice of `partials` (GradPartialsSize()
// accumulation values) and ReduceGradW sums them in chunk order.
int64 GradChunks(const CapsuleDims& d);
inline int64 GradUnits(const CapsuleDims& d) { return d.in_caps * GradChunks(d); }
inline int64 GradPartialsSize(const CapsuleDims& d) {
  const int64 chunks = GradChunks(d);
  return chunks > 1 ? SizeMul(chunks, d.w_size()) : 0;  // -1: overflows int64
}

// Accumulation values of scratch one call of RunGradUnits needs (-1 if that
// overflows int64): wt and gwt (JD x K each), ub and gu (K each), g_row (JD).
inline int64 GradScratchSize(const CapsuleDims& d) {
  const int64 jd = SizeMul(d.out_caps, d.out_dim);
  return SizeAdd(SizeAdd(SizeMul(2, SizeMul(jd, d.in_dim)), SizeMul(2, d.in_dim)), jd);
}

// Runs gradient units [unit_begin, unit_end). `rows_of.Row(b, i, scratch)`
// returns grad_u_hat[b, i, :, :] as JD accumulation values (a pointer into the
// source, or `scratch` filled with them), so both ops' gradients share this
// body and differ only in where those rows come from. `scratch` holds
// GradScratchSize(d) values (the caller allocates it: an allocation failure is
// an error status there, not an exception here).
template <typename T, typename Rows>
void RunGradUnits(const Rows& rows_of, const T* u, const T* W, T* grad_u, T* grad_W,
                  Accumulator<T>* partials, const CapsuleDims& d, int64 unit_begin,
                  int64 unit_end, Accumulator<T>* scratch) {
  using A = Accumulator<T>;
  const int64 chunks = GradChunks(d);
  const int64 jd = d.rows_per_cap(), K = d.in_dim, I = d.in_caps;
  const int64 per_chunk = (d.batch + chunks - 1) / chunks;
  A* wt = scratch;
  A* gwt = wt + jd * K;
  A* ub = gwt + jd * K;
  A* gu = ub + K;
  A* g_row = gu + K;
  for (int64 unit = unit_begin; unit < unit_end; ++unit) {
    const int64 i = unit / chunks;
    const int64 chunk = unit - i * chunks;
    const int64 b_begin = std::min(d.batch, chunk * per_chunk);
    const int64 b_end = std::min(d.batch, b_begin + per_chunk);
    TransposeCapsule(W + i * jd * K, wt, jd, K);
    std::fill_n(gwt, jd * K, A(0));
    for (int64 b = b_begin; b < b_end; ++b) {
      const T* u_bi = u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) ub[k] = static_cast<A>(u_bi[k]);
      const A* g = rows_of.Row(b, i, g_row);
      GradRows(wt, g, ub, gu, gwt, jd, K);
      T* gu_bi = grad_u + (b * I + i) * K;
      for (int64 k = 0; k < K; ++k) gu_bi[k] = static_cast<T>(gu[k]);
    }
    // gwt (K x JD) back to grad_W's (JD x K) layout.
    if (chunks == 1) {
      T* dst = grad_W + i * jd * K;
      for (int64 r = 0; r < jd; ++r) {
        for (int64 k = 0; k < K; ++k) dst[r * K + k] = static_cast<T>(gwt[k * jd + r]);
      }
    } else {
      A* dst = partials + chunk * d.w_size() + i * jd * K;
      for (int64 r = 0; r < jd; ++r) {
        for (int64 k = 0; k < K; ++k) dst[r * K + k] = gwt[k * jd + r];
      }
    }
  }
}

// Sums the partials of capsules [cap_begin, cap_end) over chunks, in chunk
// order, into grad_W.
template <typename T>
void ReduceGradW(const Accumulator<T>* partials, T* grad_W, const CapsuleDims& d,
                 int64 cap_begin, int64 cap_end) {
  using A = Accumulator<T>;
  const int64 chunks = GradChunks(d);
  const int64 per_cap = d.rows_per_cap() * d.in_dim;
  for (int64 x = cap_begin * per_cap; x < cap_end * per_cap; ++x) {
    A s = A(0);
    for (int64 c = 0; c < chunks; ++c) s += partials[c * d.w_size() + x];
    grad_W[x] = static_cast<T>(s);
  }
}

// ----------------------------------------------------------------------------
// Whole ops on the CPU without TensorFlow, for the XLA host custom calls
// (xla_handlers.cc): the same units, in the same order, as the OpKernels, so
// their results are the OpKernels' bit for bit. T is float, double, Eigen::half
// or Eigen::bfloat16 (instantiated in prediction.cc and routing.cc). Each
// returns false when its scratch cannot be allocated (nothing is written then);
// empty outputs are the caller's to skip.

// Runs fn(part) for every part in [0, parts), in parallel where it can, and
// returns when all have run.
using PartsRunner = std::function<void(int64 parts, const std::function<void(int64)>& fn)>;

template <typename T>
bool CpuCapsulePrediction(const T* u, const T* W, T* u_hat, const CapsuleDims& d,
                          int64 max_parts, const PartsRunner& run);
template <typename T>
bool CpuCapsulePredictionGrad(const T* grad, const T* u, const T* W, T* grad_u, T* grad_W,
                              const CapsuleDims& d, int64 max_parts, const PartsRunner& run);
template <typename T>
bool CpuCapsuleRouting(const T* u, const T* W, T* s_j, T* c_ij, const CapsuleDims& d,
                       int iterations, bool leaky, int64 max_parts, const PartsRunner& run);
template <typename T>
bool CpuCapsuleRoutingGrad(const T* u, const T* W, const T* c_ij, const T* grad_s, T* grad_u,
                           T* grad_W, const CapsuleDims& d, int64 max_parts,
                           const PartsRunner& run);

// Heap scratch of `n` values, or nullptr when `n` overflowed (-1) or the
// allocation failed (an error for the caller, not an exception).
template <typename A>
std::unique_ptr<A[]> TryAllocate(int64 n) {
  if (n < 0) return nullptr;
  return std::unique_ptr<A[]>(new (std::nothrow) A[n > 0 ? n : 1]);
}

// Splits [0, units) into at most `max_parts` contiguous ranges and runs
// fn(part's scratch, begin, end) for each, every part with `per_part` scratch
// values of its own: the OpKernels' RunParts (tf_glue.h) on a PartsRunner.
template <typename A, typename Fn>
bool RunUnitsInParts(int64 units, int64 per_part, int64 max_parts, const PartsRunner& run,
                     Fn fn) {
  if (units <= 0) return true;
  const int64 parts = std::max<int64>(1, std::min(max_parts, units));
  std::unique_ptr<A[]> scratch = TryAllocate<A>(SizeMul(parts, per_part));
  if (scratch == nullptr) return false;
  const int64 per = units / parts, extra = units % parts;
  run(parts, [&](int64 p) {
    const int64 first = p * per + std::min(p, extra);
    fn(scratch.get() + p * per_part, first, first + per + (p < extra ? 1 : 0));
  });
  return true;
}

// Either op's gradient with grad_u_hat rows from `rows_of` (RunGradUnits), then
// the grad_W partials summed in chunk order when the batch was split: the
// OpKernels' RunCpuGrad (tf_glue.h) on a PartsRunner.
template <typename T, typename Rows>
bool CpuGrad(const Rows& rows_of, const T* u, const T* W, T* grad_u, T* grad_W,
             const CapsuleDims& d, int64 max_parts, const PartsRunner& run) {
  using A = Accumulator<T>;
  const int64 partials_size = GradPartialsSize(d);
  std::unique_ptr<A[]> partials;
  if (partials_size != 0) {
    partials = TryAllocate<A>(partials_size);
    if (partials == nullptr) return false;
  }
  if (!RunUnitsInParts<A>(GradUnits(d), GradScratchSize(d), max_parts, run,
                          [&](A* ws, int64 begin, int64 end) {
                            RunGradUnits(rows_of, u, W, grad_u, grad_W, partials.get(), d,
                                         begin, end, ws);
                          })) {
    return false;
  }
  if (partials != nullptr) {
    return RunUnitsInParts<A>(d.in_caps, 0, max_parts, run,
                              [&](A*, int64 begin, int64 end) {
                                ReduceGradW(partials.get(), grad_W, d, begin, end);
                              });
  }
  return true;
}

}  // namespace capsnet

#endif  // CAPSNET_OPS_CPU_KERNELS_H_

