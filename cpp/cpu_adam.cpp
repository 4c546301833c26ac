#include "cpu_adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>  // _mm_stream_si128: part of x86-64's baseline, no dispatch needed
#endif
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>  // AVX-512 intrinsics, used only in target("avx512...") functions
#endif

// Built with -ffp-contract=off (CMakeLists.txt): every fused multiply-add below is written out, none is
// added by the compiler. See [Note: AdamW op order] in cpu_adam.h.

// OFFLOAD_PORTABLE_ONLY builds what a non-x86 machine gets (for checking that path compiles).
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(OFFLOAD_PORTABLE_ONLY)
#define OFFLOAD_X86_DISPATCH 1
#else
#define OFFLOAD_X86_DISPATCH 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define OFFLOAD_ALWAYS_INLINE inline __attribute__((always_inline))
#define OFFLOAD_RESTRICT __restrict__
#else
#define OFFLOAD_ALWAYS_INLINE inline
#define OFFLOAD_RESTRICT
#endif

namespace offload {
namespace {

// --- scalar conversions (branch-free, so loops using them vectorise) ------------------------------

OFFLOAD_ALWAYS_INLINE std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

OFFLOAD_ALWAYS_INLINE float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

OFFLOAD_ALWAYS_INLINE float bf16_to_float(std::uint16_t h) { return float_of(std::uint32_t{h} << 16); }

// Exact. Subnormal halves go through an int-to-float conversion rather than an fp32 subnormal, so the
// result does not depend on the denormals-are-zero flag of the calling thread. (Written so that no value
// goes float -> int -> float: GCC 12 does not vectorise such chains.)
OFFLOAD_ALWAYS_INLINE float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t em = h & 0x7fffu;                    // exponent and mantissa
  const std::uint32_t normal = (em << 13) + 0x38000000u;   // rebias the exponent: 15 -> 127
  const std::uint32_t special = (em << 13) | 0x7f800000u;  // inf, nan (payload and quiet bit kept)
  const float finite = float_of(sign | (em >= 0x7c00u ? special : normal));
  const float magnitude = static_cast<float>(static_cast<std::int32_t>(em)) * 0x1p-24f;  // exact below 0x400
  const float subnormal = sign != 0 ? -magnitude : magnitude;
  return em < 0x0400u ? subnormal : finite;
}

// Round to nearest even; nan becomes the quiet nan 0x7fc0 (as c10::BFloat16 does).
OFFLOAD_ALWAYS_INLINE std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(nan ? 0x7fc0u : rounded);
}

// Round to nearest even, overflow to inf, nan to a quiet nan, subnormals exact.
OFFLOAD_ALWAYS_INLINE std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  // |f| in [2^-14, 65520): rebias the exponent (127 -> 15) and round away the 13 low mantissa bits; a
  // carry out of the mantissa correctly bumps the exponent. (Wraps for small a; those lanes take `sub`.)
  const std::uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // |f| < 2^-14: in 0.5 + |f| one ulp is 2^-24, the fp16 subnormal step, so the FPU's own
  // round-to-nearest-even leaves the rounded subnormal count in the low bits.
  const std::uint32_t sub = bits_of(std::fabs(f) + 0.5f) - 0x3f000000u;
  std::uint32_t h = a < 0x38800000u ? sub : normal;
  h = a >= 0x477ff000u ? 0x7c00u : h;  // 65520 and above (inf included) round to inf
  h = a > 0x7f800000u ? 0x7e00u : h;   // nan
  return static_cast<std::uint16_t>(sign | h);
}

template <ScalarType G>
OFFLOAD_ALWAYS_INLINE float load_grad(const void* grad, std::size_t i) {
  if constexpr (G == ScalarType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == ScalarType::kBFloat16) {
    return bf16_to_float(static_cast<const std::uint16_t*>(grad)[i]);
  } else {
    return fp16_to_float(static_cast<const std::uint16_t*>(grad)[i]);
  }
}

template <bool kFma>
OFFLOAD_ALWAYS_INLINE float madd(float a, float b, float c) {
  if constexpr (kFma) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;  // two roundings: -ffp-contract=off keeps it so
  }
}

// Per-call scalars, each computed in double and rounded to float once, as torch does with Python
// floats (see [Note: AdamW op order]).
struct Coeffs {
  float decay;
  float grad_scale;
  float w;            // lerp weight 1 - beta1
  float w_minus_1;    // w - 1, in float as torch computes it
  bool lerp_small;    // |w| < 0.5 picks torch's first lerp formula
  float beta2;
  float one_minus_beta2;
  float inv_bc2_sqrt;  // 1 / float(bc2_sqrt), rounded once: d multiplies by it (see [Note: AdamW op order])
  float eps;
  float neg_step_size;
};

Coeffs make_coeffs(const AdamWHyper& h) {
  Coeffs c{};
  const double step = static_cast<double>(h.step);
  c.decay = static_cast<float>(h.weight_decay != 0 ? 1.0 - h.lr * h.weight_decay : 1.0);
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.w = static_cast<float>(1.0 - h.beta1);
  c.w_minus_1 = c.w - 1.0f;
  c.lerp_small = std::fabs(c.w) < 0.5f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  // pow(x, 0.5), not sqrt(x): Python's `x ** 0.5` calls libm pow, and the two may differ in the last bit.
  const float bc2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(h.beta2, step), 0.5));
  c.inv_bc2_sqrt = 1.0f / bc2_sqrt;  // an IEEE float division: correctly rounded
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, step))));
  return c;
}

// Elements are processed in blocks that stay in L1: the grads of a block are first widened to fp32, then
// one loop does the fp32 arithmetic, then another rounds the new master to the low-precision copy. Each
// loop is simple enough that the compiler vectorises it for every dtype combination (one loop doing all
// three does not vectorise with GCC 12 when 16-bit types are involved), and no extra memory traffic
// results: the block buffers never leave L1.
constexpr std::size_t kBlock = 1024;

template <ScalarType G>
OFFLOAD_ALWAYS_INLINE void widen_grads(const void* OFFLOAD_RESTRICT grad, float grad_scale, std::size_t n,
                                       float* OFFLOAD_RESTRICT out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = load_grad<G>(grad, i) * grad_scale;
}

// Every coefficient is copied into a local first: a store through `param` could otherwise alias `c`
// in the compiler's eyes and block vectorisation.
template <bool kFma>
OFFLOAD_ALWAYS_INLINE void update_fp32(float* OFFLOAD_RESTRICT param, float* OFFLOAD_RESTRICT exp_avg,
                                       float* OFFLOAD_RESTRICT exp_avg_sq, const float* OFFLOAD_RESTRICT grad,
                                       std::size_t n, const Coeffs& c) {
  const float decay = c.decay, beta2 = c.beta2, one_minus_beta2 = c.one_minus_beta2;
  const float inv_bc2_sqrt = c.inv_bc2_sqrt, eps = c.eps, neg_step_size = c.neg_step_size;
  const bool small = c.lerp_small;
  const float coeff = small ? c.w : c.w_minus_1;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float p = param[i] * decay;
    const float m_old = exp_avg[i];
    const float m = madd<kFma>(coeff, g - m_old, small ? m_old : g);
    const float v = madd<kFma>(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);
    const float denom = std::sqrt(v) * inv_bc2_sqrt + eps;
    param[i] = p + (neg_step_size * m) / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

template <int kLowp>
OFFLOAD_ALWAYS_INLINE void round_to_lowp(const float* OFFLOAD_RESTRICT param, std::size_t n,
                                         std::uint16_t* OFFLOAD_RESTRICT out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = kLowp == 1 ? float_to_bf16(param[i]) : float_to_fp16(param[i]);
}

// Copies n 16-bit values with non-temporal stores where the CPU has them. The low-precision copy is
// only written here (the next host-to-device copy reads it), so a normal store would first read each
// line into the cache (2 more bytes of traffic per parameter) and evict data the update still needs.
OFFLOAD_ALWAYS_INLINE void stream_out(const std::uint16_t* OFFLOAD_RESTRICT src, std::size_t n,
                                      std::uint16_t* OFFLOAD_RESTRICT dst) {
  std::size_t i = 0;
#if defined(__SSE2__)
  while (i < n && (reinterpret_cast<std::uintptr_t>(dst + i) & 15u) != 0) dst[i] = src[i], ++i;
  for (; i + 8 <= n; i += 8) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

// The whole update of elements [begin, end).
template <bool kFma, ScalarType G, int kLowp>  // kLowp: 0 none, 1 bf16, 2 fp16
OFFLOAD_ALWAYS_INLINE void update_range(const AdamWBuffers& b, const Coeffs& c, std::size_t begin,
                                        std::size_t end) {
  constexpr std::size_t kGradBytes = G == ScalarType::kFloat32 ? 4 : 2;
  alignas(64) float grad_block[kBlock];
  alignas(64) std::uint16_t lowp_block[kBlock];
  for (std::size_t at = begin; at < end; at += kBlock) {
    const std::size_t n = std::min(kBlock, end - at);
    const float* grad = static_cast<const float*>(b.grad) + at;
    if (G != ScalarType::kFloat32 || c.grad_scale != 1.0f) {
      widen_grads<G>(static_cast<const char*>(b.grad) + at * kGradBytes, c.grad_scale, n, grad_block);
      grad = grad_block;
    }
    update_fp32<kFma>(b.param + at, b.exp_avg + at, b.exp_avg_sq + at, grad, n, c);
    if constexpr (kLowp != 0) {
      round_to_lowp<kLowp>(b.param + at, n, lowp_block);
      stream_out(lowp_block, n, static_cast<std::uint16_t*>(b.lowp_out) + at);
    }
  }
#if defined(__SSE2__)
  if constexpr (kLowp != 0) _mm_sfence();  // order the streamed stores before anyone is told we are done
#endif
}

// The memory traffic of update_range with no AdamW arithmetic: the same loads and stores, in the same
// blocks, with trivial operations. Its speed is the bandwidth bound for the kernel on this machine.
template <ScalarType G, int kLowp>
OFFLOAD_ALWAYS_INLINE void traffic_range(const AdamWBuffers& b, std::size_t begin, std::size_t end) {
  constexpr std::size_t kGradBytes = G == ScalarType::kFloat32 ? 4 : 2;
  alignas(64) float grad_block[kBlock];
  alignas(64) std::uint16_t lowp_block[kBlock];
  for (std::size_t at = begin; at < end; at += kBlock) {
    const std::size_t n = std::min(kBlock, end - at);
    widen_grads<G>(static_cast<const char*>(b.grad) + at * kGradBytes, 1.0f, n, grad_block);
    float* OFFLOAD_RESTRICT p = b.param + at;
    float* OFFLOAD_RESTRICT m = b.exp_avg + at;
    float* OFFLOAD_RESTRICT v = b.exp_avg_sq + at;
    for (std::size_t i = 0; i < n; ++i) {
      const float g = grad_block[i];
      const float pi = p[i], mi = m[i], vi = v[i];
      p[i] = pi + g;
      m[i] = mi + g;
      v[i] = vi + g;
    }
    if constexpr (kLowp != 0) {
      for (std::size_t i = 0; i < n; ++i) lowp_block[i] = static_cast<std::uint16_t>(bits_of(p[i]) >> 16);
      stream_out(lowp_block, n, static_cast<std::uint16_t*>(b.lowp_out) + at);
    }
  }
#if defined(__SSE2__)
  if constexpr (kLowp != 0) _mm_sfence();
#endif
}

// True when every grad * scale in [begin, end) is finite. An OR over integer flags, so it vectorises.
template <ScalarType G>
OFFLOAD_ALWAYS_INLINE bool finite_range(const void* grad, float grad_scale, std::size_t begin, std::size_t end) {
  std::uint32_t bad = 0;
  for (std::size_t i = begin; i < end; ++i) {
    const float g = load_grad<G>(grad, i) * grad_scale;
    bad |= static_cast<std::uint32_t>((bits_of(g) & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

using UpdateFn = void (*)(const AdamWBuffers&, const Coeffs&, std::size_t, std::size_t);
using FiniteFn = bool (*)(const void*, float, std::size_t, std::size_t);
using TrafficFn = void (*)(const AdamWBuffers&, std::size_t, std::size_t);

struct Kernels {
  UpdateFn update[3][3];    // [grad type][lowp: none, bf16, fp16]
  FiniteFn finite[3];       // [grad type]
  TrafficFn traffic[3][2];  // [grad type][lowp: none, some]
};

// One set of kernels per instruction set: the same source, compiled with that ISA's target attribute.
// FMA mirrors torch: its AVX2/AVX-512 kernels fuse, its baseline x86 kernels cannot (no FMA unit
// assumed); on other architectures torch's vector kernels fuse too.
#define OFFLOAD_KERNELS(NAME, ATTR, FMA)                                                                \
  template <ScalarType G, int kLowp>                                                                   \
  ATTR void update_##NAME(const AdamWBuffers& b, const Coeffs& c, std::size_t begin, std::size_t end) { \
    update_range<FMA, G, kLowp>(b, c, begin, end);                                                      \
  }                                                                                                    \
  template <ScalarType G>                                                                              \
  ATTR bool finite_##NAME(const void* g, float s, std::size_t begin, std::size_t end) {                 \
    return finite_range<G>(g, s, begin, end);                                                          \
  }                                                                                                    \
  template <ScalarType G, int kLowp>                                                                   \
  ATTR void traffic_##NAME(const AdamWBuffers& b, std::size_t begin, std::size_t end) {                 \
    traffic_range<G, kLowp>(b, begin, end);                                                            \
  }                                                                                                    \
  constexpr ScalarType kF32_##NAME = ScalarType::kFloat32, kBF16_##NAME = ScalarType::kBFloat16,        \
                       kF16_##NAME = ScalarType::kFloat16;                                             \
  const Kernels kKernels_##NAME = {                                                                    \
      {{update_##NAME<kF32_##NAME, 0>, update_##NAME<kF32_##NAME, 1>, update_##NAME<kF32_##NAME, 2>},   \
       {update_##NAME<kBF16_##NAME, 0>, update_##NAME<kBF16_##NAME, 1>, update_##NAME<kBF16_##NAME, 2>}, \
       {update_##NAME<kF16_##NAME, 0>, update_##NAME<kF16_##NAME, 1>, update_##NAME<kF16_##NAME, 2>}},  \
      {finite_##NAME<kF32_##NAME>, finite_##NAME<kBF16_##NAME>, finite_##NAME<kF16_##NAME>},            \
      {{traffic_##NAME<kF32_##NAME, 0>, traffic_##NAME<kF32_##NAME, 1>},                                  \
       {traffic_##NAME<kBF16_##NAME, 0>, traffic_##NAME<kBF16_##NAME, 1>},                                \
       {traffic_##NAME<kF16_##NAME, 0>, traffic_##NAME<kF16_##NAME, 1>}}};

#if OFFLOAD_X86_DISPATCH
OFFLOAD_KERNELS(baseline, , false)
OFFLOAD_KERNELS(avx2, __attribute__((target("avx2,fma"))), true)
OFFLOAD_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), true)
#else
OFFLOAD_KERNELS(baseline, , true)
#endif

#undef OFFLOAD_KERNELS

#if OFFLOAD_X86_DISPATCH
// [Note: fused AVX-512 loop]
// With AVX-512, fp32/bf16 grads and no copy or a bf16 copy, the update is one loop of intrinsics over
// 16 elements at a time: widen, update and round without the L1 round trip of the three-loop blocks
// above (GCC does not vectorise the fused scalar loop), and the bf16 copy leaves through 32-byte
// non-temporal stores. The operations are exactly those of update_range (same order, same explicit
// fma, IEEE sqrt, multiply by the reciprocal and division), so the results are bitwise the same.
// Unaligned heads and the tail go through update_range.
// The loop also prefetches each input stream kPrefetch elements ahead into L1. On the 2-core Xeon this
// was measured on (standalone harness, per-thread CPU time, 50M elements, machine load 2.5-4), the
// hardware prefetchers alone kept too few lines in flight: with the prefetch the loop ran 5-13 % faster,
// and the bound loop below, which prefetches the same way, 5-10 % faster (so the bound stays the fastest
// way to move these bytes). 128 to 512 elements ahead were within noise of each other; a prefetch to L2
// only, prefetchw, unrolling by 2 and non-temporal stores for master/m/v were slower or no better.
// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (_mm512_undefined_epi32) when inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define OFFLOAD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

constexpr std::size_t kPrefetch = 256;  // elements: 1 KiB ahead in each fp32 stream

// The number of elements from `at` that the scalar block code takes before the fused loop: up to the first
// element whose 16-bit copy address is 32-byte aligned (for the streamed stores), or all of [at, end) when
// the copy is at an odd address and can never be aligned. 0 without a copy.
template <int kLowp>
OFFLOAD_ALWAYS_INLINE std::size_t fused_head(const AdamWBuffers& b, std::size_t at, std::size_t end) {
  if constexpr (kLowp == 0) {
    return 0;
  } else {
    const auto* out = static_cast<const std::uint16_t*>(b.lowp_out);
    std::size_t head = 0;
    while (at + head < end && (reinterpret_cast<std::uintptr_t>(out + at + head) & 31u) != 0) ++head;
    if ((reinterpret_cast<std::uintptr_t>(out + at + head) & 1u) != 0) head = end - at;
    return head;
  }
}

// Prefetches the lines kPrefetch elements past element i of every input stream: one line of each fp32
// stream per 16 elements, and of a bf16 grad on every other call (`odd`: the loop's odd iterations skip
// it). Prefetches past the end are harmless: a prefetch never faults.
template <ScalarType G>
OFFLOAD_AVX512 OFFLOAD_ALWAYS_INLINE void prefetch_ahead(const AdamWBuffers& b, std::size_t i, bool odd) {
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i + kPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i + kPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i + kPrefetch), _MM_HINT_T0);
  if constexpr (G == ScalarType::kFloat32) {
    _mm_prefetch(reinterpret_cast<const char*>(static_cast<const float*>(b.grad) + i + kPrefetch), _MM_HINT_T0);
  } else {
    if (!odd) {
      _mm_prefetch(reinterpret_cast<const char*>(static_cast<const std::uint16_t*>(b.grad) + i + kPrefetch),
                   _MM_HINT_T0);
    }
  }
}

template <ScalarType G>
OFFLOAD_AVX512 OFFLOAD_ALWAYS_INLINE __m512 load_grad16(const void* grad, std::size_t i) {
  if constexpr (G == ScalarType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(grad) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <ScalarType G, int kLowp, bool kScale>
OFFLOAD_AVX512 void update_avx512_fused(const AdamWBuffers& b, const Coeffs& c, std::size_t begin, std::size_t end) {
  static_assert(G == ScalarType::kFloat32 || G == ScalarType::kBFloat16, "fp16 grads take update_range");
  static_assert(kLowp == 0 || kLowp == 1, "fp16 copies take update_range");
  constexpr std::size_t kLanes = 16;
  const std::size_t head = fused_head<kLowp>(b, begin, end);
  if (head > 0) update_range<true, G, kLowp>(b, c, begin, begin + head);
  const std::size_t at = begin + head;
  const std::size_t vec_end = at + (end - at) / kLanes * kLanes;
  const __m512 decay = _mm512_set1_ps(c.decay), grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 beta2 = _mm512_set1_ps(c.beta2), one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 inv_bc2_sqrt = _mm512_set1_ps(c.inv_bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const bool small = c.lerp_small;
  const __m512 coeff = _mm512_set1_ps(small ? c.w : c.w_minus_1);
  const __m512i round_bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i qnan = _mm512_set1_epi32(0x7fc0);
  for (std::size_t i = at; i < vec_end; i += kLanes) {
    prefetch_ahead<G>(b, i, ((i - at) & kLanes) != 0);
    __m512 g = load_grad16<G>(b.grad, i);
    if constexpr (kScale) g = _mm512_mul_ps(g, grad_scale);
    const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(b.param + i), decay);
    const __m512 m_old = _mm512_loadu_ps(b.exp_avg + i);
    const __m512 m = _mm512_fmadd_ps(coeff, _mm512_sub_ps(g, m_old), small ? m_old : g);
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g,
                                     _mm512_mul_ps(_mm512_loadu_ps(b.exp_avg_sq + i), beta2));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), inv_bc2_sqrt), eps);
    const __m512 p_new = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    _mm512_storeu_ps(b.param + i, p_new);
    _mm512_storeu_ps(b.exp_avg + i, m);
    _mm512_storeu_ps(b.exp_avg_sq + i, v);
    if constexpr (kLowp == 1) {
      const __m512i u = _mm512_castps_si512(p_new);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, round_bias), lsb), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf_bits);
      r = _mm512_mask_blend_epi32(nan, r, qnan);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(b.lowp_out) + i),
                          _mm512_cvtepi32_epi16(r));
    }
  }
  if (vec_end < end) update_range<true, G, kLowp>(b, c, vec_end, end);
  if constexpr (kLowp != 0) _mm_sfence();
}

template <ScalarType G, int kLowp>
OFFLOAD_AVX512 void update_avx512_fused_entry(const AdamWBuffers& b, const Coeffs& c, std::size_t begin,
                                              std::size_t end) {
  if (G != ScalarType::kFloat32 || c.grad_scale != 1.0f) {
    update_avx512_fused<G, kLowp, true>(b, c, begin, end);
  } else {
    update_avx512_fused<G, kLowp, false>(b, c, begin, end);
  }
}

// The traffic of update_avx512_fused (same loads, stores, prefetches and loop; trivial arithmetic), for the
// bound.
template <ScalarType G, int kLowp>
OFFLOAD_AVX512 void traffic_avx512_fused(const AdamWBuffers& b, std::size_t begin, std::size_t end) {
  constexpr std::size_t kLanes = 16;
  const std::size_t head = fused_head<kLowp>(b, begin, end);
  if (head > 0) traffic_range<G, kLowp>(b, begin, begin + head);
  const std::size_t at = begin + head;
  const std::size_t vec_end = at + (end - at) / kLanes * kLanes;
  for (std::size_t i = at; i < vec_end; i += kLanes) {
    prefetch_ahead<G>(b, i, ((i - at) & kLanes) != 0);
    const __m512 g = load_grad16<G>(b.grad, i);
    const __m512 p = _mm512_add_ps(_mm512_loadu_ps(b.param + i), g);
    _mm512_storeu_ps(b.param + i, p);
    _mm512_storeu_ps(b.exp_avg + i, _mm512_add_ps(_mm512_loadu_ps(b.exp_avg + i), g));
    _mm512_storeu_ps(b.exp_avg_sq + i, _mm512_add_ps(_mm512_loadu_ps(b.exp_avg_sq + i), g));
    if constexpr (kLowp == 1) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(b.lowp_out) + i),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    }
  }
  if (vec_end < end) traffic_range<G, kLowp>(b, vec_end, end);
  if constexpr (kLowp != 0) _mm_sfence();
}

#undef OFFLOAD_AVX512
#pragma GCC diagnostic pop

Kernels make_avx512_kernels() {
  Kernels k = kKernels_avx512;
  k.update[0][0] = update_avx512_fused_entry<ScalarType::kFloat32, 0>;
  k.update[0][1] = update_avx512_fused_entry<ScalarType::kFloat32, 1>;
  k.update[1][0] = update_avx512_fused_entry<ScalarType::kBFloat16, 0>;
  k.update[1][1] = update_avx512_fused_entry<ScalarType::kBFloat16, 1>;
  // The bound is the fused loop's traffic for fp32/bf16 grads, with either 16-bit copy (same bytes);
  // for an fp16 copy, which the block loop writes, that is a stricter bound than the block loop's own.
  k.traffic[0][0] = traffic_avx512_fused<ScalarType::kFloat32, 0>;
  k.traffic[0][1] = traffic_avx512_fused<ScalarType::kFloat32, 1>;
  k.traffic[1][0] = traffic_avx512_fused<ScalarType::kBFloat16, 0>;
  k.traffic[1][1] = traffic_avx512_fused<ScalarType::kBFloat16, 1>;
  return k;
}
const Kernels kKernels_avx512_fused = make_avx512_kernels();
#endif

bool cpu_has(const char* isa) {
#if OFFLOAD_X86_DISPATCH
  __builtin_cpu_init();
  const std::string name = isa;
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  if (name == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::string(isa) == "baseline";
}

const char* best_isa() {
  static const char* const best = cpu_has("avx512") ? "avx512" : cpu_has("avx2") ? "avx2" : "baseline";
  return best;
}

const Kernels& kernels_for(const std::string& isa) {
#if OFFLOAD_X86_DISPATCH
  if (isa == "avx512") return kKernels_avx512_fused;
  if (isa == "avx2") return kKernels_avx2;
#endif
  (void)isa;
  return kKernels_baseline;
}

int type_index(ScalarType t) { return static_cast<int>(t); }

// [Note: work split under contention]
// parallel_runs cuts [0, n) into chunks, several per worker, and hands them out dynamically: a worker takes
// the next chunk when it is done with its last. One equal run per worker (the split before issue 18) made
// the whole update wait for its slowest worker, and inside a training step one worker shares a core with
// autograd's or the launching thread (H200 runs 5, 7, 8: the lane reached 2.9-4.2e9 params/s where the
// kernel alone does 5.2e9). A slowed worker now takes fewer chunks. Measured on a 2-vCPU VM beside a busy
// core (benchmarks/cpu_adam.py --contend; benchmarks/results/cpu-2026-11-27/README.md): 1.00-1.16x at 32 Mi
// elements on 2 threads, within that machine's noise at 1-4 Mi. What the split cannot help: a worker that is
// not running when a region starts holds it up all the same (every worker passes the region's barrier);
// there libgomp's wait policy mattered far more (12 ms against 0.6 ms for 1 Mi with OMP_WAIT_POLICY=passive).
// - Up to kChunksPerWorker chunks per worker, so the others wait for the last chunk of a slowed worker, not
//   for its whole share. The count of chunks is a multiple of the workers, so that equally fast workers
//   still finish together, as with one run each.
// - A chunk is at least kMinChunk elements (128 KiB of each fp32 stream, ~0.9 MiB of traffic): long enough
//   to stream. Measured on the 2-vCPU EPYC VM (chunk size forced in a throwaway build, 32 Mi elements,
//   2 threads, no spinner, load 0.9-2.0, medians of 31-61, one to three runs): against one run per worker,
//   chunks of 4 Ki elements cost 10 %, 16 Ki 3-12 %, 32 Ki -2 to +5 %, 64 Ki to 1 Mi -8 to +2 % (the noise
//   of this shared machine).
// - Borders are multiples of a cache line of fp32 (16 elements), as before: no two workers write one line
//   of master, m or v, and the fused AVX-512 loop's 32-byte alignment of the 16-bit copy is the same in
//   every chunk as in the whole buffer.
// - The update is element-wise, so the split cannot change a result: every element is computed by the same
//   instructions whichever worker takes it (tests/host/test_cpu_adam.py: test_split_into_chunks_*, bit for
//   bit against the reference on 1, 2, 3 and 7 threads). The finite check sets one atomic flag.
// - Small inputs stay on the calling thread, as before: below ~32 Ki elements a worker (about 1 MB of
//   traffic) waking a thread costs more than it saves.
// OFFLOAD_CPU_ADAM_STATIC_SPLIT=1 in the environment brings back the old split (one run per worker,
// schedule(static, 1)); it exists only so that benchmarks/cpu_adam.py --contend can time both in one
// process, and is read on every call (a getenv: well under a microsecond).
constexpr std::size_t kMinPerWorker = std::size_t{1} << 15;
constexpr std::size_t kChunksPerWorker = 8;
constexpr std::size_t kMinChunk = std::size_t{1} << 15;
constexpr std::size_t kLine = 16;  // fp32 elements per 64-byte cache line

struct Split {
  std::size_t workers;  // threads the loop runs on (1: the calling thread alone)
  std::size_t chunk;    // elements per chunk (a multiple of kLine), the last chunk may be shorter
  std::size_t chunks;   // ceil(n / chunk)
  bool legacy;          // the old split: one run per worker, statically assigned
};

bool static_split_requested() {
  const char* env = std::getenv("OFFLOAD_CPU_ADAM_STATIC_SPLIT");
  return env != nullptr && env[0] == '1';
}

Split split_of(std::size_t n, int num_threads) {
  const std::size_t workers = std::min<std::size_t>(static_cast<std::size_t>(num_threads),
                                                    std::max<std::size_t>(1, n / kMinPerWorker));
  const bool legacy = static_split_requested();
  // A multiple of the workers: equally fast workers then finish together, as with one run each.
  const std::size_t per_worker = legacy ? 1 : std::clamp<std::size_t>(n / (workers * kMinChunk), 1, kChunksPerWorker);
  const std::size_t parts = workers * per_worker;
  const std::size_t chunk = ((n + parts - 1) / parts + kLine - 1) / kLine * kLine;
  return Split{workers, chunk, chunk == 0 ? 0 : (n + chunk - 1) / chunk, legacy};
}

// Calls fn(begin, end) on every chunk of split_of(n, num_threads), on up to that many OpenMP threads (see
// [Note: work split under contention]).
template <typename Fn>
void parallel_runs(std::size_t n, int num_threads, Fn&& fn) {
  const Split s = split_of(n, num_threads);
#ifdef _OPENMP
  if (s.workers > 1) {
    const long count = static_cast<long>(s.chunks);
    const int workers = static_cast<int>(s.workers);
    if (s.legacy) {
#pragma omp parallel for num_threads(workers) schedule(static, 1)
      for (long c = 0; c < count; ++c) {
        const std::size_t begin = static_cast<std::size_t>(c) * s.chunk;
        fn(begin, std::min(n, begin + s.chunk));
      }
    } else {
#pragma omp parallel for num_threads(workers) schedule(dynamic, 1)
      for (long c = 0; c < count; ++c) {
        const std::size_t begin = static_cast<std::size_t>(c) * s.chunk;
        fn(begin, std::min(n, begin + s.chunk));
      }
    }
    return;
  }
#endif
  fn(std::size_t{0}, n);
}

void validate(const AdamWBuffers& b, const AdamWHyper& h, int num_threads, const std::string& isa) {
  if (b.numel > 0 && (b.param == nullptr || b.exp_avg == nullptr || b.exp_avg_sq == nullptr || b.grad == nullptr)) {
    throw std::invalid_argument("adamw_step: param, grad, exp_avg and exp_avg_sq must not be null");
  }
  if (b.lowp_out != nullptr && b.lowp_type != ScalarType::kBFloat16 && b.lowp_type != ScalarType::kFloat16) {
    throw std::invalid_argument("adamw_step: the low-precision copy must be bf16 or fp16");
  }
  if (type_index(b.grad_type) < 0 || type_index(b.grad_type) > 2) {
    throw std::invalid_argument("adamw_step: grad must be fp32, bf16 or fp16");
  }
  if (h.step < 1) throw std::invalid_argument("adamw_step: step must be >= 1, got " + std::to_string(h.step));
  if (num_threads < 1) {
    throw std::invalid_argument("adamw_step: num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  if (isa != "auto" && !cpu_has(isa.c_str())) {
    throw std::invalid_argument("adamw_step: instruction set '" + isa +
                                "' is not available on this CPU or build (have: " + best_isa() + ")");
  }
}

}  // namespace

bool adamw_step(const AdamWBuffers& buffers, const AdamWHyper& hyper, bool check_finite, int num_threads) {
  return adamw_step(buffers, hyper, check_finite, num_threads, "auto");
}

namespace {

// The body of adamw_step once its arguments are checked: shared by adamw_step and adamw_step_segments, so that
// the two run the same code on every range.
bool run_checked(const AdamWBuffers& buffers, const Coeffs& coeffs, const Kernels& k, bool check_finite,
                 int num_threads) {
  if (buffers.numel == 0) return false;
  const int g = type_index(buffers.grad_type);

  if (check_finite) {
    // A separate pass: nothing may be written unless every grad is finite. One flag for all chunks; a chunk
    // taken after a bad one was found is not read (the answer is known).
    const FiniteFn finite = k.finite[g];
    std::atomic<bool> found_bad{false};
    parallel_runs(buffers.numel, num_threads, [&](std::size_t begin, std::size_t end) {
      if (found_bad.load(std::memory_order_relaxed)) return;
      if (!finite(buffers.grad, coeffs.grad_scale, begin, end)) found_bad.store(true, std::memory_order_relaxed);
    });
    if (found_bad.load(std::memory_order_relaxed)) return true;
  }

  const int lowp = buffers.lowp_out == nullptr ? 0 : buffers.lowp_type == ScalarType::kBFloat16 ? 1 : 2;
  const UpdateFn update = k.update[g][lowp];
  parallel_runs(buffers.numel, num_threads,
                [&](std::size_t begin, std::size_t end) { update(buffers, coeffs, begin, end); });
  return false;
}

AdamWBuffers buffers_of(const AdamWSegment& s, ScalarType grad_type, ScalarType lowp_type) {
  AdamWBuffers b;
  b.param = s.param;
  b.exp_avg = s.exp_avg;
  b.exp_avg_sq = s.exp_avg_sq;
  b.grad = s.grad;
  b.grad_type = grad_type;
  b.lowp_out = s.lowp_out;
  b.lowp_type = lowp_type;
  b.numel = s.numel;
  return b;
}

}  // namespace

bool adamw_step(const AdamWBuffers& buffers, const AdamWHyper& hyper, bool check_finite, int num_threads,
                const std::string& isa) {
  validate(buffers, hyper, num_threads, isa);
  if (buffers.numel == 0) return false;
  const Kernels& k = kernels_for(isa == "auto" ? best_isa() : isa);
  return run_checked(buffers, make_coeffs(hyper), k, check_finite, num_threads);
}

std::int64_t adamw_step_segments(const AdamWSegment* segments, std::size_t count, const AdamWHyper* hypers,
                                 std::size_t n_hypers, ScalarType grad_type, ScalarType lowp_type, bool check_finite,
                                 int num_threads, const std::string& isa) {
  if (count > 0 && (segments == nullptr || hypers == nullptr || n_hypers == 0)) {
    throw std::invalid_argument("adamw_step_segments: segments and hypers must not be null");
  }
  for (std::size_t i = 0; i < count; ++i) {  // every argument before anything is written
    if (segments[i].hyper >= n_hypers) {
      throw std::invalid_argument("adamw_step_segments: segment " + std::to_string(i) + " names hyper " +
                                  std::to_string(segments[i].hyper) + " of " + std::to_string(n_hypers));
    }
    validate(buffers_of(segments[i], grad_type, lowp_type), hypers[segments[i].hyper], num_threads, isa);
  }
  if (count == 0) return -1;
  const Kernels& k = kernels_for(isa == "auto" ? best_isa() : isa);
  // Each hyper's coefficients once (a few pow calls each), not once a segment.
  std::vector<Coeffs> coeffs;
  coeffs.reserve(n_hypers);
  for (std::size_t h = 0; h < n_hypers; ++h) coeffs.push_back(make_coeffs(hypers[h]));
  for (std::size_t i = 0; i < count; ++i) {
    const AdamWSegment& s = segments[i];
    if (run_checked(buffers_of(s, grad_type, lowp_type), coeffs[s.hyper], k, check_finite, num_threads)) {
      return static_cast<std::int64_t>(i);
    }
  }
  return -1;
}

void adamw_memory_traffic(const AdamWBuffers& buffers, int num_threads) {
  validate(buffers, AdamWHyper{}, num_threads, "auto");
  if (buffers.numel == 0) return;
  const TrafficFn traffic =
      kernels_for(best_isa()).traffic[type_index(buffers.grad_type)][buffers.lowp_out == nullptr ? 0 : 1];
  parallel_runs(buffers.numel, num_threads, [&](std::size_t begin, std::size_t end) { traffic(buffers, begin, end); });
}

const char* adamw_isa() { return best_isa(); }

bool adamw_has_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace offload
